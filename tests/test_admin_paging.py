"""Listing a large queue (issue 36 item 2): pages with a cursor, damage reported, a view kept between
listings. In-process daemon (real spool, real loopback SMTP and admin HTTP), and ``mtaq queue`` as a real
process on a spool read directly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from test_runners import Harness, run

from mtaq.core.frame import scan_segment
from mtaq.core.records import DataRecord
from mtaq.core.view import Selector
from mtaq.queue.store import queue_id_shard
from mtaq.testing.prefill import prefill_deferred, prefill_shards

BODY = b"From: <a@example.com>\r\nSubject: page\r\n\r\n" + b"x" * 4000 + b"\r\n"


def _get(spool: str, path: str) -> tuple[int, Any]:
    with open(os.path.join(spool, "admin.json")) as f:
        url = json.load(f)["url"]
    with open(os.path.join(spool, "admin.token")) as f:
        token = f.read().strip()
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_pages_list_every_message_exactly_once_while_mail_is_added_and_removed(tmp_path):
    """GET .../mails?limit=7, then ?limit=7&after=NEXT until ``next`` is null. Between pages one message
    already listed and one not yet listed are deleted and three new ones arrive: every message queued the
    whole time is listed exactly once, the one deleted before its page never, each new one once; a page has
    at most 7; a cursor that is not one is 400 naming ``after``."""

    def prepare(h: Harness) -> None:
        prefill_deferred(h.spool, 30, lambda i: BODY, age_s=3600)

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        await h.until(lambda: adm.size()["total"] == 30, what="30 queued")
        everything = [m["queue_id"] for m in (await adm.list(Selector()))[1]]
        status, first = await asyncio.to_thread(_get, h.spool, "/mailQueues/spool/mails?limit=7")
        assert (200, 7, everything[:7]) == (status, first["count"], [m["queue_id"] for m in first["mails"]])
        listed = [m["queue_id"] for m in first["mails"]]
        gone_listed, gone_unlisted = everything[2], everything[20]
        res = await adm.act("delete", Selector(ids=(gone_listed, gone_unlisted)))
        assert sorted([gone_listed, gone_unlisted]) == sorted(res.done)
        h.sink.defer = re.compile("^new")
        new = [await h.send("bob@example.org", [f"new{i}@example.net"], f"n{i}") for i in range(3)]
        cursor, pages = first["next"], 1
        while cursor is not None:
            q = urllib.parse.urlencode({"limit": 7, "after": cursor})
            status, page = await asyncio.to_thread(_get, h.spool, f"/mailQueues/spool/mails?{q}")
            assert 200 == status and page["count"] <= 7, page
            listed += [m["queue_id"] for m in page["mails"]]
            cursor, pages = page["next"], pages + 1
            assert pages < 10
        assert len(listed) == len(set(listed)), "a message listed twice"
        expected = [q for q in everything if q != gone_unlisted] + new
        assert sorted(expected) == sorted(listed)
        status, err = await asyncio.to_thread(_get, h.spool, "/mailQueues/spool/mails?after=nonsense")
        assert (400, True) == (status, "after" in err["message"])

    run(tmp_path, body, prepare=prepare, retry_intervals_s=[3600.0])


def _damage_a_body(spool: str) -> tuple[int, int]:
    """Flip a byte in the body of a DATA record in segment 1; return (segment, offset of its frame)."""
    path = os.path.join(spool, "log", "000000000001.seg")
    with open(path, "rb") as f:
        buf = f.read()
    pos = [p for p, r in scan_segment(1, buf).records if isinstance(r, DataRecord)][3]
    at = pos.offset + 12 + 200
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([buf[at] ^ 0x20]))
    return pos.segment, pos.offset


def test_a_listing_reports_damage_it_meets_in_the_log_online_and_offline(tmp_path):
    """A bit flipped in a message body in segment 1: ``mtaq queue list`` on the spool (no daemon) still
    lists every message and says ``mtaq: damaged log: segment 1 offset N: corrupt`` on stderr; the running
    daemon's listing (``damage`` of GET .../mails) names it too."""
    spool = str(tmp_path / "spool")
    prefill_deferred(spool, 40, lambda i: BODY, age_s=60, segment_bytes_max=65536)
    seg, off = _damage_a_body(spool)
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", "list", "--json", "--spool", spool],
                         capture_output=True, text=True, timeout=60)
    assert 0 == out.returncode, out.stderr
    assert 40 == len(out.stdout.splitlines())
    assert re.search(rf"^mtaq: damaged log: segment {seg} offset {off}: corrupt ", out.stderr, re.M), out.stderr

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        await h.until(lambda: h.daemon.admin.size()["total"] == 40, what="40 queued")
        status, listing = await asyncio.to_thread(_get, h.spool, "/mailQueues/spool/mails")
        assert (200, 40) == (status, listing["count"])
        assert [f"segment {seg} offset {off}: corrupt"] == [d.split(" (")[0] for d in listing["damage"]]

    run(tmp_path, body, retry_intervals_s=[3600.0], segment_bytes_max=65536)


