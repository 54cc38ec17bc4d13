"""Limits of the SMTP edge, each with its RFC reply: size, recipients, line length, connections,
connection rate, idle time, errors. Real edge (real log) or the daemon, over loopback sockets."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import OrderedDict

from edgekit import HOST, codes, edge_relay, run_edge

from mtaq.edge.limits import ConnectionGate, client_key
from mtaq.edge.policy import EdgePolicy, parse_networks

ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3} ")


def start_data(c) -> None:
    c.reply()
    c.command("EHLO client.test")
    assert (250, "2.1.0") == codes(c.command("MAIL FROM:<a@example.org>"))
    assert (250, "2.1.5") == codes(c.command("RCPT TO:<b@example.net>"))
    assert 354 == codes(c.command("DATA"))[0]


def test_size_is_advertised_and_enforced_at_mail_and_after_data(tmp_path):
    """SIZE in EHLO is the limit (RFC 1870); MAIL with SIZE above it gets 552 5.3.4; a message of exactly
    the limit is queued, one octet more gets 552 5.3.4 after the final dot and nothing is queued."""
    limit = 4096
    body = b"Subject: s\r\n\r\n" + b"x" * 78 + b"\r\n"
    while len(body) + 80 <= limit:
        body += b"z" * 78 + b"\r\n"
    body += b"w" * (limit - len(body) - 2) + b"\r\n"
    assert limit == len(body)
    with run_edge(tmp_path, data_size_limit=limit) as edge:
        with edge.client() as s:
            s.ehlo("client.test")
            assert str(limit) == s.esmtp_features["size"]
            assert (552, b"5.3.4 Error: message size exceeds fixed maximum message size") == s.mail("a@example.org", [f"SIZE={limit + 1}"])
            assert 250 == s.mail("a@example.org", [f"SIZE={limit}"])[0]
            s.rcpt("b@example.net")
            assert 250 == s.data(body)[0]
            s.mail("a@example.org")
            s.rcpt("b@example.net")
            code, text = s.data(body[:-2] + b"x\r\n")
            assert (552, b"5.3.4 Error: message size exceeds fixed maximum message size") == (code, text)
            assert 250 == s.noop()[0]  # the session goes on
        [(_, stored)] = edge.messages()
    assert stored.endswith(body)


def test_recipients_beyond_the_limit_get_452_and_the_first_hundred_are_kept(tmp_path):
    """RFC 5321 §4.5.3.1.8: at least 100 recipients are accepted; the 101st with a limit of 100 gets
    452 4.5.3 (§4.5.3.1.10) and the message goes to the first 100. The config refuses a limit under 100."""
    with run_edge(tmp_path, EdgePolicy(recipients_max=100)) as edge:
        with edge.client() as s:
            s.ehlo("client.test")
            s.mail("a@example.org")
            assert [250] * 100 == [s.rcpt(f"r{i}@example.net")[0] for i in range(100)]
            assert (452, b"4.5.3 Error: too many recipients") == s.rcpt("r100@example.net")
            assert 250 == s.data(b"Subject: many\r\n\r\nx\r\n")[0]
        [(env, _)] = edge.messages()
    assert [f"r{i}@example.net" for i in range(100)] == [r.address for r in env.recipients]
    cfg = tmp_path / "few.toml"
    cfg.write_text("recipients_per_message_max = 99\n")
    out = subprocess.run([sys.executable, "-m", "mtaq.cli", "serve", "--config", str(cfg)], capture_output=True, text=True,
                         timeout=60)
    assert 2 == out.returncode and out.stderr.startswith(f"mtaq: {cfg}: recipients_per_message_max: Expected `int` >= 100")


def test_text_lines_over_1000_octets_are_refused_and_the_session_goes_on(tmp_path):
    """RFC 5321 §4.5.3.1.6: 998 octets + CRLF (plus a transparency dot) are accepted; 999 + CRLF, and a line
    far longer than the reader's buffer, get 500 5.5.2 after the final dot; nothing of them is queued and
    the next message on the same connection is accepted."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        start_data(c)
        c.send(b"Subject: ok\r\n\r\n" + b"a" * 998 + b"\r\n.." + b"b" * 997 + b"\r\n.\r\n")
        assert (250, "2.0.0") == codes(c.reply())
        for long_line in (b"c" * 999, b"d" * 70000):
            c.command("MAIL FROM:<a@example.org>")
            c.command("RCPT TO:<b@example.net>")
            c.command("DATA")
            c.send(b"Subject: long\r\n\r\n" + long_line + b"\r\nafter\r\n.\r\n")
            assert "500 5.5.2 Error: line too long (RFC 5321 section 4.5.3.1.6: 1000 octets)" == c.reply()
        assert (250, "2.0.0") == codes(c.command("NOOP"))
        [(_, body)] = edge.messages()
    assert body.endswith(b"\r\n\r\n" + b"a" * 998 + b"\r\n." + b"b" * 997 + b"\r\n")


