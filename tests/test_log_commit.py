"""Group commit and failure rules of the log (GUIDE §3, I6), on a real disk."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable

import msgspec
import pytest

from mtaq.core.errors import StorageFatal, StorageFull
from mtaq.core.frame import FRAME_HEADER_BYTES
from mtaq.core.records import FinishRecord, Pos, StartRecord, encode_payload
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, list_segments
from mtaq.testing.faults import FaultyFileSystem


def test_many_concurrent_commits_share_few_fsync_rounds(tmp_path):
    """200 writers each waiting for their record: every one is durable, with far fewer rounds than writers."""

    async def main() -> Log:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)

        async def writer(i: int) -> None:
            _, lsn = log.append(StartRecord(f"Q{i}", Pos(1, 32), 1.0))
            await log.commit(lsn)
            assert log.durable_lsn >= lsn

        await asyncio.gather(*(writer(i) for i in range(200)))
        return log

    log = asyncio.run(main())
    assert 200 == log.stats.records_appended
    assert 1 <= log.stats.commit_rounds < 50
    log.close()


def test_segments_roll_at_the_size_limit_and_are_sealed(tmp_path):
    """Appends past segment_bytes_max go to a new segment; every record stays readable at its position."""
    log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=65536)
    recs = [FinishRecord(f"Q{i:05d}", Pos(1, 32), float(i)) for i in range(6000)]
    positions = [log.append(r)[0] for r in recs]
    asyncio.run(log.sync())
    assert len(list_segments(OsFileSystem(), str(tmp_path))) >= 3
    back = [log.read(p) for p in positions]
    assert all(p.offset + FRAME_HEADER_BYTES + len(encode_payload(r)[1]) <= 65536
               for p, r in zip(positions, back, strict=True))
    # The log stamps its durable end into each record (docs/log_format.md); the rest is what was appended.
    assert recs == [msgspec.structs.replace(r, durable=None) for r in back]
    log.close()


def test_failed_fsync_fails_every_waiter_and_every_later_call(tmp_path):
    """An fsync error is fatal (I6): waiters get StorageFatal, later appends too; it is never retried."""
    fs = FaultyFileSystem()
    fatal: list[StorageFatal] = []

    async def main() -> list[object]:
        log, _ = Log.open(fs, str(tmp_path), segment_bytes_max=1 << 20)
        log.on_fatal.append(fatal.append)
        fs.fail_fsync = True
        lsns = [log.append(StartRecord(f"Q{i}", Pos(1, 32), 1.0))[1] for i in range(5)]
        res = await asyncio.gather(*(log.commit(n) for n in lsns), return_exceptions=True)
        fs.fail_fsync = False
        with pytest.raises(StorageFatal):
            log.append(StartRecord("later", Pos(1, 32), 1.0))
        with pytest.raises(StorageFatal):
            await log.commit(lsns[0])
        return res

    res = asyncio.run(main())
    assert [StorageFatal] * 5 == [type(r) for r in res]
    assert 1 == len(fatal)


def test_enospc_on_append_raises_storage_full_and_the_log_goes_on(tmp_path):
    """A full disk refuses the record (452 4.3.1 upstream) without poisoning the log."""
    fs = FaultyFileSystem()
    log, _ = Log.open(fs, str(tmp_path), segment_bytes_max=1 << 20)
    fs.fail_append = errno.ENOSPC
    with pytest.raises(StorageFull):
        log.append(StartRecord("Q", Pos(1, 32), 1.0))
    fs.fail_append = None
    pos, _ = log.append(StartRecord("Q2", Pos(1, 32), 1.0))
    assert StartRecord("Q2", Pos(1, 32), 1.0, durable=log.durable_end) == log.read(pos)  # stamped by the log
    log.close()


class _CountingFs(OsFileSystem):
    """The real file system, reporting a free space the test sets and counting the statvfs calls."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.calls = 0

    def free_bytes(self, path: str) -> int:
        self.calls += 1
        return self.free


