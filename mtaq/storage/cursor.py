"""Reading the log forward from a position, across segments: what the queue runners use (seed 001).

A cursor reads frame headers only, and reads and checks (CRC) the payload of the frames it is asked for,
so a runner that scans for envelopes does not read message bodies. It never reads past ``end``, which
the caller sets to the log's durable end: a runner never acts on a record that is not durable.

A frame that does not check out in the middle of a segment is reported once through ``on_corrupt`` and
passed over to the next good frame (found by :func:`scan_segment`); it is never silently skipped.
"""

from __future__ import annotations

from collections.abc import Callable

from mtaq.core.frame import FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES, scan_segment
from mtaq.core.records import Pos, Record, RecordType
from mtaq.errors import CorruptRecord
from mtaq.storage.log import Log

__all__ = ["LogCursor"]


class LogCursor:
    """A position in the log that moves forward. ``pos`` is the next frame not yet passed over."""

    def __init__(self, log: Log, pos: Pos, on_corrupt: Callable[[str], None] | None = None) -> None:
        self.log = log
        self.pos = pos
        self.on_corrupt = on_corrupt or (lambda msg: None)

    def _next_segment(self) -> bool:
        later = [n for n in self.log.segments() if n > self.pos.segment]
        if not later:
            return False
        self.pos = Pos(later[0], SEGMENT_HEADER_BYTES)
        return True

    def _resync(self, why: str) -> None:
        seg = self.pos.segment
        self.on_corrupt(f"segment {seg} offset {self.pos.offset}: {why}")
        scan = scan_segment(seg, self.log.read_segment(seg), skip_data=True)
        later = [p for p, _ in scan.records if p.offset > self.pos.offset]
        if later:
            self.pos = later[0]
        elif not self._next_segment():
            self.pos = Pos(seg, self.pos.offset + 1)

    def peek(self, end: Pos, want: Callable[[int], bool]) -> tuple[Pos, Record] | None:
        """The next record whose type ``want`` accepts, before ``end``; the cursor stops *at* it.

        Frames of other types are passed over (their payloads are not read). Returns None when ``end`` is
        reached. Call :meth:`skip` to move past the returned record.
        """
        while self.pos < end:
            seg = self.pos.segment
            try:
                hdr = self.log.frame_header(self.pos)
            except CorruptRecord:  # the segment file is gone (reclaimed) or has no valid header
                if not self._next_segment():
                    return None
                continue
            if hdr is None:
                if seg < end.segment:
                    if self.pos.offset < self.log.segment_size(seg):
                        self._resync("bad frame header")
                    elif not self._next_segment():
                        return None
                    continue
                return None
            rtype, length = hdr
            if rtype == RecordType.SEAL:
                if not self._next_segment():
                    return None
                continue
            if want(rtype):
                try:
                    return self.pos, self.log.read(self.pos)
                except CorruptRecord as exc:
                    self._resync(str(exc))
                    continue
            self.pos = Pos(seg, self.pos.offset + FRAME_HEADER_BYTES + length)
        return None

    def skip(self) -> None:
        """Move past the frame at the cursor."""
        hdr = self.log.frame_header(self.pos)
        if hdr is None:
            raise CorruptRecord(f"no frame at {self.pos}")
        self.pos = Pos(self.pos.segment, self.pos.offset + FRAME_HEADER_BYTES + hdr[1])
