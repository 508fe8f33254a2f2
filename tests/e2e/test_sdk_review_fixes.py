"""The SDK review's fixes against a real server: a worker run in a thread of its own,
``run()`` inside a running loop, and the refusals of ``submit`` that name the caller's
mistake (nothing sent)."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from typing import Any

import pytest

from orbit import AsyncClient, Client, Context, Worker
from orbit.client import WaitTimeout
from tests.e2e.servers import Node, Tokens


def test_a_worker_run_in_a_thread_of_its_own_works_and_stop_ends_it(
    node: Node, tokens: Tokens
) -> None:
    """``run()`` in a thread other than the main one installed signal handlers, which
    only the main thread may: ValueError before it connected. Now it installs none, does
    its tasks, and a ``stop()`` from the main thread ends it with 0."""
    worker = Worker(node.http, tokens.worker, name="threaded")

    @worker.handler("double")
    async def double(ctx: Context, payload: Any) -> Any:
        return payload * 2

    outcome: dict[str, Any] = {}
    # The application's collector keeps its settings: run() tunes it (gc.freeze and a
    # higher threshold) only in the main thread, where it owns the process.
    collector = (gc.get_threshold(), gc.get_freeze_count())

    def run() -> None:
        try:
            outcome["code"] = worker.run()
        except BaseException as exc:  # seen by the test, not lost in the thread
            outcome["error"] = exc

    with Client(node.http, tokens.admin) as client:
        client.queue_create("threads", max_concurrency=4, rate=0)
        task = client.submit("threads", "double", 21)
        thread = threading.Thread(target=run, name="orbit-worker")
        thread.start()
        try:
            result = None
            while thread.is_alive():  # a run that failed is seen at once, not waited out
                try:
                    result = client.result(task["id"], timeout=1)
                    break
                except WaitTimeout:
                    continue
            assert "error" not in outcome, repr(outcome.get("error"))
            assert result == 42
        finally:
            worker.stop()
            thread.join(60)
    assert not thread.is_alive()
    assert outcome == {"code": 0}
    assert (gc.get_threshold(), gc.get_freeze_count()) == collector


def test_run_inside_a_running_loop_says_to_await_arun_and_leaves_no_coroutine(
    node: Node, tokens: Tokens
) -> None:
    """Jupyter, an async application: asyncio's "Cannot run the event loop while another
    loop is running", and the coroutine made for the run reported never awaited. Now a
    RuntimeError that names ``await worker.arun()``, with no warning; the loop is left
    as it was (``arun`` then runs the worker in it)."""
    worker = Worker(node.http, tokens.worker)

    @worker.handler("noop")
    async def noop(ctx: Context, payload: Any) -> Any:
        return None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match=r"await worker\.arun\(\)"):
                worker.run()
            gc.collect()  # a coroutine dropped unawaited warns as it is collected
        assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
        assert asyncio.get_running_loop() is loop
        worker.stop()
        assert await worker.arun() == 0  # stopped before it started: returns at once

    asyncio.run(main())


def test_submit_names_an_unknown_option_and_sends_nothing(node: Node, tokens: Tokens) -> None:
    """``submit(..., timeout=5)`` was ``task_body() got an unexpected keyword argument``:
    a function the caller never called, and no word of ``attempt_timeout``."""
    with Client(node.http, tokens.admin) as client:
        client.queue_create("opts", max_concurrency=4, rate=0)
        with pytest.raises(TypeError) as sync_refused:
            client.submit("opts", "h", {}, timeout=5)
        message = str(sync_refused.value)
        assert message.startswith("Client.submit() got an unexpected keyword argument 'timeout'")
        assert "attempt_timeout" in message and "idempotency_key" in message
        with pytest.raises(TypeError, match=r"Client\.submit\(\) .* 'colour'"):
            client.submit("opts", "h", {}, colour="red")

        async def refused() -> str:
            async with AsyncClient(node.http, tokens.admin) as aclient:
                with pytest.raises(TypeError) as async_refused:
                    await aclient.submit("opts", "h", {}, timeout=5)
                return str(async_refused.value)

        message = asyncio.run(refused())
        assert message.startswith(
            "AsyncClient.submit() got an unexpected keyword argument 'timeout'"
        )
        assert "attempt_timeout" in message
        assert client.list_tasks(queue="opts")["items"] == []  # nothing was sent
        # the options it names are taken
        made = client.submit("opts", "h", {}, attempt_timeout=5, priority=1)
        assert made["attempt_timeout"] == 5


def test_a_payload_value_json_cannot_hold_is_named_by_its_path(node: Node, tokens: Tokens) -> None:
    """A set or bytes in a payload was "Object of type set is not JSON serializable",
    saying not where; the TypeError names the path now, and nothing is sent."""
    with Client(node.http, tokens.admin) as client:
        client.queue_create("values", max_concurrency=4, rate=0)
        with pytest.raises(TypeError, match=r"the set at payload\.tags\b.*nothing was sent"):
            client.submit("values", "h", {"tags": {"a", "b"}, "big": 2**70})
        with pytest.raises(TypeError, match=r"the bytes at tasks\[1\]\.payload\.raw"):
            client.submit_many(
                [
                    {"queue": "values", "handler": "h", "payload": 1},
                    {"queue": "values", "handler": "h", "payload": {"raw": b"\x00"}},
                ]
            )

        async def refused() -> None:
            async with AsyncClient(node.http, tokens.admin) as aclient:
                with pytest.raises(TypeError, match=r"the set at payload\[0\]"):
                    await aclient.submit("values", "h", [{1, 2}])

        asyncio.run(refused())
        assert client.list_tasks(queue="values")["items"] == []
        assert client.submit("values", "h", {"tags": ["a", "b"]})["payload"] == {"tags": ["a", "b"]}


def test_submit_many_full_reply_items_are_submitted_tasks(node: Node, tokens: Tokens) -> None:
    """What the typing now says (``list[SubmittedTask]`` for ``reply="full"``) is what it
    returns: each item has ``created``."""
    with Client(node.http, tokens.admin) as client:
        client.queue_create("many", max_concurrency=4, rate=0)
        full = client.submit_many([{"queue": "many", "handler": "h"}])
        assert full[0].created is True
        ids = client.submit_many([{"queue": "many", "handler": "h"}], reply="ids")
        assert set(ids[0]) == {"id", "created"}
