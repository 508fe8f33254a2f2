"""A refused submit's HTTP answer, through a real server on both backends: a batch's
refusal names its task (``field`` ``tasks[<index>].<field>``, leading the message too)
whichever way the batch is read (the one-pass reader's chunks, or the strict decoder),
a single submit's names its field, and an idempotency key reused for another handler
is a 409, not the other task. Nothing is written by any of them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

#: (the bad task's fields, the status, the code, the field it is refused for)
BAD: list[tuple[dict[str, Any], int, str, str]] = [
    ({"backoff": {"base": 10, "max": 5}}, 400, "INVALID_BACKOFF", "backoff.max"),
    ({"attempt_timeout": 1e-9}, 400, "INVALID_TIMEOUT", "attempt_timeout"),
    ({"deadline": "2020-01-01T00:00:00Z"}, 400, "INVALID_DEADLINE", "deadline"),
    (
        {"run_after": "2099-01-02T00:00:00Z", "deadline": "2099-01-01T00:00:00Z"},
        400,
        "INVALID_DEADLINE",
        "run_after",
    ),
    ({"payload": "x" * 300_000}, 413, "PAYLOAD_TOO_LARGE", "payload"),  # the reader's shape
    ({"parent_id": "nope"}, 404, "PARENT_NOT_FOUND", "parent_id"),  # the reader's shape
]


def _nothing_written(admin: httpx.Client) -> bool:
    return admin.get("/v1/tasks").json()["items"] == []


@pytest.mark.parametrize("size", [3, 438])  # one chunk, and several (read inside the write)
def test_a_refused_batch_names_its_task(admin: httpx.Client, size: int) -> None:
    assert admin.post("/v1/queues", json={"name": "v", "max_concurrency": 5, "rate": 0}).is_success
    wrong = []
    for bad, status, code, field in BAD:
        tasks: list[dict[str, Any]] = [{"queue": "v", "handler": "x"} for _ in range(size)]
        tasks[-1].update(bad)
        body = json.dumps({"tasks": tasks}, separators=(",", ":"))  # the reader's spelling
        reply = admin.post(
            "/v1/tasks/batch?reply=ids",
            content=body,
            headers={"content-type": "application/json"},
        )
        error = reply.json().get("error") or {}
        where = f"tasks[{size - 1}].{field}"
        got = (reply.status_code, error.get("code"), error.get("field"))
        if got != (status, code, where) or not error["message"].startswith(f"{where}: "):
            wrong.append((bad, reply.text[:200]))
        if not _nothing_written(admin):
            wrong.append((bad, "a task was written"))
    assert wrong == []


def test_a_single_submit_names_its_field(admin: httpx.Client) -> None:
    assert admin.post("/v1/queues", json={"name": "v", "max_concurrency": 5, "rate": 0}).is_success
    wrong = []
    for bad, status, code, field in [*BAD, ({"queue": "nope"}, 404, "QUEUE_NOT_FOUND", "queue")]:
        reply = admin.post("/v1/tasks", json={"queue": "v", "handler": "x", **bad})
        error = reply.json().get("error") or {}
        if (reply.status_code, error.get("code"), error.get("field")) != (status, code, field):
            wrong.append((bad, reply.text[:200]))
        if not _nothing_written(admin):
            wrong.append((bad, "a task was written"))
    assert wrong == []


def test_a_key_reused_for_another_handler_is_a_conflict(admin: httpx.Client) -> None:
    """The reviewer's case: the same key and payload with another handler answered 200
    ``created: false`` with the first handler's task, and the second job was lost."""
    assert admin.post("/v1/queues", json={"name": "v", "max_concurrency": 5, "rate": 0}).is_success
    first = admin.post(
        "/v1/tasks", json={"queue": "v", "handler": "x", "idempotency_key": "f2", "payload": 1}
    )
    assert first.status_code == 201, first.text
    tid = first.json()["task"]["id"]
    other = {"queue": "v", "handler": "y", "idempotency_key": "f2", "payload": 1}
    events = admin.get("/v1/events").json()["items"]
    for path, body, field in (
        ("/v1/tasks", other, "idempotency_key"),
        ("/v1/tasks/batch", {"tasks": [{"queue": "v", "handler": "x"}, other]}, None),
    ):
        reply = admin.post(path, json=body)
        assert reply.status_code == 409, reply.text
        error = reply.json()["error"]
        assert error["code"] == "IDEMPOTENCY_CONFLICT", error
        assert error["field"] == (field or "tasks[1].idempotency_key"), error
        assert f"already names task {tid}, submitted with handler 'x', not 'y'" in error["message"]
    assert [t["id"] for t in admin.get("/v1/tasks").json()["items"]] == [tid]
    assert admin.get("/v1/events").json()["items"] == events  # nothing written
    # a retry that computes its options afresh (priority, a deadline) is the same task
    again = {**other, "handler": "x", "priority": 9, "deadline": "2099-01-01T00:00:00Z"}
    same = admin.post("/v1/tasks", json=again)
    assert same.status_code == 200 and same.json()["created"] is False, same.text
    assert same.json()["task"]["id"] == tid and same.json()["task"]["priority"] == 0
