"""Configuration: one TOML file, every key with a default and a unit in its name; flags override it.

Validation is msgspec's (types and bounds); an error names the bad key, e.g.
``segment_bytes_max: Expected `int` >= 65536, got 10`` (GUIDE §4).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import tomllib
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec

from mtaq.core.errors import ConfigError

__all__ = [
    "Config",
    "DkimKeyConfig",
    "EventWebhook",
    "Listener",
    "ListenerConfig",
    "Relayhost",
    "TransportSpec",
    "is_loopback",
    "listeners_of",
    "load_config",
    "parse_hostport",
    "parse_milter_address",
    "parse_nameserver",
    "parse_relayhost",
    "parse_transport_spec",
]

MiB = 1024 * 1024


class DestinationLimit(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Traffic shaping for one recipient domain (``[destination_limits."example.org"]``)."""

    concurrency: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 20
    rate_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # deliveries started per second; 0: no limit


class DkimKeyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The DKIM signing key of one From: domain (``[dkim_keys."example.org"]``; mtaq.edge.dkim)."""

    selector: str  # s=: the key's DNS record is SELECTOR._domainkey.DOMAIN (RFC 6376 §3.6.2.1)
    key_file: str  # PEM private key, RSA >= 2048 bits or Ed25519, mode 0600 (checked at start)


EventName = Literal["received", "delivered", "deferred", "bounced", "expired", "dsn_queued", "held", "released",
                    "deleted", "outcome_unknown"]


class EventWebhook(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One HTTP endpoint that delivery events are POSTed to (``[[event_webhooks]]``; mtaq.daemon.exporter).

    Events (docs/events.md) go out in batches of at most ``batch_max``, a batch waiting at most
    ``batch_wait_s`` for more; each POST is signed with HMAC-SHA256 over its body under ``secret`` (header
    ``X-Mtaq-Signature: sha256=HEX``; "" : unsigned). A 2xx acknowledges the batch; a 5xx, 408, 429, a
    timeout (``timeout_s``) or a connection error is retried after ``retry_min_s``, doubling up to
    ``retry_max_s``; any other 4xx is logged and the batch skipped. https URLs are verified against
    ``ca_file`` (PEM; "" : the system's CA store).
    """

    url: str
    events: list[EventName] = msgspec.field(default_factory=lambda: list(EventName.__args__))  # type: ignore[attr-defined]
    batch_max: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    batch_wait_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 1.0
    secret: str = ""
    ca_file: str = ""
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    retry_min_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
    retry_max_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 300.0


ListenerMode = Literal["smtp", "submission", "smtps"]


class ListenerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The settings of one SMTP listener (``[listeners."0.0.0.0:587"]``), like a Postfix master.cf service.

    ``mode`` picks the defaults of the other keys; each may be set apart (left out: the mode's default):

    ============ ======================== ======================= ===============
    mode         smtpd_tls_security_level smtpd_tls_wrappermode   auth_required
    ============ ======================== ======================= ===============
    smtp         may                      false                   false
    submission   encrypt                  false                   true
    smtps        (TLS from the first byte) true                   true
    ============ ======================== ======================= ===============
    """

    mode: ListenerMode = "smtp"
    # "may": STARTTLS offered when a certificate is configured; "encrypt": required before any other command
    # than EHLO, NOOP, STARTTLS, QUIT (530 5.7.0 Must issue a STARTTLS command first; Postfix's name).
    smtpd_tls_security_level: Literal["may", "encrypt"] | msgspec.UnsetType = msgspec.UNSET
    # TLS from the first byte (RFC 8314 implicit TLS, port 465; Postfix smtpd_tls_wrappermode).
    smtpd_tls_wrappermode: bool | msgspec.UnsetType = msgspec.UNSET
    # MAIL, RCPT, DATA, VRFY and HELP need AUTH first: 530 5.7.0 Authentication required (Postfix
    # smtpd_*_restrictions = permit_sasl_authenticated, reject); nobody relays unauthenticated, mynetworks too.
    auth_required: bool | msgspec.UnsetType = msgspec.UNSET
    # This listener's content filters instead of the top-level smtpd_milters (Postfix master.cf
    # "-o smtpd_milters=..."; [] for none).
    smtpd_milters: list[str] | msgspec.UnsetType = msgspec.UNSET


class Listener(msgspec.Struct, frozen=True, kw_only=True):
    """One SMTP listener as the daemon runs it: its address as written, parsed, and its resolved settings."""

    address: str  # as written in listen / listeners (the key of the listening event)
    host: str
    port: int
    mode: ListenerMode = "smtp"
    tls_required: bool = False  # STARTTLS before anything else
    wrappermode: bool = False  # implicit TLS
    auth_required: bool = False  # AUTH before MAIL
    smtpd_milters: tuple[str, ...] | None = None  # the listener's own filters; None: the top-level smtpd_milters

    def describe(self) -> dict[str, object]:
        """The listener for the ``listening`` event: address, mode, tls (may/encrypt/wrapper), auth."""
        tls = "wrapper" if self.wrappermode else ("encrypt" if self.tls_required else "may")
        return {"listen": self.address, "mode": self.mode, "tls": tls,
                "auth": "required" if self.auth_required else "optional"}


_MODE_DEFAULTS: dict[str, tuple[bool, bool, bool]] = {  # mode -> (tls_required, wrappermode, auth_required)
    "smtp": (False, False, False),
    "submission": (True, False, True),
    "smtps": (False, True, True),
}


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every setting of ``mtaq serve``. Times in seconds, sizes in bytes."""

    spool_dir: str = "./spool"
    # "HOST:PORT", or a list of them: plain SMTP listeners (--listen overrides it). Every listeners table
    # whose address is not here is one more listener; one whose address is here sets that listener's mode.
    listen: str | list[str] = "127.0.0.1:2525"
    # Per-listener settings (submission on 587, smtps on 465): [listeners."0.0.0.0:587"] mode = "submission".
    listeners: dict[str, ListenerConfig] = msgspec.field(default_factory=dict)
    # Postfix smtpd_sender_login_maps + reject_authenticated_sender_login_mismatch: envelope sender
    # ("user@example.org", or "@example.org" for the whole domain) -> the login names that may use it. When
    # not empty, MAIL FROM of an authenticated client that does not own the address (an unlisted one
    # included) gets 553 5.7.1 <addr>: Sender address rejected: not owned by user USER. The null sender <>
    # is not checked; unauthenticated clients are not either.
    sender_login_map: dict[str, str | list[str]] = msgspec.field(default_factory=dict)
    # Postfix syntax: "[host]:port" (no MX lookup), "host:port" (MX lookup of host), "" (route by the
    # recipient domain's MX records). The embedded default is the local sink of `make run`.
    relayhost: str = "[127.0.0.1]:2526"
    # Per-domain next hops (Postfix transport(5)): "example.org" = "[10.0.0.5]:25" | "smtp:host" | "discard"
    # | "error:5.1.1 text". Lookup order: exact domain, ".parent" domains, then "*". Wins over relayhost.
    transport_map: dict[str, str] = msgspec.field(default_factory=dict)
    # Next hop by envelope sender (Postfix sender_dependent_relayhost_maps): "alice@example.org" or
    # "@example.org" (or "<>" for the null sender) = relayhost syntax ("[host]:port", "host"). Looked up
    # (address, then @domain) for recipients that transport_map does not route; wins over relayhost.
    sender_dependent_relayhost_maps: dict[str, str] = msgspec.field(default_factory=dict)
    # Per recipient domain: deliveries at once (Postfix default_destination_concurrency_limit) and a rate.
    destination_concurrency_limit: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 20
    destination_rate_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # 0: no limit
    destination_limits: dict[str, DestinationLimit] = msgspec.field(default_factory=dict)
    # Back-off per next hop (mtaq.delivery.backoff; Postfix's qmgr concurrency scheduler): a destination
    # whose failed pseudo-cohorts (connections refused or timed out, 421s) since its last success reach
    # destination_concurrency_failed_cohort_limit (0: never) is dead for smtp_destination_dead_s seconds
    # (Postfix: minimal_backoff_time, 300), never longer than half the first retry interval: its mail is
    # deferred without a connection. Its concurrency window drops by one per failure and grows back by
    # 1/window per success, between 1 and destination_concurrency_limit.
    smtp_destination_dead_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    destination_concurrency_failed_cohort_limit: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 1.0
    # RFC 4865 FUTURERELEASE (HOLDFOR / HOLDUNTIL): the longest delay a client may ask; longer requests are
    # refused with 501 5.5.4 naming this limit (Pulsar PIP-315). 0: no limit.
    delay_max_s: Annotated[float, msgspec.Meta(ge=0)] = 7 * 86400.0
    # Back-pressure at the door: 452 4.3.1 while this many messages are queued (0: no limit), 451 4.3.2
    # while this many messages wait for their fsync (group commit backlog; 0: no limit).
    queue_messages_max: Annotated[int, msgspec.Meta(ge=0)] = 0
    commit_backlog_max: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Outbound STARTTLS (Postfix smtp_tls_security_level): "may" (opportunistic, certificate not verified),
    # "encrypt" (defer 4.7.4/4.7.5 without TLS), "none". Per destination in tls_policy_map.
    # "verify" (RFC 6125: a trusted chain and the server's host name: the MX host name, or the name in
    # brackets) and "secure" (a trusted chain and the next-hop destination: the name in brackets, or the
    # domain and its subdomains) defer 4.7.5 on failure (Postfix's levels; mtaq.delivery.security).
    smtp_tls_security_level: Literal["none", "may", "encrypt", "dane", "verify", "secure"] = "may"
    tls_policy_map: dict[str, Literal["none", "may", "encrypt", "dane", "verify", "secure"]] = msgspec.field(
        default_factory=dict
    )
    # Trust anchors for verify/secure: a PEM file of CA certificates; "" uses the system's CA store.
    smtp_tls_CAfile: str = ""
    # TLS from the first byte (RFC 8314 implicit TLS, port 465) for every SMTP next hop (Postfix
    # smtp_tls_wrappermode); per destination, write "smtps:[host]:465" in transport_map instead.
    smtp_tls_wrappermode: bool = False
    # Outbound AUTH (RFC 4954; Postfix smtp_sasl_auth_enable, smtp_sasl_password_maps): "KEY user:password"
    # lines, KEY a next hop as written ("[smtp.example.com]:587") or, with
    # smtp_sender_dependent_authentication, a sender "@example.org" / "user@example.org". The file must not
    # be readable by group or other (mtaq.delivery.sasl).
    smtp_sasl_auth_enable: bool = False
    smtp_sasl_password_file: str = ""
    smtp_sender_dependent_authentication: bool = False
    # AUTH over a connection without TLS (the password in the clear, base64); Postfix noplaintext's opposite.
    smtp_sasl_allow_plaintext: bool = False
    # After a 5xx to AUTH, mail for that next hop and user is deferred without connecting for this long
    # (no lock-out of the account by retries).
    smtp_sasl_auth_failure_hold_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    # DNS for MX routing: [] means /etc/resolv.conf; entries "IP" or "IP:PORT" / "[IPv6]:PORT".
    dns_nameservers: list[str] = msgspec.field(default_factory=list)
    dns_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 53
    dns_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=300)] = 10.0
    smtp_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 25  # port of MX hosts (MX records carry none)
    smtp_mx_addresses_max: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5  # addresses tried per destination
    smtp_connection_idle_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # cached connections closed after
    smtp_connection_cache_max: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 8  # per delivery worker
    # The local address of outbound SMTP connections (Postfix smtp_bind_address / smtp_bind_address6): an IPv4
    # and an IPv6 address of this host ("" : the kernel's choice). Checked at start (mtaq check).
    smtp_bind_address: str = ""
    smtp_bind_address6: str = ""
    # Source addresses by envelope sender and by destination (KumoMTA's egress sources; Postfix's per-transport
    # -o smtp_bind_address with sender_dependent_default_transport_maps). Values: an address of this host, or a
    # list of one IPv4 and one IPv6 address. Keys of sender_dependent_bind_address_maps: "alice@example.org",
    # "@example.org", "<>" (the address, then its @domain). Keys of destination_bind_address_maps: as
    # tls_policy_map (the next hop as written, "[10.0.0.5]:25", then the recipient domain: "example.org" or
    # "@example.org", ".parent", "*"). For each family: the sender's entry, then the destination's, then
    # smtp_bind_address / smtp_bind_address6. Checked at start and on reload (mtaq check).
    sender_dependent_bind_address_maps: dict[str, str | list[str]] = msgspec.field(default_factory=dict)
    destination_bind_address_maps: dict[str, str | list[str]] = msgspec.field(default_factory=dict)
    myhostname: str = ""  # "" means the host's name
    # The domain mtaq sendmail appends to a bare local name and to the invoking user's login as the default sender
    # (Postfix's myorigin); "" means myhostname.
    myorigin: str = ""
    segment_bytes_max: Annotated[int, msgspec.Meta(ge=65536, le=4096 * MiB)] = 64 * MiB
    message_size_limit_bytes: Annotated[int, msgspec.Meta(ge=1024, le=200 * MiB)] = 10_240_000
    # New mail gets 452 4.3.1 while the spool has less free space than this (Postfix queue_minfree); the
    # floor is never below 1.5 x message_size_limit_bytes (Postfix smtpd's rule), so deliveries can go on.
    queue_minfree_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    delivery_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    # Worker processes sharing the SMTP port, each with its own shard of the spool (mtaq.daemon.workers); never
    # fewer than the shards already in the spool. delivery_concurrency is split among them. "auto": one per
    # core this process may run on (os.sched_getaffinity), at most 8, and 1 when a listener has port 0.
    workers: Annotated[int, msgspec.Meta(ge=1, le=16)] | Literal["auto"] = "auto"
    # Seconds to wait after the 1st, 2nd, ... deferred attempt; the last repeats (RFC 5321 §4.5.4.1).
    retry_intervals_s: Annotated[list[Annotated[float, msgspec.Meta(gt=0)]], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [1800.0, 3600.0, 7200.0, 14400.0]
    )
    maximal_queue_lifetime_s: Annotated[float, msgspec.Meta(gt=0)] = 5 * 86400.0  # then bounce (4.4.7)
    bounce_queue_lifetime_s: Annotated[float, msgspec.Meta(gt=0)] = 5 * 86400.0  # for mail from <>
    delay_warning_time_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # 0: no delay DSNs
    # Postfix bounce_size_limit: a DSN returns a larger original as its header section only (0: no limit).
    bounce_size_limit_bytes: Annotated[int, msgspec.Meta(ge=0)] = 50_000
    # A message being received is kept in memory up to this many bytes, the rest in an unnamed temporary file
    # in the spool, then copied into the log in pieces: memory per SMTP session is bounded by this, not by
    # message_size_limit_bytes (issue 13.4).
    receive_buffer_bytes: Annotated[int, msgspec.Meta(ge=4096, le=64 * MiB)] = 256 * 1024
    checkpoint_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    # An attempt still running after this long is abandoned and its message due again (visibility timeout).
    delivery_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    smtp_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # per command, outbound
    smtp_server_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # idle client, inbound
    # An smtps (port 465) client's TLS handshake must end within this; it holds its place in connections_max
    # and the per-client limits from accept on (Postfix smtpd_starttls_timeout, 300 s, is per I/O operation).
    tls_handshake_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=300)] = 10.0
    stats_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0  # 0 disables the periodic stats event
    # "syslog": RFC 5424 lines (facility mail) to the unix datagram socket syslog_socket, or to stderr when
    # there is none (mtaq.logs; the format is in the README, "Logging").
    log_format: Literal["console", "json", "syslog"] = "console"
    syslog_socket: str = "/dev/log"
    # HTTP admin API and Prometheus /metrics (mtaq/admin/http.py): "HOST:PORT", "" disables it. Port 0 picks a
    # free port (the real one is written to SPOOL/admin.json). Off loopback, admin_token is required.
    admin_listen: str = "127.0.0.1:2580"
    # Every request needs "Authorization: Bearer TOKEN": this token, or when "" the one generated at the
    # first start into SPOOL/admin.token (mode 0600; mtaq queue reads it).
    admin_token: str = ""
    # Started as root, mtaq binds its listeners, reads its keys, makes the spool owned by this user and runs
    # as it (Postfix mail_owner; mtaq.daemon.privileges); a missing user or root: exit 2. Not root: unused.
    mail_owner: str = "mtaq"
    # Host names a request's Host header may name besides IP literals and localhost (DNS rebinding guard).
    admin_hosts: list[str] = msgspec.field(default_factory=list)
    # Limits of the admin API, checked before the token (mtaq/admin/http.py): connections open at once (one
    # more gets 503 and is closed), seconds for a request's headers and body to arrive (else 408, closed), and
    # the largest request body (else 413, closed unread; `mtaq queue` sends many queue IDs in several requests).
    admin_connections_max: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 64
    admin_request_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    admin_body_bytes_max: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    # Distinct recipient domains labelling mtaq_delivery_latency_seconds; later ones are counted as "other".
    metrics_domains_max: Annotated[int, msgspec.Meta(ge=0, le=10000)] = 100
    # --- the SMTP edge (mtaq.edge.policy): relay control, limits, smuggling, TLS, AUTH -------------------
    # Clients that may relay to any domain (CIDR; a bare address is a /32 or /128). Default: loopback only.
    mynetworks: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    # Domains anyone may send to ("example.org" exactly; ".example.org" for its subdomains).
    relay_domains: list[str] = msgspec.field(default_factory=list)
    # The valid recipients of relay_domains (Postfix relay_recipient_maps): a file of "user@domain VALUE" or
    # "@domain VALUE" lines (VALUE is not used; # comments). With it, an unlisted recipient of a relay domain
    # gets 550 5.1.1 at RCPT (no backscatter later); "": every local part is accepted.
    relay_recipient_maps: str = ""
    # Recipient verification by probing the next hop (Postfix reject_unverified_recipient, verify(8);
    # mtaq.delivery.verify): a recipient of relay_domains from a client outside mynetworks and not
    # authenticated is checked at RCPT with a probe (EHLO, MAIL FROM, RCPT TO, RSET, QUIT; never DATA) over
    # the route its mail would take: refused (5xx) -> unverified_recipient_reject_code 5.1.1, not known yet
    # or a temporary failure -> unverified_recipient_defer_code 4.1.1, accepted -> accepted. Results are
    # kept in SPOOL/verify_cache (shared by the workers, kept across restarts, at most
    # address_verify_cache_max addresses).
    reject_unverified_recipient: bool = False
    # Postfix address_verify_sender: the probes' MAIL FROM; "" or "<>": the null sender.
    address_verify_sender: str = ""
    # Postfix address_verify_positive_expire_time (31d) / _refresh_time (7d): an accepted address is
    # believed this long; after the refresh time it is probed again in the background.
    address_verify_positive_expire_s: Annotated[float, msgspec.Meta(gt=0)] = 31 * 86400.0
    address_verify_positive_refresh_s: Annotated[float, msgspec.Meta(gt=0)] = 7 * 86400.0
    # Postfix address_verify_negative_expire_time (3d) / _refresh_time (3h): the same for a refused address.
    address_verify_negative_expire_s: Annotated[float, msgspec.Meta(gt=0)] = 3 * 86400.0
    address_verify_negative_refresh_s: Annotated[float, msgspec.Meta(gt=0)] = 3 * 3600.0
    # A temporary failure (next hop down, 4xx to RCPT) is answered from the cache this long, then probed again.
    address_verify_tempfail_expire_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # Addresses kept in the cache; the oldest results are dropped beyond.
    address_verify_cache_max: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10_000
    # Probes in flight at once per worker process (one per address at most, host-wide); beyond, 4.1.1.
    address_verify_probes_max: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 50
    # How long RCPT waits for a probe's answer before 4.1.1 "address verification in progress" (the probe
    # goes on; Postfix address_verify_poll_count x address_verify_poll_delay: 3 x 3 s).
    address_verify_wait_s: Annotated[float, msgspec.Meta(ge=0, le=300)] = 6.0
    # A probe (all its hosts) is abandoned after this long: a temporary failure.
    address_verify_probe_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120.0
    # The RCPT replies (Postfix unverified_recipient_reject_code, whose default is 450; and
    # unverified_recipient_defer_code).
    unverified_recipient_reject_code: Annotated[int, msgspec.Meta(ge=400, le=599)] = 550
    unverified_recipient_defer_code: Annotated[int, msgspec.Meta(ge=400, le=499)] = 450
    # RFC 5321 §4.5.3.1.8: at least 100 recipients must be accepted; the excess gets 452 4.5.3.
    recipients_per_message_max: Annotated[int, msgspec.Meta(ge=100, le=100_000)] = 1000
    connections_max: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 500  # concurrent, all clients
    # New connections per client IP in any 60 s (clients in mynetworks are exempt); 0: no limit.
    connections_per_client_per_minute_max: Annotated[int, msgspec.Meta(ge=0)] = 120
    # 5xx replies in one session before "421 4.7.0 Error: too many errors" (Postfix smtpd_hard_error_limit).
    smtp_server_errors_max: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    # A bare CR or LF in DATA: "reject" (550 5.5.2 and disconnect) or "normalize" (made CRLF).
    smtp_bare_newline: Literal["reject", "normalize"] = "reject"
    # Connections at once from one client IP, beyond which 421 4.7.0 (mynetworks exempt); 0: no limit.
    smtpd_client_connection_count_limit: Annotated[int, msgspec.Meta(ge=0)] = 50
    # Per cent of connections_max (rounded down) kept for clients in mynetworks.
    smtpd_mynetworks_reserve_percent: Annotated[float, msgspec.Meta(ge=0, lt=100)] = 10.0
    # NUL octets in DATA: "reject" (550 5.6.0 after the final dot; the session goes on) or "strip".
    smtpd_forbid_nul: Literal["reject", "strip"] = "reject"
    # Mail loops (Postfix hopcount_limit): a message that already has this many Received: and Delivered-To:
    # header fields is refused at DATA (554 5.4.6 too many hops).
    hopcount_limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 50
    # Header privacy for authenticated submission: the Received: field of mail from an authenticated client
    # leaves out the client's HELO name and address ("Received: by HOST (mtaq) with ESMTPSA; DATE").
    smtpd_received_header_private: bool = False
    # Rules over each header of a message received (Postfix header_checks, regexp table syntax):
    # "/PATTERN/FLAGS ACTION [TEXT]", ACTION REJECT, WARN, IGNORE, REPLACE, PREPEND, DUNNO (mtaq.edge.headerchecks).
    header_checks: list[str] = msgspec.field(default_factory=list)
    # Bounce classification (issue 37.3, after KumoMTA's classifier): a TOML rule file whose rules are tried
    # before the shipped ones (mtaq/core/bounce_rules.toml; the format in mtaq.core.bounce_class). "": the
    # shipped rules alone. Read at the start (a bad file stops it with one line) and by ``mtaq check``.
    bounce_classification_file: str = ""
    # Delivery events pushed to HTTP endpoints (issue 37; mtaq.daemon.exporter, docs/events.md): each endpoint
    # reads the log with its own position, kept in the checkpoint; segments are kept until its events are
    # acknowledged, unless it lags by more than event_backlog_max_bytes of log: then it skips ahead to the
    # end (logged as event_backlog_skipped, counted in /metrics).
    event_webhooks: list[EventWebhook] = msgspec.field(default_factory=list)
    event_backlog_max_bytes: Annotated[int, msgspec.Meta(ge=MiB)] = 1024 * MiB
    # Content filters over the Sendmail milter protocol (Postfix smtpd_milters, MILTER_README): each
    # "inet:host:port" or "unix:/path", asked in order at each SMTP stage before the 250 (mtaq.edge.milter).
    # A listeners table may set its own smtpd_milters. non_smtpd_milters: for mail picked up from the maildrop.
    smtpd_milters: list[str] = msgspec.field(default_factory=list)
    non_smtpd_milters: list[str] = msgspec.field(default_factory=list)
    # When a filter cannot be reached, times out or fails: "tempfail" (451 4.3.5), "accept" (as if it were
    # not configured) or "reject" (550 5.5.0), for the rest of the SMTP session.
    milter_default_action: Literal["tempfail", "accept", "reject"] = "tempfail"
    milter_connect_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    milter_command_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    milter_content_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 300.0
    milter_protocol: Annotated[int, msgspec.Meta(ge=2, le=6)] = 6
    # Address rewriting at receipt (Postfix canonical(5); mtaq.edge.canonical): files of "KEY VALUE" lines in
    # Postfix's table syntax, KEY user@domain, user or @domain, VALUE an address or @domain (keeps the local
    # part). The envelope sender and sender headers go through sender_canonical_maps then canonical_maps;
    # recipients and recipient headers through recipient_canonical_maps then canonical_maps. Headers only in
    # mail from mynetworks or authenticated clients. "": none.
    canonical_maps: str = ""
    sender_canonical_maps: str = ""
    recipient_canonical_maps: str = ""
    # What canonical maps rewrite (Postfix canonical_classes).
    canonical_classes: list[Literal["envelope_sender", "envelope_recipient", "header_sender", "header_recipient"]] = (
        msgspec.field(default_factory=lambda: ["envelope_sender", "envelope_recipient", "header_sender",
                                               "header_recipient"]))
    # Address rewriting of mail leaving (Postfix smtp_generic_maps, generic(5)): the same file syntax, applied
    # when a message is sent to the envelope and the header addresses (not to fields a DKIM/ARC signature of
    # the message covers); the queued message is unchanged. "": none.
    smtp_generic_maps: str = ""
    # Postfix smtpd_error_sleep_time: seconds before a failed AUTH is answered.
    smtpd_error_sleep_time_s: Annotated[float, msgspec.Meta(ge=0, le=300)] = 1.0
    # Failed AUTH attempts per client IP in any 60 s before AUTH gets 450 4.7.1 (mynetworks too); 0: no limit.
    smtpd_client_auth_failure_rate_limit: Annotated[int, msgspec.Meta(ge=0)] = 10
    # Postfix smtpd_client_ipv6_prefix_length (default 84 since 3.8): an IPv6 client counts as its address's
    # first this many bits in every per-client limit (connections at once, per minute, AUTH failures).
    smtpd_client_ipv6_prefix_length: Annotated[int, msgspec.Meta(ge=0, le=128)] = 84
    tls_cert_file: str = ""  # PEM certificate chain for STARTTLS ("" : no STARTTLS)
    tls_key_file: str = ""  # PEM private key for STARTTLS
    auth_password_file: str = ""  # "user:bcrypt-hash" lines (mtaq passwd); "" : no AUTH
    # Reclaimed segments are copied here before they are deleted ("" = no archive; relative to the cwd).
    archive_dir: str = ""
    archive_compress: Literal["none", "zstd"] = "none"
    archive_retention_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # delete archives older than this; 0: keep
    # --- DANE (RFC 7672) and MTA-STS (RFC 8461): mtaq.delivery.dane, mtaq.delivery.mtasts. NOT USED BY DELIVERY
    # YET (the modules exist and are tested; the delivery path does not call them). --------------------------
    # Postfix smtp_dns_support_level: "dnssec" asks the resolver for DNSSEC (DO+AD) and believes its AD bit
    # (from the resolvers below only); DANE needs it. "enabled": plain DNS; "disabled" is accepted for Postfix
    # compatibility and means the same as "enabled" here (mtaq routes by MX).
    smtp_dns_support_level: Literal["disabled", "enabled", "dnssec"] = "enabled"
    # Resolvers ("IP" or "IP:PORT", port dns_port) whose AD bit is believed: validating resolvers reached over
    # a path nobody can tamper with (loopback). An answer from any other server counts as insecure.
    dnssec_trusted_resolvers: list[str] = msgspec.field(default_factory=list)
    # MTA-STS: fetch and cache (SPOOL/mta-sts/) recipient domains' policies; enforce restricts MX hosts.
    mta_sts: bool = False
    mta_sts_ca_file: str = ""  # PEM CA bundle for the policy's HTTPS certificate; "" : the system store
    mta_sts_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=300)] = 10.0  # TXT lookup, and the policy fetch
    # DKIM signing (RFC 6376) by the domain of the From: header (or its closest parent with a key); mail of
    # other domains is relayed unsigned. DSNs are signed with the key of myhostname's domain, if any.
    dkim_keys: dict[str, DkimKeyConfig] = msgspec.field(default_factory=dict)
    # Whose mail is signed (rspamd dkim_signing auth_only + sign_networks, OpenDKIM InternalHosts):
    # "authenticated" (only when the login owns the From: address in sender_login_map, or, without a map,
    # the From: domain is the envelope sender's and the login an address at it) and "mynetworks" (any From:). Mail from other clients
    # (received for relay_domains) is never signed; [] signs only the DSNs mtaq generates.
    dkim_sign_clients: list[Literal["authenticated", "mynetworks"]] = msgspec.field(
        default_factory=lambda: ["authenticated", "mynetworks"])
    # Without sender_login_map, an authenticated login is signed for only when it is an address at the From:
    # domain (alice@example.org for From: ...@example.org; rspamd's allow_username_mismatch = false). true:
    # any login whose envelope sender's domain is the From: domain is signed for (logins without a domain),
    # so that every user can sign for every domain with a key: prefer a sender_login_map.
    dkim_allow_username_mismatch: bool = False

    def hostname(self) -> str:
        return self.myhostname or socket.getfqdn()


