"""orbit.aio.stop_tasks: the worker's (and the server's) loops stop at exit even when a
cancellation is swallowed (a worker once hung at exit this way, in CI)."""

from __future__ import annotations

import asyncio

import pytest

from orbit.aio import stop_tasks


async def _stopped_within(tasks: list[asyncio.Task[None]], seconds: float) -> bool:
    """Whether ``stop_tasks``, called right here (its first cancel lands in this very
    loop iteration), returns in time. A watchdog cancels the tasks once more when time
    is up, so a hang ends and is reported as a failure."""
    hung = False

    async def watchdog() -> None:
        nonlocal hung
        await asyncio.sleep(seconds)
        hung = True
        for task in tasks:
            task.cancel()

    watching = asyncio.create_task(watchdog())
    await stop_tasks(tasks, recheck=0.05)
    watching.cancel()
    return not hung and all(t.done() for t in tasks)


def test_a_loop_that_swallows_one_cancellation_is_stopped() -> None:
    swallowed = asyncio.Event()

    async def stubborn_loop() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()  # the first one is lost, as wait_for can lose it

    async def main() -> bool:
        task = asyncio.create_task(stubborn_loop())
        await asyncio.sleep(0)
        stopped = await _stopped_within([task], 5)
        assert swallowed.is_set()
        return stopped

    assert asyncio.run(main())


def test_a_reply_that_meets_the_cancel_does_not_keep_a_wait_for_loop_running() -> None:
    """The race itself: the awaited reply and the cancel land in one loop iteration.
    Python 3.11's ``asyncio.wait_for`` then returns the reply and the loop runs on."""

    async def main() -> bool:
        reply = asyncio.get_running_loop().create_future()

        async def loop() -> None:
            first = True
            while True:
                await asyncio.wait_for(reply if first else asyncio.sleep(3600), 10)
                first = False

        task = asyncio.create_task(loop())
        await asyncio.sleep(0)
        reply.set_result("pong")
        await asyncio.sleep(0)  # wait_for's callback runs; the loop's step is queued
        return await _stopped_within([task], 5)

    assert asyncio.run(main())


def test_errors_of_stopped_tasks_are_retrieved_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> list[asyncio.Task[None]]:
        tasks = [asyncio.create_task(fails()), asyncio.create_task(asyncio.sleep(3600))]
        await asyncio.sleep(0)
        await stop_tasks(tasks)
        return tasks

    failed, slept = asyncio.run(main())
    assert isinstance(failed.exception(), RuntimeError)
    assert slept.cancelled()


@pytest.mark.parametrize("count", [0, 3])
def test_nothing_or_finished_tasks_return_at_once(count: int) -> None:
    async def main() -> None:
        tasks = [asyncio.create_task(asyncio.sleep(0)) for _ in range(count)]
        await asyncio.gather(*tasks)
        async with asyncio.timeout(10):  # generous: at once, on a loaded machine too
            await stop_tasks(tasks)

    asyncio.run(main())
