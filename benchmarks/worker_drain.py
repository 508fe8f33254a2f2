"""A real ``orbit.Worker`` draining a fake server, for the worker process's CPU a task
with nothing else in the process: no store, no gateway, no database. It answers "did a
change make the worker cheaper?" with figures a shared machine moves little:

    python -m benchmarks.worker_drain --tasks 20000                # µs of worker CPU a task
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.5k \\
        python -m benchmarks.worker_drain --tasks 5000
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.25k \\
        python -m benchmarks.worker_drain --tasks 25000

Under callgrind the worker's instructions a task are the difference of the two runs'
totals (``callgrind_annotate /tmp/cg.25k | head``), divided by the difference of their
tasks (20,000): the start-up (imports, the server's launch, the hello) cancels out.

The server is a loopback WebSocket server in a process of its own (``--serve``, started
by the run; callgrind, without ``--trace-children``, does not follow it). It speaks the
frames ``orbit/server/gateway.py`` writes (``docs/protocol.md``): a ``welcome`` to the
hello, ``tasks`` pushes of ``BATCH`` tasks at a time (the probe's payloads) up to the
worker's concurrency, ``started_many`` and ``finished_many`` with a lease or a receipt an
item, each ``DELAY`` after its request (a drain's store batches take about that), and
``ack`` to the rest. The worker is tuned as ``orbit worker --profile throughput`` runs
it: concurrency 1,500, ``tune_for_throughput``, uvloop when installed; its handler is a
no-op coroutine (``--result dict``: one returning a small dict). The run ends when the
worker has had every finish acknowledged; it then drains and exits as on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from websockets.asyncio.server import ServerConnection, serve

from orbit import aio
from orbit.gctune import tune_for_throughput
from orbit.worker.runner import Context, Worker

BATCH = 180
DELAY = 0.02
CONCURRENCY = 1500
#: seconds of lease a start grants: longer than any run, so no renewal is due
LEASE_LEFT = 3600.0
_DIGEST = "sha256:" + "ab" * 32
#: seconds with no finish acknowledged before a run gives up (callgrind is slow)
STALLED = 120.0


class FakeServer:
    """One worker's session: push ``tasks`` tasks, answer its reports."""

    def __init__(self, tasks: int, delay: float = DELAY) -> None:
        self.left = tasks  # not pushed yet
        self.delay = delay
        self.in_flight = 0  # pushed, not finished
        self.limit = 0  # the session's max_concurrency, from the hello
        self.pushed = 0
        self.done = asyncio.Event()  # the connection is over
        self._answering: set[asyncio.Task[None]] = set()

    async def serve(self, ws: ServerConnection) -> None:
        try:
            async for frame in ws:
                msg = orjson.loads(frame)
                kind, rid = msg["type"], msg.get("req_id")
                if kind == "hello":
                    self.limit = msg["max_concurrency"]
                    welcome = {
                        "type": "welcome",
                        "req_id": rid,
                        "session_id": "01a229a4-5555-7000-8000-000000000001",
                        "epoch": "1",
                        "resume_secret": "secret",
                        "heartbeat_interval": 20.0,
                    }
                    await ws.send(orjson.dumps(welcome).decode())
                    await self._push(ws)
                elif kind in ("start_many", "finish_many", "start", "finish"):
                    # Answered later, as the store's batch would be, reading the next.
                    answer = asyncio.create_task(self._answer(ws, msg))
                    self._answering.add(answer)
                    answer.add_done_callback(self._answering.discard)
                elif kind == "renew":
                    leases = [_lease(a) for a in msg["attempt_ids"]]
                    await ws.send(_text({"type": "renewed", "req_id": rid, "leases": leases}))
                else:  # drain, heartbeat, release, progress
                    await ws.send(_text({"type": "ack", "req_id": rid, "op": kind}))
        finally:
            self.done.set()

    async def _answer(self, ws: ServerConnection, msg: dict[str, Any]) -> None:
        kind, rid = msg["type"], msg["req_id"]
        await asyncio.sleep(self.delay)
        with contextlib.suppress(Exception):  # the worker went away meanwhile
            if kind == "start":
                reply = {"type": "started", "req_id": rid, "lease": _lease(msg["attempt_id"])}
            elif kind == "start_many":
                results = [
                    {"attempt_id": i["attempt_id"], "lease": _lease(i["attempt_id"]), "error": None}
                    for i in msg["items"]
                ]
                reply = {"type": "started_many", "req_id": rid, "results": results}
            elif kind == "finish":
                self.in_flight -= 1
                reply = {"type": "finished", "req_id": rid, "receipt": _receipt(msg)}
            else:
                items = msg["items"]
                self.in_flight -= len(items)
                results = [
                    {"attempt_id": i["attempt_id"], "receipt": _receipt(i), "error": None}
                    for i in items
                ]
                reply = {"type": "finished_many", "req_id": rid, "results": results}
            await ws.send(_text(reply))
            await self._push(ws)

    async def _push(self, ws: ServerConnection) -> None:
        """``tasks`` frames of up to BATCH tasks while the session has room."""
        while self.left and self.in_flight < self.limit:
            n = min(BATCH, self.left, self.limit - self.in_flight)
            tasks = [_assignment(self.pushed + i) for i in range(n)]
            self.left -= n
            self.in_flight += n
            self.pushed += n
            await ws.send(_text({"type": "tasks", "req_id": None, "tasks": tasks}))


