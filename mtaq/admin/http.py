"""The HTTP admin API (aiohttp, in the daemon's event loop): the queue as JSON, Prometheus ``/metrics``.

Routes follow Apache James WebAdmin's mail-queue routes (``/mailQueues``...), on one queue named ``spool``:
mtaq has one log, and a message's state (incoming, active, deferred, delayed, held) is a filter, not a
queue. The OpenAPI 3 description is :data:`mtaq.admin.openapi.SPEC` (``GET /openapi.json``).

What must always hold:

* the API listens on ``admin_listen`` (loopback by default); off loopback, ``admin_token`` is required at
  start-up (config check). Every request, ``/metrics`` included, must carry ``Authorization: Bearer TOKEN``
  or gets 401: the configured ``admin_token``, or else the one generated at the first start and kept in
  ``SPOOL/admin.token`` (mode 0600, read by ``mtaq queue``);
* a web page the operator visits cannot act on the API (cross-site request forgery, DNS rebinding): a
  ``Host`` that is neither an IP literal, ``localhost`` nor a name in ``admin_hosts`` gets 403; an
  ``Origin`` (or ``Sec-Fetch-Site: cross-site``) that is not the API's own origin gets 403; a request that
  changes state (POST, PATCH, DELETE, PUT) without ``Content-Type: application/json`` gets 415, so no HTML
  form or "simple" cross-origin request can reach a handler. Checked before the token;
* it listens from the start (metrics during recovery) but queue routes answer 503 until recovery is done;
* every error is JSON ``{"statusCode", "type", "message"}`` (James style): 400 bad input (the message names
  the parameter), 401, 404 unknown queue, queue ID or route, 405, 500 when the log cannot be written;
* actions go through :class:`~mtaq.admin.service.AdminService` (durable log records, consistent selection);
* ``SPOOL/admin.json`` (``{"url", "pid"}``) is written atomically (rename; not fsync'd: it is a hint for
  ``mtaq queue``, rewritten at every start) once the API listens;
* with several workers (:mod:`mtaq.daemon.workers`) the public API is worker 0's and covers every shard
  (:mod:`mtaq.admin.shards`): worker k >= 1 serves the same application, plus the internal ``/_shard/...``
  routes, on the unix socket ``SPOOL/shard-k/admin.sock`` (mode 0600), behind the same checks and token.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web
from multidict import MultiMapping

from mtaq.admin.metrics import CONTENT_TYPE, Metrics
from mtaq.admin.service import AdminError, AdminService
from mtaq.admin.shards import PeerError, ShardedAdmin, ShardPeer
from mtaq.admin.token import ADMIN_TOKEN, read_spool_token, spool_token
from mtaq.core.duration import parse_duration
from mtaq.core.errors import StorageError
from mtaq.core.parking import ADMIN_ACTIONS
from mtaq.core.view import Selector

__all__ = ["ADMIN_JSON", "ADMIN_TOKEN", "QUEUE_NAME", "AdminHttp", "ApiError", "ApiState", "make_app",
           "read_spool_token", "selector_from_query", "spool_token"]

QUEUE_NAME = "spool"
ADMIN_JSON = "admin.json"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_JSON = "application/json"
_BODY_BYTES_MAX = 64 * 1024 * 1024  # an action body naming a million queue IDs fits
_LIST_PARAMS = {"sender", "recipient", "domain", "held", "deferred", "olderThan", "limit"}
_DELETE_PARAMS = {"sender", "recipient", "domain", "held", "deferred", "olderThan", "name"}
# James: PATCH /mailQueues/{name}?delayed=true {"delayed": false} makes mail that waits for a later time
# deliverable now; here: deferred (waiting for a retry) and delayed (FUTURERELEASE) mail.
_NOT_YET_DUE = frozenset({"deferred", "delayed"})


class ApiError(Exception):
    """An error answered as ``{"statusCode", "type", "message"}`` with HTTP status ``status``."""

    def __init__(self, status: int, type_: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        body = {"statusCode": self.status, "type": self.type, "message": self.message}
        return web.json_response(body, status=self.status, headers=self.headers)


class ApiState:
    """What the handlers need: the admin service (None until recovery is done), metrics, token, logger.

    ``hosts`` are the host names (besides IP literals and ``localhost``) that a request's ``Host`` may
    name (``admin_hosts``); compared case-insensitively, without the port. ``peers``: {shard: unix socket}
    of the other workers' APIs (worker 0 of several; empty otherwise), which every answer covers."""

    def __init__(self, metrics: Metrics, *, token: str = "", log: Any = None, hosts: tuple[str, ...] = (),
                 peers: Mapping[int, str] | None = None) -> None:
        self.metrics = metrics
        self.token = token
        self.log = log
        self.hosts = frozenset(h.lower().rstrip(".") for h in hosts) | {"localhost"}
        self.peers = {k: ShardPeer(k, path, token) for k, path in sorted((peers or {}).items())}
        self._admin: AdminService | None = None
        self.sharded: ShardedAdmin | None = None

    @property
    def admin(self) -> AdminService | None:
        """This worker's own shard (set once recovery is done)."""
        return self._admin

    @admin.setter
    def admin(self, admin: AdminService | None) -> None:
        self._admin = admin
        self.sharded = None if admin is None else ShardedAdmin(admin, self.peers)


