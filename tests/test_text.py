"""Escaping what reaches a terminal or a log line (mtaq.core.text)."""

from __future__ import annotations

import sys
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from mtaq.core.text import UNSAFE_RANGES, escape_text, escape_value


def test_the_written_out_ranges_are_the_categories_of_this_pythons_unicodedata():
    """UNSAFE_RANGES is every Cc, Cf, Zl and Zp code point of the running Python, and nothing else."""
    expected = [cp for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp)) in ("Cc", "Cf", "Zl", "Zp")]
    assert expected == [cp for a, b in UNSAFE_RANGES for cp in range(a, b + 1)]


def test_the_injections_of_the_review_are_escaped_and_letters_kept():
    """OSC title, screen clear, CR, C1 CSI, NEL, LINE SEPARATOR, RLO: escaped; letters of any script kept."""
    sent = "x\x1b]0;owned\x07\x1b[2J\rFAKE \u009b \u0085 \u2028 \u202e é 日本"
    assert "x\\x1b]0;owned\\x07\\x1b[2J\\x0dFAKE \\x9b \\x85 \\u2028 \\u202e é 日本" == escape_text(sent)
    assert "a\n\tb\\x0dc" == escape_text("a\n\tb\rc", keep_layout=True)
    assert {"k": ["\\x1b", ("\\u202e", 3)], "n": 1} == escape_value({"k": ["\x1b", ("\u202e", 3)], "n": 1})


@given(st.text())
def test_escaped_text_has_no_unsafe_character_left(text):
    """Whatever the input, the output contains no Cc/Cf/Zl/Zp character."""
    out = escape_text(text)
    assert [] == [c for c in out if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