def test_command_lines_over_512_octets_get_500_5_5_2(tmp_path):
    """RFC 5321 §4.5.3.1.4: a command line is at most 512 octets (more with the extensions' parameters);
    a longer one gets 500 5.5.2, and the session goes on."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        assert "500 5.5.2 Error: command line too long" == c.command("NOOP " + "x" * 600)
        assert (250, "2.0.0") == codes(c.command("NOOP"))


def test_connections_over_the_limit_get_421_4_7_0_and_a_place_frees_when_one_ends(tmp_path):
    """With connections_max = 2 a third client gets 421 4.7.0 instead of the greeting and is closed; once
    one of the two has quit, a new client is greeted again."""
    with run_edge(tmp_path, EdgePolicy(connections_max=2)) as edge:
        with edge.raw() as a, edge.raw() as b:
            assert a.reply().startswith("220 ") and b.reply().startswith("220 ")
            with edge.raw() as c:
                assert f"421 4.7.0 {HOST} Error: too many connections" == c.reply()
                assert c.closed()
            assert (221, "2.0.0") == codes(a.command("QUIT"))
            assert a.closed()
            with edge.raw() as d:
                assert d.reply().startswith(f"220 {HOST} ESMTP")


def test_a_client_connecting_too_often_gets_421_4_7_0_unless_in_mynetworks(tmp_path):
    """connections_per_client_per_minute_max = 3: the 4th connection within a minute from a client outside
    mynetworks gets 421 4.7.0 naming the client; a client inside mynetworks is exempt (as in Postfix)."""
    outside = EdgePolicy(mynetworks=parse_networks(["192.0.2.0/24"]), client_connections_per_minute_max=3)
    with run_edge(tmp_path, outside) as edge:
        greetings = []
        for _ in range(4):
            with edge.raw() as c:
                greetings.append(c.reply())
        assert [g[:4] for g in greetings[:3]] == ["220 "] * 3
        assert f"421 4.7.0 {HOST} Error: too many connections from 127.0.0.1" == greetings[3]
    inside = EdgePolicy(client_connections_per_minute_max=3)
    with run_edge(tmp_path, inside) as edge:
        for _ in range(6):
            with edge.raw() as c:
                assert c.reply().startswith("220 ")


def test_connection_gate_forgets_connections_older_than_a_minute():
    """The rate window slides: after 60 s the same client may connect again (clock injected)."""
    now = [1000.0]
    gate = ConnectionGate(connections_max=10, per_client_per_minute_max=2, clock=lambda: now[0])
    assert [None, None, "too many connections from 192.0.2.9"] == [gate.admit("192.0.2.9") for _ in range(3)]
    assert None is gate.admit("192.0.2.10")
    now[0] += 60.0
    assert None is gate.admit("192.0.2.9")
    assert 4 == gate.active


class _CountingDict(OrderedDict):  # type: ignore[type-arg]
    """An OrderedDict (as the gate keeps) that counts the entries read (``[]``, ``items()``, ``setdefault``: what the gate looks at)."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        _CountingDict.reads += 1
        return super().__getitem__(key)

    def items(self):  # type: ignore[no-untyped-def]
        for item in super().items():
            _CountingDict.reads += 1
            yield item

    def setdefault(self, key, default=None):  # type: ignore[no-untyped-def]
        _CountingDict.reads += 1
        return super().setdefault(key, default)


def test_many_clients_in_a_minute_cost_no_rescan_of_every_client():
    """Found by the outside review of issue 32: once 10,000 client addresses had connected within a minute,
    every connection rescanned all of them (2-8 ms each: 455 connections/s fell to 52, mynetworks waited 1 s
    for its greeting). Now the clients are kept in order of their last connection and only stale ones at the
    front are looked at: 30,000 addresses in one minute, then each later connection, look at a bounded number
    of entries; the stale ones are forgotten; the rate limit itself holds as before."""
    now = [0.0]
    gate = ConnectionGate(connections_max=500, per_client_per_minute_max=3, clock=lambda: now[0],
                          auth_failures_per_minute_max=10, ipv6_prefix_length=128)  # each address a client
    gate._recent = _CountingDict()
    _CountingDict.reads = 0
    for k in range(30_000):
        ip = f"2001:db8::{k:x}"
        assert gate.admit(ip) is None
        gate.release(ip)
        now[0] += 0.001  # 30 s in all: every client still in the window
    assert _CountingDict.reads <= 2 * 30_000  # bounded per connection, not 10,000 per connection
    assert ["too many connections from 2001:db8::0"] == [gate.admit("2001:db8::0") for _ in range(3)][2:]
    now[0] += 61.0
    assert gate.admit("192.0.2.1") is None
    assert ["192.0.2.1"] == list(gate._recent)


