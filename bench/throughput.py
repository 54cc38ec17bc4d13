"""Throughput benchmark: N messages over C concurrent SMTP sessions into ``mtaq serve``, relayed to a sink.

The daemon and the sink are the real ``mtaq`` command run as subprocesses (``mtaq.testing.procs``), in a
fresh temporary directory: ``mtaq serve`` with its own spool, relaying to ``mtaq sink``, which stores each
message as one file in a Maildir. The load generator is an asyncio client (aiosmtplib) in this process:
C sessions, each keeping its connection for many transactions (MAIL, RCPT x R, DATA), each message with a
unique Message-ID and padded to --size bytes (headers + body, before SMTP dot-stuffing).

It prints ONE JSON line on stdout:

- ``accepted_per_s``: messages answered 250 to DATA per second, from the first MAIL to the last 250
  (messages/s; ``load_seconds`` is that interval in s).
- ``delivered_per_s``: N / (arrival of the last message in the sink's Maildir - first MAIL) in messages/s;
  the arrival time is the newest file mtime in the Maildir (``e2e_seconds`` is that interval in s).
- ``latency_p50_ms``, ``latency_p99_ms``, ``latency_max_ms``: the 250 reply latency in milliseconds,
  measured from writing the end of the DATA content (``<CRLF>.<CRLF>``) to the client seeing the 250
  (``latency_measures`` = ``"data_end_to_250"``); it includes the daemon's group-commit fsync.
- ``fsyncs_per_msg``, ``commit_rounds_per_msg``: ``fsync_calls`` and ``commit_rounds`` from the daemon's
  last ``stats`` log event (written after the queue drained) divided by accepted messages. These are
  totals since the daemon started, so they include the delivery-outcome commits, not only receiving.
- ``daemon_peak_rss_kib`` / ``sink_peak_rss_kib``: VmHWM of the process (KiB) read from /proc before the
  SIGKILL (with ``--workers N``: the sum over the supervisor and its workers, whose stats are summed too);
  null where /proc is not available.
- the parameters: ``n``, ``concurrency``, ``size_bytes``, ``recipients``, ``sink`` (kind of sink).

The exit status is 0 only when every message was accepted, N files reached the Maildir, and every
Message-ID arrived exactly once with all R recipients.

Run from the project root (the machine's cores are shared by the client, the daemon and the sink):

    .venv/bin/python bench/throughput.py --messages 10000 --concurrency 20 --size 2048

Options: --messages N (10000), --concurrency C (20), --size BYTES (2048), --recipients R (1),
--keep DIR (create the work dir under DIR and keep it: spool, Maildir, logs), --timeout S (600, for the
load and the drain together), --webhook none|ok|hanging (none: an event webhook to a receiver in this
process answering 200, or never answering: `webhook_events` counts the events it acknowledged).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import aiosmtplib

from mtaq.testing.procs import (
    Proc,
    log_problems,
    maildir_count,
    maildir_message_ids,
    peak_rss_kib,
    read_events,
    start_daemon,
    start_sink,
)

SENDER = "bench@example.com"
STATS_INTERVAL_S = 0.5


# --------------------------------------------------------------------------------------------- messages


def build_message(i: int, run_id: str, size: int, rcpts: list[str]) -> bytes:
    """A message of ``size`` bytes (at least its headers) with a unique Message-ID."""
    head = (
        f"From: <{SENDER}>\r\n"
        f"To: <{rcpts[0]}>\r\n"
        f"Subject: mtaq throughput {i}\r\n"
        f"Message-ID: <{run_id}.{i}@bench.mtaq.invalid>\r\n"
        "Date: Thu, 01 Jan 2026 00:00:00 +0000\r\n"
        "\r\n"
    ).encode()
    room = max(2, size - len(head))
    full, rest = divmod(room, 78)  # lines of 76 octets + CRLF, then one shorter line
    lines = [b"x" * 76 + b"\r\n"] * full
    if rest == 1:  # a line needs at least CRLF: make the last full line one octet longer
        lines[-1] = b"x" * 77 + b"\r\n"
    elif rest >= 2:
        lines.append(b"x" * (rest - 2) + b"\r\n")
    body = b"".join(lines)
    return head + body


def percentile(sorted_vals: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100)."""
    if not sorted_vals:
        return None
    k = max(0, math.ceil(p / 100 * len(sorted_vals)) - 1)
    return sorted_vals[k]


