"""The merge of the open messages on the driver against Spark's (datasource.stage_open, in both), on a log
made to be awkward: messages spread over many small partitions, a message whose first envelope is not in the
log (first_seen false), outcomes of a message with no envelope, negative and zero delays, expired and still
queued recipients, a domain literally named '?', an address without a domain, delays microseconds apart (one
percentile bucket, read back by Spark), with and without a --since/--until window. Written by a reviewer of
the driver merge; it fails when first_seen is taken as always true."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import random

import pytest

pytest.importorskip("pyspark")

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

T0 = 1_740_870_000.0  # 2025-03-01T23:00:00Z


def write_log(spool: str) -> None:
    log, _ = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=4096)
    body = b"Subject: t\r\n\r\n" + b"x" * 200 + b"\r\n"

    def env(qid, gen, arr, rcpts, sender="s@a.example", bounce_of=""):
        data, _ = log.append(DataRecord(qid, body))
        p, _ = log.append(EnvelopeRecord(qid, gen, arr, arr, sender, tuple(Recipient(i, a) for i, a in enumerate(rcpts)),
                                         data, len(body), bounce_of=bounce_of))
        return p

    def start(qid, envp, ts):
        p, _ = log.append(StartRecord(qid, envp, ts, 0))
        return p

    def deliver(qid, sp, ts, outs):
        log.append(DeliveryRecord(qid, sp, ts, "mx[192.0.2.1]:25",
                                  tuple(Outcome(i, st, code, enh, "txt") for i, st, code, enh in outs)))

    def finish(qid, sp, ts):
        log.append(FinishRecord(qid, sp, ts))

    rcpts = ["a@x.example", "b@?", "NoDomain", "c@y.example"]
    # many messages, microsecond-distinct delays in one bucket, spread over segments (interleaved)
    pending = []
    for i in range(120):
        q = f"Q{i:014d}"
        arr = T0 + i * 97.0
        e = env(q, 0, arr, [rcpts[i % 4], rcpts[(i + 1) % 4]])
        s = start(q, e, arr + 0.1)
        pending.append((q, e, s, arr))
        if len(pending) > 6:
            q2, _, s2, arr2 = pending.pop(0)
            k = int(q2[1:])
            d1 = 0.2 + k * 1e-6 if k % 3 else (-5.0 if k % 7 == 0 else 3600.0 * (k % 5))
            deliver(q2, s2, arr2 + d1, [(0, "delivered", 250, "2.0.0"),
                                        (1, "deferred" if k % 4 == 0 else "delivered", 451 if k % 4 == 0 else 250, "4.0.0")])
            # k % 4 == 0: the second recipient deferred, then the FINISH: expired
            if k % 10:  # k % 10 == 0 stays queued
                finish(q2, s2, arr2 + d1 + 1)
    # a message whose first envelope is not in the log (generation 1 only)
    e = env("QGEN1ONLY00000", 1, T0 + 50, ["g@x.example"])
    s = start("QGEN1ONLY00000", e, T0 + 60)
    deliver("QGEN1ONLY00000", s, T0 + 70, [(0, "delivered", 250, "2.0.0")])
    finish("QGEN1ONLY00000", s, T0 + 71)
    # outcomes of a message with no envelope in the log
    deliver("QNOENVELOPE000", Pos(0, 0), T0 + 80, [(0, "delivered", 250, "2.0.0"), (1, "deferred", 451, "4.0.0")])
    finish("QNOENVELOPE000", Pos(0, 0), T0 + 90)
    # negative delay, exactly zero delay
    e = env("QNEGATIVE00000", 0, T0 + 1000, ["n@x.example", "z@x.example"])
    s = start("QNEGATIVE00000", e, T0 + 1000)
    deliver("QNEGATIVE00000", s, T0 + 990, [(0, "delivered", 250, "2.0.0")])
    deliver("QNEGATIVE00000", s, T0 + 1000, [(1, "delivered", 250, "2.0.0")])
    for q, _, s, arr in pending:  # the last few: still queued, one deferral
        deliver(q, s, arr + 10, [(0, "deferred", 451, "4.0.0")])
    asyncio.run(log.sync())
    log.close()


@pytest.fixture(scope="module")
def spool(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("merges") / "spool")
    write_log(d)
    return d


def _comparable(res) -> dict:
    return {"totals": dict(res.totals), "tables": {k: sorted(map(repr, rows)) for k, rows in res.tables.items()}}


@pytest.mark.parametrize("window", [None, (T0 + 1800, T0 + 7200)])
def test_the_driver_merge_equals_sparks_on_an_awkward_log(spark, spool, tmp_path, window):
    from mtaq.analytics.job import Options, analyze

    since, until = (None, None) if window is None else (dt.datetime.fromtimestamp(w, dt.UTC) for w in window)

    def run(close: bool, driver: int) -> dict:
        out = str(tmp_path / f"{close}-{driver}")
        progress: list[str] = []
        res = analyze(spark, Options(paths=[spool], out=out, top=5, partition_bytes=9000, since=since, until=until,
                                     plots=False, close_messages=close, driver_merge_rows=driver,
                                     driver_table_rows=driver, progress=progress.append))
        got = _comparable(res)
        got["parquet"] = {t: sorted(map(repr, spark.read.parquet(f"{out}/tables/{t}").collect()))
                          for t in ("outcomes", "messages", "senders", "recipients")}
        got["by"] = [m for m in progress if m.startswith("per message")]
        got["tables_by"] = [m for m in progress if m.startswith("senders and recipients added up")]
        return got

    runs = {(c, d): run(c, d) for c in (True, False) for d in (0, 100_000)}
    for (_, driver), v in runs.items():  # each merge ran where the limit says
        assert [m.rsplit(" ", 1)[-1] for m in v.pop("by")] == ["Spark" if driver == 0 else "driver"]
        [by] = v.pop("tables_by")
        assert ("by Spark" if driver == 0 else "on the driver") in by
    ref = runs[(False, 0)]
    for k, v in runs.items():
        for part in ("totals", "tables", "parquet"):
            if v[part] != ref[part]:
                diffs = {x: (ref[part].get(x), v[part].get(x)) for x in set(ref[part]) | set(v[part])
                         if ref[part].get(x) != v[part].get(x)}
                raise AssertionError(f"{k} {part}: {diffs}")
    if window is None:
        from mtaq.analytics.plain import plain_totals
        plain = plain_totals([spool])
        keys = ("delivered", "deferrals", "delay_p50_s", "delay_p90_s", "delay_p99_s")
        assert {k: ref["totals"][k] for k in keys} == pytest.approx({k: plain[k] for k in keys}, abs=1e-6)


def test_percentile_read_back_with_negative_delays_repeats_and_odd_domains(spark, tmp_path):
    """The read-back of a bucket's values, by Spark and by the driver from the outcomes files (one a task),
    with negative delays, exact repeats, a domain named '?' and a null one (also '?'), in four task splits:
    equal to the plain nearest rank. Outcomes not delivered, in the files among them, are not counted."""
    from test_analytics_percentiles import outcome_table

    from mtaq.analytics.partials import encode, locate_percentiles, merge, partials
    from mtaq.analytics.percentiles import PERCENTILES, find_percentiles
    from mtaq.analytics.plain import nearest_rank

    rnd = random.Random(11)
    choices = [lambda: -rnd.randrange(1, 400), lambda: -200_000 - rnd.randrange(300), lambda: 0,
               lambda: 1_000_000 + rnd.randrange(30_000), lambda: 7, lambda: rnd.randrange(10**11)]
    rows = [(rnd.choice(["?", None, "a.example"]), rnd.choice(choices)(), rnd.randrange(4)) for _ in range(4000)]
    parts = [p for g in range(4) for p in encode(partials(outcome_table([r for r in rows if r[2] == g]), None, None, None))]
    p_bucket = merge(parts)["p_bucket"]
    assert locate_percentiles(p_bucket, PERCENTILES)[1]
    delays = spark.createDataFrame([(d or "?", us / 1e6) for d, us, _ in rows], "domain string, delay_s double")
    got = {r["domain"]: r["p"] for r in find_percentiles(p_bucket, delays)}
    want = {None: [nearest_rank(sorted(us / 1e6 for _, us, _ in rows), p) for p in PERCENTILES]}
    for dom in ("a.example", "?"):
        want[dom] = [nearest_rank(sorted(us / 1e6 for d, us, _ in rows if (d or "?") == dom), p) for p in PERCENTILES]
    assert got == want
    # the driver's read-back, from files as the tasks stage them (OUTCOME_COLUMNS), deferred outcomes among them
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from mtaq.analytics.facts import OUTCOME_COLUMNS

    paths = []
    for g in range(4):
        t = outcome_table([r for r in rows if r[2] == g] + [(None, 5_000, g), ("a.example", -250_000, g)])
        n = t.num_rows
        t = t.set_column(t.schema.get_field_index("status"), "status",
                         pa.array(["delivered"] * (n - 2) + ["deferred"] * 2))
        paths.append(str(tmp_path / f"outcomes-{g}.parquet"))
        pq.write_table(t.select(list(OUTCOME_COLUMNS)), paths[-1])
    assert pc.sum(pc.equal(pq.read_table(paths[0])["status"], "deferred")).as_py() == 2

    def spark_must_not(*_a):
        raise AssertionError("the driver's read-back was to be used")

    assert want == {r["domain"]: r["p"] for r in find_percentiles(p_bucket, spark_must_not, outcome_paths=paths,
                                                              driver_rows=len(rows))}
    called = []

    def by_spark():
        called.append(True)
        return delays

    # more distinct values in the buckets than the driver may hold: Spark's turn, midway, with the same result
    assert want == {r["domain"]: r["p"] for r in find_percentiles(p_bucket, by_spark, outcome_paths=paths, driver_rows=5)}
    assert called == [True]
