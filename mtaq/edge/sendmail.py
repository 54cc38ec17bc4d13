"""``mtaq sendmail``: the sendmail(1) command line (Postfix's sendmail + postdrop), for cron, PHP ``mail()``
and scripts: the message is written durably into ``SPOOL/maildrop`` (:mod:`mtaq.storage.maildrop`), whether
or not the daemon runs; the daemon picks it up (:mod:`mtaq.edge.pickup`). Also run when the program is
called ``sendmail`` (``ln -s $(which mtaq) /usr/sbin/sendmail``) or ``mailq`` (= ``sendmail -bp``).

Options (Postfix's sendmail(1)): ``-t`` (recipients from To:, Cc:, Bcc:, added to those of the command line;
Bcc: removed), ``-f SENDER`` / ``-r SENDER`` (``-f '<>'``: the null sender), ``-F NAME`` (the From: full name),
``-i`` / ``-oi`` (a line with a lone ``.`` is not the end of the message), ``-bs`` (SMTP on standard input and
output), ``-bp`` (``mtaq queue list``), ``-bm`` (the default), ``-q`` (``mtaq queue flush ALL``), ``-C FILE``
(the configuration file; default ``$MTAQ_CONFIG``, else ``/etc/mtaq/mtaq.toml`` when it exists). Ignored,
as Postfix ignores them: ``-B -G -h -I -L -m -N -n -O -o* -p -R -U -V -v -X -x -e* -c -d*``.

Headers, as Postfix's cleanup does for local submission: ``From:`` (``-F`` or the login's full name, and the
sender), ``Date:`` and ``Message-ID:`` are added when missing. A bare local part ``user`` becomes
``user@myorigin``. The default sender is the invoking user's login (``getuid``) ``@myorigin``
(``myorigin``, else ``myhostname``).

Exit status (sysexits.h): 0 only once the maildrop file and its directory entry are fsync'd; 64 EX_USAGE (bad
option, no recipient), 65 EX_DATAERR (bad sender address, message too large, no header/body parse), 67
EX_NOUSER (bad recipient address), 69 EX_UNAVAILABLE (an unsupported mode), 70 EX_SOFTWARE (a bug), 73
EX_CANTCREAT (the maildrop cannot be written: permissions, read-only), 75 EX_TEMPFAIL (a full disk, an I/O error:
try again later), 78 EX_CONFIG (the configuration file).
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import logging
import os
import pwd
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from mtaq.config import Config, load_config
from mtaq.core.errors import ConfigError
from mtaq.edge.data import TEXT_LINE_MAX
from mtaq.edge.policy import address_problem
from mtaq.storage import maildrop as md

__all__ = ["EX_CANTCREAT", "EX_DATAERR", "EX_NOUSER", "EX_TEMPFAIL", "EX_USAGE", "main", "prepare"]

EX_OK = 0
EX_USAGE = 64
EX_DATAERR = 65
EX_NOUSER = 67
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_CANTCREAT = 73
EX_TEMPFAIL = 75
EX_CONFIG = 78
DEFAULT_CONFIG = "/etc/mtaq/mtaq.toml"
_WITH_ARG = set("BCFfrhLNOpRVXe")  # options that take a value (the rest of the word, or the next word)
_IGNORED_FLAGS = set("GIUvnxmcA")
_HEADER_ONLY_REPLACED = ("bcc",)


class SendmailError(Exception):
    """What ends the command: ``status`` is the exit status (sysexits), the message the one line printed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Options:
    mode: str = "m"  # m: a message on stdin; s: SMTP; p: list the queue; q: flush the queue
    extract: bool = False
    sender: str | None = None
    full_name: str | None = None
    dots: bool = True  # a lone "." line ends the message (no -i)
    config: str | None = None
    recipients: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str]) -> Options:
    """Postfix's sendmail options (module docstring); operands anywhere are recipients. Raises SendmailError."""
    o = Options()
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if a == "--":
            o.recipients += args[i:]
            break
        if not a.startswith("-") or a == "-":
            o.recipients.append(a)
            continue
        j = 1
        while j < len(a):
            c = a[j]
            j += 1
            if c in _WITH_ARG:
                val = a[j:]
                if not val:
                    if i >= len(args):
                        raise SendmailError(EX_USAGE, f"option -{c} requires an argument")
                    val = args[i]
                    i += 1
                _value_option(o, c, val)
                break
            if c in "bq" or c == "o" or c == "d":
                val = a[j:]
                if c == "o" and not val:  # -o x: Sendmail's spelling with a space
                    if i >= len(args):
                        raise SendmailError(EX_USAGE, "option -o requires an argument")
                    val = args[i]
                    i += 1
                if c == "b":
                    if val in ("m", ""):
                        o.mode = "m"
                    elif val in ("s", "p"):
                        o.mode = val
                    else:
                        raise SendmailError(EX_UNAVAILABLE, f"-b{val}: unsupported (mtaq knows -bm, -bs, -bp)")
                elif c == "q":
                    if val == "" or val[:1] in ("R", "S", "I"):  # -q, -qRsite...: flush; -q30m: ignored
                        o.mode = "q"
                elif c == "o" and val.startswith("i"):
                    o.dots = False
                break
            if c == "t":
                o.extract = True
            elif c == "i":
                o.dots = False
            elif c in _IGNORED_FLAGS:
                pass
            else:
                raise SendmailError(EX_USAGE, f"unknown option -{c}")
    return o


