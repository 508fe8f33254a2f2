"""Backpressure over HTTP and through the clients, on both backends: a queue's and a
tenant's ``max_queued``, set with POST/PATCH /v1/queues and PUT /v1/limits/tenants, and
a submit past it answered 429 with a code, a Retry-After, and nothing written."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from orbit import AsyncClient, Client
from orbit.client import TooLarge, TooManyRequests
from tests.e2e.servers import Node, Tokens


def _task(**kw: Any) -> dict[str, Any]:
    return {"queue": "bp", "handler": "h", **kw}


def _tasks(admin: httpx.Client) -> list[str]:
    reply = admin.get("/v1/tasks", params={"queue": "bp", "limit": 1000})
    return [t["id"] for t in reply.json()["items"]]


def _events(admin: httpx.Client) -> int:
    return len(admin.get("/v1/events", params={"limit": 1000}).json()["items"])


def test_a_full_queue_and_tenant_answer_429_and_write_nothing(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    made = admin.post(
        "/v1/queues", json={"name": "bp", "max_concurrency": 1, "rate": 0, "max_queued": 2}
    )
    assert made.status_code == 201 and made.json()["max_queued"] == 2
    first = admin.post("/v1/tasks", json=_task(idempotency_key="k"))
    assert first.status_code == 201
    assert admin.post("/v1/tasks", json=_task()).status_code == 201
    before = (_tasks(admin), _events(admin))

    full = admin.post("/v1/tasks", json=_task())
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert full.json()["error"]["code"] == "QUEUE_FULL"
    assert "max_queued 2" in full.json()["error"]["message"]
    batch = admin.post("/v1/tasks/batch", json={"tasks": [_task(), _task()]})
    assert batch.status_code == 429 and batch.json()["error"]["code"] == "QUEUE_FULL"
    assert (_tasks(admin), _events(admin)) == before  # nothing written

    again = admin.post("/v1/tasks", json=_task(idempotency_key="k"))  # adds nothing
    assert again.status_code == 200 and again.json()["task"]["id"] == first.json()["task"]["id"]

    # Raised: room for one more; lowered below the depth: refused, nothing touched.
    assert admin.patch("/v1/queues/bp", json={"max_queued": 3}).json()["max_queued"] == 3
    assert admin.post("/v1/tasks", json=_task()).status_code == 201
    assert admin.patch("/v1/queues/bp", json={"max_queued": 1}).status_code == 200
    waiting = _tasks(admin)
    assert admin.post("/v1/tasks", json=_task()).status_code == 429
    states = admin.get("/v1/tasks", params={"queue": "bp", "limit": 1000}).json()["items"]
    assert [t["id"] for t in states] == waiting and {t["state"] for t in states} == {"queued"}
    removed = admin.patch("/v1/queues/bp", json={"max_queued": None})
    assert removed.status_code == 200 and removed.json()["max_queued"] is None
    assert admin.patch("/v1/queues/bp", json={"max_concurrency": 2}).json()["max_queued"] is None

    # A tenant's cap, across queues; PUT keeps the cap it leaves out.
    put = admin.put("/v1/limits/tenants/acme", json={"max_queued": 1})
    assert put.json() == {"tenant": "acme", "max_concurrency": None, "max_queued": 1}
    put = admin.put("/v1/limits/tenants/acme", json={"max_concurrency": 5})
    assert put.json() == {"tenant": "acme", "max_concurrency": 5, "max_queued": 1}
    assert admin.get("/v1/limits/tenants").json() == {"items": [put.json()], "next_cursor": None}
    assert admin.post("/v1/tasks", json=_task(tenant="acme")).status_code == 201
    tenant_full = admin.post("/v1/tasks", json=_task(tenant="acme"))
    assert tenant_full.status_code == 429 and tenant_full.headers["Retry-After"] == "1"
    assert tenant_full.json()["error"]["code"] == "TENANT_FULL"

    # The clients raise TooManyRequests, with the server's Retry-After.
    with Client(node.http, tokens.submit) as client:
        with pytest.raises(TooManyRequests) as refused:
            client.submit("bp", "h", tenant="acme")
        assert refused.value.status == 429 and refused.value.code == "TENANT_FULL"
        assert refused.value.retry_after == 1.0

    async def async_submit() -> TooManyRequests:
        async with AsyncClient(node.http, tokens.submit) as client:
            try:
                await client.submit("bp", "h", tenant="acme")
            except TooManyRequests as exc:
                return exc
        raise AssertionError("not refused")

    assert asyncio.run(async_submit()).retry_after == 1.0


def test_a_batch_that_can_never_fit_is_413_without_retry_after(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    """A batch making more new tasks than a cap was a 429 with Retry-After, which the
    clients' users wait out and resend, for ever: no wait makes it fit. It is 413
    BATCH_EXCEEDS_CAP, with no Retry-After, nothing written, not counted as backpressure;
    the clients raise TooLarge, not TooManyRequests."""
    admin.post("/v1/queues", json={"name": "bp", "max_concurrency": 1, "rate": 0, "max_queued": 2})
    before = (_tasks(admin), _events(admin))
    reply = admin.post("/v1/tasks/batch", json={"tasks": [_task() for _ in range(3)]})
    assert reply.status_code == 413, reply.text
    assert "Retry-After" not in reply.headers
    error = reply.json()["error"]
    assert error["code"] == "BATCH_EXCEEDS_CAP"
    assert "max_queued 2" in error["message"] and "3 new tasks" in error["message"]
    assert (_tasks(admin), _events(admin)) == before
    assert _refused(node) == {"queue_full": 0, "tenant_full": 0}

    with Client(node.http, tokens.submit) as client:
        with pytest.raises(TooLarge) as refused:
            client.submit_many([_task() for _ in range(3)], reply="ids")
        assert (refused.value.status, refused.value.code) == (413, "BATCH_EXCEEDS_CAP")

    async def async_submit() -> TooLarge:
        async with AsyncClient(node.http, tokens.submit) as client:
            try:
                await client.submit_many([_task() for _ in range(3)])
            except TooLarge as exc:
                return exc
        raise AssertionError("not refused")

    assert asyncio.run(async_submit()).code == "BATCH_EXCEEDS_CAP"
    assert (_tasks(admin), _events(admin)) == before
    ok = admin.post("/v1/tasks/batch", json={"tasks": [_task(), _task()]})
    assert ok.status_code == 201  # the cap's worth fits


def test_a_batch_to_two_tenants_sharing_a_depth_key_is_answered(admin: httpx.Client) -> None:
    """Two tenants whose names share a CRC-32 share a depth key; a batch to both, one of
    them capped, took the node's gate of that key twice and never answered, and every
    later submit to either tenant on that node waited behind it until the node was
    killed (SIGTERM waited for the request too)."""
    admin.post("/v1/queues", json={"name": "bp", "max_concurrency": 1, "rate": 0})
    assert admin.put("/v1/limits/tenants/t928096", json={"max_queued": 5}).status_code == 200
    assert admin.post("/v1/tasks", json=_task(tenant="t928096")).status_code == 201
    both = {"tasks": [_task(tenant="t928096"), _task(tenant="t11200040")]}
    reply = admin.post("/v1/tasks/batch", json=both, timeout=30)
    assert reply.status_code == 201, reply.text
    assert admin.post("/v1/tasks", json=_task(tenant="t11200040"), timeout=30).status_code == 201
    assert len(_tasks(admin)) == 4


#: every max_queued the API refuses: out of range, not an integer
BAD_CAPS: list[Any] = [0, -1, 1_000_000_001, True, 2.5, "3", {}]


def test_every_bad_max_queued_is_refused_with_400(admin: httpx.Client) -> None:
    """One server per backend for all the values (a loop, not a parametrised test)."""
    admin.post("/v1/queues", json={"name": "bp", "max_concurrency": 1, "rate": 0})
    for bad in BAD_CAPS:
        for reply in (
            admin.post(
                "/v1/queues",
                json={"name": "other", "max_concurrency": 1, "rate": 0, "max_queued": bad},
            ),
            admin.patch("/v1/queues/bp", json={"max_queued": bad}),
            admin.put("/v1/limits/tenants/acme", json={"max_queued": bad}),
        ):
            assert reply.status_code == 400, (bad, reply.text)
            assert reply.json()["error"]["field"] == "max_queued", (bad, reply.text)
    assert [q["name"] for q in admin.get("/v1/queues").json()["items"]] == ["bp"]
    assert admin.get("/v1/queues").json()["items"][0]["max_queued"] is None
    assert admin.get("/v1/limits/tenants").json() == {"items": [], "next_cursor": None}
    empty = admin.put("/v1/limits/tenants/acme", json={})
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "MISSING_FIELD"


def _refused(node: Node) -> dict[str, float]:
    """``orbit_refused_submits_total`` by reason, as Prometheus parses ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(f"{node.http}/metrics")
    assert reply.status_code == 200
    return {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
        if s.name == "orbit_refused_submits_total"
    }


