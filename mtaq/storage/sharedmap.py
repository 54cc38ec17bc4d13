"""A small JSON map in one file, shared by the processes of one daemon (its workers), not durable.

For state that every worker must see but that may be lost in a crash without harm: the outbound SASL
hold (:mod:`mtaq.delivery.sasl`; Postfix keeps the like in one process for the host). Readers take no lock:
the file is always replaced whole (a temporary file renamed over it), so a reader sees the old map or the
new. Writers are serialized by ``flock(2)`` on ``PATH.lock``, so that two workers' changes are never lost
to each other. Nothing is fsync'd: after a power cut the map may be older or empty, which costs at most a
second try of what it held. :meth:`SharedMap.read` costs one ``stat(2)`` when nothing changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable
from typing import Any

__all__ = ["SharedMap"]

_MAX_BYTES = 1024 * 1024  # a larger file is not ours (or damaged): read as empty, replaced on the next write


class SharedMap:
    """The map in ``path`` (JSON object, string keys). Files are made mode 0600 (the daemon's user only).
    A missing, unreadable or damaged file, or one larger than ``max_bytes`` (default 1 MiB), reads as an
    empty map; :meth:`update` raises OSError when it cannot write (callers treat the map as advisory)."""

    def __init__(self, path: str, *, max_bytes: int = _MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of the map last read
        self._data: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        """The map as it is now (do not change it: :meth:`update` does)."""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._data = None, {}
            return self._data
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen != self._seen:
            self._data = self._load()
            self._seen = seen
        return self._data

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(self.max_bytes + 1)
            data = json.loads(raw) if len(raw) <= self.max_bytes else {}
        except (OSError, ValueError, RecursionError):  # RecursionError: deeply nested JSON (a damaged file)
            return {}
        return data if isinstance(data, dict) else {}

    def update(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Apply ``change`` (which edits the map it is given in place) to the map as it is on disk, under the
        writers' lock, and replace the file with the result. Raises OSError."""
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self._load()
            change(data)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as f:
                f.write(json.dumps(data, separators=(",", ":")).encode("ascii"))
            try:
                os.replace(tmp, self.path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._data, self._seen = data, None
        finally:
            os.close(fd)  # and the lock with it
