"""Structured logging (structlog): one event per line with the queue ID, readable or JSON (GUIDE §4).

Events named in the issue: ``queued``, ``delivered``, ``deferred``, ``bounced`` (``queue_id``, and
``recipient`` where it applies), ``recovery_complete`` (``seconds``, ``records``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import structlog.tracebacks

from mtaq.core.text import escape_text, escape_value, is_safe

if TYPE_CHECKING:
    import logging.handlers

__all__ = ["LIBRARY_EVENT", "PlainConsoleRenderer", "SyslogRenderer", "UtcStamper", "configure_logging", "get_logger"]


def configure_logging(fmt: str = "console", *, stream: Any = None, shard: int | None = None,
                      syslog_socket: str = "/dev/log") -> None:
    """Send events to ``stream`` (stderr) as JSON lines (``fmt="json"``) or for a terminal; ``fmt="syslog"``:
    RFC 5424 lines (:class:`SyslogRenderer`) to the unix socket ``syslog_socket`` through the standard
    library's ``logging.handlers.SysLogHandler`` (facility mail), or to ``stream`` when that socket does not
    exist.

    ``shard``: in a worker process of a sharded spool (mtaq.daemon.workers), every event gets a ``shard`` field.
    """
    stream = stream or sys.stderr
    console = fmt == "console"
    processors: list[Any] = [
        structlog.processors.add_log_level,
        UtcStamper(),
        # exc_info becomes an "exception" field here, before the escaping, so that a traceback is escaped too:
        # JSON gets the traceback as structured data, the console its text (structlog's plain format). Never
        # with the frames' local variables (structlog's default for both dict tracebacks and Rich): they held
        # an AUTH line and the user name (issue 32 item 8).
        structlog.processors.ExceptionRenderer(_NO_LOCALS) if not console else structlog.processors.format_exc_info,
        _escape_console_event if console else _escape_event,
    ]
    if shard is not None:

        def add_shard(_logger: Any, _name: str, event: Any) -> Any:
            event.setdefault("shard", shard)
            return event

        processors.append(add_shard)
    logger_factory: Any = structlog.WriteLoggerFactory(stream)
    if fmt == "syslog":
        processors.append(SyslogRenderer())
        logger_factory = _SyslogLoggerFactory(syslog_socket, stream)
    elif not console:
        processors.append(structlog.processors.JSONRenderer(serializer=_dumps))
    elif stream.isatty():
        processors.append(structlog.dev.ConsoleRenderer(colors=True))
    else:
        processors.append(PlainConsoleRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        # One write per event (message and newline together): several worker processes share the stream,
        # and O_APPEND makes each write land whole (print() writes the newline separately).
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    _route_library_logging()


_SPECIAL = frozenset(" \t=\r\n\"'")
# structlog's columns ("" is its marker of the default column: a field named "" goes first), then the keys it
# pops before rendering.
_COLUMNS = ("timestamp", "level", "event", "", "logger", "logger_name", "stack", "exception", "exc_info")
_OTHER_COLUMNS = frozenset(_COLUMNS[3:])
_MISSING = object()


class PlainConsoleRenderer:
    """structlog's ``ConsoleRenderer(colors=False)``, the same text character for character
    (``tests/test_logs_console.py`` compares them), at about a quarter of its CPU for an ordinary event (a
    timestamp, a level, an event name and fields: 4.3 against 17-18 µs for a ``delivered`` line with 10
    fields; ``bench/log_lines.py``); the daemon writes three such lines a message. An event with anything
    else of the renderer's own columns (a logger name, a stack, an exception, a field named "") goes to
    structlog's."""

    def __init__(self) -> None:
        self.full = structlog.dev.ConsoleRenderer(colors=False)
        # What the renderer pads the level to: the longest of its level names ("exception").
        self.level_width = max(len(k) for k in structlog.dev.ConsoleRenderer.get_default_level_styles(colors=False))

    def __call__(self, logger: Any, name: str, event: dict[str, Any]) -> str:
        if not _OTHER_COLUMNS.isdisjoint(event):
            return self.full(logger, name, event)
        parts: list[str] = []
        ts = event.pop("timestamp", _MISSING)
        if ts is not _MISSING:
            parts.append(str(ts))
        level = event.pop("level", _MISSING)
        if level is not _MISSING:
            parts.append(f"[{str(level).ljust(self.level_width)}]")
        ev = event.pop("event", _MISSING)
        if ev is not _MISSING:
            parts.append(str(ev).ljust(30))
        for key in sorted(event):
            v = event[key]
            if isinstance(v, str):
                parts.append(f"{key}={repr(v) if not _SPECIAL.isdisjoint(v) else v}")
            else:
                parts.append(f"{key}={v!r}")
        return " ".join([p for p in parts if p]).rstrip(" ")


