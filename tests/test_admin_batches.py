"""Bulk actions over many messages append in batches and let SMTP run between them (issue 36).

Before, ``hold ALL`` over 100,000 messages appended every START and replacement in one turn of the event
loop: no SMTP reply for 8-15 s. Now each batch is committed and the loop runs before the next; the selected
messages are reserved meanwhile, so no delivery worker starts one that the action is about to act on.
"""

from __future__ import annotations

import asyncio
import smtplib
from collections import Counter

import pytest
from test_runners import Harness, run

import mtaq.admin.service as service
from mtaq.core.frame import scan_segment
from mtaq.core.records import EnvelopeRecord, Pos, Record, StartRecord
from mtaq.core.view import Selector
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import list_segments, segment_path
from mtaq.testing.prefill import prefill_deferred

BODY = b"From: <a@example.com>\r\nSubject: bulk\r\n\r\n" + b"x" * 1000 + b"\r\n"
N = 2000


def _records(spool: str) -> list[tuple[Pos, Record]]:
    fs = OsFileSystem()
    log_dir = f"{spool}/log"
    out: list[tuple[Pos, Record]] = []
    for n in list_segments(fs, log_dir):
        out += scan_segment(n, fs.read_file(segment_path(log_dir, n)), skip_data=True).records
    return out


def _starts_by_envelope(spool: str) -> Counter[Pos]:
    return Counter(r.envelope for _p, r in _records(spool) if isinstance(r, StartRecord))


def test_smtp_gets_its_250_while_hold_all_over_many_messages_is_in_progress(tmp_path, monkeypatch):
    """2,000 deferred messages; ``hold ALL`` starts (batches of 4 here, so that it spans many turns of the
    loop). Once the first messages are held (counted by the daemon), a client that had its RCPT accepted
    before the action sends DATA and gets its 250; its envelope lies in the log *between* the action's
    first and last START (SMTP was served while the action ran: before, the action was one turn and every
    START came first), and afterwards every one of the 2,000 is held."""
    monkeypatch.setattr(service, "ACTION_BATCH_MAX", 4, raising=False)

    def prepare(h: Harness) -> None:
        prefill_deferred(h.spool, N, lambda i: BODY, age_s=3600)

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        await h.until(lambda: adm.size()["total"] == N, what=f"{N} queued")
        client = await asyncio.to_thread(smtplib.SMTP, "127.0.0.1", h.port, timeout=60)
        try:
            await asyncio.to_thread(client.ehlo, "client.test")
            assert 250 == (await asyncio.to_thread(client.mail, "new@example.com"))[0]
            assert 250 == (await asyncio.to_thread(client.rcpt, "rcpt@example.net"))[0]
            action = asyncio.create_task(adm.act("hold", Selector(all=True)))
            await h.until(lambda: adm.size().get("held", 0) > 0 or action.done(), what="the first held")
            code, text = await asyncio.to_thread(client.data, b"Subject: during\r\n\r\nduring hold ALL\r\n")
            res = await action
        finally:
            client.close()
        assert 250 == code
        assert (N, {}) == (len(res.done), res.skipped)
        qid = text.decode().rsplit(" ", 1)[1]
        records = _records(h.spool)
        holds = [p for p, r in records if isinstance(r, StartRecord) and r.admin == "hold"]
        [mine] = [p for p, r in records if isinstance(r, EnvelopeRecord) and r.queue_id == qid]
        assert (N, True) == (len(holds), holds[0] < mine < holds[-1])
        await h.until(lambda: adm.size().get("held", 0) == N, what="all held")

    run(tmp_path, body, prepare=prepare, retry_intervals_s=[3600.0])


@pytest.mark.parametrize("action", ["hold", "delete"])
def test_no_message_is_started_twice_when_workers_offer_what_a_bulk_action_is_working_through(tmp_path, monkeypatch,
                                                                                             action):
    """2,000 messages already due; the next hop defers everything, so the workers keep starting them while
    ``ACTION ALL`` works through them in batches of 16: each envelope has at most one START (the worker's or
    the action's, never both), and every message the action reports done was not delivered."""
    monkeypatch.setattr(service, "ACTION_BATCH_MAX", 16, raising=False)

    def prepare(h: Harness) -> None:
        prefill_deferred(h.spool, N, lambda i: BODY, age_s=3600, due_in_s=0.0)

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        await h.until(lambda: len(h.sink.rcpt_attempts) > 20, what="deliveries under way")
        res = await adm.act(action, Selector(all=True))
        assert res.done
        twice = {env: n for env, n in _starts_by_envelope(h.spool).items() if n > 1}
        assert {} == twice

    run(tmp_path, body, prepare=prepare, retry_intervals_s=[3600.0])