_STATE: web.AppKey[ApiState] = web.AppKey("mtaq_state", ApiState)


class _ActionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /mails/actions/{action}`` body: which messages (ids or all) and filters that narrow them."""

    ids: list[str] = msgspec.field(default_factory=list)
    all: bool = False
    sender: str | None = None
    recipient: str | None = None
    domain: str | None = None
    held: bool = False
    deferred: bool = False
    older_than: str | float | None = msgspec.field(default=None, name="olderThan")
    delay: str | float | None = None  # action delay only: seconds or a duration (2h), at most delay_max_s


# ------------------------------------------------------------------------------------------ parsing input
def _bool(params: MultiMapping[str], key: str) -> bool:
    v = params.get(key)
    if v is None:
        return False
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ApiError(400, "InvalidArgument", f"{key}: expected true or false, got {v!r}")


def _older_than(key: str, value: str | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, float | int):
        if value < 0:
            raise ApiError(400, "InvalidArgument", f"{key}: expected a duration >= 0, got {value!r}")
        return float(value)
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ApiError(400, "InvalidArgument", f"{key}: {exc}") from None


def _text(params: MultiMapping[str], key: str) -> str | None:
    v = params.get(key)
    if v is not None and not v.strip():
        raise ApiError(400, "InvalidArgument", f"{key}: must not be empty")
    return v


def selector_from_query(params: MultiMapping[str], allowed: set[str]) -> Selector:
    """The Selector that query parameters ask for (``name`` may repeat: queue IDs). Raises ApiError 400 for
    an unknown parameter or a bad value, naming it."""
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ApiError(400, "InvalidArgument", f"unknown parameter {unknown[0]!r}; expected one of {', '.join(sorted(allowed))}")
    return Selector(
        ids=tuple(params.getall("name", ())),
        sender=_text(params, "sender"),
        recipient=_text(params, "recipient"),
        domain=_text(params, "domain"),
        held=_bool(params, "held"),
        deferred=_bool(params, "deferred"),
        older_than_s=_older_than("olderThan", params.get("olderThan")),
    )


def _limit(params: MultiMapping[str]) -> int | None:
    v = params.get("limit")
    if v is None:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ApiError(400, "InvalidArgument", f"limit: expected a whole number >= 1, got {v!r}")
    return int(v)


# ------------------------------------------------------------------------------------------------ handlers
def _state(request: web.Request) -> ApiState:
    return request.app[_STATE]


def _admin(request: web.Request) -> ShardedAdmin:
    """Every shard's admin operations (just this daemon's with one worker); 503 until recovery is done."""
    sharded = _state(request).sharded
    if sharded is None:
        raise ApiError(503, "ServiceUnavailable", "recovery in progress; try again in a moment", {"Retry-After": "1"})
    return sharded


def _local_admin(request: web.Request) -> AdminService:
    """This worker's own shard only (the internal routes); 503 until recovery is done."""
    return _admin(request).local


def _queue_name(request: web.Request) -> str:
    name = request.match_info["name"]
    if name != QUEUE_NAME:
        raise ApiError(404, "notFound", f"no mail queue named {name!r}; the queue is {QUEUE_NAME!r}")
    return name


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type=_JSON)


async def list_queues(request: web.Request) -> web.Response:
    """``GET /mailQueues``: the queue names (one: ``spool``)."""
    return _json([QUEUE_NAME])


async def queue_size(request: web.Request) -> web.Response:
    """``GET /mailQueues/{name}``: size by state from the daemon's counters (no scan)."""
    name = _queue_name(request)
    size = await _admin(request).size()
    position = size.pop("position")
    total = size.pop("total")
    return _json({"name": name, "size": total, "byState": size, "position": position})


