"""An A/B of two source trees of mtaq under many sessions: both daemons run at once, relay to one
``smtp-sink``, and one Postfix ``smtp-source`` (``--sessions`` parallel sessions) sends to each at the same
time, so that a VM whose speed drifts within minutes cannot favour either side; the rounds alternate which
side starts first (docs/performance.md, "Stop 56" to "Stop 60"). The sibling of ``bench/ab_steps.py`` (one session at a time), whose rules it shares: each
daemon is ``python -m mtaq.cli serve`` with ``PYTHONPATH`` set to its tree, started from a scratch directory
outside both trees, and the run stops (exit 2) if a side would import another tree; a tree needs its C
modules built.

Per side and round: ``accept_msg_per_s`` (messages over the seconds ``smtp-source`` ran), ``e2e_msg_per_s``
(messages over the seconds from the start until the daemon's log holds that many ``delivered`` events: both
sides share one sink, so the slower one bounds both), and ``cpu_ms_per_msg`` (user + system CPU of the
daemon's processes, supervisor and workers, from ``/proc/PID/stat`` as ``bench/compare_postfix.py`` counts
it, over the messages; milliseconds).

Prints one JSON object: ``{"bench": "ab_source", "old": TREE, "new": TREE, "workers": N, "sessions": S,
"messages": M, "size": BYTES, "load_before": [1-min load average per round], "rounds": [{"old": {...},
"new": {...}, "first": the side started first}, ...], "median": {"old": {...}, "new": {...}}}``; one line a round to stderr.

    .venv/bin/python bench/ab_source.py --old /tmp/old_tree --new $PWD --workers 2 --messages 6000 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ab_steps import _logged, stop_all, trees_ok
from compare_postfix import _tree_cpu_s

from mtaq.testing.procs import free_port, wait_for


def delivered(path: str) -> int:
    """``delivered`` events in a daemon's log (a JSON line or a console line)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    return sum(1 for line in data.splitlines() if b'"delivered"' in line or b" delivered" in line)


def one_round(args: argparse.Namespace, python: str, work: str, order: tuple[str, str]) -> dict[str, Any]:
    """One round; ``order``: which side's daemon and ``smtp-source`` start first (the rounds alternate it:
    with the same tree on both sides, the side started second accepted 2-6 % more, its CPU the same)."""
    sink_port = free_port()
    sink_cmd = ["smtp-sink", *(["-u", "nobody"] if os.geteuid() == 0 else []), "-c", f"127.0.0.1:{sink_port}", "2048"]
    procs: list[subprocess.Popen[bytes]] = []
    logs: dict[str, str] = {}
    ports: dict[str, int] = {}
    pgids: dict[str, int] = {}
    try:
        procs.append(subprocess.Popen(sink_cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for side in order:
            tree = os.path.abspath(getattr(args, side))
            spool = tempfile.mkdtemp(prefix=f"{side}-", dir=work)
            os.chmod(spool, 0o755)  # run as root, the daemon drops to its mail_owner
            ports[side] = free_port()
            logs[side] = os.path.join(spool, "daemon.log")
            with open(logs[side], "ab") as log:
                procs.append(subprocess.Popen(
                    [python, "-m", "mtaq.cli", "serve", "--spool", os.path.join(spool, "spool"), "--listen",
                     f"127.0.0.1:{ports[side]}", "--relayhost", f"[127.0.0.1]:{sink_port}", "--admin-listen", "",
                     "--workers", str(args.workers)],
                    cwd=work, env={**os.environ, "PYTHONPATH": tree}, stdout=log, stderr=log, start_new_session=True))
            pgids[side] = procs[-1].pid
        for side in ("old", "new"):
            wait_for(functools.partial(_logged, logs[side], "recovery_complete"), 60, f"recovery_complete in {logs[side]}")
        time.sleep(1.0)
        cpu0 = {side: _tree_cpu_s(pgids[side]) for side in pgids}
        t0 = time.monotonic()
        sources = {side: subprocess.Popen(["smtp-source", "-s", str(args.sessions), "-m", str(args.messages), "-l",
                                           str(args.size), f"127.0.0.1:{ports[side]}"], cwd=work,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for side in order}
        sent: dict[str, float] = {}
        done: dict[str, float] = {}
        deadline = t0 + args.timeout
        while len(done) < 2 and time.monotonic() < deadline:
            for side, p in sources.items():
                if side not in sent and p.poll() is not None:
                    sent[side] = time.monotonic()
            for side in ("old", "new"):
                if side not in done and delivered(logs[side]) >= args.messages:
                    done[side] = time.monotonic()
            time.sleep(0.05)
        if len(done) < 2:
            raise SystemExit(f"ab_source: not every message was delivered within {args.timeout} s")
        out: dict[str, Any] = {"first": order[0]}
        for side in ("old", "new"):
            out[side] = {"accept_msg_per_s": round(args.messages / (sent[side] - t0), 1),
                         "e2e_msg_per_s": round(args.messages / (done[side] - t0), 1),
                         "cpu_ms_per_msg": round((_tree_cpu_s(pgids[side]) - cpu0[side]) * 1e3 / args.messages, 3)}
        return out
    finally:
        stop_all(procs, list(pgids.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the tree of the A side")
    ap.add_argument("--new", required=True, help="the tree of the B side")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=20, help="parallel sessions of each smtp-source")
    ap.add_argument("--messages", type=int, default=6000, help="messages per side and round")
    ap.add_argument("--size", type=int, default=2048, help="message size, bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take")
    args = ap.parse_args(argv)
    for tool in ("smtp-sink", "smtp-source"):
        if shutil.which(tool) is None:
            ap.error(f"{tool} not found (Debian package postfix)")
    python = sys.executable
    work = tempfile.mkdtemp(prefix="ab-source-", dir="/var/tmp")
    os.chmod(work, 0o755)
    rounds, loads = [], []
    try:
        if not trees_ok(python, args, work, "ab_source"):
            return 2
        for i in range(args.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            r = one_round(args, python, work, ("old", "new") if i % 2 == 0 else ("new", "old"))
            rounds.append(r)
            print(" | ".join(f"{side} accept {r[side]['accept_msg_per_s']} e2e {r[side]['e2e_msg_per_s']} msg/s "
                             f"cpu {r[side]['cpu_ms_per_msg']} ms/msg" for side in ("old", "new")), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {side: {k: statistics.median(r[side][k] for r in rounds) for k in rounds[0][side]}
              for side in ("old", "new")}
    print(json.dumps({"bench": "ab_source", "old": os.path.abspath(args.old), "new": os.path.abspath(args.new),
                      "workers": args.workers, "sessions": args.sessions, "messages": args.messages,
                      "size": args.size, "load_before": loads, "rounds": rounds, "median": median}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
