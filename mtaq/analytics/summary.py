"""The report's totals and small tables from the partial aggregates the job added up (issue 38, item 5: the
job split by concern). Pure Python over collected rows; no Spark. Orders are Spark's (nulls first in an
ascending key, last in a descending one), so that the rows compare equal whichever path computed them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from mtaq.analytics.staging import pylist
from mtaq.analytics.tables import AGE_BUCKETS_MIN, bucket_labels

__all__ = ["REJECTED_NOTE", "merge_top", "sorted_rows", "split_parts", "totals_and_tables"]

REJECTED_NOTE = (
    "rejected is 0: mail refused at the SMTP door (4xx/5xx before DATA is queued) never reaches the queue "
    "log, which holds only accepted mail; give the daemon's JSON event log with --events to count them."
)


def split_parts(parts: dict[str, pa.Table], percentiles: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of the small tables from the merged partial tables (:func:`mtaq.analytics.partials.merge`) and
    the rows of the percentile aggregation, as the job's definitions give them (:mod:`mtaq.analytics.job`'s module docstring)."""
    rows = {name: pylist(t) for name, t in parts.items()}
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
    out["segments"] = _segments([r for r in side if r["record_type"] == "SEGMENT"])
    seen: set[tuple[Any, ...]] = set()
    out["unknown"] = []
    for r in side:
        if r["record_type"] in ("ENVELOPE", "FLAGGED") and (key := (r["queue_id"], r["rcpt_index"], r["generation"])) not in seen:
            seen.add(key)
            out["unknown"].append({"queue_id": r["queue_id"], "rcpt_index": r["rcpt_index"],
                                   "rcpt_address": r["rcpt_address"], "generation": r["generation"],
                                   "flagged_ts": r["not_before_ts"], "last_reply": r["last_reply"]})
    return out


def _segments(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per segment file from its SEGMENT rows: one for a file read whole (``offset`` 0); a file whose
    tail a run with ``--state`` read on its own (:class:`mtaq.analytics.source.SegmentFile` ``start``) has a
    row for the bytes before and one from ``offset`` on: bytes and records added up, ``sealed`` the last's."""
    out: dict[tuple[Any, Any], dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["offset"] or 0):
        key = (r["file"], r["segment"])
        got = out.get(key)
        if got is None:
            out[key] = {"file": r["file"], "segment": r["segment"], "size": r["size"], "records": r["records"],
                        "sealed": r["sealed"], "created_ts": r["ts"]}
        else:
            got["size"] += r["size"]
            got["records"] += r["records"]
            got["sealed"] = r["sealed"]
    return list(out.values())


def merge_top(by_count: list[dict[str, Any]], by_bytes: list[dict[str, Any]], key: str,
               order: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of both top lists (each row once), in ``order``."""
    seen: dict[Any, dict[str, Any]] = {}
    for r in (*by_count, *by_bytes):
        seen.setdefault(r[key], r)
    return sorted_rows(list(seen.values()), *order)


def sorted_rows(rows: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
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


def totals_and_tables(got: dict[str, list[dict[str, Any]]], inventory: dict[str, Any], since: dt.datetime | None,
                      until: dt.datetime | None) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The report's totals and tables from the collected rows ``got`` (:func:`split_parts`' and the senders'
    and recipients' counts and top lists) and the tasks' merged ``inventory``, for the window
    ``since``/``until`` (aware UTC datetimes or None): the definitions of :mod:`mtaq.analytics.job`'s module
    docstring, each table in its fixed order."""
    age_labels = bucket_labels(AGE_BUCKETS_MIN, "m")
    [r] = got["totals_r"]
    [d] = got["totals_d"]
    [o] = got["totals_o"]
    problems = sorted_rows(got["problems"], "segment", "offset")
    unknown = sorted_rows(got["unknown"], "flagged_ts", "queue_id", "rcpt_index")
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
    hourly_rows = sorted_rows(got["hourly"], "hour")
    daily: dict[dt.date, dict[str, Any]] = {}
    for h in hourly_rows:
        day = h["hour"].date()
        row = daily.setdefault(day, {"day": day, **{k: 0 for k in h if k != "hour"}})
        for k, v in h.items():
            if k != "hour":
                row[k] += v
    top_senders = merge_top(got["senders_by_count"], got["senders_by_bytes"], "sender",
                             ("-messages", "-bytes", "sender"))
    top_recipients = merge_top(got["recipients_by_count"], got["recipients_by_bytes"], "rcpt_address",
                                ("-delivered", "-bytes", "rcpt_address"))
    tables: dict[str, list[dict[str, Any]]] = {
        "problems": problems,
        "unknown": unknown,
        "domains": sorted_rows(domain_rows, "-delivered", "-deferrals", "domain"),
        "senders": top_senders,
        "sender_domains": sorted_rows(got["sender_domains"], "-messages", "domain"),
        "recipients": top_recipients,
        "reasons": sorted_rows(got["reasons"], "-count", "status", "enhanced", "relay"),
        "categories": sorted_rows(got["categories"], "status", "-count", "category"),
        "hourly": hourly_rows,
        "daily": [daily[k] for k in sorted(daily)],
        "delays": got["delays"],
        "attempts": sorted_rows(got["attempts"], "attempts"),
        "qshape": [{k: r[k] for k in ("tick", "messages", "bytes", *age_labels)} for r in sorted_rows(got["qshape"], "tick")],
        "qshape_now": [{k: r[k] for k in ("domain", "recipients", *age_labels)}
                       for r in sorted_rows(got["qshape_now"], "-recipients", "domain")],
        "segments": sorted_rows(got["segments"], "segment", "file"),
    }
    return totals, tables
