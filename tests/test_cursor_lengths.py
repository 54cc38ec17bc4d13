"""A runner's cursor steps over a frame only once its length is confirmed (issue 12.2).

Media damage in a sealed middle segment that recovery never reads (it reads the working suffix only): a
flipped bit in the length field of a DATA frame. Before, the cursor trusted the length: a high bit sent it
past the end of the file (every later envelope of the segment skipped, nothing reported, and reclamation
then deleted the segment), a low bit into the middle of a body. Now the damage is reported (and so moved
aside by the daemon) and every envelope is still offered.
"""

from __future__ import annotations

import os

import pytest
from test_corrupt_area import envelopes, receive, start

from mtaq.core.frame import scan_segment
from mtaq.core.records import DataRecord, Pos, RecordType
from mtaq.storage.cursor import LogCursor
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, list_segments, segment_path


def offered(log: Log, first: Pos) -> tuple[set[str], list]:
    seen: list = []
    cur = LogCursor(log, first, seen.append)
    got = set()
    while (found := cur.peek(log.durable_end, lambda t: t == RecordType.ENVELOPE)) is not None:
        if found is not False:
            got.add(found[1].queue_id)
            cur.skip()
    return got, seen


@pytest.mark.parametrize("bit", [30, 26, 13, 9, 4])  # of the u32 length: past the file's end ... into a body
def test_a_flipped_bit_in_a_data_frames_length_is_reported_and_no_envelope_is_skipped(tmp_path, bit):
    """Bit ``bit`` of a middle DATA frame's length flipped, the log opened again (no recovery scan): the
    cursor reports the damage at that frame and still offers every envelope of the log."""
    spool = str(tmp_path)
    log, _q, _ = start(spool)
    receive(_q, 120)
    log.close()
    log_dir = os.path.join(spool, "log")
    segs = list_segments(OsFileSystem(), log_dir)
    middle = segs[len(segs) // 2]
    path = segment_path(log_dir, middle)
    raw = bytearray(open(path, "rb").read())
    scan = scan_segment(middle, bytes(raw))
    data_pos = [p for p, r in scan.records if isinstance(r, DataRecord)][3]
    before = envelopes(spool)
    length = int.from_bytes(raw[data_pos.offset + 4: data_pos.offset + 8], "little")
    raw[data_pos.offset + 4: data_pos.offset + 8] = (length ^ (1 << bit)).to_bytes(4, "little")
    open(path, "wb").write(bytes(raw))

    log, _report = Log.open(OsFileSystem(), log_dir, segment_bytes_max=65536)
    got, seen = offered(log, Pos(segs[0], 32))
    log.close()
    assert set(before) == got
    assert [(middle, data_pos.offset)] == [(p.segment, p.offset) for p in seen]
