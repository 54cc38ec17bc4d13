"""Content filters over the milter protocol (issue 34): mtaq's client (mtaq.edge.milter) against real filters.

The filters are milter *servers* built on ``purepythonmilter`` (PyPI, an asyncio implementation of the filter
side, independent of mtaq's codec), run in a thread of the test on a loopback port; the failure cases (a
filter that closes its connection in the middle of the body, one that never answers) are small servers over
raw sockets. mtaq is the real edge (tests/edgekit.py: start_server, QueueHandler, a real log) and real SMTP
clients. Each reply a filter may give is checked at its SMTP stage, and each modification in the message
that the log holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import smtplib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import purepythonmilter as ppm
import pytest
import structlog
from edgekit import run_edge
from purepythonmilter.api.models import connection_id_context
from purepythonmilter.protocol.payload import Payload
from purepythonmilter.protocol.responses import AbstractManipulation
from purepythonmilter.server.milterserver import MilterServer
from test_edge_tls_auth import PASSWORD, USER, cert, client_context, passwd_file, plain  # noqa: F401  (fixtures)

from mtaq.admin.metrics import Metrics
from mtaq.core.errors import ConfigError
from mtaq.edge import milter as m
from mtaq.edge.auth import PasswordFile
from mtaq.edge.policy import EdgePolicy, server_tls_context


@contextlib.contextmanager
def serving(app: ppm.PurePythonMilter, unix_path: str = "") -> Iterator[str]:
    """Serve ``app`` (a purepythonmilter filter) on 127.0.0.1 in a thread; yields its ``inet:`` address
    (its ``unix:`` address with ``unix_path``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> asyncio.Server:
        srv = MilterServer(app_factory=app._get_factory())  # its own start_server sets signal handlers
        if unix_path:
            return await asyncio.start_unix_server(srv.handle_connection, unix_path)
        return await asyncio.start_server(srv.handle_connection, "127.0.0.1", 0)

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"unix:{unix_path}" if unix_path else f"inet:127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        async def stop() -> None:
            server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5) if tasks else None

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def policy(*specs: str, **settings: Any) -> EdgePolicy:
    return EdgePolicy(milter=m.MilterSettings(smtpd_milters=specs, **settings))


MESSAGE = (b"From: a@example.org\r\nTo: b@example.net\r\nSubject: hello\r\nX-Secret: internal\r\n"
           b"\tfolded\r\nMessage-ID: <one@p>\r\n\r\nbody line 1\r\nbody line 2\r\n")


# ----------------------------------------------------------------------------------------- the codec alone
def test_the_decoder_reads_packets_byte_by_byte_and_keeps_what_follows():
    """Three outcomes (h11's readers): a packet, None for more, an error for a bad length; fed one byte at a
    time and with trailing bytes left over."""
    stream = m.packet(b"c") + m.packet(b"y", b"550 5.7.1 no\0") + m.packet(b"h", b"X-A\0v\0") + b"\0\0"
    d = m.Decoder()
    got = []
    for i in range(len(stream)):
        d.feed(stream[i:i + 1])
        while (p := d.next()) is not None:
            got.append(p)
    assert [(b"c", b""), (b"y", b"550 5.7.1 no\0"), (b"h", b"X-A\0v\0")] == got
    assert b"\0\0" == bytes(d.buf)
    bad = m.Decoder()
    bad.feed(b"\0\0\0\0c")
    with pytest.raises(m.MilterProtocolError):
        bad.next()


def test_header_edits_follow_sendmails_definitions():
    """smfi_addheader appends, smfi_insheader puts at an index (0 = top), smfi_chgheader changes the n-th
    occurrence, deletes it with an empty value and adds it when there is none; folded values get CRLF."""
    head = b"Subject: one\r\nX-A: 1\r\nX-A: 2\r\nX-Fold: a\r\n\tb\r\n"
    e = m.Edit
    out = m.edit_head(head, [
        e(m.SMFIR_ADDHEADER, name=b"X-Added", value=b"yes\n more"),
        e(m.SMFIR_INSHEADER, name=b"X-Top", value=b"first", index=0),
        e(m.SMFIR_CHGHEADER, name=b"x-a", value=b"two", index=2),
        e(m.SMFIR_CHGHEADER, name=b"Subject", value=b"", index=1),
        e(m.SMFIR_CHGHEADER, name=b"X-New", value=b"made", index=1),
    ])
    assert (b"X-Top: first\r\nX-A: 1\r\nX-A: two\r\nX-Fold: a\r\n\tb\r\nX-Added: yes\r\n more\r\nX-New: made\r\n"
            == out)
    assert None is m.edit_head(head, [e(m.SMFIR_ADDRCPT, address="<x@y>")])


def test_a_bad_milter_address_is_refused_naming_its_key(tmp_path):
    from mtaq.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('smtpd_milters = ["inet:127.0.0.1:11332", "tcp:host:1"]\n')
    with pytest.raises(ConfigError, match=r"smtpd_milters\[1\]: 'tcp:host:1': unknown socket type"):
        load_config(str(path), {})
    path.write_text('[listeners."127.0.0.1:2525"]\nsmtpd_milters = ["inet:host"]\n')
    with pytest.raises(ConfigError, match=r'listeners."127.0.0.1:2525".smtpd_milters\[0\]'):
        load_config(str(path), {})


