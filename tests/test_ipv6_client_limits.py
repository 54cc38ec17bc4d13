"""Per-client limits count an IPv6 client by its prefix (issue 32, outside review F4).

Postfix's ``smtpd_client_ipv6_prefix_length`` (default 84 since Postfix 3.8): one host commonly has a whole
/64, so counting each IPv6 address apart let one host escape every per-client limit (200 connections from
200 addresses of one /64 were all greeted with a limit of 50; 30 failed AUTHs from 30 addresses never got
450). Now ``smtpd_client_connection_count_limit``, ``connections_per_client_per_minute_max`` and
``smtpd_client_auth_failure_rate_limit`` count the addresses of one /84 together; IPv4 is unchanged, and the
replies and events name the real address.

Real processes over real sockets, in a private network namespace (``unshare -n``, as root) where an AnyIP
route makes every address of 2001:db8:1::/64 local, so that clients can bind any of them: this file runs
itself there as a script (the daemon, started with :mod:`mtaq.testing.procs`, inside the same namespace) and
prints what the clients got as JSON.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import smtplib
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

# In the namespace: /84 clients A (concurrency), B (rate), C (AUTH failures), all in one /64; D is A's /64
# but another /84.
A = "2001:db8:1::{:x}"
B = "2001:db8:1:0:2::{:x}"
C = "2001:db8:1:0:3::{:x}"
D = "2001:db8:1:0:1::1"
E = "2001:db8:1:0:4::{:x}"  # after a reload to 128 bits
COUNT_LIMIT, RATE_LIMIT, AUTH_LIMIT = 5, 10, 3
PASSWORD = "correct horse battery staple"
HOST = "mx.test"


def _greeting(sock: socket.socket) -> str:
    return sock.makefile("rb").readline().decode().strip()


def _connect(dest: tuple[str, int], source: str) -> socket.socket:
    return socket.create_connection(dest, timeout=20, source_address=(source, 0))


def _auth_fail(port: int, source: str, cafile: str) -> int:
    """One wrong AUTH PLAIN after STARTTLS on a new connection from ``source``; its reply code."""
    with smtplib.SMTP("::1", port, timeout=20, source_address=(source, 0)) as s:
        s.ehlo("client.test")
        s.starttls(context=ssl.create_default_context(cafile=cafile))
        s.ehlo("client.test")
        code, _ = s.docmd("AUTH", "PLAIN " + base64.b64encode(b"\0alice\0wrong").decode())
        return code


def _in_namespace(work: str, cert: str, key: str, ca: str, passwd: str, workers: int) -> dict[str, object]:
    """Run inside ``unshare -n``: the AnyIP route, a daemon listening on 127.0.0.1 and [::1], the clients."""
    from mtaq.testing.procs import free_port, read_events, start_daemon

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "-6", "route", "add", "local", "2001:db8:1::/64", "dev", "lo"], check=True)
    Path("/proc/sys/net/ipv6/ip_nonlocal_bind").write_text("1\n")
    p6 = free_port()
    conf = Path(work) / "mtaq.toml"
    conf.write_text(f'myhostname = "{HOST}"\nmynetworks = ["127.0.0.1/32"]\n'
                    f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\nauth_password_file = "{passwd}"\n'
                    f"smtpd_error_sleep_time_s = 0\nsmtpd_client_connection_count_limit = {COUNT_LIMIT}\n"
                    f"connections_per_client_per_minute_max = {RATE_LIMIT}\n"
                    f"smtpd_client_auth_failure_rate_limit = {AUTH_LIMIT}\n"
                    f'[listeners."[::1]:{p6}"]\nmode = "smtp"\n')
    d = start_daemon(f"{work}/spool", None, f"{work}/daemon.log", config=str(conf), workers=workers)
    out: dict[str, object] = {}
    try:
        held = [_connect(("::1", p6), A.format(k)) for k in range(1, 9)]
        out["a"] = [_greeting(s) for s in held]
        other = _connect(("::1", p6), D)
        out["d"] = _greeting(other)
        for s in [*held, other]:
            s.close()
        rate = []
        for k in range(1, 13):
            with _connect(("::1", p6), B.format(k)) as s:
                rate.append(_greeting(s)[:3])
                if rate[-1] == "220":  # a 421 is followed by the server's close
                    s.sendall(b"QUIT\r\n")
                    s.recv(100)
        out["b"] = rate
        out["c"] = [_auth_fail(p6, C.format(k), ca) for k in range(1, 6)]
        v4 = [_connect(("127.0.0.1", d.port), f"127.0.0.{k}") for k in range(2, 10)]
        out["v4_many"] = [_greeting(s)[:3] for s in v4]
        v4_one = [_connect(("127.0.0.1", d.port), "127.0.0.10") for _ in range(8)]
        out["v4_one"] = sorted(_greeting(s)[:3] for s in v4_one)
        for s in [*v4, *v4_one]:
            s.close()
        # `mtaq reload` with smtpd_client_ipv6_prefix_length = 128: each address is a client again
        mtaq_user = pwd.getpwnam("mtaq")
        for path in (cert, key, passwd):  # read again by the daemon, now mail_owner
            os.chown(path, mtaq_user.pw_uid, mtaq_user.pw_gid)
        conf.write_text(conf.read_text().replace("[listeners.", "smtpd_client_ipv6_prefix_length = 128\n[listeners."))
        reload = subprocess.run([sys.executable, "-m", "mtaq.cli", "reload", "--spool", f"{work}/spool"],
                                capture_output=True, text=True, timeout=60)
        out["reload"] = [reload.returncode, reload.stdout + reload.stderr]
        held = [_connect(("::1", p6), E.format(k)) for k in range(1, 9)]
        out["e"] = [_greeting(s)[:3] for s in held]
        for s in held:
            s.close()
        events = read_events(d.log_path)
        out["auth_failed"] = [e.get("client") for e in events if e.get("event") == "auth_failed"]
        out["auth_rate_limited"] = [e.get("client") for e in events if e.get("event") == "auth_rate_limited"]
    finally:
        d.kill9()
    return out


@pytest.fixture(scope="module")
def tls_and_passwords(tmp_path_factory) -> dict[str, str]:
    """A local CA, a certificate for ::1, and alice's password file (`mtaq passwd`, bcrypt cost 4)."""
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("pki")
    os.chmod(d, 0o755)  # the daemon reads the key and the password file again at a reload, as mail_owner
    ca = trustme.CA()
    leaf = ca.issue_cert(HOST, "::1", "127.0.0.1")
    paths = {"ca": str(d / "ca.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem"),
             "passwd": str(d / "passwd")}
    ca.cert_pem.write_to_path(paths["ca"])
    Path(paths["cert"]).write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(paths["key"])
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "passwd", "alice", "--rounds", "4"],
                         input=PASSWORD + "\n", capture_output=True, text=True, timeout=60, check=True)
    Path(paths["passwd"]).write_text(out.stdout)
    for k in ("key", "passwd"):
        os.chmod(paths[k], 0o600)  # readable by group or others: refused at start
    return paths


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
                    reason="needs root, unshare and ip (a private network namespace)")
