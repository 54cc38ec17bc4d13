"""Record codec and framing: every record type round-trips; decoders have three outcomes (h11 style)."""

from __future__ import annotations

import zlib

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mtaq.core.frame import (
    FRAME_HEADER_BYTES,
    BadFrame,
    Frame,
    NeedMore,
    SegmentHeader,
    decode_frame,
    decode_segment_header,
    encode_record,
    encode_segment_header,
    salvage_segment_header,
    scan_segment,
)
from mtaq.core.records import (
    DataRecord,
    DeliveryRecord,
    EnvelopeRecord,
    FinishRecord,
    Outcome,
    Pos,
    Recipient,
    SealRecord,
    StartRecord,
    decode_payload,
    encode_payload,
)

u32 = st.integers(0, 2**32 - 1)
pos = st.builds(Pos, st.integers(1, 2**40), st.integers(0, 2**40))
text = st.text(max_size=40)
ts = st.floats(0, 4e9, allow_nan=False)
params = st.lists(st.tuples(text, text), max_size=3).map(tuple)
recipient = st.builds(Recipient, st.integers(0, 1000), text, params, text, st.booleans())
outcome = st.builds(Outcome, st.integers(0, 1000), st.sampled_from(["delivered", "deferred", "failed"]),
                    st.integers(200, 599), text, text)
records = st.one_of(
    st.builds(DataRecord, text, st.binary(max_size=3000)),
    st.builds(EnvelopeRecord, text, st.integers(0, 100), ts, ts, text, st.lists(recipient, max_size=5).map(tuple),
              pos, st.integers(0, 2**40), st.integers(0, 100), params, text, text, st.none() | pos),
    st.builds(StartRecord, text, pos, ts),
    st.builds(DeliveryRecord, text, pos, ts, text, st.lists(outcome, max_size=5).map(tuple)),
    st.builds(FinishRecord, text, pos, ts),
    st.builds(SealRecord, st.integers(1, 2**40), st.integers(0, 2**32)),
)


@given(records)
def test_every_record_type_round_trips_through_its_payload(rec):
    """decode_payload(encode_payload(r)) == r for every record type."""
    rtype, payload = encode_payload(rec)
    assert rec == decode_payload(rtype, payload)


@given(records, u32)
def test_every_record_round_trips_through_a_frame(rec, salt):
    """A framed record decodes to itself and reports where it ends."""
    frame = encode_record(rec, salt)
    res = decode_frame(frame + b"trailing", 0, salt)
    assert isinstance(res, Frame)
    assert len(frame) == res.end
    assert rec == decode_payload(res.rtype, res.payload)


@settings(max_examples=30)
@given(records, u32)
def test_frame_decoder_needs_more_for_every_proper_prefix(rec, salt):
    """Fed one byte at a time, the decoder says 'need more' until the whole frame is there (h11 style)."""
    frame = encode_record(rec, salt)
    for n in range(len(frame)):
        assert isinstance(decode_frame(frame[:n], 0, salt), NeedMore), n
    assert isinstance(decode_frame(frame, 0, salt), Frame)


@settings(max_examples=50)
@given(records, u32, st.data())
def test_any_flipped_bit_is_a_bad_frame_or_need_more(rec, salt, data):
    """A single flipped bit never yields a good frame (CRC-32 catches every 1-bit error)."""
    frame = bytearray(encode_record(rec, salt))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    assert not isinstance(decode_frame(bytes(frame), 0, salt), Frame)


def test_frame_from_another_segment_salt_is_rejected():
    """Bytes framed under one segment's salt do not pass in a segment with another salt."""
    frame = encode_record(StartRecord("Q", Pos(1, 32), 1.0), 1111)
    res = decode_frame(frame, 0, 2222)
    assert isinstance(res, BadFrame)
    assert "checksum mismatch" == res.reason


def test_zero_bytes_are_a_bad_frame_not_need_more():
    """A zero-filled region is recognised as bad at once (bad magic), not awaited."""
    assert isinstance(decode_frame(b"\0" * (FRAME_HEADER_BYTES + 5), 0, 7), BadFrame)
    assert isinstance(decode_frame(b"\0\0", 0, 7), BadFrame)


@given(st.integers(1, 2**63), u32, u32)
def test_segment_header_round_trips_and_is_32_bytes(seg, salt, created):
    h = SegmentHeader(segment=seg, salt=salt, created=created)
    raw = encode_segment_header(h)
    assert 32 == len(raw)
    assert h == decode_segment_header(raw)


def test_frame_checksum_is_crc32_over_header_and_payload_seeded_with_salt():
    """The documented checksum (docs/log_format.md) is what the encoder writes."""
    rec = FinishRecord("Q", Pos(1, 32), 2.0)
    salt = 0xDEADBEEF
    frame = encode_record(rec, salt)
    payload = frame[FRAME_HEADER_BYTES:]
    expected = zlib.crc32(payload, zlib.crc32(frame[:8], salt))
    assert expected == int.from_bytes(frame[8:12], "little")


@given(st.lists(records, min_size=1, max_size=4), u32, st.integers(0, 32 * 8 - 1))
def test_damaged_segment_header_gives_its_salt_back_from_the_records(recs, salt, bit):
    """Any one bit flipped in a segment header: the header fails, and the salt is recovered from the first
    record's checksum (CRC-32 is affine in its seed), confirmed by the next; the scan keeps every record."""
    recs = [r for r in recs if not isinstance(r, SealRecord)]  # a seal ends a segment: none in the middle
    assume(recs)
    seg = 7
    body = b"".join(encode_record(r, salt) for r in recs)
    raw = bytearray(encode_segment_header(SegmentHeader(segment=seg, salt=salt, created=5)) + body)
    raw[bit // 8] ^= 1 << (bit % 8)
    assert SegmentHeader(segment=seg, salt=salt, created=0) == salvage_segment_header(seg, bytes(raw))
    scan = scan_segment(seg, bytes(raw))
    assert [("corrupt", 0, 32)] == [(p.kind, p.offset, p.end) for p in scan.problems]
    assert "salt recovered" in scan.problems[0].reason
    assert recs == [r for _, r in scan.records]


def test_no_salt_is_made_up_for_a_header_without_good_records_after_it():
    """Garbage after a garbage header: no record vouches for a salt, so the whole segment is one problem."""
    import random

    raw = random.Random(3).randbytes(32) + b"MQ" + random.Random(4).randbytes(400)
    assert salvage_segment_header(2, raw) is None
    scan = scan_segment(2, raw)
    assert (None, [("corrupt", 0, len(raw))]) == (scan.header, [(p.kind, p.offset, p.end) for p in scan.problems])
