"""The anvil's wire and its failure modes (issue 32.4), over real socketpairs.

A worker asks the supervisor's gate (:mod:`mtaq.daemon.anvil`); when the supervisor is slow or gone the
worker must neither wait long nor go without limits, and nothing may stay counted that nobody holds.
"""

from __future__ import annotations

import asyncio
import socket
import time

from mtaq.daemon.anvil import AnvilClient, AnvilServer
from mtaq.edge.limits import ConnectionGate


def _gate(**kw: int) -> ConnectionGate:
    return ConnectionGate(connections_max=100, per_client_per_minute_max=0, client_connections_max=kw.get("per_ip", 2),
                          auth_failures_per_minute_max=kw.get("auth", 3))


def test_two_workers_share_one_per_ip_limit_and_one_auth_failure_count():
    """Two clients of one AnvilServer (the supervisor, served here in the same loop through its real sockets):
    the per-IP limit of 2 and the AUTH failure limit of 3 count both workers' clients; a release frees a place."""
    host = _gate()
    pairs = [socket.socketpair() for _ in range(2)]
    server = AnvilServer(host, [a for a, _b in pairs])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for s in server.sockets:
            loop.add_reader(s, server.readable, s)
        w1, w2 = (AnvilClient(b, _gate(), timeout_s=5) for _a, b in pairs)
        await w1.start()
        await w2.start()
        assert [None, None, "too many connections from 192.0.2.1"] == [
            await w1.ask_admit("192.0.2.1"), await w2.ask_admit("192.0.2.1"), await w2.ask_admit("192.0.2.1")]
        w1.release("192.0.2.1")
        assert await w2.ask_admit("192.0.2.1") is None
        for w in (w1, w2, w1):
            assert await w.ask_auth_begin("192.0.2.9")
            w.auth_failed("192.0.2.9")
            w.auth_end("192.0.2.9")
        assert [True, True, False] == [await w1.ask_auth_blocked("192.0.2.9"), await w2.ask_auth_blocked("192.0.2.9"),
                                       await w2.ask_auth_blocked("192.0.2.10")]
        assert not await w2.ask_auth_begin("192.0.2.9")

    asyncio.run(main())
    assert 2 == host.active


def test_a_silent_anvil_costs_one_timeout_and_the_worker_keeps_its_own_limits():
    """The supervisor never answers: each question waits timeout_s (0.2 s here), no more, and the worker's own
    gate decides with the same limits (2 per IP): admitted, admitted, refused; a release goes to that gate."""
    ours, theirs = socket.socketpair()
    own = _gate()

    async def main() -> list[str | None]:
        w = AnvilClient(theirs, own, timeout_s=0.2)
        await w.start()
        t0 = time.monotonic()
        answers = [await w.ask_admit("192.0.2.1") for _ in range(3)]
        assert time.monotonic() - t0 < 0.2 * 3 + 0.5
        w.release("192.0.2.1")
        return answers

    assert [None, None, "too many connections from 192.0.2.1"] == asyncio.run(main())
    assert 1 == own.active
    ours.close()


def test_a_late_admission_is_given_back_to_the_anvil():
    """An answer `+` that comes after the worker stopped waiting (timeout) is released at once: the host's
    gate keeps no place that nobody holds."""
    ours, theirs = socket.socketpair()

    class Counted(ConnectionGate):
        admits = releases = 0

        def admit(self, ip: str) -> str | None:
            self.admits += 1
            return super().admit(ip)

        def release(self, ip: str | None = None) -> None:
            self.releases += 1
            super().release(ip)

    host = Counted(connections_max=100, per_client_per_minute_max=0, client_connections_max=2)

    async def main() -> None:
        w = AnvilClient(theirs, _gate(), timeout_s=0.1)
        await w.start()
        assert await w.ask_admit("192.0.2.1") is None  # decided alone: nobody answered in 0.1 s
        server = AnvilServer(host, [ours])  # the supervisor wakes up and answers the old question
        loop = asyncio.get_running_loop()
        loop.add_reader(ours, server.readable, ours)
        deadline = time.monotonic() + 10
        while host.releases == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        loop.remove_reader(ours)

    asyncio.run(main())
    assert (1, 1, 0, {}) == (host.admits, host.releases, host.active, host._per_client)


