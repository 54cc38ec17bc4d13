"""Next-hop selection: transport map, relayhost, or the recipient domain's MX records (RFC 5321 §5.1).

For one recipient, :meth:`Router.route` decides *where* without any I/O, in Postfix's order:

1. ``transport_map`` (Postfix transport(5)): the exact domain, then each parent domain written with a
   leading dot (``.example.org`` matches ``a.b.example.org``, not ``example.org``), then ``*``. Values:
   ``[host]:port`` / ``smtp:[host]:port`` (that host, no MX lookup), ``host:port`` / ``smtp:host`` (the MX
   records of ``host``), ``smtp:`` (the recipient domain by MX), ``smtps:NEXTHOP`` (as ``smtp:``, with TLS
   from the first byte, RFC 8314), ``discard[:text]`` (counted as delivered,
   nothing sent), ``error:5.1.1 text`` (that reply; 5.x.x bounces, 4.x.x defers);
2. ``relayhost`` when set;
3. the recipient domain: its MX records (an address literal ``[192.0.2.1]`` is used as it is).

:meth:`Router.candidates` then yields the addresses to try, in order: MX records by preference, random among
equal preference; the domain's own A/AAAA records when it has no MX (the implicit MX, §5.1). DNS answers
that end routing for the whole destination become a :class:`RouteFailure` carrying the reply:

* null MX (RFC 7505 §3, a single ``MX 0 .``): ``556 5.1.10`` (bounce, RFC 7505 §4.3 and RFC 3463);
* NXDOMAIN, or no MX and no address for the domain: ``550 5.1.2`` (bounce: bad destination system);
* timeout, SERVFAIL, no usable name server: ``451 4.4.3`` (defer: directory server failure, RFC 3463).

A single MX host without addresses (or whose lookup fails) is skipped with a temporary reason (4.4.4 or
4.4.3), so that the next host is tried; when none is left, the caller defers with the last reason.

The TLS policy of a destination (``none``, ``may``, ``encrypt``, ``verify``, ``secure``) is looked up in
``tls_policy_map`` by the next-hop destination as written (``[10.0.0.5]:25``, ``example.org``), then by the
recipient domain (exact, ``.parent``, ``*``), else ``smtp_tls_security_level``; :meth:`Route.tls_match` gives
the names a certificate must carry at ``verify``/``secure``.

The source address of a route (:attr:`Route.source`, one IPv4 and one IPv6 address, "" for none) is looked
up for each family on its own: ``sender_dependent_bind_address_maps`` by the envelope sender (the address,
then its ``@domain``; ``<>`` for the null sender), then ``destination_bind_address_maps`` with the keys of
``tls_policy_map`` (the next hop as written, then the recipient domain); the connection pool falls back to
``smtp_bind_address`` / ``smtp_bind_address6``. A connection uses the address of its own family only (Postfix
binds smtp_bind_address for IPv4 connections, smtp_bind_address6 for IPv6 ones): an IPv4-only entry leaves
an IPv6 connection to the next rule, and to the kernel's choice at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import random
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from mtaq.config import (
    Config,
    Relayhost,
    destination_key,
    listeners_of,
    parse_bind_addresses,
    parse_nameserver,
    parse_relayhost,
    parse_transport_spec,
)
from mtaq.delivery.relay import Reply, TlsLevel

if TYPE_CHECKING:  # dnspython is imported at the first lookup: a relayhost never needs it (issue 15.6)
    import dns.asyncresolver
    import dns.resolver

__all__ = ["AddressRewriter", "Candidate", "Dns", "Route", "RouteFailure", "Router", "domain_of", "lookup", "parse_transport"]

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Transport:
    """A parsed transport map value: ``smtp`` (``nexthop`` None: the recipient domain by MX), ``discard`` or
    ``error``; ``reply`` is the reply given to recipients of ``discard`` and ``error``."""

    kind: Literal["smtp", "discard", "error"]
    nexthop: Relayhost | None = None
    reply: Reply | None = None
    wrapper: bool = False  # smtps: implicit TLS (RFC 8314)


def parse_transport(value: str, *, key: str = "transport_map", default_port: int = 25) -> Transport:
    """A ``transport_map`` value -> Transport. Raises ValueError naming ``key`` for a value it cannot use.

    The syntax is parsed by :func:`mtaq.config.parse_transport_spec` (where the configuration is validated);
    this adds the replies of ``discard`` and ``error``.
    """
    spec = parse_transport_spec(value, key=key, default_port=default_port)
    if spec.kind == "smtp":
        return Transport("smtp", spec.nexthop, wrapper=spec.wrapper)
    assert spec.code is not None and spec.status is not None
    return Transport(spec.kind, reply=Reply(spec.code, spec.status, spec.text))


def lookup(table: Mapping[str, V], domain: str) -> V | None:
    """Postfix transport(5) lookup of ``domain`` (lower case) in ``table`` (lower-case keys): the domain,
    then ``.parent`` for each parent domain, nearest first, then ``*``; None when nothing matches."""
    if domain and domain in table:
        return table[domain]
    labels = domain.split(".")
    for i in range(1, len(labels)):
        parent = "." + ".".join(labels[i:])
        if parent in table:
            return table[parent]
    return table.get("*")


def domain_of(address: str) -> str:
    """The domain of ``address``: after the last ``@``, lower case, without a trailing dot; "" if none."""
    _, at, domain = address.rpartition("@")
    return domain.strip().rstrip(".").lower() if at else ""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a recipient goes; equal routes share one transaction (Postfix's per-destination delivery).

    ``kind`` smtp: ``host`` and ``port``; ``mx`` True means look up the MX records of ``host``. ``reply`` is
    the fixed reply of discard/error routes. ``tls`` is the TLS policy; ``wrapper`` True means TLS from
    the first byte (RFC 8314 implicit TLS: an ``smtps:`` transport or ``smtp_tls_wrappermode``).
    ``source`` is the local (IPv4, IPv6) address to connect from, "" where the maps give none (module text).
    """

    kind: Literal["smtp", "discard", "error"]
    host: str = ""
    port: int = 0
    mx: bool = False
    tls: TlsLevel = "may"
    reply: Reply | None = None
    wrapper: bool = False
    source: tuple[str, str] = ("", "")

    def tls_match(self, hostname: str) -> tuple[str, ...]:
        """The names a certificate must carry (RFC 6125): at ``verify`` the host connected to
        (``hostname``: the MX host name, or the name in brackets); at ``secure`` the next-hop destination
        (the name in brackets; for MX routes the domain and any name under it, Postfix ``nexthop,
        dot-nexthop``); () at the other levels."""
        if self.tls == "verify":
            return (hostname,)
        if self.tls == "secure":
            return (self.host, "." + self.host) if self.mx else (self.host,)
        return ()

    def __str__(self) -> str:
        if self.kind != "smtp":
            return self.kind
        return f"{self.host}:{self.port}" if self.mx else f"[{self.host}]:{self.port}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One address to try: ``hostname`` (the MX host name, or the address itself), ``address``, ``port``."""

    hostname: str
    address: str
    port: int


