"""Next-hop selection in process: transport map syntax and lookup order, relayhost, MX records from a DNS server.

DNS answers come from :class:`mtaq.testing.dnsserver.ZoneServer`, a real DNS server on 127.0.0.1 that stands
in for the internet's DNS (there is no internet here); the resolver is dnspython's, pointed at it.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaq.config import Config, parse_relayhost
from mtaq.delivery.relay import Reply
from mtaq.delivery.routing import Candidate, Route, RouteFailure, Router, lookup, parse_transport
from mtaq.testing.dnsserver import ZoneServer

ZONE = """
multi       IN MX 10 mx-a.multi
multi       IN MX 10 mx-b.multi
multi       IN MX 5  first.multi
multi       IN MX 20 last.multi
first.multi IN A 127.0.0.2
mx-a.multi  IN A 127.0.0.3
mx-b.multi  IN A 127.0.0.4
last.multi  IN A 127.0.0.5
last.multi  IN AAAA ::1
nomx        IN A 127.0.0.6
nothing     IN TXT "no mail here"
null        IN MX 0 .
dangling    IN MX 10 nowhere.dangling
dangling    IN MX 20 ok.dangling
ok.dangling IN A 127.0.0.7
"""


@pytest.fixture(scope="module")
def dns_port():
    with ZoneServer(ZONE, servfail=["broken"], silent=["slow"]) as zs:
        yield zs.port


def router(dns_port: int, seed: int = 0, **kw) -> Router:
    cfg = Config(relayhost="", dns_nameservers=[f"127.0.0.1:{dns_port}"], dns_timeout_s=1.0, smtp_port=2500, **kw)
    return Router(cfg, rng=random.Random(seed))


def candidates(r: Router, address: str) -> list[Candidate | Reply]:
    async def go():
        return [c async for c in r.candidates(r.route(address))]

    return asyncio.run(go())


def failure(r: Router, address: str) -> Reply:
    with pytest.raises(RouteFailure) as exc:
        candidates(r, address)
    return exc.value.reply


# ----------------------------------------------------------------------------------------------- transport map
def test_transport_values_parse_like_postfix():
    """Bracketed next hops skip MX lookup, bare ones look it up, discard/error carry their reply."""
    assert ("smtp", parse_relayhost("[10.0.0.5]:25")) == (lambda t: (t.kind, t.nexthop))(parse_transport("[10.0.0.5]:25"))
    assert ("smtp", parse_relayhost("[10.0.0.5]:2525")) == (lambda t: (t.kind, t.nexthop))(parse_transport("smtp:[10.0.0.5]:2525"))
    assert ("smtp", parse_relayhost("mx.example.org:25")) == (lambda t: (t.kind, t.nexthop))(parse_transport("relay:mx.example.org"))
    assert ("smtp", None) == (lambda t: (t.kind, t.nexthop))(parse_transport("smtp:"))
    assert ("discard", Reply(250, "2.0.0", "discarded by transport map")) == (lambda t: (t.kind, t.reply))(parse_transport("discard"))
    assert Reply(550, "5.1.1", "user unknown here") == parse_transport("error:5.1.1 user unknown here").reply
    assert Reply(450, "4.3.2", "try later") == parse_transport("error:4.3.2 try later").reply
    assert Reply(550, "5.0.0", "go away") == parse_transport("error:go away").reply


@pytest.mark.parametrize("value", ["lmtp:unix:/run/lmtp", "error:2.0.0 fine", "[nope", "smtp:[a]:99999"])
def test_bad_transport_values_are_refused_naming_the_key(value):
    with pytest.raises(ValueError) as exc:
        parse_transport(value, key="transport_map.example.org")
    assert str(exc.value).startswith("transport_map.example.org: ")


def test_lookup_order_is_exact_domain_then_parent_domains_with_a_dot_then_star():
    """Postfix transport(5): ``example.org`` matches only itself; ``.example.org`` matches its subdomains,
    the nearest parent first; ``*`` matches what nothing else does."""
    table = {"example.org": "exact", ".example.org": "sub", ".b.example.org": "sub-b", "*": "star"}
    assert "exact" == lookup(table, "example.org")
    assert "sub" == lookup(table, "a.example.org")
    assert "sub-b" == lookup(table, "x.b.example.org")
    assert "star" == lookup(table, "example.net")
    assert "star" == lookup(table, "notexample.org")
    assert None is lookup({"example.org": "exact"}, "a.example.org")


def test_transport_map_wins_over_relayhost_and_keys_are_case_insensitive():
    cfg = Config(relayhost="[127.0.0.1]:2526", smtp_port=2500,
                 transport_map={"Example.ORG": "[10.0.0.5]:25", ".lists.example.org": "discard", "bad.example": "error:5.1.1 no"})
    r = Router(cfg)
    assert Route("smtp", "10.0.0.5", 25, False) == r.route("a@EXAMPLE.org")
    assert "discard" == r.route("a@x.lists.example.org").kind
    assert ("error", Reply(550, "5.1.1", "no")) == (r.route("u@bad.example").kind, r.route("u@bad.example").reply)
    assert Route("smtp", "127.0.0.1", 2526, False) == r.route("a@elsewhere.net")


def test_without_relayhost_the_recipient_domain_is_routed_by_mx_on_smtp_port():
    r = Router(Config(relayhost="", smtp_port=2500))
    assert Route("smtp", "example.net", 2500, True) == r.route("Bob@Example.NET.")
    assert Route("smtp", "192.0.2.7", 2500, False) == r.route("bob@[192.0.2.7]")  # RFC 5321 §4.1.3 literal
    assert ("error", "5.1.3") == (r.route("postmaster").kind, r.route("postmaster").reply.enhanced)


def test_relayhost_without_brackets_means_the_mx_records_of_that_host():
    r = Router(Config(relayhost="smarthost.example:587"))
    assert Route("smtp", "smarthost.example", 587, True) == r.route("a@b.example")


def test_tls_policy_is_looked_up_by_destination_then_recipient_domain_then_default():
    cfg = Config(relayhost="", smtp_tls_security_level="may", transport_map={"via.example": "[10.0.0.9]:25"},
                 tls_policy_map={"secure.example": "encrypt", ".corp.example": "encrypt", "[10.0.0.9]:25": "none",
                                 "plain.example": "none"})
    r = Router(cfg)
    assert "encrypt" == r.route("a@secure.example").tls
    assert "encrypt" == r.route("a@mail.corp.example").tls
    assert "none" == r.route("a@via.example").tls
    assert "none" == r.route("a@plain.example").tls
    assert "may" == r.route("a@other.example").tls


_LABELS = st.sampled_from(["example", "corp", "lists", "via", "secure", "x", "B", "ORG", "net", "[192.0.2.7]"])
_ADDRESSES = st.one_of(
    st.builds(lambda local, labels, dot: f"{local}@{'.'.join(labels)}{dot}", st.sampled_from(["a", "Bob", "x.y"]),
              st.lists(_LABELS, min_size=1, max_size=4), st.sampled_from(["", "."])),
    st.sampled_from(["postmaster", "a@", "@", "a@b@corp.example"]),
)


@settings(max_examples=300, deadline=None)
@given(addresses=st.lists(_ADDRESSES, min_size=1, max_size=30), kept=st.integers(1, 5), star=st.booleans())
def test_routes_kept_by_domain_are_the_routes_a_fresh_router_gives(addresses, kept, star):
    """Router.route keeps routes by recipient domain: in any order of addresses, with the keep full and
    emptied on the way, every route equals what a new router gives for that address alone (transport map,
    parent domains, ``*``, TLS policy, literals, and the error route that names an address without a domain)."""
    import mtaq.delivery.routing as routing

    cfg = Config(relayhost="", smtp_port=2500, smtp_tls_security_level="may",
                 transport_map={"corp.example": "[10.0.0.5]:25", ".lists.corp.example": "discard",
                                **({"*": "[10.0.0.8]"} if star else {})},
                 tls_policy_map={".corp.example": "encrypt", "[10.0.0.8]": "none"})
    r = Router(cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routing, "ROUTES_KEPT", kept)
        for address in addresses:
            assert Router(cfg).route(address) == r.route(address)
            assert len(r._routes) <= kept


# ------------------------------------------------------------------------------------------------------- DNS
def test_mx_hosts_come_in_preference_order_each_with_the_smtp_port(dns_port):
    """RFC 5321 §5.1: lowest preference first; A before AAAA; MX records carry no port, so smtp_port is used."""
    got = candidates(router(dns_port, smtp_mx_addresses_max=10), "u@multi.test")
    hosts = [(c.hostname, c.address, c.port) for c in got]
    assert ("first.multi.test", "127.0.0.2", 2500) == hosts[0]
    assert {"mx-a.multi.test", "mx-b.multi.test"} == {h for h, _, _ in hosts[1:3]}
    assert [("last.multi.test", "127.0.0.5", 2500), ("last.multi.test", "::1", 2500)] == hosts[3:]


def test_equal_preference_mx_hosts_are_tried_in_random_order(dns_port):
    """§5.1: hosts of equal preference are randomised to spread the load; both orders occur."""
    orders = {tuple(c.hostname for c in candidates(router(dns_port, seed), "u@multi.test")[1:3]) for seed in range(16)}
    assert {("mx-a.multi.test", "mx-b.multi.test"), ("mx-b.multi.test", "mx-a.multi.test")} == orders


def test_no_more_addresses_than_the_limit_are_tried(dns_port):
    assert 2 == len(candidates(router(dns_port, smtp_mx_addresses_max=2), "u@multi.test"))


def test_domain_without_mx_falls_back_to_its_own_address(dns_port):
    """RFC 5321 §5.1: no MX records -> the domain itself is the mail host (implicit MX)."""
    assert [Candidate("nomx.test", "127.0.0.6", 2500)] == candidates(router(dns_port), "u@nomx.test")


def test_null_mx_bounces_with_556_5_1_10(dns_port):
    """RFC 7505: a single 'MX 0 .' says the domain accepts no mail."""
    assert (556, "5.1.10") == (lambda r: (r.code, r.enhanced))(failure(router(dns_port), "u@null.test"))


def test_nonexistent_domain_bounces_with_5_1_2(dns_port):
    assert (550, "5.1.2") == (lambda r: (r.code, r.enhanced))(failure(router(dns_port), "u@nx.test"))


def test_domain_with_neither_mx_nor_address_bounces_with_5_1_2(dns_port):
    assert (550, "5.1.2") == (lambda r: (r.code, r.enhanced))(failure(router(dns_port), "u@nothing.test"))


def test_servfail_and_timeout_defer_with_4_4_3(dns_port):
    """DNS trouble is temporary (RFC 3463 X.4.3, directory server failure): deferred, never bounced."""
    assert (451, "4.4.3") == (lambda r: (r.code, r.enhanced))(failure(router(dns_port), "u@broken.test"))
    assert (451, "4.4.3") == (lambda r: (r.code, r.enhanced))(failure(router(dns_port), "u@slow.test"))


def test_mx_host_without_address_is_skipped_for_the_next(dns_port):
    """A dangling MX host is reported (temporary reason) and the next MX is offered."""
    got = candidates(router(dns_port), "u@dangling.test")
    assert [Reply, Candidate] == [type(c) for c in got]
    assert "nowhere.dangling.test" in got[0].text and got[0].code == 451
    assert Candidate("ok.dangling.test", "127.0.0.7", 2500) == got[1]


def test_unreachable_dns_server_defers(tmp_path):
    """Nothing answers on the configured name server: 4.4.3 within dns_timeout_s."""
    from mtaq.testing.procs import free_port

    r = Router(Config(relayhost="", dns_nameservers=[f"127.0.0.1:{free_port()}"], dns_timeout_s=0.5))
    assert "4.4.3" == failure(r, "u@example.test").enhanced
