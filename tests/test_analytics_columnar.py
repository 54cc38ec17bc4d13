"""The numpy decoder of record payloads (:mod:`mtaq.analytics.columnar`) and the vectorised frame walk against
msgspec and the frame-by-frame codec.

Whatever the columnar grammar accepts must decode to msgspec's values; whatever it refuses goes to msgspec,
whose verdict stands. The frame walk must find exactly the frames the walk frame by frame finds, with frame
headers embedded in DATA bodies, and send any damage to scan_segment. No Spark here.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("hypothesis")

import msgspec
import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtaq.analytics import columnar
from mtaq.analytics.columnar import columns_of_rows, decode_columns, decode_columns_numpy
from mtaq.analytics.source import _as_row, _walk, _walk_loop, batches, discover, read_segment
from mtaq.core.frame import SegmentHeader, encode_frame, encode_record, encode_segment_header
from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    StartRecord,
)

T0 = 1_740_787_200.123456
SALT = 0x5A17C0DE

ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-300, 300), st.sampled_from([0, 127, 128, 255, 256, 65535,
                                                                                               65536, 2**32 - 1, 2**32, -32, -33, -129, -(2**15) - 1]))
texts = st.one_of(st.text(max_size=40), st.text(alphabet="abc@.", max_size=300), st.sampled_from(["", "a" * 31, "a" * 32, "é" * 200]))
floats = st.floats(allow_nan=False)
pos = st.builds(Pos, ints, ints)
pairs = st.lists(st.tuples(texts, texts), max_size=3).map(tuple)
recipient = st.builds(Recipient, ints, texts, pairs, texts, st.booleans())
outcome = st.builds(Outcome, ints, st.sampled_from(["delivered", "deferred", "failed"]), ints, texts, texts)
RECORDS = {
    EnvelopeRecord: st.builds(EnvelopeRecord, texts, ints, floats, floats, texts, st.lists(recipient, max_size=4).map(tuple), pos,
                              ints, ints, pairs, texts, texts, st.none() | pos, ints, st.booleans(), texts, st.booleans(),
                              st.none() | pos),
    StartRecord: st.builds(StartRecord, texts, pos, floats, ints, texts, st.none() | pos),
    DeliveryRecord: st.builds(DeliveryRecord, texts, pos, floats, texts, st.lists(outcome, max_size=20).map(tuple), st.booleans()),
    FinishRecord: st.builds(FinishRecord, texts, pos, floats),
}


DECODERS = {"c": columnar._decode_c, "numpy": decode_columns_numpy, "either": decode_columns}


def columns(cls, payloads: list[bytes], decoder: str = "either"):
    """The columns of ``payloads`` by the C decoder, the numpy one, or the one the analytics use."""
    blob = np.frombuffer(b"".join(payloads), np.uint8)
    ends = np.cumsum([len(p) for p in payloads], dtype=np.int64)
    return DECODERS[decoder](cls, blob, ends - np.array([len(p) for p in payloads], np.int64), ends)


def same(a: dict, b: dict) -> bool:
    as_arrow = {k: pa.array(v) if isinstance(v, np.ndarray) else v for k, v in a.items()}
    bs_arrow = {k: pa.array(v) if isinstance(v, np.ndarray) else v for k, v in b.items()}
    return as_arrow.keys() == bs_arrow.keys() and all(as_arrow[k].equals(bs_arrow[k]) for k in as_arrow)


@pytest.mark.parametrize("decoder", ["c", "numpy"])
@pytest.mark.parametrize("cls", list(RECORDS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_columns_equal_msgspecs_values(cls, decoder, data):
    """Any records the daemon could write (every int width, float, str length class, non-ASCII text, nested
    arrays of any length, nil or not): the columns of the C decoder and of the numpy one are msgspec's, value
    for value."""
    recs = data.draw(st.lists(RECORDS[cls], min_size=1, max_size=8))
    payloads = [msgspec.msgpack.encode(r) for r in recs]
    got = columns(cls, payloads, decoder)
    assert got is not None
    assert same(got, columns_of_rows(cls, [_as_row(r) for r in recs]))


@pytest.mark.parametrize("decoder", ["c", "numpy"])
def test_payloads_outside_the_grammar_are_left_to_msgspec(decoder):
    """Encodings msgspec accepts but the grammar does not (an int where a float is, an int beyond int64, a
    shorter array filled with defaults, a longer one whose extra elements it ignores) and payloads msgspec refuses (another record's tag, an unknown status,
    bytes left over, a str that is not UTF-8): the numpy decoder declines them all. An int in a wider
    encoding than needed (the tag as uint8 or int8) both take, with the same values."""
    enc = msgspec.msgpack.encode
    ok = enc(FinishRecord("Q1", Pos(1, 32), T0))
    assert columns(FinishRecord, [ok], decoder) is not None
    for wide in (ok[:1] + b"\xcc\x05" + ok[2:], ok[:1] + b"\xd0\x05" + ok[2:]):
        rec = msgspec.msgpack.decode(wide, type=FinishRecord)
        assert same(columns(FinishRecord, [ok, wide], decoder), columns_of_rows(FinishRecord, [_as_row(rec)] * 2))
    takes = [
        enc([5, "Q1", [1, 32], 17, None]),                  # an int for a float
        enc([5, "Q1", [1, 2**64 - 1], T0, None]),           # an int beyond int64
        enc([5, "Q1", [1, 32, 3], T0, None]),               # a longer array (msgspec ignores what follows)
        enc([5, "Q1", [1, 32], T0]),                        # a shorter one (durable: the class's default)
    ]
    refuses = [
        enc([3, "Q1", [1, 32], T0]),                        # a START's tag on a FINISH
        enc([5, "Q1", [1, 32]]),                            # a field missing
        ok + b"\xc0",                                       # a byte left over
        enc([5, "Qxyz", [1, 32], T0]).replace(b"Qxyz", b"Q\xff\xfe\xfd"),  # not UTF-8
        enc([5, "Qxyz", [1, 32], T0]).replace(b"Qxyz", b"Q\xed\xb3\xbf"),  # an encoded surrogate
        enc([5, "Qxyz", [1, 32], T0]).replace(b"Qxyz", b"Q\xc0\xaf\x41"),  # an overlong "/"
    ]
    for bad in takes + refuses:
        assert columns(FinishRecord, [ok, bad], decoder) is None, bad
    for bad in takes:
        msgspec.msgpack.decode(bad, type=FinishRecord)
    for bad in refuses:
        with pytest.raises((msgspec.MsgspecError, ValueError)):
            msgspec.msgpack.decode(bad, type=FinishRecord)
    short = enc([3, "Q1", [1, 32], T0])  # a START without runner, admin, durable: the class's defaults
    assert columns(StartRecord, [short], decoder) is None
    assert msgspec.msgpack.decode(short, type=StartRecord) == StartRecord("Q1", Pos(1, 32), T0)
    assert columns(DeliveryRecord, [enc([4, "Q1", [1, 32], T0, "mx", [[0, "bounced", 550, "5.0.0", "no"]], False])], decoder) is None


def write_segment(path, records: list, raw: list[tuple[int, bytes]] = ()) -> None:
    buf = encode_segment_header(SegmentHeader(segment=1, salt=SALT, created=int(T0)))
    for r in records:
        buf += encode_record(r, SALT)
    for rtype, payload in raw:
        buf += encode_frame(rtype, payload, SALT)
    path.write_bytes(buf)


def rows(path) -> list[dict]:
    return [r for b in batches(discover([str(path)])) for r in b.to_pylist()]


def slow_rows(path) -> list[dict]:
    return [r for b in batches(discover([str(path)]), fast=False) for r in b.to_pylist()]


def key(r: dict):
    return (r["record_type"], r["offset"], r["rcpt_index"] or 0)


def test_a_str_that_is_not_utf8_is_named_by_the_codec(tmp_path):
    """A frame with a good checksum whose payload holds a str that is not UTF-8: msgspec raises
    UnicodeDecodeError (a ValueError, not a msgspec error), and the segment goes to scan_segment, which names
    that record as corrupt. (The read failed with that exception before.)"""
    good = StartRecord("Q1", Pos(1, 32), T0, 0)
    bad = msgspec.msgpack.encode(FinishRecord("Q\xe9", Pos(1, 32), T0 + 1)).replace("Q\xe9".encode(), b"Q\xff")
    path = tmp_path / "000000000001.seg"
    write_segment(path, [good], [(5, bad)])
    got = rows(path)
    assert sorted(got, key=key) == sorted(slow_rows(path), key=key)
    assert [("corrupt", "record type 5")] == [(r["problem_kind"], r["problem_reason"][:13]) for r in got
                                               if r["record_type"] == "PROBLEM"]


def test_records_outside_the_grammar_give_the_codecs_rows(tmp_path):
    """A segment mixing records the numpy decoder takes with ones only msgspec takes (an int time, an old
    shorter START): the rows are the codec's, and the segment is still read by the fast path."""
    enc = msgspec.msgpack.encode
    recs = [StartRecord(f"Q{i}", Pos(1, 32 + i), T0 + i, i % 3) for i in range(50)]
    path = tmp_path / "000000000001.seg"
    write_segment(path, recs, [(3, enc([3, "Q-int", [1, 40], 1740787200, 1, "", None])), (3, enc([3, "Q-old", [1, 41], T0]))])
    assert read_segment(1, path.read_bytes()).fast
    got = rows(path)
    assert sorted(got, key=key) == sorted(slow_rows(path), key=key)
    assert {"Q-int", "Q-old"} <= {r["queue_id"] for r in got}