# ------------------------------------------------------------------------------------------ real filters
def test_every_stage_reaches_the_filter_and_every_modification_is_in_the_queued_message(tmp_path):
    """A filter that sees connect, HELO, MAIL, RCPT, DATA, headers, body and end of message (with Postfix's
    macros: j, {client_addr}, {mail_addr}, {rcpt_addr}, i = the queue ID of the 250) and then adds, inserts,
    changes and deletes headers, replaces the body, adds and deletes recipients and changes the sender: the
    message in the log is the filtered one, and the 250 came only once it was. A recipient mtaq refused
    reaches the filter that asked for those too (SMFIP_RCPT_REJ, {rcpt_mailer} error), as in Postfix."""
    seen: dict[str, Any] = {"headers": [], "body": b""}

    async def on_connect(cmd: ppm.Connect) -> ppm.Continue:
        seen["connect"] = dict(cmd.macros)
        return ppm.Continue()

    async def on_helo(cmd: ppm.Helo) -> ppm.Continue:
        seen["helo"] = cmd.hostname
        return ppm.Continue()

    async def on_mail(cmd: ppm.MailFrom) -> ppm.Continue:
        seen["mail"] = (cmd.address, dict(cmd.macros))
        return ppm.Continue()

    async def on_rcpt(cmd: ppm.RcptTo) -> ppm.Continue:
        seen.setdefault("rcpt", []).append((cmd.address, dict(cmd.macros)))
        return ppm.Continue()

    async def on_header(cmd: ppm.Header) -> ppm.Continue:
        seen["headers"].append((cmd.name, cmd.text))
        return ppm.Continue()

    async def on_body(cmd: ppm.BodyChunk) -> ppm.Continue:
        seen["body"] += bytes(cmd.data_raw)
        return ppm.Continue()

    async def on_eom(cmd: ppm.EndOfMessage) -> ppm.Continue:
        seen["eom"] = dict(cmd.macros)
        return ppm.Continue(manipulations=[
            ppm.AppendHeader(headername="X-Filtered", headertext="by test"),
            ppm.InsertHeader(headername="X-Top", headertext="first", index=0),
            ppm.ChangeHeader(headername="Subject", headertext="[tagged] hello", nth_occurrence=1),
            ppm.ChangeHeader(headername="X-Secret", headertext="", nth_occurrence=1),
            ppm.ReplaceBodyChunk(chunk=b"new body\r\n"),
            ppm.AddRecipient(recipient="<added@example.net>"),
            ppm.RemoveRecipient(recipient="<gone@example.net>"),
            ppm.ChangeMailFrom(mail_from="<new-sender@example.org>"),
        ])

    app = ppm.PurePythonMilter(
        name="every-stage", hook_on_connect=on_connect, hook_on_helo=on_helo, hook_on_mail_from=on_mail,
        hook_on_rcpt_to=on_rcpt, hook_on_header=on_header, hook_on_body_chunk=on_body, hook_on_end_of_message=on_eom,
        on_rcpt_to_include_rejected=True, restrict_symbols=None, can_add_headers=True, can_change_headers=True, can_change_body=True,
        can_add_recipients=True, can_remove_recipients=True, can_change_mail_from=True)
    with serving(app) as spec, run_edge(tmp_path, policy(spec)) as edge, edge.client() as s:
        s.ehlo("client.test")
        s.mail("a@example.org")
        assert 250 == s.rcpt("b@example.net")[0]
        assert 250 == s.rcpt("gone@example.net")[0]
        assert 553 == s.rcpt("nodomain")[0]  # refused by mtaq: told to a filter that asked (SMFIP_RCPT_REJ)
        code, text = s.data(MESSAGE)
        assert 250 == code
        qid = text.decode().rsplit(" ", 1)[1]
        [(env, body)] = edge.messages()
    assert qid == env.queue_id
    assert "new-sender@example.org" == env.sender
    assert ["b@example.net", "added@example.net"] == [r.address for r in env.recipients]
    head, _, rest = body.partition(b"\r\n\r\n")
    assert b"new body\r\n" == rest
    fields = [line for line in head.split(b"\r\n") if not line.startswith((b"Received:", b" ", b"\t"))]
    assert [b"X-Top: first", b"From: a@example.org", b"To: b@example.net", b"Subject: [tagged] hello",
            b"Message-ID: <one@p>", b"X-Filtered: by test"] == fields
    assert "127.0.0.1" == seen["connect"]["{client_addr}"]
    assert "mx.test" == seen["connect"]["j"]
    assert "client.test" == seen["helo"]
    assert ("a@example.org", qid, "a@example.org") == (seen["mail"][0], seen["mail"][1]["i"],
                                                        seen["mail"][1]["{mail_addr}"])
    assert [("b@example.net", "smtp"), ("gone@example.net", "smtp"), ("nodomain", "error")] == [
        (a, mac["{rcpt_mailer}"]) for a, mac in seen["rcpt"]]
    assert ("X-Secret", "internal\n\tfolded") in seen["headers"]
    assert ("Subject", "hello") in seen["headers"]
    assert b"body line 1\r\nbody line 2\r\n" == seen["body"]
    assert qid == seen["eom"]["i"]


