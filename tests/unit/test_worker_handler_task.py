"""A handler runs in an asyncio task of its own, apart from its attempt's, with or
without a time limit: each case here runs the same handler both ways (no limit; an
hour's ``attempt_timeout``) and holds the two to the same outcome, the same cancellation,
abandonment and shutdown; and a cancel the handler leaves on its own task is its own
outcome, never its attempt's (a version that ran a handler with no limit in its attempt's
task dropped such a handler's result). Driven against ``FakeGateway``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest

from orbit.worker.runner import Context, Fail, Retry, Worker
from tests.unit.fake_gateway import FakeGateway, assignment
from tests.unit.test_worker_recovery import _finished, _is, running

Handler = Callable[[Context, Any], Awaitable[Any]]
#: no time limit, and an hour's: the handler's task is timed or not
LIMITS = pytest.mark.parametrize("limit", [None, 3600.0], ids=["no-limit", "limit"])


def _push(attempt_id: str = "a1", limit: float | None = None) -> dict[str, Any]:
    task = assignment(attempt_id, "h", attempt_timeout=limit)
    return {"type": "tasks", "req_id": None, "tasks": [task]}


def _worker(gw: FakeGateway, handler: Handler, **options: Any) -> Worker:
    worker = Worker(gw.url, "token", **{"grace": 0.2, "cancel_grace": 0.3, **options})
    worker._report_grace = 0.2
    worker.handler("h")(handler)
    return worker


async def _entered(seen: list[str]) -> None:
    """Until the handler has said it is in."""
    async with asyncio.timeout(10):
        while "in" not in seen:
            await asyncio.sleep(0.005)


def _outcome(handler: Handler, limit: float | None) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with FakeGateway() as gw:
            async with running(_worker(gw, handler)):
                await gw.wait_for(_is("hello"))
                await gw.push(_push(limit=limit))
                await gw.wait_for(_finished("a1"))
            return gw.finished["a1"]

    return asyncio.run(main())


async def _returns(ctx: Context, payload: Any) -> Any:
    await asyncio.sleep(0)
    return {"n": 1, "s": "é"}


async def _returns_at_once(ctx: Context, payload: Any) -> Any:
    return [1, None, True]


async def _fails(ctx: Context, payload: Any) -> Any:
    raise Fail("no", code="NOPE")


async def _retries(ctx: Context, payload: Any) -> Any:
    raise Retry("later")


async def _raises(ctx: Context, payload: Any) -> Any:
    await asyncio.sleep(0)
    raise ValueError("bad value")


async def _exits(ctx: Context, payload: Any) -> Any:
    raise SystemExit(3)


async def _times_itself_out(ctx: Context, payload: Any) -> Any:
    """Its own asyncio.timeout: a failure of its own, whatever task it runs in."""
    async with asyncio.timeout(0.01):
        await asyncio.sleep(10)


async def _times_out_and_goes_on(ctx: Context, payload: Any) -> Any:
    """Its own timeout, caught, and more awaits after it in the same task."""
    try:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(10)
    except TimeoutError:
        await asyncio.sleep(0.01)
    return "after its timeout"


async def _checks(ctx: Context, payload: Any) -> Any:
    ctx._stop("told to stop")
    ctx.check()


@LIMITS
@pytest.mark.parametrize(
    "handler",
    [
        _returns,
        _returns_at_once,
        _fails,
        _retries,
        _raises,
        _exits,
        _times_itself_out,
        _times_out_and_goes_on,
        _checks,
    ],
)
def test_a_handler_reports_the_same_outcome_in_either_task(
    handler: Handler, limit: float | None
) -> None:
    assert _outcome(handler, limit) == _outcome(handler, 3600.0 if limit is None else None)


def test_a_handler_never_runs_in_its_attempts_task() -> None:
    """With or without a limit: a cancel the handler puts on its own task stays its own."""
    tasks: list[bool] = []

    async def which_task(ctx: Context, payload: Any) -> Any:
        tasks.append(asyncio.current_task() is worker.running[ctx.attempt_id].task)

    async def main() -> None:
        nonlocal worker
        async with FakeGateway() as gw:
            worker = _worker(gw, which_task)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.push(_push("a1"))
                await gw.push(_push("a2", limit=3600.0))
                await gw.wait_for(_finished("a1"))
                await gw.wait_for(_finished("a2"))

    worker: Worker
    asyncio.run(main())
    assert tasks == [False, False]


#: what the cancel tests' handlers saw, in order
_SEEN: list[str] = []


async def _awaits_the_cancel(ctx: Context, payload: Any) -> Any:
    _SEEN.append("in")
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        _SEEN.append("cancelled")
        raise


async def _catches_the_cancel(ctx: Context, payload: Any) -> Any:
    _SEEN.append("in")
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        _SEEN.append("cancelled")
        await asyncio.sleep(0.01)  # the task goes on: the cancel was taken
    return "caught it"


async def _ignores_its_cancel(ctx: Context, payload: Any) -> Any:
    """Ignores the pushed cancel and returns on the second, the one its abandonment
    puts on it: a late result, while the worker and its gateway still run."""
    _SEEN.append("in")
    for _ in range(2):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            _SEEN.append("cancelled")
    _SEEN.append("returned")
    return "too late"


def _cancel_outcome(handler: Handler, limit: float | None) -> tuple[Any, list[str]]:
    """Push a cancel while ``handler`` runs: what was reported, and which attempts the
    worker abandoned (``_SEEN``: what the handler saw)."""

    async def main() -> tuple[Any, list[str]]:
        async with FakeGateway() as gw:
            worker = _worker(gw, handler)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.push(_push(limit=limit))
                await _entered(_SEEN)
                attempt = worker.running["a1"].task
                assert attempt is not None
                await gw.push({"type": "cancel", "attempt_ids": ["a1"]})
                if handler is _ignores_its_cancel:
                    await _until(lambda: worker.abandoned == ["a1"])  # past cancel_grace
                    await _until(lambda: "returned" in _SEEN)  # its late result
                    await asyncio.wait_for(asyncio.wait((attempt,)), 10)
                    assert "a1" not in gw.finished  # the worker and gateway still live
                    assert worker.running == {}
                else:
                    await gw.wait_for(_finished("a1"))
            return gw.finished.get("a1"), worker.abandoned

    return asyncio.run(main())


@LIMITS
@pytest.mark.parametrize("handler", [_awaits_the_cancel, _catches_the_cancel])
def test_a_pushed_cancel_reaches_the_handler_the_same_way(
    handler: Handler, limit: float | None
) -> None:
    _SEEN.clear()
    report, abandoned = _cancel_outcome(handler, limit)
    seen_here = list(_SEEN)
    _SEEN.clear()
    other, _ = _cancel_outcome(handler, 3600.0 if limit is None else None)
    assert report == other
    assert seen_here == _SEEN == ["in", "cancelled"]
    assert abandoned == []
    if handler is _awaits_the_cancel:
        assert report["error"]["code"] == "CANCELLED"
    else:  # what it returned is reported, the server's evidence (the task ends cancelled)
        assert report == {"ok": True, "result": "caught it"}


@LIMITS
def test_a_handler_that_ignores_its_cancel_is_abandoned_and_reports_nothing(
    limit: float | None,
) -> None:
    """Abandoned after ``cancel_grace``: it leaves ``running`` (renewals and the drain
    no longer wait for it), is cancelled once more, and what it returns later is never
    reported."""
    _SEEN.clear()
    report, abandoned = _cancel_outcome(_ignores_its_cancel, limit)
    assert report is None
    assert abandoned == ["a1"]
    assert _SEEN == ["in", "cancelled", "cancelled", "returned"]


@LIMITS
def test_a_lost_lease_cancels_the_handler_and_drops_its_result(limit: float | None) -> None:
    async def lose(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] != "renew":
            return False
        leases = [
            {"attempt_id": a, "status": "lost", "lease_expires_at": None, "lease_left": None}
            for a in msg["attempt_ids"]
        ]
        await ws.send(json.dumps({"type": "renewed", "req_id": msg["req_id"], "leases": leases}))
        return True

    async def main() -> tuple[dict[str, Any], list[str]]:
        _SEEN.clear()
        async with FakeGateway(on_request=lose, lease_left=0.4) as gw:
            worker = _worker(gw, _catches_the_cancel)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.push(_push(limit=limit))
                await gw.wait_for(_is("renew"))
                async with asyncio.timeout(10):
                    while worker.running:
                        await asyncio.sleep(0.01)
            return gw.finished, list(_SEEN)

    finished, seen = asyncio.run(main())
    assert finished == {}
    assert seen == ["in", "cancelled"]


@LIMITS
@pytest.mark.parametrize("swallows", [False, True])
def test_a_cancel_of_the_attempt_itself_ends_it_unreported(
    limit: float | None, swallows: bool
) -> None:
    """The attempt's own task cancelled (as a shutdown whose token was refused, or the
    event loop's close, cancels it) while its handler runs: the handler sees the
    cancel, and the attempt ends cancelled, reporting nothing, even if the handler
    swallowed the cancel and returned."""
    seen: list[str] = []

    async def handler(ctx: Context, payload: Any) -> Any:
        seen.append("in")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            if not swallows:
                raise
        return "swallowed"

    async def main() -> tuple[bool, dict[str, Any]]:
        async with FakeGateway() as gw:
            worker = _worker(gw, handler)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.push(_push(limit=limit))
                await _entered(seen)
                attempt = worker.running["a1"].task
                assert attempt is not None
                attempt.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(attempt, 5)
                assert "a1" not in worker.running
                await asyncio.sleep(0.05)
            return attempt.cancelled(), gw.finished

    cancelled, finished = asyncio.run(main())
    assert cancelled
    assert finished == {}
    assert seen == ["in", "cancelled"]


@LIMITS
def test_a_drain_ends_when_an_ignoring_handler_is_abandoned(limit: float | None) -> None:
    """The drain waits for attempts to be over or abandoned: it ends once an ignoring
    handler is abandoned, not ``cancel_grace`` and the report grace later."""

    released = asyncio.Event()

    async def stubborn(ctx: Context, payload: Any) -> Any:
        _SEEN.append("in")
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    async def main() -> tuple[int, list[str]]:
        _SEEN.clear()
        async with FakeGateway() as gw:
            worker = _worker(gw, stubborn, grace=0.1, cancel_grace=0.2)
            worker._report_grace = 3600.0  # a drain that waited for it hangs into wait_for
            runner = asyncio.create_task(worker.arun())
            await gw.wait_for(_is("hello"))
            await gw.push(_push(limit=limit))
            await _entered(_SEEN)
            worker.stop()
            try:
                code = await asyncio.wait_for(runner, 20)
            finally:
                released.set()  # the abandoned handler, left behind as arun() leaves it
            return code, worker.abandoned

    code, abandoned = asyncio.run(main())
    assert code == 1
    assert abandoned == ["a1"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"attempt": 3, "retry_safe": True, "queue": "other", "tenant": "acme"},
        {"deadline": "2030-01-02T03:04:05.678901Z", "deadline_left": 3600.0},
        {"attempt_timeout": 12.5, "retry_safe": 1, "attempt": "2"},
    ],
)
def test_the_context_is_the_one_its_keywords_make(fields: dict[str, Any]) -> None:
    """``_accept`` makes the context positionally (a keyword call of a dataclass's
    ``__init__`` took twice as long): each field lands where its keyword would put it."""
    contexts: list[Context] = []

    async def keeps(ctx: Context, payload: Any) -> Any:
        contexts.append(ctx)

    async def main() -> None:
        async with FakeGateway() as gw, running(_worker(gw, keeps)):
            await gw.wait_for(_is("hello"))
            pushed = assignment("a1", "h", **fields)
            await gw.push({"type": "tasks", "req_id": None, "tasks": [pushed]})
            await gw.wait_for(_finished("a1"))

    asyncio.run(main())
    a = assignment("a1", "h", **fields)
    deadline = a["deadline"]
    expected = Context(
        task_id=a["task_id"],
        attempt_id=a["attempt_id"],
        attempt=int(a["attempt"]),
        handler=a["handler"],
        queue=a["queue"],
        tenant=a["tenant"],
        deadline=datetime.fromisoformat(deadline) if deadline else None,
        attempt_timeout=a["attempt_timeout"],
        retry_safe=bool(a["retry_safe"]),
    )
    (ctx,) = contexts
    names = [f.name for f in dataclasses.fields(Context) if not f.name.startswith("_")]
    assert [getattr(ctx, n) for n in names] == [getattr(expected, n) for n in names]
    assert [type(getattr(ctx, n)) for n in names] == [type(getattr(expected, n)) for n in names]


async def _cancels_itself_and_catches_it(ctx: Context, payload: Any) -> Any:
    """A cancel of its own task, caught: what an old timeout library (async-timeout
    before 4.0.3, anyio before 4) leaves behind on Python 3.11, a cancel never taken
    back."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0.01)
    return "ok"


