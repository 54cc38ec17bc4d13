"""The command line: bad input gets a one-line error naming the problem and a non-zero exit status."""

from __future__ import annotations

import subprocess
import sys


def mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=60)


def test_config_value_out_of_range_names_the_key_and_exits_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("segment_bytes_max = 10\n")
    out = mtaq("serve", "--config", str(cfg), "--spool", str(tmp_path / "s"))
    assert 2 == out.returncode
    assert [f"mtaq: {cfg}: segment_bytes_max: Expected `int` >= 65536"] == out.stderr.splitlines()


def test_unknown_config_key_is_refused(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("segmnt_bytes_max = 1\n")
    out = mtaq("serve", "--config", str(cfg))
    assert 2 == out.returncode
    assert "segmnt_bytes_max" in out.stderr


def test_unparsable_relayhost_flag_is_refused():
    out = mtaq("serve", "--relayhost", "[nope")
    assert 2 == out.returncode
    assert out.stderr.startswith("mtaq: relayhost:")


def test_listening_address_in_use_is_a_one_line_error(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = mtaq("serve", "--spool", str(tmp_path), "--listen", f"127.0.0.1:{port}")
    assert 1 == out.returncode
    assert 1 == len(out.stderr.strip().splitlines()), out.stderr
    assert "mtaq: cannot serve:" in out.stderr


def test_log_verify_without_a_log_exits_2(tmp_path):
    out = mtaq("log", "verify", "--spool", str(tmp_path))
    assert 2 == out.returncode
    assert "no queue log" in out.stderr


def test_log_dump_json_has_one_object_per_record(tmp_path, relay_factory):
    r = relay_factory()
    import smtplib

    with smtplib.SMTP("127.0.0.1", r.daemon.port) as s:
        s.sendmail("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nbody\r\n")
    r.wait_for(lambda: r.events("removed"), what="delivery")
    import json

    out = mtaq("log", "dump", "--spool", r.spool, "--json")
    types = [json.loads(line)["type"] for line in out.stdout.splitlines()]
    assert ["DATA", "ENVELOPE", "START", "DELIVERY", "FINISH"] == types


def test_bad_transport_map_value_names_the_domain_key_and_exits_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[transport_map]\n"example.org" = "lmtp:unix:/run/lmtp"\n')
    out = mtaq("serve", "--config", str(cfg), "--spool", str(tmp_path / "s"))
    assert 2 == out.returncode
    assert 1 == len(out.stderr.splitlines())
    assert out.stderr.startswith("mtaq: transport_map.example.org: unknown transport 'lmtp'")


def test_bad_tls_policy_and_nameserver_are_refused_naming_the_key(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[tls_policy_map]\n"example.org" = "maybe"\n')
    out = mtaq("serve", "--config", str(cfg), "--spool", str(tmp_path / "s"))
    assert (2, "tls_policy_map") == (out.returncode, out.stderr.split(": ")[2])
    cfg.write_text('dns_nameservers = ["ns.example.org"]\n')
    out = mtaq("serve", "--config", str(cfg), "--spool", str(tmp_path / "s"))
    assert (2, ["mtaq: dns_nameservers: 'ns.example.org' is not an IP address"]) == (out.returncode, out.stderr.splitlines())