def _value_option(o: Options, c: str, val: str) -> None:
    if c in "fr":
        o.sender = val
    elif c == "F":
        o.full_name = val
    elif c == "C":
        o.config = val


# ------------------------------------------------------------------------------------- the message
def read_message(stream: BinaryIO, *, dots: bool, limit: int) -> bytes:
    """The message on ``stream`` (a binary file) with CRLF line ends; without -i, up to a line that is a lone
    ``.``. Raises SendmailError (EX_DATAERR) when it is larger than ``limit`` bytes."""
    read = stream.readline
    lines: list[bytes] = []
    n = 0
    while True:
        line = read(limit + 3)  # bounded: a longer line is too big anyway
        if not line:
            break
        text = line.rstrip(b"\r\n")
        if dots and text == b".":
            break
        if line.endswith(b"\n"):
            line = text + b"\r\n"
        n += len(line)
        if n > limit:
            raise SendmailError(EX_DATAERR, f"message file too big (message_size_limit_bytes {limit})")
        lines.append(line)
    data = b"".join(lines)
    if data and not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data


def conform(message: bytes, *, forbid_nul: str, bare_newline: str) -> bytes:
    """``message`` (CRLF line ends, from :func:`read_message`) made fit for SMTP as the listener would take it
    (review finding B8; :func:`mtaq.edge.data.text_problem` holds for the result):

    * a NUL octet: removed with ``smtpd_forbid_nul = "strip"``, else SendmailError (EX_DATAERR);
    * a bare CR: made CRLF with ``smtp_bare_newline = "normalize"``, else SendmailError (EX_DATAERR);
    * a line longer than 998 octets: broken by inserting CRLF SPACE every 998 octets, as Postfix's
      ``smtp_line_length_limit`` (998) does to minimize the damage to MIME formatted mail.
    """
    if b"\0" in message:
        if forbid_nul != "strip":
            raise SendmailError(EX_DATAERR, "message contains NUL characters (smtpd_forbid_nul)")
        message = message.replace(b"\0", b"")
    lines = message.split(b"\r\n")
    if any(b"\r" in line for line in lines):
        if bare_newline != "normalize":
            raise SendmailError(EX_DATAERR, "message contains a bare CR (smtp_bare_newline)")
        lines = [part for line in lines for part in line.split(b"\r")]
    limit = TEXT_LINE_MAX - 2
    if any(len(line) > limit for line in lines):
        broken: list[bytes] = []
        for line in lines:
            broken.append(line[:limit])
            for at in range(limit, len(line), limit - 1):
                broken.append(b" " + line[at:at + limit - 1])
        lines = broken
    return b"\r\n".join(lines)


