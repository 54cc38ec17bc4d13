"""The fast reader of the analytics source (frame walk + bulk decode into Arrow columns) against the codec.

Segments are written by the daemon's own :class:`mtaq.storage.log.Log` with every kind of record the job
reads (replacement envelopes, outcome-unknown recipients, DSNs, odd addresses, several outcomes per
delivery) and rolled over every few KiB. The fast path must yield exactly the rows that
:func:`mtaq.core.frame.scan_segment` gives (``batches(..., fast=False)``), and any damage must send the
segment to scan_segment, whose tail rules decide: same PROBLEM rows, same good records kept.
No Spark here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

pytest.importorskip("pyarrow")

from mtaq.analytics.source import batches, discover, read_segment, read_segment_bytes
from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    StartRecord,
)
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log

T0 = 1_740_787_200.123456  # 2025-03-01T00:00:00.123456Z: fractions of a microsecond are rounded as Python does


def write_spool(spool: str, messages: int = 300, segment_bytes: int = 8192) -> None:
    log, _ = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=segment_bytes)
    addresses = ["a@X.Example", "b@y.example", "NoDomain", "c@ü.example", "d@e@F.example", "", "e@z.example"]
    for i in range(messages):
        qid = f"Q{i:014d}"
        now = T0 + i * 7.3 + 1e-7 * i
        body = b"Subject: t\r\n\r\n" + b"MQ" * (i % 50) + b"\r\n"
        rcpts = tuple(Recipient(k, addresses[(i + k) % len(addresses)]) for k in range(1 + i % 3))
        data, _ = log.append(DataRecord(qid, body))
        env = EnvelopeRecord(qid, 0, now, now, addresses[i % len(addresses)], rcpts, data, len(body),
                             client="192.0.2.1", helo="h.example", bounce_of="Q0" if i % 17 == 0 else "")
        env_pos, _ = log.append(env)
        start, _ = log.append(StartRecord(qid, env_pos, now + 0.5, 0))
        outs = tuple(Outcome(r.index, ("delivered", "deferred", "failed")[(i + r.index) % 3], 250, "2.0.0", "ok | x")
                     for r in rcpts)
        log.append(DeliveryRecord(qid, start, now + 0.25, "mx[192.0.2.25]:25", outs, remote_dsn=i % 2 == 0))
        if i % 4 == 0:
            data, _ = log.append(DataRecord(qid, body))
            again = tuple(Recipient(r.index, r.address, last_reply="451 later", unknown=i % 8 == 0) for r in rcpts)
            log.append(EnvelopeRecord(qid, 1, now, now + 1800, env.sender, again, data, len(body), attempts=1,
                                      replaces=start, runner=1))
        else:
            log.append(FinishRecord(qid, start, now + 0.75))
    asyncio.run(log.sync())
    log.close()


def rows(paths: list[str], fast: bool) -> list[dict]:
    out = [r for b in batches(discover(paths), fast=fast) for r in b.to_pylist()]
    return sorted(out, key=lambda r: (r["segment"], r["record_type"], r["offset"], r["rcpt_index"] or 0))


@pytest.fixture(scope="module")
def spool(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("fast") / "spool")
    write_spool(path)
    return path


def test_fast_path_takes_clean_segments(spool):
    """Every segment the log wrote (sealed ones and the open last one) is clean: the fast path reads it."""
    files = discover([spool])
    assert len(files) > 5
    assert all(read_segment(f.segment, read_segment_bytes(f)).fast for f in files)


def test_fast_rows_equal_the_codecs_rows(spool):
    """Row for row, column for column (times, domains, links, the SEGMENT rows), fast == scan_segment."""
    fast, slow = rows([spool], True), rows([spool], False)
    assert len(fast) > 1000
    assert slow == fast
    doms = {r["rcpt_address"]: r["rcpt_domain"] for r in fast if r["record_type"] == "ENVELOPE"}
    assert {"a@X.Example": "x.example", "NoDomain": "", "c@ü.example": "ü.example", "d@e@F.example": "f.example",
            "": ""} == {k: v for k, v in doms.items() if k in ("a@X.Example", "NoDomain", "c@ü.example", "d@e@F.example", "")}


@pytest.mark.parametrize("damage", ["flip-in-data", "flip-in-envelope", "cut-tail", "after-seal", "bad-header"])
def test_damage_goes_to_the_codecs_tail_rules(spool, tmp_path, damage):
    """A damaged copy of a sealed segment: the fast reader gives up and the rows, PROBLEM rows included, are
    scan_segment's: the damage is named, every good record after it is kept."""
    f = discover([spool])[1]
    raw = bytearray(read_segment_bytes(f))
    first = next(r for r in rows([f.path], False) if r["record_type"] == "ENVELOPE")["offset"]
    if damage == "flip-in-data":
        raw[32 + 12 + 5] ^= 0x40  # the first frame is a DATA: its payload
    elif damage == "flip-in-envelope":
        raw[first + 20] ^= 0x01
    elif damage == "cut-tail":
        raw = raw[: len(raw) - 30]
    elif damage == "after-seal":
        raw += raw[32:200]
    else:
        raw[3] ^= 0xFF
    bad = tmp_path / os.path.basename(f.path)
    bad.write_bytes(bytes(raw))
    assert not read_segment(f.segment, bytes(raw)).fast
    fast, slow = rows([str(bad)], True), rows([str(bad)], False)
    assert slow == fast
    assert [r for r in fast if r["record_type"] == "PROBLEM"]


