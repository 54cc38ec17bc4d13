"""Record payloads decoded straight into Arrow columns, in C or by numpy: no Python object per value.

Where the C module is built (``mtaq/analytics/_segment.c``, optional: ``pip install`` builds it where a
compiler is), the grammar below is compiled from the record classes into a small program
(:func:`_program`) that the C decoder runs over every payload (:func:`_decode_c`); elsewhere numpy parses it
(:func:`decode_columns_numpy`). Both give the same columns (tests/test_analytics_columnar.py,
tests/test_analytics_native.py). The numpy parser is described next.

The payloads of one record type (msgpack arrays, :mod:`mtaq.core.records`) are parsed field by field for
all records at once: a cursor per record moves through its payload, each field's type byte is read for
every record in one gather, and the values (integers, floats, booleans, strings) are assembled from the
bytes as arrays. Nested arrays (an envelope's recipients, a delivery's outcomes) are parsed element by
element over the records that have that many.

The grammar is driven by the record classes' annotations and is a strict *subset* of what msgspec accepts
for them: every field present (the array holds exactly the class's fields, its tag first), integers in any
msgpack width that fits int64, floats as float64, strings as msgpack str (valid UTF-8), booleans, nil for
an optional value, literals checked. Every payload must be consumed to its last byte. Anything else (an
older, shorter array, a float written as an integer, a malformed payload) makes :func:`decode_columns`
return None, and the caller decodes those payloads with msgspec as before, whose verdict stands. So
whatever this module accepts, msgspec would have decoded to the same values.

Columns are keyed by field path: ``queue_id``, ``start.segment`` (a nested struct's field), ``replaces.offset``
(nulls where the optional value is nil), ``recipients`` (an int64 array: the element count of each record)
and ``recipients.address`` (the elements of all records, record after record).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

try:  # the C module (the decoder here, the frame walk in source.py), built by `pip install` where a compiler is
    from mtaq.analytics import _segment
except ImportError:  # not built, or the package shipped to a cluster as a zip of .py files
    _segment = None  # type: ignore[assignment]
_cseg = _segment  # the one name both modules use (None where the module is not built)

__all__ = ["columns_of_rows", "decode_columns", "decode_columns_numpy", "struct_fields"]

_ELEMENTS_MAX = 256  # more elements in one nested array: left to msgspec (a loop per element index here)


def _table(pairs: dict[range | int, int], default: int = 0) -> np.ndarray:
    out = np.full(256, default, np.int64)
    for k, v in pairs.items():
        out[k if isinstance(k, int) else slice(k.start, k.stop)] = v
    return out


# By type byte (msgpack): an integer's width after the byte (0 for a fixint, -1 for no integer), whether it
# is signed, a fixint's value; a string's header bytes (0: no string) and a fixstr's length; an array's
# header bytes (0: no array) and a fixarray's count.
_INT_WIDTH = _table({range(0x80, 0xE0): -1, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8})
_INT_SIGNED = np.isin(np.arange(256), [0xD0, 0xD1, 0xD2, 0xD3])
_INT_FIX = np.where(np.arange(256) >= 0xE0, np.arange(256) - 256, np.arange(256))
_STR_HEAD = _table({range(0xA0, 0xC0): 1, 0xD9: 2, 0xDA: 3, 0xDB: 5})
_STR_FIXLEN = np.where(_STR_HEAD == 1, np.arange(256) & 0x1F, 0)
_ARR_HEAD = _table({range(0x90, 0xA0): 1, 0xDC: 3, 0xDD: 5})
_ARR_FIXCOUNT = np.where(_ARR_HEAD == 1, np.arange(256) & 0x0F, 0)


class _Reject(Exception):
    """A payload outside the grammar: the caller uses msgspec."""


def struct_fields(tp: Any) -> list[tuple[str, Any]] | None:
    """(name, annotation) of a struct's fields, or None when ``tp`` is not a struct."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp)
        return [(f.name, hints[f.name]) for f in msgspec.structs.fields(tp)]
    return None


