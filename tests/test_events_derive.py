"""The events of each record (mtaq.core.events, pure): what a reader that starts mid-attempt reads back from
the log, an administrator's bounce, copies forward and flushes that give no event, and a recipient gone
without a final reply (expired after a deferral, else bounced 5.3.0)."""

from __future__ import annotations

from mtaq.core.events import EventDeriver
from mtaq.core.records import (
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    Record,
    StartRecord,
)

ENV = EnvelopeRecord(queue_id="Q", generation=0, arrival_ts=100.0, not_before_ts=100.0, sender="s@example.org",
                     recipients=(Recipient(0, "a@example.net"), Recipient(1, "b@example.net")), data=Pos(1, 16),
                     size=10)


def deriver(records: dict[Pos, Record]) -> EventDeriver:
    return EventDeriver(records.__getitem__, lambda code, enhanced, text: f"cat-{enhanced}")


def test_a_delivery_whose_start_came_before_the_reader_reads_it_back():
    """A reader restarted after the START: the DELIVERY's recipient, sender and attempt come from the START's
    envelope read from the log."""
    start = StartRecord(queue_id="Q", envelope=Pos(1, 100), ts=101.0)
    d = deriver({Pos(1, 100): ENV, Pos(1, 200): start})
    rec = DeliveryRecord(queue_id="Q", start=Pos(1, 200), ts=102.0, relay="r[1.2.3.4]:25",
                         outcomes=(Outcome(1, "failed", 550, "5.1.1", "no"),), tls="TLSv1.3")
    [ev] = d.feed(Pos(1, 300), rec)
    assert ("bounced", "b@example.net", "s@example.org", 1, "TLSv1.3", "cat-5.1.1", "Q.1.300.0", 2.0) == (
        ev["event"], ev["recipient"], ev["sender"], ev["attempt"], ev["tls"], ev["category"], ev["id"], ev["delay"])


def test_a_recipient_gone_without_a_final_reply_expired_or_bounced():
    """FINISH after a deferral of a and no reply for b: a expired (4.4.7, its last reply), b bounced 5.3.0."""
    d = deriver({Pos(1, 100): ENV})
    d.feed(Pos(1, 200), StartRecord(queue_id="Q", envelope=Pos(1, 100), ts=101.0))
    d.feed(Pos(1, 300), DeliveryRecord(queue_id="Q", start=Pos(1, 200), ts=102.0, relay="r",
                                       outcomes=(Outcome(0, "deferred", 451, "4.3.0", "later"),)))
    evs = d.feed(Pos(1, 400), FinishRecord(queue_id="Q", start=Pos(1, 200), ts=103.0))
    assert [("expired", "a@example.net", "4.4.7", "451 4.3.0 later"), ("bounced", "b@example.net", "5.3.0",
            "554 5.3.0 message data unreadable in queue")] == [
        (e["event"], e["recipient"], e["dsn"], e["reply"]) for e in evs]
    assert {} == d.open


def test_admin_bounce_gives_bounced_and_copy_or_flush_nothing():
    """An administrator's bounce: every recipient bounced 5.4.7; a copy forward and a flush: no event."""
    d = deriver({Pos(1, 100): ENV})
    for i, action in enumerate(("bounce", "copy", "flush")):
        start = Pos(2, 100 * i + 16)
        d.feed(start, StartRecord(queue_id="Q", envelope=Pos(1, 100), ts=101.0, admin=action))
        if action == "bounce":
            evs = d.feed(Pos(3, i), FinishRecord(queue_id="Q", start=start, ts=102.0))
            assert [("bounced", "5.4.7"), ("bounced", "5.4.7")] == [(e["event"], e["dsn"]) for e in evs]
        else:
            repl = EnvelopeRecord(**{**{f: getattr(ENV, f) for f in ENV.__struct_fields__}, "generation": 1,
                                     "replaces": start})
            assert [] == d.feed(Pos(3, i), repl)


def test_an_unreadable_envelope_still_gives_the_event():
    """The envelope cannot be read (reclaimed, damaged): the event names the recipient by index."""
    d = deriver({Pos(1, 200): StartRecord(queue_id="Q", envelope=Pos(1, 100), ts=101.0)})
    [ev] = d.feed(Pos(1, 300), DeliveryRecord(queue_id="Q", start=Pos(1, 200), ts=102.0, relay="r",
                                              outcomes=(Outcome(0, "delivered", 250, "2.0.0", "ok"),)))
    assert ("delivered", "#0", 0) == (ev["event"], ev["recipient"], ev["recipient_index"])
