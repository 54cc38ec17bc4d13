"""Delivery analytics checked against a script: the real daemon, a scripted sink, a frozen clock, then Spark.

The daemon runs in-process (the harness of test_runners.py) with a clock the test sets: every record's time
is one the script chose, so every count, hour and percentile below is known exactly. The next hop is
mtaq's own sink (aiosmtpd, Maildir) with its scripted replies, plus ``never*`` recipients that always get
``451 4.4.1``. Segments are 64 KiB and reclaimed into a zstd archive, so the analysis reads the archive and
the spool together. One SparkSession (local[2]) serves the whole test session.

The script, from 2025-03-01T23:10:00Z (T0):

* before the daemon starts, the log holds dave's message with a START and no DELIVERY, as a crash leaves it:
  recovery flags crash1@ and crash2@w.example outcome-unknown and they are delivered at T0 (arrival T0-60);
* at T0: 6 x alice -> ok@x.example (250); 3 x bob -> ok2@y.example + laterN@y.example (250 / 451 4.2.0
  once); 2 x alice -> nobody@x.example (550 5.1.1: two DSNs to alice); carol -> never@z.example (451 4.4.1);
* T0+1000 s: laterN delivered; never deferred again (next try after 3000 s);
* T0+4000 s: never deferred a third time, past the 3600 s lifetime: expired (4.4.7, DSN to carol);
  erin -> never2@z.example arrives and is deferred (still queued at the end).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import glob
import json
import os
import shutil
import smtplib
import subprocess
import sys

import pytest

pytest.importorskip("pyspark")

from aiosmtpd.smtp import SMTP

from mtaq.analytics.plain import plain_totals
from mtaq.analytics.source import SourceError, batches, discover, plan_partitions
from mtaq.config import load_config
from mtaq.core.records import DataRecord, EnvelopeRecord, Recipient, StartRecord
from mtaq.daemon.process import Daemon
from mtaq.queue.store import new_queue_id
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log
from mtaq.testing.sink import SinkHandler

T0 = dt.datetime(2025, 3, 1, 23, 10, tzinfo=dt.UTC).timestamp()
HOUR23 = dt.datetime(2025, 3, 1, 23, 0)
HOUR00 = dt.datetime(2025, 3, 2, 0, 0)


class FrozenClock:
    """UTC seconds that move only when the script says."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class ScriptedSink(SinkHandler):
    """mtaq's sink (laterN deferred once, nobody rejected) + never* always 451 4.4.1; records DSN sizes."""

    def __init__(self, maildir: str) -> None:
        super().__init__(maildir, defer_rcpt="^later", reject_rcpt="^nobody@", defer_count=1)
        self.dsn_sizes: list[int] = []

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.startswith("never"):
            return f"451 4.4.1 <{address}>: host not responding"
        return await super().handle_RCPT(server, session, envelope, address, rcpt_options)

    async def handle_DATA(self, server, session, envelope):
        if envelope.mail_from in ("", "<>"):
            self.dsn_sizes.append(len(envelope.original_content))
        return await super().handle_DATA(server, session, envelope)


def body(i: int, kb: int = 16) -> bytes:
    return f"Subject: m{i}\r\nMessage-ID: <m{i}@t>\r\n\r\n".encode() + (b"z" * 62 + b"\r\n") * (kb * 16)


def _send(port: int, sender: str, rcpts: list[str], msg: bytes) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(sender)
        for r in rcpts:
            s.rcpt(r)
        code, text = s.data(msg)
        assert 250 == code, text


