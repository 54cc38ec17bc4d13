"""``workers = "auto"`` by default, and the admin API, ``mtaq queue`` and ``/metrics`` over every shard
(mtaq.admin.shards): sizes summed, listings merged, actions by queue ID routed to the shard in its low 4
bits, actions on all mail done in every shard; the public API's guards unchanged, the internal sockets
behind the same token."""

from __future__ import annotations

import json
import os
import smtplib
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtaq.admin.shards import join_positions, merge_metrics
from mtaq.config import Config
from mtaq.daemon.workers import WORKERS_AUTO_MAX, admin_socket, auto_workers, log_dirs, workers_wanted
from mtaq.queue.store import new_queue_id, queue_id_shard, set_queue_id_shard
from mtaq.testing.procs import Proc, admin_token, admin_url, start_daemon, start_sink, wait_for

SLOW = "slow@example.net"  # the sink defers it: mail stays queued (deferred) for the admin to act on


def _send_until_both_shards(port: int, n_min: int) -> list[str]:
    """Messages to SLOW, each on its own connection (the kernel spreads them over the workers), until at
    least ``n_min`` are queued and both shard 0 and shard 1 hold some; their queue IDs."""
    ids: list[str] = []
    for i in range(200):
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.ehlo("client.test")
            s.mail(f"sender{i}@example.org")
            s.rcpt(SLOW)
            code, text = s.data(f"Subject: m{i}\r\nMessage-ID: <m{i}@t>\r\n\r\nbody {i}\r\n".encode())
            assert 250 == code, text
            ids.append(text.decode().rsplit(" ", 1)[1])
        if len(ids) >= n_min and {0, 1} <= {queue_id_shard(q) for q in ids}:
            return ids
    raise AssertionError(f"200 connections all went to one shard: {ids}")


def _log_bytes(spool: str) -> dict[int, bytes]:
    """Every shard's log segments, concatenated (shard -> bytes)."""
    out = {}
    for k, d in log_dirs(spool):
        out[k] = b"".join(Path(d, f).read_bytes() for f in sorted(os.listdir(d)) if f.endswith(".seg"))
    return out


def _request(url: str, method: str, path: str, body: Any = None, *, token: str | None,
             origin: str | None = "same") -> tuple[int, Any]:
    """One request as a browser's same-origin fetch sends it: JSON body, ``Origin`` (the API's own, for a
    state change), ``Sec-Fetch-Site: same-origin``, and the bearer token when one is given; asked again
    while the answer is 503 (a shard still recovering)."""
    headers = {"Sec-Fetch-Site": "same-origin", "Accept": "application/json"}
    data = None
    if body is not None or method not in ("GET", "HEAD"):
        data = json.dumps(body).encode() if body is not None else b""
        headers["Content-Type"] = "application/json"
        if origin == "same":
            headers["Origin"] = url
    if origin not in (None, "same"):
        headers["Origin"] = origin
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    deadline = time.monotonic() + 30
    while True:  # 503 + Retry-After while a shard recovers (just after the start), as mtaq queue does
        req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def _listing(url: str, token: str, query: str = "") -> dict[str, Any]:
    status, body = _request(url, "GET", f"/mailQueues/spool/mails{query}", token=token)
    assert 200 == status, body
    return dict(body)


