"""Delivery from the log in pieces, pipelined (issues 15.2-15.4).

A large message is sent from its DATA record in pieces (never held whole), dot-stuffed across piece
boundaries, and its final ``.`` goes out only once the record's checksum has checked out; MAIL, RCPT... and
DATA go in one write when the next hop offers PIPELINING (RFC 2920). Everything runs over real loopback
sockets: a small raw SMTP server (to see the bytes and the timing of commands exactly as they arrive) and
aiosmtpd (a standard server, which removes the dot-stuffing itself), with a real log on a real disk.
"""

from __future__ import annotations

import asyncio
import os
import smtplib
import ssl
import threading
import time
from email.message import EmailMessage

import pytest
import uvloop
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP
from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings
from hypothesis import given, settings
from hypothesis import strategies as st
from test_outbound_tls import cert_pem  # noqa: F401  (a fixture)

from mtaq.core.frame import FRAME_HEADER_BYTES
from mtaq.core.records import EnvelopeRecord, encode_data_prefix
from mtaq.core.state import RetryPolicy
from mtaq.delivery.relay import DotStuffer, RelayConnection
from mtaq.queue.store import Queue, StoredBody
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log, scan_log, segment_path
from mtaq.testing.media import flip_bit
from mtaq.testing.procs import free_port, maildir_count, peak_rss_kib, read_events, start_daemon, start_sink


def aiosmtplib_wire(body: bytes) -> bytes:
    """What aiosmtplib's ``SMTP.data`` sends after 354 (the reference)."""
    return PERIOD_REGEX.sub(b"..", normalize_message_line_endings(body)) + b".\r\n"


_BITS = st.sampled_from([b"\r\n", b"\n", b"\r", b".", b"..", b"a", b"From: x", b"\r\n.\r\n", b" ", b"\x00"])


@settings(max_examples=500, deadline=None)
@given(body=st.lists(_BITS, max_size=40).map(b"".join), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_division_into_pieces_sends_what_aiosmtplib_sends(body: bytes, cuts: list[int]) -> None:
    """Dot-stuffing and CRLF repair across piece boundaries (a dot, a CR, a CRLF split at a boundary) give
    the same bytes as aiosmtplib over the whole message."""
    edges = sorted({min(c, len(body)) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *edges], [*edges, len(body)], strict=True)]
    d = DotStuffer()
    assert aiosmtplib_wire(body) == b"".join(d.feed(p) for p in pieces) + d.end()


