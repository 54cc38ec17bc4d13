"""DANE for SMTP (mtaq.delivery.dane, RFC 7672): TLSA lookups through a resolver whose AD bit is trusted or
not, and the check of a server's certificate chain against TLSA records.

DNS answers come from :class:`mtaq.testing.dnsserver.ZoneServer` playing a validating resolver (the AD bit on
``secure`` names); certificates from a local CA made with ``trustme``; the TLS handshakes are real (asyncio
on 127.0.0.1), and the chain is read from the client's ``ssl.SSLObject`` as delivery would.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import ssl

import dns.flags
import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from mtaq.config import Config, load_config
from mtaq.core.errors import ConfigError
from mtaq.delivery.dane import DnssecResolver, Tlsa, check_chain, name_matches, peer_chain, tlsa_name
from mtaq.testing.dnsserver import ZoneServer


# ----------------------------------------------------------------------------------------------- certificates
def der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def spki(der_cert: bytes) -> bytes:
    return x509.load_der_x509_certificate(der_cert).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def rec(usage: int, selector: int, mtype: int, cert_der: bytes) -> Tlsa:
    data = cert_der if selector == 0 else spki(cert_der)
    data = {0: data, 1: hashlib.sha256(data).digest(), 2: hashlib.sha512(data).digest()}[mtype]
    return Tlsa(usage, selector, mtype, data)


class Pki:
    """root CA -> intermediate CA -> leaf for mx.example.test (and the chain the server sends, root included)."""

    def __init__(self) -> None:
        self.root = trustme.CA()
        self.inter = self.root.create_child_ca()
        self.leaf = self.inter.issue_cert("mx.example.test")
        self.leaf_der = der(self.leaf.cert_chain_pems[0].bytes())
        self.inter_der = der(self.inter.cert_pem.bytes())
        self.root_der = der(self.root.cert_pem.bytes())
        self.chain = [self.leaf_der, self.inter_der, self.root_der]


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


@pytest.fixture(scope="module")
def other() -> Pki:
    return Pki()


@pytest.mark.parametrize(("selector", "mtype"), [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)])
def test_dane_ee_matches_the_leaf_by_every_selector_and_matching_type(pki, selector, mtype):
    m = check_chain([pki.leaf_der], [rec(3, selector, mtype, pki.leaf_der)], names=["mx.example.test"])
    assert (True, 0) == (m.ok, m.depth)


def test_dane_ee_mismatch_fails(pki, other):
    """A record of another certificate, or a one-bit change of the digest, does not authenticate the server."""
    r = rec(3, 1, 1, other.leaf_der)
    assert not check_chain(pki.chain, [r], names=["mx.example.test"]).ok
    good = rec(3, 1, 1, pki.leaf_der)
    flipped = Tlsa(3, 1, 1, bytes([good.data[0] ^ 1]) + good.data[1:])
    assert not check_chain(pki.chain, [flipped], names=["mx.example.test"]).ok
    # DANE-EE matches the leaf only: the intermediate's key in a 3 1 1 record is no match.
    assert not check_chain(pki.chain, [rec(3, 1, 1, pki.inter_der)], names=["mx.example.test"]).ok


def test_dane_ee_ignores_names_and_dates(pki):
    """RFC 7672 §3.1.1: with DANE-EE(3) the certificate's names and validity period are not checked."""
    expired = pki.inter.issue_cert(
        "somewhere.else", not_before=dt.datetime(2001, 1, 1, tzinfo=dt.UTC), not_after=dt.datetime(2002, 1, 1, tzinfo=dt.UTC)
    )
    leaf = der(expired.cert_chain_pems[0].bytes())
    assert check_chain([leaf], [rec(3, 1, 1, leaf)], names=["mx.example.test"]).ok


