"""A large deferred queue, idle: disk use, resident memory, CPU and log reads of a running ``mtaq serve``.

Issue 36.4: a million deferred messages kept for days must cost neither memory nor CPU while nothing is due
(the retry runners wait for the envelope in front of them: nothing rescans what is not due; seed 001). For
each queue size Q in ``--queued`` (default ``100000``), in ``--spool-dir DIR/Q`` (kept and reused: the same
spools as ``bench/start_time.py --spool-dir``) or a temporary directory: prefill Q deferred 2 KiB messages
due in a day (:func:`mtaq.testing.prefill.prefill_deferred`), start ``mtaq serve`` (``--workers``
processes, relayhost a closed port, admin API on), wait until every worker has logged ``recovery_complete``,
then for ``--idle-s`` seconds (default 60) measure, over every process of the daemon (Linux /proc):

* ``cpu_s``: CPU seconds (user + system) used in the idle window, and ``cpu_pct`` of one core;
* ``read_bytes``: bytes the processes read (``rchar``: page cache included) in the window: a runner that
  rescanned the queue would read it all again;
* ``rss_mib`` (summed over the processes, at the end), ``rss_max_mib`` (the largest process), ``hwm_mib``
  (the largest peak, VmHWM: recovery included);
* ``spool_mib``: disk used by the spool (allocated blocks), and ``recovery``: each worker's
  ``recovery_complete`` (seconds, records, bytes). The first start on a prefilled spool has no checkpoint
  (its recovery reads the whole log); ``--restart`` kills that daemon with ``kill -9`` once it has
  recovered and measures a second start, the one a host sees.

Prints ONE JSON line: ``{"load_1min": L, "idle_s": S, "results": [{"queued": Q, ...}, ...]}``.

    .venv/bin/python bench/deferred_idle.py --queued 100000,1000000 --idle-s 60 --restart --spool-dir /var/tmp/q
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from start_time import events, prepared_spool

from mtaq.testing.procs import free_port


def tree(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def sample(pid: int) -> dict[str, float]:
    """CPU seconds, bytes read, RSS (sum, largest) and the largest VmHWM over the process tree of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = rchar = 0.0
    rss: list[float] = []
    hwm: list[float] = []
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            with open(f"/proc/{p}/io") as f:
                rchar += next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
            with open(f"/proc/{p}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            rss.append(int(st["VmRSS"].split()[0]) / 1024)
            hwm.append(int(st["VmHWM"].split()[0]) / 1024)
        except (OSError, ValueError, KeyError, IndexError, StopIteration):
            continue
    return {"cpu": cpu, "rchar": rchar, "rss": sum(rss), "rss_max": max(rss, default=0.0),
            "hwm": max(hwm, default=0.0)}


def disk_mib(path: str) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return round(total / 2**20, 1)


def run_daemon(py: str, spool: str, log_path: str, workers: int, idle_s: float, wait_s: float) -> dict[str, object]:
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        p = subprocess.Popen(
            [py, "-m", "mtaq.cli", "--log-format", "json", "serve", "--spool", spool, "--workers", str(workers),
             "--listen", f"127.0.0.1:{free_port()}", "--relayhost", f"[127.0.0.1]:{free_port()}",
             "--admin-listen", f"127.0.0.1:{free_port()}"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        done: list[dict[str, object]] = []
        while time.monotonic() - t0 < wait_s and p.poll() is None:
            done = events(log_path, offset, "recovery_complete")
            if len(done) >= workers:
                break
            time.sleep(0.1)
        recovered_s = time.monotonic() - t0
        time.sleep(1.0)  # the checkpoint after recovery
        a = sample(p.pid)
        time.sleep(idle_s)
        b = sample(p.pid)
        return {
            "recovered_after_s": round(recovered_s, 2),
            "recovery": [{k: d.get(k) for k in ("shard", "seconds", "records", "bytes", "checkpoint")} for d in done],
            "cpu_s": round(b["cpu"] - a["cpu"], 3),
            "cpu_pct": round(100 * (b["cpu"] - a["cpu"]) / idle_s, 2),
            "read_bytes": int(b["rchar"] - a["rchar"]),
            "rss_mib": round(b["rss"], 1),
            "rss_max_mib": round(b["rss_max"], 1),
            "hwm_mib": round(b["hwm"], 1),
        }
    finally:
        p.kill()
        p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--queued", default="100000", help="queue sizes, comma-separated")
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8))
    ap.add_argument("--spool-dir", default="", help="keep each queue size's spool in DIR/Q and reuse it")
    ap.add_argument("--restart", action="store_true", help="measure a second start (kill -9 after the first)")
    ap.add_argument("--recovery-wait-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    out: dict[str, object] = {"load_1min": os.getloadavg()[0], "idle_s": args.idle_s, "workers": args.workers}
    results = []
    for q in [int(x) for x in args.queued.split(",")]:
        work = os.path.join(args.spool_dir, str(q)) if args.spool_dir else tempfile.mkdtemp(prefix="mtaq-idle-")
        try:
            res: dict[str, object] = {"queued": q}
            spool = prepared_spool(work, q, res)
            log_path = os.path.join(work, "daemon.log")
            res["spool_mib"] = disk_mib(spool)
            res["first"] = run_daemon(sys.executable, spool, log_path, args.workers, args.idle_s, args.recovery_wait_s)
            if args.restart:
                res["restart"] = run_daemon(sys.executable, spool, log_path, args.workers, args.idle_s,
                                            args.recovery_wait_s)
            results.append(res)
        finally:
            if not args.spool_dir:
                shutil.rmtree(work, ignore_errors=True)
    out["results"] = results
    out["load_1min_end"] = os.getloadavg()[0]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
