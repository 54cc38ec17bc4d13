"""Recipient verification by probing the next hop (issue 35.2; Postfix ``reject_unverified_recipient``).

A real daemon relays to an aiosmtpd next hop (in this process, on loopback) that refuses unknown users at
RCPT; SMTP clients "on the internet" bind to 127.0.0.2 (outside ``mynetworks``). The next hop counts what it
was sent: probes are the transactions from the null sender (``address_verify_sender`` default).
"""

from __future__ import annotations

import asyncio
import json
import os
import smtplib
import threading
import time

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP

from mtaq.config import Config, load_config
from mtaq.core.errors import ConfigError
from mtaq.delivery.routing import Router
from mtaq.delivery.verify import Verifier, VerifySettings, make_prober
from mtaq.edge.policy import EdgePolicy
from mtaq.storage.sharedmap import SharedMap
from mtaq.testing.procs import free_port, start_daemon, wait_for

OUTSIDE = "127.0.0.2"
KNOWN = {"alice@example.org"}
USER_UNKNOWN = "550 5.1.1 <{}>: Recipient address rejected: User unknown in virtual mailbox table"


class NextHop:
    """aiosmtpd handler: RCPT of a KNOWN address 250, else 550 5.1.1; records every transaction."""

    def __init__(self, rcpt_delay_s: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.rcpts: list[tuple[str, str]] = []  # (MAIL FROM, RCPT TO) of every RCPT
        self.data_commands: list[str] = []  # MAIL FROM of every DATA command
        self.messages: list[tuple[str, list[str]]] = []  # (MAIL FROM, recipients) of every message stored
        self.rcpt_delay_s = rcpt_delay_s

    async def handle_RCPT(self, server, session, envelope, address, options):
        if self.rcpt_delay_s:
            await asyncio.sleep(self.rcpt_delay_s)
        with self.lock:
            self.rcpts.append((envelope.mail_from, address))
        if address.lower() not in KNOWN:
            return USER_UNKNOWN.format(address)
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server, session, envelope):
        with self.lock:
            self.messages.append((envelope.mail_from, list(envelope.rcpt_tos)))
        return "250 2.0.0 Ok: queued"

    def probes(self) -> dict[str, int]:
        """RCPTs sent in null-sender transactions (the probes), by address."""
        out: dict[str, int] = {}
        with self.lock:
            for sender, rcpt in self.rcpts:
                if sender in ("", "<>"):
                    out[rcpt] = out.get(rcpt, 0) + 1
        return out


class _CountingSMTP(SMTP):
    async def smtp_DATA(self, arg):
        with self.event_handler.lock:
            self.event_handler.data_commands.append(self.envelope.mail_from)
        await super().smtp_DATA(arg)


class _HopController(Controller):
    def factory(self):
        return _CountingSMTP(self.handler, **self.SMTP_kwargs)


def start_hop(rcpt_delay_s: float = 0.0) -> tuple[NextHop, Controller]:
    hop = NextHop(rcpt_delay_s)
    ctl = _HopController(hop, hostname="127.0.0.1", port=free_port())
    ctl.start()
    return hop, ctl


