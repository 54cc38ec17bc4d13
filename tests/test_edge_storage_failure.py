"""The SMTP edge on a failing disk: no 250 without a durable message (GUIDE I6, RFC 5321 §6.1).

A real aiosmtpd server and real smtplib clients over loopback; the disk is the real file system with
failures injected (FaultyFileSystem), since a failing disk cannot be had here.
"""

from __future__ import annotations

import asyncio
import errno
import smtplib

from mtaq.core.state import RetryPolicy
from mtaq.edge.server import QueueHandler, start_server
from mtaq.queue.store import Queue
from mtaq.storage.log import Log
from mtaq.testing.faults import FaultyFileSystem

BODY = b"Subject: t\r\nMessage-ID: <x@y>\r\n\r\nbody\r\n"


def send(port: int) -> tuple[int, bytes]:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo()
        s.mail("a@example.org")
        s.rcpt("b@example.net")
        return s.data(BODY)


async def serve_and_send(tmp_path, arrange, clients: int):
    fs = FaultyFileSystem()
    log, _ = Log.open(fs, str(tmp_path / "log"), segment_bytes_max=1 << 20)
    fatal = []
    log.on_fatal.append(fatal.append)
    queue = Queue(log, policy=RetryPolicy())
    queued = []
    queue.on_durable = lambda env, pos: queued.append(env)
    server = await start_server(QueueHandler(queue), "127.0.0.1", 0, hostname="mx.test",
                                data_size_limit=1 << 20, timeout_s=30)
    port = server.sockets[0].getsockname()[1]
    arrange(fs)
    replies = await asyncio.gather(*(asyncio.to_thread(send, port) for _ in range(clients)))
    server.close()
    return replies, queued, fatal, log


def test_fsync_failure_answers_451_to_every_waiting_client_and_is_fatal(tmp_path):
    """Every client whose message waited on the failed fsync gets 451 4.3.0; none gets 250."""

    def arrange(fs):
        fs.fail_fsync = True

    replies, queued, fatal, log = asyncio.run(serve_and_send(tmp_path, arrange, clients=5))
    assert [451] * 5 == [code for code, _ in replies]
    assert all(text.startswith(b"4.3.0 ") for _, text in replies)
    assert [] == queued
    assert 1 == len(fatal) and log.failed is not None


def test_full_disk_answers_452_and_acceptance_resumes_when_space_is_back(tmp_path):
    """ENOSPC: 452 4.3.1 (RFC 3463 'mail system full'); after space returns the next message gets 250."""
    state = {}

    def arrange(fs):
        fs.fail_append = errno.ENOSPC
        state["fs"] = fs

    replies, _queued, fatal, log = asyncio.run(serve_and_send(tmp_path, arrange, clients=2))
    assert [452, 452] == [code for code, _ in replies]
    assert all(text.startswith(b"4.3.1 ") for _, text in replies)
    assert [] == fatal

    async def again():
        state["fs"].fail_append = None
        queue = Queue(log, policy=RetryPolicy())
        got = []
        queue.on_durable = lambda env, pos: got.append(env)
        server = await start_server(QueueHandler(queue), "127.0.0.1", 0, hostname="mx.test",
                                    data_size_limit=1 << 20, timeout_s=30)
        port = server.sockets[0].getsockname()[1]
        reply = await asyncio.to_thread(send, port)
        server.close()
        return reply, got

    (code, text), got = asyncio.run(again())
    assert 250 == code and text.startswith(b"2.0.0 Ok: queued as ")
    assert 1 == len(got)


def test_client_hanging_up_during_the_commit_still_gets_its_durable_message_scheduled(tmp_path):
    """The client sends its final dot and closes at once: aiosmtpd cancels the handler, but the message,
    once durable, is handed on (queued event; the runner for new mail reads only up to the durable end);
    and it is not handed on before its fsync completed."""
    import socket

    async def main():
        fs = FaultyFileSystem()
        log, _ = Log.open(fs, str(tmp_path / "log"), segment_bytes_max=1 << 20)
        queue = Queue(log, policy=RetryPolicy())
        durable = []
        seen_before_fsync = []
        queue.on_durable = lambda env, pos: durable.append(env)
        server = await start_server(QueueHandler(queue), "127.0.0.1", 0, hostname="mx.test",
                                    data_size_limit=1 << 20, timeout_s=30)
        port = server.sockets[0].getsockname()[1]
        fs.fsync_delay_s = 0.5

        def client():
            s = socket.create_connection(("127.0.0.1", port))
            f = s.makefile("rb")
            f.readline()
            s.sendall(b"HELO c\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
            for _ in range(4):
                f.readline()
            s.sendall(b"Subject: t\r\n\r\nbody\r\n.\r\n")
            s.shutdown(socket.SHUT_WR)
            s.close()

        await asyncio.to_thread(client)
        await asyncio.sleep(0.2)
        seen_before_fsync.append(list(durable))
        for _ in range(50):
            if durable:
                break
            await asyncio.sleep(0.05)
        server.close()
        return durable, seen_before_fsync, queue

    durable, before, _queue = asyncio.run(main())
    assert [[]] == before  # not handed on before its fsync completed
    assert 1 == len(durable)


def test_full_disk_when_creating_the_next_segment_answers_452_and_leaves_no_half_record(tmp_path):
    """The segment is full and the next one cannot be created (ENOSPC): 452 4.3.1, nothing half-written
    (the log verifies), and once space is back the next message gets 250 in the new segment."""
    import os

    from mtaq.storage.log import list_segments
    from mtaq.storage.logtools import verify

    async def main():
        fs = FaultyFileSystem()
        log_dir = str(tmp_path / "log")
        log, _ = Log.open(fs, log_dir, segment_bytes_max=65536)
        queue = Queue(log, policy=RetryPolicy())
        server = await start_server(QueueHandler(queue), "127.0.0.1", 0, hostname="mx.test",
                                    data_size_limit=1 << 20, timeout_s=30)
        port = server.sockets[0].getsockname()[1]
        big = BODY + (b"x" * 78 + b"\r\n") * 250

        def send_big() -> tuple[int, bytes]:
            with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
                s.ehlo()
                s.mail("a@example.org")
                s.rcpt("b@example.net")
                return s.data(big)

        first = log.current_segment
        codes = []
        fs.fail_create = errno.ENOSPC
        for _ in range(5):  # 3 messages fill a 64 KiB segment; the 4th needs a new one
            codes.append(await asyncio.to_thread(send_big))
        segs_full = list_segments(fs, log_dir)
        fs.fail_create = None
        after = await asyncio.to_thread(send_big)
        server.close()
        return first, codes, segs_full, after, log

    first, codes, segs_full, after, log = asyncio.run(main())
    assert [250, 250, 250, 452, 452] == [c for c, _ in codes]
    assert all(t.startswith(b"4.3.1 ") for c, t in codes if c == 452)
    assert first == segs_full[-1]  # no new segment, not even an empty one
    assert 250 == after[0]
    assert first + 1 == log.current_segment
    log.close()
    assert 0 == verify(str(tmp_path / "log"), out=open(os.devnull, "w"))
