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

import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import aiosmtplib
from aiosmtplib.email import quote_address

__all__ = ["HopUnusable", "RelayConnection", "Reply", "TlsLevel", "classify", "local_address_refusal", "split_enhanced",
           "wire_content"]

_ENHANCED = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})\s+")


@dataclass(frozen=True, slots=True)
class Reply:
    """A final reply for one recipient: code, enhanced status code ("" if none given) and text."""

    code: int
    enhanced: str
    text: str


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


def _refusal(exc: aiosmtplib.SMTPResponseException) -> Reply:
    """The reply in an exception aiosmtplib raised because it was not the expected one.

    Only 4xx and 5xx are refusals; anything else here (a 2xx to MAIL or to DATA where 354 was due, a 3xx
    where none belongs) is not a final acceptance, so it counts as a temporary failure and never as delivered.
    """
    if 400 <= exc.code < 600:
        return split_enhanced(exc.code, exc.message)
    return Reply(451, "4.5.0", f"unexpected reply {exc.code} {' '.join(exc.message.split())}".strip())


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


TlsLevel = Literal["none", "may", "encrypt"]


class HopUnusable(Exception):
    """The next hop cannot be used for a transaction; ``reply`` is the (temporary) reason."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.text)
        self.reply = reply


class _TlsFailed(Exception):
    """STARTTLS was refused or its handshake failed (the connection is unusable)."""


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
    ``host[address]:port``). ``tls`` is the STARTTLS policy (RFC 3207; Postfix's security levels):

    * ``may``: STARTTLS when the server offers it, certificate not verified; a refused STARTTLS or a failed
      handshake falls back to a new plaintext connection (as Postfix does);
    * ``encrypt``: the same, but no plaintext: not offered -> ``450 4.7.4 TLS is required, but was not
      offered by host …``; refused or failed -> ``450 4.7.5 Cannot start TLS: …`` (Postfix's wording and
      codes, RFC 3463 X.7.4 "security features not supported", X.7.5 "cryptographic failure");
    * ``none``: never STARTTLS.
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
    ) -> None:
        self.address = address
        self.port = port
        self.hostname = hostname or address
        self.helo_name = helo_name
        self.timeout_s = timeout_s
        self.tls: TlsLevel = tls
        self._client: aiosmtplib.SMTP | None = None
        self.remote_dsn = False  # whether the next hop offered DSN in the last transaction
        self.tls_version = ""  # e.g. "TLSv1.3" while the connection is encrypted, "" in plaintext

    @property
    def name(self) -> str:
        """``host[address]:port``, like Postfix's ``relay=``."""
        return f"{self.hostname}[{self.address}]:{self.port}"

    async def _open(self, tls: TlsLevel) -> aiosmtplib.SMTP:
        """Connect, read the greeting, EHLO (HELO if EHLO is refused) and, by ``tls``, STARTTLS + EHLO again.

        Raises HopUnusable (TLS required but not offered), _TlsFailed (STARTTLS refused or the handshake
        failed), or aiosmtplib/OS errors when the host cannot be reached or greets with an error.
        """
        c = aiosmtplib.SMTP(
            hostname=self.address,
            port=self.port,
            local_hostname=self.helo_name,
            timeout=self.timeout_s,
            start_tls=False,  # STARTTLS is driven here, by policy
        )
        try:
            await c.connect()
            await _hello(c)
            if tls != "none" and c.supports_extension("starttls"):
                try:
                    await c.starttls(server_hostname=self.hostname, tls_context=_opportunistic_context())
                    await _hello(c)  # RFC 3207 §4.2: forget what the server said before TLS
                except (aiosmtplib.SMTPException, OSError, ssl.SSLError) as exc:
                    raise _TlsFailed(exc) from exc
                ssl_obj = c.get_transport_info("ssl_object")
                self.tls_version = (ssl_obj.version() if ssl_obj is not None else None) or "TLS"
            elif tls == "encrypt":
                raise HopUnusable(Reply(450, "4.7.4", f"TLS is required, but was not offered by host {self.name}"))
        except BaseException:
            c.close()
            raise
        return c

    async def _connected(self) -> aiosmtplib.SMTP:
        """The open connection, or a new one (greeting, EHLO and, by policy, STARTTLS done).

        Raises HopUnusable for a TLS policy failure; aiosmtplib or OS errors when the host cannot be reached
        or greets with an error.
        """
        c = self._client
        if c is not None and c.is_connected:
            return c
        self._client = None
        self.tls_version = ""
        try:
            c = await self._open(self.tls)
        except _TlsFailed as exc:
            self.tls_version = ""
            if self.tls == "encrypt":
                raise HopUnusable(Reply(450, "4.7.5", f"Cannot start TLS: {_why(exc.__cause__ or exc)}")) from exc
            c = await self._open("none")  # opportunistic: a plaintext session rather than no mail
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
        body: bytes,
        *,
        mail_params: Sequence[tuple[str, str]] = (),
        rcpt_params: Sequence[Sequence[tuple[str, str]]] | None = None,
    ) -> list[Reply]:
        """Offer ``body`` from ``sender`` to ``recipients``; return one final reply per recipient, in order.

        When the next hop offers DSN (``remote_dsn`` is then True), RFC 3461 parameters are passed on: RET and
        ENVID with MAIL, NOTIFY and ORCPT with each RCPT (xtext-encoded, §4).

        SMTPUTF8 (RFC 6531) is needed when the sender, a recipient or, if the client asked for SMTPUTF8 at
        MAIL, a header line is not ASCII. It is used when the next hop offers it; otherwise the message is
        not sent where it would need it (RFC 6531 §3.2; Postfix): a non-ASCII recipient gets ``553 5.6.7``
        (the others go as usual); a non-ASCII sender or header line gets ``553 5.6.7`` for every recipient.
        Any failure in the middle of the transaction drops the connection (never reuse one in an unknown
        state) and defers what is left. A reused connection that turns out to be closed at MAIL is reopened
        once.
        """
        replies: list[Reply | None] = [local_address_refusal(r, sender=False) for r in recipients]

        def fill(reply: Reply) -> list[Reply]:
            return [r if r is not None else reply for r in replies]

        refused_sender = local_address_refusal(sender, sender=True)
        if refused_sender is not None:
            return fill(refused_sender)
        if all(r is not None for r in replies):
            return fill(Reply(553, "5.1.3", "no recipient address can be sent"))  # never used: all refused
        if sender == "<>":
            sender = ""  # aiosmtpd keeps the null reverse-path as "<>"; aiosmtplib sends "" as MAIL FROM:<>

        asked = any(k.upper() == "SMTPUTF8" for k, _ in mail_params)
        utf8_headers = asked and not _header_section(body).isascii()
        for fresh in (False, True):
            reused = not fresh and self._client is not None and self._client.is_connected
            try:
                c = await self._connected()
            except HopUnusable as exc:
                self._drop()
                return fill(exc.reply)
            except (aiosmtplib.SMTPException, OSError, ssl.SSLError) as exc:
                self._drop()
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
            try:
                await c.mail(sender, options=(["SMTPUTF8"] if utf8 else []) + mopts, encoding=enc)
                break
            except aiosmtplib.SMTPResponseException as exc:
                if reused and exc.code == 421:
                    self._drop()  # the server timed the cached connection out (RFC 5321 §4.5.3.2.7)
                    continue
                await self._reset(c)
                return fill(_refusal(exc))
            except Exception as exc:
                self._drop()
                if reused:
                    continue  # a cached connection that was closed under us: once more on a new one
                return fill(Reply(421, "4.4.2", f"conversation with {self.name}: {_why(exc)}"))
        ropts = [
            _dsn_options(p, ("NOTIFY", "ORCPT")) if self.remote_dsn else []
            for p in (rcpt_params or [()] * len(recipients))
        ]
        try:
            accepted: list[int] = []
            for i, rcpt in enumerate(recipients):
                if replies[i] is not None:
                    continue
                try:
                    await c.rcpt(rcpt, options=ropts[i], encoding=enc)
                    accepted.append(i)
                except aiosmtplib.SMTPResponseException as exc:
                    if 200 <= exc.code < 300:  # aiosmtplib takes 250 and 251 only; every 2xx accepts (§4.2.1)
                        accepted.append(i)
                    else:
                        replies[i] = _refusal(exc)
            if not accepted:
                await self._reset(c)
                return fill(Reply(450, "4.0.0", "no recipient accepted"))
            try:
                resp = await _data(c, body, self.timeout_s)
                final = split_enhanced(resp.code, resp.message)
            except aiosmtplib.SMTPResponseException as exc:
                final = _refusal(exc)
                await self._reset(c)
            for i in accepted:
                replies[i] = final
            return fill(final)
        except Exception as exc:
            # Lost connection, timeout, or anything unexpected before a final reply: the outcome is unknown
            # to us (RFC 1047); the connection is in an unknown state. Defer and retry (at-least-once).
            self._drop()
            return fill(Reply(421, "4.4.2", f"conversation with {self.name}: {_why(exc)}"))

    async def _reset(self, c: aiosmtplib.SMTP) -> None:
        try:
            await c.rset()
        except (aiosmtplib.SMTPException, OSError):
            self._drop()

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
_LEADING_DOT = re.compile(rb"(?m)^\.")


