"""Review: a hostile or broken next hop against the pipelined transaction (mtaq.delivery.relay), over real
loopback sockets. The server is scripted: it answers the whole pipelined group at once, in one packet, then
reads what the client sends next. Nothing may count as delivered that the server did not accept after a
final dot, and no content may go out where no recipient was accepted."""

from __future__ import annotations

import asyncio

from mtaq.delivery.relay import RelayConnection


class Scripted:
    """Greets, offers PIPELINING, waits for the DATA line of the group, writes ``group`` (bytes, one write),
    then optionally ``after_content`` once the final dot arrived; records every byte received."""

    def __init__(self, group: bytes, after_content: bytes = b"", close_after_group: bool = False) -> None:
        self.group, self.after_content, self.close_after_group = group, after_content, close_after_group
        self.received = bytearray()
        self.connections = 0
        self.done = asyncio.Event()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        w.write(b"220 hostile ESMTP\r\n")
        try:
            line = await r.readline()
            w.write(b"250-hostile\r\n250 PIPELINING\r\n")
            while (line := await r.readline()) and not line.upper().startswith(b"DATA"):
                self.received += line
            self.received += line
            w.write(self.group)
            await w.drain()
            if self.close_after_group:
                return
            while line := await r.readline():
                self.received += line
                if line == b".\r\n" and self.after_content:
                    w.write(self.after_content)
                    await w.drain()
        finally:
            w.close()
            self.done.set()


def run(server: Scripted, rcpts: list[str], body: bytes, timeout_s: float = 5):
    async def main():
        port = await server.start()
        c = RelayConnection("127.0.0.1", port, helo_name="client.test", timeout_s=timeout_s, tls="none")
        try:
            # wait_for: a reply timer that never fires fails here in 10 s instead of hanging the suite
            replies = await asyncio.wait_for(c.send("s@x.test", rcpts, body), 10)
            reusable = c._client is not None and c._client.is_connected
        finally:
            await c.close()
        await asyncio.wait_for(server.done.wait(), 10)
        server.server.close()
        return replies, reusable

    return asyncio.run(main())


def test_354_after_every_recipient_was_refused_sends_no_content():
    s = Scripted(b"250 2.1.0 ok\r\n550 5.1.1 no\r\n550 5.1.1 no\r\n354 go ahead\r\n")
    replies, reusable = run(s, ["a@y.test", "b@y.test"], b"Subject: secret\r\n\r\nbody\r\n")
    assert [550, 550] == [r.code for r in replies]
    assert b"secret" not in s.received and not reusable


def test_421_in_the_middle_of_a_pipelined_group_delivers_nothing():
    s = Scripted(b"250 2.1.0 ok\r\n250 2.1.5 ok\r\n421 4.3.2 shutting down\r\n", close_after_group=True)
    replies, _ = run(s, ["a@y.test", "b@y.test", "c@y.test"], b"Subject: x\r\n\r\nbody\r\n")
    assert all(400 <= r.code < 500 for r in replies), replies
    assert b"Subject" not in s.received


def test_an_extra_reply_after_the_final_dot_keeps_the_connection_from_being_reused():
    s = Scripted(b"250 2.1.0 ok\r\n250 2.1.5 ok\r\n354 go\r\n", after_content=b"250 2.0.0 queued\r\n250 2.0.0 extra\r\n")
    replies, reusable = run(s, ["a@y.test"], b"Subject: x\r\n\r\n.dot\r\n")
    assert [250] == [r.code for r in replies]
    assert b"\r\n..dot\r\n.\r\n" in bytes(s.received)
    assert not reusable  # replies left unread: the connection is in an unknown state


def test_a_next_hop_that_stops_answering_times_out_and_its_connection_is_dropped():
    """The reply to RCPT never comes: after timeout_s every recipient gets 421 4.4.2 (timed out), no content
    was sent, and the connection is not kept for another message."""
    s = Scripted(b"250 2.1.0 ok\r\n")  # MAIL answered, then silence
    replies, reusable = run(s, ["a@y.test"], b"Subject: secret\r\n\r\nbody\r\n", timeout_s=0.5)
    assert [(421, "4.4.2")] == [(r.code, r.enhanced) for r in replies]
    assert "Timed out waiting for server response" in replies[0].text
    assert b"secret" not in s.received and not reusable
