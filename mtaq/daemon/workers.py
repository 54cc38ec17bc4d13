"""Several worker processes sharing the SMTP port (one accept queue), each owning one shard of the spool.

One Python process runs on one core. With ``workers = N > 1``, ``mtaq serve`` becomes a small supervisor
that forks N workers, and worker k is a whole daemon (its own log, checkpoint, ``corrupt`` area, recovery,
runners and delivery workers) on shard k of the spool: shard 0 is the spool directory itself (``SPOOL/log``,
as with one worker), shard k >= 1 is ``SPOOL/shard-k``. The supervisor binds every SMTP listener once
(:func:`bind_listeners`) before it forks, and every worker accepts from those same sockets: a new connection
goes to whichever worker asks first, which is a worker with nothing else to do (as Postfix's smtpd processes
share the master's listening socket). With SO_REUSEPORT, as before, the kernel hashed each connection to
one worker whatever that worker was doing, and half the time a lone client's next message waited behind
the delivery of its previous one. A message stays in the shard that accepted it, and so do its DSNs and
retries. Nothing is shared between workers but the listening sockets and the per-client counters: the
supervisor is the anvil of its workers (:mod:`mtaq.daemon.anvil`), so ``connections_max``, the per-client
connection limits and the AUTH failure limit hold for the host, whatever worker a connection reaches.

What must always hold:

* no shard is left without its worker: the number of workers started is at least one more than the highest
  shard found on disk, so lowering ``workers`` never strands queued mail;
* crash-only: when any worker ends, the supervisor SIGKILLs the others and exits with that worker's status
  (75 after a failed fsync, 128 + signal number after a signal); the next start is a recovery of every
  shard. Workers die with the supervisor (``PR_SET_PDEATHSIG``, set again after the switch to ``mail_owner``:
  :func:`mtaq.daemon.privileges.switch_to`), so ``kill -9`` of it stops them all;
* queue IDs are unique across shards: the low 4 bits of worker k's IDs are k (so at most 16 workers).

``workers = "auto"`` (the default) is one worker per core this process may run on
(``os.sched_getaffinity``), at most :data:`WORKERS_AUTO_MAX`. The admin API stays one public listener on
worker 0; every other worker serves the same API on ``SPOOL/shard-k/admin.sock`` (mode 0600, the same
token), and worker 0 fans each request out to them and merges the answers (:mod:`mtaq.admin.shards`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtaq.storage.shards import SHARD_PREFIX, existing_shards, shard_dir

if TYPE_CHECKING:
    from mtaq.edge.limits import ConnectionGate

__all__ = ["ADMIN_SOCKET", "LISTEN_BACKLOG", "SHARD_PREFIX", "WORKERS_AUTO_MAX", "WORKERS_MAX", "admin_socket",
           "auto_workers", "bind_listeners", "existing_shards", "log_dirs", "shard_count", "shard_dir", "supervise", "worker_anvil_socket",
           "workers_wanted"]

WORKERS_MAX = 16  # the queue ID carries the shard in 4 bits
# "auto" stops here: past a few workers the shared disk's fsyncs, not the CPU, bound a relay, and every
# worker is a whole daemon (memory, connections, a log of its own).
WORKERS_AUTO_MAX = 8
ADMIN_SOCKET = "admin.sock"  # in each shard k >= 1: the admin API of worker k, for worker 0 only
LISTEN_BACKLOG = 100  # connections the kernel queues per listening socket (asyncio's and Postfix's default)


def auto_workers() -> int:
    """``workers = "auto"``: the cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count``
    where that is missing), at least 1 and at most :data:`WORKERS_AUTO_MAX`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, WORKERS_AUTO_MAX))


def workers_wanted(workers: int | str, ports: list[int]) -> int:
    """The ``workers`` setting as a number: itself, or for ``"auto"`` :func:`auto_workers` (1 when a
    listener's port is 0, which only one process can take: a test's or a tool's throw-away daemon).
    ``ports``: the ports of the SMTP listeners."""
    if workers == "auto":
        return 1 if 0 in ports else auto_workers()
    return int(workers)


def admin_socket(spool: str, shard: int) -> str:
    """``SPOOL/shard-k/admin.sock``: where worker ``shard`` (>= 1) serves the admin API to worker 0."""
    return os.path.join(shard_dir(spool, shard), ADMIN_SOCKET)
_PR_SET_PDEATHSIG = 1
_anvil_socket: socket.socket | None = None  # in a worker: its end of the socketpair to the supervisor's anvil


def worker_anvil_socket() -> socket.socket | None:
    """In a worker forked by :func:`supervise` with an anvil: its socket to the supervisor (once; None after,
    and in any other process)."""
    global _anvil_socket
    sock, _anvil_socket = _anvil_socket, None
    return sock