def test_free_space_is_asked_at_most_every_ttl_and_counts_what_was_appended_since(tmp_path, monkeypatch):
    """Log.free_bytes asks the file system once per FREE_BYTES_TTL_S; in between it answers the last figure
    minus every byte appended since (never more than is free); after the TTL it asks again."""
    import mtaq.storage.log as logmod

    now = [1000.0]
    monkeypatch.setattr(logmod.time, "monotonic", lambda: now[0])
    fs = _CountingFs(10_000_000)
    log, _ = Log.open(fs, str(tmp_path), segment_bytes_max=1 << 20)
    assert 10_000_000 == log.free_bytes()
    assert 1 == fs.calls
    before = log.stats.bytes_appended
    log.append(StartRecord("Q1", Pos(1, 32), 1.0))
    appended = log.stats.bytes_appended - before
    assert 0 < appended
    fs.free = 5  # whatever the disk says now is not asked before the TTL
    assert 10_000_000 - appended == log.free_bytes()
    assert 1 == fs.calls
    now[0] += logmod.FREE_BYTES_TTL_S
    assert 5 == log.free_bytes()
    assert 2 == fs.calls
    log.close()


def test_a_segment_waiting_for_its_fsync_is_not_closed_by_the_reader_cache(tmp_path):
    """Review: the commit round takes the dirty files, then fsyncs them in its thread. A segment that
    rolled just before was no longer 'dirty' for the reader cache (least recently used closed first), so
    reads of old segments during the fsync closed it: the fsync then hit EBADF (the daemon exited), or a
    file opened meanwhile got the same descriptor number and was fsync'd instead, and the rolled segment's
    tail counted as durable without being so (a power cut would lose acknowledged mail). The disk is held
    at the fsync by FaultyFileSystem.fsync_gate while a reader opens old segments."""
    import threading

    positions: list[Pos] = []

    async def fill(log: Log) -> None:  # several sealed, durable segments to read from later
        for i in range(400):
            pos, _lsn = log.append(FinishRecord(queue_id=f"Q{i:04d}", start=Pos(1, 32), ts=1.0))
            positions.append(pos)
        await log.sync()

    old, _ = Log.open(OsFileSystem(), str(tmp_path / "log"), segment_bytes_max=4096)
    asyncio.run(fill(old))
    old.close()
    assert len({p.segment for p in positions}) >= 3
    fs = FaultyFileSystem()
    log, _ = Log.open(fs, str(tmp_path / "log"), segment_bytes_max=4096)  # the old segments are not open
    log.files_open_max = 2

    async def main() -> None:
        rolled = log.current_segment
        while log.current_segment == rolled:  # roll: `rolled` is sealed, its records not yet fsync'd
            log.append(FinishRecord(queue_id="QTAIL", start=Pos(1, 32), ts=1.0))
        fs.fsync_gate = threading.Event()
        commit = asyncio.create_task(log.sync())
        while log._dirty:  # the round has taken the dirty files and waits in its fsync thread
            await asyncio.sleep(0.001)
        for pos in positions:  # readers open the old segments meanwhile (more than files_open_max)
            log.read(pos)
        fs.fsync_gate.set()
        await commit  # StorageFatal (fsync after close) before

    asyncio.run(main())
    log.close()


def test_committers_wake_before_readers_of_the_durable_end(tmp_path):
    """After a commit round, the tasks waiting for their records to be durable (a client's 250) resume a
    loop turn before those waiting for the durable end to move (the queue runners, which start deliveries),
    even when the reader started waiting first."""
    log, _ = Log.open(OsFileSystem(), str(tmp_path / "log"), segment_bytes_max=1 << 20)
    order: list[str] = []

    async def main() -> None:
        _pos, lsn = log.append(FinishRecord(queue_id="Q1", start=Pos(1, 32), ts=1.0))

        async def runner() -> None:
            await log.durable_advanced()
            order.append("runner")

        async def client() -> None:
            await log.commit(lsn)
            order.append("250")

        r = asyncio.create_task(runner())
        await asyncio.sleep(0)
        await asyncio.gather(client(), r)

    asyncio.run(main())
    log.close()
    assert ["250", "runner"] == order



