"""The job's Python tasks on a Spark Connect session (``mtaq analyze --remote sc://HOST:PORT``, issue 38.2).

A Spark Connect client has no SparkContext and no RDDs, which is how a local or ``spark-submit`` run starts
the job's two kinds of Python tasks (``rdd.mapPartitions``). Here the same functions run as ``mapInArrow``
over DataFrames, which Spark Connect plans on the server:

* the tasks over groups of segments (:func:`mtaq.analytics.datasource.stage_indexed`): over
  ``spark.range(0, N, 1, N)``, one row and one partition per group, each row's ``id`` naming its group;
* the merge of the open messages (:func:`mtaq.analytics.datasource.stage_open_rows`): over their record rows
  hash-partitioned by queue ID, each partition's rows as tuples.

The rows they yield are the same tuples, carried back as Arrow record batches of the schemas below, so that
the job reads them as it reads ``collect()``'s. The server's Python workers import these functions from the
mtaq modules the client shipped (:func:`mtaq.analytics.session.package_zip`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from mtaq.analytics.datasource import STAGED_DDL, stage_indexed, stage_open_rows

__all__ = ["INDEXED_DDL", "STAGED_SCHEMA", "open_rows_staged", "tasks_staged"]

_STAGED_FIELDS = [("table", pa.string()), ("path", pa.string()), ("rows", pa.int64()), ("part", pa.string()),
                  ("data", pa.binary())]
STAGED_SCHEMA = pa.schema(_STAGED_FIELDS)
"""The rows of a task or of the merge of the open messages (datasource.STAGED_DDL) as Arrow."""
INDEXED_SCHEMA = pa.schema([("task_group", pa.int64()), *_STAGED_FIELDS])
INDEXED_DDL = "task_group bigint, table string, path string, rows bigint, part string, data binary"
""":data:`STAGED_SCHEMA` led by the number of the group of segments (stage_indexed's rows)."""


def _batch(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.RecordBatch:
    """``rows`` (tuples in the order of ``schema``'s fields) as one record batch of ``schema``."""
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in schema]
    return pa.RecordBatch.from_arrays([pa.array(list(c), f.type) for c, f in zip(columns, schema, strict=True)],
                                      schema=schema)


def _rows_of(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[Any, ...]]:
    """The rows of ``batches`` as tuples of their columns' Python values."""
    for b in batches:
        yield from zip(*(c.to_pylist() for c in b.columns), strict=True)


def _run_groups(batches: Iterable[pa.RecordBatch], groups: Sequence[Any],
                task: Callable[[Iterable[tuple[int, Any]]], Iterator[tuple[Any, ...]]]) -> Iterator[pa.RecordBatch]:
    """mapInArrow's function over ``spark.range`` rows: the task's rows of each group the ids name."""
    ids = [int(r[0]) for r in _rows_of(batches)]
    got = list(task([(i, groups[i]) for i in ids]))
    if got:
        yield _batch(got, INDEXED_SCHEMA)


def _run_open(batches: Iterable[pa.RecordBatch],
              merge: Callable[[Iterable[tuple[Any, ...]]], Iterator[tuple[Any, ...]]]) -> Iterator[pa.RecordBatch]:
    """mapInArrow's function over a partition of open record rows: the merge's rows of them all."""
    got = list(merge(_rows_of(batches)))
    if got:
        yield _batch(got, STAGED_SCHEMA)


def tasks_staged(spark: SparkSession, indexed: Sequence[tuple[int, Any]], stage: str, until_us: int | None,
                 close: bool, since_us: int | None) -> list[tuple[Any, ...]]:
    """:func:`mtaq.analytics.datasource.stage_indexed` of each numbered group of segment files, one Spark task
    each, on a Spark Connect session: the rows ``rdd.mapPartitions(...).collect()`` gives on a local session
    (``(group, table, path, rows, part, data)``). ``indexed`` is ``list(enumerate(groups))``."""
    if not indexed:
        return []
    groups = [files for _, files in indexed]
    task = partial(stage_indexed, stage=stage, until_us=until_us, close=close, since_us=since_us)
    df = spark.range(0, len(groups), 1, len(groups)).mapInArrow(partial(_run_groups, groups=groups, task=task),
                                                              INDEXED_DDL)
    return [tuple(r) for r in _rows_of(df.toArrow().to_batches())]


def open_rows_staged(keyed: DataFrame, names: Sequence[str], stage: str, since_us: int | None,
                     until_us: int | None, end_us: int | None) -> list[tuple[Any, ...]]:
    """:func:`mtaq.analytics.datasource.stage_open_rows` of each partition of ``keyed`` (record rows of the
    FACT_SCHEMA columns ``names``, timestamps as microseconds, partitioned by queue ID) on a Spark Connect
    session: the rows ``keyed.rdd.mapPartitions(...).collect()`` gives on a local one."""
    merge = partial(stage_open_rows, names=list(names), stage=stage, since_us=since_us, until_us=until_us,
                    end_us=end_us)
    df = keyed.mapInArrow(partial(_run_open, merge=merge), STAGED_DDL)
    return [tuple(r) for r in _rows_of(df.toArrow().to_batches())]
