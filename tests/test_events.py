"""Delivery events pushed to HTTP endpoints from the log (issue 37.1, 37.2, 37.4): the daemon as a subprocess,
a real aiosmtpd next hop (``mtaq sink`` answering 550/452 for some recipients) and a real aiohttp receiver
(mtaq.testing.webhook), over TLS with a trustme CA where it matters. Every test waits for the events it checks."""

from __future__ import annotations

import os
import smtplib
import ssl
import urllib.request
import zlib
from collections import defaultdict

import msgspec
import pytest
import trustme

from mtaq.config import load_config
from mtaq.core.checkpoint import _HDR, CHECKPOINT_MAGIC, Checkpoint, decode_checkpoint, encode_checkpoint
from mtaq.core.errors import ConfigError
from mtaq.core.records import Pos
from mtaq.testing.procs import admin_token, admin_url, read_events, start_daemon, start_sink, wait_for
from mtaq.testing.webhook import Receiver

SINK = ["--rcpt-reply", "^nouser@=550 5.1.1 no such user", "--rcpt-reply", "^full@=452 4.2.2 mailbox full"]
SECRET = "s3cret"


def send(port: int, rcpts: list[str], n: int = 1) -> list[str]:
    out = []
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for _ in range(n):
            s.ehlo("client.test")
            s.mail("sender@example.org")
            for r in rcpts:
                s.rcpt(r)
            _, text = s.data(b"Subject: t\r\n\r\nhello\r\n")
            out.append(text.decode().rsplit(" ", 1)[1])
    return out


def hooks(*entries: str) -> str:
    return "".join(f"[[event_webhooks]]\n{e}\n" for e in entries)


def by_message(events: list[dict]) -> dict[str, list[str]]:
    """queue ID -> its event names in the order received, duplicates (by id) dropped."""
    seen: set[str] = set()
    out: dict[str, list[str]] = defaultdict(list)
    for e in events:
        if e["id"] not in seen:
            seen.add(e["id"])
            out[e["queue_id"]].append(e["event"])
    return out


