"""The six workloads, written once against :class:`benchmarks.systems.base.System`.

Each workload function takes a :class:`RunContext` (one system, one run) and returns an
:class:`Outcome`: the numbers the summary aggregates (``metrics``, floats or None) and
everything else worth keeping raw (``detail``). All times are ``time.time()`` seconds,
the clock the handlers' records use too.

"Last finish" is the moment the system itself records the last job as done: the first
poll at which ``done_count()`` has grown by N. To keep those polls off the database
until they matter, the handlers' own records (cheap file reads, every ``Scale.poll_s``) are
watched first, and ``done_count()`` is polled at the same pace only once the handlers
have finished all N (a job's record is always written before the system records the
job done, so this never delays the observation). A system without a durable completion
record (``done_count() == -1``) is finished when the records are.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.cpu import CpuSampler
from benchmarks.recorder import Record, RecordReader
from benchmarks.scale import Scale
from benchmarks.systems.base import Job, System, WorkerSpec
from benchmarks.wal import WalMeter

POLL_S = 0.015  # the default; each scale sets its own
Metrics = dict[str, float | None]


class RunFailed(Exception):
    """The run could not measure what it set out to (timed out, workers died)."""


@dataclass
class Outcome:
    metrics: Metrics
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunContext:
    """What a workload needs for one run of one system."""

    system: System
    scale: Scale
    run: int
    rec_root: Path  # this system's records directory; one fresh subdirectory per phase
    state: dict[str, Any]  # kept across runs of this system (the backlog lives here)
    phase: str = ""  # the backlog workload's "small" or "large" half
    keep_records: bool = False
    #: PostgreSQL to read the WAL statistics from (None: the system does not use it)
    pg_dsn: str | None = None
    #: processes of other systems (their idle servers), left out of this run's CPU
    foreign_pids: Callable[[], Iterable[int]] = tuple
    cpu: dict[str, Any] = field(default_factory=dict)
    _dirs: list[Path] = field(default_factory=list)

    def rec_dir(self, name: str) -> Path:
        path = self.rec_root / f"run{self.run}-{name}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        self._dirs.append(path)
        return path

    @contextlib.contextmanager
    def sampled(self, name: str, *, periodic: bool = True) -> Iterator[None]:
        """Sample host CPU over the block, and the WAL PostgreSQL wrote in it (for a system
        that uses PostgreSQL); the result is kept under ``cpu[name]`` (the WAL under its
        ``"wal"``). ``periodic=False``: readings at the start and the end only, never the
        scale's sampling thread (``latency``: why). Only the system under test's
        processes count among the harness's children: another system's idle server
        (``foreign_pids``) is left out."""
        sampler = CpuSampler(
            self.scale.cpu_interval_s if periodic else 0.0, exclude=set(self.foreign_pids())
        )
        wal = WalMeter(self.pg_dsn) if self.pg_dsn else contextlib.nullcontext()
        with wal, sampler:
            yield
        self.cpu[name] = sampler.result
        if isinstance(wal, WalMeter):
            self.cpu[name]["wal"] = wal.result

    def cleanup(self) -> None:
        if not self.keep_records:
            for path in self._dirs:
                shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- helpers


def make_jobs(prefix: str, n: int, kind: str = "noop", **extra: Any) -> list[Job]:
    t = time.time()
    return [{"id": f"{prefix}-{i}", "t": t, "kind": kind, **extra} for i in range(n)]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]): always a value that was measured."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Finish:
    """When the last of a set of jobs was done, and what the records say about them."""

    t_last: float  # first poll that saw all of them done (see the module docstring)
    records: dict[str, Record]  # job id -> its first F record
    durable: bool  # True if t_last comes from done_count(), False if from the records

    @property
    def first_start(self) -> float:
        return min(r.started for r in self.records.values())

    @property
    def last_record(self) -> float:
        return max(r.ended or r.started for r in self.records.values())


def wait_done(
    system: System,
    reader: RecordReader,
    *,
    ids: set[str] | None,
    need: int,
    base: int,
    timeout: float,
    procs: list[subprocess.Popen[bytes]] | None = None,
    poll: float = POLL_S,
) -> Finish:
    """Wait until ``need`` jobs (those in ``ids``, or any job if None) are done.

    ``base`` is ``done_count()`` before the jobs could start (-1: not supported)."""
    found: dict[str, Record] = {}
    deadline = time.time() + timeout
    next_check = 0.0
    fresh = list(reader.records)  # records an earlier wait has already read count too
    while True:
        now = time.time()
        for r in [*fresh, *reader.poll()]:
            if r.kind == "F" and (ids is None or r.job_id in ids):
                found.setdefault(r.job_id, r)
        fresh = []
        if len(found) >= need:
            if base < 0:
                return Finish(now, found, durable=False)
            t_query = time.time()
            if system.done_count() - base >= need:
                return Finish(t_query, found, durable=True)
        if now > deadline:
            raise RunFailed(f"timed out after {timeout:g} s with {len(found)}/{need} jobs done")
        if procs and now > next_check:
            next_check = now + 0.5
            if all(p.poll() is not None for p in procs):
                codes = [p.returncode for p in procs]
                raise RunFailed(f"every worker exited ({codes}) with {len(found)}/{need} done")
        time.sleep(poll)


def wait_record(
    reader: RecordReader, job_id: str, kind: str, timeout: float, poll: float = POLL_S
) -> Record | None:
    """The first record of ``kind`` for one job, or None after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        reader.poll()
        for r in reversed(reader.records):
            if r.job_id == job_id and r.kind == kind:
                return r
        time.sleep(poll)
    return None


