"""Relay through a provider (issue 16): outbound AUTH, implicit TLS (port 465), verified TLS levels.

The daemon runs as a subprocess (``mtaq serve``); its next hops are real aiosmtpd servers in a thread of the
test, listening on 127.0.0.1 and named ``mail.provider.test`` by a real DNS server (``ZoneServer``). A local CA
made by ``trustme`` (the daemon's ``smtp_tls_CAfile``) issues their certificates: good, expired, for the wrong
name; a second, unknown CA stands in for a self-signed one. Every test waits for the event it checks.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import smtplib
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword

from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.procs import Proc, free_port, read_events, start_daemon, wait_for

trustme = pytest.importorskip("trustme")

PASSWORD = "s3cret:Pass phrase-771"  # a ':' and a space: the password is the rest of the line
USER = "relay@provider.test"
NAME = "mail.provider.test"
BODY = b"From: a@origin.test\r\nSubject: provider\r\nMessage-ID: <{mid}>\r\n\r\nvia the provider\r\n"


class Hop:
    """An aiosmtpd next hop in a thread of its own: STARTTLS (or TLS from the first byte with ``implicit``),
    AUTH required and accepted for ``USER``/``PASSWORD`` only (``auth=False``: no AUTH at all)."""

    def __init__(self, cert: tuple[str, str] | None, *, implicit: bool = False, auth: bool = True) -> None:
        self.port = free_port()
        self.ctx: ssl.SSLContext | None = None
        if cert is not None:
            self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.ctx.load_cert_chain(*cert)
        self.implicit, self.auth = implicit, auth
        self.tried_users: list[str] = []  # the user names tried
        self.messages: list[tuple[str | None, str, list[str]]] = []  # (login, TLS version or "", recipients)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _authenticate(self, server, session, envelope, mechanism, data) -> AuthResult:
        assert isinstance(data, LoginPassword)
        self.tried_users.append(data.login.decode())
        ok = (data.login.decode(), data.password.decode()) == (USER, PASSWORD)
        return AuthResult(success=ok, handled=False, auth_data=data)  # handled=False: aiosmtpd replies 235/535

    async def handle_DATA(self, server, session, envelope) -> str:
        ssl_obj = server.transport.get_extra_info("ssl_object")
        login = session.auth_data.login.decode() if isinstance(session.auth_data, LoginPassword) else None
        self.messages.append((login, ssl_obj.version() if ssl_obj else "", list(envelope.rcpt_tos)))
        return "250 2.0.0 Ok: queued"

    def _factory(self) -> SMTP:
        return SMTP(self, hostname=NAME, loop=self.loop, tls_context=None if self.implicit else self.ctx,
                    auth_required=self.auth, auth_require_tls=not self.implicit and self.ctx is not None,
                    authenticator=self._authenticate if self.auth else None)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(self.loop.create_server(
            self._factory, "127.0.0.1", self.port, ssl=self.ctx if self.implicit else None))
        self._ready.set()
        self.loop.run_forever()

    def __enter__(self) -> Hop:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The trusted CA (as a PEM file), and PEM (cert, key) file pairs for the next hop's certificates."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    now = dt.datetime.now(dt.UTC)
    leaves = {
        "good": ca.issue_cert(NAME),
        "wrong-name": ca.issue_cert("other.example"),
        "expired": ca.issue_cert(NAME, not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1)),
    }
    out = {"ca": str(d / "ca.pem")}
    for kind, leaf in leaves.items():
        leaf.cert_chain_pems[0].write_to_path(str(d / f"{kind}.crt"))
        leaf.private_key_pem.write_to_path(str(d / f"{kind}.key"))
        out[kind] = (str(d / f"{kind}.crt"), str(d / f"{kind}.key"))
    stranger = trustme.CA()  # a root nobody trusts, presented as the server's own certificate: self-signed
    stranger.cert_pem.write_to_path(str(d / "self-signed.crt"))
    stranger.private_key_pem.write_to_path(str(d / "self-signed.key"))
    out["self-signed"] = (str(d / "self-signed.crt"), str(d / "self-signed.key"))
    return out


@pytest.fixture(scope="module")
def dns():
    with ZoneServer(f"{NAME}. IN A 127.0.0.1\nmx.origin.test. IN A 127.0.0.1\n") as z:
        yield z


class Daemon:
    """``mtaq serve`` relaying through the provider; ``password_mode`` is the password file's mode."""

    def __init__(self, tmp: Path, dns: ZoneServer, config: str, *, password_mode: int = 0o600,
                 user: str = USER, password: str = PASSWORD, workers: int = 1) -> None:
        self.tmp = tmp
        body, _, key = config.partition("@KEY@")
        sasl = ""
        if key:  # credentials for that password-file key
            pw = tmp / "sasl_passwd"
            pw.write_text(f"# provider\n{key} {user}:{password}\n")
            os.chmod(pw, password_mode)
            sasl = f'smtp_sasl_auth_enable = true\nsmtp_sasl_password_file = "{pw}"\n'
        (tmp / "mtaq.toml").write_text(
            f'dns_nameservers = ["127.0.0.1:{dns.port}"]\ndns_timeout_s = 2\nretry_intervals_s = [600]\n'
            + sasl + body)
        self.spool = str(tmp / "spool")
        self.workers = workers
        self.start()

    def start(self) -> None:
        before = len(self.events("listening")) if hasattr(self, "proc") else 0
        self.proc: Proc = start_daemon(self.spool, None, str(self.tmp / "daemon.log"), config=str(self.tmp / "mtaq.toml"),
                                       workers=self.workers)
        if self.workers > 1:
            wait_for(lambda: before + self.workers == len(self.events("listening")), 60, "every worker listening")

    def send(self, mid: str, rcpts: tuple[str, ...] = ("bob@example.net",)) -> str:
        with smtplib.SMTP("127.0.0.1", self.proc.port, timeout=30) as s:
            s.ehlo("client.test")
            s.mail("alice@origin.test")
            for r in rcpts:
                s.rcpt(r)
            code, text = s.data(BODY.replace(b"{mid}", mid.encode()))
        assert 250 == code
        return text.decode().rsplit(" ", 1)[1]

    def events(self, name: str, qid: str | None = None) -> list[dict]:
        return [e for e in read_events(self.proc.log_path)
                if e.get("event") == name and (qid is None or e.get("queue_id") == qid)]

    def wait_for(self, name: str, qid: str | None = None, timeout_s: float = 30.0) -> list[dict]:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.events(name, qid)
            if found:
                return found
            if not self.proc.alive():
                raise AssertionError(f"daemon exited: {self.proc.log_text()[-2000:]}")
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {name}")

    def close(self) -> None:
        self.proc.kill9()


