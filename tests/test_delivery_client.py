"""The delivery client against real aiosmtpd servers that answer oddly: per-recipient final replies only."""

from __future__ import annotations

import asyncio

from aiosmtpd.smtp import SMTP

from mtaq.delivery.relay import RelayConnection, classify, split_enhanced


class Recorder:
    """A next hop that records DATA transactions; RCPT answers come from ``rcpt_reply``."""

    def __init__(self, rcpt_reply=None) -> None:
        self.rcpt_reply = rcpt_reply
        self.messages: list[tuple[str, list[str]]] = []

    async def handle_RCPT(self, server, session, envelope, address, opts):
        if self.rcpt_reply:
            reply = self.rcpt_reply(address)
            if reply:
                return reply
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server, session, envelope):
        self.messages.append((envelope.mail_from, list(envelope.rcpt_tos)))
        return "250 2.0.0 Ok"


async def with_server(handler, fn, **smtp_kw):
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: SMTP(handler, hostname="hop", loop=loop, **smtp_kw), "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    conn = RelayConnection("127.0.0.1", port, helo_name="mtaq.test", timeout_s=5)
    try:
        return await fn(conn)
    finally:
        srv.close()


BODY = b"Subject: t\r\n\r\nhi\r\n"


class OddTwoHundreds(Recorder):
    """A next hop that answers RCPT 252 (keeping the recipient) and the end of DATA with ``data_reply``."""

    def __init__(self, data_reply: str) -> None:
        super().__init__()
        self.data_reply = data_reply

    async def handle_RCPT(self, server, session, envelope, address, opts):
        envelope.rcpt_tos.append(address)
        return "252 2.1.5 Cannot VRFY user, but will accept message"

    async def handle_DATA(self, server, session, envelope):
        self.messages.append((envelope.mail_from, list(envelope.rcpt_tos)))
        return self.data_reply


def test_every_2xx_to_rcpt_and_to_the_end_of_data_is_delivered():
    """RFC 5321 §4.2.1: a 2yz reply is positive completion. RCPT answered 252 is an accepted recipient, and
    a final reply of 251/252/299 to the end of DATA delivers it (Postfix's smtp client takes any 2xx);
    before, anything but 250 counted as 451 and the message was sent again and again."""
    for data_reply in ("250 2.0.0 Ok", "251 2.0.0 Ok, forwarded", "252 2.0.0 queued", "299 2.0.0 fine"):
        h = OddTwoHundreds(data_reply)
        replies = asyncio.run(with_server(h, lambda c: c.send("a@x.org", ["b@y.org"], BODY)))
        assert (["delivered"], [("a@x.org", ["b@y.org"])]) == ([classify(r.code) for r in replies], h.messages)
        assert int(data_reply[:3]) == replies[0].code


def test_mixed_rcpt_replies_map_to_each_recipient():
    """550 and 451 at RCPT are those recipients' final replies; the others get the end-of-DATA reply."""
    h = Recorder(lambda a: {"bad@y.org": "550 5.1.1 no such user", "later@y.org": "451 4.2.0 busy"}.get(a))
    replies = asyncio.run(with_server(h, lambda c: c.send("a@x.org", ["ok@y.org", "bad@y.org", "later@y.org"], BODY)))
    assert [("delivered", "2.0.0"), ("failed", "5.1.1"), ("deferred", "4.2.0")] == [(classify(r.code), r.enhanced) for r in replies]
    assert [("a@x.org", ["ok@y.org"])] == h.messages


def test_internationalised_address_without_smtputf8_fails_5_6_7_and_the_connection_stays_usable():
    """A next hop without SMTPUTF8: the UTF-8 recipient gets 553 5.6.7, the ASCII one is delivered, and the
    reused connection is clean for the next message (no half transaction left behind)."""
    h = Recorder()

    async def two(c):
        first = await c.send("a@x.org", ["jürgen@y.org", "bob@y.org"], BODY)
        second = await c.send("a@x.org", ["carol@y.org"], BODY)
        return first, second

    first, second = asyncio.run(with_server(h, two))  # aiosmtpd without enable_SMTPUTF8
    assert [(553, "5.6.7"), (250, "2.0.0")] == [(r.code, r.enhanced) for r in first]
    assert [(250, "2.0.0")] == [(r.code, r.enhanced) for r in second]
    assert [("a@x.org", ["bob@y.org"]), ("a@x.org", ["carol@y.org"])] == h.messages


def test_internationalised_address_goes_with_smtputf8_when_offered():
    h = Recorder()
    replies = asyncio.run(with_server(h, lambda c: c.send("a@x.org", ["jürgen@y.org"], BODY), enable_SMTPUTF8=True))
    assert [250] == [r.code for r in replies]
    assert [("a@x.org", ["jürgen@y.org"])] == h.messages


def test_unreachable_next_hop_defers_with_4_4_1():
    conn = RelayConnection("127.0.0.1", 1, helo_name="mtaq.test", timeout_s=2)
    replies = asyncio.run(conn.send("a@x.org", ["b@y.org"], BODY))
    assert [(421, "4.4.1", "deferred")] == [(r.code, r.enhanced, classify(r.code)) for r in replies]


