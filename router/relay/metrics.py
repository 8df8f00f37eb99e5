"""Prometheus metrics of ``router serve``.

Counters and the latency histogram live in the processes that deliver (each worker); with
``--workers N`` they are written to a shared folder (``PROMETHEUS_MULTIPROC_DIR``) and the
parent adds them up. Backlog gauges (pending, in flight, failed, abandoned, oldest claimable
age, circuit, paused) are read from the databases when scraped, so every worker and every
host agree on them.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["BacklogCollector", "CounterRate", "Metrics", "multiprocess_registry", "observe_all"]

LABELS = ("database", "target")
Key = tuple[str, str]
"""(database, target)."""
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)


def observe_all(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for every value, as one increment per bucket touched.

    A batch's latencies all land in a few buckets, and with ``--workers N`` every increment
    is a locked write to a shared file (~2.5 µs an observation, about a tenth of a worker's
    CPU per message). This reads prometheus_client's ``_upper_bounds``, ``_buckets`` and
    ``_sum``, which are not public API: where a version lacks them, it observes one by one.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect_left(bounds, value)] += 1  # the first bucket whose bound >= value
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)
    total.inc(sum(values))


class Metrics:
    """The delivery counters of one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.published = Counter(
            "router_published",
            "Rows published (broker acknowledged).",
            LABELS,
            registry=self.registry,
        )
        self.failed = Counter(
            "router_failed",
            "Attempts that failed and will be retried.",
            LABELS,
            registry=self.registry,
        )
        self.abandoned = Counter(
            "router_abandoned", "Rows given up on.", LABELS, registry=self.registry
        )
        self.retried = Counter(
            "router_retried", "Attempts after the first of a row.", LABELS, registry=self.registry
        )
        self.rate_limited = Counter(
            "router_rate_limited_seconds",
            "Seconds the target's rate_limit held its claims back.",
            LABELS,
            registry=self.registry,
        )
        self.within_slo = Counter(
            "router_delivered_within_slo",
            "Rows published within the target's slo_seconds of their commit.",
            LABELS,
            registry=self.registry,
        )
        self.publish = Histogram(
            "router_publish_seconds",
            "One wave's publish: from its first send to the broker's last acknowledgement.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "router_commit_to_ack_seconds",
            "From the row's commit (created_at) to the broker's acknowledgement.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def start_target(self, database: str, target: str) -> None:
        """Expose every series of one target at 0 before anything happened to it.

        A labelled series exists only once its labels were used: without this, a counter that
        moves rarely (``router_rate_limited_seconds_total``) has no sample until it first
        moves, and ``rate()`` or an alert on it sees nothing rather than 0.
        """
        for metric in (
            self.published,
            self.failed,
            self.abandoned,
            self.retried,
            self.rate_limited,
            self.within_slo,
            self.publish,
            self.latency,
        ):
            metric.labels(database, target)

    def render(self) -> bytes:
        """Prometheus text format."""
        return generate_latest(self.registry)

    def totals(self) -> dict[tuple[str, str], dict[str, float]]:
        """Counter totals per (database, target), for the JSON API."""
        return counter_totals(self.registry)


def counter_totals(registry: CollectorRegistry) -> dict[tuple[str, str], dict[str, float]]:
    """Sum of each ``router_*_total`` counter per (database, target) in ``registry``."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    for family in registry.collect():
        if family.type != "counter":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            key = (sample.labels.get("database", ""), sample.labels.get("target", ""))
            name = sample.name.removeprefix("router_").removesuffix("_total")
            totals.setdefault(key, {})[name] = totals.get(key, {}).get(name, 0) + sample.value
    return totals


class CounterRate:
    """One counter's increase a minute per (database, target), from successive readings of
    ``counter_totals``: what ``rate(<counter>[1m]) * 60`` would say, with no Prometheus.

    The first reading is a zero at creation (the counters start at 0 with the process), so the
    first minute's rate is the increase since start over the time since start.
    """

    def __init__(self, name: str, window: float = 60.0) -> None:
        self.name = name
        self.window = window
        self._readings: deque[tuple[float, dict[Key, float]]] = deque([(time.monotonic(), {})])

    def per_minute(self, totals: dict[Key, dict[str, float]]) -> dict[Key, float]:
        """Add the reading ``totals`` (now) and return the counter's rate over the window."""
        now = time.monotonic()
        current = {key: figures.get(self.name, 0.0) for key, figures in totals.items()}
        self._readings.append((now, current))
        # Keep the newest reading at least a window old as the base, and nothing older.
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window:
            self._readings.popleft()
        since, base = self._readings[0]
        elapsed = now - since
        if elapsed <= 0:
            return dict.fromkeys(current, 0.0)
        return {
            key: round(max(0.0, value - base.get(key, 0.0)) * 60 / elapsed, 2)
            for key, value in current.items()
        }


def multiprocess_registry(path: str | None = None) -> CollectorRegistry:
    """A registry that adds up what every worker wrote to ``PROMETHEUS_MULTIPROC_DIR``."""
    registry = CollectorRegistry()
    MultiProcessCollector(  # type: ignore[no-untyped-call]
        registry, path=path or os.environ["PROMETHEUS_MULTIPROC_DIR"]
    )
    return registry


class BacklogCollector:
    """Backlog gauges from the last database reading (refreshed before each scrape)."""

    def __init__(self) -> None:
        self.rows: Sequence[Any] = ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield one gauge family per figure."""
        figures: Iterable[tuple[str, str, str]] = (
            ("router_pending", "Rows waiting to be claimed.", "pending"),
            ("router_in_flight", "Rows leased by a worker now.", "in_flight"),
            ("router_waiting_retry", "Rows that failed and wait for their next attempt.", "failed"),
            ("router_abandoned_rows", "Abandoned rows kept for inspection.", "abandoned"),
            (
                "router_held_keys",
                "Stream keys held behind a head refused for good (ordering: hold).",
                "held_keys",
            ),
            (
                "router_parked_keys",
                "Stream keys parked with their head refused for good (ordering: park).",
                "parked_keys",
            ),
            ("router_parked_rows", "Rows parked, waiting for their key's release.", "parked"),
            (
                "router_oldest_held_age_seconds",
                "How long the oldest held or parked head has waited for an operator.",
                "oldest_held_age",
            ),
            (
                "router_oldest_claimable_age_seconds",
                "Age of the oldest row that is due.",
                "oldest_claimable_age",
            ),
        )
        for name, documentation, attribute in figures:
            family = GaugeMetricFamily(name, documentation, labels=list(LABELS))
            for row in self.rows:
                value = getattr(row, attribute)
                family.add_metric([row.database, row.target], float(value or 0))
            yield family
        circuit = GaugeMetricFamily(
            "router_circuit_open",
            "1 while the target's circuit is open (its broker unreachable).",
            labels=list(LABELS),
        )
        paused = GaugeMetricFamily(
            "router_paused", "1 while the target is paused.", labels=list(LABELS)
        )
        for row in self.rows:
            circuit.add_metric([row.database, row.target], 1.0 if row.circuit == "open" else 0.0)
            paused.add_metric([row.database, row.target], 1.0 if row.paused else 0.0)
        yield circuit
        yield paused
        yield from self._flow()

    def _flow(self) -> Iterator[GaugeMetricFamily]:
        """The last minute's flow and the limits (router.ops.flow; the config)."""
        inf, nan = float("inf"), float("nan")

        def rate_limit(row: Any) -> float:
            return float(row.rate_limit["messages_per_second"]) if row.rate_limit else 0.0

        def max_rows(row: Any) -> float:
            return float(row.on_backlog["max_rows"]) if row.on_backlog else 0.0

        def over(row: Any) -> float:
            limit = max_rows(row)
            return 1.0 if limit and row.pending + row.in_flight + row.failed > limit else 0.0

        figures: Iterable[tuple[str, str, Any]] = (
            (
                "router_staged_per_second",
                "Rows staged a second over the last minute.",
                lambda r: r.staged_per_second,
            ),
            (
                "router_published_per_second",
                "Rows published a second over the last minute.",
                lambda r: r.published_per_second,
            ),
            (
                "router_time_to_empty_seconds",
                "When the queue is empty at the last minute's pace (+Inf: not shrinking).",
                lambda r: inf if r.time_to_empty_seconds is None else r.time_to_empty_seconds,
            ),
            (
                "router_delivered_within_slo_ratio",
                "Share of the last minute's published rows delivered within slo_seconds.",
                lambda r: nan if r.delivered_within_slo is None else r.delivered_within_slo,
            ),
            ("router_slo_seconds", "The target's slo_seconds.", lambda r: r.slo_seconds),
            (
                "router_rate_limit_messages_per_second",
                "The target's rate_limit (0: none).",
                rate_limit,
            ),
            ("router_backlog_limit_rows", "The target's on_backlog.max_rows (0: none).", max_rows),
            ("router_backlog_over_limit", "1 while the queue is over on_backlog.max_rows.", over),
        )
        for name, documentation, value in figures:
            family = GaugeMetricFamily(name, documentation, labels=list(LABELS))
            for row in self.rows:
                family.add_metric([row.database, row.target], float(value(row)))
            yield family
