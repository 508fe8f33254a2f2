"""What the runner makes of what a handler does: the exceptions it raises (whatever they
are), the kind of callable it is, and how it is registered. Driven against
``FakeGateway``, a real WebSocket server on a loopback port."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import orbit
from orbit.core import validate
from orbit.protocol.decode import DecodeError, decode_model
from orbit.protocol.messages import Hello, Renew
from orbit.worker.runner import (
    RENEW_RETRY_FIRST,
    Context,
    Fail,
    Retry,
    Worker,
    _Running,
    _settle,
)
from tests.unit.fake_gateway import FakeGateway, assignment
from tests.unit.test_worker_recovery import _finished, _is, _run_one, running


def _outcome_of(handler: Any, *, attempt: str = "a1") -> dict[str, Any]:
    """Run ``handler`` as ``h`` on one task; the outcome its attempt reported."""

    async def main() -> dict[str, Any]:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", cancel_grace=1.0)
            worker.handler("h")(handler)
            await _run_one(gw, worker, assignment(attempt, "h"), timeout=5)
            return gw.finished[attempt]

    return asyncio.run(main())


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for this one")


async def _raises_unprintable(ctx: Context, payload: Any) -> Any:
    raise _Unprintable()


async def _fails_with_an_exception(ctx: Context, payload: Any) -> Any:
    try:
        int("x")
    except ValueError as exc:
        raise Fail(exc) from exc  # type: ignore[arg-type]


def _retries_with_a_number(ctx: Context, payload: Any) -> Any:
    raise Retry("busy", code=503)  # type: ignore[arg-type]


def _fails_with_no_code(ctx: Context, payload: Any) -> Any:
    raise Fail(None, code=None)  # type: ignore[arg-type]


def test_an_exception_that_cannot_be_printed_still_fails_its_attempt() -> None:
    error = _outcome_of(_raises_unprintable)["error"]
    assert error["code"] == "_Unprintable"
    assert error["retryable"] is True
    assert "_Unprintable" in error["message"]


def test_fail_and_retry_given_other_things_than_text_still_report() -> None:
    assert _outcome_of(_fails_with_an_exception)["error"] == {
        "code": "FAILED",
        "message": "invalid literal for int() with base 10: 'x'",
        "retryable": False,
    }
    assert _outcome_of(_retries_with_a_number)["error"] == {
        "code": "503",
        "message": "busy",
        "retryable": True,
    }
    assert _outcome_of(_fails_with_no_code)["error"] == {
        "code": "FAILED",
        "message": "",
        "retryable": False,
    }


def _exits_in_a_thread(ctx: Context, payload: Any) -> Any:
    sys.exit(3)


async def _exits_on_the_loop(ctx: Context, payload: Any) -> Any:
    sys.exit(3)


class _NotAnException(BaseException):
    pass


def _raises_a_base_exception(ctx: Context, payload: Any) -> Any:
    raise _NotAnException("odd")


@pytest.mark.parametrize(
    ("handler", "code", "message"),
    [
        (_exits_in_a_thread, "SystemExit", "3"),
        (_exits_on_the_loop, "SystemExit", "3"),
        (_raises_a_base_exception, "_NotAnException", "odd"),
    ],
)
def test_a_handler_that_exits_fails_its_attempt_not_the_worker(
    handler: Any, code: str, message: str
) -> None:
    """``sys.exit()`` in a handler (code lifted from a script) ended the whole worker
    with that exit code, every other attempt left to its lease."""
    assert _outcome_of(handler)["error"] == {"code": code, "message": message, "retryable": True}


class _AsyncCallable:
    async def __call__(self, ctx: Context, payload: Any) -> Any:
        await asyncio.sleep(0)
        return {"ran": "on the loop"}


@pytest.mark.parametrize("handler", [_AsyncCallable(), partial(_AsyncCallable())])
def test_an_object_with_an_async_call_runs_as_an_async_handler(handler: Any) -> None:
    """It ran in a thread, which returned an un-awaited coroutine: RESULT_NOT_JSON."""
    assert _outcome_of(handler) == {"ok": True, "result": {"ran": "on the loop"}}


def _sync_decorator(fn: Any) -> Any:
    """A decorator written for plain functions: its wrapper is no coroutine function."""

    @functools.wraps(fn)
    def wrapper(ctx: Context, payload: Any) -> Any:
        return fn(ctx, payload)

    return wrapper


@_sync_decorator
async def _wrapped_async(ctx: Context, payload: Any) -> Any:
    await asyncio.sleep(0)
    return {"ran": "on the loop", "thread": threading.current_thread().name}


def test_a_plain_handler_that_returns_a_coroutine_has_it_awaited_on_the_loop() -> None:
    """A sync decorator around an async handler: the wrapper ran in a thread and its
    "result" was the un-awaited coroutine, reported as RESULT_NOT_JSON."""
    thread = threading.current_thread().name
    assert _outcome_of(_wrapped_async) == {
        "ok": True,
        "result": {"ran": "on the loop", "thread": thread},
    }


def test_a_returned_coroutine_is_timed_and_abandoned_as_an_async_handler_is() -> None:
    """Its coroutine runs on the loop: past the attempt timeout it is cancelled, and one
    that ignores that is abandoned after ``cancel_grace`` (waited for, it held the
    attempt for ever). Abandoned, it reports nothing (a retry_safe task too): it may
    still be at work, and a retryable ``ATTEMPT_TIMEOUT`` started a retry beside it."""

    @_sync_decorator
    async def stubborn(ctx: Context, payload: Any) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.Event().wait()  # ignores the cancel, for good

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", cancel_grace=0.1, grace=0.1)
            worker.handler("h")(stubborn)
            task = assignment("a1", "h", attempt_timeout=0.1, retry_safe=True)
            await _abandoned_then_stopped(gw, worker, task)
            assert worker.abandoned == ["a1"]
            assert "a1" not in gw.finished  # the lease decides

    asyncio.run(main())


async def _abandoned_then_stopped(gw: FakeGateway, worker: Worker, task: dict[str, Any]) -> None:
    """Run ``worker`` with ``task`` until the runner abandons its handler, then stop it."""
    async with running(worker):
        await gw.wait_for(_is("hello"))
        await gw.push({"type": "tasks", "req_id": None, "tasks": [task]})
        async with asyncio.timeout(10):
            while not worker.abandoned:
                await asyncio.sleep(0.01)  # no message tells of an abandonment


@pytest.mark.parametrize("retry_safe", [True, False])
def test_a_handler_its_attempt_timeout_stopped_reports_a_timeout_only_if_retry_safe(
    retry_safe: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that stops at its attempt timeout, in time: a retry_safe task reports
    ``ATTEMPT_TIMEOUT``, retryably. Any other reports nothing: it was stopped wherever it
    had got to, an effect maybe made, and a retryable report started it again with no
    operator's decision (I6); its lease sends it to needs_review, as a drain's stop
    does. A second attempt, pushed after, shows the first was passed over, not lost."""

    async def slow(ctx: Context, payload: Any) -> Any:
        if payload == "quick":
            return "done"
        await asyncio.sleep(60)

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", cancel_grace=1.0)
            worker.handler("h")(slow)
            timed = assignment("a1", "h", attempt_timeout=0.1, retry_safe=retry_safe)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.push({"type": "tasks", "req_id": None, "tasks": [timed]})
                if retry_safe:
                    await gw.wait_for(_finished("a1"))
                else:
                    async with asyncio.timeout(10):
                        while "stopped by its attempt timeout" not in caplog.text:
                            await asyncio.sleep(0.01)  # the runner's word, then nothing
                quick = assignment("a2", "h", "quick")
                await gw.push({"type": "tasks", "req_id": None, "tasks": [quick]})
                await gw.wait_for(_finished("a2"))
            if retry_safe:
                error = gw.finished["a1"]["error"]
                assert (error["code"], error["retryable"]) == ("ATTEMPT_TIMEOUT", True)
            else:
                assert "a1" not in gw.finished
            assert gw.finished["a2"]["result"] == "done"
            assert worker.abandoned == []

    with caplog.at_level(logging.WARNING, logger="orbit.worker"):
        asyncio.run(main())


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_capacity_below_one_is_refused_at_registration(capacity: int) -> None:
    """0 was taken for "no cap" (the worker's concurrency), and a negative one was sent
    to the server, whose refusal of the hello ended the run."""
    worker = Worker("http://127.0.0.1:1", "token")
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        worker.handler("h", capacity=capacity)(_exits_on_the_loop)
    assert worker.handlers == {}


