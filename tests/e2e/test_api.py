"""The HTTP API over a real server: auth on every route, no secrets in logs, stable
pagination under concurrent inserts, size bounds, and errors in one shape."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import websockets
from fastapi.routing import APIRoute
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from orbit.server import ServerSettings, create_app
from orbit.server.app import READY_TIMEOUT_S
from orbit.server.routes import encode_cursor
from orbit.store import open_store
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens, start_server
from tests.pg import as_url, temporary_database


def _walk(routes: list[Any], prefix: str = "") -> list[APIRoute]:
    """Every APIRoute of the app, descending into included routers."""
    found: list[APIRoute] = []
    for r in routes:
        if isinstance(r, APIRoute):
            found.append(r)
        elif hasattr(r, "original_router"):
            found += _walk(r.original_router.routes)
    return found


ROUTES = [
    r
    for r in _walk(create_app(ServerSettings(db_url="sqlite:///unused.db")).routes)
    if r.path.startswith("/v1")
]


def _scope(route: APIRoute) -> str:
    scopes = [getattr(d.dependency, "orbit_scope", None) for d in route.dependencies]
    found = [s for s in scopes if s]
    assert len(found) == 1, f"{route.path} must declare exactly one scope"
    return str(found[0])


def test_every_v1_route_declares_a_scope() -> None:
    assert len(ROUTES) >= 15
    for route in ROUTES:
        _scope(route)


def test_every_v1_route_refuses_missing_and_wrong_tokens(node: Node, tokens: Tokens) -> None:
    others = {"admin": tokens.submit, "submit": tokens.worker, "worker": tokens.submit}
    with httpx.Client(base_url=node.http, timeout=10) as http:
        for route in ROUTES:
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            for method in route.methods:
                missing = http.request(method, path)
                assert missing.status_code == 401, (method, path, missing.text)
                bad = http.request(method, path, headers={"Authorization": "Bearer nope"})
                assert bad.status_code == 401, (method, path)
                wrong = http.request(
                    method, path, headers={"Authorization": f"Bearer {others[_scope(route)]}"}
                )
                assert wrong.status_code == 403, (method, path, wrong.text)
                if method == "HEAD":  # its answer has no body, by HTTP's rules
                    assert not missing.content and not wrong.content, (path, missing.content)
                    continue
                assert missing.json()["error"]["code"] == "UNAUTHENTICATED"
                assert wrong.json()["error"]["code"] == "FORBIDDEN"


@pytest.mark.parametrize("token", ["none", "submit"])
def test_worker_socket_refuses_missing_and_wrong_tokens(
    node: Node, tokens: Tokens, token: str
) -> None:
    headers = {} if token == "none" else {"Authorization": f"Bearer {tokens.submit}"}

    async def attempt() -> None:
        async with websockets.connect(node.ws, additional_headers=headers) as ws:
            await ws.send('{"type":"hello"}')
            await ws.recv()

    with pytest.raises((websockets.InvalidStatus, websockets.ConnectionClosed)):
        asyncio.run(attempt())


@pytest.mark.parametrize(
    ("token", "status", "code"),
    [
        ("none", 401, "UNAUTHENTICATED"),
        ("unknown", 401, "UNAUTHENTICATED"),
        ("submit", 403, "FORBIDDEN"),
    ],
)
def test_worker_socket_refusal_says_which_as_the_http_routes_do(
    node: Node, tokens: Tokens, token: str, status: int, code: str
) -> None:
    """A refused upgrade is answered with the status and error body an HTTP route gives
    the same token: no token or an unknown one 401 (with ``WWW-Authenticate``), a token
    without the worker scope 403. Closing the socket before accepting it, uvicorn
    answered a bare 403 to all three, so a worker could not tell a wrong token from a
    wrong scope."""
    bearer = {"unknown": "orbit_0123456789abcdef0123456789abcdef_x", "submit": tokens.submit}
    headers = {"Authorization": f"Bearer {bearer[token]}"} if token in bearer else {}

    async def attempt() -> None:
        async with websockets.connect(node.ws, additional_headers=headers) as ws:
            await ws.recv()

    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(attempt())
    response = refused.value.response
    assert response.status_code == status
    assert json.loads(response.body or b"{}")["error"]["code"] == code
    if status == 401:
        assert response.headers.get("WWW-Authenticate") == "Bearer"


def _rename_tokens_table(db_url: str, old: str, new: str) -> None:
    """Take the tokens table away (or give it back) under a running server: its token
    check then fails in the database, as it would with the database down."""
    statement = f"ALTER TABLE {old} RENAME TO {new}"
    if db_url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(db_url.removeprefix("sqlite:///"))) as cx:
            cx.execute(statement)
            cx.commit()
    else:
        with psycopg.connect(db_url, autocommit=True) as cx:
            cx.execute(statement)


def test_a_forged_or_revoked_token_is_refused(node: Node, tokens: Tokens, db_url: str) -> None:
    """A token is refused unless its id and its secret both match a row that is not
    revoked: a known id with another secret, an empty or a missing secret, a secret one
    character short or long, and a revoked token are all 401 UNAUTHENTICATED."""
    token_id = tokens.admin.split("_")[1]
    forged = [
        f"orbit_{token_id}_{'A' * 43}",
        f"orbit_{token_id}_",
        f"orbit_{token_id}",
        tokens.admin + "A",
        tokens.admin[:-1],
        "ORBIT_" + tokens.admin.removeprefix("orbit_"),
    ]
    admin = {"Authorization": f"Bearer {tokens.admin}"}
    made = httpx.post(
        f"{node.http}/v1/tokens", json={"name": "doomed", "scopes": ["admin"]}, headers=admin
    )
    assert made.status_code == 201, made.text
    doomed = made.json()
    store = open_store(db_url)
    try:
        store.token_revoke(doomed["id"])  # never used, so no node has an answer cached
    finally:
        store.close()
    for token in [*forged, doomed["token"]]:
        refused = httpx.get(
            f"{node.http}/v1/queues", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "UNAUTHENTICATED"
    assert httpx.get(f"{node.http}/v1/queues", headers=admin, timeout=10).status_code == 200


def test_tokens_are_listed_and_revoked_over_http(node: Node, tokens: Tokens) -> None:
    """An admin who can make a token with ``POST /v1/tokens`` can list and revoke them
    too: the listing holds neither a secret nor its hash, a revoke answers the token with
    its ``revoked_at`` (a second keeps the first), and the token is refused from then on.
    What cannot be revoked is refused, and changes nothing."""
    admin = httpx.Client(
        base_url=node.http, headers={"Authorization": f"Bearer {tokens.admin}"}, timeout=10
    )
    submitter = {"Authorization": f"Bearer {tokens.submit}"}
    with admin:
        made = admin.post("/v1/tokens", json={"name": "ops", "scopes": ["submit"]}).json()
        secret = made["token"].split("_", 2)[2]
        listing = admin.get("/v1/tokens")
        assert listing.status_code == 200, listing.text
        assert secret not in listing.text
        [listed] = [t for t in listing.json()["items"] if t["id"] == made["id"]]
        assert listed == {
            "id": made["id"],
            "name": "ops",
            "scopes": ["submit"],
            "created_at": listed["created_at"],
            "revoked_at": None,
        }
        for refused, status, code in (
            (admin.post(f"/v1/tokens/{'0' * 32}/revoke"), 404, "TOKEN_NOT_FOUND"),
            (admin.post(f"/v1/tokens/{made['token']}/revoke"), 400, "INVALID_ARGUMENT"),
            (admin.post("/v1/tokens/not%20an%20id/revoke"), 400, "INVALID_ARGUMENT"),
            (httpx.get(f"{node.http}/v1/tokens", headers=submitter), 403, "FORBIDDEN"),
            (
                httpx.post(f"{node.http}/v1/tokens/{made['id']}/revoke", headers=submitter),
                403,
                "FORBIDDEN",
            ),
        ):
            assert refused.status_code == status, refused.text
            assert refused.json()["error"]["code"] == code, refused.text
            assert secret not in refused.text
        assert admin.get("/v1/tokens").json() == listing.json()  # nothing changed
        revoked = admin.post(f"/v1/tokens/{made['id']}/revoke")
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["revoked_at"] is not None
        assert revoked.json() == {**listed, "revoked_at": revoked.json()["revoked_at"]}
        again = admin.post(f"/v1/tokens/{made['id']}/revoke")
        assert again.json() == revoked.json()  # the first revoked_at stands
        [listed] = [t for t in admin.get("/v1/tokens").json()["items"] if t["id"] == made["id"]]
        assert listed == revoked.json()
    # never used before, so no node has an answer cached: refused at once
    used = httpx.get(f"{node.http}/v1/queues", headers={"Authorization": f"Bearer {made['token']}"})
    assert used.status_code == 401, used.text


#: the node's ``--token-cache`` in the revoke test: short, so the test waits it out
#: quickly, yet long enough that a node ignoring it would refuse at once (the default,
#: CACHE_SECONDS, is the same code with a longer wait)
TOKEN_CACHE_S = 2.0


def test_a_revoked_token_is_refused_within_the_token_cache_lifetime(
    nodes: Callable[..., Node], db_url: str
) -> None:
    """``orbit token revoke`` beside a running node that has just accepted the token (and
    cached that answer): the node refuses it, 401 over HTTP and on a new worker socket,
    no later than its ``--token-cache`` after the revoke, whatever it had cached. On
    SQLite nothing tells the node of a revoke made by another process, so it still takes
    the token at first, having cached the answer; on PostgreSQL the revoke's NOTIFY makes
    it forget that answer, and it may refuse at once. (Worker connections already open
    with the token are closed: tests/e2e/test_revoke.py.)"""
    node = nodes(args=["--token-cache", f"{TOKEN_CACHE_S:g}"])
    store = open_store(db_url)
    try:
        token_id, leaked = store.token_create("leaked", ["admin"])
    finally:
        store.close()

    async def scenario() -> None:
        cached_at = time.monotonic()  # the node reads the token (once) after this instant
        headers = {"Authorization": f"Bearer {leaked}"}
        async with httpx.AsyncClient(base_url=node.http, headers=headers, timeout=10) as http:
            assert (await http.get("/v1/queues")).status_code == 200  # accepted, cached
            revoke = ["token", "revoke", "--db", db_url, token_id]
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "orbit.cli", *revoke],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            revoked_at = time.monotonic()
            first = await http.get("/v1/queues")
            fresh = time.monotonic() - cached_at < TOKEN_CACHE_S
            if db_url.startswith("postgresql"):
                # The revoke's NOTIFY may or may not have reached the node yet: taken from
                # its cache, or refused at once, and nothing else.
                assert first.status_code in (200, 401), first.text
            elif fresh:
                # SQLite: nothing tells the node, so still cached and still taken, if this
                # answer came within TOKEN_CACHE_S of the instant before the node read the
                # token (a slow revoke command can leave no such instant: nothing to say).
                assert first.status_code == 200, first.text
            # The cached answer runs out TOKEN_CACHE_S after it was read, which was before
            # the revoke; the margin is for the requests themselves on a busy machine. This
            # poll's deadline is what fails a node that keeps the answer longer (the
            # default cache, 10 s, or for ever).
            deadline = revoked_at + TOKEN_CACHE_S + 2.0
            answer = first
            while answer.status_code == 200:
                assert time.monotonic() < deadline, "a revoked token is still accepted"
                await asyncio.sleep(0.1)
                answer = await http.get("/v1/queues")
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["code"] == "UNAUTHENTICATED"
        with pytest.raises(websockets.InvalidStatus) as refused:
            await WorkerConnection.connect(node.ws, leaked)
        assert refused.value.response.status_code == 401

    asyncio.run(scenario())


def test_worker_socket_answers_500_when_the_token_check_fails(
    node: Node, tokens: Tokens, db_url: str
) -> None:
    """A token check that raises (the database down or erring) is the server's failure,
    not the token's: the upgrade is answered 500 INTERNAL and the failure logged, never
    refused as bad credentials (which a worker takes as a wrong token and gives up)."""
    headers = {"Authorization": f"Bearer {tokens.worker}"}

    async def connect() -> None:
        async with websockets.connect(node.ws, additional_headers=headers) as ws:
            await ws.send('{"type":"hello"}')
            await ws.recv()

    _rename_tokens_table(db_url, "orbit_tokens", "orbit_tokens_away")
    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(connect())
    response = refused.value.response
    assert response.status_code == 500
    assert json.loads(response.body or b"{}")["error"]["code"] == "INTERNAL"
    assert "worker token check failed" in node.log_text()
    # the failure was not remembered as a verdict on the token: once the database
    # answers again, the same token connects
    _rename_tokens_table(db_url, "orbit_tokens_away", "orbit_tokens")

    async def hello() -> None:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("w", {"h": 1}, 1)
        await conn.close()

    asyncio.run(hello())


def test_a_request_that_fails_is_logged_once_naming_it(
    node: Node, tokens: Tokens, db_url: str
) -> None:
    """A 500 was logged twice, two tracebacks: by the server's handler ("request failed")
    and again by uvicorn ("Exception in ASGI application"), as Starlette re-raises after
    the handler's answer. It is logged once, with the method and path it failed."""
    unknown = f"orbit_{'0' * 32}_{'A' * 43}"  # never cached: its check reads the table
    before = len(node.log_text())
    _rename_tokens_table(db_url, "orbit_tokens", "orbit_tokens_away")
    try:
        with httpx.Client(base_url=node.http, timeout=60) as http:
            failed = http.get("/v1/queues", headers={"Authorization": f"Bearer {unknown}"})
        # Answered on the same event loop after the failed request's last steps (its log
        # lines, then the close of its connection, which uvicorn does not keep after a
        # failure): once this is answered, on a connection of its own, they are written.
        assert httpx.get(f"{node.http}/healthz", timeout=60).status_code == 200
    finally:
        _rename_tokens_table(db_url, "orbit_tokens_away", "orbit_tokens")
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "INTERNAL"
    said = node.log_text()[before:]
    assert "request failed: GET /v1/queues" in said, said
    assert said.count("Traceback (most recent call last)") == 1, said
    assert "Exception in ASGI application" not in said, said


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/tasks/batch"])
def test_a_client_gone_before_its_body_is_not_logged_as_an_error(
    nodes: object, tokens: Tokens, path: str
) -> None:
    """A client that closes its connection part way through its body (a timeout, a
    killed process) is routine: it was logged as two errors with their tracebacks, the
    node's and the server's last resort's."""
    node: Node = nodes(node_id="verbose", args=["--log-level", "debug"])  # type: ignore[operator]
    with socket.create_connection(("127.0.0.1", node.port)) as raw:
        raw.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {tokens.submit}\r\nContent-Length: 1000\r\n\r\n"
            '{"queue": '.encode()
        )
    gone = f"POST {path}: the client left before its body arrived"
    deadline = time.monotonic() + 30
    while gone not in node.log_text():  # the node's own line: the request is over
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.05)
    log = node.log_text()
    assert "ERROR" not in log and "Traceback" not in log, log
    admin = httpx.Client(base_url=node.http, headers={"Authorization": f"Bearer {tokens.admin}"})
    assert admin.get("/v1/tasks").json()["items"] == []  # nothing was written