@attrs.define(auto_attribs=False, kw_only=True)
class QuarantineEdit(AbstractManipulation):
    """SMFIR_QUARANTINE as libmilter's smfi_quarantine sends it, before the final reply (purepythonmilter
    0.0.1's own Quarantine is a final reply that cannot be instantiated: its encode is abstract)."""

    response_char = b"q"
    reason: str = attrs.field()

    def encode(self) -> Payload:
        return Payload(b"q" + self.reason.encode() + b"\0")


def _verdict_milter() -> ppm.PurePythonMilter:
    """Decides by the sender or recipient local part: reject-mail / tempfail-rcpt / discard-rcpt, and by the
    Subject at end of message: reject, tempfail, discard, quarantine."""

    async def on_mail(cmd: ppm.MailFrom) -> ppm.VerdictOrContinue:
        if cmd.address.startswith("reject-mail@"):
            return ppm.RejectWithCode(primary_code=(5, 5, 0), enhanced_code=(5, 7, 1), text="sender not liked")
        return ppm.Continue()

    async def on_rcpt(cmd: ppm.RcptTo) -> ppm.VerdictOrContinue:
        if cmd.address.startswith("tempfail-rcpt@"):
            return ppm.TempFailWithCode(primary_code=(4, 5, 1), enhanced_code=(4, 7, 1), text="greylisted")
        if cmd.address.startswith("discard-rcpt@"):
            return ppm.DiscardMessage()
        return ppm.Continue()

    subject: dict[object, str] = {}  # by filter connection (the pick-up runs several at once)

    async def on_header(cmd: ppm.Header) -> ppm.Continue:
        if cmd.name.lower() == "subject":
            subject[connection_id_context.get()] = cmd.text
        return ppm.Continue()

    async def on_eom(cmd: ppm.EndOfMessage) -> ppm.AbstractResponse:
        s = subject.pop(connection_id_context.get(), "")
        if s == "reject":
            return ppm.RejectWithCode(primary_code=(5, 5, 4), enhanced_code=(5, 7, 1), text="spam detected")
        if s == "reject-plain":
            return ppm.Reject()
        if s == "tempfail":
            return ppm.TempFailWithCode(primary_code=(4, 5, 1), enhanced_code=(4, 7, 1), text="try later")
        if s == "discard":
            return ppm.DiscardMessage()
        if s == "quarantine":
            # SMFIR_QUARANTINE then a final reply (libmilter's smfi_quarantine; Postfix reads on after it)
            return ppm.Continue(manipulations=[QuarantineEdit(reason="suspicious")])
        return ppm.Continue()

    return ppm.PurePythonMilter(name="verdicts", hook_on_mail_from=on_mail, hook_on_rcpt_to=on_rcpt,
                                hook_on_header=on_header, hook_on_end_of_message=on_eom, can_quarantine=True)


def _send(s: smtplib.SMTP, sender: str, rcpts: list[str], subject: str) -> tuple[int, str]:
    """MAIL, RCPT(s), DATA; the first refusal or the DATA reply."""
    s.ehlo_or_helo_if_needed()
    code, text = s.mail(sender)
    if code != 250:
        s.rset()
        return code, text.decode()
    ok = 0
    for r in rcpts:
        code, text = s.rcpt(r)
        if code != 250:
            last = (code, text.decode())
        else:
            ok += 1
    if not ok:
        s.rset()
        return last
    code, text = s.data(f"From: a@example.org\r\nSubject: {subject}\r\n\r\nbody\r\n".encode())
    return code, text.decode()


