"""Small files replaced whole and durably: a directory of cache entries in the spool (e.g. MTA-STS policies).

:func:`write_atomic` writes a temporary file, fsyncs it, renames it over the target and fsyncs the
directory, all through the :class:`~mtaq.storage.fs.FileSystem` seam: after a crash the target holds the old
content or the new, never a mix; after the function returns, the new content survives a power cut.

:class:`CacheDir` keeps one such file per key (``DIR/<key>.json``); keys are made safe for a file name. It is
what :mod:`mtaq.delivery.mtasts` calls a ``PolicyStore`` (delivery may not import storage: the daemon passes
a CacheDir in).
"""

from __future__ import annotations

import errno
import os
import re

from mtaq.storage.fs import FileSystem, OsFileSystem, replace_file

__all__ = ["CacheDir", "read_or_none", "write_atomic"]

_TMP = ".tmp"


def write_atomic(fs: FileSystem, path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``: temporary file, fsync, rename, fsync of the directory
    (:func:`~mtaq.storage.fs.replace_file`). Raises OSError (the target is then unchanged; a temporary file
    may be left, which the next write replaces)."""
    replace_file(fs, path, data, tmp=f"{path}.{os.getpid()}{_TMP}")


def read_or_none(fs: FileSystem, path: str) -> bytes | None:
    """The content of ``path``; None when it does not exist."""
    try:
        return fs.read_file(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise


_UNSAFE = re.compile(r"[^a-z0-9._-]")


def key_file(key: str) -> str:
    """A file name for ``key``: lower case; characters other than ``a-z0-9._-`` as ``%XX``; never hidden."""
    name = _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), key.lower())
    if not name or name.startswith("."):
        name = "%2E" + name[1:] if name else "%00"
    return name + ".json"


class CacheDir:
    """Entries ``DIR/<key>.json``, each replaced whole and durably (:func:`write_atomic`). The directory is
    created at the first write."""

    def __init__(self, path: str, fs: FileSystem | None = None) -> None:
        self.path = path
        self.fs: FileSystem = fs or OsFileSystem()
        self._made = False

    def load(self, key: str) -> bytes | None:
        """The stored bytes of ``key``, None when there are none. Raises OSError on a read error."""
        return read_or_none(self.fs, os.path.join(self.path, key_file(key)))

    def save(self, key: str, data: bytes) -> None:
        """Store ``data`` as ``key``, durably. Raises OSError."""
        if not self._made:
            self.fs.makedirs(self.path)
            parent = os.path.dirname(os.path.abspath(self.path))
            self.fs.fsync_dir(parent)  # the directory's own entry
            self._made = True
        write_atomic(self.fs, os.path.join(self.path, key_file(key)), data)

    def keys(self) -> list[str]:
        """File names of the stored entries (temporary files left out)."""
        try:
            return sorted(n for n in self.fs.listdir(self.path) if n.endswith(".json"))
        except FileNotFoundError:
            return []