def test_the_worker_takes_a_capacity_of_one() -> None:
    worker = Worker("http://127.0.0.1:1", "token")
    worker.handler("h", capacity=1)(_exits_on_the_loop)
    assert worker.handlers["h"].capacity == 1


# --------------------------------------------------------------------------- shutdown


async def _answers_no_finish(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
    return bool(msg["type"] in ("finish", "finish_many"))


async def _returns_at_once(ctx: Context, payload: Any) -> Any:
    return "done"


def test_a_result_never_confirmed_by_shutdown_is_reported_and_fails_the_exit_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server never confirms the finish: at the end of the drain the worker exited
    0, with nothing logged, and under ``arun()`` the attempt's task was left behind in
    the caller's loop, waiting for a connection for ever."""

    async def main() -> None:
        async with FakeGateway(on_request=_answers_no_finish) as gw:
            worker = Worker(gw.url, "token", grace=0.1, cancel_grace=0.1, request_timeout=5)
            worker._report_grace = 0.1
            worker.handler("h")(_returns_at_once)
            runner = asyncio.create_task(worker.arun())
            await gw.wait_for(_is("hello"))
            await gw.push({"type": "tasks", "req_id": None, "tasks": [assignment("a1", "h")]})
            await gw.wait_for(_is("finish"))
            attempt = worker.running["a1"].task
            assert attempt is not None
            worker.stop()
            assert await asyncio.wait_for(runner, 10) == 1
            assert attempt.done()
            assert worker.unreported == ["a1"]
            senders = [t for t in asyncio.all_tasks() if t.get_name() == "coalescer"]
            assert senders == []  # the finish's sender, waiting for a connection for ever

    with caplog.at_level(logging.ERROR, logger="orbit.worker"):
        asyncio.run(main())
    assert "attempt a1 (task t-a1) ended without its outcome confirmed" in caplog.text


async def _refuses_resumes(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
    if msg["type"] != "resume":
        return False
    error = {"type": "error", "req_id": msg["req_id"], "code": "BAD_SECRET", "message": "no"}
    await ws.send(json.dumps(error))
    return True


def test_a_new_session_made_while_draining_is_drained_too() -> None:
    """Stopping, the worker lost its connection and its resume was refused: the new
    session it said hello with was never drained, so the server went on pushing it
    tasks, each claimed only to be released, until the drain was over."""

    async def main() -> None:
        async with FakeGateway(on_request=_refuses_resumes) as gw:
            worker = Worker(gw.url, "token", grace=5.0, cancel_grace=5.0, reconnect_max=0.1)
            release = threading.Event()

            @worker.handler("h")
            def waits(ctx: Context, payload: Any) -> Any:
                release.wait(10)  # cancelled with its session, it goes on for a while

            runner = asyncio.create_task(worker.arun())
            try:
                await gw.wait_for(_is("hello"))
                await gw.push({"type": "tasks", "req_id": None, "tasks": [assignment("a1", "h")]})
                await gw.wait_for(_is("start"))
                worker.stop()
                await gw.wait_for(_is("drain"))
                await gw.connections[-1].close()
                await gw.count(_is("hello"), 2)
                await gw.count(_is("drain"), 2, timeout=2)  # the new session's
            finally:
                release.set()
                await asyncio.wait_for(runner, 10)

    asyncio.run(main())


# --------------------------------------------------------------------------- leases


def test_more_running_attempts_than_one_renew_takes_all_keep_their_leases() -> None:
    """A renew holds at most 1,000 ids (docs/protocol.md); with more attempts running
    (docs/worker.md advises concurrency=1500), every renewal was refused as a whole,
    and every lease ran out: each handler cancelled, its result dropped."""
    n = 1001
    renewals: dict[str, int] = {}
    over = asyncio.Event()  # every lease renewed twice, or a handler cancelled

    async def read_as_the_server(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        """``renew`` read by the server's own decoder: one it refuses is an ``error``."""
        if msg["type"] != "renew":
            return False
        try:
            decode_model(Renew, msg, parsed=True)
        except DecodeError as exc:
            error = {"type": "error", "req_id": msg["req_id"], **exc.as_json()["error"]}
            await ws.send(json.dumps(error))
            return True
        for attempt_id in msg["attempt_ids"]:
            renewals[attempt_id] = renewals.get(attempt_id, 0) + 1
        if len(renewals) == n and min(renewals.values()) >= 2:
            over.set()
        return False

    async def main() -> None:
        # a lease of 4 s, renewed when half spent: a loaded machine's event loop, which
        # runs the fake server too, can be late by a second (400 of 1,001 handlers were
        # cancelled once with a lease of 1 s beside a busy suite) without losing one
        async with FakeGateway(on_request=read_as_the_server, lease_left=4.0) as gw:
            worker = Worker(gw.url, "token", concurrency=n, grace=5.0)
            release = asyncio.Event()
            cancelled: list[str] = []

            @worker.handler("h")
            async def waits(ctx: Context, payload: Any) -> Any:
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    cancelled.append(ctx.reason or "")
                    over.set()
                    raise
                return "ok"

            runner = asyncio.create_task(worker.arun())
            try:
                await gw.wait_for(_is("hello"))
                tasks = [assignment(f"a{i}", "h") for i in range(n)]
                await gw.push({"type": "tasks", "req_id": None, "tasks": tasks})
                await asyncio.wait_for(over.wait(), 30)
                assert cancelled == []
            finally:
                release.set()
                worker.stop()
                assert await asyncio.wait_for(runner, 10) == 0
            assert len(gw.finished) == n
            assert all(o == {"ok": True, "result": "ok"} for o in gw.finished.values())

    asyncio.run(main())


def test_a_stop_from_another_thread_ends_the_run_at_once() -> None:
    """``worker.stop()`` from a thread other than the worker's (a worker run in a thread
    of its own, stopped by the application) set an asyncio.Event from outside its loop,
    which woke nothing: the run went on until something else woke the loop (the next
    renewal turn or heartbeat, 10-20 s on an idle worker)."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token")
            worker.handler("h")(_returns_at_once)
            codes: list[int] = []
            thread = threading.Thread(target=lambda: codes.append(asyncio.run(worker.arun())))
            thread.start()
            try:
                await gw.wait_for(_is("hello"))
                await gw.push({"type": "tasks", "req_id": None, "tasks": [assignment("a1", "h")]})
                await gw.wait_for(_is("finish"))
                # Its answer taken: the worker's loop now waits on its sockets, idle (read
                # across threads, hence the polling).
                async with asyncio.timeout(5):
                    while worker.finished < 1 or worker.running:
                        await asyncio.sleep(0.01)
                worker.stop()
                await asyncio.to_thread(thread.join, 3)
                assert codes == [0]
            finally:
                worker.stop()
                await asyncio.to_thread(thread.join, 30)

    asyncio.run(main())


def test_a_second_run_starts_a_session_of_its_own() -> None:
    """A Worker run again after a run that drained resumed that run's session, which is
    draining for good (docs/protocol.md): the server never offered it work again. And
    the second run's exit code counted the first run's abandoned attempts."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token")
            worker.handler("h")(_returns_at_once)
            async with running(worker):
                await gw.wait_for(_is("hello"))
            worker.abandoned.append("from-the-first-run")
            async with running(worker) as second:
                await gw.count(lambda m: m["type"] in ("hello", "resume"), 2)
            assert [m["type"] for m in gw.received if m["type"] in ("hello", "resume")] == [
                "hello",
                "hello",
            ]
            assert second.result() == 0
            assert worker.abandoned == []

    asyncio.run(main())


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("request_timeout", 0.0),
        ("request_timeout", -1.0),
        ("grace", -1.0),
        ("cancel_grace", -1.0),
        ("reconnect_max", 0.0),
        ("renew_interval", 0.0),
    ],
)
def test_timings_a_worker_cannot_work_with_are_refused(option: str, value: float) -> None:
    """request_timeout=0 timed out every request, the hello first, which was retried
    for ever as "connect failed (TimeoutError)"; renew_interval=0 renewed without a
    pause; a negative grace was taken for none."""
    with pytest.raises(ValueError, match=option):
        Worker("http://127.0.0.1:1", "token", **{option: value})


