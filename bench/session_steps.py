"""Where one SMTP session's time goes: one session after another (like ``smtp-source -s 1``), each step timed.

Connects to HOST:PORT, and for each of ``--sessions`` sessions: connect and read the banner, EHLO, MAIL,
RCPT, DATA, the message and its final dot, QUIT; one connection per message, TCP_NODELAY, the message sent
in one write. Prints one JSON object: the median milliseconds of each step over the sessions after the
first tenth (warm-up), the whole session, and messages/s from the mean session time; ``tail_ms`` gives the
90th and 99th percentile and the maximum of each step, and ``slow_share`` the part of all session time spent
in sessions slower than twice the median (where a mean above the median comes from). Works against any
SMTP server (run it against Postfix and mtaq in turn, both relaying to ``smtp-sink -c``); the client's own
time is in every figure alike. ``--cpu-pid PID`` adds the user + system CPU of that process and all its
descendants over the run, in ms per session (from /proc; for Postfix give its master, whose reaped children
count too). docs/performance.md, "Fifth round (issue 15)".

With several ``--port`` values the sessions go to each port in turn (an A/B of two daemons, say old and new
code, side by side): both see the same machine at the same moments, which a run after a run does not on a
shared VM whose speed drifts by tens of per cent within minutes. The figures are then given per port under
``by_port`` (and ``--cpu-pid`` takes one PID per port).

    .venv/bin/python bench/session_steps.py --port 2525 2526 --cpu-pid OLD_PID NEW_PID --sessions 4000

    .venv/bin/python bench/session_steps.py --port 2525 --sessions 3000
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

STEPS = ("connect+banner", "EHLO", "MAIL", "RCPT", "DATA", "dot", "QUIT", "total")


def _reply(s: socket.socket, buf: bytes = b"") -> None:
    """Read up to the last line of one reply ("NNN " after any "NNN-" lines)."""
    while True:
        lines = buf.split(b"\r\n")
        if any(len(line) >= 4 and line[3:4] == b" " for line in lines[:-1]):
            return
        chunk = s.recv(65536)
        if not chunk:
            raise EOFError("the server closed the connection")
        buf += chunk


def _tail(values: list[float]) -> dict[str, float]:
    """The 90th and 99th percentile and the maximum of ``values`` (milliseconds), rounded to microseconds."""
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p90": round(q[89], 3), "p99": round(q[98], 3), "max": round(max(values), 3)}


def _slow_share(totals: list[float]) -> float:
    """The fraction of the summed session time spent in sessions longer than twice the median session."""
    limit = 2 * statistics.median(totals)
    return round(sum(t for t in totals if t > limit) / sum(totals), 4)


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of process ``root`` and its descendants (with what they reaped), from /proc."""
    tck = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            parent[int(name)] = int(fields[1])
            cpu[int(name)] = sum(int(x) for x in fields[11:15]) / tck
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, nargs="+", default=[2525], help="one port, or several taken in turn")
    ap.add_argument("--sessions", type=int, default=3000)
    ap.add_argument("--size", type=int, default=2048, help="payload bytes of the message, headers not counted")
    ap.add_argument("--cpu-pid", type=int, nargs="+", help="report the CPU of this process tree per session "
                    "(one PID per --port)")
    args = ap.parse_args(argv)
    if args.sessions < 10:
        ap.error("--sessions must be >= 10")
    ports: list[int] = args.port
    pids: list[int] = args.cpu_pid or []
    if len(set(ports)) != len(ports):
        ap.error("--port: each port once")
    if pids and len(pids) != len(ports):
        ap.error("--cpu-pid: give one PID per --port")
    for pid in pids:
        if not os.path.exists(f"/proc/{pid}"):
            ap.error(f"--cpu-pid {pid}: no such process")
    cpu0 = [tree_cpu_s(pid) for pid in pids]
    line = b"x" * 78 + b"\r\n"
    body = (b"From: a@example.org\r\nTo: b@example.com\r\nSubject: steps\r\n\r\n"
            + line * max(1, args.size // len(line)) + b".\r\n")
    times: list[dict[str, list[float]]] = [{k: [] for k in STEPS} for _ in ports]
    clock = time.perf_counter_ns
    for i in range(args.sessions):
        n = i % len(ports)
        t = [clock()]
        try:
            s = socket.create_connection((args.host, ports[n]), timeout=30)
        except OSError as exc:
            print(f"session_steps: connect {args.host}:{ports[n]}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        with s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _reply(s)
            t.append(clock())
            for cmd in (b"EHLO client.example\r\n", b"MAIL FROM:<a@example.org>\r\n", b"RCPT TO:<b@example.com>\r\n",
                        b"DATA\r\n", body, b"QUIT\r\n"):
                s.sendall(cmd)
                _reply(s)
                t.append(clock())
        if i >= args.sessions // 10:
            for k, a, b in zip(STEPS, (*t[:-1], t[0]), (*t[1:], t[-1]), strict=True):
                times[n][k].append((b - a) / 1e6)
    results = []
    for n in range(len(ports)):
        res: dict[str, object] = {
            "median_ms": {k: round(statistics.median(v), 3) for k, v in times[n].items()},
            "msg_per_s": round(1000 / statistics.mean(times[n]["total"]), 1),
            "tail_ms": {k: _tail(v) for k, v in times[n].items()},
            "slow_share": _slow_share(times[n]["total"])}
        if pids:
            res["cpu_ms_per_session"] = round((tree_cpu_s(pids[n]) - cpu0[n]) * 1000 * len(ports) / args.sessions, 3)
        results.append(res)
    out: dict[str, object] = {"bench": "session_steps", "host": args.host, "sessions": args.sessions,
                              "size_bytes": args.size}
    if len(ports) == 1:
        out = {**out, "port": ports[0], **results[0]}
    else:
        out = {**out, "ports": ports, "by_port": {str(p): r for p, r in zip(ports, results, strict=True)}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
