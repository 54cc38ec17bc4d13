"""The ``mtaq`` command line (argparse).

``mtaq serve``, ``mtaq reload`` (postfix reload; mtaq/daemon/reload.py), ``mtaq check`` (mtaq/daemon/check.py), ``mtaq sink``, ``mtaq sendmail`` (sendmail(1); mtaq/edge/sendmail.py; also when the program is
called ``sendmail`` or ``mailq``), ``mtaq dkim keygen``, ``mtaq log dump``, ``mtaq log verify``, ``mtaq passwd``, ``mtaq analyze``
(delivery statistics on Spark; needs the ``spark`` extra, imported only when that command runs), ``mtaq queue
...`` (mtaq/admin/cli.py). Errors are one line on stderr with a non-zero exit status: 2 for bad usage or
configuration, 1 for a log that does not verify or a ``queue`` command that failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
from collections.abc import Sequence

from mtaq.config import Config, load_config, parse_hostport
from mtaq.core.errors import ConfigError, MtaqError
from mtaq.core.text import EscapingWriter
from mtaq.logs import configure_logging

__all__ = ["main"]


def _add_log_format(p: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    p.add_argument("--log-format", choices=("console", "json", "syslog"), default=default,
                   help="log line format (stderr; syslog: RFC 5424 to syslog_socket)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; ``command="serve"``: of ``serve`` alone (what a start needs, without
    importing the queue and analytics commands: 70 ms of a start; issue 36.3)."""
    parser = argparse.ArgumentParser(prog="mtaq", description="A crash-only, log-structured mail queue (SMTP relay).")
    _add_log_format(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the relay daemon (the only start is a recovery)")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--spool", metavar="DIR", help="spool directory (default ./spool)")
    p.add_argument("--listen", metavar="HOST:PORT[,HOST:PORT...]",
                   help="plain SMTP listening address(es), instead of the config's listen (default 127.0.0.1:2525); "
                        "listeners tables (submission, smtps) still add theirs")
    p.add_argument("--relayhost", metavar="[HOST]:PORT", help="next hop, Postfix syntax (default [127.0.0.1]:2526)")
    p.add_argument("--admin-listen", metavar="HOST:PORT",
                   help='admin HTTP API and /metrics address (default 127.0.0.1:2580; "" disables it)')
    p.add_argument("--mynetworks", metavar="CIDR[,CIDR...]", type=_comma_list,
                   help="clients that may relay anywhere (default 127.0.0.0/8,::1/128)")
    p.add_argument("--relay-domains", metavar="DOMAIN[,DOMAIN...]", type=_comma_list,
                   help="domains anyone may send to (.example.org: its subdomains)")
    p.add_argument("--workers", metavar="auto|N", type=_workers,
                   help="worker processes, one spool shard each, 1..16; auto (the default): one per core, at most 8 "
                        "(1 when a listener has port 0)")
    _add_log_format(p)
    if command == "serve":
        return parser

    p = sub.add_parser("check", help="check the configuration, every file it names, the spool and the listeners "
                                     "(postfix check); exit 1 with one line per problem")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--bind", action="store_true", help="also bind each listening address once (fails while mtaq runs)")
    p.add_argument("--no-dns", dest="dns", action="store_false",
                   help="do not look up the DKIM keys' TXT records (looked up by default; unanswered: not checked)")

    p = sub.add_parser("sink", help="a local SMTP sink that stores what it receives as a Maildir")
    p.add_argument("--listen", metavar="HOST:PORT", required=True)
    p.add_argument("--maildir", metavar="DIR", required=True)
    p.add_argument("--defer-rcpt", metavar="REGEX", help="answer 451 4.2.0 to matching recipients")
    p.add_argument("--reject-rcpt", metavar="REGEX", help="answer 550 5.1.1 to matching recipients")
    p.add_argument("--defer-count", metavar="N", type=int, default=0,
                   help="defer a --defer-rcpt recipient only on its first N attempts (0: always)")
    p.add_argument("--rcpt-reply", metavar="REGEX=REPLY", action="append", default=[],
                   help="answer REPLY (e.g. '452 4.2.2 mailbox full') to matching recipients (repeatable; first wins)")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM certificate (chain): offer STARTTLS")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (default: in the same file)")
    p.add_argument("--no-smtputf8", action="store_true", help="do not offer SMTPUTF8 (RFC 6531)")
    _add_log_format(p)

    p = sub.add_parser("passwd", help="print a user:hash line for auth_password_file (password from stdin)")
    p.add_argument("user", help="the user name (printable ASCII, no ':')")
    p.add_argument("--rounds", type=int, default=12, choices=range(4, 32), metavar="4..31",
                   help="bcrypt cost (default 12)")

    p = sub.add_parser("dkim", help="DKIM signing keys (RFC 6376)")
    dsub = p.add_subparsers(dest="dkim_command", required=True)
    k = dsub.add_parser("keygen", help="write a new private key (mode 0600) and print its DNS TXT record")
    k.add_argument("domain", help="the signing domain (d=), the domain of the From: addresses")
    k.add_argument("selector", help="the selector (s=): the record is SELECTOR._domainkey.DOMAIN")
    k.add_argument("--type", choices=("rsa", "ed25519"), default="rsa", help="key type (default rsa)")
    k.add_argument("--bits", type=int, default=2048, metavar="N", help="RSA key size, 2048..8192 (default 2048)")
    k.add_argument("--out", metavar="FILE", help="private key file (default DOMAIN.SELECTOR.key.pem); never overwritten")

    p = sub.add_parser("log", help="inspect the queue log")
    lsub = p.add_subparsers(dest="log_command", required=True)
    d = lsub.add_parser("dump", help="one line per record")
    d.add_argument("--spool", metavar="DIR", default="./spool")
    d.add_argument("--json", action="store_true", help="one JSON object per line")
    v = lsub.add_parser("verify", help="check every checksum and link; exit 0 when sound")
    v.add_argument("--spool", metavar="DIR", default="./spool")

    sub.add_parser("sendmail", add_help=False,
                   help="sendmail(1): queue a message from stdin, also with the daemon down (-t, -f, -F, -i, -bs, -bp, -q)")
    from mtaq.admin.cli import add_queue_parser, add_reload_parser

    add_queue_parser(sub)
    add_reload_parser(sub)
    from mtaq.analytics.command import add_arguments

    a = sub.add_parser("analyze", help="delivery statistics from queue-log segments on Spark (the spark extra)")
    add_arguments(a)
    return parser


