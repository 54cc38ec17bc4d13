"""The DATA reader that works on big chunks (issues 15.2, 15.4) gives exactly what the line-at-a-time reader
gave: the same replies, the same stored octets, the same octets left for the next command.

The line-at-a-time reader the edge had before is kept here (:func:`reference_read`, the old
``MtaqSMTP._read_lines`` with ``self`` taken out) as the reference. Generated texts (dots at line starts,
lines of 997..1003 octets, bare CR and LF, NULs, lines longer than the reader's limit, sizes around the
size limit and the body buffer's memory) are given to both:

* through a real :class:`asyncio.StreamReader` (aiosmtpd's limit), fed in pieces cut at chosen offsets
  (every offset of the end mark, after each CR), the reader task running between two pieces;
* through real sockets to two real edges (:class:`MtaqSMTP` and a subclass with the reference reader), the
  text in several TCP writes, each sent once the server has received the previous one, with a command
  pipelined after the final dot;
* and a few through the real queue and log (:func:`edgekit.run_edge`), read back from the log.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from edgekit import RawClient, run_edge

from mtaq.edge.data import END_MARK, TEXT_LINE_MAX, DataScanner, read_data_text, refusal
from mtaq.edge.policy import EdgePolicy
from mtaq.edge.smtp import MtaqSMTP
from mtaq.storage.spill import BodyBuffer

READER_LIMIT = MtaqSMTP.line_length_limit  # aiosmtpd's StreamReader limit (1001)
HOST = "mx.test"
_NEWLINES_REF = re.compile(rb"\r\n|\r|\n")


# ------------------------------------------------------------------------------------------ the reference
async def reference_read(
    reader: asyncio.StreamReader, limit: int, normalize: bool, strip_nul: bool, kept: list[bytes],
    buf: BodyBuffer | None, hostname: str = HOST, alive: Callable[[], bool] = lambda: True,
) -> tuple[bytes | BodyBuffer, str | None, bool]:
    """The old ``MtaqSMTP._read_lines``, line for line (``self.transport is not None`` is ``alive()``)."""
    nul = False
    size = 0
    bare: str | None = None
    too_long = too_big = False
    partial = False  # inside a line longer than the reader's limit (its pieces come one by one)
    ended_ok = False
    while alive():
        try:
            line: bytes = await reader.readuntil(b"\r\n")
            piece, ended = line[:-2], True
        except asyncio.LimitOverrunError as exc:
            line = await reader.read(exc.consumed)
            piece, ended = line, False
        if ended and not partial and line == b".\r\n":
            ended_ok = True
            break
        if bare is None and (b"\n" in piece or b"\r" in piece):
            cr, lf = piece.find(b"\r"), piece.find(b"\n")
            bare = "<CR>" if lf < 0 or 0 <= cr < lf else "<LF>"
        if not partial and line.startswith(b"."):
            line = line[1:]  # dot transparency
        if b"\x00" in line:
            nul = True
            if strip_nul:
                line = line.replace(b"\x00", b"")
        if not ended or partial or len(line) > TEXT_LINE_MAX:
            too_long = True
        partial = not ended
        size += len(line)
        if limit and size > limit:
            too_big = True
        if too_long or too_big or (bare is not None and not normalize) or (nul and not strip_nul):
            if buf is not None:
                buf.discard()  # refused: keep nothing
            kept.clear()
            continue
        out = _NEWLINES_REF.sub(b"\r\n", line) if normalize and bare is not None else line
        if buf is not None:
            buf.write(out)
        else:
            kept.append(out)
    if not ended_ok:
        raise asyncio.CancelledError
    if bare is not None and not normalize:
        return b"", f"550 5.5.2 {hostname} Error: bare {bare} received", True
    if too_big:
        return b"", "552 5.3.4 Error: message size exceeds fixed maximum message size", False
    if too_long:
        return b"", f"500 5.5.2 Error: line too long (RFC 5321 section 4.5.3.1.6: {TEXT_LINE_MAX} octets)", False
    if nul and not strip_nul:
        return b"", "550 5.6.0 Error: message contains NUL characters", False
    if buf is not None:
        if buf.spilled:
            return buf, None, False
        return buf.getvalue(), None, False
    return b"".join(kept), None, False


async def chunked_read(
    reader: asyncio.StreamReader, limit: int, normalize: bool, strip_nul: bool, kept: list[bytes],
    buf: BodyBuffer | None, hostname: str = HOST,
) -> tuple[bytes | BodyBuffer, str | None, bool]:
    """The new reader, as ``MtaqSMTP._read_data`` uses it."""
    scanner = DataScanner(buf if buf is not None else kept, size_limit=limit, normalize=normalize,
                          strip_nul=strip_nul, line_limit=reader._limit)  # type: ignore[attr-defined]
    await read_data_text(reader, scanner, lambda: True)
    assert scanner.pending == 0
    refused = refusal(scanner, hostname)
    if refused is not None:
        return b"", refused[0], refused[1]
    if buf is not None:
        return (buf, None, False) if buf.spilled else (buf.getvalue(), None, False)
    return b"".join(kept), None, False


# ------------------------------------------------------------------------------------------ generated text
def _line(rng: random.Random) -> bytes:
    kind = rng.random()
    word = bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz ,;:-=.ABC0123456789") for _ in range(rng.randrange(0, 80)))
    if kind < 0.45:
        return word
    if kind < 0.6:
        return rng.choice([b".", b"..", b"..."]) + word + (b"x" if not word else b"")  # never "." alone
    if kind < 0.7:  # around the text line limit, with and without a transparency dot
        n = rng.choice([997, 998, 999, 1000, 1001, 1002, 1003])
        return (b"." if rng.random() < 0.5 else b"") + b"L" * n
    if kind < 0.8:  # a bare CR or LF somewhere (never a CRLF)
        c = rng.choice([b"\r", b"\n", b"\n.", b"\r.", b".\r", b".\n", b"\n\n", b"\r\r"])
        at = rng.randrange(0, len(word) + 1)
        return word[:at] + c + word[at:]
    if kind < 0.9:  # NULs, also before a dot and between CR and LF
        c = rng.choice([b"\x00", b"\x00.", b"\r\x00\n", b"\x00" * 5])
        at = rng.randrange(0, len(word) + 1)
        return (b"." if rng.random() < 0.3 else b"") + word[:at] + c + word[at:]
    if kind < 0.95:  # longer than the reader's limit
        n = rng.choice([READER_LIMIT - 1, READER_LIMIT, READER_LIMIT + 1, READER_LIMIT + 2, 5000, 70_000])
        fill = rng.choice([b"H", b"\x00", b"H\r", b"H\x00"])
        return (b"." if rng.random() < 0.5 else b"") + (fill * n)[:n]
    return b""


def generated_text(rng: random.Random, size_hint: int) -> bytes:
    """A message text without its final ``.CRLF``: empty, or lines each ending with CRLF; never holding the
    end mark before its end."""
    while True:
        if rng.random() < 0.05:
            return b""
        lines = []
        total = 0
        while total < size_hint:
            line = _line(rng)
            lines.append(line + b"\r\n")
            total += len(line) + 2
        text = b"".join(lines)
        if (b"\r\n" + text + b".\r\n").find(END_MARK) == len(text):  # the first end mark is the last
            return text


def _cuts(rng: random.Random, stream: bytes, text_len: int) -> Iterator[list[int]]:
    """Offsets at which to cut ``stream`` into pieces: none, random, around the end mark, after each CR."""
    yield []
    yield sorted(rng.sample(range(1, len(stream)), min(3, len(stream) - 1)))
    for at in range(max(1, text_len - 3), min(len(stream), text_len + 5)):
        yield [at]
    crs = [i + 1 for i, c in enumerate(stream[:text_len]) if c == 13][:20]
    if crs:
        yield crs


POLICIES = [(False, False), (True, False), (False, True), (True, True)]  # (normalize, strip_nul)


async def _run(read: Any, pieces: list[bytes], size_limit: int, normalize: bool, strip_nul: bool,
               memory: int | None, tmp: str) -> tuple[Any, ...]:
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    kept: list[bytes] = []
    buf = BodyBuffer(tmp, memory_bytes=memory, chunk_bytes=1024) if memory is not None else None
    task = asyncio.ensure_future(read(reader, size_limit, normalize, strip_nul, kept, buf))
    for piece in pieces:
        reader.feed_data(piece)
        for _ in range(3):  # let the reader take what it can (no I/O: a few loop turns)
            await asyncio.sleep(0)
    reader.feed_eof()
    try:
        content, reply, hang_up = await task
    except (asyncio.CancelledError, asyncio.IncompleteReadError) as exc:
        return ("ended", type(exc).__name__, bytes(reader._buffer))  # type: ignore[attr-defined]
    spilled = isinstance(content, BodyBuffer)
    body = b"".join(content.pieces()) if isinstance(content, BodyBuffer) else content
    if buf is not None:
        buf.close()
    left = await reader.read()
    return body, reply, hang_up, spilled, left


def _compare(stream: bytes, cuts: list[int], size_limit: int, normalize: bool, strip_nul: bool,
             memory: int | None, tmp: str) -> None:
    bounds = [0, *cuts, len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]

    async def both() -> tuple[Any, Any]:
        old = await _run(reference_read, pieces, size_limit, normalize, strip_nul, memory, tmp)
        new = await _run(chunked_read, pieces, size_limit, normalize, strip_nul, memory, tmp)
        return old, new

    old, new = asyncio.run(both())
    assert new == old, (stream[:200], cuts, size_limit, normalize, strip_nul, memory)


@pytest.mark.parametrize("normalize,strip_nul", POLICIES)
def test_the_chunked_reader_matches_the_line_reader_on_generated_text(tmp_path, normalize, strip_nul):
    rng = random.Random(1502 + 2 * normalize + strip_nul)
    for i in range(60):
        size_limit = rng.choice([0, 0, 3000, 6000])
        text = generated_text(rng, rng.choice([0, 10, 300, 2500, 2999, 3000, 3001, 4096, 6000, 9000]))
        trailer = rng.choice([b"", b"QUIT\r\n", b"MAIL FROM:<a@b.test>\r\n", b".\r\n", b"\r\n.\r\n"])
        stream = text + b".\r\n" + trailer
        memory = rng.choice([None, 4096])
        for cuts in _cuts(rng, stream, len(text)):
            _compare(stream, cuts, size_limit, normalize, strip_nul, memory, str(tmp_path))
        if len(stream) < 400 and i % 4 == 0:  # an octet at a time
            _compare(stream, list(range(1, len(stream))), size_limit, normalize, strip_nul, memory, str(tmp_path))


@pytest.mark.parametrize("text", [
    b"", b"\r\n", b"\r\n\r\n", b"x\r\n", b"..\r\n", b"\r\n..\r\n\r\n", b".x\r\n.\r.\n\r\n",
    b"\n.\n\r\n", b"\r.\r\n\r\n", b"a\r\n\r\n\r\n", b"\x00\r\n", b"\x00.\r\n", b"\r\x00\n\r\n",
    b"." + b"D" * 998 + b"\r\n", b"." + b"D" * 999 + b"\r\n", b"D" * 998 + b"\r\n", b"D" * 999 + b"\r\n",
    b"D" * (READER_LIMIT + 1) + b"\r\n", b"\x00" * 3000 + b"\r\n", b"." + b"\r" * 3000 + b"\r\n",
    b"H" * 2000 + b"\r\nabc\r\n", b"." + b"H" * 2000 + b"\r\r\nab\r\n",  # a long line's CR at a cut
])
@pytest.mark.parametrize("normalize,strip_nul", POLICIES)
def test_edge_texts_at_every_cut(tmp_path, text, normalize, strip_nul):
    """Empty text (the final dot right after DATA), empty lines, dots, line limits, bare CR/LF, NULs: cut
    at every offset near the start and the end mark, with a command pipelined after the final dot."""
    stream = text + b".\r\nQUIT\r\n"
    offsets = sorted({*range(1, min(len(stream), 12)), *range(max(1, len(text) - 6), len(stream))})
    for at in offsets:
        _compare(stream, [at], 0, normalize, strip_nul, None, str(tmp_path))
    _compare(stream, [], 2000, normalize, strip_nul, None, str(tmp_path))


def test_the_end_of_the_stream_before_the_final_dot_queues_nothing(tmp_path):
    """The connection ends inside the text: both readers end with IncompleteReadError, nothing returned."""
    for stream in [b"", b"abc\r\n", b"abc\r\n.", b"abc\r\n.\r", b"x" * 5000]:
        _compare(stream, [], 0, False, False, None, str(tmp_path))


# ------------------------------------------------------------------------------------------ over sockets
class _Recorder:
    """An aiosmtpd handler keeping each message's content as it was handed on (bytes, or BodyBuffer's)."""

    def __init__(self) -> None:
        self.contents: list[tuple[bytes, bool]] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        content = envelope.original_content
        if isinstance(content, BodyBuffer):
            self.contents.append((b"".join(content.pieces()), True))
        else:
            self.contents.append((content, False))
        return "250 2.0.0 Ok: queued"


class _Counted(MtaqSMTP):
    """The edge, counting what each client connection delivered to it (for sending pieces one by one)."""

    received: dict[int, int]
    arrived: threading.Condition

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        with self.arrived:
            port = peer[1] if isinstance(peer, tuple) else 0
            self.received[port] = self.received.get(port, 0) + len(data)
            self.arrived.notify_all()


class _Reference(_Counted):
    """The edge with the line-at-a-time reader (what MtaqSMTP was before issue 15.2)."""

    async def _read_data(self) -> tuple[bytes | BodyBuffer, str | None, bool]:
        kept: list[bytes] = []
        buf = self._body_buffer() if self._body_buffer is not None else None
        try:
            result = await reference_read(self._reader, self.data_size_limit or 0,
                                          self.policy.bare_newline == "normalize", self.policy.forbid_nul == "strip",
                                          kept, buf, self.hostname, lambda: self.transport is not None)
        except BaseException:
            if buf is not None:
                buf.close()
            raise
        if buf is not None and result[0] is not buf:
            buf.close()
        return result


class _Servers:
    def __init__(self, tmp: str, policy: EdgePolicy, size_limit: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.arrived = threading.Condition()
        self.received: dict[int, int] = {}
        self.recorders = {"old": _Recorder(), "new": _Recorder()}
        self.ports: dict[str, int] = {}
        self.servers = []
        for name, cls in (("old", _Reference), ("new", _Counted)):
            kind = type(f"{cls.__name__}_{name}", (cls,), {"received": self.received, "arrived": self.arrived})
            recorder = self.recorders[name]

            def factory(kind: type = kind, recorder: _Recorder = recorder) -> Any:
                return kind(recorder, hostname=HOST, ident="ESMTP mtaq", data_size_limit=size_limit,
                            enable_SMTPUTF8=True, decode_data=False, timeout=30, policy=policy,
                            body_buffer=lambda: BodyBuffer(tmp, memory_bytes=4096, chunk_bytes=1024),
                            loop=self.loop)

            server = asyncio.run_coroutine_threadsafe(
                self.loop.create_server(factory, "127.0.0.1", 0), self.loop).result(10)
            self.servers.append(server)
            self.ports[name] = server.sockets[0].getsockname()[1]

    def session(self, name: str, pieces: list[bytes], text_len: int) -> list[str]:
        """Send one message in ``pieces`` (each once the server has all before it, up to the final dot: the
        server may hang up after it), then read the replies."""
        replies = []
        with RawClient(self.ports[name]) as c:
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            port = c.sock.getsockname()[1]
            replies.append(c.reply())
            for cmd in ("EHLO client.test", "MAIL FROM:<a@client.test>", "RCPT TO:<b@mx.test>", "DATA"):
                replies.append(c.command(cmd).split("\n")[-1])
            with self.arrived:
                base = self.received.get(port, 0)
            sent = 0
            for piece in pieces:
                c.send(piece)
                sent += len(piece)
                if sent > text_len + 3:
                    continue
                with self.arrived:
                    assert self.arrived.wait_for(lambda n=base + sent: self.received.get(port, 0) >= n, 10)
            for _ in range(2):  # to the text, then to the pipelined NOOP
                try:
                    replies.append(c.reply())
                except ConnectionResetError:  # hung up with the NOOP unread
                    replies.append("")
            replies.append(c.command("QUIT") if replies[-1] else "")
        return replies

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                server.close()
                await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.mark.parametrize("normalize,strip_nul", POLICIES)
def test_over_sockets_the_edge_gives_the_replies_and_octets_of_the_line_reader(tmp_path, normalize, strip_nul):
    policy = EdgePolicy(bare_newline="normalize" if normalize else "reject", forbid_nul="strip" if strip_nul else "reject")
    servers = _Servers(str(tmp_path), policy, size_limit=9000)
    rng = random.Random(154 + 2 * normalize + strip_nul)
    try:
        for _ in range(25):
            text = generated_text(rng, rng.choice([0, 50, 1500, 4000, 4096, 5000, 8999, 9000, 12000]))
            stream = text + b".\r\nNOOP\r\n"
            cuts = {rng.randrange(1, len(stream)) for _ in range(rng.randrange(0, 4))}
            cuts.add(len(text) + rng.randrange(-2, 4))  # around the end mark
            bounds = [0, *sorted(c for c in cuts if 0 < c < len(stream)), len(stream)]
            pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
            old = servers.session("old", pieces, len(text))
            new = servers.session("new", pieces, len(text))
            assert new == old, (text[:200], cuts)
            assert servers.recorders["new"].contents == servers.recorders["old"].contents
    finally:
        servers.close()


def _unstuffed(text: bytes) -> bytes:
    """RFC 5321 §4.5.2 done independently: each line's leading dot removed."""
    return b"".join(line[1:] if line.startswith(b".") else line for line in text.splitlines(keepends=True))


