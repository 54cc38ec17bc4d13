"""Submission ports (issue 16.5): several listeners, each with its own mode, in one real daemon.

One daemon listens on a plain SMTP port (``--listen``, as before), a ``submission`` port (RFC 6409: STARTTLS,
then AUTH, then mail) and an ``smtps`` port (RFC 8314: TLS from the first byte), configured with
``[listeners."127.0.0.1:PORT"]`` tables. A local CA made with trustme issues the server certificate; clients
verify it against that CA. swaks drives the submission ports, smtplib and raw sockets check the exact
replies, and every message is followed to the real sink. ``sender_login_map`` restricts which envelope
senders each login may use (Postfix smtpd_sender_login_maps + reject_authenticated_sender_login_mismatch).
"""

from __future__ import annotations

import smtplib
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from edgekit import HOST, EdgeRelay

from mtaq.config import Config, Listener, ListenerConfig, listeners_of, load_config
from mtaq.edge.policy import EdgePolicy, parse_sender_logins
from mtaq.testing.procs import free_port, read_events, start_daemon, start_sink

trustme = pytest.importorskip("trustme")

USERS = {"alice": "correct horse battery staple", "bob": "tr0ub4dor&3"}
SENDER_LOGIN_MAP = '[sender_login_map]\n"alice@example.org" = "alice"\n"@shared.test" = ["alice", "bob"]\n'


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A local CA (trustme) and a certificate it issued for mx.test and 127.0.0.1: paths of ca.pem (what
    clients trust), cert.pem (the chain) and key.pem."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert(HOST, "127.0.0.1")
    paths = {"ca": str(d / "ca.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem")}
    ca.cert_pem.write_to_path(paths["ca"])
    Path(paths["cert"]).write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(paths["key"])
    Path(paths["key"]).chmod(0o600)  # readable by group or others: refused at start (issue 32.9)
    return paths


@pytest.fixture(scope="module")
def passwd_file(tmp_path_factory) -> str:
    """A password file for alice and bob, made with `mtaq passwd` (bcrypt cost 4: quick tests)."""
    lines = []
    for user, password in USERS.items():
        out = subprocess.run([sys.executable, "-m", "mtaq.cli", "passwd", user, "--rounds", "4"],
                             input=password + "\n", capture_output=True, text=True, timeout=60, check=True)
        lines.append(out.stdout)
    path = tmp_path_factory.mktemp("auth") / "passwd"
    path.write_text("".join(lines))
    path.chmod(0o600)  # group- or world-readable is refused at start (issue 33)
    return str(path)


class Ports:
    """The three listeners of the module's daemon, and the daemon itself (an EdgeRelay)."""

    def __init__(self, relay: EdgeRelay, submission: int, smtps: int) -> None:
        self.relay = relay
        self.smtp = relay.port
        self.submission = submission
        self.smtps = smtps


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, pki, passwd_file):
    """One daemon for the module: --listen 127.0.0.1:P (plain SMTP, mynetworks = loopback as by default),
    submission and smtps listeners from the config file, sender_login_map set."""
    submission, smtps = free_port(), free_port()
    config = (f'tls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
              f'auth_password_file = "{passwd_file}"\nsmtpd_error_sleep_time_s = 0\n' + SENDER_LOGIN_MAP +
              f'[listeners."127.0.0.1:{submission}"]\nmode = "submission"\n'
              f'[listeners."127.0.0.1:{smtps}"]\nmode = "smtps"\n')
    relay = EdgeRelay(tmp_path_factory.mktemp("relay"), config=config)
    try:
        relay.wait_for(lambda: relay.events("listening"), "the listening event")
        yield Ports(relay, submission, smtps)
    finally:
        relay.close()


def client_context(pki: dict[str, str]) -> ssl.SSLContext:
    """A client context that trusts only the test CA and checks the name mx.test."""
    return ssl.create_default_context(cafile=pki["ca"])


