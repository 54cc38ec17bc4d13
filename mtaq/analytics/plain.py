"""The headline totals of ``mtaq analyze`` from a plain single-process scan (no Spark): baseline and cross-check.

Same files (:func:`mtaq.analytics.source.discover`), same codec (:func:`mtaq.core.frame.scan_segment`), same
definitions as :mod:`mtaq.analytics.job` without a time window: received, delivered, deferred, deferrals,
bounced (failed + expired), expired, dsn_generated, bytes received and delivered, nearest-rank time-to-deliver
percentiles (seconds), outcome_unknown, problems, segments and records. Everything is held in memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mtaq.analytics.source import discover, read_segment_bytes
from mtaq.core.frame import scan_segment
from mtaq.core.records import DeliveryRecord, EnvelopeRecord, FinishRecord

__all__ = ["nearest_rank", "plain_totals"]


def nearest_rank(sorted_values: Sequence[float], p: float) -> float | None:
    """The smallest value with at least a fraction ``p`` of the values at or below it (None if empty)."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(p * len(sorted_values)) - 1)]


def plain_totals(paths: Sequence[str]) -> dict[str, Any]:
    """Headline totals of the segments named by ``paths`` (see the module docstring)."""
    arrival: dict[str, float] = {}
    size: dict[str, int] = {}
    received = dsn = bytes_received = 0
    finish: dict[str, float] = {}
    outcomes: list[tuple[str, int, float, int, str]] = []  # qid, index, ts, order, status
    unknown: set[tuple[str, int, int]] = set()
    problems = segments = records = 0
    order = 0
    for sf in discover(paths):
        try:
            buf = read_segment_bytes(sf)
        except Exception:
            problems += 1
            continue
        scan = scan_segment(sf.segment, buf, skip_data=True)
        segments += 1
        records += scan.frames + (1 if scan.sealed else 0)
        problems += sum(
            1 for p in scan.problems
            if not (p.kind == "torn-tail" and not scan.sealed and p.reason != "bytes after seal" and scan.header)
        )
        for _pos, rec in scan.records:
            if isinstance(rec, DeliveryRecord):
                for o in rec.outcomes:
                    order += 1
                    outcomes.append((rec.queue_id, o.index, rec.ts, order, o.status))
            elif isinstance(rec, EnvelopeRecord):
                q = rec.queue_id
                if q not in arrival or rec.arrival_ts < arrival[q]:
                    arrival[q] = rec.arrival_ts
                size[q] = max(size.get(q, 0), rec.size)
                if rec.generation == 0:
                    if rec.bounce_of:
                        dsn += 1
                    else:
                        received += 1
                        bytes_received += rec.size
                for r in rec.recipients:
                    if r.unknown:
                        unknown.add((q, r.index, rec.generation))
            elif isinstance(rec, FinishRecord):
                finish[rec.queue_id] = max(finish.get(rec.queue_id, rec.ts), rec.ts)
    delivered = deferrals = failed = bytes_delivered = 0
    deferred: set[tuple[str, int]] = set()
    delays: list[float] = []
    last: dict[tuple[str, int], tuple[float, int, str]] = {}
    for q, i, ts, n, status in outcomes:
        if status == "delivered":
            delivered += 1
            bytes_delivered += size.get(q, 0)
            if q in arrival:
                delays.append(ts - arrival[q])
        elif status == "deferred":
            deferrals += 1
            deferred.add((q, i))
        else:
            failed += 1
        prev = last.get((q, i))
        if prev is None or (ts, n) > prev[:2]:
            last[(q, i)] = (ts, n, status)
    expired = sum(1 for (q, _i), (ts, _n, s) in last.items() if s == "deferred" and q in finish and finish[q] >= ts)
    delays.sort()
    return {
        "received": received,
        "delivered": delivered,
        "deferred": len(deferred),
        "bounced": failed + expired,
        "rejected": 0,
        "deferrals": deferrals,
        "expired": expired,
        "dsn_generated": dsn,
        "bytes_received": bytes_received,
        "bytes_delivered": bytes_delivered,
        "delay_p50_s": nearest_rank(delays, 0.5),
        "delay_p90_s": nearest_rank(delays, 0.9),
        "delay_p99_s": nearest_rank(delays, 0.99),
        "outcome_unknown": len(unknown),
        "problems": problems,
        "segments": segments,
        "records": records,
    }
