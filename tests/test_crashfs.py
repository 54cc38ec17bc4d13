"""The crash file system (SQLite's crash VFS, LevelDB's fault-injection test), and the real log driven on it.

The first half checks the model itself: what survives a crash in each mode, directory entries, injected
faults. The second half runs :class:`mtaq.storage.log.Log` on it, crashes at many points with many seeds,
reopens, and checks that every committed record is still there, in order, and that ``Log.open`` never
raises after a crash.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtaq.core.errors import StorageError, StorageFatal
from mtaq.core.frame import scan_segment
from mtaq.core.records import FinishRecord, Pos
from mtaq.storage.fs import OsFileSystem, make_durable_dirs
from mtaq.storage.log import Log, list_segments, segment_path
from mtaq.testing.crashfs import CRASH_MODES, CrashFileSystem

# ---------------------------------------------------------------------------------------------- the model


def synced_file(fs: CrashFileSystem, path: str, data: bytes) -> None:
    """Create ``path`` (and its directories) with ``data``; fsync it and every directory above it."""
    fs.makedirs(os.path.dirname(path))
    f = fs.open(path, create=True)
    f.append(data)
    f.fsync()
    f.close()
    d = os.path.dirname(path)
    while True:
        fs.fsync_dir(d)
        if d == "/":
            break
        d = os.path.dirname(d)


@pytest.mark.parametrize("mode", CRASH_MODES)
def test_fsynced_data_survives_crash_in_every_mode(mode):
    """Data and entries made durable by fsync and fsync_dir are all there after a crash, whatever the mode."""
    for seed in range(50):
        fs = CrashFileSystem()
        fs.makedirs("/d")
        fs.fsync_dir("/")
        synced_file(fs, "/d/a", b"hello")
        synced_file(fs, "/d/b", b"x" * 1000)
        f = fs.open("/d/a")
        f.append(b" world")  # unsynced, may or may not survive
        fs.crash(random.Random(seed), mode=mode)
        after = fs.files()
        assert after["/d/a"][:5] == b"hello"
        assert after["/d/b"] == b"x" * 1000
        assert fs.unsynced() == {}


def test_unsynced_appends_survive_keep_but_not_drop():
    """Appends not fsync'd are all kept by a "keep" crash (kill -9) and all lost by a "drop" crash."""
    for mode, expected in (("keep", b"durable+later"), ("drop", b"durable")):
        fs = CrashFileSystem()
        synced_file(fs, "/a", b"durable")
        f = fs.open("/a")
        f.append(b"+")
        f.append(b"later")
        assert fs.files()["/a"] == b"durable+later"
        assert fs.durable_snapshot() == {"/a": b"durable"}
        fs.crash(random.Random(1), mode=mode)
        assert fs.files() == {"/a": expected}


def test_created_file_vanishes_after_drop_crash_unless_its_directory_was_fsynced():
    """A new file whose directory was never fsync'd is gone after a "drop" crash, even if the file itself
    was fsync'd (its data was durable but unreachable); after fsync_dir it stays, and "keep" keeps it."""
    fs = CrashFileSystem()
    fs.makedirs("/d")
    fs.fsync_dir("/")
    f = fs.open("/d/new", create=True)
    f.append(b"data")
    f.fsync()
    assert fs.durable_snapshot() == {}
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {}
    assert fs.listdir("/d") == []

    fs = CrashFileSystem()
    fs.makedirs("/d")
    fs.fsync_dir("/")
    fs.open("/d/new", create=True).append(b"data")
    fs.crash(random.Random(0), mode="keep")
    assert fs.files() == {"/d/new": b"data"}

    fs = CrashFileSystem()
    fs.makedirs("/d")
    fs.fsync_dir("/")
    f = fs.open("/d/new", create=True)
    f.append(b"data")
    f.fsync()
    fs.fsync_dir("/d")
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {"/d/new": b"data"}


def test_directory_made_by_makedirs_vanishes_unless_its_parent_was_fsynced():
    """makedirs changes the parent's entries like a creation: undone by a "drop" crash without fsync_dir."""
    fs = CrashFileSystem()
    fs.makedirs("/a/b")
    assert fs.dirs() == {"/", "/a", "/a/b"}
    fs.fsync_dir("/a")  # /a/b durable in /a, but /a itself not in /
    fs.crash(random.Random(0), mode="drop")
    assert fs.dirs() == {"/"}
    fs.makedirs("/a/b")
    fs.fsync_dir("/")
    fs.fsync_dir("/a")
    fs.crash(random.Random(0), mode="drop")
    assert fs.dirs() == {"/", "/a", "/a/b"}


