"""The admin API over every shard of a spool run by several workers (:mod:`mtaq.daemon.workers`).

Worker 0 serves the one public API. Every worker k >= 1 serves the same application on a unix socket
``SPOOL/shard-k/admin.sock`` (mode 0600, the same bearer token and Host/Origin checks as the public API),
which adds the internal routes ``/_shard/...`` below and nothing else. Worker 0's handlers call
:class:`ShardedAdmin`, which does each operation on its own shard (an :class:`AdminService`) and on the
others through those sockets (aiohttp's ``UnixConnector``), and merges:

* ``size``: the counts summed;
* ``list``: every shard's messages, merged in the one order a listing has (arrival time, then queue ID),
  then cut at ``limit`` (each shard returns at most ``limit``, so the merged page is the same as one log's);
* ``show`` and actions on queue IDs: routed to the shard in the ID's low 4 bits
  (:func:`~mtaq.queue.store.queue_id_shard`); an ID that shard does not hold is then looked for in shard 0,
  which keeps the mail of a spool run earlier with one worker (whose IDs' low bits are random);
* actions on all mail or on filters: done in every shard, the results merged (``done`` in shard order).

Positions: with several shards a position is ``SHARD/SEGMENT:OFFSET`` of each shard, space-separated
(``0/3:4096 1/2:512``): each shard's part is consistent as of its own log position (the shards are separate
logs; there is no single position across them). With one worker nothing here changes an answer.

``/metrics``: worker 0 scrapes every other worker's ``/metrics`` through its socket and sums the samples
(counters, histograms, summaries, queue gauges); ``mtaq_ready`` is the lowest (0 while any shard recovers
or cannot be reached), ``mtaq_recovery_seconds`` the highest, ``mtaq_log_records_per_fsync`` the ratio of
the totals, and ``mtaq_shards`` says how many shards answered.
"""

from __future__ import annotations

import asyncio
import heapq
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec

from mtaq.admin.service import ActionResult, AdminError, AdminService, Listing, cursor_of
from mtaq.core.view import Selector
from mtaq.queue.store import queue_id_shard

if TYPE_CHECKING:
    import aiohttp
    from prometheus_client import Metric

__all__ = ["PeerError", "ShardPeer", "ShardedAdmin", "join_positions", "merge_metrics", "unix_address"]

_REQUEST_TIMEOUT_S = 3600.0  # an action on a million messages is slow, not stuck
_CONNECT_TIMEOUT_S = 10.0
_NO_SUCH = "no such message in the queue"
_UNIX_PATH_MAX = 100  # sun_path is 108 bytes with its NUL; leave room


def unix_address(path: str) -> str:
    """A name for the unix socket ``path`` short enough for ``sun_path``: ``path`` itself, or (when it is
    too long) ``/proc/self/fd/N/NAME`` through a directory descriptor this process keeps open (Linux).
    Raises OSError when the directory cannot be opened."""
    if len(os.fsencode(path)) <= _UNIX_PATH_MAX:
        return path
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}"