def _split(message: bytes) -> tuple[list[bytes], bytes]:
    """(header fields, each with its continuation lines and CRLFs; the rest from the empty line on)."""
    fields: list[bytes] = []
    pos = 0
    while pos < len(message):
        end = message.find(b"\r\n", pos)
        end = len(message) if end < 0 else end + 2
        line = message[pos:end]
        if line in (b"\r\n", b""):
            break
        if line[:1] in (b" ", b"\t") and fields:
            fields[-1] += line
        elif b":" in line and line.split(b":", 1)[0].strip() and b" " not in line.split(b":", 1)[0].strip():
            fields.append(line)
        elif not fields and line.startswith(b"From "):
            pass  # an mbox "From " line before the headers: dropped (as Postfix's cleanup does)
        else:
            break
        pos = end
    return fields, message[pos:]


def _name(f: bytes) -> str:
    return f.split(b":", 1)[0].strip().decode("ascii", "replace").lower()


def _value(f: bytes) -> str:
    v = f.split(b":", 1)[1]
    return v.replace(b"\r\n", b"").decode("utf-8", "surrogateescape").strip()


def qualify(address: str, myorigin: str) -> str:
    """``<a@b>`` -> ``a@b``; ``user`` -> ``user@myorigin`` (Postfix's append_at_myorigin); ``<>`` -> ``""``."""
    a = address.strip()
    if a.startswith("<") and a.endswith(">"):
        a = a[1:-1].strip()
    if a and "@" not in a:
        a = f"{a}@{myorigin}"
    return a


def prepare(message: bytes, *, sender: str, full_name: str | None, extract: bool, myorigin: str,
            hostname: str, name: str, now_ts: float) -> tuple[bytes, list[str]]:
    """The message as queued (From:, Date:, Message-ID: added when missing; with ``extract``, Bcc: removed)
    and, with ``extract``, the recipients of its To:, Cc: and Bcc: fields (qualified)."""
    fields, rest = _split(message)
    names = {_name(f) for f in fields}
    found: list[str] = []
    if extract:
        values = [_value(f) for f in fields if _name(f) in ("to", "cc", "bcc")]
        found = [qualify(a, myorigin) for _n, a in email.utils.getaddresses(values) if a.strip()]
        fields = [f for f in fields if _name(f) not in _HEADER_ONLY_REPLACED]
    added: list[str] = []
    if "from" not in names:
        added.append("From: " + email.utils.formataddr((full_name or "", sender or f"MAILER-DAEMON@{myorigin}")))
    if "date" not in names:
        added.append("Date: " + email.utils.formatdate(now_ts, localtime=True))
    if "message-id" not in names:
        added.append(f"Message-ID: <{name}@{hostname}>")
    head = "".join(f"{h}\r\n" for h in added).encode("utf-8", "surrogateescape") + b"".join(fields)
    if not rest.startswith(b"\r\n"):
        rest = b"\r\n" + rest  # the empty line between the header section and the body
    return head + rest, found


# ------------------------------------------------------------------------------------------ running
def _config(path: str | None) -> tuple[Config, str | None]:
    path = path or os.environ.get("MTAQ_CONFIG") or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    try:
        return load_config(path, {}), path
    except ConfigError as exc:
        raise SendmailError(EX_CONFIG, str(exc)) from None


def _login() -> tuple[str, str]:
    """(login, full name) of the real user id (getuid: what Postfix's sendmail trusts, not $USER)."""
    try:
        pw = pwd.getpwuid(os.getuid())
    except KeyError:
        return f"uid{os.getuid()}", ""
    return pw.pw_name, pw.pw_gecos.split(",", 1)[0]


def _myorigin(cfg: Config) -> str:
    return cfg.myorigin or cfg.hostname()


def _check_sender(sender: str) -> None:
    p = address_problem(sender, smtputf8=True, null_ok=True)
    if p is not None:
        raise SendmailError(EX_DATAERR, f"bad sender address <{sender}>: {p}")


def _check_recipients(recipients: list[str], cfg: Config) -> None:
    for r in recipients:
        p = address_problem(r, smtputf8=True) or ("no local part" if r.startswith("@") else None)
        if p is not None:
            raise SendmailError(EX_NOUSER, f"bad recipient address <{r}>: {p}")
    if len(recipients) > cfg.recipients_per_message_max:
        raise SendmailError(EX_USAGE, f"{len(recipients)} recipients (recipients_per_message_max "
                                      f"{cfg.recipients_per_message_max})")


