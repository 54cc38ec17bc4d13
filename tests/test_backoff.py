"""Back-off that reacts (issue 35.6): dead destinations and concurrency feedback per next hop, against the
daemon in process over loopback SMTP (mtaq.delivery.backoff; Postfix's qmgr concurrency scheduler).

Next hops: the recording aiosmtpd sink of test_runners (the relayhost), and peers made here: one that
answers every connection ``421`` at the greeting and counts the connections, and a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from test_runners import Harness, run

from mtaq.core.view import Selector


class Events:
    """The daemon's logger, recording each event (name and fields) as it passes it on."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.seen: list[dict[str, Any]] = []

    def __getattr__(self, level: str) -> Any:
        emit = getattr(self.log, level)

        def record(event: str, **fields: Any) -> Any:
            self.seen.append({"event": event, **fields})
            return emit(event, **fields)

        return record

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["event"] == name]


def listen_events(h: Harness) -> Events:
    assert h.daemon is not None
    ev = Events(h.daemon.log)
    h.daemon.log = ev
    return ev


class Busy:
    """A next hop that greets every connection with ``421`` and closes it; ``connections`` counts them."""

    def __init__(self) -> None:
        self.connections = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._greet, sock=self.sock)

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.write(b"421 4.7.0 busy.test Service not available, try again later\r\n")
        await writer.drain()
        writer.close()


def free_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_421_peer_is_dead_no_connection_while_dead_one_probe_after_and_other_mail_flows(tmp_path):
    """busy.example's next hop answers 421 at the greeting: after the first message's one connection it is
    dead; three more messages to it are deferred (4.4.1 delivery temporarily suspended: ...) without a
    connection while three messages for a healthy destination are delivered. After the dead time and the
    retry interval, one delivery probes it (one more connection: still 421, dead again) and the other two
    are deferred without one: two connections in all."""
    busy = Busy()

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        ev = listen_events(h)
        await busy.start()
        port = busy.port
        dest = f"[127.0.0.1]:{port}"
        await h.send("a@example.org", ["r0@busy.example"], "b0")
        await h.until(lambda: ev.named("destination_dead"), what="destination_dead")
        [dead] = ev.named("destination_dead")
        assert (dest, 60.0) == (dead["destination"], dead["dead_s"])
        metrics = h.daemon.metrics.exposition().decode()
        assert "mtaq_destinations_dead 1.0" in metrics
        assert f'mtaq_destination_concurrency{{destination="{dest}"}} 1.0' in metrics
        for i in range(1, 4):
            await h.send("a@example.org", [f"r{i}@busy.example"], f"b{i}")
        for i in range(3):
            await h.send("a@example.org", [f"r{i}@ok.example"], f"o{i}")
        await h.until(lambda: len(h.sink.messages) == 3, what="the healthy destination's mail")
        await h.until(lambda: len(ev.named("deferred")) == 4, what="four deferrals")
        assert 1 == busy.connections
        suspended = [e for e in ev.named("deferred") if "delivery temporarily suspended" in e["reply"]]
        assert 3 == len(suspended)
        assert ("none", "4.4.1") == (suspended[0]["relay"], suspended[0]["dsn"])
        assert f"connect to 127.0.0.1[127.0.0.1]:{port}" in suspended[0]["reply"]
        # The dead time (60 s) and the retry interval (120 s) pass: one probe, dead again, no more.
        h.clock.offset += 130
        h.poke()
        await h.until(lambda: len(ev.named("deferred")) == 8, what="the retries deferred")
        assert 2 == busy.connections
        assert 2 == len(ev.named("destination_dead"))
        assert 3 == len(h.sink.messages)

    try:
        run(tmp_path, body, delivery_concurrency=4, smtp_destination_dead_s=60, retry_intervals_s=[120.0],
            transport_map={"busy.example": f"[127.0.0.1]:{busy.port}"})
    finally:
        busy.sock.close()


