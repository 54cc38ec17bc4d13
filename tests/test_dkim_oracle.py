"""No DKIM signing oracle (issue 32.1): only mail from authenticated owners and mynetworks is signed.

Real daemons (subprocesses), real SMTP clients, real TLS (trustme) on a submission port, the real sink; every
signature is checked with dkimpy's verifier against keys served by a real DNS server
(:class:`mtaq.testing.dnsserver.ZoneServer`). "The internet" is a client bound to 127.0.0.2 with
``mynetworks = ["127.0.0.1/32"]``: it may send only to ``relay_domains`` (mtaq as their MX).
"""

from __future__ import annotations

import contextlib
import email
import email.policy
import smtplib
import subprocess
import sys

import dkim
import pytest
import test_submission
from test_dkim import _stored, dnsfunc_for, keygen, message
from test_submission import USERS, client_context

from mtaq.edge.dkim import Origin, Signer, load_key
from mtaq.testing.dnsserver import ZoneServer
from mtaq.testing.procs import free_port

pki, passwd_file = test_submission.pki, test_submission.passwd_file  # module fixtures: a local CA, alice and bob


def _keys(tmp_path, *domains: str) -> tuple[str, dict[str, str]]:
    """Keys for ``domains``: (the dkim_keys config tables, {top-level domain: the zone lines of its records})."""
    config, zones = "", {}
    for d in domains:
        key_file, line = keygen(tmp_path, d, "s1")
        config += f'[dkim_keys."{d}"]\nselector = "s1"\nkey_file = "{key_file}"\n'
        tld = d.rpartition(".")[2] + "."
        zones[tld] = zones.get(tld, "") + line + "\n"
    return config, zones


@contextlib.contextmanager
def _dns(zones: dict[str, str]):
    """One real DNS server per top-level zone; dkimpy's dnsfunc asks the one of the name's zone."""
    with contextlib.ExitStack() as stack:
        funcs = {tld: dnsfunc_for(stack.enter_context(ZoneServer(text, origin=tld))) for tld, text in zones.items()}

        def dnsfunc(name: bytes, timeout: float = 5) -> bytes | None:
            tld = name.decode("ascii").rstrip(".").rpartition(".")[2] + "."
            return funcs[tld](name, timeout) if tld in funcs else None

        yield dnsfunc


def _returned_original(dsn: bytes) -> bytes:
    """The message a DSN returns (its message/rfc822 or text/rfc822-headers part), as bytes."""
    msg = email.message_from_bytes(dsn, policy=email.policy.SMTP)
    for part in msg.walk():
        if part.get_content_type() == "message/rfc822":
            return part.get_payload(0).as_bytes(policy=email.policy.SMTP)
        if part.get_content_type() == "text/rfc822-headers":
            return part.get_payload(decode=True)
    raise AssertionError("no returned message in the DSN")