def shard_count(spool: str, workers: int) -> int:
    """How many workers to start: ``workers``, or more if the spool already holds a higher shard.

    Raises ValueError when that is more than :data:`WORKERS_MAX`.
    """
    n = max(workers, 1 + max(existing_shards(spool), default=0))
    if n > WORKERS_MAX:
        raise ValueError(f"workers: {n} shards in {spool}, at most {WORKERS_MAX} are supported")
    return n


def log_dirs(spool: str) -> list[tuple[int, str]]:
    """``(shard, log directory)`` of every shard of ``spool`` (shard 0 first), for the log tools."""
    return [(k, os.path.join(shard_dir(spool, k), "log")) for k in [0, *existing_shards(spool)]]


def bind_listeners(addrs: list[tuple[str, int]], *, backlog: int = LISTEN_BACKLOG,
                   key: str = "listen") -> list[list[socket.socket]]:
    """Bind and listen on every ``(host, port)`` of ``addrs`` once, for all the workers to accept from.

    Returns, per address, its listening sockets (non-blocking; one per address family ``host`` resolves to,
    ``""`` meaning every interface, as asyncio's ``create_server`` does; IPv6 ones IPV6_V6ONLY), to be
    inherited by the forked workers. Raises OSError ``"<key> HOST:PORT: <why>"`` (``[HOST]:PORT`` for an IPv6
    address; the sockets bound so far are closed) when one cannot be resolved or bound; ``key`` is the
    setting that names the addresses.
    """
    out: list[list[socket.socket]] = []
    try:
        for host, port in addrs:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # as written in the config
            socks: list[socket.socket] = []
            out.append(socks)
            seen: set[tuple[int, object]] = set()
            try:
                infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except socket.gaierror as exc:
                raise OSError(exc.errno, f"{key} {where}: {exc.strerror}") from exc
            for family, type_, proto, _name, sa in infos:
                if (family, sa) in seen:
                    continue
                seen.add((family, sa))
                s = socket.socket(family, type_, proto)
                socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.bind(sa)
                except OSError as exc:
                    why = os.strerror(exc.errno) if exc.errno else str(exc)
                    raise OSError(exc.errno, f"{key} {where}: {why}") from exc
                s.listen(backlog)
                s.setblocking(False)
    except BaseException:
        for socks in out:
            for s in socks:
                s.close()
        raise
    return out


def _die_with_parent(parent: int) -> None:
    """Linux: get SIGKILL when the supervisor dies (no worker outlives it); exit at once if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)


def _status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return code if code >= 0 else 128 - code


def supervise(n: int, run_worker: Callable[[int], None], on_exit: Callable[[int, int], None],
              forked: Callable[[], None] = lambda: None, anvil: ConnectionGate | None = None,
              reconfigure: Callable[[], None] | None = None) -> int:
    """Fork ``n`` workers, each running ``run_worker(k)``; return the exit status of the first to end.

    The others are SIGKILLed and reaped first. ``on_exit(shard, status)`` is called (in the supervisor) for
    the worker that ended; ``forked()`` once every worker is forked (the supervisor closes its copies of the
    listening sockets there). Call this before any thread or event loop exists in the process (fork).
    ``anvil``: the host's gate; each worker gets a socketpair to it (:func:`worker_anvil_socket`) and the
    supervisor answers on them while it waits (:mod:`mtaq.daemon.anvil`); ``reconfigure()`` is called when a
    worker asks the anvil to read its limits again (``mtaq reload``). SIGHUP to the supervisor is passed on
    to every worker (each reloads: :mod:`mtaq.daemon.reload`).
    """
    from mtaq.daemon.anvil import AnvilServer, wait_serving

    global _anvil_socket
    me = os.getpid()
    pids: dict[int, int] = {}
    pairs = [socket.socketpair() for _ in range(n)] if anvil is not None else []
    for k in range(n):
        pid = os.fork()
        if pid == 0:  # the worker
            status = 0
            try:
                _die_with_parent(me)
                for j, (ours, theirs) in enumerate(pairs):
                    ours.close()
                    if j != k:
                        theirs.close()
                _anvil_socket = pairs[k][1] if pairs else None
                run_worker(k)
            except KeyboardInterrupt:
                status = 130
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc(file=sys.stderr)
                status = 70
            finally:
                sys.stderr.flush()
                os._exit(status)
        pids[pid] = k
    for _ours, theirs in pairs:
        theirs.close()
    server = AnvilServer(anvil, [ours for ours, _theirs in pairs], reconfigure=reconfigure) if anvil is not None else None

    def pass_on(signum: int, frame: object) -> None:
        for pid in list(pids):
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGHUP, pass_on)
    forked()
    status = 1
    try:
        while True:
            try:
                pid, wait_status = wait_serving(server, list(pids))
            except ChildProcessError:  # pragma: no cover - every worker reaped already
                break
            if pid in pids:
                status = _status(wait_status)
                on_exit(pids.pop(pid), status)
                break
    except KeyboardInterrupt:
        status = 130
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if server is not None:
            for sock in server.sockets:
                server.close(sock)
    return status