def test_a_client_woken_by_when_durable_resumes_before_a_task_that_joined_the_round_first(tmp_path):
    """In one round, the callbacks (a client's 250: Queue.receive wakes its session from one) run before the
    tasks waiting in commit() are woken, even when such a task (a delivery's records, which then log and
    append FINISH) joined the round first: the session resumes first (stop 57: straced, the 250 came after
    the previous message's delivery book-keeping)."""
    log, _ = Log.open(OsFileSystem(), str(tmp_path / "log"), segment_bytes_max=1 << 20)
    order: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        _pos, first = log.append(FinishRecord(queue_id="Q1", start=Pos(1, 32), ts=1.0))

        async def delivery() -> None:
            await log.commit(first, linger_s=5.0)  # lingers: the client's commit starts the round
            order.append("delivery")

        async def client() -> None:
            _pos, lsn = log.append(FinishRecord(queue_id="Q2", start=Pos(1, 32), ts=1.0))
            done: asyncio.Future[None] = loop.create_future()
            log.when_durable(lsn, lambda _err: done.set_result(None))
            await done
            order.append("250")

        d = asyncio.create_task(delivery())
        await asyncio.sleep(0)  # the delivery's waiter is queued first
        await asyncio.wait_for(asyncio.gather(client(), d), 10)

    asyncio.run(main())
    log.close()
    assert ["250", "delivery"] == order

def test_a_lingering_commit_rides_on_the_round_of_a_commit_that_does_not_wait(tmp_path):
    """A delivery's commit (linger_s) waits for a client's commit that comes meanwhile: one fsync round makes
    both durable. Before, the delivery's round started at once and the client's record needed a second."""

    async def main() -> Log:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        _, delivered = log.append(FinishRecord("QD", Pos(1, 32), 1.0))
        lingering = asyncio.ensure_future(log.commit(delivered, linger_s=30.0))
        await asyncio.sleep(0)  # the commit loop is waiting for company
        await asyncio.sleep(0)
        assert log.durable_lsn < delivered
        _, received = log.append(StartRecord("QR", Pos(1, 32), 1.0))
        await log.commit(received)
        await lingering
        return log

    log = asyncio.run(main())
    assert 1 == log.stats.commit_rounds
    assert 2 == log.durable_lsn
    log.close()


def test_a_lingering_commit_alone_is_made_durable_at_its_deadline(tmp_path):
    """No one else commits: the lingering record is still made durable, by a round of its own."""

    async def main() -> Log:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        _, lsn = log.append(FinishRecord("QD", Pos(1, 32), 1.0))
        await log.commit(lsn, linger_s=0.01)
        assert log.durable_lsn >= lsn
        return log

    log = asyncio.run(main())
    assert 1 == log.stats.commit_rounds
    log.close()


def test_a_commit_whose_caller_is_cancelled_while_it_waits_is_still_made_durable(tmp_path):
    """A caller cancelled during its (lingering) commit, as an attempt abandoned at delivery_timeout_s is: the
    record it appended, beyond the round already running (a delivery record appended while a client's commit
    is being fsynced), is fsynced all the same by a later round, with no one waiting any more
    (Queue.record_outcomes relies on this instead of shielding the wait). From a review."""

    async def main() -> tuple[Log, int]:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        sync_files = log._sync_files

        def slow_sync(files, sync_dir):  # the fsync thread: a round that takes a while
            time.sleep(0.1)
            return sync_files(files, sync_dir)

        log._sync_files = slow_sync  # type: ignore[method-assign]
        _, first = log.append(FinishRecord("QA", Pos(1, 32), 1.0))
        client = asyncio.get_running_loop().create_task(log.commit(first))  # a client's commit: a round starts
        await asyncio.sleep(0.02)  # that round is in its fsync
        _, lsn = log.append(FinishRecord("QB", Pos(1, 32), 1.0))  # beyond the running round
        waiting = asyncio.get_running_loop().create_task(log.commit(lsn, linger_s=0.01))
        await asyncio.sleep(0)  # the commit is asked for and waits
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await client
        assert log.durable_lsn < lsn
        for _ in range(500):  # until a round covers it (its event: the durable LSN moves)
            if log.durable_lsn >= lsn:
                break
            await asyncio.sleep(0.01)
        return log, lsn

    log, lsn = asyncio.run(main())
    assert log.durable_lsn >= lsn
    assert 2 == log.stats.commit_rounds
    log.close()


def test_a_failed_fsync_during_a_linger_fails_the_lingering_commit(tmp_path):
    """A lingering commit behind a failing fsync gets StorageFatal (I6), like any other waiter."""
    fs = FaultyFileSystem()

    async def main() -> list[object]:
        log, _ = Log.open(fs, str(tmp_path), segment_bytes_max=1 << 20)
        fs.fail_fsync = True
        _, a = log.append(FinishRecord("QD", Pos(1, 32), 1.0))
        lingering = asyncio.ensure_future(log.commit(a, linger_s=30.0))
        await asyncio.sleep(0)
        _, b = log.append(StartRecord("QR", Pos(1, 32), 1.0))
        res = await asyncio.gather(log.commit(b), lingering, return_exceptions=True)
        fs.fail_fsync = False
        log.close()
        return res

    res = asyncio.run(main())
    assert all(isinstance(r, StorageFatal) for r in res)


