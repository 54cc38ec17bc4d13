"""The SMTP server side: aiosmtpd does the protocol; this handler queues the message durably.

RFC 5321 §6.1: after ``250`` to DATA the message is ours and must not be lost. The reply is therefore sent
only after the DATA and ENVELOPE records are covered by an fsync (group commit). The body appended is the
message as received with one ``Received:`` header in front (RFC 5321 §4.4, :mod:`mtaq.edge.trace`), and
above it a ``DKIM-Signature:`` when the From: domain has a key and the client may have it signed
(authenticated owner or mynetworks, :meth:`mtaq.edge.dkim.Signer.permits`): the log holds
exactly what is relayed. Before that, ``header_checks`` and then the content filters (``smtpd_milters``,
:mod:`mtaq.edge.milter`) see the message; their verdict comes before the append, and their modifications
(headers, body, recipients, sender, quarantine = held) are in what is appended. The ``queued`` event and
the scheduling happen in :meth:`Queue.receive` once the message is durable, whether or not the client is
still there to hear the 250. A storage failure is
answered ``451 4.3.0`` (``452 4.3.1`` when the spool is full) and the message is not acknowledged.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from asyncio import sslproto
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiosmtpd.smtp import SMTP, Envelope, Session

from mtaq.core.errors import StorageError
from mtaq.edge.canonical import MapNesting
from mtaq.edge.dkim import HEAD_BYTES_MAX, Origin, Signer, header_section, split_head
from mtaq.edge.fastpath import FastHandlerMixin
from mtaq.edge.limits import ConnectionGate, Gate
from mtaq.edge.milter import (
    SMFIR_ADDRCPT,
    SMFIR_ADDRCPT_PAR,
    SMFIR_DELRCPT,
    MilterSession,
    apply_recipients,
    edit_head,
    new_body,
    new_sender,
)
from mtaq.edge.policy import EdgePolicy, RecipientVerifier
from mtaq.edge.smtp import MtaqSMTP
from mtaq.edge.trace import hop_count, protocol_name, received_header
from mtaq.logs import get_logger
from mtaq.queue.store import Queue
from mtaq.storage.spill import BodyBuffer
from mtaq.testing import killpoints

__all__ = ["TLS_HANDSHAKE_TIMEOUT_S", "EdgeSettings", "QueueHandler", "connection_gate", "gate_limits", "start_server"]

TLS_HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds an smtps client has for its TLS handshake (config ``tls_handshake_timeout_s``)."""
_starting: set[asyncio.Task[None]] = set()  # smtps connections between accept and the end of their handshake


