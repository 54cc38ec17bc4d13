"""The round trip of one fsync from an event loop, three ways (docs/performance.md, "Stop 59"): ``fdatasync``
inline on the loop's thread, ``loop.run_in_executor`` on a one-thread ``ThreadPoolExecutor`` (mtaq before
stop 59), and mtaq's own :class:`mtaq.storage.log.SyncThread` (a commit round's fsyncs since then).

One process under uvloop (as the daemon runs), an otherwise idle loop; before each fsync ``--bytes`` are
appended to a scratch file in ``--dir`` (a file of the disk the spool is on is what matters); the three ways
alternate within a run, so a disk whose speed drifts favours none. Prints one JSON object: ``{"bench":
"fsync_round", "rounds": R, "bytes": B, "dir": D, "runs": [{"inline": ms, "executor": ms, "syncthread": ms},
...]}``, each the median of R round trips in milliseconds.

    .venv/bin/python bench/fsync_round.py --rounds 1500 --runs 3 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

import uvloop

from mtaq.storage.log import SyncThread


async def one_run(fd: int, rounds: int, size: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    data = b"x" * size
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    sync = SyncThread()
    times: dict[str, list[float]] = {"inline": [], "executor": [], "syncthread": []}
    try:
        for _ in range(rounds):
            os.write(fd, data)
            t = time.perf_counter()
            await loop.run_in_executor(pool, os.fdatasync, fd)
            times["executor"].append(time.perf_counter() - t)
            os.write(fd, data)
            t = time.perf_counter()
            await sync.call(os.fdatasync, fd)
            times["syncthread"].append(time.perf_counter() - t)
            os.write(fd, data)
            t = time.perf_counter()
            os.fdatasync(fd)
            await asyncio.sleep(0)  # one pass of the loop, as the other two ways take at least
            times["inline"].append(time.perf_counter() - t)
    finally:
        pool.shutdown()
        sync.shutdown()
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1500, help="fsyncs of each way per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=2200, help="bytes appended before each fsync")
    ap.add_argument("--dir", default="/var/tmp", help="where the scratch file is made")
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        fd = os.open(os.path.join(d, "fsync.dat"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(args.runs):
                runs.append(uvloop.run(one_run(fd, args.rounds, args.bytes)))
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
    print(json.dumps({"bench": "fsync_round", "rounds": args.rounds, "bytes": args.bytes, "dir": args.dir,
                      "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