def test_a_cafile_that_cannot_be_loaded_is_refused_naming_it(tmp_path: Path) -> None:
    """A missing or non-PEM ``cafile`` was taken, and every connection then failed and
    was retried for ever as "connect failed (FileNotFoundError)" or "(SSLError)"."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for cafile in (tmp_path / "missing.pem", garbage):
        with pytest.raises(ValueError, match=f"cafile {cafile}: cannot load"):
            Worker("https://127.0.0.1:1", "token", cafile=str(cafile))


def test_the_least_timings_a_worker_works_with_are_taken() -> None:
    worker = Worker(
        "http://127.0.0.1:1",
        "token",
        request_timeout=0.01,
        grace=0.0,
        cancel_grace=0.0,
        reconnect_max=0.01,
        renew_interval=0.01,
    )
    assert (worker.grace, worker.cancel_grace) == (0.0, 0.0)


def test_an_error_the_server_could_not_address_to_a_request_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ``error`` with ``"req_id": null`` (a frame the server could not read, so not
    match to its request; docs/protocol.md) was dropped without a word: all one saw was
    the request timing out 30 s later and the connection closing."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token")
            worker.handler("h")(_returns_at_once)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                refusal = {"type": "error", "req_id": None, "code": "INVALID_JSON"}
                await gw.push({**refusal, "message": "the frame is not valid JSON"})
                await gw.push({"type": "tasks", "req_id": None, "tasks": [assignment("a1", "h")]})
                await gw.wait_for(_is("start"))  # pushes are read in order: the error was

    with caplog.at_level(logging.WARNING, logger="orbit.worker"):
        asyncio.run(main())
    assert "INVALID_JSON: the frame is not valid JSON" in caplog.text


# --------------------------------------------------------------------------- progress


def _context() -> tuple[Context, list[tuple[Any, Any]]]:
    reports: list[tuple[Any, Any]] = []
    ctx = Context("t1", "a1", 1, "h", "q", "default", None, None)
    ctx._report = lambda _, fraction, message: reports.append((fraction, message))
    return ctx, reports


@pytest.mark.parametrize(
    ("fraction", "message", "error"),
    [
        (None, 42, "message must be a string or None, not int"),
        (0.5, b"bytes", "message must be a string or None, not bytes"),
        ("half", None, "fraction must be a number in [0, 1] or None, not str"),
        (True, None, "fraction must be a number in [0, 1] or None, not bool"),
    ],
)
def test_progress_of_the_wrong_type_is_refused_clearly(
    fraction: Any, message: Any, error: str
) -> None:
    """``ctx.progress(message=42)`` raised "TypeError: argument of type 'int' is not
    iterable" from deep in the text cleaning, ``fraction="half"`` one about '<=' between
    float and str, and ``fraction=True`` was reported as 1."""
    ctx, reports = _context()
    with pytest.raises(TypeError, match=re.escape(error)):
        ctx.progress(fraction, message)
    assert reports == []


def test_progress_takes_what_it_should() -> None:
    ctx, reports = _context()
    ctx.progress(0, "start")
    ctx.progress(1)
    ctx.progress(message="only words")
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        ctx.progress(float("nan"))
    assert reports == [(0, "start"), (1, None), (None, "only words")]


def test_progress_reaches_the_server_from_the_loop_and_a_thread_and_none_once_over() -> None:
    """A context reports through its worker by its attempt's id and fence, from an async
    handler and from a plain one's thread; a context kept past its attempt reports
    nothing (its attempt is no longer running), as when it held a weak reference to its
    attempt's state."""
    kept: list[Context] = []
    worker = Worker("http://127.0.0.1:1", "token", grace=0.2, cancel_grace=0.3)

    @worker.handler("h")
    async def on_loop(ctx: Context, payload: Any) -> Any:
        kept.append(ctx)
        ctx.progress(0.5, "on the loop")
        for _ in range(5):  # the report's turn of the loop, and its send
            await asyncio.sleep(0)
        return 1

    @worker.handler("t")
    def in_thread(ctx: Context, payload: Any) -> Any:
        ctx.progress(0.25, "in a thread")
        time.sleep(0.05)  # the loop sends it meanwhile
        return 2

    def progress(attempt_id: str) -> Callable[[dict[str, Any]], bool]:
        return lambda m: m["type"] == "progress" and m["attempt_id"] == attempt_id

    async def main() -> None:
        async with FakeGateway() as gw:
            worker.url = gw.url
            async with running(worker):
                await gw.wait_for(_is("hello"))
                tasks = [assignment("a1", "h", fence="7"), assignment("a2", "t")]
                await gw.push({"type": "tasks", "req_id": None, "tasks": tasks})
                sent = [await gw.wait_for(progress(a)) for a in ("a1", "a2")]
                assert [(m["fence"], m["fraction"], m["message"]) for m in sent] == [
                    ("7", 0.5, "on the loop"),
                    ("1", 0.25, "in a thread"),
                ]
                async with asyncio.timeout(10):
                    while worker.finished < 2 or worker.running:
                        await asyncio.sleep(0.01)
                kept[0].progress(1.0, "after the attempt")  # over: dropped, no error
                await asyncio.sleep(0.1)
            assert kept[0]._fence == "7"
            assert sum(1 for m in gw.received if m["type"] == "progress") == 2

    asyncio.run(main())


