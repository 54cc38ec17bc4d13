"""Configuration changed between runs (issue 12.3): no message is stranded and none is offered twice.

Runner k reads the envelopes written for it; after a restart with fewer ``retry_intervals_s``, the last
runner also reads those of the runners that are gone, and with more, new runners read envelopes that the
old last runner read. The in-process daemon (real spool, real loopback SMTP, a clock the test jumps) is
taken through such restarts; :func:`restore_runners` is checked on its own for every old and new count.
"""

from __future__ import annotations

import re

import pytest
from test_runners import Harness, run

from mtaq.core.checkpoint import restore_runners
from mtaq.core.records import Pos


async def defer_into_runner(h: Harness, rcpt: str, subject: str, k: int) -> str:
    """Send a message the sink defers, and jump the clock until its envelope belongs to runner ``k``."""
    assert h.daemon is not None
    qid = await h.send("alice@example.org", [rcpt], subject)
    for attempt in range(1, k + 1):
        await h.until(lambda a=attempt: h.sink.rcpt_attempts.count(rcpt) == a, what=f"attempt {attempt}")
        await h.until(lambda: any(r.waiting_until for r in h.daemon.runners[1:]) and h.daemon.queue.counts.by_state["deferred"] >= 1,
                      what="deferral written")
        await h.until(lambda: not h.daemon.queue.working.attempts, what="attempt concluded")
        if attempt < k:
            h.clock.offset += 4000
            h.poke()
    return qid


def test_fewer_retry_intervals_after_a_restart_strand_nothing(tmp_path):
    """A message deferred twice (runner 2 of [1000, 2000]) while runner 1 stood at the log's end; checkpoint,
    crash, restart with [1000]: runner 1 takes over runner 2 from its position, and the message is
    delivered exactly once when due (before: runner 1 resumed at the end and never saw it)."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        h.sink.defer = re.compile("^slow@")
        await defer_into_runner(h, "slow@example.net", "strand", 2)
        await h.daemon.checkpoint()
        await h.crash()
        h.config["retry_intervals_s"] = [1000.0]
        await h.start()
        h.sink.defer = None
        h.clock.offset += 3 * 3600
        h.poke()
        await h.until(lambda: h.sink.to("slow@example.net"), what="the stranded message delivered")
        await h.until(lambda: h.daemon.admin.size()["total"] == 0, what="queue empty")
        assert 1 == len(h.sink.to("slow@example.net"))

    run(tmp_path, body, retry_intervals_s=[1000.0, 2000.0])


def test_intervals_removed_then_added_again_offer_nothing_twice(tmp_path):
    """[1000, 2000] -> [1000] -> [1000, 2000]: messages of runner 2 delivered under the middle run are not
    offered again by the new runner 2 of the third run; one still waiting is delivered once."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        h.sink.defer = re.compile("^slow")
        await defer_into_runner(h, "slow1@example.net", "a", 2)
        await h.daemon.checkpoint()
        await h.crash()
        h.config["retry_intervals_s"] = [1000.0]
        await h.start()
        h.sink.defer = re.compile("^slow2")
        h.clock.offset += 3 * 3600
        h.poke()
        await h.until(lambda: h.sink.to("slow1@example.net"), what="slow1 delivered in the middle run")
        await h.until(lambda: h.daemon.admin.size()["total"] == 0, what="queue empty")
        await defer_into_runner(h, "slow2@example.net", "b", 1)
        await h.daemon.checkpoint()
        await h.crash()
        h.config["retry_intervals_s"] = [1000.0, 2000.0]
        await h.start()
        h.sink.defer = None
        h.clock.offset += 3 * 3600
        h.poke()
        await h.until(lambda: h.sink.to("slow2@example.net"), what="slow2 delivered")
        await h.until(lambda: h.daemon.admin.size()["total"] == 0, what="queue empty")
        assert (1, 1) == (len(h.sink.to("slow1@example.net")), len(h.sink.to("slow2@example.net")))
        assert 2 == h.sink.rcpt_attempts.count("slow2@example.net")

    run(tmp_path, body, retry_intervals_s=[1000.0, 2000.0])


@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_each_new_runner_starts_where_every_runner_that_read_its_envelopes_stood(m, n):
    """For every old count m and new count n: envelope runner r was read by old runner min(r, m-1) and is
    read by new runner min(r, n-1), which starts at or before the position of every such old runner and
    keeps every garbage entry of theirs at or after its start; a rescan is asked for exactly when it took
    over runners that stood apart."""
    positions = tuple(Pos(1, 100 * (j + 1) + 7 * (j % 2)) for j in range(m))
    garbage = tuple((Pos(1, 1000 + j), Pos(1, 10 + j)) for j in range(m))
    got = restore_runners(positions, garbage, n)
    for r in range(max(m, n) + 2):
        old, new = min(r, m - 1), min(r, n - 1)
        assert got.positions[new] <= positions[old]
        assert {g for g in garbage[old] if g >= got.positions[new]} <= got.garbage[new]
    last_sources = {positions[j] for j in range(min(n - 1, m - 1), m)}
    assert (len(last_sources) > 1) == (got.rescan_from is not None)
    assert n == len(got.positions) == len(got.garbage)
