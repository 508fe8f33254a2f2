"""Schedules over HTTP on both backends (``/v1/schedules``): create, read, list a page
at a time, pause, resume, delete; every refusal with its code and field, nothing
written; and a fire due while the cluster was down made by the next server to start."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from orbit import AsyncClient, Client
from orbit.client import BadRequest, NotFound
from orbit.core.cron import to_us
from orbit.store import open_store
from tests.conftest import ManualClock
from tests.e2e.servers import Node, Tokens

YEAR_US = 366 * 24 * 3600 * 1_000_000


def _schedule(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "nightly",
        "cron": "0 3 * * *",
        "timezone": "Europe/Berlin",
        "template": {"queue": "sq", "handler": "h", "payload": {"a": 1}},
    }
    body.update(kw)
    return body


def _queue(admin: httpx.Client) -> None:
    made = admin.post("/v1/queues", json={"name": "sq", "max_concurrency": 1, "rate": 0})
    assert made.status_code == 201, made.text


def _events(admin: httpx.Client) -> int:
    return len(admin.get("/v1/events", params={"limit": 1000}).json()["items"])


def test_create_read_list_pause_resume_delete(admin: httpx.Client, tokens: Tokens) -> None:
    _queue(admin)
    made = admin.post(
        "/v1/schedules",
        json=_schedule(
            misfire="catch_up",
            max_catch_up=5,
            template={
                "queue": "sq",
                "handler": "h",
                "payload": {"a": 1},
                "priority": 3,
                "max_attempts": 2,
                "backoff": {"base": 2, "factor": 3, "max": 60},
                "attempt_timeout": 30,
            },
        ),
    )
    assert made.status_code == 201, made.text
    view = made.json()
    assert view["name"] == "nightly" and view["timezone"] == "Europe/Berlin"
    # 03:00 in Berlin: 02:00 UTC in winter, 01:00 in summer
    assert view["next_fire_at"][10:] in ("T02:00:00.000000Z", "T01:00:00.000000Z")
    assert view["template"]["backoff"] == {"base": 2.0, "factor": 3.0, "max": 60.0}
    assert (view["misfire"], view["max_catch_up"], view["paused"]) == ("catch_up", 5, False)
    assert admin.get("/v1/schedules/nightly").json() == view

    for name in ("b", "c"):
        assert admin.post("/v1/schedules", json=_schedule(name=name)).status_code == 201
    first = admin.get("/v1/schedules", params={"limit": 2}).json()
    assert [s["name"] for s in first["items"]] == ["b", "c"]
    rest = admin.get("/v1/schedules", params={"limit": 2, "cursor": first["next_cursor"]})
    assert [s["name"] for s in rest.json()["items"]] == ["nightly"]
    assert rest.json()["next_cursor"] is None

    paused = admin.post("/v1/schedules/nightly/pause")
    assert paused.status_code == 200 and paused.json()["paused"] is True
    resumed = admin.post("/v1/schedules/nightly/resume")
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    gone = admin.delete("/v1/schedules/nightly")
    assert gone.status_code == 200 and gone.json()["name"] == "nightly"
    missing = admin.get("/v1/schedules/nightly")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "SCHEDULE_NOT_FOUND"
    for path in ("/v1/schedules/nightly/pause", "/v1/schedules/nightly/resume"):
        assert admin.post(path).json()["error"]["code"] == "SCHEDULE_NOT_FOUND"
    assert admin.delete("/v1/schedules/nightly").status_code == 404


def test_writes_need_the_admin_scope(node: Node, tokens: Tokens, admin: httpx.Client) -> None:
    _queue(admin)
    with httpx.Client(
        base_url=node.http, headers={"Authorization": f"Bearer {tokens.submit}"}
    ) as submitter:
        assert submitter.post("/v1/schedules", json=_schedule()).status_code == 403
        assert admin.post("/v1/schedules", json=_schedule()).status_code == 201
        assert submitter.get("/v1/schedules/nightly").status_code == 200
        assert submitter.post("/v1/schedules/nightly/pause").status_code == 403
        assert submitter.delete("/v1/schedules/nightly").status_code == 403


REFUSED: list[tuple[dict[str, Any], int, str, str | None]] = [
    ({"cron": "* * * *"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "0 0 30 2 *"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "@daily"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "0 0 L * *"}, 400, "INVALID_CRON", "cron"),  # croniter's, not cron's
    ({"cron": "0 0 * * 5#2"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "*/60 * * * *"}, 400, "INVALID_CRON", "cron"),
    ({"timezone": "Mars/Olympus"}, 400, "INVALID_TIMEZONE", "timezone"),
    # a directory of the zone database: tzdata opens it (IsADirectoryError), no 500
    ({"timezone": "America/Argentina"}, 400, "INVALID_TIMEZONE", "timezone"),
    ({"misfire": "later"}, 400, "INVALID_VALUE", "misfire"),
    ({"max_catch_up": 0}, 400, "NUMBER_OUT_OF_RANGE", "max_catch_up"),
    ({"max_catch_up": 1001}, 400, "NUMBER_OUT_OF_RANGE", "max_catch_up"),
    ({"name": "bad name"}, 400, "INVALID_VALUE", "name"),
    ({"template": {"queue": "sq"}}, 400, "MISSING_FIELD", "template.handler"),
    (
        {"template": {"queue": "sq", "handler": "h", "idempotency_key": "k"}},
        400,
        "RESPONSE_ONLY_FIELD",
        "template.idempotency_key",
    ),
    (
        {"template": {"queue": "sq", "handler": "h", "max_attempts": 0}},
        400,
        "NUMBER_OUT_OF_RANGE",
        "template.max_attempts",
    ),
    (
        {"template": {"queue": "sq", "handler": "h", "run_after": "2030-01-01T00:00:00Z"}},
        400,
        "UNKNOWN_FIELD",
        "template.run_after",
    ),
    ({"template": {"queue": "nope", "handler": "h"}}, 404, "QUEUE_NOT_FOUND", "template.queue"),
    (
        {"template": {"queue": "sq", "handler": "h", "payload": "x" * (2 << 20)}},
        413,
        "PAYLOAD_TOO_LARGE",
        "template",
    ),
    ({"timezone": "Europe/../UTC"}, 400, "INVALID_TIMEZONE", "timezone"),
]


def _answer(reply: httpx.Response) -> tuple[int, str | None, str | None]:
    """A reply's status, error code and field, to compare with a table's row."""
    error = reply.json().get("error") or {}
    return reply.status_code, error.get("code"), error.get("field")


def test_every_refusal_says_why_and_writes_nothing(admin: httpx.Client) -> None:
    """Every row of REFUSED against one node: a refusal writes nothing, so each row
    meets the same database (a node per row cost the suite minutes of server starts).
    Every row is checked, and every wrong one reported."""
    _queue(admin)
    wrong = []
    for change, status, code, field in REFUSED:
        before = _events(admin)
        got = _answer(admin.post("/v1/schedules", json=_schedule(**change)))
        if got != (status, code, field):
            wrong.append((repr(change)[:80], got))
        if admin.get("/v1/schedules").json()["items"] != []:
            wrong.append((repr(change)[:80], "a schedule was written"))
        if _events(admin) != before:
            wrong.append((repr(change)[:80], "an event was written"))
    assert wrong == []


def test_a_submit_may_not_take_a_schedules_key(
    node: Node, tokens: Tokens, admin: httpx.Client
) -> None:
    """A fire's idempotency key (``schedule:<name>:<created_at>:<instant>``) is documented
    and its parts are readable with the submit scope, and a fire takes a task it finds
    under its key as its own. So a submit (with only the submit scope) could have the
    next fire take its task, whatever its handler, or refuse the fire at every pass with
    another payload. A key starting ``schedule:`` is refused (400, on the single and the
    batch route), and nothing is written."""
    _queue(admin)
    assert admin.post("/v1/schedules", json=_schedule()).status_code == 201
    view = admin.get("/v1/schedules/nightly").json()
    created = to_us(datetime.fromisoformat(view["created_at"]))
    instant = to_us(datetime.fromisoformat(view["next_fire_at"]))
    key = f"schedule:nightly:{created}:{instant}"
    task = {"queue": "sq", "handler": "evil.handler", "payload": {"a": 1}, "idempotency_key": key}
    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.submit}"}
    ) as submitter:
        before = _events(admin)
        for path, body, field in (
            ("/v1/tasks", task, "idempotency_key"),
            ("/v1/tasks/batch", {"tasks": [task]}, "tasks[0].idempotency_key"),  # names the task
        ):
            refused = submitter.post(path, json=body)
            assert refused.status_code == 400, (path, refused.text)
            error = refused.json()["error"]
            assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", field), error
        assert _events(admin) == before  # nothing written
        assert admin.get("/v1/tasks", params={"queue": "sq"}).json()["items"] == []


def test_a_taken_name_is_409(admin: httpx.Client) -> None:
    _queue(admin)
    assert admin.post("/v1/schedules", json=_schedule()).status_code == 201
    before = _events(admin)
    again = admin.post("/v1/schedules", json=_schedule(cron="0 4 * * *"))
    assert again.status_code == 409 and again.json()["error"]["code"] == "SCHEDULE_EXISTS"
    assert admin.get("/v1/schedules/nightly").json()["cron"] == "0 3 * * *"
    assert _events(admin) == before


def _await_tasks(admin: httpx.Client, n: int) -> list[dict[str, Any]]:
    """The queue's tasks once it holds ``n`` (a bound on the wait, not a timing)."""
    end = time.monotonic() + 60
    while True:
        items = admin.get("/v1/tasks", params={"queue": "sq", "limit": 100}).json()["items"]
        if len(items) >= n:
            return list(items)
        assert time.monotonic() < end, f"{len(items)} of {n} tasks made"
        time.sleep(0.05)


