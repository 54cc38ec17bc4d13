"""``mtaq analyze --state DIR`` (issue 38.1): a run on the log as it was at a split point, then a run with
the state on the whole log, gives every table a run without state gives; a state that no longer fits
(damaged, other settings, a segment changed under it) is said in one line and rebuilt, never used.

The workload: messages interleaved over small segments (4 KiB), some delivered in a later segment than they
arrived in, some deferred then expired, some still queued at the end. The split points are enumerated: a
few records in, every quarter of the log, and one just before the end (the live segment grown by a few
records)."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

pytest.importorskip("pyspark")

from mtaq.core.frame import SEGMENT_HEADER_BYTES, decode_segment_header
from mtaq.core.records import DataRecord, DeliveryRecord, EnvelopeRecord, FinishRecord, Outcome, Recipient, StartRecord
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log

T0 = 1_740_870_000.0  # 2025-03-01T23:00:00Z
MESSAGES = 40


def _ops() -> list[tuple]:
    """The workload as a list of appends, in log order (each message's delivery 5 messages later)."""
    ops: list[tuple] = []
    for i in range(MESSAGES + 5):
        if i < MESSAGES:
            ops.append(("env", i))
        k = i - 5
        if 0 <= k < MESSAGES:
            ops.append(("deliver", k))
    return ops


def write_log(spool: str, snapshots: dict[int, str], t0: float = T0) -> None:
    """Write the workload (the first message at ``t0``) under ``spool/log``; after the op numbered ``n`` of
    ``snapshots``, copy the log directory as it is on disk (synced, the live segment unsealed) to
    ``snapshots[n]``."""
    log, _ = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=4096)
    body = b"Subject: t\r\n\r\n" + b"x" * 300 + b"\r\n"
    starts = {}
    for n, (op, i) in enumerate(_ops()):
        q = f"Q{i:014d}"
        arr = t0 + i * 600.0
        if op == "env":
            data, _ = log.append(DataRecord(q, body))
            rcpts = (Recipient(0, f"a{i % 3}@x.example"), Recipient(1, f"b@d{i % 2}.example"))
            e, _ = log.append(EnvelopeRecord(q, 0, arr, arr, f"s{i % 4}@a.example", rcpts, data, len(body)))
            starts[i], _ = log.append(StartRecord(q, e, arr + 1, 0))
        else:
            sp = starts[i]
            second = ("deferred", 451, "4.2.0") if i % 3 == 0 else ("delivered", 250, "2.0.0")
            log.append(DeliveryRecord(q, sp, arr + 30 + i, "mx[192.0.2.1]:25",
                                      (Outcome(0, "delivered", 250, "2.0.0", "ok"), Outcome(1, *second, "later"))))
            if i % 5:  # i % 5 == 0 stays queued
                log.append(FinishRecord(q, sp, arr + 40 + i))
        if n in snapshots:
            asyncio.run(log.sync())
            shutil.copytree(os.path.join(spool, "log"), os.path.join(snapshots[n], "log"))
    asyncio.run(log.sync())
    log.close()


