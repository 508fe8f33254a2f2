"""Operator actions on tasks (cancel, retry, resolve) over real HTTP and a real worker
WebSocket, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import httpx

from orbit.worker import WorkerConnection
from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens

_WAIT = 10.0  # a safety net: each push below comes as soon as its cause commits


def test_a_cancel_made_while_the_worker_was_away_is_pushed_when_it_resumes(
    node: Node, tokens: Tokens, admin: httpx.Client
) -> None:
    """A cancel that commits while no connection holds the running attempt's session
    (the worker reconnecting, its node restarting) is pushed to no one. Old code: the
    resumed worker heard of it only at its next renew, up to half a lease later, its
    handler at work all the while; now the resume is followed by the push."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 1, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]

    async def work() -> tuple[dict[str, object], dict[str, object]]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("away", {"h": 1}, 1)
        [task] = (await conn.next_push(_WAIT))["tasks"]
        assert (await conn.start(task["attempt_id"], task["fence"]))["status"] == "ok"
        session_id, secret = conn.session_id, conn.resume_secret
        assert session_id is not None and secret is not None
        await conn.close()
        cancelled = await asyncio.to_thread(admin.post, f"/v1/tasks/{task_id}/cancel")
        assert cancelled.json()["state"] == "cancelling", cancelled.text
        again = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await again.resume(session_id, secret, push=False)
            pushed = await again.next_push(_WAIT)
            receipt = await again.finish(task["attempt_id"], task["fence"], result="late")
        finally:
            await again.close()
        return pushed, receipt

    pushed, receipt = asyncio.run(work())
    assert pushed["type"] == "cancel", pushed
    assert pushed["attempt_ids"] == [
        a["id"] for a in admin.get(f"/v1/tasks/{task_id}/attempts").json()["items"]
    ]
    assert receipt["task_state"] == "cancelled"
    task = admin.get(f"/v1/tasks/{task_id}").json()
    assert task["state"] == "cancelled" and task["result"] is None


