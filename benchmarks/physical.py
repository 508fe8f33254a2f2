"""The physical limit: how many jobs/s PostgreSQL itself can push through Orbit's tables.

The report compares Orbit's throughput with a ceiling measured on the same server: the
least SQL one task needs in Orbit (submit, claim, start, finish; see
``benchmarks/pgbench/pipeline.sql``) driven by ``pgbench`` with no Python, no HTTP and no
bookkeeping in between. Orbit's jobs/s divided by this figure says how much of the
database's own limit Orbit reaches, and so whether the rest of the gap is worth chasing.

Two pipelines are measured at each client count, each on freshly reset tables:

* ``one_per_tx``: one task per transaction (submit 1; claim 1; start 1; finish 1), the
  floor of a system that never batches;
* ``batched``: ``batch`` tasks per transaction at every step, as Orbit's batched hot path
  does; jobs/s = iterations/s x tasks per iteration.

Each run also gives a **drain-only** rate (``drain_jobs_per_s``): the same pipeline
without its submit step, from pgbench's per-step latencies (``rate x total / (total -
submit)``, :func:`benchmarks.summary.drain_only_jobs_per_s`). Orbit's throughput is a
drain of tasks queued before the clock starts, so that, not the whole pipeline's rate, is
the bound its throughput is a share of; the whole pipeline's stays beside it.

Two more figures bound the other targets from below, measured on the same server:

* the **submit ceiling** (``benchmarks/pgbench/submit.sql``): ``submit_batch`` tasks and
  their ``submitted`` events per statement, the least SQL a batch enqueue needs;
* the **commit latency**: a one-row INSERT and its COMMIT, ``commits`` times, durable
  (``synchronous_commit = on``, what a submit and a start must wait for) and relaxed
  (``off``, what a claim waits for), as the client sees it (p50/p99/max ms);
* the **round trip**: ``SELECT 1`` from Python, wall and client CPU per statement.

Each run happens in a database of its own (a unique name, Orbit's own migrations applied),
dropped afterwards whatever happens. Run it as::

    python -m benchmarks.physical --batch 200 --clients 1,2,4,16 --seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict

from benchmarks.scale import PHYSICAL_BATCH
from benchmarks.summary import PIPELINE_STEPS, drain_only_jobs_per_s
from benchmarks.workloads import percentile
from orbit.store import open_store

SCRIPT = Path(__file__).parent / "pgbench" / "pipeline.sql"
SUBMIT_SCRIPT = Path(__file__).parent / "pgbench" / "submit.sql"
#: The script's SQL commands in order, named as in the result's per-step latencies.
STEPS = PIPELINE_STEPS
DEFAULT_ADMIN_DSN = os.environ.get(
    "ORBIT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
QUEUE = "bench"
#: Tables the pipeline writes; emptied before every run so runs do not inherit each
#: other's dead tuples (the server may run with autovacuum off, as this machine's does).
TABLES = ("orbit_events", "orbit_artifact_chunks", "orbit_artifacts", "orbit_attempts")

_SET_BATCH = re.compile(r"^\\set batch \d+$", re.MULTILINE)


def _preload_sql() -> str:
    """The backlog insert: step 1 of pipeline.sql itself (its first INSERT), with the
    batch size as a parameter, so preloaded and submitted tasks are the same rows."""
    text = SCRIPT.read_text()
    start = text.index("INSERT INTO orbit_tasks")
    insert = text[start : text.index(";", start)]
    return insert.replace("CAST(:batch AS integer)", "%(n)s")


#: Server settings that move the ceiling; recorded so a figure can be read in context.
_SETTINGS = (
    "synchronous_commit",
    "fsync",
    "wal_sync_method",
    "commit_delay",
    "shared_buffers",
    "autovacuum",
    "max_connections",
)


def _libpq_dsn(admin_dsn: str, dbname: str) -> str:
    """The admin connection's parameters with another database: a libpq URI (the form
    ``open_store`` wants) that psycopg and pgbench read as well, whatever form
    (URL or key=value) the admin DSN was given in."""
    params = {k: v for k, v in conninfo_to_dict(admin_dsn).items() if v is not None}
    params["dbname"] = dbname
    return "postgresql://?" + urlencode({k: str(v) for k, v in params.items()})


def pgbench_path() -> str:
    """pgbench from ``$PGBENCH``, the PATH or Debian's usual place."""
    found = os.environ.get("PGBENCH") or shutil.which("pgbench")
    if found:
        return found
    if Path("/usr/bin/pgbench").exists():
        return "/usr/bin/pgbench"
    raise FileNotFoundError("pgbench not found: install postgresql-client or set $PGBENCH")


