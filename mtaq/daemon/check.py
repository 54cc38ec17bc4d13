"""``mtaq check`` (Postfix's ``postfix check``), and the same checks made by ``mtaq serve`` before it binds.

:func:`problems` runs every check of a loaded config and returns every problem found, one line each (the
config's own problems, from :func:`mtaq.config.load_config`, come first, from ``mtaq check``): ``mail_owner``
when root (mtaq.daemon.privileges), the modes of the spool, ``archive_dir``, ``tls_key_file`` and
``auth_password_file`` (:func:`mtaq.daemon.privileges.file_problems`), the TLS certificate and key loaded into
an ``ssl.SSLContext`` (a key that is not the certificate's: "tls_key_file does not match tls_cert_file"), the
password files parsed (``auth_password_file``; ``smtp_sasl_password_file`` with its mode), the bounce
classification rules (``bounce_classification_file``, mtaq.delivery.classify), every DKIM key
loaded and test-signed (mtaq.edge.dkim), the CA files (``smtp_tls_CAfile``, ``mta_sts_ca_file``) loaded as
trust anchors, the outbound source addresses (``smtp_bind_address``/``6`` and every address of
``sender_dependent_bind_address_maps`` and ``destination_bind_address_maps``: bound once, as a present address
of this host), and with ``bind`` every SMTP listener and ``admin_listen`` bound once and let go. Each check is
the loader the daemon itself uses, so ``check`` and ``serve`` cannot disagree. With ``dns`` (``mtaq check``,
not ``serve``: a start never waits for DNS), each DKIM key's TXT record (``SELECTOR._domainkey.DOMAIN``, asked
of ``dns_nameservers`` or the system's resolvers) must publish that key (:func:`mtaq.edge.dkim.record_problem`);
a resolver that does not answer (timeout, SERVFAIL, no network) is no problem: the record is then not checked.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from functools import partial

from mtaq.config import Config, listeners_of, parse_bind_addresses, parse_hostport
from mtaq.core.errors import ConfigError

__all__ = ["check_start", "problems"]


def problems(cfg: Config, *, bind: bool = False, dns: bool = False) -> list[str]:
    """Every problem of ``cfg``'s files, spool and listeners (see the module docstring), one line each, in a
    fixed order; [] when there is none. ``bind``: also bind each listening address once (it fails while a
    daemon holds it, and below port 1024 without root or CAP_NET_BIND_SERVICE). ``dns``: also look up each
    DKIM key's TXT record (at most :data:`DNS_TIMEOUT_S` seconds each). Never raises ConfigError."""
    from mtaq.daemon import privileges

    found: list[str] = []

    def run(check: Callable[[], object]) -> None:
        try:
            check()
        except (ConfigError, ValueError) as exc:
            found.append(str(exc))

    run(lambda: privileges.mail_owner(cfg))
    found += privileges.file_problems(cfg)
    before = len(found)
    for check in _file_loaders(cfg):
        run(check)
    if len(found) == before:  # each file loads: the edge as a whole (AUTH needs STARTTLS, the networks...)
        from mtaq.edge.policy import EdgePolicy

        run(lambda: EdgePolicy.from_config(cfg))
    for check in _other_loaders(cfg):
        run(check)
    if dns:
        found += _dkim_records(cfg)
    if bind:
        found += _bind(cfg)
    return found


DNS_TIMEOUT_S = 3.0
"""Seconds a DKIM record lookup of ``mtaq check`` may take before it is left unchecked."""


def _dkim_records(cfg: Config) -> list[str]:
    """One line per DKIM key (that loads) whose TXT record does not publish it; a lookup without an answer
    (timeout, SERVFAIL, no resolver) is skipped. RFC 6376 §3.6.2.2: the record's strings are joined."""
    import dns.exception
    import dns.nameserver
    import dns.resolver

    from mtaq.config import parse_nameserver
    from mtaq.edge.dkim import load_key, record_problem

    try:
        resolver = dns.resolver.Resolver(configure=not cfg.dns_nameservers)
    except dns.exception.DNSException:
        return []  # no resolver configured on this host: nothing can be looked up
    if cfg.dns_nameservers:
        resolver.nameservers = [dns.nameserver.Do53Nameserver(*parse_nameserver(ns, cfg.dns_port))
                                for ns in cfg.dns_nameservers]
    resolver.lifetime = DNS_TIMEOUT_S
    resolver.timeout = min(resolver.timeout, DNS_TIMEOUT_S)
    found = []
    for domain, k in cfg.dkim_keys.items():
        try:
            key = load_key(domain, k.selector, k.key_file)
        except ConfigError:
            continue  # said already
        name = f"{key.selector}._domainkey.{key.domain}."
        try:
            answer = resolver.resolve(name, "TXT")
            published: str | None = "".join(b"".join(rd.strings).decode("ascii", "replace") for rd in answer[:1])
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            published = None
        except dns.exception.DNSException:
            continue  # unreachable or failing: not checked
        problem = record_problem(key, published)
        if problem is not None:
            found.append(f'dkim_keys."{domain}": {problem}')
    return found


