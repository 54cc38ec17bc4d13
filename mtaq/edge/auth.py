"""The password file for SMTP AUTH (RFC 4954): ``user:hash`` lines, hashes made with bcrypt.

The format is that of Apache's ``htpasswd -B`` (bcrypt, ``$2b$``/``$2y$``/``$2a$``), so either ``mtaq passwd
USER`` or ``htpasswd -nB USER`` makes a line. Blank lines and lines starting with ``#`` are ignored. A user
name is 1 to 255 printable ASCII characters without ``:``; bcrypt uses at most 72 bytes of a password, so
longer passwords are refused when hashing and never match.

Must always hold: no clear-text password is stored or logged; an unknown user costs the same bcrypt
check as a known one (no user enumeration by timing); :meth:`PasswordFile.verify` blocks for the bcrypt
work (tens to hundreds of milliseconds), so the SMTP server calls it in a thread.
"""

from __future__ import annotations

import bcrypt

from mtaq.core.errors import ConfigError

__all__ = ["PASSWORD_MAX_BYTES", "PasswordFile", "hash_password", "valid_user"]

PASSWORD_MAX_BYTES = 72
"""bcrypt reads at most this many bytes of a password."""
_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")


def valid_user(user: str) -> bool:
    """1 to 255 printable US-ASCII characters, no ``:`` and no space."""
    return 0 < len(user) <= 255 and all("!" <= c <= "~" for c in user) and ":" not in user


def hash_password(password: bytes, *, rounds: int = 12) -> str:
    """A bcrypt hash of ``password`` (``$2b$``, cost ``rounds``, 4..31). ValueError if it is empty or > 72 bytes."""
    if not password:
        raise ValueError("empty password")
    if len(password) > PASSWORD_MAX_BYTES:
        raise ValueError(f"password longer than {PASSWORD_MAX_BYTES} bytes (bcrypt's limit)")
    return bcrypt.hashpw(password, bcrypt.gensalt(rounds=rounds)).decode("ascii")


class PasswordFile:
    """User name -> bcrypt hash, from a password file; :meth:`verify` checks a user's password."""

    def __init__(self, hashes: dict[str, bytes]) -> None:
        self._hashes = dict(hashes)
        # Checked when the user is unknown, so that the answer takes as long as for a known user: a hash
        # of the highest cost in the file, made on first use.
        self._cost = max((int(h[4:6]) for h in self._hashes.values()), default=4)
        self._dummy: bytes | None = None

    def __len__(self) -> int:
        return len(self._hashes)

    @classmethod
    def load(cls, path: str) -> PasswordFile:
        """Read ``path``. Raises ConfigError naming ``auth_password_file``, the file and the line."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"auth_password_file: {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"auth_password_file: {path}: not UTF-8 text") from exc
        return cls.parse(text, source=path)

    @classmethod
    def parse(cls, text: str, *, source: str = "<text>") -> PasswordFile:
        """Parse ``user:hash`` lines. Raises ConfigError for a bad line or a user given twice."""
        hashes: dict[str, bytes] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, hashed = line.partition(":")
            where = f"auth_password_file: {source} line {n}"
            if not sep or not valid_user(user):
                raise ConfigError(f"{where}: expected user:hash with a user name of printable ASCII")
            h = hashed.encode("ascii", "replace")
            if not h.startswith(_PREFIXES) or len(h) != 60 or not h[4:6].isdigit() or h[6:7] != b"$":
                raise ConfigError(f"{where}: not a bcrypt hash ($2b$..., 60 characters; make one with mtaq passwd)")
            if user in hashes:
                raise ConfigError(f"{where}: user {user!r} given twice")
            hashes[user] = h
        return cls(hashes)

    def verify(self, user: str, password: bytes) -> bool:
        """Whether ``password`` is ``user``'s. Blocking (bcrypt); never raises for bad input."""
        hashed = self._hashes.get(user)
        if hashed is None or not password or len(password) > PASSWORD_MAX_BYTES:
            if self._dummy is None:
                self._dummy = bcrypt.hashpw(b"mtaq-no-such-user", bcrypt.gensalt(rounds=self._cost))
            bcrypt.checkpw(b"x", self._dummy)  # the same work as a real check
            return False
        try:
            return bool(bcrypt.checkpw(password, hashed))
        except ValueError:
            return False
