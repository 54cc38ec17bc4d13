"""The analytics' frame walk in C (``mtaq/analytics/_walk.c``, issue 38.4) against its definition, the walk frame
by frame in Python (:func:`mtaq.analytics.source._walk_loop`), and the numpy walk used where the C module is not
built: on clean segments, on DATA bodies full of frame headers, on every single bit flip and every cut of a
small segment, and on random records with random damage. They must find the same frames, or all three refuse
the segment (then scan_segment reads it). No Spark here.
"""

from __future__ import annotations

import struct
import zlib

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("hypothesis")

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_analytics_columnar import RECORDS, SALT, T0, key, rows, slow_rows

from mtaq.analytics import source
from mtaq.analytics.source import _walk, _walk_c, _walk_loop, _walk_numpy, read_segment
from mtaq.core.frame import (
    FRAME_MAGIC,
    RECORD_BYTES_MAX,
    SEGMENT_HEADER_BYTES,
    SegmentHeader,
    encode_frame,
    encode_record,
    encode_segment_header,
)
from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    RecordType,
    SealRecord,
    StartRecord,
)


def segment(records: list, salt: int = SALT, raw: bytes = b"") -> bytes:
    buf = encode_segment_header(SegmentHeader(segment=1, salt=salt, created=int(T0)))
    return buf + b"".join(encode_record(r, salt) for r in records) + raw


def walks_agree(buf: bytes, segment_no: int = 1):
    """The three walks of ``buf``: equal (each None, or the same frames); the loop's result."""
    loop = _walk_loop(segment_no, buf)
    for other in (_walk_c(segment_no, buf), _walk_numpy(segment_no, buf)):
        if loop is None:
            assert other is None
            continue
        assert other is not None
        assert other[0].keys() == loop[0].keys() and other[1].keys() == loop[1].keys()
        for t in loop[0]:
            assert np.array_equal(other[0][t], loop[0][t]) and np.array_equal(other[1][t], loop[1][t])
            assert other[0][t].dtype == loop[0][t].dtype == np.int64
        assert other[2:] == loop[2:]
    return loop


SMALL = [DataRecord("Q1", b"body MQ\x02\x00"),
         EnvelopeRecord("Q1", 0, T0, T0, "s@x", (Recipient(0, "r@y"),), Pos(1, 32), 13),
         StartRecord("Q1", Pos(1, 60), T0 + 1, 0),
         DeliveryRecord("Q1", Pos(1, 90), T0 + 2, "mx", (Outcome(0, "delivered", 250, "2.0.0", "ok"),)),
         FinishRecord("Q1", Pos(1, 90), T0 + 3)]


def test_the_c_walk_is_built_and_used():
    """`make install` (pip) built the module where the tests run, and the analytics use it: a green run of the
    other tests then says something about the C walk, not only about numpy's."""
    assert source._cwalk is not None, "mtaq/analytics/_walk.c was not built by the install (gcc, python3-dev?)"
    buf = segment(SMALL)
    calls = []
    real = source._cwalk.walk
    try:
        source._cwalk.walk = lambda *a: calls.append(a) or real(*a)  # type: ignore[attr-defined]
        assert read_segment(1, buf).fast
    finally:
        source._cwalk.walk = real  # type: ignore[attr-defined]
    assert len(calls) == 1


def test_a_clean_segment_sealed_or_not_and_the_frames_counted():
    buf = segment(SMALL)
    loop = walks_agree(buf)
    assert loop is not None and loop[2:] == (len(SMALL), False)
    sealed = buf + encode_record(SealRecord(1, len(SMALL)), SALT)
    loop = walks_agree(sealed)
    assert loop is not None and loop[2:] == (len(SMALL), True)
    assert [len(loop[0][t]) for t in sorted(loop[0])] == [1, 1, 1, 1]


@pytest.mark.parametrize("case", ["header only", "seal only", "bytes after a seal", "two seals", "salt 2**32-1",
                                  "salt 0", "other segment number", "only DATA", "empty payloads"])
def test_edge_cases_agree(case):
    buf = {
        "header only": segment([]),
        "seal only": segment([SealRecord(1, 0)]),
        "bytes after a seal": segment([*SMALL, SealRecord(1, 5)], raw=b"\0"),
        "two seals": segment([*SMALL, SealRecord(1, 5), SealRecord(1, 5)]),
        "salt 2**32-1": segment(SMALL, salt=2**32 - 1),
        "salt 0": segment(SMALL, salt=0),
        "other segment number": segment(SMALL),
        "only DATA": segment([DataRecord(f"Q{i}", b"x" * i) for i in range(30)]),
        "empty payloads": segment(SMALL, raw=encode_frame(int(RecordType.DATA), b"", SALT) * 3),
    }[case]
    loop = walks_agree(buf, 2 if case == "other segment number" else 1)
    if case in ("bytes after a seal", "two seals", "other segment number"):
        assert loop is None
    else:
        assert loop is not None


