"""kill -9 harness: acknowledged mail survives SIGKILL and power cuts of the real daemon, and is delivered.

What it does: starts ``mtaq sink`` and ``mtaq serve`` (real subprocesses, real sockets) in a fresh
directory, sends ``--messages`` messages, each with a unique Message-ID, over ``--concurrency`` concurrent
SMTP sessions (smtplib, one thread per session), and runs ``--cycles`` crash cycles chosen by ``--seed``.
A cycle is a crash of the daemon and its restart on the same spool and port:

* most cycles are a ``kill -9`` by the harness at a random moment (one random point in each of
  ``--cycles`` equal slices of the sending, by messages finished);
* a fraction ``--kill-points`` of them instead restart the daemon with ``MTAQ_KILL_POINT`` set to one of
  the named points of :mod:`mtaq.testing.killpoints` (and ``MTAQ_KILL_AFTER`` to a small random count),
  so that it kills itself at exactly that point (after the fsync before the 250, after the remote reply
  before our record, mid-checkpoint, mid-reclaim, during recovery); if it has not reached the point by
  the end of its slice, the harness kills it. One that dies at its point during recovery, before it
  listens, is a crash cycle of its own (power cut, restart): the ``cycles`` reported are then more than
  ``--cycles``, never fewer unless the sending ended first (an error);
* unless ``--no-power-cut``, every crash is also a power cut: the daemon runs with
  ``MTAQ_TEST_FS=powercut`` and, once it is dead, :func:`mtaq.testing.powercut.cut` drops every write it
  never fsync'd (``kill -9`` alone keeps them in the page cache and would hide a missing fsync); with
  ``--reorder`` it keeps a random subset of the unsynced 4 KiB pages instead, as a disk's out-of-order
  write-back does, so that a later record can survive an earlier one;
* multi-run sequences (``--cut-fraction F`` < 1): each crash is followed by a power cut only with
  probability F (drawn per cycle from the seed); the others are ``kill -9`` alone, whose unsynced writes
  stay in the page cache: the next runs read them back, and the power cut of a later cycle drops whatever
  no run fsync'd since (the ledger of :mod:`mtaq.testing.powercut` is kept across runs). A run that trusts
  what an earlier run left in the page cache without fsyncing it loses mail here (issue 31.1);
* ``--recovery-kills F``: a fraction F of the restarts kills its own recovery right after its k-th append
  (``MTAQ_KILL_POINT=recovery.append``), cut or not like any crash, then restarts; k sweeps 1, 2, 3, ...
  from one such restart to the next while recovery dies there (so every append of a recovery is a crash
  point in turn, recoveries of recoveries included), and starts again at 1 when a recovery appended fewer;
* progress: a crash may land during recovery, but after three starts in a row crashed before their
  recovery completed, the next crash (other than a recovery kill) waits for its recovery to complete
  (``recoveries_waited_for``); otherwise a recovery slower than a slice (every segment scanned after media
  damage to the checkpoint) is killed every time and never writes the checkpoint that would shorten it;
* ``--roll-kills F``: a fraction F of the restarts kills itself right after its k-th segment roll-over
  (``MTAQ_KILL_POINT=log.roll``, k from 1 to 3), when the sealed segment's tail is only in the page cache:
  with a kill that is not cut, what the next run makes of it is exactly what a later cut tests.

``--break-fsync`` is the negative control: the same run with fsync turned into a no-op
(``MTAQ_TEST_FS=powercut-nofsync``); it must report lost mail, or the harness proves nothing.

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

* ``lost``: acknowledged IDs not delivered (bounced or not), unless excused by reported media damage. Must
  be 0 (RFC 5321 section 6.1; the daemon's promise). ``silently_ended``: those of them for which no DSN
  came either (neither delivered nor bounced); ``bounced_acknowledged``: acknowledged, not delivered, and
  bounced with a DSN (``bounced_undamaged`` of them outside reported damage, which ``lost`` counts).
* ``dsn_twice``: failures reported by more than one DSN (DSNs are told apart by their own Message-ID;
  counted per original queue ID, from ``X-Mtaq-Queue-ID``, and ``Final-Recipient``). Must be 0. The same
  DSN delivered twice is an in-flight duplicate (``duplicated``), not this. ``dsns_failed`` counts the
  failure DSNs, ``dsns_for_unacknowledged`` those about messages whose 250 was never sent (allowed: an
  envelope that survived a power cut without its data is bounced, issue 31), ``dsns_for_delivered`` those
  about acknowledged messages that were also delivered, ``dsns_delayed`` delay warnings.
* ``truncated``: delivered copies whose content does not end with the exact bytes the client sent (a
  cut-off or altered body; with ``--header-checks`` / ``--canonical-maps``: the message as the daemon's
  rules rewrite it). Must be 0.
* ``envelope_not_rewritten`` (``--canonical-maps``): delivered copies whose envelope (the sink's Return-Path
  and Delivered-To lines) is not the canonical sender and recipient. Must be 0 (counted as broken).
* ``duplicated``: IDs delivered more than once. Allowed (in flight at a kill, or resent by the client).
* ``unacked_delivered``: delivered IDs that were never acknowledged. Allowed.
* ``verify_ok``: ``mtaq log verify`` exited 0 (with ``--media-damage`` it names the damage and exits 1).
* ``lost_in_reported_damage``, ``media_damage``, ``media_damage_unreported`` (``--media-damage``): messages
  whose records were in damaged bytes that the daemon reported (excused from ``lost``), the faults applied,
  and faults that cost a message without being reported (must be 0).
* ``recovery_seconds_max``: the largest ``seconds`` of the daemon's ``recovery_complete`` events after the
  restarts; ``restart_to_recovered_s_max`` is the wall time from spawning the restarted process to that
  event (interpreter start and log open included).

``cuts``, ``kills_without_cut``, ``cuts_after_uncut_kills`` (cuts that came after one or more crashes
without a cut) and ``recovery_kills_k_max`` (the deepest append at which a recovery was killed) say what
the multi-run sequences did.

Prints one JSON line on stdout; exit status 1 if ``lost``, ``truncated`` or ``dsn_twice`` > 0 or the verify
failed (or the run broke), else 0. With ``lost`` > 0 the evidence (Message-IDs, queue IDs, daemon log lines, ``mtaq log
dump`` lines) goes to stderr; use ``--keep DIR`` to keep spool, Maildir and logs.

Run::

    .venv/bin/python bench/crash.py --messages 25000 --cycles 500 --seed 7 --segment-bytes 262144
    .venv/bin/python bench/crash.py --messages 600 --cycles 3 --concurrency 10 --seed 1 --keep /tmp/crash1
    .venv/bin/python bench/crash.py --messages 600 --cycles 5 --seed 1 --break-fsync   # must exit 1, lost > 0
    .venv/bin/python bench/crash.py --messages 6000 --cycles 300 --seed 31 --cut-fraction 0.5 \
        --recovery-kills 0.2 --reorder --media-damage 0.2 --defer-fraction 0.5 --segment-bytes 65536
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import random
import re
import shutil
import smtplib
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from mtaq.testing import killpoints, media, powercut
from mtaq.testing.procs import (
    Proc,
    event_time,
    free_port,
    maildir_count,
    maildir_message_ids,
    read_events,
    start_daemon,
    start_sink,
)
from mtaq.testing.webhook import Receiver

RECOVERY_KILLS_MAX = 3  # starts in a row crashed before their recovery completed, then one is let finish
RECOVERY_WAIT_S = 120.0
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


def client(port: int, work: list[tuple[str, bytes, str]], next_index: itertools.count[int], tally: Tally) -> None:
    """One SMTP session: take the next message, send it until acknowledged (or MAX_TRIES), repeat."""
    s: smtplib.SMTP | None = None
    try:
        while not tally.abort.is_set():
            i = next(next_index)
            if i >= len(work):
                break
            mid, data, rcpt = work[i]
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
                        c, _ = s.rcpt(rcpt)
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
    ap.add_argument("--cycles", "--kills", dest="cycles", type=int, default=3,
                    help="crash cycles (kill, power cut unless --no-power-cut, restart) during the sending")
    ap.add_argument("--kill-points", type=float, default=0.3, metavar="FRACTION",
                    help="fraction of cycles in which the daemon kills itself at a named kill point")
    ap.add_argument("--no-power-cut", action="store_true",
                    help="plain kill -9 only: keep writes that were never fsync'd (they survive in the page cache)")
    ap.add_argument("--break-fsync", action="store_true",
                    help="negative control: fsync is a no-op (MTAQ_TEST_FS=powercut-nofsync); must report loss")
    ap.add_argument("--cut-fraction", type=float, default=1.0, metavar="F",
                    help="fraction of the crashes followed by a power cut (default 1: all); the others are kill -9 "
                         "alone: their unsynced writes stay in the page cache for the next runs to read, and a power "
                         "cut in a later cycle drops whatever no run fsync'd since (multi-run crash sequences)")
    ap.add_argument("--recovery-kills", type=float, default=0.0, metavar="F",
                    help="fraction of the restarts told to kill their recovery right after its k-th append "
                         "(MTAQ_KILL_POINT=recovery.append); k sweeps 1, 2, 3, ... while recovery dies there and "
                         "goes back to 1 when a recovery appended fewer")
    ap.add_argument("--roll-kills", type=float, default=0.0, metavar="F",
                    help="fraction of the restarts told to kill themselves right after their k-th segment roll-over "
                         "(k from 1 to 3; MTAQ_KILL_POINT=log.roll): the sealed segment's tail is not fsync'd yet")
    ap.add_argument("--cycles-after-sending", action="store_true",
                    help="crash cycles the sending did not reach (it ended first) crash the draining daemon, each "
                         "after it ran a random 0.3-2 s (default: fewer cycles is an error)")
    ap.add_argument("--reorder", action="store_true",
                    help="power cuts keep a random subset of the unsynced 4 KiB pages (out-of-order write-back) "
                         "instead of cutting each file at its last fsync")
    ap.add_argument("--defer-fraction", type=float, default=0.0, metavar="F",
                    help="this fraction of the messages is deferred once by the sink and retried after 1 s")
    ap.add_argument("--retry-interval", type=float, default=1.0, metavar="S",
                    help="retry_intervals_s of the daemon with --defer-fraction (seconds; longer: a deferred message "
                         "stays queued across more crash cycles)")
    ap.add_argument("--vary-config", action="store_true",
                    help="restart with a different retry_intervals_s, segment_bytes_max and checkpoint_interval_s "
                         "each time (nothing may be lost or offered twice by the change)")
    ap.add_argument("--media-damage", type=float, default=0.0, metavar="P",
                    help="after this fraction of the crashes, flip a bit or zero a sector in a sealed segment or "
                         "the checkpoint (mtaq.testing.media); a lost message is excused only if it was in the "
                         "damaged bytes and the damage was reported")
    ap.add_argument("--header-checks", action="store_true",
                    help="run the daemon with header_checks rewriting every message (issue 35: PREPEND before "
                         "Subject, IGNORE Date, REPLACE To); the Message-ID that tells messages apart is kept")
    ap.add_argument("--milter", choices=("full", "eom"), default=None,
                    help="a no-op milter (bench/noop_milter.py, its --mode) in the path: smtpd_milters (issue 34: "
                         "the verdict comes before the append, a crash loses nothing acknowledged)")
    ap.add_argument("--canonical-maps", action="store_true",
                    help="run the daemon with canonical_maps rewriting every message's envelope sender and recipient "
                         "and its From:/To: (issue 35.3); every delivered copy must be the rewritten message, "
                         "delivered to the rewritten recipient from the rewritten sender")
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR (must not hold a spool yet) and keep it")
    ap.add_argument("--drain-timeout", type=float, default=120.0, metavar="S")
    ap.add_argument("--workers", default="1", metavar="auto|N",
                    help="worker processes, one spool shard each (a kill -9 takes the supervisor and all of them); "
                         "auto: as mtaq serve counts them (one per core, at most 8)")
    ap.add_argument("--size-max", type=int, default=4000,
                    help="message sizes are drawn from 200 to this many bytes")
    ap.add_argument("--receive-buffer-bytes", type=int, default=0,
                    help="receive_buffer_bytes for the daemon (small: bodies go through the temporary file "
                         "and are written into the log in pieces)")
    ap.add_argument("--segment-bytes", type=int, default=None, metavar="N",
                    help="segment_bytes_max for the daemon (small values make kills land across roll-overs)")
    ap.add_argument("--exporter", action="store_true",
                    help="attach an event webhook (issue 37): a real aiohttp receiver in this process; every "
                         "acknowledged message's received event and its outcome must reach it (events_lost: 0)")
    args = ap.parse_args(argv)
    if args.workers == "auto":
        from mtaq.daemon.workers import auto_workers

        args.workers = auto_workers()  # a number: one recovery per worker and start is counted below
    elif not args.workers.isdigit() or not 1 <= int(args.workers) <= 16:
        ap.error("--workers: expected auto or 1..16")
    args.workers = int(args.workers)
    if args.messages < 1 or args.cycles < 0 or args.concurrency < 1:
        ap.error("--messages and --concurrency must be >= 1, --cycles >= 0")
    if not 0.0 <= args.kill_points <= 1.0:
        ap.error("--kill-points must be a fraction between 0 and 1")
    if not all(0.0 <= f <= 1.0 for f in (args.cut_fraction, args.recovery_kills, args.roll_kills)):
        ap.error("--cut-fraction, --recovery-kills and --roll-kills must be fractions between 0 and 1")
    if args.break_fsync and args.no_power_cut:
        ap.error("--break-fsync needs the power cut (a kill alone keeps unsynced writes)")
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
        # --defer-fraction: the sink defers this message's recipient once, so that it is concluded with a
        # replacement envelope and a DATA copy and retried (what an out-of-order power cut can split).
        rcpt = f"defer-{i}@sink.test" if rng.random() < args.defer_fraction else RECIPIENT
        work.append((mid, build_message(i, mid, rng.randint(200, args.size_max)), rcpt))
    # One kill point in each of K equal slices of the middle 90% of the messages finished.
    k = args.cycles
    kill_at = [int(n * (0.05 + 0.9 * (j + rng.random()) / k)) for j in range(k)] if k else []

    tally = Tally()
    sink: Proc | None = None
    daemon: Proc | None = None
    restarts: list[float] = []  # time.time() just before each restart was spawned
    kills_done = 0
    self_killed: Counter[str] = Counter()  # named kill point -> cycles in which the daemon died there
    cut_totals: Counter[str] = Counter()
    # Multi-run sequences: crashes cut or not, kills since the last cut that were not cut (their unsynced writes
    # are still in the page cache), and the k of the next recovery.append kill (the sweep).
    seq = {"cuts": 0, "kills_without_cut": 0, "cuts_after_uncut_kills": 0, "uncut_since_cut": 0,
           "recovery_kill_k": 1, "recovery_kill_k_max": 0, "recoveries_waited_for": 0,
           "cycles_after_sending": 0}
    fs_mode = "" if args.no_power_cut else ("powercut-nofsync" if args.break_fsync else "powercut")
    result: dict[str, object] = {}
    broken: list[str] = []
    configs_used: Counter[str] = Counter()
    damages: list[media.Damage] = []
    milter: subprocess.Popen[str] | None = None
    receiver: Receiver | None = Receiver(delay_s=0.3).start() if args.exporter else None  # slow: kills land while posting
    try:
        sink = start_sink(maildir, sink_log,
                          extra=["--defer-rcpt", "^defer-", "--defer-count", "1"] if args.defer_fraction else ())
        milter_address = ""
        if args.milter:
            with socket.socket() as free:
                free.bind(("127.0.0.1", 0))
                milter_port = free.getsockname()[1]
            milter = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "noop_milter.py"),
                 "--port", str(milter_port), "--mode", args.milter], stdout=subprocess.PIPE, text=True)
            assert milter.stdout is not None
            milter.stdout.readline()  # "noop_milter: listening on ..."
            milter_address = f"inet:127.0.0.1:{milter_port}"

        def write_config() -> str | None:
            """The daemon's config for its next start; with --vary-config, picked anew at every restart."""
            lines = []
            intervals = [args.retry_interval] if args.defer_fraction else None
            seg = args.segment_bytes
            if args.vary_config:
                # What an administrator may change between runs (issue 12.3): retry intervals added and
                # removed (runners merged and split), the segment size, the checkpoint interval.
                intervals = rng.choice([[1.0], [1.0, 2.0], [1.0, 2.0, 3.0], [2.0, 1.0]])
                seg = rng.choice([65536, 131072, 1 << 20])
                lines.append(f"checkpoint_interval_s = {rng.choice([0.2, 1.0, 5.0])}")
            if intervals:
                lines.append(f"retry_intervals_s = {intervals}")
            if seg:
                lines.append(f"segment_bytes_max = {seg}")
            if args.receive_buffer_bytes:
                lines.append(f"receive_buffer_bytes = {args.receive_buffer_bytes}")
            if args.header_checks:
                lines.append("header_checks = [" + ", ".join(f"'{r}'" for r in HEADER_CHECKS) + "]")
            if milter_address:
                lines.append(f'smtpd_milters = ["{milter_address}"]')
            if args.canonical_maps:
                table = os.path.join(work_dir, "canonical")
                with open(table, "w") as f:
                    f.write(CANONICAL_TABLE)
                os.chmod(table, 0o644)
                lines.append(f"canonical_maps = {json.dumps(table)}")
            if receiver is not None:
                if not args.vary_config:  # positions checkpointed often: kills land between checkpoints with
                    lines.insert(0, "checkpoint_interval_s = 0.5")  # batches in flight, which must be re-sent
                lines += ["[[event_webhooks]]", f'url = "{receiver.url}"', "batch_max = 20", "batch_wait_s = 0.05",
                          "retry_min_s = 0.2", "retry_max_s = 1.0", 'secret = "crash"']
            if not lines:
                return None
            configs_used[" ".join(lines)] += 1
            path = os.path.join(work_dir, "mtaq.toml")
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
            return path

        config = write_config()

        def spawn(kill_point: str | None) -> Proc:
            nonlocal config
            if args.vary_config and cut_totals["starts"]:
                config = write_config()
            cut_totals["starts"] += 1
            env = {"MTAQ_TEST_FS": fs_mode} if fs_mode else {}
            if kill_point == "recovery.append":
                k = seq["recovery_kill_k"]
                seq["recovery_kill_k_max"] = max(seq["recovery_kill_k_max"], k)
                env |= {"MTAQ_KILL_POINT": kill_point, "MTAQ_KILL_AFTER": str(k)}
            elif kill_point == "log.roll":
                env |= {"MTAQ_KILL_POINT": kill_point, "MTAQ_KILL_AFTER": str(rng.randint(1, 3))}
            elif kill_point:
                env |= {"MTAQ_KILL_POINT": kill_point, "MTAQ_KILL_AFTER": str(rng.randint(1, 20))}
            # No admin API: the harness does not use it, and a restart is then over when SMTP listens (the
            # API starts after SMTP; waiting for it too would let the sending run ahead of the crash cycles).
            return start_daemon(spool, sink.port, daemon_log, port=port, config=config, env=env, admin_listen="",
                                workers=args.workers)

        def power_cut() -> None:
            """The power cut after a crash, or (--cut-fraction) not: then the unsynced writes stay in the page
            cache, and the ledger keeps them droppable by the cut of a later cycle."""
            if not fs_mode:
                return
            if args.cut_fraction < 1.0 and rng.random() >= args.cut_fraction:
                seq["kills_without_cut"] += 1
                seq["uncut_since_cut"] += 1
                return
            cut_totals.update(powercut.cut(spool, reorder=rng if args.reorder else None))
            seq["cuts"] += 1
            if seq["uncut_since_cut"]:
                seq["cuts_after_uncut_kills"] += 1
            seq["uncut_since_cut"] = 0

        def crash(proc: Proc) -> None:
            """The crash itself: SIGKILL (if it is not dead already), then the power cut (or not, see
            --cut-fraction), then (with --media-damage) a bit flip or a zeroed sector in a sealed segment or
            the checkpoint."""
            proc.kill9()
            power_cut()
            if args.media_damage and rng.random() < args.media_damage:
                d = media.damage(spool, rng)
                if d is not None:
                    damages.append(d)

        def next_point() -> str | None:
            """The kill point of the next start: recovery.append (--recovery-kills), log.roll (--roll-kills),
            a named point (--kill-points), or none."""
            if args.recovery_kills and rng.random() < args.recovery_kills:
                return "recovery.append"
            if args.roll_kills and rng.random() < args.roll_kills:
                return "log.roll"
            return rng.choice(killpoints.POINTS) if rng.random() < args.kill_points else None

        port = free_port()
        daemon = spawn(None)

        def recovered() -> int:
            """recovery_complete events in the daemon log so far (one per worker and start)."""
            try:
                with open(daemon_log, "rb") as f:
                    return f.read().count(b'"event":"recovery_complete"')
            except FileNotFoundError:
                return 0

        def let_recover(before: int) -> None:
            """Progress: after RECOVERY_KILLS_MAX starts in a row were crashed before their recovery
            completed (a recovery that scans every segment, its checkpoint damaged, can take longer than a
            slice; killed every time it would never write the checkpoint that shortens the next one), the
            crash waits until this start's recovery completes, the daemon dies, or RECOVERY_WAIT_S pass."""
            deadline = time.monotonic() + RECOVERY_WAIT_S
            while (daemon is not None and daemon.alive() and recovered() < before + args.workers
                   and time.monotonic() < deadline and not tally.abort.is_set()):
                time.sleep(0.05)

        def killer() -> None:
            nonlocal daemon, kills_done
            point: str | None = None
            unrecovered = 0  # starts in a row crashed before their recovery completed
            recs_before = 0  # recovery_complete events before the current start
            for at in kill_at:
                with tally.cond:
                    while (tally.finished < at and not tally.abort.is_set() and tally.finished < n
                           and (daemon is None or daemon.alive())):
                        tally.cond.wait(0.05)
                    if tally.abort.is_set():
                        return
                    sending_done = tally.finished >= n
                if sending_done:
                    if not args.cycles_after_sending:
                        break
                    # The sending ended first: this cycle crashes the draining daemon after a random while.
                    end = time.monotonic() + rng.uniform(0.3, 2.0)
                    while daemon is not None and daemon.alive() and time.monotonic() < end:
                        time.sleep(0.02)
                    seq["cycles_after_sending"] += 1
                assert daemon is not None
                if not daemon.alive():
                    if point is None:
                        with tally.cond:
                            tally.errors.append(f"daemon exited by itself with status {daemon.popen.returncode}")
                    else:
                        self_killed[point] += 1
                if point == "recovery.append":  # the sweep: one append further, or from the first again
                    seq["recovery_kill_k"] = 1 if daemon.alive() else seq["recovery_kill_k"] + 1
                if unrecovered >= RECOVERY_KILLS_MAX and point != "recovery.append":
                    let_recover(recs_before)
                    seq["recoveries_waited_for"] += 1
                unrecovered = unrecovered + 1 if recovered() < recs_before + args.workers else 0
                crash(daemon)
                kills_done += 1
                restarts.append(time.time())
                point = next_point()
                for _ in range(20):  # a daemon told to die during recovery may be dead before it listens
                    try:
                        recs_before = recovered()
                        daemon = spawn(point)
                        break
                    except RuntimeError as exc:
                        if point is None:
                            with tally.cond:
                                tally.errors.append(f"restart {kills_done} failed: {exc}")
                            tally.abort.set()
                            return
                        # It died at its point before it was seen listening (a crash during recovery).
                        self_killed[point] += 1
                        power_cut()
                        kills_done += 1
                        restarts.append(time.time())
                        point = None
            # After the last cycle the daemon runs without a kill point, so that it can drain.
            if daemon is not None and (point is not None or not daemon.alive()):
                if not daemon.alive() and point is not None:
                    self_killed[point] += 1
                crash(daemon)
                restarts.append(time.time())
                daemon = spawn(None)

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
            broken.append(f"only {kills_done} of {k} crash cycles happened"
                          + ("" if args.cycles_after_sending else " during sending"))
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
        starts = cut_totals.pop("starts", 0)
        killed_during_recovery = starts * args.workers - len(recs)  # one recovery per worker and start
        if killed_during_recovery < 0:
            broken.append(f"{len(recs)} recovery_complete events for {starts} starts")

        lost_ids = sorted(acked - delivered.keys())
        # --media-damage: a message whose records were in damaged bytes may be lost, but only if the damage
        # was reported (corrupt_record over those bytes, or an error naming its queue ID) and, where its
        # envelope survived, bounced. Anything else lost is lost.
        reported_events = [e for e in events if e.get("event") in (
            "corrupt_record", "corrupt_record_known", "corrupt_message", "corrupt_envelope", "parked_unreadable")]

        def reported(d: media.Damage) -> bool:
            return any((e.get("segment") == d.segment and e.get("offset", 0) < d.end and d.start < e.get("end", 0))
                       or e.get("queue_id") in d.queue_ids for e in reported_events)

        excusable = {q for d in damages if reported(d) for q in d.queue_ids}
        lost_damaged = [m for m in lost_ids if queue_id_of(tally.acked[m]) in excusable]
        unreported = [d for d in damages if not reported(d)
                      and any(queue_id_of(tally.acked[m]) in d.queue_ids for m in lost_ids)]
        lost_ids = [m for m in lost_ids if m not in lost_damaged]
        # DSNs (sent to the client's sender, relayed to the sink): per original queue ID and recipient, the
        # distinct DSN messages that report its failure. Two for one failure is a DSN twice; the same DSN
        # delivered twice (one Message-ID) is an in-flight duplicate, not that.
        reports = dsn_reports(maildir)
        failed_dsns: dict[tuple[str, str], set[str]] = {}
        for rep in reports:
            for rcpt, action in rep.rows:
                if action == "failed":
                    failed_dsns.setdefault((rep.queue_id, rcpt.lower()), set()).add(rep.message_id)
        bounced_qids = {q for q, _r in failed_dsns}
        acked_qids = {queue_id_of(r) for r in tally.acked.values()} - {""}
        dsn_twice = sorted(k for k, v in failed_dsns.items() if len(v) > 1)
        failed_reports = {rep.message_id: rep for rep in reports if any(a == "failed" for _r, a in rep.rows)}
        delivered_qids = {queue_id_of(tally.acked[m]) for m in acked if m in delivered}
        not_delivered = acked - delivered.keys()
        bounced_acked = [m for m in not_delivered if queue_id_of(tally.acked[m]) in bounced_qids]
        silently_ended = [m for m in lost_ids if queue_id_of(tally.acked[m]) not in bounced_qids]
        damaged_no_dsn = [m for m in lost_damaged if queue_id_of(tally.acked[m]) not in bounced_qids]
        dsn_ids = dsn_message_ids(maildir)
        truncated = truncated_copies(maildir, {mid: rewritten(data, args.header_checks, args.canonical_maps)
                                               for mid, data, _r in work})
        envelope_wrong = (envelope_not_rewritten(maildir, {mid: canonical_rcpt(r) for mid, _d, r in work})
                          if args.canonical_maps else [])
        if envelope_wrong:
            broken.append(f"{len(envelope_wrong)} copies without the canonical envelope, e.g. {envelope_wrong[:3]}")
        dup_ids = sorted(m for m, c in delivered.items() if c > 1)
        unknown_qids = {e.get("queue_id") for e in events if e.get("event") == "outcome_unknown"}
        dup_unexplained = [m for m in dup_ids if tally.submissions[m] == 1 and m in tally.acked
                           and queue_id_of(tally.acked[m]) not in unknown_qids]
        unacked_delivered = sorted(m for m in delivered if m not in acked and m not in dsn_message_ids(maildir))
        exporter: dict[str, object] = {}
        if receiver is not None:
            # Every acknowledged message: its received event and an outcome (delivered, bounced, expired) at
            # the receiver, at least once, within the drain time left (the exporter may lag the deliveries).
            acked_q = {queue_id_of(tally.acked[m]) for m in acked} - {""}
            outcomes = ("delivered", "bounced", "expired")

            def missing() -> list[str]:
                seen: dict[str, set[str]] = {}
                for e in receiver.events():
                    seen.setdefault(e["queue_id"], set()).add(e["event"])
                return sorted(q for q in acked_q
                              if "received" not in seen.get(q, set()) or not seen.get(q, set()) & set(outcomes))

            wait_end = max(deadline, time.monotonic() + 90)
            gone = missing()
            while gone and time.monotonic() < wait_end:
                time.sleep(0.25)
                gone = missing()
            ids = [e["id"] for e in receiver.events()]
            exporter = {"events_lost": len(gone), "events_received": len(ids), "events_unique": len(set(ids)),
                        "events_duplicated": len(ids) - len(set(ids)), "posts": len(receiver.posts),
                        "posts_unsigned_or_bad": sum(1 for p in receiver.posts if not p.signed_by("crash"))}
            if gone:
                broken.append(f"{len(gone)} acknowledged messages without their events, e.g. {gone[:3]}")
        sent_ids = {w[0] for w in work}
        stray = [m for m in delivered if m not in sent_ids and m not in dsn_ids]
        if stray:
            broken.append(f"{len(stray)} delivered Message-IDs were never sent, e.g. {stray[:3]}")
        result = {
            "messages": n,
            "acknowledged": len(acked),
            "delivered_unique": len(delivered),
            "lost": len(lost_ids),
            "silently_ended": len(silently_ended),
            "bounced_acknowledged": len(bounced_acked),
            "bounced_undamaged": len([m for m in bounced_acked if m not in lost_damaged]),
            "dsn_twice": len(dsn_twice),
            "dsns_failed": len(failed_reports),
            "dsns_for_unacknowledged": sum(1 for r in failed_reports.values() if r.queue_id not in acked_qids),
            "dsns_for_delivered": sum(1 for r in failed_reports.values() if r.queue_id in delivered_qids),
            "dsns_delayed": sum(1 for r in reports if any(a == "delayed" for _r, a in r.rows)),
            "lost_in_reported_damage": len(lost_damaged),
            "lost_in_reported_damage_without_dsn": len(damaged_no_dsn),
            "media_damage": [f"{d.kind} {os.path.basename(d.path)}:{d.start}" for d in damages],
            "media_damage_unreported": len(unreported),
            "truncated": len(truncated),
            "canonical_maps": bool(args.canonical_maps),
            "envelope_not_rewritten": len(envelope_wrong),
            "duplicated": len(dup_ids),
            "duplicated_resubmitted": sum(1 for m in dup_ids if tally.submissions[m] > 1),
            "duplicated_unexplained": len(dup_unexplained),
            "unacked_delivered": len(unacked_delivered),
            "gave_up": tally.gave_up,
            "failed_tries": tally.failed_tries,
            "cycles": kills_done,
            "self_killed_at": dict(sorted(self_killed.items())),
            "power_cut": fs_mode or "off",
            "reorder": bool(args.reorder),
            "configs": len(configs_used) if args.vary_config else 0,
            "workers": args.workers,
            "cut_fraction": args.cut_fraction,
            "cuts": seq["cuts"],
            "kills_without_cut": seq["kills_without_cut"],
            "cuts_after_uncut_kills": seq["cuts_after_uncut_kills"],
            "recovery_kills_k_max": seq["recovery_kill_k_max"],
            "recoveries_waited_for": seq["recoveries_waited_for"],
            "cycles_after_sending": seq["cycles_after_sending"],
            "power_cut_bytes_dropped": cut_totals["bytes_dropped"],
            "power_cut_files_removed": cut_totals["files_removed"],
            "killed_during_recovery": max(0, killed_during_recovery),
            "seed": seed,
            "verify_ok": verify_ok,
            "recovery_seconds_max": max(rec_s) if rec_s else None,
            "restart_to_recovered_s_max": round(max(wall), 4) if wall else None,
            "outcome_unknown": sum(1 for e in events if e.get("event") == "outcome_unknown"),
            "drain_s": round(drain_s, 2),
            **exporter,
            "elapsed_s": round(time.monotonic() - t0, 2),
        }
        if broken:
            result["errors"] = broken
        if lost_ids:
            _report_lost(lost_ids, tally, daemon_log, spool, seed)
        for (qid, rcpt), mids in dsn_twice[:5]:
            print(f"crash: DSN twice: {len(mids)} failure DSNs for queue ID {qid} recipient {rcpt}: {sorted(mids)}",
                  file=sys.stderr)
        for m in dup_unexplained[:5]:
            qid = queue_id_of(tally.acked[m])
            print(f"crash: duplicated without outcome_unknown: {m} queued as {qid}", file=sys.stderr)
            for e in events:
                if e.get("queue_id") == qid or e.get("dsn_for") == qid:
                    print(f"crash:   {json.dumps(e)}", file=sys.stderr)
    except Exception as exc:
        # A harness error names where it happened (the last frame) and prints its traceback: an error
        # that is not reproduced alone must still say where to look.
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        broken.append(f"{type(exc).__name__}: {exc}{where}")
        traceback.print_exc(file=sys.stderr)
        result = {"messages": n, "cycles": kills_done, "seed": seed, "errors": broken,
                  "elapsed_s": round(time.monotonic() - t0, 2)}
    finally:
        tally.abort.set()
        for p in (daemon, sink):
            if p is not None:
                p.kill9()
        if milter is not None:
            milter.kill()
            milter.wait()
        if receiver is not None:
            receiver.stop()
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(result), flush=True)
    # With media damage the log is damaged on purpose: verify must name it (exit 1); what counts is that
    # every damage that cost a message was reported.
    log_ok = result.get("verify_ok") is True or (bool(damages) and result.get("media_damage_unreported") == 0)
    ok = (result.get("lost") == 0 and result.get("truncated") == 0 and result.get("dsn_twice") == 0 and log_ok
          and not broken)
    return 0 if ok else 1