def test_task_resolve_refuses_an_empty_error_code() -> None:
    """``--error-code ""`` passed the CLI's checks and was then sent as no error at all:
    the task was resolved failed with ``RESOLVED_FAILED`` and the operator's
    ``--error-message`` was dropped without a word. Refused now (exit 2), nothing sent
    (no server listens at the URL: a request would exit 4)."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    env = {"ORBIT_URL": "http://127.0.0.1:9", "ORBIT_TOKEN": "orbit_x_y", "ORBIT_TOKEN_FILE": None}
    resolve = ["task", "resolve", "01a229a4-0000-7000-8000-000000000000", "--decision", "failed"]
    for extra in ([], ["--error-message", "the disk was full"]):
        args = [*resolve, "--error-code", "", *extra]
        run = CliRunner().invoke(app, args, env=env)
        assert run.exit_code == 2, (extra, run.output)
        assert "--error-code must not be empty" in run.output, run.output


def test_resolve_refuses_a_retryable_error_it_would_store_as_not_retryable(
    admin: httpx.Client,
) -> None:
    """``{"decision": "failed", "error": {…, "retryable": true}}`` was taken, and the
    task stored ``retryable: false`` without a word. Refused now, naming the field,
    before the task is looked at; ``retryable: false`` (what is stored) goes through."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 1, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    error = {"code": "E", "message": "m", "retryable": True}
    refused = admin.post(
        f"/v1/tasks/{task_id}/resolve", json={"decision": "failed", "error": error}
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert refused.json()["error"]["field"] == "error.retryable"
    error["retryable"] = False  # taken: the task is then judged (queued, so not resolvable)
    judged = admin.post(f"/v1/tasks/{task_id}/resolve", json={"decision": "failed", "error": error})
    assert judged.status_code == 409 and judged.json()["error"]["code"] == "INVALID_STATE"
    assert admin.get(f"/v1/tasks/{task_id}").json()["state"] == "queued"


def test_a_cancel_heard_while_a_drain_stops_the_handler_ends_the_task_at_once(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """A drain stops a handler (not retry_safe) past its grace; while the handler cleans
    up, its task is cancelled and the worker hears it. Old code: the drain's rule (report
    nothing for a task that is not retry_safe: its effects are unknown) held, so the task
    stayed `cancelling` until its lease ran out (30 s here), though any report of a
    `cancelling` task ends it `cancelled` and replays nothing. Now the runner reports the
    cancel, and the task is `cancelled` by the time the worker's run is over."""
    node = nodes()  # the default lease: 30 s, far past this test
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=auth) as api:
        api.post("/v1/queues", json={"name": "q", "max_concurrency": 1, "rate": 0})
        task_id = api.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
        worker = Worker(node.http, tokens.worker, grace=0, cancel_grace=30)
        started, stopping = threading.Event(), threading.Event()
        heard = _heard_cancel(worker)
        seen: dict[str, Any] = {}

        @worker.handler("h")
        async def handler(ctx: Context, payload: Any) -> Any:
            started.set()
            try:
                await asyncio.Event().wait()  # until the drain cancels it
            except asyncio.CancelledError:
                seen["stopped by"] = ctx.reason
                stopping.set()
                await heard.wait()  # cleaning up while the task's cancel comes
                raise
            return "never"

        async def run() -> int:
            running = asyncio.create_task(worker.arun())
            assert await asyncio.to_thread(started.wait, 30)
            worker.stop()
            assert await asyncio.to_thread(stopping.wait, 30)
            cancelled = await asyncio.to_thread(api.post, f"/v1/tasks/{task_id}/cancel")
            assert cancelled.json()["state"] == "cancelling", cancelled.text
            return await asyncio.wait_for(running, 60)

        assert asyncio.run(run()) == 0
        assert seen["stopped by"] == "worker stopping"
        task = api.get(f"/v1/tasks/{task_id}").json()
        assert task["state"] == "cancelled" and task["result"] is None, task
        [attempt] = api.get(f"/v1/tasks/{task_id}/attempts").json()["items"]
        assert attempt["state"] == "cancelled", attempt


def test_cancel_and_retry_refuse_a_body_they_would_ignore(admin: httpx.Client) -> None:
    """A cancel with ``{"cascade": false}`` (an option it does not have) cancelled the
    whole tree all the same and answered 200; a retry likewise ignored what it was sent.
    Each is refused now, naming the field, with nothing changed; no body, or ``{}``, is
    taken as before."""
    admin.post("/v1/queues", json={"name": "q", "max_concurrency": 1, "rate": 0})
    parent = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]["id"]
    child = {"queue": "q", "handler": "h", "parent_id": parent}
    child_id = admin.post("/v1/tasks", json=child).json()["task"]["id"]
    for action, body, code, field in (
        ("cancel", b'{"cascade": false}', "UNKNOWN_FIELD", "cascade"),
        ("cancel", b"null", "INVALID_TYPE", None),
        ("retry", b'{"reset_attempts": true}', "UNKNOWN_FIELD", "reset_attempts"),
    ):
        refused = admin.post(f"/v1/tasks/{parent}/{action}", content=body)
        assert refused.status_code == 400, (action, body, refused.text)
        assert refused.json()["error"]["code"] == code, (action, body, refused.text)
        assert refused.json()["error"].get("field") == field, (action, body, refused.text)
    states = [admin.get(f"/v1/tasks/{t}").json()["state"] for t in (parent, child_id)]
    assert states == ["queued", "queued"]
    assert admin.post(f"/v1/tasks/{child_id}/cancel", json={}).json()["state"] == "cancelled"
    assert admin.post(f"/v1/tasks/{child_id}/retry", json={}).json()["state"] == "queued"
    assert admin.post(f"/v1/tasks/{parent}/cancel").json()["state"] == "cancelled"
    assert admin.get(f"/v1/tasks/{child_id}").json()["state"] == "cancelled"


