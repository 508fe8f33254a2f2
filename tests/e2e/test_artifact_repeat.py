"""An upload sent again after its reply was lost (the server committed it; the worker saw
Unreachable), over real HTTP to a server process: with the same X-Orbit-Sha256 it is
answered 200 with the stored artifact, without it 409 ARTIFACT_EXISTS, as before. The
Python worker sends the header, so a handler's retry of the same bytes is safe."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.worker import ServerError, WorkerConnection
from orbit.worker import runner as runner_module
from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import run_until

BODY = os.urandom(700_000)  # three stored chunks: the repeat's body is read whole
SHA = hashlib.sha256(BODY).hexdigest()


def _api(node: Node, tokens: Tokens) -> httpx.Client:
    api = httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    return api


async def _repeats(node: Node, tokens: Tokens) -> dict[str, httpx.Response]:
    """PUTs of one name for a started attempt: the upload, then its repeats."""
    conn = await WorkerConnection.connect(node.ws, tokens.worker)
    await conn.hello("w", {"h": 1}, 1, push=False)
    [a] = await conn.claim(1)
    await conn.start(a["attempt_id"], a["fence"])
    url = f"{node.http}/v1/attempts/{a['attempt_id']}/artifacts/shot.png"
    headers = {
        "Authorization": f"Bearer {tokens.worker}",
        "Content-Type": "image/png",
        "X-Orbit-Session": conn.session_id or "",
        "X-Orbit-Epoch": conn.epoch or "",
        "X-Orbit-Fence": a["fence"],
    }
    other = b"other bytes"
    sends: list[tuple[str, bytes, dict[str, str]]] = [
        ("first", BODY, {"X-Orbit-Sha256": SHA}),
        ("repeat", BODY, {"X-Orbit-Sha256": SHA}),
        ("repeat_upper", BODY, {"X-Orbit-Sha256": SHA.upper()}),
        ("no_header", BODY, {}),
        ("other", other, {"X-Orbit-Sha256": hashlib.sha256(other).hexdigest()}),
        ("body_differs", other, {"X-Orbit-Sha256": SHA}),
        ("stale", BODY, {"X-Orbit-Sha256": SHA, "X-Orbit-Fence": str(int(a["fence"]) + 1)}),
    ]
    replies = {}
    async with httpx.AsyncClient(timeout=30) as http:
        for label, body, extra in sends:
            replies[label] = await http.put(url, content=body, headers={**headers, **extra})
    await conn.close()
    return replies


def test_a_repeat_with_the_same_sha256_is_answered_200_with_the_stored_artifact(
    node: Node, tokens: Tokens
) -> None:
    api = _api(node, tokens)
    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    replies = asyncio.run(_repeats(node, tokens))

    def refused(label: str) -> tuple[int, str]:
        reply = replies[label]
        return reply.status_code, reply.json()["error"]["code"]

    first = replies["first"]
    assert first.status_code == 201, first.text
    for label in ("repeat", "repeat_upper"):
        assert replies[label].status_code == 200, replies[label].text
        assert replies[label].json() == first.json()
    assert refused("no_header") == (409, "ARTIFACT_EXISTS")
    assert "X-Orbit-Sha256" in replies["no_header"].json()["error"]["message"]
    assert refused("other") == (409, "ARTIFACT_EXISTS")
    assert refused("body_differs") == (400, "DIGEST_MISMATCH")
    assert refused("stale") == (409, "STALE_FENCE")
    [listed] = api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]
    assert listed == first.json()
    assert api.get(f"/v1/artifacts/{listed['id']}/content").content == BODY
    events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
    assert [e["kind"] for e in events].count("artifact") == 1


def test_a_handlers_retry_of_the_same_upload_gets_the_stored_artifact(
    node: Node, tokens: Tokens, tmp_path: Path
) -> None:
    """ctx.upload sends the bytes' digest (a file's too): the second upload of the same
    bytes under the same name, what a handler does after an Unreachable whose upload was
    committed, returns the artifact the first stored. Other bytes are still refused."""
    api = _api(node, tokens)
    on_disk = tmp_path / "report.zip"
    on_disk.write_bytes(os.urandom(300_000))
    worker = Worker(node.http, tokens.worker)
    seen: dict[str, Any] = {}

    @worker.handler("shoot")
    async def shoot(ctx: Context, payload: Any) -> Any:
        seen["bytes"] = [await ctx.upload("shot.png", BODY, "image/png") for _ in range(2)]
        seen["file"] = [await ctx.upload("report.zip", on_disk) for _ in range(2)]
        on_disk.write_bytes(b"changed since")
        try:
            await ctx.upload("report.zip", on_disk)
        except ServerError as exc:
            seen["changed"] = exc.code
        return None

    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "shoot"}).json()["task"]["id"]
    asyncio.run(run_until(worker, lambda: worker.finished >= 1))
    assert api.get(f"/v1/tasks/{tid}").json()["state"] == "succeeded"
    first, again = seen["bytes"]
    assert again == first and first["sha256"] == SHA
    first_file, again_file = seen["file"]
    assert again_file == first_file
    assert seen["changed"] == "ARTIFACT_EXISTS"
    listed = api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]
    assert sorted(a["id"] for a in listed) == sorted([first["id"], first_file["id"]])


def test_a_file_changed_after_its_digest_was_read_is_refused_not_stored(
    node: Node, tokens: Tokens, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is read before the body is sent: a file rewritten in between is sent
    as it is then, which the server refuses DIGEST_MISMATCH, and nothing is stored."""
    api = _api(node, tokens)
    on_disk = tmp_path / "report.zip"
    on_disk.write_bytes(b"as hashed")
    read = runner_module._file

    async def rewritten_first(path: Path) -> AsyncIterator[bytes]:
        path.write_bytes(b"as rewritten")
        async for chunk in read(path):
            yield chunk

    monkeypatch.setattr(runner_module, "_file", rewritten_first)
    worker = Worker(node.http, tokens.worker)
    seen: dict[str, Any] = {}

    @worker.handler("shoot")
    async def shoot(ctx: Context, payload: Any) -> Any:
        try:
            await ctx.upload("report.zip", on_disk)
        except ServerError as exc:
            seen["code"] = exc.code
        return None

    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "shoot"}).json()["task"]["id"]
    asyncio.run(run_until(worker, lambda: worker.finished >= 1))
    assert seen["code"] == "DIGEST_MISMATCH"
    assert api.get(f"/v1/tasks/{tid}/artifacts").json()["items"] == []
