"""Delivery status notifications (RFC 3464 multipart/report), checked by parsing them with the stdlib."""

from __future__ import annotations

import email.parser
import email.policy
import email.utils
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.core.dsn import DsnRecipient, build_dsn

ORIGINAL = (
    b"From: Alice <alice@example.org>\r\n"
    b"To: bob@example.net\r\n"
    b"Subject: lunch\r\n"
    b"Message-ID: <m1@example.org>\r\n"
    b"\r\n"
    b"See you at noon.\r\n"
    b"-- \r\n"
    b"Alice\r\n"
)
ARRIVAL = 1_700_000_000.0
NOW = ARRIVAL + 3 * 3600.0
FAILED = DsnRecipient(
    "bob@example.net", "failed", "5.1.1",
    original_recipient="rfc822;bob@example.net",
    diagnostic="550 5.1.1 <bob@example.net>: no such user",
    remote_mta="mx.example.net",
    last_attempt_ts=NOW - 60.0,
)


def dsn(recipients=(FAILED,), **kw) -> bytes:
    args = dict(reporting_mta="relay.example.com", sender="alice@example.org", recipients=list(recipients),
                original=ORIGINAL, arrival_ts=ARRIVAL, now_ts=NOW, queue_id="Q0042", message_id="dsn.Q0042@relay.example.com")
    args.update(kw)
    return build_dsn(**args)


def parse(raw: bytes):
    return email.parser.BytesParser(policy=email.policy.default).parsebytes(raw)


def blocks(raw: bytes):
    """The header blocks of the message/delivery-status part: per-message first, then one per recipient."""
    status = parse(raw).get_payload()[1]
    assert "message/delivery-status" == status.get_content_type()
    return status.get_payload()


def unescape(s: str) -> str:
    """Undo RFC 6533 ``\\x{HEX}`` escapes."""
    return re.sub(r"\\x\{([0-9A-F]{2,6})\}", lambda m: chr(int(m.group(1), 16)), s)


def test_dsn_is_a_multipart_report_with_three_parts_in_order():
    """multipart/report; report-type=delivery-status with text/plain, message/delivery-status, message/rfc822."""
    msg = parse(dsn())
    assert "multipart/report" == msg.get_content_type()
    assert "delivery-status" == msg.get_param("report-type")
    assert ["text/plain", "message/delivery-status", "message/rfc822"] == [p.get_content_type() for p in msg.iter_parts()]
    assert [] == msg.defects


def test_top_level_headers_come_from_the_mailer_daemon_to_the_sender():
    """From MAILER-DAEMON, To <sender>, Date from now_ts, our Message-ID, Auto-Submitted (RFC 3834)."""
    msg = parse(dsn())
    assert "Mail Delivery System <MAILER-DAEMON@relay.example.com>" == str(msg["From"])
    assert "alice@example.org" == msg["To"].addresses[0].addr_spec
    assert NOW == msg["Date"].datetime.timestamp()
    assert "<dsn.Q0042@relay.example.com>" == str(msg["Message-ID"])
    assert "auto-replied" == str(msg["Auto-Submitted"])
    assert "1.0" == str(msg["MIME-Version"])


@pytest.mark.parametrize(("actions", "subject"), [
    (("failed",), "Undelivered Mail Returned to Sender"),
    (("failed", "delayed", "delivered"), "Undelivered Mail Returned to Sender"),
    (("delayed",), "Delayed Mail (still being retried)"),
    (("delayed", "relayed"), "Delayed Mail (still being retried)"),
    (("delivered",), "Successful Mail Delivery Report"),
    (("relayed", "expanded"), "Successful Mail Delivery Report"),
])
def test_subject_follows_the_most_serious_action(actions, subject):
    """Any failure makes a bounce; else any delay a delay warning; else a success report (Postfix wording)."""
    status = {"failed": "5.0.0", "delayed": "4.0.0"}
    rcpts = [DsnRecipient(f"r{i}@example.net", a, status.get(a, "2.0.0")) for i, a in enumerate(actions)]
    assert subject == str(parse(dsn(rcpts))["Subject"])


