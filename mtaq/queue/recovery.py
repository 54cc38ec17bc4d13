"""Recovery: the only way to start (crash-only software; seed 001).

Before SMTP listens, :meth:`Log.open` fsyncs every existing segment (the durable baseline, GUIDE I7), repairs the newest segment's tail and starts a fresh segment, so mail
is accepted at once. Then :func:`recover`:

1. loads the checkpoint (advisory: without one, or with a torn one, it starts from the oldest segment);
2. reads the *working suffix*, from ``min(suffix, head)`` of the checkpoint to the end of the log, and only
   that: its time depends on how much was in flight and how long ago the checkpoint was written, not on
   how much mail is queued (GUIDE I5). It repairs unsealed segments left by a crash at a roll-over, reports
   corruption with segment and offset, and collects:
   - every START whose attempt was not concluded (no replacement envelope or FINISH names it), with the
     outcomes of its DELIVERY records;
   - the envelopes ahead of each runner that a START already made garbage, which the runner must skip;
   It first learns how far the log is known to be durable (the checkpoint's head, the ``durable`` field of
   every ENVELOPE and START, the envelopes STARTs name): damage before that point is corruption, after it
   (with records after it) an unsynced hole. A conclusion written after a hole that lies within its own
   attempt is not trusted (the hole may have held its DATA copy or its DSNs): the attempt stays open, and
   what that conclusion left is ended; so is a replacement whose START was lost (docs/log_format.md, "What
   recovery trusts", the whole rule in one place);
3. concludes each interrupted attempt like a delivery worker would: DSNs for durable failures, then a
   FINISH or a replacement envelope; DATA that cannot be copied forward bounces what is left (554 5.3.0). A recipient without a durable DELIVERY record has an *unknown*
   outcome (GUIDE I4): it is logged as such and retried at once by the runner for new mail.

Running it again after a crash in the middle loses nothing: it only appends records that a second run
would append again, or that conclude what the second run would otherwise conclude.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mtaq.core.checkpoint import Checkpoint, restore_runners
from mtaq.core.errors import CorruptRecord
from mtaq.core.frame import SEGMENT_FLAG_START, SEGMENT_HEADER_BYTES, Problem, scan_segment
from mtaq.core.parking import RECOVERY_END, QueueCounts
from mtaq.core.records import (
    PARKED,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    SealRecord,
    StartRecord,
)
from mtaq.core.state import Attempt
from mtaq.queue.store import Queue, far_data
from mtaq.storage.checkpoint import read_checkpoint
from mtaq.storage.log import KEYED_SEGMENTS_MAX, OpenReport, RecoveredEnvelopes
from mtaq.storage.quarantine import list_quarantine, quarantine
from mtaq.testing import killpoints

__all__ = ["RECORDS_KEPT_MAX", "RecoveryResult", "move_aside", "recover"]

RECORDS_KEPT_MAX = 100_000  # decoded records recovery keeps between its passes (about 100 MiB); past it, read again


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
    corrupt: list[Problem] = field(default_factory=list)  # damage to durable data (moved aside, reported)
    holes: list[Problem] = field(default_factory=list)  # unsynced holes left by a crash (moved aside)
    concluded: int = 0
    unknown: list[tuple[str, str]] = field(default_factory=list)  # (queue_id, recipient)
    runners: list[Pos] = field(default_factory=list)
    garbage: list[set[Pos]] = field(default_factory=list)
    # The maildrop files named by the envelopes of the working suffix (EnvelopeRecord.maildrop): already queued,
    # whatever became of them since; the pick-up at start removes such a file instead of queueing it again.
    maildrop: set[str] = field(default_factory=set)
    # Event exporters (issue 37): endpoint URL -> (restart, acknowledged) positions from the checkpoint, clamped
    # to the oldest segment left; ``exporter_new``: where an endpoint the checkpoint does not name starts (the
    # checkpoint's head: events from then on; the oldest segment without a checkpoint); ``exporter_pin``: the
    # checkpoint's, clamped (None: none).
    exporters: dict[str, tuple[Pos, Pos]] = field(default_factory=dict)
    exporter_new: Pos = field(default_factory=lambda: Pos(0, 0))
    exporter_pin: Pos | None = None


def _read_envelope(log: Any, pos: Pos) -> EnvelopeRecord | None:
    try:
        rec = log.read(pos)
    except (CorruptRecord, OSError):
        return None
    return rec if isinstance(rec, EnvelopeRecord) else None


def _end_envelope(queue: Queue, pos: Pos, env: EnvelopeRecord, *, counted: bool) -> None:
    """End the live envelope at ``pos`` without an attempt: START and FINISH. ``counted``: it is in the
    queue's counts (replayed), which then lose it."""
    log = queue.log
    start_pos, _ = log.append(StartRecord(queue_id=env.queue_id, envelope=pos, ts=queue.clock(), runner=env.runner,
                                          admin=RECOVERY_END))
    log.append(FinishRecord(queue_id=env.queue_id, start=start_pos, ts=queue.clock()))
    queue.parked.remove(pos)
    if counted:
        queue.counts.started(env)
        queue.counts.concluded(None)


