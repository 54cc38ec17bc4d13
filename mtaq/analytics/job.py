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
  a bucket in which a wanted rank falls read again (``find_percentiles``).
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
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from mtaq.analytics import state as state_mod
from mtaq.analytics.connect import open_rows_staged, tasks_staged
from mtaq.analytics.datasource import PARTITION_BYTES_DEFAULT, stage_indexed, stage_open, stage_open_rows
from mtaq.analytics.facts import FACT_SPARK_DDL, OUTCOME_SPARK_DDL
from mtaq.analytics.partials import FILE_PARTS, decode, merge
from mtaq.analytics.percentiles import find_percentiles, merge_p_bucket
from mtaq.analytics.report import write_report
from mtaq.analytics.session import class_archive, is_connect, spark_session, stop_session
from mtaq.analytics.source import discover, join_path, plan_partitions
from mtaq.analytics.staging import (
    KEYED,
    RECIPIENT_SCHEMA,
    SENDER_SCHEMA,
    ddl,
    merge_staged,
    publish,
    pylist,
    read_open_rows,
    read_spark,
    remove_stage,
    small_schemas,
    top_rows,
    write_small,
    write_table,
)
from mtaq.analytics.summary import split_parts, totals_and_tables
from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, Result

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




def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.collect()]


def _micros(t: dt.datetime) -> int:
    """An aware datetime as microseconds since the epoch (UTC), exactly."""
    return (t - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)


