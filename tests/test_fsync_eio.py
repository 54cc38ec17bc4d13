"""A real fsync failing with EIO in the real daemon (libfiu's fiu-run / fiu-ctrl, Debian fiu-utils).

The daemon runs under ``fiu-run -x``; once some mail is queued and delivered, ``fiu-ctrl`` makes every
fsync(2) and fdatasync(2) of the process fail with EIO. The next client must get ``451 4.3.0`` (never a 250), the daemon
must exit with status 75 (EX_TEMPFAIL) instead of retrying the fsync and trusting it, and a restart
(without the fault) recovers from what is on the disk: everything acknowledged is delivered.
"""

from __future__ import annotations

import os
import pwd
import shutil
import smtplib
import subprocess
import time
from pathlib import Path

import pytest

from mtaq.testing.procs import (
    mail_owner_ready,
    maildir_count,
    maildir_message_ids,
    read_events,
    start_daemon,
    start_sink,
)


def send(port: int, i: int) -> tuple[int, bytes]:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail("a@example.org")
        s.rcpt("b@example.net")
        return s.data(f"Subject: {i}\r\nMessage-ID: <eio.{i}@test>\r\n\r\nbody {i}\r\n".encode())


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(120)
def test_fsync_eio_answers_451_exits_75_and_a_restart_delivers_everything_acknowledged(tmp_path: Path) -> None:
    """EIO from fsync: 451 4.3.0 to the waiting client, exit status 75, then recovery re-reads the disk."""
    assert shutil.which("fiu-run") and shutil.which("fiu-ctrl"), "fiu-utils missing (make test installs it)"
    spool, maildir = str(tmp_path / "spool"), str(tmp_path / "maildir")
    log = str(tmp_path / "daemon.log")
    sink = start_sink(maildir, str(tmp_path / "sink.log"))
    # libfiu's control FIFOs are made by the process at its start: one that switched from root to mail_owner
    # (issue 32.9) could no longer open them, so as root the daemon runs as mail_owner from the start (setpriv,
    # as under a systemd unit with User=), on a spool that is that user's.
    wrapper = ["fiu-run", "-x"]
    if os.geteuid() == 0:
        mail_owner_ready(spool)
        pw = pwd.getpwnam("mtaq")
        os.mkdir(spool, 0o700)
        os.chown(spool, pw.pw_uid, pw.pw_gid)
        wrapper = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *wrapper]
    daemon = start_daemon(spool, sink.port, log, wrapper=wrapper)
    try:
        assert [250, 250, 250] == [send(daemon.port, i)[0] for i in range(3)]
        wait_for(lambda: maildir_count(maildir) == 3, 20, "3 deliveries")
        time.sleep(0.5)  # let the delivery records' commit finish before the disk "fails"
        # fsync(2) and fdatasync(2) (segments are made durable with fdatasync, directories with fsync)
        subprocess.run(["fiu-ctrl", "-c", "enable name=posix/io/sync/fsync,failinfo=5",
                        "-c", "enable name=posix/io/sync/fdatasync,failinfo=5", str(daemon.popen.pid)],
                       check=True, timeout=10)
        code, text = send(daemon.port, 3)
        assert (451, True) == (code, text.startswith(b"4.3.0 ")), (code, text)
        assert 75 == daemon.popen.wait(timeout=15)
        fatal = [e for e in read_events(log) if e.get("event") == "storage_fatal"]
        assert 1 == len(fatal) and 75 == fatal[0]["exit_status"]

        daemon = start_daemon(spool, sink.port, log, port=daemon.port)  # no fault injection now
        assert 250 == send(daemon.port, 4)[0]
        want = {f"<eio.{i}@test>" for i in (0, 1, 2, 4)}

        def all_there():
            m = maildir_message_ids(maildir)
            return m if want <= m.keys() else None

        ids = wait_for(all_there, 20, "acknowledged mail delivered after the restart")
        assert all(1 == ids[f"<eio.{i}@test>"] for i in (0, 1, 2, 4))
        assert 2 == sum(1 for e in read_events(log) if e.get("event") == "recovery_complete")
    finally:
        daemon.kill9()
        sink.kill9()