def test_make_durable_dirs_makes_the_entries_an_earlier_killed_start_left_durable_too():
    """A start killed right after its mkdir (kill -9: the entry stays, only in the page cache); the next start
    finds the directories there and must still make their entries durable, or a power cut during that run
    takes the spool and what it acknowledged (the explorer with receipts in the later run found it: run 0
    killed after op 1, run 1 cut, "kept none of [#1 link /spool]")."""
    fs = CrashFileSystem()
    fs.makedirs("/spool")  # the first start, killed before it fsync'd "/"
    make_durable_dirs(fs, "/spool/log")  # the next start: /spool is there
    fs.crash(random.Random(0), mode="drop")
    assert {"/spool", "/spool/log"} <= fs.dirs()


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS, errno.EINVAL, errno.EIO])
def test_make_durable_dirs_passes_over_an_ancestor_it_cannot_fsync_but_not_an_io_error(err):
    """An existing ancestor whose fsync is refused for want of permission, or has nothing to write back (a
    read-only file system, one that does not fsync directories), is passed over; an I/O error is raised."""

    class Refusing(CrashFileSystem):
        def fsync_dir(self, path: str) -> None:
            if path == "/":
                raise OSError(err, os.strerror(err), path)
            super().fsync_dir(path)

    fs = Refusing()
    fs.makedirs("/spool")
    if err == errno.EIO:
        with pytest.raises(OSError):
            make_durable_dirs(fs, "/spool/log")
    else:
        make_durable_dirs(fs, "/spool/log")
        assert "/spool/log" in fs.dirs()


def test_unlink_not_made_durable_is_undone():
    """An unlinked file whose directory was not fsync'd afterwards reappears with its durable contents."""
    fs = CrashFileSystem()
    synced_file(fs, "/d/a", b"old")
    f = fs.open("/d/a")
    f.append(b"-unsynced")
    fs.unlink("/d/a")
    assert not fs.exists("/d/a")
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {"/d/a": b"old"}

    fs.unlink("/d/a")
    fs.fsync_dir("/d")
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {}


def test_rename_not_made_durable_is_undone():
    """A rename (replacing a file) without fsync_dir is undone by a "drop" crash and kept after one."""
    fs = CrashFileSystem()
    synced_file(fs, "/d/tmp", b"new")
    synced_file(fs, "/d/cur", b"old")
    fs.rename("/d/tmp", "/d/cur")
    assert fs.files() == {"/d/cur": b"new"}
    assert fs.durable_snapshot() == {"/d/cur": b"old", "/d/tmp": b"new"}
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {"/d/cur": b"old", "/d/tmp": b"new"}
    fs.rename("/d/tmp", "/d/cur")
    fs.fsync_dir("/d")
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {"/d/cur": b"new"}


def test_random_crash_decides_each_directory_change_independently():
    """In "random" mode each unsynced creation survives or not on its own: over seeds, all subsets occur."""
    seen = set()
    for seed in range(200):
        fs = CrashFileSystem()
        for name in "abc":
            fs.open(f"/{name}", create=True)
        fs.crash(random.Random(seed), mode="random")
        seen.add(tuple(sorted(fs.files())))
    assert len(seen) == 8


def test_random_crash_keeps_drops_garbles_and_tears_unsynced_writes():
    """Over seeds, a "random" crash of a file with unsynced appends yields: all kept, none kept, a torn
    prefix, garbled bytes, and a zero-filled hole before a write that was kept (out-of-order write-back);
    the durable part is always intact."""
    durable = b"D" * 10
    writes = [bytes([65 + i]) * 8 for i in range(4)]  # b"AAAAAAAA", b"BBBBBBBB", ...
    full = durable + b"".join(writes)
    outcomes = set()
    for seed in range(300):
        fs = CrashFileSystem()
        synced_file(fs, "/f", durable)
        f = fs.open("/f")
        for w in writes:
            f.append(w)
        fs.crash(random.Random(seed), mode="random")
        got = fs.files()["/f"]
        assert got[:10] == durable
        assert len(got) <= len(full)
        if got == full:
            outcomes.add("all kept")
        if got == durable:
            outcomes.add("none kept")
        chunks = [got[10 + 8 * i : 18 + 8 * i] for i in range(4)]
        if any(chunks[i] == bytes(8) and writes[j] in chunks[j:] for i in range(3) for j in range(i + 1, 4)):
            outcomes.add("hole then kept")
        if len(got) % 8 != 10 % 8:
            outcomes.add("torn")
        if any(len(c) == 8 and c not in (w, bytes(8)) for c, w in zip(chunks, writes, strict=True)):
            outcomes.add("garbled")
    assert outcomes == {"all kept", "none kept", "hole then kept", "torn", "garbled"}


