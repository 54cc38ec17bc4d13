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

Nothing is accepted that the delivery side could not send (issue 13.7): an address with any other
non-printing character (Unicode Cc, Cf, Zl, Zp, Co, Cn, and every space but U+0020 inside quotes: NBSP,
NEL, U+2028, bidi controls, zero-width characters), or one that aiosmtplib's ``quote_address`` refuses or
would rewrite, gets ``553 5.1.7`` as a sender and ``553 5.1.3`` as a recipient (RFC 5321 §4.1.2 Mailbox,
RFC 6531 §3.3 for UTF-8). A domain that has no IDNA2008 A-label form (RFC 5890, 5891: e.g. U+212A KELVIN
SIGN, which Python lower-cases to ``k``; an ``xn--`` label that does not decode) gets ``553 5.1.2`` as a
recipient domain and ``553 5.1.7`` as a sender's.

Domains are compared as A-labels (:func:`domain_to_ascii`): ASCII letters are lower-cased, any other label
is converted with the ``idna`` package (no UTS 46 mapping: nothing is folded into something else), so
``bücher.test`` and ``xn--bcher-kva.test`` are the same domain and ``banK.test`` (Kelvin) is no domain.

Authenticated senders (Postfix ``smtpd_sender_login_maps`` with ``reject_authenticated_sender_login_mismatch``):
with ``sender_logins`` set, an authenticated client may use as MAIL FROM only an address (or an address of a
``@domain``) that lists its login name; otherwise ``553 5.7.1 <addr>: Sender address rejected: not owned by
user USER``.

Must always hold: nothing here re-routes; a client outside ``mynetworks`` that has not authenticated can
only reach ``relay_domains``.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
import ssl
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from aiosmtplib.email import quote_address

from mtaq.core.errors import ConfigError
from mtaq.core.text import ASCII_CONTROL
from mtaq.edge.auth import PasswordFile
from mtaq.edge.canonical import Canonical
from mtaq.edge.canonical import domain_to_ascii as _canonical_domain_to_ascii
from mtaq.edge.headerchecks import HeaderChecks
from mtaq.edge.milter import MilterSettings

if TYPE_CHECKING:
    from mtaq.config import Config