def swaks(port: int, pki: dict[str, str], *args: str, sender: str = "alice@example.org",
          to: str = "someone@elsewhere.test") -> subprocess.CompletedProcess[str]:
    """swaks to 127.0.0.1:``port`` verifying the server's certificate against the test CA."""
    return subprocess.run(
        ["swaks", "--server", f"127.0.0.1:{port}", "--helo", "client.test", "--from", sender, "--to", to,
         "--tls-verify", "--tls-ca-path", pki["ca"], "--tls-sni", HOST, "--timeout", "30",
         "--header", f"Subject: via {port}", *args],
        capture_output=True, text=True, timeout=120)


def delivered_with(relay: EdgeRelay, subject: str) -> bytes:
    """The sink's copy of the message with ``subject`` (waits for its delivery)."""
    def find() -> bytes | None:
        for msg in relay.sink_messages():
            if f"Subject: {subject}\r\n".encode() in msg:
                return msg
        return None
    return bytes(relay.wait_for(find, f"delivery of {subject!r}"))


def test_the_listening_event_names_every_listener_and_keeps_listen_for_the_first(daemon):
    """One `listening` event: `listen` is still the first listener (the --listen address), and `listeners`
    lists all three with their mode, TLS, AUTH and bound port, before any recovery (mail accepted at once)."""
    [event] = daemon.relay.events("listening")
    assert f"127.0.0.1:{daemon.smtp}" == event["listen"]
    assert [
        {"listen": f"127.0.0.1:{daemon.smtp}", "mode": "smtp", "tls": "may", "auth": "optional", "port": daemon.smtp},
        {"listen": f"127.0.0.1:{daemon.submission}", "mode": "submission", "tls": "encrypt", "auth": "required",
         "port": daemon.submission},
        {"listen": f"127.0.0.1:{daemon.smtps}", "mode": "smtps", "tls": "wrapper", "auth": "required",
         "port": daemon.smtps},
    ] == event["listeners"]


def test_submission_without_auth_gets_530_even_from_mynetworks(daemon, pki):
    """Port 587 from 127.0.0.1 (in mynetworks): before STARTTLS, MAIL gets `530 5.7.0 Must issue a STARTTLS
    command first` and AUTH is not offered; after it, EHLO offers AUTH and MAIL and RCPT get `530 5.7.0
    Authentication required` (Postfix smtpd_tls_auth_only + permit_sasl_authenticated, reject)."""
    with smtplib.SMTP("127.0.0.1", daemon.submission, timeout=30) as s:
        s.ehlo("client.test")
        assert s.has_extn("starttls") and not s.has_extn("auth")
        assert (530, b"5.7.0 Must issue a STARTTLS command first") == s.mail("a@example.org")
        s.starttls(context=client_context(pki))
        s.ehlo("client.test")
        assert s.has_extn("auth") and not s.has_extn("starttls")
        assert (530, b"5.7.0 Authentication required") == s.mail("alice@example.org")
        assert (530, b"5.7.0 Authentication required") == s.rcpt("someone@elsewhere.test")


def test_submission_swaks_starttls_and_auth_plain_relays_to_the_sink(daemon, pki):
    """swaks --tls --auth PLAIN on 587 relays to a foreign domain; the sink's copy says `with ESMTPSA`.
    The same swaks without --auth is refused at MAIL with 530 5.7.0."""
    denied = swaks(daemon.submission, pki, "--tls")
    assert 0 != denied.returncode and "530 5.7.0 Authentication required" in denied.stdout, denied.stdout
    ok = swaks(daemon.submission, pki, "--tls", "--auth", "PLAIN", "--auth-user", "alice",
               "--auth-password", USERS["alice"])
    assert 0 == ok.returncode, ok.stdout
    msg = delivered_with(daemon.relay, f"via {daemon.submission}")
    assert b"Delivered-To: someone@elsewhere.test\r\n" in msg and b"with ESMTPSA\r\n" in msg


