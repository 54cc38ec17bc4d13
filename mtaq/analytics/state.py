"""``mtaq analyze --state DIR``: what a run keeps so that the next one reads only what is new (issue 38.1).

The job's tasks (:func:`mtaq.analytics.datasource.stage_facts`) turn one partition (a run of segments in log
order) into staged Parquet files (facts, messages, outcomes by date, the percentile buckets, the senders and
recipients) and the partial aggregates of the small tables. Those depend on the partition's bytes and on the
window (``--since``/``--until``) only, and the job's result does not depend on how the log was cut into
partitions, as long as each cut is between two frames (a message is *closed* where a partition holds it
whole; every other message is merged from its record rows, which is how messages that span runs join). So
the state keeps, per partition, its staged files and partial aggregates and, per segment, which bytes it
read; the next run reuses every partition whose bytes are unchanged and still a contiguous run of the
discovered segments, and runs the tasks over the rest: new segments, and the *tail* of a segment that grew
since (the live one) when the last run read it cleanly (it ended between two frames: no PROBLEM row, not
sealed, every byte the fingerprint saw), else that segment's partition again whole. Then the job goes on as
a full run does, over all the staged rows: same tables, same report.

Layout of DIR: ``manifest.json`` (written last, by rename; not fsync'd: only ``mtaq.storage.fs`` syncs, and a
manifest cut by a crash does not parse, so it is rebuilt) and ``files/`` (the staged Parquet files, hard
links where the file system allows, else copies). Manifest::

    {"format": 2, "config": {...}, "files": {NAME: [size, crc32]}, "listed_ns": NS, "crc": CRC,
     "prints": {PATH: [segment, salt, created, length, crc, stored_size, mtime_ns, [[length, crc]...]]},
     "partitions": [{"segments": [{"segment", "salt", "created", "path", "from", "length", "crc", "clean"}],
                     "rows": [[table, NAME|null, rows|null, part|null, base64|null]]}]}

A segment is known by its header's identity (number, salt, creation time: docs/log_format.md), not by its
name, so a segment moved into the archive (renamed, or compressed) is still the one read before. A
partition's entry says it read bytes ``from`` to ``length`` (decompressed); ``crc`` is the CRC-32 (zlib) of
the segment's first ``length`` bytes. Every run takes each segment's CRC-32 at every length an entry names
and compares (:func:`fingerprints`), except for a file listed with the same stored size and modification
time, and the same segment number and salt, as the last run recorded in ``prints`` (its fingerprint then)
when that time was more than ``RACY_NS`` before that run listed it, by this host's clock (after git's rule
for "racily clean" files: a write within the clock's granularity of the listing could leave the time
unchanged; a file system whose clock is more than that apart from this host's, or whose times are coarser,
weakens it). So a year of archived segments is listed, not read, by each run; a byte changed in one of them
without its size and modification time changing (bit rot, or a deliberate ``touch -d``) is not seen by a
run with state, as it is by a run without. Nothing is used unless
it checks out: a manifest that does not parse or whose own CRC-32 (``crc``: of its JSON with sorted keys,
``crc`` left out) differs, another format, version or window, a file whose size or
CRC-32 differs, a segment whose first ``length`` bytes changed (or that got shorter): each is one line
(``note``), and the run rebuilds the state from the segments, as a run without state computes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import time
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

STATE_FORMAT = 2
_CRC_CHUNK = 1 << 24  # bytes checksummed at a time (zlib.crc32 releases the GIL on large buffers)

StagedRow = tuple[str | None, str | None, int | None, str | None, bytes | None]  # datasource.STAGED_DDL


@dataclass(frozen=True, slots=True)
class Print:
    """A segment as read now: its identity (header's segment, salt, created; the name's number and salt when
    the header is bad), the file (as the job's ``file`` column has it), its length (bytes, decompressed), the
    CRC-32 of all of it, and ``cuts``: (length, CRC-32 of the first length bytes) for each length a previous
    run's entries name that is not past the end. ``stat``: the stored file's (size, mtime_ns) as listed."""

    segment: int
    salt: int | None
    created: int | None
    path: str
    length: int
    crc: int
    cuts: tuple[tuple[int, int], ...] = ()
    stat: tuple[int, int] | None = None

    @property
    def identity(self) -> tuple[int, int | None, int | None]:
        return self.segment, self.salt, self.created

    def entry(self, start: int = 0, clean: bool = False) -> dict[str, Any]:
        """The manifest entry of a partition that read bytes ``start`` to the end of this segment."""
        return {"segment": self.segment, "salt": self.salt, "created": self.created, "path": self.path,
                "from": start, "length": self.length, "crc": self.crc, "clean": clean}

    def record(self, cuts: Sequence[tuple[int, int]]) -> list[Any]:
        """Its ``prints`` value in the manifest (``cuts``: the lengths the new manifest's entries name)."""
        assert self.stat is not None
        return [self.segment, self.salt, self.created, self.length, self.crc, *self.stat, [list(c) for c in cuts]]


RACY_NS = 2_000_000_000  # a file modified this close (ns) before the listing that recorded it is read again


def _crc(buf: memoryview, seed: int = 0) -> int:
    for i in range(0, len(buf), _CRC_CHUNK):
        seed = zlib.crc32(buf[i : i + _CRC_CHUNK], seed)
    return seed


def _stat(sf: SegmentFile) -> tuple[int, int] | None:
    return None if sf.mtime_ns is None else (sf.size, sf.mtime_ns)


def _print(sf: SegmentFile, cuts: Mapping[tuple[int, int | None, int | None], Sequence[int]],
           known: Mapping[str, list[Any]]) -> Print:
    stat = _stat(sf)
    rec = known.get(sf.display)
    if rec is not None and stat is not None and tuple(rec[5:7]) == stat and (sf.segment, sf.salt) == tuple(rec[0:2]):
        # the same stored size and time, and the same segment number and salt as listed (the salt from the
        # archive name or the header discover read): another log's segment copied over it, its time kept, is not
        return Print(rec[0], rec[1], rec[2], sf.display, rec[3], rec[4], tuple((c[0], c[1]) for c in rec[7]), stat)
    try:
        buf = memoryview(read_segment_bytes(sf))
    except Exception:  # gone or unreadable: no print; its task says what (an "unreadable" PROBLEM row)
        return Print(sf.segment, sf.salt, None, sf.display, -1, 0)
    try:
        h = decode_segment_header(buf[:SEGMENT_HEADER_BYTES])
        ident: tuple[int, int | None, int | None] = (h.segment, h.salt, h.created)
    except HeaderError:
        ident = (sf.segment, sf.salt, None)
    got, crc, at = [], 0, 0
    for cut in sorted(c for c in set(cuts.get(ident, ())) if 0 <= c <= len(buf)):
        crc = _crc(buf[at:cut], crc)
        got.append((cut, crc))
        at = cut
    crc = _crc(buf[at:], crc)
    return Print(ident[0], ident[1], ident[2], sf.display, len(buf), crc, tuple(got), stat)


def fingerprints(files: Sequence[SegmentFile],
                 cuts: Mapping[tuple[int, int | None, int | None], Sequence[int]] | None = None,
                 known: Mapping[str, list[Any]] | None = None) -> list[Print]:
    """The :class:`Print` of each segment file, in order: from ``known`` (a manifest's ``prints``, only the
    files not racily clean) when the file's stored size and modification time are the same, else read whole
    (a few at a time); ``cuts``: the lengths the previous run's entries name, by identity, whose CRC-32 is
    taken too. A file that cannot be read gets length -1 and no identity beyond its name: nothing of the
    state matches it, and the task that reads it reports it as a run without state does."""
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="mtaq-state-crc") as pool:
        return list(pool.map(lambda sf: _print(sf, cuts or {}, known or {}), files))


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
    listed_ns: int = 0  # when the files were listed (ns since the epoch, UTC): the next run's RACY_NS rule


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
        if isinstance(m, dict) and m.get("format") != STATE_FORMAT:
            return None, f"made by another format ({m.get('format')}; this mtaq writes {STATE_FORMAT})"
        if not isinstance(m, dict) or not isinstance(m.get("partitions"), list) or not isinstance(m.get("files"), dict) \
                or not isinstance(m.get("prints"), dict) or not isinstance(m.get("listed_ns"), int):
            return None, "manifest.json is not a manifest of mtaq analyze"
    except (OSError, ValueError) as exc:
        return None, f"manifest.json unreadable ({exc})"
    if m.pop("crc", None) != _manifest_crc(m):
        return None, "manifest.json: its CRC-32 differs (changed since the last run wrote it)"
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


def _manifest_crc(m: Mapping[str, Any]) -> int:
    """The manifest's own CRC-32 (zlib), of its JSON with sorted keys, ``crc`` left out: a manifest that still
    parses after a change (a digit of a length) is not used."""
    return zlib.crc32(json.dumps({k: v for k, v in m.items() if k != "crc"}, sort_keys=True).encode())


def _ident(s: Mapping[str, Any]) -> tuple[int, int | None, int | None]:
    return s["segment"], s["salt"], s["created"]


def plan(state: str, files: Sequence[SegmentFile], partition_bytes: int, stage: str, since_us: int | None,
         until_us: int | None, close: bool, say: Callable[[str], None], listed_ns: int | None = None) -> StatePlan:
    """Check the state ``state`` against the discovered segments ``files`` (in log order) and link the files of
    the partitions it can reuse into ``stage``. Every problem with the state gives a note and a plan with
    nothing reused (all of ``files`` planned in partitions of ``partition_bytes``). ``listed_ns``: this host's
    clock (ns since the epoch) just before ``files`` were listed (default: now), kept for the next run's
    RACY_NS rule."""
    if listed_ns is None:
        listed_ns = time.time_ns()
    config = _config(since_us, until_us, close)
    manifest, note = _load(state, config)
    cuts: dict[tuple[int, int | None, int | None], list[int]] = {}
    known: dict[str, list[Any]] = {}
    if manifest is not None:
        for q in manifest["partitions"]:
            for s in q["segments"]:
                cuts.setdefault(_ident(s), []).append(s["length"])
        known = {path: rec for path, rec in manifest["prints"].items() if rec[6] < manifest["listed_ns"] - RACY_NS}
    prints = fingerprints(files, cuts, known)
    by_file = {p.path: p for p in prints}
    fresh = StatePlan([], plan_partitions(files, partition_bytes), note, [], by_file, 0, listed_ns)
    if manifest is None:
        return fresh
    index = {p.identity: i for i, p in enumerate(prints)}
    crcs = {(_ident(s), s["length"]): s["crc"] for q in manifest["partitions"] for s in q["segments"]}
    for p in prints:  # a prefix read before that is not there now: the state no longer describes these segments
        for cut, crc in p.cuts:
            if crcs.get((p.identity, cut), crc) != crc:
                fresh.note = f"segment {p.segment} ({p.path}) changed in its first {cut} bytes since the last run"
                return fresh
    for q in manifest["partitions"]:
        for s in q["segments"]:
            i = index.get(_ident(s))
            if i is not None and prints[i].length < s["length"]:
                fresh.note = (f"segment {s['segment']} ({prints[i].path}) is shorter ({prints[i].length} bytes) than "
                              f"the last run read ({s['length']})")
                return fresh
    covered = [0] * len(prints)  # bytes of each segment the partitions reused so far read (from its start)
    kept: list[dict[str, Any]] = []
    reused: list[StagedRow] = []
    os.makedirs(stage, exist_ok=True)
    for q in manifest["partitions"]:
        at = [index.get(_ident(s)) for s in q["segments"]]
        if any(i is None for i in at):
            continue  # a segment reclaimed (or no longer named): the rest of this partition is read again
        ii = [i for i in at if i is not None]
        if ii != list(range(ii[0], ii[0] + len(ii))):
            continue  # no longer a run of the discovered segments: read again
        if any(s["from"] != covered[i] or (s["length"] < prints[i].length and not s["clean"])
               for i, s in zip(ii, q["segments"], strict=True)):
            continue  # not where the bytes reused so far end, or a segment grew after an unclean end: read again
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
        for i, s in zip(ii, q["segments"], strict=True):
            covered[i] = s["length"]
        reused += rows
        kept.append({"segments": [{**s, "path": prints[i].path} for i, s in zip(ii, q["segments"], strict=True)],
                     "rows": [[t, None if p is None else os.path.basename(p), n, pt,
                               None if d is None else base64.b64encode(d).decode()] for t, p, n, pt, d in rows]})
    groups: list[list[SegmentFile]] = []
    run: list[SegmentFile] = []
    tails = 0
    for i, sf in enumerate(files):
        if covered[i] == prints[i].length:
            groups += plan_partitions(run, partition_bytes) if run else []
            run = []
        elif covered[i]:
            run.append(dataclasses.replace(sf, start=covered[i]))  # the tail that grew since
            tails += 1
        else:
            run.append(sf)
    groups += plan_partitions(run, partition_bytes) if run else []
    whole = sum(1 for i in range(len(prints)) if covered[i] == prints[i].length)
    say(f"state {state}: {whole} segments from the last run, {tails} read from where it stopped, "
        f"{len(files) - whole - tails} to read")
    return StatePlan(reused, groups, None, kept, by_file, whole, listed_ns)


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


def _clean_ends(rows: Sequence[StagedRow]) -> dict[tuple[str, int], int]:
    """From a partition's ``side`` partial: for each file it read with no PROBLEM row and not sealed, (file,
    where the read began) -> the bytes read from there (its SEGMENT row)."""
    ends: dict[tuple[str, int], int] = {}
    bad: set[str] = set()
    for _, _, _, part, data in rows:
        if part != "side" or data is None:
            continue
        t = decode(data)
        for r in t.select(["record_type", "file", "offset", "size", "sealed"]).to_pylist():
            if r["record_type"] == "PROBLEM" or (r["record_type"] == "SEGMENT" and r["sealed"]):
                bad.add(r["file"])
            elif r["record_type"] == "SEGMENT":
                ends[(r["file"], r["offset"] or 0)] = r["size"]
    return {k: v for k, v in ends.items() if k[0] not in bad}


def save(state: str, sp: StatePlan, computed: Sequence[tuple[int, StagedRow]], groups: Sequence[Sequence[SegmentFile]],
         since_us: int | None, until_us: int | None, close: bool) -> None:
    """Keep the partitions this run computed (``computed``: (group number in ``groups``, staged row), the
    staged files still in the stage) with those it reused, then write the manifest (by rename), then remove
    the files no manifest names. Called before the staged files are moved into the tables. A segment's entry
    is ``clean`` (the next run may read only what it grew by) when the partition's read of it ended between
    two frames at the length its fingerprint saw: no PROBLEM row, not sealed, every byte read."""
    files_dir = os.path.join(state, "files")
    os.makedirs(files_dir, exist_ok=True)
    parts: list[dict[str, Any]] = list(sp.kept)
    by_group: dict[int, list[StagedRow]] = {}
    for g, row in computed:
        by_group.setdefault(g, []).append(row)
    for g, sfs in enumerate(groups):
        rows = []
        got = by_group.get(g, [])
        ends = _clean_ends(got)
        for table, path, nrows, part, data in got:
            name = None
            if path is not None:
                name = os.path.basename(path)
                target = os.path.join(files_dir, name)
                if not os.path.exists(target):
                    _link(path, target)
            rows.append([table, name, nrows, part, None if data is None else base64.b64encode(data).decode()])
        entries = []
        for sf in sfs:
            pr = sp.prints[sf.display]
            entries.append(pr.entry(sf.start, ends.get((sf.display, sf.start)) == pr.length - sf.start))
        parts.append({"segments": entries, "rows": rows})
    names: dict[str, list[int]] = {}
    for p in parts:
        for _, name, _, _, _ in p["rows"]:
            if name is not None:
                with open(os.path.join(files_dir, name), "rb") as f:
                    data = f.read()
                names[name] = [len(data), zlib.crc32(data)]
    cuts: dict[tuple[int, int | None, int | None], set[tuple[int, int]]] = {}
    for p in parts:
        for s in p["segments"]:
            cuts.setdefault(_ident(s), set()).add((s["length"], s["crc"]))
    prints = {path: pr.record(sorted(cuts.get(pr.identity, ()))) for path, pr in sp.prints.items()
              if pr.stat is not None and pr.length >= 0}
    manifest: dict[str, Any] = {"format": STATE_FORMAT, "config": _config(since_us, until_us, close), "files": names,
                                "listed_ns": sp.listed_ns, "prints": prints, "partitions": parts}
    manifest["crc"] = _manifest_crc(manifest)
    tmp = os.path.join(state, f"manifest.json.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f)  # not fsync'd: a manifest lost or cut by a crash is said and rebuilt, never used
    os.replace(tmp, os.path.join(state, "manifest.json"))
    for name in os.listdir(files_dir):
        if name not in names:
            os.unlink(os.path.join(files_dir, name))