class PeerError(Exception):
    """An error answer from a worker's internal API (or none at all: 503), to be answered as it is."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


class ShardPeer:
    """The internal admin API of worker ``shard``, on the unix socket ``path``; ``token`` is the bearer token."""

    def __init__(self, shard: int, path: str, token: str) -> None:
        self.shard, self.path, self.token = shard, path, token
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=unix_address(self.path)),
                timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S, sock_connect=_CONNECT_TIMEOUT_S),
            )
        return self._session

    async def call(self, method: str, route: str, body: Any = None, *, raw: bool = False) -> Any:
        """The decoded JSON answer (``raw``: the bytes). Raises PeerError for an error answer, and 503 when
        the worker cannot be reached (it is starting: the supervisor ends every worker when one ends)."""
        import aiohttp

        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None or method not in ("GET", "HEAD"):
            headers["Content-Type"] = "application/json"
            data = msgspec.json.encode(body)
        try:
            async with self._client().request(method, f"http://localhost{route}", data=data, headers=headers) as resp:
                payload = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise PeerError(503, "ServiceUnavailable", f"shard {self.shard} cannot be reached ({exc}); "
                            "try again in a moment") from None
        if status >= 400:
            try:
                err = msgspec.json.decode(payload)
                raise PeerError(status, str(err["type"]), str(err["message"]))
            except (msgspec.DecodeError, KeyError, TypeError):
                raise PeerError(status, "ServerError", f"shard {self.shard}: HTTP {status}") from None
        return payload if raw else msgspec.json.decode(payload)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def join_positions(parts: Iterable[tuple[int, str]]) -> str:
    """``[(shard, position)]`` as one position: itself for one shard 0, else ``0/3:4096 1/2:512``."""
    parts = sorted(parts)
    if len(parts) == 1 and parts[0][0] == 0:
        return parts[0][1]
    return " ".join(f"{k}/{p}" for k, p in parts)


class _RawPage(msgspec.Struct):
    """A shard's page as ``POST /_shard/list`` answers it, each mail kept undecoded (its JSON as the shard's
    view keeps it) until the merge has picked it."""

    position: str
    mails: list[msgspec.Raw]
    next: str | None = None
    damage: list[str] = []


class _Key(msgspec.Struct):
    """The two fields of a listed mail that order a listing (the others are not decoded)."""

    arrival_time: float
    queue_id: str


_key_decoder = msgspec.json.Decoder(_Key)
_raw_page_decoder = msgspec.json.Decoder(_RawPage)


def _raw_key(mail: bytes | msgspec.Raw) -> tuple[int, str]:
    k = _key_decoder.decode(mail)
    return (int(k.arrival_time), k.queue_id)


class ShardedAdmin:
    """The admin operations of every shard: ``local`` (shard 0, in this process) and ``peers`` (the others).

    Same methods as :class:`AdminService` (``size`` is a coroutine here); errors: AdminError (as there),
    StorageError (shard 0's log), PeerError (another shard's answer, or 503 when it cannot be reached)."""

    def __init__(self, local: AdminService, peers: Mapping[int, ShardPeer]) -> None:
        self.local = local
        self.peers = dict(peers)

    async def size(self) -> dict[str, Any]:
        """Messages by state, summed over the shards, and the position(s) they are as of."""
        local = self.local.size()
        if not self.peers:
            return local
        remote = await asyncio.gather(*(p.call("GET", "/_shard/size") for p in self.peers.values()))
        out: dict[str, Any] = {k: v for k, v in local.items() if k != "position"}
        positions = [(0, str(local["position"]))]
        for k, r in zip(self.peers, remote, strict=True):
            positions.append((k, str(r.pop("position"))))
            for key, n in r.items():
                out[key] = out.get(key, 0) + int(n)
        out["position"] = join_positions(positions)
        return out

    async def page(
        self, selector: Selector, *, limit: int | None = None, states: Collection[str] | None = None,
        after: tuple[int, str] | None = None, raw: bool = False,
    ) -> Listing:
        """:meth:`AdminService.page` of every shard, merged in listing order (arrival, then queue ID), cut
        at ``limit``: each shard's page after ``after`` has at most ``limit`` messages, so the merged page is
        the one a single log would give, and the next page goes on after its last message in every shard.
        The shards' mails are merged as the JSON bytes each shard's view keeps: only their arrival time and
        queue ID are decoded, to merge them; with ``raw`` they stay so (``Listing.raw``), else the page's
        mails are decoded."""
        if not self.peers:
            return await self.local.page(selector, limit=limit, states=states, after=after, raw=raw)
        body = {"selector": msgspec.to_builtins(selector), "limit": limit,
                "states": None if states is None else sorted(states), "after": after, "raw": True}
        local, *remote = await asyncio.gather(
            self.local.page(selector, limit=limit, states=states, after=after, raw=True),
            *(p.call("POST", "/_shard/list", body, raw=True) for p in self.peers.values()),
        )
        positions = [(0, local.position)]
        more = local.next is not None
        damage = [f"shard 0: {d}" for d in local.damage]
        pages: list[list[Any]] = [local.raw or []]
        for k, r in zip(self.peers, remote, strict=True):
            page = _raw_page_decoder.decode(r)
            positions.append((k, page.position))
            pages.append(page.mails)
            more = more or page.next is not None
            damage += [f"shard {k}: {d}" for d in page.damage]
        merged = list(heapq.merge(*pages, key=_raw_key))  # each shard's page is in listing order already
        if limit is not None:
            more = more or len(merged) > limit
            merged = merged[:limit]
        cursor = None
        if more and merged:
            ts, qid = _raw_key(merged[-1])
            cursor = cursor_of({"arrival_time": ts, "queue_id": qid})
        if raw:
            return Listing(join_positions(positions), [], cursor, damage, raw=[bytes(m) for m in merged])
        return Listing(join_positions(positions), [msgspec.json.decode(m) for m in merged], cursor, damage)

    async def list(
        self, selector: Selector, *, limit: int | None = None, states: Collection[str] | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """:meth:`page` from the first message: (position, mails)."""
        listing = await self.page(selector, limit=limit, states=states)
        return listing.position, listing.mails

    async def show(self, queue_id: str) -> dict[str, Any]:
        """One message, from the shard its ID names (then shard 0). Raises AdminError if no shard has it."""
        peer = self.peers.get(queue_id_shard(queue_id) or 0)
        if peer is not None:
            try:
                return dict(await peer.call("GET", f"/_shard/mails/{_quote(queue_id)}"))
            except PeerError as exc:
                if exc.status != 404:
                    raise
        return await self.local.show(queue_id)

    async def act(
        self, action: str, selector: Selector, *, delay_s: float | None = None, states: Collection[str] | None = None
    ) -> ActionResult:
        """:meth:`AdminService.act` on every shard concerned: IDs to their shards, ALL and filters to all."""
        if not self.peers:
            return await self.local.act(action, selector, delay_s=delay_s, states=states)
        if selector.is_empty():
            raise AdminError("no messages selected: give queue IDs, ALL, or a filter")
        plan: dict[int, Selector] = {}
        if selector.ids and not selector.all:
            by_shard: dict[int, list[str]] = {}
            for qid in selector.ids:
                k = queue_id_shard(qid) or 0
                by_shard.setdefault(k if k in self.peers else 0, []).append(qid)
            plan = {k: replace(selector, ids=tuple(ids)) for k, ids in by_shard.items()}
        else:
            plan = {0: selector, **{k: selector for k in self.peers}}
        results = await self._act_on(plan, action, delay_s, states)
        # IDs another shard does not hold: shard 0 keeps the mail of a spool run with one worker (random low bits).
        strays: list[str] = []
        for k, r in results.items():
            if k != 0 and selector.ids and not selector.all:
                for q, why in list(r.skipped.items()):
                    if why == _NO_SUCH:
                        strays.append(q)
                        del r.skipped[q]
        if strays:
            again = await self.local.act(action, replace(selector, ids=tuple(strays)), delay_s=delay_s, states=states)
            first = results.get(0)
            if first is None:
                results[0] = again
            else:
                first.done += again.done
                first.skipped |= again.skipped
                first.position = again.position
        out = ActionResult(action, join_positions((k, r.position) for k, r in results.items()))
        for _k, r in sorted(results.items()):
            out.done += r.done
            out.skipped |= r.skipped
        return out

    async def _act_on(self, plan: Mapping[int, Selector], action: str, delay_s: float | None,
                      states: Collection[str] | None) -> dict[int, ActionResult]:
        async def one(k: int, sel: Selector) -> ActionResult:
            if k == 0:
                return await self.local.act(action, sel, delay_s=delay_s, states=states)
            r = await self.peers[k].call("POST", "/_shard/act", {
                "action": action, "selector": msgspec.to_builtins(sel), "delay_s": delay_s,
                "states": None if states is None else sorted(states)})
            return ActionResult(str(r["action"]), str(r["position"]), list(r["done"]), dict(r["skipped"]))

        keys = sorted(plan)
        got = await asyncio.gather(*(one(k, plan[k]) for k in keys), return_exceptions=True)
        for g in got:  # every shard has acted (or failed) before the first failure is answered
            if isinstance(g, BaseException):
                raise g
        return {k: g for k, g in zip(keys, got, strict=True) if isinstance(g, ActionResult)}

    async def metrics(self, local: Iterable[Metric]) -> bytes:
        """``/metrics`` of every shard, merged (see the module docstring); ``local``: shard 0's families."""
        return await merged_exposition(list(local), self.peers.values())