def test_no_token_or_secret_reaches_the_log(nodes: object, tokens: Tokens, db_url: str) -> None:
    node: Node = nodes(node_id="verbose", args=["--log-level", "debug"])  # type: ignore[operator]
    admin = httpx.Client(base_url=node.http, headers={"Authorization": f"Bearer {tokens.admin}"})
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    admin.post("/v1/tasks", json={"queue": "q", "handler": "h"})
    httpx.get(f"{node.http}/v1/tasks", headers={"Authorization": "Bearer orbit_x_wrongsecret"})

    async def work() -> str:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("w", {"h": 1}, 1)
        [task] = (await conn.next_push(10))["tasks"]
        await conn.start(task["attempt_id"], task["fence"])
        await conn.finish(task["attempt_id"], task["fence"], result=1)
        secret = conn.resume_secret
        await conn.close()
        again = await WorkerConnection.connect(node.ws, tokens.worker)
        assert conn.session_id is not None and secret is not None
        await again.resume(conn.session_id, secret)
        await again.close()
        return secret

    secret = asyncio.run(work())
    node.stop()
    log = node.log_text()
    assert "DEBUG" in log or "INFO" in log  # the log was really written
    for value in (tokens.admin, tokens.worker, tokens.submit, secret, "wrongsecret"):
        assert value not in log
        if value.startswith("orbit_"):  # orbit_<id>_<secret>: the secret part alone
            assert value.split("_", 2)[2] not in log


