"""Recovery: the only way to start (crash-only software; seed 001).

Before SMTP listens, :meth:`Log.open` repairs the newest segment's tail and starts a fresh segment, so mail
can be accepted at once. Then :func:`recover` reads the older segments (the working suffix; until the
runners issue adds checkpoints and reclamation, that is every segment still on disk), applies their records
to the queue state, repairs unsealed segments left by a crash at a roll-over, reports corruption with segment
and offset, and concludes every attempt that was active at the crash with a replacement envelope (or a
FINISH when its DELIVERY records cover every recipient). Recipients of such attempts without a durable
DELIVERY record have an *unknown* outcome (GUIDE I4): they are logged as such and retried.

What must always hold (GUIDE I5): recovery finishes whatever it reads (bad records are reported, not
raised), and running it again after a crash in the middle loses nothing: it only appends records that a
second run would append again or recognise.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mtaq.core.frame import Problem, scan_segment
from mtaq.core.records import EnvelopeRecord
from mtaq.queue import Queue
from mtaq.storage.log import OpenReport

__all__ = ["RecoveryResult", "recover"]


@dataclass
class RecoveryResult:
    """What recovery did. ``seconds`` is wall time; ``records`` the records applied from old segments."""

    seconds: float = 0.0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    repaired: list[Problem] = field(default_factory=list)
    corrupt: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    concluded: int = 0
    unknown: list[tuple[str, str]] = field(default_factory=list)  # (queue_id, recipient)


async def recover(queue: Queue, report: OpenReport, logger: Any) -> RecoveryResult:
    """Rebuild ``queue.state`` from the segments listed in ``report`` and conclude interrupted attempts."""
    t0 = time.monotonic()
    res = RecoveryResult(repaired=list(report.repaired))
    log = queue.log
    for p in report.repaired:
        logger.warning("torn_tail_repaired", segment=p.segment, offset=p.offset, bytes=p.end - p.offset, reason=p.reason)
    for n in report.segments:
        scan = report.scans.pop(n, None)
        if scan is None:
            buf = await asyncio.to_thread(log.read_segment, n)
            res.bytes += len(buf)
            scan = await asyncio.to_thread(scan_segment, n, buf, skip_data=True)
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
            note = queue.state.apply(pos, rec)
            if note:
                res.notes.append(note)
                logger.warning("log_inconsistency", note=note)
        res.records += len(scan.records)
        await asyncio.sleep(0)  # let SMTP clients in between segments
    for msg in [m for m in queue.state.messages.values() if m.active]:
        for r in msg.envelope.recipients:
            if r.index not in msg.outcomes:
                res.unknown.append((msg.queue_id, r.address))
                logger.warning("outcome_unknown", queue_id=msg.queue_id, recipient=r.address, action="retry")
        rec = queue.conclude(msg)
        res.concluded += 1
        if isinstance(rec, EnvelopeRecord):
            logger.info("attempt_concluded", queue_id=msg.queue_id, recipients_left=len(rec.recipients))
        else:
            logger.info("removed", queue_id=msg.queue_id)
    await log.sync()
    res.seconds = time.monotonic() - t0
    return res
