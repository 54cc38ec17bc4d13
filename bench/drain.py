"""Backlog benchmark: how fast mtaq drains N queued messages into Postfix's ``smtp-sink -c`` (issue 36.1),
and how long SMTP waits while a bulk action runs over them.

1. Prefill (no SMTP, fast): ``mtaq.testing.prefill.prefill_shards`` appends N deferred messages
   (``--size`` bytes, one recipient each) to a fresh spool's log, as the daemon writes them, spread over
   the shards of ``--workers`` as SMTP would spread them (``auto``: one per core); this is the queue that a
   next hop that was down while N arrived leaves behind.
2. Start ``smtp-sink -c`` (as ``-u nobody`` when root) and ``mtaq serve`` relaying to it, wait for
   ``recovery_complete``.
3. By ``--mode``:

   * ``flush`` (Postfix ``postqueue -f``): the messages are due in a day; ``mtaq queue flush ALL`` is run
     and ``drain_s`` is the time from that command's start until the sink has counted N messages.
   * ``retry``: the messages are already due (the retry runner's schedule brings the next hop's mail back
     by itself, no flush); ``drain_s`` runs from ``recovery_complete`` to the sink's N-th message.
   * ``hold``: the next hop is never offered anything (due in a day); ``mtaq queue hold ALL`` is timed
     (``action_s``), then ``release ALL`` is timed too and the drain after it (``drain_s`` from the
     release command's start).

   ``rate_msg_s`` is N / ``drain_s`` (the sink counts the probe's messages too: the wait is for N plus
   those). During the action (the first 5 s of a ``retry`` drain) a probe thread sends one message every
   ``--probe-interval`` seconds (smtplib, its own connection each) and reports the slowest whole-transaction
   time (``probe_max_s``) and the median (``probe_median_s``): an event loop held by a bulk action shows
   up here.

Prints ONE JSON line: ``{"mode", "messages", "size", "workers", "prefill_s", "recovery_s", "action_s",
"drain_s", "rate_msg_s", "daemon_cpu_s", "daemon_cpu_ms_per_msg", "probe_max_s", "probe_median_s", "probes",
"load_before"}``; ``daemon_cpu_*``: user + system CPU of the daemon's processes from the action's start
to the drain's end (the probe's messages included), which a busy machine disturbs less than the rate. With ``--profile
FILE`` ``py-spy record`` (``--py-spy PATH``) samples the daemon for the action and drain into FILE
(speedscope JSON, or ``--profile-format raw`` collapsed stacks).

Run from the project root (the same command on each tree, PYTHONPATH set to it)::

    PYTHONPATH=$PWD .venv/bin/python bench/drain.py --messages 20000 --mode flush

Options: --messages N (20000), --size BYTES (2048), --mode flush|retry|hold, --workers W (1),
--timeout S (600), --probe-interval S (0.2), --keep DIR.

``--postfix [--pairs K]`` (``--mode flush`` only, root): Postfix's side of the same drain, alternating,
Postfix first in each pair: N deferred messages of the same content in Postfix's queue (one sent to a
closed relayhost, the rest copies of its queue file: ``list_queue.prefill_postfix``), the relayhost
switched to a fresh ``smtp-sink -c`` and ``postqueue -f`` timed until the sink has counted N. Prints one
JSON object: every run, ``postfix_rate_msg_s`` and ``mtaq_rate_msg_s`` (medians) and ``ratio`` (mtaq over
Postfix)::

    PYTHONPATH=$PWD .venv/bin/python bench/drain.py --messages 100000 --mode flush --postfix --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import smtplib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_postfix import Sink, _postfix_master_pid, _tree_cpu_s, ensure_postfix_installed, log
from compare_postfix import run as run_cmd
from list_queue import prefill_postfix

from mtaq.daemon.workers import auto_workers
from mtaq.testing.prefill import prefill_shards
from mtaq.testing.procs import free_port, read_events, start_daemon

SENDER = "bench@source.example"


def message(size: int) -> bytes:
    head = (f"From: <{SENDER}>\r\nTo: <rcpt@dest.example>\r\nSubject: mtaq drain\r\n"
            "Date: Thu, 01 Jan 2026 00:00:00 +0000\r\n\r\n").encode()
    room = max(80, size - len(head))
    full, rest = divmod(room, 78)
    return head + (b"x" * 76 + b"\r\n") * full + (b"y" * max(0, rest - 2) + b"\r\n" if rest >= 2 else b"")


class Probe:
    """Sends one message every ``interval`` seconds on a new connection; records each transaction's time."""

    def __init__(self, port: int, interval: float) -> None:
        self.port = port
        self.interval = interval
        self.times: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = message(512)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with smtplib.SMTP("127.0.0.1", self.port, timeout=120) as s:
                    s.sendmail(SENDER, ["probe@dest.example"], body)
                self.times.append(time.monotonic() - t0)
            except (OSError, smtplib.SMTPException) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self.thread.join(150)
        t = self.times
        return {"probes": len(t), "probe_max_s": round(max(t), 3) if t else None,
                "probe_median_s": round(statistics.median(t), 4) if t else None, "probe_errors": self.errors[:3]}