class QueueHandler(FastHandlerMixin):
    """aiosmtpd handler: ``handle_DATA`` queues the message and answers once it is durable."""

    def __init__(self, queue: Queue, signer: Signer | None = None) -> None:
        self.queue = queue
        self.signer = signer  # DKIM (mtaq.edge.dkim); None or no keys: nothing is signed
        self.log = get_logger()

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        peer = session.peer
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        content: bytes | BodyBuffer = envelope.original_content or b""
        policy = getattr(server, "policy", None)  # MtaqSMTP's (the one in force when the session began)
        limit = policy.hopcount_limit if isinstance(policy, EdgePolicy) else 0
        if limit:
            hops = hop_count(await _head_of(content))
            if hops >= limit:  # a mail loop (Postfix hopcount_limit; RFC 5321 §6.3)
                self.log.warning("too_many_hops", client=client, sender=envelope.mail_from or "", hops=hops,
                                 limit=limit, action="refused")
                return f"554 5.4.6 Error: too many hops ({hops} Received:/Delivered-To: fields; hopcount_limit {limit})"
        checks = policy.header_checks if isinstance(policy, EdgePolicy) else None
        canon = policy.canonical if isinstance(policy, EdgePolicy) else None
        held: tuple[str, str] | None = None  # a header_checks HOLD: (its text, the header)
        mail_from, rcpt_tos = envelope.mail_from or "", list(envelope.rcpt_tos)
        rcpt_dsn = getattr(envelope, "rcpt_dsn", None)
        rcpt_params = list(rcpt_dsn) if rcpt_dsn and len(rcpt_dsn) == len(rcpt_tos) else None
        if checks or canon:
            head, whole = await _head_read(content)
            new_head: bytes | None = None
            if checks:
                outcome = checks.apply(head)
                for text, header in outcome.warnings:
                    self.log.warning("header_checks_warn", client=client, sender=envelope.mail_from or "",
                                     header=header[:200], text=text)
                held = outcome.hold
                if outcome.reject is not None:
                    self.log.info("header_checks_reject", client=client, sender=envelope.mail_from or "",
                                  reply=outcome.reject)
                    return outcome.reject
                new_head = outcome.head
            if canon:  # canonical_maps (mtaq.edge.canonical): the envelope, and the headers of our own clients
                try:
                    mail_from = canon.sender(mail_from)
                    rcpt_tos = [canon.recipient(r) for r in rcpt_tos]
                    if isinstance(policy, EdgePolicy) and _rewrites_headers(session, policy):
                        base = new_head if new_head is not None else head
                        # a long header section in a thread: the RFC 5322 parser is slow on long address lists
                        new_head = (canon.head(base) if len(base) <= 64 * 1024
                                    else await asyncio.to_thread(canon.head, base)) or new_head
                except MapNesting as exc:
                    self.log.warning("canonical_maps_nesting", client=client, sender=envelope.mail_from or "",
                                     error=str(exc), action="refused")
                    return "451 4.3.0 Error: unreasonable canonical map nesting"
                if rcpt_tos != envelope.rcpt_tos or mail_from != (envelope.mail_from or ""):
                    rcpt_params = _keep_original(envelope.rcpt_tos, rcpt_tos, rcpt_params)
                    self.log.info("canonical_rewrite", client=client, sender=envelope.mail_from or "",
                                  new_sender=mail_from, recipients=[f"{a} -> {b}" for a, b in
                                                                    zip(envelope.rcpt_tos, rcpt_tos, strict=True)
                                                                    if a != b])
            if new_head is not None:
                if not whole:  # a header section past HEAD_BYTES_MAX: not rewritten in part
                    return "552 5.3.4 Error: message header section too large to filter"
                if isinstance(content, bytes):
                    content = new_head + content[len(head):]
                else:
                    try:
                        content.replace_start(len(head), new_head)
                    except ValueError:  # a header section longer than what the temporary file holds yet
                        return "552 5.3.4 Error: message header section too large to filter"
        queue_id = str(getattr(envelope, "queue_id", "") or "")
        quarantine: tuple[str, str] | None = None  # a milter's quarantine: (its reason, the filter)
        milters = getattr(server, "milters", None)
        if isinstance(milters, MilterSession) and not (isinstance(content, BodyBuffer) and content.failure):
            # the content filters (smtpd_milters): after header_checks and canonical_maps, before signing
            recipients = [(r, tuple(rcpt_params[i]) if rcpt_params else ()) for i, r in enumerate(rcpt_tos)]
            filtered = await self._filter(milters, content, queue_id, client, recipients)
            if isinstance(filtered, str):
                return filtered
            content, new_from, new_rcpts, quarantine = filtered
            mail_from = new_from if new_from is not None else mail_from
            if new_rcpts is not None:
                if not new_rcpts:  # every recipient deleted: nothing to deliver (Postfix discards it too)
                    self.log.warning("milter_discard", queue_id=queue_id, client=client, milter="",
                                     reason="no recipients left")
                    return f"250 2.0.0 Ok: queued as {queue_id}"
                rcpt_tos = [r for r, _ in new_rcpts]
                rcpt_params = [p for _, p in new_rcpts] if any(p for _, p in new_rcpts) else None
        trace = received_header(
            helo=session.host_name or "",
            client_ip=str(peer[0]) if isinstance(peer, tuple) else "",
            hostname=server.hostname,
            protocol=protocol_name(extended=bool(session.extended_smtp), tls=session.ssl is not None,
                                   authenticated=bool(session.authenticated), smtputf8=bool(envelope.smtp_utf8)),
            recipients=envelope.rcpt_tos,  # as the client gave them (Postfix's smtpd writes it before any rewriting)
            when_ts=self.queue.clock(),
            private=bool(session.authenticated) and isinstance(policy, EdgePolicy) and policy.received_private,
        )
        if self.signer:  # RFC 6376: the DKIM-Signature field on top, the (unsigned) Received field below it
            trace = await self.signer.signature_of(content, _origin(server, session, envelope, client, mail_from)) + trace
        body: bytes | BodyBuffer
        if isinstance(content, BodyBuffer):  # a large message, partly in a temporary file (issue 13.4)
            content.head = trace
            body = content
        else:
            body = trace + content
        mail_params = [_param(o) for o in envelope.mail_options]
        ret, envid = getattr(envelope, "dsn_ret", None), getattr(envelope, "dsn_envid", None)
        if ret:
            mail_params.append(("RET", ret))
        if envid:
            mail_params.append(("ENVID", envid))
        release_ts = getattr(envelope, "release_ts", None)
        try:
            env = await self.queue.receive(
                mail_from,
                rcpt_tos,
                body,
                mail_params=mail_params,
                rcpt_params=rcpt_params,
                client=client,
                helo=session.host_name or "",
                not_before_ts=release_ts,
                queue_id=queue_id,
                held=held is not None or quarantine is not None,
            )
        except StorageError as exc:
            self.log.error("queue_write_failed", error=str(exc), client=client, reply=exc.smtp_reply)
            return exc.smtp_reply
        if held is not None:
            self.log.warning("header_checks_hold", queue_id=env.queue_id, client=client, text=held[0],
                             header=held[1][:200], action="held until released (mtaq queue release)")
        if quarantine is not None:
            self.log.warning("milter_quarantine", queue_id=env.queue_id, client=client, milter=quarantine[1],
                             reason=quarantine[0], action="held until released (mtaq queue release)")
        killpoints.hit("edge.after_commit")
        return f"250 2.0.0 Ok: queued as {env.queue_id}"

    async def _filter(
        self, milters: MilterSession, content: bytes | BodyBuffer, queue_id: str, client: str,
        recipients: list[tuple[str, tuple[tuple[str, str], ...]]],
    ) -> str | tuple[bytes | BodyBuffer, str | None, list[tuple[str, tuple[tuple[str, str], ...]]] | None,
                     tuple[str, str] | None]:
        """The message through the milters (:meth:`MilterSession.message`): a reply (refused, discarded), or
        (content with the header and body changes applied, the new sender or None, the recipients
        (address, DSN parameters) or None when unchanged, the quarantine (reason, filter) or None). A spilled
        body is streamed to the filters from its temporary file, piece by piece, in a thread."""
        milters.context = {"queue_id": queue_id, "client": client}
        if milters.discard:  # discarded at MAIL, RCPT or DATA
            self.log.warning("milter_discard", queue_id=queue_id, client=client, milter=milters.discard_by)
            return f"250 2.0.0 Ok: queued as {queue_id}"
        head, whole = await _head_read(content)
        if not whole:
            return "552 5.3.4 Error: message header section too large to filter"
        outcome = await milters.message(head, _body_after(content, len(head)), {"i": queue_id})
        if outcome.reply is not None:
            return outcome.reply
        if outcome.discard:
            self.log.warning("milter_discard", queue_id=queue_id, client=client, milter=outcome.filter)
            return f"250 2.0.0 Ok: queued as {queue_id}"
        edits = outcome.edits
        quarantine = (outcome.quarantine, outcome.filter) if outcome.quarantine is not None else None
        new_head = edit_head(head, edits)
        replaced = new_body(edits)
        if replaced is not None:
            content = (head if new_head is None else new_head) + b"\r\n" + replaced
        elif new_head is not None:
            if isinstance(content, bytes):
                content = new_head + content[len(head):]
            else:
                try:
                    content.replace_prefix(len(head), new_head)
                except ValueError:
                    return "552 5.3.4 Error: message header section too large to filter"
        rcpt_edits = [e for e in edits if e.kind in (SMFIR_ADDRCPT, SMFIR_ADDRCPT_PAR, SMFIR_DELRCPT)]
        return content, new_sender(edits), apply_recipients(recipients, rcpt_edits) if rcpt_edits else None, quarantine