def test_a_cancel_heard_while_the_attempt_timeout_stops_the_handler_is_reported(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """As above, for a handler its attempt timeout stops: the runner reports nothing for
    a task that is not retry_safe, and a cancel heard while the handler cleaned up left
    the task `cancelling` until its lease ran out (the timeout and 5 s more). Now the
    cancel is reported as the handler ends, and the task is `cancelled` then."""
    node = nodes()
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=auth) as api:
        api.post("/v1/queues", json={"name": "q", "max_concurrency": 1, "rate": 0})
        spec = {"queue": "q", "handler": "h", "attempt_timeout": 0.5}
        task_id = api.post("/v1/tasks", json=spec).json()["task"]["id"]
        worker = Worker(node.http, tokens.worker, cancel_grace=30)
        stopping = threading.Event()
        heard = _heard_cancel(worker)
        seen: dict[str, Any] = {}

        @worker.handler("h")
        async def handler(ctx: Context, payload: Any) -> Any:
            try:
                await asyncio.Event().wait()  # until the attempt timeout cancels it
            except asyncio.CancelledError:
                seen["stopped by"] = ctx.reason
                stopping.set()
                await heard.wait()
                raise
            return "never"

        async def run() -> int:
            running = asyncio.create_task(worker.arun())
            assert await asyncio.to_thread(stopping.wait, 30)
            cancelled = await asyncio.to_thread(api.post, f"/v1/tasks/{task_id}/cancel")
            assert cancelled.json()["state"] == "cancelling", cancelled.text
            worker.stop()  # the drain waits for the attempt, whose handler is stopping
            return await asyncio.wait_for(running, 60)

        assert asyncio.run(run()) == 0
        assert seen["stopped by"] == "attempt timeout"
        task = api.get(f"/v1/tasks/{task_id}").json()
        assert task["state"] == "cancelled" and task["result"] is None, task


def test_the_other_bodiless_actions_refuse_a_body_too(admin: httpx.Client) -> None:
    """Pausing or resuming a queue or a schedule, revoking a token and draining a worker
    take no input either, and ignored whatever they were sent (``{"drain": false}`` to a
    pause paused all the same). Each refuses a field now, naming it, before anything is
    read or changed; no body, or ``{}``, is taken as before."""
    admin.post("/v1/queues", json={"name": "sq", "max_concurrency": 1, "rate": 0})
    schedule = {"name": "nightly", "cron": "0 3 * * *", "template": {"queue": "sq", "handler": "h"}}
    assert admin.post("/v1/schedules", json=schedule).status_code == 201
    token_id = admin.post("/v1/tokens", json={"name": "ops", "scopes": ["submit"]}).json()["id"]
    actions = (
        "/v1/queues/sq/pause",
        "/v1/queues/sq/resume",
        "/v1/schedules/nightly/pause",
        "/v1/schedules/nightly/resume",
        f"/v1/tokens/{token_id}/revoke",
        "/v1/workers/no-such-session/drain",  # refused before the session is looked up
    )
    for path in actions:
        refused = admin.post(path, content=b'{"now": true}')
        assert refused.status_code == 400, (path, refused.text)
        assert refused.json()["error"]["code"] == "UNKNOWN_FIELD", (path, refused.text)
        assert refused.json()["error"]["field"] == "now", (path, refused.text)
    [queue] = [q for q in admin.get("/v1/queues").json()["items"] if q["name"] == "sq"]
    assert queue["paused"] is False
    assert admin.get("/v1/schedules/nightly").json()["paused"] is False
    [token] = [t for t in admin.get("/v1/tokens").json()["items"] if t["id"] == token_id]
    assert token["revoked_at"] is None
    assert admin.post("/v1/queues/sq/pause", json={}).json()["paused"] is True
    assert admin.post("/v1/queues/sq/resume").json()["paused"] is False
    assert admin.post("/v1/schedules/nightly/pause").json()["paused"] is True
    assert admin.post(f"/v1/tokens/{token_id}/revoke", json={}).json()["revoked_at"]
    assert admin.post("/v1/workers/no-such-session/drain").status_code == 404


