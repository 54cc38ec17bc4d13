"""The delivery-statistics job: segments in, Parquet tables, ``totals.json`` and a report out (PySpark).

``analyze(spark, Options)`` reads segments through the ``mtaq`` data source, derives per-message and
per-recipient facts by one definition (:mod:`mtaq.analytics.facts`, pyarrow: in the data source's tasks,
and for messages spread over partitions on the driver or in Spark tasks over their rows by queue ID), adds up the small tables' partial aggregates (:mod:`mtaq.analytics.partials`), writes every table as
Parquet under ``OUT/tables/``, and renders
``OUT/report.md`` with PNG plots (:mod:`mtaq.analytics.report`). It runs unchanged on ``local[*]`` and
under ``spark-submit`` on a cluster (``mtaq/analytics/submit.py`` is the entry file).

Definitions (each fact is counted in the ``--since``/``--until`` window by its own time, UTC):

* received: messages accepted over SMTP (first envelope, ``bounce_of`` empty), at arrival; bytes
  received is the sum of their sizes. DSNs that mtaq generated are counted apart (``dsn_generated``).
* delivered / deferrals / bounced: recipient outcomes (DELIVERY records) 2xx / 4xx / 5xx, at the reply.
  A recipient whose last reply was 4xx in a message that then FINISHed ran out of queue lifetime: it
  counts as bounced (``expired``, 4.4.7) at the FINISH. ``deferred`` is the number of distinct recipients
  deferred at least once. Bytes delivered is the message size summed over delivered recipients.
* rejected: 0 without ``--events``. Mail refused at the SMTP door never reaches the queue log (the edge answers
  4xx/5xx before anything is appended); with ``--events``, the refusals in the daemon's event log
  (:mod:`mtaq.analytics.rejections`).
* time to deliver: delivered outcome time minus arrival, in seconds; percentiles are nearest-rank, exact
  (the value at rank ceil(p * N) of the sorted delays; before, ``percentile_approx`` with accuracy 10000,
  within 0.01 % of rank above 10,000 values): counted in delay buckets by the tasks, and only the values of
  a bucket in which a wanted rank falls read again (``_percentiles``).
* bounce category: each deferred, bounced or expired outcome's reply classified by the shipped rules
  (:mod:`mtaq.core.bounce_class`, after KumoMTA's classifier; issue 37.3); table ``categories`` by status
  and category: count, recipients, messages, example.
* attempts per message: START records of each received message.
* queue over time (qshape): at every whole hour, the messages that had arrived and not yet FINISHed,
  by age (qshape's buckets, minutes); ``qshape_now`` is the same by recipient domain at the end.
* outcome unknown: recipients flagged ``unknown`` in a replacement envelope (a crash hid the outcome of
  their attempt; GUIDE I4), at the time recovery made them due.

What must always hold: corrupt data never fails the job and is never dropped silently: PROBLEM rows go
to ``tables/problems`` and to the report.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from mtaq.analytics import jvm
from mtaq.analytics import state as state_mod
from mtaq.analytics.datasource import PARTITION_BYTES_DEFAULT, stage_indexed, stage_open, stage_open_rows
from mtaq.analytics.facts import (
    FACT_SCHEMA,
    FACT_SPARK_DDL,
    OUTCOME_SPARK_DDL,
)
from mtaq.analytics.partials import (
    FILE_PARTS,
    RankTarget,
    decode,
    locate_percentiles,
    merge,
    merge_tables,
    rank_value,
)
from mtaq.analytics.report import write_report
from mtaq.analytics.source import discover, join_path, plan_partitions, resolve
from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, Result, bucket_labels

__all__ = ["AGE_BUCKETS_MIN", "DELAY_BUCKETS_S", "Options", "Result", "analyze", "class_archive", "spark_session",
           "stop_session"]

# Record rows per partition of Spark's merge of the open messages (see analyze); they go to a Python worker
# as Row objects (partials.rows_table), about 1 KB each: this bounds a worker's memory to about 100 MB.
MERGE_ROWS_PER_PARTITION = 100_000
# Open record rows (messages no task held whole) up to which the driver merges them (datasource.stage_open)
# instead of Spark tasks: at 10,000,000 records 42 rows took a Spark merge 6 s of stages.
DRIVER_MERGE_ROWS_MAX = 100_000
# Rows of the tasks' senders and recipients partial tables up to which the driver adds them up (pyarrow)
# instead of Spark; also the most delay values the driver reads back for the percentiles. At 1,000,000
# records Spark's sums and top lists took 4.5 s of a 12 s job, the driver's 0.5 s; at 10,000,000 records
# (2,970,725 partial rows) Spark's 10.7 s, the driver's 2.2 s, its process's peak RSS then 0.6 GB.
DRIVER_TABLE_ROWS_MAX = 4_000_000
TOP_ROWS_COLLECTED = 1000  # rows of the senders and recipients tables the driver gets (by count and by bytes)

REJECTED_NOTE = (
    "rejected is 0: mail refused at the SMTP door (4xx/5xx before DATA is queued) never reaches the queue "
    "log, which holds only accepted mail; give the daemon's JSON event log with --events to count them."
)


@dataclass
class Options:
    """What to analyse and where to write. Times are aware UTC datetimes (or None: unbounded)."""

    paths: Sequence[str]
    out: str
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    top: int = 20
    partition_bytes: int = PARTITION_BYTES_DEFAULT
    plots: bool = True
    parquet_out: str | None = None  # where Spark writes the big tables (a shared URI on a cluster); None: OUT/tables
    close_messages: bool = True  # False: no message closed by the data source's tasks, all merged (tests compare)
    # Open record rows up to which the driver merges them instead of Spark tasks; 0: always Spark (tests)
    driver_merge_rows: int = DRIVER_MERGE_ROWS_MAX
    # Partial rows of the senders and recipients tables up to which the driver adds them up; 0: always Spark
    driver_table_rows: int = DRIVER_TABLE_ROWS_MAX
    progress: Callable[[str], None] = field(default=lambda msg: None)
    # A local directory: keep this run's staged facts there, and reuse the last run's (mtaq/analytics/state.py)
    state: str | None = None
    # The daemon's JSON event logs (rotated, .gz): the rejections table and report section (rejections.py)
    events: Sequence[str] = ()


def spark_session(master: str | None = None, conf: Sequence[tuple[str, str]] = (), app: str = "mtaq analyze",
                  short_lived: bool = True) -> SparkSession:
    """A SparkSession in UTC. ``master`` None means ``local[*]``, except under ``spark-submit`` (its own).
    ``short_lived``: the driver JVM compiles with C1 only (:mod:`mtaq.analytics.jvm`): right for one job
    of seconds to minutes (``mtaq analyze``); False for a session that reads many rows into the JVM
    (the data source's own benchmark: C1 read its rows 15 % slower)."""
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = _worker_python(master) or sys.executable
    # collect() turns timestamps into naive datetimes in the process's local time zone: make that UTC.
    os.environ["TZ"] = "UTC"
    time.tzset()
    b = SparkSession.builder.appName(app)
    if master:
        b = b.master(master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        b = b.master("local[*]")
    # The driver JVM's start (mtaq/analytics/jvm.py): a class archive of Spark's classes and C1 only, for a
    # driver this process starts; the user's own extraJavaOptions (--conf, else spark-defaults.conf's, which
    # ours would replace) come after ours.
    from pyspark import SparkContext

    start = jvm.plan(master, c1=short_lived) if SparkContext._active_spark_context is None else jvm.JvmStart("", "off")
    theirs = " ".join(v for k, v in conf if k == "spark.driver.extraJavaOptions")
    if start.options and not any(k == "spark.driver.extraJavaOptions" for k, _ in conf):
        theirs = jvm.spark_defaults().get("spark.driver.extraJavaOptions", "")
    conf = [(k, v) for k, v in conf if k != "spark.driver.extraJavaOptions"]
    if start.options or theirs:
        b = b.config("spark.driver.extraJavaOptions", f"{start.options} {theirs}".strip())
    b = b.config("spark.sql.session.timeZone", "UTC").config("spark.ui.showConsoleProgress", "true")
    # The tables are small after aggregation: Spark's 200 shuffle partitions cost more than they bring here;
    # on this machine two per core (on local[2], 4 instead of 16 took about 3 s off the job: each of its
    # few dozen small stages ran 16 tasks).
    b = b.config("spark.sql.shuffle.partitions", str(_shuffle_partitions(master)))
    if (master or "local").startswith("local") and not (master is None and "PYSPARK_GATEWAY_PORT" in os.environ):
        b = b.config("spark.ui.enabled", "false")  # no web UI for a batch job on this machine
    for k, v in conf:
        b = b.config(k, v)
    spark = b.getOrCreate()
    _STARTS[id(spark)] = start
    spark.sparkContext.setLogLevel("ERROR")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


_STARTS: dict[int, jvm.JvmStart] = {}


def class_archive(spark: SparkSession) -> str:
    """How ``spark``'s driver JVM started (:mod:`mtaq.analytics.jvm`): "used" (a class archive mapped),
    "creating" (this run writes it when stopped by :func:`stop_session`) or "off"."""
    start = _STARTS.get(id(spark))
    return "off" if start is None else start.state


def stop_session(spark: SparkSession) -> None:
    """Stop a session made by :func:`spark_session`; the first run on a machine also waits for its driver JVM
    to write the class archive (a few seconds, once: :func:`mtaq.analytics.jvm.stop`)."""
    jvm.stop(spark, _STARTS.pop(id(spark), jvm.JvmStart("", "off")))


def _shuffle_partitions(master: str | None) -> int:
    """Shuffle partitions for ``master``: two per core on ``local[N]``/``local[*]``/``local``, else 16."""
    import re

    m = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\d+)?\])?", master or "local[*]")
    if m is None:
        return 16
    if m.group(1) is None:
        cores = 1
    elif m.group(1) == "*":
        cores = os.cpu_count() or 2
    else:
        cores = int(m.group(1))
    return max(4, 2 * cores)


