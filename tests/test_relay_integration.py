"""The relay end to end: real SMTP clients in (smtplib, swaks), the daemon as a subprocess, a real sink out."""

from __future__ import annotations

import shutil
import smtplib
import subprocess
import sys
from email import policy
from email.message import EmailMessage

import pytest

from mtaq.testing.procs import maildir_message_ids


def message(i: int, to: str = "rcpt@example.net") -> EmailMessage:
    m = EmailMessage()
    m["From"] = "sender@example.org"
    m["To"] = to
    m["Subject"] = f"test {i}"
    m["Message-ID"] = f"<it-{i}@mtaq.test>"
    m.set_content(f"message {i}\n.\n..leading dots survive\n")
    return m


def send(port: int, msg: EmailMessage, rcpts: list[str]) -> tuple[int, bytes]:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail("sender@example.org")
        for r in rcpts:
            s.rcpt(r)
        return s.data(msg.as_bytes(policy=policy.SMTP))  # CRLF, as real clients send


def test_messages_are_queued_with_an_id_and_arrive_byte_for_byte(relay_factory):
    """DATA is answered '250 2.0.0 Ok: queued as ID'; each recipient's copy arrives with the body intact."""
    r = relay_factory()
    replies = [send(r.daemon.port, message(i), ["a@example.net", "b@example.net"]) for i in range(10)]
    assert all(code == 250 and text.startswith(b"2.0.0 Ok: queued as ") for code, text in replies)
    ids = r.wait_for(lambda: (m := maildir_message_ids(r.maildir)) and sum(m.values()) >= 20 and m, what="20 deliveries")
    assert {f"<it-{i}@mtaq.test>": 2 for i in range(10)} == dict(ids)
    body = open(next(p for p in __import__("glob").glob(r.maildir + "/new/*")), "rb").read()
    assert b"\n..leading dots survive" in body  # dot-stuffing undone inbound, redone outbound
    queued = {e["queue_id"] for e in r.events("queued")}
    assert {t.decode().rsplit(" ", 1)[1] for _, t in replies} == queued
    delivered = r.wait_for(lambda: len(r.events("delivered")) >= 20 and r.events("delivered"), what="events")
    assert {(e["queue_id"], e["recipient"]) for e in delivered} == {(q, a) for q in queued for a in ("a@example.net", "b@example.net")}


def test_deferred_recipient_is_retried_after_the_configured_interval(relay_factory):
    """4xx then 2xx: the recipient is deferred once (logged), then delivered by a retry; others go at once."""
    r = relay_factory(sink_args=["--defer-rcpt", "^later@", "--defer-count", "1"], config="retry_intervals_s = [1.0]\n")
    send(r.daemon.port, message(1), ["now@example.net", "later@example.net"])
    r.wait_for(lambda: any(e["recipient"] == "later@example.net" for e in r.events("delivered")), what="retry")
    deferred = r.events("deferred")
    assert [("later@example.net", "4.2.0")] == [(e["recipient"], e["dsn"]) for e in deferred]
    delivered = {e["recipient"]: e["attempt"] for e in r.events("delivered")}
    assert {"now@example.net": 1, "later@example.net": 2} == delivered
    assert 2 == sum(maildir_message_ids(r.maildir).values())


def test_permanently_refused_recipient_is_bounced_and_leaves_the_queue(relay_factory):
    """5xx at RCPT is final: 'bounced' with the enhanced code, no retry, the message is removed, and a DSN
    from <> to the sender goes out through the same queue (here: to the same sink)."""
    r = relay_factory(sink_args=["--reject-rcpt", "^nobody@"], config="retry_intervals_s = [1.0]\n")
    _, text = send(r.daemon.port, message(2), ["nobody@example.net", "someone@example.net"])
    qid = text.decode().rsplit(" ", 1)[1]
    r.wait_for(lambda: r.events("removed"), what="removed")
    assert [("nobody@example.net", "5.1.1", qid)] == [(e["recipient"], e["dsn"], e["queue_id"]) for e in r.events("bounced")]
    [dsn] = r.wait_for(lambda: r.events("dsn_queued"), what="dsn_queued")
    assert (qid, "sender@example.org", "failed") == (dsn["dsn_for"], dsn["recipient"], dsn["action"])
    ids = r.wait_for(lambda: (m := maildir_message_ids(r.maildir)) and len(m) == 2 and m, what="original and DSN")
    assert {"<it-2@mtaq.test>": 1} == {k: v for k, v in ids.items() if "mtaq.test" in k}


def test_queued_mail_survives_kill9_while_the_next_hop_is_down_and_goes_after_restart(relay_factory):
    """With the sink refusing (4xx), queued mail waits; after kill -9 and restart it is recovered and sent."""
    r = relay_factory(sink_args=["--defer-rcpt", ".", "--defer-count", "1"], config="retry_intervals_s = [3.0]\n")
    for i in range(5):
        send(r.daemon.port, message(100 + i), [f"x{i}@example.net"])
    r.wait_for(lambda: len(r.events("deferred")) >= 5, what="deferrals")
    r.restart()
    rec = r.wait_for(lambda: r.events("recovery_complete")[1:], what="second recovery")[0]
    assert rec["records"] > 0 and rec["seconds"] >= 0
    ids = r.wait_for(lambda: (m := maildir_message_ids(r.maildir)) and len(m) >= 5 and m, what="deliveries")
    assert {f"<it-{100 + i}@mtaq.test>" for i in range(5)} == set(ids)
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "log", "verify", "--spool", r.spool], capture_output=True, text=True)
    assert 0 == out.returncode, out.stdout


@pytest.mark.skipif(shutil.which("swaks") is None, reason="swaks not installed (make test installs it)")
def test_swaks_client_is_accepted_and_relayed(relay_factory):
    """Debian's swaks, a real SMTP client, gets 250 and its message reaches the sink."""
    r = relay_factory()
    out = subprocess.run(
        ["swaks", "--server", f"127.0.0.1:{r.daemon.port}", "--from", "s@example.org", "--to", "t@example.net",
         "--header", "Message-Id: <swaks-1@mtaq.test>", "--body", "hello from swaks"],
        capture_output=True, text=True, timeout=60,
    )
    assert 0 == out.returncode, out.stdout + out.stderr
    assert "250 2.0.0 Ok: queued as" in out.stdout
    r.wait_for(lambda: "<swaks-1@mtaq.test>" in maildir_message_ids(r.maildir), what="swaks message")


def test_periodic_stats_event_reports_counters_and_the_daemon_keeps_running(relay_factory):
    """The stats event carries the log and queue counters (fsyncs, commit rounds, active attempts, segments)."""
    r = relay_factory(config="stats_interval_s = 0.2\n")
    send(r.daemon.port, message(7), ["a@example.net"])
    ev = r.wait_for(lambda: [e for e in r.events("stats") if e["delivered"] >= 1], what="stats event")[0]
    assert (1, 1) == (ev["received"], ev["delivered"])
    assert ev["fsync_calls"] >= ev["commit_rounds"] >= 1
    assert {"active", "segments", "log_bytes", "checkpoints", "runner_positions"} <= set(ev)
    r.wait_for(lambda: len(r.events("stats")) >= 3, what="more stats events")
    assert r.daemon.alive()
