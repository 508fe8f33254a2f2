"""The server's store calls off the event loop (``orbit.server.threads.in_thread``)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from orbit.server.threads import THREADS, in_thread


def test_a_call_runs_on_another_thread_and_returns_its_result() -> None:
    async def main() -> tuple[str, str, dict[str, int]]:
        here = threading.current_thread().name
        there = await in_thread(lambda: threading.current_thread().name)
        kwargs = await in_thread(lambda a, b=0: {"a": a, "b": b}, 1, b=2)
        return here, there, kwargs

    here, there, kwargs = asyncio.run(main())
    assert there.startswith("orbit-store-") and there != here
    assert kwargs == {"a": 1, "b": 2}


def test_an_exception_is_raised_in_the_caller() -> None:
    def fail() -> None:
        raise LookupError("no such task")

    async def main() -> None:
        await in_thread(fail)

    with pytest.raises(LookupError, match="no such task"):
        asyncio.run(main())


def test_a_cancel_waits_for_the_call_that_has_begun() -> None:
    began, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def slow() -> str:
        began.set()
        release.wait(10)
        finished.append("done")
        return "done"

    async def main() -> None:
        call = asyncio.create_task(in_thread(slow))
        await asyncio.get_running_loop().run_in_executor(None, began.wait, 10)
        call.cancel()
        for _ in range(5):  # turns of the loop: the cancel reaches the call's await
            await asyncio.sleep(0)
        assert not call.done()  # yet the caller waits for the call that has begun
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert finished == ["done"]  # the call ended before the cancel reached its caller

    asyncio.run(main())


def test_calls_run_side_by_side_up_to_the_threads() -> None:
    barrier = threading.Barrier(THREADS, timeout=10)

    async def main() -> list[int]:
        # each call waits until THREADS of them run at once: fewer threads would time out
        return await asyncio.gather(*(in_thread(barrier.wait) for _ in range(THREADS)))

    assert sorted(asyncio.run(main())) == list(range(THREADS))


def test_a_result_for_a_closed_loop_does_not_stop_the_threads() -> None:
    release = threading.Event()
    left: list[asyncio.Future[bool]] = []

    async def leave_one_running() -> None:
        left.append(asyncio.ensure_future(in_thread(release.wait, 10)))
        await asyncio.sleep(0)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(leave_one_running())
    loop.close()  # its call is still running; its answer will find the loop closed
    release.set()

    async def main() -> list[int]:
        return [await in_thread(lambda i=i: i) for i in range(THREADS * 2)]

    assert asyncio.run(main()) == list(range(THREADS * 2))


def test_a_forked_child_starts_threads_of_its_own() -> None:
    async def name() -> str:
        return await in_thread(lambda: threading.current_thread().name)

    assert asyncio.run(name()).startswith("orbit-store-")  # the parent's threads run
    pid = os.fork()
    if pid == 0:  # the child: its parent's threads did not survive the fork
        code = 1
        try:
            # a call no thread serves would wait for ever: the alarm's default action
            # ends the child (pytest may have a handler of its own for SIGALRM)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(10)
            code = 0 if asyncio.run(name()).startswith("orbit-store-") else 1
        finally:
            os._exit(code)  # never back into pytest in the child
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