def test_each_verdict_is_given_at_its_stage(tmp_path):
    """Reject at MAIL with the filter's code and text; tempfail one recipient at RCPT (the others go on);
    discard at RCPT and at end of message (250, nothing queued, milter_discard); reject and tempfail at end
    of message (the filter's text, or Postfix's ``550 5.7.1 Command rejected``); quarantine: queued held.
    Each refusal is an event with the filter's name and the queue ID."""
    with serving(_verdict_milter()) as spec, structlog.testing.capture_logs() as logs, \
            run_edge(tmp_path, policy(spec)) as edge, edge.client() as s:
        s.ehlo("client.test")
        assert (550, "5.7.1 sender not liked") == _send(s, "reject-mail@example.org", ["b@example.net"], "x")
        code, text = s.mail("a@example.org")
        assert (451, b"4.7.1 greylisted") == s.rcpt("tempfail-rcpt@example.net")
        assert 250 == s.rcpt("b@example.net")[0]
        code, text = s.data(b"Subject: plain\r\n\r\nbody\r\n")
        assert 250 == code
        kept = text.decode().rsplit(" ", 1)[1]
        code, text = _send(s, "a@example.org", ["discard-rcpt@example.net"], "x")
        assert 250 == code
        rcpt_discarded = text.rsplit(" ", 1)[1]
        assert (554, "5.7.1 spam detected") == _send(s, "a@example.org", ["b@example.net"], "reject")
        assert (550, "5.7.1 Command rejected") == _send(s, "a@example.org", ["b@example.net"], "reject-plain")
        assert (451, "4.7.1 try later") == _send(s, "a@example.org", ["b@example.net"], "tempfail")
        code, text = _send(s, "a@example.org", ["b@example.net"], "discard")
        assert 250 == code
        eom_discarded = text.rsplit(" ", 1)[1]
        with edge.client() as s2:  # a new milter connection: purepythonmilter 0.0.1 sends modifications for
            # the first message of a connection only
            s2.ehlo("client.test")
            code, text = _send(s2, "a@example.org", ["b@example.net"], "quarantine")
        assert 250 == code
        held = text.rsplit(" ", 1)[1]
        envs = [env for env, _ in edge.messages()]
    assert [(kept, False), (held, True)] == [(env.queue_id, env.held) for env in envs]
    assert ["b@example.net"] == [r.address for r in envs[0].recipients]
    events = [(e["event"], e.get("stage"), e.get("milter")) for e in logs if e["event"].startswith("milter_")]
    assert [("milter_reject", "mail", spec), ("milter_tempfail", "rcpt", spec), ("milter_discard", None, spec),
            ("milter_reject", "eom", spec), ("milter_reject", "eom", spec), ("milter_tempfail", "eom", spec),
            ("milter_discard", None, spec), ("milter_quarantine", None, spec)] == events
    assert [15] * 8 == [len(e.get("queue_id", "")) for e in logs if e["event"].startswith("milter_")]
    ids = [e["queue_id"] for e in logs if e["event"] in ("milter_discard", "milter_quarantine")]
    assert [rcpt_discarded, eom_discarded, held] == ids
    metrics = Metrics({})
    metrics.milter_stats = lambda: m.STATS
    lines = metrics.exposition().decode().splitlines()
    assert [3.0, 2.0, 2.0] == [float(next(x for x in lines if x.startswith(
        f'mtaq_milter_replies_total{{milter="{spec}",verdict="{v}"}}')).split()[-1]) for v in ("reject", "tempfail", "discard")]


def test_a_spilled_body_goes_to_the_filter_in_chunks_and_its_header_change_is_kept(tmp_path):
    """A 600 KiB body (beyond the edge's 256 KiB in memory: spilled to its temporary file) reaches the filter
    in SMFIC_BODY chunks of at most 65,535 octets, whole and in order; the filter's header changes are
    applied to the spilled message, whose body is queued unchanged."""
    sizes: list[int] = []
    got = bytearray()

    async def on_body(cmd: ppm.BodyChunk) -> ppm.Continue:
        sizes.append(len(cmd.data_raw))
        got.extend(cmd.data_raw)
        return ppm.Continue()

    async def on_eom(cmd: ppm.EndOfMessage) -> ppm.Continue:
        return ppm.Continue(manipulations=[ppm.ChangeHeader(headername="Subject", headertext="scanned",
                                                            nth_occurrence=1)])

    app = ppm.PurePythonMilter(name="big", hook_on_body_chunk=on_body, hook_on_end_of_message=on_eom,
                               can_change_headers=True)
    big = b"".join(b"line %06d of a large body, spilled to disk\r\n" % i for i in range(14000))
    with serving(app) as spec, run_edge(tmp_path, policy(spec)) as edge, edge.client() as s:
        assert {} == s.sendmail("a@example.org", ["b@example.net"],
                                b"From: a@example.org\r\nSubject: big\r\n\r\n" + big)
        [(_, body)] = edge.messages()
    assert big == bytes(got)
    assert len(big) > 512 * 1024
    assert max(sizes) <= 65535 and len(sizes) >= len(big) // 65535
    head, _, rest = body.partition(b"\r\n\r\n")
    assert head.endswith(b"From: a@example.org\r\nSubject: scanned")
    assert big == rest


def test_a_filter_that_sleeps_past_its_timeout_cannot_hold_the_session(tmp_path):
    """A filter that sleeps 5 s at end of message, with milter_content_timeout_s 0.5: the client gets
    ``451 4.3.5`` (milter_default_action tempfail) well before 5 s, nothing is queued, milter_error names
    the filter; with milter_default_action accept the message is queued as received. /metrics counts the
    filter's errors and replies."""

    async def on_eom(cmd: ppm.EndOfMessage) -> ppm.Continue:
        await asyncio.sleep(5)
        return ppm.Continue()

    app = ppm.PurePythonMilter(name="slow", hook_on_end_of_message=on_eom)
    with serving(app) as spec, structlog.testing.capture_logs() as logs:
        for action, expected in (("tempfail", 451), ("accept", 250)):
            with run_edge(tmp_path, policy(spec, content_timeout_s=0.5, default_action=action)) as edge, \
                    edge.client() as s:
                started = time.monotonic()
                code, _ = _send(s, "a@example.org", ["b@example.net"], "slow")
                took = time.monotonic() - started
                assert (expected, True) == (code, took < 3), (action, took)
                assert (0 if action == "tempfail" else 1) == len(edge.messages())
    errors = [(e["milter"], e["stage"], e["action"]) for e in logs if e["event"] == "milter_error"]
    assert [(spec, "eom", "tempfail"), (spec, "eom", "accept")] == errors
    assert all("timeout" in e["error"] for e in logs if e["event"] == "milter_error")
    metrics = Metrics({})
    metrics.milter_stats = lambda: m.STATS
    text = metrics.exposition().decode()
    assert f'mtaq_milter_errors_total{{milter="{spec}"}} 2.0' in text.splitlines()
    assert f'mtaq_milter_wait_seconds_count{{milter="{spec}"}} 2.0' in text.splitlines()


