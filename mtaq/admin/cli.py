"""``mtaq queue``: list, size, show, delete, hold, release, flush, bounce (Postfix mailq / postsuper style).

The commands talk to the running daemon through its admin HTTP API (:mod:`mtaq.admin.http`), found through
``SPOOL/admin.json`` (or ``--url``), with the stdlib's urllib. When the daemon is down (no admin.json, its
pid gone, or nothing listening), ``list``, ``size`` and ``show`` read the spool directly (every shard of a
spool written by several workers, merged as the API merges them: :mod:`mtaq.admin.shards`) and say so on
stderr; the actions then fail: the queue is changed only by the daemon, through its log.

What must hold: a listing names the log position it is consistent as of; errors are one line on stderr
(``mtaq: ...``) with exit status 1; nothing here writes to the spool.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

import msgspec

from mtaq.core.duration import parse_duration
from mtaq.core.errors import MtaqError
from mtaq.core.parking import ADMIN_ACTIONS

__all__ = ["add_queue_parser", "add_reload_parser", "format_mailq", "run_queue", "run_reload"]

HEADER = "-Queue ID-  --Size-- ----Arrival Time---- -Sender/Recipient-------"
RECIPIENT_INDENT = 42
_PAST = {"delete": "deleted", "hold": "held", "release": "released", "flush": "flushed", "bounce": "bounced",
         "delay": "delayed"}
_FLAG = {"active": "*", "held": "!"}


class QueueCommandError(MtaqError):
    """A ``mtaq queue`` command that cannot be carried out; the message is the one line printed."""


class Offline(Exception):
    """The daemon is not reachable; ``why`` says how we know."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# ------------------------------------------------------------------------------------------- arguments
def _add_api_arguments(p: argparse.ArgumentParser, *, timeout_s: float) -> None:
    """How a command reaches the running daemon's admin API: --spool, --url, --token, --timeout."""
    p.add_argument("--spool", metavar="DIR", help="spool directory (default: spool_dir of --config, else ./spool)")
    p.add_argument("--url", metavar="URL", help="admin API URL (default: from SPOOL/admin.json)")
    p.add_argument("--token", metavar="TOKEN",
                   help="admin API bearer token (default: $MTAQ_ADMIN_TOKEN, else admin_token of --config, "
                        "else SPOOL/admin.token)")
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=timeout_s,
                   help=f"seconds to wait for the daemon's answer (default {timeout_s:g})")


