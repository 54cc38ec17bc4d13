"""The small tables as partial aggregates, computed where the facts are and merged on the driver (issue 17).

The job's small tables (totals, per domain, per hour, time-to-deliver buckets, reasons, attempts, sending
domains, queue shape over time and at the end) are sums, counts, minima and maxima over per-message and
per-outcome facts, grouped by keys with few values. Each group's value is a sum of the values of the same
group over any split of the messages, as long as no message is split: its distinct recipients (deferred,
reasons) and its hours in the queue are then counted in one place only. The data source's tasks hold every
message they close whole (:mod:`mtaq.analytics.facts`), and Spark's merge of the other messages is
partitioned by queue ID, so :func:`partials` runs on each of them, and :func:`merge` adds the results up on
the driver. This replaces some 40 Spark stages (a few seconds each on two cores; docs/performance.md,
"Fifth round (issue 17)").

What stays in Spark: the tables with a row per fact (outcomes, messages), which are written by the
executors; and, when there are too many rows for the driver, the sum of the tasks' ``senders`` and
``recipients`` partials and the read-back of the few percentile buckets whose values the counts alone do
not tell (see "percentiles" below).

Definitions are those of :mod:`mtaq.analytics.job` (its docstring), value for value. Partial tables
(``PARTS``), each an Arrow table of its keys and its values:

* ``inventory``: segments, records, bytes_read (SEGMENT rows), last_ts (latest ``ts`` of a record or a
  closed message), open_rows (record rows left for Spark's merge), messages and outcomes (MESSAGE and
  OUTCOME rows);
* ``side``: PROBLEM and SEGMENT rows, and the envelopes with an outcome-unknown recipient (in the window);
* ``o_total``, ``o_domain``, ``o_hour``, ``o_bucket``: outcomes in the window, by nothing, recipient domain
  (``?`` when unknown), UTC hour, time-to-deliver bucket (delivered only): delivered, bytes_delivered,
  deferrals, bounced (failed + expired), expired, delay_us (sum of delivered delays, microseconds),
  delay_n, delay_max_s;
* ``p_bucket``: delivered outcomes in the window with a delay, by recipient domain and delay bucket
  (:func:`delay_key`): n, lo and hi (the least and greatest delay_s), for the exact nearest-rank percentiles
  (:func:`locate_percentiles`, :func:`rank_value`);
* ``deferred``: recipients deferred at least once, by domain;
* ``reasons``: deferred / bounced / expired outcomes by status, enhanced code and relay: count, recipients,
  messages, example (the least reply text);
* ``categories``: the same outcomes by status and bounce category (:func:`mtaq.core.bounce_class.classify`
  of each reply with the shipped rules, issue 37.3; ``expired`` is ``message_expired``): count, recipients,
  messages, example;
* ``m_total``, ``m_domain``, ``m_attempts``, ``m_hour``: messages first seen in the log, arrived in the
  window, by nothing, sending domain, attempts, UTC hour: received, bytes_received, dsn_generated;
* ``qshape``, ``qshape_age``: at every whole hour in the window, the messages arrived and not FINISHed:
  messages and bytes by tick, messages by tick and age bucket (minutes);
* ``qshape_now``, ``qshape_now_age``: recipients of messages still queued at the end with no final outcome
  by then, by domain, and by domain and age bucket;
* ``senders``: received messages (first seen, arrived in the window, not a DSN) by sender and sending
  domain: messages, bytes (sum of sizes);
* ``recipients``: delivered outcomes in the window by recipient address and domain: delivered, bytes.

``p_bucket``, ``senders`` and ``recipients`` (:data:`FILE_PARTS`) may have a row per fact: the tasks write
them as files, and the job adds them up on the driver when they are few, else with Spark.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mtaq.analytics.facts import FACT_SCHEMA, by_kind
from mtaq.analytics.tables import AGE_BUCKETS_MIN, DELAY_BUCKETS_S, bucket_labels
from mtaq.core.bounce_class import Rules, classify, default_rules

__all__ = ["FILE_PARTS", "PARTS", "RankTarget", "decode", "delay_key", "encode", "in_window", "keep_rows", "locate_percentiles", "merge", "merge_tables",
           "partials", "rank_value", "rows_table"]

_TS = pa.timestamp("us", tz="UTC")
_HOUR_US = 3_600_000_000
_KEYED_KINDS = ("ENVELOPE", "START", "DELIVERY", "FINISH")
_O_VALUES = ("delivered", "bytes_delivered", "deferrals", "bounced", "expired", "delay_us", "delay_n")
_M_VALUES = ("received", "bytes_received", "dsn_generated")
SIDE_COLUMNS = ("record_type", "file", "segment", "offset", "problem_end", "problem_kind", "problem_reason",
                "queue_id", "rcpt_index", "rcpt_address", "generation", "not_before_ts", "last_reply", "size",
                "records", "sealed", "ts")

# part: (keys, {value column: how partials of it combine})
PARTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "inventory": ((), {"segments": "sum", "records": "sum", "bytes_read": "sum", "last_ts": "max", "open_rows": "sum",
                       "messages": "sum", "outcomes": "sum"}),
    "side": ((), {}),  # rows, concatenated
    **{f"o_{g}": (k, {**{v: "sum" for v in _O_VALUES}, "delay_max_s": "max"})
       for g, k in (("total", ()), ("domain", ("domain",)), ("hour", ("hour",)), ("bucket", ("bucket",)))},
    "p_bucket": (("domain", "key"), {"n": "sum", "lo": "min", "hi": "max"}),
    "deferred": (("domain",), {"deferred": "sum"}),
    "reasons": (("status", "enhanced", "relay"),
                {"count": "sum", "recipients": "sum", "messages": "sum", "example": "min"}),
    "categories": (("status", "category"),
                   {"count": "sum", "recipients": "sum", "messages": "sum", "example": "min"}),
    **{f"m_{g}": (k, {v: "sum" for v in _M_VALUES})
       for g, k in (("total", ()), ("domain", ("domain",)), ("attempts", ("attempts",)), ("hour", ("hour",)))},
    "qshape": (("tick",), {"messages": "sum", "bytes": "sum"}),
    "qshape_age": (("tick", "age"), {"messages": "sum"}),
    "qshape_now": (("domain",), {"recipients": "sum"}),
    "qshape_now_age": (("domain", "age"), {"recipients": "sum"}),
    "senders": (("sender", "sender_domain"), {"messages": "sum", "bytes": "sum"}),
    "recipients": (("rcpt_address", "rcpt_domain"), {"delivered": "sum", "bytes": "sum"}),
}
# The parts with up to a row per fact (per delay bucket, per address): the tasks write them as staged files, never
# with the small parts collected from every task (mtaq/analytics/datasource.py, stage_facts).
FILE_PARTS = ("p_bucket", "senders", "recipients")


def in_window(ts: pa.ChunkedArray | pa.Array, since_us: int | None, until_us: int | None) -> pa.ChunkedArray:
    """True where ``ts`` is set and in [since, until) (the job's ``_window``); never null."""
    us = ts.cast(_TS).cast(pa.int64())
    cond = pc.is_valid(us)
    if since_us is not None:
        cond = pc.and_(cond, pc.fill_null(pc.greater_equal(us, since_us), False))
    if until_us is not None:
        cond = pc.and_(cond, pc.fill_null(pc.less(us, until_us), False))
    return cond


def keep_rows(t: pa.Table, mask: pa.ChunkedArray | pa.Array) -> pa.Table:
    """``t.filter(mask)``, but ``t`` itself when the mask keeps every row (no copy: most windows hold every
    row)."""
    if mask.null_count == 0 and pc.all(mask).as_py() is not False:
        return t
    return t.filter(mask)


def _true(mask: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    return pc.fill_null(mask, False)


def _labels(values: np.ndarray, bounds: Sequence[int], unit: str) -> pa.Array:
    """The bucket label of each value (NaN: the last, as the job's Spark expression gives a null value)."""
    labels = pa.array(bucket_labels(bounds, unit))
    return labels.take(pa.array(np.searchsorted(np.asarray(bounds, dtype=np.float64), values, side="right")))


def _floats(a: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(a.cast(pa.float64()), float("nan")), dtype=np.float64)


HOUR_US = 3_600_000_000
DAY_US = 24 * HOUR_US


def floor_utc(ts: pa.ChunkedArray | pa.Array, unit_us: int) -> pa.Array:
    """Timestamps floored to a multiple of ``unit_us`` microseconds since the epoch (an hour, a day: in UTC,
    ``floor_temporal``'s result, before 1970 too), as timestamp[us, UTC]; null stays null. Integer
    arithmetic: ``floor_temporal`` goes through time zone rules, ten times the cost."""
    i = ts.cast(_TS).cast(pa.int64())
    vals = np.asarray(pc.fill_null(i, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    valid = None if i.null_count == 0 else ~np.asarray(i.is_valid(), dtype=bool)
    return pa.array(vals // unit_us * unit_us, mask=valid).cast(_TS)


def _hour(ts: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    return floor_utc(ts, HOUR_US)


def _group(t: pa.Table, keys: Sequence[str], sums: Sequence[str] = (), maxs: Sequence[str] = (),
           mins: Sequence[str] = (), count: str | None = None) -> pa.Table:
    """``t`` grouped by ``keys`` with the named aggregations, columns named as given (``count``: rows). With no
    keys, one row, or none when ``t`` has no rows (pyarrow would give one row of nulls: sums of nothing)."""
    aggs: list[tuple[Any, str]] = [(c, "sum") for c in sums] + [(c, "max") for c in maxs] + [(c, "min") for c in mins]
    if count is not None:
        aggs.append(([], "count_all"))
    g = t.group_by(list(keys), use_threads=False).aggregate(aggs)
    if not keys and t.num_rows == 0:
        g = g.slice(0, 0)  # no rows, not one row of nulls
    names = [*sums, *maxs, *mins, *([count] if count else [])]
    made = [f"{c}_{fn}" for c, fn in aggs[:len(aggs) - (count is not None)]] + (["count_all"] if count else [])
    return g.select([*keys, *made]).rename_columns([*keys, *names])


def partials(t: pa.Table | Mapping[str, pa.Table], since_us: int | None, until_us: int | None,
             end_us: int | None) -> dict[str, pa.Table]:
    """The partial tables (``PARTS``) of the fact rows ``t`` (:data:`mtaq.analytics.facts.FACT_SCHEMA`; one
    table, or tables by ``record_type`` as :func:`mtaq.analytics.facts.fact_kinds` gives them): its MESSAGE,
    OUTCOME and RCPT rows (facts of whole messages), SEGMENT, PROBLEM and ENVELOPE/FLAGGED rows (inventory and
    side rows) and the other record rows (counted only: the job merges them later).

    ``since_us``/``until_us``: the job's window (microseconds since the epoch, UTC; None: unbounded).
    ``end_us``: the job's end (``until``, or the latest record time of the whole log); None means that every
    message in ``t`` FINISHed before the end (true of the messages a task closes when there is no ``until``),
    so none is still queued then."""
    kinds = t if isinstance(t, Mapping) else by_kind(t)
    empty = FACT_SCHEMA.empty_table()

    def kind(k: str) -> pa.Table:
        return kinds.get(k, empty)

    out: dict[str, pa.Table] = {}
    seg = kind("SEGMENT")
    keyed = [kind(k) for k in _KEYED_KINDS]
    latest = [x for x in (pc.max(k["ts"]).as_py() for k in (*keyed, kind("MESSAGE")) if k.num_rows) if x is not None]
    out["inventory"] = pa.table({
        "segments": pa.array([pc.sum(pc.equal(seg["offset"], 0).cast(pa.int64())).as_py() or 0], pa.int64()),
        "records": pa.array([pc.sum(seg["records"]).as_py() or 0], pa.int64()),
        "bytes_read": pa.array([pc.sum(seg["size"]).as_py() or 0], pa.int64()),
        "last_ts": pa.array([max(latest) if latest else None], _TS),
        "open_rows": pa.array([sum(k.num_rows for k in keyed)], pa.int64()),
        "messages": pa.array([kind("MESSAGE").num_rows], pa.int64()),
        "outcomes": pa.array([kind("OUTCOME").num_rows], pa.int64()),
    })
    side = [kind("PROBLEM"), seg]
    for k in ("ENVELOPE", "FLAGGED"):  # envelopes with an outcome-unknown recipient, in the window
        x = kind(k)
        if x.num_rows:
            side.append(x.filter(pc.and_(_true(x["rcpt_unknown"]), in_window(x["not_before_ts"], since_us, until_us))))
    out["side"] = pa.concat_tables([x.select(list(SIDE_COLUMNS)) for x in side])
    msgs = kind("MESSAGE")
    outcomes = kind("OUTCOME")
    out |= _outcome_parts(keep_rows(outcomes, in_window(outcomes["ts"], since_us, until_us)))
    out |= _message_parts(msgs, since_us, until_us)
    out |= _qshape(msgs, since_us, until_us, end_us)
    if end_us is not None:
        out |= _qshape_now(msgs, outcomes, kind("RCPT"), end_us)
    return out


# --------------------------------------------------------------------------------- percentiles
#
# Nearest-rank percentiles of the time to deliver, exact, without all values in one place. Each task counts
# its delivered delays in narrow buckets (``p_bucket``: by recipient domain and bucket, the count and the
# least and greatest value); the buckets add up like every other partial. On the driver the cumulative
# counts name the bucket that holds the wanted rank of each group (all recipients, and each domain). When
# that bucket holds one value, or the rank is its first or its last, the bucket's least or greatest value is
# the answer; only otherwise are the values of that bucket alone asked for again (the job's one Spark query
# for them, with their counts), and the rank counted off among them.

DELAY_KEY_BITS = 5  # mantissa bits a bucket keeps: buckets 2**-5 (3 %) of their value wide


def delay_key(delays: np.ndarray) -> np.ndarray:
    """The bucket of each delay (seconds, float64, no NaN) as an int64 that orders like the delays: the IEEE
    754 bits of ``|delay|`` (which order like non-negative doubles) without their low 52 - DELAY_KEY_BITS
    mantissa bits, negated for negative delays. Bit arithmetic, no logarithm: every executor puts a value
    in the same bucket."""
    a = np.asarray(delays, dtype=np.float64)
    bits = np.abs(a).view(np.int64) >> (52 - DELAY_KEY_BITS)
    return np.where(a < 0, -bits - 1, bits)


@dataclass(frozen=True, slots=True)
class RankTarget:
    """A rank to find among the values ``lo`` <= delay <= ``hi`` of ``domain`` (None: every domain): the
    ``within``-th smallest of them (1-based), for percentile number ``p`` of that group."""

    domain: str | None
    p: int
    lo: float
    hi: float
    n: int
    within: int


def locate_percentiles(p_bucket: pa.Table, ps: Sequence[float]) -> tuple[dict[str | None, list[float | None]], list[RankTarget]]:
    """Nearest-rank percentiles ``ps`` (fractions, e.g. 0.5) of the delays counted in the merged ``p_bucket``
    partial table, for all recipients (key None) and each domain: ({group: [value or None per p]}, the ranks
    whose value the buckets alone do not tell, left None in the values). The rank of percentile p of N values
    is ceil(p * N), as :func:`mtaq.analytics.plain.nearest_rank` counts it."""
    out: dict[str | None, list[float | None]] = {}
    todo: list[RankTarget] = []
    if p_bucket.num_rows == 0:
        return out, todo
    whole = _group(p_bucket, ("key",), sums=("n",), mins=("lo",), maxs=("hi",)).sort_by("key")
    # Every domain's buckets in one sort, each domain a slice: one pass, whatever the number of domains.
    by_domain = p_bucket.sort_by([("domain", "ascending"), ("key", "ascending")])
    dom = by_domain["domain"]
    k = by_domain.num_rows
    starts = [0] if k else []
    if k > 1:
        differs = pc.not_equal(dom.slice(0, k - 1), dom.slice(1))
        starts += (np.flatnonzero(np.asarray(pc.fill_null(differs, True).to_numpy(zero_copy_only=False))) + 1).tolist()
    groups: list[tuple[str | None, pa.Table]] = [(None, whole)]
    names = dom.take(pa.array(starts, pa.int64())).to_pylist() if starts else []
    for d, a, b in zip(names, starts, [*starts[1:], k], strict=True):
        groups.append((d, by_domain.slice(a, b - a)))
    for d, t in groups:
        n = np.asarray(t["n"].to_numpy(), dtype=np.int64)
        lo, hi = t["lo"].to_numpy(), t["hi"].to_numpy()
        cum = np.cumsum(n)
        total = int(cum[-1])
        vals: list[float | None] = []
        for i, p in enumerate(ps):
            rank = max(1, math.ceil(p * total))
            j = int(np.searchsorted(cum, rank, side="left"))
            within = rank - (int(cum[j - 1]) if j else 0)
            if lo[j] == hi[j] or within == 1:
                vals.append(float(lo[j]))
            elif within == int(n[j]):
                vals.append(float(hi[j]))
            else:
                vals.append(None)
                todo.append(RankTarget(d, i, float(lo[j]), float(hi[j]), int(n[j]), within))
        out[d] = vals
    return out, todo


def rank_value(target: RankTarget, values: Iterable[tuple[float, int]]) -> float:
    """The ``target.within``-th smallest of the values of the target's bucket, given as (value, count) pairs.
    Raises ValueError when the counts do not add up to the bucket's (the two reads disagree)."""
    got = sorted(values)
    if sum(c for _, c in got) != target.n:
        raise ValueError(f"percentile bucket [{target.lo}, {target.hi}] of {target.domain!r}: "
                         f"{sum(c for _, c in got)} values read back, {target.n} counted")
    seen = 0
    for v, c in got:
        seen += c
        if seen >= target.within:
            return v
    raise AssertionError("unreachable: within <= n")


def _outcome_parts(oe: pa.Table) -> dict[str, pa.Table]:
    st = oe["status"]
    delivered = _true(pc.equal(st, "delivered"))
    one = pa.scalar(1, pa.int64())
    zero = pa.scalar(0, pa.int64())
    delay_us = pc.subtract(oe["ts"].cast(_TS).cast(pa.int64()), oe["arrival_ts"].cast(_TS).cast(pa.int64()))
    delay_s = oe["delay_s"].cast(pa.float64())
    d_delay = pc.and_(delivered, pc.is_valid(delay_us))
    v = pa.table({
        "domain": pc.fill_null(oe["rcpt_domain"], "?"),
        "hour": _hour(oe["ts"]),
        "bucket": pc.if_else(delivered, _labels(_floats(delay_s), DELAY_BUCKETS_S, "s"), pa.scalar(None, pa.string())),
        "delivered": pc.if_else(delivered, one, zero),
        "bytes_delivered": pc.if_else(delivered, pc.fill_null(oe["size"].cast(pa.int64()), 0), zero),
        "deferrals": pc.if_else(_true(pc.equal(st, "deferred")), one, zero),
        "bounced": pc.if_else(_true(pc.is_in(st, value_set=pa.array(["failed", "expired"]))), one, zero),
        "expired": pc.if_else(_true(pc.equal(st, "expired")), one, zero),
        "delay_us": pc.if_else(d_delay, delay_us, zero),
        "delay_n": pc.if_else(d_delay, one, zero),
        "delay_max_s": pc.if_else(delivered, delay_s, pa.scalar(None, pa.float64())),
    })
    out = {}
    for name, keys in (("o_total", ()), ("o_domain", ("domain",)), ("o_hour", ("hour",))):
        out[name] = _group(v, keys, sums=_O_VALUES, maxs=("delay_max_s",))
    out["o_bucket"] = _group(v.filter(delivered), ("bucket",), sums=_O_VALUES, maxs=("delay_max_s",))
    d = pa.table({"domain": v["domain"], "delay": delay_s}).filter(pc.and_(delivered, pc.is_valid(delay_s)))
    out["p_bucket"] = _group(pa.table({"domain": d["domain"], "key": pa.array(delay_key(_floats(d["delay"]))),
                                       "lo": d["delay"], "hi": d["delay"]}),
                             ("domain", "key"), mins=("lo",), maxs=("hi",), count="n").select(["domain", "key", "n", "lo", "hi"])
    # the columns a part needs, then the rows (a filter copies every column it is given)
    deferred = oe.select(["queue_id", "rcpt_index", "rcpt_domain"]).filter(_true(pc.equal(st, "deferred")))
    deferred = deferred.group_by(["queue_id", "rcpt_index", "rcpt_domain"], use_threads=False).aggregate([])
    out["deferred"] = _group(pa.table({"domain": pc.fill_null(deferred["rcpt_domain"], "?")}), ("domain",),
                             count="deferred")
    r = oe.select(["status", "enhanced", "relay", "queue_id", "rcpt_index", "text", "code"]).filter(
        _true(pc.is_in(st, value_set=pa.array(["deferred", "failed", "expired"]))))
    r = pa.table({
        "status": pc.if_else(_true(pc.equal(r["status"], "failed")), pa.scalar("bounced"), r["status"]),
        "enhanced": r["enhanced"], "relay": r["relay"], "queue_id": r["queue_id"], "rcpt_index": r["rcpt_index"],
        "text": r["text"], "code": r["code"]})
    why = ("status", "enhanced", "relay")
    per_rcpt = _group(r, (*why, "queue_id", "rcpt_index"), mins=("text",), count="n")
    per_msg = _group(per_rcpt, (*why, "queue_id"), sums=("n",), mins=("text",), count="recipients")
    reasons = _group(per_msg, why, sums=("n", "recipients"), mins=("text",), count="messages")
    out["reasons"] = reasons.rename_columns([*why, "count", "recipients", "example", "messages"]).select(
        [*why, "count", "recipients", "messages", "example"])
    c = pa.table({"status": r["status"], "category": _categories(r["code"], r["enhanced"], r["text"]),
                  "queue_id": r["queue_id"], "rcpt_index": r["rcpt_index"], "text": r["text"]})
    cat = ("status", "category")
    per_rcpt = _group(c, (*cat, "queue_id", "rcpt_index"), mins=("text",), count="n")
    per_msg = _group(per_rcpt, (*cat, "queue_id"), sums=("n",), mins=("text",), count="recipients")
    cats = _group(per_msg, cat, sums=("n", "recipients"), mins=("text",), count="messages")
    out["categories"] = cats.rename_columns([*cat, "count", "recipients", "example", "messages"]).select(
        [*cat, "count", "recipients", "messages", "example"])
    out["recipients"] = _count_bytes(oe.select(["rcpt_address", "rcpt_domain", "size"]).filter(delivered),
                                     ("rcpt_address", "rcpt_domain"), "delivered")
    return out


def _categories(code: pa.ChunkedArray, enhanced: pa.ChunkedArray, text: pa.ChunkedArray,
                rules: Rules | None = None) -> pa.ChunkedArray | pa.Array:
    """The bounce category of each reply (:func:`mtaq.core.bounce_class.classify`; ``rules`` None: the shipped
    rules): each distinct (code, enhanced, text) classified once, then looked up (pyarrow ``index_in``)."""
    rules = rules or default_rules()
    parts = [pc.fill_null(a.cast(pa.string()), "") for a in (code, enhanced, text)]
    key = pc.binary_join_element_wise(*parts, "\x1f")  # code and enhanced code never hold \x1f
    distinct = pc.unique(key)
    cats = []
    for k in distinct.to_pylist():
        c, e, t = k.split("\x1f", 2)
        cats.append(classify(rules, c, e, t))
    return pa.array(cats, pa.string()).take(pc.index_in(key, value_set=distinct))


def _count_bytes(t: pa.Table, keys: tuple[str, str], count: str) -> pa.Table:
    """The rows of ``t`` by ``keys``: ``count`` (rows) and bytes (the sum of ``size``), in that column order."""
    v = pa.table({keys[0]: t[keys[0]], keys[1]: t[keys[1]], "bytes": t["size"].cast(pa.int64())})
    return _group(v, keys, sums=("bytes",), count=count).select([*keys, count, "bytes"])


def _message_parts(msgs: pa.Table, since_us: int | None, until_us: int | None) -> dict[str, pa.Table]:
    m = msgs.filter(pc.and_(_true(msgs["first_seen"]), in_window(msgs["arrival_ts"], since_us, until_us)))
    bo = m["bounce_of"]
    recv = _true(pc.equal(bo, ""))
    one = pa.scalar(1, pa.int64())
    zero = pa.scalar(0, pa.int64())
    v = pa.table({
        "domain": m["sender_domain"],
        "attempts": m["attempts"].cast(pa.int64()),
        "hour": _hour(m["arrival_ts"]),
        "received": pc.if_else(recv, one, zero),
        "bytes_received": pc.if_else(recv, pc.fill_null(m["size"].cast(pa.int64()), 0), zero),
        "dsn_generated": pc.if_else(_true(pc.not_equal(bo, "")), one, zero),
    })
    out = {name: _group(v, keys, sums=_M_VALUES) for name, keys in (
        ("m_total", ()), ("m_domain", ("domain",)), ("m_attempts", ("attempts",)), ("m_hour", ("hour",)))}
    out["senders"] = _count_bytes(m.select(["sender", "sender_domain", "size"]).filter(recv), ("sender", "sender_domain"),
                                  "messages")
    return out


def _ints(a: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(a.cast(_TS).cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)


def _qshape(msgs: pa.Table, since_us: int | None, until_us: int | None, end_us: int | None) -> dict[str, pa.Table]:
    """Every whole hour from the first after arrival to the last before the FINISH (or the end), as the job's
    ``ticks`` explode them."""
    m = msgs.filter(pc.is_valid(msgs["arrival_ts"]))
    if end_us is None:
        m = m.filter(pc.is_valid(m["finish_ts"]))
    arr = _ints(m["arrival_ts"])
    finish = m["finish_ts"].cast(_TS).cast(pa.int64())
    gone = pc.subtract(finish, 1)
    if end_us is not None:
        gone = pc.min_element_wise(pc.fill_null(gone, end_us), pa.scalar(end_us, pa.int64()))
    last = np.asarray(gone.to_numpy(zero_copy_only=False), dtype=np.int64)
    first = arr // _HOUR_US * _HOUR_US
    first = np.where(first == arr, first, first + _HOUR_US)
    last = last // _HOUR_US * _HOUR_US
    n = np.where(first <= last, (last - first) // _HOUR_US + 1, 0)
    idx = np.repeat(np.arange(len(arr)), n)
    starts = np.repeat(np.cumsum(n) - n, n)
    tick = first[idx] + (np.arange(len(idx)) - starts) * _HOUR_US
    keep = np.ones(len(tick), dtype=bool)
    if since_us is not None:
        keep &= tick >= since_us
    if until_us is not None:
        keep &= tick < until_us
    idx, tick = idx[keep], tick[keep]
    age_min = (tick - arr[idx]) / 1e6 / 60
    size = pc.fill_null(m["size"].cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
    v = pa.table({"tick": pa.array(tick, pa.int64()).cast(_TS), "age": _labels(age_min, AGE_BUCKETS_MIN, "m"),
                  "bytes": pa.array(size[idx] if len(size) else np.zeros(0, np.int64), pa.int64())})
    return {"qshape": _group(v, ("tick",), sums=("bytes",), count="messages").select(["tick", "messages", "bytes"]),
            "qshape_age": _group(v, ("tick", "age"), count="messages")}


def _qshape_now(msgs: pa.Table, outcomes: pa.Table, rcpts: pa.Table, end_us: int) -> dict[str, pa.Table]:
    """Recipients of the messages arrived by ``end_us`` and not FINISHed by then, without a final outcome
    (delivered or failed) at or before it."""
    end = pa.scalar(end_us, pa.int64())
    arr = msgs["arrival_ts"].cast(_TS).cast(pa.int64())
    fin = msgs["finish_ts"].cast(_TS).cast(pa.int64())
    pending = msgs.filter(pc.and_(_true(pc.less_equal(arr, end)),
                                  pc.or_(pc.is_null(fin), _true(pc.greater(fin, end)))))
    final = outcomes.filter(pc.and_(_true(pc.is_in(outcomes["status"], value_set=pa.array(["delivered", "failed"]))),
                                    _true(pc.less_equal(outcomes["ts"].cast(_TS).cast(pa.int64()), end))))
    p = (pending.select(["queue_id", "arrival_ts"])
         .join(rcpts.select(["queue_id", "rcpt_index", "rcpt_domain"]), "queue_id", join_type="inner")
         .join(final.select(["queue_id", "rcpt_index"]), ["queue_id", "rcpt_index"], join_type="left anti"))
    age_min = (end_us - _ints(p["arrival_ts"])) / 1e6 / 60
    v = pa.table({"domain": pc.fill_null(p["rcpt_domain"], "?"), "age": _labels(age_min, AGE_BUCKETS_MIN, "m")})
    return {"qshape_now": _group(v, ("domain",), count="recipients"),
            "qshape_now_age": _group(v, ("domain", "age"), count="recipients")}


def encode(parts: dict[str, pa.Table]) -> Iterator[tuple[str, bytes]]:
    """(part, Arrow IPC stream bytes) for each partial table."""
    for name, table in parts.items():
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        yield name, sink.getvalue().to_pybytes()


def decode(data: bytes) -> pa.Table:
    """The partial table of one :func:`encode` row."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def rows_table(rows: Iterable[Sequence[Any]], names: Sequence[str]) -> pa.Table | None:
    """Spark rows as a FACT_SCHEMA table (None: no rows): ``rows`` are tuples of the columns ``names`` of
    :data:`mtaq.analytics.facts.FACT_SCHEMA`, timestamps as microseconds since the epoch (so that no time zone
    of an executor comes into it). A Python row API rather than ``mapInArrow``, which needs pandas on the
    driver and every executor; the rows here are only those of the messages no task closed."""
    got = list(rows)
    if not got:
        return None
    from mtaq.analytics.facts import FACT_SCHEMA

    arrays = []
    for name, values in zip(names, zip(*got, strict=True), strict=True):
        typ = FACT_SCHEMA.field(name).type
        arrays.append(pa.array(values, pa.int64()).cast(typ) if pa.types.is_timestamp(typ) else pa.array(values, typ))
    return pa.Table.from_arrays(arrays, names=list(names))


def merge(rows: Iterable[tuple[str, bytes]]) -> dict[str, pa.Table]:
    """The partial tables of every task and partition, added up: one table per part of ``PARTS`` (absent
    parts: empty), keys unique. Raises ValueError on a part this version does not know."""
    got: dict[str, list[pa.Table]] = {}
    for name, data in rows:
        if name not in PARTS:
            raise ValueError(f"unknown partial table {name!r}")
        got.setdefault(name, []).append(decode(data))
    return {name: merge_tables(name, got.get(name, [])) for name in PARTS}


MERGE_SPLIT_ROWS = 500_000  # partial rows from which merge_tables groups them on several threads


def merge_threads() -> int:
    """The threads :func:`merge_tables` groups a large table on: the cores this process may run on, at most 4."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except AttributeError:  # not on Linux
        return max(1, min(4, os.cpu_count() or 1))


def merge_tables(name: str, tables: Sequence[pa.Table], *, threads: int | None = None) -> pa.Table:
    """Partial tables of the part ``name`` of ``PARTS`` added up (keys unique, rows in no particular order); no
    table: an empty table with no columns. From MERGE_SPLIT_ROWS rows on, where the first key is a string
    (the senders and recipients: a row per address), the rows are split by that key's length in bytes
    modulo ``threads`` (default :func:`merge_threads`) and each part is grouped on a thread of its own:
    rows of one group have one key, so one length, and are in one part. Raises KeyError on a part this
    version does not know."""
    keys, how = PARTS[name]
    if not tables:
        return pa.table({})
    t = pa.concat_tables(tables, promote_options="permissive")
    if how:
        by: dict[str, list[str]] = {}
        for col, fn in how.items():
            by.setdefault(fn, []).append(col)

        def group(x: pa.Table) -> pa.Table:
            return _group(x, keys, sums=by.get("sum", ()), maxs=by.get("max", ()), mins=by.get("min", ()))

        n = merge_threads() if threads is None else threads
        if n > 1 and t.num_rows >= MERGE_SPLIT_ROWS and keys and pa.types.is_string(t.schema.field(keys[0]).type):
            part = np.asarray(pc.fill_null(pc.binary_length(t[keys[0]]), 0).to_numpy(zero_copy_only=False)) % n
            with ThreadPoolExecutor(n) as pool:
                t = pa.concat_tables(pool.map(group, [t.filter(pa.array(part == k)) for k in range(n)]))
        else:
            t = group(t)
        t = t.select([*keys, *how])
    return t