async def _body_after(content: bytes | BodyBuffer, head_len: int) -> AsyncIterator[bytes]:
    """The body of ``content`` (after its ``head_len`` octets of header section and the empty line), in
    pieces: a spilled body read back from its temporary file one piece (64 KiB) at a time, in a thread."""
    if isinstance(content, bytes):
        rest = content[head_len:]
        yield rest[2:] if rest.startswith(b"\r\n") else rest
        return
    pieces = content.pieces()
    skip = head_len
    blank: bytes | None = b""  # the first octets after the header section, until the empty line is known
    while True:
        piece = await asyncio.to_thread(next, pieces, None)
        if piece is None:
            break
        if skip:
            cut = min(skip, len(piece))
            piece, skip = piece[cut:], skip - cut
        if blank is not None:
            blank += piece
            if len(blank) < 2:
                continue
            piece = blank[2:] if blank.startswith(b"\r\n") else blank
            blank = None
        if piece:
            yield piece
    if blank and blank != b"\r":
        yield blank


async def _head_read(content: bytes | BodyBuffer) -> tuple[bytes, bool]:
    """(:func:`_head_of`, whether it is the whole header section: its end was found within
    :data:`~mtaq.edge.dkim.HEAD_BYTES_MAX`)."""
    head = await _head_of(content)
    if isinstance(content, bytes):
        return head, True
    return head, len(head) < HEAD_BYTES_MAX


