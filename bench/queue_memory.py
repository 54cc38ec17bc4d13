"""Memory benchmark: peak RSS of ``mtaq serve`` with D deferred messages queued, in bytes per queued message.

The queue is the log: memory should hold the attempts in progress, never the queued mail or its bodies
(issue 8). For each D in ``--deferred`` (default ``0,200000,1000000``), in a fresh temporary directory:

1. Prefill (no SMTP, fast): append D messages to the spool's log, each a DATA record (a 2 KiB message)
   and a deferred generation-1 ENVELOPE (runner 1, one recipient, due in 86400 s), as bench/recovery.py
   does, then fsync.
2. Start ``mtaq serve`` (``mtaq.testing.procs.start_daemon``, ``checkpoint_interval_s = 1``) relaying to
   ``mtaq sink``. It has no checkpoint, so its recovery reads every segment, and the runner for new mail
   reads every envelope of the log to get past them (the deferred runner waits at the first one: due
   tomorrow). Wait until a checkpoint shows the new-mail runner past the prefilled segments.
3. Send ``--new`` messages (default 2000) over SMTP (20 sessions) and wait until the sink has them all:
   the daemon relays new mail with D messages queued.
4. Read the daemon's VmHWM (peak RSS) and VmRSS from /proc, then ``kill -9`` it.

It prints ONE JSON line::

    {"results": [{"deferred": D, "peak_rss_kib": ..., "rss_kib": ..., "prefill_s": ..., "scan_s": ...}, ...],
     "bytes_per_queued_msg": ...}

``bytes_per_queued_msg`` = (peak RSS with the largest D - peak RSS with the smallest D) / (difference in D),
in bytes (``rss_bytes_per_queued_msg`` the same with the RSS at the end); ``marginal_bytes_per_queued_msg``
the same between the two largest D (the first start reads every segment whole, one at a time, which
raises the peak by about one segment of records whatever D is, once D fills a segment); ``scan_s`` is the time from the start of the daemon until the checkpoint that shows the scan
done (seconds). Exit status 0 when every run delivered all new messages. Disk: about 2.2 KiB per queued
message (``--keep DIR`` keeps the spools).

    .venv/bin/python bench/queue_memory.py --deferred 0,200000,1000000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import aiosmtplib

from mtaq.core.records import Pos
from mtaq.storage.checkpoint import read_checkpoint
from mtaq.storage.fs import OsFileSystem
from mtaq.testing.prefill import prefill_deferred
from mtaq.testing.procs import maildir_count, start_daemon, start_sink

SENDER = "bench@example.com"
BODY_BYTES = 2048
SEGMENT_BYTES_MAX = 64 * 1024 * 1024


def build_message(tag: str, size: int = BODY_BYTES) -> bytes:
    head = (
        f"From: <{SENDER}>\r\nTo: <rcpt@example.org>\r\nSubject: mtaq memory {tag}\r\n"
        f"Message-ID: <{tag}@bench.mtaq.invalid>\r\nDate: Thu, 01 Jan 2026 00:00:00 +0000\r\n\r\n"
    ).encode()
    room = max(80, size - len(head))
    full, rest = divmod(room, 78)
    body = (b"x" * 76 + b"\r\n") * full + (b"y" * max(0, rest - 2) + b"\r\n" if rest >= 2 else b"")
    return head + body


def prefill(spool: str, n: int) -> tuple[float, Pos]:
    """Append ``n`` deferred messages; return the seconds it took and the log's end position."""
    t0 = time.monotonic()
    template = build_message("prefill")
    end = prefill_deferred(spool, n, lambda i: template.replace(b"prefill", f"pf{i:08d}".encode(), 2),
                           sender_of=lambda i: SENDER, segment_bytes_max=SEGMENT_BYTES_MAX)
    return time.monotonic() - t0, end


