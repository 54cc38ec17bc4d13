"""A crash at each named point (issue 4): the daemon SIGKILLs itself there, restarts, and nothing is lost.

Real processes: ``mtaq serve`` with ``MTAQ_KILL_POINT`` set, ``mtaq sink``, smtplib clients. After the
self-inflicted kill the daemon is started again without the variable; every acknowledged message must
arrive, and ``mtaq log verify`` must accept the log.
"""

from __future__ import annotations

import smtplib
import subprocess
import sys
import time

import pytest

from mtaq.testing.procs import maildir_message_ids, read_events, start_daemon, start_sink


def send(port: int, i: int, size: int = 200) -> bool:
    """One message; True if it got 250 (acknowledged)."""
    msg = f"Subject: k{i}\r\nMessage-ID: <k{i}@kill.test>\r\n\r\n".encode() + (b"y" * 76 + b"\r\n") * (size // 78 + 1)
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=15) as s:
            s.sendmail("a@example.org", ["b@example.net"], msg)
        return True
    except (smtplib.SMTPException, OSError):
        return False


class Setup:
    def __init__(self, tmp, config: str = "") -> None:
        self.tmp = tmp
        self.spool = str(tmp / "spool")
        self.maildir = str(tmp / "maildir")
        (tmp / "mtaq.toml").write_text("checkpoint_interval_s = 0.5\n" + config)
        self.sink = start_sink(self.maildir, str(tmp / "sink.log"))
        self.port: int | None = None
        self.daemon = None

    def start(self, env: dict[str, str] | None = None, *, may_die: bool = False):
        try:
            self.daemon = start_daemon(self.spool, self.sink.port, str(self.tmp / "daemon.log"), port=self.port,
                                       config=str(self.tmp / "mtaq.toml"), env=env)
        except RuntimeError:
            if not may_die:  # the kill point can come before the port is seen listening
                raise
            self.daemon = None
            return None
        self.port = self.daemon.port
        return self.daemon

    def died_of_sigkill_at_start(self) -> None:
        if self.daemon is not None:
            self.died_of_sigkill()

    def died_of_sigkill(self, timeout_s: float = 30.0) -> None:
        assert -9 == self.daemon.popen.wait(timeout=timeout_s)

    def delivered(self, ids: set[str], timeout_s: float = 30.0, copies: int = 1) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = maildir_message_ids(self.maildir)
            if all(got.get(i, 0) >= copies for i in ids):
                return dict(got)
            time.sleep(0.1)
        raise AssertionError(f"missing {sorted(ids - set(maildir_message_ids(self.maildir)))}")

    def verify(self) -> None:
        self.daemon.kill9()
        out = subprocess.run([sys.executable, "-m", "mtaq.cli", "log", "verify", "--spool", self.spool],
                             capture_output=True, text=True, check=False)
        assert 0 == out.returncode, out.stdout + out.stderr

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.kill9()
        self.sink.kill9()


@pytest.fixture
def setup(tmp_path):
    made = []

    def make(config: str = "") -> Setup:
        s = Setup(tmp_path, config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_crash_after_the_fsync_before_the_250_delivers_the_unacknowledged_message(setup):
    """Durable but unanswered: the client sees the connection drop; the message is delivered after restart."""
    s = setup()
    s.start({"MTAQ_KILL_POINT": "edge.after_commit"})
    assert not send(s.port, 1)
    s.died_of_sigkill()
    s.start()
    assert {"<k1@kill.test>": 1} == s.delivered({"<k1@kill.test>"})
    s.verify()


def test_crash_after_the_remote_250_before_our_delivery_record_retries_as_outcome_unknown(setup):
    """The next hop has the message, our record of it is not durable: after restart the recipient is
    'outcome unknown' and delivered again (at-least-once, GUIDE I4); nothing is lost."""
    s = setup()
    s.start({"MTAQ_KILL_POINT": "delivery.after_remote_reply"})
    assert send(s.port, 2)
    s.died_of_sigkill()
    s.start()
    got = s.delivered({"<k2@kill.test>"}, copies=2)
    assert 2 == got["<k2@kill.test>"]
    assert [("b@example.net",)] == [(e["recipient"],) for e in read_events(s.daemon.log_path) if e.get("event") == "outcome_unknown"]
    s.verify()


def test_crash_in_the_middle_of_a_checkpoint_loses_nothing(setup):
    """Killed with the new checkpoint fsync'd as a temp file but not renamed: the old one stays in force."""
    s = setup()
    s.start({"MTAQ_KILL_POINT": "checkpoint.after_tmp", "MTAQ_KILL_AFTER": "3"})
    acked = {f"<k{i}@kill.test>" for i in range(10, 30) if send(s.port, i)}
    s.died_of_sigkill()
    s.start()
    assert acked <= set(s.delivered(acked))
    s.verify()


def test_crash_in_the_middle_of_reclaiming_segments_loses_nothing(setup):
    """Killed after unlinking the first of several garbage segments: the next start copes with the rest."""
    s = setup("segment_bytes_max = 65536\n")
    s.start({"MTAQ_KILL_POINT": "reclaim.after_first_unlink"})
    acked = set()
    for i in range(100, 300):
        if send(s.port, i, size=2048):
            acked.add(f"<k{i}@kill.test>")
        if s.daemon.popen.poll() is not None:
            break
    assert len(acked) >= 20, "too few messages for the segments to roll: the test would not test anything"
    s.died_of_sigkill()
    s.start()
    more = {f"<k{i}@kill.test>" for i in range(200, 205) if send(s.port, i)}
    assert acked | more <= set(s.delivered(acked | more))
    s.verify()


def test_crash_during_recovery_then_recovery_again_loses_nothing(setup):
    """An attempt open at a crash, then a crash during the recovery that would conclude it: the third
    start concludes it and the message is delivered (GUIDE I5: recovery is idempotent)."""
    s = setup()
    s.start({"MTAQ_KILL_POINT": "delivery.after_remote_reply"})
    assert send(s.port, 3)
    s.died_of_sigkill()
    port = s.port
    s.start({"MTAQ_KILL_POINT": "recovery.before_conclude"}, may_die=True)
    s.died_of_sigkill_at_start()
    s.port = port
    s.start()
    assert 2 == s.delivered({"<k3@kill.test>"}, copies=2)["<k3@kill.test>"]
    s.verify()
