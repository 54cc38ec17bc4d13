"""Queue state and the end of an attempt (pure core, no disk, no clock)."""

from __future__ import annotations

import pytest

from mtaq.core.records import (
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    StartRecord,
)
from mtaq.core.state import UNKNOWN_REPLY, QueueState, RetryPolicy, conclude

POLICY = RetryPolicy(intervals_s=(10.0, 20.0))


def envelope(qid="Q1", n=3, **kw):
    rcpts = tuple(Recipient(i, f"r{i}@example.net") for i in range(n))
    return EnvelopeRecord(qid, 0, 100.0, 100.0, "s@example.org", rcpts, Pos(1, 32), 10, **kw)


def started(n=3):
    st = QueueState()
    st.apply(Pos(1, 100), envelope(n=n))
    st.apply(Pos(1, 200), StartRecord("Q1", Pos(1, 100), 101.0))
    return st, st.messages["Q1"]


def outcome(i, status, code):
    return Outcome(i, status, code, f"{code // 100}.0.0", "text")


def test_all_recipients_delivered_or_failed_concludes_with_finish():
    """No recipient left -> FINISH naming the attempt's START."""
    st, msg = started()
    st.apply(Pos(1, 300), DeliveryRecord("Q1", Pos(1, 200), 102.0, "relay",
                                         (outcome(0, "delivered", 250), outcome(1, "failed", 550), outcome(2, "delivered", 250))))
    rec = conclude(msg, 103.0, POLICY)
    assert FinishRecord("Q1", Pos(1, 200), 103.0) == rec
    st.apply(Pos(1, 400), rec)
    assert {} == st.messages


def test_deferred_recipients_go_to_a_replacement_due_after_the_retry_interval():
    """Deferred recipients are carried over with their last reply; the rest are dropped."""
    st, msg = started()
    st.apply(Pos(1, 300), DeliveryRecord("Q1", Pos(1, 200), 102.0, "relay",
                                         (outcome(0, "delivered", 250), outcome(1, "deferred", 451), outcome(2, "deferred", 421))))
    rec = conclude(msg, 103.0, POLICY)
    assert isinstance(rec, EnvelopeRecord)
    assert [1, 2] == [r.index for r in rec.recipients]
    assert "451 4.0.0 text" == rec.recipients[0].last_reply
    assert (1, 1, Pos(1, 200)) == (rec.generation, rec.attempts, rec.replaces)
    assert 113.0 == rec.not_before_ts
    st.apply(Pos(2, 32), rec)
    m = st.messages["Q1"]
    assert (False, Pos(2, 32)) == (m.active, m.envelope_pos)
    assert {"incoming": 0, "deferred": 1, "active": 0} == st.counts()


def test_recipients_without_outcome_after_a_crash_are_unknown_and_retried_at_once():
    """An interrupted attempt: recipients without a durable DELIVERY are 'unknown' (GUIDE I4), due now."""
    st, msg = started()
    st.apply(Pos(1, 300), DeliveryRecord("Q1", Pos(1, 200), 102.0, "relay", (outcome(0, "delivered", 250),)))
    rec = conclude(msg, 500.0, POLICY)
    assert isinstance(rec, EnvelopeRecord)
    assert [(1, True, UNKNOWN_REPLY), (2, True, UNKNOWN_REPLY)] == [(r.index, r.unknown, r.last_reply) for r in rec.recipients]
    assert 500.0 == rec.not_before_ts


def test_retry_interval_last_value_repeats():
    assert [0.0, 10.0, 20.0, 20.0] == [POLICY.delay_after(n) for n in range(4)]


def test_conclude_without_active_attempt_raises():
    st = QueueState()
    st.apply(Pos(1, 100), envelope())
    with pytest.raises(ValueError):
        conclude(st.messages["Q1"], 1.0, POLICY)


def test_records_for_reclaimed_messages_are_counted_as_orphans_not_errors():
    """A START/FINISH whose envelope lived in a reclaimed segment is ignored (records only point back)."""
    st = QueueState()
    assert st.apply(Pos(5, 32), StartRecord("GONE", Pos(1, 32), 1.0)) is None
    assert st.apply(Pos(5, 90), FinishRecord("GONE", Pos(5, 32), 2.0)) is None
    assert 2 == st.orphans


def test_delivery_for_a_stale_attempt_is_reported():
    st, msg = started()
    note = st.apply(Pos(1, 300), DeliveryRecord("Q1", Pos(9, 9), 1.0, "r", (outcome(0, "delivered", 250),)))
    assert note is not None and "DELIVERY" in note
    assert {} == msg.outcomes
