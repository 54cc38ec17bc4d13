"""Tail rules on a real disk (LevelDB's log tests by name): torn tails are cut, corruption is reported."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from mtaq.core.frame import scan_segment
from mtaq.core.records import DataRecord, EnvelopeRecord, FinishRecord, Pos, Recipient, StartRecord
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, list_segments, segment_path
from mtaq.storage.logtools import verify


def env(qid: str, data: Pos) -> EnvelopeRecord:
    return EnvelopeRecord(qid, 0, 1.0, 1.0, "s@x", (Recipient(0, "r@y"),), data, 5)


def write_messages(d: str, n: int, *, segment_bytes_max: int = 1 << 20) -> tuple[list[tuple[Pos, object]], int]:
    """Append n DATA+ENVELOPE pairs, fsync, 'crash' (drop the Log); return records and the segment used."""
    log, _ = Log.open(OsFileSystem(), d, segment_bytes_max=segment_bytes_max)
    out = []
    for i in range(n):
        data = DataRecord(f"Q{i}", b"body %d\r\n" % i)
        p, _ = log.append(data)
        e = env(f"Q{i}", p)
        q, _ = log.append(e)
        e = msgspec.structs.replace(e, durable=log.durable_end)  # as the log stamped it
        out += [(p, data), (q, e)]
    asyncio.run(log.sync())
    seg = log.current_segment
    log.close()
    return out, seg


def reopen_records(d: str) -> tuple[list, object]:
    """Open the log (recovery's first step) and read back every record of the older segments."""
    log, report = Log.open(OsFileSystem(), d, segment_bytes_max=1 << 20)
    recs = []
    for n in report.segments:
        scan = scan_segment(n, log.read_segment(n))  # re-read whole (the open's own scan skips DATA)
        recs += [(p, r) for p, r in scan.records if not type(r).__name__ == "SealRecord"]
    log.close()
    return recs, report


def test_truncated_trailing_record_is_cut_at_every_byte_offset(tmp_path):
    """Cutting the newest segment anywhere inside its last record loses that record only, and is repaired."""
    base = str(tmp_path / "base")
    written, seg = write_messages(base, 3)
    path = segment_path(base, seg)
    size = os.path.getsize(path)
    last_pos = written[-1][0]
    original = open(path, "rb").read()
    for cut in range(last_pos.offset, size):
        d = str(tmp_path / f"cut{cut}")
        os.makedirs(d)
        with open(segment_path(d, seg), "wb") as f:
            f.write(original[:cut])
        recs, report = reopen_records(d)
        assert written[:-1] == recs, cut
        if cut > last_pos.offset:
            assert [(seg, last_pos.offset)] == [(p.segment, p.offset) for p in report.repaired], cut
        # After the repair the log verifies and the cut segment is sealed.
        assert 0 == verify(d, out=open(os.devnull, "w")), cut
        assert scan_segment(seg, open(segment_path(d, seg), "rb").read()).sealed


@pytest.mark.parametrize("tail", [b"\0" * 4096, bytes(range(256)) * 8, b"MQ\x02\x00garbage"])
def test_zero_filled_or_garbage_tail_is_truncated_and_good_records_kept(tmp_path, tail):
    """A tail of zeros (a file extended but not written) or of garbage is the end of the log."""
    d = str(tmp_path)
    written, seg = write_messages(d, 4)
    with open(segment_path(d, seg), "ab") as f:
        f.write(tail)
    recs, report = reopen_records(d)
    assert written == recs
    assert 1 == len(report.repaired)


def test_flipped_bit_in_a_middle_segment_is_reported_and_later_records_kept(tmp_path):
    """Corruption in a sealed segment is reported with segment and offset; every good record after it stays."""
    d = str(tmp_path)
    _written, _ = write_messages(d, 40, segment_bytes_max=65536)  # ~3 KiB of records per 10 messages
    log, _ = Log.open(OsFileSystem(), d, segment_bytes_max=65536)
    for i in range(2500):  # fill several segments so that one is in the middle
        log.append(FinishRecord(f"F{i}", Pos(1, 32), 1.0))
        log.append(StartRecord(f"S{i}", Pos(1, 32), 1.0))
    asyncio.run(log.sync())
    log.close()
    segs = list_segments(OsFileSystem(), d)
    assert len(segs) >= 3
    middle = segs[len(segs) // 2 - 1]
    path = segment_path(d, middle)
    raw = bytearray(open(path, "rb").read())
    before = scan_segment(middle, bytes(raw))
    victim = before.records[5][0]
    raw[victim.offset + 20] ^= 0x10
    open(path, "wb").write(bytes(raw))
    after = scan_segment(middle, bytes(raw))
    assert [("corrupt", middle, victim.offset)] == [(p.kind, p.segment, p.offset) for p in after.problems]
    assert [p for p, _ in before.records if p != victim] == [p for p, _ in after.records]
    lines: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            lines.append(s)

    assert 1 == verify(d, out=Out())
    assert any(f"segment {middle} offset {victim.offset}" in line for line in lines)


def test_segment_created_but_header_not_durable_is_removed(tmp_path):
    """A crash right after creating a segment leaves an empty or short file: nothing in it was acknowledged."""
    d = str(tmp_path)
    written, seg = write_messages(d, 2)
    open(segment_path(d, seg + 1), "wb").write(b"MTAQ")
    recs, report = reopen_records(d)
    assert written == recs
    assert not os.path.exists(segment_path(d, seg + 1))
    assert seg + 2 == report.new_segment  # numbers are never reused


def test_zeroed_header_with_good_frames_after_it_is_not_removed(tmp_path):
    """Issue 12.6: the newest segment's header page zeroed (lost in an out-of-order write-back, or a
    zeroed sector) while the records after it are on disk: the segment is kept, the header reported as
    damage, and every record read back; before, Log.open unlinked the whole segment."""
    d = str(tmp_path)
    out, seg = write_messages(d, 5)
    path = os.path.join(d, f"{seg:012d}.seg")
    raw = bytearray(open(path, "rb").read())
    raw[:32] = bytes(32)
    open(path, "wb").write(bytes(raw))
    recs, report = reopen_records(d)
    assert [r for _, r in out] == [r for _, r in recs]
    assert [] == [p for p in report.repaired if p.offset == 0]
    assert [(seg, 0, 32, "corrupt")] == [(p.segment, p.offset, p.end, p.kind) for p in report.scans[seg].problems]
