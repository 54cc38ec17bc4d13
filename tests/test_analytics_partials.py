"""The small tables' partial aggregates (mtaq/analytics/partials.py) against the job's definitions. No Spark.

Random fact tables (FACT_SCHEMA: MESSAGE, OUTCOME, RCPT rows, a few record, SEGMENT, PROBLEM and
ENVELOPE/FLAGGED rows; timestamps over a few hours, many exactly on the hour or the minute, delays exactly
on the time-to-deliver bounds) are split into 1-4 groups, every row of a queue ID in one group, as the data
source's tasks and Spark's partitions split them. Two properties:

* ``merge()`` of the groups' ``encode(partials(...))`` rows equals ``merge()`` of one ``partials`` over all
  rows (one group also through ``rows_table``, as Spark's ``mapPartitions`` hands the rows over: timestamps
  as microseconds), for any window and end;
* what ``summary.split_parts`` makes of the merged tables equals a plain-Python reference written from the
  Spark SQL the job used before the partials (``git show cd5572e:mtaq/analytics/job.py``: the o_sets and
  m_sets GROUPING SETS and ``_split_sets``, ``deferred_rcpts``, ``reasons``, ``ticks``/``qshape``,
  ``pending``/``qshape_now``, ``side``, ``_bucket_label``), with Spark's null rules (a sum of nulls is null,
  a count ignores them, a null key is a group, a comparison with null is not true).
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtaq.analytics.facts import FACT_SCHEMA  # noqa: E402
from mtaq.analytics.partials import encode, merge, partials, rows_table  # noqa: E402
from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, bucket_labels  # noqa: E402

pytest.importorskip("pyspark")  # summary.py imports staging.py, which imports pyspark; no session is started
from mtaq.analytics.summary import split_parts  # noqa: E402

S = 1_000_000
MIN = 60 * S
H = 3600 * S
T0 = 1_740_787_200 * S  # 2025-03-01T00:00:00Z
AGES = bucket_labels(AGE_BUCKETS_MIN, "m")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- random fact tables

offsets = st.one_of(
    st.integers(0, 5 * H),  # any microsecond
    st.integers(0, 5).map(lambda h: h * H),  # on the hour
    st.integers(0, 300).map(lambda m: m * MIN),  # on the minute
    st.tuples(st.integers(1, 5), st.sampled_from(AGE_BUCKETS_MIN[:6])).map(lambda x: x[0] * H - x[1] * MIN),  # ages
    # exactly on the qshape bounds at a tick
)
times = offsets.map(lambda o: T0 + o)
delays = st.one_of(
    st.integers(0, 3 * H),
    st.sampled_from([0, *DELAY_BUCKETS_S[:5]]).map(lambda s: s * S),  # exactly on a bound
    st.integers(-5 * S, 0),  # a clock that went back
)
DOMAINS = [None, "x.example", "y.example", "?"]


@st.composite
def fact_rows(draw: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(draw(st.integers(0, 6))):
        qid = f"Q{i}"
        arrival = draw(times)
        finish = draw(st.one_of(st.none(), delays.map(lambda d, a=arrival: a + d), times))
        size = draw(st.integers(0, 5000))
        latest = [arrival] + ([finish] if finish is not None else [])
        for k in range(draw(st.integers(1, 3))):
            rdom = draw(st.sampled_from(DOMAINS))
            rows.append({"record_type": "RCPT", "queue_id": qid, "rcpt_index": k,
                         "rcpt_address": None if rdom is None else f"r{k}@{rdom}", "rcpt_domain": rdom})
            for _ in range(draw(st.integers(0, 3))):
                status = draw(st.sampled_from(["delivered", "deferred", "failed", "expired"]))
                ts = finish if status == "expired" and finish is not None else arrival + draw(delays)
                if draw(st.booleans()) and draw(st.booleans()):
                    ts = draw(times)  # any time, also on the hour
                latest.append(ts)
                rows.append({
                    "record_type": "OUTCOME", "queue_id": qid, "rcpt_index": k, "ts": ts, "status": status,
                    "enhanced": draw(st.sampled_from([None, "4.2.0", "5.1.1", "4.4.7"])),
                    "relay": draw(st.sampled_from([None, "mx1", "mx2"])),
                    "text": draw(st.sampled_from([None, "a", "b", "B", "é"])), "rcpt_domain": rdom,
                    "rcpt_address": None if rdom is None else f"r{k}@{rdom}", "arrival_ts": arrival, "size": size,
                    "finish_ts": finish, "delay_s": (ts - arrival) / 1e6, "segment": 1, "offset": len(rows)})
        rows.append({
            "record_type": "MESSAGE", "queue_id": qid, "arrival_ts": arrival, "finish_ts": finish, "size": size,
            "sender_domain": draw(st.sampled_from([None, "s.example", "t.example"])),
            "sender": draw(st.sampled_from([None, "", "a@s.example", "b@t.example"])),
            "bounce_of": draw(st.sampled_from(["", "", "Q99", None])),
            "first_seen": draw(st.sampled_from([True, True, False, None])),
            "attempts": draw(st.integers(0, 3)), "ts": max(latest), "recipients": 1})
    for j in range(draw(st.integers(0, 2))):  # outcomes of a message whose envelope is not in the log
        status = draw(st.sampled_from(["delivered", "deferred", "failed"]))
        rows.append({"record_type": "OUTCOME", "queue_id": f"O{j}", "rcpt_index": 0, "ts": draw(times),
                     "status": status, "text": "orphan", "rcpt_domain": draw(st.sampled_from(DOMAINS)),
                     "segment": 2, "offset": j})
    for j in range(draw(st.integers(0, 2))):  # record rows left for Spark's merge
        rows.append({"record_type": draw(st.sampled_from(["ENVELOPE", "START", "DELIVERY", "FINISH"])),
                     "queue_id": f"R{j}", "ts": draw(times), "rcpt_index": 0, "generation": 0,
                     "rcpt_unknown": draw(st.sampled_from([None, False, True])),
                     "not_before_ts": draw(st.one_of(st.none(), times)), "rcpt_address": "u@x.example"})
    for j in range(draw(st.integers(0, 2))):
        rows.append({"record_type": "FLAGGED", "queue_id": f"Q{j}", "rcpt_index": j, "generation": 1,
                     "rcpt_unknown": True, "not_before_ts": draw(times), "last_reply": "451 x"})
    for j in range(draw(st.integers(0, 2))):
        rows.append({"record_type": "SEGMENT", "file": f"f{j}", "segment": j, "size": 100 + j, "records": 3,
                     "sealed": True, "ts": draw(times)})
    for j in range(draw(st.integers(0, 2))):
        rows.append({"record_type": "PROBLEM", "file": f"f{j}", "segment": j, "offset": 7, "problem_end": 9,
                     "problem_kind": draw(st.sampled_from(["open-tail", "corrupt"])), "problem_reason": "r"})
    return rows


def table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=FACT_SCHEMA)


def last_ts(rows: list[dict[str, Any]]) -> int | None:
    got = [r["ts"] for r in rows if r["record_type"] in ("MESSAGE", "ENVELOPE", "START", "DELIVERY", "FINISH")
           and r.get("ts") is not None]
    return max(got) if got else None


def all_finished(rows: list[dict[str, Any]], end: int | None) -> bool:
    """What partials(end_us=None) assumes of its rows: every message FINISHed at or before the end."""
    return all(r.get("finish_ts") is not None and end is not None and r["finish_ts"] <= end
               for r in rows if r["record_type"] == "MESSAGE")


@st.composite
def cases(draw: Any) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]], int | None, int | None,
                              int | None, list[int | None], int | None, bool]:
    """(groups, all rows, since, until, end for the whole table, end of each group, the job's end, whether
    the first group goes through rows_table)."""
    rows = draw(fact_rows())
    n = draw(st.integers(1, 4))
    keys = sorted({r.get("queue_id") or f"{r['record_type']}-{i}" for i, r in enumerate(rows)})
    where = {k: draw(st.integers(0, n - 1)) for k in keys}
    groups: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for i, r in enumerate(rows):
        groups[where[r.get("queue_id") or f"{r['record_type']}-{i}"]].append(r)
    arrivals = [r["arrival_ts"] for r in rows if r["record_type"] == "MESSAGE"]
    moments = times if not arrivals else st.one_of(times, st.tuples(st.sampled_from(arrivals), st.sampled_from(
        AGE_BUCKETS_MIN)).map(lambda x: x[0] + x[1] * MIN))  # also ages exactly on the bounds at the end
    since = draw(st.one_of(st.none(), moments))
    until = draw(st.one_of(st.none(), moments))
    last = last_ts(rows)
    if until is not None:
        end = until if draw(st.integers(0, 3)) else draw(moments)  # the job's end, or any
        ends: list[int | None] = [end] * n
        whole_end: int | None = end
    else:
        end = last if draw(st.integers(0, 3)) else draw(moments)
        lazy = draw(st.booleans())  # the data source's tasks: None where every message FINISHed by the end
        ends = [None if lazy and all_finished(g, end) else end for g in groups]
        whole_end = None if lazy and all_finished(rows, end) else end
    return groups, rows, since, until, whole_end, ends, end, draw(st.booleans())


def canonical(parts: dict[str, pa.Table]) -> dict[str, list[str]]:
    return {name: sorted(repr(sorted(r.items())) for r in t.to_pylist()) for name, t in parts.items()}


def via_rows_table(t: pa.Table, since: int | None, until: int | None, end: int | None) -> list[tuple[str, bytes]]:
    """The partials of ``t`` handed over as Spark's mapPartitions hands rows to stage_open_rows: tuples of the
    fact columns, timestamps as microseconds, made a table again by rows_table."""
    names = t.column_names
    cols = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in t.columns]
    tuples = list(zip(*(c.to_pylist() for c in cols), strict=True)) if t.num_rows else []
    back = rows_table(iter(tuples), names)
    assert (back is None) == (t.num_rows == 0)
    return [] if back is None else list(encode(partials(back, since, until, end)))


def merged_groups(c: tuple[Any, ...]) -> dict[str, pa.Table]:
    groups, _, since, until, _, ends, _, rows_api = c
    got: list[tuple[str, bytes]] = []
    for i, (g, end) in enumerate(zip(groups, ends, strict=True)):
        if i == 0 and rows_api:
            got += via_rows_table(table(g), since, until, end)
        else:
            got += list(encode(partials(table(g), since, until, end)))
    return merge(got)


@SETTINGS
@given(cases())
def test_any_split_of_the_messages_merges_to_the_same_tables(c):
    _, rows, since, until, whole_end, _, _, _ = c
    whole = merge(encode(partials(table(rows), since, until, whole_end)))
    assert canonical(merged_groups(c)) == canonical(whole)


# --------------------------------------------------------------------------- the old Spark definitions


def ssum(values: Any) -> Any:
    """Spark's sum: nulls ignored, null when there is no value."""
    got = [v for v in values if v is not None]
    return sum(got) if got else None