@pytest.mark.parametrize("bodies", ["headers", "frames", "segment"])
def test_frame_headers_inside_data_bodies_are_not_frames(tmp_path, bodies):
    """DATA bodies holding frame magic with valid types, whole frames of this segment's salt, or a copy of the
    segment itself: the vectorised walk finds the frames the walk frame by frame finds (or lets it decide),
    and the rows are the codec's."""
    recs: list = []
    inner = b"".join(encode_record(StartRecord(f"E{i}", Pos(1, 32), T0, 0), SALT) for i in range(20))
    for i in range(40):
        if bodies == "headers":
            body = b"MQ\x03\x00" * (i % 7) + b"x" * i
        elif bodies == "frames":
            body = inner[: 12 + i * 5] + inner
        else:
            body = encode_segment_header(SegmentHeader(segment=1, salt=SALT, created=int(T0))) + inner * 3
        recs.append(DataRecord(f"Q{i}", body))
        recs.append(StartRecord(f"Q{i}", Pos(1, 32), T0 + i, 0))
    path = tmp_path / "000000000001.seg"
    write_segment(path, recs)
    buf = path.read_bytes()
    walked, loop = _walk(1, buf), _walk_loop(1, buf)
    assert walked is not None and loop is not None
    assert all(np.array_equal(walked[0][t], loop[0][t]) and np.array_equal(walked[1][t], loop[1][t]) for t in walked[0])
    assert walked[2:] == loop[2:]
    got = rows(path)
    assert sorted(got, key=key) == sorted(slow_rows(path), key=key)
    assert len([r for r in got if r["record_type"] == "START"]) == 40


