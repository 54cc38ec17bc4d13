"""mtaq: a crash-only, log-structured mail queue daemon (SMTP relay).

The public pieces: the record types and codec (:mod:`mtaq.core`), the log (:mod:`mtaq.storage.log`),
the queue (:mod:`mtaq.queue.store`) and the command line (:mod:`mtaq.cli`).
"""

from mtaq.core.errors import ConfigError, CorruptRecord, MtaqError, StorageError, StorageFatal, StorageFull
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
)

__all__ = [
    "ConfigError",
    "CorruptRecord",
    "DataRecord",
    "DeliveryRecord",
    "EnvelopeRecord",
    "FinishRecord",
    "MtaqError",
    "Outcome",
    "Pos",
    "Recipient",
    "SealRecord",
    "StartRecord",
    "StorageError",
    "StorageFatal",
    "StorageFull",
]
__version__ = "0.1.0"