# ------------------------------------------------------------------------------------------ a raw sink
class RawSink:
    """A minimal SMTP server on loopback that records the DATA bytes as they arrived (still dot-stuffed),
    and which commands had arrived when it answered MAIL. With ``pipelining`` it offers PIPELINING and
    answers MAIL only once DATA has arrived too (at most ``wait_s`` later): a client that waits for each
    reply shows up as a MAIL alone. Recipients containing ``refuse`` get ``550 5.1.1``; DATA without an
    accepted recipient gets ``554 5.5.1`` (RFC 2920 §3.1). ``on_rcpt`` runs at each RCPT."""

    def __init__(self, *, pipelining: bool, wait_s: float = 5.0, on_rcpt=None) -> None:
        self.pipelining = pipelining
        self.wait_s = wait_s
        self.on_rcpt = on_rcpt
        self.before_mail_reply: list[list[bytes]] = []
        self.messages: list[tuple[list[str], bytes]] = []  # completed (final dot seen): recipients, raw content
        self.partial: list[bytes] = []  # content of transactions cut off before the final dot
        self.connections = 0
        self.closed = 0  # connections that have ended (all they sent was read)
        self.ended = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        w.write(b"220 raw.sink ESMTP\r\n")
        rcpts: list[str] = []
        try:
            while line := await r.readline():
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    w.write(b"250-raw.sink\r\n" + (b"250-PIPELINING\r\n" if self.pipelining else b"") + b"250 8BITMIME\r\n")
                elif verb == b"MAIL":
                    rcpts = []
                    seen = [line.strip()]
                    if self.pipelining:
                        pending: list[bytes] = []
                        try:
                            async with asyncio.timeout(self.wait_s):
                                while not pending or not pending[-1].upper().startswith(b"DATA"):
                                    pending.append(await r.readline())
                        except TimeoutError:
                            pass
                        seen += [p.strip() for p in pending]
                        self.before_mail_reply.append(seen)
                        w.write(b"250 2.1.0 Ok\r\n")
                        for p in pending:  # answer what came with MAIL, in order
                            if not await self._after_mail(p, r, w, rcpts):
                                return
                        continue
                    self.before_mail_reply.append(seen)
                    w.write(b"250 2.1.0 Ok\r\n")
                elif not await self._after_mail(line, r, w, rcpts):
                    return
                await w.drain()
        finally:
            w.close()
            self.closed += 1
            self.ended.set()

    async def _after_mail(self, line: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter, rcpts: list[str]) -> bool:
        verb = line[:4].upper()
        if verb == b"RCPT":
            addr = line.split(b"<", 1)[1].split(b">", 1)[0].decode()
            if self.on_rcpt is not None:
                self.on_rcpt(addr)
            if "refuse" in addr:
                w.write(b"550 5.1.1 <%s>: Recipient address rejected\r\n" % addr.encode())
            else:
                rcpts.append(addr)
                w.write(b"250 2.1.5 Ok\r\n")
        elif verb == b"DATA":
            if not rcpts:
                w.write(b"554 5.5.1 Error: no valid recipients\r\n")
                return True
            w.write(b"354 End data with <CR><LF>.<CR><LF>\r\n")
            await w.drain()
            content = bytearray()
            while True:
                piece = await r.readline()
                if not piece:
                    self.partial.append(bytes(content))
                    return False
                content += piece
                if piece == b".\r\n" and (len(content) == 3 or content[-5:-3] == b"\r\n"):
                    break
            self.messages.append((list(rcpts), bytes(content)))
            rcpts.clear()
            w.write(b"250 2.0.0 Ok: queued\r\n")
        elif verb == b"RSET":
            rcpts.clear()
            w.write(b"250 2.0.0 Ok\r\n")
        elif verb == b"QUIT":
            w.write(b"221 2.0.0 Bye\r\n")
            return False
        else:
            w.write(b"502 5.5.2 Error: command not recognized\r\n")
        return True


def stored(tmp_path, bodies: list[bytes]) -> tuple[Log, Queue, list[EnvelopeRecord]]:
    """A real log with ``bodies`` queued in it (each fsync'd, as after a 250)."""
    log, _report = Log.open(OsFileSystem(), os.path.join(str(tmp_path), "log"), segment_bytes_max=64 << 20)
    q = Queue(log, policy=RetryPolicy(intervals_s=(60.0,)), clock=lambda: 1000.0, reporting_mta="mx.test")

    async def go() -> list[EnvelopeRecord]:
        return [await q.receive("s@x.test", ["r@y.test"], b) for b in bodies]

    return log, q, asyncio.run(go())


def unstuffed(raw: bytes) -> bytes:
    """The message a standard server keeps: the final ``.`` line off, each leading dot removed."""
    assert raw.endswith(b".\r\n")
    lines = raw[:-3].split(b"\r\n")
    return b"\r\n".join(x[1:] if x.startswith(b".") else x for x in lines)


def dotted(size: int, line: int = 61) -> bytes:
    """``size`` bytes of CRLF lines, every third one starting with a dot."""
    out, i = bytearray(b"Subject: dots\r\n\r\n"), 0
    while len(out) < size:
        out += (b"." if i % 3 == 0 else b"") + b"%d " % i + b"x" * (line - 10) + b"\r\n"
        i += 1
    return bytes(out[:size - 2]) + b"\r\n"