async def _head_of(content: bytes | BodyBuffer) -> bytes:
    """The header section of a message received (at most :data:`~mtaq.edge.dkim.HEAD_BYTES_MAX` bytes of it
    read from a spilled body, in a thread); b"" for a buffer that failed (the queue refuses it anyway)."""
    if isinstance(content, bytes):
        return header_section(content)
    if content.failure is not None:
        return b""
    if not content.spilled:
        return header_section(content.getvalue())

    def read() -> bytes:
        head = b""
        for piece in content.pieces():
            head += piece
            if split_head(head) is not None or len(head) > HEAD_BYTES_MAX:
                break
        return header_section(head[:HEAD_BYTES_MAX])

    return await asyncio.to_thread(read)


def _rewrites_headers(session: Session, policy: EdgePolicy) -> bool:
    """Whether canonical_maps rewrite the headers of this session's mail: a client in mynetworks or an
    authenticated one (Postfix local_header_rewrite_clients = permit_mynetworks, permit_sasl_authenticated)."""
    if session.authenticated:
        return True
    peer = session.peer
    return isinstance(peer, tuple) and bool(peer) and policy.in_mynetworks(str(peer[0]))


def _keep_original(old: list[str], new: list[str], params: list[Any] | None) -> list[Any] | None:
    """The DSN parameters of each recipient with ``ORCPT=rfc822;ORIGINAL`` added to one that canonical_maps
    rewrote and that came without ORCPT (Postfix keeps the original recipient for DSNs; RFC 3461 §4.2). Only
    for an ASCII original (a UTF-8 one would need the utf-8 address type of RFC 6533)."""
    if old == new:
        return params
    out = list(params) if params is not None else [() for _ in new]
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a != b and a.isascii() and not any(k == "ORCPT" for k, _ in out[i]):
            out[i] = (*out[i], ("ORCPT", f"rfc822;{a}"))
    return out


def _origin(server: SMTP, session: Session, envelope: Envelope, client: str, mail_from: str | None = None) -> Origin:
    """Who handed this message in, as DKIM signing asks (:meth:`Signer.permits`): mynetworks, the login,
    the envelope sender (``mail_from``, after canonical_maps; default the one given), and the
    ``sender_login_map`` lookup for that login."""
    policy = getattr(server, "policy", None)
    pol = policy if isinstance(policy, EdgePolicy) else EdgePolicy()
    peer = session.peer
    ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
    login = ""
    if session.authenticated:
        name = getattr(server, "login_name", None)
        login = name() if callable(name) else ""
    owns = None
    if pol.sender_logins is not None:
        def owns(address: str) -> bool:
            return pol.login_owns(address, login)
    return Origin(client=client, mynetworks=bool(ip) and pol.in_mynetworks(ip), login=login,
                  mail_from=envelope.mail_from or "" if mail_from is None else mail_from, owns=owns)


def _param(option: str) -> tuple[str, str]:
    key, _, value = option.partition("=")
    return key.upper(), value


