"""One error root for mtaq, split by whose fault it is and whether a retry can help (GUIDE §6.3)."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptRecord",
    "MtaqError",
    "StorageError",
    "StorageFatal",
    "StorageFull",
]


class MtaqError(Exception):
    """Root of every error mtaq raises on purpose."""


class ConfigError(MtaqError):
    """A bad configuration key or command-line value; the message names the key and the problem."""


class StorageError(MtaqError):
    """A write to the spool failed; nothing was acknowledged. Transient: SMTP answers ``451 4.3.0``."""

    smtp_reply = "451 4.3.0 Error: queue file write error"


class StorageFull(StorageError):
    """No space left on the spool device (ENOSPC); no half record is left behind. SMTP: ``452 4.3.1``."""

    smtp_reply = "452 4.3.1 Insufficient system storage"


class QueueBusy(StorageError):
    """Back-pressure: too many messages wait for their fsync (``commit_backlog_max``). Nothing was
    written. SMTP: ``451 4.3.2`` (RFC 3463: system not accepting network messages), try again later."""

    smtp_reply = "451 4.3.2 System busy, try again later"


class StorageFatal(StorageError):
    """An fsync failed (or an earlier one did): durability of everything unsynced is unknown.

    The process must exit and recovery must re-read the disk; an fsync is never retried and trusted
    (GUIDE I6, PostgreSQL "fsyncgate"). Every later append and commit raises this too.
    """


class CorruptRecord(MtaqError):
    """A record that should be there does not check out (bad frame, checksum or payload)."""