def test_mail_from_outside_for_a_relay_domain_is_not_signed_nor_the_original_its_dsn_returns(relay_factory, tmp_path):
    """The oracle of the issue: mtaq is example.org's MX (relay_domains) and holds its key. A client outside
    mynetworks, not authenticated, sends MAIL FROM:<attacker@evil.test> with `From: ceo@example.org` to
    ceo@example.org (delivered) and nobody@example.org (refused by the next hop: a DSN to the attacker).
    Neither the delivered copy, nor the original inside the DSN, nor the DSN itself (it quotes the forged
    headers; the DSN of signed mail is signed: tests/test_dkim.py) carries a DKIM-Signature; a
    `dkim_not_signed` event says why.
    Positive control: the same message from 127.0.0.1 (mynetworks) is signed and verifies."""
    keys, zone_text = _keys(tmp_path, "example.org")
    r = relay_factory(
        sink_args=["--reject-rcpt", "^nobody@"],
        config=('myhostname = "mx.example.org"\nretry_intervals_s = [1.0]\nmynetworks = ["127.0.0.1/32"]\n'
                'relay_domains = ["example.org"]\n' + keys),
    )
    spoof = message(sender="CEO <ceo@example.org>", subject="wire the money", mid="<spoof@evil.test>")
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30, source_address=("127.0.0.2", 0)) as s:
        s.ehlo("evil.test")
        assert {} == s.sendmail("attacker@evil.test", ["ceo@example.org", "nobody@example.org"], spoof)
    local = message(sender="CEO <ceo@example.org>", mid="<local@example.org>")
    with smtplib.SMTP("127.0.0.1", r.daemon.port, timeout=30) as s:
        s.ehlo("app.example.org")
        assert {} == s.sendmail("app@example.org", ["someone@example.net"], local)
    stored = r.wait_for(lambda: (m := _stored(r.maildir)) and len(m) == 3 and m, what="2 messages and a DSN")
    [dsn_mid] = [k for k in stored if k not in ("<spoof@evil.test>", "<local@example.org>")]
    dsn, delivered = stored[dsn_mid], stored["<spoof@evil.test>"]
    returned = _returned_original(dsn)
    assert b"Subject: wire the money" in returned
    with _dns(zone_text) as check:
        assert b"DKIM-Signature" not in delivered
        assert not dkim.verify(delivered, dnsfunc=check)
        assert b"DKIM-Signature" not in returned
        assert not dkim.verify(returned, dnsfunc=check)
        # mtaq's own DSN (From: MAILER-DAEMON@mx.example.org) quotes the forged From: and Subject: of an
        # original it did not sign: unsigned too, else a valid d=example.org message carries them for replay
        assert b"DKIM-Signature" not in dsn.split(b"\r\n\r\n", 1)[0]
        assert b"From: Mail Delivery System <MAILER-DAEMON@mx.example.org>" in dsn
        assert dkim.verify(stored["<local@example.org>"], dnsfunc=check)  # positive control: mynetworks
    [event] = r.events("dkim_not_signed")
    assert ("example.org", "attacker@evil.test", "", "client neither authenticated nor in mynetworks") == (
        event["domain"], event["sender"], event["login"], event["reason"])
    assert event["client"].startswith("127.0.0.2:")


@pytest.fixture(scope="module")
def qualified_passwd_file(tmp_path_factory, passwd_file) -> str:
    """alice and bob, and the login ``bob@bob.test`` with bob's password (an address as a login)."""
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "passwd", "bob@bob.test", "--rounds", "4"],
                         input=USERS["bob"] + "\n", capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path_factory.mktemp("auth-qualified") / "passwd"
    path.write_text(open(passwd_file).read() + out.stdout)
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize(("login_map", "login"), [(True, "bob"), (False, "bob@bob.test"), (False, "bob")],
                         ids=["sender_login_map", "no-map-address-login", "no-map-bare-login"])
def test_an_authenticated_user_gets_signatures_only_for_the_from_addresses_they_own(
        relay_factory, tmp_path, pki, qualified_passwd_file, login_map, login):
    """Port 587 (STARTTLS, AUTH), client on 127.0.0.1 (in mynetworks: the login's rule still decides). bob,
    held to @bob.test by sender_login_map, sends MAIL FROM:<bob@bob.test> with `From: ceo@example.org`: relayed
    unsigned (`dkim_not_signed`, the From: address is not his). Without a map, the From: domain must be the
    envelope sender's and the login an address at that domain (rspamd's allow_username_mismatch = false):
    the same message is unsigned too, and a bare login `bob` gets no signature even for `From: bob@bob.test`
    (else any login could sign for any keyed domain by naming it as envelope sender: review finding B3).
    Positive control: `From: bob@bob.test` is signed d=bob.test and verifies."""
    keys, zone_text = _keys(tmp_path, "example.org", "bob.test")
    submission = free_port()
    r = relay_factory(config=(
        f'tls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
        f'auth_password_file = "{qualified_passwd_file}"\n'
        + ('[sender_login_map]\n"@bob.test" = "bob"\n"alice@example.org" = "alice"\n' if login_map else "")
        + f'[listeners."127.0.0.1:{submission}"]\nmode = "submission"\n' + keys))
    r.wait_for(lambda: r.events("listening"), what="the listening event")
    with smtplib.SMTP("127.0.0.1", submission, timeout=30) as s:
        s.ehlo("client.test")
        s.starttls(context=client_context(pki))
        s.ehlo("client.test")
        s.login(login, USERS["bob"])
        for mid, author in (("<spoof@bob.test>", "CEO <ceo@example.org>"), ("<own@bob.test>", "Bob <bob@bob.test>")):
            assert {} == s.sendmail("bob@bob.test", ["someone@example.net"], message(sender=author, mid=mid))
    stored = r.wait_for(lambda: (m := _stored(r.maildir)) and len(m) == 2 and m, what="2 messages")
    signs_own = login_map or "@" in login
    with _dns(zone_text) as check:
        assert b"DKIM-Signature" not in stored["<spoof@bob.test>"]
        assert not dkim.verify(stored["<spoof@bob.test>"], dnsfunc=check)
        assert signs_own == dkim.verify(stored["<own@bob.test>"], dnsfunc=check)
        assert signs_own == (b"d=bob.test;" in stored["<own@bob.test>"])
    reason = ("From: address not owned by the login (sender_login_map)" if login_map
              else "From: domain is not the envelope sender's")
    expected = [("example.org", login, "bob@bob.test", reason)]
    if not signs_own:
        expected.append(("bob.test", login, "bob@bob.test",
                         "login is not an address at the From: domain (no sender_login_map)"))
    assert expected == [(e["domain"], e["login"], e["sender"], e["reason"])
                        for e in r.wait_for(lambda: len(r.events("dkim_not_signed")) == len(expected)
                                            and r.events("dkim_not_signed"), what="the dkim_not_signed events")]


