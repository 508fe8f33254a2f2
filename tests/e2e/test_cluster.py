"""Two or more ``orbit server`` nodes on one PostgreSQL database (PostgreSQL only).

- A task submitted through node A is pushed to a worker attached to node B by
  LISTEN/NOTIFY alone: both nodes poll only every 60 s.
- Node A is SIGKILLed while its worker runs an attempt; the worker resumes its session on
  node B with its secret and finishes the same attempt; reports carrying an older epoch
  are fenced (FENCED_EPOCH in the store, close code 4409 on the superseded connection)
  and leave evidence in the event log.
- A ``drain`` from a fenced epoch is refused too (it once drained the session).
- A session resumed on another node has its connection on this node closed at once
  (NOTIFY orbit_ready ``fenced``), not at its next request or dispatch round.
- A push worker resumed on node B while its connection to node A is still open: only
  the new connection gets tasks, and node A closes the old one.
- A cancel requested through node A reaches the worker attached to node B (NOTIFY
  orbit_cancel), and a node whose LISTEN connection is killed reconnects and hears the
  other node's NOTIFYs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import websockets

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Outcome
from orbit.server.listen import CHANNELS
from orbit.store import open_store
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens, make_tokens, start_server
from tests.pg import as_url, temporary_database

pytestmark = pytest.mark.postgres_only

POLL = ["--poll-interval", "60"]  # far beyond any wait below: only NOTIFY can be in time
PUSH_TIMEOUT = 10.0


@dataclass
class Cluster:
    """Nodes on one throwaway PostgreSQL database; all stopped when the test ends."""

    db_url: str
    log_dir: Path
    tokens: Tokens
    nodes: list[Node] = field(default_factory=list)

    def start(self, *node_ids: str, args: list[str] | None = None) -> list[Node]:
        """Start nodes in parallel (each waits for /healthz) and return them in order."""
        with ThreadPoolExecutor(len(node_ids)) as pool:
            futures = [
                pool.submit(start_server, self.db_url, self.log_dir, node_id=n, args=args)
                for n in node_ids
            ]
        started: list[Node] = []
        errors: list[BaseException] = []
        for future in futures:
            exc = future.exception()
            if exc is None:
                started.append(future.result())
            else:
                errors.append(exc)
        self.nodes.extend(started)
        if errors:
            raise errors[0]
        return started

    def logs(self) -> str:
        return "\n".join(f"===== {n.log.name}\n{n.log_text()}" for n in self.nodes)


@contextlib.contextmanager
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with temporary_database("orbit_cluster") as dsn:
        db_url = as_url(dsn)
        c = Cluster(db_url, tmp_path, make_tokens(db_url))  # also migrates the schema
        try:
            yield c
        except BaseException:
            print(c.logs())  # shown by pytest for a failing test only
            raise
        finally:
            for node in c.nodes:
                node.stop()


def client(node: Node, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {token}"}
    )


async def submit(http: httpx.AsyncClient, payload: dict[str, Any]) -> str:
    reply = await http.post("/v1/tasks", json={"queue": "q", "handler": "h", "payload": payload})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["task"]["id"])


async def next_tasks(conn: WorkerConnection) -> list[dict[str, Any]]:
    """The next pushed ``tasks`` message (within PUSH_TIMEOUT), as its assignments."""
    pushed = await conn.next_push(timeout=PUSH_TIMEOUT)
    assert pushed["type"] == "tasks" and pushed["req_id"] is None, pushed
    return list(pushed["tasks"])


async def make_queue(http: httpx.AsyncClient) -> None:
    created = await http.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
    assert created.status_code == 201, created.text


@contextlib.asynccontextmanager
async def pushed_to(node: Node, token: str, slots: int) -> AsyncIterator[WorkerConnection]:
    """A worker connection on ``node`` that takes pushed tasks of handler ``h``."""
    worker = await WorkerConnection.connect(node.ws, token)
    try:
        await worker.hello("w-b", {"h": slots}, max_concurrency=slots, push=True)
        yield worker
    finally:
        await worker.close()


def listener_pids(db_url: str) -> set[int]:
    """The backends of the nodes' LISTEN connections (idle after their last ``LISTEN``)."""
    with psycopg.connect(db_url, autocommit=True) as cx:
        rows = cx.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query = %s",
            (f"LISTEN {CHANNELS[-1]}",),
        ).fetchall()
    return {int(r[0]) for r in rows}


