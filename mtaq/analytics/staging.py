"""The job's Parquet files (issue 38, item 5: the job split by concern): the stage directory the tasks write
(``BIG/_facts-RANDOM``) read back and its partial tables added up on the driver, the staged messages and
outcomes moved into their tables, the small tables and the driver's tables written, the stage removed. Paths
are local paths or URIs (:func:`mtaq.analytics.source.resolve`); timestamps INT64 microseconds, UTC."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs
from pyspark.sql import DataFrame, SparkSession

from mtaq.analytics.facts import FACT_SCHEMA
from mtaq.analytics.partials import merge_tables
from mtaq.analytics.source import join_path, resolve
from mtaq.analytics.tables import AGE_BUCKETS_MIN, bucket_labels

__all__ = ["KEYED", "RECIPIENT_SCHEMA", "SENDER_SCHEMA", "ddl", "merge_staged", "publish", "pylist", "read_open_rows",
           "read_spark", "read_staged", "remove_stage", "small_schemas", "top_rows", "write_small", "write_table"]


KEYED = ("ENVELOPE", "START", "DELIVERY", "FINISH")  # the record rows of a message the job merges later


# The senders and recipients tables (counts never null, as Spark's count() writes them)
SENDER_SCHEMA = pa.schema([("sender", pa.string()), ("sender_domain", pa.string()),
                           pa.field("messages", pa.int64(), nullable=False), ("bytes", pa.int64())])
RECIPIENT_SCHEMA = pa.schema([("rcpt_address", pa.string()), ("rcpt_domain", pa.string()),
                              pa.field("delivered", pa.int64(), nullable=False), ("bytes", pa.int64())])


def ddl(schema: pa.Schema) -> str:
    """Spark's DDL of a schema of string and int64 columns."""
    return ", ".join(f"{f.name} {'bigint' if f.type == pa.int64() else 'string'}" for f in schema)


STAGED_MERGE_ROWS = 4_000_000  # partial rows read (with the sum so far) before they are added up


def merge_staged(name: str, paths: Sequence[str], schema: pa.Schema) -> pa.Table:
    """The partial tables of the part ``name`` in the staged files ``paths``, added up on the driver
    (:func:`mtaq.analytics.partials.merge_tables`) whenever the sum so far and the files read since hold
    STAGED_MERGE_ROWS rows: the driver holds about that many rows, not every task's. (Every 8 files before:
    at 10,000,000 records the 3,245,987 recipients' partial rows of 25 files were grouped four times, 3.0 s;
    once, 2.0 s.)"""
    merged = schema.empty_table()
    read: list[pa.Table] = []
    held = 0
    for i, path in enumerate(paths):
        t = read_staged(path)
        if t.num_rows:
            read.append(t)
            held += t.num_rows
        if read and (held >= STAGED_MERGE_ROWS or i == len(paths) - 1):
            merged = merge_tables(name, [t for t in (merged, *read) if t.num_rows])
            read, held = [], merged.num_rows
    return merged.select(schema.names).cast(schema) if merged.num_rows else schema.empty_table()