def test_the_view_kept_between_listings_equals_one_read_afresh_across_deliveries_and_reclamation(tmp_path):
    """The daemon keeps the view of its last listing and reads only what the log gained since. After
    deliveries, new mail, a hold, several segments and reclamation (two checkpoints), each listing equals
    one built from the whole log at that moment: a delivered message is never listed as queued."""

    from mtaq.admin.service import _catch_up, _view_of_segments, page_of

    async def fresh(h: Harness) -> list[dict[str, Any]]:
        log = h.daemon.queue.log
        with log.segments_kept():
            view = _view_of_segments(log, log.durable_end)
        _catch_up(view, log)
        return page_of(Selector().select(view.entries.values(), 0), view, limit=None, after=None,
                       position=str(view.end)).mails

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        d, adm = h.daemon, h.daemon.admin
        h.sink.defer = re.compile("^slow")
        ids = [await h.send("alice@example.org", [f"slow{i}@example.net"], f"m{i}") for i in range(5)]
        await h.until(lambda: adm.size()["deferred"] == 5, what="5 deferred")
        raw = (await adm.page(Selector(), raw=True)).raw  # each message's JSON made and kept
        assert ids == [json.loads(b)["queue_id"] for b in raw or ()]
        first = adm._view
        h.sink.defer = re.compile("^slow[34]")
        h.clock.offset += 3601.0
        h.poke()
        await h.until(lambda: len(h.sink.to("slow0@example.net")) == 1, what="slow0 delivered")
        await h.until(lambda: adm.size()["total"] == 2, what="three delivered")
        for i in range(6):  # several segments (64 KiB)
            await h.send("alice@example.org", ["pad@example.net"], f"p{i}", size=40_000)
        await h.until(lambda: len(h.sink.to("pad@example.net")) == 6, what="padding delivered")
        held = await h.send("carol@example.org", ["slow3x@example.net"], "held")
        await h.until(lambda: h.sink.rcpt_attempts.count("slow3x@example.net") == 1
                      and adm.size()["deferred"] == 3, what="the third deferred")
        assert [held] == (await adm.act("hold", Selector(ids=(held,)))).done
        _pos, listed = await adm.list(Selector())
        assert first is adm._view  # read forward, not again
        assert await fresh(h) == listed
        raw = (await adm.page(Selector(), raw=True)).raw  # the JSON kept per message (the HTTP answer's)
        assert listed == [json.loads(b) for b in raw or ()]
        assert [ids[3], ids[4], held] == [m["queue_id"] for m in listed]
        await d.checkpoint()
        await d.checkpoint()
        h.sink.defer = None
        h.clock.offset += 7200.0
        h.poke()
        await adm.act("release", Selector(ids=(held,)))
        await h.until(lambda: adm.size()["total"] == 0, what="everything delivered")
        await d.checkpoint()
        assert [] == (await adm.list(Selector()))[1]
        assert [] == (await adm.page(Selector(), raw=True)).raw
        assert [] == await fresh(h)

    run(tmp_path, body, retry_intervals_s=[3600.0], segment_bytes_max=65536)


