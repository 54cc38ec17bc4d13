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

A "client" is its IP address; an IPv6 client is its address's first ``ipv6_prefix_length`` bits (Postfix's
``smtpd_client_ipv6_prefix_length``, default 84 since Postfix 3.8: one host commonly has a whole /64),
so that every per-client count (connections at once, the connection rate, the AUTH failures) is shared by
the addresses of one prefix (:func:`client_key`). IPv4 (and IPv4-mapped IPv6) addresses count one by one.
Refusals still name the real address.

With several workers the supervisor's gate may also admit connections of mynetworks clients *ahead*
(:meth:`ConnectionGate.admit_ahead`): places a worker holds and gives to its mynetworks clients without
asking (:mod:`mtaq.daemon.anvil`). Such a place counts in ``active`` as a mynetworks connection from when it
is given to the worker until the worker gives it back; at most ``mynetworks_reserve // 2`` are out at once
(``places``), so that idle places held by one worker can never take the whole reserve from a mynetworks
client of another.

Must always hold: ``active`` equals the admitted connections not yet released plus the ``places`` out,
and never exceeds ``connections_max``; ``active`` minus the admitted mynetworks connections never exceeds
``connections_max - mynetworks_reserve``; the memory per client is bounded by its limit. A reload
(:meth:`ConnectionGate.configure`) that lowers a limit ends no connection: new ones are refused until
enough of those admitted before it have ended.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["IPV6_PREFIX_LENGTH", "RATE_WINDOW_S", "ConnectionGate", "Gate", "client_key"]

IPV6_PREFIX_LENGTH = 84
"""Postfix's default ``smtpd_client_ipv6_prefix_length`` (since 3.8): bits of an IPv6 client that are one client."""

RATE_WINDOW_S = 60.0
"""The window of the per-client connection rate and of the AUTH failure rate (seconds)."""


