"""The admin API's generated bearer token, ``SPOOL/admin.token`` (mode 0600), read and made without aiohttp.

``mtaq serve`` with several workers makes it before forking them, so that every worker (worker 0's public
API and the other workers' internal sockets) checks the same token (:mod:`mtaq.daemon.workers`).
"""

from __future__ import annotations

import os
import secrets

__all__ = ["ADMIN_TOKEN", "read_spool_token", "spool_token"]

ADMIN_TOKEN = "admin.token"  # the generated bearer token when admin_token is not configured (mode 0600)
_TOKEN_BYTES = 32


def spool_token(spool: str) -> str:
    """The bearer token kept in ``SPOOL/admin.token``, created (32 random bytes, URL-safe base64, mode 0600)
    when the file is missing, empty or unreadable as a token. Not fsync'd: a token lost in a power cut is
    made again at the next start, and ``mtaq queue`` reads whatever the running daemon wrote. Raises OSError
    when the spool cannot be written."""
    path = os.path.join(spool, ADMIN_TOKEN)
    token = read_spool_token(spool)
    if token:
        os.chmod(path, 0o600)  # a copy restored with a looser mode is tightened
        return token
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def read_spool_token(spool: str) -> str:
    """The token in ``SPOOL/admin.token``, or "" when there is none (missing, empty or not a token).
    Raises PermissionError when the file exists but this user may not read it."""
    try:
        with open(os.path.join(spool, ADMIN_TOKEN), encoding="ascii", errors="replace") as f:
            token = f.read(256).strip()
    except FileNotFoundError:
        return ""
    ok = len(token) >= 16 and all(c.isalnum() or c in "-_" for c in token)
    return token if ok else ""