# --------------------------------------------------------------------------- hello bounds


def test_what_the_hello_would_refuse_is_refused_at_construction_and_registration() -> None:
    """A concurrency over the hello's bound, more handlers than a hello declares, a
    capacity over its bound, or a name it does not take, was refused only by the
    server's answer to the hello: the run ended there (``orbit worker`` exited 3)."""
    too_many = validate.MAX_WORKER_CONCURRENCY + 1
    with pytest.raises(ValueError, match=f"concurrency must be at most {too_many - 1}"):
        Worker("http://127.0.0.1:1", "token", concurrency=too_many)
    with pytest.raises(ValueError, match="name must be 1-128 characters"):
        Worker("http://127.0.0.1:1", "token", name="my worker")
    worker = Worker("http://127.0.0.1:1", "token", concurrency=validate.MAX_WORKER_CONCURRENCY)
    with pytest.raises(ValueError, match="capacity must be at most"):
        worker.handler("h", capacity=validate.MAX_HANDLER_CAPACITY + 1)(_returns_at_once)
    with pytest.raises(ValueError, match="handler name must be 1-128 characters"):
        worker.handler("render page")(_returns_at_once)
    for i in range(validate.MAX_WORKER_HANDLERS):
        worker.handler(f"h{i}")(_returns_at_once)
    with pytest.raises(ValueError, match=f"at most {validate.MAX_WORKER_HANDLERS} handlers"):
        worker.handler("one.more")(_returns_at_once)
    assert len(worker.handlers) == validate.MAX_WORKER_HANDLERS


@pytest.mark.parametrize("number", [1.5, 2.0, True, "4"])
def test_a_concurrency_or_capacity_that_is_no_whole_number_is_refused_at_once(
    number: object,
) -> None:
    """1.5 passed the construction's bounds, and the server refused the hello at run
    time (``orbit worker`` exited 3); the hello takes integers only."""
    with pytest.raises(ValueError, match="concurrency must be a whole number"):
        Worker("http://127.0.0.1:1", "token", concurrency=number)  # type: ignore[arg-type]
    worker = Worker("http://127.0.0.1:1", "token")
    with pytest.raises(ValueError, match="capacity must be a whole number"):
        worker.handler("h", capacity=number)  # type: ignore[arg-type]
    assert worker.handlers == {}


