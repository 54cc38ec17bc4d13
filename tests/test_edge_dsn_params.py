"""The SMTP edge receives the RFC 3461 DSN parameters (mtaq.edge.smtp.MtaqSMTP).

A real aiosmtpd server with MtaqSMTP on a loopback port, its event loop in a background thread, and
Python's smtplib as the client. A small recording handler keeps what reached handle_DATA.
"""

from __future__ import annotations

import asyncio
import contextlib
import smtplib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP

from mtaq.edge.smtp import MtaqSMTP, decode_xtext, encode_xtext

BODY = b"Subject: t\r\nMessage-ID: <x@y>\r\n\r\nbody\r\n"


class RecordingHandler:
    """Keeps the DSN state of every envelope that reaches DATA; answers 250."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.received.append({
            "mail_from": envelope.mail_from,
            "dsn_ret": envelope.dsn_ret,
            "dsn_envid": envelope.dsn_envid,
            "rcpt_tos": list(envelope.rcpt_tos),
            "rcpt_dsn": list(envelope.rcpt_dsn),
            "mail_options": list(envelope.mail_options),
        })
        return "250 2.0.0 Ok: queued"


class EhloHookHandler(RecordingHandler):
    """A handler with its own (5-argument) handle_EHLO that adds an extension line."""

    async def handle_EHLO(self, server: Any, session: Any, envelope: Any, hostname: str, responses: list[str]) -> list[str]:
        session.host_name = hostname
        return [*responses[:-1], "250-XTEST", responses[-1]]


@dataclass
class Server:
    port: int
    handler: RecordingHandler
    loop: asyncio.AbstractEventLoop
    server: Any = field(default=None)

    def client(self) -> smtplib.SMTP:
        return smtplib.SMTP("127.0.0.1", self.port, timeout=10)


@contextlib.contextmanager
def run_server(handler: RecordingHandler, protocol: type[SMTP] = MtaqSMTP) -> Iterator[Server]:
    """Serve ``protocol`` (with ``handler``) on a loopback port from an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Any:
        return await loop.create_server(
            lambda: protocol(handler, hostname="mx.test", ident="mtaq", data_size_limit=1 << 20,
                             enable_SMTPUTF8=True, decode_data=False, timeout=10, loop=loop),
            "127.0.0.1", 0)

    srv = asyncio.run_coroutine_threadsafe(start(), loop).result(10)

    async def stop() -> None:
        srv.close()
        await srv.wait_closed()

    try:
        yield Server(srv.sockets[0].getsockname()[1], handler, loop, srv)
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def server() -> Iterator[Server]:
    with run_server(RecordingHandler()) as srv:
        yield srv


@pytest.fixture
def hooked_server() -> Iterator[Server]:
    with run_server(EhloHookHandler()) as srv:
        yield srv


def send(s: smtplib.SMTP) -> int:
    code, _ = s.data(BODY)
    return code


def assert_syntax_error(reply: tuple[int, bytes]) -> None:
    code, text = reply
    assert 501 == code, reply
    assert text.startswith(b"5.5.4 "), reply


def ehlo_lines(s: smtplib.SMTP) -> list[str]:
    code, text = s.ehlo("client.test")
    assert 250 == code
    return text.decode().split("\n")


def test_ehlo_advertises_dsn_and_keeps_aiosmtpds_extensions(server):
    """EHLO is plain aiosmtpd's reply with PIPELINING, ENHANCEDSTATUSCODES, DSN and FUTURERELEASE added
    before HELP;
    a second EHLO lists each once."""
    with run_server(RecordingHandler(), SMTP) as plain, plain.client() as s:
        expected = ehlo_lines(s)
    expected[-1:-1] = ["PIPELINING", "ENHANCEDSTATUSCODES", "DSN", "FUTURERELEASE"]

    def keywords(lines: list[str]) -> list[str]:  # FUTURERELEASE's date-time moves with the clock
        return [ln.split()[0] if ln.startswith("FUTURERELEASE ") else ln for ln in lines]

    with server.client() as s:
        lines = keywords(ehlo_lines(s))
        assert expected == lines
        assert ["mx.test", "SIZE 1048576", "8BITMIME", "SMTPUTF8", "PIPELINING", "ENHANCEDSTATUSCODES", "DSN",
                "FUTURERELEASE", "HELP"] == lines
        assert s.has_extn("dsn")
        assert lines == keywords(ehlo_lines(s))


def test_ehlo_dsn_is_added_to_what_the_handlers_handle_ehlo_returns(hooked_server):
    """A handler's own handle_EHLO keeps working; DSN is added without its help."""
    with hooked_server.client() as s:
        lines = ehlo_lines(s)
        assert "XTEST" in lines and "DSN" in lines and "HELP" == lines[-1]
        assert 250 == s.mail("a@example.org", ["RET=FULL"])[0]


