"""Start time: seconds from spawning ``mtaq serve`` (a restart after ``kill -9``) to the first 250 to DATA.

Crash-only means every start is a recovery, and mail must be accepted at once (issue 15.6: within 0.3 s).
For each queue size Q in ``--queued`` (default ``0,10000``), in a fresh temporary directory: prefill Q
deferred 2 KiB messages (:func:`mtaq.testing.prefill.prefill_deferred`, due in a day), then ``--runs``
times (default 5): spawn ``mtaq serve`` (the process the README's ``make run`` starts, relayhost a closed
port, admin API on a free port) while a probe thread that started before the spawn connects as soon as the
port accepts and sends one message; record the wall time of the 250; ``kill -9``.

Also reported: ``import_s``, the seconds ``python -c "import mtaq.cli; mtaq.cli.build_parser()"`` and
``python -c "import mtaq.daemon.process"`` take (the interpreter's start included), medians of the runs.

Prints ONE JSON line: ``{"runs": R, "load_1min": L, "import_cli_s": ..., "import_daemon_s": ...,
"results": [{"queued": Q, "first_250_s": [...], "first_250_median_s": ...}, ...]}``; times in seconds.
Exit status 1 if a probe got no 250.

    .venv/bin/python bench/start_time.py --queued 0,10000 --runs 5
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--queued", default="0,10000", help="queue sizes, comma-separated")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    ok = True
    out: dict[str, object] = {"runs": args.runs, "load_1min": os.getloadavg()[0]}
    py = sys.executable
    out["import_cli_s"] = round(statistics.median(
        timed([py, "-c", "import mtaq.cli; mtaq.cli.build_parser()"]) for _ in range(args.runs)), 3)
    out["import_daemon_s"] = round(statistics.median(
        timed([py, "-c", "import mtaq.daemon.process"]) for _ in range(args.runs)), 3)
    results = []
    for q in [int(x) for x in args.queued.split(",")]:
        work = tempfile.mkdtemp(prefix="mtaq-start-")
        try:
            spool = os.path.join(work, "spool")
            os.makedirs(spool)
            if q:
                prefill_deferred(spool, q, lambda i: MSG)
            mail_owner_ready(spool)  # run as root: the daemon switches to mail_owner and must reach the spool
            times = []
            for _ in range(args.runs):
                port = free_port()
                probe = Probe(port, 30)
                probe.start()
                t0 = time.time()
                with open(os.path.join(work, "daemon.log"), "ab") as log:
                    p = subprocess.Popen(
                        [py, "-m", "mtaq.cli", "--log-format", "json", "serve", "--spool", spool,
                         "--listen", f"127.0.0.1:{port}", "--relayhost", f"[127.0.0.1]:{free_port()}",
                         "--admin-listen", f"127.0.0.1:{free_port()}"],
                        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
                probe.join()
                p.kill()
                p.wait()
                if probe.t_250 is None:
                    ok = False
                    print(f"start_time: Q={q}: no 250: {sorted(set(probe.errors))[:6]} ({len(probe.errors)} tries)", file=sys.stderr)
                    continue
                times.append(round(probe.t_250 - t0, 3))
            results.append({"queued": q, "first_250_s": times,
                            "first_250_median_s": statistics.median(times) if times else None})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    out["results"] = results
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
