"""Copying parked mail forward (Queue.copy_forward, each checkpoint) on a full disk and with large bodies.

Issue 31.5: a full disk during the copy used to leave START(copy) in the log and the envelope unparked with
nothing to conclude the attempt while the process ran: the message was stranded until the next restart
(a delayed one never offered, release/delete answered "delivery in progress"). Now the envelope is put
back at once (a replacement naming its old DATA), or, if not even that fits, the copy is concluded by the
next checkpoint.

Issue 31.10: the copy read each body three times, in the event loop; now once, in a thread.

Real log on a real disk (FaultyFileSystem: ``room`` models a nearly full disk, ``reads`` records reads).
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from mtaq.admin.service import AdminService
from mtaq.core.errors import StorageFull
from mtaq.core.frame import FRAME_HEADER_BYTES
from mtaq.core.parking import COPY_FORWARD
from mtaq.core.records import DataRecord, EnvelopeRecord, StartRecord, encode_data_prefix, encode_payload
from mtaq.core.state import RetryPolicy
from mtaq.core.view import Selector
from mtaq.queue.store import Queue
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log, segment_path
from mtaq.testing.faults import FaultyFileSystem


def _held(tmp_path, fs: FaultyFileSystem, size: int):
    """A queue on ``fs`` holding one message of ``size`` bytes: (log, queue, admin, position, envelope, body)."""
    log, _report = Log.open(fs, os.path.join(str(tmp_path), "log"), segment_bytes_max=64 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")
    adm = AdminService(q, [], lambda: 1000.0, str(tmp_path))
    body = b"Subject: held\r\n\r\n" + b"x" * (size - 19) + b"\r\n"
    return log, q, adm, body


def test_a_full_disk_during_a_copy_forward_leaves_the_message_held_and_releasable(tmp_path):
    """The disk has room for a START and an envelope but not for the DATA copy: copy_forward raises
    StorageFull after putting the message back, held, as a replacement naming its old DATA; the message is
    not active, an administrator can release it at once, and the released envelope reads the intact body
    (before: the attempt stayed open, and release answered "delivery in progress")."""
    fs = FaultyFileSystem()
    log, q, adm, body = _held(tmp_path, fs, 300_000)

    async def main() -> None:
        env = await q.receive("s@x.test", ["r@y.test"], body)
        assert [env.queue_id] == (await adm.act("hold", Selector(ids=(env.queue_id,)))).done
        [(pos, held)] = [(p, q.log.read(p)) for p in q.parked.entries]
        assert isinstance(held, EnvelopeRecord)
        fs.room = 4096  # a START and an envelope fit, the 300 kB copy does not
        with pytest.raises(StorageFull):
            await q.copy_forward(pos, held)
        fs.room = None
        await log.sync()
        assert 0 == len(q.working)
        [new] = [q.log.read(p) for p in q.parked.entries]
        assert isinstance(new, EnvelopeRecord)
        assert held.data == new.data  # (pinned when far behind it: Queue.finish_admin)
        [m] = (await adm.list(Selector()))[1]
        assert (env.queue_id, "held") == (m["queue_id"], m["queue_name"])
        assert [env.queue_id] == (await adm.act("release", Selector(ids=(env.queue_id,)))).done
        [released] = [r for s in scan_log(OsFileSystem(), log.directory) for _p, r in s.records
                      if isinstance(r, EnvelopeRecord) and r.queue_id == env.queue_id and r.runner == 0 and r.generation]
        assert body == q.read_body(released)

    asyncio.run(main())
    log.close()


def test_a_replacement_that_does_not_fit_after_its_start_is_appended_at_the_next_try(tmp_path):
    """The START and the DATA copy fit, the replacement does not: the copy stays open (the message counts as
    active) until finish_open_copies, run by the next checkpoint once there is room, appends it; the
    message is then held once, with its body."""
    fs = FaultyFileSystem()
    log, q, adm, body = _held(tmp_path, fs, 3000)

    async def main() -> None:
        env = await q.receive("s@x.test", ["r@y.test"], body)
        assert [env.queue_id] == (await adm.act("hold", Selector(ids=(env.queue_id,)))).done
        [(pos, held)] = [(p, q.log.read(p)) for p in q.parked.entries]
        assert isinstance(held, EnvelopeRecord)
        _t, start = encode_payload(StartRecord(held.queue_id, pos, 1000.0, held.runner, COPY_FORWARD, log.durable_end))
        data_frame = FRAME_HEADER_BYTES + len(encode_data_prefix(held.queue_id, held.size)) + held.size
        fs.room = data_frame + FRAME_HEADER_BYTES + len(start)  # the DATA copy and the START, nothing more
        with pytest.raises(StorageFull):
            await q.copy_forward(pos, held)
        assert 1 == len(q.working)
        fs.room = None
        [new_pos] = q.finish_open_copies()
        await log.sync()
        assert (0, [new_pos]) == (len(q.working), list(q.parked.entries))
        [m] = (await adm.list(Selector()))[1]
        assert (env.queue_id, "held") == (m["queue_id"], m["queue_name"])
        new = q.log.read(new_pos)
        assert isinstance(new, EnvelopeRecord)
        assert body == q.read_body(new)

    asyncio.run(main())
    log.close()


def test_a_copy_forward_reads_the_body_once_and_off_the_event_loop(tmp_path):
    """A held 2 MiB message copied forward: the bytes of its DATA record are read once in all, every read
    in a thread other than the event loop's (before: three reads, all in the loop, holding up every SMTP
    session meanwhile). The copy is byte for byte the body."""
    fs = FaultyFileSystem()
    log, q, adm, body = _held(tmp_path, fs, 2 << 20)
    loop_thread: list[str] = []

    async def main() -> None:
        loop_thread.append(threading.current_thread().name)
        env = await q.receive("s@x.test", ["r@y.test"], body)
        assert [env.queue_id] == (await adm.act("hold", Selector(ids=(env.queue_id,)))).done
        [(pos, held)] = [(p, q.log.read(p)) for p in q.parked.entries]
        assert isinstance(held, EnvelopeRecord)
        fs.reads = []
        new_pos = await q.copy_forward(pos, held)
        reads, fs.reads = fs.reads, None
        path = segment_path(log.directory, held.data.segment)
        payload_at = held.data.offset + FRAME_HEADER_BYTES
        payload_end = payload_at + len(encode_data_prefix(held.queue_id, held.size)) + held.size
        mine = [(off, n, t) for p, off, n, t in reads if p == path and off < payload_end and off + n > payload_at]
        assert payload_end - payload_at == sum(min(off + n, payload_end) - max(off, payload_at) for off, n, _t in mine)
        assert [] == [t for _o, _n, t in mine if t == loop_thread[0]]
        assert new_pos is not None
        new = q.log.read(new_pos)
        assert isinstance(new, EnvelopeRecord)
        await log.sync()

    asyncio.run(main())
    log.close()
    datas = [r.body for s in scan_log(OsFileSystem(), os.path.join(str(tmp_path), "log")) for _p, r in s.records
             if isinstance(r, DataRecord)]
    assert [body] * 3 == datas  # received, held (the admin's copy), copied forward


def test_an_administrators_hold_on_a_full_disk_is_done_with_the_old_data(tmp_path):
    """hold on a disk with room for a START and an envelope but not the DATA copy: done, the message held
    (not active), its replacement naming the old DATA, released again at once (before: StorageFull after
    the START, and the message stuck as "delivery in progress" until a restart)."""
    fs = FaultyFileSystem()
    log, q, adm, body = _held(tmp_path, fs, 300_000)

    async def main() -> None:
        env = await q.receive("s@x.test", ["r@y.test"], body)
        fs.room = 4096
        assert [env.queue_id] == (await adm.act("hold", Selector(ids=(env.queue_id,)))).done
        fs.room = None
        assert 0 == len(q.working)
        [held] = [q.log.read(p) for p in q.parked.entries]
        assert isinstance(held, EnvelopeRecord)
        assert (env.data, body) == (held.data, q.read_body(held))
        assert [env.queue_id] == (await adm.act("release", Selector(ids=(env.queue_id,)))).done

    asyncio.run(main())
    log.close()
