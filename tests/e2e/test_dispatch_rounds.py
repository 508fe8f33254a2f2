"""Which attached workers one dispatch round claims for, against a real store (both
backends), the dispatcher driven round by round in-process.

A claim that nothing held back (no cap, rate, full slots or size limit) took every
ready task of its session's handlers, so the round skips the connections whose handlers
are among those: one submitted task used to cost a claim per idle worker, all but one
of them empty, each holding the claim lock in turn. A claim that was held back skips
nobody.
"""

from __future__ import annotations

import asyncio
import json
from typing import cast

from fastapi import WebSocket

from orbit.core.model import TaskSpec
from orbit.server.gateway import Dispatcher, WorkerConnection
from orbit.server.metrics import Metrics
from orbit.store import Grants, Store
from tests.store.helpers import queue, worker


class RecordingSocket:
    """Stands in for a worker's WebSocket: keeps the tasks pushed to it."""

    def __init__(self) -> None:
        self.task_ids: list[str] = []

    async def send_text(self, text: str) -> None:
        message = json.loads(text)
        assert message["type"] == "tasks", message
        self.task_ids.extend(t["task_id"] for t in message["tasks"])

    async def close(self, code: int = 1000, reason: str = "") -> None:
        raise AssertionError(f"closed with {code} {reason}")


class Rig:
    def __init__(self, store: Store, queue_cap: int = 10) -> None:
        self.store = store
        self.dispatcher = Dispatcher(store, poll_interval=60, metrics=Metrics(store))
        self.claims: list[str] = []  # the session of each claim the store was asked for
        claim = store.attempt_claim_many

        def counted(session_id: str, epoch: int, n: int) -> Grants:
            self.claims.append(session_id)
            return claim(session_id, epoch, n)

        store.attempt_claim_many = counted  # type: ignore[method-assign]
        queue(store, max_concurrency=queue_cap)

    def attach(
        self, handlers: dict[str, int], slots: int = 10, *, push: bool = True
    ) -> RecordingSocket:
        session, _ = worker(store=self.store, handlers=handlers, max_concurrency=slots)
        socket = RecordingSocket()
        conn = WorkerConnection(cast(WebSocket, socket), session, push=push)
        assert self.dispatcher.attach(conn) is None
        return socket

    def submit(self, handler: str = "h") -> str:
        return self.store.task_submit(TaskSpec(queue="q", handler=handler)).task.id

    def round(self) -> None:
        asyncio.run(self.dispatcher.offer_all())


def _pushed(*sockets: RecordingSocket) -> list[list[str]]:
    return [s.task_ids for s in sockets]


def test_one_ready_task_costs_one_claim_among_idle_workers(store: Store) -> None:
    rig = Rig(store)
    sockets = [rig.attach({"h": 10}) for _ in range(5)]
    task_id = rig.submit()
    rig.round()
    assert len(rig.claims) == 1
    assert _pushed(*sockets) == [[task_id], [], [], [], []]
    # the next round starts afresh, one worker further on: a new task is claimed again
    second = rig.submit()
    rig.round()
    assert len(rig.claims) == 2
    assert _pushed(*sockets) == [[task_id], [second], [], [], []]


def test_idle_workers_take_turns_round_by_round(store: Store) -> None:
    """Every round started at the first worker attached, whose claim took every ready
    task: under a light load the oldest worker ran nearly everything and the others sat
    idle. Each round now starts one worker further on."""
    rig = Rig(store)
    sockets = [rig.attach({"h": 10}) for _ in range(3)]
    for _ in range(6):
        rig.submit()
        rig.round()
    assert [len(ids) for ids in _pushed(*sockets)] == [2, 2, 2]
    assert len(rig.claims) == 6


def test_a_worker_with_other_handlers_is_still_offered(store: Store) -> None:
    rig = Rig(store)
    only_h = rig.attach({"h": 10})
    only_g = rig.attach({"g": 10})
    also_h = rig.attach({"h": 10})
    task_id = rig.submit("g")
    rig.round()
    assert _pushed(only_h, only_g, also_h) == [[], [task_id], []]
    assert len(rig.claims) == 2  # the second worker of handler h is skipped


