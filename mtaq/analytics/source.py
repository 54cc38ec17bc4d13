"""Segment files as Arrow record batches: discovery, partition planning and decoding (no Spark needed here).

This is the reading half of the Spark data source (:mod:`mtaq.analytics.datasource`) and of the plain
single-process scan (:mod:`mtaq.analytics.plain`). It reads segments with the daemon's own codec
(:func:`mtaq.core.frame.scan_segment`, which applies the tail rules of docs/log_format.md): there is no
second parser. Files are reached through ``pyarrow.fs``, so a path may be local, ``s3://bucket/prefix``
(S3-compatible stores: ``?endpoint_override=host:port&scheme=http``) or ``hdfs://namenode/path``.

What a path may name (:func:`discover`):

* a spool directory (it has ``log/``): the segments in ``SPOOL/log/``, the live one included (read up to
  its last whole record);
* an archive directory (or any other directory): every ``*.seg`` and ``*.seg.zst`` below it;
* one segment file, or a glob of them (``/archive/0000000001*.seg.zst``).

The same segment reached twice (in the spool and in the archive after a crash between archiving and
unlinking, or through two overlapping paths) is read once: copies are recognised by segment number and
checksum salt.

What must always hold: damage never fails a read and is never hidden. Every problem the tail rules find,
and every file that cannot be read or decompressed, becomes a ``PROBLEM`` row naming the file, the byte
offset and the reason; every good record after the damage is still yielded.

Rows (:data:`SCHEMA`, times are UTC instants, sizes bytes): one per recipient of an ENVELOPE, one per START,
one per recipient outcome of a DELIVERY, one per FINISH, one per PROBLEM, and one SEGMENT row per file
read. DATA frames are checksummed but not decoded (the bodies are not needed); SEAL frames are counted in
the SEGMENT row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import gc
import os
import re
import struct
import types
import typing
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union
from urllib.parse import urlsplit, urlunsplit

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from mtaq.analytics import columnar
from mtaq.analytics.columnar import columns_of_rows, decode_columns, struct_fields
from mtaq.core.frame import (
    FRAME_HEADER_BYTES,
    FRAME_MAGIC,
    RECORD_BYTES_MAX,
    SEGMENT_HEADER_BYTES,
    HeaderError,
    Problem,
    SegmentHeader,
    decode_segment_header,
    scan_segment,
)
from mtaq.core.records import (
    RECORD_TYPE_OF,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    RecordType,
    StartRecord,
)
from mtaq.core.shard import shard_of

_cseg = columnar._cseg  # the C module (None where not built): its frame walk is used here, see _walk_c

__all__ = [
    "SCHEMA",
    "SPARK_DDL",
    "SegmentFile",
    "SourceError",
    "batches",
    "discover",
    "plan_partitions",
    "typed_batches",
]

SEGMENT_FILE = re.compile(r"^(?P<segment>\d{12})(?:-(?P<salt>[0-9a-f]{8}))?\.seg(?P<zst>\.zst)?$")
_GLOB = re.compile(r"[*?\[]")
BATCH_ROWS_MAX = 65536
_TS = pa.timestamp("us", tz="UTC")

# (column, Arrow type, Spark SQL type, meaning). The README's "Analytics" section prints this table.
COLUMNS: list[tuple[str, pa.DataType, str, str]] = [
    ("file", pa.string(), "string", "path or URI of the segment file"),
    ("segment", pa.int64(), "bigint", "segment number"),
    ("offset", pa.int64(), "bigint", "byte offset of the record's frame in the segment"),
    ("record_type", pa.string(), "string", "ENVELOPE, START, DELIVERY, FINISH, PROBLEM or SEGMENT"),
    ("queue_id", pa.string(), "string", "the message's queue ID"),
    ("ts", _TS, "timestamp", "when the logged event happened (UTC): arrival for a first envelope, "
     "else the record's own time; null for a replacement envelope; segment creation for SEGMENT"),
    ("arrival_ts", _TS, "timestamp", "ENVELOPE: when the message was received (UTC)"),
    ("not_before_ts", _TS, "timestamp", "ENVELOPE: when the next attempt is due (UTC)"),
    ("generation", pa.int32(), "int", "ENVELOPE: 0 at receipt, +1 per replacement"),
    ("attempts", pa.int32(), "int", "ENVELOPE: delivery attempts already made"),
    ("runner", pa.int32(), "int", "ENVELOPE/START: queue runner (0 new mail, k the k-th retry interval)"),
    ("sender", pa.string(), "string", "ENVELOPE: envelope sender ('' is the null sender <>)"),
    ("sender_domain", pa.string(), "string", "ENVELOPE: sender's domain, lower case"),
    ("size", pa.int64(), "bigint", "ENVELOPE: message size in bytes; SEGMENT: file size in bytes, uncompressed"),
    ("client", pa.string(), "string", "ENVELOPE: SMTP client address"),
    ("helo", pa.string(), "string", "ENVELOPE: the client's HELO/EHLO name"),
    ("bounce_of", pa.string(), "string", "ENVELOPE: queue ID of the message a DSN of ours is about ('' else)"),
    ("link_segment", pa.int64(), "bigint", "the record this one names: START->envelope, DELIVERY/FINISH->start, "
     "replacement ENVELOPE->start it concludes"),
    ("link_offset", pa.int64(), "bigint", "byte offset of that record"),
    ("rcpt_index", pa.int32(), "int", "ENVELOPE/DELIVERY: recipient number in the original envelope"),
    ("rcpt_address", pa.string(), "string", "ENVELOPE: recipient address"),
    ("rcpt_domain", pa.string(), "string", "ENVELOPE: recipient's domain, lower case"),
    ("rcpt_unknown", pa.bool_(), "boolean", "ENVELOPE: outcome of the last attempt unknown after a crash"),
    ("last_reply", pa.string(), "string", "ENVELOPE: reply of the recipient's last attempt"),
    ("status", pa.string(), "string", "DELIVERY: delivered (2xx), deferred (4xx / no reply) or failed (5xx)"),
    ("code", pa.int32(), "int", "DELIVERY: SMTP reply code"),
    ("enhanced", pa.string(), "string", "DELIVERY: enhanced status code (RFC 3463)"),
    ("text", pa.string(), "string", "DELIVERY: reply text"),
    ("relay", pa.string(), "string", "DELIVERY: next hop"),
    ("remote_dsn", pa.bool_(), "boolean", "DELIVERY: the next hop offered DSN"),
    ("records", pa.int64(), "bigint", "SEGMENT: good records in the file (DATA and SEAL included)"),
    ("sealed", pa.bool_(), "boolean", "SEGMENT: the segment ends with a SEAL record"),
    ("problem_kind", pa.string(), "string", "PROBLEM: corrupt, after-seal, torn-tail, open-tail or unreadable"),
    ("problem_end", pa.int64(), "bigint", "PROBLEM: offset where good data resumes (end of file if none)"),
    ("problem_reason", pa.string(), "string", "PROBLEM: what is wrong"),
]
SCHEMA = pa.schema([(n, t) for n, t, _, _ in COLUMNS])
SPARK_DDL = ", ".join(f"{n} {s}" for n, _, s, _ in COLUMNS)


class SourceError(ValueError):
    """A path that names nothing readable (no such file, no segments under a directory, bad URI)."""


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """One segment file to read: ``root`` resolves the file system (pyarrow), ``path`` is the file in it.

    ``segment`` comes from the name; ``size`` is the stored size in bytes; ``salt`` is the checksum salt
    when known (from the archive name or the header), used to read each segment once. ``start``: 0 (the
    whole file), or the byte offset of a frame where reading begins: the tail of a segment that grew since a
    run with ``--state`` read it cleanly up to there (:mod:`mtaq.analytics.state`); its records are read as
    if the segment's header were followed by the bytes from ``start`` on (the same tail rules, offsets as in
    the file), and its SEGMENT row says ``offset`` = ``start`` and the bytes and frames from there.
    """

    root: str
    path: str
    segment: int
    size: int
    compressed: bool
    salt: int | None = None
    start: int = 0
    mtime_ns: int | None = None  # the stored file's modification time as listed (ns since the epoch; None: unknown)

    @property
    def display(self) -> str:
        """The file as the user would name it."""
        if "://" in self.root:
            scheme = self.root.split("://", 1)[0]
            return f"{scheme}://{self.path}"
        return self.path


def resolve(path: str) -> tuple[pafs.FileSystem, str, str]:
    """(file system, path in it, root to re-resolve it on an executor). Local paths become absolute; Hadoop's
    names for S3 (``s3a://``, ``s3n://``, what Spark is given for ``--parquet-out``) are pyarrow's ``s3://``."""
    if "://" not in path:
        path = os.path.abspath(path)
    elif path.startswith(("s3a://", "s3n://")):
        path = "s3://" + path.split("://", 1)[1]
    try:
        fs, inner = pafs.FileSystem.from_uri(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise SourceError(f"{path}: {exc}") from exc
    return fs, inner, path


def join_path(base: str, name: str) -> str:
    """``name`` under the directory ``base``: a local path (made absolute, so that every process means the same
    file) or a URI, whose query string (``?endpoint_override=...``) stays at the end."""
    if "://" not in base:
        return os.path.join(os.path.abspath(base), name)
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))