def test_refused_submits_are_counted_by_reason(admin: httpx.Client, node: Node) -> None:
    """Each 429 counts once, a batch as one refusal; an accepted submit counts nothing,
    nor does a batch that can never fit (413). Both series are there, at 0, before any
    refusal."""
    assert _refused(node) == {"queue_full": 0, "tenant_full": 0}
    admin.post("/v1/queues", json={"name": "bp", "max_concurrency": 1, "rate": 0, "max_queued": 2})
    admin.put("/v1/limits/tenants/acme", json={"max_queued": 1})
    assert admin.post("/v1/tasks", json=_task(tenant="acme")).status_code == 201
    assert admin.post("/v1/tasks", json=_task()).status_code == 201
    assert admin.post("/v1/tasks", json=_task()).status_code == 429
    batch = admin.post("/v1/tasks/batch", json={"tasks": [_task(), _task()]})
    assert batch.status_code == 429
    never = admin.post("/v1/tasks/batch", json={"tasks": [_task(), _task(), _task()]})
    assert never.status_code == 413
    admin.patch("/v1/queues/bp", json={"max_queued": None})
    assert admin.post("/v1/tasks", json=_task(tenant="acme")).status_code == 429
    assert admin.post("/v1/tasks", json=_task()).status_code == 201
    assert _refused(node) == {"queue_full": 2, "tenant_full": 1}