def run_script(tmp) -> dict:
    """Run the script above; return what it did (the expected figures) and where the segments are."""
    spool, archive = str(tmp / "spool"), str(tmp / "archive")
    clock = FrozenClock(T0)
    sizes: dict[str, list[int]] = {}
    dave = body(99)
    log, _ = Log.open(OsFileSystem(), f"{spool}/log", segment_bytes_max=65536)
    qid = new_queue_id(T0 - 60)
    data, _ = log.append(DataRecord(qid, dave))
    env = EnvelopeRecord(qid, 0, T0 - 60, T0 - 60, "dave@d.example",
                         (Recipient(0, "crash1@w.example"), Recipient(1, "crash2@w.example")), data, len(dave))
    env_pos, _ = log.append(env)
    log.append(StartRecord(qid, env_pos, T0 - 60, 0))
    asyncio.run(log.sync())
    log.close()
    sizes["dave@d.example"] = [len(dave)]

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        sink = ScriptedSink(str(tmp / "maildir"))
        server = await loop.create_server(lambda: SMTP(sink, hostname="sink", loop=loop), "127.0.0.1", 0)
        sink_port = server.sockets[0].getsockname()[1]
        cfg = load_config(None, {
            "spool_dir": spool, "listen": "127.0.0.1:0", "relayhost": f"[127.0.0.1]:{sink_port}",
            "stats_interval_s": 0, "checkpoint_interval_s": 3600, "segment_bytes_max": 65536,
            "retry_intervals_s": [1000.0, 3000.0], "maximal_queue_lifetime_s": 3600.0,
            "archive_dir": archive, "archive_compress": "zstd", "admin_listen": "127.0.0.1:0"})
        d = Daemon(cfg, clock=clock, monotonic=clock)  # the script's time passes: both clocks move
        task = asyncio.create_task(d.run())
        while not d.runners:
            await asyncio.sleep(0.01)
        port = d.server.sockets[0].getsockname()[1]
        queued: list[int] = []
        logged = d.queue.on_durable

        def on_durable(env, pos) -> None:  # the queued size: what was sent plus our Received header
            queued.append(env.size)
            logged(env, pos)

        d.queue.on_durable = on_durable

        async def send(sender: str, rcpts: list[str], i: int) -> None:
            msg = body(i)
            await asyncio.to_thread(_send, port, sender, rcpts, msg)
            assert queued and queued[-1] > len(msg)
            sizes.setdefault(sender, []).append(queued[-1])

        async def until(delivered: int, deferred: int, failed: int) -> None:
            want = {"delivered": delivered, "deferred": deferred, "failed": failed}
            for _ in range(1500):
                if want == d.counts and not len(d.queue.working) and d.runners_settled():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"daemon counts {d.counts}, wanted {want}")

        try:
            for i in range(6):
                await send("alice@a.example", ["ok@x.example"], i)
            for i in range(3):
                await send("bob@b.example", ["ok2@y.example", f"later{i}@y.example"], 10 + i)
            for i in range(2):
                await send("alice@a.example", ["nobody@x.example"], 20 + i)
            await send("carol@c.example", ["never@z.example"], 30)
            await until(delivered=6 + 3 + 2 + 2, deferred=3 + 1, failed=2)
            clock.t = T0 + 1000
            for r in d.runners:
                r.poke()
            await until(delivered=16, deferred=5, failed=2)
            clock.t = T0 + 4000
            for r in d.runners:
                r.poke()
            await until(delivered=17, deferred=6, failed=3)
            await send("erin@e.example", ["never2@z.example"], 40)
            await until(delivered=17, deferred=7, failed=3)
            await d.checkpoint()
            await d.reclaimed_idle()
            assert d.archived >= 3, f"only {d.archived} segments archived"
            relay = f"127.0.0.1[127.0.0.1]:{sink_port}"
            return {"dsn_sizes": list(sink.dsn_sizes), "relay": relay}
        finally:
            d.server.close()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            server.close()

    got = asyncio.run(main())
    size_of = {s: v for s, v in sizes.items()}
    dsn = sum(got["dsn_sizes"])
    return {
        "spool": spool,
        "archive": archive,
        "relay": got["relay"],
        "sizes": size_of,
        "bytes_received": sum(sum(v) for v in size_of.values()),
        # ok x6 (1 rcpt), bob x3 (2 delivered rcpts each), dave (2 rcpts), the three DSNs
        "bytes_delivered": sum(size_of["alice@a.example"][:6]) + 2 * sum(size_of["bob@b.example"])
        + 2 * len(dave) + dsn,
        "dsn_count": len(got["dsn_sizes"]),
    }


EXPECTED_TOTALS = {
    "received": 14, "delivered": 17, "deferred": 5, "bounced": 3, "rejected": 0, "deferrals": 7, "expired": 1,
    "dsn_generated": 3, "delay_p50_s": 0.0, "delay_p90_s": 1000.0, "delay_p99_s": 1000.0, "outcome_unknown": 2,
    "problems": 0,
}


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> dict:
    return run_script(tmp_path_factory.mktemp("script"))


