"""The console log format is relied on (README): mtaq's fast renderer must write exactly what structlog's
``ConsoleRenderer(colors=False)`` writes, for every event."""

from __future__ import annotations

import io
import time

import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.logs import PlainConsoleRenderer, configure_logging, get_logger

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