@functools.lru_cache(maxsize=4096)
def client_key(ip: str, ipv6_prefix_length: int = IPV6_PREFIX_LENGTH) -> str:
    """The client that ``ip`` (an address as text) counts as: an IPv6 address (zone dropped) becomes its
    network of ``ipv6_prefix_length`` bits (0..128) as ``net/len`` (``2001:db8:1::/84``; with 128 the
    address itself); an IPv4 or IPv4-mapped IPv6 address, or text that is no address, is ``ip`` unchanged.
    Postfix ``smtpd_client_ipv6_prefix_length``."""
    if ":" not in ip or ipv6_prefix_length >= 128:
        return ip
    try:
        addr = ipaddress.IPv6Address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if addr.ipv4_mapped is not None:
        return ip
    net = ipaddress.IPv6Network((int(addr) >> (128 - ipv6_prefix_length) << (128 - ipv6_prefix_length),
                                 ipv6_prefix_length))
    return str(net)


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
    exempt clients only. ``auth_failures_per_minute_max`` 0 means no AUTH failure limit. ``ipv6_prefix_length``
    (0..128): the bits of an IPv6 address that make one client (:func:`client_key`).
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
        ipv6_prefix_length: int = IPV6_PREFIX_LENGTH,
        exempt_key: str = "",
    ) -> None:
        self.connections_max = connections_max
        # Names the exemption rule (``exempt``): two gates with the same key exempt the same clients (the
        # anvil grants places ahead only to a worker whose key is the host's).
        self.exempt_key = exempt_key
        self.per_client_max = per_client_per_minute_max
        self.exempt = exempt
        self.clock = clock
        self.client_connections_max = client_connections_max
        self.mynetworks_reserve = max(0, min(mynetworks_reserve, connections_max - 1))
        self.auth_failures_max = auth_failures_per_minute_max
        self.ipv6_prefix_length = ipv6_prefix_length
        self.active = 0
        self.active_outside = 0  # admitted connections of clients not exempt
        self.places = 0  # admitted ahead for exempt clients (admit_ahead), counted in active
        # Keyed by client (client_key): what the limits count.
        # Ordered by last event, oldest first; OrderedDicts: a plain dict's first key after many deletions from
        # its front walks every deleted slot (O(table) per call), an OrderedDict's is O(1).
        self._recent: OrderedDict[str, deque[float]] = OrderedDict()
        self._per_client: dict[str, int] = {}  # admitted connections per client (not exempt), > 0 only
        self._auth_failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._auth_checking: dict[str, int] = {}  # password checks running, per client (auth_begin)
        # The same two counts by real address, > 0 only: a reload that changes ipv6_prefix_length re-keys
        # the per-client counts from them, so that each release (auth_end) finds what its admit (auth_begin) counted.
        self._per_ip: dict[str, int] = {}
        self._auth_checking_ip: dict[str, int] = {}

    def key(self, ip: str) -> str:
        """The client ``ip`` counts as (:func:`client_key` with this gate's ``ipv6_prefix_length``)."""
        return client_key(ip, self.ipv6_prefix_length)

    def configure(self, *, connections_max: int, per_client_per_minute_max: int, exempt: Callable[[str], bool],
                  client_connections_max: int, mynetworks_reserve: int, auth_failures_per_minute_max: int,
                  ipv6_prefix_length: int = IPV6_PREFIX_LENGTH, exempt_key: str = "") -> None:
        """New limits (``mtaq reload``; the arguments as for the constructor) for the admissions from now on.

        The counts are kept: the connections admitted before (``active``, per client) still count, and
        each client's recent connections and AUTH failures are kept, in windows sized for the new limits. A new
        ``ipv6_prefix_length`` re-keys the counts of the connections and password checks in progress by it
        (exact: they are kept by address too); the recent connections and AUTH failures of an IPv6 client
        go to the new client of its prefix's first address (merged when the prefix is shorter)."""
        self.connections_max = connections_max
        self.exempt = exempt
        self.exempt_key = exempt_key
        self.client_connections_max = client_connections_max
        self.mynetworks_reserve = max(0, min(mynetworks_reserve, connections_max - 1))
        if per_client_per_minute_max != self.per_client_max:
            self._recent = OrderedDict((ip, deque(seen, maxlen=per_client_per_minute_max + 1))
                                       for ip, seen in self._recent.items())
            self.per_client_max = per_client_per_minute_max
        if auth_failures_per_minute_max != self.auth_failures_max:
            self._auth_failures = OrderedDict((ip, deque(seen, maxlen=auth_failures_per_minute_max + 1))
                                              for ip, seen in self._auth_failures.items())
            self.auth_failures_max = auth_failures_per_minute_max
        if ipv6_prefix_length != self.ipv6_prefix_length:
            self.ipv6_prefix_length = ipv6_prefix_length
            self._per_client = _rekeyed_counts(self._per_ip, self.key)
            self._auth_checking = _rekeyed_counts(self._auth_checking_ip, self.key)
            self._recent = _rekeyed_times(self._recent, self.key, self.per_client_max)
            self._auth_failures = _rekeyed_times(self._auth_failures, self.key, self.auth_failures_max)

    def admit(self, ip: str) -> str | None:
        """Admit a connection from ``ip`` (None; call :meth:`release` with the same ``ip`` later) or say why
        not (the reply text after ``421 4.7.0 <hostname>``, Postfix's wording)."""
        exempt = self.exempt(ip)
        key = self.key(ip)
        if self.per_client_max and not exempt:
            now = self.clock()
            _forget_stale(self._recent, now)
            # Touched clients go to the end: the dict is ordered by last connection, stale ones at the front.
            seen = self._recent.get(key)
            if seen is None:
                seen = self._recent[key] = deque(maxlen=self.per_client_max + 1)
            else:
                self._recent.move_to_end(key)
            while seen and seen[0] <= now - RATE_WINDOW_S:
                seen.popleft()
            seen.append(now)
            if len(seen) > self.per_client_max:
                return f"too many connections from {ip}"
        if self.active >= self.connections_max:
            return "too many connections"
        if not exempt:
            if self.client_connections_max and self._per_client.get(key, 0) >= self.client_connections_max:
                return f"too many connections from {ip}"
            if self.active_outside >= self.connections_max - self.mynetworks_reserve:
                return "too many connections"
            self._per_client[key] = self._per_client.get(key, 0) + 1
            self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
            self.active_outside += 1
        self.active += 1
        return None

    def release(self, ip: str | None = None) -> None:
        """One admitted connection from ``ip`` has ended (``None``: from an exempt client, as before)."""
        self.active = max(0, self.active - 1)
        if ip is not None and ip in self._per_ip:
            _decrement(self._per_ip, ip)
            _decrement(self._per_client, self.key(ip))
            self.active_outside = max(0, self.active_outside - 1)

    def admit_ahead(self, n: int) -> int:
        """Admit up to ``n`` connections of exempt (mynetworks) clients ahead of their arrival: the number
        admitted (0..n), which count in ``active`` until :meth:`release_ahead`. At most
        ``mynetworks_reserve // 2`` are out at once, and only while ``connections_max`` has room."""
        k = min(n, self.mynetworks_reserve // 2 - self.places, self.connections_max - self.active)
        if k <= 0:
            return 0
        self.places += k
        self.active += k
        return k

    def release_ahead(self, n: int) -> None:
        """``n`` places of :meth:`admit_ahead` are given back (an exempt connection that used one has ended,
        or the place was not used); more than are out is read as all of them."""
        n = max(0, min(n, self.places))
        self.places -= n
        self.active = max(0, self.active - n)

    def auth_failed(self, ip: str) -> None:
        """Count one failed AUTH attempt of ``ip`` (kept for :data:`RATE_WINDOW_S` seconds)."""
        if not self.auth_failures_max:
            return
        now = self.clock()
        _forget_stale(self._auth_failures, now)
        key = self.key(ip)
        seen = self._auth_failures.get(key)
        if seen is None:  # ordered by last failure, as _recent
            seen = self._auth_failures[key] = deque(maxlen=self.auth_failures_max + 1)
        else:
            self._auth_failures.move_to_end(key)
        seen.append(now)

    def auth_blocked(self, ip: str) -> bool:
        """Whether ``ip``'s failed AUTH attempts in the last 60 seconds, plus the password checks of ``ip``
        still running, reach ``auth_failures_per_minute_max`` (a guess in flight counts as a failure until it
        succeeds: parallel connections cannot each get a guess checked past the limit)."""
        if not self.auth_failures_max:
            return False
        key = self.key(ip)
        seen = self._auth_failures.get(key)
        now = self.clock()
        while seen and seen[0] <= now - RATE_WINDOW_S:
            seen.popleft()
        return len(seen or ()) + self._auth_checking.get(key, 0) >= self.auth_failures_max

    def auth_begin(self, ip: str) -> bool:
        """Reserve a password check for ``ip``; False (nothing reserved) when :meth:`auth_blocked`. Every
        True is followed by one :meth:`auth_end`."""
        if not self.auth_failures_max:
            return True
        if self.auth_blocked(ip):
            return False
        key = self.key(ip)
        self._auth_checking[key] = self._auth_checking.get(key, 0) + 1
        self._auth_checking_ip[ip] = self._auth_checking_ip.get(ip, 0) + 1
        return True

    def auth_end(self, ip: str) -> None:
        """The password check reserved by :meth:`auth_begin` is over (its failure, if any, was counted)."""
        if ip in self._auth_checking_ip:
            _decrement(self._auth_checking_ip, ip)
            _decrement(self._auth_checking, self.key(ip))

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



def _decrement(counts: dict[str, int], key: str) -> None:
    """One less for ``key`` in ``counts`` (which keeps counts > 0 only)."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _rekeyed_counts(per_ip: dict[str, int], key: Callable[[str], str]) -> dict[str, int]:
    """The counts by address ``per_ip`` summed by client (``key``)."""
    out: dict[str, int] = {}
    for ip, n in per_ip.items():
        k = key(ip)
        out[k] = out.get(k, 0) + n
    return out


def _rekeyed_times(times: OrderedDict[str, deque[float]], key: Callable[[str], str],
                   limit: int) -> OrderedDict[str, deque[float]]:
    """``times`` (client -> event times, oldest client first) by ``key`` of each client: the clients that
    fall into one are merged (their times in order, the last ``limit + 1`` kept); the order by last event
    is kept (what :func:`_forget_stale` needs)."""
    merged: dict[str, list[float]] = {}
    for old, seen in times.items():
        merged.setdefault(key(old.split("/", 1)[0]), []).extend(seen)
    out = {k: deque(sorted(v), maxlen=limit + 1) for k, v in merged.items()}
    return OrderedDict(sorted(out.items(), key=lambda kv: kv[1][-1] if kv[1] else 0.0))


def _forget_stale(times: OrderedDict[str, deque[float]], now: float) -> None:
    """Drop the clients of ``times`` (ordered by their last event, oldest first) whose last event left the
    window: from the front, stopping at the first one still in it, so each call costs O(1) amortised (an
    OrderedDict: a plain dict's first key walks the slots deleted before it). A full
    rescan once 10,000 clients were remembered cost 2-8 ms per connection when more than that many addresses
    connected within a minute (issue 32's outside review: 455 connections/s fell to 52)."""
    while times:
        seen = times[next(iter(times))]
        if seen and seen[-1] > now - RATE_WINDOW_S:
            return
        times.popitem(last=False)
