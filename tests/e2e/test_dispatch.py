"""The dispatcher against a real store (both backends), served in-process so that the
test can hold a claim in flight while a worker's connection closes or breaks.

A claim the dispatcher makes for a connection that can no longer take it must be given
back at once — the attempt released, the task queued again — not left to its claim
lease (set to ten minutes here, so only a prompt release can pass).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.exceptions import StarletteDeprecationWarning

from orbit.core.model import SECOND, Capability, Outcome, TaskSpec
from orbit.server import ServerSettings, create_app
from orbit.server.gateway import Dispatcher
from orbit.store import Grants, Store, StoreConfig, open_store
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

WAIT = 30.0  # an upper bound for events that come at once; never reached when they do


@dataclass
class Rig:
    store: Store
    client: TestClient
    dispatcher: Dispatcher
    token: str
    claiming: threading.Event  # a dispatcher claim has begun (and waits for `gate`)
    gate: threading.Event
    released: threading.Event  # an attempt_release returned
    detached: threading.Event  # a connection left the dispatcher

    def hello(self, ws: Any) -> str:
        ws.send_json(
            {
                "type": "hello",
                "req_id": "r1",
                "name": "w",
                "max_concurrency": 1,
                "push": True,
                "capabilities": [{"handler": "h", "capacity": 1}],
            }
        )
        welcome = ws.receive_json()
        assert welcome["type"] == "welcome", welcome
        return str(welcome["session_id"])

    def connect(self) -> Any:
        return self.client.websocket_connect(
            "/v1/worker", headers={"Authorization": f"Bearer {self.token}"}
        )


def _observe(fn: Callable[..., Any], after: threading.Event) -> Callable[..., Any]:
    def observed(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            after.set()

    return observed


@pytest.fixture
def rig(db_url: str) -> Iterator[Rig]:
    store = open_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    store.queue_create("q", max_concurrency=10, rate=0)
    token = store.token_create("w", ["worker"])[1]
    claiming, gate, released, detached = (threading.Event() for _ in range(4))
    claim = store.attempt_claim_many

    def gated(*args: Any) -> Any:
        claiming.set()
        assert gate.wait(WAIT), "the test never opened the gate"
        return claim(*args)

    store.attempt_claim_many = gated  # type: ignore[method-assign]
    store.attempt_release = _observe(store.attempt_release, released)  # type: ignore[method-assign]
    app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
    try:
        with TestClient(app) as client:
            dispatcher: Dispatcher = app.state.dispatcher
            dispatcher.detach = _observe(dispatcher.detach, detached)  # type: ignore[method-assign]
            yield Rig(store, client, dispatcher, token, claiming, gate, released, detached)
            gate.set()
    finally:
        store.close()


def _assert_released(store: Store, task_id: str) -> None:
    assert store.task_get(task_id).state == "queued"
    [attempt] = store.attempt_list(task_id)
    assert attempt.state == "released"


def test_a_claim_for_a_connection_that_closed_meanwhile_is_released(rig: Rig) -> None:
    task_id = rig.store.task_submit(TaskSpec(queue="q", handler="h")).task.id
    with rig.connect() as ws:
        rig.hello(ws)
        assert rig.claiming.wait(WAIT)  # the dispatcher is claiming for this connection
    assert rig.detached.wait(WAIT)  # the connection is gone from the server
    rig.gate.set()  # now the claim completes, for a connection that has closed
    assert rig.released.wait(WAIT), "the undelivered claim was left to its lease"
    _assert_released(rig.store, task_id)


def test_a_claim_whose_send_fails_is_released(rig: Rig) -> None:
    task_id = rig.store.task_submit(TaskSpec(queue="q", handler="h")).task.id
    with rig.connect() as ws:
        session_id = rig.hello(ws)
        assert rig.claiming.wait(WAIT)
        conn = rig.dispatcher.connections[session_id]

        async def broken(_: str) -> None:
            raise OSError("connection reset by peer")

        conn.ws.send_text = broken  # type: ignore[method-assign]
        rig.gate.set()
        assert rig.released.wait(WAIT), "the undelivered claim was left to its lease"
        _assert_released(rig.store, task_id)
        assert conn.closed


class Steps:
    """Stands in for ``attempt_claim_many``: each dispatcher claim waits at the gate until
    the test lets it into the store, and again before it returns to the dispatcher."""

    def __init__(self, claim: Callable[..., Grants]) -> None:
        self.claim = claim
        self.entered: queue.Queue[None] = queue.Queue()
        self.go: queue.Queue[None] = queue.Queue()
        self.done: queue.Queue[Grants] = queue.Queue()
        self.back: queue.Queue[None] = queue.Queue()

    def __call__(self, *args: Any) -> Grants:
        self.entered.put(None)
        self.go.get(timeout=WAIT)
        grants = self.claim(*args)
        self.done.put(grants)
        self.back.get(timeout=WAIT)
        return grants

    def enter(self) -> None:
        """Wait for the dispatcher's next claim to reach the gate."""
        try:
            self.entered.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError("the dispatcher made no claim: a wake was lost") from None

    def run(self) -> Grants:
        """Let the claim at the gate into the store; what it found (it then waits)."""
        self.go.put(None)
        return self.done.get(timeout=WAIT)

    def step(self) -> Grants:
        """A whole claim: wait for it, run it, and hand its answer to the dispatcher."""
        self.enter()
        grants = self.run()
        self.back.put(None)
        return grants