def load_config(path: str | None, overrides: dict[str, object], *, problems: list[str] | None = None) -> Config:
    """Read the TOML file at ``path`` (None: defaults only), apply ``overrides`` (flag values), validate.

    Raises ConfigError with a one-line message naming the file and key: a file that cannot be read or
    decoded, else the first of :func:`config_problems`, unless ``problems`` is given (``mtaq check``): then
    every one of them is appended to it (one line each) and the config is returned all the same.
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
    where = f"{path}: " if path else ""
    _check_tables(data, where)
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}{_name_key(str(exc))}") from exc
    found = config_problems(cfg)
    if problems is not None:
        problems.extend(found)
    elif found:
        raise ConfigError(found[0])
    return cfg


def _check_verify_sender(sender: str) -> None:
    """``address_verify_sender``: "" or "<>" (the null sender), else ``local@domain`` without white space,
    controls or angle brackets. Raises ValueError naming the key."""
    if sender in ("", "<>"):
        return
    local, at, domain = sender.rpartition("@")
    if not at or not local or not domain or any(ch.isspace() or ord(ch) < 32 or ch in '<>"\x7f' for ch in sender):
        raise ValueError(f"address_verify_sender: {sender!r} is not an address (local@domain) nor \"<>\"")


def config_problems(cfg: Config) -> list[str]:
    """Every problem of a decoded config that its types do not catch (addresses that do not parse, listeners
    without their files, map entries, DANE without DNSSEC, admin_listen off loopback without a token): one
    line each, in the order the keys are checked; [] when there is none."""

    def dane_needs_dnssec() -> None:
        if cfg.smtp_dns_support_level != "dnssec":
            if cfg.smtp_tls_security_level == "dane":
                raise ValueError('smtp_tls_security_level: "dane" needs smtp_dns_support_level = "dnssec" '
                                 "(and a validating resolver in dnssec_trusted_resolvers)")
            for domain, level in cfg.tls_policy_map.items():
                if level == "dane":
                    raise ValueError(f'tls_policy_map.{domain}: "dane" needs smtp_dns_support_level = "dnssec"')

    def admin() -> None:
        if cfg.admin_listen.strip():
            admin_host, _ = parse_hostport(cfg.admin_listen, key="admin_listen")
            if not cfg.admin_token and not is_loopback(admin_host):
                raise ValueError(
                    f"admin_token: required when admin_listen ({cfg.admin_listen}) is not a loopback address"
                )

    checks: list[Callable[[], object]] = [
        lambda: listeners_of(cfg),
        *[lambda i=i, h=h: _check_webhook(i, h, cfg.event_webhooks[:i]) for i, h in enumerate(cfg.event_webhooks)],
        lambda: _check_sender_login_map(cfg.sender_login_map) if cfg.sender_login_map else None,
        lambda: parse_relayhost(cfg.relayhost),
        *[lambda ns=ns: parse_nameserver(ns, cfg.dns_port) for ns in cfg.dns_nameservers],
        *[lambda ns=ns: parse_nameserver(ns, cfg.dns_port, key="dnssec_trusted_resolvers")
          for ns in cfg.dnssec_trusted_resolvers],
        *[lambda d=d, v=v: parse_transport_spec(v, key=f"transport_map.{d}") for d, v in cfg.transport_map.items()],
        *[lambda k=k, v=v: _check_sender_relayhost(k, v) for k, v in cfg.sender_dependent_relayhost_maps.items()],
        *[lambda i=i, v=v: _check_milter(v, f"smtpd_milters[{i}]") for i, v in enumerate(cfg.smtpd_milters)],
        *[lambda i=i, v=v: _check_milter(v, f"non_smtpd_milters[{i}]") for i, v in enumerate(cfg.non_smtpd_milters)],
        *[lambda k=k, v=v: _check_bind_entry("sender_dependent_bind_address_maps", k, v)
          for k, v in cfg.sender_dependent_bind_address_maps.items()],
        *[lambda k=k, v=v: _check_bind_entry("destination_bind_address_maps", k, v)
          for k, v in cfg.destination_bind_address_maps.items()],
        dane_needs_dnssec,
        admin,
        lambda: _check_verify_sender(cfg.address_verify_sender),
    ]
    found = []
    for check in checks:
        try:
            check()
        except ValueError as exc:
            found.append(str(exc))
    return found


def listeners_of(cfg: Config) -> list[Listener]:
    """Every SMTP listener of ``cfg``, checked: the ``listen`` addresses in order, then the ``listeners``
    tables that name another address, in the order written. The first is the one the ``listening`` event's
    ``listen`` field names (as before there were several).

    Raises ValueError naming the key: an address that does not parse, the same address twice, a mode that
    needs TLS without ``tls_cert_file``/``tls_key_file`` or AUTH without ``auth_password_file``, no listener.
    """
    listen = [cfg.listen] if isinstance(cfg.listen, str) else list(cfg.listen)
    seen: dict[tuple[str, int], str] = {}
    addresses: list[tuple[str, str, int]] = []
    for i, address in enumerate(listen):
        key = "listen" if isinstance(cfg.listen, str) else f"listen[{i}]"
        host, port = parse_hostport(address, key=key)
        where = (host.lower(), port)
        if where in seen:
            raise ValueError(f"{key}: {address!r} is the same address as {seen[where]!r}")
        seen[where] = address
        addresses.append((address, host, port))
    tables: dict[tuple[str, int], tuple[str, ListenerConfig]] = {}
    for address, table in cfg.listeners.items():
        key = f'listeners."{address}"'
        host, port = parse_hostport(address, key=key)
        where = (host.lower(), port)
        if where in tables:
            raise ValueError(f"{key}: the same address as another listeners table")
        tables[where] = (key, table)
        if where not in seen:
            seen[where] = address
            addresses.append((address, host, port))
    if not addresses:
        raise ValueError("listen: no SMTP listener (give listen an address, or a listeners table)")
    out: list[Listener] = []
    for address, host, port in addresses:
        key, table = tables.get((host.lower(), port), ("listen", ListenerConfig()))
        tls_required, wrappermode, auth_required = _MODE_DEFAULTS[table.mode]
        if not isinstance(table.smtpd_tls_security_level, msgspec.UnsetType):
            tls_required = table.smtpd_tls_security_level == "encrypt"
        if not isinstance(table.smtpd_tls_wrappermode, msgspec.UnsetType):
            wrappermode = table.smtpd_tls_wrappermode
        if wrappermode and table.smtpd_tls_security_level == "encrypt":
            raise ValueError(f'{key}.smtpd_tls_security_level: "encrypt" means STARTTLS, which a '
                             "smtpd_tls_wrappermode listener does not offer (its TLS starts with the connection)")
        if wrappermode:
            tls_required = False  # no STARTTLS inside TLS (RFC 8314 §3.3): the connection is TLS already
        if not isinstance(table.auth_required, msgspec.UnsetType):
            auth_required = table.auth_required
        if (tls_required or wrappermode) and not (cfg.tls_cert_file and cfg.tls_key_file):
            raise ValueError(f"{key}: mode {table.mode!r} (TLS {'from the first byte' if wrappermode else 'required'}) "
                             "needs tls_cert_file and tls_key_file")
        if auth_required and not cfg.auth_password_file:
            raise ValueError(f"{key}: mode {table.mode!r} (AUTH required) needs auth_password_file")
        milters = None if isinstance(table.smtpd_milters, msgspec.UnsetType) else tuple(table.smtpd_milters)
        for i, spec in enumerate(milters or ()):
            _check_milter(spec, f"{key}.smtpd_milters[{i}]")
        out.append(Listener(address=address, host=host, port=port, mode=table.mode, tls_required=tls_required,
                            wrappermode=wrappermode, auth_required=auth_required, smtpd_milters=milters))
    return out


def parse_milter_address(spec: str) -> tuple[str, str, int]:
    """A milter address (Postfix smtpd_milters): ``inet:host:port`` (``inet:[::1]:port`` for IPv6, sendmail's
    ``inet:port@host`` too) or ``unix:/path`` (``local:/path``) -> ``("inet", host, port)`` /
    ``("unix", path, 0)``. Raises ValueError."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"{spec!r}: expected inet:host:port or unix:/path")
    kind = kind.lower()
    if kind in ("unix", "local"):
        return "unix", rest, 0
    if kind in ("inet", "inet6"):
        if "@" in rest:
            port_s, _, host = rest.partition("@")
        else:
            host, _, port_s = rest.rpartition(":")
        host = host.strip("[]")
        if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ValueError(f"{spec!r}: expected inet:host:port with a port 1-65535")
        return "inet", host, int(port_s)
    raise ValueError(f"{spec!r}: unknown socket type {kind!r} (inet or unix)")


