"""``mtaq reload`` and SIGHUP (issue 33.3; Postfix's ``postfix reload``): the configuration read again for new
SMTP sessions and new delivery attempts, without a kill -9.

Real daemons (subprocesses, started as root: they read the files again as mail_owner ``mtaq``), the real
sink, real TLS (trustme), the real ``mtaq reload`` command over the admin API, real signals. Every test waits
for the event, reply or file it checks.
"""

from __future__ import annotations

import asyncio
import email
import hashlib
import json
import os
import pwd
import signal
import smtplib
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import dkim
import pytest
import test_outbound_auth_tls
from test_dkim import dnsfunc_for, keygen, message
from test_outbound_auth_tls import NAME, PASSWORD, USER, Hop

from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.procs import maildir_message_ids, read_events, start_daemon, start_sink, wait_for

trustme = pytest.importorskip("trustme")

HOST = "mx.test"
# The next hop of the SASL test: a real aiosmtpd server with STARTTLS and AUTH, named by a real DNS server.
pki, dns, daemons = test_outbound_auth_tls.pki, test_outbound_auth_tls.dns, test_outbound_auth_tls.daemons


def mtaq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=timeout)


def reload(spool: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``mtaq reload --spool SPOOL`` (as root: the token is read from SPOOL/admin.token)."""
    return mtaq("reload", "--spool", spool, *extra)


def give_to_mail_owner(*paths: str) -> None:
    """Files the daemon reads again after its start: it runs as mail_owner then (mode 0600 kept)."""
    mtaq_user = pwd.getpwnam("mtaq")
    for p in paths:
        os.chown(p, mtaq_user.pw_uid, mtaq_user.pw_gid)


@pytest.fixture
def certs(tmp_path):
    """Two certificates for mx.test from one CA ("old" and "new") as PEM files, and the paths the daemon's
    configuration names (holding "old" at first): what a certificate renewal replaces in place."""
    ca = trustme.CA()
    d = tmp_path / "tls"
    d.mkdir()
    out: dict[str, str] = {"ca": str(d / "ca.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem")}
    ca.cert_pem.write_to_path(out["ca"])
    for name in ("old", "new", "other"):
        leaf = ca.issue_cert(HOST, "127.0.0.1")
        Path(d / f"{name}.crt").write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(d / f"{name}.key"))
        out[name] = str(d / f"{name}.crt")
        out[f"{name}_key"] = str(d / f"{name}.key")
    install(out, "old")
    return out


def install(certs: dict[str, str], name: str, key: str | None = None) -> None:
    """Copy the ``name`` certificate (and its key, or ``key``'s) over the configured files, mode 0600,
    owned by mail_owner."""
    Path(certs["cert"]).write_bytes(Path(certs[name]).read_bytes())
    Path(certs["key"]).write_bytes(Path(certs[f"{key or name}_key"]).read_bytes())
    for p in (certs["cert"], certs["key"]):
        os.chmod(p, 0o600)
    give_to_mail_owner(certs["cert"], certs["key"])


def fingerprint(pem_file: str) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(Path(pem_file).read_text())).hexdigest()


def starttls_session(port: int, ca: str) -> tuple[smtplib.SMTP, str]:
    """A new SMTP session after STARTTLS (the certificate verified against the test CA); its SHA-256
    certificate fingerprint."""
    s = smtplib.SMTP("127.0.0.1", port, timeout=30)
    s.ehlo("client.test")
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False  # verified against the CA; the name is 127.0.0.1's
    s.starttls(context=ctx)
    s.ehlo("client.test")
    der = s.sock.getpeercert(binary_form=True)
    return s, hashlib.sha256(der).hexdigest()


def msg(mid: str) -> bytes:
    return f"From: a@example.org\r\nTo: b@example.net\r\nSubject: {mid}\r\nMessage-ID: <{mid}>\r\n\r\nhello\r\n".encode()


def tls_config(certs: dict[str, str], extra: str = "") -> str:
    return f'tls_cert_file = "{certs["cert"]}"\ntls_key_file = "{certs["key"]}"\n' + extra


# ------------------------------------------------------------------------------------------- the done-when
def test_a_certificate_change_under_load_refuses_no_session_duplicates_nothing_and_serves_the_new_one(
        relay_factory, certs):
    """Four clients send without pause, each message on a new STARTTLS session; a fifth session is opened
    (STARTTLS, MAIL, RCPT) before the certificate files are replaced and `mtaq reload` runs. Then: `mtaq
    reload` exits 0; no session was refused or failed; the session opened before finishes with 250 on the
    old certificate; every session started after the reload returned gets the new certificate; every
    message is delivered exactly once."""
    r = relay_factory(config=tls_config(certs))
    port, old, new = r.daemon.port, fingerprint(certs["old"]), fingerprint(certs["new"])
    results: list[tuple[float, str, int]] = []  # (start, fingerprint, DATA reply code) per session
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            started = time.monotonic()
            try:
                s, fp = starttls_session(port, certs["ca"])
                with s:
                    s.mail("a@example.org")
                    s.rcpt("b@example.net")
                    code, _ = s.data(msg(f"load-{k}-{i}@t"))
                with lock:
                    results.append((started, fp, code))
            except (OSError, smtplib.SMTPException) as exc:
                errors.append(f"client {k} session {i}: {type(exc).__name__}: {exc}")
                return

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(results) >= 8, 30, "8 sessions before the reload")
    early, early_fp = starttls_session(port, certs["ca"])
    early.mail("a@example.org")
    early.rcpt("b@example.net")
    install(certs, "new")
    out = reload(r.spool)
    reloaded_at = time.monotonic()
    assert 0 == out.returncode, out.stderr
    n = len(results)
    wait_for(lambda: len([x for x in results if x[0] > reloaded_at]) >= 8, 30, "8 sessions after the reload")
    code, _ = early.data(msg("early@t"))
    early.quit()
    stop.set()
    for t in threads:
        t.join(30)
    print(f"sessions: {len(results) + 1}, of which after the reload: {len([x for x in results if x[0] > reloaded_at])}")
    assert [] == errors
    assert (old, 250) == (early_fp, code)
    assert {250} == {c for _, _, c in results}
    assert {new} == {fp for start, fp, _ in results if start > reloaded_at}
    assert old in {fp for _, fp, _ in results[:n]}
    sent = len(results) + 1
    ids = r.wait_for(lambda: (c := maildir_message_ids(r.maildir)) and sum(c.values()) >= sent and c,
                     timeout_s=60, what=f"{sent} deliveries")
    assert {1} == set(ids.values())
    assert sent == len(ids) and "<early@t>" in ids
    assert all(m.startswith("<load-") for m in set(ids) - {"<early@t>"})
    [ev] = r.events("reloaded")
    assert ("admin API", [], []) == (ev["trigger"], ev["changed"], ev["restart_needed"])
    assert [] == r.events("reload_failed")


# ------------------------------------------------------------------------------------ nothing changes when bad
@pytest.mark.parametrize("breakage", ["key-mismatch", "root-only-key", "world-readable-key", "bad-toml"])
def test_a_bad_new_configuration_changes_nothing_and_says_why(relay_factory, certs, breakage):
    """The new files are wrong: a key that is not the certificate's, a key only root can read (the daemon
    reads it as mail_owner now), a key others may read (as `mtaq serve` and `mtaq check` refuse it), a
    configuration file that is not TOML (with a relay_domains change that
    must not be applied either). `mtaq reload` exits 1 with one line naming the problem; a `reload_failed`
    event; a new session still gets the old certificate and the old relay control."""
    r = relay_factory(config=tls_config(certs))
    old = fingerprint(certs["old"])
    if breakage == "key-mismatch":
        install(certs, "new", key="other")
        expected = "tls_key_file does not match tls_cert_file"
    elif breakage == "world-readable-key":  # refused at a start (mtaq check): refused by a reload too
        install(certs, "new")
        os.chmod(certs["key"], 0o644)
        expected = f"tls_key_file: {certs['key']} has mode 0644: it must be readable only by its owner"
    elif breakage == "root-only-key":
        install(certs, "new")
        os.chown(certs["key"], 0, 0)
        expected = f"tls_key_file: {certs['key']}: not readable by mtaq"
    else:
        install(certs, "new")
        assert r.config is not None
        Path(r.config).write_text(tls_config(certs, 'relay_domains = ["example.net"]\nmynetworks = [\n'))
        expected = f"{r.config}: "
    out = reload(r.spool)
    assert 1 == out.returncode
    lines = out.stderr.splitlines()
    assert any(line.startswith("mtaq: reload: daemon: ") and expected in line for line in lines), out.stderr
    assert "mtaq: reload: daemon: nothing changed" in lines
    [ev] = r.wait_for(lambda: r.events("reload_failed"), what="reload_failed")
    assert any(expected in p for p in ev["problems"])
    assert [] == r.events("reloaded")
    s, fp = starttls_session(r.daemon.port, certs["ca"])
    with s:
        assert old == fp
    if breakage == "root-only-key":
        assert "or restart mtaq" in ev["problems"][0]


# ---------------------------------------------------------------------------------- what needs a restart
def test_a_key_that_needs_a_restart_is_named_and_kept_while_the_others_apply(relay_factory, certs):
    """relay_domains (reloadable) and smtp_connection_cache_max, segment_bytes_max (restart only) change:
    exit 0, `mtaq reload` names the two it kept on stderr; the answer (--json) and the `reloaded` event say
    which applied and which wait; a client outside mynetworks may now send to the new relay domain."""
    r = relay_factory(config=tls_config(certs, 'mynetworks = ["127.0.0.1/32"]\n'))

    def rcpt_from_outside() -> int:
        with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30, source_address=("127.0.0.2", 0)) as s:
            s.ehlo("outside.test")
            s.mail("x@outside.test")
            return s.rcpt("b@example.net")[0]

    assert 554 == rcpt_from_outside()
    assert r.config is not None
    Path(r.config).write_text(tls_config(certs, 'mynetworks = ["127.0.0.1/32"]\nrelay_domains = ["example.net"]\n'
                                                "smtp_connection_cache_max = 3\nsegment_bytes_max = 1048576\n"))
    out = reload(r.spool, "--json")
    assert 0 == out.returncode, out.stderr
    answer = json.loads(out.stdout)
    [w] = answer["workers"]
    assert (True, ["relay_domains"], ["smtp_connection_cache_max", "segment_bytes_max"]) == (
        answer["applied"], w["changed"], w["restart_needed"])
    assert ("mtaq: reload: daemon: needs a restart to change (kept as they were): smtp_connection_cache_max, "
            "segment_bytes_max\n") == out.stderr
    [ev] = r.events("reloaded")
    assert (["relay_domains"], ["smtp_connection_cache_max", "segment_bytes_max"]) == (ev["changed"], ev["restart_needed"])
    assert 250 == rcpt_from_outside()


# --------------------------------------------------------------------------------------------- the SASL hold
def test_reload_ends_the_sasl_hold_of_a_changed_password(daemons, dns, pki, tmp_path):
    """The newcomer's finding: a refused smarthost password holds its credentials (535: the next message is
    deferred without a second AUTH). The password file is corrected and `mtaq reload` run: it says the hold
    of that entry ended, and the next message is delivered with the new password (a second AUTH, accepted)."""
    with Hop(pki["good"]) as hop:
        key = f"[{NAME}]:{hop.port}"
        d = daemons(dns, f'relayhost = "{key}"\nsmtp_tls_security_level = "encrypt"\n@KEY@{key}',
                    password=PASSWORD + "-old")
        qid = d.send("<auth-bad@mtaq.test>")
        d.wait_for("deferred", qid)
        qid2 = d.send("<auth-bad-2@mtaq.test>")
        [held] = d.wait_for("deferred", qid2)
        assert "not tried again for" in held["reply"]
        pw = tmp_path / "sasl_passwd"
        pw.write_text(f"# provider\n{key} {USER}:{PASSWORD}\n")
        give_to_mail_owner(str(pw))  # mode 0600 kept
        out = reload(d.spool)
        assert 0 == out.returncode, out.stderr
        assert f"daemon: SASL hold ended for the changed credentials of: {key.lower()}\n" in out.stdout
        [ev] = d.wait_for("reloaded")
        assert ([key.lower()], []) == (ev["sasl_hold_cleared"], ev["changed"])  # the file changed, not the key
        qid3 = d.send("<auth-good@mtaq.test>")
        [ok] = d.wait_for("delivered", qid3)
        assert ok["tls"].startswith("TLSv1.")
        assert [USER, USER] == hop.tried_users
        assert [(USER, ok["tls"].split()[0], ["bob@example.net"])] == hop.messages


def test_a_ca_file_replaced_in_place_is_read_again_by_the_next_verified_delivery(daemons, dns, pki, tmp_path):
    """smtp_tls_CAfile holds a CA that did not issue the next hop's certificate: level verify defers 4.7.5.
    The bundle is replaced at the same path by the right CA, `mtaq reload`, `mtaq queue flush ALL`: the
    message is delivered over a verified connection (the client contexts cached per file are made again)."""
    ca = tmp_path / "ca-bundle.pem"
    ca.write_bytes(Path(pki["self-signed"][0]).read_bytes())  # a root that did not sign the hop's certificate
    with Hop(pki["good"], auth=False) as hop:
        d = daemons(dns, f'relayhost = "[{NAME}]:{hop.port}"\nsmtp_tls_security_level = "verify"\n'
                         f'smtp_tls_CAfile = "{ca}"\n')
        qid = d.send("<ca@mtaq.test>")
        [deferred] = d.wait_for("deferred", qid)
        assert "4.7.5" == deferred["dsn"]
        ca.write_bytes(Path(pki["ca"]).read_bytes())
        out = reload(d.spool)
        assert 0 == out.returncode, out.stderr
        flush = mtaq("queue", "flush", "ALL", "--spool", d.spool)
        assert 0 == flush.returncode, flush.stderr
        [ok] = d.wait_for("delivered", qid)
        assert ok["tls"].endswith(" verified")
        assert [(None, ok["tls"].split()[0], ["bob@example.net"])] == hop.messages


# ----------------------------------------------------------------------------------------------------- DKIM
def test_a_new_dkim_key_signs_the_mail_queued_after_the_reload(relay_factory, tmp_path):
    """example.org's key is rolled over to a new selector (s2, a new key file readable by mail_owner);
    SIGHUP to the daemon reloads. A message queued before is signed s=s1, one queued after s=s2; both
    verify with dkimpy against a real DNS server holding both records."""
    key1, line1 = keygen(tmp_path, "example.org", "s1")
    key2, line2 = keygen(tmp_path, "example.org", "s2")
    give_to_mail_owner(key2)
    base = 'myhostname = "mx.example.org"\n[dkim_keys."example.org"]\nkey_file = "{}"\nselector = "{}"\n'
    r = relay_factory(config=base.format(key1, "s1"))

    def send(mid: str) -> None:
        with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
            s.ehlo("app.example.org")
            assert {} == s.sendmail("app@example.org", ["someone@example.net"],
                                    message(sender="CEO <ceo@example.org>", mid=mid))

    def stored(mid: str) -> bytes:
        def find() -> bytes | None:
            for sub in ("new", "cur"):
                d = Path(r.maildir, sub)
                for p in d.iterdir() if d.is_dir() else []:
                    data = p.read_bytes()
                    if email.message_from_bytes(data).get("Message-ID") == mid:
                        return data
            return None
        return bytes(r.wait_for(find, what=f"delivery of {mid}"))

    send("<before@example.org>")
    assert r.config is not None
    Path(r.config).write_text(base.format(key2, "s2"))
    r.daemon.popen.send_signal(signal.SIGHUP)
    [ev] = r.wait_for(lambda: r.events("reloaded"), what="reloaded")
    assert ("SIGHUP", ["dkim_keys"]) == (ev["trigger"], ev["changed"])
    send("<after@example.org>")
    before, after = stored("<before@example.org>"), stored("<after@example.org>")
    with ZoneServer(f"{line1}\n{line2}\n", origin="org.") as zone:
        check = dnsfunc_for(zone)
        assert dkim.verify(before, dnsfunc=check) and dkim.verify(after, dnsfunc=check)
    assert b"s=s1;" in before.replace(b" ", b"") and b"s=s2;" in after.replace(b" ", b"")


# -------------------------------------------------------------------------------------------------- workers
def test_every_worker_reloads_by_mtaq_reload_and_by_sighup_to_the_supervisor(relay_factory, tmp_path):
    """workers = 2: `mtaq reload --json` answers for shard 0 and shard 1, both applied (changed:
    relay_domains), and each worker logs `reloaded`; SIGHUP to the supervisor is passed on to both
    workers (two more `reloaded` events, trigger SIGHUP) and the daemon keeps serving."""
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"))
    cfg = tmp_path / "mtaq.toml"
    cfg.write_text("retry_intervals_s = [1.0]\n")
    spool = str(tmp_path / "spool")
    d = start_daemon(spool, sink.port, str(tmp_path / "daemon.log"), config=str(cfg), workers=2)
    try:
        def events(name: str) -> list[dict]:
            return [e for e in read_events(d.log_path) if e.get("event") == name]

        cfg.write_text('retry_intervals_s = [1.0]\nrelay_domains = ["example.net"]\n')
        out = reload(spool, "--json")
        assert 0 == out.returncode, out.stderr
        answer = json.loads(out.stdout)
        assert (True, [0, 1]) == (answer["applied"], [w["shard"] for w in answer["workers"]])
        assert [["relay_domains"], ["relay_domains"]] == [w["changed"] for w in answer["workers"]]
        def reloaded(trigger: str) -> list:
            return sorted(e.get("shard", e.get("process")) for e in events("reloaded") if e["trigger"] == trigger)

        wait_for(lambda: [0, 1] == reloaded("admin API"), 20, "both workers' reloaded events")
        wait_for(lambda: ["supervisor"] == reloaded("worker 0"), 20, "the anvil's limits read again")
        d.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: [0, 1] == reloaded("SIGHUP"), 20, "both workers reloaded by SIGHUP")
        assert [] == events("reload_failed")
        assert d.alive()
        with smtplib.SMTP("127.0.0.1", d.port, timeout=30) as s:
            assert {} == s.sendmail("a@example.org", ["b@example.net"], msg("after-hup@t"))
        wait_for(lambda: maildir_message_ids(str(tmp_path / "maildir")).get("<after-hup@t>"), 30, "delivery")
    finally:
        d.kill9()
        sink.kill9()


# ---------------------------------------------------------------------------- limits changed under traffic
def test_a_lowered_destination_limit_holds_from_the_reload_on_and_a_raised_one_frees_slots_at_once():
    """Throttle.update: example.net allows 2 deliveries at once and 2 are running; lowered to 1, a third
    waits until both have ended (never 2 at once from then on), not just one; raised to 3, two waiters
    start at once. The deliveries running at the reload are never cut."""
    from mtaq.delivery.throttle import DomainLimit, Throttle

    async def body() -> None:
        t = Throttle(DomainLimit(2))
        running: set[str] = set()
        peaks: list[int] = []
        ends = {name: asyncio.Event() for name in ("a", "b", "c", "d", "e")}
        started = {name: asyncio.Event() for name in ends}

        async def delivery(name: str) -> None:
            async with t.slots(["example.net"]):
                running.add(name)
                peaks.append(len(running))
                started[name].set()
                await ends[name].wait()
                running.discard(name)

        tasks = {n: asyncio.create_task(delivery(n)) for n in ("a", "b")}
        await asyncio.wait_for(asyncio.gather(started["a"].wait(), started["b"].wait()), 5)
        await t.update(DomainLimit(1))
        tasks["c"] = asyncio.create_task(delivery("c"))
        ends["a"].set()
        await tasks["a"]
        await asyncio.sleep(0.05)
        assert {"b"} == running  # the limit is 1 and b still runs: c waits
        ends["b"].set()
        await asyncio.wait_for(started["c"].wait(), 5)
        assert {"c"} == running
        tasks["d"] = asyncio.create_task(delivery("d"))
        tasks["e"] = asyncio.create_task(delivery("e"))
        await asyncio.sleep(0.05)
        assert {"c"} == running
        await t.update(DomainLimit(3))
        await asyncio.wait_for(asyncio.gather(started["d"].wait(), started["e"].wait()), 5)
        assert {"c", "d", "e"} == running
        for e in ends.values():
            e.set()
        await asyncio.gather(*tasks.values())
        assert [1, 2, 1, 2, 3] == peaks

    asyncio.run(body())


def test_a_lowered_connections_max_admits_nobody_until_the_connections_before_it_are_fewer():
    """ConnectionGate.configure: 3 connections admitted under connections_max 4, lowered to 2: the next is
    refused (none is ended), and admitted again once 2 have gone; a raised per-client rate keeps the
    client's recent connections (the window is not forgotten)."""
    from mtaq.edge.limits import ConnectionGate

    now = [0.0]
    g = ConnectionGate(connections_max=4, per_client_per_minute_max=5, clock=lambda: now[0])
    assert [None, None, None] == [g.admit("192.0.2.1") for _ in range(3)]
    g.configure(connections_max=2, per_client_per_minute_max=3, exempt=lambda ip: False,
                client_connections_max=0, mynetworks_reserve=0, auth_failures_per_minute_max=0)
    assert "too many connections from 192.0.2.1" == g.admit("192.0.2.1")  # 4 in the last minute: over 3
    assert "too many connections" == g.admit("192.0.2.2")
    g.release("192.0.2.1")
    g.release("192.0.2.1")
    assert (1, None) == (g.active, g.admit("192.0.2.2"))