def test_a_permit_freed_while_a_claim_is_in_flight_wakes_the_dispatcher(tmp_path: Path) -> None:
    """The lost wakeup: a permit freed while a claim was in flight used to be judged by
    the worker's previous claim. If that one was not held back by a cap, the wake was
    skipped, and the in-flight claim — which had counted the permit as taken — left the
    worker blocked with a ready task and nothing to wake it until the poll (an hour here).

    SQLite only: on PostgreSQL the LISTEN connection's catch-up wake comes at a moment
    the test cannot order; the dispatcher's logic under test is the same on both."""
    url = f"sqlite:///{tmp_path}/orbit.db"
    store = open_store(url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        store.queue_create("q", max_concurrency=1, rate=0)
        token = store.token_create("w", ["worker"])[1]
        steps = Steps(store.attempt_claim_many)
        store.attempt_claim_many = steps  # type: ignore[method-assign]
        app = create_app(ServerSettings(db_url=url, poll_interval=3600), store=store)
        with (
            TestClient(app) as client,
            client.websocket_connect(
                "/v1/worker", headers={"Authorization": f"Bearer {token}"}
            ) as ws,
        ):
            ws.send_json(
                {
                    "type": "hello",
                    "req_id": "r1",
                    "name": "a",
                    "max_concurrency": 2,
                    "push": True,
                    "capabilities": [{"handler": "h", "capacity": 2}],
                }
            )
            assert ws.receive_json()["type"] == "welcome"
            first = steps.step()  # on attach: nothing ready, nothing held back
            assert not first and not first.blocked

            spec = TaskSpec(queue="q", handler="h")
            b, _ = store.session_open(
                name="b", node_id="test", capabilities=[Capability("h", 1)], max_concurrency=1
            )
            submitted = [s.task.id for s in store.task_submit_many([spec, spec])]
            steps.enter()  # the submit's wake: a claim for A waits at the gate
            [taken] = steps.claim(b.id, b.epoch, 1)  # B takes the queue's only permit
            store.attempt_start(b.id, b.epoch, taken.attempt.id, taken.attempt.fence)
            second = steps.run()
            assert not second and second.blocked  # held back by the queue's cap
            # B finishes while A's claim is still in flight: the permit is free again
            done = store.attempt_finish(
                b.id, b.epoch, taken.attempt.id, taken.attempt.fence, Outcome.success(1)
            )
            assert done.task_state == "succeeded"
            steps.back.put(None)  # now A's blocked claim returns to the dispatcher

            third = steps.step()  # the freed permit's wake was kept: A claims again
            [left] = [t for t in submitted if t != taken.task.id]
            assert [g.task.id for g in third] == [left]
            pushed = ws.receive_json()
            assert [t["task_id"] for t in pushed["tasks"]] == [left]
    finally:
        store.close()


def test_a_rate_limited_queue_drains_with_no_other_traffic(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """A real server whose poll fallback is an hour away (and claim leases ten minutes):
    a queue allowing 20 tasks a second, burst 1, gets five tasks for one pushed worker
    that never starts any, so no commit frees a permit or readies a task after the
    submit. Each claim after the first finds the bucket empty; only the dispatcher
    waking by itself when the next token is due hands out the rest."""
    node = nodes(args=["--poll-interval", "3600", "--claim-ttl", "600"])
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=auth) as admin:
        slow = {"name": "q", "max_concurrency": 10, "rate": 20, "burst": 1}
        assert admin.post("/v1/queues", json=slow).status_code == 201

    async def work() -> list[str]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("w", {"h": 10}, 10)
            batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(5)]
            async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=auth) as admin:
                reply = await admin.post("/v1/tasks/batch", json={"tasks": batch})
                assert reply.status_code == 201, reply.text
                submitted = [item["task"]["id"] for item in reply.json()]
            got: list[str] = []
            while len(got) < 5:
                pushed = await conn.next_push(WAIT)  # a bound, never a measurement
                assert len(pushed["tasks"]) == 1  # one token at a time
                got += [t["task_id"] for t in pushed["tasks"]]
            assert sorted(got) == sorted(submitted)
            return got
        finally:
            await conn.close()

    asyncio.run(work())