def test_a_burst_at_a_full_queue_leaves_the_node_its_threads(
    admin: httpx.Client, node: Node, tokens: Tokens, db_url: str
) -> None:
    """Submits to one capped queue go one at a time, cluster-wide. A burst of them, more
    than the node's store threads (orbit.server.threads.THREADS), each took a thread to
    wait for its turn, and every other call of the node (a submit to another queue here;
    a worker's report alike) waited for a thread behind them. They wait on the event loop
    now, one per capped scope in a thread."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite has one writer: nothing waits for a depth lock")
    import threading

    import psycopg

    from orbit.server.threads import THREADS
    from orbit.store.store import depth_key
    from tests.store.helpers import RACE_WAIT, until_done_or_waiting_on_a_lock

    admin.post(
        "/v1/queues", json={"name": "bp", "max_concurrency": 1, "rate": 0, "max_queued": 999}
    )
    admin.post("/v1/queues", json={"name": "free", "max_concurrency": 1, "rate": 0})
    assert admin.post("/v1/tasks", json=_task()).status_code == 201  # the node saw the cap
    codes: list[int] = []

    def post(queue: str) -> None:
        with httpx.Client(base_url=node.http, timeout=2 * RACE_WAIT) as c:
            reply = c.post(
                "/v1/tasks",
                json={"queue": queue, "handler": "h"},
                headers={"Authorization": f"Bearer {tokens.submit}"},
            )
            codes.append(reply.status_code)

    with psycopg.connect(db_url) as other_node:  # holds bp's depth lock
        other_node.execute("SELECT pg_advisory_xact_lock(%s)", (depth_key("queue", "bp"),))
        burst = [threading.Thread(target=post, args=("bp",)) for _ in range(THREADS + 8)]
        for t in burst:
            t.start()
        until_done_or_waiting_on_a_lock(burst[0], db_url)
        probe = threading.Thread(target=post, args=("free",))
        probe.start()
        probe.join(RACE_WAIT)
        assert not probe.is_alive() and codes == [201], codes  # bp's lock still held
        other_node.rollback()
    for t in burst:
        t.join(RACE_WAIT)
    assert codes == [201] * (THREADS + 9)