def test_who_is_signed_for_follows_dkim_sign_clients(tmp_path):
    """The decision alone, for each kind of client (Signer.permits): mynetworks signs any From: unless
    dkim_sign_clients leaves it out; an owner's login signs its own From:, never another's."""
    key_file, _ = keygen(tmp_path, "example.org", "s1")
    key = load_key("example.org", "s1", key_file)
    head = b"From: CEO <ceo@example.org>\r\nSubject: x\r\n\r\n"
    local = Origin(client="127.0.0.1:1", mynetworks=True, login="", mail_from="app@other.test")
    outside = Origin(client="127.0.0.2:1", mynetworks=False, login="", mail_from="ceo@example.org")
    owner = Origin(client="127.0.0.2:1", mynetworks=False, login="ceo", mail_from="ceo@example.org",
                   owns=lambda a: a == "ceo@example.org")
    other = Origin(client="127.0.0.1:1", mynetworks=True, login="bob", mail_from="bob@bob.test",
                   owns=lambda a: a.endswith("@bob.test"))
    default = Signer([key])
    assert [None, "client neither authenticated nor in mynetworks", None,
            "From: address not owned by the login (sender_login_map)"] == [
        default.permits(o, head) for o in (local, outside, owner, other)]
    only_auth = Signer([key], ["authenticated"])
    assert "mynetworks clients are not signed for (dkim_sign_clients)" == only_auth.permits(local, head)
    assert None is only_auth.permits(owner, head)
    only_local = Signer([key], ["mynetworks"])
    assert None is only_local.permits(other, head)  # in mynetworks: signed as any mynetworks client
    assert "authenticated clients are not signed for (dkim_sign_clients)" == only_local.permits(owner, head)
    assert key is default.choose(head, owner)
    # Without sender_login_map (owns None): the login must be an address at the From: domain (B3), unless
    # dkim_allow_username_mismatch; the From: domain must be the envelope sender's either way.
    bare = Origin(client="127.0.0.2:1", mynetworks=False, login="mallory", mail_from="ceo@example.org")
    qualified = Origin(client="127.0.0.2:1", mynetworks=False, login="ceo@EXAMPLE.org", mail_from="ceo@example.org")
    elsewhere = Origin(client="127.0.0.2:1", mynetworks=False, login="mallory@evil.test", mail_from="ceo@example.org")
    assert ["login is not an address at the From: domain (no sender_login_map)", None,
            "login is not an address at the From: domain (no sender_login_map)"] == [
        default.permits(o, head) for o in (bare, qualified, elsewhere)]
    lenient = Signer([key], allow_username_mismatch=True)
    assert [None, None, None] == [lenient.permits(o, head) for o in (bare, qualified, elsewhere)]
    assert "From: domain is not the envelope sender's" == lenient.permits(
        Origin(client="127.0.0.2:1", mynetworks=False, login="mallory", mail_from="m@evil.test"), head)
    assert None is default.choose(head, outside)
