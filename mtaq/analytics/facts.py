"""Per-message and per-outcome facts computed where the segments are decoded (the data source's ``facts`` rows).

The job (:mod:`mtaq.analytics.job`) needs, per message, its arrival, size, sender, recipients, attempts and
FINISH time, and per recipient outcome that outcome joined with its recipient and its message (plus the
``expired`` rule: a recipient whose last reply was 4xx in a message that then FINISHed). Computing that in
Spark meant shuffling every decoded row by queue ID and joining them in the JVM. Here the data source's
Python task does it for the messages it can see whole, with pyarrow's C++ group-bys and joins, and hands
Spark only the results.

A message is *closed* in a partition when the partition holds its first envelope (generation 0) and a
FINISH. A partition is a run of whole segments in log order (:func:`mtaq.analytics.source.plan_partitions`)
and nothing of a message is logged before its first envelope except its DATA, or after its FINISH, so a
closed message has all its records in that partition and none anywhere else. Its facts are final there.
Every other message (its records spread over partitions, or still queued) keeps its record rows, which
the job merges (on the driver with :func:`open_facts` when they are few, else with Spark); so do PROBLEM and
SEGMENT rows. Same definitions as the job's Spark plan (job.py's docstring), value for value: the job's
tests compare them with the plain scan.

Rows (:data:`FACT_SCHEMA`: the record columns the job reads plus five of facts), by ``record_type``:

* ``MESSAGE``: one per closed message: queue_id, arrival_ts (earliest), size (largest), sender,
  sender_domain, bounce_of, first_seen (true), recipients, attempts (START records), finish_ts (latest
  FINISH), and ts, the latest time of any of its records (the job's end of the log);
* ``OUTCOME``: one per recipient outcome of a closed message, and one ``expired`` outcome per recipient
  that ran out of queue lifetime: queue_id, rcpt_index, ts, status, code, enhanced, text, relay, segment,
  offset, rcpt_address, rcpt_domain, arrival_ts, size, sender, bounce_of, finish_ts, delay_s;
* ``FLAGGED``: the ENVELOPE rows of closed messages with ``rcpt_unknown`` set (the outcome-unknown table);
* ``RCPT``: with ``until`` given, the recipients (queue_id, rcpt_index, rcpt_address, rcpt_domain) of
  closed messages still queued at ``until`` (the queue-shape-now table);
* ENVELOPE, START, DELIVERY, FINISH, PROBLEM, SEGMENT: record rows as :data:`mtaq.analytics.source.SCHEMA`
  has them, for everything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mtaq.analytics.source import COLUMNS, SegmentFile, typed_batches

__all__ = ["FACT_COLUMNS", "FACT_SCHEMA", "FACT_SPARK_DDL", "MESSAGE_COLUMNS", "MESSAGE_SPARK_DDL", "OUTCOME_COLUMNS",
           "OUTCOME_SPARK_DDL", "by_kind", "fact_batches", "fact_kinds", "fact_table", "facts_of", "open_facts"]

_RECORD_COLUMNS = (
    "record_type", "queue_id", "ts", "arrival_ts", "not_before_ts", "generation", "size", "sender", "sender_domain",
    "bounce_of", "rcpt_index", "rcpt_address", "rcpt_domain", "rcpt_unknown", "last_reply", "status", "code",
    "enhanced", "text", "relay", "segment", "offset", "file", "records", "sealed", "problem_kind", "problem_end",
    "problem_reason")
_TS = pa.timestamp("us", tz="UTC")
_EXTRA: list[tuple[str, pa.DataType, str, str]] = [
    ("first_seen", pa.bool_(), "boolean", "MESSAGE: its first envelope (generation 0) is in the log"),
    ("recipients", pa.int64(), "bigint", "MESSAGE: recipients"),
    ("attempts", pa.int64(), "bigint", "MESSAGE: delivery attempts (START records)"),
    ("finish_ts", _TS, "timestamp", "MESSAGE/OUTCOME: when the message FINISHed (UTC)"),
    ("delay_s", pa.float64(), "double", "OUTCOME: outcome time minus arrival, seconds"),
]
_BY_NAME = {c[0]: c for c in COLUMNS}
FACT_COLUMNS = [_BY_NAME[n] for n in _RECORD_COLUMNS] + _EXTRA
FACT_SCHEMA = pa.schema([(n, t) for n, t, _, _ in FACT_COLUMNS])
FACT_SPARK_DDL = ", ".join(f"{n} {s}" for n, _, s, _ in FACT_COLUMNS)
# The columns of the job's messages and outcomes tables (OUT/tables/messages, OUT/tables/outcomes): MESSAGE and
# OUTCOME rows as the data source's tasks stage them, and as the merge of the other messages stages them.
MESSAGE_COLUMNS = ("queue_id", "arrival_ts", "size", "sender", "sender_domain", "bounce_of", "first_seen", "recipients",
                   "attempts", "finish_ts")
OUTCOME_COLUMNS = ("queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset",
                   "rcpt_address", "rcpt_domain", "arrival_ts", "size", "sender", "bounce_of", "finish_ts", "delay_s")
_SPARK_TYPE = {n: s for n, _, s, _ in FACT_COLUMNS}
MESSAGE_SPARK_DDL = ", ".join(f"{n} {_SPARK_TYPE[n]}" for n in MESSAGE_COLUMNS)
OUTCOME_SPARK_DDL = ", ".join(f"{n} {_SPARK_TYPE[n]}" for n in OUTCOME_COLUMNS)
_KEYED_KINDS = ("ENVELOPE", "START", "DELIVERY", "FINISH")


def _out(t: pa.Table, rtype: str | None = None) -> pa.Table:
    """``t`` in FACT_SCHEMA: missing columns null, types cast, ``record_type`` set when given."""
    n = t.num_rows
    cols = []
    for name, typ in zip(FACT_SCHEMA.names, FACT_SCHEMA.types, strict=True):
        if name == "record_type" and rtype is not None:
            cols.append(pa.repeat(pa.scalar(rtype, pa.string()), n))
        elif name in t.column_names:
            c = t[name]
            cols.append(c.cast(typ) if c.type != typ else c)
        else:
            cols.append(pa.nulls(n, typ))
    return pa.Table.from_arrays(cols, schema=FACT_SCHEMA)


def _seconds(later: pa.ChunkedArray, earlier: pa.ChunkedArray) -> pa.ChunkedArray:
    """(later - earlier) in seconds as the job's Spark expression computes it: microseconds, then / 1e6."""
    diff = pc.subtract(later.cast(pa.int64()), earlier.cast(pa.int64()))
    return pc.divide(diff.cast(pa.float64()), 1e6)


