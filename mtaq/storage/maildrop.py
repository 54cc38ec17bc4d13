"""The maildrop: messages submitted by local users (``mtaq sendmail``) while the daemon may be down.

Postfix's model (postdrop(1) writes, pickup(8) reads): ``SPOOL/maildrop`` is mode 1733 (sticky, writable and
searchable by every local user, listable by the daemon only), each message one file owned by its submitter.
A file is written as ``.NAME.tmp`` (a dot name the daemon leaves alone), fsync'd, renamed to ``NAME`` and the
directory fsync'd (a local user, who may not open the directory, syncfs(2)s its file system instead): a file
with a final name is complete, and once :func:`write_message` returns it survives a power cut. ``SPOOL/pickup.fifo`` (mode 0622, Postfix's ``public/pickup``) wakes the daemon at once.

File format (all integers little-endian; docs/log_format.md, "The maildrop")::

    header := magic "MTAQDROP"  version:u16 (=1)  flags:u16 (=0)  meta_len:u32  body_len:u64
              crc:u32 (CRC-32 of meta + body)  hcrc:u32 (CRC-32 of the 28 bytes before it)   ; 32 bytes
    meta   := JSON object, UTF-8 (ASCII escapes): {"id", "sender", "recipients", "uid", "login", "submit_ts"}
    body   := the message, CRLF line ends
    file   := header meta body          ; nothing after it

What must always hold: the daemon reads a maildrop file as hostile input (:func:`read_message`): never through
a symbolic link (``O_NOFOLLOW``), only a regular file with one link, at most ``body_bytes_max`` of message,
every length checked against the file's size before anything is read, the checksums checked before anything
is used. A file that fails any check is moved aside whole to ``SPOOL/corrupt/maildrop/`` (not world-writable),
never dropped and never queued.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass

from mtaq.storage.fs import OsFileSystem, fsync_fd, make_durable_dirs, syncfs_fd

__all__ = [
    "FIFO_NAME",
    "MAILDROP_DIR",
    "MAILDROP_MODE",
    "META_BYTES_MAX",
    "DropError",
    "Dropped",
    "decode_message",
    "encode_message",
    "ensure_maildrop",
    "list_names",
    "move_aside",
    "nudge",
    "open_fifo",
    "read_message",
    "remove",
    "sync_dir",
    "valid_name",
    "write_message",
]

MAILDROP_DIR = "maildrop"
ASIDE_DIR = os.path.join("corrupt", "maildrop")
FIFO_NAME = "pickup.fifo"
MAILDROP_MODE = 0o1733  # Postfix's maildrop without a setgid postdrop: sticky, write-only for others
FIFO_MODE = 0o622
FILE_MODE = 0o644  # readable by the daemon; others cannot list the directory, and the name has 64 random bits
MAGIC = b"MTAQDROP"
VERSION = 1
_HEAD = struct.Struct("<8sHHIQ")  # magic, version, flags, meta_len, body_len: 24 bytes
HEADER_BYTES = _HEAD.size + 8
META_BYTES_MAX = 1 << 20  # recipients and the rest of the envelope: 1 MiB at most
_NAME_CHARS = frozenset("0123456789abcdef")


class DropError(Exception):
    """A maildrop file that does not check out; ``reason`` is one short phrase for the event."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Dropped:
    """One message read from the maildrop. ``uid`` is the file's owner (the submitter, whatever the file
    says); the addresses are checked for their types only (the pick-up checks them as SMTP would)."""

    name: str
    uid: int
    sender: str
    recipients: tuple[str, ...]
    login: str
    submit_ts: float
    body: bytes


def new_name(now_ts: float | None = None) -> str:
    """``TTTTTTTTTTTTTT.RRRRRRRRRRRRRRRR``: microseconds since the epoch and 64 random bits, in hex (file names
    sort by submission time; nobody who cannot list the directory can guess one)."""
    us = int((time.time() if now_ts is None else now_ts) * 1_000_000)
    return f"{us:014x}.{os.urandom(8).hex()}"


def valid_name(name: str) -> bool:
    """Whether ``name`` is the name of a complete maildrop file (as :func:`new_name` makes them)."""
    a, dot, b = name.partition(".")
    return bool(dot) and 1 <= len(a) <= 16 and len(b) == 16 and set(a) <= _NAME_CHARS and set(b) <= _NAME_CHARS


