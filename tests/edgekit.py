"""A real mtaq SMTP edge for tests, and a raw SMTP client.

:func:`run_edge` starts :func:`mtaq.edge.server.start_server` with the real :class:`QueueHandler` on a real
log in a temporary directory (the real file system, real fsyncs), its event loop in a background thread.
Clients talk to it over loopback sockets: :class:`RawClient` sends bytes exactly as given (for bare CR/LF,
pipelining, STARTTLS injection) and reads whole replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import smtplib
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mtaq.core.records import EnvelopeRecord
from mtaq.core.state import RetryPolicy
from mtaq.edge.policy import EdgePolicy
from mtaq.edge.server import QueueHandler, start_server
from mtaq.queue.store import Queue
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log

HOST = "mx.test"


@dataclass
class Edge:
    """A running edge: its port, and the messages that became durable (envelope, body) in order."""

    port: int
    loop: asyncio.AbstractEventLoop
    queue: Queue
    durable: list[EnvelopeRecord] = field(default_factory=list)

    def client(self, timeout_s: float = 10) -> smtplib.SMTP:
        return smtplib.SMTP("127.0.0.1", self.port, timeout=timeout_s)

    def raw(self) -> RawClient:
        return RawClient(self.port)

    def messages(self) -> list[tuple[EnvelopeRecord, bytes]]:
        """Every durable message with the body as the log holds it."""

        async def read() -> list[tuple[EnvelopeRecord, bytes]]:
            return [(env, self.queue.read_body(env)) for env in self.durable]

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)


@contextlib.contextmanager
def run_edge(tmp_path: Any, policy: EdgePolicy | None = None, *, data_size_limit: int = 1 << 20,
             timeout_s: float = 30, clock_ts: float | None = None,
             milters: tuple[str, ...] | None = None) -> Iterator[Edge]:
    """Serve the edge with ``policy`` on 127.0.0.1 (a free port) until the block ends (``milters``: the
    listener's own smtpd_milters, as start_server takes them)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    log_dir = str(tmp_path / f"log-{len(list(tmp_path.iterdir()))}")

    async def start() -> tuple[asyncio.AbstractServer, Queue]:
        log, _ = Log.open(OsFileSystem(), log_dir, segment_bytes_max=1 << 22)
        kwargs: dict[str, Any] = {} if clock_ts is None else {"clock": lambda: clock_ts}
        queue = Queue(log, policy=RetryPolicy(), **kwargs)
        server = await start_server(QueueHandler(queue), "127.0.0.1", 0, hostname=HOST,
                                    data_size_limit=data_size_limit, timeout_s=timeout_s, policy=policy,
                                    milters=milters)
        return server, queue

    server, queue = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    edge = Edge(server.sockets[0].getsockname()[1], loop, queue)
    queue.on_durable = lambda env, pos: edge.durable.append(env)

    async def stop() -> None:
        server.close()
        await server.wait_closed()

    try:
        yield edge
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class RawClient:
    """One SMTP connection over a plain socket: bytes out exactly as given, whole replies in."""

    def __init__(self, port: int, timeout_s: float = 10) -> None:
        self.sock: socket.socket | ssl.SSLSocket = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.buf = b""

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _line(self) -> bytes | None:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def reply(self) -> str:
        """The next whole reply (lines joined with newlines, e.g. ``"250-a\\n250 b"``); "" at end of stream."""
        lines = []
        while True:
            line = self._line()
            if line is None:
                if lines:
                    raise AssertionError(f"connection closed inside a reply: {lines!r}")
                return ""
            lines.append(line.decode("utf-8", "replace"))
            if len(line) < 4 or line[3:4] != b"-":
                return "\n".join(lines)

    def command(self, line: str | bytes) -> str:
        """Send one command line (CRLF added) and return its reply."""
        self.send((line.encode() if isinstance(line, str) else line) + b"\r\n")
        return self.reply()

    def closed(self) -> bool:
        """Whether the server has closed the connection (reads until end of stream; nothing may be left)."""
        rest = self.buf
        self.buf = b""
        try:
            while chunk := self.sock.recv(65536):
                rest += chunk
        except ConnectionResetError:
            pass
        if rest:
            raise AssertionError(f"more came before the end: {rest!r}")
        return True

    def starttls(self, context: ssl.SSLContext, server_hostname: str = HOST) -> None:
        """Wrap the socket in TLS (after a 220 to STARTTLS); unread plain-text bytes would be lost, so none may
        be buffered."""
        assert self.buf == b"", f"plain text left unread before TLS: {self.buf!r}"
        self.sock = context.wrap_socket(self.sock, server_hostname=server_hostname)


def codes(reply: str) -> tuple[int, str]:
    """``"550 5.5.2 text"`` -> ``(550, "5.5.2")``; the enhanced code is "" when there is none."""
    first = reply.split("\n")[0]
    parts = first.split(" ")
    enhanced = parts[1] if len(parts) > 1 and parts[1][:1].isdigit() and parts[1].count(".") == 2 else ""
    return int(first[:3]), enhanced


def utc_now_ts() -> float:
    return dt.datetime.now(dt.UTC).timestamp()


class EdgeRelay:
    """The real daemon (``mtaq serve`` as a subprocess, ``myhostname = mx.test``) relaying to a real sink."""

    def __init__(self, tmp_path: Any, *flags: str, config: str = "") -> None:
        from mtaq.testing.procs import start_daemon, start_sink

        n = len(list(tmp_path.iterdir()))
        self.dir = tmp_path / f"relay-{n}"
        self.dir.mkdir()
        self.maildir = str(self.dir / "maildir")
        cfg = self.dir / "mtaq.toml"
        cfg.write_text(f'myhostname = "{HOST}"\n' + config)
        self.sink = start_sink(self.maildir, str(self.dir / "sink.log"))
        try:
            self.daemon = start_daemon(str(self.dir / "spool"), self.sink.port, str(self.dir / "daemon.log"),
                                       config=str(cfg), extra=flags)
        except BaseException:
            self.sink.kill9()
            raise
        self.port = self.daemon.port

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        from mtaq.testing.procs import read_events

        return [e for e in read_events(self.daemon.log_path) if name is None or e.get("event") == name]

    def wait_for(self, pred: Any, what: str, timeout_s: float = 20.0) -> Any:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def sink_messages(self) -> list[bytes]:
        """The files the sink stored (Maildir new/), each as bytes, oldest first by name."""
        import os

        d = os.path.join(self.maildir, "new")
        if not os.path.isdir(d):
            return []
        out = []
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out.append(f.read())
        return out

    def close(self) -> None:
        self.daemon.kill9()
        self.sink.kill9()


@contextlib.contextmanager
def edge_relay(tmp_path: Any, *flags: str, config: str = "") -> Iterator[EdgeRelay]:
    r = EdgeRelay(tmp_path, *flags, config=config)
    try:
        yield r
    finally:
        r.close()