async def send(port: int, rcpts: list[str], body, conn: RelayConnection | None = None):
    c = conn or RelayConnection("127.0.0.1", port, helo_name="client.test", timeout_s=20, tls="none")
    try:
        return await c.send("s@x.test", rcpts, body)
    finally:
        if conn is None:
            await c.close()


def test_streamed_bodies_arrive_byte_for_byte_whatever_the_piece_size(tmp_path):
    """Bodies with dots at line starts, a CRLF or a dot at piece boundaries (pieces of 7, 61, 64 KiB
    bytes), no final CRLF, a lone dot line, and 5 MB, sent from the log: the sink receives exactly
    aiosmtplib's stuffed form of the stored bytes (so, unstuffed, the stored message + CRLF if missing)."""
    bodies = [
        b".starts with a dot\r\n..two\r\n.\r\nlast line without CRLF",
        dotted(200_000),
        b"Subject: x\r\n\r\n" + b"a" * 65_519 + b"\r\n.dot after the boundary\r\n",
        dotted(5_000_000, line=77),
    ]
    log, _q, envs = stored(tmp_path, bodies)

    async def main() -> None:
        sink = RawSink(pipelining=True)
        port = await sink.start()
        try:
            for piece_bytes in (7, 61, 65536):
                for body, env in zip(bodies, envs, strict=True):
                    if piece_bytes < 65536 and len(body) > 300_000:
                        continue
                    content = StoredBody(log, env, piece_bytes=piece_bytes)
                    assert [250] == [r.code for r in await send(port, ["r@y.test"], content)]
                    raw = sink.messages[-1][1]
                    assert aiosmtplib_wire(body) == raw
                    assert body + (b"" if body.endswith(b"\r\n") else b"\r\n") == unstuffed(raw)
        finally:
            await sink.close()

    asyncio.run(main())
    log.close()