async def send_many(port: int, n: int, sessions: int) -> int:
    counter = itertools.count()
    ok = 0

    async def session() -> None:
        nonlocal ok
        c = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=120)
        await c.connect()
        try:
            while (i := next(counter)) < n:
                await c.sendmail(SENDER, ["new@example.org"], build_message(f"new{i}"))
                ok += 1
        finally:
            await c.quit()

    await asyncio.gather(*(session() for _ in range(sessions)))
    return ok


def vm(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0])
    return out


def run_one(d: int, new: int, work: str) -> dict[str, Any]:
    spool = os.path.join(work, "spool")
    prefill_s, end = prefill(spool, d)
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w", encoding="utf-8") as f:
        f.write("checkpoint_interval_s = 1\nstats_interval_s = 0\n")
    sink = start_sink(os.path.join(work, "maildir"), os.path.join(work, "sink.log"))
    t0 = time.monotonic()
    daemon = start_daemon(spool, sink.port, os.path.join(work, "daemon.log"), config=conf)
    res: dict[str, Any] = {"deferred": d, "prefill_s": round(prefill_s, 2)}
    try:
        fs = OsFileSystem()
        while True:  # the new-mail runner is past every prefilled segment
            cp, _why = read_checkpoint(fs, spool)
            if cp is not None and cp.runners and cp.runners[0].segment > end.segment:
                break
            if not daemon.alive():
                raise RuntimeError(f"daemon exited: {daemon.log_text()[-2000:]}")
            time.sleep(0.2)
        res["scan_s"] = round(time.monotonic() - t0, 2)
        sent = asyncio.run(send_many(daemon.port, new, 20))
        deadline = time.monotonic() + 600
        while maildir_count(os.path.join(work, "maildir")) < new and time.monotonic() < deadline:
            time.sleep(0.1)
        res["new_sent"] = sent
        res["new_delivered"] = maildir_count(os.path.join(work, "maildir"))
        v = vm(daemon.popen.pid)
        res["peak_rss_kib"] = v.get("VmHWM")
        res["rss_kib"] = v.get("VmRSS")
    finally:
        daemon.kill9()
        sink.kill9()
    res["log_bytes"] = sum(os.path.getsize(os.path.join(spool, "log", n)) for n in os.listdir(os.path.join(spool, "log")))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deferred", default="0,200000,1000000", metavar="D1,D2,...")
    ap.add_argument("--new", type=int, default=2000, metavar="N", help="new messages relayed with the queue full")
    ap.add_argument("--keep", metavar="DIR", help="create the work dirs under DIR and keep them")
    args = ap.parse_args(argv)
    ds = sorted(int(x) for x in args.deferred.split(","))
    results = []
    ok = True
    for d in ds:
        work = tempfile.mkdtemp(prefix=f"mtaq-mem-{d}-", dir=args.keep or "/var/tmp")
        try:
            r = run_one(d, args.new, work)
        except Exception as exc:
            r = {"deferred": d, "error": f"{type(exc).__name__}: {exc}"}
            ok = False
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        print(f"queue_memory: {json.dumps(r)}", file=sys.stderr, flush=True)
        ok = ok and r.get("new_delivered") == args.new
        results.append(r)
    out: dict[str, Any] = {"results": results, "body_bytes": BODY_BYTES}
    lo, hi = results[0], results[-1]
    if len(results) > 1 and lo.get("peak_rss_kib") and hi.get("peak_rss_kib") and hi["deferred"] > lo["deferred"]:
        span = hi["deferred"] - lo["deferred"]
        out["bytes_per_queued_msg"] = round((hi["peak_rss_kib"] - lo["peak_rss_kib"]) * 1024 / span, 2)
        out["rss_bytes_per_queued_msg"] = round((hi["rss_kib"] - lo["rss_kib"]) * 1024 / span, 2)
    if len(results) > 2 and results[-2].get("peak_rss_kib") and hi.get("peak_rss_kib"):
        prev = results[-2]
        # Between the two largest queues: what one more queued message costs, without the fixed start-up peak.
        out["marginal_bytes_per_queued_msg"] = round(
            (hi["peak_rss_kib"] - prev["peak_rss_kib"]) * 1024 / (hi["deferred"] - prev["deferred"]), 2
        )
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
