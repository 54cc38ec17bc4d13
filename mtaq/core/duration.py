"""Durations as administrators write them: ``3600``, ``90s``, ``30m``, ``2h``, ``1d``, ``1w`` (pure: no I/O).

Used by ``mtaq queue list --older-than`` and the admin API's ``olderThan`` (Postfix/exiqgrep style ages).
What must hold: the result is a finite number of seconds >= 0, or :class:`ValueError` naming the input.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_duration"]

_UNITS_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """``"2h"`` -> 7200.0 seconds. A bare number is seconds; units s, m, h, d, w (case-insensitive).

    Raises ValueError (``'2x' is not a duration (e.g. 3600, 30m, 2h, 1d)``) for anything else.
    """
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (e.g. 3600, 30m, 2h, 1d)")
    value = float(m.group(1)) * _UNITS_S[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large a duration")
    return value
