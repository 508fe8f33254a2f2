"""A tour of the task lifecycle on an embedded SQLite store (``python -m orbit.demo``).

Until the server and the ``orbit dev`` command land, this is the README's first command:
it opens ``./.orbit/demo.db``, plays a worker in-process, and drives four tasks through
the rules every Orbit deployment follows — one succeeds, one fails once and is retried,
one is cancelled while running (cancel wins over its late result), and one whose worker
goes silent ends in ``needs_review`` because it is not ``retry_safe``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from orbit.core.errors import Rejected
from orbit.core.model import SECOND, Backoff, Capability, Outcome, TaskSpec
from orbit.store import Store, StoreConfig, open_store


def _wait_for(store: Store, task_id: str, states: set[str], timeout: float = 10.0) -> str:
    """Reap until the task reaches one of ``states`` (the clock does the work)."""
    end = time.monotonic() + timeout
    while True:
        state = str(store.task_get(task_id).state)
        if state in states or time.monotonic() > end:
            return state
        store.reap()
        time.sleep(0.05)


def run(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(path.name + "*"):
        leftover.unlink()
    config = StoreConfig(claim_ttl_us=2 * SECOND, lease_ttl_us=SECOND, session_ttl_us=30 * SECOND)
    store = open_store(f"sqlite:///{path}", config)
    store.queue_create("demo", max_concurrency=4, rate=50, burst=10)
    quick = Backoff(base_us=200_000, factor=2.0, max_us=SECOND)

    def submit(name: str, **kw: object) -> str:
        spec = TaskSpec(queue="demo", handler="demo.echo", payload={"name": name}, **kw)  # type: ignore[arg-type]
        return store.task_submit(spec).task.id

    ids = {
        "succeeds": submit("succeeds"),
        "retries": submit("retries", backoff=quick),
        "cancelled": submit("cancelled"),
        "silent": submit("silent", retry_safe=False),
    }
    session, _secret = store.session_open(
        name="demo-worker",
        node_id="local",
        capabilities=[Capability("demo.echo", 4)],
        max_concurrency=4,
    )
    sid, epoch = session.id, session.epoch
    names = {v: k for k, v in ids.items()}
    silent = None
    for grant in store.attempt_claim_many(sid, epoch, 4):
        a = grant.attempt
        store.attempt_start(sid, epoch, a.id, a.fence)
        name = names[grant.task.id]
        if name == "succeeds":
            store.attempt_finish(sid, epoch, a.id, a.fence, Outcome.success({"echo": name}))
        elif name == "retries":
            store.attempt_finish(sid, epoch, a.id, a.fence, Outcome.failure("FLAKY", "once"))
        elif name == "cancelled":
            store.task_cancel(grant.task.id)
            store.attempt_finish(sid, epoch, a.id, a.fence, Outcome.success("late result"))
        else:  # "silent": the worker never reports; its 1 s lease runs out.
            silent = a
    _wait_for(store, ids["retries"], {"scheduled", "queued"})
    end = time.monotonic() + 10
    while time.monotonic() < end:
        grants = store.attempt_claim_many(sid, epoch, 4)
        for grant in grants:
            a = grant.attempt
            store.attempt_start(sid, epoch, a.id, a.fence)
            store.attempt_finish(sid, epoch, a.id, a.fence, Outcome.success("second try"))
        if grants:
            break
        store.reap()
        time.sleep(0.05)
    _wait_for(store, ids["silent"], {"needs_review"})

    print(f"Orbit demo on SQLite ({path})\n")
    for name, task_id in ids.items():
        task = store.task_get(task_id)
        story = " -> ".join(
            str(e["task_to"]) for e in store.event_list(task_id=task_id) if e["task_to"]
        )
        print(f"  {name:<10} {task.state:<13} attempts {task.attempts_used}  {story}")
    if silent is not None:
        try:
            store.attempt_finish(sid, epoch, silent.id, silent.fence, Outcome.success("late"))
        except Rejected as exc:
            print(f"\n  the silent worker's late result is refused: {exc}")
    rejected = [e for e in store.event_list() if e["kind"] == "rejected"]
    print(f"  rejected reports kept as evidence: {len(rejected)}")
    print(
        "\nNext: inspect the history with `sqlite3 "
        f"{path} 'select id, kind, task_from, task_to, code from orbit_events'`,"
        "\nread docs/concepts.md, and run the tests with ./scripts/test."
    )
    states = {str(store.task_get(i).state) for i in ids.values()}
    store.close()
    return 0 if states == {"succeeded", "cancelled", "needs_review"} else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--db",
        type=Path,
        default=Path(".orbit/demo.db"),
        help="SQLite file to write (default: .orbit/demo.db)",
    )
    raise SystemExit(run(parser.parse_args().db))


if __name__ == "__main__":
    main()
