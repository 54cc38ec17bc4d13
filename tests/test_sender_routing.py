"""Routing by sender (issue 35.4): ``sender_dependent_relayhost_maps`` (Postfix's), before ``relayhost``.

A real daemon and two real sinks on loopback; each sink logs what it stored.
"""

from __future__ import annotations

import smtplib

from mtaq.testing.procs import read_events, start_daemon, start_sink, wait_for


def test_the_next_hop_follows_the_sender_unless_transport_map_routes_the_recipient(tmp_path):
    """relayhost = sink A; mail from @special.example goes to sink B (sender_dependent_relayhost_maps, the
    address tried before its @domain: boss@special.example goes to A by its own entry); a recipient domain in
    transport_map keeps its transport whoever sends (Postfix's order: transport_maps, then the sender's
    relayhost, then relayhost)."""
    a = start_sink(str(tmp_path / "a"), str(tmp_path / "a.log"))
    b = start_sink(str(tmp_path / "b"), str(tmp_path / "b.log"))
    conf = tmp_path / "mtaq.toml"
    conf.write_text(f'relayhost = "[127.0.0.1]:{a.port}"\n'
                    f'[sender_dependent_relayhost_maps]\n"@Special.example" = "[127.0.0.1]:{b.port}"\n'
                    f'"boss@special.example" = "[127.0.0.1]:{a.port}"\n'
                    f'[transport_map]\n"fixed.example" = "[127.0.0.1]:{a.port}"\n')
    d = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "d.log"), config=str(conf))
    try:
        sends = [("x@special.example", "r@example.net"), ("y@other.example", "r@example.net"),
                 ("x@special.example", "t@fixed.example"), ("boss@special.example", "r@example.net")]
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:
            for sender, rcpt in sends:
                assert {} == s.sendmail(sender, [rcpt], f"Subject: {sender} {rcpt}\r\n\r\nx\r\n".encode())

        def stored(sink) -> set[tuple[str, str]]:
            return {(e["sender"], e["recipients"][0]) for e in read_events(sink.log_path) if e.get("event") == "sink_stored"}

        wait_for(lambda: len(stored(a)) + len(stored(b)) == 4, 30, "four messages stored")
        assert {("x@special.example", "r@example.net")} == stored(b)
        assert {("y@other.example", "r@example.net"), ("x@special.example", "t@fixed.example"),
                ("boss@special.example", "r@example.net")} == stored(a)
    finally:
        d.kill9()
        a.kill9()
        b.kill9()
