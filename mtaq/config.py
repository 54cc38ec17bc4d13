"""Configuration: one TOML file, every key with a default and a unit in its name; flags override it.

Validation is msgspec's (types and bounds); an error names the bad key, e.g.
``segment_bytes_max: Expected `int` >= 65536, got 10`` (GUIDE §4).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import tomllib
from typing import Annotated, Literal

import msgspec

from mtaq.errors import ConfigError

__all__ = ["Config", "Relayhost", "load_config", "parse_hostport", "parse_nameserver", "parse_relayhost"]

MiB = 1024 * 1024


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every setting of ``mtaq serve``. Times in seconds, sizes in bytes."""

    spool_dir: str = "./spool"
    listen: str = "127.0.0.1:2525"
    # Postfix syntax: "[host]:port" (no MX lookup), "host:port" (MX lookup of host), "" (route by the
    # recipient domain's MX records). The embedded default is the local sink of `make run`.
    relayhost: str = "[127.0.0.1]:2526"
    # Per-domain next hops (Postfix transport(5)): "example.org" = "[10.0.0.5]:25" | "smtp:host" | "discard"
    # | "error:5.1.1 text". Lookup order: exact domain, ".parent" domains, then "*". Wins over relayhost.
    transport_map: dict[str, str] = msgspec.field(default_factory=dict)
    # Outbound STARTTLS (Postfix smtp_tls_security_level): "may" (opportunistic, certificate not verified),
    # "encrypt" (defer 4.7.4/4.7.5 without TLS), "none". Per destination in tls_policy_map.
    smtp_tls_security_level: Literal["none", "may", "encrypt"] = "may"
    tls_policy_map: dict[str, Literal["none", "may", "encrypt"]] = msgspec.field(default_factory=dict)
    # DNS for MX routing: [] means /etc/resolv.conf; entries "IP" or "IP:PORT" / "[IPv6]:PORT".
    dns_nameservers: list[str] = msgspec.field(default_factory=list)
    dns_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 53
    dns_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=300)] = 10.0
    smtp_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 25  # port of MX hosts (MX records carry none)
    smtp_mx_addresses_max: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5  # addresses tried per destination
    smtp_connection_idle_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # cached connections closed after
    smtp_connection_cache_max: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 8  # per delivery worker
    myhostname: str = ""  # "" means the host's name
    segment_bytes_max: Annotated[int, msgspec.Meta(ge=65536, le=4096 * MiB)] = 64 * MiB
    message_size_limit_bytes: Annotated[int, msgspec.Meta(ge=1024, le=200 * MiB)] = 10_240_000
    # New mail gets 452 4.3.1 while the spool has less free space than this (Postfix queue_minfree); the
    # floor is never below 1.5 x message_size_limit_bytes (Postfix smtpd's rule), so deliveries can go on.
    queue_minfree_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    delivery_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    # Worker processes sharing the SMTP port, each with its own shard of the spool (mtaq.workers); never
    # fewer than the shards already in the spool. delivery_concurrency is split among them.
    workers: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
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
        for ns in cfg.dns_nameservers:
            parse_nameserver(ns, cfg.dns_port)
        from mtaq.delivery.routing import parse_transport

        for domain, value in cfg.transport_map.items():
            parse_transport(value, key=f"transport_map.{domain}")
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


def parse_relayhost(value: str, *, key: str = "relayhost", default_port: int = 25) -> Relayhost | None:
    """Postfix ``relayhost`` syntax: ``[host]:port``, ``[host]``, ``host:port`` or ``host`` (port 25).

    Without brackets the MX records of ``host`` are looked up (``mx`` True; RFC 5321 §5.1); with them, the
    host's own address records. ``""`` returns None: route by the recipient domain. Raises ValueError
    naming ``key``.
    """
    v = value.strip()
    if not v:
        return None
    host, port = parse_hostport(v, default_port=default_port, key=key)
    if not host.strip() or any(c.isspace() for c in host):
        raise ValueError(f"{key}: cannot parse {value!r} as a host")
    return Relayhost(host=host.rstrip(".").lower(), port=port, mx=not v.startswith("["))


def parse_nameserver(value: str, default_port: int = 53) -> tuple[str, int]:
    """A ``dns_nameservers`` entry, ``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` -> (ip, port).

    Raises ValueError naming the key when it is not an IP address (a resolver needs no resolver).
    """
    v = value.strip()
    if v.count(":") > 1 and not v.startswith("["):
        host, port = v, default_port  # a bare IPv6 address
    else:
        host, port = parse_hostport(v, default_port=default_port, key="dns_nameservers")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"dns_nameservers: {value!r} is not an IP address") from None
    return host, port
