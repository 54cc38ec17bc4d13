"""Routing end to end: the daemon as a subprocess, real sinks on several loopback addresses, MX records from DNS.

DNS answers come from :class:`mtaq.testing.dnsserver.ZoneServer`, a real DNS server on 127.0.0.1 that stands
in for the internet's DNS (no internet here); the daemon's resolver is pointed at it with ``dns_nameservers``.
MX records carry no port, so every MX host listens on the same ``smtp_port`` at its own loopback address
(127.0.0.2, 127.0.0.3, ... all reach ``lo`` on Linux).
"""

from __future__ import annotations

import email.policy
import json
import smtplib
import subprocess
import sys
import time
from email.message import EmailMessage

import pytest

from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.procs import Proc, free_port_on, maildir_message_ids, read_events, start_daemon, start_sink

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


class Mesh:
    """A DNS server, sinks on loopback addresses sharing one port, and a daemon routing by MX."""

    def __init__(self, tmp, zone: str, config: str = "", **zone_kw) -> None:
        self.tmp = tmp
        self.port = free_port_on(HOSTS)
        self.dns = ZoneServer(zone.format(port=self.port), **zone_kw).start()
        self.sinks: dict[str, Proc] = {}
        self.spool = str(tmp / "spool")
        cfg = tmp / "mtaq.toml"
        cfg.write_text(
            'relayhost = ""\n'
            f'dns_nameservers = ["127.0.0.1:{self.dns.port}"]\n'
            "dns_timeout_s = 2\n"
            f"smtp_port = {self.port}\n"
            "retry_intervals_s = [600]\n" + config.format(port=self.port)
        )
        self.config = str(cfg)
        self.daemon: Proc | None = None

    def sink(self, host: str, *extra: str) -> Proc:
        p = start_sink(self.maildir(host), str(self.tmp / f"sink-{host}.log"), port=self.port, host=host, extra=extra)
        self.sinks[host] = p
        return p

    def maildir(self, host: str) -> str:
        return str(self.tmp / f"maildir-{host}")

    def start(self) -> Proc:
        self.daemon = start_daemon(self.spool, None, str(self.tmp / "daemon.log"), config=self.config)
        return self.daemon

    def send(self, rcpts: list[str], mid: str, sender: str = "sender@origin.test") -> str:
        m = EmailMessage()
        m["From"], m["To"], m["Subject"], m["Message-ID"] = sender, ", ".join(rcpts), "routing", mid
        m.set_content("routed\n")
        assert self.daemon is not None
        with smtplib.SMTP("127.0.0.1", self.daemon.port, timeout=30) as s:
            s.ehlo("client.test")
            s.mail(sender)
            for r in rcpts:
                s.rcpt(r)
            code, text = s.data(m.as_bytes(policy=email.policy.SMTP))
        assert 250 == code
        return text.decode().rsplit(" ", 1)[1]

    def events(self, name: str) -> list[dict]:
        assert self.daemon is not None
        return [e for e in read_events(self.daemon.log_path) if e.get("event") == name]

    def wait_for(self, pred, what: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def finals(self, queue_id: str, n: int) -> dict[str, tuple[str, str, str]]:
        """recipient -> (event, dsn, relay) once ``n`` final events for ``queue_id`` are logged."""

        def got():
            evs = [e for name in ("delivered", "deferred", "bounced", "discarded") for e in self.events(name)
                   if e["queue_id"] == queue_id]
            return len(evs) >= n and evs

        return {e["recipient"]: (e["event"], e["dsn"], e["relay"]) for e in self.wait_for(got, f"{n} outcomes")}

    def records(self, kind: str, queue_id: str) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "mtaq.cli", "log", "dump", "--json", "--spool", self.spool],
                             capture_output=True, text=True, check=True)
        recs = [json.loads(line) for line in out.stdout.splitlines()]
        return [r for r in recs if r.get("type") == kind and r.get("queue_id") == queue_id]

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.kill9()
        for p in self.sinks.values():
            p.kill9()
        self.dns.stop()


