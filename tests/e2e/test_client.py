"""The SDK clients against a real server: every call, typed errors, both flavours."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from orbit import AsyncClient, Client, TaskFailed
from orbit.client import BadRequest, Conflict, NotFound, WaitTimeout
from tests.e2e.network import DelayRelay, idle_connection_answers
from tests.e2e.servers import Node, Tokens


def test_sync_client_calls_and_errors(node: Node, tokens: Tokens) -> None:
    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=2, rate=0)
        assert [q["name"] for q in c.queues()] == ["q"]
        assert c.queue_pause("q")["paused"] and not c.queue_resume("q")["paused"]
        soon = datetime.now(UTC) + timedelta(hours=1)
        task = c.submit(
            "q",
            "h",
            {"a": 1},
            tenant="t",
            priority=3,
            idempotency_key="k",
            retry_safe=True,
            max_attempts=5,
            attempt_timeout=10,
            backoff={"base": 0.5, "factor": 2, "max": 10},
            deadline=soon,
        )
        assert task["priority"] == 3 and task["max_attempts"] == 5 and task["retry_safe"]
        assert c.submit("q", "h", {"a": 1}, tenant="t", idempotency_key="k")["id"] == task["id"]
        with pytest.raises(Conflict) as conflict:
            c.submit("q", "h", {"a": 2}, tenant="t", idempotency_key="k")
        assert conflict.value.code == "IDEMPOTENCY_CONFLICT"
        many = c.submit_many([{"queue": "q", "handler": "h", "payload": i} for i in range(3)])
        assert [t["payload"] for t in many] == [0, 1, 2] and many[0]["state"] == "queued"
        keyed = {"queue": "q", "handler": "h", "payload": {"a": 1}, "tenant": "t"}
        lean = c.submit_many(
            [{"queue": "q", "handler": "h", "payload": 3}, {**keyed, "idempotency_key": "k"}],
            reply="ids",
        )
        assert lean[1] == {"id": task["id"], "created": False}  # the key's existing task
        assert set(lean[0]) == {"id", "created"} and lean[0]["created"] is True
        assert c.get(lean[0]["id"])["payload"] == 3
        with pytest.raises(BadRequest) as lean_bad:
            c.submit_many([{"queue": "q", "handler": "h"}], reply="views")  # type: ignore[call-overload]
        assert lean_bad.value.code == "INVALID_ARGUMENT"
        assert next(t["id"] for t in c.iter_tasks(queue="q", limit=2)) == task["id"]
        assert len(list(c.iter_tasks(limit=2))) == 5
        assert c.get(task["id"])["state"] == "queued"
        with pytest.raises(WaitTimeout):
            c.wait(task["id"], timeout=0.3)
        assert c.cancel(task["id"])["state"] == "cancelled"
        with pytest.raises(TaskFailed) as failed:
            c.result(task["id"], timeout=5)
        assert failed.value.state == "cancelled"
        assert c.retry(task["id"])["state"] == "queued"
        # A result the decision would drop is refused, not left out in silence.
        for decision in ("failed", "retry"):
            with pytest.raises(BadRequest) as dropped:
                c.resolve(task["id"], decision, result={"charged": True})
            assert dropped.value.field == "result", decision
        assert c.events(task["id"])["items"][0]["kind"] == "submitted"
        assert c.attempts(task["id"]) == [] and c.artifacts(task["id"]) == []
        assert c.workers() == []
        with pytest.raises(NotFound) as missing:
            c.get("nope")
        assert missing.value.code == "TASK_NOT_FOUND" and missing.value.status == 404
        with pytest.raises(BadRequest) as bad:
            c.queue_create("x", max_concurrency=0, rate=0)
        assert bad.value.code == "NUMBER_OUT_OF_RANGE"
        with pytest.raises(ValueError, match="timezone"):
            c.submit("q", "h", deadline=datetime.now())  # naive: refused
        made = c.token_create("ci", ["submit"])
        assert made["token"].startswith("orbit_")
        assert made["id"] in [t["id"] for t in c.token_list()]
        assert c.token_revoke(made["id"])["revoked_at"] is not None


def test_a_task_cancelled_while_it_waited_for_a_retry_fails_as_cancelled(
    node: Node, tokens: Tokens
) -> None:
    """A task whose attempt failed (retryable) waits ``scheduled`` for its retry and is
    cancelled then. Its view keeps the last attempt's error (history). Old code: the
    clients' ``TaskFailed`` carried that error's code (``E``, retryable) as why the task
    ended, and ``orbit task wait`` printed it as ``error:``; now the code is
    ``TASK_CANCELLED``, the attempt's error is ``last_error``, and the command says whose
    error it is."""
    from typer.testing import CliRunner

    from orbit.cli.main import app
    from orbit.worker import WorkerConnection

    error = {"code": "E", "message": "m", "retryable": True}
    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=1, rate=0)
        backoff = {"base": 3600, "factor": 2, "max": 3600}  # the retry waits past the test
        task_id = c.submit("q", "h", max_attempts=3, backoff=backoff)["id"]

        async def fail_once() -> dict[str, Any]:
            conn = await WorkerConnection.connect(node.ws, tokens.worker)
            try:
                await conn.hello("w", {"h": 1}, 1)
                [task] = (await conn.next_push(10.0))["tasks"]
                await conn.start(task["attempt_id"], task["fence"])
                return await conn.finish(task["attempt_id"], task["fence"], error=error)
            finally:
                await conn.close()

        assert asyncio.run(fail_once())["task_state"] == "scheduled"
        assert c.cancel(task_id)["state"] == "cancelled"
        assert c.get(task_id)["error"] == error  # the view is unchanged: history
        with pytest.raises(TaskFailed) as failed:
            c.result(task_id, timeout=5)
        assert failed.value.state == "cancelled" and failed.value.code == "TASK_CANCELLED"
        assert failed.value.last_error == error
        assert "ended cancelled (its last attempt's error: E m)" in str(failed.value)

    async def async_result() -> TaskFailed:
        async with AsyncClient(node.http, tokens.admin) as ac:
            with pytest.raises(TaskFailed) as raised:
                await ac.result(task_id, timeout=5)
            return raised.value

    assert asyncio.run(async_result()).code == "TASK_CANCELLED"
    env = {"ORBIT_URL": node.http, "ORBIT_TOKEN": tokens.admin, "ORBIT_TOKEN_FILE": None}
    run = CliRunner().invoke(app, ["task", "wait", task_id, "--timeout", "5"], env=env)
    assert run.exit_code == 1, run.output
    assert "last attempt's error: E m" in run.output, run.output
    assert "\nerror: " not in run.output, run.output


def test_async_client(node: Node, tokens: Tokens) -> None:
    async def scenario() -> None:
        async with AsyncClient(node.http, tokens.admin) as c:
            await c.queue_create("aq", max_concurrency=2, rate=0)
            assert (await c.queue_pause("aq"))["paused"]
            await c.queue_resume("aq")
            task = await c.submit("aq", "h", None)
            assert (await c.get(task["id"]))["state"] == "queued"
            page = await c.list_tasks(queue="aq")
            assert [t["id"] for t in page["items"]] == [task["id"]]
            assert [t["id"] async for t in c.iter_tasks(queue="aq", limit=1)] == [task["id"]]
            await c.cancel(task["id"])
            with pytest.raises(TaskFailed):
                await c.result(task["id"], timeout=5)
            assert (await c.retry(task["id"]))["state"] == "queued"
            with pytest.raises(BadRequest):
                await c.resolve(task["id"], "failed", result=0)
            assert (await c.events(task["id"]))["items"][0]["kind"] == "submitted"
            assert await c.attempts(task["id"]) == []
            assert await c.workers() == []
            [lean] = await c.submit_many([{"queue": "aq", "handler": "g"}], reply="ids")
            assert lean["created"] is True and (await c.get(lean["id"]))["handler"] == "g"
            [full] = await c.submit_many([{"queue": "aq", "handler": "g", "payload": 1}])
            assert full["payload"] == 1 and full["queue"] == "aq"
            with pytest.raises(NotFound):
                await c.get("nope")
            made = await c.token_create("aci", ["submit"])
            assert made["id"] in [t["id"] for t in await c.token_list()]
            assert (await c.token_revoke(made["id"]))["revoked_at"] is not None

    asyncio.run(scenario())


def test_submit_says_whether_it_made_the_task(node: Node, tokens: Tokens) -> None:
    """The server answers a submit with ``created`` (201, or 200 with ``created: false``
    when the idempotency key named an existing task), and a full batch with the same for
    each item; the clients returned the task's view alone, and a caller could not tell a
    deduplicated resubmit from a new task. The view is a dict as before, with a
    ``created`` attribute, from both clients."""
    keyed = {"queue": "q", "handler": "h", "payload": {"a": 1}, "idempotency_key": "k"}
    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=1, rate=0)
        first = c.submit("q", "h", {"a": 1}, idempotency_key="k")
        again = c.submit("q", "h", {"a": 1}, idempotency_key="k")
        assert again == first == c.get(first["id"])  # the view, nothing added to it
        assert first.created is True and again.created is False
        made, kept = c.submit_many([{"queue": "q", "handler": "h"}, keyed])
        assert made.created is True and kept.created is False  # type: ignore[attr-defined]
        assert kept == first

    async def main() -> None:
        async with AsyncClient(node.http, tokens.admin) as c:
            again = await c.submit("q", "h", {"a": 1}, idempotency_key="k")
            fresh = await c.submit("q", "h", {"a": 1}, idempotency_key="k2")
            assert again["id"] == first["id"] and again.created is False
            assert fresh.created is True
            made, kept = await c.submit_many([{"queue": "q", "handler": "h"}, keyed])
            assert made.created is True and kept.created is False  # type: ignore[attr-defined]

    asyncio.run(main())


#: one-way latency of the relay (a cross-region link, a congested VPN)
DELAY = 0.3
#: an idle gap before a submit: under uvicorn's default keep-alive timeout (5 s), and
#: within one round trip of it
GAP = 4.7


def test_a_submit_after_an_idle_gap_near_uvicorns_keep_alive_is_not_lost(
    node: Node, tokens: Tokens
) -> None:
    """A submit a little under 5 s after the client's last call, over a network with
    some latency, met uvicorn's keep-alive timeout on the wire: the client still saw the
    connection open (the server's FIN in flight), sent the POST on it, the server never
    read it, and the caller got Unreachable from a healthy server, not knowing whether
    the task was made. Neither client now sends on a connection idle that long, and the
    server keeps an idle one open far longer (``KEEP_ALIVE``)."""
    with DelayRelay(node.port, delay=DELAY) as relay:
        with Client(relay.http, tokens.admin) as c:
            c.queue_create("q", max_concurrency=1, rate=0)
            time.sleep(GAP)
            assert c.submit("q", "h", {"n": 1})["state"] == "queued"

        async def main() -> None:
            async with AsyncClient(relay.http, tokens.admin) as c:
                await c.queue_create("aq", max_concurrency=1, rate=0)
                await asyncio.sleep(GAP)
                assert (await c.submit("aq", "h", {"n": 1}))["state"] == "queued"

        asyncio.run(main())


def test_the_server_keeps_an_idle_connection_open_past_uvicorns_default(node: Node) -> None:
    """uvicorn closes a connection idle for 5 s by default: the close of a connection a
    client is about to reuse meets its request on the wire. ``orbit server`` keeps one
    open far longer than any client keeps it idle (``orbit.cli.listening.KEEP_ALIVE``)."""
    assert idle_connection_answers(node.port, idle=6.0)


#: ids and names no server issues: a space (a control character to http.client), a
#: non-ASCII letter, a URL's query and fragment marks, a dot segment
ODD_IDS = ["a b", "é", "x?y", "x#y", "..", "%41"]


def test_odd_ids_are_sent_as_one_path_segment(node: Node, tokens: Tokens) -> None:
    """Both clients put an id or a name in the path percent-encoded, so the server sees
    it whole and answers for it: 404 naming that very id, the same from both flavours,
    never ``Unreachable`` (the sync transport refusing the URL), a bare
    UnicodeEncodeError, or the answer for a truncated id ('x' for 'x?y')."""
    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=2, rate=0)
        sync = {}
        for odd in ODD_IDS:
            for name, call in (("get", c.get), ("cancel", c.cancel), ("pause", c.queue_pause)):
                with pytest.raises(NotFound) as missing:
                    call(odd)
                sync[(name, odd)] = (missing.value.code, missing.value.message)

    async def run() -> dict[tuple[str, str], tuple[str, str]]:
        seen = {}
        async with AsyncClient(node.http, tokens.admin) as c:
            for odd in ODD_IDS:
                for name, call in (("get", c.get), ("cancel", c.cancel), ("pause", c.queue_pause)):
                    with pytest.raises(NotFound) as missing:
                        await call(odd)
                    seen[(name, odd)] = (missing.value.code, missing.value.message)
        return seen

    assert asyncio.run(run()) == sync
    for odd in ODD_IDS:
        assert sync[("get", odd)] == ("TASK_NOT_FOUND", f"no task {odd!r}")
        assert sync[("cancel", odd)] == ("TASK_NOT_FOUND", f"no task {odd!r}")
        assert sync[("pause", odd)] == ("QUEUE_NOT_FOUND", f"no queue named {odd!r}")


def test_an_id_holding_a_slash_is_refused_not_routed_elsewhere(node: Node, tokens: Tokens) -> None:
    """A client sends '/' in an id encoded (%2F), and routes match the decoded path:
    ``get('<id>/events')`` was answered with that task's events page as if it were a
    task. No id or name may hold a '/', so the server refuses an encoded one outright,
    and nothing of the real task is answered or changed."""
    from orbit.client import BadRequest

    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=2, rate=0)
        task = c.submit("q", "h")
        for call in (c.get, c.cancel, c.retry):
            with pytest.raises(BadRequest) as refused:
                call(f"{task['id']}/events")
            assert refused.value.code == "INVALID_ARGUMENT"
            assert "encoded '/'" in refused.value.message
        with pytest.raises(BadRequest):
            c.queue_pause("q/")
        assert c.get(task["id"])["state"] == "queued"
        assert [q["paused"] for q in c.queues()] == [False]


def test_both_clients_have_the_same_calls() -> None:
    """docs/quickstart.md: "AsyncClient has the same calls for asyncio"."""
    import inspect

    def calls(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(member)
            for name, member in vars(cls).items()
            if not name.startswith("_") and callable(member) and name not in ("close", "aclose")
        }

    sync, asynchronous = calls(Client), calls(AsyncClient)
    assert sorted(sync) == sorted(asynchronous)
    for name, signature in sync.items():
        assert list(signature.parameters) == list(asynchronous[name].parameters), name


#: more follows than httpx's default pool held connections (100)
FOLLOWS = 110


def test_open_follows_never_hold_up_the_async_clients_other_calls(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """Each ``stream_events`` follow holds a connection for as long as it is read. With
    httpx's default cap of 100 connections, a hundred open follows left every other call
    of the AsyncClient waiting for one until its timeout: Unreachable, "no answer within
    5 s", from a server that was well. The AsyncClient has no cap now, as Client has
    none: with 110 follows open, a call is answered."""
    node = nodes(args=["--max-streams", str(FOLLOWS + 10)])

    async def main() -> None:
        async with AsyncClient(node.http, tokens.admin, timeout=5) as c:
            await c.queue_create("q", max_concurrency=1, rate=0)
            task = await c.submit("q", "h")
            opened = 0
            all_open = asyncio.Event()

            async def follow() -> None:
                nonlocal opened
                async with contextlib.aclosing(c.stream_events()) as events:
                    async for _ in events:
                        opened += 1
                        if opened == FOLLOWS:
                            all_open.set()
                        await asyncio.Event().wait()  # holds its stream open

            follows = [asyncio.create_task(follow()) for _ in range(FOLLOWS)]
            try:
                await asyncio.wait_for(all_open.wait(), 60)
                assert [q["name"] for q in await c.queues()] == ["q"]
                assert (await c.get(task["id"]))["state"] == "queued"
            finally:
                for f in follows:
                    f.cancel()
                await asyncio.gather(*follows, return_exceptions=True)

    asyncio.run(main())


def test_aclose_ends_the_async_follows_and_refuses_new_ones(node: Node, tokens: Tokens) -> None:
    """As ``Client.close``: ``aclose()`` ends the follows being read in other tasks, and
    a follow started after it is refused, each with RuntimeError("the client is closed").
    ``subscribe``'s WebSocket, which httpx does not hold, went on being read after
    ``aclose()``, and one opened after it was served; ``stream_events`` ended with httpx's
    "Cannot send a request, as the client has been closed"."""

    async def main() -> None:
        async with AsyncClient(node.http, tokens.admin) as setup:
            await setup.queue_create("q", max_concurrency=1, rate=0)
            await setup.submit("q", "h")
        c = AsyncClient(node.http, tokens.admin)
        opened = {"stream_events": asyncio.Event(), "subscribe": asyncio.Event()}

        async def follow(name: str) -> BaseException | None:
            try:
                async for _ in getattr(c, name)():
                    opened[name].set()
            except BaseException as exc:  # what ended it is the test's to judge
                return exc
            return None

        following = {name: asyncio.create_task(follow(name)) for name in opened}
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened.values())), 30)
        await c.aclose()
        for name, task in following.items():
            ended = await asyncio.wait_for(task, 30)
            assert isinstance(ended, RuntimeError), (name, ended)
            assert str(ended) == "the client is closed", name
        for name in opened:
            with pytest.raises(RuntimeError, match=r"^the client is closed$"):
                await anext(getattr(c, name)())
        with pytest.raises(RuntimeError, match=r"^the client is closed$"):
            await anext(c.artifact_stream("a1"))

    asyncio.run(main())


def test_ids_given_as_uuids_are_taken(node: Node, tokens: Tokens) -> None:
    """``submit(parent_id=UUID)`` took a ``uuid.UUID``; ``get`` and ``cancel`` raised
    ``TypeError: quote_from_bytes() expected bytes`` for one. Both clients take one now."""
    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=1, rate=0)
        first, second = (uuid.UUID(c.submit("q", "h")["id"]) for _ in range(2))
        assert c.get(first)["id"] == str(first)  # type: ignore[arg-type]
        assert c.cancel(first)["state"] == "cancelled"  # type: ignore[arg-type]

    async def main() -> None:
        async with AsyncClient(node.http, tokens.admin) as c:
            assert (await c.get(second))["id"] == str(second)  # type: ignore[arg-type]
            assert (await c.cancel(second))["state"] == "cancelled"  # type: ignore[arg-type]

    asyncio.run(main())


def test_a_payload_key_that_is_no_text_is_refused_and_nothing_is_made(
    node: Node, tokens: Tokens
) -> None:
    """``{1: "a"}`` was stored as ``{"1": "a"}`` and ``{None: 1}`` as ``{"null": 1}``:
    both clients refuse such a payload now (TypeError naming the key), and no task is
    made."""
    with Client(node.http, tokens.admin) as c:
        c.queue_create("q", max_concurrency=1, rate=0)
        for payload in ({1: "a"}, {None: 1}):
            with pytest.raises(TypeError, match="JSON object keys must be strings"):
                c.submit("q", "h", payload)

        async def main() -> None:
            async with AsyncClient(node.http, tokens.admin) as ac:
                with pytest.raises(TypeError, match=r"the key 1 \(int\) in tasks\[0\]\.payload"):
                    await ac.submit_many([{"queue": "q", "handler": "h", "payload": {1: "a"}}])

        asyncio.run(main())
        assert c.list_tasks()["items"] == []
