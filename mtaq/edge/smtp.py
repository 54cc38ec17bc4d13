"""aiosmtpd's SMTP protocol, extended to receive the DSN parameters of RFC 3461.

aiosmtpd 1.4.6 answers ``555`` to every RCPT parameter and to MAIL parameters it does not know, so the
Delivery Status Notification extension cannot be received with it as it is. :class:`MtaqSMTP` adds it:

* EHLO advertises ``DSN`` (RFC 3461 §3), after whatever aiosmtpd and the handler's ``handle_EHLO``
  produce; the handler need not know about it.
* MAIL accepts ``RET=FULL|HDRS`` (§4.3) and ``ENVID=xtext`` (§4.4, at most 100 characters).
* RCPT accepts ``NOTIFY=NEVER`` or a comma list of ``SUCCESS``, ``FAILURE``, ``DELAY`` (§4.1) and
  ``ORCPT=addr-type;xtext`` (§4.2, at most 500 characters).

The DSN parameters are taken out of the command before aiosmtpd sees it; aiosmtpd then handles the rest
(SIZE, BODY, SMTPUTF8, the handler's ``handle_MAIL``/``handle_RCPT`` hooks) as before. The values are kept
on the envelope (:class:`DsnEnvelope`): ``dsn_ret`` and ``dsn_envid`` for the transaction, and ``rcpt_dsn``,
one tuple of ``(keyword, value)`` pairs per accepted recipient, aligned with ``rcpt_tos``. ENVID and ORCPT
are kept decoded (the ``+HH`` escapes of xtext, RFC 3461 §4, undone). A bad value or a repeated keyword is
answered ``501 5.5.4`` (RFC 3463: invalid command arguments) and the transaction goes on as if the command
had not been sent. The parameters are only known after EHLO; after HELO they are a syntax error, as any
parameter is (aiosmtpd's reply, unchanged).

RFC 3461 lets the MAIL line grow by the ENVID and RET parameters and the RCPT line by up to 500 characters
of ORCPT; the per-command line limits are raised accordingly after an EHLO that advertised DSN.

The same class is where the edge is made safe (the policy is :class:`~mtaq.edge.policy.EdgePolicy`):

* **Relay control and address checks** at MAIL and RCPT, before the handler's hooks (``553 5.1.3``,
  ``553 5.6.7``, ``554 5.7.1``), and at most ``recipients_max`` recipients (``452 4.5.3``, RFC 5321
  §4.5.3.1.10).
* **DATA** is read here, not by aiosmtpd: only ``CRLF . CRLF`` ends it (RFC 5321 §4.1.1.4, §2.3.8). A bare
  CR or LF anywhere in it is refused (``550 5.5.2 ... Error: bare <LF> received``, then the connection is
  closed, as Postfix 3.9 does with ``smtpd_forbid_bare_newline = reject``) or, with ``normalize``, turned
  into CRLF; either way ``\n.\r\n``, ``\n.\n``, ``\r.\r\n`` and the like are message content and can neither
  end the message nor start a second one. A text line longer than 1000 octets with its CRLF, not counting
  the transparency dot (RFC 5321 §4.5.3.1.6), gets ``500 5.5.2`` (Exim's ``message_linelength_limit``
  refuses such lines too); more than ``data_size_limit`` octets get ``552 5.3.4``. Each reply comes after
  the final dot (RFC 5321 §4.2.5) and nothing of a refused message reaches the handler.
* **Replies**: every 2xx/4xx/5xx reply carries an enhanced status code (RFC 2034, :mod:`mtaq.edge.replies`);
  EHLO also offers PIPELINING, ENHANCEDSTATUSCODES and DSN; AUTH only with a password file and only after
  STARTTLS (aiosmtpd answers ``538 5.7.11`` before it).
* **Limits**: connections the gate refuses (:class:`~mtaq.edge.limits.Gate`: this process's
  :class:`~mtaq.edge.limits.ConnectionGate`, or the host's anvil with several workers) get ``421 4.7.0`` instead of
  the greeting (in all, per client IP, or outside the places kept for mynetworks); an idle client gets
  ``421 4.4.2`` (aiosmtpd just closed); after ``errors_max`` errors (5xx replies, and exceptions, which are
  answered ``451 4.3.0``) the client gets ``421 4.7.0 ... too many errors`` (Postfix
  ``smtpd_hard_error_limit``). After any 421 the connection is closed and nothing more is read (RFC 5321
  §3.8). An exception is logged with its traceback once per session, later ones as one line.
* **Bad path syntax**: a MAIL or RCPT argument the address parser cannot even parse (``MAIL FROM:<``, on
  which the email package raises) gets Postfix's ``501 5.1.7 Bad sender address syntax`` /
  ``501 5.1.3 Bad recipient address syntax`` (RFC 5321 §4.1.2), an error like any other 5xx.
* **NUL** octets in DATA: ``550 5.6.0 Error: message contains NUL characters`` after the final dot (the
  session goes on), or with ``forbid_nul = "strip"`` they are removed.
* **AUTH failures** are answered ``535 5.7.8`` only after ``error_sleep_s`` (Postfix
  ``smtpd_error_sleep_time``), logged as ``auth_failed`` (client, user name escaped, mechanism) and counted
  per client IP in the gate; over ``auth_failures_per_minute_max`` AUTH gets ``450 4.7.1 Error: too many
  AUTH failures from <ip>`` (Postfix's anvil reply to its AUTH rate limit) and counts as an error.
* **STARTTLS**: aiosmtpd discards what the client sent after ``STARTTLS`` in the clear before the handshake
  (RFC 3207 §4.2; the CVE-2011-0411 command injection), and starts a fresh session after it.
* **Listener modes** (issue 16.5, :func:`mtaq.edge.server.start_server`): aiosmtpd's ``require_starttls``
  (``530 5.7.0 Must issue a STARTTLS command first``) and ``auth_required`` (``530 5.7.0 Authentication
  required`` at MAIL, RCPT, DATA) for a submission port; ``implicit_tls`` for an smtps port, where the
  handshake was done after the gate admitted the connection (:func:`mtaq.edge.server.start_server`): no
  STARTTLS, AUTH offered at once, ``session.ssl`` filled in as after STARTTLS.
* **Recipient verification** (``reject_unverified_recipient``): with a ``verifier``, a recipient of a relay
  domain from a client outside mynetworks and not authenticated is checked with the next hop after relay
  control (:meth:`EdgePolicy.verification_wanted`, :mod:`mtaq.delivery.verify`): ``550 5.1.1 ...
  undeliverable address: ...`` or ``450 4.1.1 ... unverified address: ...``
  (:meth:`EdgePolicy.unverified_reply`).
* **Sender login mismatch**: with ``policy.sender_logins``, MAIL FROM of an authenticated client that does
  not own the address gets ``553 5.7.1 <addr>: Sender address rejected: not owned by user USER``
  (Postfix ``reject_authenticated_sender_login_mismatch``; :meth:`EdgePolicy.sender_login_reply`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import datetime as dt
import functools
import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from aiosmtpd.smtp import MISSING, SMTP, AuthResult, Envelope, LoginPassword, TLSSetupException, syntax

from mtaq.core.text import escape_text
from mtaq.edge.data import DataScanner, read_data_text, refusal
from mtaq.edge.fastpath import FastPathMixin, parse_address
from mtaq.edge.limits import Gate
from mtaq.edge.milter import MilterSession
from mtaq.edge.policy import EdgePolicy, RecipientVerifier, address_problem, unsendable_character
from mtaq.edge.replies import enhance, reply_code
from mtaq.logs import get_logger
from mtaq.queue.store import new_queue_id
from mtaq.storage.spill import BodyBuffer

__all__ = ["DsnEnvelope", "DsnParams", "DsnSyntaxError", "MtaqSMTP", "decode_xtext", "encode_xtext",
           "parse_mail_dsn", "parse_rcpt_dsn"]

DsnParams = tuple[tuple[str, str], ...]
"""The DSN parameters of one recipient, e.g. ``(("NOTIFY", "SUCCESS,FAILURE"), ("ORCPT", "rfc822;a@b"))``."""

ENVID_MAX = 100
"""RFC 3461 §4.4: the ENVID value is at most 100 characters (checked on the xtext as sent)."""
ORCPT_MAX = 500
"""RFC 3461 §4.2: the ORCPT parameter may be up to 500 characters (checked on the value as sent)."""

_MAIL_KEYWORDS = frozenset({"RET", "ENVID", "HOLDFOR", "HOLDUNTIL"})
_RCPT_KEYWORDS = frozenset({"NOTIFY", "ORCPT"})
_RET_VALUES = frozenset({"FULL", "HDRS"})
_NOTIFY_VALUES = ("SUCCESS", "FAILURE", "DELAY")
# How much longer a MAIL / RCPT line may be with the DSN parameters: " RET=HDRS ENVID=" + 100, and
# " NOTIFY=SUCCESS,FAILURE,DELAY ORCPT=" + 500.
_MAIL_EXTRA = len(" RET=HDRS ENVID=") + ENVID_MAX + len(" HOLDUNTIL=2026-11-22T08:00:00.000000+00:00")
_RCPT_EXTRA = len(" NOTIFY=SUCCESS,FAILURE,DELAY ORCPT=") + ORCPT_MAX

# RFC 3461 §4: xchar is "!" (33) to "~" (126) except "+" and "="; hexchar is "+" and two upper case hex digits.
_XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-F]{2})*")
_HEXCHAR = re.compile(r"\+([0-9A-F]{2})")
# RFC 3461 §4.2: addr-type is an atom (RFC 822), here also without "=" (not allowed in an esmtp-value).
_ADDR_TYPE = re.compile(r"[A-Za-z0-9!#$%&'*+\-/?^_`{|}~]+")

_SYNTAX = "501 5.5.4 Syntax error in parameters: "


def _not_login_data_deprecation(record: logging.LogRecord) -> bool:
    """aiosmtpd 1.4 sets its deprecated ``Session.login_data`` on every successful AUTH and warns about it
    through the ``mail.log`` logger, which Python's last-resort handler prints to stderr as a bare line in
    the middle of the daemon's JSON events. mtaq never reads ``login_data``; drop that one warning."""
    return "login_data is deprecated" not in record.getMessage()


