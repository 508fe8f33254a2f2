"""Many worker processes racing over one PostgreSQL store: caps and I1 must hold.

Single-process tests only ever interleave transactions in the order the test chose. Here
eight OS processes, each with its own connection pool and the real database clock, claim,
start, release and finish tasks as fast as they can, while a monitor samples live
occupancy. What the store promises under true concurrency (DESIGN.md §2) is then checked
three ways: by the monitor's samples (a cap is never exceeded at any observed moment), by
replaying the event log (which also sees the moments the monitor missed) and by the rows
at rest (``check_all``). SQLite is excluded: it serialises all writers, so there is no
race to lose there.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

import pytest

from orbit.core.model import Backoff, Capability, Grant, Outcome, TaskSpec
from orbit.store import Store, open_store
from tests.invariants import LIVE, all_events, check_all, occupancy_replay
from tests.pg import as_url, temporary_database

# The scenario. Caps are small and overlapping, so that every one of them binds at some
# point: 8 sessions of 2 would want 16 permits, the global cap allows 5.
QUEUE_CAPS = {"qa": 3, "qb": 3}
TENANT_CAPS = {"t1": 2, "t2": 4}
GLOBAL_CAP = 5
SESSION_CAP = 2
HANDLER_CAPS = {"render": 1, "fetch": 2}  # per session
TASKS_PER_CELL = 40  # x 2 queues x 2 tenants x 2 handlers = 320 tasks
WORKERS = 8
BATCH = 2
RELEASE_PROBABILITY = 0.05  # a worker sometimes gives a claim back unstarted
MAX_ATTEMPTS = 3
# Retries must come due within the test: 0.5-1 ms after a failure (equal jitter).
FAST_BACKOFF = Backoff(base_us=1000, factor=1.0, max_us=1000)

WORKER_BUDGET_S = 120.0  # a worker that is not done by then reports failure
STARTUP_BUDGET_S = 60.0  # spawning 8 interpreters on 2 cores
HEARTBEAT_EVERY_S = 5.0  # the session TTL is 60 s; a live worker keeps it alive
REAP_EVERY_S = 0.2
IDLE_POLL_S = (0.002, 0.010)  # nothing claimable: wait a little, then ask again
NON_TERMINAL = {"queued", "scheduled", "claimed", "running", "cancelling"}


def _plan_for(i: int) -> tuple[str, int]:
    """What task ``i`` does: ``ok``, ``flaky`` (fails ``k`` times, then succeeds),
    ``exhaust`` (fails retryably every time) or ``fatal`` (fails, not retryable).
    Deterministic, so the final state and ``attempts_used`` of every task is known."""
    r = i % 20
    if r < 12:
        return "ok", 0
    if r < 16:
        return "flaky", 1
    if r < 18:
        return "flaky", 2
    if r == 18:
        return "exhaust", MAX_ATTEMPTS
    return "fatal", 1


def _expected(plan: str, k: int) -> tuple[str, int, str | None]:
    """(final state, attempts_used, error_code) that a task with this plan must end with."""
    if plan == "ok":
        return "succeeded", 1, None
    if plan == "flaky":
        return "succeeded", k + 1, None
    if plan == "exhaust":
        return "failed", MAX_ATTEMPTS, "FLAKY"
    return "failed", 1, "FATAL"


def _outcome(grant: Grant) -> Outcome:
    """The handler's verdict, from the payload and the attempts already started."""
    payload = json.loads(grant.task.payload)
    plan, k = payload["plan"], payload["k"]
    if plan == "fatal":
        return Outcome.failure("FATAL", "not worth retrying", retryable=False)
    if plan == "exhaust" or (plan == "flaky" and grant.task.attempts_used < k):
        return Outcome.failure("FLAKY", "try again", retryable=True)
    return Outcome.success({"i": payload["i"]})


# --------------------------------------------------------------------------- worker process


