"""asyncio helpers that the server and the worker share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

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


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


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