def drop(cfg: Config, sender: str, recipients: list[str], message: bytes, login: str, name: str = "") -> str:
    """Write the message into the maildrop (as file ``name``, else a new one); its name. Raises SendmailError
    (73 or 75)."""
    try:
        return md.write_message(cfg.spool_dir, sender, recipients, message, login=login, name=name)
    except ValueError as exc:
        raise SendmailError(EX_DATAERR, str(exc)) from None
    except OSError as exc:
        where = exc.filename or os.path.join(cfg.spool_dir, md.MAILDROP_DIR)
        status = EX_CANTCREAT if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                                               errno.ENOTDIR) else EX_TEMPFAIL
        raise SendmailError(status, f"cannot write the maildrop: {where}: {exc.strerror or exc}") from None


def _unique(addresses: list[str]) -> list[str]:
    seen: set[str] = set()
    return [a for a in addresses if not (a in seen or seen.add(a))]  # type: ignore[func-returns-value]


def _submit(o: Options, cfg: Config) -> int:
    login, gecos = _login()
    origin = _myorigin(cfg)
    sender = qualify(o.sender, origin) if o.sender is not None else f"{login}@{origin}"
    _check_sender(sender)
    cmdline = [qualify(r, origin) for r in o.recipients]
    if not cmdline and not o.extract:
        raise SendmailError(EX_USAGE, "Recipient addresses must be specified on the command line or via the -t option")
    _check_recipients(cmdline, cfg)
    raw = conform(read_message(sys.stdin.buffer, dots=o.dots, limit=cfg.message_size_limit_bytes),
                  forbid_nul=cfg.smtpd_forbid_nul, bare_newline=cfg.smtp_bare_newline)
    now = time.time()
    name_hint = md.new_name(now)
    message, found = prepare(raw, sender=sender, full_name=o.full_name if o.full_name is not None else gecos,
                             extract=o.extract, myorigin=origin, hostname=cfg.hostname(), name=name_hint, now_ts=now)
    recipients = _unique(cmdline + found)
    if not recipients:
        raise SendmailError(EX_USAGE, "No recipient addresses found in message header")
    _check_recipients(recipients, cfg)
    if len(message) > cfg.message_size_limit_bytes:
        raise SendmailError(EX_DATAERR, f"message file too big (message_size_limit_bytes {cfg.message_size_limit_bytes})")
    drop(cfg, sender, recipients, message, login, name_hint)
    return EX_OK


QueueCommand = Callable[[str, Config, "str | None"], int]
"""``-bp`` / ``-q``: runs ``mtaq queue list`` / ``mtaq queue flush ALL`` for a config (the command line passes
:func:`mtaq.admin.cli.run_queue` in: the edge does not import the admin package)."""