def top_rows(t: pa.Table, order: Sequence[str], n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of ``t`` in ``order`` ("-k": descending) as Spark's ``orderBy(...).limit(n)``
    orders them: nulls last in a descending key, first in an ascending one."""
    if t.num_rows == 0:
        return []
    keys: list[tuple[str, str]] = []
    cols = {}
    for i, k in enumerate(order):
        name = k.lstrip("-")
        desc = k.startswith("-")
        cols[f"_null{i}"] = pc.is_null(t[name]) if desc else pc.is_valid(t[name])
        keys += [(f"_null{i}", "ascending"), (name, "descending" if desc else "ascending")]
    keyed = t
    for c, v in cols.items():
        keyed = keyed.append_column(c, v)
    if n < t.num_rows:  # the first n in any order (no sort of every row), then those sorted
        pick = pc.select_k_unstable(keyed, k=n, sort_keys=keys)
        keyed, t = keyed.take(pick), t.take(pick)
    return pylist(t.take(pc.sort_indices(keyed, sort_keys=keys)))


def write_table(uri: str, t: pa.Table) -> None:
    """``t`` as the Parquet table ``uri`` (local path or URI), written by the driver: what was there removed
    first (as Spark's overwrite), then ``part-0.parquet`` and an empty ``_SUCCESS``, as Spark's writer leaves
    a complete table."""
    fs, inner, _ = resolve(uri)
    if fs.get_file_info(inner).type != pafs.FileType.NotFound:
        fs.delete_dir(inner)
    fs.create_dir(inner, recursive=True)
    pq.write_table(t, f"{inner}/part-0.parquet", filesystem=fs)
    with fs.open_output_stream(f"{inner}/_SUCCESS"):
        pass


def write_small(directory: str, rows: list[dict[str, Any]], schema: pa.Schema | None) -> None:
    """Write collected rows as ``directory/part-0.parquet`` on the driver (no second Spark job); ``schema``
    None: inferred from the rows (their None values left out)."""
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    if schema is not None:
        table = pa.Table.from_pylist(rows, schema=schema)
    else:
        table = pa.Table.from_pylist([{k: v for k, v in r.items() if v is not None} for r in rows])
    pq.write_table(table, os.path.join(directory, "part-0.parquet"))


def small_schemas() -> dict[str, pa.Schema]:
    """The Parquet schemas of the small tables that have one (the others are inferred from their rows)."""
    ts, i64, s = pa.timestamp("us", tz="UTC"), pa.int64(), pa.string()
    ages = [(a, i64) for a in bucket_labels(AGE_BUCKETS_MIN, "m")]
    return {name: pa.schema(fields) for name, fields in {
        "problems": [("file", s), ("segment", i64), ("offset", i64), ("problem_end", i64), ("problem_kind", s),
                     ("problem_reason", s)],
        "unknown": [("queue_id", s), ("rcpt_index", pa.int32()), ("rcpt_address", s), ("generation", pa.int32()),
                    ("flagged_ts", ts), ("last_reply", s)],
        "sender_domains": [("domain", s), ("messages", i64), ("bytes", i64)],
        "reasons": [("status", s), ("enhanced", s), ("relay", s), ("count", i64), ("recipients", i64),
                    ("messages", i64), ("example", s)],
        "categories": [("status", s), ("category", s), ("count", i64), ("recipients", i64), ("messages", i64),
                       ("example", s)],
        "hourly": [("hour", ts), *((k, i64) for k in ("received", "delivered", "deferrals", "bounced", "bytes_received",
                                                       "bytes_delivered"))],
        "delays": [("bucket", s), ("delivered", i64)],
        "attempts": [("attempts", i64), ("messages", i64)],
        "qshape": [("tick", ts), ("messages", i64), ("bytes", i64), *ages],
        "qshape_now": [("domain", s), ("recipients", i64), *ages],
        "segments": [("file", s), ("segment", i64), ("size", i64), ("records", i64), ("sealed", pa.bool_()),
                     ("created_ts", ts)],
    }.items()}


def pylist(t: pa.Table) -> list[dict[str, Any]]:
    """Rows of an Arrow table as ``collect()`` gives them with TZ=UTC (timestamps as naive UTC datetimes)."""
    cols = [c.cast(pa.timestamp("us", tz="UTC")).cast(pa.timestamp("us")) if pa.types.is_timestamp(c.type) else c
            for c in t.columns]
    rows: list[dict[str, Any]] = pa.Table.from_arrays(cols, names=t.column_names).to_pylist()
    return rows


def read_open_rows(paths: Sequence[str]) -> pa.Table:
    """The ENVELOPE, START, DELIVERY and FINISH rows (FACT_SCHEMA) of the staged ``facts`` files ``paths``
    (local paths or URIs), read by pyarrow on the driver: the record rows of the messages no task closed.
    Each file is sorted by record type, so only the row groups of those types are read."""
    keyed = [("record_type", "in", list(KEYED))]
    return pa.concat_tables([FACT_SCHEMA.empty_table(),
                             *(read_staged(path, filters=keyed, schema=FACT_SCHEMA) for path in paths)])


def read_staged(path: str, **options: Any) -> pa.Table:
    """The staged Parquet file ``path`` (local path or URI), read by pyarrow on the driver (``options``:
    :func:`pyarrow.parquet.read_table`'s)."""
    fs, inner, _ = resolve(path)
    return pq.read_table(inner, filesystem=fs, **options)


def read_spark(spark: SparkSession, paths: Sequence[str], ddl: str) -> DataFrame:
    """The staged Parquet files ``paths`` with the schema ``ddl`` (no files: no rows)."""
    if not paths:
        return spark.createDataFrame([], ddl)
    return spark.read.schema(ddl).parquet(*paths)


def publish(big: str, staged: Sequence[tuple[str, str]]) -> None:
    """Make ``big/outcomes`` (by ``date=YYYY-MM-DD``) and ``big/messages`` hold exactly the staged files
    (``(table, file)``, table ``outcomes/date=...`` or ``messages``): what was there is removed first (as
    Spark's overwrite would), the staged files are moved in under their own names, and an empty ``_SUCCESS``
    marks each table complete as Spark's writer would, last. ``big`` is absolute (or a URI), so that Spark
    and pyarrow name the same directory."""
    for name in ("outcomes", "messages"):
        fs, inner, _ = resolve(join_path(big, name))
        if fs.get_file_info(inner).type != pafs.FileType.NotFound:
            fs.delete_dir(inner)
    for table, path in staged:
        fs, src, _ = resolve(path)
        dst = resolve(join_path(join_path(big, table), path.split("?")[0].rsplit("/", 1)[-1]))[1]
        fs.create_dir(dst.rsplit("/", 1)[0], recursive=True)
        fs.move(src, dst)
    for name in ("outcomes", "messages"):
        fs, inner, _ = resolve(join_path(join_path(big, name), "_SUCCESS"))
        fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(inner):
            pass


def remove_stage(uri: str) -> None:
    """Delete this run's stage directory ``uri`` (local path or URI) and everything in it, if it exists; only
    a directory named ``_facts-...`` (made by :func:`analyze`), whatever the URI around it says."""
    fs, inner, _ = resolve(uri)
    if not inner.rstrip("/").rsplit("/", 1)[-1].startswith("_facts-"):
        raise ValueError(f"not a stage directory of mtaq analyze: {uri}")
    if fs.get_file_info(inner).type == pafs.FileType.Directory:
        fs.delete_dir(inner)