def test_helo_session_does_not_advertise_and_rejects_dsn_params(server):
    """After HELO there are no parameters: RET is aiosmtpd's syntax error, and plain mail still flows."""
    with server.client() as s:
        code, text = s.helo("client.test")
        assert 250 == code and b"DSN" not in text
        code, text = s.docmd("MAIL", "FROM:<a@example.org> RET=FULL")
        assert 501 == code and text.startswith(b"5.5.4 Syntax: MAIL FROM:")
        assert 250 == s.docmd("MAIL", "FROM:<a@example.org>")[0]
        code, _ = s.docmd("RCPT", "TO:<b@example.net> NOTIFY=NEVER")
        assert 501 == code
        assert 250 == s.docmd("RCPT", "TO:<b@example.net>")[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert (None, None, ["b@example.net"], [()]) == (got["dsn_ret"], got["dsn_envid"], got["rcpt_tos"], got["rcpt_dsn"])


def test_dsn_params_are_stored_decoded_and_aligned_per_recipient(server):
    """RET/ENVID on the envelope, ENVID decoded; NOTIFY/ORCPT per accepted recipient, () for none."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 250 == s.mail("a@example.org", ["RET=HDRS", "ENVID=QQ+2B1"])[0]
        assert 250 == s.rcpt("b@example.net", ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;a+2Bb@x"])[0]
        assert 250 == s.rcpt("c@example.net")[0]
        assert 250 == s.rcpt("d@example.net", ["NOTIFY=NEVER"])[0]
        assert 250 == s.rcpt("e@example.net", ["ORCPT=rfc822;e@example.net"])[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert "HDRS" == got["dsn_ret"]
    assert "QQ+1" == got["dsn_envid"]
    assert ["b@example.net", "c@example.net", "d@example.net", "e@example.net"] == got["rcpt_tos"]
    assert [
        (("NOTIFY", "SUCCESS,FAILURE"), ("ORCPT", "rfc822;a+b@x")),
        (),
        (("NOTIFY", "NEVER"),),
        (("ORCPT", "rfc822;e@example.net"),),
    ] == got["rcpt_dsn"]
    assert [] == got["mail_options"]


def test_keywords_are_case_insensitive_and_values_normalised(server):
    """Lower-case keywords are recognised; RET and NOTIFY are upper-cased, NOTIFY deduplicated; ORCPT kept as given."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 250 == s.mail("a@example.org", ["ret=full", "envid=abc"])[0]
        assert 250 == s.rcpt("b@example.net", ["orcpt=RFC822;B@example.net", "notify=delay,success,delay"])[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert ("FULL", "abc") == (got["dsn_ret"], got["dsn_envid"])
    assert [(("NOTIFY", "DELAY,SUCCESS"), ("ORCPT", "RFC822;B@example.net"))] == got["rcpt_dsn"]


@pytest.mark.parametrize("params", [
    ["RET=BODY"],
    ["RET"],
    ["RET=FULL", "RET=HDRS"],
    ["ENVID=" + "x" * 101],
    ["ENVID="],
    ["ENVID=a+2"],
    ["ENVID=a+2b"],
    ["ENVID=a+0Ab"],
    ["ENVID=a", "envid=b"],
])
def test_bad_mail_dsn_params_get_501_and_the_session_goes_on(server, params):
    """A bad RET or ENVID (value, xtext, length, repeat) is 501 5.5.4; a later MAIL is accepted as usual."""
    with server.client() as s:
        s.ehlo("client.test")
        assert_syntax_error(s.mail("a@example.org", params))
        assert 250 == s.mail("a@example.org", ["ENVID=" + "x" * 100])[0]
        assert 250 == s.rcpt("b@example.net")[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert (None, "x" * 100) == (got["dsn_ret"], got["dsn_envid"])


@pytest.mark.parametrize("params", [
    ["NOTIFY=NEVER,SUCCESS"],
    ["NOTIFY=SOMETIMES"],
    ["NOTIFY="],
    ["NOTIFY=SUCCESS,,FAILURE"],
    ["NOTIFY=SUCCESS", "NOTIFY=FAILURE"],
    ["ORCPT=foo"],
    ["ORCPT=;a@b"],
    ["ORCPT=rfc822;"],
    ["ORCPT=rfc822;a+2"],
    ["ORCPT=rfc822;a+0Ab"],
    ["ORCPT=rfc822;a", "ORCPT=rfc822;b"],
    ["ORCPT=rfc822;" + "x" * 494],
])
def test_bad_rcpt_dsn_params_get_501_and_the_transaction_goes_on(server, params):
    """A bad NOTIFY or ORCPT is 501 5.5.4; the recipient is not added and the next ones stay aligned."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 250 == s.mail("a@example.org", ["RET=FULL"])[0]
        assert_syntax_error(s.rcpt("bad@example.net", params))
        assert 250 == s.rcpt("good@example.net", ["NOTIFY=FAILURE"])[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert ["good@example.net"] == got["rcpt_tos"]
    assert [(("NOTIFY", "FAILURE"),)] == got["rcpt_dsn"]
    assert "FULL" == got["dsn_ret"]


def test_long_orcpt_fits_the_rcpt_line_after_ehlo(server):
    """An ORCPT of 500 characters (RFC 3461 §4.2) is accepted although the RCPT line passes 512."""
    orcpt = "rfc822;" + "x" * 493
    with server.client() as s:
        s.ehlo("client.test")
        assert 250 == s.mail("a@example.org", ["RET=HDRS", "ENVID=" + "e" * 100, "SIZE=100"])[0]
        assert 250 == s.rcpt("b@example.net", ["NOTIFY=SUCCESS,FAILURE,DELAY", "ORCPT=" + orcpt])[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert [(("NOTIFY", "SUCCESS,FAILURE,DELAY"), ("ORCPT", orcpt))] == got["rcpt_dsn"]


def test_size_and_body_still_work_alongside_ret(server):
    """SIZE and BODY=8BITMIME are still aiosmtpd's: accepted with RET/ENVID, and kept in mail_options."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 250 == s.mail("a@example.org", ["SIZE=100", "RET=FULL", "BODY=8BITMIME", "ENVID=id1"])[0]
        assert 250 == s.rcpt("b@example.net")[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert ["SIZE=100", "BODY=8BITMIME"] == got["mail_options"]
    assert ("FULL", "id1") == (got["dsn_ret"], got["dsn_envid"])


def test_refused_mail_keeps_no_dsn_values(server):
    """A MAIL refused by aiosmtpd (too big, unknown parameter) leaves no RET/ENVID behind for the next one."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 552 == s.mail("a@example.org", ["SIZE=99999999", "RET=FULL", "ENVID=big"])[0]
        assert 555 == s.mail("a@example.org", ["XFOO=1", "RET=FULL", "ENVID=foo"])[0]
        assert 501 == s.mail("a@example.org", ["BODY=BINARYMIME", "RET=FULL"])[0]
        assert 250 == s.mail("a@example.org")[0]
        assert 250 == s.rcpt("b@example.net")[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert (None, None, [()]) == (got["dsn_ret"], got["dsn_envid"], got["rcpt_dsn"])


def test_nested_mail_and_rcpt_without_mail_are_still_503(server):
    """aiosmtpd's sequence errors come first: a second MAIL does not overwrite the first one's RET."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 503 == s.rcpt("b@example.net", ["NOTIFY=NEVER"])[0]
        assert 250 == s.mail("a@example.org", ["RET=HDRS"])[0]
        assert 503 == s.mail("a@example.org", ["RET=FULL"])[0]
        assert 250 == s.rcpt("b@example.net", ["NOTIFY=NEVER"])[0]
        assert 250 == send(s)
    [got] = server.handler.received
    assert ("HDRS", [(("NOTIFY", "NEVER"),)]) == (got["dsn_ret"], got["rcpt_dsn"])


def test_each_transaction_starts_without_dsn_values(server):
    """RSET and the end of DATA give a fresh envelope: nothing of the previous transaction's DSN carries over."""
    with server.client() as s:
        s.ehlo("client.test")
        assert 250 == s.mail("a@example.org", ["RET=HDRS", "ENVID=one"])[0]
        assert 250 == s.rcpt("b@example.net", ["NOTIFY=NEVER"])[0]
        assert 250 == s.rset()[0]
        assert 250 == s.mail("a@example.org", ["RET=FULL", "ENVID=two"])[0]
        assert 250 == s.rcpt("c@example.net", ["NOTIFY=DELAY"])[0]
        assert 250 == send(s)
        assert 250 == s.mail("a@example.org")[0]
        assert 250 == s.rcpt("d@example.net")[0]
        assert 250 == send(s)
    first, second = server.handler.received
    assert ("FULL", "two", ["c@example.net"], [(("NOTIFY", "DELAY"),)]) == (
        first["dsn_ret"], first["dsn_envid"], first["rcpt_tos"], first["rcpt_dsn"])
    assert (None, None, ["d@example.net"], [()]) == (
        second["dsn_ret"], second["dsn_envid"], second["rcpt_tos"], second["rcpt_dsn"])


def test_help_still_knows_mail_and_rcpt(server):
    """The overridden commands keep aiosmtpd's HELP text (with an enhanced status code)."""
    with server.client() as s:
        s.ehlo("client.test")
        assert (250, b"2.0.0 Syntax: RCPT TO: <address> [SP <mail-parameters>]") == s.docmd("HELP", "RCPT")
        assert (250, b"2.0.0 Syntax: MAIL FROM: <address> [SP <mail-parameters>]") == s.docmd("HELP", "MAIL")


def test_xtext_decode_and_encode():
    """RFC 3461 §4 xtext: +HH escapes decoded; encoding escapes '+', '=' and anything outside '!'..'~'."""
    assert "QQ+1" == decode_xtext("QQ+2B1")
    assert "a b=c" == decode_xtext("a+20b+3Dc")
    for bad in ("a+2", "a+2b", "a=b", "a b", "é"):
        with pytest.raises(ValueError):
            decode_xtext(bad)
    text = "a+b=c d\\e"
    assert "a+2Bb+3Dc+20d\\e" == encode_xtext(text)
    assert text == decode_xtext(encode_xtext(text))