@contextlib.contextmanager
def running(system: System, spec: WorkerSpec) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start workers and always stop them, even when the measurement fails or the start
    itself is interrupted part-way: the list is this caller's, and ``start_workers``
    appends each worker to it as soon as it runs (the one way every workload starts
    workers)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        system.start_workers(spec, procs)
        yield procs
    finally:
        system.stop_workers(procs)


def kill_tree(proc: subprocess.Popen[bytes]) -> tuple[list[int], float]:
    """SIGKILL a worker and every process under it, and confirm all are gone.

    A worker may run its jobs in child processes (a prefork pool): killing only the
    parent would leave the children holding the jobs, which is not a dead worker.
    Returns the pids killed and ``t_kill``, the ``time.time()`` just before the first
    ``os.kill``: the moment the worker died, and the recovery clock's start (reaping and
    the confirmation come after it and must not count as recovery time)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    t_kill = time.time()
    for pid in [proc.pid, *(k.pid for k in kids)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)  # waitpid: the victim itself is reaped
    _, alive = psutil.wait_procs(kids, timeout=10)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if alive:
        raise RunFailed(f"processes survived SIGKILL: {[p.pid for p in alive]}")
    return [proc.pid, *(k.pid for k in kids)], t_kill


@contextlib.contextmanager
def launched(
    ctx: RunContext, spec: WorkerSpec, cpu: str | None
) -> Iterator[tuple[list[subprocess.Popen[bytes]], float]]:
    """Start workers (and the launch time) and always stop them, like ``running``; with
    ``cpu``, inside a CPU and WAL window (``RunContext.sampled``) that opens just before
    the launch and closes when the block ends, before the workers are stopped: a drain's
    window ends at its last finish, and the workers' shutdown is not counted."""
    procs: list[subprocess.Popen[bytes]] = []  # filled as each starts (``running``)
    try:
        with ctx.sampled(cpu) if cpu else contextlib.nullcontext():
            t_launch = time.time()
            ctx.system.start_workers(spec, procs)
            yield procs, t_launch
    finally:
        ctx.system.stop_workers(procs)


