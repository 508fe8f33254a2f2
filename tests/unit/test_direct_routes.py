"""The submit routes served by ``DirectRoutes`` answer exactly as FastAPI's routing would.

One app as ``create_app`` builds it, and the same app with ``DirectRoutes`` taken out of
its middleware, each over its own SQLite store, receive the same requests: every answer
(status, error body, the shape of a success, the auth header) must match, and the direct
one must really have been served without FastAPI's routing.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute
from starlette.exceptions import StarletteDeprecationWarning
from starlette.middleware import Middleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from orbit.server import ServerSettings, create_app
from orbit.server.auth import require
from orbit.server.direct import DirectRoutes
from orbit.store import open_store

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

TASK = {"queue": "q", "handler": "h", "payload": {"n": 1}}


def _client(
    path: Path, direct: bool, inner: Middleware | None = None
) -> Iterator[tuple[TestClient, dict[str, str]]]:
    url = f"sqlite:///{path}"
    store = open_store(url)
    try:
        store.queue_create("q", max_concurrency=10, rate=0)
        tokens = {s: store.token_create(s, [s])[1] for s in ("submit", "worker", "admin")}
    finally:
        store.close()
    app = create_app(ServerSettings(db_url=url, max_body_bytes=4096))
    if not direct:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not DirectRoutes]
    if inner is not None:
        app.user_middleware.append(inner)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokens


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    direct = _client(tmp_path / "direct.db", True)
    routed = _client(tmp_path / "routed.db", False)
    yield next(direct), next(routed)
    for gen in (direct, routed):
        next(gen, None)


def _shape(value: Any) -> Any:
    """Keys and types, not values: ids and instants differ between the two stores."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def _requests(tokens: dict[str, str]) -> list[tuple[str, str, dict[str, str], bytes]]:
    submit = {"authorization": f"Bearer {tokens['submit']}"}
    worker = {"authorization": f"Bearer {tokens['worker']}"}
    body = json.dumps(TASK).encode()
    keyed = json.dumps({**TASK, "idempotency_key": "k1"}).encode()
    return [
        ("/v1/tasks", "created", submit, body),
        ("/v1/tasks", "keyed", submit, keyed),
        ("/v1/tasks", "keyed again", submit, keyed),
        ("/v1/tasks", "no token", {}, body),
        ("/v1/tasks", "bad token", {"authorization": "Bearer nope"}, body),
        ("/v1/tasks", "wrong scope", worker, body),
        ("/v1/tasks", "not JSON", submit, b"{"),
        ("/v1/tasks", "unknown field", submit, json.dumps({**TASK, "x": 1}).encode()),
        ("/v1/tasks", "unknown queue", submit, json.dumps({**TASK, "queue": "nope"}).encode()),
        ("/v1/tasks", "too large", submit, json.dumps({**TASK, "payload": "x" * 5000}).encode()),
        ("/v1/tasks?x=%00", "NUL in the query", submit, body),
        ("/v1/tasks/batch", "batch", submit, json.dumps({"tasks": [TASK, TASK]}).encode()),
        ("/v1/tasks/batch", "bad batch", submit, json.dumps({"tasks": [TASK, {}]}).encode()),
        ("/v1/tasks/batch?reply=ids", "ids", submit, json.dumps({"tasks": [TASK]}).encode()),
        ("/v1/tasks/batch?reply=no", "bad reply", submit, json.dumps({"tasks": [TASK]}).encode()),
    ]


def test_direct_submits_answer_as_the_routed_ones(pair: tuple[Any, Any]) -> None:
    (direct, d_tokens), (routed, r_tokens) = pair
    for (path, what, d_headers, body), (_, _, r_headers, _) in zip(
        _requests(d_tokens), _requests(r_tokens), strict=True
    ):
        a = direct.post(path, content=body, headers=d_headers)
        b = routed.post(path, content=body, headers=r_headers)
        assert a.status_code == b.status_code, what
        assert a.headers.get("www-authenticate") == b.headers.get("www-authenticate"), what
        assert a.headers["content-type"] == b.headers["content-type"], what
        if a.status_code >= 400:
            assert a.json() == b.json(), what
        else:
            assert _shape(a.json()) == _shape(b.json()), what


def test_direct_submits_skip_fastapi_routing(tmp_path: Path) -> None:
    reached: list[str] = []

    class Recorder:  # innermost: what passes it goes on to FastAPI's routing
        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                reached.append(f"{scope['method']} {scope['path']}")
            await self.app(scope, receive, send)

    clients = _client(tmp_path / "o.db", True, inner=Middleware(Recorder))
    client, tokens = next(clients)
    auth = {"authorization": f"Bearer {tokens['submit']}"}
    assert client.post("/v1/tasks", json=TASK, headers=auth).status_code == 201
    assert client.post("/v1/tasks/batch", json={"tasks": [TASK]}, headers=auth).status_code == 201
    assert client.get("/v1/tasks", headers=auth).status_code == 200
    assert reached == ["GET /v1/tasks"]
    next(clients, None)


def _router_with(endpoint: Any, scope: str | None) -> APIRoute:
    router = APIRouter()
    deps = [Depends(require(scope))] if scope else []
    router.add_api_route("/x", endpoint, methods=["POST"], dependencies=deps)
    route = router.routes[0]
    assert isinstance(route, APIRoute)
    return route


def test_only_routes_that_need_nothing_but_the_request_and_a_token_are_served() -> None:
    async def fine(request: Request) -> Response:
        return Response()

    async def with_param(request: Request, n: int) -> Response:
        return Response()

    DirectRoutes(app=None, routes=[_router_with(fine, "submit")])  # type: ignore[arg-type]
    for bad in (_router_with(with_param, "submit"), _router_with(fine, None)):
        with pytest.raises(ValueError, match="direct route"):
            DirectRoutes(app=None, routes=[bad])  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/queues"])
def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(tmp_path: Path, path: str) -> None:
    """A chunked body declares no length: it is read a chunk at a time and refused at
    the limit (4,096 bytes here), not read whole first (a submit served directly, a
    queue through FastAPI). Driven over ASGI, since the TestClient reads a body whole
    before it hands it to the app."""
    sent: list[int] = []  # the size of each chunk the app asked for

    async def receive() -> dict[str, Any]:
        chunk = b'{"queue":"q","payload":"' if not sent else b"x" * 1024
        sent.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": len(sent) < 1000}

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    gen = _client(tmp_path / "o.db", True)
    client, tokens = next(gen)
    try:
        token = tokens["submit" if path == "/v1/tasks" else "admin"]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"testserver"),
                (b"authorization", f"Bearer {token}".encode()),
                (b"transfer-encoding", b"chunked"),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
            "state": client.app_state.copy(),
        }
        assert client.portal is not None
        client.portal.call(client.app, scope, receive, send)
        start, *body = messages
        assert start["status"] == 413
        error = json.loads(b"".join(m.get("body", b"") for m in body))["error"]
        assert error["code"] == "BODY_TOO_LARGE"
        assert len(sent) <= 6  # the head, 4 KiB and the chunk that went over
    finally:
        next(gen, None)