SPLITS = (3, len(_ops()) // 4, len(_ops()) // 2, 3 * len(_ops()) // 4, len(_ops()) - 3)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("incremental")
    snaps = {n: str(base / f"snap-{n}") for n in SPLITS}
    write_log(str(base / "full"), snaps)
    return {"full": str(base / "full"), **snaps}


def _put(src: str, spool: str) -> None:
    """Make ``spool/log`` hold exactly the segment files of ``src/log`` (the same path every run)."""
    shutil.rmtree(os.path.join(spool, "log"), ignore_errors=True)
    shutil.copytree(os.path.join(src, "log"), os.path.join(spool, "log"))


def _run(spark, paths: list[str], out: str, state: str | None = None, since=None,
         tables: bool = True) -> tuple[dict, list[str]]:
    from mtaq.analytics.job import Options, analyze

    progress: list[str] = []
    res = analyze(spark, Options(paths=paths, out=out, top=5, partition_bytes=9000, plots=False, state=state,
                                 since=since, progress=progress.append))
    def text(rows) -> list[str]:  # the spools' own directories left out (the runs compared use others)
        return sorted(repr(r).replace(os.path.dirname(paths[0]), "DIR") for r in rows)

    got = {"totals": dict(res.totals), "tables": {k: text(rows) for k, rows in res.tables.items()},
           "parquet": {t: text(spark.read.parquet(f"{out}/tables/{t}").collect())
                       for t in ("outcomes", "messages", "senders", "recipients")} if tables else {},
           "note": res.state_note}
    return got, progress


def _same(ref: dict, got: dict) -> None:
    for part in ("totals", "tables", "parquet"):
        diffs = {k: (ref[part].get(k), got[part].get(k)) for k in set(ref[part]) | set(got[part])
                 if ref[part].get(k) != got[part].get(k)}
        assert {} == diffs, part


@pytest.fixture(scope="module")
def reference(spark, logs, tmp_path_factory) -> dict:
    spool = str(tmp_path_factory.mktemp("ref") / "spool")
    _put(logs["full"], spool)
    got, _ = _run(spark, [spool], str(tmp_path_factory.mktemp("ref-out")))
    return got


def _counts(progress: list[str]) -> tuple[int, int, int]:
    """(segments reused whole, segments whose tail alone was read, segments read whole) from the progress."""
    [line] = [m for m in progress if m.startswith("state ")]
    nums = [int(w) for w in line.split(": ", 1)[1].replace(",", " ").split() if w.isdigit()]
    return nums[0], nums[1], nums[2]


def _reused(progress: list[str]) -> int:
    return _counts(progress)[0]


@pytest.mark.parametrize("split", SPLITS)
def test_incremental_equals_full_at_every_split(spark, logs, reference, tmp_path, split):
    spool, state = str(tmp_path / "spool"), str(tmp_path / "state")
    _put(logs[split], spool)
    first, _ = _run(spark, [spool], str(tmp_path / "out1"), state=state, tables=False)
    assert first["note"] is None
    _put(logs["full"], spool)
    got, progress = _run(spark, [spool], str(tmp_path / "out2"), state=state)
    assert got["note"] is None
    _same(reference, got)
    if split >= len(_ops()) // 2:
        assert _reused(progress) > 0  # the sealed segments of the first run were not read again
    # the first run's live segment, read cleanly up to a frame, has grown: only its new bytes are read
    assert _counts(progress)[1] == 1


def test_a_live_segment_cut_inside_a_frame_is_read_again_whole(spark, logs, reference, tmp_path):
    spool, state = str(tmp_path / "spool"), str(tmp_path / "state")
    _put(logs[SPLITS[2]], spool)
    last = os.path.join(spool, "log", sorted(os.listdir(os.path.join(spool, "log")))[-1])
    with open(last, "r+b") as f:  # the last frame half written, as a crash or a read while appending leaves it
        f.truncate(os.path.getsize(last) - 7)
    first, _ = _run(spark, [spool], str(tmp_path / "out1"), state=state, tables=False)
    assert [r for r in first["tables"]["problems"] if "open-tail" in r]  # where the read stopped
    _put(logs["full"], spool)
    got, progress = _run(spark, [spool], str(tmp_path / "out2"), state=state)
    assert got["note"] is None
    _same(reference, got)
    reused, tails, whole = _counts(progress)
    assert tails == 0 and reused > 0 and whole > 0


def _age(spool: str, seconds: float) -> dict[str, int]:
    """Set every segment file's modification time ``seconds`` before now; returns path -> mtime_ns."""
    import time

    got = {}
    for name in os.listdir(os.path.join(spool, "log")):
        path = os.path.join(spool, "log", name)
        ns = time.time_ns() - int(seconds * 1e9)
        os.utime(path, ns=(ns, ns))
        got[path] = ns
    return got


def _overwrite_middle(path: str, mtime_ns: int) -> None:
    """Change bytes in the middle of ``path`` (size kept), then put its modification time back."""
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    data[mid : mid + 16] = b"\xff" * 16
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize("age_s", [3600, 0])
def test_segments_unchanged_since_the_last_listing_are_not_read_again(spark, logs, reference, tmp_path, age_s):
    # Listed with the same stored size and modification time, older than RACY_NS when the last run listed them
    # (age 3600 s): their fingerprints come from the state. Shown by changing a sealed segment's bytes behind
    # the state's back, the time put back: the run with state does not read it (a run without state would).
    # Modified just before that listing (age 0: git's racily clean file; a later change could keep the same
    # time): read again however its size and time look, and the change is said.
    spool, state = str(tmp_path / "spool"), str(tmp_path / "state")
    _put(logs["full"], spool)
    times = _age(spool, age_s)
    _run(spark, [spool], str(tmp_path / "out1"), state=state, tables=False)
    first = min(times)
    _overwrite_middle(first, times[first])
    got, progress = _run(spark, [spool], str(tmp_path / "out2"), state=state)
    if age_s:
        assert got["note"] is None
        assert _counts(progress) == (len(times), 0, 0)
        _same(reference, got)
    else:
        assert got["note"] is not None and "changed in its first" in got["note"], got["note"]
        full, _ = _run(spark, [spool], str(tmp_path / "out3"))
        _same(full, got)


def test_another_logs_segment_with_the_same_size_and_time_is_read(spark, tmp_path):
    # The same workload three days later: segments of the same sizes, other salts. Copied over the first
    # log's files with their times put back (cp -p, rsync -a, then a rename): the listing matches, the salt
    # that discover read from each header does not, so each is read and the tables are the new log's.
    # (Found by a review: the state trusted the path, size and time alone.)
    mine, other = str(tmp_path / "mine"), str(tmp_path / "other")
    write_log(mine, {})
    write_log(other, {}, t0=T0 + 3 * 86400)
    spool, state = str(tmp_path / "spool"), str(tmp_path / "state")
    _put(mine, spool)
    times = _age(spool, 3600)
    _run(spark, [spool], str(tmp_path / "out1"), state=state, tables=False)
    for path, ns in times.items():
        shutil.copyfile(os.path.join(other, "log", os.path.basename(path)), path + ".new")
        os.replace(path + ".new", path)
        os.utime(path, ns=(ns, ns))
    got, _ = _run(spark, [spool], str(tmp_path / "out2"), state=state)
    full, _ = _run(spark, [spool], str(tmp_path / "out3"))
    _same(full, got)


def test_a_segment_that_cannot_be_read_is_a_problem_row_with_state_too(spark, logs, tmp_path):
    # An archived segment whose compressed bytes are damaged: a run without state reports it (a PROBLEM row)
    # and goes on; so does a run with state, first and later (it was an exception in the state's check).
    import zstandard

    spool, state, archive = str(tmp_path / "spool"), str(tmp_path / "state"), str(tmp_path / "archive")
    os.makedirs(archive)
    _put(logs["full"], spool)
    src = os.path.join(spool, "log", sorted(os.listdir(os.path.join(spool, "log")))[0])
    data = open(src, "rb").read()
    h = decode_segment_header(data[:SEGMENT_HEADER_BYTES])
    packed = bytearray(zstandard.ZstdCompressor().compress(data))
    packed[:4] = bytes(b ^ 0xA5 for b in packed[:4])  # the zstd frame's magic
    with open(os.path.join(archive, f"{h.segment:012d}-{h.salt:08x}.seg.zst"), "wb") as f:
        f.write(packed)
    os.unlink(src)
    full, _ = _run(spark, [spool, archive], str(tmp_path / "out0"))
    assert [r for r in full["tables"]["problems"] if "unreadable" in r]
    for k in (1, 2):
        got, _ = _run(spark, [spool, archive], str(tmp_path / f"out{k}"), state=state)
        assert got["note"] is None
        _same(full, got)


def _first_run(spark, logs, tmp_path, split: int) -> tuple[str, str]:
    spool, state = str(tmp_path / "spool"), str(tmp_path / "state")
    _put(logs[split], spool)
    _run(spark, [spool], str(tmp_path / "out1"), state=state, tables=False)
    _put(logs["full"], spool)
    return spool, state


@pytest.mark.parametrize("damage", ["manifest", "manifest-digit", "file", "settings"])
def test_a_damaged_or_mismatched_state_is_said_and_rebuilt(spark, logs, reference, tmp_path, damage):
    import datetime as dt

    spool, state = _first_run(spark, logs, tmp_path, SPLITS[2])
    since = None
    if damage == "manifest":
        with open(os.path.join(state, "manifest.json"), "w") as f:
            f.write('{"format": 1, "partitions": [')
    elif damage == "manifest-digit":  # still JSON, still a manifest: one length one byte longer
        path = os.path.join(state, "manifest.json")
        text = open(path).read()
        at = text.index('"length": ') + len('"length": ')
        end = at + next(i for i, c in enumerate(text[at:]) if not c.isdigit())
        with open(path, "w") as f:
            f.write(text[:at] + str(int(text[at:end]) + 1) + text[end:])
    elif damage == "file":
        name = sorted(os.listdir(os.path.join(state, "files")))[0]
        path = os.path.join(state, "files", name)
        data = open(path, "rb").read()
        os.unlink(path)  # a hard link: a new file, not the stage's
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
    else:
        since = dt.datetime.fromtimestamp(T0 - 3600, dt.UTC)  # before everything: the same tables, other settings
    got, progress = _run(spark, [spool], str(tmp_path / "out2"), state=state, since=since)
    expect = {"manifest": "manifest.json unreadable", "manifest-digit": "manifest.json: its CRC-32 differs",
              "file": "files/", "settings": "made with other settings"}[damage]
    assert got["note"] is not None and got["note"].startswith(expect), got["note"]
    if since is None:
        _same(reference, got)
    # rebuilt: the next run uses it
    again, progress = _run(spark, [spool], str(tmp_path / "out3"), state=state, since=since)
    assert again["note"] is None
    assert len([n for n in os.listdir(os.path.join(spool, "log"))]) == _reused(progress)


def test_a_segment_changed_under_the_state_is_said_and_rebuilt(spark, logs, tmp_path):
    spool, state = _first_run(spark, logs, tmp_path, SPLITS[3])
    first = sorted(os.listdir(os.path.join(spool, "log")))[0]
    path = os.path.join(spool, "log", first)
    data = bytearray(open(path, "rb").read())
    data[SEGMENT_HEADER_BYTES + 20] ^= 0x40  # inside the first frame: a PROBLEM row in a full run
    with open(path, "wb") as f:
        f.write(data)
    got, _ = _run(spark, [spool], str(tmp_path / "out2"), state=state)
    assert got["note"] is not None and "changed in its first" in got["note"], got["note"]
    full, _ = _run(spark, [spool], str(tmp_path / "out3"))
    _same(full, got)
    assert full["totals"]["problems"] > 0


def test_segments_archived_and_reclaimed_between_runs(spark, logs, tmp_path):
    spool, state = str(tmp_path / "spool"), str(tmp_path / "state")
    archive = str(tmp_path / "archive")
    os.makedirs(archive)
    _put(logs[SPLITS[3]], spool)
    _run(spark, [spool], str(tmp_path / "out1"), state=state, tables=False)
    _put(logs["full"], spool)
    names = sorted(os.listdir(os.path.join(spool, "log")))
    for name in names[:3]:  # archived under the archive's name (number and salt)
        src = os.path.join(spool, "log", name)
        with open(src, "rb") as f:
            h = decode_segment_header(f.read(SEGMENT_HEADER_BYTES))
        shutil.move(src, os.path.join(archive, f"{h.segment:012d}-{h.salt:08x}.seg"))
    os.unlink(os.path.join(spool, "log", names[4]))  # reclaimed, not archived
    got, progress = _run(spark, [spool, archive], str(tmp_path / "out2"), state=state)
    assert got["note"] is None
    assert _reused(progress) > 0
    full, _ = _run(spark, [spool, archive], str(tmp_path / "out3"))
    _same(full, got)
