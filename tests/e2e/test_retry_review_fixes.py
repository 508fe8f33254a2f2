"""Fixes from a review of retries, timeouts and deadlines, through a real server on both
backends: a resolve's result is held to a finish's size bound (413); the published
default of a resolved error's ``retryable`` is what is stored; a duration under 1 µs is
refused saying what the floor is; the clients take a ``timedelta`` for a duration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.client import AsyncClient, BadRequest, Client
from orbit.core.validate import MAX_RESULT_CHARS
from orbit.worker.connection import WorkerConnection
from tests.e2e.servers import Node, Tokens

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--lease-ttl", "1", "--claim-ttl", "2", "--reap-interval", "0.1"]


@pytest.fixture
def fast(nodes: Callable[..., Node]) -> Node:
    return nodes(args=FAST)


@pytest.fixture
def api(fast: Node, tokens: Tokens) -> Any:
    with httpx.Client(
        base_url=fast.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as client:
        made = client.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
        assert made.is_success, made.text
        yield client


async def _started_and_dropped(node: Node, token: str, n: int) -> None:
    """Claim and start ``n`` tasks, then close the connection without a report."""
    conn = await WorkerConnection.connect(node.ws, token)
    await conn.hello("w", {"h": n}, n, push=False)
    grants: list[dict[str, Any]] = []
    while len(grants) < n:
        grants += await conn.claim(n - len(grants))
    for grant in grants:
        await conn.start(grant["attempt_id"], grant["fence"])
    await conn.close()


def _needs_review(api: httpx.Client, node: Node, tokens: Tokens, n: int) -> list[str]:
    """``n`` tasks in needs_review: started, then their run lease left to run out."""
    ids = []
    for _ in range(n):
        reply = api.post("/v1/tasks", json={"queue": "q", "handler": "h", "max_attempts": 1})
        assert reply.status_code == 201, reply.text
        ids.append(reply.json()["task"]["id"])
    asyncio.run(_started_and_dropped(node, tokens.worker, n))
    for tid in ids:
        with Client(node.http, token=tokens.admin) as client:
            assert client.wait(tid, timeout=30)["state"] == "needs_review"
    return ids


def test_resolve_refuses_a_result_no_finish_could_carry_and_stores_the_published_default(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    """A 12 MB result was resolved ``succeeded`` with 200 and stored: it is now 413
    PAYLOAD_TOO_LARGE naming ``result``, and the task is left in needs_review. A failure
    resolved without ``retryable`` is stored with the default the published schema gives
    (it said true, which resolve refuses; false is stored)."""
    large, failed = _needs_review(api, fast, tokens, 2)
    body = json.dumps({"decision": "succeeded", "result": "é" * 6_000_000}, ensure_ascii=False)
    refused = api.post(
        f"/v1/tasks/{large}/resolve", content=body, headers={"content-type": "application/json"}
    )
    assert refused.status_code == 413, refused.text[:300]
    error = refused.json()["error"]
    assert (error["code"], error["field"]) == ("PAYLOAD_TOO_LARGE", "result")
    assert str(MAX_RESULT_CHARS) in error["message"]
    task = api.get(f"/v1/tasks/{large}").json()
    assert (task["state"], task["result"]) == ("needs_review", None)

    schema = json.loads((ROOT / "schema" / "http.TaskResolve.json").read_text())
    error_ref = schema["properties"]["error"]["anyOf"][0]["$ref"].rsplit("/", 1)[-1]
    published = schema["$defs"][error_ref]["properties"]["retryable"]["default"]
    resolved = api.post(
        f"/v1/tasks/{failed}/resolve", json={"decision": "failed", "error": {"code": "E"}}
    )
    assert resolved.status_code == 200, resolved.text
    assert resolved.json()["error"]["code"] == "E"
    assert resolved.json()["error"]["retryable"] is published
    assert api.get(f"/v1/tasks/{failed}").json()["error"]["retryable"] is published


@pytest.mark.parametrize(
    ("bad", "code", "field"),
    [
        ({"attempt_timeout": 1e-7}, "INVALID_TIMEOUT", "attempt_timeout"),
        ({"backoff": {"base": 1e-7}}, "INVALID_BACKOFF", "backoff.base"),
    ],
)
def test_a_duration_under_a_microsecond_names_the_floor(
    admin: httpx.Client, bad: dict[str, Any], code: str, field: str
) -> None:
    """The reviewer's inputs: the message said the duration must be positive (> 0),
    which 1e-7 is; it now says what the floor is."""
    assert admin.post("/v1/queues", json={"name": "q", "max_concurrency": 5, "rate": 0}).is_success
    reply = admin.post("/v1/tasks", json={"queue": "q", "handler": "h", **bad})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == (code, field)
    assert "at least 0.000001 s (1 µs) and at most a year" in error["message"]
    assert admin.get("/v1/tasks").json()["items"] == []


_DURATIONS: dict[str, Any] = {
    "attempt_timeout": timedelta(seconds=5),
    "backoff": {"base": timedelta(milliseconds=250), "factor": 2, "max": timedelta(minutes=1)},
}
#: a backoff whose base (120 s) is past its max (60 s): refused only if sent as seconds
_BASE_PAST_MAX = {"backoff": {"base": timedelta(minutes=2), "max": timedelta(minutes=1)}}


def test_the_clients_take_a_timedelta_for_a_duration(node: Node, tokens: Tokens) -> None:
    """``attempt_timeout=timedelta(seconds=5)`` was a TypeError naming no argument
    ("Object of type timedelta is not JSON serializable"), where ``deadline`` took a
    datetime: both clients send it, and a backoff's, as seconds."""
    with Client(node.http, token=tokens.admin) as client:
        client.queue_create("q", max_concurrency=5, rate=0)
        assert client.submit("q", "h", **_DURATIONS)["attempt_timeout"] == 5.0
        with pytest.raises(BadRequest) as refused:
            client.submit("q", "h", **_BASE_PAST_MAX)
        assert (refused.value.code, refused.value.field) == ("INVALID_BACKOFF", "backoff.max")

    async def submit_async() -> tuple[dict[str, Any], BadRequest]:
        async with AsyncClient(node.http, token=tokens.admin) as client:
            task = await client.submit("q", "h", **_DURATIONS)
            with pytest.raises(BadRequest) as refused:
                await client.submit("q", "h", **_BASE_PAST_MAX)
            return task, refused.value

    task, refusal = asyncio.run(submit_async())
    assert task["attempt_timeout"] == 5.0
    assert (refusal.code, refusal.field) == ("INVALID_BACKOFF", "backoff.max")


