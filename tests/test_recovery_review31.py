"""Recovery findings of the durability review of issue 31 (2-4, 6), each as the review reproduced it.

Real Queue and recovery on real files; the disk state a crash leaves is made by hand, as in
test_hole_conclusions: a power cut with out-of-order write-back zeroes a record's bytes while later ones
survive, a crash between two appends cuts the log after the first, media damage flips a bit.

* 31.2: a power cut that loses the START of a book-keeping action (flush, copy forward) but keeps its
  replacement must not leave two live envelopes (the message would be delivered or released twice);
* 31.3: a bit flip in the fsync'd DATA of an acknowledged message is never taken for an unsynced hole that
  ends the message quietly: it is reported as corruption, and the message stays queued so that the
  delivery worker bounces it with a DSN;
* 31.4: a crash between a conclusion's DSN and its FINISH, or recovery killed between the DSN it appends
  and its FINISH, never queues the DSN twice;
* 31.6: an interrupted administrator's action whose DATA is damaged is bounced with a DSN and ended, like a
  delivery attempt, not dropped from the working set with neither FINISH nor DSN.
"""

from __future__ import annotations

import asyncio
import os

from test_corrupt_area import start
from test_hole_conclusions import BODY, DEFERRED, FAILED, acknowledged_then_attempted, body_of, flip, live, zero

from mtaq.core.checkpoint import Checkpoint
from mtaq.core.records import DataRecord, EnvelopeRecord, FinishRecord, Pos, StartRecord
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import scan_log, segment_path


def records(spool: str) -> list[tuple[Pos, object]]:
    return [(p, r) for s in scan_log(OsFileSystem(), os.path.join(spool, "log")) for p, r in s.records]


def in_loop(log, fn):
    """Call ``fn()`` inside an event loop (conclusions ask for a commit round) and let that round finish."""

    async def go():
        out = fn()
        await log.sync()
        return out

    return asyncio.run(go())


def checkpoint_here(spool: str, log, parked: tuple[Pos, ...] = ()) -> None:
    """A checkpoint at the durable end, listing the ``parked`` envelopes as the daemon's does."""
    e = log.durable_end
    write_checkpoint(OsFileSystem(), spool, Checkpoint(e, e, (e, e), ((), ()), 1.0, parked=parked))


def cut_after(spool: str, pos: Pos) -> None:
    """A crash right after the record at ``pos`` was written: the rest of its segment never was."""
    path = segment_path(os.path.join(spool, "log"), pos.segment)
    scan = [p for p, _r in records(spool) if p.segment == pos.segment]
    after = [p.offset for p in scan if p > pos]
    if after:
        with open(path, "r+b") as f:
            f.truncate(after[0])


def deferred_message(spool: str):
    """M acknowledged, attempted once (451, DELIVERY fsync'd), concluded into a runner-1 replacement that is
    durable; a checkpoint after all of it. Returns (log, queue, replacement position, replacement)."""
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    attempt = q.start(live(spool)[env.queue_id][0][0], env)
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [DEFERRED]))
    _c, rpos = in_loop(log, lambda: q.conclude(attempt))
    checkpoint_here(spool, log)
    [(pos, renv)] = live(spool)[env.queue_id]
    assert pos == rpos
    return log, q, pos, renv


def test_a_flush_whose_start_was_lost_in_a_power_cut_leaves_one_live_envelope(tmp_path):
    """31.2: a deferred message is flushed (START admin=flush, DATA copy, runner-0 replacement: book-keeping,
    not fsync'd); the power cut zeroes the START and keeps the rest. Before the fix recovery kept the
    original deferred envelope (no START names it) and also the replacement (its ``replaces`` names a START
    nobody read): two live envelopes, the message delivered twice. Now the replacement is distrusted and
    ended: one live envelope, the original, readable, at every start."""
    spool = str(tmp_path)
    log, q, pos, renv = deferred_message(spool)
    in_loop(log, lambda: q.admin(pos, renv, "flush"))
    log.close()
    [start_pos] = zero(spool, lambda p, r: isinstance(r, StartRecord) and r.admin == "flush")
    for _ in range(2):
        log, _q2, res = start(spool, segment_bytes_max=1 << 20)
        [(lpos, lenv)] = live(spool)[renv.queue_id]
        assert (pos, BODY) == (lpos, body_of(log, lenv))
        assert [start_pos.offset] == [h.offset for h in res.holes]
        log.close()


