"""A blocked event loop, with a real server (SQLite and PostgreSQL) and a real worker in
this process: the runner says the loop was blocked (the log said only ``lost: lease
expired``), never begins a handler whose lease ran out while its start's answer waited,
and never abandons, as one that "ignored cancellation", a plain function whose outcome
was already on its way when its cancel grace ran out."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orbit.worker.runner import LOOP_STALL_WARN_S, Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import api, fast, run_until, submit, wait_state  # noqa: F401

LEASE_S = 1.0  # the lease of the ``fast`` node (FAST's --lease-ttl)
STALL_WARNING = "the event loop was blocked for"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_blocked_loop_is_named_once_before_the_leases_it_cost(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two async handlers in turn block the loop with time.sleep, each well past the
    warning's bound and the renewal due at half of the 1 s lease, beside a plain function
    in its thread: one warning names the blocked loop (the second stall falls within its
    rate limit), ahead of the plain function's lost lease, which the stall cost."""
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    worker = Worker(fast.http, tokens.worker, concurrency=2)
    beside_started = threading.Event()
    ended: list[str] = []

    @worker.handler("beside")
    def beside(ctx: Context, payload: Any) -> str:
        beside_started.set()
        while not ctx.cancelled:
            time.sleep(0.01)
        ended.append(ctx.task_id)
        return "lost"

    @worker.handler("blocker")
    async def blocker(ctx: Context, payload: Any) -> str:
        await asyncio.to_thread(beside_started.wait, 30)
        time.sleep(LEASE_S / 2 + LOOP_STALL_WARN_S + 0.5)  # the mistake the docs warn of
        ended.append(ctx.task_id)
        return "too late"

    beside_id = submit(api, "beside")
    blockers = [submit(api, "blocker"), submit(api, "blocker")]
    asyncio.run(run_until(worker, lambda: len(ended) == 3 and not worker.running))

    for tid in (beside_id, *blockers):
        assert wait_state(api, tid, {"needs_review", "succeeded"})["state"] == "needs_review"
    lines = _warnings(caplog)
    stalls = [i for i, m in enumerate(lines) if m.startswith(STALL_WARNING)]
    assert len(stalls) == 1, lines
    assert "see docs/worker.md" in lines[stalls[0]], lines
    lost = [i for i, m in enumerate(lines) if f"(task {beside_id}) lost: lease expired" in m]
    assert lost and stalls[0] < lost[0], lines


def test_a_handler_whose_lease_ran_out_before_its_start_was_taken_never_runs(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An async handler submits a second task, then blocks the loop as soon as the server
    shows that task started (its start committed, so its answer is on its way or soon
    will be) and for longer than its whole lease. The answer is read only after the
    block, in a later turn of the loop than the blocking check: by the runner's clock
    the second lease has run out before its handler could begin, so it never begins
    (it ran, and its result was dropped). No timing luck: the order is the loop's."""
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    worker = Worker(fast.http, tokens.worker, concurrency=2)
    ran: list[str] = []
    late: list[str] = []
    blocked: list[bool] = []

    @worker.handler("late")
    async def late_handler(ctx: Context, payload: Any) -> str:
        ran.append(ctx.task_id)
        return "must not run"

    @worker.handler("blocker")
    async def blocker(ctx: Context, payload: Any) -> str:
        late.append(submit(api, "late"))
        while api.get(f"/v1/tasks/{late[0]}").json()["state"] != "running":
            await asyncio.sleep(0)  # one turn of the loop a look: the start's answer can
            # be read only in a later turn than the look that first sees it committed
        time.sleep(LEASE_S + 0.5)
        blocked.append(True)
        return "too late"

    submit(api, "blocker")
    asyncio.run(run_until(worker, lambda: bool(blocked) and not worker.running))

    assert ran == []
    task = wait_state(api, late[0], {"needs_review", "succeeded", "failed"})
    assert task["state"] == "needs_review" and task["attempts_used"] == 1, task
    reason = f"(task {late[0]}) lost: lease expired before the handler began"
    assert any(reason in m for m in _warnings(caplog)), _warnings(caplog)


GRACE_S = 1.0


@pytest.fixture
def queue_api(node: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    """The admin API of a node with the default (30 s) lease, and its queue ``q``."""
    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as client:
        client.post("/v1/queues", json={"name": "q", "max_concurrency": 50, "rate": 0})
        yield client


def test_a_plain_function_that_ended_as_its_grace_ran_out_is_not_abandoned(
    node: Node, tokens: Tokens, queue_api: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled plain function ends while the loop is blocked across the end of its
    cancel grace, in a callback run in the same turn as, and just after, the grace's
    timer: its outcome is queued on the loop when the wait for it times out. It ended
    within its grace's turn; it is neither abandoned nor logged as having ignored its
    cancel, and its task ends cancelled."""
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    worker = Worker(node.http, tokens.worker, concurrency=2, cancel_grace=GRACE_S)
    threads: list[threading.Thread] = []
    started, cancel_seen, release = threading.Event(), threading.Event(), threading.Event()
    done: list[str] = []

    @worker.handler("cooperative")
    def cooperative(ctx: Context, payload: Any) -> str:
        threads.append(threading.current_thread())
        started.set()
        while not ctx.cancelled:
            time.sleep(0.01)
        cancel_seen.set()
        release.wait(30)
        done.append("cooperative")
        return "stopped"

    def let_it_end() -> None:
        release.set()
        threads[0].join(30)  # its outcome is handed to the loop before this returns

    @worker.handler("blocker")
    async def blocker(ctx: Context, payload: Any) -> str:
        await asyncio.to_thread(started.wait, 30)
        reply = queue_api.post(f"/v1/tasks/{target}/cancel")
        assert reply.status_code == 200, reply.text
        await asyncio.to_thread(cancel_seen.wait, 30)
        # The loop blocked past the grace's end: its timer and this callback (due later)
        # are both run in the loop's next turn, in that order.
        time.sleep(GRACE_S + 0.2)
        asyncio.get_running_loop().call_later(0, let_it_end)
        done.append("blocker")
        return "blocked"

    target = submit(queue_api, "cooperative")
    submit(queue_api, "blocker")
    asyncio.run(run_until(worker, lambda: len(done) == 2 and not worker.running))

    assert worker.abandoned == []
    assert not any("ignored cancellation" in r.getMessage() for r in caplog.records)
    assert wait_state(queue_api, target, {"cancelled", "succeeded"})["state"] == "cancelled"