def test_a_record_that_does_not_decode_is_named_by_the_codec(tmp_path):
    """A frame with a good checksum whose payload is not a valid record: bulk decoding fails, scan_segment
    reports that one record as corrupt and keeps the others."""
    from mtaq.core.frame import SEGMENT_HEADER_BYTES, SegmentHeader, encode_frame, encode_record, encode_segment_header

    salt = 0x1234ABCD
    good = StartRecord("Q1", Pos(1, 32), T0, 0)
    buf = encode_segment_header(SegmentHeader(segment=1, salt=salt, created=int(T0)))
    buf += encode_record(good, salt)
    bad_at = len(buf)
    buf += encode_frame(3, b"\x93\x03\xa1x\xc0", salt)  # a START without its fields
    buf += encode_record(FinishRecord("Q1", Pos(1, SEGMENT_HEADER_BYTES), T0 + 1), salt)
    path = tmp_path / "000000000001.seg"
    path.write_bytes(buf)
    got = rows([str(path)], True)
    assert got == rows([str(path)], False)
    assert [("PROBLEM", bad_at, "corrupt")] == [(r["record_type"], r["offset"], r["problem_kind"]) for r in got
                                                 if r["record_type"] == "PROBLEM"]
    assert {"START", "FINISH", "SEGMENT", "PROBLEM"} == {r["record_type"] for r in got}


@pytest.mark.parametrize("mixed", [False, True])
def test_domains_by_arrow_equal_pythons(mixed):
    """Domains of an all-ASCII column come from Arrow kernels, of any other from Python: both as _domain says
    (after the last @, lower case, '' without one; control characters and a trailing newline kept)."""
    import pyarrow as pa

    from mtaq.analytics.source import _domain, _domains

    addresses = ["a@B.Example", "NoAt", "", "a@b@C.COM", "@", "a@", "x\n@y\n@Z.Org", "q@r.example\n", "A@\tB.c"]
    if mixed:
        addresses += ["Ü@Ä.de", "q@MÜNCHEN.de", "i@İ.example"]
    assert _domains(pa.array(addresses, pa.string())).to_pylist() == [_domain(a) for a in addresses]


