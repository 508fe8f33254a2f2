"""Prometheus metrics: counters bumped by the gateway and duties, gauges read from the
store at scrape time (tasks not ended by queue and state, queue depth, oldest queued
age), the time the worker protocol's transactions take (``worker_call``), and whether
the LISTEN connection is up (PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter
from types import TracebackType
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.store import Store

#: ``orbit_refused_submits_total``'s ``reason`` of each backpressure code.
REFUSAL_REASONS = {Code.QUEUE_FULL: "queue_full", Code.TENANT_FULL: "tenant_full"}

#: The worker protocol's store transactions ``Metrics.worker_call`` times, by ``op``: a
#: claim (the dispatcher's or a worker's ``claim``) and the reports, alone or batched.
WorkerOp = Literal["claim", "start", "finish", "renew", "release"]
WORKER_OPS: tuple[WorkerOp, ...] = get_args(WorkerOp)

#: ``orbit_worker_transaction_seconds``' buckets: a one-task transaction takes about a
#: millisecond on an idle node, a batch of hundreds in a busy drain tens of them.
WORKER_CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # The states a task can still leave, never the ended ones (succeeded, failed,
        # cancelled): those are counted by orbit_finishes_total as they end, and a count
        # of them at every scrape read every task ever stored (Store.task_stats).
        by_state = GaugeMetricFamily(
            "orbit_tasks", "Tasks not ended, by queue and state", labels=["queue", "state"]
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


class WorkerCall:
    """One timed store transaction of the worker protocol (``Metrics.worker_call``): a
    context manager around the ``await`` of the call, which records, as it exits
    (raising or not), the seconds the call took and ``items``, the tasks it granted or
    the reports it carried (set inside the block when known only from the answer)."""

    __slots__ = ("_began", "_counter", "_seconds", "items")

    def __init__(self, seconds: Histogram, counter: Counter, items: int) -> None:
        self._seconds = seconds
        self._counter = counter
        self._began = 0.0
        self.items = items

    def __enter__(self) -> WorkerCall:
        self._began = perf_counter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._seconds.observe(perf_counter() - self._began)
        self._counter.inc(self.items)


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
        # The worker protocol's transactions, timed on the event loop around their await
        # (the hop to a store thread, any wait for one, the transaction and its commit):
        # rate() of the sum is how many were in flight on average, and the items over the
        # count how large they were; every op's series is there from the start, at 0.
        self.worker_seconds = Histogram(
            "orbit_worker_transaction_seconds",
            "Store transactions made for workers (claims, starts, finishes, renewals, releases)",
            ["op"],
            buckets=WORKER_CALL_BUCKETS,
            registry=self.registry,
        )
        self.worker_items = Counter(
            "orbit_worker_transaction_items_total",
            "Tasks claimed, or reports carried, by those transactions",
            ["op"],
            registry=self.registry,
        )
        #: each op's two series, looked up once: a call costs no label lookup
        self._worker_series = {
            op: (self.worker_seconds.labels(op), self.worker_items.labels(op)) for op in WORKER_OPS
        }
        # PostgreSQL's LISTEN connection (orbit/server/listen.py): 1 while it is up, 0
        # before it first connects and while it is away, when other nodes' wakes and
        # cancels reach this node only by its polls. SQLite has none: no series at all.
        self.listen_connected: Gauge | None = None
        if store.backend == "postgres":
            self.listen_connected = Gauge(
                "orbit_listen_connected",
                "Whether this node's LISTEN connection is up (PostgreSQL)",
                registry=self.registry,
            )
        self.registry.register(_StoreCollector(store))

    def report_refused(self, exc: OrbitError) -> None:
        """Count a worker report the store refused: a fenced one (``Rejected``, which
        leaves an event) or one for an attempt it does not know (which leaves none, and
        went uncounted)."""
        if isinstance(exc, Rejected) or exc.code == Code.ATTEMPT_NOT_FOUND:
            self.rejected.labels(str(exc.code)).inc()

    def worker_call(self, op: WorkerOp, items: int = 0) -> WorkerCall:
        """Time one worker-protocol transaction of ``op`` (one of ``WORKER_OPS``) carrying
        ``items``: ``with metrics.worker_call("start", len(starts)): await ...``."""
        seconds, counted = self._worker_series[op]
        return WorkerCall(seconds, counted, items)