def test_the_last_piece_goes_out_with_the_final_dot_in_one_write(tmp_path, monkeypatch):
    """What the client writes after 354: a body of one piece is one write with the final ``.`` CRLF (one
    send to the next hop, not two); a body of several pieces is one write per piece, the last with the
    final dot. The sink still receives aiosmtplib's stuffed form."""
    from mtaq.delivery import relay

    writes: list[bytes] = []
    real = relay._Conversation.write

    def spy(self, data: bytes) -> None:
        writes.append(bytes(data))
        real(self, data)

    monkeypatch.setattr(relay._Conversation, "write", spy)
    small, large = b"Subject: s\r\n\r\n.dot\r\nend\r\n", dotted(1000)
    log, _q, envs = stored(tmp_path, [small, large])

    async def main() -> None:
        sink = RawSink(pipelining=True)
        port = await sink.start()
        try:
            for body, env, piece_bytes in ((small, envs[0], 65536), (large, envs[1], 300)):
                writes.clear()
                assert [250] == [r.code for r in await send(port, ["r@y.test"], StoredBody(log, env, piece_bytes=piece_bytes))]
                content = [w for w in writes if not w.startswith((b"EHLO", b"MAIL", b"QUIT"))]
                assert aiosmtplib_wire(body) == b"".join(content) == sink.messages[-1][1]
                assert -(-len(body) // piece_bytes) == len(content)
                assert content[-1].endswith(b"\r\n.\r\n") and len(content[-1]) > 3
        finally:
            await sink.close()

    asyncio.run(main())
    log.close()


RUNNERS = {"asyncio": asyncio.run, "uvloop": uvloop.run}  # the daemon runs on uvloop


class _Keep:
    def __init__(self) -> None:
        self.got: list[tuple[list[str], bytes]] = []
        self.tls: list[bool] = []

    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        session.host_name = hostname
        return [*responses[:-1], "250-PIPELINING", responses[-1]]

    async def handle_DATA(self, server, session, envelope):
        self.got.append((list(envelope.rcpt_tos), envelope.original_content))
        self.tls.append(bool(session.ssl))
        return "250 2.0.0 Ok"


def test_aiosmtpd_with_pipelining_stores_the_streamed_message_unchanged(tmp_path):
    """A standard server (aiosmtpd, told to offer PIPELINING) keeps exactly the stored message (its final
    CRLF added when it had none) for a 3 MB body with dot lines, sent pipelined from the log."""
    bodies = [dotted(3_000_000), b"Subject: y\r\n\r\n.\r\n..\r\nno final CRLF"]
    log, q, envs = stored(tmp_path, bodies)
    handler = _Keep()
    ctl = Controller(handler, hostname="127.0.0.1", port=free_port(), data_size_limit=0)
    ctl.start()
    try:
        async def main() -> None:
            c = RelayConnection("127.0.0.1", ctl.port, helo_name="client.test",
                                timeout_s=20, tls="none")
            for env in envs:
                body = q.body_for_delivery(env)
                assert [250, 250] == [r.code for r in await c.send("s@x.test", ["a@y.test", "b@y.test"], body)]
            await c.close()

        asyncio.run(main())
    finally:
        ctl.stop()
    assert [(["a@y.test", "b@y.test"], b + (b"" if b.endswith(b"\r\n") else b"\r\n")) for b in bodies] == handler.got
    log.close()


@pytest.mark.parametrize("loop", sorted(RUNNERS))
def test_pipelined_streamed_mail_over_starttls_and_the_connection_is_reused(tmp_path, cert_pem, loop):  # noqa: F811
    """Over STARTTLS (the transport is TLS), pipelined, a 2 MB message from the log and then a small one on
    the same connection arrive unchanged at aiosmtpd, both encrypted."""
    bodies = [dotted(2_000_000), b"Subject: small\r\n\r\n.hi\r\n"]
    log, q, envs = stored(tmp_path, bodies)
    handler = _Keep()

    async def main() -> int:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert_pem)
        ev = asyncio.get_running_loop()
        conns = []

        def factory() -> SMTP:
            conns.append(1)
            return SMTP(handler, hostname="hop", tls_context=ctx, data_size_limit=0, loop=ev)

        srv = await ev.create_server(factory, "127.0.0.1", 0)
        c = RelayConnection("127.0.0.1", srv.sockets[0].getsockname()[1], helo_name="client.test", timeout_s=20,
                            tls="may")
        try:
            for env in envs:
                replies = await c.send("s@x.test", ["a@y.test"], q.body_for_delivery(env))
                assert [250] == [r.code for r in replies]
                assert c.tls_version.startswith("TLS")
            await c.close()
        finally:
            srv.close()
        return len(conns)

    assert 1 == RUNNERS[loop](main())
    assert [(["a@y.test"], b) for b in bodies] == handler.got
    assert [True, True] == handler.tls
    log.close()


def test_pipelining_sends_mail_rcpt_and_data_without_waiting_for_replies(tmp_path):
    """With PIPELINING offered, MAIL, both RCPTs and DATA have all arrived when the server answers MAIL
    (RFC 2920 §3.1); without it, the client waits for each reply (MAIL arrives alone)."""

    async def main() -> None:
        for pipelining, expected in ((True, [b"MAIL", b"RCPT", b"RCPT", b"DATA"]), (False, [b"MAIL"])):
            sink = RawSink(pipelining=pipelining)
            port = await sink.start()
            replies = await send(port, ["a@y.test", "b@y.test"], b"Subject: p\r\n\r\nhello\r\n")
            await sink.close()
            assert [250, 250] == [r.code for r in replies]
            assert [expected] == [[c[:4] for c in seen] for seen in sink.before_mail_reply]
            assert [(["a@y.test", "b@y.test"], b"Subject: p\r\n\r\nhello\r\n.\r\n")] == sink.messages

    asyncio.run(main())