@pytest.fixture(scope="module")
def result(spark, script, tmp_path_factory):
    from mtaq.analytics.job import Options, analyze

    out = str(tmp_path_factory.mktemp("out"))
    res = analyze(spark, Options(paths=[script["archive"], script["spool"]], out=out, top=5, partition_bytes=150_000))
    res.out = out  # type: ignore[attr-defined]
    return res


def test_the_script_ran_as_written(script):
    """Three DSNs reached the sink (two 5.1.1 bounces, one 4.4.7 expiry): the scenario itself held."""
    assert 3 == script["dsn_count"]


def test_headline_totals_match_what_the_script_did(script, result):
    """received / delivered / deferred / bounced / rejected, bytes and percentiles equal the script's."""
    got = {k: result.totals[k] for k in EXPECTED_TOTALS}
    assert EXPECTED_TOTALS == got
    assert (script["bytes_received"], script["bytes_delivered"]) == (
        result.totals["bytes_received"], result.totals["bytes_delivered"])
    assert ((2 * 60 + 3 * 1000) / 17, 1000.0) == pytest.approx((result.totals["delay_mean_s"], result.totals["delay_max_s"]))
    assert (5, 5, 9, 5) == (result.totals["senders"], result.totals["sending_domains"], result.totals["recipients"],
                            result.totals["recipient_domains"])


def test_plain_scan_agrees_with_spark_and_the_script(script, result):
    """The single-process scan with the same codec gives the same headline totals as the Spark job."""
    plain = plain_totals([script["archive"], script["spool"]])
    keys = [*EXPECTED_TOTALS, "bytes_received", "bytes_delivered", "segments", "records"]
    assert {k: result.totals[k] for k in keys} == {k: plain[k] for k in keys}


def test_per_hour_and_per_day_traffic(result):
    """Facts land in the UTC hour and day they happened: 23:00 on the 1st, 00:00 on the 2nd."""
    cols = ("received", "delivered", "deferrals", "bounced")
    assert [(HOUR23, 13, 16, 5, 2), (HOUR00, 1, 1, 2, 1)] == [
        (r["hour"], *(r[c] for c in cols)) for r in result.tables["hourly"]]
    assert [(dt.date(2025, 3, 1), 13, 16, 5, 2), (dt.date(2025, 3, 2), 1, 1, 2, 1)] == [
        (r["day"], *(r[c] for c in cols)) for r in result.tables["daily"]]


def test_per_domain_delivery_and_percentiles(result):
    """Per recipient domain: deliveries, deferrals, bounces and nearest-rank time-to-deliver percentiles."""
    got = {r["domain"]: (r["delivered"], r["deferrals"], r["deferred"], r["bounced"], r["delay_p50_s"], r["delay_p90_s"])
           for r in result.tables["domains"]}
    assert {
        "x.example": (6, 0, 0, 2, 0.0, 0.0),
        "y.example": (6, 3, 3, 0, 0.0, 1000.0),
        "w.example": (2, 0, 0, 0, 60.0, 60.0),
        "a.example": (2, 0, 0, 0, 0.0, 0.0),
        "c.example": (1, 0, 0, 0, 0.0, 0.0),
        "z.example": (0, 4, 2, 1, None, None),
    } == got


def test_deferral_and_bounce_reasons_by_enhanced_code_and_relay(script, result):
    """Reasons are grouped by status, enhanced status code and remote host, with counts."""
    relay = script["relay"]
    got = [(r["status"], r["enhanced"], r["relay"], r["count"], r["recipients"]) for r in result.tables["reasons"]]
    assert [("deferred", "4.4.1", relay, 4, 2), ("deferred", "4.2.0", relay, 3, 3), ("bounced", "5.1.1", relay, 2, 2),
            ("expired", "4.4.7", relay, 1, 1)] == got