def metrics(spool: str) -> str:
    req = urllib.request.Request(admin_url(spool) + "/metrics",
                                 headers={"Authorization": f"Bearer {admin_token(spool)}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture
def ca(tmp_path):
    authority = trustme.CA()
    cert = authority.issue_cert("127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    pem = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(pem))
    os.chmod(pem, 0o644)
    return ctx, str(pem)


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(**kw) -> Receiver:
        r = Receiver(**kw).start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.hang = False
        r.stop()


def test_every_outcome_arrives_signed_over_verified_tls(relay_factory, receivers, ca):
    """One message to a delivered, a bounced (550 5.1.1) and a deferred (452 4.2.2) recipient: the receiver
    (https, trustme CA in ``ca_file``) gets received, delivered, bounced, deferred and the DSN's dsn_queued
    with the log events' fields, each POST signed (HMAC-SHA256 of the body under ``secret``)."""
    ctx, pem = ca
    rx = receivers(ssl_context=ctx)
    r = relay_factory(sink_args=SINK, config="retry_intervals_s = [600.0]\n" + hooks(
        f'url = "{rx.url}"\nsecret = "{SECRET}"\nca_file = "{pem}"\nbatch_wait_s = 0.05'))
    [qid] = send(r.daemon.port, ["ok@example.net", "nouser@example.net", "full@example.net"])
    names = {"received", "delivered", "bounced", "deferred", "dsn_queued"}
    wait_for(lambda: names <= {e["event"] for e in rx.events()}, 15, "every event kind")
    evs = {(e["event"], e.get("recipient")): e for e in rx.events()}
    assert ["sender@example.org", ["ok@example.net", "nouser@example.net", "full@example.net"]] == [
        evs[("received", None)]["sender"], evs[("received", None)]["recipients"]]
    d = evs[("delivered", "ok@example.net")]
    log_d = next(e for e in r.events("delivered") if e["queue_id"] == qid)
    assert (qid, log_d["relay"], log_d["dsn"], log_d["reply"], log_d["tls"], 1, 1) == (
        d["queue_id"], d["relay"], d["dsn"], d["reply"], d["tls"], d["attempt"], d["schema"])
    b = evs[("bounced", "nouser@example.net")]
    assert ("5.1.1", 550, "invalid_recipient", "bounced") == (b["dsn"], b["code"], b["category"], b["status"])
    f = evs[("deferred", "full@example.net")]
    assert ("4.2.2", "mailbox_full") == (f["dsn"], f["category"])
    dsn = next(e for e in rx.events() if e["event"] == "dsn_queued")
    assert (qid, ["sender@example.org"]) == (dsn["dsn_for"], dsn["recipients"])
    assert [True] * len(rx.ok_posts()) == [p.signed_by(SECRET) for p in rx.ok_posts()]
    assert [False] * len(rx.ok_posts()) == [p.signed_by("other") for p in rx.ok_posts()]


def test_an_unverified_certificate_is_retried_not_sent(relay_factory, receivers, ca):
    """https without the CA (the system store does not know trustme's): nothing is acknowledged, the batch
    is retried (``event_batch_failed``), never posted in the clear."""
    ctx, _pem = ca
    rx = receivers(ssl_context=ctx)
    r = relay_factory(config=hooks(f'url = "{rx.url}"\nbatch_wait_s = 0\nretry_min_s = 0.1\nretry_max_s = 0.2'))
    send(r.daemon.port, ["ok@example.net"])
    r.wait_for(lambda: len(r.events("event_batch_failed")) >= 2, what="two failed tries")
    assert ([], True) == (rx.posts, "CERTIFICATE_VERIFY_FAILED" in r.events("event_batch_failed")[0]["error"])


def test_kill9_while_posting_loses_no_event(relay_factory, receivers):
    """The daemon is killed (-9) while the receiver still has batches to take (it answers slowly), and
    started again: every message's received and delivered events arrive at least once, none missing."""
    rx = receivers(delay_s=0.1)  # slow: the backlog is still being posted at the kill
    rx.statuses = [503] * 2
    r = relay_factory(config=hooks(f'url = "{rx.url}"\nbatch_max = 4\nbatch_wait_s = 0.01\nretry_min_s = 0.2'))
    ids = send(r.daemon.port, ["a@example.net", "b@example.net"], n=12)
    r.wait_for(lambda: len(r.events("delivered")) == 24, what="24 deliveries")
    wait_for(lambda: rx.ok_posts(), 10, "a first batch acknowledged")
    r.daemon.kill9()
    assert len({e["id"] for e in rx.events()}) < 36  # killed while posting: not everything was acknowledged
    r.start(port=r.daemon.port)
    ids += send(r.daemon.port, ["a@example.net"], n=5)
    want = {q: ["received", "delivered"] for q in ids}
    for q in ids[:12]:
        want[q] = ["received", "delivered", "delivered"]
    wait_for(lambda: all(sorted(set(by_message(rx.events()).get(q, []))) == sorted(set(w)) for q, w in want.items()),
             15, "every event after the restart")
    got = by_message(rx.events())
    assert {q: sorted(w) for q, w in want.items()} == {q: sorted(got[q]) for q in ids}


def test_a_receiver_down_gets_the_backlog_in_order_per_message(relay_factory, receivers):
    """The receiver is down (connection refused) while mail is delivered; once it is up it gets every event,
    for each message received before delivered; the failed tries count as retried batches in /metrics."""
    rx = receivers()
    url = rx.url
    rx.stop()
    r = relay_factory(config=hooks(f'url = "{url}"\nbatch_max = 5\nbatch_wait_s = 0.01\nretry_min_s = 0.1\n'
                                   'retry_max_s = 0.3'))
    ids = send(r.daemon.port, ["a@example.net"], n=12)
    r.wait_for(lambda: len(r.events("delivered")) == 12, what="12 deliveries")
    r.wait_for(lambda: len(r.events("event_batch_failed")) >= 2, what="failed tries")
    lag = [line for line in metrics(r.spool).splitlines()
           if line.startswith(f'mtaq_event_exporter_lag_records{{endpoint="{url}"}}')]
    assert (1, True) == (len(lag), float(lag[0].rsplit(" ", 1)[1]) >= 24)  # 12 messages: 2 records or more each
    rx.start()
    wait_for(lambda: all(by_message(rx.events()).get(q) == ["received", "delivered"] for q in ids), 15,
             "the backlog")
    assert {q: ["received", "delivered"] for q in ids} == {q: by_message(rx.events())[q] for q in ids}
    caught_up = f'mtaq_event_exporter_lag_records{{endpoint="{url}"}} 0.0'
    text = wait_for(lambda: next((t for t in [metrics(r.spool)] if caught_up in t), None), 10, "lag 0")
    retried = next(line for line in text.splitlines()
                   if line.startswith(f'mtaq_event_batches_total{{endpoint="{url}",result="retried"}}'))
    assert float(retried.rsplit(" ", 1)[1]) >= 2


def test_a_hanging_receiver_stops_neither_mail_nor_another_endpoint(relay_factory, receivers):
    """One endpoint never answers (hangs); the other is fine: every message still gets its 250 and is
    delivered, and the second endpoint gets every event."""
    stuck, fine = receivers(hang=True), receivers()
    r = relay_factory(config=hooks(f'url = "{stuck.url}"\ntimeout_s = 300\nbatch_wait_s = 0',
                                   f'url = "{fine.url}"\nbatch_wait_s = 0.01'))
    ids = send(r.daemon.port, ["a@example.net"], n=10)
    r.wait_for(lambda: len(r.events("delivered")) == 10, what="10 deliveries")
    wait_for(lambda: all(by_message(fine.events()).get(q) == ["received", "delivered"] for q in ids), 15,
             "the fine endpoint's events")
    assert ([], 10) == (stuck.posts, len(ids))


def test_a_4xx_skips_the_batch_and_counts_it(relay_factory, receivers):
    """400 to the first batch: it is logged (``event_batch_rejected``) and not sent again; later events
    arrive; /metrics counts one failed batch."""
    rx = receivers()
    rx.statuses = [400]
    r = relay_factory(config=hooks(f'url = "{rx.url}"\nbatch_wait_s = 0.2\nevents = ["received"]'))
    [first] = send(r.daemon.port, ["a@example.net"])
    r.wait_for(lambda: r.events("event_batch_rejected"), what="the rejection")
    [second] = send(r.daemon.port, ["a@example.net"])
    wait_for(lambda: rx.events(), 10, "the second event")
    assert [(second, "received")] == [(e["queue_id"], e["event"]) for e in rx.events()]
    assert (400, 2) == (r.events("event_batch_rejected")[0]["status"], len(rx.posts))
    assert f'mtaq_event_batches_total{{endpoint="{rx.url}",result="failed"}} 1.0' in metrics(r.spool)
    assert first != second


def test_admin_actions_are_events(tmp_path, receivers):
    """hold, release and delete through the admin API give held, released and deleted events."""
    rx = receivers()
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text('relayhost = "[127.0.0.1]:9"\nretry_intervals_s = [600.0]\n' + hooks(
        f'url = "{rx.url}"\nbatch_wait_s = 0.01'))
    d = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "daemon.log"), config=str(cfg))
    try:
        [qid] = send(d.port, ["a@example.net"])
        wait_for(lambda: [e for e in read_events(d.log_path) if e.get("event") == "deferred_until"], 15, "deferral")
        def act(action: str) -> None:
            req = urllib.request.Request(f"{admin_url(str(tmp_path / 'spool'))}/mails/actions/{action}",
                                         method="POST", data=b'{"ids": ["%s"]}' % qid.encode(), headers={
                                             "Authorization": f"Bearer {admin_token(str(tmp_path / 'spool'))}",
                                             "Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()

        def deferrals() -> int:
            return len([e for e in read_events(d.log_path) if e.get("event") == "deferred_until"])

        act("hold")
        act("release")  # due at once: tried again (refused again), then held and deleted
        wait_for(lambda: deferrals() == 2, 15, "the second deferral")
        act("hold")
        act("delete")
        wait_for(lambda: "deleted" in by_message(rx.events()).get(qid, []), 15, "deleted")
        got = [n for n in by_message(rx.events())[qid] if n in ("held", "released", "deleted")]
        assert ["held", "released", "held", "deleted"] == got
    finally:
        d.kill9()


def test_config_errors_are_one_line_naming_the_entry(tmp_path):
    """A bad event name, a URL that is not http(s), a URL twice, retry_min_s above retry_max_s."""
    cases = [
        ('url = "http://h/e"\nevents = ["sent"]', "event_webhooks[0].events[0]: Invalid enum value 'sent'"),
        ('url = "ftp://h/e"', "event_webhooks[0].url: expected http://HOST[:PORT]/PATH or https://..."),
        ('url = "http://h/e"\nbatch_max = 0', "event_webhooks[0].batch_max: Expected `int` >= 1"),
        ('url = "http://h/e"\nretry_min_s = 9.0\nretry_max_s = 1.0', "event_webhooks[0].retry_min_s: 9.0 is more"),
    ]
    for entry, want in cases:
        path = tmp_path / "c.toml"
        path.write_text(hooks(entry))
        with pytest.raises(ConfigError) as exc:
            load_config(str(path), {})
        assert (want in str(exc.value), 1) == (True, len(str(exc.value).splitlines())), str(exc.value)
    path.write_text(hooks('url = "http://h/e"', 'url = "http://h/e"'))
    with pytest.raises(ConfigError, match=r"event_webhooks\[1\].url: http://h/e is listed twice"):
        load_config(str(path), {})


def test_an_older_checkpoint_without_exporter_fields_is_read():
    """A checkpoint written before the exporter fields decodes with none of them; a new one round-trips."""

    class Old(msgspec.Struct, array_like=True):
        head: Pos
        suffix: Pos
        runners: tuple[Pos, ...]
        garbage: tuple[tuple[Pos, ...], ...]
        written_ts: float
        parked: tuple[Pos, ...] = ()
        counts: tuple[tuple[str, int], ...] = ()
        pins: tuple[tuple[Pos, Pos], ...] = ()

    payload = msgspec.msgpack.encode(Old(Pos(1, 16), Pos(1, 16), (Pos(1, 16),), ((),), 1.0))
    cp = decode_checkpoint(_HDR.pack(CHECKPOINT_MAGIC, len(payload), zlib.crc32(payload)) + payload)
    assert ((), None) == (cp.exporters, cp.exporter_pin)
    new = Checkpoint(Pos(1, 16), Pos(1, 16), (), (), 1.0, exporters=(("http://h/e", Pos(1, 16), Pos(2, 16)),),
                     exporter_pin=Pos(1, 20))
    assert new == decode_checkpoint(encode_checkpoint(new))


def send_big(port: int, n: int, size: int) -> list[str]:
    body = b"Subject: big\r\n\r\n" + (b"x" * 998 + b"\r\n") * (size // 1000)
    out = []
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for _ in range(n):
            s.ehlo("client.test")
            s.mail("sender@example.org")
            s.rcpt("a@example.net")
            _, text = s.data(body)
            out.append(text.decode().rsplit(" ", 1)[1])
    return out


SMALL_LOG = "segment_bytes_max = 65536\ncheckpoint_interval_s = 0.2\n"


def test_segments_are_kept_until_the_endpoint_has_the_events(relay_factory, receivers):
    """With the receiver down, delivered mail's segments are not reclaimed (the endpoint has not read them);
    once it is up it gets the events of the first message too, and the segments are reclaimed after."""
    rx = receivers()
    url = rx.url
    rx.stop()
    r = relay_factory(config=SMALL_LOG + hooks(f'url = "{url}"\nbatch_wait_s = 0.01\nretry_min_s = 0.1\n'
                                               'retry_max_s = 0.2'))
    ids = send_big(r.daemon.port, 12, 20_000)
    r.wait_for(lambda: len(r.events("delivered")) == 12, what="12 deliveries")
    r.wait_for(lambda: len(r.events("event_batch_failed")) >= 3, what="a few failed tries (checkpoints between)")
    assert [] == r.events("segments_reclaimed")
    rx.start()
    wait_for(lambda: all(by_message(rx.events()).get(q) == ["received", "delivered"] for q in ids), 15, "the backlog")
    r.wait_for(lambda: r.events("segments_reclaimed"), what="reclamation once acknowledged")


def test_an_endpoint_too_far_behind_skips_ahead(relay_factory, receivers):
    """More than ``event_backlog_max_bytes`` of log behind (the receiver down): the endpoint skips to the end
    (``event_backlog_skipped``, counted in /metrics), segments are reclaimed, and later events still come."""
    rx = receivers()
    url = rx.url
    rx.stop()
    r = relay_factory(config=SMALL_LOG + "event_backlog_max_bytes = 1048576\n" + hooks(
        f'url = "{url}"\nbatch_wait_s = 0.01\nretry_min_s = 0.1\nretry_max_s = 0.2'))
    early = send_big(r.daemon.port, 24, 60_000)
    [skip] = r.wait_for(lambda: r.events("event_backlog_skipped"), what="the skip")
    r.wait_for(lambda: r.events("segments_reclaimed"), what="reclamation")
    rx.start()
    [late] = send(r.daemon.port, ["a@example.net"])
    wait_for(lambda: by_message(rx.events()).get(late) == ["received", "delivered"], 15, "the later events")
    assert (url, True) == (skip["endpoint"], skip["bytes"] > 1048576)
    assert f'mtaq_event_backlog_skips_total{{endpoint="{url}"}} 1.0' in metrics(r.spool)
    assert set() == set(by_message(rx.events())) & set(early[:10])


def test_expired_event(relay_factory, receivers):
    """A recipient deferred past ``maximal_queue_lifetime_s`` gives ``expired`` (4.4.7), its last reply kept."""
    rx = receivers()
    r = relay_factory(sink_args=SINK, config="maximal_queue_lifetime_s = 1.0\nretry_intervals_s = [0.6]\n" + hooks(
        f'url = "{rx.url}"\nbatch_wait_s = 0.01'))
    [qid] = send(r.daemon.port, ["full@example.net"])
    wait_for(lambda: "expired" in by_message(rx.events()).get(qid, []), 15, "expired")
    [exp] = [e for e in rx.events() if e["event"] == "expired"]
    assert ("full@example.net", "4.4.7", "message_expired", "452 4.2.2 mailbox full") == (
        exp["recipient"], exp["dsn"], exp["category"], exp["reply"])


def test_outcome_unknown_event(tmp_path, receivers):
    """A kill -9 after the next hop's 250 and before the DELIVERY record gives ``outcome_unknown`` after the
    restart, then the retry's ``delivered``."""
    rx = receivers()
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text(hooks(f'url = "{rx.url}"\nbatch_wait_s = 0.01'))
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    spool, log = str(tmp_path / "spool"), str(tmp_path / "daemon.log")
    d = start_daemon(spool, sink.port, log, config=str(cfg), env={"MTAQ_KILL_POINT": "delivery.after_remote_reply"})
    try:
        [q2] = send(d.port, ["ok@example.net"])
        wait_for(lambda: not d.alive(), 15, "the kill point")
        d = start_daemon(spool, sink.port, log, config=str(cfg), port=d.port)
        wait_for(lambda: "delivered" in by_message(rx.events()).get(q2, []), 15, "the retry")
        assert ["received", "outcome_unknown", "delivered"] == by_message(rx.events())[q2]
    finally:
        d.kill9()
        sink.kill9()


def test_a_retry_whose_envelope_lies_behind_the_endpoint_keeps_it(relay_factory, receivers):
    """The endpoint has acknowledged past a deferred message's replacement envelope (two segments on), then
    goes down while the retry starts, delivers and ends, checkpoints reclaim what they may, and the daemon is
    killed (-9) and started again: the START it has yet to read names that envelope, whose segment is kept
    (``exporter_pin``, across the restart), so the delivered event still names the recipient."""
    rx = receivers()
    r = relay_factory(sink_args=["--defer-rcpt", "^defer-", "--defer-count", "1"],
                      config=SMALL_LOG + "retry_intervals_s = [6.0]\n" + hooks(
                          f'url = "{rx.url}"\nbatch_wait_s = 0.01\nretry_min_s = 0.1\nretry_max_s = 0.2'))
    [qid] = send(r.daemon.port, ["defer-x@example.net"])
    wait_for(lambda: "deferred" in by_message(rx.events()).get(qid, []), 15, "the deferral")
    fillers = send_big(r.daemon.port, 4, 60_000)  # the log moves on by several segments
    wait_for(lambda: all("delivered" in by_message(rx.events()).get(q, []) for q in fillers), 15, "the fillers")
    rx.stop()
    assert [] == [e for e in r.events("delivered") if e["queue_id"] == qid]  # the retry comes after the stop
    r.wait_for(lambda: [e for e in r.events("delivered") if e["queue_id"] == qid], what="the retry's delivery")
    r.wait_for(lambda: len(r.events("event_batch_failed")) >= 3, what="a few failed tries (checkpoints between)")
    r.restart()  # kill -9: nothing of the log is left in memory
    rx.start()
    wait_for(lambda: "delivered" in by_message(rx.events()).get(qid, []), 15, "the retry's event")
    [ev] = [e for e in rx.events() if e["queue_id"] == qid and e["event"] == "delivered"]
    assert ("defer-x@example.net", 2) == (ev["recipient"], ev.get("attempt"))