def _worker_python(master: str | None) -> str | None:
    """A wrapper of this interpreter for Spark's Python workers that drops ``pyspark.zip`` from their PYTHONPATH,
    or None where it does not apply.

    Spark puts ``SPARK_HOME/python/lib/pyspark.zip`` first on every Python worker's PYTHONPATH. Python keeps
    no bytecode for modules imported from a zip, so each new worker process (the data source's planner
    processes, the worker daemon and every worker it forks) compiled pyspark's modules from source again:
    about 20 s of a 30 s first scan on a loaded 2-core machine (docs/performance.md, "Analytics"). When the
    same pyspark is installed in this interpreter (pip: SPARK_HOME is that package), the workers import it
    from there, with its compiled bytecode. Only for a master on this machine (``local``, ``local-cluster``),
    never under spark-submit, and never when PYSPARK_PYTHON is set.
    """
    import pyspark

    home = os.path.dirname(os.path.abspath(pyspark.__file__))
    if "PYSPARK_GATEWAY_PORT" in os.environ or not (master or "local").startswith("local"):
        return None
    if os.environ.get("SPARK_HOME", home) != home or not os.path.exists(os.path.join(home, "python", "lib", "pyspark.zip")):
        return None
    import hashlib
    import shlex
    import tempfile

    script = (
        "#!/bin/sh\n"
        "# mtaq analyze: Spark's Python workers without pyspark.zip on PYTHONPATH (mtaq/analytics/job.py)\n"
        "PYTHONPATH=$(printf '%s' \"$PYTHONPATH\" | tr ':' '\\n' | grep -v '/pyspark\\.zip$' | paste -sd: -)\n"
        "export PYTHONPATH\n"
        f"exec {shlex.quote(sys.executable)} \"$@\"\n"
    )
    digest = hashlib.sha256(script.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"mtaq-spark-python-{os.getuid()}-{digest}")
    try:
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(script)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
    except OSError:
        return None
    return path


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.collect()]


