"""asyncio helpers that the server and the worker share."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine, Generator, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (``uvicorn[standard]`` brings it on
    Linux and macOS; the server already runs on it through uvicorn), else None: the
    standard loop. A worker spends about a third of its CPU in the loop itself (a task,
    a future and a few callbacks per attempt), which uvloop runs in C."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, leftovers: float | None = None) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks.

    With ``leftovers``, the tasks still running when ``main`` returns are cancelled and
    given that many seconds to end; one that ignores its cancel is left behind and the
    loop closes anyway. ``asyncio.run`` waits for every task it cancels, so a task that
    swallows CancelledError (an abandoned handler) kept it from ever returning."""
    if leftovers is None:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(main)
    loop = (loop_factory() or asyncio.new_event_loop)()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            _end_leftovers(loop, leftovers)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _end_leftovers(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """Cancel the loop's remaining tasks and wait ``timeout`` seconds at most for them,
    reporting their errors as ``asyncio.Runner`` does."""
    tasks = asyncio.all_tasks(loop)
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    done, _ = loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], *, recheck: float = 0.5) -> None:
    """Cancel ``tasks`` and return once every one has finished.

    One ``cancel()`` and an ``await`` are not enough: on Python 3.11,
    ``asyncio.wait_for`` returns its result instead of raising when the awaited reply
    lands in the same loop iteration as the cancel, so a loop built on it runs on and
    the ``await`` never returns (a worker hung at exit this way). Whatever is still
    running after ``recheck`` seconds is cancelled again. Their errors are not raised:
    they are loops being stopped."""
    pending = set(tasks)
    finished: list[asyncio.Task[Any]] = []
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=recheck)
        finished.extend(done)
    for task in finished:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit


def start_eagerly(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
    """Run ``coro`` in the caller up to its first suspension, as Python 3.12's eager
    tasks do. If it finished there, return None (its result is dropped; an exception it
    raised propagates to the caller). Otherwise return a task that carries it on from
    where it waits.

    The server's pushes use this: a send to a socket that takes the bytes completes
    without suspending, so the usual push costs no task and no turn of the event loop,
    and only a send that would wait for a slow reader is left to run by itself."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    task = asyncio.get_running_loop().create_task(_carry_on(coro, waiting_on))
    task.add_done_callback(lambda _: _close_if_suspended(coro))
    return task


def _close_if_suspended(coro: Coroutine[Any, Any, Any]) -> None:
    # A task cancelled before its first step never resumes ``coro``: close it, so its
    # cleanup (a lock's waiter, say) runs now rather than when it is collected.
    if inspect.getcoroutinestate(coro) == inspect.CORO_SUSPENDED:
        coro.close()


async def _carry_on(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    return await _Resumed(coro, waiting_on)


class _Resumed(Generic[T]):
    """A coroutine that has already run up to ``waiting_on`` (what it yielded), as an
    awaitable: the task awaiting it first waits for ``waiting_on``, then resumes the
    coroutine with what the wait gave, as ``yield from`` would have."""

    def __init__(self, coro: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, T]:
        coro, waiting_on = self.coro, self.waiting_on
        while True:
            try:
                value = yield waiting_on
            except BaseException as exc:  # thrown into the task (a cancellation): pass it on
                try:
                    waiting_on = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
            else:
                try:
                    waiting_on = coro.send(value)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
