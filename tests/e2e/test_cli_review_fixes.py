"""The CLI review's fixes against real servers, SQLite and PostgreSQL: text a worker
wrote reaches the terminal with its control characters spelled out (``\\x1b``), never
run; tables fold long values at 80 columns rather than end them with ``…``, and keep
an attempt's session id on one line; the task list refuses filters no task can match;
and non-ASCII text in a result prints as written, not as ``\\uXXXX``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.e2e.servers import Node, Tokens
from tests.e2e.test_cli import Run, ok, runner

#: a failed handler's message that clears the screen's colours and sets the window title
EVIL = "msg\x1b[31mRED\x1b]0;PWNED\x07 and \x9b2J"
EVIL_SHOWN = "msg\\x1b[31mRED\\x1b]0;PWNED\\x07 and \\x9b2J"
#: raw bytes a terminal acts on: ESC, BEL, CSI (C1), DEL
CONTROL = ("\x1b", "\x07", "\x9b", "\x7f")


@pytest.fixture
def cli(node: Node, tokens: Tokens) -> Run:
    """``orbit`` as a subprocess against this test's server (SQLite or PostgreSQL)."""
    return runner(node, tokens.admin)


def _work(
    node: Node, tokens: Tokens, outcomes: list[dict[str, Any]], message: str = "step"
) -> list[str]:
    """Claim one task per outcome, report progress with ``message``, and finish it so:
    ``{"error": …}`` or ``{"result": …}``. The session's id."""
    from orbit.worker import WorkerConnection

    async def run() -> list[str]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("review-worker", {"h": 1}, 1, push=False)
        for outcome in outcomes:
            [a] = await conn.claim(1)
            await conn.start(a["attempt_id"], a["fence"])
            await conn.progress(a["attempt_id"], a["fence"], message=message)
            await conn.finish(a["attempt_id"], a["fence"], **outcome)
        await conn.close()
        assert conn.session_id is not None
        return [conn.session_id]

    return asyncio.run(run())


def _raw(text: str) -> list[str]:
    return [c for c in CONTROL if c in text]


def test_worker_text_is_printed_with_its_control_characters_spelled_out(
    admin: httpx.Client, node: Node, tokens: Tokens, cli: Run
) -> None:
    """``task show`` and ``task wait`` printed a handler's error and progress messages
    raw: rich drops BEL but passes ESC, so a worker could clear the operator's screen or
    set the window's title. Each control character (C0 but newline and tab, DEL, C1) is
    printed as ``\\x1b`` and the like, in ``task show``, ``task wait`` and ``event ls``
    (also ``--follow``); ``--json`` is JSON as before, which escapes them itself."""
    admin.post("/v1/queues", json={"name": "esc", "max_concurrency": 1, "rate": 0})
    failed = admin.post("/v1/tasks", json={"queue": "esc", "handler": "h"}).json()["task"]
    done = admin.post("/v1/tasks", json={"queue": "esc", "handler": "h"}).json()["task"]
    error = {"code": "B\x1bAD", "message": EVIL, "retryable": False}
    clear = "step\x1b[2J\x7f"  # clears the screen
    _work(node, tokens, [{"error": error}, {"result": {"r": "\x1b]0;x\x07\x9b\x7f"}}], clear)

    shown = ok(cli("task", "show", failed["id"]))
    assert _raw(shown) == [] and f"error: B\\x1bAD {EVIL_SHOWN}" in shown, shown
    assert "B\\x1bAD" in shown.split("error:")[1]  # the history's code column
    waited = cli("task", "wait", failed["id"])
    assert waited.returncode == 1 and _raw(waited.stdout + waited.stderr) == [], waited
    assert EVIL_SHOWN in waited.stdout and "step\\x1b[2J\\x7f" in waited.stderr, waited
    result = ok(cli("task", "show", done["id"]))
    # JSON spells C0 itself (\u001b); DEL and C1 it leaves as they are
    assert _raw(result) == [] and 'result: {"r": "\\u001b]0;x\\u0007\\x9b\\x7f"}' in result
    events = ok(cli("event", "ls", "--task", failed["id"]))
    assert _raw(events) == [] and "step\\u001b[2J\\x7f" in _column(events, 5), events
    followed = ok(cli("event", "ls", "--follow", "--task", failed["id"]))
    assert _raw(followed) == [] and "step\\u001b[2J\\x7f" in followed, followed
    as_json = json.loads(ok(cli("task", "show", failed["id"], "--json")))
    assert as_json["task"]["error"]["message"] == EVIL  # JSON: as written, escaped by JSON