def test_pagination_is_stable_while_tasks_are_inserted(admin: httpx.Client) -> None:
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(40)]
    before = {s["task"]["id"] for s in admin.post("/v1/tasks/batch", json={"tasks": batch}).json()}
    stop = threading.Event()

    def insert() -> None:
        with httpx.Client(base_url=str(admin.base_url), headers=admin.headers) as other:
            while not stop.is_set():
                other.post("/v1/tasks", json={"queue": "q", "handler": "h", "payload": "new"})

    writer = threading.Thread(target=insert)
    writer.start()
    seen: list[str] = []
    cursor = None
    try:
        while True:
            params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
            page = admin.get("/v1/tasks", params=params).json()
            seen += [t["id"] for t in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None or len(seen) > 400:
                break
    finally:
        stop.set()
        writer.join()
    assert len(seen) == len(set(seen)), "a task appeared twice"
    assert before <= set(seen), "a task that existed before the walk was skipped"
    assert seen == sorted(seen)


def test_list_filters_and_bad_cursor(admin: httpx.Client) -> None:
    admin.post("/v1/queues", json={"name": "a", "max_concurrency": 2, "rate": 0})
    admin.post("/v1/queues", json={"name": "b", "max_concurrency": 2, "rate": 0})
    admin.post("/v1/tasks", json={"queue": "a", "handler": "h", "tenant": "t1"})
    admin.post("/v1/tasks", json={"queue": "b", "handler": "g", "tenant": "t2"})
    assert [t["queue"] for t in admin.get("/v1/tasks?queue=b").json()["items"]] == ["b"]
    assert [t["tenant"] for t in admin.get("/v1/tasks?tenant=t1").json()["items"]] == ["t1"]
    assert [t["handler"] for t in admin.get("/v1/tasks?handler=g").json()["items"]] == ["g"]
    assert admin.get("/v1/tasks?state=succeeded").json()["items"] == []
    assert len(admin.get("/v1/tasks?created_after=2000-01-01T00:00:00Z").json()["items"]) == 2
    assert admin.get("/v1/tasks?created_before=2000-01-01T00:00:00Z").json()["items"] == []
    # an empty instant is no instant: it was read as no filter, and listed every task
    bad = ("created_after=", "created_before=", "created_after=yesterday")
    for query in ("cursor=%%%", "limit=0", "limit=1001", *bad):
        reply = admin.get(f"/v1/tasks?{query}")
        assert reply.status_code == 400, query
        assert reply.json()["error"]["code"] in (
            "INVALID_CURSOR",
            "INVALID_ARGUMENT",
            "INVALID_VALUE",
        )
    # the field a refused limit names is the parameter, as for every other parameter
    # (and for a limit given twice): it was "query.limit", FastAPI's location of it
    for path, query in (("/v1/tasks", "limit=0"), ("/v1/events", "limit=x")):
        error = admin.get(f"{path}?{query}").json()["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "limit"), error
        assert error["message"].startswith("limit: "), error


def test_task_cursor_must_be_a_task_id(admin: httpx.Client) -> None:
    """A task list cursor decodes to the id of the last task of a page: any other text
    is INVALID_CURSOR, never an empty page that looks like the end of the list ('hello',
    '~') nor the list from its start ('0')."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(3)]
    ids = [s["task"]["id"] for s in admin.post("/v1/tasks/batch", json={"tasks": batch}).json()]
    bad = ["hello", "0", "~", "\x01", ids[0].upper(), ids[0] + "0", ids[0][:-1], "1" * 36]
    for text in bad:
        reply = admin.get("/v1/tasks", params={"cursor": encode_cursor(text)})
        assert reply.status_code == 400, (text, reply.text)
        assert reply.json()["error"] == {
            "code": "INVALID_CURSOR",
            "message": "the cursor is not one this server issued",
            "field": "cursor",
        }, text
    first = admin.get("/v1/tasks", params={"limit": 1}).json()
    assert [t["id"] for t in first["items"]] == ids[:1]
    rest = admin.get("/v1/tasks", params={"cursor": first["next_cursor"]}).json()
    assert [t["id"] for t in rest["items"]] == ids[1:]


def test_a_list_filter_given_twice_is_refused(admin: httpx.Client) -> None:
    """``?state=queued&state=running`` was read as its last value alone: a page of
    running tasks that looked like an answer to both. A repeated query parameter of a
    list route is INVALID_ARGUMENT naming it."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    for path, query in (
        ("/v1/tasks", [("state", "queued"), ("state", "running")]),
        ("/v1/tasks", [("queue", "q"), ("limit", "1"), ("limit", "2")]),
        ("/v1/events", [("limit", "5"), ("limit", "5")]),
        (f"/v1/tasks/{task_id}/events", [("cursor", "MQ"), ("cursor", "Mg")]),
    ):
        reply = admin.get(path, params=query)
        assert reply.status_code == 400, (path, query, reply.text)
        twice = query[-1][0]
        assert reply.json()["error"] == {
            "code": "INVALID_ARGUMENT",
            "message": f"{twice}: give it once",
            "field": twice,
        }, (path, query)
    once = admin.get("/v1/tasks", params=[("state", "queued"), ("queue", "q")])
    assert [t["id"] for t in once.json()["items"]] == [task_id]


def test_the_task_list_window_takes_rfc3339_only(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    """``created_after``/``created_before`` are RFC 3339 date-times, as the docs say and
    as a submit's ``deadline`` is: ``datetime.fromisoformat`` also took a date alone, a
    time without an offset (an instant in no time zone), week dates, compact forms, a
    space for ``T``, offsets such as ``+05`` or ``+05:30:15``, and ``+05:60`` read as
    ``+06:00``. Each is INVALID_VALUE naming its parameter; every RFC 3339 spelling of
    the instant (lowercase ``t``/``z``, another offset, more digits) is taken. The
    clients still send what passes: an aware datetime whose offset is not whole minutes
    goes as the same instant in UTC."""
    from datetime import datetime, timedelta, timezone

    from orbit import Client

    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    first = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]
    second = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]
    at = second["created_at"]  # 2026-12-06T18:00:00.123456Z
    assert at.endswith("Z") and len(at) == 27, at
    aware = datetime.fromisoformat(at)
    date, clock = at[:10], at[11:19]
    in_india = aware.astimezone(timezone(timedelta(hours=5, minutes=30))).isoformat()
    same = [at, at.lower(), at[:-1] + "000Z", at[:-1] + "+00:00", at[:-1] + "-00:00", in_india]
    for text in same:
        after = admin.get("/v1/tasks", params={"created_after": text}).json()["items"]
        assert [t["id"] for t in after] == [second["id"]], text
        before = admin.get("/v1/tasks", params={"created_before": text}).json()["items"]
        assert [t["id"] for t in before] == [first["id"]], text
    year, week, weekday = aware.isocalendar()
    not_rfc3339 = [
        date,
        at[:-1],  # no offset
        f"{date} {at[11:]}",
        f"{date}X{at[11:]}",
        f"{year}-W{week:02d}-{weekday}T{at[11:]}",
        at.replace("-", "").replace(":", ""),
        at[:16] + "Z",  # no seconds
        at[:-1].replace(".", ",") + "Z",
        at[:-1] + "+00",
        at[:-1] + "+0000",
        at[:-1] + "+00:00:00",
        f"{date}T{clock}+05:60",
        at + " ",
    ]
    for text in not_rfc3339:
        for name in ("created_after", "created_before"):
            reply = admin.get("/v1/tasks", params={name: text})
            assert reply.status_code == 400, (name, text, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == ("INVALID_VALUE", name), (text, error)
            assert "RFC 3339" in error["message"], error
    odd = aware.astimezone(timezone(timedelta(hours=5, minutes=30, seconds=15)))
    with Client(node.http, tokens.admin) as c:
        assert [t["id"] for t in c.list_tasks(created_after=odd)["items"]] == [second["id"]]
        assert [t["id"] for t in c.list_tasks(created_before=odd)["items"]] == [first["id"]]


def test_a_list_refuses_a_query_parameter_it_does_not_take(admin: httpx.Client) -> None:
    """An unknown query parameter was ignored, so a filter a list does not have (or a
    misspelt one) answered the whole list, a page that looked filtered:
    ``/v1/events?task_id=…`` gave every task's events, ``/v1/tasks?status=failed`` every
    task. A list refuses it, INVALID_ARGUMENT naming it; an event stream still ignores
    it (a browser's EventSource polyfill may add its own)."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    for path, name, value in (
        ("/v1/tasks", "status", "failed"),
        ("/v1/tasks", "Queue", "q"),
        ("/v1/events", "task_id", task_id),
        ("/v1/events", "kind", "submitted"),
        (f"/v1/tasks/{task_id}/events", "kind", "submitted"),
        (f"/v1/tasks/{task_id}/attempts", "state", "running"),
        (f"/v1/tasks/{task_id}/artifacts", "name", "a.png"),
        ("/v1/workers", "name", "w"),
        ("/v1/queues", "name", "q"),
        ("/v1/tokens", "scope", "admin"),
        ("/v1/limits/tenants", "tenant", "t"),
        ("/v1/schedules", "paused", "true"),
    ):
        reply = admin.get(path, params={"limit": 5, name: value})
        assert reply.status_code == 400, (path, name, reply.text)
        error = reply.json()["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", name), (path, error)
        assert error["message"].startswith(f"{name}: not a parameter of this list"), error
    # what a list does take is still taken
    page = admin.get("/v1/tasks", params={"state": "queued", "queue": "q", "limit": 5})
    assert [t["id"] for t in page.json()["items"]] == [task_id]
    for path in ("/v1/events/stream", f"/v1/tasks/{task_id}/events/stream"):
        with admin.stream("GET", path, params={"lastEventId": "x"}) as stream:
            assert stream.status_code == 200, path


def _last_event_cursor(admin: httpx.Client, path: str) -> tuple[int, int]:
    """The position (xid, id) the cursor of ``path``'s last event stands for: the
    ``next_cursor`` of a page as long as the feed (events carry no xid of their own)."""
    items = admin.get(path).json()["items"]
    cursor = admin.get(path, params={"limit": len(items)}).json()["next_cursor"]
    text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    xid, _, event_id = text.partition(".")
    assert int(event_id) == int(items[-1]["id"]), text
    return int(xid), int(event_id)


def test_events_cursor_must_be_a_position_of_64_bit_decimals(admin: httpx.Client) -> None:
    """An events cursor decodes to an event's position, ``<xid>.<id>``, or to a bare id
    (a cursor from before migration 0008, xid 0), spelt as the server spells them: plain
    ASCII digits of at most 2^63 - 1, no sign, no leading zero, an id from 1. Anything
    else is INVALID_CURSOR naming ``cursor``, never a 500 from int() or from the
    database's integer (nor, for other scripts' digits, a page read from a misparsed
    id). ``0``, ``0.0`` and ``00.00`` were read as the start of the log, and a real
    position with a leading zero as that position: spellings the server never issues
    (no cursor at all is the start), refused as every other list refuses a cursor it
    did not issue."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    bad = ["\u0661\u0662", "\u00b2", "+5", " 5", "-1", "1_0", str(2**63), "9" * 40]
    bad += ["1.", ".1", "1..2", "1.2.3", "-1.2", "1.-2", f"{2**63}.1", "\u0661.1", "1 .2"]
    bad += ["0", "0.0", "00.00", "00", "0.00"]
    for path in ("/v1/events", f"/v1/tasks/{task_id}/events"):
        xid, event_id = _last_event_cursor(admin, path)
        spelt_otherwise = [f"0{xid}.{event_id}", f"{xid}.0{event_id}", f"{xid}.+{event_id}"]
        for text in bad + spelt_otherwise + ([] if xid else [f"0{event_id}"]):
            reply = admin.get(path, params={"cursor": encode_cursor(text)})
            assert reply.status_code == 400, (path, text, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == ("INVALID_CURSOR", "cursor"), text
        # the streams read their cursor (or Last-Event-ID) by the same rule, refused
        # before the stream starts
        for text in ("0", "0.0", f"0{xid}.{event_id}"):
            cursor = encode_cursor(text)
            for params, headers in (({"cursor": cursor}, {}), ({}, {"Last-Event-ID": cursor})):
                reply = admin.get(f"{path}/stream", params=params, headers=headers)
                assert reply.status_code == 400, (path, text, headers, reply.text)
                assert reply.json()["error"]["code"] == "INVALID_CURSOR", (path, text)
        for text in [f"{xid}.{event_id}"] + ([] if xid else [str(event_id)]):
            reply = admin.get(path, params={"cursor": encode_cursor(text)})
            assert reply.status_code == 200, (path, text, reply.text)
            assert reply.json() == {"items": [], "next_cursor": None}, (path, text)
        assert admin.get(path).json()["items"], path  # no cursor: from the start


def test_events_cursor_must_name_an_event(admin: httpx.Client) -> None:
    """An events cursor stands for the position of the event it names in the log, which
    is in transaction order, not id order: a well-formed position that no event has is
    INVALID_CURSOR. It was read as "after this id", an empty page that looked like the
    end of the log. A bare id is the position of an event from before migration 0008,
    with xid 0: of a later event (xid 0 only on SQLite) it names none."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    for path in ("/v1/events", f"/v1/tasks/{task_id}/events"):
        xid, last = _last_event_cursor(admin, path)
        nowhere = [
            f"{xid}.{last + 1}",
            f"{xid + 1}.{last}",
            f"{xid}.{2**63 - 1}",
            f"{xid + 1}.0",
            "1.0",
        ]
        nowhere += [str(last + 1), str(2**63 - 1)] + ([str(last)] if xid else [])
        for text in nowhere:
            reply = admin.get(path, params={"cursor": encode_cursor(text)})
            assert reply.status_code == 400, (path, text, reply.text)
            assert reply.json()["error"] == {
                "code": "INVALID_CURSOR",
                "message": "the cursor is not one this server issued",
                "field": "cursor",
            }, (path, text)
        for text in [f"{xid}.{last}"] + ([] if xid else [str(last)]):
            page = admin.get(path, params={"cursor": encode_cursor(text)}).json()
            assert page == {"items": [], "next_cursor": None}, (path, text)


def _walk_pages(admin: httpx.Client, path: str, limit: int) -> list[list[dict[str, Any]]]:
    """Every page of a list route, ``limit`` items at a time, by its ``next_cursor``."""
    pages, cursor = [], None
    while True:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        reply = admin.get(path, params=params)
        assert reply.status_code == 200, (path, reply.text)
        pages.append(reply.json()["items"])
        cursor = reply.json()["next_cursor"]
        if cursor is None:
            return pages


def test_the_queue_token_and_attempt_lists_page_on_each_backend(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    """The three lists that came whole are pages on both databases: each row on exactly
    one page, in the list's order (queues by name in code-point order, tokens oldest
    first, attempts by number), and a cursor the server did not issue refused with 400,
    before the database sees it (past 2^31 - 1, an attempt number overflows PostgreSQL's
    integer), or, for an attempt number past the task's last claim, once the task is
    read."""
    for name in ("b", "B", "a-1", "a", "a.1", "0"):
        admin.post("/v1/queues", json={"name": name, "max_concurrency": 1, "rate": 0})
    queues = [q["name"] for p in _walk_pages(admin, "/v1/queues", 2) for q in p]
    assert queues == ["0", "B", "a", "a-1", "a.1", "b"]
    for i in range(3):
        admin.post("/v1/tokens", json={"name": f"t{i}", "scopes": ["submit"]})
    listed = [t for p in _walk_pages(admin, "/v1/tokens", 2) for t in p]
    assert [t["id"] for t in listed] == sorted({t["id"] for t in listed})
    assert [t["created_at"] for t in listed] == sorted(t["created_at"] for t in listed)
    assert [t["name"] for t in listed][-3:] == ["t0", "t1", "t2"]
    task_id = admin.post("/v1/tasks", json={"queue": "a", "handler": "h"}).json()["task"]["id"]

    async def claim_and_release(times: int) -> None:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("w", {"h": 1}, 1, push=False)
            for _ in range(times):
                [granted] = await conn.claim(1)
                await conn.release(granted["attempt_id"], granted["fence"])
        finally:
            await conn.close()

    asyncio.run(claim_and_release(3))
    pages = _walk_pages(admin, f"/v1/tasks/{task_id}/attempts", 2)
    assert [[a["number"] for a in p] for p in pages] == [[1, 2], [3]]
    for path, text in (
        ("/v1/queues", "~"),
        ("/v1/tokens", "Z" * 32),
        (f"/v1/tasks/{task_id}/attempts", str(2**31)),
        (f"/v1/tasks/{task_id}/attempts", "0"),
    ):
        reply = admin.get(path, params={"cursor": encode_cursor(text)})
        assert reply.status_code == 400, (path, text, reply.text)
        assert reply.json()["error"]["code"] == "INVALID_CURSOR", (path, text)
    # the task's last claim's number (its fence) is a cursor, the end for now; a number
    # past it names no attempt, and its empty page read as "none new yet" for ever
    # after (even the largest number was one), so a reader would miss attempts 4 to N.
    # Every claim here was released: attempts_used is still 0, the fence 3.
    path = f"/v1/tasks/{task_id}/attempts"
    reply = admin.get(path, params={"cursor": encode_cursor("3")})
    assert reply.json() == {"items": [], "next_cursor": None}
    for text in ("4", str(2**31 - 1)):
        reply = admin.get(path, params={"cursor": encode_cursor(text)})
        assert reply.status_code == 400, (text, reply.text)
        assert reply.json()["error"]["code"] == "INVALID_CURSOR", text
    asyncio.run(claim_and_release(1))  # number 4 now: its cursor is one
    reply = admin.get(path, params={"cursor": encode_cursor("3")})
    assert [a["number"] for a in reply.json()["items"]] == [4]
    reply = admin.get(path, params={"cursor": encode_cursor("4")})
    assert reply.json() == {"items": [], "next_cursor": None}


def test_an_attempt_shows_its_session_epoch_claim_expiry_and_outcome(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    """DESIGN's Attempt has ``session_epoch``, ``claim_expires_at`` and ``outcome``, which
    ``AttemptView`` lacked. Each attempt now shows the epoch of the session that claimed
    it (a resumed session's later claims the new one), the claim's expiry the worker was
    given, and, once it has ended, the ``kind`` and ``code`` of the event that ended it
    (null while it is live): a release, a failure with its code, a success."""
    from orbit.protocol.messages import AttemptView

    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 5, "rate": 0})

    def submit() -> str:
        reply = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"})
        return str(reply.json()["task"]["id"])

    async def work() -> tuple[dict[str, str], dict[str, list[dict[str, Any]]], str]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        again = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("w", {"h": 2}, 2, push=False)
            tasks, grants = {"failed": submit()}, {}
            released = (await conn.claim(1))[0]
            await conn.release(released["attempt_id"], released["fence"])
            failed = (await conn.claim(1))[0]
            await conn.start(failed["attempt_id"], failed["fence"])
            error = {"code": "BAD_INPUT", "message": "no such page", "retryable": False}
            await conn.finish(failed["attempt_id"], failed["fence"], error=error)
            grants["failed"] = [released, failed]
            tasks["succeeded"] = submit()
            succeeded = (await conn.claim(1))[0]
            await conn.start(succeeded["attempt_id"], succeeded["fence"])
            await conn.finish(succeeded["attempt_id"], succeeded["fence"], result={"ok": 1})
            grants["succeeded"] = [succeeded]
            assert conn.session_id is not None and conn.resume_secret is not None
            await again.resume(conn.session_id, conn.resume_secret, push=False)
            tasks["live"] = submit()
            grants["live"] = await again.claim(1)
            return tasks, grants, conn.session_id
        finally:
            await again.close()
            await conn.close()

    tasks, grants, session_id = asyncio.run(work())
    shown = {
        name: admin.get(f"/v1/tasks/{task_id}/attempts").json()["items"]
        for name, task_id in tasks.items()
    }
    for name, attempts in shown.items():
        assert [a["id"] for a in attempts] == [g["attempt_id"] for g in grants[name]], name
        for a, granted in zip(attempts, grants[name], strict=True):
            AttemptView.model_validate(a)  # the documented schema
            assert a["session_id"] == session_id
            assert a["claim_expires_at"] == granted["claim_expires_at"], (name, a)
    assert [(a["session_epoch"], a["state"], a["outcome"]) for a in shown["failed"]] == [
        ("1", "released", {"kind": "released", "code": None}),
        ("1", "failed", {"kind": "failed", "code": "BAD_INPUT"}),
    ]
    assert [(a["session_epoch"], a["state"], a["outcome"]) for a in shown["succeeded"]] == [
        ("1", "succeeded", {"kind": "succeeded", "code": None})
    ]
    assert [(a["session_epoch"], a["state"], a["outcome"]) for a in shown["live"]] == [
        ("2", "claimed", None)
    ]
    # the outcome is the event that ended the attempt, as the task's events show it
    events = admin.get(f"/v1/tasks/{tasks['failed']}/events").json()["items"]
    for a in shown["failed"]:
        [ended] = [
            e for e in events if e["attempt_id"] == a["id"] and e["attempt_to"] == a["state"]
        ]
        assert a["outcome"] == {"kind": ended["kind"], "code": ended["code"]}


def test_the_tenant_limit_list_pages_on_each_backend(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    """``GET /v1/limits/tenants`` answered every tenant ever capped in one bare list. It
    is a page now (``{items, next_cursor}``, keyset by name, as the queue list is): each
    capped tenant on exactly one page in code-point order, one whose caps were removed on
    none; the clients read one page, walk them from the start or a cursor, or return all."""
    from orbit import AsyncClient, Client

    names = ["b", "B", "a-1", "a", "a.1", "0", "gone"]
    for i, name in enumerate(names):
        body = {"max_concurrency": i + 1} if i % 2 else {"max_queued": i + 1}
        assert admin.put(f"/v1/limits/tenants/{name}", json=body).status_code == 200
    admin.put("/v1/limits/tenants/gone", json={"max_concurrency": None, "max_queued": None})
    admin.put("/v1/limits/tenants/never", json={"max_concurrency": None})  # a row, no cap
    every = ["0", "B", "a", "a-1", "a.1", "b"]
    for size in (1, 2, 5, 6, 1000):
        pages = _walk_pages(admin, "/v1/limits/tenants", size)
        assert [t["tenant"] for p in pages for t in p] == every, size
        assert all(len(p) == size for p in pages[:-1]), size
    assert [len(p) for p in _walk_pages(admin, "/v1/limits/tenants", 3)] == [3, 3, 0]
    first = admin.get("/v1/limits/tenants", params={"limit": 1}).json()
    assert first == {
        "items": [{"tenant": "0", "max_concurrency": 6, "max_queued": None}],
        "next_cursor": encode_cursor("0"),
    }
    assert admin.get("/v1/limits/tenants").json()["next_cursor"] is None  # 100 by default
    with Client(node.http, tokens.admin) as c:
        assert [t["tenant"] for t in c.tenant_limits()] == every
        one = c.list_tenant_limits(limit=2)
        assert [t["tenant"] for t in one["items"]] == every[:2] and one["next_cursor"]
        assert [t["tenant"] for t in c.iter_tenant_limits(limit=4)] == every
        resumed = c.iter_tenant_limits(limit=1, cursor=one["next_cursor"])
        assert [t["tenant"] for t in resumed] == every[2:]

    async def walk_async() -> tuple[list[str], list[str], list[str]]:
        async with AsyncClient(node.http, tokens.admin) as c:
            whole = [t["tenant"] for t in await c.tenant_limits()]
            page = await c.list_tenant_limits(limit=1)
            cursor = page["next_cursor"]
            rest = [t["tenant"] async for t in c.iter_tenant_limits(limit=2, cursor=cursor)]
            return whole, [t["tenant"] for t in page["items"]], rest

    assert asyncio.run(walk_async()) == (every, every[:1], every[1:])


def test_a_bad_tenant_limit_page_request_is_refused(
    admin: httpx.Client, node: Node, tokens: Tokens
) -> None:
    """A cursor that is not a tenant name (which would read as a place in the list: '' its
    start, '~' its end), an empty one, a limit out of 1-1,000 or not in plain digits, and
    a parameter given twice are each refused with 400 naming it, from the route and both
    clients, and change nothing."""
    from orbit import AsyncClient, Client
    from orbit.client import BadRequest

    admin.put("/v1/limits/tenants/acme", json={"max_queued": 5})
    path = "/v1/limits/tenants"
    cursors = ["~", "-a", "a b", "a\n", "é", "a" * 129, "café"]
    for bad in [encode_cursor(c) for c in cursors] + ["%%%", "!!", "YQ=x", ""]:
        reply = admin.get(path, params={"cursor": bad})
        assert reply.status_code == 400, (bad, reply.text)
        error = reply.json()["error"]
        assert (error["code"], error["field"]) == ("INVALID_CURSOR", "cursor"), bad
    for limit in ("0", "1001", "-1", "1.0", "+1", "1_0", "x", ""):
        reply = admin.get(path, params={"limit": limit})
        assert reply.status_code == 400, (limit, reply.text)
        error = reply.json()["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "limit"), limit
    for twice in ("limit=1&limit=2", "cursor=YQ&cursor=Yg"):
        reply = admin.get(f"{path}?{twice}")
        assert reply.status_code == 400, (twice, reply.text)
        assert reply.json()["error"]["message"].endswith("give it once"), twice
    with Client(node.http, tokens.admin) as c:
        for call in (
            lambda: c.list_tenant_limits(cursor=""),
            lambda: c.list_tenant_limits(cursor=encode_cursor("~")),
            lambda: c.list_tenant_limits(limit=0),
        ):
            with pytest.raises(BadRequest):
                call()

    async def refused_async() -> str:
        async with AsyncClient(node.http, tokens.admin) as c:
            with pytest.raises(BadRequest) as refused:
                await c.list_tenant_limits(cursor="")
            return refused.value.code

    assert asyncio.run(refused_async()) == "INVALID_CURSOR"
    assert admin.get(path).json() == {
        "items": [{"tenant": "acme", "max_concurrency": None, "max_queued": 5}],
        "next_cursor": None,
    }


def test_task_list_refuses_an_unknown_state(admin: httpx.Client) -> None:
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    admin.post("/v1/tasks", json={"queue": "q", "handler": "h"})
    for state in ("nope", "QUEUED", "queued ", ""):
        reply = admin.get("/v1/tasks", params={"state": state})
        assert reply.status_code == 400, (state, reply.text)
        error = reply.json()["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "state"), state
    assert len(admin.get("/v1/tasks", params={"state": "queued"}).json()["items"]) == 1
    assert admin.get("/v1/tasks", params={"state": "needs_review"}).json()["items"] == []


def test_batch_reply_of_ids(admin: httpx.Client) -> None:
    """``?reply=ids``: each task's id and whether this request created it, in order; the
    tasks are the same as with whole views. A bad ``reply`` is refused before the body is
    read, so nothing is stored."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    keyed = {"queue": "q", "handler": "h", "idempotency_key": "k"}
    first = admin.post("/v1/tasks", json=keyed).json()["task"]
    batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(3)]
    reply = admin.post("/v1/tasks/batch?reply=ids", json={"tasks": [*batch, keyed]})
    assert reply.status_code == 201
    items = reply.json()
    assert [set(item) for item in items] == [{"id", "created"}] * 4
    assert [item["created"] for item in items] == [True, True, True, False]
    assert items[3]["id"] == first["id"]
    assert [admin.get(f"/v1/tasks/{i['id']}").json()["payload"] for i in items[:3]] == [0, 1, 2]
    full = admin.post("/v1/tasks/batch?reply=full", json={"tasks": batch[:1]}).json()
    assert full[0]["created"] is True and full[0]["task"]["payload"] == 0
    stored = {t["id"] for t in admin.get("/v1/tasks").json()["items"]}
    assert len(stored) == 5
    for query in ("reply=views", "reply=", "reply=IDS", "reply=ids&reply=full"):
        bad = admin.post(f"/v1/tasks/batch?{query}", json={"tasks": batch})
        assert bad.status_code == 400, query
        assert bad.json()["error"]["code"] == "INVALID_ARGUMENT", query
        assert bad.json()["error"]["field"] == "reply", query
    # also before an unreadable body: the query is the first thing refused
    bad = admin.post("/v1/tasks/batch?reply=x", content=b"{")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert {t["id"] for t in admin.get("/v1/tasks").json()["items"]} == stored