def encode_message(name: str, sender: str, recipients: list[str], uid: int, login: str, submit_ts: float,
                   body: bytes) -> bytes:
    """The bytes of a maildrop file (see the module docstring). Raises ValueError if the envelope is too large."""
    meta = json.dumps({"id": name, "sender": sender, "recipients": recipients, "uid": uid, "login": login,
                       "submit_ts": submit_ts}, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if len(meta) > META_BYTES_MAX:
        raise ValueError(f"the envelope is {len(meta)} bytes (at most {META_BYTES_MAX})")
    head = _HEAD.pack(MAGIC, VERSION, 0, len(meta), len(body))
    crc = zlib.crc32(body, zlib.crc32(meta))
    head += struct.pack("<I", crc)
    return head + struct.pack("<I", zlib.crc32(head)) + meta + body


def decode_message(name: str, uid: int, data: bytes, *, body_bytes_max: int) -> Dropped:
    """Check and decode the bytes of maildrop file ``name`` owned by ``uid``. Raises DropError."""
    if len(data) < HEADER_BYTES:
        raise DropError(f"truncated: {len(data)} bytes, shorter than the header")
    magic, version, _flags, meta_len, body_len = _HEAD.unpack_from(data)
    crc, hcrc = struct.unpack_from("<II", data, _HEAD.size)
    if magic != MAGIC:
        raise DropError("not a maildrop file (bad magic)")
    if hcrc != zlib.crc32(data[: _HEAD.size + 4]):
        raise DropError("header checksum mismatch")
    if version != VERSION:
        raise DropError(f"unknown version {version}")
    if meta_len > META_BYTES_MAX:
        raise DropError(f"envelope of {meta_len} bytes (at most {META_BYTES_MAX})")
    if body_len > body_bytes_max:
        raise DropError(f"message of {body_len} bytes exceeds message_size_limit_bytes ({body_bytes_max})")
    if len(data) != HEADER_BYTES + meta_len + body_len:
        raise DropError(f"torn or padded: {len(data)} bytes, the header says {HEADER_BYTES + meta_len + body_len}")
    meta_b = data[HEADER_BYTES: HEADER_BYTES + meta_len]
    body = data[HEADER_BYTES + meta_len:]
    if crc != zlib.crc32(body, zlib.crc32(meta_b)):
        raise DropError("content checksum mismatch")
    try:
        meta = json.loads(meta_b)
    except (ValueError, RecursionError) as exc:
        raise DropError(f"envelope is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise DropError("envelope is not a JSON object")
    sender, rcpts, login, ts, mid = (meta.get("sender"), meta.get("recipients"), meta.get("login", ""),
                                     meta.get("submit_ts", 0.0), meta.get("id"))
    if mid != name:
        raise DropError(f"file name {name!r} is not the id it records")
    if not isinstance(sender, str) or not isinstance(login, str) or not isinstance(ts, int | float):
        raise DropError("envelope fields of the wrong type")
    if not isinstance(rcpts, list) or not rcpts or not all(isinstance(r, str) for r in rcpts):
        raise DropError("no recipients, or not a list of strings")
    return Dropped(name=name, uid=uid, sender=sender, recipients=tuple(rcpts), login=login, submit_ts=float(ts),
                   body=body)


# ----------------------------------------------------------------------------------------- the writer
def ensure_maildrop(spool: str) -> str:
    """``SPOOL/maildrop``, made (durably, mode 1733) if missing; the mode is set again when this process owns
    it, and the spool gets search permission (``--x``) for group and others, so that local users reach the
    maildrop (the daemon's own files are 0600 in 0700 directories: its umask is 077). Returns its path.
    Raises OSError."""
    d = os.path.join(spool, MAILDROP_DIR)
    if not os.path.isdir(d):
        make_durable_dirs(OsFileSystem(), d)
    top = os.stat(spool)
    if top.st_uid == os.geteuid() and top.st_mode & 0o011 != 0o011:
        os.chmod(spool, stat.S_IMODE(top.st_mode) | 0o011)  # entered, not listed, by local users: to the maildrop
    st = os.stat(d)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != MAILDROP_MODE:
        os.chmod(d, MAILDROP_MODE)
    return d


def write_message(spool: str, sender: str, recipients: list[str], body: bytes, *, login: str,
                  now_ts: float | None = None, name: str = "") -> str:
    """Write one message into the maildrop durably (temp file, fsync, rename, directory fsync) and return its
    name (``name``, from :func:`new_name`, or a new one); nudge a running daemon. Raises OSError (nothing left
    behind), ValueError (envelope too large, a bad name)."""
    d = ensure_maildrop(spool)
    now = time.time() if now_ts is None else now_ts
    name = name or new_name(now)
    if not valid_name(name):
        raise ValueError(f"bad maildrop file name {name!r}")
    data = encode_message(name, sender, recipients, os.getuid(), login, now, body)
    tmp = os.path.join(d, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, FILE_MODE)  # whatever the umask: the daemon (mail_owner) reads it
            fsync_fd(fd)
            os.rename(tmp, os.path.join(d, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:
            try:
                sync_dir(d)
            except PermissionError:
                # A local user may write the maildrop but not read it (mode 1733), so cannot open it to fsync it:
                # syncfs(2) of the file system holding the new file makes its directory entry durable instead.
                syncfs_fd(fd)
        except OSError:
            remove(d, name)  # not acknowledged: withdrawn (best effort), the caller says to try again
            raise
    finally:
        os.close(fd)
    nudge(spool)
    return name


def nudge(spool: str) -> None:
    """Wake the daemon's pick-up through ``SPOOL/pickup.fifo`` (one byte, never blocking; nothing when no
    daemon reads it: it picks the maildrop up at start and every second anyway)."""
    try:
        fd = os.open(os.path.join(spool, FIFO_NAME), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, b"W")
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_dir(d: str) -> None:
    """fsync the directory ``d`` (its entries: a rename or an unlink in it is durable after). Raises OSError."""
    OsFileSystem().fsync_dir(d)


# ----------------------------------------------------------------------------------------- the reader
def open_fifo(spool: str) -> int:
    """The daemon's end of ``SPOOL/pickup.fifo`` (made if missing, mode 0622), opened read-write and non-blocking
    so that it never reads end-of-file when a writer closes (as Postfix's master does). Raises OSError."""
    path = os.path.join(spool, FIFO_NAME)
    try:
        os.mkfifo(path, FIFO_MODE)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a fifo", path)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FIFO_MODE:
        os.fchmod(fd, FIFO_MODE)
    return fd


def list_names(d: str) -> list[str]:
    """Every entry of the maildrop directory ``d``, oldest name first (names start with the submit time)."""
    return sorted(os.listdir(d))


def read_message(d: str, name: str, *, body_bytes_max: int) -> Dropped:
    """Read and check the maildrop file ``d/name`` as hostile input (module docstring). Raises DropError for a
    file to move aside, FileNotFoundError if it is gone, other OSError (EIO, EMFILE: try again later)."""
    path = os.path.join(d, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DropError("a symbolic link") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.EACCES):
            raise DropError(f"cannot be opened: {exc.strerror}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DropError("not a regular file")
        if st.st_nlink != 1:
            raise DropError(f"{st.st_nlink} hard links")
        limit = HEADER_BYTES + META_BYTES_MAX + body_bytes_max
        if st.st_size > limit:
            raise DropError(f"{st.st_size} bytes: larger than any message allowed")
        chunks, n = [], 0
        while n <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise DropError("grew past any message allowed while read")
    return decode_message(name, st.st_uid, data, body_bytes_max=body_bytes_max)


def move_aside(spool: str, name: str) -> str:
    """Move ``SPOOL/maildrop/NAME`` (whatever it is: the entry, never what a link names) to
    ``SPOOL/corrupt/maildrop/NAME`` durably; return the new path. Raises OSError."""
    aside = os.path.join(spool, ASIDE_DIR)
    if not os.path.isdir(aside):
        make_durable_dirs(OsFileSystem(), aside)
    dst = os.path.join(aside, name)
    if os.path.lexists(dst):
        dst = f"{dst}.{os.urandom(4).hex()}"
    os.rename(os.path.join(spool, MAILDROP_DIR, name), dst)
    sync_dir(aside)
    sync_dir(os.path.join(spool, MAILDROP_DIR))
    return dst


def remove(d: str, name: str) -> None:
    """Unlink ``d/name`` (gone already is fine); the caller fsyncs the directory (:func:`sync_dir`)."""
    try:
        os.unlink(os.path.join(d, name))
    except FileNotFoundError:
        pass