def drain(
    ctx: RunContext,
    jobs: list[Job],
    spec: WorkerSpec,
    *,
    ids: set[str] | None = None,
    cpu: str | None = None,
) -> dict[str, Any]:
    """Start workers on an already filled queue and time them until the jobs are done;
    with ``cpu``, sample the CPU from the launch to the last finish (``launched``).

    Returns tasks/s from the first job's start to the last finish, and from launching
    the worker processes (so start-up counts) to the last finish."""
    system = ctx.system
    base = system.done_count()
    reader = RecordReader(spec.rec_dir)
    n = len(jobs)
    with launched(ctx, spec, cpu) as (procs, t_launch):
        done = wait_done(
            system,
            reader,
            ids={j["id"] for j in jobs} if ids is None else ids,
            need=n,
            base=base,
            timeout=ctx.scale.timeout_s,
            procs=procs,
            poll=ctx.scale.poll_s,
        )
    busy = done.t_last - done.first_start
    return {
        "jobs": n,
        "tasks_per_s": n / busy if busy > 0 else None,
        "tasks_per_s_incl_startup": n / (done.t_last - t_launch),
        "startup_s": done.first_start - t_launch,
        "t_launch": t_launch,
        "t_first_start": done.first_start,
        "t_last_finish": done.t_last,
        "t_last_record": done.last_record,
        "durable_lag_s": done.t_last - done.last_record,
        "finish_from": "done_count" if done.durable else "handler records",
        "processes": spec.processes,
        "concurrency": spec.concurrency,
    }


def timed_enqueue(system: System, jobs: list[Job], batch: int) -> float:
    """Seconds one ``System.enqueue`` call took; the statistics are then brought up to date
    (``System.settle``), untimed."""
    t0 = time.perf_counter()
    system.enqueue(jobs, batch)
    seconds = time.perf_counter() - t0
    system.settle()
    return seconds


# ---------------------------------------------------------------------- workloads


def throughput(ctx: RunContext) -> Outcome:
    """N pre-enqueued no-op jobs drained by 1, then (after a reset) by 2 worker processes."""
    s, metrics, detail = ctx.scale, {}, {}
    for procs in s.throughput_processes:
        key = f"w{procs}"
        ctx.system.reset()
        jobs = make_jobs(f"tp{ctx.run}{key}", s.throughput_jobs)
        enqueue_s = timed_enqueue(ctx.system, jobs, s.batch)
        spec = WorkerSpec(procs, s.worker_concurrency, ctx.rec_dir(key))
        result = drain(ctx, jobs, spec, cpu=key)
        result["enqueue_s"] = enqueue_s
        detail[key] = result
        metrics[f"{key}_tasks_per_s"] = result["tasks_per_s"]
        metrics[f"{key}_tasks_per_s_incl_startup"] = result["tasks_per_s_incl_startup"]
        metrics[f"{key}_startup_s"] = result["startup_s"]
    return Outcome(metrics, detail)


def enqueue(ctx: RunContext) -> Outcome:
    """Jobs/s through the system's client: one job per call, then ``batch`` per call."""
    s = ctx.scale
    ctx.system.reset()
    one = make_jobs(f"eq{ctx.run}one", s.enqueue_one_jobs)
    with ctx.sampled("one"):
        one_s = timed_enqueue(ctx.system, one, 1)
    ctx.system.reset()
    many = make_jobs(f"eq{ctx.run}batch", s.enqueue_batch_jobs)
    with ctx.sampled("batch"):
        batch_s = timed_enqueue(ctx.system, many, s.batch)
    ctx.system.reset()
    return Outcome(
        {"one_jobs_per_s": len(one) / one_s, "batch_jobs_per_s": len(many) / batch_s},
        {
            "one": {"jobs": len(one), "seconds": one_s},
            "batch": {"jobs": len(many), "seconds": batch_s, "batch": s.batch},
        },
    )


