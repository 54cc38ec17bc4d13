"""Outbound source addresses (issue 35.5): ``smtp_bind_address`` / ``smtp_bind_address6`` (Postfix's).

A real daemon relaying to the real sink on 127.0.0.1; the sink logs the address each message came from.
"""

from __future__ import annotations

import smtplib
import subprocess
import sys

from mtaq.testing.procs import read_events, start_daemon, start_sink, wait_for


def test_mail_leaves_from_smtp_bind_address(tmp_path):
    """smtp_bind_address = 127.0.0.2: the next hop sees the connection come from 127.0.0.2 (before: the
    kernel's choice, 127.0.0.1)."""
    conf = tmp_path / "mtaq.toml"
    conf.write_text('smtp_bind_address = "127.0.0.2"\n')
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    d = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "d.log"), config=str(conf))
    try:
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:
            assert {} == s.sendmail("a@example.org", ["b@example.net"], b"Subject: from\r\n\r\nx\r\n")
        [stored] = wait_for(lambda: [e for e in read_events(sink.log_path) if e.get("event") == "sink_stored"],
                            30, "the message at the sink")
        assert "127.0.0.2" == stored["client"]
    finally:
        d.kill9()
        sink.kill9()


def test_a_bind_address_that_is_not_this_hosts_stops_the_start(tmp_path):
    """192.0.2.1 (TEST-NET-1) is no address of this host: `mtaq check` says so in one line for each key,
    and `mtaq serve` exits 2 with the first, before it listens."""
    conf = tmp_path / "mtaq.toml"
    conf.write_text(f'spool_dir = "{tmp_path / "spool"}"\nadmin_listen = ""\nlisten = "127.0.0.1:0"\n'
                    'smtp_bind_address = "192.0.2.1"\nsmtp_bind_address6 = "127.0.0.1"\n')
    check = subprocess.run([sys.executable, "-m", "mtaq.cli", "check", "--config", str(conf), "--no-dns"],
                           capture_output=True, text=True, timeout=60)
    assert 1 == check.returncode
    assert ["mtaq: check: smtp_bind_address: 192.0.2.1 is not an address of this host (Cannot assign requested address)",
            "mtaq: check: smtp_bind_address6: 127.0.0.1 is not an IPv6 address"] == check.stdout.splitlines()[-2:]
    serve = subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", "--config", str(conf)],
                           capture_output=True, text=True, timeout=60)
    assert 2 == serve.returncode
    assert "smtp_bind_address: 192.0.2.1 is not an address of this host" in serve.stderr
