"""The pure parts of relaying through a provider: RFC 6125 name matching, the password file and its lookup
order, the AUTH hold, and the ``smtps:`` transport / verify-secure routing (no sockets)."""

from __future__ import annotations

import os

import pytest

from mtaq.config import Config, load_config, parse_transport_spec
from mtaq.core.errors import ConfigError
from mtaq.delivery.relay import Reply
from mtaq.delivery.routing import Router
from mtaq.delivery.sasl import SaslClient, load_password_file, nexthop_keys
from mtaq.delivery.security import Credentials, cert_names_match


def cert(*dns: str, cn: str = "", ips: tuple[str, ...] = ()) -> dict:
    """A certificate as ``SSLSocket.getpeercert()`` returns it."""
    c: dict = {"subject": ((("commonName", cn),),) if cn else ()}
    sans = tuple(("DNS", d) for d in dns) + tuple(("IP Address", i) for i in ips)
    if sans:
        c["subjectAltName"] = sans
    return c


@pytest.mark.parametrize(
    ("presented", "names", "expected"),
    [
        (cert("mail.provider.test"), ("mail.provider.test",), True),
        (cert("MAIL.Provider.test."), ("mail.provider.test",), True),  # case and a trailing dot do not matter
        (cert("*.provider.test"), ("mail.provider.test",), True),  # §6.4.3: a wildcard is one label
        (cert("*.provider.test"), ("a.mail.provider.test",), False),
        (cert("*.provider.test"), ("provider.test",), False),
        (cert("*.test"), ("provider.test",), False),  # no wildcard over a single label
        (cert("other.example"), ("mail.provider.test",), False),
        (cert(cn="mail.provider.test"), ("mail.provider.test",), True),  # §6.4.4: CN without DNS-IDs
        (cert("other.example", cn="mail.provider.test"), ("mail.provider.test",), False),  # DNS-IDs win
        (cert("mx1.example.org"), ("example.org", ".example.org"), True),  # secure: dot-nexthop
        (cert("mx1.example.org.evil.test"), ("example.org", ".example.org"), False),
        (cert("example.org"), ("example.org", ".example.org"), True),
        (cert("notexample.org"), ("example.org", ".example.org"), False),
        (cert(ips=("192.0.2.5",)), ("192.0.2.5",), True),  # an IP next hop against iPAddress entries
        (cert("192.0.2.5"), ("192.0.2.5",), False),
    ],
)
def test_certificate_names_match_as_rfc_6125_says(presented, names, expected):
    assert expected == cert_names_match(presented, names)


def write(tmp_path, text: str, mode: int = 0o600) -> str:
    p = tmp_path / "sasl_passwd"
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


