"""The analytics' C module (``mtaq/analytics/_segment.c``, issue 38.4).

Its frame walk against its definition, the walk frame by frame in Python
(:func:`mtaq.analytics.source._walk_loop`), and the numpy walk used where the module is not built: on clean
segments, on DATA bodies full of frame headers, on every single bit flip and every cut of a small segment, and
on random records with random damage. They must find the same frames, or all three refuse the segment (then
scan_segment reads it).

Its payload decoder against the numpy one and msgspec (tests/test_analytics_columnar.py runs both on random
records): here on damaged payloads, on UTF-8 at every boundary, on long arrays, and on bad arguments. No Spark.
"""

from __future__ import annotations

import struct
import typing
import zlib

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("hypothesis")

import msgspec
import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_analytics_columnar import RECORDS, SALT, T0, columns, key, rows, same, slow_rows

from mtaq.analytics import columnar, source
from mtaq.analytics.columnar import columns_of_rows
from mtaq.analytics.source import _as_row, _walk_c, _walk_loop, _walk_numpy, read_segment
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


def test_the_c_module_is_built_and_used():
    """`make install` (pip) built the module where the tests run, and the analytics use its walk and its
    decoder: a green run of the other tests then says something about the C code, not only about numpy's."""
    assert source._cseg is not None, "mtaq/analytics/_segment.c was not built by the install (gcc, python3-dev?)"
    assert columnar._cseg is source._cseg
    buf = segment(SMALL)
    calls: list[str] = []
    real_walk, real_decode = source._cseg.walk, source._cseg.decode
    try:
        source._cseg.walk = lambda *a: calls.append("walk") or real_walk(*a)
        source._cseg.decode = lambda *a: calls.append("decode") or real_decode(*a)
        assert read_segment(1, buf).fast
    finally:
        source._cseg.walk, source._cseg.decode = real_walk, real_decode
    assert calls == ["walk"] + ["decode"] * 4


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
        source._cseg.walk(segment(SMALL), SEGMENT_HEADER_BYTES, SALT, FRAME_MAGIC, b"\1" * 255, 1, 6, RECORD_BYTES_MAX)
    with pytest.raises(ValueError):
        source._cseg.walk(segment(SMALL), -1, SALT, FRAME_MAGIC, b"\1" * 256, 1, 6, RECORD_BYTES_MAX)
    with pytest.raises(TypeError):
        source._cseg.walk("text", SEGMENT_HEADER_BYTES, SALT, FRAME_MAGIC, b"\1" * 256, 1, 6, RECORD_BYTES_MAX)


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


def same_nan(a: dict, b: dict) -> bool:
    """:func:`same`, but a NaN equals a NaN (a damaged float is often one)."""
    def norm(v):
        v = pa.array(v) if isinstance(v, np.ndarray) else v
        if v.type == pa.float64():
            f = v.to_numpy(zero_copy_only=False)
            return pa.array(np.where(np.isnan(f), 0.0, f)), pa.array(np.isnan(f)), v.is_null()
        return (v,)
    return a.keys() == b.keys() and all(all(x.equals(y) for x, y in zip(norm(a[k]), norm(b[k]), strict=True)) for k in a)


def payloads_of(recs) -> list[bytes]:
    return [msgspec.msgpack.encode(r) for r in recs]


