"""Group commit on the worker side: many coroutines' reports, few requests.

Each running attempt awaits its own start and finish, but sending each alone would cost
the server one transaction (one fsync) per report. A :class:`Coalescer` keeps one request
of a kind in flight; whatever is submitted meanwhile waits and goes in the next request.
An idle worker therefore sends at once (no added latency), and a busy one sends batches
as large as the load, up to ``max_batch``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

I = TypeVar("I")  # noqa: E741 - an item sent
R = TypeVar("R")  # its answer

#: sends a batch; returns, per item in order, its answer or the exception to raise for it
Send = Callable[[list[I]], Awaitable[list[R | BaseException]]]


class Coalescer(Generic[I, R]):
    def __init__(self, send: Send[I, R], *, max_batch: int = 500) -> None:
        self._send = send
        self._max_batch = max_batch
        self._pending: list[tuple[I, asyncio.Future[R]]] = []
        self._runner: asyncio.Task[None] | None = None

    async def submit(self, item: I) -> R:
        """Send ``item`` in the next batch and return its own answer (or raise its error)."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="coalescer")
        return await future

    async def _run(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
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

    def close(self) -> None:
        """Stop sending; callers still waiting see CancelledError."""
        if self._runner is not None:
            self._runner.cancel()
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