def _optional(tp: Any) -> Any:
    """X for ``X | None``, else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


class _Parser:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.last = len(buf) - 1

    def byte(self, cur: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The type byte at each cursor (uint8), each inside its payload."""
        if len(cur) and not (cur < ends).all():
            raise _Reject
        return self.buf[cur]  # type: ignore[no-any-return]

    def be(self, pos: np.ndarray, width: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Big-endian unsigned integers of ``width`` (1, 2, 4 or 8) bytes at ``pos`` (inside ``ends``), as uint64."""
        if len(pos) and not (pos + width <= ends).all():
            raise _Reject
        if not len(pos):
            return np.zeros(0, np.uint64)
        w = int(width[0])
        if (width == w).all():  # one width: one gather
            return self.buf[pos[:, None] + np.arange(w)].view(f">u{w}").reshape(-1).astype(np.uint64)
        out = np.empty(len(pos), np.uint64)
        for w in (1, 2, 4, 8):
            lanes = width == w
            at = pos[lanes]
            out[lanes] = self.buf[at[:, None] + np.arange(w)].view(f">u{w}").reshape(-1)
        return out

    def int_(self, cur: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = self.byte(cur, ends)
        width = _INT_WIDTH[b]
        if len(b) and width.min() < 0:
            raise _Reject
        out = _INT_FIX[b]
        wide = np.flatnonzero(width)
        if len(wide):
            w = width[wide]
            raw = self.be(cur[wide] + 1, w, ends[wide])
            signed = _INT_SIGNED[b[wide]]
            if ((~signed) & (raw > np.uint64(2**63 - 1))).any():
                raise _Reject  # beyond int64: msgspec decides
            val = raw.view(np.int64).copy()
            neg = signed & (w < 8) & ((raw >> (w * 8 - 1).astype(np.uint64)) & np.uint64(1) == 1)
            val[neg] -= np.left_shift(np.int64(1), w[neg] * 8)
            out[wide] = val
        return out, cur + 1 + width

    def float_(self, cur: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not (self.byte(cur, ends) == 0xCB).all():
            raise _Reject
        return self.be(cur + 1, np.full(len(cur), 8), ends).view(np.float64), cur + 9

    def bool_(self, cur: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = self.byte(cur, ends)
        if not ((b == 0xC2) | (b == 0xC3)).all():
            raise _Reject
        return b == 0xC3, cur + 1

    def length(self, cur: np.ndarray, ends: np.ndarray, heads: np.ndarray,
               fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A str's or array's length header at each cursor: (lengths, header sizes in bytes). ``heads`` and
        ``fixed`` map the first byte to the header's size (0: not this kind) and to a fix-format length."""
        b = self.byte(cur, ends)
        head = heads[b]
        if len(b) and head.min() == 0:
            raise _Reject
        lens = fixed[b]
        sized = np.flatnonzero(head > 1)
        if len(sized):
            lens[sized] = self.be(cur[sized] + 1, head[sized] - 1, ends[sized]).astype(np.int64)
        return lens, head

    def str_(self, cur: np.ndarray, ends: np.ndarray) -> tuple[pa.Array, np.ndarray]:
        lens, head = self.length(cur, ends, _STR_HEAD, _STR_FIXLEN)
        starts = cur + head
        nxt = starts + lens
        if len(cur) and not (nxt <= ends).all():
            raise _Reject
        offsets = np.zeros(len(cur) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        if total >= 2**31:
            raise _Reject
        offsets32 = offsets.astype(np.int32)
        if not total:
            data = np.zeros(0, np.uint8)
        elif lens.min() == lens.max():  # one length: a 2-D gather
            data = self.buf[starts[:, None] + np.arange(lens[0])].reshape(-1)
        else:
            data = self.buf[np.repeat((starts - offsets[:-1]).astype(np.int32), lens) + np.arange(total, dtype=np.int32)]
        if total and data.max() >= 0x80:  # UTF-8 checked by Python itself, as msgspec does
            lane = np.repeat(np.arange(len(cur)), lens)[data >= 0x80]
            for i in np.unique(lane).tolist():
                try:
                    data[offsets[i] : offsets[i + 1]].tobytes().decode("utf-8")
                except UnicodeDecodeError:
                    raise _Reject from None
        arr = pa.StringArray.from_buffers(len(cur), pa.py_buffer(offsets32), pa.py_buffer(data))
        return arr, nxt

    def array_head(self, cur: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(element counts, cursor after the array header)."""
        counts, head = self.length(cur, ends, _ARR_HEAD, _ARR_FIXCOUNT)
        return counts, cur + head

    def value(self, tp: Any, cur: np.ndarray, ends: np.ndarray, path: str, out: dict[str, Any],
              nested: bool = False) -> np.ndarray:
        """Parse one value of type ``tp`` at each cursor; put its columns into ``out``; the new cursors.
        ``nested``: inside an element of a nested array, whose own nested arrays give their counts only
        (their elements are checked, not kept: no record needs them)."""
        fields = struct_fields(tp)
        if fields is not None:
            counts, cur = self.array_head(cur, ends)
            tag = tp.__struct_config__.tag
            if not (counts == len(fields) + (tag is not None)).all():
                raise _Reject
            if tag is not None:
                if not isinstance(tag, int) or isinstance(tag, bool):
                    raise _Reject
                got, cur = self.int_(cur, ends)
                if not (got == tag).all():
                    raise _Reject
            for name, ftp in fields:
                cur = self.value(ftp, cur, ends, f"{path}.{name}" if path else name, out, nested)
            return cur
        inner = _optional(tp)
        if inner is not None:
            nil = self.byte(cur, ends) == 0xC0
            some = ~nil
            opt: dict[str, Any] = {}
            cur = cur + nil
            cur[some] = self.value(inner, cur[some], ends[some], path, opt, nested)
            take = pa.array(np.cumsum(some) - 1, mask=nil)
            for k, v in opt.items():
                if isinstance(v, np.ndarray):
                    v = pa.array(v)
                out[k] = v.take(take)
            return cur
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            counts, cur = self.array_head(cur, ends)
            if len(counts) and counts.max() > _ELEMENTS_MAX:
                raise _Reject
            out[path] = counts
            parents: list[np.ndarray] = []
            pieces: list[dict[str, Any]] = []
            for j in range(int(counts.max()) if len(counts) else 0):
                live = np.flatnonzero(counts > j)
                sub: dict[str, Any] = {}
                cur[live] = self.value(args[0], cur[live], ends[live], path, sub, True)
                if not nested:
                    parents.append(live)
                    pieces.append(sub)
            if nested:
                return cur
            if not pieces:  # no record has an element: the empty columns, typed as the element's would be
                pieces = [self.empty(args[0], path)]
                parents = [np.zeros(0, np.int64)]
            order = np.argsort(np.concatenate(parents), kind="stable")
            for k in pieces[0]:
                parts = [pa.array(p[k]) if isinstance(p[k], np.ndarray) else p[k] for p in pieces]
                out[k] = pa.concat_arrays(parts).take(pa.array(order))
            return cur
        if origin is tuple:
            counts, cur = self.array_head(cur, ends)
            if not (counts == len(args)).all():
                raise _Reject
            for i, a in enumerate(args):
                cur = self.value(a, cur, ends, f"{path}.{i}", out, nested)
            return cur
        if origin is Literal:
            if all(isinstance(a, str) for a in args):
                col, cur = self.str_(cur, ends)
                if len(col) and not pc.all(pc.is_in(col, pa.array(list(args)))).as_py():
                    raise _Reject
                out[path] = col
                return cur
            raise _Reject
        parse = {int: self.int_, float: self.float_, bool: self.bool_, str: self.str_}.get(tp)
        if parse is None:
            raise _Reject
        out[path], cur = parse(cur, ends)
        return cur

    def empty(self, tp: Any, path: str) -> dict[str, Any]:
        """The columns of ``tp`` at ``path`` for no record at all (their names and types)."""
        out: dict[str, Any] = {}
        self.value(tp, np.zeros(0, np.int64), np.zeros(0, np.int64), path, out, True)
        return out


# The grammar compiled for the C decoder (mtaq/analytics/_segment.c, ``decode``): its opcodes.
_OP_STRUCT, _OP_TUPLE, _OP_ARRAY, _OP_OPT, _OP_INT, _OP_FLOAT, _OP_BOOL, _OP_STR = range(1, 9)
_LEAF_OPS = {int: _OP_INT, float: _OP_FLOAT, bool: _OP_BOOL, str: _OP_STR}


class _Unsupported(Exception):
    """A type the C decoder's program cannot say: the numpy parser decodes that class."""


@dataclasses.dataclass(frozen=True)
class _Program:
    """A record class's grammar for the C decoder: the opcodes (int32), and each column's path, kind, whether
    it is under an optional value, and the strings a Literal allows (None: any)."""

    ops: bytes
    paths: tuple[str, ...]
    kinds: bytes
    nullable: bytes
    literals: tuple[tuple[str, ...] | None, ...]


_Column = tuple[str, int, bool, tuple[str, ...] | None]  # path, kind (an op), under an optional value, literals


def _compile(tp: Any, path: str, depth: int, nullable: bool, cols: list[_Column]) -> list[int]:
    """The ops of a value of type ``tp`` at ``path``, adding its columns to ``cols``. ``depth``: 0 at the top,
    1 inside an element of a top-level array (its arrays keep their counts only), 2 and more inside those
    (nothing kept): as :meth:`_Parser.value` keeps them. Raises _Unsupported."""

    def column(kind: int, literals: tuple[str, ...] | None = None) -> int:
        if depth > 1:
            return -1
        if any(c[0] == path for c in cols):
            raise _Unsupported(path)  # two columns of one path: left to the numpy parser
        cols.append((path, kind, nullable, literals))
        return len(cols) - 1

    fields = struct_fields(tp)
    if fields is not None:
        tag = tp.__struct_config__.tag
        if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < 2**31):
            raise _Unsupported(path)
        body = [op for name, ftp in fields
                for op in _compile(ftp, f"{path}.{name}" if path else name, depth, nullable, cols)]
        return [_OP_STRUCT, 4 + len(body), len(fields), -1 if tag is None else tag, *body]
    inner = _optional(tp)
    if inner is not None:
        first = len(cols)
        body = _compile(inner, path, depth, True, cols)  # an array under it: _Unsupported (not in any record)
        leaves = list(range(first, len(cols)))
        return [_OP_OPT, 3 + len(leaves) + len(body), len(leaves), *leaves, *body]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if nullable:
            raise _Unsupported(path)
        count = column(_OP_INT)
        body = _compile(args[0], path, depth + 1, nullable, cols)
        return [_OP_ARRAY, 4 + len(body), count, int(depth == 0), *body]
    if origin is tuple:
        body = [op for i, a in enumerate(args) for op in _compile(a, f"{path}.{i}", depth, nullable, cols)]
        return [_OP_TUPLE, 3 + len(body), len(args), *body]
    if origin is Literal:
        if not all(isinstance(a, str) for a in args) or depth > 1:
            raise _Unsupported(path)  # depth > 1: a value not kept, so not checked either
        return [_OP_STR, column(_OP_STR, tuple(args))]
    op = _LEAF_OPS.get(tp)
    if op is None:
        raise _Unsupported(path)
    return [op, column(op)]


@functools.cache
def _program(cls: type[msgspec.Struct]) -> _Program | None:
    """``cls``'s program for the C decoder, or None when it has a type the program cannot say."""
    cols: list[_Column] = []
    try:
        ops = _compile(cls, "", 0, False, cols)
    except _Unsupported:
        return None
    return _Program(np.asarray(ops, np.int32).tobytes(), tuple(c[0] for c in cols), bytes(c[1] for c in cols),
                    bytes(int(c[2]) for c in cols), tuple(c[3] for c in cols))


def _bitmap(flags: bytes) -> pa.Buffer:
    return pa.py_buffer(np.packbits(np.frombuffer(flags, np.uint8), bitorder="little"))


def _decode_c(cls: type[msgspec.Struct], buf: np.ndarray, starts: np.ndarray,
              ends: np.ndarray) -> dict[str, Any] | None:
    """:func:`decode_columns` by the C decoder, the same columns as the numpy parser's (``_Parser``): numpy
    arrays for the integer, float and boolean columns, Arrow arrays for the strings and for every column
    under an optional value (with its nulls). None when a payload is outside the grammar. Raises
    RuntimeError when the module is not built, ValueError when ``cls`` has no program."""
    if _cseg is None:
        raise RuntimeError("mtaq.analytics._segment is not built")
    prog = _program(cls)
    if prog is None:
        raise ValueError(f"{cls.__name__}: no program for the C decoder")
    got = _cseg.decode(buf, starts.astype(np.int64).tobytes(), ends.astype(np.int64).tobytes(), prog.ops,
                       prog.kinds, prog.nullable)
    if got is None:
        return None
    out: dict[str, Any] = {}
    for path, kind, literals, (vals, valid, data) in zip(prog.paths, prog.kinds, prog.literals, got, strict=True):
        col: Any
        if kind == _OP_STR:
            n = len(vals) // 4 - 1
            col = pa.StringArray.from_buffers(n, pa.py_buffer(vals), pa.py_buffer(data),
                                              None if valid is None else _bitmap(valid))
            if literals is not None and col.null_count < n:
                if not pc.all(pc.is_in(col.drop_null(), pa.array(list(literals)))).as_py():
                    return None
        else:
            dtype = {_OP_INT: np.int64, _OP_FLOAT: np.float64, _OP_BOOL: np.bool_}[kind]
            col = np.frombuffer(vals, dtype)
            if valid is not None:
                typ = {_OP_INT: pa.int64(), _OP_FLOAT: pa.float64(), _OP_BOOL: pa.bool_()}[kind]
                values = _bitmap(vals) if kind == _OP_BOOL else pa.py_buffer(vals)
                col = pa.Array.from_buffers(typ, len(col), [_bitmap(valid), values])
        out[path] = col
    return out


def decode_columns(cls: type[msgspec.Struct], buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> dict[str, Any] | None:
    """The columns of the payloads ``buf[starts[i]:ends[i]]``, each a record of ``cls`` (see the module
    docstring), or None when any payload is outside the grammar (then decode them with msgspec). By the C
    decoder where it is built (:func:`_decode_c`), else by numpy (:func:`decode_columns_numpy`): the same
    columns, the same grammar."""
    if _cseg is not None and len(starts) and _program(cls) is not None:
        return _decode_c(cls, buf, starts, ends)
    return decode_columns_numpy(cls, buf, starts, ends)


def decode_columns_numpy(cls: type[msgspec.Struct], buf: np.ndarray, starts: np.ndarray,
                         ends: np.ndarray) -> dict[str, Any] | None:
    """:func:`decode_columns` by numpy (where the C module is not built, and for the tests)."""
    out: dict[str, Any] = {}
    try:
        with np.errstate(over="ignore"):
            cur = _Parser(buf).value(cls, starts.astype(np.int64), ends.astype(np.int64), "", out)
    except _Reject:
        return None
    if not np.array_equal(cur, ends):
        return None
    return out


def columns_of_rows(cls: Any, rows: list[Any], path: str = "", out: dict[str, Any] | None = None,
                    nested: bool = False) -> dict[str, Any]:
    """The columns :func:`decode_columns` gives, from rows decoded by msgspec (tuples: the record's tag first,
    nested structs as tuples too), for the payloads it leaves to msgspec."""
    if out is None:
        out = {}
    fields = struct_fields(cls)
    if fields is not None:
        first = 0 if cls.__struct_config__.tag is None else 1
        cols = list(zip(*rows, strict=True)) if rows else [()] * (len(fields) + first)
        for i, (name, ftp) in enumerate(fields):
            columns_of_rows(ftp, list(cols[first + i]), f"{path}.{name}" if path else name, out, nested)
        return out
    inner = _optional(cls)
    if inner is not None:
        nil = np.array([v is None for v in rows], bool)
        sub = columns_of_rows(inner, [v for v in rows if v is not None], path, None, nested)
        take = pa.array(np.cumsum(~nil) - 1, mask=nil)
        for k, v in sub.items():
            out[k] = (pa.array(v) if isinstance(v, np.ndarray) else v).take(take)
        return out
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        out[path] = np.fromiter(map(len, rows), np.int64, len(rows))
        return out if nested else columns_of_rows(args[0], [e for r in rows for e in r], path, out, True)
    if origin is tuple:
        cols = list(zip(*rows, strict=True)) if rows else [()] * len(args)
        for i, a in enumerate(args):
            columns_of_rows(a, list(cols[i]), f"{path}.{i}", out, nested)
        return out
    if origin is Literal:
        out[path] = pa.array(rows, pa.string() if all(isinstance(a, str) for a in args) else pa.int64())
        return out
    typ = {int: pa.int64(), float: pa.float64(), bool: pa.bool_(), str: pa.string()}[cls]
    out[path] = pa.array(rows, typ)
    return out
