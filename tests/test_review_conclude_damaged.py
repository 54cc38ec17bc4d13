"""Review: an attempt that queues a DSN and leaves a recipient for later must copy the message forward or
raise, never copy an empty body in its place.

Queue.conclude read the body for the DSN with ``_body_or_empty`` (b"" when the DATA does not check out or
cannot be read: EIO, EMFILE) and then copied *that* forward as the replacement's DATA: the recipient left
for later got an empty message (or, for a streamed body, a 5.3.0 bounce an attempt later), silently. That
is the path of a streamed body damaged while it was sent (the daemon concludes without the bytes) and of
recovery. Now the body is read first; CorruptRecord comes before anything is appended, the caller bounces
the rest and concludes again, and each DSN is queued once. Real log on a real disk; the byte is flipped in
the segment file as media damage would."""

from __future__ import annotations

import asyncio
import os

import pytest

from mtaq.core.errors import CorruptRecord
from mtaq.core.frame import FRAME_HEADER_BYTES
from mtaq.core.records import DataRecord, EnvelopeRecord, Outcome, encode_data_prefix
from mtaq.core.state import RetryPolicy
from mtaq.queue.store import Queue
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log, segment_path
from mtaq.testing.media import flip_bit


def flip_byte(log: Log, env: EnvelopeRecord, at: int) -> None:
    path = segment_path(log.directory, env.data.segment)
    flip_bit(path, env.data.offset + FRAME_HEADER_BYTES + len(encode_data_prefix(env.queue_id, env.size)) + at, 5)


def test_a_body_damaged_at_conclusion_bounces_each_recipient_once(tmp_path):
    log, _report = Log.open(OsFileSystem(), os.path.join(str(tmp_path), "log"), segment_bytes_max=64 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    durable: list = []
    dsns: list[tuple[str, str]] = []
    qid: list[str] = []
    ended: list = []
    q.on_durable = lambda env, pos: durable.append((pos, env))
    q.on_dsn = lambda env, qid, kind, items: dsns.append((qid, kind))
    body = b"Subject: big\r\n\r\n" + b"x" * 998 + b"\r\n" * 1 + (b"y" * 78 + b"\r\n") * 8000

    async def main() -> None:
        env = await q.receive("s@x.test", ["refused@y.test", "later@y.test"], body)
        [(pos, env)] = [(p, e) for p, e in durable if e.queue_id == env.queue_id]
        qid.append(env.queue_id)
        attempt = q.start(pos, env)
        # The next hop refused the first recipient at RCPT; the second was cut off mid-DATA (451 4.3.0:
        # the streamed body did not check out while it was sent).
        await q.record_outcomes(attempt, "mx", [Outcome(0, "failed", 550, "5.1.1", "no such user"),
                                                Outcome(1, "deferred", 451, "4.3.0", "data unreadable")])
        flip_byte(log, env, 300_000)
        with pytest.raises(CorruptRecord):
            q.conclude(attempt, None)  # cannot copy the damaged DATA forward
        # What the daemon does next (Daemon._attempt): the rest is bounced (554 5.3.0), conclude again.
        attempt.outcomes[1] = Outcome(1, "failed", 554, "5.3.0", "message data unreadable in queue")
        c, _pos = q.conclude(attempt, b"")
        ended.append(c.record)
        await log.sync()

    asyncio.run(main())
    log.close()
    assert 1 == len(dsns), dsns  # one bounce naming both recipients, not the 550 one twice
    datas = [rec for seg in scan_log(OsFileSystem(), os.path.join(str(tmp_path), "log")) for _p, rec in seg.records
             if isinstance(rec, DataRecord) and rec.queue_id == qid[0]]
    assert [] == [len(d.body) for d in datas if len(d.body) != len(body)]  # never an empty copy of the message
    assert not isinstance(ended[0], EnvelopeRecord)  # no replacement: the message ended (bounced)


def test_a_conclusion_that_fails_after_its_dsn_does_not_queue_the_dsn_again(tmp_path):
    """Review: Queue.conclude queues the DSNs, then appends the replacement; a full disk there (StorageFull)
    sent the daemon's worker to conclude again, which queued the same bounce a second time. The disk fills
    (FaultyFileSystem: ENOSPC) right after the bounce is queued; the second conclusion queues none."""
    import errno

    from mtaq.core.errors import StorageFull
    from mtaq.testing.faults import FaultyFileSystem

    fs = FaultyFileSystem()
    log, _report = Log.open(fs, os.path.join(str(tmp_path), "log"), segment_bytes_max=64 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    durable: list = []
    dsns: list[str] = []

    def disk_full_after_the_dsn(env, qid, kind, items) -> None:
        dsns.append(qid)
        fs.fail_append = errno.ENOSPC

    q.on_durable = lambda env, pos: durable.append((pos, env))
    q.on_dsn = disk_full_after_the_dsn
    ended: list = []

    async def main() -> None:
        env = await q.receive("s@x.test", ["refused@y.test", "later@y.test"], b"Subject: s\r\n\r\nsmall\r\n")
        [(pos, env)] = [(p, e) for p, e in durable if e.queue_id == env.queue_id]
        attempt = q.start(pos, env)
        await q.record_outcomes(attempt, "mx", [Outcome(0, "failed", 550, "5.1.1", "no such user"),
                                                Outcome(1, "deferred", 451, "4.4.1", "try later")])
        with pytest.raises(StorageFull):
            q.conclude(attempt, None)
        fs.fail_append = None  # space again: what the daemon's worker does after the failure
        c, _pos = q.conclude(attempt, None)
        ended.append(c.record)
        await log.sync()

    asyncio.run(main())
    log.close()
    assert 1 == len(dsns), dsns
    bounces = [rec for seg in scan_log(OsFileSystem(), os.path.join(str(tmp_path), "log")) for _p, rec in seg.records
               if isinstance(rec, EnvelopeRecord) and rec.bounce_of]
    assert 1 == len(bounces)
    assert isinstance(ended[0], EnvelopeRecord) and ["later@y.test"] == [r.address for r in ended[0].recipients
                                                                         if r.index == 1]
