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
* no client can hold the API (issue 32 item 3): at most ``admin_connections_max`` connections at once (one
  more gets ``503`` JSON and is closed at once, before reading anything); a request's headers and body must
  have arrived within ``admin_request_timeout_s`` of the connection (or of the previous answer on it), or it
  gets ``408`` JSON and is closed; a body over ``admin_body_bytes_max`` (1 MiB) gets ``413`` JSON and the
  connection is closed without reading it (by ``Content-Length``; a chunked one is read no further than the
  limit). Checked before the token, so they hold for clients without one. Any request answered before its
  body was read (401 without the token, 403, 415) is answered without reading the body, and the connection
  is closed right after the answer (``Connection: close``), never read to its end;
* ``SPOOL/admin.json`` (``{"url", "pid"}``) is written atomically (rename; not fsync'd: it is a hint for
  ``mtaq queue``, rewritten at every start) once the API listens;
* with several workers (:mod:`mtaq.daemon.workers`) the public API is worker 0's and covers every shard
  (:mod:`mtaq.admin.shards`): worker k >= 1 serves the same application, plus the internal ``/_shard/...``
  routes, on the unix socket ``SPOOL/shard-k/admin.sock`` (mode 0600), behind the same checks and token.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import msgspec
from aiohttp import web
from multidict import MultiMapping

from mtaq.admin.metrics import CONTENT_TYPE, Metrics
from mtaq.admin.service import AdminError, AdminService, parse_cursor
from mtaq.admin.shards import PeerError, ShardedAdmin, ShardPeer
from mtaq.admin.token import ADMIN_TOKEN, read_spool_token, spool_token
from mtaq.core.duration import parse_duration
from mtaq.core.errors import StorageError
from mtaq.core.parking import ADMIN_ACTIONS
from mtaq.core.view import Selector

__all__ = ["ADMIN_JSON", "ADMIN_TOKEN", "BODY_BYTES_MAX", "CONNECTIONS_MAX", "QUEUE_NAME", "REQUEST_TIMEOUT_S", "AdminHttp", "ApiError", "ApiState", "make_app",
           "read_spool_token", "selector_from_query", "spool_token"]

