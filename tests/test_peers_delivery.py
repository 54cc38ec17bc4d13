"""DANE and MTA-STS applied by delivery (issue 16.3, 16.4): real next hops with real TLS, a real DNS server
that plays a validating resolver (the AD bit on ``secure`` names), a real HTTPS server for the policies.

In process: :func:`mtaq.delivery.transport.deliver` with the daemon's Router, ConnectionPool and PeerPolicy;
and once end to end through ``mtaq serve`` (config keys -> DANE-verified delivery). The DNS and the
internet are the only fakes (the test DNS server and loopback next hops); everything else is real.
"""

from __future__ import annotations

import asyncio
import hashlib
import smtplib
import ssl
import time

import msgspec
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from test_outbound_auth_tls import Hop

from mtaq.config import Config, load_config
from mtaq.delivery.dane import DnssecResolver
from mtaq.delivery.mtasts import MtaSts
from mtaq.delivery.peers import PeerPolicy
from mtaq.delivery.routing import Router
from mtaq.delivery.transport import Batch, ConnectionPool, HopFailure, deliver
from mtaq.storage.cachefile import CacheDir
from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.procs import read_events, start_daemon

trustme = pytest.importorskip("trustme")
BODY = b"From: a@origin.test\r\nSubject: peers\r\nMessage-ID: <peers@origin.test>\r\n\r\nhello\r\n"