@pytest.fixture
def daemons(tmp_path):
    made: list[Daemon] = []

    def make(dns: ZoneServer, config: str, **kw) -> Daemon:
        d = Daemon(tmp_path, dns, config, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def secrets_in(d: Daemon, qid: str | None = None, password: str = PASSWORD) -> list[str]:
    """Where the password (or its base64 forms in AUTH PLAIN / LOGIN) shows up: the daemon's log, the
    spool files, and ``mtaq queue show`` of ``qid``."""
    needles = [password.encode(), base64.b64encode(password.encode()),
               base64.b64encode(f"\0{USER}\0{password}".encode())]
    found = []
    for p in [Path(d.proc.log_path), *Path(d.spool).rglob("*")]:
        if p.is_file() and any(n in p.read_bytes() for n in needles):
            found.append(str(p))
    if qid is not None:
        for extra in ([], ["--json"]):
            out = subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", "show", qid, *extra, "--spool", d.spool],
                                 capture_output=True, timeout=60)
            assert 0 == out.returncode, out.stderr
            if any(n in out.stdout for n in needles):
                found.append(f"queue show {' '.join(extra)}")
    return found


# ------------------------------------------------------------------------------------------- AUTH, good path
def test_auth_over_starttls_with_a_verified_certificate_delivers(daemons, dns, pki):
    """relayhost [mail.provider.test]:PORT at level ``secure``, credentials keyed by that next hop as written:
    STARTTLS, the chain and the name verified, AUTH as USER; the event says ``TLSv1.x verified``; the
    password is nowhere in the log or the spool."""
    with Hop(pki["good"]) as hop:
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\nsmtp_tls_security_level = "secure"\n'
                         f'smtp_tls_CAfile = "{pki["ca"]}"\n@KEY@[{NAME}]:{hop.port}')
        d.send("<auth-ok@mtaq.test>")
        [ev] = d.wait_for("delivered")
        assert ev["tls"].startswith("TLSv1.") and ev["tls"].endswith(" verified")
        assert [(USER, ev["tls"].split()[0], ["bob@example.net"])] == hop.messages
        assert [] == secrets_in(d)


