"""The server's WebSocket frames for a drain, in one process: the pushes of claimed
tasks (``tasks``), the worker's ``start_many`` and ``finish_many`` frames read, and
their answers (``started_many``, ``finished_many``) written, from real store records
(SQLite, no server, no worker). It answers "did a change make the gateway's frames
cheaper?" with figures a shared machine moves little:

    python -m benchmarks.frames --tasks 10000                      # µs of CPU a task
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.0 \\
        python -m benchmarks.frames --tasks 2000 --phase push --reps 0
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.5 \\
        python -m benchmarks.frames --tasks 2000 --phase push --reps 5

The records are made once (fill, claim, start and finish through ``Store``, in batches
of ``BATCH`` as a drain's are, about 180); a phase is then run ``--reps`` times over all
of them. Under callgrind a phase's instructions a task are the difference between runs
with ``--reps R`` and ``--reps 0``, divided by R times the tasks. The worker's frames are
written as the worker writes them (``orbit.worker.connection.frame_text``), the tasks'
payloads are the probe's."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orbit.core.errors import OrbitError
from orbit.core.model import SECOND, Capability, Grant, Lease, Outcome, Receipt, TaskSpec
from orbit.gctune import tune_for_throughput
from orbit.protocol.reports import FinishBatch, StartBatch
from orbit.server import gateway
from orbit.server.metrics import Metrics
from orbit.store import StoreConfig, open_store
from orbit.worker.connection import frame_text, outcome

PHASES = ("push", "start", "finish")
BATCH = 180


@dataclass
class Records:
    """A drain's records, batch by batch, and the worker's frames for them."""

    grants: list[list[Grant]]
    leases: list[list[Lease | OrbitError]]
    receipts: list[list[Receipt | OrbitError]]
    start_frames: list[str]
    finish_frames: list[str]
    metrics: Metrics


def make_records(tasks: int, where: Path) -> Records:
    """Fill, claim, start and finish ``tasks`` tasks on a fresh SQLite store."""
    hour = 3600 * SECOND
    config = StoreConfig(claim_ttl_us=hour, lease_ttl_us=hour, session_ttl_us=hour)
    store = open_store(f"sqlite:///{where / 'orbit.db'}", config)
    try:
        store.queue_create("bench", max_concurrency=tasks, rate=0)
        specs = [
            TaskSpec(queue="bench", handler="h", payload={"id": f"p{i}", "t": 0.0, "kind": "noop"})
            for i in range(tasks)
        ]
        for at in range(0, tasks, 1000):
            store.task_submit_many(specs[at : at + 1000])
        session, _ = store.session_open(
            name="w", node_id="n", capabilities=[Capability("h", tasks)], max_concurrency=tasks
        )
        records = Records([], [], [], [], [], Metrics(store))
        while sum(len(g) for g in records.grants) < tasks:
            grants = store.attempt_claim_many(session.id, session.epoch, BATCH)
            assert grants, "nothing left to claim"
            records.grants.append(list(grants))
        for n, grants in enumerate(records.grants):
            wire = [(g.attempt.id, str(g.attempt.fence)) for g in grants]
            items = [{"attempt_id": a, "fence": f} for a, f in wire]
            start = {"type": "start_many", "items": items, "req_id": f"s{n}"}
            records.start_frames.append(frame_text(start, plain=True))
            starts = [(g.attempt.id, g.attempt.fence) for g in grants]
            records.leases.append(store.attempt_start_many(session.id, session.epoch, starts))
            ended = [{"attempt_id": a, "fence": f, "outcome": outcome()} for a, f in wire]
            finish = {"type": "finish_many", "items": ended, "req_id": f"f{n}"}
            records.finish_frames.append(frame_text(finish, plain=True))
            done = [(a, f, Outcome.success(None)) for a, f in starts]
            records.receipts.append(store.attempt_finish_many(session.id, session.epoch, done))
        return records
    finally:
        store.close()


def push(records: Records) -> None:
    """Each batch of grants as the ``tasks`` frame pushed to the worker."""
    for grants in records.grants:
        gateway.tasks_frame(None, grants)


def start(records: Records) -> None:
    """Each ``start_many`` frame read, and its answer written."""
    for frame, leases in zip(records.start_frames, records.leases, strict=True):
        batch = gateway.read_request(frame)
        assert isinstance(batch, StartBatch)
        reply = gateway.started_many_wire(batch.req_id, batch.items, leases, records.metrics)
        gateway.wire_text(reply)


def finish(records: Records) -> None:
    """Each ``finish_many`` frame read, and its answer written."""
    for frame, receipts in zip(records.finish_frames, records.receipts, strict=True):
        batch = gateway.read_request(frame)
        assert isinstance(batch, FinishBatch)
        reply = gateway.finished_many_wire(batch.req_id, batch.items, receipts, records.metrics)
        gateway.wire_text(reply)


WORK: dict[str, Callable[[Records], None]] = {"push": push, "start": start, "finish": finish}


def run(tasks: int, phases: tuple[str, ...], reps: int) -> dict[str, float]:
    """Each phase's thread CPU in µs a task, over ``reps`` runs."""
    with tempfile.TemporaryDirectory(prefix="orbit-frames-") as where:
        records = make_records(tasks, Path(where))
    tune_for_throughput()
    spent: dict[str, float] = {}
    for phase in phases:
        began = time.thread_time()
        for _ in range(reps):
            WORK[phase](records)
        spent[phase] = (time.thread_time() - began) * 1e6 / (tasks * max(reps, 1))
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--phase", choices=(*PHASES, "all"), default="all")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.tasks < 1 or args.reps < 0:
        parser.error("--tasks must be at least 1, --reps at least 0")
    phases = PHASES if args.phase == "all" else (args.phase,)
    spent = run(args.tasks, phases, args.reps)
    print(json.dumps({"tasks": args.tasks, "reps": args.reps, "us_a_task": spent}))


if __name__ == "__main__":
    main()