def config(tmp_path, **extra: object) -> str:
    conf = tmp_path / "mtaq.toml"
    lines = ['mynetworks = ["127.0.0.1/32"]', 'relay_domains = ["example.org"]', "reject_unverified_recipient = true"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    conf.write_text("\n".join(lines) + "\n")
    return str(conf)


def rcpts_from_outside(port: int, *addresses: str) -> list[tuple[int, bytes]]:
    """One session from outside mynetworks: MAIL, then RCPT of each address; the replies (then RSET, QUIT)."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30, source_address=(OUTSIDE, 0)) as s:
        s.ehlo("outside.test")
        assert 250 == s.mail("someone@elsewhere.test")[0]
        return [s.rcpt(a) for a in addresses]


def verified_events(log_path: str) -> list[dict]:
    out = []
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == "address_verified":
                out.append(ev)
    return out


def test_unknown_recipient_is_refused_at_rcpt_after_a_probe_and_the_known_one_is_delivered(tmp_path):
    """With reject_unverified_recipient, a client outside mynetworks gets 550 5.1.1 at RCPT for a recipient
    of a relay domain that the next hop refuses (with the next hop's words, as Postfix: "undeliverable
    address: host ... said: 550 5.1.1 ..."), and 250 for one it takes; the message goes to the known one
    only. Each address cost one probe (MAIL FROM:<>, RCPT, no DATA); asking again, in the same session or
    another, is answered from the cache. A mynetworks client is not verified. Before, every local part was
    accepted and refused later by the next hop: a bounce to a forged sender (backscatter)."""
    hop, ctl = start_hop()
    d = start_daemon(str(tmp_path / "spool"), ctl.port, str(tmp_path / "d.log"), config=config(tmp_path))
    try:
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30, source_address=(OUTSIDE, 0)) as s:
            s.ehlo("outside.test")
            assert 250 == s.mail("someone@elsewhere.test")[0]
            bob = s.rcpt("bob@example.org")
            alice = s.rcpt("alice@example.org")
            bob_again = s.rcpt("Bob@Example.org")
            assert 250 == s.data(b"Subject: hi\r\n\r\nhello\r\n")[0]
        assert (550, 250, 550) == (bob[0], alice[0], bob_again[0])
        said = f"host 127.0.0.1[127.0.0.1]:{ctl.port} said: " + USER_UNKNOWN.format("bob@example.org")
        assert (b"5.1.1 <bob@example.org>: Recipient address rejected: undeliverable address: " + said.encode()
                == bob[1])
        assert [(250, 250), (250,)] == [
            tuple(c for c, _ in rcpts_from_outside(d.port, "alice@example.org", "ALICE@example.org")),
            tuple(c for c, _ in rcpts_from_outside(d.port, "alice@example.org"))]
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:  # mynetworks: no verification
            s.ehlo("inside.test")
            assert 250 == s.mail("app@example.org")[0]
            assert 250 == s.rcpt("carol@example.org")[0]
        wait_for(lambda: hop.messages, 15, "the message at the next hop")
        assert [("someone@elsewhere.test", ["alice@example.org"])] == hop.messages
        assert {"bob@example.org": 1, "alice@example.org": 1} == hop.probes()
        assert ["someone@elsewhere.test"] == hop.data_commands  # no probe sent DATA
    finally:
        d.kill9()
        ctl.stop()


def test_a_next_hop_that_is_down_gives_450_4_1_1_and_one_probe(tmp_path):
    """A next hop that refuses connections: RCPT gets 450 4.1.1 "unverified address: connect to ...", never
    550 nor 250; asked again, the temporary failure comes from the cache (one probe in the log)."""
    down = free_port()
    log = str(tmp_path / "d.log")
    d = start_daemon(str(tmp_path / "spool"), down, log, config=config(tmp_path))
    try:
        first = rcpts_from_outside(d.port, "bob@example.org", "bob@example.org")
        assert [450, 450] == [c for c, _ in first]
        assert first[0][1].startswith(b"4.1.1 <bob@example.org>: Recipient address rejected: unverified address: "
                                      b"connect to 127.0.0.1[127.0.0.1]:")
        assert [("bob@example.org", "defer")] == [(e["recipient"], e["status"]) for e in verified_events(log)]
    finally:
        d.kill9()


def test_the_cache_survives_a_kill9_restart(tmp_path):
    """The results are kept in the spool (SPOOL/verify_cache): after kill -9 and a new start on the same
    spool, both addresses are answered without a new probe."""
    hop, ctl = start_hop()
    spool, conf = str(tmp_path / "spool"), config(tmp_path)
    d = start_daemon(spool, ctl.port, str(tmp_path / "d.log"), config=conf)
    try:
        assert [550, 250] == [c for c, _ in rcpts_from_outside(d.port, "bob@example.org", "alice@example.org")]
        d.kill9()
        d = start_daemon(spool, ctl.port, str(tmp_path / "d2.log"), config=conf)
        assert [550, 250] == [c for c, _ in rcpts_from_outside(d.port, "bob@example.org", "alice@example.org")]
        assert {"bob@example.org": 1, "alice@example.org": 1} == hop.probes()
    finally:
        d.kill9()
        ctl.stop()


def _replace(path: str, data: bytes) -> None:
    tmp = path + ".test-tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def test_a_damaged_cache_file_is_forgotten_never_believed(tmp_path):
    """A cache file that does not parse (deeply nested JSON: Python's parser raises RecursionError, which
    the shared map did not catch, so RCPT got 451 4.3.0) is read as empty: the daemon starts and probes.
    An entry whose check does not match (a forged "ok" for bob) is ignored: bob is probed again and refused."""
    hop, ctl = start_hop()
    spool = tmp_path / "spool"
    spool.mkdir()
    cache = str(spool / "verify_cache")
    _replace(cache, b"[" * 200_000)
    d = start_daemon(str(spool), ctl.port, str(tmp_path / "d.log"), config=config(tmp_path))
    try:
        assert [550] == [c for c, _ in rcpts_from_outside(d.port, "bob@example.org")]
        forged = {"bob@example.org": {"s": "ok", "t": time.time() - 10, "p": 0.0, "o": 0, "x": "forged", "c": 12345}}
        _replace(cache, json.dumps(forged).encode())
        assert [550] == [c for c, _ in rcpts_from_outside(d.port, "bob@example.org")]
        assert {"bob@example.org": 2} == hop.probes()
    finally:
        d.kill9()
        ctl.stop()


def _verifier(port: int, shared: SharedMap | None = None, **settings: object) -> Verifier:
    cfg = Config(relayhost=f"[127.0.0.1]:{port}", smtp_timeout_s=10.0)
    router = Router(cfg)
    return Verifier(VerifySettings(**settings), shared, make_prober(cfg, lambda: (router, None, None)))


def test_a_failed_refresh_never_clobbers_an_accepted_address(tmp_path):
    """Postfix verify(8): an accepted address past its refresh time is answered from the cache and probed
    again in the background; when that probe fails (the next hop is down now), the address stays accepted
    until it expires."""
    hop, ctl = start_hop()
    port = ctl.port
    shared = SharedMap(str(tmp_path / "verify_cache"))

    async def main() -> list[str]:
        v = _verifier(port, shared, positive_refresh_s=0.2)
        first = await v.verify("alice@example.org")
        ctl.stop()  # down: the refresh gets "connection refused"
        await asyncio.sleep(0.3)
        during = await v.verify("alice@example.org")
        while v._inflight:  # the background refresh
            await asyncio.sleep(0.05)
        after = await v.verify("alice@example.org")
        return [first[0], during[0], after[0], str(v.probes)]

    assert ["ok", "ok", "ok", "2"] == asyncio.run(main())
    assert "ok" == shared.read()["alice@example.org"]["s"]
    assert {"alice@example.org": 1} == hop.probes()  # the second probe found nobody


def test_two_workers_sharing_the_cache_probe_an_address_once(tmp_path):
    """Two worker processes' verifiers on one SPOOL/verify_cache (the second stands for another live
    process: its pid is this test's parent's): asked about the same new address at once, one claims it and
    probes, the other waits for the result in the map; the next hop sees one probe, both get its answer."""
    hop, ctl = start_hop(rcpt_delay_s=0.5)
    path = str(tmp_path / "verify_cache")
    try:
        async def main() -> list[str]:
            a, b = _verifier(ctl.port, SharedMap(path)), _verifier(ctl.port, SharedMap(path))
            b.pid = os.getppid()
            got = await asyncio.gather(a.verify("bob@example.org"), b.verify("bob@example.org"))
            return [s for s, _ in got] + [str(a.probes + b.probes)]

        assert ["bounce", "bounce", "1"] == asyncio.run(main())
        assert {"bob@example.org": 1} == hop.probes()
    finally:
        ctl.stop()


def test_unverified_reply_is_one_line_of_printable_ascii_within_512_octets():
    """A next hop's text is repeated to the client on one line of printable ASCII, the reply cut to 510
    characters (RFC 5321 §4.5.3.1.5: a reply line is at most 512 octets with its CRLF)."""
    p = EdgePolicy()
    reply = p.unverified_reply("bob@example.org", "bounce", "host x said: 550 \x1b[31mno\r\n" + "y" * 1000)
    assert reply is not None
    assert 510 == len(reply)
    assert reply.startswith("550 5.1.1 <bob@example.org>: Recipient address rejected: undeliverable address: "
                            "host x said: 550 ?[31mno yyy")
    assert None is p.unverified_reply("bob@example.org", "ok", "")
    assert ("450 4.1.1 <bob@example.org>: Recipient address rejected: unverified address: in progress"
            == p.unverified_reply("bob@example.org", "defer", "in progress"))


def test_one_probe_per_address_and_a_bound_on_probes_in_flight():
    """Ten RCPTs for one new address at once (a slow next hop) cost one probe, and all get its answer; with
    address_verify_probes_max = 2, five new addresses at once start two probes and the rest are answered
    "defer" (4.1.1) at once, so a client cannot make mtaq flood the next hop."""
    hop, ctl = start_hop(rcpt_delay_s=0.5)
    try:
        async def same() -> list[tuple[str, str]]:
            v = _verifier(ctl.port)
            return list(await asyncio.gather(*(v.verify("bob@example.org") for _ in range(10))))

        verdicts = asyncio.run(same())
        assert {"bounce"} == {s for s, _ in verdicts}
        assert {"bob@example.org": 1} == hop.probes()

        async def many() -> list[str]:
            v = _verifier(ctl.port, probes_max=2)
            got = await asyncio.gather(*(v.verify(f"u{i}@example.org") for i in range(5)))
            return [s for s, _ in got]

        assert ["bounce", "bounce", "defer", "defer", "defer"] == asyncio.run(many())
        assert 3 == sum(hop.probes().values())  # bob, then two of the five
        assert [] == hop.data_commands
    finally:
        ctl.stop()


def test_address_verify_sender_must_be_an_address_or_the_null_sender():
    """The probes' MAIL FROM is checked at start: "" and "<>" (the null sender) or local@domain; anything
    else stops the start with a line naming the key."""
    for good in ("", "<>", "double-bounce@mx.example.org"):
        assert good == load_config(None, {"address_verify_sender": good}).address_verify_sender
    for bad in ("a b@example.org", "nodomain", "<x@example.org>"):
        with pytest.raises(ConfigError, match="address_verify_sender"):
            load_config(None, {"address_verify_sender": bad})
