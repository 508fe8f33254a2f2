"""A worker module run as a real process (``orbit worker tests.e2e.lease_app:worker``) by
tests/e2e/test_node_restart_and_drain.py.

Its reconnect pauses are made known: each is half its back-off base (0.05, 0.1, 0.2, ...
seconds, doubling up to ``reconnect_max``), so that a test can tell where a long pause
falls against a lease. Handlers write marker files into ``$ORBIT_TEST_MARKS``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from orbit.worker.runner import Context, Worker

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name=os.environ.get("ORBIT_TEST_NAME", "lease-worker"),
    concurrency=2,
    grace=30.0,
    reconnect_max=float(os.environ.get("ORBIT_TEST_RECONNECT_MAX", "5")),
)
worker._reconnect_random = lambda: 0.0  # every pause half its base: no jitter
MARKS = Path(os.environ.get("ORBIT_TEST_MARKS", "."))


def mark(name: str) -> None:
    (MARKS / name).write_text(str(time.time()))


@worker.handler("nap")
def nap(ctx: Context, payload: Any) -> Any:
    """Runs ``payload["seconds"]`` (a plain function: the task need not be retry_safe)."""
    mark(f"start-{ctx.task_id}")
    time.sleep(float(payload["seconds"]))
    mark(f"done-{ctx.task_id}")
    return {"napped": payload["seconds"]}


@worker.handler("held")
async def held(ctx: Context, payload: Any) -> Any:
    """Runs until the test writes ``release-<task id>``."""
    mark(f"start-{ctx.task_id}")
    release = MARKS / f"release-{ctx.task_id}"
    while not release.exists():
        await asyncio.sleep(0.05)
    return {"held": True}
