"""A plain aiosmtpd server under uvloop that answers 250 to DATA and queues nothing: the floor of a receive
path on aiosmtpd, to measure beside ``mtaq serve`` with ``bench/session_steps.py --cpu-pid`` (docs/performance.md,
"Fifth round (issue 15)"). Runs until killed.

    .venv/bin/python bench/plain_smtpd.py --port 2540 &
    .venv/bin/python bench/session_steps.py --port 2540 --cpu-pid $!
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import uvloop
from aiosmtpd.smtp import SMTP


class Handler:
    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        return "250 2.0.0 Ok: discarded"


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SMTP(Handler(), hostname="plain.example"), host, port)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=2540)
    args = ap.parse_args(argv)
    try:
        uvloop.run(serve(args.host, args.port))
    except OSError as exc:
        print(f"plain_smtpd: listen {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
