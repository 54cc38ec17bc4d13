"""``mtaq analyze``: the arguments and the run (shared by ``mtaq.cli`` and the ``spark-submit`` entry file).

Imports neither PySpark nor the daemon's logging here, so ``mtaq --help`` works without the ``spark``
extra and a cluster driver needs only PySpark, pyarrow, msgspec, zstandard and matplotlib.

Errors: a bad flag value or a path that names no segments exits 2 with one line naming the flag or the
path; a missing ``spark`` extra exits 2 saying how to install it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Sequence

from mtaq.core.errors import ConfigError, MtaqError

__all__ = ["MALLOC_ENVIRONMENT", "add_arguments", "job_environment", "parse_time", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mtaq analyze``."""
    p.add_argument("--segments", metavar="PATH", action="append", required=True,
                   help="spool dir, archive dir, segment file or glob; local, s3:// or hdfs:// (repeatable)")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory: report.md, PNGs, tables/ (Parquet)")
    p.add_argument("--parquet-out", metavar="URI",
                   help="where executors write the big tables (outcomes, messages, senders, recipients); default "
                        "OUT/tables. On a "
                        "cluster give a shared URI (hdfs://, s3a://)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--master", metavar="URL",
                       help="Spark master (default local[*]; spark-submit's own under spark-submit)")
    where.add_argument("--remote", metavar="sc://HOST:PORT",
                       help="run the job on a Spark Connect server (needs mtaq[spark-connect]; the server must "
                            "see the same --segments and --out paths)")
    p.add_argument("--since", metavar="T", help="count facts at or after T (ISO 8601; UTC unless an offset is given)")
    p.add_argument("--until", metavar="T", help="count facts before T (ISO 8601; UTC unless an offset is given)")
    p.add_argument("--json", action="store_true", help="also print the headline totals as one JSON object on stdout")
    p.add_argument("--top", metavar="N", type=int, default=20, help="rows in the report's top-N tables (default 20)")
    p.add_argument("--partition-bytes", metavar="N", type=int, default=64 * 1024 * 1024,
                   help="pack whole segments into Spark partitions of about N bytes (default 67108864)")
    p.add_argument("--conf", metavar="KEY=VALUE", action="append", default=[],
                   help="extra Spark configuration, e.g. spark.driver.memory=4g (repeatable)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--events", metavar="FILE", nargs="+", action="extend", default=[],
                   help="the daemon's JSON event log files (rotated ones too, .gz): refusals into the rejections "
                        "table and the report")
    p.add_argument("--state", metavar="DIR",
                   help="keep what this run read in DIR (local) and read only new segments next time (incremental)")


def parse_time(value: str | None, flag: str) -> dt.datetime | None:
    """ISO 8601 date or date-time -> aware UTC datetime (naive means UTC). Raises ConfigError naming ``flag``."""
    if value is None:
        return None
    try:
        t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError(f"{flag}: cannot parse {value!r} as an ISO 8601 time (e.g. 2025-03-01T00:00:00Z)") from exc
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.astimezone(dt.UTC)


# The C library's allocator in the Spark processes mtaq analyze starts (the driver JVM, its Python workers):
# blocks up to 32 MiB from the heap (not each its own mapping), freed memory kept up to 1 GiB, the heap grown
# 256 MiB at a time. A worker's task allocates and frees some 400 MB; with glibc's defaults every task touched
# fresh pages again (16,000-26,000 page faults a 64 MB segment, 105,000 in a worker's first), with these none
# after the first. 10,000,000 records: 0.2-0.4 s less (docs/performance.md, "Stop 54"). Read by glibc when a
# process starts, so not in this process.
MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                      "MALLOC_TOP_PAD_": str(256 << 20)}


