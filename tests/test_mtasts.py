"""MTA-STS (mtaq.delivery.mtasts, RFC 8461): TXT discovery, the policy over verified HTTPS, its cache in the
spool (mtaq.storage.cachefile), and what enforce / testing / none mean for MX hosts.

Real parts: :class:`mtaq.testing.dnsserver.ZoneServer` for ``_mta-sts`` TXT and ``mta-sts.`` A records, an
aiohttp HTTPS server on 127.0.0.1 with certificates from a local CA made with ``trustme`` (a second CA, not
trusted, signs the certificate of ``mta-sts.untrusted.test``), and a second Python process reading the cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from collections import Counter
from contextlib import asynccontextmanager

import dns.rdataset
import pytest
import trustme
from aiohttp import web

from mtaq.delivery.mtasts import (
    MAX_AGE_MAX,
    POLICY_BYTES_MAX,
    MtaSts,
    StsError,
    StsPolicy,
    mx_allowed,
    outcome,
    parse_policy,
    parse_txt,
    policy_url,
)
from mtaq.storage.cachefile import CacheDir, key_file, write_atomic
from mtaq.storage.fs import OsFileSystem
from mtaq.testing.dnsserver import ZoneServer

DOMAINS = ["enforce.test", "testing.test", "none.test", "rotate.test", "big.test", "bad.test", "redirect.test",
           "html.test", "untrusted.test", "notxt.test", "down.test", "wrongname.test"]

ENFORCE = "version: STSv1\nmode: enforce\nmx: mx1.enforce.test\nmx: *.backup.enforce.test\nmax_age: 86400\n"


def zone() -> str:
    lines = [f"mta-sts.{d.removesuffix('.test')} IN A 127.0.0.1" for d in DOMAINS]
    lines += [f'_mta-sts.{d.removesuffix(".test")} IN TXT "v=STSv1; id=1;"' for d in DOMAINS if d != "notxt.test"]
    lines.append('_mta-sts.enforce IN TXT "some other record"')  # ignored: does not start with v=STSv1
    lines.append('_mta-sts.notxt IN TXT "v=spf1 -all"')
    lines.append('_mta-sts.dup IN TXT "v=STSv1; id=1;"')
    lines.append('_mta-sts.dup IN TXT "v=STSv1; id=2;"')
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def zs():
    with ZoneServer(zone(), origin="test.", servfail=["_mta-sts.down"]) as z:
        yield z


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    good, bad = trustme.CA(), trustme.CA()
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    good.cert_pem.write_to_path(str(ca_file))
    return good, bad, str(ca_file)


class Site:
    """The policy host of every test domain: ``pages[host] = (status, content_type, body, headers)``."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[int, str, bytes, dict[str, str]]] = {}
        self.hits: Counter[str] = Counter()

    async def handle(self, request: web.Request) -> web.Response:
        host = request.host.rsplit(":", 1)[0]
        self.hits[host] += 1
        if request.path != "/.well-known/mta-sts.txt" or host not in self.pages:
            return web.Response(status=404)
        status, ctype, body, headers = self.pages[host]
        return web.Response(status=status, body=body, headers={"Content-Type": ctype, **headers})