def render_script(batch: int, directory: Path, script: Path = SCRIPT) -> Path:
    """``script`` (pipeline.sql) with its ``\\set batch`` line set to ``batch``.

    pgbench re-runs ``\\set`` at every iteration, so ``-D batch=N`` cannot override it:
    the one line is rewritten instead, and the checked-in script stays runnable by hand.
    """
    text = script.read_text(encoding="utf-8")
    rendered, count = _SET_BATCH.subn(f"\\\\set batch {batch}", text)
    if count != 1:
        raise ValueError(f"{script} must hold exactly one '\\set batch N' line")
    path = directory / f"{script.stem}_b{batch}.sql"
    path.write_text(rendered, encoding="utf-8")
    return path


def parse_pgbench(output: str) -> dict[str, Any]:
    """tps, mean latency, iterations and per-step latencies from pgbench's report."""

    def number(pattern: str) -> float:
        m = re.search(pattern, output, re.MULTILINE)
        if m is None:
            raise ValueError(f"pgbench output lacks {pattern!r}:\n{output}")
        return float(m.group(1))

    steps: list[float] = []
    in_steps = False
    for line in output.splitlines():
        if line.startswith("statement latencies"):
            in_steps = True
            continue
        if in_steps:
            m = re.match(r"^\s+([\d.]+)\s+(?:\d+\s+)?(.*)$", line)
            if m is None:
                break
            if not m.group(2).startswith("\\"):  # meta-commands (\set) are not SQL
                steps.append(float(m.group(1)))
    failed = re.search(r"^number of failed transactions: (\d+)", output, re.MULTILINE)
    return {
        "tps": number(r"^tps = ([\d.]+)"),
        "latency_ms": number(r"^latency average = ([\d.]+) ms"),
        "iterations": int(number(r"^number of transactions actually processed: (\d+)")),
        "failed": int(failed.group(1)) if failed else 0,
        "step_latency_ms": dict(zip(STEPS, steps, strict=False)),
    }


def _reset(dsn: str, backlog: int) -> None:
    """Empty the pipeline's tables and queue ``backlog`` ready tasks, then vacuum, analyse
    and checkpoint, so every run starts from the same state and no run pays for the
    previous one's dead rows or dirty pages."""
    with psycopg.connect(dsn, autocommit=True) as cx:
        cx.execute(f"TRUNCATE {', '.join(TABLES)}, orbit_tasks RESTART IDENTITY")
        if backlog > 0:
            cx.execute(_preload_sql(), {"n": backlog})
        cx.execute(f"VACUUM ANALYZE {', '.join(TABLES)}, orbit_tasks")
        # Best effort: only a superuser (or a member of pg_checkpoint) may checkpoint.
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            cx.execute("CHECKPOINT")


#: what a run counts as done: the pipeline's succeeded tasks, the submit script's tasks
_DONE = "SELECT count(*) FROM orbit_tasks WHERE state = 'succeeded'"
_SUBMITTED = "SELECT count(*) FROM orbit_tasks"