def test_bounces_and_deferrals_by_category_in_the_table_and_the_report(result):
    """Issue 37.3: each deferred/bounced/expired reply classified (mtaq.core.bounce_class): 550 5.1.1 is
    invalid_recipient, 451 4.4.1 and 451 4.2.0 transient, the 4.4.7 expiry message_expired; report.md has the
    table, and tables/categories reads back."""
    got = [(r["status"], r["category"], r["count"], r["recipients"]) for r in result.tables["categories"]]
    assert [("bounced", "invalid_recipient", 2, 2), ("deferred", "transient", 7, 5),
            ("expired", "message_expired", 1, 1)] == got
    text = open(os.path.join(result.out, "report.md")).read()
    section = text.split("## Bounces and deferrals by category", 1)[1].split("\n## ", 1)[0]
    assert "| bounced | invalid\\_recipient | 2 | 2 | 2 |" in section, section  # Markdown escapes the _
    import pyarrow.parquet as pq

    assert 3 == pq.read_table(os.path.join(result.out, "tables", "categories")).num_rows


def test_top_senders_and_recipients(script, result):
    """Senders by messages received (DSNs excluded) and recipients by deliveries, largest first."""
    assert [("alice@a.example", 8, sum(script["sizes"]["alice@a.example"])), ("bob@b.example", 3,
            sum(script["sizes"]["bob@b.example"]))] == [
        (r["sender"], r["messages"], r["bytes"]) for r in result.tables["senders"][:2]]
    assert {"carol@c.example", "dave@d.example", "erin@e.example"} == {r["sender"] for r in result.tables["senders"][2:]}
    assert ("ok@x.example", 6) == (result.tables["recipients"][0]["rcpt_address"], result.tables["recipients"][0]["delivered"])
    assert 9 == len(result.tables["recipients"])  # ok, ok2, later0-2, crash1-2, alice (2 DSNs), carol (1)


def test_attempts_per_message(result):
    """START records per received message: 9 went at once, bob's three and dave's took two, carol's three."""
    assert [(1, 9), (2, 4), (3, 1)] == [(r["attempts"], r["messages"]) for r in result.tables["attempts"]]


def test_outcome_unknown_recipients_after_the_crash(result):
    """The two recipients in flight at the simulated crash are listed, flagged when recovery ran (T0)."""
    got = [(r["rcpt_address"], r["generation"], r["flagged_ts"]) for r in result.tables["unknown"]]
    t0 = dt.datetime(2025, 3, 1, 23, 10)
    assert [("crash1@w.example", 1, t0), ("crash2@w.example", 1, t0)] == got


def test_queue_shape_over_time_and_at_the_end(script, result):
    """At 00:00 only carol's message (50 minutes old) was queued; at the end, erin's recipient (0 minutes)."""
    [tick] = result.tables["qshape"]
    assert (HOUR00, 1, script["sizes"]["carol@c.example"][0], 1) == (tick["tick"], tick["messages"], tick["bytes"], tick["40-80m"])
    [now] = result.tables["qshape_now"]
    assert ("z.example", 1, 1) == (now["domain"], now["recipients"], now["0-5m"])


def _comparable(res) -> dict:
    """A Result's totals and tables, rows in a fixed order (some tables come in no particular order)."""
    tables = {k: sorted(map(repr, rows)) for k, rows in res.tables.items()}
    return {"totals": {k: v for k, v in res.totals.items()}, "tables": tables}


