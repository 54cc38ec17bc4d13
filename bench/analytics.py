"""Benchmark: records/s of the Spark job on local[2] against a plain single-process Python scan (same codec).

Generates segments directly with :class:`mtaq.storage.log.Log` (realistic record sequences, not SMTP):
per message DATA, ENVELOPE, START, DELIVERY, then FINISH or a replacement (DATA copied forward, ENVELOPE)
and more attempts. Mix: 80 % delivered at once, 10 % deferred once then delivered 30 min later, 5 %
bounced (5xx), 5 % deferred three times then delivered; 1-3 recipients per message; arrivals spread over
``--days`` days. Then it measures, on the same segments:

* ``plain``: :func:`mtaq.analytics.plain.plain_totals`, one Python process (parse + headline totals);
* ``spark_scan``: the ``mtaq`` data source alone on ``--master`` (parse + count of rows);
* ``spark_job``: the whole ``mtaq analyze`` job (every table, Parquet, report), in the same Spark session;
* ``spark_job_cold_process`` (``--cold``): ``mtaq analyze`` run as a user runs it, in a fresh process,
  JVM and Spark start-up included;
* ``pflogsumm`` (``--pflogsumm``): the same messages as Postfix 3.7 would have logged them (smtpd, cleanup,
  qmgr, smtp lines with mtaq's queue IDs, one smtp line per recipient outcome; :func:`postfix_log`), read by
  ``pflogsumm`` (Debian package) just before each fresh-process job (``--pairs`` of them, alternating;
  medians); its totals (received, delivered) are checked against the segments'.
  ``cold_job_vs_pflogsumm_per_message`` > 1 means mtaq is faster per message.

The fresh-process jobs find the driver JVM's class archive (mtaq/analytics/jvm.py) that the in-process
session made or found (``class_archive``: "used"); ``--first-run`` also times a machine's first job (no
archive yet: it is written at the job's end) and ``--without-archive`` one with the archive off.

Prints one JSON object: for each, seconds, records/s, MB/s (segment bytes, DATA included) and messages/s
(received + DSNs, to compare with pflogsumm's messages/s); the load average; whether the totals agree.

    .venv/bin/python bench/analytics.py --records 10000000 --dir /tmp/mtaq-bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from mtaq.analytics.command import job_environment
from mtaq.core.records import DataRecord, DeliveryRecord, EnvelopeRecord, FinishRecord, Outcome, Recipient, StartRecord
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log

# As `mtaq analyze` sets them for its own process and the Spark processes it starts (job_environment in
# mtaq/analytics/command.py), so that the in-process job is measured as the command runs it; before anything
# imports pyarrow (none of the imports above does).
job_environment()


def generate(spool: str, records: int, *, days: int = 3, body_bytes: int = 300, seed: int = 7, prefix: str = "B",
             t0: float = 1_740_787_200.0) -> int:
    """Write about ``records`` records into ``spool/log`` (appended after what is there, as a restarted daemon
    does: its last segment sealed, a new one opened); queue IDs ``PREFIX`` + number, arrivals from ``t0``
    (default 2025-03-01T00:00:00Z) over ``days``; return the number written (seals excluded)."""
    rnd = random.Random(seed)
    log, _ = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=64 << 20)
    body = b"Subject: bench\r\n\r\n" + b"x" * (body_bytes - 20) + b"\r\n"
    domains = [f"d{i}.example" for i in range(200)]
    senders = [f"s{i}@src{i % 50}.example" for i in range(1000)]
    span = days * 86400.0
    n = 0
    i = 0
    while n < records:
        i += 1
        qid = f"{prefix}{i:014d}"
        now = t0 + span * (i * 0.6180339887 % 1.0)
        rcpts = tuple(Recipient(k, f"u{rnd.randrange(5000)}@{rnd.choice(domains)}") for k in range(rnd.randint(1, 3)))
        sender = rnd.choice(senders)
        roll = rnd.random()
        plan = (["ok"] if roll < 0.8 else ["def", "ok"] if roll < 0.9 else ["bounce"] if roll < 0.95
                else ["def", "def", "def", "ok"])
        data, _ = log.append(DataRecord(qid, body))
        env = EnvelopeRecord(qid, 0, now, now, sender, rcpts, data, len(body), client="192.0.2.1", helo="c.example")
        env_pos, _ = log.append(env)
        n += 2
        for a, step in enumerate(plan):
            start, _ = log.append(StartRecord(qid, env_pos, now, env.runner))
            if step == "ok":
                outs = tuple(Outcome(r.index, "delivered", 250, "2.0.0", "Ok") for r in env.recipients)
            elif step == "bounce":
                outs = tuple(Outcome(r.index, "failed", 550, "5.1.1", "no such user") for r in env.recipients)
            else:
                outs = tuple(Outcome(r.index, "deferred", 451, "4.2.0", "try later") for r in env.recipients)
            log.append(DeliveryRecord(qid, start, now + 0.2, "mx[192.0.2.25]:25", outs))
            n += 2
            if step != "def":
                log.append(FinishRecord(qid, start, now + 0.2))
                n += 1
                break
            now += 1800.0
            data, _ = log.append(DataRecord(qid, body))
            env = EnvelopeRecord(qid, env.generation + 1, env.arrival_ts, now, sender, env.recipients, data, len(body),
                                 attempts=a + 1, replaces=start, runner=min(a + 1, 4))
            env_pos, _ = log.append(env)
            n += 2
    asyncio.run(log.sync())
    log.close()
    return n


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _syslog_time(ts: float) -> str:
    t = time.gmtime(ts)
    return f"{_MONTHS[t.tm_mon - 1]} {t.tm_mday:2d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"


def postfix_log(spool: str, path: str) -> dict[str, int]:
    """Write, from the same segments, the log Postfix 3.7 would have written for the same messages (smtpd
    connect/client/disconnect, cleanup message-id, qmgr from/size/nrcpt, one smtp line per recipient outcome
    with its dsn and status sent/deferred/bounced, qmgr removed), in log order, to ``path``; return
    {"lines": N, "messages": received, "delivered": sent recipients}. The queue IDs are mtaq's."""
    from mtaq.analytics.source import discover, read_segment_bytes
    from mtaq.core.frame import scan_segment

    rcpts: dict[str, dict[int, str]] = {}
    sizes: dict[str, int] = {}
    arrival: dict[str, float] = {}
    lines = messages = delivered = 0
    pid = {"smtpd": 1201, "cleanup": 1202, "qmgr": 1100, "smtp": 1203}
    with open(path, "w", encoding="ascii", errors="replace") as out:
        w = out.write
        for sf in discover([spool]):
            for _pos, rec in scan_segment(sf.segment, read_segment_bytes(sf), skip_data=True).records:
                if isinstance(rec, EnvelopeRecord):
                    q = rec.queue_id
                    rcpts[q] = {r.index: r.address for r in rec.recipients}
                    if rec.generation != 0:
                        continue
                    sizes[q] = rec.size
                    arrival[q] = rec.arrival_ts
                    stamp = f"{_syslog_time(rec.arrival_ts)} mx1 postfix"
                    client = f"{rec.helo or 'unknown'}[{rec.client or '127.0.0.1'}]"
                    n = len(rec.recipients)
                    w(f"{stamp}/smtpd[{pid['smtpd']}]: connect from {client}\n"
                      f"{stamp}/smtpd[{pid['smtpd']}]: {q}: client={client}\n"
                      f"{stamp}/cleanup[{pid['cleanup']}]: {q}: message-id=<{q}@{rec.helo or 'localhost'}>\n"
                      f"{stamp}/qmgr[{pid['qmgr']}]: {q}: from=<{rec.sender}>, size={rec.size}, nrcpt={n} (queue active)\n"
                      f"{stamp}/smtpd[{pid['smtpd']}]: disconnect from {client} ehlo=1 mail=1 rcpt={n} data=1 quit=1 "
                      f"commands={n + 4}\n")
                    lines += 5
                    messages += 1 if not rec.bounce_of else 0
                elif isinstance(rec, DeliveryRecord):
                    q = rec.queue_id
                    stamp = f"{_syslog_time(rec.ts)} mx1 postfix/smtp[{pid['smtp']}]: {q}: to=<"
                    delay = max(0.0, rec.ts - arrival.get(q, rec.ts))
                    for o in rec.outcomes:
                        status = {"delivered": "sent", "deferred": "deferred"}.get(o.status, "bounced")
                        reply = f"{o.code} {o.enhanced} {o.text}"
                        why = f"({reply})" if status == "sent" else f"(host {rec.relay} said: {reply} (in reply to end of DATA command))"
                        w(f"{stamp}{rcpts.get(q, {}).get(o.index, '')}>, relay={rec.relay}, delay={delay:.2f}, "
                          f"delays={delay:.2f}/0/0/0, dsn={o.enhanced or '4.0.0'}, status={status} {why}\n")
                        lines += 1
                        delivered += status == "sent"
                elif isinstance(rec, FinishRecord):
                    w(f"{_syslog_time(rec.ts)} mx1 postfix/qmgr[{pid['qmgr']}]: {rec.queue_id}: removed\n")
                    lines += 1
                    rcpts.pop(rec.queue_id, None)
    return {"lines": lines, "messages": messages, "delivered": delivered}


