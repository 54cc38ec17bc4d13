"""The per-partition facts step of ``mtaq analyze`` (mtaq/analytics/facts.py) on hand-made rows: messages,
recipient outcomes joined with their recipient and message, and the ``expired`` rule (no Spark needed)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa

from mtaq.analytics.facts import EVERY_COLUMNS, MESSAGE_COLUMNS, partition_facts
from mtaq.analytics.source import SCHEMA

T0 = dt.datetime(2025, 3, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def rows_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in SCHEMA.names} for r in rows], schema=SCHEMA)


def envelope(qid: str, gen: int, idx: int, addr: str, off: int) -> dict:
    return {"record_type": "ENVELOPE", "queue_id": qid, "generation": gen, "arrival_ts": at(0), "size": 1000,
            "sender": "a@src.example", "sender_domain": "src.example", "bounce_of": "", "rcpt_index": idx,
            "rcpt_address": addr, "rcpt_domain": addr.split("@")[1], "segment": 1, "offset": off}


def outcome(qid: str, idx: int, ts: float, status: str, off: int, text: str) -> dict:
    return {"record_type": "DELIVERY", "queue_id": qid, "rcpt_index": idx, "ts": at(ts), "status": status,
            "code": 250 if status == "delivered" else 451, "enhanced": "2.0.0" if status == "delivered" else "4.2.0",
            "text": text, "relay": "mx[192.0.2.25]:25", "segment": 1, "offset": off}


def test_messages_outcomes_and_expiry():
    rows = [
        envelope("Q1", 0, 0, "u@d1.example", 10), envelope("Q1", 0, 1, "v@d2.example", 10),
        {"record_type": "START", "queue_id": "Q1", "ts": at(1), "segment": 1, "offset": 20},
        outcome("Q1", 0, 1.5, "delivered", 30, "Ok"), outcome("Q1", 1, 1.5, "deferred", 30, "try later"),
        envelope("Q1", 1, 0, "u@d1.example", 40), envelope("Q1", 1, 1, "v@d2.example", 40),
        {"record_type": "START", "queue_id": "Q1", "ts": at(1801), "segment": 1, "offset": 50},
        outcome("Q1", 1, 1801.25, "deferred", 60, "still later"),
        {"record_type": "FINISH", "queue_id": "Q1", "ts": at(1802), "segment": 1, "offset": 70},
        outcome("Q9", 0, 5, "delivered", 80, "Ok"),  # its envelope is in a segment not read
        {"record_type": "SEGMENT", "segment": 1, "offset": 0, "file": "x.seg"},
    ]
    got = partition_facts(rows_table(rows)).to_pylist()
    msgs = [{k: r[k] for k in MESSAGE_COLUMNS} for r in got if r["kind"] == "m"]
    assert msgs == [{"queue_id": "Q1", "arrival_ts": at(0), "size": 1000, "sender": "a@src.example",
                     "sender_domain": "src.example", "bounce_of": "", "first_seen": True, "recipients": 2,
                     "attempts": 2, "finish_ts": at(1802)}]
    outs = sorted(({k: r[k] for k in EVERY_COLUMNS} for r in got if r["kind"] == "o"),
                  key=lambda r: (r["queue_id"], r["rcpt_index"], r["ts"]))
    assert [(o["queue_id"], o["rcpt_index"], o["status"], o["rcpt_address"], o["delay_s"]) for o in outs] == [
        ("Q1", 0, "delivered", "u@d1.example", 1.5),
        ("Q1", 1, "deferred", "v@d2.example", 1.5),
        ("Q1", 1, "deferred", "v@d2.example", 1801.25),
        ("Q1", 1, "expired", "v@d2.example", 1802.0),
        ("Q9", 0, "delivered", None, None),
    ]
    expired = outs[3]
    assert expired["ts"] == expired["finish_ts"] == at(1802)
    assert (expired["code"], expired["enhanced"]) == (None, "4.4.7")
    assert expired["text"] == "queue lifetime exceeded; last reply: still later"
    assert (expired["segment"], expired["offset"]) == (1, 60)  # the last outcome's record


def test_a_recipient_delivered_last_does_not_expire():
    rows = [
        envelope("Q2", 0, 0, "u@d1.example", 10),
        outcome("Q2", 0, 1, "deferred", 20, "try later"), outcome("Q2", 0, 2, "delivered", 30, "Ok"),
        {"record_type": "FINISH", "queue_id": "Q2", "ts": at(3), "segment": 1, "offset": 40},
    ]
    got = partition_facts(rows_table(rows)).to_pylist()
    assert sorted(r["status"] for r in got if r["kind"] == "o") == ["deferred", "delivered"]
    [m] = [r for r in got if r["kind"] == "m"]
    assert (m["attempts"], m["recipients"], m["finish_ts"]) == (0, 1, at(3))
