"""What the SMTP edge lets in: relay control, address checks, and the limits, TLS and AUTH it runs with.

Relaying (GUIDE §4, "not an open relay"): a recipient is accepted when the client's address is in
``mynetworks``, or the client has authenticated (RFC 4954), or the recipient's domain is one of
``relay_domains``; anything else is ``554 5.7.1 <addr>: Relay access denied`` at RCPT.

The domain is what follows the last ``@`` outside a quoted local part of the address as aiosmtpd parsed it.
A source route (``<@a,@b:user@c>``) is dropped by that parser and never looked at (RFC 5321 §4.1.1.3 and
Appendix C). ``%`` and ``!`` are never read as routing (no "percent hack", no UUCP bang path): a recipient
``user%elsewhere@ours`` is for ``ours`` and is passed on to the next hop exactly as written.

Address checks (MAIL and RCPT): an address with a control character or DEL, without a domain, or with a
malformed domain gets ``553 5.1.3`` (RFC 3463: bad destination mailbox address syntax); a non-ASCII address
without ``SMTPUTF8`` on MAIL gets ``553 5.6.7`` (RFC 6531 §3.5). The null reverse-path ``<>`` is a valid
sender (RFC 5321 §4.5.5) and never a valid recipient.

Must always hold: nothing here re-routes; a client outside ``mynetworks`` that has not authenticated can
only reach ``relay_domains``.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mtaq.core.errors import ConfigError
from mtaq.edge.auth import PasswordFile

if TYPE_CHECKING:
    from mtaq.config import Config

__all__ = [
    "DEFAULT_MYNETWORKS",
    "EdgePolicy",
    "IPNetwork",
    "address_problem",
    "domain_of",
    "parse_domains",
    "parse_networks",
    "server_tls_context",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_MYNETWORKS: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
"""Loopback only: out of the box, only this host may relay."""

BAD_SYNTAX = "553 5.1.3 Error: malformed address"
NO_DOMAIN = "553 5.1.3 Error: address has no domain"
CONTROL = "553 5.1.3 Error: address contains a control character"
NOT_UTF8 = "553 5.1.3 Error: address is not valid UTF-8"
NEEDS_SMTPUTF8 = "553 5.6.7 Error: non-ASCII address requires SMTPUTF8"

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_DOMAIN_MAX = 255  # RFC 5321 §4.5.3.1.2, octets


def domain_of(address: str) -> str | None:
    """The domain of ``address`` (after its last ``@`` outside quotes), lower-cased; None if there is none.

    ``address`` is an addr-spec as aiosmtpd parsed it, without angle brackets, e.g.
    ``'"a@b"@[192.0.2.1]'`` -> ``'[192.0.2.1]'``, ``'"a@b"'`` -> None, ``'b!a'`` -> None.
    """
    at = -1
    quoted = escaped = False
    for i, ch in enumerate(address):
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "@" and not quoted:
            at = i
    if at < 0 or at == len(address) - 1:
        return None
    return address[at + 1 :].lower()


def _valid_domain(domain: str, *, utf8: bool) -> bool:
    """RFC 5321 §4.1.2 Domain, or an address literal ``[IPv4]`` / ``[IPv6:...]`` (§4.1.3)."""
    if domain.startswith("["):
        if not domain.endswith("]"):
            return False
        inner = domain[1:-1]
        try:
            if inner.lower().startswith("ipv6:"):
                ipaddress.IPv6Address(inner[5:])
            else:
                ipaddress.IPv4Address(inner)
        except ValueError:
            return False
        return True
    if len(domain.encode("utf-8", "surrogateescape")) > _DOMAIN_MAX:
        return False
    for label in domain.split("."):
        if utf8 and not label.isascii():
            # An internationalised label (RFC 6531 §3.3): letters, digits and hyphens of any script.
            if not label or label[0] == "-" or label[-1] == "-" or not all(c.isalnum() or c == "-" for c in label):
                return False
        elif _LABEL.fullmatch(label) is None:
            return False
    return True


def address_problem(address: str, *, smtputf8: bool, null_ok: bool = False) -> str | None:
    """The ``553`` reply for an address mtaq refuses, or None when it is acceptable.

    ``address`` as aiosmtpd parsed it (``"<>"`` or ``""`` for the null path); ``null_ok`` for MAIL FROM.
    Non-UTF-8 bytes reach here as surrogate escapes (aiosmtpd decodes with ``surrogateescape``).
    """
    if address in ("", "<>"):
        return None if null_ok else NO_DOMAIN
    if any(ch < " " or ch == "\x7f" for ch in address):
        return CONTROL
    if any("\udc80" <= ch <= "\udcff" for ch in address):
        return NOT_UTF8
    if not address.isascii() and not smtputf8:
        return NEEDS_SMTPUTF8
    domain = domain_of(address)
    if domain is None:
        return NO_DOMAIN
    if not _valid_domain(domain, utf8=smtputf8):
        return BAD_SYNTAX
    return None


def parse_networks(values: list[str], key: str = "mynetworks") -> tuple[IPNetwork, ...]:
    """CIDR strings -> networks; a bare address is a /32 (/128). Raises ConfigError naming ``key``."""
    nets: list[IPNetwork] = []
    for v in values:
        try:
            nets.append(ipaddress.ip_network(v.strip(), strict=True))
        except ValueError as exc:
            raise ConfigError(f"{key}: {v!r} is not a network in CIDR notation ({exc})") from exc
    return tuple(nets)


def parse_domains(values: list[str], key: str = "relay_domains") -> tuple[str, ...]:
    """Domains, lower-cased, without a trailing dot; ``.example.org`` stands for its subdomains.

    Raises ConfigError naming ``key`` for anything that is not a domain name.
    """
    out: list[str] = []
    for v in values:
        d = v.strip().lower().rstrip(".")
        bare = d[1:] if d.startswith(".") else d
        if not bare or not _valid_domain(bare, utf8=False) or bare.startswith("["):
            raise ConfigError(f"{key}: {v!r} is not a domain name")
        out.append(d)
    return tuple(out)


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or newer) with the PEM certificate chain and key; for STARTTLS.

    Raises ConfigError naming ``tls_cert_file`` / ``tls_key_file`` when they cannot be loaded.
    """
    if bool(cert_file) != bool(key_file):
        raise ConfigError("tls_cert_file and tls_key_file: set both or neither")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except FileNotFoundError as exc:
        raise ConfigError(f"tls_cert_file/tls_key_file: {exc.filename}: {exc.strerror}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert_file/tls_key_file: cannot load {cert_file} with {key_file}: {exc}") from exc
    return ctx


