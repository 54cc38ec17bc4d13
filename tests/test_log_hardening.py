"""Issue 32 items 7 and 8: every library's log records are escaped like mtaq's own events, an over-long AUTH
response line gets ``500 5.5.6`` (not ``451`` and a traceback), and no traceback carries local variables
(it held the AUTH line and the user name).

The daemon is the real one (``mtaq serve`` with a trustme certificate and a password file); clients are raw
sockets and ssl over loopback.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import socket
import ssl
import subprocess
import sys

import pytest
import trustme

from mtaq.logs import LIBRARY_EVENT, configure_logging, get_logger
from mtaq.testing.procs import read_events, start_daemon, wait_for

SECRET_USER = "zorro-the-secret-user"
SECRET_PASSWORD = "Tr0ub4dor-secret-pw"
RAW_CONTROLS = (b"\x1b", b"\r", b"\x0b", b"\x1c")


class Client:
    """A raw SMTP client: lines in and out, STARTTLS by hand."""

    def __init__(self, port: int) -> None:
        self.sock: socket.socket = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.file = self.sock.makefile("rb")

    def reply(self) -> bytes:
        lines = []
        while True:
            line = self.file.readline()
            assert line, f"connection closed after {lines}"
            lines.append(line)
            if line[3:4] != b"-":
                return b"".join(lines)

    def cmd(self, line: bytes) -> bytes:
        self.sock.sendall(line + b"\r\n")
        return self.reply()

    def starttls(self, ca: trustme.CA) -> None:
        assert self.cmd(b"STARTTLS").startswith(b"220 ")
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        self.sock = ctx.wrap_socket(self.sock, server_hostname="mx.test")
        self.file = self.sock.makefile("rb")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The daemon with STARTTLS and AUTH (user SECRET_USER, bcrypt cost 4); yields (Proc, CA)."""
    d = tmp_path_factory.mktemp("authd")
    ca = trustme.CA()
    ca.issue_cert("mx.test", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(d / "cert.pem"))
    (d / "cert.pem").chmod(0o600)  # the key inside: readable by group or others is refused at start (issue 32.9)
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "passwd", SECRET_USER, "--rounds", "4"],
                         input=SECRET_PASSWORD + "\n", capture_output=True, text=True, timeout=60, check=True)
    (d / "passwd").write_text(out.stdout)
    (d / "passwd").chmod(0o600)  # group- or world-readable is refused at start (issue 33)
    (d / "mtaq.toml").write_text(f'myhostname = "mx.test"\ntls_cert_file = "{d}/cert.pem"\n'
                                 f'tls_key_file = "{d}/cert.pem"\nauth_password_file = "{d}/passwd"\n')
    p = start_daemon(str(d / "spool"), 9, str(d / "daemon.log"), config=str(d / "mtaq.toml"))
    yield p, ca
    p.kill9()


def _tls_client(daemon) -> Client:
    p, ca = daemon
    c = Client(p.port)
    assert c.reply().startswith(b"220 ")
    assert c.cmd(b"EHLO client.test").startswith(b"250")
    c.starttls(ca)
    assert b"AUTH LOGIN PLAIN" in c.cmd(b"EHLO client.test")
    return c


def _b64(data: bytes) -> bytes:
    return base64.b64encode(data)


def test_an_unknown_command_with_controls_is_logged_escaped(daemon):
    """aiosmtpd's own warning for an unknown command (logger ``mail.log``) carried ESC, CR, VT and FS raw
    into the daemon's log; now it is a ``library_log`` event with each escaped, and the log has none raw."""
    p, _ = daemon
    c = Client(p.port)
    try:
        assert c.reply().startswith(b"220 ")
        assert c.cmd(b"EHLO client.test").startswith(b"250")
        # the reply names nothing of the command (aiosmtpd's echoed it raw, ESC and all)
        assert b"500 5.5.2 Error: command not recognized\r\n" == c.cmd(b"XYZZY\x1b[31m\r\x0bmid\x1cEND")
        assert c.cmd(b"NOOP").startswith(b"250 ")
    finally:
        c.close()
    [ev] = wait_for(lambda: [e for e in read_events(p.log_path) if e.get("event") == LIBRARY_EVENT
                             and "XYZZY" in e.get("message", "")], 10, "aiosmtpd's unrecognised-command record")
    assert ("mail.log", "warning") == (ev["logger"], ev["level"])
    assert "XYZZY\\x1b[31M\\x0d\\x0bMID\\x1cEND" in ev["message"]
    with open(p.log_path, "rb") as f:
        raw = f.read()
    assert [] == [c for c in RAW_CONTROLS if c in raw]