def test_per_message_fields():
    """Reporting-MTA, the queue ID, Original-Envelope-Id (ENVID decoded from xtext) and Arrival-Date."""
    per_message = blocks(dsn(envid="env+2B1"))[0]
    assert "dns; relay.example.com" == per_message["Reporting-MTA"]
    assert "Q0042" == per_message["X-Mtaq-Queue-ID"]
    assert "env+1" == per_message["Original-Envelope-Id"]
    assert ARRIVAL == email.utils.parsedate_to_datetime(per_message["Arrival-Date"]).timestamp()
    assert "Original-Envelope-Id" not in blocks(dsn())[0]


def test_per_recipient_fields_of_a_bounce():
    """One block per recipient, with the ORCPT, address, action, status, remote MTA, reply and attempt time."""
    rcpt = blocks(dsn())[1]
    assert "rfc822; bob@example.net" == rcpt["Original-Recipient"]
    assert "rfc822; bob@example.net" == rcpt["Final-Recipient"]
    assert "failed" == rcpt["Action"]
    assert "5.1.1" == rcpt["Status"]
    assert "dns; mx.example.net" == rcpt["Remote-MTA"]
    assert "smtp; 550 5.1.1 <bob@example.net>: no such user" == rcpt["Diagnostic-Code"]
    assert NOW - 60.0 == email.utils.parsedate_to_datetime(rcpt["Last-Attempt-Date"]).timestamp()
    assert "Will-Retry-Until" not in rcpt


def test_one_block_per_recipient_in_order_and_optional_fields_left_out():
    """Fields not given are not written; a bare address gets the rfc822 type; an ORCPT's xtext is decoded."""
    rcpts = [DsnRecipient("a@example.net", "delivered", "2.0.0"),
             DsnRecipient("rfc822;b@example.net", "relayed", "2.0.0", original_recipient="rfc822;B+2Bx@example.net")]
    _, a, b = blocks(dsn(rcpts))
    assert ["Final-Recipient", "Action", "Status"] == list(a.keys())
    assert ("rfc822; a@example.net", "delivered", "2.0.0") == (a["Final-Recipient"], a["Action"], a["Status"])
    assert ("rfc822; b@example.net", "relayed") == (b["Final-Recipient"], b["Action"])
    assert "rfc822; B+x@example.net" == b["Original-Recipient"]


def test_will_retry_until_only_for_delayed_recipients():
    """Will-Retry-Until is written for action delayed and ignored for the others (RFC 3464 §2.3.8)."""
    until = ARRIVAL + 5 * 86400.0
    rcpts = [DsnRecipient("late@example.net", "delayed", "4.4.1", diagnostic="451 4.4.1 try later", will_retry_until_ts=until),
             DsnRecipient("gone@example.net", "failed", "5.0.0", will_retry_until_ts=until)]
    _, late, gone = blocks(dsn(rcpts))
    assert until == email.utils.parsedate_to_datetime(late["Will-Retry-Until"]).timestamp()
    assert "smtp; 451 4.4.1 try later" == late["Diagnostic-Code"]
    assert "Will-Retry-Until" not in gone


def test_typed_diagnostic_and_remote_mta_are_kept():
    """A diagnostic or MTA name already carrying a type (``x-unix; ...``) is not typed again."""
    rcpt = DsnRecipient("a@example.net", "failed", "5.0.0", diagnostic="X-Mtaq; message too old", remote_mta="dns; mx.x")
    fields = blocks(dsn([rcpt]))[1]
    assert ("X-Mtaq; message too old", "dns; mx.x") == (fields["Diagnostic-Code"], fields["Remote-MTA"])


