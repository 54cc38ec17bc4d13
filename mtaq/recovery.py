"""Recovery: the only way to start (crash-only software; seed 001).

Before SMTP listens, :meth:`Log.open` repairs the newest segment's tail and starts a fresh segment, so mail
is accepted at once. Then :func:`recover`:

1. loads the checkpoint (advisory: without one, or with a torn one, it starts from the oldest segment);
2. reads the *working suffix*, from ``min(suffix, head)`` of the checkpoint to the end of the log, and only
   that: its time depends on how much was in flight and how long ago the checkpoint was written, not on
   how much mail is queued (GUIDE I5). It repairs unsealed segments left by a crash at a roll-over, reports
   corruption with segment and offset, and collects:
   - every START whose attempt was not concluded (no replacement envelope or FINISH names it), with the
     outcomes of its DELIVERY records;
   - the envelopes ahead of each runner that a START already made garbage, which the runner must skip;
3. concludes each interrupted attempt like a delivery worker would: DSNs for durable failures, then a
   FINISH or a replacement envelope. A recipient without a durable DELIVERY record has an *unknown*
   outcome (GUIDE I4): it is logged as such and retried at once by the runner for new mail.

Running it again after a crash in the middle loses nothing: it only appends records that a second run
would append again, or that conclude what the second run would otherwise conclude.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.frame import SEGMENT_HEADER_BYTES, Problem, scan_segment
from mtaq.core.records import DeliveryRecord, EnvelopeRecord, FinishRecord, Outcome, Pos, StartRecord
from mtaq.core.state import Attempt
from mtaq.errors import CorruptRecord
from mtaq.queue import Queue
from mtaq.storage.checkpoint import read_checkpoint
from mtaq.storage.log import OpenReport
from mtaq.testing import killpoints

__all__ = ["RecoveryResult", "recover"]


@dataclass
class RecoveryResult:
    """What recovery did, and where the runners start. ``seconds`` is wall time."""

    seconds: float = 0.0
    checkpoint: str = ""  # "" when one was used, else why not
    scan_from: Pos = field(default_factory=lambda: Pos(0, 0))
    segments: int = 0
    records: int = 0
    bytes: int = 0
    repaired: list[Problem] = field(default_factory=list)
    corrupt: list[Problem] = field(default_factory=list)
    concluded: int = 0
    unknown: list[tuple[str, str]] = field(default_factory=list)  # (queue_id, recipient)
    runners: list[Pos] = field(default_factory=list)
    garbage: list[set[Pos]] = field(default_factory=list)


@dataclass(slots=True)
class _Open:
    start: StartRecord
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    remote_dsn: bool = False


async def recover(queue: Queue, report: OpenReport, spool: str, logger: Any) -> RecoveryResult:
    """Read the working suffix, conclude interrupted attempts, and return the runners' start positions."""
    t0 = time.monotonic()
    log = queue.log
    n = queue.policy.runners
    res = RecoveryResult(repaired=list(report.repaired))
    for p in report.repaired:
        logger.warning("torn_tail_repaired", segment=p.segment, offset=p.offset, bytes=p.end - p.offset, reason=p.reason)
    first = Pos(report.segments[0] if report.segments else report.new_segment, SEGMENT_HEADER_BYTES)

    def clamp(p: Pos) -> Pos:
        return p if p >= first else first

    cp: Checkpoint | None
    cp, why = read_checkpoint(log.fs, spool)
    res.checkpoint = why
    if cp is not None:
        scan_from = clamp(min(cp.suffix, cp.head))
        runners = [clamp(p) for p in cp.runners[:n]]
        runners += [min(runners, default=scan_from)] * (n - len(runners))
        garbage = [{g for g in gs if g >= runners[k]} for k, gs in enumerate(cp.garbage[:n])]
        garbage += [set() for _ in range(n - len(garbage))]
    else:
        logger.info("checkpoint_unused", reason=why, action="scanning every segment")
        scan_from = first
        runners = [first] * n
        garbage = [set() for _ in range(n)]
    res.scan_from = scan_from
    open_attempts: dict[Pos, _Open] = {}
    for seg in report.segments:
        if seg < scan_from.segment:
            continue
        scan = report.scans.pop(seg, None)
        if scan is None:
            buf = await asyncio.to_thread(log.read_segment, seg)
            res.bytes += len(buf)
            scan = await asyncio.to_thread(scan_segment, seg, buf, skip_data=True)
        res.segments += 1
        for p in scan.problems:
            if p.kind == "torn-tail" and not scan.sealed:
                res.repaired.append(p)
                logger.warning("torn_tail_repaired", segment=p.segment, offset=p.offset, bytes=p.end - p.offset, reason=p.reason)
            else:
                res.corrupt.append(p)
                logger.error("corrupt_record", segment=p.segment, offset=p.offset, end=p.end, kind=p.kind, reason=p.reason)
        if scan.header is not None and (scan.torn_tail is not None or not scan.sealed):
            await asyncio.to_thread(log.repair_segment, scan)
        for pos, rec in scan.records:
            if pos < scan_from:
                continue
            res.records += 1
            if isinstance(rec, StartRecord):
                open_attempts[pos] = _Open(rec)
                k = min(rec.runner, n - 1)
                if rec.envelope >= runners[k]:
                    garbage[k].add(rec.envelope)
            elif isinstance(rec, DeliveryRecord):
                o = open_attempts.get(rec.start)
                if o is not None:
                    o.outcomes.update((x.index, x) for x in rec.outcomes)
                    o.remote_dsn = o.remote_dsn or rec.remote_dsn
            elif isinstance(rec, EnvelopeRecord):
                if rec.replaces is not None:
                    open_attempts.pop(rec.replaces, None)
            elif isinstance(rec, FinishRecord):
                open_attempts.pop(rec.start, None)
        await asyncio.sleep(0)  # let SMTP clients in between segments
    killpoints.hit("recovery.before_conclude")
    for start_pos, o in sorted(open_attempts.items()):
        try:
            env = log.read(o.start.envelope)
        except CorruptRecord as exc:
            logger.error("corrupt_envelope", queue_id=o.start.queue_id, start=str(start_pos), error=str(exc))
            continue
        if not isinstance(env, EnvelopeRecord):
            logger.error("corrupt_envelope", queue_id=o.start.queue_id, start=str(start_pos), error="not an envelope")
            continue
        attempt = Attempt(env, o.start.envelope, start_pos, dict(o.outcomes), o.remote_dsn)
        queue.working.attempts[start_pos] = attempt
        for r in env.recipients:
            if r.index not in attempt.outcomes:
                res.unknown.append((env.queue_id, r.address))
                logger.warning("outcome_unknown", queue_id=env.queue_id, recipient=r.address, action="retry")
        try:
            c, _ = queue.conclude(attempt)
        except CorruptRecord as exc:
            queue.working.concluded(start_pos)
            logger.error("corrupt_message", queue_id=env.queue_id, error=str(exc))
            continue
        res.concluded += 1
        if isinstance(c.record, EnvelopeRecord):
            logger.info("attempt_concluded", queue_id=env.queue_id, recipients_left=len(c.record.recipients))
        else:
            logger.info("removed", queue_id=env.queue_id)
    await log.sync()
    res.runners, res.garbage = runners, garbage
    res.seconds = time.monotonic() - t0
    return res
