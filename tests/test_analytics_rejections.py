"""Rejections (issue 38.3): the daemon logs every refusal as an event (``smtp_reject`` for a 4xx/5xx reply to
MAIL, RCPT or DATA, ``connection_refused`` for a connection its limits refuse), nothing new on the 250 path,
and ``mtaq analyze --events`` reads them (rotated files, gzip) into the ``rejections`` table and the report's
section: top reasons, top clients, per hour."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os

import pytest

from tests.edgekit import RawClient, edge_relay

pytest.importorskip("pyarrow")


def test_read_events_takes_rotated_gzip_files_skips_what_is_not_an_event_and_keeps_the_window(tmp_path):
    from mtaq.analytics.rejections import read_events, summarize

    def ev(ts: str, **kw) -> str:
        return json.dumps({"timestamp": ts, "level": "info", **kw})

    old = tmp_path / "mtaq.log.1.gz"
    with gzip.open(old, "wt") as f:
        f.write(ev("2025-03-01T10:00:00Z", event="smtp_reject", client="192.0.2.7", stage="rcpt", code=554,
                   enhanced="5.7.1", reply="554 5.7.1 <x@far.example>: Relay access denied", sender="s@a.example",
                   recipient="x@far.example") + "\n")
        f.write(ev("2025-03-01T10:30:00Z", event="queued", queue_id="Q1") + "\n")
    new = tmp_path / "mtaq.log"
    new.write_text(
        "2025-03-01 11:00:00 [info] smtp_reject client=192.0.2.9 (a console line, not JSON)\n"
        + ev("2025-03-01T11:05:00.5Z", event="smtp_reject", client="192.0.2.7", stage="rcpt", code=554,
             enhanced="5.7.1", reply="554 5.7.1 <y@far.example>: Relay access denied", sender="", recipient="y@far.example")
        + "\n" + ev("2025-03-01T11:06:00Z", event="connection_refused", client="192.0.2.8",
                    reason="too many connections from your address", code=421) + "\n"
        + ev("2025-03-01T12:00:00Z", event="smtp_reject", client="192.0.2.9", stage="data", code=550,
             enhanced="5.6.0", reply="550 5.6.0 Error: NUL octets in message", sender="s@a.example", recipient="")
        + "\n" + '{"timestamp": "2025-03-01T12:01:00Z", "event": "smtp_reject", "cli')  # a torn last line
    got = read_events([str(old), str(new)])
    assert 1 == got.skipped  # the torn line (the console line has no quoted event name: never decoded)
    rows = got.table.to_pylist()
    assert ["rcpt", "rcpt", "connect", "data"] == [r["stage"] for r in rows]
    assert [554, 554, 421, 550] == [r["code"] for r in rows]
    assert "<>: Relay access denied" == rows[0]["reason"] == rows[1]["reason"]
    s = summarize(got.table)
    assert {"stage": "rcpt", "code": 554, "enhanced": "5.7.1", "reason": "<>: Relay access denied", "count": 2,
            "clients": 1, "example": "554 5.7.1 <x@far.example>: Relay access denied"} == s["rejection_reasons"][0]
    assert [("192.0.2.7", 2), ("192.0.2.8", 1), ("192.0.2.9", 1)] == [(r["client"], r["count"]) for r in s["rejection_clients"]]
    assert [(10, 1), (11, 2), (12, 1)] == [(r["hour"].hour, r["count"]) for r in s["rejection_hourly"]]
    window = read_events([str(old), str(new)], since=dt.datetime(2025, 3, 1, 11, tzinfo=dt.UTC),
                         until=dt.datetime(2025, 3, 1, 12, tzinfo=dt.UTC))
    assert ["rcpt", "connect"] == [r["stage"] for r in window.table.to_pylist()]


def test_refusals_are_events_and_analyze_reads_them_into_the_rejections_table(spark, tmp_path):
    """The real daemon (loopback outside mynetworks, two connections a minute): a relay refusal at RCPT, a NUL
    refused at DATA, a third connection refused; a message accepted in between logs no smtp_reject. Then
    ``analyze --events`` over the log rotated in two (the older part gzip'd)."""
    from mtaq.analytics.job import Options, analyze

    config = 'relay_domains = ["ok.example"]\nconnections_per_client_per_minute_max = 2\n'
    with edge_relay(tmp_path, "--mynetworks", "192.0.2.0/24", config=config) as r:
        with RawClient(r.port) as c:
            assert c.reply().startswith("220")
            assert c.command("EHLO c.example").startswith("250")
            assert c.command("MAIL FROM:<s@a.example>").startswith("250")
            assert c.command("RCPT TO:<x@far.example>").startswith("554 5.7.1")
            assert c.command("RCPT TO:<y@ok.example>").startswith("250")
            assert c.command("DATA").startswith("354")
            assert c.command(b"Subject: t\r\n\r\nnul \x00 here\r\n.").startswith("550 5.6.0")
            assert c.command("MAIL FROM:<s@a.example>").startswith("250")
            assert c.command("RCPT TO:<y@ok.example>").startswith("250")
            assert c.command("DATA").startswith("354")
            assert c.command(b"Subject: t\r\n\r\nfine\r\n.").startswith("250")
        with RawClient(r.port) as c:
            assert c.reply().startswith("220")
        with RawClient(r.port) as c:
            assert c.reply().startswith("421 4.7.0")
        r.wait_for(lambda: r.events("connection_refused") and r.events("queued"), "the refusal and the queued event")
        rejects = r.events("smtp_reject")
        assert [("rcpt", 554, "5.7.1", "x@far.example"), ("data", 550, "5.6.0", "")] == [
            (e["stage"], e["code"], e["enhanced"], e["recipient"]) for e in rejects]
        assert {"127.0.0.1"} == {e["client"] for e in rejects + r.events("connection_refused")}
        with open(r.daemon.log_path, "rb") as f:
            lines = f.readlines()
        half = len(lines) // 2
        rotated = str(tmp_path / "daemon.log.1.gz")
        with gzip.open(rotated, "wb") as f:
            f.writelines(lines[:half])
        current = str(tmp_path / "daemon.log")
        with open(current, "wb") as f:
            f.writelines(lines[half:])
        out = str(tmp_path / "out")
        res = analyze(spark, Options(paths=[str(r.dir / "spool")], out=out, plots=False, events=[rotated, current]))
    assert 3 == res.totals["rejected"]
    assert 1 == res.totals["received"]
    assert [("connect", 421), ("data", 550), ("rcpt", 554)] == sorted(
        (x["stage"], x["code"]) for x in res.tables["rejection_reasons"])
    assert [("127.0.0.1", 3, 1, 0, 1, 1)] == [(x["client"], x["count"], x["connect"], x["mail"], x["rcpt"], x["data"])
                                              for x in res.tables["rejection_clients"]]
    assert 3 == sum(x["count"] for x in res.tables["rejection_hourly"])
    import pyarrow.parquet as pq

    assert 3 == pq.read_table(os.path.join(out, "tables", "rejections")).num_rows
    with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
        report = f.read()
    assert "## Rejections: top 20 reasons (from the event log)" in report
    assert "Relay access denied" in report


def test_analyze_refuses_a_missing_events_file_and_a_remote_state_in_one_line(tmp_path, capsys):
    from mtaq.analytics.command import main
    from tests.test_analytics_incremental import write_log

    spool = str(tmp_path / "spool")
    write_log(spool, {})
    assert 2 == main(["--segments", spool, "--out", str(tmp_path / "out"), "--events", str(tmp_path / "nope.log")])
    assert f"mtaq: --events {tmp_path / 'nope.log'}: no such file\n" == capsys.readouterr().err
    assert 2 == main(["--segments", spool, "--out", str(tmp_path / "out"), "--state", "s3://bucket/state"])
    assert "mtaq: --state: the state directory and --parquet-out must be local paths with --state\n" == capsys.readouterr().err
    (tmp_path / "a-file").write_text("not a directory\n")
    assert 2 == main(["--segments", spool, "--out", str(tmp_path / "out"), "--state", str(tmp_path / "a-file")])
    assert f"mtaq: --state {tmp_path / 'a-file'}: Not a directory\n" == capsys.readouterr().err