@contextlib.contextmanager
def raw_filter(on_command: Any, optneg: tuple[int, int, int] = (6, 0, 0),
               reads: list[list[bytes]] | None = None, rcvbuf: int = 0) -> Iterator[str]:
    """A filter over raw sockets (mtaq's codec): answers the negotiation with ``optneg`` (version, actions,
    protocol), then calls ``on_command(conn, cmd)`` for every command; it returns the reply bytes to send
    (b"" for none), or None to close the connection there. ``reads``: the commands that each recv() of a
    connection completed, appended in order. ``rcvbuf``: the connections' SO_RCVBUF (0: the system's)."""
    listener = socket.socket()
    if rcvbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # inherited by what it accepts
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    def one(conn: socket.socket) -> None:
        d = m.Decoder()
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                d.feed(data)
                got: list[bytes] = []
                if reads is not None:
                    reads.append(got)
                while (p := d.next()) is not None:
                    cmd, _ = p
                    got.append(cmd)
                    if cmd == m.SMFIC_OPTNEG:
                        conn.sendall(m.packet(b"O", struct.pack("!III", *optneg)))
                        continue
                    if cmd in (m.SMFIC_MACRO, m.SMFIC_ABORT, m.SMFIC_QUIT):
                        continue
                    reply = on_command(conn, cmd)
                    if reply is None:
                        return
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"inet:127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_filter_that_drops_the_connection_mid_body_gets_the_default_action(tmp_path):
    """A filter that closes its connection at the first body chunk: milter_default_action, logged with the
    filter's name (milter_error at stage body): tempfail ``451 4.3.5`` by default, ``550 5.5.0`` with
    reject; nothing queued either way; later MAILs in that session get the same reply without the filter."""

    def on_command(conn: socket.socket, cmd: bytes) -> bytes | None:
        return None if cmd == m.SMFIC_BODY else m.packet(m.SMFIR_CONTINUE)

    with raw_filter(on_command) as spec, structlog.testing.capture_logs() as logs:
        for action, expected in (("tempfail", (451, "4.3.5 Server configuration problem - try again later")),
                                 ("reject", (550, "5.5.0 Service unavailable"))):
            with run_edge(tmp_path, policy(spec, default_action=action)) as edge, edge.client() as s:
                assert expected == _send(s, "a@example.org", ["b@example.net"], "x")
                assert expected == _send(s, "a@example.org", ["b@example.net"], "again")
                assert [] == edge.messages()
    errors = [(e["milter"], e["stage"], e["action"], e["error"]) for e in logs if e["event"] == "milter_error"]
    assert [(spec, "body", "tempfail", "connection closed by the filter"),
            (spec, "body", "reject", "connection closed by the filter")] == errors


def test_a_filter_that_cannot_be_reached_gets_the_default_action(tmp_path):
    """Nothing listens at the filter's address: tempfail at MAIL (``451 4.3.5``); with accept the mail flows
    as if the filter were not configured."""
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    spec = f"inet:127.0.0.1:{spare.getsockname()[1]}"  # bound, not listening: connection refused
    with spare:
        with run_edge(tmp_path, policy(spec)) as edge, edge.client() as s:
            assert (451, "4.3.5 Server configuration problem - try again later") == _send(
                s, "a@example.org", ["b@example.net"], "x")
        with run_edge(tmp_path, policy(spec, default_action="accept")) as edge, edge.client() as s:
            assert 250 == _send(s, "a@example.org", ["b@example.net"], "x")[0]
            assert 1 == len(edge.messages())


def test_a_filter_that_never_answers_the_negotiation_delays_the_greeting_by_its_timeout_only(tmp_path):
    """A filter that accepts the connection and never answers: the greeting comes after
    milter_connect_timeout_s, and MAIL gets the default action."""
    listener = socket.create_server(("127.0.0.1", 0))
    spec = f"inet:127.0.0.1:{listener.getsockname()[1]}"
    with listener, run_edge(tmp_path, policy(spec, connect_timeout_s=0.5, command_timeout_s=0.5)) as edge:
        started = time.monotonic()
        with edge.client() as s:
            took = time.monotonic() - started
            assert (451, "4.3.5 Server configuration problem - try again later") == _send(
                s, "a@example.org", ["b@example.net"], "x")
        assert 0.4 < took < 3


