"""Delivery to the next hop over SMTP (aiosmtplib), one reused connection per worker.

The transaction is driven command by command (MAIL, RCPT per recipient, DATA) so that every recipient gets
its own final reply (RFC 5321 §3.3): a RCPT refusal is that recipient's reply; for the accepted ones the
reply to the end of DATA is. 2xx -> delivered, 5xx -> failed, 4xx -> deferred; a lost connection or a
timeout before the final reply -> deferred (RFC 1047: the remote may have taken it; we retry, at-least-once).
An address aiosmtplib refuses to put on a command line (:func:`local_address_refusal`) is a permanent local
refusal, decided before anything is sent: ``553 5.1.7`` for every recipient when it is the sender,
``553 5.1.3`` for that recipient; a retry could never change it, so it bounces.

Third-party exceptions are converted here and only here (httpcore's ``map_exceptions`` habit).
"""

from __future__ import annotations

import asyncio
import functools
import re
import socket
import ssl
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Literal, Protocol, cast, runtime_checkable

import aiosmtplib
from aiosmtplib.email import quote_address

from mtaq.core.errors import CorruptRecord, StorageError
from mtaq.core.octets import crlf_only, stuff
from mtaq.delivery.reply import Reply
from mtaq.delivery.security import HopSecurity, cert_names_match, verified_context

__all__ = ["Content", "DotStuffer", "HopUnusable", "RelayConnection", "Reply", "TlsLevel", "classify",
           "local_address_refusal", "split_enhanced", "wire_content"]

_ENHANCED = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})\s+")


def split_enhanced(code: int, message: str) -> Reply:
    """Split an RFC 3463 enhanced status code off the reply text; supply a generic one when absent."""
    text = " ".join(message.split()) + " "
    m = _ENHANCED.match(text)
    if m:
        return Reply(code, f"{m.group(1)}.{m.group(2)}.{m.group(3)}", text[m.end() :].strip())
    text = text.strip()
    klass = str(code)[0] if code else "4"
    return Reply(code, f"{klass}.0.0", text)


def _xtext(value: str) -> str:
    """RFC 3461 §4 xtext: '+', '=', controls and non-ASCII as +HH."""
    return "".join(
        ch if 33 <= ord(ch) <= 126 and ch not in "+=" else "".join(f"+{b:02X}" for b in ch.encode())
        for ch in value
    )


def _dsn_options(params: Sequence[tuple[str, str]], keys: tuple[str, ...]) -> list[str]:
    out = []
    for k, v in params:
        k = k.upper()
        if k in keys:
            if k in ("ENVID",):
                v = _xtext(v)
            elif k == "ORCPT":
                kind, _, addr = v.partition(";")
                v = f"{kind};{_xtext(addr)}"
            out.append(f"{k}={v}")
    return out


def local_address_refusal(address: str, *, sender: bool) -> Reply | None:
    """The permanent reply for an address aiosmtplib would refuse to send, or None when it can be sent.

    aiosmtplib's ``quote_address`` raises ValueError for whitespace (Python's ``\\s``: NBSP, NEL, U+2028
    ...) and ``<>"`` outside a quoted local part, before anything is sent; an address it would rewrite
    (``email.utils.parseaddr`` drops what follows a comma) is refused too, so mail never goes to another
    address than the one accepted. The null sender (``""`` or aiosmtpd's ``"<>"``) is fine.
    Sender: ``553 5.1.7`` (bad sender mailbox syntax); recipient: ``553 5.1.3`` (RFC 3463 §3.2).
    """
    if sender and address in ("", "<>"):
        return None
    return _local_refusal(address, sender)


@functools.lru_cache(maxsize=4096)  # senders and recipients repeat; a pure function (Reply is immutable)
def _local_refusal(address: str, sender: bool) -> Reply | None:
    try:
        sendable = quote_address(address) == f"<{address}>"
        why = "would be rewritten"
    except ValueError as exc:
        sendable, why = False, str(exc)
    if sendable:
        return None
    if sender:
        return Reply(553, "5.1.7", f"sender address refused before sending ({why})")
    return Reply(553, "5.1.3", f"recipient address refused before sending ({why})")


def classify(code: int) -> str:
    """delivered / deferred / failed for an SMTP reply code."""
    if 200 <= code < 300:
        return "delivered"
    if 500 <= code < 600:
        return "failed"
    return "deferred"


TlsLevel = Literal["none", "may", "encrypt", "dane", "verify", "secure"]
_MANDATORY = ("encrypt", "verify", "secure")  # no plaintext fallback at these levels


