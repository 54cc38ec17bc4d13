"""The tasks' facts (mtaq/analytics/facts.py) on logs written with the daemon's own Log: the facts a task
computes over all its rows and keeps for the messages it closes equal the facts of those messages' rows
alone (:func:`open_facts`, the same definition); the ``expired`` outcome picked among a message's
disagreeing envelopes does not depend on the order rows come in; a null recipient number (no log has one)
does not take another message's ``expired`` outcome with it. Written after a review of stop 52's change
(facts by record type, over all rows)."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa
import pyarrow.compute as pc

from mtaq.analytics.facts import fact_kinds, facts_of, open_facts
from mtaq.analytics.source import discover, typed_batches
from mtaq.core.records import DataRecord, DeliveryRecord, EnvelopeRecord, FinishRecord, Outcome, Recipient, StartRecord
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log

T0 = 1_740_870_000.0  # 2025-03-01T23:00:00Z
BODY = b"Subject: t\r\n\r\n" + b"x" * 100 + b"\r\n"


class _Writer:
    def __init__(self, spool: str, segment_bytes_max: int = 1 << 20) -> None:
        self.log, _ = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=segment_bytes_max)

    def envelope(self, qid: str, gen: int, arrival: float, rcpts: list[str], sender: str = "s@a.example",
                 bounce_of: str = ""):
        data, _ = self.log.append(DataRecord(qid, BODY))
        pos, _ = self.log.append(EnvelopeRecord(qid, gen, arrival, arrival, sender,
                                                tuple(Recipient(i, a) for i, a in enumerate(rcpts)), data, len(BODY),
                                                bounce_of=bounce_of))
        return pos

    def attempt(self, qid: str, env, ts: float, outs: list[tuple[int, str, int, str]]):
        sp, _ = self.log.append(StartRecord(qid, env, ts, 0))
        self.log.append(DeliveryRecord(qid, sp, ts + 1, "mx[192.0.2.1]:25",
                                       tuple(Outcome(i, st, code, enh, "reply") for i, st, code, enh in outs)))
        return sp

    def finish(self, qid: str, sp, ts: float) -> None:
        self.log.append(FinishRecord(qid, sp, ts))


def _rows(t: pa.Table, columns: list[str]) -> list[tuple]:
    return sorted((tuple(r[c] for c in columns) for r in t.select(columns).to_pylist()), key=repr)


def _kinds_read(spool: str, i: int) -> dict[str, pa.Table]:
    """The record rows of segment file ``i`` of ``spool`` by type, as fact_kinds reads them."""
    got: dict[str, list[pa.RecordBatch]] = {}
    for kind, b in typed_batches([discover([spool])[i]]):
        got.setdefault(kind, []).append(b)
    return {k: pa.Table.from_batches(v) for k, v in got.items()}


MESSAGE = ["queue_id", "arrival_ts", "size", "sender", "sender_domain", "bounce_of", "first_seen", "recipients",
           "attempts", "finish_ts", "ts"]
OUTCOME = ["queue_id", "rcpt_index", "ts", "status", "code", "enhanced", "text", "relay", "segment", "offset",
           "rcpt_address", "rcpt_domain", "arrival_ts", "size", "sender", "bounce_of", "finish_ts", "delay_s"]


def test_a_tasks_facts_equal_the_facts_of_its_closed_messages_rows_alone(tmp_path):
    """Messages spread over small segments (some closed in one, some not), deferred, bounced and expired
    recipients, several generations: for each segment, the MESSAGE and OUTCOME rows facts_of keeps equal
    open_facts over the rows of exactly those messages, and the rows it leaves as record rows are exactly the
    other messages' keyed rows."""
    rng = random.Random(52)
    spool = str(tmp_path / "spool")
    w = _Writer(spool, segment_bytes_max=12000)
    live: list[tuple[str, object, int]] = []
    for n in range(160):
        qid = f"Q{n:014d}"
        rcpts = [f"r{j}@{rng.choice('xyz')}.example" for j in range(rng.randint(1, 3))]
        env = w.envelope(qid, 0, T0 + n, rcpts)
        live.append((qid, env, len(rcpts)))
        if rng.random() < 0.8 and live:  # progress on a recent message (now and then an older one)
            q, e, k = live.pop(len(live) - 1 - min(len(live) - 1, int(rng.expovariate(0.7))))
            fate = rng.choice(["delivered", "deferred-expired", "bounced", "retry"])
            if fate == "delivered":
                w.finish(q, w.attempt(q, e, T0 + n + 0.5, [(i, "delivered", 250, "2.0.0") for i in range(k)]), T0 + n + 0.6)
            elif fate == "deferred-expired":
                w.finish(q, w.attempt(q, e, T0 + n + 0.5, [(i, "deferred", 451, "4.3.0") for i in range(k)]), T0 + n + 0.7)
            elif fate == "bounced":
                w.finish(q, w.attempt(q, e, T0 + n + 0.5, [(i, "failed", 550, "5.1.1") for i in range(k)]), T0 + n + 0.6)
            else:  # deferred, then a replacement envelope of the next generation, still queued
                w.attempt(q, e, T0 + n + 0.5, [(i, "deferred", 451, "4.3.0") for i in range(k)])
                live.append((q, w.envelope(q, 1, T0 + n - 30, [f"r{i}@x.example" for i in range(k)]), k))
    files = discover([spool])
    assert len(files) >= 5
    closed_seen = 0
    for i in range(len(files)):
        kinds = _kinds_read(spool, i)
        got = facts_of(kinds)
        msgs = got.get("MESSAGE", pa.table({"queue_id": pa.array([], pa.string())}))
        closed = set(msgs["queue_id"].to_pylist())
        closed_seen += len(closed)
        keyed = pa.concat_tables([kinds[k] for k in ("ENVELOPE", "START", "DELIVERY", "FINISH") if k in kinds])
        mine = keyed.filter(pc.is_in(keyed["queue_id"], value_set=pa.array(sorted(closed), pa.string())))
        want = open_facts(mine) if mine.num_rows else {}
        assert _rows(msgs, MESSAGE) == _rows(want["MESSAGE"], MESSAGE) if closed else "MESSAGE" not in got
        if closed:
            assert _rows(got["OUTCOME"], OUTCOME) == _rows(want["OUTCOME"], OUTCOME)
        left = pa.concat_tables([got[k] for k in ("ENVELOPE", "START", "DELIVERY", "FINISH") if k in got])
        assert not closed & set(left["queue_id"].to_pylist())
        assert left.num_rows + mine.num_rows == keyed.num_rows
    assert closed_seen > 60  # most messages are closed in one segment