def by_kind(t: pa.Table) -> dict[str, pa.Table]:
    """The rows of ``t`` (any table with a ``record_type`` column) by record type, each type's rows in ``t``'s
    order; a row whose type is null is in none."""
    rt = t["record_type"]
    return {k: t.filter(pc.equal(rt, k)) for k in pc.unique(rt).drop_null().to_pylist()}


def _keyed(kinds: Mapping[str, pa.Table]) -> tuple[pa.Table, dict[str, tuple[int, int]]] | None:
    """The ENVELOPE, START, DELIVERY and FINISH rows of ``kinds`` (record rows by type, _RECORD_COLUMNS) as one
    table (their chunks, not copied), and where each type's rows are in it (offset, rows); None if none."""
    parts, spans, at = [], {}, 0
    for k in _KEYED_KINDS:
        x = kinds.get(k)
        if x is not None and x.num_rows:
            parts.append(x.select(list(_RECORD_COLUMNS)))
            spans[k] = (at, x.num_rows)
            at += x.num_rows
    return (pa.concat_tables(parts), spans) if parts else None


class _Whole:
    """The facts of the messages whose record rows a table ``c`` holds (each type's rows together, where
    ``spans`` says: :func:`_keyed`), every row of each: ``e`` (envelope rows), ``rc`` (recipients), ``m``
    (messages), ``o`` (outcomes), ``expired`` (``expired`` outcomes, or None). The one definition of the facts,
    for the messages a task closes and for those merged later (:func:`open_facts`).

    Messages: one per queue ID with an envelope row: arrival (earliest), size (largest), ts (latest of any
    record), sender, sender_domain, bounce_of, recipients, attempts (START rows), finish_ts (latest FINISH,
    null if none), first_seen (an envelope of generation 0 is among them). Outcomes: every DELIVERY row's
    outcome joined with its recipient and its message (nulls where the log has none).

    The groupings and joins key on the queue ID's number in a dictionary of the table's queue IDs (int32; a
    null ID stays null), not on the string: pyarrow's hash joins and group-bys over strings were most of a
    task's facts (1.5 s of 2.5 s a segment). :meth:`named` puts the strings back.

    A message's facts are made of its own rows only (every grouping and join is by queue ID). So a task
    computes them over all its rows and keeps those of the messages it closes (:meth:`named` with ``keep``),
    rather than first copying those messages' rows out of the rest."""

    def __init__(self, c: pa.Table, spans: Mapping[str, tuple[int, int]], *, dense: bool = True,
                 closed_only: bool = False) -> None:
        at = c.schema.get_field_index("queue_id")
        enc = pc.dictionary_encode(c["queue_id"])
        chunks = enc.chunks
        if chunks and all(ch.dictionary.equals(chunks[-1].dictionary) for ch in chunks):
            # pyarrow encodes the chunks with one dictionary: no copy of the IDs into one array first
            self.dictionary: pa.Array = chunks[-1].dictionary
            indices: pa.Array | pa.ChunkedArray = pa.chunked_array([ch.indices for ch in chunks], pa.int32())
        else:
            whole = pc.dictionary_encode(c["queue_id"].combine_chunks())
            self.dictionary, indices = whole.dictionary, whole.indices
        self.numbers = _numbers(indices)  # a row's queue ID: its number in the dictionary, -1 for null
        self.c = c.set_column(at, "queue_id", indices)
        self.spans = spans
        self.keep = self.closed() if closed_only else None
        got = _whole_dense(self.c, spans, self.numbers, len(self.dictionary), self.keep) if dense else None
        # m, o and expired hold only the closed messages' rows already (dense) or still all (the definition)
        self.only_kept = got is not None and self.keep is not None
        self.e, self.rc, self.m, self.o, self.expired = got if got is not None else _whole_keyed(self.c, spans)

    def span(self, kind: str) -> tuple[int, int]:
        at, n = self.spans.get(kind, (0, 0))
        return at, at + n

    def closed(self) -> np.ndarray:
        """A boolean per dictionary number, then one more (False) for null: the queue IDs with an envelope of
        generation 0 and a FINISH (the module docstring's *closed*). Rows with a null queue ID (no log has one)
        are never a closed message: they stay record rows."""
        n = len(self.dictionary)
        env0 = np.zeros(n + 1, dtype=bool)
        a, b = self.span("ENVELOPE")
        gen0 = np.asarray(pc.fill_null(pc.equal(self.c["generation"].slice(a, b - a), 0), False), dtype=bool)
        env0[self.numbers[a:b][gen0]] = True
        finished = np.zeros(n + 1, dtype=bool)
        a, b = self.span("FINISH")
        finished[self.numbers[a:b]] = True
        out = env0 & finished
        out[n] = False  # numbers of -1 (null) index the last
        return out

    def named(self, t: pa.Table, keep: np.ndarray | None = None) -> pa.Table:
        """``t`` (keyed by number) with the queue IDs' strings; ``keep`` (as :meth:`closed` gives): only those."""
        if keep is not None:
            t = t.filter(pa.array(keep[_numbers(t["queue_id"])]))
        i = t.schema.get_field_index("queue_id")
        return t.set_column(i, "queue_id", self.dictionary.take(t["queue_id"]))


