"""The SMTP server side: aiosmtpd does the protocol; this handler queues the message durably.

RFC 5321 §6.1: after ``250`` to DATA the message is ours and must not be lost. The reply is therefore sent
only after the DATA and ENVELOPE records are covered by an fsync (group commit). The ``queued`` event and
the scheduling happen in :meth:`Queue.receive` once the message is durable, whether or not the client is
still there to hear the 250. A storage failure is
answered ``451 4.3.0`` (``452 4.3.1`` when the spool is full) and the message is not acknowledged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from mtaq.edge.smtp import MtaqSMTP
from mtaq.errors import StorageError
from mtaq.logs import get_logger
from mtaq.queue import Queue
from mtaq.testing import killpoints

__all__ = ["QueueHandler", "start_server"]


class QueueHandler:
    """aiosmtpd handler: ``handle_DATA`` queues the message and answers once it is durable."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.log = get_logger()

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        body = envelope.original_content or b""
        peer = session.peer
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        mail_params = [_param(o) for o in envelope.mail_options]
        ret, envid = getattr(envelope, "dsn_ret", None), getattr(envelope, "dsn_envid", None)
        if ret:
            mail_params.append(("RET", ret))
        if envid:
            mail_params.append(("ENVID", envid))
        rcpt_dsn = getattr(envelope, "rcpt_dsn", None)
        try:
            env = await self.queue.receive(
                envelope.mail_from or "",
                list(envelope.rcpt_tos),
                body,
                mail_params=mail_params,
                rcpt_params=rcpt_dsn if rcpt_dsn and len(rcpt_dsn) == len(envelope.rcpt_tos) else None,
                client=client,
                helo=session.host_name or "",
            )
        except StorageError as exc:
            self.log.error("queue_write_failed", error=str(exc), client=client, reply=exc.smtp_reply)
            return exc.smtp_reply
        killpoints.hit("edge.after_commit")
        return f"250 2.0.0 Ok: queued as {env.queue_id}"


def _param(option: str) -> tuple[str, str]:
    key, _, value = option.partition("=")
    return key.upper(), value


async def start_server(
    handler: QueueHandler,
    host: str,
    port: int,
    *,
    hostname: str,
    data_size_limit: int,
    timeout_s: float,
    reuse_port: bool = False,
) -> asyncio.AbstractServer:
    """Listen on ``host:port`` with aiosmtpd's SMTP protocol; returns the asyncio server.

    ``reuse_port``: SO_REUSEPORT, for several worker processes on one port (mtaq.workers).
    """
    loop = asyncio.get_running_loop()

    def factory() -> Any:
        return MtaqSMTP(
            handler,
            hostname=hostname,
            ident="mtaq",
            data_size_limit=data_size_limit,
            enable_SMTPUTF8=True,
            decode_data=False,
            timeout=timeout_s,
            loop=loop,
        )

    return await loop.create_server(factory, host=host, port=port, reuse_address=True, reuse_port=reuse_port or None)