def test_a_damaged_header_after_many_like_it_is_caught(spool, tmp_path):
    """The walk checks each distinct frame header once per segment: a bit flipped in any of the 12 header
    bytes of a later frame whose like came before (a START, same type and length) still sends the segment to
    scan_segment, and the rows are the codec's."""
    import random

    f = discover([spool])[2]
    clean = read_segment_bytes(f)
    starts = [r["offset"] for r in rows([f.path], False) if r["record_type"] == "START"]
    assert len(starts) >= 2
    rnd = random.Random(5)
    for _ in range(12):
        raw = bytearray(clean)
        at = starts[-1] + rnd.randrange(12)
        raw[at] ^= 1 << rnd.randrange(8)
        assert not read_segment(f.segment, bytes(raw)).fast, at
        bad = tmp_path / os.path.basename(f.path)
        bad.write_bytes(bytes(raw))
        fast, slow = rows([str(bad)], True), rows([str(bad)], False)
        assert slow == fast
        assert [r for r in fast if r["record_type"] == "PROBLEM"]


def test_two_logs_with_the_same_segment_numbers_stage_every_fact(tmp_path):
    """Worker shards (or two hosts) number their segments alike: each partition's staged file is its own, so
    the facts of both logs are all there (review: the files of one shard overwrote the other's)."""
    import pyarrow.parquet as pq

    from mtaq.analytics.datasource import stage_facts
    from mtaq.analytics.facts import fact_batches
    from mtaq.analytics.partials import FILE_PARTS
    from mtaq.analytics.source import plan_partitions

    shards = [str(tmp_path / f"shard-{k}") for k in (0, 1)]
    for s in shards:
        write_spool(s, messages=120)
    files = discover(shards)
    assert len({f.segment for f in files}) < len(files)  # the same numbers in both
    stage = str(tmp_path / "stage" / "_facts-x")
    got = [r[:3] for group in plan_partitions(files, 1) for r in stage_facts(group, stage, None, True) if r[1]
           and r[0] not in FILE_PARTS]  # the percentile buckets, senders, recipients: partial tables, not facts
    assert len({path for _, path, _ in got}) == len(got) >= 2 * len(files)
    assert sorted(t for t, _, _ in got if t in ("facts", "messages")) == sorted(len(files) * ["facts", "messages"])
    want = sum(b.num_rows for f in files for b in fact_batches([f]))
    assert sum(n for _, _, n in got) == want == sum(pq.read_table(path).num_rows for _, path, _ in got)


def test_a_spool_of_several_workers_is_read_whole(tmp_path):
    """A spool written by several workers (the default, workers = "auto") keeps shard 0 in SPOOL/log and shard k
    in SPOOL/shard-k/log: naming the spool reads every shard (real input: `make run` plus swaks gave one of
    three messages), and nothing else in the spool looks like a shard."""
    from mtaq.analytics.plain import plain_totals

    spool = tmp_path / "spool"
    write_spool(str(spool), messages=40)
    write_spool(str(spool / "shard-1"), messages=30)
    write_spool(str(spool / "shard-2"), messages=20)
    (spool / "shard-x" / "log").mkdir(parents=True)  # not a shard
    (spool / "sink" / "log").mkdir(parents=True)  # nor this
    files = discover([str(spool)])
    want = {os.path.dirname(f.path) for f in files}
    assert want == {str(spool / "log"), str(spool / "shard-1" / "log"), str(spool / "shard-2" / "log")}
    each = [plain_totals([str(p)])["received"] for p in (spool / "log", spool / "shard-1" / "log", spool / "shard-2" / "log")]
    assert plain_totals([str(spool)])["received"] == sum(each) > 0


def test_stage_paths_keep_a_uris_query_at_the_end():
    """The stage directory goes into the path of a URI (its query string stays last), and a relative --out is
    made absolute so that an executor in another working directory writes where the driver reads."""
    from mtaq.analytics.source import join_path, resolve

    uri = join_path("s3a://bucket/tables?region=us-east-1&endpoint_override=127.0.0.1:9", "_facts-1")
    assert uri == "s3a://bucket/tables/_facts-1?region=us-east-1&endpoint_override=127.0.0.1:9"
    assert resolve(uri)[1] == "bucket/tables/_facts-1"
    assert join_path("out/tables/", "_facts-1") == os.path.join(os.getcwd(), "out", "tables", "_facts-1")