def test_human_readable_part_names_queue_id_recipients_and_reasons():
    """The text part explains, per recipient, what the remote host said, and quotes the queue ID."""
    text = parse(dsn()).get_payload()[0].get_content()
    assert "Q0042" in text
    flat = " ".join(text.split())
    assert "<bob@example.net>: host mx.example.net said: 550 5.1.1 <bob@example.net>: no such user" in flat


def test_delay_warning_text_says_it_is_only_a_warning():
    """A delay DSN tells the sender not to resend and how long the message has waited."""
    rcpt = DsnRecipient("late@example.net", "delayed", "4.4.1", will_retry_until_ts=ARRIVAL + 86400.0)
    text = parse(dsn([rcpt])).get_payload()[0].get_content()
    assert "WARNING ONLY" in text and "3 hour(s)" in text


def test_ret_full_returns_the_original_byte_for_byte():
    """RET=FULL: the original, even not valid MIME and 8-bit, is message/rfc822 and appears verbatim."""
    original = ORIGINAL.replace(b"noon.", b"no\xc3\xb3n \xff\xfe.") + b"Content-Type: multipart/mixed\r\n--x\r\n"
    raw = dsn(original=original)
    assert original in raw
    part = parse(raw).get_payload()[2]
    assert ("message/rfc822", "8bit") == (part.get_content_type(), part["Content-Transfer-Encoding"])
    inner = part.get_payload()[0]
    assert "lunch" == inner["Subject"]
    assert b"Content-Type: multipart/mixed\r\n--x\r\n" in raw.split(b"Subject: lunch\r\n", 1)[1]


def test_ret_hdrs_returns_only_the_header_section():
    """RET=HDRS: text/rfc822-headers with the bytes up to the first empty line, without the body (RFC 6522)."""
    raw = dsn(ret="hdrs")
    part = parse(raw).get_payload()[2]
    assert "text/rfc822-headers" == part.get_content_type()
    header_section = ORIGINAL.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    assert header_section.decode() == part.get_payload()
    assert b"See you at noon." not in raw
    assert header_section in raw


@pytest.mark.parametrize(("original", "section"), [
    (b"", b""),
    (b"\r\nno header lines\r\n", b""),
    (b"Subject: only headers, no empty line", b"Subject: only headers, no empty line\r\n"),
    (b"Subject: a\n\nbody\n", b"Subject: a\r\n"),
])
def test_ret_hdrs_header_section_edge_cases(original, section):
    """The header section is empty when the original starts with an empty line, and all of it when none."""
    raw = dsn(original=original, ret="HDRS")
    part = parse(raw).get_payload()[2]
    assert section.decode() == part.get_payload()
    assert b"body" not in raw.split(b"text/rfc822-headers", 1)[1]


def test_every_line_ends_in_crlf_even_when_the_original_has_bare_lf():
    """No bare LF or CR anywhere: the original's line ends are made CRLF, its other bytes are kept."""
    original = b"Subject: x\n\nline one\nline two\r\nbare\rcr\n"
    for ret in ("FULL", "HDRS"):
        raw = dsn(original=original, ret=ret)
        assert raw.endswith(b"\r\n")
        assert raw.count(b"\n") == raw.count(b"\r\n") == raw.count(b"\r")
    assert b"Subject: x\r\n\r\nline one\r\nline two\r\nbare\r\ncr\r\n" in dsn(original=original)


def test_boundary_never_occurs_in_the_original():
    """An original that happens to contain the first-choice boundary gets another one."""
    first = parse(dsn()).get_param("boundary")
    original = ORIGINAL + f"--{first}\r\n".encode()
    msg = parse(dsn(original=original))
    assert first != msg.get_param("boundary")
    assert 3 == len(msg.get_payload())


def test_same_arguments_give_the_same_bytes():
    """No clock and no randomness: the DSN is a function of its arguments."""
    assert dsn() == dsn()