@dataclass
class DsnReport:
    """One DSN the sink received: its own Message-ID, the queue ID of the message it reports on
    (``X-Mtaq-Queue-ID``) and its (Final-Recipient address, Action) rows."""

    message_id: str
    queue_id: str
    rows: list[tuple[str, str]]


_DSN_QID_RE = re.compile(rb"^X-Mtaq-Queue-ID: *(\S+)", re.MULTILINE)
_DSN_ROW_RE = re.compile(rb"^Final-Recipient: *[A-Za-z0-9-]+; *([^\r\n]+)\r?\n(?:[ \t][^\r\n]*\r?\n)*Action: *(\w+)",
                         re.MULTILINE)


def dsn_reports(maildir: str) -> list[DsnReport]:
    """Every DSN in the Maildir (from the null sender, ``Return-Path: <>``), once per file (a DSN delivered
    twice is two entries with one Message-ID)."""
    out = []
    for sub in ("new", "cur"):
        d = os.path.join(maildir, sub)
        for name in os.listdir(d) if os.path.isdir(d) else []:
            with open(os.path.join(d, name), "rb") as f:
                content = f.read()
            head = content.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            if not any(line.lower() in (b"return-path: <>", b"return-path: <<>>") for line in head):
                continue
            mid = next((line.split(b":", 1)[1].strip().decode(errors="replace") for line in head
                        if line.lower().startswith(b"message-id:")), name)
            m = _DSN_QID_RE.search(content)
            rows = [(r.decode(errors="replace").strip(), a.decode().lower()) for r, a in _DSN_ROW_RE.findall(content)]
            out.append(DsnReport(mid, m.group(1).decode(errors="replace") if m else "", rows))
    return out


