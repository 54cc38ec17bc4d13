"""Admission of SMTP connections: how many at once, and how often one client may connect.

One :class:`ConnectionGate` is shared by every connection of the daemon's listeners. At connect, :meth:`admit` either
admits the client (the caller must :meth:`release` once the connection is gone) or gives the reason it is
refused; the server then answers ``421 4.7.0`` and closes (RFC 5321 §3.8: 421 is the reply of a server
that closes the channel). Like Postfix's anvil, the per-client rate counts the connections a client IP
opened in the last 60 seconds (refused ones too, so hammering does not pay), and clients in ``mynetworks``
are exempt from it (Postfix ``smtpd_client_event_limit_exceptions = $mynetworks``).

Concurrency: at most ``connections_max`` connections in all; at most ``client_connections_max`` at once
from one client IP (Postfix ``smtpd_client_connection_count_limit``; ``mynetworks`` exempt); and the last
``mynetworks_reserve`` places are kept for clients in ``mynetworks``, so that clients outside it, however
many connections they open, can never lock out the local network.

The gate also counts failed AUTH attempts per client IP in the same 60-second window
(:meth:`auth_failed`, :meth:`auth_blocked`): over ``auth_failures_per_minute_max`` the server refuses AUTH
from that client for a while, whichever connection it comes on.

Must always hold: ``active`` equals the admitted connections not yet released, and never exceeds
``connections_max``; ``active`` minus the admitted mynetworks connections never exceeds
``connections_max - mynetworks_reserve``; the memory per client is bounded by its limit. A reload
(:meth:`ConnectionGate.configure`) that lowers a limit ends no connection: new ones are refused until
enough of those admitted before it have ended.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["RATE_WINDOW_S", "ConnectionGate", "Gate"]

RATE_WINDOW_S = 60.0
"""The window of the per-client connection rate and of the AUTH failure rate (seconds)."""


class Gate(Protocol):
    """What the SMTP server needs of an admission: a :class:`ConnectionGate` in this process, or the host's
    (:class:`mtaq.daemon.anvil.AnvilClient`, one gate for every worker process, as Postfix's anvil). The
    ``ask_`` methods may wait for the answer; the others only tell."""

    async def ask_admit(self, ip: str) -> str | None: ...
    def release(self, ip: str | None = None) -> None: ...
    async def ask_auth_blocked(self, ip: str) -> bool: ...
    async def ask_auth_begin(self, ip: str) -> bool: ...
    def auth_end(self, ip: str) -> None: ...
    def auth_failed(self, ip: str) -> None: ...


class ConnectionGate:
    """Concurrency and per-client rate limits; ``clock`` is monotonic seconds (injectable for tests).

    ``per_client_per_minute_max`` 0 means no rate limit; ``exempt(ip)`` True means no per-client limit for
    ``ip`` (rate and concurrency) and access to the reserved places. ``client_connections_max`` 0 means no
    per-client concurrency limit; ``mynetworks_reserve`` places (connections) of ``connections_max`` are for
    exempt clients only. ``auth_failures_per_minute_max`` 0 means no AUTH failure limit.
    """

    def __init__(
        self,
        *,
        connections_max: int,
        per_client_per_minute_max: int,
        exempt: Callable[[str], bool] = lambda ip: False,
        clock: Callable[[], float] = time.monotonic,
        client_connections_max: int = 0,
        mynetworks_reserve: int = 0,
        auth_failures_per_minute_max: int = 0,
    ) -> None:
        self.connections_max = connections_max
        self.per_client_max = per_client_per_minute_max
        self.exempt = exempt
        self.clock = clock
        self.client_connections_max = client_connections_max
        self.mynetworks_reserve = max(0, min(mynetworks_reserve, connections_max - 1))
        self.auth_failures_max = auth_failures_per_minute_max
        self.active = 0
        self.active_outside = 0  # admitted connections of clients not exempt
        self._recent: dict[str, deque[float]] = {}
        self._per_client: dict[str, int] = {}  # admitted connections per client IP (not exempt), > 0 only
        self._auth_failures: dict[str, deque[float]] = {}
        self._auth_checking: dict[str, int] = {}  # password checks running, per client (auth_begin)

    def configure(self, *, connections_max: int, per_client_per_minute_max: int, exempt: Callable[[str], bool],
                  client_connections_max: int, mynetworks_reserve: int, auth_failures_per_minute_max: int) -> None:
        """New limits (``mtaq reload``; the arguments as for the constructor) for the admissions from now on.

        The counts are kept: the connections admitted before (``active``, per client) still count, and
        each client's recent connections and AUTH failures are kept, in windows sized for the new limits."""
        self.connections_max = connections_max
        self.exempt = exempt
        self.client_connections_max = client_connections_max
        self.mynetworks_reserve = max(0, min(mynetworks_reserve, connections_max - 1))
        if per_client_per_minute_max != self.per_client_max:
            self._recent = {ip: deque(seen, maxlen=per_client_per_minute_max + 1) for ip, seen in self._recent.items()}
            self.per_client_max = per_client_per_minute_max
        if auth_failures_per_minute_max != self.auth_failures_max:
            self._auth_failures = {ip: deque(seen, maxlen=auth_failures_per_minute_max + 1)
                                   for ip, seen in self._auth_failures.items()}
            self.auth_failures_max = auth_failures_per_minute_max

    def admit(self, ip: str) -> str | None:
        """Admit a connection from ``ip`` (None; call :meth:`release` with the same ``ip`` later) or say why
        not (the reply text after ``421 4.7.0 <hostname>``, Postfix's wording)."""
        exempt = self.exempt(ip)
        if self.per_client_max and not exempt:
            now = self.clock()
            _forget_stale(self._recent, now)
            # Touched clients go to the end: the dict is ordered by last connection, stale ones at the front.
            seen = self._recent.pop(ip, None) or deque(maxlen=self.per_client_max + 1)
            self._recent[ip] = seen
            while seen and seen[0] <= now - RATE_WINDOW_S:
                seen.popleft()
            seen.append(now)
            if len(seen) > self.per_client_max:
                return f"too many connections from {ip}"
        if self.active >= self.connections_max:
            return "too many connections"
        if not exempt:
            if self.client_connections_max and self._per_client.get(ip, 0) >= self.client_connections_max:
                return f"too many connections from {ip}"
            if self.active_outside >= self.connections_max - self.mynetworks_reserve:
                return "too many connections"
            self._per_client[ip] = self._per_client.get(ip, 0) + 1
            self.active_outside += 1
        self.active += 1
        return None

    def release(self, ip: str | None = None) -> None:
        """One admitted connection from ``ip`` has ended (``None``: from an exempt client, as before)."""
        self.active = max(0, self.active - 1)
        if ip is not None and ip in self._per_client:
            left = self._per_client[ip] - 1
            if left > 0:
                self._per_client[ip] = left
            else:
                del self._per_client[ip]
            self.active_outside = max(0, self.active_outside - 1)

    def auth_failed(self, ip: str) -> None:
        """Count one failed AUTH attempt of ``ip`` (kept for :data:`RATE_WINDOW_S` seconds)."""
        if not self.auth_failures_max:
            return
        now = self.clock()
        _forget_stale(self._auth_failures, now)
        seen = self._auth_failures.pop(ip, None) or deque(maxlen=self.auth_failures_max + 1)
        self._auth_failures[ip] = seen  # ordered by last failure, as _recent
        seen.append(now)

    def auth_blocked(self, ip: str) -> bool:
        """Whether ``ip``'s failed AUTH attempts in the last 60 seconds, plus the password checks of ``ip``
        still running, reach ``auth_failures_per_minute_max`` (a guess in flight counts as a failure until it
        succeeds: parallel connections cannot each get a guess checked past the limit)."""
        if not self.auth_failures_max:
            return False
        seen = self._auth_failures.get(ip)
        now = self.clock()
        while seen and seen[0] <= now - RATE_WINDOW_S:
            seen.popleft()
        return len(seen or ()) + self._auth_checking.get(ip, 0) >= self.auth_failures_max

    def auth_begin(self, ip: str) -> bool:
        """Reserve a password check for ``ip``; False (nothing reserved) when :meth:`auth_blocked`. Every
        True is followed by one :meth:`auth_end`."""
        if not self.auth_failures_max:
            return True
        if self.auth_blocked(ip):
            return False
        self._auth_checking[ip] = self._auth_checking.get(ip, 0) + 1
        return True

    def auth_end(self, ip: str) -> None:
        """The password check reserved by :meth:`auth_begin` is over (its failure, if any, was counted)."""
        left = self._auth_checking.get(ip, 0) - 1
        if left > 0:
            self._auth_checking[ip] = left
        else:
            self._auth_checking.pop(ip, None)

    # The :class:`Gate` interface: this gate answers at once.
    async def ask_admit(self, ip: str) -> str | None:
        """:meth:`admit`."""
        return self.admit(ip)

    async def ask_auth_blocked(self, ip: str) -> bool:
        """:meth:`auth_blocked`."""
        return self.auth_blocked(ip)

    async def ask_auth_begin(self, ip: str) -> bool:
        """:meth:`auth_begin`."""
        return self.auth_begin(ip)



def _forget_stale(times: dict[str, deque[float]], now: float) -> None:
    """Drop the clients of ``times`` (ordered by their last event, oldest first) whose last event left the
    window: from the front, stopping at the first one still in it, so each call costs O(1) amortised. A full
    rescan once 10,000 clients were remembered cost 2-8 ms per connection when more than that many addresses
    connected within a minute (issue 32's outside review: 455 connections/s fell to 52)."""
    while times:
        ip = next(iter(times))
        seen = times[ip]
        if seen and seen[-1] > now - RATE_WINDOW_S:
            return
        del times[ip]