logging.getLogger("mail.log").addFilter(_not_login_data_deprecation)

_EXTENSIONS = ("PIPELINING", "ENHANCEDSTATUSCODES", "DSN")


class DsnSyntaxError(ValueError):
    """A DSN parameter with a bad value, or given twice; :attr:`reply` is the ``501 5.5.4`` to send."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.reply = _SYNTAX + detail


class DsnEnvelope(Envelope):
    """aiosmtpd's envelope plus the RFC 3461 parameters of the transaction.

    ``dsn_ret`` is ``"FULL"``, ``"HDRS"`` or ``None``; ``dsn_envid`` the decoded ENVID or ``None``;
    ``rcpt_dsn[i]`` holds the DSN parameters given with ``rcpt_tos[i]`` (``()`` when none were given).
    """

    def __init__(self) -> None:
        super().__init__()
        self.dsn_ret: str | None = None
        self.dsn_envid: str | None = None
        self.rcpt_dsn: list[DsnParams] = []
        self.release_ts: float | None = None  # RFC 4865 HOLDFOR/HOLDUNTIL: first attempt not before (UTC s)
        self.queue_id = ""  # given at MAIL when milters are asked (their macro i); "" : made when queued


def decode_xtext(value: str) -> str:
    """Decode RFC 3461 §4 xtext (``+HH`` escapes); ``ValueError`` if ``value`` is not xtext."""
    if _XTEXT.fullmatch(value) is None:
        raise ValueError("not xtext")
    return _HEXCHAR.sub(lambda m: chr(int(m.group(1), 16)), value)


def encode_xtext(text: str) -> str:
    """Encode printable US-ASCII ``text`` as RFC 3461 §4 xtext: ``+``, ``=`` and the rest as ``+HH``."""
    out = []
    for ch in text:
        code = ord(ch)
        if code > 0xFF:
            raise ValueError("xtext encodes octets only")
        out.append(ch if 33 <= code <= 126 and ch not in "+=" else f"+{code:02X}")
    return "".join(out)


def _printable(text: str) -> bool:
    return all(" " <= ch <= "~" for ch in text)


def _split_params(tokens: Iterable[str], keywords: Collection[str]) -> dict[str, str | None]:
    """``{KEYWORD: value or None}`` for the tokens whose keyword is one of ``keywords``; duplicates rejected."""
    found: dict[str, str | None] = {}
    for token in tokens:
        key, eq, value = token.partition("=")
        key = key.upper()
        if key not in keywords:
            continue
        if key in found:
            raise DsnSyntaxError(f"{key} given more than once")
        found[key] = value if eq else None
    return found


def parse_mail_dsn(tokens: Iterable[str]) -> tuple[str | None, str | None]:
    """``(ret, envid)`` from MAIL parameter tokens (RFC 3461 §4.3, §4.4); other tokens are ignored.

    ``ret`` is upper-cased; ``envid`` is decoded and must be printable US-ASCII. Raises :class:`DsnSyntaxError`.
    """
    found = _split_params(tokens, _MAIL_KEYWORDS)
    ret: str | None = None
    envid: str | None = None
    if "RET" in found:
        ret = (found["RET"] or "").upper()
        if ret not in _RET_VALUES:
            raise DsnSyntaxError("RET must be FULL or HDRS")
    if "ENVID" in found:
        raw = found["ENVID"] or ""
        try:
            envid = decode_xtext(raw)
        except ValueError:
            envid = None
        if not raw or len(raw) > ENVID_MAX or envid is None or not _printable(envid):
            raise DsnSyntaxError(f"ENVID must be xtext of 1 to {ENVID_MAX} characters")
    return ret, envid


# RFC 4865 §4: HOLDFOR is 1*9DIGIT seconds; HOLDUNTIL an RFC 3339 date-time (erratum 2040).
_ENHANCED_CODE = re.compile(r"[245]\.\d{1,3}\.\d{1,3}")
_HOLDFOR = re.compile(r"[0-9]{1,9}")
NO_LIMIT_S = 999_999_999  # what FUTURERELEASE advertises when delay_max_s = 0 (the largest 9-digit interval)


def parse_future_release(tokens: Iterable[str], now_ts: float, delay_max_s: float) -> float | None:
    """The release time (UTC seconds) asked by HOLDFOR / HOLDUNTIL among MAIL parameter tokens, or None.

    A request beyond ``delay_max_s`` (0: no limit) is refused, naming the limit (Pulsar PIP-315's rule); so
    are both parameters at once, a malformed value and a time in the past. Raises :class:`DsnSyntaxError`
    whose reply is ``501 5.5.4`` (RFC 4865: the hold parameter is invalid).
    """
    found = _split_params(tokens, ("HOLDFOR", "HOLDUNTIL"))
    if not found:
        return None
    if len(found) == 2:
        raise DsnSyntaxError("HOLDFOR and HOLDUNTIL cannot both be given")
    limit = delay_max_s if delay_max_s > 0 else NO_LIMIT_S
    if "HOLDFOR" in found:
        raw = found["HOLDFOR"] or ""
        if not _HOLDFOR.fullmatch(raw):
            raise DsnSyntaxError("HOLDFOR must be a number of seconds (1 to 9 digits)")
        delay = float(raw)
    else:
        raw = found["HOLDUNTIL"] or ""
        try:
            when = dt.datetime.fromisoformat(raw.replace("z", "Z"))
        except ValueError:
            raise DsnSyntaxError("HOLDUNTIL must be an RFC 3339 date-time, e.g. 2026-11-22T08:00:00Z") from None
        if when.tzinfo is None:
            raise DsnSyntaxError("HOLDUNTIL needs a time zone (Z or +hh:mm)")
        delay = when.timestamp() - now_ts
        if delay < 0:
            raise DsnSyntaxError("HOLDUNTIL is in the past")
    if delay > limit:
        raise DsnSyntaxError(f"requested delay of {delay:.0f} seconds exceeds the maximum of {limit:.0f} seconds (delay_max_s)")
    return now_ts + delay


def future_release_keyword(now_ts: float, delay_max_s: float) -> str:
    """The EHLO line ``FUTURERELEASE <max-interval> <max-date-time>`` (RFC 4865 §3), as of ``now_ts``."""
    limit = int(delay_max_s) if delay_max_s > 0 else NO_LIMIT_S
    return _future_line(math.floor(now_ts), limit)  # the same line for every EHLO within one second


@functools.lru_cache(maxsize=4)
def _future_line(second: int, limit: int) -> str:
    until = dt.datetime.fromtimestamp(second + limit, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"FUTURERELEASE {limit} {until}"


@functools.lru_cache(maxsize=1024)
def _enhanced(status: str, verb: str | None) -> tuple[str, int]:
    """``push``'s reply ``status`` answering ``verb``, with its enhanced code, and its basic code."""
    text = enhance(status, verb)
    return text, reply_code(text)


@functools.lru_cache(maxsize=64)  # the same reply for every client of a listener, for a second
def _ehlo_reply(lines: tuple[str | bytes, ...], no_auth: bool, future: str) -> tuple[str, bool]:
    """aiosmtpd's EHLO reply ``lines`` as one text (AUTH left out with ``no_auth``; PIPELINING,
    ENHANCEDSTATUSCODES, DSN and ``future`` added to a positive reply), and whether they were added."""
    kept = [line for line in lines if _ehlo_keyword(line) != "AUTH"] if no_auth else list(lines)
    with_ext = _with_extensions(kept, (*_EXTENSIONS, future))
    # One write for the whole reply: clients that read "a line" and take what came with it (nmap's smtp
    # library) would otherwise take the rest of the EHLO reply as the reply to what follows.
    out = with_ext if with_ext is not None else kept
    texts = [line.decode("utf-8", "replace") if isinstance(line, bytes) else line for line in out]
    return "\r\n".join(texts), with_ext is not None
_IDLE_SLACK_S = 0.001  # the idle timer: what counts as its deadline reached (uvloop's timers are in ms)


def parse_rcpt_dsn(tokens: Iterable[str]) -> DsnParams:
    """The DSN parameters among RCPT parameter tokens (RFC 3461 §4.1, §4.2); other tokens are ignored.

    NOTIFY is upper-cased and deduplicated; ORCPT keeps its addr-type as given and has its xtext decoded.
    The result lists NOTIFY before ORCPT, each only if given. Raises :class:`DsnSyntaxError`.
    """
    found = _split_params(tokens, _RCPT_KEYWORDS)
    params: list[tuple[str, str]] = []
    if "NOTIFY" in found:
        items = (found["NOTIFY"] or "").upper().split(",")
        if items == ["NEVER"]:
            params.append(("NOTIFY", "NEVER"))
        elif all(item in _NOTIFY_VALUES for item in items):
            params.append(("NOTIFY", ",".join(dict.fromkeys(items))))
        else:
            raise DsnSyntaxError("NOTIFY must be NEVER or a list of SUCCESS, FAILURE, DELAY")
    if "ORCPT" in found:
        raw = found["ORCPT"] or ""
        addr_type, semi, xtext = raw.partition(";")
        try:
            address = decode_xtext(xtext)
        except ValueError:
            address = ""
        if (not semi or len(raw) > ORCPT_MAX or _ADDR_TYPE.fullmatch(addr_type) is None
                or not address or not _printable(address)):
            raise DsnSyntaxError("ORCPT must be addr-type;xtext")
        params.append(("ORCPT", f"{addr_type};{address}"))
    return tuple(params)


class MtaqSMTP(FastPathMixin, SMTP):
    """aiosmtpd's :class:`~aiosmtpd.smtp.SMTP` with DSN, relay control, limits, DATA checks (module docstring).

    Takes aiosmtpd's arguments, plus ``policy`` (default: :class:`EdgePolicy`'s safe defaults) and ``gate``
    (connection admission shared by the listener; None admits everyone). Pass ``tls_context`` for STARTTLS.
    The envelope is a :class:`DsnEnvelope`; a subclass that overrides :meth:`_create_envelope` must return one.
    """

    def __init__(
        self,
        handler: Any,
        *args: Any,
        policy: EdgePolicy | None = None,
        gate: Gate | None = None,
        body_buffer: Callable[[], BodyBuffer] | None = None,
        implicit_tls: bool = False,
        milters: tuple[str, ...] | None = None,
        verifier: RecipientVerifier | None = None,
        **kwargs: Any,
    ) -> None:
        # aiosmtpd keeps the per-command line limits in a class attribute, shared by every connection (and
        # grown on each EHLO); give each connection its own.
        self.command_size_limits = collections.defaultdict(lambda: self.command_size_limit)
        self._ehlo_lines: list[str | bytes] | None = None
        self.policy = policy if policy is not None else EdgePolicy()
        self.sasl_enabled = self.policy.passwords is not None  # HELP lists AUTH only then
        self.gate = gate
        # Recipient verification with the next hop (reject_unverified_recipient), when the policy asks for it.
        self.verifier = verifier
        self._verb: str | None = None  # the command being answered, for the enhanced status codes
        # MAIL, RCPT or DATA while one is answered: a 4xx/5xx reply to it is logged as smtp_reject (and its argument)
        self._stage: str | None = None
        self._stage_arg: str | None = None
        self._errors = 0  # 5xx replies sent in this connection
        self._closing = False  # a 421 went out: say nothing more
        self._admitted = False  # holds a place in the gate
        self._refusal: str | None = None  # why the gate refused this connection
        # Where a message's lines go while DATA is read: a BodyBuffer (memory bounded, the rest in a temporary
        # file; the handler gets it as envelope.content when the message was large) or, with None, a list.
        self._body_buffer = body_buffer
        self._gate_ip = ""  # the client address the gate admitted
        self._in_data = False  # the text of a message is being read
        self._exceptions = 0  # exceptions that reached handle_exception in this connection
        # TLS from the first byte (RFC 8314, a smtps listener): the handshake is done before connection_made
        # (after the gate admitted the connection, mtaq.edge.server); no STARTTLS is offered (pass no
        # tls_context), and AUTH is offered at once.
        self.implicit_tls = implicit_tls
        self._idle_deadline = 0.0  # loop time at which the client is idle too long (see _reset_timeout)
        self._idle_when = 0.0  # loop time the idle timer was set for (uvloop's handles may not tell)
        self._idle_armed = False  # the idle timer is set and has not fired
        # Content filters (mtaq.edge.milter): the listener's own smtpd_milters, else the policy's; the session
        # with them is opened at connect (None: no filter).
        self._milter_specs = milters
        self.milters: MilterSession | None = None
        self._auth_mechanism = ""
        self._building = True  # FastPathMixin: the command and AUTH tables are made after aiosmtpd's __init__
        exclude = kwargs.get("auth_exclude_mechanism")
        if exclude is not None:  # read twice (aiosmtpd's __init__, then _fast_tables): a one-shot iterable would not do
            exclude = kwargs["auth_exclude_mechanism"] = tuple(exclude)
        super().__init__(handler, *args, **kwargs)
        self._fast_tables(exclude)
        if implicit_tls:
            # aiosmtpd knows TLS only through its own STARTTLS; the connection is TLS already, so AUTH needs
            # nothing more (set after __init__: passing auth_require_tls=False would warn on every connection).
            self._auth_require_tls = False

    def _create_envelope(self) -> DsnEnvelope:
        """A fresh :class:`DsnEnvelope` for each transaction (connect, HELO/EHLO, RSET, after DATA)."""
        return DsnEnvelope()

    def _dsn_envelope(self) -> DsnEnvelope:
        envelope = self.envelope
        assert isinstance(envelope, DsnEnvelope), "MtaqSMTP needs a DsnEnvelope"
        return envelope

    def client_ip(self) -> str:
        """The client's IP address as text ("" if unknown)."""
        peer = self.session.peer if self.session is not None else None
        return str(peer[0]) if isinstance(peer, tuple) and peer else ""

    # ---------------------------------------------------------------------------- connection and replies
    def admitted_as(self, ip: str) -> None:
        """The connection was admitted by the gate already, for ``ip`` (an smtps listener admits before the
        TLS handshake: :func:`mtaq.edge.server.start_server`); its place is given back when it ends."""
        self._admitted = True
        self._gate_ip = ip

    def release_admission(self) -> bool:
        """Give the place back now (an smtps connection whose handshake failed: never made, never lost);
        False when it holds none."""
        if not self._admitted or self.gate is None:
            return False
        self._admitted = False
        self.gate.release(self._gate_ip)
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """aiosmtpd's; the gate is asked in :meth:`_handle_client`, before the greeting (not again after STARTTLS)."""
        first = self.transport is None and self._original_transport is None
        if first and not self._admitted:
            peer = transport.get_extra_info("peername")
            self._gate_ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        super().connection_made(transport)
        if first and self.implicit_tls and self.session is not None and self.session.ssl is None:
            # What aiosmtpd records after STARTTLS (its SSLProtocol's extra info): the Received header then
            # says ESMTPS/ESMTPSA.
            self.session.ssl = {k: transport.get_extra_info(k)
                                for k in ("sslcontext", "peercert", "cipher", "compression", "ssl_object")}

    def tls_active(self) -> bool:
        """Whether this connection is encrypted: after STARTTLS, or from the first byte (implicit TLS)."""
        return self._tls_protocol is not None or self.implicit_tls

    def connection_lost(self, error: Exception | None) -> None:
        """aiosmtpd's, and the connection's place in the gate is given back (and the filters told SMFIC_QUIT)."""
        self.release_admission()
        if self.milters is not None:
            self.milters.close()
        if self.session is None:  # an smtps connection whose TLS handshake failed: never made
            return
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        """aiosmtpd's (it cancels the session's handler), and the connection is closed (False). aiosmtpd kept
        the transport open (True) and left the closing to the handler's ``except CancelledError``, which a
        handler cancelled before it reached its command loop (not yet started, asking the gate, greeting)
        never runs: a client that connected and closed at once (a port scanner's FIN) left a socket in
        CLOSE-WAIT for ``smtp_server_timeout_s`` (300 s), not counted in any limit. An end of stream before
        :meth:`connection_made` (right after an smtps handshake) closes too."""
        if self.session is not None:
            super().eof_received()
        return False

    async def _handle_client(self) -> None:
        if not self._admitted and self.gate is not None:
            # Admission before the greeting (the host's gate may answer from another process: a cancellation
            # while asking leaves nothing held, the gate gives a late place back itself, and one answered
            # just before the cancellation too: mtaq.daemon.anvil.AnvilClient._ask).
            self._refusal = await self.gate.ask_admit(self._gate_ip)
            self._admitted = self._refusal is None
        if self._refusal is not None:
            # issue 38.3: the refusal as an event (Postfix: "warning: Connection rate limit exceeded" / anvil)
            get_logger().info("connection_refused", client=self._gate_ip, reason=self._refusal, code=421)
            await self.push(f"421 4.7.0 {self.hostname} Error: {self._refusal}")
            return
        specs = self._milter_specs if self._milter_specs is not None else self.policy.milter.smtpd_milters
        if specs:
            # Postfix: the filters hear of the connection before the greeting; a refusal (or the default
            # action of a filter that failed) is the answer to every MAIL of the session (MilterSession.refused).
            milters = self.milters = MilterSession(self.policy.milter, specs)
            peer = self.session.peer if self.session is not None else None
            ip = self.client_ip()
            port = int(peer[1]) if isinstance(peer, tuple) and len(peer) > 1 else 0
            milters.context = {"client": f"{ip}:{port}"}
            await milters.connect(f"[{ip}]" if ip else "unknown", ip, port, self._milter_macros("connect"))
        await super()._handle_client()

    def _milter_macros(self, stage: str, envelope: DsnEnvelope | None = None, address: str = "") -> dict[str, str]:
        """The macros Postfix sends at ``stage`` (its milter_*_macros defaults, MILTER_README "Sendmail
        macro emulation"): j, {daemon_name}, v, _, {client_*} at connect; {tls_version}, {cipher},
        {cipher_bits} at HELO; i, {auth_type}, {auth_authen}, {mail_addr}, {mail_host} at MAIL;
        {rcpt_addr}, {rcpt_host} at RCPT; i at DATA, end of headers and end of message."""
        if stage == "connect":
            peer = self.session.peer if self.session is not None else None
            ip = self.client_ip()
            port = str(peer[1]) if isinstance(peer, tuple) and len(peer) > 1 else ""
            local = self.transport.get_extra_info("sockname") if self.transport is not None else None
            return {"j": self.hostname, "{daemon_name}": self.hostname, "v": "mtaq",
                    "_": f"unknown [{ip}]", "{client_addr}": ip, "{client_name}": "unknown",
                    "{client_port}": port, "{client_ptr}": "unknown",
                    "{daemon_addr}": str(local[0]) if isinstance(local, tuple) else "",
                    "{daemon_port}": str(local[1]) if isinstance(local, tuple) and len(local) > 1 else ""}
        if stage == "helo":
            tls = self.session.ssl if self.session is not None else None
            if not isinstance(tls, dict):
                return {}
            ssl_object, cipher = tls.get("ssl_object"), tls.get("cipher")
            out = {"{tls_version}": str(ssl_object.version()) if ssl_object is not None else ""}
            if isinstance(cipher, tuple) and len(cipher) >= 3:
                out |= {"{cipher}": str(cipher[0]), "{cipher_bits}": str(cipher[2])}
            return out
        qid = envelope.queue_id if envelope is not None else ""
        if stage == "mail":
            authenticated = self.session is not None and self.session.authenticated
            return {"i": qid, "{auth_type}": self._auth_mechanism if authenticated else "",
                    "{auth_authen}": self.login_name() if authenticated else "",
                    "{mail_addr}": address, "{mail_host}": address.rpartition("@")[2] if "@" in address else "",
                    "{mail_mailer}": "smtp"}
        if stage == "rcpt":
            return {"{rcpt_addr}": address, "{rcpt_host}": address.rpartition("@")[2], "{rcpt_mailer}": "smtp"}
        return {"i": qid}

    def _reset_timeout(self, duration: float | None = None) -> None:
        """aiosmtpd's idle timer, moved without a new timer per command: the deadline moves on, and a timer
        that fires before it sets itself again for the rest (aiosmtpd cancels one timer and schedules
        another on every command and every piece of DATA)."""
        deadline = self.loop.time() + (duration or self._timeout_duration)
        self._idle_deadline = deadline
        handle = self._timeout_handle
        if self._idle_armed and handle is not None and not handle.cancelled() and self._idle_when <= deadline:
            return  # fires earlier and sets itself again for the rest
        if handle is not None:
            handle.cancel()
        self._idle_armed = True
        self._idle_when = deadline
        self._timeout_handle = self.loop.call_at(deadline, self._idle_timer)

    def _idle_timer(self) -> None:
        # uvloop rounds a timer to the millisecond and may run it up to 1 ms early: within 1 ms of the deadline
        # it counts as reached (as aiosmtpd's own timer would), so the timer never spins through that last ms.
        if self._idle_deadline - self.loop.time() > _IDLE_SLACK_S:  # the client was heard since it was set
            self._idle_when = self._idle_deadline
            self._timeout_handle = self.loop.call_at(self._idle_deadline, self._idle_timer)
            return
        self._idle_armed = False  # the handle stays: aiosmtpd's connection_lost cancels it
        self._timeout_cb()

    def _timeout_cb(self) -> None:
        """An idle client: ``421 4.4.2`` (RFC 3463: connection dropped, timeout), then aiosmtpd closes."""
        if self.transport is not None and not self._closing and not self.transport.is_closing():
            self._closing = True
            self._writer.write(f"421 4.4.2 {self.hostname} Error: timeout exceeded\r\n".encode("ascii"))
        super()._timeout_cb()  # type: ignore[no-untyped-call]

    def _hang_up(self) -> None:
        """Close after a 421: nothing more is read or answered (pipelined commands are dropped).

        What the client pipelined and is already buffered is thrown away here: a DATA sent behind commands that
        led to the 421 must never reach the queue (the client was told 421 and will send it again: a
        duplicate). :meth:`smtp_DATA` checks ``_closing`` too, before reading and before queueing."""
        self._closing = True
        reader = getattr(self, "_reader", None)
        if isinstance(reader, asyncio.StreamReader):
            buffered = getattr(reader, "_buffer", None)  # asyncio keeps no public way to drop buffered bytes
            if isinstance(buffered, bytearray):
                buffered.clear()
        if self.transport is not None:
            self.transport.close()
        if self._handler_coroutine is not None:
            self._handler_coroutine.cancel()

    async def push(self, status: str | bytes) -> bool:
        """Send one reply line with its enhanced status code, or hold it back while EHLO is assembled.

        Counts 5xx replies; at ``policy.errors_max`` adds ``421 4.7.0 ... too many errors`` and hangs up.
        After any 421 the connection is closed.
        """
        if self._ehlo_lines is not None:
            self._ehlo_lines.append(status)
            return False
        if self._closing:
            return False
        if isinstance(status, bytes):
            raw = status
            try:
                status = raw.decode("ascii")
            except UnicodeDecodeError:
                sent_raw: bool = await super().push(raw)
                return sent_raw
        text, code = _enhanced(status, self._verb)
        sent: bool = await super().push(text)
        if code >= 400 and self._stage is not None:  # a refusal (never on the 250 path: no event there)
            self._log_refusal(text, code)
        if code == 421:
            self._hang_up()
            return sent
        if code >= 500:
            self._errors += 1
        # Also reached after an error counted elsewhere (an exception, an AUTH rate refusal) and its reply.
        if self._errors >= self.policy.errors_max:
            await super().push(f"421 4.7.0 {self.hostname} Error: too many errors")
            self._hang_up()
        return sent

    def _log_refusal(self, text: str, code: int) -> None:
        """The ``smtp_reject`` event of a 4xx/5xx reply ``text`` to MAIL, RCPT or DATA (issue 38.3; Postfix logs
        ``NOQUEUE: reject: RCPT from ...`` for its own): client, stage (mail, rcpt, data), code, enhanced (""
        when the reply has none), reply (the first line, at most 512 characters), sender (MAIL FROM of the
        transaction, or MAIL's argument), recipient (RCPT's address, "" otherwise)."""
        first = text.split("\r\n", 1)[0]
        words = first.split(" ", 2)
        enhanced = words[1] if len(words) > 1 and _ENHANCED_CODE.fullmatch(words[1]) else ""
        arg = self._stage_arg or ""
        stage = self._stage or ""
        envelope = self.envelope
        sender = (envelope.mail_from if envelope is not None else None) or ""
        recipient = ""
        if stage in ("MAIL", "RCPT") and arg:
            path = (self._strip_command_keyword("FROM:" if stage == "MAIL" else "TO:", arg) or "").split(" ", 1)[0]
            path = path.strip("<>")[:256]
            if stage == "MAIL":
                sender = sender or path
            else:
                recipient = path
        get_logger().info("smtp_reject", client=self.client_ip(), stage=stage.lower(), code=code, enhanced=enhanced,
                          reply=first[:512], sender=sender, recipient=recipient)

    async def handle_exception(self, error: Exception) -> str:
        """A failed TLS handshake is the client's business (one log line); any other exception is a bug:
        logged, and the client gets ``451 4.3.0`` (try again later) rather than the exception's text.

        Each such exception counts toward ``errors_max`` (Postfix ``smtpd_hard_error_limit``), so a client
        that can trigger one cannot do it for ever; the first of a session is logged with its traceback,
        the later ones as one line each (``repeat`` counts them), so the log cannot be flooded with them."""
        if hasattr(self.event_handler, "handle_exception"):
            return await super().handle_exception(error)
        if isinstance(error, TLSSetupException):
            get_logger().warning("tls_handshake_failed", client=self.client_ip(), error=str(error.__cause__ or error))
            return "454 4.7.0 TLS not available due to temporary reason"
        if self._closing:
            # After the 421: pipelined commands already buffered still run until the next real wait (the
            # cancellation lands there); they are not answered, counted or logged again.
            return "451 4.3.0 Error: internal error"
        self._errors += 1
        self._exceptions += 1
        text = f"{type(error).__name__}: {error}"
        if self._exceptions == 1:
            get_logger().exception("smtp_session_error", client=self.client_ip(), error=text)
        else:
            get_logger().error("smtp_session_error", client=self.client_ip(), error=text, repeat=self._exceptions)
        return "451 4.3.0 Error: internal error"

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        """aiosmtpd's address parsing (the fast path's), with a parser crash taken as "does not parse"."""
        try:
            return super()._getaddr(arg)
        except Exception:  # the email package's parser raises IndexError, AttributeError on some input
            return None, None

    async def _path_refused(self, arg: str | None, verb: str, keyword: str) -> bool:
        """Answer and return True when the path in ``arg`` is refused before aiosmtpd parses it; False to go
        on as usual. aiosmtpd's HELO and AUTH checks come first, as they would.

        * The address parser crashes on it (``<``: IndexError, ``<a@[``: AttributeError): Postfix's
          ``501 5.1.7 Bad sender address syntax`` / ``501 5.1.3 Bad recipient address syntax`` (RFC 5321
          §4.1.2).
        * It holds a non-ASCII character no address may contain (:func:`unsendable_character`): the parser
          would drop some of them as white space (``<a@exam\u00a0ple.net>`` becomes ``a@example.net``), so
          the line as sent is checked: ``553 5.1.7`` / ``553 5.1.3``. ASCII controls are left to the
          address checks (``553 5.1.3``), surrogate escapes (not UTF-8) too.
        """
        rest = self._strip_command_keyword(keyword, arg) if arg is not None else None
        if not rest:
            return False
        sender = verb == "MAIL"
        reply: str | None = None
        try:
            parse_address(rest, self.local_part_limit or 0)
        except Exception:  # see _getaddr
            reply = "501 5.1.7 Bad sender address syntax" if sender else "501 5.1.3 Bad recipient address syntax"
        else:
            bad = None if rest.isascii() else unsendable_character(
                "".join(ch for ch in rest if ch > "\x7f" and not "\udc80" <= ch <= "\udcff"))
            if bad is not None:
                role, code = ("sender", "5.1.7") if sender else ("recipient", "5.1.3")
                reply = f"553 {code} Error: {role} address contains an invisible or control character ({bad})"
        if reply is None:
            return False
        if not (await self.check_helo_needed() or await self.check_auth_needed(verb)):
            await self.push(reply)
        return True

    async def _call_handler_hook(self, command: str, *args: Any) -> Any:
        """The policy first (MAIL: address checks; RCPT: count, address checks, relay control), then the
        handler's own hook. A reply string refuses the command (aiosmtpd then records nothing)."""
        if command in ("MAIL", "RCPT"):
            envelope = self._dsn_envelope()
            address = str(args[0])
            smtputf8 = bool(envelope.smtp_utf8)
            if command == "MAIL":
                problem = address_problem(address, smtputf8=smtputf8, null_ok=True, sender=True)
                if problem is not None:
                    return problem
                assert self.session is not None
                if self.session.authenticated and self.policy.sender_logins is not None:
                    refusal = self.policy.sender_login_reply(address, self.login_name())
                    if refusal is not None:
                        return refusal
            else:
                if len(envelope.rcpt_tos) >= self.policy.recipients_max:
                    return "452 4.5.3 Error: too many recipients"
                assert self.session is not None
                refusal = self.policy.rcpt_reply(address, client_ip=self.client_ip(),
                                                 authenticated=bool(self.session.authenticated), smtputf8=smtputf8)
                if refusal is not None:
                    if self.milters is not None and envelope.mail_from is not None:
                        await self.milters.rcpt_rejected(address, [str(o) for o in args[1]], dict(
                            self._milter_macros("rcpt", envelope, address), **{"{rcpt_mailer}": "error"}))
                    return refusal
                if self.verifier is not None and self.policy.verification_wanted(
                        address, client_ip=self.client_ip(), authenticated=bool(self.session.authenticated)):
                    status, text = await self.verifier.verify(address)
                    refusal = self.policy.unverified_reply(address, status, text)
                    if refusal is not None:
                        return refusal
            if self.milters is not None:
                if command == "MAIL":
                    envelope.queue_id = new_queue_id()
                    self.milters.context["queue_id"] = envelope.queue_id
                    reply = await self.milters.mail(address, [str(o) for o in args[1]],
                                                    self._milter_macros("mail", envelope, address))
                else:
                    reply = await self.milters.rcpt(address, [str(o) for o in args[1]],
                                                    self._milter_macros("rcpt", envelope, address))
                if reply is not None:
                    return reply
        return await super()._call_handler_hook(command, *args)

    async def _milter_helo(self, hostname: str) -> None:
        """SMFIC_HELO after a HELO/EHLO that was accepted; a refusal is remembered and answers every MAIL
        (MilterSession.refused), as Postfix's smtpd_delay_reject does."""
        if self.milters is not None and hostname and self.session is not None and self.session.host_name == hostname:
            await self.milters.helo(hostname, self._milter_macros("helo"))

    def login_name(self) -> str:
        """The user name this session authenticated as ("" if none)."""
        data = self.session.auth_data if self.session is not None else None
        login = getattr(data, "login", None)
        return login.decode("utf-8", "replace") if isinstance(login, bytes) else str(login or "")

    # ------------------------------------------------------------------------------------------ commands
    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str) -> None:
        """aiosmtpd's HELO (its 250 reply carries no enhanced code, RFC 2034 §3)."""
        self._verb = "HELO"
        try:
            await super().smtp_HELO(hostname)
            await self._milter_helo(hostname)
        finally:
            self._verb = None

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str) -> None:
        """aiosmtpd's EHLO (and the handler's ``handle_EHLO``), with PIPELINING, ENHANCEDSTATUSCODES and
        DSN added to a positive reply, and AUTH left out when there is no password file."""
        if hostname:
            self.command_size_limits.clear()  # aiosmtpd adds to them on each EHLO; start over
        self._ehlo_lines = []
        self._verb = "EHLO"
        try:
            try:
                await super().smtp_EHLO(hostname)
                lines = self._ehlo_lines
            finally:
                self._ehlo_lines = None
            future = future_release_keyword(time.time(), self.policy.delay_max_s)
            reply, extended = _ehlo_reply(tuple(lines), self.policy.passwords is None, future)
            if extended:
                self.command_size_limits["MAIL"] += _MAIL_EXTRA
                self.command_size_limits["RCPT"] += _RCPT_EXTRA
            await self.push(reply)
            await self._milter_helo(hostname)
        finally:
            self._verb = None

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg: str) -> None:
        """aiosmtpd's STARTTLS (RFC 3207), answered ``220 2.0.0``."""
        self._verb = "STARTTLS"
        try:
            await super().smtp_STARTTLS(arg)
        finally:
            self._verb = None

    @syntax("AUTH <mechanism>", when="sasl_enabled")
    async def smtp_AUTH(self, arg: str) -> None:
        """aiosmtpd's AUTH (RFC 4954), only with a password file and never inside a mail transaction."""
        if self.policy.passwords is None:
            await self.push("503 5.5.1 Error: authentication not enabled")
            return
        if self.envelope is not None and self.envelope.mail_from:
            await self.push("503 5.5.1 Error: MAIL transaction in progress")  # RFC 4954 §4
            return
        ip = self.client_ip()
        session = self.session
        if (arg and self.tls_active() and session is not None and session.extended_smtp
                and not session.authenticated and self.gate is not None and await self.gate.ask_auth_blocked(ip)):
            # Postfix's anvil reply to smtpd_client_auth_rate_limit, for failures here; counts as an error.
            get_logger().warning("auth_rate_limited", client=ip, limit=self.policy.auth_failures_per_minute_max)
            self._errors += 1
            await self.push(f"450 4.7.1 Error: too many AUTH failures from {ip}")
            return
        await super().smtp_AUTH(arg)

    async def auth_PLAIN(self, _: SMTP, args: list[str]) -> AuthResult:
        """SASL PLAIN (RFC 4616): ``authzid NUL authcid NUL passwd``; authzid empty or the user's own."""
        blob = await self.challenge_auth("") if len(args) == 1 else await self._initial_response(args[1])
        if not isinstance(blob, bytes):  # MISSING or None: answered already
            return AuthResult(success=False, handled=True)
        parts = blob.split(b"\x00")
        if len(parts) != 3:
            await self.push("501 5.5.2 Error: malformed PLAIN response")
            return AuthResult(success=False, handled=True)
        authzid, user, password = parts
        if authzid and authzid != user:
            await self._auth_failed(user, "PLAIN")
            return AuthResult(success=False, handled=False)  # no authorisation as someone else: 535 5.7.8
        return await self._check_password(user, password, "PLAIN")

    async def auth_LOGIN(self, _: SMTP, args: list[str]) -> AuthResult:
        """SASL LOGIN (draft-murchison-sasl-login): user name, then password, each base64."""
        user = await self.challenge_auth("Username:") if len(args) == 1 else await self._initial_response(args[1])
        if not isinstance(user, bytes):  # MISSING or None: answered already
            return AuthResult(success=False, handled=True)
        password = await self.challenge_auth("Password:")
        if not isinstance(password, bytes):
            return AuthResult(success=False, handled=True)
        return await self._check_password(user, password, "LOGIN")

    async def _initial_response(self, text: str) -> bytes | None:
        """Decode an RFC 4954 §4 initial response (``=`` is empty); None after answering ``501``."""
        if text == "=":
            return b""
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            await self.push("501 5.5.2 Error: cannot decode base64")
            return None

    async def challenge_auth(self, challenge: str | bytes, encode_to_b64: bool = True,
                             log_client_response: bool = False) -> Any:
        """aiosmtpd's: send ``334 challenge`` and return the client's base64-decoded answer, or MISSING after
        answering ``501`` (``*`` cancels, bad base64). A response line longer than the line limit gets
        Postfix's ``500 5.5.6 SASL response limit exceeded`` (RFC 4954 §6: 5.5.6, authentication exchange
        line too long) and ends the AUTH; the rest of the line is read and dropped. aiosmtpd let the reader's
        ValueError out: ``451 4.3.0`` and a traceback. The response is never logged."""
        raw = challenge.encode() if isinstance(challenge, str) else challenge
        await self.push(b"334 " + (base64.b64encode(raw) if encode_to_b64 else raw))
        try:
            line = await self._reader.readuntil()
        except asyncio.IncompleteReadError as exc:  # the client went away: what came is the answer
            line = exc.partial
        except asyncio.LimitOverrunError as exc:
            await self._reader.read(exc.consumed)
            while True:  # aiosmtpd's own way through an over-long command line
                try:
                    await self._reader.readuntil()
                    break
                except asyncio.LimitOverrunError as more:
                    await self._reader.read(more.consumed)
            await self.push("500 5.5.6 SASL response limit exceeded")
            return MISSING
        blob = line.strip()
        if blob == b"*":
            await self.push("501 5.7.0 Auth aborted")
            return MISSING
        try:
            return base64.b64decode(blob, validate=True)
        except binascii.Error:
            await self.push("501 5.5.2 Can't decode base64")
            return MISSING

    async def _check_password(self, user: bytes, password: bytes, mechanism: str) -> AuthResult:
        """Check against the password file in a thread (bcrypt is slow on purpose). Failure: 535 5.7.8,
        after :meth:`_auth_failed`."""
        passwords = self.policy.passwords
        assert passwords is not None
        name = user.decode("utf-8", "replace")
        ip = self.client_ip()
        if self.gate is not None and not await self.gate.ask_auth_begin(ip):
            # Over the limit counting the checks still running on the client's other connections (found by
            # review: parallel connections each got a guess checked). Postfix's anvil reply; an error.
            get_logger().warning("auth_rate_limited", client=ip, limit=self.policy.auth_failures_per_minute_max)
            self._errors += 1
            await self.push(f"450 4.7.1 Error: too many AUTH failures from {ip}")
            return AuthResult(success=False, handled=True)
        try:
            ok = await asyncio.to_thread(passwords.verify, name, password)
            if not ok and self.gate is not None:
                self.gate.auth_failed(ip)  # counted before the reservation ends: never a gap to slip through
        finally:
            if self.gate is not None:
                self.gate.auth_end(ip)
        if ok:
            self._auth_mechanism = mechanism
            return AuthResult(success=True, auth_data=LoginPassword(user, b""))
        await self._auth_failed(user, mechanism, counted=True)
        return AuthResult(success=False, handled=False)

    async def _auth_failed(self, user: bytes, mechanism: str, *, counted: bool = False) -> None:
        """A failed AUTH: log ``auth_failed`` (client IP, the user name escaped and cut at 256 characters,
        the mechanism), count it in the gate, and wait ``error_sleep_s`` seconds before the reply (Postfix
        ``smtpd_error_sleep_time``: a brute-force client gets one guess per that time per connection)."""
        ip = self.client_ip()
        get_logger().warning("auth_failed", client=ip, user=escape_text(user.decode("utf-8", "replace")[:256]),
                             mechanism=mechanism)
        if self.gate is not None and not counted:
            self.gate.auth_failed(ip)
        if self.policy.error_sleep_s > 0:
            await asyncio.sleep(self.policy.error_sleep_s)

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        """aiosmtpd's MAIL, with RET and ENVID taken out, checked and kept on the envelope."""
        self._verb = self._stage = "MAIL"
        self._stage_arg = arg
        try:
            await self._mail(arg)
        finally:
            self._verb = self._stage = self._stage_arg = None

    async def _mail(self, arg: str | None) -> None:
        if await self._path_refused(arg, "MAIL", "FROM:"):
            return
        split = self._take_params(arg, "FROM:", _MAIL_KEYWORDS)
        if split is None:
            await super().smtp_MAIL(arg)
            return
        stripped, tokens = split
        if await self.check_helo_needed() or await self.check_auth_needed("MAIL"):
            return
        assert self.session is not None
        envelope = self._dsn_envelope()
        if not self.session.extended_smtp or envelope.mail_from:
            await super().smtp_MAIL(arg)  # aiosmtpd's 501 (parameters after HELO) or 503 (nested MAIL)
            return
        try:
            ret, envid = parse_mail_dsn(tokens)
            release = parse_future_release(tokens, time.time(), self.policy.delay_max_s)
        except DsnSyntaxError as exc:
            await self.push(exc.reply)
            return
        envelope.dsn_ret, envelope.dsn_envid = ret, envid  # visible to the handler's handle_MAIL
        envelope.release_ts = release
        await super().smtp_MAIL(stripped)
        if not envelope.mail_from:  # refused (SIZE, BODY, unknown parameter, handle_MAIL): not kept
            envelope.dsn_ret = envelope.dsn_envid = None
            envelope.release_ts = None

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        """aiosmtpd's RCPT, with NOTIFY and ORCPT taken out, checked and kept per accepted recipient."""
        self._verb = self._stage = "RCPT"
        self._stage_arg = arg
        try:
            await self._rcpt(arg)
        finally:
            self._verb = self._stage = self._stage_arg = None

    async def _rcpt(self, arg: str | None) -> None:
        if await self._path_refused(arg, "RCPT", "TO:"):
            return
        split = self._take_params(arg, "TO:", _RCPT_KEYWORDS)
        if split is None:
            await self._rcpt_aligned(arg, ())
            return
        stripped, tokens = split
        if await self.check_helo_needed() or await self.check_auth_needed("RCPT"):
            return
        assert self.session is not None
        if not self.session.extended_smtp or not self._dsn_envelope().mail_from:
            await self._rcpt_aligned(arg, ())  # aiosmtpd's 501 (parameters after HELO) or 503 (no MAIL)
            return
        try:
            params = parse_rcpt_dsn(tokens)
        except DsnSyntaxError as exc:
            await self.push(exc.reply)
            return
        await self._rcpt_aligned(stripped, params)

    async def _rcpt_aligned(self, arg: str | None, params: DsnParams) -> None:
        """aiosmtpd's RCPT; then ``params`` for each recipient it (or ``handle_RCPT``) added."""
        envelope = self._dsn_envelope()
        await super().smtp_RCPT(arg)
        while len(envelope.rcpt_dsn) < len(envelope.rcpt_tos):
            envelope.rcpt_dsn.append(params)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        """Read the message (see the module docstring for what is refused), then the handler's
        ``handle_DATA`` decides the reply. RFC 5321 §4.1.1.4, §4.5.2 (dot transparency)."""
        self._stage = "DATA"
        try:
            await self._data(arg)
        finally:
            self._stage = None

    async def _data(self, arg: str) -> None:
        if self._closing:  # a 421 went out: a pipelined DATA is never read, let alone queued
            raise asyncio.CancelledError
        if await self.check_helo_needed() or await self.check_auth_needed("DATA"):
            return
        envelope = self._dsn_envelope()
        if not envelope.rcpt_tos:
            await self.push("503 Error: need RCPT command")
            return
        if arg:
            await self.push("501 Syntax: DATA")
            return
        if self.milters is not None:
            refused = await self.milters.data(self._milter_macros("data", envelope))
            if refused is not None:
                await self.push(refused)
                return
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        content, refusal, hang_up = await self._read_data()
        if refusal is not None:
            self._set_post_data_state()  # type: ignore[no-untyped-call]
            await self.push(refusal)
            if hang_up:
                self._hang_up()
            return
        if self._closing:  # the 421 came while the message was read (a timeout): not queued
            if isinstance(content, BodyBuffer):
                content.close()
            raise asyncio.CancelledError
        envelope.content = envelope.original_content = content  # type: ignore[assignment]
        self._reset_timeout()  # the handler's wait for the fsync is not the client's idleness
        try:
            status = await self._call_handler_hook("DATA") if "DATA" in self._handle_hooks else MISSING
        finally:
            if isinstance(content, BodyBuffer):
                content.close()
        self._set_post_data_state()  # type: ignore[no-untyped-call]
        self._verb = "DATA"
        try:
            await self.push("250 OK" if status is MISSING else status)
        finally:
            self._verb = None

    async def _read_data(self) -> tuple[bytes | BodyBuffer, str | None, bool]:
        """``(content, None, False)``, or ``(b"", reply, hang_up)`` for a refused message; reads up to
        ``CRLF . CRLF`` (:func:`mtaq.edge.data.read_data_text`, in big chunks). ``content`` is bytes, or the
        :class:`BodyBuffer` of a message that outgrew the buffer's memory (the caller closes it).

        Lines are split on CRLF only; a leading dot is removed from each (RFC 5321 §4.5.2). A bare CR or LF
        is refused or, under ``normalize``, replaced by CRLF after that (so no dot is removed after one).
        Once a message is refused its text is no longer kept. The idle timeout restarts whenever octets
        arrive (:meth:`data_received`).
        """
        kept: list[bytes] = []
        buf = self._body_buffer() if self._body_buffer is not None else None
        scanner = DataScanner(
            buf if buf is not None else kept,
            size_limit=self.data_size_limit or 0,
            normalize=self.policy.bare_newline == "normalize",
            strip_nul=self.policy.forbid_nul == "strip",
            line_limit=self._reader._limit,  # type: ignore[attr-defined]  # aiosmtpd's line_length_limit
        )
        self._in_data = True
        try:
            await read_data_text(self._reader, scanner, lambda: self.transport is not None)
        except BaseException:
            if buf is not None:
                buf.close()
            raise
        finally:
            self._in_data = False
        result = self._data_result(scanner, kept, buf)
        if buf is not None and result[0] is not buf:
            buf.close()  # refused, or small enough to be handed on as bytes
        return result

    def _data_result(
        self, scanner: DataScanner, kept: list[bytes], buf: BodyBuffer | None
    ) -> tuple[bytes | BodyBuffer, str | None, bool]:
        refused = refusal(scanner, self.hostname)
        if refused is not None:
            return b"", refused[0], refused[1]
        if buf is not None:
            if buf.spilled or buf.failure is not None:
                # A failed temporary file (ENOSPC, EIO, EMFILE) dropped what it held: the buffer goes on, so
                # that the queue answers 452/451 for it (StorageFull/StorageError), never 250 for the part
                # still in memory.
                return buf, None, False
            return buf.getvalue(), None, False
        return b"".join(kept), None, False

    def data_received(self, data: bytes) -> None:
        """asyncio's, and while a message is read, each arrival restarts the idle timeout (a client sending
        a large message slowly is not idle)."""
        if self._in_data:
            self._reset_timeout()
        super().data_received(data)

    def _take_params(self, arg: str | None, keyword: str, ours: Collection[str]) -> tuple[str, list[str]] | None:
        """``(arg without our parameters, our parameter tokens)``; ``None`` if there are none of ours.

        Also ``None`` when aiosmtpd cannot parse the address: it then answers as it always did.
        """
        if arg is None:
            return None
        rest = self._strip_command_keyword(keyword, arg)
        if rest is None:
            return None
        address, params = self._getaddr(rest)
        if not address or params is None or not rest.endswith(params):
            return None
        tokens = params.split()
        mine = [t.partition("=")[0].upper() in ours for t in tokens]
        if not any(mine):
            return None
        head = rest[: len(rest) - len(params)].rstrip()
        kept = [t for t, m in zip(tokens, mine, strict=True) if not m]
        taken = [t for t, m in zip(tokens, mine, strict=True) if m]
        return " ".join([keyword + head, *kept]), taken