def test_every_bit_flip_of_a_small_segment_gives_the_codecs_rows(tmp_path):
    """Each single bit flipped in a small segment (headers, CRCs, payloads, the DATA body, the SEAL): the
    rows are scan_segment's, and the fast path never takes a damaged segment."""
    from mtaq.core.records import SealRecord

    recs = [DataRecord("Q1", b"body MQ\x02\x00"), EnvelopeRecord("Q1", 0, T0, T0, "s@x", (Recipient(0, "r@y"),), Pos(1, 32), 13),
            StartRecord("Q1", Pos(1, 60), T0 + 1, 0), DeliveryRecord("Q1", Pos(1, 90), T0 + 2, "mx", (Outcome(0, "delivered", 250, "2.0.0", "ok"),)),
            FinishRecord("Q1", Pos(1, 90), T0 + 3)]
    path = tmp_path / "000000000001.seg"
    write_segment(path, recs)
    clean = path.read_bytes()
    path.write_bytes(clean + encode_record(SealRecord(1, len(recs)), SALT))
    clean = path.read_bytes()
    for at in range(32, len(clean)):
        for bit in (0, 3, 7):
            raw = bytearray(clean)
            raw[at] ^= 1 << bit
            path.write_bytes(bytes(raw))
            assert not read_segment(1, bytes(raw)).fast, (at, bit)
            assert sorted(rows(path), key=key) == sorted(slow_rows(path), key=key), (at, bit)
    os.remove(path)