def _write_small(directory: str, rows: list[dict[str, Any]], schema: pa.Schema | None) -> None:
    """Write collected rows as ``directory/part-0.parquet`` on the driver (no second Spark job); ``schema``
    None: inferred from the rows (their None values left out)."""
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    if schema is not None:
        table = pa.Table.from_pylist(rows, schema=schema)
    else:
        table = pa.Table.from_pylist([{k: v for k, v in r.items() if v is not None} for r in rows])
    pq.write_table(table, os.path.join(directory, "part-0.parquet"))


def _small_schemas() -> dict[str, pa.Schema]:
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


def _micros(t: dt.datetime) -> int:
    """An aware datetime as microseconds since the epoch (UTC), exactly."""
    return (t - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)


def _pylist(t: pa.Table) -> list[dict[str, Any]]:
    """Rows of an Arrow table as ``collect()`` gives them with TZ=UTC (timestamps as naive UTC datetimes)."""
    cols = [c.cast(pa.timestamp("us", tz="UTC")).cast(pa.timestamp("us")) if pa.types.is_timestamp(c.type) else c
            for c in t.columns]
    rows: list[dict[str, Any]] = pa.Table.from_arrays(cols, names=t.column_names).to_pylist()
    return rows


# The senders and recipients tables (counts never null, as Spark's count() writes them)
SENDER_SCHEMA = pa.schema([("sender", pa.string()), ("sender_domain", pa.string()),
                           pa.field("messages", pa.int64(), nullable=False), ("bytes", pa.int64())])
RECIPIENT_SCHEMA = pa.schema([("rcpt_address", pa.string()), ("rcpt_domain", pa.string()),
                              pa.field("delivered", pa.int64(), nullable=False), ("bytes", pa.int64())])


def _ddl(schema: pa.Schema) -> str:
    """Spark's DDL of a schema of string and int64 columns."""
    return ", ".join(f"{f.name} {'bigint' if f.type == pa.int64() else 'string'}" for f in schema)


STAGED_MERGE_FILES = 8  # staged partial files read before they are added up


def _merge_staged(name: str, paths: Sequence[str], schema: pa.Schema) -> pa.Table:
    """The partial tables of the part ``name`` in the staged files ``paths``, added up on the driver
    (:func:`mtaq.analytics.partials.merge_tables`), STAGED_MERGE_FILES at a time: the driver holds the sum
    and one batch of files, not every task's."""
    merged = schema.empty_table()
    for i in range(0, len(paths), STAGED_MERGE_FILES):
        read = [_read_staged(path) for path in paths[i : i + STAGED_MERGE_FILES]]
        merged = merge_tables(name, [t for t in (merged, *read) if t.num_rows]) if any(t.num_rows for t in read) else merged
    return merged.select(schema.names).cast(schema) if merged.num_rows else schema.empty_table()


def _top(t: pa.Table, order: Sequence[str], n: int) -> list[dict[str, Any]]:
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
    return _pylist(t.take(pc.sort_indices(keyed, sort_keys=keys)))


def _write_table(uri: str, t: pa.Table) -> None:
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


_KEYED = ("ENVELOPE", "START", "DELIVERY", "FINISH")


def _collect_tables(named: dict[str, DataFrame]) -> dict[str, list[dict[str, Any]]]:
    """Collect many small DataFrames as Arrow, from a few driver threads at once, so that Spark schedules
    their stages together (one plan each: a union of them all took seconds to plan). Timestamps come back
    as naive UTC datetimes (as ``collect()`` gives them with TZ=UTC), rows in no particular order."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    def one(df: DataFrame) -> list[dict[str, Any]]:
        got = df.toArrow()
        cols = []
        for f in got.schema:
            arr = got.column(f.name)
            if pa.types.is_timestamp(f.type):
                arr = arr.cast(pa.timestamp("us", tz="UTC")).cast(pa.timestamp("us"))
            cols.append(arr)
        rows: list[dict[str, Any]] = pa.Table.from_arrays(cols, names=got.schema.names).to_pylist()
        return rows

    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="mtaq-collect") as pool:
        futures = {name: pool.submit(one, df) for name, df in named.items()}
        return {name: f.result() for name, f in futures.items()}


def _sorted(rows: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    """Rows sorted by ``keys`` ("-k" descending), None first as Spark's ascending order puts nulls."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        out: list[Any] = []
        for k in keys:
            desc = k.startswith("-")
            v = r[k.lstrip("-")]
            if desc:
                out += [v is not None, (-v if isinstance(v, (int, float)) else _Rev(v)) if v is not None else 0]
            else:
                out += [v is not None, v if v is not None else 0]
        return tuple(out)

    return sorted(rows, key=key)


class _Rev:
    """Reverses the order of a non-numeric value in a sort key."""

    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v

    def __lt__(self, other: _Rev) -> bool:
        return bool(self.v > other.v)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rev) and bool(self.v == other.v)

    __hash__ = None  # type: ignore[assignment]


