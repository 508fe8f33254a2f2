"""The worker of the chaos run (``tests/fault/chaos.py``), run as a real process:

    ORBIT_URL=http://127.0.0.1:PORT ORBIT_TOKEN=... ORBIT_CHAOS_NAME=w0 \\
        python -m orbit.cli worker tests.fault.chaos_worker:worker

Two handlers, both async (so a lost lease or a cancel can interrupt them at once):

- ``chaos.safe``: for tasks submitted ``retry_safe`` (Orbit may replay them after a lost
  lease);
- ``chaos.unsafe``: registered ``retry_safe=False``: its effects must not be replayed, so a
  lost lease leaves the task ``needs_review`` instead of running it again.

The driver draws the randomness (seeded) and puts it in the payload, so a run is
reproducible from its seed: ``sleep`` is how long the handler works (seconds), ``fail``
lists the attempt numbers that fail with a retryable error (``Retry``).

The result names the attempt that produced it, so the driver can check that a stored
result comes from the attempt recorded as the one that succeeded.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from orbit.worker.runner import Context, Retry, Worker

NAME = os.environ.get("ORBIT_CHAOS_NAME", "chaos")

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name=NAME,
    concurrency=int(os.environ.get("ORBIT_CHAOS_CONCURRENCY", "3")),
    grace=5.0,
    cancel_grace=1.0,
    reconnect_max=1.0,
)


async def _work(ctx: Context, payload: Any) -> dict[str, Any]:
    spec = payload if isinstance(payload, dict) else {}
    await asyncio.sleep(float(spec.get("sleep", 0.0)))
    if ctx.attempt in spec.get("fail", []):
        raise Retry(f"chaos: attempt {ctx.attempt} fails on purpose", code="CHAOS_RETRY")
    return {
        "task": ctx.task_id,
        "attempt": ctx.attempt,
        "attempt_id": ctx.attempt_id,
        "worker": NAME,
    }


@worker.handler("chaos.safe")
async def safe(ctx: Context, payload: Any) -> dict[str, Any]:
    return await _work(ctx, payload)


@worker.handler("chaos.unsafe", retry_safe=False)
async def unsafe(ctx: Context, payload: Any) -> dict[str, Any]:
    return await _work(ctx, payload)