def test_a_received_message_is_acknowledged_before_the_runner_for_new_mail_sees_it(tmp_path):
    """Queue.receive returns (the client's 250 goes out) in the loop turn after its fsync round, before the
    readers of the durable end (the runner that starts its delivery) resume, even when the reader waited
    first and under uvloop, the daemon's loop. Before, the settling ran as a shielded task and the receive
    resumed two turns after the reader, so the delivery's first steps ran ahead of the 250."""
    import uvloop

    from mtaq.core.state import RetryPolicy
    from mtaq.queue.store import Queue

    order: list[str] = []

    async def main() -> Log:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        queue = Queue(log, policy=RetryPolicy())
        queue.on_durable = lambda env, pos: order.append("queued")

        async def runner() -> None:
            await log.durable_advanced()
            order.append("runner")

        async def client() -> None:
            await queue.receive("a@example.org", ["b@example.net"], b"Subject: t\r\n\r\nbody\r\n")
            order.append("250")

        r = asyncio.create_task(runner())
        await asyncio.sleep(0)
        await asyncio.gather(client(), r)
        return log

    log = uvloop.run(main())
    log.close()
    assert ["queued", "250", "runner"] == order


def test_when_durable_calls_back_once_with_none_or_the_fatal_error(tmp_path):
    """Log.when_durable: None once the records are durable (at once when they already are), the
    StorageFatal of a failed fsync otherwise; a callback that raises goes to the loop's exception handler and
    the other waiters of the round are answered all the same."""
    fs = FaultyFileSystem()
    got: list[object] = []
    handled: list[dict[str, object]] = []

    def boom(_err: object) -> None:
        raise RuntimeError("callback bug")

    async def main() -> Log:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: handled.append(ctx))
        log, _ = Log.open(fs, str(tmp_path), segment_bytes_max=1 << 20)
        _, first = log.append(StartRecord("Q1", Pos(1, 32), 1.0))
        log.when_durable(first, boom)
        log.when_durable(first, got.append)
        waiter = asyncio.ensure_future(log.commit(first))
        await waiter
        assert [None] == got
        log.when_durable(first, got.append)  # already durable: called at once
        assert [None, None] == got
        fs.fail_fsync = True
        _, second = log.append(StartRecord("Q2", Pos(1, 32), 1.0))
        log.when_durable(second, got.append)
        with pytest.raises(StorageFatal):
            await log.commit(second)
        log.when_durable(second, got.append)  # after the failure: the same error at once
        return log

    asyncio.run(main())
    assert [None, None] == got[:2]
    assert [StorageFatal, StorageFatal] == [type(x) for x in got[2:]]
    assert got[2] is got[3]
    assert 1 == len(handled) and isinstance(handled[0]["exception"], RuntimeError)


def test_readers_of_the_durable_end_wake_durable_wake_s_after_it_moves_together_for_several_rounds(tmp_path):
    """With durable_wake_s the readers (the queue runners) are woken that long after the durable end moved,
    while the committers (the clients' 250) are answered at the end of their rounds; the readers waiting
    across two rounds in that time are woken by one timer."""
    woke: list[tuple[str, float]] = []

    async def main() -> Log:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        log.durable_wake_s = 0.2
        loop = asyncio.get_running_loop()

        async def reader(name: str) -> None:
            await log.durable_advanced()
            woke.append((name, loop.time()))

        first = asyncio.create_task(reader("first"))
        await asyncio.sleep(0)
        t0 = loop.time()
        _, lsn = log.append(StartRecord("Q1", Pos(1, 32), 1.0))
        await log.commit(lsn)
        second = asyncio.create_task(reader("second"))
        await asyncio.sleep(0)
        _, lsn = log.append(StartRecord("Q2", Pos(1, 32), 1.0))
        await log.commit(lsn)
        assert [] == woke  # both rounds are durable and their committers answered; no reader woken yet
        assert log._wake_pending is not None and 2 == len(log._wake_pending)  # one timer for both
        await asyncio.gather(first, second)
        assert all(t - t0 >= 0.2 - 0.01 for _, t in woke)  # not before the delay (loop.time, monotonic)
        assert log._wake_pending is None
        return log

    log = asyncio.run(main())
    log.close()
    assert ["first", "second"] == [n for n, _ in woke]


