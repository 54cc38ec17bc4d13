"""Large messages are received with bounded memory (issue 13.4): the body beyond receive_buffer_bytes goes
to an unnamed temporary file and into the log in pieces; the frame written is the one a whole-message
append writes, and nothing of it is left after a failed copy.

End to end: a real daemon (subprocess), real SMTP clients, its peak RSS read from /proc.
"""

from __future__ import annotations

import concurrent.futures
import errno
import glob
import smtplib
import subprocess
import sys

import pytest

from mtaq.core.errors import StorageError, StorageFatal, StorageFull
from mtaq.core.frame import encode_record, scan_segment
from mtaq.core.records import DataRecord, encode_data_prefix, encode_payload
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, segment_path
from mtaq.storage.spill import BodyBuffer
from mtaq.testing.faults import FaultyFileSystem
from mtaq.testing.procs import peak_rss_kib

MiB = 1024 * 1024


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65535, 65536, 70_000, 3 * MiB])
def test_data_prefix_plus_body_is_msgspecs_encoding(size):
    """msgpack bin 8/16/32 at each boundary: the prefix and the body are the whole payload, byte for byte."""
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert encode_payload(DataRecord("1M0RZQH28K28MQ6", body))[1] == encode_data_prefix("1M0RZQH28K28MQ6", size) + body


def test_body_buffer_keeps_memory_bounded_and_gives_the_body_back(tmp_path):
    buf = BodyBuffer(str(tmp_path), memory_bytes=4096, chunk_bytes=1024)
    lines = [b"%05d " % i + b"y" * 70 + b"\r\n" for i in range(1000)]
    for line in lines:
        buf.write(line)
        assert len(buf._mem) <= 4096 + len(line)
    buf.head = b"Received: x\r\n"
    assert buf.spilled and buf.size == len(buf.head) + sum(map(len, lines))
    assert all(len(p) <= 4096 for p in buf.pieces())
    assert b"".join(buf.pieces()) == buf.head + b"".join(lines)
    assert b"".join(buf.pieces()) == buf.head + b"".join(lines)  # read twice (checksum, then copy)
    assert [] == glob.glob(str(tmp_path / "*"))  # the temporary file has no name
    buf.discard()
    assert (0, False) == (buf.size - len(buf.head), buf.spilled)
    buf.close()


def _open_log(tmp_path) -> Log:
    log, _ = Log.open(OsFileSystem(), str(tmp_path / "log"), segment_bytes_max=64 * MiB)
    return log


def test_append_data_writes_the_frame_a_whole_append_writes(tmp_path):
    log = _open_log(tmp_path)
    body = b"".join(b"line %d\r\n" % i for i in range(100_000))
    pos, _ = log.append_data("Q1", lambda: (body[i:i + 7000] for i in range(0, len(body), 7000)), len(body))
    assert DataRecord("Q1", body) == log.read(pos)
    raw = OsFileSystem().read_file(segment_path(log.directory, pos.segment))
    frame = encode_record(DataRecord("Q1", body), log._salts[pos.segment])
    assert frame == raw[pos.offset:pos.offset + len(frame)]
    assert [] == scan_segment(pos.segment, raw).problems
    log.close()


class _FailingPieces:
    """Gives the body on the checksum pass, then fails part way through the copy: ``exc`` raised by the
    source (a temporary file that cannot be read back), or ``then`` called (to make the log's disk fail)."""

    def __init__(self, body: bytes, exc: Exception | None = None, then=None) -> None:
        self.body, self.exc, self.then, self.passes = body, exc, then, 0

    def __call__(self):
        self.passes += 1
        yield self.body[:1000]
        if self.passes == 2:
            if self.exc is not None:
                raise self.exc
            self.then()
        yield self.body[1000:]


def _faulty_log(tmp_path):
    fs = FaultyFileSystem()
    log, _ = Log.open(fs, str(tmp_path / "log"), segment_bytes_max=64 * MiB)
    log.append(DataRecord("Q0", b"before"))
    return fs, log


def _file_size(log: Log, segment: int) -> int:
    return OsFileSystem().open(segment_path(log.directory, segment)).size()


@pytest.mark.parametrize("errno_", [errno.EIO, errno.ENOSPC])
def test_a_source_that_cannot_be_read_leaves_nothing_and_says_so(tmp_path, errno_):
    """The temporary file fails on the copy pass: its OSError comes out as it is (the queue answers 451/452),
    and the half frame is truncated away: the next record lands where this one would have."""
    _, log = _faulty_log(tmp_path)
    end = log.end
    with pytest.raises(OSError) as info:
        log.append_data("Q1", _FailingPieces(b"z" * 5000, OSError(errno_, "read back")), 5000)
    assert errno_ == info.value.errno and not isinstance(info.value, StorageError)
    assert (end, end.offset) == (log.end, _file_size(log, end.segment))
    pos, _ = log.append(DataRecord("Q2", b"after"))
    assert pos == end and DataRecord("Q2", b"after") == log.read(pos)
    log.close()