class RouteFailure(Exception):
    """Routing failed for the whole destination; ``reply`` is the final (5xx) or temporary (4xx) reply."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.text)
        self.reply = reply


class Dns:
    """MX and address lookups with dnspython's asyncio resolver.

    ``nameservers`` ((ip, port) pairs) replace /etc/resolv.conf when given. ``timeout_s`` bounds each
    lookup as a whole (seconds). Errors come back as :class:`RouteFailure` replies (see the module text).
    """

    def __init__(self, nameservers: list[tuple[str, int]], *, timeout_s: float) -> None:
        self.nameservers = nameservers
        self.timeout_s = timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None

    def _get(self, what: str) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            import dns.asyncresolver
            import dns.exception
            import dns.nameserver

            try:
                r = dns.asyncresolver.Resolver(configure=not self.nameservers)
            except dns.exception.DNSException as exc:  # no /etc/resolv.conf, or nothing in it
                raise RouteFailure(Reply(451, "4.4.3", f"{what}: no DNS resolver: {exc}")) from exc
            if self.nameservers:
                r.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in self.nameservers]
            r.lifetime = self.timeout_s
            r.timeout = min(r.timeout, self.timeout_s)
            self._resolver = r
        return self._resolver

    async def _query(self, name: str, rdtype: str) -> dns.resolver.Answer | None:
        """The answer, None when the name exists without records of that type; raises RouteFailure."""
        import dns.exception
        import dns.name
        import dns.resolver

        what = f"Name service error for name={name} type={rdtype}"
        try:
            qname = dns.name.from_unicode(name) if not name.isascii() else dns.name.from_text(name)
        except dns.exception.DNSException as exc:
            raise RouteFailure(Reply(550, "5.1.2", f"{what}: bad domain name: {exc}")) from exc
        try:
            return await self._get(what).resolve(qname, rdtype, search=False)
        except dns.resolver.NoAnswer:
            return None
        except dns.resolver.NXDOMAIN as exc:
            raise RouteFailure(Reply(550, "5.1.2", f"Host or domain name not found. {what}: Host not found")) from exc
        except dns.exception.Timeout as exc:
            raise RouteFailure(Reply(451, "4.4.3", f"Host or domain name not found. {what}: timed out")) from exc
        except dns.exception.DNSException as exc:  # SERVFAIL from every server, refused, malformed, ...
            reason = " ".join(str(exc).split())
            raise RouteFailure(Reply(451, "4.4.3", f"Host or domain name not found. {what}: try again ({reason})")) from exc

    async def mx(self, domain: str) -> list[tuple[int, str]] | None:
        """MX records of ``domain`` as (preference, host) sorted by preference; None when there is none.

        Raises RouteFailure: null MX (556 5.1.10), NXDOMAIN (550 5.1.2), DNS trouble (451 4.4.3).
        """
        ans = await self._query(domain, "MX")
        if ans is None:
            return None
        recs = [(int(r.preference), r.exchange.to_text(omit_final_dot=True)) for r in ans]
        real = [(p, h) for p, h in recs if h not in ("", ".")]
        if not real:
            # RFC 7505 §3: the domain accepts no mail; §4.3: 556 5.1.10 when a sender tries anyway.
            raise RouteFailure(Reply(556, "5.1.10", f"Domain {domain} does not accept mail (nullMX)"))
        return sorted(real)

    async def addresses(self, host: str) -> list[str]:
        """IPv4 then IPv6 addresses of ``host``; [] when it has none. Raises RouteFailure (as ``mx``)."""
        out: list[str] = []
        failure: RouteFailure | None = None
        for rdtype in ("A", "AAAA"):
            try:
                ans = await self._query(host, rdtype)
            except RouteFailure as exc:
                if exc.reply.enhanced == "5.1.2":  # NXDOMAIN: the name does not exist at all
                    raise
                failure = exc
                continue
            out += [r.address for r in ans or ()]
        if not out and failure is not None:
            raise failure
        return out


ROUTES_KEPT = 4096  # routes kept by recipient domain (Router.route); all are dropped when it is full


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.strip("[]")) == ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return a.lower() == b.lower()


@functools.lru_cache(maxsize=256)
def _is_local_address(address: str) -> bool:
    """Whether ``address`` (an IP address) is one of this host's: a socket can be bound to it."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