def check_start(cfg: Config) -> None:
    """What ``mtaq serve`` runs before binding: :func:`problems` (without ``bind``: serve binds itself and says
    so); raises ConfigError with the first problem (one line, exit 2)."""
    found = problems(cfg)
    if found:
        raise ConfigError(found[0])


def _file_loaders(cfg: Config) -> list[Callable[[], object]]:
    from mtaq.edge.auth import PasswordFile
    from mtaq.edge.policy import server_tls_context

    checks: list[Callable[[], object]] = []
    if cfg.tls_cert_file or cfg.tls_key_file:
        checks.append(lambda: server_tls_context(cfg.tls_cert_file, cfg.tls_key_file))
    if cfg.auth_password_file:
        checks.append(lambda: PasswordFile.load(cfg.auth_password_file))
    return checks


def _other_loaders(cfg: Config) -> list[Callable[[], object]]:
    from mtaq.delivery.classify import load_rules
    from mtaq.delivery.sasl import SaslClient
    from mtaq.edge.dkim import load_key

    checks: list[Callable[[], object]] = [lambda: SaslClient.from_config(cfg)]
    if cfg.bounce_classification_file:  # the shipped rules alone are the package's, parsed at first use
        checks.append(lambda: load_rules(cfg))
    checks += [partial(load_key, d, k.selector, k.key_file) for d, k in cfg.dkim_keys.items()]
    if cfg.smtp_generic_maps:
        from mtaq.edge.canonical import Generic

        checks.append(partial(Generic.from_config, cfg.smtp_generic_maps, myhostname=cfg.hostname(),
                              myorigin=cfg.myorigin))
    for key, path in (("smtp_tls_CAfile", cfg.smtp_tls_CAfile), ("mta_sts_ca_file", cfg.mta_sts_ca_file)):
        if path:
            checks.append(partial(_ca_file, key, path))
    for key, address, version in (("smtp_bind_address", cfg.smtp_bind_address, 4),
                                  ("smtp_bind_address6", cfg.smtp_bind_address6, 6)):
        if address:
            checks.append(partial(_bind_address, key, address, version))
    for table in ("sender_dependent_bind_address_maps", "destination_bind_address_maps"):
        for k, v in getattr(cfg, table).items():
            try:
                pair = parse_bind_addresses(v, key=f"{table}.{k}")
            except ValueError:
                continue  # the config's own problem, said already
            checks += [partial(_bind_address, f"{table}.{k}", address, version)
                       for address, version in zip(pair, (4, 6), strict=True) if address]
    return checks


def _bind_address(key: str, address: str, version: int) -> None:
    """``address`` must be an IPv``version`` address of this host (a socket can be bound to it), as Postfix's
    smtp_bind_address must. Raises ConfigError."""
    import ipaddress
    import socket

    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ConfigError(f"{key}: {address!r} is not an IP address") from None
    if ip.version != version:
        raise ConfigError(f"{key}: {address} is not an IPv{version} address")
    try:
        with socket.socket(socket.AF_INET6 if version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as exc:
        raise ConfigError(f"{key}: {address} is not an address of this host ({exc.strerror})") from None


def _ca_file(key: str, path: str) -> None:
    """Load ``path`` as trust anchors, as delivery will (mtaq.delivery.security). Raises ConfigError."""
    try:
        ctx = ssl.create_default_context(cafile=path)
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: {path}: {exc.strerror}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{key}: {path}: not a PEM CA bundle ({exc})") from exc
    if not ctx.get_ca_certs():
        raise ConfigError(f"{key}: {path}: no CA certificate in it")


def _bind(cfg: Config) -> list[str]:
    """Bind every SMTP listener and ``admin_listen`` once and close them: one line per address that cannot be
    bound now (in use, by a running daemon too; a port below 1024 without root or CAP_NET_BIND_SERVICE). An
    address that does not parse is the config's problem, said already."""
    from mtaq.daemon.workers import bind_listeners

    try:
        addrs = [("listen", (lst.host, lst.port)) for lst in listeners_of(cfg)]
    except ValueError:
        addrs = []
    if cfg.admin_listen.strip():
        try:
            addrs.append(("admin_listen", parse_hostport(cfg.admin_listen, key="admin_listen")))
        except ValueError:
            pass
    found = []
    for key, addr in addrs:
        try:
            for socks in bind_listeners([addr], key=key):
                for s in socks:
                    s.close()
        except OSError as exc:
            found.append(f"{exc.strerror or exc} (cannot be bound now)")
    return found