def _segment_file(root: str, info: pafs.FileInfo) -> SegmentFile | None:
    m = SEGMENT_FILE.match(info.base_name)
    if m is None or info.type != pafs.FileType.File:
        return None
    salt = int(m.group("salt"), 16) if m.group("salt") else None
    return SegmentFile(root, info.path, int(m.group("segment")), int(info.size or 0), bool(m.group("zst")), salt,
                       mtime_ns=info.mtime_ns)


def _glob(fs: pafs.FileSystem, root: str, pattern: str) -> list[SegmentFile]:
    parts = pattern.split("/")
    i = next(k for k, p in enumerate(parts) if _GLOB.search(p))
    prefix = "/".join(parts[:i]) or "/"
    deep = "**" in pattern
    out = []
    for info in fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True)):
        p = info.path
        if fnmatch.fnmatchcase(p, pattern.replace("**", "*")) and (deep or p.count("/") == pattern.count("/")):
            sf = _segment_file(root, info)
            if sf is not None:
                out.append(sf)
    return out


def _read_salt(fs: pafs.FileSystem, sf: SegmentFile) -> int | None:
    try:
        with fs.open_input_stream(sf.path, compression=None) as f:
            head = f.read(SEGMENT_HEADER_BYTES)
        return decode_segment_header(head).salt
    except (OSError, HeaderError, pa.ArrowException):
        return None


def _shard_logs(fs: pafs.FileSystem, spool: str) -> list[str]:
    """The ``log`` directories of the worker shards k >= 1 of ``spool`` (``SPOOL/shard-k/log``,
    :mod:`mtaq.core.shard`): a spool written by several workers keeps shard 0 in ``SPOOL/log``."""
    out = []
    for info in fs.get_file_info(pafs.FileSelector(spool.rstrip("/"), allow_not_found=True)):
        if info.type == pafs.FileType.Directory and shard_of(info.base_name) is not None \
                and fs.get_file_info(f"{info.path}/log").type == pafs.FileType.Directory:
            out.append(f"{info.path}/log")
    return sorted(out)


