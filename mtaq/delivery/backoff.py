"""Back-off that reacts: dead destinations and a concurrency window per next hop (Postfix's qmgr
concurrency scheduler, SCHEDULER_README "Concurrency scheduling"; KumoMTA's ready-queue suspension).

A *destination* is a next hop as Postfix's queue manager names it: ``str(route)`` of a
:class:`~mtaq.delivery.routing.Route`, ``example.org:25`` (by MX) or ``[192.0.2.1]:25`` (a host as it
is: relayhost, transport map).

Each destination has a concurrency *window* (a float; deliveries at once: ``int(window)``, never below 1),
at most ``limit`` (``destination_concurrency_limit``, or the next hop's ``destination_limits`` entry) and
starting there. The feedback of each delivery to it (:meth:`Destinations.feedback`):

* **negative** (a *site failure*: the connection refused or timed out, the greeting was not 2xx, a 421 at
  any stage, the connection lost in the middle): the window drops by one (Postfix's classic "-1 after a
  connection or handshake failure"; never below 1), and the failure counts ``1 / window`` of a failed
  *pseudo-cohort* (``window`` deliveries). A host that could not be talked to at all (connect or greeting)
  counts a whole cohort at once: every delivery of the cohort would fail alike. When the failed cohorts
  since the last success reach ``destination_concurrency_failed_cohort_limit`` (Postfix's parameter, 1),
  the destination is **dead** for ``dead_s`` seconds (``smtp_destination_dead_s``; Postfix keeps a dead
  destination throttled for ``minimal_backoff_time``): its mail is deferred without a connection attempt,
  ``4.4.x delivery temporarily suspended: <the last reason>`` (Postfix's words), through the same DELIVERY
  records as any deferral. After the dead time one delivery at a time probes it (window 1).
* **positive** (the host answered, whatever it answered: 2xx, 5xx, a 4xx other than 421): the failed
  cohorts are forgotten, the window grows by ``1 / window`` (Postfix's default positive feedback: one more
  after a whole window of successes), and a destination that was dead is alive again.

:meth:`Destinations.clear` (``mtaq queue flush``, as ``postqueue -f`` in Postfix) forgets every dead mark
and failure. The state is per process, in memory only: a restart starts every destination afresh, and
nothing here is durable or needed for durability (the deferrals are ordinary records).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mtaq.delivery.relay import Reply

__all__ = ["DESTINATIONS_MAX", "DestState", "Destinations"]

DESTINATIONS_MAX = 10_000
"""Destinations kept in memory; past it, those with nothing to remember (alive, idle, window at its ceiling)
are forgotten."""


@dataclass(slots=True)
class DestState:
    """One destination: ``window`` (deliveries at once: ``int(window)``), ``active`` deliveries holding a
    slot, ``fail_cohorts`` failed since the last success, ``dead_until`` (monotonic seconds; 0: alive),
    ``reason`` (the last site failure), ``was_dead`` (dead, not yet answered since)."""

    limit: int
    window: float
    active: int = 0
    fail_cohorts: float = 0.0
    dead_until: float = 0.0
    reason: Reply | None = None
    was_dead: bool = False
    peak: int = 0


class Destinations:
    """The dead-destination cache and concurrency windows of one daemon process.

    ``limit``: the window's ceiling (>= 1); ``limits``: per next-hop host (lower case), overriding it;
    ``dead_s``: seconds a dead destination is suspended; ``failed_cohort_limit``: failed cohorts that make
    it dead (0: never dead, as Postfix's 0); ``report(event, fields)``: ``destination_dead``,
    ``destination_alive``, ``concurrency_changed``."""

    def __init__(self, limit: int, limits: dict[str, int] | None = None, *, dead_s: float = 300.0,
                 failed_cohort_limit: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 report: Callable[[str, dict[str, Any]], None] = lambda event, fields: None) -> None:
        self.limit = limit
        self.limits = {k.lower(): v for k, v in (limits or {}).items()}
        self.dead_s = dead_s
        self.failed_cohort_limit = failed_cohort_limit
        self.clock = clock
        self.report = report
        self._dests: dict[str, DestState] = {}

    # --------------------------------------------------------------------------------------------- state
    def _ceiling(self, dest: str) -> int:
        host = dest.rpartition(":")[0].strip("[]").lower()
        return max(1, self.limits.get(host, self.limit))

    def state(self, dest: str) -> DestState:
        """The state of ``dest`` (made at its first use, window at its ceiling)."""
        d = self._dests.get(dest)
        if d is None:
            if len(self._dests) >= DESTINATIONS_MAX:
                self._forget_idle()
            lim = self._ceiling(dest)
            d = self._dests[dest] = DestState(limit=lim, window=float(lim))
        return d

    def _forget_idle(self) -> None:
        now = self.clock()
        for name in [n for n, d in self._dests.items()
                     if not d.active and not d.fail_cohorts and d.window >= d.limit
                     and not (d.dead_until and now < d.dead_until)]:
            del self._dests[name]

    def configure(self, limit: int, limits: dict[str, int] | None = None, *, dead_s: float | None = None,
                  failed_cohort_limit: float | None = None) -> None:
        """New limits (``mtaq reload``): each window is cut to its new ceiling (never raised by this)."""
        self.limit = limit
        self.limits = {k.lower(): v for k, v in (limits or {}).items()}
        if dead_s is not None:
            self.dead_s = dead_s
        if failed_cohort_limit is not None:
            self.failed_cohort_limit = failed_cohort_limit
        for name, d in self._dests.items():
            d.limit = self._ceiling(name)
            d.window = min(d.window, float(d.limit))

    def suspended(self, dest: str) -> Reply | None:
        """The deferral for mail to ``dest`` while it is dead, else None (also once its dead time is over:
        it is then probed by one delivery at a time)."""
        d = self._dests.get(dest)
        if d is None or not d.dead_until:
            return None
        if self.clock() < d.dead_until:
            why = d.reason or Reply(421, "4.4.1", "destination not reachable")
            return Reply(why.code if 400 <= why.code < 500 else 421, why.enhanced or "4.4.1",
                         f"delivery temporarily suspended: {why.text}")
        d.dead_until = 0.0
        d.fail_cohorts = 0.0
        self._set_window(dest, d, 1.0, "dead time over: probing")
        return None

    def free(self, dests: Iterable[str]) -> bool:
        """Whether a delivery to each of ``dests`` may start now: a free place in its window, or dead (its
        mail is deferred without a connection)."""
        for name in dests:
            if self.suspended(name) is None:
                d = self.state(name)
                if d.active >= max(1, int(d.window)):
                    return False
        return True

    def hold(self, dests: Iterable[str]) -> list[str]:
        """Count a delivery to each of ``dests`` not dead (after :meth:`free` said yes, with no await in
        between); returns the names to :meth:`release`."""
        held = []
        for name in dests:
            if self.suspended(name) is None:
                d = self.state(name)
                d.active += 1
                d.peak = max(d.peak, d.active)
                held.append(name)
        return held

    def release(self, held: Iterable[str]) -> None:
        for name in held:
            d = self._dests.get(name)
            if d is not None and d.active > 0:
                d.active -= 1

    # ------------------------------------------------------------------------------------------ feedback
    def feedback(self, dest: str, *, answered: bool, failure: Reply | None = None, whole: bool = False) -> None:
        """The outcome of one delivery to ``dest``: ``answered`` (a host talked: positive feedback), else
        ``failure`` (the site failure's reply: negative feedback; ``whole``: no host could be talked to at
        all, a whole failed cohort). Neither: no feedback (a routing or policy problem)."""
        d = self.state(dest)
        if answered:
            d.fail_cohorts = 0.0
            d.reason = None
            if d.was_dead or d.dead_until:
                d.was_dead, d.dead_until = False, 0.0
                self.report("destination_alive", {"destination": dest, "concurrency": max(1, int(d.window))})
            if d.window < d.limit:
                self._set_window(dest, d, min(float(d.limit), d.window + 1.0 / d.window), "positive feedback")
            return
        if failure is None:
            return
        d.reason = failure
        if d.dead_until and self.clock() < d.dead_until:
            return  # a delivery begun before it was declared dead: already counted
        d.fail_cohorts += 1.0 if whole else 1.0 / max(1.0, d.window)
        if self.failed_cohort_limit > 0 and d.fail_cohorts >= self.failed_cohort_limit - 1e-9:
            d.dead_until = self.clock() + self.dead_s
            d.was_dead = True
            self._set_window(dest, d, 1.0, "dead")
            self.report("destination_dead", {"destination": dest, "dead_s": self.dead_s,
                                             "reason": f"{failure.code} {failure.enhanced} {failure.text}".strip(),
                                             "action": "deferred without a connection until the dead time is over "
                                                       "(or mtaq queue flush)"})
            return
        self._set_window(dest, d, max(1.0, d.window - 1.0), "negative feedback")

    def _set_window(self, dest: str, d: DestState, window: float, why: str) -> None:
        before = max(1, int(d.window))
        d.window = window
        after = max(1, int(window))
        if after != before:
            self.report("concurrency_changed", {"destination": dest, "concurrency": after, "before": before,
                                                "reason": why})

    def clear(self) -> int:
        """Forget every dead mark and failure (``mtaq queue flush``; Postfix ``postqueue -f``); windows
        back at their ceilings. Returns how many destinations were dead."""
        dead = 0
        now = self.clock()
        for name, d in self._dests.items():
            if d.dead_until and now < d.dead_until:
                dead += 1
            d.dead_until, d.fail_cohorts, d.reason, d.was_dead = 0.0, 0.0, None, False
            self._set_window(name, d, float(d.limit), "flush")
        return dead

    def backed_off(self) -> dict[str, tuple[int, int, bool]]:
        """{destination: (deliveries allowed at once, deliveries in progress, dead)} of the destinations
        now dead or below their ceiling (for /metrics: the ones an administrator looks for)."""
        now = self.clock()
        out = {}
        for name, d in self._dests.items():
            dead = bool(d.dead_until) and now < d.dead_until
            if dead or d.window < d.limit:
                out[name] = (max(1, int(d.window)), d.active, dead)
        return out