def _worker_loop(index: int, url: str, go: ProcessEvent) -> dict[str, Any]:
    """One worker: claim a batch, start all, finish all, until no task is left to do."""
    rng = random.Random(index)
    store = open_store(url, migrate=False)
    try:
        session, _ = store.session_open(
            name=f"w{index}",
            node_id=f"node{index % 2}",
            capabilities=[Capability(h, c) for h, c in HANDLER_CAPS.items()],
            max_concurrency=SESSION_CAP,
        )
        go.wait(STARTUP_BUDGET_S)  # start together, so the first claims collide too
        stats: dict[str, Any] = defaultdict(int)
        grants: list[list[Any]] = []
        start = time.monotonic()
        give_up = start + WORKER_BUDGET_S
        next_heartbeat = start + HEARTBEAT_EVERY_S
        next_reap = start + rng.uniform(0, REAP_EVERY_S)
        while True:
            now = time.monotonic()
            if now > give_up:
                raise TimeoutError(
                    f"worker {index}: tasks left after {WORKER_BUDGET_S} s: {store.task_counts()}"
                )
            if now >= next_heartbeat:
                store.session_heartbeat(session.id, session.epoch)
                next_heartbeat = now + HEARTBEAT_EVERY_S
            if now >= next_reap:
                stats["reaped"] += store.reap().total
                stats["reaps"] += 1
                next_reap = now + REAP_EVERY_S
            claimed = store.attempt_claim_many(session.id, session.epoch, BATCH)
            stats["claim_calls"] += 1
            if not claimed:
                counts = store.task_counts()
                if not NON_TERMINAL.intersection(counts):
                    break
                stats["idle_polls"] += 1
                time.sleep(rng.uniform(*IDLE_POLL_S))
                continue
            running: list[Grant] = []
            for g in claimed:
                a = g.attempt
                grants.append([a.id, a.task_id, a.fence, session.id])
                if rng.random() < RELEASE_PROBABILITY:
                    store.attempt_release(session.id, session.epoch, a.id, a.fence)
                    stats["released"] += 1
                    continue
                store.attempt_start(session.id, session.epoch, a.id, a.fence)
                running.append(g)
            for g in running:
                receipt = store.attempt_finish(
                    session.id, session.epoch, g.attempt.id, g.attempt.fence, _outcome(g)
                )
                stats[f"finished_{receipt.attempt_state}"] += 1
        stats["seconds"] = round(time.monotonic() - start, 2)
        return {"ok": True, "session": session.id, "stats": dict(stats), "grants": grants}
    finally:
        store.close()


def _worker_main(index: int, url: str, go: ProcessEvent, out: str) -> None:
    """Process entry point: run the loop and leave a report (or the traceback) in ``out``;
    an exception still escapes, so the exit code says so too."""
    try:
        report = _worker_loop(index, url, go)
    except BaseException:
        Path(out).write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise
    Path(out).write_text(json.dumps(report))


# --------------------------------------------------------------------------- monitor


@dataclass
class Monitor:
    """Samples ``live_attempt_counts()`` (one statement, one snapshot) in a thread and
    records every scope's peak and every sample in which a cap was exceeded."""

    store: Store
    samples: int = 0
    peaks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    violations: list[str] = field(default_factory=list)
    error: str | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="occupancy-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        assert self._thread is not None
        self._thread.join(30)
        assert not self._thread.is_alive(), "the monitor thread did not stop"

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.sample()
                self.stopping.wait(0.003)  # leave the 2 cores to the workers
        except BaseException:
            self.error = traceback.format_exc()

    def sample(self) -> None:
        count: dict[str, int] = defaultdict(int)
        for row in self.store.live_attempt_counts():
            n = int(row["n"])
            count["global"] += n
            count[f"queue:{row['queue']}"] += n
            count[f"tenant:{row['tenant']}"] += n
            count[f"session:{row['session_id']}"] += n
            count[f"handler:{row['session_id']}:{row['handler']}"] += n
        self.samples += 1
        for scope, n in count.items():
            self.peaks[scope] = max(self.peaks[scope], n)
            cap = _cap_of(scope)
            if cap is not None and n > cap:
                self.violations.append(f"sample {self.samples}: {scope} has {n} live, cap {cap}")


def _cap_of(scope: str) -> int | None:
    """The cap of a scope named as ``occupancy_replay`` and the monitor name them."""
    kind, _, name = scope.partition(":")
    if kind == "global":
        return GLOBAL_CAP
    if kind == "queue":
        return QUEUE_CAPS[name]
    if kind == "tenant":
        return TENANT_CAPS[name]
    if kind == "session":
        return SESSION_CAP
    if kind == "handler":
        return HANDLER_CAPS[name.rpartition(":")[2]]
    return None


# --------------------------------------------------------------------------- checks


