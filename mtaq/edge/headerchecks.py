"""``header_checks`` (Postfix header_checks(5) with a regexp table): rules over each header of a message received.

Each rule is one line of Postfix's regexp table syntax::

    /PATTERN/FLAGS ACTION [TEXT]

``PATTERN`` is a Python regular expression (``re``; Postfix uses POSIX or PCRE, the common patterns read the
same), matched with ``search`` against each *logical* header of the message's header section, unfolded
(continuation lines joined without their line break), e.g. ``Subject: hello world``. As in Postfix the match
ignores case unless ``FLAGS`` holds ``i`` (which toggles it); ``!/PATTERN/`` matches a header that the
pattern does not match. The first rule that matches a header decides for it:

* ``REJECT [TEXT]``: the message is refused at the end of DATA, ``550 5.7.1 TEXT`` (default text
  ``Error: message content rejected``), nothing is queued; event ``header_checks_reject``.
* ``WARN [TEXT]``: the message goes on; event ``header_checks_warn`` with the header.
* ``HOLD [TEXT]``: the message is queued on hold (``mtaq queue list`` shows it held; an administrator
  releases or deletes it), event ``header_checks_hold``; the rules go on for the other headers.
* ``IGNORE``: the header is removed.
* ``REPLACE TEXT``: the header is replaced by ``TEXT`` (a whole header line, ``Name: value``).
* ``PREPEND TEXT``: ``TEXT`` (a header line) is inserted before the header.
* ``DUNNO`` / ``OK``: nothing; no later rule is tried for this header.

The result is applied before the message is signed and appended to the log (issue 35.3): what is on disk is
what is sent. A header line made by REPLACE or PREPEND that is not ``Name: value`` with a field name of
RFC 5322 §3.6.8 characters, or holds a CR, LF or NUL, is refused when the rules are loaded (ConfigError).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from mtaq.core.errors import ConfigError

__all__ = ["HeaderChecks", "Outcome", "Rule"]

Action = Literal["REJECT", "WARN", "HOLD", "IGNORE", "REPLACE", "PREPEND", "DUNNO", "OK"]
_ACTIONS = ("REJECT", "WARN", "HOLD", "IGNORE", "REPLACE", "PREPEND", "DUNNO", "OK")
_NEEDS_TEXT = ("REPLACE", "PREPEND")
_RULE = re.compile(r"^(?P<neg>!?)/(?P<pattern>(?:\\.|[^\\/])*)/(?P<flags>[imx]*)\s+(?P<action>\S+)(?:\s+(?P<text>.*))?$")
_FIELD_LINE = re.compile(r"^[!-9;-~]+:[^\r\n\0]*$")  # RFC 5322 §3.6.8 ftext, then the value
_LINE_END = re.compile(rb"\r?\n")


@dataclass(frozen=True)
class Rule:
    """One ``header_checks`` line, parsed: ``negate`` (``!/.../``), the compiled ``pattern``, ``action``
    and ``text`` ("" when none)."""

    negate: bool
    pattern: re.Pattern[str]
    action: Action
    text: str

    def matches(self, header: str) -> bool:
        return (self.pattern.search(header) is None) if self.negate else (self.pattern.search(header) is not None)


@dataclass
class Outcome:
    """What the rules made of a header section: ``reject`` (the reply, or None), ``warnings`` (rule text,
    header) pairs, ``hold`` (the first HOLD rule's (text, header), or None), and ``head`` (the rewritten header section, its empty line included, or None when no
    header changed)."""

    reject: str | None = None
    warnings: list[tuple[str, str]] = field(default_factory=list)
    hold: tuple[str, str] | None = None
    head: bytes | None = None


def parse_rule(line: str, index: int) -> Rule:
    """One rule (module text). Raises ConfigError naming ``header_checks[index]``."""
    where = f"header_checks[{index}]"
    m = _RULE.match(line.strip())
    if m is None:
        raise ConfigError(f"{where}: expected /PATTERN/FLAGS ACTION [TEXT]")
    action = m["action"].upper()
    if action not in _ACTIONS:
        raise ConfigError(f"{where}: unknown action {m['action']!r} (one of {', '.join(_ACTIONS)})")
    text = (m["text"] or "").strip()
    if action in _NEEDS_TEXT and not _FIELD_LINE.match(text):
        raise ConfigError(f"{where}: {action} needs a header line 'Name: value' without control characters")
    if any(c in text for c in "\r\n\0"):
        raise ConfigError(f"{where}: the text holds a control character")
    ignore_case = "i" not in m["flags"]  # Postfix's regexp tables ignore case; the i flag toggles that
    flags = (re.IGNORECASE if ignore_case else 0) | (re.MULTILINE if "m" in m["flags"] else 0) | (
        re.VERBOSE if "x" in m["flags"] else 0)
    try:
        pattern = re.compile(m["pattern"].replace("\\/", "/"), flags)
    except re.error as exc:
        raise ConfigError(f"{where}: bad pattern: {exc}") from None
    return Rule(bool(m["neg"]), pattern, action, text)  # type: ignore[arg-type]


def _logical_headers(head: bytes) -> list[bytes]:
    """The header section ``head`` (without its empty line) as logical headers, each with its line ends."""
    out: list[bytes] = []
    for line in head.splitlines(keepends=True):
        if line[:1] in (b" ", b"\t") and out:
            out[-1] += line
        else:
            out.append(line)
    return out


class HeaderChecks:
    """The ``header_checks`` rules of a configuration, applied to one header section at a time."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules

    @classmethod
    def from_config(cls, lines: list[str]) -> HeaderChecks:
        """Parse ``header_checks``; raises ConfigError naming the first bad rule."""
        return cls([parse_rule(line, i) for i, line in enumerate(lines)])

    def __bool__(self) -> bool:
        return bool(self.rules)

    def apply(self, head: bytes) -> Outcome:
        """Run the rules over ``head``, a header section as received (CRLF line ends, without the empty line
        that ends it). Headers that are not UTF-8 are matched as decoded with replacement characters and
        kept as they are unless a rule replaces or removes them."""
        out = Outcome()
        new: list[bytes] = []
        changed = False
        for raw in _logical_headers(head):
            text = _LINE_END.sub(b"", raw).decode("utf-8", "replace")
            rule = next((r for r in self.rules if r.matches(text)), None)
            if rule is None or rule.action in ("DUNNO", "OK"):
                new.append(raw)
                continue
            if rule.action == "REJECT":
                out.reject = f"550 5.7.1 {rule.text or 'Error: message content rejected'}"
                return out
            if rule.action == "WARN":
                out.warnings.append((rule.text, text))
                new.append(raw)
            elif rule.action == "HOLD":
                out.hold = out.hold or (rule.text, text)
                new.append(raw)
            elif rule.action == "IGNORE":
                changed = True
            elif rule.action == "REPLACE":
                new.append(rule.text.encode("utf-8") + b"\r\n")
                changed = True
            else:  # PREPEND
                new += [rule.text.encode("utf-8") + b"\r\n", raw]
                changed = True
        if changed:
            out.head = b"".join(new)
        return out
