"""Relay control at RCPT: mynetworks, relay_domains, authenticated clients; address checks (GUIDE §4).

Real daemon (``mtaq serve`` subprocess) or the real edge in-process, spoken to over loopback sockets. A
client is made "not permitted" by starting the daemon with ``--mynetworks 192.0.2.0/24`` and connecting
from 127.0.0.1.
"""

from __future__ import annotations

import shutil
import smtplib
import subprocess
import sys

import pytest
from edgekit import HOST, RawClient, codes, edge_relay, run_edge

from mtaq.edge.policy import EdgePolicy, domain_of, parse_domains, parse_networks

IP = "127.0.0.1"
DOMAIN = "nmap.scanme.org"  # nmap's default test domain (smtp.get_domain())
RELAY_DENIED = (554, "5.7.1")
BAD_ADDRESS = (553, "5.1.3")

# The sixteen MAIL FROM / RCPT TO pairs of nmap's smtp-open-relay script (srvname is the name in our
# greeting, ip the address connected to), each with the reply mtaq must give to the RCPT.
NMAP_FORMS = [
    ("", f"relaytest@{DOMAIN}", RELAY_DENIED),
    (f"antispam@{DOMAIN}", f"relaytest@{DOMAIN}", RELAY_DENIED),
    (f"antispam@{HOST}", f"relaytest@{DOMAIN}", RELAY_DENIED),
    (f"antispam@[{IP}]", f"relaytest@{DOMAIN}", RELAY_DENIED),
    (f"antispam@[{IP}]", f"relaytest%{DOMAIN}@[{IP}]", RELAY_DENIED),
    (f"antispam@[{IP}]", f"relaytest%{DOMAIN}@{HOST}", RELAY_DENIED),
    (f"antispam@[{IP}]", f'"relaytest@{DOMAIN}"', BAD_ADDRESS),  # no domain outside the quotes
    (f"antispam@[{IP}]", f'"relaytest%{DOMAIN}"', BAD_ADDRESS),
    (f"antispam@[{IP}]", f"relaytest@{DOMAIN}@[{IP}]", BAD_ADDRESS),  # two @: malformed
    (f"antispam@[{IP}]", f'"relaytest@{DOMAIN}"@[{IP}]', RELAY_DENIED),
    (f"antispam@[{IP}]", f"relaytest@{DOMAIN}@{HOST}", BAD_ADDRESS),
    (f"antispam@[{IP}]", f"@[{IP}]:relaytest@{DOMAIN}", RELAY_DENIED),  # source route ignored
    (f"antispam@[{IP}]", f"@{HOST}:relaytest@{DOMAIN}", RELAY_DENIED),
    (f"antispam@[{IP}]", f"{DOMAIN}!relaytest", BAD_ADDRESS),  # bang path: no domain
    (f"antispam@[{IP}]", f"{DOMAIN}!relaytest@[{IP}]", RELAY_DENIED),
    (f"antispam@[{IP}]", f"{DOMAIN}!relaytest@{HOST}", RELAY_DENIED),
]


