"""Terminal and log injection (issue 13.5): what a client sent never reaches a terminal or a log line raw.

End to end: a real SMTP client sends an EHLO name with an OSC title sequence and a screen clear, and a
Subject with C1 CSI (U+009B), NEL, LINE SEPARATOR and RIGHT-TO-LEFT OVERRIDE; ``mtaq queue show``,
``queue list`` and ``log dump`` (real subprocesses) print none of them raw. The log renderers (JSON and
console) escape the same characters in every field.
"""

from __future__ import annotations

import io
import json
import smtplib
import subprocess
import sys
import unicodedata

from mtaq.logs import configure_logging, get_logger

INJECT_HELO = "x\x1b]0;owned\x07\x1b[2JFAKE"
INJECT_TEXT = "hi \x1b[31m\u009b2J \u0085 \u2028 \u202egnp.exe \x07"


def unsafe(text: str) -> list[str]:
    """The control, format and line-separator characters in ``text``, LF and TAB excepted."""
    return [c for c in text if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]


def mtaq(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, timeout=60)
    assert 0 == out.returncode, out.stderr
    return (out.stdout + out.stderr).decode("utf-8")


def test_queue_show_list_and_log_dump_escape_what_the_client_sent(relay_factory):
    """The injected EHLO and Subject come out escaped (\\x1b, \\x9b, \\u2028, \\u202e) in every human output."""
    r = relay_factory(sink_args=["--defer-rcpt", "^slow"], config="retry_intervals_s = [3600.0]\n")
    msg = f"Subject: {INJECT_TEXT}\r\nMessage-ID: <inj@t>\r\n\r\nbody\r\n".encode()
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        code, _ = s.docmd("EHLO", INJECT_HELO)
        assert 250 == code
        s.esmtp_features["smtputf8"] = ""
        s.mail("alice@example.org")
        s.rcpt("slow@example.net")
        code, text = s.data(msg)
        assert 250 == code
    qid = text.decode().rsplit(" ", 1)[1]
    utf8_sender = "b\u00f8b\u00e9@example.org"  # SMTPUTF8 (an override in an address is refused: 553)
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        s.ehlo("client.example")
        s.esmtp_features["smtputf8"] = ""
        assert 250 == s.mail(utf8_sender, ["SMTPUTF8"])[0]
        assert 250 == s.rcpt("slow@example.net")[0]
        assert 250 == s.data(b"Subject: second\r\n\r\nbody\r\n")[0]
    r.wait_for(lambda: len(r.events("deferred_until")) >= 2, what="both deferred")
    listed = mtaq("queue", "list", "--json", "--spool", r.spool)  # the daemon's JSON lines, as it sent them
    lines = listed.splitlines()[:-1]  # the last line: "listing consistent as of" on stderr
    assert ([], True) == (unsafe(listed), all(ln.isascii() for ln in lines)), listed
    assert {"alice@example.org", utf8_sender} == {json.loads(ln)["sender"] for ln in lines}
    show = mtaq("queue", "show", qid, "--spool", r.spool)
    assert ([], True, True) == (unsafe(show), "\\x1b]0;owned\\x07" in show, "hi \\x1b[31m" in show)
    outputs = [mtaq("queue", "list", "--spool", r.spool), mtaq("queue", "show", qid, "--json", "--spool", r.spool),
               mtaq("log", "dump", "--spool", r.spool), mtaq("log", "dump", "--json", "--spool", r.spool)]
    assert [[], [], [], []] == [unsafe(o) for o in outputs]


def test_json_and_console_log_lines_escape_controls_bidi_and_line_separators():
    """An event field with ESC, CR, C1 CSI, NEL, U+2028 and U+202E renders as one line with each escaped,
    in JSON and on the console; the JSON still decodes to the escaped text."""
    lines = {}
    for fmt in ("json", "console"):
        buf = io.StringIO()
        configure_logging(fmt, stream=buf)
        get_logger().info("queued", sender=INJECT_TEXT + "\r\nFAKE line", nested=[INJECT_HELO])
        lines[fmt] = buf.getvalue()
    configure_logging("console")
    assert ([], [], 1, 1) == (unsafe(lines["json"]), unsafe(lines["console"]),
                              lines["json"].count("\n"), lines["console"].count("\n"))
    event = json.loads(lines["json"])
    assert ("hi \\x1b[31m\\x9b2J \\x85 \\u2028 \\u202egnp.exe \\x07\\x0d\\x0aFAKE line", ["x\\x1b]0;owned\\x07\\x1b[2JFAKE"]) == (
        event["sender"], event["nested"])