def test_a_copy_forward_whose_start_was_lost_leaves_one_held_envelope(tmp_path):
    """31.2, the daemon's own copy forward of held mail: START(copy) lost, DATA copy and replacement kept.
    One held envelope after recovery (before the fix: two, each released on its own)."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    _rec, _held_pos, lsn = q.admin(live(spool)[env.queue_id][0][0], env, "hold")
    asyncio.run(log.commit(lsn))
    [(hpos, henv)] = live(spool)[env.queue_id]
    checkpoint_here(spool, log, parked=(hpos,))
    asyncio.run(q.copy_forward(hpos, henv))
    log.close()
    zero(spool, lambda p, r: isinstance(r, StartRecord) and r.admin == "copy")
    for _ in range(2):
        log, q2, _res = start(spool, segment_bytes_max=1 << 20)
        [(lpos, lenv)] = live(spool)[env.queue_id]
        assert (hpos, True, BODY) == (lpos, lenv.held, body_of(log, lenv))
        assert [hpos] == sorted(q2.parked.entries)
        log.close()


def test_an_administrators_bounce_whose_start_was_lost_sends_no_dsn(tmp_path):
    """Found by the crash-state explorer (V8): an administrator bounces M; the power cut keeps the DSN (its
    DATA and envelope) and loses START(admin=bounce). M is live again (no START names it) and was delivered,
    while the DSN told the sender it had failed. Now a DSN names the START that queued it
    (``bounce_start``), and one whose START was lost is ended: M stays queued, no DSN."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    checkpoint_here(spool, log)
    [(pos, _e)] = live(spool)[env.queue_id]
    in_loop(log, lambda: q.admin(pos, env, "bounce"))
    log.close()
    [dsn] = [r for _p, r in records(spool) if isinstance(r, EnvelopeRecord) and r.bounce_of == env.queue_id]
    [start_pos] = zero(spool, lambda p, r: isinstance(r, StartRecord) and r.admin == "bounce")
    assert start_pos == dsn.bounce_start
    for _ in range(2):
        log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
        log.close()
        got = live(spool)
        assert [pos] == [p for p, _e in got[env.queue_id]]
        assert f"dsn:{env.queue_id}" not in got


def test_a_crash_while_recovery_ends_a_distrusted_replacement_does_not_bounce_it(tmp_path):
    """Found by the crash-state explorer (V9): a deferral's replacement survived a power cut without its DATA
    copy; the next start distrusts it, concludes the attempt again (a good replacement) and ends the orphan
    with a START and a FINISH, and is killed between the two. Before the fix the start after that took the
    orphan's START for an interrupted delivery attempt whose DATA was unreadable and bounced it (554 5.3.0)
    while the good replacement was delivered: delivered and bounced. Now recovery's own ending is a START
    with ``admin="end"``, completed with its FINISH: one live envelope, readable, no DSN."""
    spool = str(tmp_path)
    _q, env, _ = acknowledged_then_attempted(spool, DEFERRED)
    [copy] = zero(spool, lambda p, r: isinstance(r, DataRecord) and r.queue_id == env.queue_id and p != env.data)
    [orphan] = [p for p, r in records(spool) if isinstance(r, EnvelopeRecord) and r.data == copy]
    log, _q2, _res = start(spool, segment_bytes_max=1 << 20)  # distrusts, concludes again, ends the orphan
    log.close()
    [end_start] = [p for p, r in records(spool) if isinstance(r, StartRecord) and r.envelope == orphan]
    cut_after(spool, end_start)  # killed before the FINISH
    for _ in range(2):
        log, _q3, _res = start(spool, segment_bytes_max=1 << 20)
        log.close()
        got = live(spool)
        [(_pos, renv)] = got[env.queue_id]
        assert BODY == body_of(log, renv)
        assert f"dsn:{env.queue_id}" not in got
        assert 1 == len([r for _p, r in records(spool) if isinstance(r, FinishRecord) and r.start == end_start])


