"""The HTTP admin API against the real daemon (subprocess), real SMTP in, a real sink deferring some
recipients out; JSON errors; the bearer token rule; admin.json; the OpenAPI document covers every route."""

from __future__ import annotations

import asyncio
import json
import os
import re
import smtplib
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mtaq.admin.http import DAMAGE_HEADER_BYTES_MAX, AdminHttp, ApiState, _damage_header, make_app
from mtaq.admin.metrics import Metrics
from mtaq.admin.openapi import SPEC, dumps
from mtaq.testing import procs
from mtaq.testing.procs import maildir_message_ids

ROOT = Path(__file__).resolve().parent.parent
_TOKENS: dict[str, str] = {}  # admin URL -> the token its daemon generated into SPOOL/admin.token


def admin_url(spool: str) -> str:
    """The daemon's admin URL (SPOOL/admin.json); remembers the token it generated for :func:`api`."""
    url = procs.admin_url(spool)
    _TOKENS[url] = procs.admin_token(spool)
    return url


def api(url: str, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any, dict[str, str]]:
    """(status, decoded JSON body, headers) of one request, as ``mtaq queue`` sends it (JSON content type on
    state changes). ``token`` None: the token the daemon at ``url`` generated ("" when it has none)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"} if data is not None or method not in ("GET", "HEAD") else {}
    token = _TOKENS.get(url, "") if token is None else token
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode(), hdrs


def send(port: int, sender: str, rcpts: list[str], subject: str = "t") -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(sender)
        for r in rcpts:
            s.rcpt(r)
        code, text = s.data(f"Subject: {subject}\r\nMessage-ID: <{subject}@t>\r\n\r\nbody\r\n".encode())
        assert 250 == code, text
        return text.decode().rsplit(" ", 1)[1]


def deferred_relay(relay_factory, sink_args=("--defer-rcpt", "^slow"), config: str = ""):
    """A relay whose sink defers every ^slow recipient, with ``retry_intervals_s = [3600]``."""
    return relay_factory(sink_args=list(sink_args), config="retry_intervals_s = [3600.0]\n" + config)


def wait_deferred(r, n: int) -> None:
    r.wait_for(lambda: len(r.events("deferred_until")) >= n, what=f"{n} deferred")


def test_queues_size_and_listing_with_filters_limit_and_position(relay_factory):
    """GET /mailQueues is ["spool"]; its size by state comes from counters; the listing filters by sender,
    domain, state and age, honours limit, carries each recipient's last reason and names the log position
    it is consistent as of."""
    r = deferred_relay(relay_factory)
    spam = [send(r.daemon.port, "spammer@bad.example", [f"slow{i}@example.net"], f"s{i}") for i in range(2)]
    good = send(r.daemon.port, "alice@example.org", ["slow@other.example"], "g")
    wait_deferred(r, 3)
    url = admin_url(r.spool)
    assert (200, ["spool"]) == api(url, "GET", "/mailQueues")[:2]
    status, size, _ = api(url, "GET", "/mailQueues/spool")
    assert (200, "spool", 3) == (status, size["name"], size["size"])
    assert {"incoming": 0, "active": 0, "deferred": 3, "delayed": 0, "held": 0} == size["byState"]
    status, listing, _ = api(url, "GET", "/mailQueues/spool/mails")
    assert 200 == status and re.fullmatch(r"\d+:\d+", listing["position"])
    assert sorted([*spam, good]) == sorted(m["queue_id"] for m in listing["mails"])
    assert 3 == listing["count"]
    by_id = {m["queue_id"]: m for m in listing["mails"]}
    [rcpt] = by_id[good]["recipients"]
    assert "slow@other.example" == rcpt["address"]
    assert rcpt["delay_reason"].startswith("451 4.2.0")

    def ids(query: str) -> list[str]:
        st, body, _ = api(url, "GET", "/mailQueues/spool/mails" + query)
        assert 200 == st, body
        return sorted(m["queue_id"] for m in body["mails"])

    assert sorted(spam) == ids("?sender=SPAMMER@")
    assert [good] == ids("?domain=other.example")
    assert sorted([*spam, good]) == ids("?deferred=true")
    assert [] == ids("?held=true")
    assert [] == ids("?olderThan=1h")
    assert sorted([*spam, good]) == ids("?olderThan=0")
    assert 1 == len(ids("?limit=1"))


def test_show_gives_envelope_reasons_and_headers_and_404_for_an_unknown_id(relay_factory):
    """GET /mails/ID: the message with its recipients' last reasons and its header section; an unknown ID
    is 404 in the James error shape."""
    r = deferred_relay(relay_factory)
    qid = send(r.daemon.port, "alice@example.org", ["slow@example.net"], "shown")
    wait_deferred(r, 1)
    url = admin_url(r.spool)
    status, m, _ = api(url, "GET", f"/mails/{qid}")
    assert (200, qid, "deferred", "alice@example.org") == (status, m["queue_id"], m["state"], m["sender"])
    assert ["Subject", "shown"] in m["headers"]
    assert m["recipients"][0]["delay_reason"].startswith("451 4.2.0")
    status, err, _ = api(url, "GET", "/mails/NOSUCHID")
    assert (404, {"statusCode": 404, "type": "notFound", "message": "NOSUCHID: no such message in the queue"}) == (status, err)


def test_delete_by_sender_removes_only_matching_mail_and_needs_a_filter(relay_factory):
    """DELETE /mailQueues/spool/mails?sender=...: the matching messages are gone (ActionResult lists them);
    the others stay; without any filter the request is refused with 400 rather than emptying the queue."""
    r = deferred_relay(relay_factory)
    spam = [send(r.daemon.port, "spammer@bad.example", [f"slow{i}@example.net"], f"s{i}") for i in range(2)]
    good = send(r.daemon.port, "alice@example.org", ["slow9@example.net"], "g")
    wait_deferred(r, 3)
    url = admin_url(r.spool)
    status, res, _ = api(url, "DELETE", "/mailQueues/spool/mails?sender=spammer@bad.example")
    assert (200, "delete", sorted(spam), {}) == (status, res["action"], sorted(res["done"]), res["skipped"])
    assert [good] == [m["queue_id"] for m in api(url, "GET", "/mailQueues/spool/mails")[1]["mails"]]
    status, res, _ = api(url, "DELETE", f"/mailQueues/spool/mails?name={good}&name=NOPE")
    assert (200, [good], {"NOPE": "no such message in the queue"}) == (status, res["done"], res["skipped"])
    status, err, _ = api(url, "DELETE", "/mailQueues/spool/mails")
    assert (400, "InvalidArgument") == (status, err["type"])
    assert 0 == api(url, "GET", "/mailQueues/spool")[1]["size"]


def test_patch_delayed_false_makes_deferred_mail_due_now(relay_factory):
    """PATCH /mailQueues/spool?delayed=true {"delayed": false} (James's flush): mail deferred for an hour
    is attempted at once and delivered; a wrong body is 400."""
    r = deferred_relay(relay_factory, sink_args=("--defer-rcpt", "^slow", "--defer-count", "1"))
    qid = send(r.daemon.port, "alice@example.org", ["slow@example.net"], "later")
    wait_deferred(r, 1)
    url = admin_url(r.spool)
    assert 400 == api(url, "PATCH", "/mailQueues/spool?delayed=true", {"delayed": True})[0]
    assert 400 == api(url, "PATCH", "/mailQueues/spool", {"delayed": False})[0]
    status, res, _ = api(url, "PATCH", "/mailQueues/spool?delayed=true", {"delayed": False})
    assert (200, "flush", [qid]) == (status, res["action"], res["done"])
    r.wait_for(lambda: r.events("delivered"), what="delivery after the flush")
    assert {"<later@t>": 1} == dict(maildir_message_ids(r.maildir))


def test_actions_hold_release_and_bounce_by_ids_and_all(relay_factory):
    """POST /mails/actions/hold|release|bounce: held mail is listed held; released it is deferred again
    after a new attempt; bounce returns it to the sender with a DSN (5.4.7) and it leaves the queue."""
    r = deferred_relay(relay_factory)
    a = send(r.daemon.port, "alice@example.org", ["slow1@example.net"], "a")
    b = send(r.daemon.port, "bob@example.org", ["slow2@example.net"], "b")
    wait_deferred(r, 2)
    url = admin_url(r.spool)
    status, res, _ = api(url, "POST", "/mails/actions/hold", {"ids": [a]})
    assert (200, [a]) == (status, res["done"])
    size = api(url, "GET", "/mailQueues/spool")[1]["byState"]
    assert (1, 1) == (size["held"], size["deferred"])
    res = api(url, "POST", "/mails/actions/release", {"all": True})[1]
    assert ([a], {b: "message is deferred"}) == (res["done"], res["skipped"])
    wait_deferred(r, 3)  # the released message was attempted again (and deferred again)
    res = api(url, "POST", "/mails/actions/bounce", {"all": True, "sender": "bob@"})[1]
    assert [b] == res["done"]
    dsn = r.wait_for(lambda: [e for e in r.events("dsn_queued") if e["dsn_for"] == b], what="dsn_queued")[0]
    assert ("failed", "bob@example.org") == (dsn["action"], dsn["recipient"])
    r.wait_for(lambda: [e for e in r.events("delivered") if e["recipient"] == "bob@example.org"], what="DSN sent")
    assert [a] == [m["queue_id"] for m in api(url, "GET", "/mailQueues/spool/mails")[1]["mails"]]


def test_delay_action_parks_mail_until_a_release_time_within_delay_max_s(relay_factory):
    """POST /mails/actions/delay {"ids": [...], "delay": "1h"}: the message is listed as delayed with its
    release time; a delay beyond delay_max_s is 400 naming the limit; delay is required by that action
    only."""
    import time

    r = deferred_relay(relay_factory, config="delay_max_s = 7200\n")
    qid = send(r.daemon.port, "alice@example.org", ["slow@example.net"], "d")
    wait_deferred(r, 1)
    url = admin_url(r.spool)
    before = time.time()
    status, res, _ = api(url, "POST", "/mails/actions/delay", {"ids": [qid], "delay": "1h"})
    assert (200, "delay", [qid]) == (status, res["action"], res["done"])
    [m] = api(url, "GET", "/mailQueues/spool/mails")[1]["mails"]
    assert ("delayed", True) == (m["state"], before + 3600 <= m["release_time"] <= time.time() + 3600)
    status, err, _ = api(url, "POST", "/mails/actions/delay", {"ids": [qid], "delay": 86400})
    assert (400, "requested delay of 86400 seconds exceeds the maximum of 7200 seconds (delay_max_s)") == (
        status, err["message"])
    assert 400 == api(url, "POST", "/mails/actions/delay", {"ids": [qid]})[0]
    assert 400 == api(url, "POST", "/mails/actions/hold", {"ids": [qid], "delay": 60})[0]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind", "names"),
    [
        ("GET", "/mailQueues/spool/mails?held=maybe", None, 400, "InvalidArgument", "held"),
        ("GET", "/mailQueues/spool/mails?limit=0", None, 400, "InvalidArgument", "limit"),
        ("GET", "/mailQueues/spool/mails?olderThan=2x", None, 400, "InvalidArgument", "olderThan"),
        ("GET", "/mailQueues/spool/mails?sendr=a", None, 400, "InvalidArgument", "sendr"),
        ("GET", "/mailQueues/outgoing", None, 404, "notFound", "outgoing"),
        ("GET", "/nowhere", None, 404, "notFound", "/nowhere"),
        ("PUT", "/mailQueues", b"{}", 405, "MethodNotAllowed", "PUT"),
        ("POST", "/mails/actions/explode", {"all": True}, 404, "notFound", "explode"),
        ("POST", "/mails/actions/delete", {}, 400, "InvalidArgument", "ids"),
        ("POST", "/mails/actions/delete", {"all": True, "colour": "red"}, 400, "InvalidArgument", "colour"),
        ("POST", "/mails/actions/delete", b"{not json", 400, "InvalidArgument", "JSON"),
        ("POST", "/mails/actions/hold", {"ids": "abc"}, 400, "InvalidArgument", "ids"),
    ],
)
def test_bad_requests_get_james_style_json_errors_naming_the_problem(relay_factory, method, path, body, status, kind, names):
    """Each bad request gets the right status and {"statusCode", "type", "message"}, the message naming the
    parameter or thing at fault."""
    r = relay_factory()
    got_status, err, _ = api(admin_url(r.spool), method, path, body)
    assert (status, status, kind) == (got_status, err["statusCode"], err["type"])
    assert names in err["message"]


def test_token_is_required_when_set_401_without_200_with(relay_factory):
    """With admin_token set, a request without the bearer token, or with a wrong one, gets 401 with
    WWW-Authenticate (metrics too); with it, 200."""
    r = relay_factory(config='admin_token = "s3cret"\n')
    url = admin_url(r.spool)
    status, err, headers = api(url, "GET", "/mailQueues")
    assert (401, "Unauthorized") == (status, err["type"])
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert 401 == api(url, "GET", "/mailQueues", token="wrong")[0]
    assert 401 == api(url, "GET", "/metrics")[0]
    assert (200, ["spool"]) == api(url, "GET", "/mailQueues", token="s3cret")[:2]
    assert 200 == api(url, "GET", "/metrics", token="s3cret")[0]


def mtaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", *args], capture_output=True, text=True, timeout=60)


def test_non_loopback_admin_address_without_token_is_refused_at_start(tmp_path):
    """admin_listen off loopback without admin_token: the daemon does not start; exit 2 and one line
    naming the key (flag and config file alike)."""
    out = mtaq("serve", "--spool", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--admin-listen", "0.0.0.0:0")
    assert (2, ["mtaq: admin_token: required when admin_listen (0.0.0.0:0) is not a loopback address"]) == (
        out.returncode, out.stderr.splitlines())
    cfg = tmp_path / "c.toml"
    cfg.write_text('admin_listen = "[::]:2580"\n')
    out = mtaq("serve", "--config", str(cfg), "--spool", str(tmp_path / "s"))
    assert (2, ["mtaq: admin_token: required when admin_listen ([::]:2580) is not a loopback address"]) == (
        out.returncode, out.stderr.splitlines())
    assert not (tmp_path / "s").exists()


def test_non_loopback_admin_address_with_a_token_listens_and_asks_for_it(relay_factory, tmp_path):
    """admin_listen = 0.0.0.0:0 with admin_token: the daemon starts; admin.json gives a loopback URL for
    the local CLI; the token is asked for."""
    from mtaq.testing.procs import start_daemon

    r = relay_factory()
    r.daemon.kill9()
    cfg = tmp_path / "c.toml"
    cfg.write_text('admin_listen = "0.0.0.0:0"\nadmin_token = "t0ken"\n')
    r.daemon = start_daemon(r.spool, r.sink.port, str(tmp_path / "d2.log"), config=str(cfg), admin_listen=None)
    url = admin_url(r.spool)
    assert url.startswith("http://127.0.0.1:")
    assert (401, 200) == (api(url, "GET", "/mailQueues")[0], api(url, "GET", "/mailQueues", token="t0ken")[0])


def test_admin_address_in_use_is_a_one_line_error_naming_the_key(tmp_path):
    """When admin_listen cannot be bound, serve exits 1 with one line naming admin_listen."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = mtaq("serve", "--spool", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--admin-listen", f"127.0.0.1:{port}")
    assert (1, [f"mtaq: cannot serve: admin_listen 127.0.0.1:{port}: Address already in use"]) == (
        out.returncode, out.stderr.splitlines())



