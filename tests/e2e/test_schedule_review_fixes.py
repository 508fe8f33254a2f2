"""The schedule review's fixes against real servers: a change body that sends ``name``
or ``paused`` is told where they change (not "set by the server"); an empty or
over-long cron or time zone is INVALID_CRON or INVALID_TIMEZONE, as any other bad text
is, over HTTP and from the CLI; and the OpenAPI document lists the 413 the schedule
writes answer and no 422, which this server never sends."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.servers import Node, Tokens
from tests.e2e.test_cli import Run, cluster, ok, orbit  # noqa: F401 (fixtures)

SERVER_SET = "{} is set by the server, never sent"


def _answer(reply: httpx.Response) -> tuple[int, str | None, str | None, str | None]:
    error = reply.json().get("error") or {}
    return reply.status_code, error.get("code"), error.get("field"), error.get("message")


def _schedule(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "nightly",
        "cron": "0 3 * * *",
        "timezone": "Europe/Berlin",
        "template": {"queue": "sq", "handler": "h"},
    }
    return body | kw


def _events(admin: httpx.Client) -> int:
    return len(admin.get("/v1/events", params={"limit": 1000}).json()["items"])


def _setup(admin: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    queue = admin.post("/v1/queues", json={"name": "sq", "max_concurrency": 1, "rate": 0})
    assert queue.status_code == 201, queue.text
    schedule = admin.post("/v1/schedules", json=_schedule())
    assert schedule.status_code == 201, schedule.text
    return queue.json(), schedule.json()


CHANGE_REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "/v1/schedules/nightly",
        {"paused": True},
        "paused",
        "an update cannot change paused: use POST /v1/schedules/{name}/pause or /resume",
    ),
    (
        "/v1/schedules/nightly",
        {"name": "y"},
        "name",
        "an update cannot change name: it is the URL's (/v1/schedules/{name})",
    ),
    # the body is decoded before the schedule is looked up
    (
        "/v1/schedules/x",
        {"paused": True},
        "paused",
        "an update cannot change paused: use POST /v1/schedules/{name}/pause or /resume",
    ),
    (
        "/v1/schedules/nightly",
        {"next_fire_at": "2030-01-01T00:00:00Z"},
        "next_fire_at",
        SERVER_SET.format("next_fire_at"),
    ),
    (
        "/v1/queues/sq",
        {"paused": True},
        "paused",
        "an update cannot change paused: use POST /v1/queues/{name}/pause or /resume",
    ),
    (
        "/v1/queues/sq",
        {"name": "y", "rate": 1},
        "name",
        "an update cannot change name: it is the URL's (/v1/queues/{name})",
    ),
    (
        "/v1/queues/sq",
        {"created_at": "2030-01-01T00:00:00Z"},
        "created_at",
        SERVER_SET.format("created_at"),
    ),
]


def test_a_change_body_sending_name_or_paused_is_told_where_each_changes(
    admin: httpx.Client,
) -> None:
    """``name`` and ``paused`` in a ``PATCH`` of a schedule or a queue were refused as
    "set by the server, never sent": untrue of a name the URL gives and of a flag the
    client sets at create (a schedule's) and changes by pause and resume. The code is
    the same (RESPONSE_ONLY_FIELD), the message says where each changes; a field the
    server does set keeps the generic message. Nothing is changed or written."""
    queue, schedule = _setup(admin)
    before = _events(admin)
    wrong = []
    for path, body, field, message in CHANGE_REFUSED:
        got = _answer(admin.patch(path, json=body))
        if got != (400, "RESPONSE_ONLY_FIELD", field, message):
            wrong.append((path, body, got))
    created_paused = admin.post(
        "/v1/queues", json={"name": "p", "max_concurrency": 1, "rate": 0, "paused": True}
    )
    if _answer(created_paused) != (
        400,
        "RESPONSE_ONLY_FIELD",
        "paused",
        "a queue is created running: pause it with POST /v1/queues/{name}/pause",
    ):
        wrong.append(("/v1/queues", {"paused": True}, _answer(created_paused)))
    assert wrong == []
    assert admin.get("/v1/schedules/nightly").json() == schedule
    assert admin.get("/v1/queues").json()["items"] == [queue]
    assert _events(admin) == before


#: over the bounds by one: 201 characters of cron, 65 of time zone
LONG_CRON = " " * 192 + "0 3 * * *"
LONG_ZONE = "Europe/" + "B" * 58

BAD_TEXT: list[tuple[dict[str, Any], str, str, str]] = [
    ({"cron": ""}, "INVALID_CRON", "cron", "it must be 1-200 characters"),
    ({"cron": "   "}, "INVALID_CRON", "cron", "it must be 1-200 characters"),
    ({"cron": LONG_CRON}, "INVALID_CRON", "cron", "it is 201 characters, over 200"),
    ({"cron": "0 " * 1000}, "INVALID_CRON", "cron", "it is 2000 characters, over 200"),
    ({"timezone": ""}, "INVALID_TIMEZONE", "timezone", "is not an IANA time zone"),
    ({"timezone": LONG_ZONE}, "INVALID_TIMEZONE", "timezone", "is 65 characters, over 64"),
]


@pytest.mark.parametrize("method", ["create", "update"])
def test_an_empty_or_over_long_cron_or_timezone_is_invalid_cron_or_timezone(
    admin: httpx.Client, method: str
) -> None:
    """An empty or too long ``cron`` or ``timezone`` was INVALID_VALUE or
    VALUE_TOO_LONG (the HTTP model's length limits), where the docs promise
    INVALID_CRON and INVALID_TIMEZONE for bad text: now those, with the field and a
    message giving the bound, at create and at update. Nothing is written; 200
    characters of cron are still taken."""
    assert len(LONG_CRON) == 201 and len(LONG_ZONE) == 65
    _, schedule = _setup(admin)
    before = _events(admin)
    wrong = []
    for body, code, field, why in BAD_TEXT:
        if method == "create":
            reply = admin.post("/v1/schedules", json=_schedule(name="other", **body))
        else:
            reply = admin.patch("/v1/schedules/nightly", json=body)
        status, got_code, got_field, message = _answer(reply)
        if (status, got_code, got_field) != (400, code, field) or why not in str(message):
            wrong.append((repr(body)[:60], status, got_code, got_field, message))
    assert wrong == []
    assert [s["name"] for s in admin.get("/v1/schedules").json()["items"]] == ["nightly"]
    assert admin.get("/v1/schedules/nightly").json() == schedule
    assert _events(admin) == before
    longest = LONG_CRON[1:]
    if method == "create":
        taken = admin.post("/v1/schedules", json=_schedule(name="other", cron=longest))
        assert taken.status_code == 201, taken.text
    else:
        taken = admin.patch("/v1/schedules/nightly", json={"cron": longest, "timezone": "UTC"})
        assert taken.status_code == 200, taken.text
    assert taken.json()["cron"] == "0 3 * * *"


def test_the_cli_shows_invalid_cron_and_timezone_for_empty_or_over_long_text(
    orbit: Run,  # noqa: F811
) -> None:
    """``orbit schedule create|update`` with an empty or over-long ``--cron`` or
    ``--timezone`` ends 3 with the server's code on stderr; nothing is made or changed."""
    ok(orbit("queue", "create", "fix-q", "--max-concurrency", "1", "--rate", "0"))
    common = ("--queue", "fix-q", "--handler", "h")
    ok(orbit("schedule", "create", "kept", "--cron", "0 3 * * *", *common))
    kept = ok(orbit("schedule", "show", "kept", "--json"))
    for option, value, code in [
        ("--cron", "", "INVALID_CRON"),
        ("--cron", LONG_CRON, "INVALID_CRON"),
        ("--timezone", "", "INVALID_TIMEZONE"),
        ("--timezone", LONG_ZONE, "INVALID_TIMEZONE"),
    ]:
        cron = () if option == "--cron" else ("--cron", "0 3 * * *")
        made = orbit("schedule", "create", "e1", *cron, option, value, *common)
        assert made.returncode == 3 and code in made.stderr, (option, value, made.stderr)
        changed = orbit("schedule", "update", "kept", option, value)
        assert changed.returncode == 3 and code in changed.stderr, (option, value, changed.stderr)
    assert "e1" not in ok(orbit("schedule", "ls"))
    assert ok(orbit("schedule", "show", "kept", "--json")) == kept


def test_the_openapi_document_lists_413_on_schedule_writes_and_no_422(
    node: Node, tokens: Tokens
) -> None:
    """The schedule create and update answer 413 (PAYLOAD_TOO_LARGE) for a template's
    payload over the store's bound, which their OpenAPI description left out; and
    FastAPI's default 422, on every route with a parameter, is never sent (a bad
    parameter is 400 INVALID_ARGUMENT): it is gone, with the schemas only it used, and
    every reference left resolves."""
    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as admin:
        document = admin.get("/openapi.json").json()
        _setup(admin)
        huge = {"queue": "sq", "handler": "h", "payload": "x" * (2 << 20)}
        created = admin.post("/v1/schedules", json=_schedule(name="big", template=huge))
        updated = admin.patch("/v1/schedules/nightly", json={"template": huge})
        bad_limit = admin.get("/v1/schedules", params={"limit": 0})
    for reply in (created, updated):
        assert _answer(reply)[:3] == (413, "PAYLOAD_TOO_LARGE", "template"), reply.text
    assert _answer(bad_limit)[:3] == (400, "INVALID_ARGUMENT", "limit"), bad_limit.text

    listed = {
        (method.upper(), path): set(operation.get("responses", {}))
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    assert [route for route, codes in listed.items() if "422" in codes] == []
    assert "413" in listed[("POST", "/v1/schedules")]
    assert "413" in listed[("PATCH", "/v1/schedules/{name}")]
    for route in (("POST", "/v1/schedules"), ("PATCH", "/v1/schedules/{name}")):
        path = document["paths"][route[1]][route[0].lower()]
        schema = path["responses"]["413"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorReply"}
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    refs: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            refs.extend(v for k, v in value.items() if k == "$ref")
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(document)
    prefix = "#/components/schemas/"
    assert refs and all(r.startswith(prefix) and r[len(prefix) :] in schemas for r in refs)
