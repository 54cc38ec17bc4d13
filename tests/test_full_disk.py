"""A full disk (or no file descriptor left) must not stop the deliveries that would free space (issue 31.9).

A checkpoint that cannot be written is logged (``checkpoint_failed``) and tried again, like a failed archive;
the daemon goes on. A start on a full disk gives up the reserve file (``LOG_DIR/reserve``, made at a
checkpoint while the disk has room) to create its segment, recovers and delivers.

The in-process daemon (real spool, real loopback SMTP) on :class:`FaultyFileSystem`: ``fail_create`` refuses
new files, ``room`` is a nearly full disk.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re

import structlog
from test_runners import Harness

from mtaq.storage.log import RESERVE_BYTES, RESERVE_NAME
from mtaq.testing.faults import FaultyFileSystem


def test_a_checkpoint_that_cannot_be_written_is_logged_and_the_daemon_goes_on(tmp_path):
    """Checkpoints every 50 ms while no file can be created (ENOSPC; EMFILE is the same path): each is logged
    as checkpoint_failed, the daemon keeps running and delivering, and checkpoints resume once files can be
    created again (before: the first such checkpoint ended the daemon)."""
    fs = FaultyFileSystem()
    h = Harness(tmp_path, checkpoint_interval_s=0.05)

    async def main() -> None:
        await h.start_sink()
        d = await h.start(fs)
        try:
            with structlog.testing.capture_logs() as logs:
                fs.fail_create = errno.ENOSPC
                await h.until(lambda: sum(e["event"] == "checkpoint_failed" for e in logs) >= 2, what="two failed")
                done = d.checkpoints
                assert not h.task.done()
                await h.send("alice@example.org", ["bob@example.net"], "during")
                await h.until(lambda: h.sink.to("bob@example.net"), what="delivered while checkpoints fail")
                fs.fail_create = None
                await h.until(lambda: d.checkpoints > done, what="a checkpoint written again")
            assert not h.task.done()
            [e, *_] = [e for e in logs if e["event"] == "checkpoint_failed"]
            assert "No space left on device" in e["error"] or "injected" in e["error"]
        finally:
            await h.crash()
            h.sink_server.close()

    asyncio.run(main())


def test_a_start_on_a_full_disk_gives_up_the_reserve_and_delivers(tmp_path):
    """Run 1 queues a deferred message (its checkpoint made the reserve file). Run 2 starts on a disk with no
    room at all: creating its segment fails with ENOSPC, the reserve is given up (spool_reserve_released),
    and the daemon recovers and delivers the message when it is due (before: Log.open raised StorageFull and
    the daemon could not start)."""
    h = Harness(tmp_path, retry_intervals_s=[1000.0])

    async def main() -> None:
        await h.start_sink()
        await h.start()
        try:
            h.sink.defer = re.compile("^later@")
            await h.send("alice@example.org", ["later@example.net"], "full")
            await h.until(lambda: h.daemon.queue.counts.by_state["deferred"] == 1, what="deferred")
            assert RESERVE_BYTES == os.path.getsize(os.path.join(h.spool, "log", RESERVE_NAME))
            await h.crash()
            h.sink.defer = None
            fs = FaultyFileSystem()
            fs.room = 0  # the disk is full
            with structlog.testing.capture_logs() as logs:
                await h.start(fs)
                h.clock.offset += 2000
                h.poke()
                await h.until(lambda: h.sink.to("later@example.net"), what="delivered after a start on a full disk")
            assert ["spool_reserve_released"] == [e["event"] for e in logs if e["event"] == "spool_reserve_released"]
            assert not os.path.exists(os.path.join(h.spool, "log", RESERVE_NAME))
            assert not h.task.done()
        finally:
            if h.task and not h.task.done():
                await h.crash()
            h.sink_server.close()

    asyncio.run(main())


def test_a_roll_over_on_a_full_disk_takes_the_reserves_room(tmp_path):
    """While running: the disk fills up, and the next segment cannot be created; the log gives up its
    reserve (made by keep_reserve while there was room) and the append goes on into the new segment."""
    from mtaq.core.frame import FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES
    from mtaq.core.records import FinishRecord, Pos, SealRecord, encode_payload
    from mtaq.storage.log import Log

    fs = FaultyFileSystem()
    log, _report = Log.open(fs, str(tmp_path / "log"), segment_bytes_max=65536)
    assert log.keep_reserve(RESERVE_BYTES, free_at_least=0)
    assert not log.keep_reserve(RESERVE_BYTES, free_at_least=0)  # there is one already
    first = log.current_segment
    p0, _ = log.append(FinishRecord("Q000000", Pos(1, 32), 0.0))
    p1, _ = log.append(FinishRecord("Q000001", Pos(1, 32), 1.0))
    frame = p1.offset - p0.offset
    i = 2
    while log.segment_size(first) + frame <= 65536:
        log.append(FinishRecord(f"Q{i:06d}", Pos(1, 32), float(i)))
        i += 1
    _t, seal = encode_payload(SealRecord(segment=first, records=i))
    # Room for this segment's SEAL (16 bytes more than its fields: the durable end the log may stamp in it)
    # and not for the next segment's header (SEGMENT_HEADER_BYTES, 32).
    fs.room = FRAME_HEADER_BYTES + len(seal) + 16
    assert 16 < SEGMENT_HEADER_BYTES
    log.append(FinishRecord(f"Q{i:06d}", Pos(1, 32), float(i)))
    assert (first + 1, 1) == (log.current_segment, log.stats.reserve_released)
    assert not os.path.exists(str(tmp_path / "log" / RESERVE_NAME))
    asyncio.run(log.sync())
    log.close()
