"""``mtaq sink`` (mtaq.testing.sink): where it stores what it receives."""

from __future__ import annotations

import asyncio
import mailbox

from aiosmtpd.smtp import Envelope, Session

from mtaq.testing.sink import SinkHandler


def test_an_existing_empty_directory_becomes_a_maildir_and_a_message_is_stored(tmp_path):
    """``mkdir md; mtaq sink --maildir md`` answered every message ``500 ... (FileNotFoundError)``: Python's
    Maildir takes an existing directory as one and does not make tmp/, new/ and cur/ (found at stop 57)."""
    md = tmp_path / "md"
    md.mkdir()
    sink = SinkHandler(str(md))

    async def main() -> str:
        session = Session(asyncio.get_running_loop())
        session.peer = ("127.0.0.1", 1)
        env = Envelope()
        env.mail_from = "a@example.org"
        env.rcpt_tos = ["b@example.com"]
        env.original_content = b"Subject: x\r\n\r\nbody\r\n"
        return await sink.handle_DATA(None, session, env)  # type: ignore[arg-type]

    reply = asyncio.run(main())
    assert reply.startswith("250 2.0.0 Ok: stored as ")
    [msg] = list(mailbox.Maildir(str(md), create=False))
    assert msg.get_payload().replace("\r\n", "\n") == "body\n" and msg["Delivered-To"] == "b@example.com"