def add_queue_parser(sub: Any) -> None:
    """Add ``mtaq queue ...`` to the ``mtaq`` sub-command parsers ``sub``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file (spool_dir, admin_token)")
    _add_api_arguments(common, timeout_s=300.0)
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("--sender", metavar="S", help="sender contains S (case-insensitive)")
    filters.add_argument("--recipient", metavar="R", help="a recipient contains R (case-insensitive)")
    filters.add_argument("--domain", metavar="D", help="a recipient's domain is D")
    filters.add_argument("--held", action="store_true", help="held messages only")
    filters.add_argument("--deferred", action="store_true", help="deferred messages only")
    filters.add_argument("--older-than", metavar="DURATION", help="arrived more than DURATION ago (3600, 30m, 2h, 1d)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="JSON output")

    p = sub.add_parser("queue", help="list, inspect and act on the queue (mailq, postsuper)")
    qsub = p.add_subparsers(dest="queue_command", required=True)
    lst = qsub.add_parser("list", parents=[common, filters], help="the queue like mailq (--json: like postqueue -j)")
    lst.add_argument("--json", action="store_true", help="one JSON object per message and line (postqueue -j)")
    lst.add_argument("--limit", metavar="N", type=_positive, help="at most N messages (a page); the cursor of the "
                     "next page is printed on stderr")
    lst.add_argument("--after", metavar="CURSOR", help="the page after CURSOR (the next cursor of the last page)")
    qsub.add_parser("size", parents=[common, as_json], help="messages by state (daemon counters: no scan)")
    show = qsub.add_parser("show", parents=[common, as_json], help="one message: envelope, reasons, headers")
    show.add_argument("queue_id", metavar="ID")
    for action in ADMIN_ACTIONS:
        a = qsub.add_parser(action, parents=[common, filters, as_json], help=f"{action} messages (running daemon)")
        a.add_argument("targets", nargs="+", metavar="ID|ALL|-",
                       help="queue IDs, ALL (spelled out), or - to read IDs from standard input; filters narrow")
        if action == "delay":
            a.add_argument("--for", dest="delay_for", metavar="DURATION", required=True,
                           help="park the messages this long (3600, 30m, 2h, 1d; at most delay_max_s)")


def _positive(v: str) -> int:
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {v!r}")
    return int(v)


def add_reload_parser(sub: Any) -> None:
    """Add ``mtaq reload`` (Postfix's ``postfix reload``; :mod:`mtaq.daemon.reload`)."""
    p = sub.add_parser("reload", help="make the running daemon read its configuration again (postfix reload): "
                                      "new sessions and attempts use it; exit 1 with one line per problem")
    p.add_argument("--config", metavar="FILE",
                   help="the daemon's TOML configuration file (to find spool_dir and admin_token; the daemon "
                        "reads the file it was started with)")
    _add_api_arguments(p, timeout_s=60.0)
    p.add_argument("--json", action="store_true", help="the daemon's answer as one JSON object")


def run_reload(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``mtaq reload``: ``POST /reload`` to the running daemon (every worker reloads: worker 0 asks the
    others), then one line per worker (``--json``: the answer). Returns 0 when every worker applied the new
    configuration, 1 otherwise (one ``mtaq: reload: ...`` line per problem on stderr). Raises MtaqError
    (one line) when the daemon cannot be reached."""
    out = out or sys.stdout
    spool, token = _settings(args)
    try:
        res = _client(args, spool, token).call("POST", "/reload", body={})
    except Offline as off:
        raise QueueCommandError(f"reload needs a running daemon with its admin API ({off.why}); without the "
                                "API (admin_listen = \"\") send SIGHUP to the mtaq serve process") from None
    if args.json:
        out.write(json.dumps(res) + "\n")
    workers = res.get("workers", [])
    for w in workers:
        name = f"worker {w['shard']}" if len(workers) > 1 else "daemon"
        if w["applied"]:
            changed = ", ".join(w["changed"]) or "no key (files read again)"
            if not args.json:
                out.write(f"{name}: reloaded; changed: {changed}\n")
        for p in w["problems"]:
            print(f"mtaq: reload: {name}: {p}", file=sys.stderr)
        if w["applied"] and w["restart_needed"]:
            print(f"mtaq: reload: {name}: needs a restart to change (kept as they were): "
                  f"{', '.join(w['restart_needed'])}", file=sys.stderr)
        if w.get("sasl_hold_cleared") and not args.json:
            out.write(f"{name}: SASL hold ended for the changed credentials of: {', '.join(w['sasl_hold_cleared'])}\n")
        if not w["applied"]:
            print(f"mtaq: reload: {name}: nothing changed", file=sys.stderr)
    return 0 if res.get("applied") else 1


# ----------------------------------------------------------------------------------------- the client
class Client:
    """JSON over HTTP to the admin API (urllib). Raises Offline when nothing answers at all."""

    def __init__(self, url: str, token: str, timeout_s: float, *, may_be_stale: bool) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.may_be_stale = may_be_stale  # the URL came from admin.json: refused means the daemon is down

    def call(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None) -> Any:
        """The decoded JSON answer. Raises QueueCommandError for an error answer (its message), Offline."""
        payload, _headers = self.fetch(method, path, query, body)
        try:
            return msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise QueueCommandError(f"admin API at {self.url}: answer is not JSON: {exc}") from None

    def fetch(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None, *,
              accept: str = "application/json") -> tuple[bytes, Any]:
        """The answer's body (bytes) and headers (an ``email.message.Message``), asked for as ``accept``.
        Raises QueueCommandError for an error answer (its message), Offline."""
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": accept}
        if data is not None or method not in ("GET", "HEAD"):
            headers["Content-Type"] = "application/json"  # the API refuses state changes without it (415)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + min(self.timeout_s, 30.0)
        while True:
            req = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read(), resp.headers
            except urllib.error.HTTPError as exc:
                if exc.code == 503 and time.monotonic() < deadline:  # recovery in progress: it is short
                    time.sleep(0.2)
                    continue
                raise QueueCommandError(_error_message(exc)) from None
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, ConnectionRefusedError) and self.may_be_stale:
                    raise Offline(f"nothing listening at {self.url}") from None
                raise QueueCommandError(f"admin API at {self.url}: {exc.reason}") from None
            except (TimeoutError, ConnectionError) as exc:
                raise QueueCommandError(f"admin API at {self.url}: {exc}") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        msg = str(json.loads(exc.read())["message"])
    except (ValueError, KeyError, TypeError):
        msg = exc.reason or ""
    hint = " (give --token or set MTAQ_ADMIN_TOKEN)" if exc.code == 401 else ""
    return f"admin API: {exc.code} {msg}{hint}"


def _settings(args: argparse.Namespace) -> tuple[str, str]:
    """(spool directory, token) from the flags, the environment and --config."""
    spool, token = args.spool, args.token
    if args.config:
        from mtaq.config import load_config

        cfg = load_config(args.config, {})
        spool = spool or cfg.spool_dir
        token = token or os.environ.get("MTAQ_ADMIN_TOKEN") or cfg.admin_token
    spool = spool or "./spool"
    token = token or os.environ.get("MTAQ_ADMIN_TOKEN", "")
    if not token:  # the token the daemon generated at its first start
        from mtaq.admin.token import read_spool_token

        try:
            token = read_spool_token(spool)
        except PermissionError:
            raise QueueCommandError(
                f"{os.path.join(spool, 'admin.token')}: permission denied (run as the daemon's user, or give --token)"
            ) from None
    return spool, token


def _client(args: argparse.Namespace, spool: str, token: str) -> Client:
    """The client of the running daemon. Raises Offline when admin.json says there is none."""
    if args.url:
        return Client(args.url, token, args.timeout, may_be_stale=False)
    path = os.path.join(spool, "admin.json")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        url, pid = str(info["url"]), int(info["pid"])
    except FileNotFoundError:
        raise Offline(f"no {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise QueueCommandError(f"{path}: unreadable: {exc}") from None
    if not _pid_alive(pid):
        raise Offline(f"daemon pid {pid} of {path} is not running")
    return Client(url, token, args.timeout, may_be_stale=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _offline_note(why: str, spool: str) -> None:
    print(f"mtaq: daemon not running ({why}); reading the spool {spool} directly", file=sys.stderr)


def _need_log(spool: str) -> None:
    if not os.path.isdir(os.path.join(spool, "log")):
        raise QueueCommandError(f"no queue log at {os.path.join(spool, 'log')}")


# ------------------------------------------------------------------------------------------- commands
def run_queue(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``mtaq queue ...``; returns the exit status. Raises MtaqError (a one-line message)."""
    out = out or sys.stdout
    spool, token = _settings(args)
    older = None
    if getattr(args, "older_than", None) is not None:
        try:
            older = parse_duration(args.older_than)
        except ValueError as exc:
            raise QueueCommandError(f"--older-than: {exc}") from None
    cmd = args.queue_command
    if cmd == "list":  # a process that ends after it: a listing makes a few objects per message, no garbage
        gc.disable()  # to collect (a third of the time of 100,000 messages, walking them again and again)
    if cmd in ADMIN_ACTIONS:
        body = _action_body(args, older)
        try:
            client = _client(args, spool, token)
            res = _act_in_batches(client, cmd, body)
        except Offline as off:
            raise QueueCommandError(
                f"{cmd} needs a running daemon ({off.why}): the queue changes only through the daemon's log"
            ) from None
        _print_action(cmd, res, args.json, out)
        return 0
    lines: bytes | None = None  # a --json listing from the daemon, as it sent it
    try:
        client = _client(args, spool, token)
        if cmd == "list" and args.json:  # the lines as the daemon's views keep them: nothing decoded here
            query = _filter_query(args, older) | {"limit": args.limit, "after": args.after}
            lines, headers = client.fetch("GET", "/mailQueues/spool/mails", query, accept="application/x-ndjson")
            if headers.get_content_type() == "application/x-ndjson":
                position, next_cursor = headers.get("X-Mtaq-Position", "?"), headers.get("X-Mtaq-Next")
                damage = json.loads(headers.get("X-Mtaq-Damage") or "[]")
            else:  # a daemon of an earlier version: the JSON object
                listing, lines = msgspec.json.decode(lines), None
                position, mails = listing["position"], listing["mails"]
                next_cursor, damage = listing.get("next"), listing.get("damage", [])
        elif cmd == "list":
            query = _filter_query(args, older) | {"limit": args.limit, "after": args.after}
            listing = client.call("GET", "/mailQueues/spool/mails", query)
            position, mails = listing["position"], listing["mails"]
            next_cursor, damage = listing.get("next"), listing.get("damage", [])
        elif cmd == "size":
            size = client.call("GET", "/mailQueues/spool")
            counts: dict[str, Any] = {**size["byState"], "total": size["size"], "position": size["position"]}
        else:
            detail = client.call("GET", f"/mails/{urllib.parse.quote(args.queue_id, safe='')}")
    except Offline as off:
        _need_log(spool)
        _offline_note(off.why, spool)
        from mtaq.admin import service as admin
        from mtaq.admin.shards import join_positions
        from mtaq.queue.store import queue_id_shard
        from mtaq.storage.shards import shard_dirs

        shards = shard_dirs(spool)
        if cmd == "list":
            after = _cursor(args.after)
            positions, mails, damage, more = [], [], [], False
            for shard, d in shards:
                page = _offline_list(d, args, older, after)
                positions.append((shard, page.position))
                mails += page.mails
                more = more or page.next is not None
                damage += [f"shard {shard}: {p}" if len(shards) > 1 else p for p in page.damage]
            mails.sort(key=lambda m: (m["arrival_time"], m["queue_id"]))
            if args.limit is not None:
                more = more or len(mails) > args.limit
                mails = mails[:args.limit]
            position = join_positions(positions)
            next_cursor = admin.cursor_of(mails[-1]) if more and mails else None
        elif cmd == "size":
            parts = [(shard, admin.offline_size(d)) for shard, d in shards]
            counts = {key: sum(int(c.get(key, 0)) for _shard, c in parts)
                      for key in ("incoming", "active", "deferred", "delayed", "held", "total")}
            counts["position"] = join_positions((shard, str(c["position"])) for shard, c in parts)
            counts["source"] = "; ".join(f"shard {shard}: {c['source']}" if len(parts) > 1 else str(c["source"])
                                         for shard, c in parts)
        else:
            owner = dict(shards).get(queue_id_shard(args.queue_id) or 0, spool)
            try:
                detail = admin.offline_show(owner, args.queue_id)
            except admin.AdminError as exc:
                if owner == spool:
                    raise QueueCommandError(str(exc)) from None
                try:  # an ID made by one worker (random low bits) is in shard 0
                    detail = admin.offline_show(spool, args.queue_id)
                except admin.AdminError as exc2:
                    raise QueueCommandError(str(exc2)) from None
    if cmd == "list":
        for problem in damage:
            print(f"mtaq: damaged log: {problem}", file=sys.stderr)
        if args.json:
            if lines is not None:
                _write_ndjson(lines, out)
            else:
                _write_json_lines(mails, out)
            print(f"mtaq: listing consistent as of log position {position}", file=sys.stderr)
        else:
            out.write(format_mailq(mails, position))
        if next_cursor is not None:
            print(f"mtaq: more: --after {next_cursor}", file=sys.stderr)
    elif cmd == "size":
        if args.json:
            out.write(json.dumps(counts) + "\n")
        else:
            for k in ("incoming", "active", "deferred", "delayed", "held", "total"):
                out.write(f"{k:<9} {counts.get(k, 0)}\n")
            source = f"; {counts['source']}" if "source" in counts else ""
            out.write(f"(as of log position {counts['position']}{source})\n")
    else:
        out.write(json.dumps(detail) + "\n" if args.json else format_show(detail))
    return 0


def _filter_query(args: argparse.Namespace, older: float | None) -> dict[str, Any]:
    return {
        "sender": args.sender,
        "recipient": args.recipient,
        "domain": args.domain,
        "held": "true" if args.held else None,
        "deferred": "true" if args.deferred else None,
        "olderThan": None if older is None else repr(older),
    }


def _cursor(value: str | None) -> tuple[int, str] | None:
    from mtaq.admin.service import parse_cursor

    if value is None:
        return None
    try:
        return parse_cursor(value)
    except ValueError as exc:
        raise QueueCommandError(f"--after: {exc}") from None


def _offline_list(spool: str, args: argparse.Namespace, older: float | None, after: tuple[int, str] | None) -> Any:
    from mtaq.admin.service import offline_view, page_of
    from mtaq.core.view import Selector

    view = offline_view(spool)
    sel = Selector(sender=args.sender, recipient=args.recipient, domain=args.domain, held=args.held,
                   deferred=args.deferred, older_than_s=older)
    entries = sel.select(view.entries.values(), time.time())
    page = page_of(entries, view, limit=args.limit, after=after, position=str(view.end))
    page.damage = [p for _n, ps in sorted(view.damage.items()) for p in ps]
    return page


def _write_ndjson(lines: bytes, out: TextIO) -> None:
    """The daemon's JSON lines (UTF-8) as :func:`_write_json_lines` writes them: a line that is not ASCII
    is decoded and written again with ``json.dumps`` (its ``\\uXXXX`` escapes); the rest as it came."""
    if lines.isascii():
        out.write(lines.decode("ascii"))
        return
    for line in lines.splitlines():
        if line.isascii():
            out.write(line.decode("ascii") + "\n")
        else:
            out.write(json.dumps(json.loads(line), separators=(",", ":")) + "\n")


def _write_json_lines(mails: Sequence[dict[str, Any]], out: TextIO) -> None:
    """One compact JSON object per line (``postqueue -j``), written in large pieces. A line that is not
    ASCII is written with ``json.dumps``, whose ``\\uXXXX`` escapes keep it valid JSON through the escaping
    of the output (a C1 control or a bidi character would otherwise be escaped Python-style)."""
    enc = msgspec.json.encode
    chunk: list[str] = []
    for m in mails:
        line = enc(m).decode()
        chunk.append(line if line.isascii() else json.dumps(m, separators=(",", ":")))
        if len(chunk) >= 4096:
            out.write("\n".join(chunk) + "\n")
            chunk = []
    if chunk:
        out.write("\n".join(chunk) + "\n")


def _action_body(args: argparse.Namespace, older: float | None) -> dict[str, Any]:
    ids: list[str] = []
    everything = False
    for t in args.targets:
        if t == "ALL":
            everything = True
        elif t == "-":
            got = [line.strip() for line in sys.stdin if line.strip()]
            if not got:
                raise QueueCommandError("no queue IDs on standard input")
            ids += got
        else:
            ids.append(t)
    if everything and ids:
        raise QueueCommandError("give either ALL or queue IDs, not both")
    body: dict[str, Any] = {"all": True} if everything else {"ids": ids}
    for key, value in (("sender", args.sender), ("recipient", args.recipient), ("domain", args.domain)):
        if value is not None:
            body[key] = value
    if args.held:
        body["held"] = True
    if args.deferred:
        body["deferred"] = True
    if older is not None:
        body["olderThan"] = older
    if getattr(args, "delay_for", None) is not None:
        try:
            body["delay"] = parse_duration(args.delay_for)
        except ValueError as exc:
            raise QueueCommandError(f"--for: {exc}") from None
    return body


# Queue IDs per action request: about 20 bytes each as JSON, far below the API's body limit
# (admin_body_bytes_max, 1 MiB by default); more IDs (``-`` reads them from stdin) go in several requests.
IDS_PER_REQUEST = 20_000


def _act_in_batches(client: Any, action: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /mails/actions/{action}`` with ``body``; a long ``ids`` list in requests of at most
    :data:`IDS_PER_REQUEST` IDs, their answers merged (``done`` and ``skipped`` together, the last ``position``)."""
    ids = body.get("ids") or []
    if len(ids) <= IDS_PER_REQUEST:
        res: dict[str, Any] = client.call("POST", f"/mails/actions/{action}", body=body)
        return res
    merged: dict[str, Any] = {"action": action, "position": "", "done": [], "skipped": {}}
    for i in range(0, len(ids), IDS_PER_REQUEST):
        part = client.call("POST", f"/mails/actions/{action}", body={**body, "ids": ids[i:i + IDS_PER_REQUEST]})
        merged["done"] += part["done"]
        merged["skipped"].update(part["skipped"])
        merged["position"] = part["position"]
    return merged


def _print_action(action: str, res: dict[str, Any], as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(res) + "\n")
        return
    for qid in res["done"]:
        out.write(f"{qid}: {_PAST[action]}\n")
    for qid, why in res["skipped"].items():
        print(f"mtaq: {qid}: skipped: {why}", file=sys.stderr)
    n = len(res["done"])
    out.write(f"{_PAST[action].capitalize()}: {n} message{'' if n == 1 else 's'} "
              f"(as of log position {res['position']})\n")


# ------------------------------------------------------------------------------------------ formatting
def format_mailq(mails: Sequence[dict[str, Any]], position: str) -> str:
    """The listing as Postfix ``mailq`` prints it: a header; per message the queue ID with ``*`` (active)
    or ``!`` (held), size (bytes), arrival time (UTC), sender; each recipient on its own line after its last
    reason in parentheses; a blank line between messages; the total in Kbytes (rounded up) and requests,
    and the log position the listing is consistent as of."""
    from mtaq.admin.service import format_time  # here: --json and the actions never need the service module

    if not mails:
        return f"Mail queue is empty (consistent as of log position {position})\n"
    lines = [HEADER]
    total = 0
    for m in mails:
        total += int(m["message_size"])
        flag = _FLAG.get(str(m["state"]), "")
        lines.append(f"{m['queue_id'] + flag:<11} {m['message_size']:>8} {format_time(m['arrival_time']):<20} "
                     f"{m['sender'] or '<>'}")
        last = None
        for r in m["recipients"]:
            reason = r.get("delay_reason")
            if reason and reason != last:
                lines.append(f"({reason})")
            last = reason
            lines.append(" " * RECIPIENT_INDENT + r["address"])
        lines.append("")
    n = len(mails)
    kbytes = math.ceil(total / 1024)
    lines.append(f"-- {kbytes} Kbytes in {n} Request{'' if n == 1 else 's'}. (consistent as of log position {position})")
    return "\n".join(lines) + "\n"


def format_show(d: dict[str, Any]) -> str:
    """One message for a terminal (``mtaq queue show``): envelope fields, recipients, header section."""
    from mtaq.admin.service import format_time

    lines = [
        f"Queue ID: {d['queue_id']}",
        f"State: {d['state']}",
        f"Arrival: {format_time(d['arrival_time'])} UTC",
        f"Size: {d['message_size']} bytes",
        f"Sender: {d['sender'] or '<>'}",
        f"Attempts: {d.get('attempts', 0)}",
    ]
    if "next_attempt_time" in d:
        lines.append(f"Next attempt: {format_time(d['next_attempt_time'])} UTC")
    if "release_time" in d:
        lines.append(f"Release: {format_time(d['release_time'])} UTC")
    if d.get("client"):
        lines.append(f"Client: {d['client']} (HELO {d.get('helo', '')})")
    if d.get("bounce_of"):
        lines.append(f"Bounce of: {d['bounce_of']}")
    lines.append("Recipients:")
    for r in d["recipients"]:
        reason = f"  ({r['delay_reason']})" if r.get("delay_reason") else ""
        lines.append(f"  {r['address']}{reason}")
    if "headers" in d:
        lines.append("Headers:")
        lines += [f"  {k}: {v}".replace("\r\n", "\n") for k, v in d["headers"]]  # folded lines stay folded
    elif "headers_error" in d:
        lines.append(f"Headers: unreadable: {d['headers_error']}")
    lines.append(f"(consistent as of log position {d['position_as_of']})")
    return "\n".join(lines) + "\n"
