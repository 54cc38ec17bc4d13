"""Checkpoints of restart positions: their contents and codec (pure).

Seed 001: "find out the current restart positions, fsync() all the queue files, then write these restart
positions to disk." A checkpoint holds:

* ``head``: the end of the log when the positions were taken. Every START after the runner positions
  that a runner must skip was written after this point, or is listed in ``garbage``;
* ``suffix``: the start of the working suffix, i.e. the earliest START not yet concluded (``head`` when none);
* ``runners``: each runner's position. Every envelope of runner k before ``runners[k]`` has been started;
* ``garbage``: for each runner, envelopes ahead of it that were already started (out of band, e.g. by
  recovery or an administrator), which it must skip;
* ``parked``: the live envelopes no runner reads (held, or delayed by FUTURERELEASE) as of ``head``;
  reclamation never deletes a segment holding one;
* ``counts``: messages by state as of ``head``, so that ``mtaq queue size`` never scans the queue.

Recovery reads the log from ``min(suffix, head)`` to the end, and no more (GUIDE I5). A checkpoint is
advisory. A torn, stale or missing one only makes the scan longer. Positions in segments that have been
reclaimed are clamped to the oldest segment left.

File format: ``"MTAQCKP1"`` magic, u32 payload length, u32 CRC-32 of the payload, then the msgpack payload.
"""

from __future__ import annotations

import struct
import zlib

import msgspec

from mtaq.core.records import Pos

__all__ = ["CHECKPOINT_MAGIC", "Checkpoint", "CheckpointError", "decode_checkpoint", "encode_checkpoint"]

CHECKPOINT_MAGIC = b"MTAQCKP1"
_HDR = struct.Struct("<8sII")


class CheckpointError(ValueError):
    """A checkpoint file that is short, has the wrong magic, or fails its checksum."""


class Checkpoint(msgspec.Struct, frozen=True, array_like=True):
    """Restart positions (see the module docstring); ``written_ts`` in UTC seconds."""

    head: Pos
    suffix: Pos
    runners: tuple[Pos, ...]
    garbage: tuple[tuple[Pos, ...], ...]
    written_ts: float
    parked: tuple[Pos, ...] = ()  # live parked envelopes (held or delayed) as of head
    counts: tuple[tuple[str, int], ...] = ()  # messages by state as of head (QueueCounts), for a cheap size


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Checkpoint)


def encode_checkpoint(cp: Checkpoint) -> bytes:
    payload = _ENC.encode(cp)
    return _HDR.pack(CHECKPOINT_MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_checkpoint(buf: bytes) -> Checkpoint:
    """Decode a checkpoint file; raises CheckpointError naming what is wrong."""
    if len(buf) < _HDR.size:
        raise CheckpointError(f"checkpoint short: {len(buf)} bytes")
    magic, length, crc = _HDR.unpack_from(buf)
    if magic != CHECKPOINT_MAGIC:
        raise CheckpointError("bad checkpoint magic")
    payload = buf[_HDR.size :]
    if len(payload) != length:
        raise CheckpointError(f"checkpoint payload {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise CheckpointError("checkpoint checksum mismatch")
    try:
        return _DEC.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint payload: {exc}") from exc