def test_a_fire_due_while_the_cluster_was_down_is_made_after_a_restart(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """A yearly schedule whose last three instants passed while no server ran (its
    next_fire_at set three years back through the store): the next server to start
    fires the latest two (catch_up, max_catch_up 2), once each."""
    first = nodes()
    with httpx.Client(
        base_url=first.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as admin:
        _queue(admin)
        body = _schedule(cron="0 0 1 1 *", timezone="UTC", misfire="catch_up", max_catch_up=2)
        assert admin.post("/v1/schedules", json=body).status_code == 201
    first.kill()
    # While the cluster is down: the schedule resumed three years ago, as far as its
    # row says (the store's clock set back), so its next fire is long past.
    now = to_us(datetime.now(UTC))
    past = open_store(db_url, clock=ManualClock(now - 3 * YEAR_US))
    try:
        past.schedule_pause("nightly")
        past.schedule_resume("nightly")
        assert past.schedule_get("nightly").next_fire_at < now - YEAR_US
    finally:
        past.close()

    second = nodes(node_id="node-b")
    with httpx.Client(
        base_url=second.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as admin:
        tasks = _await_tasks(admin, 2)
        year = datetime.now(UTC).year
        instants = [to_us(datetime(y, 1, 1, tzinfo=UTC)) for y in (year - 1, year)]
        keys = sorted(t["idempotency_key"] for t in tasks)
        assert [int(k.rsplit(":", 1)[1]) for k in keys] == instants
        assert all(t["payload"] == {"a": 1} for t in tasks)
        view = admin.get("/v1/schedules/nightly").json()
        assert view["last_fire_at"] == f"{year}-01-01T00:00:00.000000Z"
        assert view["next_fire_at"] == f"{year + 1}-01-01T00:00:00.000000Z"
        assert len(_await_tasks(admin, 2)) == 2  # and no more


def test_the_clients(node: Node, tokens: Tokens, admin: httpx.Client) -> None:
    _queue(admin)
    with Client(node.http, tokens.admin) as c:
        made = c.schedule_create(
            "a", cron="*/5 * * * *", queue="sq", handler="h", payload=[1], priority=4
        )
        assert made["template"]["priority"] == 4 and made["timezone"] == "UTC"
        c.schedule_create("b", cron="0 * * * *", queue="sq", handler="h", misfire="run_once")
        assert c.schedule("b")["misfire"] == "run_once"
        assert [s["name"] for s in c.iter_schedules(limit=1)] == ["a", "b"]
        assert c.list_schedules(limit=1)["next_cursor"] is not None
        assert c.schedule_pause("a")["paused"] is True
        assert c.schedule_resume("a")["paused"] is False
        with pytest.raises(BadRequest) as bad:
            c.schedule_create("c", cron="0 0 30 2 *", queue="sq", handler="h")
        assert bad.value.code == "INVALID_CRON"
        assert c.schedule_delete("b")["name"] == "b"
        with pytest.raises(NotFound):
            c.schedule("b")

    async def go() -> None:
        async with AsyncClient(node.http, tokens.admin) as ac:
            await ac.schedule_create("c", cron="0 0 * * 0", queue="sq", handler="h")
            assert [s["name"] async for s in ac.iter_schedules(limit=1)] == ["a", "c"]
            assert (await ac.schedules())[1]["cron"] == "0 0 * * 0"
            assert (await ac.schedule_pause("c"))["paused"] is True
            assert (await ac.schedule_resume("c"))["paused"] is False
            assert (await ac.schedule("c"))["name"] == "c"
            assert (await ac.list_schedules(limit=1))["items"][0]["name"] == "a"
            await ac.schedule_delete("c")
            with pytest.raises(NotFound):
                await ac.schedule_delete("c")

    asyncio.run(go())


def test_two_nodes_fire_each_instant_once(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """Two PostgreSQL nodes whose duties look every 50 ms, five yearly schedules each
    three instants behind (catch_up): fifteen tasks and fifteen ``schedule.fired``
    events, one of each per instant, whichever node fired it."""
    if not db_url.startswith("postgresql"):
        pytest.skip("one SQLite database has one server")
    fast = ["--schedule-interval", "0.05"]
    a, _ = nodes(args=fast), nodes(node_id="node-b", args=fast)
    with httpx.Client(
        base_url=a.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as admin:
        _queue(admin)
        names = [f"y{i}" for i in range(5)]
        for name in names:
            body = _schedule(
                name=name, cron="0 0 1 1 *", timezone="UTC", misfire="catch_up", max_catch_up=3
            )
            assert admin.post("/v1/schedules", json=body).status_code == 201
        # Set every schedule ten years back at once (pause, then resume under a clock
        # that far back), while both nodes' duties run.
        past = open_store(db_url, clock=ManualClock(to_us(datetime.now(UTC)) - 10 * YEAR_US))
        try:
            for name in names:
                past.schedule_pause(name)
            for name in names:
                past.schedule_resume(name)
        finally:
            past.close()
        tasks = _await_tasks(admin, 15)
        keys = [t["idempotency_key"] for t in tasks]
        assert len(keys) == len(set(keys)) == 15
        year = datetime.now(UTC).year
        for name in names:
            view = admin.get(f"/v1/schedules/{name}").json()
            assert view["next_fire_at"] == f"{year + 1}-01-01T00:00:00.000000Z"
        events = admin.get("/v1/events", params={"limit": 1000}).json()["items"]
        assert sum(e["kind"] == "schedule.fired" for e in events) == 15
        assert len(_await_tasks(admin, 15)) == 15


# ----------------------------------------------------------------------------- update


def test_update_changes_only_what_is_given(admin: httpx.Client, tokens: Tokens) -> None:
    _queue(admin)
    made = admin.post("/v1/schedules", json=_schedule()).json()
    changed = admin.patch(
        "/v1/schedules/nightly",
        json={"misfire": "run_once", "template": {"queue": "sq", "handler": "h2", "priority": 7}},
    )
    assert changed.status_code == 200, changed.text
    view = changed.json()
    assert (view["misfire"], view["cron"], view["timezone"]) == (
        "run_once",
        "0 3 * * *",
        made["timezone"],
    )
    # the template is replaced whole: its payload left out is the default (null)
    assert (view["template"]["handler"], view["template"]["priority"]) == ("h2", 7)
    assert view["template"]["payload"] is None
    assert view["next_fire_at"] == made["next_fire_at"]  # neither cron nor zone changed
    moved = admin.patch("/v1/schedules/nightly", json={"cron": "0 4 * * *", "timezone": "UTC"})
    assert moved.json()["next_fire_at"][10:] == "T04:00:00.000000Z"
    events = admin.get("/v1/events", params={"limit": 1000}).json()["items"]
    assert [e["kind"] for e in events if e["kind"] == "schedule.updated"] == [
        "schedule.updated"
    ] * 2
    with httpx.Client(
        base_url=str(admin.base_url), headers={"Authorization": f"Bearer {tokens.submit}"}
    ) as submitter:
        assert (
            submitter.patch("/v1/schedules/nightly", json={"cron": "0 5 * * *"}).status_code == 403
        )
    assert admin.get("/v1/schedules/nightly").json()["cron"] == "0 4 * * *"


UPDATE_REFUSED: list[tuple[Any, int, str, str | None]] = [
    ({}, 400, "MISSING_FIELD", None),
    ({"cron": None}, 400, "NULL_NOT_ALLOWED", "cron"),
    ({"template": None}, 400, "NULL_NOT_ALLOWED", "template"),
    ({"name": "other"}, 400, "RESPONSE_ONLY_FIELD", "name"),
    ({"paused": True}, 400, "RESPONSE_ONLY_FIELD", "paused"),
    ({"next_fire_at": "2030-01-01T00:00:00Z"}, 400, "RESPONSE_ONLY_FIELD", "next_fire_at"),
    ({"Cron": "0 4 * * *"}, 400, "FIELD_CASE_MISMATCH", "Cron"),
    ({"cron": "* * * *"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "0 0 30 2 *"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "0 0 15W * *"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "0 0 * * fri-mon"}, 400, "INVALID_CRON", "cron"),
    ({"cron": "0 0 * * *\u0000"}, 400, "NUL_CHARACTER", "cron"),
    ({"cron": "0 " * 150}, 400, "INVALID_CRON", "cron"),
    ({"timezone": "../etc/passwd"}, 400, "INVALID_TIMEZONE", "timezone"),
    ({"timezone": ""}, 400, "INVALID_TIMEZONE", "timezone"),
    ({"misfire": "later"}, 400, "INVALID_VALUE", "misfire"),
    ({"max_catch_up": 0}, 400, "NUMBER_OUT_OF_RANGE", "max_catch_up"),
    ({"max_catch_up": True}, 400, "INVALID_TYPE", "max_catch_up"),
    ({"template": {"queue": "sq"}}, 400, "MISSING_FIELD", "template.handler"),
    (
        {"template": {"queue": "sq", "handler": "h", "idempotency_key": "k"}},
        400,
        "RESPONSE_ONLY_FIELD",
        "template.idempotency_key",
    ),
    (
        {"template": {"queue": "sq", "handler": "h", "deadline": "2030-01-01T00:00:00Z"}},
        400,
        "UNKNOWN_FIELD",
        "template.deadline",
    ),
    ({"template": {"queue": "nope", "handler": "h"}}, 404, "QUEUE_NOT_FOUND", "template.queue"),
    (
        {"template": {"queue": "sq", "handler": "h", "payload": "x" * (2 << 20)}},
        413,
        "PAYLOAD_TOO_LARGE",
        "template",
    ),
]


def test_every_update_refusal_says_why_and_writes_nothing(admin: httpx.Client) -> None:
    """Every row of UPDATE_REFUSED against one node and one schedule, which no refusal
    may change (as ``test_every_refusal_says_why_and_writes_nothing``)."""
    _queue(admin)
    made = admin.post("/v1/schedules", json=_schedule()).json()
    wrong = []
    for body, status, code, field in UPDATE_REFUSED:
        before = _events(admin)
        got = _answer(admin.patch("/v1/schedules/nightly", json=body))
        if got != (status, code, field):
            wrong.append((repr(body)[:80], got))
        if admin.get("/v1/schedules/nightly").json() != made:
            wrong.append((repr(body)[:80], "the schedule changed"))
        if _events(admin) != before:
            wrong.append((repr(body)[:80], "an event was written"))
    assert wrong == []


def test_update_of_a_missing_schedule_is_404(admin: httpx.Client) -> None:
    _queue(admin)
    before = _events(admin)
    reply = admin.patch("/v1/schedules/nope", json={"cron": "0 4 * * *"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "SCHEDULE_NOT_FOUND"
    assert _events(admin) == before


def test_update_through_the_clients(node: Node, tokens: Tokens, admin: httpx.Client) -> None:
    _queue(admin)
    with Client(node.http, tokens.admin) as c:
        c.schedule_create("a", cron="*/5 * * * *", queue="sq", handler="h", payload=[1])
        u = c.schedule_update(
            "a", template={"queue": "sq", "handler": "h", "payload": [2], "tenant": "t"}
        )
        assert (u["template"]["payload"], u["template"]["tenant"]) == ([2], "t")
        assert c.schedule_update("a", max_catch_up=3, misfire="catch_up")["max_catch_up"] == 3
        with pytest.raises(BadRequest) as bad:
            c.schedule_update("a")
        assert bad.value.code == "MISSING_FIELD"
        with pytest.raises(NotFound):
            c.schedule_update("b", cron="0 * * * *")

    async def go() -> None:
        async with AsyncClient(node.http, tokens.admin) as ac:
            u = await ac.schedule_update("a", cron="0 * * * *", timezone="Asia/Kolkata")
            assert (u["cron"], u["timezone"]) == ("0 * * * *", "Asia/Kolkata")
            assert u["next_fire_at"][13:] == ":30:00.000000Z"  # UTC+05:30

    asyncio.run(go())