@pytest.mark.parametrize("length", [RECORD_BYTES_MAX, RECORD_BYTES_MAX + 1, 2**32 - 1, 2**31, 100])
def test_a_frame_length_past_the_end_or_the_limit_is_refused(length):
    """A header whose length field is beyond the file or beyond RECORD_BYTES_MAX (also near 2**32, where a
    sum in 32 bits would wrap): refused by every walk, never read past the end."""
    head = struct.pack("<HBBI", FRAME_MAGIC, int(RecordType.START), 0, length)
    buf = segment(SMALL, raw=head + struct.pack("<I", zlib.crc32(head, SALT)) + b"y" * 40)
    assert walks_agree(buf) is None


@pytest.mark.parametrize("rtype, flags", [(int(RecordType.START), 1), (int(RecordType.START), 0x80), (0, 0), (200, 0)])
def test_a_frame_with_flags_or_an_unknown_type_is_refused_even_with_a_good_crc(rtype, flags):
    payload = b"\x93\x01\x02\x03"
    head = struct.pack("<HBBI", FRAME_MAGIC, rtype, flags, len(payload))
    buf = segment(SMALL, raw=head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head, SALT))) + payload)
    assert walks_agree(buf) is None


def test_frame_headers_inside_data_bodies():
    """DATA bodies made of frame headers and whole frames of this segment's salt: the walks agree."""
    inner = b"".join(encode_record(StartRecord(f"E{i}", Pos(1, 32), T0, 0), SALT) for i in range(20))
    recs: list = []
    for i in range(40):
        recs += [DataRecord(f"Q{i}", inner[: 12 + i * 5] + inner + b"MQ\x03\x00" * (i % 7)),
                 StartRecord(f"Q{i}", Pos(1, 32), T0 + i, 0)]
    loop = walks_agree(segment(recs))
    assert loop is not None and len(loop[0][int(RecordType.START)]) == 40


def test_every_bit_flip_and_every_cut_of_a_small_segment():
    """Each of 3 bits of every byte flipped, and the file cut at every length: the three walks agree, and none
    takes a damaged segment as clean."""
    clean = segment([*SMALL, SealRecord(1, len(SMALL))])
    for at in range(len(clean)):
        for bit in (0, 3, 7):
            raw = bytearray(clean)
            raw[at] ^= 1 << bit
            assert walks_agree(bytes(raw)) is None, (at, bit)
    for cut in range(len(clean) + 1):
        loop = walks_agree(clean[:cut])
        frame_ends = {SEGMENT_HEADER_BYTES + sum(len(encode_record(r, SALT)) for r in SMALL[:k]) for k in range(len(SMALL) + 1)}
        assert (loop is not None) == (cut in frame_ends or cut == len(clean)), cut


def test_the_rows_of_a_damaged_segment_are_the_codecs(tmp_path):
    """The rows from a segment with a damaged frame in the middle (the C walk refuses it, scan_segment reads
    it) are the frame-by-frame codec's."""
    buf = bytearray(segment(SMALL * 3))
    buf[len(buf) // 2] ^= 0x10
    path = tmp_path / "000000000001.seg"
    path.write_bytes(bytes(buf))
    assert not read_segment(1, bytes(buf)).fast
    assert sorted(rows(path), key=key) == sorted(slow_rows(path), key=key)


def test_the_modules_arguments_are_checked():
    with pytest.raises(ValueError):
        source._cwalk.walk(segment(SMALL), SEGMENT_HEADER_BYTES, SALT, FRAME_MAGIC, b"\1" * 255, 1, 6, RECORD_BYTES_MAX)
    with pytest.raises(ValueError):
        source._cwalk.walk(segment(SMALL), -1, SALT, FRAME_MAGIC, b"\1" * 256, 1, 6, RECORD_BYTES_MAX)
    with pytest.raises(TypeError):
        source._cwalk.walk("text", SEGMENT_HEADER_BYTES, SALT, FRAME_MAGIC, b"\1" * 256, 1, 6, RECORD_BYTES_MAX)


any_record = st.one_of(*RECORDS.values(), st.builds(DataRecord, st.text(max_size=10), st.binary(max_size=300)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(recs=st.lists(any_record, max_size=12), salt=st.integers(0, 2**32 - 1), sealed=st.booleans(),
       damage=st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=4)), max_size=3),
       cut=st.none() | st.integers(0, 10**6))
def test_random_records_with_random_damage(recs, salt, sealed, damage, cut):
    """Any records (DATA bodies of any bytes), any salt, sealed or not, then bytes overwritten and the file
    maybe cut short: the three walks agree."""
    buf = bytearray(segment([*recs, *([SealRecord(1, len(recs))] if sealed else [])], salt=salt))
    for at, patch in damage:
        at %= len(buf)
        buf[at : at + len(patch)] = patch
    if cut is not None:
        buf = buf[: cut % (len(buf) + 1)]
    walks_agree(bytes(buf))
    if _walk(1, bytes(buf)) is not None:
        assert _walk(1, bytes(buf))[2] == _walk_loop(1, bytes(buf))[2]