async def list_mails(request: web.Request) -> web.Response:
    """``GET /mailQueues/{name}/mails``: the messages (filters, limit), consistent as of ``position``."""
    name = _queue_name(request)
    selector = selector_from_query(request.query, _LIST_PARAMS)
    limit = _limit(request.query)
    position, mails = await _admin(request).list(selector, limit=limit)
    return _json({"name": name, "position": position, "count": len(mails), "mails": mails})


async def delete_mails(request: web.Request) -> web.Response:
    """``DELETE /mailQueues/{name}/mails?sender=|recipient=|name=...``: delete what the filters select."""
    _queue_name(request)
    selector = selector_from_query(request.query, _DELETE_PARAMS)
    if selector.is_empty():
        raise ApiError(400, "InvalidArgument",
                       "give at least one of sender, recipient, name, domain, held, deferred, olderThan "
                       "(to delete everything: POST /mails/actions/delete {\"all\": true})")
    return await _act(request, "delete", selector)


async def flush_delayed(request: web.Request) -> web.Response:
    """``PATCH /mailQueues/{name}?delayed=true`` with ``{"delayed": false}``: deferred and delayed mail is
    due now (a durable ``flush`` of each)."""
    _queue_name(request)
    unknown = sorted(set(request.query) - {"delayed"})
    if unknown:
        raise ApiError(400, "InvalidArgument", f"unknown parameter {unknown[0]!r}; expected delayed=true")
    if request.query.get("delayed") != "true":
        raise ApiError(400, "InvalidArgument", "delayed: expected the query parameter delayed=true")
    body = await _body(request)
    if body != {"delayed": False}:
        raise ApiError(400, "InvalidArgument", 'body: expected {"delayed": false}')
    return await _act(request, "flush", Selector(all=True), states=_NOT_YET_DUE)


async def show_mail(request: web.Request) -> web.Response:
    """``GET /mails/{queue_id}``: one message (envelope, recipients and last reasons, header section)."""
    admin = _admin(request)
    try:
        return _json(await admin.show(request.match_info["queue_id"]))
    except AdminError as exc:
        raise ApiError(404, "notFound", str(exc)) from None


async def mail_action(request: web.Request) -> web.Response:
    """``POST /mails/actions/{action}`` with ``{"ids": [...]}`` or ``{"all": true}`` and filters."""
    action = request.match_info["action"]
    if action not in ADMIN_ACTIONS:
        raise ApiError(404, "notFound", f"no action {action!r}; expected one of {', '.join(ADMIN_ACTIONS)}")
    b = _decode(await request.read() or b"{}", _ActionBody)
    if not b.ids and not b.all:
        raise ApiError(400, "InvalidArgument", 'body: give "ids": [queue IDs] or "all": true')
    for key in ("sender", "recipient", "domain"):
        v = getattr(b, key)
        if v is not None and not v.strip():
            raise ApiError(400, "InvalidArgument", f"{key}: must not be empty")
    selector = Selector(ids=tuple(b.ids), all=b.all, sender=b.sender, recipient=b.recipient, domain=b.domain,
                        held=b.held, deferred=b.deferred, older_than_s=_older_than("olderThan", b.older_than))
    delay_s = _older_than("delay", b.delay)
    if (action == "delay") != (delay_s is not None):
        raise ApiError(400, "InvalidArgument", 'delay: "delay" (seconds, or 30m, 2h, 1d) is needed by the delay '
                       "action and by no other")
    return await _act(request, action, selector, delay_s=delay_s)


def _decode(raw: bytes, type_: Any) -> Any:
    """``raw`` decoded as JSON into ``type_``; ApiError 400 for anything else, nesting too deep included."""
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, "InvalidArgument", f"body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "InvalidArgument", f"body: not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "InvalidArgument", "body: JSON nested too deeply") from None


async def _body(request: web.Request) -> Any:
    return _decode(await request.read() or b"null", Any)


