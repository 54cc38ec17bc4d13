"""The byte passes over a message's text in C (``mtaq/core/_octets.c``, issue 36.5) against their definitions
in Python (``mtaq.core.octets``): random bytes over the alphabet that matters (CR, LF, dot, NUL, a letter),
every string of up to 6 such bytes, and crafted cases (texts across the C loop's 255-byte blocks, a dot or
LF at the very start and end, long texts). Then the callers, which must give what they gave before the C module:
the receiver's scanner and the sender's dot-stuffer, piece by piece.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mtaq.delivery.relay as relay
import mtaq.edge.data as edge_data
from mtaq.core import octets
from mtaq.delivery.relay import DotStuffer, wire_content
from mtaq.edge.data import DataScanner

try:
    from mtaq.core import _octets
except ImportError:  # not built: test_the_c_module_is_built_and_used fails, the comparisons are skipped
    _octets = None  # type: ignore[assignment]
needs_c = pytest.mark.skipif(_octets is None, reason="mtaq/core/_octets.c was not built")

ALPHABET = b"\r\n.\x00a"
texts = st.lists(st.sampled_from(list(ALPHABET)), max_size=300).map(bytes)
# Mostly CRLF-terminated lines with dots, as real mail is, so that the "all CRLF" answer is often True.
lines = st.lists(st.sampled_from([b"a", b".", b"..", b".a", b"a.b", b"", b"\r", b"\n", b"\x00"]), max_size=6)
mail_texts = st.lists(lines.map(b"".join), max_size=40).map(lambda ls: b"".join(line + b"\r\n" for line in ls))

FUNCTIONS = [("crlf_only", octets.crlf_only_py), ("unstuff", octets.unstuff_py), ("stuff", octets.stuff_py)]


def test_the_c_module_is_built_and_used():
    """`make test` installs gcc and python3-dev before the package: the relay runs the C passes."""
    assert octets.NATIVE, "mtaq/core/_octets.c was not built by the install (gcc, python3-dev?)"
    assert octets.crlf_only is _octets.crlf_only
    assert octets.unstuff is _octets.unstuff
    assert octets.stuff is _octets.stuff


def _same(data: bytes) -> None:
    for name, definition in FUNCTIONS:
        assert getattr(_octets, name)(data) == definition(data), (name, data)


def test_the_definitions_say_what_the_rfc_says():
    """The definitions themselves on hand-made cases, so that agreeing with them means something."""
    assert octets.crlf_only_py(b"") and octets.crlf_only_py(b"a\r\nb\r\n")
    assert not octets.crlf_only_py(b"a\nb") and not octets.crlf_only_py(b"a\rb") and not octets.crlf_only_py(b"\n\r")
    assert octets.unstuff_py(b"a\r\n..b\r\n.\r\n") == b"a\r\n.b\r\n\r\n"
    assert octets.stuff_py(b".a\n.b\r\n..c") == b".a\n..b\r\n...c"


@needs_c
@pytest.mark.parametrize("n", range(7))
def test_every_short_string_over_the_alphabet(n: int):
    for combo in itertools.product(ALPHABET, repeat=n):
        _same(bytes(combo))


@needs_c
@settings(max_examples=400, deadline=None)
@given(texts)
def test_random_bytes(data: bytes):
    _same(data)


@needs_c
@settings(max_examples=400, deadline=None)
@given(mail_texts)
def test_random_mail_text(data: bytes):
    _same(data)


@needs_c
@pytest.mark.parametrize("data", [
    b"x" * 65535 + b"\r\n" + b"y" * 70000,  # long texts with a CRLF, a bare LF, a bare CR in the middle
    b"x" * 65535 + b"\n" + b"y" * 70000,
    b"x" * 65536 + b"\r" + b"y" * 70000,
    (b"line.\r\n.dot\r\n") * 20000,
    b"\n" + b"a\r\n" * 30000,
    b"." * 5 + b"\r\n" + b"." * 5,
    b"\r\n." * 30000,
    b"\n." * 30000,
])
def test_crafted(data: bytes):
    _same(data)


@needs_c
@pytest.mark.parametrize("k", range(250, 262))
def test_line_ends_at_the_c_loop_s_255_byte_blocks(k: int):
    """The C loop sums in blocks of 255 bytes and looks one byte back across each block's start."""
    for end in (b"\r\n", b"\n", b"\r", b"\n\r"):
        _same(b"x" * k + end + b"y" * 300)
        _same(b"x\r\n" * k + end)


@needs_c
def test_unchanged_text_is_given_back_and_bad_arguments_are_refused():
    text = b"no dot after a line end\r\n"
    assert _octets.unstuff(text) is text and _octets.stuff(text) is text
    for bad in (bytearray(b"a"), memoryview(b"a"), "a", None, 1):
        for name, _ in FUNCTIONS:
            with pytest.raises(TypeError):
                getattr(_octets, name)(bad)


def _scan(data: bytes, cut: int, **kw: object) -> tuple[bytes, str | None, bool, bool, int]:
    sink: list[bytes] = []
    s = DataScanner(sink, **kw)  # type: ignore[arg-type]
    s.feed(data[:cut])
    s.feed(data[cut:])
    return b"".join(sink), s.bare, s.too_long, s.nul, s.size


@settings(max_examples=300, deadline=None)
@given(mail_texts, st.integers(min_value=0, max_value=400), st.booleans())
def test_the_scanner_and_the_stuffer_give_what_the_definitions_give(data: bytes, cut: int, normalize: bool):
    """The receiver's scan and the sender's dot-stuffing with the C passes and with the definitions, the text
    cut in two anywhere: the same stored text, the same verdicts, the same bytes on the wire."""
    cut = min(cut, len(data))
    with_c = _scan(data, cut, normalize=normalize)
    wire_c = DotStuffer()
    sent_c = wire_c.feed(data[:cut]) + wire_c.feed(data[cut:]) + wire_c.end()
    saved = edge_data.crlf_only, edge_data.unstuff, relay.crlf_only, relay.stuff
    try:
        edge_data.crlf_only, edge_data.unstuff = octets.crlf_only_py, octets.unstuff_py
        relay.crlf_only, relay.stuff = octets.crlf_only_py, octets.stuff_py
        assert _scan(data, cut, normalize=normalize) == with_c
        wire_py = DotStuffer()
        assert wire_py.feed(data[:cut]) + wire_py.feed(data[cut:]) + wire_py.end() == sent_c
        assert wire_content(data) == sent_c
    finally:
        edge_data.crlf_only, edge_data.unstuff, relay.crlf_only, relay.stuff = saved