def test_pkix_usages_are_not_used_for_smtp(pki):
    """RFC 7672 §3.1.3: PKIX-TA(0) and PKIX-EE(1) records are unusable; a matching one authenticates nothing."""
    assert not Tlsa(1, 1, 1, b"x").usable and not Tlsa(0, 1, 1, b"x").usable
    assert not Tlsa(3, 2, 1, b"x").usable and not Tlsa(3, 1, 3, b"x").usable  # unknown selector / matching type
    m = check_chain(pki.chain, [rec(1, 1, 1, pki.leaf_der), rec(0, 0, 1, pki.root_der)], names=["mx.example.test"])
    assert (False, "no usable TLSA record") == (m.ok, m.reason)


@pytest.mark.parametrize("which", ["root", "inter"])
def test_dane_ta_matches_a_trust_anchor_in_the_chain(pki, which):
    ta = pki.root_der if which == "root" else pki.inter_der
    for selector, mtype in [(0, 1), (1, 1), (1, 2), (0, 0)]:
        m = check_chain(pki.chain, [rec(2, selector, mtype, ta)], names=["mx.example.test"])
        assert m.ok, m.reason
        assert m.depth == (2 if which == "root" else 1)


def test_dane_ta_follows_an_out_of_order_chain(pki):
    m = check_chain([pki.leaf_der, pki.root_der, pki.inter_der], [rec(2, 1, 1, pki.root_der)], names=["mx.example.test"])
    assert m.ok, m.reason


def test_dane_ta_checks_the_leaf_name(pki):
    """With DANE-TA(2) the leaf must name the MX host (RFC 7672 §3.2.2)."""
    m = check_chain(pki.chain, [rec(2, 1, 1, pki.root_der)], names=["other.example.test"])
    assert not m.ok
    assert "none of ['other.example.test']" in m.reason


def test_dane_ta_of_another_ca_or_a_broken_chain_fails(pki, other):
    assert not check_chain(pki.chain, [rec(2, 1, 1, other.root_der)], names=["mx.example.test"]).ok
    # The other PKI's root sent along (the server cannot make it a trust anchor): it signs nothing here.
    m = check_chain([pki.leaf_der, other.root_der], [rec(2, 1, 1, other.root_der)], names=["mx.example.test"])
    assert not m.ok and "does not lead to it" in m.reason
    # The intermediate missing: the leaf does not chain to the root.
    assert not check_chain([pki.leaf_der, pki.root_der], [rec(2, 1, 1, pki.root_der)], names=["mx.example.test"]).ok


def test_dane_ta_checks_the_leafs_dates(pki):
    expired = pki.inter.issue_cert(
        "mx.example.test", not_before=dt.datetime(2001, 1, 1, tzinfo=dt.UTC), not_after=dt.datetime(2002, 1, 1, tzinfo=dt.UTC)
    )
    chain = [der(expired.cert_chain_pems[0].bytes()), pki.inter_der, pki.root_der]
    m = check_chain(chain, [rec(2, 1, 1, pki.root_der)], names=["mx.example.test"])
    assert not m.ok and "expired" in m.reason


def test_name_matching_rules():
    assert name_matches("mx.example.test", "MX.Example.Test.")
    assert name_matches("*.example.test", "mx.example.test")
    assert not name_matches("*.example.test", "example.test")
    assert not name_matches("*.example.test", "a.mx.example.test")
    assert not name_matches("m*.example.test", "mx.example.test")
    assert not name_matches("*.test", "example.test")  # no wildcard right under a top-level name
    assert not name_matches("*", "test")


# ------------------------------------------------------------------------------------------------ real TLS
async def _handshake_chain(server_ctx: ssl.SSLContext) -> tuple[list[bytes], bool]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context()
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE  # DANE does its own check
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname="mx.example.test")
        chain = peer_chain(writer.get_extra_info("ssl_object"))
        writer.write(b"x")
        writer.close()
        return chain
    finally:
        server.close()


