"""``mtaq serve``: open the log, listen for SMTP at once, recover, then run the queue runners and deliver.

There is no shutdown code (crash-only): SIGTERM and SIGKILL both simply end the process, and the next start
is a recovery. The deliberate exits are after a failed fsync (GUIDE I6), where everyone waiting on that
commit has been answered 451 and the status is 75 (EX_TEMPFAIL), and after an unexpected exception in a
daemon task (status 70). In both cases recovery re-reads the disk.

Every ``checkpoint_interval_s`` the restart positions are taken, the log is fsync'd, the checkpoint is
written (seed 001), and then every segment wholly before the point where true garbage ends is deleted
(reclamation). That point is the earliest of the runner positions and of the envelopes of attempts still
in the working set. With ``archive_dir`` set, the segments are first copied into the archive by a
background task (the copying runs in a thread): the queue, and the checkpoints, never wait for it. A
segment whose copy fails is kept, with an ``archive_failed`` event, and tried again after the next
checkpoint; only the archived prefix is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import importlib
import os
import resource
import signal
import socket
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from mtaq.admin.metrics import Metrics
from mtaq.config import Config, listeners_of, parse_hostport
from mtaq.core.bounce_class import Rules, default_rules
from mtaq.core.bounce_class import classify as classify_bounce
from mtaq.core.checkpoint import Checkpoint
from mtaq.core.errors import CorruptRecord, MtaqError, StorageError, StorageFatal
from mtaq.core.frame import Problem
from mtaq.core.records import EnvelopeRecord, Outcome, Pos
from mtaq.core.state import Attempt, DsnItem, RetryPolicy, format_reply
from mtaq.daemon import privileges
from mtaq.daemon.anvil import AnvilClient
from mtaq.daemon.check import check_start
from mtaq.daemon.check import problems as check_problems
from mtaq.daemon.reload import ReloadResult, changed_keys, unreadable_files
from mtaq.daemon.workers import (
    admin_socket,
    bind_listeners,
    shard_count,
    shard_dir,
    supervise,
    worker_anvil_socket,
    workers_wanted,
)
from mtaq.delivery.backoff import Destinations
from mtaq.delivery.classify import load_rules
from mtaq.delivery.relay import Reply, classify
from mtaq.delivery.routing import Router
from mtaq.delivery.sasl import SaslClient
from mtaq.delivery.security import forget_contexts
from mtaq.delivery.throttle import DomainLimit, Slots, Throttle
from mtaq.delivery.transport import Batch, ConnectionPool, HopFailure, deliver
from mtaq.delivery.verify import VERIFY_CACHE_FILE, Verifier, VerifySettings, make_prober
from mtaq.edge.canonical import Generic
from mtaq.edge.dkim import Signer
from mtaq.edge.limits import ConnectionGate, Gate
from mtaq.edge.milter import STATS as milter_stats
from mtaq.edge.pickup import Pickup
from mtaq.edge.policy import EdgePolicy
from mtaq.edge.server import EdgeSettings, QueueHandler, connection_gate, gate_limits, start_server
from mtaq.logs import configure_logging, get_logger
from mtaq.queue.recovery import move_aside, recover
from mtaq.queue.runners import RUNNER_READ_RETRY_S, Declined, Dispatcher, Offer, Runner
from mtaq.queue.store import Queue, StoredBody, set_queue_id_shard
from mtaq.storage.archive import ArchiveError, SegmentArchive
from mtaq.storage.checkpoint import write_checkpoint
from mtaq.storage.fs import FileSystem, OsFileSystem, make_durable_dirs
from mtaq.storage.log import FILES_OPEN_MAX, RESERVE_BYTES, Log, release_reserve, segment_path
from mtaq.storage.sharedmap import SharedMap
from mtaq.storage.spill import set_spill_files_max
from mtaq.testing import killpoints, powercut

if TYPE_CHECKING:  # imported when needed, not before the first 250 (issue 15.6)
    from mtaq.admin.http import AdminHttp
    from mtaq.delivery.peers import PeerPolicy

__all__ = ["FILES_RESERVED", "Daemon", "open_files_needed", "raise_open_files_limit", "serve"]

PARKED_COPIES_MAX = 1000  # parked envelopes copied forward per checkpoint (each: its DATA and envelope)
GC_THRESHOLDS = (20_000, 20, 20)  # gc.set_threshold: collect the young generation every 20,000 allocations
RUNNER_WAKE_S = 0.01
"""Seconds after the durable end of the log moves before the queue runners are woken (Log.durable_wake_s):
the SMTP client whose message was just acknowledged gets the reply to its next command (QUIT, or MAIL of its
next message) before the delivery of that message takes the event loop, and the runners take the messages
of several commit rounds in one pass, whose delivery records then share fsyncs. A message's delivery starts
up to this much later. 10 ms rather than 1 (docs/performance.md, sixth round of issue 15): at one session a message
took 16 % less CPU and the rate rose 10 %; 50 ms made it worse (bursts of deliveries held up the sessions)."""
COMMIT_SPACING_S = 0.006
"""Seconds from the start of one commit round to the start of the next while two or more clients wait for
their 250 at once (Log.round_spacing_s): under load one fsync covers several times as many messages, and
each round's fsync costs CPU whatever it covers. A lone client (one session) never waits for it; the 250
waits at most this much longer. 10 ms until stop 48: on a CPU-bound 2-core machine, at 20 sessions with one
worker, fsyncs per message fell from 0.40 to 0.20 with 6 ms and 0.13 with 10 ms, CPU per message by about a
tenth and then 3 % more (docs/performance.md, seventh round of issue 15). On a machine where the relay
does not fill the cores, 10 ms was a wait with nothing to do: 6 ms against 10 ms, alternating, 3 pairs, 20
sessions of 2 KiB, 2 workers: 1,622-1,843 msg/s against 1,414-1,544 (+18 %, CPU a message +4-8 %); 100 KiB:
846-905 against 875-927 (-2 %); 4 ms and 2 ms were slower again (docs/performance.md, "Stop 48")."""
FILES_RESERVED = 100
SASL_HOLD_FILE = "sasl_hold"  # in the spool: the host's outbound SASL holds (mtaq.storage.sharedmap)
"""Descriptors a worker needs besides its SMTP connections, its deliveries and the log's readers: listening
sockets, the log's files being written, the admin API, the anvil, pidfds, DNS, temporary files of messages."""
EXIT_FSYNC_FAILED = 75
IMPORT_SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval while the admin API is imported beside SMTP
EXIT_SOFTWARE = 70  # an unexpected exception in a daemon task: crash, recovery will pick up
BACKLOG_PER_WORKER = 50
"""Started attempts held back per delivery worker while their destination is full (a slow or backed-off
next hop, a domain at its concurrency limit) before the workers stop taking new mail: they wait instead,
as Postfix's qmgr stops reading the queue when its active queue is full (qmgr_message_active_limit)."""
_EVENT_OF = {"delivered": "delivered", "deferred": "deferred", "failed": "bounced"}
_STATUS_OF = {"delivered": "sent", "deferred": "deferred", "failed": "bounced"}


@dataclass(slots=True)
class _Pending:
    """A started attempt waiting for its destinations: the recipient ``domains`` (Throttle) and next hops
    ``dests`` (Destinations) of its SMTP recipients."""

    attempt: Attempt
    body: bytes | StoredBody | None
    problem: str
    domains: list[str]
    dests: list[str]


def dead_time_s(cfg: Config) -> float:
    """How long a dead destination is suspended: ``smtp_destination_dead_s``, never longer than half the
    first retry interval (the mail it defers is then tried for real at its next retry; Postfix's dead time,
    minimal_backoff_time, is never longer than its shortest retry either)."""
    return min(cfg.smtp_destination_dead_s, cfg.retry_intervals_s[0] / 2)


def _destinations(cfg: Config, report: Callable[[str, dict[str, Any]], None],
                  monotonic: Callable[[], float]) -> Destinations:
    return Destinations(cfg.destination_concurrency_limit,
                        {d: v.concurrency for d, v in cfg.destination_limits.items()},
                        dead_s=dead_time_s(cfg), failed_cohort_limit=cfg.destination_concurrency_failed_cohort_limit,
                        clock=monotonic, report=report)


