"""DANE for SMTP (RFC 7672, RFC 6698, RFC 7671): TLSA records of an MX host and the check of its certificates.

Not wired into delivery yet: :mod:`~mtaq.delivery.relay` and :mod:`~mtaq.delivery.transport` do not call this.

**Lookup.** :class:`DnssecResolver` asks the configured resolver (``dns_nameservers``, else
/etc/resolv.conf) with DO and AD set (``use_edns(0, DO, 1232)``, ``flags = RD | AD``). mtaq does not
validate DNSSEC itself: like Postfix with ``smtp_dns_support_level = dnssec``, it believes the AD bit of a
validating resolver, and only of one listed in ``dnssec_trusted_resolvers`` (it should be on loopback: the AD
bit of a resolver across a network can be forged on the way). An answer from any other server counts as
insecure. :meth:`DnssecResolver.tlsa` turns the ``_PORT._tcp.HOST`` TLSA lookup into a :class:`DanePolicy`:

* ``dane``: a secure RRset with usable records (DANE-TA(2), DANE-EE(3); PKIX-TA(0)/PKIX-EE(1) are unusable
  for SMTP, RFC 7672 §3.1.3; so are unknown selectors and matching types): TLS is mandatory and the
  certificate chain must match (:func:`check_chain`), else that MX host is not used (defer ``4.7.5``);
* ``encrypt``: a secure RRset whose records are all unusable: mandatory TLS without authentication
  (RFC 7672 §2.2);
* ``none``: no TLSA records (NXDOMAIN or no data), or ``insecure``: records without a trusted AD bit;
  both mean no DANE: the usual policy (``may``) applies;
* ``defer``: the lookup failed (SERVFAIL, which is what a validating resolver answers for *bogus* data,
  timeout, ...): the host must not be used now, RFC 7672 §2.2.1; ``reply`` is ``451 4.7.5``.

DANE applies to an MX host only when the MX RRset of the destination and the host's address records were
secure (RFC 7672 §2.2.1-2.2.2; Exim's rule too): an attacker who forges an insecure MX or A answer chooses the
host, and with it the TLSA records. Check both with :meth:`DnssecResolver.is_secure` (``MX`` of the domain,
``A``/``AAAA`` of the host) before :meth:`DnssecResolver.tlsa`; the MX lookup of
:mod:`~mtaq.delivery.routing` does not say whether its answer was secure.

**Check.** :func:`check_chain` matches the peer's chain (DER certificates, leaf first) with the records:
selector 0 (whole certificate) or 1 (SubjectPublicKeyInfo), matching type 0 (exact), 1 (SHA-256), 2
(SHA-512). DANE-EE(3) matches the leaf only and ignores its names and dates (RFC 7672 §3.1.1). DANE-TA(2)
matches a certificate of the chain the server sent (it must send its trust anchor, §3.1.2); the chain from
the leaf up to it must be signed link by link, the leaf and intermediates must be within their dates (the
trust anchor's own dates are not checked, as for any PKIX trust anchor), and the leaf must name one of the
reference identifiers (the MX host name; §3.2.2-3.2.3: subjectAltName dNSName, else the CN; ``*`` only as the
whole leftmost label).

**The chain.** :func:`peer_chain` reads it from the connection's ``ssl.SSLObject``. Python 3.11 has no
public accessor: it uses ``get_unverified_chain()`` (public in 3.13), else the private
``_sslobj.get_unverified_chain()`` (present since 3.10); where neither exists it returns the leaf alone
(``getpeercert(binary_form=True)``), which is enough for DANE-EE(3) but not for DANE-TA(2) (a TA record then
only matches a self-issued leaf).

**What delivery should do** (RFC 7672 §2.2, Postfix ``smtp_tls_security_level = dane``): per MX host of a
secure MX RRset whose addresses were secure, ``policy = await resolver.tlsa(host, port)``; ``defer`` -> skip the host with
``policy.reply``; ``dane`` -> STARTTLS required (not offered: ``4.7.4``), SNI = the MX host name, the
handshake with ``CERT_NONE`` (the check is ours), then ``check_chain(peer_chain(ssl_object), policy.records,
names=[host])``; not ``ok`` -> quit and skip the host with ``451 4.7.5`` and ``match.reason``; ``encrypt`` ->
as the ``encrypt`` level; ``none``/``insecure`` -> the configured level.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import dns.asyncresolver
import dns.exception
import dns.flags
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from mtaq.config import Config, parse_nameserver
from mtaq.delivery.reply import Reply

__all__ = [
    "DANE_EE",
    "DANE_TA",
    "PKIX_EE",
    "PKIX_TA",
    "DaneMatch",
    "DanePolicy",
    "DnssecResolver",
    "SecureAnswer",
    "Tlsa",
    "check_chain",
    "name_matches",
    "peer_chain",
    "tlsa_name",
]

PKIX_TA, PKIX_EE, DANE_TA, DANE_EE = 0, 1, 2, 3
SELECTORS = (0, 1)  # full certificate, SubjectPublicKeyInfo
MATCHING = (0, 1, 2)  # exact, SHA-256, SHA-512
CHAIN_DEPTH_MAX = 10  # certificates followed from the leaf to a trust anchor


@dataclass(frozen=True, slots=True)
class Tlsa:
    """One TLSA record: certificate usage, selector, matching type, certificate association data."""

    usage: int
    selector: int
    mtype: int
    data: bytes

    @property
    def usable(self) -> bool:
        """DANE-TA(2) or DANE-EE(3) with a known selector and matching type (RFC 7672 §3.1.3)."""
        return self.usage in (DANE_TA, DANE_EE) and self.selector in SELECTORS and self.mtype in MATCHING

    def __str__(self) -> str:
        return f"{self.usage} {self.selector} {self.mtype} {self.data.hex()}"


@dataclass(frozen=True, slots=True)
class DanePolicy:
    """What the TLSA lookup of one MX host means for delivery (see the module text)."""

    status: Literal["dane", "encrypt", "none", "insecure", "defer"]
    records: tuple[Tlsa, ...] = ()  # the usable records (status dane)
    reply: Reply | None = None  # status defer: why the host must not be used now
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SecureAnswer:
    """An RRset (None: the name has no such records) and whether a trusted resolver said it was validated."""

    rrset: Any
    secure: bool
    server: str = ""


class DaneLookupError(Exception):
    """The lookup failed (no answer that says yes or no); str() says why."""


def tlsa_name(host: str, port: int = 25) -> str:
    """``_25._tcp.mx.example.org`` (RFC 7672 §2.2.3; no trailing dot)."""
    return f"_{port}._tcp.{host.rstrip('.')}"


class DnssecResolver:
    """Lookups that tell whether the answer was DNSSEC-validated, by the AD bit of a trusted resolver.

    ``nameservers``: (ip, port) pairs; [] means /etc/resolv.conf. ``trusted``: (ip, port) pairs whose AD bit
    is believed. ``timeout_s`` bounds a lookup as a whole.
    """

    def __init__(self, nameservers: Sequence[tuple[str, int]], trusted: Sequence[tuple[str, int]], *, timeout_s: float) -> None:
        self.nameservers = list(nameservers)
        self.trusted = {(ip, int(port)) for ip, port in trusted}
        self.timeout_s = timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> DnssecResolver:
        """The resolver of ``dns_nameservers`` (else /etc/resolv.conf), the AD bit believed from
        ``dnssec_trusted_resolvers``. Delivery should use DANE only when ``smtp_dns_support_level`` is dnssec."""
        return cls(
            [parse_nameserver(ns, cfg.dns_port) for ns in cfg.dns_nameservers],
            [parse_nameserver(ns, cfg.dns_port, key="dnssec_trusted_resolvers") for ns in cfg.dnssec_trusted_resolvers],
            timeout_s=cfg.dns_timeout_s,
        )

    def _get(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            try:
                r = dns.asyncresolver.Resolver(configure=not self.nameservers)
            except dns.exception.DNSException as exc:
                raise DaneLookupError(f"no DNS resolver: {exc}") from exc
            if self.nameservers:
                r.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in self.nameservers]
            r.use_edns(0, dns.flags.DO, 1232)
            r.flags = dns.flags.RD | dns.flags.AD
            r.lifetime = self.timeout_s
            r.timeout = min(r.timeout, self.timeout_s)
            self._resolver = r
        return self._resolver

    async def lookup(self, name: str, rdtype: str) -> SecureAnswer:
        """Records of ``name`` and whether they are secure. NXDOMAIN and no data give ``rrset`` None (their
        security comes from the AD bit too, when the response reached us). Raises DaneLookupError."""
        try:
            qname = dns.name.from_unicode(name) if not name.isascii() else dns.name.from_text(name)
        except dns.exception.DNSException as exc:
            raise DaneLookupError(f"bad name {name!r}: {exc}") from exc
        try:
            ans = await self._get().resolve(qname, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer) as exc:
            resp = _response_of(exc)
            secure = resp is not None and bool(resp.flags & dns.flags.AD) and self._only_trusted()
            return SecureAnswer(None, secure)
        except dns.exception.Timeout as exc:
            raise DaneLookupError(f"{name} {rdtype}: timed out") from exc
        except dns.exception.DNSException as exc:  # SERVFAIL (bogus data at a validator), refused, ...
            raise DaneLookupError(f"{name} {rdtype}: {' '.join(str(exc).split())}") from exc
        server = (str(ans.nameserver), int(ans.port or 0))
        secure = bool(ans.response.flags & dns.flags.AD) and server in self.trusted
        return SecureAnswer(ans.rrset, secure, f"{server[0]}:{server[1]}")

    def _only_trusted(self) -> bool:
        """Whether every configured server is trusted (a negative answer does not say which one answered)."""
        return bool(self.nameservers) and all((ip, int(port)) in self.trusted for ip, port in self.nameservers)

    async def is_secure(self, name: str, rdtype: str) -> bool:
        """Whether the answer for ``name``/``rdtype`` (positive or negative) is secure; False on failure
        (for deciding whether DANE applies use :meth:`secure`, which tells failure apart)."""
        try:
            return (await self.lookup(name, rdtype)).secure
        except DaneLookupError:
            return False

    async def secure(self, name: str, rdtype: str) -> bool:
        """Whether the answer for ``name``/``rdtype`` is secure. Raises DaneLookupError when there is no
        answer: a failed lookup is not "insecure" (RFC 7672 §2.1.1: that would let whoever can drop the
        DNSSEC queries turn DANE off)."""
        return (await self.lookup(name, rdtype)).secure

    async def tlsa(self, host: str, port: int = 25) -> DanePolicy:
        """The DANE policy of MX host ``host`` on ``port`` (see the module text)."""
        name = tlsa_name(host, port)
        try:
            ans = await self.lookup(name, "TLSA")
        except DaneLookupError as exc:
            return DanePolicy("defer", reply=Reply(451, "4.7.5", f"TLSA lookup error for {host}:{port}: {exc}"), detail=str(exc))
        if ans.rrset is None:
            return DanePolicy("none", detail=f"no TLSA records at {name}")
        if not ans.secure:
            return DanePolicy("insecure", detail=f"TLSA records at {name} are not DNSSEC-validated by a trusted resolver")
        records = tuple(
            Tlsa(int(r.usage), int(r.selector), int(r.mtype), bytes(r.cert))
            for r in ans.rrset
            if r.rdtype == dns.rdatatype.TLSA
        )
        usable = tuple(r for r in records if r.usable)
        if not usable:
            return DanePolicy("encrypt", detail=f"all {len(records)} TLSA records at {name} are unusable")
        return DanePolicy("dane", records=usable, detail=f"{len(usable)} usable TLSA records at {name}")


def _response_of(exc: dns.exception.DNSException) -> Any:
    """The DNS response inside NXDOMAIN / NoAnswer (dnspython keeps it), or None."""
    kwargs = getattr(exc, "kwargs", {}) or {}
    resp = kwargs.get("response")
    if resp is not None:
        return resp
    responses = kwargs.get("responses") or {}
    for r in responses.values():
        return r
    return None


# ---------------------------------------------------------------------------------------------- certificates
@dataclass(frozen=True, slots=True)
class DaneMatch:
    """The outcome of :func:`check_chain`: ``ok``, the record that matched and why (or why not)."""

    ok: bool
    reason: str
    record: Tlsa | None = None
    depth: int = -1  # index in the chain of the matched certificate
    notes: tuple[str, ...] = field(default=())


def _association(der: bytes, cert: x509.Certificate | None, selector: int, mtype: int) -> bytes | None:
    if selector == 0:
        data = der
    else:
        if cert is None:
            return None
        try:
            data = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        except (ValueError, TypeError):  # a key type cryptography cannot handle
            return None
    if mtype == 0:
        return data
    if mtype == 1:
        return hashlib.sha256(data).digest()
    return hashlib.sha512(data).digest()


def _matches(record: Tlsa, der: bytes, cert: x509.Certificate | None) -> bool:
    got = _association(der, cert, record.selector, record.mtype)
    return got is not None and got == record.data


def name_matches(pattern: str, host: str) -> bool:
    """A certificate name against a host name (RFC 7672 §3.2.3, RFC 6125): case-insensitive, trailing dots
    ignored; ``*`` only as the whole leftmost label, matching exactly one label."""
    p = pattern.strip().rstrip(".").lower()
    h = host.strip().rstrip(".").lower()
    if not p or not h:
        return False
    if p.startswith("*."):
        rest = p[2:]
        if "*" in rest or rest.count(".") < 1:
            return False
        first, dot, tail = h.partition(".")
        return bool(first) and bool(dot) and tail == rest
    return "*" not in p and p == h


def _cert_names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(n) for n in san.get_values_for_type(x509.DNSName)]
        if names:
            return names
    except x509.ExtensionNotFound:
        pass
    return [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def _in_dates(cert: x509.Certificate, now: dt.datetime) -> bool:
    return cert.not_valid_before_utc <= now <= cert.not_valid_after_utc


def _may_issue(cert: x509.Certificate, below: int) -> bool:
    """Whether ``cert`` may sign a certificate that has ``below`` intermediate CA certificates under it
    down to the leaf (RFC 5280 §4.2.1.9, §4.2.1.3): basicConstraints cA TRUE, keyCertSign when keyUsage is
    present, and pathLenConstraint >= ``below``. Without this, anyone holding an ordinary certificate from
    a DANE-TA anchor's CA could sign a certificate for any MX host (found by review)."""
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    if not bc.ca or (bc.path_length is not None and below > bc.path_length):
        return False
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return bool(ku.key_cert_sign)


