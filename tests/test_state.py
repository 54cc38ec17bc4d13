"""The working set, the retry schedule and the end of an attempt (pure core: no disk, no clock)."""

from __future__ import annotations

import pytest

from mtaq.core.records import DeliveryRecord, EnvelopeRecord, FinishRecord, Outcome, Pos, Recipient
from mtaq.core.state import UNKNOWN_REPLY, Attempt, RetryPolicy, WorkingSet, conclude

POLICY = RetryPolicy(intervals_s=(10.0, 20.0), maximal_queue_lifetime_s=1000.0, bounce_queue_lifetime_s=500.0)
START = Pos(1, 200)


def envelope(n=3, sender="s@example.org", params=(), **kw):
    rcpts = tuple(Recipient(i, f"r{i}@example.net", params) for i in range(n))
    return EnvelopeRecord("Q1", 0, 100.0, 100.0, sender, rcpts, Pos(1, 32), 10, **kw)


def attempt(env=None, outcomes=(), remote_dsn=False):
    a = Attempt(env or envelope(), Pos(1, 100), START, remote_dsn=remote_dsn)
    for o in outcomes:
        a.outcomes[o.index] = o
    return a


def out(i, status, code, enhanced=None):
    return Outcome(i, status, code, enhanced or f"{code // 100}.0.0", "text")


def test_all_recipients_done_concludes_with_finish_and_a_failure_dsn_for_the_5xx():
    """No recipient left -> FINISH naming the START; the 5xx recipient gets a 'failed' DSN line."""
    c = conclude(attempt(outcomes=[out(0, "delivered", 250), out(1, "failed", 550, "5.1.1"), out(2, "delivered", 250)]), 103.0, POLICY)
    assert FinishRecord("Q1", START, 103.0) == c.record
    assert [("r1@example.net", "failed", "5.1.1")] == [(i.recipient.address, i.action, i.status) for i in c.failed]
    assert () == c.delayed == c.succeeded


def test_deferred_recipients_go_to_the_next_runner_with_its_interval():
    """First deferral -> runner 1 (10 s); a replacement of runner 1's mail -> runner 2 (20 s); then runner 2 again."""
    c = conclude(attempt(outcomes=[out(0, "delivered", 250), out(1, "deferred", 451), out(2, "deferred", 421)]), 103.0, POLICY)
    rec = c.record
    assert isinstance(rec, EnvelopeRecord)
    assert ([1, 2], 1, 1, 113.0, START) == ([r.index for r in rec.recipients], rec.runner, rec.attempts, rec.not_before_ts, rec.replaces)
    assert "451 4.0.0 text" == rec.recipients[0].last_reply
    second = conclude(attempt(rec, [out(1, "deferred", 451), out(2, "deferred", 451)]), 120.0, POLICY).record
    third = conclude(attempt(second, [out(1, "deferred", 451), out(2, "deferred", 451)]), 150.0, POLICY).record
    assert [(2, 140.0), (2, 170.0)] == [(second.runner, second.not_before_ts), (third.runner, third.not_before_ts)]


def test_recipients_without_outcome_are_unknown_and_retried_at_once_by_the_new_mail_runner():
    """Crash-interrupted recipients are 'unknown' (GUIDE I4), runner 0, due now."""
    c = conclude(attempt(outcomes=[out(0, "delivered", 250)]), 500.0, POLICY)
    rec = c.record
    assert isinstance(rec, EnvelopeRecord)
    assert [(1, True, UNKNOWN_REPLY), (2, True, UNKNOWN_REPLY)] == [(r.index, r.unknown, r.last_reply) for r in rec.recipients]
    assert (0, 500.0) == (rec.runner, rec.not_before_ts)


def test_queue_lifetime_expiry_fails_deferred_recipients_with_4_4_7():
    """After maximal_queue_lifetime_s a deferral is final: DSN Action failed, Status 4.4.7, FINISH."""
    c = conclude(attempt(outcomes=[out(0, "deferred", 451), out(1, "delivered", 250), out(2, "deferred", 421)]), 1100.0, POLICY)
    assert isinstance(c.record, FinishRecord)
    assert [("r0@example.net", "4.4.7"), ("r2@example.net", "4.4.7")] == [(i.recipient.address, i.status) for i in c.failed]
    assert 2 == len(c.expired)


def test_bounces_use_the_bounce_lifetime_and_never_produce_a_dsn():
    """Mail from <> expires after bounce_queue_lifetime_s, and a DSN is never sent to <> (RFC 3464 §2)."""
    c = conclude(attempt(envelope(n=1, sender=""), [out(0, "deferred", 451)]), 650.0, POLICY)
    assert isinstance(c.record, FinishRecord)
    assert ((), 1) == (c.failed, len(c.expired))
    c = conclude(attempt(envelope(n=1, sender=""), [out(0, "failed", 550)]), 101.0, POLICY)
    assert () == c.failed


def test_notify_never_suppresses_and_notify_success_asks_for_a_relayed_dsn():
    """RFC 3461 §4.1: NOTIFY=NEVER -> no DSN; NOTIFY=SUCCESS and a next hop without DSN -> 'relayed'."""
    never = envelope(n=1, params=(("NOTIFY", "NEVER"),))
    assert () == conclude(attempt(never, [out(0, "failed", 550)]), 101.0, POLICY).failed
    success = envelope(n=1, params=(("NOTIFY", "SUCCESS,FAILURE"),))
    c = conclude(attempt(success, [out(0, "delivered", 250)]), 101.0, POLICY)
    assert [("relayed", "2.0.0")] == [(i.action, i.status) for i in c.succeeded]
    assert () == conclude(attempt(success, [out(0, "delivered", 250)], remote_dsn=True), 101.0, POLICY).succeeded


def test_delay_warning_is_sent_once_after_delay_warning_time():
    """delay_warning_time_s: one 'delayed' DSN, then the replacement is marked warned."""
    policy = RetryPolicy(intervals_s=(10.0,), delay_warning_time_s=50.0)
    early = conclude(attempt(envelope(n=1), [out(0, "deferred", 451)]), 120.0, policy)
    assert () == early.delayed
    late = conclude(attempt(early.record, [out(0, "deferred", 451)]), 160.0, policy)
    assert [("delayed", "4.0.0")] == [(i.action, i.status) for i in late.delayed]
    assert late.record.warned
    again = conclude(attempt(late.record, [out(0, "deferred", 451)]), 200.0, policy)
    assert () == again.delayed


def test_working_set_tracks_attempts_and_the_ends_of_the_working_suffix():
    ws = WorkingSet()
    ws.start(Pos(2, 40), Pos(1, 100), envelope())
    ws.start(Pos(2, 80), Pos(1, 60), envelope())
    assert (Pos(2, 40), Pos(1, 60)) == (ws.earliest_start(), ws.earliest_envelope())
    assert ws.delivery(DeliveryRecord("Q1", Pos(2, 40), 1.0, "r", (out(0, "delivered", 250),)))
    assert not ws.delivery(DeliveryRecord("Q1", Pos(9, 9), 1.0, "r", ()))
    assert ws.concluded(Pos(2, 40)) is not None
    assert (1, Pos(2, 80)) == (len(ws), ws.earliest_start())


def test_runner_numbers_and_delays():
    assert 3 == POLICY.runners
    assert [1, 1, 2, 2] == [POLICY.runner_after(n) for n in (0, 1, 2, 5)]
    assert [0.0, 10.0, 20.0] == [POLICY.delay_of(k) for k in range(3)]
    with pytest.raises(IndexError):
        RetryPolicy(intervals_s=()).delay_of(1)