def dsn_message_ids(maildir: str) -> set[str]:
    """Message-IDs of the DSNs in the Maildir (sent from the null sender: ``Return-Path: <>``)."""
    out = set()
    for sub in ("new", "cur"):
        d = os.path.join(maildir, sub)
        for name in os.listdir(d) if os.path.isdir(d) else []:
            with open(os.path.join(d, name), "rb") as f:
                head = f.read(8192).split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            if any(line.lower() in (b"return-path: <>", b"return-path: <<>>") for line in head):
                out |= {line.split(b":", 1)[1].strip().decode(errors="replace") for line in head
                        if line.lower().startswith(b"message-id:")}
    return out


# --header-checks: what every message goes through (its Message-ID, which tells messages apart, is kept)
HEADER_CHECKS = ("/^Subject:/ PREPEND X-Checked: crash", "/^Date:/ IGNORE", "/^To:/ REPLACE To: <rewritten@example.net>")


# --canonical-maps: the sender, the recipients' domain and header_checks' To: domain are rewritten (a defer-N
# local part is kept, so that the sink still defers it once)
CANONICAL_TABLE = (f"{SENDER}  crash-canonical-sender@client.test\n"
                   "@sink.test  @canonical.sink.test\n"
                   "@example.net  @canonical.example.net\n")


