"""A full task life over real HTTP and a real WebSocket, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import httpx

from orbit.store.store import CLAIM_PAYLOAD_BYTES
from orbit.worker import ServerError, WorkerConnection
from tests.e2e.servers import Node, Tokens


def test_full_task_life_over_the_wire(node: Node, tokens: Tokens, admin: httpx.Client) -> None:
    assert (
        admin.post(
            "/v1/queues", json={"name": "render", "max_concurrency": 4, "rate": 0}
        ).status_code
        == 201
    )
    submitted = admin.post(
        "/v1/tasks",
        json={"queue": "render", "handler": "shot", "payload": {"url": "https://example.test"}},
    )
    assert submitted.status_code == 201, submitted.text
    task_id = submitted.json()["task"]["id"]

    async def work() -> dict[str, object]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            welcome = await conn.hello("w1", {"shot": 2}, max_concurrency=2)
            assert welcome["epoch"] == "1" and welcome["resume_secret"]
            pushed = await conn.next_push(timeout=10)  # the dispatcher pushes the task
            assert pushed["type"] == "tasks" and pushed["req_id"] is None
            [task] = pushed["tasks"]
            assert task["task_id"] == task_id and task["payload"] == {"url": "https://example.test"}
            lease = await conn.start(task["attempt_id"], task["fence"])
            assert lease["status"] == "ok"
            [renewed] = await conn.renew([task["attempt_id"]])
            assert renewed["status"] == "ok"
            receipt = await conn.finish(task["attempt_id"], task["fence"], result={"png": "x"})
            again = await conn.finish(task["attempt_id"], task["fence"], result={"png": "x"})
            assert again == receipt  # a retried finish gets the same receipt
            try:
                await conn.finish(task["attempt_id"], "9", result="stale")
            except ServerError as exc:
                assert exc.code == "ALREADY_FINISHED"
            else:
                raise AssertionError("a different outcome was accepted")
            return receipt
        finally:
            await conn.close()

    receipt = asyncio.run(work())
    assert receipt["task_state"] == "succeeded" and receipt["result_version"] == "1"
    task = admin.get(f"/v1/tasks/{task_id}").json()
    assert task["state"] == "succeeded" and task["result"] == {"png": "x"}
    kinds = [e["kind"] for e in admin.get(f"/v1/tasks/{task_id}/events").json()["items"]]
    assert kinds == ["submitted", "claimed", "started", "succeeded", "rejected"]
    attempts = admin.get(f"/v1/tasks/{task_id}/attempts").json()["items"]
    assert [a["state"] for a in attempts] == ["succeeded"]
    metrics = httpx.get(f"{node.http}/metrics").text
    # an ended task leaves the gauge of tasks by state (counted by orbit_finishes_total)
    assert 'orbit_tasks{queue="render"' not in metrics
    assert 'orbit_queue_depth{queue="render"} 0.0' in metrics
    assert 'orbit_finishes_total{task_state="succeeded"}' in metrics


def test_a_worker_with_more_slots_than_one_claim_holds_is_pushed_every_task(
    node: Node, tokens: Tokens, admin: httpx.Client
) -> None:
    """A session may declare up to 100,000 slots but one claim grants at most 1,000: the
    dispatcher offers a session its free slots capped at that, so a worker declaring more
    is pushed tasks all the same (it was refused every offer and was never pushed one)."""
    assert (
        admin.post("/v1/queues", json={"name": "wide", "max_concurrency": 5000, "rate": 0})
    ).status_code == 201
    submitted: set[str] = set()
    for size in (1000, 200):
        specs = [{"queue": "wide", "handler": "h"} for _ in range(size)]
        reply = admin.post("/v1/tasks/batch", json={"tasks": specs})
        assert reply.status_code == 201, reply.text
        submitted.update(item["task"]["id"] for item in reply.json())

    async def work() -> tuple[set[str], int]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("wide", {"h": 2500}, max_concurrency=2500, push=True)
            pushed: set[str] = set()
            largest = 0
            while len(pushed) < len(submitted):
                message = await conn.next_push(30)
                assert message["type"] == "tasks", message
                largest = max(largest, len(message["tasks"]))
                pushed.update(t["task_id"] for t in message["tasks"])
            return pushed, largest
        finally:
            await conn.close()

    pushed, largest = asyncio.run(work())
    assert pushed == submitted
    assert largest <= 1000


def test_a_push_of_large_payloads_fits_the_workers_frames(
    node: Node, tokens: Tokens, admin: httpx.Client
) -> None:
    """One claim's tasks travel in one frame, and the SDK's connection takes frames of up
    to 8 MiB: a claim hands out at most CLAIM_PAYLOAD_BYTES of payload, so 45 tasks of
    200 KB (9 MB) reach a 100-slot worker in several pushes. Before, they went as one
    frame, the worker refused it by closing its connection, and nothing arrived."""
    assert (
        admin.post("/v1/queues", json={"name": "big", "max_concurrency": 100, "rate": 0})
    ).status_code == 201
    pad = "x" * 200_000
    specs = [{"queue": "big", "handler": "h", "payload": {"i": i, "pad": pad}} for i in range(45)]
    reply = admin.post("/v1/tasks/batch?reply=ids", json={"tasks": specs})
    assert reply.status_code == 201, reply.text
    submitted = {item["id"] for item in reply.json()}

    async def work() -> tuple[dict[str, int], list[int]]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("big", {"h": 100}, max_concurrency=100, push=True)
            pushed: dict[str, int] = {}
            sizes: list[int] = []
            while len(pushed) < len(submitted):
                message = await conn.next_push(30)
                assert message["type"] == "tasks", message
                sizes.append(sum(len(str(t["payload"]["pad"])) for t in message["tasks"]))
                pushed.update((t["task_id"], t["payload"]["i"]) for t in message["tasks"])
            return pushed, sizes
        finally:
            await conn.close()

    pushed, sizes = asyncio.run(work())
    assert set(pushed) == submitted and sorted(pushed.values()) == list(range(45))
    assert len(sizes) >= 3 and max(sizes) <= CLAIM_PAYLOAD_BYTES