def test_unsynced_truncation_may_be_undone():
    """A truncation that was not fsync'd is undone by a "drop" crash, kept by "keep", either by "random"."""
    results = {}
    for mode in CRASH_MODES:
        got = set()
        for seed in range(40):
            fs = CrashFileSystem()
            synced_file(fs, "/f", b"0123456789")
            fs.open("/f").truncate(4)
            fs.crash(random.Random(seed), mode=mode)
            got.add(fs.files()["/f"])
        results[mode] = got
    assert results == {"drop": {b"0123456789"}, "keep": {b"0123"}, "random": {b"0123456789", b"0123"}}


def test_crash_is_deterministic_for_a_seed():
    """The same operations, mode and seed give the same post-crash state (a failure can be replayed)."""

    def run(seed: int) -> dict[str, bytes]:
        fs = CrashFileSystem()
        fs.makedirs("/d")
        for i in range(5):
            f = fs.open(f"/d/{i}", create=True)
            for j in range(10):
                f.append(bytes([i, j]) * 7)
        fs.crash(random.Random(seed), mode="random")
        return fs.files()

    assert run(7) == run(7)
    assert len({tuple(sorted(run(s).items())) for s in range(10)}) > 1


def test_pending_lists_every_unsynced_change_in_the_order_made():
    """pending() lists the writes, truncations and directory changes not yet durable, in order, with
    their place; an fsync (file) or fsync_dir (directory) removes its own from the list."""
    fs = CrashFileSystem()
    synced_file(fs, "/d/a", b"durable")
    f = fs.open("/d/a")
    f.append(b"one")
    g = fs.open("/d/b", create=True)
    g.append(b"two")
    f.truncate(3)
    fs.rename("/d/b", "/d/c")
    assert [
        "#4 write /d/a@7+3", "#5 link /d/b", "#6 write /d/b@0+3", "#7 truncate /d/a to 3", "#8 rename /d/b -> c",
    ] == [str(c) for c in fs.pending()]
    f.fsync()
    fs.fsync_dir("/d")
    assert ["#6 write /d/c@0+3"] == [str(c) for c in fs.pending()]
    assert {"/d/a": b"dur", "/d/c": b"two"} == fs.files()


def test_crash_to_keeps_exactly_the_chosen_changes():
    """crash_to(keep, torn) is a power cut with every outcome chosen: a later write kept after a lost one
    (out-of-order write-back: the lost one reads as zeros), a torn write's prefix, a creation undone."""
    def setup() -> tuple[CrashFileSystem, list[int]]:
        fs = CrashFileSystem()
        synced_file(fs, "/d/a", b"D")
        f = fs.open("/d/a")
        f.append(b"111")
        f.append(b"222")
        fs.open("/d/new", create=True).append(b"x")
        return fs, [c.seq for c in fs.pending()]

    fs, (w1, w2, link, wx) = setup()
    fs.crash_to({w2, link})
    assert {"/d/a": b"D\x00\x00\x00222", "/d/new": b""} == fs.files()
    assert [] == fs.pending()
    fs, (w1, w2, link, wx) = setup()
    fs.crash_to({w1, wx}, {w2: 1})
    assert {"/d/a": b"D1112"} == fs.files()  # /d/new's entry was lost: its data is unreachable
    fs, _ = setup()
    fs.crash_to(())
    assert {"/d/a": b"D"} == fs.files() == fs.durable_snapshot()
    assert ("crash", "chosen") == fs.ops[-1]


def test_kill_keeps_the_page_cache_and_a_later_cut_can_still_take_it():
    """kill() (kill -9) kills the open files and changes nothing else: unsynced changes stay pending, and a
    power cut after it (in the next run) can still lose them."""
    fs = CrashFileSystem()
    synced_file(fs, "/a", b"durable")
    f = fs.open("/a")
    f.append(b"+later")
    fs.kill()
    with pytest.raises(OSError) as info:
        f.size()
    assert errno.EBADF == info.value.errno
    assert {"/a": b"durable+later"} == fs.files()
    assert ["#3 write /a@7+6"] == [str(c) for c in fs.pending()]
    fs.crash_to(())
    assert {"/a": b"durable"} == fs.files()


