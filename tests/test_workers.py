"""Several worker processes on one port, one spool shard each (mtaq.daemon.workers): every message delivered once,
crash-only supervision, shards never stranded, queue IDs unique across shards, log tools over all shards."""

from __future__ import annotations

import errno
import os
import re
import signal
import smtplib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mtaq.queue.store
from mtaq.daemon.workers import WORKERS_MAX, existing_shards, log_dirs, shard_count, shard_dir
from mtaq.queue.store import new_queue_id, set_queue_id_shard
from mtaq.testing.procs import (
    Proc,
    free_port,
    log_problems,
    maildir_message_ids,
    read_events,
    start_daemon,
    start_sink,
    wait_for,
)

_B32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def _shard_of(queue_id: str) -> int:
    return _B32.index(queue_id[-1]) & 0xF


def _send(port: int, n: int, tag: str, *, timeout: float = 30) -> list[str]:
    """``n`` messages, each on its own connection (so that they spread over the workers)."""
    replies = []
    for i in range(n):
        msg = f"From: a@example.org\r\nTo: b@example.net\r\nMessage-ID: <{tag}.{i}@test>\r\n\r\nbody {i}\r\n"
        with smtplib.SMTP("127.0.0.1", port, timeout=timeout) as s:
            s.ehlo("client.test")
            s.mail("a@example.org")
            s.rcpt("b@example.net")
            code, text = s.data(msg.encode())
            assert 250 == code, text
            replies.append(text.decode())
    return replies


def _mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=60)


def test_shard_directories_and_how_many_workers_start(tmp_path: Path) -> None:
    """Shard 0 is the spool itself, shard k is SPOOL/shard-k; a spool that holds shard 3 starts 4 workers
    even when 1 is configured; more shards than queue IDs can tell apart is an error."""
    spool = str(tmp_path / "spool")
    assert spool == shard_dir(spool, 0)
    assert os.path.join(spool, "shard-2") == shard_dir(spool, 2)
    assert [] == existing_shards(spool)
    assert 1 == shard_count(spool, 1)
    assert 2 == shard_count(spool, 2)
    os.makedirs(os.path.join(spool, "shard-3", "log"))
    os.makedirs(os.path.join(spool, "shard-x"))
    (tmp_path / "spool" / "shard-5").write_text("not a directory")
    assert [3] == existing_shards(spool)
    assert 4 == shard_count(spool, 1)
    assert [(0, os.path.join(spool, "log")), (3, os.path.join(spool, "shard-3", "log"))] == log_dirs(spool)
    os.makedirs(os.path.join(spool, f"shard-{WORKERS_MAX}"))
    with pytest.raises(ValueError, match="workers"):
        shard_count(spool, 1)


def test_a_queue_id_is_the_15_base32_symbols_of_its_microseconds_and_random_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue ID spells (microseconds since the epoch << 20 | 20 random bits) in Crockford base32, most
    significant symbol first, 15 symbols: IDs sort by time. Checked against the number written out."""
    monkeypatch.setattr(mtaq.queue.store, "_shard", -1)
    monkeypatch.setattr(mtaq.queue.store, "_last_us", 0)
    monkeypatch.setattr(mtaq.queue.store.os, "urandom", lambda n: bytes([0xAB, 0xCD, 0xEF])[:n])
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    for ts in (1_700_000_000.25, 1_800_000_000.0, 4_000_000_000.999999):
        us = int(ts * 1_000_000)
        n = (us << 20) | 0xBCDEF
        want = "".join(alphabet[(n >> (5 * k)) & 31] for k in range(14, -1, -1))
        got = new_queue_id(ts)
        assert want == got and 15 == len(got)
    monkeypatch.setattr(mtaq.queue.store, "_last_us", 0)
    later = [new_queue_id(t) for t in (1_700_000_000.0, 1_700_000_000.000001, 1_700_000_001.0, 2_000_000_000.0)]
    assert later == sorted(later) and 4 == len(set(later))


def test_queue_ids_of_a_worker_carry_its_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """In worker k, every queue ID's low 4 bits are k: two workers can never make the same ID."""
    monkeypatch.setattr(mtaq.queue.store, "_shard", -1)
    for shard in (0, 5, 15):
        set_queue_id_shard(shard)
        ids = [new_queue_id(1_700_000_000.0) for _ in range(50)]
        assert [shard] * 50 == [_shard_of(q) for q in ids]
        assert 50 == len(set(ids))
    with pytest.raises(ValueError):
        set_queue_id_shard(16)
    set_queue_id_shard(None)  # IDs of no shard again: random low bits, as a one-worker daemon makes them
    assert len({_shard_of(new_queue_id(1_700_000_000.0)) for _ in range(200)}) > 1