# --------------------------------------------------------------------------------------------- load


class Load:
    """Shared state of the C client sessions."""

    def __init__(self, port: int, msgs: list[bytes], rcpts: list[str]) -> None:
        self.port = port
        self.msgs = msgs
        self.rcpts = rcpts
        self.next = itertools.count()
        self.latencies: list[float] = []
        self.accepted = 0
        self.errors: list[str] = []
        self.t_first_mail: float | None = None
        self.t_last_250: float | None = None

    async def connect(self) -> tuple[aiosmtplib.SMTP, list[float]]:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=self.port, timeout=120, local_hostname="bench.local")
        await smtp.connect()
        await smtp.ehlo()
        mark = [0.0]
        proto: Any = smtp.protocol
        orig = proto.write

        def write(data: bytes) -> None:
            # aiosmtplib writes the whole dot-stuffed content plus ".\r\n" in one call after the 354.
            if data.endswith(b"\r\n.\r\n"):
                mark[0] = time.perf_counter()
            orig(data)

        proto.write = write
        return smtp, mark

    async def session(self, smtp: aiosmtplib.SMTP, mark: list[float]) -> None:
        n = len(self.msgs)
        while True:
            i = next(self.next)
            if i >= n:
                break
            if self.t_first_mail is None:
                self.t_first_mail = time.perf_counter()
            try:
                if not smtp.is_connected:
                    smtp, mark = await self.connect()
                await smtp.mail(SENDER)
                for r in self.rcpts:
                    await smtp.rcpt(r)
                mark[0] = 0.0
                await smtp.data(self.msgs[i])
                t_250 = time.perf_counter()
            except (aiosmtplib.SMTPException, OSError) as exc:
                self.errors.append(f"message {i}: {type(exc).__name__}: {exc}")
                try:
                    if smtp.is_connected:
                        await smtp.rset()
                except (aiosmtplib.SMTPException, OSError):
                    smtp.close()
                continue
            self.accepted += 1
            self.latencies.append(t_250 - mark[0])
            if self.t_last_250 is None or t_250 > self.t_last_250:
                self.t_last_250 = t_250
        try:
            await smtp.quit()
        except (aiosmtplib.SMTPException, OSError):
            smtp.close()

    async def run(self, concurrency: int) -> tuple[float, float]:
        """Connect C sessions, then send; returns (perf_counter, wall clock) of the start of sending."""
        conns = await asyncio.gather(*(self.connect() for _ in range(concurrency)))
        t0, w0 = time.perf_counter(), time.time()
        await asyncio.gather(*(self.session(s, m) for s, m in conns))
        return t0, w0


# --------------------------------------------------------------------------------------------- daemon log


def stats_events(path: str) -> list[dict[str, Any]]:
    return [e for e in read_events(path) if e.get("event") == "stats"]


def _sum_last_per_worker(evs: list[dict[str, Any]]) -> dict[str, Any]:
    """The last stats event of each worker (``shard`` field; one worker: the last event), counters summed."""
    last: dict[Any, dict[str, Any]] = {}
    for e in evs:
        last[e.get("shard")] = e
    out: dict[str, Any] = {}
    for e in last.values():
        for k, v in e.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "shard":
                out[k] = out.get(k, 0) + v
    return out