def test_under_load_rounds_are_spaced_and_a_lone_caller_never_waits_for_the_spacing(tmp_path):
    """round_spacing_s (the daemon's COMMIT_SPACING_S): a lone caller's round starts at once, however soon
    after the last one; two or more callers at once wait until the spacing has passed since the last round
    started, and share one round with every caller that came meanwhile."""
    spacing = 1.0

    async def main() -> Log:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        log.round_spacing_s = spacing
        for i in range(3):  # lone callers, one after the other: a round each, none spaced
            _, lsn = log.append(StartRecord(f"L{i}", Pos(1, 32), 1.0))
            await asyncio.wait_for(log.commit(lsn), spacing * 0.9)
        assert 3 == log.stats.commit_rounds
        started = log._round_started
        lsns = [log.append(StartRecord(f"C{i}", Pos(1, 32), 1.0))[1] for i in range(2)]
        first = [asyncio.ensure_future(log.commit(lsn)) for lsn in lsns]
        await asyncio.sleep(spacing / 3)
        assert not any(f.done() for f in first)  # waiting out the spacing
        _, late = log.append(StartRecord("late", Pos(1, 32), 1.0))
        await asyncio.gather(*first, log.commit(late))
        assert time.monotonic() - started >= spacing
        assert 4 == log.stats.commit_rounds  # the two and the one that came meanwhile: one round
        return log

    log = asyncio.run(main())
    log.close()


SPACING = 2.0  # seconds: far above any fsync, so a wait for it cannot pass for one


async def _lone_round(log: Log) -> None:
    _, lsn = log.append(StartRecord("first", Pos(1, 32), 1.0))
    await log.commit(lsn)  # sets _round_started: the next round is "too soon" for SPACING


def _client(log: Log, name: str) -> asyncio.Future[float]:
    """What Queue.receive does for a client's message: append, when_durable; the future gives the wait."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    _, lsn = log.append(StartRecord(name, Pos(1, 32), 1.0))
    t0 = time.monotonic()
    log.when_durable(lsn, lambda err: done.set_result(time.monotonic() - t0) if err is None else done.set_exception(err))
    return done


def _lone_client_wait(tmp_path, scenario: Callable[[Log], Awaitable[float]]) -> float:
    """Seconds a lone client's 250 waited in ``scenario`` (on a log spaced SPACING, right after a round)."""

    async def main() -> float:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        log.round_spacing_s = SPACING
        try:
            await _lone_round(log)
            return await scenario(log)
        finally:
            log.close()

    return asyncio.run(main())


def test_a_lone_client_does_not_wait_for_the_spacing_because_of_sync_soon(tmp_path):
    """One session: the client's 250 (when_durable) and a delivery's conclude() (sync_soon: a retry envelope
    or a DSN) wait at the same round start. Only one *client* waits: before, the round was spaced anyway,
    and the lone client's 250 waited up to round_spacing_s (the daemon's COMMIT_SPACING_S) longer."""

    async def scenario(log: Log) -> float:
        waited = _client(log, "client")
        log.append(StartRecord("retry-envelope", Pos(1, 32), 1.0))
        log.sync_soon()  # Queue.conclude of a deferred delivery, same loop turn
        return await waited

    waited = _lone_client_wait(tmp_path, scenario)
    assert waited < SPACING / 2, f"the lone client waited {waited:.3f} s for the spacing"


def test_a_lone_client_does_not_wait_for_the_spacing_because_of_a_checkpoint(tmp_path):
    """Same with the checkpointer's Log.sync() (Daemon.checkpoint) or an admin operation's commit()."""

    async def scenario(log: Log) -> float:
        log.append(StartRecord("runner-position", Pos(1, 32), 1.0))
        checkpoint = asyncio.ensure_future(log.sync())  # Daemon.checkpoint
        await asyncio.sleep(0)  # the checkpoint is waiting; the commit loop has not started its round
        waited = _client(log, "client")  # a client's DATA ends in the same loop turn
        w = await waited
        await checkpoint
        return w

    waited = _lone_client_wait(tmp_path, scenario)
    assert waited < SPACING / 2, f"the lone client waited {waited:.3f} s for the spacing"