def try_forms(port: int) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Run the sixteen forms in one session as nmap does (RSET, MAIL, RCPT); the MAIL and RCPT replies."""
    out = []
    with RawClient(port) as c:
        assert c.reply().startswith("220 ")
        assert c.command(f"EHLO {DOMAIN}").startswith("250-")
        for sender, rcpt, _ in NMAP_FORMS:
            assert codes(c.command("RSET")) == (250, "2.0.0")
            out.append((codes(c.command(f"MAIL FROM:<{sender}>")), codes(c.command(f"RCPT TO:<{rcpt}>"))))
        assert codes(c.command("QUIT")) == (221, "2.0.0")
    return out


def test_the_sixteen_nmap_relay_forms_are_refused_from_a_client_outside_mynetworks(tmp_path):
    """From a client outside mynetworks, each of nmap's sixteen forms has its MAIL accepted and its RCPT
    refused: 554 5.7.1 where there is a domain that is not ours to relay to, 553 5.1.3 where there is none
    (quoted local part, bang path) or the address is malformed; nothing is queued."""
    with edge_relay(tmp_path, "--mynetworks", "192.0.2.0/24") as r:
        got = try_forms(r.port)
        assert [((250, "2.1.0"), want) for _, _, want in NMAP_FORMS] == got
        assert [] == r.events("queued")


def test_the_same_forms_are_accepted_from_mynetworks_so_the_refusals_are_relay_control(tmp_path):
    """Negative control: from a client inside mynetworks (the default, loopback), the very forms refused
    with 554 above are accepted; the malformed ones are still 553."""
    with run_edge(tmp_path) as edge:
        got = try_forms(edge.port)
    expected = [((250, "2.1.0"), (250, "2.1.5") if want == RELAY_DENIED else want) for _, _, want in NMAP_FORMS]
    assert expected == got


def nmap_open_relay(port: int) -> str:
    out = subprocess.run(
        ["nmap", "-Pn", "-n", "-p", str(port), "--script", "+smtp-open-relay", "-d", IP],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    lines = [line for line in out.splitlines() if "smtp-open-relay" in line or "open relay" in line]
    return "\n".join(lines)


@pytest.mark.skipif(shutil.which("nmap") is None, reason="nmap is installed by `make test` (Makefile: debs)")
def test_nmaps_smtp_open_relay_script_finds_no_open_relay(tmp_path):
    """nmap's own smtp-open-relay script (forced onto our port with '+') reports that all its tests failed
    against the daemon when nmap's address is outside mynetworks; against an edge that lets loopback relay
    (negative control) it reports an open relay, so the script did run its tests against us."""
    with edge_relay(tmp_path, "--mynetworks", "192.0.2.0/24") as r:
        report = nmap_open_relay(r.port)
        assert "Server doesn't seem to be an open relay, all tests failed" in report, report
    with run_edge(tmp_path) as edge:
        report = nmap_open_relay(edge.port)
        assert "Server is an open relay (11/16 tests)" in report, report


def test_relay_domains_are_open_to_anyone_and_percent_or_bang_never_reroute(tmp_path):
    """With --relay-domains example.org,.example.net a client outside mynetworks may send to example.org
    (any case) and to subdomains of example.net, not to example.net itself nor elsewhere. 'user%elsewhere'
    and 'elsewhere!user' at example.org are for example.org: the sink (our next hop) receives exactly those
    envelope recipients, unrewritten."""
    with edge_relay(tmp_path, "--mynetworks", "192.0.2.0/24", "--relay-domains", "example.org,.example.net") as r:
        with smtplib.SMTP("127.0.0.1", r.port, timeout=30) as s:
            s.ehlo("client.test")
            assert 250 == s.mail("a@outside.test")[0]
            results = {rcpt: s.rcpt(rcpt)[0] for rcpt in [
                "user%elsewhere.test@example.org", "elsewhere.test!user@EXAMPLE.ORG", "b@mx.sub.example.net",
                "c@example.net", "d@elsewhere.test", "e@example.org.evil.test"]}
            assert {"user%elsewhere.test@example.org": 250, "elsewhere.test!user@EXAMPLE.ORG": 250,
                    "b@mx.sub.example.net": 250, "c@example.net": 554, "d@elsewhere.test": 554,
                    "e@example.org.evil.test": 554} == results
            code, _ = s.data(b"Subject: percent\r\nMessage-ID: <pct@test>\r\n\r\nhello\r\n")
            assert 250 == code
        [msg] = r.wait_for(lambda: r.sink_messages(), "delivery to the sink")
        delivered_to = [line.split(b": ", 1)[1].decode() for line in msg.split(b"\r\n") if line.startswith(b"Delivered-To:")]
        assert ["user%elsewhere.test@example.org", "elsewhere.test!user@EXAMPLE.ORG", "b@mx.sub.example.net"] == delivered_to


@pytest.mark.parametrize(("command", "reply"), [
    ("RCPT TO:<a\x01b@example.org>", (553, "5.1.3")),
    ("RCPT TO:<ab@exam\x7fple.org>", (553, "5.1.3")),
    ("RCPT TO:<\"a\tb\"@example.org>", (553, "5.1.3")),
    ("RCPT TO:<postmaster>", (553, "5.1.3")),
    ("RCPT TO:<>", (553, "5.1.3")),
    ("RCPT TO:<a@-bad-.example.org>", (553, "5.1.3")),
    ("RCPT TO:<a@[300.1.1.1]>", (553, "5.1.3")),
    ("RCPT TO:<a@b@example.org>", (553, "5.1.3")),
    ("RCPT TO:<ü@example.org>", (553, "5.6.7")),  # non-ASCII without SMTPUTF8 on MAIL
    ("RCPT TO:<a@[IPv6:2001:db8::1]>", (250, "2.1.5")),
    ("RCPT TO:<a@[192.0.2.1]>", (250, "2.1.5")),
    ("RCPT TO:<@a.test,@b.test:c@example.org>", (250, "2.1.5")),
    ('RCPT TO:<"odd local@part"@example.org>', (250, "2.1.5")),
])
def test_recipient_address_checks(tmp_path, command, reply):
    """Addresses with a control character or DEL, without a domain, with a malformed domain or two @ get
    553 5.1.3; a non-ASCII one without SMTPUTF8 gets 553 5.6.7; address literals, source routes and quoted
    local parts are fine (from mynetworks, so relay control does not interfere)."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        assert (250, "2.1.0") == codes(c.command("MAIL FROM:<a@example.org>"))
        assert reply == codes(c.command(command.encode("utf-8")))


