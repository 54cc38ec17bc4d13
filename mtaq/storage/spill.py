"""A message body while it is being received: memory up to a bound, then an unnamed temporary file.

Issue 13.4: a session receiving a 10 MB message used to hold the whole message (several copies of it) in
memory until it was appended to the log. :class:`BodyBuffer` keeps at most ``memory_bytes`` in memory; what
comes after goes, in chunks of ``chunk_bytes``, to an *unnamed* temporary file in the spool directory
(``O_TMPFILE`` through :func:`tempfile.TemporaryFile`: the kernel frees it when it is closed or the process
dies, so a crash leaves nothing behind and recovery has nothing to clean up). The file is never fsync'd:
the body is durable only once :meth:`mtaq.storage.log.Log.append_stream` has copied it into the log in
chunks and the covering fsync is done (the 250 comes after, as for every message).

Memory per receiving session is therefore bounded by ``memory_bytes`` + ``chunk_bytes``, not by
``message_size_limit_bytes``. A write error on the temporary file (ENOSPC, EIO) does not end the session:
the buffer remembers it, keeps counting bytes, and :attr:`failure` makes the queue answer 452/451 after
the final dot (nothing is acknowledged).

Each spilled body holds one descriptor beside its session's socket. The daemon's open-files check counts
one per connection (``mtaq.daemon.process.open_files_needed``), so the temporary files get what the limit
leaves beyond it, :func:`set_spill_files_max`: a body that would spill past that gets the EMFILE
:attr:`BodyBuffer.failure` at once (451 4.3.0 after the dot), instead of taking the descriptor the next
``accept()`` needs (review finding B6: the mynetworks reserve of ``connections_max`` must hold).
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import IO

__all__ = ["CHUNK_BYTES", "MEMORY_BYTES", "BodyBuffer", "set_spill_files_max", "spill_files_open"]

MEMORY_BYTES = 256 * 1024  # default: bodies up to this size never touch the temporary file
CHUNK_BYTES = 64 * 1024  # bytes written to, and read back from, the temporary file at a time

_lock = threading.Lock()
_spill_files_max: int | None = None  # None: no bound (tests, tools); the daemon sets it at start
_spill_files_open = 0


def set_spill_files_max(n: int | None) -> None:
    """Bound the temporary body files open at once in this process to ``n`` (None: no bound). Set by
    ``mtaq serve`` to RLIMIT_NOFILE's soft limit minus what ``open_files_needed`` keeps for connections, the
    log and the rest."""
    global _spill_files_max
    with _lock:
        _spill_files_max = None if n is None else max(0, n)


def spill_files_open() -> int:
    """How many temporary body files are open now in this process."""
    return _spill_files_open


def _take_spill_file() -> bool:
    global _spill_files_open
    with _lock:
        if _spill_files_max is not None and _spill_files_open >= _spill_files_max:
            return False
        _spill_files_open += 1
        return True


def _give_spill_file() -> None:
    global _spill_files_open
    with _lock:
        _spill_files_open -= 1


class BodyBuffer:
    """The body of one message being received (bytes, CRLF line ends, dot-unstuffed).

    ``head`` (bytes, default empty) is put before what was written, once known (the ``Received:`` header,
    written when the message is complete). :attr:`size` is ``len(head)`` + every byte written (bytes).
    Not thread-safe; one per SMTP transaction. :meth:`close` frees the file (idempotent).
    """

    def __init__(self, directory: str, *, memory_bytes: int = MEMORY_BYTES, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.directory = directory
        self.memory_bytes = memory_bytes
        self.chunk_bytes = chunk_bytes
        self.head = b""
        # replace_start: the first _skip octets written are read as _start instead (header rewriting)
        self._skip = 0
        self._start = b""
        self._mem = bytearray()
        self._file: IO[bytes] | None = None
        self._in_file = 0  # bytes in the temporary file
        self._written = 0
        self.failure: OSError | None = None  # the first write error on the temporary file

    @property
    def size(self) -> int:
        return len(self.head) + len(self._start) + self._written - self._skip

    @property
    def spilled(self) -> bool:
        """True once part of the body is in the temporary file."""
        return self._file is not None

    def write(self, data: bytes) -> None:
        """Add ``data`` at the end. Never raises for an I/O error (see :attr:`failure`)."""
        self._written += len(data)
        if self.failure is not None:
            return
        self._mem += data
        limit = self.chunk_bytes if self._file is not None else self.memory_bytes
        if len(self._mem) > limit:
            self._flush()

    def _flush(self) -> None:
        try:
            if self._file is None:
                if not _take_spill_file():
                    raise OSError(errno.EMFILE, f"too many temporary body files open ({_spill_files_max}: what "
                                                "RLIMIT_NOFILE leaves beyond connections_max)")
                try:
                    # O_TMPFILE on Linux: no name; unbuffered, so that pieces() reads back every byte written
                    self._file = tempfile.TemporaryFile(dir=self.directory, buffering=0)
                except BaseException:
                    _give_spill_file()
                    raise
            view = memoryview(self._mem)
            fd = self._file.fileno()
            while view:
                n = os.pwrite(fd, view, self._in_file)
                self._in_file += n
                view = view[n:]
            view.release()
        except OSError as exc:
            self.failure = exc
            self._drop_file()
        self._mem = bytearray()

    def discard(self) -> None:
        """Forget everything written (a refused message); the buffer may be written again."""
        self._drop_file()
        self._mem = bytearray()
        self._written = 0
        self._in_file = 0
        self._skip, self._start = 0, b""
        self.failure = None

    def getvalue(self) -> bytes:
        """The whole body as one bytes object (``head`` included): only for bodies that were not spilled."""
        assert self._file is None, "a spilled body is read with pieces()"
        return self.head + bytes(self._mem)

    def replace_start(self, old_len: int, new: bytes) -> None:
        """Read the first ``old_len`` octets written as ``new`` from now on (the header section rewritten by
        header_checks, :mod:`mtaq.edge.headerchecks`), the file itself untouched (what is still in memory is
        written to it first when the octets reach past it). Only for a spilled body; raises ValueError
        otherwise, or when the file could not be written."""
        if self._file is not None and old_len > self._in_file and self._mem and self.failure is None:
            self._flush()  # what is still in memory goes to the file first: the octets are then all there
        if self._file is None or old_len > self._in_file:
            raise ValueError("replace_start: the octets to replace are not all in the temporary file")
        self._skip, self._start = old_len, new

    def replace_prefix(self, length: int, new: bytes) -> None:
        """Read the first ``length`` octets of the body as it reads now (after an earlier
        :meth:`replace_start`; ``head`` not counted) as ``new`` from now on: the milter's header changes
        after header_checks' (:mod:`mtaq.edge.milter`). Only for a spilled body; ValueError as
        :meth:`replace_start`."""
        if length <= len(self._start):
            if self._file is None:
                raise ValueError("replace_prefix: the body was not spilled")
            self._start = new + self._start[length:]
            return
        self.replace_start(self._skip + length - len(self._start), new)

    def pieces(self) -> Iterator[bytes]:
        """The body in order, ``head`` first, in pieces of at most ``chunk_bytes`` (plus the memory tail).

        May be iterated more than once (the log reads it twice: checksum, then copy). Raises OSError if the
        temporary file cannot be read back.
        """
        if self.head:
            yield self.head
        if self._start:
            yield self._start
        if self._file is not None:
            fd = self._file.fileno()
            offset = self._skip
            while offset < self._in_file:
                piece = os.pread(fd, min(self.chunk_bytes, self._in_file - offset), offset)
                if not piece:
                    raise OSError(f"temporary body file ended at {offset} of {self._in_file} bytes")
                offset += len(piece)
                yield piece
        if self._mem:
            yield bytes(self._mem)

    def _drop_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
            _give_spill_file()

    def close(self) -> None:
        """Free the temporary file and the memory."""
        self._drop_file()
        self._mem = bytearray()