def job_environment() -> None:
    """Set, in ``os.environ`` and only where they are not set, ``ARROW_DEFAULT_MEMORY_POOL`` (``system``) for
    this process and the Spark processes it starts, and MALLOC_ENVIRONMENT for those processes. Before
    anything in this process allocates with Arrow."""
    # Arrow's allocations with the C library's allocator, unless the environment names one: in this process
    # and in the Spark processes it starts, which inherit the variable (read once, at Arrow's first allocation;
    # pyarrow.set_memory_pool, datasource.task_memory_pool, does not reach Acero's group-bys and joins). With
    # mimalloc the driver took 0.25-0.30 s to add up the recipients' partial rows of 1,000,000 records,
    # against 0.05-0.08 s (docs/performance.md, "Stop 52").
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    for k, v in MALLOC_ENVIRONMENT.items():
        os.environ.setdefault(k, v)


def run(args: argparse.Namespace) -> int:
    """Validate ``args``, start Spark, run the job; print the totals as JSON with ``--json``. Returns 0. Sets
    the allocators' variables of :func:`job_environment` where the environment does not."""
    job_environment()
    since = parse_time(args.since, "--since")
    until = parse_time(args.until, "--until")
    if since is not None and until is not None and since >= until:
        raise ConfigError(f"--since {args.since} is not before --until {args.until}")
    if args.top < 1:
        raise ConfigError(f"--top: expected an integer >= 1, got {args.top}")
    if args.partition_bytes < 1:
        raise ConfigError(f"--partition-bytes: expected an integer >= 1, got {args.partition_bytes}")
    remote = getattr(args, "remote", None)
    if remote is not None and not remote.startswith("sc://"):
        raise ConfigError(f"--remote: expected a Spark Connect URL sc://HOST:PORT, got {remote!r}")
    if remote is not None and "PYSPARK_GATEWAY_PORT" in os.environ:
        raise ConfigError("--remote: not under spark-submit (its --master says where the job runs)")
    if args.state is not None and "://" in (args.parquet_out or "") + args.state:
        raise ConfigError("--state: the state directory and --parquet-out must be local paths with --state")
    if args.state is not None:
        try:  # a state directory that cannot be made: one line now, not a traceback after the job
            os.makedirs(os.path.join(args.state, "files"), exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--state {args.state}: {exc.strerror or exc}") from exc
    conf = []
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--conf: expected KEY=VALUE, got {item!r}")
        conf.append((key.strip(), value.strip()))
    if args.quiet:
        conf.insert(0, ("spark.ui.showConsoleProgress", "false"))  # no stage bars either (--conf may say otherwise)
    try:
        from mtaq.analytics.session import RemoteError, class_archive, one_line, redact, spark_session, stop_session
        from mtaq.analytics.source import SourceError, discover
    except ImportError as exc:
        raise ConfigError(f"analyze needs the spark extra (pip install 'mtaq[spark]'): {exc}") from exc
    for path in args.events:
        if not os.path.isfile(path):
            raise ConfigError(f"--events {path}: no such file")
    flag = "--remote"  # what named the Spark Connect server, in the lines we print
    from_env = os.environ.get("SPARK_REMOTE") or None
    if remote is None and from_env is not None:
        # PySpark takes SPARK_REMOTE as "run on Spark Connect", and so does analyze, as if --remote named it. Set
        # beside a master, PySpark refuses the two together with a traceback that prints the URL and its token.
        flag = "SPARK_REMOTE"
        if args.master is not None:
            raise ConfigError(f"--master {args.master}: SPARK_REMOTE={redact(from_env)} is set in the environment "
                              "(Spark Connect); unset it to run on a master")
        if "PYSPARK_GATEWAY_PORT" in os.environ:
            raise ConfigError(f"SPARK_REMOTE={redact(from_env)}: not under spark-submit (its --master says where the "
                              "job runs); unset it")
        if not from_env.startswith("sc://"):
            raise ConfigError(f"SPARK_REMOTE: expected a Spark Connect URL sc://HOST:PORT, got {redact(from_env)!r}")
        remote = from_env
    try:
        discover(args.segments)  # fail fast, before Spark starts, on a path that names nothing
    except SourceError as exc:
        raise ConfigError(f"--segments {exc}") from exc
    segments = list(args.segments)
    if remote is not None:  # the server resolves the paths: relative ones from this directory, not its own
        segments = [p if "://" in p else os.path.abspath(p) for p in segments]
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"mtaq analyze [{time.monotonic() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    # While the driver JVM starts (1.5-2 s, mostly one core): the job's own modules that do not import PySpark
    # (the facts, whose module-level pa.array loads pandas, the partials: 0.3 s) and matplotlib (0.5 s), on
    # threads, instead of before or after it. Neither thread imports a PySpark or py4j module (checked
    # transitively), so no import cycle with the session's start can form: a module both import (pandas, which
    # PySpark's start imports too; dateutil) makes one wait for the other, never a deadlock.
    import threading

    threading.Thread(target=_import_job_modules, name="mtaq-import-job", daemon=True).start()
    if not args.no_plots:
        threading.Thread(target=_import_plotting, name="mtaq-import-matplotlib", daemon=True).start()
    shown = None if remote is None else redact(remote)  # the URL without its token, in every line we print
    say("starting Spark" if remote is None else f"connecting to Spark Connect at {shown}")
    try:
        spark = spark_session(args.master, conf, remote=remote, sql_on_demand=True)
    except ImportError as exc:  # only --remote imports more than the spark extra
        raise ConfigError(f"{flag} needs the spark-connect extra (pip install 'mtaq[spark-connect]'): {exc}") from exc
    except ValueError as exc:  # PySpark's own check of a Spark Connect URL
        raise ConfigError(f"{flag} {shown}: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{flag} {shown}: cannot reach the Spark Connect server: {exc.strerror or exc}") from exc
    except RemoteError as exc:
        raise ConfigError(f"{flag} {shown}: {exc}") from exc
    say(f"Spark started (class archive: {class_archive(spark)})")
    try:
        from mtaq.analytics.job import Options, analyze
    except ImportError as exc:
        stop_session(spark)
        raise ConfigError(f"analyze needs the spark extra (pip install 'mtaq[spark]'): {exc}") from exc
    opts = Options(paths=segments, out=args.out, since=since, until=until, top=args.top,
                   partition_bytes=args.partition_bytes, plots=not args.no_plots, progress=say,
                   parquet_out=args.parquet_out, state=args.state,
                   events=args.events)
    try:
        try:
            result = analyze(spark, opts)
        finally:
            if class_archive(spark) == "creating":
                say("writing the class archive for the next runs (once)")
            stop_session(spark)
    except Exception as exc:
        if remote is None or not type(exc).__module__.startswith("pyspark"):
            raise
        # The server went away or failed the job (its errors are PySpark's): one line, not the client's traceback.
        raise MtaqError(f"{flag} {shown}: the Spark Connect server failed the job: {one_line(exc)}") from exc
    if args.json:
        keys = ("received", "delivered", "deferred", "bounced", "rejected", "deferrals", "expired", "dsn_generated",
                "bytes_received", "bytes_delivered", "delay_p50_s", "delay_p90_s", "delay_p99_s", "outcome_unknown",
                "problems", "segments", "records")
        print(json.dumps({k: result.totals[k] for k in keys}), flush=True)
    return 0


def _import_job_modules() -> None:
    """Import the job's modules that do not import PySpark (:func:`run` does it on a thread while the driver
    JVM starts); an error here is raised again by the job's own import."""
    try:
        import pyarrow.parquet  # noqa: F401

        import mtaq.analytics.facts
        import mtaq.analytics.partials
        import mtaq.analytics.report
        import mtaq.analytics.state  # noqa: F401
    except Exception:
        pass


def _import_plotting() -> None:
    """Import matplotlib with the Agg backend, as :mod:`mtaq.analytics.report` does (nothing if absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except Exception:  # the report says what is missing when it gets there
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``python mtaq/analytics/submit.py ARGS`` / ``spark-submit ... submit.py ARGS``: the analyze command."""
    p = argparse.ArgumentParser(prog="mtaq analyze", description="Delivery statistics from queue-log segments (Spark).")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:
        print(f"mtaq: {exc}", file=sys.stderr)
        return 2
