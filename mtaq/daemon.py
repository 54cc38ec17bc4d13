"""``mtaq serve``: open the log, listen for SMTP at once, recover, then deliver.

There is no shutdown code (crash-only): SIGTERM and SIGKILL both simply end the process, and the next start
is a recovery. The one deliberate exit is after a failed fsync (GUIDE I6): everyone waiting on that commit
has been answered 451, and the process exits with status 75 (EX_TEMPFAIL) so that recovery re-reads the disk.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from mtaq.config import Config, parse_hostport, parse_relayhost
from mtaq.core.records import EnvelopeRecord, Outcome
from mtaq.core.state import Message, RetryPolicy, format_reply
from mtaq.delivery.relay import RelayConnection, classify
from mtaq.edge.server import QueueHandler, start_server
from mtaq.errors import CorruptRecord, StorageError, StorageFatal
from mtaq.logs import get_logger
from mtaq.queue import Queue
from mtaq.recovery import recover
from mtaq.runners import Scheduler
from mtaq.storage.fs import OsFileSystem
from mtaq.storage.log import Log

__all__ = ["Daemon", "serve"]

EXIT_FSYNC_FAILED = 75
EXIT_SOFTWARE = 70  # an unexpected exception in a daemon task: crash, recovery will pick up
_EVENT_OF = {"delivered": "delivered", "deferred": "deferred", "failed": "bounced"}
_STATUS_OF = {"delivered": "sent", "deferred": "deferred", "failed": "bounced"}


class Daemon:
    """The running relay: one log, one SMTP listener, ``delivery_concurrency`` delivery workers."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = get_logger()
        self.relayhost = parse_relayhost(cfg.relayhost)
        self.counts = {"delivered": 0, "deferred": 0, "failed": 0}
        self._live_scheduled: set[str] | None = set()  # queued while recovery runs
        self.ready = asyncio.Event()

    def _on_durable(self, env: EnvelopeRecord) -> None:
        self.log.info(
            "queued",
            queue_id=env.queue_id,
            sender=env.sender,
            size=env.size,
            nrcpt=len(env.recipients),
            client=env.client,
        )
        self.scheduler.add(env.queue_id, env.not_before_ts, incoming=True)
        if self._live_scheduled is not None:
            self._live_scheduled.add(env.queue_id)

    def _on_fatal(self, exc: StorageFatal) -> None:
        self.log.critical("storage_fatal", error=str(exc), exit_status=EXIT_FSYNC_FAILED)
        # Let the 451 replies reach the clients, then exit without touching the disk again.
        asyncio.get_running_loop().call_later(0.2, os._exit, EXIT_FSYNC_FAILED)

    async def run(self) -> None:
        cfg = self.cfg
        t_start = time.monotonic()
        log_dir = os.path.join(cfg.spool_dir, "log")
        qlog, report = Log.open(OsFileSystem(), log_dir, segment_bytes_max=cfg.segment_bytes_max)
        qlog.on_fatal.append(self._on_fatal)
        self.queue = Queue(qlog, policy=RetryPolicy(intervals_s=tuple(cfg.retry_intervals_s)))
        self.scheduler = Scheduler()
        self.queue.on_durable = self._on_durable
        host, port = parse_hostport(cfg.listen)
        handler = QueueHandler(self.queue)
        self.server = await start_server(
            handler,
            host,
            port,
            hostname=cfg.hostname(),
            data_size_limit=cfg.message_size_limit_bytes,
            timeout_s=cfg.smtp_server_timeout_s,
        )
        self.log.info(
            "listening",
            listen=cfg.listen,
            spool=cfg.spool_dir,
            relayhost=str(self.relayhost),
            segment=report.new_segment,
            seconds=round(time.monotonic() - t_start, 4),
        )
        res = await recover(self.queue, report, self.log)
        live = self._live_scheduled or set()
        self._live_scheduled = None
        for msg in self.queue.state.messages.values():
            if msg.queue_id not in live and not msg.active:
                self.scheduler.add(msg.queue_id, msg.envelope.not_before_ts, incoming=msg.envelope.attempts == 0)
        self.log.info(
            "recovery_complete",
            seconds=round(res.seconds, 4),
            records=res.records,
            segments=res.segments,
            bytes=res.bytes,
            concluded=res.concluded,
            outcome_unknown=len(res.unknown),
            corrupt=len(res.corrupt),
            queued=len(self.queue.state.messages),
        )
        workers = [
            asyncio.create_task(self._worker(i)) for i in range(cfg.delivery_concurrency)
        ]
        if cfg.stats_interval_s > 0:
            workers.append(asyncio.create_task(self._stats()))
        self.ready.set()
        await asyncio.gather(*workers)

    async def _worker(self, n: int) -> None:
        conn = RelayConnection(self.relayhost, helo_name=self.cfg.hostname(), timeout_s=self.cfg.smtp_timeout_s)
        while True:
            qid = await self.scheduler.get()
            msg = self.queue.state.messages.get(qid)
            if msg is None or msg.active:
                continue
            try:
                await self._attempt(msg, conn)
            except StorageFatal:
                return  # the process is exiting
            except Exception as exc:
                # A full disk, a read error, or a bug: never leave the message active and forgotten.
                self.log.exception("delivery_attempt_failed", queue_id=qid, error=str(exc))
                self._abandon(msg)

    def _abandon(self, msg: Message) -> None:
        """End a failed attempt: conclude with what is known (the rest is 'unknown'), retry in a minute."""
        retry_at = time.time() + 60.0
        if msg.active:
            try:
                self.queue.conclude(msg)
            except StorageFatal:
                return
            except StorageError:
                # Not even book-keeping can be written: forget the attempt in memory only; the START in
                # the log stays open, and the next recovery concludes it.
                msg.start_pos = None
                msg.outcomes = {}
        if msg.queue_id in self.queue.state.messages:
            self.scheduler.add(msg.queue_id, retry_at, incoming=False)

    async def _attempt(self, msg: Message, conn: RelayConnection) -> None:
        q = self.queue
        env = msg.envelope
        try:
            body = q.read_body(msg)
        except CorruptRecord as exc:
            # Postfix moves such a file to its corrupt queue; until mtaq has one (and admin commands),
            # the message stays queued, is not retried, and is reported at every start.
            self.log.error("corrupt_message", queue_id=msg.queue_id, error=str(exc), action="held, not retried")
            return
        q.start(msg.queue_id)
        rcpts = env.recipients
        replies = await conn.send(env.sender, [r.address for r in rcpts], body)
        relay = conn.name
        outcomes = [
            Outcome(index=r.index, status=classify(rep.code), code=rep.code, enhanced=rep.enhanced, text=rep.text)  # type: ignore[arg-type]
            for r, rep in zip(rcpts, replies, strict=True)
        ]
        await q.record_outcomes(msg, relay, outcomes)  # durable before the recipients count as done
        delay = round(time.time() - env.arrival_ts, 3)
        for r, o in zip(rcpts, outcomes, strict=True):
            self.counts[o.status] += 1
            getattr(self.log, "info" if o.status == "delivered" else "warning")(
                _EVENT_OF[o.status],
                queue_id=msg.queue_id,
                recipient=r.address,
                relay=relay,
                delay=delay,
                dsn=o.enhanced,
                status=_STATUS_OF[o.status],
                reply=format_reply(o),
                attempt=env.attempts + 1,
            )
        rec = q.conclude(msg)
        if isinstance(rec, EnvelopeRecord):
            self.scheduler.add(msg.queue_id, rec.not_before_ts, incoming=False)
        else:
            self.log.info("removed", queue_id=msg.queue_id)

    async def _stats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.stats_interval_s)
            st = self.queue.log.stats
            self.log.info(
                "stats",
                received=self.queue.received,
                delivered=self.counts["delivered"],
                deferred=self.counts["deferred"],
                bounced=self.counts["failed"],
                records=st.records_appended,
                bytes=st.bytes_appended,
                commit_rounds=st.commit_rounds,
                fsync_calls=st.fsync_calls,
                fsync_seconds=round(st.fsync_seconds, 4),
                **{f"queue_{k}": v for k, v in self.queue.state.counts().items()},
            )


async def _run_or_crash(daemon: Daemon) -> None:
    """Run the daemon; any unexpected exception ends the process at once (crash-only: no half-alive state)."""
    try:
        await daemon.run()
    except (OSError, StorageError, KeyboardInterrupt, asyncio.CancelledError):
        raise  # start-up failures (a one-line error from the CLI), Ctrl-C
    except BaseException:
        daemon.log.exception("daemon_crashed", exit_status=EXIT_SOFTWARE)
        os._exit(EXIT_SOFTWARE)


def serve(cfg: Config) -> None:
    """Run the daemon until the process is killed."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    runner(_run_or_crash(Daemon(cfg)))