def discover(paths: Sequence[str]) -> list[SegmentFile]:
    """The segment files named by ``paths`` (spool, archive, file or glob), each segment once, in order. A
    spool's segments are those of every worker shard (``SPOOL/log`` and ``SPOOL/shard-k/log``).

    Raises SourceError naming the path when it does not exist or holds no segment file.
    """
    found: list[SegmentFile] = []
    for raw in paths:
        fs, inner, root = resolve(raw)
        if _GLOB.search(inner):
            files = _glob(fs, root, inner)
        else:
            info = fs.get_file_info(inner)
            if info.type == pafs.FileType.NotFound:
                raise SourceError(f"{raw}: no such file or directory")
            if info.type == pafs.FileType.File:
                sf = _segment_file(root, info)
                if sf is None:
                    raise SourceError(f"{raw}: not a segment file (NNNNNNNNNNNN[-salt].seg[.zst])")
                files = [sf]
            else:
                log_dir = inner.rstrip("/") + "/log"
                is_spool = fs.get_file_info(log_dir).type == pafs.FileType.Directory
                dirs = [log_dir, *_shard_logs(fs, inner)] if is_spool else [inner]
                files = [sf for d in dirs for sf in map(lambda i: _segment_file(root, i),
                                                        fs.get_file_info(pafs.FileSelector(d, recursive=not is_spool)))
                         if sf is not None]
        if not files:
            raise SourceError(f"{raw}: no segment files (*.seg, *.seg.zst) found")
        for sf in files:
            if sf.salt is None:
                sf = dataclasses.replace(sf, salt=_read_salt(fs, sf))
            found.append(sf)
    seen: set[tuple[int, int]] = set()
    out = []
    for sf in sorted(found, key=lambda f: (f.segment, f.compressed, f.path)):
        if sf.salt is not None:
            if (sf.segment, sf.salt) in seen:
                continue
            seen.add((sf.segment, sf.salt))
        out.append(sf)
    return out


def plan_partitions(files: Sequence[SegmentFile], partition_bytes: int) -> list[list[SegmentFile]]:
    """Pack whole segments, in order, into groups of at most ``partition_bytes`` stored bytes (a bigger
    segment is a group of its own). A segment is never split here: its tail rules need all of it (the tail of
    a segment read before is a file of its own: ``SegmentFile.start``)."""
    groups: list[list[SegmentFile]] = []
    cur: list[SegmentFile] = []
    cur_bytes = 0
    for sf in files:
        size = sf.size - sf.start if not sf.compressed else sf.size
        if cur and cur_bytes + size > partition_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(sf)
        cur_bytes += size
    if cur:
        groups.append(cur)
    return groups


def read_segment_bytes(sf: SegmentFile, fs: pafs.FileSystem | None = None) -> bytes:
    """The segment's bytes, decompressed if it is a ``.zst`` (here, not by pyarrow's by-extension guess); all
    of them, whatever ``sf.start`` says.

    Raises OSError, pyarrow or zstandard errors.
    """
    if fs is None:
        fs, _, _ = resolve(sf.root)
    with fs.open_input_stream(sf.path, compression=None) as f:
        raw = f.read()
    if not sf.compressed:
        return bytes(raw)
    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(raw) as r:
        return r.read()


def read_tail(sf: SegmentFile, fs: pafs.FileSystem | None = None) -> tuple[bytes, int]:
    """What :func:`batches` reads of ``sf``: (the segment's header followed by its bytes from ``sf.start`` on,
    the file's length in bytes, decompressed) when ``sf.start`` > 0, else (all of it, its length). An
    uncompressed file is read in two ranges, never whole. Raises what :func:`read_segment_bytes` raises, and
    ValueError when ``sf.start`` is past the end or inside the header."""
    if sf.start == 0:
        buf = read_segment_bytes(sf, fs)
        return buf, len(buf)
    if fs is None:
        fs, _, _ = resolve(sf.root)
    if sf.compressed:
        whole = read_segment_bytes(sf, fs)
        head, rest, length = whole[:SEGMENT_HEADER_BYTES], whole[sf.start:], len(whole)
    else:
        with fs.open_input_file(sf.path) as f:
            length = f.size()
            head = bytes(f.read_at(min(SEGMENT_HEADER_BYTES, length), 0))
            rest = bytes(f.read_at(max(length - sf.start, 0), sf.start)) if sf.start <= length else b""
    if not SEGMENT_HEADER_BYTES <= sf.start <= length:
        raise ValueError(f"start {sf.start} is not inside the frames of a segment of {length} bytes")
    return head + rest, length


# ------------------------------------------------------------------------------------------- decoding
#
# A segment is read in two steps. (1) The frames are walked (:func:`_walk`: in C, else with numpy): every
# frame's header and checksum are checked (DATA included: its payload is checksummed, then stepped over by its
# length, never decoded), and the offsets and payload ends of the other frames are kept, grouped by type.
# (2) Each group is decoded straight into columns, in C or by numpy (:mod:`mtaq.analytics.columnar`: no
# Python object per value), or, when a payload is outside that module's strict grammar, by msgspec (the payloads joined
# into one msgpack array, decoded as tuples) and transposed; then Arrow kernels make everything per row
# (timestamps, the explode of recipients and outcomes, constants, domains of ASCII addresses). Step (1) is
# the fast path of :func:`mtaq.core.frame.scan_segment` for a segment in which everything checks out (a
# good header, good frames to the end, at most a SEAL as the last frame): then it finds exactly what
# scan_segment finds and no problem. At anything else (a bad frame, a cut-off end, bytes after a seal, a bad
# header, a payload that does not decode) the segment is read again by scan_segment itself, whose tail rules
# decide; its records go through the same step (2). So there is one set of tail rules and one codec.

