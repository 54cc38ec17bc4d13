"""Configuration: one TOML file, every key with a default and a unit in its name; flags override it.

Validation is msgspec's (types and bounds); an error names the bad key, e.g.
``segment_bytes_max: Expected `int` >= 65536, got 10`` (GUIDE §4).
"""

from __future__ import annotations

import re
import socket
import tomllib
from typing import Annotated, Literal

import msgspec

from mtaq.errors import ConfigError

__all__ = ["Config", "Relayhost", "load_config", "parse_hostport", "parse_relayhost"]

MiB = 1024 * 1024


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every setting of ``mtaq serve``. Times in seconds, sizes in bytes."""

    spool_dir: str = "./spool"
    listen: str = "127.0.0.1:2525"
    # Postfix syntax: "[host]:port" (no MX lookup). The embedded default is the local sink of `make run`.
    relayhost: str = "[127.0.0.1]:2526"
    myhostname: str = ""  # "" means the host's name
    segment_bytes_max: Annotated[int, msgspec.Meta(ge=65536, le=4096 * MiB)] = 64 * MiB
    message_size_limit_bytes: Annotated[int, msgspec.Meta(ge=1024, le=200 * MiB)] = 10_240_000
    delivery_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    # Seconds to wait after the 1st, 2nd, ... deferred attempt; the last repeats (RFC 5321 §4.5.4.1).
    retry_intervals_s: Annotated[list[Annotated[float, msgspec.Meta(gt=0)]], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [1800.0, 3600.0, 7200.0, 14400.0]
    )
    maximal_queue_lifetime_s: Annotated[float, msgspec.Meta(gt=0)] = 5 * 86400.0  # then bounce (4.4.7)
    bounce_queue_lifetime_s: Annotated[float, msgspec.Meta(gt=0)] = 5 * 86400.0  # for mail from <>
    delay_warning_time_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # 0: no delay DSNs
    checkpoint_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    smtp_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # per command, outbound
    smtp_server_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # idle client, inbound
    stats_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0  # 0 disables the periodic stats event
    log_format: Literal["console", "json"] = "console"
    # Reclaimed segments are copied here before they are deleted ("" = no archive; relative to the cwd).
    archive_dir: str = ""
    archive_compress: Literal["none", "zstd"] = "none"
    archive_retention_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # delete archives older than this; 0: keep

    def hostname(self) -> str:
        return self.myhostname or socket.getfqdn()


def load_config(path: str | None, overrides: dict[str, object]) -> Config:
    """Read the TOML file at ``path`` (None: defaults only), apply ``overrides`` (flag values), validate.

    Raises ConfigError with a one-line message naming the file and key.
    """
    data: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{_name_key(str(exc))}") from exc
    try:
        parse_hostport(cfg.listen)
        parse_relayhost(cfg.relayhost)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return cfg


def _name_key(msg: str) -> str:
    m = re.search(r" - at `\$\.([^`\[]+)[^`]*`$", msg)
    if m:
        return f"{m.group(1)}: {msg[: m.start()]}"
    return msg


def parse_hostport(value: str, *, default_port: int | None = None, key: str = "listen") -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (host, port). Raises ValueError naming ``key``."""
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", value.strip())
    if not m:
        raise ValueError(f"{key}: cannot parse {value!r} as HOST:PORT")
    host = m.group(1) or m.group(3)
    port_s = m.group(2) or m.group(4)
    if port_s is None:
        if default_port is None:
            raise ValueError(f"{key}: {value!r} has no port")
        port = default_port
    else:
        port = int(port_s)
    if not 0 <= port <= 65535:
        raise ValueError(f"{key}: port {port} out of range")
    return host, port


class Relayhost(msgspec.Struct, frozen=True):
    """The next hop. ``mx`` is False for the bracketed form (Postfix: no MX lookup)."""

    host: str
    port: int
    mx: bool

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if not self.mx else f"{self.host}:{self.port}"


def parse_relayhost(value: str) -> Relayhost:
    """Postfix ``relayhost`` syntax: ``[host]:port``, ``[host]``, ``host:port`` or ``host`` (port 25).

    Without brackets Postfix looks up MX records; mtaq has no MX routing yet (issue 5) and connects to the
    host's address records either way.
    """
    v = value.strip()
    host, port = parse_hostport(v, default_port=25, key="relayhost")
    return Relayhost(host=host, port=port, mx=not v.startswith("["))