def _count(dsn: str, sql: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as cx:
        row = cx.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


def run_pipeline(
    pgbench: str,
    dsn: str,
    script: Path,
    *,
    batch: int,
    clients: int,
    seconds: float,
    done_sql: str = _DONE,
) -> dict[str, Any]:
    """One pgbench run of the pipeline; jobs/s from the tasks that actually succeeded
    (``done_sql``: the submit script counts the tasks it inserted).

    jobs/s is tps x tasks per iteration, the latter counted in the database (succeeded
    tasks / iterations) rather than assumed to be ``batch``: if the queue ran dry a claim
    would grant fewer, and the figure must say so.
    """
    cmd = [
        pgbench,
        "-n",
        "-r",
        "-M",
        "prepared",
        "-f",
        str(script),
        "-c",
        str(clients),
        "-j",
        str(clients),
        "-T",
        str(max(1, round(seconds))),
        dsn,
    ]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 3 + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    parsed = parse_pgbench(proc.stdout)
    done = _count(dsn, done_sql)
    per_iteration = min(float(batch), done / parsed["iterations"]) if parsed["iterations"] else 0.0
    jobs_per_s = round(parsed["tps"] * per_iteration, 1)
    drain = drain_only_jobs_per_s(
        {"jobs_per_s": jobs_per_s, "step_latency_ms": parsed["step_latency_ms"]}
    )
    return {
        "clients": clients,
        "jobs_per_s": jobs_per_s,
        # without the submit step (the module docstring); None for a script without it
        "drain_jobs_per_s": round(drain, 1) if drain is not None else None,
        "tps": round(parsed["tps"], 2),
        "tasks_per_iteration": round(per_iteration, 3),
        "iterations": parsed["iterations"],
        "tasks_succeeded": done,
        "failed": parsed["failed"],
        "latency_ms": parsed["latency_ms"],
        "step_latency_ms": parsed["step_latency_ms"],
        "loadavg_1m_before": round(load, 2),
    }


def commit_latency(dsn: str, commits: int) -> dict[str, dict[str, float]]:
    """p50/p99/max ms of a one-row INSERT plus its COMMIT, durable and relaxed.

    The floor under any enqueue-to-start latency: Orbit's path waits for two durable
    commits by design (the submit, acknowledged to the client; the start, the point of
    no return, before the handler runs) and one relaxed one (the claim).
    """
    out: dict[str, dict[str, float]] = {}
    with psycopg.connect(dsn) as cx:
        cx.execute("CREATE TABLE commit_probe (id bigserial PRIMARY KEY, at bigint NOT NULL)")
        cx.commit()
        for label, setting in (("durable", "on"), ("relaxed", "off")):
            cx.execute(f"SET synchronous_commit = {setting}")
            cx.commit()
            times: list[float] = []
            for _ in range(commits):
                t0 = time.perf_counter()
                cx.execute("INSERT INTO commit_probe (at) VALUES (1)")
                cx.commit()
                times.append((time.perf_counter() - t0) * 1000)
            out[label] = {
                "p50_ms": round(percentile(times, 50), 3),
                "p99_ms": round(percentile(times, 99), 3),
                "max_ms": round(max(times), 3),
            }
        cx.execute("DROP TABLE commit_probe")
        cx.commit()
    return out


def round_trip(dsn: str, queries: int) -> dict[str, float]:
    """The cost of one statement round trip from Python: ``SELECT 1`` through psycopg,
    ``queries`` times: wall and this process's CPU per query, in µs. Orbit's transactions
    are a handful of statements each, so on a host where a round trip is dear (syscalls
    on a small virtual machine) this, not the SQL, sets the cost of a small transaction."""
    with psycopg.connect(dsn, autocommit=True) as cx:
        for _ in range(min(queries, 50)):  # warm up: prepared statement, caches
            cx.execute("SELECT 1").fetchone()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(queries):
            cx.execute("SELECT 1").fetchone()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "wall_us": round(wall / queries * 1e6, 1),
        "client_cpu_us": round(cpu / queries * 1e6, 1),
    }


