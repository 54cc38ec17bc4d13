"""The queue runners' shared caches of checked frames and decoded records (``Log.confirmed``,
``Log.decoded``) evict their oldest entry in constant time (issue 36.1).

They were plain dicts trimmed with ``del d[next(iter(d))]``: CPython leaves a deleted slot at the front of
a dict's entry table until the next resize, and ``next(iter(d))`` walks all of them, so each eviction cost
O(entries evicted since the last resize), about 90 us a frame once ``CONFIRMED_MAX`` (65,536) frames had
been checked: draining a 100,000-message backlog (several frames a message) slowed down as it went.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict

import mtaq.storage.cursor as cursor_mod
from mtaq.core.frame import SEGMENT_HEADER_BYTES
from mtaq.core.records import FinishRecord, Pos, RecordType
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log


def test_a_cursor_keeps_the_newest_checked_frames_and_evicts_the_oldest_in_constant_time(tmp_path, monkeypatch):
    """A log of an earlier run (read frame by frame) with 200 FINISH frames and no envelope; a cursor with
    ``CONFIRMED_MAX`` 64 walks it to the end: the cache holds exactly the last 64 frames it checked (the
    segment's SEAL the last), oldest first, in an OrderedDict (whose ``popitem(last=False)`` is O(1), unlike a dict's ``next(iter(d))``)."""
    monkeypatch.setattr(cursor_mod, "CONFIRMED_MAX", 64)
    log_dir = os.path.join(tmp_path, "log")
    log, _ = Log.open(OsFileSystem(), log_dir, segment_bytes_max=1 << 22)
    for i in range(200):
        log.append(FinishRecord(queue_id=f"Q{i:05d}", start=Pos(1, SEGMENT_HEADER_BYTES), ts=0.0))
    asyncio.run(log.sync())
    log.close()
    log, _ = Log.open(OsFileSystem(), log_dir, segment_bytes_max=1 << 22)  # a new run: no envelope list
    try:
        frames = []
        c = LogCursor(log, Pos(1, SEGMENT_HEADER_BYTES))
        while (found := c.peek(log.durable_end, lambda rtype: True)) is not None:
            assert found is not False
            frames.append(found[0])
            c.skip()
        assert 200 == len(frames)
        log.decoded.clear()
        c = LogCursor(log, Pos(1, SEGMENT_HEADER_BYTES))
        assert c.peek_envelope(log.durable_end) is None
        # the last checked is the SEAL the second start wrote: a cursor checks a SEAL before it trusts it
        *checked, seal = list(log.confirmed)
        assert (OrderedDict, frames[-63:]) == (type(log.confirmed), checked)
        assert seal.offset > frames[-1].offset and log.read_segment(1)[seal.offset + 2] == RecordType.SEAL
        assert OrderedDict is type(log.decoded)
    finally:
        log.close()
