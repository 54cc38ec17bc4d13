"""The edge's fast path (mtaq.edge.fastpath) changes costs, never behaviour: same tables, same addresses."""

from __future__ import annotations

import asyncio
import smtplib
from typing import Any

from aiosmtpd.smtp import SMTP
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.core.state import RetryPolicy
from mtaq.edge.fastpath import parse_address
from mtaq.edge.server import QueueHandler
from mtaq.edge.smtp import MtaqSMTP
from mtaq.queue.store import Queue
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log


class _Handler:
    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        return "250 OK"


def _outcome(f: Any, *args: Any) -> Any:
    try:
        return f(*args)
    except Exception as exc:  # aiosmtpd's parser raises on some input ('<'): the same must happen
        return type(exc)


def _aiosmtpd_getaddr(arg: str, local_part_limit: int = 0) -> tuple[str | None, str | None]:
    plain = SMTP.__new__(SMTP)
    plain.local_part_limit = local_part_limit
    return SMTP._getaddr(plain, arg)  # type: ignore[no-any-return]


_ADDR_CHARS = st.sampled_from([*'ab<>@."\\ :,;()[]x=-+', "SIZE=1", "é", "\t"])


@settings(max_examples=400, deadline=None)
@given(arg=st.lists(_ADDR_CHARS, max_size=24).map("".join), limit=st.sampled_from([0, 1, 3, 64]))
def test_address_parsing_gives_what_aiosmtpd_gives(arg: str, limit: int) -> None:
    """For any MAIL/RCPT argument, parse_address returns (or raises) what aiosmtpd does, cached or not."""
    expected = _outcome(_aiosmtpd_getaddr, arg, limit)
    assert expected == _outcome(parse_address, arg, limit)
    assert expected == _outcome(parse_address, arg, limit)  # the second time from the cache


def test_address_parsing_examples() -> None:
    """Angle addresses with parameters, bare addresses, the null path, and garbage."""
    assert ("a@b.example", "SIZE=10") == parse_address("<a@b.example> SIZE=10")
    assert ("a@b.example", "") == parse_address("a@b.example")
    assert ("", "") == parse_address("")
    assert (None, None) == parse_address("<" + "x" * 65 + "@b.example>", 64)


def test_connection_tables_are_those_aiosmtpd_builds_from_the_full_dir() -> None:
    """The command table (and AUTH table) of a new connection lists every smtp_* (auth_*) method of the class."""

    async def make() -> MtaqSMTP:
        return MtaqSMTP(_Handler(), hostname="mx.test", loop=asyncio.get_running_loop())

    proto = asyncio.run(make())
    full = object.__dir__(proto)
    expected_commands = {n.removeprefix("smtp_") for n in full if n.startswith("smtp_")}
    assert expected_commands == set(proto._smtp_methods)
    assert {"DATA", "EHLO", "HELO", "MAIL", "RCPT", "RSET", "QUIT", "NOOP", "VRFY", "HELP"} <= expected_commands
    expected_auth = {n.removeprefix("auth_").replace("__", "-") for n in full if n.startswith("auth_")}
    assert expected_auth == set(proto._auth_methods)
    # The table binds a command's method when asked, as aiosmtpd's dict held it; unknown commands are absent.
    assert proto.smtp_MAIL == proto._smtp_methods["MAIL"] == proto._smtp_methods.get("MAIL")
    assert None is proto._smtp_methods.get("XYZZY") and "XYZZY" not in proto._smtp_methods
    assert {name: getattr(proto, "smtp_" + name) for name in expected_commands} == dict(proto._smtp_methods.items())
    assert all(a.is_builtin and a.method == getattr(proto, "auth_" + m) for m, a in proto._auth_methods.items())


def test_auth_table_leaves_out_excluded_mechanisms_as_aiosmtpd_does() -> None:
    """auth_exclude_mechanism removes a mechanism from the AUTH table, of the class or of the handler."""

    class Handler(_Handler):
        async def auth_CUSTOM(self, server: Any, args: list[str]) -> None:
            return None

        async def auth_LOGIN(self, server: Any, args: list[str]) -> None:  # the handler's wins over the class's
            return None

    def which(proto: SMTP, handler: Handler) -> dict[str, tuple[bool, str]]:
        """Each mechanism: built in or not, and whose method (the protocol's or the handler's) serves it."""
        return {m: (a.is_builtin, "handler" if getattr(a.method, "__self__", None) is handler else "protocol")
                for m, a in proto._auth_methods.items()}

    async def make(exclude: Any) -> tuple[dict[str, tuple[bool, str]], dict[str, tuple[bool, str]]]:
        loop = asyncio.get_running_loop()
        h1, h2 = Handler(), Handler()
        ours = MtaqSMTP(h1, hostname="mx.test", loop=loop, auth_exclude_mechanism=exclude())
        theirs = SMTP(h2, hostname="mx.test", loop=loop, auth_exclude_mechanism=exclude())
        return which(ours, h1), which(theirs, h2)

    # Lists, and one-shot iterables (aiosmtpd takes any iterable; it must be read only once).
    for exclude in (lambda: None, lambda: ["LOGIN"], lambda: ["CUSTOM", "PLAIN"], lambda: iter(["LOGIN"]),
                    lambda: (m for m in ["PLAIN"])):
        ours, theirs = asyncio.run(make(exclude))
        assert theirs == ours
        assert set(ours).isdisjoint(exclude() or [])