@pytest.mark.parametrize("loop", sorted(RUNNERS))
def test_a_refused_recipient_in_a_pipelined_group_keeps_its_own_reply(tmp_path, loop):
    """In one pipelined group, the refused recipient gets its 550 5.1.1, the others the reply to the end
    of DATA; when every recipient is refused, DATA's 554 ends the transaction, no content is sent, and the
    same connection carries the next message."""

    async def main() -> None:
        sink = RawSink(pipelining=True)
        port = await sink.start()
        c = RelayConnection("127.0.0.1", port, helo_name="client.test", timeout_s=20, tls="none")
        replies = await c.send("s@x.test", ["a@y.test", "refuse-b@y.test", "c@y.test"], b"one\r\n")
        assert [(250, "2.0.0"), (550, "5.1.1"), (250, "2.0.0")] == [(r.code, r.enhanced) for r in replies]
        replies = await c.send("s@x.test", ["refuse-1@y.test", "refuse-2@y.test"], b"two\r\n")
        assert [(550, "5.1.1"), (550, "5.1.1")] == [(r.code, r.enhanced) for r in replies]
        replies = await c.send("s@x.test", ["d@y.test"], b"three\r\n")
        assert [250] == [r.code for r in replies]
        await c.close()
        await sink.close()
        assert [(["a@y.test", "c@y.test"], b"one\r\n.\r\n"), (["d@y.test"], b"three\r\n.\r\n")] == sink.messages
        assert 1 == sink.connections
        assert [[b"MAIL", b"RCPT", b"RCPT", b"RCPT", b"DATA"], [b"MAIL", b"RCPT", b"RCPT", b"DATA"],
                [b"MAIL", b"RCPT", b"DATA"]] == [[x[:4] for x in s] for s in sink.before_mail_reply]

    RUNNERS[loop](main())


def flip_byte(log: Log, env: EnvelopeRecord, at: int) -> None:
    """Flip one bit of the body byte ``at`` of ``env``'s DATA record in its segment file (media damage)."""
    path = segment_path(log.directory, env.data.segment)
    flip_bit(path, env.data.offset + FRAME_HEADER_BYTES + len(encode_data_prefix(env.queue_id, env.size)) + at, 5)


def test_a_body_damaged_after_it_was_checked_is_cut_off_before_the_final_dot(tmp_path):
    """The body checks out when the attempt starts, then a byte of it flips on disk while the transaction
    runs (at RCPT): the content is sent up to its end, the checksum fails, and the connection is dropped
    before the final ``.``. The server delivers nothing and the recipient is deferred (451 4.3.0); the
    next attempt finds the damage before sending anything."""
    body = dotted(1_000_000)
    log, q, [env] = stored(tmp_path, [body])
    content = q.body_for_delivery(env)  # checked in a streaming pass
    assert isinstance(content, StoredBody)

    async def main() -> None:
        sink = RawSink(pipelining=True, on_rcpt=lambda addr: flip_byte(log, env, 500_000))
        port = await sink.start()
        replies = await send(port, ["r@y.test"], content)
        await asyncio.wait_for(sink.ended.wait(), 20)  # the sink has read all it was sent
        await sink.close()
        assert [(451, "4.3.0")] == [(r.code, r.enhanced) for r in replies]
        assert "checksum mismatch" in replies[0].text
        assert [] == sink.messages
        assert 1 == len(sink.partial) and not sink.partial[0].endswith(b"\r\n.\r\n")

    asyncio.run(main())
    try:
        q.body_for_delivery(env)
        raise AssertionError("a damaged body was handed out for delivery")
    except Exception as exc:
        assert "checksum mismatch" in str(exc)
    log.close()


