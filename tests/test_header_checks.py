"""header_checks (issue 35.3): Postfix's regexp-table rules over each header, applied before the log append.

The rules alone (mtaq.edge.headerchecks), then a real daemon with the real sink: small messages and a body
spilled to its temporary file, DKIM-signed after the rewrite and verified with dkimpy against a real DNS
server (what is on disk, what is signed and what is sent are the same message).
"""

from __future__ import annotations

import smtplib

import dkim
import pytest
from test_dkim import _stored, dnsfunc_for, keygen

from mtaq.core.errors import ConfigError
from mtaq.edge.headerchecks import HeaderChecks
from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.procs import read_events

RULES = [
    "/^Subject:.*viagra/ REJECT Spam is not welcome here",
    "/^X-Secret:/ IGNORE",
    "/^X-Mailer: (.*)$/ REPLACE X-Mailer: hidden",
    "/^Subject:/ PREPEND X-Checked: yes",
    "!/^(From|To|Subject|Date|Message-ID|X-Secret|X-Mailer|MIME-Version|Content-Type):/ WARN unexpected header",
    "/^From:.*@trusted\\.example/ DUNNO",
]


def test_the_first_rule_that_matches_a_header_decides_for_it():
    checks = HeaderChecks.from_config(RULES)
    head = (b"From: a@example.org\r\nX-Secret: internal\r\n\tfolded on\r\nX-Mailer: Outlook 16\r\n"
            b"Subject: Hello\r\nX-Odd: 1\r\n")
    out = checks.apply(head)
    assert None is out.reject
    assert b"From: a@example.org\r\nX-Mailer: hidden\r\nX-Checked: yes\r\nSubject: Hello\r\nX-Odd: 1\r\n" == out.head
    assert [("unexpected header", "X-Odd: 1")] == out.warnings
    assert "550 5.7.1 Spam is not welcome here" == checks.apply(b"SUBJECT: cheap VIAGRA\r\n").reject  # any case
    assert None is checks.apply(b"From: a@example.org\r\nTo: b@x\r\n").head  # nothing changed


@pytest.mark.parametrize(("rule", "why"), [
    ("Subject: x REJECT", "expected /PATTERN/FLAGS ACTION [TEXT]"),
    ("/x/ DELETE", "unknown action 'DELETE'"),
    ("/x/ REPLACE not a header", "REPLACE needs a header line"),
    ("/(/ IGNORE", "bad pattern"),
])
def test_a_bad_rule_is_one_line_naming_it(rule, why):
    with pytest.raises(ConfigError, match=r"header_checks\[1\]: ") as e:
        HeaderChecks.from_config(["/ok/ IGNORE", rule])
    assert why in str(e.value)


def test_the_daemon_applies_the_rules_before_it_queues_and_signs(relay_factory, tmp_path):
    """A real daemon with the rules above and a DKIM key for example.org (the client is in mynetworks):
    a Subject with viagra is refused at DATA (550 5.7.1, header_checks_reject), nothing queued; a small and
    a spilled message (receive_buffer_bytes 4096, 200 KiB body) are delivered without X-Secret, with
    X-Mailer replaced and X-Checked before Subject, their bodies whole, and their DKIM signatures (made
    after the rewrite) verify."""
    key_file, zone_line = keygen(tmp_path, "example.org", "s1")
    r = relay_factory(config="receive_buffer_bytes = 4096\nheader_checks = [\n"
                      + "".join(f"  {rule!r},\n".replace("\\\\", "\\") for rule in RULES) + "]\n"
                      + f'[dkim_keys."example.org"]\nselector = "s1"\nkey_file = "{key_file}"\n')
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    big = b"".join(b"line %06d of a large body\r\n" % i for i in range(7500))
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        with pytest.raises(smtplib.SMTPDataError) as refused:
            s.sendmail("a@example.org", ["x@example.net"],
                       b"From: a@example.org\r\nSubject: cheap viagra\r\nMessage-ID: <spam@p>\r\n\r\nbuy\r\n")
        assert (550, b"5.7.1 Spam is not welcome here") == (refused.value.smtp_code, refused.value.smtp_error)
        for mid, body in (("<small@p>", b"short body\r\n"), ("<big@p>", big), ("<bighead@p>", b"tail\r\n")):
            # <bighead@p>: a 100 KiB header section, spilled, longer than the temporary file held at the end
            padding = "".join(f"X-Secret: pad {i:04d} {'.' * 60}\r\n" for i in range(1500)) if mid == "<bighead@p>" else ""
            assert {} == s.sendmail("a@example.org", ["x@example.net"], (
                f"From: a@example.org\r\nTo: x@example.net\r\nX-Secret: internal\r\n\tfolded\r\n{padding}"
                f"X-Mailer: Outlook 16\r\nSubject: hello\r\nMessage-ID: {mid}\r\n\r\n").encode() + body)
    stored = r.wait_for(lambda: (m := _stored(r.maildir)) and len(m) == 3 and m, what="3 messages")
    with ZoneServer(zone_line + "\n", origin="org.") as zone:
        check = dnsfunc_for(zone)
        for mid, body in (("<small@p>", b"short body\r\n"), ("<big@p>", big), ("<bighead@p>", b"tail\r\n")):
            m = stored[mid]
            assert b"X-Secret" not in m and b"X-Mailer: hidden\r\nX-Checked: yes\r\nSubject: hello\r\n" in m, mid
            assert m.endswith(b"\r\n\r\n" + body), mid
            assert dkim.verify(m, dnsfunc=check), mid
    assert ["550 5.7.1 Spam is not welcome here"] == [e["reply"] for e in read_events(r.daemon.log_path)
                                                       if e.get("event") == "header_checks_reject"]
    assert 3 == len(r.events("queued"))


