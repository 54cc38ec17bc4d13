"""Start time: seconds from spawning ``mtaq serve`` (a restart after ``kill -9``) to the first 250 to DATA.

Crash-only means every start is a recovery, and mail must be accepted at once (issue 15.6, 36.3: within
0.3 s, whatever the queue holds). For each queue size Q in ``--queued`` (default ``0,10000``), in a fresh
temporary directory (or ``--spool-dir DIR/Q``, kept and reused when it holds a log already): prefill Q
deferred 2 KiB messages (:func:`mtaq.testing.prefill.prefill_deferred`, due in a day; no checkpoint), then:

* one *cold* start: the first ever on that log (no checkpoint, so recovery reads the whole log, as after
  an upgrade or a lost checkpoint), timed like the others;
* ``--runs`` times (default 5) a *restart*: spawn ``mtaq serve`` (the process the README's ``make run``
  starts, relayhost a closed port, admin API on a free port, ``--workers`` processes) while a probe thread
  that started before the spawn connects as soon as the port accepts and sends one message; record the wall
  time of the 250; wait until every worker has logged ``recovery_complete`` (so the next start finds the
  checkpoint a running daemon leaves, as on a host); ``kill -9``.

Each start also reports ``cpu_to_250_s`` (CPU seconds of the daemon's processes up to the 250: on a busy
machine steadier than the wall time) and its workers' recovery (``recovery_s``: the slowest worker's seconds; ``records``
and ``bytes`` read, summed). Also reported: ``import_s``, the seconds ``python -c "import mtaq.cli;
mtaq.cli.build_parser()"`` and ``python -c "import mtaq.daemon.process"`` take (the interpreter's start
included), medians of the runs, and ``bytecode``: whether mtaq's modules had compiled bytecode (with
PYTHONDONTWRITEBYTECODE set and no ``__pycache__``, every start compiles mtaq from source: about 0.3 s more).

Prints ONE JSON line: ``{"runs": R, "load_1min": L, "import_cli_s": ..., "import_daemon_s": ...,
"results": [{"queued": Q, "cold": {...}, "first_250_s": [...], "first_250_median_s": ..., "restarts":
[{"first_250_s", "recovery_s", "records", "bytes"}, ...]}, ...]}``; times in seconds.
Exit status 1 if a probe got no 250.

    .venv/bin/python bench/start_time.py --queued 0,10000 --runs 5
    .venv/bin/python bench/start_time.py --queued 100000,1000000 --runs 3 --spool-dir /var/tmp/mtaq-start
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import smtplib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtaq.testing.prefill import prefill_deferred
from mtaq.testing.procs import free_port, mail_owner_ready

MSG = b"From: a@example.org\r\nSubject: probe\r\nMessage-ID: <probe@example.org>\r\n\r\n" + (b"x" * 76 + b"\r\n") * 26


class Probe(threading.Thread):
    """Connects as soon as the port accepts and sends one message; records the wall time of the 250."""

    def __init__(self, port: int, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.port, self.deadline = port, time.time() + timeout_s
        self.t_250: float | None = None
        self.errors: list[str] = []

    def run(self) -> None:
        while time.time() < self.deadline:
            try:
                with smtplib.SMTP("127.0.0.1", self.port, local_hostname="probe.local", timeout=30) as s:
                    s.ehlo()
                    s.mail("a@example.org")
                    s.rcpt("probe@example.net")
                    code, text = s.data(MSG)
                    if code == 250:
                        self.t_250 = time.time()
                        return
                    self.errors.append(f"{code} {text!r}")
            except ConnectionRefusedError:
                time.sleep(0.001)
            except (OSError, smtplib.SMTPException) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.005)


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def events(path: str, offset: int, name: str) -> list[dict[str, object]]:
    """The JSON log events called ``name`` in ``path`` after byte ``offset``."""
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and d.get("event") == name:
                out.append(d)
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and every descendant still alive (Linux /proc)."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def start_once(py: str, spool: str, log_path: str, workers: int, recovery_wait_s: float) -> dict[str, object]:
    """Spawn ``mtaq serve`` on ``spool`` with a probe; the 250's time, then each worker's recovery; kill -9."""
    port = free_port()
    probe = Probe(port, 60)
    probe.start()
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    t0 = time.time()
    with open(log_path, "ab") as log:
        p = subprocess.Popen(
            [py, "-m", "mtaq.cli", "--log-format", "json", "serve", "--spool", spool, "--workers", str(workers),
             "--listen", f"127.0.0.1:{port}", "--relayhost", f"[127.0.0.1]:{free_port()}",
             "--admin-listen", f"127.0.0.1:{free_port()}"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        probe.join()
        cpu = tree_cpu_s(p.pid)  # every process of the daemon, up to the 250 (and the few ms since)
        out: dict[str, object] = {"first_250_s": round(probe.t_250 - t0, 3) if probe.t_250 else None,
                                  "cpu_to_250_s": round(cpu, 3)}
        if probe.t_250 is None:
            out["errors"] = sorted(set(probe.errors))[:6]
        deadline = time.time() + recovery_wait_s
        done: list[dict[str, object]] = []
        while time.time() < deadline and p.poll() is None:
            done = events(log_path, offset, "recovery_complete")
            if len(done) >= workers:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # the checkpoint written after recovery (Daemon.run), as a running daemon leaves it
        out["recovered_workers"] = len(done)
        out["recovery_s"] = max((float(str(d.get("seconds", 0))) for d in done), default=None)
        out["records"] = sum(int(str(d.get("records", 0))) for d in done)
        out["bytes"] = sum(int(str(d.get("bytes", 0))) for d in done)
        return out
    finally:
        p.kill()
        p.wait()


def prepared_spool(work: str, queued: int, res: dict[str, object]) -> str:
    """``work``/spool, prefilled with ``queued`` deferred messages (:data:`MSG`, due in a day) unless it holds
    a log already (``res["prefill_s"]``: the seconds that took), and made reachable by the mail_owner the
    daemon switches to when run as root. Returns the spool's path. Shared by bench/deferred_idle.py."""
    spool = os.path.join(work, "spool")
    if not os.path.isdir(os.path.join(spool, "log")):
        os.makedirs(spool, exist_ok=True)
        t = time.perf_counter()
        if queued:
            prefill_deferred(spool, queued, lambda i: MSG)
        res["prefill_s"] = round(time.perf_counter() - t, 1)
    mail_owner_ready(spool)
    return spool


