"""Queue runners (first version): which message to attempt next.

One queue for new mail (FIFO, due at once) and one for deferred mail (a heap by due time). Delivery workers
take from them alternately when both have work, so deferred mail never starves new mail and the other way
round (Postfix alternates the incoming and deferred queues; seed 001 postscript). The full design - one
runner per retry interval scanning the log, with checkpoints - is the runners issue; this keeps its interface
(``add``/``get``) so the workers need not change.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable

__all__ = ["Scheduler"]


class Scheduler:
    """Hands out queue IDs that are due. ``clock`` returns UTC seconds."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._new: deque[str] = deque()
        self._deferred: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._prefer_deferred = False

    def add(self, queue_id: str, due_ts: float, *, incoming: bool) -> None:
        """Schedule ``queue_id``: new mail goes to the incoming FIFO, the rest by ``due_ts``."""
        if incoming and due_ts <= self.clock():
            self._new.append(queue_id)
        else:
            heapq.heappush(self._deferred, (due_ts, next(self._seq), queue_id))
        self._wakeup.set()

    def __len__(self) -> int:
        return len(self._new) + len(self._deferred)

    def _take(self) -> str | None:
        due = bool(self._deferred) and self._deferred[0][0] <= self.clock()
        if due and (self._prefer_deferred or not self._new):
            self._prefer_deferred = False
            return heapq.heappop(self._deferred)[2]
        if self._new:
            self._prefer_deferred = True
            return self._new.popleft()
        return None

    async def get(self) -> str:
        """Wait for the next due queue ID."""
        while True:
            qid = self._take()
            if qid is not None:
                return qid
            timeout = max(0.0, self._deferred[0][0] - self.clock()) if self._deferred else None
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass
