"""Delayed delivery with a maximum: RFC 4865 FUTURERELEASE (HOLDFOR / HOLDUNTIL) and the admin API's delay,
refused beyond delay_max_s with a reply naming the limit (Pulsar PIP-315); delayed mail never blocks other
mail (JAMES-4192) and survives a crash. The daemon in process, real sockets, a clock the test can jump."""

from __future__ import annotations

import asyncio
import datetime as dt
import smtplib

from test_runners import Harness, run

from mtaq.core.view import Selector


def send_with(port: int, params: list[str], subject: str) -> tuple[int, bytes, str]:
    """MAIL with ``params``; returns (code, text) of MAIL if refused, else of DATA, and the queue ID."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        code, text = s.mail("alice@example.org", params)
        if code != 250:
            return code, text, ""
        s.rcpt(f"{subject}@example.net")
        code, text = s.data(f"Subject: {subject}\r\nMessage-ID: <{subject}@t>\r\n\r\nbody\r\n".encode())
        return code, text, text.decode().rsplit(" ", 1)[-1]


def test_holdfor_parks_the_message_until_due_without_blocking_new_mail(tmp_path):
    """HOLDFOR=600: the message is listed as delayed with its release time, is not delivered, and mail sent
    after it goes out at once; when the clock passes the release time it is delivered."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        code, _, qid = await asyncio.to_thread(send_with, h.port, ["HOLDFOR=600"], "later")
        assert 250 == code
        _, listed = await h.daemon.admin.list(Selector(ids=(qid,)))
        assert "delayed" == listed[0]["state"]
        assert abs(listed[0]["release_time"] - (h.clock() + 600)) < 5
        await h.send("alice@example.org", ["now@example.net"], "now")
        await h.until(lambda: h.sink.to("now@example.net"), what="mail sent after the delayed one")
        assert [] == h.sink.to("later@example.net")
        h.clock.offset += 601
        await h.until(lambda: h.sink.to("later@example.net"), what="delivery at the release time")
        await h.until(lambda: h.daemon.admin.size()["total"] == 0, what="an empty queue")

    run(tmp_path, body)


def test_a_delay_beyond_delay_max_s_is_refused_with_501_5_5_4_naming_the_limit(tmp_path):
    """delay_max_s = 3600: HOLDFOR=7200 and a HOLDUNTIL two hours ahead are refused at MAIL with 501 5.5.4
    and a text naming the limit; both parameters at once, or a date in the past, are refused too; nothing
    is queued. HOLDFOR=3600 is accepted."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
        past = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for params in (["HOLDFOR=7200"], [f"HOLDUNTIL={later}"]):
            code, text, _ = await asyncio.to_thread(send_with, h.port, params, "x")
            assert 501 == code
            assert text.startswith(b"5.5.4 ")
            assert b"exceeds the maximum of 3600 seconds (delay_max_s)" in text
        for params in (["HOLDFOR=60", f"HOLDUNTIL={later}"], [f"HOLDUNTIL={past}"], ["HOLDFOR=soon"]):
            code, text, _ = await asyncio.to_thread(send_with, h.port, params, "x")
            assert (501, True) == (code, text.startswith(b"5.5.4 ")), (params, text)
        assert 0 == h.daemon.admin.size()["total"]
        code, _, _ = await asyncio.to_thread(send_with, h.port, ["HOLDFOR=3600"], "ok")
        assert 250 == code
        assert 1 == h.daemon.admin.size()["delayed"]

    run(tmp_path, body, delay_max_s=3600.0)


def test_admin_delay_parks_queued_mail_and_is_bounded_by_the_same_limit(tmp_path):
    """The admin API's delay parks a deferred message until its release time (then it is delivered);
    a delay over delay_max_s is refused naming the limit."""
    import re

    import pytest

    from mtaq.admin.service import AdminError

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        adm = h.daemon.admin
        h.sink.defer = re.compile("^slow")
        qid = await h.send("alice@example.org", ["slow@example.net"], "d1")
        await h.until(lambda: adm.size()["deferred"] == 1, what="deferred")
        with pytest.raises(AdminError, match=r"exceeds the maximum of 3600 seconds \(delay_max_s\)"):
            await adm.act("delay", Selector(ids=(qid,)), delay_s=7200)
        assert [qid] == (await adm.act("delay", Selector(ids=(qid,)), delay_s=120)).done
        assert 1 == adm.size()["delayed"]
        h.sink.defer = None
        h.clock.offset += 121
        await h.until(lambda: h.sink.to("slow@example.net"), what="delivery after the admin delay")

    run(tmp_path, body, delay_max_s=3600.0, retry_intervals_s=[36000.0])


def test_delayed_mail_survives_a_crash_before_and_after_a_checkpoint(tmp_path):
    """Two delayed messages, one received before the last checkpoint and one after; the daemon crashes and
    restarts; both are still delayed (counted and listed) and both are delivered when due."""

    async def body(h: Harness) -> None:
        assert h.daemon is not None
        code1, _, q1 = await asyncio.to_thread(send_with, h.port, ["HOLDFOR=600"], "before")
        await h.daemon.checkpoint()
        code2, _, q2 = await asyncio.to_thread(send_with, h.port, ["HOLDFOR=900"], "after")
        assert (250, 250) == (code1, code2)
        await h.crash()
        await h.start()
        assert 2 == h.daemon.admin.size()["delayed"]
        _, listed = await h.daemon.admin.list(Selector())
        assert {q1, q2} == {m["queue_id"] for m in listed if m["state"] == "delayed"}
        h.clock.offset += 901
        await h.until(lambda: h.sink.to("before@example.net") and h.sink.to("after@example.net"),
                      what="both delivered after the restart")

    run(tmp_path, body)
