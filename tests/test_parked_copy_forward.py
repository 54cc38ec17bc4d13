"""Held and delayed mail is copied forward, so that it never pins old segments (issue 12.9).

Reclamation deletes the segments before the earliest position that still matters; a parked envelope
(held, or delayed by FUTURERELEASE / the admin delay action) used to be such a position for as long as it
was parked, so one held message kept every later segment on disk. The in-process daemon (real spool, real
loopback SMTP, small segments) holds one message, delays another, and relays 3,000 more (about 120 segment
roll-overs of 64 KiB), with checkpoints; the log stays within a few segments, the parked messages keep
their state and bytes, and each is delivered once when released or due. A crash between a copy's START
and its replacement loses nothing.
"""

from __future__ import annotations

import asyncio
import os
import re

from test_runners import Harness, run

from mtaq.core.parking import COPY_FORWARD
from mtaq.core.records import EnvelopeRecord, StartRecord
from mtaq.core.view import Selector
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import scan_log

SEGMENT = 65536


def log_bytes(spool: str) -> int:
    d = os.path.join(spool, "log")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".seg"))  # not the reserve


def test_held_and_delayed_mail_is_copied_forward_and_disk_use_stays_bounded(tmp_path):
    """See the module docstring."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        q, adm = h.daemon.queue, h.daemon.admin
        h.sink.defer = re.compile("^(held|later)@")
        held = await h.send("alice@example.org", ["held@example.net"], "held", size=3000)
        later = await h.send("alice@example.org", ["later@example.net"], "later", size=3000)
        await h.until(lambda: q.counts.by_state["deferred"] == 2, what="two deferred")
        assert [held] == (await adm.act("hold", Selector(ids=(held,)))).done
        assert [later] == (await adm.act("delay", Selector(ids=(later,)), delay_s=36000.0)).done
        h.sink.defer = None
        for i in range(0, 3000, 100):
            await asyncio.gather(*(q.receive("bulk@example.org", [f"r{j}@example.net"],
                                             b"Subject: bulk\r\n\r\n" + (b"b" * 76 + b"\r\n") * 24) for j in range(i, i + 100)))
            await h.until(lambda: q.counts.total() <= 2, timeout_s=60, what="bulk delivered")
            await h.daemon.checkpoint()
        await h.until(h.daemon.runners_settled, what="every runner at the end")
        await h.daemon.checkpoint()
        assert log_bytes(h.spool) < 8 * SEGMENT, log_bytes(h.spool)
        assert {"held": 1, "delayed": 1, "total": 2} == {k: v for k, v in adm.size().items() if k in ("held", "delayed", "total")}
        recs = [r for s in scan_log(OsFileSystem(), os.path.join(h.spool, "log")) for _, r in s.records]
        assert any(isinstance(r, StartRecord) and r.admin == COPY_FORWARD for r in recs)
        [m_held] = [m for m in (await adm.list(Selector(ids=(held,))))[1]]
        assert "held" == m_held["queue_name"]
        # A crash, then the release and the due time: each delivered once, byte for byte.
        await h.crash()
        await h.start()
        q, adm = h.daemon.queue, h.daemon.admin
        assert [held] == (await adm.act("release", Selector(ids=(held,)))).done
        await h.until(lambda: h.sink.to("held@example.net"), what="held one delivered after release")
        h.clock.offset += 40000
        h.poke()
        await h.until(lambda: h.sink.to("later@example.net"), what="delayed one delivered when due")
        await h.until(lambda: adm.size()["total"] == 0, what="queue empty")
        for rcpt in ("held@example.net", "later@example.net"):
            [raw] = h.sink.to(rcpt)
            assert raw.endswith(b"x" * 76 + b"\r\n") and b"Subject: " in raw

    run(tmp_path, body, retry_intervals_s=[3600.0], segment_bytes_max=SEGMENT, delay_max_s=86400.0)


def test_a_crash_between_a_copys_start_and_its_replacement_keeps_the_message_held(tmp_path):
    """The copy's START is in the log but not its replacement (the crash came between): recovery completes
    the copy, and the message is still held, once, with its body."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        q, adm = h.daemon.queue, h.daemon.admin
        h.sink.defer = re.compile("^held@")
        held = await h.send("alice@example.org", ["held@example.net"], "held", size=3000)
        await h.until(lambda: q.counts.by_state["deferred"] == 1, what="deferred")
        assert [held] == (await adm.act("hold", Selector(ids=(held,)))).done
        [(pos, _qid_due)] = [(p, v) for p, v in q.parked.entries.items()]
        env = q.log.read(pos)
        assert isinstance(env, EnvelopeRecord)
        q.start(pos, env, admin=COPY_FORWARD)  # ... and the crash, before the replacement
        await q.log.sync()
        await h.crash()
        await h.start()
        q, adm = h.daemon.queue, h.daemon.admin
        assert {"held": 1, "total": 1} == {k: v for k, v in adm.size().items() if k in ("held", "total")}
        [m] = (await adm.list(Selector()))[1]
        assert (held, "held") == (m["queue_id"], m["queue_name"])
        assert [held] == (await adm.act("release", Selector(ids=(held,)))).done
        h.sink.defer = None
        await h.until(lambda: h.sink.to("held@example.net"), what="delivered after release")

    run(tmp_path, body, retry_intervals_s=[3600.0])