def test_the_expired_outcome_among_disagreeing_envelopes_does_not_depend_on_row_order(tmp_path):
    """A message whose replacement envelope names another address (and bounce_of) for the same recipient: the
    joins give its last deferral twice, and the expired outcome picked is the same whatever order each
    type's rows come in (the one with the greatest address, the sort's last keys)."""
    spool = str(tmp_path / "spool")
    w = _Writer(spool)
    for n in range(12):  # other messages around it, closed and not
        q = f"P{n:014d}"
        e = w.envelope(q, 0, T0 + n, ["a@x.example"])
        if n % 3:
            w.finish(q, w.attempt(q, e, T0 + n + 1, [(0, "delivered", 250, "2.0.0")]), T0 + n + 2)
    e0 = w.envelope("QD", 0, T0 + 100, ["r0@x.example", "r1@x.example"])
    sp = w.attempt("QD", e0, T0 + 110, [(0, "deferred", 451, "4.3.0"), (1, "delivered", 250, "2.0.0")])
    w.envelope("QD", 1, T0 + 100, ["z0@y.example"], bounce_of="QX")
    w.finish("QD", sp, T0 + 120)
    kinds = _kinds_read(spool, 0)
    picks = set()
    rng = random.Random(7)
    for attempt in range(8):
        shuffled = {}
        for k, t in kinds.items():
            order = list(range(t.num_rows))
            if attempt:
                rng.shuffle(order)
            shuffled[k] = t.take(pa.array(order, pa.int64()))
        o = facts_of(shuffled)["OUTCOME"]
        exp = o.filter(pc.equal(o["status"], "expired"))
        assert exp.num_rows == 1
        picks.add(tuple(exp.select(["queue_id", "rcpt_index", "rcpt_address", "bounce_of"]).to_pylist()[0].values()))
    assert picks == {("QD", 0, "z0@y.example", "QX")}


