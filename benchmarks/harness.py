"""The harness: every registered system, the same workloads, alternating run by run.

For each workload, run 1 goes through every system in registry order, then run 2, and so
on (A B C A B C …), so that a drift of the machine over time (other load, a warming page
cache, a growing WAL) is spread over every system instead of landing on one. Each run
writes one raw JSON file; ``summary.json`` aggregates them (see :mod:`benchmarks.summary`).

The registry names systems by module path, so this file (and the smoke test, which runs
everything registered) imports nothing of a peer until it runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from benchmarks import summary as summarise
from benchmarks.scale import Scale
from benchmarks.systems.base import Env, System
from benchmarks.workloads import WORKLOADS, RunContext

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PG_DSN = os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
DEFAULT_REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379")
PG_SETTINGS = (
    "autovacuum",
    "fsync",
    "synchronous_commit",
    "shared_buffers",
    "max_connections",
    "max_wal_size",
    "work_mem",
    "wal_level",
)


@dataclass(frozen=True)
class Entry:
    """One registered system: where its class lives and how to construct it."""

    key: str  # the name in file names, tables and plots
    module: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    #: why the backlog workload does not apply, or None when it does
    backlog_skip: str | None = None
    #: the system keeps its queue in Redis (it gets a Redis database of its own)
    redis: bool = False

    def load(self) -> System:
        """Import the module and construct its one System subclass."""
        module = importlib.import_module(self.module)
        classes = [
            obj
            for obj in vars(module).values()
            if inspect.isclass(obj)
            and issubclass(obj, System)
            and obj is not System
            and obj.__module__ == module.__name__
            and not inspect.isabstract(obj)
        ]
        if len(classes) != 1:
            raise RuntimeError(f"{self.module} defines {len(classes)} System classes, not 1")
        return classes[0](**dict(self.kwargs))


_CELERY_BACKLOG = (
    "Celery's Redis broker keeps a queue as one Redis list, read from its head in O(1): "
    "there is no table and no claim statement whose cost grows with the backlog"
)

REGISTRY: list[Entry] = [
    Entry("orbit-pg", "benchmarks.systems.orbit_system", (("backend", "postgres"),)),
    Entry("orbit-sqlite", "benchmarks.systems.orbit_system", (("backend", "sqlite"),)),
    Entry(
        "orbit-pg-tuned",
        "benchmarks.systems.orbit_system",
        (("backend", "postgres"), ("profile", "tuned")),
    ),
    Entry(
        "orbit-sqlite-tuned",
        "benchmarks.systems.orbit_system",
        (("backend", "sqlite"), ("profile", "tuned")),
    ),
    Entry("procrastinate", "benchmarks.systems.procrastinate_system", (("profile", "defaults"),)),
    Entry(
        "procrastinate-tuned", "benchmarks.systems.procrastinate_system", (("profile", "tuned"),)
    ),
    Entry("pgqueuer", "benchmarks.systems.pgqueuer_system", (("profile", "defaults"),)),
    Entry("pgqueuer-tuned", "benchmarks.systems.pgqueuer_system", (("profile", "tuned"),)),
    Entry(
        "celery",
        "benchmarks.systems.celery_system",
        (("profile", "defaults"),),
        backlog_skip=_CELERY_BACKLOG,
        redis=True,
    ),
    Entry(
        "celery-tuned",
        "benchmarks.systems.celery_system",
        (("profile", "tuned"),),
        backlog_skip=_CELERY_BACKLOG,
        redis=True,
    ),
]


def entries(keys: list[str] | None) -> list[Entry]:
    if not keys:
        return list(REGISTRY)
    known = {e.key: e for e in REGISTRY}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {', '.join(known)}")
    return [known[k] for k in keys]


def workload_names(names: list[str] | None) -> list[str]:
    """The requested workloads in canonical order (backlog always last)."""
    if not names:
        return list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    return [w for w in WORKLOADS if w in names]


@dataclass
class Options:
    runs: int
    scale: Scale
    out: Path
    systems: list[str] | None = None
    workloads: list[str] | None = None
    pg_dsn: str = DEFAULT_PG_DSN
    redis_url: str = DEFAULT_REDIS
    redis_db_base: int = 1
    physical: bool = True
    parallel: bool = False  # smoke checks only: systems side by side, numbers meaningless
    keep_records: bool = False
    log: Callable[[str], None] = print


@dataclass
class Slot:
    """One system for the whole invocation: its instance and what persists across runs."""

    entry: Entry
    system: System | None = None
    error: str | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    workload: str
    run: int
    key: str
    phase: str = ""

    @property
    def file(self) -> str:
        return f"{self.workload}-{self.key}-{self.run}.json"


def plan(workloads: list[str], keys: list[str], runs: int) -> list[Step]:
    """Every step in execution order; the backlog's two halves each alternate on their own
    (all "small" runs first, then the large backlog is filled once and kept)."""
    steps: list[Step] = []
    for w in workloads:
        phases = ["small", "large"] if w == "backlog" else [""]
        for phase in phases:
            for run in range(1, runs + 1):
                steps.extend(Step(w, run, k, phase) for k in keys)
    return steps


# ---------------------------------------------------------------------- invocation metadata


def _git() -> dict[str, Any]:
    def out(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": out("rev-parse", "HEAD"), "dirty": bool(out("status", "--porcelain"))}


def _postgres(dsn: str) -> dict[str, Any]:
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as cx:
            version = cx.execute("SHOW server_version").fetchone()
            rows = cx.execute(
                "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s)",
                [list(PG_SETTINGS)],
            ).fetchall()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "version": version[0] if version else None,
        "settings": {name: f"{value}{unit or ''}" for name, value, unit in rows},
    }


def _redis(url: str) -> dict[str, Any]:
    try:
        import redis

        info = redis.Redis.from_url(url, socket_timeout=5).info("server")
        return {"version": info.get("redis_version")}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def host() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": model,
        "cpu_count": psutil.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def run_physical(opts: Options) -> dict[str, Any]:
    """PostgreSQL's own ceiling on Orbit's tables (benchmarks.physical, imported late:
    the harness works, and says so in the summary, when that module is absent)."""
    s = opts.scale
    args = {
        "batch": s.physical_batch,
        "clients": list(s.physical_clients),
        "seconds": s.physical_seconds,
        "backlog": s.physical_backlog,
        "submit_batch": s.physical_submit_batch,
        "commits": s.physical_commits,
    }
    try:
        physical = importlib.import_module("benchmarks.physical")
        t0 = time.time()
        result = physical.measure(opts.pg_dsn, **args)
        return {"args": args, "seconds": time.time() - t0, "result": result}
    except Exception as exc:
        return {"args": args, "error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------- running


class Harness:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.slots = [Slot(e) for e in entries(opts.systems)]
        self.workloads = workload_names(opts.workloads)
        self.runs_dir = opts.out / "runs"
        self.work_dir = opts.out / "work"
        self._lock = threading.Lock()

    def log(self, text: str) -> None:
        with self._lock:
            self.opts.log(f"{time.strftime('%H:%M:%S')} {text}")

    def run(self) -> dict[str, Any]:
        opts = self.opts
        if any(self.runs_dir.glob("*.json")):
            # the summary aggregates every file there: never mix two invocations
            raise FileExistsError(f"{self.runs_dir} already holds runs; choose a new --out")
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        started = datetime.now(UTC)
        meta: dict[str, Any] = {
            "started_at": started.isoformat(),
            "argv": sys.argv,
            "runs": opts.runs,
            "scale": opts.scale.as_dict(),
            "workloads": self.workloads,
            "systems": [s.entry.key for s in self.slots],
            "parallel": opts.parallel,
            "order": "alternating: for each workload, run 1 of every system, then run 2, …",
            "host": host(),
            "postgres": _postgres(opts.pg_dsn),
            "redis": _redis(opts.redis_url),
            "git": _git(),
        }
        physical: dict[str, Any] = {}

        def measure_physical() -> None:
            self.log("physical limit (benchmarks.physical.measure) …")
            physical.update(run_physical(opts))
            self.log(f"  physical limit: {physical.get('error') or 'done'}")

        # Alone before everything else, so nothing disturbs it; beside the systems only
        # in a parallel (smoke) run, whose numbers mean nothing anyway.
        beside = threading.Thread(target=measure_physical, name="bench-physical")
        if opts.physical and not opts.parallel:
            measure_physical()
        elif opts.physical:
            beside.start()
        try:
            steps = plan(self.workloads, [s.entry.key for s in self.slots], opts.runs)
            if opts.parallel:
                self._run_parallel(steps)
            else:
                self._prepare_all()
                for step in steps:
                    self._step(step)
        finally:
            if beside.is_alive():
                beside.join()
            self._close_all()
        meta["finished_at"] = datetime.now(UTC).isoformat()
        meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        result = summarise.build(self.runs_dir, meta, physical or None, self._descriptions())
        (opts.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    def _descriptions(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for slot in self.slots:
            d: dict[str, Any] = {"module": slot.entry.module, "kwargs": dict(slot.entry.kwargs)}
            if slot.system is not None:
                d.update(
                    name=slot.system.name,
                    profile=slot.system.profile,
                    uses_postgres=slot.system.uses_postgres,
                    versions=_safe(slot.system.versions),
                    settings=_safe(slot.system.settings),
                    recovery_note=_safe(slot.system.recovery_note),
                    recovery_settings=_safe(slot.system.recovery_settings),
                )
            if slot.entry.backlog_skip:
                d["backlog_skipped"] = slot.entry.backlog_skip
            for key in ("prepare_s", "backlog_fill"):
                if key in slot.state:
                    d[key] = slot.state[key]
            if slot.error:
                d["error"] = slot.error
            found[slot.entry.key] = d
        return found

    def _prepare_all(self) -> None:
        for i, slot in enumerate(self.slots):
            self._prepare(i, slot)

    def _redis_db(self, i: int) -> int:
        """A Redis database of its own for each system that uses Redis (Redis has 16 by
        default, fewer than the registry's entries, so PostgreSQL systems take none)."""
        return self.opts.redis_db_base + sum(1 for s in self.slots[:i] if s.entry.redis)

    def _prepare(self, i: int, slot: Slot) -> None:
        key = slot.entry.key
        env = Env(
            pg_admin_dsn=self.opts.pg_dsn,
            redis_url=f"{self.opts.redis_url.rstrip('/')}/{self._redis_db(i)}",
            work_dir=(self.work_dir / key).resolve(),
        )
        env.work_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"prepare {key} …")
        t0 = time.time()
        try:
            slot.system = slot.entry.load()
            slot.system.prepare(env)
        except Exception:
            slot.error = traceback.format_exc()
            self.log(f"  {key} unavailable: {slot.error.strip().splitlines()[-1]}")
        else:
            slot.state["prepare_s"] = round(time.time() - t0, 3)
            self.log(f"  {key} prepared in {slot.state['prepare_s']:.1f} s")

    def _close_all(self) -> None:
        for slot in self.slots:
            if slot.system is not None:
                try:
                    slot.system.close()
                except Exception:
                    self.log(f"close {slot.entry.key} failed:\n{traceback.format_exc()}")

    def _run_parallel(self, steps: list[Step]) -> None:
        """One thread per system: prepare it, then go through its own steps in order."""

        def one(i: int, slot: Slot) -> None:
            self._prepare(i, slot)
            for step in steps:
                if step.key == slot.entry.key:
                    self._step(step)

        threads = [
            threading.Thread(target=one, args=(i, slot), name=f"bench-{slot.entry.key}")
            for i, slot in enumerate(self.slots)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _step(self, step: Step) -> None:
        slot = next(s for s in self.slots if s.entry.key == step.key)
        path = self.runs_dir / step.file
        label = f"{step.workload}{'/' + step.phase if step.phase else ''} {step.key} #{step.run}"
        record: dict[str, Any] = _read(path) if step.phase == "large" else {}
        record.update(
            workload=step.workload,
            system=step.key,
            run=step.run,
            scale=self.opts.scale.name,
        )
        if slot.system is None:
            record["error"] = f"system unavailable: {slot.error}"
            _write(path, record)
            return
        system = slot.system
        record.update(name=system.name, profile=system.profile)
        if step.workload == "backlog" and slot.entry.backlog_skip:
            record["skipped"] = slot.entry.backlog_skip
            _write(path, record)
            return
        if step.phase == "large" and (record.get("error") or slot.state.get("backlog_broken")):
            return  # no large-backlog numbers after a failed small run or a failed fill
        ctx = RunContext(
            system=system,
            scale=self.opts.scale,
            run=step.run,
            rec_root=self.work_dir / step.key / "records" / step.workload,
            state=slot.state,
            phase=step.phase,
            keep_records=self.opts.keep_records,
            pg_dsn=self.opts.pg_dsn if system.uses_postgres else None,
        )
        self.log(f"{label} …")
        t0 = time.time()
        try:
            outcome = WORKLOADS[step.workload](ctx)
        except Exception:
            record["error"] = traceback.format_exc()
            if step.phase == "large":
                slot.state["backlog_broken"] = True
            self.log(f"  {label} FAILED: {record['error'].strip().splitlines()[-1]}")
        else:
            record.setdefault("metrics", {}).update(outcome.metrics)
            detail = record.setdefault("detail", {})
            detail.update(outcome.detail)
            self.log(f"  {label}: {_brief(outcome.metrics)}")
        finally:
            ctx.cleanup()
        record.setdefault("wall_s", {})[step.phase or "run"] = round(time.time() - t0, 3)
        record.setdefault("cpu", {}).update(ctx.cpu)
        record.setdefault("started_at", datetime.fromtimestamp(t0, UTC).isoformat())
        record["versions"] = _safe(system.versions)
        record["settings"] = _safe(system.settings)
        _write(path, record)


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _brief(metrics: dict[str, float | None]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, int | float) else f"{k}={v}" for k, v in metrics.items()
    )


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