def analyze(spark: SparkSession, opts: Options) -> Result:
    """Run the whole analysis; write Parquet tables, ``totals.json`` and the report under ``opts.out``.

    How (docs/performance.md, "Analytics"): the segments are read once, by the data source's ``staged``
    rows: each Python task computes the per-message and per-outcome facts of every message its partition
    holds whole (:mod:`mtaq.analytics.facts`) and the partial aggregates of the small tables over them
    (:mod:`mtaq.analytics.partials`), and writes the facts as Parquet under ``BIG/_facts-RANDOM`` (BIG is
    ``parquet_out`` or ``OUT/tables``; removed at the end, also when the job fails): the messages, the
    outcomes by date, and the other rows. The record rows of the other messages are merged into the same
    facts and partials by the same definition (:func:`mtaq.analytics.datasource.stage_open`, staged like a
    task's): on the driver when they are few (``driver_merge_rows``: read back from the staged files), else
    in Spark tasks over the rows hash-partitioned by queue ID. The driver adds the
    partials up and finds the percentiles in their delay buckets (Spark reads back the values of a bucket
    only when a rank falls inside one of several values); Spark computes the senders and recipients
    tables; the staged messages and outcomes files are moved into those tables as they are.

    Raises :class:`mtaq.analytics.source.SourceError` when a path names no segments.
    """
    big = (opts.parquet_out or os.path.join(opts.out, "tables")).rstrip("/")
    if "://" not in big:
        big = os.path.abspath(big)  # Spark and pyarrow (which deletes and moves) must name the same directory
    stage = join_path(big, f"_facts-{uuid.uuid4().hex}")  # this run's own: two runs never share one
    try:
        return _analyze(spark, opts, big, stage)
    finally:
        _remove_stage(stage)