def _attempt_overlaps(attempts: dict[str, list[Any]]) -> list[str]:
    """I1 by the clock: a task's attempts, ordered by claim time, must not overlap in
    ``[claimed_at, ended_at)``; an attempt still live extends to infinity.

    The attempt rows are the history an operator and the metrics read, so their
    timestamps must tell the same story as the commit order: a claim stamped before the
    previous attempt ended is reported even when the commits themselves were ordered."""
    bad = []
    for task_id, items in attempts.items():
        ordered = sorted(items, key=lambda a: (a.claimed_at, a.number))
        for before, after in itertools.pairwise(ordered):
            if before.ended_at is None or before.ended_at > after.claimed_at:
                bad.append(
                    f"I1 {task_id}: attempt {before.number} ({before.state}) "
                    f"[{before.claimed_at}, {before.ended_at}) overlaps attempt "
                    f"{after.number} claimed at {after.claimed_at}"
                )
        fences = [a.fence for a in sorted(items, key=lambda a: a.claimed_at)]
        if fences != sorted(set(fences)):
            bad.append(f"I1 {task_id}: fences not strictly increasing by claim time: {fences}")
    return bad


def _live_overlaps_in_log(events: list[dict[str, Any]]) -> list[str]:
    """I1 by the event log, in commit-consistent id order: a task never gains a live
    attempt while another of its attempts is live."""
    live: dict[str, set[str]] = defaultdict(set)
    bad = []
    for e in events:
        tid, aid = e["task_id"], e["attempt_id"]
        if tid is None or aid is None or e["attempt_to"] is None:
            continue
        if e["attempt_from"] in LIVE:
            live[tid].discard(aid)
        if e["attempt_to"] in LIVE:
            live[tid].add(aid)
            if len(live[tid]) > 1:
                bad.append(f"I1 {tid}: event {e['id']} makes {sorted(live[tid])} live at once")
    return bad


def _bounded(what: str, deadline: float, fn: Callable[[float], object]) -> None:
    """Call ``fn`` with the seconds left before ``deadline``; fail if none are left."""
    left = deadline - time.monotonic()
    if left <= 0:
        pytest.fail(f"out of time while {what}")
    fn(left)


def _print_figures(
    tasks: int,
    elapsed: float,
    reports: list[dict[str, Any]],
    granted: list[list[Any]],
    peaks: dict[str, int],
    monitor: Monitor,
) -> None:
    """The run's figures (shown with ``-s``), printed before any assertion so that a
    failing run still says how much contention it produced."""
    stats: dict[str, int] = defaultdict(int)
    for r in reports:
        for k, v in r["stats"].items():
            if k != "seconds":
                stats[k] += v
    print(
        f"\n{tasks} tasks, {WORKERS} processes, {len(granted)} attempts, "
        f"{elapsed:.1f} s of work; {monitor.samples} monitor samples"
    )
    print(f"worker totals: {dict(stats)}")
    print(
        f"caps: global {GLOBAL_CAP}, queues {QUEUE_CAPS}, tenants {TENANT_CAPS}, "
        f"session {SESSION_CAP}, handlers per session {HANDLER_CAPS}"
    )
    for name, seen in (("event-log", peaks), ("monitor", monitor.peaks)):
        shared = {
            s: n for s, n in sorted(seen.items()) if s.startswith(("global", "queue:", "tenant:"))
        }
        per_session = max((n for s, n in seen.items() if s.startswith("session:")), default=0)
        print(f"{name} peaks: {shared}, busiest session {per_session}")


# --------------------------------------------------------------------------- the test


def _setup(store: Store) -> dict[str, tuple[str, int]]:
    """Queues, caps and tasks; returns each task's plan by id."""
    for name, cap in QUEUE_CAPS.items():
        store.queue_create(name, max_concurrency=cap, rate=0)
    for tenant, cap in TENANT_CAPS.items():
        store.tenant_limit_set(tenant, cap)
    store.global_limit_set(GLOBAL_CAP)
    specs = []
    i = 0
    for _ in range(TASKS_PER_CELL):
        for queue in QUEUE_CAPS:
            for tenant in TENANT_CAPS:
                for handler in HANDLER_CAPS:
                    plan, k = _plan_for(i)
                    specs.append(
                        TaskSpec(
                            queue=queue,
                            handler=handler,
                            tenant=tenant,
                            payload={"i": i, "plan": plan, "k": k},
                            max_attempts=MAX_ATTEMPTS,
                            backoff=FAST_BACKOFF,
                            retry_safe=i % 2 == 0,
                        )
                    )
                    i += 1
    rng = random.Random(7)
    rng.shuffle(specs)  # interleave queues, tenants and plans in claim order
    plans: dict[str, tuple[str, int]] = {}
    for n in range(0, len(specs), 100):
        for sub, spec in zip(
            store.task_submit_many(specs[n : n + 100]), specs[n : n + 100], strict=True
        ):
            plans[sub.task.id] = (spec.payload["plan"], spec.payload["k"])
    return plans