def test_a_flipped_byte_in_a_stored_body_is_never_delivered_by_the_daemon(tmp_path):
    """The daemon (a subprocess, on uvloop) queues a 1 MB message and relays it to a raw sink, which flips a
    byte of its body in the spool at the first RCPT (after the attempt checked it). That transaction is cut
    off before the final dot (451 4.3.0); the attempt's conclusion cannot copy the damaged DATA forward and
    bounces it (554 5.3.0, ``corrupt_message``), as recovery does. The sink never completes a transaction
    with that message."""
    spool = tmp_path / "spool"
    body = b"Message-ID: <flip@x.test>\r\n" + dotted(1_000_000)
    flipped: list[str] = []

    def flip(addr: str) -> None:
        if addr != "r@y.test" or flipped:
            return
        for seg in scan_log(OsFileSystem(), str(spool / "log")):
            for _pos, rec in seg.records:
                if isinstance(rec, EnvelopeRecord) and rec.sender == "s@x.test":
                    path = segment_path(str(spool / "log"), rec.data.segment)
                    with open(path, "r+b") as f:
                        off = rec.data.offset + FRAME_HEADER_BYTES + len(encode_data_prefix(rec.queue_id, rec.size))
                        f.seek(off + 500_000)
                        b = f.read(1)
                        f.seek(off + 500_000)
                        f.write(bytes([b[0] ^ 0x20]))
                    flipped.append(rec.queue_id)
                    return

    sink = RawSink(pipelining=True, on_rcpt=flip)
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(sink.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text("retry_intervals_s = [0.5]\n")
    daemon = start_daemon(str(spool), port, str(tmp_path / "daemon.log"), config=str(cfg))
    try:
        with smtplib.SMTP("127.0.0.1", daemon.port, timeout=30) as s:
            s.sendmail("s@x.test", ["r@y.test"], body)
        deadline = time.monotonic() + 30
        events: list[dict] = []
        while time.monotonic() < deadline:
            events = read_events(daemon.log_path)
            # Wait for the last event checked below: corrupt_message is logged before the bounce it leads to
            # (and the first bounce classification loads the shipped rules between the two).
            if any(e.get("event") == "corrupt_message" for e in events) and any(
                    e.get("event") == "bounced" and e.get("dsn") == "5.3.0" for e in events):
                break
            time.sleep(0.05)
    finally:
        daemon.kill9()
        # The sink records the cut-off transfer when it sees the connection end, which can come after the
        # daemon's event on a loaded machine: wait for that, not for the loop to stop first.
        deadline = time.monotonic() + 10
        while not sink.partial and time.monotonic() < deadline:
            time.sleep(0.05)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert 1 == len(flipped)
    by_name = [(e["event"], e.get("dsn")) for e in events if e.get("queue_id") == flipped[0]
               and e["event"] in ("deferred", "bounced", "delivered", "corrupt_message")]
    assert [("deferred", "4.3.0"), ("corrupt_message", None), ("bounced", "5.3.0")] == by_name
    assert not any(b"<flip@x.test>" in m for _r, m in sink.messages)  # the DSN (headers only) may be there
    assert 1 == len(sink.partial) and not sink.partial[0].endswith(b"\r\n.\r\n")


def test_peak_rss_while_delivering_six_10_mb_messages_stays_bounded(tmp_path):
    """Six 10 MB messages received and delivered (through a sink) by the daemon: its peak RSS stays far
    below what holding them would take (the figure is printed for the report)."""
    maildir = str(tmp_path / "maildir")
    sink = start_sink(maildir, str(tmp_path / "sink.log"))
    daemon = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "daemon.log"))
    try:
        base = peak_rss_kib(daemon.popen.pid) or 0
        payload = dotted(10_000_000, line=77).split(b"\r\n\r\n", 1)[1]
        with smtplib.SMTP("127.0.0.1", daemon.port, timeout=60) as s:
            for i in range(6):
                msg = EmailMessage()
                msg["Subject"] = f"big {i}"
                msg["Message-ID"] = f"<big{i}@x.test>"
                s.sendmail("s@x.test", ["r@y.test"], msg.as_bytes().replace(b"\n", b"\r\n") + payload)
        deadline = time.monotonic() + 120
        while maildir_count(maildir) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 6 == maildir_count(maildir)
        peak = peak_rss_kib(daemon.popen.pid) or 0
    finally:
        daemon.kill9()
        sink.kill9()
    print(f"daemon peak RSS {peak} KiB (at start {base} KiB) delivering 6 x 10 MB")
    assert peak - base < 40 * 1024