def test_the_hello_of_a_worker_at_every_bound_is_one_the_server_reads() -> None:
    """The bounds the worker checks are the ones the server's decoder holds it to."""
    worker = Worker(
        "http://127.0.0.1:1", "token", name="w", concurrency=validate.MAX_WORKER_CONCURRENCY
    )
    for i in range(validate.MAX_WORKER_HANDLERS):
        worker.handler(f"h{i}", capacity=validate.MAX_HANDLER_CAPACITY)(_returns_at_once)
    hello = {
        "type": "hello",
        "req_id": "r1",
        "name": worker.name,
        "max_concurrency": worker.concurrency,
        "capabilities": [
            {"handler": name, "capacity": reg.capacity} for name, reg in worker.handlers.items()
        ],
    }
    decode_model(Hello, hello, parsed=True)
    for field, over in (
        ("max_concurrency", worker.concurrency + 1),
        ("capabilities", [*hello["capabilities"], {"handler": "x", "capacity": 1}]),
    ):
        with pytest.raises(DecodeError):
            decode_model(Hello, {**hello, field: over}, parsed=True)


def test_a_refused_renewal_is_retried_with_backoff_within_the_lease() -> None:
    """The server refuses a renew as a whole (an ``error`` with its req_id, such as a
    database failure): renewals were retried every 50 ms while it lasted. They back off
    now (0.25 s, then twice as long each time), but never past half of what is left of
    the soonest lease, so that a server that recovers in time still renews it."""
    waits: list[float] = []  # the wait after a refusal, as each renewal arrived
    workers: list[Worker] = []
    third = asyncio.Event()

    async def refuses_two(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] != "renew":
            return False
        waits.append(workers[0]._renew_retry)
        if len(waits) > 2:
            third.set()
            return False
        error = {"type": "error", "req_id": msg["req_id"], "code": "INTERNAL", "message": "db"}
        await ws.send(json.dumps(error))
        return True

    async def main() -> None:
        async with FakeGateway(on_request=refuses_two, lease_left=1.0) as gw:
            worker = Worker(gw.url, "token", grace=5.0)
            workers.append(worker)
            cancelled: list[str] = []

            @worker.handler("h")
            async def waits_for_the_third(ctx: Context, payload: Any) -> Any:
                try:
                    await third.wait()
                except asyncio.CancelledError:
                    cancelled.append(ctx.reason or "")
                    raise
                return "ok"

            await _run_one(gw, worker, timeout=5)
            # renewed before its 1 s lease ran out: the second retry's wait (0.5 s) was
            # capped at half of what was left of the lease
            assert cancelled == []
            assert gw.finished["a1"] == {"ok": True, "result": "ok"}
        # each refusal doubled the wait before the next renewal (it was a 50 ms turn)
        assert waits[:3] == [RENEW_RETRY_FIRST, 2 * RENEW_RETRY_FIRST, 4 * RENEW_RETRY_FIRST]

    asyncio.run(main())