def test_the_queue_handlers_hooks_are_those_aiosmtpd_finds_in_its_full_dir(tmp_path: Any) -> None:
    """QueueHandler lists only its handle_*/auth_* names to dir(): aiosmtpd's hook table is unchanged."""

    async def make() -> tuple[MtaqSMTP, QueueHandler]:
        log, _ = Log.open(OsFileSystem(), str(tmp_path / "log"), segment_bytes_max=1 << 20)
        handler = QueueHandler(Queue(log, policy=RetryPolicy()))
        handler.auth_TEST = lambda *a: None  # type: ignore[attr-defined]  # set on the instance: listed too
        return MtaqSMTP(handler, hostname="mx.test", loop=asyncio.get_running_loop()), handler

    proto, handler = asyncio.run(make())
    full = object.__dir__(handler)
    assert {n.removeprefix("handle_") for n in full if n.startswith("handle_")} == set(proto._handle_hooks) == {"DATA"}
    assert "TEST" in proto._auth_methods and set(dir(handler)) == {"handle_DATA", "auth_TEST"}


def test_session_through_the_fast_path(tmp_path: Any) -> None:
    """A whole session (EHLO, MAIL with DSN parameters, two RCPT, DATA, HELP) against the real protocol class."""
    received: list[tuple[str, list[str], list[Any]]] = []

    class Handler:
        async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
            received.append((envelope.mail_from, list(envelope.rcpt_tos), list(envelope.rcpt_dsn)))
            return "250 2.0.0 OK"

    async def main() -> tuple[str, tuple[int, bytes]]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: MtaqSMTP(Handler(), hostname="mx.test", loop=loop), host="127.0.0.1", port=0
        )
        port = server.sockets[0].getsockname()[1]

        def client() -> tuple[str, tuple[int, bytes]]:
            with smtplib.SMTP("127.0.0.1", port) as s:
                s.ehlo("client.test")
                help_reply = s.docmd("HELP")
                s.mail("<s@example.org>", ["RET=HDRS"])
                s.rcpt("<r1@example.net>", ["NOTIFY=SUCCESS"])
                s.rcpt("r2@example.net")
                code, _ = s.data(b"Subject: t\r\n\r\nhello\r\n")
                return str(code), help_reply

        try:
            return await asyncio.to_thread(client)
        finally:
            server.close()

    code, (help_code, help_text) = asyncio.run(main())
    assert "250" == code
    assert 250 == help_code
    assert b"MAIL" in help_text and b"RCPT" in help_text and b"DATA" in help_text
    assert [("s@example.org", ["r1@example.net", "r2@example.net"], [(("NOTIFY", "SUCCESS"),), ()])] == received


def _domain_of_by_walk(address: str) -> str | None:
    """domain_of as it was before its fast path: the last "@" outside quotes, found character by character."""
    at = -1
    quoted = escaped = False
    for i, ch in enumerate(address):
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "@" and not quoted:
            at = i
    if at < 0 or at == len(address) - 1:
        return None
    return address[at + 1 :].translate(str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz"))


def _address_problem_by_walk(address: str, *, smtputf8: bool, null_ok: bool = False) -> str | None:
    """address_problem as it was before its fast paths (generator walks, unsendable_character always)."""
    from mtaq.edge import policy

    if address in ("", "<>"):
        return None if null_ok else policy.NO_DOMAIN
    if any(ch < " " or ch == "\x7f" for ch in address):
        return policy.CONTROL
    if any("\udc80" <= ch <= "\udcff" for ch in address):
        return policy.NOT_UTF8
    if not address.isascii() and not smtputf8:
        return policy.NEEDS_SMTPUTF8
    role, code = ("sender", "5.1.7") if null_ok else ("recipient", "5.1.3")
    bad = policy.unsendable_character(address)
    if bad is not None:
        return f"553 {code} Error: {role} address contains an invisible or control character ({bad})"
    return "checked further"


_ADDRESS_CHARS = st.sampled_from([*'ab@."\\ <>', "\x00", "\x1f", "\x7f", "\t", "\x85", "\u00a0", "\u200b", "\u2028",
                                  "\udc80", "\udcff", "é", "K", "\u212a", "\ue000"])


@settings(max_examples=600, deadline=None)
@given(address=st.lists(_ADDRESS_CHARS, max_size=16).map("".join), smtputf8=st.booleans(), null_ok=st.booleans())
def test_address_checks_with_fast_paths_answer_as_the_character_walks(address: str, smtputf8: bool, null_ok: bool) -> None:
    """domain_of and address_problem's first checks (controls, non-UTF-8, SMTPUTF8, unsendable characters)
    give the same answers with their fast paths (regex searches, ASCII short cuts) as walked by hand."""
    from mtaq.edge import policy

    assert _domain_of_by_walk(address) == policy.domain_of(address)
    expected = _address_problem_by_walk(address, smtputf8=smtputf8, null_ok=null_ok)
    got = policy.address_problem(address, smtputf8=smtputf8, null_ok=null_ok)
    if expected == "checked further":  # the rest (domain, IDNA, sendable) is unchanged: not one of these
        assert got not in (policy.CONTROL, policy.NOT_UTF8, policy.NEEDS_SMTPUTF8)
        assert got is None or "invisible or control character" not in got
    else:
        assert expected == got