def test_a_result_in_any_script_is_printed_as_written(
    admin: httpx.Client, node: Node, tokens: Tokens, cli: Run
) -> None:
    """``task show``'s ``result:`` line and ``event ls``'s data were JSON with
    ``ensure_ascii``: 日本語 printed as ``\\u65e5\\u672c\\u8a9e``."""
    admin.post("/v1/queues", json={"name": "uni", "max_concurrency": 1, "rate": 0})
    task = admin.post("/v1/tasks", json={"queue": "uni", "handler": "h"}).json()["task"]
    _work(node, tokens, [{"result": {"r": "日本語"}}], message="進捗")
    assert 'result: {"r": "日本語"}' in ok(cli("task", "show", task["id"]))
    events = ok(cli("event", "ls", "--task", task["id"]))
    assert "進捗" in _column(events, 5) and "\\u" not in events, events


def _column(table: str, n: int) -> str:
    """Column ``n`` of a rich table's rows, its lines joined: a folded value whole."""
    cells = []
    for line in table.splitlines():
        parts = line.replace("┃", "│").split("│")
        if len(parts) > n:
            cells.append(parts[n].strip())
    return "".join(cells)


def test_an_80_column_table_folds_long_names_and_keeps_session_ids_whole(
    admin: httpx.Client, node: Node, tokens: Tokens, cli: Run
) -> None:
    """At 80 columns (a pipe) ``queue ls`` and ``schedule ls`` ended a long name with
    ``…``, and ``event ls`` its instant; ``task show`` wrapped an attempt's session id
    over lines, though ids are never cut. Names fold; the session id is on one line."""
    narrow = {"COLUMNS": "80"}
    queue = "q" * 30 + "-" + "z" * 29
    schedule = "s" * 30 + "." + "y" * 29
    assert admin.post(
        "/v1/queues", json={"name": queue, "max_concurrency": 1, "rate": 0}
    ).is_success
    made = admin.post(
        "/v1/schedules",
        json={
            "name": schedule,
            "cron": "0 3 * * *",
            "timezone": "America/Argentina/Buenos_Aires",
            "template": {"queue": queue, "handler": "h"},
        },
    )
    assert made.status_code == 201, made.text
    assert queue in _column(ok(cli("queue", "ls", **narrow)), 1)
    listed = ok(cli("schedule", "ls", **narrow))
    assert schedule in _column(listed, 1), listed
    assert "America/Argentina/Buenos_Aires" in _column(listed, 3), listed
    assert made.json()["next_fire_at"] in _column(listed, 7), listed
    task = admin.post("/v1/tasks", json={"queue": queue, "handler": "h"}).json()["task"]
    [session] = _work(node, tokens, [{"result": 1}])
    assert session in ok(cli("task", "show", task["id"], **narrow))
    [event] = admin.get("/v1/events", params={"limit": 1}).json()["items"]
    events = ok(cli("event", "ls", "--limit", "1", **narrow))
    assert event["at"] in _column(events, 2), events


def test_task_list_filters_no_task_can_match_are_refused(admin: httpx.Client, cli: Run) -> None:
    """``GET /v1/tasks?queue=no/such`` (a tenant with a space, a 5,000-character handler)
    answered an empty page, and so did a window whose ``created_after`` is not before its
    ``created_before``: each read as "no such tasks". Each is 400 INVALID_ARGUMENT naming
    the field, and reaches ``orbit task ls`` as a server's refusal (exit 3)."""
    admin.post("/v1/queues", json={"name": "fine", "max_concurrency": 1, "rate": 0})
    assert admin.post("/v1/tasks", json={"queue": "fine", "handler": "h"}).status_code == 201
    at = "2026-01-01T00:00:00Z"
    refused = [
        ({"queue": "no/such"}, "queue", ["--queue", "no/such"]),
        ({"tenant": "bad tenant"}, "tenant", ["--tenant", "bad tenant"]),
        ({"handler": "h" * 5000}, "handler", ["--handler", "h" * 5000]),
        ({"queue": "-lead"}, "queue", ["--queue", "-lead"]),
        (
            {"created_after": at, "created_before": at},
            "created_after",
            ["--created-after", at, "--created-before", at],
        ),
        (
            {"created_after": "2026-01-02T00:00:00Z", "created_before": at},
            "created_after",
            ["--created-after", "2026-01-02T00:00:00Z", "--created-before", at],
        ),
    ]
    wrong = []
    for params, field, args in refused:
        reply = admin.get("/v1/tasks", params=params)
        error = reply.json().get("error") or {}
        if (reply.status_code, error.get("code"), error.get("field")) != (
            400,
            "INVALID_ARGUMENT",
            field,
        ):
            wrong.append((params, reply.status_code, reply.text[:200]))
        run = cli("task", "ls", *args)
        if run.returncode != 3 or "INVALID_ARGUMENT" not in run.stderr or run.stdout:
            wrong.append((args[0], run.returncode, run.stdout, run.stderr))
    assert wrong == []
    # a name no task has is a name: an empty page, as before
    assert admin.get("/v1/tasks", params={"queue": "nobody_here"}).json()["items"] == []
    listed = json.loads(ok(cli("task", "ls", "--queue", "fine", "--json")))["items"]
    assert len(listed) == 1
    window = {"created_after": at, "created_before": "2999-01-01T00:00:00Z"}
    assert len(admin.get("/v1/tasks", params=window).json()["items"]) == 1


