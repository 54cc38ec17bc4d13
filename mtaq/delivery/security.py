"""What a connection to a next hop must prove and present: TLS verification (RFC 6125) and SASL credentials.

Postfix's security levels beyond ``may``/``encrypt`` (``smtp_tls_security_level``, ``tls_policy_map``):

* ``verify``: the server's certificate chain ends at a trusted CA (``smtp_tls_CAfile``, else the system
  store), is valid now, and names the host that was connected to: the MX host name, or the name in brackets
  (Postfix ``smtp_tls_verify_cert_match = hostname``; the MX answer itself is trusted);
* ``secure``: the same chain check, and the certificate names the next-hop *destination*: the name in
  brackets, or for an MX destination the domain itself or any name under it (Postfix
  ``smtp_tls_secure_cert_match = nexthop, dot-nexthop``), so that a forged MX record cannot redirect mail.

Names are matched as RFC 6125 §6.4 says: DNS-IDs in subjectAltName, case-insensitively, a wildcard only as the
whole left-most label and matching one label (§6.4.3); the subject CN only when there is no DNS-ID (§6.4.4);
an IP address next hop against the iPAddress entries. Nothing here does I/O; the handshake is in
:mod:`mtaq.delivery.relay`.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtaq.delivery.dane import Tlsa

__all__ = ["Credentials", "HopSecurity", "cert_names_match", "forget_contexts", "verified_context"]


@dataclass(frozen=True, slots=True)
class Credentials:
    """A SASL user name and password for a next hop; ``key`` is the password-file entry they came from.

    The password never appears in ``repr`` (and so in no log line or exception text built from one).
    """

    key: str
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class HopSecurity:
    """Per-connection settings beyond the TLS level; part of the connection-cache key.

    ``wrapper``: TLS from the first byte (RFC 8314 §3.3 implicit TLS, port 465; Postfix
    ``smtp_tls_wrappermode``). ``match``: names the certificate must carry at ``verify``/``secure`` (a name
    starting with ``.`` matches any name under it). ``ca_file``: trust anchors ("" = system store).
    ``credentials``: AUTH (RFC 4954) after the last EHLO, when the server offers AUTH; never without TLS
    unless ``allow_plaintext_auth``. ``tlsa``: usable DANE-TA/DANE-EE records of the host (RFC 7672 §3):
    TLS is required and the chain the server sends must match one of them, for the names in ``match``.
    """

    wrapper: bool = False
    match: tuple[str, ...] = ()
    ca_file: str = ""
    credentials: Credentials | None = None
    allow_plaintext_auth: bool = False
    tlsa: tuple[Tlsa, ...] = ()  # DANE (RFC 7672): the chain must match one of these (level encrypt)


_CONTEXTS: dict[str, ssl.SSLContext] = {}


def verified_context(ca_file: str) -> ssl.SSLContext:
    """A client context that requires a certificate chain ending at a CA of ``ca_file`` (PEM; "" = the
    system store). The host name is not checked by OpenSSL here (:func:`cert_names_match` does, against
    one or several names); contexts are cached per file. Raises OSError/ssl.SSLError for a bad file."""
    ctx = _CONTEXTS.get(ca_file)
    if ctx is None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file or None)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        _CONTEXTS[ca_file] = ctx
    return ctx


def forget_contexts() -> None:
    """Drop the cached client contexts (``mtaq reload``): the next :func:`verified_context` reads its CA
    file again (a bundle replaced at the same path); the connections made before keep theirs."""
    _CONTEXTS.clear()


def _a_label(name: str) -> str:
    name = name.strip().rstrip(".").lower()
    try:
        return name.encode("idna").decode("ascii") if not name.isascii() else name
    except UnicodeError:
        return name


def _dns_match(pattern: str, presented: str) -> bool:
    """RFC 6125 §6.4.1/§6.4.3: ``presented`` (a DNS-ID, maybe ``*.`` wildcard) names ``pattern``; a
    ``pattern`` starting with a dot (Postfix dot-nexthop) accepts any name under it."""
    presented = _a_label(presented)
    if not presented:
        return False
    if pattern.startswith("."):
        if presented.startswith("*."):
            return ("." + presented[2:]).endswith(pattern)
        return presented.endswith(pattern)
    if presented.startswith("*."):
        head, dot, tail = pattern.partition(".")
        return bool(dot) and bool(head) and tail == presented[2:] and "." in tail
    return pattern == presented


def cert_names_match(cert: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether the validated certificate ``cert`` (``SSLSocket.getpeercert()``) names one of ``names``.

    DNS-IDs first; the subject common name only when the certificate has no DNS-ID (RFC 6125 §6.4.4); an
    IP address in ``names`` is compared with the iPAddress entries (§6.2.1 note).
    """
    sans = cert.get("subjectAltName", ())
    dns_ids = [v for k, v in sans if k == "DNS"]
    ip_ids = []
    for k, v in sans:
        if k == "IP Address":
            try:
                ip_ids.append(ipaddress.ip_address(v.strip()))
            except ValueError:
                continue
    if not dns_ids:
        dns_ids = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    for name in names:
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            pattern = ("." if name.startswith(".") else "") + _a_label(name.lstrip("."))
            if any(_dns_match(pattern, p) for p in dns_ids):
                return True
            continue
        if ip in ip_ids:
            return True
    return False