def test_snapshot_restores_the_whole_state_any_number_of_times():
    """restore(snapshot()) is a new file system in the same state (durable contents, current contents and
    pending changes), whatever happens afterwards to the original or to another copy; on_op is called
    after every operation."""
    fs = CrashFileSystem()
    seen = []
    fs.on_op = seen.append
    synced_file(fs, "/d/a", b"durable")
    fs.open("/d/a").append(b"+x")
    snap = fs.snapshot()
    fs.open("/d/a").append(b"+y")
    fs.crash(random.Random(0), mode="drop")
    one, two = CrashFileSystem.restore(snap), CrashFileSystem.restore(snap)
    one.crash_to(())
    assert {"/d/a": b"durable"} == one.files()
    assert {"/d/a": b"durable+x"} == two.files() == CrashFileSystem.restore(snap).files()
    assert ["#4 write /d/a@7+2"] == [str(c) for c in two.pending()]
    assert {"/d/a": b"durable"} == two.durable_snapshot()
    assert len(fs.ops) == len(seen)
    assert ("crash", "drop") == seen[-1]


def test_open_files_are_dead_after_a_crash():
    """After crash() every File object raises OSError(EBADF) on every call; so does a closed File."""
    fs = CrashFileSystem()
    synced_file(fs, "/a", b"x")
    f = fs.open("/a")
    fs.crash(random.Random(0), mode="keep")
    for call in (f.size, lambda: f.append(b"y"), lambda: f.pread(0, 1), lambda: f.truncate(0), f.fsync, f.close):
        with pytest.raises(OSError) as ei:
            call()
        assert ei.value.errno == errno.EBADF
    g = fs.open("/a")
    assert g.pread(0, 10) == b"x"
    g.close()
    with pytest.raises(OSError) as ei:
        g.size()
    assert ei.value.errno == errno.EBADF


def test_fsync_eio_injection_counts_file_and_directory_fsyncs_and_makes_nothing_durable():
    """fail_fsync_at=N: the N-th fsync from now (file or directory) raises EIO once; what it was to make
    durable stays unsynced and a "drop" crash loses it."""
    fs = CrashFileSystem()
    synced_file(fs, "/a", b"base")
    f = fs.open("/a")
    f.append(b"+1")
    fs.fail_fsync_at = 2
    fs.fsync_dir("/")  # 1st: fine
    with pytest.raises(OSError) as ei:
        f.fsync()  # 2nd: EIO
    assert ei.value.errno == errno.EIO
    assert fs.fail_fsync_at is None
    assert ("fsync-failed", "/a") in fs.ops
    assert fs.durable_snapshot() == {"/a": b"base"}
    fs.crash(random.Random(0), mode="drop")
    assert fs.files() == {"/a": b"base"}

    fs.fail_fsync_at = 1
    with pytest.raises(OSError) as ei:
        fs.fsync_dir("/")
    assert ei.value.errno == errno.EIO


def test_write_errno_injection_leaves_the_file_unchanged():
    """fail_write_errno=ENOSPC with fail_write_at=N: the N-th append raises ENOSPC and writes nothing;
    without fail_write_at every append fails until the errno is cleared."""
    fs = CrashFileSystem()
    f = fs.open("/a", create=True)
    f.append(b"one")
    fs.fail_write_errno, fs.fail_write_at = errno.ENOSPC, 2
    f.append(b"two")
    with pytest.raises(OSError) as ei:
        f.append(b"three")
    assert ei.value.errno == errno.ENOSPC
    assert fs.files() == {"/a": b"onetwo"} and f.size() == 6
    assert f.append(b"four") == 6  # one-shot
    fs.fail_write_errno = errno.EIO
    for _ in range(3):
        with pytest.raises(OSError):
            f.append(b"x")
    fs.fail_write_errno = None
    f.append(b"!")
    assert fs.files() == {"/a": b"onetwofour!"}


