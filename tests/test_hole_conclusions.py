"""Recovery beside an unsynced hole (issue 12.1): what a conclusion stands on may be in the hole.

A disk writes back unsynced pages out of order, so after a power cut a later record can be there while an
earlier one is not. The sequences here are those of the durability review: a message is received and
fsync'd (the 250 was sent), a checkpoint is written, an attempt runs and its DELIVERY is fsync'd, and its
conclusion (a fresh DATA copy and a replacement envelope; or DSN records and a FINISH) is appended but not
fsync'd. The "power cut" keeps the conclusion record and zeroes the bytes it stands on. Real Queue and
recovery on real files; the hole is made by hand as the disk would leave it.

Before the fix, recovery let the replacement close the attempt, found its DATA unreadable and ended the
message quietly ("no 250 was sent for it"), and a FINISH after a swallowed DSN counted as a conclusion, so
the acknowledged message, or its DSN, was gone.
"""

from __future__ import annotations

import asyncio
import os

from test_corrupt_area import start

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.frame import scan_segment
from mtaq.core.records import DataRecord, EnvelopeRecord, Outcome, Pos, StartRecord
from mtaq.queue.store import Queue
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log, segment_path

BODY = b"Subject: precious\r\nMessage-ID: <p@t>\r\n\r\n" + b"acknowledged mail\r\n" * 80


def live(spool: str) -> dict[str, list[tuple[Pos, EnvelopeRecord]]]:
    """Envelopes that no START names, by queue ID (and a DSN's under "dsn:" + the ID it is about)."""
    recs = [(p, r) for s in scan_log(OsFileSystem(), os.path.join(spool, "log")) for p, r in s.records]
    started = {r.envelope for _, r in recs if isinstance(r, StartRecord)}
    out: dict[str, list[tuple[Pos, EnvelopeRecord]]] = {}
    for p, r in recs:
        if isinstance(r, EnvelopeRecord) and p not in started:
            out.setdefault(f"dsn:{r.bounce_of}" if r.bounce_of else r.queue_id, []).append((p, r))
    return out


def body_of(log: Log, env: EnvelopeRecord) -> bytes | None:
    try:
        rec = log.read(env.data)
    except Exception:
        return None
    return rec.body if isinstance(rec, DataRecord) else None


def acknowledged_then_attempted(spool: str, outcome: Outcome) -> tuple[Queue, EnvelopeRecord, Pos]:
    """Receive (fsync'd), checkpoint, START, DELIVERY (fsync'd), conclude (appended only); close unsynced."""
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    e = log.durable_end
    write_checkpoint(OsFileSystem(), spool, Checkpoint(e, e, (e, e), ((), ()), 1.0))
    env_pos = live(spool)[env.queue_id][0][0]
    attempt = q.start(env_pos, env)
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [outcome]))
    log.sync_soon = lambda: None  # type: ignore[method-assign]  # the power cut comes before that fsync
    q.conclude(attempt)
    log.close()  # the conclusion was never fsync'd
    return q, env, env_pos


def zero(spool: str, which) -> list[Pos]:
    """Zero, in the newest segment, every frame for which ``which(pos, record)`` is true."""
    log_dir = os.path.join(spool, "log")
    seg = max(s.segment for s in scan_log(OsFileSystem(), log_dir))
    path = segment_path(log_dir, seg)
    raw = bytearray(open(path, "rb").read())
    scan = scan_segment(seg, bytes(raw))
    ends = [p.offset for p, _ in scan.records[1:]] + [len(raw)]
    hit = []
    for (p, r), end in zip(scan.records, ends, strict=True):
        if which(p, r):
            raw[p.offset:end] = bytes(end - p.offset)
            hit.append(p)
    open(path, "wb").write(bytes(raw))
    return hit


DEFERRED = Outcome(index=0, status="deferred", code=451, enhanced="4.2.0", text="try later")
FAILED = Outcome(index=0, status="failed", code=550, enhanced="5.1.1", text="no such user")


def test_replacement_whose_data_copy_is_in_the_hole_does_not_end_the_message(tmp_path):
    """The replacement envelope survived, its DATA copy did not: the message is still queued exactly once
    after recovery, with the body byte for byte (concluded again from the original DATA), and a second
    start changes nothing."""
    spool = str(tmp_path)
    _q, env, _ = acknowledged_then_attempted(spool, DEFERRED)
    [copy] = zero(spool, lambda p, r: isinstance(r, DataRecord) and r.queue_id == env.queue_id and p.segment > 0
                  and p != env.data)
    for _ in range(2):
        log, _q2, res = start(spool, segment_bytes_max=1 << 20)
        [(_pos, renv)] = live(spool)[env.queue_id]
        assert (BODY, 1) == (body_of(log, renv), renv.attempts)
        assert [copy.offset] == [p.offset for p in res.holes]
        log.close()


