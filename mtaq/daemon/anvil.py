"""One set of per-client counters for the whole host: the supervisor is the anvil of its workers.

With ``workers`` > 1 every worker process accepts SMTP connections from the same sockets, so a gate in each
worker would let one client IP open ``client_connections_max`` connections *per worker*, connect
``connections_per_client_per_minute_max`` times a minute per worker and fail AUTH
``auth_failures_per_minute_max`` times per worker. As Postfix's smtpd processes ask the ``anvil`` service,
mtaq's workers ask the supervisor: it holds the one :class:`~mtaq.edge.limits.ConnectionGate` of the host
(``connections_max`` too), and each worker talks to it over its own socketpair, made before the fork.

The wire is one line per message, ``ID OP IP`` (ASCII, LF-terminated); ``OP`` is ``A`` admit, ``R`` release,
``F`` AUTH failed, ``B`` AUTH check begins, ``E`` AUTH check ended, ``Q`` AUTH blocked? ``L`` read the limits
again (``mtaq reload``: ``IP`` is ``-``; worker 0 sends it once it has reloaded), ``P`` places ahead (``IP`` is
``N KEY``: a count N, 1 to :data:`PLACES_MAX`, and the worker's mynetworks key,
:meth:`~mtaq.edge.policy.EdgePolicy.mynetworks_key`, ``-`` for none), ``G`` give places back and ``Y`` the
answer to a recall (``IP`` is a count, 0 allowed for ``Y``). ``A``, ``B`` and ``Q`` are answered ``ID +``
(admitted / yes) or ``ID -REASON`` (``ID -`` for no), ``P`` with ``ID +K`` (K of the N places granted, 0
included); the others are not answered. The supervisor sends one message unasked: ``0 X``, give back your
idle places (a worker answers every ``X`` with one ``ID Y N``, in order, naming all of them: so the host
matches each ``Y`` to its ``X`` by counting). A worker's messages are handled in the order sent (one stream),
so a failure told before the end of its check is always counted first; a worker reads the host's lines in
order too (a grant read with a recall after it is in the pool that the ``Y`` gives back).

Places ahead: a connection of a client in mynetworks is limited by ``connections_max`` alone (no per-client
limit, no rate), so the anvil may admit such connections before they come
(:meth:`~mtaq.edge.limits.ConnectionGate.admit_ahead`): a worker asks for :data:`PLACES_ASK` at a time and
admits its mynetworks clients from them without a round trip (side by side with 2 workers on a 2-core VM:
6-15 % less CPU a message at 20 sessions, the greeting 0.27-0.33 ms sooner at one; docs/performance.md,
stop 58); a connection's end puts its place back in the worker's pool, and the pool above :data:`PLACES_KEEP` is
given back. The host counts a place from its grant to its return (at most ``mynetworks_reserve // 2`` out,
kept apart from its per-address counts), so ``connections_max`` holds exactly. Places are granted only to a
worker whose mynetworks key is the host's (a worker that reloaded before the host, or a host whose reload
failed, asks for every client as before), and the host calls back the idle ones (``0 X``) when it reads its
limits again and before it refuses an admission for want of room (if a place was granted since the last
recall, or a recall is under way: after one, no worker holds an idle place until the next grant): such an admission is decided once
every worker holding places has answered, or after :data:`RECALL_WAIT_S`, in the order asked; no place is
granted meanwhile, and a recall ends after :data:`RECALL_WAIT_S` whether or not an admission waits. A
worker answering a recall gives back its idle places at once and those in use as their connections end
(``G``, as a release would be without places), so a place freed while the host waits is counted. So idle places
never make the host refuse a client it would have admitted without them (unless a worker does not answer
in :data:`RECALL_WAIT_S`). A recall only queues its messages: they are sent once the lines read from the
worker being served are all counted, so a send that fails (and closes that worker's socket, giving back what
it held) never cuts a worker's lines in two. Lines from a socket already closed count for nothing.

What must always hold:

* a worker never waits on the anvil for more than :data:`ANVIL_TIMEOUT_S` for one answer, and never blocks its
  event loop on it: when the supervisor is slow or gone, the worker decides with its own gate (the same
  limits, counted per worker: the behaviour before the anvil, never no limit), logs ``anvil_unavailable``
  and goes on; a late ``+`` to an admission or a check it no longer waits for is given back at once, as is
  a ``+`` set just before the asking task was cancelled (its connection ended), so the host's counters
  never keep a place nobody holds;
* the supervisor counts what each worker holds: a release or an end that worker holds nothing for is
  ignored, and what it holds is given back when its socket is closed (each place is given back once);
* a place granted ahead is held by exactly one worker until given back: used by one connection at a time,
  returned to that worker's pool when the connection ends, given back to the host with ``G``, ``Y`` or when
  the worker's socket closes (never more than that worker holds); a worker whose anvil is gone uses no place
  (the host gave them back); a worker uses a place only for a client its own mynetworks exempts, and holds
  places only while its mynetworks key was the host's when they were granted: a reload of the worker gives
  the idle ones back at once and the used ones as their connections end (a grant asked for under the old
  key goes back as it comes); a reload of the host calls back the idle ones, and places in use return to
  their workers' pools until those workers reload too (the window of any reload: each process decides
  with its own rules until it has read the new ones);
* the supervisor never blocks on a worker: its sockets are non-blocking, what a worker does not read is
  buffered (at most :data:`OUT_BUFFER_MAX` bytes, then that worker's socket is closed and it falls back).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import socket
import time
from collections.abc import Callable, Iterable

from mtaq.edge.limits import ConnectionGate
from mtaq.logs import get_logger

__all__ = ["ANVIL_TIMEOUT_S", "OUT_BUFFER_MAX", "PLACES_ASK", "PLACES_KEEP", "PLACES_MAX", "AnvilClient",
           "AnvilServer", "wait_serving"]

ANVIL_TIMEOUT_S = 0.5
"""Seconds a worker waits for one answer of the anvil before it decides with its own gate."""
OUT_BUFFER_MAX = 1 << 20
"""Bytes of answers the supervisor keeps for a worker that does not read them (then it closes that socket)."""
PLACES_ASK = 4
"""Places ahead a worker asks for when its pool runs low (its mynetworks clients then need no round trip)."""
PLACES_KEEP = 8
"""Idle places a worker keeps; above this it gives back all but :data:`PLACES_ASK`."""
PLACES_MAX = 64
"""The most places one ``P`` or ``G`` message may name (a larger count is not the wire)."""
RECALL_WAIT_S = 0.2
"""Seconds an admission waits, at the most, while the host calls back the idle places ahead (then decided)."""
_PLACES_RETRY_S = 1.0  # after a "P" answered +0, or a recall, the seconds before a worker asks again
IN_LINE_MAX = 4096  # a line longer than this is not the wire: the socket is closed
_SLOW_LOG_EVERY_S = 60.0


class AnvilServer:
    """The supervisor's side: answers the workers' messages from one :class:`ConnectionGate`."""

    def __init__(self, gate: ConnectionGate, socks: Iterable[socket.socket],
                 reconfigure: Callable[[], None] | None = None) -> None:
        self.gate = gate
        self.reconfigure = reconfigure
        self._in: dict[socket.socket, bytearray] = {}
        self._out: dict[socket.socket, bytearray] = {}
        # What each worker holds (admissions and AUTH checks answered "+", not yet released / ended), per IP:
        # given back when its socket is closed, so a worker cut off keeps no place in the host's gate.
        self._held: dict[socket.socket, dict[str, int]] = {}
        self._checks: dict[socket.socket, dict[str, int]] = {}
        # Places ahead granted to each worker and not given back (used by a connection or idle in its pool).
        self._places: dict[socket.socket, int] = {}
        # Recalls ("0 X"): each worker answers every X with one Y, in order, so the X's sent to a worker and
        # the Y's read from it, both counted from the start, say which recall a Y answers. A recall waits for
        # each worker it asked until that worker's Y count reaches ``_waiting[w]`` (or until ``_recall_until``).
        self._x_sent: dict[socket.socket, int] = {}
        self._y_read: dict[socket.socket, int] = {}
        self._waiting: dict[socket.socket, int] = {}
        self._recall_until: float | None = None  # monotonic deadline of the recall under way (None: none)
        self._parked: list[tuple[socket.socket, str, str]] = []  # (socket, ident, ip) of the A's it holds back
        # Whether a worker may hold idle places: set by a grant and by a recall that ended before every worker
        # answered; cleared when a recall starts (each worker answering it gives back its idle places and
        # returns the used ones as their connections end, so none is idle until the next grant).
        self._maybe_idle = False
        self._dirty: set[socket.socket] = set()  # other workers' sockets given output while one was read
        self.clock = time.monotonic
        for s in socks:
            s.setblocking(False)
            self._in[s] = bytearray()
            self._out[s] = bytearray()
            self._held[s] = {}
            self._checks[s] = {}

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._in)

    def answer(self, line: bytes, s: socket.socket | None = None) -> bytes | None:
        """The answer to one message (without its LF) from the worker on ``s``, or None when it needs none.
        Raises ValueError when it is not the wire. A release (``R``) or an end (``E``) the worker on ``s``
        holds nothing for is ignored: each place is given back once."""
        ident, op, ip = line.decode("ascii").split(" ", 2)
        if s is not None and s not in self._in:
            return None  # a socket closed already (what it held is given back): nothing it says counts
        g = self.gate
        held = self._held.get(s) if s is not None else None
        checks = self._checks.get(s) if s is not None else None
        if op == "A":
            if s is not None and (self._parked or (g.active >= g.connections_max and any(self._places.values())
                                                   and (self._maybe_idle or self._recall_until is not None))):
                # No room while places may sit idle in the workers' pools: call them back, and decide this
                # admission when they are back (or after RECALL_WAIT_S), in the order asked.
                self._parked.append((s, ident, ip))
                if self._recall_until is None:
                    self._recall()
                return None
            return self._admit(s, ident, ip)
        if op == "B":
            ok = g.auth_begin(ip)
            if ok and checks is not None:
                checks[ip] = checks.get(ip, 0) + 1
            return f"{ident} {'+' if ok else '-'}\n".encode()
        if op == "Q":
            return f"{ident} {'+' if g.auth_blocked(ip) else '-'}\n".encode()
        if op == "P":
            count, _, key = ip.partition(" ")
            n = _count(count)
            k = 0
            # Only to a worker that exempts the clients this gate exempts (the same mynetworks: a worker that
            # reloaded before the host, or a host whose reload failed, gets none), and never while calling back.
            if s is not None and key == (g.exempt_key or "-") and self._recall_until is None and not self._parked:
                k = g.admit_ahead(n)
                self._places[s] = self._places.get(s, 0) + k
                self._maybe_idle = self._maybe_idle or k > 0
            return f"{ident} +{k}\n".encode()
        if op in ("G", "Y"):
            n = _count(ip, zero=op == "Y")  # Y: the answer to a recall, the whole idle pool (0 or more)
            if s is not None:
                n = min(n, self._places.get(s, 0))
                if n:
                    self._places[s] -= n
                    g.release_ahead(n)
                if op == "Y":
                    self._y_read[s] = self._y_read.get(s, 0) + 1
                    if s in self._waiting and self._y_read[s] >= self._waiting[s]:
                        del self._waiting[s]
                        if not self._waiting:
                            self._end_recall()
            return None
        if op == "R":
            if held is None or _take(held, ip):
                g.release(ip)
        elif op == "F":
            g.auth_failed(ip)
        elif op == "E":
            if checks is None or _take(checks, ip):
                g.auth_end(ip)
        elif op == "L":
            if self.reconfigure is not None:
                self.reconfigure()
            if self._recall_until is None:
                self._recall()  # idle places were granted under the old mynetworks: back, and asked again
        else:
            raise ValueError(f"unknown anvil message {op!r}")
        return None

    def _admit(self, s: socket.socket | None, ident: str, ip: str) -> bytes:
        held = self._held.get(s) if s is not None else None
        refusal = self.gate.admit(ip)
        if refusal is None and held is not None:
            held[ip] = held.get(ip, 0) + 1
        return f"{ident} +\n".encode() if refusal is None else f"{ident} -{refusal}\n".encode("ascii", "replace")

    def _recall(self) -> None:
        """Ask every worker holding places ahead for its idle ones (``0 X``; each answers ``Y N``), and wait
        for the answers (or :data:`RECALL_WAIT_S`). Only queues the messages (they go out when the sockets
        are writable): nothing here closes a socket."""
        self._maybe_idle = False
        for w, n in self._places.items():
            if n and w in self._out:
                self._out[w] += b"0 X\n"
                self._dirty.add(w)
                self._x_sent[w] = self._x_sent.get(w, 0) + 1
                self._waiting[w] = self._x_sent[w]
        if self._waiting:
            self._recall_until = self.clock() + RECALL_WAIT_S
        else:
            self._end_recall()

    def _end_recall(self) -> None:
        """The recall is over (every worker asked answered, closed, or the time is up): answer the admissions
        held back for it, in the order they came (queued only, as in :meth:`_recall`)."""
        self._waiting.clear()
        self._recall_until = None
        parked, self._parked = self._parked, []
        for s, ident, ip in parked:
            if s in self._out:
                self._out[s] += self._admit(s, ident, ip)
                self._dirty.add(s)

    def due(self) -> float | None:
        """Seconds until the recall under way must end, after ending it if that time has come (a worker that
        does not answer a recall in RECALL_WAIT_S is not waited for); None when no recall is under way."""
        if self._recall_until is None:
            return None
        left = self._recall_until - self.clock()
        if left > 0:
            return left
        self._maybe_idle = True  # a worker that did not answer may still hold idle places
        self._end_recall()
        self.flush()
        return None

    def flush(self) -> None:
        """Send what a recall queued for other workers than the one being read (each only once no loop over
        its lines is running, so a socket that a failed send closes is never read on)."""
        while self._dirty:
            self.writable(self._dirty.pop())

    def readable(self, s: socket.socket) -> bool:
        """Read and answer what ``s`` has; False when it is closed (the worker is gone or broke the wire)."""
        buf = self._in.get(s)
        if buf is None:
            return False
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self.close(s)
            return False
        buf += data
        out = self._out[s]
        try:
            while (nl := buf.find(b"\n")) >= 0:
                reply = self.answer(bytes(buf[:nl]), s)
                del buf[: nl + 1]
                if reply is not None:
                    out += reply
            if len(buf) > IN_LINE_MAX:
                raise ValueError("line too long")
        except (ValueError, UnicodeDecodeError):
            self.close(s)
            self.flush()
            return False
        self._dirty.discard(s)
        ok = self.writable(s)
        self.flush()
        return ok

    def writable(self, s: socket.socket) -> bool:
        """Send what is buffered for ``s``; False when it was closed."""
        out = self._out.get(s)
        if out is None:
            return False
        while out:
            try:
                n = s.send(out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close(s)
                return False
            del out[:n]
        if len(out) > OUT_BUFFER_MAX:
            self.close(s)
            return False
        return True

    def wants_write(self, s: socket.socket) -> bool:
        return bool(self._out.get(s))

    def close(self, s: socket.socket) -> None:
        """Close the socket of a worker (gone, or it broke the wire), and give back what that worker held:
        it now decides alone (:class:`AnvilClient` falls back), and never releases those places here."""
        self._in.pop(s, None)
        self._out.pop(s, None)
        self.gate.release_ahead(self._places.pop(s, 0))
        self._parked = [p for p in self._parked if p[0] is not s]
        self._x_sent.pop(s, None)
        self._y_read.pop(s, None)
        for ip, n in self._held.pop(s, {}).items():
            for _ in range(n):
                self.gate.release(ip)
        for ip, n in self._checks.pop(s, {}).items():
            for _ in range(n):
                self.gate.auth_end(ip)
        with contextlib.suppress(OSError):
            s.close()
        if s in self._waiting:
            del self._waiting[s]
            if not self._waiting:
                self._end_recall()


def _count(text: str, *, zero: bool = False) -> int:
    """The count of a ``P``, ``G`` or ``Y`` message: 1 (0 with ``zero``) to PLACES_MAX; ValueError otherwise
    (not the wire)."""
    if not text.isascii() or not text.isdigit() or not (0 if zero else 1) <= int(text) <= PLACES_MAX:
        raise ValueError(f"not a count of places: {text!r}")
    return int(text)


def _take(counts: dict[str, int], key: str) -> bool:
    """Take one from ``counts[key]``; False when it held none."""
    left = counts.get(key, 0)
    if not left:
        return False
    if left > 1:
        counts[key] = left - 1
    else:
        del counts[key]
    return True


def wait_serving(server: AnvilServer | None, pids: Iterable[int]) -> tuple[int, int]:
    """``os.wait()`` that answers the anvil's messages meanwhile: the pid and wait status of the first child
    of this process that ends. Child exits are seen through pidfds (``os.pidfd_open``, Linux 5.3), else by
    polling every 0.1 s. Raises ChildProcessError when there is no child."""
    if server is None or not server.sockets:
        return os.wait()
    sel = selectors.DefaultSelector()
    pidfds: list[int] = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                break
            pidfds.append(fd)
            sel.register(fd, selectors.EVENT_READ, None)
        polling = len(pidfds) == 0
        registered: dict[socket.socket, int] = {}
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                return pid, status
            wait = server.due()  # first: ending a recall queues answers, which need write interest below
            live = server.sockets
            for s in live:
                want = selectors.EVENT_READ | (selectors.EVENT_WRITE if server.wants_write(s) else 0)
                if registered.get(s) != want:
                    if s in registered:
                        sel.modify(s, want, s)
                    else:
                        sel.register(s, want, s)
                    registered[s] = want
            for s in registered.keys() - set(live):  # closed while another was read
                sel.unregister(s)
                del registered[s]
            if polling:
                wait = 0.1 if wait is None else min(wait, 0.1)
            for key, events in sel.select(wait):
                s = key.data
                if s is None:
                    continue  # a pidfd: the waitpid above sees it
                ok = True
                if events & selectors.EVENT_READ:
                    ok = server.readable(s)
                if ok and events & selectors.EVENT_WRITE:
                    ok = server.writable(s)
                if not ok:
                    sel.unregister(s)
                    registered.pop(s, None)
    finally:
        sel.close()
        for fd in pidfds:
            os.close(fd)


class AnvilClient:
    """A worker's side: the :class:`~mtaq.edge.limits.Gate` of the host, asked over ``sock``; ``fallback`` (a
    gate of this worker with the same limits) decides when the anvil does not answer in ``timeout_s``."""

    def __init__(self, sock: socket.socket, fallback: ConnectionGate, *, timeout_s: float = ANVIL_TIMEOUT_S) -> None:
        self.sock = sock
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.log = get_logger()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._next = 0
        self._pending: dict[int, tuple[str, str, asyncio.Future[str]]] = {}
        self._local: dict[str, int] = {}  # connections admitted by the fallback, per IP (released there)
        self._local_checks: dict[str, int] = {}  # AUTH checks begun in the fallback, per IP
        self._down = False
        self._slow_logged = -_SLOW_LOG_EVERY_S
        self._places = 0  # idle places ahead held for this worker's mynetworks clients (the host counts them)
        self._place_ips: dict[str, int] = {}  # connections admitted from a place, per IP
        # Connections admitted from places granted under mynetworks as it was before this worker's last reload:
        # their places go back to the host (G) when they end, not to the pool.
        self._stale_place_ips: dict[str, int] = {}
        self._asking_places = 0  # the ID of the "P" not yet answered (0: none)
        self._asking_key = ""  # the mynetworks key that P named
        self._places_again = 0.0  # monotonic time before which no "P" is sent (the last got +0)

    async def start(self) -> None:
        """Connect the stream; call once in the worker's event loop."""
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                ident, _, answer = line.decode("ascii", "replace").rstrip("\n").partition(" ")
                if ident == "0":  # from the host, unasked: "X", give back the idle places
                    if answer == "X":
                        self._give_back_places("Y")
                        self._stale_places_in_use()  # and those in use as their connections end
                    continue
                if self._asking_places and int(ident) == self._asking_places:
                    # taken here, before the next line: an "X" read with it in one go recalls these places too
                    self._got_places(answer)
                    continue
                entry = self._pending.pop(int(ident), None)
                if entry is None:
                    continue
                op, ip, fut = entry
                if not fut.done():
                    fut.set_result(answer)
                elif answer == "+":  # nobody waits for it any more (timed out, or the connection went): give it back
                    self._give_back(op, ip)
        except (OSError, ValueError) as exc:
            self._gone(f"{type(exc).__name__}: {exc}")
            return
        self._gone("the supervisor closed the anvil socket")

    def _gone(self, why: str) -> None:
        if not self._down:
            self._down = True
            self.log.error("anvil_unavailable", error=why, action="per-client limits counted in this worker only")
            # The host gives back what this worker held (its places too) once the socket is closed.
            self._places = 0
            self._asking_places = 0
            if self._writer is not None:
                self._writer.close()
        for _op, _ip, fut in self._pending.values():
            if not fut.done():
                fut.set_result("?")
        self._pending.clear()

    def _send(self, op: str, ip: str) -> int:
        self._next += 1
        if self._down or self._writer is None or self._writer.is_closing():
            return 0
        self._writer.write(f"{self._next} {op} {ip}\n".encode("ascii", "replace"))
        return self._next

    async def _ask(self, op: str, ip: str) -> str:
        """The anvil's answer (``+``, ``-...``) or ``?`` when it could not be had in time."""
        ident = self._send(op, ip)
        if not ident:
            return "?"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        self._pending[ident] = (op, ip, fut)
        timer = loop.call_later(self.timeout_s, self._expire, fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled (the client's connection ended) after the answer was set but before this task woke up
            # to take it: the future holds "+", the entry is gone, so neither _read nor the caller would give
            # it back. (Cancelled while still waiting, the future is cancelled and _read gives a late "+" back.)
            if fut.done() and not fut.cancelled() and fut.result() == "+":
                self._give_back(op, ip)
            raise
        finally:
            timer.cancel()

    def _give_back(self, op: str, ip: str) -> None:
        """Undo a ``+`` nobody takes: an admission (``A``) is released, an AUTH check (``B``) ended."""
        if op == "A":
            self._send("R", ip)
        elif op == "B":
            self._send("E", ip)

    def _expire(self, fut: asyncio.Future[str]) -> None:
        if fut.done():
            return
        fut.set_result("?")  # the entry stays: a late "+" is given back
        now = time.monotonic()
        if now - self._slow_logged >= _SLOW_LOG_EVERY_S:
            self._slow_logged = now
            self.log.warning("anvil_unavailable", error=f"no answer in {self.timeout_s} s",
                             action="decided by this worker's own counters")

    def _ask_places(self) -> None:
        """Ask the host for places ahead (no wait: the answer fills the pool when it comes, read in order with
        the host's other messages)."""
        if self._asking_places or self._down or time.monotonic() < self._places_again:
            return
        key = self.fallback.exempt_key or "-"
        ident = self._send("P", f"{max(1, PLACES_ASK - self._places)} {key}")
        if ident:
            self._asking_places, self._asking_key = ident, key

    def _got_places(self, answer: str) -> None:
        """The host's answer to the "P" (``+K``): K places into the pool, or straight back (G) when this
        worker's mynetworks changed since it asked (they were granted under the old one)."""
        self._asking_places = 0
        granted = int(answer[1:]) if answer[:1] == "+" and answer[1:].isdigit() else 0
        if granted and self._asking_key != (self.fallback.exempt_key or "-"):
            self._send("G", str(min(granted, PLACES_MAX)))
            granted = 0
        self._places += granted
        if not granted:
            self._places_again = time.monotonic() + _PLACES_RETRY_S

    def _give_back_places(self, op: str) -> None:
        """Give the idle places back: ``Y`` (the answer to the host's recall, sent even for none) or ``G``;
        none is asked for again before _PLACES_RETRY_S."""
        n, self._places = self._places, 0
        self._places_again = time.monotonic() + _PLACES_RETRY_S
        while n > PLACES_MAX:  # more than one message may name (never in practice: a pool stays near PLACES_KEEP)
            self._send("G", str(PLACES_MAX))
            n -= PLACES_MAX
        if op == "Y" or n:
            self._send(op, str(n))

    def limits_changed(self) -> None:
        """This worker's limits were read again (a reload): its places, granted under its old mynetworks, go
        back, the idle ones now and those in use as their connections end; the next ask names the new one."""
        self._give_back_places("G")
        self._stale_places_in_use()

    def _stale_places_in_use(self) -> None:
        """The places now used by connections go back to the host (G) as those connections end, not to the
        pool: after a recall (the host is full, or read its limits again: a pool refilled without a message
        would hide a place the host is waiting for) and after this worker's reload."""
        for ip, n in self._place_ips.items():
            self._stale_place_ips[ip] = self._stale_place_ips.get(ip, 0) + n
        self._place_ips.clear()

    # ------------------------------------------------------------------------------------- Gate interface
    async def ask_admit(self, ip: str) -> str | None:
        if self.fallback.exempt(ip) and not self._down:
            if self._places:  # a place ahead: no round trip (the host counted it when it granted it)
                self._places -= 1
                self._place_ips[ip] = self._place_ips.get(ip, 0) + 1
                if self._places < 2:
                    self._ask_places()
                return None
            self._ask_places()
        answer = await self._ask("A", ip)
        if answer == "?":
            refusal = self.fallback.admit(ip)
            if refusal is None:
                self._local[ip] = self._local.get(ip, 0) + 1
            return refusal
        return None if answer == "+" else answer[1:] or "too many connections"

    def release(self, ip: str | None = None) -> None:
        key = ip or ""
        left = self._local.get(key, 0)
        if left:  # admitted by this worker's own gate (the anvil was slow): first, so no place is freed early
            if left > 1:
                self._local[key] = left - 1
            else:
                del self._local[key]
            self.fallback.release(ip)
            return
        if _take(self._stale_place_ips, key):  # granted under mynetworks as it was: back to the host
            self._send("G", "1")
            return
        if _take(self._place_ips, key):  # back to the pool (gone with the anvil: the host gave it back)
            if not self._down:
                self._places += 1
                if self._places > PLACES_KEEP:
                    extra = self._places - PLACES_ASK
                    self._places = PLACES_ASK
                    self._send("G", str(extra))
            return
        self._send("R", key)

    async def ask_auth_blocked(self, ip: str) -> bool:
        answer = await self._ask("Q", ip)
        return self.fallback.auth_blocked(ip) if answer == "?" else answer == "+"

    async def ask_auth_begin(self, ip: str) -> bool:
        answer = await self._ask("B", ip)
        if answer == "?":
            ok = self.fallback.auth_begin(ip)
            if ok:
                self._local_checks[ip] = self._local_checks.get(ip, 0) + 1
            return ok
        return answer == "+"

    def auth_end(self, ip: str) -> None:
        left = self._local_checks.get(ip, 0)
        if left:
            if left > 1:
                self._local_checks[ip] = left - 1
            else:
                del self._local_checks[ip]
            self.fallback.auth_end(ip)
            return
        self._send("E", ip)

    def auth_failed(self, ip: str) -> None:
        self.fallback.auth_failed(ip)  # also here: should the anvil go, this worker still remembers
        self._send("F", ip)

    def reconfigure_host(self) -> None:
        """Ask the supervisor to read the host's limits again (after this worker reloaded)."""
        self._send("L", "-")
