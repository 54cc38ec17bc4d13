"""The reply a recipient ends up with (its own module so that every part of delivery can name it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Reply"]


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply for one recipient: SMTP code (RFC 5321 §4.2), RFC 3463 enhanced status code ("" if none
    given) and text."""

    code: int
    enhanced: str
    text: str