def _collect_tables(named: dict[str, DataFrame]) -> dict[str, list[dict[str, Any]]]:
    """Collect many small DataFrames as Arrow, from a few driver threads at once, so that Spark schedules
    their stages together (one plan each: a union of them all took seconds to plan). Timestamps come back
    as naive UTC datetimes (as ``collect()`` gives them with TZ=UTC), rows in no particular order."""
    from concurrent.futures import ThreadPoolExecutor


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
        remove_stage(stage)


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
    listed_ns = time.time_ns()  # before the listing: --state's rule for files modified just before it
    segment_files = discover(opts.paths)  # a path that names no segments: SourceError here, not from inside Spark
    w_since = None if since is None else _micros(since)
    w_until = None if until is None else _micros(until)
    plan: state_mod.StatePlan | None = None
    if opts.state is not None:
        # The last run's partitions whose segments are unchanged are reused (their staged files linked into this
        # run's stage); the tasks compute the rest (mtaq/analytics/state.py).
        plan = state_mod.plan(opts.state, segment_files, opts.partition_bytes, stage, w_since, w_until,
                              opts.close_messages, say, listed_ns)
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
    if is_connect(spark):  # no RDDs: the same function as mapInArrow (mtaq/analytics/connect.py)
        tasks = tasks_staged(spark, indexed, stage, w_until, opts.close_messages, w_since)
    else:
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
    [inventory] = pylist(merge(part_rows)["inventory"])
    say(f"decoded {inventory['records']} records from {inventory['segments']} segments "
        f"({inventory['bytes_read']} bytes)")
    end_value = until if until is not None else inventory["last_ts"]
    if isinstance(end_value, dt.datetime) and end_value.tzinfo is None:
        end_value = end_value.replace(tzinfo=dt.UTC)  # pylist's naive UTC
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
            got_open = list(stage_open(read_open_rows(files.get("facts", [])), stage, since_us, until_us, end_us))
            where = "on the driver"
        else:
            # Partitions by the rows to merge, not by the log's size (one per 32 MB of segments would be 45 at
            # 10,000,000 records, each a task of overhead); timestamps as microseconds, so that no executor's
            # time zone comes into it.
            nparts = -(-inventory["open_rows"] // MERGE_ROWS_PER_PARTITION)
            keyed = read_spark(spark, files.get("facts", []), FACT_SPARK_DDL).filter(
                F.col("record_type").isin(*KEYED)).repartition(nparts, "queue_id")
            names = keyed.columns
            keyed = keyed.select(*(F.unix_micros(F.col(f.name)).alias(f.name) if f.dataType.typeName() == "timestamp"
                                   else F.col(f.name) for f in keyed.schema.fields))
            if is_connect(spark):
                got_open = open_rows_staged(keyed, names, stage, since_us, until_us, end_us)
            else:
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
        [spread] = pylist(merge([x for x in open_parts if x[0] == "inventory"])["inventory"]) or [
            {"outcomes": 0, "messages": 0}]
        say(f"per message and per recipient facts: {spread['outcomes']} outcomes and {spread['messages']} messages "
            f"merged {where}")
    # The tables with a row per sender and per recipient (and the percentiles' read-back) from the partial
    # tables staged in files: added up on the driver (pyarrow) when they are few, else by Spark.
    tables_on_driver = table_rows <= opts.driver_table_rows
    # The percentile buckets: the tasks' files, and what the merge of the open messages added, merged a few
    # at a time, so that the driver holds the merged buckets, not every task's.
    p_bucket = merge_p_bucket(files.get("p_bucket", []), [decode(data) for name, data in part_rows if name == "p_bucket"])
    parts = merge([(name, data) for name, data in part_rows if name != "p_bucket"])
    say("computing the tables")
    shown = max(opts.top, TOP_ROWS_COLLECTED)

    def delays() -> DataFrame:
        """The delivered outcomes in the window (domain, delay_s), for Spark's percentile read-back."""
        oe = read_spark(spark, files.get("outcomes", []), OUTCOME_SPARK_DDL)  # the staged files: in the window already
        return oe.filter(F.col("status") == "delivered").select(
            F.coalesce(F.col("rcpt_domain"), F.lit("?")).alias("domain"), "delay_s")

    if tables_on_driver:
        senders_t = merge_staged("senders", files.get("senders", []), SENDER_SCHEMA)
        recipients_t = merge_staged("recipients", files.get("recipients", []), RECIPIENT_SCHEMA)
        got = {
            "senders_count": [{"senders": senders_t.num_rows}],
            "recipients_count": [{"recipients": recipients_t.num_rows - recipients_t["rcpt_address"].null_count}],
            "senders_by_count": top_rows(senders_t, ("-messages", "-bytes", "sender"), shown),
            "senders_by_bytes": top_rows(senders_t, ("-bytes", "sender"), shown),
            "recipients_by_count": top_rows(recipients_t, ("-delivered", "-bytes", "rcpt_address"), shown),
            "recipients_by_bytes": top_rows(recipients_t, ("-bytes", "rcpt_address"), shown),
        }
        say(f"senders and recipients added up on the driver ({table_rows} partial rows)")
        percentiles = find_percentiles(p_bucket, delays, outcome_paths=files.get("outcomes", []),
                                   driver_rows=opts.driver_table_rows)
    else:
        # Spark adds up the staged partial tables (the tasks' and the open messages').
        senders = read_spark(spark, files.get("senders", []), ddl(SENDER_SCHEMA))
        recipients = read_spark(spark, files.get("recipients", []), ddl(RECIPIENT_SCHEMA))
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
        percentiles = find_percentiles(p_bucket, delays)
    got |= split_parts(parts, percentiles)
    say("tables collected")
    totals, tables = totals_and_tables(got, inventory, since, until)
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
        write_table(os.path.join(tables_dir, "rejections"), rej.table.cast(REJECTION_SCHEMA))
    say("writing the tables (Parquet)")
    os.makedirs(tables_dir, exist_ok=True)
    schemas = small_schemas()
    for name, rows in tables.items():
        if name in ("senders", "recipients"):
            continue
        write_small(os.path.join(tables_dir, name), rows, schemas.get(name))
    write_small(os.path.join(tables_dir, "totals"), [totals], None)
    say(f"writing the outcomes, messages, senders and recipients tables (Parquet, {big})")
    # A row per address: under BIG (--parquet-out on a cluster), as the outcomes and messages are, written by the
    # driver through pyarrow.fs when it added them up, else by the executors (OUT is the driver's: an executor
    # elsewhere would write its part on its own disk).
    if tables_on_driver:
        write_table(join_path(big, "senders"), senders_t)
        write_table(join_path(big, "recipients"), recipients_t)
    else:
        senders.write.mode("overwrite").parquet(join_path(big, "senders"))
        recipients.write.mode("overwrite").parquet(join_path(big, "recipients"))
    # The outcomes (by date) and messages the tasks staged become those tables' files as they are, moved
    # (no second copy by Spark); Spark appends what it merged.
    publish(big, published)
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