def test_a_schedules_delete_refuses_a_body_it_would_ignore(admin: httpx.Client) -> None:
    """``DELETE /v1/schedules/{name}`` takes no input, and deleted the schedule whatever it
    was sent (``{"dry_run": true}``, or no JSON at all): the one bodiless action the
    others' check had missed. A field is UNKNOWN_FIELD and text INVALID_JSON now, and the
    schedule stays; no body is taken as before."""
    admin.post("/v1/queues", json={"name": "sq", "max_concurrency": 1, "rate": 0})
    schedule = {"name": "keep", "cron": "0 3 * * *", "template": {"queue": "sq", "handler": "h"}}
    assert admin.post("/v1/schedules", json=schedule).status_code == 201
    for body, code in ((b'{"dry_run": true}', "UNKNOWN_FIELD"), (b"not json", "INVALID_JSON")):
        refused = admin.request("DELETE", "/v1/schedules/keep", content=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == code, refused.text
        assert admin.get("/v1/schedules/keep").status_code == 200
    assert admin.delete("/v1/schedules/keep").status_code == 200
    assert admin.get("/v1/schedules/keep").status_code == 404


def test_actions_refuse_a_query_parameter_they_would_ignore(admin: httpx.Client) -> None:
    """An action took any query parameter and ignored it: ``DELETE
    /v1/schedules/keep?dry_run=true`` deleted the schedule, ``POST /v1/tasks?dry_run=1``
    submitted the task, ``POST /v1/queues/q/pause?dry_run=true`` paused the queue, each
    answering as though the flag had been heard. Each is INVALID_ARGUMENT naming the
    parameter now, and nothing changes; the batch submit still takes its ``reply``."""
    admin.post("/v1/queues", json={"name": "sq", "max_concurrency": 1, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "sq", "handler": "h"}).json()["task"]["id"]
    schedule = {"name": "keep", "cron": "0 3 * * *", "template": {"queue": "sq", "handler": "h"}}
    assert admin.post("/v1/schedules", json=schedule).status_code == 201
    token_id = admin.post("/v1/tokens", json={"name": "ops", "scopes": ["submit"]}).json()["id"]
    tasks_before = admin.get("/v1/tasks").json()["items"]
    template = {"queue": "sq", "handler": "h"}
    actions: tuple[tuple[str, str, dict[str, object] | None], ...] = (
        ("POST", "/v1/queues", {"name": "q2", "max_concurrency": 1, "rate": 0}),
        ("PATCH", "/v1/queues/sq", {"max_concurrency": 5}),
        ("POST", "/v1/queues/sq/pause", None),
        ("POST", "/v1/queues/sq/resume", None),
        ("POST", "/v1/tasks", {"queue": "sq", "handler": "h"}),
        ("POST", "/v1/tasks/batch", {"tasks": [{"queue": "sq", "handler": "h"}]}),
        ("POST", f"/v1/tasks/{task_id}/cancel", None),
        ("POST", f"/v1/tasks/{task_id}/retry", None),
        ("POST", f"/v1/tasks/{task_id}/resolve", {"decision": "failed"}),
        ("POST", "/v1/schedules", {"name": "s2", "cron": "0 4 * * *", "template": template}),
        ("PATCH", "/v1/schedules/keep", {"cron": "0 5 * * *"}),
        ("POST", "/v1/schedules/keep/pause", None),
        ("DELETE", "/v1/schedules/keep", None),
        ("PUT", "/v1/limits/global", {"max_concurrency": 3}),
        ("PUT", "/v1/limits/tenants/t1", {"max_concurrency": 3}),
        ("POST", "/v1/tokens", {"name": "more", "scopes": ["submit"]}),
        ("POST", f"/v1/tokens/{token_id}/revoke", None),
        ("POST", "/v1/workers/no-such-session/drain", None),
    )
    for method, path, body in actions:
        refused = admin.request(method, path, json=body, params={"dry_run": "true"})
        assert refused.status_code == 400, (method, path, refused.text)
        error = refused.json()["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "dry_run"), (path, error)
        assert error["message"].startswith("dry_run: not a parameter of this action"), error
    # nothing changed
    assert [q["name"] for q in admin.get("/v1/queues").json()["items"]] == ["sq"]
    [queue] = admin.get("/v1/queues").json()["items"]
    assert (queue["max_concurrency"], queue["paused"]) == (1, False)
    assert admin.get("/v1/tasks").json()["items"] == tasks_before
    kept = admin.get("/v1/schedules/keep").json()
    assert (kept["cron"], kept["paused"]) == ("0 3 * * *", False)
    assert admin.get("/v1/schedules/s2").status_code == 404
    assert admin.get("/v1/limits/global").json()["max_concurrency"] is None
    assert admin.get("/v1/limits/tenants").json()["items"] == []
    tokens = admin.get("/v1/tokens").json()["items"]
    assert [t["name"] for t in tokens if t["name"] in ("ops", "more")] == ["ops"]
    assert all(t["revoked_at"] is None for t in tokens if t["id"] == token_id)
    # what an action does take is still taken
    ids = admin.post("/v1/tasks/batch", params={"reply": "ids"}, json={"tasks": [template]})
    assert ids.status_code == 201 and list(ids.json()[0]) == ["id", "created"], ids.text


def _heard_cancel(worker: Worker) -> asyncio.Event:
    """Set once ``worker``'s runner has taken a pushed ``cancel`` (after its own handling)."""
    heard = asyncio.Event()
    take_push = worker._on_push

    def on_push(msg: dict[str, Any]) -> None:
        take_push(msg)
        if msg.get("type") == "cancel":
            heard.set()

    worker._on_push = on_push  # type: ignore[method-assign]
    return heard


def test_the_bodiless_actions_take_an_empty_body_sent_chunked(admin: httpx.Client) -> None:
    """No body is taken, however it is sent: a client that streams its body sends an
    empty one as ``Transfer-Encoding: chunked`` with no bytes and no Content-Length, and
    the strict check read those no bytes as a document and refused them (400
    INVALID_JSON), where the action took them before it and its docs say no body is
    taken."""
    admin.post("/v1/queues", json={"name": "sq", "max_concurrency": 1, "rate": 0})
    task_id = admin.post("/v1/tasks", json={"queue": "sq", "handler": "h"}).json()["task"]["id"]
    schedule = {"name": "nightly", "cron": "0 3 * * *", "template": {"queue": "sq", "handler": "h"}}
    assert admin.post("/v1/schedules", json=schedule).status_code == 201
    token_id = admin.post("/v1/tokens", json={"name": "ops", "scopes": ["submit"]}).json()["id"]
    for path, field, value in (
        ("/v1/queues/sq/pause", "paused", True),
        ("/v1/queues/sq/resume", "paused", False),
        ("/v1/schedules/nightly/pause", "paused", True),
        ("/v1/schedules/nightly/resume", "paused", False),
        (f"/v1/tasks/{task_id}/cancel", "state", "cancelled"),
        (f"/v1/tasks/{task_id}/retry", "state", "queued"),
    ):
        reply = admin.post(path, content=iter([]))  # chunked, no bytes
        assert reply.request.headers.get("transfer-encoding") == "chunked", path
        assert reply.status_code == 200, (path, reply.text)
        assert reply.json()[field] == value, (path, reply.text)
    revoked = admin.post(f"/v1/tokens/{token_id}/revoke", content=iter([]))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"], revoked.text
    drained = admin.post("/v1/workers/no-such-session/drain", content=iter([]))
    assert drained.status_code == 404, drained.text  # read past the body to the lookup
    # a chunked body that has a field is still refused
    refused = admin.post("/v1/queues/sq/pause", content=iter([b'{"now": ', b"true}"]))
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "now", refused.text