async def _act(
    request: web.Request, action: str, selector: Selector, *, states: frozenset[str] | None = None,
    delay_s: float | None = None,
) -> web.Response:
    st = _state(request)
    admin = _admin(request)
    try:
        res = await admin.act(action, selector, states=states, delay_s=delay_s)
    except AdminError as exc:
        raise ApiError(400, "InvalidArgument", str(exc)) from None
    except StorageError as exc:
        raise ApiError(500, "ServerError", f"the queue log cannot be written: {exc}") from None
    st.metrics.admin_action(action, len(res.done))
    if st.log is not None:
        st.log.info("admin_action", action=action, done=len(res.done), skipped=len(res.skipped),
                    position=res.position, queue_ids=res.done[:100], client=request.remote or "")
    return _json(res.as_json())


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format (summed over every shard; :mod:`mtaq.admin.shards`)."""
    st = _state(request)
    if st.peers:
        from mtaq.admin.shards import merged_exposition

        body = await merged_exposition(list(st.metrics.registry.collect()), st.peers.values())
    else:
        body = st.metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# --------------------------------------------------------------- internal routes (worker k >= 1, unix socket)
class _ListBody(msgspec.Struct, forbid_unknown_fields=True):
    selector: Selector
    limit: int | None = None
    states: list[str] | None = None


class _ActBody(msgspec.Struct, forbid_unknown_fields=True):
    action: str
    selector: Selector
    delay_s: float | None = None
    states: list[str] | None = None


async def shard_size(request: web.Request) -> web.Response:
    """``GET /_shard/size``: this shard's counts (internal)."""
    return _json(_local_admin(request).size())


async def shard_list(request: web.Request) -> web.Response:
    """``POST /_shard/list`` ``{"selector", "limit", "states"}``: this shard's listing (internal)."""
    b = _decode(await request.read(), _ListBody)
    position, mails = await _local_admin(request).list(b.selector, limit=b.limit, states=b.states)
    return _json({"position": position, "mails": mails})


async def shard_show(request: web.Request) -> web.Response:
    """``GET /_shard/mails/{queue_id}``: one message of this shard (internal)."""
    try:
        return _json(await _local_admin(request).show(request.match_info["queue_id"]))
    except AdminError as exc:
        raise ApiError(404, "notFound", str(exc)) from None


async def shard_act(request: web.Request) -> web.Response:
    """``POST /_shard/act`` ``{"action", "selector", "delay_s", "states"}``: an action on this shard
    (internal; worker 0 counts it in ``mtaq_admin_actions_total`` and logs the ``admin_action`` event)."""
    b = _decode(await request.read(), _ActBody)
    try:
        res = await _local_admin(request).act(b.action, b.selector, delay_s=b.delay_s, states=b.states)
    except AdminError as exc:
        raise ApiError(400, "InvalidArgument", str(exc)) from None
    except StorageError as exc:
        raise ApiError(500, "ServerError", f"the queue log of this shard cannot be written: {exc}") from None
    return _json(res.as_json())


async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the OpenAPI 3 description of this API."""
    from mtaq.admin.openapi import SPEC

    return _json(SPEC)


# -------------------------------------------------------------------------------------------- middleware
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except PeerError as exc:  # another shard's answer, passed on as it is
        return ApiError(exc.status, exc.type, exc.message, {"Retry-After": "1"} if exc.status == 503 else None).response()
    except web.HTTPException as exc:  # unknown route (404), wrong method (405), ...
        if exc.status < 400:
            raise
        kind = {404: "notFound", 405: "MethodNotAllowed"}.get(exc.status, "InvalidArgument")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return ApiError(exc.status, kind, f"{request.method} {request.path}: {exc.reason}", headers).response()


def _split_host(value: str) -> tuple[str, str]:
    """(host, port) of a ``Host`` header or an origin's authority: ``name``, ``name:port``, ``[v6]:port``."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return host, port


def _host_allowed(state: ApiState, host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True  # DNS rebinding needs a name: a browser sends the URL's host, never the resolved address
    except ValueError:
        return host.lower().rstrip(".") in state.hosts


@web.middleware
async def _same_origin(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what a hostile web page can make the operator's browser send (see the module docstring)."""
    state = _state(request)
    host_header = request.headers.get("Host")
    if host_header is not None:
        host, _port = _split_host(host_header.strip())
        if not _host_allowed(state, host):
            raise ApiError(403, "Forbidden", f"Host {host_header!r} is not an address of this API (a DNS rebinding "
                           "page?); name it in admin_hosts to allow it")
    origin = request.headers.get("Origin")
    if origin is not None and (host_header is None or origin.strip().lower() != f"http://{host_header.strip().lower()}"):
        raise ApiError(403, "Forbidden", f"Origin {origin!r} is not this API's own origin: cross-site requests are refused")
    if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        raise ApiError(403, "Forbidden", "Sec-Fetch-Site: cross-site: cross-site requests are refused")
    if request.method not in _SAFE_METHODS:
        ctype = request.headers.get("Content-Type", "")
        if ctype.split(";", 1)[0].strip().lower() != _JSON:
            raise ApiError(415, "UnsupportedMediaType", f"{request.method} needs Content-Type: {_JSON} "
                           f"(got {ctype or 'none'}); this also keeps web pages from sending it cross-site")
    return await handler(request)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = _state(request).token
    if token:
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise ApiError(401, "Unauthorized", "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                           {"WWW-Authenticate": 'Bearer realm="mtaq"'})
    return await handler(request)


ROUTES: tuple[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]], ...] = (
    ("GET", "/mailQueues", list_queues),
    ("GET", "/mailQueues/{name}", queue_size),
    ("PATCH", "/mailQueues/{name}", flush_delayed),
    ("GET", "/mailQueues/{name}/mails", list_mails),
    ("DELETE", "/mailQueues/{name}/mails", delete_mails),
    ("GET", "/mails/{queue_id}", show_mail),
    ("POST", "/mails/actions/{action}", mail_action),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
)


# Only on a worker's unix socket, for worker 0 (mtaq.admin.shards): never on the public listener.
INTERNAL_ROUTES: tuple[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]], ...] = (
    ("GET", "/_shard/size", shard_size),
    ("POST", "/_shard/list", shard_list),
    ("GET", "/_shard/mails/{queue_id}", shard_show),
    ("POST", "/_shard/act", shard_act),
)