QUEUE_NAME = "spool"
ADMIN_JSON = "admin.json"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_JSON = "application/json"
_NDJSON = "application/x-ndjson"  # one JSON text a line (a listing, as postqueue -j prints it)
# Defaults of admin_body_bytes_max, admin_connections_max, admin_request_timeout_s (mtaq.config).
BODY_BYTES_MAX = 1024 * 1024  # about 50,000 queue IDs in an action body; `mtaq queue` sends more in several
CONNECTIONS_MAX = 64
REQUEST_TIMEOUT_S = 10.0
_LIST_PARAMS = {"sender", "recipient", "domain", "held", "deferred", "olderThan", "limit", "after"}
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
    of the other workers' APIs (worker 0 of several; empty otherwise), which every answer covers.
    ``reload``: reads the configuration again (``POST /reload``); None: the route answers 503."""

    def __init__(self, metrics: Metrics, *, token: str = "", log: Any = None, hosts: tuple[str, ...] = (),
                 peers: Mapping[int, str] | None = None,
                 reload: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> None:
        self.metrics = metrics
        self.reload = reload  # this daemon's reload (mtaq.daemon.reload), answering ReloadResult.as_json()
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


def _after(params: MultiMapping[str]) -> tuple[int, str] | None:
    v = params.get("after")
    if v is None:
        return None
    try:
        return parse_cursor(v)
    except ValueError as exc:
        raise ApiError(400, "InvalidArgument", f"after: {exc}") from None


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
    """``GET /mailQueues/{name}/mails``: the messages (filters, ``limit``, ``after`` a cursor), consistent as
    of ``position``; ``next``: the cursor of the next page (null after the last); ``damage``: problems met in
    the log while reading it.

    With ``Accept: application/x-ndjson`` the body is the messages alone, one JSON object a line (what
    ``postqueue -j`` prints), and the rest goes in headers: ``X-Mtaq-Position``, ``X-Mtaq-Count``,
    ``X-Mtaq-Next`` (only when there is a next page) and ``X-Mtaq-Damage`` (a JSON array, ASCII)."""
    name = _queue_name(request)
    selector = selector_from_query(request.query, _LIST_PARAMS)
    limit = _limit(request.query)
    # Each message's JSON as the shard's view keeps it, merged and joined (no object made or encoded again)
    listing = await _admin(request).page(selector, limit=limit, after=_after(request.query), raw=True)
    mails = listing.raw or []
    if _NDJSON in request.headers.get("Accept", ""):
        headers = {"X-Mtaq-Position": listing.position, "X-Mtaq-Count": str(len(mails)),
                   "X-Mtaq-Damage": _damage_header(listing.damage)}
        if listing.next is not None:
            headers["X-Mtaq-Next"] = listing.next
        body = b"\n".join(mails) + b"\n" if mails else b""
        return web.Response(body=body, status=200, content_type=_NDJSON, headers=headers)
    return _raw_listing({"name": name, "position": listing.position, "count": listing.count, "next": listing.next,
                         "damage": listing.damage}, mails)


DAMAGE_HEADER_BYTES_MAX = 8192  # well under what HTTP clients read in one header line (http.client: 65,536)


def _damage_header(damage: list[str]) -> str:
    """``damage`` as a JSON array (ASCII) of at most :data:`DAMAGE_HEADER_BYTES_MAX` bytes: past that, the
    problems that fit and one last line saying how many more the JSON listing has."""
    text = json.dumps(damage)
    if len(text) <= DAMAGE_HEADER_BYTES_MAX:
        return text
    kept: list[str] = []
    size = 64  # the brackets and the last line
    for d in damage:
        size += len(json.dumps(d)) + 2
        if size > DAMAGE_HEADER_BYTES_MAX:
            break
        kept.append(d)
    more = len(damage) - len(kept)
    return json.dumps([*kept, f"and {more} more problems: the listing as application/json has them all"])


def _raw_listing(fields: dict[str, Any], mails: list[bytes]) -> web.Response:
    """``fields`` as a JSON object with ``"mails"``: the JSON texts ``mails`` as they are, in an array."""
    head = msgspec.json.encode(fields)
    body = b"".join((head[:-1], b',"mails":[', b",".join(mails), b"]}"))
    return web.Response(body=body, status=200, content_type=_JSON)


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


async def _local_reload(request: web.Request) -> dict[str, Any]:
    reload = _state(request).reload
    if reload is None:
        raise ApiError(503, "ServiceUnavailable", "this daemon cannot reload (no configuration source)")
    return await reload()


async def reload_config(request: web.Request) -> web.Response:
    """``POST /reload``: every worker reads the configuration again (``mtaq reload``, postfix reload); the
    answer ``{"applied": true only when every worker applied it, "workers": [per worker: shard, applied,
    changed, restart_needed, problems, sasl_hold_cleared]}`` is 200 either way."""
    st = _state(request)
    mine = await _local_reload(request)

    async def peer_reload(peer: ShardPeer) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = await peer.call("POST", "/_shard/reload", {})
            return answer
        except PeerError as exc:
            return {"shard": peer.shard, "applied": False, "changed": [], "restart_needed": [],
                    "problems": [f"shard {peer.shard}: {exc.message}"], "sasl_hold_cleared": []}

    others = await asyncio.gather(*(peer_reload(p) for p in st.peers.values()))
    workers = [mine, *others]
    if st.log is not None:
        st.log.info("admin_reload", applied=all(w["applied"] for w in workers),
                    workers=[w["shard"] for w in workers], client=request.remote or "")
    return _json({"applied": all(w["applied"] for w in workers), "workers": workers})


async def shard_reload(request: web.Request) -> web.Response:
    """``POST /_shard/reload``: this worker reads the configuration again (internal)."""
    return _json(await _local_reload(request))


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
    after: tuple[int, str] | None = None
    raw: bool = True  # ignored: always the view's JSON


class _ActBody(msgspec.Struct, forbid_unknown_fields=True):
    action: str
    selector: Selector
    delay_s: float | None = None
    states: list[str] | None = None


async def shard_size(request: web.Request) -> web.Response:
    """``GET /_shard/size``: this shard's counts (internal)."""
    return _json(_local_admin(request).size())


async def shard_list(request: web.Request) -> web.Response:
    """``POST /_shard/list`` ``{"selector", "limit", "states", "after"}``: this shard's page (internal), each
    mail the JSON its view keeps, joined as they are (``raw``, from before, is accepted and changes nothing:
    the answer is the same JSON either way)."""
    b = _decode(await request.read(), _ListBody)
    listing = await _local_admin(request).page(b.selector, limit=b.limit, states=b.states, after=b.after, raw=True)
    return _raw_listing({"position": listing.position, "next": listing.next, "damage": listing.damage},
                        listing.raw or [])


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