def _numbers(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Dictionary numbers (int32, maybe null) as an int64 numpy array, null as -1."""
    return np.asarray(pc.fill_null(a, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def _whole_keyed(c: pa.Table, spans: Mapping[str, tuple[int, int]]) -> tuple[pa.Table, pa.Table, pa.Table, pa.Table, pa.Table | None]:
    """:class:`_Whole`'s facts of ``c`` with ``queue_id`` a number (any key type works: the definitions only
    group and join on it), each record type's rows where ``spans`` says."""

    def kind(k: str) -> pa.Table:
        at, n = spans.get(k, (0, 0))
        return c.slice(at, n)

    e = kind("ENVELOPE")
    rc = e.select(["queue_id", "rcpt_index", "rcpt_address", "rcpt_domain"]).group_by(
        ["queue_id", "rcpt_index", "rcpt_address", "rcpt_domain"], use_threads=False).aggregate([])
    first = pa.table({"queue_id": e["queue_id"], "first_seen": pc.equal(e["generation"], 0)})
    m = (
        e.group_by("queue_id", use_threads=False).aggregate([("arrival_ts", "min"), ("size", "max")])
        .rename_columns(["queue_id", "arrival_ts", "size"])
        .join(c.group_by("queue_id", use_threads=False).aggregate([("ts", "max")]), "queue_id")
        .join(first.group_by("queue_id", use_threads=False).aggregate([("first_seen", "any")])
              .rename_columns(["queue_id", "first_seen"]), "queue_id")
        .join(e.select(["queue_id", "sender", "sender_domain", "bounce_of"]).group_by(
            ["queue_id", "sender", "sender_domain", "bounce_of"], use_threads=False).aggregate([]), "queue_id",
            join_type="left outer")
        .join(rc.group_by("queue_id", use_threads=False).aggregate([([], "count_all")])
              .rename_columns(["queue_id", "recipients"]), "queue_id", join_type="left outer")
        .join(kind("START").group_by("queue_id", use_threads=False).aggregate([([], "count_all")])
              .rename_columns(["queue_id", "attempts"]), "queue_id", join_type="left outer")
        .join(kind("FINISH").group_by("queue_id", use_threads=False).aggregate([("ts", "max")])
              .rename_columns(["queue_id", "finish_ts"]), "queue_id", join_type="left outer")
    )
    m = m.set_column(m.schema.get_field_index("attempts"), "attempts", pc.fill_null(m["attempts"], 0))
    m = m.rename_columns(["ts" if n == "ts_max" else n for n in m.column_names])
    o = (
        kind("DELIVERY")
        .select(["queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset"])
        .join(rc, ["queue_id", "rcpt_index"], join_type="left outer")
        .join(m.select(["queue_id", "arrival_ts", "size", "sender", "bounce_of", "finish_ts"]), "queue_id",
              join_type="left outer")
    )
    o = o.append_column("delay_s", _seconds(o["ts"], o["arrival_ts"]))
    return e, rc, m, o, _expired(o)