async def _cancels_itself_and_returns(ctx: Context, payload: Any) -> Any:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    return "ok"


@LIMITS
def test_a_cancel_a_handler_leaves_on_its_own_task_is_not_its_attempts(
    limit: float | None,
) -> None:
    """Its result is reported (the attempt is not ended unreported, which would leave a
    finished task to its lease: run again, or sent to review)."""
    assert _outcome(_cancels_itself_and_catches_it, limit) == {"ok": True, "result": "ok"}


@LIMITS
def test_a_handler_that_cancels_itself_and_returns_reports_its_cancel(
    limit: float | None,
) -> None:
    """The cancel lands on its own task as it returns: the handler's own failure,
    retryable, as any exception is (docs/worker.md, Cancellation). It was reported
    CANCELLED, which failed the task for good though no one had cancelled it."""
    report = _outcome(_cancels_itself_and_returns, limit)
    assert report["ok"] is False
    assert report["error"]["code"] == "CancelledError" and report["error"]["retryable"] is True


async def _until(done: Callable[[], object]) -> None:
    async with asyncio.timeout(10):
        while not done():
            await asyncio.sleep(0.005)


def test_a_second_cancel_leaves_an_async_handlers_cleanup_alone() -> None:
    """Every renewal after a cancel says ``cancel`` again, and a cancel may be pushed
    twice: the handler's task was cancelled each time, so cleanup it awaited in its
    ``except CancelledError`` (a page to close) was cut short part way."""
    seen: list[str] = []

    async def cleans_up(ctx: Context, payload: Any) -> Any:
        seen.append("in")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0.3)  # the cleanup's own work
            seen.append("cleaned up")
            raise

    async def main() -> dict[str, Any]:
        async with FakeGateway() as gw:
            async with running(_worker(gw, cleans_up, cancel_grace=5)):
                await gw.wait_for(_is("hello"))
                await gw.push(_push())
                await _until(lambda: "in" in seen)
                await gw.push({"type": "cancel", "attempt_ids": ["a1"]})
                await _until(lambda: "cancelled" in seen)
                await gw.push({"type": "cancel", "attempt_ids": ["a1"]})
                await gw.wait_for(_finished("a1"))
            return gw.finished["a1"]

    report = asyncio.run(main())
    assert seen == ["in", "cancelled", "cleaned up"]
    assert report["error"]["code"] == "CANCELLED"