def _analyze(spark: SparkSession, opts: Options, big: str, stage: str) -> Result:
    t0 = time.monotonic()
    say = opts.progress
    since, until = opts.since, opts.until
    # Joins on (queue_id, rcpt_index) of sides both partitioned by queue_id: no new shuffle.
    spark.conf.set("spark.sql.requireAllClusterKeysForCoPartition", "false")
    # Timestamps in every table as the tasks' files (pyarrow) have them: INT64 microseconds, UTC (Spark's
    # default INT96 is deprecated in Parquet, and one table would mix both).
    spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    # The staged files are listed on the driver (a few per task), not by a Spark job of one task per file.
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.threshold", "100000")
    tables_dir = os.path.join(opts.out, "tables")
    say(f"reading segments from {', '.join(opts.paths)}")
    # One read of the segments, staged as Parquet (mtaq/analytics/datasource.py, stage_facts). The Python
    # tasks compute the per-message and per-outcome facts of every message a partition holds whole (nearly
    # all of them) with pyarrow, so only the record rows of the others (spread over partitions, or still
    # queued) are shuffled by queue ID and merged by the Spark plan below; they also compute the small
    # tables' partial aggregates (mtaq/analytics/partials.py), which replaced some 40 Spark stages. The
    # queries below read only the columns and row groups they need, vectorised. Spark's own cache of the
    # same rows cost more JVM CPU than the decoding (docs/performance.md, "Fourth round (issue 17)").
    segment_files = discover(opts.paths)  # a path that names no segments: SourceError here, not from inside Spark
    w_since = None if since is None else _micros(since)
    w_until = None if until is None else _micros(until)
    plan: state_mod.StatePlan | None = None
    if opts.state is not None:
        # The last run's partitions whose segments are unchanged are reused (their staged files linked into this
        # run's stage); the tasks compute the rest (mtaq/analytics/state.py).
        plan = state_mod.plan(opts.state, segment_files, opts.partition_bytes, stage, w_since, w_until,
                              opts.close_messages, say)
        if plan.note is not None:
            print(f"mtaq analyze: state {opts.state}: {plan.note}; rebuilt from the segments", file=sys.stderr,
                  flush=True)
        groups = plan.groups
    else:
        groups = plan_partitions(segment_files, opts.partition_bytes)
    # The tasks as an RDD over the groups of segments: the data source's "staged" rows are the same rows, but
    # Spark plans a Python data source in a Python process of its own on the driver (2 s on two cores).
    task = partial(stage_indexed, stage=stage, until_us=w_until, close=opts.close_messages, since_us=w_since)
    indexed = list(enumerate(groups))
    tasks = spark.sparkContext.parallelize(indexed, len(indexed)).mapPartitions(task).collect() if indexed else []
    rows_got = [tuple(r[1:]) for r in tasks]
    if plan is not None and opts.state is not None:
        state_mod.save(opts.state, plan, [(r[0], tuple(r[1:])) for r in tasks], groups, w_since, w_until,
                       opts.close_messages)
        rows_got = list(plan.reused) + rows_got
    staged: list[dict[str, Any]] = [dict(zip(("table", "path", "rows", "part", "data"), r, strict=True))
                                    for r in rows_got]
    files: dict[str, list[str]] = {}
    table_rows = 0  # rows of the senders' and recipients' partial tables the tasks staged
    for got_row in staged:
        if got_row["path"] is not None:
            files.setdefault(got_row["table"].split("/")[0], []).append(got_row["path"])
            if got_row["table"] in ("senders", "recipients"):
                table_rows += got_row["rows"]
    # The small tables' partial aggregates, one set per task (mtaq/analytics/partials.py); Spark's merge of the
    # open messages adds its own below, and the driver adds them all up.
    part_rows = [(x["part"], bytes(x["data"])) for x in staged if x["part"] is not None]
    [inventory] = _pylist(merge(part_rows)["inventory"])
    say(f"decoded {inventory['records']} records from {inventory['segments']} segments "
        f"({inventory['bytes_read']} bytes)")
    end_value = until if until is not None else inventory["last_ts"]
    if isinstance(end_value, dt.datetime) and end_value.tzinfo is None:
        end_value = end_value.replace(tzinfo=dt.UTC)  # _pylist's naive UTC
    age_labels = bucket_labels(AGE_BUCKETS_MIN, "m")
    cached: list[DataFrame] = []
    since_us, until_us = (None if x is None else _micros(x) for x in (since, until))
    end_us = None if end_value is None else _micros(end_value)
    published = [(x["table"], x["path"]) for x in staged
                 if x["path"] is not None and x["table"] not in ("facts", *FILE_PARTS)]
    if inventory["open_rows"]:
        # Messages no task held whole (spread over partitions, or still queued): their record rows merged into
        # facts by the tasks' own definition (datasource.stage_open, facts.open_facts), staged and added up like
        # a task's: on the driver when they are few (at 10,000,000 records 42 rows, which a Spark stage took
        # 6 s to merge), else in Spark tasks over the rows hash-partitioned by queue ID.
        if inventory["open_rows"] <= opts.driver_merge_rows:
            got_open = list(stage_open(_read_open_rows(files.get("facts", [])), stage, since_us, until_us, end_us))
            where = "on the driver"
        else:
            # Partitions by the rows to merge, not by the log's size (one per 32 MB of segments would be 45 at
            # 10,000,000 records, each a task of overhead); timestamps as microseconds, so that no executor's
            # time zone comes into it.
            nparts = -(-inventory["open_rows"] // MERGE_ROWS_PER_PARTITION)
            keyed = _read(spark, files.get("facts", []), FACT_SPARK_DDL).filter(
                F.col("record_type").isin(*_KEYED)).repartition(nparts, "queue_id")
            names = keyed.columns
            keyed = keyed.select(*(F.unix_micros(F.col(f.name)).alias(f.name) if f.dataType.typeName() == "timestamp"
                                   else F.col(f.name) for f in keyed.schema.fields))
            got_open = keyed.rdd.mapPartitions(partial(stage_open_rows, names=names, stage=stage, since_us=since_us,
                                                       until_us=until_us, end_us=end_us)).collect()
            where = "by Spark"
        open_parts: list[tuple[str, bytes]] = []
        for kind, path, nrows, part, data in got_open:  # stage_open's rows, as the tasks' (STAGED_DDL)
            if part is not None and data is not None:
                open_parts.append((part, bytes(data)))
            elif kind is not None and path is not None:
                files.setdefault(kind.split("/")[0], []).append(path)
                if kind in ("senders", "recipients"):
                    table_rows += nrows or 0
                elif kind not in FILE_PARTS:
                    published.append((kind, path))
        part_rows += open_parts
        [spread] = _pylist(merge([x for x in open_parts if x[0] == "inventory"])["inventory"]) or [
            {"outcomes": 0, "messages": 0}]
        say(f"per message and per recipient facts: {spread['outcomes']} outcomes and {spread['messages']} messages "
            f"merged {where}")
    # The tables with a row per sender and per recipient (and the percentiles' read-back) from the partial
    # tables staged in files: added up on the driver (pyarrow) when they are few, else by Spark.
    tables_on_driver = table_rows <= opts.driver_table_rows
    # The percentile buckets: the tasks' files, and what the merge of the open messages added, merged a few
    # at a time, so that the driver holds the merged buckets, not every task's.
    p_bucket = _merge_p_bucket(files.get("p_bucket", []), [decode(data) for name, data in part_rows if name == "p_bucket"])
    parts = merge([(name, data) for name, data in part_rows if name != "p_bucket"])
    say("computing the tables")
    shown = max(opts.top, TOP_ROWS_COLLECTED)

    def delays() -> DataFrame:
        """The delivered outcomes in the window (domain, delay_s), for Spark's percentile read-back."""
        oe = _read(spark, files.get("outcomes", []), OUTCOME_SPARK_DDL)  # the staged files: in the window already
        return oe.filter(F.col("status") == "delivered").select(
            F.coalesce(F.col("rcpt_domain"), F.lit("?")).alias("domain"), "delay_s")

    if tables_on_driver:
        senders_t = _merge_staged("senders", files.get("senders", []), SENDER_SCHEMA)
        recipients_t = _merge_staged("recipients", files.get("recipients", []), RECIPIENT_SCHEMA)
        got = {
            "senders_count": [{"senders": senders_t.num_rows}],
            "recipients_count": [{"recipients": recipients_t.num_rows - recipients_t["rcpt_address"].null_count}],
            "senders_by_count": _top(senders_t, ("-messages", "-bytes", "sender"), shown),
            "senders_by_bytes": _top(senders_t, ("-bytes", "sender"), shown),
            "recipients_by_count": _top(recipients_t, ("-delivered", "-bytes", "rcpt_address"), shown),
            "recipients_by_bytes": _top(recipients_t, ("-bytes", "rcpt_address"), shown),
        }
        say(f"senders and recipients added up on the driver ({table_rows} partial rows)")
        percentiles = _percentiles(p_bucket, delays, outcome_paths=files.get("outcomes", []),
                                   driver_rows=opts.driver_table_rows)
    else:
        # Spark adds up the staged partial tables (the tasks' and the open messages').
        senders = _read(spark, files.get("senders", []), _ddl(SENDER_SCHEMA))
        recipients = _read(spark, files.get("recipients", []), _ddl(RECIPIENT_SCHEMA))
        senders = senders.groupBy("sender", "sender_domain").agg(
            F.coalesce(F.sum("messages"), F.lit(0)).alias("messages"), F.sum("bytes").alias("bytes"))
        recipients = recipients.groupBy("rcpt_address", "rcpt_domain").agg(
            F.coalesce(F.sum("delivered"), F.lit(0)).alias("delivered"), F.sum("bytes").alias("bytes"))
        senders = senders.persist(StorageLevel.MEMORY_AND_DISK)
        recipients = recipients.persist(StorageLevel.MEMORY_AND_DISK)
        cached += [senders, recipients]
        # The counts first: each fills its cache (queries started together on a cache not yet filled each compute
        # it: the recipients' aggregation ran three times at once), the two side by side.
        got = _collect_tables({
            "senders_count": senders.agg(F.count("*").alias("senders")),
            "recipients_count": recipients.filter(F.col("rcpt_address").isNotNull()).agg(
                F.count("*").alias("recipients"))})
        got |= _collect_tables({
            "senders_by_count": senders.orderBy(F.desc("messages"), F.desc("bytes"), "sender").limit(shown),
            "senders_by_bytes": senders.orderBy(F.desc("bytes"), "sender").limit(shown),
            "recipients_by_count": recipients.orderBy(F.desc("delivered"), F.desc("bytes"), "rcpt_address").limit(shown),
            "recipients_by_bytes": recipients.orderBy(F.desc("bytes"), "rcpt_address").limit(shown),
        })
        say(f"senders and recipients added up by Spark ({table_rows} partial rows)")
        percentiles = _percentiles(p_bucket, delays)
    got |= _split_parts(parts, percentiles)
    say("tables collected")
    [r] = got["totals_r"]
    [d] = got["totals_d"]
    [o] = got["totals_o"]
    problems = _sorted(got["problems"], "segment", "offset")
    unknown = _sorted(got["unknown"], "flagged_ts", "queue_id", "rcpt_index")
    p = [o["delay_p50_s"], o["delay_p90_s"], o["delay_p99_s"]]
    [counts] = [got["senders_count"][0] | got["recipients_count"][0]]
    deferred_by_domain = {x["domain"]: x["deferred"] for x in got["deferred_rcpts"]}
    domain_rows = []
    for x in got["domains"]:
        x = {"domain": x["domain"], "delivered": x["delivered"], "bytes_delivered": x["bytes_delivered"],
             "deferrals": x["deferrals"], "deferred": deferred_by_domain.get(x["domain"], 0), **{
                 k: x[k] for k in ("bounced", "delay_mean_s", "delay_max_s", "delay_p50_s", "delay_p90_s", "delay_p99_s")}}
        domain_rows.append(x)
    totals: dict[str, Any] = {
        "received": r["received"],
        "delivered": o["delivered"] or 0,
        "deferred": sum(deferred_by_domain.values()),
        "bounced": o["bounced"] or 0,
        "rejected": 0,
        "deferrals": o["deferrals"] or 0,
        "expired": o["expired"] or 0,
        "dsn_generated": d["dsn_generated"],
        "bytes_received": r["bytes_received"],
        "bytes_delivered": o["bytes_delivered"] or 0,
        "senders": counts["senders"],
        "sending_domains": len(got["sender_domains"]),
        "recipients": counts["recipients"],
        "recipient_domains": sum(1 for x in domain_rows if x["delivered"] and x["domain"] != "?"),
        "delay_p50_s": p[0],
        "delay_p90_s": p[1],
        "delay_p99_s": p[2],
        "delay_mean_s": o["delay_mean_s"],
        "delay_max_s": o["delay_max_s"],
        "outcome_unknown": len(unknown),
        "problems": sum(1 for x in problems if x["problem_kind"] != "open-tail"),
        "open_tails": sum(1 for x in problems if x["problem_kind"] == "open-tail"),
        "segments": inventory["segments"],
        "records": inventory["records"] or 0,
        "bytes_read": inventory["bytes_read"] or 0,
        "since": since.isoformat() if since else None,
        "until": until.isoformat() if until else None,
        "rejected_note": REJECTED_NOTE,
    }
    hourly_rows = _sorted(got["hourly"], "hour")
    daily: dict[dt.date, dict[str, Any]] = {}
    for h in hourly_rows:
        day = h["hour"].date()
        row = daily.setdefault(day, {"day": day, **{k: 0 for k in h if k != "hour"}})
        for k, v in h.items():
            if k != "hour":
                row[k] += v
    top_senders = _merge_top(got["senders_by_count"], got["senders_by_bytes"], "sender",
                             ("-messages", "-bytes", "sender"))
    top_recipients = _merge_top(got["recipients_by_count"], got["recipients_by_bytes"], "rcpt_address",
                                ("-delivered", "-bytes", "rcpt_address"))
    tables: dict[str, list[dict[str, Any]]] = {
        "problems": problems,
        "unknown": unknown,
        "domains": _sorted(domain_rows, "-delivered", "-deferrals", "domain"),
        "senders": top_senders,
        "sender_domains": _sorted(got["sender_domains"], "-messages", "domain"),
        "recipients": top_recipients,
        "reasons": _sorted(got["reasons"], "-count", "status", "enhanced", "relay"),
        "categories": _sorted(got["categories"], "status", "-count", "category"),
        "hourly": hourly_rows,
        "daily": [daily[k] for k in sorted(daily)],
        "delays": got["delays"],
        "attempts": _sorted(got["attempts"], "attempts"),
        "qshape": [{k: r[k] for k in ("tick", "messages", "bytes", *age_labels)} for r in _sorted(got["qshape"], "tick")],
        "qshape_now": [{k: r[k] for k in ("domain", "recipients", *age_labels)}
                       for r in _sorted(got["qshape_now"], "-recipients", "domain")],
        "segments": _sorted(got["segments"], "segment", "file"),
    }
    if opts.events:
        from mtaq.analytics.rejections import SCHEMA as REJECTION_SCHEMA
        from mtaq.analytics.rejections import read_events, summarize

        rej = read_events(opts.events, since, until)
        totals["rejected"] = rej.table.num_rows
        totals["rejected_note"] = (
            f"rejected counts the refusals in the daemon's event log ({len(opts.events)} files: smtp_reject and "
            f"connection_refused events; {rej.skipped} lines not events skipped); the queue log holds only "
            "accepted mail.")
        tables |= summarize(rej.table)
        say(f"rejections: {rej.table.num_rows} from {len(opts.events)} event files")
        os.makedirs(tables_dir, exist_ok=True)
        _write_table(os.path.join(tables_dir, "rejections"), rej.table.cast(REJECTION_SCHEMA))
    say("writing the tables (Parquet)")
    os.makedirs(tables_dir, exist_ok=True)
    schemas = _small_schemas()
    for name, rows in tables.items():
        if name in ("senders", "recipients"):
            continue
        _write_small(os.path.join(tables_dir, name), rows, schemas.get(name))
    _write_small(os.path.join(tables_dir, "totals"), [totals], None)
    say(f"writing the outcomes, messages, senders and recipients tables (Parquet, {big})")
    # A row per address: under BIG (--parquet-out on a cluster), as the outcomes and messages are, written by the
    # driver through pyarrow.fs when it added them up, else by the executors (OUT is the driver's: an executor
    # elsewhere would write its part on its own disk).
    if tables_on_driver:
        _write_table(join_path(big, "senders"), senders_t)
        _write_table(join_path(big, "recipients"), recipients_t)
    else:
        senders.write.mode("overwrite").parquet(join_path(big, "senders"))
        recipients.write.mode("overwrite").parquet(join_path(big, "recipients"))
    # The outcomes (by date) and messages the tasks staged become those tables' files as they are, moved
    # (no second copy by Spark); Spark appends what it merged.
    _publish(big, published)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "totals.json"), "w", encoding="utf-8") as f:
        json.dump(totals, f, indent=2, default=str)
        f.write("\n")
    say("writing the report")
    result = Result(totals, tables, time.monotonic() - t0, None if plan is None else plan.note)
    write_report(opts.out, result, top=opts.top, plots=opts.plots)
    for df in cached:
        df.unpersist()
    result.seconds = time.monotonic() - t0
    say(f"done in {result.seconds:.1f} s: {opts.out}/report.md")
    return result