async def closed_with(conn: WorkerConnection) -> int | None:
    """Wait until the server closes the connection; return its close code."""
    while (await conn.next_push(timeout=PUSH_TIMEOUT))["type"] != "closed":
        pass
    return conn.ws.close_code


def test_task_submitted_on_node_a_is_pushed_to_a_worker_on_node_b(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        a, b = c.start("node-a", "node-b", args=POLL)

        async def scenario() -> None:
            async with client(a, c.tokens.admin) as http_a:
                created = await http_a.post(
                    "/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0}
                )
                assert created.status_code == 201, created.text
                worker = await WorkerConnection.connect(b.ws, c.tokens.worker)
                try:
                    await worker.hello("w-b", {"h": 4}, max_concurrency=4, push=True)
                    # Round 1: B's dispatcher may also have been woken by the attach.
                    first = await submit(http_a, {"n": 1})
                    [t1] = await next_tasks(worker)
                    assert t1["task_id"] == first
                    # Round 2: B has been silent since (a claim notifies nobody), so only
                    # A's NOTIFY orbit_ready can wake B's dispatcher before its 60 s poll.
                    second = await submit(http_a, {"n": 2})
                    [t2] = await next_tasks(worker)
                    assert t2["task_id"] == second and t2["payload"] == {"n": 2}
                    # Round 3: a batch answered with ids only; the id is the pushed task's.
                    lean = await http_a.post(
                        "/v1/tasks/batch?reply=ids",
                        json={"tasks": [{"queue": "q", "handler": "h", "payload": {"n": 3}}]},
                    )
                    assert lean.status_code == 201, lean.text
                    [item] = lean.json()
                    third = item["id"]
                    [t3] = await next_tasks(worker)
                    assert t3["task_id"] == third and t3["payload"] == {"n": 3}
                    for t in (t1, t2, t3):
                        assert (await worker.start(t["attempt_id"], t["fence"]))["status"] == "ok"
                        receipt = await worker.finish(
                            t["attempt_id"], t["fence"], result=t["payload"]
                        )
                        assert receipt["task_state"] == "succeeded"
                finally:
                    await worker.close()
                for task_id in (first, second, third):
                    task = (await http_a.get(f"/v1/tasks/{task_id}")).json()
                    assert task["state"] == "succeeded" and task["attempts_used"] == 1
                    assert task["result"] == task["payload"]
                [session] = (await http_a.get("/v1/workers")).json()["items"]
                assert session["node_id"] == "node-b"

        asyncio.run(scenario())


def test_worker_resumes_on_node_b_after_node_a_is_killed(tmp_path: Path) -> None:
    # Leases long enough that a slow restart of node A never lets the attempt's lease lapse.
    args = [*POLL, "--lease-ttl", "120", "--session-ttl", "120"]
    with cluster(tmp_path) as c:
        a, b = c.start("node-a", "node-b", args=args)

        async def scenario() -> None:
            nonlocal a
            async with client(a, c.tokens.admin) as http_a:
                created = await http_a.post(
                    "/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0}
                )
                assert created.status_code == 201, created.text
                w0 = await WorkerConnection.connect(a.ws, c.tokens.worker)
                welcome = await w0.hello("w", {"h": 1}, max_concurrency=1, push=True)
                assert welcome["epoch"] == "1"
                session_id, secret = w0.session_id, w0.resume_secret
                assert session_id is not None and secret is not None
                task_id = await submit(http_a, {"url": "https://example.test"})
                [task] = await next_tasks(w0)
                attempt_id, fence = task["attempt_id"], task["fence"]
                assert task["task_id"] == task_id
                assert (await w0.start(attempt_id, fence))["status"] == "ok"

            # Node A dies mid-run; the worker's connection to it is gone.
            a.kill()
            assert await closed_with(w0) == 1006  # abnormal closure: no close frame
            await w0.close()

            # Node A comes back (same node id, new process). A stale twin of the worker
            # resumes there first (epoch 2) ...
            [a] = await asyncio.to_thread(c.start, "node-a", args=args)
            x = await WorkerConnection.connect(a.ws, c.tokens.worker)
            assert (await x.resume(session_id, secret, push=False))["epoch"] == "2"
            assert [r["status"] for r in await x.renew([attempt_id])] == ["ok"]

            # ... then the worker resumes on node B (epoch 3) and renews the same attempt.
            y = await WorkerConnection.connect(b.ws, c.tokens.worker)
            assert (await y.resume(session_id, secret, push=True))["epoch"] == "3"
            assert [r["status"] for r in await y.renew([attempt_id])] == ["ok"]

            # Node A hears of the resume on B (NOTIFY orbit_ready `fenced`) and closes X
            # with 4409 at once, though X sent nothing more.
            assert await closed_with(x) == 4409
            assert x.ws.close_reason == "FENCED_EPOCH"
            await x.close()
            # Epoch-2 reports that were already on their way (X's twin could have sent
            # them just before the close) are fenced by the store, and leave evidence.
            store = open_store(c.db_url)
            try:
                [lost] = store.lease_renew_many(session_id, 2, [attempt_id])
                assert lost.status == "lost"
                with pytest.raises(OrbitError) as stale:
                    store.attempt_finish(
                        session_id, 2, attempt_id, int(fence), Outcome.success({"from": "epoch 2"})
                    )
                assert stale.value.code == Code.FENCED_EPOCH
            finally:
                store.close()

            # A second resume on the same node B (epoch 4, connection Z) supersedes Y:
            # node B closes Y with 4409 at once, so Y cannot report anything more.
            z = await WorkerConnection.connect(b.ws, c.tokens.worker)
            try:
                assert (await z.resume(session_id, secret, push=True))["epoch"] == "4"
                assert await closed_with(y) == 4409
                with pytest.raises((ConnectionError, websockets.ConnectionClosed)):
                    await y.finish(attempt_id, fence, result={"from": "superseded epoch 3"})
                await y.close()

                # Z renews and finishes the SAME attempt; a retried finish is idempotent.
                assert [r["status"] for r in await z.renew([attempt_id])] == ["ok"]
                receipt = await z.finish(attempt_id, fence, result={"png": "ok"})
                assert receipt["attempt_id"] == attempt_id and receipt["fence"] == fence
                assert receipt["task_state"] == "succeeded"
                assert receipt["attempt_state"] == "succeeded"
                assert await z.finish(attempt_id, fence, result={"png": "ok"}) == receipt
            finally:
                await z.close()

            async with client(b, c.tokens.admin) as http_b:
                got = (await http_b.get(f"/v1/tasks/{task_id}")).json()
                assert got["state"] == "succeeded", got
                assert got["attempts_used"] == 1 and got["result"] == {"png": "ok"}
                assert got["result_version"] == "1"
                attempts = (await http_b.get(f"/v1/tasks/{task_id}/attempts")).json()["items"]
                assert [(t["id"], t["state"]) for t in attempts] == [(attempt_id, "succeeded")]
                events = (await http_b.get(f"/v1/tasks/{task_id}/events")).json()["items"]
                kinds = [e["kind"] for e in events]
                assert kinds.count("started") == 1 and kinds.count("succeeded") == 1
                rejected = [
                    (e["code"], e["data"]["report"], e["session_id"], e["attempt_id"])
                    for e in events
                    if e["kind"] == "rejected"
                ]
                assert rejected == [
                    ("FENCED_EPOCH", "renew", session_id, attempt_id),
                    ("FENCED_EPOCH", "finish", session_id, attempt_id),
                ], events
                stale_finish = next(
                    e for e in events if e["kind"] == "rejected" and e["data"]["report"] == "finish"
                )
                assert stale_finish["data"]["epoch"] == 2
                assert stale_finish["data"]["current_epoch"] == 3
                # The stale report is evidence only, recorded before the real success.
                assert kinds.index("rejected") < kinds.index("succeeded")
                [session] = (await http_b.get("/v1/workers")).json()["items"]
                assert session["session_id"] == session_id
                assert session["node_id"] == "node-b" and session["epoch"] == "4"

        asyncio.run(scenario())


def test_a_drain_from_a_fenced_epoch_is_refused(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        [a] = c.start("node-a", args=POLL)

        async def scenario() -> None:
            x = await WorkerConnection.connect(a.ws, c.tokens.worker)
            try:
                await x.hello("w", {"h": 1}, max_concurrency=1, push=False)  # epoch 1 on A
                assert x.session_id is not None and x.resume_secret is not None
                # The resume another node would do (one store call) fences epoch 1; node A
                # hears of it (NOTIFY orbit_ready `fenced`) and closes X at once.
                store = open_store(c.db_url)
                try:
                    resumed = store.session_resume(x.session_id, x.resume_secret, node_id="b")
                    assert resumed.epoch == 2
                    assert await closed_with(x) == 4409
                    assert x.ws.close_reason == "FENCED_EPOCH"
                    # A drain X sent just before the close reaches the store with X's epoch
                    # (the gateway passes its connection's epoch), and is refused there.
                    with pytest.raises(OrbitError) as fenced:
                        store.session_drain(x.session_id, 1)
                    assert fenced.value.code == Code.FENCED_EPOCH
                finally:
                    store.close()
            finally:
                await x.close()
            async with client(a, c.tokens.admin) as http_a:
                [session] = (await http_a.get("/v1/workers")).json()["items"]
                assert session["epoch"] == "2" and session["draining"] is False

        asyncio.run(scenario())


def test_a_cancel_on_node_a_reaches_the_worker_on_node_b(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        a, b = c.start("node-a", "node-b", args=POLL)

        async def scenario() -> None:
            async with client(a, c.tokens.admin) as http_a:
                await make_queue(http_a)
                async with pushed_to(b, c.tokens.worker, 1) as worker:
                    task_id = await submit(http_a, {"n": 1})
                    [task] = await next_tasks(worker)
                    assert (await worker.start(task["attempt_id"], task["fence"]))["status"] == "ok"
                    reply = await http_a.post(f"/v1/tasks/{task_id}/cancel")
                    assert reply.status_code == 200, reply.text
                    # Node A's store sent NOTIFY orbit_cancel; only node B holds the worker.
                    pushed = await worker.next_push(timeout=PUSH_TIMEOUT)
                    assert pushed["type"] == "cancel", pushed
                    assert pushed["attempt_ids"] == [task["attempt_id"]]

        asyncio.run(scenario())


def test_a_node_whose_listen_connection_dies_hears_notifies_again(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        a, b = c.start("node-a", "node-b", args=POLL)
        old = listener_pids(c.db_url)
        assert len(old) == 2
        with psycopg.connect(c.db_url, autocommit=True) as cx:
            for pid in old:
                cx.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # Both nodes reconnect (after half a second's backoff) with new backends.
        deadline = time.monotonic() + 30
        while len(listener_pids(c.db_url) - old) < 2:
            assert time.monotonic() < deadline, "the nodes did not LISTEN again"
            time.sleep(0.05)

        async def scenario() -> None:
            async with client(a, c.tokens.admin) as http_a:
                await make_queue(http_a)
                async with pushed_to(b, c.tokens.worker, 4) as worker:
                    first = await submit(http_a, {"n": 1})  # B may also be woken by the attach
                    [t1] = await next_tasks(worker)
                    assert t1["task_id"] == first
                    # Only the new LISTEN connection can wake B before its 60 s poll.
                    second = await submit(http_a, {"n": 2})
                    [t2] = await next_tasks(worker)
                    assert t2["task_id"] == second

        asyncio.run(scenario())


def terminate_other_backends(db_url: str) -> int:
    """Close every connection to the database but this one, as a PostgreSQL restart
    would; return how many, once their backends have exited."""
    with psycopg.connect(db_url, autocommit=True) as cx:
        others = "datname = current_database() AND pid <> pg_backend_pid()"
        row = cx.execute(
            f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE {others}"
        ).fetchone()
        assert row is not None
        deadline = time.monotonic() + 30
        while cx.execute(f"SELECT count(*) FROM pg_stat_activity WHERE {others}").fetchone() != (
            0,
        ):
            assert time.monotonic() < deadline, "the terminated backends did not exit"
            time.sleep(0.01)
        return int(row[0])


def test_no_call_fails_after_postgres_closed_every_connection(tmp_path: Path) -> None:
    """Every node's connections closed at once, as a restart of PostgreSQL closes them:
    no call afterwards fails for it. Each node passes over its closed pooled connections
    (each used to fail one call, a 500) and its LISTEN connection reconnects."""
    with cluster(tmp_path) as c:
        a, b = c.start("node-a", "node-b", args=POLL)

        async def run_task(http: httpx.AsyncClient, worker: WorkerConnection, n: int) -> str:
            task_id = await submit(http, {"n": n})
            [task] = await next_tasks(worker)
            assert task["task_id"] == task_id
            assert (await worker.start(task["attempt_id"], task["fence"]))["status"] == "ok"
            receipt = await worker.finish(task["attempt_id"], task["fence"], result=n)
            assert receipt["task_state"] == "succeeded"
            return task_id

        async def scenario() -> None:
            async with client(a, c.tokens.admin) as http_a, client(b, c.tokens.admin) as http_b:
                await make_queue(http_a)
                async with pushed_to(b, c.tokens.worker, 4) as worker:
                    first = await run_task(http_a, worker, 1)  # both nodes' pools in use
                    closed = await asyncio.to_thread(terminate_other_backends, c.db_url)
                    assert closed >= 6  # per node: two pools and the LISTEN connection
                    for http in (http_a, http_b, http_a, http_b):
                        reply = await http.get(f"/v1/tasks/{first}")
                        assert reply.status_code == 200, reply.text
                    # a submit on A, pushed by B once its LISTEN is back, run through B
                    await run_task(http_a, worker, 2)
                    listing = await http_b.get("/v1/tasks")
                    assert listing.status_code == 200, listing.text

        asyncio.run(scenario())


def test_after_a_resume_on_node_b_only_the_new_connection_gets_pushes(tmp_path: Path) -> None:
    """A push worker on node A is resumed on node B while its connection to A stays
    open. A task submitted on A goes to the new connection on B; node A closes the old
    connection (4409, reason FENCED_EPOCH), on the resume's NOTIFY or, had it missed that,
    when its dispatcher finds the old epoch fenced, and pushes it nothing; a cancel
    reaches B."""
    with cluster(tmp_path) as c:
        a, b = c.start("node-a", "node-b", args=POLL)

        async def scenario() -> None:
            async with client(a, c.tokens.admin) as http_a:
                await make_queue(http_a)
                old = await WorkerConnection.connect(a.ws, c.tokens.worker)
                new = await WorkerConnection.connect(b.ws, c.tokens.worker)
                try:
                    await old.hello("w", {"h": 1}, max_concurrency=1, push=True)
                    assert old.session_id is not None and old.resume_secret is not None
                    resumed = await new.resume(old.session_id, old.resume_secret, push=True)
                    assert resumed["epoch"] == "2"
                    task_id = await submit(http_a, {"n": 1})
                    [task] = await next_tasks(new)
                    assert task["task_id"] == task_id
                    closed = await old.next_push(timeout=PUSH_TIMEOUT)  # nothing before it
                    assert closed == {"type": "closed", "code": 4409, "reason": "FENCED_EPOCH"}, (
                        closed
                    )
                    assert (old.ws.close_code, old.ws.close_reason) == (4409, "FENCED_EPOCH")
                    assert (await new.start(task["attempt_id"], task["fence"]))["status"] == "ok"
                    reply = await http_a.post(f"/v1/tasks/{task_id}/cancel")
                    assert reply.status_code == 200, reply.text
                    pushed = await new.next_push(timeout=PUSH_TIMEOUT)
                    assert pushed == {"type": "cancel", "attempt_ids": [task["attempt_id"]]}
                finally:
                    await old.close()
                    await new.close()

        asyncio.run(scenario())