def test_chain_read_from_a_real_handshake_matches_ee_and_ta(pki, tmp_path):
    """The server sends leaf, intermediate and root; the client (CERT_NONE, as DANE needs) reads them all from
    its SSLObject (3.11: the private get_unverified_chain) and both kinds of record match."""
    pem = tmp_path / "chain.pem"
    pem.write_bytes(pki.leaf.private_key_pem.bytes() + b"".join(b.bytes() for b in pki.leaf.cert_chain_pems) + pki.root.cert_pem.bytes())
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pem))
    chain, whole = asyncio.run(_handshake_chain(ctx))
    assert whole, "no chain accessor in this Python: DANE-TA cannot be checked"
    assert pki.chain == chain
    assert check_chain(chain, [rec(3, 1, 1, pki.leaf_der)], names=["mx.example.test"]).ok
    assert check_chain(chain, [rec(2, 0, 1, pki.root_der)], names=["mx.example.test"]).ok


# --------------------------------------------------------------------------------------------------- lookups
def zone(pki: Pki) -> str:
    ee = rec(3, 1, 1, pki.leaf_der)
    ta = rec(2, 0, 1, pki.root_der)
    pkix = rec(1, 1, 1, pki.leaf_der)
    return f"""
_25._tcp.mx     IN TLSA {ee.usage} {ee.selector} {ee.mtype} {ee.data.hex()}
_25._tcp.mx     IN TLSA {ta.usage} {ta.selector} {ta.mtype} {ta.data.hex()}
_25._tcp.pkix   IN TLSA {pkix.usage} {pkix.selector} {pkix.mtype} {pkix.data.hex()}
_25._tcp.plain  IN TLSA {ee.usage} {ee.selector} {ee.mtype} {ee.data.hex()}
mx              IN A 127.0.0.1
nodane          IN A 127.0.0.1
"""


@pytest.fixture(scope="module")
def zs(pki):
    secure = ["_25._tcp.mx", "_25._tcp.pkix", "_25._tcp.nodane", "mx", "nodane"]
    with ZoneServer(zone(pki), origin="example.test.", secure=secure, servfail=["_25._tcp.bogus"], silent=["_25._tcp.slow"]) as z:
        yield z


def resolver(zs: ZoneServer, trusted: bool = True) -> DnssecResolver:
    server = ("127.0.0.1", zs.port)
    return DnssecResolver([server], [server] if trusted else [("127.0.0.1", 53)], timeout_s=1.0)


def test_secure_tlsa_records_give_dane_with_the_usable_records(zs, pki):
    policy = asyncio.run(resolver(zs).tlsa("mx.example.test"))
    assert "dane" == policy.status
    assert {rec(3, 1, 1, pki.leaf_der), rec(2, 0, 1, pki.root_der)} == set(policy.records)
    assert check_chain(pki.chain, policy.records, names=["mx.example.test"]).ok


def test_queries_ask_for_dnssec_with_do_and_ad(zs):
    asyncio.run(resolver(zs).tlsa("mx.example.test"))
    flags, ednsflags = zs.flags[-1]
    assert flags & dns.flags.AD and flags & dns.flags.RD and ednsflags & dns.flags.DO
    assert ("_25._tcp.mx.example.test.", "TLSA") == zs.queries[-1]
    assert "_25._tcp.mx.example.test" == tlsa_name("mx.example.test.", 25)


def test_ad_bit_from_a_resolver_not_trusted_is_ignored(zs):
    """The same answer with AD set, from a server not in dnssec_trusted_resolvers: insecure, no DANE."""
    policy = asyncio.run(resolver(zs, trusted=False).tlsa("mx.example.test"))
    assert ("insecure", ()) == (policy.status, policy.records)


def test_tlsa_records_without_ad_are_insecure(zs):
    assert "insecure" == asyncio.run(resolver(zs).tlsa("plain.example.test")).status


def test_no_tlsa_records_mean_no_dane(zs):
    r = resolver(zs)
    assert "none" == asyncio.run(r.tlsa("nodane.example.test")).status  # the name exists (secure NODATA)
    assert "none" == asyncio.run(r.tlsa("absent.example.test")).status  # NXDOMAIN


def test_only_unusable_records_mean_mandatory_tls_without_authentication(zs):
    """RFC 7672 §2.2: a secure TLSA RRset whose records are all unusable -> encrypt."""
    assert "encrypt" == asyncio.run(resolver(zs).tlsa("pkix.example.test")).status