def test_the_daemon_filters_smtp_and_picked_up_mail_and_lists_a_quarantined_message_held(tmp_path):
    """A real daemon with smtpd_milters and non_smtpd_milters naming one filter that adds ``X-Scanned`` and
    quarantines a Subject ``hold``: a message over SMTP and one through ``mtaq sendmail`` (the maildrop's
    pick-up) reach the sink with the header; the held one is ``held`` in ``mtaq queue list`` (event
    milter_quarantine with its queue ID) and is not delivered."""
    import json
    import subprocess
    import sys

    from test_sendmail import Host, sendmail

    hold = {"next": False}  # the messages come one after the other

    async def on_header(cmd: ppm.Header) -> ppm.Continue:
        if cmd.name.lower() == "subject":
            hold["next"] = cmd.text == "hold"
        return ppm.Continue()

    async def on_eom(cmd: ppm.EndOfMessage) -> ppm.Continue:
        edits: list[Any] = [ppm.AppendHeader(headername="X-Scanned", headertext="yes")]
        if hold["next"]:
            edits.append(QuarantineEdit(reason="needs a look"))
        return ppm.Continue(manipulations=edits)

    app = ppm.PurePythonMilter(name="scan", hook_on_header=on_header, hook_on_end_of_message=on_eom,
                               can_add_headers=True, can_quarantine=True)
    with serving(app) as spec:
        h = Host(tmp_path, extra=f'smtpd_milters = ["{spec}"]\nnon_smtpd_milters = ["{spec}"]\n')
        try:
            h.start()
            for subject, mid in (("clean", "<smtp@p>"), ("hold", "<held@p>")):
                with smtplib.SMTP("127.0.0.1", h.port, timeout=30) as s:
                    assert {} == s.sendmail("a@example.org", ["b@example.net"], (
                        f"From: a@example.org\r\nSubject: {subject}\r\nMessage-ID: {mid}\r\n\r\nhi\r\n").encode())
            r = sendmail(h.cfg, "-f", "root@host.test", "rcpt@example.net",
                         stdin=b"Subject: local\nMessage-ID: <local@p>\n\nfrom cron\n")
            assert (0, b"") == (r.returncode, r.stderr)
            got = h.wait_messages(2)
            assert {"<smtp@p>": "yes", "<local@p>": "yes"} == {m["Message-ID"]: m["X-Scanned"] for m in got}
            [quarantined] = wait_for_events(h, "milter_quarantine")
            assert (spec, "needs a look") == (quarantined["milter"], quarantined["reason"])
            out = subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", "list", "--json", "--spool",
                                  str(h.spool)], capture_output=True, text=True, timeout=60)
            assert 0 == out.returncode, out.stderr
            assert [(quarantined["queue_id"], "held")] == [(q["queue_id"], q["state"])
                                                          for q in map(json.loads, out.stdout.splitlines())]
            assert 2 == len(h.messages())
        finally:
            h.close()


def wait_for_events(h: Any, name: str) -> list[dict[str, Any]]:
    from mtaq.testing.procs import wait_for

    return wait_for(lambda: h.events(name), 20, f"the {name} event")


def test_a_refusal_at_connect_or_helo_answers_every_mail_of_the_session(tmp_path):
    """Postfix's way (smtpd_delay_reject): a filter's reject at HELO, or tempfail at connect, is the reply to
    every MAIL of that session (EHLO itself is answered, so STARTTLS and QUIT still work); another session
    whose HELO the filter likes is served."""

    async def on_connect(cmd: ppm.Connect) -> ppm.VerdictOrContinue:
        if cmd.macros.get("{client_port}") == blocked.get("port"):
            return ppm.TempFailWithCode(primary_code=(4, 5, 0), enhanced_code=(4, 7, 0), text="come back later")
        return ppm.Continue()

    async def on_helo(cmd: ppm.Helo) -> ppm.VerdictOrContinue:
        if cmd.hostname == "bad.test":
            return ppm.RejectWithCode(primary_code=(5, 5, 0), enhanced_code=(5, 7, 1), text="bad HELO")
        return ppm.Continue()

    blocked: dict[str, str] = {}
    app = ppm.PurePythonMilter(name="helo", hook_on_connect=on_connect, hook_on_helo=on_helo, restrict_symbols=None)
    with serving(app) as spec, run_edge(tmp_path, policy(spec)) as edge:
        with edge.client() as s:
            assert 250 == s.ehlo("bad.test")[0]
            assert (550, "5.7.1 bad HELO") == _send(s, "a@example.org", ["b@example.net"], "x")
            assert (550, "5.7.1 bad HELO") == _send(s, "a@example.org", ["b@example.net"], "y")
        with edge.client() as s:
            assert 250 == s.ehlo("good.test")[0]
            assert 250 == _send(s, "a@example.org", ["b@example.net"], "x")[0]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        blocked["port"] = str(sock.getsockname()[1])
        sock.close()
        with smtplib.SMTP(timeout=10, source_address=("127.0.0.1", int(blocked["port"]))) as s:
            s.connect("127.0.0.1", edge.port)
            assert (450, "4.7.0 come back later") == _send(s, "a@example.org", ["b@example.net"], "x")


