"""The MTA side of the Sendmail milter protocol (version 6, option negotiation), as Postfix speaks it.

Content filters (rspamd, OpenDKIM, OpenDMARC, ClamAV's clamav-milter, SpamAssassin's spamass-milter) speak
this protocol; Postfix's MILTER_README and ``milter_*`` parameters are the model, libmilter's ``mfdef.h``
the wire constants. No maintained, permissively licensed MTA-side implementation exists on PyPI
(``miltertest`` is GPLv3 and blocking; ``kilter.protocol`` and ``purepythonmilter`` are the filter side),
so the protocol is kept small here:

* a sans-I/O part: :func:`packet` frames one command (``uint32`` length, command octet, data),
  :class:`Decoder` splits a byte stream into ``(command, data)`` packets (three outcomes: a packet, None for
  "need more", :class:`MilterProtocolError`), the ``*_packet`` builders and :func:`edit_head`, which applies
  header modifications to a header section;
* :class:`Filter`, one asyncio connection to one filter, every wait bounded by a timeout
  (``milter_connect_timeout_s`` for the connect and the negotiation, ``milter_command_timeout_s`` for each
  SMTP-stage command, ``milter_content_timeout_s`` for the message content and the end-of-message reply),
  over a bare asyncio protocol (one future and one timer per wait); packets that get no reply
  (``SMFIP_NR_HDR``/``NR_BODY`` content, the SMFIC_ABORT before a MAIL) go out in one write with the next;
* :class:`MilterSession`, the filters of one SMTP session, asked in order at each stage as Postfix does
  (``smtpd_milters``): connect, HELO, MAIL, RCPT, DATA, then each header, end of headers, the body in chunks
  of at most 65,535 octets (``MILTER_CHUNK_SIZE``) and end of message, whose modifications are returned as
  :class:`MessageOutcome` to be applied before the message is appended to the log.

What must always hold: no wait on a filter is longer than its timeout; a filter that fails (cannot be
reached, times out, breaks the protocol, closes the connection) is dropped for the rest of the SMTP session
and ``milter_default_action`` decides (``tempfail``: ``451 4.3.5`` for the rest of the session, ``reject``:
``550 5.5.0``, ``accept``: as if that filter were not configured), with a ``milter_error`` event naming it.
"""

from __future__ import annotations

import asyncio
import re
import struct
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Literal, cast

from mtaq.config import Config, parse_milter_address
from mtaq.logs import get_logger

__all__ = [
    "BODY_CHUNK_BYTES",
    "PROTOCOL_VERSION",
    "STATS",
    "Decoder",
    "Edit",
    "Filter",
    "FilterStats",
    "MessageOutcome",
    "MilterDiscarded",
    "MilterProtocolError",
    "MilterRefused",
    "MilterSession",
    "MilterSettings",
    "edit_head",
    "filter_local",
    "packet",
    "parse_address",
]

PROTOCOL_VERSION = 6
BODY_CHUNK_BYTES = 65535  # libmilter MILTER_CHUNK_SIZE: the largest SMFIC_BODY a filter accepts
PACKET_BYTES_MAX = 16 << 20  # a filter's packet beyond this is a protocol error (libmilter: 1 MiB + change)

# MTA -> filter commands (mfdef.h SMFIC_*)
SMFIC_ABORT, SMFIC_BODY, SMFIC_CONNECT, SMFIC_MACRO, SMFIC_BODYEOB = b"A", b"B", b"C", b"D", b"E"
SMFIC_HELO, SMFIC_QUIT_NC, SMFIC_HEADER, SMFIC_MAIL, SMFIC_EOH = b"H", b"K", b"L", b"M", b"N"
SMFIC_OPTNEG, SMFIC_QUIT, SMFIC_RCPT, SMFIC_DATA, SMFIC_UNKNOWN = b"O", b"Q", b"R", b"T", b"U"
# filter -> MTA replies and modifications (SMFIR_*)
SMFIR_ADDRCPT, SMFIR_DELRCPT, SMFIR_ADDRCPT_PAR, SMFIR_SHUTDOWN = b"+", b"-", b"2", b"4"
SMFIR_ACCEPT, SMFIR_REPLBODY, SMFIR_CONTINUE, SMFIR_DISCARD, SMFIR_CHGFROM = b"a", b"b", b"c", b"d", b"e"
SMFIR_CONN_FAIL, SMFIR_ADDHEADER, SMFIR_INSHEADER, SMFIR_SETSYMLIST, SMFIR_CHGHEADER = b"f", b"h", b"i", b"l", b"m"
SMFIR_PROGRESS, SMFIR_QUARANTINE, SMFIR_REJECT, SMFIR_SKIP, SMFIR_TEMPFAIL, SMFIR_REPLYCODE = (
    b"p", b"q", b"r", b"s", b"t", b"y")

# SMFIF_* actions the MTA offers: add/change headers, change body, add/delete recipients, quarantine,
# change sender, add recipient with parameters, macro lists.
SMFIF_ADDHDRS, SMFIF_CHGBODY, SMFIF_ADDRCPT, SMFIF_DELRCPT = 0x01, 0x02, 0x04, 0x08
SMFIF_CHGHDRS, SMFIF_QUARANTINE, SMFIF_CHGFROM, SMFIF_ADDRCPT_PAR, SMFIF_SETSYMLIST = 0x10, 0x20, 0x40, 0x80, 0x100
ACTIONS_OFFERED = 0x1FF
# SMFIP_* protocol steps the filter may leave out (NO*) or not answer (NR_*)
SMFIP_NOCONNECT, SMFIP_NOHELO, SMFIP_NOMAIL, SMFIP_NORCPT = 0x01, 0x02, 0x04, 0x08
SMFIP_NOBODY, SMFIP_NOHDRS, SMFIP_NOEOH, SMFIP_NR_HDR, SMFIP_NOUNKNOWN, SMFIP_NODATA = 0x10, 0x20, 0x40, 0x80, 0x100, 0x200
SMFIP_SKIP, SMFIP_RCPT_REJ = 0x400, 0x800
SMFIP_NR_CONN, SMFIP_NR_HELO, SMFIP_NR_MAIL, SMFIP_NR_RCPT = 0x1000, 0x2000, 0x4000, 0x8000
SMFIP_NR_DATA, SMFIP_NR_UNKN, SMFIP_NR_EOH, SMFIP_NR_BODY, SMFIP_HDR_LEADSPC = 0x10000, 0x20000, 0x40000, 0x80000, 0x100000
# Offered: every step may be left out or go unanswered, SKIP, leading spaces, and RCPT_REJ (a filter that
# asks for it also hears of the recipients mtaq's own policy refused, with {rcpt_mailer} "error").
# recipients are not sent to filters, as Postfix does by default).
PROTOCOL_OFFERED = 0x1FFFFF

