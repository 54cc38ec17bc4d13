"""Backscatter (issue 13.2): what a forged sender can make the relay mail to a victim, end to end.

A real client sends a 1 MB message from a forged sender; the real sink refuses one recipient (5xx) and
takes another that asked for NOTIFY=SUCCESS. Both DSNs go, through the same queue, to the sink: each must
carry the original's header section only, so the relay never mails a stranger a copy of what anyone sent.
"""

from __future__ import annotations

import email.parser
import email.policy
import glob
import smtplib


def test_dsns_about_a_large_forged_message_return_its_header_section_only(relay_factory):
    """1 MB from a forged sender: the bounce (5xx recipient) and the relayed notice (NOTIFY=SUCCESS) are
    each under bounce_size_limit_bytes (50,000), with text/rfc822-headers and no byte of the body."""
    r = relay_factory(sink_args=["--reject-rcpt", "^nobody@"])
    body = b"".join(b"%06d " % i + b"B" * 90 + b"\r\n" for i in range(10_500))  # about 1 MB
    msg = b"From: victim@forged.example\r\nSubject: big\r\nMessage-ID: <big@forged.example>\r\n\r\n" + body
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=60) as s:
        s.ehlo("client.test")
        s.mail("victim@forged.example")
        assert 250 == s.rcpt("nobody@example.net")[0]
        assert 250 == s.rcpt("ok@example.net", ["NOTIFY=SUCCESS"])[0]
        assert 250 == s.data(msg)[0]
    dsns = r.wait_for(lambda: len(r.events("dsn_queued")) >= 2 and r.events("dsn_queued"), what="two DSNs")
    assert ["failed", "relayed"] == sorted(e["action"] for e in dsns)

    def notices() -> list[bytes]:
        out = []
        for path in glob.glob(r.maildir + "/new/*"):
            with open(path, "rb") as f:
                raw = f.read()
            if b"MAILER-DAEMON@" in raw.split(b"\r\n\r\n", 1)[0].replace(b"\n\n", b"")[:4000]:
                out.append(raw)
        return out

    got = r.wait_for(lambda: len(n := notices()) >= 2 and n, timeout_s=60, what="both DSNs delivered")
    parser = email.parser.BytesParser(policy=email.policy.default)
    for raw in got:
        parts = list(parser.parsebytes(raw).iter_parts())
        assert ("text/rfc822-headers", False) == (parts[2].get_content_type(), b"BBBBBBBBBB" in raw)
        assert len(raw) < 50_000
