"""A real HTTP receiver of delivery events (aiohttp server in a thread), for tests and bench/crash.py.

It records every POST (body, headers, the status it answered), and can be told to answer a status, to hang
(never answer until released) or to be down (connections refused). Nothing is mocked: the daemon's exporter
talks to it over a real socket, with TLS when given an ``ssl.SSLContext``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["Post", "Receiver"]


@dataclass
class Post:
    """One request as received: the raw body, the headers, the status answered."""

    body: bytes
    headers: dict[str, str]
    status: int

    def events(self) -> list[dict[str, Any]]:
        return list(json.loads(self.body)["events"])

    def signed_by(self, secret: str) -> bool:
        """True when ``X-Mtaq-Signature`` is ``sha256=`` + the hex HMAC-SHA256 of the body under ``secret``."""
        want = "sha256=" + hmac.new(secret.encode(), self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, self.headers.get("X-Mtaq-Signature", ""))


@dataclass
class Receiver:
    """``start()`` listens on 127.0.0.1 (a free port); ``url`` is where to POST."""

    ssl_context: ssl.SSLContext | None = None
    status: int = 200  # answered to each POST
    statuses: list[int] = field(default_factory=list)  # answered first, one per POST, before ``status``
    hang: bool = False  # when True, POSTs wait until it is False again (then answer)
    delay_s: float = 0.0  # each POST is answered this long after its body arrived
    posts: list[Post] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}/events"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        while self.hang:
            await asyncio.sleep(0.02)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        with self._lock:
            status = self.statuses.pop(0) if self.statuses else self.status
            self.posts.append(Post(body, dict(request.headers), status))
        return web.Response(status=status, text="ok")

    def start(self) -> Receiver:
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/events", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            self.port = int(sock.getsockname()[1])
            site = web.SockSite(self._runner, sock, ssl_context=self.ssl_context)
            loop.run_until_complete(site.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        """Stop listening (connections are refused from now on); ``start()`` listens again on the same port."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def ok_posts(self) -> list[Post]:
        with self._lock:
            return [p for p in self.posts if 200 <= p.status < 300]

    def events(self) -> list[dict[str, Any]]:
        """Every event of every acknowledged POST, in the order received (duplicates kept)."""
        return [e for p in self.ok_posts() for e in p.events()]
