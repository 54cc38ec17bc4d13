"""Prometheus metrics of one daemon (``GET /metrics`` on the admin HTTP API; prometheus_client text format).

Everything is read at scrape time from counters the daemon keeps anyway (queue counts by state, the log's
:class:`~mtaq.storage.log.LogStats`, outcome counters), through one custom collector in a per-daemon
:class:`~prometheus_client.CollectorRegistry` (never the global one, so several daemons can live in one
process). The two histograms are plain lists of bucket counts bumped in the event loop (no lock: one loop
writes them and the scrape reads them in the same loop).

What must always hold: the hot path does at most a bisect and two additions per observation; the label
set of ``mtaq_delivery_latency_seconds`` is bounded by ``metrics_domains_max`` (later domains are counted
under ``domain="other"``).

Exposed (units in names; seconds, UTC-free durations):

* ``mtaq_queue_messages{state}`` gauge: incoming, active, deferred, delayed, held, from the daemon's
  counters (no scan of the queue), once recovery is done;
* ``mtaq_messages_accepted_total``: messages answered 250 after DATA;
* ``mtaq_deliveries_total{outcome}``: recipient outcomes delivered / deferred / bounced (expiry included);
* ``mtaq_admin_actions_total{action}``: messages acted on by an administrator (delete, hold, ...);
* ``mtaq_log_records_total``, ``mtaq_fsyncs_total``, ``mtaq_commit_rounds_total``,
  ``mtaq_log_records_per_fsync`` (gauge: records appended / fsync calls since start),
  ``mtaq_fsync_round_seconds`` (summary: count = commit rounds, sum = seconds spent in fsync);
* ``mtaq_commit_latency_seconds`` histogram: how long a caller of ``Log.commit`` waited for the fsync round
  covering its record (the wait behind every 250);
* ``mtaq_milter_replies_total{milter,verdict}``, ``mtaq_milter_errors_total{milter}`` and
  ``mtaq_milter_wait_seconds{milter}`` (summary: count = replies waited for, sum = seconds): each content
  filter's verdicts, failures and latency (issue 34; the filter named by its address as configured);
* ``mtaq_delivery_latency_seconds{domain}`` histogram: arrival to delivery (the remote's 2xx, made
  durable), by recipient domain;
* ``mtaq_recovery_seconds`` gauge (absent until recovery is done), ``mtaq_ready`` gauge (1 after it);
* ``mtaq_destinations_dead`` gauge: next hops now dead (mtaq.delivery.backoff; their mail is deferred
  without a connection), and ``mtaq_destination_concurrency{destination}`` gauge: deliveries allowed at once
  to each next hop that is dead or backed off below its limit (at most ``metrics_domains_max`` of them;
  summed over the shards, as each worker process has its own window);
* with ``event_webhooks`` (issue 37.4): ``mtaq_event_exporter_lag_records{endpoint}`` and
  ``mtaq_event_exporter_lag_seconds{endpoint}`` gauges (how far the endpoint's acknowledged position is behind
  the log's durable end), ``mtaq_event_batches_total{endpoint,result}`` (delivered, failed, retried),
  ``mtaq_events_sent_total{endpoint}``, ``mtaq_event_backlog_skips_total{endpoint}``.

With several workers ``/metrics`` is worker 0's, summed over every shard by :mod:`mtaq.admin.shards`
(which adds ``mtaq_shards``); this module is one daemon's, one shard's.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from mtaq.queue.store import Queue

# prometheus_client (and http.server, which it imports: 50 ms) is imported at the first scrape, not when the
# daemon starts: the first 250 after a start waits for nothing it does not use (issue 36.3).

__all__ = ["COMMIT_BUCKETS_S", "DELIVERY_BUCKETS_S", "Buckets", "Metrics"]


def __getattr__(name: str) -> str:
    """``CONTENT_TYPE``: prometheus_client's ``CONTENT_TYPE_LATEST`` (imported when first asked for)."""
    if name == "CONTENT_TYPE":
        from prometheus_client import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

COMMIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DELIVERY_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0,
                      86400.0, 432000.0)
OTHER_DOMAIN = "other"


