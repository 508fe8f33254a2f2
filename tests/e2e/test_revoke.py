"""Revoking a token cuts off the worker connections already open with it, on every node:
each is closed with 4401 ``UNAUTHENTICATED``, the ``orbit worker`` holding one exits 3 as
when its token is refused at the start, and the tasks it held go to a worker whose token
is still good: a claimed one at once (the closing node releases it), a running one when
its run lease runs out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from orbit.store import open_store
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import FAST, _wait_for, _worker_process, submit, wait_state

#: Far longer than the test: a connection closed within it was closed by the revoke's
#: notice, not by the periodic re-check of the tokens (which runs at this period)
LONG_TOKEN_CACHE = ["--token-cache", "600"]
#: Far longer than the test too (and the session's 60 s): a claimed task another worker
#: got within it was released by the close for the revoked token, not by its claim lease
LONG_CLAIM_TTL = ["--claim-ttl", "600"]
#: a retry of the running task right after its lease is lost, not a second later
QUICK_RETRY = {"base": 0.1, "factor": 1, "max": 0.1}


@pytest.fixture
def cluster(nodes: Callable[..., Node], db_url: str) -> tuple[Node, Node]:
    """Nodes A and B: two processes on PostgreSQL; on SQLite (one server process per
    database) the same node twice."""
    a = nodes(node_id="node-a", args=FAST + LONG_TOKEN_CACHE + LONG_CLAIM_TTL)
    if db_url.startswith("sqlite"):
        return a, a
    return a, nodes(node_id="node-b", args=FAST + LONG_TOKEN_CACHE + LONG_CLAIM_TTL)


@pytest.fixture
def admin_a(cluster: tuple[Node, Node], tokens: Tokens) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=cluster[0].http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as client:
        created = client.post("/v1/queues", json={"name": "q", "max_concurrency": 50, "rate": 0})
        assert created.status_code == 201, created.text
        yield client


async def _closed(conn: WorkerConnection) -> dict[str, Any]:
    """The ``closed`` message that ends ``conn`` (anything pushed before it is skipped)."""
    while (msg := await conn.next_push(timeout=30))["type"] != "closed":
        pass
    return msg


def test_a_revoke_through_node_a_closes_the_connections_open_on_node_b(
    cluster: tuple[Node, Node], tokens: Tokens, admin_a: httpx.Client, tmp_path: Path
) -> None:
    """A worker token is revoked through node A's API while two connections opened with
    it are attached to node B: a real ``orbit worker`` running a retry_safe task, and a
    connection holding a claimed one. Both are closed with 4401 UNAUTHENTICATED (node B
    caches token checks far longer than the test runs, so only the revoke's notice can
    close them); the worker exits 3, as when its token is refused at the start, its
    handler cancelled. A worker with a good token, on node A, gets both tasks: the
    claimed one at once, released by node B as it closed the connection (the claim
    lease is far longer than the test), the running one retried when its run lease runs
    out. Before, both connections stayed open and kept their tasks; then the claimed
    task waited for its claim lease."""
    a, b = cluster
    made = admin_a.post("/v1/tokens", json={"name": "leaked", "scopes": ["worker"]})
    assert made.status_code == 201, made.text
    leaked = made.json()
    running = submit(admin_a, "sleep", {"seconds": 120}, retry_safe=True, backoff=QUICK_RETRY)
    proc = _worker_process(b, Tokens(tokens.admin, tokens.submit, leaked["token"]), tmp_path)
    try:
        _wait_for(tmp_path / f"start-{running}")

        async def scenario() -> str:
            held = await WorkerConnection.connect(b.ws, leaked["token"])
            await held.hello("holder", {"held": 1}, 1, push=False)
            claimed = submit(admin_a, "held")
            [task] = await held.claim(1)
            assert task["task_id"] == claimed

            revoked = admin_a.post(f"/v1/tokens/{leaked['id']}/revoke")
            assert revoked.status_code == 200, revoked.text
            closed = await _closed(held)
            assert (closed["code"], closed["reason"]) == (4401, "UNAUTHENTICATED")
            out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
            assert proc.returncode == 3, out
            assert "token was revoked (4401 UNAUTHENTICATED)" in out, out
            assert "the server refused the token (HTTP 401)" in out, out
            assert leaked["token"] not in out

            rescuer = await WorkerConnection.connect(a.ws, tokens.worker)
            await rescuer.hello("rescuer", {"held": 1, "sleep": 1}, 2)
            got: dict[str, dict[str, Any]] = {}
            while len(got) < 2:
                pushed = await rescuer.next_push(timeout=30)
                assert pushed["type"] == "tasks", pushed
                got.update({t["task_id"]: t for t in pushed["tasks"]})
            assert set(got) == {claimed, running}
            for t in got.values():
                await rescuer.start(t["attempt_id"], t["fence"])
                await rescuer.finish(t["attempt_id"], t["fence"], result="rescued")
            await rescuer.close()
            return claimed

        claimed = asyncio.run(scenario())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for task_id, lost in ((claimed, "released"), (running, "lost")):
        task = wait_state(admin_a, task_id, {"succeeded"})
        assert task["result"] == "rescued", task
        attempts = admin_a.get(f"/v1/tasks/{task_id}/attempts").json()["items"]
        assert [x["state"] for x in attempts] == [lost, "succeeded"], attempts
    events = admin_a.get(f"/v1/tasks/{claimed}/events").json()["items"]
    released = [(e["kind"], e["code"]) for e in events if e["kind"] == "released"]
    assert released == [("released", "TOKEN_REVOKED")], events


#: the node's ``--token-cache`` in the re-check test, which is also how often it re-checks
#: the tokens of its open worker connections
TOKEN_CACHE_S = 2.0


def _revoke_unannounced(db_url: str, token_id: str) -> None:
    """Mark the token revoked with the store's own statement, but none of the notice its
    revoke sends: what a node sees when its LISTEN connection was away at the time, or
    (on SQLite) when ``orbit token revoke`` ran in another process."""
    store = open_store(db_url)
    try:
        with store.driver.transaction() as cx:
            assert cx.execute("token_revoke", {"id": token_id, "now": 1}) == 1
    finally:
        store.close()


def _worker_token(db_url: str) -> tuple[str, str]:
    """A worker token made straight in the database: its id and its secret."""
    store = open_store(db_url)
    try:
        return store.token_create("leaked", ["worker"])
    finally:
        store.close()


def test_a_revoke_no_node_heard_of_closes_the_connection_within_the_token_cache_period(
    nodes: Callable[..., Node], db_url: str, tokens: Tokens
) -> None:
    """The backstop: a token is revoked without any notice reaching the node. Its re-check
    of the tokens its connections were opened with (every ``--token-cache`` seconds) finds
    it revoked and closes the connection with 4401 UNAUTHENTICATED, and the node then
    refuses the token at once (it forgot its cached answer). Before, the connection stayed
    open and was served for good."""
    node = nodes(args=["--token-cache", f"{TOKEN_CACHE_S:g}"])
    token_id, leaked = _worker_token(db_url)

    async def scenario() -> None:
        held = await WorkerConnection.connect(node.ws, leaked)
        await held.hello("holder", {"h": 1}, 1, push=False)
        kept = await WorkerConnection.connect(node.ws, tokens.worker)
        await kept.hello("kept", {"h": 1}, 1, push=False)
        _revoke_unannounced(db_url, token_id)
        closed = await _closed(held)
        assert (closed["code"], closed["reason"]) == (4401, "UNAUTHENTICATED")
        with pytest.raises(websockets.InvalidStatus) as refused:
            await WorkerConnection.connect(node.ws, leaked)
        assert refused.value.response.status_code == 401
        await kept.heartbeat(timeout=10)  # a connection with a good token is untouched
        await kept.close()

    asyncio.run(scenario())


def test_a_connection_upgraded_before_the_revoke_and_welcomed_after_it_is_closed(
    cluster: tuple[Node, Node], admin_a: httpx.Client
) -> None:
    """A worker's token is checked when its WebSocket is upgraded; its connection joins
    the node's connections only at its hello. One upgraded before the revoke, whose
    hello came after node B heard of it, was missed by the revoke's sweep, and was
    served until the next re-check (here far longer than the test). It is closed with
    4401 as it is welcomed. A connection of the same token attached before the revoke
    tells when node B has heard of it."""
    b = cluster[1]
    made = admin_a.post("/v1/tokens", json={"name": "leaked", "scopes": ["worker"]})
    assert made.status_code == 201, made.text
    leaked = made.json()

    async def scenario() -> None:
        sentinel = await WorkerConnection.connect(b.ws, leaked["token"])
        await sentinel.hello("sentinel", {"h": 1}, 1, push=False)
        upgraded = await WorkerConnection.connect(b.ws, leaked["token"])  # no hello yet
        revoked = admin_a.post(f"/v1/tokens/{leaked['id']}/revoke")
        assert revoked.status_code == 200, revoked.text
        assert (await _closed(sentinel))["code"] == 4401  # node B has heard of it
        await upgraded.hello("late", {"h": 1}, 1, push=False)
        closed = await _closed(upgraded)
        assert (closed["code"], closed["reason"]) == (4401, "UNAUTHENTICATED")

    asyncio.run(scenario())


def test_a_worker_whose_token_was_revoked_while_its_server_was_down_exits_3(
    nodes: Callable[..., Node], db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    """A real ``orbit worker`` runs a task; its server stops (the connection closes with
    no 4401), the worker's token is revoked while no server runs, and a server comes
    back on the same port. The worker never hears a 4401; its reconnects are refused
    with 401. Once the same token has been refused twice it stops as after a 4401: exit
    3 with the start-up's message. Before, it retried for ever, an error logged each
    time."""
    first = nodes(args=FAST)
    token_id, leaked = _worker_token(db_url)
    with httpx.Client(
        base_url=first.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as admin:
        created = admin.post("/v1/queues", json={"name": "q", "max_concurrency": 5, "rate": 0})
        assert created.status_code == 201, created.text
        task_id = submit(admin, "sleep", {"seconds": 120}, retry_safe=True)
    proc = _worker_process(
        first,
        Tokens(tokens.admin, tokens.submit, leaked),
        tmp_path,
        ORBIT_TEST_RECONNECT_MAX="0.2",
    )
    try:
        _wait_for(tmp_path / f"start-{task_id}")
        first.stop()
        store = open_store(db_url)
        try:
            store.token_revoke(token_id)
        finally:
            store.close()
        nodes(args=[*FAST, "--port", str(first.port)])
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, out
    assert "the server refused the token (HTTP 401)" in out, out
    assert out.count("connect refused: HTTP 401") == 2, out
    assert "4401" not in out, out
    assert leaked not in out


def test_a_connection_opened_after_an_unheard_revoke_is_refused_at_once(
    nodes: Callable[..., Node], db_url: str
) -> None:
    """A worker's upgrade reads the token from the database, not from the node's cache:
    let in by a cached answer, a connection opened after a revoke the node never heard
    of claimed and started tasks until the re-check after that answer ran out, nearly
    twice ``--token-cache`` after the revoke (here: ten minutes)."""
    node = nodes(args=LONG_TOKEN_CACHE)
    token_id, leaked = _worker_token(db_url)

    async def scenario() -> None:
        first = await WorkerConnection.connect(node.ws, leaked)  # the node caches it
        await first.hello("before", {"h": 1}, 1, push=False)
        await first.close()
        _revoke_unannounced(db_url, token_id)
        with pytest.raises(websockets.InvalidStatus) as refused:
            await WorkerConnection.connect(node.ws, leaked)
        assert refused.value.response.status_code == 401

    asyncio.run(scenario())