def test_a_cancelled_committer_does_not_count_as_a_second_caller(tmp_path):
    """A commit() whose caller was cancelled (its future is done) does not count as an at-once caller:
    before, it counted until a round covered it, and a lone client then waited for the spacing."""

    async def scenario(log: Log) -> float:
        _, lsn = log.append(StartRecord("gone", Pos(1, 32), 1.0))
        gone = asyncio.ensure_future(log.commit(lsn))
        await asyncio.sleep(0)  # enqueued
        gone.cancel()
        return await _client(log, "client")

    waited = _lone_client_wait(tmp_path, scenario)
    assert waited < SPACING / 2, f"the lone client waited {waited:.3f} s for the spacing"


def test_a_failure_during_the_spacing_sleep_fails_every_waiter_at_once(tmp_path):
    """_fail (a half record that cannot be truncated) while the loop sleeps out the spacing: the waiters get
    StorageFatal at once, not after the sleep, and nothing is acknowledged; later calls fail too."""

    async def main() -> None:
        fs = FaultyFileSystem()
        log, _ = Log.open(fs, str(tmp_path), segment_bytes_max=1 << 20)
        log.round_spacing_s = SPACING
        try:
            await _lone_round(log)
            a, b = _client(log, "a"), _client(log, "b")
            await asyncio.sleep(SPACING / 5)
            assert log._commit_task is not None and not a.done()  # sleeping out the spacing
            fs.fail_truncate = errno.EIO

            calls = []

            def pieces():  # the second pass (the copy) differs from the first (the checksum)
                calls.append(1)
                return iter([b"x" * 10] if len(calls) == 1 else [b"x" * 9])

            t0 = time.monotonic()
            with pytest.raises(ValueError):
                log.append_data("Q", pieces, 10)  # written, then truncated: EIO -> _fail
            assert log._failed is not None
            for f in (a, b):
                with pytest.raises(StorageFatal):
                    await f
            assert time.monotonic() - t0 < SPACING / 5
            with pytest.raises(StorageFatal):
                await log.commit(log._appended_lsn)
            seen = []
            log.when_durable(1, seen.append)
            assert isinstance(seen[0], StorageFatal) or seen[0] is None  # lsn 1 is durable from before
            await asyncio.sleep(SPACING)
            assert log._commit_task is None  # the loop ended after its sleep, without a round
            assert 1 == log.stats.commit_rounds
        finally:
            log.close()

    asyncio.run(main())


def test_commits_arriving_during_the_sleep_and_sync_soon_are_all_released(tmp_path):
    """Waiters that come while the loop sleeps (commit, when_durable, sync_soon, a lingering commit) are all
    released by the spaced round or the next one; none is stranded; _round_started survives a restart."""

    async def main() -> None:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        log.round_spacing_s = 0.05
        try:
            for _ in range(20):
                futs = [_client(log, f"c{i}") for i in range(3)]
                await asyncio.sleep(0.01)
                futs.append(_client(log, "late"))
                _, lsn = log.append(StartRecord("linger", Pos(1, 32), 1.0))
                futs.append(asyncio.ensure_future(log.commit(lsn, linger_s=1.0)))
                log.append(StartRecord("soon", Pos(1, 32), 1.0))
                log.sync_soon()
                await asyncio.wait_for(asyncio.gather(*futs), 10.0)
                assert not log._waiters
                await asyncio.sleep(0)
                assert log._commit_task is None
        finally:
            log.close()

    asyncio.run(main())


def test_closing_the_log_fails_the_callers_no_round_will_cover(tmp_path):
    """Log.close() (tests and tools; the daemon never closes) while the loop sleeps out the spacing: the
    callers get StorageFatal instead of waiting for ever, and later calls fail too."""

    async def main() -> None:
        log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
        log.round_spacing_s = SPACING
        await _lone_round(log)
        a, b = _client(log, "a"), _client(log, "b")
        await asyncio.sleep(SPACING / 5)
        log.close()
        for f in (a, b):
            with pytest.raises(StorageFatal):
                await asyncio.wait_for(f, SPACING / 2)
        with pytest.raises(StorageFatal):
            await log.commit(log._appended_lsn)

    asyncio.run(main())


