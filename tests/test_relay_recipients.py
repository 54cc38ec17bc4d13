"""Recipient verification for relay_domains (issue 35.2): ``relay_recipient_maps`` (Postfix's).

A real daemon; SMTP clients on loopback, "the internet" bound to 127.0.0.2 (outside ``mynetworks``).
"""

from __future__ import annotations

import smtplib

from mtaq.testing.procs import free_port, start_daemon, start_sink

OUTSIDE = "127.0.0.2"


def test_unlisted_recipients_of_a_relay_domain_are_refused_at_rcpt(tmp_path):
    """relay_domains example.org and .open.test with a recipient map listing alice@example.org and
    @open.test's subdomain: from outside, alice@example.org is accepted (any case of her local part),
    bob@example.org gets 550 5.1.1 at RCPT (Postfix's words; before, accepted and bounced later by the
    next hop to a sender anyone can forge: backscatter), anyone@sub.open.test is accepted by its @domain
    entry; a recipient outside relay_domains is still relay control's (554 5.7.1). From mynetworks the map
    holds for relay domains too, and other domains are relayed as before."""
    rmap = tmp_path / "relay_recipients"
    rmap.write_text("# valid recipients\nalice@Example.ORG OK\n@sub.open.test OK\n")
    conf = tmp_path / "mtaq.toml"
    conf.write_text(f'mynetworks = ["127.0.0.1/32"]\nrelay_domains = ["example.org", ".open.test"]\n'
                    f'relay_recipient_maps = "{rmap}"\n')
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    d = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "d.log"), config=str(conf), port=free_port())
    try:
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30, source_address=(OUTSIDE, 0)) as s:
            s.ehlo("outside.test")
            assert 250 == s.mail("someone@elsewhere.test")[0]
            replies = {r: s.rcpt(r) for r in ("alice@example.org", "ALICE@example.org", "bob@example.org",
                                              "anyone@sub.open.test", "x@example.net")}
        assert {"alice@example.org": 250, "ALICE@example.org": 250, "anyone@sub.open.test": 250,
                "bob@example.org": 550, "x@example.net": 554} == {r: c for r, (c, _) in replies.items()}
        assert (b"5.1.1 <bob@example.org>: Recipient address rejected: User unknown in relay recipient table"
                == replies["bob@example.org"][1])
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:
            s.ehlo("inside.test")
            assert 250 == s.mail("app@example.org")[0]
            assert 550 == s.rcpt("bob@example.org")[0]
            assert 250 == s.rcpt("x@example.net")[0]
    finally:
        d.kill9()
        sink.kill9()
