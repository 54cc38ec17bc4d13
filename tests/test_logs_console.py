"""The console log format is relied on (README): mtaq's fast renderer must write exactly what structlog's
``ConsoleRenderer(colors=False)`` writes, for every event."""

from __future__ import annotations

import io
import re
import time

import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.logs import PlainConsoleRenderer, UtcStamper, configure_logging, get_logger

_text = st.text(alphabet=st.sampled_from(list("ab =\t\r\n\"'\\é\x00\u2028Z9.:@[]")), max_size=12)
_values = st.one_of(_text, st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                    st.binary(max_size=6), st.lists(st.integers(), max_size=3), st.tuples(_text, st.integers()))
_keys = st.one_of(st.sampled_from(["timestamp", "event", "queue_id", "a", "z", "reply", "size"]), _text)


@settings(max_examples=3000, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=8), st.sampled_from(["info", "warning", "critical", "debug", "x"]))
def test_the_fast_renderer_writes_what_structlogs_console_renderer_writes(fields, level):
    event = {**fields, "level": level}  # add_log_level always sets a name
    expected = structlog.dev.ConsoleRenderer(colors=False)(None, "info", dict(event))
    assert expected == PlainConsoleRenderer()(None, "info", dict(event))


def test_events_with_the_renderers_other_columns_go_to_structlogs_renderer():
    """A logger name, a stack or an exception: structlog's own renderer (the same text as without mtaq's)."""
    for extra in ({"logger": "mtaq"}, {"logger_name": "x"}, {"stack": "Stack:\n  here"}, {"exception": "Traceback"},
                  {"exc_info": False}):
        event = {"timestamp": "2026-11-25T00:00:00Z", "level": "error", "event": "boom", "a": 1, **extra}
        expected = structlog.dev.ConsoleRenderer(colors=False)(None, "error", dict(event))
        assert expected == PlainConsoleRenderer()(None, "error", dict(event))
    try:
        raise ValueError("bad")
    except ValueError as exc:
        event = {"event": "boom", "level": "error", "exc_info": exc}
        expected = structlog.dev.ConsoleRenderer(colors=False)(None, "error", dict(event))
        assert "ValueError: bad" in expected
        assert expected == PlainConsoleRenderer()(None, "error", dict(event))


def test_the_daemons_console_lines_through_the_configured_pipeline():
    """configure_logging("console") on a stream that is not a terminal uses the fast renderer: one line per
    event, in the documented shape."""

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return False

    out = Stream()
    configure_logging("console", stream=out)
    try:
        get_logger().info("queued", queue_id="1K11JVM1Q1K1G2H", sender="a@example.org", size=2300, nrcpt=1,
                          client="127.0.0.1:37224", reply="250 2.0.0 Ok")
    finally:
        configure_logging("console")
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    stamp, rest = line.rstrip("\n").split(" ", 1)
    time.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ")
    assert rest == ("[info     ] queued                         client=127.0.0.1:37224 nrcpt=1 "
                    "queue_id=1K11JVM1Q1K1G2H reply='250 2.0.0 Ok' sender=a@example.org size=2300")


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.integers(0, 4102444800 * 10**9), st.integers(0, 4102444800).map(lambda s: s * 10**9),
                 st.integers(0, 4102444800 * 10**6).map(lambda us: us * 1000 + 999)))
def test_the_stamper_writes_what_structlogs_iso_utc_stamper_writes(ns):
    """mtaq's UtcStamper against what structlog's ``TimeStamper(fmt="iso", utc=True)`` makes of the same
    instant (``datetime.isoformat`` with ``Z``; a whole second without a fraction), the system clock
    floored to the microsecond as ``datetime.now`` does; once fresh, once right after another second."""
    import datetime

    expected = (datetime.datetime.fromtimestamp(ns // 10**9, datetime.UTC)
                .replace(microsecond=ns // 1000 % 10**6).isoformat().replace("+00:00", "Z"))
    clock = iter([ns - 10**9, ns, ns])
    stamper = UtcStamper(clock=lambda: next(clock))
    stamper(None, "info", {})  # the second before: its prefix cached
    assert expected == stamper(None, "info", {})["timestamp"] == stamper(None, "info", {})["timestamp"]


def test_the_stamper_reads_the_clock_structlog_reads():
    """Against structlog's own stamper, live: the same shape, and an instant between two of ours."""
    import datetime

    theirs = structlog.processors.TimeStamper(fmt="iso", utc=True)
    ours = UtcStamper()
    for _ in range(1000):
        a = ours(None, "info", {})["timestamp"]
        b = theirs(None, "info", {})["timestamp"]
        c = ours(None, "info", {})["timestamp"]
        parse = [datetime.datetime.fromisoformat(x.replace("Z", "+00:00")) for x in (a, b, c)]
        assert parse[0] <= parse[1] <= parse[2]
        assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z", x) for x in (a, b, c))


_unsafe_text = st.text(alphabet=st.sampled_from(list("ab =@.\x00\x1b\x7f\x85\x9b\u200b\u2028\u202e\ufeff\U000e0001é\t\n")),
                       max_size=10)
_event_values = st.one_of(_unsafe_text, st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                          st.lists(_unsafe_text, max_size=3), st.tuples(_unsafe_text, st.integers()),
                          st.dictionaries(_text, _unsafe_text, max_size=2), st.binary(max_size=4))


@settings(max_examples=3000, deadline=None)
@given(st.dictionaries(_keys, _event_values, max_size=10))
def test_every_string_of_an_event_is_escaped_as_escape_value_escapes_it(fields):
    """The log's escaping (one search over an event's strings joined, value by value only when needed) gives
    every value what :func:`mtaq.core.text.escape_value` gives it: controls, C1, bidi and line separators
    escaped in strings at any depth, numbers and bytes as they were."""
    from mtaq.core.text import escape_value
    from mtaq.logs import _escape_event

    assert {k: escape_value(v) for k, v in fields.items()} == _escape_event(None, "info", dict(fields))