def _warm_up(ctx: RunContext, reader: RecordReader, name: str, timeout: float) -> dict[str, Any]:
    """Send one job and wait for its record: proof that a worker is up and claiming."""
    job = make_jobs(f"warm{ctx.run}{name}", 1)[0]
    job["t"] = time.time()
    ctx.system.enqueue_one(job)
    rec = wait_record(reader, job["id"], "F", timeout, ctx.scale.poll_s)
    return {"id": job["id"], "ready": rec is not None, "after_s": time.time() - job["t"]}


def _paced(system: System, ids: list[str], rate: float) -> tuple[list[float], list[float]]:
    """Submit one job per id, one call each, on a fixed schedule of ``rate`` per second;
    each job carries ``time.time()`` taken just before its call. Returns every call's
    duration and every slip behind the schedule (seconds)."""
    calls: list[float] = []
    slips: list[float] = []
    t0 = time.perf_counter()
    for i, job_id in enumerate(ids):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        slips.append(max(0.0, time.perf_counter() - due))
        job = {"id": job_id, "t": time.time(), "kind": "noop"}
        c0 = time.perf_counter()
        system.enqueue_one(job)
        calls.append(time.perf_counter() - c0)
    return calls, slips


def latency(ctx: RunContext) -> Outcome:
    """Enqueue→start of jobs submitted one at a time at a fixed rate to idle workers.

    1. One job proves the worker is up and claiming (the run fails without its record).
    2. ``Scale.latency_warm_up_jobs`` untimed jobs at the workload's rate, and the wait
       for all of their records: the first tasks after the harness's reset pay for it (a
       statement's first runs on each pooled connection, cold caches), which is not the
       steady state this workload measures (``benchmarks.scale.LATENCY_WARM_UP``). Their
       latencies are kept under ``detail["warm_up"]``, never in the samples; the
       readiness job of step 1 under ``detail["ready"]``.
    3. The timed jobs, ``Scale.latency_jobs`` at ``Scale.latency_rate``.

    Its CPU is read at the start and the end of the paced phase only: the sampler's
    thread runs in this process, the client's, and once a second it scans every process
    on the machine (``benchmarks.cpu``, 3-6 ms of CPU and of this process's GIL), which
    the job in flight then waited for. With it, the jobs whose path overlapped a scan
    took 9.2 ms at the median against 5.3 for all (Orbit, 1,000 jobs at 100/s), and they
    were half of the ten slowest jobs that set the p99 (docs/benchmarks/history.md, the fixes
    table). The readings at the ends still count every process's CPU over the phase,
    and the host's busy share as its mean."""
    s, system = ctx.scale, ctx.system
    system.reset()
    base = system.done_count()
    rec_dir = ctx.rec_dir("lat")
    reader = RecordReader(rec_dir)
    ids: list[str] = [f"lat{ctx.run}-{i}" for i in range(s.latency_jobs)]
    warm_ids: list[str] = [f"warm{ctx.run}paced-{i}" for i in range(s.latency_warm_up_jobs)]
    with running(system, WorkerSpec(1, s.worker_concurrency, rec_dir)) as procs:
        ready = _warm_up(ctx, reader, "lat", s.ready_timeout_s)
        if not ready["ready"]:
            raise RunFailed(f"the worker ran no warm-up job in {s.ready_timeout_s:g} s")
        warm_calls, _ = _paced(system, warm_ids, s.latency_rate)
        warm_done = wait_done(
            system,
            reader,
            ids=set(warm_ids),
            need=len(warm_ids),
            base=-1,  # the handlers' records: the final wait counts these jobs as done
            timeout=s.ready_timeout_s,
            procs=procs,
            poll=s.poll_s,
        )
        time.sleep(0.2)  # let the worker settle back into waiting
        with ctx.sampled("lat", periodic=False):
            calls, slips = _paced(system, ids, s.latency_rate)
            done = wait_done(
                system,
                reader,
                ids={*ids, ready["id"], *warm_ids},
                need=len(ids) + 1 + len(warm_ids),
                base=base,
                timeout=s.timeout_s,
                procs=procs,
                poll=s.poll_s,
            )
    lat_ms = [(done.records[i].started - done.records[i].enqueued) * 1000 for i in ids]
    warm_ms = [
        (warm_done.records[i].started - warm_done.records[i].enqueued) * 1000 for i in warm_ids
    ]
    warm = {
        "jobs": len(warm_ids),
        "rate_per_s": s.latency_rate,
        "latencies_ms": [round(v, 3) for v in warm_ms],
        "enqueue_call_ms_max": max(warm_calls) * 1000 if warm_calls else None,
    }
    return Outcome(
        {
            "p50_ms": percentile(lat_ms, 50),
            "p99_ms": percentile(lat_ms, 99),
            "max_ms": max(lat_ms),
            "mean_ms": sum(lat_ms) / len(lat_ms),
        },
        {
            "jobs": len(ids),
            "rate_per_s": s.latency_rate,
            "ready": ready,
            "warm_up": warm,
            "latencies_ms": [round(v, 3) for v in lat_ms],
            "enqueue_call_ms": {
                "p50": percentile(calls, 50) * 1000,
                "p99": percentile(calls, 99) * 1000,
                "max": max(calls) * 1000,
            },
            "schedule_slip_ms_max": max(slips) * 1000,
        },
    )


