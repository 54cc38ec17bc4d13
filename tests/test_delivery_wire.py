"""The DATA content mtaq sends is byte for byte what aiosmtplib would send (CRLF, dot-stuffing, final dot)."""

from __future__ import annotations

from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.delivery.relay import wire_content


def _aiosmtplib_wire(body: bytes) -> bytes:
    return PERIOD_REGEX.sub(b"..", normalize_message_line_endings(body)) + b".\r\n"


_PIECES = st.sampled_from([b"\r\n", b"\n", b"\r", b".", b"..", b"a", b"From: x", b"\r\n.\r\n", b" ", b"\x00"])


@settings(max_examples=500, deadline=None)
@given(body=st.lists(_PIECES, max_size=40).map(b"".join))
def test_wire_content_is_what_aiosmtplib_sends(body: bytes) -> None:
    """Bare CR/LF made CRLF, a final CRLF added when missing, leading dots doubled, then CRLF . CRLF."""
    assert _aiosmtplib_wire(body) == wire_content(body)


def test_wire_content_examples() -> None:
    """A clean message only gets its final dot; dots and bare line ends are fixed as RFC 5321 §4.5.2 says."""
    assert b"Subject: a\r\n\r\nbody\r\n.\r\n" == wire_content(b"Subject: a\r\n\r\nbody\r\n")
    assert b"a\r\n..b\r\n.\r\n" == wire_content(b"a\r\n.b")
    assert b"..\r\na\r\nb\r\n.\r\n" == wire_content(b".\na\rb")
    assert b"\r\n.\r\n" == wire_content(b"")
