"""Outbound AUTH (RFC 4954): which credentials a next hop gets, and the memory of refused ones.

Postfix's ``smtp_sasl_auth_enable`` with ``smtp_sasl_password_maps``. The password file
(``smtp_sasl_password_file``) has Postfix's sasl_passwd lines::

    # KEY                          user:password
    [smtp.example.com]:587         relay@example.com:secret
    @example.org                   org-relay:other secret     (with smtp_sender_dependent_authentication)

The user name ends at the first ``:``; the password is the rest of the line (it may hold ``:`` and spaces).
Keys are folded to lower case; a key written with its ``transport_map`` transport (``smtps:[host]:465``)
is the same as the next hop alone (``[host]:465``, Postfix's form). Lookup, first match wins (Postfix ``smtp_sasl_passwd_lookup``): with
``smtp_sender_dependent_authentication`` the sender address, then ``@domain`` of the sender; then the next
hop as written in ``relayhost`` or ``transport_map`` (``[host]:port``, then ``[host]``; for an MX next hop
``host:port``, then ``host``). No entry: no AUTH.

The file must be readable by the daemon only: a mode with any group or other bit set stops the start
(ConfigError, exit 2), as a password readable by everyone on the host is a password given away.
No secret is ever put in a log line, an event, a reply or an exception text: errors name the file and the
line number, never the line.

A 5xx reply to AUTH (535 5.7.8 "credentials invalid") means the next try would fail the same way, and
providers lock accounts after a few: the credentials are *held* for ``smtp_sasl_auth_failure_hold_s``
(default 300 s): mail that would use them is deferred with the remembered reply without connecting. A 4xx
to AUTH (454 4.7.0) is not remembered. ``mtaq reload`` (SIGHUP) reads the file again and ends the hold of
every entry whose user name or password changed (:meth:`SaslClient.keep_holds`); the hold of an unchanged
entry stays until it runs out.

The hold is the host's, not one process's: with a :class:`HoldMap` (the daemon passes ``SPOOL/sasl_hold``,
:class:`mtaq.storage.sharedmap.SharedMap`) every worker sees every hold, and it outlives a restart (so a
restart loop cannot lock the account either). Its entries are keyed by a SHA-256 of the entry's key, user
name and password (never the password itself): a changed password is not held, whichever process held the
old one.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mtaq.config import Config
from mtaq.core.errors import ConfigError
from mtaq.delivery.relay import Reply
from mtaq.delivery.security import Credentials

__all__ = ["HoldMap", "SaslClient", "load_password_file", "nexthop_keys"]


class HoldMap(Protocol):
    """A map shared by the daemon's processes (:class:`mtaq.storage.sharedmap.SharedMap`): ``read()`` the map
    as it is now; ``update(change)`` applies ``change`` to it under a lock (raises OSError)."""

    def read(self) -> dict[str, Any]: ...

    def update(self, change: Callable[[dict[str, Any]], None]) -> None: ...


def _fingerprint(cred: Credentials) -> str:
    """The hold map's key of ``cred``: SHA-256 of key, user name and password (hex)."""
    return hashlib.sha256(f"{cred.key}\0{cred.username}\0{cred.password}".encode()).hexdigest()