def io_bound(ctx: RunContext) -> Outcome:
    """Jobs that each sleep, many at once in one process (the system's I/O-bound mode)."""
    s = ctx.scale
    ctx.system.reset()
    jobs = make_jobs(f"io{ctx.run}", s.io_jobs, "sleep", ms=s.io_sleep_ms)
    enqueue_s = timed_enqueue(ctx.system, jobs, s.batch)
    spec = WorkerSpec(1, s.io_concurrency, ctx.rec_dir("io"), io_bound=True)
    result = drain(ctx, jobs, spec, cpu="io")
    result["enqueue_s"] = enqueue_s
    result["ideal_tasks_per_s"] = s.io_concurrency * 1000 / s.io_sleep_ms
    return Outcome(
        {
            "tasks_per_s": result["tasks_per_s"],
            "tasks_per_s_incl_startup": result["tasks_per_s_incl_startup"],
        },
        result,
    )


def recovery(ctx: RunContext) -> Outcome:
    """How long after a worker is SIGKILLed holding jobs until another worker has run them.

    1. A victim worker (``hold``) takes every hold job; its handler records each start
       and then sleeps for an hour.
    2. A warm-up job is sent and a rescuer worker started. The victim is full, so only the
       rescuer can run the warm-up: its record proves the rescuer is up and claiming.
    3. The victim (and any process under it) is SIGKILLed: the clock starts at the kill;
       then it is reaped and confirmed gone.
    4. The clock stops when the system records every hold job (and the warm-up) as done.
    """
    s, system = ctx.scale, ctx.system
    system.reset()
    base = system.done_count()
    n = s.recovery_jobs
    victim_dir, rescuer_dir = ctx.rec_dir("victim"), ctx.rec_dir("rescuer")
    victim_reader, reader = RecordReader(victim_dir), RecordReader(rescuer_dir)
    jobs = make_jobs(f"rc{ctx.run}", n, "hold", mark_start=True)
    hold_ids = {j["id"] for j in jobs}
    detail: dict[str, Any] = {
        "jobs": n,
        "cap_s": s.recovery_cap_s,
        "note": system.recovery_note(),
        "settings": system.recovery_settings(),
    }
    # filled as each starts (``running``): an interrupt mid-start still stops them
    victim: list[subprocess.Popen[bytes]] = []
    rescuer: list[subprocess.Popen[bytes]] = []
    try:
        system.start_workers(WorkerSpec(1, n, victim_dir, hold=True), victim)
        system.enqueue(jobs, s.batch)
        held = _wait_started(victim_reader, hold_ids, s.timeout_s, victim, s.poll_s)
        detail["held_by_victim"] = held
        system.start_workers(WorkerSpec(1, n, rescuer_dir), rescuer)
        warm = _warm_up(ctx, reader, "rescuer", s.rescuer_ready_s)
        detail["rescuer_warm_up"] = warm
        with ctx.sampled("recovery"):
            detail["killed_pids"], t_kill = kill_tree(victim[0])
            detail["t_kill"] = t_kill
            detail["kill_confirmed_after_s"] = time.time() - t_kill
            try:
                done = wait_done(
                    system,
                    reader,
                    ids={*hold_ids, warm["id"]},
                    need=n + 1,
                    base=base,
                    timeout=s.recovery_cap_s,
                    procs=rescuer,
                    poll=ctx.scale.poll_s,
                )
            except RunFailed as exc:
                reader.poll()
                finished = {r.job_id for r in reader.finished() if r.job_id in hold_ids}
                detail.update(recovered=False, done_at_cap=len(finished), why=str(exc))
                return Outcome(
                    {"recovery_s": None, "recovered": 0.0, "done": len(finished)}, detail
                )
    finally:
        system.stop_workers([p for p in victim if p.poll() is None] + rescuer)
    seconds = done.t_last - t_kill
    finish_from = "done_count" if done.durable else "handler records"
    detail.update(recovered=True, seconds=seconds, finish_from=finish_from)
    target = detail["settings"].get("target_s")
    if target is not None:
        detail["within_target"] = seconds <= float(target)
    return Outcome({"recovery_s": seconds, "recovered": 1.0, "done": float(n)}, detail)


