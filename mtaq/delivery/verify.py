"""Recipient address verification by probing the next hop (Postfix ``reject_unverified_recipient``, verify(8)).

At RCPT the SMTP edge asks :meth:`Verifier.verify` whether the next hop takes a recipient. Unknown addresses
are probed over the route a delivery would take (:func:`~mtaq.delivery.transport.deliver` with no body:
transport map, relayhost, MX, TLS policy, SASL credentials, DANE/MTA-STS, the next host after a 4xx):
EHLO, MAIL FROM (``address_verify_sender``; the null sender by default), RCPT TO, RSET, QUIT; never DATA.
The answer is a :class:`Verdict`: ``ok`` (the RCPT got a 2xx), ``bounce`` (a 5xx, from the next hop or the
route: the edge answers ``550 5.1.1``) or ``defer`` (a 4xx, a host that cannot be reached, a probe still
running after ``address_verify_wait_s``: ``450 4.1.1``).

What must always hold:

* **Never a flood.** At most one probe per address at a time for the whole host (a claim in the shared map
  names the process probing; the other workers wait for its result), at most ``address_verify_probes_max``
  probes in flight per process (beyond: ``defer`` at once), and every result is cached, refusals and
  temporary failures too, so a client repeating an address costs the next hop nothing.
* **Lifetimes as Postfix's.** An accepted address is believed ``address_verify_positive_expire_s`` (31 d) and
  probed again in the background after ``address_verify_positive_refresh_s`` (7 d); a refused one
  ``address_verify_negative_expire_s`` (3 d), refreshed after ``address_verify_negative_refresh_s`` (3 h);
  a temporary failure ``address_verify_tempfail_expire_s`` (300 s; Postfix keeps it as a refusal). A failed
  probe never replaces an accepted address that has not expired (Postfix verify.c, "don't allow a failed
  probe to clobber an OK address").
* **A damaged cache only forgets.** The cache is a :class:`~mtaq.storage.sharedmap.SharedMap` in the spool
  (``SPOOL/verify_cache``: replaced whole by rename, so never torn; not fsync'd, so a power cut may take the
  latest results). Every entry carries a CRC-32 of its key and fields; an entry that fails it, has a field
  of the wrong type, a status it does not know or a time in the future is ignored (the address is probed
  again), never believed; a file that does not parse reads as empty. At most ``address_verify_cache_max``
  addresses are kept: expired entries go first, then the oldest.

Addresses are keyed without regard to case (``Bob@Example.ORG`` is ``bob@example.org``), so that changing
the case of an address cannot buy a new probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from mtaq.config import Config
from mtaq.delivery.relay import Reply
from mtaq.delivery.transport import Batch, ConnectionPool, deliver

if TYPE_CHECKING:
    from mtaq.delivery.peers import PeerPolicy
    from mtaq.delivery.routing import Router
    from mtaq.delivery.sasl import SaslClient

__all__ = ["VERIFY_CACHE_FILE", "ProbeResult", "Verdict", "Verifier", "VerifyMap", "VerifySettings", "cache_key",
           "make_prober"]

VERIFY_CACHE_FILE = "verify_cache"
"""The cache's file in the spool (above the shards: one for the host)."""
TEXT_MAX = 300
"""Characters of a next hop's reply kept (and repeated to the client): an SMTP reply line is at most 512."""
POLL_S = 0.1
"""How often a process waiting for another worker's probe reads the shared map."""
_CLAIM_SLACK_S = 10.0  # a claim is believed this long past the probe timeout (the claimer writes its result)
_FUTURE_SLACK_S = 60.0  # an entry dated further ahead than this is damaged (or from a wrong clock)

Status = Literal["ok", "bounce", "defer"]
_STATUSES = frozenset({"ok", "bounce", "defer", ""})  # "": no result yet (a first probe is claimed)


class Verdict(NamedTuple):
    """What is known of an address: ``status`` ``ok`` / ``bounce`` / ``defer`` and why (``text``: the next
    hop's reply, or what went wrong, printable ASCII, at most :data:`TEXT_MAX` characters)."""

    status: Status
    text: str


class ProbeResult(NamedTuple):
    """One probe's outcome: the relay that answered (``host[address]:port``, ``none`` when no host was
    asked) and the recipient's reply."""

    relay: str
    reply: Reply


class VerifyMap(Protocol):
    """A map shared by the daemon's processes (:class:`mtaq.storage.sharedmap.SharedMap`)."""

    def read(self) -> dict[str, Any]: ...

    def update(self, change: Callable[[dict[str, Any]], None]) -> None: ...