def test_submit_many_takes_durations_and_instants_as_submit_does(
    node: Node, tokens: Tokens
) -> None:
    """A ``submit_many`` item with ``attempt_timeout=timedelta(...)`` was a bare TypeError
    from the JSON encoder, where ``submit`` took it: each item's durations go as seconds,
    its instants as RFC 3339, and a naive instant is refused before anything is sent."""
    soon = datetime.now(UTC) + timedelta(hours=1)
    item = {"queue": "q", "handler": "h", **_DURATIONS, "deadline": soon}
    with Client(node.http, token=tokens.admin) as client:
        client.queue_create("q", max_concurrency=5, rate=0)
        [task] = client.submit_many([item])
        assert task["attempt_timeout"] == 5.0 and task["backoff"]["max"] == 60.0
        assert datetime.fromisoformat(task["deadline"]) == soon
        with pytest.raises(ValueError, match="timezone"):
            client.submit_many([{**item, "deadline": soon.replace(tzinfo=None)}])
        assert len(list(client.iter_tasks(queue="q"))) == 1  # the refused batch made nothing
        # Anything but a list is the server's to refuse, naming "tasks": None was a bare
        # TypeError, and a dict's keys were sent as the tasks ("tasks[0]: …").
        for wrong in (None, {"queue": "q", "handler": "h"}):
            with pytest.raises(BadRequest) as refused:
                client.submit_many(wrong)  # type: ignore[call-overload]
            assert refused.value.field == "tasks", refused.value

    async def submit_async() -> dict[str, Any]:
        async with AsyncClient(node.http, token=tokens.admin) as client:
            [task] = await client.submit_many([item])
            return task

    assert asyncio.run(submit_async())["attempt_timeout"] == 5.0