def wire_content(body: bytes) -> bytes:
    """What follows the 354 reply to DATA: ``body`` with CRLF line ends (a bare CR or LF made CRLF), ending
    in CRLF, dot-stuffed (RFC 5321 §4.5.2), then ``.`` CRLF (§4.1.1.4). The same bytes aiosmtplib sends.

    The regular expressions run only when a bare CR or LF, or a line starting with a dot, is present: for a
    message already in CRLF form without such lines it is a few byte counts and one copy.
    """
    crlf = body.count(b"\r\n")
    if body.count(b"\r") == crlf and body.count(b"\n") == crlf:
        msg = body if body.endswith(b"\r\n") else body + b"\r\n"
    else:
        msg = _LINE_ENDS.sub(b"\r\n", body)
        if not msg.endswith(b"\r\n"):
            msg += b"\r\n"
    if msg.startswith(b".") or b"\n." in msg:
        msg = _LEADING_DOT.sub(b"..", msg)
    return msg + b".\r\n"


async def _data(c: aiosmtplib.SMTP, body: bytes, timeout_s: float) -> aiosmtplib.SMTPResponse:
    """DATA, the content (:func:`wire_content`), and the final reply; as aiosmtplib's ``SMTP.data`` without
    its two passes of regular expressions over every message (most of the delivery CPU for large mail).

    The connection is used by one delivery at a time (its pool marks it busy), so the content and the
    reply read after it cannot interleave with another command. Raises SMTPDataError for a reply other than
    354 or 2xx, SMTPServerDisconnected or SMTPTimeoutError (the connection is then closed).
    """
    start = await c.execute_command(b"DATA")
    if start.code != 354:
        raise aiosmtplib.SMTPDataError(start.code, start.message)
    proto = c.protocol
    if proto is None:
        raise aiosmtplib.SMTPServerDisconnected("Connection lost")
    try:
        proto.write(wire_content(body))
        resp = await proto.read_response(timeout=timeout_s)
    except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError):
        c.close()
        raise
    if not 200 <= resp.code < 300:  # every 2xx is positive completion (RFC 5321 §4.2.1), not just 250
        raise aiosmtplib.SMTPDataError(resp.code, resp.message)
    return resp


def _header_section(body: bytes) -> bytes:
    """The header lines of a message (up to the first empty line; RFC 5322 §2.1)."""
    end = body.find(b"\r\n\r\n")
    if end < 0:
        end = body.find(b"\n\n")
    return body if end < 0 else body[:end]


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
