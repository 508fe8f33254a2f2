"""Dispatch when the attached workers are full, or a shared cap holds every claim back
(both backends).

A claim for a session with no free slot (``Grants.full``) can find nothing until one of
its own attempts ends, and a claim held back only by what every session shares (a
queue's, a tenant's or the global cap, a rate) finds what a claim for a session of the
same handlers would. Both used to skip nobody: with every worker busy, each submit cost
a claim transaction per connected worker (200 busy workers, a submit: ~50 claims).

The dispatcher now skips a full connection until its worker reports something that may
free a slot (a finish, a release, a capacity update, a start refused for an attempt
that ended meanwhile) or a poll round comes. The wake tests here make sure no such free
is lost: the poll is set to ten minutes where it must not be what delivers the task.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import httpx
import pytest
from fastapi import WebSocket

from orbit.core.model import TaskSpec
from orbit.server.gateway import WorkerConnection
from orbit.store import Store
from orbit.worker import WorkerConnection as Worker
from orbit.worker.connection import ServerError, outcome
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_dispatch_rounds import RecordingSocket, Rig
from tests.store.helpers import queue, worker

WAIT = 30.0  # a bound for a push that comes at once; never reached when it does
LONG_POLL = "600"  # seconds: the poll round cannot be what delivers a task in time

# ---------------------------------------------------------------- claims per submit


def _fill(rig: Rig, sessions: int, handlers: dict[str, int], slots: int) -> list[RecordingSocket]:
    """``sessions`` workers, each given all the work it can take by one round."""
    sockets = [rig.attach(handlers, slots=slots) for _ in range(sessions)]
    each = min(slots, sum(handlers.values()))
    for _ in range(sessions * each):
        rig.submit()
    rig.round()
    assert [len(s.task_ids) for s in sockets] == [each] * sessions
    return sockets


def test_full_workers_cost_no_claim_per_submit(store: Store) -> None:
    """Eight workers of one slot each, all busy: a submit claims for none of them (it
    was a claim each, every submit). The task stays queued for the first to free."""
    rig = Rig(store, queue_cap=100)
    sockets = _fill(rig, 8, {"h": 1}, slots=1)
    rig.claims.clear()
    for _ in range(5):
        rig.submit()
        rig.round()
    assert len(rig.claims) <= 5, len(rig.claims)
    assert [len(s.task_ids) for s in sockets] == [1] * 8


def test_workers_full_by_their_handlers_capacities_are_skipped(store: Store) -> None:
    """Full by every handler's capacity, with ``max_concurrency`` to spare: as full."""
    rig = Rig(store, queue_cap=100)
    _fill(rig, 6, {"h": 1}, slots=5)  # one running, four slots no handler can use
    rig.claims.clear()
    for _ in range(4):
        rig.submit()
        rig.round()
    assert len(rig.claims) <= 4, len(rig.claims)


@pytest.mark.parametrize("limit", ["queue", "tenant", "global", "rate"])
def test_a_shared_cap_reached_costs_one_claim_per_submit(store: Store, limit: str) -> None:
    """Workers with free slots, but a cap every session shares reached: the first claim
    of a round finds it, and the workers of the same handlers are skipped (it was a
    claim each, all held back by the same cap)."""
    rig = Rig(store, queue_cap=2 if limit == "queue" else 100)
    if limit == "tenant":
        store.tenant_limit_set("default", 2)
    elif limit == "global":
        store.global_limit_set(2)
    elif limit == "rate":  # two tokens, and the test's clock never moves to refill one
        queue(store, "r", rate=0.001, burst=2)
    handler = {"h": 2}
    sockets = [rig.attach(handler, slots=2) for _ in range(8)]

    def submit() -> None:
        if limit == "rate":
            store.task_submit(TaskSpec(queue="r", handler="h"))
        else:
            rig.submit()

    submit()
    submit()
    rig.round()
    assert sum(len(s.task_ids) for s in sockets) == 2
    rig.claims.clear()
    for _ in range(5):
        submit()
        rig.round()
    assert len(rig.claims) <= 5 + 1, len(rig.claims)
    assert sum(len(s.task_ids) for s in sockets) == 2


