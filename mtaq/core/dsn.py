"""Delivery status notifications: bounces, delay warnings and success notices as bytes (pure: stdlib + msgspec).

``build_dsn`` renders one DSN (RFC 3464 ``multipart/report; report-type=delivery-status``, RFC 6522) about
one queued message, for one or more of its recipients, ready to be queued as a new message from ``<>``:

1. ``text/plain``: what happened, for people (Postfix's bounce text in spirit), naming the queue ID;
2. ``message/delivery-status``: the per-message fields, then one block of per-recipient fields each
   (RFC 3464 §2.2, §2.3; enhanced status codes of RFC 3463);
3. the original: the whole message as ``message/rfc822`` (RET=FULL) or its header section only as
   ``text/rfc822-headers`` (RET=HDRS, RFC 6522 §4, formerly RFC 3462).

What must hold:

* The result has CRLF line ends only (no bare CR or LF anywhere), so it can be queued and sent as is.
* The original is included byte for byte: it is never parsed or re-encoded; only its line ends are made
  CRLF (SMTP forbids bare CR and LF, RFC 5321 §2.3.8). Part 3 is ``8bit`` when it has 8-bit bytes.
* The delivery-status part is 7-bit US-ASCII (RFC 3464 §2.1): a non-ASCII recipient address is given
  with address type ``utf-8`` in its ``utf-8-addr-xtext`` form (``\\x{HEX}`` escapes, RFC 6533 §3); non-ASCII
  characters of diagnostics and MTA names are escaped the same way. Long fields are folded at spaces.
* No value can inject a header line: addresses and names with control characters are refused
  (ValueError); a remote reply's control characters and line breaks become single spaces.
* The MIME boundary occurs nowhere in the parts it separates.
* Deterministic: the same arguments give the same bytes (no clock, no randomness; dates come from the
  timestamps passed in).

A DSN is never sent to the null sender (RFC 3461 §6.2, RFC 5321 §4.5.5): the caller must not ask for one,
and ``build_dsn`` refuses ``sender=""``.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
import unicodedata
from collections.abc import Sequence
from email.message import MIMEPart
from email.policy import SMTP
from email.utils import formatdate

import msgspec

__all__ = ["ACTIONS", "DsnRecipient", "build_dsn"]

ACTIONS = ("failed", "delayed", "delivered", "relayed", "expanded")
"""The RFC 3464 §2.3.3 actions, in the order their groups appear in the text part."""

_STATUS_RE = re.compile(r"[245]\.[0-9]{1,3}\.[0-9]{1,3}")
_TYPED_RE = re.compile(r"([A-Za-z][A-Za-z0-9-]*)[ \t]*;[ \t]*(.*)", re.DOTALL)
_XTEXT_HEX_RE = re.compile(r"\+([0-9A-F]{2})")
_LINE_MAX = 78  # fold delivery-status fields longer than this (RFC 5322 §2.1.1 SHOULD)
_HARD_MAX = 990  # below the 998-octet limit of RFC 5322 §2.1.1 and RFC 5321 §4.5.3.1.6

_SUBJECTS = {
    "failed": "Undelivered Mail Returned to Sender",
    "delayed": "Delayed Mail (still being retried)",
    "success": "Successful Mail Delivery Report",
}


class DsnRecipient(msgspec.Struct, frozen=True):
    """What one DSN reports about one recipient (RFC 3464 §2.3).

    ``final_recipient`` is the address we tried (a leading ``rfc822;`` is accepted and dropped); it is
    reported as ``rfc822; addr`` (``utf-8; ...`` when not ASCII). ``action`` is one of :data:`ACTIONS`;
    ``status`` an enhanced status code ``class.subject.detail`` with class 2, 4 or 5 (RFC 3463).
    ``original_recipient`` is the RCPT ORCPT parameter as given, ``addr-type;xtext`` (RFC 3461 §4.2).
    ``diagnostic`` is the remote reply, e.g. ``550 5.1.1 no such user``, reported as
    ``Diagnostic-Code: smtp; 550 5.1.1 no such user`` (a value already typed, ``x-foo; ...``, is kept).
    ``remote_mta`` is the next hop's host name, reported as ``Remote-MTA: dns; name``.
    Times are UTC seconds since the epoch; ``will_retry_until_ts`` is only reported for ``delayed``.
    """

    final_recipient: str
    action: str
    status: str
    original_recipient: str | None = None
    diagnostic: str | None = None
    remote_mta: str | None = None
    last_attempt_ts: float | None = None
    will_retry_until_ts: float | None = None


def build_dsn(
    *,
    reporting_mta: str,
    sender: str,
    recipients: Sequence[DsnRecipient],
    original: bytes,
    ret: str = "FULL",
    envid: str | None = None,
    arrival_ts: float,
    now_ts: float,
    queue_id: str,
    message_id: str,
    size_limit: int = 0,
) -> bytes:
    """The DSN to ``sender`` about ``recipients`` of the message ``original``, as bytes with CRLF line ends.

    ``reporting_mta`` is our host name (``From: MAILER-DAEMON@...``, ``Reporting-MTA: dns; ...``);
    ``sender`` the original envelope sender (the DSN's ``To``); ``original`` the queued message content;
    ``ret`` the MAIL RET parameter, ``FULL`` or ``HDRS`` (any case); ``envid`` the MAIL ENVID parameter as
    given (xtext, RFC 3461 §4.4), reported decoded as ``Original-Envelope-Id``. ``arrival_ts`` is when the
    original was queued, ``now_ts`` the DSN's ``Date``, both UTC seconds. ``queue_id`` is the original's
    queue ID; ``message_id`` the DSN's own Message-ID without angle brackets (``id@host``).

    The subject follows the most serious action: any ``failed`` gives a bounce, else any ``delayed`` a
    delay warning, else a success report.

    Backscatter (Postfix ``bounce_size_limit``): a success report (``delivered``, ``relayed``, ``expanded``)
    returns the header section only, whatever ``ret`` says; with ``size_limit`` > 0 (bytes) an original
    larger than that returns its header section only ("when truncating a large message, don't damage the
    MIME structure", as Postfix does), and a header section larger than that is cut at the last line end
    within the limit. Raises ValueError for no recipients, an unknown action, a bad
    status code, an empty (null) sender, an unknown ``ret``, or a control character in an address or name.
    """
    if not recipients:
        raise ValueError("a DSN needs at least one recipient")
    if sender in ("", "<>"):
        raise ValueError("a DSN is never sent to the null sender <>")
    _check_text("sender", sender)
    for name, value in (("reporting_mta", reporting_mta), ("queue_id", queue_id), ("message_id", message_id)):
        if not value or not value.isascii() or not value.isprintable() or " " in value:
            raise ValueError(f"{name} must be printable ASCII without spaces: {value!r}")
    message_id = message_id.removeprefix("<").removesuffix(">")
    ret_u = ret.upper()
    if ret_u not in ("FULL", "HDRS"):
        raise ValueError(f"ret must be FULL or HDRS, not {ret!r}")
    rows = [_Row.of(r) for r in recipients]
    actions = {row.action for row in rows}
    kind = "failed" if "failed" in actions else "delayed" if "delayed" in actions else "success"

    body = _crlf(original)
    if kind == "success" or (size_limit > 0 and len(body) > size_limit):
        ret_u = "HDRS"  # nothing of the content goes back to whoever the sender claims to be
    if ret_u == "HDRS":
        end = -2 if body.startswith(b"\r\n") else body.find(b"\r\n\r\n")  # -2: no header lines at all
        headers = body if end == -1 else body[: end + 2]
        if headers and not headers.endswith(b"\r\n"):
            headers += b"\r\n"
        if size_limit > 0 and len(headers) > size_limit:
            cut = headers.rfind(b"\r\n", 0, size_limit)
            headers = headers[: cut + 2] if cut >= 0 else b""
        third_type, third_desc, third_body = "text/rfc822-headers", "Original message header section", headers
    else:
        third_type, third_desc, third_body = "message/rfc822", "Original message", body
    eight_bit = not third_body.isascii()

    text = _human_text(reporting_mta, queue_id, rows, ret_u, arrival_ts, now_ts)
    note = MIMEPart(policy=SMTP)
    seven_bit = text.isascii() and max(map(len, text.splitlines())) <= _HARD_MAX
    note.set_content(text, charset="utf-8", cte="7bit" if seven_bit else "quoted-printable")
    note["Content-Description"] = "Notification"
    part1 = note.as_bytes(policy=SMTP)

    part2 = _lines(
        "Content-Description: Delivery report",
        "Content-Type: message/delivery-status",
        "",
        *_delivery_status(reporting_mta, queue_id, envid, arrival_ts, rows),
    )
    part3 = _lines(
        f"Content-Description: {third_desc}",
        f"Content-Type: {third_type}",
        f"Content-Transfer-Encoding: {'8bit' if eight_bit else '7bit'}",
        "",
    ) + third_body

    boundary = _boundary(queue_id, message_id, (part1, part2, part3))
    head = _lines(
        f"From: Mail Delivery System <MAILER-DAEMON@{reporting_mta}>",
        f"To: <{sender}>",
        f"Subject: {_SUBJECTS[kind]}",
        f"Date: {formatdate(now_ts, usegmt=True)}",
        f"Message-ID: <{message_id}>",
        "Auto-Submitted: auto-replied",
        "MIME-Version: 1.0",
        "Content-Type: multipart/report; report-type=delivery-status;",
        f' boundary="{boundary}"',
        *(["Content-Transfer-Encoding: 8bit"] if eight_bit else []),
        "",
        "This is a MIME-encapsulated message.",
        "",
    )
    delim = f"--{boundary}\r\n".encode("ascii")
    # The CRLF before each delimiter belongs to the delimiter (RFC 2046 §5.1.1), not to the part.
    return b"".join((
        head, delim, part1, b"\r\n", delim, part2, b"\r\n", delim, part3, f"\r\n--{boundary}--\r\n".encode("ascii"),
    ))


class _Row(msgspec.Struct, frozen=True):
    """A validated recipient, with the field values as they will be written (ASCII) and shown (text)."""

    action: str
    status: str
    address: str  # as shown to people
    final_field: str  # "rfc822; addr" or "utf-8; xtext"
    orig_address: str | None
    orig_field: str | None
    reply: str | None  # the diagnostic text, for people
    diag_field: str | None
    remote: str | None  # the remote MTA name, for people
    remote_field: str | None
    last_attempt_ts: float | None
    retry_until_ts: float | None

    @classmethod
    def of(cls, r: DsnRecipient) -> _Row:
        action = r.action.strip().lower()
        if action not in ACTIONS:
            raise ValueError(f"unknown DSN action {r.action!r} (expected one of {', '.join(ACTIONS)})")
        status = r.status.strip()
        if not _STATUS_RE.fullmatch(status):
            raise ValueError(f"bad enhanced status code {r.status!r} (expected class.subject.detail, class 2, 4 or 5)")
        address = r.final_recipient.strip()
        m = _TYPED_RE.fullmatch(address)
        if m and m.group(1).lower() == "rfc822":
            address = m.group(2)
        if not address:
            raise ValueError("final_recipient is empty")
        _check_text("final_recipient", address)
        orig_address = orig_field = None
        if r.original_recipient is not None and r.original_recipient.strip():
            orig_address, orig_field = _orcpt(r.original_recipient.strip())
        reply = diag_field = None
        if r.diagnostic is not None:
            dtype, reply = "smtp", _flatten(r.diagnostic)
            m = _TYPED_RE.fullmatch(reply)
            if m:
                dtype, reply = m.group(1), m.group(2)
            if reply:
                diag_field = f"{dtype}; {_escape(reply, address=False)}"
            else:
                reply = None
        remote = remote_field = None
        if r.remote_mta is not None and _flatten(r.remote_mta):
            mtype, remote = "dns", _flatten(r.remote_mta)
            m = _TYPED_RE.fullmatch(remote)
            if m:
                mtype, remote = m.group(1), m.group(2)
            remote_field = f"{mtype}; {_escape(remote, address=False)}"
        return cls(
            action=action,
            status=status,
            address=address,
            final_field=_typed_address(address),
            orig_address=orig_address,
            orig_field=orig_field,
            reply=reply,
            diag_field=diag_field,
            remote=remote,
            remote_field=remote_field,
            last_attempt_ts=r.last_attempt_ts,
            retry_until_ts=r.will_retry_until_ts if action == "delayed" else None,
        )


def _delivery_status(reporting_mta: str, queue_id: str, envid: str | None, arrival_ts: float,
                     rows: Sequence[_Row]) -> list[str]:
    """The lines (without line ends) of the message/delivery-status body (RFC 3464 §2.1)."""
    out = [f"Reporting-MTA: dns; {reporting_mta}", f"X-Mtaq-Queue-ID: {queue_id}"]
    if envid is not None and envid.strip():
        out.append(_fold(f"Original-Envelope-Id: {_escape(_xtext_decode(envid.strip()), address=False)}"))
    out.append(f"Arrival-Date: {formatdate(arrival_ts, usegmt=True)}")
    for row in rows:
        out.append("")
        if row.orig_field is not None:
            out.append(_fold(f"Original-Recipient: {row.orig_field}"))
        out.append(_fold(f"Final-Recipient: {row.final_field}"))
        out.append(f"Action: {row.action}")
        out.append(f"Status: {row.status}")
        if row.remote_field is not None:
            out.append(_fold(f"Remote-MTA: {row.remote_field}"))
        if row.diag_field is not None:
            out.append(_fold(f"Diagnostic-Code: {row.diag_field}"))
        if row.last_attempt_ts is not None:
            out.append(f"Last-Attempt-Date: {formatdate(row.last_attempt_ts, usegmt=True)}")
        if row.retry_until_ts is not None:
            out.append(f"Will-Retry-Until: {formatdate(row.retry_until_ts, usegmt=True)}")
    return out


def _human_text(reporting_mta: str, queue_id: str, rows: Sequence[_Row], ret: str,
                arrival_ts: float, now_ts: float) -> str:
    """The text/plain part: one paragraph and a recipient list per kind of outcome."""
    paras = [f"This is the mail system at host {reporting_mta}."]
    failed = [r for r in rows if r.action == "failed"]
    delayed = [r for r in rows if r.action == "delayed"]
    done = [r for r in rows if r.action not in ("failed", "delayed")]
    attached = "It is attached below." if ret == "FULL" else "Its header section is attached below."
    if failed:
        paras.append(
            "I'm sorry to have to tell you that your message could not be delivered to one or more "
            f"recipients. {attached}")
        paras.append("For further assistance, please send mail to postmaster, and include this report.")
        paras.append(_recipient_list(failed))
    if delayed:
        paras.append("THIS IS A WARNING ONLY. YOU DO NOT NEED TO SEND YOUR MESSAGE AGAIN.")
        until = max((r.retry_until_ts for r in delayed if r.retry_until_ts is not None), default=None)
        tail = f" until {formatdate(until, usegmt=True)}" if until is not None else ""
        paras.append(
            f"Your message has not been delivered to the recipients below for {_duration(now_ts - arrival_ts)}. "
            f"The mail system will keep trying{tail}; you will be told if it gives up.")
        paras.append(_recipient_list(delayed))
    if done:
        paras.append(
            "Your message was delivered to, or passed on towards, the destinations listed below. "
            "If it was delivered to a mailbox you will receive no further notification; otherwise you "
            "may still hear from other mail systems.")
        paras.append(_recipient_list(done))
    paras.append(f"The queue ID of your message here was {queue_id}; please quote it if you contact postmaster.")
    wrapper = textwrap.TextWrapper(width=76, break_long_words=False, break_on_hyphens=False)
    return "\n\n".join(p if p.startswith("<") else wrapper.fill(p) for p in paras) + "\n"


def _recipient_list(rows: Sequence[_Row]) -> str:
    """One wrapped entry per recipient: ``<addr>: host mx said: 550 ...`` (Postfix's form)."""
    wrapper = textwrap.TextWrapper(width=76, subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False)
    entries = []
    for r in rows:
        who = f"<{r.address}>"
        if r.orig_address is not None and r.orig_address.lower() != r.address.lower():
            who += f" (expanded from <{r.orig_address}>)"
        if r.reply is not None:
            why = (f"host {r.remote} said: " if r.remote else "") + r.reply
        else:
            verb = {"failed": "delivery failed", "delayed": "delivery temporarily failed",
                    "delivered": "delivered", "relayed": "relayed", "expanded": "expanded"}[r.action]
            why = f"{verb}{f' via {r.remote}' if r.remote else ''} (status {r.status})"
        entries.append(wrapper.fill(f"{who}: {why}"))
    return "\n\n".join(entries)


def _duration(seconds: float) -> str:
    """``3 day(s)``, ``4 hour(s)`` or ``12 minute(s)``: the largest whole unit (floor, at least minutes)."""
    s = max(0, int(seconds))
    if s >= 86400:
        return f"{s // 86400} day(s)"
    if s >= 3600:
        return f"{s // 3600} hour(s)"
    return f"{s // 60} minute(s)"


def _check_text(name: str, value: str) -> None:
    """Refuse control characters, line separators, surrogates and outer whitespace in an address or name."""
    if value != value.strip():
        raise ValueError(f"{name} has leading or trailing whitespace: {value!r}")
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp"):
            raise ValueError(f"{name} contains control character {ch!r}: {value!r}")


def _flatten(text: str) -> str:
    """A remote reply on one line: control characters and line breaks become spaces, runs of spaces one."""
    chars = []
    for ch in text:
        cat = unicodedata.category(ch)
        chars.append(" " if cat in ("Cc", "Zl", "Zp") else "\ufffd" if cat == "Cs" else ch)
    return re.sub(r" {2,}", " ", "".join(chars)).strip()


def _escape(text: str, *, address: bool) -> str:
    """``text`` in 7-bit form: non-ASCII characters as ``\\x{HEX}`` (RFC 6533 §3 EmbeddedUnicodeChar).

    For an address (``utf-8-addr-xtext``) also space, ``+``, ``=`` and ``\\`` are escaped, so that only
    QCHARs remain.
    """
    out = []
    for ch in text:
        cp = ord(ch)
        if cp > 0x7E or cp < 0x20 or (address and ch in " +=\\"):
            out.append(f"\\x{{{cp:02X}}}")
        else:
            out.append(ch)
    return "".join(out)


def _typed_address(address: str) -> str:
    """``rfc822; addr`` for a printable ASCII address, else ``utf-8; utf-8-addr-xtext`` (RFC 6533 §3)."""
    if address.isascii() and address.isprintable():
        return f"rfc822; {address}"
    return f"utf-8; {_escape(address, address=True)}"


def _xtext_decode(value: str) -> str:
    """Undo xtext ``+HH`` escapes (RFC 3461 §4); keep ``value`` as is when one is not printable ASCII."""
    codes = [int(h, 16) for h in _XTEXT_HEX_RE.findall(value)]
    if not all(0x20 <= c <= 0x7E for c in codes):
        return value
    return _XTEXT_HEX_RE.sub(lambda m: chr(int(m.group(1), 16)), value)


def _orcpt(value: str) -> tuple[str, str]:
    """An ORCPT parameter ``addr-type;xtext`` as (address for people, Original-Recipient field value)."""
    _check_text("original_recipient", value)
    m = _TYPED_RE.fullmatch(value)
    atype, addr = (m.group(1), m.group(2)) if m else ("rfc822", value)
    if atype.lower() == "utf-8":
        # utf-8-addr-xtext is already 7-bit (RFC 6533 §3); a raw UTF-8 value is escaped here.
        return addr, f"utf-8; {addr if addr.isascii() else _escape(addr, address=True)}"
    addr = _xtext_decode(addr)
    if addr.isascii():
        return addr, f"{atype}; {addr}"
    return addr, f"utf-8; {_escape(addr, address=True)}"


def _fold(line: str) -> str:
    """Fold a field line longer than 78 characters at spaces (CRLF before an existing space; RFC 5322 §2.2.3).

    A word longer than the 998-octet limit is broken by force (the unfolded value then gains a space).
    """
    if len(line) <= _LINE_MAX:
        return line
    chunks = re.findall(r" *[^ ]+| +$", line)
    out = [chunks[0]]
    for chunk in chunks[1:]:
        if len(out[-1]) + len(chunk) > _LINE_MAX and out[-1].strip():
            out.append(chunk)
        else:
            out[-1] += chunk
    hard = []
    for piece in out:
        while len(piece) > _HARD_MAX:
            hard.append(piece[:_HARD_MAX])
            piece = " " + piece[_HARD_MAX:]
        hard.append(piece)
    return "\r\n".join(hard)


def _lines(*lines: str) -> bytes:
    """``lines`` joined and ended with CRLF, as UTF-8 (the header section may carry an SMTPUTF8 sender)."""
    return "".join(f"{line}\r\n" for line in lines).encode("utf-8")


def _crlf(data: bytes) -> bytes:
    """``data`` with every line end (CRLF, bare CR, bare LF) made CRLF; no other byte changes."""
    if b"\r" not in data:
        return data.replace(b"\n", b"\r\n")
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").replace(b"\n", b"\r\n")


def _boundary(queue_id: str, message_id: str, parts: Sequence[bytes]) -> str:
    """A MIME boundary (RFC 2046 §5.1.1) found in none of ``parts``; derived from the IDs, not random."""
    n = 0
    while True:
        digest = hashlib.sha256(f"{queue_id}\0{message_id}\0{n}".encode()).hexdigest()[:32]
        boundary = f"=_mtaq_{digest}"  # "=_" cannot occur in quoted-printable or base64 text
        token = boundary.encode("ascii")
        if not any(token in p for p in parts):
            return boundary
        n += 1
