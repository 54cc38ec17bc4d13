"""How the shards of a spool written by several workers are named (pure: no I/O): shard 0 is the spool
directory itself, shard k >= 1 the subdirectory ``shard-k``. :mod:`mtaq.storage.shards` finds them on disk,
:mod:`mtaq.analytics.source` through ``pyarrow.fs``."""

from __future__ import annotations

__all__ = ["SHARD_PREFIX", "shard_of"]

SHARD_PREFIX = "shard-"


def shard_of(name: str) -> int | None:
    """The shard k >= 1 a directory name ``shard-k`` stands for, or None when ``name`` is not one."""
    num = name[len(SHARD_PREFIX) :]
    if name.startswith(SHARD_PREFIX) and num.isdigit() and int(num) >= 1:
        return int(num)
    return None
