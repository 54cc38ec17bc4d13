"""STARTTLS (RFC 3207) with a configured certificate, the CVE-2011-0411 command injection, and AUTH PLAIN /
LOGIN (RFC 4954, RFC 4616) only after TLS, against a bcrypt password file; authenticated clients may relay.

The certificate is self-signed, made by the test with the cryptography package; clients verify it (it is
their only trust anchor). Real edge or daemon, smtplib, swaks and raw sockets over loopback.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import ssl
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from edgekit import HOST, codes, edge_relay, run_edge

from mtaq.core.errors import ConfigError
from mtaq.edge.auth import PasswordFile, hash_password
from mtaq.edge.policy import EdgePolicy, parse_networks, server_tls_context

USER, PASSWORD = "alice", "correct horse battery staple"


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for mx.test and 127.0.0.1: (cert.pem, key.pem)."""
    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])
    now = dt.datetime.now(dt.UTC)
    crt = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = d / "cert.pem", d / "key.pem"
    cert_path.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)  # readable by group or others: refused at start (issue 32.9)
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def passwd_file(tmp_path_factory) -> str:
    """A password file made with `mtaq passwd` (bcrypt cost 4 to keep the tests quick)."""
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "passwd", USER, "--rounds", "4"], input=PASSWORD + "\n",
                         capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path_factory.mktemp("auth") / "passwd"
    path.write_text("# mtaq users\n\n" + out.stdout)
    path.chmod(0o600)  # group- or world-readable is refused at start (issue 33)
    return str(path)


def client_context(cert_path: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cert_path)
    return ctx


def policy(cert, passwd_file=None, **kw) -> EdgePolicy:
    return EdgePolicy(tls_context=server_tls_context(*cert),
                      passwords=PasswordFile.load(passwd_file) if passwd_file else None, **kw)


OUTSIDE = parse_networks(["192.0.2.0/24"])  # 127.0.0.1 is then not in mynetworks


def plain(user: str, password: str) -> str:
    return base64.b64encode(f"\0{user}\0{password}".encode()).decode()


def test_starttls_is_offered_and_works_with_the_configured_certificate(tmp_path, cert, passwd_file):
    """EHLO offers STARTTLS and no AUTH in the clear; the handshake verifies against our certificate for
    mx.test; afterwards EHLO offers AUTH PLAIN LOGIN and no STARTTLS, and a message sent over TLS is
    marked 'with ESMTPS' in its Received header."""
    with run_edge(tmp_path, policy(cert, passwd_file)) as edge:
        with edge.client() as s:
            s.ehlo("client.test")
            assert s.has_extn("starttls") and not s.has_extn("auth")
            assert (220, b"2.0.0 Ready to start TLS") == s.starttls(context=client_context(cert[0]))
            peer = s.sock.getpeercert()
            assert ((("commonName", HOST),),) == peer["subject"]
            s.ehlo("client.test")
            assert not s.has_extn("starttls")
            assert ["LOGIN", "PLAIN"] == sorted(s.esmtp_features["auth"].split())
            assert {} == s.sendmail("a@example.org", ["b@example.net"], b"Subject: tls\r\n\r\nover tls\r\n")
        [(_, body)] = edge.messages()
    assert body.startswith(b"Received: from client.test ([127.0.0.1])\r\n\tby mx.test (mtaq) with ESMTPS\r\n")


def test_commands_sent_with_starttls_in_the_clear_are_discarded_cve_2011_0411(tmp_path, cert):
    """'STARTTLS\\r\\nRSET\\r\\n' in one packet: the RSET sent in the clear is never executed or answered; the
    first reply inside TLS is to the client's EHLO (RFC 3207 §4.2: the server discards what came before
    the handshake)."""
    with run_edge(tmp_path, policy(cert)) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        c.send(b"STARTTLS\r\nRSET\r\n")
        assert "220 2.0.0 Ready to start TLS" == c.reply()
        c.starttls(client_context(cert[0]))
        ehlo = c.command("EHLO client.test").split("\n")
        assert f"250-{HOST}" == ehlo[0]
        assert (250, "2.0.0") == codes(c.command("NOOP"))


