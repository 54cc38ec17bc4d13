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
* ``counts``: messages by state as of ``head``, so that ``mtaq queue size`` never scans the queue;
* ``exporters``, ``exporter_pin``: each event exporter's restart and acknowledged positions, and the oldest
  envelope it may still have to read (issue 37). Absent in checkpoints written before: decoded as none.

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

__all__ = ["CHECKPOINT_MAGIC", "Checkpoint", "CheckpointError", "RestoredRunners", "decode_checkpoint",
           "encode_checkpoint", "restore_runners"]

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
    # (envelope, DATA) of live envelopes naming DATA more than a segment before them (a failed copy
    # forward): those segments are kept (mtaq.queue.store.Queue.data_pins)
    pins: tuple[tuple[Pos, Pos], ...] = ()
    # Event exporters (issue 37; mtaq.daemon.exporter): per endpoint (its URL), where its reader starts again
    # (the START of the oldest attempt it saw open, or its acknowledged position) and the position up to which
    # its events were acknowledged (events of records before it are not sent again).
    exporters: tuple[tuple[str, Pos, Pos], ...] = ()
    # The oldest envelope named by a START at or after the earliest exporter restart position (None: none):
    # reclamation keeps its segment, so that an exporter reading that START can still read the envelope.
    exporter_pin: Pos | None = None


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Checkpoint)


class RestoredRunners(msgspec.Struct, frozen=True):
    """Where each of ``n`` runners starts after a restart, and what it must skip.

    ``positions[k]`` and ``garbage[k]`` for runner k; ``rescan_from``: when a runner took over runners
    that stood at different positions, the earliest of them. Recovery must then read the log from there
    (not only from the working suffix) and add to ``garbage[k]`` every envelope at or after
    ``positions[k]`` that a START names: the runner that stood further ahead had started those.
    """

    positions: list[Pos]
    garbage: list[set[Pos]]
    rescan_from: Pos | None


def restore_runners(positions: tuple[Pos, ...], garbage: tuple[tuple[Pos, ...], ...], n: int) -> RestoredRunners:
    """The start of ``n`` runners from a checkpoint's ``positions`` and ``garbage``, taken with as many
    runners as ``positions`` has (``retry_intervals_s`` may have changed between the runs).

    Runner k reads the envelopes whose ``runner`` r has ``min(r, n - 1) == k``; with ``m`` runners before,
    runner ``min(r, m - 1)`` read them. So new runner k took over old runner ``min(k, m - 1)``, and the last
    new runner also every old runner after it. A runner with one predecessor starts where it stood, with
    its garbage (a new runner beyond the old count: where the old last runner, which read its envelopes,
    stood). A runner with several starts at the earliest of their positions (nothing behind it is left
    unread), with their garbage merged, and :attr:`RestoredRunners.rescan_from` set so that recovery finds
    the envelopes the others had already started (nothing is offered twice). Raises ValueError when
    ``positions`` is empty or ``n`` < 1.
    """
    m = len(positions)
    if m == 0 or n < 1:
        raise ValueError(f"restore_runners: {m} positions, {n} runners")
    out_pos: list[Pos] = []
    out_garbage: list[set[Pos]] = []
    rescan: Pos | None = None
    for k in range(n):
        first = min(k, m - 1)
        sources = range(first, m) if k == n - 1 else range(first, first + 1)
        pos = min(positions[j] for j in sources)
        merged = {g for j in sources if j < len(garbage) for g in garbage[j] if g >= pos}
        if len({positions[j] for j in sources}) > 1:
            rescan = pos if rescan is None else min(rescan, pos)
        out_pos.append(pos)
        out_garbage.append(merged)
    return RestoredRunners(out_pos, out_garbage, rescan)


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