def test_a_segment_read_on_from_an_offset_gives_what_a_whole_read_gives_there(tmp_path):
    """``scan_frames`` (how the kept view reads on from where it stopped) from any frame boundary of a
    damaged segment: the records and problems at or after it, as ``scan_segment`` of the whole file finds
    them."""
    from mtaq.core.frame import SEGMENT_HEADER_BYTES, decode_segment_header, scan_frames

    spool = str(tmp_path / "spool")
    prefill_deferred(spool, 40, lambda i: BODY, segment_bytes_max=65536)
    _damage_a_body(spool)
    with open(os.path.join(spool, "log", "000000000001.seg"), "rb") as f:
        buf = f.read()
    whole = scan_segment(1, buf, skip_data=True)
    assert 1 == len(whole.corruption)
    salt = decode_segment_header(buf).salt
    starts = sorted({SEGMENT_HEADER_BYTES, *(p.offset for p, _ in whole.records), whole.problems[0].end})
    for base in starts:
        part = scan_frames(1, buf[base:], base, salt, skip_data=True)
        assert [(p, r) for p, r in whole.records if p.offset >= base] == part.records
        assert [p for p in whole.problems if p.offset >= base] == part.problems
        assert whole.valid_end == part.valid_end


def test_queue_list_pages_with_limit_and_after_on_the_spool(tmp_path):
    """``mtaq queue list --json --limit 15`` (no daemon: the spool read directly) prints 15 messages and
    ``mtaq: more: --after CURSOR``; ``--after CURSOR`` prints the other 25 and no ``more``: together every
    message once, in listing order. A cursor that is not one is exit 1 naming --after."""
    spool = str(tmp_path / "spool")
    prefill_deferred(spool, 40, lambda i: BODY)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", "list", "--json", "--spool", spool, *args],
                              capture_output=True, text=True, timeout=60)

    every = [json.loads(line)["queue_id"] for line in cli().stdout.splitlines()]
    first = cli("--limit", "15")
    [cursor] = re.findall(r"^mtaq: more: --after (\S+)$", first.stderr, re.M)
    rest = cli("--after", cursor, "--limit", "100")
    assert (0, []) == (rest.returncode, re.findall(r"more:", rest.stderr))
    pages = [json.loads(line)["queue_id"] for out in (first, rest) for line in out.stdout.splitlines()]
    assert (40, every) == (len(every), pages)
    bad = cli("--after", "nonsense")
    assert (1, True) == (bad.returncode, "--after" in bad.stderr)


def test_a_queue_prefilled_over_three_shards_lists_whole_offline_in_listing_order(tmp_path):
    """prefill_shards (the benches' sharded backlog) spreads N messages over SPOOL, SPOOL/shard-1 and
    SPOOL/shard-2 with IDs of their shard; mtaq queue list --json with no daemon reads every shard and
    prints all N in listing order, each in the log of the shard its ID names."""
    spool = str(tmp_path / "spool")
    prefill_shards(spool, 10, lambda i: BODY + str(i).encode() + b"\r\n", 3, age_s=60)
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", "list", "--json", "--spool", spool],
                         capture_output=True, text=True, timeout=60)
    assert 0 == out.returncode, out.stderr
    mails = [json.loads(line) for line in out.stdout.splitlines()]
    assert 10 == len(mails)
    keys = [(m["arrival_time"], m["queue_id"]) for m in mails]
    assert sorted(keys) == keys
    by_shard = {k: sorted(m["queue_id"] for m in mails if queue_id_shard(m["queue_id"]) == k) for k in range(3)}
    assert [4, 3, 3] == [len(by_shard[k]) for k in range(3)]
    for k in range(3):
        log = (tmp_path / "spool" / (f"shard-{k}" if k else "") / "log").iterdir()
        text = b"".join(p.read_bytes() for p in log)
        assert all(q.encode() in text for q in by_shard[k])
