"""Which TLS each host of a destination must offer: DANE (RFC 7672) and MTA-STS (RFC 8461) applied to routes.

:class:`PeerPolicy` sits between routing and the connection: for a destination it looks up the MTA-STS
policy (MX routes, ``mta_sts = true``) and, for each host tried, the TLSA records (level ``dane``), and says
what the connection must prove, as a :class:`HostTls`, or why the host must be skipped (a :class:`Reply`):

* level ``dane`` (Postfix ``smtp_tls_security_level = dane``; needs ``smtp_dns_support_level = dnssec``):
  when the MX RRset (for an MX route) and the host's address records were validated by a trusted resolver
  (Exim's rule: whoever can forge an unsigned answer picks the TLSA records too), the TLSA records of
  ``_PORT._tcp.HOST`` decide: usable DANE-TA/DANE-EE records -> TLS required and the certificate chain
  must match one of them (RFC 7672 §3; the names checked at DANE-TA are the host name and, for an MX route,
  the destination domain, §3.2.2); only unusable records -> ``encrypt``; none or not secure -> ``may``;
  a failed lookup of the TLSA records, or of the MX RRset's or the host's security (SERVFAIL: what a
  validator says of bogus data; a timeout) -> the host is skipped (``451 4.7.5``), never treated as
  "insecure" (that would let whoever can drop DNSSEC queries switch DANE off, RFC 7672 §2.1.1);
* MTA-STS ``enforce``: only the MX hosts the policy lists are used (``451 4.7.0`` for the others) and
  their TLS must verify: trusted chain and the MX host name (RFC 8461 §4.2), i.e. at least ``verify``;
  ``testing``: nothing changes, a host the policy does not list is reported (``mta_sts_report``);
  usable TLSA records of a host take precedence over MTA-STS (RFC 8461 §2); a host with only unusable
  records still gets what MTA-STS demands.

Lookups never raise: a failed MTA-STS lookup means no policy (or the cached one, :mod:`mtaq.delivery.mtasts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mtaq.delivery.dane import DaneLookupError, DnssecResolver, Tlsa
from mtaq.delivery.mtasts import MtaSts, StsPolicy, outcome
from mtaq.delivery.relay import Reply, TlsLevel
from mtaq.delivery.routing import Candidate, Route

__all__ = ["DestinationTls", "HostTls", "PeerPolicy"]

_STRENGTH = {"none": 0, "may": 1, "encrypt": 2, "dane": 2, "verify": 3, "secure": 4}


@dataclass(frozen=True, slots=True)
class HostTls:
    """What a connection to one host must prove: the TLS ``level`` (never ``dane``), the certificate
    names to match at ``verify``/``secure`` (``match``; () means the route's own), and the TLSA records
    the chain must match (``tlsa``; then the level is ``encrypt`` and the chain is checked after the
    handshake)."""

    level: TlsLevel
    match: tuple[str, ...] = ()
    tlsa: tuple[Tlsa, ...] = ()


@dataclass(slots=True)
class DestinationTls:
    """The MTA-STS policy of a destination (None: none applies), whether its MX RRset was secure, and the
    verdicts already reached for its hosts (one DNS round per host and port, however many addresses)."""

    sts: StsPolicy | None = None
    mx_secure: bool = False
    failure: Reply | None = None  # the DNSSEC lookup of the MX RRset failed: no host is used (level dane)
    hosts: dict[tuple[str, int], HostTls | Reply] = field(default_factory=dict)


class PeerPolicy:
    """DANE and MTA-STS for delivery. ``dane`` None: level ``dane`` means ``may`` (no DNSSEC resolver);
    ``sts`` None: no MTA-STS. ``report(event, fields)`` hears what should be logged."""

    def __init__(
        self,
        *,
        dane: DnssecResolver | None = None,
        sts: MtaSts | None = None,
        report: Callable[[str, dict[str, object]], None] = lambda event, fields: None,
    ) -> None:
        self.dane = dane
        self.sts = sts
        self.report = report

    async def destination(self, route: Route) -> DestinationTls:
        """Look up what applies to the whole destination of ``route`` (once per delivery group)."""
        sts = None
        if self.sts is not None and route.mx:
            sts = await self.sts.policy(route.host)
        mx_secure, failure = False, None
        if self.dane is not None and route.tls == "dane" and route.mx:
            try:
                mx_secure = await self.dane.secure(route.host, "MX")
            except DaneLookupError as exc:
                failure = Reply(451, "4.7.5", f"MX lookup error for {route.host} (DNSSEC): {exc}")
        return DestinationTls(sts, mx_secure, failure)

    async def for_host(self, route: Route, dest: DestinationTls, cand: Candidate) -> HostTls | Reply:
        """What a connection to ``cand`` must prove, or the reply for skipping it."""
        key = (cand.hostname, cand.port)
        known = dest.hosts.get(key)
        if known is None:
            known = dest.hosts[key] = await self._for_host(route, dest, cand)
        return known

    async def _for_host(self, route: Route, dest: DestinationTls, cand: Candidate) -> HostTls | Reply:
        level: TlsLevel = route.tls
        if level == "dane":
            dane = await self._dane(route, dest, cand)
            if isinstance(dane, Reply) or (dane is not None and dane.tlsa):
                return dane  # skipped, or authenticated by TLSA records: DANE first (RFC 8461 §2)
            level = dane.level if dane is not None else "may"  # encrypt (unusable records) or may; MTA-STS next
        if dest.sts is None:
            return HostTls(level)
        verdict = outcome(dest.sts, cand.hostname, route.host)
        if verdict.report:
            self.report("mta_sts_report", {"domain": route.host, "mx_host": cand.hostname, "mode": dest.sts.mode,
                                           "reason": verdict.report})
        if not verdict.use_host:
            assert verdict.reply is not None
            return verdict.reply
        if verdict.verify_tls and _STRENGTH[level] < _STRENGTH["verify"]:
            return HostTls("verify", match=(cand.hostname,))
        return HostTls(level)

    async def _dane(self, route: Route, dest: DestinationTls, cand: Candidate) -> HostTls | Reply | None:
        """DANE's verdict for ``cand`` (None: DANE does not apply; use the rest of the policy)."""
        if dest.failure is not None:
            return dest.failure
        if self.dane is None or (route.mx and not dest.mx_secure) or cand.hostname == cand.address:
            return None
        rdtype = "AAAA" if ":" in cand.address else "A"
        try:
            if not await self.dane.secure(cand.hostname, rdtype):
                return None
        except DaneLookupError as exc:  # not "insecure": a failed lookup must not switch DANE off
            return Reply(451, "4.7.5", f"address lookup error for {cand.hostname} (DNSSEC): {exc}")
        policy = await self.dane.tlsa(cand.hostname, cand.port)
        if policy.status == "defer":
            assert policy.reply is not None
            return policy.reply
        if policy.status == "dane":
            names = (cand.hostname, route.host) if route.mx else (cand.hostname,)
            return HostTls("encrypt", match=names, tlsa=policy.records)
        if policy.status == "encrypt":
            return HostTls("encrypt")
        return None  # none / insecure: no DANE for this host