def _command_word(words: Sequence[str]) -> str | None:
    """The command ``words`` name (the first word after the top-level options), or None."""
    i = 0
    while i < len(words):
        w = words[i]
        if w == "--log-format":
            i += 2
        elif w.startswith("--log-format="):
            i += 1
        else:
            return None if w.startswith("-") else w
    return None


def main(argv: Sequence[str] | None = None) -> int:
    prog = os.path.basename(sys.argv[0]) if argv is None else ""
    words = list(sys.argv[1:] if argv is None else argv)
    if prog in ("sendmail", "mailq") or (words and words[0] == "sendmail"):
        # sendmail(1) has its own option syntax (-oi, -f sender, -bs...): not argparse (mtaq.admin.sendmail).
        from mtaq.edge.sendmail import main as sendmail_main

        if prog in ("sendmail", "mailq"):
            return sendmail_main(words, prog=prog, queue_command=_sendmail_queue)
        return sendmail_main(words[1:], queue_command=_sendmail_queue)
    args = build_parser(_command_word(words)).parse_args(words)
    if args.command == "analyze" and argv is None:
        # The program itself (not a caller in this process): once the job has written and closed its files and
        # stopped Spark, end without the interpreter's teardown of pandas, matplotlib, PySpark and pyarrow, 0.25 s
        # of a 6 s run (docs/performance.md, "Stop 50"). The exit handlers still run (PySpark's profiler writes
        # its output from one); the driver JVM ends on its own when its stdin closes.
        import atexit

        code = _main(args)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: the descriptor was closed when the program started
                stream.flush()
        os._exit(code)
    if args.command not in ("queue", "log"):
        return _main(args)
    # Human output of what clients sent (addresses, HELO names, replies): every control, format and line-
    # separator character is escaped on the way to the terminal (mtaq.core.text), JSON lines included.
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapingWriter(sys.stdout), EscapingWriter(sys.stderr)
    try:
        return _main(args)
    finally:
        sys.stdout, sys.stderr = saved


