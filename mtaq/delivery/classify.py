"""The bounce classification rules of a configuration (issue 37.3): the shipped rule file, after it the one
``bounce_classification_file`` names (tried first). The classifier itself is pure: mtaq.core.bounce_class."""

from __future__ import annotations

from mtaq.config import Config
from mtaq.core.bounce_class import RuleError, Rules, combine
from mtaq.core.errors import ConfigError

__all__ = ["load_rules"]


def load_rules(cfg: Config) -> Rules:
    """The rules ``cfg`` asks for: the shipped ones, preceded by those of ``bounce_classification_file`` when
    set (its ``include_defaults = false``: those alone). Raises ConfigError with one line naming the key, the
    file, and the rule and key at fault (``mtaq check`` and ``mtaq serve`` exit 2 with it)."""
    path = cfg.bounce_classification_file
    if not path:
        return combine(None)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"bounce_classification_file: {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"bounce_classification_file: {path}: not UTF-8 ({exc.reason})") from exc
    try:
        return combine(text, path)
    except RuleError as exc:
        raise ConfigError(f"bounce_classification_file: {exc}") from exc
