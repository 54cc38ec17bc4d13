"""Listing a large queue (issue 36.2): ``mtaq queue list --json`` against Postfix's ``postqueue -j`` over the
same number of deferred messages, alternating, medians of ``--pairs``.

1. mtaq: ``mtaq.testing.prefill.prefill_deferred`` writes N deferred messages (``--size`` bytes of body,
   one recipient each) into a fresh spool, split evenly over the shards of ``--workers`` worker processes
   (shard k's messages carry queue IDs of shard k, as the workers write them); ``mtaq serve`` is started on
   it (relaying to a closed port, nothing is due for a day) and waits for ``recovery_complete``.
2. Postfix (the running instance ``bench/compare_postfix.py`` configures, relayhost a closed port): one
   message is sent with ``sendmail`` and becomes deferred; Postfix is stopped, the queue file is copied
   N - 1 times under new short queue IDs (mode, owner and a modification time a day ahead kept, so the
   queue manager leaves them alone) and Postfix is started again: ``postqueue -j`` asks its showq service,
   which opens and reads every queue file.
3. Each pair times ``postqueue -j > /dev/null`` and ``mtaq queue list --json > /dev/null`` (whole
   commands, wall clock; the admin API answers mtaq's). ``mtaq_first_s`` is mtaq's first listing after the
   start (the daemon reads the log into its view then; later listings bring that view forward); the pairs
   come after it. The output's line counts are checked: N lines each, or the run fails.
4. With ``--restarts R`` (issue 36.3, the backlog table of ``bench/backlog.py``): R pairs of a restart
   after ``kill -9`` on the same N queued, Postfix first: every Postfix process is killed with SIGKILL and
   ``postfix start`` spawned, mtaq's daemon is killed and ``mtaq serve`` spawned
   (``start_time.start_once``: it waits for every worker's recovery, then kills it again); each time a
   probe that started before the spawn sends one message as soon as the port accepts, and the seconds from
   the spawn to its 250 are recorded (``postfix_first_250_s``, ``mtaq_first_250_s``: every run and the
   median). The probes' messages join the queues after the listings.

Prints ONE JSON object: messages, size, workers, postfix_s (median), mtaq_s (median), ratio
(postfix_s / mtaq_s: above 1 when mtaq is faster), mtaq_first_s, runs (every time), loadavg before/after;
with ``--restarts``, ``restarts`` (every first-250 time) and the two medians.
Needs root (Postfix's queue) and Postfix installed (``make`` installs it). Run from the project root::

    PYTHONPATH=$PWD .venv/bin/python bench/list_queue.py --messages 100000 --pairs 3

Postfix's queue is emptied afterwards (``postsuper -d ALL``) and its relayhost left at the closed port
(``compare_postfix.py`` sets it again at its next run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_postfix import (
    POSTFIX_SPOOL,
    _descendants,
    _postfix_master_pid,
    configure_postfix,
    ensure_postfix_installed,
    free_port,
    log,
    run,
)
from start_time import Probe, start_once

from mtaq.testing.prefill import prefill_shards
from mtaq.testing.procs import read_events, start_daemon


def _body(size: int) -> bytes:
    head = b"From: bench@example.com\r\nTo: deferred@example.org\r\nSubject: listing bench\r\n\r\n"
    line = b"x" * 76 + b"\r\n"
    return head + line * max(1, size // len(line))


def prefill_mtaq(spool: str, n: int, size: int, workers: int) -> None:
    """N deferred messages over the shards of ``workers`` (shard k: queue IDs of shard k)."""
    body = _body(size)
    prefill_shards(spool, n, lambda i: body, workers)


def _deferred_files() -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(POSTFIX_SPOOL, "deferred")):
        out += [os.path.join(root, f) for f in files]
    return out


QUEUE_DIRS = ("incoming", "active", "deferred", "defer", "bounce", "trace", "hold", "corrupt")


def fresh_postfix_queue() -> None:
    """Postfix stopped and its (empty) queue directories made anew by ``postfix check``, as mtaq's spool is new
    for each run: an ext4 directory that once held 100,000 entries keeps its size after they are deleted, and
    every scan of it reads those blocks (a suspected bias against Postfix in later runs of a sitting; on the
    2-core machine of stop 47 its drain was no faster with fresh directories: docs/performance.md)."""
    run(["postfix", "stop"], check=False)
    for d in QUEUE_DIRS:
        shutil.rmtree(os.path.join(POSTFIX_SPOOL, d), ignore_errors=True)
    run(["postfix", "check"], check=False)


def prefill_postfix(n: int, content: bytes, timeout_s: float = 120.0) -> int:
    """N deferred messages of ``content`` in Postfix's queue (running afterwards, its relayhost a closed
    port, each next attempt a day ahead): one sent, the rest copies of its queue file. Returns the port
    Postfix's smtpd listens on (127.0.0.1)."""
    run(["postsuper", "-d", "ALL"], check=False)
    fresh_postfix_queue()
    dead = free_port()  # nothing listens there: the message is deferred at once
    listen = free_port()
    configure_postfix(listen, dead)
    subprocess.run(["sendmail", "-f", "bench@example.com", "deferred@example.org"], input=content, check=True)
    deadline = time.monotonic() + timeout_s
    while not _deferred_files():
        if time.monotonic() > deadline:
            raise RuntimeError("the message sent to Postfix did not become deferred")
        time.sleep(0.2)
    (src,) = _deferred_files()
    run(["postfix", "stop"])
    st = os.stat(src)
    later = time.time() + 86400
    base = int(time.time() * 1e6) & 0xFFFFF
    tmp = os.path.join(POSTFIX_SPOOL, "deferred", "copy.tmp")
    for i in range(n - 1):
        shutil.copyfile(src, tmp)
        # Postfix's short queue ID: 5 hex digits of microseconds, then the file's inode number in hex
        # (postsuper renames a file whose name does not match its inode when Postfix starts)
        qid = f"{(base + i) & 0xFFFFF:05X}{os.stat(tmp).st_ino:X}"
        d = os.path.join(POSTFIX_SPOOL, "deferred", qid[0])
        if not os.path.isdir(d):
            os.mkdir(d, 0o700)
            os.chown(d, st.st_uid, st.st_gid)
        os.chown(tmp, st.st_uid, st.st_gid)
        os.chmod(tmp, st.st_mode & 0o7777)
        os.utime(tmp, (later, later))
        os.rename(tmp, os.path.join(d, qid))
    os.utime(src, (later, later))
    run(["postfix", "start"])
    return listen