class HopUnusable(Exception):
    """The next hop cannot be used for a transaction; ``reply`` is the (temporary) reason."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.text)
        self.reply = reply


class _TlsFailed(Exception):
    """STARTTLS was refused or its handshake failed (the connection is unusable)."""


class _AuthFailed(HopUnusable):
    """The server refused AUTH (RFC 4954 §6): ``code`` is its reply code (535, 454, ...)."""

    def __init__(self, reply: Reply, code: int) -> None:
        super().__init__(reply)
        self.code = code


def _cert_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error behind ``exc`` (aiosmtplib wraps the one of implicit TLS)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def _hello(c: aiosmtplib.SMTP) -> None:
    try:
        await c.ehlo()
    except aiosmtplib.SMTPHeloError as exc:
        if not 500 <= exc.code < 600:
            raise
        await c.helo()  # RFC 5321 §3.2: a server that does not know EHLO


def _opportunistic_context() -> ssl.SSLContext:
    """TLS without certificate checks, as Postfix's ``smtp_tls_security_level = may`` and ``encrypt``
    (RFC 3207 §4.1 leaves the decision to the client; RFC 7435 opportunistic security)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class RelayConnection:
    """One SMTP client connection to one address of a next hop, opened on demand and reused between messages.

    ``address`` is what is connected to (an IP address or a name for the system resolver), ``hostname`` the
    name it was found under (an MX host name; used for SNI and in ``name``, Postfix's ``relay=`` form
    ``host[address]:port``). ``tls`` is the TLS policy (RFC 3207; Postfix's security levels):

    * ``may``: STARTTLS when the server offers it, certificate not verified; a refused STARTTLS or a failed
      handshake falls back to a new plaintext connection (as Postfix does);
    * ``encrypt``: the same, but no plaintext: not offered -> ``450 4.7.4 TLS is required, but was not
      offered by host …``; refused or failed -> ``450 4.7.5 Cannot start TLS: …`` (Postfix's wording and
      codes, RFC 3463 X.7.4 "security features not supported", X.7.5 "cryptographic failure");
    * ``verify`` / ``secure``: as ``encrypt``, and the certificate chain must end at a trusted CA
      (``450 4.7.5 Server certificate not trusted: …`` otherwise) and name ``security.match`` (RFC 6125;
      ``450 4.7.5 Server certificate not verified: …``); the ``tls`` label is then ``TLSv1.3 verified``;
    * ``none``: never STARTTLS.

    ``security`` (:class:`~mtaq.delivery.security.HopSecurity`) adds implicit TLS (RFC 8314, port 465: TLS
    before the greeting; levels below ``encrypt`` count as ``encrypt`` there, as no plaintext is possible)
    and AUTH credentials (RFC 4954, after the last EHLO; a refusal is ``454 4.7.0 SASL authentication
    failed; server … said: 535 …`` and ``auth_failure`` holds the server's code).
    """

    def __init__(
        self,
        address: str,
        port: int,
        *,
        helo_name: str,
        timeout_s: float,
        hostname: str | None = None,
        tls: TlsLevel = "may",
        security: HopSecurity | None = None,
        bind_address: str = "",
    ) -> None:
        self.address = address
        self.bind_address = bind_address  # the local address connected from (smtp_bind_address); "": any
        self.port = port
        self.hostname = hostname or address
        self.helo_name = helo_name
        self.timeout_s = timeout_s
        self.tls: TlsLevel = tls
        self.security = security or HopSecurity()
        self.auth_failure = 0  # the server's reply code when AUTH was refused in the last send, else 0
        # The last send could not talk to the host at all (refused, timed out, a greeting other than 2xx):
        # a whole failed cohort for the destination's back-off (mtaq.delivery.backoff).
        self.connect_failed = False
        self._client: aiosmtplib.SMTP | None = None
        self.remote_dsn = False  # whether the next hop offered DSN in the last transaction
        self.tls_version = ""  # e.g. "TLSv1.3" while the connection is encrypted, "" in plaintext
        # The TLS version of the session last opened, kept after it ends (an AUTH refusal or a failure met
        # in it is reported with the TLS it had); "" once a new one starts, until it is encrypted.
        self.session_tls = ""

    @property
    def name(self) -> str:
        """``host[address]:port``, like Postfix's ``relay=``."""
        return f"{self.hostname}[{self.address}]:{self.port}"

    def _context(self, tls: TlsLevel) -> ssl.SSLContext:
        if tls in ("verify", "secure"):
            return verified_context(self.security.ca_file)
        return _opportunistic_context()

    async def _socket(self) -> socket.socket:
        """A TCP connection to ``address``:``port`` (for implicit TLS, so that SNI names ``hostname``)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.address, self.port, type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"no address for {self.address}")
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            if self.bind_address:
                sock.bind((self.bind_address, 0))
            async with asyncio.timeout(self.timeout_s):
                await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return sock

    def _peer(self, c: aiosmtplib.SMTP, tls: TlsLevel) -> str:
        """The ``tls`` label of an encrypted connection after checking the certificate's names at
        ``verify``/``secure`` (RFC 6125; the chain was checked in the handshake). Raises HopUnusable
        ``4.7.5 Server certificate not verified`` when no name matches (Postfix's wording)."""
        ssl_obj = c.get_transport_info("ssl_object")
        version = (ssl_obj.version() if ssl_obj is not None else None) or "TLS"
        if self.security.tlsa:
            # DANE (RFC 7672 §3): the chain the server sent must match a TLSA record; PKIX trust is not asked.
            from mtaq.delivery.dane import check_chain, peer_chain  # dnspython, cryptography: only for DANE

            chain = peer_chain(ssl_obj)[0] if ssl_obj is not None else []
            refs = self.security.match or (self.hostname,)
            found = check_chain(chain, self.security.tlsa, names=refs)
            if not found.ok:
                raise HopUnusable(Reply(450, "4.7.5", f"Server certificate not trusted: host {self.name}: "
                                                      f"DANE: {found.reason}"))
            return f"{version} verified (DANE)"
        if tls not in ("verify", "secure"):
            return version  # encrypted, certificate not checked (Postfix: "Untrusted"/"Anonymous")
        cert = ssl_obj.getpeercert() if ssl_obj is not None else None
        if not cert or not cert_names_match(cert, self.security.match):
            names = ", ".join(self.security.match) or "(none)"
            raise HopUnusable(Reply(450, "4.7.5", f"Server certificate not verified: host {self.name}: "
                                                  f"the certificate names none of {names}"))
        return f"{version} verified"

    async def _authenticate(self, c: aiosmtplib.SMTP) -> None:
        """AUTH (RFC 4954) with the hop's credentials when the server offers it: one try with CRAM-MD5
        (RFC 2195), else PLAIN (RFC 4616), else LOGIN. Never without TLS unless ``allow_plaintext_auth`` (the password would cross the
        network readable). Raises HopUnusable ``454 4.7.0`` (no TLS, no common mechanism) or _AuthFailed
        with the server's code (Postfix: ``SASL authentication failed; server … said: 535 …``). No text
        raised here contains the password or user name."""
        cred = self.security.credentials
        if cred is None or not c.supports_extension("auth"):
            return  # Postfix: a server that does not offer AUTH gets the mail without it
        if not self.tls_version and not self.security.allow_plaintext_auth:
            raise HopUnusable(Reply(454, "4.7.0", f"SASL authentication failed; cannot authenticate to server "
                                                  f"{self.name}: no TLS session (smtp_sasl_allow_plaintext = false)"))
        offered = c.server_auth_methods
        mechanism = next((m for m in ("cram-md5", "plain", "login") if m in offered), None)
        if mechanism is None:
            raise HopUnusable(Reply(454, "4.7.0", f"SASL authentication failed; cannot authenticate to server "
                                                  f"{self.name}: no mechanism available (offered: "
                                                  f"{' '.join(offered)[:200] or 'none'})"))
        try:
            # One mechanism, one try (aiosmtplib's login() would try each in turn: two or three failures
            # counted against the account per attempt). CRAM-MD5 first: it never sends the password.
            if mechanism == "cram-md5":
                await c.auth_crammd5(cred.username, cred.password)
            elif mechanism == "plain":
                await c.auth_plain(cred.username, cred.password)
            else:
                await c.auth_login(cred.username, cred.password)
        except aiosmtplib.SMTPResponseException as exc:
            said = " ".join(exc.message.split())
            raise _AuthFailed(Reply(454, "4.7.0", f"SASL authentication failed; server {self.name} said: "
                                                  f"{exc.code} {said}".strip()), exc.code) from None
        except aiosmtplib.SMTPException as exc:
            raise HopUnusable(Reply(454, "4.7.0", f"SASL authentication failed; cannot authenticate to server "
                                                  f"{self.name}: {_why(exc)}")) from None

    async def _open(self, tls: TlsLevel) -> aiosmtplib.SMTP:
        """Connect, read the greeting, EHLO (HELO if EHLO is refused), by ``tls`` STARTTLS + EHLO again, then
        AUTH when the hop has credentials. With ``security.wrapper`` TLS starts before the greeting (RFC 8314
        §3.3, implicit TLS) and is never dropped.

        Raises HopUnusable (TLS required but not offered, certificate name mismatch, AUTH refused),
        _TlsFailed (STARTTLS refused or the handshake failed), or aiosmtplib/OS errors when the host cannot
        be reached or greets with an error.
        """
        wrapped = self.security.wrapper
        sock = await self._socket() if wrapped else None
        if sock is not None:
            c = aiosmtplib.SMTP(hostname=self.hostname, sock=sock, local_hostname=self.helo_name,
                                timeout=self.timeout_s, use_tls=True, start_tls=False, tls_context=self._context(tls))
        else:
            c = aiosmtplib.SMTP(
                hostname=self.address,
                port=self.port,
                local_hostname=self.helo_name,
                timeout=self.timeout_s,
                start_tls=False,  # STARTTLS is driven here, by policy
                source_address=(self.bind_address, 0) if self.bind_address else None,
            )
        try:
            try:
                await c.connect()
            except (aiosmtplib.SMTPException, OSError) as exc:
                if wrapped and isinstance(exc.__cause__ or exc, ssl.SSLError):
                    raise _TlsFailed(exc) from exc
                raise
            if wrapped:
                self.tls_version = self.session_tls = self._peer(c, tls)
            await _hello(c)
            if not wrapped and tls != "none" and c.supports_extension("starttls"):
                try:
                    await c.starttls(server_hostname=self.hostname, tls_context=self._context(tls))
                    await _hello(c)  # RFC 3207 §4.2: forget what the server said before TLS
                except (aiosmtplib.SMTPException, OSError, ssl.SSLError) as exc:
                    raise _TlsFailed(exc) from exc
                self.tls_version = self.session_tls = self._peer(c, tls)
            elif not wrapped and tls in _MANDATORY:
                raise HopUnusable(Reply(450, "4.7.4", f"TLS is required, but was not offered by host {self.name}"))
            await self._authenticate(c)
        except BaseException:
            c.close()
            if sock is not None:
                sock.close()
            raise
        return c

    async def _connected(self) -> aiosmtplib.SMTP:
        """The open connection, or a new one (greeting, EHLO, by policy STARTTLS, AUTH done).

        Raises HopUnusable for a TLS or AUTH failure (``4.7.5 Server certificate not trusted`` when the chain
        does not verify at ``verify``/``secure``); aiosmtplib or OS errors when the host cannot be reached
        or greets with an error.
        """
        c = self._client
        if c is not None and c.is_connected:
            return c
        self._client = None
        self.tls_version = self.session_tls = ""
        try:
            c = await self._open(self.tls)
        except _TlsFailed as exc:
            self.tls_version = ""
            cause = exc.__cause__ or exc
            if self.tls in _MANDATORY or self.security.wrapper:
                bad = _cert_failure(cause)
                if bad is not None:
                    why = bad.verify_message or _why(bad)
                    raise HopUnusable(Reply(450, "4.7.5", f"Server certificate not trusted: host {self.name}: {why}")) from None
                raise HopUnusable(Reply(450, "4.7.5", f"Cannot start TLS: {_why(cause)}")) from None
            c = await self._open("none")  # opportunistic: a plaintext session rather than no mail
        except HopUnusable:
            self.tls_version = ""
            raise
        self._client = c
        return c

    def _drop(self) -> None:
        c, self._client = self._client, None
        self.tls_version = ""
        if c is not None:
            try:
                c.close()
            except Exception:  # pragma: no cover - closing a broken transport
                pass

    async def send(
        self,
        sender: str,
        recipients: Sequence[str],
        body: bytes | Content | None,
        *,
        mail_params: Sequence[tuple[str, str]] = (),
        rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
    ) -> list[Reply]:
        """Offer ``body`` from ``sender`` to ``recipients``; return one final reply per recipient, in order.

        ``body`` is the message as bytes, or a :class:`Content` read in pieces while it is sent (never held
        whole): if its pieces end in an error (a damaged or unreadable record) the connection is dropped
        before the final ``.`` (so nothing is delivered) and the recipients get ``451 4.3.0``.

        When the next hop offers PIPELINING (RFC 2920), MAIL, every RCPT and DATA go in one write and the
        replies are read in order (§3.1: DATA is sent even if every RCPT is refused; its reply, 554 or 503,
        then only ends the transaction); otherwise one command at a time. Either way each recipient gets
        its own RCPT reply, or the reply to the end of DATA.

        When the next hop offers DSN (``remote_dsn`` is then True), RFC 3461 parameters are passed on: RET and
        ENVID with MAIL, NOTIFY and ORCPT with each RCPT (xtext-encoded, §4).

        SMTPUTF8 (RFC 6531) is needed when the sender, a recipient or, if the client asked for SMTPUTF8 at
        MAIL, a header line is not ASCII. It is used when the next hop offers it; otherwise the message is
        not sent where it would need it (RFC 6531 §3.2; Postfix): a non-ASCII recipient gets ``553 5.6.7``
        (the others go as usual); a non-ASCII sender or header line gets ``553 5.6.7`` for every recipient.
        Any failure in the middle of the transaction drops the connection (never reuse one in an unknown
        state) and defers what is left. A reused connection that turns out to be closed at MAIL is reopened
        once.

        ``body`` None is an address probe (Postfix's verify(8) probes, ``reject_unverified_recipient``):
        MAIL, the RCPTs, then RSET; DATA is never sent. Each recipient gets its RCPT reply (an accepted one
        its 2xx), or the reply that ended the transaction before it.
        """
        replies: list[Reply | None] = [local_address_refusal(r, sender=False) for r in recipients]

        def fill(reply: Reply) -> list[Reply]:
            return [r if r is not None else reply for r in replies]

        self.auth_failure = 0
        self.connect_failed = False
        refused_sender = local_address_refusal(sender, sender=True)
        if refused_sender is not None:
            return fill(refused_sender)
        if all(r is not None for r in replies):
            return fill(Reply(553, "5.1.3", "no recipient address can be sent"))  # never used: all refused
        if sender == "<>":
            sender = ""  # aiosmtpd keeps the null reverse-path as "<>"; aiosmtplib sends "" as MAIL FROM:<>

        asked = any(k.upper() == "SMTPUTF8" for k, _ in mail_params)
        utf8_headers = asked and body is not None and not _header_section(body).isascii()
        for fresh in (False, True):
            reused = not fresh and self._client is not None and self._client.is_connected
            try:
                c = await self._connected()
            except HopUnusable as exc:
                self._drop()
                if isinstance(exc, _AuthFailed):
                    self.auth_failure = exc.code
                return fill(exc.reply)
            except (aiosmtplib.SMTPException, OSError, ssl.SSLError) as exc:
                self._drop()
                self.connect_failed = True
                return fill(Reply(421, "4.4.1", f"connect to {self.name}: {_why(exc)}"))
            self.remote_dsn = c.supports_extension("dsn")
            mopts = _dsn_options(mail_params, ("RET", "ENVID")) if self.remote_dsn else []
            utf8 = asked or not sender.isascii() or not all(r.isascii() for r, ok in zip(recipients, replies, strict=True)
                                                            if ok is None)
            if utf8 and not c.supports_extension("smtputf8"):
                no_utf8 = Reply(553, "5.6.7", f"SMTPUTF8 is required, but was not offered by host {self.name}")
                if not sender.isascii() or utf8_headers:
                    return fill(no_utf8)
                for i, rcpt in enumerate(recipients):
                    if not rcpt.isascii() and replies[i] is None:
                        replies[i] = no_utf8
                utf8 = False
            enc = "utf-8" if utf8 else "ascii"
            ropts = [
                _dsn_options(p, ("NOTIFY", "ORCPT")) if self.remote_dsn else []
                for p in (rcpt_params or [()] * len(recipients))
            ]
            try:
                mail = _command(b"MAIL FROM:", sender, (["SMTPUTF8"] if utf8 else []) + mopts, enc)
                rcpts = [(i, _command(b"RCPT TO:", rcpt, ropts[i], enc)) for i, rcpt in enumerate(recipients)
                         if replies[i] is None]
            except ValueError as exc:  # a control character in a parameter (aiosmtplib's check): nothing sent
                return fill(Reply(421, "4.4.2", f"conversation with {self.name}: {_why(exc)}"))
            conv = _Conversation.start(c)
            if conv is None:
                self._drop()
                if reused:
                    continue
                return fill(Reply(421, "4.4.2", f"conversation with {self.name}: connection lost"))
            try:
                outcome = await self._transaction(conv, c.supports_extension("pipelining"), mail, rcpts, body,
                                                  replies, reused)
            except _Retry:
                self._drop()
                continue
            except Exception as exc:
                # Lost connection, timeout, or anything unexpected before a final reply: the outcome is unknown
                # to us (RFC 1047); the connection is in an unknown state. Defer and retry (at-least-once).
                self._drop()
                return fill(Reply(421, "4.4.2", f"conversation with {self.name}: {_why(exc)}"))
            if conv.closing or not conv.finish():
                self._drop()  # 421 (RFC 5321 §3.8), or replies left unread: never reuse it
            return fill(outcome)
        return fill(Reply(421, "4.4.2", f"conversation with {self.name}: connection lost"))  # pragma: no cover

    async def _transaction(
        self,
        conv: _Conversation,
        pipelining: bool,
        mail: bytes,
        rcpts: list[tuple[int, bytes]],
        body: bytes | Content | None,
        replies: list[Reply | None],
        reused: bool,
    ) -> Reply:
        """MAIL, RCPT..., DATA and the content on ``conv``; sets each refused recipient's reply in
        ``replies`` and returns the reply for the rest (the final one, or why there is none). ``body``
        None: a probe, RSET after the RCPTs instead of DATA (the rest get their RCPT reply). Raises
        _Retry when a reused connection turns out to be closed (or 421) at MAIL, aiosmtplib errors and
        OSError when the connection fails."""
        t = self.timeout_s
        probe = body is None
        try:
            if pipelining:  # RFC 2920 §3.1: the whole group in one write, the replies read in order
                conv.write(b"".join([mail, *(line for _, line in rcpts), *(() if probe else (b"DATA\r\n",))]))
            else:
                conv.write(mail)
            resp = await conv.read(t)
        except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError):
            if reused:
                raise _Retry from None  # a cached connection that was closed under us: once more on a new one
            raise
        if resp.code != 250:
            if reused and resp.code == 421:
                raise _Retry  # the server timed the cached connection out (RFC 5321 §4.5.3.2.7)
            if pipelining:
                try:
                    for _ in range(len(rcpts) + (0 if probe else 1)):  # the RCPT and DATA replies (503: no MAIL)
                        if (await conv.read(t)).code == 354:
                            conv.closing = True  # in DATA mode without a transaction: never reuse it
                            break
                except (aiosmtplib.SMTPException, OSError):
                    conv.closing = True
            await self._rset(conv)
            return _refusal_of(resp)
        accepted: list[int] = []
        took: Reply | None = None  # the RCPT reply of the last recipient accepted (a probe's answer)
        for i, line in rcpts:
            if not pipelining:
                conv.write(line)
            resp = await conv.read(t)
            if 200 <= resp.code < 300:  # every 2xx accepts (RFC 5321 §4.2.1)
                accepted.append(i)
                if probe:
                    took = split_enhanced(resp.code, resp.message)
            else:
                replies[i] = _refusal_of(resp)
        if probe:  # no DATA: the transaction is reset, the connection stays usable
            await self._rset(conv)
            return took if took is not None else Reply(450, "4.0.0", "no recipient accepted")
        assert body is not None
        if not accepted:
            if pipelining:
                resp = await conv.read(t)  # DATA: 554 5.5.1 no valid recipients (RFC 2920 §3.1), or 503
                if resp.code == 354:
                    conv.closing = True  # it wants content for no one: drop the connection, send nothing
                    return Reply(450, "4.0.0", "no recipient accepted")
            await self._rset(conv)
            return Reply(450, "4.0.0", "no recipient accepted")
        if not pipelining:
            conv.write(b"DATA\r\n")
        resp = await conv.read(t)
        if resp.code != 354:
            await self._rset(conv)
            return _refusal_of(resp)
        try:
            await conv.send_content(body, t)
        except (CorruptRecord, StorageError) as exc:
            # The content could not be read to its end (or did not check out): the final "." was never
            # sent, so the server delivers nothing; the connection is in the middle of DATA: drop it.
            conv.closing = True
            return Reply(451, "4.3.0", f"message data could not be read from the queue: {exc}")
        resp = await conv.read(t)
        if 200 <= resp.code < 300:  # every 2xx is positive completion (RFC 5321 §4.2.1), not just 250
            return split_enhanced(resp.code, resp.message)
        await self._rset(conv)
        return _refusal_of(resp)

    async def _rset(self, conv: _Conversation) -> None:
        """RSET after a refusal; a connection that does not take it is dropped (RFC 5321 §4.1.1.5)."""
        if conv.closing:
            return
        try:
            conv.write(b"RSET\r\n")
            resp = await conv.read(self.timeout_s)
        except (aiosmtplib.SMTPException, OSError):
            conv.closing = True
            return
        if resp.code != 250:
            conv.closing = True

    def abort(self) -> None:
        """Drop the connection at once, without QUIT (a transaction abandoned half-way, a hung server)."""
        c, self._client = self._client, None
        if c is not None:
            c.close()

    async def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                await c.quit()
            except (aiosmtplib.SMTPException, OSError):
                c.close()


