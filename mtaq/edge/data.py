"""Reading the message text after DATA in big chunks, one pass over each (issues 15.2 and 15.4).

The text is read from the connection's :class:`asyncio.StreamReader` with ``readuntil(b"\\r\\n.\\r\\n")``
(pieces of what is buffered when the reader's limit is overrun), not a line at a time, and each chunk is
examined once with C-level bytes operations (``find``, ``count``, ``replace``): no Python loop per line
except for the rare text that needs one (a line longer than 998 octets, NULs to strip in a long line).

What :class:`DataScanner` computes is exactly what a reader that takes one CRLF-terminated line at a time
computes (the behaviour the edge had before; tests/test_data_reader.py keeps that reader as the reference
and compares the two on generated input):

* the text ends at the first ``CRLF . CRLF``, the first CRLF being the DATA command's own when the message
  is empty (RFC 5321 §4.1.1.4); lines are split on CRLF only (§2.3.8);
* a leading dot is removed from every line (§4.5.2), before NULs are stripped;
* ``bare``: ``"<CR>"`` or ``"<LF>"``, the first CR or LF that is not part of a CRLF; under ``normalize``
  they become CRLF in the stored text (a line is normalized after its dot is removed and its NULs stripped);
* ``nul``: a NUL octet was seen (removed from the text when ``strip_nul``);
* ``too_long``: a line longer than :data:`TEXT_LINE_MAX` octets with its CRLF after the dot is removed (and
  NULs stripped), or whose raw text is longer than the reader's limit (RFC 5321 §4.5.3.1.6);
* ``size``: the octets of the text after dot removal and NUL stripping, before normalizing; ``too_big``
  when it exceeds ``size_limit`` (0: none);
* the text is written to the sink (a :class:`~mtaq.storage.spill.BodyBuffer`, or a list of bytes) until
  the message is refused; then what was written is discarded and nothing more is kept, but the whole text
  is still read and examined (the reply comes after the final dot, RFC 5321 §4.2.5).

Bytes the client sent after the final dot (pipelined commands) are never taken from the reader. The sink is
written a chunk at a time (at most what the reader buffered: its limit plus one socket read), not a line at
a time.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from mtaq.core.octets import crlf_only, unstuff
from mtaq.storage.spill import BodyBuffer

__all__ = ["END_MARK", "TEXT_LINE_MAX", "DataScanner", "read_data_text", "refusal", "text_problem"]

TEXT_LINE_MAX = 1000
"""RFC 5321 §4.5.3.1.6: a text line is at most 1000 octets with its CRLF (not counting a transparency dot)."""
END_MARK = b"\r\n.\r\n"
"""RFC 5321 §4.1.1.4: the end of the mail data (its first CRLF ends the last line of the text)."""

_NEWLINES = re.compile(rb"\r\n|\r|\n")
_CONTENT_MAX = TEXT_LINE_MAX - 2  # octets of a line without its CRLF


def _first_bare(text: bytes) -> str | None:
    """``"<CR>"`` / ``"<LF>"``: the first CR or LF of ``text`` that is not part of a CRLF, or None."""
    if crlf_only(text):
        return None
    masked = text.replace(b"\r\n", b"  ")  # same length: positions kept
    cr, lf = masked.find(b"\r"), masked.find(b"\n")
    return "<CR>" if lf < 0 or 0 <= cr < lf else "<LF>"


def _maybe_long_line(text: bytes) -> bool:
    """Whether some line of ``text`` (whole CRLF-terminated lines) may have more than 998 octets before its
    CRLF: False is certain, True means "look closer". One ``rfind`` per ~1000 octets."""
    pos, end = 0, len(text)
    while end - pos > _CONTENT_MAX + 2:
        crlf = text.rfind(b"\r\n", pos, pos + _CONTENT_MAX + 2)
        if crlf < 0:
            return True
        pos = crlf + 2
    return False


class DataScanner:
    """One pass over the text of a message (module docstring): :meth:`feed` the raw octets in order, in
    pieces of any size, without the final ``.CRLF``; the results are the attributes.

    ``sink``: a :class:`BodyBuffer` or a list that receives the stored text (dot-unstuffed, NULs stripped
    under ``strip_nul``, CRLF everywhere under ``normalize``) while the message is not refused.
    ``line_limit``: the reader's limit in octets (a raw line longer than it is too long).
    """

    def __init__(self, sink: BodyBuffer | list[bytes], *, size_limit: int = 0, normalize: bool = False,
                 strip_nul: bool = False, line_limit: int = TEXT_LINE_MAX + 1) -> None:
        self.sink = sink
        self.size_limit = size_limit
        self.normalize = normalize
        self.strip_nul = strip_nul
        self.line_limit = line_limit
        self.size = 0
        self.bare: str | None = None
        self.nul = False
        self.too_long = False
        self.too_big = False
        self.refused = False  # nothing more is kept
        self._carry = b""  # the start of a line whose CRLF has not come yet
        self._long = False  # the line in _carry is known to be too long and its start (its dot) is done

    def feed(self, data: bytes) -> None:
        """The next raw octets of the text, in stream order, cut anywhere: the end of a line not complete yet
        (a CR whose LF has not come included) is kept until the next piece."""
        if self._carry:
            data = self._carry + data
        cut = data.rfind(b"\r\n") + 2
        if cut >= 2:
            self._lines(data if cut == len(data) else data[:cut])
            data = data[cut:]
        if len(data) > self.line_limit + 1:
            # A line longer than the reader's limit (refused whatever follows): take it in pieces, keeping a
            # final CR back (it may be the start of the CRLF).
            keep = 1 if data.endswith(b"\r") else 0
            self._piece(data[: len(data) - keep])
            data = data[len(data) - keep:]
        self._carry = data

    @property
    def pending(self) -> int:
        """Octets fed that do not end a line yet (0 after the whole text, which ends with CRLF)."""
        return len(self._carry)

    def _lines(self, block: bytes) -> None:
        """Whole lines (``block`` ends with CRLF); the first continues a long line when ``_long``."""
        continued = self._long
        self._long = False
        if self.bare is None:
            self.bare = _first_bare(block)
        text = unstuff(block)  # dot transparency on every line but the first
        if not continued and text[:1] == b".":
            text = text[1:]
        has_nul = b"\x00" in text
        if not self.too_long and (self.line_limit <= _CONTENT_MAX or _maybe_long_line(text)):
            self.too_long = self._any_long_line(block, continued)
        if has_nul:
            self.nul = True
            if self.strip_nul:
                text = text.replace(b"\x00", b"")
        self._count(len(text))
        if self.refused:
            return
        if self.normalize and self.bare is not None:
            text = _NEWLINES.sub(b"\r\n", text)
        if isinstance(self.sink, list):
            self.sink.append(text)
        else:
            self.sink.write(text)

    def _any_long_line(self, block: bytes, continued: bool) -> bool:
        """The exact rule, a line at a time: the rare block with a line over 998 octets, or NULs to strip."""
        lines = block.split(b"\r\n")
        lines.pop()  # after the last CRLF: nothing
        for i, raw in enumerate(lines):
            if i == 0 and continued:
                return True
            if len(raw) > self.line_limit:
                return True
            line = raw[1:] if raw[:1] == b"." else raw
            length = len(line) - line.count(b"\x00") if self.strip_nul else len(line)
            if length > _CONTENT_MAX:
                return True
        return False

    def _piece(self, piece: bytes) -> None:
        """Part of a line longer than the reader's limit, without a CRLF (all its CR and LF are bare)."""
        if not self._long and piece[:1] == b".":
            piece = piece[1:]
        self._long = True
        self.too_long = True
        if self.bare is None and (b"\r" in piece or b"\n" in piece):
            cr, lf = piece.find(b"\r"), piece.find(b"\n")
            self.bare = "<CR>" if lf < 0 or 0 <= cr < lf else "<LF>"
        size = len(piece)
        if b"\x00" in piece:
            self.nul = True
            if self.strip_nul:
                size -= piece.count(b"\x00")
        self._count(size)

    def _count(self, size: int) -> None:
        self.size += size
        if self.size_limit and self.size > self.size_limit:
            self.too_big = True
        if not self.refused and (self.too_long or self.too_big or (self.bare is not None and not self.normalize)
                                 or (self.nul and not self.strip_nul)):
            self.refused = True
            if isinstance(self.sink, list):
                self.sink.clear()
            else:
                self.sink.discard()


