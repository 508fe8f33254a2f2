"""A quick same-code probe: one Orbit server, one worker, N pre-enqueued tasks (no-ops).

The full harness compares systems; this answers a narrower question fast: did a change
make Orbit's drain cheaper? It prints tasks/s and the CPU each process spent per task
(server, worker, PostgreSQL), measured from the first success to the last, and the same
for the fill (``enqueue``: batches of 1,000 through ``Client.submit_many``). A drain also
reports the server's worker-protocol ``transactions`` over it, by op (claim, start,
finish): how many, their mean size and wall time, and how many were in flight on average,
from the server's ``orbit_worker_transaction_*`` metrics, read before the worker
starts and after the drain (outside its timing: a scrape counts the task table). This
machine's speed drifts by the hour, so compare two builds by running the probe on each
in turn, several times, in both orders (A B B A …), never against an old figure::

    python -m benchmarks.probe --tasks 20000
    python -m benchmarks.probe --tasks 40000 --py-spy /tmp/server.txt  # and a profile
    python -m benchmarks.probe --tasks 20000 --payload-bytes 8192  # tasks with arguments
    python -m benchmarks.probe --paced 100 --tasks 1000  # latency, and its stages
    python -m benchmarks.probe --tasks 5000 --concurrency 200 --sleep-ms 20 --prefetch 200

A paced run also splits each task's enqueue→start into its stages (``STAGES``), from the
times the database recorded for it: where a paced task's time goes, without a profiler.

``--sleep-ms MS`` drains tasks that each sleep MS ms instead (the I/O-bound workload's
tasks; ``--prefetch P`` gives the worker the prefetch the tuned profile gives it there) and
also reports how many handlers ran at once on average (``in_flight_mean``, of
``--concurrency``) and, per task, the median and p90 of the time from the start's clock
(``started_at``, read once the start's rows are locked) to its handler's first line
(``start_to_handler_ms``): the start's write, its durable commit and its reply, which a
waiting handler waits for. A drain with a prefetch also reports the slots the worker's
session declared (``worker_slots``: its concurrency and the prefetch), as the server
recorded them.

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
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.cpu import CpuSampler
from benchmarks.harness import interrupts_end_the_run, one_line_error
from benchmarks.recorder import Record, RecordReader
from benchmarks.systems.base import create_database, drop_database
from benchmarks.systems.orbit_system import TUNED_CONCURRENCY
from benchmarks.workloads import percentile
from orbit import Client
from orbit.cli.listening import announced_port, listening_port
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


@dataclass
class _Orbit:
    """One probe's server and its client, in a database of the probe's own."""

    url: str  # the database
    base: str  # the server
    token_file: Path
    work: Path  # the handlers' records
    client: Client
    server: subprocess.Popen[bytes]
    procs: list[subprocess.Popen[bytes]]


@contextmanager
def _orbit(admin_dsn: str) -> Iterator[_Orbit]:
    """A fresh database, a server on it with a ``bench`` queue; all dropped afterwards."""
    name = f"orbit_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = create_database(admin_dsn, name)
    work = Path(tempfile.mkdtemp(prefix="orbit_probe_"))
    try:
        store = open_store(url)
        try:
            _, token = store.token_create("probe", ["admin", "submit", "worker"])
        finally:
            store.close()
        token_file = work / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        log = work / "server.log"
        with _processes() as procs:
            with log.open("wb") as out:
                server = subprocess.Popen(
                    [
                        *(sys.executable, "-m", "orbit.cli", "server", "--db", url),
                        *("--port", "0", "--log-level", "warning"),
                        *("--lease-ttl", "5", "--reap-interval", "0.5"),
                    ],
                    cwd=REPO,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            procs.append(server)
            base = f"http://127.0.0.1:{announced_port(server, log)}"  # once it serves
            client = Client(base, token=token)
            client.queue_create("bench", max_concurrency=1_000_000, rate=0)
            try:
                yield _Orbit(url, base, token_file, work, client, server, procs)
            finally:  # the server's warnings, if it had any
                lines = log.read_text(errors="replace").splitlines()
                said = [line for line in lines if listening_port(line.encode()) is None]
                if said:
                    print("\n".join(said), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        drop_database(admin_dsn, name)


def _start_worker(orbit: _Orbit, concurrency: int, prefetch: int = 0) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ORBIT_URL": orbit.base,
        "ORBIT_TOKEN_FILE": str(orbit.token_file),
        "BENCH_CONCURRENCY": str(concurrency),
        "BENCH_PREFETCH": str(prefetch),
        "BENCH_REC_DIR": str(orbit.work),
        "PYTHONPATH": str(REPO),
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "benchmarks.systems.orbit_worker:worker"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    orbit.procs.append(worker)
    return worker


@contextmanager
def _spying(spy: str | None, pid: int) -> Iterator[None]:
    """``py-spy record --gil`` of ``pid`` for the first seconds of the block."""
    if spy is None:
        yield
        return
    spying = subprocess.Popen(
        [
            *(_py_spy(), "record", "-p", str(pid), "-d", "6", "-r", "250"),
            *("--gil", "-f", "raw", "-o", spy),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        spying.wait()


def _cpu_per_task(
    sampler: CpuSampler,
    tasks: int,
    server: subprocess.Popen[bytes],
    worker: subprocess.Popen[bytes],
) -> dict[str, float]:
    per_task = 1000 / tasks  # CPU seconds -> ms per task
    by_pid = {p["pid"]: p["cpu_s"] for p in sampler.result["processes"]}
    return {
        "server": round(by_pid[server.pid] * per_task, 4),
        "worker": round(by_pid[worker.pid] * per_task, 4),
        "postgres": round(sampler.result["cpu_s"]["postgres"] * per_task, 4),
    }


def drain(
    admin_dsn: str,
    *,
    tasks: int,
    concurrency: int,
    spy: str | None,
    spy_worker: bool,
    payload_bytes: int = 0,
    sleep_ms: int = 0,
    prefetch: int = 0,
) -> dict[str, Any]:
    """Fill ``tasks`` no-op tasks, start one worker, and time the drain. With
    ``payload_bytes``, each payload also carries a string of that many hex digits (random,
    so that PostgreSQL's compression does not shrink it away), as a real task's
    arguments would. With ``sleep_ms``, each task sleeps that long instead (``_waves``
    adds what the handlers' overlap shows); ``prefetch`` is the worker's."""
    if tasks < 1 or concurrency < 1:
        raise ValueError("tasks and concurrency must be at least 1")
    if payload_bytes < 0 or sleep_ms < 0 or prefetch < 0:
        raise ValueError("payload bytes, sleep ms and prefetch must be at least 0")
    work: dict[str, Any] = {"kind": "sleep", "ms": sleep_ms} if sleep_ms else {"kind": "noop"}
    if spy is not None:
        _py_spy()  # refuse before anything starts
    with _orbit(admin_dsn) as orbit:
        bodies = [
            task_body("bench", "bench", {"id": f"p{i}", "t": 0.0, **work, **_pad(payload_bytes)})
            for i in range(tasks)
        ]
        # The fill is the batch-enqueue workload: timed, with the CPU of each side
        # (this process is the client).
        with CpuSampler(interval=0) as filling:
            f0 = time.perf_counter()
            for start in range(0, tasks, 1000):
                orbit.client.submit_many(bodies[start : start + 1000])
            fill_s = time.perf_counter() - f0
        with psycopg.connect(orbit.url, autocommit=True) as cx:
            cx.execute("ANALYZE")
        # before the worker is there, off the timed drain (nothing to count yet: the
        # fill made no worker transactions)
        calls_before = _worker_calls(orbit.base)
        worker = _start_worker(orbit, concurrency, prefetch)
        done_sql = "SELECT count(*) FROM orbit_tasks WHERE state = 'succeeded'"
        with psycopg.connect(orbit.url, autocommit=True) as cx:

            def succeeded() -> int:
                row = cx.execute(done_sql).fetchone()
                return int(row[0]) if row else 0

            while succeeded() == 0:
                if worker.poll() is not None:
                    raise RuntimeError("the worker exited before running a task")
                time.sleep(0.01)
            # readings at the start and the end only: no sampling thread in the way
            target = worker.pid if spy_worker else orbit.server.pid
            with CpuSampler(interval=0) as sampler, _spying(spy, target):
                t0 = time.perf_counter()
                # The handlers' records first (file reads), then the count that says
                # the finishes are durable: a count(*) reads the whole table (7 ms a
                # poll at 20,000 tasks, a tenth of PostgreSQL's CPU per task when it
                # was polled all along). The harness waits the same way (wait_done).
                reader = RecordReader(orbit.work)
                finished = 0
                while finished < tasks or succeeded() < tasks:
                    _check_alive(orbit, worker, finished)
                    finished += sum(r.kind == "F" for r in reader.poll())
                    time.sleep(0.01)
                elapsed = time.perf_counter() - t0
            # read once the timed drain is over, outside the CPU sampler: the scrape
            # counts the task table, a tenth of a second of the server's time
            calls = _transactions(calls_before, _worker_calls(orbit.base), elapsed)
            # after the timed drain, on the connection that polled it
            shown: dict[str, Any] = {}
            if sleep_ms:
                shown.update(sleep_ms=sleep_ms, **_waves(cx, reader.finished()))
            if prefetch:
                shown.update(prefetch=prefetch, worker_slots=_session_slots(cx))
        filled = {p["pid"]: p["cpu_s"] for p in filling.result["processes"]}
        per_task = 1000 / tasks
        return {
            "tasks": tasks,
            "concurrency": concurrency,
            "tasks_per_s": round(tasks / elapsed, 1),
            **shown,
            "cpu_ms_per_task": _cpu_per_task(sampler, tasks, orbit.server, worker),
            "transactions": calls,
            "enqueue": {
                "batch": 1000,
                "tasks_per_s": round(tasks / fill_s, 1),
                "cpu_ms_per_task": {
                    "server": round(filled.get(orbit.server.pid, 0.0) * per_task, 4),
                    "client": round(filling.result["cpu_s"]["harness"] * per_task, 4),
                    "postgres": round(filling.result["cpu_s"]["postgres"] * per_task, 4),
                },
            },
        }


class Tally(NamedTuple):
    """One op's worker-protocol transactions, as the server's metrics count them."""

    calls: float
    seconds: float
    items: float


#: the sample of ``/metrics`` each of ``Tally``'s fields is read from
TALLY_SAMPLES = {
    "orbit_worker_transaction_seconds_count": "calls",
    "orbit_worker_transaction_seconds_sum": "seconds",
    "orbit_worker_transaction_items_total": "items",
}


def _worker_calls(base: str) -> dict[str, Tally]:
    """What the server's ``/metrics`` says of its worker-protocol transactions so far,
    by op."""
    text = httpx.get(f"{base}/metrics", timeout=30).raise_for_status().text
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            op, field = sample.labels.get("op"), TALLY_SAMPLES.get(sample.name)
            if op is not None and field is not None:
                found.setdefault(op, {})[field] = sample.value
    return {op: Tally(**fields) for op, fields in found.items()}


def _transactions(
    before: dict[str, Tally], after: dict[str, Tally], seconds: float
) -> dict[str, Any]:
    """Per op with calls between the two readings: how many, their mean size (tasks
    claimed, reports carried) and wall time, and how many were in flight on average over
    ``seconds`` (the timed drain's; the few calls made before its first success count
    too). One claim at a time reads up to 1."""
    shown: dict[str, Any] = {}
    for op, now in after.items():
        then = before.get(op, Tally(0.0, 0.0, 0.0))
        calls = now.calls - then.calls
        if calls > 0:
            spent = now.seconds - then.seconds
            shown[op] = {
                "calls": int(calls),
                "items_mean": round((now.items - then.items) / calls, 1),
                "ms_mean": round(spent / calls * 1000, 2),
                "in_flight": round(spent / seconds, 2),
            }
    return shown


def _waves(cx: psycopg.Connection[Any], records: Sequence[Record]) -> dict[str, Any]:
    """What the handlers' records and the database say of a drain of sleeping tasks:
    how many handlers ran at once on average, from the first start to the last end, and
    the time from each start's clock to its handler (p50 and p90). A task that ran
    twice counts once, by its last attempt and its last record; None where nothing
    could be measured."""
    last = {r.job_id: r for r in sorted(records, key=lambda r: r.started)}
    spans = [(r.started, r.ended) for r in last.values() if r.ended is not None]
    span = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    busy = sum(end - start for start, end in spans)
    rows = cx.execute(
        "SELECT DISTINCT ON (t.id) CAST(t.payload AS json)->>'id', a.started_at"
        " FROM orbit_tasks t JOIN orbit_attempts a ON a.task_id = t.id"
        " WHERE a.started_at IS NOT NULL ORDER BY t.id, a.number DESC"
    ).fetchall()
    # µs since the epoch (the database) against seconds (the records): milliseconds
    waits = [(last[job].started * 1e6 - at) / 1000 for job, at in rows if job in last]
    return {
        "in_flight_mean": round(busy / span, 1) if span > 0 else None,
        "start_to_handler_ms": _spread(waits, quantiles=(50, 90)) if waits else None,
    }


def _session_slots(cx: psycopg.Connection[Any]) -> int | None:
    """The slots the (one) worker's session declared, as the server recorded them."""
    row = cx.execute("SELECT max(max_concurrency) FROM orbit_sessions").fetchone()
    return None if row is None or row[0] is None else int(row[0])


def paced(
    admin_dsn: str,
    *,
    tasks: int,
    rate: float,
    concurrency: int = TUNED_CONCURRENCY,
    spy: str | None,
    spy_worker: bool,
) -> dict[str, Any]:
    """Submit ``tasks`` one at a time at ``rate`` per second to an idle worker with
    ``concurrency`` slots (the latency workload; the harness's tuned worker by default)
    and report enqueue→start percentiles, their stages (``STAGES``) and CPU per task."""
    if tasks < 1 or not rate > 0 or concurrency < 1:
        raise ValueError("tasks and concurrency must be at least 1 and the rate above 0")
    if spy is not None:
        _py_spy()
    with _orbit(admin_dsn) as orbit:
        worker = _start_worker(orbit, concurrency)
        reader = RecordReader(orbit.work)

        def submit_and_wait(ids: list[str], pace: float | None) -> None:
            t0 = time.perf_counter()
            for i, job_id in enumerate(ids):
                if pace is not None:
                    delay = t0 + i / pace - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                job = {"id": job_id, "t": time.time(), "kind": "noop"}
                orbit.client.submit("bench", "bench", job, retry_safe=True)
            wanted = set(ids)
            while wanted:
                _check_alive(orbit, worker, len(ids) - len(wanted))
                wanted.difference_update(r.job_id for r in reader.poll() if r.kind == "F")
                time.sleep(0.005)

        submit_and_wait(["warm-up"], None)
        time.sleep(0.2)  # let the worker settle back into waiting
        ids = [f"p{i}" for i in range(tasks)]
        target = worker.pid if spy_worker else orbit.server.pid
        with CpuSampler(interval=0) as sampler, _spying(spy, target):
            submit_and_wait(ids, rate)
        records = {r.job_id: r for r in reader.finished()}
        lat_ms = [(records[i].started - records[i].enqueued) * 1000 for i in ids]
        return {
            "tasks": tasks,
            "rate": rate,
            "concurrency": concurrency,
            "latency_ms": _spread(lat_ms, with_max=True),
            "stages_ms": _stages(orbit.url, {i: records[i] for i in ids}),
            "cpu_ms_per_task": _cpu_per_task(sampler, tasks, orbit.server, worker),
        }


#: The stages of a paced task's enqueue→start, each ending at a time the database or the
#: worker recorded (every clock here is this host's): the submit transaction's clock
#: (``created_at``, read after its first statement), the claim's (``claimed_at``), the
#: start's (``started_at``), and the worker's handler. In order: the HTTP submit, its
#: thread and its first round trip; the insert and its durable COMMIT, the wake, the
#: claim's first read; the claim's write, the push, the worker's start and its first
#: read; the start's write and durable COMMIT, the reply, the handler.
STAGES = ("to_submit_tx", "submit_to_claim", "claim_to_start", "start_to_handler")


def _spread(
    values: Sequence[float], *, with_max: bool = False, quantiles: Sequence[int] = (50, 99)
) -> dict[str, float]:
    spread = {f"p{p}": round(percentile(values, p), 3) for p in quantiles}
    return {**spread, "max": round(max(values), 3)} if with_max else spread


def _stages(url: str, records: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Where each paced task's enqueue→start went (``STAGES``): p50 and p99 of each,
    from the timestamps the database holds for it (its first attempt)."""
    with psycopg.connect(url) as cx:
        rows = cx.execute(
            "SELECT CAST(t.payload AS json)->>'id', t.created_at, a.claimed_at, a.started_at"
            " FROM orbit_tasks t JOIN orbit_attempts a ON a.task_id = t.id AND a.number = 1"
        ).fetchall()
    spans: dict[str, list[float]] = {name: [] for name in STAGES}
    for job_id, created, claimed, started in rows:
        record = records.get(job_id)
        if record is None:  # the warm-up task, timed while the worker settled
            continue
        marks = [record.enqueued * 1e6, created, claimed, started, record.started * 1e6]
        for name, (begin, end) in zip(STAGES, pairwise(marks), strict=True):
            spans[name].append((end - begin) / 1000)
    return {name: _spread(values) for name, values in spans.items()}


def _pad(size: int) -> dict[str, str]:
    """``{"pad": <size hex digits>}``, or nothing for 0."""
    return {"pad": os.urandom(size // 2 + 1).hex()[:size]} if size else {}


def _check_alive(orbit: _Orbit, worker: subprocess.Popen[bytes], finished: int) -> None:
    if worker.poll() is not None or orbit.server.poll() is not None:
        raise RuntimeError(f"a process exited with {finished} finished")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probe",
        description="Time one Orbit server and worker draining pre-enqueued tasks.",
    )
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks to drain")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=TUNED_CONCURRENCY,
        help=f"the worker's slots (default {TUNED_CONCURRENCY}, the tuned profile's)",
    )
    parser.add_argument("--py-spy", dest="spy", help="record a GIL profile into this file")
    parser.add_argument("--worker", action="store_true", help="profile the worker instead")
    parser.add_argument(
        "--paced",
        type=float,
        metavar="RATE",
        help="submit one at a time at RATE/s to an idle worker; report latency (no fill)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=0,
        metavar="N",
        help="pad each drained task's payload with N random hex digits (default 0)",
    )
    parser.add_argument(
        "--sleep-ms",
        type=int,
        default=0,
        metavar="MS",
        help="drain tasks that each sleep MS ms (the I/O-bound workload's; default 0: no-op)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=0,
        metavar="P",
        help="the worker's prefetch (Worker(prefetch=P); default 0, Orbit's own)",
    )
    parser.add_argument("--pg-dsn", default=DEFAULT_ADMIN_DSN, help="may CREATE DATABASE")
    args = parser.parse_args(argv)
    if args.paced is not None and (args.sleep_ms or args.prefetch or args.payload_bytes):
        parser.error("--sleep-ms, --prefetch and --payload-bytes are for a drain, not --paced")
    try:  # before anything starts, so a bad DSN is one line, not a traceback
        psycopg.connect(args.pg_dsn, connect_timeout=5).close()
    except psycopg.Error as exc:
        parser.error(f"--pg-dsn: cannot connect: {one_line_error(exc)}")
    # SIGTERM unwinds as Ctrl-C does: the server and worker stopped, the database dropped
    with interrupts_end_the_run():
        try:
            if args.paced is not None:
                result = paced(
                    args.pg_dsn,
                    tasks=args.tasks,
                    rate=args.paced,
                    concurrency=args.concurrency,
                    spy=args.spy,
                    spy_worker=args.worker,
                )
            else:
                result = drain(
                    args.pg_dsn,
                    tasks=args.tasks,
                    concurrency=args.concurrency,
                    spy=args.spy,
                    spy_worker=args.worker,
                    payload_bytes=args.payload_bytes,
                    sleep_ms=args.sleep_ms,
                    prefetch=args.prefetch,
                )
        except ValueError as exc:
            parser.error(str(exc))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
