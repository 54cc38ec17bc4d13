"""mtaq against Postfix on the same machine, in the same run, with the same load and the same sink (issues 8, 15).

Both relays get the same ``smtp-source`` load (Postfix's test client) and relay to the same kind of sink,
Postfix's ``smtp-sink``, started afresh for each run and counting every message it receives (``-c``). The
two sides alternate for ``--pairs`` pairs (at least 3), so that a noisy neighbour on the machine hurts
both alike, and which side goes first alternates too (Postfix then mtaq, mtaq then Postfix, ...): the
second run of a pair starts on a machine still warm from the first (load average, page cache, the disk's
write-back), which cost the second side 3-7 % in A/B runs of mtaq against itself. Every run waits for the queue to drain into the sink before the next starts.

Per run and side (the same measurement for both):

* ``accepted_per_s`` = messages / (smtp-source's wall time): every message was answered 250 to DATA
  (smtp-source exits non-zero on any other reply), in messages/s;
* ``e2e_per_s`` = messages / (the moment the sink's counter first showed the last message - the start of
  smtp-source), messages/s: what a user sees, mail in until mail out;
* ``cpu_ms_per_msg``: user + system CPU of the relay's whole process tree from the start of the load until
  the last message is in the sink, per message (ms). For Postfix the master and its children, with the CPU
  of the children that ended meanwhile (the master reaps them: its cutime/cstime); for mtaq the daemon
  and its workers;
* ``machine_cpu_ms_per_msg``: the same span's busy CPU of the whole machine (``/proc/stat``, every core:
  the load generator, the sink, a milter and the relay), per message (ms); ``milter_cpu_ms_per_msg``:
  the no-op milter's process (``--milter``), which both relays share;
* ``fsync_calls_per_msg``: fsync(2) + fdatasync(2) calls of that process tree, counted by the kernel's
  syscall tracepoints (``perf stat -p``; no ptrace, no slow-down), None without perf;
* ``latency_250_ms`` (p50, p99, max): a probe session beside the load (``--probe-interval``, 0.1 s) sends
  a message of the same size on one connection every interval and times the reply to the final dot, the
  250 that promises the message is on disk. The probe's messages count in the totals;
* mtaq only: ``peak_rss_kib`` (supervisor + workers), ``worker_processes``, and with ``--log-format json``
  its own fsync count (``fsyncs_per_msg``, from its ``stats`` events).

It prints ONE JSON line on stdout: each side's medians, the runs themselves, and ``ratio_e2e`` /
``ratio_accepted`` = mtaq median / Postfix median. ``--suite`` (``make compare``) runs issue 15's four
variants in one go and prints them as a Markdown table on stderr too. The exit status is 0 only when every
run delivered every message.

Both keep their promise: Postfix's cleanup(8) fsyncs each queue file before smtpd answers 250 (it has no
setting to turn that off; the script checks that the running master has no libeatmydata loaded), and
mtaq answers 250 after a group-commit fsync covering the message. Both spools are on the same file system
(``same_device`` in the output).

Postfix set-up (needs root): installed from Debian if missing (``DEBIAN_FRONTEND=noninteractive``, debconf
"No configuration"), then configured as a pure relay: no local delivery (``mydestination`` empty,
``local_transport = error:...``), ``relayhost = [127.0.0.1]:SINK``, ``mynetworks = 127.0.0.0/8``,
``inet_interfaces = loopback-only``, logging to a file (``maillog_file``, as mtaq logs to a file), smtpd
moved to ``127.0.0.1:--postfix-port`` (10025), everything else as Debian ships it (chroot, process limits,
connection cache). It is started with ``postfix start`` (or reloaded). This rewrites the machine's Postfix
configuration: run it on a bench machine. ``bench/independent_postfix.sh`` is a cross-check sharing no code
with this script (Debian's satellite configuration, ``make run``'s mtaq).

mtaq: ``mtaq serve`` with a fresh spool for each run, ``--relayhost [127.0.0.1]:SINK``, ``--workers N|auto``
if given (else mtaq's default), its default console log to a file, its embedded defaults otherwise
(``stats_interval_s`` 0.5; ``--mtaq-config LINE`` adds a line).

Content filter (``--milter full|eom``, issue 34): the same no-op milter in front of both, Postfix's
``smtpd_milters`` and mtaq's, with ``milter_default_action = tempfail`` on both. ``--milter-impl c`` (the
default) is ``bench/noop_milter.c`` on Sendmail's libmilter, a thread per filter connection, compiled into
``build/noop_milter`` on first use (``gcc``, ``libmilter-dev``); ``python`` is ``bench/noop_milter.py``, one
event loop for every connection, which at 20 sessions is itself the limit of both MTAs (about 250 msg/s on
a 2-core machine). The JSON's ``milter`` has the filter's own count of connections and of messages it
answered at end of message, over every run of both sides.

Load (``smtp-source``): ``-s SESSIONS -m MESSAGES -l SIZE -r RECIPIENTS``; ``-l`` is the payload length in
bytes without the headers; one connection per message, as smtp-source does by default (``--reuse`` adds
``-d``: many messages per connection). Examples::

    .venv/bin/python bench/compare_postfix.py --suite                      # make compare: issue 15's table
    .venv/bin/python bench/compare_postfix.py --workers 1                  # 20 sessions, 10,000 x 2 KiB, 1 rcpt
    .venv/bin/python bench/compare_postfix.py --sessions 1 --messages 2000
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
import smtplib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import mtaq
from mtaq.testing.procs import children, mail_owner_ready, peak_rss_kib

# The daemon runs the mtaq this script imported (PYTHONPATH=TREE chooses the tree, for an A/B of two
# commits), from its work directory: with the working directory inside another tree, ``python -m`` would
# import that tree's mtaq first, ahead of PYTHONPATH.
MTAQ_TREE = os.path.dirname(os.path.dirname(os.path.abspath(mtaq.__file__)))
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def _tree_commit(tree: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None

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


def configure_postfix(listen_port: int, sink_port: int, milter: str = "") -> dict[str, Any]:
    """Write the relay configuration and start (or reload) Postfix; returns what is worth reporting.
    ``milter``: the ``smtpd_milters`` address of the no-op milter (``--milter``), "" for none (cleared: the
    setting would stay from an earlier run otherwise)."""
    settings = {
        "smtpd_milters": milter,
        "milter_default_action": "tempfail",
        "milter_protocol": "6",
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

    def __init__(self, port: int, backlog: int) -> None:
        cmd = ["smtp-sink", "-c"]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]
        cmd += [f"127.0.0.1:{port}", str(backlog)]
        self.port = port
        self.count = 0
        self.cond = threading.Condition()
        self.history: list[tuple[int, float]] = []  # (count, wall-clock time it was read)
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
                    if last > self.count:
                        self.count = last
                        self.history.append((last, now))
                    self.cond.notify_all()

    def wait_for(self, n: int, timeout_s: float) -> float | None:
        """Wall-clock time (UTC s) at which the sink's counter first showed ``n`` messages (read as it was
        printed), or None on timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.count < n:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return None
                self.cond.wait(min(left, 0.5))
            return next(t for c, t in self.history if c >= n)

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