_LINE_ENDS = re.compile(rb"\r\n|\n|\r(?!\n)")
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")  # aiosmtplib's COMMAND_INJECTION_REGEX
HEADER_SCAN_BYTES_MAX = 1024 * 1024  # how far a streamed message is read to find its header section
_REPLY_BYTES_MAX = 64 * 1024  # a reply (all its lines) longer than this is a protocol error


@runtime_checkable
class Content(Protocol):
    """A message that is not held in memory: ``size`` bytes given by ``pieces()`` in order (a new iterator
    each call). The iterator may raise CorruptRecord or StorageError, after its last piece too (a checksum
    checked at the end): the content counts as sent only when the iteration ended without an error."""

    @property
    def size(self) -> int: ...

    def pieces(self) -> Iterator[bytes]: ...


class DotStuffer:
    """What follows the 354 reply to DATA, piece by piece (RFC 5321 §4.5.2, §4.1.1.4): CRLF line ends (a
    bare CR or LF made CRLF), a leading dot doubled on every line, also where a line starts a piece or a
    CRLF is split between two pieces; :meth:`end` ends the last line with CRLF if needed and adds ``.``
    CRLF. The output for any division into pieces is :func:`wire_content` of the whole.

    Per piece: one pass for the line ends and one for the dots (:mod:`mtaq.core.octets`); a regular
    expression only when a bare CR or LF is there.
    """

    __slots__ = ("_cr", "_line_start", "_started")

    def __init__(self) -> None:
        self._line_start = True  # the next byte starts a line
        self._cr = False  # a CR ended the last piece: held back until we know whether LF follows
        self._started = False

    def feed(self, piece: bytes) -> bytes:
        if self._cr:
            piece, self._cr = b"\r" + piece, False
        if piece.endswith(b"\r"):
            piece, self._cr = piece[:-1], True
        if not piece:
            return b""
        if not crlf_only(piece):
            piece = _LINE_ENDS.sub(b"\r\n", piece)
        piece = stuff(piece)
        if self._line_start and piece.startswith(b"."):
            piece = b"." + piece
        self._line_start = piece.endswith(b"\n")
        self._started = True
        return piece

    def end(self) -> bytes:
        if self._cr:  # a bare CR at the very end
            self._cr, self._line_start, self._started = False, True, True
            return b"\r\n.\r\n"
        return b".\r\n" if self._started and self._line_start else b"\r\n.\r\n"


