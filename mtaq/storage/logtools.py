"""``mtaq log dump`` and ``mtaq log verify``: read-only views of the queue log.

``verify`` checks every frame checksum, every segment header and seal, and every link (an envelope's data
reference names a DATA record of the same queue ID; a START names an envelope; a DELIVERY or FINISH names a
START; a replacement envelope names the START it replaces). Links into segments already reclaimed are not
problems. A torn tail at the end of the newest segment (or of an unsealed one) is what a crash leaves; it is
reported as a note, since recovery truncates it and nothing acknowledged was in it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import IO, Any

import msgspec

from mtaq.core.records import (
    RECORD_TYPE_OF,
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Pos,
    Record,
    SealRecord,
    StartRecord,
)
from mtaq.storage.fs import FileSystem, OsFileSystem
from mtaq.storage.log import list_segments, scan_log
from mtaq.storage.quarantine import CORRUPT_DIR, list_quarantine

__all__ = ["dump", "record_fields", "verify"]


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_fields(rec: Record) -> dict[str, Any]:
    """A record as plain JSON-able data (DATA bodies shown by size only)."""
    d = msgspec.to_builtins(msgspec.structs.asdict(rec))
    if isinstance(rec, DataRecord):
        d.pop("body")
        d["size"] = len(rec.body)
    return {"type": RECORD_TYPE_OF[type(rec)].name, **d}


def _line(pos: Pos, rec: Record) -> str:
    t = RECORD_TYPE_OF[type(rec)].name
    if isinstance(rec, DataRecord):
        return f"{pos} {t} {rec.queue_id} size={len(rec.body)}"
    if isinstance(rec, EnvelopeRecord):
        rcpts = ",".join(f"<{r.address}>{'?' if r.unknown else ''}" for r in rec.recipients)
        rep = f" replaces={rec.replaces}" if rec.replaces else ""
        return (
            f"{pos} {t} {rec.queue_id} gen={rec.generation} from=<{rec.sender}> to={rcpts} data={rec.data} "
            f"size={rec.size} attempts={rec.attempts} due={_ts(rec.not_before_ts)}{rep}"
        )
    if isinstance(rec, StartRecord):
        return f"{pos} {t} {rec.queue_id} envelope={rec.envelope} at={_ts(rec.ts)}"
    if isinstance(rec, DeliveryRecord):
        outs = " ".join(f"[{o.index}]{o.status}:{o.code} {o.enhanced}" for o in rec.outcomes)
        return f"{pos} {t} {rec.queue_id} start={rec.start} relay={rec.relay} {outs}"
    if isinstance(rec, FinishRecord):
        return f"{pos} {t} {rec.queue_id} start={rec.start} at={_ts(rec.ts)}"
    assert isinstance(rec, SealRecord)
    return f"{pos} {t} segment={rec.segment} records={rec.records}"


def dump(log_dir: str, *, as_json: bool, out: IO[str], shard: int | None = None) -> int:
    """Print one line per record (and one per problem); exit status 0.

    ``shard`` (a sharded spool, mtaq.daemon.workers): a ``# shard k: DIR`` line first, and a ``shard`` field in JSON.
    """
    extra = {} if shard is None else {"shard": shard}
    if shard is not None and not as_json:
        out.write(f"# shard {shard}: {log_dir}\n")
    for scan in scan_log(OsFileSystem(), log_dir):
        for pos, rec in scan.records:
            if as_json:
                out.write(json.dumps({**extra, "pos": str(pos), **record_fields(rec)}) + "\n")
            else:
                out.write(_line(pos, rec) + "\n")
        for p in scan.problems:
            out.write((json.dumps({"problem": str(p)}) if as_json else f"# {p}") + "\n")
    return 0


def verify(log_dir: str, *, out: IO[str], fs: FileSystem | None = None) -> int:
    """Check the whole log; print the problems (first one first) and return 0 when sound, 1 otherwise.
    ``fs``: the file system holding it (the real one when None; tests pass a crash file system)."""
    fs = fs or OsFileSystem()
    present = list_segments(fs, log_dir)
    newest = present[-1] if present else None
    first = present[0] if present else 0
    problems: list[str] = []
    notes: list[str] = []
    kinds: dict[Pos, tuple[type, str]] = {}
    records = 0
    spool = os.path.dirname(os.path.abspath(log_dir))
    aside = list_quarantine(fs, spool)

    def check(pos: Pos, ref: Pos, want: type, qid: str, what: str) -> None:
        if ref.segment < first:
            return  # reclaimed
        got = kinds.get(ref)
        if got is None and any(q.kind == "unsynced-hole" and q.segment == ref.segment and q.offset <= ref.offset < q.end
                               for q in aside.values()):
            notes.append(f"segment {pos.segment} offset {pos.offset}: {qid} {what} {ref} lies in a hole left by a crash "
                         "(recovery ends it, or bounces it with a DSN when it is a new message)")
            return
        if got is None or got[0] is not want or got[1] != qid:
            problems.append(f"segment {pos.segment} offset {pos.offset}: {qid} {what} {ref} is not a {want.__name__[:-6].upper()} of {qid}")

    for scan in scan_log(fs, log_dir):
        for p in scan.problems:
            q = aside.get((p.segment, p.offset))
            where = f" (moved aside to {os.path.join(spool, CORRUPT_DIR)}/{p.segment:012d}-{p.offset:010d}.bin)" if q else ""
            if p.kind == "torn-tail" and (scan.segment == newest or not scan.sealed) and p.reason != "bytes after seal":
                notes.append(f"{p}: crash leftover, recovery truncates it")
            elif q is not None and q.kind == "unsynced-hole":
                notes.append(f"{p}: hole left by a crash in bytes never made durable, records after it kept{where}")
            else:
                problems.append(f"{p}{where}")
        frames = 0
        for pos, rec in scan.records:
            records += 1
            if isinstance(rec, SealRecord):
                holed = any(q.kind == "unsynced-hole" and q.segment == scan.segment for q in aside.values())
                if rec.segment != scan.segment or rec.records < frames or (rec.records > frames and not holed):
                    problems.append(f"segment {pos.segment} offset {pos.offset}: seal says {rec.records} records, found {frames}")
                elif rec.records > frames:
                    notes.append(f"segment {pos.segment} offset {pos.offset}: seal says {rec.records} records, found "
                                 f"{frames}: the rest were in the segment's unsynced hole(s)")
                continue
            frames += 1
            kinds[pos] = (type(rec), rec.queue_id)
            if isinstance(rec, EnvelopeRecord):
                check(pos, rec.data, DataRecord, rec.queue_id, "data reference")
                if rec.replaces is not None:
                    check(pos, rec.replaces, StartRecord, rec.queue_id, "replaces")
            elif isinstance(rec, StartRecord):
                check(pos, rec.envelope, EnvelopeRecord, rec.queue_id, "envelope")
            elif isinstance(rec, (DeliveryRecord, FinishRecord)):
                check(pos, rec.start, StartRecord, rec.queue_id, "start")
    for n in notes:
        out.write(f"note: {n}\n")
    if problems:
        for line in problems:
            out.write(f"problem: {line}\n")
        out.write(f"log {log_dir}: {len(problems)} problem(s); first: {problems[0]}\n")
        return 1
    out.write(f"log {log_dir}: sound ({len(present)} segments, {records} records)\n")
    return 0
