"""Steady-state disk benchmark: does the queue log stay small while mail flows through at full speed?

With checkpoints and reclamation, segments wholly before the earliest runner position and the earliest
in-flight envelope are deleted every ``checkpoint_interval_s``, so the log's disk use should stay bounded
by the traffic of a few checkpoint intervals (plus the segments those need), however many messages pass.

What it does: in a fresh temporary directory, starts ``mtaq serve`` (``mtaq.testing.procs.start_daemon``)
with ``segment_bytes_max = 4194304``, ``checkpoint_interval_s = 1`` and ``stats_interval_s = 1``, relaying
to a fast next hop, and sends ``--messages`` N messages (2 KiB each, unique Message-IDs) over
``--concurrency`` C concurrent SMTP sessions (aiosmtplib, sessions reused). The next hop (``--sink``) is
either ``maildir`` (default: ``mtaq sink`` via ``start_sink``, one file per message in a Maildir) or
``null`` (this script run again as a subprocess: an aiosmtpd server that answers 250 to DATA and stores
nothing, for when the Maildir is the bottleneck). Once a second, from the file system (not from the
daemon), a sampler thread sums the sizes of ``SPOOL/log/*.seg`` and counts them. When every message has
reached the next hop it waits ``--settle`` seconds (3) for the last checkpoint and reclamation, takes a
final sample, and kills everything.

It prints ONE JSON line on stdout:

- ``messages``: N; ``accepted``: messages answered 250 to DATA; ``delivered``: messages the next hop got
  (files in the Maildir, or DATA transactions the null sink answered 250); ``daemon_delivered``: the
  ``delivered`` count of the daemon's last ``stats`` event;
- ``elapsed_s``: seconds from the first MAIL to the moment all N were seen at the next hop (polled every
  0.1 s); ``load_s``: seconds to the last 250; ``accepted_per_s``, ``delivered_per_s`` (messages/s);
- ``peak_log_bytes``, ``peak_segments``: the largest sum of segment sizes (bytes) and the largest segment
  count seen by any sample, from the daemon's start to the end; ``final_log_bytes``, ``final_segments``:
  the last sample, after the settle time; ``samples``: how many samples were taken;
- ``bytes_appended``, ``checkpoints``, ``segments_reclaimed``: from the daemon's last ``stats`` event
  (bytes written to the log in total, checkpoints written, segments deleted), and
  ``daemon_log_warnings_errors``.

With ``--keep DIR`` the work dir (spool, Maildir, logs, ``samples.jsonl`` with every sample) is kept.
Exit status 0 only when all N messages were accepted and delivered.

Run from the project root (the client, the daemon and the sink share the machine's cores)::

    .venv/bin/python bench/steady_disk.py --messages 200000 --concurrency 20
    .venv/bin/python bench/steady_disk.py --messages 20000 --sink null --keep /tmp/steady

Options: --messages N (200000), --concurrency C (20), --sink maildir|null (maildir), --settle S (3),
--timeout S (3600, load + drain), --keep DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import aiosmtplib

from mtaq.testing.procs import (
    Proc,
    free_port,
    log_problems,
    maildir_count,
    read_events,
    start_daemon,
    start_sink,
    wait_port,
)

SENDER = "bench@example.com"
SIZE = 2048


def build_message(i: int, run_id: str) -> bytes:
    head = (
        f"From: <{SENDER}>\r\nTo: <rcpt@example.org>\r\nSubject: mtaq steady disk {i}\r\n"
        f"Message-ID: <{run_id}.{i}@bench.mtaq.invalid>\r\nDate: Thu, 01 Jan 2026 00:00:00 +0000\r\n\r\n"
    ).encode()
    full, rest = divmod(max(80, SIZE - len(head)), 78)
    return head + (b"x" * 76 + b"\r\n") * full + (b"y" * (rest - 2) + b"\r\n" if rest >= 2 else b"")


# --------------------------------------------------------------------------------------------- null sink


def run_null_sink(port: int, status_path: str) -> None:
    """A next hop that answers 250 to everything and stores nothing (run in a subprocess)."""
    from aiosmtpd.smtp import SMTP, Envelope, Session

    state = {"data_total": 0}

    class Handler:
        async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
            state["data_total"] += 1
            return "250 2.0.0 Ok: discarded"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handler = Handler()
        server = await loop.create_server(
            lambda: SMTP(handler, hostname="null", ident="null-sink", data_size_limit=None, loop=loop),
            host="127.0.0.1", port=port, reuse_address=True,
        )
        tmp = status_path + ".tmp"
        async with server:
            while True:
                with open(tmp, "w", encoding="ascii") as f:
                    f.write(json.dumps(state))
                os.replace(tmp, status_path)
                await asyncio.sleep(0.1)

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # pragma: no cover
        asyncio.run(main())


def null_count(path: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            return int(json.load(f).get("data_total", 0))
    except (OSError, ValueError):
        return 0


# --------------------------------------------------------------------------------------------- sampler


class Sampler(threading.Thread):
    """Every ``period_s``: (seconds since start, sum of SPOOL/log/*.seg sizes, segment count)."""

    def __init__(self, log_dir: str, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.log_dir = log_dir
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> tuple[float, int, int]:
        total = count = 0
        try:
            with os.scandir(self.log_dir) as it:
                for e in it:
                    if not e.name.endswith(".seg"):
                        continue
                    try:
                        total += e.stat().st_size
                        count += 1
                    except FileNotFoundError:  # reclaimed between listing and stat
                        pass
        except FileNotFoundError:
            pass
        s = (round(time.monotonic() - self.t0, 3), total, count)
        self.samples.append(s)
        return s

    def run(self) -> None:
        nxt = time.monotonic()
        while not self.stop.is_set():
            self.sample()
            nxt += self.period_s
            self.stop.wait(max(0.0, nxt - time.monotonic()))


# --------------------------------------------------------------------------------------------- load


async def load(port: int, n: int, conc: int, run_id: str, deadline: float) -> dict[str, Any]:
    counter = itertools.count()
    st: dict[str, Any] = {"accepted": 0, "errors": [], "t_first": None, "t_last_250": None}

    async def session() -> None:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=120, local_hostname="bench.local")
        await smtp.connect()
        while (i := next(counter)) < n:
            if st["t_first"] is None:
                st["t_first"] = time.monotonic()
            try:
                if not smtp.is_connected:
                    await smtp.connect()
                refused, _ = await smtp.sendmail(SENDER, ["rcpt@example.org"], build_message(i, run_id))
                if refused:
                    st["errors"].append(f"message {i}: refused {refused}")
                    continue
            except (aiosmtplib.SMTPException, OSError) as exc:
                st["errors"].append(f"message {i}: {type(exc).__name__}: {exc}")
                smtp.close()
                continue
            st["accepted"] += 1
            st["t_last_250"] = time.monotonic()
        try:
            await smtp.quit()
        except (aiosmtplib.SMTPException, OSError):
            smtp.close()

    try:
        await asyncio.wait_for(asyncio.gather(*(session() for _ in range(conc))), max(1.0, deadline - time.monotonic()))
    except TimeoutError:
        st["errors"].append("load timed out")
    return st


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200000, metavar="N")
    ap.add_argument("--concurrency", type=int, default=20, metavar="C")
    ap.add_argument("--sink", choices=("maildir", "null"), default="maildir")
    ap.add_argument("--settle", type=float, default=3.0, metavar="S", help="seconds after the drain")
    ap.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="load + drain (seconds)")
    ap.add_argument("--keep", metavar="DIR", help="create the work dir under DIR and keep it")
    ap.add_argument("--null-sink-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--null-sink-status", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.null_sink_port:
        run_null_sink(args.null_sink_port, args.null_sink_status)
        return 0
    n, conc = args.messages, args.concurrency
    if n < 1 or conc < 1:
        ap.error("--messages and --concurrency must be >= 1")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run

    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        work = tempfile.mkdtemp(prefix="steady-", dir=args.keep)
    else:
        work = tempfile.mkdtemp(prefix="mtaq-steady-")
    spool = os.path.join(work, "spool")
    maildir = os.path.join(work, "maildir")
    status = os.path.join(work, "null-sink.json")
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w", encoding="utf-8") as f:
        f.write("segment_bytes_max = 4194304\ncheckpoint_interval_s = 1\nstats_interval_s = 1\n")

    result: dict[str, Any] = {"messages": n, "concurrency": conc, "sink": args.sink}
    daemon: Proc | None = None
    sink: Proc | None = None
    null: subprocess.Popen[bytes] | None = None
    sampler: Sampler | None = None
    ok = False
    deadline = time.monotonic() + args.timeout
    try:
        if args.sink == "maildir":
            sink = start_sink(maildir, os.path.join(work, "sink.log"))
            sink_port = sink.port

            def delivered() -> int:
                return maildir_count(maildir)
        else:
            sink_port = free_port()
            out = open(os.path.join(work, "null-sink.log"), "ab")
            null = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--null-sink-port", str(sink_port),
                 "--null-sink-status", status],
                stdout=out, stderr=out, stdin=subprocess.DEVNULL,
            )
            out.close()
            wait_port(sink_port, proc=null)

            def delivered() -> int:
                return null_count(status)

        sampler = Sampler(os.path.join(spool, "log"))
        sampler.start()
        daemon = start_daemon(spool, sink_port, os.path.join(work, "daemon.log"), config=conf)
        run_id = uuid.uuid4().hex[:12]
        st = runner(load(daemon.port, n, conc, run_id, deadline))
        t0 = st["t_first"] or time.monotonic()
        result["accepted"] = st["accepted"]
        result["client_errors"] = len(st["errors"])
        for e in st["errors"][:5]:
            print(f"steady_disk: client error: {e}", file=sys.stderr)
        if st["t_last_250"]:
            result["load_s"] = round(st["t_last_250"] - t0, 3)
            result["accepted_per_s"] = round(st["accepted"] / max(1e-9, st["t_last_250"] - t0), 1)
        poll = 0.1 if args.sink == "null" else 0.25  # listing a Maildir of 200,000 files is not free
        while (got := delivered()) < st["accepted"] and time.monotonic() < deadline and daemon.alive():
            time.sleep(poll)
        t_done = time.monotonic()
        result["delivered"] = got
        result["elapsed_s"] = round(t_done - t0, 3)
        result["delivered_per_s"] = round(got / max(1e-9, t_done - t0), 1)
        time.sleep(args.settle)
        sampler.stop.set()
        sampler.join()
        sampler.sample()  # the final one, after the settle time
        result["delivered"] = delivered()
        result["daemon_alive_at_end"] = daemon.alive()
    except Exception as exc:
        print(f"steady_disk: {type(exc).__name__}: {exc}", file=sys.stderr)
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if sampler is not None:
            sampler.stop.set()
        for p in (daemon, sink):
            if p is not None:
                p.kill9()
        if null is not None:
            if null.poll() is None:
                null.send_signal(signal.SIGKILL)
            null.wait()

    if sampler is not None and sampler.samples:
        s = sampler.samples
        result["peak_log_bytes"] = max(x[1] for x in s)
        result["final_log_bytes"] = s[-1][1]
        result["peak_segments"] = max(x[2] for x in s)
        result["final_segments"] = s[-1][2]
        result["samples"] = len(s)
        if args.keep:
            with open(os.path.join(work, "samples.jsonl"), "w", encoding="utf-8") as f:
                for t, b, c in s:
                    f.write(json.dumps({"t": t, "log_bytes": b, "segments": c}) + "\n")
    if daemon is not None:
        events = read_events(daemon.log_path)
        stats = [e for e in events if e.get("event") == "stats"]
        if stats:
            last = stats[-1]
            result["daemon_delivered"] = last.get("delivered")
            result["daemon_deferred"] = last.get("deferred")
            result["bytes_appended"] = last.get("bytes")
            result["checkpoints"] = last.get("checkpoints")
            result["segments_reclaimed"] = last.get("segments_reclaimed")
            result["daemon_stats_log_bytes"] = last.get("log_bytes")
        bad, other = log_problems(daemon.log_path)
        result["daemon_log_warnings_errors"] = len(bad)
        for e in bad[:5]:
            print(f"steady_disk: daemon log: {json.dumps(e)}", file=sys.stderr)
        result["daemon_log_non_json_lines"] = len(other)
        for line in other[:20]:
            print(f"steady_disk: daemon log: {line}", file=sys.stderr)
    ok = "error" not in result and result.get("accepted") == n and result.get("delivered", 0) >= n
    result["ok"] = ok
    if args.keep:
        result["workdir"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
