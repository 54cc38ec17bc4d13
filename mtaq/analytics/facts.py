"""Per-message and per-recipient facts of one queue-ID partition, in Arrow (run by Spark's Python workers).

:func:`facts` is handed to ``DataFrame.mapInArrow`` over the job's cached rows, which are hash-partitioned
by queue ID, so every record of a message is in the same partition. It replaces the Spark SQL of the
previous version (a group-by, four shuffle-hash joins and a window per partition, about 12 s of executor
CPU at 1,000,000 records) by pyarrow's C++ group-bys and joins. Definitions: :mod:`mtaq.analytics.job`.

Output (:data:`FACTS_DDL`): one row per message (``kind`` = ``m``: arrival, size, sender, bounce_of,
first_seen, recipients, attempts, finish_ts) and one per recipient outcome (``kind`` = ``o``: the
DELIVERY outcome with its recipient's address and domain, the message's arrival, size, sender,
bounce_of and FINISH time, and ``delay_s`` = outcome time - arrival in seconds), plus an ``expired``
outcome at the FINISH for each recipient whose last outcome (by time, then segment, then offset) was a
deferral and whose message then FINISHed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["EVERY_COLUMNS", "FACTS_DDL", "MESSAGE_COLUMNS", "facts", "partition_facts"]

_TS = pa.timestamp("us", tz="UTC")
_FIELDS: list[tuple[str, pa.DataType, str]] = [
    ("kind", pa.string(), "string"),
    ("queue_id", pa.string(), "string"),
    ("rcpt_index", pa.int32(), "int"),
    ("ts", _TS, "timestamp"),
    ("status", pa.string(), "string"),
    ("code", pa.int32(), "int"),
    ("enhanced", pa.string(), "string"),
    ("text", pa.string(), "string"),
    ("relay", pa.string(), "string"),
    ("segment", pa.int64(), "bigint"),
    ("offset", pa.int64(), "bigint"),
    ("rcpt_address", pa.string(), "string"),
    ("rcpt_domain", pa.string(), "string"),
    ("arrival_ts", _TS, "timestamp"),
    ("size", pa.int64(), "bigint"),
    ("sender", pa.string(), "string"),
    ("sender_domain", pa.string(), "string"),
    ("bounce_of", pa.string(), "string"),
    ("first_seen", pa.bool_(), "boolean"),
    ("recipients", pa.int64(), "bigint"),
    ("attempts", pa.int64(), "bigint"),
    ("finish_ts", _TS, "timestamp"),
    ("delay_s", pa.float64(), "double"),
]
SCHEMA = pa.schema([(n, t) for n, t, _ in _FIELDS])
FACTS_DDL = ", ".join(f"`{n}` {s}" for n, _, s in _FIELDS)
MESSAGE_COLUMNS = ("queue_id", "arrival_ts", "size", "sender", "sender_domain", "bounce_of", "first_seen",
                   "recipients", "attempts", "finish_ts")
EVERY_COLUMNS = ("queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset",
                 "rcpt_address", "rcpt_domain", "arrival_ts", "size", "sender", "bounce_of", "finish_ts", "delay_s")


def _seconds(later: pa.ChunkedArray, earlier: pa.ChunkedArray) -> pa.ChunkedArray:
    """(later - earlier) in seconds as float64, exactly as Spark's (unix_micros(a) - unix_micros(b)) / 1e6."""
    diff = pc.subtract(later.cast(pa.int64()), earlier.cast(pa.int64()))
    return pc.divide(diff.cast(pa.float64()), 1e6)


