"""mtaq against Postfix on the same machine, in the same run, with the same load and the same sink (issue 8).

Both relays get the same ``smtp-source`` load (Postfix's test client) and relay to the same kind of sink,
Postfix's ``smtp-sink``, started afresh for each run and counting every message it receives (``-c``). The
two sides alternate, Postfix then mtaq, for ``--pairs`` pairs (at least 3), so that a noisy neighbour on
the machine hurts both alike. Every run waits for the queue to drain into the sink before the next starts.

Per run:

* ``accepted_per_s`` = messages / (smtp-source's wall time): every message was answered 250 to DATA
  (smtp-source exits non-zero on any other reply), in messages/s;
* ``e2e_per_s`` = messages / (time the sink counted the last message - start of smtp-source), messages/s;
* mtaq only: ``cpu_ms_per_msg``, the user + system CPU time of its processes from the start of the load to
  the last message in the sink, per message (ms); ``fsyncs_per_msg``; ``peak_rss_kib``.

It prints ONE JSON line on stdout: each side's median ``accepted_per_s`` and ``e2e_per_s`` (with the runs
themselves), and ``ratio_e2e`` / ``ratio_accepted`` = mtaq median / Postfix median. The exit status is 0
only when every run delivered every message.

Both keep their promise: Postfix's cleanup(8) fsyncs each queue file before smtpd answers 250 (it has no
setting to turn that off; the script checks that the running master has no libeatmydata loaded), and
mtaq answers 250 after a group-commit fsync covering the message. Both spools are on the same file system
(``same_device`` in the output).

Postfix set-up (needs root): installed from Debian if missing (``DEBIAN_FRONTEND=noninteractive``, debconf
"No configuration"), then configured as a pure relay: no local delivery (``mydestination`` empty,
``local_transport = error:...``), ``relayhost = [127.0.0.1]:SINK``, ``mynetworks = 127.0.0.0/8``,
``inet_interfaces = loopback-only``, smtpd moved to ``127.0.0.1:--postfix-port`` (10025), everything else
as Debian ships it (chroot, process limits, connection cache). It is started with ``postfix start`` (or
reloaded). This rewrites the machine's Postfix configuration: run it on a bench machine.

mtaq: ``mtaq serve`` with a fresh spool for each run, ``--relayhost [127.0.0.1]:SINK``, ``--workers N``
(``--workers``, default 1), JSON logs to a file, its embedded defaults otherwise (``stats_interval_s`` 0.5
so that fsyncs per message can be reported, summed over the workers; ``peak_rss_kib`` is the sum of the
VmHWM of the supervisor and the workers).

Load (``smtp-source``): ``-s SESSIONS -m MESSAGES -l SIZE -r RECIPIENTS``; ``-l`` is the payload length in
bytes without the headers; one connection per message, as smtp-source does by default (``--reuse`` adds
``-d``: many messages per connection). Variants of issue 8::

    .venv/bin/python bench/compare_postfix.py                              # 20 sessions, 10,000 x 2 KiB, 1 rcpt
    .venv/bin/python bench/compare_postfix.py --sessions 1 --messages 2000
    .venv/bin/python bench/compare_postfix.py --sessions 100
    .venv/bin/python bench/compare_postfix.py --recipients 10
    .venv/bin/python bench/compare_postfix.py --size 102400 --messages 3000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from mtaq.testing.procs import peak_rss_kib

SENDER = "bench@source.example"
RCPT = "rcpt@dest.example"
POSTFIX_SPOOL = "/var/spool/postfix"


def log(msg: str) -> None:
    print(f"compare_postfix: {msg}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str], *, check: bool = True, env: dict[str, str] | None = None) -> str:
    p = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[:500]}")
    return p.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


# ------------------------------------------------------------------------------------------------ Postfix


def ensure_postfix_installed() -> None:
    if shutil.which("postconf") and shutil.which("smtp-source") and shutil.which("smtp-sink"):
        return
    if os.geteuid() != 0:
        raise RuntimeError("Postfix is not installed and this is not root: apt-get install postfix first")
    log("installing Postfix from Debian")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sel = "postfix postfix/main_mailer_type select No configuration\npostfix postfix/mailname string bench.localdomain\n"
    subprocess.run(["debconf-set-selections"], input=sel, text=True, check=False, env=env)
    cmd = ["apt-get", "install", "-y", "-qq", "postfix"]
    if subprocess.run(cmd, capture_output=True, env=env).returncode != 0:
        run(["apt-get", "update", "-qq"], env=env)
        run(cmd, env=env)


def configure_postfix(listen_port: int, sink_port: int) -> dict[str, Any]:
    """Write the relay configuration and start (or reload) Postfix; returns what is worth reporting."""
    settings = {
        "compatibility_level": "3.6",
        "myhostname": "postfix-bench.localdomain",  # not the sink's greeting name: no "loops back to myself"
        "mydomain": "localdomain",
        "myorigin": "$myhostname",
        "mydestination": "",
        "local_recipient_maps": "",
        "local_transport": "error:5.1.1 local delivery is disabled",
        "alias_maps": "",
        "alias_database": "",
        "relayhost": f"[127.0.0.1]:{sink_port}",
        "mynetworks": "127.0.0.0/8",
        "inet_interfaces": "loopback-only",
        "inet_protocols": "ipv4",
        "smtpd_relay_restrictions": "permit_mynetworks, reject_unauth_destination",
        "maillog_file": "/var/log/postfix-bench.log",
        "smtputf8_enable": "no",
    }
    if not os.path.exists("/etc/postfix/main.cf"):
        open("/etc/postfix/main.cf", "a").close()
    run(["postconf", "-e", *(f"{k}={v}" for k, v in settings.items())])
    service = f"127.0.0.1:{listen_port}"
    masters = run(["postconf", "-M"])
    for line in masters.splitlines():  # the stock port 25 service, and ours of an earlier run on another port
        f = line.split()
        if len(f) >= 2 and f[1] == "inet" and f[0] != service and (
            f[0] == "smtp" or re.fullmatch(r"127\.0\.0\.1:\d+", f[0])
        ):
            run(["postconf", "-MX", f"{f[0]}/inet"])
    run(["postconf", "-M", f"{service}/inet={service} inet n - y - - smtpd"])
    run(["postfix", "check"], check=False)
    status = subprocess.run(["postfix", "status"], capture_output=True).returncode
    if status == 0:
        run(["postfix", "reload"])
    else:
        run(["postfix", "start"])
    wait_port(listen_port)
    info: dict[str, Any] = {"postfix_version": run(["postconf", "-h", "mail_version"]).strip()}
    pid = _postfix_master_pid()
    if pid is not None:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
            if "eatmydata" in f.read():
                raise RuntimeError("Postfix's master runs with libeatmydata: fsync is disabled; restart it without")
    return info


def _postfix_master_pid() -> int | None:
    try:
        with open(os.path.join(POSTFIX_SPOOL, "pid", "master.pid"), encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def postfix_queue_count() -> int:
    n = 0
    for sub in ("maildrop", "incoming", "active", "deferred", "hold"):
        for _root, _dirs, files in os.walk(os.path.join(POSTFIX_SPOOL, sub)):
            n += len(files)
    return n


# --------------------------------------------------------------------------------------------------- sink


class Sink:
    """Postfix's ``smtp-sink -c`` on 127.0.0.1:port; a thread reads its running ``mesg=N`` counter."""

    def __init__(self, port: int, backlog: int, target: int) -> None:
        cmd = ["smtp-sink", "-c"]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]
        cmd += [f"127.0.0.1:{port}", str(backlog)]
        self.port = port
        self.count = 0
        self.cond = threading.Condition()
        self.reached: dict[int, float] = {}
        self.target = target  # the time the count reaches it is taken as the count is read
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        wait_port(port)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        while True:
            chunk = os.read(fd, 65536)
            now = time.time()
            if not chunk:
                return
            pending += chunk
            *done, pending = re.split(rb"[\r\n]", pending)
            last = None
            for tok in done:
                m = re.search(rb"mesg=(\d+)", tok)
                if m:
                    last = int(m.group(1))
            if last is not None:
                with self.cond:
                    self.count = max(self.count, last)
                    if self.target and self.count >= self.target and self.target not in self.reached:
                        self.reached[self.target] = now
                    self.cond.notify_all()

    def wait_for(self, n: int, timeout_s: float) -> float | None:
        """Wall-clock time (UTC s) at which the sink had received ``n`` messages, or None on timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.target = n
            if self.count >= n and n not in self.reached:
                self.reached[n] = time.time()
            while n not in self.reached:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return None
                self.cond.wait(min(left, 0.5))
            return self.reached[n]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


# --------------------------------------------------------------------------------------------------- runs


def smtp_source(args: argparse.Namespace, port: int) -> tuple[float, float, int, str]:
    """Run the load; returns (start, end) wall-clock times, exit status and stderr."""
    cmd = ["smtp-source", "-s", str(args.sessions), "-m", str(args.messages), "-l", str(args.size),
           "-r", str(args.recipients), "-f", SENDER, "-t", RCPT, "-M", "source.example"]
    if args.reuse:
        cmd.append("-d")
    cmd.append(f"127.0.0.1:{port}")
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    return t0, time.time(), p.returncode, (p.stderr or p.stdout).strip()


def run_postfix(args: argparse.Namespace, sink_port: int) -> dict[str, Any]:
    left = postfix_queue_count()
    if left:
        log(f"Postfix queue not empty ({left} files): postsuper -d ALL")
        run(["postsuper", "-d", "ALL"], check=False)
    sink = Sink(sink_port, args.backlog, args.messages)
    try:
        t0, t1, rc, err = smtp_source(args, args.postfix_port)
        t_e2e = sink.wait_for(args.messages, args.timeout) if rc == 0 else None
    finally:
        sink.stop()
    return _result(args, t0, t1, rc, err, t_e2e, sink.count)


def run_mtaq(args: argparse.Namespace, sink_port: int, workdir: str, i: int) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"mtaq-{i}-", dir=workdir)
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w", encoding="utf-8") as f:
        f.write("stats_interval_s = 0.5\n")
    port = free_port()
    logf = os.path.join(work, "daemon.log")
    sink = Sink(sink_port, args.backlog, args.messages)
    out = open(logf, "ab")
    daemon = subprocess.Popen(
        [*args.mtaq, "--log-format", "json", "serve", "--spool", os.path.join(work, "spool"),
         "--listen", f"127.0.0.1:{port}", "--relayhost", f"[127.0.0.1]:{sink_port}", "--config", conf,
         "--workers", str(args.workers)],
        stdout=out, stderr=out, stdin=subprocess.DEVNULL,
    )
    try:
        wait_port(port)
        _wait_event(logf, "recovery_complete", 30)
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "-r", "250", "-f", args.py_spy_format,
                                    "-o", f"{args.py_spy}.{i}", "--pid", str(daemon.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        pids = [daemon.pid, *_children(daemon.pid)]
        cpu0 = sum(_cpu_s(p) for p in pids)
        t0, t1, rc, err = smtp_source(args, port)
        t_e2e = sink.wait_for(args.messages, args.timeout) if rc == 0 else None
        cpu1 = sum(_cpu_s(p) for p in pids)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        res = _result(args, t0, t1, rc, err, t_e2e, sink.count)
        res["cpu_ms_per_msg"] = round(1000 * (cpu1 - cpu0) / args.messages, 3)  # user + system, all processes
        time.sleep(1.2)  # a stats event after the drain
        res["peak_rss_kib"] = sum(peak_rss_kib(p) or 0 for p in pids)  # supervisor + workers
        last: dict[Any, dict[str, Any]] = {}
        for e in _events(logf):
            if e.get("event") == "stats":
                last[e.get("shard")] = e  # the last of each worker
        if last:
            fsyncs = sum(e.get("fsync_calls", 0) for e in last.values())
            rounds = sum(e.get("commit_rounds", 0) for e in last.values())
            res["fsyncs_per_msg"] = round(fsyncs / args.messages, 4)
            res["commit_rounds_per_msg"] = round(rounds / args.messages, 4)
        res["alive"] = daemon.poll() is None
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        out.close()
        sink.stop()
    res["spool_dev"] = os.stat(work).st_dev
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return res


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                if int(f.read().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(name))
    return out


def _result(args: argparse.Namespace, t0: float, t1: float, rc: int, err: str, t_e2e: float | None,
            sink_count: int) -> dict[str, Any]:
    res: dict[str, Any] = {
        "accepted_per_s": round(args.messages / (t1 - t0), 1) if rc == 0 else None,
        "e2e_per_s": round(args.messages / (t_e2e - t0), 1) if t_e2e is not None else None,
        "load_s": round(t1 - t0, 3),
        "e2e_s": round(t_e2e - t0, 3) if t_e2e is not None else None,
        "sink_count": sink_count,
    }
    if rc != 0:
        res["source_exit"] = rc
        res["source_error"] = err[-300:]
    return res


def _events(path: str) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def _wait_event(path: str, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.get("event") == name for e in _events(path)):
            return
        time.sleep(0.05)
    raise RuntimeError(f"mtaq did not log {name} within {timeout_s}s (see {path})")


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 1) if len(vals) == len(runs) and vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=20, help="parallel SMTP sessions (smtp-source -s)")
    ap.add_argument("--messages", type=int, default=10000, help="messages per run (smtp-source -m)")
    ap.add_argument("--size", type=int, default=2048, help="payload bytes per message, headers not counted (-l)")
    ap.add_argument("--recipients", type=int, default=1, help="recipients per message (smtp-source -r)")
    ap.add_argument("--pairs", type=int, default=3, help="Postfix/mtaq pairs, alternating (at least 3)")
    ap.add_argument("--reuse", action="store_true", help="many messages per connection (smtp-source -d)")
    ap.add_argument("--postfix-port", type=int, default=10025, help="Postfix smtpd listens on 127.0.0.1:PORT")
    ap.add_argument("--backlog", type=int, default=1024, help="smtp-sink listen backlog")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (load, then drain)")
    ap.add_argument("--workdir", default="/var/tmp", help="where mtaq's spools go (the disk Postfix's spool is on)")
    ap.add_argument("--keep", action="store_true", help="keep mtaq's spools and logs")
    ap.add_argument("--mtaq", nargs="+", default=[sys.executable, "-m", "mtaq.cli"], help="how to run mtaq")
    ap.add_argument("--workers", type=int, default=1, help="mtaq worker processes (mtaq serve --workers)")
    ap.add_argument("--only", choices=("postfix", "mtaq"), help="run one side only (no ratio; for profiling)")
    ap.add_argument("--py-spy", metavar="FILE", help="profile mtaq with py-spy (in PATH) into FILE.<pair>")
    ap.add_argument("--py-spy-format", default="raw", choices=("raw", "flamegraph", "speedscope"))
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.messages < 1 or args.sessions < 1 or args.recipients < 1:
        ap.error("--pairs, --messages, --sessions and --recipients must be >= 1")
    if args.pairs < 3 and args.only is None:
        log("fewer than 3 pairs: the medians are not what issue 8 asks for")

    ensure_postfix_installed()
    sink_port = free_port()
    out: dict[str, Any] = {
        "bench": "compare_postfix",
        "sessions": args.sessions,
        "messages": args.messages,
        "size_bytes": args.size,
        "recipients": args.recipients,
        "reuse_connections": args.reuse,
        "mtaq_workers": args.workers,
        "pairs": args.pairs,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }
    sides = ["postfix", "mtaq"] if args.only is None else [args.only]
    if "postfix" in sides:
        out.update(configure_postfix(args.postfix_port, sink_port))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    os.makedirs(args.workdir, exist_ok=True)
    for i in range(args.pairs):
        for side in sides:
            log(f"pair {i + 1}/{args.pairs}: {side} ...")
            r = run_postfix(args, sink_port) if side == "postfix" else run_mtaq(args, sink_port, args.workdir, i)
            log(f"pair {i + 1}/{args.pairs}: {side} {json.dumps(r)}")
            runs[side].append(r)
    for side in sides:
        rs = runs[side]
        out[side] = {
            "accepted_per_s": _median(rs, "accepted_per_s"),
            "e2e_per_s": _median(rs, "e2e_per_s"),
            "runs": [{k: v for k, v in r.items() if k != "spool_dev"} for r in rs],
        }
    if args.only is None:
        p, m = out["postfix"], out["mtaq"]
        for key, name in (("e2e_per_s", "ratio_e2e"), ("accepted_per_s", "ratio_accepted")):
            out[name] = round(m[key] / p[key], 3) if m[key] and p[key] else None
        devs = {r.get("spool_dev") for r in runs["mtaq"]}
        out["same_device"] = devs == {os.stat(POSTFIX_SPOOL).st_dev}
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out), flush=True)
    ok = all(r.get("e2e_per_s") is not None for rs in runs.values() for r in rs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