def test_a_second_cancel_does_not_hide_a_plain_function_that_ignores_it() -> None:
    """A plain function that never looks at ``ctx.cancelled`` is abandoned after
    ``cancel_grace`` and reports nothing. A second cancel broke its grace off, and the
    attempt reported CANCELLED at once while the function ran on: its slot and the
    server's permit were freed under it, nothing was logged, and the worker exited 0."""
    entered, noticed, release = threading.Event(), threading.Event(), threading.Event()

    def ignores(ctx: Context, payload: Any) -> Any:
        entered.set()
        while not ctx.cancelled:  # seen, and ignored
            time.sleep(0.005)
        noticed.set()
        release.wait(10)
        return "too late"

    async def main() -> tuple[dict[str, Any], list[str]]:
        async with FakeGateway() as gw:
            worker = _worker(gw, ignores, cancel_grace=0.5)
            try:
                async with running(worker):
                    await gw.wait_for(_is("hello"))
                    await gw.push(_push())
                    await _until(entered.is_set)
                    attempt = worker.running["a1"].task
                    assert attempt is not None
                    await gw.push({"type": "cancel", "attempt_ids": ["a1"]})
                    await _until(noticed.is_set)  # its grace has begun
                    await gw.push({"type": "cancel", "attempt_ids": ["a1"]})  # a renewal's
                    await _until(lambda: worker.abandoned or "a1" in gw.finished)
                    release.set()  # it returns now, while the worker and gateway still run
                    await _until(lambda: all(h.done() for h in worker._abandoned_handlers.values()))
                    await asyncio.wait_for(asyncio.wait((attempt,)), 10)
                    late = dict(gw.finished)
            finally:
                release.set()  # should the test fail first: the thread is not left waiting
            return late, worker.abandoned

    finished, abandoned = asyncio.run(main())
    assert abandoned == ["a1"] and finished == {}