def test_two_workers_share_the_port_and_deliver_every_message_once(tmp_path: Path) -> None:
    """With workers = 2, both workers accept from the one port, and a worker that is busy (here: stopped)
    holds no new connection: with one worker stopped, 20 clients in a row are all served by the other (with
    SO_REUSEPORT, the kernel gave about half of them to the stopped one, where they waited for a greeting);
    then the other way round. Each message is delivered exactly once; every line of the shared log file is
    one whole JSON event; each shard's log holds only IDs of its shard, 20 each; log verify checks both
    shards and passes."""
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    (tmp_path / "mtaq.toml").write_text("workers = 2\n")
    spool = str(tmp_path / "spool")
    daemon = start_daemon(spool, sink.port, str(tmp_path / "daemon.log"), config=str(tmp_path / "mtaq.toml"), workers=None)
    try:
        kids = wait_for(lambda: (k := daemon.children()) and len(k) == 2 and k, 20, "two workers")
        for n, (stopped, tag) in enumerate(((kids[0], "w2a"), (kids[1], "w2b"))):
            os.kill(stopped, signal.SIGSTOP)
            try:
                _send(daemon.port, 20, tag, timeout=10)
            finally:
                os.kill(stopped, signal.SIGCONT)
            want = 20 * (n + 1)
            wait_for(lambda: len(maildir_message_ids(str(tmp_path / "maildir"))) >= want, 60, "deliveries")  # noqa: B023
        ids = maildir_message_ids(str(tmp_path / "maildir"))
        assert {f"<{t}.{i}@test>": 1 for t in ("w2a", "w2b") for i in range(20)} == dict(ids)
    finally:
        daemon.kill9()
        sink.kill9()
    assert [] == daemon.children()
    _bad, not_json = log_problems(daemon.log_path)
    assert [] == not_json  # both workers write events to one file: each line is one whole event
    dump = _mtaq("log", "dump", "--spool", spool)
    assert 0 == dump.returncode, dump.stderr
    per_shard: dict[int, set[str]] = {}
    shard = -1
    for line in dump.stdout.splitlines():
        m = re.match(r"# shard (\d+): ", line)
        if m:
            shard = int(m.group(1))
        elif " ENVELOPE " in line:
            per_shard.setdefault(shard, set()).add(line.split()[2])
    assert {0: 20, 1: 20} == {k: len(v) for k, v in per_shard.items()}
    for k, qids in per_shard.items():
        assert {k} == {_shard_of(q) for q in qids}
    verify = _mtaq("log", "verify", "--spool", spool)
    assert 0 == verify.returncode, verify.stdout + verify.stderr
    assert 2 == verify.stdout.count(": sound (")


