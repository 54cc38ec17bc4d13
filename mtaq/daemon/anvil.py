"""One set of per-client counters for the whole host: the supervisor is the anvil of its workers.

With ``workers`` > 1 every worker process accepts SMTP connections from the same sockets, so a gate in each
worker would let one client IP open ``client_connections_max`` connections *per worker*, connect
``connections_per_client_per_minute_max`` times a minute per worker and fail AUTH
``auth_failures_per_minute_max`` times per worker. As Postfix's smtpd processes ask the ``anvil`` service,
mtaq's workers ask the supervisor: it holds the one :class:`~mtaq.edge.limits.ConnectionGate` of the host
(``connections_max`` too), and each worker talks to it over its own socketpair, made before the fork.

The wire is one line per message, ``ID OP IP`` (ASCII, LF-terminated); ``OP`` is ``A`` admit, ``R`` release,
``F`` AUTH failed, ``B`` AUTH check begins, ``E`` AUTH check ended, ``Q`` AUTH blocked? ``L`` read the limits
again (``mtaq reload``: ``IP`` is ``-``; worker 0 sends it once it has reloaded). ``A``, ``B`` and ``Q``
are answered ``ID +`` (admitted / yes) or ``ID -REASON`` (``ID -`` for no); the others are not answered.
A worker's messages are handled in the order sent (one stream), so a failure told before the end of its
check is always counted first.

What must always hold:

* a worker never waits on the anvil for more than :data:`ANVIL_TIMEOUT_S` for one answer, and never blocks its
  event loop on it: when the supervisor is slow or gone, the worker decides with its own gate (the same
  limits, counted per worker: the behaviour before the anvil, never no limit), logs ``anvil_unavailable``
  and goes on; a late ``+`` to an admission or a check it no longer waits for is given back at once, as is
  a ``+`` set just before the asking task was cancelled (its connection ended), so the host's counters
  never keep a place nobody holds;
* the supervisor counts what each worker holds: a release or an end that worker holds nothing for is
  ignored, and what it holds is given back when its socket is closed (each place is given back once);
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

__all__ = ["ANVIL_TIMEOUT_S", "OUT_BUFFER_MAX", "AnvilClient", "AnvilServer", "wait_serving"]

ANVIL_TIMEOUT_S = 0.5
"""Seconds a worker waits for one answer of the anvil before it decides with its own gate."""
OUT_BUFFER_MAX = 1 << 20
"""Bytes of answers the supervisor keeps for a worker that does not read them (then it closes that socket)."""
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
        g = self.gate
        held = self._held.get(s) if s is not None else None
        checks = self._checks.get(s) if s is not None else None
        if op == "A":
            refusal = g.admit(ip)
            if refusal is None and held is not None:
                held[ip] = held.get(ip, 0) + 1
            return f"{ident} +\n".encode() if refusal is None else f"{ident} -{refusal}\n".encode("ascii", "replace")
        if op == "B":
            ok = g.auth_begin(ip)
            if ok and checks is not None:
                checks[ip] = checks.get(ip, 0) + 1
            return f"{ident} {'+' if ok else '-'}\n".encode()
        if op == "Q":
            return f"{ident} {'+' if g.auth_blocked(ip) else '-'}\n".encode()
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
        else:
            raise ValueError(f"unknown anvil message {op!r}")
        return None

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
            return False
        return self.writable(s)

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
        for ip, n in self._held.pop(s, {}).items():
            for _ in range(n):
                self.gate.release(ip)
        for ip, n in self._checks.pop(s, {}).items():
            for _ in range(n):
                self.gate.auth_end(ip)
        with contextlib.suppress(OSError):
            s.close()


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
            for s in server.sockets:
                want = selectors.EVENT_READ | (selectors.EVENT_WRITE if server.wants_write(s) else 0)
                if registered.get(s) != want:
                    if s in registered:
                        sel.modify(s, want, s)
                    else:
                        sel.register(s, want, s)
                    registered[s] = want
            for key, events in sel.select(0.1 if polling else None):
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

    async def start(self) -> None:
        """Connect the stream; call once in the worker's event loop."""
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                ident, _, answer = line.decode("ascii", "replace").rstrip("\n").partition(" ")
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

    # ------------------------------------------------------------------------------------- Gate interface
    async def ask_admit(self, ip: str) -> str | None:
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
        if left:
            if left > 1:
                self._local[key] = left - 1
            else:
                del self._local[key]
            self.fallback.release(ip)
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
