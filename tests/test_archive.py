"""The segment archive: byte-for-byte copies (plain or zstd), failures keep the segment, retention by age."""

from __future__ import annotations

import asyncio
import os
import re
import smtplib

import pytest
import structlog
import zstandard

from mtaq.config import load_config
from mtaq.core.errors import ConfigError
from mtaq.core.frame import SegmentHeader, encode_segment_header
from mtaq.daemon.process import Daemon
from mtaq.storage.archive import ArchiveError, SegmentArchive, archive_name
from mtaq.storage.fs import OsFileSystem


def _segment(path, number: int, salt: int, payload: bytes) -> bytes:
    data = encode_segment_header(SegmentHeader(segment=number, salt=salt, created=1_740_787_200)) + payload
    with open(path, "wb") as f:
        f.write(data)
    return data


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_a_stored_segment_is_byte_for_byte_the_original(tmp_path, compress):
    """store() writes NNN-salt.seg[.zst] whose (decompressed) bytes equal the segment file; the source stays."""
    src = tmp_path / "000000000007.seg"
    data = _segment(src, 7, 0x1A2B3C4D, os.urandom(3 << 20))  # more than one 1 MiB chunk
    a = SegmentArchive(OsFileSystem(), str(tmp_path / "archive" / "deep"), compress=compress).store(7, str(src))
    name = "000000000007-1a2b3c4d.seg" + (".zst" if compress == "zstd" else "")
    assert (str(tmp_path / "archive" / "deep" / name), len(data)) == (a.path, a.bytes)
    stored = open(a.path, "rb").read()
    assert a.stored_bytes == len(stored)
    assert data == (zstandard.ZstdDecompressor().decompress(stored) if compress == "zstd" else stored)
    assert src.exists()
    assert [name] == os.listdir(tmp_path / "archive" / "deep")  # no temporary file left behind


def test_a_segment_whose_header_names_another_segment_is_not_archived(tmp_path):
    """A header that does not match the file's number raises ArchiveError and writes nothing."""
    src = tmp_path / "000000000003.seg"
    _segment(src, 4, 1, b"")
    arch = SegmentArchive(OsFileSystem(), str(tmp_path / "archive"))
    with pytest.raises(ArchiveError, match="header names segment 4"):
        arch.store(3, str(src))
    assert [] == os.listdir(tmp_path / "archive")


def test_retention_deletes_only_archives_older_than_the_limit(tmp_path):
    """expire() unlinks archive files modified more than retention_s ago, and nothing else."""
    d = tmp_path / "archive"
    d.mkdir()
    now = 1_800_000_000.0
    for name, age in (("000000000001-00000001.seg", 7200), ("000000000002-00000002.seg.zst", 100),
                      ("notes.txt", 7200)):
        (d / name).write_bytes(b"x")
        os.utime(d / name, (now - age, now - age))
    arch = SegmentArchive(OsFileSystem(), str(d), retention_s=3600, clock=lambda: now)
    assert [str(d / "000000000001-00000001.seg")] == arch.expire()
    assert ["000000000002-00000002.seg.zst", "notes.txt"] == sorted(os.listdir(d))


def test_archive_name_carries_number_salt_and_compression():
    """Names sort by segment number and tell two spools' segment 1 apart by the salt."""
    assert "000000000042-0000beef.seg.zst" == archive_name(42, 0xBEEF, "zstd")
    assert "000000000042-0000beef.seg" == archive_name(42, 0xBEEF, "none")


