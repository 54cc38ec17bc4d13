"""Issue 32.9: started as root, the daemon binds, then runs as mail_owner (Postfix mail_owner).

The tests run as root, so every daemon they start switches; these check it from outside: /proc/PID/status
of the daemon and its workers while a client relays through a port below 1024, the spool's owners after a
run and after ``mtaq queue`` as root, and the one-line refusals (no such mail_owner, unsafe modes).
"""

from __future__ import annotations

import os
import pwd
import shutil
import smtplib
import subprocess
import sys
from pathlib import Path

import pytest

from mtaq.testing.procs import (
    children,
    low_free_port,
    mail_owner_ready,
    maildir_count,
    proc_status,
    start_daemon,
    start_sink,
    wait_for,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the switch happens only when started as root")

OWNER = "mtaq"


def _mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=60)


def _ids(pid: int) -> dict[str, list[str]]:
    """Uid, Gid, Groups, CapEff, CapPrm, CapAmb of /proc/PID/status."""
    keep = ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapAmb")
    return {k: v for k, v in proc_status(pid).items() if k in keep}


def _root_owned(top: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(top):
        for name in [".", *dirs, *files]:
            path = os.path.normpath(os.path.join(root, name))
            st = os.lstat(path)
            if st.st_uid == 0 or st.st_gid == 0:
                found.append(path)
    return sorted(found)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_serving_processes_run_as_mail_owner_while_a_port_below_1024_is_bound(tmp_path: Path, workers: int) -> None:
    mail_owner_ready(str(tmp_path))
    pw = pwd.getpwnam(OWNER)
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    port = low_free_port()
    spool = str(tmp_path / "spool")
    os.makedirs(spool)  # made by root, as a test or an administrator would: given to mail_owner at start
    archive = tmp_path / "archive"
    (tmp_path / "c.toml").write_text(f'archive_dir = "{archive}"\ncheckpoint_interval_s = 0.2\n')
    d = start_daemon(spool, sink.port, str(tmp_path / "daemon.log"), port=port, workers=workers,
                     config=str(tmp_path / "c.toml"))
    try:
        workers_pids = wait_for(lambda: children(d.popen.pid) if len(children(d.popen.pid)) == workers else None,
                                10, "the workers") if workers > 1 else []
        pids = [d.popen.pid, *workers_pids]
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:  # a session open while the ids are read
            c.ehlo("client.test")
            c.sendmail("a@client.test", ["b@dest.test"], b"Subject: t\r\n\r\nbody\r\n")
            held = {pid: _ids(pid) for pid in pids}
            assert f":{port:04X} " in Path("/proc/net/tcp").read_text()  # still bound
        uid, gid = str(pw.pw_uid), str(pw.pw_gid)
        for ids in held.values():
            assert [uid] * 4 == ids["Uid"]
            assert [gid] * 4 == ids["Gid"]
            assert [gid] == ids["Groups"]
            assert ["0000000000000000"] * 3 == [ids["CapEff"][0], ids["CapPrm"][0], ids["CapAmb"][0]]
        wait_for(lambda: maildir_count(str(tmp_path / "maildir")) == 1, 20, "the relayed message")
        shard0 = Path(spool, "checkpoint")
        wait_for(lambda: shard0.exists() and shard0.stat().st_uid == pw.pw_uid, 10, "a checkpoint by mail_owner")
        # mtaq queue and mtaq log run as root against the running daemon's spool leave nothing root-owned there
        assert 0 == _mtaq("queue", "list", "--spool", spool).returncode
        assert 0 == _mtaq("queue", "size", "--spool", spool).returncode
        assert 0 == _mtaq("log", "verify", "--spool", spool).returncode
        assert [] == _root_owned(spool)
        assert [] == _root_owned(str(archive))
    finally:
        d.kill9()
        sink.kill9()
    # What root leaves there while the daemon is down (a restored file) is given back at the next start.
    Path(spool, "restored").write_text("x")
    # ... but not a file elsewhere that a hard link in the spool names (root would give it away).
    secret = tmp_path / "secret"
    secret.write_text("root's")
    os.link(secret, Path(spool, "linked"))
    d = start_daemon(spool, sink.port, str(tmp_path / "daemon2.log"), port=port, workers=workers)
    try:
        assert [os.path.join(spool, "linked")] == _root_owned(spool)
        assert 0 == secret.stat().st_uid
    finally:
        d.kill9()


def test_started_as_root_without_a_usable_mail_owner_exits_2_with_one_line(tmp_path: Path) -> None:
    mail_owner_ready(str(tmp_path))
    for name, why in [("nosuchuser-mtaq", "no such user (started as root, mtaq runs as mail_owner; create it: "
                                          "useradd --system --no-create-home --shell /usr/sbin/nologin nosuchuser-mtaq)"),
                      ("root", "must not be root (uid 0, gid 0)")]:
        (tmp_path / "c.toml").write_text(f'mail_owner = "{name}"\n')
        out = _mtaq("serve", "--config", str(tmp_path / "c.toml"), "--spool", str(tmp_path / "spool"),
                    "--listen", "127.0.0.1:0", "--workers", "1")
        assert (2, [f"mtaq: mail_owner '{name}': {why}"]) == (out.returncode, out.stderr.splitlines())


def test_a_spool_writable_by_others_and_a_tls_key_readable_by_group_are_refused(tmp_path: Path) -> None:
    mail_owner_ready(str(tmp_path))
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o777)
    out = _mtaq("serve", "--spool", str(spool), "--listen", "127.0.0.1:0", "--workers", "1")
    assert (2, [f"mtaq: spool: {spool} has mode 0777: it must not be writable by others (chmod o-w)"]) == (
        out.returncode, out.stderr.splitlines())
    spool.chmod(0o755)
    key = tmp_path / "key.pem"
    key.write_text("not read: refused before\n")
    key.chmod(0o640)
    (tmp_path / "c.toml").write_text(f'tls_cert_file = "{tmp_path}/cert.pem"\ntls_key_file = "{key}"\n')
    out = _mtaq("serve", "--config", str(tmp_path / "c.toml"), "--spool", str(spool), "--listen", "127.0.0.1:0",
                "--workers", "1")
    assert (2, [f"mtaq: tls_key_file: {key} has mode 0640: it must be readable only by its owner (chmod 600)"]) == (
        out.returncode, out.stderr.splitlines())


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
def test_as_a_systemd_unit_with_user_and_cap_net_bind_service_nothing_is_switched(tmp_path: Path) -> None:
    """``User=mtaq`` + ``AmbientCapabilities=CAP_NET_BIND_SERVICE`` (here: setpriv, which sets up the same
    process): not root, so no switch; the capability binds the low port; the spool is the user's already."""
    mail_owner_ready(str(tmp_path))
    pw = pwd.getpwnam(OWNER)
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    os.chown(spool, pw.pw_uid, pw.pw_gid)
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    port = low_free_port()
    unit = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
            "--inh-caps=+net_bind_service", "--ambient-caps=+net_bind_service"]
    d = start_daemon(str(spool), sink.port, str(tmp_path / "daemon.log"), port=port, wrapper=unit)
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as c:
            c.sendmail("a@client.test", ["b@dest.test"], b"Subject: t\r\n\r\nbody\r\n")
            assert [str(pw.pw_uid)] * 4 == _ids(d.popen.pid)["Uid"]
        wait_for(lambda: maildir_count(str(tmp_path / "maildir")) == 1, 20, "the relayed message")
        assert [] == _root_owned(str(spool))
    finally:
        d.kill9()
        sink.kill9()