def _drained(
    handler: Any, started: Callable[[Worker], object], limit: float | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Run ``handler`` for attempt ``a1`` (``limit``: its attempt timeout), drain the
    worker (no grace) once ``started(worker)`` holds, and return what it reported and
    which attempts it abandoned; the run ends with exit code 0."""

    async def main() -> tuple[dict[str, Any], list[str]]:
        async with FakeGateway() as gw:
            worker = _worker(gw, handler, grace=0, cancel_grace=5)
            async with running(worker) as runner:
                await gw.wait_for(_is("hello"))
                await gw.push(_push(limit=limit))
                await _until(lambda: started(worker))
                worker.stop()
                assert await asyncio.wait_for(runner, 20) == 0
            return gw.finished, worker.abandoned

    return asyncio.run(main())


def _holds_a1(worker: Worker) -> bool:
    return "a1" in worker.running


def test_a_plain_function_that_finishes_after_a_drains_cancel_reports_its_result() -> None:
    """The drain cancels a plain function, which finishes its work within
    ``cancel_grace``: its result is the outcome. It was reported CANCELLED, and the task
    run again although its work was done."""

    def finishes(ctx: Context, payload: Any) -> Any:
        while not ctx.cancelled:
            time.sleep(0.005)
        return "done anyway"

    finished, _ = _drained(finishes, _holds_a1)
    assert finished["a1"] == {"ok": True, "result": "done anyway"}


def test_a_drain_then_the_attempt_timeout_still_leaves_a_task_that_is_not_retry_safe_alone() -> (
    None
):
    """The drain cancels a handler whose cleanup then runs past the attempt's timeout:
    the timeout's branch reported ATTEMPT_TIMEOUT, retryably, and the task ran again,
    though the drain had stopped it part way (what the drain's rule forbids for a task
    that is not retry_safe). The drain's rule decides: nothing is reported."""
    seen: list[str] = []

    async def slow_cleanup(ctx: Context, payload: Any) -> Any:
        seen.append("in")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(2)  # its cleanup, past the 1 s attempt timeout
            raise

    finished, abandoned = _drained(slow_cleanup, lambda _: "in" in seen, limit=1.0)
    assert seen == ["in", "cancelled"] and abandoned == []
    assert finished == {}  # left to its lease: needs_review


def test_a_plain_function_that_fails_on_a_drains_cancel_reports_its_own_failure() -> None:
    """A plain function that answers the drain's cancel with ``Fail`` (it stopped at a
    point it knows): that is its outcome. It was replaced by the cancel, and the task
    left to its lease."""

    def fails(ctx: Context, payload: Any) -> Any:
        while not ctx.cancelled:
            time.sleep(0.005)
        raise Fail("stopped before charging", code="STOPPED")

    finished, _ = _drained(fails, _holds_a1)
    error = finished["a1"]["error"]
    assert (error["code"], error["retryable"]) == ("STOPPED", False)
