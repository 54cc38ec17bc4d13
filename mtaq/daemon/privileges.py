"""Dropping root: ``mail_owner`` (Postfix's parameter of that name), and the permission checks made at start.

Started as root, ``mtaq serve`` binds every listener (SMTP and the admin API) and reads every key it needs
(TLS key, DKIM keys, outbound SASL password file, auth password file, ``smtp_tls_CAfile``: loaded into memory, so root-owned
files of mode 0600 are fine), makes the spool (and ``archive_dir``) owned by ``mail_owner``, and then
switches to that user for good (setgroups to its group only, setgid, setuid: no supplementary group, no
capability, no way back) before it reads the spool (recovery) or accepts a connection. With several workers
the supervisor binds and chowns, then every worker switches after loading its keys and before opening its
shard, and the supervisor switches once the workers are forked. Not started as root (``make run``, or a
systemd unit with ``User=mtaq`` and ``AmbientCapabilities=CAP_NET_BIND_SERVICE``, which may bind port 25
without root): nothing is switched. A reload that reads root-only keys again (issue 33) needs a process that
is still root, as Postfix's master is; mtaq keeps none.

Checked at every start (root or not), as OpenSSH and Postfix do, with a one-line ConfigError (exit 2): the
spool and ``archive_dir`` must not be writable by others; ``tls_key_file`` and ``auth_password_file`` must not
be readable or writable by group or others (DKIM keys and the outbound password file are checked where they are read, mtaq.edge.dkim
and mtaq.delivery.sasl); ``SPOOL/admin.token`` is tightened to 0600 when it is read (mtaq.admin.token).
"""

from __future__ import annotations

import ctypes
import os
import pwd
import stat
from dataclasses import dataclass
from typing import Any

from mtaq.config import Config
from mtaq.core.errors import ConfigError

__all__ = ["ADD_USER", "Owner", "check_files", "check_switched", "file_problems", "give_to", "mail_owner", "switch_to"]

ADD_USER = "useradd --system --no-create-home --shell /usr/sbin/nologin"  # the install step's command (+ name)


@dataclass(frozen=True)
class Owner:
    """The unprivileged user the daemon runs as: its name, uid and primary gid (from the passwd database)."""

    name: str
    uid: int
    gid: int


def mail_owner(cfg: Config) -> Owner | None:
    """``mail_owner`` when this process is root (effective uid 0), else None (nothing to switch).

    Raises ConfigError (one line) when the user does not exist or is root (uid or gid 0).
    """
    if os.geteuid() != 0:
        return None
    name = cfg.mail_owner
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"mail_owner {name!r}: no such user (started as root, mtaq runs as mail_owner; "
                          f"create it: {ADD_USER} {name})") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise ConfigError(f"mail_owner {name!r}: must not be root (uid {pw.pw_uid}, gid {pw.pw_gid})")
    return Owner(name, pw.pw_uid, pw.pw_gid)


def _writable_by_others(path: str, what: str) -> str | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None  # made at start, by the daemon, with a safe mode
    if st.st_mode & stat.S_IWOTH:
        return (f"{what}: {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must not be writable "
                "by others (chmod o-w)")
    return None


