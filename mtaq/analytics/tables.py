"""What the job hands to the report, as plain data: the :class:`Result` and the bucket bounds it uses.

Neither :mod:`mtaq.analytics.job` (which fills a Result with Spark) nor :mod:`mtaq.analytics.report` (which
renders one) imports the other's module for these: the report takes the job's results as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AGE_BUCKETS_MIN", "DELAY_BUCKETS_S", "Result", "bucket_labels"]

AGE_BUCKETS_MIN = (5, 10, 20, 40, 80, 160, 320, 640, 1280)  # qshape's default buckets (minutes)
DELAY_BUCKETS_S = (1, 10, 60, 600, 3600, 6 * 3600, 86400, 5 * 86400)  # time-to-deliver buckets (seconds)


@dataclass
class Result:
    """The headline totals (``totals.json``) and every small table as lists of dicts (the report's input);
    ``seconds`` is the job's wall-clock time; ``state_note``: with ``--state``, the one line saying why the
    state was rebuilt (None when it was used, or there was none)."""

    totals: dict[str, Any]
    tables: dict[str, list[dict[str, Any]]]
    seconds: float
    state_note: str | None = None


def bucket_labels(bounds: Sequence[int], unit: str) -> list[str]:
    """Labels of the buckets ``bounds`` make (``[0-b0unit, b0-b1unit, ..., >bNunit]``), in order; the job's
    Spark expression assigns the same labels."""
    out, lo = [], 0
    for b in bounds:
        out.append(f"{lo}-{b}{unit}")
        lo = b
    return [*out, f">{bounds[-1]}{unit}"]