def wait_for_event(proc: Proc, name: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.get("event") == name for e in read_events(proc.log_path)):
            return True
        if not proc.alive():
            return False
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=10000, metavar="N")
    ap.add_argument("--concurrency", type=int, default=20, metavar="C")
    ap.add_argument("--size", type=int, default=2048, metavar="BYTES", help="message size, headers + body")
    ap.add_argument("--recipients", type=int, default=1, metavar="R", help="envelope recipients per message")
    ap.add_argument("--workers", type=int, default=1, metavar="N", help="mtaq worker processes (spool shards)")
    ap.add_argument("--keep", metavar="DIR", help="create the work dir under DIR and keep it")
    ap.add_argument("--timeout", type=float, default=600.0, metavar="S", help="for load + drain (seconds)")
    ap.add_argument("--webhook", choices=("none", "ok", "hanging"), default="none",
                    help="an event webhook (issue 37) to a receiver in this process that answers 200 (ok) or "
                         "never answers (hanging): the 250s and the deliveries must not wait for it")
    args = ap.parse_args(argv)
    n, conc, size, nrcpt = args.messages, args.concurrency, args.size, args.recipients
    if n < 1 or conc < 1 or nrcpt < 1:
        ap.error("--messages, --concurrency and --recipients must be >= 1")

    try:
        import uvloop

        loop_name = "uvloop"
    except ImportError:  # pragma: no cover
        uvloop = None
        loop_name = "asyncio"

    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        work = tempfile.mkdtemp(prefix="throughput-", dir=args.keep)
    else:
        work = tempfile.mkdtemp(prefix="mtaq-throughput-")
    maildir = os.path.join(work, "maildir")
    conf = os.path.join(work, "mtaq.toml")
    with open(conf, "w", encoding="utf-8") as f:
        f.write(f"stats_interval_s = {STATS_INTERVAL_S}\nworkers = {args.workers}\n")
    receiver = None
    if args.webhook != "none":
        from mtaq.testing.webhook import Receiver

        receiver = Receiver(hang=args.webhook == "hanging").start()
        with open(conf, "a", encoding="utf-8") as f:
            f.write(f'[[event_webhooks]]\nurl = "{receiver.url}"\ntimeout_s = 3600\n')

    run_id = uuid.uuid4().hex[:12]
    rcpts = [f"rcpt{j}@example.org" for j in range(nrcpt)]
    msgs = [build_message(i, run_id, size, rcpts) for i in range(n)]

    result: dict[str, Any] = {
        "n": n,
        "concurrency": conc,
        "size_bytes": size,
        "recipients": nrcpt,
        "sink": "maildir",
        "workers": args.workers,
        "client_loop": loop_name,
        "latency_measures": "data_end_to_250",
        "webhook": args.webhook,
    }
    ok = False
    sink: Proc | None = None
    daemon: Proc | None = None
    deadline = time.monotonic() + args.timeout
    try:
        sink = start_sink(maildir, os.path.join(work, "sink.log"))
        daemon = start_daemon(os.path.join(work, "spool"), sink.port, os.path.join(work, "daemon.log"), config=conf, workers=None)
        if not wait_for_event(daemon, "recovery_complete", 30):
            raise RuntimeError("daemon did not log recovery_complete")

        load = Load(daemon.port, msgs, rcpts)
        runner = uvloop.run if uvloop is not None else asyncio.run

        async def go() -> tuple[float, float]:
            return await asyncio.wait_for(load.run(conc), timeout=max(1.0, deadline - time.monotonic()))

        try:
            t0, w0 = runner(go())
        except TimeoutError:
            t0 = load.t_first_mail or time.perf_counter()
            w0 = time.time() - (time.perf_counter() - t0)
            load.errors.append(f"load timed out after {args.timeout}s")
        t_load_end = load.t_last_250 or time.perf_counter()
        load_s = t_load_end - t0
        result["accepted"] = load.accepted
        result["accepted_per_s"] = round(load.accepted / load_s, 1) if load_s > 0 else None
        result["load_seconds"] = round(load_s, 3)
        lat = sorted(load.latencies)
        result["latency_p50_ms"] = _ms(percentile(lat, 50))
        result["latency_p99_ms"] = _ms(percentile(lat, 99))
        result["latency_max_ms"] = _ms(lat[-1] if lat else None)
        result["client_errors"] = len(load.errors)
        for e in load.errors[:5]:
            print(f"throughput: client error: {e}", file=sys.stderr)

        # Drain: every accepted message is one file in the Maildir (all R recipients in one transaction).
        while maildir_count(maildir) < load.accepted and time.monotonic() < deadline and daemon.alive():
            time.sleep(0.05)
        t_seen = time.perf_counter()
        files = [os.path.join(maildir, s, name) for s in ("new", "cur") for name in _listdir(os.path.join(maildir, s))]
        delivered = len(files)
        last_mtime = max((os.stat(p).st_mtime_ns for p in files), default=0) / 1e9
        e2e_s = last_mtime - w0 if files else None
        result["delivered"] = delivered
        result["delivered_per_s"] = round(n / e2e_s, 1) if e2e_s and delivered >= n else None
        result["e2e_seconds"] = round(e2e_s, 3) if e2e_s else None
        result["drain_detected_after_s"] = round(t_seen - t0, 3)

        # A stats event written after the drain (the outcome commits follow the sink's 250).
        n_before = len(stats_events(daemon.log_path))
        time.sleep(0.7)
        stats: dict[str, Any] | None = None
        wait_until = time.monotonic() + 5
        while True:
            evs = stats_events(daemon.log_path)
            if evs:
                stats = _sum_last_per_worker(evs)
            if (len(evs) > n_before and stats is not None and stats.get("delivered", 0) >= delivered * nrcpt) or (
                time.monotonic() > wait_until or not daemon.alive()
            ):
                break
            time.sleep(0.1)
        result["daemon_peak_rss_kib"] = sum(peak_rss_kib(p) or 0 for p in [daemon.popen.pid, *daemon.children()])
        result["sink_peak_rss_kib"] = peak_rss_kib(sink.popen.pid)
        result["daemon_alive_at_end"] = daemon.alive()
        if stats is not None:
            acc = load.accepted or 1
            for key in ("received", "delivered", "deferred", "bounced", "commit_rounds", "fsync_calls", "fsync_seconds"):
                result[f"daemon_{key}"] = stats.get(key)
            result["fsyncs_per_msg"] = round(stats.get("fsync_calls", 0) / acc, 3)
            result["commit_rounds_per_msg"] = round(stats.get("commit_rounds", 0) / acc, 3)
        else:
            result["fsyncs_per_msg"] = result["commit_rounds_per_msg"] = None

        if not daemon.alive():
            result["daemon_exit_status"] = daemon.popen.returncode
    except Exception as exc:  # report what was measured so far, then fail
        print(f"throughput: {type(exc).__name__}: {exc}", file=sys.stderr)
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in (daemon, sink):
            if p is not None:
                p.kill9()
    if receiver is not None:
        result["webhook_events"] = len(receiver.events())
        receiver.hang = False
        receiver.stop()
    if daemon is not None:
        # Read after the SIGKILL: everything the daemon wrote is in the file.
        bad, other = log_problems(daemon.log_path)
        result["daemon_log_warnings_errors"] = len(bad)
        for e in bad[:5]:
            print(f"throughput: daemon log: {json.dumps(e)}", file=sys.stderr)
        result["daemon_log_non_json_lines"] = len(other)
        for line in other[:40]:
            print(f"throughput: daemon log: {line}", file=sys.stderr)

    if "error" not in result:
        ids = maildir_message_ids(maildir)
        want = {f"<{run_id}.{i}@bench.mtaq.invalid>" for i in range(n)}
        missing = len(want - ids.keys())
        wrong = sum(1 for k, v in ids.items() if k not in want or v != nrcpt)
        result["ids_missing"] = missing
        result["ids_wrong_count"] = wrong
        ok = (
            result.get("accepted") == n
            and result.get("delivered") == n
            and missing == 0
            and wrong == 0
            and result.get("client_errors") == 0
            and result.get("fsyncs_per_msg") is not None
        )
    result["ok"] = ok
    if args.keep:
        result["workdir"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    sys.exit(main())
