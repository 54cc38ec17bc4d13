"""``mtaq sink``: a local SMTP server that stores every message it receives in a Maildir.

It is the next hop of ``make run`` and of the tests. Each stored message starts with ``Return-Path`` and
one ``Delivered-To`` line per envelope recipient (as Postfix's local delivery writes them), then the
message byte for byte. ``--defer-rcpt`` / ``--reject-rcpt`` take regular expressions: matching recipients
get ``451 4.2.0`` / ``550 5.1.1`` at RCPT, to exercise deferral and bounces; with ``--defer-count N`` a
matching recipient is deferred only on its first N attempts, then accepted (4xx, then 2xx).
``--rcpt-reply REGEX=REPLY`` (repeatable, tried first, the first that matches wins) answers a matching
recipient with REPLY as given, e.g. ``452 4.2.2 mailbox full`` (the replies the large providers send).

With ``--tls-cert``/``--tls-key`` the sink offers STARTTLS (RFC 3207) and a message that came over TLS gets
an ``X-Sink-TLS: <protocol version>`` line after ``Delivered-To``; ``--no-smtputf8`` makes it a next hop
without the SMTPUTF8 extension (RFC 6531).
"""

from __future__ import annotations

import asyncio
import mailbox
import os
import re
import ssl
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from mtaq.logs import get_logger

__all__ = ["SinkHandler", "run_sink"]


class SinkHandler:
    """aiosmtpd handler that writes each message into ``maildir`` (created if missing)."""

    def __init__(
        self,
        maildir: str,
        *,
        defer_rcpt: str | None = None,
        reject_rcpt: str | None = None,
        defer_count: int = 0,
        rcpt_replies: list[str] | None = None,
    ) -> None:
        self.maildir = mailbox.Maildir(maildir, create=True)
        for sub in ("tmp", "new", "cur"):  # an existing empty directory is taken as a Maildir without them
            os.makedirs(os.path.join(maildir, sub), exist_ok=True)
        self.defer_count = defer_count  # 0: always defer matching recipients
        self.deferred: dict[str, int] = {}
        self.defer = re.compile(defer_rcpt) if defer_rcpt else None
        self.reject = re.compile(reject_rcpt) if reject_rcpt else None
        self.replies = []  # (pattern, reply) of --rcpt-reply REGEX=REPLY
        for item in rcpt_replies or []:
            pattern, sep, reply = item.partition("=")
            if not sep or not reply[:3].isdigit():
                raise ValueError(f"--rcpt-reply: expected REGEX=REPLY with a 3-digit code, got {item!r}")
            self.replies.append((re.compile(pattern), reply))
        self.received = 0
        self.log = get_logger(component="sink")

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, rcpt_options: list[str]
    ) -> str:
        for pattern, reply in self.replies:
            if pattern.search(address):
                return reply
        if self.reject is not None and self.reject.search(address):
            return f"550 5.1.1 <{address}>: Recipient address rejected: User unknown"
        if self.defer is not None and self.defer.search(address):
            seen = self.deferred.get(address, 0)
            if self.defer_count and seen >= self.defer_count:
                envelope.rcpt_tos.append(address)
                return "250 2.1.5 Ok"
            self.deferred[address] = seen + 1
            return f"451 4.2.0 <{address}>: Recipient address deferred: try again later"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        head = f"Return-Path: <{envelope.mail_from or ''}>\r\n".encode()
        head += b"".join(f"Delivered-To: {r}\r\n".encode() for r in envelope.rcpt_tos)
        tls = session.ssl.get("ssl_object") if isinstance(session.ssl, dict) else None
        if tls is not None:
            head += f"X-Sink-TLS: {tls.version()}\r\n".encode()
        key = self.maildir.add(head + (envelope.original_content or b""))
        self.received += 1
        peer = session.peer
        self.log.info("sink_stored", key=key, sender=envelope.mail_from, recipients=envelope.rcpt_tos,
                      client=peer[0] if isinstance(peer, tuple) else str(peer or ""))
        return f"250 2.0.0 Ok: stored as {key}"


async def run_sink(
    host: str,
    port: int,
    maildir: str,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    smtputf8: bool = True,
    **kw: Any,
) -> None:
    """Serve until killed. ``tls_cert``/``tls_key`` (PEM files) turn STARTTLS on."""
    handler = SinkHandler(maildir, **kw)
    loop = asyncio.get_running_loop()
    ctx = None
    if tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(tls_cert, tls_key)
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="sink", ident="mtaq-sink", enable_SMTPUTF8=smtputf8, data_size_limit=None,
                     tls_context=ctx, loop=loop),
        host=host,
        port=port,
        reuse_address=True,
    )
    get_logger(component="sink").info("sink_listening", listen=f"{host}:{port}", maildir=maildir)
    async with server:
        await server.serve_forever()