def queue_cmd(spool: str, *args: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", *args, "--spool", spool, "--json"],
                   check=True, stdout=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - t0


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (/proc/PID/stat fields 14 and 15)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            pass
    return total


def wait_count(sink: Sink, n: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    with sink.cond:
        while sink.count < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sink.cond.wait(min(left, 1.0))
    return True


def _tally(res: dict[str, Any], who: str, cpu: float | None, sink: Sink, n: int, ok: bool, t_go: float,
           timeout: float) -> None:
    """Into ``res``, now that the sink counted N (``ok``) or the wait timed out: ``WHO_cpu_s`` and
    ``WHO_cpu_ms_per_msg`` (when ``cpu`` is known), ``delivered``, ``drain_s`` and ``rate_msg_s`` from
    ``t_go`` (monotonic), ``error`` when not ``ok``."""
    t_done = time.monotonic()
    if cpu is not None:
        res[f"{who}_cpu_s"] = round(cpu, 2)
        res[f"{who}_cpu_ms_per_msg"] = round(cpu * 1000 / n, 3)
    res["delivered"] = sink.count
    if not ok:
        res["error"] = f"sink counted {sink.count} of {n} in {timeout}s"
    res["drain_s"] = round(t_done - t_go, 2)
    res["rate_msg_s"] = round(n / (t_done - t_go), 1)


def run(args: argparse.Namespace, work: str) -> dict[str, Any]:
    spool = os.path.join(work, "spool")
    n = args.messages
    body = message(args.size)
    t0 = time.monotonic()
    due_in = 0.0 if args.mode == "retry" else 86400.0
    shards = int(args.workers) if str(args.workers).isdigit() else auto_workers()  # as SMTP would spread them
    prefill_shards(spool, n, lambda i: body, shards, sender_of=lambda i: SENDER, age_s=3600, due_in_s=due_in)
    res: dict[str, Any] = {"mode": args.mode, "messages": n, "size": args.size, "workers": args.workers,
                           "prefill_s": round(time.monotonic() - t0, 2), "load_before": os.getloadavg()[0]}
    sink = Sink(free_port(), 1024)
    log_path = os.path.join(work, "daemon.log")
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w", encoding="utf-8") as f:
        f.write("stats_interval_s = 0\n")
    t_start = time.monotonic()
    daemon = start_daemon(spool, sink.port, log_path, config=conf, workers=args.workers)
    spy = None
    probe = None
    try:
        while not any(e.get("event") == "recovery_complete" for e in read_events(log_path)):
            if not daemon.alive():
                raise RuntimeError(f"daemon exited: {daemon.log_text()[-2000:]}")
            time.sleep(0.05)
        t_rec = time.monotonic()
        res["recovery_s"] = round(t_rec - t_start, 2)
        if args.profile:
            pids = [daemon.popen.pid, *daemon.children()] if args.workers != 1 else [daemon.popen.pid]
            spy = subprocess.Popen([args.py_spy, "record", "-o", args.profile, "-f", args.profile_format,
                                    "-r", "200", "-p", str(pids[-1]), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        pids = [daemon.popen.pid, *daemon.children()]
        cpu0 = cpu_s(pids)
        probe = Probe(daemon.port, args.probe_interval)
        if args.mode == "flush":
            t_go = time.monotonic()
            res["action_s"] = round(queue_cmd(spool, "flush", "ALL"), 3)
        elif args.mode == "retry":
            t_go = t_rec
            time.sleep(5.0)  # the probe measures the first seconds of the drain
        else:
            res["action_s"] = round(queue_cmd(spool, "hold", "ALL"), 3)
            t_go = time.monotonic()
            res["release_s"] = round(queue_cmd(spool, "release", "ALL"), 3)
        # The probe covers the action (and the first seconds of a retry drain), not the whole drain: its
        # messages reach the same sink, which counts them with the backlog.
        res |= probe.stop()
        probed = res["probes"]
        probe = None
        ok = wait_count(sink, n + probed, args.timeout)
        # CPU of the daemon for the action and the drain: less at the mercy of a busy machine than the rate.
        # The probes are delivered alongside: the backlog's rate counts the N only (they are a few dozen).
        _tally(res, "daemon", cpu_s(pids) - cpu0, sink, n, ok, t_go, args.timeout)
    finally:
        if probe is not None:
            probe.stop()
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        daemon.kill9()
        sink.proc.kill()
        sink.proc.wait()
    return res


def run_postfix(args: argparse.Namespace) -> dict[str, Any]:
    """Postfix's side of ``--mode flush``: N deferred messages of the same content (copies of one queue
    file, ``list_queue.prefill_postfix``), the relayhost switched to a fresh ``smtp-sink -c``, then
    ``postqueue -f`` timed until the sink has counted N. CPU: Postfix's master and every child it reaped."""
    n = args.messages
    t0 = time.monotonic()
    prefill_postfix(n, message(args.size))
    res: dict[str, Any] = {"side": "postfix", "mode": "flush", "messages": n, "size": args.size,
                           "prefill_s": round(time.monotonic() - t0, 2), "load_before": os.getloadavg()[0]}
    sink = Sink(free_port(), 1024)
    try:
        run_cmd(["postconf", "-e", f"relayhost=[127.0.0.1]:{sink.port}"])
        run_cmd(["postfix", "reload"])
        master = _postfix_master_pid()
        cpu0 = _tree_cpu_s(master) if master else 0.0
        t_go = time.monotonic()
        run_cmd(["postqueue", "-f"])
        ok = wait_count(sink, n, args.timeout)
        _tally(res, "postfix", _tree_cpu_s(master) - cpu0 if master else None, sink, n, ok, t_go, args.timeout)
    finally:
        sink.stop()
        run_cmd(["postsuper", "-d", "ALL"], check=False)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--mode", choices=("flush", "retry", "hold"), default="flush")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--probe-interval", type=float, default=0.2)
    ap.add_argument("--profile", metavar="FILE")
    ap.add_argument("--profile-format", default="speedscope")
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--keep", metavar="DIR")
    ap.add_argument("--postfix", action="store_true",
                    help="--mode flush against Postfix's postqueue -f on the same N (needs root), alternating")
    ap.add_argument("--pairs", type=int, default=1, help="with --postfix: Postfix/mtaq pairs (medians printed)")
    args = ap.parse_args(argv)
    if args.postfix and args.mode != "flush":
        ap.error("--postfix compares --mode flush only")
    if not args.postfix:
        res = _mtaq_run(args)
        print(json.dumps(res), flush=True)
        return 0 if "error" not in res else 1
    ensure_postfix_installed()
    runs: dict[str, list[dict[str, Any]]] = {"postfix": [], "mtaq": []}
    for i in range(args.pairs):
        for side in ("postfix", "mtaq"):
            r = run_postfix(args) if side == "postfix" else _mtaq_run(args)
            log(f"pair {i + 1}/{args.pairs}: {side} {json.dumps(r)}")
            runs[side].append(r)
    out: dict[str, Any] = {"bench": "drain", "mode": "flush", "messages": args.messages, "size": args.size,
                           "workers": args.workers, "pairs": args.pairs, "runs": runs}
    for side, rs in runs.items():
        out[f"{side}_rate_msg_s"] = statistics.median(r["rate_msg_s"] for r in rs)
    out["ratio"] = round(out["mtaq_rate_msg_s"] / out["postfix_rate_msg_s"], 3)
    print(json.dumps(out), flush=True)
    return 0 if not any("error" in r for rs in runs.values() for r in rs) else 1


def _mtaq_run(args: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="mtaq-drain-", dir=args.keep or "/var/tmp")
    try:
        return run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
