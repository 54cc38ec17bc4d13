"""``mtaq reload`` and SIGHUP: which configuration keys a running daemon takes up, and which need a restart.

Postfix's ``postfix reload`` is the model: the daemon reads the same configuration source it started with
(the ``--config`` file with the same flags, or the defaults) and applies it to the SMTP sessions and the
delivery attempts that start afterwards; a session or an attempt in progress finishes on what it started
with (none is closed, none cut). Everything new is built first (TLS context, password files, DKIM keys,
routing, outbound credentials); when anything fails (a bad TOML file, a key that does not match its
certificate, a file the daemon cannot read) nothing at all changes and every problem is one line of the
answer (:class:`ReloadResult`) and of the ``reload_failed`` event.

A key in :data:`RELOADABLE` is applied. Any other key that changed is kept as it was and named in
``restart_needed`` (the listening addresses, the spool, workers, the admin API, mail_owner, the log format,
the retry schedule, the delivery connection pools...): never silently ignored. The files the reloadable
keys name are read again even when the key did not change (a renewed certificate at the same path).

The daemon reads the files as ``mail_owner`` after its start (:mod:`mtaq.daemon.privileges`): a file only
root can read (fine at the start, which reads keys before dropping root) is a problem line naming the key,
the file and what to do (make it readable by mail_owner, as under systemd's ``User=``, or restart).
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field
from typing import Any

from mtaq.config import Config

__all__ = ["RELOADABLE", "ReloadResult", "changed_keys", "unreadable_files"]

RELOADABLE: frozenset[str] = frozenset({
    # the SMTP edge: new sessions (EdgePolicy, the connection gate, EdgeSettings)
    "mynetworks", "relay_domains", "relay_recipient_maps", "sender_login_map", "recipients_per_message_max", "connections_max",
    "connections_per_client_per_minute_max", "smtp_server_errors_max", "smtp_bare_newline",
    "smtpd_client_connection_count_limit", "smtpd_mynetworks_reserve_percent", "smtpd_forbid_nul",
    "smtpd_error_sleep_time_s", "smtpd_client_auth_failure_rate_limit", "smtpd_client_ipv6_prefix_length",
    "tls_cert_file", "tls_key_file", "auth_password_file", "delay_max_s", "message_size_limit_bytes",
    "smtp_server_timeout_s", "tls_handshake_timeout_s", "hopcount_limit", "smtpd_received_header_private", "header_checks",
    "smtpd_milters", "non_smtpd_milters", "milter_default_action", "milter_connect_timeout_s", "milter_command_timeout_s",
    "milter_content_timeout_s", "milter_protocol",
    "reject_unverified_recipient", "unverified_recipient_reject_code", "unverified_recipient_defer_code",
    "canonical_maps", "sender_canonical_maps", "recipient_canonical_maps", "canonical_classes",
    # delivery: new attempts (Router, Throttle, SaslClient, PeerPolicy)
    "relayhost", "transport_map", "sender_dependent_relayhost_maps", "sender_dependent_bind_address_maps",
    "destination_bind_address_maps", "smtp_generic_maps", "destination_concurrency_limit", "destination_rate_per_s",
    "smtp_destination_dead_s", "destination_concurrency_failed_cohort_limit",
    "destination_limits", "smtp_tls_security_level", "tls_policy_map", "smtp_tls_CAfile", "smtp_tls_wrappermode",
    "smtp_sasl_auth_enable", "smtp_sasl_password_file", "smtp_sender_dependent_authentication",
    "smtp_sasl_allow_plaintext", "smtp_sasl_auth_failure_hold_s", "dns_nameservers", "dns_port", "dns_timeout_s",
    "smtp_port", "smtp_mx_addresses_max", "smtp_dns_support_level", "dnssec_trusted_resolvers", "mta_sts",
    "mta_sts_ca_file", "mta_sts_timeout_s", "delivery_timeout_s",
    # DKIM signing: messages whose DATA ends after the reload (Signer)
    "dkim_keys", "dkim_sign_clients", "dkim_allow_username_mismatch",
    # the queue's admission limits and the checkpoint period
    "queue_messages_max", "commit_backlog_max", "bounce_size_limit_bytes", "queue_minfree_bytes",
    "checkpoint_interval_s",
})
"""The configuration keys a reload applies; every other key needs a restart."""


@dataclass
class ReloadResult:
    """What one daemon (one worker) did: ``applied`` (False: nothing changed), the keys that changed and
    were applied, those kept until a restart, one line per problem, and the password-file keys whose SASL
    hold a changed entry ended (:meth:`mtaq.delivery.sasl.SaslClient.keep_holds`)."""

    shard: int = 0
    applied: bool = False
    changed: list[str] = field(default_factory=list)
    restart_needed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    sasl_hold_cleared: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "applied": self.applied, "changed": self.changed,
                "restart_needed": self.restart_needed, "problems": self.problems,
                "sasl_hold_cleared": self.sasl_hold_cleared}


def changed_keys(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """``(applied, restart_needed)``: the keys whose value differs between ``old`` and ``new``, split by
    :data:`RELOADABLE`; each list in the order of the Config's fields."""
    changed = [k for k in old.__struct_fields__ if getattr(old, k) != getattr(new, k)]
    return [k for k in changed if k in RELOADABLE], [k for k in changed if k not in RELOADABLE]


def _files(cfg: Config) -> list[tuple[str, str]]:
    """``(key, path)`` of every file the reloadable keys of ``cfg`` make the daemon read."""
    out = [(k, getattr(cfg, k)) for k in ("tls_cert_file", "tls_key_file", "auth_password_file", "smtp_tls_CAfile",
                                          "mta_sts_ca_file", "canonical_maps", "sender_canonical_maps",
                                          "recipient_canonical_maps", "smtp_generic_maps") if getattr(cfg, k)]
    if cfg.smtp_sasl_auth_enable and cfg.smtp_sasl_password_file:
        out.append(("smtp_sasl_password_file", cfg.smtp_sasl_password_file))
    out += [(f"dkim_keys.{d}.key_file", k.key_file) for d, k in cfg.dkim_keys.items()]
    return out


def unreadable_files(cfg: Config) -> list[str]:
    """One line per file of ``cfg`` that exists but that this process (``mail_owner`` after the start)
    cannot read, naming the key, the file and the remedy; [] when every one is readable (a missing file
    is left to the loader, whose message names it)."""
    problems = []
    for key, path in _files(cfg):
        if not os.path.exists(path) or os.access(path, os.R_OK):
            continue
        try:
            user = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            user = f"uid {os.geteuid()}"
        problems.append(
            f"{key}: {path}: not readable by {user}, the user the daemon runs as since its start: make it "
            f"readable by {user} (chown {user} {path}, mode 0600 or 0640 with a group of {user}; as the systemd "
            f"unit's User= needs anyway), or restart mtaq; the old one is kept")
    return problems
