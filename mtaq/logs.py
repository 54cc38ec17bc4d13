"""Structured logging (structlog): one event per line with the queue ID, readable or JSON (GUIDE §4).

Events named in the issue: ``queued``, ``delivered``, ``deferred``, ``bounced`` (``queue_id``, and
``recipient`` where it applies), ``recovery_complete`` (``seconds``, ``records``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec
import structlog

from mtaq.core.text import escape_value

__all__ = ["configure_logging", "get_logger"]


def configure_logging(fmt: str = "console", *, stream: Any = None, shard: int | None = None) -> None:
    """Send events to ``stream`` (stderr) as JSON lines (``fmt="json"``) or for a terminal.

    ``shard``: in a worker process of a sharded spool (mtaq.daemon.workers), every event gets a ``shard`` field.
    """
    stream = stream or sys.stderr
    processors: list[Any] = [
        _escape_event,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if shard is not None:

        def add_shard(_logger: Any, _name: str, event: Any) -> Any:
            event.setdefault("shard", shard)
            return event

        processors.append(add_shard)
    if fmt == "json":
        # exc_info becomes an "exception" field (the traceback as structured data) instead of being dropped.
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer(serializer=_dumps)]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        # One write per event (message and newline together): several worker processes share the stream,
        # and O_APPEND makes each write land whole (print() writes the newline separately).
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


def _escape_event(_logger: Any, _name: str, event: Any) -> Any:
    """Escape control, format and line-separator characters in every string value (mtaq.core.text): a
    client's HELO name or address can neither drive the terminal showing the log nor forge a line of it,
    in JSON (whose encoder leaves C1 controls, U+2028 and bidi controls raw) as on the console."""
    for k, v in event.items():
        if not isinstance(v, int | float | bool | None):
            event[k] = escape_value(v)
    return event


def _fallback(obj: Any) -> Any:
    """What msgspec cannot encode: the object's ``__structlog__()`` if it has one, else its repr (structlog's rule)."""
    to_log = getattr(obj, "__structlog__", None)
    return to_log() if callable(to_log) else repr(obj)


_ENCODER = msgspec.json.Encoder(enc_hook=_fallback)


def _dumps(event: Any, **_kw: Any) -> str:
    """One JSON object per event (msgspec: several times faster than json.dumps; the same JSON values)."""
    return _ENCODER.encode(event).decode()


def get_logger(**bind: Any) -> Any:
    """A logger with ``bind`` values in every event."""
    return structlog.get_logger("mtaq").bind(**bind)
