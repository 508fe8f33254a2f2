"""A worker module run as a real process (``orbit worker tests.e2e.rotation_app:worker``)
by tests/e2e/test_token_file_rotation.py.

Its handler holds its attempt until the test lets it go (a ``go-<task id>`` file in
``$ORBIT_TEST_MARKS``), so the test knows the attempt ran through the whole rotation.
Each reconnect pause is the whole of its back-off base (0.1 s, then 0.2 s, ...): no
jitter. The wait for a rotated token after a 4401 is 2 s here, not
``runner.ROTATION_WAIT_S``'s 10, so a test that lets it run out is short.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from orbit.worker import runner
from orbit.worker.runner import Context, Worker

worker = Worker(os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"), name="rotation-worker")
worker._reconnect_random = lambda: 1.0  # every pause all of its base: no jitter
runner.ROTATION_WAIT_S = 2.0
MARKS = Path(os.environ.get("ORBIT_TEST_MARKS", "."))


@worker.handler("gated")
async def gated(ctx: Context, payload: Any) -> Any:
    (MARKS / f"start-{ctx.task_id}").write_text("")
    while not (MARKS / f"go-{ctx.task_id}").exists():
        await asyncio.sleep(0.02)
    return "went"
