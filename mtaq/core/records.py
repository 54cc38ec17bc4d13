"""Record types of the queue log and their payload codec (pure: standard library + msgspec).

The queue is one append-only log of records (seed 001, fanf 2006):

* ``DATA``      the message content, byte for byte as received (after SMTP dot-unstuffing);
* ``ENVELOPE``  everything needed to route the message, with a reference (``data``) to its DATA record;
                a *replacement* envelope (``replaces`` set) carries the recipients left to retry;
* ``START``     a delivery attempt began; links back to the envelope it works on (which becomes garbage);
* ``DELIVERY``  a delta: a set of recipients and their outcome, made durable (fsync) before they count as done;
* ``FINISH``    no recipients left; the message leaves the queue;
* ``SEAL``      the last record of a segment that was rolled over; a sealed segment cannot have a torn tail.

What must always hold: records only ever refer *backwards* (to positions earlier in the log), so that
deleting a prefix of wholly-garbage segments can never leave a dangling reference that matters.

Payloads are msgpack arrays (msgspec ``array_like`` structs); framing, checksums and segment headers live in
:mod:`mtaq.core.frame`.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

__all__ = [
    "RECORD_TYPE_OF",
    "DataRecord",
    "DeliveryRecord",
    "EnvelopeRecord",
    "FinishRecord",
    "Outcome",
    "PayloadError",
    "Pos",
    "Recipient",
    "Record",
    "RecordType",
    "SealRecord",
    "StartRecord",
    "decode_payload",
    "encode_payload",
]


class RecordType(enum.IntEnum):
    """The one-byte type tag in every frame header (see docs/log_format.md)."""

    DATA = 1
    ENVELOPE = 2
    START = 3
    DELIVERY = 4
    FINISH = 5
    SEAL = 6


class Pos(msgspec.Struct, frozen=True, array_like=True, order=True):
    """A record's position in the log: segment number and byte offset of its frame header in that segment."""

    segment: int
    offset: int

    def __str__(self) -> str:
        return f"{self.segment}:{self.offset}"


Status = Literal["delivered", "deferred", "failed"]


class Recipient(msgspec.Struct, frozen=True, array_like=True):
    """One envelope recipient.

    ``index`` is the recipient's number in the original envelope (stable across replacement envelopes);
    ``params`` are its ESMTP RCPT parameters (RFC 3461 NOTIFY/ORCPT, kept for DSNs); ``last_reply`` is the
    reason of the last attempt ("" before the first); ``unknown`` is True when a crash left the outcome of the
    last attempt unknown (remote may have said 250 before our delivery record was durable; GUIDE I4).
    """

    index: int
    address: str
    params: tuple[tuple[str, str], ...] = ()
    last_reply: str = ""
    unknown: bool = False


class Outcome(msgspec.Struct, frozen=True, array_like=True):
    """A final per-recipient reply: 2xx -> delivered, 4xx (or no reply) -> deferred, 5xx -> failed."""

    index: int
    status: Status
    code: int
    enhanced: str
    text: str


class DataRecord(msgspec.Struct, frozen=True, array_like=True, tag=int(RecordType.DATA)):
    """The message content (bytes, CRLF line ends as received), owned by ``queue_id``."""

    queue_id: str
    body: bytes


class EnvelopeRecord(msgspec.Struct, frozen=True, array_like=True, tag=int(RecordType.ENVELOPE)):
    """Everything needed to route a message.

    Times are UTC seconds since the epoch (float). ``generation`` is 0 for the envelope written at receipt
    and grows by one with each replacement; ``replaces`` is the position of the START record whose attempt
    this replacement concludes (None for generation 0). ``not_before_ts`` is when the next attempt is due.
    ``attempts`` counts the delivery attempts already made. ``size`` is len(body) in bytes.
    """

    queue_id: str
    generation: int
    arrival_ts: float
    not_before_ts: float
    sender: str
    recipients: tuple[Recipient, ...]
    data: Pos
    size: int
    attempts: int = 0
    mail_params: tuple[tuple[str, str], ...] = ()
    client: str = ""
    helo: str = ""
    replaces: Pos | None = None


class StartRecord(msgspec.Struct, frozen=True, array_like=True, tag=int(RecordType.START)):
    """A delivery attempt of the envelope at ``envelope`` began at ``ts`` (UTC seconds)."""

    queue_id: str
    envelope: Pos
    ts: float


class DeliveryRecord(msgspec.Struct, frozen=True, array_like=True, tag=int(RecordType.DELIVERY)):
    """Final replies for a set of recipients of the attempt started at ``start``; ``relay`` names the next hop."""

    queue_id: str
    start: Pos
    ts: float
    relay: str
    outcomes: tuple[Outcome, ...]


class FinishRecord(msgspec.Struct, frozen=True, array_like=True, tag=int(RecordType.FINISH)):
    """The attempt started at ``start`` left no recipients: the message is done."""

    queue_id: str
    start: Pos
    ts: float


class SealRecord(msgspec.Struct, frozen=True, array_like=True, tag=int(RecordType.SEAL)):
    """The last record of segment ``segment``, which holds ``records`` records before this one."""

    segment: int
    records: int


Record = DataRecord | EnvelopeRecord | StartRecord | DeliveryRecord | FinishRecord | SealRecord

RECORD_TYPE_OF: dict[type, RecordType] = {
    DataRecord: RecordType.DATA,
    EnvelopeRecord: RecordType.ENVELOPE,
    StartRecord: RecordType.START,
    DeliveryRecord: RecordType.DELIVERY,
    FinishRecord: RecordType.FINISH,
    SealRecord: RecordType.SEAL,
}

_CLASS_OF: dict[int, type] = {int(v): k for k, v in RECORD_TYPE_OF.items()}
_ENCODER = msgspec.msgpack.Encoder()
# Frames carry the type byte, so each payload is decoded with its own (untagged) decoder.
_DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {t: msgspec.msgpack.Decoder(cls) for t, cls in _CLASS_OF.items()}


class PayloadError(ValueError):
    """A frame with a good checksum whose payload does not decode as its record type (a format bug)."""


def encode_payload(record: Record) -> tuple[RecordType, bytes]:
    """Return the frame type and the msgpack payload of ``record``.

    The struct tag is not part of the payload (array_like structs with a tag would prepend it); the
    frame header carries the type instead.
    """
    rtype = RECORD_TYPE_OF[type(record)]
    # msgspec encodes a tagged array_like struct as [tag, *fields]; strip nothing - keep the tag as a
    # redundant self-check so a payload decoded under the wrong type byte fails loudly.
    return rtype, _ENCODER.encode(record)


def decode_payload(rtype: int, payload: bytes | memoryview) -> Record:
    """Decode the payload of a frame of type ``rtype``.

    Raises :class:`PayloadError` for an unknown type or a payload that is not a valid record of that type.
    """
    decoder = _DECODERS.get(rtype)
    if decoder is None:
        raise PayloadError(f"unknown record type {rtype}")
    try:
        return decoder.decode(payload)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PayloadError(f"record type {rtype}: {exc}") from exc