def test_the_gates_client_windows_forget_from_the_front_in_constant_time_after_a_reload_too():
    """A plain dict's first key walks every slot deleted before it (CPython compacts only on a resize): the
    gate forgot stale clients from the front of dicts, so each connection cost O(clients seen lately), 21-25 us
    an admission at 20,000 clients a minute (bench/gate_admit.py; 5.6-6.4 us with OrderedDicts, alternating). The
    windows must be OrderedDicts at construction and after every reload that rebuilds them (a new per-client
    limit, a new AUTH-failure limit, a new IPv6 prefix), and a client seen again moves to the end."""
    now = [0.0]
    gate = ConnectionGate(connections_max=50, per_client_per_minute_max=5, clock=lambda: now[0],
                          auth_failures_per_minute_max=5)
    kinds = [(type(gate._recent), type(gate._auth_failures))]
    for change in ({"per_client_per_minute_max": 6}, {"auth_failures_per_minute_max": 7},
                   {"ipv6_prefix_length": 128}):
        settings = {"connections_max": 50, "per_client_per_minute_max": gate.per_client_max,
                    "exempt": lambda ip: False, "client_connections_max": 0, "mynetworks_reserve": 0,
                    "auth_failures_per_minute_max": gate.auth_failures_max,
                    "ipv6_prefix_length": gate.ipv6_prefix_length, **change}
        gate.configure(**settings)
        kinds.append((type(gate._recent), type(gate._auth_failures)))
    assert [(OrderedDict, OrderedDict)] * 4 == kinds
    for ip in ("192.0.2.1", "192.0.2.2", "192.0.2.1"):
        assert gate.admit(ip) is None
        gate.auth_failed(ip)
        now[0] += 1.0
    assert (["192.0.2.2", "192.0.2.1"], ["192.0.2.2", "192.0.2.1"]) == (list(gate._recent), list(gate._auth_failures))
    now[0] += 58.5  # 192.0.2.2 left the window, 192.0.2.1 (seen again later) did not
    assert gate.admit("192.0.2.3") is None
    assert ["192.0.2.1", "192.0.2.3"] == list(gate._recent)


def test_an_idle_client_of_the_daemon_gets_421_4_4_2_and_is_disconnected(tmp_path):
    """smtp_server_timeout_s: a client that sends nothing gets '421 4.4.2 ... timeout exceeded' (RFC 3463:
    timeout) and the daemon closes the connection."""
    from edgekit import RawClient

    with edge_relay(tmp_path, config="smtp_server_timeout_s = 1\n") as r, RawClient(r.port, timeout_s=30) as c:
        assert c.reply().startswith("220 ")
        assert (250, "") == codes(c.command("EHLO client.test"))
        assert f"421 4.4.2 {HOST} Error: timeout exceeded" == c.reply()
        assert c.closed()


