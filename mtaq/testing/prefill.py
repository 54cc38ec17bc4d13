"""Fill a spool's log with deferred mail directly, without SMTP (for bench/ scripts that need a big queue).

The records are the daemon's own (DATA, then a generation-1 ENVELOPE of runner 1 with one attempt behind
it), appended through :class:`Log` and made durable with one fsync at the end, so the daemon started on the
spool afterwards recovers them like any queue it wrote itself.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from mtaq.core.records import DataRecord, EnvelopeRecord, Pos, Recipient
from mtaq.queue.store import new_queue_id, set_queue_id_shard
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log
from mtaq.storage.shards import shard_dir

__all__ = ["prefill_deferred", "prefill_shards"]


def prefill_deferred(
    spool: str,
    n: int,
    body_of: Callable[[int], bytes],
    *,
    sender_of: Callable[[int], str] = lambda i: "bench@example.com",
    age_s: float = 0.0,
    due_in_s: float = 86400.0,
    segment_bytes_max: int = 64 << 20,
) -> Pos:
    """Append ``n`` deferred messages to ``SPOOL/log``; return the log's end after the closing fsync.

    Message ``i`` has the content ``body_of(i)`` (bytes, CRLF lines), the sender ``sender_of(i)`` and one
    recipient ``deferred{i}@example.org``; it arrived ``age_s`` seconds ago and is due ``due_in_s`` seconds
    from now (UTC clock). Raises StorageError when the disk refuses.
    """
    log, _report = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=segment_bytes_max)
    try:
        now = time.time()
        for i in range(n):
            qid = new_queue_id()
            body = body_of(i)
            data_pos, _ = log.append(DataRecord(queue_id=qid, body=body))
            log.append(EnvelopeRecord(
                queue_id=qid, generation=1, arrival_ts=now - age_s, not_before_ts=now + due_in_s,
                sender=sender_of(i), recipients=(Recipient(0, f"deferred{i}@example.org"),),
                data=data_pos, size=len(body), attempts=1, runner=1,
            ))
        asyncio.run(log.sync())
        return log.end
    finally:
        log.close()


def prefill_shards(spool: str, n: int, body_of: Callable[[int], bytes], workers: int, **kwargs: Any) -> None:
    """:func:`prefill_deferred` over the shards of a spool run by ``workers`` worker processes, as mail
    received by SMTP spreads over them: shard k (``SPOOL`` itself for 0, ``SPOOL/shard-k`` otherwise) gets
    every ``workers``-th message, with queue IDs of shard k (:func:`set_queue_id_shard`). ``kwargs`` go to
    :func:`prefill_deferred`. With one worker, the IDs carry no shard (as a one-worker daemon makes them)."""
    try:
        for k in range(workers):
            d = shard_dir(spool, k)
            os.makedirs(d, exist_ok=True)
            if workers > 1:
                set_queue_id_shard(k)
            count = n // workers + (1 if k < n % workers else 0)
            prefill_deferred(d, count, _nth(body_of, workers, k), **kwargs)
    finally:
        set_queue_id_shard(None)  # back to IDs of no shard for whatever this process does next


def _nth(body_of: Callable[[int], bytes], step: int, first: int) -> Callable[[int], bytes]:
    return lambda i: body_of(i * step + first)