def test_an_empty_list_says_so_rather_than_print_a_bare_frame(
    admin: httpx.Client, cli: Run
) -> None:
    """``task ls``, ``queue ls``, ``schedule ls``, ``worker ls`` and ``event ls`` with
    nothing to list printed a table's empty frame; they say there is nothing, and with
    ``--json`` print the empty list as before."""
    assert ok(cli("queue", "ls")) == "no queues\n"
    assert ok(cli("schedule", "ls")) == "no schedules\n"
    assert ok(cli("worker", "ls")) == "no live workers\n"  # the live ones by default
    assert ok(cli("worker", "ls", "--state", "live")) == "no live workers\n"
    assert ok(cli("worker", "ls", "--state", "all")) == "no workers\n"
    admin.post("/v1/queues", json={"name": "empty", "max_concurrency": 1, "rate": 0})
    assert ok(cli("task", "ls")) == "no tasks match\n"
    task = admin.post("/v1/tasks", json={"queue": "empty", "handler": "h"}).json()["task"]
    assert task["id"] in ok(cli("task", "ls"))
    assert ok(cli("task", "ls", "--queue", "other")) == "no tasks match\n"
    written = len(admin.get("/v1/events", params={"limit": 1000}).json()["items"])
    end = admin.get("/v1/events", params={"limit": written}).json()["next_cursor"]
    assert ok(cli("event", "ls", "--cursor", end)) == "no events\n"
    assert json.loads(ok(cli("event", "ls", "--cursor", end, "--json")))["items"] == []
    assert json.loads(ok(cli("queue", "ls", "--json"))) != []
    assert json.loads(ok(cli("schedule", "ls", "--json"))) == []
    assert json.loads(ok(cli("task", "ls", "--queue", "other", "--json")))["items"] == []


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the CLI's text, not the db
def test_event_ls_after_a_short_page_says_the_cursor_to_go_on_with(
    admin: httpx.Client, cli: Run
) -> None:
    """``orbit event ls --cursor C`` whose page is short (the end, for now) printed no
    cursor at all; a follower goes on from C itself (that page's events come again, then
    the newer ones), so it says so on stderr. Not with ``--json`` (its page's
    ``next_cursor`` is null, as the API's), nor for a page read from the start."""
    admin.post("/v1/queues", json={"name": "log", "max_concurrency": 1, "rate": 0})
    task = admin.post("/v1/tasks", json={"queue": "log", "handler": "h"}).json()["task"]
    cursor = admin.get("/v1/events", params={"limit": 1}).json()["next_cursor"]
    short = cli("event", "ls", "--cursor", cursor)
    assert task["id"] in ok(short) and "next page" not in short.stdout
    assert short.stderr == f"caught up; go on with --cursor {cursor}\n"
    again = admin.post("/v1/tasks", json={"queue": "log", "handler": "h"}).json()["task"]
    assert again["id"] in ok(cli("event", "ls", "--cursor", cursor))  # from there: the new
    mine = admin.get(f"/v1/tasks/{task['id']}/events", params={"limit": 1}).json()
    on_task = cli("event", "ls", "--task", task["id"], "--cursor", mine["next_cursor"])
    assert ok(on_task) == "no events\n"
    assert on_task.stderr == f"caught up; go on with --cursor {mine['next_cursor']}\n"
    as_json = cli("event", "ls", "--cursor", cursor, "--json")
    assert json.loads(ok(as_json))["next_cursor"] is None and as_json.stderr == ""
    from_start = cli("event", "ls")
    assert task["id"] in ok(from_start) and from_start.stderr == ""
    full = cli("event", "ls", "--limit", "1", "--cursor", cursor)
    assert "next page: --cursor" in ok(full) and full.stderr == ""
