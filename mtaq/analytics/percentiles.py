"""Exact nearest-rank percentiles of the time to deliver from the tasks' delay buckets (issue 17; issue 38,
item 5: the job split by concern). The buckets locate each wanted rank (:func:`mtaq.analytics.partials.
locate_percentiles`); only where a rank falls inside a bucket of several values are those values read back:
from the staged outcomes files on the driver (the definition: up to ``driver_rows`` values), else by a Spark
query over the same files; the tests check the two against each other and against the plain nearest rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from mtaq.analytics.partials import RankTarget, locate_percentiles, merge_tables, merge_threads, rank_value
from mtaq.analytics.staging import read_staged

__all__ = ["PERCENTILES", "find_percentiles", "merge_p_bucket", "read_back_files", "read_back_spark"]


PERCENTILES = (0.5, 0.9, 0.99)


def find_percentiles(p_bucket: pa.Table, delays: DataFrame | Callable[[], DataFrame], outcome_paths: Sequence[str] | None = None,
                 driver_rows: int = 0) -> list[dict[str, Any]]:
    """Exact nearest-rank PERCENTILES of the time to deliver, for all recipients and per recipient domain, as
    rows {domain, g_domain (true for all recipients), p: [values]}: located in the merged ``p_bucket`` partial
    (:func:`mtaq.analytics.partials.locate_percentiles`); where a bucket holds several values and the rank
    falls inside it, that bucket's values and counts are read back and the rank is counted off among them:
    from the staged outcomes files ``outcome_paths`` by the driver (pyarrow) when they are given and the
    buckets to read hold at most ``driver_rows`` distinct (domain, value) pairs, else from ``delays``
    (columns domain, delay_s: the delivered outcomes of the window; or a function that makes it, called only
    then) by one Spark query."""
    found, todo = locate_percentiles(p_bucket, PERCENTILES)
    if todo:
        values = None if outcome_paths is None else read_back_files(todo, outcome_paths, driver_rows)
        if values is None:
            values = read_back_spark(todo, delays if isinstance(delays, DataFrame) else delays())
        for i, t in enumerate(todo):
            found[t.domain][t.p] = rank_value(t, values.get(i, []))
    return [{"domain": d, "g_domain": d is None, "p": p} for d, p in found.items()]


def read_back_spark(todo: Sequence[RankTarget], delays: DataFrame) -> dict[int, list[tuple[float, int]]]:
    """The values of each target's bucket with their counts, {target number: [(delay_s, count)]}, by Spark
    from ``delays`` (columns domain, delay_s)."""
    spark = delays.sparkSession
    targets = spark.createDataFrame([(i, t.domain, t.lo, t.hi) for i, t in enumerate(todo)],
                                    "tid int, t_domain string, lo double, hi double")
    by_domain = delays.join(F.broadcast(targets.filter(F.col("t_domain").isNotNull())),
                            F.col("domain") == F.col("t_domain"))
    every = delays.crossJoin(F.broadcast(targets.filter(F.col("t_domain").isNull())))
    rows = (by_domain.unionByName(every).filter(F.col("delay_s").between(F.col("lo"), F.col("hi")))
            .groupBy("tid", "delay_s").count().toArrow().to_pylist())
    values: dict[int, list[tuple[float, int]]] = {}
    for r in rows:
        values.setdefault(r["tid"], []).append((r["delay_s"], r["count"]))
    return values


def read_back_files(todo: Sequence[RankTarget], paths: Sequence[str],
                     limit: int) -> dict[int, list[tuple[float, int]]] | None:
    """:func:`read_back_spark` by the driver from the staged outcomes files ``paths`` (OUTCOME_COLUMNS, the
    outcomes of the window): a few files at a time (:func:`mtaq.analytics.partials.merge_threads`, each on a
    thread of its own), the delivered rows with a delay in some target's range, counted by (domain, delay);
    then each target's values cut out of those counts (numpy, sorted). None (Spark's turn) as soon as the
    counts hold more than ``limit`` distinct (domain, delay) pairs: the driver holds at most that many, and
    the rows and counts of those few files."""
    import numpy as np

    ranges = sorted((t.lo, t.hi) for t in todo)
    starts, ends = [ranges[0][0]], [ranges[0][1]]
    for lo, hi in ranges[1:]:  # the targets' ranges, overlapping ones joined
        if lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    lo_a, hi_a = np.asarray(starts), np.asarray(ends)
    wanted = [("status", "=", "delivered"), ("delay_s", ">=", starts[0]), ("delay_s", "<=", max(ends))]
    counted: list[pa.Table] = []

    def count(path: str) -> pa.Table:
        got = read_staged(path, columns=["rcpt_domain", "delay_s"], filters=wanted)
        d = np.asarray(got["delay_s"].to_numpy(zero_copy_only=False), dtype=np.float64)
        i = np.searchsorted(lo_a, d, side="right") - 1
        keep = (i >= 0) & (d <= hi_a[np.maximum(i, 0)])
        got = pa.table({"domain": pc.fill_null(got["rcpt_domain"], "?"), "delay_s": got["delay_s"]}).filter(pa.array(keep))
        return (got.group_by(["domain", "delay_s"], use_threads=False).aggregate([([], "count_all")])
                .rename_columns(["domain", "delay_s", "n"]))

    threads = merge_threads()  # the files are read and counted a few at a time, each on a thread of its own
    for at in range(0, len(paths), threads):
        with ThreadPoolExecutor(threads) as pool:
            counted += [x for x in pool.map(count, paths[at:at + threads]) if x.num_rows]
        if sum(x.num_rows for x in counted) > limit:
            counted = [pa.concat_tables(counted).group_by(["domain", "delay_s"], use_threads=False).aggregate(
                [("n", "sum")]).rename_columns(["domain", "delay_s", "n"])]
            if counted[0].num_rows > limit:
                return None
    if not counted:
        return {}
    t = pa.concat_tables(counted).group_by(["domain", "delay_s"], use_threads=False).aggregate([("n", "sum")])
    t = t.rename_columns(["domain", "delay_s", "n"])

    def cut(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        table = table.group_by("delay_s", use_threads=False).aggregate([("n", "sum")]).sort_by("delay_s")
        return (np.asarray(table["delay_s"].to_numpy(zero_copy_only=False), dtype=np.float64),
                np.asarray(table["n_sum"].to_numpy(zero_copy_only=False), dtype=np.int64))

    by_domain: dict[str | None, tuple[np.ndarray, np.ndarray]] = {}
    if any(x.domain is None for x in todo):
        by_domain[None] = cut(t)
    named = sorted({x.domain for x in todo if x.domain is not None})
    if named:
        mine = t.filter(pc.is_in(t["domain"], value_set=pa.array(named, pa.string()))).sort_by("domain")
        dom = mine["domain"].to_pylist()
        edges = np.searchsorted(np.asarray(dom, dtype=object), np.asarray(named, dtype=object), side="left").tolist()
        ends_at = np.searchsorted(np.asarray(dom, dtype=object), np.asarray(named, dtype=object), side="right").tolist()
        for name, a, b in zip(named, edges, ends_at, strict=True):
            by_domain[name] = cut(mine.slice(a, b - a))
    values: dict[int, list[tuple[float, int]]] = {}
    for k, x in enumerate(todo):
        v, c = by_domain[x.domain]
        a, b = np.searchsorted(v, x.lo, side="left"), np.searchsorted(v, x.hi, side="right")
        values[k] = list(zip(v[a:b].tolist(), c[a:b].tolist(), strict=True))
    return values


P_BUCKET_MERGE_FILES = 32  # files of the tasks' percentile buckets read before they are merged


def merge_p_bucket(paths: Sequence[str], tables: Sequence[pa.Table]) -> pa.Table:
    """The ``p_bucket`` partial tables in the staged files ``paths`` and in ``tables``, added up
    (:func:`mtaq.analytics.partials.merge`), read and merged P_BUCKET_MERGE_FILES at a time."""
    merged = merge_tables("p_bucket", [t for t in tables if t.num_rows])
    for i in range(0, len(paths), P_BUCKET_MERGE_FILES):
        read = [read_staged(path) for path in paths[i : i + P_BUCKET_MERGE_FILES]]
        merged = merge_tables("p_bucket", [t for t in (merged, *read) if t.num_rows])
    return merged