def _check_milter(spec: str, key: str) -> None:
    """A milter address: inet:host:port or unix:/path (ValueError naming ``key``)."""
    try:
        parse_milter_address(spec)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _check_sender_login_map(table: dict[str, str | list[str]]) -> None:
    """Each key an address ``local@domain`` or ``@domain``, each value one or more login names."""
    for address, owners in table.items():
        key = f'sender_login_map."{address}"'
        _local, at, domain = address.strip().rpartition("@")
        if not at or not domain or any(ch.isspace() or ch < " " for ch in address):
            raise ValueError(f"{key}: not an address (user@example.org) or a domain (@example.org)")
        names = owners.replace(",", " ").split() if isinstance(owners, str) else owners
        if not names or any(not n.strip() or any(ch.isspace() or ch < " " for ch in n) for n in names):
            raise ValueError(f"{key}: give one or more login names (\"alice\" or [\"alice\", \"bob\"])")


def _check_tables(data: dict[str, object], where: str) -> None:
    """Validate each ``listeners`` and ``sender_login_map`` entry on its own, so that an error names its
    table (msgspec's own path leaves dictionary keys out: ``listeners[...].mode``). Raises ConfigError."""
    entries: list[tuple[str, object, object]] = []
    listeners = data.get("listeners")
    if isinstance(listeners, dict):
        entries += [(f'listeners."{k}"', v, ListenerConfig) for k, v in listeners.items()]
    for table in ("sender_login_map", "sender_dependent_bind_address_maps", "destination_bind_address_maps"):
        entries_of = data.get(table)
        if isinstance(entries_of, dict):
            entries += [(f'{table}."{k}"', v, str | list[str]) for k, v in entries_of.items()]
    hooks = data.get("event_webhooks")
    if isinstance(hooks, list):
        entries += [(f"event_webhooks[{i}]", v, EventWebhook) for i, v in enumerate(hooks)]
    for key, value, kind in entries:
        try:
            msgspec.convert(value, kind)
        except msgspec.ValidationError as exc:
            m = re.search(r" - at `\$\.?([^`]*)`$", str(exc))
            text = str(exc)[: m.start()] if m else str(exc)
            field = f".{m.group(1)}" if m and m.group(1) else ""
            raise ConfigError(f"{where}{key}{field}: {text}") from exc