def _out(t: pa.Table, kind: str) -> pa.Table:
    n = t.num_rows
    cols = []
    for name, typ, _ in _FIELDS:
        if name == "kind":
            cols.append(pa.repeat(pa.scalar(kind), n))
        elif name in t.column_names:
            c = t[name]
            cols.append(c.cast(typ) if c.type != typ else c)
        else:
            cols.append(pa.nulls(n, typ))
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def partition_facts(t: pa.Table) -> pa.Table:
    """The facts (see the module docstring) of the rows ``t`` of whole messages (the job's cached columns)."""
    rt = t["record_type"]
    env = t.filter(pc.equal(rt, "ENVELOPE"))
    env = env.append_column("g0", pc.equal(env["generation"], 0))
    per_env = env.group_by("queue_id").aggregate([
        ("arrival_ts", "min"), ("size", "max"), ("g0", "any")])
    per_env = per_env.rename_columns({"arrival_ts_min": "arrival_ts", "size_max": "size", "g0_any": "first_seen"})
    starts = t.filter(pc.equal(rt, "START")).group_by("queue_id").aggregate([([], "count_all")])
    starts = starts.rename_columns({"count_all": "attempts"})
    fins = t.filter(pc.equal(rt, "FINISH")).group_by("queue_id").aggregate([("ts", "max")])
    fins = fins.rename_columns({"ts_max": "finish_ts"})
    who = env.group_by(["queue_id", "sender", "sender_domain", "bounce_of"]).aggregate([])
    rcpts = env.group_by(["queue_id", "rcpt_index", "rcpt_address", "rcpt_domain"]).aggregate([])
    nrcpt = rcpts.group_by("queue_id").aggregate([([], "count_all")]).rename_columns({"count_all": "recipients"})
    msgs = (per_env.join(who, "queue_id", join_type="left outer", use_threads=False)
            .join(nrcpt, "queue_id", join_type="left outer", use_threads=False)
            .join(starts, "queue_id", join_type="left outer", use_threads=False)
            .join(fins, "queue_id", join_type="left outer", use_threads=False))
    msgs = msgs.set_column(msgs.column_names.index("attempts"), "attempts", pc.coalesce(msgs["attempts"], 0))
    dlv = t.filter(pc.equal(rt, "DELIVERY")).select(
        ["queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset"])
    outcomes = (dlv.join(rcpts, ["queue_id", "rcpt_index"], join_type="left outer", use_threads=False)
                .join(msgs.select(["queue_id", "arrival_ts", "size", "sender", "bounce_of", "finish_ts"]), "queue_id",
                      join_type="left outer", use_threads=False))
    outcomes = outcomes.append_column("delay_s", _seconds(outcomes["ts"], outcomes["arrival_ts"]))
    # The last outcome of each recipient: sorted by recipient, then latest first; the first row of each run.
    last = outcomes.sort_by([("queue_id", "ascending"), ("rcpt_index", "ascending"), ("ts", "descending"),
                             ("segment", "descending"), ("offset", "descending")])
    n = last.num_rows
    if n:
        q, i = last["queue_id"].combine_chunks(), last["rcpt_index"].combine_chunks()
        head = pc.or_(pc.not_equal(q.slice(1), q.slice(0, n - 1)), pc.not_equal(i.slice(1), i.slice(0, n - 1)))
        first = pa.concat_arrays([pa.array([True]), pc.fill_null(head, True)])
        fin = last["finish_ts"]
        keep = pc.and_(pc.and_(first, pc.equal(last["status"], "deferred")),
                       pc.and_(pc.is_valid(fin), pc.fill_null(pc.greater_equal(fin, last["ts"]), False)))
        exp = last.filter(keep)
    else:
        exp = last
    m = exp.num_rows
    exp = exp.set_column(exp.column_names.index("ts"), "ts", exp["finish_ts"])
    exp = exp.set_column(exp.column_names.index("status"), "status", pa.repeat(pa.scalar("expired"), m))
    exp = exp.set_column(exp.column_names.index("code"), "code", pa.nulls(m, pa.int32()))
    exp = exp.set_column(exp.column_names.index("enhanced"), "enhanced", pa.repeat(pa.scalar("4.4.7"), m))
    exp = exp.set_column(exp.column_names.index("text"), "text",
                         pc.binary_join_element_wise("queue lifetime exceeded; last reply: ", exp["text"], ""))
    exp = exp.set_column(exp.column_names.index("delay_s"), "delay_s", _seconds(exp["finish_ts"], exp["arrival_ts"]))
    return pa.concat_tables([_out(msgs, "m"), _out(outcomes, "o"), _out(exp, "o")])


def facts(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` function: the whole partition's batches in, its facts out (:data:`FACTS_DDL`)."""
    got = list(batches)
    if not got:
        return
    yield from partition_facts(pa.Table.from_batches(got)).to_batches(max_chunksize=65536)
