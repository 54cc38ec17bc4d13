"""Where the shards of a spool written by several workers live (:mod:`mtaq.daemon.workers`): shard 0 is the
spool directory itself, shard k >= 1 is ``SPOOL/shard-k``. Read by the daemon, the log tools and
``mtaq queue`` when the daemon is down."""

from __future__ import annotations

import os

from mtaq.core.shard import SHARD_PREFIX, shard_of

__all__ = ["SHARD_PREFIX", "existing_shards", "shard_dir", "shard_dirs"]


def shard_dir(spool: str, shard: int) -> str:
    """The spool directory of shard ``shard``: the spool itself for 0, ``SPOOL/shard-k`` otherwise."""
    return spool if shard == 0 else os.path.join(spool, f"{SHARD_PREFIX}{shard}")


def existing_shards(spool: str) -> list[int]:
    """The shards k >= 1 that have a directory in ``spool``, ascending (none when the spool is missing)."""
    try:
        names = os.listdir(spool)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        k = shard_of(name)
        if k is not None and os.path.isdir(os.path.join(spool, name)):
            out.append(k)
    return sorted(out)


def shard_dirs(spool: str) -> list[tuple[int, str]]:
    """``(shard, directory)`` of every shard of ``spool``, shard 0 (the spool itself) first."""
    return [(k, shard_dir(spool, k)) for k in [0, *existing_shards(spool)]]