_NO = {SMFIC_CONNECT: SMFIP_NOCONNECT, SMFIC_HELO: SMFIP_NOHELO, SMFIC_MAIL: SMFIP_NOMAIL,
       SMFIC_RCPT: SMFIP_NORCPT, SMFIC_DATA: SMFIP_NODATA, SMFIC_HEADER: SMFIP_NOHDRS, SMFIC_EOH: SMFIP_NOEOH,
       SMFIC_BODY: SMFIP_NOBODY}
_NR = {SMFIC_CONNECT: SMFIP_NR_CONN, SMFIC_HELO: SMFIP_NR_HELO, SMFIC_MAIL: SMFIP_NR_MAIL,
       SMFIC_RCPT: SMFIP_NR_RCPT, SMFIC_DATA: SMFIP_NR_DATA, SMFIC_HEADER: SMFIP_NR_HDR, SMFIC_EOH: SMFIP_NR_EOH,
       SMFIC_BODY: SMFIP_NR_BODY}
_STAGES = {0: SMFIC_CONNECT, 1: SMFIC_HELO, 2: SMFIC_MAIL, 3: SMFIC_RCPT, 4: SMFIC_DATA, 5: SMFIC_BODYEOB,
           6: SMFIC_EOH}  # SMFIM_* macro stages
_EDITS = {SMFIR_ADDHEADER: SMFIF_ADDHDRS, SMFIR_INSHEADER: SMFIF_ADDHDRS, SMFIR_CHGHEADER: SMFIF_CHGHDRS,
          SMFIR_REPLBODY: SMFIF_CHGBODY, SMFIR_ADDRCPT: SMFIF_ADDRCPT, SMFIR_ADDRCPT_PAR: SMFIF_ADDRCPT_PAR,
          SMFIR_DELRCPT: SMFIF_DELRCPT, SMFIR_CHGFROM: SMFIF_CHGFROM, SMFIR_QUARANTINE: SMFIF_QUARANTINE}

# Postfix's replies (milter8.c, smtpd.c) for a filter's reject / tempfail without text, and for
# milter_default_action when a filter fails.
REJECT_REPLY = "550 5.7.1 Command rejected"
TEMPFAIL_REPLY = "451 4.7.1 Service unavailable - try again later"
DEFAULT_TEMPFAIL_REPLY = "451 4.3.5 Server configuration problem - try again later"
DEFAULT_REJECT_REPLY = "550 5.5.0 Service unavailable"

DefaultAction = Literal["tempfail", "accept", "reject"]


class MilterProtocolError(Exception):
    """A filter broke the protocol (a bad packet, a reply not allowed at that stage)."""


class MilterRefused(Exception):
    """The filters refused a message that did not come over SMTP (``reply``: the 4xx or 5xx reply)."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.reply = reply


class MilterDiscarded(Exception):
    """A filter discarded a message that did not come over SMTP (``milter``: which one)."""

    def __init__(self, milter: str) -> None:
        super().__init__(milter)
        self.milter = milter


@dataclass(frozen=True)
class MilterSettings:
    """The milter configuration (Postfix's names): ``smtpd_milters`` (filters for SMTP mail, each
    ``inet:host:port`` or ``unix:/path``), ``non_smtpd_milters`` (for mail picked up from the maildrop),
    ``default_action`` (``milter_default_action``), the three timeouts in seconds, ``protocol`` (6)."""

    smtpd_milters: tuple[str, ...] = ()
    non_smtpd_milters: tuple[str, ...] = ()
    default_action: DefaultAction = "tempfail"
    connect_timeout_s: float = 30.0
    command_timeout_s: float = 30.0
    content_timeout_s: float = 300.0
    protocol: int = PROTOCOL_VERSION

    @classmethod
    def from_config(cls, cfg: Config) -> MilterSettings:
        return cls(tuple(cfg.smtpd_milters), tuple(cfg.non_smtpd_milters), cfg.milter_default_action,
                   cfg.milter_connect_timeout_s, cfg.milter_command_timeout_s, cfg.milter_content_timeout_s,
                   cfg.milter_protocol)


def parse_address(spec: str) -> tuple[str, str, int]:
    """:func:`mtaq.config.parse_milter_address` (``inet:host:port`` / ``unix:/path``)."""
    return parse_milter_address(spec)


# ------------------------------------------------------------------------------------------ codec (sans I/O)
def packet(command: bytes, data: bytes = b"") -> bytes:
    """One milter packet: ``uint32`` length (command octet + data, network order), the command, the data."""
    return struct.pack("!I", len(data) + 1) + command + data


def _cstrings(*items: bytes) -> bytes:
    """Each item NUL-ended (a NUL inside an item removed)."""
    return b"\0".join([item.replace(b"\0", b"") for item in items]) + b"\0" if items else b""


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def optneg_packet(version: int = PROTOCOL_VERSION, actions: int = ACTIONS_OFFERED,
                  protocol: int = PROTOCOL_OFFERED) -> bytes:
    return packet(SMFIC_OPTNEG, struct.pack("!III", version, actions, protocol))


def macro_packet(command: bytes, macros: dict[str, str]) -> bytes:
    """SMFIC_MACRO for the command ``command``: the macro names as Postfix sends them (one-letter names
    bare, longer ones in braces)."""
    body = _cstrings(*[_b(part) for name, value in macros.items()
                       for part in (name if len(name) == 1 or name.startswith("{") else "{" + name + "}", value)])
    return packet(SMFIC_MACRO, command + body)


def connect_packet(hostname: str, address: str, port: int) -> bytes:
    """SMFIC_CONNECT: the client's name, family (``4``, ``6``, ``U`` for unknown), port, address."""
    if not address:
        return packet(SMFIC_CONNECT, _cstrings(_b(hostname)) + b"U")
    family = b"6" if ":" in address else b"4"
    return packet(SMFIC_CONNECT, _cstrings(_b(hostname)) + family + struct.pack("!H", port) + _cstrings(_b(address)))