def main(argv: Sequence[str], *, prog: str = "sendmail", queue_command: QueueCommand | None = None) -> int:
    """Run the sendmail command with ``argv`` (the words after the program name); the exit status.
    ``queue_command`` carries out -bp and -q (without one they exit 69, EX_UNAVAILABLE)."""
    try:
        o = parse_args(argv)
        if prog == "mailq":
            o.mode = "p"
        cfg, path = _config(o.config)
        if o.mode in ("p", "q"):
            if queue_command is None:
                raise SendmailError(EX_UNAVAILABLE, "-bp and -q need the mtaq command line")
            return queue_command("list" if o.mode == "p" else "flush", cfg, path)
        if o.mode == "s":
            return _smtp(o, cfg)
        return _submit(o, cfg)
    except SendmailError as exc:
        print(f"{prog}: fatal: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return EX_TEMPFAIL


# ------------------------------------------------------------------------------------------- -bs
def _smtp(o: Options, cfg: Config) -> int:
    """``-bs``: aiosmtpd's SMTP server over a socket pair whose other end is copied to and from stdin and
    stdout; each message is dropped into the maildrop before its 250 (Postfix runs smtpd the same way)."""
    from aiosmtpd.smtp import SMTP, Envelope, Session

    login, gecos = _login()
    origin = _myorigin(cfg)
    # aiosmtpd logs the end of the pipe after QUIT ("SMTP session exception", IncompleteReadError) with a
    # traceback; on a terminal or a caller's stderr that is noise: the session's outcome is in its replies.
    logging.getLogger("mail.log").disabled = True

    class Handler:
        async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                              options: list[str]) -> str:
            a = qualify(address, origin)
            if address_problem(a, smtputf8=True, null_ok=True) is not None:
                return "553 5.1.7 Error: bad sender address"
            envelope.mail_from = a
            envelope.mail_options.extend(options)
            return "250 2.1.0 Ok"

        async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                              options: list[str]) -> str:
            a = qualify(address, origin)
            p = address_problem(a, smtputf8=True)
            if p is not None:
                return p
            if len(envelope.rcpt_tos) >= cfg.recipients_per_message_max:
                return "452 4.5.3 Error: too many recipients"
            envelope.rcpt_tos.append(a)
            return "250 2.1.5 Ok"

        async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
            raw = envelope.original_content or b""
            assert isinstance(raw, bytes)
            try:  # what an SMTP listener would refuse is refused here, not set aside after a 250 (B8)
                raw = conform(raw, forbid_nul=cfg.smtpd_forbid_nul, bare_newline=cfg.smtp_bare_newline)
            except SendmailError as exc:
                return f"550 5.6.0 Error: {exc}"
            now = time.time()
            name = md.new_name(now)
            message, _ = prepare(raw, sender=envelope.mail_from or "", full_name=gecos, extract=False,
                                 myorigin=origin, hostname=cfg.hostname(), name=name, now_ts=now)
            try:
                name = await asyncio.to_thread(drop, cfg, envelope.mail_from or "", list(envelope.rcpt_tos),
                                               message, login, name)
            except SendmailError as exc:
                return f"451 4.3.0 Error: {exc}"
            return f"250 2.0.0 Ok: queued as {name}"

    class PipeSMTP(SMTP):
        """aiosmtpd cancels the session at end-of-file; on a pipe the commands before it (a whole session
        written at once, then stdin closed) are answered first, then the session ends."""

        def eof_received(self) -> bool | None:
            asyncio.StreamReaderProtocol.eof_received(self)  # the reader sees EOF after what it has buffered
            task = self._handler_coroutine

            def ended(t: asyncio.Task[None]) -> None:
                if not t.cancelled():
                    t.exception()  # an EOF in mid-command: the session just ends
                if self.transport is not None:
                    self.transport.close()

            if task is not None:
                task.add_done_callback(ended)
            return True

    ours, theirs = socket.socketpair()

    def pump_in() -> None:
        try:
            while True:
                b = os.read(sys.stdin.fileno(), 65536)
                if not b:
                    break
                theirs.sendall(b)
        except OSError:
            pass
        try:
            theirs.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def pump_out() -> None:
        out = sys.stdout.fileno()
        while True:
            b = theirs.recv(65536)
            if not b:
                break
            while b:
                b = b[os.write(out, b):]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def factory() -> SMTP:
            smtp = PipeSMTP(Handler(), hostname=cfg.hostname(), ident="ESMTP mtaq sendmail", decode_data=False,
                        data_size_limit=cfg.message_size_limit_bytes, enable_SMTPUTF8=True, loop=loop)
            lost = smtp.connection_lost

            def connection_lost(exc: Exception | None) -> None:
                lost(exc)
                if not done.done():
                    done.set_result(None)

            smtp.connection_lost = connection_lost  # type: ignore[method-assign,assignment]
            return smtp

        await loop.connect_accepted_socket(factory, ours)
        await done

    t_in = threading.Thread(target=pump_in, daemon=True)
    t_out = threading.Thread(target=pump_out, daemon=True)
    t_in.start()
    t_out.start()
    asyncio.run(serve())
    try:
        ours.close()
    except OSError:
        pass
    t_out.join(timeout=5)
    return EX_OK