def smax(values: Any) -> Any:
    got = [v for v in values if v is not None]
    return max(got) if got else None


def label(bounds: tuple[int, ...], unit: str, value: float | None) -> str:
    """The job's _bucket_label: the first bucket whose bound the value is below; null (or NaN) the last."""
    for b, name in zip(bounds, bucket_labels(bounds, unit), strict=False):
        if value is not None and value < b:
            return name
    return bucket_labels(bounds, unit)[-1]


def hour(us: int) -> dt.datetime:
    return naive(us // H * H)


def naive(us: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=us)


def window(us: int | None, since: int | None, until: int | None) -> bool:
    return us is not None and (since is None or us >= since) and (until is None or us < until)


def reference(rows: list[dict[str, Any]], since: int | None, until: int | None, end: int | None) -> dict[str, Any]:
    """The small tables as the Spark SQL of cd5572e computes them (``_split_sets``'s rows), ``end`` the job's
    end (``until``, or the latest record time)."""
    msgs = [r for r in rows if r["record_type"] == "MESSAGE"]
    every = [r for r in rows if r["record_type"] == "OUTCOME"]
    oe = [r for r in every if window(r.get("ts"), since, until)]
    out: dict[str, Any] = {}

    def o_aggs(g: list[dict[str, Any]]) -> dict[str, Any]:
        d = [r for r in g if r["status"] == "delivered"]
        delays = [r.get("delay_s") for r in d if r.get("delay_s") is not None]
        # Spark's sum(when(delivered, size).otherwise(0)) was null for a group of delivered outcomes that all
        # lack a size (a message whose envelope is not in the log); the partials give 0, which the job's
        # definitions mean (the old daily sums failed on that null): 0 here too.
        return {"delivered": len(d),
                "bytes_delivered": ssum(r.get("size") if r["status"] == "delivered" else 0 for r in g) or 0,
                "deferrals": sum(r["status"] == "deferred" for r in g),
                "bounced": sum(r["status"] in ("failed", "expired") for r in g),
                "expired": sum(r["status"] == "expired" for r in g),
                "delay_mean_s": sum(delays) / len(delays) if delays else None, "delay_max_s": smax(delays)}

    by: dict[str, dict[Any, list[dict[str, Any]]]] = {"domain": defaultdict(list), "hour": defaultdict(list),
                                                      "bucket": defaultdict(list)}
    for r in oe:
        by["domain"][r.get("rcpt_domain") or "?"].append(r)
        by["hour"][hour(r["ts"])].append(r)
        if r["status"] == "delivered":
            by["bucket"][label(DELAY_BUCKETS_S, "s", r.get("delay_s"))].append(r)
    # GROUPING SETS over no rows: no grand total row, and _split_sets' default (every value None)
    out["totals_o"] = job_totals(o_aggs(oe) if oe else dict.fromkeys(("delivered", "bytes_delivered", "deferrals",
                                                                       "bounced", "expired", "delay_mean_s",
                                                                       "delay_max_s")))
    out["domains"] = {k: o_aggs(g) for k, g in by["domain"].items()}
    out["delays"] = {k: len(g) for k, g in by["bucket"].items()}
    hours: dict[Any, dict[str, Any]] = {}

    def at(h: Any) -> dict[str, Any]:
        return hours.setdefault(h, {"hour": h, "received": 0, "delivered": 0, "deferrals": 0, "bounced": 0,
                                    "bytes_received": 0, "bytes_delivered": 0})

    for h, g in by["hour"].items():
        a = o_aggs(g)
        for k in ("delivered", "deferrals", "bounced", "bytes_delivered"):
            at(h)[k] = a[k]
    deferred: dict[str, set[Any]] = defaultdict(set)
    for r in oe:
        if r["status"] == "deferred":
            deferred[r.get("rcpt_domain") or "?"].add((r["queue_id"], r.get("rcpt_index"), r.get("rcpt_domain")))
    out["deferred_rcpts"] = {k: len(v) for k, v in deferred.items()}
    reasons: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in oe:
        if r["status"] in ("deferred", "failed", "expired"):
            status = "bounced" if r["status"] == "failed" else r["status"]
            reasons[(status, r.get("enhanced"), r.get("relay"))].append(r)
    out["reasons"] = {k: {"count": len(g), "recipients": len({(r["queue_id"], r.get("rcpt_index")) for r in g}),
                          "messages": len({r["queue_id"] for r in g}),
                          "example": min((r["text"] for r in g if r.get("text") is not None), default=None)}
                      for k, g in reasons.items()}
    # m_sets: messages first seen, arrived in the window
    m = [r for r in msgs if r.get("first_seen") and window(r.get("arrival_ts"), since, until)]

    def m_aggs(g: list[dict[str, Any]]) -> dict[str, Any]:
        recv = [r for r in g if r.get("bounce_of") == ""]
        return {"received": len(recv), "bytes_received": ssum(r.get("size") for r in recv) or 0,
                "dsn_generated": sum(r.get("bounce_of") not in (None, "") for r in g)}

    t = m_aggs(m) if m else {"received": 0, "bytes_received": 0, "dsn_generated": 0}
    out["totals_r"] = {"received": t["received"], "bytes_received": t["bytes_received"]}
    out["totals_d"] = {"dsn_generated": t["dsn_generated"]}
    m_by: dict[str, dict[Any, list[dict[str, Any]]]] = {"domain": defaultdict(list), "attempts": defaultdict(list),
                                                        "hour": defaultdict(list)}
    for r in m:
        m_by["domain"][r.get("sender_domain")].append(r)
        m_by["attempts"][r.get("attempts")].append(r)
        m_by["hour"][hour(r["arrival_ts"])].append(r)
    out["sender_domains"] = {k: (a["received"], a["bytes_received"]) for k, g in m_by["domain"].items()
                             if (a := m_aggs(g))["received"]}
    out["attempts"] = {k: a["received"] for k, g in m_by["attempts"].items() if (a := m_aggs(g))["received"]}
    for h, g in m_by["hour"].items():
        a = m_aggs(g)
        if a["received"]:
            at(h)["received"], at(h)["bytes_received"] = a["received"], a["bytes_received"]
    out["hourly"] = hours
    # ticks / qshape
    ticks: dict[int, list[tuple[dict[str, Any], str]]] = defaultdict(list)
    for r in msgs:
        arr = r.get("arrival_ts")
        if arr is None:
            continue
        first = arr // H * H
        first = first if first == arr else first + H
        fin = r.get("finish_ts")
        gone = fin - 1 if fin is not None else end
        bounds = [x for x in (gone, end) if x is not None]  # Spark's least() skips nulls
        if not bounds:
            continue
        last = min(bounds) // H * H
        for tick in range(first, last + 1, H):
            if window(tick, since, until):
                ticks[tick].append((r, label(AGE_BUCKETS_MIN, "m", (tick - arr) / 1e6 / 60)))
    out["qshape"] = {naive(k): {"messages": len(g), "bytes": ssum(r.get("size") for r, _ in g),
                                **{a: sum(x == a for _, x in g) for a in AGES}} for k, g in ticks.items()}
    # pending / qshape_now
    now: dict[str, list[str]] = defaultdict(list)
    if end is not None:
        final = {(r["queue_id"], r.get("rcpt_index")) for r in every
                 if r["status"] in ("delivered", "failed") and r.get("ts") is not None and r["ts"] <= end}
        rcpts = [r for r in rows if r["record_type"] == "RCPT"]
        for msg in msgs:
            arr, fin = msg.get("arrival_ts"), msg.get("finish_ts")
            if arr is None or arr > end or (fin is not None and fin <= end):
                continue
            for rc in rcpts:
                if rc["queue_id"] == msg["queue_id"] and (
                        rc.get("rcpt_index") is None or (rc["queue_id"], rc["rcpt_index"]) not in final):
                    now[rc.get("rcpt_domain") or "?"].append(label(AGE_BUCKETS_MIN, "m", (end - arr) / 1e6 / 60))
    out["qshape_now"] = {k: {"recipients": len(g), **{a: g.count(a) for a in AGES}} for k, g in now.items()}
    # side
    side = [r for r in rows if r["record_type"] in ("PROBLEM", "SEGMENT") or (
        r["record_type"] in ("ENVELOPE", "FLAGGED") and r.get("rcpt_unknown")
        and window(r.get("not_before_ts"), since, until))]
    out["problems"] = sorted((r["file"], r["segment"], r["offset"], r["problem_kind"]) for r in side
                             if r["record_type"] == "PROBLEM")
    out["segments"] = sorted((r["file"], r["segment"], r["size"], r["records"]) for r in side
                             if r["record_type"] == "SEGMENT")
    # senders: received messages (first seen, in the window, not DSNs); recipients: delivered outcomes in the
    # window; count and sum(size) by the two keys, as the job's Spark groupBy computed them
    by_sender: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in m:
        if r.get("bounce_of") == "":
            by_sender[(r.get("sender"), r.get("sender_domain"))].append(r)
    out["senders"] = {k: (len(g), ssum(r.get("size") for r in g)) for k, g in by_sender.items()}
    by_rcpt: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in oe:
        if r["status"] == "delivered":
            by_rcpt[(r.get("rcpt_address"), r.get("rcpt_domain"))].append(r)
    out["recipients"] = {k: (len(g), ssum(r.get("size") for r in g)) for k, g in by_rcpt.items()}
    out["unknown"] = sorted({(r["queue_id"], r["rcpt_index"], r["generation"]) for r in side
                             if r["record_type"] in ("ENVELOPE", "FLAGGED")})
    return out


def job_totals(o: dict[str, Any]) -> dict[str, Any]:
    """What the job's totals take of the outcomes' grand total: the counts ``or 0``, the delays as they are."""
    return {k: o[k] if k.startswith("delay_") else o[k] or 0 for k in (
        "delivered", "bytes_delivered", "deferrals", "bounced", "expired", "delay_mean_s", "delay_max_s")}


def report_of(split: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """summary.split_parts' rows in the reference's shape (what the job's totals and tables take from them)."""
    keys = ("delivered", "bytes_delivered", "deferrals", "bounced", "expired", "delay_mean_s", "delay_max_s")
    [o] = split["totals_o"]
    [r] = split["totals_r"]
    [d] = split["totals_d"]
    return {
        "totals_o": job_totals(o),
        "domains": {x["domain"]: {k: x[k] for k in keys} for x in split["domains"]},
        "delays": {x["bucket"]: x["delivered"] for x in split["delays"]},
        "hourly": {x["hour"]: x for x in split["hourly"]},
        "deferred_rcpts": {x["domain"]: x["deferred"] for x in split["deferred_rcpts"]},
        "reasons": {(x["status"], x["enhanced"], x["relay"]): {k: x[k] for k in ("count", "recipients", "messages",
                                                                                  "example")}
                    for x in split["reasons"]},
        "totals_r": r, "totals_d": d,
        "sender_domains": {x["domain"]: (x["messages"], x["bytes"]) for x in split["sender_domains"]},
        "attempts": {x["attempts"]: x["messages"] for x in split["attempts"]},
        "qshape": {x["tick"]: {k: v for k, v in x.items() if k != "tick"} for x in split["qshape"]},
        "qshape_now": {x["domain"]: {k: v for k, v in x.items() if k != "domain"} for x in split["qshape_now"]},
        "problems": sorted((x["file"], x["segment"], x["offset"], x["problem_kind"]) for x in split["problems"]),
        "segments": sorted((x["file"], x["segment"], x["size"], x["records"]) for x in split["segments"]),
        "unknown": sorted((x["queue_id"], x["rcpt_index"], x["generation"]) for x in split["unknown"]),
    }


def same(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-9 (the mean is summed as whole microseconds now, as doubles before)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return bool(a == b) and type(a) is type(b)


TABLES = ("totals_o", "domains", "delays", "hourly", "deferred_rcpts", "reasons", "totals_r", "totals_d",
          "sender_domains", "attempts", "qshape", "qshape_now", "problems", "segments", "unknown")


@pytest.mark.parametrize("name", TABLES)
@SETTINGS
@given(c=cases())
def test_merged_tables_follow_the_old_spark_definitions(name, c):
    _, rows, since, until, _, _, end, _ = c
    got = report_of(split_parts(merged_groups(c), []))[name]
    want = reference(rows, since, until, end)[name]
    assert same(got, want), (got, want)


@SETTINGS
@given(c=cases())
def test_senders_and_recipients_follow_the_old_spark_definitions(c):
    """The senders' and recipients' partial tables of any split, added up, equal the job's old Spark groupBy
    (count and sum of sizes, a null size or key as Spark has it)."""
    _, rows, since, until, _, _, end, _ = c
    parts = merged_groups(c)
    want = reference(rows, since, until, end)
    for name, keys, count in (("senders", ("sender", "sender_domain"), "messages"),
                              ("recipients", ("rcpt_address", "rcpt_domain"), "delivered")):
        got = {(r[keys[0]], r[keys[1]]): (r[count], r["bytes"]) for r in parts[name].to_pylist()}
        assert got == want[name], name


@pytest.mark.parametrize("rows_held", [1, 7, 10_000])
@pytest.mark.parametrize("threads", [1, 3])
def test_staged_partial_files_add_up_alike_whatever_the_driver_holds(tmp_path, monkeypatch, rows_held, threads):
    # merge_staged adds up what it has read whenever it holds STAGED_MERGE_ROWS rows: every few files, after
    # every file, or once at the end. The sums are the same, and equal a sum in plain Python.
    import random as rnd

    import pyarrow.parquet as pq

    from mtaq.analytics import partials as partials_mod
    from mtaq.analytics import staging

    # and from MERGE_SPLIT_ROWS rows on, in parts by the address's length on several threads (here always)
    monkeypatch.setattr(staging, "STAGED_MERGE_ROWS", rows_held)
    monkeypatch.setattr(partials_mod, "MERGE_SPLIT_ROWS", 1)
    monkeypatch.setattr(partials_mod, "merge_threads", lambda: threads)
    r = rnd.Random(rows_held)
    want: dict[tuple[Any, Any], list[int]] = defaultdict(lambda: [0, 0])
    paths = []
    for k in range(6):
        rows = [{"rcpt_address": None if r.random() < 0.1 else f"u{r.randrange(12)}@d{r.randrange(3)}.example",
                 "delivered": r.randrange(3), "bytes": r.randrange(1000)} for _ in range(r.randrange(0, 9))]
        for x in rows:
            x["rcpt_domain"] = None if x["rcpt_address"] is None else x["rcpt_address"].split("@")[1]
            got = want[(x["rcpt_address"], x["rcpt_domain"])]
            got[0] += x["delivered"]
            got[1] += x["bytes"]
        path = str(tmp_path / f"recipients-{k}.parquet")
        pq.write_table(pa.Table.from_pylist(rows, staging.RECIPIENT_SCHEMA), path)
        paths.append(path)
    t = staging.merge_staged("recipients", paths, staging.RECIPIENT_SCHEMA)
    assert t.schema == staging.RECIPIENT_SCHEMA
    assert {(x["rcpt_address"], x["rcpt_domain"]): [x["delivered"], x["bytes"]] for x in t.to_pylist()} == dict(want)
    assert t.num_rows == len(want)


@given(st.lists(st.one_of(st.none(), st.integers(-(2**55), 2**55)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_floor_utc_equals_floor_temporal(values):
    """partials.floor_utc (integer arithmetic) against Arrow's floor_temporal, by the hour and by the day, on
    timestamps before and after 1970 and nulls, in an array and in chunks."""
    import pyarrow.compute as pc

    from mtaq.analytics.partials import DAY_US, HOUR_US, floor_utc

    a = pa.array(values, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    for unit_us, unit in ((HOUR_US, "hour"), (DAY_US, "day")):
        assert floor_utc(a, unit_us).equals(pc.floor_temporal(a, unit=unit))
        chunked = pa.chunked_array([a.slice(0, len(a) // 2), a.slice(len(a) // 2)], a.type)
        assert floor_utc(chunked, unit_us).to_pylist() == pc.floor_temporal(chunked, unit=unit).to_pylist()
