"""The queue runners jump from envelope to envelope over what this process appended (Log.next_envelope).

A runner looks only at ENVELOPE frames, yet it read the header of every frame (DATA, START, DELIVERY,
FINISH) to step over it, and each of the runners did so. The log now lists the positions of the envelopes
it appends; a cursor in that stretch goes straight to the next one. What must hold: the envelopes found,
and their order, are exactly those a frame-by-frame walk finds, over old segments (walked), the listed
stretch, the boundary between them, and after the oldest listed half was dropped; never one past the
durable end.
"""

from __future__ import annotations

import asyncio
import os

from test_corrupt_area import receive, runner_walk, start

from mtaq.core.frame import FRAME_HEADER_BYTES
from mtaq.core.records import EnvelopeRecord, Pos, RecordType
from mtaq.storage import cursor as cursor_mod
from mtaq.storage import log as log_mod
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, list_segments, scan_log


def walked(log: Log, first: Pos, end: Pos) -> list[tuple[Pos, str]]:
    cur = LogCursor(log, first)
    got = []
    while (found := cur.peek(end, lambda t: t == RecordType.ENVELOPE)) is not None:
        if found is not False:
            got.append((found[0], found[1].queue_id))
            cur.skip()
    return got


def jumped(log: Log, first: Pos, end: Pos) -> list[tuple[Pos, str]]:
    cur = LogCursor(log, first)
    got = []
    while (found := cur.peek_envelope(end, max_frames=64)) is not None:
        if found is not False:
            got.append((found[0], found[1].queue_id))
            cur.skip()
    return got


def on_disk(spool: str) -> list[tuple[Pos, str]]:
    return [(p, r.queue_id) for s in scan_log(OsFileSystem(), os.path.join(spool, "log"))
            for p, r in s.records if isinstance(r, EnvelopeRecord)]


def first_pos(spool: str) -> Pos:
    return Pos(list_segments(OsFileSystem(), os.path.join(spool, "log"))[0], 32)


def test_jumping_finds_what_walking_finds_and_reads_only_the_envelopes(tmp_path, monkeypatch):
    """60 messages over several segments, all appended by this Log: the same envelopes in the same order
    as the walk and as the segments hold them; the walk reads a header per frame; so does the first
    jumping cursor (it checks each frame once, for all), the next one about two per envelope (the one it
    stops at, and skip)."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=16384)
    receive(q, 60)
    end = log.durable_end
    reads = {"n": 0}
    real = cursor_mod.LogCursor._header

    def counted(self, pos):
        reads["n"] += 1
        return real(self, pos)

    monkeypatch.setattr(cursor_mod.LogCursor, "_header", counted)
    want = walked(log, first_pos(spool), end)
    walk_reads, reads["n"] = reads["n"], 0
    first = jumped(log, first_pos(spool), end)
    first_reads, reads["n"] = reads["n"], 0
    assert log.checked_end == end
    got = jumped(log, first_pos(spool), end)
    jump_reads = reads["n"]
    log.close()
    assert len(want) == 60 and got == first == want == on_disk(spool)
    assert walk_reads > 2 * 60 + 60  # every DATA frame too, and the seals
    assert first_reads > 2 * 60 + 60
    assert jump_reads <= 2 * 60 + 2


def test_damage_between_listed_envelopes_is_reported_by_the_first_cursor_to_pass(tmp_path):
    """One byte of a message body that no runner asks for (between two listed envelopes) flipped on disk
    after it was written: the first jumping cursor checks every frame it passes once and reports the
    damaged DATA frame, as a frame-by-frame walk does (found by review: the jump stepped over it unreported);
    both envelopes are found, and a later cursor jumps without reading the frames again."""
    spool = str(tmp_path)
    log, q, _ = start(spool)
    envs = receive(q, 2)
    end = log.durable_end
    data = envs[1].data
    with open(log_mod.segment_path(os.path.join(spool, "log"), data.segment), "r+b") as f:
        f.seek(data.offset + FRAME_HEADER_BYTES + 100)  # inside the body's payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    log.confirmed.clear()
    log.decoded.clear()
    got, problems = runner_walk(log, first_pos(spool), end)
    again, problems_again = runner_walk(log, first_pos(spool), end)
    log.close()
    assert got == again == [e.queue_id for e in envs]
    assert len(problems) == 1 and problems[0].segment == data.segment, problems
    assert problems_again == []  # the first cursor checked that stretch; this one jumps


def test_an_old_segments_envelopes_are_walked_then_the_listed_ones_jumped(tmp_path):
    """A log of an earlier run (30 messages) opened again, 30 more received: from the first segment the
    cursor walks the old segments and jumps through the new ones, finding all 60 in log order."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=16384)
    receive(q, 30)
    log.close()
    log, q, _ = start(spool, segment_bytes_max=16384)
    receive(q, 30)
    end = log.durable_end
    got = jumped(log, first_pos(spool), end)
    want = walked(log, first_pos(spool), end)
    log.close()
    assert got == want
    assert [qid for _p, qid in got] == [qid for _p, qid in on_disk(spool)]
    assert len({qid for _p, qid in got}) >= 60  # recovery's own records may add envelopes; none missing


def test_when_the_oldest_listed_half_is_dropped_the_cursor_walks_up_to_what_is_still_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(log_mod, "ENVELOPES_LISTED_MAX", 8)
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=16384)
    receive(q, 40)
    end = log.durable_end
    assert log.next_envelope(first_pos(spool), end) is False
    assert len(log._envelopes) <= 8
    got = jumped(log, first_pos(spool), end)
    want = walked(log, first_pos(spool), end)
    log.close()
    assert got == want and len(got) == 40


def test_an_envelope_past_the_durable_end_is_not_offered(tmp_path):
    """An envelope appended and not yet committed is listed, but a cursor bounded by the durable end stops
    before it, and finds it once it is durable."""
    spool = str(tmp_path)
    log, q, _ = start(spool)
    [env] = receive(q, 1)
    durable = log.durable_end
    pos, lsn = log.append(env)
    assert log.end > durable
    cur = LogCursor(log, first_pos(spool))
    found = cur.peek_envelope(durable)
    assert found is not None and found is not False
    cur.skip()
    assert cur.peek_envelope(log.durable_end) is None
    assert cur.pos == durable
    asyncio.run(log.commit(lsn))
    found = cur.peek_envelope(log.durable_end)
    log.close()
    assert found is not None and found is not False and found[0] == pos