def canonical_rcpt(rcpt: str) -> str:
    """A recipient as :data:`CANONICAL_TABLE` rewrites it."""
    return rcpt.rpartition("@")[0] + "@canonical.sink.test"


def rewritten(data: bytes, header_checks: bool = True, canonical: bool = False) -> bytes:
    """``data`` as the daemon's header_checks (:data:`HEADER_CHECKS`) and then canonical_maps
    (:data:`CANONICAL_TABLE`) rewrite it, each when on: what a faithful copy ends with."""
    import tempfile

    from mtaq.edge.canonical import CLASSES, Canonical
    from mtaq.edge.headerchecks import HeaderChecks

    head, _sep, rest = data.partition(b"\r\n\r\n")
    head += b"\r\n"
    if header_checks:
        out = HeaderChecks.from_config(list(HEADER_CHECKS)).apply(head)
        head = out.head if out.head is not None else head
    if canonical:
        with tempfile.NamedTemporaryFile("w", suffix=".canonical") as f:
            f.write(CANONICAL_TABLE)
            f.flush()
            c = Canonical.from_config(canonical_maps=f.name, sender_canonical_maps="", recipient_canonical_maps="",
                                      canonical_classes=list(CLASSES), myhostname="localhost", myorigin="")
        assert c is not None
        head = c.head(head) or head
    return head + b"\r\n" + rest


