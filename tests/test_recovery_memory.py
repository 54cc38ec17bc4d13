"""Recovery without a checkpoint keeps memory flat however long the log (issue 36.3): past
``RECORDS_KEPT_MAX`` decoded records, a segment is read again in the second pass instead of held."""

from __future__ import annotations

import asyncio
import os
import shutil
import tracemalloc

import structlog

from mtaq.core.parking import QueueCounts
from mtaq.core.state import RetryPolicy
from mtaq.queue import recovery
from mtaq.queue.store import Queue
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log
from mtaq.testing.prefill import prefill_deferred

LOG = structlog.get_logger("test")
N = 1500


def _recover(spool: str) -> tuple[recovery.RecoveryResult, QueueCounts, int]:
    """A start on ``spool``: the recovery result, the queue's counts, and the peak bytes Python allocated
    during the recovery (tracemalloc)."""
    log, report = Log.open(OsFileSystem(), os.path.join(spool, "log"), segment_bytes_max=16 << 10)
    try:
        q = Queue(log, policy=RetryPolicy(intervals_s=(60.0, 600.0)), clock=lambda: 1000.0, reporting_mta="mx.test")
        tracemalloc.start()
        try:
            res = asyncio.run(recovery.recover(q, report, spool, LOG))
            _cur, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return res, q.counts, peak
    finally:
        log.close()


def test_a_full_scan_past_the_budget_reads_segments_again_and_finds_the_same(tmp_path, monkeypatch):
    """N deferred messages over many segments, no checkpoint: with a budget of 100 records the recovery
    finds what it finds with every record kept (records read, counts, runner positions), while its peak
    allocation stays under half the unbounded one (which holds all N envelopes at once)."""
    spools = [str(tmp_path / "kept"), str(tmp_path / "bounded")]
    os.makedirs(spools[0])
    prefill_deferred(spools[0], N, lambda i: b"Subject: x\r\n\r\nbody\r\n", segment_bytes_max=16 << 10)
    shutil.copytree(spools[0], spools[1])
    monkeypatch.setattr(recovery, "RECORDS_KEPT_MAX", 10 * N, raising=False)
    full, full_counts, full_peak = _recover(spools[0])
    monkeypatch.setattr(recovery, "RECORDS_KEPT_MAX", 100, raising=False)
    bounded, bounded_counts, bounded_peak = _recover(spools[1])
    assert full.segments > 4
    assert (full.records, full.segments, full.runners, full.concluded, full.corrupt, full.holes) == (
        bounded.records, bounded.segments, bounded.runners, bounded.concluded, bounded.corrupt, bounded.holes)
    assert N <= full.records  # and a SEAL a segment
    assert full_counts.by_state == bounded_counts.by_state
    assert bounded.bytes > full.bytes  # the segments past the budget were read twice
    assert bounded_peak * 2 < full_peak, (bounded_peak, full_peak)