def test_a_closed_port_is_dead_then_flush_delivers_once_the_peer_is_back(tmp_path):
    """The relayhost's port refuses connections: the first message makes it dead; a next hop started on
    that port meanwhile sees no connection for a second message (deferred: delivery temporarily
    suspended); ``flush`` (Postfix postqueue -f) forgets the dead mark and both are delivered."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        ev = listen_events(h)
        sink_port = h.sink_port
        h.sink_server.close()
        await h.sink_server.wait_closed()
        await h.send("a@example.org", ["r0@example.net"], "c0")
        await h.until(lambda: ev.named("destination_dead"), what="destination_dead")
        [dead] = ev.named("destination_dead")
        assert f"connect to 127.0.0.1[127.0.0.1]:{sink_port}" in dead["reason"]
        # The next hop is back (same port), but the destination is dead: no connection for new mail.
        connections = 0
        loop = asyncio.get_running_loop()
        from aiosmtpd.smtp import SMTP

        def factory() -> SMTP:
            nonlocal connections
            connections += 1
            return SMTP(h.sink, hostname="sink", loop=loop)

        h.sink_server = await loop.create_server(factory, "127.0.0.1", sink_port)
        await h.send("a@example.org", ["r1@example.net"], "c1")
        await h.until(lambda: len(ev.named("deferred")) == 2, what="the second deferral")
        assert "delivery temporarily suspended" in ev.named("deferred")[1]["reply"]
        assert 0 == connections
        res = await h.daemon.admin.act("flush", Selector(all=True))
        assert 2 == len(res.done)
        await h.until(lambda: len(h.sink.messages) == 2, what="both delivered after the flush")
        assert 1 <= connections
        assert [1] == [e["dead"] for e in ev.named("destinations_flushed")]

    run(tmp_path, body, delivery_concurrency=2, retry_intervals_s=[3600.0])


def test_concurrency_backs_off_after_421s_and_grows_back(tmp_path):
    """destination_concurrency_limit = 4; the next hop answers 421 to the first two MAIL commands: its
    window drops to 2 (not dead: 1/4 + 1/3 of a failed cohort), so four messages reach it two at a time;
    successes then grow the window back (1/window each) until four are delivered at once again."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        ev = listen_events(h)
        refusals = 2
        now = 0
        peak = 0
        orig_data = h.sink.handle_DATA

        async def mail(server, session, envelope, address, options):
            nonlocal refusals
            if refusals:
                refusals -= 1
                return "421 4.7.0 sink busy, closing"
            envelope.mail_from = address
            envelope.mail_options.extend(options)
            return "250 2.1.0 Ok"

        async def data(server, session, envelope):
            nonlocal now, peak
            now += 1
            peak = max(peak, now)
            await asyncio.sleep(0.3)
            now -= 1
            return await orig_data(server, session, envelope)

        h.sink.handle_MAIL = mail
        h.sink.handle_DATA = data
        for i in range(2):
            await h.send("a@example.org", [f"f{i}@example.net"], f"f{i}")
            await h.until(lambda i=i: len(ev.named("deferred")) == i + 1, what="a 421 deferral")
        assert [3, 2] == [e["concurrency"] for e in ev.named("concurrency_changed")]
        assert [] == ev.named("destination_dead")
        await asyncio.gather(*(h.send("a@example.org", [f"s{i}@example.net"], f"s{i}") for i in range(4)))
        await h.until(lambda: len(h.sink.messages) == 4, what="four delivered")
        assert 2 == peak
        # 2 + 1/2 + 1/2.5 + ... : after four successes the window is 3.5; two more make it 4 (the limit).
        peak = 0
        await asyncio.gather(*(h.send("a@example.org", [f"t{i}@example.net"], f"t{i}") for i in range(12)))
        await h.until(lambda: len(h.sink.messages) == 16, what="twelve more delivered")
        assert 4 == peak
        assert [3, 2, 3, 4] == [e["concurrency"] for e in ev.named("concurrency_changed")]

    run(tmp_path, body, delivery_concurrency=8, destination_concurrency_limit=4, retry_intervals_s=[3600.0])