def _server(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as cx:
        version = cx.execute("SHOW server_version").fetchone()
        rows = cx.execute(
            "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
            [list(_SETTINGS)],
        ).fetchall()
    settings = {name: f"{setting}{unit or ''}" for name, setting, unit in rows}
    return {"version": version[0] if version else None, "settings": settings}


def measure(
    admin_dsn: str,
    *,
    batch: int,
    clients: list[int],
    seconds: float,
    backlog: int,
    submit_batch: int = 1000,
    commits: int = 500,
) -> dict[str, Any]:
    """Measure both pipelines and the submit ceiling at every client count, and the
    commit latency, in a throwaway database.

    ``backlog`` ready tasks are queued before each run and kept at that depth (each
    iteration submits what it claims), so claims scan a realistic ready index and never
    come up short; it should be at least a few times ``batch x max(clients)``.
    """
    if batch < 1 or submit_batch < 1 or commits < 1:
        raise ValueError("batch, submit_batch and commits must be at least 1")
    if not clients or any(c < 1 for c in clients):
        raise ValueError("clients must be a non-empty list of positive counts")
    if seconds < 1 or seconds != int(seconds) or backlog < 0:
        raise ValueError(
            "seconds must be a whole number, at least 1 (pgbench -T), and backlog non-negative"
        )
    pgbench = pgbench_path()
    name = f"orbit_physical_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    dsn = _libpq_dsn(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    started = time.time()
    try:
        store = open_store(dsn)  # Orbit's own migrations, as `orbit db migrate` applies them
        store.close()
        with psycopg.connect(dsn, autocommit=True) as cx:
            cx.execute(
                "INSERT INTO orbit_queues (name, max_concurrency, rate, burst, paused, tokens,"
                " tokens_at, created_at) VALUES (%s, 1000000, 0, 1, false, 1, 0, 0)",
                [QUEUE],
            )
        pipelines: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="orbit_physical_") as tmp:
            for key, n in (("one_per_tx", 1), ("batched", batch)):
                script = render_script(n, Path(tmp))
                runs = []
                for c in clients:
                    _reset(dsn, backlog)
                    runs.append(
                        run_pipeline(pgbench, dsn, script, batch=n, clients=c, seconds=seconds)
                    )
                pipelines[key] = {"batch": n, "runs": runs}
            script = render_script(submit_batch, Path(tmp), SUBMIT_SCRIPT)
            submit_runs = []
            for c in clients:
                _reset(dsn, 0)
                submit_runs.append(
                    run_pipeline(
                        pgbench,
                        dsn,
                        script,
                        batch=submit_batch,
                        clients=c,
                        seconds=seconds,
                        done_sql=_SUBMITTED,
                    )
                )
        _reset(dsn, 0)
        commit = commit_latency(dsn, commits)
        trip = round_trip(dsn, commits * 4)
        server = _server(dsn)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return {
        "database": name,
        "server": server,
        "cpus": os.cpu_count(),
        "batch": batch,
        "clients": list(clients),
        "seconds": seconds,
        "backlog": backlog,
        "elapsed_s": round(time.time() - started, 1),
        "pipelines": pipelines,
        "jobs_per_s": {
            key: {str(r["clients"]): r["jobs_per_s"] for r in p["runs"]}
            for key, p in pipelines.items()
        },
        "drain_jobs_per_s": {
            key: {str(r["clients"]): r["drain_jobs_per_s"] for r in p["runs"]}
            for key, p in pipelines.items()
        },
        "submit": {"batch": submit_batch, "runs": submit_runs},
        "submit_jobs_per_s": {str(r["clients"]): r["jobs_per_s"] for r in submit_runs},
        "commits": commits,
        "commit_latency_ms": commit,
        "round_trip": trip,
    }


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


def _client_counts(text: str) -> list[int]:
    """``--clients``: a comma-separated list of whole numbers, each at least 1."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("no client count given")
    return [_at_least(1)(part) for part in parts]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.physical",
        description="Measure PostgreSQL's own jobs/s ceiling on Orbit's tables with pgbench.",
    )
    parser.add_argument(
        "--batch", type=_at_least(1), default=PHYSICAL_BATCH, help="tasks per batched transaction"
    )
    parser.add_argument(
        "--clients",
        type=_client_counts,
        default=[1, 2, 4, 16],
        help="comma-separated client counts (1,2,4,16)",
    )
    parser.add_argument(
        "--seconds",
        type=_at_least(1),
        default=10,
        help="duration of each run, whole seconds (pgbench -T; 10)",
    )
    parser.add_argument(
        "--backlog", type=_at_least(0), default=10_000, help="ready tasks kept queued"
    )
    parser.add_argument(
        "--submit-batch",
        type=_at_least(1),
        default=1000,
        help="tasks per statement, submit ceiling",
    )
    parser.add_argument(
        "--commits", type=_at_least(1), default=500, help="commits timed for latency"
    )
    parser.add_argument(
        "--admin-dsn",
        default=DEFAULT_ADMIN_DSN,
        help="a PostgreSQL DSN allowed to create databases (default: $ORBIT_TEST_PG_DSN or "
        "postgresql://postgres@127.0.0.1:5432/postgres)",
    )
    args = parser.parse_args(argv)
    result = measure(
        args.admin_dsn,
        batch=args.batch,
        clients=args.clients,
        seconds=args.seconds,
        backlog=args.backlog,
        submit_batch=args.submit_batch,
        commits=args.commits,
    )
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