def test_short_write_raises_enospc_and_cuts_the_file_back():
    """short_write_at=N: the N-th append writes half its data, then the file is cut back (as _OsFile does)
    and ENOSPC raised: no partial data stays, and the ops show the partial write and the cut."""
    fs = CrashFileSystem()
    synced_file(fs, "/a", b"base")
    f = fs.open("/a")
    fs.short_write_at = 1
    with pytest.raises(OSError) as ei:
        f.append(b"12345678")
    assert ei.value.errno == errno.ENOSPC
    assert f.size() == 4 and fs.files() == {"/a": b"base"}
    assert fs.ops[-3:] == [("append", "/a", 4, 4), ("truncate", "/a", 4), ("append-failed", "/a", 4, errno.ENOSPC)]
    fs.crash(random.Random(0), mode="keep")
    assert fs.files() == {"/a": b"base"}


def test_errors_are_the_real_ones():
    """Missing files and directories, O_EXCL, and files in the way raise what the os calls raise."""
    fs = CrashFileSystem()
    with pytest.raises(FileNotFoundError):
        fs.open("/nope")
    with pytest.raises(FileNotFoundError):
        fs.open("/nodir/f", create=True)
    with pytest.raises(FileNotFoundError):
        fs.listdir("/nodir")
    with pytest.raises(FileNotFoundError):
        fs.read_file("/nope")
    with pytest.raises(FileNotFoundError):
        fs.unlink("/nope")
    with pytest.raises(FileNotFoundError):
        fs.fsync_dir("/nodir")
    fs.open("/f", create=True)
    with pytest.raises(FileExistsError):
        fs.open("/f", create=True)
    with pytest.raises(FileExistsError):
        fs.makedirs("/f")
    with pytest.raises(NotADirectoryError):
        fs.makedirs("/f/g")
    with pytest.raises(NotADirectoryError):
        fs.listdir("/f")
    fs.makedirs("/d")
    with pytest.raises(IsADirectoryError):
        fs.open("/d")
    with pytest.raises(IsADirectoryError):
        fs.unlink("/d")
    assert fs.exists("/d") and fs.exists("/d/../f") and not fs.exists("/f/x")


def test_visible_behaviour_matches_the_real_file_system(tmp_path):
    """Without a crash, the same calls give the same results on CrashFileSystem and OsFileSystem."""
    rng = random.Random(3)
    results = []
    for fs, root in ((OsFileSystem(), str(tmp_path)), (CrashFileSystem(), "/r")):
        out: list[object] = []
        fs.makedirs(os.path.join(root, "d", "e"))
        f = fs.open(os.path.join(root, "d", "f"), create=True)
        rng.seed(3)
        for _ in range(50):
            out.append(f.append(rng.randbytes(rng.randrange(0, 40))))
            if rng.random() < 0.2:
                f.truncate(rng.randrange(0, f.size() + 10))
            out.append((f.size(), f.pread(rng.randrange(0, 100), rng.randrange(0, 50))))
        f.fsync()
        fs.fsync_dir(os.path.join(root, "d"))
        fs.rename(os.path.join(root, "d", "f"), os.path.join(root, "d", "g"))
        out.append(sorted(fs.listdir(os.path.join(root, "d"))))
        out.append(fs.read_file(os.path.join(root, "d", "g")))
        g = fs.open(os.path.join(root, "d", "h"), create=True)
        g.append(b"x")
        g.close()
        fs.unlink(os.path.join(root, "d", "h"))
        out.append((fs.exists(os.path.join(root, "d", "h")), sorted(fs.listdir(os.path.join(root, "d")))))
        f.close()
        results.append(out)
    assert results[0] == results[1]


# ---------------------------------------------------------------------------------------------- the real log

LOG_DIR = "/spool/log"


def finish(i: int) -> FinishRecord:
    return FinishRecord(f"Q{i}", Pos(1, 32), 1.0)


