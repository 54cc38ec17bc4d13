"""An A/B of two source trees of mtaq side by side: both daemons run at once, relay to one ``smtp-sink``, and
``bench/session_steps.py --port A B`` sends one session to each in turn, so that a VM whose speed drifts
within minutes cannot favour either side (docs/performance.md, "Stop 56" and "Stop 57").

Each daemon is ``python -m mtaq.cli serve`` with ``PYTHONPATH`` set to its tree, started from a scratch
directory outside both trees: ``python -m`` puts the current directory first on ``sys.path``, so a daemon
started from a checkout runs that checkout's code whatever ``PYTHONPATH`` says (stop 56's A/Bs did that and
compared one tree with itself). Before a round, each side is asked which ``mtaq`` it imports, under the
same environment and directory, and the run stops (exit 2) if that is not its own tree. A tree needs its C
modules built (``pip install -e .`` in it, or the ``.so`` files copied from a built checkout); without them
the relay falls back to the pure-Python definitions and the A/B measures that too.

Prints one JSON object: ``{"bench": "ab_steps", "old": TREE, "new": TREE, "workers": N, "rounds": [{"old":
{...}, "new": {...}}, ...]}`` where each side's figures are those of ``session_steps.py`` for its port
(``median_ms`` per step, ``msg_per_s``, ``cpu_ms_per_session``, ``slow_share``, ``tail_ms``).

    .venv/bin/python bench/ab_steps.py --old /tmp/old_tree --new $PWD --workers 1 --sessions 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from mtaq.testing.procs import free_port, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def imported_tree(python: str, tree: str, cwd: str) -> str:
    """The directory of the ``mtaq`` package a daemon started with ``PYTHONPATH=tree`` from ``cwd`` imports."""
    out = subprocess.run([python, "-c", "import mtaq, os; print(os.path.dirname(os.path.dirname(mtaq.__file__)))"],
                         cwd=cwd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def trees_ok(python: str, args: argparse.Namespace, work: str, bench: str) -> bool:
    """Whether each side (``args.old``, ``args.new``) imports mtaq from its own tree when started from
    ``work``; says which does not on stderr."""
    for side in ("old", "new"):
        tree = os.path.realpath(getattr(args, side))
        got = os.path.realpath(imported_tree(python, tree, work))
        if got != tree:
            print(f"{bench}: the {side} side would import mtaq from {got}, not {tree}", file=sys.stderr)
            return False
    return True


def stop_all(procs: list[subprocess.Popen[bytes]], groups: list[int]) -> None:
    """SIGKILL each process group in ``groups`` (a daemon's supervisor and workers), then every process."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.kill()
        p.wait()


def _logged(path: str, needle: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return needle in f.read()
    except FileNotFoundError:
        return False


def one_round(args: argparse.Namespace, python: str, work: str) -> dict[str, Any]:
    sink_port = free_port()
    sink_cmd = ["smtp-sink", *(["-u", "nobody"] if os.geteuid() == 0 else []), "-c", f"127.0.0.1:{sink_port}", "1024"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(sink_cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ports, pids = [], []
        for side in ("old", "new"):
            tree = os.path.abspath(getattr(args, side))
            spool = tempfile.mkdtemp(prefix=f"{side}-", dir=work)
            os.chmod(spool, 0o755)  # run as root, the daemon drops to its mail_owner
            port = free_port()
            with open(os.path.join(work, f"{side}.log"), "ab") as log:  # the daemon keeps its own copy
                procs.append(subprocess.Popen(
                    [python, "-m", "mtaq.cli", "serve", "--spool", os.path.join(spool, "spool"), "--listen",
                     f"127.0.0.1:{port}", "--relayhost", f"[127.0.0.1]:{sink_port}", "--admin-listen", "",
                     "--workers", str(args.workers)],
                    cwd=work, env={**os.environ, "PYTHONPATH": tree}, stdout=log, stderr=log, start_new_session=True))
            ports.append(port)
            pids.append(procs[-1].pid)
        for side in ("old", "new"):
            log_path = os.path.join(work, f"{side}.log")
            wait_for(functools.partial(_logged, log_path, "recovery_complete"), 60, f"recovery_complete in {log_path}")
        time.sleep(1.0)
        out = subprocess.run([python, os.path.join(HERE, "session_steps.py"), "--port", *map(str, ports),
                              "--cpu-pid", *map(str, pids), "--sessions", str(args.sessions), "--size", str(args.size)],
                             cwd=work, capture_output=True, text=True, check=True)
        by_port = json.loads(out.stdout)["by_port"]
        return {"old": by_port[str(ports[0])], "new": by_port[str(ports[1])]}
    finally:
        stop_all(procs, [p.pid for p in procs[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the tree of the A side")
    ap.add_argument("--new", required=True, help="the tree of the B side")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=2000, help="sessions per round, both sides together")
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if shutil.which("smtp-sink") is None:
        ap.error("smtp-sink not found (Debian package postfix)")
    python = sys.executable
    work = tempfile.mkdtemp(prefix="ab-steps-", dir="/var/tmp")
    os.chmod(work, 0o755)
    try:
        if not trees_ok(python, args, work, "ab_steps"):
            return 2
        rounds = [one_round(args, python, work) for _ in range(args.rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rounds:
        print(" ".join(f"{side} msg/s {r[side]['msg_per_s']} cpu {r[side].get('cpu_ms_per_session')} dot "
                       f"{r[side]['median_ms']['dot']} total {r[side]['median_ms']['total']}" for side in ("old", "new")),
              file=sys.stderr)
    print(json.dumps({"bench": "ab_steps", "old": os.path.abspath(args.old), "new": os.path.abspath(args.new),
                      "workers": args.workers, "sessions": args.sessions, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
