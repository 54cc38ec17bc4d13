"""Checkpoint files: written atomically (tmp, fsync, rename, fsync the directory), read defensively.

A checkpoint is advisory (seed 001). :func:`read_checkpoint` returns None, with the reason, for a missing,
torn or garbled file, and recovery then scans the whole log.
"""

from __future__ import annotations

import os

from mtaq.core.checkpoint import Checkpoint, CheckpointError, decode_checkpoint, encode_checkpoint
from mtaq.storage.fs import FileSystem, replace_file
from mtaq.testing import killpoints

__all__ = ["CHECKPOINT_NAME", "read_checkpoint", "write_checkpoint"]

CHECKPOINT_NAME = "checkpoint"


def write_checkpoint(fs: FileSystem, spool: str, cp: Checkpoint) -> None:
    """Replace ``SPOOL/checkpoint`` with ``cp`` atomically. The caller has fsync'd the log first.

    Raises OSError; a crash at any point leaves either the old or the new checkpoint (or, before the
    first rename, none), never a mixture.
    """
    replace_file(fs, os.path.join(spool, CHECKPOINT_NAME), encode_checkpoint(cp),
                 before_rename=lambda: killpoints.hit("checkpoint.after_tmp"))


def read_checkpoint(fs: FileSystem, spool: str) -> tuple[Checkpoint | None, str]:
    """The checkpoint in ``spool`` and "" , or None and why not."""
    path = os.path.join(spool, CHECKPOINT_NAME)
    if not fs.exists(path):
        return None, "no checkpoint"
    try:
        return decode_checkpoint(fs.read_file(path)), ""
    except CheckpointError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"reading checkpoint: {exc.strerror or exc}"
