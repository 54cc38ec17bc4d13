"""kill -9 harness: acknowledged mail survives SIGKILL of the real daemon and is delivered.

What it does: starts ``mtaq sink`` and ``mtaq serve`` (real subprocesses, real sockets) in a fresh
directory, sends ``--messages`` messages, each with a unique Message-ID, over ``--concurrency`` concurrent
SMTP sessions (smtplib, one thread per session), and at ``--kills`` moments chosen by ``--seed`` (one
random point in each of ``--kills`` equal slices of the sending, by messages finished) kills the daemon
with SIGKILL and at once restarts it on the same spool and port.

Client policy: only a 2xx reply to DATA counts as acknowledged. After an exception, a disconnection or a
non-2xx reply the session reconnects (waiting while the daemon is down) and resends the SAME message with
the SAME Message-ID, as a real client does, up to ``MAX_TRIES`` times; then it gives up on that message.
A resend of a message whose 250 was lost in the kill is a legitimate duplicate made by the client;
``duplicated_resubmitted`` counts the duplicated IDs whose DATA the client sent more than once;
``duplicated_unexplained`` those sent once whose queue ID the daemon never logged as ``outcome_unknown``
(informational: an attempt whose START record was not yet durable at the kill is in flight too, but
recovery sees it as never started and logs nothing).

After sending it waits (``--drain-timeout``) until every acknowledged Message-ID is in the sink's Maildir,
kills the daemon and runs ``mtaq log verify`` on the spool. Checks:

* ``lost``: acknowledged IDs not delivered. Must be 0 (RFC 5321 section 6.1; the daemon's promise).
* ``duplicated``: IDs delivered more than once. Allowed (in flight at a kill, or resent by the client).
* ``unacked_delivered``: delivered IDs that were never acknowledged. Allowed.
* ``verify_ok``: ``mtaq log verify`` exited 0.
* ``recovery_seconds_max``: the largest ``seconds`` of the daemon's ``recovery_complete`` events after the
  restarts; ``restart_to_recovered_s_max`` is the wall time from spawning the restarted process to that
  event (interpreter start and log open included).

Prints one JSON line on stdout; exit status 1 if ``lost`` > 0 or the verify failed (or the run broke),
else 0. With ``lost`` > 0 the evidence (Message-IDs, queue IDs, daemon log lines, ``mtaq log dump``
lines) goes to stderr; use ``--keep DIR`` to keep spool, Maildir and logs.

Run::

    .venv/bin/python bench/crash.py --messages 10000 --kills 3 --concurrency 20
    .venv/bin/python bench/crash.py --messages 600 --kills 3 --concurrency 10 --seed 1 --keep /tmp/crash1
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import random
import shutil
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from mtaq.testing.procs import (
    Proc,
    event_time,
    maildir_count,
    maildir_message_ids,
    read_events,
    start_daemon,
    start_sink,
)

MAX_TRIES = 50  # DATA attempts per message before the client gives up on it
CONNECT_GIVE_UP_S = 60.0  # a daemon that does not accept connections this long is a failed run
SMTP_TIMEOUT_S = 30.0
SENDER = "crash-sender@client.test"
RECIPIENT = "crash-rcpt@sink.test"


@dataclass
class Tally:
    """What the clients saw, shared between threads (guarded by ``cond``)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    acked: dict[str, str] = field(default_factory=dict)  # Message-ID -> the 250 reply text
    submissions: Counter[str] = field(default_factory=Counter)  # Message-ID -> DATA commands sent
    finished: int = 0  # acknowledged or given up
    gave_up: int = 0
    failed_tries: int = 0
    errors: list[str] = field(default_factory=list)
    abort: threading.Event = field(default_factory=threading.Event)


