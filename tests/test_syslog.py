"""``--log-format syslog`` (issue 33 item 5): RFC 5424 lines through the standard library's SysLogHandler to a
unix datagram socket (``syslog_socket``, default /dev/log), one line per event, control characters escaped as
in the other formats. The socket here is the test's own (this machine has no /dev/log)."""

from __future__ import annotations

import io
import re
import smtplib
import socket

from mtaq.logs import configure_logging, get_logger
from mtaq.testing.procs import start_daemon, start_sink, wait_for

# <PRI>1 TIMESTAMP HOST mtaq PID EVENT - key=value ... (README, "Logging"); 22 = mail.info
LINE = re.compile(r"<(\d+)>1 (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?Z) (\S+) mtaq (\d+) (\S+) - (.*)")
# A quoted local part (RFC 5321 §4.1.2) that would forge fields of an unquoted key=value line.
HOSTILE = '"x\\" status=sent relay=evil"'



def test_daemon_logs_queued_and_delivered_as_rfc5424_lines_to_the_syslog_socket(tmp_path):
    """A relayed message: ``queued`` and ``delivered`` arrive as datagrams in the documented format (PRI of
    mail.info, MSGID the event, ``queue_id`` first), the hostile sender one quoted value (its quote and backslash escaped), not three fields."""
    path = str(tmp_path / "syslog.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.settimeout(0.1)
    (tmp_path / "mtaq.toml").write_text(f'syslog_socket = "{path}"\n')
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    daemon = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "daemon.log"),
                          config=str(tmp_path / "mtaq.toml"), extra=["--log-format", "syslog"])
    try:
        with smtplib.SMTP("127.0.0.1", daemon.port, timeout=30) as s:
            s.ehlo("client.example")
            code, _ = s.mail(f"{HOSTILE}@example.org")
            assert 250 == code
            assert 250 == s.rcpt("bob@example.net")[0]
            code, text = s.data(b"Subject: hi\r\n\r\nbody\r\n")
            assert 250 == code
        qid = text.decode().rsplit(" ", 1)[1]
        lines: list[str] = []

        def delivered() -> bool:
            try:
                while True:
                    lines.append(rx.recv(65536).decode("utf-8"))
            except TimeoutError:
                pass
            return any(f" delivered - queue_id={qid} " in line for line in lines)

        wait_for(delivered, 20, "the delivered line")
    finally:
        daemon.kill9()
        sink.kill9()
        rx.close()
    parsed = {m.group(5): m for m in map(LINE.fullmatch, lines) if m}
    assert [] == [line for line in lines if not LINE.fullmatch(line)]
    queued, done = parsed["queued"], parsed["delivered"]
    assert ("22", "22", str(daemon.popen.pid)) == (queued.group(1), done.group(1), queued.group(4))
    fields = re.sub(r"client=127\.0\.0\.1:\d+ ", "client=127.0.0.1:PORT ", queued.group(6))
    assert f'queue_id={qid} client=127.0.0.1:PORT nrcpt=1 sender="\\"x\\\\\\" status=sent relay=evil\\"@example.org" size=' == (
        fields[: fields.index(" size=") + 6])
    assert done.group(6).startswith(f"queue_id={qid} ")
    assert "recipient=bob@example.net" in done.group(6).split(" ")


def test_syslog_renderer_quotes_and_escapes_values():
    """Without a socket the lines go to the stream, each with its PRI: a value with spaces, quotes, a
    backslash or a control character is one quoted logfmt value on one line."""
    buf = io.StringIO()
    configure_logging("syslog", stream=buf, syslog_socket="/nonexistent/log")
    try:
        get_logger().warning("deferred", queue_id="Q1", reply='451 "busy"\r\nFAKE', attempts=2, relay=None)
    finally:
        configure_logging("console")
    m = LINE.fullmatch(buf.getvalue().rstrip("\n"))
    assert m is not None, buf.getvalue()
    assert (1, "20", "deferred", 'queue_id=Q1 attempts=2 relay=- reply="451 \\"busy\\"\\\\x0d\\\\x0aFAKE"') == (
        buf.getvalue().count("\n"), m.group(1), m.group(5), m.group(6))
