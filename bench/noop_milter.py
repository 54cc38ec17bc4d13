"""A no-op milter for benchmarks: the filter side of the Sendmail milter protocol (version 6), answering
*continue* to every stage and *accept* at end of message, changing nothing.

It is the same filter in front of Postfix (``smtpd_milters``) and mtaq, so that ``compare_postfix.py
--milter`` measures the cost of a filter in the path on both sides alike. ``--mode full`` (the default)
asks for every stage (connect, HELO, MAIL, RCPT, each header, end of headers, the body) and replies to
each, as a scanner that reads the whole message does; ``--mode eom`` asks the MTA to skip every stage but
the end of message (protocol flags ``SMFIP_NO*``), the cheapest filter there is.

Protocol (libmilter's ``mfdef.h``, Postfix's MILTER_README): each packet is a 4-byte big-endian length,
then a one-byte command and its data. The MTA opens with ``O`` (version, actions, protocol flags); the
filter answers ``O`` with the version, the actions it may take (none here) and the stages it skips.
``D`` (macros) and ``A`` (abort) get no reply; ``Q`` ends the connection; ``K`` (quit, new connection)
starts the next message on the same connection.

    .venv/bin/python bench/noop_milter.py --port 8891 [--mode full|eom]

Prints one line ``noop_milter: listening on 127.0.0.1:PORT`` when ready; on SIGTERM, one line
``noop_milter: connections=N messages=M`` (M: end-of-message commands answered), and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import struct

SMFI_VERSION = 6
SKIP_ALL_BUT_EOM = (0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x100 | 0x200)  # SMFIP_NOCONNECT .. NODATA
REPLY_CONTINUE = b"c"
REPLY_ACCEPT = b"a"
NO_REPLY = {b"D", b"A"}
COUNTS = {"connections": 0, "messages": 0}  # messages: end-of-message commands answered


def packet(cmd: bytes, data: bytes = b"") -> bytes:
    """One milter packet: length (command byte included, big-endian u32), command, data."""
    return struct.pack(">I", len(data) + 1) + cmd + data


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mode: str) -> None:
    COUNTS["connections"] += 1
    try:
        while True:
            head = await reader.readexactly(4)
            (n,) = struct.unpack(">I", head)
            body = await reader.readexactly(n)
            cmd, data = body[:1], body[1:]
            if cmd == b"O":
                _version, _actions, offered = struct.unpack(">III", data[:12])
                skip = SKIP_ALL_BUT_EOM & offered if mode == "eom" else 0
                writer.write(packet(b"O", struct.pack(">III", SMFI_VERSION, 0, skip)))
            elif cmd == b"Q":
                break
            elif cmd in NO_REPLY or cmd == b"K":
                continue
            elif cmd == b"E":
                COUNTS["messages"] += 1
                writer.write(packet(REPLY_ACCEPT))
            else:
                writer.write(packet(REPLY_CONTINUE))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main_async(host: str, port: int, mode: str) -> None:
    server = await asyncio.start_server(lambda r, w: serve(r, w, mode), host, port)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"noop_milter: listening on {host}:{port}", flush=True)
    async with server:
        await stop.wait()
    print(f"noop_milter: connections={COUNTS['connections']} messages={COUNTS['messages']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=("full", "eom"), default="full")
    a = ap.parse_args()
    asyncio.run(main_async(a.host, a.port, a.mode))


if __name__ == "__main__":
    main()
