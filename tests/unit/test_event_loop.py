"""Which event loop Orbit's own processes run on (``orbit.aio.run``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest
import uvloop

from orbit import aio


async def _loop_type() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


def test_uvloop_when_it_is_installed() -> None:
    assert aio.loop_factory() is uvloop.new_event_loop
    assert issubclass(aio.run(_loop_type()), uvloop.Loop)


def test_the_standard_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert aio.loop_factory() is None
    loop = aio.run(_loop_type())
    assert issubclass(loop, asyncio.BaseEventLoop) and not issubclass(loop, uvloop.Loop)


def test_run_returns_what_the_coroutine_returns_and_raises_what_it_raises() -> None:
    async def answer() -> int:
        return 42

    async def fail() -> None:
        raise ValueError("no")

    assert aio.run(answer()) == 42
    with pytest.raises(ValueError, match="no"):
        aio.run(fail())


def test_run_with_leftovers_closes_the_loop_without_a_task_that_ignores_its_cancel() -> None:
    """``asyncio.run`` waits for every task it cancels at the end, so one that swallows
    CancelledError (an abandoned handler) kept it from returning: with ``leftovers`` the
    loop closes without it."""
    ended: list[str] = []

    async def stubborn() -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

    async def polite() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("polite")

    async def main() -> int:
        asyncio.get_running_loop().create_task(stubborn())
        asyncio.get_running_loop().create_task(polite())
        await asyncio.sleep(0)  # one turn: both have started
        return 7

    assert aio.run(main(), leftovers=0.05) == 7
    assert ended == ["polite"]  # a task that ends when cancelled still ends
