"""Traffic shaping per destination domain and back-pressure at the door, against the daemon in process
(real sockets, real disk)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import smtplib
import threading
import time

from test_runners import Harness, run

from mtaq.core.state import RetryPolicy
from mtaq.edge.server import QueueHandler, start_server
from mtaq.queue.store import Queue
from mtaq.storage.log import Log
from mtaq.testing.faults import FaultyFileSystem


def test_throttled_domain_never_exceeds_its_concurrency_and_others_are_not_held_back(tmp_path):
    """slow.example is limited to 2 deliveries at once: the next hop never sees more than 2 of its
    messages at the same time, while fast.example (default limit) gets more than 2 at once."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        orig = h.sink.handle_DATA
        now: dict[str, int] = {"slow.example": 0, "fast.example": 0}
        peak: dict[str, int] = {"slow.example": 0, "fast.example": 0}

        async def slow_data(server, session, envelope):
            dom = envelope.rcpt_tos[0].rpartition("@")[2]
            now[dom] += 1
            peak[dom] = max(peak[dom], now[dom])
            await asyncio.sleep(0.2)
            now[dom] -= 1
            return await orig(server, session, envelope)

        h.sink.handle_DATA = slow_data
        sends = [h.send("a@example.org", [f"r{i}@slow.example"], f"s{i}") for i in range(8)]
        sends += [h.send("a@example.org", [f"r{i}@fast.example"], f"f{i}") for i in range(8)]
        await asyncio.gather(*sends)
        await h.until(lambda: len(h.sink.messages) == 16, timeout_s=30, what="all delivered")
        assert 2 == peak["slow.example"]
        assert 2 == h.daemon.throttle.peak("slow.example")
        assert peak["fast.example"] > 2

    run(tmp_path, body, delivery_concurrency=8,
        destination_limits={"slow.example": {"concurrency": 2}})


def test_destination_rate_spaces_deliveries_to_the_domain(tmp_path):
    """rate_per_s = 5: deliveries to the domain start at least 0.2 s apart (a token bucket of one)."""

    async def body(h: Harness) -> None:
        orig = h.sink.handle_DATA
        starts: list[float] = []

        async def stamp(server, session, envelope):
            starts.append(time.monotonic())
            return await orig(server, session, envelope)

        h.sink.handle_DATA = stamp
        await asyncio.gather(*(h.send("a@example.org", [f"r{i}@rated.example"], f"r{i}") for i in range(5)))
        await h.until(lambda: len(h.sink.messages) == 5, timeout_s=30, what="all delivered")
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert all(g >= 0.15 for g in gaps), gaps  # 0.2 s less the jitter of the sink's own clock

    run(tmp_path, body, delivery_concurrency=5,
        destination_limits={"rated.example": {"concurrency": 5, "rate_per_s": 5.0}})


def test_queue_over_its_message_limit_refuses_new_mail_with_452(tmp_path):
    """queue_messages_max = 3: with 3 messages queued (deferred), the 4th gets 452 4.3.1."""

    def try_send(port: int) -> tuple[int, bytes]:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.ehlo("client.test")
            s.mail("alice@example.org")
            s.rcpt("slow9@example.net")
            return s.data(b"Subject: 4th\r\n\r\nbody\r\n")

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        h.sink.defer = re.compile("^slow")
        for i in range(3):
            await h.send("alice@example.org", [f"slow{i}@example.net"], f"q{i}")
        code, text = await asyncio.to_thread(try_send, h.port)
        assert (452, True) == (code, text.startswith(b"4.3.1 "))

    run(tmp_path, body, queue_messages_max=3, retry_intervals_s=[3600.0])


def test_commit_backlog_over_its_limit_answers_451_4_3_2(tmp_path):
    """A disk that holds its fsync until told, and commit_backlog_max = 2: two clients' messages wait for
    the fsync; a third client gets 451 4.3.2 and nothing is written for it; once the disk answers, the two
    get 250."""

    def send(port: int) -> tuple[int, bytes]:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.ehlo("client.test")
            s.mail("a@example.org")
            s.rcpt("b@example.net")
            return s.data(b"Subject: b\r\n\r\nbody\r\n")

    async def main():
        fs = FaultyFileSystem()
        log, _ = Log.open(fs, str(tmp_path / "log"), segment_bytes_max=1 << 20)
        queue = Queue(log, policy=RetryPolicy())
        queue.commit_backlog_max = 2
        durable = []
        queue.on_durable = lambda env, pos: durable.append(env)
        server = await start_server(QueueHandler(queue), "127.0.0.1", 0, hostname="mx.test",
                                    data_size_limit=1 << 20, timeout_s=30)
        port = server.sockets[0].getsockname()[1]
        gate = fs.fsync_gate = threading.Event()
        waiting = [asyncio.ensure_future(asyncio.to_thread(send, port)) for _ in range(2)]
        for _ in range(500):
            if queue.settling == 2:
                break
            await asyncio.sleep(0.01)
        assert 2 == queue.settling
        third = await asyncio.to_thread(send, port)
        gate.set()
        replies = [third, *await asyncio.gather(*waiting)]
        server.close()
        return replies, durable

    replies, durable = asyncio.run(main())
    assert [451, 250, 250] == [c for c, _ in replies]
    assert replies[0][1].startswith(b"4.3.2 ")
    assert 2 == len(durable)


def test_a_delivery_cancelled_while_waiting_for_a_slot_gives_back_the_slots_it_had():
    """Domains are taken in sorted order: a delivery holding a's slot while it waits for b's, cancelled there
    (delivery_timeout_s), gives a's back; nothing stays counted as active."""
    from mtaq.delivery.throttle import DomainLimit, Throttle

    async def main():
        t = Throttle(DomainLimit(concurrency=1))
        holding_b = asyncio.Event()
        release_b = asyncio.Event()

        async def hold_b():
            async with t.slots(["B.example"]):
                holding_b.set()
                await release_b.wait()

        first = asyncio.create_task(hold_b())
        await holding_b.wait()
        second = asyncio.create_task(t.slots(["b.example", "a.example"]).__aenter__())
        while t._domains.get("a.example") is None or not t._domains["a.example"].sem.locked():
            await asyncio.sleep(0)  # until the second has a's slot and waits for b's
        second.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await second
        a, b = t._domains["a.example"], t._domains["b.example"]
        assert (0, False) == (a.active, a.sem.locked())
        assert (1, True) == (b.active, b.sem.locked())
        release_b.set()
        await first
        assert (0, False) == (b.active, b.sem.locked())
        async with t.slots(["a.example", "b.example"]):
            assert (1, 1) == (a.active, b.active)
        assert (0, 0, 1, 1) == (a.active, b.active, a.peak, b.peak)

    asyncio.run(main())
