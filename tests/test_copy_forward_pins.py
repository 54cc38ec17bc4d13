"""A replacement envelope that could not get a fresh copy of its DATA (a read error, a full disk: it names
the old DATA, far behind it in the log) must keep that DATA's segment from being reclaimed until the
message is concluded again: otherwise the retry finds the segment gone and bounces acknowledged mail
(554 5.3.0). Real daemon, real sockets, real disk (reads made to fail with FaultyFileSystem)."""

from __future__ import annotations

import asyncio
import errno
import re

import pytest
from test_runners import Harness, Sink

from mtaq.daemon.process import Daemon
from mtaq.testing.faults import FaultyFileSystem


class HeldSink(Sink):
    """Holds the RCPT of ``later@`` until ``release`` is set, then defers it (451)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.on_release = lambda: None

    async def handle_RCPT(self, server, session, envelope, address, options):
        if address.startswith("later@") and not self.release.is_set():
            self.rcpt_attempts.append(address)
            await self.release.wait()
            self.on_release()
            return f"451 4.2.0 <{address}>: try later"
        return await super().handle_RCPT(server, session, envelope, address, options)


@pytest.mark.parametrize("restart", [False, True])
def test_a_replacement_naming_old_data_keeps_that_segment_until_the_retry(tmp_path, restart):
    fs = FaultyFileSystem()
    h = Harness(tmp_path, segment_bytes_max=1 << 17, retry_intervals_s=[1000.0])
    h.sink = HeldSink()

    async def start() -> Daemon:
        return await h.start(fs)

    async def main() -> None:
        await h.start_sink()
        d = await start()
        try:
            await h.send("a@x.test", ["later@y.test"], "big", size=400_000)
            await h.until(lambda: "later@y.test" in h.sink.rcpt_attempts, what="the big one at RCPT")
            data_seg = min(a.envelope.data.segment for a in d.queue.working.attempts.values())
            for i in range(12):  # other mail meanwhile: the log moves on by several segments
                await h.send("a@x.test", ["ok@y.test"], f"m{i}", size=40_000)
            await h.until(lambda: len(h.sink.to("ok@y.test")) == 12, what="12 delivered")
            assert d.queue.log.current_segment > data_seg + 3

            def fail_reads() -> None:
                fs.fail_pread = errno.EIO  # the copy forward cannot read the old DATA

            h.sink.on_release = fail_reads
            h.sink.release.set()
            await h.until(lambda: d.admin.size()["deferred"] == 1 and not len(d.queue.working), what="deferred")
            fs.fail_pread = None
            await h.until(d.runners_settled, what="every runner at the end")
            await d.checkpoint()
            await d.checkpoint()
            if restart:  # the pin is in the checkpoint: a restart keeps the old DATA too
                await h.crash()
                d = await start()
                await h.until(d.runners_settled, what="every runner at the end after the restart")
                await d.checkpoint()
            h.clock.offset += 1100
            h.poke()
            await h.until(lambda: h.sink.to("later@y.test") or h.sink.to("a@x.test"), what="the retry's end")
            assert not h.sink.to("a@x.test")  # no bounce (554 5.3.0 "segment ... is missing")
            [raw] = h.sink.to("later@y.test")
            assert raw.endswith(b"Subject: big\r\nMessage-ID: <big@t>\r\n\r\nbody\r\n" + b"x" * 76 + b"\r\n" * 1
                                + (b"x" * 76 + b"\r\n") * (400_000 // 78 - 1))
            await h.until(lambda: not d.queue.data_pins and not len(d.queue.working), what="the pin released")
        finally:
            if h.task and not h.task.done():
                await h.crash()
            h.sink_server.close()

    h.sink.defer = re.compile("^never@")
    asyncio.run(main())