def _expired(o: pa.Table) -> pa.Table | None:
    """The ``expired`` outcomes of the outcome rows ``o`` (:func:`_whole_keyed`'s columns), None if none."""
    # The last outcome of each recipient (latest ts, then log position): in sorted order, the last row of each
    # run. Nulls first, so that the last is the latest known, as Spark's descending order (nulls last) gives
    # it. Only the keys are sorted, and only the rows that expire are taken whole. Where envelopes of one
    # message disagree (another address for a recipient, another sender), the joins above give an outcome
    # once for each: the last keys after the log position make the pick the same whatever order the joins
    # return rows in. A null number or queue ID (no log has one) is a run of its own.
    keys = ["queue_id", "rcpt_index", "ts", "segment", "offset", "rcpt_address", "rcpt_domain", "sender", "bounce_of"]
    order = _order_nulls_first(o.select(keys), keys)
    n = len(order)
    expired = None
    if n:
        q, i = o["queue_id"].take(order), o["rcpt_index"].take(order)
        same = pc.and_(_same(q.slice(0, n - 1), q.slice(1)), _same(i.slice(0, n - 1), i.slice(1)))
        last = pa.concat_arrays([*(ch for ch in pc.invert(same).chunks), pa.array([True])])
        cand = order.filter(last)
        hit = pc.fill_null(pc.and_(pc.equal(o["status"].take(cand), "deferred"),
                                   pc.greater_equal(o["finish_ts"].take(cand), o["ts"].take(cand))), False)
        s = o.take(cand.filter(hit))
        if s.num_rows:
            k = s.num_rows
            x = s.drop_columns(["ts", "status", "code", "enhanced", "text", "delay_s"])
            x = x.append_column("ts", s["finish_ts"]).append_column("status", pa.repeat(pa.scalar("expired"), k))
            x = x.append_column("enhanced", pa.repeat(pa.scalar("4.4.7"), k))
            x = x.append_column("text", pc.binary_join_element_wise(
                pa.repeat(pa.scalar("queue lifetime exceeded; last reply: "), k), s["text"], ""))
            expired = x.append_column("delay_s", _seconds(s["finish_ts"], s["arrival_ts"]))
    return expired


_I64_MIN = np.iinfo(np.int64).min
_I64_MAX = np.iinfo(np.int64).max
# The dense facts hold a slot per recipient number of each message (up to its largest): at most 8 a row
# plus this many, else the definition runs (a message's numbers run 0..n-1 in every log the daemon writes).
DENSE_SLOTS_SPARE = 1_000_000