class _TlsAfterAdmission(asyncio.Protocol):
    """An smtps connection from accept to the end of its TLS handshake (RFC 8314 §3.3).

    The gate is asked first: a refused client is disconnected at once (no reply: it expects TLS, and a
    handshake would cost the CPU the limit is there to save); an admitted one holds its place during the
    handshake, which must end within ``handshake_timeout_s``, so unfinished handshakes count in
    ``connections_max``, the per-client limits and the rate like any connection. The handshake is asyncio's
    SSLProtocol over the accepted transport (as aiosmtpd's STARTTLS does); the SMTP protocol owns the place
    from the start and gives it back when the connection ends, or here when the handshake fails.
    What the client sent while the gate was asked (its ClientHello) is kept and handed to the TLS layer."""

    def __init__(self, make_smtp: Callable[[], MtaqSMTP], gate: Gate | None, context: ssl.SSLContext,
                 handshake_timeout_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.make_smtp, self.gate, self.context = make_smtp, gate, context
        self.handshake_timeout_s, self.loop = handshake_timeout_s, loop
        self.transport: asyncio.Transport | None = None
        self.early = bytearray()  # bytes received before the gate answered
        self.lost = False  # the connection ended while the gate was asked

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        task = self.loop.create_task(self._start(ip))
        _starting.add(task)
        task.add_done_callback(_starting.discard)

    def data_received(self, data: bytes) -> None:
        # Kept for the TLS layer; nothing more is read until the gate has answered (uvloop starts reading
        # after connection_made whatever the protocol did there, so the pause is here).
        self.early += data
        if self.transport is not None:
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def eof_received(self) -> bool:
        return False

    async def _start(self, ip: str) -> None:
        transport = self.transport
        assert transport is not None
        gate = self.gate
        refusal = await gate.ask_admit(ip) if gate is not None else None
        if self.lost:
            if refusal is None and gate is not None:
                gate.release(ip)
            return
        if refusal is not None:
            get_logger().info("connection_refused", client=ip, reason=refusal, code=None)  # issue 38.3: no reply, before TLS
            transport.abort()
            return
        smtp = self.make_smtp()
        if gate is not None:
            smtp.admitted_as(ip)
        waiter = self.loop.create_future()
        tls = sslproto.SSLProtocol(self.loop, smtp, self.context, waiter, server_side=True,
                                   ssl_handshake_timeout=self.handshake_timeout_s)  # type: ignore[arg-type]  # seconds, a float

        def handshake_done(fut: asyncio.Future[None]) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if exc is None:
                return  # smtp.connection_made was called: the place is its own
            # A failed, timed-out or abandoned handshake: the SMTP protocol never started; the place is free.
            smtp.release_admission()
            get_logger().warning("tls_handshake_failed", client=ip, error=f"{type(exc).__name__}: {exc}")

        waiter.add_done_callback(handshake_done)
        transport.set_protocol(tls)
        tls.connection_made(transport)
        if self.early:
            _feed(tls, bytes(self.early))
            self.early.clear()
        transport.resume_reading()


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    """Hand ``data`` to a buffered protocol as if the transport had read it."""
    view = memoryview(data)
    while view:
        buf = memoryview(protocol.get_buffer(len(view))).cast("B")
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        protocol.buffer_updated(n)
        view = view[n:]


def gate_limits(policy: EdgePolicy) -> dict[str, Any]:
    """The keyword arguments of :class:`ConnectionGate` (and :meth:`ConnectionGate.configure`) that
    ``policy`` sets: its limits and its mynetworks exemption."""
    return {
        "connections_max": policy.connections_max,
        "per_client_per_minute_max": policy.client_connections_per_minute_max,
        "exempt": policy.in_mynetworks,
        "client_connections_max": policy.client_connections_max,
        "mynetworks_reserve": policy.mynetworks_reserve(),
        "auth_failures_per_minute_max": policy.auth_failures_per_minute_max,
        "ipv6_prefix_length": policy.client_ipv6_prefix_length,
        "exempt_key": policy.mynetworks_key(),
    }


def connection_gate(policy: EdgePolicy, clock: Callable[[], float]) -> ConnectionGate:
    """The :class:`ConnectionGate` of ``policy``'s limits; give one to every listener of a daemon so that
    ``connections_max`` and the per-client limits count the connections of all its ports together."""
    return ConnectionGate(clock=clock, **gate_limits(policy))


@dataclass
class EdgeSettings:
    """What a new SMTP session of a listener starts with, read at each accepted connection: a reload
    (``mtaq reload``, :meth:`mtaq.daemon.process.Daemon.reload`) replaces the fields, and the sessions
    already open keep what they started with (Postfix's ``postfix reload``: the running smtpd processes
    finish on the old configuration).

    ``policy``: relay control, limits, TLS certificate and AUTH passwords; ``data_size_limit``: bytes
    (``message_size_limit_bytes``); ``timeout_s``: idle seconds before ``421 4.4.2``
    (``smtp_server_timeout_s``); ``tls_handshake_timeout_s``: seconds an smtps client has for its handshake;
    ``verifier``: recipient verification with the next hop (``reject_unverified_recipient``), None for none."""

    policy: EdgePolicy
    data_size_limit: int
    timeout_s: float
    tls_handshake_timeout_s: float = TLS_HANDSHAKE_TIMEOUT_S
    # Asks the next hop about recipients when policy.verify_recipients (mtaq.delivery.verify); None: never.
    verifier: RecipientVerifier | None = None


async def start_server(
    handler: QueueHandler,
    host: str,
    port: int,
    *,
    hostname: str,
    data_size_limit: int,
    timeout_s: float,
    policy: EdgePolicy | None = None,
    sock: socket.socket | None = None,
    gate: Gate | None = None,
    auth_required: bool = False,
    tls_required: bool = False,
    implicit_tls: bool = False,
    tls_handshake_timeout_s: float = TLS_HANDSHAKE_TIMEOUT_S,
    settings: EdgeSettings | None = None,
    milters: tuple[str, ...] | None = None,
) -> asyncio.Server:
    """Listen on ``host:port`` with :class:`MtaqSMTP`; returns the asyncio server.

    ``data_size_limit`` in bytes (SIZE, ``552 5.3.4``); ``timeout_s`` the idle time before ``421 4.4.2``;
    ``policy`` the relay control, limits, TLS and AUTH (default: :class:`EdgePolicy`'s safe defaults);
    ``sock``: a bound, listening socket to serve instead of ``host:port`` (several worker processes share one
    accept queue: :func:`mtaq.daemon.workers.bind_listeners`).
    ``gate``: the connection admission to use (default: a new one for this listener's connections alone).

    The listener's mode (a submission or smtps service, :class:`mtaq.config.Listener`):
    ``auth_required``: MAIL, RCPT, DATA (and VRFY, HELP) get ``530 5.7.0 Authentication required`` before
    AUTH, so nobody relays unauthenticated, mynetworks included; ``tls_required``: every command but EHLO,
    NOOP, STARTTLS and QUIT gets ``530 5.7.0 Must issue a STARTTLS command first`` before STARTTLS;
    ``implicit_tls``: TLS from the first byte (RFC 8314 §3.3, port 465) with the policy's certificate, no
    STARTTLS offered, AUTH offered at once; a client that does not start TLS gets no greeting. The gate
    admits the connection at accept, before the TLS handshake, which must end within
    ``tls_handshake_timeout_s`` seconds (a refused client is disconnected without a reply). Raises OSError if it cannot listen, ValueError when the
    policy has no certificate for ``tls_required`` / ``implicit_tls``.

    ``settings``: an :class:`EdgeSettings` read at every accepted connection instead of ``policy``,
    ``data_size_limit``, ``timeout_s`` and ``tls_handshake_timeout_s`` (which are then ignored): the
    daemon's, which a reload changes for the sessions that start after it.

    ``milters``: this listener's content filters (its ``smtpd_milters``) instead of the policy's
    (:class:`mtaq.edge.milter.MilterSettings`); None: the policy's.
    """
    loop = asyncio.get_running_loop()
    if settings is None:
        settings = EdgeSettings(policy if policy is not None else EdgePolicy(), data_size_limit, timeout_s,
                                tls_handshake_timeout_s)
    live = settings
    pol = live.policy
    if (tls_required or implicit_tls) and pol.tls_context is None:
        raise ValueError("a listener that requires TLS needs a certificate (tls_cert_file, tls_key_file)")
    if gate is None:
        gate = connection_gate(pol, loop.time)

    # Large bodies go to the queue's bounded buffer (issue 13.4); a handler without a queue gets bytes.
    queue = getattr(handler, "queue", None)
    body_buffer = queue.new_body if isinstance(queue, Queue) else None

    def factory() -> MtaqSMTP:
        pol = live.policy  # the policy in force when this connection was accepted, for its whole session
        return MtaqSMTP(
            handler,
            hostname=hostname,
            ident="ESMTP mtaq",
            data_size_limit=live.data_size_limit,
            enable_SMTPUTF8=True,
            decode_data=False,
            timeout=live.timeout_s,
            tls_context=None if implicit_tls else pol.tls_context,
            require_starttls=tls_required and not implicit_tls,
            auth_required=auth_required,
            implicit_tls=implicit_tls,
            policy=pol,
            gate=gate,
            body_buffer=body_buffer,
            verifier=live.verifier,
            loop=loop,
            milters=milters,
        )

    where: dict[str, Any] = {"sock": sock} if sock is not None else {"host": host, "port": port, "reuse_address": True}
    if implicit_tls:

        def tls_factory() -> Any:
            context = live.policy.tls_context  # a reload keeps one for a listener that needs it
            assert context is not None
            return _TlsAfterAdmission(factory, gate, context, live.tls_handshake_timeout_s, loop)

        return await loop.create_server(tls_factory, **where)
    return await loop.create_server(factory, **where)
