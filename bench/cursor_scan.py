"""How long a queue runner's cursor takes to pass over the log: records/s and MB/s of one full pass.

Builds a log of ``--messages`` messages of ``--size`` bytes (real Queue, real files, fsync'd), then times a
fresh :class:`LogCursor` from the oldest segment to the end looking for envelopes (what runner k does),
with the shared caches emptied before each of ``--runs`` passes. Prints one JSON object.

    .venv/bin/python bench/cursor_scan.py --messages 20000 --size 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

from mtaq.core.records import Pos, RecordType
from mtaq.core.state import RetryPolicy
from mtaq.queue.store import Queue
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, list_segments


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        log_dir = os.path.join(d, "log")
        log, _ = Log.open(OsFileSystem(), log_dir, segment_bytes_max=64 * 1024 * 1024)
        q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), reporting_mta="bench.test")
        body = b"Subject: x\r\n\r\n" + b"y" * max(0, a.size - 16) + b"\r\n"

        async def fill() -> None:
            for i in range(0, a.messages, 500):
                await asyncio.gather(*(q.receive("s@x.test", ["r@y.test"], body) for _ in range(min(500, a.messages - i))))

        asyncio.run(fill())
        first = Pos(list_segments(OsFileSystem(), log_dir)[0], 32)
        end = log.durable_end
        size = sum(os.path.getsize(os.path.join(log_dir, f)) for f in os.listdir(log_dir))
        times = []
        for _ in range(a.runs):
            log.decoded.clear()
            getattr(log, "confirmed", {}).clear()
            cur = LogCursor(log, first)
            t0 = time.perf_counter()
            n = 0
            while (found := cur.peek(end, lambda t: t == RecordType.ENVELOPE)) is not None:
                if found is not False:
                    n += 1
                    cur.skip()
            times.append(time.perf_counter() - t0)
        log.close()
    med = statistics.median(times)
    print(json.dumps({"messages": a.messages, "size": a.size, "envelopes": n, "log_bytes": size,
                      "pass_s_median": round(med, 4), "envelopes_per_s": round(n / med),
                      "mb_per_s": round(size / med / 1e6, 1), "runs": a.runs}))


if __name__ == "__main__":
    main()
