"""MTA-STS (RFC 8461): a recipient domain's policy, fetched over verified HTTPS, cached, and what it means for
its MX hosts.

Not wired into delivery yet: :mod:`~mtaq.delivery.relay` and :mod:`~mtaq.delivery.transport` do not call this.

**Discovery** (§3.1, §5.1). :meth:`MtaSts.policy` looks up the TXT record ``_mta-sts.DOMAIN``
(``v=STSv1; id=...;``: TXT records not starting with ``v=STSv1`` are ignored, more than one that does counts
as none). A cached policy that has not expired (fetched + ``max_age``) and carries the same id is used as it
is; when the id changed, the cache is empty or expired, the policy is fetched again. No TXT record, a DNS
failure or a failed fetch keep a cached policy that has not expired (§5.1: a policy is not removed by an
attacker who blocks DNS or HTTPS); without one, the domain has no policy (None).

**Fetch** (§3.3): ``GET https://mta-sts.DOMAIN/.well-known/mta-sts.txt`` with aiohttp; the server's
certificate must chain to the trust store (``mta_sts_ca_file``, else the system store) and name the host; no
redirects (any status but 200 fails), ``Content-Type: text/plain``, at most 64 KiB
(:data:`POLICY_BYTES_MAX`), a total timeout. The host name is resolved with the configured DNS servers
(``dns_nameservers``), as MX hosts are. No proxy from the environment.

**Policy** (§3.2): ``version: STSv1``, ``mode: enforce|testing|none``, ``max_age`` (seconds; larger than
31557600 is cut to it), ``mx`` patterns (one or more unless mode is none; ``*.example.org`` matches exactly one
more leftmost label, §4.1). Unknown fields are ignored; of a repeated field the first counts (``mx`` repeats).

**Cache.** One JSON file per domain in the spool through a :class:`PolicyStore` (delivery may not import
storage; the daemon passes :class:`mtaq.storage.cachefile.CacheDir` over ``SPOOL/mta-sts``), written whole
and durably, so a cached policy survives a restart and a crash.

**What delivery should do** (§4, §5): for a recipient domain routed by MX (not a relayhost or transport map
next hop), ``policy = await sts.policy(domain)``; then per MX host ``o = outcome(policy, host)``:
``o.use_host`` False -> skip the host with ``o.reply`` (when no host is left, defer with it); ``o.verify_tls``
-> STARTTLS required, certificate verified against the trust store and matching the MX host name (the
``verify`` level being added to relay.py), a failure skips the host with ``451 4.7.5``; ``o.report`` ->
log it (mode testing: the violation is logged, mail goes as without a policy). DANE wins over MTA-STS
when the MX host has usable secure TLSA records (RFC 8461 §2).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import aiohttp
import aiohttp.abc
import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.resolver

from mtaq.config import Config, parse_nameserver
from mtaq.delivery.reply import Reply
from mtaq.logs import get_logger

__all__ = [
    "MAX_AGE_MAX",
    "POLICY_BYTES_MAX",
    "MtaSts",
    "PolicyStore",
    "StsError",
    "StsOutcome",
    "StsPolicy",
    "mx_allowed",
    "outcome",
    "parse_policy",
    "parse_txt",
    "policy_url",
]

MAX_AGE_MAX = 31_557_600  # RFC 8461 §3.2: about one year
POLICY_BYTES_MAX = 64 * 1024  # RFC 8461 §3.3: senders may limit the policy to 64 KiB
Mode = Literal["enforce", "testing", "none"]

_ID = re.compile(r"[A-Za-z0-9]{1,32}")
_LABEL = r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)"
_MX_PATTERN = re.compile(rf"(?:\*\.)?{_LABEL}(?:\.{_LABEL})+")
_FIELD = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,31}):[ \t]*(.*?)[ \t]*")


class StsError(Exception):
    """A TXT record, policy or fetch that cannot be used; str() says why."""


@dataclass(frozen=True, slots=True)
class StsPolicy:
    """A domain's policy as fetched: ``id`` of the TXT record it was fetched for, ``fetched_at`` (Unix time)."""

    mode: Mode
    mx: tuple[str, ...]
    max_age: int
    id: str = ""
    fetched_at: float = 0.0

    def expires_at(self) -> float:
        return self.fetched_at + self.max_age

    def fresh(self, now: float) -> bool:
        return now < self.expires_at()

    def to_json(self, domain: str) -> bytes:
        return json.dumps(
            {"domain": domain, "id": self.id, "mode": self.mode, "mx": list(self.mx), "max_age": self.max_age,
             "fetched_at": self.fetched_at},
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StsPolicy:
        """Raises StsError for a file that is not a policy."""
        try:
            d = json.loads(data)
            mode = d["mode"]
            if mode not in ("enforce", "testing", "none"):
                raise ValueError(f"mode {mode!r}")
            return cls(mode, tuple(str(p) for p in d["mx"]), min(int(d["max_age"]), MAX_AGE_MAX), str(d["id"]),
                       float(d["fetched_at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StsError(f"cached policy unreadable: {exc}") from exc


def parse_txt(records: Sequence[str]) -> str:
    """The policy id of the ``_mta-sts`` TXT records (each given as its strings joined). Raises StsError when
    no record or more than one starts with ``v=STSv1``, or the one that does is malformed (§3.1)."""
    sts = [r for r in records if re.match(r"v=STSv1(;|$)", r.strip())]
    if len(sts) != 1:
        raise StsError(f"{len(sts)} TXT records start with v=STSv1 (need exactly one)")
    fields = [f.strip() for f in sts[0].strip().split(";")]
    ident = None
    for f in fields[1:]:
        if not f:
            continue
        key, eq, value = f.partition("=")
        if not eq:
            raise StsError(f"TXT record field {f!r} is not key=value")
        if key.strip() == "id" and ident is None:
            ident = value.strip()
    if ident is None or not _ID.fullmatch(ident):
        raise StsError(f"TXT record has no valid id (1-32 letters and digits): {sts[0]!r}")
    return ident


def parse_policy(text: str) -> StsPolicy:
    """A policy file's text -> StsPolicy (``id`` and ``fetched_at`` unset). Raises StsError (§3.2)."""
    fields: dict[str, str] = {}
    mx: list[str] = []
    for raw in text.split("\n"):
        line = raw.removesuffix("\r")
        if not line.strip():
            continue
        m = _FIELD.fullmatch(line.strip(" \t"))
        if not m:
            raise StsError(f"policy line {line[:80]!r} is not 'key: value'")
        key, value = m.group(1), m.group(2)
        if key == "mx":
            mx.append(value)
        else:
            fields.setdefault(key, value)
    if fields.get("version") != "STSv1":
        raise StsError(f"policy version {fields.get('version')!r} is not STSv1")
    mode: Mode
    if fields.get("mode") == "enforce":
        mode = "enforce"
    elif fields.get("mode") == "testing":
        mode = "testing"
    elif fields.get("mode") == "none":
        mode = "none"
    else:
        raise StsError(f"policy mode {fields.get('mode')!r} is not enforce, testing or none")
    age = fields.get("max_age", "")
    if not re.fullmatch(r"[0-9]{1,10}", age):
        raise StsError(f"policy max_age {age!r} is not 1 to 10 digits")
    patterns = []
    for p in mx:
        norm = p.lower().rstrip(".")
        if not _MX_PATTERN.fullmatch(norm):
            raise StsError(f"policy mx pattern {p!r} is not a host name or *.domain")
        patterns.append(norm)
    if mode != "none" and not patterns:
        raise StsError(f"policy mode {mode} without mx patterns")
    return StsPolicy(mode, tuple(patterns), min(int(age), MAX_AGE_MAX))


def mx_allowed(policy: StsPolicy, mx_host: str) -> bool:
    """Whether ``mx_host`` matches one of the policy's ``mx`` patterns (§4.1): case-insensitive, trailing dot
    ignored; ``*.example.org`` matches ``mail.example.org`` but neither ``example.org`` nor
    ``a.mail.example.org``. The mode is not considered here (see :func:`outcome`)."""
    host = mx_host.strip().lower().rstrip(".")
    for p in policy.mx:
        if p.startswith("*."):
            first, dot, rest = host.partition(".")
            if first and dot and rest == p[2:]:
                return True
        elif host == p:
            return True
    return False


@dataclass(frozen=True, slots=True)
class StsOutcome:
    """What a policy means for one MX host: use it or not, verify its TLS or not, what to log."""

    use_host: bool = True
    verify_tls: bool = False
    report: str = ""  # non-empty: log this (the violation in mode testing, the reason in mode enforce)
    reply: Reply | None = None  # use_host False: why the host is skipped


def outcome(policy: StsPolicy | None, mx_host: str, domain: str = "") -> StsOutcome:
    """enforce: only matching MX hosts, with verified TLS; testing: everything as without a policy, a
    non-matching host reported; none or no policy: nothing (§4, §5)."""
    if policy is None or policy.mode == "none":
        return StsOutcome()
    allowed = mx_allowed(policy, mx_host)
    where = f" of {domain}" if domain else ""
    if policy.mode == "testing":
        return StsOutcome(report="" if allowed else f"MTA-STS policy{where} (testing) does not list MX host {mx_host}")
    if not allowed:
        why = f"MTA-STS policy{where} does not allow MX host {mx_host}"
        return StsOutcome(use_host=False, verify_tls=True, report=why, reply=Reply(451, "4.7.0", why))
    return StsOutcome(verify_tls=True)


class PolicyStore(Protocol):
    """Durable bytes by key (a domain); :class:`mtaq.storage.cachefile.CacheDir` is one."""

    def load(self, key: str) -> bytes | None: ...

    def save(self, key: str, data: bytes) -> None: ...


def policy_url(domain: str, port: int = 443) -> str:
    host = f"mta-sts.{domain}"
    return f"https://{host}/.well-known/mta-sts.txt" if port == 443 else f"https://{host}:{port}/.well-known/mta-sts.txt"


def _resolver(nameservers: Sequence[tuple[str, int]], timeout_s: float) -> dns.asyncresolver.Resolver:
    try:
        r = dns.asyncresolver.Resolver(configure=not nameservers)
    except dns.exception.DNSException as exc:
        raise StsError(f"no DNS resolver: {exc}") from exc
    if nameservers:
        r.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in nameservers]
    r.lifetime = timeout_s
    r.timeout = min(r.timeout, timeout_s)
    return r


class _DnsResolver(aiohttp.abc.AbstractResolver):
    """aiohttp's host lookups through dnspython and the configured servers (A, then AAAA)."""

    def __init__(self, resolver: dns.asyncresolver.Resolver) -> None:
        self.resolver = resolver

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[aiohttp.abc.ResolveResult]:
        out: list[aiohttp.abc.ResolveResult] = []
        failure: OSError | None = None
        kinds = [("A", socket.AF_INET), ("AAAA", socket.AF_INET6)]
        for rdtype, fam in kinds:
            if family not in (socket.AF_UNSPEC, fam):
                continue
            try:
                ans = await self.resolver.resolve(host, rdtype, search=False)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                continue
            except dns.exception.DNSException as exc:  # the other family may still answer
                failure = OSError(f"{host} {rdtype}: {' '.join(str(exc).split())}")
                continue
            out += [
                {"hostname": host, "host": r.address, "port": port, "family": fam, "proto": 0,
                 "flags": socket.AI_NUMERICHOST}
                for r in ans
            ]
        if not out:
            raise failure or OSError(f"{host}: no address records")
        return out

    async def close(self) -> None:
        return None


class MtaSts:
    """Policies of recipient domains: TXT lookup, HTTPS fetch, cache in ``store`` (see the module text).

    ``nameservers``: (ip, port) pairs, [] for /etc/resolv.conf. ``ca_file``: PEM trust store for the policy
    hosts ("" : the system's), or a ready ``ssl_context``. ``port`` is 443 but for tests; ``clock`` Unix time.
    """

    def __init__(
        self,
        store: PolicyStore,
        *,
        nameservers: Sequence[tuple[str, int]] = (),
        timeout_s: float = 10.0,
        ca_file: str = "",
        ssl_context: ssl.SSLContext | None = None,
        port: int = 443,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.nameservers = list(nameservers)
        self.timeout_s = timeout_s
        self.ssl_context = ssl_context or ssl.create_default_context(cafile=ca_file or None)
        self.port = port
        self.clock = clock
        self._memory: dict[str, StsPolicy] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._dns: dns.asyncresolver.Resolver | None = None
        self.log = get_logger()

    @classmethod
    def from_config(cls, cfg: Config, store: PolicyStore) -> MtaSts:
        """``dns_nameservers``, ``mta_sts_timeout_s``, ``mta_sts_ca_file``; ``store`` is
        ``CacheDir(os.path.join(cfg.spool_dir, "mta-sts"))`` in the daemon. Use only when ``cfg.mta_sts``."""
        return cls(
            store,
            nameservers=[parse_nameserver(ns, cfg.dns_port) for ns in cfg.dns_nameservers],
            timeout_s=cfg.mta_sts_timeout_s,
            ca_file=cfg.mta_sts_ca_file,
        )

    def _resolver(self) -> dns.asyncresolver.Resolver:
        if self._dns is None:
            self._dns = _resolver(self.nameservers, self.timeout_s)
        return self._dns

    async def txt_id(self, domain: str) -> str | None:
        """The id of ``_mta-sts.DOMAIN`` (None: no usable record). Raises StsError when DNS fails."""
        try:
            ans = await self._resolver().resolve(f"_mta-sts.{domain}", "TXT", search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            return None
        except dns.exception.DNSException as exc:
            raise StsError(f"_mta-sts.{domain} TXT: {' '.join(str(exc).split())}") from exc
        records = [b"".join(r.strings).decode("ascii", "replace") for r in ans]
        try:
            return parse_txt(records)
        except StsError as exc:
            self.log.info("mta_sts_txt_unusable", domain=domain, reason=str(exc))
            return None

    async def fetch(self, domain: str) -> StsPolicy:
        """Fetch and parse the policy of ``domain`` (``id`` unset, ``fetched_at`` now). Raises StsError."""
        url = policy_url(domain, self.port)
        connector = aiohttp.TCPConnector(ssl=self.ssl_context, resolver=_DnsResolver(self._resolver()), use_dns_cache=False)
        try:
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s), trust_env=False
            ) as session, session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise StsError(f"{url}: HTTP status {resp.status} (only 200 is taken, no redirects)")
                if resp.content_type != "text/plain":
                    raise StsError(f"{url}: Content-Type {resp.content_type!r} is not text/plain")
                if resp.content_length is not None and resp.content_length > POLICY_BYTES_MAX:
                    raise StsError(f"{url}: policy of {resp.content_length} bytes is larger than {POLICY_BYTES_MAX}")
                body = b""
                while len(body) <= POLICY_BYTES_MAX:
                    chunk = await resp.content.read(POLICY_BYTES_MAX + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
                if len(body) > POLICY_BYTES_MAX:
                    raise StsError(f"{url}: policy larger than {POLICY_BYTES_MAX} bytes")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise StsError(f"{url}: {type(exc).__name__}: {' '.join(str(exc).split())}") from exc
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StsError(f"{url}: policy is not UTF-8") from exc
        p = parse_policy(text)
        return StsPolicy(p.mode, p.mx, p.max_age, "", self.clock())

    def cached(self, domain: str) -> StsPolicy | None:
        """The cached policy of ``domain`` if it has not expired (memory, else the store)."""
        p = self._memory.get(domain)
        if p is None:
            try:
                data = self.store.load(domain)
            except OSError as exc:
                self.log.warning("mta_sts_cache_unreadable", domain=domain, error=str(exc))
                data = None
            if data is not None:
                try:
                    p = StsPolicy.from_json(data)
                except StsError as exc:
                    self.log.warning("mta_sts_cache_unreadable", domain=domain, error=str(exc))
                    p = None
            if p is not None:
                self._memory[domain] = p
        return p if p is not None and p.fresh(self.clock()) else None

    async def policy(self, domain: str) -> StsPolicy | None:
        """The policy that applies to mail for ``domain`` now, or None (see the module text)."""
        domain = domain.strip().lower().rstrip(".")
        lock = self._locks.setdefault(domain, asyncio.Lock())
        async with lock:
            cached = self.cached(domain)
            try:
                ident = await self.txt_id(domain)
            except StsError as exc:
                self.log.info("mta_sts_txt_failed", domain=domain, reason=str(exc), cached=cached is not None)
                return cached
            if ident is None:
                return cached
            if cached is not None and cached.id == ident:
                return cached
            try:
                fetched = await self.fetch(domain)
            except StsError as exc:
                self.log.warning("mta_sts_fetch_failed", domain=domain, reason=str(exc), cached=cached is not None)
                return cached
            p = StsPolicy(fetched.mode, fetched.mx, fetched.max_age, ident, fetched.fetched_at)
            self._memory[domain] = p
            try:
                self.store.save(domain, p.to_json(domain))
            except OSError as exc:  # the policy is used; only its survival across a restart is lost
                self.log.warning("mta_sts_cache_write_failed", domain=domain, error=str(exc))
            self.log.info("mta_sts_policy", domain=domain, id=ident, mode=p.mode, mx=list(p.mx), max_age=p.max_age)
            return p
