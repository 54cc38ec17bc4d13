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
    assert {"files_removed": 1, "files_cut": 1, "bytes_dropped": len(b" lost") + len(b"never durable"),
            "pages_kept": 0} == out
    assert out == {**cut(spool), "files_removed": 1, "files_cut": 1, "bytes_dropped": 18}  # a second cut: nothing


def test_reordered_cut_keeps_some_unsynced_pages_whole_zeroes_the_others_and_they_stay(tmp_path):
    """With reorder, each unsynced 4 KiB page survives whole or is zeros (the file ends after the last
    surviving page); the fsync'd prefix is untouched; what survived is durable for the next cut."""
    import random

    spool = str(tmp_path)
    fs = PowerCutFileSystem(spool)
    f = fs.open(str(tmp_path / "seg"), create=True)
    f.append(b"D" * 5000)
    f.fsync()
    fs.fsync_dir(spool)
    pages = [bytes([65 + i]) * 4096 for i in range(8)]
    f.append(b"".join(pages)[: 8 * 4096 - 5000])  # the file now ends on a page boundary (8 pages)
    out = cut(spool, reorder=random.Random(4))
    raw = (tmp_path / "seg").read_bytes()
    assert raw[:5000] == b"D" * 5000
    appended = b"".join(pages)[: 8 * 4096 - 5000]
    assert 0 < out["pages_kept"] and len(raw) % 4096 == 0 and len(raw) > 5000
    for i in range(1, len(raw) // 4096):
        lo = max(5000, i * 4096)  # page 1 holds the end of the fsync'd prefix too
        got, new = raw[lo:(i + 1) * 4096], appended[lo - 5000:(i + 1) * 4096 - 5000]
        assert got in (new, bytes(len(new))), i
    assert raw[-1] != 0  # the file ends with a page that survived
    assert 0 == cut(spool, reorder=random.Random(5))["bytes_dropped"]
    assert raw == (tmp_path / "seg").read_bytes()


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