class Decoder:
    """Splits what a filter sends into packets. :meth:`feed` the bytes read; :meth:`next` gives
    ``(command, data)``, None when more bytes are needed, or raises :class:`MilterProtocolError` (a length
    of 0 or above :data:`PACKET_BYTES_MAX`)."""

    def __init__(self, max_bytes: int = PACKET_BYTES_MAX) -> None:
        self.buf = bytearray()
        self.max_bytes = max_bytes

    def feed(self, data: bytes) -> None:
        self.buf += data

    def next(self) -> tuple[bytes, bytes] | None:
        if len(self.buf) < 4:
            return None
        (length,) = struct.unpack_from("!I", self.buf)
        if length == 0 or length > self.max_bytes:
            raise MilterProtocolError(f"packet length {length}")
        if len(self.buf) < 4 + length:
            return None
        command, data = bytes(self.buf[4:5]), bytes(self.buf[5:4 + length])
        del self.buf[:4 + length]
        return command, data


@dataclass(frozen=True)
class Edit:
    """One end-of-message modification from a filter: ``kind`` (its SMFIR_* octet), and by kind: header
    ``name``/``value`` and ``index`` (insheader: position, 0 = top; chgheader: occurrence, 1 = first),
    ``data`` (replbody chunk), ``address``/``args`` (recipient, sender). ``leadspc``: the filter asked for
    header values with their leading space (SMFIP_HDR_LEADSPC)."""

    kind: bytes
    name: bytes = b""
    value: bytes = b""
    index: int = 0
    data: bytes = b""
    address: str = ""
    args: str = ""
    leadspc: bool = False


def _split0(data: bytes, n: int) -> list[bytes]:
    """The first ``n`` NUL-ended strings of ``data`` (the last may lack its NUL); MilterProtocolError if fewer."""
    parts = data.split(b"\0")
    if len(parts) < n:
        raise MilterProtocolError("a string is missing")
    return parts[:n]


def parse_edit(command: bytes, data: bytes, leadspc: bool) -> Edit:
    """A modification packet -> :class:`Edit`. Raises MilterProtocolError for a malformed one."""
    try:
        if command == SMFIR_ADDHEADER:
            name, value = _split0(data, 2)
            return Edit(command, name=name, value=value, leadspc=leadspc)
        if command in (SMFIR_INSHEADER, SMFIR_CHGHEADER):
            (index,) = struct.unpack_from("!I", data)
            name, value = _split0(data[4:], 2)
            return Edit(command, name=name, value=value, index=index, leadspc=leadspc)
        if command == SMFIR_REPLBODY:
            return Edit(command, data=data)
        if command in (SMFIR_ADDRCPT, SMFIR_DELRCPT, SMFIR_QUARANTINE):
            return Edit(command, address=data.split(b"\0")[0].decode("utf-8", "surrogateescape"))
        if command in (SMFIR_ADDRCPT_PAR, SMFIR_CHGFROM):
            parts = data.split(b"\0")
            return Edit(command, address=parts[0].decode("utf-8", "surrogateescape"),
                        args=(parts[1] if len(parts) > 1 else b"").decode("utf-8", "surrogateescape"))
    except (struct.error, ValueError) as exc:
        raise MilterProtocolError(f"malformed {command!r}: {exc}") from None
    raise MilterProtocolError(f"not a modification: {command!r}")


def _crlf(value: bytes) -> bytes:
    """A header value from a filter with every line end CRLF, each continuation line starting with a
    space or tab (a filter's bare LF folding, as libmilter filters write it); NUL removed."""
    lines = re.split(rb"\r?\n", value.replace(b"\0", b""))
    return b"\r\n".join([lines[0]] + [ln if ln[:1] in (b" ", b"\t") else b"\t" + ln for ln in lines[1:]])


def split_headers(head: bytes) -> list[tuple[bytes, bytes]]:
    """A header section (CRLF line ends, without the empty line) as ``(name, raw value)`` pairs, the raw
    value being everything after the colon without the last CRLF (folding kept). A line that is not a
    header (no colon) is kept as ``(b"", line)``."""
    out: list[tuple[bytes, bytes]] = []
    for line in head.split(b"\r\n")[:-1] if head.endswith(b"\r\n") else head.split(b"\r\n"):
        if line[:1] in (b" ", b"\t") and out:
            out[-1] = (out[-1][0], out[-1][1] + b"\r\n" + line)
            continue
        name, colon, value = line.partition(b":")
        out.append((name, value) if colon and name.strip() else (b"", line))
    return out


