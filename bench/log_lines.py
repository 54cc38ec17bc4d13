"""CPU per console log line: structlog's ``ConsoleRenderer(colors=False)`` against mtaq's ``PlainConsoleRenderer``
(the same text), and one whole event through mtaq's console logging (``configure_logging("console")`` on a
stream that is not a terminal). Prints one JSON object, microseconds per line, best of ``--repeat``.
docs/performance.md, "Fifth round (issue 15)".

    .venv/bin/python bench/log_lines.py --lines 50000
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Callable

import structlog

from mtaq.logs import PlainConsoleRenderer, configure_logging, get_logger

DELIVERED = {"timestamp": "2026-11-25T01:29:45.162808Z", "level": "info", "event": "delivered", "attempt": 1,
             "delay": 0.007, "dsn": "2.0.0", "queue_id": "1K11XFHSD58FQDG", "recipient": "b@example.com",
             "relay": "127.0.0.1[127.0.0.1]:2600", "reply": "250 2.0.0 Ok", "status": "sent", "tls": "none"}


def _best_us(fn: Callable[[], object], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t)
    return round(best / n * 1e6, 2)


class _Stream(io.StringIO):
    def isatty(self) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=50000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if args.lines < 1 or args.repeat < 1:
        ap.error("--lines and --repeat must be >= 1")
    full, fast = structlog.dev.ConsoleRenderer(colors=False), PlainConsoleRenderer()
    assert full(None, "info", dict(DELIVERED)) == fast(None, "info", dict(DELIVERED))
    out = _Stream()
    configure_logging("console", stream=out)
    log = get_logger()

    def event() -> None:
        log.info("queued", queue_id="1K11JVM1Q1K1G2H", sender="a@example.org", size=2300, nrcpt=1,
                 client="127.0.0.1:37224")
        out.seek(0)
        out.truncate()

    print(json.dumps({
        "bench": "log_lines", "lines": args.lines, "repeat": args.repeat,
        "structlog_console_renderer_us": _best_us(lambda: full(None, "info", dict(DELIVERED)), args.lines, args.repeat),
        "mtaq_plain_console_renderer_us": _best_us(lambda: fast(None, "info", dict(DELIVERED)), args.lines, args.repeat),
        "mtaq_console_event_us": _best_us(event, args.lines, args.repeat),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