class _CappedLease:
    """A fake gateway's answers for two attempts: ``capped``, whose lease the server will
    not extend past an end 0.6 s after its start (as an attempt timeout or a task's
    deadline caps it), and ``free``, whose lease is a minute. Each renewal is answered
    after ``delay`` seconds, or never once ``hang_after`` renewals were answered."""

    def __init__(self, delay: float, hang_after: int | None = None) -> None:
        self.delay = delay
        self.hang_after = hang_after
        self.end = 0.0
        self.renewals = 0

    def lease(self, attempt_id: str) -> dict[str, Any]:
        left = max(self.end - time.monotonic(), 0.0) if attempt_id == "capped" else 60.0
        return {"attempt_id": attempt_id, "status": "ok", "lease_left": left}

    async def __call__(self, gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        kind = msg["type"]
        if kind not in ("start", "start_many", "renew"):
            return False
        if kind == "renew":
            self.renewals += 1
            if self.hang_after is not None and self.renewals > self.hang_after:
                return True  # never answered
            await asyncio.sleep(self.delay)
            reply = {"type": "renewed", "leases": [self.lease(a) for a in msg["attempt_ids"]]}
        else:
            self.end = self.end or time.monotonic() + 0.6
            items = [
                {"attempt_id": i["attempt_id"], "lease": self.lease(i["attempt_id"])}
                for i in msg.get("items", [msg])
            ]
            reply = (
                {"type": "started", "lease": items[0]["lease"]}
                if kind == "start"
                else {"type": "started_many", "results": items}
            )
        await ws.send(json.dumps({**reply, "req_id": msg["req_id"]}))
        return True


async def _run_capped(server: _CappedLease, **options: Any) -> tuple[FakeGateway, list[str], int]:
    """Run ``capped`` and ``free`` against ``server`` until ``capped`` is given up (checked
    to be given up as expired by this host's clock, which times a lease from when its
    renewal was sent, so a little before the server's end, never after it), then let ``free``
    finish; the gateway, the attempts whose handlers were cancelled, and how many
    connections the worker had made when ``capped`` was given up."""
    cancelled: list[str] = []
    reasons: list[str | None] = []
    go, given_up = asyncio.Event(), asyncio.Event()
    async with FakeGateway(on_request=server) as gw:
        worker = Worker(gw.url, "token", grace=5.0, cancel_grace=0.3, **options)

        @worker.handler("h")
        async def waits(ctx: Context, payload: Any) -> Any:
            try:
                await go.wait()
            except asyncio.CancelledError:
                cancelled.append(ctx.attempt_id)
                reasons.append(ctx.reason)
                given_up.set()
                raise
            return "ok"

        async with running(worker):
            await gw.wait_for(_is("hello"))
            tasks = [assignment("capped", "h"), assignment("free", "h")]
            await gw.push({"type": "tasks", "req_id": None, "tasks": tasks})
            await asyncio.wait_for(given_up.wait(), 10)
            # given up at its end by this host's clock: neither the server's word (``lease
            # lost``) nor a closed connection ended it, and the other attempt still runs
            assert reasons == ["lease expired"]
            assert "free" in worker.running and not gw.finished
            connections = len(gw.connections)
            go.set()
            await gw.wait_for(_finished("free"), timeout=20)
    return gw, cancelled, connections


def test_a_lease_that_cannot_be_extended_ends_without_closing_the_connection() -> None:
    """A lease capped by the server shrinks at each renewal towards its end. The renewal
    was timed out at the soonest lease, so that the end was noticed in time; near it the
    timeout fell to 50 ms, and a server slower than that (80 ms here) had the connection
    closed and resumed, again and again, every other attempt's renewal with it. Now a
    renewal waits as any request does, the capped lease is given up when it ends (its
    handler cancelled, its result dropped), and the other attempt goes on, on the one
    connection."""
    server = _CappedLease(delay=0.08)
    gw, cancelled, _ = asyncio.run(_run_capped(server))
    kinds = [m["type"] for m in gw.received]
    assert kinds.count("renew") >= 2, kinds  # at half of what was left, and again
    assert "resume" not in kinds and len(gw.connections) == 1
    assert cancelled == ["capped"]
    assert "capped" not in gw.finished
    assert gw.finished["free"] == {"ok": True, "result": "ok"}


def test_a_lease_ends_on_time_while_its_renewal_goes_unanswered() -> None:
    """A renewal that gets no answer is waited for at least a second (then the
    connection is closed), but a lease that ends meanwhile is given up at its end, not
    when the wait does: a handler never runs on past its lease by this host's clock."""
    server = _CappedLease(delay=0.0, hang_after=1)
    gw, cancelled, connections = asyncio.run(_run_capped(server, request_timeout=2.0))
    assert connections == 1  # given up while the second renewal was still awaited
    assert server.renewals == 2
    assert cancelled == ["capped"]
    assert "capped" not in gw.finished
    assert gw.finished["free"] == {"ok": True, "result": "ok"}


def test_an_attempt_started_while_a_renewal_goes_unanswered_ends_with_its_lease() -> None:
    """The leases watched while a renewal's answer is awaited include those of attempts
    started meanwhile: ``first``'s renewal, at half its 4 s lease, is never answered and
    is awaited for the 2 s left of it; ``later`` starts meanwhile with a 0.5 s lease, and
    is given up at its own end, not when the wait ends (1.5 s after that)."""
    leases = {"first": 4.0, "later": 0.5}
    ends: dict[str, float] = {}

    async def hang_renewals(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] == "renew":
            return True  # never answered
        if msg["type"] not in ("start", "start_many"):
            return False
        results = []
        for item in msg.get("items", [msg]):
            left = leases[item["attempt_id"]]
            ends[item["attempt_id"]] = time.monotonic() + left
            lease = {"attempt_id": item["attempt_id"], "status": "ok", "lease_left": left}
            results.append({"attempt_id": item["attempt_id"], "lease": lease})
        if msg["type"] == "start":
            reply = {"type": "started", "lease": results[0]["lease"]}
        else:
            reply = {"type": "started_many", "results": results}
        await ws.send(json.dumps({**reply, "req_id": msg["req_id"]}))
        return True

    async def main() -> dict[str, float]:
        given_up: dict[str, float] = {}
        both = asyncio.Event()

        async def waits(ctx: Context, payload: Any) -> Any:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                given_up[ctx.attempt_id] = time.monotonic()
                if len(given_up) == 2:
                    both.set()
                raise

        async with FakeGateway(on_request=hang_renewals) as gw:
            worker = Worker(gw.url, "token", request_timeout=6.0, cancel_grace=0.3)
            worker.handler("h")(waits)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.push(
                    {"type": "tasks", "req_id": None, "tasks": [assignment("first", "h")]}
                )
                await gw.wait_for(_is("renew"))  # first's, at half its lease: never answered
                await gw.push(
                    {"type": "tasks", "req_id": None, "tasks": [assignment("later", "h")]}
                )
                await asyncio.wait_for(both.wait(), 10)
        return given_up

    given_up = asyncio.run(main())
    for attempt_id in ("first", "later"):
        assert ends[attempt_id] - 0.3 <= given_up[attempt_id] <= ends[attempt_id] + 0.5


def test_a_renewal_unanswered_by_the_soonest_lease_end_resumes_in_time_for_the_others() -> None:
    """A link gone half-open: the first connection swallows every renewal. The renewal is
    given up when the soonest lease ends (at least a second after it was sent), and the
    connection with it, so the runner resumes on a new one while the longer lease still
    runs and renews it there; its handler finishes. The short lease is given up at its
    end. Waiting for the request timeout instead lost every lease shorter than it."""
    leases = {"short": 1.0, "long": 5.0}

    async def half_open_first(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] == "renew" and ws is gw.connections[0]:
            return True  # never answered
        if msg["type"] not in ("start", "start_many"):
            return False
        results = [
            {"attempt_id": a, "lease": {"attempt_id": a, "status": "ok", "lease_left": leases[a]}}
            for a in (i["attempt_id"] for i in msg.get("items", [msg]))
        ]
        reply = (
            {"type": "started", "lease": results[0]["lease"]}
            if msg["type"] == "start"
            else {"type": "started_many", "results": results}
        )
        await ws.send(json.dumps({**reply, "req_id": msg["req_id"]}))
        return True

    async def main() -> tuple[FakeGateway, list[str]]:
        cancelled: list[str] = []
        resumed = asyncio.Event()

        async def waits(ctx: Context, payload: Any) -> Any:
            try:
                await resumed.wait()
            except asyncio.CancelledError:
                cancelled.append(ctx.attempt_id)
                raise
            return "ok"

        async with FakeGateway(on_request=half_open_first) as gw:
            worker = Worker(gw.url, "token", request_timeout=30.0, cancel_grace=0.3)
            worker.handler("h")(waits)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                tasks = [assignment("short", "h"), assignment("long", "h")]
                await gw.push({"type": "tasks", "req_id": None, "tasks": tasks})
                await gw.wait_for(_is("resume"), timeout=4.0)  # before the long lease ends
                await gw.count(_is("renew"), 2)  # the long lease renewed on the new one
                resumed.set()
                await gw.wait_for(_finished("long"))
        return gw, cancelled

    gw, cancelled = asyncio.run(main())
    assert cancelled == ["short"]
    assert "short" not in gw.finished
    assert gw.finished["long"] == {"ok": True, "result": "ok"}


def test_a_new_lease_wakes_the_renew_loop_without_a_look_at_every_attempt() -> None:
    """Each start batch wakes the renew loop, which looked at every running attempt (1,500
    at each batch of a busy worker) to learn that no renewal was due yet. It keeps a
    floor under their renewal times now and looks only once that has passed; the look
    is still exact: a renewal is due only when a lease is half spent, and an attempt
    that ended leaves no renewal behind."""
    worker = Worker("http://127.0.0.1:9", "token")
    looks = 0

    class Counted(dict[str, Any]):
        def values(self) -> Any:
            nonlocal looks
            looks += 1
            return super().values()

    worker.running = Counted()

    def started(attempt_id: str, lease_left: float) -> None:
        ctx = Context("t", attempt_id, 1, "h", "q", "default", None, None)
        attempt = worker.running[attempt_id] = _Running(ctx=ctx, fence="1")
        worker._set_lease(attempt, {"lease_left": lease_left}, time.monotonic())

    for i in range(3):
        started(f"a{i}", 30.0)
    assert not worker._renewal_due()
    assert worker._interval() == 10.0  # the most the loop sleeps
    assert looks == 0
    started("soon", 0.0)  # its lease is spent: a renewal is due
    assert worker._renewal_due() and worker._interval() == 0.05
    assert looks == 1
    del worker.running["soon"]  # it ended: the others are not due for 15 s
    assert not worker._renewal_due()
    assert looks == 2
    assert not worker._renewal_due() and worker._interval() == 10.0
    assert looks == 2


def _next_of_nothing(ctx: Context, payload: Any) -> Any:
    return next(iter([]))


def _raises_stop_iteration_of_its_own(ctx: Context, payload: Any) -> Any:
    raise StopIteration("spent")


@pytest.mark.parametrize("handler", [_next_of_nothing, _raises_stop_iteration_of_its_own])
def test_a_plain_function_raising_stop_iteration_fails_its_attempt_retryably(
    handler: Any,
) -> None:
    """``next()`` of an empty iterator in a thread: the future refused StopIteration
    (TypeError in the loop's callback), and the attempt ran, its lease renewed, for ever."""
    error = _outcome_of(handler)["error"]
    assert error["code"] == "StopIteration"
    assert error["retryable"] is True


def test_a_thread_future_is_settled_even_with_an_exception_asyncio_refuses() -> None:
    async def main() -> BaseException | None:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        _settle(future, None, StopIteration("spent"))
        assert future.done()
        return future.exception()

    settled = asyncio.run(main())
    assert isinstance(settled, RuntimeError)
    assert "StopIteration" in str(settled)


class _NotFound(Fail):
    """A Fail whose __init__ does not call Fail's: it had no code and no message."""

    def __init__(self, key: str) -> None:
        Exception.__init__(self, f"no such key {key}")


class _Throttled(Retry):
    def __init__(self, after: float) -> None:
        self.after = after


class _Declined(Fail):
    code = "CARD_DECLINED"


class _Busy(Retry):
    code = "BUSY"


class _Refused(Fail):
    code = "REFUSED"
    message = "the order was refused"  # a class's message, as its code


class _CodeThatRaises(Fail):
    @property
    def code(self) -> str:  # type: ignore[override]
        raise RuntimeError("no code for this one")


def _raises(exc: BaseException) -> Callable[[Context, Any], Any]:
    async def handler(ctx: Context, payload: Any) -> Any:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("make", "code", "message", "retryable"),
    [
        (partial(_NotFound, "k1"), "FAILED", "no such key k1", False),
        (partial(_Throttled, 3.0), "RETRY", "3.0", True),
        (partial(_Declined, "card 4242 declined"), "CARD_DECLINED", "card 4242 declined", False),
        (partial(_Declined, "x", code="OTHER"), "OTHER", "x", False),
        (_Busy, "BUSY", "", True),
        (partial(Retry, "x"), "RETRY", "x", True),
        (partial(Fail, "x"), "FAILED", "x", False),
        (_Refused, "REFUSED", "the order was refused", False),
        (partial(_Refused, "this one"), "REFUSED", "this one", False),
        (partial(_CodeThatRaises, "x"), "FAILED", None, False),
    ],
)
def test_fail_and_retry_subclasses_report_their_class_code_or_the_default(
    make: Callable[[], Exception], code: str, message: str | None, retryable: bool
) -> None:
    """A subclass that skipped ``super().__init__`` reported nothing (its outcome failed
    in the runner), and one whose code is a class attribute had it overwritten with
    FAILED; an outcome that cannot be made at all still fails the attempt."""
    error = _outcome_of(_raises(make()))["error"]
    assert (error["code"], error["retryable"]) == (code, retryable)
    if message is not None:
        assert error["message"] == message


