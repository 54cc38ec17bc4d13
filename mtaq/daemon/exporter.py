"""The event exporter: delivery events read from the log and POSTed to HTTP endpoints (issue 37.1, 37.2).

Each endpoint of ``event_webhooks`` has its own reader of the queue log (a :class:`~mtaq.storage.cursor.
LogCursor`, like a queue runner's) and its own position, so that one slow or dead endpoint never holds up
another, nor the 250s or the deliveries (nothing on those paths waits for an exporter). Events are derived
from the records already in the log (:mod:`mtaq.core.events`); nothing is written for them.

Positions: ``acked`` is just past the last record whose events the endpoint acknowledged (2xx) or that gave
none; ``restart`` is ``acked`` or, when an attempt the reader saw start is not yet concluded before it, that
attempt's START (so that a restarted reader knows the attempt's envelope); both are kept in the checkpoint
(``Checkpoint.exporters``). After a restart the reader reads from ``restart`` and sends only the events of
records at or after ``acked``: delivery is at least once (a batch in flight at a crash is sent again), never
lost. Reclamation keeps every segment from the earliest ``restart`` on, and the segment of every envelope a
START after it names (:meth:`Exporter.pin`), unless an endpoint lags by more than
``event_backlog_max_bytes`` of log: it then skips to the log's durable end, logs ``event_backlog_skipped``
and counts it (its events in between are lost to it, as a bounded spool must).

HTTP (aiohttp client): ``POST url`` with ``Content-Type: application/json`` and the body
``{"schema": 1, "events": [...]}``, ``X-Mtaq-Signature: sha256=HEX`` where HEX is the lower-case hex
HMAC-SHA256 of the exact body bytes under the endpoint's ``secret``. 2xx: acknowledged. 5xx, 408, 429, a
timeout or a connection error (TLS verification failures included): retried after ``retry_min_s``, doubling
up to ``retry_max_s``. Other 4xx: logged (``event_batch_rejected``) and skipped. Batches of one endpoint go
out one at a time, in log order, so the events of a message arrive in order.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from mtaq.config import EventWebhook
from mtaq.core.errors import CorruptRecord, StorageError
from mtaq.core.events import EventDeriver
from mtaq.core.records import Pos, RecordType
from mtaq.storage.cursor import LogCursor
from mtaq.storage.log import Log

__all__ = ["SIGNATURE_HEADER", "Endpoint", "Exporter", "backlog_bytes", "sign"]

SIGNATURE_HEADER = "X-Mtaq-Signature"
SAMPLES_MAX = 100_000  # (durable end, records appended, time) samples kept for the lag metrics
_WANT = frozenset({RecordType.ENVELOPE, RecordType.START, RecordType.DELIVERY, RecordType.FINISH})
_RETRY_4XX = frozenset({408, 429})


def sign(secret: str, body: bytes) -> str:
    """The ``X-Mtaq-Signature`` value of ``body``: ``sha256=`` and the hex HMAC-SHA256 under ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def backlog_bytes(log: Log, a: Pos, b: Pos) -> int:
    """Bytes of log from ``a`` to ``b`` (0 when ``a`` >= ``b``), across segments; reclaimed ones count 0."""
    if a >= b:
        return 0
    if a.segment == b.segment:
        return b.offset - a.offset
    total = 0
    for n in log.segments():
        if n < a.segment or n > b.segment:
            continue
        try:
            size = log.segment_size(n)
        except OSError:
            continue
        total += (size - a.offset) if n == a.segment else (b.offset if n == b.segment else size)
    return max(total, 0)


@dataclass
class EndpointStats:
    """Counters of one endpoint since the process started."""

    batches_delivered: int = 0
    batches_failed: int = 0  # refused with a 4xx and skipped
    batches_retried: int = 0  # tries that failed and were retried
    events_sent: int = 0
    backlog_skips: int = 0
    backlog_skipped_bytes: int = 0