def test_enhanced_status_code_is_split_off_the_reply_text():
    assert ("5.1.1", "no such user") == (split_enhanced(550, "5.1.1 no such user").enhanced, split_enhanced(550, "5.1.1 no such user").text)
    assert ("4.0.0", "try later") == (split_enhanced(421, "try later").enhanced, split_enhanced(421, "try later").text)


def test_utf8_header_with_smtputf8_requested_is_not_sent_to_a_hop_without_it():
    """The client asked for SMTPUTF8 and a header is UTF-8: every recipient gets 553 5.6.7 (RFC 6531 §3.2)
    rather than a message the next hop cannot read; nothing is sent."""
    h = Recorder()
    body = "Subject: Grüße\r\n\r\nhi\r\n".encode()
    replies = asyncio.run(with_server(h, lambda c: c.send("a@x.org", ["b@y.org", "c@y.org"], body,
                                                          mail_params=[("SMTPUTF8", "")])))
    assert [(553, "5.6.7"), (553, "5.6.7")] == [(r.code, r.enhanced) for r in replies]
    assert [] == h.messages


def test_ascii_message_with_smtputf8_requested_goes_to_a_hop_without_it():
    """SMTPUTF8 asked for but nothing needs it (ASCII envelope and headers): delivered as plain SMTP."""
    h = Recorder()
    replies = asyncio.run(with_server(h, lambda c: c.send("a@x.org", ["b@y.org"], BODY, mail_params=[("SMTPUTF8", "")])))
    assert [250] == [r.code for r in replies]


class Dropper(Recorder):
    """Closes the connection after each delivered message (as a server's idle timeout would later)."""

    async def handle_DATA(self, server, session, envelope):
        reply = await super().handle_DATA(server, session, envelope)
        asyncio.get_running_loop().call_later(0.05, server.transport.close)
        return reply


def test_a_cached_connection_closed_by_the_server_is_reopened_not_deferred():
    """The next hop hung up on the idle connection: the next message goes on a new connection."""
    h = Dropper()

    async def two(c):
        first = await c.send("a@x.org", ["b@y.org"], BODY)
        await asyncio.sleep(0.3)
        second = await c.send("a@x.org", ["c@y.org"], BODY)
        return first + second

    replies = asyncio.run(with_server(h, two))
    assert [250, 250] == [r.code for r in replies]
    assert [("a@x.org", ["b@y.org"]), ("a@x.org", ["c@y.org"])] == h.messages


def test_connection_pool_reuses_by_hop_and_closes_idle_and_least_recently_used():
    """One connection per (address, port, host name, TLS policy); idle ones close after idle_s; over
    max_conns the least recently used idle one is closed."""
    from mtaq.delivery.routing import Candidate
    from mtaq.delivery.transport import ConnectionPool

    now = [0.0]
    pool = ConnectionPool(helo_name="h", timeout_s=1, idle_s=10, max_conns=2, clock=lambda: now[0])

    async def go():
        a = pool.get(Candidate("mx.a", "127.0.0.2", 25), "may")
        await pool.release(a)
        assert a is pool.get(Candidate("mx.a", "127.0.0.2", 25), "may")
        await pool.release(a)
        b = pool.get(Candidate("mx.a", "127.0.0.2", 25), "encrypt")
        assert b is not a
        await pool.release(b)
        now[0] = 5.0
        c = pool.get(Candidate("mx.c", "127.0.0.3", 25), "may")
        await pool.release(c)
        after_lru = len(pool)
        assert a is not pool.get(Candidate("mx.a", "127.0.0.2", 25), "may")  # a was the oldest: closed
        now[0] = 100.0
        closed = await pool.close_idle()
        return after_lru, closed, len(pool)

    # after c: 2 left (a dropped); the re-got a stays busy, so only b and c are idle and closed.
    assert (2, 2, 1) == asyncio.run(go())


def test_a_reply_longer_than_the_limit_is_refused_even_when_it_came_whole_in_one_read():
    """A next hop's reply is held to _REPLY_BYTES_MAX (64 KiB, all its lines) whether it arrives in pieces or
    whole in one read (before, only a reply still incomplete was measured: a hostile hop could hand over
    any one read's worth at a time). A reply within the limit, over several lines, still parses."""
    import aiosmtplib
    import pytest

    from mtaq.delivery import relay

    class _Transport(asyncio.WriteTransport):
        def is_closing(self) -> bool:
            return False

    conv = relay._Conversation(asyncio.Protocol(), _Transport())
    conv.data_received(b"250-" + b"x" * 1000 + b"\r\n250 2.1.0 Ok\r\n")
    ok = asyncio.run(conv.read(1.0))
    assert 250 == ok.code and ok.message.endswith("2.1.0 Ok")
    conv.data_received(b"250 2.1.5 " + b"y" * (relay._REPLY_BYTES_MAX + 10) + b"\r\n")  # whole, in one read
    with pytest.raises(aiosmtplib.SMTPResponseException):
        asyncio.run(conv.read(1.0))
    conv2 = relay._Conversation(asyncio.Protocol(), _Transport())
    conv2.data_received(b"250-a\r\n" * (relay._REPLY_BYTES_MAX // 7 + 10) + b"250 end\r\n")  # many short lines
    with pytest.raises(aiosmtplib.SMTPResponseException):
        asyncio.run(conv2.read(1.0))
