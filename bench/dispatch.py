"""CPU per offer of the dispatcher, the hand-over from the queue runners to the delivery workers (issue 15.4).

``--idle`` delivery workers (each takes an offer and accepts it at once, as a worker appends its START and
accepts) wait on one :class:`mtaq.queue.runners.Dispatcher` under uvloop, the daemon's loop; one runner
offers ``--offers`` envelopes one after the other. Measured: process CPU seconds over the offers, per
offer in microseconds. With an ``asyncio.Event`` every offer woke every idle worker; the dispatcher now
wakes one, so the cost should not grow with the number of idle workers.

Prints ONE JSON line: ``{"bench": "dispatch", "offers": N, "results": [{"idle_workers": W,
"cpu_us_per_offer": X}, ...]}``. To compare two trees: ``PYTHONPATH=TREE .venv/bin/python bench/dispatch.py``.

    .venv/bin/python bench/dispatch.py --idle 1,10,20 --offers 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvloop

from mtaq.core.records import EnvelopeRecord, Pos, Recipient
from mtaq.queue.runners import Dispatcher

_ENV = EnvelopeRecord("Q", 0, 1.0, 1.0, "s@x", (Recipient(0, "r@y"),), Pos(1, 32), 1, runner=0)


async def _per_offer_us(idle: int, offers: int) -> float:
    d = Dispatcher(6)

    async def worker() -> None:
        while True:
            (await d.take()).accept()

    workers = [asyncio.create_task(worker()) for _ in range(idle)]
    await asyncio.sleep(0)
    t0 = time.process_time()
    for i in range(offers):
        await d.offer(0, Pos(1, 32 + i), _ENV)
    spent = time.process_time() - t0
    for w in workers:
        w.cancel()
    return round(spent / offers * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", default="1,10,20", help="idle delivery workers, comma-separated")
    ap.add_argument("--offers", type=int, default=20000)
    args = ap.parse_args()
    results = [{"idle_workers": int(w), "cpu_us_per_offer": uvloop.run(_per_offer_us(int(w), args.offers))}
               for w in args.idle.split(",")]
    print(json.dumps({"bench": "dispatch", "offers": args.offers, "results": results}))


if __name__ == "__main__":
    main()
