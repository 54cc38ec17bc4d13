"""Admin operations on a running daemon (in process, real sockets, real disk): list, size, show, hold,
release, delete, flush, bounce; each a durable record; a delete racing with delivery."""

from __future__ import annotations

import asyncio
import re

from test_runners import Harness, parse, run

from mtaq.admin.service import offline_size, offline_view
from mtaq.core.records import StartRecord
from mtaq.core.view import Selector
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import scan_log


def admin_starts(spool: str) -> list[tuple[str, str]]:
    return [(r.queue_id, r.admin) for s in scan_log(OsFileSystem(), spool + "/log") for _, r in s.records
            if isinstance(r, StartRecord) and r.admin]


def test_hold_keeps_mail_from_delivery_until_release(tmp_path):
    """A held message is listed as held, is not attempted even when due, and is delivered once released;
    both actions are START records with admin= in the log."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        h.sink.defer = re.compile("^slow@")
        qid = await h.send("alice@example.org", ["slow@example.net"], "h1")
        await h.until(lambda: h.sink.rcpt_attempts.count("slow@example.net") == 1, what="first attempt")
        await h.until(lambda: adm.size()["deferred"] == 1, what="deferred")
        res = await adm.act("hold", Selector(ids=(qid,)))
        assert [qid] == res.done
        _, listed = await adm.list(Selector())
        assert [(qid, "held")] == [(m["queue_id"], m["state"]) for m in listed]
        assert 1 == adm.size()["held"]
        h.sink.defer = None
        h.clock.offset += 7200
        h.poke()
        await asyncio.sleep(0.5)
        assert 1 == h.sink.rcpt_attempts.count("slow@example.net")  # held: not attempted
        res = await adm.act("release", Selector(ids=(qid,)))
        assert [qid] == res.done
        await h.until(lambda: h.sink.to("slow@example.net"), what="delivery after release")
        await h.until(lambda: adm.size()["total"] == 0, what="empty queue")
        assert [(qid, "hold"), (qid, "release")] == admin_starts(h.spool)

    run(tmp_path, body, retry_intervals_s=[3600.0])


def test_delete_by_sender_removes_deferred_mail_and_skips_what_does_not_match(tmp_path):
    """delete --sender: matching deferred messages are gone for good (never delivered, even after their
    retry comes due); the others stay and are delivered; an unknown ID is reported as skipped."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        h.sink.defer = re.compile("^slow")
        spam = [await h.send("spammer@bad.example", [f"slow{i}@example.net"], f"s{i}") for i in range(3)]
        good = await h.send("alice@example.org", ["slow9@example.net"], "g1")
        await h.until(lambda: adm.size()["deferred"] == 4, what="4 deferred")
        res = await adm.act("delete", Selector(ids=(*spam, "NOSUCHID"), sender="spammer@"))
        assert sorted(spam) == sorted(res.done)
        assert {"NOSUCHID": "no such message in the queue"} == res.skipped
        assert {"deferred": 1, "total": 1} == {k: v for k, v in adm.size().items() if k in ("deferred", "total")}
        assert [good] == [m["queue_id"] for m in (await adm.list(Selector()))[1]]
        h.sink.defer = None
        h.clock.offset += 7200
        h.poke()
        await h.until(lambda: h.sink.to("slow9@example.net"), what="the good one delivered")
        await h.until(lambda: adm.size()["total"] == 0, what="the good one concluded")
        assert 1 == len(h.sink.messages)

    run(tmp_path, body, retry_intervals_s=[3600.0])


def test_flush_makes_deferred_mail_due_now_and_bounce_returns_it_with_5_4_7(tmp_path):
    """flush by ID: the deferred message is attempted now, not at its retry time; bounce: the sender gets
    a DSN saying failed, 5.4.7, and the message leaves the queue."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        h.sink.defer = re.compile("^slow")
        a = await h.send("alice@example.org", ["slow1@example.net"], "f1")
        b = await h.send("bob@example.org", ["slow2@example.net"], "f2")
        await h.until(lambda: adm.size()["deferred"] == 2, what="2 deferred")
        h.sink.defer = re.compile("^slow2")
        assert [a] == (await adm.act("flush", Selector(ids=(a,)))).done
        await h.until(lambda: h.sink.to("slow1@example.net"), what="flushed delivery")
        assert [b] == (await adm.act("bounce", Selector(ids=(b,)))).done
        [raw] = await h.until(lambda: h.sink.to("bob@example.org"), what="bounce DSN")
        rcpt = next(p for p in parse(raw).iter_parts() if p.get_content_type() == "message/delivery-status").get_payload()[1]
        assert ("failed", "5.4.7") == (rcpt["Action"], rcpt["Status"])
        await h.until(lambda: adm.size()["total"] == 0, what="empty queue")

    run(tmp_path, body, retry_intervals_s=[3600.0])


def test_delete_racing_with_delivery_never_both_never_lost(tmp_path):
    """delete ALL while 40 messages are being delivered through a slow next hop: each message is either
    delivered or deleted, never both and never neither; active ones are skipped, not half-deleted."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        orig = h.sink.handle_DATA

        async def slow_data(server, session, envelope):
            await asyncio.sleep(0.05)
            return await orig(server, session, envelope)

        h.sink.handle_DATA = slow_data
        ids = await asyncio.gather(*(h.send("alice@example.org", [f"r{i}@example.net"], f"m{i}") for i in range(40)))
        await h.until(lambda: len(h.sink.messages) >= 3, what="some deliveries")
        res = await adm.act("delete", Selector(all=True))
        await h.until(lambda: adm.size()["total"] == 0, what="queue drained")
        delivered = {rs[0].split("@")[0][1:] for _, rs, _ in h.sink.messages}
        delivered_ids = {ids[int(i)] for i in delivered}
        assert len(h.sink.messages) == len(delivered)  # no duplicates
        assert set() == delivered_ids & set(res.done)
        assert set(ids) == delivered_ids | set(res.done)
        assert res.done, "the race should have caught some messages still queued"
        assert all(why.startswith("delivery in progress") for why in res.skipped.values())

    run(tmp_path, body, delivery_concurrency=2)


def test_size_comes_from_counters_and_matches_a_full_listing_after_a_restart(tmp_path):
    """size is kept by the daemon (no scan) and carried by checkpoints; after a crash and restart it still
    equals the counts of a full listing, and the spool can be read with the daemon down."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        h.sink.defer = re.compile("^slow")
        for i in range(5):
            await h.send("alice@example.org", [f"slow{i}@example.net"], f"z{i}")
        await h.until(lambda: h.daemon.admin.size()["deferred"] == 5, what="5 deferred")
        await h.daemon.admin.act("hold", Selector(ids=(), recipient="slow1@"))
        await h.daemon.checkpoint()
        await h.send("alice@example.org", ["slow7@example.net"], "after-checkpoint")
        await h.until(lambda: h.daemon.admin.size()["deferred"] == 5, what="6th deferred")
        await h.crash()
        full = offline_view(h.spool).counts()
        assert {"deferred": 5, "held": 1, "total": 6} == {k: full[k] for k in ("deferred", "held", "total")}
        off = offline_size(h.spool)
        assert {k: full[k] for k in full} == {k: off[k] for k in full}
        await h.start()
        assert {k: full[k] for k in full} == {k: v for k, v in h.daemon.admin.size().items() if k in full}

    run(tmp_path, body, retry_intervals_s=[3600.0])