@dataclass(frozen=True, slots=True)
class VerifySettings:
    """The ``address_verify_*`` keys (seconds, counts); see :class:`mtaq.config.Config`."""

    sender: str = ""
    positive_expire_s: float = 31 * 86400.0
    positive_refresh_s: float = 7 * 86400.0
    negative_expire_s: float = 3 * 86400.0
    negative_refresh_s: float = 3 * 3600.0
    tempfail_expire_s: float = 300.0
    cache_max: int = 10_000
    probes_max: int = 50
    wait_s: float = 6.0
    probe_timeout_s: float = 120.0

    @classmethod
    def from_config(cls, cfg: Config) -> VerifySettings:
        return cls(
            sender="" if cfg.address_verify_sender in ("", "<>") else cfg.address_verify_sender,
            positive_expire_s=cfg.address_verify_positive_expire_s,
            positive_refresh_s=cfg.address_verify_positive_refresh_s,
            negative_expire_s=cfg.address_verify_negative_expire_s,
            negative_refresh_s=cfg.address_verify_negative_refresh_s,
            tempfail_expire_s=cfg.address_verify_tempfail_expire_s,
            cache_max=cfg.address_verify_cache_max,
            probes_max=cfg.address_verify_probes_max,
            wait_s=cfg.address_verify_wait_s,
            probe_timeout_s=cfg.address_verify_probe_timeout_s,
        )

    def map_bytes_max(self) -> int:
        """The largest cache file believed: 2 KiB an address (a key of up to 254 characters escaped as JSON,
        :data:`TEXT_MAX` of text, times and the check), plus room."""
        return self.cache_max * 2048 + 65536


def cache_key(address: str) -> str:
    """The cache's key of ``address``: lower case (local part and domain)."""
    return address.lower()


def printable(text: str) -> str:
    """``text`` on one line of printable ASCII (anything else as ``?``; runs of white space as one space), at
    most :data:`TEXT_MAX` characters: safe to repeat in an SMTP reply and a log line."""
    flat = " ".join(text.split())
    return "".join(ch if " " <= ch <= "~" else "?" for ch in flat)[:TEXT_MAX]


def describe(result: ProbeResult) -> Verdict:
    """The verdict of a probe's reply: 2xx ok, 5xx bounce, else defer; the text as Postfix gives it (``host
    RELAY said: 550 5.1.1 ...`` when a server answered)."""
    r = result.reply
    status: Status = "ok" if 200 <= r.code < 300 else "bounce" if 500 <= r.code < 600 else "defer"
    own = r.text.startswith(("connect to ", "conversation with ")) or result.relay == "none"
    text = r.text if own else f"host {result.relay} said: {r.code} {r.enhanced} {r.text}"
    return Verdict(status, printable(text))


def _check(key: str, s: str, t: float, p: float, o: int, x: str) -> int:
    return zlib.crc32(f"{key}\0{s}\0{t!r}\0{p!r}\0{o}\0{x}".encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class _Entry:
    """One address in the map: the last result (``s``: a status, "" for none yet; ``t``: when, 0 none;
    ``x``: its text) and the probe in flight (``p``: claimed at, 0 none; ``o``: the claiming process)."""

    s: str
    t: float
    p: float
    o: int
    x: str

    def dump(self, key: str) -> dict[str, Any]:
        return {"s": self.s, "t": self.t, "p": self.p, "o": self.o, "x": self.x,
                "c": _check(key, self.s, self.t, self.p, self.o, self.x)}

    @classmethod
    def load(cls, key: str, raw: object, now: float) -> _Entry | None:
        """The entry stored as ``raw``, None unless every field is there, of its type, and passes the check."""
        if not isinstance(raw, dict):
            return None
        s, t, p, o, x, c = (raw.get(k) for k in ("s", "t", "p", "o", "x", "c"))
        if not (isinstance(s, str) and s in _STATUSES and isinstance(x, str) and isinstance(o, int)
                and isinstance(c, int) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (t, p))):
            return None
        assert isinstance(t, (int, float)) and isinstance(p, (int, float))
        t, p = float(t), float(p)
        if not (0 <= t <= now + _FUTURE_SLACK_S and 0 <= p <= now + _FUTURE_SLACK_S) or (s == "") != (t == 0):
            return None
        if c != _check(key, s, t, p, o, x):
            return None
        return cls(s, t, p, o, x)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


