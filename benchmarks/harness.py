"""The harness: every registered system, the same workloads, alternating run by run.

For each workload, run 1 goes through every system, then run 2, and so on, each run in
another order: a Williams design, a rotation and then the same order reversed (run 1:
A B C, run 2: C B A, run 3: B C A, run 4: A C B, …), so that a drift of the machine over
time (other load, a warming page cache, a growing WAL) is spread over every system
instead of landing on one, and over the runs each system follows each other system about
equally often instead of always the same predecessor (whose leftovers, a checkpoint or a
vacuum it set off, it would always pay for). A plain rotation (A B C, B C A, …) would not
do that: it keeps the cycle, so B would follow A in every run but one. Each run writes
one raw JSON file holding that run's order; ``summary.json`` aggregates them (see
:mod:`benchmarks.summary`).

The backlog workload keeps its large queue in a second instance of each system (a
database of its own), filled, vacuumed, analysed and checkpointed before any timed run
and maintained the same way after each top-up; each run then drains the small and the
large backlog back to back (the second half even when the first failed), so that each
run's large/small ratio is measured close in time (``plan``).

The registry names systems by module path, so this file (and the smoke test, which runs
everything registered) imports nothing of a peer until it runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from benchmarks import summary as summarise
from benchmarks.masking import mask, masked
from benchmarks.scale import Scale
from benchmarks.systems.base import Env, System, WorkerSpec
from benchmarks.workloads import WORKLOADS, RunContext

REPO = Path(__file__).resolve().parents[1]
#: the defaults without $BENCH_PG_DSN / $BENCH_REDIS_URL (--help names these, never the
#: variables' values, which may hold a password)
FALLBACK_PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
FALLBACK_REDIS = "redis://127.0.0.1:6379"
DEFAULT_PG_DSN = os.environ.get("BENCH_PG_DSN", FALLBACK_PG_DSN)
DEFAULT_REDIS = os.environ.get("BENCH_REDIS_URL", FALLBACK_REDIS)
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


@contextlib.contextmanager
def interrupts_end_the_run() -> Iterator[None]:
    """SIGTERM (what ``timeout`` and ``kill`` send) ends the run as Ctrl-C does: the
    ``finally`` blocks stop the workers and close every system. After the first SIGINT or
    SIGTERM both are swallowed until the block ends, so a second one cannot cut that
    clean-up short (a handler, not SIG_IGN: processes started meanwhile must not inherit
    an ignored SIGTERM). Only the main thread may install handlers."""

    def first(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGINT, later)
        signal.signal(signal.SIGTERM, later)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def later(signum: int, _frame: Any) -> None:
        os.write(2, f"{signal.Signals(signum).name}: still cleaning up\n".encode())

    before = {s: signal.signal(s, first) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def one_line_error(exc: BaseException) -> str:
    """``Type: message`` on one line (psycopg's span several: the log would show only the
    last), with any password in a DSN or URL masked."""
    text = mask(" ".join(part.strip() for part in str(exc).splitlines() if part.strip()))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _named_once(kind: str, names: list[str]) -> None:
    """An empty list would mean everything, a repeated name a second run that overwrites
    the first's files (and a second prepare that deletes the first's live SQLite files)."""
    if not names:
        raise ValueError(f"no {kind} named")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{kind} named more than once: {', '.join(repeated)}")


def entries(keys: list[str] | None) -> list[Entry]:
    """The registered systems named (all of them for None), in the order given."""
    if keys is None:
        return list(REGISTRY)
    _named_once("systems", keys)
    known = {e.key: e for e in REGISTRY}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown systems {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[k] for k in keys]


def workload_names(names: list[str] | None) -> list[str]:
    """The requested workloads (all of them for None) in canonical order (backlog always
    last)."""
    if names is None:
        return list(WORKLOADS)
    _named_once("workloads", names)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    return [w for w in WORKLOADS if w in names]


def redis_dbs(chosen: list[Entry], base: int) -> list[int]:
    """The Redis database number of each entry (the same index): one of its own for each
    system that uses Redis, from ``base`` up (Redis has 16 by default, fewer than the
    registry's entries, so PostgreSQL systems take none: their number is -1)."""
    found, next_db = [], base
    for entry in chosen:
        found.append(next_db if entry.redis else -1)
        next_db += 1 if entry.redis else 0
    return found


def redis_db_url(url: str, db: int) -> str:
    """The Redis URL (which names no database: ``redis_url_problem``) for database ``db``."""
    return f"{url.rstrip('/')}/{db}"


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be the run's Redis, or None: the harness picks each system's
    database itself (``--redis-db-base``), so the URL must not name one."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return "not a redis:// or rediss:// URL"
    if parts.path.strip("/") or "db" in parse_qs(parts.query):
        return (
            "must not name a database (the harness gives each Redis system one of its "
            "own, from --redis-db-base up)"
        )
    return None


def occupied_redis_dbs(url: str, dbs: list[int]) -> dict[int, int | str]:
    """Of the Redis databases ``dbs`` on ``url``'s server, those a Redis system would
    flush with keys in them (db -> key count), or those it cannot use (db -> why, e.g.
    beyond the server's ``databases``). An unreachable server reports nothing: the
    systems then fail to prepare, and say why."""
    import redis

    found: dict[int, int | str] = {}
    for db in dbs:
        client = redis.Redis.from_url(redis_db_url(url, db), socket_timeout=5)
        try:
            keys = int(client.dbsize())
        except (redis.ConnectionError, redis.TimeoutError):
            return {}
        except redis.RedisError as exc:
            found[db] = one_line_error(exc)
            continue
        finally:
            client.close()
        if keys:
            found[db] = keys
    return found


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
    #: let the Redis systems flush databases that hold keys before the run (else such a
    #: system refuses to prepare, and the CLI refuses to start: ``occupied_redis_dbs``)
    flush_redis: bool = False
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
    env: Env | None = None
    #: the backlog workload's large queue: a second instance, a database of its own
    large: System | None = None


@dataclass(frozen=True)
class Step:
    workload: str
    run: int
    key: str
    phase: str = ""
    #: the systems in the order this run goes through them (recorded in the run's file)
    order: tuple[str, ...] = ()

    @property
    def file(self) -> str:
        return f"{self.workload}-{self.key}-{self.run}.json"


#: the backlog's phase that fills the large queue (no run file: ``Slot.state``)
FILL = "fill"


def _williams_row(n: int, row: int) -> list[int]:
    """Row ``row`` (0-based) of a Williams design for ``n`` treatments: the base sequence
    0, 1, n-1, 2, n-2, … shifted by ``row``."""
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    return [(b + row) % n for b in base]


def run_order(keys: list[str], run: int) -> list[str]:
    """The systems in the order run ``run`` (1-based) goes through them: a Williams
    design, odd runs a row of it and even runs the same row reversed (A B C, C B A,
    B C A, A C B, C A B, B A C for three systems; run 1 in the order given). Every run
    has every system once, so each system's runs alternate with the others'; over 2n
    runs (n for an even n) each system follows each other one equally often and stands
    in each position equally often; over fewer runs each still follows several others,
    not always the same one."""
    if not keys:
        return []
    n = len(keys)
    # keys[j] is the design's treatment base[j], so run 1 goes through them as given
    # (renaming the treatments keeps the design balanced)
    name = dict(zip(_williams_row(n, 0), keys, strict=True))
    row = _williams_row(n, ((run - 1) // 2) % n)
    if run % 2 == 0:
        row.reverse()
    return [name[i] for i in row]


def plan(workloads: list[str], keys: list[str], runs: int) -> list[Step]:
    """Every step in execution order (``run_order`` for each run). The backlog workload
    first fills every system's large queue (phase ``fill``: untimed, then vacuumed,
    analysed and checkpointed), then each run drains the small and the large backlog of a
    system back to back, small first in odd runs and large first in even ones, so neither
    half always comes first."""
    steps: list[Step] = []
    for w in workloads:
        if w == "backlog":
            steps.extend(Step(w, 0, k, FILL) for k in keys)
        for run in range(1, runs + 1):
            order = tuple(run_order(keys, run))
            for k in order:
                if w != "backlog":
                    steps.append(Step(w, run, k, "", order))
                    continue
                phases = ("small", "large") if run % 2 else ("large", "small")
                steps.extend(Step(w, run, k, phase, order) for phase in phases)
    return steps


#: How this harness measures, where earlier ones differed (the report's captions say it
#: only for a summary that records it).
METHOD = {
    "cpu_window": "from the workers' launch to the last finish (their shutdown after it "
    "is not counted), and servers + workers are the system under test's processes only "
    "(other systems' idle servers are left out)",
    "recovery_clock": "the clock starts at the kill signal (the victim is reaped and "
    "confirmed gone after it)",
    "backlog": "The large backlog is a second instance of each system with a database of "
    "its own, filled before the first timed run, then vacuumed, analysed and checkpointed, "
    "and vacuumed, analysed and checkpointed again (untimed) after each run's top-up; "
    "each run drains the small and the large backlog back to back (small first in odd "
    "runs, large first in even ones), so each run's ratio is measured close in time",
    "order": "each run's system order from a Williams design, a row then the same row "
    "reversed (A B C, C B A, B C A, A C B, …), so each system follows each other one about "
    "equally often",
}

#: the recovery cap's margin over the slowest documented recovery of the run's systems
RECOVERY_MARGIN = 1.25
RECOVERY_MARGIN_MIN_S = 5.0


def recovery_cap(scale_cap: float, bounds: dict[str, float | None]) -> float:
    """The recovery workload's cap: the scale's, raised above the longest documented
    recovery of any system in the run (``System.recovery_bound_s``) with a margin
    (x ``RECOVERY_MARGIN``, at least ``RECOVERY_MARGIN_MIN_S`` more), so a peer whose
    documented recovery takes longer than the scale's cap is measured, not cut off. Systems
    that never recover (None) do not raise it."""
    known = [b for b in bounds.values() if b is not None]
    if not known:
        return scale_cap
    longest = max(known)
    return float(
        max(scale_cap, math.ceil(max(longest * RECOVERY_MARGIN, longest + RECOVERY_MARGIN_MIN_S)))
    )


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
        return {"error": one_line_error(exc)}
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
        return {"error": one_line_error(exc)}


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
        return {"args": args, "error": one_line_error(exc)}


# ---------------------------------------------------------------------- running


class Harness:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.slots = [Slot(e) for e in entries(opts.systems)]
        self.workloads = workload_names(opts.workloads)
        self.runs_dir = opts.out / "runs"
        self.work_dir = opts.out / "work"
        self._lock = threading.Lock()
        #: the scale the runs use: the options' with the recovery cap raised (``run``)
        self.scale = opts.scale
        #: one line per failed run or unavailable system: the CLI exits non-zero on any
        self.failed: list[str] = []

    def _failed(self, text: str) -> None:
        with self._lock:
            self.failed.append(text)

    def log(self, text: str) -> None:
        with self._lock:
            self.opts.log(f"{time.strftime('%H:%M:%S')} {mask(text)}")

    def run(self) -> dict[str, Any]:
        opts = self.opts
        if any(self.runs_dir.glob("*.json")):
            # the summary aggregates every file there: never mix two invocations
            raise FileExistsError(f"{self.runs_dir} already holds runs; choose a new --out")
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        started = datetime.now(UTC)
        keys = [s.entry.key for s in self.slots]
        fits = opts.scale.recovery_cap_fits_systems and "recovery" in self.workloads
        cap = self.recovery_cap() if fits else None
        if cap is not None:
            self.scale = dataclasses.replace(opts.scale, recovery_cap_s=cap["cap_s"])
        meta: dict[str, Any] = {
            "started_at": started.isoformat(),
            "argv": [mask(arg) for arg in sys.argv],
            "runs": opts.runs,
            "scale": self.scale.as_dict(),
            "workloads": self.workloads,
            "systems": keys,
            "parallel": opts.parallel,
            "order": "alternating, balanced: for each workload, run 1 of every system, then "
            "run 2, …, each run's order a row of a Williams design or its reverse (A B C, "
            "C B A, B C A, A C B, …); the backlog fills every large queue first, then "
            "drains small and large back to back per run and system (small first in odd "
            "runs, large first in even ones)",
            "run_orders": {str(r): run_order(keys, r) for r in range(1, opts.runs + 1)},
            "host": host(),
            "postgres": _postgres(opts.pg_dsn),
            "redis": _redis(opts.redis_url),
            "git": _git(),
        }
        if cap is not None:
            meta["recovery_cap"] = cap
        meta["method"] = METHOD
        physical: dict[str, Any] = {}

        def measure_physical() -> None:
            self.log("physical limit (benchmarks.physical.measure) …")
            physical.update(run_physical(opts))
            self.log(f"  physical limit: {physical.get('error') or 'done'}")
            if physical.get("error"):  # asked for and not measured: the run failed
                self._failed(f"physical limit: {physical['error']} (--no-physical skips it)")

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
        (opts.out / "summary.json").write_text(json.dumps(masked(result), indent=2) + "\n")
        return result

    def recovery_cap(self) -> dict[str, Any]:
        """The recovery workload's cap for this run (``recovery_cap``), from every
        system's documented recovery bound; each system is constructed for it, not
        prepared (a system that cannot even be constructed has no bound)."""
        bounds: dict[str, float | None] = {}
        for slot in self.slots:
            try:
                bounds[slot.entry.key] = slot.entry.load().recovery_bound_s()
            except Exception:
                continue
        cap = recovery_cap(self.opts.scale.recovery_cap_s, bounds)
        return {
            "cap_s": cap,
            "scale_cap_s": self.opts.scale.recovery_cap_s,
            "bounds_s": bounds,
            "rule": f"the scale's cap, raised to the longest documented recovery of any "
            f"system here x {RECOVERY_MARGIN:g} (at least {RECOVERY_MARGIN_MIN_S:g} s more), "
            "rounded up; None: the system never recovers held jobs",
        }

    def _in_flight(self, system: System) -> dict[str, str]:
        """What one worker process holds at once, per workload, in the system's terms."""
        s, here = self.scale, Path(".")
        specs = {
            "throughput": WorkerSpec(1, s.worker_concurrency, here),
            "latency": WorkerSpec(1, s.worker_concurrency, here),
            "backlog": WorkerSpec(1, s.worker_concurrency, here),
            "io": WorkerSpec(1, s.io_concurrency, here, io_bound=True),
        }
        return {w: system.in_flight(spec) for w, spec in specs.items()}

    def _descriptions(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for slot in self.slots:
            d: dict[str, Any] = {"module": slot.entry.module, "kwargs": dict(slot.entry.kwargs)}
            if slot.system is not None:
                system = slot.system
                d.update(
                    name=system.name,
                    profile=system.profile,
                    uses_postgres=system.uses_postgres,
                    versions=_safe(system.versions),
                    settings=_safe(system.settings),
                    in_flight=_safe(functools.partial(self._in_flight, system)),
                    # the spec the backlog measures it with (``workloads.backlog``)
                    claim_probe=_safe(
                        functools.partial(
                            system.claim_probe,
                            WorkerSpec(1, self.scale.worker_concurrency, Path(".")),
                        )
                    ),
                    recovery_note=_safe(system.recovery_note),
                    recovery_settings=_safe(system.recovery_settings),
                    recovery_bound_s=_safe(system.recovery_bound_s),
                )
            if slot.entry.backlog_skip:
                d["backlog_skipped"] = slot.entry.backlog_skip
            elif "backlog" in self.workloads:
                d["backlog_large"] = (
                    "a second instance of the system, with a database of its own, holds the "
                    "large backlog; prepared and filled before the first timed run"
                )
            for key in ("prepare_s", "backlog_fill", "backlog_large_prepare_s"):
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
        return redis_dbs([s.entry for s in self.slots], self.opts.redis_db_base)[i]

    def _prepare(self, i: int, slot: Slot) -> None:
        key = slot.entry.key
        env = Env(
            pg_admin_dsn=self.opts.pg_dsn,
            redis_url=redis_db_url(self.opts.redis_url, self._redis_db(i)),
            work_dir=(self.work_dir / key).resolve(),
            flush_redis=self.opts.flush_redis,
        )
        env.work_dir.mkdir(parents=True, exist_ok=True)
        slot.env = env
        self.log(f"prepare {key} …")
        t0 = time.time()
        try:
            # set before prepare: an interrupt inside it leaves _close_all what it started
            slot.system = slot.entry.load()
            slot.system.prepare(env)
        except Exception as exc:
            slot.error = one_line_error(exc)
            self.log(f"  {key} unavailable: {slot.error}")
            self._failed(f"{key} unavailable: {slot.error}")
            self._close_half_prepared(slot)
        else:
            slot.state["prepare_s"] = round(time.time() - t0, 3)
            self.log(f"  {key} prepared in {slot.state['prepare_s']:.1f} s")

    def _close_half_prepared(self, slot: Slot) -> None:
        """Close what a failed prepare started and mark the system unavailable, so no step
        runs against it. Its close may fail on what prepare never made (a database never
        created): one line, not a traceback, and none when it repeats prepare's error."""
        system, slot.system = slot.system, None
        if system is None:
            return
        try:
            system.close()
        except Exception as exc:
            if one_line_error(exc) != slot.error:
                self.log(f"  closing the half-prepared {slot.entry.key}: {one_line_error(exc)}")

    def _close_all(self) -> None:
        for slot in self.slots:
            for system in (slot.large, slot.system):
                if system is not None:
                    try:
                        system.close()
                    except Exception:
                        self.log(f"close {slot.entry.key} failed:\n{traceback.format_exc()}")

    def _foreign_pids(self, system: System) -> list[int]:
        """The long-lived processes of every system but ``system`` (their servers)."""
        pids: list[int] = []
        for slot in self.slots:
            for other in (slot.system, slot.large):
                if other is not None and other is not system:
                    with contextlib.suppress(Exception):
                        pids.extend(other.own_pids())
        return pids

    def _fill(self, step: Step, slot: Slot) -> None:
        """The backlog's large queue: a second instance of the system (a database of its
        own, so the small half's resets never touch it), filled, vacuumed, analysed and
        checkpointed (``workloads.backlog``'s fill phase) before any timed run."""
        key = slot.entry.key
        if slot.system is None or slot.entry.backlog_skip or slot.env is None:
            return
        label = f"backlog/fill {key}"
        self.log(f"{label} …")
        t0 = time.time()
        ctx: RunContext | None = None
        try:
            large = slot.entry.load()
            slot.large = large
            large.prepare(
                dataclasses.replace(slot.env, work_dir=slot.env.work_dir / "backlog-large")
            )
            slot.state["backlog_large_prepare_s"] = round(time.time() - t0, 3)
            ctx = self._context(step, slot, large)
            WORKLOADS[step.workload](ctx)
        except Exception:
            error = traceback.format_exc()
            slot.state["backlog_broken"] = True
            slot.state["backlog_fill"] = {"error": error.strip().splitlines()[-1]}
            self.log(f"  {label} FAILED: {error.strip().splitlines()[-1]}")
            self._failed(f"{label}: {error.strip().splitlines()[-1]}")
        else:
            fill = slot.state.get("backlog_fill", {})
            self.log(f"  {label}: {_brief({k: v for k, v in fill.items() if k != 'maintenance'})}")
        finally:
            if ctx is not None:
                ctx.cleanup()

    def _context(self, step: Step, slot: Slot, system: System) -> RunContext:
        return RunContext(
            system=system,
            scale=self.scale,
            run=step.run,
            rec_root=self.work_dir / step.key / "records" / step.workload,
            state=slot.state,
            phase=step.phase,
            keep_records=self.opts.keep_records,
            pg_dsn=self.opts.pg_dsn if system.uses_postgres else None,
            foreign_pids=lambda: self._foreign_pids(system),
        )

    def _run_parallel(self, steps: list[Step]) -> None:
        """One thread per system: prepare it, then go through its own steps in order. An
        interrupt (only the main thread gets it) sets ``stop``, which each thread checks
        between steps, and waits for the threads before ``run`` closes the systems: a
        system closed under a running step would have its workers started after the close
        and left behind. The main thread waits on an event, not in ``join``: an interrupt
        inside ``Thread.join`` can leave the thread marked finished while it runs on."""
        if not self.slots:
            return
        stop, all_done = threading.Event(), threading.Event()
        left = [len(self.slots)]

        def one(i: int, slot: Slot) -> None:
            try:
                if stop.is_set():
                    return
                self._prepare(i, slot)
                for step in steps:
                    if stop.is_set():
                        return
                    if step.key == slot.entry.key:
                        self._step(step)
            finally:
                with self._lock:
                    left[0] -= 1
                    if not left[0]:
                        all_done.set()

        threads = [
            threading.Thread(target=one, args=(i, slot), name=f"bench-{slot.entry.key}")
            for i, slot in enumerate(self.slots)
        ]
        try:
            for t in threads:
                t.start()
            all_done.wait()
            for t in threads:
                t.join()
        except BaseException:
            stop.set()
            self.log("interrupted: waiting for each system's current step to end …")
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
            raise

    def _step(self, step: Step) -> None:
        slot = next(s for s in self.slots if s.entry.key == step.key)
        if step.phase == FILL:
            self._fill(step, slot)
            return
        path = self.runs_dir / step.file
        label = f"{step.workload}{'/' + step.phase if step.phase else ''} {step.key} #{step.run}"
        # a backlog run's two phases share one file: the second adds to the first's
        record: dict[str, Any] = _read(path) if step.phase else {}
        record.update(
            workload=step.workload,
            system=step.key,
            run=step.run,
            scale=self.scale.name,
            order=list(step.order),
            position=step.order.index(step.key) if step.key in step.order else None,
        )
        if step.phase:
            record.setdefault("phases", []).append(step.phase)
        if slot.system is None:
            record["error"] = f"system unavailable: {slot.error}"
            _write(path, record)
            return  # counted once, as unavailable, by _prepare
        system = slot.system
        record.update(name=system.name, profile=system.profile)
        if step.workload == "backlog" and slot.entry.backlog_skip:
            record["skipped"] = slot.entry.backlog_skip
            _write(path, record)
            return
        # A backlog run's second half runs even when its first failed: the small and the
        # large backlog are separate instances, so one half's failure leaves the other's
        # queue as it was (a failed large half marks only the large one broken).
        if step.phase == "large":
            if slot.large is None or slot.state.get("backlog_broken"):
                record.setdefault("detail", {})["large"] = {
                    "skipped": "the large backlog is unavailable (its fill or a run failed)"
                }
                _write(path, record)
                return
            system = slot.large
        ctx = self._context(step, slot, system)
        self.log(f"{label} …")
        t0 = time.time()
        try:
            outcome = WORKLOADS[step.workload](ctx)
        except Exception:
            error = traceback.format_exc()
            if step.phase:
                # both halves of a backlog run may fail: keep the first half's error too
                record.setdefault("detail", {}).setdefault(step.phase, {})["error"] = (
                    error.strip().splitlines()[-1]
                )
                if record.get("error"):
                    error = f"{record['error'].rstrip()}\n{error}"
            record["error"] = error
            if step.phase == "large":
                slot.state["backlog_broken"] = True
            self.log(f"  {label} FAILED: {error.strip().splitlines()[-1]}")
            self._failed(f"{label}: {error.strip().splitlines()[-1]}")
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
        return {"error": one_line_error(exc)}


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
    tmp.write_text(json.dumps(masked(record), indent=1) + "\n")
    tmp.replace(path)