__all__ = [
    "DEFAULT_MYNETWORKS",
    "MYNETWORKS_SEEN_MAX",
    "EdgePolicy",
    "IPNetwork",
    "RecipientVerifier",
    "address_problem",
    "domain_of",
    "domain_to_ascii",
    "parse_domains",
    "parse_networks",
    "parse_sender_logins",
    "server_tls_context",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class RecipientVerifier(Protocol):
    """Asks the next hop whether it takes a recipient (:class:`mtaq.delivery.verify.Verifier`, which the
    daemon passes in): ``verify(address)`` gives ``(status, text)``, status ``ok``, ``bounce`` or ``defer``."""

    async def verify(self, address: str) -> tuple[str, str]: ...


DEFAULT_MYNETWORKS: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
"""Loopback only: out of the box, only this host may relay."""

BAD_SYNTAX = "553 5.1.3 Error: malformed address"
NO_DOMAIN = "553 5.1.3 Error: address has no domain"
CONTROL = "553 5.1.3 Error: address contains a control character"
NOT_UTF8 = "553 5.1.3 Error: address is not valid UTF-8"
NEEDS_SMTPUTF8 = "553 5.6.7 Error: non-ASCII address requires SMTPUTF8"

# Unicode general categories no address may contain (RFC 5321 §4.1.2 allows printable US-ASCII only; RFC
# 6531 §3.3 adds UTF-8 letters and symbols, not controls, format characters, separators or unassigned and
# private-use code points). "Zs" is checked apart: U+0020 is allowed inside a quoted local part.
_UNSENDABLE_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn", "Cs", "Zl", "Zp"})
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

_SURROGATE_ESCAPE = re.compile("[\udc80-\udcff]")  # a byte that was not UTF-8 (aiosmtpd's surrogateescape)
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_DOMAIN_MAX = 255  # RFC 5321 §4.5.3.1.2, octets


def domain_of(address: str) -> str | None:
    """The domain of ``address`` (after its last ``@`` outside quotes), its ASCII letters lower-cased (only
    those: ``str.lower`` would turn U+212A KELVIN SIGN into ``k``); None if there is none.

    ``address`` is an addr-spec as aiosmtpd parsed it, without angle brackets, e.g.
    ``'"a@b"@[192.0.2.1]'`` -> ``'[192.0.2.1]'``, ``'"a@b"'`` -> None, ``'b!a'`` -> None.
    """
    if '"' not in address:  # no quoted part: the last "@" (a backslash escapes only inside quotes)
        at = address.rfind("@")
        if at < 0 or at == len(address) - 1:
            return None
        return address[at + 1 :].translate(_ASCII_LOWER)
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
    return address[at + 1 :].translate(_ASCII_LOWER)


@functools.lru_cache(maxsize=4096)  # domains repeat; a pure function of its arguments
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


# domain_to_ascii (IDNA2008 A-labels, RFC 5891 §4) lives in mtaq.edge.canonical, which this module
# imports; it is re-exported here, where the rest of the edge looks for it (one rule, one place).
domain_to_ascii = _canonical_domain_to_ascii


def unsendable_character(address: str) -> str | None:
    """The first character of ``address`` no address may contain, as ``U+XXXX``, or None.

    That is every code point of the Unicode categories Cc, Cf, Co, Cn, Cs, Zl and Zp, and every space
    separator (Zs) but U+0020, which only a quoted local part may hold (RFC 5321 §4.1.2 ``qtextSMTP``).
    """
    for ch in address:
        if " " < ch <= "~":
            continue
        category = unicodedata.category(ch)
        if category in _UNSENDABLE_CATEGORIES or (category == "Zs" and ch != " "):
            return f"U+{ord(ch):04X}"
    return None


def address_problem(address: str, *, smtputf8: bool, null_ok: bool = False, sender: bool | None = None) -> str | None:
    """The ``553`` reply for an address mtaq refuses, or None when it is acceptable.

    ``address`` as aiosmtpd parsed it (``"<>"`` or ``""`` for the null path); ``null_ok`` for MAIL FROM;
    ``sender`` (default: ``null_ok``) picks the enhanced codes of the checks of issue 13: ``5.1.7`` for a
    sender, ``5.1.3`` / ``5.1.2`` for a recipient (RFC 3463 §3.2). Non-UTF-8 bytes reach here as surrogate
    escapes (aiosmtpd decodes with ``surrogateescape``).
    """
    if address in ("", "<>"):
        return None if null_ok else NO_DOMAIN
    if ASCII_CONTROL.search(address) is not None:
        return CONTROL
    ascii_only = address.isascii()
    if not ascii_only and _SURROGATE_ESCAPE.search(address) is not None:
        return NOT_UTF8
    if not ascii_only and not smtputf8:
        return NEEDS_SMTPUTF8
    is_sender = null_ok if sender is None else sender
    role, code = ("sender", "5.1.7") if is_sender else ("recipient", "5.1.3")
    # ASCII without C0 controls and DEL holds nothing unsendable (its only Zs is U+0020, which is allowed).
    bad = None if ascii_only else unsendable_character(address)
    if bad is not None:
        return f"553 {code} Error: {role} address contains an invisible or control character ({bad})"
    domain = domain_of(address)
    if domain is None:
        return NO_DOMAIN
    if not _valid_domain(domain, utf8=smtputf8):
        return BAD_SYNTAX
    if domain_to_ascii(domain) is None:
        return (f"553 5.1.7 Error: sender domain {domain_to_show(domain)} is not a valid IDNA domain name" if is_sender
                else f"553 5.1.2 Error: recipient domain {domain_to_show(domain)} is not a valid IDNA domain name")
    if not _sendable(address):
        # What the delivery side (aiosmtplib) would refuse or rewrite would never leave as it was accepted.
        return f"553 {code} Error: {role} address cannot be relayed as written"
    return None


@functools.lru_cache(maxsize=4096)
def _sendable(address: str) -> bool:
    """Whether aiosmtplib's ``quote_address`` (what delivery puts on the MAIL/RCPT line) takes ``address``
    as it is (cached: senders and recipients repeat, and ``email.utils.parseaddr`` is not cheap)."""
    try:
        return bool(quote_address(address) == f"<{address}>")
    except ValueError:
        return False


def domain_to_show(domain: str) -> str:
    """``domain`` for a reply line: printable ASCII kept, anything else as ``\\uXXXX`` (replies are text
    the client may log; RFC 5321 §4.2 reply text is printable US-ASCII)."""
    return "".join(ch if " " < ch <= "~" else f"\\u{ord(ch):04x}" for ch in domain)


def parse_networks(values: list[str], key: str = "mynetworks") -> tuple[IPNetwork, ...]:
    """CIDR strings -> networks; a bare address is a /32 (/128). Raises ConfigError naming ``key``."""
    nets: list[IPNetwork] = []
    for v in values:
        try:
            nets.append(ipaddress.ip_network(v.strip(), strict=True))
        except ValueError as exc:
            raise ConfigError(f"{key}: {v!r} is not a network in CIDR notation ({exc})") from exc
    return tuple(nets)


def load_recipient_map(path: str) -> frozenset[str]:
    """Read a ``relay_recipient_maps`` file (Postfix's source format: ``KEY VALUE`` per line, ``#`` comments,
    blank lines; the key an address ``user@domain`` or ``@domain``, the value not used) -> its keys, the local
    part lower case, the domain in A-labels. Raises ConfigError naming the file and the line number of a bad
    line, or why it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64 * 1024 * 1024 + 1)
    except OSError as exc:
        raise ConfigError(f"relay_recipient_maps: {path}: {exc.strerror}") from None
    if len(raw) > 64 * 1024 * 1024:
        raise ConfigError(f"relay_recipient_maps: {path}: larger than 64 MiB")
    keys: set[str] = set()
    for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key = line.split()[0]
        local, at, domain = key.rpartition("@")
        ace = domain_to_ascii(domain.rstrip(".")) if at and domain else None
        if ace is None:
            raise ConfigError(f"relay_recipient_maps: {path}: line {n}: expected user@domain or @domain")
        keys.add(f"{local.lower()}@{ace}")
    return frozenset(keys)


def parse_domains(values: list[str], key: str = "relay_domains") -> tuple[str, ...]:
    """Domains as IDNA A-labels (:func:`domain_to_ascii`), without a trailing dot; ``.example.org`` stands
    for its subdomains. ``bücher.test`` is kept as ``xn--bcher-kva.test``.

    Raises ConfigError naming ``key`` for anything that is not a domain name or has no A-label form.
    """
    out: list[str] = []
    for v in values:
        d = v.strip().rstrip(".")
        dot = "." if d.startswith(".") else ""
        bare = d[1:] if dot else d
        ace = domain_to_ascii(bare) if bare and not bare.startswith("[") else None
        if ace is None or not _valid_domain(ace, utf8=False):
            raise ConfigError(f"{key}: {v!r} is not a domain name (IDNA2008, RFC 5891)")
        out.append(dot + ace)
    return tuple(out)


def _map_key(address: str) -> str:
    """The lookup form of a sender address or ``@domain``: ASCII letters lower-cased (as Postfix folds the
    keys of its tables), the domain as A-labels (:func:`domain_to_ascii`) when it has them."""
    local, at, domain = address.strip().rpartition("@")
    if not at:
        return address.translate(_ASCII_LOWER)
    return f"{local.translate(_ASCII_LOWER)}@{domain_to_ascii(domain.rstrip('.')) or domain.translate(_ASCII_LOWER)}"


def parse_sender_logins(table: dict[str, str | list[str]]) -> dict[str, frozenset[str]]:
    """``sender_login_map`` -> {lookup key: the owners' login names, lower-cased}. A value may be a list or
    one string of names separated by commas or spaces (Postfix's ``alice, bob``)."""
    out: dict[str, frozenset[str]] = {}
    for address, owners in table.items():
        names = owners.replace(",", " ").split() if isinstance(owners, str) else owners
        out[_map_key(address)] = frozenset(n.strip().lower() for n in names)
    return out


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
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":  # OpenSSL's X509_check_private_key
            raise ConfigError(f"tls_key_file does not match tls_cert_file: {key_file} is not the key of "
                              f"{cert_file}") from exc
        raise ConfigError(f"tls_cert_file/tls_key_file: cannot load {cert_file} with {key_file}: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"tls_cert_file/tls_key_file: cannot load {cert_file} with {key_file}: {exc}") from exc
    return ctx


MYNETWORKS_SEEN_MAX = 4096
"""Client addresses whose in_mynetworks answer is kept (the cache is emptied when it reaches this many)."""


@dataclass(frozen=True)
class EdgePolicy:
    """The settings of the SMTP edge, checked and loaded (networks parsed, TLS context and passwords read).

    The defaults are the safe ones: only loopback may relay, bare newlines in DATA are refused.
    """

    mynetworks: tuple[IPNetwork, ...] = DEFAULT_MYNETWORKS
    relay_domains: tuple[str, ...] = ()
    # relay_recipient_maps: the valid recipients of relay_domains ("user@domain" and "@domain" keys, lower
    # case, A-labels); None: every recipient of a relay domain is accepted.
    relay_recipients: frozenset[str] | None = field(default=None, repr=False)
    # reject_unverified_recipient: recipients of relay_domains from outside mynetworks, not authenticated,
    # are verified with the next hop at RCPT (a RecipientVerifier); the codes of the two refusals.
    verify_recipients: bool = False
    unverified_reject_code: int = 550
    unverified_defer_code: int = 450
    recipients_max: int = 1000
    connections_max: int = 500
    client_connections_per_minute_max: int = 120
    errors_max: int = 20
    bare_newline: Literal["reject", "normalize"] = "reject"
    tls_context: ssl.SSLContext | None = field(default=None, repr=False)
    passwords: PasswordFile | None = field(default=None, repr=False)
    delay_max_s: float = 7 * 86400.0  # RFC 4865 FUTURERELEASE: the longest delay a client may ask; 0: no limit
    # Postfix smtpd_client_connection_count_limit: connections at once from one client IP (mynetworks
    # exempt); 0: no limit.
    client_connections_max: int = 50
    # Per cent of connections_max (rounded down) that only mynetworks clients may use.
    mynetworks_reserve_percent: float = 10.0
    forbid_nul: Literal["reject", "strip"] = "reject"  # NUL octets in DATA: 550 5.6.0, or removed
    hopcount_limit: int = 50  # Received:/Delivered-To: fields a message may already have (554 5.4.6 beyond)
    received_private: bool = False  # smtpd_received_header_private: no client in authenticated mail's Received:
    header_checks: HeaderChecks | None = field(default=None, repr=False)  # header_checks rules; None: none
    milter: MilterSettings = field(default_factory=MilterSettings)  # smtpd_milters and milter_* (mtaq.edge.milter)
    # canonical_maps, sender_canonical_maps, recipient_canonical_maps (mtaq.edge.canonical); None: none
    canonical: Canonical | None = field(default=None, repr=False)
    error_sleep_s: float = 1.0  # Postfix smtpd_error_sleep_time: the wait before answering a failed AUTH
    auth_failures_per_minute_max: int = 10  # failed AUTH per client IP in any 60 s before 450 4.7.1; 0: none
    # Postfix smtpd_client_ipv6_prefix_length: the bits of an IPv6 client address that every per-client
    # limit counts as one client (mtaq.edge.limits.client_key).
    client_ipv6_prefix_length: int = 84
    # Postfix smtpd_sender_login_maps (+ reject_authenticated_sender_login_mismatch): lookup key
    # (parse_sender_logins) -> login names; None: authenticated clients may use any sender.
    sender_logins: dict[str, frozenset[str]] | None = field(default=None, repr=False)
    # in_mynetworks answers by client address (asked at every connection and RCPT; clients repeat)
    _mynetworks_seen: dict[str, bool] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: Config) -> EdgePolicy:
        """Build the policy from ``cfg``: reads the TLS files, the password file and the canonical maps.
        Raises ConfigError."""
        tls = server_tls_context(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file or cfg.tls_key_file else None
        passwords = PasswordFile.load(cfg.auth_password_file) if cfg.auth_password_file else None
        if passwords is not None and tls is None:
            # AUTH is only offered after STARTTLS (RFC 4954 §4, 538 5.7.11): without TLS it could never be used.
            raise ConfigError("auth_password_file: AUTH needs STARTTLS; set tls_cert_file and tls_key_file too")
        return cls(
            mynetworks=parse_networks(cfg.mynetworks),
            relay_domains=parse_domains(cfg.relay_domains),
            relay_recipients=load_recipient_map(cfg.relay_recipient_maps) if cfg.relay_recipient_maps else None,
            verify_recipients=cfg.reject_unverified_recipient,
            unverified_reject_code=cfg.unverified_recipient_reject_code,
            unverified_defer_code=cfg.unverified_recipient_defer_code,
            recipients_max=cfg.recipients_per_message_max,
            connections_max=cfg.connections_max,
            client_connections_per_minute_max=cfg.connections_per_client_per_minute_max,
            errors_max=cfg.smtp_server_errors_max,
            bare_newline=cfg.smtp_bare_newline,
            tls_context=tls,
            passwords=passwords,
            delay_max_s=cfg.delay_max_s,
            client_connections_max=cfg.smtpd_client_connection_count_limit,
            mynetworks_reserve_percent=cfg.smtpd_mynetworks_reserve_percent,
            forbid_nul=cfg.smtpd_forbid_nul,
            hopcount_limit=cfg.hopcount_limit,
            received_private=cfg.smtpd_received_header_private,
            header_checks=HeaderChecks.from_config(cfg.header_checks) if cfg.header_checks else None,
            milter=MilterSettings.from_config(cfg),
            canonical=Canonical.from_config(
                canonical_maps=cfg.canonical_maps, sender_canonical_maps=cfg.sender_canonical_maps,
                recipient_canonical_maps=cfg.recipient_canonical_maps, canonical_classes=list(cfg.canonical_classes),
                myhostname=cfg.hostname(), myorigin=cfg.myorigin),
            error_sleep_s=cfg.smtpd_error_sleep_time_s,
            auth_failures_per_minute_max=cfg.smtpd_client_auth_failure_rate_limit,
            client_ipv6_prefix_length=cfg.smtpd_client_ipv6_prefix_length,
            sender_logins=parse_sender_logins(cfg.sender_login_map) if cfg.sender_login_map else None,
        )

    def mynetworks_reserve(self) -> int:
        """The connections (of ``connections_max``) kept for mynetworks clients: the percentage, rounded down."""
        return int(self.connections_max * self.mynetworks_reserve_percent / 100)

    def mynetworks_key(self) -> str:
        """A short name of ``mynetworks`` (16 hex digits of a BLAKE2s digest of the networks in order): equal
        for the same networks, so that two processes can tell whether they exempt the same clients."""
        return hashlib.blake2s(",".join(str(n) for n in self.mynetworks).encode(), digest_size=8).hexdigest()

    def in_mynetworks(self, ip: str) -> bool:
        """Whether the client address ``ip`` (text; IPv4-mapped IPv6 counts as IPv4) is in ``mynetworks``;
        the last ``MYNETWORKS_SEEN_MAX`` answers are remembered."""
        seen = self._mynetworks_seen
        hit = seen.get(ip)
        if hit is None:
            if len(seen) >= MYNETWORKS_SEEN_MAX:
                seen.clear()
            hit = seen[ip] = self._in_mynetworks(ip)
        return hit

    def _in_mynetworks(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr.version == net.version and addr in net for net in self.mynetworks)

    def is_relay_domain(self, domain: str) -> bool:
        """Whether mail to ``domain`` (A-labels, lower case: :func:`domain_to_ascii`) is accepted from anyone."""
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
        ace = domain_to_ascii(domain)
        assert ace is not None  # address_problem refuses a domain without one
        if self.relay_recipients is not None and self.is_relay_domain(ace):
            # Postfix smtpd_reject_unlisted_recipient with relay_recipient_maps: whoever the client is.
            key = f"{address.rpartition('@')[0].lower()}@{ace}"
            if key not in self.relay_recipients and f"@{ace}" not in self.relay_recipients:
                return f"550 5.1.1 <{address}>: Recipient address rejected: User unknown in relay recipient table"
        if authenticated or self.in_mynetworks(client_ip) or self.is_relay_domain(ace):
            return None
        return f"554 5.7.1 <{address}>: Relay access denied"

    def verification_wanted(self, address: str, *, client_ip: str, authenticated: bool) -> bool:
        """Whether RCPT TO ``address`` (accepted by :meth:`rcpt_reply`) is to be verified with the next hop:
        ``verify_recipients`` is on, the domain is a relay domain, and the client is neither authenticated
        nor in mynetworks (Postfix's usual ``permit_mynetworks, permit_sasl_authenticated,
        reject_unauth_destination, reject_unverified_recipient``)."""
        if not self.verify_recipients or authenticated or self.in_mynetworks(client_ip):
            return False
        domain = domain_of(address)
        ace = domain_to_ascii(domain) if domain is not None else None
        return ace is not None and self.is_relay_domain(ace)

    def unverified_reply(self, address: str, status: str, text: str) -> str | None:
        """The RCPT reply for a verification outcome (Postfix's words): ``bounce`` -> ``550 5.1.1 <addr>:
        Recipient address rejected: undeliverable address: TEXT``; ``defer`` -> ``450 4.1.1 ... unverified
        address: TEXT`` (the codes are ``unverified_recipient_reject_code`` / ``_defer_code``); ``ok`` -> None."""
        if status == "ok":
            return None
        if status == "bounce":
            code, what = self.unverified_reject_code, "undeliverable address"
        else:
            code, what = self.unverified_defer_code, "unverified address"
        head = f"{code} {code // 100}.1.1 <{address}>: Recipient address rejected: {what}: "
        # One line of printable ASCII, the whole reply at most 510 characters (RFC 5321 §4.5.3.1.5: 512 with CRLF).
        flat = "".join(ch if " " <= ch <= "~" else "?" for ch in " ".join(text.split()))
        return head + flat[: max(0, 510 - len(head))]

    def login_owns(self, address: str, login: str) -> bool:
        """Whether ``sender_login_map`` lists ``login`` (compared without regard to case) among the owners of
        ``address``, looked up as the whole address, then as its ``@domain`` (Postfix
        ``smtpd_sender_login_maps``). False when no entry lists the address, and when there is no map.
        Also what DKIM signing asks of an authenticated client's ``From:`` address (:mod:`mtaq.edge.dkim`)."""
        if self.sender_logins is None or not login:
            return False
        key = _map_key(address)
        owners = self.sender_logins.get(key)
        if owners is None and "@" in key:
            owners = self.sender_logins.get("@" + key.rpartition("@")[2])
        return owners is not None and login.lower() in owners

    def sender_login_reply(self, sender: str, login: str) -> str | None:
        """The refusal of MAIL FROM ``sender`` by a client authenticated as ``login``, or None to accept it.

        Postfix ``reject_authenticated_sender_login_mismatch``: with ``sender_logins`` set, the address
        (then its ``@domain``) must list ``login`` among its owners (compared without regard to case);
        an address listed nowhere is owned by nobody. The null sender ``<>`` is not checked.
        """
        if self.sender_logins is None or sender in ("", "<>"):
            return None
        if self.login_owns(sender, login):
            return None
        return f"553 5.7.1 <{sender}>: Sender address rejected: not owned by user {domain_to_show(login)}"
