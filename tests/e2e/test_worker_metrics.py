"""The worker protocol's transactions in /metrics (``orbit_worker_transaction_seconds``
and ``orbit_worker_transaction_items_total``, by op), over a real WebSocket on SQLite and
PostgreSQL: every op's series is there from the start at 0; each claim, start, finish,
renew and release a node makes for a worker counts once with the tasks it granted or the
reports it carried, a refused report too; a push counts as the dispatcher's claim; and on
two PostgreSQL nodes each counts only what went through it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orbit.server.metrics import WORKER_OPS
from orbit.worker import ServerError, WorkerConnection
from tests.e2e.servers import Node, Tokens, make_tokens, start_server
from tests.pg import as_url, temporary_database

#: (calls, tasks or reports) by op
Counts = dict[str, tuple[int, int]]


def worker_transactions(node: Node) -> tuple[Counts, dict[str, float]]:
    """Each op's calls and items, and its seconds, from the node's /metrics; the calls
    are the histogram's count, which its ``+Inf`` bucket must equal."""
    text = httpx.get(f"{node.http}/metrics").raise_for_status().text
    calls: dict[str, float] = {}
    infinite: dict[str, float] = {}
    items: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            op = sample.labels.get("op", "")
            if sample.name == "orbit_worker_transaction_seconds_count":
                calls[op] = sample.value
            elif sample.name == "orbit_worker_transaction_seconds_sum":
                seconds[op] = sample.value
            elif sample.name == "orbit_worker_transaction_seconds_bucket":
                if sample.labels["le"] == "+Inf":
                    infinite[op] = sample.value
            elif sample.name == "orbit_worker_transaction_items_total":
                items[op] = sample.value
    assert calls == infinite
    assert set(calls) == set(items) == set(seconds)
    return {op: (int(calls[op]), int(items[op])) for op in calls}, seconds


def make_queue(admin: httpx.Client, name: str) -> None:
    reply = admin.post("/v1/queues", json={"name": name, "max_concurrency": 100, "rate": 0})
    assert reply.status_code == 201, reply.text


def submit(admin: httpx.Client, queue: str, n: int) -> None:
    specs = [{"queue": queue, "handler": "h"} for _ in range(n)]
    reply = admin.post("/v1/tasks/batch", json={"tasks": specs})
    assert reply.status_code == 201, reply.text


@contextlib.asynccontextmanager
async def session(node: Node, tokens: Tokens, *, push: bool) -> AsyncIterator[WorkerConnection]:
    """A worker session of handler ``h`` (10 slots) on ``node``, closed afterwards."""
    conn = await WorkerConnection.connect(node.ws, tokens.worker)
    try:
        await conn.hello("w", {"h": 10}, max_concurrency=10, push=push)
        yield conn
    finally:
        await conn.close()


def test_each_worker_transaction_is_counted_with_its_items(
    node: Node, tokens: Tokens, admin: httpx.Client
) -> None:
    counts, seconds = worker_transactions(node)
    assert counts == {op: (0, 0) for op in WORKER_OPS}  # every series, before any call
    assert seconds == {op: 0.0 for op in WORKER_OPS}
    make_queue(admin, "q")
    submit(admin, "q", 6)

    async def work() -> None:
        async with session(node, tokens, push=False) as conn:
            first = await conn.claim(4)
            assert len(first) == 4
            (a, fa), (b, fb), (c, fc), (d, fd) = [(t["attempt_id"], t["fence"]) for t in first]
            started = await conn.start_many([(a, fa), (b, fb), (c, fc)])
            assert all(r["error"] is None for r in started)
            assert (await conn.start(d, fd))["status"] == "ok"
            with pytest.raises(ServerError):  # a refused report is timed and counted too
                await conn.start(d, "99")
            assert len(await conn.renew([a, b])) == 2
            finished = await conn.finish_many(
                [(a, fa, {"ok": True, "result": None}), (b, fb, {"ok": True, "result": None})]
            )
            assert all(r["error"] is None for r in finished)
            await conn.finish(c, fc, result=1)
            rest = await conn.claim(4)
            assert len(rest) == 2
            await conn.release(rest[0]["attempt_id"], rest[0]["fence"])

    asyncio.run(work())
    counts, seconds = worker_transactions(node)
    assert counts == {
        "claim": (2, 6),
        "start": (3, 5),
        "renew": (1, 2),
        "finish": (2, 3),
        "release": (1, 1),
    }
    assert all(seconds[op] > 0 for op in WORKER_OPS)


def test_a_push_counts_as_the_dispatchers_claim(
    node: Node, tokens: Tokens, admin: httpx.Client
) -> None:
    make_queue(admin, "pushed")
    submit(admin, "pushed", 5)

    async def work() -> int:
        async with session(node, tokens, push=True) as conn:
            got = 0
            while got < 5:
                message = await conn.next_push(30)
                assert message["type"] == "tasks", message
                got += len(message["tasks"])
            return got

    assert asyncio.run(work()) == 5
    calls, items = worker_transactions(node)[0]["claim"]
    assert calls >= 1 and items == 5  # empty claims count as calls, with no items


@pytest.mark.postgres_only
def test_each_node_counts_only_what_went_through_it(tmp_path: Path) -> None:
    with temporary_database("orbit_worker_metrics") as dsn:
        db_url = as_url(dsn)
        tokens = make_tokens(db_url)  # also migrates the schema
        a = start_server(db_url, tmp_path, node_id="a")
        try:
            b = start_server(db_url, tmp_path, node_id="b")
            try:
                with httpx.Client(
                    base_url=a.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
                ) as admin:
                    make_queue(admin, "spread")
                    submit(admin, "spread", 3)

                async def claim_through(node: Node) -> int:
                    async with session(node, tokens, push=False) as conn:
                        return len(await conn.claim(10))

                assert asyncio.run(claim_through(b)) == 3
                assert worker_transactions(b)[0]["claim"] == (1, 3)
                # submitted through a, claimed through b: a made no claim
                assert worker_transactions(a)[0]["claim"] == (0, 0)
            finally:
                b.stop()
        finally:
            a.stop()
