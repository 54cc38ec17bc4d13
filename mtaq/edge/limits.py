"""Admission of SMTP connections: how many at once, and how often one client may connect.

One :class:`ConnectionGate` is shared by every connection of a listener. At connect, :meth:`admit` either
admits the client (the caller must :meth:`release` once the connection is gone) or gives the reason it is
refused; the server then answers ``421 4.7.0`` and closes (RFC 5321 §3.8: 421 is the reply of a server
that closes the channel). Like Postfix's anvil, the per-client rate counts the connections a client IP
opened in the last 60 seconds (refused ones too, so hammering does not pay), and clients in ``mynetworks``
are exempt from it (Postfix ``smtpd_client_event_limit_exceptions = $mynetworks``); the concurrency cap
applies to everyone.

Must always hold: ``active`` equals the admitted connections not yet released, and never exceeds
``connections_max``; the memory per client is bounded by its limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["RATE_WINDOW_S", "ConnectionGate"]

RATE_WINDOW_S = 60.0
"""The window of the per-client connection rate (seconds)."""
_PRUNE_AT = 10_000  # clients remembered before the idle ones are forgotten


class ConnectionGate:
    """Concurrency and per-client rate limits; ``clock`` is monotonic seconds (injectable for tests).

    ``per_client_per_minute_max`` 0 means no rate limit; ``exempt(ip)`` True means no rate limit for ``ip``.
    """

    def __init__(
        self,
        *,
        connections_max: int,
        per_client_per_minute_max: int,
        exempt: Callable[[str], bool] = lambda ip: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connections_max = connections_max
        self.per_client_max = per_client_per_minute_max
        self.exempt = exempt
        self.clock = clock
        self.active = 0
        self._recent: dict[str, deque[float]] = {}

    def admit(self, ip: str) -> str | None:
        """Admit a connection from ``ip`` (None; call :meth:`release` later) or say why not (reply text)."""
        if self.per_client_max and not self.exempt(ip):
            now = self.clock()
            if len(self._recent) > _PRUNE_AT:
                self._prune(now)
            seen = self._recent.setdefault(ip, deque(maxlen=self.per_client_max + 1))
            while seen and seen[0] <= now - RATE_WINDOW_S:
                seen.popleft()
            seen.append(now)
            if len(seen) > self.per_client_max:
                return f"too many connections from {ip}"
        if self.active >= self.connections_max:
            return "too many connections"
        self.active += 1
        return None

    def release(self) -> None:
        """One admitted connection has ended."""
        self.active = max(0, self.active - 1)

    def _prune(self, now: float) -> None:
        for ip in [ip for ip, seen in self._recent.items() if not seen or seen[-1] <= now - RATE_WINDOW_S]:
            del self._recent[ip]