def _check_webhook(i: int, hook: EventWebhook, before: list[EventWebhook]) -> None:
    """An ``event_webhooks`` entry: an http(s) URL with a host, each URL once (it names the endpoint's position
    in the checkpoint), ``retry_min_s`` <= ``retry_max_s``, a ``ca_file`` that loads as PEM CA certificates.
    Raises ValueError naming the entry."""
    m = re.fullmatch(r"https?://[^/\s?#]+(?:[/?#]\S*)?", hook.url)
    if m is None:
        raise ValueError(f"event_webhooks[{i}].url: expected http://HOST[:PORT]/PATH or https://..., got {hook.url!r}")
    if any(b.url == hook.url for b in before):
        raise ValueError(f"event_webhooks[{i}].url: {hook.url} is listed twice")
    if hook.retry_min_s > hook.retry_max_s:
        raise ValueError(f"event_webhooks[{i}].retry_min_s: {hook.retry_min_s} is more than retry_max_s {hook.retry_max_s}")
    if not hook.events:
        raise ValueError(f"event_webhooks[{i}].events: empty (leave it out for every event)")
    if hook.ca_file:
        try:
            ssl.create_default_context(cafile=hook.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"event_webhooks[{i}].ca_file: {hook.ca_file}: {getattr(exc, 'strerror', None) or exc}") from exc


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); any other name counts as not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _check_sender_key(table: str, key: str) -> None:
    """A key of a sender-dependent table (Postfix sender_dependent_*_maps): an address, ``@domain`` or ``<>``.
    Raises ValueError naming it."""
    if key != "<>" and "@" not in key:
        raise ValueError(f"{table}.{key}: the key is an address, @domain or <>")