def test_a_listener_with_its_own_smtpd_milters_and_a_filter_on_a_unix_socket(tmp_path):
    """The policy's smtpd_milters name a filter nobody runs (tempfail for every MAIL); a listener with its
    own list (a filter on a unix socket) uses that one, and a listener whose own list is empty uses none."""

    async def on_eom(cmd: ppm.EndOfMessage) -> ppm.Continue:
        return ppm.Continue(manipulations=[ppm.AppendHeader(headername="X-Unix", headertext="seen")])

    app = ppm.PurePythonMilter(name="unix", hook_on_end_of_message=on_eom, can_add_headers=True)
    down = socket.socket()
    down.bind(("127.0.0.1", 0))
    with down, serving(app, str(tmp_path / "milter.sock")) as spec:
        pol = policy(f"inet:127.0.0.1:{down.getsockname()[1]}")
        for own, tagged in (((spec,), True), ((), False)):
            with run_edge(tmp_path, pol, milters=own) as edge, edge.client() as s:
                assert 250 == _send(s, "a@example.org", ["b@example.net"], "x")[0]
                [(_, body)] = edge.messages()
                assert (tagged, b"body\r\n") == (b"\r\nSubject: x\r\nX-Unix: seen\r\n\r\n" in body,
                                                  body.partition(b"\r\n\r\n")[2])


def test_picked_up_mail_refused_by_a_filter_stays_or_is_set_aside_and_a_discarded_one_goes(tmp_path):
    """non_smtpd_milters on the maildrop's pick-up (a filter deciding by Subject): tempfail leaves the file
    in the maildrop (pickup_deferred, tried again); reject sets it aside in SPOOL/corrupt/maildrop
    (maildrop_corrupt naming the filter's reply); discard removes it (milter_discard); nothing of the three
    reaches the sink, while a clean one does."""
    from test_sendmail import Host, sendmail

    with serving(_verdict_milter()) as spec:
        h = Host(tmp_path, extra=f'non_smtpd_milters = ["{spec}"]\n')
        try:
            h.start()
            for subject in ("tempfail", "reject", "discard", "clean"):
                r = sendmail(h.cfg, "-f", "root@host.test", "rcpt@example.net",
                             stdin=f"Subject: {subject}\nMessage-ID: <{subject}@p>\n\nfrom cron\n".encode())
                assert (0, b"") == (r.returncode, r.stderr)
            [clean] = h.wait_messages(1)
            assert "<clean@p>" == clean["Message-ID"]
            [corrupt] = wait_for_events(h, "maildrop_corrupt")
            assert "refused by a milter: 554 5.7.1 spam detected" == corrupt["reason"]
            [discarded] = wait_for_events(h, "milter_discard")
            assert spec == discarded["milter"]
            deferred = wait_for_events(h, "pickup_deferred")
            assert {"451 4.7.1 try later"} == {e["error"] for e in deferred}
            assert [deferred[0]["maildrop"]] == h.maildrop()
            assert [corrupt["maildrop"]] == os.listdir(h.spool / "corrupt" / "maildrop")
            assert 1 == len(h.messages())
        finally:
            h.close()


def test_tls_and_auth_macros_reach_the_filter_at_helo_and_mail(tmp_path, cert, passwd_file):  # noqa: F811
    """After STARTTLS the filter hears HELO again with {tls_version} and {cipher}; after AUTH PLAIN, MAIL
    carries {auth_type} PLAIN and {auth_authen} the login (OpenDKIM signs on {auth_type}); the first HELO,
    in the clear, carries no TLS macro."""
    helos: list[tuple[str, dict[str, str]]] = []
    mails: list[dict[str, str]] = []

    async def on_helo(cmd: ppm.Helo) -> ppm.Continue:
        helos.append((cmd.hostname, dict(cmd.macros)))
        return ppm.Continue()

    async def on_mail(cmd: ppm.MailFrom) -> ppm.Continue:
        mails.append(dict(cmd.macros))
        return ppm.Continue()

    app = ppm.PurePythonMilter(name="tls", hook_on_helo=on_helo, hook_on_mail_from=on_mail, restrict_symbols=None)
    with serving(app) as spec:
        pol = EdgePolicy(tls_context=server_tls_context(*cert), passwords=PasswordFile.load(passwd_file),
                         milter=m.MilterSettings(smtpd_milters=(spec,)))
        with run_edge(tmp_path, pol) as edge, edge.client() as s:
            s.ehlo("client.test")
            s.starttls(context=client_context(cert[0]))
            s.ehlo("client.test")
            assert 235 == s.docmd("AUTH", "PLAIN " + plain(USER, PASSWORD))[0]
            assert {} == s.sendmail("alice@example.org", ["b@example.net"], b"Subject: x\r\n\r\nbody\r\n")
    [(first, clear), (again, tls)] = helos
    assert ("client.test", "client.test", None) == (first, again, clear.get("{tls_version}"))
    assert (True, True) == (tls["{tls_version}"].startswith("TLSv1."), bool(tls["{cipher}"]))
    assert ("PLAIN", USER, "alice@example.org") == (mails[0]["{auth_type}"], mails[0]["{auth_authen}"],
                                                    mails[0]["{mail_addr}"])


