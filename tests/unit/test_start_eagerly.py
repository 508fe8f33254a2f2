"""orbit.aio.start_eagerly: a coroutine runs in the caller until it first waits; only
then does a task carry it on (the server's pushes, see orbit.server.gateway)."""

from __future__ import annotations

import asyncio

import pytest

from orbit.aio import start_eagerly


def test_a_coroutine_that_never_waits_finishes_in_the_caller_without_a_task() -> None:
    ran: list[str] = []

    async def quick() -> None:
        ran.append("quick")

    async def main() -> None:
        tasks = len(asyncio.all_tasks())
        assert start_eagerly(quick()) is None
        assert ran == ["quick"]  # before the caller went on
        assert len(asyncio.all_tasks()) == tasks

    asyncio.run(main())


def test_an_error_before_the_first_wait_reaches_the_caller() -> None:
    async def broken() -> None:
        raise ValueError("at once")

    async def main() -> None:
        with pytest.raises(ValueError, match="at once"):
            start_eagerly(broken())

    asyncio.run(main())


def test_a_coroutine_that_waits_is_carried_on_by_a_task_in_order() -> None:
    async def main() -> None:
        lock = asyncio.Lock()
        order: list[int] = []

        async def send(n: int) -> int:
            order.append(-n)  # runs in the caller, up to the lock
            async with lock:
                await asyncio.sleep(0)
                order.append(n)
            return n

        await lock.acquire()
        tasks = [start_eagerly(send(n)) for n in (1, 2, 3)]
        assert order == [-1, -2, -3]  # each ran until it waited for the lock
        lock.release()
        assert [await t for t in tasks if t is not None] == [1, 2, 3]
        assert order == [-1, -2, -3, 1, 2, 3]  # the lock's first come, first served

    asyncio.run(main())


def test_a_cancelled_task_cancels_the_coroutine_where_it_waits() -> None:
    async def main() -> None:
        lock = asyncio.Lock()
        cleaned: list[str] = []

        async def send() -> None:
            try:
                async with lock:
                    pass
            except asyncio.CancelledError:
                cleaned.append("cancelled")
                raise

        await lock.acquire()
        task = start_eagerly(send())
        assert task is not None
        await asyncio.sleep(0)  # the task has started, and waits for the lock
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["cancelled"]
        lock.release()
        async with lock:  # the cancelled waiter left the lock usable
            pass

    asyncio.run(main())


def test_a_task_cancelled_before_its_first_step_closes_the_coroutine() -> None:
    async def main() -> None:
        lock = asyncio.Lock()
        closed: list[str] = []

        async def send() -> None:
            try:
                async with lock:
                    pass
            finally:
                closed.append("closed")

        await lock.acquire()
        task = start_eagerly(send())
        assert task is not None
        task.cancel()  # before the task ever ran
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == ["closed"]
        lock.release()
        async with lock:
            pass

    asyncio.run(main())
