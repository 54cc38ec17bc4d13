"""The byte passes over a message's text made at every 250 and every delivery: whether every line end is a
CRLF, and the transparency dot taken away (receiving) or doubled (sending), RFC 5321 §2.3.8 and §4.5.2.

The functions here are the definitions. Where the optional C module ``mtaq.core._octets`` was built
(``setup.py``; ``pip install`` goes on without it where there is no C compiler), :data:`crlf_only`,
:data:`unstuff` and :data:`stuff` are its functions, which give the same results
(``tests/test_octets.py``) in one pass each instead of two to four: at 100 KiB these passes were about a
fifth of the relay's CPU (docs/performance.md, "Stop 55"). Every function takes ``bytes`` (TypeError for
anything else in C) and gives ``bytes`` or bool; ``unstuff`` and ``stuff`` may give their argument itself.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["NATIVE", "crlf_only", "crlf_only_py", "stuff", "stuff_py", "unstuff", "unstuff_py"]


def crlf_only_py(data: bytes) -> bool:
    """True when every CR and every LF of ``data`` is part of a CRLF (none is bare, RFC 5321 §2.3.8)."""
    n = data.count(b"\n")
    return data.count(b"\r") == n and (not n or data.count(b"\r\n") == n)


def unstuff_py(data: bytes) -> bytes:
    """``data`` with the dot after each CRLF taken away (RFC 5321 §4.5.2; a dot at the very start is the
    caller's: it has no CRLF before it here)."""
    return data.replace(b"\r\n.", b"\r\n")


def stuff_py(data: bytes) -> bytes:
    """``data`` with the dot after each LF doubled (RFC 5321 §4.5.2; a dot at the very start is the caller's)."""
    return data.replace(b"\n.", b"\n..") if b"." in data else data  # "." first: one memchr pass


crlf_only: Callable[[bytes], bool]
unstuff: Callable[[bytes], bytes]
stuff: Callable[[bytes], bytes]
try:
    from mtaq.core import _octets
except ImportError:  # built without a C compiler: the definitions themselves
    NATIVE = False
    crlf_only, unstuff, stuff = crlf_only_py, unstuff_py, stuff_py
else:
    NATIVE = True
    crlf_only, unstuff, stuff = _octets.crlf_only, _octets.unstuff, _octets.stuff
