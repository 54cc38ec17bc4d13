"""Media damage for the harnesses: bit flips and zeroed sectors in sealed segments and the checkpoint.

A disk (or its controller, or a stray write) can damage bytes that were durable long ago: a flipped bit in a
record's length field, in its payload or in a segment header, a 512-byte sector read back as zeros, a
damaged checkpoint. None of that may cost an acknowledged message silently: what the damage hit is reported
(``corrupt_record``, by segment and offset, and by queue ID where the record can still be named) and moved
aside, a message whose data is lost is bounced, and every record outside the damaged bytes is still read.

:func:`damage` applies one such fault to a spool whose daemon is not running and says what it hit, so that
a harness can excuse exactly the messages in the damaged bytes, and only if the damage was reported.
Used by ``bench/crash.py --media-damage`` and by the tests; nothing here runs in the daemon.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from mtaq.core.frame import FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES, scan_segment
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import list_segments, segment_path

__all__ = ["KINDS", "SECTOR_BYTES", "Damage", "damage", "flip_bit"]

SECTOR_BYTES = 512
KINDS = ("length-bit", "payload-bit", "sector", "header-bit", "checkpoint-bit")


@dataclass
class Damage:
    """What one fault hit: ``kind``, the file, the byte range ``[start, end)`` in it, the segment number (0
    for the checkpoint) and the queue IDs of every record that overlaps the range."""

    kind: str
    path: str
    segment: int
    start: int
    end: int
    queue_ids: set[str] = field(default_factory=set)


def flip_bit(path: str, offset: int, bit: int) -> None:
    """Flip bit ``bit`` (0-7) of the byte at ``offset`` of the file ``path`` in place (media damage)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def damage(spool: str, rng: random.Random, *, kinds: tuple[str, ...] = KINDS) -> Damage | None:
    """Apply one fault of a kind drawn from ``kinds`` to the spool's log (segments other than the newest,
    which a crash may still be writing) or checkpoint. Returns what it hit, or None when there is nothing
    to damage (fewer than two segments, no records)."""
    log_dir = os.path.join(spool, "log")
    segs = list_segments(OsFileSystem(), log_dir)[:-1]
    kind = rng.choice(kinds)
    if kind == "checkpoint-bit":
        path = os.path.join(spool, "checkpoint")
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            return None
        at = rng.randrange(os.path.getsize(path))
        flip_bit(path, at, rng.randrange(8))
        return Damage(kind, path, 0, at, at + 1)
    if not segs:
        return None
    seg = rng.choice(segs)
    path = segment_path(log_dir, seg)
    with open(path, "rb") as f:
        buf = f.read()
    scan = scan_segment(seg, buf)
    frames = [(p.offset, r) for p, r in scan.records]
    if not frames:
        return None
    ends = [o for o, _ in frames[1:]] + [scan.valid_end]
    if kind == "header-bit":
        at = rng.randrange(SEGMENT_HEADER_BYTES)
        start, end = at, at + 1
    elif kind == "sector":
        start = rng.randrange(SEGMENT_HEADER_BYTES, max(SEGMENT_HEADER_BYTES + 1, len(buf))) // SECTOR_BYTES * SECTOR_BYTES
        end = min(len(buf), start + SECTOR_BYTES)
    else:
        i = rng.randrange(len(frames))
        off, frame_end = frames[i][0], ends[i]
        if kind == "length-bit":
            start = off + 4 + rng.randrange(4)
        else:
            start = rng.randrange(off + FRAME_HEADER_BYTES, max(off + FRAME_HEADER_BYTES + 1, frame_end))
        end = start + 1
    if start >= len(buf):
        return None
    if kind == "sector":
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(bytes(end - start))
    else:
        flip_bit(path, start, rng.randrange(8))
    hit = Damage(kind, path, seg, start, end)
    for (off, rec), rec_end in zip(frames, ends, strict=True):
        qid = getattr(rec, "queue_id", None)
        touches = off < end and start < rec_end
        if kind == "header-bit" or touches:
            # A damaged header costs the whole segment if no record vouches for its salt.
            if qid:
                hit.queue_ids.add(qid)
    return hit