def run_pflogsumm(path: str) -> dict[str, float | int]:
    """Time ``pflogsumm`` (the Debian package) on ``path``: {"s": wall seconds, "received": its messages
    received, "delivered": its recipients delivered}."""
    t = time.monotonic()
    out = subprocess.run(["pflogsumm", path], check=True, capture_output=True, text=True).stdout
    s = time.monotonic() - t

    def grand(label: str) -> int:
        import re

        m = re.search(rf"^\s*(\d+)([km]?)\s+{label}\s*$", out, re.M)
        if m is None:
            return -1
        return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2)]

    return {"s": round(s, 2), "received": grand("received"), "delivered": grand("delivered")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--dir", default="/tmp/mtaq-bench-analytics")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--keep", action="store_true", help="reuse segments already generated in --dir")
    ap.add_argument("--driver-memory", default="4g")
    ap.add_argument("--conf", metavar="KEY=VALUE", action="append", default=[], help="extra Spark configuration")
    ap.add_argument("--event-log", metavar="DIR", help="write Spark's event log there (stage and task times)")
    ap.add_argument("--cold", action="store_true",
                    help="also time `mtaq analyze` in a fresh process (Spark start-up included)")
    ap.add_argument("--pflogsumm", action="store_true",
                    help="also write Postfix's log of the same messages and time pflogsumm on it (right before "
                         "each fresh-process job; implies --cold)")
    ap.add_argument("--pairs", type=int, default=3,
                    help="fresh-process jobs (alternating with pflogsumm runs): medians are reported (default 3)")
    ap.add_argument("--first-run", action="store_true",
                    help="also time a machine's first fresh-process job: no class archive yet, written at its end "
                         "(mtaq/analytics/jvm.py)")
    ap.add_argument("--without-archive", action="store_true",
                    help=f"also time a fresh-process job with the class archive off ({'MTAQ_SPARK_CLASS_ARCHIVE'}=off)")
    ap.add_argument("--all-open", action="store_true",
                    help="also time the job with every message merged by Spark tasks (close_messages=False, "
                         "driver_merge_rows=0): the merge of the open messages at its largest (issue 38.5)")
    ap.add_argument("--incremental", metavar="M", type=int,
                    help="only the incremental cost: --records N analysed with --state, M new records appended, "
                         "then `mtaq analyze --state` (fresh process) against a fresh run over M records alone, "
                         "--pairs of each, alternating; medians")
    args = ap.parse_args()
    if args.incremental:
        return incremental(args)
    spool = os.path.join(args.dir, "spool")
    t = time.monotonic()
    if not (args.keep and os.path.isdir(os.path.join(spool, "log"))):
        shutil.rmtree(args.dir, ignore_errors=True)
        written = generate(spool, args.records)
        print(f"generated {written} records in {time.monotonic() - t:.1f} s", file=sys.stderr)
    from mtaq.analytics.plain import plain_totals

    t = time.monotonic()
    plain = plain_totals([spool])
    plain_s = time.monotonic() - t
    records = plain["records"]
    size = sum(os.path.getsize(os.path.join(spool, "log", f)) for f in os.listdir(os.path.join(spool, "log")) if f.endswith(".seg"))

    from mtaq.analytics.job import Options, analyze, class_archive, spark_session, stop_session

    conf = [("spark.driver.memory", args.driver_memory), *(tuple(c.split("=", 1)) for c in args.conf)]
    if args.event_log:
        os.makedirs(args.event_log, exist_ok=True)
        conf += [("spark.eventLog.enabled", "true"), ("spark.eventLog.dir", "file://" + os.path.abspath(args.event_log))]
    t = time.monotonic()
    # A session as a user's own (C2 as well): the data source's rows go into the JVM here (mtaq/analytics/jvm.py)
    spark = spark_session(args.master, conf, app="mtaq bench", short_lived=False)
    start_s = time.monotonic() - t
    from mtaq.analytics.datasource import register

    register(spark)
    t = time.monotonic()
    rows = spark.read.format("mtaq").load(spool).count()
    scan_s = time.monotonic() - t
    t = time.monotonic()
    res = analyze(spark, Options(paths=[spool], out=os.path.join(args.dir, "out"),
                                 progress=lambda m: print(f"  {time.monotonic() - t:7.1f} s {m}", file=sys.stderr)))
    job_s = time.monotonic() - t
    all_open_s = None
    if args.all_open:
        t = time.monotonic()
        every = analyze(spark, Options(paths=[spool], out=os.path.join(args.dir, "out-all-open"), close_messages=False,
                                       driver_merge_rows=0, plots=False))
        all_open_s = time.monotonic() - t
        if every.totals != res.totals:
            raise SystemExit("bench/analytics.py: --all-open totals differ from the job's")
    session_archive = class_archive(spark)
    stop_session(spark)  # the first run on a machine writes the class archive here
    cold_s = None
    pfl: dict[str, object] | None = None
    cold_runs: list[float] = []
    pfl_runs: list[float] = []
    got: dict[str, float | int] = {}
    made: dict[str, int] = {}
    pf_path = os.path.join(args.dir, "postfix.log")
    if args.pflogsumm:
        args.cold = True
        made = postfix_log(spool, pf_path)

    def cold(env: dict[str, str] | None = None) -> float:
        # The whole job as a user runs it: a fresh process, Spark start-up included.
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", spool, "--out",
                        os.path.join(args.dir, "out-cold"), "--master", args.master, "--quiet",
                        "--conf", f"spark.driver.memory={args.driver_memory}",
                        *(x for c in args.conf for x in ("--conf", c))], check=True, env=env)
        return time.monotonic() - t

    from mtaq.analytics import jvm

    archive_state = jvm.plan(args.master).state if args.cold else None  # what the fresh-process runs find
    first_run_s = without_s = None
    if args.first_run:
        with tempfile.TemporaryDirectory() as fresh:  # a machine's first run: the class archive written at its end
            first_run_s = cold({**os.environ, jvm.ARCHIVE_ENV: fresh})
    if args.without_archive:
        without_s = cold({**os.environ, jvm.ARCHIVE_ENV: "off"})
    for _ in range(args.pairs if args.cold else 0):  # alternating, pflogsumm first
        if args.pflogsumm:
            got = run_pflogsumm(pf_path)
            pfl_runs.append(float(got["s"]))
        cold_runs.append(cold())
    if cold_runs:
        cold_s = statistics.median(cold_runs)
    if args.pflogsumm:
        seconds = statistics.median(pfl_runs)
        pfl = {**got, "s": round(seconds, 2), "runs_s": pfl_runs, "lines": made["lines"],
               "log_bytes": os.path.getsize(pf_path), "messages_per_s": round(made["messages"] / seconds),
               "mb_per_s": round(os.path.getsize(pf_path) / 1e6 / seconds, 1),
               "totals_agree": got["received"] == made["messages"] and got["delivered"] == made["delivered"]}
    same = {k: (plain[k], res.totals[k]) for k in ("received", "delivered", "deferrals", "bounced", "bytes_received")}
    messages = plain["received"] + plain["dsn_generated"]
    mb = size / 1e6

    def rates(seconds: float) -> dict[str, float]:
        return {"s": round(seconds, 2), "records_per_s": round(records / seconds), "mb_per_s": round(mb / seconds, 1),
                "messages_per_s": round(messages / seconds)}

    print(json.dumps({
        "records": records,
        "messages": messages,
        "segment_bytes": size,
        "rows": rows,
        "master": args.master,
        "load_average": os.getloadavg(),
        "plain": rates(plain_s),
        "spark_start_s": round(start_s, 2),
        "class_archive": session_archive,
        "spark_scan": rates(scan_s),
        "spark_job": rates(job_s),
        "spark_job_all_open": None if all_open_s is None else rates(all_open_s),
        "spark_job_cold_process": ({**rates(cold_s), "runs_s": [round(x, 2) for x in cold_runs],
                                    "class_archive": archive_state} if cold_s is not None else None),
        "spark_job_cold_first_run_s": None if first_run_s is None else round(first_run_s, 2),
        "spark_job_cold_without_archive_s": None if without_s is None else round(without_s, 2),
        "pflogsumm": pfl,
        "cold_job_vs_pflogsumm_per_message": (round(float(pfl["s"]) / cold_s, 2)  # type: ignore[arg-type]
                                              if pfl is not None and cold_s else None),
        "pairs_ratios": [round(a / b, 2) for a, b in zip(pfl_runs, cold_runs, strict=False)],
        "totals_agree": all(a == b for a, b in same.values()),
        "totals": same,
    }))
    return 0