def test_a_null_recipient_number_elsewhere_keeps_an_expired_outcome(tmp_path):
    """No log has a null recipient number; a table may (a crafted one). A DELIVERY row with one, of a message
    not closed here, sorts next to a closed message's last deferral: that deferral still expires, and the
    null one is a run of its own."""
    spool = str(tmp_path / "spool")
    w = _Writer(spool)
    e7 = w.envelope("Q7", 0, T0, ["r@x.example"])
    w.finish("Q7", w.attempt("Q7", e7, T0 + 10, [(0, "deferred", 451, "4.3.0")]), T0 + 20)
    e2 = w.envelope("Q2", 1, T0 + 30, ["r@x.example"])  # generation 1 only: not closed here
    w.attempt("Q2", e2, T0 + 40, [(0, "deferred", 451, "4.3.0")])
    kinds = _kinds_read(spool, 0)
    d = kinds["DELIVERY"]
    at = d.schema.get_field_index("rcpt_index")
    nulled = pc.if_else(pc.equal(d["queue_id"], "Q2"), pa.scalar(None, d["rcpt_index"].type), d["rcpt_index"])
    kinds["DELIVERY"] = d.set_column(at, "rcpt_index", nulled)
    got = facts_of(kinds)
    o = got["OUTCOME"]
    assert _rows(o.filter(pc.equal(o["status"], "expired")), ["queue_id", "rcpt_index"]) == [("Q7", 0)]
    assert {r["queue_id"] for r in got["DELIVERY"].to_pylist()} == {"Q2"}  # left as a record row
    of = open_facts(pa.concat_tables([kinds[k] for k in ("ENVELOPE", "START", "DELIVERY", "FINISH")]))["OUTCOME"]
    assert _rows(of.filter(pc.equal(of["status"], "expired")), ["queue_id", "rcpt_index"]) == [("Q7", 0)]


def test_fact_kinds_reads_every_record_once(tmp_path):
    """fact_kinds over a segment: every keyed row is either a record row left or part of a closed message."""
    spool = str(tmp_path / "spool")
    w = _Writer(spool)
    for n in range(30):
        q = f"Q{n:014d}"
        e = w.envelope(q, 0, T0 + n, ["a@x.example", "b@y.example"])
        if n % 2:
            w.finish(q, w.attempt(q, e, T0 + n + 1, [(0, "delivered", 250, "2.0.0"), (1, "failed", 550, "5.1.1")]),
                     T0 + n + 2)
    kinds = fact_kinds(discover([spool]))
    assert kinds["MESSAGE"].num_rows == 15 and kinds["OUTCOME"].num_rows == 30
    assert kinds["ENVELOPE"].num_rows == 30  # the 15 messages never attempted, a row per recipient
    assert kinds["START"].num_rows == 0 and kinds["DELIVERY"].num_rows == 0 and kinds["FINISH"].num_rows == 0
    assert kinds["SEGMENT"].num_rows == 1


