"""CPU of three queue runners' cursors walking a log of an earlier run frame by frame (issue 36.1).

Prefills SPOOL with N deferred messages (``mtaq.testing.prefill``; 2 KiB bodies) unless it exists, opens
the log as a new run would (no envelope list: the cursors read frame by frame, checking every DATA frame
they step over through the shared ``Log.confirmed`` cache), and walks three cursors from the oldest segment
to the end in turn, as runners 0..2 do after a restart. Prints one JSON line: ``{"n", "cpu_s", "envelopes",
"confirmed", "type"}`` (CPU seconds of this process for the three walks: a busy machine disturbs it less
than wall time).

    PYTHONPATH=$PWD .venv/bin/python bench/cursor_walk.py /var/tmp/walk-spool 100000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from mtaq.core.frame import SEGMENT_HEADER_BYTES
from mtaq.core.records import Pos
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log
from mtaq.testing.prefill import prefill_deferred


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("spool", help="spool directory (prefilled when it does not exist)")
    ap.add_argument("messages", type=int, help="messages to prefill")
    args = ap.parse_args(argv)
    spool, n = args.spool, args.messages
    if not os.path.exists(spool):
        prefill_deferred(spool, n, lambda i: b"Subject: x\r\n\r\n" + b"x" * 2000 + b"\r\n")
    log, _ = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=64 << 20)
    try:
        first = log.segments()[0]
        t0 = time.process_time()
        envs = 0
        for _k in range(3):
            c = LogCursor(log, Pos(first, SEGMENT_HEADER_BYTES))
            while (f := c.peek_envelope(log.durable_end)) is not None:
                if f is False:
                    continue
                envs += 1
                c.skip()
        out = {"n": n, "cpu_s": round(time.process_time() - t0, 2), "envelopes": envs,
               "confirmed": len(log.confirmed), "type": type(log.confirmed).__name__}
    finally:
        log.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
