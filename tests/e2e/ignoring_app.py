"""A worker module run as a real process by ``test_worker_abandoned_exit.py``
(``orbit worker``): handlers that ignore their cancel until the test lets them end.

Each writes ``start-<task>`` into ``$ORBIT_TEST_MARKS`` as it begins, waits for the
test's ``release-<task>`` there, whatever cancel comes, and writes ``done-<task>`` as it
returns."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from orbit.worker.runner import Context, Worker

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name="ignoring",
    grace=0.5,
    cancel_grace=float(os.environ.get("ORBIT_TEST_CANCEL_GRACE", "0.3")),
)
MARKS = Path(os.environ.get("ORBIT_TEST_MARKS", "."))


def _mark(name: str) -> None:
    (MARKS / name).write_text("")


@worker.handler("ignores")
def ignores(ctx: Context, payload: Any) -> str:
    """A plain function that never looks at ``ctx.cancelled``."""
    _mark(f"start-{ctx.task_id}")
    while not (MARKS / f"release-{ctx.task_id}").exists():
        time.sleep(0.01)
    _mark(f"done-{ctx.task_id}")
    return "ended on its own"


@worker.handler("ignores.async")
async def ignores_async(ctx: Context, payload: Any) -> str:
    """An async handler that swallows every ``CancelledError``."""
    _mark(f"start-{ctx.task_id}")
    while not (MARKS / f"release-{ctx.task_id}").exists():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.01)
    _mark(f"done-{ctx.task_id}")
    return "ended on its own"


@worker.handler("quick")
def quick(ctx: Context, payload: Any) -> None:
    return None
