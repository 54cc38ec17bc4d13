"""SMTP smuggling closed: only CRLF.CRLF ends DATA; bare CR/LF is refused (default) or made CRLF.

aiosmtpd 1.4.6 splits DATA on CRLF only and ends it only at a line that is exactly ".CRLF", but passes a
bare CR or LF into the content, where a next hop that takes LF as a line end could see an end of data and
a second message. mtaq reads DATA itself (mtaq.edge.smtp) and refuses such content with
"550 5.5.2 ... bare <LF> received" and a disconnect, or, with smtp_bare_newline = "normalize", turns each
bare CR or LF into CRLF, so that what is relayed is one message whatever the bytes.

Raw sockets against the real edge (real log), swaks --no-data-fixup against the daemon, and the daemon's
delivery to a real sink.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from edgekit import HOST, codes, edge_relay, run_edge

from mtaq.edge.policy import EdgePolicy

SECOND = (b"MAIL FROM:<evil@attacker.test>\r\nRCPT TO:<victim@example.net>\r\nDATA\r\n"
          b"From: ceo@example.org\r\nSubject: smuggled\r\n\r\nsecond message\r\n")
# A would-be end of data that is not CRLF . CRLF, then a whole second transaction, then the real end.
# Each with the first bare character in it, as the refusal names it.
FAKE_ENDS = [(b"\n.\r\n", "<LF>"), (b"\n.\n", "<LF>"), (b"\r.\r\n", "<CR>"), (b"\r\n.\r", "<CR>"), (b"\r\n.\n", "<LF>"),
             (b"\r.\r", "<CR>"), (b"\n.\r", "<LF>"), (b"\r.\n", "<CR>"), (b"\r\n.\r\r\n", "<CR>"), (b"\n\n.\n\n", "<LF>")]
FIRST = b"From: a@example.org\r\nSubject: first\r\n\r\nfirst message"


def smuggle(edge, fake_end: bytes) -> list[str]:
    """One transaction whose data hides a second one behind ``fake_end``; every reply until the server
    closes or QUIT is answered."""
    replies = []
    with edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        c.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n" + FIRST + fake_end + SECOND
               + b".\r\nQUIT\r\n")
        while reply := c.reply():
            replies.append(reply)
    return replies


@pytest.mark.parametrize(("fake_end", "bare"), FAKE_ENDS, ids=[repr(f) for f, _ in FAKE_ENDS])
def test_fake_end_of_data_with_bare_newlines_is_refused_and_nothing_is_queued(tmp_path, fake_end, bare):
    """Default (reject): the message is refused with 550 5.5.2 after the real end of data, the connection
    is closed (the pipelined QUIT is never answered), and nothing at all is queued."""
    with run_edge(tmp_path) as edge:
        replies = smuggle(edge, fake_end)
        assert [] == edge.messages()
    assert ["250 2.1.0 Ok", "250 2.1.5 Ok", "354 End data with <CR><LF>.<CR><LF>",
            f"550 5.5.2 {HOST} Error: bare {bare} received"] == replies


@pytest.mark.parametrize("fake_end", [f for f, _ in FAKE_ENDS], ids=repr)
def test_fake_end_of_data_under_normalize_is_one_message_with_crlf_only(tmp_path, fake_end):
    """normalize: one 250 for one message that holds the would-be second transaction as text; its content
    has CRLF line ends only; the session goes on (QUIT answered)."""
    with run_edge(tmp_path, EdgePolicy(bare_newline="normalize")) as edge:
        replies = smuggle(edge, fake_end)
        messages = edge.messages()
    assert ["250 2.1.0 Ok", "250 2.1.5 Ok", "354 End data with <CR><LF>.<CR><LF>"] == replies[:3]
    assert replies[3].startswith("250 2.0.0 Ok: queued as ") and replies[4].startswith("221 2.0.0")
    assert 5 == len(replies)
    [(env, body)] = messages
    assert ["b@example.net"] == [r.address for r in env.recipients]
    assert b"MAIL FROM:<evil@attacker.test>\r\nRCPT TO:<victim@example.net>\r\nDATA\r\n" in body
    assert re.search(rb"\r(?!\n)|(?<!\r)\n", body) is None  # no bare CR, no bare LF
    assert body.endswith(b"second message\r\n")


def test_a_real_end_of_data_does_start_a_second_message(tmp_path):
    """Control for the two tests above: with CRLF . CRLF where the fake end was, the pipelined second
    transaction is real and two messages are queued, so a split would have been seen."""
    with run_edge(tmp_path) as edge:
        replies = smuggle(edge, b"\r\n.\r\n")
        messages = edge.messages()
    assert 2 == len(messages)
    assert [["b@example.net"], ["victim@example.net"]] == [[r.address for r in env.recipients] for env, _ in messages]
    assert 9 == len(replies)


def test_dot_transparency_is_undone_only_at_crlf_line_starts(tmp_path):
    """A leading dot is removed from each CRLF line (RFC 5321 §4.5.2): '..x' -> '.x', '...' -> '..';
    under normalize a dot after a bare LF is content and stays."""
    data = b"Subject: dots\r\n\r\n..x\r\n...\r\n.y\r\nz\n.w\r\n.\r\n"
    with run_edge(tmp_path, EdgePolicy(bare_newline="normalize")) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        c.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n" + data)
        assert [(250, "2.1.0"), (250, "2.1.5"), (354, "")] == [codes(c.reply()) for _ in range(3)]
        assert (250, "2.0.0") == codes(c.reply())
        [(_, body)] = edge.messages()
    assert body.endswith(b"\r\n\r\n.x\r\n..\r\ny\r\nz\r\n.w\r\n")


def swaks(port: int, data_file: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["swaks", "--server", f"127.0.0.1:{port}", "--helo", "client.test", "--from", "a@example.org",
         "--to", "b@example.net", "--data", f"@{data_file}", "--no-data-fixup", "--timeout", "30"],
        capture_output=True, text=True, timeout=120,
    )


def test_swaks_no_data_fixup_bare_lf_smuggling_is_refused_by_the_daemon(tmp_path):
    """swaks --no-data-fixup sends the data as written, bare LF and '\\n.\\r\\n' included: the daemon answers
    550 5.5.2 to the end of data, swaks fails, and nothing is queued or delivered."""
    data = tmp_path / "smuggle.eml"
    data.write_bytes(FIRST + b"\n.\r\n" + SECOND + b".\r\n")
    with edge_relay(tmp_path) as r:
        out = swaks(r.port, str(data))
        assert 0 != out.returncode
        assert f"<** 550 5.5.2 {HOST} Error: bare <LF> received" in out.stdout, out.stdout
        assert [] == r.events("queued")
        assert [] == r.sink_messages()


def test_swaks_smuggling_under_normalize_relays_one_message_to_the_next_hop(tmp_path):
    """With smtp_bare_newline = "normalize", the same swaks data is one message: it reaches the sink as one
    message to b@example.net, with the would-be second transaction as text and a line "." in it (which
    crossed the wire dot-stuffed), and nothing reaches victim@example.net."""
    data = tmp_path / "smuggle.eml"
    data.write_bytes(FIRST + b"\n.\r\n" + SECOND + b".\r\n")
    with edge_relay(tmp_path, config='smtp_bare_newline = "normalize"\n') as r:
        out = swaks(r.port, str(data))
        assert 0 == out.returncode, out.stdout
        [msg] = r.wait_for(r.sink_messages, "delivery")
        assert 1 == len(r.events("queued"))
    assert b"Delivered-To: b@example.net\r\n" in msg and b"victim@example.net>\r\nDATA" in msg
    assert b"Delivered-To: victim" not in msg
    assert msg.endswith(b"first message\r\n.\r\nMAIL FROM:<evil@attacker.test>\r\nRCPT TO:<victim@example.net>\r\n"
                        b"DATA\r\nFrom: ceo@example.org\r\nSubject: smuggled\r\n\r\nsecond message\r\n")


def test_lines_starting_with_dots_arrive_intact_at_the_sink(tmp_path):
    """Outbound dot-stuffing: lines '.', '..', '.x', '...' in a message arrive at the next hop exactly as
    sent (smtplib stuffs them, the edge unstuffs, aiosmtplib stuffs again, the sink unstuffs)."""
    import smtplib

    body = b"Subject: dots\r\nMessage-ID: <dots@test>\r\n\r\n.\r\n..\r\n.x\r\n...\r\nend\r\n.\r\n"
    with edge_relay(tmp_path) as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            assert {} == s.sendmail("a@example.org", ["b@example.net"], body)
        [msg] = r.wait_for(r.sink_messages, "delivery")
    assert msg.endswith(b"\r\n\r\n.\r\n..\r\n.x\r\n...\r\nend\r\n.\r\n")


def test_a_message_cut_off_before_its_final_dot_is_never_queued(tmp_path):
    """The client sends half a message (even a bare '.' line after LF) and hangs up: nothing is queued;
    the next client's message is (RFC 5321 §6.1 / GUIDE I3: absent or complete)."""
    import socket

    with run_edge(tmp_path, EdgePolicy(bare_newline="normalize")) as edge:
        with edge.raw() as c:
            start = c.reply()
            assert start.startswith("220 ")
            c.command("EHLO client.test")
            c.command("MAIL FROM:<a@example.org>")
            c.command("RCPT TO:<cut@example.net>")
            assert 354 == codes(c.command("DATA"))[0]
            c.send(b"Subject: cut\r\n\r\nhalf a message\n.\n")
            c.sock.shutdown(socket.SHUT_WR)
            assert c.closed()
        with edge.client() as s:
            assert {} == s.sendmail("a@example.org", ["whole@example.net"], b"Subject: whole\r\n\r\nx\r\n")
        messages = edge.messages()
    assert [["whole@example.net"]] == [[r.address for r in env.recipients] for env, _ in messages]