def _check_sender_relayhost(key: str, value: str) -> None:
    """One ``sender_dependent_relayhost_maps`` entry: a sender address, ``@domain`` or ``<>``, and a next hop
    (relayhost syntax, not empty). Raises ValueError naming it."""
    name = f"sender_dependent_relayhost_maps.{key}"
    _check_sender_key("sender_dependent_relayhost_maps", key)
    if parse_relayhost(value, key=name) is None:
        raise ValueError(f"{name}: a next hop is needed")


def destination_key(value: str, *, key: str) -> str:
    """A ``destination_bind_address_maps`` key, lower case, as looked up: a next hop as written
    (``[10.0.0.5]:25``, ``[mx.example]``, ``relay.example:587``) or a recipient domain (``example.org``,
    ``.parent``, ``*``); ``@example.org`` is ``example.org``. Raises ValueError naming ``key``."""
    v = value.strip().lower()
    if v.startswith("@"):
        v = v[1:]
    if not v or any(c.isspace() or c in "@\"\\" for c in v):
        raise ValueError(f"{key}: the key is a next hop ([host]:port) or a domain (example.org, @example.org, "
                         ".parent, *)")
    return v


def _check_bind_entry(table: str, key: str, value: str | list[str]) -> None:
    """One entry of a source-address map: its key (a sender, or a destination) and its addresses."""
    if table == "sender_dependent_bind_address_maps":
        _check_sender_key(table, key)
    else:
        destination_key(key, key=f"{table}.{key}")
    parse_bind_addresses(value, key=f"{table}.{key}")