def test_password_file_lines_keep_colons_and_spaces_in_the_password(tmp_path):
    path = write(tmp_path, "# comment\n\n[SMTP.example.com]:587  user@example.com:pa:ss word \n@example.org o:p\n")
    assert {"[smtp.example.com]:587": ("user@example.com", "pa:ss word"), "@example.org": ("o", "p")} == load_password_file(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_password_file_open_to_group_or_other_is_refused(tmp_path, mode):
    path = write(tmp_path, "[h]:587 u:topsecret\n", mode)
    with pytest.raises(ConfigError) as e:
        load_password_file(path)
    assert f"mode {mode:04o} gives group or other access" in str(e.value) and "topsecret" not in str(e.value)


def test_a_bad_line_is_named_by_number_never_shown(tmp_path):
    path = write(tmp_path, "[h]:587 u:ok\n[h2]:587 topsecret-without-colon\n")
    with pytest.raises(ConfigError) as e:
        load_password_file(path)
    assert "line 2: expected 'KEY user:password'" in str(e.value) and "topsecret" not in str(e.value)


def test_sasl_enabled_without_a_file_is_a_config_error():
    with pytest.raises(ConfigError, match="smtp_sasl_password_file: required"):
        SaslClient.from_config(Config(smtp_sasl_auth_enable=True))
    assert SaslClient.from_config(Config(smtp_sasl_password_file="/nonexistent")) is None  # not enabled: not read


def test_lookup_order_sender_then_domain_then_nexthop_as_written():
    """Postfix smtp_sasl_passwd_lookup: with sender-dependent authentication the sender, then ``@domain``,
    then the next hop (``[host]:port``, then ``[host]``); without it, only the next hop."""
    table = {"alice@origin.test": ("a", "1"), "@origin.test": ("d", "2"), "[smtp.p.test]:587": ("h", "3"),
             "[smtp.p.test]": ("b", "4")}
    dep = SaslClient(table, sender_dependent=True)
    keys = nexthop_keys("smtp.p.test", 587, mx=False)
    assert ("[smtp.p.test]:587", "[smtp.p.test]") == keys
    assert "a" == dep.credentials("Alice@ORIGIN.test", keys).username  # type: ignore[union-attr]
    assert "d" == dep.credentials("bob@origin.test", keys).username  # type: ignore[union-attr]
    assert "h" == dep.credentials("bob@elsewhere.test", keys).username  # type: ignore[union-attr]
    assert "b" == dep.credentials("bob@elsewhere.test", nexthop_keys("smtp.p.test", 25, mx=False)).username  # type: ignore[union-attr]
    assert "h" == SaslClient(table).credentials("alice@origin.test", keys).username  # type: ignore[union-attr]
    assert SaslClient(table).credentials("x@y.test", nexthop_keys("smtp.p.test", 587, mx=True)) is None


def test_credentials_never_show_the_password_in_repr():
    c = Credentials("[h]:587", "user", "topsecret")
    s = SaslClient({"[h]:587": ("user", "topsecret")})
    assert "topsecret" not in repr(c) + repr(s) + str(c)


def test_a_5xx_to_auth_holds_the_credentials_for_the_configured_time():
    now = [1000.0]
    s = SaslClient({}, hold_s=300, clock=lambda: now[0])
    c = Credentials("[h]:587", "user", "pw")
    s.failed(c, Reply(454, "4.7.0", "SASL authentication failed; server h said: 535 5.7.8 no"))
    held = s.held(c)
    assert held is not None and (454, "4.7.0") == (held.code, held.enhanced) and "not tried again for 300 s" in held.text
    now[0] += 299.9
    assert s.held(c) is not None
    now[0] += 0.2
    assert s.held(c) is None


def test_smtps_transport_and_wrappermode_route_with_implicit_tls():
    assert parse_transport_spec("smtps:[smtp.p.test]:465").wrapper
    assert not parse_transport_spec("smtp:[smtp.p.test]:465").wrapper
    r = Router(Config(relayhost="[smtp.p.test]:587", transport_map={"tls.test": "smtps:[smtp.p.test]:465"}))
    assert (True, False) == (r.route("a@tls.test").wrapper, r.route("a@other.test").wrapper)
    assert Router(Config(relayhost="[smtp.p.test]:465", smtp_tls_wrappermode=True)).route("a@x.test").wrapper


def test_verify_matches_the_host_connected_to_and_secure_the_nexthop():
    """verify: the MX host name (or the name in brackets); secure: the name in brackets, or for MX the
    domain and names under it (Postfix nexthop, dot-nexthop)."""
    r = Router(Config(relayhost="", tls_policy_map={"v.test": "verify", "s.test": "secure", "[relay.test]:587": "secure"},
                      transport_map={"b.test": "[relay.test]:587"}))
    assert ("mx1.provider.test",) == r.route("a@v.test").tls_match("mx1.provider.test")
    assert ("s.test", ".s.test") == r.route("a@s.test").tls_match("mx1.provider.test")
    assert ("relay.test",) == r.route("a@b.test").tls_match("relay.test")
    assert () == Router(Config(relayhost="")).route("a@x.test").tls_match("mx.x.test")


def test_config_accepts_the_new_levels_and_refuses_others(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('smtp_tls_security_level = "secure"\n[tls_policy_map]\n"x.test" = "verify"\n')
    assert "secure" == load_config(str(p), {}).smtp_tls_security_level
    p.write_text('smtp_tls_security_level = "dane"\n')
    with pytest.raises(ConfigError, match="smtp_tls_security_level"):
        load_config(str(p), {})


def test_a_password_file_key_written_with_its_transport_is_the_next_hop_alone(tmp_path):
    """`smtps:[host]:465` as written in transport_map finds the same credentials as `[host]:465`, the key
    Postfix documents (a newcomer's question, issue 33): before, such a key matched nothing and mail went
    without AUTH."""
    path = write(tmp_path, "smtps:[Smtp.Example.com]:465 u:p\nsmtp:[relay.example]:587 v:q\n")
    assert {"[smtp.example.com]:465": ("u", "p"), "[relay.example]:587": ("v", "q")} == load_password_file(path)
    assert nexthop_keys("smtp.example.com", 465, mx=False)[0] in load_password_file(path)
