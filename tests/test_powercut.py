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


def test_the_ledger_outlives_a_kill_without_a_cut_and_a_later_run_fsyncs_count(tmp_path):
    """Run 1 writes past its last fsync and is killed without a cut; run 2 (a new file system on the same
    spool) reads the file from the page cache but does not fsync it: a cut after run 2 still drops run 1's
    unsynced bytes. Once a later run fsyncs a file it did not write, a cut keeps all of it."""
    spool = str(tmp_path)
    run1 = PowerCutFileSystem(spool)
    a = run1.open(str(tmp_path / "a"), create=True)
    a.append(b"synced")
    a.fsync()
    run1.fsync_dir(spool)
    a.append(b" unsynced")
    b = run1.open(str(tmp_path / "b"), create=True)
    b.append(b"b synced")
    b.fsync()
    b.append(b" b unsynced")
    del run1, a, b  # kill -9, no cut: the bytes stay in the page cache
    run2 = PowerCutFileSystem(spool)
    assert b"synced unsynced" == run2.read_file(str(tmp_path / "a"))  # run 2 reads what run 1 never made durable
    run2.fsync_dir(spool)  # b's name becomes durable; its unsynced bytes do not
    run2.open(str(tmp_path / "a")).pread(0, 100)  # read, not fsync'd
    out = cut(spool)
    assert b"synced" == (tmp_path / "a").read_bytes()
    assert b"b synced" == (tmp_path / "b").read_bytes()
    assert len(b" unsynced") + len(b" b unsynced") == out["bytes_dropped"]
    run3 = PowerCutFileSystem(spool)
    a3 = run3.open(str(tmp_path / "a"))
    a3.append(b" run3")
    del run3, a3  # killed without a cut
    run4 = PowerCutFileSystem(spool)
    run4.open(str(tmp_path / "a")).fsync()  # a later run fsyncs what run 3 wrote
    cut(spool)
    assert b"synced run3" == (tmp_path / "a").read_bytes()


def test_a_new_file_of_an_old_name_is_not_trusted_with_the_old_ones_fsyncd_size(tmp_path):
    """A file fsync'd at 8 bytes is unlinked (or taken by a cut) and made again under the same name, its
    directory fsync'd but not the file: a cut removes all of its bytes, not the first 8. A truncation lowers
    what counts as durable; a ledger line cut by a kill does not spoil the next run's lines."""
    spool = str(tmp_path)
    fs = PowerCutFileSystem(spool)
    p = str(tmp_path / "seg")
    f = fs.open(p, create=True)
    f.append(b"old data")
    f.fsync()
    fs.fsync_dir(spool)
    fs.unlink(p)
    f = fs.open(p, create=True)
    f.append(b"new data, never fsync'd")
    fs.fsync_dir(spool)
    with open(tmp_path / ".powercut-ledger", "a") as led:
        led.write("F\t" + p)  # a line cut by a kill
    fs2 = PowerCutFileSystem(spool)
    g = fs2.open(str(tmp_path / "other"), create=True)
    g.append(b"x" * 10)
    g.fsync()
    g.truncate(4)
    g.append(b"yyyyyy")
    fs2.fsync_dir(spool)
    cut(spool)
    assert b"" == (tmp_path / "seg").read_bytes()
    assert b"xxxx" == (tmp_path / "other").read_bytes()