@pytest.mark.parametrize("host", ["bogus.example.test", "slow.example.test"])
def test_lookup_failure_defers_the_host_with_4_7_5(zs, host):
    """SERVFAIL (what a validating resolver answers for bogus data) or a timeout: that MX host is not used."""
    policy = asyncio.run(resolver(zs).tlsa(host))
    assert "defer" == policy.status
    assert policy.reply is not None and (451, "4.7.5") == (policy.reply.code, policy.reply.enhanced)


def test_address_security_is_reported(zs):
    r = resolver(zs)
    assert asyncio.run(r.is_secure("mx.example.test", "A"))
    assert not asyncio.run(r.is_secure("plain.example.test", "A"))
    assert not asyncio.run(resolver(zs, trusted=False).is_secure("mx.example.test", "A"))


# ---------------------------------------------------------------------------------------------------- config
def test_config_keys(tmp_path):
    cfg = Config()
    assert ("enabled", [], False) == (cfg.smtp_dns_support_level, cfg.dnssec_trusted_resolvers, cfg.mta_sts)
    p = tmp_path / "mtaq.toml"
    p.write_text('smtp_dns_support_level = "dnssec"\ndnssec_trusted_resolvers = ["127.0.0.1", "[::1]:5353"]\n')
    cfg = load_config(str(p), {})
    assert "dnssec" == cfg.smtp_dns_support_level
    p.write_text('dnssec_trusted_resolvers = ["resolver.example"]\n')
    with pytest.raises(ConfigError, match="dnssec_trusted_resolvers"):
        load_config(str(p), {})


# ------------------------------------------------------------------------ issuers must be CAs (review)
def test_dane_ta_refuses_a_leaf_signed_by_an_end_entity_certificate_of_the_anchor_ca():
    """Found by review: anyone with an ordinary (CA:FALSE) certificate from the CA a domain publishes as
    DANE-TA could sign a certificate for the domain's MX host, and it matched. Issuers must be CAs (RFC 5280
    §4.2.1.9) allowed to sign certificates (keyCertSign) within their path length; the real chain still
    matches."""
    import hashlib

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def cert(subject, key, issuer, ikey, *, ca, path_length=None, san=None, key_cert_sign=None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=path_length), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        if key_cert_sign is not None:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False, key_cert_sign=key_cert_sign,
                                              crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        return b.sign(ikey, hashes.SHA256())

    def der(c):
        return c.public_bytes(serialization.Encoding.DER)

    ca_key, mid_key, atk_key, leaf_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = cert("Shared CA", ca_key, "Shared CA", ca_key, ca=True, path_length=0)
    spki = ca.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    record = Tlsa(2, 1, 1, hashlib.sha256(spki).digest())
    names = ["mx.victim.test", "victim.test"]
    real = cert("mx.victim.test", leaf_key, "Shared CA", ca_key, ca=False, san="mx.victim.test")
    assert check_chain([der(real), der(ca)], [record], names=names).ok
    attacker = cert("attacker.test", atk_key, "Shared CA", ca_key, ca=False, san="attacker.test")
    forged = cert("mx.victim.test", leaf_key, "attacker.test", atk_key, ca=False, san="mx.victim.test")
    assert not check_chain([der(forged), der(attacker), der(ca)], [record], names=names).ok
    no_sign = cert("attacker.test", atk_key, "Shared CA", ca_key, ca=True, key_cert_sign=False)
    forged2 = cert("mx.victim.test", leaf_key, "attacker.test", atk_key, ca=False, san="mx.victim.test")
    assert not check_chain([der(forged2), der(no_sign), der(ca)], [record], names=names).ok
    # pathLen 0 on the anchor: an intermediate CA under it may not issue the leaf
    mid = cert("Sub CA", mid_key, "Shared CA", ca_key, ca=True)
    deep = cert("mx.victim.test", leaf_key, "Sub CA", mid_key, ca=False, san="mx.victim.test")
    assert not check_chain([der(deep), der(mid), der(ca)], [record], names=names).ok
