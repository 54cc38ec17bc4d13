"""Recovery on a real disk, driven directly (no sockets): repair, interrupted attempts, checkpoints, idempotence."""

from __future__ import annotations

import asyncio
import os

import structlog

from mtaq.core.checkpoint import Checkpoint, CheckpointError, decode_checkpoint, encode_checkpoint
from mtaq.core.frame import scan_segment
from mtaq.core.records import EnvelopeRecord, FinishRecord, Outcome, Pos
from mtaq.core.state import RetryPolicy
from mtaq.queue.recovery import recover
from mtaq.queue.store import Queue
from mtaq.storage.checkpoint import CHECKPOINT_NAME, read_checkpoint, write_checkpoint
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log, segment_path
from mtaq.storage.logtools import verify

LOG = structlog.get_logger("test")


def start(spool: str):
    """Open the log and recover, as the daemon does at every start."""
    log, report = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=1 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    res = asyncio.run(recover(q, report, spool, LOG))
    return log, q, res


def receive(q: Queue, n: int, rcpts=("a@x", "b@x")) -> list[tuple[EnvelopeRecord, Pos]]:
    got: list[tuple[EnvelopeRecord, Pos]] = []
    q.on_durable = lambda env, pos: got.append((env, pos))

    async def go():
        for i in range(n):
            await q.receive("s@x", list(rcpts), b"Subject: %d\r\n\r\nhi\r\n" % i)

    asyncio.run(go())
    return got


def records(spool: str):
    return [r for s in scan_log(OsFileSystem(), os.path.join(spool, "log")) for _, r in s.records]


def test_recovery_after_a_torn_tail_reports_no_corruption_and_keeps_the_seal(tmp_path):
    """A torn tail repaired at open is a repair, not corruption, and the repaired segment stays sealed."""
    spool = str(tmp_path)
    log, q, _ = start(spool)
    receive(q, 3)
    seg = log.current_segment
    log.close()
    with open(segment_path(os.path.join(spool, "log"), seg), "ab") as f:
        f.write(b"MQ\x02\x00\xff\xff")  # a torn frame header
    log, q, res = start(spool)
    log.close()
    assert [] == res.corrupt
    assert [seg] == [p.segment for p in res.repaired]
    assert scan_segment(seg, open(segment_path(os.path.join(spool, "log"), seg), "rb").read()).sealed
    assert 3 == sum(isinstance(r, EnvelopeRecord) for r in records(spool))
    assert 0 == verify(os.path.join(spool, "log"), out=open(os.devnull, "w"))


def test_interrupted_attempt_is_concluded_with_unknown_recipients_and_recovery_is_idempotent(tmp_path):
    """START + a DELIVERY for one recipient, then a crash: the other is 'unknown' and retried by runner 0
    with a fresh copy of the data; a second recovery after that finds nothing to conclude."""
    spool = str(tmp_path)
    log, q, _ = start(spool)
    [(env, pos)] = receive(q, 1)
    a = q.start(pos, env)
    asyncio.run(q.record_outcomes(a, "relay", [Outcome(0, "delivered", 250, "2.0.0", "ok")]))
    log.close()  # crash: no FINISH, no replacement

    log, q, res = start(spool)
    log.close()
    assert [(env.queue_id, "b@x")] == res.unknown
    [rep] = [r for r in records(spool) if isinstance(r, EnvelopeRecord) and r.replaces is not None]
    assert (0, ["b@x"], [True], a.start_pos) == (rep.runner, [r.address for r in rep.recipients],
                                                [r.unknown for r in rep.recipients], rep.replaces)
    assert rep.data != env.data  # copied forward

    log, q, res2 = start(spool)  # crash again right after recovery, then recover again
    log.close()
    assert ([], 0) == (res2.unknown, res2.concluded)


def test_attempt_whose_deliveries_cover_every_recipient_is_finished_by_recovery(tmp_path):
    """DELIVERY records durable for all recipients, FINISH lost: recovery writes the FINISH, nothing is resent."""
    spool = str(tmp_path)
    log, q, _ = start(spool)
    [(env, pos)] = receive(q, 1, rcpts=("a@x",))
    a = q.start(pos, env)
    asyncio.run(q.record_outcomes(a, "relay", [Outcome(0, "delivered", 250, "2.0.0", "ok")]))
    log.close()
    log, q, res = start(spool)
    log.close()
    assert ([], 1) == (res.unknown, res.concluded)
    recs = records(spool)
    assert [(env.queue_id, a.start_pos, 1000.0)] == [(r.queue_id, r.start, r.ts) for r in recs if isinstance(r, FinishRecord)]
    assert [] == [r for r in recs if isinstance(r, EnvelopeRecord) and r.replaces is not None]


def test_checkpoint_torn_at_every_byte_is_refused_and_recovery_falls_back_to_a_full_scan(tmp_path):
    """A checkpoint cut anywhere never decodes; recovery then scans from the oldest segment and finds
    the same interrupted attempt it would have found with the checkpoint."""
    cp = Checkpoint(Pos(3, 100), Pos(2, 40), (Pos(3, 100), Pos(1, 32)), ((), (Pos(2, 10),)), 5.0)
    raw = encode_checkpoint(cp)
    assert cp == decode_checkpoint(raw)
    for cut in range(len(raw)):
        try:
            decode_checkpoint(raw[:cut])
        except CheckpointError:
            continue
        raise AssertionError(f"torn checkpoint of {cut} bytes decoded")

    spool = str(tmp_path)
    log, q, _ = start(spool)
    [(env, pos)] = receive(q, 1)
    q.start(pos, env)
    asyncio.run(log.sync())
    write_checkpoint(OsFileSystem(), spool, Checkpoint(log.end, log.end, (log.end, log.end), ((), ()), 1.0))
    log.close()
    with open(os.path.join(spool, CHECKPOINT_NAME), "r+b") as f:
        f.truncate(len(f.read()) - 3)
    assert read_checkpoint(OsFileSystem(), spool)[0] is None
    log, q, res = start(spool)
    log.close()
    assert res.checkpoint  # not used, and says why
    assert [(env.queue_id, "a@x"), (env.queue_id, "b@x")] == res.unknown


def test_many_restarts_keep_every_queued_message(tmp_path):
    """Twenty crash-restarts in a row (each opens a new segment and seals the last): nothing is lost."""
    spool = str(tmp_path)
    log, q, _ = start(spool)
    envs = receive(q, 5)
    log.close()
    for _ in range(20):
        log, q, res = start(spool)
        assert [] == res.corrupt
        log.close()
    assert {e.queue_id for e, _ in envs} == {r.queue_id for r in records(spool) if isinstance(r, EnvelopeRecord)}
    assert 0 == verify(os.path.join(spool, "log"), out=open(os.devnull, "w"))
