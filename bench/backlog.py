"""The backlog table (issue 36): mtaq against Postfix where the queue is large, in one run.

For each queue size N in ``--messages`` (default ``100000``; ``100000,1000000`` for both of the issue's):

1. **Drain**: ``bench/drain.py --mode flush --postfix --pairs P``: N deferred 2 KiB messages on each side,
   the next hop back (Postfix's ``smtp-sink -c``), ``postqueue -f`` / ``mtaq queue flush ALL`` timed until
   the sink has counted N; Postfix first in each pair; messages a second (medians) and mtaq / Postfix.
2. **List**: ``bench/list_queue.py --pairs P``: ``postqueue -j`` and ``mtaq queue list --json`` over N
   deferred (1 KiB), whole commands, alternating; seconds (medians), Postfix / mtaq, and mtaq's first
   listing after its start apart.
3. **First 250 after kill -9** (in the same run as 2, on the same queues): ``--restarts P`` pairs of
   SIGKILL to every process of the relay and a spawn (``postfix start`` / ``mtaq serve``) with a probe
   that sends one message as soon as the port accepts; seconds from the spawn to the 250 (medians).

The targets (issue 36): drain ≥ 2× Postfix at 100,000, listing ≥ 1× ``postqueue -j``, first 250 ≤ 0.3 s at
every queue size. Each step is its own process (its JSON line kept whole under ``steps``); the table goes to
stderr and one JSON object to stdout. Needs root and Postfix (installed from Debian when missing).
Runs long: at 100,000 with 3 pairs about 15 minutes on 2 cores; at 1,000,000 about ten times that. Say how
loaded the machine was (``loadavg`` before and after each step is in the JSON).

    PYTHONPATH=$PWD .venv/bin/python bench/backlog.py --messages 100000 --pairs 3      # make compare-backlog
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))

from mtaq.daemon.workers import auto_workers  # noqa: E402

TARGETS = {"drain": 2.0, "list": 1.0, "first_250_s": 0.3}


def step(script: str, args: list[str]) -> dict[str, Any]:
    """Run ``bench/SCRIPT ARGS`` with this interpreter; its one JSON line (stderr passes through).
    Raises RuntimeError when it exits non-zero or prints no JSON object."""
    cmd = [sys.executable, os.path.join(BENCH, script), *args]
    print(f"backlog: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    load = [round(x, 2) for x in os.getloadavg()]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{script}: exit {p.returncode}: {p.stdout[-500:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    out["step_loadavg_before"] = load
    return out


def row(n: int, drain: dict[str, Any], listing: dict[str, Any]) -> dict[str, Any]:
    """One table row from the steps' JSON: rates in messages a second, times in seconds."""
    return {
        "messages": n,
        "drain_postfix_msg_s": drain["postfix_rate_msg_s"], "drain_mtaq_msg_s": drain["mtaq_rate_msg_s"],
        "drain_ratio": drain["ratio"],
        "list_postfix_s": listing.get("postfix_s"), "list_mtaq_s": listing["mtaq_s"],
        "list_ratio": listing.get("ratio"), "list_mtaq_first_s": listing.get("mtaq_first_s"),
        "first_250_postfix_s": listing.get("postfix_first_250_s"),
        "first_250_mtaq_s": listing.get("mtaq_first_250_s"),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| queued | drain Postfix msg/s | drain mtaq msg/s | ratio (≥ 2) | list `postqueue -j` s | "
            "list mtaq s (first) | ratio (≥ 1) | first 250 after kill -9: Postfix s | mtaq s (≤ 0.3) |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        out.append(f"| {r['messages']:,} | {r['drain_postfix_msg_s']:,.0f} | {r['drain_mtaq_msg_s']:,.0f} | "
                   f"**{r['drain_ratio']:.2f}** | {r['list_postfix_s']} | {r['list_mtaq_s']} "
                   f"({r['list_mtaq_first_s']}) | **{r['list_ratio']}** | {r['first_250_postfix_s']} | "
                   f"**{r['first_250_mtaq_s']}** |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--messages", default="100000", help="queue sizes, comma-separated")
    ap.add_argument("--pairs", type=int, default=3, help="Postfix/mtaq pairs of each step (medians)")
    ap.add_argument("--workers", default="auto", help="mtaq serve --workers (auto: what the daemon's workers = 'auto' gives)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.messages.split(",")]
    except ValueError:
        ap.error("--messages: comma-separated whole numbers")
    if args.pairs < 1 or any(n < 1 for n in sizes):
        ap.error("--messages and --pairs must be >= 1")
    if os.geteuid() != 0:
        print("backlog: needs root (Postfix's queue and its start)", file=sys.stderr)
        return 2
    workers = str(auto_workers()) if args.workers == "auto" else args.workers
    out: dict[str, Any] = {"bench": "backlog", "pairs": args.pairs, "workers": workers, "cpus": os.cpu_count(),
                           "loadavg_before": [round(x, 2) for x in os.getloadavg()], "steps": [], "rows": []}
    pairs = str(args.pairs)
    for n in sizes:
        drain = step("drain.py", ["--messages", str(n), "--mode", "flush", "--postfix", "--pairs", pairs,
                                  "--workers", workers, "--timeout", str(max(600, n // 100))])
        listing = step("list_queue.py", ["--messages", str(n), "--pairs", pairs, "--workers", workers,
                                         "--restarts", pairs])
        out["steps"] += [drain, listing]
        out["rows"].append(row(n, drain, listing))
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["targets"] = TARGETS
    print(table(out["rows"]), file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