def test_a_full_worker_freed_is_offered_again_after_a_round_that_skipped_it(
    store: Store,
) -> None:
    """The order a finish meets on a real node: its commit wakes a round (the permit it
    freed) that still finds the worker marked full and skips it, and only then does the
    gateway hear the report returned and clear the mark (``slots_freed``). That clear
    must wake another round, or the queued task waits for the poll."""
    rig = Rig(store, queue_cap=100)
    session, _ = worker(store=store, handlers={"h": 1}, max_concurrency=1)
    socket = RecordingSocket()
    conn = WorkerConnection(cast(WebSocket, socket), session, push=True)
    rig.dispatcher.attach(conn)
    first = rig.submit()
    rig.round()
    assert socket.task_ids == [first] and conn.full
    second = rig.submit()
    rig.round()
    assert socket.task_ids == [first]  # skipped: full
    assert store.session_release_claims(session.id, session.epoch) == 1  # the slot frees
    rig.round()  # the commit's wake: the mark is not cleared yet
    assert socket.task_ids == [first]
    dispatcher = rig.dispatcher
    dispatcher._wake.clear()
    dispatcher.slots_freed(conn)  # the report returned
    assert dispatcher._wake.is_set()
    rig.round()
    assert len(socket.task_ids) == 2 and set(socket.task_ids) <= {first, second}


# ---------------------------------------------------------------- a real server


def _claims(http: httpx.Client) -> int:
    text = http.get("/metrics").text
    found = re.search(r'orbit_worker_transaction_seconds_count\{op="claim"\} (\S+)', text)
    assert found is not None
    return int(float(found.group(1)))


@contextmanager
def _admin(node: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=headers) as http:
        http.post("/v1/queues", json={"name": "q", "max_concurrency": 1000, "rate": 0})
        yield http


async def _submit(http: httpx.AsyncClient, handler: str = "h") -> str:
    reply = await http.post("/v1/tasks", json={"queue": "q", "handler": handler, "payload": {}})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["task"]["id"])


async def _tasks(conn: Worker) -> list[dict[str, Any]]:
    """The next ``tasks`` push (other pushes are not expected here)."""
    message = await conn.next_push(WAIT)
    assert message["type"] == "tasks", message
    return list(message["tasks"])


async def _workers(node: Node, tokens: Tokens, n: int, slots: int = 1) -> list[Worker]:
    conns = []
    for i in range(n):
        conn = await Worker.connect(node.ws, tokens.worker)
        await conn.hello(f"w{i}", {"h": slots}, slots, push=True)
        conns.append(conn)
    return conns


async def _full_worker_whose_claimed_task_is_cancelled(
    ah: httpx.AsyncClient, node: Node, tokens: Tokens
) -> tuple[Worker, dict[str, Any], str]:
    """A one-slot worker holding a claimed task, another task queued behind it, and the
    claimed one cancelled: the worker, the cancelled task's push, the queued task's id."""
    (conn,) = await _workers(node, tokens, 1)
    await _submit(ah)
    (task,) = await _tasks(conn)
    queued = await _submit(ah)
    cancelled = await ah.post(f"/v1/tasks/{task['task_id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    return conn, task, queued


@pytest.fixture
def slow_poll_node(nodes: Any) -> Node:
    return nodes(args=["--poll-interval", LONG_POLL])


def test_busy_workers_cost_a_claim_per_submit_not_per_worker(
    slow_poll_node: Node, tokens: Tokens
) -> None:
    """The reviewer's case on a real server: every worker busy, single submits. Each
    submit is followed by one for handler ``g``, whose worker's push says a round has run
    since the first (that worker is attached last, so claimed for last)."""
    node = slow_poll_node
    sessions, submits = 10, 6

    async def scenario(http: httpx.Client) -> int:
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=headers) as ah:
            busy = await _workers(node, tokens, sessions)
            other = await Worker.connect(node.ws, tokens.worker)
            await other.hello("g", {"g": 100}, 100, push=True)
            for _ in range(sessions):
                await _submit(ah)
            for conn in busy:
                assert len(await _tasks(conn)) == 1
            await _submit(ah, "g")  # settles the rounds the fill woke
            await _tasks(other)
            before = _claims(http)
            for _ in range(submits):
                await _submit(ah)
                await _submit(ah, "g")
                await _tasks(other)
            used = _claims(http) - before
            for conn in [*busy, other]:
                await conn.close()
            return used

    with _admin(node, tokens) as http:
        used = asyncio.run(scenario(http))
    # one for each ``g`` task, and a spare for a round woken twice; it was a claim per
    # busy worker (ten) for each submit
    assert used <= 2 * submits + 2, used