def test_a_hole_in_a_sealed_segment_is_a_hole_even_without_a_checkpoint(tmp_path):
    """Found by the 300-cycle crash run (seed 33): a deferral's DATA copy and replacement, not fsync'd, then a
    roll-over seals the segment; a reordered power cut zeroes the DATA copy and keeps the replacement and
    the SEAL; and media damage has made the checkpoint unusable. Recovery required a checkpoint (or an
    unsealed segment) before it would call anything an unsynced hole, so the lost copy was "corruption",
    the replacement was trusted and the intact message bounced 554 5.3.0. The records' own ``durable``
    claims are the evidence now: the zeros lie after all of them, so they are a hole, and the attempt is
    concluded again from the original DATA."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    attempt = q.start(live(spool)[env.queue_id][0][0], env)
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [DEFERRED]))
    log.sync_soon = lambda: None  # type: ignore[method-assign]  # the cut comes before that fsync
    _c, rpos = q.conclude(attempt)
    log.segment_bytes_max = log.end.offset + 8  # the next record rolls the segment over (and seals it)
    q._append_message("carol@example.org", ["dave@example.net"], BODY)
    log.close()
    [copy] = [r.data for p, r in records(spool) if p == rpos]
    path = segment_path(os.path.join(spool, "log"), copy.segment)
    raw = bytearray(open(path, "rb").read())
    raw[copy.offset:rpos.offset] = bytes(rpos.offset - copy.offset)  # that write never reached the disk
    open(path, "wb").write(bytes(raw))
    assert not os.path.exists(os.path.join(spool, "checkpoint"))  # none (or a damaged one): every segment is read
    log, _q2, res = start(spool, segment_bytes_max=1 << 20)
    log.close()
    assert ([copy.offset], []) == ([h.offset for h in res.holes], res.corrupt)
    log, _q3, _res = start(spool, segment_bytes_max=1 << 20)
    [(_pos, renv)] = live(spool)[env.queue_id]
    assert BODY == body_of(log, renv)
    log.close()


def test_a_held_message_whose_release_lost_its_start_stays_listed_and_held(tmp_path):
    """Found by the crash-state explorer (V7): a held message is released; the power cut keeps only the
    release's replacement (START(release) and the DATA copy lost). Recovery ends that replacement (its START
    was lost) and the held envelope is live again; the queue view, which kept one envelope per queue ID,
    took the ended replacement's FINISH for the end of the message: ``mtaq queue list`` no longer showed
    it and no release could select it, held forever. Now the view falls back to the older envelope no START
    named: the message is listed, held, at its position."""
    from mtaq.admin.service import offline_view

    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    _rec, _pos, lsn = q.admin(live(spool)[env.queue_id][0][0], env, "hold")
    asyncio.run(log.commit(lsn))
    [(hpos, henv)] = live(spool)[env.queue_id]
    checkpoint_here(spool, log, parked=(hpos,))
    in_loop(log, lambda: q.admin(hpos, henv, "release"))
    log.close()
    zero(spool, lambda p, r: (isinstance(r, StartRecord) and r.admin == "release")
         or (isinstance(r, DataRecord) and p > hpos))
    for _ in range(2):
        log, q2, _res = start(spool, segment_bytes_max=1 << 20)
        log.close()
        [(lpos, _lenv)] = live(spool)[env.queue_id]
        assert hpos == lpos
        entry = offline_view(spool).entries[env.queue_id]
        assert (hpos, "held") == (entry.pos, entry.state)
        assert [hpos] == sorted(q2.parked.entries)


def test_a_lost_start_before_a_surviving_data_copy_is_a_hole_not_corruption(tmp_path):
    """Found by the crash-state explorer (V5): a copy forward of held mail, the power cut keeps the DATA copy
    and loses the START before it (and the replacement after it was never written). Recovery lists no DATA
    records (it checksums them only), so it took the last good frame for the one before the zeros and
    called them corruption: ``mtaq log verify`` failed on a plain crash leftover. Now the zeros, with a good
    frame after them and after the known durable end, are an unsynced hole; the message is held, once, and
    the log verifies."""
    import io

    from mtaq.storage.logtools import verify

    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    _rec, _pos, lsn = q.admin(live(spool)[env.queue_id][0][0], env, "hold")
    asyncio.run(log.commit(lsn))
    [(hpos, henv)] = live(spool)[env.queue_id]
    checkpoint_here(spool, log, parked=(hpos,))
    asyncio.run(q.copy_forward(hpos, henv))
    log.close()
    [copy] = [p for p, r in records(spool) if isinstance(r, EnvelopeRecord) and r.replaces is not None
              and p > hpos]
    cut_after(spool, Pos(copy.segment, copy.offset - 1))  # the replacement never reached the file
    [start_pos] = zero(spool, lambda p, r: isinstance(r, StartRecord) and r.admin == "copy")
    for _ in range(2):
        log, _q2, res = start(spool, segment_bytes_max=1 << 20)
        assert ([start_pos.offset], []) == ([h.offset for h in res.holes], res.corrupt)
        [(lpos, lenv)] = live(spool)[env.queue_id]
        assert (hpos, True, BODY) == (lpos, lenv.held, body_of(log, lenv))
        log.close()
    out = io.StringIO()
    assert 0 == verify(os.path.join(spool, "log"), out=out), out.getvalue()


def test_a_bit_flip_in_the_fsynced_data_of_an_acknowledged_message_is_corruption_not_a_hole(tmp_path):
    """31.3: M is received and fsync'd (250); another message's DELIVERY, appended after that fsync, rolls
    the segment; a bit of M's body flips in the sealed segment. Before the fix M's ENVELOPE carried the
    durable end from before M and DELIVERY/SEAL carried none, so the flip was called an unsynced hole and
    M ended quietly ("no 250 was sent"). Now every record carries the durable end when it was appended:
    the flip is corruption, reported, and M stays queued for the delivery worker to bounce with a DSN."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    checkpoint_here(spool, log)  # the daemon writes one at every start
    other = asyncio.run(q.receive("carol@example.org", ["dave@example.net"], b"Subject: o\r\n\r\nx\r\n"))
    attempt = q.start(live(spool)[other.queue_id][0][0], other)
    m = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))  # the 250
    log.segment_bytes_max = log.end.offset + 8  # the next record rolls the segment over
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [DEFERRED]))
    assert log.current_segment == m.data.segment + 1
    log.close()  # kill -9
    flip(spool, m.data, 200)
    for _ in range(2):
        log, _q2, res = start(spool, segment_bytes_max=1 << 20)
        assert [] == res.holes
        assert [m.data.offset] == [p.offset for p in res.corrupt]
        [(_pos, menv)] = live(spool)[m.queue_id]  # still queued: the worker bounces it (554 5.3.0, DSN)
        assert body_of(log, menv) is None
        log.close()