def test_smtps_swaks_tls_on_connect_and_auth_relays_to_the_sink(daemon, pki):
    """swaks --tlsc (TLS from the first byte) --auth PLAIN on the smtps port relays; `with ESMTPSA`. Over
    smtplib.SMTP_SSL: the greeting comes inside TLS, EHLO offers AUTH and no STARTTLS, MAIL before AUTH gets
    530 5.7.0, and after AUTH MAIL is accepted."""
    ok = swaks(daemon.smtps, pki, "--tlsc", "--auth", "PLAIN", "--auth-user", "alice",
               "--auth-password", USERS["alice"])
    assert 0 == ok.returncode, ok.stdout
    msg = delivered_with(daemon.relay, f"via {daemon.smtps}")
    assert b"with ESMTPSA\r\n" in msg
    with smtplib.SMTP_SSL("127.0.0.1", daemon.smtps, timeout=30, context=client_context(pki)) as s:
        s.ehlo("client.test")
        assert s.has_extn("auth") and not s.has_extn("starttls")
        assert (530, b"5.7.0 Authentication required") == s.mail("alice@example.org")
        assert 235 == s.login("alice", USERS["alice"])[0]
        assert 250 == s.mail("alice@example.org")[0]


def test_smtps_plaintext_client_gets_no_smtp_greeting(daemon):
    """A client that speaks plain SMTP to the smtps port never sees a 220: the server waits for a TLS
    ClientHello, takes the EHLO line for a broken one and closes the connection."""
    with socket.create_connection(("127.0.0.1", daemon.smtps), timeout=30) as sock:
        sock.sendall(b"EHLO client.test\r\n")
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    assert b"220" not in received and b"ESMTP" not in received


def test_port_25_listener_is_unchanged(daemon, pki):
    """The --listen listener works as before: STARTTLS offered, no AUTH in the clear, and a client in
    mynetworks relays without AUTH (250 at MAIL, RCPT and DATA; delivered to the sink)."""
    with smtplib.SMTP("127.0.0.1", daemon.smtp, timeout=30) as s:
        s.ehlo("client.test")
        assert s.has_extn("starttls") and not s.has_extn("auth")
        assert 250 == s.mail("anyone@example.net")[0]
        assert 250 == s.rcpt("someone@elsewhere.test")[0]
        assert 250 == s.data(f"Subject: via {daemon.smtp}\r\n\r\nplain\r\n".encode())[0]
    assert b"with ESMTP\r\n" in delivered_with(daemon.relay, f"via {daemon.smtp}")


def test_sender_login_mismatch_is_553_and_an_owned_sender_250(daemon, pki):
    """sender_login_map: alice@example.org belongs to alice, @shared.test to alice and bob. Authenticated as
    bob, MAIL FROM alice@example.org gets Postfix's `553 5.7.1 <alice@example.org>: Sender address rejected:
    not owned by user bob`, an address in no entry too; bob@shared.test and <> are accepted. As alice,
    ALICE@Example.ORG (keys fold case) is accepted."""
    with smtplib.SMTP("127.0.0.1", daemon.submission, timeout=30) as s:
        s.starttls(context=client_context(pki))
        s.login("bob", USERS["bob"])
        assert (553, b"5.7.1 <alice@example.org>: Sender address rejected: not owned by user bob") == s.mail("alice@example.org")
        assert (553, b"5.7.1 <bob@example.net>: Sender address rejected: not owned by user bob") == s.mail("bob@example.net")
        assert 250 == s.mail("bob@shared.test")[0]
        s.rset()
        assert 250 == s.mail("")[0]
    with smtplib.SMTP_SSL("127.0.0.1", daemon.smtps, timeout=30, context=client_context(pki)) as s:
        s.login("alice", USERS["alice"])
        assert 250 == s.mail("ALICE@Example.ORG")[0]
    denied = swaks(daemon.submission, pki, "--tls", "--auth", "PLAIN", "--auth-user", "bob",
                   "--auth-password", USERS["bob"], sender="alice@example.org")
    assert "553 5.7.1 <alice@example.org>: Sender address rejected: not owned by user bob" in denied.stdout


