"""Fixes from a review of the worker protocol by a worker written from docs/protocol.md
alone, through a real server on both backends: the receipt's ``result_digest`` is what
the docs' recipe computes; progress and an artifact on an attempt still claimed are
NOT_STARTED (the attempt is live), not ATTEMPT_ENDED; a start refused because the task
was cancelled names the cancel; the artifact upload's unknown session and missing
Content-Type answer as documented."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.worker import ServerError
from orbit.worker.connection import WorkerConnection
from tests.e2e.servers import Node, Tokens

ROOT = Path(__file__).resolve().parents[2]
#: Nothing may move by the clock while a test compares state before and after.
STILL = ["--claim-ttl", "3600", "--lease-ttl", "3600", "--session-ttl", "3600"]


@pytest.fixture
def still(nodes: Any) -> Node:
    return nodes(args=STILL)


@pytest.fixture
def api(still: Node, tokens: Tokens) -> Any:
    with httpx.Client(
        base_url=still.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as client:
        made = client.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
        assert made.is_success, made.text
        yield client


def _submit(api: httpx.Client, n: int = 1) -> list[str]:
    ids = []
    for _ in range(n):
        reply = api.post("/v1/tasks", json={"queue": "q", "handler": "h"})
        assert reply.status_code == 201, reply.text
        ids.append(reply.json()["task"]["id"])
    return ids


async def _claimed(node: Node, tokens: Tokens, n: int) -> tuple[WorkerConnection, list[Any]]:
    """A raw worker connection (no pushes) holding ``n`` claimed attempts."""
    conn = await WorkerConnection.connect(node.ws, tokens.worker)
    await conn.hello("w", {"h": n}, n, push=False)
    grants: list[dict[str, Any]] = []
    while len(grants) < n:
        grants += await conn.claim(n - len(grants))
    return conn, grants


def _state(api: httpx.Client, tid: str) -> tuple[Any, ...]:
    """What a refused report must not change: the task, its attempts and artifacts; and
    its events, compared by kind and code."""
    task = api.get(f"/v1/tasks/{tid}").json()
    attempts = api.get(f"/v1/tasks/{tid}/attempts").json()["items"]
    artifacts = api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]
    events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
    return task, attempts, artifacts, [(e["kind"], e.get("code")) for e in events]


def _upload_headers(tokens: Tokens, conn: WorkerConnection, grant: dict[str, Any]) -> Any:
    assert conn.session_id is not None and conn.epoch is not None
    return {
        "Authorization": f"Bearer {tokens.worker}",
        "X-Orbit-Session": conn.session_id,
        "X-Orbit-Epoch": conn.epoch,
        "X-Orbit-Fence": grant["fence"],
    }


def _documented_digest(outcome: dict[str, Any]) -> str:
    """``result_digest`` computed by the docs' words, nothing else: docs/protocol.md
    spells each outcome "with its defaults filled in", and the canonical JSON is the
    call docs/concepts.md names (non-ASCII written as itself), hashed as UTF-8."""
    protocol = " ".join((ROOT / "docs" / "protocol.md").read_text().split())
    concepts = " ".join((ROOT / "docs" / "concepts.md").read_text().split())
    call = 'json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)'
    assert call in concepts and "non-ASCII characters written as themselves" in concepts
    # The docs' examples of what an outcome is digested as: its wire form -> its spelling.
    spelled = {
        json.dumps(json.loads(sent), sort_keys=True): text
        for sent, text in re.findall(r"`(\{[^`]*\})` is digested as `(\{[^`]*\})`", protocol)
        + re.findall(r"`(\{[^`]*\})` as `(\{[^`]*\})`", protocol)
    }
    text = spelled.get(json.dumps(outcome, sort_keys=True))
    if text is None:  # not among the examples: a success, with its result given
        assert set(outcome) == {"ok", "result"} and outcome["ok"] is True
        text = json.dumps(outcome, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


OUTCOMES: list[dict[str, Any]] = [
    {"ok": True, "result": {"s": "é"}},
    {"ok": True},
    {"ok": False, "error": {"code": "BAD", "retryable": False}},
]


def test_the_receipts_digest_is_the_documented_recipes(
    api: httpx.Client, still: Node, tokens: Tokens
) -> None:
    """The docs said non-ASCII was escaped and the outcome digested as reported: neither
    gave the server's digest for an ``é``, a success without ``result`` or a failure
    without ``message``."""
    _submit(api, len(OUTCOMES))

    async def go() -> list[str]:
        conn, grants = await _claimed(still, tokens, len(OUTCOMES))
        try:
            digests = []
            for grant, outcome in zip(grants, OUTCOMES, strict=True):
                await conn.start(grant["attempt_id"], grant["fence"])
                receipt = await conn.finish_report(grant["attempt_id"], grant["fence"], outcome)
                digests.append(receipt["result_digest"])
            return digests
        finally:
            await conn.close()

    assert asyncio.run(go()) == [_documented_digest(o) for o in OUTCOMES]


def test_progress_and_an_artifact_on_a_claimed_attempt_are_not_started(
    api: httpx.Client, still: Node, tokens: Tokens
) -> None:
    """They were ATTEMPT_ENDED "the attempt is claimed": a code that elsewhere says the
    attempt is over, so a worker following the docs gave up a claim it still held. Both
    are refused, leave their evidence, and change nothing else; the start still works."""
    (tid,) = _submit(api)

    async def go() -> None:
        conn, (grant,) = await _claimed(still, tokens, 1)
        try:
            before = _state(api, tid)
            with pytest.raises(ServerError) as progress:
                await conn.progress(grant["attempt_id"], grant["fence"], fraction=0.5)
            assert progress.value.code == "NOT_STARTED", progress.value.reply
            assert "claimed and not started" in progress.value.message
            put = httpx.put(
                f"{still.http}/v1/attempts/{grant['attempt_id']}/artifacts/a.txt",
                content=b"x",
                headers={**_upload_headers(tokens, conn, grant), "Content-Type": "text/plain"},
            )
            assert put.status_code == 409, put.text
            assert put.json()["error"]["code"] == "NOT_STARTED"
            task, attempts, artifacts, events = _state(api, tid)
            assert (task, attempts, artifacts) == before[:3]
            assert events == [*before[3], ("rejected", "NOT_STARTED"), ("rejected", "NOT_STARTED")]
            assert attempts[0]["state"] == "claimed"
            await conn.start(grant["attempt_id"], grant["fence"])
        finally:
            await conn.close()

    asyncio.run(go())


def test_a_start_after_the_cancel_names_the_cancel(
    api: httpx.Client, still: Node, tokens: Tokens
) -> None:
    """It said "the attempt is released, not claimed": true, but not why."""
    (tid,) = _submit(api)

    async def go() -> None:
        conn, (grant,) = await _claimed(still, tokens, 1)
        try:
            cancelled = api.post(f"/v1/tasks/{tid}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["state"] == "cancelled"
            before = _state(api, tid)
            with pytest.raises(ServerError) as start:
                await conn.start(grant["attempt_id"], grant["fence"])
            assert start.value.code == "TASK_CANCELLED"
            assert start.value.message == "the task was cancelled: its attempt is released"
            task, attempts, artifacts, events = _state(api, tid)
            assert (task, attempts, artifacts) == before[:3]
            assert events == [*before[3], ("rejected", "TASK_CANCELLED")]
        finally:
            await conn.close()

    asyncio.run(go())


def test_an_upload_from_an_unknown_session_and_one_without_a_content_type(
    api: httpx.Client, still: Node, tokens: Tokens
) -> None:
    """Both answers were undocumented: an unknown X-Orbit-Session is 404
    SESSION_NOT_FOUND (no event, nothing stored); a body sent without a Content-Type is
    stored, and served back, as application/octet-stream."""
    (tid,) = _submit(api)

    async def go() -> None:
        conn, (grant,) = await _claimed(still, tokens, 1)
        try:
            await conn.start(grant["attempt_id"], grant["fence"])
            url = f"{still.http}/v1/attempts/{grant['attempt_id']}/artifacts"
            headers = _upload_headers(tokens, conn, grant)
            before = _state(api, tid)
            stranger = {**headers, "X-Orbit-Session": "no-such-session"}
            unknown = httpx.put(f"{url}/a.bin", content=b"x", headers=stranger)
            assert unknown.status_code == 404, unknown.text
            assert unknown.json()["error"]["code"] == "SESSION_NOT_FOUND"
            assert _state(api, tid) == before

            bare = httpx.put(f"{url}/a.bin", content=b"bytes", headers=headers)
            assert "content-type" not in bare.request.headers
            assert bare.status_code == 201, bare.text
            assert bare.json()["content_type"] == "application/octet-stream"
            served = api.get(f"/v1/artifacts/{bare.json()['id']}/content")
            assert served.status_code == 200 and served.content == b"bytes"
            assert served.headers["content-type"] == "application/octet-stream"
        finally:
            await conn.close()

    asyncio.run(go())