class Endpoint:
    """One webhook: its reader, its positions, its batches."""

    def __init__(self, hub: Exporter, spec: EventWebhook, restart: Pos, acked: Pos) -> None:
        self.hub = hub
        self.spec = spec
        self.name = spec.url
        self.restart = restart
        self.acked = acked
        self._resume = acked  # events of records before this were acknowledged before the restart
        self.wanted = frozenset(spec.events)
        self.stats = EndpointStats()
        self.deriver = EventDeriver(hub.log.read, hub.category)
        self.cursor = LogCursor(hub.log, restart)
        self.pending: list[tuple[dict[str, Any], Pos | None]] = []  # (event, end of its record if its last)

    def _note_positions(self) -> None:
        oldest = self.deriver.earliest_open()
        self.restart = min(self.acked, oldest) if oldest is not None else self.acked

    def _skip_if_behind(self) -> bool:
        """Skip to the durable end when more than ``event_backlog_max_bytes`` lie unacknowledged; True if so."""
        log = self.hub.log
        end = log.durable_end
        behind = backlog_bytes(log, self.acked, end)
        if behind <= self.hub.backlog_max_bytes:
            return False
        self.stats.backlog_skips += 1
        self.stats.backlog_skipped_bytes += behind
        self.hub.logger.error("event_backlog_skipped", endpoint=self.name, bytes=behind, acked=str(self.acked),
                              skipped_to=str(end), limit=self.hub.backlog_max_bytes,
                              action="events of the records in between are not sent to this endpoint")
        self.pending.clear()
        self.deriver.open.clear()
        self.cursor = LogCursor(log, end)
        self.acked = self.restart = self._resume = end
        return True

    def _read(self) -> bool:
        """Read records into ``pending`` up to ``batch_max`` events or the durable end; True when records are
        left to read (the caller yields to the event loop and calls again)."""
        end = self.hub.log.durable_end
        more = False
        while len(self.pending) < self.spec.batch_max:
            found = self.cursor.peek(end, _WANT.__contains__, max_frames=4096)
            if found is False:
                more = True
                break
            if found is None:
                break
            pos, rec = found
            try:
                self.cursor.skip()
            except CorruptRecord:
                break  # the record was just read whole: only a race with reclamation; read again later
            events = self.deriver.feed(pos, rec)
            if pos < self._resume:
                continue  # acknowledged before the restart; read again only to know the open attempts
            events = [e for e in events if e["event"] in self.wanted]
            if events:
                self.pending += [(e, None) for e in events[:-1]]
                self.pending.append((events[-1], self.cursor.pos))
        if not self.pending and self.cursor.pos > self.acked:
            self.acked = self.cursor.pos
        self._note_positions()
        return more or (len(self.pending) >= self.spec.batch_max and self.cursor.pos < end)

    async def run(self) -> None:
        """Read, batch, POST, forever (cancelled with the daemon). A read error (EIO) is logged and retried."""
        ctx = self.hub.tls.get(self.name) or ssl.create_default_context(cafile=self.spec.ca_file or None)
        connector = aiohttp.TCPConnector(ssl=ctx, limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            while True:
                try:
                    await self._once(session)
                except (StorageError, FileNotFoundError) as exc:
                    self.hub.logger.error("event_read_failed", endpoint=self.name, position=str(self.cursor.pos),
                                          error=str(exc), action="tried again in 1 s")
                    await asyncio.sleep(1.0)
                except Exception as exc:
                    # Never the mail's problem: this endpoint starts again from its positions, as after a restart.
                    self.hub.logger.exception("event_exporter_failed", endpoint=self.name, error=str(exc),
                                              action="read again from the last acknowledged position in 1 s")
                    self.pending.clear()
                    self.deriver.open.clear()
                    self.cursor = LogCursor(self.hub.log, self.restart)
                    self._resume = self.acked
                    await asyncio.sleep(1.0)

    async def _once(self, session: aiohttp.ClientSession) -> None:
        self._skip_if_behind()
        more = self._read()
        if not self.pending:
            if more:
                await asyncio.sleep(0)
            else:
                await self.hub.log.durable_advanced()
            return
        deadline = time.monotonic() + self.spec.batch_wait_s
        while len(self.pending) < self.spec.batch_max:
            if more:
                await asyncio.sleep(0)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self.hub.log.durable_advanced(), left)
                except TimeoutError:
                    break
            more = self._read()
        await self._send(session)

    async def _send(self, session: aiohttp.ClientSession) -> None:
        n = min(len(self.pending), self.spec.batch_max)
        batch = self.pending[:n]
        body = json.dumps({"schema": 1, "events": [e for e, _ in batch]}, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"}
        if self.spec.secret:
            headers[SIGNATURE_HEADER] = sign(self.spec.secret, body)
        delay = self.spec.retry_min_s
        timeout = aiohttp.ClientTimeout(total=self.spec.timeout_s)
        log = self.hub.logger
        while True:
            why = ""
            try:
                async with session.post(self.spec.url, data=body, headers=headers, timeout=timeout) as resp:
                    status = resp.status
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                status, why = 0, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if 200 <= status < 300:
                self.stats.batches_delivered += 1
                self.stats.events_sent += n
                break
            if 400 <= status < 500 and status not in _RETRY_4XX:
                self.stats.batches_failed += 1
                log.warning("event_batch_rejected", endpoint=self.name, status=status, events=n,
                            first=batch[0][0]["id"], action="skipped")
                break
            self.stats.batches_retried += 1
            log.warning("event_batch_failed", endpoint=self.name, status=status or None, error=why or None,
                        events=n, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.spec.retry_max_s)
            if self._skip_if_behind():
                return
        del self.pending[:n]
        after = next((a for _, a in reversed(batch) if a is not None), None)
        if not self.pending:
            after = self.cursor.pos
        if after is not None and after > self.acked:
            self.acked = after
        self._note_positions()


class Exporter:
    """Every endpoint of one daemon, the reclamation pin and the lag samples.

    ``positions``: URL -> (restart, acknowledged) from the checkpoint; endpoints it does not name start at
    ``new_at``. ``pin``: the checkpoint's ``exporter_pin``, held until every restart position passes
    ``pin_head`` (the checkpoint's head). ``category``: a reply's bounce category. ``tls``: URL -> the SSL
    context for it (default: one made from its ``ca_file``).
    """

    def __init__(self, log: Log, specs: list[EventWebhook], positions: dict[str, tuple[Pos, Pos]], new_at: Pos,
                 *, backlog_max_bytes: int, category: Callable[[int, str, str], str], logger: Any,
                 pin: Pos | None = None, pin_head: Pos | None = None,
                 tls: dict[str, ssl.SSLContext] | None = None) -> None:
        self.log = log
        self.category = category
        self.logger = logger
        self.backlog_max_bytes = backlog_max_bytes
        self.tls = tls or {}  # URL -> the context verifying its certificate (made before privileges drop)
        self.endpoints = [Endpoint(self, s, *positions.get(s.url, (new_at, new_at))) for s in specs]
        # (START, its envelope) for STARTs not yet passed by every restart position, envelopes increasing
        # (a sliding-window minimum): the first envelope is the oldest any reader may still have to read.
        self._window: collections.deque[tuple[Pos, Pos]] = collections.deque()
        if pin is not None and pin_head is not None:
            self._window.append((pin_head, pin))
        self._samples: collections.deque[tuple[Pos, int, float]] = collections.deque()
        self._t0 = time.monotonic()

    def on_start(self, start: Pos, envelope: Pos) -> None:
        """A START at ``start`` naming ``envelope`` was appended (Queue.on_start)."""
        w = self._window
        while w and w[-1][1] >= envelope:
            w.pop()
        w.append((start, envelope))

    def _restart_min(self) -> Pos | None:
        return min((e.restart for e in self.endpoints), default=None)

    def window_pin(self) -> Pos | None:
        """The oldest envelope named by a START at or after the earliest restart position (None: none)."""
        low = self._restart_min()
        w = self._window
        while w and low is not None and w[0][0] < low:
            w.popleft()
        return w[0][1] if w else None

    def pin(self) -> Pos | None:
        """Where reclamation must stop for the exporters (None: nothing to keep)."""
        low = self._restart_min()
        wp = self.window_pin()
        return min(p for p in (low, wp) if p is not None) if (low is not None or wp is not None) else None

    def positions(self) -> tuple[tuple[str, Pos, Pos], ...]:
        """For the checkpoint: (URL, restart, acknowledged) of each endpoint."""
        return tuple((e.name, e.restart, e.acked) for e in self.endpoints)

    def lag(self, e: Endpoint) -> tuple[int, float]:
        """(records, seconds) the endpoint's acknowledged position is behind the durable end, from the samples
        of this run (records of earlier runs still unacknowledged count from the start of this one)."""
        end = self.log.durable_end
        if e.acked >= end:
            return 0, 0.0
        base = None
        first_after = None
        for pos, records, t in self._samples:
            if pos <= e.acked:
                base = records
            elif first_after is None:
                first_after = t
                break
        records_now = self.log.stats.records_appended
        return max(0, records_now - (base or 0)), max(0.0, time.monotonic() - (first_after or self._t0))

    async def _sample(self) -> None:
        while True:
            await self.log.durable_advanced()
            s = self._samples
            s.append((self.log.durable_end, self.log.stats.records_appended, time.monotonic()))
            low = min((e.acked for e in self.endpoints), default=None)
            while len(s) > 1 and low is not None and s[1][0] <= low:
                s.popleft()
            while len(s) > SAMPLES_MAX:
                s.popleft()

    async def run(self) -> None:
        """Run every endpoint and the sampler (forever)."""
        await asyncio.gather(self._sample(), *(e.run() for e in self.endpoints))

    def metrics(self) -> list[tuple[str, int, float, EndpointStats]]:
        """(endpoint, lag records, lag seconds, counters) for /metrics."""
        return [(e.name, *self.lag(e), e.stats) for e in self.endpoints]

