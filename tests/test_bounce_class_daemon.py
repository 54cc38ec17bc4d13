"""Bounce classification in the running daemon (issue 37.3): the ``category`` of ``bounced``, ``deferred`` and
``dsn_queued`` events over real SMTP (the daemon as a subprocess, an aiosmtpd next hop answering as Gmail
would), ``bounce_classification_file`` overriding a category, and a bad rule file stopping ``mtaq check``
and ``mtaq serve`` with one line."""

from __future__ import annotations

import os
import smtplib
import subprocess
import sys

from mtaq.testing.procs import free_port, mail_owner_ready

SINK = ["--rcpt-reply", "^nouser@=550 5.1.1 no such user",
        "--rcpt-reply", "^full@=452 4.2.2 mailbox full"]


def send(port: int, rcpts: list[str]) -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail("sender@example.org")
        for r in rcpts:
            s.rcpt(r)
        _, text = s.data(b"Subject: t\r\n\r\nhello\r\n")
    return text.decode().rsplit(" ", 1)[1]


def test_bounced_and_deferred_events_carry_the_category(relay_factory):
    """550 5.1.1 at RCPT: the ``bounced`` event and the DSN's ``dsn_queued`` say invalid_recipient; 452 4.2.2:
    the ``deferred`` event says mailbox_full; the delivered recipient's event has no category."""
    r = relay_factory(sink_args=SINK, config="retry_intervals_s = [600.0]\n")
    qid = send(r.daemon.port, ["nouser@example.net", "full@example.net", "ok@example.net"])
    r.wait_for(lambda: r.events("deferred_until"), what="the attempt's end")
    assert [("nouser@example.net", "5.1.1", "invalid_recipient")] == [
        (e["recipient"], e["dsn"], e["category"]) for e in r.events("bounced")]
    assert [("full@example.net", "4.2.2", "mailbox_full")] == [
        (e["recipient"], e["dsn"], e["category"]) for e in r.events("deferred")]
    assert [("ok@example.net", False)] == [(e["recipient"], "category" in e) for e in r.events("delivered")
                                           if e["queue_id"] == qid]
    [dsn] = r.wait_for(lambda: r.events("dsn_queued"), what="dsn_queued")
    assert (qid, "failed", "invalid_recipient", {"nouser@example.net": "invalid_recipient"}) == (
        dsn["dsn_for"], dsn["action"], dsn["category"], dsn["categories"])


def test_a_custom_rule_file_overrides_a_category(relay_factory, tmp_path):
    """``bounce_classification_file``: its rule (mailbox full -> rate_limited, for the sake of the test) is
    tried before the shipped ones; a reply it does not match keeps the shipped category."""
    rules = tmp_path / "bounces.toml"
    rules.write_text("version = 1\n[[rules]]\ncategory = \"rate_limited\"\ntext = ['(?i)mailbox full']\n")
    os.chmod(rules, 0o644)
    r = relay_factory(sink_args=SINK, config=f'retry_intervals_s = [600.0]\nbounce_classification_file = "{rules}"\n')
    send(r.daemon.port, ["nouser@example.net", "full@example.net"])
    r.wait_for(lambda: r.events("deferred_until"), what="the attempt's end")
    assert [("full@example.net", "rate_limited")] == [(e["recipient"], e["category"]) for e in r.events("deferred")]
    assert [("nouser@example.net", "invalid_recipient")] == [(e["recipient"], e["category"])
                                                             for e in r.events("bounced")]


def mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=60)


def test_a_bad_rule_file_stops_check_and_serve_with_one_line(tmp_path):
    """A rule with a category mtaq does not know: ``mtaq check`` exits 1 and ``mtaq serve`` exits 2 before
    binding, each with one line naming the key, the file, the rule and its key."""
    rules = tmp_path / "bounces.toml"
    rules.write_text("version = 1\n[[rules]]\ncategory = \"full\"\nenhanced = ['5.2.2']\n")
    os.chmod(rules, 0o644)
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    mail_owner_ready(str(spool))
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text(f'spool_dir = "{spool}"\nlisten = "127.0.0.1:{free_port()}"\nadmin_listen = ""\n'
                   f'bounce_classification_file = "{rules}"\n')
    want = f"bounce_classification_file: {rules}: rule 1: category: 'full' is not one of invalid_recipient, "
    out = mtaq("check", "--config", str(cfg), "--no-dns")
    assert (1, 1, "") == (out.returncode, len(out.stdout.splitlines()), out.stderr), out.stdout
    assert want in out.stdout
    out = mtaq("--log-format", "json", "serve", "--config", str(cfg), "--workers", "1")
    assert (2, 1) == (out.returncode, len(out.stderr.splitlines())), out.stderr
    assert out.stderr.startswith(f"mtaq: {want}")
