"""A large message retried later is copied forward in pieces, never held whole (issue 15.2's memory bound,
extended to deferral): Queue.conclude without the body appends the replacement's DATA from the log in
pieces (Log.append_data over StoredBody.pieces). The copy is byte for byte the original; memory allocated
while concluding stays near the piece size, not the message size; a damaged body raises CorruptRecord
with the log left as it was; on a read error the replacement names the old DATA. Real log, real disk."""

from __future__ import annotations

import asyncio
import errno
import os
import tracemalloc

import pytest

from mtaq.core.errors import CorruptRecord
from mtaq.core.frame import FRAME_HEADER_BYTES
from mtaq.core.records import DataRecord, EnvelopeRecord, Outcome, encode_data_prefix
from mtaq.core.state import RetryPolicy
from mtaq.queue.store import Queue
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log, segment_path
from mtaq.testing.faults import FaultyFileSystem
from mtaq.testing.media import flip_bit

SIZE = 8 << 20  # 8 MiB: far above the streaming threshold and the 64 KiB pieces


def _with_deferred(tmp_path, scenario, fs=None) -> None:
    """Run ``scenario(log, queue, env, attempt, body)`` in an event loop, on a queue holding one 8 MiB message
    whose only recipient was just deferred."""
    log, _report = Log.open(fs or OsFileSystem(), os.path.join(str(tmp_path), "log"), segment_bytes_max=64 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    durable: list = []
    q.on_durable = lambda env, pos: durable.append((pos, env))
    body = b"Subject: big\r\n\r\n" + os.urandom(SIZE // 2).hex().encode()[: SIZE - 18] + b"\r\n"

    async def main() -> None:
        env = await q.receive("s@x.test", ["later@y.test"], body)
        [(pos, env)] = [(p, e) for p, e in durable if e.queue_id == env.queue_id]
        attempt = q.start(pos, env)
        await q.record_outcomes(attempt, "mx", [Outcome(0, "deferred", 451, "4.4.1", "try later")])
        await scenario(log, q, env, attempt, body)
        await log.sync()

    try:
        asyncio.run(main())
    finally:
        log.close()


def _datas(tmp_path, qid: str) -> list[bytes]:
    return [rec.body for seg in scan_log(OsFileSystem(), os.path.join(str(tmp_path), "log")) for _p, rec in seg.records
            if isinstance(rec, DataRecord) and rec.queue_id == qid]


def test_a_deferred_large_message_is_copied_forward_in_pieces_byte_for_byte(tmp_path):
    seen: list = []

    async def scenario(log, q, env, attempt, body) -> None:
        tracemalloc.start()
        try:
            c, _pos = q.conclude(attempt, None)
            _size, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert isinstance(c.record, EnvelopeRecord) and c.record.data > env.data  # a new DATA, later in the log
        assert peak < SIZE // 8, f"{peak} bytes allocated while copying an {SIZE}-byte message forward"
        seen.append((env.queue_id, body))

    _with_deferred(tmp_path, scenario)
    [(qid, body)] = seen
    assert [body, body] == _datas(tmp_path, qid)


def test_a_damaged_large_body_is_not_copied_and_the_log_is_left_as_it_was(tmp_path):
    async def scenario(log, q, env, attempt, _body) -> None:
        path = segment_path(log.directory, env.data.segment)
        at = env.data.offset + FRAME_HEADER_BYTES + len(encode_data_prefix(env.queue_id, env.size)) + SIZE // 2
        flip_bit(path, at, 3)
        end = log.end
        with pytest.raises(CorruptRecord):
            q.conclude(attempt, None)
        assert end == log.end  # nothing appended: the caller bounces the rest and concludes again

    _with_deferred(tmp_path, scenario)


def test_an_unreadable_large_body_leaves_the_replacement_naming_the_old_data(tmp_path):
    fs = FaultyFileSystem()  # the disk answering EIO to reads (a real failing disk cannot be had here)

    async def scenario(log, q, env, attempt, _body) -> None:
        fs.fail_pread = errno.EIO
        try:
            c, _pos = q.conclude(attempt, None)
        finally:
            fs.fail_pread = None
        assert isinstance(c.record, EnvelopeRecord) and env.data == c.record.data

    _with_deferred(tmp_path, scenario, fs)


def test_the_daemon_delivers_a_deferred_streamed_message_byte_for_byte_after_a_crash(tmp_path):
    """End to end: a 2 MB message deferred by the next hop, its copy made in pieces, the daemon killed and
    restarted, the retry delivered: the sink gets the same bytes it was first offered, once."""
    import re

    from test_runners import Harness, run

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        h.sink.defer = re.compile("^later@")
        await h.send("a@x.test", ["later@y.test"], "big", size=2_000_000)
        await h.until(lambda: h.daemon.admin.size()["deferred"] == 1 and not len(h.daemon.queue.working),
                      what="deferred once")
        offered = h.sink.rcpt_attempts[:]
        await h.crash()
        h.sink.defer = None
        await h.start()
        h.clock.offset += 1100
        h.poke()
        [raw] = await h.until(lambda: h.sink.to("later@y.test"), what="delivered on retry")
        pad = b"x" * 76 + b"\r\n"  # what Harness.send wrote after the headers
        assert raw.endswith(b"Subject: big\r\nMessage-ID: <big@t>\r\n\r\nbody\r\n" + pad * (2_000_000 // len(pad)))
        assert ["later@y.test"] == offered and 1 == len(h.sink.to("later@y.test"))

    run(tmp_path, body, retry_intervals_s=[1000.0])


def test_checking_a_large_body_for_delivery_lets_other_tasks_run_between_pieces(tmp_path):
    """The daemon checks a large body just after START with StoredBody.verify_yielding: every 64 KiB piece
    is followed by a turn of the event loop (other sessions go on), and damage still raises CorruptRecord."""
    from mtaq.queue.store import StoredBody

    async def scenario(log, q, env, attempt, _body) -> None:
        body = q.body_for_delivery(env, check=False)
        assert isinstance(body, StoredBody)
        turns = 0
        done = False

        async def other_session() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_session())
        await asyncio.sleep(0)
        await body.verify_yielding()
        done = True
        await task
        pieces = -(-SIZE // body.piece_bytes)
        assert turns >= pieces - 1, (turns, pieces)
        path = segment_path(log.directory, env.data.segment)
        flip_bit(path, env.data.offset + FRAME_HEADER_BYTES + len(encode_data_prefix(env.queue_id, env.size)) + 7, 1)
        with pytest.raises(CorruptRecord):
            await body.verify_yielding()

    _with_deferred(tmp_path, scenario)


def test_holding_and_copying_a_large_parked_message_forward_never_reads_it_whole(tmp_path):
    """An administrator's hold (DATA copied with the replacement) and the checkpoint's copy of parked mail
    (Queue.copy_forward) copy a large message in pieces too: bounded memory, byte-for-byte copies."""
    log, _report = Log.open(OsFileSystem(), os.path.join(str(tmp_path), "log"), segment_bytes_max=64 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    durable: list = []
    q.on_durable = lambda env, pos: durable.append((pos, env))
    body = b"Subject: held\r\n\r\n" + os.urandom(SIZE // 2).hex().encode()[: SIZE - 19] + b"\r\n"
    peaks: list[int] = []
    qid: list[str] = []

    async def main() -> None:
        env = await q.receive("s@x.test", ["r@y.test"], body)
        [(pos, env)] = [(p, e) for p, e in durable if e.queue_id == env.queue_id]
        qid.append(env.queue_id)
        tracemalloc.start()
        try:
            held, held_pos, _lsn = q.admin(pos, env, "hold")
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.reset_peak()
            assert isinstance(held, EnvelopeRecord)
            await q.copy_forward(held_pos, held)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        await log.sync()

    asyncio.run(main())
    log.close()
    assert all(p < SIZE // 8 for p in peaks), peaks
    assert [body, body, body] == _datas(tmp_path, qid[0])
