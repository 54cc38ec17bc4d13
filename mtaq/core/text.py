"""Text that is safe to show: control, format and line-separator characters escaped (pure).

Anything a client sends (HELO names, addresses, replies of a next hop, header fields) can reach a log line
or a terminal. A terminal obeys escape sequences (``ESC ] 0;title BEL`` sets the window title, ``ESC [ 2J``
clears the screen, C1 ``CSI`` U+009B does the same in one character), a bare CR or a NEL/U+2028 starts what
looks like a new log line, and bidi controls (U+202E) reorder what is displayed (CVE-2021-42574, "Trojan
Source"). :func:`escape_text` replaces every character of the Unicode categories Cc (C0 and C1 controls,
DEL), Cf (format: bidi controls, zero-width characters, the BOM), Zl and Zp (U+2028, U+2029) with a
Python-style escape (``\\x1b``, ``\\u202e``, ``\\U000e0001``), so that the text shows what was sent without
acting on the display. Backslashes are left alone (an escape in the output may also be text that was sent
as such; it never acts on the terminal either way). Letters of every script are kept as they are.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ASCII_CONTROL", "UNSAFE_RANGES", "EscapingWriter", "escape_text", "escape_value", "is_safe"]

ASCII_CONTROL = re.compile("[\x00-\x1f\x7f]")
"""A C0 control character or DEL (``.search(text) is None``: ``text`` has none)."""


# The code points of the categories Cc, Cf, Zl and Zp in Unicode 14.0 (Python 3.11's unicodedata), as
# inclusive ranges; tests/test_text.py checks them against unicodedata of the running Python. Written out
# rather than computed at import: scanning 1.1 million code points costs 0.3 s of start-up.
UNSAFE_RANGES: tuple[tuple[int, int], ...] = (
    (0x0, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x600, 0x605), (0x61C, 0x61C), (0x6DD, 0x6DD), (0x70F, 0x70F),
    (0x890, 0x891), (0x8E2, 0x8E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x2028, 0x202E), (0x2060, 0x2064),
    (0x2066, 0x206F), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD),
    (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> re.Pattern[str]:
    parts = [re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges]
    return re.compile("[" + "".join(parts) + "]")


_UNSAFE = _char_class(UNSAFE_RANGES)
_UNSAFE_BUT_LAYOUT = _char_class(((0x0, 0x8), (0xB, 0x1F), *UNSAFE_RANGES[1:]))  # TAB and LF kept


_ASCII_SAFE = bytes(range(0x20, 0x7F))  # printable ASCII: nothing to escape
_ASCII_SAFE_LAYOUT = _ASCII_SAFE + b"\t\n"


def _escape(m: re.Match[str]) -> str:
    cp = ord(m.group())
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def escape_text(text: str, *, keep_layout: bool = False) -> str:
    """``text`` with every Cc, Cf, Zl and Zp character replaced by its escape (``\\x1b``, ``\\u2028``);
    with ``keep_layout`` LF and TAB are kept, for multi-line output that is ours (folded header lines
    start with a TAB). The same object is returned when nothing needs escaping (the common case costs one
    regex search)."""
    if text.isascii() and not text.encode("ascii").translate(None, _ASCII_SAFE_LAYOUT if keep_layout else _ASCII_SAFE):
        return text  # printable ASCII (and LF, TAB): two passes in C, much faster than the search below
    pattern = _UNSAFE_BUT_LAYOUT if keep_layout else _UNSAFE
    if pattern.search(text) is None:
        return text
    return pattern.sub(_escape, text)


def is_safe(text: str) -> bool:
    """True when ``text`` has no character :func:`escape_text` would replace (one regex search). Several
    strings can be checked at once by joining them: a character is unsafe alone, whatever surrounds it."""
    return _UNSAFE.search(text) is None


def escape_value(value: Any) -> Any:
    """``value`` with :func:`escape_text` applied to every string in it (in lists, tuples and dict values,
    at any depth); other values are returned unchanged."""
    if isinstance(value, str):
        return escape_text(value)
    if isinstance(value, list | tuple):
        return type(value)(escape_value(v) for v in value) if any(isinstance(v, str | list | tuple | dict) for v in value) else value
    if isinstance(value, dict):
        return {k: escape_value(v) for k, v in value.items()}
    return value


class EscapingWriter:
    """A text stream wrapper for human output: every ``write`` goes through :func:`escape_text` with LF
    and TAB kept (the lines are ours, what is in them may be anybody's). Returns what the stream returns."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> Any:
        return self.stream.write(escape_text(text, keep_layout=True))

    def flush(self) -> None:
        self.stream.flush()
