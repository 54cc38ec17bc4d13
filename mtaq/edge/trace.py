"""The trace header mtaq adds to every message it queues (RFC 5321 §4.4, RFC 5322 §3.6.7).

The edge prepends one ``Received:`` line to the message as received, before it is appended to the log, so
the log holds exactly what is relayed. Form (folded with CRLF and a tab, every line under 78 characters
when the names allow)::

    Received: from HELO ([192.0.2.1])
    \tby mx.example.org (mtaq) with ESMTPS
    \tfor <rcpt@example.net>; Mon, 20 Nov 2023 04:19:26 +0000

``from`` names what the client said in HELO/EHLO and its address as an address literal (no reverse DNS
lookup is made); ``with`` is the RFC 3848 / RFC 6531 §3.7.3 protocol name (SMTP, ESMTP, ESMTPA, ESMTPS,
ESMTPSA, UTF8SMTP...); ``for`` is given only when the message has one recipient (as Postfix does, so that
one copy does not reveal the other recipients). The date is UTC.

Must always hold: the header is CRLF-terminated 7-bit text (UTF-8 only in an address under SMTPUTF8) with
no bare CR or LF, whatever the client sent in HELO.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import functools
import ipaddress
import re
from collections.abc import Sequence

from mtaq.core.text import ASCII_CONTROL

__all__ = ["address_literal", "hop_count", "protocol_name", "received_header"]

_HOP_FIELD = re.compile(rb"^(?:received|delivered-to)[ \t]*:", re.IGNORECASE | re.MULTILINE)


def hop_count(head: bytes) -> int:
    """The ``Received:`` and ``Delivered-To:`` fields of the header section ``head`` (each counted once, not
    its continuation lines): the hops a message has made (Postfix's ``hopcount_limit``, RFC 5321 §6.3: a
    loop is detected by counting them)."""
    return len(_HOP_FIELD.findall(head))

_HELO_MAX = 255
_NOT_IN_COMMENT = re.compile(r"[^!-~]|[()\\]")  # what _clean_helo replaces
# The last date formatted, and the UTC seconds [lo, hi) in which it certainly holds: a microsecond inside its
# second on either side, so that datetime's rounding to the microsecond never carries a time into the next.
_last_date: tuple[float, float, str] = (0.0, 0.0, "")


def _date(when_ts: float) -> str:
    """RFC 5322 §3.3 date-time of ``when_ts`` (UTC seconds), e.g. ``Mon, 20 Nov 2023 04:19:26 +0000``
    (formatted once a second: messages received in the same second share it)."""
    global _last_date
    lo, hi, text = _last_date
    if lo <= when_ts < hi:
        return text
    moment = dt.datetime.fromtimestamp(when_ts, dt.UTC).replace(microsecond=0)
    text = email.utils.format_datetime(moment)
    second = moment.timestamp()
    _last_date = (second + 1e-6, second + 1 - 1e-6, text)
    return text


@functools.lru_cache(maxsize=4096)
def address_literal(ip: str) -> str:
    """``192.0.2.1`` -> ``[192.0.2.1]``, ``::1`` -> ``[IPv6:::1]`` (RFC 5321 §4.1.3); else ``[unknown]``."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return "[unknown]"
    if isinstance(addr, ipaddress.IPv6Address):
        mapped = addr.ipv4_mapped
        return f"[{mapped}]" if mapped is not None else f"[IPv6:{addr.compressed}]"
    return f"[{addr}]"


def protocol_name(*, extended: bool, tls: bool, authenticated: bool, smtputf8: bool) -> str:
    """The ``with`` value: ``SMTP``/``ESMTP`` or ``UTF8SMTP``, plus ``S`` for TLS and ``A`` for AUTH."""
    if smtputf8:
        base = "UTF8SMTP"
    else:
        base = "ESMTP" if extended else "SMTP"
    if base == "SMTP":
        return base
    return base + ("S" if tls else "") + ("A" if authenticated else "")


def _clean_helo(helo: str) -> str:
    """``helo`` (at most 255 characters) with anything but printable ASCII other than ``()\\`` as ``?``."""
    return _NOT_IN_COMMENT.sub("?", helo[:_HELO_MAX]) or "unknown"


def received_header(
    *,
    helo: str,
    client_ip: str,
    hostname: str,
    protocol: str,
    recipients: Sequence[str],
    when_ts: float,
    private: bool = False,
) -> bytes:
    """The ``Received:`` header (with its final CRLF) for a message received now (``when_ts``, UTC seconds).
    ``private``: without the ``from`` clause (the client's HELO name and address), for mail an authenticated
    user submitted (``smtpd_received_header_private``): ``Received: by HOST (mtaq) with ESMTPSA ...; DATE``."""
    date = _date(when_ts)
    by = f"by {_clean_helo(hostname)} (mtaq) with {protocol}"
    lines = [f"Received: {by}"] if private else [
        f"Received: from {_clean_helo(helo)} ({address_literal(client_ip)})",
        f"\t{by}",
    ]
    if len(recipients) == 1 and ASCII_CONTROL.search(recipients[0]) is None:
        lines.append(f"\tfor <{recipients[0]}>; {date}")
    else:
        lines[-1] += ";"
        lines.append(f"\t{date}")
    return ("\r\n".join(lines) + "\r\n").encode("utf-8", "surrogateescape")