_HEAD = struct.Struct("<QI")  # a frame header: its first 8 bytes as one number, then the CRC
_MAGIC0, _MAGIC1 = FRAME_MAGIC & 0xFF, FRAME_MAGIC >> 8  # its first two bytes
_CHAIN_ROUNDS = 8  # rounds of dropping places no frame points to before the walk frame by frame decides
_DATA, _ENVELOPE, _START, _DELIVERY, _FINISH, _SEAL = (int(t) for t in (
    RecordType.DATA, RecordType.ENVELOPE, RecordType.START, RecordType.DELIVERY, RecordType.FINISH, RecordType.SEAL))
_VALID_TYPES = frozenset(int(t) for t in RecordType)
_TYPE_OK = np.isin(np.arange(256), sorted(_VALID_TYPES))  # type byte -> valid
_TYPE_OK_BYTES = _TYPE_OK.astype(np.uint8).tobytes()


def _row_type(tp: Any) -> Any:
    """The type of a record class's msgpack array as a plain tuple (msgspec validates it just as strictly):
    a struct becomes ``tuple[Literal[tag], field types...]`` (its tag first when it has one), nested structs
    and unions and tuples of them likewise. Derived from the classes, so it stays equal to them."""
    fields = struct_fields(tp)
    if fields is not None:
        elems = [_row_type(ftp) for _name, ftp in fields]
        tag = tp.__struct_config__.tag
        return tuple[(*([Literal[tag]] if tag is not None else []), *elems)]  # type: ignore[misc]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or origin is Literal:
        return tp
    if origin is Union or origin is types.UnionType:
        return Union[tuple(_row_type(a) for a in args)]  # noqa: UP007
    return origin[tuple(a if a is Ellipsis else _row_type(a) for a in args)]


def _as_row(value: Any) -> Any:
    """A decoded record (or any value in it) as :func:`_row_type` describes it: what the row decoders give."""
    if isinstance(value, msgspec.Struct):
        vals = tuple(map(_as_row, msgspec.structs.astuple(value)))
        tag = value.__struct_config__.tag
        return vals if tag is None else (tag, *vals)
    if isinstance(value, tuple):
        return tuple(map(_as_row, value))
    return value


_CLASSES: dict[int, type[msgspec.Struct]] = {
    _ENVELOPE: EnvelopeRecord, _START: StartRecord, _DELIVERY: DeliveryRecord, _FINISH: FinishRecord}
# When msgspec decodes (payloads outside the columnar grammar), it decodes plain tuples (the row type): as
# strict as the record class, and transposed by one zip, without an attribute read per field and record. A
# payload the row type refuses (an older, shorter array the class fills with defaults) is decoded into the
# class and converted.
_ROWS: dict[int, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(types.GenericAlias(list, (_row_type(c),))) for t, c in _CLASSES.items()}
_BULK: dict[int, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(types.GenericAlias(list, (c,))) for t, c in _CLASSES.items()}
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError)  # ValueError: msgspec lets UnicodeDecodeError through


Walk = tuple[dict[int, np.ndarray], dict[int, np.ndarray], int, bool]  # offsets by type, payload ends by type, good frames, sealed


def _checked_header(segment: int, buf: bytes) -> SegmentHeader | None:
    """The header of segment file ``buf`` when it decodes and names ``segment``, else None."""
    try:
        header = decode_segment_header(buf)
    except HeaderError:
        return None
    return header if header.segment == segment else None


def _walk(segment: int, buf: bytes) -> Walk | None:
    """Walk the frames of a clean segment: (frame offsets by type, payload ends by type, good frames, sealed),
    or None when anything does not check out (then :func:`scan_segment` must read it). A frame's payload is
    ``buf[offset + FRAME_HEADER_BYTES : end]``. :func:`_walk_c` where the C module is built, else
    :func:`_walk_numpy`; both find what :func:`_walk_loop`, the definition, finds."""
    return _walk_c(segment, buf) if _cseg is not None else _walk_numpy(segment, buf)


def _walk_c(segment: int, buf: bytes) -> Walk | None:
    """:func:`_walk_loop` in C (``mtaq/analytics/_segment.c``: the same checks frame by frame, 10 times faster than
    :func:`_walk_numpy` on a 64 MB segment). ``pip install`` builds the module where a C compiler and Python's
    headers are (the Makefile installs them); without it, and in a zip of the package shipped to a Spark
    cluster, :func:`_walk` uses numpy. Raises RuntimeError when the module is not built."""
    if _cseg is None:
        raise RuntimeError("mtaq.analytics._segment is not built")
    header = _checked_header(segment, buf)
    if header is None:
        return None
    got = _cseg.walk(buf, SEGMENT_HEADER_BYTES, header.salt, FRAME_MAGIC, _TYPE_OK_BYTES, _DATA, _SEAL,
                      RECORD_BYTES_MAX)
    if got is None:
        return None
    kinds, offs, ends_, frames, sealed = got
    rtype = np.frombuffer(kinds, np.uint8)
    at, end = np.frombuffer(offs, np.int64), np.frombuffer(ends_, np.int64)
    offsets: dict[int, np.ndarray] = {}
    ends: dict[int, np.ndarray] = {}
    for t in (_ENVELOPE, _START, _DELIVERY, _FINISH):
        keep = rtype == t
        offsets[t], ends[t] = at[keep], end[keep]
    return offsets, ends, frames, sealed