@pytest.mark.parametrize("until", [None, T0 + 2000])
def test_facts_from_the_data_source_equal_the_spark_merge(spark, script, tmp_path, until):
    """Each message's facts computed in the data source's task (messages a partition holds whole) or merged
    by Spark from its record rows (messages spread over partitions: here, or all of them with
    close_messages=False, or none with one partition), by Spark or on the driver (driver_merge_rows), give the
    same totals and the same tables; with
    --until before carol's expiry her message is still queued at the end (qshape_now) in every way."""
    from mtaq.analytics.job import Options, analyze

    u = None if until is None else dt.datetime.fromtimestamp(until, dt.UTC)
    paths = [script["archive"], script["spool"]]
    def run(pb: int, close: bool, driver: int = 100_000, tables: int | None = None) -> dict:
        tables = driver if tables is None else tables
        out = str(tmp_path / f"{pb}-{close}-{driver}-{tables}")
        progress: list[str] = []
        got = _comparable(analyze(spark, Options(paths=paths, out=out, top=5, partition_bytes=pb, until=u, plots=False,
                                                 close_messages=close, driver_merge_rows=driver,
                                                 driver_table_rows=tables, progress=progress.append)))
        # the open messages merged where the limit says: by Spark, or on the driver (pyarrow)
        merged_by = {m.rsplit(" ", 1)[-1] for m in progress if m.startswith("per message and per recipient facts")}
        assert merged_by == ({"Spark"} if driver == 0 else {"driver"}) or (close and pb > 1 << 30 and not merged_by)
        # the senders and recipients added up on the driver when the limit allows
        [added] = [m for m in progress if m.startswith("senders and recipients added up")]
        assert ("on the driver" in added) == (tables > 0), added
        # the big tables too: the files the tasks and the merge of the open messages staged, moved in; the
        # senders and recipients, written by the driver or by Spark
        got["parquet"] = {t: sorted(map(repr, spark.read.parquet(f"{out}/tables/{t}").collect()))
                          for t in ("outcomes", "messages", "senders", "recipients")}
        # one timestamp type in every file, Spark's and the tasks': a plain Parquet reader reads the table
        import pyarrow.parquet as pq

        assert str(pq.read_table(f"{out}/tables/outcomes").schema.field("ts").type) == "timestamp[us, tz=UTC]"
        return got

    runs = {(pb, close, driver, tables): run(pb, close, driver, tables) for pb, close, driver, tables in (
        (150_000, True, 100_000, None), (150_000, True, 0, None), (150_000, False, 100_000, None),
        (150_000, False, 0, None), (1 << 40, True, 0, None), (1 << 40, True, 0, 100_000), (150_000, True, 100_000, 0))}
    first = runs[(150_000, False, 0, None)]
    assert all(first == other for other in runs.values())
    t = first["totals"]
    assert len(first["parquet"]["outcomes"]) == t["delivered"] + t["deferrals"] + t["bounced"] > 0
    assert run(150_000, True) == first  # again into the same OUT: the tables replaced, nothing twice
    if until is not None:
        assert [("z.example", 1)] == [(r["domain"], r["recipients"]) for r in analyze(
            spark, Options(paths=paths, out=str(tmp_path / "q"), until=u, plots=False)).tables["qshape_now"]]


def test_report_and_parquet_tables_are_written(spark, result):
    """report.md holds the totals and links PNG plots that exist; the Parquet tables read back."""
    out = result.out
    text = open(os.path.join(out, "report.md")).read()
    assert "| received | 14 |" in text and "| rejected | 0 |" in text and "never reaches the queue log" in text
    pngs = sorted(os.path.basename(p) for p in glob.glob(f"{out}/*.png"))
    assert ["attempts.png", "queue_size.png", "time_to_deliver.png", "traffic_hourly.png"] == pngs
    assert all(f"]({p})" in text for p in pngs)
    page = open(os.path.join(out, "report.html")).read()  # one file: the plots inline (test_analytics_report.py)
    assert 4 == page.count('src="data:image/png;base64,') and "<td>received</td><td class=\"n\">14</td>" in page
    assert 17 == spark.read.parquet(f"{out}/tables/outcomes").filter("status = 'delivered'").count()
    assert json.load(open(f"{out}/totals.json"))["received"] == 14
    assert not glob.glob(f"{out}/tables/_facts*")  # the staged facts are removed at the end


def test_a_job_that_fails_leaves_no_staged_facts(spark, script, tmp_path, monkeypatch):
    """The staged copy of the facts is removed when the job fails after staging, too (review)."""
    import mtaq.analytics.job as job
    from mtaq.analytics.job import Options, analyze

    def broken(*_a, **_k):
        raise RuntimeError("report writer broke")

    monkeypatch.setattr(job, "write_report", broken)
    out = str(tmp_path / "out")
    with pytest.raises(RuntimeError, match="report writer broke"):
        analyze(spark, Options(paths=[script["archive"], script["spool"]], out=out, plots=False))
    assert os.path.isdir(f"{out}/tables/outcomes") and not glob.glob(f"{out}/tables/_facts*")


