"""Outbound STARTTLS (RFC 3207): opportunistic by default, required per destination with ``encrypt``.

Next hops are real aiosmtpd servers (``mtaq sink --tls-cert``, or in process) with a self-signed certificate
made by the test with ``cryptography``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import smtplib
import ssl

import pytest
from aiosmtpd.smtp import SMTP
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mtaq.delivery.relay import RelayConnection, classify
from mtaq.testing.procs import maildir_message_ids

BODY = b"From: a@x.org\r\nSubject: t\r\nMessage-ID: <tls@mtaq.test>\r\n\r\nhi\r\n"


@pytest.fixture(scope="module")
def cert_pem(tmp_path_factory) -> str:
    """A self-signed certificate and its key in one PEM file (CN sink.test)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sink.test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("sink.test")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = tmp_path_factory.mktemp("tls") / "sink.pem"
    path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path)


def send(port: int, rcpts: list[str], mid: str) -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail("sender@example.org")
        for r in rcpts:
            s.rcpt(r)
        code, text = s.data(BODY.replace(b"<tls@mtaq.test>", mid.encode()))
    assert 250 == code
    return text.decode().rsplit(" ", 1)[1]


def sink_tls_headers(maildir: str) -> list[str]:
    import email.parser
    import glob

    out = []
    for p in glob.glob(maildir + "/new/*"):
        with open(p, "rb") as f:
            out.append(email.parser.BytesHeaderParser().parse(f).get("X-Sink-TLS", "plaintext"))
    return out


def test_mail_goes_over_starttls_when_the_next_hop_offers_it(relay_factory, cert_pem):
    """Default policy ``may``: STARTTLS with a self-signed (unverified) certificate; the sink saw TLS and the
    delivered event says which version."""
    r = relay_factory(sink_args=["--tls-cert", cert_pem])
    send(r.daemon.port, ["a@example.net"], "<over-tls@mtaq.test>")
    [ev] = r.wait_for(lambda: r.events("delivered"), what="delivered")
    assert ev["tls"].startswith("TLSv1.")
    assert [ev["tls"]] == sink_tls_headers(r.maildir)


def test_policy_none_never_starts_tls(relay_factory, cert_pem):
    r = relay_factory(sink_args=["--tls-cert", cert_pem], config='smtp_tls_security_level = "none"\n')
    send(r.daemon.port, ["a@example.net"], "<plain@mtaq.test>")
    [ev] = r.wait_for(lambda: r.events("delivered"), what="delivered")
    assert ("none", ["plaintext"]) == (ev["tls"], sink_tls_headers(r.maildir))


def test_encrypt_policy_defers_4_7_4_when_the_next_hop_has_no_starttls(relay_factory):
    """``encrypt`` for one domain: its recipient is deferred with Postfix's 4.7.4 "TLS is required, but was not
    offered"; a recipient of another domain in the same message still goes in plaintext."""
    r = relay_factory(config='[tls_policy_map]\n"secret.example" = "encrypt"\n')
    qid = send(r.daemon.port, ["a@secret.example", "b@open.example"], "<must-encrypt@mtaq.test>")
    [deferred] = r.wait_for(lambda: r.events("deferred"), what="deferred")
    assert ("a@secret.example", "4.7.4", qid) == (deferred["recipient"], deferred["dsn"], deferred["queue_id"])
    assert "TLS is required, but was not offered by host" in deferred["reply"]
    [delivered] = r.wait_for(lambda: r.events("delivered"), what="delivered")
    assert "b@open.example" == delivered["recipient"]
    assert {"<must-encrypt@mtaq.test>": 1} == dict(maildir_message_ids(r.maildir))


def test_encrypt_policy_delivers_when_the_next_hop_offers_starttls(relay_factory, cert_pem):
    r = relay_factory(sink_args=["--tls-cert", cert_pem], config='smtp_tls_security_level = "encrypt"\n')
    send(r.daemon.port, ["a@example.net"], "<encrypted@mtaq.test>")
    [ev] = r.wait_for(lambda: r.events("delivered"), what="delivered")
    assert sink_tls_headers(r.maildir) == [ev["tls"]] and ev["tls"].startswith("TLSv1.")


# ----------------------------------------------------------------------------- in process: a refused STARTTLS
class RefusingTls(SMTP):
    """Offers STARTTLS in EHLO (it has a TLS context) but answers 454 to the command (RFC 3207 §4)."""

    async def smtp_STARTTLS(self, arg: str) -> None:
        await self.push("454 4.7.0 TLS not available due to temporary reason")


class Recorder:
    def __init__(self) -> None:
        self.tls: list[bool] = []

    async def handle_DATA(self, server, session, envelope):
        self.tls.append(bool(session.ssl))
        return "250 2.0.0 Ok"


async def against_refusing_server(cert_pem: str, tls: str):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_pem)
    h = Recorder()
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: RefusingTls(h, hostname="hop", tls_context=ctx, loop=loop), "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    conn = RelayConnection("127.0.0.1", port, helo_name="mtaq.test", timeout_s=5, tls=tls)  # type: ignore[arg-type]
    try:
        replies = await conn.send("a@x.org", ["b@y.org"], BODY)
        await conn.close()
        return replies, h.tls
    finally:
        srv.close()


def test_refused_starttls_falls_back_to_plaintext_under_may(cert_pem):
    """Opportunistic TLS never costs a delivery: STARTTLS refused -> a plaintext session (as Postfix)."""
    replies, tls = asyncio.run(against_refusing_server(cert_pem, "may"))
    assert ([("delivered", "2.0.0")], [False]) == ([(classify(r.code), r.enhanced) for r in replies], tls)


def test_refused_starttls_defers_4_7_5_under_encrypt(cert_pem):
    """``encrypt`` never sends in plaintext: "Cannot start TLS" 4.7.5 (Postfix), and nothing was delivered."""
    replies, tls = asyncio.run(against_refusing_server(cert_pem, "encrypt"))
    assert ([("deferred", "4.7.5")], []) == ([(classify(r.code), r.enhanced) for r in replies], tls)
    assert replies[0].text.startswith("Cannot start TLS")
