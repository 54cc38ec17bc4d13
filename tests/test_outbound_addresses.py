"""Outbound source addresses (issue 35.5): ``smtp_bind_address`` / ``smtp_bind_address6`` (Postfix's).

A real daemon relaying to the real sink on 127.0.0.1; the sink logs the address each message came from.
"""

from __future__ import annotations

import smtplib
import subprocess
import sys
from pathlib import Path

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


# --------------------------------------------------------------- per sender and per destination (egress sources)

def stored_clients(sink) -> list[tuple[str, tuple[str, ...], str]]:
    """(sender, recipients, client address) of each transaction the sink stored, in order."""
    return [(e["sender"], tuple(e["recipients"]), e["client"])
            for e in read_events(sink.log_path) if e.get("event") == "sink_stored"]


def send_each(port: int, sends: list[tuple[str, list[str]]]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for sender, rcpts in sends:
            assert {} == s.sendmail(sender, rcpts, f"Subject: {sender}\r\n\r\nx\r\n".encode())


def test_mail_from_each_sender_leaves_from_its_own_source_address(tmp_path):
    """sender_dependent_bind_address_maps (the address, then its @domain, "<>" for bounces; else
    smtp_bind_address): four messages to one next hop come from four addresses. One delivery worker: its
    cached connection (from 127.0.0.3) is never reused for mail that must leave from another address."""
    conf = tmp_path / "mtaq.toml"
    conf.write_text('smtp_bind_address = "127.0.0.2"\ndelivery_concurrency = 1\n'
                    '[sender_dependent_bind_address_maps]\n"@A.example" = "127.0.0.3"\n'
                    '"boss@a.example" = ["127.0.0.4"]\n"<>" = "127.0.0.5"\n')
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    d = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "d.log"), config=str(conf))
    try:
        send_each(d.port, [("x@a.example", ["r@example.net"]), ("y@other.example", ["r@example.net"]),
                           ("boss@a.example", ["r@example.net"]), ("", ["r@example.net"]),
                           ("z@a.example", ["r@example.net"])])
        wait_for(lambda: len(stored_clients(sink)) == 5, 30, "five messages at the sink")
        assert {("x@a.example", "127.0.0.3"), ("y@other.example", "127.0.0.2"), ("boss@a.example", "127.0.0.4"),
                ("<>", "127.0.0.5"), ("z@a.example", "127.0.0.3")} == {(s, c) for s, _, c in stored_clients(sink)}
    finally:
        d.kill9()
        sink.kill9()


def test_mail_to_each_destination_leaves_from_its_own_source_address(tmp_path):
    """destination_bind_address_maps, looked up as tls_policy_map: the next hop as written ("[127.0.0.1]:B"
    for the transport_map route to sink B), then the recipient domain (exact or "@domain", ".parent", "*").
    One message to five recipients of one next hop is split into one transaction per source address."""
    a = start_sink(str(tmp_path / "a"), str(tmp_path / "a.log"))
    b = start_sink(str(tmp_path / "b"), str(tmp_path / "b.log"))
    conf = tmp_path / "mtaq.toml"
    conf.write_text(f'relayhost = "[127.0.0.1]:{a.port}"\n'
                    f'[transport_map]\n"hop.example" = "[127.0.0.1]:{b.port}"\n'
                    '[destination_bind_address_maps]\n"dest.example" = "127.0.0.3"\n"@other.example" = "127.0.0.4"\n'
                    f'".sub.example" = "127.0.0.5"\n"*" = "127.0.0.2"\n"[127.0.0.1]:{b.port}" = "127.0.0.6"\n')
    d = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "d.log"), config=str(conf))
    try:
        send_each(d.port, [("s@example.org", ["r@dest.example", "r@other.example", "r@x.sub.example",
                                               "r@plain.example", "r@hop.example", "q@dest.example"])])
        wait_for(lambda: len(stored_clients(a)) == 4 and len(stored_clients(b)) == 1, 30, "five transactions")
        assert {(("r@dest.example", "q@dest.example"), "127.0.0.3"), (("r@other.example",), "127.0.0.4"),
                (("r@x.sub.example",), "127.0.0.5"), (("r@plain.example",), "127.0.0.2")} == {
            (r, c) for _, r, c in stored_clients(a)}
        assert [("s@example.org", ("r@hop.example",), "127.0.0.6")] == stored_clients(b)
    finally:
        d.kill9()
        a.kill9()
        b.kill9()


def test_the_sender_wins_over_the_destination_which_wins_over_smtp_bind_address_each_family_on_its_own(tmp_path):
    """For each address family: the sender's entry, then the destination's, then smtp_bind_address. A sender
    entry with only an IPv6 address leaves IPv4 connections to the destination's entry."""
    conf = tmp_path / "mtaq.toml"
    conf.write_text('smtp_bind_address = "127.0.0.2"\n'
                    '[destination_bind_address_maps]\n"dest.example" = "127.0.0.3"\n'
                    '[sender_dependent_bind_address_maps]\n"@s.example" = "127.0.0.4"\n"@v6only.example" = "::1"\n')
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    d = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "d.log"), config=str(conf))
    try:
        send_each(d.port, [("a@s.example", ["r@dest.example"]), ("a@o.example", ["r@dest.example"]),
                           ("a@o.example", ["r@plain.example"]), ("a@v6only.example", ["r@dest.example"]),
                           ("a@s.example", ["r@plain.example"])])
        wait_for(lambda: len(stored_clients(sink)) == 5, 30, "five messages")
        assert {("a@s.example", ("r@dest.example",), "127.0.0.4"), ("a@o.example", ("r@dest.example",), "127.0.0.3"),
                ("a@o.example", ("r@plain.example",), "127.0.0.2"), ("a@v6only.example", ("r@dest.example",), "127.0.0.3"),
                ("a@s.example", ("r@plain.example",), "127.0.0.4")} == set(stored_clients(sink))
    finally:
        d.kill9()
        sink.kill9()


