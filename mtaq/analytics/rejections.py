"""Rejections from the daemon's JSON event log (``mtaq analyze --events FILE...``, issue 38.3).

The queue log holds only accepted mail; what the edge refused is in its events (``log_format = "json"``):

* ``smtp_reject``: a 4xx/5xx reply to MAIL, RCPT or DATA (``client``, ``stage`` mail/rcpt/data, ``code``,
  ``enhanced``, ``reply``, ``sender``, ``recipient``): every refusal of a transaction, whatever refused it
  (relay control, address checks, limits, header checks, milters, the queue's storage);
* ``connection_refused``: a connection the gate refused (``client``, ``reason``; ``code`` 421, or null on an
  smtps listener, where the refusal is a close before the TLS handshake).

Each is one row of the ``rejections`` table (:data:`SCHEMA`): ts (the event's ``timestamp``, UTC), stage
(``connect`` for a refused connection), client, code, enhanced, reply (the reply text, or the refusal's
reason), reason (the reply without its codes, each ``<address>`` as ``<>``: what the report groups by, as
pflogsumm groups its reject lines), sender, recipient, file (the event file). Files may be rotated and
gzip-compressed (``.gz``); lines that are not JSON objects (a console-format log, a torn last line) are
counted in ``skipped``, never an error. The report's section: top reasons, top clients, per hour.
"""

from __future__ import annotations

import datetime as dt
import gzip
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["EVENTS", "SCHEMA", "Rejections", "read_events", "summarize"]

EVENTS = (b'"smtp_reject"', b'"connection_refused"')
_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema([("ts", _TS), ("stage", pa.string()), ("client", pa.string()), ("code", pa.int32()),
                    ("enhanced", pa.string()), ("reply", pa.string()), ("reason", pa.string()),
                    ("sender", pa.string()), ("recipient", pa.string()), ("file", pa.string())])
_CODES = re.compile(r"^\d{3}[ -](?:[245]\.\d{1,3}\.\d{1,3} )?")
_ADDRESS = re.compile(r"<[^<>]*>")
_DECODER = msgspec.json.Decoder()


@dataclass
class Rejections:
    """The ``rejections`` table (:data:`SCHEMA`), and the lines that were not events (``skipped``)."""

    table: pa.Table
    skipped: int


def _lines(path: str) -> Iterator[bytes]:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        yield from f


def _ts(text: Any) -> dt.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.astimezone(dt.UTC) if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)


def _reason(reply: str) -> str:
    return _ADDRESS.sub("<>", _CODES.sub("", reply, count=1)).strip()


def read_events(paths: Sequence[str], since: dt.datetime | None = None, until: dt.datetime | None = None) -> Rejections:
    """The rejections in the event files ``paths`` (JSON lines, ``.gz`` read as gzip), in [since, until)
    (aware UTC; None: unbounded), in file order. Raises OSError for a file that cannot be read."""
    rows: dict[str, list[Any]] = {n: [] for n in SCHEMA.names}
    skipped = 0
    for path in paths:
        for line in _lines(path):
            if not any(e in line for e in EVENTS):
                continue  # most lines: not a refusal, not decoded
            try:
                ev = _DECODER.decode(line)
            except msgspec.DecodeError:
                skipped += 1
                continue
            if not isinstance(ev, dict) or ev.get("event") not in ("smtp_reject", "connection_refused"):
                continue
            ts = _ts(ev.get("timestamp"))
            if ts is None:
                skipped += 1
                continue
            if (since is not None and ts < since) or (until is not None and ts >= until):
                continue
            connect = ev["event"] == "connection_refused"
            reply = str(ev.get("reason" if connect else "reply") or "")
            code = ev.get("code")
            rows["ts"].append(ts)
            rows["stage"].append("connect" if connect else str(ev.get("stage") or ""))
            rows["client"].append(str(ev.get("client") or ""))
            rows["code"].append(code if isinstance(code, int) and not isinstance(code, bool) else None)
            rows["enhanced"].append("4.7.0" if connect and code == 421 else str(ev.get("enhanced") or ""))
            rows["reply"].append(reply)
            rows["reason"].append(reply if connect else _reason(reply))
            rows["sender"].append(str(ev.get("sender") or ""))
            rows["recipient"].append(str(ev.get("recipient") or ""))
            rows["file"].append(path)
    return Rejections(pa.table(rows, schema=SCHEMA), skipped)


def summarize(t: pa.Table) -> dict[str, list[dict[str, Any]]]:
    """The report's tables of the rejections ``t``: ``rejection_reasons`` (by stage, code, enhanced, reason:
    count, clients, example reply: the least), ``rejection_clients`` (by client: count, and per stage),
    ``rejection_hourly`` (by UTC hour: count, and per stage); each sorted as the report shows it."""
    stages = ("connect", "mail", "rcpt", "data")
    if t.num_rows == 0:
        return {"rejection_reasons": [], "rejection_clients": [], "rejection_hourly": []}
    per_stage = {s: pc.equal(t["stage"], s).cast(pa.int64()) for s in stages}
    reasons = t.group_by(["stage", "code", "enhanced", "reason"], use_threads=False).aggregate(
        [([], "count_all"), ("client", "count_distinct"), ("reply", "min")]).rename_columns(
        ["stage", "code", "enhanced", "reason", "count", "clients", "example"])
    wide = t.select(["client", "ts"]).append_column("hour", pc.floor_temporal(t["ts"], unit="hour"))
    for s, col in per_stage.items():
        wide = wide.append_column(s, col)
    sums = [(s, "sum") for s in stages]
    clients = wide.group_by(["client"], use_threads=False).aggregate([([], "count_all"), *sums]).rename_columns(
        ["client", "count", *stages])
    hourly = wide.group_by(["hour"], use_threads=False).aggregate([([], "count_all"), *sums]).rename_columns(
        ["hour", "count", *stages])

    def rows(x: pa.Table) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = x.to_pylist()
        return out

    return {
        "rejection_reasons": sorted(rows(reasons), key=lambda r: (-r["count"], r["stage"], r["code"] or 0,
                                                                  r["enhanced"], r["reason"])),
        "rejection_clients": sorted(rows(clients), key=lambda r: (-r["count"], r["client"])),
        "rejection_hourly": sorted(rows(hourly), key=lambda r: r["hour"]),
    }