def test_a_closed_anvil_means_the_workers_own_gate_at_once():
    """The supervisor's socket is closed: questions are answered by the worker's own gate without waiting."""
    ours, theirs = socket.socketpair()
    ours.close()

    async def main() -> float:
        w = AnvilClient(theirs, _gate(), timeout_s=5)
        await w.start()
        deadline = time.monotonic() + 10
        while not w._down and time.monotonic() < deadline:  # the reader sees the end of the stream
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        assert await w.ask_admit("192.0.2.1") is None
        assert not await w.ask_auth_blocked("192.0.2.1")
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0


def test_an_answer_taken_by_a_cancelled_question_is_given_back():
    """Review finding F1: the anvil's `+` is set on the question's future, and the asking task (a connection's
    handler) is cancelled before it wakes up to take it (aiosmtpd cancels it when the client resets or closes
    right then). The task gets CancelledError, not `+`: the admission and the AUTH check it was given are
    released / ended at once, so the host's gate holds nothing (before: the place was kept for ever).

    Deterministic on asyncio's loop: a task that yields every iteration sees the future done in the iteration
    after the anvil's reader set it, before the asking task's wake-up (queued behind it) runs, and cancels it."""
    ours, theirs = socket.socketpair()
    host = _gate(per_ip=5)
    server = AnvilServer(host, [ours])

    async def cancel_once_answered(w: AnvilClient, ask) -> str:
        task = asyncio.ensure_future(ask)
        while not w._pending:  # the question is on the wire
            await asyncio.sleep(0)
        [(_op, _ip, fut)] = w._pending.values()
        while not fut.done():
            await asyncio.sleep(0)
        assert not task.done()  # answered, not yet taken
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "taken"

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        loop.add_reader(ours, server.readable, ours)
        w = AnvilClient(theirs, _gate(), timeout_s=5)
        await w.start()
        outcomes = [await cancel_once_answered(w, w.ask_admit("192.0.2.1")),
                    await cancel_once_answered(w, w.ask_auth_begin("192.0.2.1"))]
        deadline = time.monotonic() + 10
        while (host.active or host._auth_checking) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        loop.remove_reader(ours)
        return outcomes

    assert ["cancelled", "cancelled"] == asyncio.run(main())
    assert (0, 0, {}, {}) == (host.active, host.active_outside, host._per_client, host._auth_checking)


def test_what_a_cut_off_worker_held_is_given_back_and_a_release_counts_once():
    """Found with review finding F1: the supervisor closes the socket of a worker that breaks the wire (here it
    sends a line that is not the wire); that worker then decides alone and never releases its places in the
    host's gate, so the anvil gives back at once what it held (2 admissions and 1 AUTH check of 192.0.2.1),
    and the other worker's client is admitted again up to the limit of 2. A release the worker holds nothing
    for is ignored (a place is given back once)."""
    host = _gate(per_ip=2)
    pairs = [socket.socketpair() for _ in range(2)]
    server = AnvilServer(host, [a for a, _b in pairs])

    async def main() -> list[str | None]:
        loop = asyncio.get_running_loop()
        for s in server.sockets:
            loop.add_reader(s, server.readable, s)
        w1, w2 = (AnvilClient(b, _gate(per_ip=2), timeout_s=5) for _a, b in pairs)
        await w1.start()
        await w2.start()
        assert [None, None] == [await w1.ask_admit("192.0.2.1"), await w1.ask_admit("192.0.2.1")]
        assert await w1.ask_auth_begin("192.0.2.1")
        w2.release("192.0.2.1")  # w2 holds nothing: ignored
        assert "too many connections from 192.0.2.1" == await w2.ask_admit("192.0.2.1")
        pairs[0][1].send(b"not the wire\n")
        deadline = time.monotonic() + 10
        while len(server.sockets) == 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        answers = [await w2.ask_admit("192.0.2.1"), await w2.ask_admit("192.0.2.1"), await w2.ask_admit("192.0.2.1")]
        for s in server.sockets:
            loop.remove_reader(s)
        return answers

    assert [None, None, "too many connections from 192.0.2.1"] == asyncio.run(main())
    assert (2, {"192.0.2.1": 2}, {}) == (host.active, host._per_client, host._auth_checking)