class Daemon:
    """The running relay: one log, its SMTP listeners, the runners, ``delivery_concurrency`` workers."""

    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, listen_sockets: list[list[socket.socket]] | None = None, fs: FileSystem | None = None, admin_socket: str = "", admin_peers: dict[int, str] | None = None,
                 anvil_socket: socket.socket | None = None, pickup: bool = True,
                 config_source: Callable[[], Config] | None = None, shard: int = 0) -> None:
        self.cfg = cfg
        # mtaq reload / SIGHUP (mtaq.daemon.reload): reads the configuration again as it was read at the start
        # (the same file and flags; a worker's shard settings applied); None: a daemon built without one.
        self.config_source = config_source
        self.shard = shard
        self._reload_lock = asyncio.Lock()
        self.handler: QueueHandler | None = None
        self.own_gate: ConnectionGate | None = None
        self.host_gate: AnvilClient | None = None
        # One of several workers: the socket to the supervisor's anvil, the host's per-client counters
        # (mtaq.daemon.anvil); None: the gate is this process's own.
        self.anvil_socket = anvil_socket
        # The maildrop's pick-up (mtaq sendmail; mtaq.edge.pickup): in one process only (worker 0 of several).
        self.pickup_wanted = pickup
        self.pickup: Pickup | None = None
        # Several workers (mtaq.daemon.workers): worker k >= 1 serves the admin API on ``admin_socket`` for
        # worker 0, whose public API reaches the other shards through ``admin_peers`` {shard: socket}.
        self.admin_socket = admin_socket
        self.admin_peers = dict(admin_peers or {})
        self.clock = clock  # UTC seconds (steps with the wall clock)
        self.monotonic = monotonic  # seconds no clock step moves: waits and message ages (issue 31.8)
        self._fs_given = fs  # tests pass a failing one; else the real file system (or MTAQ_TEST_FS)
        # One of several worker processes (mtaq.daemon.workers): per listener, the sockets the supervisor bound,
        # which every worker accepts from (None: bind the listeners here).
        self.listen_sockets = listen_sockets
        self._copy_failed: set[Pos] = set()  # parked envelopes whose DATA could not be copied forward
        self.log = get_logger()
        self.router = _router(cfg)
        self.throttle = Throttle(
            DomainLimit(cfg.destination_concurrency_limit, cfg.destination_rate_per_s),
            {d: DomainLimit(v.concurrency, v.rate_per_s) for d, v in cfg.destination_limits.items()},
        )
        self.pools: list[ConnectionPool] = []
        # Back-off per next hop: dead destinations, concurrency windows (mtaq.delivery.backoff).
        self.dests = _destinations(cfg, self._on_destination, monotonic)
        self.backlog: deque[_Pending] = deque()  # started attempts waiting for a full destination
        self._backlog_changed = asyncio.Event()
        self._rate_timer: asyncio.TimerHandle | None = None
        self.edge = EdgePolicy.from_config(cfg)  # reads the TLS and password files; ConfigError if bad
        # What each new SMTP session starts with (a reload replaces it; sessions keep theirs).
        self.edge_settings = EdgeSettings(self.edge, cfg.message_size_limit_bytes, cfg.smtp_server_timeout_s,
                                          cfg.tls_handshake_timeout_s)
        self.listeners = listeners_of(cfg)  # the SMTP listeners: listen, then the listeners tables
        self.servers: list[asyncio.Server] = []
        self.sasl = self._sasl_client(cfg)  # outbound AUTH credentials; ConfigError if bad or readable
        self.signer = Signer.from_config(cfg)  # reads the DKIM keys; ConfigError if one is unsafe or bad
        self.peers = self._peer_policy(cfg)  # DANE and MTA-STS, when configured
        # reject_unverified_recipient: probes of the next hop at RCPT, results in SPOOL/verify_cache (the host's)
        self.verifier = self._verifier(cfg)
        self.edge_settings.verifier = self.verifier
        # The bounce classifier's rules (bounce_classification_file, then the shipped ones); ConfigError if bad.
        # None: the shipped ones alone, parsed at the first classification (20-40 ms of TOML and regular
        # expressions the first 250 after a start does not need; issue 36.3).
        self.bounce_rules: Rules | None = load_rules(cfg) if cfg.bounce_classification_file else None
        self.counts = {"delivered": 0, "deferred": 0, "failed": 0}
        self.metrics = Metrics(self.counts, domains_max=cfg.metrics_domains_max)
        self.metrics.milter_stats = lambda: milter_stats  # per-filter counters (mtaq.edge.milter)
        self.metrics.destinations = self.dests.backed_off
        self.http: AdminHttp | None = None  # the admin API (admin_listen), listening from the start
        self.admin_listen_sockets: list[socket.socket] | None = None  # admin_listen bound before dropping root
        self.policy = RetryPolicy(
            intervals_s=tuple(cfg.retry_intervals_s),
            maximal_queue_lifetime_s=cfg.maximal_queue_lifetime_s,
            bounce_queue_lifetime_s=cfg.bounce_queue_lifetime_s,
            delay_warning_time_s=cfg.delay_warning_time_s,
        )
        self.runners: list[Runner] = []
        self._background: set[asyncio.Task[None]] = set()
        self.checkpoints = 0
        self.exporter: Any = None  # mtaq.daemon.exporter.Exporter when event_webhooks are configured
        # The webhooks' TLS contexts, made here: before a start as root switches to mail_owner (ca_file may be
        # root's alone, like the other keys read at the start).
        self.webhook_tls = {h.url: ssl.create_default_context(cafile=h.ca_file or None) for h in cfg.event_webhooks}
        self.reclaimed = 0
        self.archived = 0
        self.archive: SegmentArchive | None = None
        self._reclaim_task: asyncio.Task[None] | None = None
        self._reclaim_limit = 0
        self._reserve_released = 0  # Log.stats.reserve_released already reported (spool_reserve_released)

    def _sasl_client(self, cfg: Config) -> SaslClient | None:
        """The outbound credentials of ``cfg`` (None: no AUTH), their holds kept for the whole host in
        ``SPOOL/sasl_hold`` (the spool above the shards: every worker's; mtaq.delivery.sasl). Raises
        ConfigError."""
        sasl = SaslClient.from_config(cfg)
        if sasl is not None:
            host_spool = os.path.dirname(cfg.spool_dir.rstrip("/")) if self.shard > 0 else cfg.spool_dir
            sasl.shared = SharedMap(os.path.join(host_spool, SASL_HOLD_FILE))
        return sasl

    def _verifier(self, cfg: Config) -> Verifier:
        """The recipient verification service (used by the edge only while ``reject_unverified_recipient``
        is on): probes over this daemon's current routing, credentials and DANE/MTA-STS, its cache in
        ``SPOOL/verify_cache`` above the shards (every worker's; mtaq.delivery.verify)."""
        settings = VerifySettings.from_config(cfg)
        host_spool = os.path.dirname(cfg.spool_dir.rstrip("/")) if self.shard > 0 else cfg.spool_dir
        shared = SharedMap(os.path.join(host_spool, VERIFY_CACHE_FILE), max_bytes=settings.map_bytes_max())

        def report(event: str, fields: dict[str, object]) -> None:
            (self.log.info if event == "address_verified" else self.log.warning)(event, **fields)

        return Verifier(settings, shared, make_prober(cfg, lambda: (self.router, self.sasl, self.peers)),
                        clock=self.clock, report=report)

    def _on_durable(self, env: EnvelopeRecord, pos: Pos) -> None:
        self.log.info(
            "queued", queue_id=env.queue_id, sender=env.sender, size=env.size, nrcpt=len(env.recipients), client=env.client
        )

    def _peer_policy(self, cfg: Config) -> PeerPolicy | None:
        """DANE (level ``dane`` anywhere, with ``smtp_dns_support_level = dnssec``) and MTA-STS (``mta_sts``,
        policies cached in ``SPOOL/mta-sts``); None when neither is configured."""
        dane_used = cfg.smtp_tls_security_level == "dane" or "dane" in cfg.tls_policy_map.values()
        if not dane_used and not cfg.mta_sts:
            return None
        from mtaq.delivery.dane import DnssecResolver
        from mtaq.delivery.mtasts import MtaSts
        from mtaq.delivery.peers import PeerPolicy
        from mtaq.storage.cachefile import CacheDir

        dane = DnssecResolver.from_config(cfg) if dane_used and cfg.smtp_dns_support_level == "dnssec" else None
        sts = MtaSts.from_config(cfg, CacheDir(os.path.join(cfg.spool_dir, "mta-sts"))) if cfg.mta_sts else None
        return PeerPolicy(dane=dane, sts=sts, report=lambda event, fields: self.log.warning(event, **fields))

    def _category(self, code: int, enhanced: str, text: str) -> str:
        """The bounce category of a reply (mtaq.core.bounce_class, with this daemon's rules)."""
        if self.bounce_rules is None:
            self.bounce_rules = default_rules()
        return classify_bounce(self.bounce_rules, code, enhanced, text)

    def _item_category(self, i: DsnItem) -> str:
        """The bounce category of one recipient of a DSN: ``message_expired`` when its queue lifetime ran out
        (4.4.7, as its ``bounced`` event says), else its reply's."""
        if i.action == "failed" and i.status == "4.4.7":
            return "message_expired"
        o = i.outcome
        return self._category(o.code, o.enhanced, o.text) if o is not None else self._category(0, i.status, "")

    def _on_dsn(self, env: EnvelopeRecord, original: str, kind: str, items: tuple[DsnItem, ...] = ()) -> None:
        # ``category``: the first reported recipient's; ``categories``: each reported recipient's (issue 37.3).
        # A success notice (action relayed) has neither.
        cats = {i.recipient.address: self._item_category(i) for i in items if i.action in ("failed", "delayed")}
        extra: dict[str, Any] = {"category": next(iter(cats.values())), "categories": cats} if cats else {}
        self.log.info("dsn_queued", queue_id=env.queue_id, dsn_for=original, action=kind,
                      recipient=env.recipients[0].address, **extra)

    def _on_fatal(self, exc: StorageFatal) -> None:
        self.log.critical("storage_fatal", error=str(exc), exit_status=EXIT_FSYNC_FAILED)
        # Let the 451 replies reach the clients, then exit without touching the disk again.
        asyncio.get_running_loop().call_later(0.2, os._exit, EXIT_FSYNC_FAILED)

    def _on_runner_read_error(self, exc: StorageError) -> None:
        self.log.error("runner_read_failed", error=str(exc), action=f"retried in {RUNNER_READ_RETRY_S} s")

    def _on_corrupt(self, p: Problem) -> None:
        """A runner passed over damage: move it aside (in a thread; the runner goes on) and report it."""
        task = asyncio.get_running_loop().create_task(move_aside(self.queue.log, self.cfg.spool_dir, p, self.log))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run(self) -> None:
        cfg = self.cfg
        t_start = time.monotonic()
        # MTAQ_TEST_FS (tests only) selects a file system that can simulate a power cut; unset: the real one.
        self.fs = self._fs_given or powercut.from_env(cfg.spool_dir) or OsFileSystem()
        if cfg.archive_dir:
            self.archive = SegmentArchive(self.fs, cfg.archive_dir, compress=cfg.archive_compress,
                                          retention_s=cfg.archive_retention_s, clock=self.clock)
        log_dir = os.path.join(cfg.spool_dir, "log")
        if self._free_bytes(log_dir) < RESERVE_BYTES and release_reserve(self.fs, log_dir):
            # A start on a full disk (issue 31.9): the reserve's room seals the last segment, creates the new
            # one, and lets recovery and the deliveries that free space write their records.
            self.log.warning("spool_reserve_released", bytes=RESERVE_BYTES, free_bytes=self._free_bytes(log_dir),
                             action="made again once the disk has room")
        qlog, report = Log.open(self.fs, log_dir, segment_bytes_max=cfg.segment_bytes_max)
        qlog.on_fatal.append(self._on_fatal)
        self.queue = Queue(qlog, policy=self.policy, reporting_mta=cfg.hostname(), clock=self.clock,
                           monotonic=self.monotonic)
        self._note_reserve()  # a start on a full disk: the new segment took the reserve's room
        self.queue.on_durable = self._on_durable
        self.queue.messages_max = cfg.queue_messages_max
        self.queue.commit_backlog_max = cfg.commit_backlog_max
        self.queue.bounce_size_limit_bytes = cfg.bounce_size_limit_bytes
        self.queue.body_memory_bytes = cfg.receive_buffer_bytes
        self.queue.minfree_bytes = max(cfg.queue_minfree_bytes, cfg.message_size_limit_bytes * 3 // 2)
        self.queue.on_dsn = self._on_dsn
        self.queue.sign = self.signer.sign_dsn  # DSNs of signed mail are signed too (myhostname's domain key)
        self.metrics.queue = self.queue
        qlog.on_commit_seconds = self.metrics.commit_latency.observe
        qlog.durable_wake_s = RUNNER_WAKE_S
        qlog.round_spacing_s = COMMIT_SPACING_S
        # Every listener before recovery (I5: mail is accepted at once on each); one gate for all of them, so
        # connections_max and the per-client limits count the daemon's connections, whatever the port.
        own = self.own_gate = connection_gate(self.edge, asyncio.get_running_loop().time)
        gate: Gate = own
        if self.anvil_socket is not None:  # several workers: the host's gate, this one if it does not answer
            anvil = self.host_gate = AnvilClient(self.anvil_socket, fallback=own)
            await anvil.start()
            gate = anvil
        handler = self.handler = QueueHandler(self.queue, self.signer)
        self.servers = []  # one per listener (the first socket's, when the supervisor bound several)
        for i, lst in enumerate(self.listeners):
            socks: list[socket.socket | None] = list(self.listen_sockets[i]) if self.listen_sockets else [None]
            for j, sock in enumerate(socks):
                server = await start_server(
                    handler,
                    lst.host,
                    lst.port,
                    hostname=cfg.hostname(),
                    data_size_limit=cfg.message_size_limit_bytes,
                    timeout_s=cfg.smtp_server_timeout_s,
                    policy=self.edge,
                    settings=self.edge_settings,
                    sock=sock,
                    gate=gate,
                    auth_required=lst.auth_required,
                    tls_required=lst.tls_required,
                    implicit_tls=lst.wrappermode,
                    tls_handshake_timeout_s=cfg.tls_handshake_timeout_s,
                    milters=lst.smtpd_milters,
                )
                if j == 0:
                    self.servers.append(server)
        self.server = self.servers[0]
        described = []
        for lst, server in zip(self.listeners, self.servers, strict=True):
            d = lst.describe()
            d["port"] = int(server.sockets[0].getsockname()[1]) if server.sockets else lst.port
            described.append(d)
        if cfg.admin_listen.strip() or self.admin_socket:
            # After SMTP listens, and imported in a thread: aiohttp costs the first 250 nothing (issue 15.6).
            # admin.json is written once the API listens; the API answers 503 until recovery is done.
            # The import holds the GIL for most of 0.1-0.2 s: while it runs, a shorter switch interval lets the
            # loop answer SMTP within 1 ms of wanting the GIL instead of 5 ms, at each step (issue 36.3).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, IMPORT_SWITCH_INTERVAL_S))
            try:
                http = await asyncio.to_thread(importlib.import_module, "mtaq.admin.http")
            finally:
                sys.setswitchinterval(interval)
            token = cfg.admin_token or http.spool_token(cfg.spool_dir)
            state = http.ApiState(self.metrics, token=token, log=self.log, hosts=tuple(cfg.admin_hosts),
                                  peers=self.admin_peers, reload=self._reload_by_api)
            limits = {"body_bytes_max": cfg.admin_body_bytes_max, "connections_max": cfg.admin_connections_max,
                      "request_timeout_s": cfg.admin_request_timeout_s}
            if self.admin_socket:
                self.http = http.AdminHttp(state, "", 0, cfg.spool_dir, unix_path=self.admin_socket, **limits)
            else:
                admin_host, admin_port = parse_hostport(cfg.admin_listen, key="admin_listen")
                self.http = http.AdminHttp(state, admin_host, admin_port, cfg.spool_dir,
                                           socks=self.admin_listen_sockets, **limits)
            await self.http.start()
        self._on_sighup_reload()
        self.log.info(
            "listening",
            listen=self.listeners[0].address,  # the first listener, as when there was only one
            listeners=described,
            admin=self.http.url if self.http else "",
            spool=cfg.spool_dir,
            relayhost=self.router.describe(),
            segment=report.new_segment,
            seconds=round(time.monotonic() - t_start, 4),
        )
        killpoints.recovering = True  # MTAQ_KILL_POINT=recovery.append counts recovery's appends only
        try:
            res = await recover(self.queue, report, cfg.spool_dir, self.log)
        finally:
            killpoints.recovering = False
        self.recovery = res
        self.metrics.recovery_seconds = res.seconds
        self.log.info(
            "recovery_complete",
            seconds=round(res.seconds, 4),
            records=res.records,
            segments=res.segments,
            bytes=res.bytes,
            scan_from=str(res.scan_from),
            checkpoint=res.checkpoint or "used",
            concluded=res.concluded,
            outcome_unknown=len(res.unknown),
            corrupt=len(res.corrupt),
        )
        # Everything recovery built stays: keep it out of the cyclic collector's generations, and let the
        # young generation grow (each message allocates a few hundred short-lived objects; issue 8).
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
                # One slot per runner, plus one (the last) for parked mail that comes due (FUTURERELEASE).
        self.dispatcher = Dispatcher(self.policy.runners + 1)
        self.runners = [
            Runner(
                k,
                qlog,
                self.dispatcher,
                res.runners[k],
                res.garbage[k],
                runners=self.policy.runners,
                clock=self.clock,
                monotonic=self.monotonic,
                interval_s=self.policy.delay_of(k),
                on_corrupt=self._on_corrupt,
                on_read_error=self._on_runner_read_error,
            )
            for k in range(self.policy.runners)
        ]
        from mtaq.admin.service import AdminService

        self.admin = AdminService(self.queue, self.runners, self.clock, cfg.spool_dir, delay_max_s=cfg.delay_max_s)
        self.admin.on_flush = self._flushed
        if self.http is not None:
            self.http.state.admin = self.admin
        if cfg.event_webhooks:  # imported here: aiohttp's client costs a daemon without webhooks nothing
            exporter_mod = await asyncio.to_thread(importlib.import_module, "mtaq.daemon.exporter")
            self.exporter = exporter_mod.Exporter(
                qlog, list(cfg.event_webhooks), res.exporters, res.exporter_new,
                backlog_max_bytes=cfg.event_backlog_max_bytes, category=self._category, logger=self.log,
                pin=res.exporter_pin, pin_head=res.exporter_new, tls=self.webhook_tls)
            self.queue.on_start = self.exporter.on_start
            self.metrics.exporter = self.exporter
        # A checkpoint now bounds the next recovery to what comes after this start, even if the next crash
        # comes before the first periodic one.
        await self.checkpoint()
        tasks = [asyncio.create_task(r.run()) for r in self.runners]
        tasks += [asyncio.create_task(self._worker()) for _ in range(cfg.delivery_concurrency)]
        tasks.append(asyncio.create_task(self._checkpointer()))
        tasks.append(asyncio.create_task(self._parked_runner()))
        tasks.append(asyncio.create_task(self._close_idle_connections()))
        if self.exporter is not None:
            tasks.append(asyncio.create_task(self.exporter.run()))
        if self.pickup_wanted:  # after recovery: it knows which maildrop files are queued already
            self.pickup = Pickup(self.queue, cfg.spool_dir, hostname=cfg.hostname(),
                                 body_bytes_max=cfg.message_size_limit_bytes,
                                 recipients_max=cfg.recipients_per_message_max, signer=self.signer, log=self.log,
                                 myorigin=cfg.myorigin, milters=self.edge.milter,
                                 canonical=self.edge.canonical)
            tasks.append(asyncio.create_task(self.pickup.run(res.maildrop)))
        if cfg.stats_interval_s > 0:
            tasks.append(asyncio.create_task(self._stats()))
        await asyncio.gather(*tasks)

    # -------------------------------------------------------------------------------------------- reload
    def _on_sighup_reload(self) -> None:
        """SIGHUP reloads (mtaq.daemon.reload); before this the signal is ignored (serve sets SIG_IGN)."""
        loop = asyncio.get_running_loop()

        async def reload() -> None:
            await self.reload("SIGHUP")

        def hup() -> None:
            task = loop.create_task(reload())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        try:
            loop.add_signal_handler(signal.SIGHUP, hup)
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread (a test's daemon)
            pass

    async def _reload_by_api(self) -> dict[str, Any]:
        return (await self.reload("admin API")).as_json()

    async def reload(self, trigger: str) -> ReloadResult:
        """Read the configuration again and apply it to new sessions and new attempts (module
        :mod:`mtaq.daemon.reload`); one reload at a time. ``trigger``: what asked (``SIGHUP``, ``admin API``),
        for the ``reloaded`` / ``reload_failed`` event. Never raises for a bad configuration: the result
        says why nothing changed."""
        async with self._reload_lock:
            res = ReloadResult(shard=self.shard)
            # In a thread: reading and checking the files (keys test-signed, TLS contexts) must not hold up
            # the sessions and deliveries; nothing it builds is in use before _apply_reload.
            built = await asyncio.to_thread(self._build_reload, res)
            if built is None:
                self.log.error("reload_failed", trigger=trigger, problems=res.problems, action="nothing changed")
                return res
            await self._apply_reload(built, res)
            res.applied = True
            self.log.info("reloaded", trigger=trigger, changed=res.changed, restart_needed=res.restart_needed,
                          sasl_hold_cleared=res.sasl_hold_cleared,
                          action="applied to new sessions and new delivery attempts"
                          + ("; the restart_needed keys keep their old values until a restart" if res.restart_needed else ""))
            return res

    def _build_reload(self, res: ReloadResult) -> dict[str, Any] | None:
        """Everything a reload needs, built from the configuration read again; None (and ``res.problems``)
        when anything is wrong, with nothing changed."""
        if self.config_source is None:
            res.problems.append("this daemon was started without a configuration source to read again")
            return None
        try:
            new = self.config_source()
        except (MtaqError, OSError, ValueError) as exc:
            res.problems.append(str(exc))
            return None
        res.changed, res.restart_needed = changed_keys(self.cfg, new)
        # Keys that need a restart keep their old values (named in the answer), the rest is the new file.
        cfg = msgspec.structs.replace(new, **{k: getattr(self.cfg, k) for k in res.restart_needed})
        res.problems += unreadable_files(cfg)
        if not res.problems:
            # The checks `mtaq serve` makes before it binds (mtaq check): key and password file modes, the
            # certificate and key pair, CA files, DKIM keys test-signed: a reload accepts no less.
            res.problems += check_problems(cfg)
        if res.problems:
            return None
        built: dict[str, Any] = {"cfg": cfg}
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("edge", lambda: EdgePolicy.from_config(cfg)),
            ("sasl", lambda: self._sasl_client(cfg)),
            ("signer", lambda: Signer.from_config(cfg)),
            ("router", lambda: _router(cfg)),
            ("peers", lambda: self._peer_policy(cfg)),
        ]
        for name, make in steps:
            try:
                built[name] = make()
            except (MtaqError, OSError, ValueError) as exc:
                res.problems.append(str(exc))
        edge = built.get("edge")
        if isinstance(edge, EdgePolicy) and edge.tls_context is None:
            for lst in self.listeners:
                if lst.tls_required or lst.wrappermode:
                    res.problems.append(f"listeners.{lst.address}: mode {lst.mode} needs a certificate "
                                        "(tls_cert_file, tls_key_file)")
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and open_files_needed(cfg) > soft:
            res.problems.append(f"connections_max: needs {open_files_needed(cfg)} open files per process, but "
                                f"RLIMIT_NOFILE is {soft}: raise it (systemd LimitNOFILE=) and restart, or lower connections_max")
        return None if res.problems else built

    async def _apply_reload(self, b: dict[str, Any], res: ReloadResult) -> None:
        """Put what :meth:`_build_reload` made in place, for new sessions and new attempts only."""
        cfg: Config = b["cfg"]
        self.cfg = cfg
        # The SMTP edge: the next accepted connection gets the new policy, certificate and limits.
        self.edge = b["edge"]
        st = self.edge_settings
        st.policy, st.data_size_limit = self.edge, cfg.message_size_limit_bytes
        st.timeout_s, st.tls_handshake_timeout_s = cfg.smtp_server_timeout_s, cfg.tls_handshake_timeout_s
        if self.own_gate is not None:
            self.own_gate.configure(**gate_limits(self.edge))
            if self.host_gate is not None:
                self.host_gate.limits_changed()  # its idle places were granted under the old mynetworks
        if self.host_gate is not None and self.shard == 0:
            self.host_gate.reconfigure_host()  # the supervisor's gate (the host's limits) reads them too
        # DKIM: messages whose DATA ends from now on (SMTP, the maildrop, DSNs).
        self.signer = b["signer"]
        if self.handler is not None:
            self.handler.signer = self.signer
        if self.pickup is not None:  # non_smtpd_milters and milter_*: picked-up messages from now on
            self.pickup.milters = self.edge.milter
        if getattr(self, "queue", None) is not None:
            self.queue.sign = self.signer.sign_dsn
            self.queue.messages_max = cfg.queue_messages_max
            self.queue.commit_backlog_max = cfg.commit_backlog_max
            self.queue.bounce_size_limit_bytes = cfg.bounce_size_limit_bytes
            self.queue.minfree_bytes = max(cfg.queue_minfree_bytes, cfg.message_size_limit_bytes * 3 // 2)
        if self.pickup is not None:
            self.pickup.signer = self.signer
            self.pickup.canonical = self.edge.canonical
            self.pickup.body_bytes_max = cfg.message_size_limit_bytes
            self.pickup.recipients_max = cfg.recipients_per_message_max
        admin = getattr(self, "admin", None)
        if admin is not None:
            admin.delay_max_s = cfg.delay_max_s
        # Delivery: attempts that start from now on (those running hold the old objects to their end).
        sasl: SaslClient | None = b["sasl"]
        # Holds of entries that changed or went end (smtp_sasl_auth_enable turned off: every hold ends).
        res.sasl_hold_cleared = (sasl or SaslClient({})).keep_holds(self.sasl)
        self.sasl = sasl
        self.router = b["router"]
        self.peers = b["peers"]
        forget_contexts()  # smtp_tls_CAfile read again by the next verified connection
        await self.throttle.update(
            DomainLimit(cfg.destination_concurrency_limit, cfg.destination_rate_per_s),
            {d: DomainLimit(v.concurrency, v.rate_per_s) for d, v in cfg.destination_limits.items()},
        )
        self.dests.configure(cfg.destination_concurrency_limit,
                             {d: v.concurrency for d, v in cfg.destination_limits.items()},
                             dead_s=dead_time_s(cfg), failed_cohort_limit=cfg.destination_concurrency_failed_cohort_limit)
        if getattr(self, "dispatcher", None) is not None:
            self._kick()

    # ------------------------------------------------------------------------------------------ delivery
    async def _close_idle_connections(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.cfg.smtp_connection_idle_s / 2))
            for pool in self.pools:
                await pool.close_idle()

    async def _worker(self) -> None:
        """One delivery worker: takes started attempts that can go now (held back ones first, then new
        offers), and never waits for one destination while other mail could go: an attempt whose
        destination (a recipient domain's slots, a next hop's concurrency window) is full waits in
        :attr:`backlog` (started, in memory: a crash leaves it to recovery like any attempt in progress)
        and the worker takes the next offer. Only a full backlog (``BACKLOG_PER_WORKER`` per worker) makes
        a worker wait, as Postfix's queue manager stops reading the queue when its active queue is full."""
        cfg = self.cfg
        pool = ConnectionPool(helo_name=cfg.hostname(), timeout_s=cfg.smtp_timeout_s,
                              idle_s=cfg.smtp_connection_idle_s, max_conns=cfg.smtp_connection_cache_max,
                              bind_address=cfg.smtp_bind_address, bind_address6=cfg.smtp_bind_address6)
        self.pools.append(pool)
        me = asyncio.current_task()
        while True:
            if me is not None and me.cancelling():
                # Python 3.11's wait_for (inside aiosmtplib) can swallow a cancellation; honour it here.
                raise asyncio.CancelledError
            ready = self._next_ready()
            if ready is None:
                if len(self.backlog) >= BACKLOG_PER_WORKER * self.cfg.delivery_concurrency:
                    self._backlog_changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._backlog_changed.wait(), 1.0)
                    continue
                offer = await self.dispatcher.take_or_nudge()
                if offer is None:
                    continue  # nudged: held-back work may go now
                started = self._start_offer(offer)
                if started is False:
                    return  # StorageFatal: the process is exiting
                if started is None:
                    continue
                p = started
                if isinstance(p.body, StoredBody):
                    try:
                        await p.body.verify_yielding()  # the other sessions go on while a large body is checked
                    except CorruptRecord as exc:
                        p.body, p.problem = None, str(exc)  # damaged for good: bounced (554 5.3.0) with a DSN
                    except StorageError as exc:
                        p.body, p.problem = None, f"temporary: {exc}"  # deferred, tried again
                    except StorageFatal:
                        return
                ready = self._claim(p)
                if ready is None:
                    self.backlog.append(p)
                    continue
            p, slots, held = ready
            self._kick()  # another held-back attempt may go too: wake an idle worker for it
            try:
                async with slots:  # free (checked by _claim, nothing awaited since): never waits
                    if not await self._run_attempt(p, pool):
                        return
            finally:
                self.dests.release(held)
                self._backlog_changed.set()

    def _start_offer(self, offer: Offer) -> _Pending | Literal[False] | None:
        """Start the offered envelope (its START appended, the offer accepted): the attempt to run; None
        when there is nothing to deliver (revoked, or declined to be offered again); False after a
        StorageFatal (the process is exiting)."""
        q = self.queue
        env = offer.envelope
        if offer.pos in q.reserved:
            # An administrator's action is appending its records in batches and has not reached this one:
            # not started here; the runner offers it again after a while (by then it is revoked, or free).
            offer.decline()
            return None
        if offer.pos in q.revoked or (offer.runner == self.policy.runners and offer.pos not in q.parked):
            # An administrator deleted, held, ... this envelope after it was found: it is not ours.
            q.revoked.discard(offer.pos)
            offer.accept()
            return None
        body: bytes | StoredBody | None
        try:
            # Checked now; a large one (sent from the log in pieces) just after START, yielding between pieces.
            body = q.body_for_delivery(env, check=False)
            problem = ""
        except CorruptRecord as exc:
            body, problem = None, str(exc)  # damaged for good: bounced (554 5.3.0) with a DSN
        except StorageError as exc:
            body, problem = None, f"temporary: {exc}"  # EIO, EMFILE, ENOMEM: deferred, tried again
        try:
            attempt = q.start(offer.pos, env)  # same step as take(): the runner position stays truthful
        except StorageFatal:
            offer.decline()
            return False
        except StorageError as exc:
            self.log.error("start_failed", queue_id=env.queue_id, error=str(exc), action="offered again")
            offer.decline()
            return None
        offer.accept()
        domains: set[str] = set()
        dests: set[str] = set()
        if body is not None:
            for r in env.recipients:
                route = self.router.route(r.address, env.sender)
                if route.kind == "smtp":
                    domains.add(r.address.rpartition("@")[2].lower())
                    dests.add(str(route))
        return _Pending(attempt, body, problem, sorted(domains), sorted(dests))

    def _claim(self, p: _Pending) -> tuple[_Pending, Slots, list[str]] | None:
        """``p`` with its slots (entered right after, with no await between) and its next hops counted in
        their windows, when every destination of it has room now; else None (with a wake-up armed when
        only a rate is in the way)."""
        wait = self.throttle.wait_s(p.domains)
        if wait is None or not self.dests.free(p.dests):
            return None
        if wait > 0:
            if self._rate_timer is None or self._rate_timer.cancelled():
                self._rate_timer = asyncio.get_running_loop().call_later(wait, self._rate_due)
            return None
        return p, self.throttle.slots(p.domains), self.dests.hold(p.dests)

    def _rate_due(self) -> None:
        self._rate_timer = None
        self._kick()

    def _next_ready(self) -> tuple[_Pending, Slots, list[str]] | None:
        """The first held-back attempt (oldest first) that can go now, taken out of the backlog."""
        for i, p in enumerate(self.backlog):
            ready = self._claim(p)
            if ready is not None:
                del self.backlog[i]
                self._backlog_changed.set()
                return ready
        return None

    def _kick(self) -> None:
        """Wake an idle worker when a held-back attempt can go now (a slot came free, a window grew, a
        destination died or was flushed, a rate allows the next start)."""
        if self.backlog and any(self.throttle.wait_s(p.domains) == 0.0 and self.dests.free(p.dests)
                                for p in self.backlog):
            self.dispatcher.nudge()
            self._backlog_changed.set()

    def _on_destination(self, event: str, fields: dict[str, Any]) -> None:
        """A next hop died, came back, or its window changed (mtaq.delivery.backoff): log it; held-back
        attempts may go now."""
        (self.log.warning if event == "destination_dead" else self.log.info)(event, **fields)
        if getattr(self, "dispatcher", None) is not None:
            self._kick()

    def _flushed(self) -> None:
        """``mtaq queue flush`` (Postfix ``postqueue -f``): dead destinations are tried again at once."""
        dead = self.dests.clear()
        if dead:
            self.log.info("destinations_flushed", dead=dead, action="tried again now")

    async def _run_attempt(self, p: _Pending, pool: ConnectionPool) -> bool:
        """Deliver ``p`` and conclude it; False after a StorageFatal (the process is exiting)."""
        q = self.queue
        attempt, body = p.attempt, p.body
        env = attempt.envelope
        try:
            await self._attempt(attempt, body, p.problem, pool)
        except StorageFatal:
            return False
        except Exception as exc:
            # A full disk, or a bug: never leave the attempt open and forgotten while we run.
            self.log.exception("delivery_attempt_failed", queue_id=env.queue_id, error=str(exc))
            try:
                q.conclude(attempt, body if isinstance(body, bytes) else None)
            except Exception as exc2:
                # Stays in the working set (so reclamation keeps its envelope); the next recovery ends it.
                self.log.error("attempt_left_open", queue_id=env.queue_id, error=str(exc2))
        return True

    async def _attempt(self, attempt: Attempt, body: bytes | StoredBody | None, problem: str,
                       pool: ConnectionPool) -> None:
        """Deliver one started attempt; every recipient's final reply is durable before it counts (I2)."""
        q = self.queue
        env = attempt.envelope
        rcpts = env.recipients
        delay = round(self.clock() - env.arrival_ts, 3)

        async def record(b: Batch) -> None:
            if b.relay != "none":
                killpoints.hit("delivery.after_remote_reply")
            outcomes = [
                Outcome(index=rcpts[i].index, status=classify(rep.code), code=rep.code, enhanced=rep.enhanced,  # type: ignore[arg-type]
                        text=rep.text)
                for i, rep in b.items
            ]
            # Durable before they count. An abandoned attempt (delivery_timeout_s) still writes the replies it
            # already has: record_outcomes appends before its first await, and the commit round covering the
            # record fsyncs it whether or not anyone still waits (no shield, no task a batch).
            await q.record_outcomes(attempt, b.relay, outcomes, remote_dsn=b.remote_dsn, tls=b.tls or "")
            for (i, _), o in zip(b.items, outcomes, strict=True):
                self.counts[o.status] += 1
                if o.status == "delivered":
                    self.metrics.delivered(rcpts[i].address, self.clock() - env.arrival_ts)
                event = "discarded" if b.discarded else _EVENT_OF[o.status]
                # deferred and bounced events carry the reply's bounce category (issue 37.3)
                extra = {} if o.status == "delivered" else {"category": self._category(o.code, o.enhanced, o.text)}
                getattr(self.log, "info" if o.status == "delivered" else "warning")(
                    event,
                    queue_id=env.queue_id,
                    recipient=rcpts[i].address,
                    relay=b.relay,
                    delay=delay,
                    dsn=o.enhanced,
                    status="discarded" if b.discarded else _STATUS_OF[o.status],
                    reply=format_reply(o),
                    attempt=env.attempts + 1,
                    tls=b.tls or "none",
                    **extra,
                )

        def hop_failed(f: HopFailure) -> None:
            self.log.info("hop_failed", queue_id=env.queue_id, relay=f.relay, dsn=f.reply.enhanced,
                          reply=f"{f.reply.code} {f.reply.enhanced} {f.reply.text}",
                          recipients=[rcpts[i].address for i in f.positions], action="next host")
            if f.sasl_code:  # AUTH refused (the user name, never the password)
                self.log.warning("sasl_auth_failed", queue_id=env.queue_id, relay=f.relay, code=f.sasl_code,
                                 sasl_username=f.sasl_username, reply=f"{f.reply.code} {f.reply.enhanced} {f.reply.text}",
                                 action="held" if f.sasl_code >= 500 else "next host")

        if body is None and problem.startswith("temporary: "):
            # Only a checksum failure may bounce; a read that failed for a reason that can pass defers.
            self.log.error("message_read_failed", queue_id=env.queue_id, error=problem, action="deferred")
            reply = Reply(451, "4.3.0", f"message data could not be read from the queue: {problem}")
            await record(Batch("none", [(i, reply) for i in range(len(rcpts))]))
        elif body is None:
            self.log.error("corrupt_message", queue_id=env.queue_id, error=problem)
            reply = Reply(554, "5.3.0", f"message data unreadable in queue: {problem}")
            await record(Batch("none", [(i, reply) for i in range(len(rcpts))]))
        else:
            try:
                async with asyncio.timeout(self.cfg.delivery_timeout_s):
                    await deliver(
                        self.router,
                        pool,
                        env.sender,
                        [r.address for r in rcpts],
                        body,
                        mail_params=env.mail_params,
                        rcpt_params=[r.params for r in rcpts],
                        record=record,
                        on_hop_failure=hop_failed,
                        sasl=self.sasl,
                        peers=self.peers,
                        dests=self.dests,  # the domains' slots are held by the worker (_claim)
                    )
            except TimeoutError:
                # The visibility timeout (CassieQ): the attempt is abandoned; recipients without a durable
                # reply have an unknown outcome and are retried at once (GUIDE I4: at most a duplicate).
                left = [r.address for r in rcpts if r.index not in attempt.outcomes]
                self.log.warning("attempt_timed_out", queue_id=env.queue_id, seconds=self.cfg.delivery_timeout_s,
                                 recipients=left, action="retry")
        try:
            c, _pos = q.conclude(attempt, body if isinstance(body, bytes) else None)  # streamed: read if needed
        except CorruptRecord as exc:
            # A streamed body damaged after this attempt checked it (its transaction was cut off before the
            # final dot): it cannot be copied forward; bounce what is left, as recovery does (554 5.3.0).
            self.log.error("corrupt_message", queue_id=env.queue_id, error=str(exc), action="bounced")
            text = f"message data unreadable in queue: {exc}"
            for r in rcpts:
                o = attempt.outcomes.get(r.index)
                if o is None or o.status == "deferred":
                    attempt.outcomes[r.index] = Outcome(index=r.index, status="failed", code=554, enhanced="5.3.0",
                                                        text=text)
                    self.counts["failed"] += 1
                    self.log.warning("bounced", queue_id=env.queue_id, recipient=r.address, dsn="5.3.0",
                                     status="bounced", reply=f"554 5.3.0 {text}",
                                     category=self._category(554, "5.3.0", text))
            c, _pos = q.conclude(attempt, b"")
        for r in c.expired:
            self.counts["failed"] += 1
            self.log.warning("bounced", queue_id=env.queue_id, recipient=r.address, dsn="4.4.7",
                             status="expired", reply="message delivery time expired", category="message_expired")
        if isinstance(c.record, EnvelopeRecord):
            self.log.info("deferred_until", queue_id=env.queue_id, runner=c.record.runner,
                          due=round(c.record.not_before_ts, 3), recipients_left=len(c.record.recipients))
        else:
            self.log.info("removed", queue_id=env.queue_id)

    # ------------------------------------------------------------------------------- checkpoints, reclaim
    async def _parked_runner(self) -> None:
        """Offer delayed mail (FUTURERELEASE, flushed parked mail) when it comes due; held mail never."""
        q, slot = self.queue, self.policy.runners
        while True:
            now = self.clock()
            due = [p for p in q.parked.due(now) if p < q.log.durable_end]
            if not due:
                nxt = q.parked.next_due()
                await asyncio.sleep(min(1.0, max(0.05, nxt - now)) if nxt is not None else 1.0)
                continue
            for pos in due:
                if pos not in q.parked:
                    continue  # started by an administrator's action meanwhile
                try:
                    env = q.log.read(pos)
                except (CorruptRecord, StorageError) as exc:
                    q.parked.remove(pos)
                    self.log.error("corrupt_envelope", envelope=str(pos), error=str(exc))
                    continue
                if not isinstance(env, EnvelopeRecord):
                    q.parked.remove(pos)
                    continue
                try:
                    await self.dispatcher.offer(slot, pos, env)
                except Declined:
                    await asyncio.sleep(1.0)
                    break

    async def _checkpointer(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.checkpoint_interval_s)
            await self.checkpoint()

    async def checkpoint(self) -> None:
        """Take the restart positions, fsync the log, write the checkpoint, delete wholly-garbage segments."""
        qlog, working = self.queue.log, self.queue.working
        await self._copy_parked_forward()
        # No maildrop pick-up between its appends and its unlinks' fsync while the positions are read (mtaq.edge.pickup).
        pickup_lock = self.pickup.lock if self.pickup is not None else None
        if pickup_lock is not None:
            await pickup_lock.acquire()
        head = qlog.end
        positions = tuple(r.position for r in self.runners)
        garbage = tuple(tuple(sorted(r.garbage)) for r in self.runners)
        suffix = working.earliest_start() or head
        parked = self.queue.parked
        pins = self.queue.data_pins  # replacements naming DATA far behind them (a failed copy forward)
        exporter_pin = self.exporter.pin() if self.exporter is not None else None
        true_garbage_end = min((*positions, working.earliest_envelope() or head, parked.earliest() or head, head,
                                *pins.values(), exporter_pin or head))
        if pickup_lock is not None:
            pickup_lock.release()
        # Revoked envelopes that every runner has passed can no longer be offered by a runner.
        self.queue.revoked = {p for p in self.queue.revoked if p >= min(positions, default=head)}
        cp = Checkpoint(head=head, suffix=suffix, runners=positions, garbage=garbage, written_ts=self.clock(),
                        parked=tuple(sorted(parked.entries)), counts=self.queue.counts.snapshot(),
                        pins=tuple(sorted(pins.items())),
                        exporters=self.exporter.positions() if self.exporter is not None else (),
                        exporter_pin=self.exporter.window_pin() if self.exporter is not None else None)
        await qlog.sync()  # every START behind the positions is durable before the checkpoint says so
        try:
            await asyncio.to_thread(self._write_checkpoint, cp)
        except OSError as exc:
            # Like a failed archive (issue 31.9): a full disk or no descriptor left must not end the daemon,
            # whose deliveries free space. The last checkpoint written stays; nothing is reclaimed past it.
            self._note_reserve()
            self.log.error("checkpoint_failed", error=oserror_line(exc),
                           action="tried again at the next checkpoint; no segment reclaimed")
            return
        self.checkpoints += 1
        self._note_reserve()
        try:
            await asyncio.to_thread(qlog.keep_reserve, RESERVE_BYTES,
                                    free_at_least=self.queue.minfree_bytes + 2 * RESERVE_BYTES)
        except OSError as exc:
            self.log.warning("spool_reserve_failed", error=oserror_line(exc), action="tried again at the next checkpoint")
        # Keep the segment before the garbage end too: an envelope's DATA may sit at the end of it (DATA
        # further behind its envelope is pinned above).
        limit = true_garbage_end.segment - 1
        if self.archive is not None:
            self._reclaim_soon(limit)
            return
        gone = qlog.delete_segments_before(limit)
        if gone:
            self.reclaimed += len(gone)
            self.log.info("segments_reclaimed", segments=gone, garbage_end=str(true_garbage_end))

    def _write_checkpoint(self, cp: Checkpoint) -> None:
        """write_checkpoint (in a thread); on a full disk once more after giving up the reserve. Raises OSError."""
        try:
            write_checkpoint(self.fs, self.cfg.spool_dir, cp)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.queue.log.release_reserve():
                raise
            write_checkpoint(self.fs, self.cfg.spool_dir, cp)

    def _note_reserve(self) -> None:
        """Log ``spool_reserve_released`` once for each time the log gave up its reserve to a full disk."""
        released = self.queue.log.stats.reserve_released
        if released > self._reserve_released:
            self._reserve_released = released
            self.log.warning("spool_reserve_released", bytes=RESERVE_BYTES,
                             free_bytes=self._free_bytes(self.queue.log.directory),
                             action="made again once the disk has room")

    def _free_bytes(self, directory: str) -> int:
        """Bytes free where ``directory`` is; a large number when that cannot be told (a first start)."""
        try:
            return self.fs.free_bytes(directory)
        except OSError:
            return 1 << 62

    async def _copy_parked_forward(self) -> None:
        """Copy held and delayed envelopes that alone keep old segments from being reclaimed to the log's
        end (issue 12.9), at most ``PARKED_COPIES_MAX`` per checkpoint, oldest first: disk use stays bounded
        by the traffic of a few checkpoint intervals, however long mail stays on hold. Each copy rewrites
        the message once (its DATA and envelope); a message is copied again only when reclamation reaches it
        again. Each body is read once, in a thread (Queue.copy_forward): the SMTP sessions go on meanwhile."""
        q = self.queue
        qlog, parked = q.log, q.parked
        try:
            q.finish_open_copies()  # a full disk cut one short after its START: its replacement now
        except StorageError as exc:
            self.log.error("parked_copy_failed", error=str(exc), action="tried again later")
            return
        if not parked.entries:
            return
        head = qlog.end
        positions = [r.position for r in self.runners]
        pinned_below = min((*positions, q.working.earliest_envelope() or head, head)).segment - 1
        old = sorted(p for p in parked.entries
                     if p.segment < pinned_below and p not in self._copy_failed)[:PARKED_COPIES_MAX]
        for pos in old:
            if pos not in parked:
                continue  # released, deleted, ... or offered while an earlier copy was read
            try:
                env = qlog.read(pos)
                if not isinstance(env, EnvelopeRecord):
                    raise CorruptRecord(f"{pos} is not an envelope")
                await q.copy_forward(pos, env)
            except CorruptRecord as exc:
                self._copy_failed.add(pos)  # reported once; it keeps its segments (and shows in queue list)
                self.log.error("parked_copy_failed", envelope=str(pos), error=str(exc), action="left where it is")
            except StorageError as exc:
                self.log.error("parked_copy_failed", envelope=str(pos), error=str(exc), action="tried again later")
                return

    def _reclaim_soon(self, limit: int) -> None:
        """Archive, then delete, the segments below ``limit`` in a background task (one at a time)."""
        self._reclaim_limit = max(self._reclaim_limit, limit)
        if self._reclaim_task is None or self._reclaim_task.done():
            self._reclaim_task = asyncio.create_task(self._archive_and_reclaim())

    def runners_settled(self) -> bool:
        """True when every queue runner has read the log up to its durable end or waits for an envelope's
        due time: a checkpoint taken now reclaims all it can (for tests and tools; deferred runners read
        in batches, up to ``DEFERRED_SCAN_DELAY_S`` after the end moved)."""
        end = self.queue.log.durable_end
        return all(r.position >= end or r.waiting_until is not None for r in self.runners)

    async def reclaimed_idle(self) -> None:
        """Wait until the background archive-and-reclaim task (if any) has finished (for tests and tools)."""
        while self._reclaim_task is not None and not self._reclaim_task.done():
            await asyncio.shield(self._reclaim_task)

    async def _archive_and_reclaim(self) -> None:
        archive = self.archive
        assert archive is not None
        qlog = self.queue.log
        done = 0
        while done < self._reclaim_limit:
            limit = done = self._reclaim_limit
            archived: list[int] = []
            for n in qlog.segments():
                if n >= limit or n >= qlog.current_segment:
                    break
                try:
                    a = await asyncio.to_thread(archive.store, n, segment_path(qlog.directory, n))
                except ArchiveError as exc:
                    self.log.error("archive_failed", segment=n, error=str(exc), action="segment kept")
                    break
                archived.append(n)
                self.archived += 1
                self.log.info("segment_archived", segment=n, path=a.path, bytes=a.bytes, stored_bytes=a.stored_bytes,
                              seconds=round(a.seconds, 4))
            if archived:
                try:
                    gone = qlog.delete_segments_before(archived[-1] + 1)
                except StorageError as exc:
                    self.log.error("reclaim_failed", error=str(exc), action="segments kept")
                    return
                if gone:  # none while an admin view reads the segments (Log.segments_kept): the next checkpoint
                    self.reclaimed += len(gone)
                    self.log.info("segments_reclaimed", segments=gone, archived=archived, limit=limit)
            try:
                expired = await asyncio.to_thread(archive.expire)
            except ArchiveError as exc:
                self.log.error("archive_retention_failed", error=str(exc))
            else:
                if expired:
                    self.log.info("archives_expired", files=expired, retention_s=archive.retention_s)

    async def _stats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.stats_interval_s)
            st = self.queue.log.stats
            segs = self.queue.log.segments()
            self.log.info(
                "stats",
                received=self.queue.received,
                delivered=self.counts["delivered"],
                deferred=self.counts["deferred"],
                bounced=self.counts["failed"],
                active=len(self.queue.working),
                records=st.records_appended,
                bytes=st.bytes_appended,
                commit_rounds=st.commit_rounds,
                fsync_calls=st.fsync_calls,
                fsync_seconds=round(st.fsync_seconds, 4),
                segments=len(segs),
                log_bytes=sum(self.queue.log.segment_size(n) for n in segs),
                checkpoints=self.checkpoints,
                segments_reclaimed=self.reclaimed,
                segments_archived=self.archived,
                runner_positions=[str(r.position) for r in self.runners],
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


def _router(cfg: Config) -> Router:
    """The delivery router of ``cfg``, with its ``smtp_generic_maps`` (:class:`mtaq.edge.canonical.Generic`)
    read: the delivery package does not read edge modules. Raises ConfigError."""
    router = Router(cfg)
    router.generic = Generic.from_config(cfg.smtp_generic_maps, myhostname=cfg.hostname(), myorigin=cfg.myorigin)
    return router


def _run_loop(daemon: Daemon) -> None:
    runner: Any
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    runner(_run_or_crash(daemon))


def _shard_config(cfg: Config, shard: int, n: int) -> Config:
    """Worker ``shard``'s view of ``cfg``: its shard of the spool, its share of ``delivery_concurrency``, and
    the public admin API on worker 0 only."""
    return msgspec.structs.replace(
        cfg,
        spool_dir=shard_dir(cfg.spool_dir, shard),
        delivery_concurrency=max(1, -(-cfg.delivery_concurrency // n)),  # the total stays as configured
        # The public admin API and /metrics: worker 0 (one port); it reaches the other shards through the
        # unix socket each of them serves the API on (mtaq.admin.shards).
        admin_listen=cfg.admin_listen if shard == 0 else "",
    )


def _run_worker(cfg: Config, shard: int, n: int, sockets: list[list[socket.socket]],
                owner: privileges.Owner | None = None, admin_socks: list[socket.socket] | None = None,
                source: Callable[[], Config] | None = None) -> None:
    """Worker ``shard`` of ``n`` (in its own process): a whole daemon on its shard of the spool, accepting SMTP
    connections from ``sockets`` (per listener, bound by the supervisor: :func:`mtaq.daemon.workers.bind_listeners`).
    Started as root: switches to ``owner`` once its keys are read, before it opens its shard; worker 0 serves
    the admin API on ``admin_socks`` (bound by the supervisor), the others close them."""
    set_queue_id_shard(shard)
    configure_logging(cfg.log_format, shard=shard, syslog_socket=cfg.syslog_socket)
    shard_cfg = _shard_config(cfg, shard, n)

    def shard_source() -> Config:  # mtaq reload: the file read again, seen as at the start
        assert source is not None
        new = source()
        if new.admin_listen.strip() and not new.admin_token and cfg.admin_token:
            new = msgspec.structs.replace(new, admin_token=cfg.admin_token)  # the spool's token, as at the start
        return _shard_config(new, shard, n)
    api = bool(cfg.admin_listen.strip())
    peers = {k: admin_socket(cfg.spool_dir, k) for k in range(1, n)} if api and shard == 0 else {}
    sock = admin_socket(cfg.spool_dir, shard) if api and shard > 0 else ""
    try:
        daemon = Daemon(shard_cfg, listen_sockets=sockets, admin_socket=sock, admin_peers=peers,
                        anvil_socket=worker_anvil_socket(), pickup=shard == 0,
                        config_source=shard_source if source is not None else None, shard=shard)
        if shard == 0:
            daemon.admin_listen_sockets = admin_socks
        else:
            for s in admin_socks or []:
                s.close()
        if owner is not None:
            privileges.switch_to(owner, cfg)  # the spool, not a shard not made yet
        _run_loop(daemon)
    except (OSError, MtaqError) as exc:
        # What one process says from the CLI (a start-up failure: admin_listen taken since the supervisor's check,
        # an admin socket path it cannot replace, an unreadable spool): one line and status 1, no traceback.
        print(f"mtaq: cannot serve: worker {shard}: {oserror_line(exc) if isinstance(exc, OSError) else exc}",
              file=sys.stderr)
        raise SystemExit(1) from None


def oserror_line(exc: OSError) -> str:
    """An OSError in one line for an administrator: its strerror and the file it names, if any."""
    text = exc.strerror or str(exc)
    return f"{text}: {exc.filename}" if exc.filename else text


def _check_admin_bindable(cfg: Config) -> None:
    """Several workers: bind ``admin_listen`` once in the supervisor (and let it go: worker 0 binds it), so that
    an address in use is one line (OSError ``admin_listen HOST:PORT: ...``), not a worker's exit. Called while
    the supervisor holds the SMTP listeners, so that admin_listen on one of their addresses is found too."""
    if cfg.admin_listen.strip():
        for socks in bind_listeners([parse_hostport(cfg.admin_listen, key="admin_listen")], key="admin_listen"):
            for s in socks:
                s.close()


def open_files_needed(cfg: Config) -> int:
    """Descriptors one worker may need at once: ``connections_max`` SMTP connections (any worker may get them
    all), ``delivery_concurrency`` outbound ones, the log's :data:`~mtaq.storage.log.FILES_OPEN_MAX` readers and
    :data:`FILES_RESERVED`."""
    return cfg.connections_max + cfg.delivery_concurrency + FILES_OPEN_MAX + FILES_RESERVED


def raise_open_files_limit(needed: int) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit, as Postfix's master does (``open_limit()``); return
    ``(soft before, soft now)``. Raises ValueError (one line naming ``connections_max``) when the limit stays
    below ``needed`` (:func:`open_files_needed`): the daemon would run out of descriptors under load
    (EMFILE: accepted connections dropped, a checkpoint or a new segment not written) before its
    ``connections_max`` could refuse anyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # an infinite hard limit above fs.nr_open: keep what there is
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise ValueError(f"connections_max: needs at least {needed} open files per process (connections_max, "
                         f"delivery_concurrency and {FILES_OPEN_MAX + FILES_RESERVED} more), "
                         f"but RLIMIT_NOFILE is {soft} (hard limit {'unlimited' if hard == resource.RLIM_INFINITY else hard}):"
                         " raise it (ulimit -n, systemd LimitNOFILE=) or lower connections_max")
    return before, soft


def serve(cfg: Config, source: Callable[[], Config] | None = None) -> int:
    """Run the daemon until the process is killed; with ``workers`` > 1 (``"auto"``: one per core, at most 8;
    or a spool that has shards), run one worker process per shard under a supervisor
    (:mod:`mtaq.daemon.workers`) and return the exit status of the first worker that ended (the others are
    killed: crash-only). Raises ValueError (too many shards, or several workers on a listener with port 0).

    ``source``: reads the configuration again as ``cfg`` was read (``mtaq reload``, SIGHUP:
    :mod:`mtaq.daemon.reload`); None: a reload answers that there is none. SIGHUP is ignored until the
    daemon (each worker) listens, then reloads; the supervisor passes it on to every worker."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload during the start must not end the process
    # What the daemon writes (segments, checkpoint, archives, corrupt records: mail) is its user's alone, as
    # Postfix's 0700 queue directories; local users reach only the maildrop (mode 1733; mtaq.storage.maildrop).
    os.umask(0o077)
    listeners = listeners_of(cfg)
    files_before, files = raise_open_files_limit(open_files_needed(cfg))
    # What the limit leaves beyond open_files_needed is the temporary body files' (mtaq.storage.spill): a
    # spilled body past it gets 451 4.3.0, never the descriptor an accept() needs (review finding B6).
    set_spill_files_max(None if files == resource.RLIM_INFINITY else files - open_files_needed(cfg))
    if files != files_before:
        get_logger().info("open_files_limit_raised", soft_before=files_before, soft=files, needed=open_files_needed(cfg))
    n = shard_count(cfg.spool_dir, workers_wanted(cfg.workers, [lst.port for lst in listeners]))
    for lst in listeners:
        if n > 1 and lst.port == 0:
            raise ValueError(f"workers: {n} workers need a fixed listen port, not {lst.address}")
    # Started as root (mtaq.daemon.privileges): bind every listener and read every key first, give the spool to
    # mail_owner, switch to it; then read the spool and accept. A missing mail_owner or an unsafe mode: exit 2.
    # Every file, mode and address `mtaq check` checks, by the same function (mtaq.daemon.check): the first
    # problem is one line, exit 2.
    owner = privileges.mail_owner(cfg)
    check_start(cfg)
    if n == 1:
        set_queue_id_shard(0)  # IDs name shard 0, so that a later start with more workers routes them exactly
        if owner is None:
            _run_loop(Daemon(cfg, config_source=source))
            return 0
        daemon = Daemon(cfg, listen_sockets=bind_listeners([(lst.host, lst.port) for lst in listeners]),
                        config_source=source)
        daemon.admin_listen_sockets = _bind_admin(cfg)
        privileges.give_to(owner, cfg)
        privileges.switch_to(owner, cfg)
        _run_loop(daemon)
        return 0
    # Every file the workers read at start is checked before any of them starts: a bad one exits 2 with one
    # line, not 70 from inside a worker (TLS certificate and password files, outbound credentials, DKIM keys).
    edge = EdgePolicy.from_config(cfg)
    SaslClient.from_config(cfg)
    Signer.from_config(cfg)
    # Bound once here, accepted from by every worker (mtaq.daemon.workers); an address in use is one line.
    sockets = bind_listeners([(lst.host, lst.port) for lst in listeners])
    admin_socks: list[socket.socket] | None = None
    try:
        if owner is None:
            _check_admin_bindable(cfg)  # while the SMTP listeners are held: admin_listen on one of them is one line too
        else:
            admin_socks = _bind_admin(cfg)  # kept for worker 0: bound while root
        if cfg.admin_listen.strip() and not cfg.admin_token:
            # One token for worker 0's public API and the other workers' sockets, made before any worker starts.
            from mtaq.admin.token import spool_token

            make_durable_dirs(OsFileSystem(), cfg.spool_dir)  # its entry in its parent too (issue 31.11)
            cfg = msgspec.structs.replace(cfg, admin_token=spool_token(cfg.spool_dir))
        if owner is not None:
            privileges.give_to(owner, cfg)  # the token and every shard too
    except BaseException:
        for socks in [*sockets, admin_socks or []]:
            for s in socks:
                s.close()
        raise
    log = get_logger()

    def on_exit(shard: int, status: int) -> None:
        log.critical("worker_exited", shard=shard, exit_status=status, action="stopping every worker")

    def forked() -> None:
        for socks in [*sockets, admin_socks or []]:
            for s in socks:
                s.close()  # the workers hold them now
        if owner is not None:
            privileges.switch_to(owner, cfg)  # the supervisor too: it only waits and kills its workers

    host_gate = connection_gate(edge, time.monotonic)

    def reconfigure() -> None:
        """Worker 0 reloaded (mtaq reload, SIGHUP): the host's limits and mynetworks from the file too (no key
        is read here: only the limits)."""
        try:
            assert source is not None
            new = source()
            pol = EdgePolicy.from_config(msgspec.structs.replace(new, tls_cert_file="", tls_key_file="",
                                                                 auth_password_file=""))
        except (AssertionError, MtaqError, OSError, ValueError) as exc:
            log.error("reload_failed", process="supervisor", trigger="worker 0",
                      problems=[str(exc) or "no configuration source"],
                      action="the host's connection limits stay as they were")
            return
        host_gate.configure(**gate_limits(pol))
        log.info("reloaded", process="supervisor", trigger="worker 0",
                 action="the host's connection limits and mynetworks (the anvil) read again")

    # The supervisor holds the host's connection gate (the anvil): the limits count every worker's connections.
    return supervise(n, lambda k: _run_worker(cfg, k, n, sockets, owner, admin_socks, source), on_exit, forked,
                     anvil=host_gate, reconfigure=reconfigure)


def _bind_admin(cfg: Config) -> list[socket.socket] | None:
    """``admin_listen`` bound now (before dropping root), or None when the admin API is off."""
    if not cfg.admin_listen.strip():
        return None
    return bind_listeners([parse_hostport(cfg.admin_listen, key="admin_listen")], key="admin_listen")[0]