def test_auth_before_tls_is_538_and_without_a_password_file_auth_is_not_offered(tmp_path, cert, passwd_file):
    """AUTH in the clear gets 538 5.7.11 (RFC 4954 §6); with TLS but no password file, EHLO offers no AUTH
    and AUTH gets 503 5.5.1."""
    with run_edge(tmp_path, policy(cert, passwd_file)) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        assert "538 5.7.11 Encryption required for requested authentication mechanism" == c.command(
            "AUTH PLAIN " + plain(USER, PASSWORD))
    with run_edge(tmp_path, policy(cert)) as edge, edge.client() as s:
        s.ehlo("client.test")
        s.starttls(context=client_context(cert[0]))
        s.ehlo("client.test")
        assert not s.has_extn("auth")
        assert (503, b"5.5.1 Error: authentication not enabled") == s.docmd("AUTH", "PLAIN " + plain(USER, PASSWORD))


def test_authenticated_client_may_relay_anywhere_and_a_failed_one_may_not(tmp_path, cert, passwd_file):
    """From outside mynetworks: AUTH PLAIN with the right password (235 2.7.0) lets the client relay to
    any domain, and the Received header says ESMTPSA; a wrong password or unknown user gets 535 5.7.8 and
    relaying stays denied (554 5.7.1)."""
    with run_edge(tmp_path, policy(cert, passwd_file, mynetworks=OUTSIDE)) as edge:
        with edge.client() as s:
            s.ehlo("client.test")
            s.starttls(context=client_context(cert[0]))
            s.ehlo("client.test")
            assert (535, b"5.7.8 Authentication credentials invalid") == s.docmd("AUTH", "PLAIN " + plain(USER, "wrong"))
            assert (535, b"5.7.8 Authentication credentials invalid") == s.docmd("AUTH", "PLAIN " + plain("bob", PASSWORD))
            s.mail("a@example.org")
            assert 554 == s.rcpt("b@elsewhere.test")[0]
            s.rset()
            assert (235, b"2.7.0 Authentication successful") == s.docmd("AUTH", "PLAIN " + plain(USER, PASSWORD))
            assert {} == s.sendmail("a@example.org", ["b@elsewhere.test"], b"Subject: auth\r\n\r\nrelayed\r\n")
        [(env, body)] = edge.messages()
    assert ["b@elsewhere.test"] == [r.address for r in env.recipients]
    assert b"\tby mx.test (mtaq) with ESMTPSA\r\n" in body


def test_auth_login_with_challenges_and_smtplib_login(tmp_path, cert, passwd_file):
    """AUTH LOGIN asks 'Username:' then 'Password:' (base64) and accepts the right pair; smtplib's login()
    (which picks PLAIN or LOGIN itself) works; AUTH inside a transaction is 503 5.5.1 (RFC 4954 §4)."""
    with run_edge(tmp_path, policy(cert, passwd_file)) as edge:
        with edge.raw() as c:
            c.reply()
            c.command("EHLO client.test")
            c.command("STARTTLS")
            c.starttls(client_context(cert[0]))
            c.command("EHLO client.test")
            assert "334 " + base64.b64encode(b"Username:").decode() == c.command("AUTH LOGIN")
            assert "334 " + base64.b64encode(b"Password:").decode() == c.command(base64.b64encode(USER.encode()))
            assert "235 2.7.0 Authentication successful" == c.command(base64.b64encode(PASSWORD.encode()))
            assert "503 5.5.1 Error: already authenticated" == c.command("AUTH LOGIN")
        with edge.client() as s:
            s.ehlo("client.test")
            s.starttls(context=client_context(cert[0]))
            s.ehlo("client.test")
            s.mail("a@example.org")
            assert (503, b"5.5.1 Error: MAIL transaction in progress") == s.docmd("AUTH", "PLAIN " + plain(USER, PASSWORD))
            s.rset()
            assert 235 == s.login(USER, PASSWORD)[0]