def load_password_file(path: str) -> dict[str, tuple[str, str]]:
    """Read a password file (format in the module text) -> {key: (user, password)}.

    Raises ConfigError ``PATH: ...`` when the file cannot be read, when its mode gives group or other any
    access (RFC-less, Postfix's own advice: ``chmod 600``), or naming the line number of a bad line (never
    its text).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path}: smtp_sasl_password_file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: smtp_sasl_password_file: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{path}: smtp_sasl_password_file: mode {mode:04o} gives group or other access to the "
                f"passwords; make it readable by the daemon only (chmod 600 {path})"
            )
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            raw = f.read(1024 * 1024 + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > 1024 * 1024:
        raise ConfigError(f"{path}: smtp_sasl_password_file: larger than 1 MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: smtp_sasl_password_file: not UTF-8 text") from None
    out: dict[str, tuple[str, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        user, colon, password = parts[1].strip().partition(":") if len(parts) == 2 else ("", "", "")
        if not colon or not user or not password:
            raise ConfigError(f"{path}: smtp_sasl_password_file: line {n}: expected 'KEY user:password'")
        if any(ord(c) < 32 or ord(c) == 127 for c in user + password):
            raise ConfigError(f"{path}: smtp_sasl_password_file: line {n}: control character in user or password")
        key = parts[0].lower()
        for transport in ("smtps:", "smtp:"):  # `smtps:[host]:465` as in transport_map: the key is its next hop
            if key.startswith(transport):
                key = key[len(transport):]
        out[key] = (user, password)
    return out


def nexthop_keys(host: str, port: int, mx: bool) -> tuple[str, ...]:
    """The password-file keys of a next hop, most specific first: ``[host]:port``, ``[host]`` for a
    bracketed (no MX) next hop; ``host:port``, ``host`` for an MX one."""
    host = host.lower()
    return (f"{host}:{port}", host) if mx else (f"[{host}]:{port}", f"[{host}]")


@dataclass
class SaslClient:
    """Credentials by sender and next hop, and the credentials held after a 5xx to AUTH (module text)."""

    passwords: dict[str, tuple[str, str]]
    sender_dependent: bool = False
    allow_plaintext: bool = False
    hold_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    # The host's holds (every worker's; module text), None: this process's only. Its times are wall-clock
    # UTC seconds (``wall``): other processes and the next start read them.
    shared: HoldMap | None = None
    wall: Callable[[], float] = time.time
    _held: dict[Credentials, tuple[float, Reply]] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:  # never the passwords
        return f"SaslClient(entries={len(self.passwords)}, sender_dependent={self.sender_dependent})"

    @classmethod
    def from_config(cls, cfg: Config) -> SaslClient | None:
        """None unless ``smtp_sasl_auth_enable``; raises ConfigError (see :func:`load_password_file`)."""
        if not cfg.smtp_sasl_auth_enable:
            return None
        if not cfg.smtp_sasl_password_file:
            raise ConfigError("smtp_sasl_password_file: required when smtp_sasl_auth_enable is true")
        return cls(
            load_password_file(cfg.smtp_sasl_password_file),
            sender_dependent=cfg.smtp_sender_dependent_authentication,
            allow_plaintext=cfg.smtp_sasl_allow_plaintext,
            hold_s=cfg.smtp_sasl_auth_failure_hold_s,
        )

    def credentials(self, sender: str, nexthop: Iterable[str]) -> Credentials | None:
        """The credentials for mail from ``sender`` to the next hop with keys ``nexthop`` (see
        :func:`nexthop_keys`); None when no entry matches (the mail goes without AUTH)."""
        keys: list[str] = []
        if self.sender_dependent and "@" in sender:
            local, _, domain = sender.rpartition("@")
            keys += [f"{local}@{domain.lower()}".lower(), f"@{domain.lower()}"]
        keys += list(nexthop)
        for k in keys:
            found = self.passwords.get(k)
            if found is not None:
                return Credentials(k, found[0], found[1])
        return None

    def held(self, cred: Credentials) -> Reply | None:
        """The deferral reply while ``cred`` is held after a 5xx to AUTH (by any process of the host, with
        ``shared``), else None."""
        if self.shared is not None:
            entry = self.shared.read().get(_fingerprint(cred))
            try:
                until, code, enhanced, text = float(entry[0]), int(entry[1]), str(entry[2]), str(entry[3])  # type: ignore[index]
            except (TypeError, ValueError, IndexError, KeyError):
                pass  # none, or not one of ours: this process's own hold decides
            else:
                left = min(until - self.wall(), self.hold_s)  # a clock stepped back holds no longer than hold_s
                if left > 0:
                    return Reply(code, enhanced, f"{text} (not tried again for {left:.0f} s: smtp_sasl_auth_failure_hold_s)")
        h = self._held.get(cred)
        if h is None:
            return None
        until, reply = h
        if self.clock() >= until:
            del self._held[cred]
            return None
        return Reply(reply.code, reply.enhanced,
                     f"{reply.text} (not tried again for {until - self.clock():.0f} s: smtp_sasl_auth_failure_hold_s)")

    def keep_holds(self, old: SaslClient | None) -> list[str]:
        """After a reload: keep ``old``'s holds of the credentials this client still has unchanged (same
        key, user name and password); return the password-file keys whose hold ends here because their
        entry changed or went (never a password)."""
        cleared: list[str] = []
        if self.shared is not None:
            current = {_fingerprint(Credentials(k, u, p)) for k, (u, p) in self.passwords.items()}
            wall = self.wall()

            def prune(holds: dict[str, Any]) -> None:
                for fp, entry in list(holds.items()):
                    try:
                        live = float(entry[0]) > wall
                        key = str(entry[4])
                    except (TypeError, ValueError, IndexError, KeyError):
                        live, key = False, ""
                    if live and fp in current:
                        continue
                    if live:
                        cleared.append(key)
                    del holds[fp]

            try:
                self.shared.update(prune)
            except OSError:
                pass  # advisory: a changed entry is not held anyway (its fingerprint changed)
        if old is None:
            return sorted(set(cleared))
        now = set(self.passwords.items())
        for cred, held in old._held.items():
            if old.clock() >= held[0]:
                continue  # ran out anyway
            if (cred.key, (cred.username, cred.password)) in now:
                self._held[cred] = held
            else:
                cleared.append(cred.key)
        return sorted(set(cleared))

    def failed(self, cred: Credentials, reply: Reply) -> None:
        """Hold ``cred`` for ``hold_s`` seconds after the AUTH failure ``reply`` (a 5xx from the server)."""
        if self.hold_s <= 0:
            return
        self._held[cred] = (self.clock() + self.hold_s, reply)
        if self.shared is not None:
            wall = self.wall()
            entry = [wall + self.hold_s, reply.code, reply.enhanced, reply.text, cred.key]

            def put(holds: dict[str, Any]) -> None:
                for fp, e in list(holds.items()):  # those that ran out go
                    try:
                        if float(e[0]) <= wall:
                            del holds[fp]
                    except (TypeError, ValueError, IndexError, KeyError):
                        del holds[fp]
                holds[_fingerprint(cred)] = entry

            try:
                self.shared.update(put)
            except OSError:
                pass  # advisory: this process holds them still
