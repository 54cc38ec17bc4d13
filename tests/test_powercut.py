"""The power-cut file system used by the kill -9 harness drops exactly what was never made durable."""

from __future__ import annotations

import os

from mtaq.testing.powercut import PowerCutFileSystem, cut


def test_cut_keeps_fsynced_bytes_drops_the_rest_and_forgets_undurable_files(tmp_path):
    """Bytes after a file's last fsync are dropped; a file whose directory entry was never fsync'd is
    removed; a renamed file keeps the size fsync'd under its old name."""
    spool = str(tmp_path)
    fs = PowerCutFileSystem(spool)
    os.makedirs(tmp_path / "log")
    a = fs.open(str(tmp_path / "log" / "a"), create=True)
    a.append(b"durable")
    a.fsync()
    fs.fsync_dir(str(tmp_path / "log"))
    a.append(b" lost")
    b = fs.open(str(tmp_path / "log" / "b"), create=True)  # created after the directory fsync
    b.append(b"never durable")
    b.fsync()
    t = fs.open(str(tmp_path / "ck.tmp"), create=True)
    t.append(b"checkpoint")
    t.fsync()
    fs.rename(str(tmp_path / "ck.tmp"), str(tmp_path / "ck"))
    fs.fsync_dir(spool)
    out = cut(spool)
    assert b"durable" == (tmp_path / "log" / "a").read_bytes()
    assert not (tmp_path / "log" / "b").exists()
    assert b"checkpoint" == (tmp_path / "ck").read_bytes()
    assert {"files_removed": 1, "files_cut": 1, "bytes_dropped": len(b" lost") + len(b"never durable")} == out


def test_negative_control_file_system_makes_nothing_durable(tmp_path):
    """With fsync_works=False nothing is recorded as durable: a cut removes every file."""
    spool = str(tmp_path)
    fs = PowerCutFileSystem(spool, fsync_works=False)
    f = fs.open(str(tmp_path / "x"), create=True)
    f.append(b"data")
    f.fsync()
    fs.fsync_dir(spool)
    cut(spool)
    assert not (tmp_path / "x").exists()