# Answers after which the connection is closed: what is left of the request is never read.
_CLOSING = frozenset({408, 413})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        resp = await _answer(request, handler)
    except BaseException:
        guard = _guard_of(request)
        if guard is not None:
            guard.answered(closing=True)
        raise
    # Answered before its body was read (413 by Content-Length, 401 without the token, 403, 415...): the body
    # is never read, and the connection is closed right after the answer (``Connection: close``; the runner
    # has no lingering time, so aiohttp closes the transport instead of reading and discarding the rest).
    closing = resp.status in _CLOSING or (request.body_exists and not request.content.is_eof())
    guard = _guard_of(request)
    if guard is not None:  # the next request on this connection has its own deadline
        guard.answered(closing=closing)
    if closing:
        resp.force_close()
    return resp


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except PeerError as exc:  # another shard's answer, passed on as it is
        return ApiError(exc.status, exc.type, exc.message, {"Retry-After": "1"} if exc.status == 503 else None).response()
    except web.HTTPException as exc:  # unknown route (404), wrong method (405), body too large (413), ...
        if exc.status < 400:
            raise
        if exc.status == 413:
            return _too_large(request).response()
        kind = {404: "notFound", 405: "MethodNotAllowed"}.get(exc.status, "InvalidArgument")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return ApiError(exc.status, kind, f"{request.method} {request.path}: {exc.reason}", headers).response()


def _too_large(request: web.Request) -> ApiError:
    return ApiError(413, "PayloadTooLarge", f"request body over {request.app[_BODY_MAX]} bytes (admin_body_bytes_max)")


def _guard_of(request: web.Request) -> _Guard | None:
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, _Guard) else None


@web.middleware
async def _body_cap(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body over the limit by its ``Content-Length`` gets 413 before any other check (the token's
    included), unread; the connection is then closed (:func:`_errors`)."""
    length = request.content_length
    if length is not None and length > request.app[_BODY_MAX]:
        raise _too_large(request)
    return await handler(request)


@web.middleware
async def _received(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The whole request before any handler runs, once the token is checked: a chunked body is read up to
    the limit only (aiohttp's ``client_max_size``: 413); then the connection's deadline stops (the request
    has arrived; handling it may take longer)."""
    if request.body_exists:
        try:
            await request.read()  # kept by aiohttp: the handler's read() returns it
        except ConnectionError:  # closed by the deadline (or the client) half-way through the body
            raise ApiError(408, "RequestTimeout", "the request did not arrive in time") from None
    guard = _guard_of(request)
    if guard is not None:
        guard.received()
    return await handler(request)


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
    ("POST", "/reload", reload_config),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
)


# Only on a worker's unix socket, for worker 0 (mtaq.admin.shards): never on the public listener.
INTERNAL_ROUTES: tuple[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]], ...] = (
    ("GET", "/_shard/size", shard_size),
    ("POST", "/_shard/list", shard_list),
    ("GET", "/_shard/mails/{queue_id}", shard_show),
    ("POST", "/_shard/act", shard_act),
    ("POST", "/_shard/reload", shard_reload),
)


_BODY_MAX: web.AppKey[int] = web.AppKey("mtaq_body_max", int)


def make_app(state: ApiState, *, internal: bool = False, body_bytes_max: int = BODY_BYTES_MAX) -> web.Application:
    """The aiohttp application (routes in :data:`ROUTES`, described in :mod:`mtaq.admin.openapi`); with
    ``internal`` the :data:`INTERNAL_ROUTES` too (a worker's unix socket), whose bodies (worker 0's share of
    a public request) may be twice ``body_bytes_max``. The same middleware either way."""
    limit = body_bytes_max * (2 if internal else 1)
    app = web.Application(middlewares=[_errors, _body_cap, _same_origin, _auth, _received], client_max_size=limit)
    app[_STATE] = state
    app[_BODY_MAX] = limit
    for method, path, handler in (*ROUTES, *(INTERNAL_ROUTES if internal else ())):
        app.router.add_route(method, path, handler)
    return app


