"""Group commit on the worker side: many coroutines' reports, few requests.

Each running attempt awaits its own start and finish, but sending each alone would cost
the server one transaction (one fsync) per report. A :class:`Coalescer` keeps at most
``max_in_flight`` requests of a kind in flight; whatever is submitted meanwhile waits and
goes in the next request. An idle worker therefore sends at once (no added latency), and
a busy one sends batches as large as the load, up to ``max_batch`` — with a few batches
in flight, the server's transactions overlap instead of taking turns. A batch also stops
before its items' ``size`` passes ``max_bytes`` (always one item at least): it travels as
one WebSocket frame, which the server reads up to 4 MiB (uvicorn closes the connection on
one past 16 MiB), and 200 finishes with results of 200 KB each made a 40 MB frame that
closed the connection, again after every resume.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from orbit.aio import stop_tasks

I = TypeVar("I")  # noqa: E741 - an item sent
R = TypeVar("R")  # its answer

#: sends a batch; returns, per item in order, its answer or the exception to raise for it
Send = Callable[[list[I]], Awaitable[list[R | BaseException]]]

#: The most items one batch carries unless told otherwise.
MAX_BATCH = 200
#: What one batch may carry by its items' ``size`` unless told otherwise. The runner's
#: finishes are bounded by the server's 4 MiB frame (``orbit.worker.outcomes``).
MAX_BATCH_BYTES = 4 * 1024 * 1024


class Coalescer(Generic[I, R]):
    def __init__(
        self,
        send: Send[I, R],
        *,
        max_batch: int = MAX_BATCH,
        max_in_flight: int = 2,
        max_bytes: int = MAX_BATCH_BYTES,
        size: Callable[[I], int] | None = None,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1 or max_bytes < 1:
            raise ValueError("max_batch, max_in_flight and max_bytes must be at least 1")
        self._send = send
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._max_bytes = max_bytes
        self._size = size
        self._pending: list[tuple[I, asyncio.Future[R], int]] = []
        self._senders: set[asyncio.Task[None]] = set()

    async def submit(self, item: I, *, size: int | None = None) -> R:
        """Send ``item`` in the next batch and return its own answer (or raise its error).
        ``size`` counts it against ``max_bytes`` (default: the ``size`` function's, or 0),
        for a caller that has measured it already."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        if size is None:
            size = 0 if self._size is None else self._size(item)
        self._pending.append((item, future, size))
        if len(self._senders) < self._max_in_flight:
            sender = asyncio.create_task(self._run(), name="coalescer")
            self._senders.add(sender)
            # In case it is cancelled before its first step; it normally leaves the set
            # itself (``_run``).
            sender.add_done_callback(self._senders.discard)
        return await future

    async def stop(self) -> None:
        """Give up what is pending and end the senders at work; their callers see
        CancelledError. A sender waiting for a connection that never comes (the end
        of a run) was otherwise left in the event loop for ever."""
        for _, future, _ in self._pending:
            future.cancel()
        self._pending.clear()
        await stop_tasks(list(self._senders))

    def _take(self) -> list[tuple[I, asyncio.Future[R]]]:
        """The next batch off the pending list: up to ``max_batch`` items, stopping
        before their sizes pass ``max_bytes`` (the first item goes whatever its size)."""
        end, total = 0, 0
        for _, _, size in self._pending[: self._max_batch]:
            total += size
            if end and total > self._max_bytes:
                break
            end += 1
        batch = self._pending[:end]
        del self._pending[:end]
        return [(item, future) for item, future, _ in batch if not future.done()]

    async def _run(self) -> None:
        """Send batches until nothing is pending, then leave ``_senders`` in the same step
        as that last look, with no ``await`` between: a done callback would leave it a
        turn of the loop later, and an item submitted in that turn, while every sender
        still counted, started no sender and waited for the next ``submit``; at the end
        of a drain there is none (a start so held its task until its claim lease expired,
        a finish for as long as its lease was renewed)."""
        try:
            await self._send_pending()
        finally:
            sender = asyncio.current_task()
            if sender is not None:
                self._senders.discard(sender)

    async def _send_pending(self) -> None:
        while self._pending:
            batch = self._take()
            if not batch:
                continue
            try:
                answers = await self._send([item for item, _ in batch])
            except BaseException as exc:  # the whole request failed: each caller sees it
                for _, future in batch:
                    if future.done():
                        continue
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                if future.done():
                    continue
                if isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
