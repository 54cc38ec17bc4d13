"""Reading the log forward from a position, across segments: what the queue runners use (seed 001).

A cursor reads frame headers only, and reads and checks (CRC) the payload of the frames it is asked for,
so a runner that scans for envelopes does not decode message bodies. It reads the segment in chunks
(``CHUNK_BYTES``) and parses headers from memory: appends never change bytes already written, so a chunk
never goes stale. It never reads past ``end``, which the caller sets to the log's durable end: a runner
never acts on a record that is not durable. A record one cursor decoded (and checked) is kept for a while
in ``Log.decoded`` for the others (one runner per retry interval reads every envelope): segments are
append-only and their numbers never reused, so the bytes at a position never change while it is read.
Over the stretch of the log this process appended, :meth:`LogCursor.peek_envelope` does not read the frames
in between at all: the log lists where it appended each envelope (``Log.next_envelope``).

A frame that does not check out in the middle of a segment is reported once through ``on_corrupt`` and
passed over to the next good frame (found by :func:`scan_segment`); it is never silently skipped. That holds
for the frames a cursor steps over too: it moves past a frame only after the frame's checksum, which covers
its length field, confirmed that length (a flipped bit in the length of a DATA frame would otherwise send
the cursor past the end of the file or into a body, skipping envelopes unreported). Frames confirmed by
one cursor are remembered a while in ``Log.confirmed`` for the others. A damaged segment header is reported
too, once (salvaged: its records are still read; beyond salvage: the whole segment is one problem).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from mtaq.core.errors import CorruptRecord, StorageError
from mtaq.core.frame import (
    FRAME_HEADER_BYTES,
    RECORD_BYTES_MAX,
    SEGMENT_HEADER_BYTES,
    Frame,
    Problem,
    decode_frame,
    scan_segment,
)
from mtaq.core.records import PayloadError, Pos, Record, RecordType, decode_payload
from mtaq.storage.log import Log

__all__ = ["CHUNK_BYTES", "CONFIRMED_MAX", "DECODED_MAX", "LogCursor"]

CHUNK_BYTES = 256 * 1024
DECODED_MAX = 4096  # records decoded by one cursor and kept (Log.decoded) for the others
CONFIRMED_MAX = 65536  # frame positions checksummed by one cursor and kept (Log.confirmed) for the others


def _is_envelope(rtype: int) -> bool:
    return rtype == RecordType.ENVELOPE


class LogCursor:
    """A position in the log that moves forward. ``pos`` is the next frame not yet passed over."""

    def __init__(self, log: Log, pos: Pos, on_corrupt: Callable[[Problem], None] | None = None) -> None:
        self.log = log
        self.pos = pos
        self.on_corrupt = on_corrupt or (lambda problem: None)
        self._reports = on_corrupt is not None  # takes (and so reports) the log's damaged segment headers
        self._seg = -1  # the chunk: bytes [_start, _start + len(_buf)) of segment _seg
        self._start = 0
        self._buf = b""

    def _bytes(self, pos: Pos, n: int) -> bytes | None:
        """``n`` bytes at ``pos`` from the chunk (refilled as needed); None if the segment has fewer."""
        off = pos.offset - self._start
        if pos.segment != self._seg or off < 0 or off + n > len(self._buf):
            f, _salt = self.log._file(pos.segment)
            if self._reports and self.log.header_problems:
                damaged = self.log.header_problems.pop(pos.segment, None)
                if damaged is not None:  # a salvaged header: its records are read, the damage is reported
                    self.on_corrupt(damaged)
            self._buf = f.pread(pos.offset, max(n, CHUNK_BYTES))
            self._seg, self._start, off = pos.segment, pos.offset, 0
            if len(self._buf) < n:
                return None
        return self._buf[off : off + n]

    def _header(self, pos: Pos) -> tuple[int, int] | None:
        head = self._bytes(pos, FRAME_HEADER_BYTES)
        if head is None or head[:2] != b"MQ":
            return None
        return head[2], int.from_bytes(head[4:8], "little")

    def _record(self, pos: Pos, length: int) -> Record:
        shared = self.log.decoded  # the runners' cursors read the same envelopes: decode and check each once
        rec = shared.get(pos)
        if rec is not None:
            return rec
        rec = self._decode(pos, length)
        if len(shared) >= DECODED_MAX:
            shared.popitem(last=False)  # the oldest, O(1) (Log.confirmed)
        shared[pos] = rec
        return rec

    def _decode(self, pos: Pos, length: int) -> Record:
        raw = self._bytes(pos, FRAME_HEADER_BYTES + length)
        _f, salt = self.log._file(pos.segment)
        res = decode_frame(raw or b"", 0, salt)
        if not isinstance(res, Frame):
            raise CorruptRecord(f"segment {pos.segment} offset {pos.offset}: {getattr(res, 'reason', 'cut off')}")
        try:
            return decode_payload(res.rtype, res.payload)
        except PayloadError as exc:
            raise CorruptRecord(f"segment {pos.segment} offset {pos.offset}: {exc}") from exc

    def _confirmed(self, pos: Pos, length: int) -> bool:
        """True when the frame at ``pos`` with header length ``length`` checks out (checksum over its header,
        length included, and its payload), so that ``pos + 12 + length`` is really the next frame."""
        shared = self.log.confirmed
        if pos in shared:
            return True
        raw = self._bytes(pos, FRAME_HEADER_BYTES + length) if length <= RECORD_BYTES_MAX else None
        if raw is None:
            return False
        _f, salt = self.log._file(pos.segment)
        if not isinstance(decode_frame(raw, 0, salt), Frame):
            return False
        if len(shared) >= CONFIRMED_MAX:
            shared.popitem(last=False)  # the oldest, O(1) (Log.confirmed)
        shared[pos] = None
        return True

    def _next_segment(self) -> bool:
        later = [n for n in self.log.segments() if n > self.pos.segment]
        if not later:
            return False
        self.pos = Pos(later[0], SEGMENT_HEADER_BYTES)
        return True

    def _resync(self, why: str) -> None:
        seg = self.pos.segment
        scan = scan_segment(seg, self.log.read_segment(seg), skip_data=True)
        later = [p for p, _ in scan.records if p.offset > self.pos.offset]
        # The scan's own problem says where the damage ends (DATA frames are not listed in its records).
        at = self.pos.offset
        found = next((p for p in scan.problems if p.offset <= at < p.end), None)
        self.on_corrupt(found or Problem("corrupt", seg, at, later[0].offset if later else at + 1, why))
        if later:
            self.pos = later[0]
        elif not self._next_segment():
            self.pos = Pos(seg, self.pos.offset + 1)

    def peek(
        self, end: Pos, want: Callable[[int], bool], *, max_frames: int | None = None
    ) -> tuple[Pos, Record] | Literal[False] | None:
        """See :meth:`_peek`; an I/O error other than a missing (reclaimed) segment raises StorageError
        (EMFILE, EIO: it can pass), and the cursor stays where it was."""
        try:
            return self._peek(end, want, max_frames=max_frames)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StorageError(f"reading the log at {self.pos}: {exc.strerror or exc}") from exc

    def _peek(
        self, end: Pos, want: Callable[[int], bool], *, max_frames: int | None = None
    ) -> tuple[Pos, Record] | Literal[False] | None:
        """The next record whose type ``want`` accepts, before ``end``; the cursor stops *at* it.

        Frames of other types are passed over (their payloads are not read). Returns None when ``end`` is
        reached, and False after passing over ``max_frames`` frames (call again to go on). Call
        :meth:`skip` to move past the returned record.
        """
        budget = max_frames
        while self.pos < end:
            if budget is not None:
                if budget <= 0:
                    return False
                budget -= 1
            seg = self.pos.segment
            try:
                hdr = self._header(self.pos)
            except FileNotFoundError:  # the segment file is gone (reclaimed)
                if not self._next_segment():
                    return None
                continue
            except CorruptRecord as exc:  # a header beyond salvage: the whole segment is one problem, reported
                if self._reports and seg not in self.log.unreadable_reported:
                    self.log.unreadable_reported.add(seg)
                    try:
                        size = len(self.log.read_segment(seg))
                    except OSError:
                        size = SEGMENT_HEADER_BYTES
                    self.on_corrupt(Problem("corrupt", seg, 0, max(size, 1), str(exc)))
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
                # Checked before it is trusted: a type byte flipped to SEAL would otherwise end the segment
                # here and pass over every frame after it unreported (found by review, stop 47).
                if not self._confirmed(self.pos, length):
                    self._resync("frame does not check out (a SEAL cannot be trusted)")
                    continue
                if not self._next_segment():
                    return None
                continue
            if want(rtype):
                try:
                    return self.pos, self._record(self.pos, length)
                except CorruptRecord as exc:
                    self._resync(str(exc))
                    continue
            if not self._confirmed(self.pos, length):
                self._resync("frame does not check out (its length cannot be trusted)")
                continue
            self.pos = Pos(seg, self.pos.offset + FRAME_HEADER_BYTES + length)
        return None

    def peek_envelope(
        self, end: Pos, *, max_frames: int | None = None, runner: int | None = None
    ) -> tuple[Pos, Record] | Literal[False] | None:
        """:meth:`peek` for ENVELOPE records only (the queue runners), with the same results and errors.

        Where the log lists the envelopes it appended itself (:meth:`Log.next_envelope`), the cursor goes
        straight to the next one (or to ``end``) without reading the frames in between, once some cursor
        has walked them frame by frame and checked each (``Log.checked_end``: so every frame this process
        appended is checksummed once, by the first cursor to pass, and damage is reported as :meth:`peek`
        reports it); it reads and checks the envelope it stops at as :meth:`peek` does.

        With ``runner`` k, in the segments of earlier runs that recovery read and checked frame by frame
        (``Log.recovered``, :class:`mtaq.storage.log.RecoveredEnvelopes`), the cursor goes straight to the
        next envelope *of runner k* (the others' envelopes are not returned there; elsewhere they are, and the
        caller passes over them as before). Elsewhere (segments of an earlier run not read so) it reads frame
        by frame.
        """
        log = self.log
        listed = log.recovered if runner is not None else None
        if listed is not None and listed.floor <= self.pos < listed.end:
            assert runner is not None
            stop = end if end < listed.end else listed.end
            at = listed.next(runner, self.pos, stop)
            if at is not None:
                self.pos = at
                # one frame (checked, decoded); without a budget, on past it should it not check out now
                return self.peek(end, _is_envelope, max_frames=1 if max_frames is not None else None)
            self.pos = stop
            if stop == end:
                return None
        nxt = log.next_envelope(self.pos, end)
        if nxt is False:
            return self.peek(end, _is_envelope, max_frames=max_frames)
        checked = log.checked_end
        if checked is not None and checked < (end if nxt is None else nxt):
            # not yet checked past ``checked``: walk from there (no envelope lies before ``nxt``)
            if self.pos < checked:
                self.pos = checked
            extends = self.pos == checked
            found = self.peek(end, _is_envelope, max_frames=max_frames)
            if extends and log.checked_end is not None and self.pos > log.checked_end:
                log.checked_end = self.pos
            return self._checked_through(found)
        if nxt is None:
            if self.pos < end:
                self.pos = end
            return None
        self.pos = nxt
        return self._checked_through(self.peek(end, _is_envelope, max_frames=1))

    def _checked_through(
        self, found: tuple[Pos, Record] | Literal[False] | None
    ) -> tuple[Pos, Record] | Literal[False] | None:
        """An envelope read (and so checked) right at ``Log.checked_end`` moves that mark past its frame."""
        log = self.log
        if found and found[0] == log.checked_end:
            hdr = self._header(found[0])
            if hdr is not None:
                log.checked_end = Pos(found[0].segment, found[0].offset + FRAME_HEADER_BYTES + hdr[1])
        return found

    def skip(self) -> None:
        """Move past the frame at the cursor."""
        hdr = self._header(self.pos)
        if hdr is None:
            raise CorruptRecord(f"no frame at {self.pos}")
        self.pos = Pos(self.pos.segment, self.pos.offset + FRAME_HEADER_BYTES + hdr[1])
