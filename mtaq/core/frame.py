"""Framing, segment headers and the tail rules of the queue log (pure: no I/O).

Layout (docs/log_format.md has the grammar and a worked example)::

    segment  := header frame*
    header   := "MTAQSEG\\0" version:u16 reserved:u16 segment:u64 salt:u32 created:u32 hcrc:u32   (32 bytes, LE)
    frame    := magic:u16 type:u8 flags:u8 length:u32 crc:u32 payload[length]               (12 + length bytes)

``crc`` is CRC-32 (zlib) of the first 8 header bytes and the payload, seeded with the segment's random
``salt`` (SQLite WAL's idea): bytes left over from an older file, or a frame embedded in a message body,
cannot pass as a record of this segment.

What must always hold (the tail rules):

* a frame that does not check out and after which no good frame follows in the segment is a *torn tail*:
  the end of the log if the segment is the newest or unsealed; the reader truncates it;
* a bad frame followed by a good one is *corruption*: reported with its segment and offset, never silently
  passed over, and every good record after it is kept;
* a SEAL record ends a segment; anything after a seal is corruption.

Every decoder has three outcomes (h11 ``_readers.py``): a frame and where the next one starts, "need
more" (the buffer ends inside the frame), or a corruption error.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from mtaq.core.records import (
    PayloadError,
    Pos,
    Record,
    RecordType,
    decode_payload,
    encode_payload,
)

__all__ = [
    "FRAME_HEADER_BYTES",
    "FRAME_MAGIC",
    "RECORD_BYTES_MAX",
    "SEGMENT_FLAG_START",
    "SEGMENT_HEADER_BYTES",
    "SEGMENT_MAGIC",
    "SEGMENT_VERSION",
    "BadFrame",
    "Frame",
    "HeaderError",
    "NeedMore",
    "Problem",
    "SegmentHeader",
    "SegmentScan",
    "decode_frame",
    "decode_segment_header",
    "encode_frame",
    "encode_record",
    "encode_segment_header",
    "frame_crc",
    "frame_head",
    "salvage_segment_header",
    "scan_frames",
    "scan_segment",
]

SEGMENT_MAGIC = b"MTAQSEG\x00"
SEGMENT_VERSION = 1
_SEG_HDR = struct.Struct("<8sHHQII")  # magic, version, flags, segment, salt, created (UTC seconds)
# Segment header flags (the u16 after the version; 0 in segments written before they existed).
SEGMENT_FLAG_START = 1  # opened by a start (Log.open): the segment before it ended a run
SEGMENT_HEADER_BYTES = _SEG_HDR.size + 4  # + header crc
FRAME_MAGIC = 0x514D  # b"MQ" little-endian
_FRAME_MAGIC_BYTES = struct.pack("<H", FRAME_MAGIC)
_FRAME_HDR = struct.Struct("<HBBII")  # magic, type, flags, length, crc
FRAME_HEADER_BYTES = _FRAME_HDR.size  # 12
RECORD_BYTES_MAX = 256 * 1024 * 1024  # a payload larger than this is never written, so never a valid frame
_VALID_TYPES = frozenset(int(t) for t in RecordType)


class HeaderError(ValueError):
    """A segment header that is short, has the wrong magic or version, or fails its checksum."""


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """A segment's header: its number, its checksum salt, its creation time (UTC seconds) and its flags
    (:data:`SEGMENT_FLAG_START`; 0 when unknown, as in a salvaged header)."""

    segment: int
    salt: int
    created: int
    version: int = SEGMENT_VERSION
    flags: int = 0


def encode_segment_header(h: SegmentHeader) -> bytes:
    """Return the 32-byte header of segment ``h.segment``."""
    body = _SEG_HDR.pack(SEGMENT_MAGIC, h.version, h.flags, h.segment, h.salt, h.created)
    return body + struct.pack("<I", zlib.crc32(body))


def decode_segment_header(buf: bytes | memoryview) -> SegmentHeader:
    """Decode the header at the start of ``buf``; raises :class:`HeaderError` naming what is wrong."""
    if len(buf) < SEGMENT_HEADER_BYTES:
        raise HeaderError(f"segment header short: {len(buf)} of {SEGMENT_HEADER_BYTES} bytes")
    body = bytes(buf[: _SEG_HDR.size])
    (crc,) = struct.unpack_from("<I", buf, _SEG_HDR.size)
    magic, version, flags, segment, salt, created = _SEG_HDR.unpack(body)
    if magic != SEGMENT_MAGIC:
        raise HeaderError(f"bad segment magic {magic!r}")
    if zlib.crc32(body) != crc:
        raise HeaderError("segment header checksum mismatch")
    if version != SEGMENT_VERSION:
        raise HeaderError(f"unsupported segment format version {version}")
    return SegmentHeader(segment=segment, salt=salt, created=created, version=version, flags=flags)


def _solve_crc_seed(data: bytes | memoryview, crc: int) -> int | None:
    """The seed ``s`` with ``zlib.crc32(data, s) == crc``, or None.

    CRC-32 is affine over GF(2) in its seed: ``crc32(data, s) = M·s XOR crc32(data, 0)``, with M invertible
    (the register shift of a polynomial with an x^0 term). M's columns are measured with the 32 one-bit
    seeds and the system is solved by Gaussian elimination.
    """
    base = zlib.crc32(data, 0)
    pivots: dict[int, tuple[int, int]] = {}  # highest bit -> (combination of columns, which seed bits)
    for i in range(32):
        v, m = zlib.crc32(data, 1 << i) ^ base, 1 << i
        while v:
            top = v.bit_length() - 1
            if top not in pivots:
                pivots[top] = (v, m)
                break
            pv, pm = pivots[top]
            v, m = v ^ pv, m ^ pm
    t, seed = crc ^ base, 0
    while t:
        top = t.bit_length() - 1
        if top not in pivots:
            return None
        pv, pm = pivots[top]
        t, seed = t ^ pv, seed ^ pm
    return seed


SALVAGE_CANDIDATES_MAX = 64  # frame-magic positions tried when a segment header is damaged


def salvage_segment_header(segment: int, buf: bytes | memoryview) -> SegmentHeader | None:
    """Rebuild the header of segment ``segment`` whose own header is damaged, from its records.

    A frame's checksum is CRC-32 seeded with the segment's salt, so one good frame gives the salt back
    (:func:`_solve_crc_seed`). A candidate (the first frame after the header, then the next places the
    frame magic appears) is accepted only when its payload decodes as a record and, when another frame
    follows it, that frame checks out with the same salt. Returns a header with ``created = 0`` (unknown),
    or None when no record vouches for a salt (then the whole segment is unreadable).
    """
    mv = memoryview(buf)
    raw = bytes(buf)
    off, tried = SEGMENT_HEADER_BYTES, 0
    while 0 <= off and tried < SALVAGE_CANDIDATES_MAX:
        tried += 1
        if off + FRAME_HEADER_BYTES <= len(mv):
            magic, rtype, _flags, length, crc = _FRAME_HDR.unpack_from(mv, off)
            end = off + FRAME_HEADER_BYTES + length
            if magic == FRAME_MAGIC and rtype in _VALID_TYPES and end <= len(mv):
                salt = _solve_crc_seed(bytes(mv[off : off + 8]) + bytes(mv[off + FRAME_HEADER_BYTES : end]), crc)
                if salt is not None and isinstance(res := decode_frame(mv, off, salt), Frame):
                    try:
                        decode_payload(res.rtype, res.payload)
                    except PayloadError:
                        pass
                    else:
                        if res.end >= len(mv) or isinstance(decode_frame(mv, res.end, salt), Frame):
                            return SegmentHeader(segment=segment, salt=salt, created=0)
        off = raw.find(_FRAME_MAGIC_BYTES, off + 1)
    return None


def encode_frame(rtype: int, payload: bytes, salt: int) -> bytes:
    """Frame ``payload`` as a record of type ``rtype`` for a segment with checksum seed ``salt``."""
    if len(payload) > RECORD_BYTES_MAX:
        raise ValueError(f"record payload {len(payload)} bytes exceeds {RECORD_BYTES_MAX}")
    head = struct.pack("<HBBI", FRAME_MAGIC, rtype, 0, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head, salt))
    return head + struct.pack("<I", crc) + payload


def frame_head(rtype: int, length: int) -> bytes:
    """The first 8 bytes of a frame header (magic, type, flags, payload length); the CRC follows them."""
    if length > RECORD_BYTES_MAX:
        raise ValueError(f"record payload {length} bytes exceeds {RECORD_BYTES_MAX}")
    return struct.pack("<HBBI", FRAME_MAGIC, rtype, 0, length)


def frame_crc(head: bytes, pieces: Iterable[bytes | memoryview], salt: int) -> int:
    """The frame checksum of a payload given in ``pieces`` (the same value :func:`encode_frame` writes)."""
    crc = zlib.crc32(head, salt)
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


def encode_record(record: Record, salt: int) -> bytes:
    """Encode and frame ``record`` (one msgpack encode, one CRC pass)."""
    rtype, payload = encode_payload(record)
    return encode_frame(int(rtype), payload, salt)


@dataclass(frozen=True, slots=True)
class Frame:
    """A good frame: its type, its payload (a view into the buffer) and the offset just past it."""

    rtype: int
    payload: memoryview
    end: int


@dataclass(frozen=True, slots=True)
class NeedMore:
    """The buffer ends inside this frame; ``needed`` is the total number of bytes the frame would take."""

    needed: int


@dataclass(frozen=True, slots=True)
class BadFrame:
    """The bytes at this offset are not a good frame; ``reason`` says why (magic, type, length, crc)."""

    reason: str


def decode_frame(buf: bytes | memoryview, offset: int, salt: int) -> Frame | NeedMore | BadFrame:
    """Decode the frame starting at ``offset`` of ``buf`` (bytes belonging to a segment with ``salt``)."""
    mv = memoryview(buf)
    avail = len(mv) - offset
    if avail < FRAME_HEADER_BYTES:
        # A partial header is "need more" only if what is there could begin a frame.
        if avail >= 2 and bytes(mv[offset : offset + 2]) != _FRAME_MAGIC_BYTES:
            return BadFrame("bad frame magic")
        if avail >= 3 and mv[offset + 2] not in _VALID_TYPES:
            return BadFrame(f"unknown record type {mv[offset + 2]}")
        return NeedMore(FRAME_HEADER_BYTES)
    magic, rtype, flags, length, crc = _FRAME_HDR.unpack_from(mv, offset)
    if magic != FRAME_MAGIC:
        return BadFrame("bad frame magic")
    if rtype not in _VALID_TYPES:
        return BadFrame(f"unknown record type {rtype}")
    if flags != 0:
        return BadFrame(f"unknown frame flags {flags:#x}")
    if length > RECORD_BYTES_MAX:
        return BadFrame(f"frame length {length} exceeds maximum")
    end = offset + FRAME_HEADER_BYTES + length
    if end > len(mv):
        return NeedMore(FRAME_HEADER_BYTES + length)
    payload = mv[offset + FRAME_HEADER_BYTES : end]
    if zlib.crc32(payload, zlib.crc32(mv[offset : offset + 8], salt)) != crc:
        return BadFrame("checksum mismatch")
    return Frame(rtype=rtype, payload=payload, end=end)


@dataclass(frozen=True, slots=True)
class Problem:
    """Something wrong found while reading a segment.

    ``kind`` is ``"torn-tail"`` (a cut-off or garbled end; repaired by truncation), ``"corrupt"`` (damage
    followed by good data; ``end`` is where good data resumes) or ``"after-seal"``. Offsets are bytes from
    the start of the segment file.
    """

    kind: str
    segment: int
    offset: int
    end: int
    reason: str

    def __str__(self) -> str:
        return f"segment {self.segment} offset {self.offset}: {self.kind} ({self.reason}), {self.end - self.offset} bytes"


@dataclass(slots=True)
class SegmentScan:
    """The result of reading one segment: good records in order, where good data ends, and problems."""

    segment: int
    header: SegmentHeader | None
    records: list[tuple[Pos, Record]] = field(default_factory=list)
    valid_end: int = 0  # offset just past the last good frame (where appends may continue)
    frames: int = 0  # good frames before any seal, DATA included even when skipped
    sealed: bool = False
    problems: list[Problem] = field(default_factory=list)

    @property
    def torn_tail(self) -> Problem | None:
        """The torn-tail problem, if the segment ends in one."""
        for p in self.problems:
            if p.kind == "torn-tail":
                return p
        return None

    @property
    def corruption(self) -> list[Problem]:
        """Problems that are not a repairable torn tail."""
        return [p for p in self.problems if p.kind != "torn-tail"]


def _resync(raw: bytes, start: int, salt: int) -> int | None:
    """Offset of the next good frame at or after ``start``, or None. Candidates are found by the magic."""
    pos = start
    while True:
        pos = raw.find(_FRAME_MAGIC_BYTES, pos)
        if pos < 0:
            return None
        if isinstance(decode_frame(raw, pos, salt), Frame):
            return pos
        pos += 1


def scan_segment(segment: int, buf: bytes, *, decode: bool = True, skip_data: bool = False) -> SegmentScan:
    """Read every record of the segment file contents ``buf`` (header included), applying the tail rules.

    With ``decode=False`` only the framing is checked and ``records`` stays empty (cheap verification);
    with ``skip_data=True`` DATA frames are checksummed but neither decoded nor listed (recovery).
    A header that does not decode: a short or zero-filled one with no good frame after it is a torn tail (a
    crash right after the file was created; ``header`` is None). Any other damage, a zero-filled header
    with good frames after it included, is a ``corrupt`` problem over the header's bytes;
    the salt is then recovered from the records (:func:`salvage_segment_header`) and every good record is
    read as usual. Only when no record vouches for a salt is the whole segment one problem (``header`` None).
    """
    scan = SegmentScan(segment=segment, header=None)
    try:
        header = decode_segment_header(buf)
    except HeaderError as exc:
        # A short or zero-filled header: the file's first write never reached the disk (torn).
        torn = len(buf) < SEGMENT_HEADER_BYTES or not any(buf[:SEGMENT_HEADER_BYTES])
        # A zero-filled header with good frames after it is no torn file: the header's page was lost (or
        # zeroed) while later ones survived. Its records are kept like those behind any damaged header.
        later = len(buf) > SEGMENT_HEADER_BYTES and any(buf[SEGMENT_HEADER_BYTES:])
        salvaged = salvage_segment_header(segment, buf) if later else None
        if salvaged is None:
            scan.problems.append(Problem("torn-tail" if torn else "corrupt", segment, 0, len(buf), str(exc)))
            return scan
        scan.problems.append(Problem("corrupt", segment, 0, SEGMENT_HEADER_BYTES,
                                     f"{exc}; checksum salt recovered from the records, which are kept"))
        header = salvaged
    if header.segment != segment:
        scan.problems.append(Problem("corrupt", segment, 0, len(buf), f"header names segment {header.segment}"))
        return scan
    scan.header = header
    scan.valid_end = SEGMENT_HEADER_BYTES
    _scan_frames(scan, buf, SEGMENT_HEADER_BYTES, 0, header.salt, decode=decode, skip_data=skip_data)
    return scan


def scan_frames(segment: int, buf: bytes, base: int, salt: int, *, skip_data: bool = False) -> SegmentScan:
    """Read the frames of ``buf``, the bytes of segment ``segment`` from offset ``base`` (a frame boundary,
    past the header) to some end, with the segment's checksum ``salt``: :func:`scan_segment` without the
    header, for a reader that goes on from where it stopped (``mtaq.admin.service``: a view caught up
    incrementally). The same tail rules; positions and problem offsets are offsets in the segment file.
    ``header`` is None in the result."""
    scan = SegmentScan(segment=segment, header=None, valid_end=base)
    _scan_frames(scan, buf, 0, base, salt, decode=True, skip_data=skip_data)
    return scan


def _scan_frames(scan: SegmentScan, buf: bytes, off: int, base: int, salt: int, *, decode: bool,
                 skip_data: bool) -> None:
    """The frame loop of :func:`scan_segment` from ``off`` in ``buf``, whose byte 0 is offset ``base`` of the
    segment file. A frame that checks out is taken in line (one header unpack, one CRC pass); anything else
    goes through :func:`decode_frame`, which names what is wrong, so the outcome is decode_frame's."""
    segment = scan.segment
    mv = memoryview(buf)
    n = len(buf)
    unpack = _FRAME_HDR.unpack_from
    crc32 = zlib.crc32
    valid = _VALID_TYPES
    data_t, seal_t = int(RecordType.DATA), int(RecordType.SEAL)
    records = scan.records
    while off < n:
        if scan.sealed:
            nxt = _resync(buf, off, salt)
            if nxt is None:
                scan.problems.append(Problem("torn-tail", segment, base + off, base + n, "bytes after seal"))
                break
            scan.problems.append(Problem("after-seal", segment, base + off, base + nxt, "records after seal"))
            scan.sealed = False
            off = nxt
            continue
        end = -1
        if off + FRAME_HEADER_BYTES <= n:
            magic, rtype, flags, length, crc = unpack(mv, off)
            end = off + FRAME_HEADER_BYTES + length
            if not (magic == FRAME_MAGIC and flags == 0 and rtype in valid and length <= RECORD_BYTES_MAX
                    and end <= n and crc32(mv[off + FRAME_HEADER_BYTES : end], crc32(mv[off : off + 8], salt)) == crc):
                end = -1
        if end >= 0:
            if rtype != seal_t:
                scan.frames += 1
            if (decode and not (skip_data and rtype == data_t)) or rtype == seal_t:
                try:
                    rec = decode_payload(rtype, mv[off + FRAME_HEADER_BYTES : end])
                except PayloadError as exc:
                    scan.problems.append(Problem("corrupt", segment, base + off, base + end, str(exc)))
                    off = end
                    scan.valid_end = base + off
                    continue
                if decode:
                    records.append((Pos(segment, base + off), rec))
                if rtype == seal_t:
                    scan.sealed = True
            off = end
            scan.valid_end = base + off
            continue
        res = decode_frame(mv, off, salt)  # not a good frame (the same checks): why not
        reason = "cut off" if isinstance(res, NeedMore) else getattr(res, "reason", "bad frame")
        nxt = _resync(buf, off + 1, salt)
        if nxt is None:
            scan.problems.append(Problem("torn-tail", segment, base + off, base + n, reason))
            break
        scan.problems.append(Problem("corrupt", segment, base + off, base + nxt, reason))
        off = nxt