def test_implicit_tls_on_port_465_with_auth_delivers(daemons, dns, pki):
    """``smtps:[host]:port`` in transport_map: TLS from the first byte (RFC 8314), verified at ``verify``,
    then AUTH; no STARTTLS is involved (the server offers none)."""
    with Hop(pki["good"], implicit=True) as hop:
        d = daemons(dns, f'smtp_tls_CAfile = "{pki["ca"]}"\n[transport_map]\n"example.net" = "smtps:[{NAME}]:{hop.port}"\n'
                         f'[tls_policy_map]\n"example.net" = "verify"\n@KEY@[{NAME}]:{hop.port}')
        d.send("<implicit@mtaq.test>")
        [ev] = d.wait_for("delivered")
        assert ev["tls"].endswith(" verified")
        assert [(USER, ev["tls"].split()[0], ["bob@example.net"])] == hop.messages


def test_wrappermode_relayhost_with_sender_dependent_credentials(daemons, dns, pki):
    """``smtp_tls_wrappermode = true`` with relayhost, credentials found by the sender's domain
    (``@origin.test``, smtp_sender_dependent_authentication), level ``may`` (made ``encrypt``: no plaintext
    is possible on a TLS port): delivered, the event names the TLS version without ``verified``."""
    with Hop(pki["self-signed"], implicit=True) as hop:
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\nsmtp_tls_wrappermode = true\n'
                         "smtp_sender_dependent_authentication = true\n@KEY@@origin.test")
        d.send("<wrapper@mtaq.test>")
        [ev] = d.wait_for("delivered")
        assert ev["tls"].startswith("TLSv1.") and "verified" not in ev["tls"]
        assert [USER] == [m[0] for m in hop.messages]


# ------------------------------------------------------------------------------------------- AUTH failures
def test_535_defers_4_7_0_reports_sasl_auth_failed_and_holds_the_credentials(daemons, dns, pki):
    """A wrong password: the message is deferred ``4.7.0 SASL authentication failed; server … said: 535 …``
    (Postfix's wording), a ``sasl_auth_failed`` event names the relay and the code; the next message for the
    same hop is deferred with the remembered reply without a second AUTH (no account lock-out). The
    password is in no log line, spool file or ``mtaq queue show``."""
    with Hop(pki["good"]) as hop:
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\nsmtp_tls_security_level = "encrypt"\n'
                         f"@KEY@[{NAME}]:{hop.port}", password=PASSWORD + "-old")
        qid = d.send("<auth-bad@mtaq.test>")
        [fail] = d.wait_for("sasl_auth_failed", qid)
        [deferred] = d.wait_for("deferred", qid)
        relay = f"{NAME}[127.0.0.1]:{hop.port}"
        assert (relay, 535, USER) == (fail["relay"], fail["code"], fail["sasl_username"])
        assert "4.7.0" == deferred["dsn"]
        assert deferred["reply"].startswith(f"454 4.7.0 SASL authentication failed; server {relay} said: 535")
        # The refusal came inside a TLS session (level encrypt: not verified): the event says so (before: none).
        assert deferred["tls"] in ("TLSv1.2", "TLSv1.3"), deferred["tls"]
        qid2 = d.send("<auth-bad-2@mtaq.test>")
        [deferred2] = d.wait_for("deferred", qid2)
        assert "4.7.0" == deferred2["dsn"] and "not tried again for" in deferred2["reply"]
        assert [USER] == hop.tried_users and [] == hop.messages
        assert [] == d.events("sasl_auth_failed", qid2)
        assert [] == secrets_in(d, qid, password=PASSWORD + "-old")