class AddressRewriter(Protocol):
    """Address rewriting of mail leaving (``smtp_generic_maps``; :class:`mtaq.edge.canonical.Generic`)."""

    def address(self, address: str) -> str:
        """An envelope address as it leaves."""
        ...

    def head(self, head: bytes) -> bytes | None:
        """A header section (without its empty line) as it leaves, or None when unchanged."""
        ...


class Router:
    """Routes recipients (pure) and turns a route into the addresses to try (DNS). See the module text."""

    def __init__(self, cfg: Config, *, rng: random.Random | None = None, dns_client: Dns | None = None) -> None:
        self.smtp_port = cfg.smtp_port
        self.relayhost = parse_relayhost(cfg.relayhost, default_port=cfg.smtp_port)
        self.sender_relayhosts: dict[str, Relayhost] = {}  # sender_dependent_relayhost_maps, keys lower case
        for k, v in cfg.sender_dependent_relayhost_maps.items():
            hop = parse_relayhost(v, key=f"sender_dependent_relayhost_maps.{k}", default_port=cfg.smtp_port)
            if hop is not None:
                self.sender_relayhosts[k.strip().lower()] = hop
        self.sender_sources = {  # sender_dependent_bind_address_maps: (IPv4, IPv6), keys lower case
            k.strip().lower(): parse_bind_addresses(v, key=f"sender_dependent_bind_address_maps.{k}")
            for k, v in cfg.sender_dependent_bind_address_maps.items()
        }
        self.destination_sources = {  # destination_bind_address_maps, keys as tls_policy_map's
            destination_key(k, key=f"destination_bind_address_maps.{k}"):
                parse_bind_addresses(v, key=f"destination_bind_address_maps.{k}")
            for k, v in cfg.destination_bind_address_maps.items()
        }
        self.transports = {
            k.strip().lower(): parse_transport(v, key=f"transport_map.{k}", default_port=cfg.smtp_port)
            for k, v in cfg.transport_map.items()
        }
        self.tls_default: TlsLevel = cfg.smtp_tls_security_level
        self.tls_policy: dict[str, TlsLevel] = {k.strip().lower(): v for k, v in cfg.tls_policy_map.items()}
        self.tls_ca_file = cfg.smtp_tls_CAfile
        # smtp_generic_maps, applied as mail leaves (mtaq.edge.canonical.Generic, set by the daemon); None: none
        self.generic: AddressRewriter | None = None
        self.wrappermode = cfg.smtp_tls_wrappermode
        self.addresses_max = cfg.smtp_mx_addresses_max
        self.rng = rng or random.Random()
        self._routes: dict[str, Route] = {}
        self.dns = dns_client or Dns(
            [parse_nameserver(ns, cfg.dns_port) for ns in cfg.dns_nameservers], timeout_s=cfg.dns_timeout_s
        )
        try:  # our own SMTP listeners (a port 0 one cannot be known here): a next hop there is a mail loop
            self.own: tuple[tuple[str, int], ...] = tuple((lst.host, lst.port) for lst in listeners_of(cfg) if lst.port)
        except ValueError:
            self.own = ()

    def loops_back(self, address: str, port: int) -> bool:
        """Whether a next hop at ``address``:``port`` is this daemon (one of its listeners: the same address,
        or any address of this host for a wildcard listener), as Postfix refuses to deliver to itself
        (``mail for DOMAIN loops back to myself``)."""
        for host, own_port in self.own:
            if own_port != port:
                continue
            if host in ("", "0.0.0.0", "::", "*"):
                if _is_local_address(address):
                    return True
            elif _same_address(host, address):
                return True
        return False

    def describe(self) -> str:
        """The default route for logs: the relayhost, or ``mx`` (by recipient domain)."""
        return str(self.relayhost) if self.relayhost is not None else "mx"

    def _tls(self, nexthop: Relayhost, domain: str) -> TlsLevel:
        """The policy of the next-hop destination as written (``[host]:port``, ``[host]``, ``host:port``,
        ``host``), else of the recipient domain (exact, ``.parent``, ``*``), else the default."""
        found = _by_destination(self.tls_policy, nexthop, domain)
        return found if found is not None else self.tls_default

    def _source(self, nexthop: Relayhost, domain: str) -> tuple[str, str]:
        """The (IPv4, IPv6) source addresses ``destination_bind_address_maps`` gives the next hop, else the
        recipient domain (the lookup of ``tls_policy_map``); ("", "") for none."""
        if not self.destination_sources:
            return ("", "")
        return _by_destination(self.destination_sources, nexthop, domain) or ("", "")

    def sender_relayhost(self, sender: str) -> Relayhost | None:
        """The next hop ``sender_dependent_relayhost_maps`` gives mail from ``sender`` (the address, then its
        ``@domain``; ``<>`` for the null sender), or None."""
        return _by_sender(self.sender_relayhosts, sender)

    def route(self, address: str, sender: str | None = None) -> Route:
        """The route of recipient ``address`` (no I/O). A route depends on the recipient's domain alone (and
        on this router's tables, set once), so it is kept per domain (at most ``ROUTES_KEPT``); the error
        route of an address without a domain names the address and is never kept. With ``sender`` (the
        envelope sender; "" for <>), a recipient that ``transport_map`` does not route goes to the next hop
        of :meth:`sender_relayhost`, if any, before ``relayhost`` (Postfix's order); and the source address
        ``sender_dependent_bind_address_maps`` gives the sender wins over the destination's (module text)."""
        found = self._route_of(address, sender)
        if sender is None or found.kind != "smtp" or not self.sender_sources:
            return found
        mine = _by_sender(self.sender_sources, sender)
        if mine is None:
            return found
        source = (mine[0] or found.source[0], mine[1] or found.source[1])
        return found if source == found.source else dataclasses.replace(found, source=source)

    def _route_of(self, address: str, sender: str | None) -> Route:
        domain = domain_of(address)
        if sender is not None and self.sender_relayhosts and lookup(self.transports, domain) is None:
            hop = self.sender_relayhost(sender)
            if hop is not None:
                return Route("smtp", hop.host, hop.port, hop.mx, self._tls(hop, domain), wrapper=self.wrappermode,
                             source=self._source(hop, domain))
        found = self._routes.get(domain)
        if found is None:
            found = self._route(address, domain)
            if domain:
                if len(self._routes) >= ROUTES_KEPT:
                    self._routes.clear()
                self._routes[domain] = found
        return found

    def _route(self, address: str, domain: str) -> Route:
        t = lookup(self.transports, domain)
        if t is not None and t.kind != "smtp":
            return Route(t.kind, reply=t.reply)
        nexthop = t.nexthop if t is not None else self.relayhost
        if nexthop is None:
            if not domain:
                return Route("error", reply=Reply(550, "5.1.3", f"<{address}>: no domain to route by"))
            literal = _address_literal(domain)
            if literal is not None:
                nexthop = Relayhost(host=literal, port=self.smtp_port, mx=False)
            else:
                nexthop = Relayhost(host=domain, port=self.smtp_port, mx=True)
        wrapper = self.wrappermode or (t is not None and t.wrapper)
        return Route("smtp", nexthop.host, nexthop.port, nexthop.mx, self._tls(nexthop, domain), wrapper=wrapper,
                     source=self._source(nexthop, domain))

    async def candidates(self, route: Route) -> AsyncIterator[Candidate | Reply]:
        """The addresses to try for ``route``, best first, at most ``smtp_mx_addresses_max``.

        A :class:`Reply` in the stream is a host that was skipped (temporary, e.g. no address) and why.
        Raises RouteFailure when the destination itself cannot be routed (see the module text).
        """
        if _is_ip(route.host):
            yield Candidate(route.host, route.host, route.port)
            return
        hosts: list[str]
        implicit = False
        if route.mx:
            mx = await self.dns.mx(route.host)
            if mx is None:
                hosts, implicit = [route.host], True  # RFC 5321 §5.1: the domain is its own MX, preference 0
            else:
                hosts = []
                for pref in sorted({p for p, _ in mx}):
                    same = [h for p, h in mx if p == pref]
                    self.rng.shuffle(same)  # §5.1: random among equal preference, to spread the load
                    hosts += same
        else:
            hosts = [route.host]
        left = self.addresses_max
        for host in hosts:
            try:
                addrs = await self.dns.addresses(host)
            except RouteFailure as exc:
                if implicit or not route.mx:
                    raise
                yield Reply(451, exc.reply.enhanced if exc.reply.code < 500 else "4.4.4", f"MX host {host}: {exc.reply.text}")
                continue
            if not addrs:
                if implicit:
                    raise RouteFailure(Reply(550, "5.1.2", f"Domain {host} has no MX and no address record"))
                yield Reply(451, "4.4.4", f"Host {host} has no address record")
                continue
            for a in addrs:
                if left <= 0:
                    return
                left -= 1
                yield Candidate(host, a, route.port)


