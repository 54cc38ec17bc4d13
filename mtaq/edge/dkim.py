"""DKIM signing (RFC 6376) of the mail the relay queues, with dkimpy; key files and DNS records for them.

Signing happens once, in the edge before the message is appended to the log (and in the queue for each DSN
it generates, through the callable :attr:`mtaq.queue.store.Queue.sign`), so that the log holds exactly what
is relayed: a retry days later sends the same signed bytes.

* Only mail handed in by those who may speak for the domain is signed (issue 32.1; rspamd ``dkim_signing``,
  OpenDKIM ``InternalHosts``; :meth:`Signer.permits`): an authenticated client whose login owns the
  ``From:`` address in ``sender_login_map`` (without a map: whose envelope sender has the ``From:`` domain),
  or a client in ``mynetworks`` (``dkim_sign_clients``). Mail from anyone else, such as the internet
  sending to ``relay_domains`` with mtaq as their MX, is relayed unsigned with a ``dkim_not_signed`` event:
  else anyone could have mtaq sign ``From: ceo@example.org`` (delivered, or returned in a DSN) and replay it
  past DMARC. The DSNs the queue generates are mtaq's own mail and are signed.
* The signing domain (``d=``) is chosen by the domain of the message's single ``From:`` address (RFC 5322
  §3.6.2), not the envelope sender: that is what DMARC aligns with (RFC 7489 §3.1.1). The key of that
  domain is used, else the key of its closest parent domain that has one (relaxed DMARC alignment, as
  rspamd's ``use_esld``); else the message is relayed unsigned. A message with no ``From:``, several
  ``From:`` fields or several addresses in it is relayed unsigned (a signature would make such mail look
  better than it is).
* Headers signed: those of RFC 6376 §5.4.1 (and Message-ID, MIME-Version, Content-Type,
  Content-Transfer-Encoding, every Resent-* but Resent-Bcc, every List-*), each as often as it occurs;
  ``From`` once more (over-signing, RFC 6376 §8.15), so that a second ``From:`` added later breaks the
  signature. ``Received:`` is not signed (RFC 6376 §5.4: trace fields change in transit).
* Canonicalization relaxed/relaxed (§3.4.2, §3.4.4); ``rsa-sha256`` for RSA keys of 2048 bits or more
  (RFC 8301), ``ed25519-sha256`` for Ed25519 keys (RFC 8463; dkimpy needs PyNaCl for it).
* The ``DKIM-Signature:`` field goes at the top of the message, above mtaq's ``Received:`` field.

* A body larger than ``receive_buffer_bytes`` (in the temporary file) is signed from that file in pieces
  (issue 32.6): dkimpy 1.1 hashes only a whole body, so :class:`RelaxedBodyHash` computes the relaxed body
  hash (RFC 6376 §3.4.4, §3.7) piece by piece, equal to dkimpy's for every body (tested), and dkimpy signs
  the header section with that ``bh=``. Memory per message signed: a piece and the header section.

Must always hold: mail from a client outside ``mynetworks`` that did not authenticate is never signed;
key material never reaches a log line, a repr or an error message; a key file is
readable only by the daemon's user (mode checked at start, with its type and size); a failure to sign one
message (a header dkimpy cannot parse) relays it unsigned with a ``dkim_sign_failed`` event, never
refuses or loses it.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import importlib.util
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from mtaq.config import Config
from mtaq.core.errors import ConfigError
from mtaq.edge.policy import domain_of, domain_to_ascii
from mtaq.logs import get_logger
from mtaq.storage.spill import BodyBuffer

__all__ = [
    "HEAD_BYTES_MAX",
    "RSA_BITS_MIN",
    "SIGN_CLIENTS",
    "DkimKey",
    "Origin",
    "RelaxedBodyHash",
    "Signer",
    "from_address",
    "from_domain",
    "generate_key",
    "headers_to_sign",
    "load_key",
    "normalize_domain",
    "public_value",
    "record_problem",
    "split_head",
    "txt_record",
    "valid_selector",
]

RSA_BITS_MIN = 2048  # RFC 8301 §3.2: signers SHOULD use at least 2048 bits
RSA_BITS_MAX = 8192
TXT_STRING_BYTES_MAX = 255  # one <character-string> of a TXT record (RFC 1035 §3.3)

# Over-signed (RFC 6376 §8.15; rspamd's oversign_headers): each once more than it appears, absent ones too, so
# that no such field can be added to a signed message (a second Subject on top, a Reply-To, a To, a Resent-From,
# a List-Unsubscribe link) for replay. Every field of RFC 6376 §5.4.1 and dkimpy's SHOULD list (Sender, the
# MIME fields, Message-ID, the Resent-* and List-* fields of RFC 5322 §3.6.6 and RFC 2369/2919), and
# List-Unsubscribe-Post (RFC 8058 §4: must be signed).
_OVERSIGN = (
    b"from", b"sender", b"reply-to", b"subject", b"date", b"message-id", b"to", b"cc", b"in-reply-to",
    b"references", b"mime-version", b"content-type", b"content-transfer-encoding", b"content-id",
    b"content-description", b"resent-date", b"resent-from", b"resent-sender", b"resent-to", b"resent-cc",
    b"resent-message-id", b"list-id", b"list-help", b"list-unsubscribe", b"list-unsubscribe-post",
    b"list-subscribe", b"list-post", b"list-owner", b"list-archive",
)
# Signed once per occurrence: those, and any other Resent-* and List-* field (matched by prefix below).
_SIGN = frozenset(_OVERSIGN)
# dkimpy's SHOULD_NOT list (Received, Return-Path, Bcc, Resent-Bcc, DKIM-Signature, ...), taken at the first use:
# dkimpy and cryptography are imported only when a key is configured (start time, issue 15.6).
_NEVER: frozenset[bytes] = frozenset()


def _never() -> frozenset[bytes]:
    global _NEVER
    if not _NEVER:
        import dkim

        _NEVER = frozenset(dkim.DKIM.SHOULD_NOT)
    return _NEVER


_DOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*")
_SELECTOR = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


@dataclass(frozen=True)
class DkimKey:
    """One signing key: ``domain`` (d=, lower case A-labels), ``selector`` (s=), ``algorithm`` (a=).

    ``secret`` is the private key as dkimpy takes it (RSA: PKCS#1 PEM; Ed25519: the base64 32-byte seed);
    it is left out of ``repr``.
    """

    domain: str
    selector: str
    algorithm: Literal["rsa-sha256", "ed25519-sha256"]
    bits: int
    secret: bytes = field(repr=False)


def _key_error(domain: str, msg: str) -> ConfigError:
    return ConfigError(f'dkim_keys."{domain}".key_file: {msg}')


def normalize_domain(domain: str) -> str | None:
    """``"Example.ORG."`` -> ``"example.org"``; a U-label name -> its A-label form (IDNA); None if it is not a
    domain name."""
    d = domain.strip().rstrip(".").lower()
    if not d.isascii():
        try:
            d = d.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    return d if _DOMAIN.fullmatch(d) else None


def valid_selector(selector: str) -> bool:
    """True for a selector of RFC 6376 §3.1 syntax (dot-separated labels of letters, digits, hyphens)."""
    return len(selector) <= 253 and _SELECTOR.fullmatch(selector) is not None


def load_key(domain: str, selector: str, key_file: str) -> DkimKey:
    """Read and check the key of ``dkim_keys."domain"`` (done once, at start).

    The file must be a regular file readable by its owner only (no group or other permission bits, as
    OpenSSH demands of private keys), hold an unencrypted PEM private key, RSA of at least 2048 bits
    (RFC 8301 §3.2) or Ed25519 (RFC 8463), and sign a test message with dkimpy. Raises ConfigError with a
    one-line message naming the key (never the key material).
    """
    import dkim
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    d = normalize_domain(domain)
    if d is None:
        raise ConfigError(f'dkim_keys."{domain}": not a domain name')
    if not valid_selector(selector):
        raise ConfigError(f'dkim_keys."{domain}".selector: {selector!r} is not a selector (RFC 6376 §3.1)')
    try:
        fd = os.open(key_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _key_error(domain, f"{key_file}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the name points to a moment later
        if not stat.S_ISREG(st.st_mode):
            raise _key_error(domain, f"{key_file} is not a regular file")
        if st.st_mode & 0o077:
            raise _key_error(
                domain,
                f"{key_file} has mode {stat.S_IMODE(st.st_mode):04o}: it must be readable only by the daemon "
                f"(chmod 600)",
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(64 * 1024)
    finally:
        os.close(fd)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise _key_error(domain, f"{key_file}: the key is encrypted (a passphrase cannot be asked at start)") from None
    except Exception:  # ValueError, UnsupportedAlgorithm: the message could quote the file; say less
        raise _key_error(domain, f"{key_file}: not a PEM private key") from None
    if isinstance(key, rsa.RSAPrivateKey):
        if key.key_size < RSA_BITS_MIN:
            raise _key_error(domain, f"{key_file}: RSA key of {key.key_size} bits, at least {RSA_BITS_MIN} needed")
        secret = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                   serialization.NoEncryption())
        out = DkimKey(d, selector, "rsa-sha256", key.key_size, secret)
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        if importlib.util.find_spec("nacl") is None:
            raise _key_error(domain, f"{key_file}: Ed25519 signing needs PyNaCl (pip install pynacl) or use an RSA key")
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
        out = DkimKey(d, selector, "ed25519-sha256", 256, base64.b64encode(raw))
    else:
        raise _key_error(domain, f"{key_file}: neither an RSA nor an Ed25519 key")
    try:
        _dkimpy_sign(out, b"From: <check@" + d.encode() + b">\r\n\r\nkey check\r\n", [b"from"])
    except dkim.DKIMException as exc:
        raise _key_error(domain, f"{key_file}: dkimpy cannot sign with it ({type(exc).__name__})") from None
    return out


def _dkimpy_sign(key: DkimKey, message: bytes, include: list[bytes]) -> bytes:
    import dkim

    sig: bytes = dkim.sign(
        message,
        key.selector.encode("ascii"),
        key.domain.encode("ascii"),
        key.secret,
        canonicalize=(b"relaxed", b"relaxed"),
        signature_algorithm=key.algorithm.encode("ascii"),
        include_headers=include,
    )
    return sig


def header_section(message: bytes) -> bytes:
    """The header section of ``message`` (up to, not including, the first empty line, lines ended by
    ``\r?\n`` as dkimpy reads them; all of it if none; empty when the message starts with an empty line)."""
    m = _BLANK_LINE.search(message)
    if m is None:
        return message
    return message[: m.start() + 1] if m.start() else b""


def _fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """(name, unfolded value) of each header field, in order."""
    out: list[tuple[bytes, bytes]] = []
    for line in re.split(rb"\r?\n", head):
        if line[:1] in (b" ", b"\t") and out:
            out[-1] = (out[-1][0], out[-1][1] + b" " + line.strip())
        elif b":" in line:
            name, _, value = line.partition(b":")
            out.append((name.strip(), value.strip()))
    return out


def headers_to_sign(head: bytes) -> list[bytes]:
    """The h= list (lower case) for a message with header section ``head`` (RFC 6376 §5.4, §5.4.2): each
    field of :data:`_SIGN`, Resent-* and List-* once per occurrence, in the order they appear, then each
    field of :data:`_OVERSIGN` once more, present or not (over-signed: none can be added, §8.15)."""
    names: list[bytes] = []
    for name, _ in _fields(head):
        n = name.lower()
        if n in _never():
            continue
        if n in _SIGN or n.startswith((b"resent-", b"list-")):
            names.append(n)
    return names + list(_OVERSIGN)


def from_address(head: bytes) -> str | None:
    """The one address of the one ``From:`` field of ``head`` (RFC 5322 §3.6.2), ``local@domain`` with the
    domain lower case in A-labels; None when there is no From, more than one, it does not hold exactly one
    address, or the domain is not a domain name."""
    froms = [v for n, v in _fields(head) if n.lower() == b"from"]
    if len(froms) != 1:
        return None
    addrs = [a for _, a in email.utils.getaddresses([froms[0].decode("utf-8", "surrogateescape")]) if a]
    if len(addrs) != 1 or "@" not in addrs[0]:
        return None
    local, _, domain = addrs[0].rpartition("@")
    d = normalize_domain(domain)
    return f"{local}@{d}" if d is not None else None


def from_domain(head: bytes) -> str | None:
    """The domain (lower case, A-labels) of the one address in the one ``From:`` field of ``head``
    (RFC 5322 §3.6.2); None when there is no From, more than one, or it does not hold exactly one address."""
    address = from_address(head)
    return address.rpartition("@")[2] if address is not None else None


@dataclass(frozen=True)
class Origin:
    """Who handed a message in, for the decision to sign it (:meth:`Signer.permits`).

    ``client``: ``ip:port`` (for the event); ``mynetworks``: the client address is in ``mynetworks``;
    ``login``: the name the session authenticated as ("" when it did not); ``mail_from``: the envelope
    sender ("" for ``<>``); ``owns``: ``sender_login_map``'s answer to "does this login own this address"
    (:meth:`mtaq.edge.policy.EdgePolicy.login_owns`), None when no map is configured.
    """

    client: str
    mynetworks: bool
    login: str
    mail_from: str
    owns: Callable[[str], bool] | None = None


SIGN_CLIENTS = ("authenticated", "mynetworks")
HEAD_BYTES_MAX = 1024 * 1024  # a spilled message's header section read to choose its key; beyond: unsigned


class RelaxedBodyHash:
    """The body hash (RFC 6376 §3.7) of the ``relaxed`` body canonicalization (§3.4.4), fed in pieces.

    ``update(piece)`` any number of times with the body (the octets after the header section's empty line),
    then ``digest()`` (once). Equal to dkimpy's (its ``canonicalize_body`` over its ``rfc822_parse``d body;
    checked in tests/test_dkim.py) for any body and any cut into pieces: line ends are ``\r?\n`` (made CRLF),
    whitespace before a line end is removed, runs of SP/HTAB become one SP, empty lines at the end are
    ignored, a last line without a line end gets one, an empty body hashes as empty. Memory: one piece and
    the unfinished line (the edge refuses lines over 1000 octets).
    """

    def __init__(self) -> None:
        self._hash = hashlib.sha256()  # rsa-sha256 and ed25519-sha256 both hash the body with SHA-256
        self._partial = b""  # the line not yet ended
        self._held = 0  # CRLFs not hashed yet: they end the last line and any empty lines after it (§3.4.4 c)
        self._any = False  # a non-empty line was hashed

    def update(self, piece: bytes) -> None:
        data = self._partial + piece if self._partial else piece
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        if not cut:
            return
        block = _WSP.sub(b" ", _WSP_EOL.sub(b"\r\n", _EOL.sub(b"\r\n", data[:cut])))
        end = len(block)
        while end >= 2 and block[end - 2 : end] == b"\r\n":
            end -= 2
        if end:
            self._hash.update(b"\r\n" * self._held)
            self._hash.update(block[:end])
            self._held = (len(block) - end) // 2
            self._any = True
        else:
            self._held += len(block) // 2

    def digest(self) -> bytes:
        if self._partial:
            self._hash.update(b"\r\n" * self._held + _WSP.sub(b" ", self._partial) + b"\r\n")
        elif self._any:
            self._hash.update(b"\r\n")
        return self._hash.digest()


_EOL = re.compile(rb"\r?\n")
_WSP_EOL = re.compile(rb"[\t ]+\r\n")
_WSP = re.compile(rb"[\t ]+")
_BLANK_LINE = re.compile(rb"(?:\A|\n)\r?\n")  # the empty line that ends the header section (dkimpy's rule)


def split_head(data: bytes) -> int | None:
    """The offset where the body of a message starting with ``data`` begins (after the empty line that ends
    the header section, lines ended by ``\r?\n`` as dkimpy reads them), or None if ``data`` has no such
    line."""
    m = _BLANK_LINE.search(data)
    return m.end() if m is not None else None


_PRESET: type | None = None


def _preset_body_hash_class() -> type:
    """A dkimpy ``DKIM`` whose ``bh=`` is set by the caller: its ``sign`` (key parsing, tags, folding, the
    header hash and the signature, unchanged) runs on the header section alone, and ``gen_header`` (the
    step that signs the tags) puts the given body hash in place of the empty body's."""
    global _PRESET
    if _PRESET is None:
        import dkim

        class PresetBodyHash(dkim.DKIM):  # type: ignore[misc]
            body_hash = b""

            def gen_header(self, fields: list[tuple[bytes, bytes]], *args: Any, **kwargs: Any) -> bytes:
                fields = [(k, self.body_hash if k == b"bh" else v) for k, v in fields]
                out: bytes = super().gen_header(fields, *args, **kwargs)
                return out

        _PRESET = PresetBodyHash
    return _PRESET


def _dkimpy_sign_pieces(key: DkimKey, pieces: Iterable[bytes]) -> bytes:
    """:func:`_dkimpy_sign` (with :func:`headers_to_sign`) of the message given in ``pieces``, in memory
    bounded by one piece and the header section: the body is hashed as it goes by
    (:class:`RelaxedBodyHash`), the header section is signed by dkimpy with that body hash."""
    head = b""
    body: RelaxedBodyHash | None = None
    for piece in pieces:
        if body is not None:
            body.update(piece)
            continue
        head += piece
        cut = split_head(head)
        if cut is not None:
            body = RelaxedBodyHash()
            body.update(head[cut:])
            head = head[:cut]
        elif len(head) > HEAD_BYTES_MAX:
            raise _HeadTooLarge(f"header section over {HEAD_BYTES_MAX} bytes")
    include = headers_to_sign(head)
    d = _preset_body_hash_class()(head, signature_algorithm=key.algorithm.encode("ascii"))
    d.body_hash = base64.b64encode((body if body is not None else RelaxedBodyHash()).digest())
    sig: bytes = d.sign(key.selector.encode("ascii"), key.domain.encode("ascii"), key.secret,
                        canonicalize=(b"relaxed", b"relaxed"), include_headers=include)
    return sig


class _HeadTooLarge(ValueError):
    pass


class Signer:
    """Signs messages with the key of their From: domain (see the module text). ``keys`` by domain;
    ``sign_clients``: the clients whose mail is signed (``dkim_sign_clients``: "authenticated", "mynetworks").

    Thread-safe (no state changes after construction): a large message may be signed in a worker thread.
    """

    def __init__(self, keys: Iterable[DkimKey] = (), sign_clients: Iterable[str] = SIGN_CLIENTS, *,
                 allow_username_mismatch: bool = False) -> None:
        self.keys: dict[str, DkimKey] = {k.domain: k for k in keys}
        self.sign_clients = frozenset(sign_clients)
        self.allow_username_mismatch = allow_username_mismatch
        self.log = get_logger()

    @classmethod
    def from_config(cls, cfg: Config) -> Signer:
        """A signer for the config's ``dkim_keys`` and ``dkim_sign_clients``; every key is loaded and checked
        now (:func:`load_key`). Raises ConfigError naming the first bad key."""
        keys = [load_key(domain, k.selector, k.key_file) for domain, k in cfg.dkim_keys.items()]
        return cls(keys, cfg.dkim_sign_clients, allow_username_mismatch=cfg.dkim_allow_username_mismatch)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def key_for(self, domain: str) -> DkimKey | None:
        """The key of ``domain``, else of its closest parent domain that has one, else None."""
        labels = domain.split(".")
        for i in range(len(labels)):
            key = self.keys.get(".".join(labels[i:]))
            if key is not None:
                return key
        return None

    def wants(self, head: bytes) -> DkimKey | None:
        """The key a message with header section ``head`` is signed with (None: relayed unsigned), whoever
        sent it (see :meth:`choose`)."""
        if not self.keys:
            return None
        domain = from_domain(head)
        return self.key_for(domain) if domain is not None else None

    def permits(self, origin: Origin, head: bytes) -> str | None:
        """Why mail from ``origin`` with header section ``head`` must not be signed, or None when it may be
        (rspamd ``dkim_signing``'s ``auth_only`` / ``sign_networks``, OpenDKIM's ``InternalHosts``):

        * an authenticated client (with "authenticated" in ``sign_clients``): with ``sender_login_map``, the
          login must own the ``From:`` address (the address, else its ``@domain``: the lookup of MAIL FROM);
          without it, the ``From:`` domain must be the envelope sender's (rspamd's default
          ``allow_hdrfrom_mismatch = false``) and the login an address at that domain, ``user@domain``
          (rspamd's default ``allow_username_mismatch = false``; ``dkim_allow_username_mismatch`` lifts this
          second rule, and then any login may sign for any keyed domain it names as envelope sender);
        * else a client in ``mynetworks`` (with "mynetworks" in ``sign_clients``): any ``From:``;
        * anyone else (the internet: mail received for ``relay_domains``): never.
        """
        if origin.login and "authenticated" in self.sign_clients:
            if origin.owns is not None:
                address = from_address(head)
                if address is None or not origin.owns(address):
                    return "From: address not owned by the login (sender_login_map)"
                return None
            env = domain_of(origin.mail_from) if origin.mail_from else None
            env_ace = domain_to_ascii(env.rstrip(".")) if env else None
            if env_ace is None or env_ace != from_domain(head):
                return "From: domain is not the envelope sender's"
            if not self.allow_username_mismatch:
                at = origin.login.rfind("@")
                login_ace = domain_to_ascii(origin.login[at + 1:].rstrip(".")) if at > 0 else None
                if login_ace is None or login_ace != env_ace:
                    return "login is not an address at the From: domain (no sender_login_map)"
            return None
        if origin.mynetworks and "mynetworks" in self.sign_clients:
            return None
        if origin.login:
            return "authenticated clients are not signed for (dkim_sign_clients)"
        if origin.mynetworks:
            return "mynetworks clients are not signed for (dkim_sign_clients)"
        return "client neither authenticated nor in mynetworks"

    def choose(self, head: bytes, origin: Origin) -> DkimKey | None:
        """The key to sign a message with header section ``head`` from ``origin`` with, or None. When its
        From: domain has a key but :meth:`permits` says no, a ``dkim_not_signed`` event (domain, client,
        sender, login, reason) is logged and the message is relayed unsigned."""
        key = self.wants(head)
        if key is None:
            return None
        reason = self.permits(origin, head)
        if reason is None:
            return key
        self.log.info("dkim_not_signed", domain=from_domain(head), client=origin.client,
                      sender=origin.mail_from, login=origin.login, reason=reason, action="relayed unsigned")
        return None

    def _failed(self, key: DkimKey, error: str) -> bytes:
        self.log.warning("dkim_sign_failed", domain=key.domain, selector=key.selector, error=error,
                         action="relayed unsigned")
        return b""

    def signature(self, message: bytes, key: DkimKey | None = None) -> bytes:
        """The ``DKIM-Signature:`` field (CRLF-terminated, folded) to put on top of ``message`` (the whole
        message, CRLF line ends), or b"" when it is not to be signed (no key for its From domain, or
        dkimpy could not sign it: then a ``dkim_sign_failed`` event is logged). ``key``: the one
        :meth:`choose` chose, if already known. Without ``key`` nobody's permission is asked: for mail
        generated here (DSNs). Costs one pass over the message (relaxed body hash, RFC 6376 §3.7) and one
        private-key operation."""
        import dkim

        head = header_section(message)
        if key is None:
            key = self.wants(head)
            if key is None:
                return b""
        try:
            return _dkimpy_sign(key, message, headers_to_sign(head))
        except (dkim.DKIMException, IndexError) as exc:
            return self._failed(key, type(exc).__name__)

    def signature_of_pieces(self, pieces: Iterable[bytes], key: DkimKey) -> bytes:
        """:meth:`signature` with ``key`` for a message given in pieces (a :class:`BodyBuffer`'s), in memory
        bounded by one piece and the header section (at most :data:`HEAD_BYTES_MAX`, else not signed):
        the body hash is computed as the pieces go by (:class:`RelaxedBodyHash`) and dkimpy signs the
        header section with it. Raises OSError if the pieces cannot be read."""
        import dkim

        try:
            return _dkimpy_sign_pieces(key, pieces)
        except (dkim.DKIMException, IndexError, _HeadTooLarge) as exc:
            return self._failed(key, type(exc).__name__)

    async def signature_of(self, content: bytes | BodyBuffer, origin: Origin) -> bytes:
        """:meth:`signature` for the content of a DATA command from ``origin`` (:class:`BodyBuffer` before its
        ``head`` is set), or b"" when :meth:`choose` finds no key or no permission. A body that went to the
        temporary file (larger than ``receive_buffer_bytes``) is signed from the file in pieces
        (:meth:`signature_of_pieces`), in a worker thread so that the event loop is not held up: memory per
        message signed stays bounded by a piece, not by ``message_size_limit_bytes``. A buffer that failed
        is not signed (the queue refuses it anyway)."""
        if not self.keys:
            return b""
        if isinstance(content, bytes):
            key = self.choose(header_section(content), origin)
            return self.signature(content, key) if key is not None else b""
        if content.failure is not None:
            return b""
        try:
            if not content.spilled:
                data = content.getvalue()
                key = self.choose(header_section(data), origin)
                return self.signature(data, key) if key is not None else b""
            head = b""
            for piece in content.pieces():
                head += piece
                if split_head(head) is not None or len(head) > HEAD_BYTES_MAX:
                    break
            key = self.choose(header_section(head), origin)
            if key is None:
                return b""
            return await asyncio.to_thread(self.signature_of_pieces, content.pieces(), key)
        except OSError:
            return b""  # the temporary file cannot be read back: the queue will answer 451

    def sign(self, message: bytes) -> bytes:
        """``message`` with its ``DKIM-Signature:`` field on top (unchanged when it is not signed). The hook
        the queue calls for the DSNs it generates (``Queue.sign``): mail made here, signed for anyone."""
        return self.signature(message) + message

    def sign_dsn(self, dsn: bytes, original: bytes) -> bytes:
        """The hook the queue calls for the DSNs it generates (``Queue.sign``): ``dsn`` signed (:meth:`sign`)
        only when ``original``, the message as stored, was signed at receipt, i.e. it begins with the
        ``DKIM-Signature:`` field mtaq put on top (a client's own field can never be first: mtaq's
        ``Received:`` line is). A DSN quotes its original (its headers at least, a success notice's too): for
        mail from outside ``dkim_sign_clients`` a signed DSN would carry the sender's forged ``From:`` and
        ``Subject:`` under a valid signature of our domain, for replay (issue 32.1). Such DSNs go unsigned."""
        return self.sign(dsn) if original[:15].lower() == b"dkim-signature:" else dsn


def generate_key(kind: Literal["rsa", "ed25519"] = "rsa", bits: int = RSA_BITS_MIN) -> tuple[bytes, str]:
    """A new private key as PKCS#8 PEM, and the value of its DNS TXT record (RFC 6376 §3.6.1,
    ``v=DKIM1; k=rsa; p=...``; RFC 8463 §4.2 for ``k=ed25519``). ``bits`` (RSA only): 2048 to 8192.
    Raises ValueError for a size out of range."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    if kind == "ed25519":
        ek = ed25519.Ed25519PrivateKey.generate()
        pem = ek.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        pub = ek.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return pem, f"v=DKIM1; k=ed25519; p={base64.b64encode(pub).decode('ascii')}"
    if not RSA_BITS_MIN <= bits <= RSA_BITS_MAX:
        raise ValueError(f"--bits {bits}: RSA keys of {RSA_BITS_MIN} to {RSA_BITS_MAX} bits")
    rk = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    pem = rk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    # p= is the DER SubjectPublicKeyInfo, base64 (RFC 6376 §3.6.1)
    spki = rk.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem, f"v=DKIM1; k=rsa; p={base64.b64encode(spki).decode('ascii')}"


def public_value(key: DkimKey) -> str:
    """The TXT record value that publishes ``key`` (``v=DKIM1; k=rsa; p=...``, RFC 6376 §3.6.1; ``k=ed25519``,
    RFC 8463 §4.2), as :func:`generate_key` prints it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    if key.algorithm.startswith("ed25519"):
        ek = ed25519.Ed25519PrivateKey.from_private_bytes(base64.b64decode(key.secret))
        pub = ek.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return f"v=DKIM1; k=ed25519; p={base64.b64encode(pub).decode('ascii')}"
    rk = serialization.load_pem_private_key(key.secret, password=None)
    spki = rk.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return f"v=DKIM1; k=rsa; p={base64.b64encode(spki).decode('ascii')}"


def record_problem(key: DkimKey, published: str | None) -> str | None:
    """Why the TXT record value ``published`` (its strings joined; None: no record at
    ``SELECTOR._domainkey.DOMAIN``) does not let a verifier check ``key``'s signatures, or None when it does:
    no record, no ``p=`` tag, an empty ``p=`` (revoked, RFC 6376 §3.6.1), a ``k=`` other than the key's,
    or the public key of another private key."""
    name = f"{key.selector}._domainkey.{key.domain}"
    if published is None:
        return f"no DKIM record at {name} (publish: {public_value(key)})"
    tags: dict[str, str] = {}
    for part in published.split(";"):
        tag, eq, value = part.partition("=")
        if eq:
            tags[tag.strip()] = "".join(value.split())
    kind = "ed25519" if key.algorithm.startswith("ed25519") else "rsa"
    if "p" not in tags:
        return f"the record at {name} has no p= tag"
    if not tags["p"]:
        return f"the record at {name} is revoked (empty p=)"
    if tags.get("k", "rsa") != kind:
        return f"the record at {name} is k={tags.get('k', 'rsa')}, the key is {kind}"
    wanted = public_value(key).rpartition("p=")[2]
    if tags["p"] != wanted:
        return f"the record at {name} publishes another key than key_file's (publish: {public_value(key)})"
    return None


def txt_record(domain: str, selector: str, value: str) -> str:
    """The zone file line ``SELECTOR._domainkey.DOMAIN. IN TXT "..." "..."`` for ``value``, split into
    strings of at most 255 bytes (RFC 1035 §3.3; RFC 6376 §3.6.2.2: a verifier joins them)."""
    parts = [value[i : i + TXT_STRING_BYTES_MAX] for i in range(0, len(value), TXT_STRING_BYTES_MAX)]
    name = f"{selector}._domainkey.{domain.rstrip('.')}."
    return f"{name} IN TXT " + " ".join(f'"{p}"' for p in parts)
