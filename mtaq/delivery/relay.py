"""Delivery to the next hop over SMTP (aiosmtplib), one reused connection per worker.

The transaction is driven command by command (MAIL, RCPT per recipient, DATA) so that every recipient gets
its own final reply (RFC 5321 §3.3): a RCPT refusal is that recipient's reply; for the accepted ones the
reply to the end of DATA is. 2xx -> delivered, 5xx -> failed, 4xx -> deferred; a lost connection or a
timeout before the final reply -> deferred (RFC 1047: the remote may have taken it; we retry, at-least-once).

Third-party exceptions are converted here and only here (httpcore's ``map_exceptions`` habit).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import aiosmtplib

from mtaq.config import Relayhost

__all__ = ["RelayConnection", "Reply", "classify", "split_enhanced"]

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

    Only 4xx and 5xx are refusals; anything else here (a 252 to RCPT, a 2xx to MAIL or to DATA where 354 was
    due) is not a final acceptance, so it counts as a temporary failure and never as delivered.
    """
    if 400 <= exc.code < 600:
        return split_enhanced(exc.code, exc.message)
    return Reply(451, "4.5.0", f"unexpected reply {exc.code} {' '.join(exc.message.split())}".strip())


def classify(code: int) -> str:
    """delivered / deferred / failed for an SMTP reply code."""
    if 200 <= code < 300:
        return "delivered"
    if 500 <= code < 600:
        return "failed"
    return "deferred"


class RelayConnection:
    """One SMTP client connection to the next hop, opened on demand and reused between messages."""

    def __init__(self, relayhost: Relayhost, *, helo_name: str, timeout_s: float) -> None:
        self.relayhost = relayhost
        self.helo_name = helo_name
        self.timeout_s = timeout_s
        self._client: aiosmtplib.SMTP | None = None
        self.remote_dsn = False  # whether the next hop offered DSN in the last transaction

    @property
    def name(self) -> str:
        return f"{self.relayhost.host}[{self.relayhost.host}]:{self.relayhost.port}"

    async def _connected(self) -> aiosmtplib.SMTP:
        c = self._client
        if c is not None and c.is_connected:
            return c
        c = aiosmtplib.SMTP(
            hostname=self.relayhost.host,
            port=self.relayhost.port,
            local_hostname=self.helo_name,
            timeout=self.timeout_s,
            start_tls=False,  # opportunistic STARTTLS comes with the SMTP-edge issue
        )
        await c.connect()
        await c.ehlo()
        self._client = c
        return c

    def _drop(self) -> None:
        c, self._client = self._client, None
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

        Internationalised addresses go with SMTPUTF8 (RFC 6531) when the next hop offers it; otherwise
        they get ``553 5.6.7`` (RFC 6531 §3.5), the others go as usual. Any failure in the middle of the
        transaction drops the connection (never reuse one in an unknown state) and defers what is left.
        """
        replies: list[Reply | None] = [None] * len(recipients)

        def fill(reply: Reply) -> list[Reply]:
            return [r if r is not None else reply for r in replies]

        try:
            c = await self._connected()
        except (aiosmtplib.SMTPException, OSError) as exc:
            self._drop()
            return fill(Reply(421, "4.4.1", f"connect to {self.name}: {_why(exc)}"))
        self.remote_dsn = c.supports_extension("dsn")
        mopts = _dsn_options(mail_params, ("RET", "ENVID")) if self.remote_dsn else []
        ropts = [
            _dsn_options(p, ("NOTIFY", "ORCPT")) if self.remote_dsn else []
            for p in (rcpt_params or [()] * len(recipients))
        ]
        utf8 = not sender.isascii() or not all(r.isascii() for r in recipients)
        if utf8 and not c.supports_extension("smtputf8"):
            no_utf8 = Reply(553, "5.6.7", f"{self.name} does not support SMTPUTF8")
            if not sender.isascii():
                return fill(no_utf8)
            for i, rcpt in enumerate(recipients):
                if not rcpt.isascii():
                    replies[i] = no_utf8
            utf8 = False
        enc = "utf-8" if utf8 else "ascii"
        try:
            try:
                await c.mail(sender, options=(["SMTPUTF8"] if utf8 else []) + mopts, encoding=enc)
            except aiosmtplib.SMTPResponseException as exc:
                await self._reset(c)
                return fill(_refusal(exc))
            accepted: list[int] = []
            for i, rcpt in enumerate(recipients):
                if replies[i] is not None:
                    continue
                try:
                    await c.rcpt(rcpt, options=ropts[i], encoding=enc)
                    accepted.append(i)
                except aiosmtplib.SMTPResponseException as exc:
                    replies[i] = _refusal(exc)
            if not accepted:
                await self._reset(c)
                return fill(Reply(450, "4.0.0", "no recipient accepted"))
            try:
                resp = await c.data(body)
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

    async def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            try:
                await c.quit()
            except (aiosmtplib.SMTPException, OSError):
                c.close()


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