async def _fails_in_a_task_group(ctx: Context, payload: Any) -> Any:
    async def part() -> None:
        raise Fail("bad input", code="BAD_INPUT")

    async def other() -> None:
        raise RuntimeError("transient")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(other())
        tg.create_task(part())


async def _raises_a_nested_group(ctx: Context, payload: Any) -> Any:
    raise ExceptionGroup("outer", [ValueError("v"), ExceptionGroup("inner", [Fail("f", "F")])])


async def _raises_a_group_without_a_fail(ctx: Context, payload: Any) -> Any:
    raise ExceptionGroup("outer", [ValueError("v")])


@pytest.mark.parametrize(
    ("handler", "code", "retryable"),
    [
        (_fails_in_a_task_group, "BAD_INPUT", False),
        (_raises_a_nested_group, "F", False),
        (_raises_a_group_without_a_fail, "ExceptionGroup", True),
    ],
)
def test_a_fail_in_an_exception_group_fails_the_task(
    handler: Any, code: str, retryable: bool
) -> None:
    """A Fail raised in an asyncio.TaskGroup arrives in an ExceptionGroup: it was
    reported as a retryable ExceptionGroup, and the task retried though it had failed."""
    error = _outcome_of(handler)["error"]
    assert (error["code"], error["retryable"]) == (code, retryable)