def _text(message: dict[str, Any]) -> str:
    return orjson.dumps(message).decode()


def _assignment(n: int) -> dict[str, Any]:
    """Task ``n`` as ``gateway.tasks_frame`` writes it (``views.assignments_wire``)."""
    return {
        "task_id": f"01a229a4-555a-7c20-92ff-{n:012x}",
        "attempt_id": f"01a229a4-55fa-7a0c-a53f-{n:012x}",
        "fence": "1",
        "handler": "bench",
        "queue": "bench",
        "tenant": "default",
        "payload": {"id": f"p{n}", "t": 0.0, "kind": "noop"},
        "attempt": 1,
        "retry_safe": False,
        "deadline": None,
        "deadline_left": None,
        "attempt_timeout": None,
        "claim_expires_at": "2026-12-05T12:00:00.000000Z",
    }


def _lease(attempt_id: str) -> dict[str, Any]:
    """A start's lease as ``views.lease_wire`` writes it."""
    return {
        "attempt_id": attempt_id,
        "status": "ok",
        "lease_expires_at": "2026-12-05T13:00:00.000000Z",
        "lease_left": LEASE_LEFT,
    }


def _receipt(item: dict[str, Any]) -> dict[str, Any]:
    """A finish's receipt as ``views.receipt_wire`` writes it."""
    attempt_id = item["attempt_id"]
    return {
        "task_id": "01a229a4-555a-7c20-92ff-" + attempt_id[-12:],
        "attempt_id": attempt_id,
        "fence": item["fence"],
        "task_state": "succeeded",
        "attempt_state": "succeeded",
        "result_digest": _DIGEST,
        "result_version": "1",
    }


@contextlib.asynccontextmanager
async def fake_server(tasks: int, delay: float = DELAY) -> AsyncIterator[tuple[int, FakeServer]]:
    """A ``FakeServer`` for one worker on a loopback port, in this event loop."""
    server = FakeServer(tasks, delay)
    async with serve(server.serve, "127.0.0.1", 0, compression=None) as listening:
        yield next(iter(listening.sockets)).getsockname()[1], server


async def _serve_one(tasks: int, delay: float) -> None:
    """``--serve``: print the port, serve one worker, return once it has gone."""
    async with fake_server(tasks, delay) as (port, server):
        print(port, flush=True)
        await server.done.wait()


async def _noop(ctx: Context, payload: Any) -> None:
    return None


async def _small_dict(ctx: Context, payload: Any) -> dict[str, Any]:
    return {"id": ctx.attempt_id.replace("-", ""), "n": 1}


HANDLERS = {"none": _noop, "dict": _small_dict}


async def drain(port: int, tasks: int, concurrency: int = CONCURRENCY, result: str = "none") -> int:
    """Run a worker against the server on ``port`` until ``tasks`` finishes are
    acknowledged, then stop it; its exit status (0: every outcome confirmed)."""
    worker = Worker(f"http://127.0.0.1:{port}", "bench", name="bench", concurrency=concurrency)
    worker.handler("bench")(HANDLERS[result])
    run = asyncio.create_task(worker.arun())
    finished, since = 0, time.monotonic()
    while worker.finished < tasks and not run.done():
        await asyncio.sleep(0.05)
        if worker.finished > finished:
            finished, since = worker.finished, time.monotonic()
        elif time.monotonic() - since > STALLED:
            worker.stop()
            raise RuntimeError(f"no finish for {STALLED:.0f} s, {finished} of {tasks} done")
    worker.stop()
    return await run


def measure(tasks: int, concurrency: int, result: str, delay: float) -> dict[str, Any]:
    """A drain of ``tasks`` against a server process: the worker's CPU a task."""
    serve_args = ["--serve", "--tasks", str(tasks), "--delay", str(delay)]
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.worker_drain", *serve_args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        tune_for_throughput()
        began, cpu = time.monotonic(), time.process_time()
        status = aio.run(drain(port, tasks, concurrency, result), leftovers=1.0)
        cpu, wall = time.process_time() - cpu, time.monotonic() - began
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return {
        "tasks": tasks,
        "result": result,
        "status": status,
        "worker_cpu_us_a_task": round(cpu * 1e6 / tasks, 2),
        "tasks_a_second": round(tasks / wall),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--result", choices=sorted(HANDLERS), default="none")
    parser.add_argument("--delay", type=float, default=DELAY, help="seconds to answer a report")
    parser.add_argument("--serve", action="store_true", help="be the server (the run starts it)")
    args = parser.parse_args()
    if args.tasks < 1 or args.concurrency < 1 or args.delay < 0:
        parser.error("--tasks and --concurrency must be at least 1, --delay at least 0")
    if args.serve:
        asyncio.run(_serve_one(args.tasks, args.delay))
        return
    print(json.dumps(measure(args.tasks, args.concurrency, args.result, args.delay)))


if __name__ == "__main__":
    main()