SYSLOG_FACILITY = 2  # LOG_MAIL (RFC 5424 facility 2); logging.handlers is imported only for syslog (30 ms)
_SEVERITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}
_LEVEL_NAME = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "warn": "WARNING", "error": "ERROR",
               "exception": "ERROR", "critical": "CRITICAL"}
_LOGFMT_QUOTE = frozenset(' "=\\')


class SyslogRenderer:
    """An event as the part of an RFC 5424 syslog line after ``<PRI>`` (which the handler adds):
    ``1 TIMESTAMP HOSTNAME mtaq PROCID MSGID - MSG`` (RFC 5424 §6: VERSION 1, the event's UTC timestamp,
    ``socket.gethostname()``, APP-NAME ``mtaq``, the process ID, MSGID the event name, no STRUCTURED-DATA).
    MSG is ``key=value`` pairs separated by one space, ``queue_id`` first (as Postfix's ``QUEUEID:`` prefix)
    then the other keys sorted; a string value with a space, ``"``, ``=`` or ``\\`` (or empty) is written in
    double quotes with ``"`` and ``\\`` escaped by a backslash (logfmt); numbers and booleans as JSON; None
    as ``-``; lists and mappings as JSON text (then quoted as a string). Control characters are escaped
    before (mtaq.core.text, as in every format), so a line is one line. The level becomes the severity of
    PRI (``_syslog_level`` travels to the logger)."""

    def __init__(self) -> None:
        self.host = socket.gethostname() or "-"

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> str:
        level = str(event.pop("level", "info"))
        ts = event.pop("timestamp", "-")
        name = str(event.pop("event", "-"))
        msgid = "".join(c if "!" <= c <= "~" else "_" for c in name)[:32] or "-"  # PRINTUSASCII, 1*32
        parts = []
        qid = event.pop("queue_id", _MISSING)
        if qid is not _MISSING:
            parts.append(f"queue_id={_logfmt(qid)}")
        parts += [f"{k}={_logfmt(event[k])}" for k in sorted(event)]
        line = f"1 {ts} {self.host} mtaq {os.getpid()} {msgid} -"
        if parts:
            line += " " + " ".join(parts)
        return f"{_LEVEL_NAME.get(level, 'INFO')} {line}"