def test_sender_address_checks_and_the_null_sender(tmp_path):
    """MAIL FROM:<> is accepted (bounces, RFC 5321 §4.5.5); a sender with a control character, without a
    domain or non-ASCII without SMTPUTF8 is refused; with SMTPUTF8 a UTF-8 address is accepted."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        assert (553, "5.1.3") == codes(c.command("MAIL FROM:<a\x02@example.org>"))
        assert (553, "5.1.3") == codes(c.command("MAIL FROM:<nodomain>"))
        assert (553, "5.6.7") == codes(c.command("MAIL FROM:<ü@example.org>".encode()))
        assert (250, "2.1.0") == codes(c.command("MAIL FROM:<ü@bücher.example> SMTPUTF8".encode()))
        assert (250, "2.1.5") == codes(c.command("RCPT TO:<ö@bücher.example>".encode()))
        assert (250, "2.0.0") == codes(c.command("RSET"))
        assert (250, "2.1.0") == codes(c.command("MAIL FROM:<>"))


def test_unknown_client_is_refused_but_authenticated_or_listed_domains_decide_per_recipient(tmp_path):
    """The relay decision is per recipient: in one transaction, the relay domain is accepted and the
    foreign domain refused (554 5.7.1 naming the address, as Postfix says it)."""
    policy = EdgePolicy(mynetworks=parse_networks(["192.0.2.0/24"]), relay_domains=parse_domains(["example.org"]))
    with run_edge(tmp_path, policy) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        c.command("MAIL FROM:<a@outside.test>")
        assert "250 2.1.5 Ok" == c.command("RCPT TO:<b@example.org>")
        assert "554 5.7.1 <c@example.com>: Relay access denied" == c.command("RCPT TO:<c@example.com>")


def test_domain_of_takes_the_last_at_outside_quotes():
    """The domain is after the last '@' that is not inside a quoted local part; none -> None."""
    assert "[192.0.2.1]" == domain_of('"a@b"@[192.0.2.1]')
    assert None is domain_of('"a@b"')
    assert None is domain_of("b!a")
    assert "example.org" == domain_of("a%b@EXAMPLE.org")
    assert "x.test" == domain_of('"q\\"@"@x.test')


def test_bad_mynetworks_or_relay_domains_flags_exit_2_naming_the_key():
    """A bad CIDR or domain on the command line is a one-line error naming the key, exit status 2."""
    for flag, value, key in [("--mynetworks", "10.0.0.300/8", "mynetworks"), ("--mynetworks", "10.0.0.1/8", "mynetworks"),
                             ("--relay-domains", "exa mple.org", "relay_domains")]:
        out = subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", flag, value], capture_output=True, text=True,
                             timeout=60)
        assert 2 == out.returncode
        [line] = out.stderr.splitlines()
        assert line.startswith(f"mtaq: {key}: "), line