def _asyncio_run_cancelled(ctx: Context, payload: Any) -> Any:
    async def inner() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)

    return asyncio.run(inner())


def test_a_plain_function_raising_cancelled_error_fails_retryably_not_as_a_timeout() -> None:
    """Its own asyncio.run's CancelledError was taken for the attempt's timeout: a
    non-retryable CANCELLED "attempt timeout", with no timeout set."""
    error = _outcome_of(_asyncio_run_cancelled)["error"]
    assert (error["code"], error["retryable"]) == ("CancelledError", True)


@pytest.mark.parametrize("retry_safe", [0, 1, "false", "no"])
def test_a_retry_safe_that_is_no_bool_is_refused_at_registration(retry_safe: Any) -> None:
    """``retry_safe=0`` passed the guard ``is False``: a replayable task then ran a
    handler meant never to be replayed."""
    worker = Worker("http://127.0.0.1:8000", "token")
    with pytest.raises(TypeError, match="retry_safe must be True, False or None"):
        worker.handler("h", retry_safe=retry_safe)


def _a_generator(ctx: Context, payload: Any) -> Any:
    yield payload


async def _an_async_generator(ctx: Context, payload: Any) -> Any:
    yield payload


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        ("not a function", "is not callable"),
        (None, "is not callable"),
        (_a_generator, "generator function"),
        (_an_async_generator, "generator function"),
        (partial(_a_generator), "generator function"),
    ],
)
def test_a_handler_that_can_never_work_is_refused_at_registration(fn: Any, words: str) -> None:
    worker = Worker("http://127.0.0.1:8000", "token")
    with pytest.raises(TypeError, match=words):
        worker.handler("h")(fn)
    assert "h" not in worker.handlers


def _deep_in_the_handler() -> None:
    raise KeyError("missing")


def _raises_from_deep(ctx: Context, payload: Any) -> Any:
    _deep_in_the_handler()


def test_a_handlers_unexpected_exception_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server is told its class and str(): no traceback was anywhere."""
    with caplog.at_level(logging.WARNING, logger="orbit"):
        error = _outcome_of(_raises_from_deep, attempt="a7")["error"]
    assert error["code"] == "KeyError"
    logged = [r for r in caplog.records if "the handler raised" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].levelno == logging.WARNING
    message = logged[0].getMessage()
    assert "a7" in message and "t-a7" in message
    assert "Traceback (most recent call last)" in message and "_deep_in_the_handler" in message
    assert "token" not in caplog.text


def test_a_handlers_traceback_is_logged_as_text_a_log_file_can_take(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception whose text holds a lone surrogate (bytes decoded with
    ``surrogateescape``): logged with ``exc_info`` as it was, it failed a UTF-8 log
    file's write, and pytest-xdist could not send the captured log. It is escaped, as
    the report's text is."""
    with caplog.at_level(logging.WARNING, logger="orbit"):
        _outcome_of(_raises(ValueError("bad byte \udcff here")))
    [message] = [r.getMessage() for r in caplog.records if "the handler raised" in r.getMessage()]
    message.encode("utf-8")  # no lone surrogate left
    assert "bad byte \\udcff here" in message


def test_a_fail_or_retry_is_not_logged_as_unexpected(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="orbit"):
        _outcome_of(_raises(Fail("bad", "BAD")))
        _outcome_of(_raises(Retry("later")))
    assert "the handler raised" not in caplog.text


def test_a_result_that_cannot_be_sent_is_logged_with_its_attempt_and_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def returns_nan(ctx: Context, payload: Any) -> Any:
        return float("nan")

    with caplog.at_level(logging.ERROR, logger="orbit"):
        _outcome_of(returns_nan, attempt="a8")
    line = next(r.getMessage() for r in caplog.records if "cannot be sent" in r.getMessage())
    assert "a8" in line and "t-a8" in line


def test_arun_removes_its_signal_handlers_when_it_returns() -> None:
    """Left on the caller's loop, a later Ctrl-C went to the finished worker's stop()."""

    async def main() -> bool:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", grace=0.1, cancel_grace=0.1)
            worker.handler("h")(_returns_at_once)
            runner = asyncio.create_task(worker.arun(install_signals=True))
            await gw.wait_for(_is("hello"))
            worker.stop()
            assert await asyncio.wait_for(runner, 10) == 0
            return asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    assert asyncio.run(main()) is False


def test_a_worker_module_that_cannot_build_its_worker_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    """``Worker(prefetch=1.5)`` raises TypeError, which was a traceback."""
    (tmp_path / "badworker.py").write_text(
        "from orbit.worker.runner import Worker\n"
        "worker = Worker('http://127.0.0.1:8000', 'token', prefetch=1.5)\n"
    )
    root = str(Path(orbit.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from orbit.cli.main import main; main()",
            "worker",
            "badworker:worker",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot load badworker:worker" in done.stderr
    assert "prefetch must be a whole number" in done.stderr
    assert "Traceback" not in done.stderr


WORKER_ARGS = ("worker", "buggyworker:worker")


def test_a_type_error_of_the_worker_modules_own_keeps_its_traceback(tmp_path: Path) -> None:
    """A bug in the module (``len(5)``) is no refusal of Orbit's: its traceback, which
    names its file and line, is printed, where one line hid them."""
    (tmp_path / "buggyworker.py").write_text("n = len(5)\n")
    root = str(Path(orbit.__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", "from orbit.cli.main import main; main()", *WORKER_ARGS],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root, "COLUMNS": "400"},  # no path elided
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "buggyworker.py" in done.stderr  # its file
    assert done.stderr.rstrip().endswith("TypeError: object of type 'int' has no len()")
