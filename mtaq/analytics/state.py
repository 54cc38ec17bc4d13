"""``mtaq analyze --state DIR``: what a run keeps so that the next one reads only what is new (issue 38.1).

The job's tasks (:func:`mtaq.analytics.datasource.stage_facts`) turn one partition (a run of whole segments in
log order) into staged Parquet files (facts, messages, outcomes by date, the percentile buckets, the senders
and recipients) and the partial aggregates of the small tables. Those depend on the partition's bytes and on
the window (``--since``/``--until``) only, and the job's result does not depend on how the segments were packed
into partitions (a message is *closed* where a partition holds it whole; every other message is merged from
its record rows, which is how messages that span runs join). So the state keeps, per partition, its staged
files and partial aggregates and, per segment, how far it was read; the next run reuses every partition
whose segments are unchanged and still a contiguous run of the discovered segments, and runs the tasks over
the rest (new segments, and the partition of a segment that grew: its tail rules need the whole file, so it
is read again whole). Then the job goes on as a full run does, over all the staged rows: same tables, same
report.

Layout of DIR: ``manifest.json`` (written last, by rename; not fsync'd: only ``mtaq.storage.fs`` syncs, and a
manifest cut by a crash does not parse, so it is rebuilt) and ``files/`` (the staged Parquet files, hard
links where the file system allows, else copies). Manifest::

    {"format": 1, "config": {...}, "files": {NAME: [size, crc32]},
     "partitions": [{"segments": [{"segment", "salt", "created", "path", "length", "crc"}],
                     "rows": [[table, NAME|null, rows|null, part|null, base64|null]]}]}

A segment is known by its header's identity (number, salt, creation time: docs/log_format.md), not by its
name, so a segment moved into the archive (renamed, or compressed) is still the one read before; ``crc`` is
the CRC-32 (zlib) of its first ``length`` bytes (decompressed), checked again on every run. Nothing is used
unless it checks out: a manifest that does not parse, another format, version or window, a file whose size
or CRC-32 differs, a segment whose first ``length`` bytes changed (or that got shorter): each is one line
(``note``), and the run rebuilds the state from the segments, as a run without state computes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from mtaq.analytics.partials import decode, encode
from mtaq.analytics.source import SegmentFile, plan_partitions, read_segment_bytes
from mtaq.core.frame import SEGMENT_HEADER_BYTES, HeaderError, decode_segment_header

__all__ = ["STATE_FORMAT", "Print", "StatePlan", "fingerprints", "plan", "save"]

STATE_FORMAT = 1
_CRC_CHUNK = 1 << 24  # bytes checksummed at a time (zlib.crc32 releases the GIL on large buffers)

StagedRow = tuple[str | None, str | None, int | None, str | None, bytes | None]  # datasource.STAGED_DDL


@dataclass(frozen=True, slots=True)
class Print:
    """A segment as read now: its identity (header's segment, salt, created; the name's number and salt when
    the header is bad), the file (as the job's ``file`` column has it), its length (bytes, decompressed), the
    CRC-32 of all of it, and of its first ``prefix`` bytes (the length a previous run read; -1: none asked)."""

    segment: int
    salt: int | None
    created: int | None
    path: str
    length: int
    crc: int
    prefix: int = -1
    prefix_crc: int = 0

    @property
    def identity(self) -> tuple[int, int | None, int | None]:
        return self.segment, self.salt, self.created

    def entry(self) -> dict[str, Any]:
        return {"segment": self.segment, "salt": self.salt, "created": self.created, "path": self.path,
                "length": self.length, "crc": self.crc}


def _crc(buf: memoryview, seed: int = 0) -> int:
    for i in range(0, len(buf), _CRC_CHUNK):
        seed = zlib.crc32(buf[i : i + _CRC_CHUNK], seed)
    return seed


def _print(sf: SegmentFile, prefixes: Mapping[tuple[int, int | None, int | None], int]) -> Print:
    buf = memoryview(read_segment_bytes(sf))
    try:
        h = decode_segment_header(buf[:SEGMENT_HEADER_BYTES])
        ident: tuple[int, int | None, int | None] = (h.segment, h.salt, h.created)
    except HeaderError:
        ident = (sf.segment, sf.salt, None)
    prefix = prefixes.get(ident, -1)
    if 0 <= prefix <= len(buf):
        head = _crc(buf[:prefix])
        whole = _crc(buf[prefix:], head)
    else:
        head, whole = 0, _crc(buf)
    return Print(ident[0], ident[1], ident[2], sf.display, len(buf), whole, prefix, head)


def fingerprints(files: Sequence[SegmentFile],
                 prefixes: Mapping[tuple[int, int | None, int | None], int] | None = None) -> list[Print]:
    """The :class:`Print` of each segment file (read whole, a few at a time), in order; ``prefixes``: the
    length read before of each known identity, whose CRC-32 is taken too. Raises what reading raises."""
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="mtaq-state-crc") as pool:
        return list(pool.map(lambda sf: _print(sf, prefixes or {}), files))


@dataclass
class StatePlan:
    """What a run with state does: ``reused`` (the staged rows of the partitions kept, their files linked into
    the stage), ``groups`` (the partitions its tasks compute), ``note`` (one line when the state was not
    usable and is rebuilt; None otherwise), and what :func:`save` needs."""

    reused: list[StagedRow]
    groups: list[list[SegmentFile]]
    note: str | None
    kept: list[dict[str, Any]] = field(default_factory=list)  # manifest partitions kept (paths updated)
    prints: dict[str, Print] = field(default_factory=dict)  # by file (display) of every discovered segment
    read_from_state: int = 0  # segments whose partitions were reused


def _version() -> str:
    """mtaq's version (the installed distribution's; "unknown" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtaq")
    except PackageNotFoundError:
        return "unknown"


def _config(since_us: int | None, until_us: int | None, close: bool) -> dict[str, Any]:
    return {"format": STATE_FORMAT, "mtaq": _version(), "since_us": since_us, "until_us": until_us, "close": close}


def _load(state: str, config: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when the state checks out, (None, reason) when it does not, (None, None) when empty."""
    path = os.path.join(state, "manifest.json")
    if not os.path.exists(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
        if not isinstance(m, dict) or not isinstance(m.get("partitions"), list) or not isinstance(m.get("files"), dict):
            return None, "manifest.json is not a manifest of mtaq analyze"
    except (OSError, ValueError) as exc:
        return None, f"manifest.json unreadable ({exc})"
    if m.get("config") != config:
        return None, f"made with other settings ({m.get('config')}, now {config})"
    for name, (size, crc) in m["files"].items():
        p = os.path.join(state, "files", name)
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as exc:
            return None, f"files/{name}: {exc.strerror or exc}"
        if len(data) != size or zlib.crc32(data) != crc:
            return None, f"files/{name}: not the file the last run kept (size or CRC-32 differs)"
    return m, None


def plan(state: str, files: Sequence[SegmentFile], partition_bytes: int, stage: str, since_us: int | None,
         until_us: int | None, close: bool, say: Callable[[str], None]) -> StatePlan:
    """Check the state ``state`` against the discovered segments ``files`` (in log order) and link the files of
    the partitions it can reuse into ``stage``. Every problem with the state gives a note and a plan with
    nothing reused (all of ``files`` planned in partitions of ``partition_bytes``)."""
    config = _config(since_us, until_us, close)
    manifest, note = _load(state, config)
    prefixes: dict[tuple[int, int | None, int | None], int] = {}
    if manifest is not None:
        for p in manifest["partitions"]:
            for s in p["segments"]:
                prefixes[(s["segment"], s["salt"], s["created"])] = s["length"]
    prints = fingerprints(files, prefixes)
    by_file = {p.path: p for p in prints}
    fresh = StatePlan([], plan_partitions(files, partition_bytes), note, [], by_file)
    if manifest is None:
        return fresh
    index = {p.identity: i for i, p in enumerate(prints)}
    known = {(s["segment"], s["salt"], s["created"]): s for q in manifest["partitions"] for s in q["segments"]}
    for p in prints:  # a prefix read before that is not there now: the state no longer describes these segments
        if p.prefix >= 0 and p.prefix_crc != known[p.identity]["crc"]:
            fresh.note = f"segment {p.segment} ({p.path}) changed in its first {p.prefix} bytes since the last run"
            return fresh
    for q in manifest["partitions"]:
        for s in q["segments"]:
            i = index.get((s["segment"], s["salt"], s["created"]))
            if i is not None and prints[i].length < s["length"]:
                fresh.note = (f"segment {s['segment']} ({prints[i].path}) is shorter ({prints[i].length} bytes) than "
                              f"the last run read ({s['length']})")
                return fresh
    used = [False] * len(prints)
    kept: list[dict[str, Any]] = []
    reused: list[StagedRow] = []
    os.makedirs(stage, exist_ok=True)
    for q in manifest["partitions"]:
        at = [index.get((s["segment"], s["salt"], s["created"])) for s in q["segments"]]
        if any(i is None for i in at):
            continue  # a segment reclaimed (or no longer named): the rest of this partition is read again
        ii = [i for i in at if i is not None]
        if ii != list(range(ii[0], ii[0] + len(ii))) or any(used[i] for i in ii):
            continue  # no longer a run of the discovered segments: read again
        if any(prints[i].length != s["length"] for i, s in zip(ii, q["segments"], strict=True)):
            continue  # a segment grew (the live one): its partition is read again
        renamed = {s["path"]: prints[i].path for i, s in zip(ii, q["segments"], strict=True) if s["path"] != prints[i].path}
        rows: list[StagedRow] = []
        for table, name, nrows, part, data in q["rows"]:
            raw = None if data is None else base64.b64decode(data)
            if part == "side" and raw is not None and renamed:
                raw = _renamed(raw, renamed)
            if name is not None:
                _link(os.path.join(state, "files", name), os.path.join(stage, name))
                rows.append((table, os.path.join(stage, name), nrows, part, raw))
            else:
                rows.append((table, None, nrows, part, raw))
        for i in ii:
            used[i] = True
        reused += rows
        kept.append({"segments": [prints[i].entry() for i in ii],
                     "rows": [[t, None if p is None else os.path.basename(p), n, pt,
                               None if d is None else base64.b64encode(d).decode()] for t, p, n, pt, d in rows]})
    groups: list[list[SegmentFile]] = []
    run: list[SegmentFile] = []
    for i, sf in enumerate(files):
        if used[i]:
            groups += plan_partitions(run, partition_bytes) if run else []
            run = []
        else:
            run.append(sf)
    groups += plan_partitions(run, partition_bytes) if run else []
    say(f"state {state}: {sum(used)} segments from the last run, {len(files) - sum(used)} to read")
    return StatePlan(reused, groups, None, kept, by_file, sum(used))


def _renamed(data: bytes, renamed: Mapping[str, str]) -> bytes:
    """A ``side`` partial (PROBLEM and SEGMENT rows) with its ``file`` column renamed (a segment archived)."""
    t = decode(data)
    files = [renamed.get(f, f) if f is not None else None for f in t["file"].to_pylist()]
    t = t.set_column(t.schema.get_field_index("file"), "file", pa.array(files, t.schema.field("file").type))
    [(_, out)] = list(encode({"side": t}))
    return out


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def save(state: str, sp: StatePlan, computed: Sequence[tuple[int, StagedRow]], groups: Sequence[Sequence[SegmentFile]],
         since_us: int | None, until_us: int | None, close: bool) -> None:
    """Keep the partitions this run computed (``computed``: (group number in ``groups``, staged row), the
    staged files still in the stage) with those it reused, then write the manifest (by rename), then remove
    the files no manifest names. Called before the staged files are moved into the tables."""
    files_dir = os.path.join(state, "files")
    os.makedirs(files_dir, exist_ok=True)
    parts: list[dict[str, Any]] = list(sp.kept)
    by_group: dict[int, list[StagedRow]] = {}
    for g, row in computed:
        by_group.setdefault(g, []).append(row)
    for g, sfs in enumerate(groups):
        rows = []
        for table, path, nrows, part, data in by_group.get(g, []):
            name = None
            if path is not None:
                name = os.path.basename(path)
                target = os.path.join(files_dir, name)
                if not os.path.exists(target):
                    _link(path, target)
            rows.append([table, name, nrows, part, None if data is None else base64.b64encode(data).decode()])
        parts.append({"segments": [sp.prints[sf.display].entry() for sf in sfs], "rows": rows})
    names: dict[str, list[int]] = {}
    for p in parts:
        for _, name, _, _, _ in p["rows"]:
            if name is not None:
                with open(os.path.join(files_dir, name), "rb") as f:
                    data = f.read()
                names[name] = [len(data), zlib.crc32(data)]
    manifest = {"format": STATE_FORMAT, "config": _config(since_us, until_us, close), "files": names, "partitions": parts}
    tmp = os.path.join(state, f"manifest.json.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f)  # not fsync'd: a manifest lost or cut by a crash is said and rebuilt, never used
    os.replace(tmp, os.path.join(state, "manifest.json"))
    for name in os.listdir(files_dir):
        if name not in names:
            os.unlink(os.path.join(files_dir, name))