def _quote(queue_id: str) -> str:
    from urllib.parse import quote

    return quote(queue_id, safe="")


async def merged_exposition(local: list[Metric], peers: Iterable[ShardPeer]) -> bytes:
    """Prometheus text of ``local`` merged with every peer's ``/metrics`` (a peer that cannot be reached is
    left out and makes ``mtaq_ready`` 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    peers = list(peers)
    texts = await asyncio.gather(*(p.call("GET", "/metrics", raw=True) for p in peers), return_exceptions=True)
    shards = [local]
    missing = 0
    for t in texts:
        if isinstance(t, BaseException):
            if not isinstance(t, PeerError):
                raise t
            missing += 1
            continue
        shards.append(list(text_string_to_metric_families(t.decode("utf-8"))))
    return merge_metrics(shards, missing=missing)


_GAUGE_MIN = {"mtaq_ready"}
_GAUGE_MAX = {"mtaq_recovery_seconds"}


def merge_metrics(shards: list[list[Metric]], *, missing: int = 0) -> bytes:
    """The Prometheus text (0.0.4) of the metric families of several shards summed sample by sample (same
    name and labels), with the gauge rules of the module docstring. ``missing``: shards that did not answer."""
    from prometheus_client import CollectorRegistry, Metric, generate_latest

    families: dict[str, tuple[str, str, str]] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for fams in shards:
        for f in fams:
            families.setdefault(f.name, (f.documentation, f.type, f.unit))
            acc = values.setdefault(f.name, {})
            for s in f.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in acc:
                    acc[key] = s.value
                elif f.name in _GAUGE_MIN:
                    acc[key] = min(acc[key], s.value)
                elif f.name in _GAUGE_MAX:
                    acc[key] = max(acc[key], s.value)
                else:
                    acc[key] += s.value
    if missing and "mtaq_ready" in values:
        values["mtaq_ready"] = {k: 0.0 for k in values["mtaq_ready"]}

    def total(name: str, sample: str) -> float:
        return values.get(name, {}).get((sample, ()), 0.0)

    if "mtaq_log_records_per_fsync" in values:
        fsyncs = total("mtaq_fsyncs", "mtaq_fsyncs_total")
        ratio = total("mtaq_log_records", "mtaq_log_records_total") / fsyncs if fsyncs else 0.0
        values["mtaq_log_records_per_fsync"] = {("mtaq_log_records_per_fsync", ()): ratio}
    out: list[Metric] = []
    for name, (doc, type_, unit) in families.items():
        m = Metric(name, doc, type_, unit)
        for (sample, labels), v in values[name].items():
            m.add_sample(sample, dict(labels), v)
        out.append(m)
    shards_metric = Metric("mtaq_shards", "Spool shards (worker processes) whose metrics are summed here", "gauge")
    shards_metric.add_sample("mtaq_shards", {}, float(len(shards)))
    out.append(shards_metric)

    class _Merged:
        def collect(self) -> Iterable[Metric]:
            return out

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
