"""One delivery attempt of one message: recipients grouped by route, each group tried host after host.

:func:`deliver` groups the recipients by :class:`~mtaq.delivery.routing.Route` (one SMTP transaction per
destination, as Postfix does), then for each group walks the candidates of the route (MX preference order)
until every recipient has a final reply:

* 2xx and 5xx replies are final: they are handed to ``record`` (which makes them durable) at once, before
  the next host is tried, so a crash while trying a backup MX never forgets a delivery that happened;
* 4xx replies and connection failures (including a 4xx greeting, MAIL refused, or a TLS policy failure)
  leave the recipient for the next host (RFC 5321 §5.1: "try the next MX"; Postfix's soft-error rule);
* when the candidates run out, what is left is handed to ``record`` with its last reason (deferred).

Groups are delivered one after the other, within the single START of the attempt; each batch handed to
``record`` names the relay that gave the replies (``host[address]:port``, ``none`` when no host was asked).

:class:`ConnectionPool` is a worker's small cache of open connections keyed by (address, port, host name,
TLS policy, security, source address): a connection opened from one source address is never reused for mail
that must leave from another; connections idle longer than ``idle_s`` are closed by :meth:`ConnectionPool.close_idle`, and
the least recently used idle one is closed when the pool is full.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mtaq.core.errors import CorruptRecord, StorageError
from mtaq.delivery.backoff import Destinations
from mtaq.delivery.relay import Content, RelayConnection, Reply, TlsLevel
from mtaq.delivery.routing import AddressRewriter, Candidate, Route, RouteFailure, Router
from mtaq.delivery.sasl import SaslClient, nexthop_keys
from mtaq.delivery.security import Credentials, HopSecurity
from mtaq.delivery.throttle import Throttle

if TYPE_CHECKING:  # DANE and MTA-STS pull in dnspython, aiohttp and cryptography: only when configured
    from mtaq.delivery.dane import Tlsa
    from mtaq.delivery.peers import PeerPolicy

__all__ = ["GENERIC_HEAD_BYTES_MAX", "Batch", "ConnectionPool", "HopFailure", "deliver"]

GENERIC_HEAD_BYTES_MAX = 1024 * 1024
"""The most of a queued message read to find its header section for smtp_generic_maps (bytes)."""
_BLANK_LINE = re.compile(rb"(?:\A|\n)\r?\n")  # the empty line that ends the header section (as mtaq.edge.dkim)
HEAD_INLINE_BYTES_MAX = 64 * 1024
"""A header section up to this long is rewritten by smtp_generic_maps in the event loop; a longer one in a thread."""


@dataclass(slots=True)
class Batch:
    """Final replies from one relay: ``items`` are (recipient position, reply) pairs.

    ``discarded`` is True for a discard transport (nothing was sent). ``tls`` is the TLS version used
    ("" for plaintext or no connection).
    """

    relay: str
    items: list[tuple[int, Reply]]
    remote_dsn: bool = False
    discarded: bool = False
    tls: str = ""


@dataclass(frozen=True, slots=True)
class HopFailure:
    """A host that was tried (or skipped) for ``positions`` and answered 4xx or could not be used.

    ``sasl_code`` is the server's reply code when it refused AUTH (0 otherwise), ``sasl_username`` the user
    name that was refused (never the password).
    """

    relay: str
    positions: tuple[int, ...]
    reply: Reply
    sasl_code: int = 0
    sasl_username: str = ""


@dataclass(slots=True)
class _Entry:
    conn: RelayConnection
    last_used: float
    busy: bool = False


@functools.lru_cache(maxsize=1024)
def _ip_version(address: str) -> int:
    """4 or 6 for an IP address literal, 0 for anything else (a host name). Cached: asked for every delivery
    (:meth:`ConnectionPool._bind_for`), of the few next hops a relay talks to."""
    try:
        return ipaddress.ip_address(address).version
    except ValueError:
        return 0


@dataclass
class ConnectionPool:
    """Open connections of one delivery worker, reused between messages (``max_conns`` at most)."""

    helo_name: str
    timeout_s: float
    idle_s: float
    max_conns: int = 8
    clock: Callable[[], float] = time.monotonic
    bind_address: str = ""  # the local IPv4 address of new connections (smtp_bind_address); "": any
    bind_address6: str = ""  # the same for IPv6 (smtp_bind_address6)
    _entries: dict[tuple[str, int, str, str, HopSecurity, str], _Entry] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def _bind_for(self, address: str, source: tuple[str, str] = ("", "")) -> str:
        """The local address to connect to ``address`` from: for an IPv6 one the route's IPv6 ``source``, else
        ``bind_address6``; for an IPv4 one the route's IPv4 ``source``, else ``bind_address``; "" for a name
        (the system resolver picks the family). Never an address of the other family (Postfix's rule)."""
        version = _ip_version(address)
        if version == 0:
            return ""
        return (source[1] or self.bind_address6) if version == 6 else (source[0] or self.bind_address)

    def get(self, cand: Candidate, tls: TlsLevel, security: HopSecurity | None = None,
            source: tuple[str, str] = ("", "")) -> RelayConnection:
        """The cached connection for ``cand`` with policy ``tls``, ``security`` (implicit TLS, names to
        verify, credentials: a connection authenticated as one user is never used for another) and the local
        address :meth:`_bind_for` picks from the route's (IPv4, IPv6) ``source``, or a new (not yet open) one;
        marked busy."""
        security = security or HopSecurity()
        bind = self._bind_for(cand.address, source)
        key = (cand.address, cand.port, cand.hostname, tls, security, bind)
        e = self._entries.pop(key, None)
        if e is None:
            e = _Entry(
                RelayConnection(cand.address, cand.port, hostname=cand.hostname, helo_name=self.helo_name,
                                timeout_s=self.timeout_s, tls=tls, security=security, bind_address=bind),
                self.clock(),
            )
        e.busy = True
        self._entries[key] = e  # most recently used last
        return e.conn

    async def release(self, conn: RelayConnection) -> None:
        """Done with ``conn`` for now; close the least recently used idle connections over ``max_conns``."""
        for e in self._entries.values():
            if e.conn is conn:
                e.busy, e.last_used = False, self.clock()
        while len(self._entries) > self.max_conns:
            key = next((k for k, e in self._entries.items() if not e.busy), None)
            if key is None:
                break
            await self._entries.pop(key).conn.close()

    def discard(self, conn: RelayConnection) -> None:
        """Take ``conn`` out of the pool and drop it without QUIT."""
        for key, e in list(self._entries.items()):
            if e.conn is conn:
                del self._entries[key]
        conn.abort()

    async def close_idle(self) -> int:
        """Close connections not used for ``idle_s`` seconds; returns how many were closed."""
        now = self.clock()
        old = [k for k, e in self._entries.items() if not e.busy and now - e.last_used >= self.idle_s]
        gone = [self._entries.pop(k) for k in old]  # out of the pool before any await: no one picks them up
        for e in gone:
            await e.conn.close()
        return len(gone)


async def deliver(
    router: Router,
    pool: ConnectionPool,
    sender: str,
    recipients: Sequence[str],
    body: bytes | Content | None,
    *,
    mail_params: Sequence[tuple[str, str]] = (),
    rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
    record: Callable[[Batch], Awaitable[None]],
    on_hop_failure: Callable[[HopFailure], None] = lambda f: None,
    throttle: Throttle | None = None,
    sasl: SaslClient | None = None,
    peers: PeerPolicy | None = None,
    dests: Destinations | None = None,
) -> None:
    """Deliver ``body`` to ``recipients``; every position gets exactly one final reply through ``record``.

    ``body`` is the message as bytes, or :class:`~mtaq.delivery.relay.Content` read in pieces as it is sent
    (once per transaction; a large message is never held in memory); None for an address probe (MAIL and
    RCPT only, no DATA: :meth:`RelayConnection.send`; :mod:`mtaq.delivery.verify`).

    ``record`` is awaited for each batch (the caller makes it durable there). ``on_hop_failure`` hears of
    each host that was given up on for some recipients before the next one was tried. ``throttle`` holds
    a slot of each recipient domain of a group while it is delivered (per-domain concurrency and rate).
    ``sasl`` gives the credentials of each destination (by ``sender`` and next hop; RFC 4954); credentials
    held after a 5xx to AUTH defer the group without connecting (:mod:`mtaq.delivery.sasl`). ``peers``
    applies DANE and MTA-STS to each host (:mod:`mtaq.delivery.peers`); without it level ``dane`` is ``may``.
    ``dests`` (:mod:`mtaq.delivery.backoff`): a group whose next hop is dead is deferred without a connection
    (``4.4.1 delivery temporarily suspended: …``); each group's outcome is the next hop's feedback.
    """
    params = list(rcpt_params) if rcpt_params is not None else [()] * len(recipients)
    wire = _Wire(sender, list(recipients), body)
    if router.generic is not None:  # smtp_generic_maps: what leaves, not what is routed, logged or queued
        wire = await _generic_wire(router.generic, wire)
    groups: dict[Route, list[int]] = {}
    for i, rcpt in enumerate(recipients):
        groups.setdefault(router.route(rcpt, sender), []).append(i)
    for route, positions in groups.items():
        if route.kind != "smtp":
            assert route.reply is not None
            await record(Batch("none", [(i, route.reply) for i in positions], discarded=route.kind == "discard"))
            continue
        fb: _Feedback | None = None
        if dests is not None:
            suspended = dests.suspended(str(route))
            if suspended is not None:
                await record(Batch("none", [(i, suspended) for i in positions]))
                continue
            fb = _Feedback()
        if throttle is None:
            await _deliver_group(router, pool, route, positions, sender, wire, params, mail_params,
                                 record, on_hop_failure, sasl, peers, fb)
        else:
            async with throttle.slots(recipients[i].rpartition("@")[2] for i in positions):
                await _deliver_group(router, pool, route, positions, sender, wire, params, mail_params,
                                     record, on_hop_failure, sasl, peers, fb)
        if dests is not None and fb is not None:
            dests.feedback(str(route), answered=fb.answered, failure=fb.failure,
                           whole=fb.failure is not None and fb.all_connect)


@dataclass(slots=True)
class _Feedback:
    """What the hosts of one group did, for the next hop's back-off: ``answered`` (a host talked),
    ``failure`` (the last site failure: refused, timed out, 421, lost), ``all_connect`` (every failure was
    a host that could not be talked to at all)."""

    answered: bool = False
    failure: Reply | None = None
    all_connect: bool = True

    def note(self, conn: RelayConnection, replies: Sequence[Reply]) -> None:
        lost = next((r for r in replies if r.code == 421), None)
        if lost is None and not conn.connect_failed:
            self.answered = True
            return
        self.failure = lost or Reply(421, "4.4.1", f"connect to {conn.name}: failed")
        self.all_connect = self.all_connect and conn.connect_failed


@dataclass(frozen=True, slots=True)
class _Wire:
    """What goes on the MAIL and RCPT lines and after DATA (after smtp_generic_maps)."""

    sender: str
    recipients: list[str]
    body: bytes | Content | None  # None: an address probe (no DATA)


class _Spliced:
    """``inner`` with its first ``old_len`` octets read as ``head`` (a :class:`Content`): the rest is read
    through, so the inner iterator's checks (the record checksum at its end) still run."""

    def __init__(self, inner: Content, old_len: int, head: bytes) -> None:
        self.inner, self.old_len, self.head = inner, old_len, head

    @property
    def size(self) -> int:
        return self.inner.size - self.old_len + len(self.head)

    def pieces(self) -> Iterator[bytes]:
        yield self.head
        skip = self.old_len
        for piece in self.inner.pieces():
            if skip >= len(piece):
                skip -= len(piece)
                continue
            yield piece[skip:] if skip else piece
            skip = 0


async def _generic_wire(generic: AddressRewriter, wire: _Wire) -> _Wire:
    """``wire`` with smtp_generic_maps applied (:class:`mtaq.edge.canonical.Generic`): the envelope
    addresses, and the header addresses the message's DKIM/ARC signatures do not cover. A header section
    longer than :data:`GENERIC_HEAD_BYTES_MAX`, or one that cannot be read (found again when the content is
    sent), is sent as it is."""
    body = wire.body
    if body is None:  # an address probe: the envelope only
        head = b""
    elif isinstance(body, bytes):
        m = _BLANK_LINE.search(body)
        head = body if m is None else body[: m.start() + 1] if m.start() else b""
    else:
        buf = b""
        try:
            for piece in body.pieces():
                buf += piece
                if _BLANK_LINE.search(buf) is not None or len(buf) > GENERIC_HEAD_BYTES_MAX:
                    break
        except (CorruptRecord, StorageError):
            buf = b""
        m = _BLANK_LINE.search(buf)
        head = b"" if m is None else buf[: m.start() + 1] if m.start() else b""
    # A large header section is rewritten in a thread (the RFC 5322 parser is slow on long address lists).
    new_head = (None if not head else generic.head(head) if len(head) <= HEAD_INLINE_BYTES_MAX
                else await asyncio.to_thread(generic.head, head))
    if new_head is not None and body is not None:
        body = new_head + body[len(head):] if isinstance(body, bytes) else _Spliced(body, len(head), new_head)
    return _Wire(generic.address(wire.sender), [generic.address(r) for r in wire.recipients], body)


async def _deliver_group(
    router: Router,
    pool: ConnectionPool,
    route: Route,
    positions: list[int],
    sender: str,
    wire: _Wire,
    params: Sequence[Sequence[tuple[str, str]]],
    mail_params: Sequence[tuple[str, str]],
    record: Callable[[Batch], Awaitable[None]],
    on_hop_failure: Callable[[HopFailure], None],
    sasl: SaslClient | None = None,
    peers: PeerPolicy | None = None,
    fb: _Feedback | None = None,
) -> None:
    pending = list(positions)
    last: dict[int, Reply] = {}
    last_relay, last_dsn, last_tls = "none", False, ""
    cred: Credentials | None = None
    if sasl is not None:
        cred = sasl.credentials(sender, nexthop_keys(route.host, route.port, route.mx))
    held = sasl.held(cred) if sasl is not None and cred is not None else None
    if held is not None:
        on_hop_failure(HopFailure("none", tuple(pending), held))
        await record(Batch("none", [(i, held) for i in pending]))
        return
    try:
        dest = await peers.destination(route) if peers is not None else None
        tried = False  # a host other than this daemon came first (tried, or its address not found)
        async for cand in router.candidates(route):
            if isinstance(cand, Reply):
                tried = True  # a host before this daemon's place (its address could not be found)
                for i in pending:
                    last[i] = cand
                on_hop_failure(HopFailure("none", tuple(pending), cand))
                continue
            if router.loops_back(cand.address, cand.port):
                # Postfix: a next hop that is this daemon ends the search; the hosts after it are of lower
                # preference. Without a host tried before it, the mail can go nowhere: bounced 5.4.6.
                loop = Reply(554, "5.4.6", f"mail for {route.host} loops back to myself")
                on_hop_failure(HopFailure(f"{cand.hostname}[{cand.address}]:{cand.port}", tuple(pending), loop))
                if not tried:
                    await record(Batch("none", [(i, loop) for i in pending]))
                    return
                break
            tried = True
            level: TlsLevel = "may" if route.tls == "dane" else route.tls
            match = route.tls_match(cand.hostname)
            tlsa: tuple[Tlsa, ...] = ()
            if peers is not None and dest is not None:
                verdict = await peers.for_host(route, dest, cand)
                if isinstance(verdict, Reply):  # DANE lookup failed, or not an MTA-STS host: skip it
                    for i in pending:
                        last[i] = verdict
                    on_hop_failure(HopFailure(f"{cand.hostname}[{cand.address}]:{cand.port}", tuple(pending), verdict))
                    continue
                level, tlsa = verdict.level, verdict.tlsa
                match = verdict.match or (route.tls_match(cand.hostname) if level == route.tls else ())
            security = HopSecurity(
                wrapper=route.wrapper,
                match=match,
                ca_file=router.tls_ca_file,
                credentials=cred,
                allow_plaintext_auth=sasl is not None and sasl.allow_plaintext,
                tlsa=tlsa,
            )
            conn = pool.get(cand, level, security, route.source)
            try:
                replies = await conn.send(
                    wire.sender,
                    [wire.recipients[i] for i in pending],
                    wire.body,
                    mail_params=mail_params,
                    rcpt_params=[params[i] for i in pending],
                )
            except asyncio.CancelledError:
                pool.discard(conn)  # abandoned mid-transaction (delivery_timeout_s): never reuse it
                raise
            finally:
                await pool.release(conn)
            if fb is not None:
                fb.note(conn, replies)
            final = [(i, r) for i, r in zip(pending, replies, strict=True) if not 400 <= r.code < 500]
            retry = [(i, r) for i, r in zip(pending, replies, strict=True) if 400 <= r.code < 500]
            if final:
                await record(Batch(conn.name, final, remote_dsn=conn.remote_dsn, tls=conn.tls_version))
            pending = [i for i, _ in retry]
            last_relay, last_dsn, last_tls = conn.name, conn.remote_dsn, conn.session_tls
            for i, r in retry:
                last[i] = r
            if not pending:
                return
            refused = conn.auth_failure
            for reply in {r for _, r in retry}:
                on_hop_failure(HopFailure(conn.name, tuple(i for i, r in retry if r == reply), reply,
                                          sasl_code=refused, sasl_username=cred.username if cred and refused else ""))
            if refused >= 500 and sasl is not None and cred is not None:
                # RFC 4954 §6: 535 and other 5xx mean these credentials will not do; every further try (the
                # next MX, the next message) counts against the account: hold them, try no other host.
                sasl.failed(cred, retry[0][1])
                break
    except RouteFailure as exc:
        if not last:
            await record(Batch("none", [(i, exc.reply) for i in pending]))
            return
        for i in pending:
            last.setdefault(i, exc.reply)
    fallback = Reply(451, "4.4.4", f"no route to {route}")
    await record(Batch(last_relay, [(i, last.get(i, fallback)) for i in pending], remote_dsn=last_dsn,
                       tls=last_tls))