def _path_to(certs: list[x509.Certificate | None], target: int) -> list[int] | None:
    """Indexes from the leaf (0) to ``target``, each signed by the next; None when there is no such path.

    The server's chain is searched (it may be out of order), at most CHAIN_DEPTH_MAX steps."""
    path = [0]
    while path[-1] != target:
        if len(path) > CHAIN_DEPTH_MAX:
            return None
        cur = certs[path[-1]]
        if cur is None:
            return None
        nxt = None
        for j in [target, *range(len(certs))]:
            cand = certs[j]
            if j in path or cand is None:
                continue
            try:
                cur.verify_directly_issued_by(cand)
            except (ValueError, TypeError, InvalidSignature):
                continue
            if not _may_issue(cand, len(path) - 1):
                continue  # an end-entity certificate (or a CA beyond its path length) signs nothing we accept
            nxt = j
            break
        if nxt is None:
            return None
        path.append(nxt)
    return path


def check_chain(
    chain: Sequence[bytes],
    records: Sequence[Tlsa],
    *,
    names: Sequence[str],
    now: dt.datetime | None = None,
) -> DaneMatch:
    """Whether the peer's ``chain`` (DER, leaf first) is authenticated by the usable ``records`` for the
    reference identifiers ``names`` (the MX host name first). See the module text."""
    if not chain:
        return DaneMatch(False, "the server sent no certificate")
    usable = [r for r in records if r.usable]
    if not usable:
        return DaneMatch(False, "no usable TLSA record")
    when = now or dt.datetime.now(dt.UTC)
    certs: list[x509.Certificate | None] = []
    for der in chain:
        try:
            certs.append(x509.load_der_x509_certificate(der))
        except ValueError:
            certs.append(None)
    # DANE-EE(3): the leaf, no name or date checks (RFC 7672 §3.1.1).
    for r in usable:
        if r.usage == DANE_EE and _matches(r, chain[0], certs[0]):
            return DaneMatch(True, f"DANE-EE({r}) matched the server certificate", r, 0)
    notes: list[str] = []
    leaf = certs[0]
    for r in usable:
        if r.usage != DANE_TA:
            continue
        for i, der in enumerate(chain):
            if not _matches(r, der, certs[i]):
                continue
            if leaf is None:
                notes.append("the server certificate cannot be parsed")
                continue
            path = _path_to(certs, i)
            if path is None:
                notes.append(f"DANE-TA({r}) matched certificate {i}, but the chain does not lead to it")
                continue
            stale = [k for k in path[:-1] if (c := certs[k]) is not None and not _in_dates(c, when)]
            if stale:
                notes.append(f"certificate {stale[0]} of the chain is expired or not yet valid")
                continue
            cert_names = _cert_names(leaf)
            if not any(name_matches(p, n) for p in cert_names for n in names):
                notes.append(f"the server certificate names {cert_names}, none of {list(names)}")
                continue
            return DaneMatch(True, f"DANE-TA({r}) matched certificate {i} of the chain", r, i, tuple(notes))
    reason = "; ".join(notes) if notes else "no TLSA record matched the server's certificate chain"
    return DaneMatch(False, reason, notes=tuple(notes))


def peer_chain(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> tuple[list[bytes], bool]:
    """The certificates the peer sent (DER, leaf first) and whether that is the whole chain (False: only the
    leaf could be read, DANE-TA(2) cannot be checked). See the module text."""
    for getter in (getattr(ssl_object, "get_unverified_chain", None), getattr(getattr(ssl_object, "_sslobj", None), "get_unverified_chain", None)):
        if getter is None:
            continue
        try:
            got = getter()
        except (AttributeError, ValueError, ssl.SSLError):
            continue
        if got is None:
            continue
        out = [c if isinstance(c, bytes) else bytes(c.public_bytes(_DER)) for c in got]
        if out:
            return out, True
    leaf = ssl_object.getpeercert(binary_form=True)
    return ([leaf] if leaf else []), False


_DER: int = int(getattr(getattr(ssl, "_ssl", None), "ENCODING_DER", 1))  # _ssl.ENCODING_DER (1 in CPython)