def wire_content(body: bytes) -> bytes:
    """What follows the 354 reply to DATA: ``body`` with CRLF line ends (a bare CR or LF made CRLF), ending
    in CRLF, dot-stuffed (RFC 5321 §4.5.2), then ``.`` CRLF (§4.1.1.4). The same bytes aiosmtplib sends."""
    d = DotStuffer()
    return d.feed(body) + d.end()


class _Retry(Exception):
    """A reused connection was found closed (or answered 421) at MAIL: try once more on a new one."""


def _command(verb: bytes, address: str, options: Sequence[str], enc: str) -> bytes:
    """``verb`` + ``<address>`` + options + CRLF, as aiosmtplib's ``mail``/``rcpt`` write it for an address
    that passed :func:`local_address_refusal` (its ``quote_address`` is then ``<address>``: not parsed
    again). Raises ValueError for a control character (aiosmtplib's command-injection check) or an
    address that cannot be encoded in ``enc``."""
    line = verb + f"<{address}>".encode(enc) + b"".join(b" " + o.encode("ascii") for o in options)
    if _CONTROL.search(line):
        raise ValueError("Command arg contains a prohibited control character")
    return line + b"\r\n"


def _refusal_of(resp: aiosmtplib.SMTPResponse) -> Reply:
    """A reply that is not the expected one: 4xx and 5xx as they are; anything else (a 2xx to MAIL other
    than 250, a 3xx where none belongs) is not an acceptance: a temporary failure, never delivered."""
    if 400 <= resp.code < 600:
        return split_enhanced(resp.code, resp.message)
    return Reply(451, "4.5.0", f"unexpected reply {resp.code} {' '.join(resp.message.split())}".strip())