def _main(args: argparse.Namespace) -> int:
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "sink":
            return _sink(args)
        if args.command == "check":
            return _check(args)
        if args.command == "queue":
            from mtaq.admin.cli import run_queue

            return run_queue(args)
        if args.command == "reload":
            from mtaq.admin.cli import run_reload

            return run_reload(args)
        if args.command == "passwd":
            return _passwd(args)
        if args.command == "dkim":
            return _dkim_keygen(args)
        if args.command == "analyze":
            from mtaq.analytics.command import run

            return run(args)
        if args.command == "log":
            from mtaq.daemon.workers import log_dirs
            from mtaq.storage.logtools import dump, verify

            shards = log_dirs(args.spool)  # one log per shard (mtaq.daemon.workers); just SPOOL/log with one worker
            for _k, log_dir in shards:
                if not os.path.isdir(log_dir):
                    raise ConfigError(f"no queue log at {log_dir}")
            status = 0
            for k, log_dir in shards:
                shard = k if len(shards) > 1 else None
                if args.log_command == "dump":
                    status = max(status, dump(log_dir, as_json=args.json, out=sys.stdout, shard=shard))
                else:
                    status = max(status, verify(log_dir, out=sys.stdout))
            return status
    except ConfigError as exc:
        print(f"mtaq: {exc}", file=sys.stderr)
        return 2
    except MtaqError as exc:
        print(f"mtaq: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _serve(args: argparse.Namespace) -> int:
    overrides = {
        "spool_dir": args.spool,
        "listen": None if args.listen is None else (_comma_list(args.listen) if "," in args.listen else args.listen),
        "relayhost": args.relayhost,
        "admin_listen": args.admin_listen,
        "log_format": args.log_format,
        "mynetworks": args.mynetworks,
        "relay_domains": args.relay_domains,
        "workers": args.workers,
    }
    cfg = load_config(args.config, overrides)
    configure_logging(cfg.log_format, syslog_socket=cfg.syslog_socket)
    from mtaq.daemon.process import serve

    try:
        # mtaq reload / SIGHUP read the same file with the same flags again (mtaq.daemon.reload).
        return serve(cfg, source=lambda: load_config(args.config, overrides))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    except OSError as exc:
        from mtaq.daemon.process import oserror_line

        print(f"mtaq: cannot serve: {oserror_line(exc)}", file=sys.stderr)
        return 1


def _check(args: argparse.Namespace) -> int:
    """``mtaq check``: every problem on stdout, one line each, and 1; nothing and 0 when there is none."""
    from mtaq.daemon.check import problems

    try:
        found: list[str] = []  # the config's own problems, then those of its files, spool and listeners
        cfg = load_config(args.config, {}, problems=found)
        found += problems(cfg, bind=args.bind, dns=args.dns)
    except ConfigError as exc:  # the file cannot be read or decoded: nothing else can be checked
        found = [str(exc)]
    for line in found:
        print(f"mtaq: check: {line}")
    return 1 if found else 0


def _sendmail_queue(command: str, cfg: Config, config_path: str | None) -> int:
    """``sendmail -bp`` (``list``) and ``-q`` (``flush``, ALL): ``mtaq queue`` on the spool of ``cfg``; a failure is
    one line and 75 (EX_TEMPFAIL: the daemon may be starting)."""
    from mtaq.admin.cli import run_queue

    # Parsed by the real parser, so every option `mtaq queue` gains has its default here too (a Namespace
    # written by hand lacked --limit/--after once they were added, and -bp failed).
    argv = ["queue", command, "--spool", cfg.spool_dir, *(["--config", config_path] if config_path else []),
            *(["ALL"] if command == "flush" else [])]
    ns = build_parser().parse_args(argv)
    try:
        return run_queue(ns)
    except MtaqError as exc:
        print(f"sendmail: {exc}", file=sys.stderr)
        return 75


def _workers(value: str) -> int | str:
    """``--workers``: ``auto`` or a whole number (the config check says when it is out of range)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of workers, got {value!r}") from None


def _comma_list(value: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; ``""`` -> ``[]``."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _passwd(args: argparse.Namespace) -> int:
    """Read a password (asked twice on a terminal; else the first line of stdin) and print ``user:hash``."""
    import getpass

    from mtaq.edge.auth import hash_password, valid_user

    if not valid_user(args.user):
        raise ConfigError(f"passwd: bad user name {args.user!r} (printable ASCII, no ':' or space)")
    if sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            raise ConfigError("passwd: the passwords differ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    try:
        hashed = hash_password(password.encode("utf-8"), rounds=args.rounds)
    except ValueError as exc:
        raise ConfigError(f"passwd: {exc}") from exc
    print(f"{args.user}:{hashed}")
    return 0


def _dkim_keygen(args: argparse.Namespace) -> int:
    """Write a new DKIM private key (PEM, mode 0600, never over an existing file) and print the zone file line
    of its TXT record on stdout (key material never goes to the terminal)."""
    from mtaq.edge.dkim import generate_key, normalize_domain, txt_record, valid_selector

    domain = normalize_domain(args.domain)
    if domain is None:
        raise ConfigError(f"dkim keygen: {args.domain!r} is not a domain name")
    if not valid_selector(args.selector):
        raise ConfigError(f"dkim keygen: {args.selector!r} is not a selector (RFC 6376 §3.1)")
    try:
        pem, value = generate_key(args.type, args.bits)
    except ValueError as exc:
        raise ConfigError(f"dkim keygen: {exc}") from exc
    out = args.out or f"{domain}.{args.selector}.key.pem"
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"dkim keygen: {out}: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # whatever the umask
        f.write(pem)
    print(f"; private key in {out} (mode 0600): dkim_keys.\"{domain}\" selector = \"{args.selector}\"", file=sys.stderr)
    print(txt_record(domain, args.selector, value))
    return 0


def _sink(args: argparse.Namespace) -> int:
    configure_logging(args.log_format or "console")
    try:
        host, port = parse_hostport(args.listen)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    from mtaq.testing.sink import run_sink

    try:
        asyncio.run(run_sink(host, port, args.maildir, defer_rcpt=args.defer_rcpt, reject_rcpt=args.reject_rcpt,
                              defer_count=args.defer_count, rcpt_replies=args.rcpt_reply,
                              tls_cert=args.tls_cert, tls_key=args.tls_key,
                              smtputf8=not args.no_smtputf8))
    except (OSError, ssl.SSLError) as exc:
        print(f"mtaq: sink: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad --rcpt-reply
        raise ConfigError(str(exc)) from exc
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