def test_staged_facts_are_parquet_files_of_each_partition(spark, script, tmp_path):
    """rows=staged: each task writes its partition's facts under the option stage, the MESSAGE rows, the
    OUTCOME rows by UTC date and the other rows in files of their own, and yields (table, file, rows) for
    each, then its partial tables (part, data); the files read back are the facts rows. Without stage the
    option is refused."""
    from mtaq.analytics.datasource import STAGED_DDL
    from mtaq.analytics.facts import FACT_SPARK_DDL, MESSAGE_COLUMNS, MESSAGE_SPARK_DDL, OUTCOME_SPARK_DDL
    from mtaq.analytics.partials import FILE_PARTS, PARTS

    paths = json.dumps([script["archive"], script["spool"]])
    stage = str(tmp_path / "stage" / "_facts-x")
    got = (spark.read.format("mtaq").schema(STAGED_DDL).option("rows", "staged").option("stage", stage)
           .option("partitionBytes", "1").option("paths", paths).load().collect())
    files = discover(json.loads(paths))
    parts = [r for r in got if r["part"] is not None]
    got = [r for r in got if r["path"] is not None]
    assert len(files) > 1
    assert sorted(r["table"] for r in got if not r["table"].startswith("outcomes/")) == sorted(
        len(files) * ["facts", "messages", "p_bucket", "senders", "recipients"])
    # The OUTCOME rows by UTC date, a file each: every row of a date's file is of that date. Which dates the
    # tasks stage depends on where the segments split the messages (a task closes only the messages it holds
    # whole; the others are merged later), which depends on how the script's deliveries interleaved in the
    # log: any of the script's two days (23:00 on the 1st, 00:00 on the 2nd), at least one.
    import pyarrow.parquet as pq

    days = {r["table"] for r in got if r["table"].startswith("outcomes/")}
    assert days and days <= {"outcomes/date=2025-03-01", "outcomes/date=2025-03-02"}
    for r in got:
        if r["table"].startswith("outcomes/"):
            stamps = pq.read_table(r["path"], columns=["ts"]).column("ts").to_pylist()
            assert len(stamps) == r["rows"] > 0
            assert {f"outcomes/date={t.date().isoformat()}" for t in stamps} == {r["table"]}
    # every part but the queue shape at --until (none given): the closed messages are all FINISHed by the end
    # (the percentile buckets, the senders and the recipients are files, FILE_PARTS: up to a row per fact, too
    # many rows to collect with the rest)
    assert sorted(r["part"] for r in parts) == sorted(len(files) * [p for p in PARTS if not p.startswith("qshape_now")
                                                                    and p not in FILE_PARTS])
    assert all(r["path"] is None and r["data"] for r in parts)
    assert sorted(os.listdir(stage)) == sorted(os.path.basename(r["path"]) for r in got)
    facts = spark.read.format("mtaq").option("rows", "facts").option("partitionBytes", "1").option("paths", paths).load()

    def of(table: str, ddl: str):
        return spark.read.schema(ddl).parquet(*(r["path"] for r in got if r["table"].split("/")[0] == table))

    staged = of("facts", FACT_SPARK_DDL)
    assert sum(r["rows"] for r in got if r["table"] not in FILE_PARTS) == facts.count()
    delivered = facts.filter("record_type = 'OUTCOME' AND status = 'delivered' AND delay_s IS NOT NULL").count()
    assert spark.read.parquet(*(r["path"] for r in got if r["table"] == "p_bucket")).agg({"n": "sum"}).first()[0] == delivered
    # the senders' partials count the closed messages received (first seen, not DSNs), the recipients' their
    # delivered outcomes (none here: with a partition per segment no task holds one of the script's messages
    # whole; the job's tests compare the tables both ways)
    def total(table: str, col: str) -> int:
        return spark.read.parquet(*(r["path"] for r in got if r["table"] == table)).agg({col: "sum"}).first()[0] or 0

    assert total("senders", "messages") == facts.filter(
        "record_type = 'MESSAGE' AND first_seen AND bounce_of = ''").count()
    assert total("recipients", "delivered") == facts.filter(
        "record_type = 'OUTCOME' AND status = 'delivered'").count()
    assert staged.filter("record_type in ('MESSAGE', 'OUTCOME')").count() == 0
    assert staged.exceptAll(facts).count() == 0
    msgs = facts.filter("record_type = 'MESSAGE'").select(*MESSAGE_COLUMNS)
    assert of("messages", MESSAGE_SPARK_DDL).exceptAll(msgs).count() == 0 == msgs.exceptAll(of("messages", MESSAGE_SPARK_DDL)).count()
    outcomes = of("outcomes", OUTCOME_SPARK_DDL)
    assert outcomes.count() == facts.filter("record_type = 'OUTCOME'").count()
    with pytest.raises(Exception, match="needs the option stage"):
        spark.read.format("mtaq").option("rows", "staged").option("paths", paths).load().collect()