def _ehlo_keyword(line: str | bytes) -> str:
    """The extension keyword of an EHLO reply line (``"250-AUTH PLAIN"`` -> ``"AUTH"``)."""
    text = line.decode("ascii", "replace") if isinstance(line, bytes) else line
    words = text[4:].split()
    return words[0].upper() if words else ""


def _with_extensions(lines: list[str | bytes], extensions: Iterable[str]) -> list[str] | None:
    """The EHLO reply ``lines`` with ``extensions`` added before the last line (those not listed yet), or
    ``None`` to leave it as it is.

    Only a well-formed positive reply (``250-`` lines, then one ``250 `` line) is changed.
    """
    texts: list[str] = []
    for line in lines:
        if isinstance(line, bytes):
            try:
                line = line.decode("ascii")
            except UnicodeDecodeError:
                return None
        texts.append(line)
    if not texts:
        return None
    if not all(t.startswith("250-") for t in texts[:-1]) or not texts[-1].startswith("250 "):
        return None
    words = [t[4:] for t in texts]
    have = {w.upper().split()[0] for w in words[1:] if w.split()}
    at = max(1, len(words) - 1)
    for ext in extensions:
        if ext not in have:
            words.insert(at, ext)
            at += 1
    return [f"250-{w}" for w in words[:-1]] + [f"250 {words[-1]}"]
