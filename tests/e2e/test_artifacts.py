"""Artifacts over the wire: a handler uploads (bytes and a file), a client downloads."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from orbit import Client
from orbit.worker import ServerError, WorkerConnection
from orbit.worker import runner as runner_module
from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import run_until

LIMIT = 2_000_000


@pytest.fixture
def small(nodes: Callable[..., Node]) -> Node:
    return nodes(args=["--max-artifact-bytes", str(LIMIT), "--reap-interval", "0.2"])


async def _started(node: Node, tokens: Tokens) -> tuple[WorkerConnection, str, dict[str, str]]:
    """A worker connection holding the one queued task's started attempt, the URL its
    artifacts are uploaded under, and the headers an upload for it needs."""
    conn = await WorkerConnection.connect(node.ws, tokens.worker)
    await conn.hello("w", {"h": 1}, 1, push=False)
    [a] = await conn.claim(1)
    await conn.start(a["attempt_id"], a["fence"])
    headers = {
        "Authorization": f"Bearer {tokens.worker}",
        "Content-Type": "text/plain",
        "X-Orbit-Session": conn.session_id or "",
        "X-Orbit-Epoch": conn.epoch or "",
        "X-Orbit-Fence": a["fence"],
    }
    return conn, f"{node.http}/v1/attempts/{a['attempt_id']}/artifacts", headers


def test_handler_uploads_and_client_downloads(small: Node, tokens: Tokens, tmp_path: Path) -> None:
    api = httpx.Client(
        base_url=small.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    picture = os.urandom(700_000)  # three stored chunks
    on_disk = tmp_path / "report.zip"
    on_disk.write_bytes(os.urandom(300_000))
    worker = Worker(small.http, tokens.worker)
    seen: dict[str, Any] = {}

    @worker.handler("shoot")
    async def shoot(ctx: Context, payload: Any) -> Any:
        first = await ctx.upload("shot.png", picture, "image/png")
        second = await ctx.upload("report.zip", on_disk, "application/zip")
        try:
            await ctx.upload("too-big.bin", b"x" * (LIMIT + 1))
        except ServerError as exc:
            seen["too_big"] = exc.code
        return {"png": first["id"], "zip": second["id"]}

    @worker.handler("sync")
    def sync(ctx: Context, payload: Any) -> Any:
        return ctx.upload_from_thread("note.txt", b"from a thread", "text/plain")["id"]

    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "shoot"}).json()["task"]["id"]
    sid = api.post("/v1/tasks", json={"queue": "q", "handler": "sync"}).json()["task"]["id"]

    asyncio.run(run_until(worker, lambda: worker.finished >= 2))
    result = api.get(f"/v1/tasks/{tid}").json()["result"]
    listed = {a["name"]: a for a in api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]}
    assert set(listed) == {"shot.png", "report.zip"}  # the refused upload left nothing
    assert seen["too_big"] == "ARTIFACT_TOO_LARGE"
    png = api.get(f"/v1/artifacts/{result['png']}/content")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content == picture
    assert png.headers["x-orbit-sha256"] == hashlib.sha256(picture).hexdigest()
    assert listed["shot.png"]["size"] == len(picture)
    zipped = api.get(f"/v1/artifacts/{result['zip']}/content")
    assert zipped.content == on_disk.read_bytes()
    with Client(small.http, tokens.submit) as client:  # the SDK, buffered and streamed
        assert client.artifact_content(result["png"]) == picture
        assert b"".join(client.artifact_stream(result["zip"])) == on_disk.read_bytes()
        assert {a["name"] for a in client.artifacts(tid)} == {"shot.png", "report.zip"}
        first = client.list_artifacts(tid, limit=1)  # a page, as list_tasks reads one
        assert len(first["items"]) == 1 and first["next_cursor"] is not None
        second = client.list_artifacts(tid, limit=1, cursor=first["next_cursor"])
        paged = [a["id"] for a in first["items"] + second["items"]]
        assert paged == [a["id"] for a in client.iter_artifacts(tid, limit=1)]
        assert paged == [a["id"] for a in client.artifacts(tid)]
    note_id = api.get(f"/v1/tasks/{sid}").json()["result"]
    assert api.get(f"/v1/artifacts/{note_id}/content").content == b"from a thread"
    assert api.get("/v1/artifacts/nope").status_code == 404


def test_uploads_are_fenced_and_validated(small: Node, tokens: Tokens) -> None:
    api = httpx.Client(
        base_url=small.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]

    async def scenario() -> dict[str, Any]:
        conn, url, headers = await _started(small, tokens)
        replies: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=30) as http:
            replies["stale"] = await http.put(
                f"{url}/x", content=b"1", headers={**headers, "X-Orbit-Fence": "2"}
            )
            replies["bad_fence"] = await http.put(
                f"{url}/x", content=b"1", headers={**headers, "X-Orbit-Fence": "01"}
            )
            replies["digest"] = await http.put(
                f"{url}/x", content=b"1", headers={**headers, "X-Orbit-Sha256": "0" * 64}
            )
            replies["submit_token"] = await http.put(
                f"{url}/x",
                content=b"1",
                headers={**headers, "Authorization": f"Bearer {tokens.submit}"},
            )
            replies["ok"] = await http.put(f"{url}/x", content=b"1", headers=headers)
        await conn.close()
        return replies

    replies = asyncio.run(scenario())
    assert replies["stale"].status_code == 409
    assert replies["stale"].json()["error"]["code"] == "STALE_FENCE"
    assert replies["bad_fence"].status_code == 400
    assert replies["digest"].status_code == 400
    assert replies["digest"].json()["error"]["code"] == "DIGEST_MISMATCH"
    assert replies["submit_token"].status_code == 403
    assert replies["ok"].status_code == 201
    assert [a["name"] for a in api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]] == ["x"]
    kinds = [(e["kind"], e["code"]) for e in api.get(f"/v1/tasks/{tid}/events").json()["items"]]
    assert ("rejected", "STALE_FENCE") in kinds and ("artifact", None) in kinds


def test_a_bad_ttl_header_is_refused_and_writes_nothing(small: Node, tokens: Tokens) -> None:
    """X-Orbit-TTL is whole seconds in ASCII digits, from 1 s to 366 days: anything else
    is a 400 that names the header, never a 500 (``str.isdigit`` admits '²', which
    ``int`` refuses), and leaves no artifact behind."""
    api = httpx.Client(
        base_url=small.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    bad: list[bytes] = [b"\xb2", b"\xb9", b"1\xb3", b"", b"-1", b"+5", b"1.5", b"0", b"31622401"]

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        conn, url, headers = await _started(small, tokens)
        refused = []
        for i, ttl in enumerate(bad):
            async with httpx.AsyncClient(timeout=30) as http:  # a 500 closes the connection
                refused.append(
                    await http.put(
                        f"{url}/bad{i}", content=b"1", headers={**headers, "X-Orbit-TTL": ttl}
                    )
                )
        async with httpx.AsyncClient(timeout=30) as http:
            ok = await http.put(
                f"{url}/good", content=b"1", headers={**headers, "X-Orbit-TTL": "31622400"}
            )
        await conn.close()
        return refused, ok

    refused, ok = asyncio.run(scenario())
    for ttl, reply in zip(bad, refused, strict=True):
        assert reply.status_code == 400, (ttl, reply.status_code, reply.text)
        assert reply.json()["error"]["code"] == "INVALID_ARGUMENT", ttl
        assert reply.json()["error"]["field"] == "X-Orbit-TTL", ttl
    assert ok.status_code == 201, ok.text
    listed = api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]
    assert [a["name"] for a in listed] == ["good"]


def test_async_client_downloads_as_the_sync_one_does(small: Node, tokens: Tokens) -> None:
    """AsyncClient.artifact_content and artifact_stream: the same bytes as Client's, and
    the same NotFound for an unknown artifact."""
    from orbit import AsyncClient
    from orbit.client import NotFound

    api = httpx.Client(
        base_url=small.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    blob = os.urandom(600_000)  # more than one stored chunk
    worker = Worker(small.http, tokens.worker)

    @worker.handler("shoot")
    async def shoot(ctx: Context, payload: Any) -> Any:
        return (await ctx.upload("blob.bin", blob))["id"]

    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "shoot"}).json()["task"]["id"]

    async def run() -> tuple[bytes, bytes, list[str]]:
        await run_until(worker, lambda: worker.finished >= 1)
        artifact_id = api.get(f"/v1/tasks/{tid}").json()["result"]
        codes = []
        async with AsyncClient(small.http, tokens.submit) as client:
            page = await client.list_artifacts(tid, limit=1)
            assert [a["id"] for a in page["items"]] == [artifact_id]
            rest = await client.list_artifacts(tid, cursor=page["next_cursor"])
            assert rest == {"items": [], "next_cursor": None}
            assert [a["id"] async for a in client.iter_artifacts(tid, limit=1)] == [artifact_id]
            assert [a["id"] for a in await client.artifacts(tid)] == [artifact_id]
            whole = await client.artifact_content(artifact_id)
            streamed = b"".join([chunk async for chunk in client.artifact_stream(artifact_id)])
            try:
                await client.artifact_content("nope")
            except NotFound as exc:
                codes.append(exc.code)
            try:
                [chunk async for chunk in client.artifact_stream("nope")]
            except NotFound as exc:
                codes.append(exc.code)
        return whole, streamed, codes

    whole, streamed, codes = asyncio.run(run())
    assert whole == blob and streamed == blob
    assert codes == ["ARTIFACT_NOT_FOUND", "ARTIFACT_NOT_FOUND"]
    with Client(small.http, tokens.submit) as client:
        with pytest.raises(NotFound) as missing:
            client.artifact_content("nope")
        assert missing.value.code == "ARTIFACT_NOT_FOUND"


def test_refused_uploads_are_counted_in_the_metrics(small: Node, tokens: Tokens) -> None:
    """An upload refused as a stale report leaves a ``rejected`` event like any worker
    report, and is counted in ``orbit_rejected_reports_total{code}`` like one: the
    upload route used to count nothing, so the metric missed every refused artifact."""
    from prometheus_client.parser import text_string_to_metric_families

    api = httpx.Client(
        base_url=small.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    api.post("/v1/tasks", json={"queue": "q", "handler": "h"})

    async def scenario() -> list[int]:
        conn, url, headers = await _started(small, tokens)
        async with httpx.AsyncClient(timeout=30) as http:
            stale = await http.put(
                f"{url}/x", content=b"1", headers={**headers, "X-Orbit-Fence": "2"}
            )
            epoch = str(int(headers["X-Orbit-Epoch"]) + 1)
            fenced = await http.put(
                f"{url}/y", content=b"1", headers={**headers, "X-Orbit-Epoch": epoch}
            )
        await conn.close()
        return [stale.status_code, fenced.status_code]

    assert asyncio.run(scenario()) == [409, 409]
    counted = {
        s.labels["code"]: s.value
        for family in text_string_to_metric_families(httpx.get(f"{small.http}/metrics").text)
        if family.name == "orbit_rejected_reports"
        for s in family.samples
        if s.name == "orbit_rejected_reports_total"
    }
    assert counted == {"STALE_FENCE": 1.0, "FENCED_EPOCH": 1.0}


def _upload_rows(db_url: str) -> list[tuple[str, str, int]]:
    """Every artifact row, ready or not (name, state, stored chunks), read directly: the
    API shows only ready ones, and this test is about the others."""
    sql = (
        "SELECT f.name, f.state, (SELECT count(*) FROM orbit_artifact_chunks c"
        " WHERE c.artifact_id = f.id) FROM orbit_artifacts f ORDER BY f.name, f.state"
    )
    if db_url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(db_url.removeprefix("sqlite:///"))) as cx:
            return [(str(n), str(s), int(c)) for n, s, c in cx.execute(sql)]
    with psycopg.connect(db_url, autocommit=True) as cx:
        return [(str(n), str(s), int(c)) for n, s, c in cx.execute(sql)]


def _until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait for a state another process reaches (its rows), bounded."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_an_upload_cut_off_half_way_leaves_nothing_behind(
    nodes: Callable[..., Node], tokens: Tokens, db_url: str
) -> None:
    """The client gone mid-body: the server aborts the upload, rows and chunks. The
    server SIGKILLed mid-body: nothing aborts it, and its ``uploading`` row used to hold
    the name, so the worker's retry on another node was refused ``ARTIFACT_EXISTS``;
    the retry now replaces it, and only the committed artifact's chunks stay stored."""
    a = nodes(node_id="a")
    api = httpx.Client(
        base_url=a.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    first = os.urandom(300_000)  # more than one stored chunk: one is written at once

    async def stalled(never: asyncio.Event) -> AsyncIterator[bytes]:
        yield first
        await never.wait()
        yield b"never sent"

    async def cut(url: str, headers: dict[str, str], then: Callable[[], None]) -> None:
        never = asyncio.Event()
        async with httpx.AsyncClient(timeout=30) as http:
            put = asyncio.create_task(http.put(url, content=stalled(never), headers=headers))
            await asyncio.to_thread(_until, lambda: _upload_rows(db_url) != [], "a chunk")
            await asyncio.to_thread(then)
            put.cancel()  # the client side: its connection is closed with it
            with contextlib.suppress(asyncio.CancelledError, httpx.TransportError):
                await put

    async def scenario() -> httpx.Response:
        conn, url, headers = await _started(a, tokens)
        await cut(f"{url}/gone", headers, lambda: None)  # the client disconnects
        await asyncio.to_thread(_until, lambda: _upload_rows(db_url) == [], "the abort")
        await cut(f"{url}/shot", headers, a.kill)  # the server dies
        assert a.proc.poll() is not None
        b = nodes(node_id="b")
        retry_url = url.replace(a.http, b.http)
        async with httpx.AsyncClient(timeout=30) as http:
            retried = await http.put(f"{retry_url}/shot", content=first, headers=headers)
        with contextlib.suppress(Exception):
            await conn.close()
        return retried

    retried = asyncio.run(scenario())
    assert retried.status_code == 201, retried.text
    assert _upload_rows(db_url) == [("shot", "ready", 2)]
    assert retried.json()["task_id"] == tid


def test_an_upload_across_a_resume_of_the_session_is_sent_again(
    nodes: Callable[..., Node], tokens: Tokens, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's socket drops during an upload and the runner resumes its session
    (a new epoch), the attempt still its own (DESIGN §2, §5.6). The upload's epoch was
    read when its PUT started and checked again at its commit: refused FENCED_EPOCH, it
    raised in the handler, and the attempt then finished under the new epoch with no
    artifact. The runner sends it again, the file read again from its start."""
    node = nodes()  # default leases (30 s): the resume, not a lease, is what is tested
    worker = Worker(node.http, tokens.worker)
    on_disk = tmp_path / "shot.bin"
    on_disk.write_bytes(os.urandom(600_000))
    epochs: list[str | None] = []  # each send's, as the runner reads the file for it
    read = runner_module._file

    async def cut_by_a_resume(path: Path) -> AsyncIterator[bytes]:
        """The file as the runner reads it; on the first send, after its first chunk the
        worker's socket drops, and the rest follows once the runner has resumed."""
        conn = worker._conn
        assert conn is not None
        first = not epochs
        epochs.append(conn.epoch)
        async for chunk in read(path):
            yield chunk
            if first:
                first = False
                await conn.ws.close()
                for _ in range(400):
                    if worker._conn is not conn and worker._connected.is_set():
                        break
                    await asyncio.sleep(0.025)
                else:
                    pytest.fail("the runner did not resume")

    monkeypatch.setattr(runner_module, "_file", cut_by_a_resume)

    @worker.handler("shoot")
    async def shoot(ctx: Context, payload: Any) -> Any:
        return (await ctx.upload("shot.bin", on_disk, "application/octet-stream"))["id"]

    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as api:
        api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
        tid = api.post("/v1/tasks", json={"queue": "q", "handler": "shoot"}).json()["task"]["id"]
        asyncio.run(run_until(worker, lambda: worker.finished == 1))
        task = api.get(f"/v1/tasks/{tid}").json()
        assert task["state"] == "succeeded" and task["attempts_used"] == 1, task
        assert len(epochs) == 2 and epochs[0] != epochs[1], epochs  # sent again once
        items = api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]
        assert [(a["id"], a["name"]) for a in items] == [(task["result"], "shot.bin")]
        content = api.get(f"/v1/artifacts/{task['result']}/content").content
        assert content == on_disk.read_bytes()


def test_an_upload_slower_than_its_ttl_is_kept_for_its_ttl_from_its_commit(
    small: Node, tokens: Tokens
) -> None:
    """``X-Orbit-TTL: 3`` and a body that takes 3.5 s to arrive, the reaper passing
    every 0.2 s (3 s, not less, to read it back in: a loaded machine once took more
    than 2). The TTL counted from the begin: the reaper deleted the upload in flight
    (its PUT answered 409 INVALID_STATE "the artifact is not being uploaded"), and
    without a pass between, the artifact was committed already expired (404 to every
    read). Its expiry is now the commit's instant + its TTL."""
    with httpx.Client(
        base_url=small.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as api:
        api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
        api.post("/v1/tasks", json={"queue": "q", "handler": "h"})

        last_sent: list[datetime] = []

        async def slow() -> AsyncIterator[bytes]:
            yield b"first half "
            await asyncio.sleep(3.5)
            last_sent.append(datetime.now(UTC))  # the commit comes after this
            yield b"second half"

        async def upload() -> httpx.Response:
            conn, url, headers = await _started(small, tokens)
            try:
                async with httpx.AsyncClient(timeout=30) as http:
                    return await http.put(
                        f"{url}/slow.txt", content=slow(), headers={**headers, "X-Orbit-TTL": "3"}
                    )
            finally:
                await conn.close()

        made = asyncio.run(upload())
        assert made.status_code == 201, made.text
        got = api.get(f"/v1/artifacts/{made.json()['id']}/content")
        assert got.status_code == 200 and got.content == b"first half second half", got.text
        # Counted from the begin it expired 3 s after ``created_at``, which a loaded
        # server may stamp a little after the first chunk left: the commit's own instant
        # is after the last chunk left, on the same host's clock (µs in the database).
        expires_at = datetime.fromisoformat(made.json()["expires_at"])
        assert expires_at >= last_sent[0] + timedelta(seconds=3, milliseconds=-1), (
            expires_at,
            last_sent,
        )


def test_a_download_cut_off_by_a_server_sigkill_is_an_error_not_a_short_artifact(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """``Client.artifact_stream`` reads through http.client, whose ``read(n)`` answers
    b"" when the connection closes before Content-Length is reached: a download cut off
    by a server killed mid-body ended quietly, and the caller took the first part for
    the whole artifact. It is ``Unreachable`` now, as AsyncClient's (httpx's) is."""
    from orbit.client import Unreachable

    node = nodes(args=["--max-artifact-bytes", str(64 * 2**20)])
    api = httpx.Client(
        base_url=node.http, timeout=60, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    api.post("/v1/tasks", json={"queue": "q", "handler": "h"})
    blob = os.urandom(24 * 2**20)  # far more than the sockets' buffers hold

    async def upload() -> str:
        conn, url, headers = await _started(node, tokens)
        async with httpx.AsyncClient(timeout=60) as http:
            reply = await http.put(f"{url}/big", content=blob, headers=headers)
        await conn.close()
        assert reply.status_code == 201, reply.text
        return str(reply.json()["id"])

    artifact_id = asyncio.run(upload())
    received = 0
    with Client(node.http, tokens.submit) as client, pytest.raises(Unreachable):
        for chunk in client.artifact_stream(artifact_id):
            if received == 0:
                node.kill()  # confirmed gone before the rest is read
            received += len(chunk)
    assert 0 < received < len(blob)


def test_an_upload_refused_by_a_proxy_in_front_is_a_server_error(tmp_path: Path) -> None:
    """A proxy in front of the server (nginx refuses bodies over 1 MB by default) answers
    an upload with a page of HTML, not Orbit's JSON error: ``ctx.upload`` raised the
    JSON decoder's error from inside the runner instead of the ``ServerError`` it
    documents. It is a ``ServerError`` now, ``HTTP_ERROR`` with the status."""
    import http.server
    import threading
    from types import SimpleNamespace

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            page = b"<html><body>413 Request Entity Too Large</body></html>"
            self.send_response(413)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        worker = Worker(f"http://127.0.0.1:{server.server_address[1]}", "orbit_x")
        worker._conn = SimpleNamespace(session_id="s", epoch="1")  # type: ignore[assignment]
        with pytest.raises(ServerError) as err:
            asyncio.run(worker._upload("a", "1", "big.bin", b"x" * 1000, "a/b", None))
        assert err.value.code == "HTTP_ERROR" and "413" in err.value.message
    finally:
        server.shutdown()
        server.server_close()


def test_the_disk_reserve_is_the_servers_flag(
    nodes: Callable[..., Node], tokens: Tokens, db_url: str
) -> None:
    """``orbit server --artifact-disk-reserve``: the reserve was
    ``StoreConfig.artifact_disk_reserve_bytes`` alone, so an operator of ``orbit
    server`` could not set it. A reserve larger than any disk refuses every upload on
    SQLite, before it writes; PostgreSQL's disk is not the node's to see, so there the
    upload goes through."""
    node = nodes(args=["--artifact-disk-reserve", str(2**62)])
    httpx.post(
        f"{node.http}/v1/queues",
        json={"name": "q", "max_concurrency": 4, "rate": 0},
        headers={"Authorization": f"Bearer {tokens.admin}"},
    )
    httpx.post(
        f"{node.http}/v1/tasks",
        json={"queue": "q", "handler": "h"},
        headers={"Authorization": f"Bearer {tokens.admin}"},
    )

    async def upload() -> httpx.Response:
        conn, url, headers = await _started(node, tokens)
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.put(f"{url}/small", content=b"x" * 1000, headers=headers)
        await conn.close()
        return reply

    reply = asyncio.run(upload())
    if db_url.startswith("sqlite"):
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "DATABASE_FULL"
        assert _upload_rows(db_url) == []
    else:
        assert reply.status_code == 201, reply.text


def test_a_negative_disk_reserve_is_refused_before_anything(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from orbit.cli.main import app

    db = tmp_path / "orbit.db"
    args = ["server", "--db", f"sqlite:///{db}", "--port", "0", "--artifact-disk-reserve", "-1"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "--artifact-disk-reserve" in result.stderr
    assert not db.exists()