def _owner_only(path: str, key: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None  # named by the loader's own message (mtaq.edge.policy, mtaq.edge.auth)
    if st.st_mode & 0o077:
        return (f"{key}: {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must "
                "be readable only by its owner (chmod 600)")
    return None


def file_problems(cfg: Config) -> list[str]:
    """The permission checks made at start (see the module docstring), every problem one line; [] when none.

    The spool and ``archive_dir`` not writable by others; ``tls_key_file`` and ``auth_password_file`` (bcrypt
    hashes: an offline guessing target) with no group or other permission bit, as OpenSSH's private keys and
    Postfix's ``sasl_passwd`` advice. Not root, an existing spool must be writable and searchable by this
    user (root gives it to ``mail_owner``: :func:`give_to`)."""
    found = [_writable_by_others(cfg.spool_dir, "spool")]
    if cfg.archive_dir:
        found.append(_writable_by_others(cfg.archive_dir, "archive_dir"))
    if os.geteuid() != 0 and os.path.isdir(cfg.spool_dir) and not os.access(cfg.spool_dir, os.W_OK | os.X_OK):
        found.append(f"spool: {cfg.spool_dir} is not writable by uid {os.geteuid()}, the daemon's user "
                     "(chown it to that user)")
    if cfg.tls_key_file:
        found.append(_owner_only(cfg.tls_key_file, "tls_key_file"))
    if cfg.auth_password_file:
        found.append(_owner_only(cfg.auth_password_file, "auth_password_file"))
    return [f for f in found if f is not None]


def check_files(cfg: Config) -> None:
    """:func:`file_problems`; raises ConfigError with the first one (one line)."""
    found = file_problems(cfg)
    if found:
        raise ConfigError(found[0])


def give_to(owner: Owner, cfg: Config) -> None:
    """Make the spool (created if missing, mode 0700) and ``archive_dir`` and everything in them owned by
    ``owner``, as root (``postfix set-permissions``): what root wrote there (``mtaq queue``, an earlier start as
    root, a restored copy) stays writable by the daemon; the files in ``SPOOL/maildrop`` and
    ``SPOOL/corrupt/maildrop`` stay their submitters' (the directories are given). Symbolic links are not followed, and a regular file
    with more than one link is left alone (a hard link the previous run's user made to a file elsewhere must
    not make root give that file away)."""
    from mtaq.storage import maildrop as md
    from mtaq.storage.fs import OsFileSystem, make_durable_dirs

    make_durable_dirs(OsFileSystem(), cfg.spool_dir)
    keep_owners = {os.path.join(cfg.spool_dir, md.MAILDROP_DIR), os.path.join(cfg.spool_dir, md.ASIDE_DIR)}
    for top in (cfg.spool_dir, cfg.archive_dir):
        if not top:
            continue
        make_durable_dirs(OsFileSystem(), top)  # 0700 under serve's umask 077
        os.chown(top, owner.uid, owner.gid)
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                _give(os.path.join(root, name), owner)
            if top == cfg.spool_dir:
                # The maildrop's files (and those set aside from it) stay their submitters': the owner is the
                # local user the pick-up names in Received: (mtaq.edge.pickup); the directories are given.
                dirs[:] = [d for d in dirs if os.path.join(root, d) not in keep_owners]


def _give(path: str, owner: Owner) -> None:
    st = os.lstat(path)
    if (st.st_uid, st.st_gid) == (owner.uid, owner.gid):
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        os.lchown(path, owner.uid, owner.gid)  # a socket, a symbolic link itself
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # gone, or replaced by a link meanwhile
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
            os.fchown(fd, owner.uid, owner.gid)
    finally:
        os.close(fd)


def switch_to(owner: Owner, cfg: Config) -> None:
    """Become ``owner`` for good: supplementary groups = its group only, then gid, then uid (which clears
    every capability). Raises ConfigError (one line) when the switch does not hold or ``owner`` cannot
    write the spool (e.g. a parent directory it may not search)."""
    _load_trust_anchors(cfg)
    death_signal, parent = _parent_death_signal(), os.getppid()
    os.setgroups([owner.gid])
    os.setgid(owner.gid)
    os.setuid(owner.uid)
    if death_signal:
        _rearm_parent_death_signal(death_signal, parent)
    check_switched(owner)
    stdlib = os.path.dirname(os.__file__)  # modules imported later (lazily) are read as owner
    if not os.access(stdlib, os.R_OK | os.X_OK):
        raise ConfigError(f"mail_owner {owner.name!r}: cannot read the Python installation {stdlib}")
    if not os.access(cfg.spool_dir, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"mail_owner {owner.name!r}: cannot use the spool {cfg.spool_dir} "
                          "(a parent directory it may not search?)")


_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2


def _prctl() -> Any:
    """libc's ``prctl`` (Linux), or None."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None


def _parent_death_signal() -> int:
    """The signal this process gets when its parent dies (``PR_GET_PDEATHSIG``; 0: none, or not Linux)."""
    prctl = _prctl()
    sig = ctypes.c_int(0)
    if prctl is None or prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0) != 0:
        return 0
    return sig.value


def _rearm_parent_death_signal(sig: int, parent: int) -> None:
    """Set the parent-death signal ``sig`` again: Linux clears it when a process changes its uid or gid
    (prctl(2), PR_SET_PDEATHSIG), so a worker that switched to ``mail_owner`` would outlive a ``kill -9`` of
    its supervisor and keep serving its port. If the parent (pid ``parent`` before the switch) died in
    between, this process gets ``sig`` now, as it would have."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _load_trust_anchors(cfg: Config) -> None:
    """``smtp_tls_CAfile`` into the verified-context cache while still root (it is otherwise read at the first
    verified delivery, when a root-only file could no longer be read). A bad file is left to delivery to
    report, as before."""
    if not cfg.smtp_tls_CAfile:
        return
    import ssl

    from mtaq.delivery.security import verified_context

    try:
        verified_context(cfg.smtp_tls_CAfile)
    except (OSError, ssl.SSLError):
        pass


def check_switched(owner: Owner) -> None:
    """Raise ConfigError unless every uid and gid of this process is ``owner``'s and root cannot be regained."""
    if os.getresuid() != (owner.uid,) * 3 or os.getresgid() != (owner.gid,) * 3:
        raise ConfigError(f"mail_owner {owner.name!r}: the switch did not hold")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise ConfigError(f"mail_owner {owner.name!r}: root could be regained")