def incremental(args: argparse.Namespace) -> int:
    """``--incremental M``: the cost of a daily run with ``--state`` (issue 38.1). N = ``--records`` analysed
    once with ``--state``; M new records appended to the same log (a restart: the last segment sealed, later
    arrivals, other queue IDs); then, ``--pairs`` times, alternating: ``mtaq analyze --segments NEW`` on a
    log of the M records alone (fresh process), and ``mtaq analyze --state`` on the N + M log (fresh process,
    the state as the first run left it, copied back before each). Prints one JSON object; the incremental
    run's totals are checked against a run without state over N + M."""
    base, new = os.path.join(args.dir, "inc-base"), os.path.join(args.dir, "inc-new")
    state, pristine = os.path.join(args.dir, "inc-state"), os.path.join(args.dir, "inc-state-pristine")
    days = 3
    later = 1_740_787_200.0 + days * 86400.0
    t = time.monotonic()
    if not (args.keep and os.path.isdir(pristine)):
        shutil.rmtree(args.dir, ignore_errors=True)
        n = generate(base, args.records, days=days)
        generate(new, args.incremental, days=1, seed=11, prefix="C", t0=later)
        print(f"generated {n} + {args.incremental} records in {time.monotonic() - t:.1f} s", file=sys.stderr)

    def job(segments: str, out: str, with_state: bool) -> tuple[float, dict[str, object]]:
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", segments, "--out", out,
                        "--master", args.master, "--quiet", "--json", "--no-plots",
                        "--conf", f"spark.driver.memory={args.driver_memory}",
                        *(["--state", state] if with_state else []),
                        *(x for c in args.conf for x in ("--conf", c))], check=True, stdout=open(out + ".json", "w"))
        seconds = time.monotonic() - t
        with open(out + ".json") as f:
            return seconds, json.loads(f.read())

    if not (args.keep and os.path.isdir(pristine)):
        first_s, _ = job(base, os.path.join(args.dir, "inc-out-first"), True)
        shutil.copytree(state, pristine)
        generate(base, args.incremental, days=1, seed=11, prefix="C", t0=later)  # the same M records, appended
    else:
        first_s = None
    fresh_runs, inc_runs = [], []
    inc_totals: dict[str, object] = {}
    load = []
    for _ in range(args.pairs):
        load.append(os.getloadavg()[0])
        s, _ = job(new, os.path.join(args.dir, "inc-out-fresh"), False)
        fresh_runs.append(s)
        shutil.rmtree(state, ignore_errors=True)
        shutil.copytree(pristine, state)
        s, inc_totals = job(base, os.path.join(args.dir, "inc-out-inc"), True)
        inc_runs.append(s)
    _, full_totals = job(base, os.path.join(args.dir, "inc-out-full"), False)
    fresh_s, inc_s = statistics.median(fresh_runs), statistics.median(inc_runs)
    print(json.dumps({
        "analysed_records": args.records, "new_records": args.incremental, "master": args.master,
        "load_average_before_each_pair": load, "load_average": os.getloadavg(),
        "first_run_with_state_s": None if first_s is None else round(first_s, 2),
        "fresh_new_only_s": round(fresh_s, 2), "fresh_runs_s": [round(x, 2) for x in fresh_runs],
        "incremental_s": round(inc_s, 2), "incremental_runs_s": [round(x, 2) for x in inc_runs],
        "incremental_vs_fresh": round(inc_s / fresh_s, 2),
        "pairs_ratios": [round(a / b, 2) for a, b in zip(inc_runs, fresh_runs, strict=True)],
        "totals_equal_full_run": inc_totals == full_totals,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