def parse_bind_addresses(value: str | list[str], *, key: str) -> tuple[str, str]:
    """A source-address map value (``sender_dependent_bind_address_maps``, ``destination_bind_address_maps``):
    one IP address, or one IPv4 and one IPv6 address (a list, or a string with commas or spaces) ->
    ``(ipv4, ipv6)``, "" for the family not given. Raises ValueError naming ``key``: not an IP address, none,
    two of one family. Whether the host has them is :mod:`mtaq.daemon.check`'s (at start and on reload)."""
    items = value.replace(",", " ").split() if isinstance(value, str) else [v.strip() for v in value]
    found: dict[int, str] = {}
    for item in items:
        try:
            ip = ipaddress.ip_address(item)
        except ValueError:
            raise ValueError(f"{key}: {item!r} is not an IP address") from None
        if ip.version in found:
            raise ValueError(f"{key}: two IPv{ip.version} addresses ({found[ip.version]}, {ip}): give at most "
                             "one of each family")
        found[ip.version] = str(ip)
    if not found:
        raise ValueError(f"{key}: give an IP address of this host")
    return found.get(4, ""), found.get(6, "")


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


_STATUS = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})(?:\s+|$)")


class TransportSpec(msgspec.Struct, frozen=True):
    """A ``transport_map`` value as written: ``kind`` smtp (``nexthop`` None: the recipient domain by MX),
    ``discard`` or ``error``; for the last two ``code``/``status``/``text`` is the reply their recipients get
    (an SMTP code, an RFC 3463 enhanced status code, the text)."""

    kind: Literal["smtp", "discard", "error"]
    nexthop: Relayhost | None = None
    code: int | None = None
    status: str | None = None
    text: str = ""
    wrapper: bool = False  # "smtps:": TLS from the first byte (RFC 8314 implicit TLS)