def _wait_started(
    reader: RecordReader,
    ids: set[str],
    timeout: float,
    procs: list[subprocess.Popen[bytes]],
    poll: float,
) -> int:
    """Wait until every job in ``ids`` has a start record (all held by the victim)."""
    deadline = time.time() + timeout
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(r.job_id for r in reader.poll() if r.kind == "S" and r.job_id in ids)
        if time.time() > deadline:
            raise RunFailed(f"the victim started {len(started)}/{len(ids)} hold jobs")
        if all(p.poll() is not None for p in procs):
            raise RunFailed("the victim worker exited before holding its jobs")
        time.sleep(poll)
    return len(started)


def backlog(ctx: RunContext) -> Outcome:
    """Drain ``backlog_small`` jobs with 1 worker when only they are queued ("small"
    phase, after a reset) and when ``backlog_large`` are queued ("large" phase).

    The large backlog lives in an instance of the system of its own (its own database;
    the harness prepares it), so the two halves can alternate run by run: the "fill"
    phase queues it once, before any timed large run, then vacuums, analyses and
    checkpoints that database (``System.maintain``), and every large run tops it back up
    afterwards, never resetting it, and maintains it again (untimed), so every large run
    starts from the state the first one did.
    """
    if ctx.phase == "small":
        return _backlog_small(ctx)
    if ctx.phase == "fill":
        ctx.state["backlog_fill"] = fill = _fill(ctx, ctx.scale.backlog_large)
        return Outcome({}, {"fill": fill})
    return _backlog_large(ctx)


def _backlog_small(ctx: RunContext) -> Outcome:
    s, system = ctx.scale, ctx.system
    system.reset()
    jobs = make_jobs(f"bs{ctx.run}", s.backlog_small)
    system.enqueue(jobs, s.batch)
    system.settle()
    spec = WorkerSpec(1, s.worker_concurrency, ctx.rec_dir("small"))
    claim_ms = system.claim_statement_ms(spec)
    result = drain(ctx, jobs, spec, cpu="small")
    result.update(queued=s.backlog_small, claim_ms=claim_ms, claim_probe=system.claim_probe(spec))
    return Outcome(
        {
            "small_tasks_per_s": result["tasks_per_s"],
            "small_tasks_per_s_incl_startup": result["tasks_per_s_incl_startup"],
            "small_claim_ms": claim_ms,
        },
        {"small": result},
    )