@pytest.mark.parametrize("text", [
    b"",
    b"Subject: x\r\n\r\n..dot\r\n.\x2e\r\nend\r\n",
    b"".join(b".%06d " % i + b"y" * 90 + b"\r\n" for i in range(3000)),  # ~300 KiB: spilled to a file
])
def test_the_queue_stores_the_unstuffed_text_and_the_next_command_is_answered(tmp_path, text):
    """Through the real queue and log: the body read back is the Received field plus the unstuffed text; a
    command pipelined after the final dot (in the same write) is answered, and the text split before the
    end mark's last octet changes nothing."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        assert c.reply().startswith("220")
        for cmd in ("EHLO client.test", "MAIL FROM:<a@client.test>", "RCPT TO:<b@mx.test>"):
            assert c.command(cmd).split("\n")[-1].startswith("250")
        assert c.command("DATA").startswith("354")
        stream = text + b".\r\nNOOP\r\n"
        c.send(stream[: len(text) + 2])
        c.send(stream[len(text) + 2:])
        assert c.reply().startswith("250 2.0.0 Ok: queued as")
        assert c.reply().startswith("250")  # the NOOP
        ((_env, body),) = edge.messages()
        assert body.startswith(b"Received: ") and body.endswith(_unstuffed(text))


def test_a_client_idle_in_the_middle_of_the_text_gets_421_and_nothing_is_queued(tmp_path):
    """smtp_server_timeout_s also while the text is read: 421 4.4.2, the connection closed, nothing queued."""
    with run_edge(tmp_path, timeout_s=1) as edge, edge.raw() as c:
        assert c.reply().startswith("220")
        for cmd in ("EHLO client.test", "MAIL FROM:<a@client.test>", "RCPT TO:<b@mx.test>"):
            assert c.command(cmd).split("\n")[-1].startswith("250")
        assert c.command("DATA").startswith("354")
        c.send(b"Subject: x\r\n\r\n" + b"y" * 3000 + b"\r\n.")  # no final CRLF: the text has not ended
        assert f"421 4.4.2 {HOST} Error: timeout exceeded" == c.reply()
        assert c.closed()
        assert [] == edge.messages()