def test_a_corrupt_record_is_reported_and_the_records_after_it_are_kept(spark, script, tmp_path):
    """A flipped byte inside an archived segment: a PROBLEM row names the file and offset, every other record
    is still read, and the Spark read does not fail."""
    import zstandard

    src = sorted(glob.glob(f"{script['archive']}/*.seg.zst"))[1]
    raw = bytearray(zstandard.ZstdDecompressor().decompress(open(src, "rb").read()))
    good = [r for b in batches(discover([src])) for r in b.to_pylist() if r["record_type"] not in ("PROBLEM", "SEGMENT")]
    envelopes = sorted({r["offset"] for r in good if r["record_type"] == "ENVELOPE"})
    hit = envelopes[len(envelopes) // 2]
    raw[hit + 20] ^= 0xFF  # inside that envelope's payload: its checksum fails
    bad = tmp_path / os.path.basename(src)[: -len(".zst")]
    bad.write_bytes(bytes(raw))
    rows = [r for b in batches(discover([str(bad)])) for r in b.to_pylist()]
    problems = [(r["offset"], r["problem_kind"], r["problem_reason"]) for r in rows if r["record_type"] == "PROBLEM"]
    assert [(hit, "corrupt", "checksum mismatch")] == problems
    kept = [r for r in rows if r["record_type"] not in ("PROBLEM", "SEGMENT")]
    assert [r for r in good if r["offset"] != hit] == [{**r, "file": r["file"].replace(str(bad), src)} for r in kept]
    assert any(r["offset"] > hit for r in kept)
    df = spark.read.format("mtaq").load(str(bad))
    got = [(r["file"], r["problem_kind"]) for r in df.filter("record_type = 'PROBLEM'").collect()]
    assert [(str(bad), "corrupt")] == got
    assert len(kept) == df.filter("record_type NOT IN ('PROBLEM', 'SEGMENT')").count()


def test_each_segment_is_read_once_even_when_named_twice(script):
    """The spool and the archive named together, twice: segments are deduplicated by number and salt."""
    once = discover([script["archive"], script["spool"]])
    twice = discover([script["spool"], script["archive"], script["archive"] + "/*.seg.zst", script["spool"]])
    assert [(f.segment, f.salt) for f in once] == [(f.segment, f.salt) for f in twice]
    assert len(once) == len({f.segment for f in once})


def test_partitions_pack_whole_segments_in_order(script):
    """Segments are packed into partitions of at most partition_bytes (a bigger one alone), never split."""
    files = discover([script["archive"], script["spool"]])
    groups = plan_partitions(files, 100_000)
    assert files == [f for g in groups for f in g]
    assert all(len(g) == 1 or sum(f.size for f in g) <= 100_000 for g in groups)


def test_paths_that_name_no_segments_are_errors(tmp_path):
    """A missing path, a directory without segments and a non-segment file are SourceErrors naming the path."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.txt").write_text("x")
    for p, why in ((tmp_path / "nope", "no such file"), (tmp_path / "empty", "no segment files"),
                   (tmp_path / "x.txt", "not a segment file")):
        with pytest.raises(SourceError, match=why):
            discover([str(p)])


def test_hadoop_s3_uris_resolve_to_pyarrows_s3():
    """--parquet-out is a Hadoop URI for Spark (s3a://); the tasks stage the facts under it through pyarrow,
    which names the same store s3:// (no network here: the endpoint is never contacted)."""
    from mtaq.analytics.source import resolve

    for scheme in ("s3a", "s3n", "s3"):
        fs, inner, root = resolve(f"{scheme}://bucket/tables/_facts?region=us-east-1&endpoint_override=127.0.0.1:9")
        assert type(fs).__name__ == "S3FileSystem" and inner == "bucket/tables/_facts" and root.startswith("s3://")


def test_analyze_cli_rejects_bad_flags_with_one_line(tmp_path):
    """Bad --since, or a path without segments: exit 2 and one line naming the flag (before Spark starts)."""
    for args, needle in ((["--since", "yesterday"], "--since"), ([], "--segments")):
        p = subprocess.run([sys.executable, "-m", "mtaq.cli", "analyze", "--segments", str(tmp_path), "--out",
                            str(tmp_path / "o"), *args], capture_output=True, text=True, timeout=120)
        assert (2, 1) == (p.returncode, len(p.stderr.strip().splitlines())), p.stderr
        assert needle in p.stderr


def test_spark_submit_on_a_local_cluster_with_the_module_zip(script, tmp_path):
    """spark-submit --master local-cluster[2,1,1024] --py-files mtaq.zip submit.py --json --since: executors
    in separate JVMs read the segments; the totals since 00:00 on the 2nd are the script's."""
    from test_analytics_cluster import module_zip  # tests/ is on sys.path (pytest, rootdir mode prepend)

    zpath = tmp_path / "mtaq.zip"
    pkg = module_zip(zpath)  # as make spark-zip: the modules and the shipped bounce rules (package data)
    submit = shutil.which("spark-submit", path=os.path.dirname(sys.executable))
    assert submit is not None
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    p = subprocess.run(
        [submit, "--master", "local-cluster[2,1,1024]", "--py-files", str(zpath), f"{pkg}/mtaq/analytics/submit.py",
         "--segments", script["archive"], "--segments", script["spool"], "--out", str(tmp_path / "out"),
         "--since", "2025-03-02T00:00:00Z", "--json", "--no-plots", "--quiet"],
        capture_output=True, text=True, timeout=540, cwd=tmp_path, env=env)
    assert 0 == p.returncode, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"received": 1, "delivered": 1, "deferred": 2, "bounced": 1, "rejected": 0, "deferrals": 2, "expired": 1,
            "outcome_unknown": 0} == {k: got[k] for k in ("received", "delivered", "deferred", "bounced", "rejected",
                                                          "deferrals", "expired", "outcome_unknown")}


def test_percentiles_inside_a_bucket_are_read_back_by_spark(spark):
    """Delays microseconds apart share a bucket of the partials; the ranks inside it are read back by the
    job's Spark query (per domain and for all recipients) and equal the plain nearest rank."""
    import random

    from test_analytics_percentiles import outcome_table  # tests/ is on sys.path (pytest, rootdir mode prepend)

    from mtaq.analytics.partials import encode, locate_percentiles, merge, partials
    from mtaq.analytics.percentiles import PERCENTILES, find_percentiles
    from mtaq.analytics.plain import nearest_rank

    rnd = random.Random(5)
    rows = [(rnd.choice(["a.example", "b.example", None]), rnd.choice([200_000 + rnd.randrange(500),
                                                                       rnd.randrange(10**9)]), 0) for _ in range(3000)]
    p_bucket = merge(encode(partials(outcome_table(rows), None, None, None)))["p_bucket"]
    assert locate_percentiles(p_bucket, PERCENTILES)[1], "some rank falls inside a bucket of several values"
    delays = spark.createDataFrame([(d or "?", us / 1e6) for d, us, _ in rows], "domain string, delay_s double")
    got = {r["domain"]: r["p"] for r in find_percentiles(p_bucket, delays)}
    want = {None: [nearest_rank(sorted(us / 1e6 for _, us, _ in rows), p) for p in PERCENTILES]}
    for dom in ("a.example", "b.example", "?"):
        want[dom] = [nearest_rank(sorted(us / 1e6 for d, us, _ in rows if (d or "?") == dom), p) for p in PERCENTILES]
    assert got == want


def test_parquet_out_holds_every_big_table(spark, script, tmp_path):
    """--parquet-out (a shared URI on a cluster) gets every table written by the executors, the senders and
    recipients too (they went to the driver's OUT/tables, which an executor on another machine cannot reach);
    OUT/tables keeps the small tables."""
    from mtaq.analytics.job import Options, analyze

    out, big = tmp_path / "out", tmp_path / "shared"
    analyze(spark, Options(paths=[script["archive"], script["spool"]], out=str(out), parquet_out=str(big), plots=False))
    for name in ("outcomes", "messages", "senders", "recipients"):
        assert (big / name / "_SUCCESS").exists() and not (out / "tables" / name).exists(), name
        assert spark.read.parquet(str(big / name)).count() > 0, name
    assert (out / "tables" / "totals").exists() and not [p for p in big.iterdir() if p.name.startswith("_facts")]