def test_a_filter_that_asks_for_bits_not_offered_is_served_with_the_rest(tmp_path):
    """A filter whose negotiation answer holds bits mtaq did not offer (libmilter's SMFIP_MDS_256K
    0x10000000, an unknown action 0x8000) besides SMFIP_NR_HDR and SMFIF_ADDHDRS: the unknown bits are left
    out (as Postfix does) instead of failing the filter, headers go unanswered as it asked, and its header
    is added at the end of the message."""
    seen: list[bytes] = []

    def on_command(conn: socket.socket, cmd: bytes) -> bytes | None:
        seen.append(cmd)
        if cmd == m.SMFIC_HEADER:
            return b""  # SMFIP_NR_HDR: no reply
        if cmd == m.SMFIC_BODYEOB:
            return m.packet(m.SMFIR_ADDHEADER, b"X-Raw\0yes\0") + m.packet(m.SMFIR_CONTINUE)
        return m.packet(m.SMFIR_CONTINUE)

    optneg = (6, m.SMFIF_ADDHDRS | 0x8000, m.SMFIP_NR_HDR | 0x10000000)
    with raw_filter(on_command, optneg) as spec, run_edge(tmp_path, policy(spec)) as edge, edge.client() as s:
        assert 250 == _send(s, "a@example.org", ["b@example.net"], "x")[0]
        [(_, body)] = edge.messages()
    assert b"\r\nSubject: x\r\nX-Raw: yes\r\n\r\nbody\r\n" in body
    assert [m.SMFIC_HEADER, m.SMFIC_HEADER] == [c for c in seen if c == m.SMFIC_HEADER]


def test_packets_without_a_reply_go_out_in_one_write_with_the_next_packet(tmp_path):
    """A filter that negotiated SMFIP_NR_HDR gets every header with the end of headers (and its macros) in
    one write, and the SMFIC_ABORT of a transaction left by RSET in one write with the next MAIL: a run of
    packets that get no reply costs one write (one wake-up of the filter), not one per packet. Every
    command still arrives, in Postfix's order."""
    reads: list[list[bytes]] = []

    def on_command(conn: socket.socket, cmd: bytes) -> bytes | None:
        return b"" if cmd == m.SMFIC_HEADER else m.packet(m.SMFIR_CONTINUE)

    optneg = (6, 0, m.SMFIP_NR_HDR)
    with raw_filter(on_command, optneg, reads) as spec, run_edge(tmp_path, policy(spec)) as edge, \
            edge.client() as s:
        s.ehlo("client.example.org")
        assert 250 == s.mail("a@example.org")[0]
        assert 250 == s.rcpt("b@example.net")[0]
        assert 250 == s.rset()[0]
        assert {} == s.sendmail("a@example.org", ["b@example.net"],
                                b"From: a@example.org\r\nTo: b@example.net\r\nSubject: x\r\nMessage-ID: <c@p>\r\n\r\nhi\r\n")
        assert 1 == len(edge.messages())
    headers = [r for r in reads if m.SMFIC_HEADER in r]
    aborts = [r for r in reads if m.SMFIC_ABORT in r]
    n = headers[0].count(m.SMFIC_HEADER) if headers else 0
    assert ([[m.SMFIC_HEADER] * n + [m.SMFIC_MACRO, m.SMFIC_EOH]], [[m.SMFIC_ABORT, m.SMFIC_MACRO, m.SMFIC_MAIL]]) == (
        headers, aborts), reads
    assert 4 <= n


def test_a_filter_that_stops_reading_cannot_hold_the_session_past_its_timeout(tmp_path):
    """A filter that asked for the body without replies (SMFIP_NR_BODY) and stops reading at the first
    chunk, with a small receive buffer: mtaq's writes back up, and after milter_content_timeout_s (0.5 s)
    the filter is dropped (milter_error at stage body, a write timeout) and the client gets ``451 4.3.5``;
    nothing is queued."""

    def on_command(conn: socket.socket, cmd: bytes) -> bytes | None:
        if cmd == m.SMFIC_BODY:
            time.sleep(4)  # not reading
            return None
        return m.packet(m.SMFIR_CONTINUE)

    big = b"".join(b"line %07d of a body the filter never reads\r\n" % i for i in range(150000))  # 6.6 MB
    optneg = (6, 0, m.SMFIP_NR_BODY)
    with raw_filter(on_command, optneg, rcvbuf=16384) as spec, structlog.testing.capture_logs() as logs, \
            run_edge(tmp_path, policy(spec, content_timeout_s=0.5), data_size_limit=16 << 20) as edge, \
            edge.client() as s:
        s.ehlo("client.example.org")
        assert 250 == s.mail("a@example.org")[0]
        assert 250 == s.rcpt("b@example.net")[0]
        started = time.monotonic()
        code, text = s.data(b"From: a@example.org\r\nSubject: big\r\n\r\n" + big)
        took = time.monotonic() - started
        assert (451, b"4.3.5 Server configuration problem - try again later") == (code, text)
        assert [] == edge.messages()
    errors = [(e["stage"], e["error"].split(":")[:2]) for e in logs if e["event"] == "milter_error"]
    assert [("body", ["write", " TimeoutError"])] == errors
    assert took < 3.5, took