def test_kill9_of_the_supervisor_stops_every_worker_and_a_restart_with_fewer_workers_delivers_all(
    tmp_path: Path,
) -> None:
    """Mail deferred in both shards survives kill -9 of the supervisor (which takes its workers with it);
    a restart configured with workers = 1 still starts a worker for shard 1, and every message is then
    delivered exactly once."""
    maildir = str(tmp_path / "maildir")
    deferring = start_sink(maildir, str(tmp_path / "sink1.log"), extra=["--defer-rcpt", ".*"])
    conf = tmp_path / "mtaq.toml"
    conf.write_text("workers = 2\nretry_intervals_s = [1.0]\n")
    spool = str(tmp_path / "spool")
    daemon: Proc | None = start_daemon(spool, deferring.port, str(tmp_path / "daemon1.log"), config=str(conf), workers=None)
    sink: Proc | None = None
    try:
        assert daemon is not None
        wait_for(lambda: len(daemon.children()) == 2, 20, "two workers")
        kids = daemon.children()
        _send(daemon.port, 30, "k9")
        wait_for(lambda: len([e for e in read_events(daemon.log_path) if e.get("event") == "deferred"]) >= 30, 30,
              "30 deferrals")
        daemon.kill9()
        assert not [p for p in kids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        assert [1] == existing_shards(spool)
        deferring.kill9()
        sink = start_sink(maildir, str(tmp_path / "sink2.log"), port=deferring.port)
        conf.write_text("workers = 1\nretry_intervals_s = [1.0]\n")
        daemon = start_daemon(spool, sink.port, str(tmp_path / "daemon2.log"), config=str(conf), port=daemon.port,
                              workers=None)
        wait_for(lambda: len(maildir_message_ids(maildir)) >= 30, 60, "30 deliveries after the restart")
        time.sleep(1.0)
        assert {f"<k9.{i}@test>": 1 for i in range(30)} == dict(maildir_message_ids(maildir))
        shards = {e.get("shard") for e in read_events(daemon.log_path) if e.get("event") == "recovery_complete"}
        assert {0, 1} == shards
    finally:
        if daemon is not None:
            daemon.kill9()
        deferring.kill9()
        if sink is not None:
            sink.kill9()


def _sockets_on(port: int) -> str:
    """The TCP sockets whose local port is ``port``, with their processes, as ``ss`` lists them."""
    return subprocess.run(["ss", "-tanp", f"sport = :{port}"], capture_output=True, text=True, check=False).stdout


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_kill9_of_the_supervisor_alone_takes_workers_that_switched_to_mail_owner_with_it(tmp_path: Path) -> None:
    """Review finding F8: started as root, each worker switches to mail_owner, and Linux clears the
    parent-death signal (PR_SET_PDEATHSIG) on that change of uid and gid. kill -9 of the supervisor only (not
    its workers: what an OOM killer or an administrator does): both workers are gone within 10 s and the port
    can be bound again (before: they went on serving port 25 under init, and the next `mtaq serve` failed with
    Address already in use)."""
    assert 0 == os.geteuid()  # the tests run as root: the workers switch to mail_owner
    daemon = start_daemon(str(tmp_path / "spool"), free_port(), str(tmp_path / "daemon.log"), workers=2)
    kids: list[int] = []
    try:
        kids = wait_for(lambda: (k := daemon.children()) and len(k) == 2 and k, 20, "two workers")
        wait_for(lambda: 2 == len([e for e in read_events(daemon.log_path) if e.get("event") == "listening"]), 20,
                 "both workers listening")
        assert [True, True] == [os.stat(f"/proc/{pid}").st_uid != 0 for pid in kids]  # switched
        os.kill(daemon.popen.pid, signal.SIGKILL)
        assert -signal.SIGKILL == daemon.popen.wait(timeout=20)
        wait_for(lambda: not [p for p in kids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"], 10,
                 "both workers to be gone")
        held = _sockets_on(daemon.port)
        assert "LISTEN" not in held, held  # no worker (nor anything else) serves the port
        # Bound as the next `mtaq serve` binds (mtaq.daemon.workers.bind_listeners). Seen once (stop 46, 1 run
        # in 20): EADDRINUSE here with both workers gone; retried for 5 s, and if it persists the sockets on
        # the port are in the failure, to tell what held it.
        for attempt in range(26):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", daemon.port))
                    s.listen()
                    break
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE or attempt == 25:
                        raise AssertionError(f"port {daemon.port}: {exc}; sockets: {_sockets_on(daemon.port)}") from exc
            time.sleep(0.2)
    finally:
        for pid in kids:  # before the fix they outlive the supervisor: daemon.kill9 no longer sees them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon.kill9()


def test_a_worker_that_dies_takes_the_supervisor_and_the_other_workers_down(tmp_path: Path) -> None:
    """Crash-only: kill -9 of one worker ends the supervisor with status 137 (128 + SIGKILL) after it has
    killed the other worker, and the supervisor logs worker_exited naming the shard."""
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    (tmp_path / "mtaq.toml").write_text("workers = 2\n")
    daemon = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "daemon.log"),
                          config=str(tmp_path / "mtaq.toml"), workers=None)
    try:
        kids = wait_for(lambda: (k := daemon.children()) and len(k) == 2 and k, 20, "two workers")
        os.kill(kids[0], signal.SIGKILL)
        assert 137 == daemon.popen.wait(timeout=20)
        wait_for(lambda: not [p for p in kids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"], 10,
              "the other worker to be gone")
        exited = [e for e in read_events(daemon.log_path) if e.get("event") == "worker_exited"]
        assert 1 == len(exited)
        assert 137 == exited[0]["exit_status"]
        assert exited[0]["shard"] in (0, 1)
    finally:
        daemon.kill9()
        sink.kill9()


def test_several_workers_need_a_fixed_port(tmp_path: Path) -> None:
    """Port 0 would give each worker a port of its own: refused with a one-line message naming the key."""
    res = _mtaq("serve", "--spool", str(tmp_path / "spool"), "--listen", "127.0.0.1:0", "--workers", "2")
    assert 2 == res.returncode
    assert "workers: 2 workers need a fixed listen port" in res.stderr
    assert 1 == len(res.stderr.strip().splitlines())


@pytest.mark.parametrize("config", ["sasl", "auth"])
def test_a_bad_secret_file_stops_serve_before_any_worker_starts(tmp_path, config):
    """With workers = 2, an outbound password file or an inbound TLS/password setting that cannot be used is
    reported as with one process: exit 2 and one line naming the key (it was exit 70 and a traceback from
    inside a worker)."""
    pw = tmp_path / "pw"
    pw.write_text("[smtp.example.com]:587 user:secret\n")
    pw.chmod(0o640)
    if config == "sasl":
        text, key = f'smtp_sasl_auth_enable = true\nsmtp_sasl_password_file = "{pw}"\n', "smtp_sasl_password_file"
    else:
        text, key = f'auth_password_file = "{pw}"\n', "auth_password_file"
    (tmp_path / "c.toml").write_text(text)
    out = _mtaq("serve", "--config", str(tmp_path / "c.toml"), "--spool", str(tmp_path / "spool"),
                  "--listen", f"127.0.0.1:{free_port()}", "--admin-listen", "", "--workers", "2")
    assert (2, 1) == (out.returncode, len(out.stderr.strip().splitlines())), out.stderr
    assert key in out.stderr and "Traceback" not in out.stderr


def test_a_worker_that_cannot_start_says_so_in_one_line(tmp_path: Path) -> None:
    """A start-up failure inside worker 1 that the supervisor's checks cannot see (here its admin socket path
    is a directory it cannot replace) ends serve with status 1 and one ``mtaq: cannot serve: worker 1: ...``
    line naming the path, as one process says it from the CLI; it was status 70 and a traceback."""
    blocker = tmp_path / "spool" / "shard-1" / "admin.sock"
    (blocker / "x").mkdir(parents=True)
    out = _mtaq("serve", "--spool", str(tmp_path / "spool"), "--listen", f"127.0.0.1:{free_port()}",
                "--admin-listen", f"127.0.0.1:{free_port()}", "--relayhost", "[127.0.0.1]:9", "--workers", "2")
    assert 1 == out.returncode, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("mtaq: ")]
    assert [f"mtaq: cannot serve: worker 1: Is a directory: {blocker}"] == lines, out.stderr
    assert "Traceback" not in out.stderr