class Buckets:
    """A histogram as bucket counts (``le`` upper bounds in seconds, plus +Inf) and a sum; not thread-safe."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value`` (seconds) in the first bucket whose bound is >= it."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``[(le, count of observations <= le), ..., ("+Inf", total)]`` as Prometheus wants them."""
        out, running = [], 0
        for bound, n in zip((*map(_le, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class Metrics:
    """The metrics of one daemon. The daemon sets ``queue`` once its log is open, and ``recovery_seconds``
    when recovery is done; ``counts`` is the daemon's outcome counter dict (delivered, deferred, failed)."""

    def __init__(self, counts: dict[str, int], *, domains_max: int = 100) -> None:
        self.counts = counts
        self.domains_max = domains_max
        self.queue: Queue | None = None
        self.recovery_seconds: float | None = None
        self.commit_latency = Buckets(COMMIT_BUCKETS_S)
        self.delivery_latency: dict[str, Buckets] = {}
        self.admin_actions: Counter[str] = Counter()
        # The content filters' counters by filter name (mtaq.edge.milter.STATS, set by the daemon): objects
        # with ``verdicts`` (verdict -> count), ``errors``, ``seconds`` and ``waits``.
        self.milter_stats: Callable[[], Mapping[str, Any]] | None = None
        # The daemon's next hops (mtaq.delivery.backoff): {destination: (window, active, dead)}; None: none yet.
        self.destinations: Callable[[], dict[str, tuple[int, int, bool]]] | None = None
        # The event exporter (mtaq.daemon.exporter.Exporter; None: no event_webhooks): its ``metrics()`` gives
        # (endpoint, lag records, lag seconds, counters with batches_delivered/_failed/_retried, ...).
        self.exporter: Any = None
        self._registry: CollectorRegistry | None = None

    @property
    def registry(self) -> CollectorRegistry:
        """The daemon's own registry (never the global one), made at the first scrape."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry
            from prometheus_client.registry import Collector

            class _DaemonCollector(Collector):
                def __init__(self, m: Metrics) -> None:
                    self.m = m

                def collect(self) -> Iterable[Metric]:
                    return _collect(self.m)

            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(_DaemonCollector(self))
        return self._registry

    def delivered(self, address: str, seconds: float) -> None:
        """A recipient was delivered ``seconds`` after its message arrived (labelled by its domain)."""
        domain = address.rpartition("@")[2].lower() or "none"
        b = self.delivery_latency.get(domain)
        if b is None:
            if len(self.delivery_latency) >= self.domains_max:
                domain = OTHER_DOMAIN
                b = self.delivery_latency.get(domain)
            if b is None:
                b = self.delivery_latency[domain] = Buckets(DELIVERY_BUCKETS_S)
        b.observe(max(0.0, seconds))

    def admin_action(self, action: str, messages: int) -> None:
        """An administrator's ``action`` was applied to ``messages`` messages."""
        self.admin_actions[action] += messages

    def exposition(self) -> bytes:
        """The Prometheus text format (version 0.0.4) of every metric, as of now."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _collect(m: Metrics) -> Iterable[Metric]:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        SummaryMetricFamily,
    )

    q = m.queue
    ready = q is not None and m.recovery_seconds is not None
    yield GaugeMetricFamily("mtaq_ready", "1 once recovery is done and the queue is being run, else 0",
                            value=1.0 if ready else 0.0)
    if q is not None and m.recovery_seconds is not None:
        sizes = GaugeMetricFamily("mtaq_queue_messages", "Messages in the queue by state (daemon counters)",
                                  labels=["state"])
        for state, n in q.counts.as_dict().items():
            if state != "total":
                sizes.add_metric([state], float(n))
        yield sizes
        yield GaugeMetricFamily("mtaq_recovery_seconds", "Seconds the last recovery took",
                                value=m.recovery_seconds)
    if q is not None:
        yield CounterMetricFamily("mtaq_messages_accepted", "Messages answered 250 after DATA (durable)",
                                  value=float(q.received))
        st = q.log.stats
        yield CounterMetricFamily("mtaq_log_records", "Records appended to the log", value=float(st.records_appended))
        yield CounterMetricFamily("mtaq_fsyncs", "fsync calls (files and directory)", value=float(st.fsync_calls))
        yield CounterMetricFamily("mtaq_commit_rounds", "Group-commit rounds", value=float(st.commit_rounds))
        yield GaugeMetricFamily("mtaq_log_records_per_fsync", "Records appended per fsync call since start",
                                value=st.records_appended / st.fsync_calls if st.fsync_calls else 0.0)
        yield SummaryMetricFamily("mtaq_fsync_round_seconds", "Seconds spent in fsync per group-commit round",
                                  count_value=st.commit_rounds, sum_value=st.fsync_seconds)
    outcomes = CounterMetricFamily("mtaq_deliveries", "Recipient outcomes (bounced includes expiry)",
                                   labels=["outcome"])
    for outcome, key in (("delivered", "delivered"), ("deferred", "deferred"), ("bounced", "failed")):
        outcomes.add_metric([outcome], float(m.counts.get(key, 0)))
    yield outcomes
    actions = CounterMetricFamily("mtaq_admin_actions", "Messages acted on by an administrator", labels=["action"])
    for action, n in sorted(m.admin_actions.items()):
        actions.add_metric([action], float(n))
    yield actions
    if m.destinations is not None:
        dests = m.destinations()
        yield GaugeMetricFamily("mtaq_destinations_dead", "Next hops now dead: their mail is deferred without "
                                "a connection (smtp_destination_dead_s)", value=float(sum(d for _, _, d in dests.values())))
        window = GaugeMetricFamily("mtaq_destination_concurrency", "Deliveries allowed at once to a next hop that "
                                   "is dead or backed off below its limit (concurrency feedback)",
                                   labels=["destination"])
        for name, (w, _active, _dead) in sorted(dests.items())[: m.domains_max]:
            window.add_metric([name], float(w))
        yield window
    if m.exporter is not None:
        yield from _exporter_metrics(m.exporter.metrics())
    commit = HistogramMetricFamily("mtaq_commit_latency_seconds",
                                   "Seconds a commit waited for the fsync round covering it")
    commit.add_metric([], m.commit_latency.cumulative(), sum_value=m.commit_latency.sum)
    yield commit
    if m.milter_stats is not None:
        stats = sorted(m.milter_stats().items())
        replies = CounterMetricFamily("mtaq_milter_replies", "Final replies of each content filter (milter), "
                                      "by verdict", labels=["milter", "verdict"])
        errors = CounterMetricFamily("mtaq_milter_errors", "Content filter failures (unreachable, timeout, "
                                     "protocol error, connection closed)", labels=["milter"])
        waits = SummaryMetricFamily("mtaq_milter_wait_seconds", "Seconds waited for each filter's replies",
                                    labels=["milter"])
        for name, st in stats:
            for verdict, n in sorted(st.verdicts.items()):
                replies.add_metric([name, verdict], float(n))
            errors.add_metric([name], float(st.errors))
            waits.add_metric([name], count_value=st.waits, sum_value=st.seconds)
        yield replies
        yield errors
        yield waits
    delivery = HistogramMetricFamily("mtaq_delivery_latency_seconds",
                                     "Seconds from arrival to delivery, by recipient domain", labels=["domain"])
    for domain, b in sorted(m.delivery_latency.items()):
        delivery.add_metric([domain], b.cumulative(), sum_value=b.sum)
    yield delivery


def _exporter_metrics(rows: list[tuple[str, int, float, Any]]) -> Iterable[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    lag_r = GaugeMetricFamily("mtaq_event_exporter_lag_records", "Log records appended since the endpoint's "
                              "acknowledged position (records of this run)", labels=["endpoint"])
    lag_s = GaugeMetricFamily("mtaq_event_exporter_lag_seconds", "Seconds since the oldest record not yet "
                              "acknowledged by the endpoint became durable (0: caught up)", labels=["endpoint"])
    batches = CounterMetricFamily("mtaq_event_batches", "Event batches POSTed: delivered (2xx), failed (4xx, "
                                  "skipped), retried (5xx, timeout, connection error)", labels=["endpoint", "result"])
    events = CounterMetricFamily("mtaq_events_sent", "Events acknowledged by the endpoint", labels=["endpoint"])
    skips = CounterMetricFamily("mtaq_event_backlog_skips", "Times the endpoint lagged beyond "
                                "event_backlog_max_bytes and skipped to the end of the log", labels=["endpoint"])
    for name, records, seconds, st in rows:
        lag_r.add_metric([name], float(records))
        lag_s.add_metric([name], seconds)
        for result, n in (("delivered", st.batches_delivered), ("failed", st.batches_failed),
                          ("retried", st.batches_retried)):
            batches.add_metric([name, result], float(n))
        events.add_metric([name], float(st.events_sent))
        skips.add_metric([name], float(st.backlog_skips))
    yield from (lag_r, lag_s, batches, events, skips)