@pytest.mark.parametrize("cls", list(RECORDS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_damaged_payloads_are_decoded_alike_or_declined_alike(cls, data):
    """Valid payloads with bytes overwritten, inserted or cut (as a CRC collision or a writer's bug would leave
    them): the C decoder and the numpy one both decline, or give the same columns, and whatever the C decoder
    takes msgspec decodes to the same values."""
    recs = data.draw(st.lists(RECORDS[cls], min_size=1, max_size=4))
    payloads = payloads_of(recs)
    i = data.draw(st.integers(0, len(payloads) - 1))
    p = bytearray(payloads[i])
    at = data.draw(st.integers(0, len(p)))
    how = data.draw(st.sampled_from(["overwrite", "insert", "cut"]))
    patch = data.draw(st.binary(min_size=1, max_size=3))
    if how == "overwrite":
        p[at : at + len(patch)] = patch
    elif how == "insert":
        p[at:at] = patch
    else:
        del p[at:]
    payloads[i] = bytes(p)
    c, n = columns(cls, payloads, "c"), columns(cls, payloads, "numpy")
    assert (c is None) == (n is None)
    if c is not None:
        assert same_nan(c, n)
        decoded = [msgspec.msgpack.decode(x, type=cls) for x in payloads]
        assert same_nan(c, columns_of_rows(cls, [_as_row(r) for r in decoded]))


def test_utf8_at_every_boundary_is_taken_exactly_as_python_decodes_it():
    """A queue ID of every lead byte from 0x80 on followed by continuation bytes at the edges of the ranges
    (overlong forms, surrogates, beyond U+10FFFF, cut short): the C decoder takes it exactly when Python's
    UTF-8 decoder does, and then with Python's string."""
    edges = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF]
    seen = 0
    for lead in range(0x80, 0x100):
        for b1 in edges:
            for tail in ([], [0x80], [0xBF, 0x80], [0x80, 0x80, 0x41]):
                raw = bytes([0x41, lead, b1, *tail])
                payload = msgspec.msgpack.encode(FinishRecord("Qxxxxxx", Pos(1, 32), T0)).replace(
                    b"\xa7Qxxxxxx", bytes([0xA0 | len(raw)]) + raw)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = None
                got = columns(FinishRecord, [payload], "c")
                if text is None:
                    assert got is None, raw
                else:
                    assert got is not None and got["queue_id"].to_pylist() == [text], raw
                    seen += 1
    assert seen > 100


def test_arrays_longer_than_the_numpy_decoders_limit():
    """257 and 1,000 outcomes in one record, 300 recipients: the numpy decoder leaves them to msgspec
    (its loop per element index), the C decoder takes them, with msgspec's values."""
    outs = tuple(Outcome(i, "delivered", 250, "2.0.0", f"ok {i}") for i in range(1000))
    recs = [DeliveryRecord("Q1", Pos(1, 32), T0, "mx", outs[:257]), DeliveryRecord("Q2", Pos(1, 33), T0, "mx", outs)]
    got = columns(DeliveryRecord, payloads_of(recs), "c")
    assert columns(DeliveryRecord, payloads_of(recs), "numpy") is None
    assert got is not None and same(got, columns_of_rows(DeliveryRecord, [_as_row(r) for r in recs]))
    env = EnvelopeRecord("Q3", 0, T0, T0, "s@x", tuple(Recipient(i, f"r{i}@y", (("NOTIFY", "NEVER"),)) for i in range(300)),
                         Pos(1, 32), 13)
    got = columns(EnvelopeRecord, payloads_of([env]), "c")
    assert got is not None and same(got, columns_of_rows(EnvelopeRecord, [_as_row(env)]))


def test_the_decoders_arguments_are_checked():
    """A program that does not parse, names a column it lacks or of another kind, starts and ends of other
    lengths: ValueError. Payload bounds outside the buffer: declined (None), never read."""
    prog = columnar._program(FinishRecord)
    assert prog is not None
    payload = payloads_of([FinishRecord("Q1", Pos(1, 32), T0)])[0]
    st_, en = np.array([0], np.int64).tobytes(), np.array([len(payload)], np.int64).tobytes()
    assert source._cseg.decode(payload, st_, en, prog.ops, prog.kinds, prog.nullable) is not None
    ops = np.frombuffer(prog.ops, np.int32)
    bad_programs = [
        prog.ops[:-4],                                                     # cut short
        prog.ops + prog.ops,                                               # two ops
        np.concatenate([[99], ops[1:]]).astype(np.int32).tobytes(),       # an unknown opcode
        np.concatenate([[ops[0], ops[1] + 1], ops[2:]]).astype(np.int32).tobytes(),  # a wrong length
        np.concatenate([ops, [0]]).astype(np.int32).tobytes(),
        b"",
    ]
    for bad in bad_programs:
        with pytest.raises(ValueError):
            source._cseg.decode(payload, st_, en, bad, prog.kinds, prog.nullable)
    with pytest.raises(ValueError):  # a column of another kind
        source._cseg.decode(payload, st_, en, prog.ops, bytes([6]) + prog.kinds[1:], prog.nullable)
    with pytest.raises(ValueError):  # fewer columns than the program names
        source._cseg.decode(payload, st_, en, prog.ops, prog.kinds[:-1], prog.nullable[:-1])
    with pytest.raises(ValueError):
        source._cseg.decode(payload, st_, en + en, prog.ops, prog.kinds, prog.nullable)
    for s_, e_ in ((0, len(payload) + 1), (-1, 4), (5, 4)):
        bounds = np.array([s_], np.int64).tobytes(), np.array([e_], np.int64).tobytes()
        assert source._cseg.decode(payload, *bounds, prog.ops, prog.kinds, prog.nullable) is None


class _Inner(msgspec.Struct, array_like=True):
    kinds: tuple[typing.Literal["x", "z"], ...]


class _Outer(msgspec.Struct, array_like=True, tag=9):
    items: tuple[_Inner, ...]
    state: typing.Literal["on", "off"] | None = None


def test_a_literal_is_checked_at_every_depth_or_left_to_numpy():
    """A Literal two arrays deep (its values not kept, so the C decoder could not check them): the class gets
    no C program, and a value outside the Literal is declined as numpy and msgspec decline it. An optional
    Literal that is null in every record is taken by both decoders."""
    assert columnar._program(_Outer) is None
    bad = msgspec.msgpack.encode(_Outer((_Inner(("x",)),))).replace(b"\xa1x", b"\xa1y")
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=_Outer)
    assert columns(_Outer, [bad]) is None
    nulls = [msgspec.msgpack.encode(FinishRecord(f"Q{i}", Pos(1, 32), T0)) for i in range(3)]
    assert columns(FinishRecord, nulls, "c") is not None

    class Opt(msgspec.Struct, array_like=True):
        state: typing.Literal["on", "off"] | None = None

    payloads = [msgspec.msgpack.encode(Opt()) for _ in range(3)]
    c, n = columns(Opt, payloads, "c"), columns(Opt, payloads, "numpy")
    assert c is not None and n is not None and same(c, n)
    assert columns(Opt, [msgspec.msgpack.encode(Opt("on")), b"\x91\xa3bad"], "c") is None


