"""``mtaq queue`` against the real daemon (subprocess, real SMTP in, a sink deferring ^slow out), and with
the daemon killed (offline: read the spool). Each command is run as a real process."""

from __future__ import annotations

import json
import re
import smtplib
import subprocess
import sys

from mtaq.testing.procs import maildir_message_ids


def queue(*args: str, spool: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", *args, "--spool", spool],
                          capture_output=True, text=True, timeout=120, input=stdin)


def send(port: int, sender: str, rcpts: list[str], subject: str, body_lines: int = 1) -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(sender)
        for r in rcpts:
            s.rcpt(r)
        code, text = s.data(f"Subject: {subject}\r\nMessage-ID: <{subject}@t>\r\n\r\n".encode() + b"body line\r\n" * body_lines)
        assert 250 == code, text
        return text.decode().rsplit(" ", 1)[1]


def deferred(relay_factory, messages: list[tuple[str, list[str], str]], sink_args=("--defer-rcpt", "^slow")):
    """A relay with ``messages`` (sender, recipients, subject) sent and deferred; returns (relay, queue IDs)."""
    r = relay_factory(sink_args=list(sink_args), config="retry_intervals_s = [3600.0]\n")
    ids = [send(r.daemon.port, s, rc, subj) for s, rc, subj in messages]
    r.wait_for(lambda: len(r.events("deferred_until")) >= len(messages), what="deferred")
    return r, ids


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_list_prints_like_mailq_with_reasons_flags_and_the_log_position(relay_factory):
    """list: the mailq header; per message ID (with ! when held), size, arrival time, sender; each
    recipient's last reason in parentheses before it; a blank line between messages; the total line with
    the log position the listing is consistent as of."""
    r, (a, b) = deferred(relay_factory, [("alice@example.org", ["slow1@example.net", "slow2@example.net"], "a"),
                                         ("bob@example.org", ["slow3@example.net"], "b")])
    assert 0 == queue("hold", b, spool=r.spool).returncode
    out = queue("list", spool=r.spool)
    assert (0, "") == (out.returncode, out.stderr)
    lines = out.stdout.splitlines()
    assert "-Queue ID-  --Size-- ----Arrival Time---- -Sender/Recipient-------" == lines[0]
    assert re.fullmatch(rf"{a}\s+\d+ \w{{3}} \w{{3}} [ \d]\d \d\d:\d\d:\d\d  alice@example\.org", lines[1]), lines[1]
    assert lines[2].startswith("(451 4.2.0 <slow1@example.net>")
    assert " " * 42 + "slow1@example.net" == lines[3]
    assert lines[4].startswith("(451 4.2.0 <slow2@example.net>")
    assert " " * 42 + "slow2@example.net" == lines[5]
    assert "" == lines[6]
    assert lines[7].startswith(f"{b}! ")  # held
    assert re.fullmatch(r"-- 1 Kbytes in 2 Requests\. \(consistent as of log position \d+:\d+\)", lines[-1]), lines[-1]


def test_list_json_and_filters(relay_factory):
    """list --json: one postqueue -j object per line; --sender, --domain, --deferred, --held and
    --older-than narrow the listing; a bad duration is exit 1 with one line."""
    r, (a, b, c) = deferred(relay_factory, [("alice@example.org", ["slow1@example.net"], "a"),
                                            ("bob@example.org", ["slow2@other.example"], "b"),
                                            ("bob@example.org", ["slow3@example.net"], "c")])
    out = queue("list", "--json", spool=r.spool)
    assert 0 == out.returncode
    objs = json_lines(out.stdout)
    assert [a, b, c] == [o["queue_id"] for o in objs]
    assert {("deferred", "deferred")} == {(o["queue_name"], o["state"]) for o in objs}
    assert {"queue_name", "queue_id", "arrival_time", "message_size", "sender", "recipients"} <= set(objs[0])
    assert re.fullmatch(r"mtaq: listing consistent as of log position \d+:\d+\n", out.stderr)

    def ids(*flags: str) -> list[str]:
        res = queue("list", "--json", *flags, spool=r.spool)
        assert 0 == res.returncode, res.stderr
        return [o["queue_id"] for o in json_lines(res.stdout)]

    assert [b, c] == ids("--sender", "bob@")
    assert [b] == ids("--domain", "other.example")
    assert [c] == ids("--sender", "bob@", "--recipient", "slow3")
    assert [a, b, c] == ids("--deferred")
    assert [] == ids("--held")
    assert [] == ids("--older-than", "2h")
    assert [a, b, c] == ids("--older-than", "0")
    bad = queue("list", "--older-than", "2x", spool=r.spool)
    assert (1, ["mtaq: --older-than: '2x' is not a duration (e.g. 3600, 30m, 2h, 1d)"]) == (bad.returncode, bad.stderr.splitlines())