# -------------------------------------------------------------------------------------------- the server
def _raw_answer(status: int, reason: str, type_: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with the James-style JSON error body, closing the connection."""
    body = msgspec.json.encode({"statusCode": status, "type": type_, "message": message})
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {_JSON}; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class _Limits:
    """What every connection of one admin server shares: the caps, and how many connections are open."""

    def __init__(self, connections_max: int, request_timeout_s: float) -> None:
        self.connections_max = connections_max
        self.request_timeout_s = request_timeout_s
        self.open = 0
        self.refused = 0  # connections closed at once because ``connections_max`` were open
        self.timed_out = 0  # requests that had not arrived within ``request_timeout_s``
        self.busy = _raw_answer(503, "Service Unavailable", "ServiceUnavailable",
                                f"too many admin connections (admin_connections_max = {connections_max})")
        self.late = _raw_answer(408, "Request Timeout", "RequestTimeout",
                                f"the request did not arrive within {request_timeout_s:g} s (admin_request_timeout_s)")


class _Guard(asyncio.Protocol):
    """One admin connection: aiohttp's protocol inside, the connection cap and the request deadline around it.

    The deadline runs while a request is awaited (from the connection, or from the previous answer on it)
    until its headers and body are in (:meth:`received`); a connection that is still writing an answer when
    it fires is given another period (the answer is ours, not a slow request)."""

    def __init__(self, limits: _Limits, inner: asyncio.Protocol) -> None:
        self.limits = limits
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.counted = False
        self.timer: asyncio.TimerHandle | None = None
        self.idle = False  # answered, and nothing of another request has come since
        self.closing = False  # answered with the connection to be closed (aiohttp may read what is left)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        lim = self.limits
        if lim.open >= lim.connections_max:
            lim.refused += 1
            self.transport.write(lim.busy)
            self.transport.close()  # after the answer is written; nothing is read
            return
        lim.open += 1
        self.counted = True
        self._arm()
        self.inner.connection_made(transport)

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(self.limits.request_timeout_s, self._expired)

    def received(self) -> None:
        """The request is in: no deadline while it is handled."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def answered(self, *, closing: bool = False) -> None:
        """The answer is on its way: the next request on this connection must arrive in time. With
        ``closing`` no other request is taken: what aiohttp still reads of this one (lingering, so that the
        client gets the answer before the close) is cut at the deadline, silently."""
        self.idle = True
        self.closing = self.closing or closing
        if self.counted and self.transport is not None and not self.transport.is_closing():
            self._arm()

    def _expired(self) -> None:
        self.timer = None
        t = self.transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size() > 0:  # still sending an answer: not the client's request being late
            self._arm()
            return
        if self.closing or self.idle:  # an idle keep-alive connection, or one answered already: just close
            t.close()
            return
        self.limits.timed_out += 1
        t.write(self.limits.late)
        t.close()

    def data_received(self, data: bytes) -> None:
        self.idle = False
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.counted = False
            self.limits.open -= 1
            self.inner.connection_lost(exc)


class AdminHttp:
    """The API server of one daemon: :meth:`start` listens on ``host``:``port`` and writes admin.json;
    with ``unix_path`` (worker k >= 1 of several) it listens on that unix socket instead (mode 0600, the
    internal routes added, no admin.json)."""

    def __init__(self, state: ApiState, host: str, port: int, spool: str, *, unix_path: str = "",
                 body_bytes_max: int = BODY_BYTES_MAX, connections_max: int = CONNECTIONS_MAX,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, socks: list[socket.socket] | None = None) -> None:
        self.state = state
        self.socks = socks  # listening sockets bound before the daemon dropped root (mtaq.daemon.privileges)
        self.host, self.port, self.spool = host, port, spool
        self.unix_path = unix_path
        self.url = ""
        self.body_bytes_max = body_bytes_max
        self.limits = _Limits(connections_max, request_timeout_s)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._more_servers: list[asyncio.Server] = []

    async def _runner_for(self, *, internal: bool) -> web.AppRunner:
        app = make_app(self.state, internal=internal, body_bytes_max=self.body_bytes_max)
        # lingering_time 0: a request answered before its body was read is closed, not read to its end (aiohttp
        # would read and discard up to 10 s of it, in this event loop, for any client).
        runner = web.AppRunner(app, access_log=None, handle_signals=False, lingering_time=0)
        await runner.setup()
        return runner

    def _protocol(self, runner: web.AppRunner) -> Callable[[], asyncio.Protocol]:
        """aiohttp's protocol for each connection, inside a :class:`_Guard` (the caps and the deadline)."""
        server = runner.server
        assert server is not None
        limits = self.limits
        return lambda: _Guard(limits, server())

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
        runner = await self._runner_for(internal=False)
        try:
            loop = asyncio.get_running_loop()
            if self.socks:  # bound before the switch to mail_owner; every one behind the same guard
                servers = [await loop.create_server(self._protocol(runner), sock=sock, backlog=128)
                           for sock in self.socks]
                self._server, self._more_servers = servers[0], servers[1:]
            else:
                self._server = await loop.create_server(
                    self._protocol(runner), self.host or None, self.port, reuse_address=True, backlog=128)
        except OSError as exc:
            await runner.cleanup()
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            where = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            raise OSError(exc.errno, f"admin_listen {where}: {why}") from exc
        self._runner = runner
        addr = self._server.sockets[0].getsockname()
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

        runner = await self._runner_for(internal=True)
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
            self._server = await asyncio.get_running_loop().create_unix_server(self._protocol(runner), sock=sock,
                                                                             backlog=128)
        except OSError as exc:
            sock.close()
            await runner.cleanup()
            raise OSError(exc.errno, f"admin socket {self.unix_path}: {os.strerror(exc.errno) if exc.errno else exc}") from exc
        self._runner = runner
        self.url = f"unix:{self.unix_path}"
        return self.url