@pytest.mark.parametrize("report", ["finish", "finish_many", "release", "capacity"])
def test_a_full_worker_gets_the_next_task_when_it_frees_a_slot(
    slow_poll_node: Node, tokens: Tokens, report: str
) -> None:
    """A full worker's own report frees its slot: the queued task is pushed to it at
    once, not at the poll (ten minutes). The dispatcher heard of the free from the
    commit before the gateway cleared the worker's mark: the clear wakes it again."""
    node = slow_poll_node

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=headers) as ah:
            conns = await _workers(node, tokens, 3)
            for _ in conns:
                await _submit(ah)
            held = [(await _tasks(conn))[0] for conn in conns]
            if report != "release":
                for conn, task in zip(conns, held, strict=True):
                    await conn.start(task["attempt_id"], task["fence"])
            queued = await _submit(ah)  # every worker is full: it waits
            conn, task = conns[1], held[1]
            if report == "finish":
                await conn.finish(task["attempt_id"], task["fence"], result=1)
            elif report == "finish_many":
                items = [(task["attempt_id"], task["fence"], outcome(result=1))]
                await conn.finish_many(items)
            elif report == "release":
                await conn.release(task["attempt_id"], task["fence"])
            else:
                capabilities = [{"handler": "h", "capacity": 2}]
                message = {"type": "capacity", "seq": "1", "max_concurrency": 2}
                await conn.request({**message, "capabilities": capabilities})
            pushed = await _tasks(conn)
            assert [t["task_id"] for t in pushed] == [queued] or (
                report == "release" and len(pushed) == 1
            )
            for c in conns:
                assert c is conn or c.pushed.empty()
                await c.close()

    with _admin(node, tokens):
        asyncio.run(scenario())


def test_a_full_worker_whose_claimed_task_is_cancelled_gets_the_next(
    slow_poll_node: Node, tokens: Tokens
) -> None:
    """A task cancelled while claimed frees its worker's slot with no report from the
    worker; its start is then refused, and that offers to it again: the queued task
    comes at once, not at the poll."""
    node = slow_poll_node

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=headers) as ah:
            conn, task, queued = await _full_worker_whose_claimed_task_is_cancelled(
                ah, node, tokens
            )
            with pytest.raises(ServerError):
                await conn.start(task["attempt_id"], task["fence"])
            assert [t["task_id"] for t in await _tasks(conn)] == [queued]
            await conn.close()

    with _admin(node, tokens):
        asyncio.run(scenario())


def test_a_full_worker_freed_by_the_reaper_gets_work_at_once(nodes: Any, tokens: Tokens) -> None:
    """A slot freed where no report of the worker says so (its claim lease expired, the
    reaper released the attempt, as it ends a timed-out one) frees a permit, which
    clears every full mark: the worker, skipped as full since, is offered again then,
    not at the poll round (ten minutes here; it waited for it)."""
    node = nodes(
        args=["--poll-interval", LONG_POLL, "--claim-ttl", "0.5", "--reap-interval", "0.1"]
    )

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=headers) as ah:
            (conn,) = await _workers(node, tokens, 1)
            first = await _submit(ah)
            (task,) = await _tasks(conn)
            assert task["task_id"] == first
            second = await _submit(ah)
            # never started: the claim lease runs out, and the task is queued again
            pushed = await _tasks(conn)
            assert len(pushed) == 1 and pushed[0]["task_id"] in (first, second)
            await conn.close()

    with _admin(node, tokens):
        asyncio.run(scenario())


def test_a_full_workers_claimed_task_cancelled_frees_its_slot_with_no_report(
    slow_poll_node: Node, tokens: Tokens
) -> None:
    """A task cancelled while claimed, whose worker sends nothing after (a prefetched
    attempt it held waiting is dropped without a report): the cancel's release frees a
    permit, which clears the full mark, and the queued task is pushed at once, not at
    the poll round (it waited for it)."""
    node = slow_poll_node

    async def scenario() -> None:
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=headers) as ah:
            conn, _, queued = await _full_worker_whose_claimed_task_is_cancelled(ah, node, tokens)
            # the cancel's push, then the queued task in the freed slot
            pushed = []
            while not any(m["type"] == "tasks" for m in pushed):
                pushed.append(await conn.next_push(WAIT))
            tasks = [m for m in pushed if m["type"] == "tasks"]
            assert [t["task_id"] for t in tasks[0]["tasks"]] == [queued], pushed
            await conn.close()

    with _admin(node, tokens):
        asyncio.run(scenario())
