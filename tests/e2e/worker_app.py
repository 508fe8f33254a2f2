"""A worker module run as a real process by the runner tests (``orbit worker``).

Handlers write marker files into ``$ORBIT_TEST_MARKS`` so the test can see what ran.
"""

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
    name=os.environ.get("ORBIT_TEST_NAME", "test-worker"),
    concurrency=int(os.environ.get("ORBIT_TEST_CONCURRENCY", "4")),
    prefetch=int(os.environ.get("ORBIT_TEST_PREFETCH", "0")),
    grace=float(os.environ.get("ORBIT_TEST_GRACE", "10")),
    cancel_grace=float(os.environ.get("ORBIT_TEST_CANCEL_GRACE", "1")),
    reconnect_max=float(os.environ.get("ORBIT_TEST_RECONNECT_MAX", "5")),
)
if "ORBIT_TEST_RENAME" in os.environ:
    # A name set past the constructor's check, as an older SDK would send it: what only
    # the server's hello then refuses
    worker.name = os.environ["ORBIT_TEST_RENAME"]
MARKS = Path(os.environ.get("ORBIT_TEST_MARKS", "."))


def mark(name: str) -> None:
    (MARKS / name).write_text(str(time.time()))


@worker.handler("sleep")
async def sleep(ctx: Context, payload: Any) -> Any:
    mark(f"start-{ctx.task_id}")
    await asyncio.sleep(float(payload["seconds"]))
    mark(f"done-{ctx.task_id}")
    return {"slept": payload["seconds"]}


@worker.handler("stubborn")
def stubborn(ctx: Context, payload: Any) -> Any:
    """Ignores cancellation on purpose: shutdown must still be bounded."""
    mark(f"start-{ctx.task_id}")
    time.sleep(float(payload["seconds"]))
    return "too late"


@worker.handler("touch")
def touch(ctx: Context, payload: Any) -> Any:
    """Marks that it ran, and returns nothing (the payload may be large)."""
    mark(f"done-{ctx.task_id}")
    return None


@worker.handler("stubborn.async")
async def stubborn_async(ctx: Context, payload: Any) -> Any:
    """An async handler that swallows every cancellation on purpose (a retry loop that
    catches CancelledError): shutdown must still be bounded."""
    mark(f"start-{ctx.task_id}")
    end = time.monotonic() + float(payload["seconds"])
    while time.monotonic() < end:
        with contextlib.suppress(asyncio.CancelledError):  # the point of this handler
            await asyncio.sleep(0.05)
    return "too late"
