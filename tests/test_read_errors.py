"""Read errors that can pass are not damage (issue 12.5): bounded open files, runners that survive EMFILE
and EIO, and a body that cannot be read for such a reason is deferred, never bounced.

The in-process daemon (real spool, real loopback SMTP) runs on :class:`FaultyFileSystem`, the real file
system with errors injected on demand, since a failing disk or a process out of descriptors cannot be had
on cue here.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re

import structlog
from test_corrupt_area import receive, start
from test_runners import Harness

from mtaq.core.records import EnvelopeRecord
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log
from mtaq.testing.faults import FaultyFileSystem


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_log_keeps_at_most_files_open_max_segment_files_open_for_reading(tmp_path):
    """Reading a record in each of 40 segments with files_open_max = 8 leaves at most 8 more descriptors
    open (before: one per segment ever read, so held mail pinning old segments could exhaust them)."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=65536)
    receive(q, 1200, size=1500)
    log.close()
    envs = [p for s in scan_log(OsFileSystem(), os.path.join(spool, "log")) for p, r in s.records
            if isinstance(r, EnvelopeRecord)]
    log, _report = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=65536)
    log.files_open_max = 8
    before = open_fds()
    segs = sorted({p.segment for p in envs})
    assert len(segs) >= 30
    for p in envs:
        assert isinstance(log.read(p), EnvelopeRecord)
    assert open_fds() - before <= 8
    log.close()


def test_runners_survive_emfile_and_eio_and_deliver_once_they_pass(tmp_path):
    """Deferred mail due while every read of the log fails (EIO, then EMFILE on opening a segment): the
    runner logs runner_read_failed and keeps its place; the daemon keeps running; when reads work again
    the message is delivered once (before: the runner task died and the daemon exited with status 70)."""
    fs = FaultyFileSystem()
    h = Harness(tmp_path, retry_intervals_s=[1000.0], segment_bytes_max=65536, admin_listen="")

    async def main() -> None:
        await h.start_sink()
        await h.start(fs)
        try:
            h.sink.defer = re.compile("^slow@")
            await h.send("alice@example.org", ["slow@example.net"], "r1")
            await h.until(lambda: h.daemon.queue.counts.by_state["deferred"] == 1, what="deferred")
            for _ in range(40):  # the deferred envelope ends up in an older segment
                await h.send("bob@example.org", ["fast@example.net"], "pad", size=4000)
            await h.until(lambda: len(h.sink.to("fast@example.net")) == 40, what="padding delivered")
            h.daemon.queue.log.files_open_max = 1
            h.daemon.queue.log._close_readers(0)
            h.sink.defer = None
            with structlog.testing.capture_logs() as logs:
                fs.fail_pread = errno.EIO
                fs.fail_open = errno.EMFILE
                h.clock.offset += 2000
                h.poke()
                await h.until(lambda: any(e["event"] == "runner_read_failed" for e in logs), what="read failure logged")
                await asyncio.sleep(1.5)  # past one retry: still failing, still running
                assert not h.task.done()
                fs.fail_pread = fs.fail_open = None
                # Whatever was offered meanwhile could not read its body: deferred (451 4.3.0), not bounced.
                await h.until(lambda: h.daemon.queue.counts.by_state["deferred"] == 1 and not h.daemon.queue.working.attempts,
                              what="the slow message waiting again")
                h.clock.offset += 5000
                h.poke()
                await h.until(lambda: h.sink.to("slow@example.net"), what="delivered once reads work")
            assert 1 == len(h.sink.to("slow@example.net"))
            assert not h.task.done()
            assert [] == [e for e in logs if e["event"] in ("bounced", "corrupt_message")]
            assert [] == [e for e in logs if e["event"] == "deferred" and e["dsn"] not in ("4.3.0", "4.2.0")]
        finally:
            await h.crash()
            h.sink_server.close()

    asyncio.run(main())


def test_segments_this_process_wrote_do_not_stay_open_after_their_fsync(tmp_path):
    """files_open_max bounds the segments a process wrote too (issue 31.12): rolling over 40 segments, each
    round fsync'd and nothing reclaimed (held mail pins them all), leaves at most files_open_max segment
    files open besides the one being written (before: each rolled-over segment kept its write handle until
    reclamation deleted it, up to the last retry interval, so a busy spool ran out of descriptors)."""
    from mtaq.core.records import FinishRecord, Pos

    async def main() -> None:
        log, _report = Log.open(OsFileSystem(), str(tmp_path), segment_bytes_max=65536)
        log.files_open_max = 4
        before = open_fds()
        first = log.current_segment
        i = 0
        while log.current_segment < first + 40:
            for _ in range(200):
                log.append(FinishRecord(f"Q{i:06d}", Pos(1, 32), float(i)))
                i += 1
            await log.sync()
        assert 40 == len(log.segments()) - 1  # nothing reclaimed
        assert open_fds() - before <= 4
        log.close()

    asyncio.run(main())