class Probe(threading.Thread):
    """One more SMTP session beside the load, the same on both sides: on one connection, a message of the
    load's size every ``interval_s``, timing the reply to the final dot (the 250 that says the message is
    safe on disk) from the moment the body has been written. ``latencies_ms``: one per accepted message."""

    def __init__(self, port: int, size: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.interval_s = interval_s
        payload = (b"x" * 78 + b"\r\n") * max(1, size // 80)
        self.body = (b"From: <" + SENDER.encode() + b">\r\nTo: <" + RCPT.encode() + b">\r\nSubject: probe\r\n\r\n"
                     + payload + b".\r\n")
        self.stopping = threading.Event()
        self.latencies_ms: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            s = smtplib.SMTP("127.0.0.1", self.port, timeout=60)
            s.ehlo("probe.example")
            while not self.stopping.wait(self.interval_s):
                s.mail(SENDER)
                s.rcpt(RCPT)
                s.putcmd("data")
                code, msg = s.getreply()
                if code != 354:
                    raise smtplib.SMTPResponseException(code, msg)
                t = time.perf_counter()
                s.send(self.body)
                code, msg = s.getreply()
                if code != 250:
                    raise smtplib.SMTPResponseException(code, msg)
                self.latencies_ms.append(1000 * (time.perf_counter() - t))
            s.quit()
        except (OSError, smtplib.SMTPException) as exc:
            self.errors.append(repr(exc))

    def finish(self) -> int:
        """Stop after the message in progress; the number of messages the relay accepted."""
        self.stopping.set()
        self.join(120)
        return len(self.latencies_ms)


def _measure(args: argparse.Namespace, port: int, sink: Sink, root_pid: int) -> dict[str, Any]:
    """Run the load (and the probe) into ``port``; CPU of ``root_pid``'s process tree and the disk's flushes
    from the start of the load until the sink counted the last message."""
    probe = Probe(port, args.size, args.probe_interval) if args.probe_interval > 0 else None
    fsyncs = FsyncCounter(root_pid)
    milter_pid = getattr(args, "milter_pid", None)
    cpu0, busy0 = _tree_cpu_s(root_pid), _machine_busy_s()
    milter0 = _tree_cpu_s(milter_pid) if milter_pid else 0.0
    if probe is not None:
        probe.start()
    t0, t1, rc, err = smtp_source(args, port)
    extra = probe.finish() if probe is not None else 0
    total = args.messages + extra
    t_e2e = sink.wait_for(total, args.timeout) if rc == 0 else None
    cpu1, busy1, n_fsyncs = _tree_cpu_s(root_pid), _machine_busy_s(), fsyncs.stop()
    res = _result(args, t0, t1, rc, err, t_e2e, sink.count, total)
    res["cpu_ms_per_msg"] = round(1000 * (cpu1 - cpu0) / total, 3)  # user + system, the whole process tree
    # every process of the machine (the load, the sink, a milter, the relay): where the budget of the cores goes
    res["machine_cpu_ms_per_msg"] = round(1000 * (busy1 - busy0) / total, 3)
    if milter_pid:
        res["milter_cpu_ms_per_msg"] = round(1000 * (_tree_cpu_s(milter_pid) - milter0) / total, 3)
    if n_fsyncs is not None:
        res["fsync_calls_per_msg"] = round(n_fsyncs / total, 3)  # fsync + fdatasync, perf's count
    if probe is not None:
        lat = sorted(probe.latencies_ms)
        res["probe_messages"] = extra
        if lat:
            res["latency_250_ms"] = {"p50": round(lat[len(lat) // 2], 2),
                                     "p99": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
                                     "max": round(lat[-1], 2)}
        if probe.errors:
            res["probe_error"] = probe.errors[0][:200]
    return res


def run_postfix(args: argparse.Namespace, sink_port: int) -> dict[str, Any]:
    left = postfix_queue_count()
    if left:
        log(f"Postfix queue not empty ({left} files): postsuper -d ALL")
        run(["postsuper", "-d", "ALL"], check=False)
    master = _postfix_master_pid()
    if master is None:
        raise RuntimeError("Postfix's master is not running")
    sink = Sink(sink_port, args.backlog)
    try:
        return _measure(args, args.postfix_port, sink, master)
    finally:
        sink.stop()


def run_mtaq(args: argparse.Namespace, sink_port: int, workdir: str, i: int) -> dict[str, Any]:
    work = os.path.abspath(tempfile.mkdtemp(prefix=f"mtaq-{i}-", dir=workdir))
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w", encoding="utf-8") as f:
        f.write("stats_interval_s = 0.5\n" + "".join(line + "\n" for line in args.mtaq_config))
    port = free_port()
    logf = os.path.join(work, "daemon.log")
    os.makedirs(os.path.join(work, "spool"), exist_ok=True)
    mail_owner_ready(os.path.join(work, "spool"), conf)  # run as root: mtaq serve switches to mail_owner
    sink = Sink(sink_port, args.backlog)
    out = open(logf, "ab")
    daemon = subprocess.Popen(
        [*args.mtaq, "--log-format", args.log_format, "serve", "--spool", os.path.join(work, "spool"),
         "--listen", f"127.0.0.1:{port}", "--relayhost", f"[127.0.0.1]:{sink_port}", "--config", conf,
         "--admin-listen", f"127.0.0.1:{free_port()}",  # not the default 2580: another daemon may hold it
         *(["--workers", str(args.workers)] if args.workers is not None else [])],
        stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=work,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([MTAQ_TREE, *filter(None, [os.environ.get("PYTHONPATH")])])},
    )
    try:
        wait_port(port)
        _wait_event(logf, "recovery_complete", 30)
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "--subprocesses", "-r", "250", "-f", args.py_spy_format,
                                    "-o", f"{args.py_spy}.{i}", "--pid", str(daemon.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        pids = [daemon.pid, *children(daemon.pid)]
        res = _measure(args, port, sink, daemon.pid)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        res["worker_processes"] = max(1, len(pids) - 1)
        time.sleep(1.2)  # a stats event after the drain
        res["peak_rss_kib"] = sum(peak_rss_kib(p) or 0 for p in pids)  # supervisor + workers
        last: dict[Any, dict[str, Any]] = {}
        for e in _events(logf):
            if e.get("event") == "stats":
                last[e.get("shard")] = e  # the last of each worker
        if last:
            fsyncs = sum(e.get("fsync_calls", 0) for e in last.values())
            rounds = sum(e.get("commit_rounds", 0) for e in last.values())
            res["fsyncs_per_msg"] = round(fsyncs / res["messages"], 4)
            res["commit_rounds_per_msg"] = round(rounds / res["messages"], 4)
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


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user + system CPU seconds with what it collected from children it reaped:
    utime + stime + cutime + cstime), from /proc."""
    table: dict[int, tuple[int, float]] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), \
                    open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
                table[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tck)
    return table


def _descendants(root: int, table: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """``root`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _cpu) in (table if table is not None else _proc_table()).items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``: user, nice, system, irq,
    softirq and steal of every core; idle and iowait left out)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of process ``root`` and all its descendants, with what each has collected
    from children it reaped (cutime + cstime): Postfix's master reaps its smtpd, cleanup, smtp... processes,
    so the CPU of processes that ended during the run is counted too."""
    table = _proc_table()
    return sum(table[pid][1] for pid in _descendants(root, table) if pid in table)


class FsyncCounter:
    """fsync(2) + fdatasync(2) calls of a process tree, counted by the kernel's syscall tracepoints with
    ``perf stat -p PIDS`` (children and threads created later are counted too; no ptrace, so the relay runs
    at full speed). The same count for both relays; None where perf or its tracepoints are missing."""

    EVENTS = "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync"

    def __init__(self, root: int) -> None:
        self.proc: subprocess.Popen[str] | None = None
        for _ in range(10 if shutil.which("perf") else 0):  # a process that ended between listing and attaching
            proc = subprocess.Popen(
                ["perf", "stat", "-x", ",", "-e", self.EVENTS, "-p", ",".join(map(str, _descendants(root)))],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)  # attached, or failed
            if proc.poll() is None:
                self.proc = proc
                return
            log(f"perf stat: {(proc.communicate()[1] or '').strip()[:200]}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        _out, err = self.proc.communicate(timeout=30)
        total, seen = 0, 0
        for line in err.splitlines():
            f = line.split(",")
            if len(f) >= 3 and f[2] in self.EVENTS.split(",") and f[0].isdigit():
                total += int(f[0])
                seen += 1
        return total if seen == 2 else None


def _result(args: argparse.Namespace, t0: float, t1: float, rc: int, err: str, t_e2e: float | None,
            sink_count: int, total: int) -> dict[str, Any]:
    res: dict[str, Any] = {
        "messages": total,
        "accepted_per_s": round(total / (t1 - t0), 1) if rc == 0 else None,
        "e2e_per_s": round(total / (t_e2e - t0), 1) if t_e2e is not None else None,
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
    """Wait until the daemon's log (JSON or console) has an event ``name``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
            if re.search(rf'"event": ?"{name}"|\b{name}\b', f.read()):
                return
        time.sleep(0.05)
    raise RuntimeError(f"mtaq did not log {name} within {timeout_s}s (see {path})")


def _median(runs: list[dict[str, Any]], key: str, digits: int = 1) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), digits) if len(vals) == len(runs) and vals else None


VARIANTS = (  # issue 15's table: (name, sessions, messages, size, workers: None = mtaq's default)
    ("20 sessions, 2 KiB, --workers 1", 20, 10000, 2048, "1"),
    ("20 sessions, 2 KiB, default workers", 20, 10000, 2048, None),
    ("1 session, 2 KiB, default workers", 1, 2000, 2048, None),
    ("20 sessions, 100 KiB, default workers", 20, 3000, 102400, None),
)


def compare(args: argparse.Namespace, sink_port: int) -> dict[str, Any]:
    """One variant: Postfix and mtaq alternating for ``args.pairs`` pairs; medians and ratios."""
    out: dict[str, Any] = {
        "sessions": args.sessions,
        "messages": args.messages,
        "size_bytes": args.size,
        "recipients": args.recipients,
        "reuse_connections": args.reuse,
        "mtaq_workers": args.workers or "default",
        "pairs": args.pairs,
        "probe_interval_s": args.probe_interval,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }
    sides = ["postfix", "mtaq"] if args.only is None else [args.only]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for i in range(args.pairs):
        for side in (sides if i % 2 == 0 else sides[::-1]):  # ABBA: neither side always runs second
            log(f"pair {i + 1}/{args.pairs}: {side} ...")
            r = run_postfix(args, sink_port) if side == "postfix" else run_mtaq(args, sink_port, args.workdir, i)
            log(f"pair {i + 1}/{args.pairs}: {side} {json.dumps(r)}")
            runs[side].append(r)
    for side in sides:
        rs = runs[side]
        out[side] = {
            "accepted_per_s": _median(rs, "accepted_per_s"),
            "e2e_per_s": _median(rs, "e2e_per_s"),
            "cpu_ms_per_msg": _median(rs, "cpu_ms_per_msg", 3),
            "machine_cpu_ms_per_msg": _median(rs, "machine_cpu_ms_per_msg", 3),
            "milter_cpu_ms_per_msg": _median(rs, "milter_cpu_ms_per_msg", 3),
            "fsync_calls_per_msg": _median(rs, "fsync_calls_per_msg", 3),
            "latency_250_p99_ms": _median([r.get("latency_250_ms", {}) for r in rs], "p99", 2),
            "runs": [{k: v for k, v in r.items() if k != "spool_dev"} for r in rs],
        }
        if side == "mtaq":
            out[side]["fsyncs_per_msg_own_count"] = _median(rs, "fsyncs_per_msg", 3)
            out[side]["worker_processes"] = rs[0].get("worker_processes")
    if args.only is None:
        p, m = out["postfix"], out["mtaq"]
        for key, name in (("e2e_per_s", "ratio_e2e"), ("accepted_per_s", "ratio_accepted")):
            out[name] = round(m[key] / p[key], 3) if m[key] and p[key] else None
        devs = {r.get("spool_dev") for r in runs["mtaq"]}
        out["same_device"] = devs == {os.stat(POSTFIX_SPOOL).st_dev}
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["ok"] = all(r.get("e2e_per_s") is not None for rs in runs.values() for r in rs)
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The variants side by side, as a Markdown table."""
    rows = ["| load | mtaq workers | Postfix e2e msg/s | mtaq e2e msg/s | **ratio** | CPU ms/msg Postfix / mtaq "
            "| fsyncs/msg Postfix / mtaq | 250 p99 ms Postfix / mtaq |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        p, m = r.get("postfix", {}), r.get("mtaq", {})
        load = f"{r['sessions']} session{'s' if r['sessions'] > 1 else ''}, {r['size_bytes'] // 1024} KiB"
        rows.append(f"| {load} | {m.get('worker_processes')} ({r['mtaq_workers']}) | {p.get('e2e_per_s')} "
                    f"| {m.get('e2e_per_s')} | **{r.get('ratio_e2e')}** "
                    f"| {p.get('cpu_ms_per_msg')} / {m.get('cpu_ms_per_msg')} "
                    f"| {p.get('fsync_calls_per_msg')} / {m.get('fsync_calls_per_msg')} "
                    f"| {p.get('latency_250_p99_ms')} / {m.get('latency_250_p99_ms')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="store_true",
                    help="run issue 15's four variants in one go and print them as a table (make compare)")
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
    ap.add_argument("--mtaq-config", action="append", default=[], metavar="LINE",
                    help="a TOML line added to mtaq's configuration (repeatable)")
    ap.add_argument("--workers", default=None,
                    help="mtaq serve --workers N|auto (default: none given, mtaq's own default)")
    ap.add_argument("--log-format", default="console", choices=("console", "json"),
                    help="mtaq's log format (console: what mtaq serve writes unless told; json adds mtaq's own "
                         "fsync count)")
    ap.add_argument("--probe-interval", type=float, default=0.1,
                    help="seconds between the latency probe's messages (0: no probe)")
    ap.add_argument("--milter", choices=("full", "eom"),
                    help="a no-op milter in front of both: Postfix's smtpd_milters and mtaq's; full: it asks for "
                         "every stage, eom: only the end of message")
    ap.add_argument("--milter-impl", choices=("c", "python"), default="c",
                    help="which no-op milter: c (bench/noop_milter.c on libmilter, a thread per connection, built "
                         "into build/ on first use; default) or python (bench/noop_milter.py, one event loop)")
    ap.add_argument("--only", choices=("postfix", "mtaq"), help="run one side only (no ratio; for profiling)")
    ap.add_argument("--py-spy", metavar="FILE", help="profile mtaq with py-spy (in PATH) into FILE.<pair>")
    ap.add_argument("--py-spy-format", default="raw", choices=("raw", "flamegraph", "speedscope"))
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.messages < 1 or args.sessions < 1 or args.recipients < 1:
        ap.error("--pairs, --messages, --sessions and --recipients must be >= 1")
    if args.pairs < 3 and args.only is None:
        log("fewer than 3 pairs: the medians are not what issue 15 asks for")

    ensure_postfix_installed()
    sink_port = free_port()
    os.makedirs(args.workdir, exist_ok=True)
    head: dict[str, Any] = {"bench": "compare_postfix", "cpus": os.cpu_count(), "mtaq_tree": MTAQ_TREE,
                            "mtaq_commit": _tree_commit(MTAQ_TREE)}
    milter_proc = None
    if args.milter:
        milter_port = free_port()
        if args.milter_impl == "c":
            try:
                cmd = [noop_milter_binary()]
            except RuntimeError as exc:
                log(str(exc))
                return 2
        else:
            cmd = [sys.executable, os.path.join(BENCH_DIR, "noop_milter.py")]
        milter_proc = subprocess.Popen([*cmd, "--port", str(milter_port), "--mode", args.milter],
                                       stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert milter_proc.stdout is not None
        ready = milter_proc.stdout.readline()  # "noop_milter: listening on ..."
        if not ready.startswith("noop_milter: listening"):
            milter_proc.wait()
            raise RuntimeError(f"{cmd[-1]} did not start (exit {milter_proc.returncode})")
        args.milter_address = f"inet:127.0.0.1:{milter_port}"
        args.milter_pid = milter_proc.pid
        args.mtaq_config = [*args.mtaq_config, f'smtpd_milters = ["{args.milter_address}"]']
        head["milter"] = {"mode": args.milter, "impl": args.milter_impl, "address": args.milter_address}
    try:
        out, rc = _main_runs(args, sink_port, head)
    finally:
        if milter_proc is not None:
            milter_proc.terminate()
            tail, _ = milter_proc.communicate(timeout=30)
            log(tail.strip())
    if milter_proc is not None:  # what the filter saw: "noop_milter: connections=N messages=M"
        counts = dict(re.findall(r"(connections|messages)=(\d+)", tail))
        out["milter"] = {**head["milter"], **{k: int(v) for k, v in counts.items()}}
    print(json.dumps(out), flush=True)
    if args.suite:
        print(table(out["suite"]), file=sys.stderr, flush=True)
    return rc


def noop_milter_binary() -> str:
    """The C no-op milter (bench/noop_milter.c on libmilter), compiled into ``build/noop_milter`` when missing
    or older than its source; RuntimeError with one line naming what is missing when it cannot be built."""
    src = os.path.join(BENCH_DIR, "noop_milter.c")
    out = os.path.join(os.path.dirname(BENCH_DIR), "build", "noop_milter")
    with contextlib.suppress(OSError):
        if os.stat(out).st_mtime >= os.stat(src).st_mtime:
            return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    hint = "bench/noop_milter.c needs a C compiler and libmilter (Debian: apt-get install gcc libmilter-dev)"
    if cc is None:
        raise RuntimeError(f"{hint}: no compiler found")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"  # two runs building at once: each renames a whole file
    p = subprocess.run([cc, "-O2", "-Wall", "-o", tmp, src, "-lmilter", "-lpthread"], capture_output=True, text=True)
    if p.returncode != 0:
        first = next((ln for ln in p.stderr.splitlines() if "error" in ln), p.stderr.strip()[:200])
        raise RuntimeError(f"{hint}: {first.strip()}")
    os.replace(tmp, out)
    return out


def _main_runs(args: argparse.Namespace, sink_port: int, head: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The runs (one variant, or --suite's four): the JSON object to print and the exit status."""
    if args.only != "mtaq":
        head.update(configure_postfix(args.postfix_port, sink_port, getattr(args, "milter_address", "")))
    if not args.suite:
        out = {**head, **compare(args, sink_port)}
        return out, 0 if out["ok"] else 1
    results = []
    for name, sessions, messages, size, workers in VARIANTS:
        log(f"variant: {name}")
        v = argparse.Namespace(**{**vars(args), "sessions": sessions, "messages": messages, "size": size,
                                  "workers": workers})
        results.append({"variant": name, **compare(v, sink_port)})
    return {**head, "suite": results}, 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
