"""Bounce classification: an SMTP reply -> one of a few categories (pure: stdlib only).

After KumoMTA's bounce classifier (``kumo.configure_bounce_classifier``: ordered rules files, the first rule
that matches wins, a reply no rule matches is ``Uncategorized``), with the categories of RFC 3463 (enhanced
status codes, and RFC 7372 for the email-authentication codes X.7.20-X.7.27) and of the large mailbox
providers' documented replies (Gmail, Microsoft, Yahoo). :func:`classify` is a pure function of
(SMTP reply code, enhanced status code, reply text, stage); :func:`parse_rules` turns the text of a rule file
(TOML) into :class:`Rules` or raises :class:`RuleError` with a one-line message.

The rule file (``bounce_rules.toml`` ships with the package; ``bounce_classification_file`` adds one whose
rules are tried first)::

    version = 1                   # the format; required
    include_defaults = true       # (custom files only) also try the shipped rules after these
    [[rules]]
    category = "invalid_recipient"            # one of CATEGORIES; required
    code = ["550", "55x"]                     # reply codes, 'x' any digit (or integers)
    enhanced = ["5.1.1", "X.1.1"]             # RFC 3463 codes, 'X' any number (RFC 3463's own notation)
    text = ["(?i)does not exist"]             # regular expressions (Python re), searched in the reply text
    stage = ["rcpt"]                          # the SMTP stage of the reply (STAGES)

A rule matches when each condition it has matches (within a list: any entry); it must have at least one.
The first rule that matches gives the category, so specific text rules come before generic code rules; a
reply no rule matches is ``uncategorized``. What must hold: :func:`classify` never raises, and the same
rules and reply give the same category (no clock, no state).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources

__all__ = ["CATEGORIES", "STAGES", "Rule", "RuleError", "Rules", "classify", "combine", "default_rules", "parse_rules",
           "shipped_rules_text"]

CATEGORIES = (
    "invalid_recipient",  # the mailbox does not exist or is disabled (X.1.1, X.1.6, X.2.1)
    "bad_domain",  # the recipient's domain does not exist or takes no mail (X.1.2, X.1.10, X.4.4)
    "mailbox_full",  # over quota (X.2.2)
    "spam_block",  # the sending IP or domain is on a block list, or has a poor reputation
    "content_related",  # the message itself was judged spam, a virus, or a prohibited attachment
    "policy_related",  # refused by the receiver's policy (relaying denied, reverse DNS, local policy: X.7.1)
    "authentication_failed",  # SPF, DKIM or DMARC failed (RFC 7372: X.7.20-X.7.26), or SMTP AUTH (X.7.8)
    "rate_limited",  # too many messages, connections or recipients at once; try later
    "message_too_large",  # over the receiver's size limit (X.2.3, X.3.4)
    "tls_required",  # the receiver (or our policy) needs TLS that could not be had (X.7.10, X.7.11, X.7.4)
    "message_expired",  # the queue lifetime ran out (X.4.7)
    "transient",  # any other temporary failure (4xx): connection, DNS, system errors
    "uncategorized",  # no rule matched
)
"""Every category :func:`classify` can give, in report order."""

STAGES = ("connect", "ehlo", "starttls", "auth", "mail", "rcpt", "data", "dot", "")
"""The SMTP stages a reply can come at ("" when not known; a rule with ``stage`` never matches it)."""

_CODE = re.compile(r"[2-5][0-9x][0-9x]")
_ENHANCED = re.compile(r"([245X])\.(\d{1,3}|X)\.(\d{1,3}|X)")
_RULE_KEYS = {"category", "code", "enhanced", "text", "stage"}
TEXT_MAX = 2048  # characters of a reply text the regexes see (a hostile peer's megabyte reply is cut)


class RuleError(ValueError):
    """A rule file that cannot be used; the message is one line naming the file, the rule and the key."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: ``category`` when every given condition matches (an empty tuple is no condition).
    ``codes``: patterns of 3 characters, 'x' any digit; ``enhanced``: (class, subject, detail) with None
    for 'X'; ``text``: compiled regexes, searched."""

    category: str
    codes: tuple[str, ...] = ()
    enhanced: tuple[tuple[str | None, str | None, str | None], ...] = ()
    text: tuple[re.Pattern[str], ...] = ()
    stages: tuple[str, ...] = ()

    def matches(self, code: str, enhanced: tuple[str, str, str] | None, text: str, stage: str) -> bool:
        if self.codes and not any(all(p in ("x", c) for p, c in zip(pat, code, strict=True)) for pat in self.codes):
            return False
        if self.enhanced:
            if enhanced is None:
                return False
            if not any(all(p is None or p == e for p, e in zip(pat, enhanced, strict=True)) for pat in self.enhanced):
                return False
        if self.stages and stage not in self.stages:
            return False
        return not self.text or any(r.search(text) for r in self.text)


@dataclass(frozen=True, slots=True)
class Rules:
    """An ordered list of rules (the first that matches wins) and where they came from."""

    rules: tuple[Rule, ...]
    source: str = "<rules>"

    def __add__(self, other: Rules) -> Rules:
        return Rules(self.rules + other.rules, f"{self.source} + {other.source}")


def _norm_code(code: int | str) -> str:
    s = str(code).strip()
    return s if len(s) == 3 and s.isdigit() else "000"


def _norm_enhanced(enhanced: str) -> tuple[str, str, str] | None:
    m = re.fullmatch(r"\s*([245])\.(\d{1,3})\.(\d{1,3})\s*", enhanced or "")
    if m is None:
        return None
    return m.group(1), str(int(m.group(2))), str(int(m.group(3)))


def classify(rules: Rules, code: int | str, enhanced: str, text: str, stage: str = "") -> str:
    """The category (one of :data:`CATEGORIES`) of an SMTP reply: ``code`` (RFC 5321 §4.2.1, e.g. 550),
    ``enhanced`` (RFC 3463, e.g. "5.1.1"; "" if none), ``text`` (the rest of the reply, multi-line replies
    joined), ``stage`` (:data:`STAGES`). The first rule of ``rules`` that matches gives it; none:
    ``uncategorized``. Never raises."""
    c = _norm_code(code)
    e = _norm_enhanced(enhanced)
    t = (text or "")[:TEXT_MAX]
    for rule in rules.rules:
        if rule.matches(c, e, t, stage):
            return rule.category
    return "uncategorized"


def _strings(where: str, key: str, value: object) -> list[str]:
    items = value if isinstance(value, list) else [value]
    out = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise RuleError(f"{where}: {key}[{i}]: expected a string, got {v!r}")
        out.append(str(v))
    if not out:
        raise RuleError(f"{where}: {key}: empty list")
    return out


def _rule(where: str, raw: object) -> Rule:
    if not isinstance(raw, dict):
        raise RuleError(f"{where}: expected a table ([[rules]])")
    unknown = sorted(set(raw) - _RULE_KEYS)
    if unknown:
        raise RuleError(f"{where}: unknown key {unknown[0]!r} (expected: {', '.join(sorted(_RULE_KEYS))})")
    category = raw.get("category")
    if category not in CATEGORIES:
        raise RuleError(f"{where}: category: {category!r} is not one of {', '.join(CATEGORIES)}")
    codes = []
    for i, s in enumerate(_strings(where, "code", raw["code"]) if "code" in raw else []):
        if not _CODE.fullmatch(s.lower()):
            raise RuleError(f"{where}: code[{i}]: {s!r} is not a reply code like 550 or 5xx")
        codes.append(s.lower())
    enhanced: list[tuple[str | None, str | None, str | None]] = []
    for i, s in enumerate(_strings(where, "enhanced", raw["enhanced"]) if "enhanced" in raw else []):
        m = _ENHANCED.fullmatch(s.upper())
        if m is None:
            raise RuleError(f"{where}: enhanced[{i}]: {s!r} is not an RFC 3463 code like 5.1.1 or X.7.26")
        enhanced.append(tuple(None if g == "X" else str(int(g)) for g in m.groups()))  # type: ignore[arg-type]
    texts = []
    for i, s in enumerate(_strings(where, "text", raw["text"]) if "text" in raw else []):
        try:
            texts.append(re.compile(s))
        except re.error as exc:
            raise RuleError(f"{where}: text[{i}]: bad regular expression {s!r}: {exc}") from None
    stages = _strings(where, "stage", raw["stage"]) if "stage" in raw else []
    for i, s in enumerate(stages):
        if s not in STAGES or not s:
            raise RuleError(f"{where}: stage[{i}]: {s!r} is not one of {', '.join(x for x in STAGES if x)}")
    if not (codes or enhanced or texts or stages):
        raise RuleError(f"{where}: no condition (give code, enhanced, text or stage)")
    return Rule(str(category), tuple(codes), tuple(enhanced), tuple(texts), tuple(stages))


def parse_rules(data: str, source: str = "<rules>") -> tuple[Rules, bool]:
    """The rules of a rule file's text (TOML, see the module docstring) and its ``include_defaults`` (True
    when absent). Raises RuleError, one line naming ``source`` (and the rule, 1-based, and the key)."""
    try:
        doc = tomllib.loads(data)
    except tomllib.TOMLDecodeError as exc:
        raise RuleError(f"{source}: {exc}") from None
    unknown = sorted(set(doc) - {"version", "include_defaults", "rules"})
    if unknown:
        raise RuleError(f"{source}: unknown key {unknown[0]!r} (expected: version, include_defaults, rules)")
    if doc.get("version") != 1:
        raise RuleError(f"{source}: version: expected 1, got {doc.get('version')!r}")
    include = doc.get("include_defaults", True)
    if not isinstance(include, bool):
        raise RuleError(f"{source}: include_defaults: expected true or false, got {include!r}")
    raw = doc.get("rules", [])
    if not isinstance(raw, list):
        raise RuleError(f"{source}: rules: expected an array of tables ([[rules]])")
    return Rules(tuple(_rule(f"{source}: rule {i}", r) for i, r in enumerate(raw, 1)), source), include


def shipped_rules_text() -> str:
    """The text of the rule file shipped with mtaq (``mtaq/core/bounce_rules.toml``, package data)."""
    return resources.files(__package__ or "mtaq.core").joinpath("bounce_rules.toml").read_text(encoding="utf-8")


_DEFAULT: list[Rules] = []


def default_rules() -> Rules:
    """The shipped rules, parsed once (RuleError if the package's own file is bad: a bug)."""
    if not _DEFAULT:
        _DEFAULT.append(parse_rules(shipped_rules_text(), "bounce_rules.toml")[0])
    return _DEFAULT[0]


def combine(custom: str | None, source: str = "<rules>") -> Rules:
    """The rules to use: those of the rule file text ``custom`` first (None: none), then the shipped
    rules unless the file says ``include_defaults = false``. Raises RuleError."""
    if custom is None:
        return default_rules()
    rules, include = parse_rules(custom, source)
    return rules + default_rules() if include else rules
