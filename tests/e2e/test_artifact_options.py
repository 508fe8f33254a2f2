"""``ctx.upload``'s ``ttl`` and ``content_type`` against a real server: a bad one is
refused in the handler, by name, before anything is sent; a good one arrives as given."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from orbit.core.validate import MAX_ARTIFACT_TTL_S
from orbit.server.artifacts import MAX_TTL_S
from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import run_until

#: What each bad option raised before: 1.5 was kept 1 s, True taken as 1, "10" as 10 s,
#: 0.5 came back as the server's word on a header the handler never set, and a content
#: type httpx could not encode raised its UnicodeEncodeError.
BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"ttl": 1.5}, TypeError, "ttl must be whole seconds (an int) or None, not float"),
    ({"ttl": 0.5}, TypeError, "ttl must be whole seconds (an int) or None, not float"),
    ({"ttl": True}, TypeError, "ttl must be whole seconds (an int) or None, not bool"),
    ({"ttl": "10"}, TypeError, "ttl must be whole seconds (an int) or None, not str"),
    ({"ttl": 0}, ValueError, f"ttl must be from 1 to {MAX_ARTIFACT_TTL_S} seconds; got 0"),
    ({"ttl": -5}, ValueError, "ttl must be from 1 to"),
    ({"ttl": MAX_ARTIFACT_TTL_S + 1}, ValueError, "ttl must be from 1 to"),
    ({"content_type": "text/plain; name=日本"}, ValueError, "got '日'"),
    ({"content_type": "a/" + "b" * 250}, ValueError, "3 to 200 characters long; got 252"),
    ({"content_type": "png"}, ValueError, "content_type must look like type/subtype"),
    ({"content_type": b"a/b"}, TypeError, "content_type must be a string, not bytes"),
]


def _run(node: Node, tokens: Tokens, handler: Any) -> Any:
    """Run ``handler`` once as a real worker's handler; return what it returned."""
    api = httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    )
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 4, "rate": 0})
    worker = Worker(node.http, tokens.worker)
    worker.handler("h")(handler)
    tid = api.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]

    asyncio.run(run_until(worker, lambda: worker.finished >= 1))
    task = api.get(f"/v1/tasks/{tid}").json()
    assert task["state"] == "succeeded", task
    listed = api.get(f"/v1/tasks/{tid}/artifacts").json()["items"]
    return task["result"], listed, api


def test_the_worker_shares_the_servers_ttl_bound() -> None:
    assert MAX_TTL_S == MAX_ARTIFACT_TTL_S == 366 * 24 * 3600


def test_bad_upload_options_are_refused_by_name_before_anything_is_sent(
    node: Node, tokens: Tokens
) -> None:
    async def handler(ctx: Context, payload: Any) -> Any:
        seen = []
        for options, _, _ in BAD:
            try:
                await ctx.upload("bad.bin", b"x", **options)
            except (TypeError, ValueError) as exc:
                seen.append([type(exc).__name__, str(exc)])
            else:
                seen.append(["accepted", ""])
        return seen

    seen, listed, _ = _run(node, tokens, handler)
    assert listed == []  # nothing was uploaded
    for (options, kind, says), (got_kind, got) in zip(BAD, seen, strict=True):
        assert got_kind == kind.__name__, (options, got_kind, got)
        assert says in got, (options, got)


@pytest.mark.parametrize("ttl", [1, 7, MAX_ARTIFACT_TTL_S])
def test_a_whole_ttl_and_a_latin1_content_type_arrive_as_given(
    node: Node, tokens: Tokens, ttl: int
) -> None:
    """The bounds and a TTL between, kept for that many seconds; a Latin-1 parameter (name=é),
    which the server takes, was refused by httpx's ASCII encoding of a str header."""
    content_type = "text/plain; name=é"

    async def handler(ctx: Context, payload: Any) -> Any:
        return await ctx.upload("ok.txt", b"hello", content_type, ttl=ttl)

    made, [listed], api = _run(node, tokens, handler)
    ran_by = datetime.now(UTC)  # the upload committed before this instant
    expires_at = datetime.fromisoformat(made["expires_at"])
    # created_at is the upload's begin, expires_at its commit + TTL: never less than the
    # TTL from the begin, nor more than the TTL from an instant after the commit (no
    # bound on how long the upload took).
    assert expires_at - datetime.fromisoformat(made["created_at"]) >= timedelta(seconds=ttl)
    assert expires_at <= ran_by + timedelta(seconds=ttl)
    assert listed["content_type"] == content_type
    got = api.get(f"/v1/artifacts/{listed['id']}/content")
    assert got.status_code == 200 and got.content == b"hello"
    raw = {k.lower(): v for k, v in got.headers.raw}
    assert raw[b"content-type"] == content_type.encode("latin-1")


def test_a_runs_uploads_share_one_http_client(
    node: Node, tokens: Tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each upload made an httpx client of its own, with a TLS context that loads the CA
    bundle even for http://: a worker uploading 300 KB a task grew from 54 to 286 MB of
    native memory over 400 tasks (57 MB with one client), and opened a connection for
    each. The clients made are counted as the real class makes them."""
    made: list[httpx.AsyncClient] = []
    init = httpx.AsyncClient.__init__

    def counted(self: httpx.AsyncClient, *args: Any, **kw: Any) -> None:
        made.append(self)
        init(self, *args, **kw)

    monkeypatch.setattr(httpx.AsyncClient, "__init__", counted)

    async def handler(ctx: Context, payload: Any) -> Any:
        return [(await ctx.upload(f"a{i}.bin", b"x" * 1000))["size"] for i in range(5)]

    sizes, listed, _ = _run(node, tokens, handler)
    assert sizes == [1000] * 5 and len(listed) == 5
    assert len(made) == 1
    assert made[0].is_closed  # closed as the run ended


def test_a_plain_handler_uploads_from_loops_of_its_own(node: Node, tokens: Tokens) -> None:
    """A plain function may run ``asyncio.run(ctx.upload(...))``, each call a loop of its
    own: the run's shared client, its connections opened on the first such loop, failed
    the second with "Event loop is closed". An upload off the run's loop gets a client
    of its own, closed after it."""

    def handler(ctx: Context, payload: Any) -> Any:
        first = asyncio.run(ctx.upload("a.bin", b"x" * 10))
        second = asyncio.run(ctx.upload("b.bin", b"y" * 20))
        return [first["size"], second["size"]]

    sizes, listed, _ = _run(node, tokens, handler)
    assert sizes == [10, 20]
    assert sorted(a["name"] for a in listed) == ["a.bin", "b.bin"]