def _backlog_large(ctx: RunContext) -> Outcome:
    s, system = ctx.scale, ctx.system
    detail: dict[str, Any] = {}
    if "backlog_fill" not in ctx.state:  # no "fill" phase ran first (the harness runs one)
        ctx.state["backlog_fill"] = detail["fill"] = _fill(ctx, s.backlog_large)
    rec_dir = ctx.rec_dir("large")
    spec = WorkerSpec(1, s.worker_concurrency, rec_dir)
    claim_ms = system.claim_statement_ms(spec)
    base = system.done_count()
    reader = RecordReader(rec_dir)
    with launched(ctx, spec, "large") as (procs, t_launch):
        done = wait_done(
            system,
            reader,
            ids=None,
            need=s.backlog_small,
            base=base,
            timeout=s.timeout_s,
            procs=procs,
            poll=ctx.scale.poll_s,
        )
    n = s.backlog_small
    reader.poll()
    drained = len({r.job_id for r in reader.finished()})
    top_up_s = timed_enqueue(system, _next_jobs(ctx, drained), s.batch)
    # Untimed, as after the fill: VACUUM ANALYZE and CHECKPOINT, so the next large run
    # starts from the state the first one did (no dead rows, no dirty pages of the last
    # drain and top-up), not only the first.
    m0 = time.perf_counter()
    maintenance = system.maintain()
    maintenance_s = round(time.perf_counter() - m0, 3)
    busy = done.t_last - done.first_start
    rate = n / busy if busy > 0 else None
    rate_incl = n / (done.t_last - t_launch)
    result = {
        "queued": s.backlog_large,
        "jobs": n,
        "tasks_per_s": rate,
        "tasks_per_s_incl_startup": rate_incl,
        "startup_s": done.first_start - t_launch,
        "claim_ms": claim_ms,
        "claim_probe": system.claim_probe(spec),
        "drained_before_stop": drained,
        "top_up_s": top_up_s,
        "maintenance": maintenance,
        "maintenance_s": maintenance_s,
        "finish_from": "done_count" if done.durable else "handler records",
    }
    detail["large"] = result
    return Outcome(
        {
            "large_tasks_per_s": rate,
            "large_tasks_per_s_incl_startup": rate_incl,
            "large_claim_ms": claim_ms,
        },
        detail,
    )


def _next_jobs(ctx: RunContext, n: int) -> list[Job]:
    """Backlog jobs with ids never used before in this system's backlog."""
    start = int(ctx.state.get("backlog_seq", 0))
    ctx.state["backlog_seq"] = start + n
    t = time.time()
    return [{"id": f"bl-{i}", "t": t, "kind": "noop"} for i in range(start, start + n)]


def _fill(ctx: RunContext, total: int) -> dict[str, Any]:
    """Empty the system, queue ``total`` jobs in batches, a chunk at a time (1M job dicts
    at once is a lot of memory for nothing), then ``System.maintain``: VACUUM ANALYZE of
    the system's own database and a CHECKPOINT, so the first timed run neither meets a
    million rows without their visibility map nor pays for the fill's dirty pages."""
    ctx.system.reset()
    chunk = 50_000
    t0 = time.perf_counter()
    left = total
    while left > 0:
        n = min(chunk, left)
        ctx.system.enqueue(_next_jobs(ctx, n), ctx.scale.batch)
        left -= n
    seconds = time.perf_counter() - t0
    m0 = time.perf_counter()
    maintenance = ctx.system.maintain()
    return {
        "jobs": total,
        "seconds": seconds,
        "jobs_per_s": total / seconds,
        "maintenance": maintenance,
        "maintenance_s": round(time.perf_counter() - m0, 3),
    }


#: every workload, in the order a run executes them (backlog last: its large queue stays)
WORKLOADS: dict[str, Callable[[RunContext], Outcome]] = {
    "throughput": throughput,
    "enqueue": enqueue,
    "latency": latency,
    "io": io_bound,
    "recovery": recovery,
    "backlog": backlog,
}