def _walk_numpy(segment: int, buf: bytes) -> Walk | None:
    """:func:`_walk` with numpy, where the C module is not built.

    Vectorised: every place where a frame header could start (its magic, a valid type, flags 0) is found with
    numpy, and each such place points to where the next frame would start. The frames are the chain of these
    from the first frame on, exactly as a walk frame by frame follows it: places no chain member points to
    are dropped (a magic inside a payload, or an embedded frame) until the chain runs from the first frame
    to the end of the file, one frame after the other; when it does not after a few rounds, the walk frame
    by frame (:func:`_walk_loop`) decides. Then every frame is checked as that walk checks it: the type and
    length in its header, SEAL only as the last frame, and its CRC (the CRC of its first 8 header bytes by
    tables, since it is affine in those bytes, then one zlib call over each frame's payload).
    Call it with the cyclic GC paused (:func:`_gc_paused`)."""
    header = _checked_header(segment, buf)
    if header is None:
        return None
    n, first = len(buf), SEGMENT_HEADER_BYTES
    if n - FRAME_HEADER_BYTES < first:
        return _walk_loop(segment, buf)  # no frame, or a cut-off one
    a = np.frombuffer(buf, np.uint8)
    cand = np.flatnonzero(a[first : n - FRAME_HEADER_BYTES + 1] == _MAGIC0) + first
    cand = cand[(a[cand + 1] == _MAGIC1) & (a[cand + 3] == 0) & _TYPE_OK[a[cand + 2]]]
    length = _le(a, cand + 4, 4)
    nxt = cand + FRAME_HEADER_BYTES + length
    for _ in range(_CHAIN_ROUNDS):
        if len(cand) and cand[0] == first and nxt[-1] == n and np.array_equal(nxt[:-1], cand[1:]):
            break
        j = np.searchsorted(cand, nxt)
        hit = j < len(cand)
        hit[hit] = cand[j[hit]] == nxt[hit]
        keep = np.zeros(len(cand), bool)
        keep[j[hit]] = True
        keep[cand == first] = True
        if keep.all():
            return _walk_loop(segment, buf)
        cand, nxt, length = cand[keep], nxt[keep], length[keep]
    else:
        return _walk_loop(segment, buf)
    if (length > RECORD_BYTES_MAX).any():
        return None
    rtype = a[cand + 2]
    seal = rtype == _SEAL
    sealed = bool(seal[-1])
    if seal[:-1].any():
        return None  # bytes after a seal
    seeds = _head_crcs(a, cand, header.salt)
    mv = memoryview(buf)
    got = np.fromiter(map(zlib.crc32, map(mv.__getitem__, map(slice, (cand + FRAME_HEADER_BYTES).tolist(), nxt.tolist())),
                          seeds.tolist()), np.int64, len(cand))
    if not np.array_equal(got, _le(a, cand + 8, 4)):
        return None
    offsets: dict[int, np.ndarray] = {}
    ends: dict[int, np.ndarray] = {}
    for t in (_ENVELOPE, _START, _DELIVERY, _FINISH):
        keep = rtype == t
        offsets[t], ends[t] = cand[keep], nxt[keep]
    return offsets, ends, len(cand) - sealed, sealed