def test_an_acknowledged_message_whose_data_is_damaged_past_all_evidence_is_never_ended_silently(tmp_path):
    """31.3, when in doubt: M is the last thing written and fsync'd, nothing after it vouches for it, and
    its DATA is damaged with its envelope intact after it. Recovery cannot tell a lost page from a flipped
    bit: M stays queued (to be bounced with a DSN by the delivery worker), never ended without a word."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    checkpoint_here(spool, log)
    m = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))  # the 250
    log.close()
    flip(spool, m.data, 200)
    log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
    [(_pos, menv)] = live(spool)[m.queue_id]
    assert body_of(log, menv) is None
    assert not [r for _p, r in records(spool) if isinstance(r, StartRecord) and r.queue_id == m.queue_id]
    log.close()


def test_a_crash_between_a_dsn_and_its_finish_queues_the_dsn_once(tmp_path):
    """31.4: a 5xx, its DSN appended, the crash before the FINISH. Before the fix recovery concluded the
    attempt again and queued a second DSN (the count of DSNs queued lived only in memory). Recovery killed
    between the DSN it might append and its own FINISH (the FINISH cut again) must not add one either."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    attempt = q.start(live(spool)[env.queue_id][0][0], env)
    asyncio.run(q.record_outcomes(attempt, "mx[127.0.0.1]:25", [FAILED]))
    in_loop(log, lambda: q.conclude(attempt))
    log.close()
    [dsn_pos] = [p for p, r in records(spool) if isinstance(r, EnvelopeRecord) and r.bounce_of == env.queue_id]
    cut_after(spool, dsn_pos)  # the FINISH never reached the file
    for _ in range(3):
        log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
        log.close()
        got = live(spool)
        assert env.queue_id not in got
        assert 1 == len(got[f"dsn:{env.queue_id}"])
        finishes = [p for p, r in records(spool) if isinstance(r, FinishRecord) and r.start == attempt.start_pos]
        assert 1 == len(finishes)
        cut_after(spool, Pos(finishes[0].segment, finishes[0].offset - 1))  # and recovery's own FINISH is cut


def test_an_interrupted_admin_action_whose_data_is_damaged_is_bounced_with_a_dsn(tmp_path):
    """31.6: an administrator holds M; the crash comes right after the START (no DATA copy, no replacement),
    and M's fsync'd DATA has a flipped bit. Before the fix recovery logged ``admin_action_lost`` and
    dropped the attempt with neither FINISH nor DSN, at every start. Now it bounces M (554 5.3.0) with a
    DSN and a FINISH, as a delivery attempt with damaged DATA is, once."""
    spool = str(tmp_path)
    log, q, _ = start(spool, segment_bytes_max=1 << 20)
    env = asyncio.run(q.receive("alice@example.org", ["bob@example.net"], BODY))
    checkpoint_here(spool, log)
    in_loop(log, lambda: q.admin(live(spool)[env.queue_id][0][0], env, "hold"))
    log.close()
    [start_pos] = [p for p, r in records(spool) if isinstance(r, StartRecord) and r.admin == "hold"]
    cut_after(spool, start_pos)
    flip(spool, env.data, 200)
    for _ in range(2):
        log, _q2, _res = start(spool, segment_bytes_max=1 << 20)
        got = live(spool)
        assert env.queue_id not in got
        [(_pos, dsn)] = got[f"dsn:{env.queue_id}"]
        body = body_of(log, dsn)
        assert body is not None and b"5.3.0" in body
        assert 1 == len([r for _p, r in records(spool) if isinstance(r, FinishRecord) and r.start == start_pos])
        log.close()