@pytest.mark.postgres_only
def test_many_processes_respect_every_cap_and_never_double_claim(tmp_path: Path) -> None:
    """Eight worker processes drain 320 tasks through overlapping caps; afterwards every
    task has the outcome its plan dictates, no task ever had two live attempts, and no
    cap (global, queue, tenant, session, handler) was exceeded at any sampled moment or
    anywhere in the event log."""
    overall = time.monotonic() + STARTUP_BUDGET_S + WORKER_BUDGET_S + 30
    ctx = multiprocessing.get_context("spawn")
    with temporary_database("orbit_conc") as dsn:
        url = as_url(dsn)
        store = open_store(url)
        monitor_store = open_store(url, migrate=False)
        procs: list[BaseProcess] = []
        monitor: Monitor | None = None
        try:
            plans = _setup(store)
            go = ctx.Event()
            outs = [tmp_path / f"worker-{i}.json" for i in range(WORKERS)]
            for i in range(WORKERS):
                proc = ctx.Process(
                    target=_worker_main, args=(i, url, go, str(outs[i])), name=f"orbit-worker-{i}"
                )
                proc.start()
                procs.append(proc)
            # Release the workers once every one of them has a session (or died trying).
            startup = time.monotonic() + STARTUP_BUDGET_S
            while len(store.session_list()) < WORKERS:
                if time.monotonic() > startup or any(p.exitcode is not None for p in procs):
                    break
                time.sleep(0.05)
            monitor = Monitor(monitor_store)
            monitor.start()
            began = time.monotonic()
            go.set()
            for p in procs:
                _bounded("waiting for the workers", overall, p.join)
            elapsed = time.monotonic() - began
            monitor.stop()
            monitor.sample()  # and one more at rest
        finally:
            if monitor is not None:
                monitor.stopping.set()
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
            monitor_store.close()

        assert monitor is not None
        try:
            reports = []
            for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
                report = json.loads(out.read_text()) if out.exists() else None
                if p.exitcode != 0 or report is None or not report["ok"]:
                    detail = report["error"] if report else "(no report written)"
                    pytest.fail(f"worker {i} exited with {p.exitcode}:\n{detail}")
                reports.append(report)
            assert monitor.error is None, monitor.error
            events = all_events(store)
            negatives, peaks = occupancy_replay(events)
            granted = [g for r in reports for g in r["grants"]]
            _print_figures(len(plans), elapsed, reports, granted, peaks, monitor)

            assert monitor.violations == [], monitor.violations[:20]

            # Every task ended as its plan says, with exactly the attempts it needed.
            wrong = []
            for task_id, (plan, k) in plans.items():
                t = store.task_get(task_id)
                want = _expected(plan, k)
                got = (str(t.state), t.attempts_used, t.error_code)
                if got != want:
                    wrong.append(f"{task_id} ({plan} {k}): {got} != {want}")
                elif t.state == "succeeded" and json.loads(t.result or "null") != {
                    "i": json.loads(t.payload)["i"]
                }:
                    wrong.append(f"{task_id}: result {t.result} is not its own")
            assert wrong == [], wrong[:20]

            # I1: by the attempt rows' clock intervals, by the event log, and by the
            # grants the workers received (each attempt handed to exactly one worker).
            attempts = {tid: store.attempt_list(tid) for tid in plans}
            assert _attempt_overlaps(attempts) == []
            assert _live_overlaps_in_log(events) == []
            assert len({g[0] for g in granted}) == len(granted), "an attempt granted twice"
            stored = {
                (a.id, a.task_id, a.fence, a.session_id)
                for items in attempts.values()
                for a in items
            }
            assert {tuple(g) for g in granted} == stored

            # I4 by the event log: replayed permits never exceed any cap.
            assert negatives == []
            over = {
                s: (n, _cap_of(s))
                for s, n in peaks.items()
                if (c := _cap_of(s)) is not None and n > c
            }
            assert over == {}
            assert store.live_attempt_counts() == []

            caps: dict[str, Any] = {"global": GLOBAL_CAP}
            caps.update({f"tenant:{t}": c for t, c in TENANT_CAPS.items()})
            assert check_all(store, caps=caps) == []

            # The caps must actually have been contended, or the test proves nothing.
            assert peaks["global"] == GLOBAL_CAP, peaks
        finally:
            store.close()