def test_long_diagnostic_is_folded_and_reads_back_whole():
    """Delivery-status lines stay within 78 characters; folding only adds CRLF before existing spaces."""
    reply = "550 5.7.1 " + " ".join(f"word{i}" for i in range(60))
    raw = dsn([DsnRecipient("a@example.net", "failed", "5.7.1", diagnostic=reply)])
    part2 = raw.split(b"message/delivery-status\r\n\r\n", 1)[1].split(b"\r\n--=_mtaq_", 1)[0]
    assert max(len(line) for line in part2.split(b"\r\n")) <= 78
    assert f"smtp; {reply}" == blocks(raw)[1]["Diagnostic-Code"]


def test_remote_reply_cannot_inject_fields():
    """Line breaks and control characters of a remote reply become spaces: no extra field or block appears."""
    reply = "550 nope\r\nAction: delivered\r\n\r\nFinal-Recipient: rfc822; evil@x\x00\t end"
    _, rcpt = blocks(dsn([DsnRecipient("a@example.net", "failed", "5.0.0", diagnostic=reply)]))
    assert "smtp; 550 nope Action: delivered Final-Recipient: rfc822; evil@x end" == rcpt["Diagnostic-Code"]
    assert ["failed"] == rcpt.get_all("Action")


def test_non_ascii_recipient_uses_the_utf8_address_type_in_7bit():
    """A UTF-8 address is reported as ``utf-8; utf-8-addr-xtext`` (RFC 6533 §3); the report stays ASCII."""
    rcpt = DsnRecipient("jösé@exämple.net", "failed", "5.1.1", diagnostic="550 unbekannt: jösé")
    raw = dsn([rcpt])
    part2 = raw.split(b"message/delivery-status\r\n\r\n", 1)[1].split(b"\r\n--=_mtaq_", 1)[0]
    assert part2.isascii()
    fields = blocks(raw)[1]
    assert "utf-8; j\\x{F6}s\\x{E9}@ex\\x{E4}mple.net" == fields["Final-Recipient"]
    assert "smtp; 550 unbekannt: jösé" == unescape(fields["Diagnostic-Code"])
    assert "jösé@exämple.net" in parse(raw).get_payload()[0].get_content()


@pytest.mark.parametrize(("kw", "message"), [
    ({"recipients": []}, "at least one recipient"),
    ({"recipients": [DsnRecipient("a@x", "bounced", "5.0.0")]}, "unknown DSN action"),
    ({"recipients": [DsnRecipient("a@x", "failed", "5.1")]}, "status code"),
    ({"recipients": [DsnRecipient("a@x", "failed", "3.0.0")]}, "status code"),
    ({"recipients": [DsnRecipient("a@x", "failed", "5.1.1.1")]}, "status code"),
    ({"recipients": [DsnRecipient("a@x", "failed", "550")]}, "status code"),
    ({"recipients": [DsnRecipient("a@x", "failed", "")]}, "status code"),
    ({"recipients": [DsnRecipient("a@x\r\nBcc: b@y", "failed", "5.0.0")]}, "control character"),
    ({"recipients": [DsnRecipient("", "failed", "5.0.0")]}, "empty"),
    ({"sender": ""}, "null sender"),
    ({"sender": "<>"}, "null sender"),
    ({"sender": "a@x\nSubject: hi"}, "control character"),
    ({"ret": "NONE"}, "FULL or HDRS"),
    ({"queue_id": "Q 1"}, "queue_id"),
])
def test_bad_arguments_raise_value_error(kw, message):
    """No recipients, an unknown action, a status not x.y.z of class 2/4/5, the null sender, a bad RET,
    and control characters in addresses are programming errors."""
    with pytest.raises(ValueError, match=message):
        dsn(**kw)


PRINTABLE = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))
ADDRESS = (st.text(PRINTABLE, min_size=1, max_size=60).map(str.strip)
           .filter(lambda s: s and not re.match(r"(?i)rfc822[ \t]*;", s)))


