"""The delivery-statistics job: segments in, Parquet tables, ``totals.json`` and a report out (PySpark).

``analyze(spark, Options)`` reads segments through the ``mtaq`` data source, derives per-message and
per-recipient facts with Spark SQL, writes every table as Parquet under ``OUT/tables/``, and renders
``OUT/report.md`` with PNG plots (:mod:`mtaq.analytics.report`). It runs unchanged on ``local[*]`` and
under ``spark-submit`` on a cluster (``mtaq/analytics/submit.py`` is the entry file).

Definitions (each fact is counted in the ``--since``/``--until`` window by its own time, UTC):

* received: messages accepted over SMTP (first envelope, ``bounce_of`` empty), at arrival; bytes
  received is the sum of their sizes. DSNs that mtaq generated are counted apart (``dsn_generated``).
* delivered / deferrals / bounced: recipient outcomes (DELIVERY records) 2xx / 4xx / 5xx, at the reply.
  A recipient whose last reply was 4xx in a message that then FINISHed ran out of queue lifetime: it
  counts as bounced (``expired``, 4.4.7) at the FINISH. ``deferred`` is the number of distinct recipients
  deferred at least once. Bytes delivered is the message size summed over delivered recipients.
* rejected: always 0 here. Mail refused at the SMTP door never reaches the queue log (the edge answers
  4xx/5xx before anything is appended), so the log cannot count it; the report says so.
* time to deliver: delivered outcome time minus arrival, in seconds; percentiles are nearest-rank
  (``percentile_approx`` with accuracy 10000: exact below 10,000 values, within 0.01 % of rank above).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from mtaq.analytics.datasource import PARTITION_BYTES_DEFAULT, register
from mtaq.analytics.report import write_report
from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, Result, bucket_labels

__all__ = ["AGE_BUCKETS_MIN", "DELAY_BUCKETS_S", "Options", "Result", "analyze", "spark_session"]

REJECTED_NOTE = (
    "rejected is 0: mail refused at the SMTP door (4xx/5xx before DATA is queued) never reaches the queue "
    "log, which holds only accepted mail; count rejections from the daemon's SMTP logs instead."
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
    progress: Callable[[str], None] = field(default=lambda msg: None)


def spark_session(master: str | None = None, conf: Sequence[tuple[str, str]] = (), app: str = "mtaq analyze") -> SparkSession:
    """A SparkSession in UTC. ``master`` None means ``local[*]``, except under ``spark-submit`` (its own)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # collect() turns timestamps into naive datetimes in the process's local time zone: make that UTC.
    os.environ["TZ"] = "UTC"
    time.tzset()
    b = SparkSession.builder.appName(app)
    if master:
        b = b.master(master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        b = b.master("local[*]")
    b = b.config("spark.sql.session.timeZone", "UTC").config("spark.ui.showConsoleProgress", "true")
    # The tables are small after aggregation: Spark's 200 shuffle partitions cost more than they bring here.
    b = b.config("spark.sql.shuffle.partitions", "16")
    for k, v in conf:
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


def _window(col: Column, since: dt.datetime | None, until: dt.datetime | None) -> Column:
    cond = col.isNotNull()
    if since is not None:
        cond = cond & (col >= F.lit(since))
    if until is not None:
        cond = cond & (col < F.lit(until))
    return cond


def _seconds_between(later: Column, earlier: Column) -> Column:
    return (F.unix_micros(later) - F.unix_micros(earlier)) / F.lit(1e6)


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.collect()]