def refusal(scanner: DataScanner, hostname: str) -> tuple[str, bool] | None:
    """The reply to a refused message and whether to hang up after it, or None: the text was accepted.

    In this order: a bare CR/LF (unless normalized): ``550 5.5.2 <host> Error: bare <LF> received``, then
    the connection is closed (Postfix 3.9 ``smtpd_forbid_bare_newline = reject``: what follows cannot be
    trusted to be what the client meant); too big: ``552 5.3.4``; a line too long: ``500 5.5.2``; a NUL
    (unless stripped): ``550 5.6.0``.
    """
    if scanner.bare is not None and not scanner.normalize:
        return f"550 5.5.2 {hostname} Error: bare {scanner.bare} received", True
    if scanner.too_big:
        return "552 5.3.4 Error: message size exceeds fixed maximum message size", False
    if scanner.too_long:
        return f"500 5.5.2 Error: line too long (RFC 5321 section 4.5.3.1.6: {TEXT_LINE_MAX} octets)", False
    if scanner.nul and not scanner.strip_nul:
        return "550 5.6.0 Error: message contains NUL characters", False
    return None


async def read_data_text(reader: asyncio.StreamReader, scanner: DataScanner, alive: Callable[[], bool]) -> None:
    """Read the text of one message from ``reader`` into ``scanner``, up to and including the final
    ``CRLF . CRLF`` and not one octet more.

    ``alive()`` is asked before each read; False (the connection went away) raises CancelledError, as does
    the end of the stream (IncompleteReadError, from the reader) before the final dot.
    """
    # The text may be empty (".\r\n" at once) or start with empty lines; until no part of the end mark can
    # be pending, read only as many octets as cannot go past it. Usually one read of 3 octets.
    tail = b"\r\n"  # the last octets seen (the DATA command's CRLF at first), for matching the end mark
    held = b""  # octets read that may be the start of the end mark: not given to the scanner yet
    matched = 2  # octets of the end mark at the end of `tail`
    while matched:
        if not alive():
            raise asyncio.CancelledError
        got = await reader.readexactly(len(END_MARK) - matched)
        window = tail + got
        if window.endswith(END_MARK):
            scanner.feed((held + got)[:-3])
            return
        matched = next((n for n in (4, 3, 2, 1) if window.endswith(END_MARK[:n])), 0)
        fresh = held + got
        scanner.feed(fresh[: len(fresh) - matched])
        held = fresh[len(fresh) - matched:]
        tail = window[-4:]
    while True:
        if not alive():
            raise asyncio.CancelledError
        try:
            chunk = await reader.readuntil(END_MARK)
        except asyncio.LimitOverrunError as exc:
            # More than the reader's limit before the end mark: what is buffered, except its last octets
            # (a part of the end mark is never cut off: readuntil keeps len(END_MARK) - 1 octets).
            scanner.feed(await reader.read(exc.consumed))
            continue
        scanner.feed(chunk[:-3])
        return


def text_problem(text: bytes) -> str | None:
    """Why ``text`` (a whole message as stored: CRLF line ends, not dot-stuffed) would be refused at DATA,
    or None: the listener's checks (:func:`refusal`) for text that did not come over SMTP (the maildrop,
    review finding B8): a CR or LF that is not part of a CRLF, a line longer than :data:`TEXT_LINE_MAX`
    octets with its CRLF (RFC 5321 §4.5.3.1.6), a NUL octet. Lines are numbered from 1."""
    for number, line in enumerate(text.split(b"\r\n"), 1):
        if len(line) + 2 > TEXT_LINE_MAX:
            return f"line {number} longer than {TEXT_LINE_MAX - 2} octets (RFC 5321 section 4.5.3.1.6)"
        if b"\r" in line:
            return f"line {number} has a bare CR"
        if b"\n" in line:
            return f"line {number} has a bare LF"
        if b"\0" in line:
            return f"line {number} has a NUL octet"
    if text and not text.endswith(b"\r\n"):
        return "the text does not end with CRLF"
    return None