class Workload:
    """Appends numbered FINISH records to the real Log on a CrashFileSystem, commits some, crashes,
    reopens (with recovery's repair of older unsealed segments), and checks what survived."""

    def __init__(self, segment_bytes_max: int = 65536) -> None:
        self.fs = CrashFileSystem()
        self.segment_bytes_max = segment_bytes_max
        self.appended = 0  # records Q0 .. Q{appended-1} were appended
        self.committed: list[int] = []  # record numbers whose commit returned
        self.opened_at = 0  # first record number appended by the current Log
        self.log: Log | None = None

    def open(self) -> None:
        """Log.open, then what recovery does to older segments (repair_segment); must never raise."""
        log, report = Log.open(self.fs, LOG_DIR, segment_bytes_max=self.segment_bytes_max)
        for n in report.segments:
            scan = report.scans.get(n) or scan_segment(n, self.fs.read_file(segment_path(LOG_DIR, n)))
            if scan.header is not None and (scan.torn_tail is not None or not scan.sealed):
                log.repair_segment(scan)
        self.log = log
        self.opened_at = self.appended

    def batch(self, n: int, commit: bool) -> bool:
        """Append ``n`` records and maybe commit them all; False once the log has failed (fsync EIO)."""
        assert self.log is not None
        lsn = 0
        try:
            for _ in range(n):
                _pos, lsn = self.log.append(finish(self.appended))
                self.appended += 1
            if commit and lsn:
                asyncio.run(self.log.commit(lsn))
                # commit(lsn) covers every record this Log appended before, uncommitted batches included
                self.committed = sorted(set(self.committed) | set(range(self.opened_at, self.appended)))
        except StorageFatal:
            return False
        return True

    def crash(self, rng: random.Random, mode: str) -> None:
        self.fs.crash(rng, mode=mode)
        if self.log is not None:
            self.log.close()  # its files are dead (EBADF, ignored); releases the fsync thread
            self.log = None

    def survivors(self) -> list[int]:
        """Record numbers found in the segments, in log order, by reading the segment files."""
        found = []
        for n in list_segments(self.fs, LOG_DIR):
            scan = scan_segment(n, self.fs.read_file(segment_path(LOG_DIR, n)))
            found += [int(r.queue_id[1:]) for _p, r in scan.records if isinstance(r, FinishRecord)]
        return found

    def check(self) -> None:
        """Every committed record is there, in order; nothing appears twice or out of order."""
        found = self.survivors()
        assert found == sorted(set(found)), f"records duplicated or out of order: {found}"
        missing = sorted(set(self.committed) - set(found))
        assert not missing, f"committed records lost: {missing}"


def run_cycles(w: Workload, rng: random.Random, cycles: int, mode: str) -> None:
    for _ in range(cycles):
        w.open()
        for _ in range(rng.randint(1, 4)):
            if not w.batch(rng.randint(0, 40), commit=rng.random() < 0.6):
                break
        w.crash(random.Random(rng.getrandbits(64)), mode)
    w.open()
    w.check()
    assert w.log is not None
    w.log.close()


@pytest.mark.parametrize("mode", CRASH_MODES)
def test_log_keeps_every_committed_record_across_crashes(mode):
    """Real Log (64 KiB segments): batches of appends, some committed, crash, reopen, several times; for
    300 seeds, Log.open never raises and every committed record is read back in order."""
    for seed in range(300 if mode == "random" else 40):
        w = Workload(65536)
        run_cycles(w, random.Random(seed), cycles=3, mode=mode)


@pytest.mark.parametrize("mode", CRASH_MODES)
def test_log_keeps_every_committed_record_across_crashes_with_segment_rolls(mode):
    """As above with 400-byte segments, so crashes hit roll-overs (seal of the old segment, creation of
    the new one, its directory entry not yet durable)."""
    for seed in range(300 if mode == "random" else 40):
        w = Workload(400)
        run_cycles(w, random.Random(seed), cycles=3, mode=mode)


def test_log_after_fsync_failure_and_crash_keeps_committed_records():
    """The N-th fsync fails (EIO) during a commit round: the commit raises StorageFatal and nothing more is
    acknowledged; after a crash the log reopens and every record committed before is there."""
    for seed in range(200):
        rng = random.Random(seed)
        w = Workload(rng.choice((400, 65536)))
        w.open()
        w.batch(rng.randint(1, 20), commit=True)
        w.fs.fail_fsync_at = rng.randint(1, 4)
        for _ in range(6):
            before = list(w.committed)
            if not w.batch(rng.randint(1, 20), commit=True):
                assert w.committed == before
                break
        w.fs.fail_fsync_at = None
        w.crash(random.Random(seed), "random")
        w.open()
        w.check()
        assert w.log is not None
        w.log.close()


