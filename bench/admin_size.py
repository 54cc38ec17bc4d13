"""Admin benchmark: ``queue size`` (daemon counters, no scan) against ``queue list`` (a consistent view of
the whole queue) with N deferred messages queued (default 100,000).

1. Prefill (no SMTP, fast): append N messages to a fresh spool's log with :meth:`mtaq.storage.log.Log.open`,
   each a DATA record (``--size`` bytes, default 1024) and a deferred generation-1 ENVELOPE (``runner=1``,
   ``attempts=1``, due in 86400 s), then fsync.
2. Start ``mtaq serve`` (``mtaq.testing.procs.start_daemon``; admin API on a free port, the next hop a
   closed port: nothing comes due during the run) and wait for ``recovery_complete``.
3. Time, each ``--repeat`` times (median and min reported, seconds, wall clock):
   * ``http_list_first_s``: the first ``GET /mailQueues/spool/mails`` (all N; the daemon reads the whole
     log: once, not repeated); then ``http_list_s``, the same again (the daemon's kept view, read forward);
     ``http_page_s``: ``?limit=1000`` (one page);
   * ``http_size_s``: ``GET /mailQueues/spool``;
   * ``cli_size_s``: ``mtaq queue size --json``; ``cli_list_s``: ``mtaq queue list --json`` (a new Python
     process each time, so these include interpreter start-up, about 0.2 s);
4. ``kill -9`` the daemon and time the offline forms (``offline_cli_size_s``, ``offline_cli_list_s``), which
   read the spool: size from the last checkpoint's counts plus the records after it; list from every
   segment.
5. With ``--actions``: start the daemon again on the spool and time each of ``mtaq queue hold ALL``,
   ``release ALL``, ``flush ALL``, ``delete ALL`` once (``action_hold_s``... and the messages each did,
   ``action_done``); ``flush`` makes every message due at a next hop that refuses connections, so ``delete``
   skips the ones under an attempt.

It checks that every answer counts N messages, and prints ONE JSON line::

    {"messages": N, "log_bytes": ..., "http_size_s": {"median": ..., "min": ...}, ..., "ratio_http_list_to_size": ...}

Run from the project root::

    .venv/bin/python bench/admin_size.py --messages 100000

Options: --messages N (100000), --size BYTES (1024), --repeat R (3), --keep DIR (work under DIR and keep it),
--actions (step 5).
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
import urllib.request
from collections.abc import Callable
from typing import Any

from mtaq.testing.prefill import prefill_deferred
from mtaq.testing.procs import admin_token, admin_url, free_port, read_events, start_daemon


def prefill(spool: str, n: int, size: int) -> float:
    """Append ``n`` deferred messages to the log of ``spool``; return the seconds it took."""
    t0 = time.monotonic()
    head = b"From: <bench@example.com>\r\nTo: <rcpt@example.org>\r\nSubject: admin bench\r\n\r\n"
    body = head + b"x" * max(0, size - len(head) - 2) + b"\r\n"
    prefill_deferred(spool, n, lambda i: body, sender_of=lambda i: f"sender{i % 100}@example.com", age_s=3600)
    return time.monotonic() - t0


def timed(fn: Callable[[], Any], repeat: int) -> tuple[dict[str, float], Any]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.monotonic()
        result = fn()
        times.append(time.monotonic() - t0)
    return {"median": round(statistics.median(times), 4), "min": round(min(times), 4)}, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", metavar="DIR")
    ap.add_argument("--actions", action="store_true", help="also time hold/release/flush/delete ALL")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="mtaq-admin-", dir=args.keep)
    spool = os.path.join(work, "spool")
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w") as f:
        f.write("retry_intervals_s = [86400.0]\nstats_interval_s = 0\ncheckpoint_interval_s = 2\n")
    n = args.messages
    out: dict[str, Any] = {"messages": n, "message_bytes": args.size, "repeat": args.repeat}
    out["prefill_s"] = round(prefill(spool, n, args.size), 3)
    log_dir = os.path.join(spool, "log")
    out["log_bytes"] = sum(os.path.getsize(os.path.join(log_dir, x)) for x in os.listdir(log_dir) if x.endswith(".seg"))
    def started(name: str) -> Any:
        d = start_daemon(spool, free_port(), os.path.join(work, name), config=conf)
        deadline = time.monotonic() + 600
        while not [e for e in read_events(d.log_path) if e.get("event") == "recovery_complete"]:
            if time.monotonic() > deadline or not d.alive():
                raise RuntimeError("no recovery_complete")
            time.sleep(0.1)
        return d

    daemon = started("daemon.log")
    ok = True
    try:
        rec = next(e for e in read_events(daemon.log_path) if e.get("event") == "recovery_complete")
        out["recovery_seconds"] = rec["seconds"]
        url = admin_url(spool)

        def get(path: str) -> Any:
            req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {admin_token(spool)}"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())

        def cli(*a: str) -> str:
            res = subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", *a, "--spool", spool],
                                 capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"mtaq queue {' '.join(a)}: {res.stderr.strip()}")
            return res.stdout

        get("/mailQueues/spool")  # wait until the queue routes answer (recovery done)
        out["http_list_first_s"], first = timed(lambda: get("/mailQueues/spool/mails"), 1)
        out["http_size_s"], size = timed(lambda: get("/mailQueues/spool"), args.repeat)
        out["http_list_s"], listing = timed(lambda: get("/mailQueues/spool/mails"), args.repeat)
        out["http_page_s"], page = timed(lambda: get("/mailQueues/spool/mails?limit=1000"), args.repeat)
        out["cli_size_s"], cli_size = timed(lambda: cli("size", "--json"), args.repeat)
        out["cli_list_s"], cli_list = timed(lambda: cli("list", "--json"), args.repeat)
        counted = {"http_size": size["size"], "http_list_first": first["count"], "http_list": listing["count"], "cli_size": json.loads(cli_size)["total"],
                   "cli_list": len(cli_list.splitlines())}
        time.sleep(2.5)  # let a checkpoint carry the counts (for the offline size)
        daemon.kill9()
        out["offline_cli_size_s"], off_size = timed(lambda: cli("size", "--json"), args.repeat)
        out["offline_cli_list_s"], off_list = timed(lambda: cli("list", "--json"), args.repeat)
        counted |= {"offline_cli_size": json.loads(off_size)["total"], "offline_cli_list": len(off_list.splitlines())}
        out["offline_size_source"] = json.loads(off_size).get("source")
        ok = page["count"] == min(n, 1000)
        if args.actions:
            daemon = started("daemon2.log")
            done: dict[str, int] = {}
            for action in ("hold", "release", "flush", "delete"):
                out[f"action_{action}_s"], res = timed(lambda a=action: cli(a, "ALL", "--json"), 1)
                done[action] = len(json.loads(res)["done"])
            out["action_done"] = done
        out["counted"] = counted
        ok = ok and all(v == n for v in counted.values())
        out["ratio_http_list_to_size"] = round(out["http_list_s"]["median"] / max(out["http_size_s"]["median"], 1e-6), 1)
        out["ratio_cli_list_to_size"] = round(out["cli_list_s"]["median"] / max(out["cli_size_s"]["median"], 1e-6), 1)
        out["ok"] = ok
    finally:
        daemon.kill9()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
