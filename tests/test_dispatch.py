"""Runner and dispatcher on a real log (no sockets): positions stay truthful; new and deferred mail alternate."""

from __future__ import annotations

import asyncio

from mtaq.core.frame import SEGMENT_HEADER_BYTES
from mtaq.core.records import DataRecord, EnvelopeRecord, Pos, Recipient
from mtaq.queue.runners import Dispatcher, Runner
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log


def add(log: Log, qid: str, runner: int) -> Pos:
    data, _ = log.append(DataRecord(qid, b"x"))
    pos, _ = log.append(EnvelopeRecord(qid, 0, 1.0, 1.0, "s@x", (Recipient(0, "r@y"),), data, 1, runner=runner))
    return pos


def test_a_declined_offer_keeps_the_runner_position_and_is_offered_again(tmp_path):
    """If the worker cannot append the START (full disk) it declines: the runner does not move past the
    envelope (a checkpoint now would not call it started) and offers the same envelope again."""

    async def main() -> None:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        first = Pos(log.current_segment, SEGMENT_HEADER_BYTES)
        pos = add(log, "Q1", 0)
        await log.sync()
        d = Dispatcher(2)
        r = Runner(0, log, d, first, set(), runners=2)
        task = asyncio.create_task(r.run())
        o = await asyncio.wait_for(d.take(), 5)
        assert pos == o.pos
        o.decline()
        await asyncio.sleep(0.05)
        assert pos == r.position
        again = await asyncio.wait_for(d.take(), 5)
        assert pos == again.pos
        again.accept()
        await asyncio.sleep(0.05)
        assert r.position > pos
        task.cancel()
        log.close()

    asyncio.run(main())


def test_workers_alternate_between_new_and_deferred_mail(tmp_path):
    """With both waiting, takes alternate: new, deferred, new, deferred (Postfix's incoming/deferred)."""

    async def main() -> list[int]:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        first = Pos(log.current_segment, SEGMENT_HEADER_BYTES)
        for i in range(4):
            add(log, f"N{i}", 0)
            add(log, f"D{i}", 1)
        await log.sync()
        d = Dispatcher(2)
        runners = [Runner(k, log, d, first, set(), runners=2) for k in range(2)]
        tasks = [asyncio.create_task(r.run()) for r in runners]
        await asyncio.sleep(0.05)  # both runners have an offer up
        order = []
        for _ in range(8):
            o = await asyncio.wait_for(d.take(), 5)
            order.append(o.runner)
            o.accept()
            await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        log.close()
        return order

    assert [0, 1, 0, 1, 0, 1, 0, 1] == asyncio.run(main())


def _envelope(qid: str) -> EnvelopeRecord:
    return EnvelopeRecord(qid, 0, 1.0, 1.0, "s@x", (Recipient(0, "r@y"),), Pos(1, 32), 1, runner=0)


def test_an_offer_wakes_one_idle_worker_not_all(monkeypatch):
    """20 idle delivery workers, one offer: one worker looks for it (before, an asyncio.Event woke all 20,
    and 19 found nothing and went back to sleep, for every message)."""
    looks = {"n": 0}
    real = Dispatcher._pick

    def counted(self):
        looks["n"] += 1
        return real(self)

    monkeypatch.setattr(Dispatcher, "_pick", counted)

    async def main() -> tuple[int, int]:
        d = Dispatcher(2)
        takers = [asyncio.create_task(d.take()) for _ in range(20)]
        await asyncio.sleep(0)
        assert looks["n"] == 20  # each looked once and waits
        offering = asyncio.create_task(d.offer(0, Pos(1, 32), _envelope("Q1")))
        for _ in range(5):
            await asyncio.sleep(0)
        done = [t for t in takers if t.done()]
        assert len(done) == 1
        done[0].result().accept()
        await offering
        for t in takers:
            t.cancel()
        return looks["n"], len(done)

    n, done = asyncio.run(main())
    assert (n, done) == (21, 1)


def test_a_worker_cancelled_after_it_was_woken_passes_the_offer_on():
    """The woken worker is cancelled before it runs (the daemon stopping one): the next idle worker takes
    the offer, which is never left waiting with idle workers asleep."""

    async def main() -> str:
        d = Dispatcher(2)
        first = asyncio.create_task(d.take())
        second = asyncio.create_task(d.take())
        await asyncio.sleep(0)
        offering = asyncio.create_task(d.offer(0, Pos(1, 32), _envelope("Q1")))
        await asyncio.sleep(0)  # the offer is made and wakes the first worker
        first.cancel()
        o = await asyncio.wait_for(second, 5)
        o.accept()
        await offering
        return o.envelope.queue_id

    assert asyncio.run(main()) == "Q1"