def parse_transport_spec(value: str, *, key: str = "transport_map", default_port: int = 25) -> TransportSpec:
    """Postfix transport(5) syntax -> TransportSpec. Raises ValueError naming ``key`` for a value it cannot use.

    ``discard`` and ``discard:text``; ``error:5.1.1 text``, ``error:text`` (5.0.0); ``smtp:NEXTHOP``,
    ``relay:NEXTHOP``, ``smtp:`` or a bare ``NEXTHOP`` in relayhost syntax (``[host]:port``, ``host:port``);
    ``smtps:NEXTHOP`` is ``smtp`` with TLS from the first byte (RFC 8314 §3.3, Postfix's ``smtps`` service
    with ``smtp_tls_wrappermode = yes``).
    """
    v = value.strip()
    kind, colon, rest = v.partition(":")
    kind = kind.lower()
    if kind == "discard":
        return TransportSpec("discard", code=250, status="2.0.0", text=rest.strip() or "discarded by transport map")
    if kind == "error":
        m = _STATUS.match(rest.strip())
        if m and m.group(1) == "2":
            raise ValueError(f"{key}: error status {m.group(0).strip()} is not a failure (4.x.x or 5.x.x)")
        status = f"{m.group(1)}.{m.group(2)}.{m.group(3)}" if m else "5.0.0"
        text = (rest.strip()[m.end() :] if m else rest).strip() or "mail for this destination is refused"
        return TransportSpec("error", code=550 if status[0] == "5" else 450, status=status, text=text)
    if kind in ("smtp", "relay", "smtps") and colon:
        nexthop = rest
    elif re.fullmatch(r"[a-z][a-z0-9-]*", kind) and colon and not rest[:1].isdigit() and not v.startswith("["):
        raise ValueError(f"{key}: unknown transport {kind!r} in {value!r} (smtp, smtps, relay, discard or error)")
    else:
        nexthop = v
    wrapper = kind == "smtps" and bool(colon)
    if not nexthop.strip():
        return TransportSpec("smtp", None, wrapper=wrapper)
    return TransportSpec("smtp", parse_relayhost(nexthop, key=key, default_port=default_port), wrapper=wrapper)


def parse_nameserver(value: str, default_port: int = 53, *, key: str = "dns_nameservers") -> tuple[str, int]:
    """A ``dns_nameservers`` entry, ``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` -> (ip, port).

    Raises ValueError naming the key when it is not an IP address (a resolver needs no resolver).
    """
    v = value.strip()
    if v.count(":") > 1 and not v.startswith("["):
        host, port = v, default_port  # a bare IPv6 address
    else:
        host, port = parse_hostport(v, default_port=default_port, key=key)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{key}: {value!r} is not an IP address") from None
    return host, port