def test_size_and_show(relay_factory):
    """size: counts by state (human and --json); show ID: the message with its reasons and headers;
    an unknown ID is exit 1 with one line."""
    r, (a, b) = deferred(relay_factory, [("alice@example.org", ["slow1@example.net"], "first"),
                                         ("bob@example.org", ["slow2@example.net"], "second")])
    queue("hold", a, spool=r.spool)
    out = queue("size", "--json", spool=r.spool)
    size = json.loads(out.stdout)
    assert {"incoming": 0, "active": 0, "deferred": 1, "delayed": 0, "held": 1, "total": 2} == {
        k: v for k, v in size.items() if k != "position"}
    human = queue("size", spool=r.spool).stdout.splitlines()
    assert ["deferred  1", "held      1", "total     2"] == [line for line in human if line.startswith(("deferred", "held", "total"))]
    shown = queue("show", b, spool=r.spool)
    assert 0 == shown.returncode
    assert f"Queue ID: {b}" in shown.stdout.splitlines()
    assert "  Subject: second" in shown.stdout.splitlines()
    assert any(line.startswith("  slow2@example.net  (451 4.2.0") for line in shown.stdout.splitlines())
    as_json = json.loads(queue("show", a, "--json", spool=r.spool).stdout)
    assert (a, "held") == (as_json["queue_id"], as_json["state"])
    missing = queue("show", "NOSUCHID", spool=r.spool)
    assert (1, ["mtaq: admin API: 404 NOSUCHID: no such message in the queue"]) == (missing.returncode, missing.stderr.splitlines())


def test_actions_by_id_stdin_and_all_with_filters(relay_factory):
    """hold/release by ID, delete with IDs from stdin (-), delete ALL narrowed by --sender, flush and
    bounce: each reports what it did; skipped IDs are named on stderr; the queue shows the result."""
    r, (a, b, c, d) = deferred(
        relay_factory,
        [("alice@example.org", ["slow1@example.net"], "a"), ("spam@bad.example", ["slow2@example.net"], "b"),
         ("spam@bad.example", ["slow3@example.net"], "c"), ("carol@example.org", ["slow4@example.net"], "d")],
        sink_args=("--defer-rcpt", "^slow", "--defer-count", "1"),
    )
    out = queue("hold", a, spool=r.spool)
    assert (0, [f"{a}: held"]) == (out.returncode, out.stdout.splitlines()[:1])
    assert re.fullmatch(r"Held: 1 message \(as of log position \d+:\d+\)", out.stdout.splitlines()[1])
    out = queue("delete", "ALL", "--sender", "spam@", "--json", spool=r.spool)
    res = json.loads(out.stdout)
    assert ("delete", sorted([b, c]), {}) == (res["action"], sorted(res["done"]), res["skipped"])
    out = queue("release", "-", spool=r.spool, stdin=f"{a}\nNOSUCHID\n\n")
    assert [f"{a}: released"] == out.stdout.splitlines()[:1]
    assert ["mtaq: NOSUCHID: skipped: no such message in the queue"] == out.stderr.splitlines()
    # released: attempted again at once; the sink accepts slow1 on its second attempt
    r.wait_for(lambda: "<a@t>" in maildir_message_ids(r.maildir), what="released message delivered")
    out = queue("flush", d, spool=r.spool)
    assert [f"{d}: flushed"] == out.stdout.splitlines()[:1]
    r.wait_for(lambda: "<d@t>" in maildir_message_ids(r.maildir), what="flushed message delivered")
    assert {"<a@t>", "<d@t>"} == set(maildir_message_ids(r.maildir))
    empty = queue("delete", "-", spool=r.spool, stdin="")
    assert (1, ["mtaq: no queue IDs on standard input"]) == (empty.returncode, empty.stderr.splitlines())
    both = queue("delete", "ALL", a, spool=r.spool)
    assert (1, ["mtaq: give either ALL or queue IDs, not both"]) == (both.returncode, both.stderr.splitlines())


