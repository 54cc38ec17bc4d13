"""A durable baseline at every start (GUIDE I7, issue 31.1): a restart after kill -9 trusts nothing that is
only in the page cache.

kill -9 keeps the dying run's unsynced writes in the page cache, so the next run reads them back. If that
run acts on them (concludes attempts, checkpoints past them, stamps "everything before my segment is
durable") without making them durable first, a power cut one run later takes them, and with them what the
checkpoint already skipped. The sequences here are the review's: run 1 concludes a deferred attempt (DATA
copy and replacement, book-keeping, not fsync'd), a roll-over seals that segment, kill -9; run 2 recovers and
checkpoints as the daemon does; the power cut drops whatever was never fsync'd; run 3 must still offer the
message. Real Log, Queue and recovery on the crash file system (mtaq.testing.crashfs), where a "kill -9" is
a Log abandoned without a crash (its writes stay unsynced) and a power cut is ``crash(mode="drop")``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.records import EnvelopeRecord, Outcome, Pos, StartRecord
from mtaq.core.state import RetryPolicy
from mtaq.queue.recovery import RecoveryResult, recover
from mtaq.queue.store import Queue
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.log import Log, scan_log
from mtaq.testing.crashfs import CrashFileSystem

SPOOL = "/spool"
LOG_DIR = "/spool/log"
BODY = b"Subject: precious\r\nMessage-ID: <p@t>\r\n\r\n" + b"acknowledged mail\r\n" * 50  # ~1 KB


class _Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def start(fs: CrashFileSystem) -> tuple[Queue, RecoveryResult]:
    """The only start there is: open the log, recover, and write the checkpoint the daemon writes right after
    recovery (Daemon.run -> Daemon.checkpoint: positions, fsync of the log, checkpoint file)."""
    log, report = Log.open(fs, LOG_DIR, segment_bytes_max=4096)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    res = asyncio.run(recover(q, report, SPOOL, _Quiet()))
    head = log.end
    cp = Checkpoint(head=head, suffix=q.working.earliest_start() or head, runners=tuple(res.runners),
                    garbage=tuple(tuple(sorted(g)) for g in res.garbage), written_ts=1000.0,
                    parked=tuple(sorted(q.parked.entries)), counts=q.counts.snapshot())
    asyncio.run(log.sync())
    write_checkpoint(fs, SPOOL, cp)
    return q, res


def offered(fs: CrashFileSystem, res: RecoveryResult, queue_id: str) -> list[Pos]:
    """Live envelopes of ``queue_id`` that a runner will offer (at or after its position, not in its garbage)."""
    recs = [(p, r) for s in scan_log(fs, LOG_DIR) for p, r in s.records]
    started = {r.envelope for _, r in recs if isinstance(r, StartRecord)}
    out = []
    for p, r in recs:
        if isinstance(r, EnvelopeRecord) and r.queue_id == queue_id and p not in started:
            k = min(r.runner, len(res.runners) - 1)
            if p >= res.runners[k] and p not in res.garbage[k]:
                out.append(p)
    return out


def test_a_power_cut_one_run_after_a_kill_loses_no_deferred_message() -> None:
    """Run 1: M acknowledged, its attempt deferred (451) and concluded with a DATA copy and a replacement
    (not fsync'd), then a roll-over seals that segment; kill -9. Run 2 recovers (the replacement is read
    from the page cache) and checkpoints past the attempt. A power cut drops every write never fsync'd.
    Run 3 offers M exactly once: run 2 made the sealed segment durable before it trusted it. Before the
    fix, run 2 fsync'd only the newest segment; the cut took the replacement, the SEAL and the START, and
    the checkpoint had already put M's original envelope in the runner's garbage: M was never offered."""
    fs = CrashFileSystem()
    q, _ = start(fs)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))  # the 250
    (pos,) = offered(fs, RecoveryResult(runners=[Pos(0, 0)], garbage=[set()]), env.queue_id)
    attempt = q.start(pos, env)
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [Outcome(0, "deferred", 451, "4.3.0", "later")]))
    q.log.sync_soon = lambda: None  # type: ignore[method-assign]  # the kill comes before that fsync
    q.conclude(attempt)
    segment = q.log.current_segment
    q._append_message("carol@example.org", ["dave@example.net"], BODY * 3)  # being received: rolls over
    assert q.log.current_segment == segment + 1  # the concluded attempt's segment is sealed
    # kill -9: the Log is abandoned; its writes stay in the (simulated) page cache, unsynced.
    _q2, _ = start(fs)
    fs.crash(random.Random(0), mode="drop")  # the power cut, one run later
    _q3, res3 = start(fs)
    assert 1 == len(offered(fs, res3, env.queue_id))


def test_a_restart_leaves_nothing_of_the_previous_run_unsynced() -> None:
    """After Log.open, every byte of every existing segment is durable (the baseline recovery stands on):
    the crash file system has no unsynced change left in the log directory's files."""
    fs = CrashFileSystem()
    q, _ = start(fs)
    asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    for _ in range(4):  # several segments, the older ones sealed by roll-overs, none of it fsync'd
        q._append_message("carol@example.org", ["dave@example.net"], BODY * 2)
    assert any(path.startswith(LOG_DIR) for path in fs.unsynced())
    Log.open(fs, LOG_DIR, segment_bytes_max=4096)  # the next run
    assert {} == {p: n for p, n in fs.unsynced().items() if p.startswith(LOG_DIR)}