def _remove_stage(uri: str) -> None:
    """Delete this run's stage directory ``uri`` (local path or URI) and everything in it, if it exists; only
    a directory named ``_facts-...`` (made by :func:`analyze`), whatever the URI around it says."""
    fs, inner, _ = resolve(uri)
    if not inner.rstrip("/").rsplit("/", 1)[-1].startswith("_facts-"):
        raise ValueError(f"not a stage directory of mtaq analyze: {uri}")
    if fs.get_file_info(inner).type == pafs.FileType.Directory:
        fs.delete_dir(inner)


PERCENTILES = (0.5, 0.9, 0.99)


def _percentiles(p_bucket: pa.Table, delays: DataFrame | Callable[[], DataFrame], outcome_paths: Sequence[str] | None = None,
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
        values = None if outcome_paths is None else _read_back_files(todo, outcome_paths, driver_rows)
        if values is None:
            values = _read_back_spark(todo, delays if isinstance(delays, DataFrame) else delays())
        for i, t in enumerate(todo):
            found[t.domain][t.p] = rank_value(t, values.get(i, []))
    return [{"domain": d, "g_domain": d is None, "p": p} for d, p in found.items()]


def _read_back_spark(todo: Sequence[RankTarget], delays: DataFrame) -> dict[int, list[tuple[float, int]]]:
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


def _read_back_files(todo: Sequence[RankTarget], paths: Sequence[str],
                     limit: int) -> dict[int, list[tuple[float, int]]] | None:
    """:func:`_read_back_spark` by the driver from the staged outcomes files ``paths`` (OUTCOME_COLUMNS, the
    outcomes of the window): a file at a time, the delivered rows with a delay in some target's range,
    counted by (domain, delay); then each target's values cut out of those counts (numpy, sorted). None
    (Spark's turn) as soon as the counts hold more than ``limit`` distinct (domain, delay) pairs: the driver
    holds at most that many, and one file's rows."""
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
    for path in paths:
        got = _read_staged(path, columns=["rcpt_domain", "delay_s"], filters=wanted)
        if got.num_rows == 0:
            continue
        d = np.asarray(got["delay_s"].to_numpy(zero_copy_only=False), dtype=np.float64)
        i = np.searchsorted(lo_a, d, side="right") - 1
        keep = (i >= 0) & (d <= hi_a[np.maximum(i, 0)])
        got = pa.table({"domain": pc.fill_null(got["rcpt_domain"], "?"), "delay_s": got["delay_s"]}).filter(pa.array(keep))
        counted.append(got.group_by(["domain", "delay_s"], use_threads=False).aggregate([([], "count_all")])
                       .rename_columns(["domain", "delay_s", "n"]))
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


def _merge_p_bucket(paths: Sequence[str], tables: Sequence[pa.Table]) -> pa.Table:
    """The ``p_bucket`` partial tables in the staged files ``paths`` and in ``tables``, added up
    (:func:`mtaq.analytics.partials.merge`), read and merged P_BUCKET_MERGE_FILES at a time."""
    merged = merge_tables("p_bucket", [t for t in tables if t.num_rows])
    for i in range(0, len(paths), P_BUCKET_MERGE_FILES):
        read = [_read_staged(path) for path in paths[i : i + P_BUCKET_MERGE_FILES]]
        merged = merge_tables("p_bucket", [t for t in (merged, *read) if t.num_rows])
    return merged


def _read_open_rows(paths: Sequence[str]) -> pa.Table:
    """The ENVELOPE, START, DELIVERY and FINISH rows (FACT_SCHEMA) of the staged ``facts`` files ``paths``
    (local paths or URIs), read by pyarrow on the driver: the record rows of the messages no task closed.
    Each file is sorted by record type, so only the row groups of those types are read."""
    keyed = [("record_type", "in", list(_KEYED))]
    return pa.concat_tables([FACT_SCHEMA.empty_table(),
                             *(_read_staged(path, filters=keyed, schema=FACT_SCHEMA) for path in paths)])


def _read_staged(path: str, **options: Any) -> pa.Table:
    """The staged Parquet file ``path`` (local path or URI), read by pyarrow on the driver (``options``:
    :func:`pyarrow.parquet.read_table`'s)."""
    fs, inner, _ = resolve(path)
    return pq.read_table(inner, filesystem=fs, **options)


def _read(spark: SparkSession, paths: Sequence[str], ddl: str) -> DataFrame:
    """The staged Parquet files ``paths`` with the schema ``ddl`` (no files: no rows)."""
    if not paths:
        return spark.createDataFrame([], ddl)
    return spark.read.schema(ddl).parquet(*paths)


def _publish(big: str, staged: Sequence[tuple[str, str]]) -> None:
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


def _split_parts(parts: dict[str, pa.Table], percentiles: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of the small tables from the merged partial tables (:func:`mtaq.analytics.partials.merge`) and
    the rows of the percentile aggregation, as the job's definitions give them (see the module docstring)."""
    rows = {name: _pylist(t) for name, t in parts.items()}
    p_of = {r["domain"]: r["p"] for r in percentiles if not r["g_domain"]}
    p_all = next((r["p"] for r in percentiles if r["g_domain"]), None)

    def o_row(r: dict[str, Any], p: list[float | None] | None) -> dict[str, Any]:
        p = p or [None, None, None]
        n = r["delay_n"]
        return {"delivered": r["delivered"], "bytes_delivered": r["bytes_delivered"], "deferrals": r["deferrals"],
                "bounced": r["bounced"], "expired": r["expired"], "delay_mean_s": r["delay_us"] / 1e6 / n if n else None,
                "delay_max_s": r["delay_max_s"], "delay_p50_s": p[0], "delay_p90_s": p[1], "delay_p99_s": p[2]}

    out: dict[str, list[dict[str, Any]]] = {
        "totals_o": [o_row(r, p_all) for r in rows["o_total"]] or [o_row({k: 0 for k in (
            "delivered", "bytes_delivered", "deferrals", "bounced", "expired", "delay_us", "delay_n")} | {
            "delay_max_s": None}, None)],
        "domains": [{"domain": r["domain"], **o_row(r, p_of.get(r["domain"]))} for r in rows["o_domain"]],
        "delays": [{"bucket": r["bucket"], "delivered": r["delivered"]} for r in rows["o_bucket"]],
        "totals_r": [{"received": r["received"], "bytes_received": r["bytes_received"]} for r in rows["m_total"]]
        or [{"received": 0, "bytes_received": 0}],
        "totals_d": [{"dsn_generated": r["dsn_generated"]} for r in rows["m_total"]] or [{"dsn_generated": 0}],
        "sender_domains": [{"domain": r["domain"], "messages": r["received"], "bytes": r["bytes_received"]}
                           for r in rows["m_domain"] if r["received"]],
        "attempts": [{"attempts": r["attempts"], "messages": r["received"]} for r in rows["m_attempts"] if r["received"]],
        "deferred_rcpts": rows["deferred"],
        "reasons": rows["reasons"],
        "categories": rows["categories"],
    }
    hours: dict[Any, dict[str, Any]] = {}

    def hour(h: Any) -> dict[str, Any]:
        return hours.setdefault(h, {"hour": h, "received": 0, "delivered": 0, "deferrals": 0, "bounced": 0,
                                    "bytes_received": 0, "bytes_delivered": 0})

    for r in rows["o_hour"]:
        h = hour(r["hour"])
        for k in ("delivered", "deferrals", "bounced", "bytes_delivered"):
            h[k] = r[k]
    for r in rows["m_hour"]:
        if r["received"]:
            h = hour(r["hour"])
            h["received"], h["bytes_received"] = r["received"], r["bytes_received"]
    out["hourly"] = list(hours.values())
    ages = bucket_labels(AGE_BUCKETS_MIN, "m")
    for name, col, count in (("qshape", "tick", "messages"), ("qshape_now", "domain", "recipients")):
        by_age: dict[Any, dict[str, int]] = {}
        for r in rows[f"{name}_age"]:
            by_age.setdefault(r[col], {})[r["age"]] = r[count]
        out[name] = [{**r, **{a: by_age.get(r[col], {}).get(a, 0) for a in ages}} for r in rows[name]]
    side = rows["side"]
    out["problems"] = [{k: r[k] for k in ("file", "segment", "offset", "problem_end", "problem_kind", "problem_reason")}
                       for r in side if r["record_type"] == "PROBLEM"]
    out["segments"] = [{"file": r["file"], "segment": r["segment"], "size": r["size"], "records": r["records"],
                        "sealed": r["sealed"], "created_ts": r["ts"]} for r in side if r["record_type"] == "SEGMENT"]
    seen: set[tuple[Any, ...]] = set()
    out["unknown"] = []
    for r in side:
        if r["record_type"] in ("ENVELOPE", "FLAGGED") and (key := (r["queue_id"], r["rcpt_index"], r["generation"])) not in seen:
            seen.add(key)
            out["unknown"].append({"queue_id": r["queue_id"], "rcpt_index": r["rcpt_index"],
                                   "rcpt_address": r["rcpt_address"], "generation": r["generation"],
                                   "flagged_ts": r["not_before_ts"], "last_reply": r["last_reply"]})
    return out


def _merge_top(by_count: list[dict[str, Any]], by_bytes: list[dict[str, Any]], key: str,
               order: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of both top lists (each row once), in ``order``."""
    seen: dict[Any, dict[str, Any]] = {}
    for r in (*by_count, *by_bytes):
        seen.setdefault(r[key], r)
    return _sorted(list(seen.values()), *order)
