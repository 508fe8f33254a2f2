"""The store's blocking calls, run off the event loop on a few threads of Orbit's own.

Every report a worker sends and every submit is one store call, and each crossed to a
thread through Starlette's ``run_in_threadpool`` (anyio's ``to_thread.run_sync``): a
capacity limiter, a cancel scope and context lookups on the event loop for every call,
100-130 µs of CPU a call against 45-60 µs this way (side by side, a no-op function on
uvloop), and a sixth of the server's event-loop time one task at a time (py-spy,
``python -m benchmarks.probe --tasks 1000 --paced 100 --py-spy FILE``). Here a call is
one put on a queue that ``THREADS`` threads read, and one ``call_soon_threadsafe`` back.

As with anyio, a call that has begun runs to its end before a cancel reaches its caller:
a connection closing, or the server stopping, never tears down what the call is using.
The hot paths use this (``gateway``, ``routes``, ``auth``); the rest (the lifespan, the
reaper, artifacts' streamed bodies, metrics) stay on anyio's pool, so a slow upload
never holds a thread that reports wait for.

Each call carries the instant it was queued, which the call sees while it runs
(``orbit.store.store.CALL_QUEUED``): a store transaction's wait for the database
(``StoreConfig.tx_wait_us``) counts from it, so that a call queued behind threads that
wait for a lock does not wait its whole wait again once a thread takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from orbit.store.store import CALL_QUEUED

P = ParamSpec("P")
T = TypeVar("T")

#: Threads serving the calls: more than the store's pooled connections (8 durable and 2
#: relaxed on PostgreSQL), so a call waits for a connection, never for a thread.
THREADS = 16

_Call = tuple[
    asyncio.AbstractEventLoop,
    "asyncio.Future[Any]",
    Callable[..., Any],
    tuple[Any, ...],
    dict[str, Any],
    float,  # when it was queued (time.monotonic())
]
_calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
_started = 0
_start_lock = threading.Lock()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled while it ran: its caller has stopped listening
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _serve() -> None:
    queued = CALL_QUEUED
    while True:
        loop, future, fn, args, kwargs, queued.at = _calls.get()
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as exc:  # the caller raises it
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(_settle, future, result, error)
        del loop, future, fn, args, kwargs, result, error  # hold nothing while idle


def _after_fork() -> None:
    """A forked child has none of its parent's threads: start its own on first use."""
    global _calls, _started, _start_lock
    _calls, _started, _start_lock = queue.SimpleQueue(), 0, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _ensure_threads() -> None:
    global _started
    if _started >= THREADS:
        return
    with _start_lock:
        while _started < THREADS:
            threading.Thread(target=_serve, name=f"orbit-store-{_started}", daemon=True).start()
            _started += 1


async def in_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on one of the threads; its result, or its exception
    raised here."""
    _ensure_threads()
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    _calls.put((loop, future, fn, args, kwargs, time.monotonic()))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        # The call has begun or will: let it end, then let the cancel go on.
        await asyncio.wait([future])
        raise