def postfix_restart(port: int, timeout_s: float = 60.0) -> float | None:
    """Every Postfix process killed with SIGKILL (the master and all below it), then ``postfix start``
    spawned while a :class:`start_time.Probe` waits on ``port``: seconds from the spawn to the probe's 250
    (None if none came within ``timeout_s``)."""
    master = _postfix_master_pid()
    if master is not None and os.path.exists(f"/proc/{master}"):
        pids = _descendants(master)
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
    probe = Probe(port, timeout_s)
    probe.start()
    t0 = time.time()
    p = subprocess.run(["postfix", "start"], capture_output=True, text=True)
    probe.join()
    if p.returncode != 0:
        raise RuntimeError(f"postfix start: exit {p.returncode}: {p.stderr.strip()[:300]}")
    return round(probe.t_250 - t0, 3) if probe.t_250 else None


def timed(cmd: list[str], n: int, env: dict[str, str] | None = None) -> float:
    """Wall seconds of ``cmd`` with its output counted (must be ``n`` lines)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, env=env)
    dt = time.perf_counter() - t0
    lines = p.stdout.count(b"\n")
    if p.returncode != 0 or lines != n:
        raise RuntimeError(f"{cmd[0]}: exit {p.returncode}, {lines} lines of {n}: {p.stderr[-300:]!r}")
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=1024, help="body bytes per message")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="mtaq serve --workers (the spool's shards)")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--skip-postfix", action="store_true", help="mtaq only (no ratio)")
    ap.add_argument("--restarts", type=int, default=0,
                    help="then R pairs of a restart after kill -9 under the same queue: seconds to the first 250")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.pairs < 1 or not 1 <= args.workers <= 16 or args.restarts < 0:
        ap.error("--messages and --pairs must be >= 1, --workers 1..16, --restarts >= 0")
    out: dict[str, Any] = {"bench": "list_queue", "messages": args.messages, "size": args.size,
                           "workers": args.workers, "cpus": os.cpu_count(),
                           "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    if not args.skip_postfix:
        ensure_postfix_installed()
        t = time.monotonic()
        postfix_port = prefill_postfix(args.messages, _body(args.size))
        out["postfix_prefill_s"] = round(time.monotonic() - t, 1)
        out["postfix_version"] = run(["postconf", "-h", "mail_version"]).strip()
    work = tempfile.mkdtemp(prefix="mtaq-list-", dir=args.workdir)
    spool = os.path.join(work, "spool")
    t = time.monotonic()
    prefill_mtaq(spool, args.messages, args.size, args.workers)
    out["mtaq_prefill_s"] = round(time.monotonic() - t, 1)
    mtaq = [sys.executable, "-m", "mtaq.cli", "queue", "list", "--json", "--spool", spool]
    daemon = start_daemon(spool, free_port(), os.path.join(work, "daemon.log"), workers=args.workers)
    runs: dict[str, list[float]] = {"postfix": [], "mtaq": []}
    restarts: dict[str, list[float | None]] = {"postfix": [], "mtaq": []}
    try:
        deadline = time.monotonic() + 300
        while sum(1 for e in read_events(daemon.log_path) if e.get("event") == "recovery_complete") < args.workers:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not complete recovery")
            time.sleep(0.1)
        out["mtaq_first_s"] = round(timed(mtaq, args.messages), 3)
        for i in range(args.pairs):
            log(f"pair {i + 1}/{args.pairs}")
            if not args.skip_postfix:
                runs["postfix"].append(round(timed(["postqueue", "-j"], args.messages), 3))
            runs["mtaq"].append(round(timed(mtaq, args.messages), 3))
        daemon.kill9()
        for i in range(args.restarts):
            log(f"restart pair {i + 1}/{args.restarts}")
            if not args.skip_postfix:
                restarts["postfix"].append(postfix_restart(postfix_port))
            r = start_once(sys.executable, spool, os.path.join(work, "restarts.log"), args.workers, 600.0)
            restarts["mtaq"].append(r["first_250_s"])  # type: ignore[arg-type]
    finally:
        daemon.kill9()
        if not args.skip_postfix:
            run(["postsuper", "-d", "ALL"], check=False)
        shutil.rmtree(work, ignore_errors=True)
    out["runs"] = runs
    out["mtaq_s"] = round(statistics.median(runs["mtaq"]), 3)
    if runs["postfix"]:
        out["postfix_s"] = round(statistics.median(runs["postfix"]), 3)
        out["ratio"] = round(out["postfix_s"] / out["mtaq_s"], 3)
    if args.restarts:
        out["restarts"] = restarts
        for side, times in restarts.items():
            got = [t for t in times if t is not None]
            if times:
                out[f"{side}_first_250_s"] = round(statistics.median(got), 3) if len(got) == len(times) else None
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