def test_log_open_interrupted_by_fsync_failure_then_crash_reopens():
    """Log.open itself fails (EIO at its N-th fsync, while repairing a torn tail or starting the new
    segment) and the machine then crashes: the next Log.open succeeds and loses no committed record."""
    for seed in range(200):
        rng = random.Random(seed)
        w = Workload(rng.choice((400, 65536)))
        w.open()
        w.batch(rng.randint(1, 30), commit=True)
        w.batch(rng.randint(1, 30), commit=False)
        w.crash(random.Random(seed), "random")
        w.fs.fail_fsync_at = rng.randint(1, 3)
        try:
            w.open()
        except StorageError:
            pass  # the disk refused: expected, the daemon would exit here
        w.fs.fail_fsync_at = None
        w.crash(random.Random(seed + 1), "random")
        w.open()
        w.check()
        assert w.log is not None
        w.log.close()


def test_log_append_failures_leave_no_partial_record():
    """ENOSPC (plain and short write) on appends: the append raises StorageError, leaves nothing, and later
    commits and a crash still keep every committed record."""
    for seed in range(100):
        rng = random.Random(seed)
        w = Workload(rng.choice((400, 65536)))
        w.open()
        assert w.log is not None
        for _ in range(30):
            if rng.random() < 0.2:
                w.fs.short_write_at = 1
            elif rng.random() < 0.2:
                w.fs.fail_write_errno, w.fs.fail_write_at = errno.ENOSPC, 1
            try:
                w.batch(1, commit=rng.random() < 0.3)
            except StorageError as exc:
                assert "No space" in str(exc)
            w.fs.short_write_at = w.fs.fail_write_errno = w.fs.fail_write_at = None
        asyncio.run(w.log.sync())
        w.committed = list(range(w.appended))
        w.crash(random.Random(seed), "random")
        w.open()
        w.check()
        assert w.survivors() == list(range(w.appended))
        assert w.log is not None
        w.log.close()


cycle = st.tuples(
    st.lists(st.tuples(st.integers(0, 25), st.booleans()), max_size=4),  # (appends, commit?) batches
    st.integers(0, 2**32 - 1),  # crash seed
    st.sampled_from(CRASH_MODES),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cycles=st.lists(cycle, min_size=1, max_size=4), segment_bytes_max=st.sampled_from([300, 1000, 65536]))
def test_log_survives_any_sequence_of_batches_and_crashes(cycles, segment_bytes_max):
    """Hypothesis: any sequence of (append batches, commits, crash with any mode and seed) leaves a log
    that opens and holds every committed record in order."""
    w = Workload(segment_bytes_max)
    for batches, seed, mode in cycles:
        w.open()
        for n, commit in batches:
            if not w.batch(n, commit):
                break
        w.crash(random.Random(seed), mode)
    w.open()
    w.check()
    assert w.log is not None
    w.log.close()


def harness_catches(mode: str, segment_bytes_max: int) -> bool:
    """True if run_cycles fails (loses a committed record) for some of 50 seeds."""
    for seed in range(50):
        try:
            run_cycles(Workload(segment_bytes_max), random.Random(seed), cycles=3, mode=mode)
        except AssertionError:
            return True
    return False


def test_negative_control_harness_catches_a_log_that_skips_the_directory_fsync(monkeypatch):
    """The harness can fail: with the commit round's directory fsync removed, a "drop" crash after a
    roll-over loses the new segment and its committed records, and the check notices."""

    def sync_files_only(self, files, sync_dir):
        for f in files:
            f.fsync()
        return len(files)

    monkeypatch.setattr(Log, "_sync_files", sync_files_only)
    assert harness_catches("drop", 400)
    assert not harness_catches("keep", 400)


def test_negative_control_harness_catches_a_log_that_never_fsyncs(monkeypatch):
    """The harness can fail: with commit rounds fsyncing nothing (eatmydata), crashes lose committed
    records in "drop" and "random" mode, and the check notices; "keep" (kill -9) does not."""
    monkeypatch.setattr(Log, "_sync_files", lambda self, files, sync_dir: 0)
    assert harness_catches("drop", 65536)
    assert harness_catches("random", 65536)
    assert not harness_catches("keep", 65536)


def test_make_durable_dirs_survives_a_power_cut_at_once():
    """make_durable_dirs (the first start's spool, issue 31.11) fsyncs the parent of every directory it
    creates: a power cut right after it returns, keeping nothing unsynced, still has every level."""
    from mtaq.storage.fs import make_durable_dirs

    fs = CrashFileSystem()
    fs.makedirs("/var")
    fs.fsync_dir("/")
    make_durable_dirs(fs, "/var/spool/mtaq/shard-1")
    fs.crash(random.Random(0), mode="drop")
    assert fs.exists("/var/spool/mtaq/shard-1")