@functools.lru_cache(maxsize=1024)
def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _by_sender(table: Mapping[str, V], sender: str) -> V | None:
    """Postfix's lookup of a sender-dependent table (lower-case keys): the address, then ``@domain``; ``<>``
    for the null sender (""); None when nothing matches."""
    if not table:
        return None
    if not sender:
        return table.get("<>")
    low = sender.lower()
    found = table.get(low)
    return found if found is not None else table.get("@" + low.rpartition("@")[2])


def _by_destination(table: Mapping[str, V], nexthop: Relayhost, domain: str) -> V | None:
    """A per-destination table (``tls_policy_map``, ``destination_bind_address_maps``): the next hop as
    written (``[host]:port``, ``[host]``, ``host:port``, ``host``), then the recipient ``domain`` by
    :func:`lookup`; None when nothing matches."""
    names = (str(nexthop), f"[{nexthop.host}]") if not nexthop.mx else (str(nexthop), nexthop.host)
    for key in names:
        if key in table:
            return table[key]
    return lookup(table, domain)


def _address_literal(domain: str) -> str | None:
    """RFC 5321 §4.1.3 address literal ``[192.0.2.1]`` / ``[IPv6:2001:db8::1]`` -> the address, else None."""
    if not (domain.startswith("[") and domain.endswith("]")):
        return None
    inner = domain[1:-1]
    if inner.lower().startswith("ipv6:"):
        inner = inner[5:]
    return inner if _is_ip(inner) else None
