"""A quick same-code probe: one Orbit server, one worker, N pre-enqueued no-op tasks.

The full harness compares systems; this answers a narrower question fast: did a change
make Orbit's drain cheaper? It prints tasks/s and the CPU each process spent per task
(server, worker, PostgreSQL), measured from the first success to the last, and the same
for the fill (``enqueue``: batches of 1,000 through ``Client.submit_many``). This
machine's speed drifts by the hour, so compare two builds by running the probe on each
in turn, several times, in both orders (A B B A …), never against an old figure::

    python -m benchmarks.probe --tasks 20000
    python -m benchmarks.probe --tasks 40000 --py-spy /tmp/server.txt  # and a profile

``--py-spy FILE`` records the server (``--worker`` records the worker instead) for the
first seconds of the drain with ``py-spy record --gil -f raw``: stacks that held the GIL,
in the collapsed format.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.cpu import CpuSampler
from benchmarks.harness import free_ports
from benchmarks.recorder import RecordReader
from benchmarks.systems.base import create_database, drop_database
from orbit import Client
from orbit.client._client import task_body
from orbit.store import open_store

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ADMIN_DSN = os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def _py_spy() -> str:
    """py-spy beside this interpreter (a venv's bin) or on the PATH."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise FileNotFoundError("py-spy is not installed (pip install -e '.[dev]')")
    return found


@contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def drain(
    admin_dsn: str, *, tasks: int, concurrency: int, spy: str | None, spy_worker: bool
) -> dict[str, Any]:
    """Fill ``tasks`` no-op tasks, start one worker, and time the drain."""
    if tasks < 1 or concurrency < 1:
        raise ValueError("tasks and concurrency must be at least 1")
    spy_bin = _py_spy() if spy is not None else None
    name = f"orbit_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = create_database(admin_dsn, name)
    try:
        store = open_store(url)
        try:
            _, token = store.token_create("probe", ["admin", "submit", "worker"])
        finally:
            store.close()
        work = Path(tempfile.mkdtemp(prefix="orbit_probe_"))
        token_file = work / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        (port,) = free_ports(1)
        base = f"http://127.0.0.1:{port}"
        with _processes() as procs:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "orbit.cli",
                    "server",
                    "--db",
                    url,
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--lease-ttl",
                    "5",
                    "--reap-interval",
                    "0.5",
                ],
                cwd=REPO,
            )
            procs.append(server)
            client = Client(base, token=token)
            for _ in range(300):
                try:
                    client.queues()
                    break
                except Exception:
                    time.sleep(0.05)
            client.queue_create("bench", max_concurrency=1_000_000, rate=0)
            bodies = [
                task_body("bench", "bench", {"id": f"p{i}", "t": 0.0, "kind": "noop"})
                for i in range(tasks)
            ]
            # The fill is the batch-enqueue workload: timed, with the CPU of each side
            # (this process is the client).
            with CpuSampler(interval=0) as filling:
                f0 = time.perf_counter()
                for start in range(0, tasks, 1000):
                    client.submit_many(bodies[start : start + 1000])
                fill_s = time.perf_counter() - f0
            with psycopg.connect(url, autocommit=True) as cx:
                cx.execute("ANALYZE")
            env = {
                **os.environ,
                "ORBIT_URL": base,
                "ORBIT_TOKEN_FILE": str(token_file),
                "BENCH_CONCURRENCY": str(concurrency),
                "BENCH_REC_DIR": str(work),
                "PYTHONPATH": str(REPO),
            }
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "orbit.cli",
                    "worker",
                    "benchmarks.systems.orbit_worker:worker",
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(worker)
            done_sql = "SELECT count(*) FROM orbit_tasks WHERE state = 'succeeded'"
            with psycopg.connect(url, autocommit=True) as cx:

                def succeeded() -> int:
                    row = cx.execute(done_sql).fetchone()
                    return int(row[0]) if row else 0

                while succeeded() == 0:
                    if worker.poll() is not None:
                        raise RuntimeError("the worker exited before running a task")
                    time.sleep(0.01)
                # readings at the start and the end only: no sampling thread in the way
                with CpuSampler(interval=0) as sampler:
                    t0 = time.perf_counter()
                    spying = None
                    if spy is not None and spy_bin is not None:
                        target = worker.pid if spy_worker else server.pid
                        spying = subprocess.Popen(
                            [
                                spy_bin,
                                "record",
                                "-p",
                                str(target),
                                "-d",
                                "6",
                                "-r",
                                "250",
                                "--gil",
                                "-f",
                                "raw",
                                "-o",
                                spy,
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    # The handlers' records first (file reads), then the count that says
                    # the finishes are durable: a count(*) reads the whole table (7 ms a
                    # poll at 20,000 tasks, a tenth of PostgreSQL's CPU per task when it
                    # was polled all along). The harness waits the same way (wait_done).
                    reader = RecordReader(work)
                    finished = 0
                    while finished < tasks or succeeded() < tasks:
                        if worker.poll() is not None or server.poll() is not None:
                            raise RuntimeError(f"a process exited with {finished} finished")
                        finished += sum(r.kind == "F" for r in reader.poll())
                        time.sleep(0.01)
                    elapsed = time.perf_counter() - t0
            if spying is not None:
                spying.wait()
        shutil.rmtree(work, ignore_errors=True)
    finally:
        drop_database(admin_dsn, name)
    per_task = 1000 / tasks  # CPU seconds per drain -> ms per task
    by_pid = {p["pid"]: p["cpu_s"] for p in sampler.result["processes"]}
    filled = {p["pid"]: p["cpu_s"] for p in filling.result["processes"]}
    return {
        "tasks": tasks,
        "concurrency": concurrency,
        "tasks_per_s": round(tasks / elapsed, 1),
        "cpu_ms_per_task": {
            "server": round(by_pid[server.pid] * per_task, 4),
            "worker": round(by_pid[worker.pid] * per_task, 4),
            "postgres": round(sampler.result["cpu_s"]["postgres"] * per_task, 4),
        },
        "enqueue": {
            "batch": 1000,
            "tasks_per_s": round(tasks / fill_s, 1),
            "cpu_ms_per_task": {
                "server": round(filled.get(server.pid, 0.0) * per_task, 4),
                "client": round(filling.result["cpu_s"]["harness"] * per_task, 4),
                "postgres": round(filling.result["cpu_s"]["postgres"] * per_task, 4),
            },
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probe",
        description="Time one Orbit server and worker draining pre-enqueued no-op tasks.",
    )
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks to drain")
    parser.add_argument("--concurrency", type=int, default=500, help="the worker's slots")
    parser.add_argument("--py-spy", dest="spy", help="record a GIL profile into this file")
    parser.add_argument("--worker", action="store_true", help="profile the worker instead")
    parser.add_argument("--pg-dsn", default=DEFAULT_ADMIN_DSN, help="may CREATE DATABASE")
    args = parser.parse_args(argv)
    try:
        result = drain(
            args.pg_dsn,
            tasks=args.tasks,
            concurrency=args.concurrency,
            spy=args.spy,
            spy_worker=args.worker,
        )
    except ValueError as exc:
        parser.error(str(exc))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