def spki_sha256(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA the daemon does NOT trust (DANE needs no PKIX trust), one it trusts (MTA-STS), and leaves."""
    d = tmp_path_factory.mktemp("pki")
    untrusted, trusted = trustme.CA(), trustme.CA()
    trusted.cert_pem.write_to_path(str(d / "trusted.pem"))
    out = {"trusted_ca": str(d / "trusted.pem"), "trusted": trusted}
    leaves = {
        "dane": untrusted.issue_cert("mx.good.test", "mx.bad.test", "mx.plain.test", "mx.bogus.test"),
        "sts": trusted.issue_cert("mx.sts.test", "mx.stst.test"),
        "sts-untrusted": untrusted.issue_cert("mx.stsbad.test", "mx.stspkix.test"),
    }
    for kind, leaf in leaves.items():
        leaf.cert_chain_pems[0].write_to_path(str(d / f"{kind}.crt"))
        leaf.private_key_pem.write_to_path(str(d / f"{kind}.key"))
        out[kind] = (str(d / f"{kind}.crt"), str(d / f"{kind}.key"))
        out[f"{kind}-spki"] = spki_sha256(leaf.cert_chain_pems[0].bytes())
    return out


@pytest.fixture(scope="module")
def hops(pki):
    with Hop(pki["dane"], auth=False) as dane_hop, Hop(pki["sts"], auth=False) as sts_hop, \
            Hop(pki["sts-untrusted"], auth=False) as sts_bad_hop:
        yield {"dane": dane_hop, "sts": sts_hop, "sts-untrusted": sts_bad_hop}


def zone(pki, hops) -> str:
    dp = hops["dane"].port
    good = pki["dane-spki"]
    flipped = good[:-1] + ("0" if good[-1] != "0" else "1")
    lines = [
        "good IN MX 10 mx.good", "mx.good IN A 127.0.0.1", f"_{dp}._tcp.mx.good IN TLSA 3 1 1 {good}",
        "bad IN MX 10 mx.bad", "mx.bad IN A 127.0.0.1", f"_{dp}._tcp.mx.bad IN TLSA 3 1 1 {flipped}",
        # TLSA published but the MX answer is not secure: DANE must not apply (Exim's rule)
        "plain IN MX 10 mx.plain", "mx.plain IN A 127.0.0.1", f"_{dp}._tcp.mx.plain IN TLSA 3 1 1 {flipped}",
        "bogus IN MX 10 mx.bogus", "mx.bogus IN A 127.0.0.1",
        # MTA-STS domains: sts (enforce; mx2 not in the policy, tried first), stst (testing), stsbad (enforce,
        # the listed MX presents a certificate of an untrusted CA)
        "sts IN MX 5 mx2.sts", "sts IN MX 10 mx.sts", "mx.sts IN A 127.0.0.1", "mx2.sts IN A 127.0.0.1",
        "stst IN MX 10 mx2.stst", "mx2.stst IN A 127.0.0.1",
        "stsbad IN MX 10 mx.stsbad", "mx.stsbad IN A 127.0.0.1",
        # enforce policy and only unusable (PKIX-EE) TLSA records: MTA-STS must still demand verified TLS
        "stspkix IN MX 10 mx.stspkix", "mx.stspkix IN A 127.0.0.1",
        f"_{hops['sts-untrusted'].port}._tcp.mx.stspkix IN TLSA 1 1 1 {pki['sts-untrusted-spki']}",
    ]
    for d in ("sts", "stst", "stsbad", "stspkix"):
        lines += [f"mta-sts.{d} IN A 127.0.0.1", f'_mta-sts.{d} IN TXT "v=STSv1; id=1;"']
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def zs(pki, hops):
    dp = hops["dane"].port
    secure = ["good", "mx.good", f"_{dp}._tcp.mx.good", "bad", "mx.bad", f"_{dp}._tcp.mx.bad",
              "mx.plain", f"_{dp}._tcp.mx.plain", "bogus", "mx.bogus",
              "stspkix", "mx.stspkix", f"_{hops['sts-untrusted'].port}._tcp.mx.stspkix"]
    with ZoneServer(zone(pki, hops), origin="test.", secure=secure, servfail=[f"_{dp}._tcp.mx.bogus"]) as z:
        yield z


POLICIES = {
    "mta-sts.sts.test": "version: STSv1\nmode: enforce\nmx: mx.sts.test\nmax_age: 86400\n",
    "mta-sts.stst.test": "version: STSv1\nmode: testing\nmx: mx.stst.test\nmax_age: 86400\n",
    "mta-sts.stsbad.test": "version: STSv1\nmode: enforce\nmx: mx.stsbad.test\nmax_age: 86400\n",
    "mta-sts.stspkix.test": "version: STSv1\nmode: enforce\nmx: mx.stspkix.test\nmax_age: 86400\n",
}


def cfg_for(zs: ZoneServer, port: int, **more: object) -> Config:
    server = f"127.0.0.1:{zs.port}"
    return msgspec.convert({"dns_nameservers": [server], "dnssec_trusted_resolvers": [server], "dns_timeout_s": 2,
                            "smtp_port": port, "relayhost": "", **more}, Config)


async def run_delivery(cfg: Config, peers: PeerPolicy, rcpt: str) -> tuple[list[Batch], list[HopFailure]]:
    batches: list[Batch] = []
    failures: list[HopFailure] = []

    async def record(b: Batch) -> None:
        batches.append(b)

    pool = ConnectionPool(helo_name="relay.test", timeout_s=10, idle_s=5)
    await deliver(Router(cfg), pool, "a@origin.test", [rcpt], BODY, record=record, on_hop_failure=failures.append,
                  peers=peers)
    await pool.close_idle()
    return batches, failures


def dane_case(zs, hops, rcpt: str):
    cfg = cfg_for(zs, hops["dane"].port, smtp_tls_security_level="dane", smtp_dns_support_level="dnssec")
    return asyncio.run(run_delivery(cfg, PeerPolicy(dane=DnssecResolver.from_config(cfg)), rcpt))


def test_dane_ee_match_delivers_over_tls_that_pkix_would_refuse(zs, hops):
    """The certificate's CA is trusted by nobody; the TLSA 3 1 1 record vouches for it: delivered, verified."""
    batches, _ = dane_case(zs, hops, "bob@good.test")
    ((batch,),) = [[b for b in batches]]
    assert [250] == [r.code for _, r in batch.items]
    assert batch.tls.endswith("verified (DANE)"), batch.tls


def test_dane_mismatch_defers_with_4_7_5_and_sends_nothing(zs, hops):
    before = len(hops["dane"].messages)
    batches, _ = dane_case(zs, hops, "bob@bad.test")
    (reply,) = [r for b in batches for _, r in b.items]
    assert (450, "4.7.5") == (reply.code, reply.enhanced) and "DANE" in reply.text, reply
    assert before == len(hops["dane"].messages)


def test_dane_does_not_apply_when_the_mx_answer_is_not_secure(zs, hops):
    """TLSA exists (and would not match) but the MX RRset was not validated: plain opportunistic TLS."""
    batches, _ = dane_case(zs, hops, "bob@plain.test")
    ((batch,),) = [[b for b in batches]]
    assert [250] == [r.code for _, r in batch.items]
    assert batch.tls and "verified" not in batch.tls


def test_dane_lookup_failure_skips_the_host_451_4_7_5(zs, hops):
    batches, _ = dane_case(zs, hops, "bob@bogus.test")
    (reply,) = [r for b in batches for _, r in b.items]
    assert (451, "4.7.5") == (reply.code, reply.enhanced), reply


async def _policy_site():
    async def handle(request: web.Request) -> web.Response:
        host = request.host.rsplit(":", 1)[0]
        if request.path != "/.well-known/mta-sts.txt" or host not in POLICIES:
            return web.Response(status=404)
        return web.Response(body=POLICIES[host].encode(), headers={"Content-Type": "text/plain"})

    return handle


def sts_case(zs, hops, pki, tmp_path, rcpt: str, hop: str, *, dane: bool = False):
    more = {"smtp_tls_security_level": "dane", "smtp_dns_support_level": "dnssec"} if dane else {}
    cfg = cfg_for(zs, hops[hop].port, mta_sts=True, smtp_tls_CAfile=pki["trusted_ca"], **more)
    reports: list[tuple[str, dict]] = []

    async def go():
        app = web.Application()
        app.router.add_get("/{tail:.*}", await _policy_site())
        runner = web.AppRunner(app)
        await runner.setup()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        pki["trusted"].issue_cert(*POLICIES).configure_cert(ctx)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        try:
            sts = MtaSts(CacheDir(str(tmp_path / "mta-sts")), nameservers=[("127.0.0.1", zs.port)], timeout_s=5,
                         ca_file=pki["trusted_ca"], port=runner.addresses[0][1])
            peers = PeerPolicy(sts=sts, dane=DnssecResolver.from_config(cfg) if dane else None,
                               report=lambda ev, f: reports.append((ev, f)))
            return await run_delivery(cfg, peers, rcpt)
        finally:
            await runner.cleanup()

    batches, failures = asyncio.run(go())
    return batches, failures, reports


def test_mta_sts_enforce_skips_unlisted_mx_and_verifies_the_listed_one(zs, hops, pki, tmp_path):
    batches, failures, _ = sts_case(zs, hops, pki, tmp_path, "bob@sts.test", "sts")
    assert any(f.reply.enhanced == "4.7.0" and "mx2.sts.test" in f.reply.text for f in failures), failures
    ((batch,),) = [[b for b in batches]]
    assert [250] == [r.code for _, r in batch.items]
    assert batch.relay.startswith("mx.sts.test[") and batch.tls.endswith("verified"), (batch.relay, batch.tls)


def test_mta_sts_enforce_defers_when_the_certificate_is_not_trusted(zs, hops, pki, tmp_path):
    batches, _, _ = sts_case(zs, hops, pki, tmp_path, "bob@stsbad.test", "sts-untrusted")
    (reply,) = [r for b in batches for _, r in b.items]
    assert (450, "4.7.5") == (reply.code, reply.enhanced) and "not trusted" in reply.text, reply


def test_mta_sts_testing_reports_and_delivers(zs, hops, pki, tmp_path):
    batches, _, reports = sts_case(zs, hops, pki, tmp_path, "bob@stst.test", "sts")
    ((batch,),) = [[b for b in batches]]
    assert [250] == [r.code for _, r in batch.items]
    assert [("mta_sts_report", "mx2.stst.test")] == [(ev, f["mx_host"]) for ev, f in reports]


def test_level_dane_without_dnssec_is_a_config_error(tmp_path):
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text('smtp_tls_security_level = "dane"\n')
    with pytest.raises(Exception, match="dnssec"):
        load_config(str(cfg), {})


def test_the_daemon_delivers_with_dane_end_to_end(zs, hops, tmp_path):
    """mtaq serve with the config keys only: the delivered event says the TLS was DANE-verified."""
    server = f"127.0.0.1:{zs.port}"
    (tmp_path / "mtaq.toml").write_text(
        f'relayhost = ""\ndns_nameservers = ["{server}"]\ndnssec_trusted_resolvers = ["{server}"]\ndns_timeout_s = 2\n'
        f'smtp_port = {hops["dane"].port}\nsmtp_tls_security_level = "dane"\nsmtp_dns_support_level = "dnssec"\n')
    d = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "daemon.log"), config=str(tmp_path / "mtaq.toml"))
    try:
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:
            s.ehlo("client.test")
            assert {} == s.sendmail("a@origin.test", ["carol@good.test"], BODY)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = [e for e in read_events(d.log_path) if e.get("event") == "delivered"]
            if done:
                break
            assert d.alive(), d.log_text()[-2000:]
            time.sleep(0.05)
        assert done and done[0].get("tls", "").endswith("verified (DANE)"), done
    finally:
        d.kill9()