def _time_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(True)


class _Conversation(asyncio.Protocol):
    """One mail transaction on an open aiosmtplib connection, driven here (RFC 2920 pipelining).

    aiosmtplib's protocol keeps one reply at a time and drops what arrives before it is picked up, so it
    cannot read pipelined replies. For the transaction this object becomes the transport's protocol (plain
    or TLS: the same ``set_protocol``); it keeps every reply in order, tells aiosmtplib's protocol of a lost
    connection and of flow control, and :meth:`finish` gives the transport back to it. Writes go straight
    to the transport; :meth:`drain` waits while its buffer is over the high-water mark.
    """

    def __init__(self, inner: asyncio.BaseProtocol, transport: asyncio.WriteTransport) -> None:
        self._inner = inner
        self._transport = transport
        self._buf = bytearray()
        self._replies: deque[aiosmtplib.SMTPResponse] = deque()
        self._failure: Exception | None = None
        self._waiter: asyncio.Future[bool] | None = None  # True: timed out
        self._paused = False
        self.closing = False  # drop the connection after the transaction (421, or in an unknown state)

    @classmethod
    def start(cls, c: aiosmtplib.SMTP) -> _Conversation | None:
        """Take over the transport of ``c``; None when it is not connected."""
        proto = c.protocol
        transport = proto.transport if proto is not None else None
        if proto is None or transport is None or transport.is_closing():
            return None
        conv = cls(proto, cast(asyncio.WriteTransport, transport))
        transport.set_protocol(conv)
        return conv

    def finish(self) -> bool:
        """Give the transport back to aiosmtplib; False when the connection must not be reused (closed, or
        replies or bytes left unread)."""
        t = self._transport
        if t.is_closing():
            return False
        t.set_protocol(self._inner)
        return not self._buf and not self._replies and self._failure is None

    # asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            while (resp := self._parse()) is not None:
                self._replies.append(resp)
        except aiosmtplib.SMTPResponseException as exc:
            self._failure = exc
        self._wake()

    def eof_received(self) -> bool:
        self._failure = self._failure or aiosmtplib.SMTPServerDisconnected("Unexpected EOF received")
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        lost = aiosmtplib.SMTPServerDisconnected("Connection lost")
        lost.__cause__ = exc
        self._failure = self._failure or lost
        self._paused = False
        self._wake()
        self._inner.connection_lost(exc)  # aiosmtplib forgets the connection

    def pause_writing(self) -> None:
        self._paused = True
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        self._wake()
        self._inner.resume_writing()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(False)

    def _parse(self) -> aiosmtplib.SMTPResponse | None:
        """One complete reply from the front of the buffer (RFC 5321 §4.2.1: ``ddd-`` continues, ``ddd``
        SP ends), or None. Raises SMTPResponseException for a malformed or too long reply."""
        buf, off, code, lines = self._buf, 0, -1, []
        while (nl := buf.find(b"\n", off)) >= 0:
            line = bytes(buf[off : nl + 1])
            try:
                code = int(line[:3])
            except ValueError:
                raise aiosmtplib.SMTPResponseException(
                    -1, f"Malformed SMTP response line: {line.decode('utf-8', 'replace')!r}"
                ) from None
            lines.append(line[4:].strip(b" \t\r\n"))
            off = nl + 1
            if off > _REPLY_BYTES_MAX:  # a whole reply that came in one read is held to the limit too
                raise aiosmtplib.SMTPResponseException(-1, "Response too long")
            if line[3:4] != b"-":
                del buf[:off]
                return aiosmtplib.SMTPResponse(code, b"\n".join(lines).decode("utf-8", "surrogateescape"))
        if len(buf) > _REPLY_BYTES_MAX:
            raise aiosmtplib.SMTPResponseException(-1, "Response too long")
        return None

    async def _wait(self, timeout_s: float, what: str) -> None:
        """Until data, flow or the end of the connection wakes us; SMTPReadTimeoutError after ``timeout_s``.
        One timer and one future a wait (``asyncio.timeout`` costs about three times as much per reply)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _time_out, waiter)
        try:
            timed_out = await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if timed_out:
            self.closing = True
            raise aiosmtplib.SMTPReadTimeoutError(f"Timed out {what}")

    # the transaction
    def write(self, data: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        if self._transport.is_closing():
            raise aiosmtplib.SMTPServerDisconnected("Connection lost")
        self._transport.write(data)

    async def drain(self, timeout_s: float) -> None:
        """Wait while the transport's buffer is full (the server reads slower than we read the log)."""
        while self._paused and self._failure is None:
            await self._wait(timeout_s, "writing to the server")
        if self._failure is not None:
            raise self._failure

    async def read(self, timeout_s: float) -> aiosmtplib.SMTPResponse:
        """The next reply, in the order the commands were sent. Raises SMTPServerDisconnected,
        SMTPReadTimeoutError, SMTPResponseException (malformed reply)."""
        while not self._replies:
            if self._failure is not None:
                raise self._failure
            await self._wait(timeout_s, "waiting for server response")
        resp = self._replies.popleft()
        if resp.code == 421:
            self.closing = True  # the server is closing the connection (RFC 5321 §3.8)
        return resp

    async def send_content(self, body: bytes | Content, timeout_s: float) -> None:
        """The content after 354, dot-stuffed, and the final ``.`` CRLF, which is written only after the
        content was read to its end without an error (CorruptRecord, StorageError propagate before it).
        The last piece is held back and written with the ``.`` CRLF: a message of one piece (most mail) is
        one write, one send to the next hop."""
        d = DotStuffer()
        if isinstance(body, bytes):
            self.write(d.feed(body) + d.end())
            return
        held = b""
        for piece in body.pieces():
            out = d.feed(piece)
            if out:
                if held:
                    self.write(held)
                    await self.drain(timeout_s)
                held = out
        self.write(held + d.end())


def _header_section(body: bytes | Content) -> bytes:
    """The header lines of a message (up to the first empty line; RFC 5322 §2.1). Of streamed content at
    most the first ``HEADER_SCAN_BYTES_MAX`` bytes are read (not checked: it only decides SMTPUTF8)."""
    if not isinstance(body, bytes):
        buf = b""
        try:
            for piece in body.pieces():
                buf += piece
                if b"\r\n\r\n" in buf or b"\n\n" in buf or len(buf) >= HEADER_SCAN_BYTES_MAX:
                    break
        except (CorruptRecord, StorageError):
            pass  # found again (and acted on) when the content is sent
        body = buf
    end = body.find(b"\r\n\r\n")
    if end < 0:
        end = body.find(b"\n\n")
    return body if end < 0 else body[:end]


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
