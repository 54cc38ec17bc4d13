"""Traffic shaping per destination domain: a concurrency limit and a message rate (Postfix
``default_destination_concurrency_limit`` / ``smtp_destination_rate_delay``, KumoMTA traffic shaping).

A delivery of a message to the recipients of one domain holds one of that domain's *slots* while it
talks to the next hop, and takes one token of the domain's rate (a token bucket of one: deliveries to the
domain start at least ``1 / rate_per_s`` seconds apart). Mail for a saturated domain waits, like mail in
Postfix's active queue waits for its destination; it is never deferred for it. The daemon's workers ask
:meth:`Throttle.wait_s` first and hold such mail back rather than wait themselves (mtaq.daemon.process:
other destinations' mail goes on); :meth:`Throttle.slots` entered directly waits.

What must always hold: at no moment do more deliveries to a domain hold a slot than its limit (after a
reload that lowered it, :meth:`Throttle.update`: no new one starts until the deliveries begun before it are
fewer than the new limit; none is cut). Domains are acquired in sorted order, so two workers needing the
same two domains cannot deadlock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["DomainLimit", "Slots", "Throttle"]


@dataclass(frozen=True)
class DomainLimit:
    """``concurrency``: deliveries at once (>= 1); ``rate_per_s``: deliveries started per second (0: no limit)."""

    concurrency: int
    rate_per_s: float = 0.0


class _Domain:
    __slots__ = ("active", "debt", "limit", "next_start", "peak", "sem")

    def __init__(self, limit: DomainLimit) -> None:
        self.limit = limit
        self.sem = asyncio.Semaphore(limit.concurrency)
        self.next_start = 0.0
        self.active = 0
        self.peak = 0  # the most deliveries ever in progress at once (tests and metrics)
        self.debt = 0  # slots a lowered limit took away while they were held: kept back when given back

    def give_back(self) -> None:
        if self.debt:
            self.debt -= 1
        else:
            self.sem.release()


class Throttle:
    """Per-domain limits: ``limits`` by domain (lower case), ``default`` for every other domain."""

    def __init__(self, default: DomainLimit, limits: dict[str, DomainLimit] | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.default = default
        self.limits = {k.lower(): v for k, v in (limits or {}).items()}
        self.clock = clock
        self._domains: dict[str, _Domain] = {}

    def _domain(self, name: str) -> _Domain:
        d = self._domains.get(name)
        if d is None:
            d = self._domains[name] = _Domain(self.limits.get(name, self.default))
        return d

    async def update(self, default: DomainLimit, limits: dict[str, DomainLimit] | None = None) -> None:
        """New limits (``mtaq reload``) for the deliveries that start from now on; those in progress keep
        their slots. A lowered concurrency takes the free slots away at once and the others as they are
        given back; a raised one frees slots at once. Returns without waiting."""
        self.default = default
        self.limits = {k.lower(): v for k, v in (limits or {}).items()}
        for name, d in self._domains.items():
            new = self.limits.get(name, default)
            diff = new.concurrency - d.limit.concurrency
            d.limit = new
            if diff > 0:
                paid = min(diff, d.debt)
                d.debt -= paid
                for _ in range(diff - paid):
                    d.sem.release()
            for _ in range(-diff):
                if d.sem.locked():
                    d.debt += 1
                else:
                    await d.sem.acquire()  # a free slot: taken at once, no wait

    def peak(self, domain: str) -> int:
        """The highest number of simultaneous deliveries to ``domain`` seen so far."""
        d = self._domains.get(domain.lower())
        return d.peak if d is not None else 0

    def wait_s(self, domains: Iterable[str]) -> float | None:
        """Whether a delivery to ``domains`` could start now without waiting: 0.0 when a slot of each is free
        and its rate allows a start now, the seconds until the rate allows one when only the rate is in the
        way, None when a domain has no free slot (a slot comes free when a delivery ends). Entering
        :meth:`slots` right after a 0.0, with no await in between, never waits."""
        wait = 0.0
        now = self.clock()
        for name in {d.lower() for d in domains}:
            d = self._domain(name)
            if d.sem.locked():
                return None
            if d.limit.rate_per_s > 0:
                wait = max(wait, d.next_start - now)
        return wait

    def slots(self, domains: Iterable[str]) -> Slots:
        """Hold one slot (and one rate token) of each domain for the body of the ``async with``."""
        return Slots(self, domains)


class Slots:
    """``async with throttle.slots(domains)``: the slots of ``domains`` (sorted, lower case) acquired on entry
    (waiting for the rate where one is set), all given back on exit, also when entry was cut short (a
    cancellation while waiting). A class rather than ``@asynccontextmanager``: one per delivery, and the
    generator machinery cost more than the rest of it."""

    __slots__ = ("_counted", "_held", "_names", "_throttle")

    def __init__(self, throttle: Throttle, domains: Iterable[str]) -> None:
        self._throttle = throttle
        self._names = sorted({d.lower() for d in domains})
        self._held: list[_Domain] = []  # semaphores acquired
        self._counted: list[_Domain] = []  # deliveries counted as active

    async def __aenter__(self) -> None:
        t = self._throttle
        try:
            for name in self._names:
                d = t._domain(name)
                await d.sem.acquire()
                self._held.append(d)
                if d.limit.rate_per_s > 0:
                    now = t.clock()
                    start = max(now, d.next_start)
                    d.next_start = start + 1.0 / d.limit.rate_per_s
                    if start > now:
                        await asyncio.sleep(start - now)
                d.active += 1
                self._counted.append(d)
                d.peak = max(d.peak, d.active)
        except BaseException:
            self._release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        for d in self._counted:
            d.active -= 1
        for d in self._held:
            d.give_back()
        self._counted.clear()
        self._held.clear()
