"""How long a bulk admin action holds the daemon's event loop (issue 36: ``hold ALL`` over 100,000 messages
held SMTP for 8-15 s).

The daemon runs in this process (``mtaq.daemon.process.Daemon``, as the tests' harness runs it; the next
hop a closed port, so nothing is delivered) on a spool prefilled with N deferred messages
(``mtaq.testing.prefill``). A ticker task sleeps 1 ms at a time in the same loop and records the longest
gap between its wake-ups while ``AdminService.act(ACTION, ALL)`` runs: that gap is how long an SMTP
session would have waited for its next reply. Then the action's wall time.

Prints ONE JSON line: ``{"action", "messages", "action_s", "loop_max_gap_s", "loop_gaps_over_100ms",
"done", "load_before"}``.

Run from the project root (the same command on each tree, PYTHONPATH set to it)::

    PYTHONPATH=$PWD .venv/bin/python bench/action_stall.py --messages 20000 --action hold
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from mtaq.config import load_config
from mtaq.core.view import Selector
from mtaq.daemon.process import Daemon
from mtaq.testing.prefill import prefill_deferred
from mtaq.testing.procs import free_port, mail_owner_ready

BODY = b"From: <a@example.com>\r\nSubject: stall\r\n\r\n" + b"x" * 2000 + b"\r\n"


async def measure(spool: str, n: int, action: str) -> dict[str, Any]:
    cfg = load_config(None, {"spool_dir": spool, "listen": "127.0.0.1:0", "relayhost": f"[127.0.0.1]:{free_port()}",
                             "stats_interval_s": 0, "checkpoint_interval_s": 3600, "admin_listen": "127.0.0.1:0",
                             "retry_intervals_s": [3600.0]})
    daemon = Daemon(cfg)
    task = asyncio.create_task(daemon.run())
    try:
        while not daemon.runners or daemon.admin.size()["total"] < n:
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        gaps.clear()
        t0 = time.monotonic()
        res = await daemon.admin.act(action, Selector(all=True))
        action_s = time.monotonic() - t0
        stop = True
        await t
        return {"action": action, "messages": n, "action_s": round(action_s, 3),
                "loop_max_gap_s": round(max(gaps), 4) if gaps else None,
                "loop_gaps_over_100ms": sum(1 for g in gaps if g > 0.1), "done": len(res.done)}
    finally:
        task.cancel()
        try:
            await task
        except BaseException:  # cancelled, or what the daemon raised on its way out
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--action", default="hold", choices=("hold", "flush", "delete"))
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="mtaq-stall-", dir="/var/tmp")
    try:
        spool = os.path.join(work, "spool")
        prefill_deferred(spool, args.messages, lambda i: BODY, age_s=3600)
        mail_owner_ready(spool)
        load = os.getloadavg()[0]
        out = asyncio.run(measure(spool, args.messages, args.action))
        out["load_before"] = round(load, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0 if out["done"] == args.messages else 1


if __name__ == "__main__":
    sys.exit(main())