def _logfmt(v: Any) -> str:
    if v is None:
        return "-"
    if type(v) in _NUMBER_TYPES:
        return _dumps(v)
    text = v if isinstance(v, str) else _dumps(v)
    if text and _LOGFMT_QUOTE.isdisjoint(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _SyslogLogger:
    """The structlog logger of ``--log-format syslog``: each rendered line ("LEVEL rest") handed to a
    ``SysLogHandler`` (which adds ``<PRI>`` and sends one datagram), or written to ``stream`` with ``<PRI>`` and
    a newline when there is no syslog socket."""

    def __init__(self, handler: logging.handlers.SysLogHandler | None, stream: Any) -> None:
        self.handler = handler
        self.stream = stream

    def msg(self, line: str) -> None:
        level, _, rest = line.partition(" ")
        if self.handler is None:
            pri = SYSLOG_FACILITY * 8 + {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}[level]
            self.stream.write(f"<{pri}>{rest}\n")  # one write per line, as WriteLogger
            self.stream.flush()
            return
        record = logging.LogRecord("mtaq", getattr(logging, level), "", 0, rest, None, None)
        self.handler.handle(record)

    debug = info = warning = warn = error = critical = exception = fatal = log = failure = err = msg


class _SyslogLoggerFactory:
    def __init__(self, address: str, stream: Any) -> None:
        import logging.handlers

        handler: logging.handlers.SysLogHandler | None = None
        if os.path.exists(address):
            try:
                handler = logging.handlers.SysLogHandler(address, facility=SYSLOG_FACILITY)
            except OSError:  # nobody reads it (a stale socket): stderr, as without one
                handler = None
            else:
                handler.append_nul = False  # RFC 5424 has no NUL terminator
                handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger = _SyslogLogger(handler, stream)

    def __call__(self, *_args: Any) -> _SyslogLogger:
        return self.logger


_NUMBER_TYPES = frozenset((int, float, bool, type(None)))  # exactly these: what a subclass prints is its own


class UtcStamper:
    """structlog's ``TimeStamper(fmt="iso", utc=True)``, the same text (``2026-11-25T01:29:45.162808Z``, and
    ``2026-11-25T01:29:45Z`` on a whole second, as ``datetime.isoformat`` writes it), the same clock (the
    system's, floored to the microsecond, as ``datetime.now``), with the date and time of day formatted
    once a second: about a third of its CPU. ``clock`` gives nanoseconds since the epoch (UTC)."""

    __slots__ = ("_cached", "_clock")

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._cached = (-1, "")  # (second, its text): one object, so a thread never sees one without the other

    def __call__(self, _logger: Any, _name: str, event: Any) -> Any:
        second, us = divmod(self._clock() // 1000, 1_000_000)
        cached = self._cached
        if cached[0] != second:
            cached = self._cached = (second, datetime.datetime.fromtimestamp(second, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S"))
        event["timestamp"] = f"{cached[1]}.{us:06d}Z" if us else f"{cached[1]}Z"
        return event


def _escape_event(_logger: Any, _name: str, event: Any) -> Any:
    """Escape control, format and line-separator characters in every string value (mtaq.core.text): a
    client's HELO name or address can neither drive the terminal showing the log nor forge a line of it,
    in JSON (whose encoder leaves C1 controls, U+2028 and bidi controls raw) as on the console.

    An event of plain strings and numbers (nearly all) is checked with one search over its strings joined;
    only an event with an unsafe character or another kind of value is escaped value by value."""
    strings = []
    for v in event.values():
        t = type(v)
        if t is str:
            strings.append(v)
        elif t not in _NUMBER_TYPES:
            break
    else:
        if is_safe("".join(strings)):
            return event
    for k, v in event.items():
        if not isinstance(v, int | float | bool | None):
            event[k] = escape_value(v)
    return event


# structlog's ExceptionDictTransformer shows each frame's locals by default: never here (issue 32 item 8).
_NO_LOCALS = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)


def _escape_console_event(logger: Any, name: str, event: Any) -> Any:
    """:func:`_escape_event` for the console: the same, except that a traceback's line breaks and tabs are
    kept (it is read on several lines there); its other controls are escaped as everywhere."""
    exc = event.pop("exception", None)
    event = _escape_event(logger, name, event)
    if isinstance(exc, str):
        event["exception"] = escape_text(exc, keep_layout=True)
    return event


LIBRARY_EVENT = "library_log"


class _LibraryRecords(logging.Handler):
    """Python ``logging`` records of every other library (aiosmtpd's ``mail.log``, asyncio, aiohttp,
    aiosmtplib...) as ``library_log`` events of mtaq's own pipeline: ``logger`` (its name), ``message``
    (the formatted text) and ``level``, a traceback as ``exception``; escaped like every other event (a
    client's unknown SMTP command, logged by aiosmtpd, carried ESC, CR, VT and FS raw into the log before:
    issue 32 item 7). Records below WARNING are dropped as before (the root logger's level), so the log
    is no louder than Python's last-resort handler made it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            try:
                message = record.getMessage()
            except Exception:  # a library's bad format string: its parts, never an error of ours
                message = f"{record.msg!r} % {record.args!r}"
            fields: dict[str, Any] = {"logger": record.name, "message": message}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            level = min(max(record.levelno // 10 * 10, logging.DEBUG), logging.CRITICAL)  # structlog knows these
            structlog.get_logger("mtaq").log(level, LIBRARY_EVENT, **fields)
        except Exception:  # pragma: no cover - the stream itself failed; nowhere left to say so
            pass


def _route_library_logging() -> None:
    """Send every ``logging`` record (and ``warnings.warn``, through ``py.warnings``) to :class:`_LibraryRecords`,
    in place of any handler an earlier call installed."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _LibraryRecords)]:
        root.removeHandler(h)
    root.addHandler(_LibraryRecords())
    logging.captureWarnings(True)


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
