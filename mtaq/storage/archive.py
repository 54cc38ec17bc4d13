"""The segment archive: reclaimed segments are copied here before they are unlinked, so history outlives the queue.

A segment is archived as-is, byte for byte (``.seg``), or compressed as one zstd frame (``.seg.zst``; the
frame records the content size). The file name carries the segment number and its checksum salt,
``000000000042-1a2b3c4d.seg[.zst]``: numbers restart when a spool is re-created, salts do not repeat, so an
archive never overwrites another spool's history, and readers can tell two copies of one segment apart
from two different segments.

What must always hold:

* an archive file is complete or absent: it is written as ``.NAME.tmp``, fsync'd, renamed into place and the
  directory fsync'd; only then may the caller unlink the segment (a crash in between leaves the segment,
  which is archived again, under the same name, at the next reclaim);
* archiving reads the segment through its own handle and never writes to the log: it runs in a thread
  while the queue goes on (the daemon hands it only segments that are wholly garbage and sealed);
* any failure raises :class:`ArchiveError` and leaves the segment alone; nothing here is fatal to the queue.

Retention deletes archive files whose modification time (the time of archiving) is more than
``retention_s`` seconds old; 0 keeps everything.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from mtaq.core.errors import MtaqError
from mtaq.core.frame import (
    SEGMENT_HEADER_BYTES,
    HeaderError,
    SegmentHeader,
    decode_segment_header,
    salvage_segment_header,
)
from mtaq.storage.fs import File, FileSystem

__all__ = ["ARCHIVE_NAME", "ArchiveError", "Archived", "SegmentArchive", "archive_name"]

CHUNK_BYTES = 1 << 20
ARCHIVE_NAME = re.compile(r"^(?P<segment>\d{12})-(?P<salt>[0-9a-f]{8})\.seg(?P<zst>\.zst)?$")


class ArchiveError(MtaqError):
    """A segment could not be archived (I/O error, bad header, archive unwritable); the segment was kept."""


@dataclass(frozen=True, slots=True)
class Archived:
    """One archived segment: where it went, its size before and after compression (bytes), wall seconds."""

    segment: int
    path: str
    bytes: int
    stored_bytes: int
    seconds: float


def archive_name(segment: int, salt: int, compress: str) -> str:
    """The archive file name of segment ``segment`` with checksum salt ``salt`` (``compress``: none | zstd)."""
    return f"{segment:012d}-{salt:08x}.seg" + (".zst" if compress == "zstd" else "")


class SegmentArchive:
    """Copies sealed segments into ``directory`` (created on first use), optionally zstd-compressed.

    ``compress`` is ``"none"`` or ``"zstd"``; ``level`` is the zstd level (1-22). ``retention_s`` (seconds,
    0 = forever) applies in :meth:`expire`. All methods block: the daemon calls them with
    ``asyncio.to_thread``.
    """

    def __init__(
        self,
        fs: FileSystem,
        directory: str,
        *,
        compress: str = "none",
        level: int = 3,
        retention_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if compress not in ("none", "zstd"):
            raise ValueError(f"archive_compress: {compress!r} is not none or zstd")
        self.fs = fs
        self.directory = directory
        self.compress = compress
        self.level = level
        self.retention_s = retention_s
        self.clock = clock

    def _ensure_dir(self) -> None:
        missing = []
        d = os.path.abspath(self.directory)
        while not self.fs.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            self.fs.makedirs(d)
            self.fs.fsync_dir(os.path.dirname(d))

    def store(self, segment: int, src_path: str) -> Archived:
        """Copy the segment file at ``src_path`` into the archive durably; return where it went.

        Raises ArchiveError (the segment file is untouched) when it cannot be read, its header names another
        segment, or the archive cannot be written and fsync'd. A damaged header is archived as it is.
        """
        t0 = time.monotonic()
        try:
            self._ensure_dir()
            src = self.fs.open(src_path)
        except OSError as exc:
            raise ArchiveError(f"segment {segment}: {exc.strerror or exc}") from exc
        tmp = ""
        try:
            size = src.size()
            try:
                header = decode_segment_header(src.pread(0, SEGMENT_HEADER_BYTES))
            except HeaderError:
                # A damaged header (already reported and moved aside by recovery): archived as it is, so
                # history keeps its records and the segment does not pin reclamation; the salt in the name
                # comes from the records (0 when none vouches for one).
                header = salvage_segment_header(segment, src.pread(0, size)) or SegmentHeader(segment, 0, 0)
            if header.segment != segment:
                raise ArchiveError(f"segment {segment}: header names segment {header.segment}")
            name = archive_name(segment, header.salt, self.compress)
            final = os.path.join(self.directory, name)
            tmp = os.path.join(self.directory, f".{name}.tmp")
            if self.fs.exists(tmp):  # left by a crash during an earlier attempt
                self.fs.unlink(tmp)
            dst = self.fs.open(tmp, create=True)
            try:
                stored = self._copy(src, size, dst)
                dst.fsync()
            finally:
                dst.close()
            self.fs.rename(tmp, final)
            tmp = ""
            self.fs.fsync_dir(self.directory)
        except OSError as exc:
            raise ArchiveError(f"segment {segment}: {exc.strerror or exc}") from exc
        finally:
            src.close()
            if tmp:
                try:
                    self.fs.unlink(tmp)
                except OSError:
                    pass
        return Archived(segment, final, size, stored, time.monotonic() - t0)

    def _copy(self, s: File, size: int, d: File) -> int:
        """Copy ``size`` bytes of ``s`` to ``d`` in 1 MiB chunks (compressing them); return bytes written."""
        cobj = None
        if self.compress == "zstd":
            import zstandard

            cobj = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compressobj(size=size)
        stored = 0
        off = 0
        while off < size:
            chunk = s.pread(off, min(CHUNK_BYTES, size - off))
            if not chunk:
                raise OSError(f"segment shrank to {off} of {size} bytes while being archived")
            off += len(chunk)
            out = cobj.compress(chunk) if cobj is not None else chunk
            if out:
                d.append(out)
                stored += len(out)
        if cobj is not None:
            out = cobj.flush()
            d.append(out)
            stored += len(out)
        return stored

    def expire(self) -> list[str]:
        """Delete archive files older than ``retention_s`` (by modification time); return their paths.

        Does nothing when ``retention_s`` is 0 or the directory does not exist yet. Raises ArchiveError
        when a file cannot be deleted.
        """
        if self.retention_s <= 0 or not self.fs.exists(self.directory):
            return []
        cutoff = self.clock() - self.retention_s
        gone = []
        try:
            for name in sorted(self.fs.listdir(self.directory)):
                if not ARCHIVE_NAME.match(name):
                    continue
                path = os.path.join(self.directory, name)
                if os.stat(path).st_mtime < cutoff:
                    self.fs.unlink(path)
                    gone.append(path)
            if gone:
                self.fs.fsync_dir(self.directory)
        except OSError as exc:
            raise ArchiveError(f"archive retention in {self.directory}: {exc.strerror or exc}") from exc
        return gone
