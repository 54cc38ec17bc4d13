"""The ``corrupt`` area: damaged log records moved aside for the administrator (Postfix's ``corrupt`` queue).

A frame that does not check out in the middle of a segment (a flipped bit, a hole) is never silently passed
over. Its bytes, from where the damage starts to where good data resumes, are copied once into
``SPOOL/corrupt/`` as two files named after its place in the log::

    SEGMENT-OFFSET.bin    the damaged bytes, exactly as found
    SEGMENT-OFFSET.json   {"segment", "offset", "end", "bytes", "kind", "reason", "found_utc", "epoch_segment"}

The segment itself is left as it is (the log is append-only; rewriting it in place could damage its good
neighbours on a torn write) and readers go on passing over the damaged region to the next good frame; the
copy is what ``mtaq log verify`` and the administrator look at. Each copy is written to a temporary name,
fsync'd and renamed, then the directory is fsync'd, so a crash leaves either no copy or a whole one; the
JSON file is written last and marks the copy as complete.

``kind`` is ``"corrupt"`` (damage to data that had been made durable) or ``"unsynced-hole"`` (a region of
a segment that was being written at a crash, after the last checkpoint's durable end: bytes that never
reached the disk, with records written after them that did; not damage, but kept the same way).
"""

from __future__ import annotations

import datetime as dt
import os

import msgspec

from mtaq.core.frame import Problem
from mtaq.storage.fs import FileSystem, replace_file

__all__ = ["CORRUPT_DIR", "QuarantineEntry", "list_quarantine", "quarantine"]

CORRUPT_DIR = "corrupt"


class QuarantineEntry(msgspec.Struct, kw_only=True):
    """One moved-aside region: segment number, byte offsets ``[offset, end)`` in it, kind, reason."""

    segment: int
    offset: int
    end: int
    bytes: int
    kind: str
    reason: str
    found_utc: str
    # The segment the start that found it began appending to: records from there on were written after
    # the damage was known (recovery trusts conclusions written then; older segments decode as 0).
    epoch_segment: int = 0


def _stem(segment: int, offset: int) -> str:
    return f"{segment:012d}-{offset:010d}"


def quarantine(
    fs: FileSystem, spool: str, problem: Problem, raw: bytes, *, now: float | None = None, epoch_segment: int = 0
) -> tuple[str, bool]:
    """Copy the damaged bytes ``raw`` of ``problem`` into ``SPOOL/corrupt``; idempotent.

    Returns ``(path of the .bin copy, True if written now / False if it was there already)``. Raises
    OSError when the disk refuses (the caller reports the problem without the copy).
    """
    d = os.path.join(spool, CORRUPT_DIR)
    stem = os.path.join(d, _stem(problem.segment, problem.offset))
    if fs.exists(stem + ".json"):
        return stem + ".bin", False
    if not fs.exists(d):
        fs.makedirs(d)
        fs.fsync_dir(spool)
    replace_file(fs, stem + ".bin", raw, sync_dir=False)  # the directory is fsync'd once, below
    when = dt.datetime.fromtimestamp(now if now is not None else dt.datetime.now(dt.UTC).timestamp(), dt.UTC)
    entry = QuarantineEntry(
        segment=problem.segment,
        offset=problem.offset,
        end=problem.end,
        bytes=len(raw),
        kind=problem.kind,
        reason=problem.reason,
        found_utc=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        epoch_segment=epoch_segment,
    )
    replace_file(fs, stem + ".json", msgspec.json.encode(entry), sync_dir=False)
    fs.fsync_dir(d)
    return stem + ".bin", True


def list_quarantine(fs: FileSystem, spool: str) -> dict[tuple[int, int], QuarantineEntry]:
    """Every complete copy in ``SPOOL/corrupt``, keyed by ``(segment, offset)``; unreadable entries skipped."""
    d = os.path.join(spool, CORRUPT_DIR)
    out: dict[tuple[int, int], QuarantineEntry] = {}
    if not fs.exists(d):
        return out
    for name in sorted(fs.listdir(d)):
        if not name.endswith(".json"):
            continue
        try:
            e = msgspec.json.decode(fs.read_file(os.path.join(d, name)), type=QuarantineEntry)
        except (OSError, msgspec.DecodeError):
            continue
        out[(e.segment, e.offset)] = e
    return out