def test_an_ipv6_admin_address_in_use_is_named_in_brackets(tmp_path, ipv6_port_taken):
    """The one line for an IPv6 admin_listen that cannot be bound names it as written, ``[::1]:PORT``, as the
    supervisor of several workers does (one worker said ``admin_listen ::1:PORT``)."""
    port = ipv6_port_taken
    out = mtaq("serve", "--spool", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--admin-listen", f"[::1]:{port}")
    assert (1, [f"mtaq: cannot serve: admin_listen [::1]:{port}: Address already in use"]) == (
        out.returncode, out.stderr.splitlines())

def test_admin_json_names_the_real_port_and_pid_and_is_replaced_at_restart(relay_factory):
    """With port 0 the daemon writes SPOOL/admin.json with the port it got and its pid; after kill -9 and
    a restart the file names the new process."""
    r = relay_factory()
    info = json.loads((Path(r.spool) / "admin.json").read_text())
    _TOKENS[info["url"]] = procs.admin_token(r.spool)
    assert r.daemon.popen.pid == info["pid"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", info["url"]) and not info["url"].endswith(":0")
    assert 200 == api(info["url"], "GET", "/mailQueues")[0]
    r.restart()
    info2 = json.loads((Path(r.spool) / "admin.json").read_text())
    _TOKENS[info2["url"]] = procs.admin_token(r.spool)
    assert (r.daemon.popen.pid, 200) == (info2["pid"], api(info2["url"], "GET", "/mailQueues/spool")[0])
    assert "admin.json.tmp" not in os.listdir(r.spool)


def test_queue_routes_answer_503_until_recovery_is_done_and_openapi_is_served(tmp_path):
    """Before the daemon hands over its admin service (recovery running), queue routes answer 503 with
    Retry-After while /metrics and /openapi.json already answer (a real aiohttp server on a real socket)."""

    async def main() -> None:
        http = AdminHttp(ApiState(Metrics({})), "127.0.0.1", 0, str(tmp_path))
        url = await http.start()
        try:
            got = await asyncio.to_thread(api, url, "GET", "/mailQueues/spool")
            assert (503, "ServiceUnavailable", "1") == (got[0], got[1]["type"], got[2]["Retry-After"])
            assert (200, SPEC) == (await asyncio.to_thread(api, url, "GET", "/openapi.json"))[:2]
            status, text, _ = await asyncio.to_thread(api, url, "GET", "/metrics")
            assert (200, True) == (status, "mtaq_ready 0.0" in text)
        finally:
            assert http._runner is not None
            await http._runner.cleanup()

    asyncio.run(main())


def test_openapi_document_describes_every_route_and_only_routes(tmp_path):
    """Every (method, path) of the application is in the OpenAPI document and vice versa; the copy in
    docs/admin_api.openapi.json is the document (regenerate with python -m mtaq.admin.openapi)."""
    app = make_app(ApiState(Metrics({})))
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    documented = {(m, p) for p, ops in SPEC["paths"].items() for m in ops}
    assert documented == routes
    for p, ops in SPEC["paths"].items():
        for op in ops.values():
            params = {x["name"] for x in op.get("parameters", []) if x["in"] == "path"}
            assert set(re.findall(r"\{(\w+)\}", p)) == params
    assert dumps() == (ROOT / "docs" / "admin_api.openapi.json").read_text()


def test_the_damage_header_of_a_line_listing_stays_short_ascii_and_says_what_it_left_out():
    """X-Mtaq-Damage (the x-ndjson listing's damage) is JSON in ASCII; a badly damaged log's thousands of
    problems are cut to what fits in DAMAGE_HEADER_BYTES_MAX, and a last line counts the rest (an HTTP
    client reads one header line of at most 64 KiB)."""
    few = ["segment 3: corrupt at 10-20: bad checksum"]
    assert few == json.loads(_damage_header(few))
    many = [f"segment {i}: corrupt at {i}-{i + 9}: caf\u00e9 \r\n" for i in range(5000)]
    text = _damage_header(many)
    assert (True, True) == (text.isascii(), len(text) <= DAMAGE_HEADER_BYTES_MAX)
    got = json.loads(text)
    kept = got[:-1]
    assert (many[:len(kept)], f"and {5000 - len(kept)} more problems: the listing as application/json has them all") \
        == (kept, got[-1])
    assert len(kept) > 50
