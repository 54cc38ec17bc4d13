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
"""

from __future__ import annotations

import collections
import re
from collections.abc import Collection, Iterable
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, syntax

from mtaq.edge.fastpath import FastPathMixin

__all__ = ["DsnEnvelope", "DsnParams", "DsnSyntaxError", "MtaqSMTP", "decode_xtext", "encode_xtext",
           "parse_mail_dsn", "parse_rcpt_dsn"]

DsnParams = tuple[tuple[str, str], ...]
"""The DSN parameters of one recipient, e.g. ``(("NOTIFY", "SUCCESS,FAILURE"), ("ORCPT", "rfc822;a@b"))``."""

ENVID_MAX = 100
"""RFC 3461 §4.4: the ENVID value is at most 100 characters (checked on the xtext as sent)."""
ORCPT_MAX = 500
"""RFC 3461 §4.2: the ORCPT parameter may be up to 500 characters (checked on the value as sent)."""

_MAIL_KEYWORDS = frozenset({"RET", "ENVID"})
_RCPT_KEYWORDS = frozenset({"NOTIFY", "ORCPT"})
_RET_VALUES = frozenset({"FULL", "HDRS"})
_NOTIFY_VALUES = ("SUCCESS", "FAILURE", "DELAY")
# How much longer a MAIL / RCPT line may be with the DSN parameters: " RET=HDRS ENVID=" + 100, and
# " NOTIFY=SUCCESS,FAILURE,DELAY ORCPT=" + 500.
_MAIL_EXTRA = len(" RET=HDRS ENVID=") + ENVID_MAX
_RCPT_EXTRA = len(" NOTIFY=SUCCESS,FAILURE,DELAY ORCPT=") + ORCPT_MAX

# RFC 3461 §4: xchar is "!" (33) to "~" (126) except "+" and "="; hexchar is "+" and two upper case hex digits.
_XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-F]{2})*")
_HEXCHAR = re.compile(r"\+([0-9A-F]{2})")
# RFC 3461 §4.2: addr-type is an atom (RFC 822), here also without "=" (not allowed in an esmtp-value).
_ADDR_TYPE = re.compile(r"[A-Za-z0-9!#$%&'*+\-/?^_`{|}~]+")

_SYNTAX = "501 5.5.4 Syntax error in parameters: "


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
    """aiosmtpd's :class:`~aiosmtpd.smtp.SMTP` with the RFC 3461 DSN extension (see the module docstring).

    Takes the same arguments as aiosmtpd's SMTP. The envelope is a :class:`DsnEnvelope`; a subclass that
    overrides :meth:`_create_envelope` must return one.
    """

    def __init__(self, handler: Any, *args: Any, **kwargs: Any) -> None:
        # aiosmtpd keeps the per-command line limits in a class attribute, shared by every connection (and
        # grown on each EHLO); give each connection its own.
        self.command_size_limits = collections.defaultdict(lambda: self.command_size_limit)
        self._ehlo_lines: list[str | bytes] | None = None
        super().__init__(handler, *args, **kwargs)

    def _create_envelope(self) -> DsnEnvelope:
        """A fresh :class:`DsnEnvelope` for each transaction (connect, HELO/EHLO, RSET, after DATA)."""
        return DsnEnvelope()

    def _dsn_envelope(self) -> DsnEnvelope:
        envelope = self.envelope
        assert isinstance(envelope, DsnEnvelope), "MtaqSMTP needs a DsnEnvelope"
        return envelope

    async def push(self, status: str | bytes) -> bool:
        """Send one reply line, or hold it back while an EHLO reply is being assembled."""
        if self._ehlo_lines is not None:
            self._ehlo_lines.append(status)
            return False
        # aiosmtpd's push takes AnyStr: bind it to str or to bytes, not to the union.
        if isinstance(status, str):
            sent: bool = await super().push(status)
        else:
            sent = await super().push(status)
        return sent

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str) -> None:
        """aiosmtpd's EHLO (and the handler's ``handle_EHLO``), with ``DSN`` added to a positive reply."""
        if hostname:
            self.command_size_limits.clear()  # aiosmtpd adds to them on each EHLO; start over
        self._ehlo_lines = []
        try:
            await super().smtp_EHLO(hostname)
            lines = self._ehlo_lines
        finally:
            self._ehlo_lines = None
        extended = _with_dsn(lines)
        if extended is not None:
            lines = [*extended]
            self.command_size_limits["MAIL"] += _MAIL_EXTRA
            self.command_size_limits["RCPT"] += _RCPT_EXTRA
        for line in lines:
            await self.push(line)

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        """aiosmtpd's MAIL, with RET and ENVID taken out, checked and kept on the envelope."""
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
        except DsnSyntaxError as exc:
            await self.push(exc.reply)
            return
        envelope.dsn_ret, envelope.dsn_envid = ret, envid  # visible to the handler's handle_MAIL
        await super().smtp_MAIL(stripped)
        if not envelope.mail_from:  # refused (SIZE, BODY, unknown parameter, handle_MAIL): not kept
            envelope.dsn_ret = envelope.dsn_envid = None

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        """aiosmtpd's RCPT, with NOTIFY and ORCPT taken out, checked and kept per accepted recipient."""
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


def _with_dsn(lines: list[str | bytes]) -> list[str] | None:
    """The EHLO reply ``lines`` with ``DSN`` added before the last line, or ``None`` to leave it as it is.

    Only a well-formed positive reply (``250-`` lines, then one ``250 `` line) that does not already list
    DSN is changed.
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
    if any(w.upper().split()[:1] == ["DSN"] for w in words[1:]):
        return None
    words.insert(max(1, len(words) - 1), "DSN")
    return [f"250-{w}" for w in words[:-1]] + [f"250 {words[-1]}"]