def test_the_sasl_hold_is_the_hosts_across_workers_and_a_restart(daemons, dns, pki):
    """A wrong password with two workers: the first 535 holds the credentials for every worker (one AUTH
    tried at the provider, however many messages reach either worker), and after a kill -9 and a start the
    hold still stands (SPOOL/sasl_hold): a restart loop cannot lock the account. Before, each worker process
    tried the refused password once (newcomer finding, issue 33)."""
    with Hop(pki["good"]) as hop:
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\nsmtp_tls_security_level = "encrypt"\n'
                         f"@KEY@[{NAME}]:{hop.port}", password=PASSWORD + "-old", workers=2)
        first = d.send("<hold-0@mtaq.test>")
        d.wait_for("sasl_auth_failed", first)
        shards: dict[int, str] = {}
        for i in range(1, 40):  # until a message has been queued by each worker (the kernel picks the worker)
            qid = d.send(f"<hold-{i}@mtaq.test>")
            [deferred] = d.wait_for("deferred", qid)
            assert "not tried again for" in deferred["reply"], deferred["reply"]
            shards[deferred["shard"]] = qid
            if len(shards) == 2:
                break
        assert {0, 1} == set(shards)
        assert [USER] == hop.tried_users
        d.close()
        d.start()
        qid = d.send("<hold-after-restart@mtaq.test>")
        [deferred] = d.wait_for("deferred", qid)
        assert "not tried again for" in deferred["reply"]
        assert [USER] == hop.tried_users and [] == hop.messages
        assert [] == secrets_in(d, password=PASSWORD + "-old")


def test_no_auth_without_tls_unless_allowed(daemons, dns):
    """A next hop that offers AUTH without TLS: nothing is sent (``4.7.0 … no TLS session``), the password
    never crosses the network; the event says why."""
    with Hop(None) as hop:
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\n@KEY@[{NAME}]:{hop.port}')
        qid = d.send("<no-plain-auth@mtaq.test>")
        [deferred] = d.wait_for("deferred", qid)
        assert "4.7.0" == deferred["dsn"] and "no TLS session (smtp_sasl_allow_plaintext = false)" in deferred["reply"]
        assert ([], []) == (hop.tried_users, hop.messages)


def test_password_file_readable_by_group_stops_the_start(tmp_path, dns):
    """Mode 0640: ``mtaq serve`` exits 2 with one line naming the file and the mode, and no secret."""
    pw = tmp_path / "sasl_passwd"
    pw.write_text(f"[{NAME}]:587 {USER}:{PASSWORD}\n")
    os.chmod(pw, 0o640)
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text(f'smtp_sasl_auth_enable = true\nsmtp_sasl_password_file = "{pw}"\n')
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", "--spool", str(tmp_path / "spool"),
                          "--listen", f"127.0.0.1:{free_port()}", "--admin-listen", "", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert 2 == out.returncode
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"mtaq: {pw}: smtp_sasl_password_file: mode 0640 gives group or other access")
    assert PASSWORD not in out.stderr + out.stdout


# ----------------------------------------------------------------------------------- certificate failures
@pytest.mark.parametrize(
    ("cert", "level", "implicit", "expected"),
    [
        ("expired", "verify", False, "Server certificate not trusted: host {relay}: certificate has expired"),
        ("self-signed", "secure", False, "Server certificate not trusted: host {relay}: self-signed certificate"),
        ("wrong-name", "secure", False, "Server certificate not verified: host {relay}: the certificate names none of mail.provider.test"),
        ("wrong-name", "verify", True, "Server certificate not verified: host {relay}: the certificate names none of mail.provider.test"),
        ("expired", "encrypt", True, None),  # encrypt does not verify: delivered
    ],
)
def test_certificate_failures_defer_4_7_5_with_postfix_wording(daemons, dns, pki, cert, level, implicit, expected):
    """At ``verify``/``secure`` an expired or self-signed certificate is "not trusted", one for another name
    "not verified" (Postfix's 4.7.5 texts), over STARTTLS and over implicit TLS; nothing reaches the hop and
    no AUTH is tried before the certificate is accepted. ``encrypt`` takes the same expired certificate."""
    with Hop(pki[cert], implicit=implicit, auth=False) as hop:
        wrap = "smtp_tls_wrappermode = true\n" if implicit else ""
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\nsmtp_tls_security_level = "{level}"\n{wrap}'
                         f'smtp_tls_CAfile = "{pki["ca"]}"\n')
        qid = d.send(f"<cert-{cert}-{level}@mtaq.test>")
        relay = f"{NAME}[127.0.0.1]:{hop.port}"
        if expected is None:
            [ev] = d.wait_for("delivered", qid)
            assert ev["tls"].startswith("TLSv1.") and 1 == len(hop.messages)
            return
        [deferred] = d.wait_for("deferred", qid)
        assert ("4.7.5", f"450 4.7.5 {expected.format(relay=relay)}") == (deferred["dsn"], deferred["reply"])
        assert [] == hop.messages
