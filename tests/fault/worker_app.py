"""The worker for the lease and connection drills (``tests/fault/test_drills.py``), run
as a real process:

    ORBIT_DRILL_DIR=/tmp/x ORBIT_DRILL_NAME=a \\
        python -m orbit.cli worker tests.fault.worker_app:worker

One handler, ``lease.drill`` (async). Each run of task ``T`` as attempt ``n`` leaves files
in ``$ORBIT_DRILL_DIR``, each holding JSON ``{"worker", "pid", "attempt", "attempt_id",
"t"}`` (``t`` = ``time.time()`` when written), written atomically (a dot-file, then
``os.replace``), so a SIGKILL never leaves a torn marker, only possibly a dot-file:

- ``runs-T-n``    first thing, once per run: which worker ran which attempt, and when;
- ``effect-T-n``  the simulated external side effect, just before returning.

The payload steers the timing (all keys optional):

- ``hold``: a list of attempt numbers that wait, after ``runs-T-n``, until the test
  writes ``release-T-n`` (polled every 10 ms; an async sleep, so a lost lease can cancel
  it);
- ``sleep``: seconds to sleep before the effect (default 0).

The result is ``{"task": T, "attempt": n, "worker": <$ORBIT_DRILL_NAME>}``.

With ``$ORBIT_DRILL_GATE`` set to a path, the worker does not connect until that file
exists: the test can pay a process's start-up while another worker is busy, and let it in
at a chosen moment (until then the process holds no session and can claim nothing).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from orbit.worker.runner import Context, Worker

NAME = os.environ.get("ORBIT_DRILL_NAME", "drill")
DIR = Path(os.environ.get("ORBIT_DRILL_DIR", "."))


class GatedWorker(Worker):
    """A ``Worker`` that first waits for the ``$ORBIT_DRILL_GATE`` file, if one is set."""

    async def arun(self, *, install_signals: bool = False) -> int:
        gate = os.environ.get("ORBIT_DRILL_GATE")
        while gate and not Path(gate).exists():
            await asyncio.sleep(0.01)
        return await super().arun(install_signals=install_signals)


worker = GatedWorker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name=NAME,
    concurrency=int(os.environ.get("ORBIT_DRILL_CONCURRENCY", "1")),
    grace=5.0,
    cancel_grace=1.0,
)


def _mark(name: str, ctx: Context) -> None:
    info = {
        "worker": NAME,
        "pid": os.getpid(),
        "attempt": ctx.attempt,
        "attempt_id": ctx.attempt_id,
        "t": time.time(),
    }
    tmp = DIR / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, DIR / name)


@worker.handler("lease.drill")
async def drill(ctx: Context, payload: Any) -> Any:
    spec = payload if isinstance(payload, dict) else {}
    run = f"{ctx.task_id}-{ctx.attempt}"
    _mark(f"runs-{run}", ctx)
    if ctx.attempt in spec.get("hold", []):
        release = DIR / f"release-{run}"
        while not release.exists():
            await asyncio.sleep(0.01)
    if spec.get("sleep"):
        await asyncio.sleep(float(spec["sleep"]))
    _mark(f"effect-{run}", ctx)
    return {"task": ctx.task_id, "attempt": ctx.attempt, "worker": NAME}