def server_context(cas) -> ssl.SSLContext:
    good, bad, _ = cas
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    good.issue_cert(*[f"mta-sts.{d}" for d in DOMAINS if d not in ("untrusted.test", "wrongname.test")]).configure_cert(ctx)
    other = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    bad.issue_cert("mta-sts.untrusted.test").configure_cert(other)

    def sni(obj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        if name == "mta-sts.untrusted.test":
            obj.context = other

    ctx.sni_callback = sni
    return ctx


@asynccontextmanager
async def https(cas, site: Site):
    app = web.Application()
    app.router.add_get("/{tail:.*}", site.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context(cas))
    await tcp.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def page(body: str | bytes, status: int = 200, ctype: str = "text/plain", **headers: str):
    return (status, ctype, body.encode() if isinstance(body, str) else body, headers)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def client(zs, cas, port: int, cache: str, clock=None) -> MtaSts:
    return MtaSts(CacheDir(cache), nameservers=[("127.0.0.1", zs.port)], timeout_s=3.0, ca_file=cas[2], port=port,
                  clock=clock or Clock())


# --------------------------------------------------------------------------------------------------- parsing
def test_txt_record_parsing():
    assert "20160831085700Z" == parse_txt(["v=STSv1; id=20160831085700Z;"])
    assert "abc" == parse_txt(["v=STSv1;id=abc", "v=spf1 -all"])  # others ignored, no trailing ; needed
    assert "abc" == parse_txt(["v=STSv1; id=abc; ext=1"])
    for bad in [[], ["v=STSv1; id=1;", "v=STSv1; id=2;"], ["v=STSv1;"], ["v=STSv1; id=has-dash"], ["v=STSv1; id=" + "a" * 33],
                ["v=STSv1; junk"]]:
        with pytest.raises(StsError):
            parse_txt(bad)


def test_policy_parsing():
    p = parse_policy(ENFORCE.replace("\n", "\r\n"))
    assert ("enforce", ("mx1.enforce.test", "*.backup.enforce.test"), 86400) == (p.mode, p.mx, p.max_age)
    assert "none" == parse_policy("version: STSv1\nmode: none\nmax_age: 0\n").mode
    assert MAX_AGE_MAX == parse_policy("version: STSv1\nmode: testing\nmx: MX.Example.ORG.\nmax_age: 9999999999\n").max_age
    assert ("mx.example.org",) == parse_policy("version: STSv1\nmode: testing\nmx: MX.Example.ORG.\nmax_age: 1\n").mx
    assert "enforce" == parse_policy("version: STSv1\nmode: enforce\nmx: a.b\nmax_age: 1\nfuture_field: x\n").mode


@pytest.mark.parametrize("text", [
    "mode: enforce\nmx: a.b\nmax_age: 1\n",  # no version
    "version: STSv2\nmode: enforce\nmx: a.b\nmax_age: 1\n",
    "version: STSv1\nmode: reject\nmx: a.b\nmax_age: 1\n",
    "version: STSv1\nmode: enforce\nmax_age: 1\n",  # enforce without mx
    "version: STSv1\nmode: enforce\nmx: a.b\nmax_age: -1\n",
    "version: STSv1\nmode: enforce\nmx: a.b\nmax_age: 12345678901\n",  # 11 digits
    "version: STSv1\nmode: enforce\nmx: a.b\n",  # no max_age
    "version: STSv1\nmode: enforce\nmx: a.*.b\nmax_age: 1\n",  # wildcard not leftmost
    "version: STSv1\nmode: enforce\nmx: *\nmax_age: 1\n",
    "<html>version: STSv1</html>\n",
])
def test_bad_policies_are_refused(text):
    with pytest.raises(StsError):
        parse_policy(text)


def test_mx_patterns_of_rfc_8461_4_1():
    """``*.example.com`` matches one extra leftmost label only; exact names match exactly; case and the
    trailing dot do not matter."""
    p = StsPolicy("enforce", ("mail.example.com", "*.example.net"), 86400)
    assert mx_allowed(p, "mail.example.com")
    assert mx_allowed(p, "MAIL.Example.COM.")
    assert not mx_allowed(p, "x.mail.example.com")
    assert mx_allowed(p, "mx1.example.net")
    assert not mx_allowed(p, "example.net")  # the wildcard needs a label
    assert not mx_allowed(p, "a.b.example.net")  # ... exactly one
    assert not mx_allowed(p, "mx1.example.net.evil.org")
    assert not mx_allowed(p, "mx1example.net")


def test_outcomes_for_delivery():
    enforce = StsPolicy("enforce", ("mx.a.test",), 60)
    assert (True, True, "") == (lambda o: (o.use_host, o.verify_tls, o.report))(outcome(enforce, "mx.a.test"))
    o = outcome(enforce, "evil.test", "a.test")
    assert (False, True) == (o.use_host, o.verify_tls)
    assert o.reply is not None and (451, "4.7.0") == (o.reply.code, o.reply.enhanced) and "evil.test" in o.reply.text
    testing = StsPolicy("testing", ("mx.a.test",), 60)
    o = outcome(testing, "evil.test", "a.test")
    assert (True, False) == (o.use_host, o.verify_tls) and "evil.test" in o.report  # log only
    assert ("", True) == (outcome(testing, "mx.a.test").report, outcome(testing, "mx.a.test").use_host)
    for none in (None, StsPolicy("none", (), 60)):
        o = outcome(none, "anything.test")
        assert (True, False, "") == (o.use_host, o.verify_tls, o.report)


def test_policy_url():
    assert "https://mta-sts.example.org/.well-known/mta-sts.txt" == policy_url("example.org")


# ------------------------------------------------------------------------------------------- fetch and cache
def run(coro):
    return asyncio.run(coro)


def test_enforce_testing_and_none_policies_are_fetched_and_cached(zs, cas, tmp_path):
    site = Site()
    site.pages["mta-sts.enforce.test"] = page(ENFORCE)
    site.pages["mta-sts.testing.test"] = page("version: STSv1\nmode: testing\nmx: mx.testing.test\nmax_age: 600\n")
    site.pages["mta-sts.none.test"] = page("version: STSv1\nmode: none\nmax_age: 600\n")

    async def go():
        async with https(cas, site) as port:
            sts = client(zs, cas, port, str(tmp_path / "mta-sts"))
            got = [await sts.policy(d) for d in ("enforce.test", "Testing.Test.", "none.test")]
            again = await sts.policy("enforce.test")
            return got, again

    (enf, tst, non), again = run(go())
    assert ("enforce", ("mx1.enforce.test", "*.backup.enforce.test"), "1") == (enf.mode, enf.mx, enf.id)
    assert mx_allowed(enf, "mx1.enforce.test") and mx_allowed(enf, "b1.backup.enforce.test")
    assert not outcome(enf, "mx2.enforce.test").use_host
    assert "testing" == tst.mode and "none" == non.mode
    assert again == enf
    assert 1 == site.hits["mta-sts.enforce.test"]  # the second lookup: TXT id unchanged, from the cache
    stored = json.loads((tmp_path / "mta-sts" / "enforce.test.json").read_bytes())
    assert {"domain": "enforce.test", "id": "1", "mode": "enforce", "max_age": 86400} == {
        k: stored[k] for k in ("domain", "id", "mode", "max_age")}
    assert [] == [n for n in os.listdir(tmp_path / "mta-sts") if n.endswith(".tmp")]


def test_cache_survives_a_new_process(zs, cas, tmp_path):
    """A policy fetched here is read from the spool by another Python process with no HTTPS server reachable
    (the TXT id unchanged): the enforce policy still applies after a restart."""
    site = Site()
    site.pages["mta-sts.enforce.test"] = page(ENFORCE)
    cache = str(tmp_path / "mta-sts")

    async def go():
        async with https(cas, site) as port:
            return await MtaSts(CacheDir(cache), nameservers=[("127.0.0.1", zs.port)], timeout_s=3.0, ca_file=cas[2],
                                port=port).policy("enforce.test")

    first = run(go())
    code = f"""
import asyncio, json, socket
from mtaq.delivery.mtasts import MtaSts
from mtaq.storage.cachefile import CacheDir
s = socket.socket(); s.bind(("127.0.0.1", 0)); dead = s.getsockname()[1]; s.close()
sts = MtaSts(CacheDir({cache!r}), nameservers=[("127.0.0.1", {zs.port})], timeout_s=3.0, ca_file={cas[2]!r}, port=dead)
p = asyncio.run(sts.policy("enforce.test"))
print(json.dumps(None if p is None else [p.mode, list(p.mx), p.id, p.fetched_at]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
    assert [first.mode, list(first.mx), first.id, first.fetched_at] == json.loads(out.stdout.strip().splitlines()[-1])


def test_txt_id_change_fetches_again_and_expiry_too(zs, cas, tmp_path):
    site = Site()
    site.pages["mta-sts.rotate.test"] = page("version: STSv1\nmode: testing\nmx: old.rotate.test\nmax_age: 600\n")
    clock = Clock()
    name = "_mta-sts.rotate.test."

    async def go():
        async with https(cas, site) as port:
            sts = client(zs, cas, port, str(tmp_path / "c"), clock)
            a = await sts.policy("rotate.test")
            site.pages["mta-sts.rotate.test"] = page("version: STSv1\nmode: enforce\nmx: new.rotate.test\nmax_age: 600\n")
            b = await sts.policy("rotate.test")  # same id: the cache, not the new text
            zs.zone.replace_rdataset(name, dns.rdataset.from_text("IN", "TXT", 60, '"v=STSv1; id=2;"'))
            c = await sts.policy("rotate.test")  # new id: fetched again
            d = await sts.policy("rotate.test")
            clock.t += 601  # expired: fetched again although the id is the same
            e = await sts.policy("rotate.test")
            return a, b, c, d, e

    try:
        a, b, c, d, e = run(go())
    finally:
        zs.zone.replace_rdataset(name, dns.rdataset.from_text("IN", "TXT", 60, '"v=STSv1; id=1;"'))
    assert ("testing", "1") == (a.mode, a.id) and a == b
    assert ("enforce", ("new.rotate.test",), "2") == (c.mode, c.mx, c.id) and c == d
    assert e.fetched_at == clock.t
    assert 3 == site.hits["mta-sts.rotate.test"]


def test_untrusted_certificate_is_not_taken(zs, cas, tmp_path):
    """The policy host's certificate is from a CA the trust store does not hold: no policy; and a policy
    served under a name the certificate does not carry is refused the same way."""
    site = Site()
    site.pages["mta-sts.untrusted.test"] = page(ENFORCE)
    site.pages["mta-sts.wrongname.test"] = page(ENFORCE)

    async def go():
        async with https(cas, site) as port:
            sts = client(zs, cas, port, str(tmp_path / "c"))
            with pytest.raises(StsError, match=r"(?i)certificate"):
                await sts.fetch("untrusted.test")
            with pytest.raises(StsError, match=r"(?i)hostname|certificate"):
                await sts.fetch("wrongname.test")  # trusted CA, but the certificate does not name this host
            return [await sts.policy("untrusted.test"), await sts.policy("wrongname.test")]

    assert [None, None] == run(go())
    assert not (tmp_path / "c").exists()
    assert 0 == sum(site.hits.values())  # nothing was sent over either connection


@pytest.mark.parametrize(("domain", "served", "why"), [
    ("big.test", page("version: STSv1\nmode: enforce\nmx: a.b\nmax_age: 60\n" + "x: y\n" * (POLICY_BYTES_MAX // 5)), "larger than"),
    ("bad.test", page("version: STSv1\nmode: enforce\nmax_age: 60\n"), "without mx"),
    ("redirect.test", page("", status=301, Location="https://mta-sts.enforce.test/.well-known/mta-sts.txt"), "status 301"),
    ("html.test", page(ENFORCE, ctype="text/html"), "text/plain"),
])
def test_unusable_policies_are_not_taken(zs, cas, tmp_path, domain, served, why):
    site = Site()
    site.pages[f"mta-sts.{domain}"] = served
    site.pages["mta-sts.enforce.test"] = page(ENFORCE)

    async def go():
        async with https(cas, site) as port:
            sts = client(zs, cas, port, str(tmp_path / "c"))
            with pytest.raises(StsError, match=why):
                await sts.fetch(domain)
            return await sts.policy(domain)

    assert run(go()) is None
    assert 0 == site.hits["mta-sts.enforce.test"]  # the redirect was not followed


def test_policy_streamed_without_length_is_cut_at_the_cap(zs, cas, tmp_path):
    """A chunked response (no Content-Length) beyond 64 KiB is refused too."""
    site = Site()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"version: STSv1\nmode: enforce\nmx: a.b\nmax_age: 60\n")
        for _ in range(20):
            await resp.write(b"x: " + b"y" * 8000 + b"\n")
        await resp.write_eof()
        return resp

    site.handle = stream  # type: ignore[method-assign]

    async def go():
        async with https(cas, site) as port:
            with pytest.raises(StsError, match="larger than"):
                await client(zs, cas, port, str(tmp_path / "c")).fetch("big.test")

    run(go())


def test_missing_or_duplicate_txt_and_dns_failure(zs, cas, tmp_path):
    """No STSv1 TXT record, two of them, or SERVFAIL: no policy without a cache; a cached policy that has not
    expired is kept (RFC 8461 §5.1), and then no fetch is tried."""
    site = Site()
    for d in ("notxt.test", "dup.test", "down.test"):
        site.pages[f"mta-sts.{d}"] = page(ENFORCE)
    cache = CacheDir(str(tmp_path / "c"))

    async def go():
        async with https(cas, site) as port:
            sts = client(zs, cas, port, cache.path)
            empty = [await sts.policy(d) for d in ("notxt.test", "dup.test", "down.test")]
            p = StsPolicy("enforce", ("mx.down.test",), 600, "1", sts.clock())
            cache.save("down.test", p.to_json("down.test"))
            cache.save("notxt.test", p.to_json("notxt.test"))
            kept = [await client(zs, cas, port, cache.path).policy(d) for d in ("down.test", "notxt.test")]
            return empty, kept, p

    empty, kept, p = run(go())
    assert [None, None, None] == empty
    assert [p, p] == kept
    assert 0 == sum(site.hits.values())


def test_fetch_failure_keeps_the_cached_policy(zs, cas, tmp_path):
    """The id changed but the new policy cannot be fetched: the old one is used until it expires."""
    cache = CacheDir(str(tmp_path / "c"))
    clock = Clock()
    old = StsPolicy("enforce", ("mx.enforce.test",), 600, "0", clock.t - 10)
    cache.save("enforce.test", old.to_json("enforce.test"))
    site = Site()  # serves 404

    async def go():
        async with https(cas, site) as port:
            sts = client(zs, cas, port, cache.path, clock)
            a = await sts.policy("enforce.test")
            clock.t += 600
            b = await sts.policy("enforce.test")
            return a, b

    assert (old, None) == run(go())


# ---------------------------------------------------------------------------------------------- cachefile
class CountingFs(OsFileSystem):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def open(self, path, *, create=False):
        f = super().open(path, create=create)
        calls = self.calls

        class F:
            def __getattr__(self, name):
                attr = getattr(f, name)
                if name in ("fsync", "append", "close"):
                    def wrapped(*a, **k):
                        calls.append(name)
                        return attr(*a, **k)
                    return wrapped
                return attr

        return F()  # type: ignore[return-value]

    def rename(self, src, dst):
        self.calls.append("rename")
        super().rename(src, dst)

    def fsync_dir(self, path):
        self.calls.append("fsync_dir")
        super().fsync_dir(path)


def test_write_atomic_is_write_fsync_rename_fsync_dir(tmp_path):
    fs = CountingFs()
    target = str(tmp_path / "x.json")
    write_atomic(fs, target, b"one")
    write_atomic(fs, target, b"two")
    assert ["append", "fsync", "close", "rename", "fsync_dir"] * 2 == fs.calls
    assert b"two" == (tmp_path / "x.json").read_bytes()
    assert ["x.json"] == os.listdir(tmp_path)


def test_cache_keys_are_safe_file_names(tmp_path):
    assert "example.org.json" == key_file("Example.ORG")
    assert "/" not in key_file("../../etc/passwd") and not key_file("..").startswith(".")
    c = CacheDir(str(tmp_path / "d"))
    assert c.load("a.test") is None and [] == c.keys()
    c.save("a.test", b"{}")
    assert b"{}" == c.load("a.test") and ["a.test.json"] == c.keys()


def test_from_config(tmp_path, cas):
    from mtaq.config import Config
    from mtaq.delivery.dane import DnssecResolver

    cfg = Config(dns_nameservers=["127.0.0.1:5300"], mta_sts=True, mta_sts_ca_file=cas[2], mta_sts_timeout_s=2.0,
                 smtp_dns_support_level="dnssec", dnssec_trusted_resolvers=["127.0.0.1:5300"])
    sts = MtaSts.from_config(cfg, CacheDir(str(tmp_path)))
    assert ([("127.0.0.1", 5300)], 2.0) == (sts.nameservers, sts.timeout_s)
    r = DnssecResolver.from_config(cfg)
    assert ([("127.0.0.1", 5300)], {("127.0.0.1", 5300)}) == (r.nameservers, r.trusted)
