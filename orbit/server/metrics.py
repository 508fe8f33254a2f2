"""Prometheus metrics: counters bumped by the gateway and duties, gauges read from the
store at scrape time (tasks by queue and state, queue depth, oldest queued age)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from orbit.core.errors import Code
from orbit.store import Store

#: ``orbit_refused_submits_total``'s ``reason`` of each backpressure code.
REFUSAL_REASONS = {Code.QUEUE_FULL: "queue_full", Code.TENANT_FULL: "tenant_full"}


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_state = GaugeMetricFamily(
            "orbit_tasks", "Tasks by queue and state", labels=["queue", "state"]
        )
        depth = GaugeMetricFamily("orbit_queue_depth", "Queued tasks", labels=["queue"])
        oldest = GaugeMetricFamily(
            "orbit_oldest_queued_seconds", "Age of the oldest queued task", labels=["queue"]
        )
        # Every queue has a depth, 0 when nothing is queued: a series that vanished when
        # its queue drained left a dashboard a gap, and no alert could tell empty from
        # unknown. The queues are read first, so one created meanwhile is counted anyway.
        queued = {q.name: 0.0 for q in self._store.queue_list()}
        rows, now_us = self._store.task_stats()
        for row in rows:
            by_state.add_metric([row["queue"], row["state"]], float(row["n"]))
            if row["state"] == "queued":
                queued[row["queue"]] = float(row["n"])
                if row["oldest"] is not None:
                    oldest.add_metric([row["queue"]], max(0, now_us - int(row["oldest"])) / 1e6)
        for name, n in sorted(queued.items()):
            depth.add_metric([name], n)
        yield by_state
        yield depth
        yield oldest


class Metrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.claims = Counter("orbit_claims_total", "Attempts claimed", registry=self.registry)
        self.starts = Counter("orbit_starts_total", "Attempts started", registry=self.registry)
        self.finishes = Counter(
            "orbit_finishes_total",
            "Finish reports accepted",
            ["task_state"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "orbit_rejected_reports_total",
            "Worker reports refused",
            ["code"],
            registry=self.registry,
        )
        # Backpressure (docs/concepts.md): submits refused with 429, by reason; both
        # series are there from the start, at 0, so a rate over them never has a gap.
        self.refused_submits = Counter(
            "orbit_refused_submits_total",
            "Submits refused because a queue or a tenant was full (429)",
            ["reason"],
            registry=self.registry,
        )
        for reason in REFUSAL_REASONS.values():
            self.refused_submits.labels(reason)
        self.lease_expiries = Counter(
            "orbit_lease_expiries_total",
            "Run leases that expired without a report",
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store))
