"""Recovery benchmark: restart time after ``kill -9`` with W attempts in flight and D messages deferred.

Recovery reads the log only from the last checkpoint's ``min(working-suffix start, head)`` to the end, so
its time should depend on how much was in flight (W), not on how much is queued (D). This measures it.

For each D in ``--deferred`` (default ``1000,200000``), in a fresh temporary directory:

1. Prefill (no SMTP, fast): open the spool's log with :meth:`mtaq.storage.log.Log.open` (64 MiB segments)
   and append D messages, each a DATA record (a 2 KiB message) and a deferred generation-1 ENVELOPE
   (``runner=1``, ``attempts=1``, due in 86400 s), then fsync and close.
2. Start a *stalling* next hop: this script run again as a subprocess (``--stall-sink-port``, an aiosmtpd
   server) that accepts MAIL and RCPT but holds its reply to the end of DATA for ``--stall`` seconds
   (600), so every delivery attempt stays in flight (between its START and its DELIVERY/FINISH records).
   It writes the number of open DATA transactions to a status file ten times a second.
3. Start ``mtaq serve`` (``mtaq.testing.procs.start_daemon``) with ``delivery_concurrency = W``
   (``--inflight``, 500), ``checkpoint_interval_s = 1``, ``retry_intervals_s = [86400.0]``,
   ``stats_interval_s = 0`` and ``smtp_timeout_s = 3600`` (so that the outbound DATA does not time out
   while the next hop stalls: the default 60 s would conclude the attempts as deferred). Wait for its first
   ``recovery_complete`` (this one has no checkpoint and reads every segment: reported as
   ``first_start_*``).
4. Send W new messages over SMTP (50 concurrent sessions; each must get 250), wait until the stalling next
   hop has W open DATA transactions, then until a checkpoint written after that moment is on disk (at least
   2 s), and ``kill -9`` the daemon.
5. Restart it on the same spool and port and measure from the restart's spawn time (wall clock, taken just
   before the process is spawned):

   * ``first_250_s``: seconds until a client (a thread started before the spawn that connects as soon as
     the port accepts and sends one message) gets 250 to DATA;
   * ``recovery_complete_s``: seconds until the ``recovery_complete`` event, by the event's own timestamp;
   * ``recovery_seconds``, ``records_scanned``: that event's ``seconds`` (the recovery itself, after the
     daemon listens) and ``records`` (records read from the working suffix); also ``segments_read``,
     ``bytes_read``, ``scan_from``, ``outcome_unknown`` and the checkpoint's ``suffix``/``head`` read just
     after the kill.

It prints ONE JSON line on stdout::

    {"inflight": W, "results": [{"deferred": D, "first_250_s": ..., "recovery_complete_s": ...,
     "recovery_seconds": ..., "records_scanned": ..., ...}, ...], "ratio_recovery_200k_to_1k": ...}

Times are in seconds. The ratio is the largest D's ``recovery_seconds`` over the smallest D's (its key is
named after those two D values: ``ratio_recovery_200k_to_1k`` for the default); near 1 means recovery does
not depend on the queue size. ``ratio_records_…`` is the same for ``records_scanned``. Exit status 0 when
every step worked (all W messages and the probe got 250), else 1. Every process started is killed at the
end, also on error.

Run from the project root (the client, the daemon and the stalling next hop share the machine's cores)::

    .venv/bin/python bench/recovery.py --deferred 1000,200000 --inflight 500

Options: --deferred D1,D2,... (1000,200000), --inflight W (500), --keep DIR (create the work dirs under
DIR and keep them: spool, logs), --stall S (600, seconds the next hop holds each DATA reply).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import aiosmtplib

from mtaq.core.checkpoint import CheckpointError, decode_checkpoint
from mtaq.testing.prefill import prefill_deferred
from mtaq.testing.procs import Proc, event_time, free_port, read_events, start_daemon, wait_port

SENDER = "bench@example.com"
BODY_BYTES = 2048
SEND_SESSIONS = 50
SEGMENT_BYTES_MAX = 64 << 20


# --------------------------------------------------------------------------------------------- messages


def build_message(tag: str, size: int = BODY_BYTES) -> bytes:
    head = (
        f"From: <{SENDER}>\r\nTo: <rcpt@example.org>\r\nSubject: mtaq recovery {tag}\r\n"
        f"Message-ID: <{tag}@bench.mtaq.invalid>\r\nDate: Thu, 01 Jan 2026 00:00:00 +0000\r\n\r\n"
    ).encode()
    room = max(80, size - len(head))
    full, rest = divmod(room, 78)
    body = (b"x" * 76 + b"\r\n") * full + (b"y" * max(0, rest - 2) + b"\r\n" if rest >= 2 else b"")
    return head + body


def prefill(spool: str, n: int) -> float:
    """Append ``n`` deferred messages (DATA + generation-1 ENVELOPE of runner 1) to the log; return seconds."""
    t0 = time.monotonic()
    template = build_message("prefill")
    prefill_deferred(spool, n, lambda i: template.replace(b"prefill", f"pf{i:08d}".encode(), 2),
                     sender_of=lambda i: SENDER, segment_bytes_max=SEGMENT_BYTES_MAX)
    return time.monotonic() - t0


# --------------------------------------------------------------------------------------------- stalling next hop


def run_stall_sink(port: int, status_path: str, stall_s: float) -> None:
    """The stalling next hop (run in a subprocess): accept MAIL/RCPT, hold the reply to DATA ``stall_s`` s."""
    from aiosmtpd.smtp import SMTP, Envelope, Session

    state = {"connections": 0, "open_data": 0, "data_total": 0}

    class Handler:
        async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
            state["open_data"] += 1
            state["data_total"] += 1
            try:
                await asyncio.sleep(stall_s)
            finally:  # the connection is lost (daemon killed): aiosmtpd cancels the handler
                state["open_data"] -= 1
            return "451 4.3.0 stalled on purpose (bench/recovery.py)"

    class Counting(SMTP):
        def connection_made(self, transport: Any) -> None:
            state["connections"] += 1
            super().connection_made(transport)

        def connection_lost(self, error: Exception | None) -> None:
            state["connections"] -= 1
            super().connection_lost(error)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handler = Handler()
        server = await loop.create_server(
            lambda: Counting(handler, hostname="stall", ident="stall-sink", data_size_limit=None,
                             timeout=stall_s + 3600, loop=loop),
            host="127.0.0.1",
            port=port,
            reuse_address=True,
            backlog=4096,
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


def stall_status(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="ascii") as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------------------------- helpers


def wait_event(proc: Proc, name: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        for e in read_events(proc.log_path):
            if e.get("event") == name:
                return e
        if not proc.alive():
            raise RuntimeError(f"daemon exited with {proc.popen.returncode} before {name!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {name!r} event after {timeout_s}s")
        time.sleep(0.05)


async def send_many(port: int, n: int, tag: str, sessions: int) -> list[str]:
    """Send ``n`` messages over ``sessions`` concurrent sessions; return the errors (empty: all got 250)."""
    counter = itertools.count()
    errors: list[str] = []

    async def session() -> None:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=120, local_hostname="bench.local")
        await smtp.connect()
        try:
            while (i := next(counter)) < n:
                try:
                    refused, _reply = await smtp.sendmail(
                        SENDER, [f"inflight{i}@example.org"], build_message(f"{tag}.{i}")
                    )
                    if refused:
                        errors.append(f"message {i}: refused {refused}")
                except aiosmtplib.SMTPException as exc:
                    errors.append(f"message {i}: {type(exc).__name__}: {exc}")
        finally:
            try:
                await smtp.quit()
            except (aiosmtplib.SMTPException, OSError):
                smtp.close()

    await asyncio.gather(*(session() for _ in range(min(sessions, n))))
    return errors


class Probe(threading.Thread):
    """Connects as soon as the port accepts and sends one message; records the wall time of the 250."""

    def __init__(self, port: int, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.deadline = time.time() + timeout_s
        self.t_250: float | None = None
        self.t_connected: float | None = None
        self.refused = 0
        self.errors: list[str] = []
        self.reply = ""

    def run(self) -> None:
        msg = build_message("probe")
        while time.time() < self.deadline:
            try:
                with smtplib.SMTP("127.0.0.1", self.port, local_hostname="probe.local", timeout=60) as s:
                    if self.t_connected is None:
                        self.t_connected = time.time()
                    s.ehlo()
                    s.mail(SENDER)
                    s.rcpt("probe@example.org")
                    code, text = s.data(msg)
                    if code == 250:
                        self.t_250 = time.time()
                        self.reply = text.decode(errors="replace")
                        return
                    self.errors.append(f"DATA: {code} {text!r}")
            except ConnectionRefusedError:
                self.refused += 1
                time.sleep(0.002)
            except (OSError, smtplib.SMTPException) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.01)


def kill_popen(p: subprocess.Popen[bytes] | None) -> None:
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGKILL)
    if p is not None:
        p.wait()


def label(n: int) -> str:
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}m"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def write_config(path: str, inflight: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f"delivery_concurrency = {inflight}\n"
            "checkpoint_interval_s = 1\n"
            "retry_intervals_s = [86400.0]\n"
            "stats_interval_s = 0\n"
            "smtp_timeout_s = 3600\n"
        )


# --------------------------------------------------------------------------------------------- one run


def run_one(d: int, w: int, work: str, stall_s: float, procs: list[Any]) -> dict[str, Any]:
    spool = os.path.join(work, "spool")
    res: dict[str, Any] = {"deferred": d}
    res["prefill_s"] = round(prefill(spool, d), 3)

    # The stalling next hop.
    sink_port = free_port()
    status = os.path.join(work, "stall-status.json")
    sink_log = open(os.path.join(work, "stall-sink.log"), "ab")
    sink = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--stall-sink-port", str(sink_port), "--stall-status", status,
         "--stall", str(stall_s)],
        stdout=sink_log, stderr=sink_log, stdin=subprocess.DEVNULL,
    )
    sink_log.close()
    procs.append(sink)
    wait_port(sink_port, proc=sink)

    conf = os.path.join(work, "mtaq.toml")
    write_config(conf, w)

    # First start: no checkpoint, reads every segment.
    t_spawn1 = time.time()
    d1 = start_daemon(spool, sink_port, os.path.join(work, "daemon1.log"), config=conf)
    procs.append(d1)
    ev1 = wait_event(d1, "recovery_complete", 900)
    res["first_start_recovery_seconds"] = ev1.get("seconds")
    res["first_start_records"] = ev1.get("records")
    res["first_start_recovery_complete_s"] = _round((event_time(ev1) or t_spawn1) - t_spawn1)

    # W new messages, each answered 250, then wait until W attempts are in flight at the next hop.
    t_send = time.monotonic()
    errors = asyncio.run(send_many(d1.port, w, f"inflight.{d}", SEND_SESSIONS))
    res["send_s"] = round(time.monotonic() - t_send, 3)
    if errors:
        raise RuntimeError(f"{len(errors)} of {w} messages not accepted, e.g. {errors[:3]}")
    deadline = time.monotonic() + 900
    while (st := stall_status(status)).get("open_data", 0) < w:
        if not d1.alive():
            raise RuntimeError(f"daemon exited with {d1.popen.returncode} while waiting for {w} in flight")
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {st.get('open_data')} of {w} attempts in flight after 900 s")
        time.sleep(0.05)
    t_inflight = time.time()
    res["inflight_reached_after_send_s"] = round(time.monotonic() - t_send, 3)
    res["inflight_at_kill"] = st.get("open_data")
    # A checkpoint written after all W STARTs: at least 2 s (checkpoint_interval_s = 1), and its mtime says so.
    cp_path = os.path.join(spool, "checkpoint")
    time.sleep(2.0)
    deadline = time.monotonic() + 30
    while not (os.path.exists(cp_path) and os.stat(cp_path).st_mtime > t_inflight + 0.05):
        if time.monotonic() > deadline:
            raise RuntimeError("no checkpoint written after the attempts were in flight")
        time.sleep(0.05)
    res["inflight_at_kill"] = stall_status(status).get("open_data")
    d1.kill9()
    try:
        with open(cp_path, "rb") as f:
            cp = decode_checkpoint(f.read())
        res["checkpoint_suffix"], res["checkpoint_head"] = str(cp.suffix), str(cp.head)
        res["checkpoint_runners"] = [str(p) for p in cp.runners]
    except (OSError, CheckpointError) as exc:
        res["checkpoint_error"] = str(exc)
    segs = [n for n in os.listdir(os.path.join(spool, "log")) if n.endswith(".seg")]
    res["segments_on_disk"] = len(segs)
    res["log_bytes_on_disk"] = sum(os.path.getsize(os.path.join(spool, "log", n)) for n in segs)

    # Restart on the same spool and port; the probe connects as soon as the port accepts.
    probe = Probe(d1.port, timeout_s=300)
    probe.start()
    t_spawn = time.time()
    d2 = start_daemon(spool, sink_port, os.path.join(work, "daemon2.log"), port=d1.port, config=conf)
    procs.append(d2)
    ev = wait_event(d2, "recovery_complete", 900)
    probe.join(timeout=300)
    listening = next((e for e in read_events(d2.log_path) if e.get("event") == "listening"), {})
    if probe.t_250 is None:
        raise RuntimeError(f"the probe got no 250 after the restart: {probe.errors[:3]}")
    res["first_250_s"] = _round(probe.t_250 - t_spawn)
    res["recovery_complete_s"] = _round((event_time(ev) or float("nan")) - t_spawn)
    res["recovery_seconds"] = ev.get("seconds")
    res["records_scanned"] = ev.get("records")
    res["segments_read"] = ev.get("segments")
    res["bytes_read"] = ev.get("bytes")
    res["scan_from"] = ev.get("scan_from")
    res["checkpoint_used"] = ev.get("checkpoint")
    res["outcome_unknown"] = ev.get("outcome_unknown")
    res["concluded"] = ev.get("concluded")
    res["listening_s"] = _round((event_time(listening) or float("nan")) - t_spawn) if listening else None
    res["probe_connected_s"] = _round(probe.t_connected - t_spawn) if probe.t_connected else None
    res["probe_errors"] = len(probe.errors)
    time.sleep(0.5)
    # Everything the daemons logged at warning level or above, other than the expected outcome_unknown.
    bad = [
        e for p in (d1, d2) for e in read_events(p.log_path)
        if e.get("level") in ("warning", "error", "critical", "exception") and e.get("event") != "outcome_unknown"
    ]
    res["daemon_log_warnings_errors"] = len(bad)
    for e in bad[:5]:
        print(f"recovery: D={d}: daemon log: {json.dumps(e)}", file=sys.stderr)
    for p in (d2, d1):
        p.kill9()
    kill_popen(sink)
    return res


def _round(v: float) -> float:
    return round(v, 4)


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--deferred", default="1000,200000", metavar="D1,D2,...", help="deferred messages per run")
    ap.add_argument("--inflight", type=int, default=500, metavar="W", help="attempts in flight at the kill")
    ap.add_argument("--keep", metavar="DIR", help="create the work dirs under DIR and keep them")
    ap.add_argument("--stall", type=float, default=600.0, metavar="S", help="seconds the next hop holds DATA")
    ap.add_argument("--stall-sink-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stall-status", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stall_sink_port:
        run_stall_sink(args.stall_sink_port, args.stall_status, args.stall)
        return 0
    try:
        ds = [int(x) for x in args.deferred.split(",") if x.strip()]
    except ValueError:
        ap.error("--deferred takes comma-separated integers")
    if not ds or any(d < 0 for d in ds) or args.inflight < 1:
        ap.error("--deferred values must be >= 0 and --inflight >= 1")

    out: dict[str, Any] = {"inflight": args.inflight, "results": []}
    procs: list[Any] = []
    ok = True
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    try:
        for d in ds:
            work = tempfile.mkdtemp(prefix=f"recovery-{d}-", dir=args.keep) if args.keep else tempfile.mkdtemp(
                prefix=f"mtaq-recovery-{d}-")
            try:
                r = run_one(d, args.inflight, work, args.stall, procs)
            except Exception as exc:
                print(f"recovery: D={d}: {type(exc).__name__}: {exc}", file=sys.stderr)
                r = {"deferred": d, "error": f"{type(exc).__name__}: {exc}"}
                ok = False
            finally:
                for p in procs:
                    if isinstance(p, Proc):
                        p.kill9()
                    else:
                        kill_popen(p)
                procs.clear()
            if args.keep:
                r["workdir"] = work
            else:
                shutil.rmtree(work, ignore_errors=True)
            out["results"].append(r)
    finally:
        for p in procs:  # an interrupt between the steps above
            if isinstance(p, Proc):
                p.kill9()
            else:
                kill_popen(p)
    good = [r for r in out["results"] if "recovery_seconds" in r]
    if len(good) >= 2:
        lo = min(good, key=lambda r: r["deferred"])
        hi = max(good, key=lambda r: r["deferred"])
        name = f"{label(hi['deferred'])}_to_{label(lo['deferred'])}"
        out[f"ratio_recovery_{name}"] = (
            round(hi["recovery_seconds"] / lo["recovery_seconds"], 3) if lo["recovery_seconds"] else None
        )
        out[f"ratio_records_{name}"] = (
            round(hi["records_scanned"] / lo["records_scanned"], 3) if lo["records_scanned"] else None
        )
    out["ok"] = ok and len(good) == len(ds)
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