def test_unusable_tlsa_records_do_not_switch_mta_sts_off(zs, hops, pki, tmp_path):
    """Found by review: at level dane, a host with only unusable (PKIX-EE) TLSA records got plain encrypt and
    MTA-STS was never asked, so an enforce domain's mail went over unverified TLS. Only usable records take
    precedence; here the enforce policy still demands a trusted certificate, which this host lacks."""
    batches, _, _ = sts_case(zs, hops, pki, tmp_path, "bob@stspkix.test", "sts-untrusted", dane=True)
    (reply,) = [r for b in batches for _, r in b.items]
    assert (450, "4.7.5") == (reply.code, reply.enhanced) and "not trusted" in reply.text, reply


def test_a_failed_dnssec_lookup_defers_instead_of_dropping_dane(zs, hops):
    """Found by review: a timeout on the DNSSEC (DO) query for the MX RRset counted as "insecure", so DANE
    was dropped to may and STARTTLS could be stripped. Now the host is not used: 451 4.7.5. The router's own
    lookups still work (they go to the zone server); the validating resolver does not answer."""
    import socket

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))  # a resolver that never answers
    try:
        cfg = cfg_for(zs, hops["dane"].port, smtp_tls_security_level="dane", smtp_dns_support_level="dnssec")
        dead = ("127.0.0.1", silent.getsockname()[1])
        peers = PeerPolicy(dane=DnssecResolver([dead], [dead], timeout_s=0.5))
        before = len(hops["dane"].messages)
        batches, _ = asyncio.run(run_delivery(cfg, peers, "bob@good.test"))
    finally:
        silent.close()
    (reply,) = [r for b in batches for _, r in b.items]
    assert (451, "4.7.5") == (reply.code, reply.enhanced), reply
    assert before == len(hops["dane"].messages)