def has_bytecode() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("mtaq.daemon.process")
    cached = spec.cached if spec else None
    return bool(cached and os.path.exists(cached))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--queued", default="0,10000", help="queue sizes, comma-separated")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                    help="worker processes (default: as workers = auto)")
    ap.add_argument("--spool-dir", default="", help="keep each queue size's spool in DIR/Q and reuse it")
    ap.add_argument("--recovery-wait-s", type=float, default=600.0,
                    help="how long a start may take to recover before it is killed anyway")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold start (a reused spool has a checkpoint)")
    args = ap.parse_args(argv)
    ok = True
    out: dict[str, object] = {"runs": args.runs, "workers": args.workers, "load_1min": os.getloadavg()[0],
                              "bytecode": has_bytecode()}
    py = sys.executable
    out["import_cli_s"] = round(statistics.median(
        timed([py, "-c", "import mtaq.cli; mtaq.cli.build_parser()"]) for _ in range(args.runs)), 3)
    out["import_daemon_s"] = round(statistics.median(
        timed([py, "-c", "import mtaq.daemon.process"]) for _ in range(args.runs)), 3)
    results = []
    for q in [int(x) for x in args.queued.split(",")]:
        work = os.path.join(args.spool_dir, str(q)) if args.spool_dir else tempfile.mkdtemp(prefix="mtaq-start-")
        try:
            res: dict[str, object] = {"queued": q}
            spool = prepared_spool(work, q, res)
            log_path = os.path.join(work, "daemon.log")
            if not args.no_cold:
                res["cold"] = cold = start_once(py, spool, log_path, args.workers, args.recovery_wait_s)
                ok = ok and cold["first_250_s"] is not None
            restarts = [start_once(py, spool, log_path, args.workers, args.recovery_wait_s) for _ in range(args.runs)]
            for r in restarts:
                if r["first_250_s"] is None:
                    ok = False
                    print(f"start_time: Q={q}: no 250: {r.get('errors')}", file=sys.stderr)
            times = [float(str(r["first_250_s"])) for r in restarts if r["first_250_s"] is not None]
            cpus = [float(str(r["cpu_to_250_s"])) for r in restarts]
            res.update({"first_250_s": times, "first_250_median_s": statistics.median(times) if times else None,
                        "cpu_to_250_median_s": statistics.median(cpus) if cpus else None,
                        "restarts": restarts})
            results.append(res)
        finally:
            if not args.spool_dir:
                shutil.rmtree(work, ignore_errors=True)
    out["results"] = results
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