def _ndjson(url: str, token: str, query: str = "") -> tuple[Any, bytes]:
    """The listing asked for as ``application/x-ndjson``: (headers, body)."""
    req = urllib.request.Request(url + f"/mailQueues/spool/mails{query}",
                                 headers={"Accept": "application/x-ndjson", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert (200, "application/x-ndjson") == (r.status, r.headers.get_content_type())
        return r.headers, r.read()


def _all_deferred(url: str, token: str, ids: list[str], attempts: int = 1) -> bool:
    mails = _listing(url, token)["mails"]
    return sorted(ids) == sorted(m["queue_id"] for m in mails) and all(
        m["state"] == "deferred" and m["attempts"] >= attempts for m in mails)


def _metrics(url: str, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = _request(url, "GET", "/metrics", token=token)
    assert 200 == status, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def sharded(tmp_path: Path):
    """A deferring sink and a daemon started with the DEFAULT config (no --workers, no config file)."""
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"), extra=("--defer-rcpt", "^slow"))
    spool = str(tmp_path / "spool")
    daemon = start_daemon(spool, sink.port, str(tmp_path / "daemon.log"), workers=None)
    try:
        yield spool, daemon
    finally:
        daemon.kill9()
        sink.kill9()


# ------------------------------------------------------------------------------------------------ units
def test_workers_is_auto_by_default_one_per_core_capped_and_one_with_a_port_0_listener():
    """The default is "auto": the cores of os.sched_getaffinity, at most WORKERS_AUTO_MAX; a listener
    with port 0 (only one process can have it) makes it 1; a number stays itself."""
    assert "auto" == Config().workers
    assert min(len(os.sched_getaffinity(0)), WORKERS_AUTO_MAX) == auto_workers()
    assert auto_workers() == workers_wanted("auto", [2525, 587])
    assert 1 == workers_wanted("auto", [2525, 0])
    assert 3 == workers_wanted(3, [0])


def test_queue_ids_name_their_shard_and_positions_join_per_shard():
    """queue_id_shard reads the low 4 bits that set_queue_id_shard put in; one shard 0's position is
    itself, several are SHARD/POSITION each."""
    try:
        for k in (0, 1, 15):
            set_queue_id_shard(k)
            assert k == queue_id_shard(new_queue_id())
    finally:
        set_queue_id_shard(0)
    assert None is queue_id_shard("nope")
    assert "3:40" == join_positions([(0, "3:40")])
    assert "0/3:40 1/1:12" == join_positions([(1, "1:12"), (0, "3:40")])


def test_metrics_of_shards_are_summed_ready_is_the_lowest_and_records_per_fsync_the_ratio_of_totals():
    """merge_metrics: counters, histograms and queue gauges summed; mtaq_ready the minimum;
    mtaq_log_records_per_fsync from the summed totals; mtaq_shards counts the shards."""
    a = ("# TYPE mtaq_ready gauge\nmtaq_ready 1.0\n# TYPE mtaq_messages_accepted_total counter\n"
         "mtaq_messages_accepted_total 3.0\n# TYPE mtaq_queue_messages gauge\nmtaq_queue_messages{state=\"held\"} 2.0\n"
         "# TYPE mtaq_log_records_total counter\nmtaq_log_records_total 10.0\n# TYPE mtaq_fsyncs_total counter\n"
         "mtaq_fsyncs_total 10.0\n# TYPE mtaq_log_records_per_fsync gauge\nmtaq_log_records_per_fsync 1.0\n"
         "# TYPE h histogram\nh_bucket{le=\"1.0\"} 1.0\nh_bucket{le=\"+Inf\"} 2.0\nh_count 2.0\nh_sum 3.0\n")
    b = a.replace("mtaq_ready 1.0", "mtaq_ready 0.0").replace("fsyncs_total 10.0", "fsyncs_total 30.0")
    fams = [list(text_string_to_metric_families(t)) for t in (a, b)]
    got = {(s.name, tuple(s.labels.items())): s.value
           for f in text_string_to_metric_families(merge_metrics(fams).decode()) for s in f.samples}
    assert 0.0 == got[("mtaq_ready", ())]
    assert 6.0 == got[("mtaq_messages_accepted_total", ())]
    assert 4.0 == got[("mtaq_queue_messages", (("state", "held"),))]
    assert 0.5 == got[("mtaq_log_records_per_fsync", ())]
    assert (4.0, 2.0, 6.0) == (got[("h_bucket", (("le", "+Inf"),))], got[("h_bucket", (("le", "1.0"),))], got[("h_sum", ())])
    assert 2.0 == got[("mtaq_shards", ())]


# ------------------------------------------------------------------------------------ the real daemon
def test_default_daemon_runs_a_worker_per_core_and_its_api_covers_every_shard(sharded):
    """With the default config (auto: two workers on two cores) mail lands in both shards' logs; the
    public API lists and sizes all of it, shows and acts on queue IDs of either shard (hold, release,
    delete by name, flush, delete ALL), and /metrics sums both shards."""
    spool, daemon = sharded
    if auto_workers() < 2:
        pytest.skip("one core: auto is one worker")
    assert auto_workers() == len(daemon.children())
    url, token = admin_url(spool), admin_token(spool)
    ids = _send_until_both_shards(daemon.port, 6)
    logs = _log_bytes(spool)
    for q in ids:  # each message is in the log of the shard its ID names, and only there
        assert [queue_id_shard(q)] == [k for k, b in logs.items() if q.encode() in b]
    wait_for(lambda: _all_deferred(url, token, ids), 60, "every message deferred once")

    status, size = _request(url, "GET", "/mailQueues/spool", token=token)
    assert 200 == status
    assert (len(ids), len(ids)) == (size["size"], size["byState"]["deferred"])
    assert {"0", "1"} <= {p.split("/")[0] for p in size["position"].split()}
    full = _listing(url, token)
    assert len(ids) == full["count"]
    keys = [(m["arrival_time"], m["queue_id"]) for m in full["mails"]]
    assert sorted(keys) == keys
    first3 = _listing(url, token, "?limit=3")
    assert full["mails"][:3] == first3["mails"]
    # the same listing as JSON lines (what mtaq queue list --json prints): merged from both shards' raw JSON
    headers, body = _ndjson(url, token)
    assert full["mails"] == [json.loads(line) for line in body.splitlines()]
    assert (full["position"], str(len(ids)), "[]", None) == (
        headers["X-Mtaq-Position"], headers["X-Mtaq-Count"], headers["X-Mtaq-Damage"], headers.get("X-Mtaq-Next"))
    headers, body = _ndjson(url, token, "?limit=3")
    assert (first3["mails"], first3["next"]) == ([json.loads(ln) for ln in body.splitlines()], headers["X-Mtaq-Next"])
    s0 = next(q for q in ids if queue_id_shard(q) == 0)
    s1 = next(q for q in ids if queue_id_shard(q) == 1)
    for q in (s0, s1):
        status, shown = _request(url, "GET", f"/mails/{q}", token=token)
        assert (200, q) == (status, shown["queue_id"])

    status, res = _request(url, "POST", "/mails/actions/hold", {"ids": [s0, s1, "0000000000000ZZ"]}, token=token)
    assert 200 == status, res
    assert ({s0, s1}, {"0000000000000ZZ": "no such message in the queue"}) == (set(res["done"]), res["skipped"])
    held = _listing(url, token, "?held=true")
    assert {s0, s1} == {m["queue_id"] for m in held["mails"]}
    status, res = _request(url, "POST", "/mails/actions/release", {"ids": [s0, s1]}, token=token)
    assert (200, {s0, s1}) == (status, set(res["done"]))
    wait_for(lambda: _all_deferred(url, token, ids), 60, "the released messages tried again")  # not active now

    status, res = _request(url, "DELETE", f"/mailQueues/spool/mails?name={s0}&name={s1}", token=token)
    assert (200, {s0, s1}) == (status, set(res["done"]))
    left = [q for q in ids if q not in (s0, s1)]
    status, size = _request(url, "GET", "/mailQueues/spool", token=token)
    assert len(left) == size["size"]

    status, res = _request(url, "PATCH", "/mailQueues/spool?delayed=true", {"delayed": False}, token=token)
    assert (200, sorted(left)) == (status, sorted(res["done"]))
    wait_for(lambda: _all_deferred(url, token, left, attempts=2), 60, "every flushed message tried again")

    m = _metrics(url, token)
    assert 2.0 == m[("mtaq_shards", ())]
    assert 1.0 == m[("mtaq_ready", ())]
    assert len(ids) == m[("mtaq_messages_accepted_total", ())]
    assert len(left) == m[("mtaq_queue_messages", (("state", "deferred"),))]
    assert len(ids) + 2 + len(left) == m[("mtaq_deliveries_total", (("outcome", "deferred"),))]

    status, res = _request(url, "POST", "/mails/actions/delete", {"all": True}, token=token)
    assert (200, sorted(left)) == (status, sorted(res["done"]))
    status, size = _request(url, "GET", "/mailQueues/spool", token=token)
    assert 0 == size["size"]
    m = _metrics(url, token)
    assert len(ids) == m[("mtaq_admin_actions_total", (("action", "delete"),))]
    assert 2.0 == m[("mtaq_admin_actions_total", (("action", "hold"),))]


def test_public_api_guards_hold_for_every_shard_and_the_internal_socket_asks_the_same_token(sharded):
    """Without the token: 401 (listing, size, actions, /metrics); a foreign Origin: 403; the internal
    routes are not on the public listener; worker 1's socket is mode 0600 and asks the same token."""
    spool, daemon = sharded
    if auto_workers() < 2:
        pytest.skip("one core: auto is one worker")
    url, token = admin_url(spool), admin_token(spool)
    _send_until_both_shards(daemon.port, 2)
    for method, path, body in [("GET", "/mailQueues/spool", None), ("GET", "/mailQueues/spool/mails", None),
                               ("GET", "/metrics", None), ("POST", "/mails/actions/delete", {"all": True})]:
        assert 401 == _request(url, method, path, body, token=None)[0]
        assert 401 == _request(url, method, path, body, token="wrong" + token)[0]
    assert 403 == _request(url, "POST", "/mails/actions/delete", {"all": True}, token=token,
                           origin="http://evil.example")[0]
    assert 404 == _request(url, "GET", "/_shard/size", token=token)[0]
    assert 0 < _listing(url, token)["count"]  # nothing was deleted by the refused requests

    sock = admin_socket(spool, 1)
    assert stat.S_ISSOCK(os.stat(sock).st_mode) and 0o600 == stat.S_IMODE(os.stat(sock).st_mode)
    code = (
        "import asyncio, aiohttp, sys\n"
        "async def main(tok):\n"
        f"    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path={sock!r})) as s:\n"
        "        h = {'Authorization': 'Bearer ' + tok} if tok else {}\n"
        "        async with s.get('http://localhost/_shard/size', headers=h) as r:\n"
        "            print(r.status)\n"
        "asyncio.run(main(sys.argv[1]))\n"
    )
    statuses = [subprocess.run([sys.executable, "-c", code, t], capture_output=True, text=True, timeout=60).stdout.strip()
                for t in ("", "wrong", token)]
    assert ["401", "401", "200"] == statuses


def _cli(spool: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtaq.cli", "queue", *args, "--spool", spool], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_mtaq_queue_cli_sees_and_acts_on_both_of_two_workers(tmp_path: Path):
    """workers = 2: `mtaq queue size/list/show/hold/release/delete/flush` cover both shards through the one
    API, and list/size/show read both shards' logs when the daemon is down."""
    sink = start_sink(str(tmp_path / "maildir"), str(tmp_path / "sink.log"), extra=("--defer-rcpt", "^slow"))
    (tmp_path / "mtaq.toml").write_text("workers = 2\n")
    spool = str(tmp_path / "spool")
    daemon: Proc = start_daemon(spool, sink.port, str(tmp_path / "daemon.log"), config=str(tmp_path / "mtaq.toml"),
                                workers=None)
    try:
        assert 2 == len(daemon.children())
        ids = _send_until_both_shards(daemon.port, 5)
        url, token = admin_url(spool), admin_token(spool)
        wait_for(lambda: _all_deferred(url, token, ids), 60, "every message deferred once")
        out = _cli(spool, "size", "--json")
        assert 0 == out.returncode, out.stderr
        assert (len(ids), len(ids)) == (json.loads(out.stdout)["total"], json.loads(out.stdout)["deferred"])
        out = _cli(spool, "list", "--json")
        assert sorted(ids) == sorted(json.loads(line)["queue_id"] for line in out.stdout.splitlines())
        s0 = next(q for q in ids if queue_id_shard(q) == 0)
        s1 = next(q for q in ids if queue_id_shard(q) == 1)
        out = _cli(spool, "show", s1, "--json")
        assert s1 == json.loads(out.stdout)["queue_id"]
        out = _cli(spool, "hold", "-", "--json", stdin=f"{s0}\n{s1}\n")
        assert {s0, s1} == set(json.loads(out.stdout)["done"]), out.stderr
        out = _cli(spool, "list", "--held")
        assert s0 in out.stdout and s1 in out.stdout and "0/" in out.stdout and "1/" in out.stdout
        out = _cli(spool, "release", s0, s1, "--json")
        assert {s0, s1} == set(json.loads(out.stdout)["done"])
        wait_for(lambda: _all_deferred(url, token, ids), 60, "the released messages tried again")
        out = _cli(spool, "delete", s1, "--json")
        assert [s1] == json.loads(out.stdout)["done"]
        left = [q for q in ids if q != s1]
        out = _cli(spool, "flush", "ALL", "--json")
        assert sorted(left) == sorted(json.loads(out.stdout)["done"])
        wait_for(lambda: _all_deferred(url, token, left, attempts=2), 60, "the flushed messages tried again")
        daemon.kill9()
        # The daemon is down: list, size and show read every shard's log directly.
        out = _cli(spool, "size", "--json")
        assert (len(left), len(left)) == (json.loads(out.stdout)["total"], json.loads(out.stdout)["deferred"]), out.stderr
        out = _cli(spool, "list", "--json")
        assert sorted(left) == sorted(json.loads(line)["queue_id"] for line in out.stdout.splitlines())
        s1b = next((q for q in left if queue_id_shard(q) == 1), None)
        if s1b is not None:
            assert s1b == json.loads(_cli(spool, "show", s1b, "--json").stdout)["queue_id"]
    finally:
        daemon.kill9()
        sink.kill9()