@pytest.mark.parametrize("errno_,raised", [(errno.ENOSPC, StorageFull), (errno.EIO, StorageError)])
def test_the_log_disk_failing_mid_copy_leaves_nothing_of_the_record(tmp_path, errno_, raised):
    fs, log = _faulty_log(tmp_path)
    end = log.end

    def disk_fails() -> None:
        fs.fail_append = errno_

    with pytest.raises(raised):
        log.append_data("Q1", _FailingPieces(b"z" * 5000, then=disk_fails), 5000)
    fs.fail_append = None
    assert (end, end.offset) == (log.end, _file_size(log, end.segment))
    pos, _ = log.append(DataRecord("Q2", b"after"))
    assert pos == end and DataRecord("Q2", b"after") == log.read(pos)
    log.close()


def test_a_half_frame_that_cannot_be_truncated_stops_the_log(tmp_path):
    """Found by review: with the truncate failing too, a half frame stayed inside the segment and later
    records (acknowledged ones) were appended after it, to be reported as corruption at the next start.
    Now the log fails like after a failed fsync: nothing more is appended; recovery re-reads the disk."""
    fs, log = _faulty_log(tmp_path)
    fatal = []
    log.on_fatal.append(fatal.append)

    def disk_fails() -> None:
        fs.fail_append = errno.EIO
        fs.fail_truncate = errno.EIO

    with pytest.raises(StorageError):
        log.append_data("Q1", _FailingPieces(b"z" * 5000, then=disk_fails), 5000)
    fs.fail_append = fs.fail_truncate = None
    assert isinstance(log.failed, StorageFatal) and [log.failed] == fatal
    with pytest.raises(StorageFatal):
        log.append(DataRecord("Q2", b"after"))
    log.close()


def test_pieces_that_change_between_passes_are_refused(tmp_path):
    log = _open_log(tmp_path)
    end = log.end
    with pytest.raises(ValueError):
        log.append_data("Q1", lambda: [b"abc"], 4)
    assert end == log.end
    log.close()


def _send_big(port: int, n: int, size: int, params: list[str]) -> tuple[int, bytes]:
    line = b"%07d " % n + b"L" * 68 + b"\r\n"
    body = line * (size // len(line))
    msg = b"From: a@example.org\r\nSubject: big %d\r\nMessage-ID: <big-%d@example.org>\r\n\r\n" % (n, n) + body
    with smtplib.SMTP("127.0.0.1", port, timeout=120) as s:
        s.ehlo("client.test")
        s.mail("a@example.org", params)
        s.rcpt(f"r{n}@example.net")
        return s.data(msg)


def test_six_concurrent_10_mb_messages_do_not_grow_the_daemon_by_their_size(relay_factory):
    """Six sessions send 10 MB each at once (held with HOLDFOR, so that no delivery reads them back): the
    daemon's peak RSS grows by far less than one message (it grew by about 175 MB when whole messages were
    kept in memory). Then a 3 MB message is delivered byte for byte, and the log verifies."""
    r = relay_factory(config="message_size_limit_bytes = 12000000\n")
    before = peak_rss_kib(r.daemon.popen.pid)
    assert before is not None
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda n: _send_big(r.daemon.port, n, 10_000_000, ["HOLDFOR=3600"]), range(6)))
    assert all(code == 250 for code, _ in replies), replies
    after = peak_rss_kib(r.daemon.popen.pid)
    assert after is not None
    grown_mib = (after - before) / 1024
    print(f"peak RSS grew by {grown_mib:.1f} MiB for 6 x 10 MB")
    assert grown_mib < 40, f"peak RSS grew by {grown_mib:.0f} MiB for 6 x 10 MB"
    code, _ = _send_big(r.daemon.port, 99, 3_000_000, [])
    assert 250 == code
    r.wait_for(lambda: r.events("delivered"), timeout_s=60, what="the 3 MB message delivered")
    (path,) = glob.glob(r.maildir + "/new/*")
    with open(path, "rb") as f:
        got = f.read()
    line = b"%07d " % 99 + b"L" * 68 + b"\r\n"
    assert got.endswith(b"Message-ID: <big-99@example.org>\r\n\r\n" + line * (3_000_000 // len(line)))
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "log", "verify", "--spool", r.spool],
                         capture_output=True, text=True, timeout=120)
    assert 0 == out.returncode, out.stdout + out.stderr
    sizes = sorted(e["size"] for e in r.events("queued"))
    assert 7 == len(sizes) and all(s > 3_000_000 for s in sizes)