@settings(max_examples=200, deadline=None)
@given(sender=ADDRESS, address=ADDRESS, text=st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"),
                                                                    blacklist_characters="\\"), max_size=200),
       action=st.sampled_from(["failed", "delayed", "delivered", "relayed", "expanded"]),
       ret=st.sampled_from(["FULL", "HDRS"]), original=st.binary(max_size=300))
def test_arbitrary_printable_values_round_trip_through_the_parser(sender, address, text, action, ret, original):
    """Any printable address and reply gives a DSN that parses without defects, is CRLF-only, and whose
    Final-Recipient and Diagnostic-Code read back as given (after RFC 6533 unescaping)."""
    status = {"failed": "5.0.0", "delayed": "4.0.0"}.get(action, "2.0.0")
    reply = "550 " + text
    raw = build_dsn(reporting_mta="relay.example.com", sender=sender,
                    recipients=[DsnRecipient(address, action, status, diagnostic=reply, remote_mta="mx.example.net")],
                    original=original, ret=ret, arrival_ts=ARRIVAL, now_ts=NOW, queue_id="Q1", message_id="d@relay")
    assert raw.count(b"\n") == raw.count(b"\r\n") == raw.count(b"\r")
    msg = parse(raw)
    assert [] == msg.defects
    assert 3 == len(msg.get_payload())
    str(msg["To"])
    _, rcpt = msg.get_payload()[1].get_payload()
    atype, _, value = rcpt["Final-Recipient"].partition("; ")
    assert address == (value if atype == "rfc822" else unescape(value))
    assert "smtp; " + re.sub(" {2,}", " ", reply).strip() == unescape(rcpt["Diagnostic-Code"])
    assert action == rcpt["Action"]
    msg.get_payload()[0].get_content()


LARGE = ORIGINAL + (b"y" * 998 + b"\r\n") * 1000  # about 1 MB


def test_an_original_over_the_size_limit_returns_its_header_section_only():
    """Backscatter (Postfix bounce_size_limit): with size_limit, a larger original comes back as
    text/rfc822-headers even with RET=FULL; one within the limit comes back whole."""
    big = parse(dsn(original=LARGE, size_limit=50_000))
    assert "text/rfc822-headers" == big.get_payload()[2].get_content_type()
    assert b"yyyy" not in dsn(original=LARGE, size_limit=50_000)
    assert len(dsn(original=LARGE, size_limit=50_000)) < 50_000
    small = parse(dsn(original=ORIGINAL, size_limit=50_000))
    assert "message/rfc822" == small.get_payload()[2].get_content_type()


def test_a_header_section_over_the_limit_is_cut_at_a_line_end():
    """A header section larger than size_limit is cut at the last CRLF within it: whole lines only."""
    many = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 60) for i in range(2000)) + b"\r\nbody\r\n"
    raw = dsn(original=many, size_limit=1000)
    third = raw[raw.index(b"Content-Type: text/rfc822-headers"):]
    section = third.split(b"\r\n\r\n", 1)[1].split(b"\r\n\r\n--", 1)[0] + b"\r\n"
    assert (True, True) == (0 < len(section) <= 1000, section.startswith(b"X-Pad-0: ppp"))
    assert all(re.fullmatch(rb"X-Pad-\d+: p{60}", line) for line in section.splitlines())


@pytest.mark.parametrize("action", ["delivered", "relayed", "expanded"])
def test_success_notices_carry_the_header_section_only_whatever_ret_says(action):
    """A success or relayed notice (NOTIFY=SUCCESS) returns headers only, also with RET=FULL and no limit:
    otherwise anyone could make the relay mail a whole message to an address of their choosing."""
    ok = DsnRecipient("bob@example.net", action, "2.0.0")
    msg = parse(dsn(recipients=[ok], ret="FULL"))
    assert "text/rfc822-headers" == msg.get_payload()[2].get_content_type()
    assert b"See you at noon" not in dsn(recipients=[ok], ret="FULL")