def make_app(state: ApiState, *, internal: bool = False) -> web.Application:
    """The aiohttp application (routes in :data:`ROUTES`, described in :mod:`mtaq.admin.openapi`); with
    ``internal`` the :data:`INTERNAL_ROUTES` too (a worker's unix socket). The same middleware either way."""
    app = web.Application(middlewares=[_errors, _same_origin, _auth], client_max_size=_BODY_BYTES_MAX)
    app[_STATE] = state
    for method, path, handler in (*ROUTES, *(INTERNAL_ROUTES if internal else ())):
        app.router.add_route(method, path, handler)
    return app


# -------------------------------------------------------------------------------------------- the server
class AdminHttp:
    """The API server of one daemon: :meth:`start` listens on ``host``:``port`` and writes admin.json;
    with ``unix_path`` (worker k >= 1 of several) it listens on that unix socket instead (mode 0600, the
    internal routes added, no admin.json)."""

    def __init__(self, state: ApiState, host: str, port: int, spool: str, *, unix_path: str = "",
                 socks: list[socket.socket] | None = None) -> None:
        self.state = state
        self.socks = socks  # listening sockets bound before the daemon dropped root (mtaq.daemon.privileges)
        self.host, self.port, self.spool = host, port, spool
        self.unix_path = unix_path
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def admin_json(self) -> str:
        return os.path.join(self.spool, ADMIN_JSON)

    async def start(self) -> str:
        """Listen; write ``SPOOL/admin.json``; return the URL (with the real port when port 0 was asked).
        Raises OSError naming ``admin_listen`` when the address cannot be bound."""
        if self.unix_path:
            return await self._start_unix()
        try:
            os.unlink(self.admin_json)  # a stale one from the previous run
        except FileNotFoundError:
            pass
        runner = web.AppRunner(make_app(self.state), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            if self.socks:
                for sock in self.socks:
                    await web.SockSite(runner, sock).start()
            else:
                await web.TCPSite(runner, self.host, self.port, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            where = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            raise OSError(exc.errno, f"admin_listen {where}: {why}") from exc
        self._runner = runner
        addr = runner.addresses[0]
        host, port = str(addr[0]), int(addr[1])
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        tmp = self.admin_json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"url": self.url, "pid": os.getpid()}, f)
        os.replace(tmp, self.admin_json)  # atomic; not fsync'd (a hint, rewritten at every start)
        return self.url

    async def _start_unix(self) -> str:
        from mtaq.admin.shards import unix_address

        runner = web.AppRunner(make_app(self.state, internal=True), access_log=None, handle_signals=False)
        await runner.setup()
        address = unix_address(self.unix_path)
        try:
            os.unlink(address)  # a stale one from the previous run
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: only the daemon's user may even connect (and the token is asked)
        try:  # bound with nothing awaited meanwhile: the umask applies to this socket only, not to other tasks' files
            sock.bind(address)
        except OSError as exc:
            sock.close()
            await runner.cleanup()
            raise OSError(exc.errno, f"admin socket {self.unix_path}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
        finally:
            os.umask(old)
        os.chmod(address, 0o600)
        try:
            await web.SockSite(runner, sock).start()
        except OSError as exc:
            sock.close()
            await runner.cleanup()
            raise OSError(exc.errno, f"admin socket {self.unix_path}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
        self._runner = runner
        self.url = f"unix:{self.unix_path}"
        return self.url