@pytest.mark.parametrize("workers", [1, 2])
def test_the_addresses_of_one_ipv6_prefix_are_one_client(tmp_path, tls_and_passwords, workers):
    """With the default ``smtpd_client_ipv6_prefix_length`` (84), at one worker and at two (the supervisor's
    anvil): 8 connections at once from 8 addresses of one /84 get 5 greetings and 3 ``421 ... too many
    connections from <the real address>`` (limit 5), while an address of another /84 of the same /64 is
    greeted; 12 connections in a row from 12 addresses of one /84 get 10 greetings, then 421 (10 a minute);
    5 wrong AUTHs from 5 addresses of one /84 get 535 three times, then 450 (3 a minute), the events naming
    each real address. IPv4 is unchanged: 8 addresses are 8 clients, one address is one. After ``mtaq
    reload`` with the key at 128 (reloadable), 8 addresses of one /84 are 8 clients again."""
    p = tls_and_passwords
    run = subprocess.run(["unshare", "-n", sys.executable, __file__, str(tmp_path), p["cert"], p["key"], p["ca"],
                          p["passwd"], str(workers)], capture_output=True, text=True, timeout=90)
    assert 0 == run.returncode, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    greeted = [g for g in got["a"] if g.startswith("220")]
    refused = sorted(g for g in got["a"] if not g.startswith("220"))
    assert COUNT_LIMIT == len(greeted), got["a"]
    assert 8 - COUNT_LIMIT == len(refused), got["a"]
    for line in refused:  # the reply names the address that connected, not its prefix
        assert line.startswith(f"421 4.7.0 {HOST} Error: too many connections from 2001:db8:1::"), line
        assert "/" not in line
    assert got["d"].startswith("220"), got["d"]
    assert ["220"] * RATE_LIMIT + ["421"] * 2 == got["b"]
    assert [535] * AUTH_LIMIT + [450] * 2 == got["c"]
    assert [C.format(k) for k in range(1, AUTH_LIMIT + 1)] == got["auth_failed"]
    assert [C.format(k) for k in range(AUTH_LIMIT + 1, 6)] == got["auth_rate_limited"]
    assert ["220"] * 8 == got["v4_many"]
    assert ["220"] * COUNT_LIMIT + ["421"] * (8 - COUNT_LIMIT) == got["v4_one"]
    assert 0 == got["reload"][0], got["reload"][1]
    assert ["220"] * 8 == got["e"]  # reloaded to 128 bits: 8 addresses of one /84 are 8 clients


if __name__ == "__main__":  # inside `unshare -n`: see the module docstring
    print(json.dumps(_in_namespace(*sys.argv[1:6], workers=int(sys.argv[6]))))
