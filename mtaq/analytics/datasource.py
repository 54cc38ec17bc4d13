"""The ``mtaq`` Spark data source (PySpark 4 Python Data Source API): segments as a DataFrame.

Usage::

    from mtaq.analytics.datasource import register
    register(spark)                                   # spark.dataSource.register(MtaqDataSource)
    df = spark.read.format("mtaq").load("/var/spool/mtaq-archive")
    df = spark.read.format("mtaq").option("paths", '["spool", "s3://bucket/archive"]').load()

Options: ``path`` (what ``load`` is given) or ``paths`` (a JSON list; both may be given): spool
directories, archive directories, segment files or globs, local or ``s3://`` / ``hdfs://`` (see
:mod:`mtaq.analytics.source`). ``partitionBytes`` (default 67108864) packs whole segments into partitions
of about that many stored bytes; a segment is never split, because its tail rules need the whole file.
``rows``: ``records`` (default: the schema below), ``facts`` (:mod:`mtaq.analytics.facts`: per-message and
per-outcome facts of the messages a partition holds whole, record rows for the rest) or ``staged`` (what
``mtaq analyze`` reads: each task writes its partition's facts as Parquet files under the option
``stage``, a directory or URI every executor can write and the driver can read, and yields
:data:`STAGED_DDL` rows: each file with its table and row count, and the partial aggregates of the small
tables, :func:`stage_facts`); with ``facts`` and ``staged``, ``untilMicros`` and ``sinceMicros`` are the
job's ``--until`` and ``--since`` (microseconds since the epoch) and ``closeMessages`` ``false`` leaves
every message to Spark (record rows only; the tests compare both ways).

The schema is :data:`mtaq.analytics.source.SPARK_DDL`: one row per envelope recipient, START, delivery
outcome, FINISH, problem and segment file. Files are listed on the driver; executors read them through
``pyarrow.fs`` with the daemon's codec and yield Arrow record batches. Corrupt records become PROBLEM rows:
the job never fails on them and never hides them. Executors need this package importable (``--py-files``
with a zip of ``mtaq/``) and ``msgspec``, ``pyarrow`` and ``zstandard`` installed (README, "Analytics").
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from mtaq.analytics.facts import (
    FACT_SCHEMA,
    FACT_SPARK_DDL,
    MESSAGE_COLUMNS,
    OUTCOME_COLUMNS,
    fact_batches,
    fact_kinds,
    open_facts,
)
from mtaq.analytics.partials import DAY_US, FILE_PARTS, encode, floor_utc, in_window, keep_rows, partials, rows_table
from mtaq.analytics.source import SPARK_DDL, SegmentFile, batches, discover, join_path, plan_partitions, resolve

__all__ = ["MtaqDataSource", "SegmentPartition", "register", "stage_facts", "stage_indexed", "stage_open", "stage_open_rows",
           "stage_partitions", "write_staged"]

PARTITION_BYTES_DEFAULT = 64 * 1024 * 1024
# The staged files' columns that Parquet dictionary-encodes: those with few values in a partition (types, codes,
# domains, relays). For the others (queue IDs, addresses, times, reply texts, which name the remote's queue ID)
# the writer would build a dictionary only to give it up: the outcomes file of a 64 MB segment took 75 ms to
# write with a dictionary for every column, 52 ms with these only, and is no larger (6.1 MB against 6.5 MB).
DICTIONARY_COLUMNS = frozenset(("record_type", "status", "code", "enhanced", "relay", "rcpt_domain", "sender_domain",
                                "domain", "bounce_of", "file", "segment", "attempts", "recipients", "problem_kind"))


class SegmentPartition(InputPartition):
    """Whole segment files read by one task, in log order."""

    def __init__(self, files: Sequence[SegmentFile]) -> None:
        super().__init__([f.path for f in files])
        self.files = list(files)


def paths_of(options: Any) -> list[str]:
    """The paths named by the ``path`` and ``paths`` (JSON list) options. Raises ValueError if none."""
    out: list[str] = []
    raw = options.get("paths")
    if raw:
        value = json.loads(raw)
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ValueError("option paths: expected a JSON list of strings")
        out += value
    if options.get("path"):
        out.append(str(options.get("path")))
    if not out:
        raise ValueError("the mtaq data source needs a path: spark.read.format('mtaq').load(PATH)")
    return out


def rows_of(options: Any) -> str:
    """The ``rows`` option: ``records`` (default), ``facts`` or ``staged``. Raises ValueError otherwise."""
    rows = str(options.get("rows") or "records")
    if rows not in ("records", "facts", "staged"):
        raise ValueError(f"option rows: expected 'records', 'facts' or 'staged', got {rows!r}")
    if rows == "staged" and not options.get("stage"):
        raise ValueError("option rows 'staged' needs the option stage (a directory or URI)")
    return rows


STAGED_DDL = "table string, path string, rows bigint, part string, data binary"


def task_memory_pool() -> None:
    """Make the C library's allocator (``pyarrow.system_memory_pool``) this process's default Arrow memory
    pool, as a task's first step, unless ``ARROW_DEFAULT_MEMORY_POOL`` names one. Spark's Python workers are
    forked from its worker daemon, and in such a process Arrow's default allocator (mimalloc) made each
    worker's first task about 0.6 s slower for a 64 MiB segment (2.0-2.5 s against 1.4-1.5 s for the same
    task again in the same worker; with the C library's allocator 1.5-1.8 s the first time, the same after:
    docs/performance.md, "Stop 50"). Called by the task functions Spark runs (the RDD's, the data source's,
    the merge's). The switch is for the whole process: a reused worker keeps it for the session's later
    Python tasks too. A process that is not a Spark worker may call them as well (the tests do): the tables
    are the same, and arrays already allocated keep the pool they came from. It reaches what pyarrow
    allocates, not Acero's own group-bys and joins: ``mtaq analyze`` sets ``ARROW_DEFAULT_MEMORY_POOL`` for
    its driver and the workers it starts (:func:`mtaq.analytics.command.run`)."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    if pa.default_memory_pool().backend_name != "system":
        pa.set_memory_pool(pa.system_memory_pool())


def stage_facts(files: Sequence[SegmentFile], stage: str, until_us: int | None, close: bool,
                since_us: int | None = None) -> Iterator[tuple[str | None, str | None, int | None, str | None, bytes | None]]:
    """Write the facts of one partition (``files``) as Parquet files under ``stage`` (a directory: local path
    or URI, as :mod:`mtaq.analytics.source` resolves them) and yield the :data:`STAGED_DDL` rows that say so:

    * (``"facts"``, file, rows, None, None): every row but the MESSAGE and OUTCOME rows (FACT_SCHEMA), sorted
      by ``record_type``, in row groups of 65,536 rows, so that a reader filtering on it skips the other types;
    * (``"messages"``, file, rows, None, None): the MESSAGE rows, :data:`MESSAGE_COLUMNS`;
    * (``"outcomes/date=YYYY-MM-DD"``, file, rows, None, None): for each UTC date, the OUTCOME rows of that
      date in the window ``since_us``/``until_us`` (microseconds since the epoch, None: unbounded),
      :data:`OUTCOME_COLUMNS`; the job moves these files into its outcomes table as they are;
    * (``"p_bucket"``, file, rows, None, None), (``"senders"``, ...), (``"recipients"``, ...): the partial
      tables of :data:`mtaq.analytics.partials.FILE_PARTS` (the percentiles' delay buckets per domain, the
      senders, the recipients: up to a row per fact, so files, never values the driver collects with the
      rest);
    * (None, None, None, part, data) for each other partial table of the small tables (:mod:`mtaq.analytics.partials`).

    Each file's name is this attempt's own (``KIND-FIRST-LAST-RANDOM.parquet``, FIRST and LAST the segment
    numbers): two logs with the same segment numbers (worker shards, two hosts) or two attempts of one task
    never write the same file, and the job reads only the files the successful attempts return."""
    kinds = fact_kinds(files, until_us, close=close)
    name = f"{files[0].segment:012d}-{files[-1].segment:012d}-{uuid.uuid4().hex}"
    # The facts file: every kind but MESSAGE and OUTCOME, the kinds in order of name (each kind's rows in theirs).
    rest = [kinds[k] for k in sorted(kinds) if k not in ("MESSAGE", "OUTCOME")]
    yield from _stage(kinds, stage, name, since_us, until_us, until_us, pa.concat_tables(rest) if rest else FACT_SCHEMA.empty_table())


def _stage(kinds: Mapping[str, pa.Table], stage: str, name: str, since_us: int | None, until_us: int | None,
           end_us: int | None, rest: pa.Table | None = None) -> Iterator[tuple[str | None, str | None, int | None, str | None, bytes | None]]:
    """The fact rows ``kinds`` (FACT_SCHEMA tables by ``record_type``) staged (:func:`write_staged`, the
    FILE_PARTS partial tables as files) and the other partial tables as :data:`STAGED_DDL` rows: what a task
    and the merge of the open messages yield."""
    parts = partials(kinds, since_us, until_us, end_us)
    yield from write_staged(kinds, stage, name, since_us, until_us, rest, {k: parts.pop(k) for k in FILE_PARTS if k in parts})
    for part, data in encode(parts):
        yield None, None, None, part, data


def stage_partitions(groups: Iterable[Sequence[SegmentFile]], stage: str, until_us: int | None, close: bool,
                     since_us: int | None = None) -> Iterator[tuple[str | None, str | None, int | None, str | None, bytes | None]]:
    """:func:`stage_facts` of each group of segment files (one partition each, as
    :func:`mtaq.analytics.source.plan_partitions` packs them): for ``rdd.mapPartitions`` over those groups,
    which is how ``mtaq analyze`` runs the tasks (the data source's ``staged`` rows give the same rows, but
    Spark starts a Python process on the driver to plan a Python data source: 2 s of a job of 10 on two
    cores)."""
    task_memory_pool()
    for files in groups:
        yield from stage_facts(files, stage, until_us, close, since_us)


def stage_indexed(groups: Iterable[tuple[int, Sequence[SegmentFile]]], stage: str, until_us: int | None, close: bool,
                  since_us: int | None = None) -> Iterator[tuple[Any, ...]]:
    """:func:`stage_partitions` of numbered groups ``(number, files)``, each row led by its group's number (the
    job with ``--state`` keeps each partition's rows apart: :mod:`mtaq.analytics.state`)."""
    task_memory_pool()
    for g, files in groups:
        for row in stage_facts(files, stage, until_us, close, since_us):
            yield (g, *row)


def stage_open(rows: pa.Table, stage: str, since_us: int | None, until_us: int | None,
               end_us: int | None) -> Iterator[tuple[str | None, str | None, int | None, str | None, bytes | None]]:
    """The facts of the messages no task held whole ("open": spread over partitions, or still queued), from
    *all* their record rows ``rows`` (FACT_SCHEMA; every row of a message here), by the tasks' own definition
    (:func:`mtaq.analytics.facts.open_facts`), staged and added up as :func:`stage_facts` stages a task's: the
    same :data:`STAGED_DDL` rows, the messages and outcomes files and the partial tables (with ``end_us``, the
    job's end, for the queue at the end). The job calls it on the driver when the open rows are few, and in
    Spark tasks over rows hash-partitioned by queue ID (:func:`stage_open_rows`) when they are many: one
    definition, run where it is cheapest. Raises OSError or pyarrow errors."""
    kinds = open_facts(rows)
    if any(t.num_rows for t in kinds.values()):
        yield from _stage(kinds, stage, f"open-{uuid.uuid4().hex}", since_us, until_us, end_us)


def stage_open_rows(rows: Iterable[Sequence[Any]], names: Sequence[str], stage: str, since_us: int | None,
                    until_us: int | None, end_us: int | None) -> Iterator[tuple[Any, ...]]:
    """:func:`stage_open` for Spark's ``rdd.mapPartitions`` over record rows partitioned by queue ID: ``rows``
    are tuples of the FACT_SCHEMA columns ``names``, timestamps as microseconds since the epoch
    (:func:`mtaq.analytics.partials.rows_table`)."""
    task_memory_pool()
    t = rows_table(rows, names)
    if t is not None:
        yield from stage_open(t, stage, since_us, until_us, end_us)


def write_staged(kinds: Mapping[str, pa.Table], stage: str, name: str, since_us: int | None, until_us: int | None,
                 rest: pa.Table | None = None,
                 parts: Mapping[str, pa.Table] | None = None) -> Iterator[tuple[str, str, int, None, None]]:
    """Write the MESSAGE rows and the OUTCOME rows in the window of the fact rows ``kinds`` (FACT_SCHEMA tables
    by ``record_type``) under ``stage`` as :func:`stage_facts` describes (``rest``, when given, as the
    ``facts`` file; ``parts``, partial tables of FILE_PARTS by name, each as a file of that kind), each file
    named ``KIND-NAME[-DATE].parquet``; yield its (table, file, rows, None, None). Used by the tasks and by the
    job's merge of the open messages on the driver. Raises OSError or pyarrow errors."""
    empty = FACT_SCHEMA.empty_table()
    outcomes = kinds.get("OUTCOME", empty)
    outcomes = keep_rows(outcomes, in_window(outcomes["ts"], since_us, until_us)).select(list(OUTCOME_COLUMNS))
    out = [] if rest is None else [("facts", rest)]
    out += [(kind, t) for kind, t in (parts or {}).items()]
    out.append(("messages", kinds.get("MESSAGE", empty).select(list(MESSAGE_COLUMNS))))
    days = floor_utc(outcomes["ts"], DAY_US)
    for day in pc.unique(days).to_pylist():
        out.append((f"outcomes/date={day.date().isoformat()}", keep_rows(outcomes, pc.equal(days, pa.scalar(day, days.type)))))
    for kind, t in out:
        target = join_path(stage, f"{kind.split('/')[0]}-{name}{'-' + kind[-10:] if '/' in kind else ''}.parquet")
        fs, inner, _ = resolve(target)
        fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
        pq.write_table(t, inner, filesystem=fs, row_group_size=65536,
                       use_dictionary=[c for c in t.column_names if c in DICTIONARY_COLUMNS])
        yield kind, target, t.num_rows, None, None


class MtaqReader(DataSourceReader):
    """Plans partitions on the driver (listing files), reads them on executors."""

    def __init__(self, options: Any) -> None:
        self.files = discover(paths_of(options))
        self.partition_bytes = int(options.get("partitionBytes") or PARTITION_BYTES_DEFAULT)
        self.facts = rows_of(options) == "facts"
        until, since = options.get("untilMicros"), options.get("sinceMicros")
        self.until_us = int(until) if until else None
        self.since_us = int(since) if since else None
        self.close = str(options.get("closeMessages") or "true").lower() != "false"
        self.stage = str(options.get("stage")) if rows_of(options) == "staged" else None

    def partitions(self) -> list[SegmentPartition]:
        return [SegmentPartition(g) for g in plan_partitions(self.files, self.partition_bytes)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, SegmentPartition)
        task_memory_pool()
        if self.stage is not None:
            yield from stage_facts(partition.files, self.stage, self.until_us, self.close, self.since_us)
        elif self.facts:
            yield from fact_batches(partition.files, self.until_us, close=self.close)
        else:
            yield from batches(partition.files)


class MtaqDataSource(DataSource):
    """``spark.read.format("mtaq")``: queue-log segments, decoded by the daemon's codec."""

    @classmethod
    def name(cls) -> str:
        return "mtaq"

    def schema(self) -> str:
        rows = rows_of(self.options)
        return FACT_SPARK_DDL if rows == "facts" else STAGED_DDL if rows == "staged" else SPARK_DDL

    def reader(self, schema: StructType) -> MtaqReader:
        return MtaqReader(self.options)


def register(spark: SparkSession) -> None:
    """Register the ``mtaq`` format with ``spark`` (once per session; repeating it is harmless)."""
    spark.dataSource.register(MtaqDataSource)