@pytest.mark.parametrize("mechanism", ["LOGIN", "PLAIN"])
def test_an_over_long_auth_response_line_gets_500_5_5_6_and_no_secret_is_logged(daemon, mechanism):
    """An AUTH response line over the line limit (1001 octets) got ``451 4.3.0`` and a traceback whose frames'
    locals held the user name and the line; now Postfix's ``500 5.5.6 SASL response limit exceeded`` (RFC
    4954 §6), the session goes on, and neither the user name nor the password is anywhere in the log."""
    p, _ = daemon
    long_password = (SECRET_PASSWORD * 80).encode()
    c = _tls_client(daemon)
    try:
        if mechanism == "LOGIN":
            assert c.cmd(b"AUTH LOGIN").startswith(b"334 ")
            assert c.cmd(_b64(SECRET_USER.encode())).startswith(b"334 ")
            reply = c.cmd(_b64(long_password))
        else:
            assert c.cmd(b"AUTH PLAIN").startswith(b"334 ")
            reply = c.cmd(_b64(b"\0" + SECRET_USER.encode() + b"\0" + long_password))
        assert b"500 5.5.6 SASL response limit exceeded\r\n" == reply
        assert c.cmd(b"NOOP").startswith(b"250 ")  # the rest of the line was dropped, not taken as a command
        # the same user with the right password still logs in on this connection
        ok = c.cmd(b"AUTH PLAIN " + _b64(b"\0" + SECRET_USER.encode() + b"\0" + SECRET_PASSWORD.encode()))
        assert ok.startswith(b"235 ")
    finally:
        c.close()
    with open(p.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert (False, False, False) == (SECRET_USER in log, SECRET_PASSWORD in log, "smtp_session_error" in log)


def test_an_over_long_auth_login_user_name_line_gets_500_5_5_6(daemon):
    """The first LOGIN answer (the user name) too: ``500 5.5.6``, and the name is not logged."""
    p, _ = daemon
    c = _tls_client(daemon)
    try:
        assert c.cmd(b"AUTH LOGIN").startswith(b"334 ")
        assert b"500 5.5.6 SASL response limit exceeded\r\n" == c.cmd(_b64((SECRET_USER * 60).encode()))
        assert c.cmd(b"NOOP").startswith(b"250 ")
    finally:
        c.close()
    with open(p.log_path, encoding="utf-8", errors="replace") as f:
        assert SECRET_USER not in f.read()


class _Stream(io.StringIO):
    def isatty(self) -> bool:
        return False


def _raise_with_secrets_in_locals() -> None:
    user, line = SECRET_USER, f"AUTH PLAIN {SECRET_PASSWORD}"  # noqa: F841 - locals a traceback could show
    raise ValueError("boom")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_no_traceback_shows_local_variables(fmt):
    """structlog's JSON tracebacks showed every frame's locals (``show_locals`` is its default), Rich's too:
    an exception logged by mtaq or by any library (asyncio, aiohttp through ``logging``) has its traceback,
    but no frame's local variables, in either format."""
    out = _Stream()
    configure_logging(fmt, stream=out)
    try:
        try:
            _raise_with_secrets_in_locals()
        except ValueError:
            get_logger().exception("smtp_session_error", client="127.0.0.1")
            logging.getLogger("asyncio").error("Exception in callback", exc_info=True)
    finally:
        configure_logging("console")
    text = out.getvalue()
    assert (2, True) == (text.count("ValueError: boom") if fmt == "console" else text.count('"ValueError"'),
                         "_raise_with_secrets_in_locals" in text)
    assert (False, False) == (SECRET_USER in text, SECRET_PASSWORD in text)


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_library_records_go_through_the_same_escaping(fmt):
    """A ``logging`` record of any library (here ``aiosmtplib`` and ``aiohttp.server``) is an event of mtaq's
    pipeline: ESC, CR, VT, FS, C1 CSI and U+2028 come out escaped, on one line."""
    out = _Stream()
    configure_logging(fmt, stream=out)
    try:
        logging.getLogger("aiosmtplib").warning("reply %s", "a\x1b[2Jb\r\x0b\x1c\u009b\u2028c")
        logging.getLogger("aiohttp.server").error("bad \x1b]0;t\x07")
        logging.getLogger("quiet").info("below warning: dropped, as Python's last-resort handler did")
    finally:
        configure_logging("console")
    lines = out.getvalue().splitlines()
    assert 2 == len(lines), lines
    assert [] == [c for c in "\x1b\r\x0b\x1c\u009b\u2028\x07" if c in out.getvalue()]
    if fmt == "json":
        events = [json.loads(line) for line in lines]
        assert [("aiosmtplib", "warning", "reply a\\x1b[2Jb\\x0d\\x0b\\x1c\\x9b\\u2028c"),
                ("aiohttp.server", "error", "bad \\x1b]0;t\\x07")] == [
            (e["logger"], e["level"], e["message"]) for e in events]
    else:
        assert "message=" + repr("reply a\\x1b[2Jb\\x0d\\x0b\\x1c\\x9b\\u2028c") in lines[0]
