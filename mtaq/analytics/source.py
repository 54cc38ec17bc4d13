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

import fnmatch
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from mtaq.core.frame import SEGMENT_HEADER_BYTES, HeaderError, decode_segment_header, scan_segment
from mtaq.core.records import DeliveryRecord, EnvelopeRecord, FinishRecord, StartRecord

__all__ = [
    "SCHEMA",
    "SPARK_DDL",
    "SegmentFile",
    "SourceError",
    "batches",
    "discover",
    "plan_partitions",
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
    when known (from the archive name or the header), used to read each segment once.
    """

    root: str
    path: str
    segment: int
    size: int
    compressed: bool
    salt: int | None = None

    @property
    def display(self) -> str:
        """The file as the user would name it."""
        if "://" in self.root:
            scheme = self.root.split("://", 1)[0]
            return f"{scheme}://{self.path}"
        return self.path


def _resolve(path: str) -> tuple[pafs.FileSystem, str, str]:
    """(file system, path in it, root to re-resolve it on an executor). Local paths become absolute."""
    if "://" not in path:
        path = os.path.abspath(path)
    try:
        fs, inner = pafs.FileSystem.from_uri(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise SourceError(f"{path}: {exc}") from exc
    return fs, inner, path


def _segment_file(root: str, info: pafs.FileInfo) -> SegmentFile | None:
    m = SEGMENT_FILE.match(info.base_name)
    if m is None or info.type != pafs.FileType.File:
        return None
    salt = int(m.group("salt"), 16) if m.group("salt") else None
    return SegmentFile(root, info.path, int(m.group("segment")), int(info.size or 0), bool(m.group("zst")), salt)


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


def discover(paths: Sequence[str]) -> list[SegmentFile]:
    """The segment files named by ``paths`` (spool, archive, file or glob), each segment once, in order.

    Raises SourceError naming the path when it does not exist or holds no segment file.
    """
    found: list[SegmentFile] = []
    for raw in paths:
        fs, inner, root = _resolve(raw)
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
                sel = pafs.FileSelector(log_dir if is_spool else inner, recursive=not is_spool)
                files = [sf for sf in map(lambda i: _segment_file(root, i), fs.get_file_info(sel)) if sf is not None]
        if not files:
            raise SourceError(f"{raw}: no segment files (*.seg, *.seg.zst) found")
        for sf in files:
            if sf.salt is None:
                sf = SegmentFile(sf.root, sf.path, sf.segment, sf.size, sf.compressed, _read_salt(fs, sf))
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
    segment is a group of its own). A segment is never split: its tail rules need the whole file."""
    groups: list[list[SegmentFile]] = []
    cur: list[SegmentFile] = []
    cur_bytes = 0
    for sf in files:
        if cur and cur_bytes + sf.size > partition_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(sf)
        cur_bytes += sf.size
    if cur:
        groups.append(cur)
    return groups


def read_segment_bytes(sf: SegmentFile, fs: pafs.FileSystem | None = None) -> bytes:
    """The segment's bytes, decompressed if it is a ``.zst`` (here, not by pyarrow's by-extension guess).

    Raises OSError, pyarrow or zstandard errors.
    """
    if fs is None:
        fs, _, _ = _resolve(sf.root)
    with fs.open_input_stream(sf.path, compression=None) as f:
        raw = f.read()
    if not sf.compressed:
        return bytes(raw)
    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(raw) as r:
        return r.read()


def _domain(address: str) -> str:
    return address.rpartition("@")[2].lower() if "@" in address else ""


def _us(t: float) -> int:
    return round(t * 1_000_000)


def _batch(n: int, cols: dict[str, list[Any]]) -> pa.RecordBatch:
    arrays = []
    for name, typ, _, _ in COLUMNS:
        v = cols.get(name)
        arrays.append(pa.nulls(n, typ) if v is None else pa.array(v, typ))
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def _const(value: Any, n: int) -> list[Any]:
    return [value] * n


def _rows_of(file: str, segment: int, records: Sequence[tuple[Any, Any]]) -> Iterator[pa.RecordBatch]:
    """Batches for decoded records (a slice of one segment), one batch per record type present."""
    env: dict[str, list[Any]] = {k: [] for k in (
        "offset", "queue_id", "ts", "arrival_ts", "not_before_ts", "generation", "attempts", "runner", "sender",
        "sender_domain", "size", "client", "helo", "bounce_of", "link_segment", "link_offset", "rcpt_index",
        "rcpt_address", "rcpt_domain", "rcpt_unknown", "last_reply")}
    st: dict[str, list[Any]] = {k: [] for k in ("offset", "queue_id", "ts", "runner", "link_segment", "link_offset")}
    dl: dict[str, list[Any]] = {k: [] for k in (
        "offset", "queue_id", "ts", "link_segment", "link_offset", "relay", "remote_dsn", "rcpt_index", "status",
        "code", "enhanced", "text")}
    fin: dict[str, list[Any]] = {k: [] for k in ("offset", "queue_id", "ts", "link_segment", "link_offset")}
    for pos, rec in records:
        if isinstance(rec, DeliveryRecord):
            ts, ls, lo = _us(rec.ts), rec.start.segment, rec.start.offset
            for o in rec.outcomes:
                dl["offset"].append(pos.offset)
                dl["queue_id"].append(rec.queue_id)
                dl["ts"].append(ts)
                dl["link_segment"].append(ls)
                dl["link_offset"].append(lo)
                dl["relay"].append(rec.relay)
                dl["remote_dsn"].append(rec.remote_dsn)
                dl["rcpt_index"].append(o.index)
                dl["status"].append(o.status)
                dl["code"].append(o.code)
                dl["enhanced"].append(o.enhanced)
                dl["text"].append(o.text)
        elif isinstance(rec, StartRecord):
            st["offset"].append(pos.offset)
            st["queue_id"].append(rec.queue_id)
            st["ts"].append(_us(rec.ts))
            st["runner"].append(rec.runner)
            st["link_segment"].append(rec.envelope.segment)
            st["link_offset"].append(rec.envelope.offset)
        elif isinstance(rec, FinishRecord):
            fin["offset"].append(pos.offset)
            fin["queue_id"].append(rec.queue_id)
            fin["ts"].append(_us(rec.ts))
            fin["link_segment"].append(rec.start.segment)
            fin["link_offset"].append(rec.start.offset)
        elif isinstance(rec, EnvelopeRecord):
            arrival = _us(rec.arrival_ts)
            common = (
                pos.offset, rec.queue_id, arrival if rec.generation == 0 else None, arrival, _us(rec.not_before_ts),
                rec.generation, rec.attempts, rec.runner, rec.sender, _domain(rec.sender), rec.size, rec.client,
                rec.helo, rec.bounce_of, rec.replaces.segment if rec.replaces else None,
                rec.replaces.offset if rec.replaces else None,
            )
            for r in rec.recipients:
                for k, v in zip(env, common, strict=False):
                    env[k].append(v)
                env["rcpt_index"].append(r.index)
                env["rcpt_address"].append(r.address)
                env["rcpt_domain"].append(_domain(r.address))
                env["rcpt_unknown"].append(r.unknown)
                env["last_reply"].append(r.last_reply)
    for rtype, cols in (("ENVELOPE", env), ("START", st), ("DELIVERY", dl), ("FINISH", fin)):
        n = len(cols["offset"])
        if n:
            yield _batch(n, {**cols, "file": _const(file, n), "segment": _const(segment, n),
                             "record_type": _const(rtype, n)})


def _problem_batch(file: str, rows: Sequence[tuple[int, int, str, int, str]]) -> pa.RecordBatch:
    n = len(rows)
    return _batch(n, {
        "file": _const(file, n),
        "segment": [r[0] for r in rows],
        "offset": [r[1] for r in rows],
        "record_type": _const("PROBLEM", n),
        "problem_kind": [r[2] for r in rows],
        "problem_end": [r[3] for r in rows],
        "problem_reason": [r[4] for r in rows],
    })


def batches(files: Iterable[SegmentFile]) -> Iterator[pa.RecordBatch]:
    """Read ``files`` in order and yield Arrow batches of :data:`SCHEMA` (see the module docstring)."""
    filesystems: dict[str, pafs.FileSystem] = {}
    for sf in files:
        fs = filesystems.get(sf.root)
        if fs is None:
            fs = filesystems[sf.root] = _resolve(sf.root)[0]
        name = sf.display
        try:
            buf = read_segment_bytes(sf, fs)
        except Exception as exc:  # any I/O or decompression failure: report, never fail the job
            yield _problem_batch(name, [(sf.segment, 0, "unreadable", sf.size, f"{type(exc).__name__}: {exc}")])
            continue
        scan = scan_segment(sf.segment, buf, skip_data=True)
        recs = scan.records
        for i in range(0, len(recs), BATCH_ROWS_MAX):
            yield from _rows_of(name, sf.segment, recs[i : i + BATCH_ROWS_MAX])
        problems = []
        for p in scan.problems:
            kind = p.kind
            if kind == "torn-tail" and not scan.sealed and p.reason != "bytes after seal" and scan.header is not None:
                kind = "open-tail"  # the live segment, or one cut by a crash: its end, not damage
            problems.append((p.segment, p.offset, kind, p.end, p.reason))
        if problems:
            yield _problem_batch(name, problems)
        created = scan.header.created * 1_000_000 if scan.header is not None and scan.header.created else None
        yield _batch(1, {
            "file": [name], "segment": [sf.segment], "offset": [0], "record_type": ["SEGMENT"], "ts": [created],
            "size": [len(buf)], "records": [scan.frames + (1 if scan.sealed else 0)], "sealed": [scan.sealed],
        })