def test_the_tasks_allocate_with_the_c_librarys_allocator(spark, tmp_path):
    """Each Spark task of the job (stage_indexed, as `mtaq analyze` runs it) allocates its Arrow memory from the
    C library's allocator: in a worker forked from Spark's daemon, Arrow's default (mimalloc) made each worker's
    first task about 0.6 s slower (docs/performance.md, "Stop 50"). The staged rows are the same either way."""
    from functools import partial

    from mtaq.analytics.datasource import stage_indexed

    spool = str(tmp_path / "spool")
    write_spool(spool, messages=40)
    groups = list(enumerate([[f] for f in discover([spool])]))

    def task(it, stage):
        import pyarrow as pa

        rows = list(stage_indexed(it, stage=stage, until_us=None, close=True))
        yield pa.default_memory_pool().backend_name, sum(1 for r in rows if r[1] == "messages")

    got = spark.sparkContext.parallelize(groups, len(groups)).mapPartitions(
        partial(task, stage=str(tmp_path / "stage"))).collect()
    assert {pool for pool, _ in got} == {"system"} and len(got) == len(groups)
    assert sum(n for _, n in got) == len(groups)  # one messages file a group


def test_every_task_function_switches_the_pool_unless_the_environment_names_one(tmp_path, monkeypatch):
    """The four task functions Spark runs (the RDD's stage_indexed and stage_partitions, the merge's
    stage_open_rows, the data source's read) make the C library's allocator the default before any work, and
    leave a pool named in ARROW_DEFAULT_MEMORY_POOL alone."""
    import pyarrow as pa

    from mtaq.analytics.datasource import MtaqReader, SegmentPartition, stage_indexed, stage_open_rows, stage_partitions

    spool = str(tmp_path / "spool")
    write_spool(spool, messages=5)
    files = discover([spool])
    stage = str(tmp_path / "stage")
    reader = MtaqReader({"path": spool, "rows": "staged", "stage": stage})
    runs = {
        "stage_indexed": lambda: list(stage_indexed([(0, files)], stage, None, True)),
        "stage_partitions": lambda: list(stage_partitions([files], stage, None, True)),
        "stage_open_rows": lambda: list(stage_open_rows(iter([]), ["record_type"], stage, None, None, None)),
        "read": lambda: list(reader.read(SegmentPartition(files))),
    }
    saved = pa.default_memory_pool()
    try:
        monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
        for name, run in runs.items():
            pa.set_memory_pool(pa.jemalloc_memory_pool())
            run()
            assert (name, pa.default_memory_pool().backend_name) == (name, "system")
        monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
        for name, run in runs.items():
            pa.set_memory_pool(pa.jemalloc_memory_pool())
            run()
            assert (name, pa.default_memory_pool().backend_name) == (name, "jemalloc")
    finally:
        pa.set_memory_pool(saved)


def test_the_program_ends_with_exit_handlers_run_and_a_closed_stdout(tmp_path):
    """`mtaq analyze` as a program ends without the interpreter's teardown (os._exit), but after the exit
    handlers: PySpark's profiler dumps its profiles from one (review: they were lost). Started with its
    standard output closed, it still exits 0 (review: flushing the missing stream made it exit 1)."""
    spool = str(tmp_path / "spool")
    write_spool(spool, messages=20)
    dump = tmp_path / "profiles"
    p = subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", spool, "--out", str(tmp_path / "o"),
                        "--master", "local[1]", "--no-plots", "--quiet", "--json", "--conf", "spark.python.profile=true",
                        "--conf", f"spark.python.profile.dump={dump}"],
                       stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert 0 == p.returncode, p.stderr[-3000:]
    assert (tmp_path / "o" / "report.md").exists()
    assert [f for f in os.listdir(dump) if f.endswith(".pstats")]
