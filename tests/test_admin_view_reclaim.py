"""The admin view reads the log's segments in a thread; reclamation must not delete segments under it
(issue 31.7). Before, a segment holding a message's START and FINISH could be deleted after the view had
read the segment with its envelope: the delivered message looked live, and ``bounce`` would have sent an
"expired" DSN for it. Now the view holds ``Log.segments_kept`` and reclamation waits for the next checkpoint.

The in-process daemon (real spool, real loopback SMTP, 64 KiB segments) on FaultyFileSystem, whose
``before_read_file`` hook stops the view's thread at the segment of the START until reclamation has run.
"""

from __future__ import annotations

import asyncio
import re
import threading

from test_runners import Harness

from mtaq.core.records import EnvelopeRecord, StartRecord
from mtaq.core.view import Selector
from mtaq.storage.log import segment_path
from mtaq.testing.faults import FaultyFileSystem


def test_a_view_read_while_reclamation_runs_does_not_show_delivered_mail_as_live(tmp_path):
    """M is deferred (its envelope in segment a), delivered later (START in segment b > a), and the log
    moves on. A listing reads segment a, then stops before b; a checkpoint runs meanwhile; the listing
    then goes on: M is not in it (before: listed as deferred), and the next checkpoint reclaims a and b."""
    fs = FaultyFileSystem()
    h = Harness(tmp_path, segment_bytes_max=65536, retry_intervals_s=[100.0])

    async def main() -> None:
        await h.start_sink()
        d = await h.start(fs)
        q = d.queue
        try:
            h.sink.defer = re.compile("^m@")
            mid = await h.send("alice@example.org", ["m@example.net"], "M")
            await h.until(lambda: q.counts.by_state["deferred"] == 1 and not len(q.working), what="M deferred")
            for i in range(4):  # the log moves on by a few segments
                await h.send("alice@example.org", ["pad@example.net"], f"p{i}", size=40_000)
            h.sink.defer = None
            h.clock.offset += 101.0
            h.poke()
            await h.until(lambda: h.sink.to("m@example.net"), what="M delivered")
            await h.until(lambda: q.counts.total() == 0, what="the queue empty")
            for i in range(4, 8):
                await h.send("alice@example.org", ["pad@example.net"], f"p{i}", size=40_000)
            await h.until(lambda: len(h.sink.to("pad@example.net")) == 8, what="padding delivered")
            await h.until(d.runners_settled, what="every runner at the end")
            starts = [(p, r) for p, r in _records(q.log) if isinstance(r, StartRecord) and r.queue_id == mid]
            envs = [(p, r) for p, r in _records(q.log) if isinstance(r, EnvelopeRecord) and r.queue_id == mid]
            b = starts[-1][0].segment
            assert envs[-1][0].segment < b < q.log.current_segment - 1

            at_b, go_on = threading.Event(), threading.Event()

            def stop_at_b(path: str) -> None:
                if path == segment_path(q.log.directory, b):
                    at_b.set()
                    go_on.wait(30)

            fs.before_read_file = stop_at_b
            listing = asyncio.create_task(d.admin.list(Selector()))
            await h.until(at_b.is_set, what="the view's thread at segment b")
            await d.checkpoint()
            go_on.set()
            fs.before_read_file = None
            _pos, entries = await listing
            assert [] == [e["queue_id"] for e in entries]
            await d.checkpoint()
            assert b < q.log.segments()[0]
        finally:
            await h.crash()
            h.sink_server.close()

    asyncio.run(main())


def _records(log):
    from mtaq.core.frame import scan_segment

    for n in log.segments():
        yield from scan_segment(n, log.read_segment(n), skip_data=True).records
