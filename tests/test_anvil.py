"""The anvil's wire and its failure modes (issue 32.4), over real socketpairs.

A worker asks the supervisor's gate (:mod:`mtaq.daemon.anvil`); when the supervisor is slow or gone the
worker must neither wait long nor go without limits, and nothing may stay counted that nobody holds.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

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


def _lan_gate(connections_max: int = 10, reserve: int = 4) -> ConnectionGate:
    """connections_max 10 with 4 kept for mynetworks (127.0.0.1 here): 6 for the outside, 2 places ahead."""
    return ConnectionGate(connections_max=connections_max, per_client_per_minute_max=0, client_connections_max=50,
                          mynetworks_reserve=reserve, exempt=lambda ip: ip == "127.0.0.1")


async def _until(check, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def test_places_ahead_admit_mynetworks_clients_without_a_round_trip_and_connections_max_stays_exact():
    """Two workers of one anvil, connections_max 10, 4 of them kept for mynetworks (so at most 2 places ahead).
    Worker 1's first mynetworks client is admitted by asking (A) and gets it the 2 places; its next two clients
    take them without a message to the anvil (the host's count does not move). The outside takes its 6,
    the 7th is refused; worker 2's mynetworks clients get the rest by asking, up to exactly 10 in all; worker
    1, its places used, is refused too. Ended connections put their places back in worker 1's pool, and
    the host's count only drops once the worker gives them back (its socket closed)."""
    host = _lan_gate()
    pairs = [socket.socketpair() for _ in range(2)]
    server = AnvilServer(host, [a for a, _b in pairs])
    lines: list[bytes] = []
    answer = server.answer

    def counted(line: bytes, s: socket.socket | None = None) -> bytes | None:
        lines.append(line.split(b" ", 1)[1])
        return answer(line, s)

    server.answer = counted  # type: ignore[method-assign]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for s in server.sockets:
            loop.add_reader(s, server.readable, s)
        w1, w2 = (AnvilClient(b, _lan_gate(), timeout_s=5) for _a, b in pairs)
        await w1.start()
        await w2.start()
        assert await w1.ask_admit("127.0.0.1") is None
        await _until(lambda: w1._places == 2, "worker 1's places")
        assert (3, 2) == (host.active, host.places)
        assert [b"P 4 -", b"A 127.0.0.1"] == lines
        sent = w1._next  # messages worker 1 has put on the wire
        assert [None, None] == [await w1.ask_admit("127.0.0.1"), await w1.ask_admit("127.0.0.1")]
        assert (3, 0) == (host.active, w1._places)  # taken from the places: the host already counted them
        assert sent + 1 == w1._next  # only the ask for more places (its pool ran low): no admission asked
        await _until(lambda: not w1._asking_places, "worker 1's second ask answered")
        sent = w1._next
        w1.release("127.0.0.1")  # from a place: back in the pool, nothing on the wire
        assert (1, 3, sent) == (w1._places, host.active, w1._next)
        assert await w1.ask_admit("127.0.0.1") is None  # places are alike: any connection of an IP puts one back
        assert (0, 3, sent) == (w1._places, host.active, w1._next)
        outside = [await w2.ask_admit(f"192.0.2.{i}") for i in range(1, 8)]
        assert [None] * 6 + ["too many connections"] == outside
        assert 9 == host.active
        assert [None, "too many connections"] == [await w2.ask_admit("127.0.0.1"), await w2.ask_admit("127.0.0.1")]
        assert "too many connections" == await w1.ask_admit("127.0.0.1")
        assert (10, 6) == (host.active, host.active_outside)  # exactly connections_max
        for _ in range(2):
            w1.release("127.0.0.1")  # its places were called back (the host was full): to the host now (G)
        await _until(lambda: host.active == 8, "the places given back as their connections end")
        assert (0, 0) == (w1._places, host.places)
        pairs[0][1].close()  # worker 1 gone: the host gives back what it held (its admission)
        await _until(lambda: host.active == 7 and host.places == 0, "worker 1's admission given back")
        assert [b"P 4 -", b"A 127.0.0.1"] == [line for line in lines if not line.startswith(b"A 192.")][:2]
        for s in server.sockets:
            loop.remove_reader(s)

    asyncio.run(main())


def test_a_pool_over_places_keep_gives_the_rest_back():
    """A worker whose mynetworks connections end returns their places to its pool; above PLACES_KEEP idle it
    gives all but PLACES_ASK back to the host (G), so idle places do not pile up in one worker."""
    from mtaq.daemon.anvil import PLACES_ASK, PLACES_KEEP

    host = _lan_gate(connections_max=100, reserve=40)  # 20 places ahead at most
    ours, theirs = socket.socketpair()
    server = AnvilServer(host, [ours])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(ours, server.readable, ours)
        w = AnvilClient(theirs, _lan_gate(connections_max=100, reserve=40), timeout_s=5)
        await w.start()
        for _ in range(PLACES_KEEP + 1):
            assert await w.ask_admit("127.0.0.1") is None
            await _until(lambda: not w._asking_places, "the ask answered")
        held = host.places
        assert held >= PLACES_KEEP + 1
        for _ in range(PLACES_KEEP + 1):
            w.release("127.0.0.1")
        await _until(lambda: host.places < held, "the extra places given back")
        assert PLACES_ASK <= w._places <= PLACES_KEEP  # the pool was cut back to PLACES_ASK, then grew
        assert host.places == w._places + sum(w._place_ips.values())
        loop.remove_reader(ours)

    asyncio.run(main())
    ours.close()


@pytest.mark.parametrize("line", [b"1 P 0 -\n", b"1 P 65 -\n", b"1 P x -\n", b"1 G -1\n", b"1 G 0\n", b"1 Y x\n",
                                  b"1 Y 65\n", b"1 P \xd9\xa3 -\n"])
def test_a_count_of_places_out_of_range_is_not_the_wire(line):
    """P and G take a count of 1 to PLACES_MAX; anything else, and a release of the places' own key, closes
    that worker's socket (it then decides alone) and grants nothing."""
    host = _lan_gate()
    ours, theirs = socket.socketpair()
    server = AnvilServer(host, [ours])
    theirs.send(line)
    assert not server.readable(ours)
    assert ([], 0, 0) == (server.sockets, host.active, host.places)
    theirs.close()


async def _workers(host: ConnectionGate, n: int, gate=None) -> tuple[AnvilServer, list[AnvilClient], list]:
    pairs = [socket.socketpair() for _ in range(n)]
    server = AnvilServer(host, [a for a, _b in pairs])
    loop = asyncio.get_running_loop()
    for s in server.sockets:
        loop.add_reader(s, server.readable, s)
    clients = [AnvilClient(b, gate() if gate else _lan_gate(host.connections_max, host.mynetworks_reserve), timeout_s=5)
               for _a, b in pairs]
    for c in clients:
        await c.start()
    return server, clients, pairs


def test_idle_places_are_called_back_before_an_admission_is_refused_for_room():
    """Review of stop 57: with connections_max 10 and 4 kept for mynetworks, 2 places idle in worker 1 made
    the host refuse the 6th outside client at 8 real connections. Now an admission the host has no room for
    while places are out waits: the host calls back the idle places (``0 X``, answered ``Y N``), then
    decides; the client is admitted, and exactly connections_max is still never passed."""
    host = _lan_gate()

    async def main() -> None:
        server, (w1, w2), _pairs = await _workers(host, 2)
        assert await w1.ask_admit("127.0.0.1") is None  # asks A, and 2 places ahead for later
        await _until(lambda: w1._places == 2, "worker 1's places")
        w1.release("127.0.0.1")  # the asked admission ends: 2 idle places left in worker 1
        await _until(lambda: host.active == 2, "the release")
        assert [None] * 3 == [await w2.ask_admit("127.0.0.1") for _ in range(3)]
        assert [None] * 5 == [await w2.ask_admit(f"192.0.2.{i}") for i in range(1, 6)]
        assert (10, 5, 2) == (host.active, host.active_outside, host.places)
        assert await w2.ask_admit("192.0.2.6") is None  # before: "too many connections"
        assert (9, 6, 0, 0) == (host.active, host.active_outside, host.places, w1._places)
        assert "too many connections" == await w2.ask_admit("192.0.2.7")  # the outside's 6 are taken
        assert None is await w2.ask_admit("127.0.0.1")
        assert "too many connections" == await w2.ask_admit("127.0.0.1")  # 10 real connections: full
        assert 10 == host.active
        for s in server.sockets:
            asyncio.get_running_loop().remove_reader(s)

    asyncio.run(main())


def test_a_worker_that_does_not_answer_a_recall_delays_an_admission_by_recall_wait_s_at_most():
    """A worker holding places that never answers ``0 X`` (hung): the parked admission is decided after
    RECALL_WAIT_S (refused: there is no room), well within the asking worker's own timeout."""
    from mtaq.daemon.anvil import RECALL_WAIT_S

    host = _lan_gate(connections_max=4, reserve=2)  # 1 place ahead at most

    async def main() -> None:
        hung_ours, hung = socket.socketpair()
        pairs = [socket.socketpair()]
        server = AnvilServer(host, [hung_ours, pairs[0][0]])
        loop = asyncio.get_running_loop()
        for s in server.sockets:
            loop.add_reader(s, server.readable, s)
        hung.send(b"1 P 1 -\n")
        await _until(lambda: host.places == 1, "the hung worker's place")
        w = AnvilClient(pairs[0][1], _lan_gate(connections_max=4, reserve=2), timeout_s=5)
        await w.start()
        assert [None] * 3 == [await w.ask_admit(f"192.0.2.{i}") for i in (1, 2)] + [await w.ask_admit("127.0.0.1")]
        assert 4 == host.active
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(w.ask_admit("127.0.0.1"))
        while not waiter.done():  # what wait_serving does between its selects
            server.due()
            await asyncio.sleep(0.01)
        assert "too many connections" == waiter.result()
        assert RECALL_WAIT_S <= time.monotonic() - t0 < 2
        assert b"0 X\n" in hung.recv(100)
        for s in server.sockets:
            loop.remove_reader(s)

    asyncio.run(main())


def test_places_go_only_to_a_worker_whose_mynetworks_is_the_hosts():
    """Review of stop 57: a worker whose mynetworks differs from the host's (it reloaded first, or the host's
    reload failed) admitted from its places a client the host counts as outside, past its per-client limit.
    Now the host grants no place to a worker whose exemption key is not its own: the worker asks, and the
    host decides, by its own mynetworks."""
    host = ConnectionGate(connections_max=10, per_client_per_minute_max=0, client_connections_max=1,
                          mynetworks_reserve=4, exempt=lambda ip: False, exempt_key="host-networks")

    def lenient() -> ConnectionGate:
        return ConnectionGate(connections_max=10, per_client_per_minute_max=0, client_connections_max=1,
                              mynetworks_reserve=4, exempt=lambda ip: True, exempt_key="worker-networks")

    async def main() -> None:
        server, (w,), _pairs = await _workers(host, 1, lenient)
        got = [await w.ask_admit("192.0.2.1") for _ in range(3)]
        await _until(lambda: not w._asking_places, "the ask answered")
        assert [None, "too many connections from 192.0.2.1", "too many connections from 192.0.2.1"] == got
        assert (0, 0, 1) == (w._places, host.places, host.active)
        for s in server.sockets:
            asyncio.get_running_loop().remove_reader(s)

    asyncio.run(main())


def test_the_host_reading_its_limits_again_calls_back_the_idle_places():
    """``L`` (worker 0 reloaded): the places idle in every worker were granted under the old mynetworks;
    they come back, and a worker asks again (naming its mynetworks) only after _PLACES_RETRY_S."""
    host = _lan_gate()
    read_again: list[int] = []

    async def main() -> None:
        server, (w1, w2), _pairs = await _workers(host, 2)
        server.reconfigure = lambda: read_again.append(1)
        assert await w1.ask_admit("127.0.0.1") is None
        await _until(lambda: w1._places == 2, "worker 1's places")
        w2.reconfigure_host()
        await _until(lambda: host.places == 0, "the idle places back")
        assert ([1], 0, 1) == (read_again, w1._places, host.active)
        for s in server.sockets:
            asyncio.get_running_loop().remove_reader(s)

    asyncio.run(main())


def test_a_give_back_larger_than_held_and_a_grant_never_pass_what_the_host_allows():
    """The review's surviving mutations: ``G`` naming more places than that worker holds gives back only its
    own (not another worker's), and places ahead never take ``active`` past connections_max."""
    host = _lan_gate(connections_max=10, reserve=8)  # 4 places ahead at most
    a, b = socket.socketpair(), socket.socketpair()
    server = AnvilServer(host, [a[0], b[0]])
    assert b"1 +2\n" == server.answer(b"1 P 2 -", a[0])
    assert b"1 +2\n" == server.answer(b"1 P 2 -", b[0])
    assert None is server.answer(b"2 G 4", a[0])
    assert (2, 2) == (host.places, host.active)  # worker b's 2 still counted
    for i in range(7):
        assert b"%d +\n" % (10 + i) == server.answer(b"%d A 127.0.0.1" % (10 + i), a[0])
    assert 9 == host.active
    assert b"3 +1\n" == server.answer(b"3 P 4 -", a[0])  # room for one: one granted
    assert (10, 3) == (host.active, host.places)
    assert b"4 +0\n" == server.answer(b"4 P 4 -", a[0])
    assert 10 == host.active
    for s in (*a, *b):
        s.close()


# ------------------------------------------------------------------ the second review of places ahead (stop 57)


@pytest.mark.parametrize("line", [b"1 G 1\n", b"1 Y 0\n"])
def test_a_give_back_from_a_worker_granted_no_place_changes_nothing(line):
    """Finding 1: ``G`` or ``Y`` from a worker the host never granted a place raised KeyError in the
    supervisor. It is ignored: the socket stays open, no count moves."""
    host = _lan_gate()
    ours, theirs = socket.socketpair()
    server = AnvilServer(host, [ours])
    theirs.send(line + b"2 A 127.0.0.1\n")
    assert server.readable(ours)
    assert b"2 +\n" == theirs.recv(100)
    assert ([ours], 1, 0) == (server.sockets, host.active, host.places)
    ours.close()
    theirs.close()


@pytest.mark.parametrize("tail", [b"4 R 192.0.2.9\n", b"4 G 1\n"])
def test_lines_read_with_an_admission_that_recalls_count_once_even_when_the_worker_is_gone(tail):
    """Finding 2: worker 1 (2 places, one admission of 192.0.2.9) sends an admission the full host parks
    (recalling its places), then a release, and exits. Sending the recall failed and closed its socket in the
    middle of its lines, and the release after was counted again, taking worker 2's admission of the same
    address. Now a recall only queues its message: the lines count once, then the closed socket gives back
    what worker 1 still held, and worker 2 keeps its own."""
    host = ConnectionGate(connections_max=6, per_client_per_minute_max=0, mynetworks_reserve=4,
                          client_connections_max=9, exempt=lambda ip: ip == "127.0.0.1", exempt_key="k")
    p1, p2 = socket.socketpair(), socket.socketpair()
    server = AnvilServer(host, [p1[0], p2[0]])
    assert b"1 +2\n" == server.answer(b"1 P 2 k", p1[0])
    assert b"2 +\n" == server.answer(b"2 A 192.0.2.9", p1[0])
    assert b"1 +\n" == server.answer(b"1 A 192.0.2.9", p2[0])
    assert b"2 +\n" == server.answer(b"2 A 127.0.0.1", p2[0])
    assert b"3 +\n" == server.answer(b"3 A 127.0.0.1", p2[0])
    assert 6 == host.active
    p1[1].send(b"3 A 127.0.0.1\n" + tail)
    p1[1].close()
    assert not server.readable(p1[0])
    assert (3, {"192.0.2.9": 1}, {"192.0.2.9": 1, "127.0.0.1": 2}) == (host.active, dict(host._per_ip),
                                                                       server._held[p2[0]])
    assert [p2[0]] == server.sockets
    for s in (p2[0], p2[1], p1[0]):
        s.close()


def test_a_recall_read_with_the_grant_before_it_gives_those_places_back():
    """Finding 3: the host grants places (``+2``) and, before the worker's loop has run, calls them back (an
    admission at capacity). The worker read both lines in one go but took the grant after answering the
    recall (``Y 0``): the places stayed idle in its pool and the parked admission was refused. Now the grant
    is taken in order, so the ``Y`` gives both back and the admission gets one of them."""
    host = ConnectionGate(connections_max=6, per_client_per_minute_max=0, client_connections_max=9,
                          mynetworks_reserve=4, exempt=lambda ip: ip == "127.0.0.1", exempt_key="k")
    p1, p2 = socket.socketpair(), socket.socketpair()
    server = AnvilServer(host, [p1[0], p2[0]])

    async def main() -> None:
        w1 = AnvilClient(p1[1], ConnectionGate(connections_max=6, per_client_per_minute_max=0,
                                               client_connections_max=9, mynetworks_reserve=4,
                                               exempt=lambda ip: ip == "127.0.0.1", exempt_key="k"), timeout_s=5)
        await w1.start()
        for i, ip in enumerate(("192.0.2.1", "192.0.2.2", "127.0.0.1", "127.0.0.1"), 1):
            assert b"%d +\n" % i == server.answer(b"%d A %s" % (i, ip.encode()), p2[0])
        w1._ask_places()  # "P" on the wire; the worker's loop has not run
        await asyncio.sleep(0)
        server.readable(p1[0])  # granted: +2, the host is full
        assert (6, 2) == (host.active, host.places)
        p2[1].send(b"5 A 127.0.0.1\n")
        server.readable(p2[0])  # parked, "0 X" to worker 1 (both lines now wait in worker 1's socket)
        assert (1, [p1[0]]) == (len(server._parked), list(server._waiting))
        await _until(lambda: server.readable(p1[0]) and not server._waiting, "worker 1's answer to the recall")
        assert (0, 0, 5) == (w1._places, host.places, host.active)
        assert b"5 +\n" == p2[1].recv(100)

    asyncio.run(main())
    for s in (*p1, *p2):
        s.close()


def test_a_place_in_use_when_the_worker_reloads_goes_back_to_the_host_when_its_connection_ends():
    """Finding 4: a place used by a connection when the worker's mynetworks changed went back to its pool at
    the connection's end and was used under the new rule (a client the host counts as outside got in past
    its per-client limit). Now the idle places go back at the reload and the used ones when their
    connections end; a grant asked for under the old mynetworks and answered after the reload goes back too."""
    host = ConnectionGate(connections_max=10, per_client_per_minute_max=0, client_connections_max=1,
                          mynetworks_reserve=4, exempt=lambda ip: ip == "127.0.0.1", exempt_key="old")
    worker = ConnectionGate(connections_max=10, per_client_per_minute_max=0, client_connections_max=1,
                            mynetworks_reserve=4, exempt=lambda ip: ip == "127.0.0.1", exempt_key="old")

    async def main() -> None:
        server, (w,), _pairs = await _workers(host, 1, lambda: worker)
        assert await w.ask_admit("127.0.0.1") is None
        await _until(lambda: w._places == 2, "the places")
        assert await w.ask_admit("127.0.0.1") is None  # from a place
        assert (1, {"127.0.0.1": 1}, 2) == (w._places, w._place_ips, host.places)
        worker.configure(connections_max=10, per_client_per_minute_max=0, client_connections_max=1,
                         mynetworks_reserve=4, exempt=lambda ip: True, auth_failures_per_minute_max=0,
                         exempt_key="new")
        w.limits_changed()
        await _until(lambda: host.places == 1, "the idle place back")
        w.release("127.0.0.1")  # the connection that used a place ends: the place goes to the host
        await _until(lambda: host.places == 0, "the used place back")
        assert (0, {}) == (w._places, w._place_ips)
        got = [await w.ask_admit("192.0.2.1") for _ in range(2)]  # asked: the host decides by its own rule
        assert [None, "too many connections from 192.0.2.1"] == got
        await _until(lambda: not w._asking_places, "the ask answered")
        assert 0 == host.places  # "new" is not the host's key: no place
        for s in server.sockets:
            asyncio.get_running_loop().remove_reader(s)

    asyncio.run(main())


def test_a_grant_answered_after_the_worker_reloaded_goes_back():
    """The ask named the old mynetworks; the grant comes after the worker read its new one: straight back."""
    host = _lan_gate()
    worker = _lan_gate()

    async def main() -> None:
        server, (w,), pairs = await _workers(host, 1, lambda: worker)
        loop = asyncio.get_running_loop()
        loop.remove_reader(pairs[0][0])  # the host reads the ask only after the reload
        w._ask_places()
        await asyncio.sleep(0.01)
        worker.exempt_key = "reloaded"
        w.limits_changed()
        loop.add_reader(pairs[0][0], server.readable, pairs[0][0])
        await _until(lambda: not w._asking_places, "the ask answered")
        await _until(lambda: host.places == 0 and host.active == 0, "the grant given back")
        assert 0 == w._places
        loop.remove_reader(pairs[0][0])

    asyncio.run(main())


def test_a_recall_without_a_parked_admission_ends_and_a_late_answer_does_not_end_a_newer_one():
    """Suspected in the review: a recall that a worker never answers stayed under way for good (no place was
    granted again), and a late ``Y`` to an abandoned recall ended a newer one before the worker's answer to
    it. Now a recall ends after RECALL_WAIT_S whether or not an admission waits, and each worker's ``Y`` is
    matched to the ``X`` it answers by count."""
    from mtaq.daemon.anvil import RECALL_WAIT_S

    host = _lan_gate(reserve=8)  # 4 places ahead at most
    ours, theirs = socket.socketpair()
    server = AnvilServer(host, [ours])
    now = [0.0]
    server.clock = lambda: now[0]
    theirs.send(b"1 P 2 -\n2 L -\n")  # granted 2, then the host reads its limits again: a recall
    assert server.readable(ours)
    assert [b"1 +2", b"0 X"] == theirs.recv(100).split(b"\n")[:2]
    assert 0 < server.due() <= RECALL_WAIT_S
    theirs.send(b"3 P 1 -\n")
    assert server.readable(ours)
    assert (b"3 +0\n", 2) == (theirs.recv(100), host.places)  # no grant while calling back (room for 2 more)
    now[0] += RECALL_WAIT_S
    assert server.due() is None  # ended unanswered
    theirs.send(b"4 L -\n")  # a second recall: "0 X" again
    assert server.readable(ours)
    assert b"0 X\n" == theirs.recv(100)
    theirs.send(b"5 Y 0\n")  # the late answer to the first: the second still waits
    assert server.readable(ours)
    assert ({ours: 2}, 2) == (server._waiting, host.places)
    theirs.send(b"6 Y 2\n")  # the answer to the second
    assert server.readable(ours)
    assert ({}, None, 0, 0) == (server._waiting, server.due(), host.places, host.active)
    theirs.send(b"7 P 1 -\n")
    assert server.readable(ours)
    assert b"7 +1\n" == theirs.recv(100)  # granted again
    ours.close()
    theirs.close()


# ------------------------------------------------------------------ the third review of places ahead (stop 58)


def test_after_the_host_reloads_first_a_place_in_use_goes_back_to_the_host_not_to_the_pool():
    """Finding 1 of the third review: the host read its limits again (worker 0's ``L``) and called back the
    idle places; a place in use then went back to worker 1's pool when its connection ended, and worker 1 (not
    reloaded yet) used it, without a message, for a client the host no longer exempts, past the host's
    per-client limit of 1. Now a place in use when a recall comes goes back to the host at its end."""
    host = ConnectionGate(connections_max=20, per_client_per_minute_max=0, client_connections_max=1,
                          mynetworks_reserve=8, exempt=lambda ip: ip == "10.0.0.5", exempt_key="old")

    def old_rule() -> ConnectionGate:
        return ConnectionGate(connections_max=20, per_client_per_minute_max=0, client_connections_max=1,
                              mynetworks_reserve=8, exempt=lambda ip: ip == "10.0.0.5", exempt_key="old")

    def reconfigure() -> None:  # the host's new mynetworks leaves 10.0.0.5 out
        host.configure(connections_max=20, per_client_per_minute_max=0, client_connections_max=1,
                       mynetworks_reserve=8, exempt=lambda ip: False, auth_failures_per_minute_max=0,
                       exempt_key="new")

    async def main() -> None:
        server, (w0, w1), _pairs = await _workers(host, 2, old_rule)
        server.reconfigure = reconfigure
        assert await w1.ask_admit("10.0.0.5") is None  # asked (A), and places ahead for later
        await _until(lambda: w1._places == 4, "worker 1's places")
        assert await w1.ask_admit("10.0.0.5") is None  # from a place
        w0.reconfigure_host()
        await _until(lambda: host.exempt_key == "new" and host.places == 1, "the idle places back")
        w1.release("10.0.0.5")  # the connection on a place ends: the place goes to the host
        await _until(lambda: host.places == 0, "the used place back")
        assert (0, 1) == (w1._places, host.active)  # the admission asked for is still open
        assert await w0.ask_admit("10.0.0.5") is None  # counted per client by the host now (limit 1)
        assert "too many connections from 10.0.0.5" == await w1.ask_admit("10.0.0.5")  # asked: the host's rule
        for s in server.sockets:
            asyncio.get_running_loop().remove_reader(s)

    asyncio.run(main())


def test_a_place_freed_after_its_worker_answered_a_recall_goes_to_the_waiting_admission():
    """Finding 2 of the third review: worker 1 answered the recall (``Y 0``: its places were in use), then
    one of those connections ended and its place went to worker 1's pool without a message; once worker 3
    answered, the waiting admission was refused with a place idle. Without places that end would have been
    an ``R`` the host counts; now it is a ``G``, and the admission gets the place."""
    host = _lan_gate(connections_max=12, reserve=8)  # 4 places ahead at most
    p1, p2, p3 = (socket.socketpair() for _ in range(3))
    server = AnvilServer(host, [p1[0], p2[0], p3[0]])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for s in server.sockets:
            loop.add_reader(s, server.readable, s)
        w1, w2 = (AnvilClient(p[1], _lan_gate(connections_max=12, reserve=8), timeout_s=5) for p in (p1, p2))
        await w1.start()
        await w2.start()
        p3[1].send(b"1 P 2 -\n")  # worker 3 (the test plays it): 2 places, in use
        await _until(lambda: server._places.get(p3[0]) == 2, "worker 3's places")
        assert p3[1].recv(100) == b"1 +2\n"
        assert await w1.ask_admit("127.0.0.1") is None
        await _until(lambda: w1._places == 2, "worker 1's places")
        assert [None, None] == [await w1.ask_admit("127.0.0.1") for _ in range(2)]  # both in use
        assert [None] * 4 == [await w2.ask_admit(f"192.0.2.{i}") for i in range(4)]
        assert [None] * 3 == [await w2.ask_admit("127.0.0.1") for _ in range(3)]
        assert 12 == host.active
        waiting = asyncio.ensure_future(w2.ask_admit("127.0.0.1"))  # held back: X to workers 1 and 3
        await _until(lambda: server._y_read.get(p1[0], 0) == 1, "worker 1's Y")
        w1.release("127.0.0.1")  # after its Y: the place goes back to the host (G)
        assert 0 == w1._places
        await _until(lambda: host.places == 3, "the place back")
        assert p3[1].recv(100) == b"0 X\n"
        p3[1].send(b"2 Y 0\n")
        assert await waiting is None
        assert (12, 3) == (host.active, host.places)
        for s in server.sockets:
            loop.remove_reader(s)

    asyncio.run(main())
    for p in (p1, p2, p3):
        for s in p:
            s.close()


def test_at_capacity_with_every_place_in_use_one_recall_serves_the_refusals_after_it():
    """Finding 3 of the third review (cost): with places out but none idle, every admission refused for room
    started a recall (an ``X`` to every worker holding places, and the refusal waited for the slowest). After
    a recall no worker holds an idle place until the next grant, so later refusals are decided at once."""
    host = _lan_gate()

    async def main() -> None:
        server, (w1, w2), pairs = await _workers(host, 2)
        assert await w1.ask_admit("127.0.0.1") is None
        await _until(lambda: w1._places == 2, "worker 1's places")
        assert [None, None] == [await w1.ask_admit("127.0.0.1") for _ in range(2)]  # in use, none idle
        assert [None] * 6 == [await w2.ask_admit(f"192.0.2.{i}") for i in range(6)]
        assert await w2.ask_admit("127.0.0.1") is None
        assert 10 == host.active
        refusals = [await w2.ask_admit("127.0.0.1") for _ in range(20)]
        assert ["too many connections"] * 20 == refusals
        assert 1 == server._x_sent.get(pairs[0][0], 0)
        for s in server.sockets:
            asyncio.get_running_loop().remove_reader(s)

    asyncio.run(main())


def test_admissions_held_back_for_a_recall_are_decided_in_the_order_asked_and_no_place_is_granted_meanwhile():
    """The third review's surviving mutations: an admission that comes while others wait for a recall waits
    behind them (even if there is room by then), and no place is granted while any waits."""
    host = _lan_gate(connections_max=4, reserve=2)  # 1 place ahead at most
    w, other = socket.socketpair(), socket.socketpair()
    server = AnvilServer(host, [w[0], other[0]])
    assert b"1 +1\n" == server.answer(b"1 P 1 -", w[0])
    for i, ip in enumerate(("192.0.2.1", "127.0.0.1", "127.0.0.1"), 1):
        assert b"%d +\n" % i == server.answer(b"%d A %s" % (i, ip.encode()), other[0])
    assert 4 == host.active
    assert server.answer(b"4 A 127.0.0.1", other[0]) is None  # full: held back, X to w
    assert b"2 R 127.0.0.1" and server.answer(b"5 R 127.0.0.1", other[0]) is None  # room for one now
    assert server.answer(b"6 A 127.0.0.1", other[0]) is None  # behind the one waiting
    assert b"7 +0\n" == server.answer(b"7 P 1 -", other[0])  # nothing granted while admissions wait
    assert b"" == bytes(server._out[other[0]])
    assert server.answer(b"2 Y 1", w[0]) is None  # w's idle place back: both decided, in order
    assert b"4 +\n6 +\n" == bytes(server._out[other[0]])
    assert (4, 0) == (host.active, host.places)
    for p in (w, other):
        for s in p:
            s.close()


_WORKERS_CHILD = r"""
import socket, sys, time
w1, w2, w3 = (socket.socket(fileno=int(fd)) for fd in sys.argv[1:4])
def rd(s, want):
    s.settimeout(5)
    buf = b""
    while want not in buf:
        buf += s.recv(4096)
    return buf
w1.send(b"1 P 2 -\n")
print("w1", rd(w1, b"\n"), flush=True)  # 2 places; it never answers a recall
for i in range(8):
    w2.send(f"{i + 1} A 192.0.2.{i}\n".encode() if i < 6 else f"{i + 1} A 127.0.0.1\n".encode())
rd(w2, b"8 ")
t = time.monotonic()
w2.send(b"20 A 127.0.0.1\n")  # full with places out: held back, X to w1
w3.send(b"1 A 127.0.0.1\n")  # held back behind it
print("w2", rd(w2, b"20 "), round(time.monotonic() - t, 3), flush=True)
print("w3", rd(w3, b"1 "), flush=True)
print("x", rd(w1, b"0 X\n").count(b"0 X"), flush=True)
w1.close()  # the place-holder goes: its places come back
time.sleep(0.1)
w3.send(b"2 R 127.0.0.1\n3 Q\n")  # a release, then a line that is not the wire: w3 is cut off
time.sleep(0.1)
w2.send(b"21 A 127.0.0.1\n")
print("w2", rd(w2, b"21 "), flush=True)
"""


def test_wait_serving_ends_an_unanswered_recall_and_survives_workers_that_go():
    """The supervisor's real loop (``wait_serving``) serving a child process that plays three workers: an
    admission held back for a recall that the place-holder never answers is decided after RECALL_WAIT_S (no
    room: refused, in order with the one behind it); the place-holder closing and another worker breaking the
    wire raise nothing; nothing stays counted once every worker is gone."""
    import subprocess
    import sys

    from mtaq.daemon.anvil import RECALL_WAIT_S, wait_serving

    host = _lan_gate()
    pairs = [socket.socketpair() for _ in range(3)]
    child = subprocess.Popen([sys.executable, "-c", _WORKERS_CHILD, *(str(b.fileno()) for _a, b in pairs)],
                             pass_fds=[b.fileno() for _a, b in pairs], stdout=subprocess.PIPE, text=True)
    for _a, b in pairs:
        b.close()
    server = AnvilServer(host, [a for a, _b in pairs])
    pid, status = wait_serving(server, [child.pid])
    out = child.stdout.read().splitlines() if child.stdout else []
    child.stdout.close()
    assert (child.pid, 0) == (pid, status), out
    assert "w1 b'1 +2\\n'" == out[0]
    w2, waited = out[1].rsplit(" ", 1)
    assert "w2 b'20 -too many connections\\n'" == w2 and float(waited) >= RECALL_WAIT_S, out
    assert ["w3 b'1 -too many connections\\n'", "x 1", "w2 b'21 +\\n'"] == out[2:], out
    assert pairs[0][0] not in server.sockets and pairs[2][0] not in server.sockets
    for s in server.sockets:  # w2, unless its end was read before the child's exit was seen
        server.close(s)
    assert (0, 0, 0) == (host.active, host.active_outside, host.places)  # nothing counted that nobody holds


def test_an_admission_at_capacity_during_a_recall_for_a_reload_waits_for_the_answers():
    """The fourth review: a recall started by ``L`` (the host read its limits again) held no admission back,
    so one that came at capacity before the workers answered was refused at once, though their idle places
    were on their way back. An admission at capacity now waits whenever a recall is under way."""
    host = _lan_gate(reserve=8)  # 4 places ahead at most
    w0, w1 = socket.socketpair(), socket.socketpair()
    server = AnvilServer(host, [w0[0], w1[0]])
    assert b"1 +2\n" == server.answer(b"1 P 2 -", w1[0])  # 2 places idle in worker 1
    for i in range(1, 9):
        assert b"%d +\n" % i == server.answer(b"%d A 127.0.0.1" % i, w0[0])
    assert 10 == host.active
    assert server.answer(b"20 L -", w0[0]) is None  # a recall: X to worker 1
    assert b"0 X\n" in bytes(server._out[w1[0]])
    assert server.answer(b"21 A 127.0.0.1", w0[0]) is None  # held back, not refused
    assert server.answer(b"2 Y 2", w1[0]) is None
    assert b"21 +\n" == bytes(server._out[w0[0]])
    assert (9, 0) == (host.active, host.places)
    for p in (w0, w1):
        for s in p:
            s.close()