def _le(a: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """Little-endian unsigned integers of ``width`` (4 or 8) bytes at ``pos``, as int64 (uint64 for 8)."""
    raw = a[pos[:, None] + np.arange(width)].view("<u4" if width == 4 else "<u8").reshape(-1)
    return raw.astype(np.int64) if width == 4 else raw


def _head_crcs(a: np.ndarray, frames: np.ndarray, salt: int) -> np.ndarray:
    """``zlib.crc32(first 8 header bytes, salt)`` of each frame: the CRC of 8 bytes is affine in them, so it is
    the CRC of 8 zero bytes XOR one table entry per byte (8 tables of 256, made here)."""
    zero = zlib.crc32(bytes(8), salt)
    out = np.full(len(frames), zero, np.int64)
    for k in range(8):
        table = np.array([zlib.crc32(bytes(k) + bytes((v,)) + bytes(7 - k), salt) ^ zero for v in range(256)], np.int64)
        out ^= table[a[frames + k]]
    return out


def _walk_loop(segment: int, buf: bytes) -> Walk | None:
    """:func:`_walk` frame by frame, in Python: the definition the C walk and the vectorised one follow, and what
    the vectorised walk uses for a segment whose chain of frames it could not tell (see there).

    Each distinct first 8 bytes of a frame header (magic, type, flags, length) is checked, and its part of
    the CRC computed, once per segment: a log has a few hundred of them (a type and a length), not one per
    frame. Call it with the cyclic GC paused (:func:`_gc_paused`): it makes a memoryview per record."""
    header = _checked_header(segment, buf)
    if header is None:
        return None
    salt, n, mv = header.salt, len(buf), memoryview(buf)
    unpack, crc32 = _HEAD.unpack_from, zlib.crc32
    heads: dict[int, tuple[int, int, int]] = {}  # first 8 header bytes -> (type, payload length, their CRC)
    types: list[int] = []
    offs: list[int] = []
    pays: list[memoryview] = []
    type_app, off_app, pay_app = types.append, offs.append, pays.append
    off, frames, sealed, last = SEGMENT_HEADER_BYTES, 0, False, n - FRAME_HEADER_BYTES
    while off < n:
        if off > last:
            return None  # a cut-off frame header
        head, crc = unpack(buf, off)
        known = heads.get(head)
        if known is None:
            rtype, length = (head >> 16) & 0xFF, head >> 32
            if head & 0xFFFF != FRAME_MAGIC or (head >> 24) & 0xFF or rtype not in _VALID_TYPES or length > RECORD_BYTES_MAX:
                return None
            known = heads[head] = (rtype, length, crc32(mv[off : off + 8], salt))
        rtype, length, head_crc = known
        start = off + FRAME_HEADER_BYTES
        end = start + length
        if end > n:
            return None
        payload = mv[start:end]
        if crc32(payload, head_crc) != crc:
            return None
        if rtype != _DATA:
            if rtype == _SEAL:
                if end != n:
                    return None  # bytes after a seal
                sealed = True
                break
            type_app(rtype)
            off_app(off)
            pay_app(payload)
        frames += 1
        off = end
    by_type = np.asarray(types, dtype=np.int64)
    all_offs = np.asarray(offs, dtype=np.int64)
    lengths = np.fromiter(map(len, pays), np.int64, len(pays))
    offsets: dict[int, np.ndarray] = {}
    ends: dict[int, np.ndarray] = {}
    for t in (_ENVELOPE, _START, _DELIVERY, _FINISH):
        keep = by_type == t
        offsets[t] = all_offs[keep]
        ends[t] = offsets[t] + FRAME_HEADER_BYTES + lengths[keep]
    return offsets, ends, frames, sealed


def _bulk_decode(rtype: int, payloads: Sequence[memoryview]) -> list[tuple[Any, ...]]:
    """Decode payloads of one record type with one msgspec call into rows (:func:`_row_type`). Raises
    msgspec errors or ValueError for a payload that does not decode as a record of that type."""
    if not payloads:
        return []
    blob = b"".join((b"\xdd", len(payloads).to_bytes(4, "big"), *payloads))  # msgpack array 32 of them
    try:
        return _ROWS[rtype].decode(blob)  # type: ignore[no-any-return]
    except _DECODE_ERRORS:
        return [_as_row(r) for r in _BULK[rtype].decode(blob)]


def _us(t: pa.Array) -> pa.Array:
    """UTC seconds (float64) -> timestamp[us, UTC], rounded half to even as Python's round()."""
    return pc.round(pc.multiply(t, 1_000_000.0), round_mode="half_to_even").cast(pa.int64()).cast(_TS)


def _domain(address: str) -> str:
    return address.rpartition("@")[2].lower() if "@" in address else ""


def _domains(addresses: pa.Array) -> pa.Array:
    """The lower-cased domain of each address ('' without an @), as :func:`_domain` gives it: by the C module
    (``domains``) or else Arrow kernels when every address is ASCII (then lowering A-Z is ``str.lower``; a
    null address gives ''), else by Python once per distinct address (a null address stays null). Decoded
    logs hold no null address."""
    if _cseg is not None and isinstance(addresses, pa.Array) and addresses.type == pa.string():
        flat = pc.fill_null(addresses, "") if addresses.null_count else addresses
        n = len(flat)
        bufs = flat.buffers()
        offs = np.frombuffer(bufs[1], np.int32, n + 1, offset=flat.offset * 4) if bufs[1] is not None else np.zeros(1, np.int32)
        got = _cseg.domains(offs, bufs[2] if bufs[2] is not None else b"")
        if got is not None:
            return pa.StringArray.from_buffers(n, pa.py_buffer(got[0]), pa.py_buffer(got[1]))
    elif pc.all(pc.string_is_ascii(addresses)).as_py() is not False:
        found = pc.struct_field(pc.extract_regex(addresses, r"(?s)@(?P<d>[^@]*)$"), [0])
        return pc.ascii_lower(pc.fill_null(found, ""))
    enc = pc.dictionary_encode(addresses)
    doms = pa.array([_domain(a) for a in enc.dictionary.to_pylist()], pa.string())
    return doms.take(enc.indices)


def _repeat_index(counts: Sequence[int]) -> pa.Array:
    """[0]*counts[0] + [1]*counts[1] + ...: the row of the parent record of each exploded row."""
    return pa.array(np.repeat(np.arange(len(counts), dtype=np.int64), np.asarray(counts, dtype=np.int64)))


def _table(n: int, cols: dict[str, pa.Array], file: str, segment: int, rtype: str) -> pa.RecordBatch:
    cols = {"file": pa.repeat(pa.scalar(file, pa.string()), n),
            "segment": pa.repeat(pa.scalar(segment, pa.int64()), n),
            "record_type": pa.repeat(pa.scalar(rtype, pa.string()), n), **cols}
    arrays = []
    for name, typ, _, _ in COLUMNS:
        v = cols.get(name)
        arrays.append(pa.nulls(n, typ) if v is None else v.cast(typ) if v.type != typ else v)
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


Columns = dict[str, Any]  # :mod:`mtaq.analytics.columnar`: field path -> numpy or Arrow array


def _arr(c: Columns, key: str, typ: pa.DataType) -> pa.Array:
    v = c[key]
    v = pa.array(v) if isinstance(v, np.ndarray) else v
    return v if v.type == typ else v.cast(typ)


def _envelope_batch(file: str, segment: int, offsets: np.ndarray, c: Columns) -> pa.RecordBatch:
    n = len(offsets)
    idx = _repeat_index(c["recipients"])
    gen = _arr(c, "generation", pa.int32())
    arrival = _us(_arr(c, "arrival_ts", pa.float64()))
    senders = _arr(c, "sender", pa.string())
    per_env = {
        "offset": pa.array(offsets, pa.int64()),
        "queue_id": _arr(c, "queue_id", pa.string()),
        "ts": pc.if_else(pc.equal(gen, 0), arrival, pa.nulls(n, _TS)),
        "arrival_ts": arrival,
        "not_before_ts": _us(_arr(c, "not_before_ts", pa.float64())),
        "generation": gen,
        "attempts": _arr(c, "attempts", pa.int32()),
        "runner": _arr(c, "runner", pa.int32()),
        "sender": senders,
        "sender_domain": _domains(senders),
        "size": _arr(c, "size", pa.int64()),
        "client": _arr(c, "client", pa.string()),
        "helo": _arr(c, "helo", pa.string()),
        "bounce_of": _arr(c, "bounce_of", pa.string()),
        "link_segment": _arr(c, "replaces.segment", pa.int64()),
        "link_offset": _arr(c, "replaces.offset", pa.int64()),
    }
    cols = {k: v.take(idx) for k, v in per_env.items()}
    addresses = _arr(c, "recipients.address", pa.string())
    cols |= {
        "rcpt_index": _arr(c, "recipients.index", pa.int32()),
        "rcpt_address": addresses,
        "rcpt_domain": _domains(addresses),
        "rcpt_unknown": _arr(c, "recipients.unknown", pa.bool_()),
        "last_reply": _arr(c, "recipients.last_reply", pa.string()),
    }
    return _table(len(addresses), cols, file, segment, "ENVELOPE")


def _start_batch(file: str, segment: int, offsets: np.ndarray, c: Columns) -> pa.RecordBatch:
    return _table(len(offsets), {
        "offset": pa.array(offsets, pa.int64()),
        "queue_id": _arr(c, "queue_id", pa.string()),
        "ts": _us(_arr(c, "ts", pa.float64())),
        "runner": _arr(c, "runner", pa.int32()),
        "link_segment": _arr(c, "envelope.segment", pa.int64()),
        "link_offset": _arr(c, "envelope.offset", pa.int64()),
    }, file, segment, "START")


def _delivery_batch(file: str, segment: int, offsets: np.ndarray, c: Columns) -> pa.RecordBatch:
    idx = _repeat_index(c["outcomes"])
    per_rec = {
        "offset": pa.array(offsets, pa.int64()),
        "queue_id": _arr(c, "queue_id", pa.string()),
        "ts": _us(_arr(c, "ts", pa.float64())),
        "link_segment": _arr(c, "start.segment", pa.int64()),
        "link_offset": _arr(c, "start.offset", pa.int64()),
        "relay": _arr(c, "relay", pa.string()),
        "remote_dsn": _arr(c, "remote_dsn", pa.bool_()),
    }
    cols = {k: v.take(idx) for k, v in per_rec.items()}
    index = _arr(c, "outcomes.index", pa.int32())
    cols |= {
        "rcpt_index": index,
        "status": _arr(c, "outcomes.status", pa.string()),
        "code": _arr(c, "outcomes.code", pa.int32()),
        "enhanced": _arr(c, "outcomes.enhanced", pa.string()),
        "text": _arr(c, "outcomes.text", pa.string()),
    }
    return _table(len(index), cols, file, segment, "DELIVERY")


def _finish_batch(file: str, segment: int, offsets: np.ndarray, c: Columns) -> pa.RecordBatch:
    return _table(len(offsets), {
        "offset": pa.array(offsets, pa.int64()),
        "queue_id": _arr(c, "queue_id", pa.string()),
        "ts": _us(_arr(c, "ts", pa.float64())),
        "link_segment": _arr(c, "start.segment", pa.int64()),
        "link_offset": _arr(c, "start.offset", pa.int64()),
    }, file, segment, "FINISH")


_BUILDERS: list[tuple[int, str, Callable[[str, int, np.ndarray, Columns], pa.RecordBatch]]] = [
    (_ENVELOPE, "ENVELOPE", _envelope_batch), (_START, "START", _start_batch), (_DELIVERY, "DELIVERY", _delivery_batch),
    (_FINISH, "FINISH", _finish_batch),
]


def _record_batches(file: str, segment: int, offsets: dict[int, np.ndarray],
                    records: dict[int, Columns]) -> Iterator[tuple[str, pa.RecordBatch]]:
    """Arrow batches of the decoded records of one segment, by type (with its ``record_type``), at most
    BATCH_ROWS_MAX rows each."""
    for rtype, kind, build in _BUILDERS:
        if not len(offsets[rtype]):
            continue
        batch = build(file, segment, offsets[rtype], records[rtype])
        for i in range(0, batch.num_rows, BATCH_ROWS_MAX):
            yield kind, batch.slice(i, BATCH_ROWS_MAX)


def _decode(rtype: int, buf: bytes, starts: np.ndarray, ends: np.ndarray) -> Columns:
    """The columns of the payloads ``buf[starts[i]:ends[i]]`` of one record type: by
    :func:`mtaq.analytics.columnar.decode_columns` when they are all inside its grammar, else by msgspec
    (:func:`_bulk_decode`). Raises msgspec errors or ValueError for a payload that does not decode as a
    record of that type."""
    cls = _CLASSES[rtype]
    cols = decode_columns(cls, np.frombuffer(buf, np.uint8), starts, ends) if len(starts) else None
    if cols is not None:
        return cols
    mv = memoryview(buf)
    return columns_of_rows(cls, _bulk_decode(rtype, list(map(mv.__getitem__, map(slice, starts.tolist(), ends.tolist())))))


@dataclass(slots=True)
class SegmentRead:
    """One segment decoded: records (offsets and records by type), problems, good frames and the header."""

    offsets: dict[int, np.ndarray]
    records: dict[int, Columns]
    problems: list[Problem]
    frames: int
    sealed: bool
    header: SegmentHeader | None
    fast: bool


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while many objects are made at once (msgspec's structs, the column lists):
    each full collection would walk every one of them again, which tripled the decoding time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_segment(segment: int, buf: bytes, *, fast: bool = True) -> SegmentRead:
    """Decode segment ``segment`` from ``buf`` (see the comment above): the fast path when everything checks
    out, else :func:`scan_segment` with DATA skipped. Both give the same records and problems. Call it with
    the cyclic GC paused (:func:`_gc_paused`) and free the records before resuming it: it makes an object
    per record, and every collection would walk them all again."""
    if fast:
        walked = _walk(segment, buf)
        if walked is not None:
            offsets, ends, frames, sealed = walked
            try:
                decoded = {t: _decode(t, buf, o + FRAME_HEADER_BYTES, ends[t]) for t, o in offsets.items()}
            except _DECODE_ERRORS:
                pass  # scan_segment names the record
            else:
                return SegmentRead(offsets, decoded, [], frames, sealed, decode_segment_header(buf), True)
    scan = scan_segment(segment, buf, skip_data=True)
    offs: dict[int, list[int]] = {t: [] for t in (_ENVELOPE, _START, _DELIVERY, _FINISH)}
    rows: dict[int, list[Any]] = {t: [] for t in (_ENVELOPE, _START, _DELIVERY, _FINISH)}
    for pos, rec in scan.records:
        t = int(RECORD_TYPE_OF[type(rec)])
        if t in rows:
            offs[t].append(pos.offset)
            rows[t].append(_as_row(rec))
    offsets = {t: np.asarray(o, np.int64) for t, o in offs.items()}
    records = {t: columns_of_rows(_CLASSES[t], r) for t, r in rows.items()}
    return SegmentRead(offsets, records, list(scan.problems), scan.frames, scan.sealed, scan.header, False)


def _problem_batch(file: str, rows: Sequence[tuple[int, int, str, int, str]]) -> pa.RecordBatch:
    n = len(rows)
    return _table(n, {
        "segment": pa.array([r[0] for r in rows], pa.int64()),
        "offset": pa.array([r[1] for r in rows], pa.int64()),
        "problem_kind": pa.array([r[2] for r in rows], pa.string()),
        "problem_end": pa.array([r[3] for r in rows], pa.int64()),
        "problem_reason": pa.array([r[4] for r in rows], pa.string()),
    }, file, 0, "PROBLEM")


def batches(files: Iterable[SegmentFile], *, fast: bool = True) -> Iterator[pa.RecordBatch]:
    """Read ``files`` in order and yield Arrow batches of :data:`SCHEMA` (see the module docstring).
    ``fast=False`` reads every segment with :func:`scan_segment` (the reference the tests compare with)."""
    for _, b in typed_batches(files, fast=fast):
        yield b


def typed_batches(files: Iterable[SegmentFile], *, fast: bool = True) -> Iterator[tuple[str, pa.RecordBatch]]:
    """:func:`batches`, each with its ``record_type``: every row of a batch is of that one type."""
    filesystems: dict[str, pafs.FileSystem] = {}
    for sf in files:
        fs = filesystems.get(sf.root)
        if fs is None:
            fs = filesystems[sf.root] = resolve(sf.root)[0]
        name = sf.display
        try:
            buf, length = read_tail(sf, fs)
        except Exception as exc:  # any I/O or decompression failure: report, never fail the job
            yield "PROBLEM", _problem_batch(name, [(sf.segment, sf.start, "unreadable", sf.size,
                                                    f"{type(exc).__name__}: {exc}")])
            continue
        shift = sf.start - SEGMENT_HEADER_BYTES if sf.start else 0  # a tail: file offset - offset in buf
        with _gc_paused():  # and the records are freed before it runs again (it would walk them all)
            seg = read_segment(sf.segment, buf, fast=fast)
            if shift:
                seg.offsets = {t: o + shift for t, o in seg.offsets.items()}
            made = list(_record_batches(name, sf.segment, seg.offsets, seg.records))
            seg.records = {}  # the records are in the batches now: let them go
        yield from made
        problems = []
        for p in seg.problems:
            kind = p.kind
            if kind == "torn-tail" and not seg.sealed and p.reason != "bytes after seal" and seg.header is not None:
                kind = "open-tail"  # the live segment, or one cut by a crash: its end, not damage
            at, end = (p.offset + shift, p.end + shift) if shift and p.offset >= SEGMENT_HEADER_BYTES else (p.offset, p.end)
            problems.append((p.segment, at, kind, end, p.reason))
        if problems:
            yield "PROBLEM", _problem_batch(name, problems)
        created = seg.header.created * 1_000_000 if seg.header is not None and seg.header.created else None
        yield "SEGMENT", _table(1, {
            "offset": pa.array([sf.start], pa.int64()), "ts": pa.array([created], pa.int64()).cast(_TS),
            "size": pa.array([length - sf.start], pa.int64()),
            "records": pa.array([seg.frames + (1 if seg.sealed else 0)], pa.int64()),
            "sealed": pa.array([seg.sealed], pa.bool_()),
        }, name, sf.segment, "SEGMENT")
