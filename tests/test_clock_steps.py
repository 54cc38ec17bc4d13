"""Steps of the wall clock while the daemon runs (issue 31.8): waits are bounded on the monotonic clock and
message ages need the wall clock and the elapsed monotonic time to agree.

* a backward step of T used to hold every new message behind the one in front of the new-mail runner for T
  (it waited ``not_before_ts - now``); the runner for new mail never waits now, and runner k never waits
  longer than its retry interval after it first saw an envelope;
* a forward step used to expire deferred mail early (4.4.7 bounces for mail that had been queued minutes);
  a forward step now only makes mail due early (a harmless early retry).

The in-process daemon (real spool, real loopback SMTP) with the harness clock of test_runners: ``offset`` is
time passing (both clocks), ``step`` a step of the wall clock alone.
"""

from __future__ import annotations

import asyncio
import re

from test_runners import Harness, Sink, run


class HoldingSink(Sink):
    """Holds the RCPT of ``slow@`` until ``release`` is set, then accepts it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def handle_RCPT(self, server, session, envelope, address, options):
        if address.startswith("slow@"):
            self.rcpt_attempts.append(address)
            await self.release.wait()
            envelope.rcpt_tos.append(address)
            return "250 2.1.5 Ok"
        return await super().handle_RCPT(server, session, envelope, address, options)


def test_a_backward_step_does_not_hold_new_mail(tmp_path):
    """One delivery worker busy with ``slow@``; two messages queued behind it; the wall clock steps back an
    hour; the worker is freed: both are delivered at once (before: the runner for new mail waited an hour
    for the second, written before the step, and every later message with it)."""
    h = Harness(tmp_path, delivery_concurrency=1)
    h.sink = HoldingSink()

    async def main() -> None:
        await h.start_sink()
        await h.start()
        try:
            await h.send("alice@example.org", ["slow@example.net"], "m1")
            await h.until(lambda: "slow@example.net" in h.sink.rcpt_attempts, what="m1 at RCPT")
            await h.send("alice@example.org", ["a@example.net"], "m2")  # offered, no worker free
            await h.send("alice@example.org", ["b@example.net"], "m3")  # behind it, not looked at yet
            h.clock.step -= 3600.0
            h.sink.release.set()
            await h.until(lambda: h.sink.to("b@example.net"), what="m3 delivered after the step")
            assert [1, 1, 1] == [len(h.sink.to(f"{r}@example.net")) for r in ("slow", "a", "b")]
        finally:
            await h.crash()
            h.sink_server.close()

    asyncio.run(main())


def test_a_backward_step_holds_deferred_mail_at_most_its_retry_interval(tmp_path):
    """Mail deferred for a 100 s retry; the wall clock steps back a day; 101 s pass: it is retried (before:
    a day later)."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        h.sink.defer = re.compile("^later@")
        await h.send("alice@example.org", ["later@example.net"], "d1")
        await h.until(lambda: h.daemon.runners[1].waiting_until is not None, what="runner 1 waiting for it")
        h.sink.defer = None
        h.clock.step -= 86400.0
        h.clock.offset += 101.0
        h.poke()
        await h.until(lambda: h.sink.to("later@example.net"), what="retried after its interval")

    run(tmp_path, body, retry_intervals_s=[100.0])


def test_a_forward_step_expires_nothing_and_time_passing_does(tmp_path):
    """Lifetime one hour. The wall clock steps two hours forward: the deferred message is retried early and
    deferred again, not bounced (before: expired, 4.4.7). Then an hour really passes (both clocks): it
    expires, with its DSN."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        q = h.daemon.queue
        h.sink.defer = re.compile("^later@")
        await h.send("alice@example.org", ["later@example.net"], "e1")
        await h.until(lambda: q.counts.by_state["deferred"] == 1 and not len(q.working), what="deferred")
        h.clock.step += 7200.0
        h.poke()
        await h.until(lambda: h.sink.rcpt_attempts.count("later@example.net") == 2, what="the early retry")
        await h.until(lambda: not len(q.working), what="its conclusion")
        assert (1, []) == (q.counts.by_state["deferred"], h.sink.to("alice@example.org"))
        h.clock.offset += 3600.0
        h.poke()
        [dsn] = await h.until(lambda: h.sink.to("alice@example.org"), what="the expiry DSN")
        assert b"4.4.7" in dsn
        assert 3 == h.sink.rcpt_attempts.count("later@example.net")

    run(tmp_path, body, retry_intervals_s=[100.0], maximal_queue_lifetime_s=3600.0)
