"""DKIM signing (RFC 6376) of the mail the relay queues, with dkimpy; key files and DNS records for them.

Signing happens once, in the edge before the message is appended to the log (and in the queue for each DSN
it generates, through the callable :attr:`mtaq.queue.store.Queue.sign`), so that the log holds exactly what
is relayed: a retry days later sends the same signed bytes.

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

Must always hold: key material never reaches a log line, a repr or an error message; a key file is
readable only by the daemon's user (mode checked at start, with its type and size); a failure to sign one
message (a header dkimpy cannot parse) relays it unsigned with a ``dkim_sign_failed`` event, never
refuses or loses it.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import importlib.util
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from mtaq.config import Config
from mtaq.core.errors import ConfigError
from mtaq.logs import get_logger
from mtaq.storage.spill import BodyBuffer

__all__ = [
    "RSA_BITS_MIN",
    "DkimKey",
    "Signer",
    "from_domain",
    "generate_key",
    "headers_to_sign",
    "load_key",
    "normalize_domain",
    "txt_record",
    "valid_selector",
]

RSA_BITS_MIN = 2048  # RFC 8301 §3.2: signers SHOULD use at least 2048 bits
RSA_BITS_MAX = 8192
TXT_STRING_BYTES_MAX = 255  # one <character-string> of a TXT record (RFC 1035 §3.3)

# RFC 6376 §5.4.1, plus the MIME fields and Message-ID; Resent-* and List-* are matched by prefix below.
_SIGN = frozenset({
    b"from", b"reply-to", b"subject", b"date", b"to", b"cc", b"in-reply-to", b"references", b"message-id",
    b"mime-version", b"content-type", b"content-transfer-encoding",
})
# dkimpy's SHOULD_NOT list (Received, Return-Path, Bcc, Resent-Bcc, DKIM-Signature, ...), taken at the first use:
# dkimpy and cryptography are imported only when a key is configured (start time, issue 15.6).
_NEVER: frozenset[bytes] = frozenset()


def _never() -> frozenset[bytes]:
    global _NEVER
    if not _NEVER:
        import dkim

        _NEVER = frozenset(dkim.DKIM.SHOULD_NOT)
    return _NEVER

_OVERSIGN = (b"from",)
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
    """The header section of ``message`` (up to, not including, the empty line; all of it if none)."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        i = message.find(sep)
        if i >= 0:
            return message[: i + len(sep) // 2]
    return message


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
    field of :data:`_SIGN`, Resent-* and List-* once per occurrence, in the order they appear, and ``from``
    once more (over-signed)."""
    names: list[bytes] = []
    for name, _ in _fields(head):
        n = name.lower()
        if n in _never():
            continue
        if n in _SIGN or n.startswith((b"resent-", b"list-")):
            names.append(n)
    return names + [n for n in _OVERSIGN if n in names]


def from_domain(head: bytes) -> str | None:
    """The domain (lower case, A-labels) of the one address in the one ``From:`` field of ``head``
    (RFC 5322 §3.6.2); None when there is no From, more than one, or it does not hold exactly one address."""
    froms = [v for n, v in _fields(head) if n.lower() == b"from"]
    if len(froms) != 1:
        return None
    addrs = [a for _, a in email.utils.getaddresses([froms[0].decode("utf-8", "surrogateescape")]) if a]
    if len(addrs) != 1 or "@" not in addrs[0]:
        return None
    return normalize_domain(addrs[0].rpartition("@")[2])


class Signer:
    """Signs messages with the key of their From: domain (see the module text). ``keys`` by domain.

    Thread-safe (no state changes after construction): a large message may be signed in a worker thread.
    """

    def __init__(self, keys: Iterable[DkimKey] = ()) -> None:
        self.keys: dict[str, DkimKey] = {k.domain: k for k in keys}
        self.log = get_logger()

    @classmethod
    def from_config(cls, cfg: Config) -> Signer:
        """A signer for the config's ``dkim_keys``; every key is loaded and checked now (:func:`load_key`).
        Raises ConfigError naming the first bad key."""
        return cls(load_key(domain, k.selector, k.key_file) for domain, k in cfg.dkim_keys.items())

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
        """The key a message with header section ``head`` is signed with (None: relayed unsigned)."""
        if not self.keys:
            return None
        domain = from_domain(head)
        return self.key_for(domain) if domain is not None else None

    def signature(self, message: bytes, key: DkimKey | None = None) -> bytes:
        """The ``DKIM-Signature:`` field (CRLF-terminated, folded) to put on top of ``message`` (the whole
        message, CRLF line ends), or b"" when it is not to be signed (no key for its From domain, or
        dkimpy could not sign it: then a ``dkim_sign_failed`` event is logged). ``key``: the one
        :meth:`wants` chose, if already known. Costs one pass over the message (relaxed body hash, RFC 6376
        §3.7) and one private-key operation."""
        import dkim

        head = header_section(message)
        if key is None:
            key = self.wants(head)
            if key is None:
                return b""
        try:
            return _dkimpy_sign(key, message, headers_to_sign(head))
        except dkim.DKIMException as exc:
            self.log.warning("dkim_sign_failed", domain=key.domain, selector=key.selector,
                             error=type(exc).__name__, action="relayed unsigned")
            return b""

    async def signature_of(self, content: bytes | BodyBuffer) -> bytes:
        """:meth:`signature` for the content of a DATA command (:class:`BodyBuffer` before its ``head`` is
        set). A body that went to the temporary file (larger than ``receive_buffer_bytes``) is assembled in
        memory to be signed (a known cost: up to ``message_size_limit_bytes`` per such message while it is
        signed; dkimpy has no streaming interface), and signed in a worker thread so that the event loop is
        not held up. A buffer that failed is not signed (the queue refuses it anyway)."""
        if not self.keys:
            return b""
        if isinstance(content, bytes):
            return self.signature(content)
        if content.failure is not None:
            return b""
        key = None
        try:
            first = next(iter(content.pieces()), b"")
            if b"\r\n\r\n" in first or b"\n\n" in first:  # the whole header section is in the first piece
                key = self.wants(header_section(first))
                if key is None:
                    return b""
            if not content.spilled:
                return self.signature(content.getvalue(), key)
            data = b"".join(content.pieces())
        except OSError:
            return b""  # the temporary file cannot be read back: the queue will answer 451
        return await asyncio.to_thread(self.signature, data, key)

    def sign(self, message: bytes) -> bytes:
        """``message`` with its ``DKIM-Signature:`` field on top (unchanged when it is not signed). The hook
        the queue calls for the DSNs it generates (``Queue.sign``)."""
        return self.signature(message) + message


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


def txt_record(domain: str, selector: str, value: str) -> str:
    """The zone file line ``SELECTOR._domainkey.DOMAIN. IN TXT "..." "..."`` for ``value``, split into
    strings of at most 255 bytes (RFC 1035 §3.3; RFC 6376 §3.6.2.2: a verifier joins them)."""
    parts = [value[i : i + TXT_STRING_BYTES_MAX] for i in range(0, len(value), TXT_STRING_BYTES_MAX)]
    name = f"{selector}._domainkey.{domain.rstrip('.')}."
    return f"{name} IN TXT " + " ".join(f'"{p}"' for p in parts)