def _random_log(spool: str, seed: int) -> None:
    """Messages over small segments with what the dense facts must decline or get right: replacement
    envelopes (now and then one naming another sender, bounce_of or address), outcomes for recipient numbers
    no envelope has, outcomes and FINISHes of messages whose envelope is in another segment, repeated
    attempts."""
    rng = random.Random(seed)
    w = _Writer(spool, segment_bytes_max=9000)
    live: list[tuple[str, object, list[str], str]] = []
    for n in range(140):
        qid = f"Q{seed}-{n:05d}"
        rcpts = [f"r{j}@{rng.choice('xyz')}.Example" for j in range(rng.randint(1, 4))]
        sender = rng.choice(["s@a.example", "", "S@B.example"])
        live.append((qid, w.envelope(qid, 0, T0 + n, rcpts, sender=sender), rcpts, sender))
        for _ in range(2):
            if not live or rng.random() < 0.3:
                continue
            q, e, rc, snd = live.pop(rng.randrange(len(live)))
            k = len(rc)
            outs = [(i, rng.choice(["delivered", "deferred", "failed"]), 250, "2.0.0") for i in range(k + rng.choice([0, 0, 1]))]
            sp = w.attempt(q, e, T0 + n + 0.5, outs)
            r = rng.random()
            if r < 0.5:
                w.finish(q, sp, T0 + n + 0.7)
            elif r < 0.8:  # a replacement envelope: now and then one that disagrees
                odd, other = rng.random() < 0.08, rng.random() < 0.08
                again = [a.replace("@", "@w") if odd and i == 0 else a for i, a in enumerate(rc)]
                bounce = "QB" if other else ""
                live.append((q, w.envelope(q, 1, T0 + n - 5, again, sender=snd, bounce_of=bounce), rc, snd))
            else:
                live.append((q, e, rc, snd))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_dense_facts_equal_the_definition(tmp_path, seed):
    """facts._whole_dense (numpy over the queue IDs' numbers) against facts._whole_keyed (Acero's group-bys
    and joins, the definition): for every segment of random logs, whole and with the closed messages only,
    the same recipients, messages, outcomes and expired outcomes (rows and columns), or None (the definition
    then runs) only where a message's envelopes disagree."""
    from mtaq.analytics import facts as F

    spool = str(tmp_path / "spool")
    _random_log(spool, seed)
    taken = declined = 0
    for i in range(len(discover([spool]))):
        kinds = {k: t.select(list(F._RECORD_COLUMNS)) for k, t in _kinds_read(spool, i).items()}
        got = F._keyed(kinds)
        if got is None:
            continue
        for closed_only in (False, True):
            a = F._Whole(*got, dense=False, closed_only=closed_only)
            b = F._Whole(*got, closed_only=closed_only)
            if F._whole_dense(b.c, b.spans, b.numbers, len(b.dictionary)) is None:
                declined += 1
                continue
            taken += 1
            keep = a.keep if closed_only else None
            for name in ("rc", "m", "o", "expired"):
                x, y = getattr(a, name), getattr(b, name)
                if keep is not None and name in ("m", "o", "expired") and x is not None:
                    x = x.filter(pa.array(keep[F._numbers(x["queue_id"])]))
                    x = x if x.num_rows else None
                if x is None or y is None:
                    assert x is None and (y is None or y.num_rows == 0), (i, name)
                    continue
                assert x.schema == y.schema, (i, name)
                assert _rows(x, x.column_names) == _rows(y, y.column_names), (i, name)
    assert taken >= 10 and declined >= 2, (taken, declined)  # both ways were tried


def test_the_dense_facts_decline_nulls_and_keep_the_definitions_results():
    """Crafted rows no log has (a null queue ID, recipient number or generation; a recipient number of 2^31-1,
    which would need 2^31 slots, or a negative one): the dense facts decline, and the facts are the
    definition's."""
    from mtaq.analytics import facts as F

    def rows(kind: str, **cols):
        n = len(next(iter(cols.values())))
        t = {c: pa.nulls(n, F.FACT_SCHEMA.field(c).type) for c in F._RECORD_COLUMNS}
        t["record_type"] = pa.array([kind] * n)
        for c, v in cols.items():
            t[c] = pa.array(v, F.FACT_SCHEMA.field(c).type)
        return pa.table(t)

    env = dict(queue_id=["A", "A", "B"], rcpt_index=[0, 1, 0], generation=[0, 0, 0], arrival_ts=[1, 1, 2],
               ts=[1, 1, 2], size=[10, 10, 20], rcpt_address=["a@x", "b@y", "c@z"], rcpt_domain=["x", "y", "z"],
               sender=["s@q", "s@q", "t@q"], sender_domain=["q", "q", "q"])
    dl = dict(queue_id=["A", "A", "B"], rcpt_index=[0, 1, 0], ts=[5, 5, 6], status=["delivered", "deferred", "deferred"])
    fin = dict(queue_id=["A", "B"], ts=[7, 8])
    for k, v in (("queue_id", None), ("rcpt_index", None), ("generation", None), ("rcpt_index", 2**31 - 1),
                 ("rcpt_index", -1)):
        for where in (env, dl):
            if k not in where:
                continue
            bad = dict(where, **{k: [*where[k][:-1], v]})
            kinds = {"ENVELOPE": rows("ENVELOPE", **(bad if where is env else env)),
                     "DELIVERY": rows("DELIVERY", **(bad if where is dl else dl)), "FINISH": rows("FINISH", **fin)}
            got = F._keyed(kinds)
            assert got is not None
            w = F._Whole(*got)
            if where is env or v is None:  # an outcome's number no envelope has is only not found
                assert F._whole_dense(w.c, w.spans, w.numbers, len(w.dictionary)) is None, (k, v, where is env)
            d = F._Whole(*got, dense=False)
            for name in ("rc", "m", "o", "expired"):
                x, y = getattr(w, name), getattr(d, name)
                assert (x is None) == (y is None), name
                assert x is None or _rows(x, x.column_names) == _rows(y, y.column_names), name