def test_bad_archive_compress_is_refused_naming_the_key():
    """archive_compress accepts none or zstd; anything else is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match="archive_compress"):
        load_config(None, {"archive_compress": "gzip"})


def _send(port: int, n: int) -> None:
    pad = b"y" * 998 + b"\r\n"
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for i in range(n):
            s.sendmail("a@example.org", ["b@example.net"], f"Subject: {i}\r\n\r\n".encode() + pad * 8)


def _run_daemon(tmp_path, archive_dir: str, body) -> None:
    """The real Daemon in-process with a real aiosmtpd sink (mtaq.testing.sink), 64 KiB segments, no timer checkpoints."""
    from aiosmtpd.smtp import SMTP

    from mtaq.testing.sink import SinkHandler

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sink = SinkHandler(str(tmp_path / "maildir"))
        server = await loop.create_server(lambda: SMTP(sink, hostname="sink", loop=loop), "127.0.0.1", 0)
        cfg = load_config(None, {
            "spool_dir": str(tmp_path / "spool"), "listen": "127.0.0.1:0", "stats_interval_s": 0,
            "relayhost": f"[127.0.0.1]:{server.sockets[0].getsockname()[1]}", "checkpoint_interval_s": 3600,
            "segment_bytes_max": 65536, "archive_dir": archive_dir, "archive_compress": "zstd", "admin_listen": "127.0.0.1:0"})
        d = Daemon(cfg)
        task = asyncio.create_task(d.run())
        while not d.runners:
            await asyncio.sleep(0.01)
        try:
            await body(d, sink)
        finally:
            d.server.close()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            server.close()

    asyncio.run(main())


def test_reclaimed_segments_go_to_the_archive_before_they_are_deleted(tmp_path):
    """Under steady delivery, a checkpoint archives every wholly-garbage segment (zstd), then deletes it;
    the archive holds exactly the segments that left the spool, byte for byte."""
    archive = tmp_path / "archive"

    async def body(d: Daemon, sink) -> None:
        await asyncio.to_thread(_send, d.server.sockets[0].getsockname()[1], 80)
        for _ in range(1000):
            if sink.received == 80 and not len(d.queue.working) and d.runners_settled():
                break
            await asyncio.sleep(0.02)
        log = d.queue.log
        before = {n: open(f"{log.directory}/{n:012d}.seg", "rb").read() for n in log.segments()}
        await d.checkpoint()
        await d.reclaimed_idle()
        after = set(log.segments())
        gone = sorted(set(before) - after)
        assert len(gone) >= 3, f"nothing reclaimed: {sorted(before)}"
        names = sorted(os.listdir(archive))
        assert [n for n in gone] == [int(x[:12]) for x in names]
        for name in names:
            raw = zstandard.ZstdDecompressor().decompress(open(archive / name, "rb").read())
            assert before[int(name[:12])] == raw
        assert len(gone) == d.archived

    _run_daemon(tmp_path, str(archive), body)


def test_a_failed_archive_keeps_the_segment_and_says_so(tmp_path):
    """When the archive cannot be written (its parent is a file), no segment is deleted, the queue keeps
    delivering, and an archive_failed event names the segment."""
    (tmp_path / "blocker").write_text("not a directory")

    async def body(d: Daemon, sink) -> None:
        with structlog.testing.capture_logs() as events:
            await asyncio.to_thread(_send, d.server.sockets[0].getsockname()[1], 60)
            for _ in range(1000):
                if sink.received == 60 and not len(d.queue.working) and d.runners_settled():
                    break
                await asyncio.sleep(0.02)
            segs = d.queue.log.segments()
            await d.checkpoint()
            await d.reclaimed_idle()
            assert segs == d.queue.log.segments()[: len(segs)]
            failed = [e for e in events if e["event"] == "archive_failed"]
            assert [segs[0]] == [e["segment"] for e in failed]
            assert "segment kept" == failed[0]["action"]
            await asyncio.to_thread(_send, d.server.sockets[0].getsockname()[1], 1)
            for _ in range(1000):
                if sink.received == 61:
                    break
                await asyncio.sleep(0.02)
            assert 61 == sink.received

    _run_daemon(tmp_path, str(tmp_path / "blocker" / "archive"), body)
    assert not re.search(r"\.seg", " ".join(os.listdir(tmp_path)))
