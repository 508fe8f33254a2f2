"""A worker module run as a real process (``orbit worker
tests.e2e.runtime_review_app:worker``) by tests/e2e/test_runtime_review_fixes.py.

Handlers write marker files into ``$ORBIT_TEST_MARKS`` so the test can see what ran.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from orbit.worker.runner import Context, Worker

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name="runtime-review-worker",
    concurrency=4,
    grace=30.0,
    cancel_grace=1.0,
)
MARKS = Path(os.environ.get("ORBIT_TEST_MARKS", "."))


def mark(name: str) -> None:
    (MARKS / name).write_text(str(time.time()))


@worker.handler("interrupt")
async def interrupt(ctx: Context, payload: Any) -> Any:
    """Raises KeyboardInterrupt itself: code lifted from a script that stops on Ctrl-C."""
    mark(f"start-{ctx.task_id}")
    raise KeyboardInterrupt


@worker.handler("hold")
def hold(ctx: Context, payload: Any) -> Any:
    """A plain function beside it: runs until the test writes ``release-<task id>``."""
    mark(f"start-{ctx.task_id}")
    release = MARKS / f"release-{ctx.task_id}"
    while not release.exists():
        time.sleep(0.02)
    return "held"


@worker.handler("ok")
async def ok(ctx: Context, payload: Any) -> Any:
    return "ok"