def test_after_too_many_errors_the_client_gets_421_4_7_0_and_pipelined_commands_are_dropped(tmp_path):
    """Postfix smtpd_hard_error_limit: the 20th 5xx reply is followed by '421 4.7.0 ... too many errors'
    and the connection is closed; commands sent after it in the same packet are never answered."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        c.reply()
        c.command("EHLO client.test")
        c.send(b"RCPT TO:<b@example.net>\r\n" * 25 + b"NOOP\r\n")
        replies = []
        while reply := c.reply():
            replies.append(reply)
    assert ["503 5.5.1 Error: need MAIL command"] * 20 + [f"421 4.7.0 {HOST} Error: too many errors"] == replies


def test_unknown_commands_are_answered_500_then_421_4_7_0_after_five(tmp_path):
    """Unknown commands get 500 5.5.2; the fifth closes the session with 421 4.7.0 (aiosmtpd's limit)."""
    with run_edge(tmp_path) as edge, edge.raw() as c:
        c.reply()
        replies = [c.command(f"XYZZY{i}") for i in range(5)]
        assert c.closed()
    assert ["500 5.5.2 Error: command not recognized"] * 4 == replies[:4]  # the command is not echoed
    assert "421 4.7.0 Error: too many unrecognized commands" == replies[4]


def test_every_reply_but_greeting_ehlo_and_354_has_an_enhanced_status_code(tmp_path):
    """ENHANCEDSTATUSCODES is advertised, so every 2xx/4xx/5xx reply carries one (RFC 2034 §3)."""
    commands = ["NOOP", "HELP", "VRFY a@example.org", "EXPN list", "RSET", "MAIL FROM:<a@example.org>",
                "MAIL FROM:<a@example.org>", "RCPT TO:<b@example.net>", "RCPT TO:<bad", "STARTTLS", "AUTH PLAIN",
                "DATA extra", "MAIL FROM:<a@example.org> XFOO=1", "BDAT 10", "", "RSET now", "QUIT"]
    with run_edge(tmp_path) as edge, edge.raw() as c:
        assert c.reply().startswith("220 ")
        assert "250-ENHANCEDSTATUSCODES" in c.command("EHLO client.test").split("\n")
        replies = [c.command(cmd) for cmd in commands]
    assert [] == [r for r in replies if not ENHANCED.match(r)]


def test_the_idle_timeout_counts_from_the_last_command_not_the_first(tmp_path):
    """The idle timer moves on with every command without being set anew each time (mtaq's _reset_timeout):
    a client that sends a NOOP every 0.4 s for 2.4 s with a 1 s timeout is never cut off, and once it
    stops, the 421 4.4.2 comes a whole timeout after its last command, not at a deadline set earlier."""
    import time

    with run_edge(tmp_path, timeout_s=1) as edge, edge.raw() as c:
        assert c.reply().startswith("220")
        replies = []
        for _ in range(6):
            time.sleep(0.4)
            replies.append(codes(c.command("NOOP")))
        last = time.monotonic()
        assert [(250, "2.0.0")] * 6 == replies
        assert f"421 4.4.2 {HOST} Error: timeout exceeded" == c.reply()
        assert time.monotonic() - last >= 0.9
        assert c.closed()


def _on_both_loops(coro_fn):
    """Run ``coro_fn()`` under asyncio and under uvloop (the daemon's loop, whose timers are rounded to ms)."""
    import asyncio

    import uvloop

    return [runner(coro_fn()) for runner in (asyncio.run, uvloop.run)]


def test_a_command_in_the_last_millisecond_before_the_idle_deadline_is_answered_under_uvloop():
    """uvloop runs a timer up to 1 ms early and gives a plain Handle (no ``when()``) for under 0.5 ms: the
    idle timer must neither re-arm for that last millisecond nor fail when the client speaks then (it did:
    451 4.3.0 to the command, or the transport aborted in DATA). From a review."""
    import asyncio

    from mtaq.edge.smtp import MtaqSMTP

    class Handler:
        async def handle_DATA(self, *args):
            return "250 OK"

    async def main():
        fired = []
        loop = asyncio.get_running_loop()
        p = MtaqSMTP(Handler(), hostname=HOST, loop=loop, timeout=300)
        p._timeout_cb = lambda: fired.append(loop.time())  # no transport here
        p._reset_timeout()
        p._idle_deadline = loop.time() + 0.0002  # as if the timer ran 0.2 ms before its deadline
        p._idle_timer()  # within the last millisecond: the deadline counts as reached
        assert 1 == len(fired)
        p._reset_timeout()  # the client's next command in that window: a new timer, no error
        assert p._idle_armed and p._idle_when > loop.time() + 299
        p._timeout_handle.cancel()

    _on_both_loops(main)


def test_the_idle_timer_runs_once_an_expiry_under_uvloop():
    """Each expiry runs the idle timer about once (a moved deadline adds one run), not once a loop turn
    through uvloop's last rounded millisecond. From a review."""
    import asyncio

    from mtaq.edge.smtp import MtaqSMTP

    class Handler:
        async def handle_DATA(self, *args):
            return "250 OK"

    def count(runner):
        calls = []

        async def main():
            loop = asyncio.get_running_loop()
            p = MtaqSMTP(Handler(), hostname=HOST, loop=loop, timeout=0.0503)
            real = p._idle_timer

            def counted():
                calls.append(loop.time())
                real()

            p._idle_timer = counted
            p._timeout_cb = lambda: None  # no transport here: only the timer's runs are counted
            for _ in range(10):
                p._idle_armed = False
                p._reset_timeout()
                await asyncio.sleep(0.06)

        runner(main())
        return len(calls)

    import uvloop

    assert count(uvloop.run) <= 20
    assert count(asyncio.run) <= 20


def test_a_proxy_timeout_longer_than_the_idle_timeout_gives_way_to_it_after_the_handshake():
    """aiosmtpd arms the PROXY protocol's timeout, then after the handshake the idle timeout: a shorter idle
    deadline must replace the longer one already set (the timer that moves its deadline only forward must
    not keep the later one), under asyncio and uvloop. From a review."""
    import asyncio
    import logging

    from mtaq.edge.smtp import MtaqSMTP

    class Handler:
        async def handle_PROXY(self, server, session, envelope, proxy_data):
            return True

        async def handle_DATA(self, *args):
            return "250 OK"

    async def main():
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: MtaqSMTP(Handler(), hostname=HOST, loop=loop, timeout=0.4,
                                                        proxy_protocol_timeout=3.0), "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = loop.time()
        await asyncio.sleep(0.6)  # past the idle timeout: the timer now waits for the PROXY timeout's deadline
        w.write(b"PROXY TCP4 192.0.2.1 192.0.2.2 1234 25\r\n")
        greeting = await r.readline()
        rest = await asyncio.wait_for(r.read(), 10)  # idle after the handshake: the 421, then the close
        took = loop.time() - t0
        w.close()
        srv.close()
        return greeting, rest, took

    logging.getLogger("mail.log").disabled = True
    try:
        results = _on_both_loops(main)
    finally:
        logging.getLogger("mail.log").disabled = False
    for greeting, rest, took in results:
        assert greeting.startswith(b"220 ")
        assert rest.startswith(b"421 4.4.2")
        assert took < 2.0, took  # 0.6 s, then 0.4 s idle; not the 3 s PROXY timeout


def test_an_ipv6_client_is_its_prefix_and_an_ipv4_client_its_address():
    """Postfix ``smtpd_client_ipv6_prefix_length``: an IPv6 address counts as its first N bits (84 by
    default); IPv4, IPv4-mapped IPv6 and text that is no address count as they are."""
    assert "2001:db8:1::/84" == client_key("2001:db8:1::5")
    assert "2001:db8:1::/84" == client_key("2001:db8:1:0:0:fff::1")  # bits 84..127 differ: the same client
    assert "2001:db8:1:0:1000::/84" == client_key("2001:db8:1:0:1000::1")  # bit 67 differs: another
    assert "2001:db8:1::/64" == client_key("2001:db8:1::ffff:1", 64)
    assert "2001:db8:1::5" == client_key("2001:db8:1::5", 128)
    assert "::/0" == client_key("2001:db8:1::5", 0)
    assert "fe80::/84" == client_key("fe80::1%eth0")
    assert ["192.0.2.1", "::ffff:192.0.2.1", "unknown"] == [client_key(a) for a in ("192.0.2.1", "::ffff:192.0.2.1",
                                                                                    "unknown")]


def test_a_reload_that_changes_the_ipv6_prefix_keeps_every_count_exact():
    """A reload from 84 bits to 128 and back: the connections admitted before are counted under the new
    clients (kept by address too), each release finds its count, and nothing is left once all have ended;
    the same for password checks in progress (auth_begin / auth_end)."""
    gate = ConnectionGate(connections_max=100, per_client_per_minute_max=0, client_connections_max=2,
                          auth_failures_per_minute_max=2)
    limits = {"connections_max": 100, "per_client_per_minute_max": 0, "exempt": lambda ip: False,
              "client_connections_max": 2, "mynetworks_reserve": 0, "auth_failures_per_minute_max": 2}
    a = [f"2001:db8::{k}" for k in range(1, 5)]
    assert [None, None, "too many connections from 2001:db8::3"] == [gate.admit(ip) for ip in a[:3]]
    # two password checks in flight from one /84 (limit 2): a third address of it must wait
    assert [True, True, False] == [gate.auth_begin(a[0]), gate.auth_begin(a[1]), gate.auth_begin(a[2])]
    gate.configure(**limits, ipv6_prefix_length=128)
    assert [None, None] == [gate.admit(a[2]), gate.admit(a[3])]  # each address its own client now
    assert [True, False] == [gate.auth_begin(a[2]), gate.auth_blocked(a[2])]
    gate.configure(**limits, ipv6_prefix_length=84)
    assert "too many connections from 2001:db8::1" == gate.admit(a[0])  # 4 of one /84 again
    assert gate.auth_blocked(a[3])  # 3 checks in flight in the /84
    for ip in a:
        gate.release(ip)
    for ip in a[:3]:
        gate.auth_end(ip)
    assert (0, 0, {}, {}) == (gate.active, gate.active_outside, gate._per_client, gate._auth_checking)
    assert [None, None] == [gate.admit(a[0]), gate.admit(a[1])]