def _write_small(directory: str, rows: list[dict[str, Any]], df: DataFrame | None) -> None:
    """Write collected rows as ``directory/part-0.parquet`` on the driver (no second Spark job)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    os.makedirs(directory, exist_ok=True)
    if df is not None:
        table = pa.Table.from_pylist(rows, schema=to_arrow_schema(df.schema, timezone="UTC"))
    else:
        table = pa.Table.from_pylist([{k: v for k, v in r.items() if v is not None} for r in rows])
    pq.write_table(table, os.path.join(directory, "part-0.parquet"))


def _bucket_label(bounds: Sequence[int], unit: str, value: Column) -> Column:
    expr = F.lit(f">{bounds[-1]}{unit}")
    lo = 0
    labels = []
    for b in bounds:
        labels.append((b, f"{lo}-{b}{unit}"))
        lo = b
    for b, label in reversed(labels):
        expr = F.when(value < b, F.lit(label)).otherwise(expr)
    return expr


def analyze(spark: SparkSession, opts: Options) -> Result:
    """Run the whole analysis; write Parquet tables, ``totals.json`` and the report under ``opts.out``.

    Raises :class:`mtaq.analytics.source.SourceError` when a path names no segments.
    """
    t0 = time.monotonic()
    say = opts.progress
    since, until = opts.since, opts.until
    register(spark)
    tables_dir = os.path.join(opts.out, "tables")
    say(f"reading segments from {', '.join(opts.paths)}")
    ev = (
        spark.read.format("mtaq")
        .option("paths", json.dumps(list(opts.paths)))
        .option("partitionBytes", str(opts.partition_bytes))
        .load()
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    inventory = ev.filter(F.col("record_type") == "SEGMENT").agg(
        F.count("*").alias("segments"), F.sum("records").alias("records"), F.sum("size").alias("bytes_read"),
        F.min("ts").alias("first_segment_ts"),
    ).first()
    assert inventory is not None
    say(f"decoded {inventory['records'] or 0} records from {inventory['segments']} segments "
        f"({inventory['bytes_read'] or 0} bytes)")
    rt = F.col("record_type")

    envs = ev.filter(rt == "ENVELOPE")
    rcpts = envs.groupBy("queue_id", "rcpt_index").agg(
        F.max("rcpt_address").alias("rcpt_address"), F.max("rcpt_domain").alias("rcpt_domain")
    )
    msgs = (
        envs.groupBy("queue_id")
        .agg(
            F.min("arrival_ts").alias("arrival_ts"),
            F.max("size").alias("size"),
            F.max("sender").alias("sender"),
            F.max("sender_domain").alias("sender_domain"),
            F.max("bounce_of").alias("bounce_of"),
            F.max(F.col("generation") == 0).alias("first_seen"),
            F.countDistinct("rcpt_index").alias("recipients"),
        )
        .join(ev.filter(rt == "START").groupBy("queue_id").agg(F.count("*").alias("attempts")), "queue_id", "left")
        .join(ev.filter(rt == "FINISH").groupBy("queue_id").agg(F.max("ts").alias("finish_ts")), "queue_id", "left")
        .withColumn("attempts", F.coalesce(F.col("attempts"), F.lit(0)))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    received = msgs.filter(F.col("first_seen") & (F.col("bounce_of") == "") & _window(F.col("arrival_ts"), since, until))

    outcomes = (
        ev.filter(rt == "DELIVERY")
        .select("queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset")
        .join(rcpts, ["queue_id", "rcpt_index"], "left")
        .join(msgs.select("queue_id", "arrival_ts", "size", "sender", "bounce_of", "finish_ts"), "queue_id", "left")
        .withColumn("delay_s", _seconds_between(F.col("ts"), F.col("arrival_ts")))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    last = Window.partitionBy("queue_id", "rcpt_index").orderBy(F.desc("ts"), F.desc("segment"), F.desc("offset"))
    expired = (
        outcomes.withColumn("rn", F.row_number().over(last))
        .filter((F.col("rn") == 1) & (F.col("status") == "deferred") & F.col("finish_ts").isNotNull()
                & (F.col("finish_ts") >= F.col("ts")))
        .select(
            "queue_id", "rcpt_index", F.col("finish_ts").alias("ts"), F.lit("expired").alias("status"),
            F.lit(None).cast("int").alias("code"), F.lit("4.4.7").alias("enhanced"),
            F.concat(F.lit("queue lifetime exceeded; last reply: "), F.col("text")).alias("text"), "relay",
            "segment", "offset", "rcpt_address", "rcpt_domain", "arrival_ts", "size", "sender", "bounce_of",
            "finish_ts", _seconds_between(F.col("finish_ts"), F.col("arrival_ts")).alias("delay_s"),
        )
    )
    oe = outcomes.unionByName(expired).filter(_window(F.col("ts"), since, until)).persist(StorageLevel.MEMORY_AND_DISK)
    st = F.col("status")
    is_bounce = st.isin("failed", "expired")

    # ---------------------------------------------------------------------------------------- totals
    say("totals")
    r = received.agg(F.count("*").alias("received"), F.coalesce(F.sum("size"), F.lit(0)).alias("bytes_received"),
                     F.countDistinct("sender").alias("senders"),
                     F.countDistinct("sender_domain").alias("sending_domains")).first()
    o = oe.agg(
        F.sum(F.when(st == "delivered", 1).otherwise(0)).alias("delivered"),
        F.sum(F.when(st == "delivered", F.col("size")).otherwise(0)).alias("bytes_delivered"),
        F.sum(F.when(st == "deferred", 1).otherwise(0)).alias("deferrals"),
        F.countDistinct(F.when(st == "deferred", F.struct("queue_id", "rcpt_index"))).alias("deferred"),
        F.sum(F.when(is_bounce, 1).otherwise(0)).alias("bounced"),
        F.sum(F.when(st == "expired", 1).otherwise(0)).alias("expired"),
        F.countDistinct(F.when(st == "delivered", F.col("rcpt_address"))).alias("recipients"),
        F.countDistinct(F.when(st == "delivered", F.col("rcpt_domain"))).alias("recipient_domains"),
        F.percentile_approx(F.when(st == "delivered", F.col("delay_s")), [0.5, 0.9, 0.99], 10000).alias("p"),
        F.avg(F.when(st == "delivered", F.col("delay_s"))).alias("delay_mean_s"),
        F.max(F.when(st == "delivered", F.col("delay_s"))).alias("delay_max_s"),
    ).first()
    dsn = msgs.filter(F.col("first_seen") & (F.col("bounce_of") != "") & _window(F.col("arrival_ts"), since, until)).count()
    unknown_df = (
        envs.filter(F.col("rcpt_unknown") & _window(F.col("not_before_ts"), since, until))
        .select("queue_id", "rcpt_index", "rcpt_address", "generation", F.col("not_before_ts").alias("flagged_ts"),
                "last_reply")
        .dropDuplicates(["queue_id", "rcpt_index", "generation"])
        .orderBy("flagged_ts", "queue_id", "rcpt_index")
    )
    problems_df = ev.filter(rt == "PROBLEM").select(
        "file", "segment", "offset", "problem_end", "problem_kind", "problem_reason").orderBy("segment", "offset")
    problems = _rows(problems_df)
    unknown = _rows(unknown_df)
    assert r is not None and o is not None
    p = o["p"] or [None, None, None]
    totals: dict[str, Any] = {
        "received": r["received"],
        "delivered": o["delivered"] or 0,
        "deferred": o["deferred"] or 0,
        "bounced": o["bounced"] or 0,
        "rejected": 0,
        "deferrals": o["deferrals"] or 0,
        "expired": o["expired"] or 0,
        "dsn_generated": dsn,
        "bytes_received": r["bytes_received"],
        "bytes_delivered": o["bytes_delivered"] or 0,
        "senders": r["senders"],
        "sending_domains": r["sending_domains"],
        "recipients": o["recipients"],
        "recipient_domains": o["recipient_domains"],
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

    # ------------------------------------------------------------------------------- tables
    tables: dict[str, list[dict[str, Any]]] = {"problems": problems, "unknown": unknown}
    say("per-domain, per-sender and per-recipient tables")
    delivered = st == "delivered"
    domains = (
        oe.groupBy(F.coalesce(F.col("rcpt_domain"), F.lit("?")).alias("domain"))
        .agg(
            F.sum(F.when(delivered, 1).otherwise(0)).alias("delivered"),
            F.sum(F.when(delivered, F.col("size")).otherwise(0)).alias("bytes_delivered"),
            F.sum(F.when(st == "deferred", 1).otherwise(0)).alias("deferrals"),
            F.countDistinct(F.when(st == "deferred", F.struct("queue_id", "rcpt_index"))).alias("deferred"),
            F.sum(F.when(is_bounce, 1).otherwise(0)).alias("bounced"),
            F.avg(F.when(delivered, F.col("delay_s"))).alias("delay_mean_s"),
            F.max(F.when(delivered, F.col("delay_s"))).alias("delay_max_s"),
            F.percentile_approx(F.when(delivered, F.col("delay_s")), [0.5, 0.9, 0.99], 10000).alias("p"),
        )
        .select("*", F.col("p")[0].alias("delay_p50_s"), F.col("p")[1].alias("delay_p90_s"),
                F.col("p")[2].alias("delay_p99_s"))
        .drop("p")
        .orderBy(F.desc("delivered"), F.desc("deferrals"), "domain")
    )
    senders = (
        received.groupBy("sender", "sender_domain")
        .agg(F.count("*").alias("messages"), F.sum("size").alias("bytes"))
        .orderBy(F.desc("messages"), F.desc("bytes"), "sender")
    )
    sender_domains = (
        received.groupBy(F.col("sender_domain").alias("domain"))
        .agg(F.count("*").alias("messages"), F.sum("size").alias("bytes"))
        .orderBy(F.desc("messages"), "domain")
    )
    recipients = (
        oe.filter(delivered)
        .groupBy("rcpt_address", "rcpt_domain")
        .agg(F.count("*").alias("delivered"), F.sum("size").alias("bytes"))
        .orderBy(F.desc("delivered"), F.desc("bytes"), "rcpt_address")
    )
    say("deferral and bounce reasons")
    reasons = (
        oe.filter(st.isin("deferred", "failed", "expired"))
        .groupBy(F.when(st == "failed", "bounced").otherwise(st).alias("status"), "enhanced", "relay")
        .agg(F.count("*").alias("count"),
             F.countDistinct("queue_id", "rcpt_index").alias("recipients"),
             F.countDistinct("queue_id").alias("messages"),
             F.min("text").alias("example"))
        .orderBy(F.desc("count"), "status", "enhanced", "relay")
    )
    say("per-hour and per-day traffic")
    facts = (
        received.select(F.col("arrival_ts").alias("t"), F.lit("received").alias("kind"), F.col("size").alias("bytes"))
        .unionByName(oe.select(F.col("ts").alias("t"),
                               F.when(st == "expired", "bounced").when(st == "failed", "bounced").otherwise(st).alias("kind"),
                               F.when(delivered, F.col("size")).otherwise(0).alias("bytes")))
    )
    kinds: list[Any] = ["received", "delivered", "deferred", "bounced"]

    def traffic(key: Column, name: str) -> DataFrame:
        return (
            facts.groupBy(key.alias(name)).pivot("kind", kinds).agg(F.count(F.lit(1)))
            .join(facts.groupBy(key.alias(name)).agg(
                F.sum(F.when(F.col("kind") == "received", F.col("bytes")).otherwise(0)).alias("bytes_received"),
                F.sum(F.when(F.col("kind") == "delivered", F.col("bytes")).otherwise(0)).alias("bytes_delivered")), name)
            .na.fill(0, kinds)
            .withColumnRenamed("deferred", "deferrals")
            .orderBy(name)
        )

    hourly = traffic(F.date_trunc("hour", F.col("t")), "hour")
    daily = traffic(F.to_date(F.col("t")), "day")
    say("time to deliver and attempts")
    delays = (
        oe.filter(delivered)
        .groupBy(_bucket_label(DELAY_BUCKETS_S, "s", F.col("delay_s")).alias("bucket"))
        .agg(F.count("*").alias("delivered"))
    )
    attempts = received.groupBy("attempts").agg(F.count("*").alias("messages")).orderBy("attempts")
    say("queue shape over time")
    last_ts = ev.filter(rt.isin("ENVELOPE", "START", "DELIVERY", "FINISH")).agg(F.max("ts")).first()
    end_ts = F.lit(until) if until is not None else F.lit(last_ts[0] if last_ts is not None else None)
    q = msgs
    first_tick = F.date_trunc("hour", F.col("arrival_ts"))
    first_tick = F.when(first_tick == F.col("arrival_ts"), first_tick).otherwise(first_tick + F.expr("INTERVAL 1 HOUR"))
    gone = F.coalesce(F.col("finish_ts") - F.expr("INTERVAL 1 MICROSECOND"), end_ts)
    last_tick = F.date_trunc("hour", F.least(gone, end_ts))
    ticks = (
        q.select("queue_id", "arrival_ts", "size", first_tick.alias("a"), last_tick.alias("b"))
        .filter(F.col("a") <= F.col("b"))
        .select("arrival_ts", "size", F.explode(F.sequence("a", "b", F.expr("INTERVAL 1 HOUR"))).alias("tick"))
        .filter(_window(F.col("tick"), since, until))
        .withColumn("age", _bucket_label(AGE_BUCKETS_MIN, "m", _seconds_between(F.col("tick"), F.col("arrival_ts")) / 60))
    )
    age_labels: list[Any] = bucket_labels(AGE_BUCKETS_MIN, "m")
    qshape = (
        ticks.groupBy("tick").pivot("age", age_labels).agg(F.count(F.lit(1)))
        .join(ticks.groupBy("tick").agg(F.count("*").alias("messages"), F.sum("size").alias("bytes")), "tick")
        .na.fill(0, age_labels)
        .select("tick", "messages", "bytes", *age_labels)
        .orderBy("tick")
    )
    final = outcomes.filter(st.isin("delivered", "failed") & (F.col("ts") <= end_ts)).select("queue_id", "rcpt_index")
    pending = (
        msgs.filter((F.col("arrival_ts") <= end_ts) & (F.col("finish_ts").isNull() | (F.col("finish_ts") > end_ts)))
        .select("queue_id", "arrival_ts")
        .join(rcpts, "queue_id")
        .join(final, ["queue_id", "rcpt_index"], "left_anti")
        .withColumn("age", _bucket_label(AGE_BUCKETS_MIN, "m", _seconds_between(end_ts, F.col("arrival_ts")) / 60))
    )
    qshape_now = (
        pending.groupBy(F.coalesce("rcpt_domain", F.lit("?")).alias("domain")).pivot("age", age_labels).agg(F.count(F.lit(1)))
        .join(pending.groupBy(F.coalesce("rcpt_domain", F.lit("?")).alias("domain")).agg(
            F.count("*").alias("recipients")), "domain")
        .na.fill(0, age_labels)
        .select("domain", "recipients", *age_labels)
        .orderBy(F.desc("recipients"), "domain")
    )
    segments = ev.filter(rt == "SEGMENT").select("file", "segment", "size", "records", "sealed",
                                                 F.col("ts").alias("created_ts")).orderBy("segment", "file")

    small = {
        "domains": domains, "senders": senders, "sender_domains": sender_domains, "recipients": recipients,
        "reasons": reasons, "hourly": hourly, "daily": daily, "delays": delays, "attempts": attempts,
        "qshape": qshape, "qshape_now": qshape_now, "segments": segments,
    }
    say("collecting the tables")
    os.makedirs(tables_dir, exist_ok=True)
    for name, df in {**small, "problems": problems_df, "unknown": unknown_df}.items():
        rows = tables.get(name) if name in ("problems", "unknown") else None
        if rows is None:
            rows = tables[name] = _rows(df)
        _write_small(os.path.join(tables_dir, name), rows, df)
    _write_small(os.path.join(tables_dir, "totals"), [totals], None)
    big = opts.parquet_out or tables_dir
    say(f"writing the outcomes and messages tables (Parquet, {big})")
    (oe.withColumn("date", F.to_date("ts")).write.mode("overwrite").partitionBy("date")
     .parquet(f"{big.rstrip('/')}/outcomes"))
    msgs.write.mode("overwrite").parquet(f"{big.rstrip('/')}/messages")
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "totals.json"), "w", encoding="utf-8") as f:
        json.dump(totals, f, indent=2, default=str)
        f.write("\n")
    say("writing the report")

    result = Result(totals, tables, time.monotonic() - t0)
    write_report(opts.out, result, top=opts.top, plots=opts.plots)
    for df in (oe, outcomes, msgs, ev):
        df.unpersist()
    result.seconds = time.monotonic() - t0
    say(f"done in {result.seconds:.1f} s: {opts.out}/report.md")
    return result
