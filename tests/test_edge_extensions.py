"""Extensions a modern relay offers (8BITMIME, SMTPUTF8, PIPELINING, ENHANCEDSTATUSCODES, DSN, SIZE) and the
Received header (RFC 5321 §4.4) the edge puts in front of every message it queues. Daemon and real edge
over loopback sockets."""

from __future__ import annotations

import datetime as dt
import email.utils
import re
import smtplib

from edgekit import HOST, RawClient, codes, edge_relay, run_edge
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.edge.trace import _clean_helo, _date, address_literal, protocol_name, received_header

RECEIVED = re.compile(
    rb"^Received: from (?P<helo>\S+) \((?P<ip>\[[^\]]+\])\)\r\n"
    rb"\tby (?P<by>\S+) \(mtaq\) with (?P<proto>[A-Z0-9]+)(?:;)?\r\n"
    rb"\t(?:for <(?P<rcpt>[^>]+)>; )?(?P<date>[^\r\n]+)\r\n"
)


def test_the_daemon_advertises_the_extensions_of_a_modern_relay(tmp_path):
    """EHLO lists SIZE (the configured limit), 8BITMIME, SMTPUTF8, PIPELINING, ENHANCEDSTATUSCODES, DSN and
    FUTURERELEASE; the greeting names the host and says ESMTP."""
    with edge_relay(tmp_path, config="message_size_limit_bytes = 2000000\n") as r, RawClient(r.port) as c:
        assert f"220 {HOST} ESMTP mtaq" == c.reply()
        lines = c.command("EHLO client.test").split("\n")
    assert [f"250-{HOST}", "250-SIZE 2000000", "250-8BITMIME", "250-SMTPUTF8", "250-PIPELINING",
            "250-ENHANCEDSTATUSCODES", "250-DSN"] == lines[:7]
    # RFC 4865: the maximum interval (delay_max_s, 7 days by default) and the latest date-time it allows.
    assert re.fullmatch(r"250-FUTURERELEASE 604800 \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", lines[7]), lines[7]
    assert ["250 HELP"] == lines[8:]


def test_every_relayed_message_gets_one_received_header_first_in_the_log_and_at_the_next_hop(tmp_path):
    """The daemon prepends 'Received: from HELO ([ip]) by host (mtaq) with ESMTP for <rcpt>; date' (UTC, an
    RFC 5322 date near now); the sink receives the message with that header first and the body intact."""
    msg = b"From: a@example.org\r\nSubject: trace\r\nMessage-ID: <trace@test>\r\n\r\nbody\r\n"
    with edge_relay(tmp_path) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            s.ehlo("client.example")
            assert {} == s.sendmail("a@example.org", ["b@example.net"], msg)
        [stored] = r.wait_for(r.sink_messages, "delivery")
    head, _, rest = stored.partition(b"Received: ")
    assert head.startswith(b"Return-Path: <a@example.org>\r\n")  # the sink's own lines come before ours
    m = RECEIVED.match(b"Received: " + rest)
    assert m is not None, rest[:300]
    assert (b"client.example", b"[127.0.0.1]", HOST.encode(), b"ESMTP", b"b@example.net") == m.group(
        "helo", "ip", "by", "proto", "rcpt")
    when = email.utils.parsedate_to_datetime(m.group("date").decode())
    assert "UTC" == when.tzname() or when.utcoffset().total_seconds() == 0
    assert rest[m.end() - len(b"Received: "):] == msg


def test_received_header_forms_helo_several_recipients_smtputf8(tmp_path):
    """HELO gives 'with SMTP'; two recipients give no 'for' clause; SMTPUTF8 gives 'with UTF8SMTP' and a UTF-8
    address is taken as it is; a HELO with odd characters cannot break the header."""
    with run_edge(tmp_path, clock_ts=1700000000.0) as edge:
        with edge.client() as s:
            s.helo("we(ird)\\name")
            assert {} == s.sendmail("a@example.org", ["b@example.net", "c@example.net"], b"Subject: 1\r\n\r\nx\r\n")
        with edge.client() as s:
            s.ehlo("client.test")
            assert {} == s.sendmail("ü@bücher.example", ["ö@bücher.example"], b"Subject: 2\r\n\r\nx\r\n",
                                    mail_options=["SMTPUTF8", "BODY=8BITMIME"])
        (_, first), (env2, second) = edge.messages()
    assert first.startswith(b"Received: from we?ird??name ([127.0.0.1])\r\n\tby mx.test (mtaq) with SMTP;\r\n"
                            b"\tTue, 14 Nov 2023 22:13:20 +0000\r\nSubject: 1\r\n")
    assert second.startswith("Received: from client.test ([127.0.0.1])\r\n\tby mx.test (mtaq) with UTF8SMTP\r\n"
                             "\tfor <ö@bücher.example>; Tue, 14 Nov 2023 22:13:20 +0000\r\nSubject: 2\r\n".encode())
    assert "ü@bücher.example" == env2.sender
    assert {("SMTPUTF8", ""), ("BODY", "8BITMIME")} <= set(env2.mail_params)  # passed on to the next hop