def envelope_not_rewritten(maildir: str, rcpt_of: dict[str, str]) -> list[str]:
    """Message-IDs of delivered copies (DSNs aside) whose envelope, as the sink wrote it (Return-Path,
    Delivered-To), is not the canonical sender and ``rcpt_of[Message-ID]``."""
    want_from = b"return-path: <crash-canonical-sender@client.test>"
    bad = []
    for sub in ("new", "cur"):
        d = os.path.join(maildir, sub)
        for name in os.listdir(d) if os.path.isdir(d) else []:
            with open(os.path.join(d, name), "rb") as f:
                head = f.read(8192).split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            if any(line.lower() in (b"return-path: <>", b"return-path: <<>>") for line in head):
                continue
            mid = next((line.split(b":", 1)[1].strip().decode(errors="replace") for line in head
                        if line.lower().startswith(b"message-id:")), name)
            rcpts = [line.split(b":", 1)[1].strip().decode() for line in head if line.startswith(b"Delivered-To:")]
            if head[0].lower() != want_from or rcpts != [rcpt_of.get(mid, "?")]:
                bad.append(mid)
    return bad


def truncated_copies(maildir: str, sent: dict[str, bytes]) -> list[str]:
    """Message-IDs of delivered copies whose content does not end with the bytes the client sent.

    The sink stores ``Delivered-To`` lines (and the relay may add trace headers) before the message, so a
    faithful copy *ends with* what was sent; a cut-off or altered body does not.
    """
    bad = []
    for sub in ("new", "cur"):
        d = os.path.join(maildir, sub)
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            with open(os.path.join(d, name), "rb") as f:
                content = f.read()
            mid = ""
            head = content.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            if any(line.lower() in (b"return-path: <>", b"return-path: <<>>") for line in head):
                continue  # a DSN mtaq sent (a bounce of damaged data): not one of the client's messages
            for line in head:
                if line.lower().startswith(b"message-id:"):
                    mid = line.split(b":", 1)[1].strip().decode(errors="replace")
                    break
            if mid not in sent or not content.endswith(sent[mid]):
                bad.append(mid or name)
    return bad


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