def serve_with(tmp_path: Path, config: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`mtaq serve` with ``config`` (expected to refuse it before listening)."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(config)
    return subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", "--spool", str(tmp_path / "spool"),
                           "--admin-listen", "", "--config", str(cfg), *flags],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("config", "message"), [
    ('[listeners."127.0.0.1:1587"]\nmode = "submision"\n',
     """listeners."127.0.0.1:1587".mode: Invalid enum value 'submision'"""),
    ('[listeners."127.0.0.1:1587"]\nmode = "submission"\nauth = true\n',
     'listeners."127.0.0.1:1587": Object contains unknown field `auth`'),
    ('[listeners."127.0.0.1:1587"]\nauth_required = "yes"\n',
     'listeners."127.0.0.1:1587".auth_required: Expected `bool`, got `str`'),
    ('[listeners."127.0.0.1"]\nmode = "smtp"\n', """listeners."127.0.0.1": '127.0.0.1' has no port"""),
    ('[listeners."127.0.0.1:1587"]\nmode = "submission"\n',
     """listeners."127.0.0.1:1587": mode 'submission' (TLS required) needs tls_cert_file and tls_key_file"""),
    ('listen = ["127.0.0.1:1525", "127.0.0.1:01525"]\n',
     "listen[1]: '127.0.0.1:01525' is the same address as '127.0.0.1:1525'"),
    ('listen = 25\n', "listen: Expected `str | array`, got `int`"),
    ('listen = []\n', "listen: no SMTP listener (give listen an address, or a listeners table)"),
    ('[sender_login_map]\n"alice" = "alice"\n',
     'sender_login_map."alice": not an address (user@example.org) or a domain (@example.org)'),
    ('[sender_login_map]\n"@example.org" = []\n',
     """sender_login_map."@example.org": give one or more login names ("alice" or ["alice", "bob"])"""),
])
def test_bad_listener_config_exits_2_with_one_line_naming_the_key(tmp_path, config, message):
    """Each bad listeners / listen / sender_login_map setting stops `mtaq serve` with status 2 and one line
    on stderr that names the key."""
    r = serve_with(tmp_path, config)
    assert 2 == r.returncode
    [line] = r.stderr.splitlines()
    assert line.startswith("mtaq: ") and line.endswith(message), line


def test_smtps_with_starttls_required_is_refused(tmp_path, pki, passwd_file):
    """smtps with smtpd_tls_security_level = "encrypt" (STARTTLS, which implicit TLS never offers): exit 2."""
    r = serve_with(tmp_path, f'tls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
                             f'auth_password_file = "{passwd_file}"\n'
                             '[listeners."127.0.0.1:1465"]\nmode = "smtps"\nsmtpd_tls_security_level = "encrypt"\n')
    assert 2 == r.returncode
    assert ['mtaq: listeners."127.0.0.1:1465".smtpd_tls_security_level: "encrypt" means STARTTLS, which a '
            "smtpd_tls_wrappermode listener does not offer (its TLS starts with the connection)"] == r.stderr.splitlines()


def test_listeners_resolve_modes_overrides_and_order():
    """listen entries come first, in order, then tables for other addresses; a table for a listen address
    sets its mode; a per-listener key overrides the mode's default."""
    cfg = Config(listen=["127.0.0.1:25", "[::1]:587"], tls_cert_file="c", tls_key_file="k", auth_password_file="p",
                 listeners={"[::1]:587": msgspec_convert({"mode": "submission"}),
                            "0.0.0.0:465": msgspec_convert({"mode": "smtps"}),
                            "0.0.0.0:2587": msgspec_convert({"mode": "submission", "auth_required": False})})
    assert [
        Listener(address="127.0.0.1:25", host="127.0.0.1", port=25),
        Listener(address="[::1]:587", host="::1", port=587, mode="submission", tls_required=True, auth_required=True),
        Listener(address="0.0.0.0:465", host="0.0.0.0", port=465, mode="smtps", wrappermode=True, auth_required=True),
        Listener(address="0.0.0.0:2587", host="0.0.0.0", port=2587, mode="submission", tls_required=True),
    ] == listeners_of(cfg)
    assert [Listener(address="127.0.0.1:2525", host="127.0.0.1", port=2525)] == listeners_of(Config())