def test_an_ipv4_source_address_is_never_bound_to_an_ipv6_connection(tmp_path, ipv6_port_taken):
    """A sender whose entry has only an IPv4 address sends to a next hop on ::1: the IPv6 connection takes
    smtp_bind_address6 (Postfix binds smtp_bind_address for IPv4 connections only), and the mail goes."""
    v6 = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"), host="::1")
    conf = tmp_path / "mtaq.toml"
    conf.write_text(f'relayhost = "[::1]:{v6.port}"\nsmtp_bind_address6 = "::1"\n'
                    '[sender_dependent_bind_address_maps]\n"@s.example" = "127.0.0.4"\n')
    d = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "d.log"), config=str(conf))
    try:
        send_each(d.port, [("a@s.example", ["r@example.net"])])
        wait_for(lambda: stored_clients(v6), 30, "the message at the IPv6 sink")
        assert [("a@s.example", ("r@example.net",), "::1")] == stored_clients(v6)
    finally:
        d.kill9()
        v6.kill9()


def test_a_reload_applies_a_new_source_address_and_refuses_one_the_host_lacks(relay_factory):
    """The maps are reloadable: an address the host lacks makes `mtaq reload` exit 1 naming it, with nothing
    changed (mail still leaves from the old address); a good one is applied to the next delivery (a new
    connection: the cached one is from the old address)."""
    r = relay_factory(config='[sender_dependent_bind_address_maps]\n"@a.example" = "127.0.0.3"\n')
    assert r.config is not None

    def send_and_see(n: int) -> str:
        send_each(r.daemon.port, [("x@a.example", ["r@example.net"])])
        return wait_for(lambda: stored_clients(r.sink)[n:], 30, f"message {n + 1} at the sink")[0][2]

    def reload() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mtaq.cli", "reload", "--spool", r.spool],
                              capture_output=True, text=True, timeout=60)

    assert "127.0.0.3" == send_and_see(0)
    Path(r.config).write_text('[sender_dependent_bind_address_maps]\n"@a.example" = "192.0.2.1"\n')
    out = reload()
    assert 1 == out.returncode
    assert ["mtaq: reload: daemon: sender_dependent_bind_address_maps.@a.example: 192.0.2.1 is not an address of "
            "this host (Cannot assign requested address)", "mtaq: reload: daemon: nothing changed"] == out.stderr.splitlines()
    assert "127.0.0.3" == send_and_see(1)
    Path(r.config).write_text('[sender_dependent_bind_address_maps]\n"@a.example" = "127.0.0.4"\n')
    assert 0 == reload().returncode
    assert "127.0.0.4" == send_and_see(2)


def test_a_map_address_that_is_not_this_hosts_stops_the_start(tmp_path):
    """An address in either map that the host does not have (192.0.2.1, TEST-NET-1): `mtaq check` names the
    map and its key in one line each; `mtaq serve` exits 2 with the first line before it listens. A value
    that is no address, or two of one family, is refused by the config's own check."""
    conf = tmp_path / "mtaq.toml"
    base = f'spool_dir = "{tmp_path / "spool"}"\nadmin_listen = ""\nlisten = "127.0.0.1:0"\n'
    conf.write_text(base + '[sender_dependent_bind_address_maps]\n"@a.example" = "192.0.2.1"\n'
                           '[destination_bind_address_maps]\n"dest.example" = ["127.0.0.3", "2001:db8::1"]\n')
    check = subprocess.run([sys.executable, "-m", "mtaq.cli", "check", "--config", str(conf), "--no-dns"],
                           capture_output=True, text=True, timeout=60)
    assert 1 == check.returncode
    assert ["mtaq: check: sender_dependent_bind_address_maps.@a.example: 192.0.2.1 is not an address of this host "
            "(Cannot assign requested address)",
            "mtaq: check: destination_bind_address_maps.dest.example: 2001:db8::1 is not an address of this host "
            "(Cannot assign requested address)"] == check.stdout.splitlines()[-2:]
    serve = subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", "--config", str(conf)],
                           capture_output=True, text=True, timeout=60)
    assert 2 == serve.returncode
    assert ["mtaq: sender_dependent_bind_address_maps.@a.example: 192.0.2.1 is not an address of this host "
            "(Cannot assign requested address)"] == serve.stderr.splitlines()
    conf.write_text(base + '[destination_bind_address_maps]\n"dest.example" = "127.0.0.3, 127.0.0.4"\n'
                           '"other.example" = "mail.example"\n')
    check = subprocess.run([sys.executable, "-m", "mtaq.cli", "check", "--config", str(conf), "--no-dns"],
                           capture_output=True, text=True, timeout=60)
    assert 1 == check.returncode
    assert ["mtaq: check: destination_bind_address_maps.dest.example: two IPv4 addresses (127.0.0.3, 127.0.0.4): "
            "give at most one of each family",
            "mtaq: check: destination_bind_address_maps.other.example: 'mail.example' is not an IP address"
            ] == check.stdout.splitlines()[-2:]