def build_message(i: int, mid: str, size: int) -> bytes:
    line = f"crash test message {i} " + "x" * 60
    body_lines = [line[:76]] * max(1, size // 78)
    head = [
        f"From: <{SENDER}>",
        f"To: <{RECIPIENT}>",
        f"Subject: crash {i}",
        f"Message-ID: {mid}",
        "Date: " + dt.datetime.now(dt.UTC).strftime("%a, %d %b %Y %H:%M:%S +0000"),
    ]
    return ("\r\n".join(head) + "\r\n\r\n" + "\r\n".join(body_lines) + "\r\n").encode()


def _connect(port: int, tally: Tally) -> smtplib.SMTP | None:
    """A fresh session, waiting while the daemon is down. None when the run is aborting."""
    deadline = time.monotonic() + CONNECT_GIVE_UP_S
    delay = 0.01
    while not tally.abort.is_set():
        try:
            s = smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=SMTP_TIMEOUT_S)
            code, _ = s.ehlo()
            if code == 250:
                return s
            _close(s)
        except (OSError, smtplib.SMTPException):
            pass
        if time.monotonic() > deadline:
            with tally.cond:
                tally.errors.append(f"no SMTP session on port {port} for {CONNECT_GIVE_UP_S}s")
            tally.abort.set()
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    return None


def _close(s: smtplib.SMTP | None) -> None:
    if s is None:
        return
    try:
        s.close()
    except Exception:
        pass


def client(port: int, work: list[tuple[str, bytes]], next_index: itertools.count[int], tally: Tally) -> None:
    """One SMTP session: take the next message, send it until acknowledged (or MAX_TRIES), repeat."""
    s: smtplib.SMTP | None = None
    try:
        while not tally.abort.is_set():
            i = next(next_index)
            if i >= len(work):
                break
            mid, data = work[i]
            acked = False
            for _ in range(MAX_TRIES):
                if s is None:
                    s = _connect(port, tally)
                    if s is None:
                        return
                code: int | None = None
                reply = b""
                try:
                    c, _ = s.mail(SENDER)
                    if c == 250:
                        c, _ = s.rcpt(RECIPIENT)
                        if c in (250, 251):
                            with tally.cond:
                                tally.submissions[mid] += 1
                            code, reply = s.data(data)
                    if code is None:
                        s.rset()
                except (OSError, smtplib.SMTPException):
                    # Disconnected (the kill) or DATA refused with a non-354: not acknowledged.
                    _close(s)
                    s = None
                    code = None
                if code is not None and 200 <= code < 300:
                    with tally.cond:
                        tally.acked[mid] = reply.decode(errors="replace")
                    acked = True
                    break
                with tally.cond:
                    tally.failed_tries += 1
            with tally.cond:
                tally.finished += 1
                if not acked:
                    tally.gave_up += 1
                tally.cond.notify_all()
    finally:
        if s is not None:
            try:
                s.quit()
            except (OSError, smtplib.SMTPException):
                pass
            _close(s)
        with tally.cond:
            tally.cond.notify_all()