def _join(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join((name + b":" + value if name else value) + b"\r\n" for name, value in headers)


def edit_head(head: bytes, edits: Iterable[Edit]) -> bytes | None:
    """Apply the header modifications among ``edits`` to ``head`` (as :func:`split_headers`), in order, as
    Sendmail's smfi_addheader / smfi_insheader / smfi_chgheader define them: add appends; insert puts the
    header at position ``index`` (0 = top; past the end appends); change replaces the ``index``-th (from 1)
    header of that name (any case), deletes it when the value is empty, and appends it when there is no
    such occurrence. Returns the new header section, or None when no header modification is among ``edits``."""
    headers = split_headers(head)
    changed = False
    for e in edits:
        if e.kind not in (SMFIR_ADDHEADER, SMFIR_INSHEADER, SMFIR_CHGHEADER):
            continue
        changed = True
        name = e.name.strip()
        value = _crlf(e.value)
        raw = value if e.leadspc else b" " + value
        if e.kind == SMFIR_ADDHEADER:
            headers.append((name, raw))
        elif e.kind == SMFIR_INSHEADER:
            real = [i for i, (n, _) in enumerate(headers) if n]
            at = real[e.index] if e.index < len(real) else len(headers)
            headers.insert(at, (name, raw))
        else:
            seen = 0
            for i, (n, _) in enumerate(headers):
                if n.strip().lower() == name.lower():
                    seen += 1
                    if seen == max(e.index, 1):
                        if value.strip():
                            headers[i] = (n, raw)
                        else:
                            del headers[i]
                        break
            else:
                if value.strip():
                    headers.append((name, raw))
    return _join(headers) if changed else None


def _reply_text(data: bytes) -> str:
    """SMFIR_REPLYCODE's text: lines joined by CRLF, ``%%`` read as ``%`` (smfi_setreply's escaping, as
    Postfix's milter8 reads it)."""
    text = data.split(b"\0")[0].decode("utf-8", "replace").replace("%%", "%")
    return "\r\n".join(line.strip() for line in text.replace("\r\n", "\n").split("\n") if line.strip())


# ------------------------------------------------------------------------------------------------- I/O
@dataclass
class FilterStats:
    """Per-filter counters for /metrics: replies by verdict, failures, and the seconds spent waiting."""

    verdicts: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    seconds: float = 0.0
    waits: int = 0


STATS: dict[str, FilterStats] = {}
"""Counters by filter name (its address as configured), for this process (read by /metrics)."""
STATS_MAX = 64


def _stats(name: str) -> FilterStats:
    s = STATS.get(name)
    if s is None:
        if len(STATS) >= STATS_MAX:
            name = "other"
            s = STATS.get(name)
        if s is None:
            s = STATS[name] = FilterStats()
    return s


@dataclass
class Reply:
    """A filter's final answer to one command: ``verdict`` (continue, accept, reject, tempfail, discard,
    skip), ``text`` (the SMTP reply for reject and tempfail), and for end of message its ``edits``."""

    verdict: str
    text: str = ""
    edits: list[Edit] = field(default_factory=list)


_QUIT, _ABORT = packet(SMFIC_QUIT), packet(SMFIC_ABORT)


class FilterFailed(Exception):
    """A filter could not be used (unreachable, timeout, protocol error, connection closed)."""


FLUSH_BYTES = 65536  # packets that get no reply are held back (coalesced) up to this many octets


class _Connection(asyncio.Protocol):
    """A filter's socket as a bare asyncio protocol (no StreamReader, no task per read): what arrives is fed
    to the :class:`Decoder` and wakes the one waiter; ``lost`` says why nothing more will come (an end of
    stream keeps the socket open for writing, as a StreamReader did); pause/resume for the write buffer."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[bool] | None = None  # True: data or end of stream; False: timed out
        self.drained: asyncio.Future[bool] | None = None
        self.paused = False
        self.closed = False  # the transport is gone (connection_lost)
        self.lost: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport is no asyncio.Transport subclass

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(True)

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        self._wake()

    def eof_received(self) -> bool:
        self.lost = self.lost or "connection closed by the filter"
        self._wake()
        return True  # half-open: what is being written still goes (then the read says why it failed)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.lost is None:
            self.lost = f"read: {type(exc).__name__}: {exc}" if exc is not None else "connection closed by the filter"
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        d = self.drained
        if d is not None and not d.done():
            d.set_result(True)


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


async def _within(fut: asyncio.Future[bool], when: float) -> bool:
    """``fut``'s result (True: the wake-up came), or False once the loop's clock reaches ``when`` (seconds,
    ``loop.time()``): one timer, no task (``asyncio.wait_for`` makes a task per wait in Python 3.11)."""
    timer = asyncio.get_running_loop().call_at(when, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


class Filter:
    """One connection to one filter (``spec``, e.g. ``inet:127.0.0.1:11332``). :meth:`open` connects and
    negotiates; :meth:`ask` sends packets and reads the final reply. Each raises :class:`FilterFailed` on
    any failure (the caller applies ``milter_default_action``), the connection then closed.

    Packets that get no reply (``SMFIP_NR_*``, SMFIC_ABORT) may be held back with ``send(..., more=True)``
    and go out with the next write (at most :data:`FLUSH_BYTES` held): one write for a run of them."""

    def __init__(self, spec: str, settings: MilterSettings) -> None:
        self.name = spec
        self.settings = settings
        self.conn: _Connection | None = None
        self.decoder = Decoder()
        self.actions = 0
        self.protocol = 0
        self.skip_session = False  # accepted at connect or HELO: not asked again in this SMTP session
        self.skip_message = False  # accepted or rejected during this message: not asked again for it
        self.skip_body = False  # answered SMFIR_SKIP to a body chunk
        self.in_message = False  # MAIL sent, end of message not yet: SMFIC_ABORT before the next MAIL
        self.symbols: dict[bytes, set[str]] = {}  # the macros the filter asked for, by command
        self.no: frozenset[bytes] = frozenset()  # the commands negotiated away (SMFIP_NO*)
        self.nr: frozenset[bytes] = frozenset()  # the commands sent without a reply (SMFIP_NR_*)
        self.held: list[bytes] = []  # packets held back (send(more=True)), not yet written
        self.held_bytes = 0
        self.stats = _stats(spec)

    async def open(self) -> None:
        """Connect (``connect_timeout_s``) and negotiate version 6 (``command_timeout_s``)."""
        kind, where, port = parse_address(self.name)
        loop = asyncio.get_running_loop()
        try:
            if kind == "unix":
                conn = loop.create_unix_connection(lambda: _Connection(self.decoder), where)
            else:
                conn = loop.create_connection(lambda: _Connection(self.decoder), where, port)
            async with asyncio.timeout(self.settings.connect_timeout_s):  # no task, as wait_for makes in 3.11
                _, self.conn = await conn
        except (TimeoutError, OSError) as exc:
            raise FilterFailed(f"connect: {type(exc).__name__}: {exc}") from None
        await self.send(optneg_packet(self.settings.protocol), self.settings.command_timeout_s)
        command, data = await self._read(self.settings.command_timeout_s)
        if command != SMFIC_OPTNEG or len(data) < 12:
            raise FilterFailed(f"negotiation: unexpected reply {command!r}")
        version, actions, protocol = struct.unpack_from("!III", data)
        if version < 2:
            raise FilterFailed(f"negotiation: version {version}")
        # Bits that were not offered (libmilter's SMFIP_MDS_* data sizes, later extensions) are left out, as
        # Postfix's milter8 does; every step and no-reply bit of mfdef.h is offered, so a filter that asks for
        # them regardless (rspamd 3.4 answers NR_* whatever it is offered) is served as it asked.
        self.actions, self.protocol = actions & ACTIONS_OFFERED, protocol & PROTOCOL_OFFERED
        self.no = frozenset(c for c, bit in _NO.items() if self.protocol & bit)
        self.nr = frozenset(c for c, bit in _NR.items() if self.protocol & bit)
        rest = data[12:]
        while len(rest) > 4:  # SMFIF_SETSYMLIST: (uint32 stage, "names ...\0")*, the macros wanted per stage
            (stage,) = struct.unpack_from("!I", rest)
            names, _, rest = rest[4:].partition(b"\0")
            stage_command = _STAGES.get(stage)
            if stage_command is not None:
                self.symbols[stage_command] = {n.strip("{}") for n in names.decode("ascii", "replace").split()}

    def macros_for(self, command: bytes, macros: dict[str, str]) -> dict[str, str]:
        """``macros`` less those the filter's symbol list for this stage leaves out (Postfix honours it too)."""
        wanted = self.symbols.get(command)
        return macros if wanted is None else {k: v for k, v in macros.items() if k.strip("{}") in wanted}

    def sends(self, command: bytes) -> bool:
        """Whether this filter wants ``command`` (it did not negotiate it away)."""
        return command not in self.no

    def answers(self, command: bytes) -> bool:
        return command not in self.nr

    async def send(self, data: bytes, timeout_s: float, *, more: bool = False) -> None:
        """Write ``data`` after what is held back, and wait (``timeout_s``) while the socket's buffer is full;
        with ``more``, hold it back instead (unless :data:`FLUSH_BYTES` are held)."""
        if more:
            self.held.append(data)
            self.held_bytes += len(data)
            if self.held_bytes < FLUSH_BYTES:
                return
            data = b""
        if self.held:
            self.held.append(data)
            data = b"".join(self.held)
            self.held.clear()
            self.held_bytes = 0
        c = self.conn
        if c is None:
            raise FilterFailed("not connected")
        if c.closed or c.transport is None or c.transport.is_closing():
            raise FilterFailed(f"write: {c.lost or 'connection lost'}")
        c.transport.write(data)
        if c.paused:  # over the transport's high-water mark: wait for the filter to read
            loop = asyncio.get_running_loop()
            c.drained = loop.create_future()
            try:
                ok = await _within(c.drained, loop.time() + timeout_s)
            finally:
                c.drained = None
            if not ok:
                raise FilterFailed(f"write: TimeoutError: timeout after {timeout_s:g} s")
            if c.closed:
                raise FilterFailed(f"write: {c.lost or 'connection lost'}")

    async def flush(self, timeout_s: float) -> None:
        """Write what is held back, if anything."""
        if self.held:
            await self.send(b"", timeout_s)

    async def _read(self, timeout_s: float) -> tuple[bytes, bytes]:
        c = self.conn
        if c is None:
            raise FilterFailed("not connected")
        deadline = 0.0
        while True:
            try:
                got = self.decoder.next()
            except MilterProtocolError as exc:
                raise FilterFailed(f"protocol: {exc}") from None
            if got is not None:
                return got
            if c.lost is not None:
                raise FilterFailed(c.lost)
            loop = asyncio.get_running_loop()
            if not deadline:
                deadline = loop.time() + timeout_s
            c.waiter = loop.create_future()
            try:
                arrived = await _within(c.waiter, deadline)
            finally:
                c.waiter = None
            if not arrived:
                raise FilterFailed(f"timeout after {timeout_s:g} s")

    async def ask(self, packets: bytes, command: bytes, timeout_s: float) -> Reply:
        """Send ``packets`` (ending with ``command``; what is held back goes first), then read the final
        reply (progress packets restart the timeout, as Postfix's milter8 does). At end of message
        (SMFIC_BODYEOB) the modifications before the reply are collected; elsewhere, or not negotiated, they
        are a protocol error."""
        started = time.monotonic()
        stats = self.stats
        edits: list[Edit] = []
        try:
            await self.send(packets, timeout_s)
            while True:
                cmd, data = await self._read(timeout_s)
                if cmd == SMFIR_PROGRESS:
                    continue
                if cmd in _EDITS:
                    if command != SMFIC_BODYEOB or not self.actions & _EDITS[cmd]:
                        raise FilterFailed(f"protocol: modification {cmd!r} not allowed here")
                    try:
                        edits.append(parse_edit(cmd, data, bool(self.protocol & SMFIP_HDR_LEADSPC)))
                    except MilterProtocolError as exc:
                        raise FilterFailed(f"protocol: {exc}") from None
                    continue
                reply = self._final(cmd, data, command)
                reply.edits = edits
                stats.verdicts[reply.verdict] = stats.verdicts.get(reply.verdict, 0) + 1
                return reply
        finally:
            stats.seconds += time.monotonic() - started
            stats.waits += 1

    def _final(self, cmd: bytes, data: bytes, command: bytes) -> Reply:
        if cmd == SMFIR_CONTINUE:
            return Reply("continue")
        if cmd == SMFIR_ACCEPT:
            return Reply("accept")
        if cmd == SMFIR_REJECT:
            return Reply("reject", REJECT_REPLY)
        if cmd == SMFIR_TEMPFAIL:
            return Reply("tempfail", TEMPFAIL_REPLY)
        if cmd == SMFIR_DISCARD and command not in (SMFIC_CONNECT, SMFIC_HELO):
            return Reply("discard")
        if cmd == SMFIR_SKIP and command == SMFIC_BODY and self.protocol & SMFIP_SKIP:
            return Reply("skip")
        if cmd == SMFIR_REPLYCODE:
            text = _reply_text(data)
            if text[:1] == "4" and text[:3].isdigit():
                return Reply("tempfail", text)
            if text[:1] == "5" and text[:3].isdigit():
                return Reply("reject", text)
            raise FilterFailed(f"protocol: reply code {text[:40]!r} is not 4xx or 5xx")
        if cmd in (SMFIR_SHUTDOWN, SMFIR_CONN_FAIL):
            raise FilterFailed(f"the filter ended the session ({cmd!r})")
        raise FilterFailed(f"protocol: reply {cmd!r} not allowed after {command!r}")

    def close(self, quit_first: bool = True) -> None:
        """Send SMFIC_QUIT (when ``quit_first``; after what is held back) and close; never waits, never raises."""
        c, self.conn = self.conn, None
        held, self.held, self.held_bytes = self.held, [], 0
        if c is None or c.transport is None:
            return
        try:
            if quit_first and not c.transport.is_closing():
                c.transport.write(b"".join(held) + _QUIT)
            c.transport.close()
        except (OSError, RuntimeError):
            pass


@dataclass
class MessageOutcome:
    """What the filters made of a message: ``reply`` (a 4xx/5xx refusal, or None), ``discard``,
    ``quarantine`` (the reason, or None), ``edits`` (every modification, in order), ``filter`` (the filter
    that decided a refusal, discard or quarantine)."""

    reply: str | None = None
    discard: bool = False
    quarantine: str | None = None
    edits: list[Edit] = field(default_factory=list)
    filter: str = ""


class MilterSession:
    """The filters of one SMTP session (or one picked-up message), asked in the configured order.

    Each stage method returns None (go on) or a refusal reply; :attr:`discard` is set when a filter
    discards the message being received. A stage never waits longer than its timeout per filter; a failed
    filter is dropped and ``default_action`` applied (``refused`` then holds the reply given to every later
    stage of the session when it is tempfail or reject). ``context`` (queue ID, client) goes into the events."""

    def __init__(self, settings: MilterSettings, specs: Iterable[str] | None = None) -> None:
        self.settings = settings
        self.filters = [Filter(spec, settings) for spec in (settings.smtpd_milters if specs is None else specs)]
        self.refused: str | None = None  # a session-wide refusal (connect/HELO verdict or default action)
        self.discard = False
        self.discard_by = ""
        self.log = get_logger()
        self.context: dict[str, str] = {}

    def active(self) -> list[Filter]:
        return [f for f in self.filters if f.conn is not None and not f.skip_session]

    def _failed(self, f: Filter, stage: str, error: str) -> str | None:
        """Drop ``f`` and apply the default action: the reply for this stage (and later ones), or None."""
        f.close(quit_first=False)
        _stats(f.name).errors += 1
        action = self.settings.default_action
        self.log.warning("milter_error", milter=f.name, stage=stage, error=error, action=action, **self.context)
        if action == "accept":
            return None
        self.refused = DEFAULT_TEMPFAIL_REPLY if action == "tempfail" else DEFAULT_REJECT_REPLY
        return self.refused

    async def _stage(self, command: bytes, stage: str, data: bytes, macros: dict[str, str] | None,
                     timeout_s: float, per_message: bool) -> str | None:
        if self.refused is not None:
            return self.refused
        for f in self.active():
            if per_message and f.skip_message:
                continue
            if not f.sends(command):
                continue
            wanted = f.macros_for(command, macros) if macros else None
            pkts = (macro_packet(command, wanted) if wanted else b"") + packet(command, data)
            try:
                if not f.answers(command):
                    await f.send(pkts, timeout_s)  # with anything held back before it (abort, NR headers)
                    continue
                reply = await f.ask(pkts, command, timeout_s)
            except FilterFailed as exc:
                refusal = self._failed(f, stage, str(exc))
                if refusal is not None:
                    return refusal
                continue
            if reply.verdict == "accept":
                if per_message:
                    f.skip_message = True
                else:
                    f.skip_session = True
            elif reply.verdict == "discard":
                self.discard, self.discard_by = True, f.name
                f.skip_message = True
            elif reply.verdict in ("reject", "tempfail"):
                event = "milter_reject" if reply.verdict == "reject" else "milter_tempfail"
                self.log.info(event, milter=f.name, stage=stage, reply=reply.text, **self.context)
                if not per_message:  # a refused connection or HELO: every MAIL of the session gets it
                    self.refused = reply.text
                return reply.text
        return None

    async def connect(self, hostname: str, address: str, port: int, macros: dict[str, str]) -> str | None:
        """Open every filter and send SMFIC_CONNECT (Postfix: ``[address]`` as the name without reverse DNS)."""
        for f in list(self.filters):
            try:
                await f.open()
            except FilterFailed as exc:
                refusal = self._failed(f, "connect", str(exc))
                if refusal is not None:
                    return refusal
        return await self._stage(SMFIC_CONNECT, "connect", connect_packet(hostname, address, port)[5:], macros,
                                 self.settings.command_timeout_s, per_message=False)

    async def helo(self, name: str, macros: dict[str, str]) -> str | None:
        return await self._stage(SMFIC_HELO, "helo", _cstrings(_b(name)), macros, self.settings.command_timeout_s,
                                 per_message=False)

    async def abort(self, more: bool = False) -> None:
        """SMFIC_ABORT to every filter inside a message (a RSET, a refused DATA, a new MAIL); no reply. With
        ``more`` (a new MAIL follows) it is held back to go out in one write with the next packet."""
        for f in self.active():
            if f.in_message:
                f.in_message = False
                try:
                    await f.send(_ABORT, self.settings.command_timeout_s, more=more)
                except FilterFailed as exc:
                    self._failed(f, "abort", str(exc))
            f.skip_message = f.skip_body = False
        self.discard, self.discard_by = False, ""

    async def mail(self, sender: str, params: list[str], macros: dict[str, str]) -> str | None:
        await self.abort(more=True)
        for f in self.active():
            f.in_message = True
        return await self._stage(SMFIC_MAIL, "mail", _cstrings(_b(f"<{sender}>"), *map(_b, params)), macros,
                                 self.settings.command_timeout_s, per_message=True)

    async def rcpt(self, recipient: str, params: list[str], macros: dict[str, str]) -> str | None:
        return await self._stage(SMFIC_RCPT, "rcpt", _cstrings(_b(f"<{recipient}>"), *map(_b, params)), macros,
                                 self.settings.command_timeout_s, per_message=True)

    async def rcpt_rejected(self, recipient: str, params: list[str], macros: dict[str, str]) -> None:
        """A recipient mtaq refused (relay control, address checks), for the filters that negotiated
        SMFIP_RCPT_REJ (Postfix sends them too); their reply changes nothing."""
        if self.refused is not None:
            return
        for f in self.active():
            if f.skip_message or not f.protocol & SMFIP_RCPT_REJ or not f.sends(SMFIC_RCPT):
                continue
            wanted = f.macros_for(SMFIC_RCPT, macros)
            pkts = (macro_packet(SMFIC_RCPT, wanted) if wanted else b"") + packet(
                SMFIC_RCPT, _cstrings(_b(f"<{recipient}>"), *map(_b, params)))
            try:
                if f.answers(SMFIC_RCPT):
                    await f.ask(pkts, SMFIC_RCPT, self.settings.command_timeout_s)
                else:
                    await f.send(pkts, self.settings.command_timeout_s)
            except FilterFailed as exc:
                self._failed(f, "rcpt", str(exc))

    async def data(self, macros: dict[str, str]) -> str | None:
        return await self._stage(SMFIC_DATA, "data", b"", macros, self.settings.command_timeout_s, per_message=True)

    async def message(self, head: bytes, body: AsyncIterator[bytes], macros: dict[str, str]) -> MessageOutcome:
        """Headers, end of headers, the body (in chunks of at most :data:`BODY_CHUNK_BYTES` octets, taken from
        ``body`` as it yields them: a spilled body is never whole in memory) and end of message, to each
        filter still asking; the outcome of the message. ``head``: the header section (CRLF, without the
        empty line). Headers go as Postfix sends them: the value without its leading space (unless the
        filter asked for it) and with LF between folded lines."""
        out = MessageOutcome()
        content_s = self.settings.content_timeout_s

        def done(reply: str | None) -> MessageOutcome:
            if reply is not None:
                out.reply = reply
            return out

        if self.refused is not None:
            return done(self.refused)
        for name, raw in split_headers(head):
            if not name:
                continue
            for f in self.active():
                if f.skip_message or not f.sends(SMFIC_HEADER):
                    continue
                value = raw.replace(b"\r\n", b"\n")
                if not f.protocol & SMFIP_HDR_LEADSPC:
                    value = value.lstrip(b" \t")
                reply = await self._one(f, packet(SMFIC_HEADER, _cstrings(name.strip(), value)), SMFIC_HEADER,
                                        "header", content_s)
                if reply is not None:
                    return done(reply)
        reply = await self._stage(SMFIC_EOH, "eoh", b"", macros, content_s, per_message=True)
        if reply is not None:
            return done(reply)
        async for piece in body:
            if not any(not f.skip_message and not f.skip_body and f.sends(SMFIC_BODY) for f in self.active()):
                continue  # read to the end anyway: the caller's iterator may hold a file
            for start in range(0, len(piece), BODY_CHUNK_BYTES):
                chunk = piece[start:start + BODY_CHUNK_BYTES]
                for f in self.active():
                    if f.skip_message or f.skip_body or not f.sends(SMFIC_BODY):
                        continue
                    reply = await self._one(f, packet(SMFIC_BODY, chunk), SMFIC_BODY, "body", content_s)
                    if reply is not None:
                        return done(reply)
        if self.refused is not None:
            return done(self.refused)
        for f in self.active():
            if f.skip_message:
                f.in_message = False
                continue
            wanted = f.macros_for(SMFIC_BODYEOB, macros)
            pkts = (macro_packet(SMFIC_BODYEOB, wanted) if wanted else b"") + packet(SMFIC_BODYEOB)
            try:
                r = await f.ask(pkts, SMFIC_BODYEOB, content_s)
            except FilterFailed as exc:
                refusal = self._failed(f, "eom", str(exc))
                if refusal is not None:
                    return done(refusal)
                continue
            f.in_message = False
            if any(e.kind == SMFIR_REPLBODY for e in r.edits):  # this filter's body replaces an earlier one's
                out.edits = [e for e in out.edits if e.kind != SMFIR_REPLBODY]
            for e in r.edits:
                if e.kind == SMFIR_QUARANTINE:
                    out.quarantine, out.filter = e.address or "quarantined by a milter", f.name
                else:
                    out.edits.append(e)
            if r.verdict in ("reject", "tempfail"):
                self.log.info("milter_reject" if r.verdict == "reject" else "milter_tempfail", milter=f.name,
                              stage="eom", reply=r.text, **self.context)
                out.filter = f.name
                return done(r.text)
            if r.verdict == "discard":
                self.discard, self.discard_by = True, f.name
        if self.discard:
            out.discard, out.filter = True, self.discard_by
        return out

    async def _one(self, f: Filter, pkts: bytes, command: bytes, stage: str, timeout_s: float) -> str | None:
        """One content packet to one filter: None to go on, or the message's refusal. A packet that gets no
        reply (SMFIP_NR_HDR, SMFIP_NR_BODY) is held back: a run of them goes in one write with the next."""
        try:
            if not f.answers(command):
                await f.send(pkts, timeout_s, more=True)
                return None
            reply = await f.ask(pkts, command, timeout_s)
        except FilterFailed as exc:
            return self._failed(f, stage, str(exc))
        if reply.verdict == "accept":
            f.skip_message = True
        elif reply.verdict == "skip":
            f.skip_body = True
        elif reply.verdict == "discard":
            self.discard, self.discard_by = True, f.name
            f.skip_message = True
        elif reply.verdict in ("reject", "tempfail"):
            self.log.info("milter_reject" if reply.verdict == "reject" else "milter_tempfail", milter=f.name,
                          stage=stage, reply=reply.text, **self.context)
            return reply.text
        return None

    def close(self) -> None:
        """SMFIC_QUIT to every filter and close the connections (never waits)."""
        for f in self.filters:
            f.close()


def apply_edits(content: bytes, head: bytes, edits: list[Edit]) -> bytes:
    """``content`` (a whole message whose header section is ``head``) with the header changes and the
    replaced body among ``edits`` applied."""
    new_head = edit_head(head, edits)
    replaced = new_body(edits)
    if replaced is not None:
        return (head if new_head is None else new_head) + b"\r\n" + replaced
    return content if new_head is None else new_head + content[len(head):]


async def filter_local(settings: MilterSettings, content: bytes, head: bytes, sender: str, recipients: list[str],
                       queue_id: str, hostname: str, context: dict[str, str]) -> tuple[bytes, str, list[str], str | None]:
    """A message that did not come over SMTP (the maildrop's) through ``non_smtpd_milters``, as Postfix
    sends it: connect from ``localhost`` [127.0.0.1], HELO ``localhost``, MAIL, each RCPT, DATA, the
    message. Returns (content, sender, recipients, quarantine reason or None) with the modifications
    applied; a recipient a filter refuses is left out. Raises :class:`MilterRefused` (a 4xx: try again
    later; a 5xx) or :class:`MilterDiscarded`."""
    session = MilterSession(settings, settings.non_smtpd_milters)
    session.context = dict(context, queue_id=queue_id)
    try:
        reply = await session.connect("localhost", "127.0.0.1", 0, {
            "j": hostname, "{daemon_name}": hostname, "v": "mtaq", "_": "localhost [127.0.0.1]",
            "{client_addr}": "127.0.0.1", "{client_name}": "localhost"})
        reply = reply or await session.helo("localhost", {})
        reply = reply or await session.mail(sender, [], {"i": queue_id, "{mail_addr}": sender,
                                                         "{mail_mailer}": "local"})
        if reply is not None:
            raise MilterRefused(reply)
        kept = []
        for r in recipients:
            refused = await session.rcpt(r, [], {"{rcpt_addr}": r, "{rcpt_host}": r.rpartition("@")[2]})
            if session.refused is not None:
                raise MilterRefused(session.refused)
            if refused is None:
                kept.append(r)
        if not kept:
            raise MilterRefused(REJECT_REPLY)
        reply = await session.data({"i": queue_id})
        if reply is not None:
            raise MilterRefused(reply)
        if session.discard:
            raise MilterDiscarded(session.discard_by)

        async def body() -> AsyncIterator[bytes]:
            rest = content[len(head):]
            yield rest[2:] if rest.startswith(b"\r\n") else rest

        out = await session.message(head, body(), {"i": queue_id})
    finally:
        session.close()
    if out.reply is not None:
        raise MilterRefused(out.reply)
    if out.discard:
        raise MilterDiscarded(out.filter)
    edits = out.edits
    rcpt_edits = [e for e in edits if e.kind in (SMFIR_ADDRCPT, SMFIR_ADDRCPT_PAR, SMFIR_DELRCPT)]
    final = [a for a, _ in apply_recipients([(a, ()) for a in kept], rcpt_edits)]
    if not final:
        raise MilterDiscarded(out.filter)
    return apply_edits(content, head, edits), new_sender(edits) or sender, final, out.quarantine


def apply_recipients(recipients: list[tuple[str, tuple[tuple[str, str], ...]]],
                     edits: Iterable[Edit]) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """Recipients (address, DSN parameters) after the filters' add / delete recipient edits, in order
    (delete matches the address without angle brackets, in any case; an added one has no parameters and is
    not added twice)."""
    out = list(recipients)
    for e in edits:
        address = e.address.strip().strip("<>")
        if e.kind in (SMFIR_ADDRCPT, SMFIR_ADDRCPT_PAR) and address:
            if all(a.lower() != address.lower() for a, _ in out):
                out.append((address, ()))
        elif e.kind == SMFIR_DELRCPT:
            out = [(a, p) for a, p in out if a.lower() != address.lower()]
    return out


def new_sender(edits: Iterable[Edit]) -> str | None:
    """The envelope sender the last SMFIR_CHGFROM set (without angle brackets), or None."""
    sender = None
    for e in edits:
        if e.kind == SMFIR_CHGFROM:
            sender = e.address.strip().strip("<>")
    return sender


def new_body(edits: Iterable[Edit]) -> bytes | None:
    """The body the SMFIR_REPLBODY chunks among ``edits`` make (:meth:`MilterSession.message` keeps those
    of the last filter that replaced it), every line end CRLF; None when none replaced it."""
    chunks = [e.data for e in edits if e.kind == SMFIR_REPLBODY]
    if not chunks:
        return None
    return re.sub(rb"\r?\n", b"\r\n", b"".join(chunks))