def test_pipelined_transactions_are_answered_in_order(tmp_path):
    """PIPELINING (RFC 2920): EHLO, MAIL, RCPT x2, DATA sent in one packet, then the message and a second
    transaction with QUIT in another: every reply comes, in order, and both messages are queued."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        c.reply()
        c.send(b"EHLO client.test\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\n"
               b"RCPT TO:<c@example.net>\r\nDATA\r\n")
        assert [250, (250, "2.1.0"), (250, "2.1.5"), (250, "2.1.5"), (354, "")] == [
            250 if r.startswith("250-") else codes(r) for r in (c.reply() for _ in range(5))]
        c.send(b"Subject: p1\r\n\r\none\r\n.\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<d@example.net>\r\nDATA\r\n"
               b"Subject: p2\r\n\r\ntwo\r\n.\r\nQUIT\r\n")
        replies = [codes(c.reply()) for _ in range(6)]
        assert c.closed()
        messages = edge.messages()
    assert [(250, "2.0.0"), (250, "2.1.0"), (250, "2.1.5"), (354, ""), (250, "2.0.0"), (221, "2.0.0")] == replies
    assert [["b@example.net", "c@example.net"], ["d@example.net"]] == [
        [r.address for r in env.recipients] for env, _ in messages]


def test_trace_helpers():
    """Address literals per RFC 5321 §4.1.3 and protocol names per RFC 3848 / RFC 6531 §3.7.3."""
    assert ["[192.0.2.1]", "[IPv6:2001:db8::1]", "[192.0.2.1]", "[unknown]"] == [
        address_literal(a) for a in ("192.0.2.1", "2001:db8::1", "::ffff:192.0.2.1", "")]
    names = [protocol_name(extended=e, tls=t, authenticated=a, smtputf8=u)
             for e, t, a, u in [(False, False, False, False), (True, False, False, False), (True, True, False, False),
                                (True, True, True, False), (True, False, True, False), (True, True, True, True)]]
    assert ["SMTP", "ESMTP", "ESMTPS", "ESMTPSA", "ESMTPA", "UTF8SMTPSA"] == names


def test_the_received_date_is_the_rfc5322_date_of_that_second_also_when_reused():
    """The date is formatted once a second (issue 15.4); each header still carries its own second's date."""
    for ts in [0.0, 1700000000.0, 1700000000.4999999, 1700000000.9999996, 1700000001.0, 1700000000.2, 4e9 + 0.75]:
        header = received_header(helo="c.test", client_ip="192.0.2.1", hostname=HOST, protocol="ESMTP",
                                 recipients=["a@b.test"], when_ts=ts)
        date = email.utils.format_datetime(dt.datetime.fromtimestamp(ts, dt.UTC))
        assert header.endswith(f"; {date}\r\n".encode())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0, max_value=4e9, allow_nan=False).map(lambda t: [t]),
                          # around the edge of a second: its previous second first, then just below the edge
                          # (which datetime rounds up into the next second), then the edge itself and above
                          st.integers(min_value=1, max_value=1_000_000_000).map(
                              lambda s: [s - 0.5, s - 3e-7, s - 6e-7, s, s + 3e-7, s + 0.5])),
                min_size=1, max_size=10).map(lambda runs: [t for run in runs for t in run]))
def test_the_received_date_of_any_sequence_of_times_is_that_times_second(times):
    """The date formatted once a second and reused holds for every time of that second, also just around a
    second's edge where datetime rounds to the microsecond (the cache keeps a microsecond away from it)."""

    for ts in times:
        assert email.utils.format_datetime(dt.datetime.fromtimestamp(ts, dt.UTC).replace(microsecond=0)) == _date(ts)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from([*"ab.-()\\ !~\x7f\x00", "é", "\udc80", "\u2028"]), max_size=300))
def test_the_helo_in_the_received_header_keeps_printable_ascii_but_comment_characters(helo):
    """_clean_helo (a regex) gives what the character walk gave: printable ASCII but ( ) \\ kept, the rest ?."""

    walked = "".join(c if "!" <= c <= "~" and c not in "()\\" else "?" for c in helo[:255]) or "unknown"
    assert walked == _clean_helo(helo)
