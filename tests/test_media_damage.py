"""Media damage against the real Queue, recovery and runner cursors (issue 12, the model side).

Messages are received (fsync'd) into small segments, some attempted and deferred (replacement envelopes
with DATA copies), a checkpoint is written, and then one fault of :mod:`mtaq.testing.media` hits a sealed
segment or the checkpoint: a flipped bit in a length field, in a payload or in a segment header, or a
zeroed sector. After recovery, a runner's cursor reads the log from its oldest segment. For every seed:

* every message none of whose records was in the damaged bytes is still live and its body reads back byte
  for byte (nothing skipped past the damage);
* a message whose records were damaged is either still live and readable, or reported: the damaged bytes
  were reported by recovery or by the cursor, covering the place the fault hit (never dropped silently).
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
from test_corrupt_area import start
from test_hole_conclusions import body_of, live

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.frame import SEGMENT_HEADER_BYTES
from mtaq.core.records import Outcome, Pos, RecordType
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import list_segments
from mtaq.testing import media


@pytest.mark.parametrize("seed", range(24))
def test_damage_to_sealed_bytes_never_costs_a_message_silently(tmp_path, seed):
    """See the module docstring."""
    rng = random.Random(seed)
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=65536)
    bodies = {}

    async def fill() -> None:
        for i in range(60):
            body = b"Subject: %d\r\n\r\n" % i + bytes([97 + i % 26]) * rng.randint(200, 3000) + b"\r\n"
            env = await q.receive("s@x.test", [f"r{i}@y.test"], body)
            bodies[env.queue_id] = body
        for qid in rng.sample(sorted(bodies), 15):  # deferred once: a replacement with a DATA copy
            [(pos, env)] = live(spool)[qid]
            attempt = q.start(pos, env)
            await q.record_outcomes(attempt, "mx", [Outcome(0, "deferred", 451, "4.2.0", "later")])
            q.conclude(attempt)
        await log.sync()

    asyncio.run(fill())
    e = log.end
    write_checkpoint(OsFileSystem(), spool, Checkpoint(e, e, (e, e), ((), ()), 1.0))
    log.close()
    hit = media.damage(spool, rng)
    assert hit is not None
    log, q, res = start(spool, segment_bytes_max=65536)
    seen: list = []
    first = Pos(list_segments(OsFileSystem(), os.path.join(spool, "log"))[0], SEGMENT_HEADER_BYTES)
    cur = LogCursor(log, first, seen.append)
    while (found := cur.peek(log.durable_end, lambda t: t == RecordType.ENVELOPE)) is not None:
        if found is not False:
            cur.skip()
    reported = [*res.corrupt, *res.holes, *seen]
    covered = any(p.segment == hit.segment and p.offset < hit.end and hit.start < p.end for p in reported)
    now = live(spool)
    for qid, body in bodies.items():
        envs = now.get(qid, [])
        readable = len(envs) == 1 and body_of(log, envs[0][1]) == body
        if qid not in hit.queue_ids:
            assert readable, (qid, hit, reported)
        elif not readable:
            assert covered, (qid, hit, reported)
    if hit.kind != "checkpoint-bit" and any(qid not in {k for k in now} for qid in hit.queue_ids):
        assert covered, (hit, reported)
    log.close()
