"""Recovery on a real disk, driven directly (no sockets): repair, conclude interrupted attempts, idempotence."""

from __future__ import annotations

import asyncio
import os

import structlog

from mtaq.core.frame import scan_segment
from mtaq.core.records import EnvelopeRecord, Outcome
from mtaq.core.state import RetryPolicy
from mtaq.logtools import verify
from mtaq.queue import Queue
from mtaq.recovery import recover
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, segment_path

LOG = structlog.get_logger("test")


def start(d: str):
    log, report = Log.open(OsFileSystem(), d, segment_bytes_max=1 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0)
    res = asyncio.run(recover(q, report, LOG))
    return log, q, res


def receive(q: Queue, n: int, rcpts=("a@x", "b@x")) -> list[EnvelopeRecord]:
    async def go():
        return [await q.receive("s@x", list(rcpts), b"Subject: %d\r\n\r\nhi\r\n" % i) for i in range(n)]

    return asyncio.run(go())


def test_recovery_after_a_torn_tail_reports_no_corruption_and_keeps_the_seal(tmp_path):
    """A torn tail repaired at open is a repair, not corruption, and the repaired segment stays sealed."""
    d = str(tmp_path)
    log, q, _ = start(d)
    receive(q, 3)
    seg = log.current_segment
    log.close()
    with open(segment_path(d, seg), "ab") as f:
        f.write(b"MQ\x02\x00\xff\xff")  # a torn frame header
    log, q, res = start(d)
    assert [] == res.corrupt
    assert [seg] == [p.segment for p in res.repaired]
    assert 3 == len(q.state.messages)
    log.close()
    assert scan_segment(seg, open(segment_path(d, seg), "rb").read()).sealed
    assert 0 == verify(d, out=open(os.devnull, "w"))


def test_interrupted_attempt_is_concluded_with_unknown_recipients_and_recovery_is_idempotent(tmp_path):
    """START + a DELIVERY for one recipient, then a crash: the other is 'unknown'; a second recovery adds nothing."""
    d = str(tmp_path)
    log, q, _ = start(d)
    [env] = receive(q, 1)
    msg = q.start(env.queue_id)
    asyncio.run(q.record_outcomes(msg, "relay", [Outcome(0, "delivered", 250, "2.0.0", "ok")]))
    log.close()  # crash: no FINISH, no replacement

    log, q, res = start(d)
    assert [(env.queue_id, "b@x")] == res.unknown
    m = q.state.messages[env.queue_id]
    assert (False, ["b@x"], [True]) == (m.active, [r.address for r in m.envelope.recipients], [r.unknown for r in m.envelope.recipients])
    log.close()

    log, q2, res2 = start(d)  # crash again right after recovery, then recover again
    assert ([], 0) == (res2.unknown, res2.concluded)
    assert m.envelope == q2.state.messages[env.queue_id].envelope
    log.close()


def test_attempt_whose_deliveries_cover_every_recipient_is_finished_by_recovery(tmp_path):
    """DELIVERY records durable for all recipients, FINISH lost: recovery writes the FINISH, nothing is resent."""
    d = str(tmp_path)
    log, q, _ = start(d)
    [env] = receive(q, 1)
    msg = q.start(env.queue_id)
    asyncio.run(q.record_outcomes(msg, "relay", [Outcome(0, "delivered", 250, "2.0.0", "ok"),
                                                 Outcome(1, "failed", 550, "5.1.1", "no")]))
    log.close()
    log, q, res = start(d)
    assert ({}, [], 1) == (q.state.messages, res.unknown, res.concluded)
    log.close()


def test_many_restarts_keep_every_queued_message(tmp_path):
    """Twenty crash-restarts in a row (each opens a new segment and seals the last): nothing is lost."""
    d = str(tmp_path)
    log, q, _ = start(d)
    envs = receive(q, 5)
    log.close()
    for _ in range(20):
        log, q, res = start(d)
        assert [] == res.corrupt
        log.close()
    assert {e.queue_id for e in envs} == set(q.state.messages)
    assert 0 == verify(d, out=open(os.devnull, "w"))