def test_delay_parks_mail_for_a_while_and_refuses_beyond_delay_max_s(relay_factory):
    """delay ID --for 2h: the message is delayed with a release time; --for beyond delay_max_s is exit 1
    with one line naming the limit."""
    r = relay_factory(sink_args=["--defer-rcpt", "^slow"], config="retry_intervals_s = [3600.0]\ndelay_max_s = 86400\n")
    a = send(r.daemon.port, "alice@example.org", ["slow1@example.net"], "a")
    r.wait_for(lambda: r.events("deferred_until"), what="deferred")
    out = queue("delay", a, "--for", "2h", spool=r.spool)
    assert (0, [f"{a}: delayed"]) == (out.returncode, out.stdout.splitlines()[:1])
    [m] = json_lines(queue("list", "--json", spool=r.spool).stdout)
    assert ("delayed", True) == (m["state"], "release_time" in m)
    out = queue("delay", a, "--for", "2d", spool=r.spool)
    assert (1, ["mtaq: admin API: 400 requested delay of 172800 seconds exceeds the maximum of 86400 seconds (delay_max_s)"]) == (
        out.returncode, out.stderr.splitlines())


def test_bounce_returns_the_message_to_its_sender(relay_factory):
    """bounce ID: the sender gets a DSN (sent through the queue to the sink) and the message is gone."""
    r, (a,) = deferred(relay_factory, [("alice@example.org", ["slow1@example.net"], "a")])
    out = queue("bounce", a, spool=r.spool)
    assert [f"{a}: bounced"] == out.stdout.splitlines()[:1]
    r.wait_for(lambda: [e for e in r.events("delivered") if e["recipient"] == "alice@example.org"], what="DSN delivered")
    assert [] == json_lines(queue("list", "--json", spool=r.spool).stdout)


def test_offline_list_size_show_read_the_spool_and_actions_fail(relay_factory):
    """With the daemon killed, list/size/show read the spool (saying so on stderr) and give what the
    daemon gave; an action fails with exit 1 and one line saying a running daemon is needed."""
    r, (a, b) = deferred(relay_factory, [("alice@example.org", ["slow1@example.net"], "a"),
                                         ("bob@example.org", ["slow2@example.net"], "b")])
    queue("hold", b, spool=r.spool)
    online = json_lines(queue("list", "--json", spool=r.spool).stdout)
    online_size = json.loads(queue("size", "--json", spool=r.spool).stdout)
    r.daemon.kill9()
    out = queue("list", "--json", spool=r.spool)
    assert 0 == out.returncode
    assert out.stderr.startswith("mtaq: daemon not running (daemon pid ")
    assert [(m["queue_id"], m["state"], m["recipients"]) for m in online] == [
        (m["queue_id"], m["state"], m["recipients"]) for m in json_lines(out.stdout)]
    human = queue("list", spool=r.spool)
    assert human.stdout.splitlines()[-1].startswith("-- 1 Kbytes in 2 Requests. (consistent as of log position ")
    off_size = json.loads(queue("size", "--json", spool=r.spool).stdout)
    assert {k: online_size[k] for k in ("deferred", "held", "total")} == {k: off_size[k] for k in ("deferred", "held", "total")}
    shown = queue("show", a, "--json", spool=r.spool)
    detail = json.loads(shown.stdout)
    assert (0, a, True) == (shown.returncode, detail["queue_id"], ["Subject", "a"] in detail["headers"])
    act = queue("delete", a, spool=r.spool)
    assert 1 == act.returncode
    [line] = act.stderr.splitlines()
    assert line.startswith("mtaq: delete needs a running daemon (daemon pid ")
    (r.tmp / "spool" / "admin.json").unlink()
    out = queue("size", spool=r.spool)
    assert (0, True) == (out.returncode, "(no " in out.stderr)


def test_without_daemon_or_spool_the_command_fails_with_one_line(tmp_path):
    """No admin.json and no queue log: exit 1, one line naming the missing log."""
    out = queue("list", spool=str(tmp_path / "nothing"))
    assert (1, [f"mtaq: no queue log at {tmp_path / 'nothing' / 'log'}"]) == (out.returncode, out.stderr.splitlines())