def _i64(a: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A column without nulls (timestamp or integer) as int64 numpy values."""
    return np.asarray(a.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)


def _max_by(q: np.ndarray, a: pa.ChunkedArray, n: int, typ: pa.DataType) -> pa.Array:
    """Per key 0..n-1 (``q``, one per row of ``a``) the largest non-null value of ``a``, null where a key has
    none: Acero's ``hash_max`` (nulls skipped, min_count 1)."""
    valid = np.asarray(a.is_valid(), dtype=bool)
    vals = _i64(pc.fill_null(a.cast(pa.int64()), 0))
    out = np.full(n, _I64_MIN, dtype=np.int64)
    np.maximum.at(out, q[valid], vals[valid])
    seen = np.bincount(q[valid], minlength=n) > 0
    return pa.array(out, mask=~seen).cast(typ)


def _agree(a: pa.ChunkedArray, first: np.ndarray) -> bool:
    """Every row of ``a`` equal (null equal to null) to the row ``first`` names for it."""
    return bool(pc.all(_same(a, a.take(pa.array(first)))).as_py() is not False)


def _whole_dense(c: pa.Table, spans: Mapping[str, tuple[int, int]], numbers: np.ndarray, n: int,
                 keep: np.ndarray | None = None) -> tuple[pa.Table, pa.Table, pa.Table, pa.Table, pa.Table | None] | None:
    """:func:`_whole_keyed`'s facts (the definition) computed with numpy over the dense queue ID numbers
    ``numbers`` (0..n-1, one per row of ``c``): the same rows (in another order) and the same columns,
    without Acero's hash group-bys and joins. Only for the common case, else None (then the definition
    runs): no null queue ID, recipient number, generation, arrival or size; every envelope row of a message
    names the same sender, sender domain and bounce_of, and of a recipient the same address and domain (so
    that each message has one row of these, and each recipient one, as the definition's joins then give);
    recipient numbers not far above the rows (DENSE_SLOTS_SPARE).
    ``keep`` (a boolean per number, :meth:`_Whole.closed`'s): the messages, outcomes and ``expired``
    outcomes of those messages only (``e`` and ``rc`` stay whole)."""
    if not len(numbers) or numbers.min() < 0:
        return None

    def kind(k: str) -> tuple[pa.Table, np.ndarray]:
        at, m = spans.get(k, (0, 0))
        return c.slice(at, m), numbers[at:at + m]

    e, qe = kind("ENVELOPE")
    d, qd = kind("DELIVERY")
    if any(e[k].null_count for k in ("rcpt_index", "generation", "arrival_ts", "size")) or d["rcpt_index"].null_count:
        return None
    rows = np.arange(len(qe), dtype=np.int64)
    # a message's first envelope row, and that all its rows name the same sender, domain and bounce_of
    first = np.full(n, _I64_MAX, dtype=np.int64)
    np.minimum.at(first, qe, rows)
    has = first < _I64_MAX
    if not all(_agree(e[k], first[qe]) for k in ("sender", "sender_domain", "bounce_of")):
        return None
    # a recipient's slot: its message's base plus its number; its first envelope row, and that all agree
    idx = _i64(e["rcpt_index"])
    if len(idx) and idx.min() < 0:
        return None
    top = np.full(n, -1, dtype=np.int64)
    np.maximum.at(top, qe, idx)
    width = top + 1
    if int(width.sum()) > 8 * len(qe) + DENSE_SLOTS_SPARE:
        return None  # recipient numbers far above the rows (a damaged or crafted log): not worth the memory
    base = np.cumsum(width) - width
    slot = base[qe] + idx
    rfirst = np.full(int(width.sum()), _I64_MAX, dtype=np.int64)
    np.minimum.at(rfirst, slot, rows)
    if not (_agree(e["rcpt_address"], rfirst[slot]) and _agree(e["rcpt_domain"], rfirst[slot])):
        return None
    rc = e.select(["queue_id", "rcpt_index", "rcpt_address", "rcpt_domain"]).take(
        pa.array(rfirst[rfirst < _I64_MAX]))
    qids = np.flatnonzero(has if keep is None else has & keep[:n])
    at = pa.array(first[qids])
    arrival = np.full(n, _I64_MAX, dtype=np.int64)
    np.minimum.at(arrival, qe, _i64(e["arrival_ts"]))
    size = np.full(n, _I64_MIN, dtype=np.int64)
    np.maximum.at(size, qe, _i64(e["size"]))
    seen0 = np.zeros(n, dtype=bool)
    seen0[qe[_i64(e["generation"]) == 0]] = True
    ts_type = c.schema.field("ts").type
    ts = _max_by(numbers, c["ts"], n, ts_type)
    _, qs = kind("START")
    f, qf = kind("FINISH")
    finish = _max_by(qf, f["ts"], n, ts_type)
    recipients = np.bincount(qe[rfirst[rfirst < _I64_MAX]], minlength=n)
    attempts = np.bincount(qs, minlength=n) if len(qs) else np.zeros(n, dtype=np.int64)
    take = pa.array(qids)
    qtype = c.schema.field("queue_id").type
    m = pa.table({
        "queue_id": pa.array(qids.astype(np.int32)).cast(qtype),
        "arrival_ts": pa.array(arrival[qids]).cast(e.schema.field("arrival_ts").type),
        "size": pa.array(size[qids]).cast(e.schema.field("size").type),
        "ts": ts.take(take),
        "first_seen": pa.array(seen0[qids]),
        "sender": e["sender"].take(at),
        "sender_domain": e["sender_domain"].take(at),
        "bounce_of": e["bounce_of"].take(at),
        "recipients": pa.array(recipients[qids].astype(np.int64)),
        "attempts": pa.array(attempts[qids].astype(np.int64)),
        "finish_ts": finish.take(take),
    })
    # each outcome row with its recipient (if its message has that number) and its message (if any)
    if keep is not None:
        mine = keep[qd]
        if not mine.all():
            d, qd = d.filter(pa.array(mine)), qd[mine]
    di = _i64(d["rcpt_index"])
    env = has[qd]
    inside = env & (di >= 0) & (di <= top[qd])
    where = np.where(inside, base[qd] + np.where(inside, di, 0), 0)
    r = rfirst[where] if len(rfirst) else np.full(len(qd), _I64_MAX, dtype=np.int64)
    found = inside & (r < _I64_MAX)
    rrow = pa.array(np.where(found, r, 0), mask=~found)
    mrow = pa.array(np.where(env, first[qd], 0), mask=~env)
    qrow = pa.array(np.where(env, qd, 0), mask=~env)
    o = d.select(["queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset"])
    for k in ("rcpt_address", "rcpt_domain"):
        o = o.append_column(k, e[k].take(rrow))
    o = o.append_column("arrival_ts", pa.array(arrival, mask=~has).cast(m.schema.field("arrival_ts").type).take(qrow))
    o = o.append_column("size", pa.array(size, mask=~has).cast(m.schema.field("size").type).take(qrow))
    o = o.append_column("sender", e["sender"].take(mrow)).append_column("bounce_of", e["bounce_of"].take(mrow))
    o = o.append_column("finish_ts", finish.take(qrow))
    o = o.append_column("delay_s", _seconds(o["ts"], o["arrival_ts"]))
    return e, rc, m, o, _expired(o)


def _same(a: pa.ChunkedArray, b: pa.ChunkedArray) -> pa.ChunkedArray:
    """Element by element: equal, or both null (never null itself)."""
    return pc.fill_null(pc.equal(a, b), pc.and_(pc.is_null(a), pc.is_null(b)))


def _order_nulls_first(t: pa.Table, keys: list[str]) -> pa.Array:
    """The row numbers of ``t`` sorted ascending by ``keys``, nulls first in each (a stable sort; pyarrow 25
    takes the placement per key, older versions only for the whole sort)."""
    try:
        return pc.sort_indices(t, options=pc.SortOptions(sort_keys=[(k, "ascending", "at_start") for k in keys]))
    except (TypeError, ValueError):
        return pc.sort_indices(t, options=pc.SortOptions(sort_keys=[(k, "ascending") for k in keys],
                                                         null_placement="at_start"))


def facts_of(kinds: Mapping[str, pa.Table], until: pa.Scalar | None = None, *, close: bool = True) -> dict[str, pa.Table]:
    """Fact tables (FACT_SCHEMA) by ``record_type`` (see the module docstring) of one partition's record rows
    ``kinds`` (by type, each in log order: :func:`fact_kinds`). ``close=False`` closes no message: every row
    stays a record row (the tests compare both ways). Each record type's rows that stay keep their order."""
    out: dict[str, pa.Table] = {}
    got = _keyed(kinds) if close else None
    w = None if got is None else _Whole(*got, closed_only=True)
    keep = None if w is None else w.keep
    for k, t in kinds.items():
        if w is not None and keep is not None and k in w.spans:
            a, b = w.span(k)
            t = t.filter(pa.array(~keep[w.numbers[a:b]]))  # the rows of messages not closed here
        out[k] = _out(t)
    if w is None or keep is None or not keep.any():
        return out
    kept = None if w.only_kept else keep
    m = w.named(w.m, kept)
    out["MESSAGE"] = _out(m, "MESSAGE")
    outcomes = [_out(w.named(w.o, kept), "OUTCOME")]
    if w.expired is not None:
        outcomes.append(_out(w.named(w.expired, kept), "OUTCOME"))
    out["OUTCOME"] = pa.concat_tables(outcomes)
    flagged = w.named(w.e.filter(pc.fill_null(w.e["rcpt_unknown"], False)), keep)
    if flagged.num_rows:
        out["FLAGGED"] = _out(flagged, "FLAGGED")
    if until is not None:
        queued = m.filter(pc.and_(pc.less_equal(m["arrival_ts"], until), pc.greater(m["finish_ts"], until)))
        if queued.num_rows:
            rc = w.named(w.rc, keep)
            out["RCPT"] = _out(rc.filter(pc.is_in(rc["queue_id"], value_set=queued["queue_id"])), "RCPT")
    return out


def open_facts(t: pa.Table) -> dict[str, pa.Table]:
    """The facts (FACT_SCHEMA tables by ``record_type``: MESSAGE, OUTCOME and RCPT; none when ``t`` holds no
    message) of the messages no task closed, from *all* their record rows ``t`` (ENVELOPE, START, DELIVERY and
    FINISH rows gathered from every partition, or all of a partition of them by queue ID; other rows are
    ignored), by the definition the tasks use for the messages they close (:class:`_Whole`); the job's only
    merge of these messages (:func:`mtaq.analytics.datasource.stage_open`). MESSAGE rows for every message
    with an envelope row (``first_seen`` false when its first envelope is not in the log, ``finish_ts`` null
    while it is queued), OUTCOME rows with the ``expired`` ones, and a RCPT row per recipient. No FLAGGED
    rows: the tasks counted these envelopes' outcome-unknown recipients already."""
    got = _keyed(by_kind(t))
    if got is None:
        return {}
    w = _Whole(*got)
    outcomes = [_out(w.named(w.o), "OUTCOME")]
    if w.expired is not None:
        outcomes.append(_out(w.named(w.expired), "OUTCOME"))
    return {"MESSAGE": _out(w.named(w.m), "MESSAGE"), "OUTCOME": pa.concat_tables(outcomes),
            "RCPT": _out(w.named(w.rc), "RCPT")}


def fact_kinds(files: Iterable[SegmentFile], until_us: int | None = None, *, close: bool = True) -> dict[str, pa.Table]:
    """Read ``files`` (one partition: whole segments in log order): its fact rows (FACT_SCHEMA) by
    ``record_type`` (:func:`facts_of`). ``until_us``: the job's ``--until`` in microseconds since the epoch
    (None: unbounded); ``close``: see :func:`facts_of`. The record rows come by type from the reading
    (:func:`mtaq.analytics.source.typed_batches`): no filtering of one table by type."""
    got: dict[str, list[pa.RecordBatch]] = {}
    for kind, b in typed_batches(files):
        got.setdefault(kind, []).append(b)
    kinds = {k: pa.Table.from_batches(v).select(list(_RECORD_COLUMNS)) for k, v in got.items()}
    del got
    until = None if until_us is None else pa.scalar(until_us, pa.int64()).cast(_TS)
    return facts_of(kinds, until, close=close)


def fact_table(files: Iterable[SegmentFile], until_us: int | None = None, *, close: bool = True) -> pa.Table:
    """:func:`fact_kinds` in one table (FACT_SCHEMA), the types one after another."""
    kinds = fact_kinds(files, until_us, close=close)
    return pa.concat_tables(kinds.values()) if kinds else FACT_SCHEMA.empty_table()


def fact_batches(files: Iterable[SegmentFile], until_us: int | None = None, *,
                 close: bool = True) -> Iterator[pa.RecordBatch]:
    """:func:`fact_table` as record batches of at most 65,536 rows."""
    yield from fact_table(files, until_us, close=close).to_batches(max_chunksize=65536)