def test_the_sync_thread_runs_calls_in_order_hands_back_results_and_errors_and_survives_a_cancelled_caller():
    """SyncThread (the log's fsync thread): results and exceptions reach the caller's loop, calls run in the
    order made, a caller that stopped waiting does not stop its call nor break the next one, a loop that
    closed while its call ran does not stop the thread, and after shutdown the thread ends once the calls
    made have run and a new call raises RuntimeError (as the executor's did)."""
    import threading

    from mtaq.storage.log import SyncThread

    sync = SyncThread()
    ran: list[int] = []
    gate = threading.Event()

    def slow(i: int) -> int:
        gate.wait(10)
        ran.append(i)
        return i

    def fail() -> None:
        raise OSError(errno.EIO, "Input/output error")

    async def main() -> None:
        first = sync.call(slow, 1)
        second = sync.call(lambda: (ran.append(2), threading.current_thread().name)[1])
        first.cancel()  # its caller stops waiting: the call still runs, before the next
        gate.set()
        assert "mtaq-fsync" == await second
        assert [1, 2] == ran
        with pytest.raises(OSError) as exc:
            await sync.call(fail)
        assert errno.EIO == exc.value.errno
        assert 7 == await sync.call(slow, 7)

    asyncio.run(main())
    gate.clear()

    async def abandon() -> None:  # the loop closes while its call waits at the gate
        sync.call(slow, 9)

    asyncio.run(abandon())
    gate.set()

    async def after() -> int:
        gate.clear()
        pending = sync.call(slow, 11)
        sync.shutdown()  # the call made before still runs
        with pytest.raises(RuntimeError):
            sync.call(slow, 12)
        gate.set()
        return await pending

    thread = sync._thread
    assert thread is not None
    assert 11 == asyncio.run(after())
    thread.join(10)
    assert not thread.is_alive()
    assert [1, 2, 7, 9, 11] == ran


def test_a_sync_thread_nobody_holds_ends_its_thread_and_shutdown_from_another_thread_loses_no_call(tmp_path):
    """A Log dropped without close() does not leave its fsync thread behind (it ends when the SyncThread is
    collected, as an executor's thread did), and shutdown() from another thread while calls are being made
    neither loses nor hangs a call made before it: each is answered or refused."""
    import gc
    import threading

    from mtaq.storage.log import SyncThread

    async def one_round(sync: SyncThread) -> int:
        return await sync.call(lambda: 5)

    threads = []
    for _ in range(5):
        sync = SyncThread()
        assert 5 == asyncio.run(one_round(sync))
        threads.append(sync._thread)
        del sync
    for _ in range(5):  # a real Log, its rounds a bound method of it (the thread must not keep that)
        log, _report = Log.open(OsFileSystem(), str(tmp_path / f"log{len(threads)}"), segment_bytes_max=1 << 20)

        async def commit_one(log: Log = log) -> None:
            _, lsn = log.append(StartRecord("Q1", Pos(1, 32), 1.0))
            await log.commit(lsn)

        asyncio.run(commit_one())
        threads.append(log._syncer._thread)
        del log, commit_one
    gc.collect()
    for t in threads:
        assert t is not None
        t.join(10)
        assert not t.is_alive()

    sync = SyncThread()

    async def many() -> list[str]:
        stop = threading.Timer(0.01, sync.shutdown)
        stop.start()
        futures = []
        outcomes = []
        for i in range(20000):
            try:
                futures.append(sync.call(lambda i=i: i))
            except RuntimeError:
                outcomes.append("refused")
                break
            if i % 100 == 0:
                await asyncio.sleep(0)
        stop.join()
        for f in futures:
            await asyncio.wait_for(f, 10)  # every call made before the shutdown is answered
            outcomes.append("answered")
        return outcomes

    outcomes = asyncio.run(many())
    assert "answered" in outcomes
    assert outcomes.count("refused") <= 1


def test_a_commit_after_close_fails_with_storage_fatal_instead_of_waiting_for_ever(tmp_path):
    """A record appended before close() and committed after it: no round can run (the fsync thread is shut
    down), so the commit raises StorageFatal at once; it used to wait for good (review, stop 59)."""
    log, _ = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=1 << 20)
    _, lsn = log.append(StartRecord("Q1", Pos(1, 32), 1.0))
    log.close()

    async def main() -> None:
        with pytest.raises(StorageFatal):
            await asyncio.wait_for(log.commit(lsn), 10)

    asyncio.run(main())