def queue_id_of(reply: str) -> str:
    """``2.0.0 Ok: queued as QID`` -> ``QID`` ('' if absent)."""
    _, sep, rest = reply.partition("queued as ")
    return rest.split()[0] if sep and rest.split() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=10000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR (must not hold a spool yet) and keep it")
    ap.add_argument("--drain-timeout", type=float, default=120.0, metavar="S")
    ap.add_argument("--segment-bytes", type=int, default=None, metavar="N",
                    help="segment_bytes_max for the daemon (small values make kills land across roll-overs)")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.kills < 0 or args.concurrency < 1:
        ap.error("--messages and --concurrency must be >= 1, --kills >= 0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    t0 = time.monotonic()

    if args.keep:
        work_dir = os.path.abspath(args.keep)
        os.makedirs(work_dir, exist_ok=True)
        if os.path.exists(os.path.join(work_dir, "spool")):
            ap.error(f"{work_dir} already holds a spool; give an empty or new directory")
    else:
        work_dir = tempfile.mkdtemp(prefix="mtaq-crash-")
    spool = os.path.join(work_dir, "spool")
    maildir = os.path.join(work_dir, "maildir")
    daemon_log = os.path.join(work_dir, "daemon.log")
    sink_log = os.path.join(work_dir, "sink.log")
    print(f"crash: seed={seed} dir={work_dir}", file=sys.stderr, flush=True)

    n = args.messages
    work = []
    for i in range(n):
        mid = f"<crash.{seed}.{i}@mtaq.test>"
        work.append((mid, build_message(i, mid, rng.randint(200, 4000))))
    # One kill point in each of K equal slices of the middle 90% of the messages finished.
    k = args.kills
    kill_at = [int(n * (0.05 + 0.9 * (j + rng.random()) / k)) for j in range(k)] if k else []

    tally = Tally()
    sink: Proc | None = None
    daemon: Proc | None = None
    restarts: list[float] = []  # time.time() just before each restart was spawned
    kills_done = 0
    result: dict[str, object] = {}
    broken: list[str] = []
    try:
        sink = start_sink(maildir, sink_log)
        config = None
        if args.segment_bytes:
            config = os.path.join(work_dir, "mtaq.toml")
            with open(config, "w") as f:
                f.write(f"segment_bytes_max = {args.segment_bytes}\n")
        daemon = start_daemon(spool, sink.port, daemon_log, config=config)
        port = daemon.port

        def killer() -> None:
            nonlocal daemon, kills_done
            for at in kill_at:
                with tally.cond:
                    while tally.finished < at and not tally.abort.is_set() and tally.finished < n:
                        tally.cond.wait(0.5)
                    if tally.abort.is_set() or tally.finished >= n:
                        return
                assert daemon is not None
                daemon.kill9()
                kills_done += 1
                restarts.append(time.time())
                try:
                    daemon = start_daemon(spool, sink.port, daemon_log, port=port, config=config)
                except RuntimeError as exc:
                    with tally.cond:
                        tally.errors.append(f"restart {kills_done} failed: {exc}")
                    tally.abort.set()
                    return

        next_index = itertools.count()
        threads = [threading.Thread(target=client, args=(port, work, next_index, tally), daemon=True)
                   for _ in range(args.concurrency)]
        kt = threading.Thread(target=killer, daemon=True)
        kt.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_sent = time.monotonic()
        with tally.cond:
            tally.cond.notify_all()
        kt.join()
        if kills_done < k:
            broken.append(f"only {kills_done} of {k} kills happened during sending")
        broken.extend(tally.errors)

        # Drain: every acknowledged Message-ID in the Maildir, or the timeout.
        acked = set(tally.acked)
        deadline = time.monotonic() + args.drain_timeout
        delivered: Counter[str] = Counter()
        while True:
            if maildir_count(maildir) >= len(acked):
                delivered = maildir_message_ids(maildir)
                if acked <= delivered.keys():
                    break
            if time.monotonic() > deadline:
                delivered = maildir_message_ids(maildir)
                break
            time.sleep(0.25)
        # Let late redeliveries (duplicates) land: until the Maildir stops growing for 1 s.
        settle_end = min(deadline, time.monotonic() + 10)
        last, stable_since = maildir_count(maildir), time.monotonic()
        while time.monotonic() < settle_end and time.monotonic() - stable_since < 1.0:
            time.sleep(0.2)
            c = maildir_count(maildir)
            if c != last:
                last, stable_since = c, time.monotonic()
        delivered = maildir_message_ids(maildir)
        drain_s = time.monotonic() - t_sent

        assert daemon is not None
        daemon.kill9()
        sink.kill9()
        v = subprocess.run([sys.executable, "-m", "mtaq.cli", "log", "verify", "--spool", spool],
                           capture_output=True, text=True, timeout=300)
        verify_ok = v.returncode == 0
        if not verify_ok:
            print(f"crash: log verify exited {v.returncode}:\n{v.stdout}{v.stderr}", file=sys.stderr)

        events = read_events(daemon_log)
        recs = [e for e in events if e.get("event") == "recovery_complete"]
        after = recs[1:]  # the first is the initial start
        rec_s = [float(e["seconds"]) for e in after if isinstance(e.get("seconds"), (int, float))]
        wall: list[float] = []
        for r in restarts:
            ts = [t for t in (event_time(e) for e in after) if t is not None and t >= r]
            if ts:
                wall.append(min(ts) - r)
        # A kill that lands before recovery_complete is a crash during recovery (GUIDE I5): allowed, counted.
        killed_during_recovery = kills_done + 1 - len(recs)
        if killed_during_recovery < 0:
            broken.append(f"{len(recs)} recovery_complete events for {kills_done + 1} starts")

        lost_ids = sorted(acked - delivered.keys())
        dup_ids = sorted(m for m, c in delivered.items() if c > 1)
        unknown_qids = {e.get("queue_id") for e in events if e.get("event") == "outcome_unknown"}
        dup_unexplained = [m for m in dup_ids if tally.submissions[m] == 1 and m in tally.acked
                           and queue_id_of(tally.acked[m]) not in unknown_qids]
        unacked_delivered = sorted(m for m in delivered if m not in acked)
        sent_ids = {w[0] for w in work}
        stray = [m for m in delivered if m not in sent_ids]
        if stray:
            broken.append(f"{len(stray)} delivered Message-IDs were never sent, e.g. {stray[:3]}")
        result = {
            "messages": n,
            "acknowledged": len(acked),
            "delivered_unique": len(delivered),
            "lost": len(lost_ids),
            "duplicated": len(dup_ids),
            "duplicated_resubmitted": sum(1 for m in dup_ids if tally.submissions[m] > 1),
            "duplicated_unexplained": len(dup_unexplained),
            "unacked_delivered": len(unacked_delivered),
            "gave_up": tally.gave_up,
            "failed_tries": tally.failed_tries,
            "kills": kills_done,
            "killed_during_recovery": max(0, killed_during_recovery),
            "seed": seed,
            "verify_ok": verify_ok,
            "recovery_seconds_max": max(rec_s) if rec_s else None,
            "restart_to_recovered_s_max": round(max(wall), 4) if wall else None,
            "outcome_unknown": sum(1 for e in events if e.get("event") == "outcome_unknown"),
            "drain_s": round(drain_s, 2),
            "elapsed_s": round(time.monotonic() - t0, 2),
        }
        if broken:
            result["errors"] = broken
        if lost_ids:
            _report_lost(lost_ids, tally, daemon_log, spool, seed)
    except Exception as exc:
        broken.append(f"{type(exc).__name__}: {exc}")
        result = {"messages": n, "kills": kills_done, "seed": seed, "errors": broken,
                  "elapsed_s": round(time.monotonic() - t0, 2)}
    finally:
        tally.abort.set()
        for p in (daemon, sink):
            if p is not None:
                p.kill9()
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(result), flush=True)
    ok = result.get("lost") == 0 and result.get("verify_ok") is True and not broken
    return 0 if ok else 1


def _report_lost(lost_ids: list[str], tally: Tally, daemon_log: str, spool: str, seed: int) -> None:
    """Evidence for lost mail on stderr: Message-ID, queue ID, its daemon log lines and log records."""
    dump = subprocess.run([sys.executable, "-m", "mtaq.cli", "log", "dump", "--spool", spool],
                          capture_output=True, text=True, timeout=300).stdout.splitlines()
    with open(daemon_log, encoding="utf-8", errors="replace") as f:
        log_lines = f.read().splitlines()
    print(f"crash: LOST {len(lost_ids)} acknowledged messages (seed {seed})", file=sys.stderr)
    for mid in lost_ids[:10]:
        qid = queue_id_of(tally.acked[mid])
        print(f"--- {mid} acknowledged with {tally.acked[mid]!r} (queue ID {qid or '?'}), "
              f"DATA sent {tally.submissions[mid]}x", file=sys.stderr)
        if qid:
            for line in log_lines:
                if qid in line:
                    print(f"  daemon: {line}", file=sys.stderr)
            for line in dump:
                if qid in line:
                    print(f"  dump:   {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