def test_a_worker_with_more_handlers_is_still_offered(store: Store) -> None:
    rig = Rig(store)
    narrow = rig.attach({"h": 10})
    wide = rig.attach({"h": 10, "g": 10})
    for_h, for_g = rig.submit("h"), rig.submit("g")
    rig.round()
    assert _pushed(narrow, wide) == [[for_h], [for_g]]


def test_a_claim_held_back_by_its_slots_skips_nobody(store: Store) -> None:
    rig = Rig(store)
    sockets = [rig.attach({"h": 1}, slots=1) for _ in range(3)]
    submitted = sorted([rig.submit(), rig.submit()])  # one instant: either order
    rig.round()
    assert [len(ids) for ids in _pushed(*sockets)] == [1, 1, 0]
    assert sorted(sockets[0].task_ids + sockets[1].task_ids) == submitted
    assert len(rig.claims) == 3  # the second claim was held back too: the third is made


def test_a_claim_held_back_by_a_queue_cap_skips_nobody(store: Store) -> None:
    rig = Rig(store, queue_cap=1)
    sockets = [rig.attach({"h": 10}) for _ in range(2)]
    rig.submit()
    rig.submit()
    rig.round()
    assert [len(ids) for ids in _pushed(*sockets)] == [1, 0]
    assert len(rig.claims) == 2  # held back by the cap, so the next worker was asked


def test_a_freed_permit_wakes_no_round_for_a_worker_that_takes_no_pushes(store: Store) -> None:
    """A freed permit wakes the dispatcher only if some worker's last claim was held
    back. A worker that takes no pushed tasks (``"push": false``) has no claim made for
    it, and its connection counted as held back for ever: while one was attached, every
    finish on the node (every freed permit) woke a round of empty claims for the push
    workers, the cost the rule is there to save."""
    rig = Rig(store)
    pushed = rig.attach({"h": 10})
    rig.attach({"h": 10}, push=False)
    rig.round()
    assert rig.claims and pushed.task_ids == []  # nothing ready: nothing held it back
    dispatcher = rig.dispatcher
    dispatcher._wake.clear()
    dispatcher._wake_if_blocked()  # what a finish's freed permit calls
    assert not dispatcher._wake.is_set()


def test_a_claim_that_ran_out_of_rounds_is_made_again_at_once(store: Store) -> None:
    """More capped queues ahead in claim order than a claim has rounds: the first claim
    grants one task of each of eight and stops with ready work behind them. The
    dispatcher claims again by itself (the claim says so, ``Grants.more``, and a push
    that went out wakes it too), with a 60 s poll and no permit freed: the worker's free
    slots must not wait for either."""
    for i in range(10):
        queue(store, f"c{i}", max_concurrency=1)
        store.task_submit_many([TaskSpec(queue=f"c{i}", handler="h")] * 300)
    queue(store, "bulk", max_concurrency=100)
    bulk = {store.task_submit(TaskSpec(queue="bulk", handler="h")).task.id for _ in range(20)}
    session, _ = worker(store=store, handlers={"h": 100}, max_concurrency=100)
    dispatcher = Dispatcher(store, poll_interval=60, metrics=Metrics(store))
    socket = RecordingSocket()
    dispatcher.attach(WorkerConnection(cast(WebSocket, socket), session, push=True))

    async def until_pushed(count: int) -> None:
        running = asyncio.create_task(dispatcher.run())
        try:
            async with asyncio.timeout(30):
                while len(socket.task_ids) < count:
                    await asyncio.sleep(0)  # the pushes are the loop's own tasks
        finally:
            running.cancel()

    asyncio.run(until_pushed(30))  # ten capped queues' one each, and the 20 behind them
    assert bulk <= set(socket.task_ids)
    assert len(socket.task_ids) == 30
