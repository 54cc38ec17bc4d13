"""Run the real daemon and sink as subprocesses, and read what arrived (for tests and bench/ scripts).

Nothing here is a fake: the daemon and the sink are the ``mtaq`` command, spoken to over real sockets.
"""

from __future__ import annotations

import datetime as dt
import email.parser
import email.policy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Proc", "admin_token", "admin_url", "children", "free_port", "free_port_on", "mail_owner_ready", "maildir_count",
           "maildir_message_ids", "peak_rss_kib", "start_daemon", "start_sink", "wait_for", "wait_port"]


_GIVEN: set[int] = set()  # the ports free_port returned in this process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and that no earlier call in this process returned.

    A test often takes several ports before anything binds them (its own listener's, then the sink's, the
    daemon's, the admin API's), and the kernel may hand the same free port out again a few calls later
    (about 1 in 4,000 within four calls here). Two of them equal made a test's submission listener and its
    daemon's port-25 listener one listener (``listeners_of`` merges a listeners table into the ``listen``
    address it names), and the plain connection got 530 5.7.0 (stop 50's second suite run). Raises
    RuntimeError when 100 tries give only ports returned before."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no TCP port on 127.0.0.1 that free_port had not returned before")


def low_free_port(ports: Sequence[int] = (25, *range(1000, 600, -1))) -> int:
    """The first of ``ports`` (default: 25, then 1000 down to 601) free on 127.0.0.1 a moment ago: a port
    below 1024 needs root or CAP_NET_BIND_SERVICE to bind. Raises RuntimeError when none is free."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port below 1024 free on 127.0.0.1")


def proc_status(pid: int) -> dict[str, list[str]]:
    """The fields of /proc/PID/status (Uid, Gid, Groups, CapEff, NoNewPrivs, Seccomp...), each split on
    whitespace."""
    out: dict[str, list[str]] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.split()
    return out


def free_port_on(hosts: Sequence[str]) -> int:
    """A TCP port that was free a moment ago on every one of ``hosts`` (e.g. 127.0.0.2, 127.0.0.3, ...)."""
    for _ in range(100):
        port = free_port()
        try:
            for h in hosts:
                with socket.socket() as s:
                    s.bind((h, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {list(hosts)}")


def mail_owner_ready(*paths: str, user: str = "mtaq") -> None:
    """Run as root (the tests are): let a daemon that switches to ``user`` (``mail_owner``; created with the
    install step's ``useradd`` when missing) reach ``paths`` and the Python it runs on. Every directory above
    them (the interpreter's, the standard library's, mtaq's and its packages', pytest's 0700 temporary
    directories) gets search permission for others (o+x: entering, not listing). Not root: nothing."""
    if os.geteuid() != 0:
        return
    import pwd

    try:
        pwd.getpwnam(user)
    except KeyError:
        # The install step's command (mtaq.daemon.privileges.ADD_USER; testing may not import the daemon).
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                       check=True, capture_output=True)
    import aiohttp

    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # mtaq/, this file's grandparent
    code = [os.path.realpath(sys.executable), os.path.dirname(os.path.realpath(os.__file__)),
            package, os.path.realpath(os.path.dirname(aiohttp.__file__))]
    for path in [*code, *(os.path.abspath(p) for p in paths)]:
        d = path if os.path.isdir(path) else os.path.dirname(path)
        while True:
            try:
                st = os.stat(d)
            except FileNotFoundError:
                pass
            else:
                if not st.st_mode & 0o001:
                    os.chmod(d, st.st_mode | 0o001)
            if d == os.path.dirname(d):
                break
            d = os.path.dirname(d)


def peak_rss_kib(pid: int) -> int | None:
    """Peak resident set size of process ``pid`` in KiB (``VmHWM`` in /proc/PID/status), or None if gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def wait_port(
    port: int, timeout_s: float = 15.0, proc: subprocess.Popen[bytes] | None = None, host: str = "127.0.0.1"
) -> None:
    """Wait until something accepts connections on ``host``:``port``; raise RuntimeError on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on {host}:{port} after {timeout_s}s")


@dataclass
class Proc:
    """A running ``mtaq`` subprocess; stderr goes to ``log_path``."""

    popen: subprocess.Popen[bytes]
    port: int
    log_path: str
    started: float = field(default_factory=time.monotonic)

    def kill9(self) -> None:
        """SIGKILL and reap (the only stop of a crash-only daemon), the worker processes of a supervisor
        (``workers`` > 1) too; returns once none of them can write anything any more."""
        kids = children(self.popen.pid) if self.popen.poll() is None else []
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait()
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in kids) and time.monotonic() < deadline:
            time.sleep(0.01)

    def children(self) -> list[int]:
        """PIDs of the processes this one started (the workers of a supervisor)."""
        return children(self.popen.pid)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``pred()`` every 50 ms until it returns something true, and return that; AssertionError naming
    ``what`` after ``timeout_s`` seconds (for tests waiting on another process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> list[int]:
    """PIDs of the live child processes of ``pid`` (Linux /proc; [] elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(name))
    return out


def _parent_of(pid: int) -> int | None:
    """The parent PID of ``pid`` (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a killed child whose reaper has not come yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _mtaq(args: Sequence[str], log_path: str, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    out = open(log_path, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "mtaq.cli", *args],
        stdout=out,
        stderr=out,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def start_sink(
    maildir: str, log_path: str, *, port: int | None = None, extra: Sequence[str] = (), host: str = "127.0.0.1"
) -> Proc:
    """Start ``mtaq sink`` on ``host`` (an IPv6 address too: ``::1``) writing to ``maildir``; returns once it
    listens."""
    port = port or free_port()
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    p = _mtaq(["--log-format", "json", "sink", "--listen", listen, "--maildir", maildir, *extra], log_path, None)
    wait_port(port, proc=p, host=host)
    return Proc(p, port, log_path)


def start_daemon(
    spool: str,
    relay_port: int | None,
    log_path: str,
    *,
    port: int | None = None,
    config: str | None = None,
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
    admin_listen: str | None = "127.0.0.1:0",
    extra: Sequence[str] = (),
    workers: int | str | None = 1,
) -> Proc:
    """Start ``mtaq serve`` on ``spool`` relaying to 127.0.0.1:``relay_port``; returns once SMTP listens
    (the admin API listens before SMTP does, so ``SPOOL/admin.json`` is there by then). Raises RuntimeError
    when it does not listen in time, after killing it (never two daemons on one spool).

    With ``relay_port`` None there is no ``--relayhost`` flag: the config file (or the default) decides.
    ``admin_listen`` is the ``--admin-listen`` flag (default: a free port on 127.0.0.1, so that daemons
    started side by side never share 2580); None leaves it to the config file.
    ``extra``: more ``mtaq serve`` flags (e.g. ``--mynetworks``).
    ``workers`` is the ``--workers`` flag: 1 by default (a test about something else reads ``SPOOL/log``
    as the one log), ``"auto"`` the daemon's own default, None leaves it to the config file.
    """
    port = port or free_port()
    args = ["--log-format", "json", "serve", "--spool", spool, "--listen", f"127.0.0.1:{port}"]
    if admin_listen is not None:
        args += ["--admin-listen", admin_listen]
    if relay_port is not None:
        args += ["--relayhost", f"[127.0.0.1]:{relay_port}"]
    if config:
        args += ["--config", config]
    if workers is not None:
        args += ["--workers", str(workers)]
    args += list(extra)
    mail_owner_ready(spool)  # run as root: the daemon switches to mail_owner (mtaq.daemon.privileges)
    if wrapper:
        out = open(log_path, "ab")
        p = subprocess.Popen([*wrapper, sys.executable, "-m", "mtaq.cli", *args], stdout=out, stderr=out,
                             stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    else:
        p = _mtaq(args, log_path, env)
    try:
        wait_port(port, proc=p)
        if _admin_enabled(admin_listen, config):
            wait_admin_json(spool, p)
    except BaseException:
        # A daemon that is only slow to listen (a start fsyncing many segments on a loaded machine) must not
        # live on unseen beside the next one started on the same spool.
        if p.poll() is None:
            p.kill()
            p.wait()
        raise
    return Proc(p, port, log_path)


def _admin_enabled(flag: str | None, config: str | None) -> bool:
    """Whether the daemon started with this ``--admin-listen`` flag (None: none) and config file serves the API."""
    if flag is not None:
        return bool(flag.strip())
    from mtaq.config import Config, load_config

    return bool((load_config(config, {}) if config else Config()).admin_listen.strip())


def wait_admin_json(spool: str, proc: subprocess.Popen[bytes], *, timeout_s: float = 30.0) -> None:
    """Wait until ``SPOOL/admin.json`` names ``proc`` (or one of its worker processes) as its writer: the
    admin API starts just after SMTP listens (its import does not delay the first 250), so the port alone
    does not say it is up, and a file left by the previous run names the previous process."""
    path = os.path.join(spool, "admin.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as f:
                pid = json.load(f).get("pid")
            if pid == proc.pid or (isinstance(pid, int) and _parent_of(pid) == proc.pid):
                return
        except (FileNotFoundError, ValueError, AttributeError):
            pass  # not there yet, or being replaced
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before writing {path}")
        time.sleep(0.01)
    raise RuntimeError(f"no fresh {path} after {timeout_s}s")


def admin_token(spool: str) -> str:
    """The bearer token the daemon on ``spool`` generated into ``SPOOL/admin.token`` ("" if none)."""
    try:
        with open(os.path.join(spool, "admin.token"), encoding="ascii") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def admin_url(spool: str) -> str:
    """The admin API's URL that the daemon on ``spool`` wrote into ``SPOOL/admin.json``."""
    with open(os.path.join(spool, "admin.json"), encoding="utf-8") as f:
        return str(json.load(f)["url"])


def read_events(path: str) -> list[dict[str, Any]]:
    """The JSON log events (one object per line, ``--log-format json``) in the file at ``path``.

    Lines that are not JSON objects (a traceback, a line cut by a kill) are skipped; a missing file is [].
    """
    events: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    events.append(ev)
    except FileNotFoundError:
        pass
    return events


def event_time(ev: dict[str, Any]) -> float | None:
    """An event's ``timestamp`` (ISO 8601, UTC) as seconds since the epoch, or None."""
    t = ev.get("timestamp")
    if not isinstance(t, str):
        return None
    try:
        return dt.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def log_problems(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The warning-or-worse events, and the lines that are not JSON (tracebacks), of a JSON log file."""
    bad = [e for e in read_events(path) if e.get("level") in ("warning", "error", "critical", "exception")]
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            other = [line.rstrip() for line in f if line.strip() and not line.lstrip().startswith("{")]
    except FileNotFoundError:
        other = []
    return bad, other


def maildir_message_ids(maildir: str) -> Counter[str]:
    """Message-ID -> how many deliveries (one per Delivered-To line) the sink stored."""
    ids: Counter[str] = Counter()
    parser = email.parser.BytesHeaderParser(policy=email.policy.compat32)
    for sub in ("new", "cur"):
        d = os.path.join(maildir, sub)
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            with open(os.path.join(d, name), "rb") as f:
                msg = parser.parse(f)
            mid = (msg.get("Message-ID") or "").strip()
            ids[mid] += max(1, len(msg.get_all("Delivered-To") or []))
    return ids


def maildir_count(maildir: str) -> int:
    """Number of message files in the Maildir (cheap; no parsing)."""
    n = 0
    for sub in ("new", "cur"):
        d = os.path.join(maildir, sub)
        if os.path.isdir(d):
            n += len(os.listdir(d))
    return n