def _bounce_unreadable(attempt: Attempt, exc: Exception) -> None:
    """Fail every recipient of ``attempt`` without a final outcome: its DATA cannot be read (554 5.3.0, RFC
    3463 "other or undefined mail system status"), as the delivery worker does."""
    for r in attempt.envelope.recipients:
        if r.index not in attempt.outcomes or attempt.outcomes[r.index].status == "deferred":
            attempt.outcomes[r.index] = Outcome(index=r.index, status="failed", code=554, enhanced="5.3.0",
                                                text=f"message data unreadable in queue: {exc}")


async def move_aside(log: Any, spool: str, p: Problem, logger: Any, *, epoch_segment: int = 0) -> None:
    """Copy a damaged region into ``SPOOL/corrupt`` and report it: an error for corruption, a warning for
    an unsynced hole. A region already moved aside by an earlier start is reported once more, quietly."""
    hole = p.kind == "unsynced-hole"
    event = "unsynced_hole" if hole else "corrupt_record"
    fields = {"segment": p.segment, "offset": p.offset, "end": p.end, "kind": p.kind, "reason": p.reason}
    try:
        raw = await asyncio.to_thread(log.read_bytes, p.segment, p.offset, p.end - p.offset)
        path, new = await asyncio.to_thread(quarantine, log.fs, spool, p, raw, epoch_segment=epoch_segment)
    except OSError as exc:
        logger.error(event, **fields, moved_to=None, copy_error=str(exc))
        return
    if not new:
        logger.info(f"{event}_known", **fields, moved_to=path)
    elif hole:
        logger.warning(event, **fields, moved_to=path, records_after_it="kept")
    else:
        logger.error(event, **fields, moved_to=path)


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

    since_start = queue.counts.by_state.copy()
    cp: Checkpoint | None
    cp, why = read_checkpoint(log.fs, spool)
    res.checkpoint = why
    if cp is not None:
        scan_from = clamp(min(cp.suffix, cp.head))
        # The number of runners may have changed (retry_intervals_s): each runner takes over those that read
        # its envelopes before, from the earliest of their positions (core.checkpoint.restore_runners).
        restored = restore_runners(tuple(clamp(p) for p in cp.runners), cp.garbage, n)
        runners, garbage = restored.positions, restored.garbage
        if restored.rescan_from is not None and restored.rescan_from < scan_from:
            scan_from = restored.rescan_from  # the STARTs of what the runners further ahead had started
            logger.info("runners_merged", runners_before=len(cp.runners), runners=n, scan_from=str(scan_from))
        # Counts and parked envelopes as of head; what came after head is replayed below.
        replay_from = clamp(cp.head)
        queue.counts = QueueCounts.restore(cp.counts)
        parked_before = [p for p in cp.parked if p >= first]
        pins: dict[Pos, Pos] = {e: d for e, d in cp.pins if e >= first}
        res.exporters = {url: (clamp(r), clamp(a)) for url, r, a in cp.exporters}
        res.exporter_new = clamp(cp.head)
        res.exporter_pin = clamp(cp.exporter_pin) if cp.exporter_pin is not None else None
    else:
        logger.info("checkpoint_unused", reason=why, action="scanning every segment")
        scan_from = first
        res.exporter_new = first
        runners = [first] * n
        garbage = [set() for _ in range(n)]
        replay_from = first
        queue.counts = QueueCounts()
        parked_before = []
        pins = {}
    res.scan_from = scan_from
    # Mail is accepted while recovery runs (into the new segment, which it does not read): keep its counts.
    queue.counts.by_state.update(since_start)
    parked_after: dict[Pos, EnvelopeRecord] = {}  # parked envelopes written after replay_from
    unparked: set[Pos] = set()  # parked envelopes started after replay_from
    open_attempts: dict[Pos, _Open] = {}
    aside = list_quarantine(log.fs, spool)  # regions moved aside by an earlier start keep their kind
    holes: list[Problem] = []
    unreadable: dict[Pos, EnvelopeRecord] = {}  # envelopes whose DATA lies in an unsynced hole
    started: set[Pos] = set()
    dsns: dict[str, list[tuple[Pos, EnvelopeRecord]]] = {}  # DSN envelopes by the queue ID they are about
    dropped: dict[Pos, tuple[EnvelopeRecord, bool, str]] = {}  # envelopes to end: (envelope, counted, why)
    replacements: dict[Pos, list[Pos]] = {}  # START -> the replacement envelopes that conclude it
    starts_read: set[Pos] = set()  # START records read in the working suffix

    # Pass 1: read the working suffix, and learn how far the log is known to have been fsync'd. Every
    # ENVELOPE and START carries the durable end when it was appended, and a START names an envelope that
    # was durable (runners offer nothing else); the checkpoint's head was fsync'd before it was written.
    scans: list[tuple[int, Any, bool]] = []
    # Decoded records are kept from pass 1 for pass 2 up to RECORDS_KEPT_MAX; past it a segment's records are
    # dropped after pass 1 and the segment is read again in pass 2 (the same bytes: only pass 2's repair writes
    # to an old segment, after the read). Memory then stays flat however long the scan (a start without a
    # checkpoint over a million deferred messages held 1 GiB of records; issue 36.3).
    kept = 0
    reread: set[int] = set()
    # The claims are kept per segment: a run's claims vouch only for the bytes of its own run and earlier
    # ones, never for the unsynced tail of an earlier run that its start's baseline fsync made durable as it
    # was (holes and all). Runs end at the segment before one a start opened (its header's start flag), at
    # those a start sealed (a SEAL without a claim; segments older than the flag), and at the newest now.
    claims: dict[int, Pos] = {}
    # This start opened report.new_segment: the newest earlier segment ended the last run (sealed by this
    # start, or already sealed by a roll-over just before the crash).
    run_ends: set[int] = set(report.unsealed) | ({max(report.segments)} if report.segments else set())
    prev_seg: int | None = None
    for seg in report.segments:
        if seg < scan_from.segment:
            continue
        scan = report.scans.pop(seg, None)
        if scan is None:
            buf = await asyncio.to_thread(log.read_segment, seg)
            res.bytes += len(buf)
            scan = await asyncio.to_thread(scan_segment, seg, buf, skip_data=True)
        scans.append((seg, scan, seg in report.unsealed or not scan.sealed))
        if scan.header is not None and scan.header.flags & SEGMENT_FLAG_START and prev_seg is not None:
            run_ends.add(prev_seg)  # a start opened ``seg``: the segment before it ended a run
        prev_seg = seg
        for _pos, rec in scan.records:
            if isinstance(rec, SealRecord) and rec.durable is None:
                run_ends.add(seg)  # sealed by the repair at a start: the last segment of a run
            claim = getattr(rec, "durable", None)  # every record kind but DATA carries one (docs/log_format.md)
            if isinstance(rec, StartRecord):  # a runner starts only durable envelopes
                started_claim = Pos(rec.envelope.segment, rec.envelope.offset + 1)
                claim = started_claim if claim is None or started_claim > claim else claim
            if claim is not None and claim > claims.get(seg, Pos(0, 0)):
                claims[seg] = claim
        kept += len(scan.records)
        if kept > RECORDS_KEPT_MAX and seg != report.segments[-1]:
            kept -= len(scan.records)
            scan.records = []
            reread.add(seg)
        await asyncio.sleep(0)  # let SMTP clients in between segments

    checkpoint_head = cp.head if cp is not None else Pos(0, 0)

    def durable_known_for(at: Pos) -> Pos:
        """How far the log is known to have been fsync'd, as evidence about the bytes at ``at``: the largest
        claim of a record of ``at``'s run or an earlier one (and the checkpoint's head, when it lies in
        those runs). Without a run end after ``at``, every claim counts."""
        end = min((r for r in run_ends if r >= at.segment), default=None)
        known = checkpoint_head if end is None or checkpoint_head.segment <= end else Pos(0, 0)
        for seg, claim in claims.items():
            if (end is None or seg <= end) and claim > known:
                known = claim
        return known

    # Where the last good frame ends, DATA frames included (recovery's scans list no DATA records): damage
    # before it has good frames after it.
    last_record = max((Pos(sc.segment, sc.valid_end) for _s, sc, _u in scans if sc.frames or sc.sealed),
                      default=Pos(0, 0))

    hole_epoch: dict[tuple[int, int], Pos] = {}

    def hole_between(a: Pos, b: Pos) -> bool:
        """A hole lies between ``a`` and ``b``, and ``b`` was written before that hole was known."""
        return any(a < Pos(h.segment, h.offset) < b < hole_epoch[(h.segment, h.offset)] for h in holes)

    # The envelopes of the segments read here, by runner: the runners go from one of theirs to the next over
    # these segments instead of walking and checking every frame again (RecoveredEnvelopes; issue 36.4).
    listed = (RecoveredEnvelopes(Pos(scans[0][0], 0), Pos(report.new_segment, SEGMENT_HEADER_BYTES))
              if scans and report.new_segment < KEYED_SEGMENTS_MAX else None)

    # Pass 2: classify damage, and fold the records.
    for _seg, scan, _unsealed in scans:
        res.segments += 1
        for p in scan.problems:
            if p.kind == "torn-tail" and not scan.sealed:
                res.repaired.append(p)
                logger.warning("torn_tail_repaired", segment=p.segment, offset=p.offset, bytes=p.end - p.offset, reason=p.reason)
                continue
            known = aside.get((p.segment, p.offset))
            if (known is not None and known.kind == "unsynced-hole") or (
                known is None and durable_known_for(Pos(p.segment, p.offset)) <= Pos(p.segment, p.offset) < last_record
            ):
                # Bytes after the last point known to be durable that never reached the disk, with later writes
                # that did (a disk writes back out of order): not damage; kept aside the same way, and reported
                # as what it is. Before that point the same bytes were fsync'd: corruption. (With no record
                # after it, it is no hole either: a torn end, or damage, reported as corruption.) The evidence
                # is the records' own claims, with or without a checkpoint, in sealed segments too: a SEAL that
                # survived a reordered cut does not make what the cut took durable.
                p = Problem("unsynced-hole", p.segment, p.offset, p.end, p.reason)
                res.holes.append(p)
                holes.append(p)
                # Records from the segment this start appends to (or the one of the start that found it)
                # on were written knowing of the hole: their conclusions stand on nothing in it.
                hole_epoch[(p.segment, p.offset)] = Pos(known.epoch_segment if known and known.epoch_segment
                                                        else report.new_segment, 0)
            else:
                res.corrupt.append(p)
            await move_aside(log, spool, p, logger, epoch_segment=report.new_segment)
        records = scan.records
        if _seg in reread:  # before the repair below, which may append a SEAL: the bytes pass 1 read
            buf = await asyncio.to_thread(log.read_segment, _seg)
            res.bytes += len(buf)
            records = (await asyncio.to_thread(scan_segment, _seg, buf, skip_data=True)).records
        if scan.header is not None and (scan.torn_tail is not None or not scan.sealed):
            await asyncio.to_thread(log.repair_segment, scan)
        for pos, rec in records:
            if listed is not None and isinstance(rec, EnvelopeRecord) and rec.runner != PARKED:
                listed.add(min(rec.runner, n - 1), pos)
            if pos < scan_from:
                continue
            res.records += 1
            if isinstance(rec, EnvelopeRecord) and rec.maildrop:
                res.maildrop.add(rec.maildrop)
            if isinstance(rec, EnvelopeRecord | FinishRecord):
                x = rec.replaces if isinstance(rec, EnvelopeRecord) else rec.start
                if x is not None and x in open_attempts and hole_between(x, pos):
                    # A conclusion written after a hole that lies within its attempt: the hole may have held
                    # what the conclusion stands on (the DATA copy of a replacement, the DSNs queued before
                    # it). Not a conclusion: the attempt stays open and is concluded again below from the
                    # original envelope and DATA, and what the block left (this replacement, its DSNs) ends.
                    qid = open_attempts[x].start.queue_id
                    for dpos, denv in dsns.get(qid, []):
                        if x < dpos < pos and dpos not in started:
                            dropped[dpos] = (denv, dpos >= replay_from, "dsn_dropped")
                    if isinstance(rec, EnvelopeRecord):
                        dropped[pos] = (rec, False, "replacement_dropped")
                    logger.warning("conclusion_distrusted", queue_id=qid, start=str(x), conclusion=str(pos),
                                   reason="an unsynced hole lies within the attempt; concluded again")
                    continue
            if (isinstance(rec, EnvelopeRecord) and rec.replaces is not None and rec.replaces >= scan_from
                    and rec.replaces not in starts_read and rec.replaces >= durable_known_for(rec.replaces)):
                # A replacement whose START was never read: lost in an unsynced hole (a power cut kept this
                # page and not the START's). Nothing it concludes happened as far as the log can show: the
                # envelope the START named is still live, so this one is ended (31.2: two live envelopes
                # would be delivered, or released, twice).
                dropped[pos] = (rec, False, "replacement_dropped")
                logger.warning("conclusion_distrusted", queue_id=rec.queue_id, start=str(rec.replaces),
                               conclusion=str(pos), reason="its START was lost before it reached the disk")
                continue
            if (isinstance(rec, EnvelopeRecord) and rec.bounce_of and rec.replaces is None
                    and rec.bounce_start is not None and rec.bounce_start >= scan_from
                    and rec.bounce_start not in starts_read and rec.bounce_start >= durable_known_for(rec.bounce_start)):
                # A DSN whose START (the attempt or the administrator's bounce that queued it) was lost: that
                # attempt never happened as far as the log can show, and the message is still live. Ended, or
                # the sender would be told of a failure while the message is delivered.
                dropped[pos] = (rec, False, "dsn_dropped")
                logger.warning("conclusion_distrusted", queue_id=rec.bounce_of, start=str(rec.bounce_start),
                               conclusion=str(pos), reason="the START of the attempt that queued this DSN was lost")
                continue
            if pos >= replay_from:
                queue.counts.replay(rec, lambda p: _read_envelope(log, p))
            if isinstance(rec, StartRecord):
                starts_read.add(pos)
                open_attempts[pos] = _Open(rec)
                started.add(rec.envelope)
                dropped.pop(rec.envelope, None)
                k = min(rec.runner, n - 1)
                if k >= 0 and rec.envelope >= runners[k]:
                    garbage[k].add(rec.envelope)
                if pos >= replay_from:
                    unparked.add(rec.envelope)
                    parked_after.pop(rec.envelope, None)
            elif isinstance(rec, DeliveryRecord):
                o = open_attempts.get(rec.start)
                if o is not None:
                    o.outcomes.update((x.index, x) for x in rec.outcomes)
                    o.remote_dsn = o.remote_dsn or rec.remote_dsn
            elif isinstance(rec, EnvelopeRecord):
                if rec.replaces is not None:
                    open_attempts.pop(rec.replaces, None)
                    replacements.setdefault(rec.replaces, []).append(pos)
                if pos >= replay_from and rec.runner == PARKED:
                    parked_after[pos] = rec
                if far_data(pos, rec):
                    pins[pos] = rec.data  # its DATA was not copied forward: kept until it is concluded again
                if rec.bounce_of and rec.replaces is None:
                    dsns.setdefault(rec.bounce_of, []).append((pos, rec))
                d = rec.data
                if any(h.segment == d.segment and h.offset <= d.offset < h.end for h in holes):
                    unreadable[pos] = rec
            elif isinstance(rec, FinishRecord):
                open_attempts.pop(rec.start, None)
        await asyncio.sleep(0)  # let SMTP clients in between segments
    for ppos in parked_before:
        if ppos not in unparked and ppos < replay_from:
            try:
                penv = log.read(ppos)
            except (CorruptRecord, OSError) as exc:
                logger.error("parked_unreadable", envelope=str(ppos), error=str(exc),
                             action="not offered; the damage is in SPOOL/corrupt once a reader passes it")
                continue
            if isinstance(penv, EnvelopeRecord) and penv.runner == PARKED:
                queue.parked.add(ppos, penv)
    for ppos, penv in parked_after.items():
        if ppos not in dropped:
            queue.parked.add(ppos, penv)
    queue.data_pins.update((e, d) for e, d in pins.items() if e not in started)
    for pos, env in unreadable.items():
        if pos in started or pos in dropped:
            continue
        if env.generation == 0 and not env.bounce_of:
            # Its DATA lies after the last point known durable and did not survive. Most likely no fsync
            # covered it and the client never had its 250; but a flipped bit in fsync'd DATA that no later
            # record vouches for looks the same. When in doubt, never end it silently: it stays queued and
            # the delivery worker bounces it (554 5.3.0) with a DSN to the sender (31.3).
            logger.warning("data_unreadable", queue_id=env.queue_id, envelope=str(pos), data=str(env.data),
                           action="bounced with a DSN when offered; it may never have been acknowledged")
        elif env.bounce_of or (env.replaces is not None and (
                env.replaces in open_attempts
                or any(r != pos and r not in unreadable for r in replacements.get(env.replaces, [])))):
            # A DSN or a replacement whose DATA never reached the disk: the attempt that wrote it is concluded
            # again (above: a hole lies within it), or an earlier start already did so, which queues its
            # content anew.
            dropped[pos] = (env, pos >= replay_from, "dsn_dropped" if env.bounce_of else "replacement_dropped")
    killpoints.hit("recovery.before_conclude")
    for start_pos, o in sorted(open_attempts.items()):
        read: Any
        try:
            read = log.read(o.start.envelope)
        except (CorruptRecord, OSError) as exc:
            read = exc
        if not isinstance(read, EnvelopeRecord):
            # Nothing to conclude from: the envelope the START names cannot be read. End the attempt, so that
            # it does not hold the working suffix forever, and say which message it was.
            log.append(FinishRecord(queue_id=o.start.queue_id, start=start_pos, ts=queue.clock()))
            logger.error("corrupt_envelope", queue_id=o.start.queue_id, start=str(start_pos),
                         error=str(read) if isinstance(read, Exception) else "not an envelope",
                         action="attempt ended; the message cannot be read (see SPOOL/corrupt)")
            continue
        env = read
        attempt = Attempt(env, o.start.envelope, start_pos, dict(o.outcomes), o.remote_dsn)
        # The DSNs this attempt already queued before the crash (31.4): they are written after its START, in
        # the order of its DSN groups. Those up to the first unreadable one count as queued; that one and
        # any after it are ended and queued again.
        mine = sorted(d for d in dsns.get(env.queue_id, [])
                      if (d[1].bounce_start == start_pos if d[1].bounce_start is not None else d[0] > start_pos))
        for i, (dpos, _denv) in enumerate(mine):
            if dpos in dropped or dpos in unreadable:
                for dpos2, denv2 in mine[i:]:
                    if dpos2 not in started:
                        dropped[dpos2] = (denv2, dpos2 >= replay_from, "dsn_dropped")
                break
            attempt.dsns_queued += 1
        queue.working.attempts[start_pos] = attempt
        if o.start.admin:
            # An administrator's action interrupted between its START and its conclusion: finish it.
            try:
                rec, _pos, _lsn = queue.finish_admin(attempt, o.start.admin)
            except CorruptRecord as exc:
                # Its DATA cannot be copied forward: bounce the message, as a delivery worker does (31.6).
                logger.error("corrupt_message", queue_id=env.queue_id, error=str(exc), action="bounced",
                             admin=o.start.admin)
                _bounce_unreadable(attempt, exc)
                queue.conclude(attempt, b"")
                res.concluded += 1
                continue
            except ValueError as exc:
                queue.working.concluded(start_pos)
                logger.error("admin_action_lost", queue_id=env.queue_id, action=o.start.admin, error=str(exc))
                continue
            res.concluded += 1
            logger.info("admin_action_completed", queue_id=env.queue_id, action=o.start.admin)
            continue
        for r in env.recipients:
            if r.index not in attempt.outcomes:
                res.unknown.append((env.queue_id, r.address))
                logger.warning("outcome_unknown", queue_id=env.queue_id, recipient=r.address, action="retry")
        try:
            c, _ = queue.conclude(attempt)
        except CorruptRecord as exc:
            # The DATA to copy forward does not check out: bounce what is left, as a delivery worker does
            # (554 5.3.0, a DSN without the content), instead of leaving the message neither live nor ended.
            logger.error("corrupt_message", queue_id=env.queue_id, error=str(exc), action="bounced")
            _bounce_unreadable(attempt, exc)
            c, _ = queue.conclude(attempt, b"")
        res.concluded += 1
        if isinstance(c.record, EnvelopeRecord):
            logger.info("attempt_concluded", queue_id=env.queue_id, recipients_left=len(c.record.recipients))
        else:
            logger.info("removed", queue_id=env.queue_id)
    # What the attempts concluded again replaces must be durable before it is ended: under out-of-order
    # write-back a crash could otherwise keep the ending and lose the new conclusion.
    await log.sync()
    for pos, (env, counted, why) in sorted(dropped.items()):
        _end_envelope(queue, pos, env, counted=counted)
        k = min(env.runner, n - 1)
        if k >= 0 and pos >= runners[k]:
            garbage[k].add(pos)
        reason = "written after an unsynced hole within its attempt, or its START was lost; not a conclusion"
        logger.warning(why, queue_id=env.queue_id, envelope=str(pos), reason=reason)
    await log.sync()
    res.runners, res.garbage = runners, garbage
    log.recovered = listed
    res.seconds = time.monotonic() - t0
    return res
