"""Prometheus /metrics of the real daemon (subprocess, real SMTP, real sink): values move as mail flows;
the per-daemon registry and the bounded domain label."""

from __future__ import annotations

import smtplib
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mtaq.admin.metrics import Metrics
from mtaq.testing.procs import admin_token, admin_url


def scrape(url: str, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape (with the bearer token, as a Prometheus
    ``authorization: credentials_file`` would send it), parsed by prometheus_client's own parser."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def send(port: int, rcpts: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("alice@example.org", rcpts, b"Subject: m\r\n\r\nbody\r\n")


def test_metrics_follow_the_mail_through_the_queue_and_survive_a_restart(relay_factory):
    """After two messages (one recipient delivered, one deferred): accepted 2, deliveries by outcome, the
    queue gauge shows 1 deferred, fsyncs and commit latency are counted, delivery latency is labelled
    by the recipient domain; recovery seconds are reported, also after kill -9 and a restart."""
    r = relay_factory(sink_args=["--defer-rcpt", "^slow"], config="retry_intervals_s = [3600.0]\n")
    url = admin_url(r.spool)
    before = scrape(url, admin_token(r.spool))
    assert 0.0 == before[("mtaq_queue_messages", (("state", "deferred"),))]
    assert 0.0 == before[("mtaq_messages_accepted_total", ())]
    assert 1.0 == before[("mtaq_ready", ())]
    send(r.daemon.port, ["bob@example.com"])
    send(r.daemon.port, ["slow@example.net"])
    r.wait_for(lambda: r.events("deferred_until") and r.events("delivered"), what="one delivered, one deferred")
    m = scrape(url, admin_token(r.spool))
    assert 2.0 == m[("mtaq_messages_accepted_total", ())]
    assert (1.0, 1.0, 0.0) == tuple(m[("mtaq_deliveries_total", (("outcome", o),))] for o in ("delivered", "deferred", "bounced"))
    assert {"incoming": 0.0, "active": 0.0, "deferred": 1.0, "delayed": 0.0, "held": 0.0} == {
        s: m[("mtaq_queue_messages", (("state", s),))] for s in ("incoming", "active", "deferred", "delayed", "held")}
    assert m[("mtaq_fsyncs_total", ())] > before[("mtaq_fsyncs_total", ())]
    assert m[("mtaq_log_records_total", ())] > before[("mtaq_log_records_total", ())]
    assert m[("mtaq_log_records_per_fsync", ())] > 0
    assert m[("mtaq_commit_latency_seconds_count", ())] >= 2  # at least the two 250s waited for an fsync
    assert m[("mtaq_fsync_round_seconds_count", ())] == m[("mtaq_commit_rounds_total", ())]
    assert 1.0 == m[("mtaq_delivery_latency_seconds_count", (("domain", "example.com"),))]
    assert 1.0 == m[("mtaq_delivery_latency_seconds_bucket", (("domain", "example.com"), ("le", "+Inf")))]
    assert ("mtaq_delivery_latency_seconds_count", (("domain", "example.net"),)) not in m  # deferred: no delivery
    assert m[("mtaq_recovery_seconds", ())] >= 0
    r.restart()
    after = scrape(admin_url(r.spool), admin_token(r.spool))
    assert (1.0, 0.0) == (after[("mtaq_queue_messages", (("state", "deferred"),))], after[("mtaq_messages_accepted_total", ())])
    assert after[("mtaq_recovery_seconds", ())] >= 0


def test_admin_actions_are_counted(relay_factory):
    """Messages held or deleted through the API show up in mtaq_admin_actions_total{action}."""
    import json

    r = relay_factory(sink_args=["--defer-rcpt", "^slow"], config="retry_intervals_s = [3600.0]\n")
    send(r.daemon.port, ["slow1@example.net"])
    send(r.daemon.port, ["slow2@example.net"])
    r.wait_for(lambda: len(r.events("deferred_until")) >= 2, what="2 deferred")
    url = admin_url(r.spool)
    req = urllib.request.Request(url + "/mails/actions/hold", data=json.dumps({"all": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {admin_token(r.spool)}"})
    urllib.request.urlopen(req, timeout=30).read()
    m = scrape(url, admin_token(r.spool))
    assert (2.0, 2.0) == (m[("mtaq_admin_actions_total", (("action", "hold"),))],
                          m[("mtaq_queue_messages", (("state", "held"),))])


def test_delivery_latency_domains_are_bounded_and_each_daemon_has_its_own_registry():
    """With metrics_domains_max = 2, a third domain is counted under domain="other"; two Metrics objects in
    one process do not share (or clash over) their series."""
    a, b = Metrics({"delivered": 0}, domains_max=2), Metrics({"delivered": 5}, domains_max=2)
    for addr, s in (("x@one.example", 0.05), ("y@TWO.example", 2.0), ("z@three.example", 7.0), ("w@four.example", 0.2)):
        a.delivered(addr, s)
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(a.exposition().decode()) for s in fam.samples}
    counts = {dict(k[1])["domain"]: v for k, v in m.items() if k[0] == "mtaq_delivery_latency_seconds_count"}
    assert {"one.example": 1.0, "two.example": 1.0, "other": 2.0} == counts
    assert 1.0 == m[("mtaq_delivery_latency_seconds_bucket", (("domain", "other"), ("le", "5.0")))]
    assert 7.2 == round(m[("mtaq_delivery_latency_seconds_sum", (("domain", "other"),))], 6)
    text_b = b.exposition().decode()
    assert "one.example" not in text_b
    assert 'mtaq_deliveries_total{outcome="delivered"} 5.0' in text_b