def test_a_second_daemon_on_the_same_port_is_refused(tmp_path: Path) -> None:
    """A second ``mtaq serve --workers 2`` started by mistake on the port of a running one (another spool)
    exits 1 with one line, and the first keeps every connection: with SO_REUSEPORT on both, the second
    bound the same port and the kernel silently split new mail between the two spools."""
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    daemon = start_daemon(str(tmp_path / "spool1"), sink.port, str(tmp_path / "daemon.log"), workers=2)
    try:
        out = _mtaq("serve", "--spool", str(tmp_path / "spool2"), "--listen", f"127.0.0.1:{daemon.port}",
                    "--admin-listen", "", "--relayhost", "[127.0.0.1]:9", "--workers", "2")
        assert (1, [f"mtaq: cannot serve: listen 127.0.0.1:{daemon.port}: Address already in use"]) == (
            out.returncode, out.stderr.strip().splitlines()), out.stderr
        _send(daemon.port, 4, "one")
        wait_for(lambda: len(maildir_message_ids(str(tmp_path / "maildir"))) >= 4, 60, "4 deliveries")
    finally:
        daemon.kill9()
        sink.kill9()


def test_admin_listen_on_an_smtp_listener_is_one_line(tmp_path: Path) -> None:
    """``admin_listen`` on the address of an SMTP listener: with two workers as with one, exit 1 and the one
    line ``mtaq: cannot serve: admin_listen HOST:PORT: Address already in use``, nothing else. The supervisor
    checked admin_listen before it bound the SMTP listeners, so the clash was found by worker 0 (a line
    naming worker 0, then a worker_exited event)."""
    port = free_port()
    for workers in ("1", "2"):
        out = _mtaq("serve", "--spool", str(tmp_path / f"spool{workers}"), "--listen", f"127.0.0.1:{port}",
                    "--admin-listen", f"127.0.0.1:{port}", "--relayhost", "[127.0.0.1]:9", "--workers", workers)
        assert (1, [f"mtaq: cannot serve: admin_listen 127.0.0.1:{port}: Address already in use"]) == (
            out.returncode, (out.stdout + out.stderr).strip().splitlines()), (workers, out.stdout, out.stderr)


def test_an_ipv6_listener_in_use_is_named_in_brackets(tmp_path: Path, ipv6_port_taken: int) -> None:
    """The one line for an IPv6 listener that cannot be bound names it as it is written, ``[::1]:PORT`` (it
    said ``listen ::1:PORT``, which reads as another address)."""
    port = ipv6_port_taken
    out = _mtaq("serve", "--spool", str(tmp_path / "spool"), "--listen", f"[::1]:{port}",
                "--admin-listen", "", "--relayhost", "[127.0.0.1]:9", "--workers", "2")
    assert (1, [f"mtaq: cannot serve: listen [::1]:{port}: Address already in use"]) == (
        out.returncode, out.stderr.strip().splitlines()), out.stderr
