"""Per-connection and per-command costs of aiosmtpd taken off the hot path (issue 8), behaviour unchanged.

aiosmtpd's ``SMTP.__init__`` builds its command and AUTH tables on *every* connection from ``dir(self)``
and ``inspect.getmembers(self)``; the latter calls ``getattr`` on every attribute of the protocol object,
properties included, which cost more than the rest of a short session. And ``SMTP._getaddr`` defines a
``typing.Protocol`` class on every call before it parses the address of each MAIL and RCPT with the email
package's RFC 5322 parser (``get_angle_addr`` / ``get_addr_spec``).

:class:`FastPathMixin`, placed before aiosmtpd's ``SMTP`` in the bases of the protocol class, changes both:

* the command table (``_smtp_methods``) is a mapping that binds ``smtp_<COMMAND>`` when a command is looked
  up, over the class's ``smtp_*`` names computed once per class, instead of ~20 bound methods made per
  connection; the AUTH table (``_auth_methods``) is built from the class's ``auth_*`` names, computed once
  per class (what ``inspect.getmembers(self)`` found, without the per-connection walk); both are set by
  :meth:`FastPathMixin._fast_tables` right after ``SMTP.__init__``, during which ``__dir__`` lists nothing;
* ``__dir__`` lists only the ``smtp_*`` and ``auth_*`` names of the class (all aiosmtpd looks for there);
* ``__dir__`` of a handler with :class:`FastHandlerMixin` lists only its ``handle_*`` and ``auth_*`` names:
  aiosmtpd also runs ``inspect.getmembers(handler)`` (for AUTH mechanisms) and ``dir(handler)`` (for the
  ``handle_*`` hooks) on every connection;
* ``_getaddr`` parses as aiosmtpd does (the same parser functions, the same ``local_part_limit`` rule, the
  same ``(address, rest)`` / ``(None, None)`` results, RFC 5321 §4.1.2), without the class, and remembers
  the last ``ADDRESS_CACHE_MAX`` results: senders and recipients repeat.

What must always hold: the replies and the envelope are exactly what aiosmtpd alone would produce.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from email._header_value_parser import get_addr_spec, get_angle_addr
from email.errors import HeaderParseError
from typing import Any

from aiosmtpd.smtp import _AuthMechAttr

__all__ = ["ADDRESS_CACHE_MAX", "BoundCommands", "FastHandlerMixin", "FastPathMixin"]

ADDRESS_CACHE_MAX = 4096
"""Parsed MAIL/RCPT arguments kept (the cache is emptied when it reaches this many)."""

_parsed: dict[tuple[str, int], tuple[str | None, str | None]] = {}


_names: dict[tuple[type, tuple[str, ...]], tuple[str, ...]] = {}


def _table_names(cls: type, prefixes: tuple[str, ...] = ("smtp_", "auth_")) -> tuple[str, ...]:
    names = _names.get((cls, prefixes))
    if names is None:
        names = _names[cls, prefixes] = tuple(n for n in dir(cls) if n.startswith(prefixes))
    return names


_auth_names: dict[type, tuple[tuple[str, str], ...]] = {}


def _class_auth(cls: type) -> tuple[tuple[str, str], ...]:
    """``(mechanism, method name)`` of every ``auth_*`` method of ``cls``, named as aiosmtpd names them: the
    ``__auth_mechanism_name__`` of ``@auth_mechanism``, else the name without ``auth_``, ``__`` as ``-``."""
    found = _auth_names.get(cls)
    if found is None:
        found = _auth_names[cls] = tuple(
            (getattr(getattr(cls, n), "__auth_mechanism_name__", n.replace("auth_", "").replace("__", "-")), n)
            for n in _table_names(cls, ("auth_",)))
    return found


class BoundCommands(Mapping[str, Any]):
    """aiosmtpd's command table of one connection (``{"MAIL": self.smtp_MAIL, ...}``) without building it:
    ``table[command]`` binds ``smtp_<command>`` of ``obj`` when asked (KeyError for a command it lacks)."""

    __slots__ = ("_names", "_obj")

    def __init__(self, obj: object, names: Collection[str]) -> None:
        self._obj = obj
        self._names = names

    def __getitem__(self, command: str) -> Any:
        if command in self._names:
            return getattr(self._obj, "smtp_" + command)
        raise KeyError(command)

    def get(self, command: str, default: Any = None) -> Any:
        if command in self._names:
            return getattr(self._obj, "smtp_" + command)
        return default

    def __contains__(self, command: object) -> bool:
        return command in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


_commands: dict[type, frozenset[str]] = {}


def _class_commands(cls: type) -> frozenset[str]:
    found = _commands.get(cls)
    if found is None:
        found = _commands[cls] = frozenset(n.removeprefix("smtp_") for n in _table_names(cls, ("smtp_",)))
    return found


def parse_address(arg: str, local_part_limit: int = 0) -> tuple[str | None, str | None]:
    """``(address, rest of the line)`` of a MAIL FROM / RCPT TO argument, as aiosmtpd's ``_getaddr``.

    ``("", "")`` for an empty argument; ``(None, None)`` when it does not parse (RFC 5321 §4.1.2 path or
    mailbox) or its local part is longer than ``local_part_limit`` (0: no limit). Raises what the email
    package's parser raises on some malformed input (``IndexError`` for ``<``), as aiosmtpd does.
    """
    key = (arg, local_part_limit)
    hit = _parsed.get(key)
    if hit is not None:
        return hit
    result: tuple[str | None, str | None]
    if not arg:
        result = ("", "")
    else:
        try:
            if arg.lstrip().startswith("<"):
                angle, rest = get_angle_addr(arg)
                addr = str(angle.addr_spec)
            else:
                spec, rest = get_addr_spec(arg)
                addr = str(spec.addr_spec)
        except HeaderParseError:
            result = (None, None)
        else:
            local = addr.rpartition("@")[0]
            result = (None, None) if local_part_limit and len(local) > local_part_limit else (addr, rest)
    if len(_parsed) >= ADDRESS_CACHE_MAX:
        _parsed.clear()
    _parsed[key] = result
    return result


class FastPathMixin:
    """Put before aiosmtpd's ``SMTP`` in the bases: cheaper connection set-up and address parsing."""

    local_part_limit: int
    _smtp_methods: Any  # aiosmtpd declares a dict; a BoundCommands serves its uses (get, items, in)
    _auth_methods: dict[str, Any]
    _building = False  # inside SMTP.__init__: __dir__ lists nothing, _fast_tables makes the tables after it

    def __dir__(self) -> tuple[str, ...]:
        """Only the ``smtp_*`` and ``auth_*`` names: what aiosmtpd builds its tables from on each connection
        (nothing while ``SMTP.__init__`` runs: :meth:`_fast_tables` makes them then)."""
        return () if self._building else _table_names(type(self))

    def _fast_tables(self, auth_exclude_mechanism: Collection[str] | None) -> None:
        """After ``SMTP.__init__`` (called with ``_building`` set): the command table, and the AUTH table of
        this class's mechanisms with the handler's (which aiosmtpd found through the handler's ``dir``) over
        them and ``auth_exclude_mechanism`` left out, as aiosmtpd builds them."""
        self._building = False
        self._smtp_methods = BoundCommands(self, _class_commands(type(self)))
        auth = {mech: _AuthMechAttr(getattr(self, name), True) for mech, name in _class_auth(type(self))}
        auth.update(self._auth_methods)  # the handler's: aiosmtpd lists them after its own, so they win
        for m in auth_exclude_mechanism or ():
            auth.pop(m, None)
        self._auth_methods = auth

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        return parse_address(arg, self.local_part_limit or 0)


class FastHandlerMixin:
    """Put in the bases of an aiosmtpd handler: ``dir()`` lists only its ``handle_*`` and ``auth_*`` names (those
    of the class, computed once, and any set on the instance), all aiosmtpd's ``SMTP.__init__`` looks for."""

    def __dir__(self) -> tuple[str, ...]:
        names = _table_names(type(self), ("handle_", "auth_"))
        own = [n for n in vars(self) if n.startswith(("handle_", "auth_"))]
        return (*names, *own) if own else names