def test_size_bounds_answer_413(admin: httpx.Client) -> None:
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    big = admin.post("/v1/tasks", json={"queue": "q", "handler": "h", "payload": "x" * 300_000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
    # a batch in the usual shape (the one-pass reader's) has its payloads checked too
    usual = [{"queue": "q", "handler": "h", "payload": {"i": i}} for i in range(3)]
    usual[2]["payload"] = "x" * 300_000
    batch = admin.post("/v1/tasks/batch", json={"tasks": usual})
    assert batch.status_code == 413 and batch.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
    huge = admin.post(
        "/v1/tasks",
        content=b'{"queue":"q","handler":"h","payload":"' + b"x" * (17 * 1024 * 1024) + b'"}',
    )
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "BODY_TOO_LARGE"
    assert admin.get("/v1/tasks").json()["items"] == []


def test_a_large_batch_with_a_late_bad_task_is_refused_whole(admin: httpx.Client) -> None:
    """A batch of more than one chunk is read a chunk at a time inside its transaction
    (orbit.core.batches): a bad task in its last chunk is refused with the error the
    strict path gives it, naming the task, and nothing of the batch is stored."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    usual = [{"queue": "q", "handler": "h", "payload": {"i": i}} for i in range(600)]
    cases: list[tuple[dict[str, Any], int, str, str | None]] = [
        ({"handler": "a b"}, 400, "INVALID_VALUE", "tasks[550].handler"),
        ({"retry_safe": 1}, 400, "INVALID_TYPE", "tasks[550].retry_safe"),
        ({"priority": 1_000_001}, 400, "NUMBER_OUT_OF_RANGE", "tasks[550].priority"),
        ({"payload": "x" * 300_000}, 413, "PAYLOAD_TOO_LARGE", "tasks[550].payload"),
        ({"payload": {"nul": "a\u0000b"}}, 400, "NUL_CHARACTER", "tasks[550].payload.nul"),
    ]
    for late, status, code, field in cases:
        bad = [*usual]
        bad[550] = {**usual[550], **late}
        reply = admin.post("/v1/tasks/batch", json={"tasks": bad})
        assert reply.status_code == status, (late, reply.text)
        assert reply.json()["error"]["code"] == code, late
        assert reply.json()["error"].get("field") == field, late
    assert admin.get("/v1/tasks").json()["items"] == []
    good = admin.post("/v1/tasks/batch?reply=ids", json={"tasks": usual})
    assert good.status_code == 201 and len(good.json()) == 600
    ids = [item["id"] for item in good.json()]
    for i in (0, 404, 405, 599):  # either side of the last chunk's start
        assert admin.get(f"/v1/tasks/{ids[i]}").json()["payload"] == {"i": i}


def test_operator_routes(admin: httpx.Client, node: Node, tokens: Tokens) -> None:
    missing = admin.post("/v1/queues", json={"name": "q", "rate": 0})
    assert missing.status_code == 400 and missing.json()["error"]["field"] == "max_concurrency"
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    assert admin.post("/v1/queues/q/pause").json()["paused"] is True
    assert admin.post("/v1/queues/q/resume").json()["paused"] is False
    assert admin.post("/v1/queues/nope/pause").status_code == 404
    task = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]
    assert admin.post(f"/v1/tasks/{task['id']}/cancel").json()["state"] == "cancelled"
    assert admin.post(f"/v1/tasks/{task['id']}/retry").json()["state"] == "queued"
    conflict = admin.post(f"/v1/tasks/{task['id']}/resolve", json={"decision": "failed"})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "INVALID_STATE"
    for body, field in (  # an outcome the decision would drop is refused, not ignored
        ({"decision": "failed", "result": {"r": 1}}, "result"),
        ({"decision": "retry", "result": 0}, "result"),
        ({"decision": "succeeded", "error": {"code": "E"}}, "error"),
        ({"decision": "retry", "error": {"code": "E", "message": "m"}}, "error"),
    ):
        refused = admin.post(f"/v1/tasks/{task['id']}/resolve", json=body)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["error"]["code"] == "INVALID_ARGUMENT", body
        assert refused.json()["error"]["field"] == field, body
    assert admin.get(f"/v1/tasks/{task['id']}").json()["state"] == "queued"
    made = admin.post("/v1/tokens", json={"name": "ci", "scopes": ["submit"]})
    assert made.status_code == 201 and made.json()["token"].startswith("orbit_")
    assert made.headers["cache-control"] == "no-store"  # the secret is kept by no cache
    workers = admin.get("/v1/workers").json()
    assert workers == {"items": [], "next_cursor": None}
    assert admin.get("/v1/nope").status_code == 404
    assert httpx.get(f"{node.http}/readyz").json() == {"status": "ready"}


def test_a_childs_idempotent_resubmit_after_its_parents_cancel_gets_the_child(
    admin: httpx.Client,
) -> None:
    """Over HTTP: the client lost the reply to a child's submit, the parent was cancelled
    meanwhile, and the retry with the same key gets the (cancelled) child back; a new
    child under that parent is still refused, and nothing new is stored."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 2, "rate": 0})
    parent = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]
    child = {"queue": "q", "handler": "h", "parent_id": parent["id"], "idempotency_key": "c"}
    first = admin.post("/v1/tasks", json=child)
    assert first.status_code == 201, first.text
    assert admin.post(f"/v1/tasks/{parent['id']}/cancel").status_code == 200
    again = admin.post("/v1/tasks", json=child)
    assert again.status_code == 200 and again.json()["created"] is False, again.text
    task = again.json()["task"]
    assert task["id"] == first.json()["task"]["id"] and task["state"] == "cancelled"
    batch = admin.post("/v1/tasks/batch?reply=ids", json={"tasks": [child]})
    assert batch.status_code == 201, batch.text
    assert batch.json() == [{"id": task["id"], "created": False}]
    new = admin.post("/v1/tasks", json={**child, "idempotency_key": "other"})
    assert new.status_code == 409 and new.json()["error"]["code"] == "PARENT_CANCELLED"
    assert len(admin.get("/v1/tasks").json()["items"]) == 2


def _samples(node: Node, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of metric family ``name`` in ``/metrics``, parsed as Prometheus reads
    them (so a format error fails here), keyed by their sorted labels."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(f"{node.http}/metrics")
    assert reply.status_code == 200
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(reply.text)
        if family.name == name
        for s in family.samples
    }


def test_queue_depth_is_zero_for_a_queue_with_nothing_queued(
    admin: httpx.Client, node: Node
) -> None:
    """Every queue has an ``orbit_queue_depth`` sample, 0 when nothing is queued: a
    drained queue's series used to vanish, so a dashboard showed a gap and an alert on
    ``orbit_queue_depth == 0`` (or ``absent``) could not tell empty from unknown."""
    admin.post("/v1/queues", json={"name": "idle", "max_concurrency": 1, "rate": 0})
    admin.post("/v1/queues", json={"name": "busy", "max_concurrency": 1, "rate": 0})
    task = admin.post("/v1/tasks", json={"queue": "busy", "handler": "h"}).json()["task"]
    depth = _samples(node, "orbit_queue_depth")
    assert depth == {(("queue", "busy"),): 1.0, (("queue", "idle"),): 0.0}
    admin.post(f"/v1/tasks/{task['id']}/cancel")
    depth = _samples(node, "orbit_queue_depth")
    assert depth == {(("queue", "busy"),): 0.0, (("queue", "idle"),): 0.0}


class _Proxy:
    """A TCP proxy to PostgreSQL that can be cut: the database "gone" for a node whose
    connections go through it, without touching the shared server. Cut, it closes every
    connection and stops listening, so a new one is refused."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # cut
            with self._lock:
                if self._cut:
                    client.close()
                    return
                server = socket.create_connection(self._target)
                self._open += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            # shutdown, not only close: a close leaves the blocked accept() listening
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


#: A client's patience with /readyz and /metrics while the database is gone: longer than
#: any plausible good answer (READY_TIMEOUT_S, 2 s), shorter than the connection pool's
#: 30 s that the defect waited, so that the defect fails by timing out.
PROBE_TIMEOUT_S = 15.0


@contextlib.contextmanager
def _served_through_a_proxy(tmp_path: Path) -> Iterator[tuple[Node, _Proxy]]:
    """A node on a fresh PostgreSQL database that it reaches through a ``_Proxy``."""
    with temporary_database("orbit_ready") as dsn:
        params = conninfo_to_dict(dsn)
        proxy = _Proxy(str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
        url = as_url(make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port)))
        node = start_server(url, tmp_path)
        try:
            yield node, proxy
        finally:
            node.stop()


@pytest.mark.postgres_only
def test_readyz_answers_503_promptly_when_the_database_is_gone(tmp_path: Path) -> None:
    """/readyz is 503 when the database cannot be read, within a probe's patience: it
    used to wait for the connection pool's own timeout (30 s), far past any probe's, so
    a caller without one hung and each probe held a worker thread all that while."""
    with _served_through_a_proxy(tmp_path) as (node, proxy):
        assert httpx.get(f"{node.http}/readyz").json() == {"status": "ready"}
        proxy.cut()
        # A probe's patience: far more than READY_TIMEOUT_S, far less than the pool's 30 s,
        # so the defect raises httpx.ReadTimeout here.
        replies = [httpx.get(f"{node.http}/readyz", timeout=PROBE_TIMEOUT_S) for _ in range(2)]
        assert [r.status_code for r in replies] == [503, 503], [r.text for r in replies]
        assert replies[0].json()["status"] == "unavailable"
        assert httpx.get(f"{node.http}/healthz").json()["status"] == "ok"


@pytest.mark.postgres_only
def test_metrics_answers_503_promptly_when_the_database_is_gone(tmp_path: Path) -> None:
    """/metrics reads its task gauges from the database: with the database gone it
    waited for the connection pool's 30 s, then answered 500 (``INTERNAL``), so a
    scrape timed out and each one held a thread. It is bounded as /readyz is: 503 within
    ``READY_TIMEOUT_S``, saying why."""
    with _served_through_a_proxy(tmp_path) as (node, proxy):
        assert httpx.get(f"{node.http}/metrics").status_code == 200
        proxy.cut()
        with ThreadPoolExecutor(2) as scrapers:  # two at once: they share one read
            replies = list(  # the defect raises httpx.ReadTimeout, as for /readyz
                scrapers.map(
                    lambda _: httpx.get(f"{node.http}/metrics", timeout=PROBE_TIMEOUT_S),
                    range(2),
                )
            )
        assert [r.status_code for r in replies] == [503, 503], [r.text for r in replies]
        assert replies[0].json() == {
            "status": "unavailable",
            "reason": "TimeoutError",
            "message": f"the database did not answer within {READY_TIMEOUT_S:g} s",
        }
        assert httpx.get(f"{node.http}/healthz").json()["status"] == "ok"