def test_buffers_at_any_address():
    """The payload, starts, ends and program passed at odd addresses (memoryviews one byte in): the same
    columns as from aligned bytes."""
    prog = columnar._program(FinishRecord)
    assert prog is not None
    payloads = payloads_of([FinishRecord(f"Q{i}", Pos(1, 32 + i), T0 + i) for i in range(5)])
    blob = b"".join(payloads)
    ends = np.cumsum([len(p) for p in payloads]).astype(np.int64)
    starts = ends - np.array([len(p) for p in payloads], np.int64)

    def odd(b: bytes) -> memoryview:
        return memoryview(b"x" + b)[1:]

    aligned = source._cseg.decode(blob, starts.tobytes(), ends.tobytes(), prog.ops, prog.kinds, prog.nullable)
    shifted = source._cseg.decode(odd(blob), odd(starts.tobytes()), odd(ends.tobytes()), odd(prog.ops),
                                  odd(prog.kinds), odd(prog.nullable))
    assert aligned is not None and shifted == aligned


def _domains_by_kernels(a: pa.Array) -> pa.Array:
    """source._domains as it runs without the C module (its definition): Arrow kernels where every address is
    ASCII, else Python's str.lower once per distinct address."""
    saved = source._cseg
    source._cseg = None
    try:
        return source._domains(a)
    finally:
        source._cseg = saved


@given(st.lists(st.one_of(st.none(), st.text(alphabet="aZ@.\n-Ä\x00x", max_size=10)), max_size=30),
       st.integers(0, 3))
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_domains_in_c_equal_the_kernels(values, cut):
    """source._domains (the C module's ``domains`` where every address is ASCII) against its definition by
    Arrow kernels and Python, on addresses with several or no @, upper case, NUL, newlines, non-ASCII letters,
    nulls, and on slices (an array offset)."""
    a = pa.array(values, pa.string())
    if cut and len(a) > cut:
        a = a.slice(cut, len(a) - cut)
    got = source._domains(a)
    got.validate(full=True)
    assert got.to_pylist() == _domains_by_kernels(a).to_pylist()


def test_domains_refuses_bad_offsets():
    """Offsets that run backwards or past the data are a ValueError, never a read outside the buffer."""
    cseg = columnar._cseg
    for offs in ([0, 5, 3], [0, 99], [-1, 2], [0]):
        if offs == [0]:
            assert cseg.domains(np.asarray(offs, np.int32), b"") == (b"\x00\x00\x00\x00", b"")
            continue
        with pytest.raises(ValueError):
            cseg.domains(np.asarray(offs, np.int32), b"abcdef")
    with pytest.raises(ValueError):
        cseg.domains(b"\x00\x00\x00", b"")
    assert cseg.domains(np.asarray([0, 3], np.int32), b"a\xc3\xa4") is None  # not ASCII: the caller's turn