def msgspec_convert(table: dict[str, object]) -> ListenerConfig:
    return msgspec.convert(table, ListenerConfig)


def test_listen_flag_replaces_listen_and_tables_still_add_their_listeners(tmp_path):
    """--listen (one address or a comma list) replaces the config's listen; listeners tables still add
    theirs. The config file's own listen is kept when the flag is absent."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('listen = "127.0.0.1:25"\n[listeners."127.0.0.1:2600"]\nmode = "smtp"\n')
    assert ["127.0.0.1:25", "127.0.0.1:2600"] == [x.address for x in listeners_of(load_config(str(cfg), {}))]
    from mtaq.cli import _comma_list

    got = load_config(str(cfg), {"listen": _comma_list("127.0.0.1:1,127.0.0.1:2")})
    assert ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:2600"] == [x.address for x in listeners_of(got)]


def test_sender_login_reply_lookup_order_and_case():
    """The address is looked up, then its @domain; keys fold ASCII case and IDNA (bücher.test is
    xn--bcher-kva.test); login names compare without case; <> is never checked; no map, no check."""
    pol = EdgePolicy(sender_logins=parse_sender_logins({"Alice@Example.org": "alice", "@bücher.test": "Bob, carol",
                                                        "bob@example.org": ["bob"]}))
    assert pol.sender_login_reply("alice@EXAMPLE.org", "ALICE") is None
    assert pol.sender_login_reply("x@xn--bcher-kva.test", "bob") is None
    assert pol.sender_login_reply("x@bücher.test", "carol") is None
    assert pol.sender_login_reply("<>", "dave") is None
    assert ("553 5.7.1 <bob@example.org>: Sender address rejected: not owned by user carol"
            == pol.sender_login_reply("bob@example.org", "carol"))
    assert ("553 5.7.1 <z@nowhere.test>: Sender address rejected: not owned by user alice"
            == pol.sender_login_reply("z@nowhere.test", "alice"))
    assert EdgePolicy().sender_login_reply("z@nowhere.test", "alice") is None


def test_two_workers_listen_on_every_listener(tmp_path, pki, passwd_file):
    """workers = 2: each worker (shard 0 and 1) logs its own `listening` event naming all the listeners
    (the sockets bound once, every worker accepting on them), and mail submitted on the smtps port is delivered."""
    submission, smtps = free_port(), free_port()
    conf = tmp_path / "mtaq.toml"
    conf.write_text(f'workers = 2\nmyhostname = "{HOST}"\ntls_cert_file = "{pki["cert"]}"\n'
                    f'tls_key_file = "{pki["key"]}"\nauth_password_file = "{passwd_file}"\n'
                    f'[listeners."127.0.0.1:{submission}"]\nmode = "submission"\n'
                    f'[listeners."127.0.0.1:{smtps}"]\nmode = "smtps"\n')
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    try:
        d = start_daemon(str(tmp_path / "spool"), sink.port, str(tmp_path / "daemon.log"), config=str(conf), workers=None)
        try:
            events = wait_until(lambda: (lambda ev: ev if len(ev) == 2 else None)(
                [e for e in read_events(d.log_path) if e.get("event") == "listening"]), "two listening events")
            assert [0, 1] == sorted(e["shard"] for e in events)
            for e in events:
                assert [d.port, submission, smtps] == [x["port"] for x in e["listeners"]]
            ok = swaks(smtps, pki, "--tlsc", "--auth", "PLAIN", "--auth-user", "alice",
                       "--auth-password", USERS["alice"])
            assert 0 == ok.returncode, ok.stdout
            new = tmp_path / "maildir" / "new"
            wait_until(lambda: new.is_dir() and any(f"Subject: via {smtps}\r\n".encode() in f.read_bytes()
                                                    for f in new.iterdir()), "delivery")
        finally:
            d.kill9()
    finally:
        sink.kill9()


def wait_until(pred, what: str, timeout_s: float = 30.0):
    """``pred()`` once it is true (polled every 50 ms); AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