def test_a_hold_rule_queues_the_message_on_hold_across_a_restart_until_released(relay_factory):
    """`/^X-Review:/ HOLD needs review`: the message is accepted (250) and queued on hold
    (header_checks_hold with its queue ID); `mtaq queue list` shows it held, before and after a kill -9 and a
    start (recovery parks it again); nothing reaches the next hop until `mtaq queue release ID`."""
    import json
    import subprocess
    import sys

    r = relay_factory(config="header_checks = ['/^X-Review:/ HOLD needs review']\n")
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        assert {} == s.sendmail("a@example.org", ["x@example.net"],
                                b"From: a@example.org\r\nX-Review: please\r\nMessage-ID: <hold@p>\r\n\r\nwait\r\n")
    [hold] = r.wait_for(lambda: r.events("header_checks_hold"), what="the hold event")
    assert ("needs review", "X-Review: please") == (hold["text"], hold["header"])

    def queue(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", *args, "--spool", r.spool],
                              capture_output=True, text=True, timeout=60)

    def states() -> list[tuple[str, str]]:
        out = queue("list", "--json")
        assert 0 == out.returncode, out.stderr
        return [(m["queue_id"], m["state"]) for m in map(json.loads, out.stdout.splitlines())]  # JSON lines

    assert [(hold["queue_id"], "held")] == states()
    r.restart()
    r.wait_for(lambda: r.events("recovery_complete"), what="recovery")
    assert [(hold["queue_id"], "held")] == states()
    assert {} == _stored(r.maildir)
    assert 0 == queue("release", hold["queue_id"]).returncode
    stored = r.wait_for(lambda: _stored(r.maildir), what="the released message delivered")
    assert ["<hold@p>"] == list(stored)


def test_a_rewritten_header_section_longer_than_the_file_holds_yet_is_read_back_whole(tmp_path):
    """A spilled body written line by line (memory 4 KiB, pieces of 64 KiB): its 114 KB header section
    reaches past what the temporary file holds (the rest is still in memory). replace_start writes the
    memory out first, so the rewritten message reads back as the new header section and the rest, whole;
    size follows."""
    from mtaq.storage.spill import BodyBuffer

    b = BodyBuffer(str(tmp_path), memory_bytes=4096)
    line = b"X-Secret: pad " + b"." * 60 + b"\r\n"
    for _ in range(1500):
        b.write(line)
    b.write(b"\r\ntail\r\n")
    head_len = 1500 * len(line)
    b.replace_start(head_len, b"X-New: 1\r\n")
    b.head = b"Received: x\r\n"
    assert b"Received: x\r\nX-New: 1\r\n\r\ntail\r\n" == b"".join(b.pieces())
    assert len(b"Received: x\r\nX-New: 1\r\n\r\ntail\r\n") == b.size
    b.close()