@pytest.fixture
def mesh(tmp_path):
    made: list[Mesh] = []

    def make(zone: str, config: str = "", **kw) -> Mesh:
        m = Mesh(tmp_path, zone, config, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


ORIGIN = """
origin      IN MX 10 mx.origin
mx.origin   IN A 127.0.0.5
"""


def test_message_goes_to_the_best_mx_that_takes_it_after_failover(mesh):
    """MX 10 has nothing listening, MX 20 answers 4xx, MX 30 takes it: tried in that order, delivered once,
    and the delivered event names the relay as host[address]:port."""
    m = mesh(ORIGIN + """
example     IN MX 10 mx1.example
example     IN MX 20 mx2.example
example     IN MX 30 mx3.example
mx1.example IN A 127.0.0.3
mx2.example IN A 127.0.0.2
mx3.example IN A 127.0.0.4
""")
    m.sink("127.0.0.2", "--defer-rcpt", ".")
    m.sink("127.0.0.4")
    m.start()
    qid = m.send(["rcpt@example.test"], "<failover@mtaq.test>")
    assert {"rcpt@example.test": ("delivered", "2.0.0", f"mx3.example.test[127.0.0.4]:{m.port}")} == m.finals(qid, 1)
    assert {"<failover@mtaq.test>": 1} == dict(maildir_message_ids(m.maildir("127.0.0.4")))
    assert {} == dict(maildir_message_ids(m.maildir("127.0.0.2")))
    hops = [(e["relay"], e["dsn"]) for e in m.events("hop_failed") if e["queue_id"] == qid]
    assert [(f"mx1.example.test[127.0.0.3]:{m.port}", "4.4.1"), (f"mx2.example.test[127.0.0.2]:{m.port}", "4.2.0")] == hops


def test_when_every_mx_fails_the_recipient_is_deferred_with_the_last_reason(mesh):
    m = mesh(ORIGIN + """
example     IN MX 10 mx1.example
example     IN MX 20 mx2.example
mx1.example IN A 127.0.0.3
mx2.example IN A 127.0.0.2
""")
    m.sink("127.0.0.2", "--defer-rcpt", ".")
    m.start()
    qid = m.send(["rcpt@example.test"], "<alldown@mtaq.test>")
    assert {"rcpt@example.test": ("deferred", "4.2.0", f"mx2.example.test[127.0.0.2]:{m.port}")} == m.finals(qid, 1)


def test_recipients_of_different_domains_go_to_their_own_mx_in_one_attempt(mesh):
    """One message, two domains with different MX hosts: each host gets only its own recipient, and the log
    has a single START for the attempt and one DELIVERY record per relay."""
    m = mesh(ORIGIN + """
one         IN MX 10 mx.one
mx.one      IN A 127.0.0.2
two         IN MX 10 mx.two
mx.two      IN A 127.0.0.4
""")
    m.sink("127.0.0.2")
    m.sink("127.0.0.4")
    m.start()
    qid = m.send(["a@one.test", "b@two.test", "c@one.test"], "<split@mtaq.test>")
    assert {
        "a@one.test": ("delivered", "2.0.0", f"mx.one.test[127.0.0.2]:{m.port}"),
        "c@one.test": ("delivered", "2.0.0", f"mx.one.test[127.0.0.2]:{m.port}"),
        "b@two.test": ("delivered", "2.0.0", f"mx.two.test[127.0.0.4]:{m.port}"),
    } == m.finals(qid, 3)
    assert {"<split@mtaq.test>": 2} == dict(maildir_message_ids(m.maildir("127.0.0.2")))
    assert {"<split@mtaq.test>": 1} == dict(maildir_message_ids(m.maildir("127.0.0.4")))
    assert 1 == len(m.records("START", qid))
    assert {f"mx.one.test[127.0.0.2]:{m.port}", f"mx.two.test[127.0.0.4]:{m.port}"} == {
        r["relay"] for r in m.records("DELIVERY", qid)
    }


def test_dns_answers_decide_each_recipient_implicit_mx_null_mx_nxdomain_servfail(mesh):
    """No MX -> the domain's A record is used; null MX bounces 5.1.10; NXDOMAIN bounces 5.1.2; SERVFAIL defers
    4.4.3 — each recipient of the same message on its own."""
    m = mesh(ORIGIN + """
nomx        IN A 127.0.0.2
null        IN MX 0 .
""", servfail=["broken"])
    m.sink("127.0.0.2")
    m.sink("127.0.0.5")  # the sender's MX, for the bounce
    m.start()
    qid = m.send(["a@nomx.test", "b@null.test", "c@nx.test", "d@broken.test"], "<dns@mtaq.test>")
    assert {
        "a@nomx.test": ("delivered", "2.0.0", f"nomx.test[127.0.0.2]:{m.port}"),
        "b@null.test": ("bounced", "5.1.10", "none"),
        "c@nx.test": ("bounced", "5.1.2", "none"),
        "d@broken.test": ("deferred", "4.4.3", "none"),
    } == m.finals(qid, 4)
    # The DSN for the two bounces went to the sender's domain by its MX.
    m.wait_for(lambda: len(maildir_message_ids(m.maildir("127.0.0.5"))) == 1, what="DSN at the sender's MX")


def test_transport_map_overrides_mx_discards_and_refuses(mesh):
    """transport_map: a bracketed next hop beats the domain's MX; ``.parent`` entries match subdomains and
    discard (delivered, logged as discarded, nothing sent); ``error:5.1.1 …`` bounces with that status."""
    m = mesh(ORIGIN + """
special     IN MX 10 mx.special
mx.special  IN A 127.0.0.2
""", config="""
[transport_map]
"special.test" = "smtp:[127.0.0.4]:{port}"
".lists.test" = "discard"
"closed.test" = "error:5.1.1 this domain takes no mail"
""")
    m.sink("127.0.0.2")
    m.sink("127.0.0.4")
    m.sink("127.0.0.5")
    m.start()
    qid = m.send(["a@special.test", "b@x.lists.test", "c@closed.test"], "<transport@mtaq.test>")
    assert {
        "a@special.test": ("delivered", "2.0.0", f"127.0.0.4[127.0.0.4]:{m.port}"),
        "b@x.lists.test": ("discarded", "2.0.0", "none"),
        "c@closed.test": ("bounced", "5.1.1", "none"),
    } == m.finals(qid, 3)
    [bounce] = m.events("bounced")
    assert "550 5.1.1 this domain takes no mail" == bounce["reply"]
    assert {"<transport@mtaq.test>": 1} == dict(maildir_message_ids(m.maildir("127.0.0.4")))
    assert {} == dict(maildir_message_ids(m.maildir("127.0.0.2")))


def test_internationalised_recipient_bounces_5_6_7_at_an_mx_without_smtputf8(mesh):
    """RFC 6531: a UTF-8 address goes only to a next hop that offers SMTPUTF8; the ASCII recipient of the same
    message is delivered; the UTF-8 one at a domain whose MX offers SMTPUTF8 is delivered too."""
    m = mesh(ORIGIN + """
old         IN MX 10 mx.old
mx.old      IN A 127.0.0.2
new         IN MX 10 mx.new
mx.new      IN A 127.0.0.4
""")
    m.sink("127.0.0.2", "--no-smtputf8")
    m.sink("127.0.0.4")
    m.sink("127.0.0.5")
    m.start()
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"], msg["Message-ID"] = "s@origin.test", "x@old.test", "utf8", "<u8@mtaq.test>"
    msg.set_content("hi\n")
    assert m.daemon is not None
    with smtplib.SMTP("127.0.0.1", m.daemon.port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail("s@origin.test", ["SMTPUTF8"])
        for r in ("jürgen@old.test", "bob@old.test", "jürgen@new.test"):
            s.rcpt(r)
        assert 250 == s.data(msg.as_bytes(policy=email.policy.SMTP))[0]
    qid = m.events("queued")[0]["queue_id"]
    finals = m.finals(qid, 3)
    assert {
        "jürgen@old.test": ("bounced", "5.6.7"),
        "bob@old.test": ("delivered", "2.0.0"),
        "jürgen@new.test": ("delivered", "2.0.0"),
    } == {k: v[:2] for k, v in finals.items()}