def test_swaks_starttls_and_auth_relay_through_the_daemon_to_the_sink(tmp_path, cert, passwd_file):
    """The daemon configured with tls_cert_file, tls_key_file and auth_password_file, nmap-style outsider
    (mynetworks without 127.0.0.1): swaks --tls --auth LOGIN relays a message to a foreign domain; it reaches
    the sink with 'with ESMTPSA'. Without --auth the same swaks gets 554 5.7.1."""
    config = (f'tls_cert_file = "{cert[0]}"\ntls_key_file = "{cert[1]}"\nauth_password_file = "{passwd_file}"\n'
              'mynetworks = ["192.0.2.0/24"]\n')
    with edge_relay(tmp_path, config=config) as r:
        base = ["swaks", "--server", f"127.0.0.1:{r.port}", "--helo", "client.test", "--from", "a@example.org",
                "--to", "b@elsewhere.test", "--tls", "--tls-verify", "--tls-ca-path", cert[0],
                "--tls-sni", HOST, "--timeout", "30"]
        denied = subprocess.run(base, capture_output=True, text=True, timeout=120)
        assert 0 != denied.returncode and "554 5.7.1 <b@elsewhere.test>: Relay access denied" in denied.stdout
        ok = subprocess.run([*base, "--auth", "LOGIN", "--auth-user", USER, "--auth-password", PASSWORD],
                            capture_output=True, text=True, timeout=120)
        assert 0 == ok.returncode, ok.stdout
        [msg] = r.wait_for(r.sink_messages, "delivery")
    assert b"Delivered-To: b@elsewhere.test\r\n" in msg and b"with ESMTPSA\r\n" in msg


def test_mtaq_passwd_makes_a_line_the_password_file_accepts():
    """`mtaq passwd USER` prints 'USER:$2b$...' that verifies the password and nothing else; an empty or a
    too long password, or a bad user name, is a one-line error with status 2."""
    def run(*args: str, password: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mtaq.cli", "passwd", *args], input=password + "\n",
                              capture_output=True, text=True, timeout=60)

    out = run("carol", "--rounds", "4", password="s3cret")
    assert 0 == out.returncode
    line = out.stdout.strip()
    assert line.startswith("carol:$2b$04$")
    pw = PasswordFile.parse(line)
    assert (True, False, False) == (pw.verify("carol", b"s3cret"), pw.verify("carol", b"s3cret!"), pw.verify("dave", b"s3cret"))
    for args, password, message in [(("carol",), "", "mtaq: passwd: empty password"),
                                    (("carol",), "x" * 73, "mtaq: passwd: password longer than 72 bytes (bcrypt's limit)"),
                                    (("a:b",), "pw", "mtaq: passwd: bad user name 'a:b' (printable ASCII, no ':' or space)")]:
        bad = run(*args, password=password)
        assert (2, [message]) == (bad.returncode, bad.stderr.splitlines())


def test_bad_tls_or_password_settings_stop_the_daemon_with_a_message_naming_the_key(tmp_path, cert):
    """A missing certificate, a key without a certificate, a password file with a bad line, or AUTH
    without TLS: `mtaq serve` exits 2 with one line naming the key (and the file and line)."""
    bad_pw = tmp_path / "pw"
    bad_pw.write_text(f"ok:{hash_password(b'pw', rounds=4)}\nbroken line\n")
    bad_pw.chmod(0o600)
    cases = [
        (f'tls_cert_file = "{tmp_path}/none.pem"\ntls_key_file = "{cert[1]}"\n', "mtaq: tls_cert_file/tls_key_file: "),
        (f'tls_key_file = "{cert[1]}"\n', "mtaq: tls_cert_file and tls_key_file: set both or neither"),
        (f'tls_cert_file = "{cert[0]}"\ntls_key_file = "{cert[1]}"\nauth_password_file = "{bad_pw}"\n',
         f"mtaq: auth_password_file: {bad_pw} line 2: expected user:hash"),
        (f'auth_password_file = "{bad_pw}"\n', "mtaq: auth_password_file: "),
    ]
    for i, (config, start) in enumerate(cases):
        cfg = tmp_path / f"c{i}.toml"
        cfg.write_text(config)
        out = subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", "--config", str(cfg), "--spool",
                              str(tmp_path / "spool"), "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
        assert 2 == out.returncode, (config, out.stderr)
        [line] = out.stderr.splitlines()
        assert line.startswith(start), line


def test_password_file_parse_errors_name_the_line():
    """Unit check of the file format: comments and blank lines skipped; a duplicate user is refused."""
    h = hash_password(b"pw", rounds=4)
    assert 2 == len(PasswordFile.parse(f"# c\n\na:{h}\nb:{h}\n"))
    with pytest.raises(ConfigError, match="line 2: user 'a' given twice"):
        PasswordFile.parse(f"a:{h}\na:{h}\n", source="f")
    with pytest.raises(ConfigError, match="line 1: not a bcrypt hash"):
        PasswordFile.parse("a:plaintext\n", source="f")