def test_a_blocked_destination_holds_at_most_its_limit_of_workers_and_other_mail_flows(tmp_path):
    """Four delivery workers; slow.example (limit 2) answers DATA only when the test lets it: two of its six
    messages are in DATA, the other four wait without a worker, and fast.example's three messages are
    delivered meanwhile. Once slow.example answers, all nine are delivered."""

    async def body(h: Harness) -> None:
        release = asyncio.Event()
        now = 0
        peak = 0
        orig_data = h.sink.handle_DATA

        async def data(server, session, envelope):
            nonlocal now, peak
            if envelope.rcpt_tos[0].endswith("@slow.example"):
                now += 1
                peak = max(peak, now)
                await release.wait()
                now -= 1
            return await orig_data(server, session, envelope)

        h.sink.handle_DATA = data
        await asyncio.gather(*(h.send("a@example.org", [f"s{i}@slow.example"], f"s{i}") for i in range(6)))
        await h.until(lambda: now == 2, what="two slow.example deliveries in DATA")
        await asyncio.gather(*(h.send("a@example.org", [f"f{i}@fast.example"], f"f{i}") for i in range(3)))
        await h.until(lambda: len(h.sink.messages) == 3, timeout_s=10, what="fast.example's mail")
        assert (2, 0) == (now, len([m for m in h.sink.messages if m[1][0].endswith("@slow.example")]))
        release.set()
        await h.until(lambda: len(h.sink.messages) == 9, what="all nine delivered")
        assert 2 == peak

    run(tmp_path, body, delivery_concurrency=4, destination_limits={"slow.example": {"concurrency": 2}})


def test_feedback_arithmetic_window_never_below_one_and_cohort_limit_zero_never_dead():
    """Destinations alone, on a clock the test moves: session 421s take the window from 3 down to 1 and no
    lower; with destination_concurrency_failed_cohort_limit = 0 nothing is ever dead; with 2, a host that
    cannot be reached is dead after its second failure (a whole cohort each); after the dead time one
    delivery at a time probes it, and the failed cohorts count afresh."""
    from mtaq.delivery.backoff import Destinations
    from mtaq.delivery.relay import Reply

    t = [0.0]
    events: list[tuple[str, dict[str, Any]]] = []
    lost = Reply(421, "4.4.2", "conversation with h[192.0.2.1]:25: connection lost")
    never = Destinations(3, failed_cohort_limit=0, clock=lambda: t[0], report=lambda e, f: events.append((e, f)))
    for _ in range(10):
        never.feedback("x:25", answered=False, failure=lost)
    assert (1.0, None) == (never.state("x:25").window, never.suspended("x:25"))
    assert [2, 1] == [f["concurrency"] for e, f in events if e == "concurrency_changed"]
    never.feedback("x:25", answered=True)
    assert 2.0 == never.state("x:25").window

    refused = Reply(421, "4.4.1", "connect to h[192.0.2.1]:25: Connection refused")
    d = Destinations(20, dead_s=10, failed_cohort_limit=2, clock=lambda: t[0])
    d.feedback("[192.0.2.1]:25", answered=False, failure=refused, whole=True)
    assert (None, 19.0) == (d.suspended("[192.0.2.1]:25"), d.state("[192.0.2.1]:25").window)
    d.feedback("[192.0.2.1]:25", answered=False, failure=refused, whole=True)
    r = d.suspended("[192.0.2.1]:25")
    assert r is not None and (421, "4.4.1") == (r.code, r.enhanced)
    assert "delivery temporarily suspended: connect to h[192.0.2.1]:25: Connection refused" == r.text
    assert True is d.free(["[192.0.2.1]:25"])  # dead: its mail goes at once, deferred without a connection
    assert [] == d.hold(["[192.0.2.1]:25"])
    t[0] = 10.0
    assert None is d.suspended("[192.0.2.1]:25")
    assert ["[192.0.2.1]:25"] == d.hold(["[192.0.2.1]:25"])
    assert False is d.free(["[192.0.2.1]:25"])  # one probe at a time
    d.feedback("[192.0.2.1]:25", answered=False, failure=refused, whole=True)
    d.release(["[192.0.2.1]:25"])
    assert None is d.suspended("[192.0.2.1]:25")  # one failed cohort of the two since the dead time
    d.feedback("[192.0.2.1]:25", answered=False, failure=refused, whole=True)
    assert d.suspended("[192.0.2.1]:25") is not None
