"""The admin API against a hostile web page (issue 13.1): cross-site request forgery and DNS rebinding.

A page the operator visits can make the browser send requests to ``http://127.0.0.1:2580`` (a "simple"
cross-origin POST with ``Content-Type: text/plain`` needs no preflight), or, through a name that resolves
to 127.0.0.1 (DNS rebinding), read the answers. These tests send, over a real socket with http.client,
exactly the headers a browser sends in those cases, to the real daemon (subprocess), and check that each
guard refuses on its own (the token given, so that only the guard under test can refuse) and that the
queue is unchanged afterwards.
"""

from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import urllib.parse
from typing import Any

from test_admin_http import deferred_relay, send, wait_deferred

from mtaq.testing.procs import admin_token, admin_url


def raw(url: str, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
    """(status, JSON body) of one request sent with exactly ``headers`` (Host included when given)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body or b"")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def queued(url: str, token: str) -> int:
    return int(raw(url, "GET", "/mailQueues/spool", None, {"Authorization": f"Bearer {token}"})[1]["size"])


def relay_with_mail(relay_factory, config: str = ""):
    r = deferred_relay(relay_factory, config=config)
    qid = send(r.daemon.port, "alice@example.org", ["slow@example.net"], subject="victim")
    wait_deferred(r, 1)
    return r, qid


def test_the_cross_site_delete_of_the_review_is_refused_and_deletes_nothing(relay_factory):
    """The reproduced attack: POST /mails/actions/delete {"all": true} as text/plain, with a foreign Origin
    and a rebinding Host, and no token: refused (403, JSON), and the queue still holds the message."""
    r, _qid = relay_with_mail(relay_factory)
    url, token = admin_url(r.spool), admin_token(r.spool)
    port = urllib.parse.urlsplit(url).port
    status, err = raw(url, "POST", "/mails/actions/delete", b'{"all": true}', {
        "Host": f"rebind.evil.example:{port}", "Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert (403, 403, "Forbidden") == (status, err["statusCode"], err["type"])
    assert 1 == queued(url, token)


def test_each_guard_refuses_on_its_own_even_with_the_token(relay_factory):
    """Host not ours (403, reads included), Origin not ours (403), Sec-Fetch-Site cross-site (403), a state
    change without Content-Type: application/json (415, also with none): each refuses although the
    request carries the right token; the message is still queued afterwards."""
    r, qid = relay_with_mail(relay_factory)
    url, token = admin_url(r.spool), admin_token(r.spool)
    port = urllib.parse.urlsplit(url).port
    auth = {"Authorization": f"Bearer {token}"}
    own = {**auth, "Host": f"127.0.0.1:{port}", "Content-Type": "application/json"}
    delete_all = b'{"all": true}'
    cases = [
        ("GET", f"/mails/{qid}", None, {**auth, "Host": f"rebind.evil.example:{port}"}, 403),
        ("GET", "/mailQueues/spool/mails", None, {**auth, "Host": "rebind.evil.example"}, 403),
        ("POST", "/mails/actions/delete", delete_all, {**own, "Origin": "http://evil.example"}, 403),
        ("POST", "/mails/actions/delete", delete_all, {**own, "Origin": "null"}, 403),
        ("POST", "/mails/actions/delete", delete_all, {**own, "Origin": f"http://127.0.0.1:{port + 1}"}, 403),
        ("POST", "/mails/actions/delete", delete_all, {**own, "Sec-Fetch-Site": "cross-site"}, 403),
        ("POST", "/mails/actions/delete", delete_all, {**own, "Content-Type": "text/plain"}, 415),
        ("POST", "/mails/actions/delete", delete_all, {k: v for k, v in own.items() if k != "Content-Type"}, 415),
        ("POST", "/mails/actions/delete", delete_all,
         {**own, "Content-Type": "application/x-www-form-urlencoded"}, 415),
        ("DELETE", "/mailQueues/spool/mails?sender=alice@example.org", None,
         {k: v for k, v in own.items() if k != "Content-Type"}, 415),
    ]
    got = [raw(url, m, p, b, h) for m, p, b, h, _ in cases]
    assert [c[-1] for c in cases] == [status for status, _ in got]
    assert all(status == body["statusCode"] for status, body in got)
    assert 1 == queued(url, token)
    # The same request from the API's own origin, as mtaq queue sends it, works.
    status, res = raw(url, "POST", "/mails/actions/hold", json.dumps({"ids": [qid]}).encode(),
                      {**own, "Origin": f"http://127.0.0.1:{port}"})
    assert (200, [qid]) == (status, res["done"])


def test_a_name_listed_in_admin_hosts_is_accepted(relay_factory):
    """admin_hosts = ["mta.test"]: a Host (and same Origin) naming mta.test is served; another name is not."""
    r, _qid = relay_with_mail(relay_factory, config='admin_hosts = ["MTA.test"]\n')
    url, token = admin_url(r.spool), admin_token(r.spool)
    port = urllib.parse.urlsplit(url).port
    auth = {"Authorization": f"Bearer {token}"}
    assert 200 == raw(url, "GET", "/mailQueues/spool", None, {**auth, "Host": f"mta.test:{port}",
                                                               "Origin": f"http://mta.test:{port}"})[0]
    assert 403 == raw(url, "GET", "/mailQueues/spool", None, {**auth, "Host": f"other.test:{port}"})[0]


def test_a_token_is_generated_at_first_start_kept_0600_used_by_mtaq_queue_and_kept_across_restarts(relay_factory):
    """Without admin_token the daemon makes SPOOL/admin.token (mode 0600) at its first start: a request
    without it gets 401, mtaq queue finds it by itself, and a restart keeps the same token."""
    r, qid = relay_with_mail(relay_factory)
    path = os.path.join(r.spool, "admin.token")
    token = admin_token(r.spool)
    assert (0o600, True) == (stat.S_IMODE(os.stat(path).st_mode), len(token) >= 32)
    url = admin_url(r.spool)
    status, err = raw(url, "GET", "/mailQueues/spool", None, {})
    assert (401, "Unauthorized") == (status, err["type"])
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", "list", "--json", "--spool", r.spool],
                         capture_output=True, text=True, timeout=60)
    assert (0, [qid]) == (out.returncode, [json.loads(line)["queue_id"] for line in out.stdout.splitlines()])
    r.restart()
    assert token == admin_token(r.spool)
    assert 1 == queued(admin_url(r.spool), token)


def test_deeply_nested_json_gets_the_documented_400_and_no_traceback(relay_factory):
    """A body nested 100,000 deep (PATCH and POST routes) gets 400 InvalidArgument naming the nesting,
    not 500 with a RecursionError traceback in the log (issue 13.8)."""
    r, _qid = relay_with_mail(relay_factory)
    url, token = admin_url(r.spool), admin_token(r.spool)
    own = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    deep = b"[" * 100_000 + b"]" * 100_000
    deep_obj = b'{"ids": ' + deep + b"}"
    got = [raw(url, "PATCH", "/mailQueues/spool?delayed=true", deep, own),
           raw(url, "POST", "/mails/actions/hold", deep, own),
           raw(url, "POST", "/mails/actions/hold", deep_obj, own)]
    assert [(400, "InvalidArgument")] * 3 == [(s, b["type"]) for s, b in got]
    assert "nested too deeply" in got[0][1]["message"]
    assert [] == [e for e in r.events() if "RecursionError" in str(e) or e.get("level") in ("error", "critical")]
    assert 1 == queued(url, token)