class Verifier:
    """The address verification service of one process: the shared cache ``shared`` (None: this process's
    memory only, for tests), ``probe(address)`` that asks the next hop (:func:`make_prober`), and the wall
    clock ``clock`` (UTC seconds: entries outlive the process). ``report(event, fields)`` hears what should
    be logged (``address_verified`` after each probe, ``address_verify_cache_failed`` when the map cannot
    be written)."""

    def __init__(
        self,
        settings: VerifySettings,
        shared: VerifyMap | None,
        probe: Callable[[str], Awaitable[ProbeResult]],
        *,
        clock: Callable[[], float] = time.time,
        report: Callable[[str, dict[str, object]], None] = lambda event, fields: None,
    ) -> None:
        self.settings = settings
        self.shared = shared
        self.probe = probe
        self.clock = clock
        self.report = report
        self.pid = os.getpid()
        self.probes = 0  # probes this process sent
        self._memory: dict[str, Any] = {}  # the map when there is no shared one
        self._inflight: dict[str, asyncio.Task[Verdict]] = {}

    # ------------------------------------------------------------------------------------------ the map
    def _read(self) -> dict[str, Any]:
        return self.shared.read() if self.shared is not None else self._memory

    def _entry(self, key: str, now: float) -> _Entry | None:
        return _Entry.load(key, self._read().get(key), now)

    async def _update(self, change: Callable[[dict[str, Any]], None]) -> bool:
        """Apply ``change`` to the map under its lock (in a thread: the map is written whole); False when it
        could not be written (reported; the cache is advisory)."""
        if self.shared is None:
            change(self._memory)
            return True
        try:
            await asyncio.to_thread(self.shared.update, change)
        except OSError as exc:
            self.report("address_verify_cache_failed", {"error": f"{type(exc).__name__}: {exc}",
                                                        "action": "the result is used, not kept"})
            return False
        return True

    def _fresh(self, e: _Entry, now: float) -> bool:
        """Whether ``e`` holds a result still believed at ``now``."""
        st = self.settings
        age = now - e.t
        if e.s == "ok":
            return age < st.positive_expire_s
        if e.s == "bounce":
            return age < st.negative_expire_s
        if e.s == "defer":
            return age < st.tempfail_expire_s
        return False

    def _stale(self, e: _Entry, now: float) -> bool:
        """Whether a believed result ``e`` is due for a background probe (Postfix's refresh times)."""
        st = self.settings
        if e.s == "ok":
            return now - e.t >= st.positive_refresh_s
        if e.s == "bounce":
            return now - e.t >= st.negative_refresh_s
        return False

    def _claimed_elsewhere(self, e: _Entry | None, now: float) -> bool:
        """Whether another live process is probing this address (its claim not older than the probe timeout)."""
        if e is None or not e.p or now - e.p >= self.settings.probe_timeout_s + _CLAIM_SLACK_S:
            return False
        return e.o != self.pid and _alive(e.o)

    def _trim(self, m: dict[str, Any], now: float, keep: str) -> None:
        """Keep at most ``cache_max`` entries: damaged and expired ones go first, then the oldest."""
        over = len(m) - self.settings.cache_max
        if over <= 0:
            return
        ages: list[tuple[float, str]] = []
        for k in list(m):
            if k == keep:
                continue
            e = _Entry.load(k, m[k], now)
            if e is None or (not self._fresh(e, now) and not self._claimed_elsewhere(e, now)):
                del m[k]
                over -= 1
            else:
                ages.append((max(e.t, e.p), k))
        if over > 0:
            ages.sort()
            for _, k in ages[:over]:
                del m[k]

    # ------------------------------------------------------------------------------------------ queries
    async def verify(self, address: str) -> Verdict:
        """What is known of ``address``, probing the next hop when nothing (believed) is. Waits at most
        ``wait_s`` for a probe; then ``defer`` "Address verification in progress" (the probe goes on and its
        result is cached). Never raises for a failing next hop or map."""
        key = cache_key(address)
        now = self.clock()
        e = self._entry(key, now)
        if e is not None and self._fresh(e, now):
            if self._stale(e, now) and key not in self._inflight and not self._claimed_elsewhere(e, now):
                self._start(key, address)  # refreshed in the background; the cached answer stands
            return Verdict(e.s, e.x)  # type: ignore[arg-type]  # _fresh: s is a status
        task = self._inflight.get(key) or self._start(key, address)
        if task is None:
            return Verdict("defer", "Address verification in progress (too many probes at once)")
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.settings.wait_s)
        except TimeoutError:
            return Verdict("defer", "Address verification in progress")

    def _start(self, key: str, address: str) -> asyncio.Task[Verdict] | None:
        """The task that finds ``address`` out (a probe, or another worker's); None over ``probes_max``."""
        if len(self._inflight) >= self.settings.probes_max:
            return None
        task = asyncio.get_running_loop().create_task(self._find_out(key, address))
        self._inflight[key] = task
        task.add_done_callback(lambda _t: self._inflight.pop(key, None))
        return task

    async def _find_out(self, key: str, address: str) -> Verdict:
        """Claim the address and probe it, or wait for the worker that claimed it first."""
        claimed = False
        elsewhere = False

        def claim(m: dict[str, Any]) -> None:
            nonlocal claimed, elsewhere
            now = self.clock()
            e = _Entry.load(key, m.get(key), now)
            if self._claimed_elsewhere(e, now):
                elsewhere = True
                return
            base = e if e is not None and e.s else _Entry("", 0.0, 0.0, 0, "")
            m[key] = _Entry(base.s, base.t, now, self.pid, base.x).dump(key)
            self._trim(m, now, key)
            claimed = True

        written = await self._update(claim)
        if elsewhere:
            return await self._wait_for_other(key)
        verdict = await self._probe(address)
        if claimed or not written:
            await self._store(key, verdict)
        return verdict

    async def _wait_for_other(self, key: str) -> Verdict:
        """Read the map until the worker that claimed ``key`` writes a result or its claim lapses."""
        start = self.clock()
        while True:
            await asyncio.sleep(POLL_S)
            now = self.clock()
            e = self._entry(key, now)
            if e is not None and self._fresh(e, now) and e.t >= start - POLL_S:
                return Verdict(e.s, e.x)  # type: ignore[arg-type]
            if not self._claimed_elsewhere(e, now):
                if e is not None and self._fresh(e, now):
                    return Verdict(e.s, e.x)  # type: ignore[arg-type]
                return Verdict("defer", "Address verification in progress")

    async def _probe(self, address: str) -> Verdict:
        self.probes += 1
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                result = await self.probe(address)
        except TimeoutError:
            result = ProbeResult("none", Reply(450, "4.4.2", f"address verification probe timed out after "
                                                             f"{self.settings.probe_timeout_s:g} s"))
        except Exception as exc:  # a bug must not leave the session without an answer
            result = ProbeResult("none", Reply(450, "4.3.0", f"address verification failed: {type(exc).__name__}"))
        verdict = describe(result)
        self.report("address_verified", {"recipient": address, "status": verdict.status, "relay": result.relay,
                                         "reply": f"{result.reply.code} {result.reply.enhanced} {printable(result.reply.text)}"})
        return verdict

    async def _store(self, key: str, verdict: Verdict) -> None:
        def put(m: dict[str, Any]) -> None:
            now = self.clock()
            old = _Entry.load(key, m.get(key), now)
            if verdict.status != "ok" and old is not None and old.s == "ok" and self._fresh(old, now):
                m[key] = _Entry(old.s, old.t, 0.0, 0, old.x).dump(key)  # a failed probe never clobbers an OK
            else:
                m[key] = _Entry(verdict.status, now, 0.0, 0, verdict.text).dump(key)
            self._trim(m, now, key)

        await self._update(put)

    async def close(self) -> None:
        """Cancel the probes in flight (the daemon is stopping)."""
        tasks = list(self._inflight.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


def make_prober(
    cfg: Config, hops: Callable[[], tuple[Router, SaslClient | None, PeerPolicy | None]]
) -> Callable[[str], Awaitable[ProbeResult]]:
    """``probe(address)`` for :class:`Verifier`: :func:`~mtaq.delivery.transport.deliver` of no body to
    ``address`` from ``address_verify_sender``, over the router, outbound credentials and DANE/MTA-STS
    that ``hops()`` gives at the time (a reload changes them), on a connection of its own that is closed
    (QUIT) afterwards. The result is the recipient's final reply, or the last temporary one."""
    sender = "" if cfg.address_verify_sender in ("", "<>") else cfg.address_verify_sender

    async def probe(address: str) -> ProbeResult:
        router, sasl, peers = hops()
        pool = ConnectionPool(helo_name=cfg.hostname(), timeout_s=cfg.smtp_timeout_s, idle_s=0.0, max_conns=1,
                              bind_address=cfg.smtp_bind_address, bind_address6=cfg.smtp_bind_address6)
        got: list[ProbeResult] = []

        async def record(b: Batch) -> None:
            got.extend(ProbeResult(b.relay, r) for _, r in b.items)

        try:
            await deliver(router, pool, sender, [address], None, record=record, sasl=sasl, peers=peers)
        finally:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(cfg.smtp_timeout_s):
                    await pool.close_idle()  # QUIT
        if not got:  # pragma: no cover - deliver gives every recipient a reply
            return ProbeResult("none", Reply(451, "4.4.0", "address verification gave no answer"))
        return got[-1]

    return probe