def test_dsn_swallowed_whole_by_the_hole_is_queued_again(tmp_path):
    """A 5xx: the DSN (DATA and envelope) is in the hole, the FINISH after it survived. The FINISH is no
    conclusion: recovery concludes the attempt again, and the sender's DSN is queued exactly once."""
    spool = str(tmp_path)
    _q, env, _ = acknowledged_then_attempted(spool, FAILED)
    zero(spool, lambda p, r: (isinstance(r, DataRecord) and r.queue_id != env.queue_id)
         or (isinstance(r, EnvelopeRecord) and r.bounce_of == env.queue_id))
    for _ in range(2):
        log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
        got = live(spool)
        assert env.queue_id not in got
        [(_pos, dsn)] = got[f"dsn:{env.queue_id}"]
        body = body_of(log, dsn)
        assert body is not None and b"5.1.1" in body
        log.close()


def test_dsn_envelope_whose_data_is_in_the_hole_is_replaced_by_a_readable_one(tmp_path):
    """The DSN's envelope and the FINISH survived, the DSN's DATA did not: the unreadable DSN is ended and
    a readable one queued, once."""
    spool = str(tmp_path)
    _q, env, _ = acknowledged_then_attempted(spool, FAILED)
    zero(spool, lambda p, r: isinstance(r, DataRecord) and r.queue_id != env.queue_id)
    for _ in range(2):
        log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
        [(_pos, dsn)] = live(spool)[f"dsn:{env.queue_id}"]
        assert body_of(log, dsn) is not None
        log.close()


def test_held_replacement_whose_data_copy_is_in_the_hole_stays_held(tmp_path):
    """An administrator's hold: START(admin) and the held replacement survived, its DATA copy did not.
    The hold is completed again from the original DATA: the message is held, readable, once."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    e = log.durable_end
    write_checkpoint(OsFileSystem(), spool, Checkpoint(e, e, (e, e), ((), ()), 1.0))
    q.admin(live(spool)[env.queue_id][0][0], env, "hold")
    log.close()
    zero(spool, lambda p, r: isinstance(r, DataRecord) and p != env.data)
    for _ in range(2):
        log, q2, _res = start(spool, segment_bytes_max=1 << 20)
        [(pos, henv)] = live(spool)[env.queue_id]
        assert (True, BODY, True) == (henv.held, body_of(log, henv), pos in q2.parked)
        log.close()


def flip(spool: str, pos: Pos, at: int = 20) -> None:
    path = segment_path(os.path.join(spool, "log"), pos.segment)
    raw = bytearray(open(path, "rb").read())
    raw[pos.offset + at] ^= 0x10
    open(path, "wb").write(bytes(raw))


def test_interrupted_attempt_whose_data_is_corrupt_is_bounced_by_recovery(tmp_path):
    """Issue 12.7: a crash after a deferral's DELIVERY and before the conclusion, and the message's DATA
    (durable, before the checkpoint) damaged on disk: recovery cannot copy it forward, so it bounces the
    recipient with 554 5.3.0 and a DSN, as a delivery worker does; before, the attempt was marked
    concluded with neither FINISH nor DSN."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    env_pos = live(spool)[env.queue_id][0][0]
    attempt = q.start(env_pos, env)
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [DEFERRED]))
    e = log.durable_end
    write_checkpoint(OsFileSystem(), spool, Checkpoint(e, attempt.start_pos, (e, e), ((), ()), 1.0))
    log.close()
    flip(spool, env.data, 40)
    log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
    got = live(spool)
    assert env.queue_id not in got
    [(_pos, dsn)] = got[f"dsn:{env.queue_id}"]
    body = body_of(log, dsn)
    assert body is not None and b"5.3.0" in body
    log.close()


def test_a_parked_envelope_that_cannot_be_read_is_reported(tmp_path):
    """Issue 12.7: a held message whose envelope (listed in the checkpoint, before the working suffix) is
    damaged: recovery logs ``parked_unreadable`` with its position instead of forgetting it silently."""
    import structlog

    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    _rec, held_pos, _lsn = q.admin(live(spool)[env.queue_id][0][0], env, "hold")
    asyncio.run(q.receive("carol@example.org", ["dave@example.net"], BODY))  # the held one is not the last frame
    e = log.end
    write_checkpoint(OsFileSystem(), spool, Checkpoint(e, e, (e, e), ((), ()), 1.0, parked=(held_pos,)))
    log.close()
    flip(spool, held_pos)
    with structlog.testing.capture_logs() as logs:
        log, q2, _res = start(spool, segment_bytes_max=1 << 20)
        log.close()
    assert [str(held_pos)] == [e["envelope"] for e in logs if e["event"] == "parked_unreadable"]
    assert held_pos not in q2.parked