@dataclass(frozen=True)
class EdgePolicy:
    """The settings of the SMTP edge, checked and loaded (networks parsed, TLS context and passwords read).

    The defaults are the safe ones: only loopback may relay, bare newlines in DATA are refused.
    """

    mynetworks: tuple[IPNetwork, ...] = DEFAULT_MYNETWORKS
    relay_domains: tuple[str, ...] = ()
    recipients_max: int = 1000
    connections_max: int = 500
    client_connections_per_minute_max: int = 120
    errors_max: int = 20
    bare_newline: Literal["reject", "normalize"] = "reject"
    tls_context: ssl.SSLContext | None = field(default=None, repr=False)
    passwords: PasswordFile | None = field(default=None, repr=False)
    delay_max_s: float = 7 * 86400.0  # RFC 4865 FUTURERELEASE: the longest delay a client may ask; 0: no limit

    @classmethod
    def from_config(cls, cfg: Config) -> EdgePolicy:
        """Build the policy from ``cfg``: reads the TLS files and the password file. Raises ConfigError."""
        tls = server_tls_context(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file or cfg.tls_key_file else None
        passwords = PasswordFile.load(cfg.auth_password_file) if cfg.auth_password_file else None
        if passwords is not None and tls is None:
            # AUTH is only offered after STARTTLS (RFC 4954 §4, 538 5.7.11): without TLS it could never be used.
            raise ConfigError("auth_password_file: AUTH needs STARTTLS; set tls_cert_file and tls_key_file too")
        return cls(
            mynetworks=parse_networks(cfg.mynetworks),
            relay_domains=parse_domains(cfg.relay_domains),
            recipients_max=cfg.recipients_per_message_max,
            connections_max=cfg.connections_max,
            client_connections_per_minute_max=cfg.connections_per_client_per_minute_max,
            errors_max=cfg.smtp_server_errors_max,
            bare_newline=cfg.smtp_bare_newline,
            tls_context=tls,
            passwords=passwords,
            delay_max_s=cfg.delay_max_s,
        )

    def in_mynetworks(self, ip: str) -> bool:
        """Whether the client address ``ip`` (text; IPv4-mapped IPv6 counts as IPv4) is in ``mynetworks``."""
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr.version == net.version and addr in net for net in self.mynetworks)

    def is_relay_domain(self, domain: str) -> bool:
        """Whether mail to ``domain`` (lower case) is accepted from anyone."""
        for d in self.relay_domains:
            if d.startswith(".") and domain.endswith(d):
                return True
            if domain == d:
                return True
        return False

    def rcpt_reply(self, address: str, *, client_ip: str, authenticated: bool, smtputf8: bool) -> str | None:
        """The refusal of RCPT TO ``address``, or None to accept it (address checks, then relay control)."""
        problem = address_problem(address, smtputf8=smtputf8)
        if problem is not None:
            return problem
        domain = domain_of(address)
        assert domain is not None
        if authenticated or self.in_mynetworks(client_ip) or self.is_relay_domain(domain):
            return None
        return f"554 5.7.1 <{address}>: Relay access denied"
