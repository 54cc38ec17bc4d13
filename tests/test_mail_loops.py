"""Mail loops (issue 35.1): a hop count at DATA (Postfix ``hopcount_limit``) and no delivery to ourselves.

Real daemons (``mtaq serve`` subprocesses) relaying to each other over loopback, real SMTP clients.
"""

from __future__ import annotations

import smtplib
from pathlib import Path

from mtaq.testing.procs import free_port, read_events, start_daemon, wait_for

MESSAGE = b"From: s@example.org\r\nTo: r@example.net\r\nSubject: loop\r\n\r\nround and round\r\n"


def _events(log: str, name: str) -> list[dict]:
    return [e for e in read_events(log) if e.get("event") == name]


def _config(tmp: Path, name: str, relay_port: int, extra: str = "") -> str:
    path = tmp / f"{name}.toml"
    path.write_text(f'myhostname = "{name}.test"\nrelayhost = "[127.0.0.1]:{relay_port}"\nhopcount_limit = 8\n'
                    f"retry_intervals_s = [600]\n{extra}")
    return str(path)


def test_two_daemons_relaying_to_each_other_stop_at_the_hop_limit_with_one_dsn(tmp_path):
    """A relays to B and B to A (each other's relayhost). A message sent to A goes back and forth, one
    Received: field more at each hop, until the daemon it reaches already counts hopcount_limit (8) of them:
    that one refuses it at DATA with 554 5.4.6 (a ``too_many_hops`` event), the other bounces it, and its
    DSN, which loops the same way, is refused too and, having the null sender, makes no second DSN. One DSN
    in all; nothing is retried."""
    port_a, port_b = free_port(), free_port()
    a = start_daemon(str(tmp_path / "a"), None, str(tmp_path / "a.log"), port=port_a,
                     config=_config(tmp_path, "a", port_b))
    b = start_daemon(str(tmp_path / "b"), None, str(tmp_path / "b.log"), port=port_b,
                     config=_config(tmp_path, "b", port_a))
    logs = (a.log_path, b.log_path)
    try:
        with smtplib.SMTP("127.0.0.1", port_a, timeout=30) as s:
            assert {} == s.sendmail("s@example.org", ["r@example.net"], MESSAGE)
        refusals = wait_for(lambda: (r := [e for log in logs for e in _events(log, "too_many_hops")]) and len(r) == 2
                            and r, 60, "the message and its DSN refused")
        assert [(8, 8), (8, 8)] == [(e["hops"], e["limit"]) for e in refusals]
        assert {"s@example.org", "<>"} == {e["sender"] for e in refusals}  # the message, then its DSN
        bounced = wait_for(lambda: (x := [e for log in logs for e in _events(log, "bounced")]) and len(x) == 2 and x,
                           30, "two bounces")
        assert {"5.4.6"} == {e["dsn"] for e in bounced}
        assert 1 == len([e for log in logs for e in _events(log, "dsn_queued")])
        assert [] == [e for log in logs for e in _events(log, "deferred")]
    finally:
        a.kill9()
        b.kill9()


def test_a_next_hop_that_is_this_daemon_is_never_connected_to(tmp_path):
    """relayhost = [127.0.0.1]:OUR_PORT (a typing error, or an MX that points at us): the mail is bounced
    554 5.4.6 "mail for 127.0.0.1 loops back to myself" (Postfix's words) without a connection to ourselves:
    no second Received:, no too_many_hops, no retry loop filling the log. Its DSN goes the same way and, with
    the null sender, makes no other."""
    port = free_port()
    d = start_daemon(str(tmp_path / "spool"), None, str(tmp_path / "d.log"), port=port,
                     config=_config(tmp_path, "self", port))
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            assert {} == s.sendmail("s@example.org", ["r@example.net"], MESSAGE)
        bounced = wait_for(lambda: (x := _events(d.log_path, "bounced")) and len(x) == 2 and x, 30, "two bounces")
        assert {"554 5.4.6 mail for 127.0.0.1 loops back to myself"} == {e["reply"] for e in bounced}
        assert 1 == len(_events(d.log_path, "dsn_queued"))
        assert 1 == len(_events(d.log_path, "queued"))  # from the client only: nothing came back in over SMTP
        assert [] == _events(d.log_path, "too_many_hops")
    finally:
        d.kill9()
