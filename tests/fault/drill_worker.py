"""A worker for the lifecycle drills (DESIGN §5), run as a real process:

    ORBIT_DRILL_DIR=/tmp/x python -m orbit.cli worker tests.fault.drill_worker:worker

The test controls each handler's timing through files in ``$ORBIT_DRILL_DIR`` (every
name ends with the task id; every file holds the ``time.time()`` it was written at):

- ``run-<task>-<attempt>``  written first, once per run (a rerun leaves a second one);
- ``started-<task>``        then, once the handler is under way;
- ``effect-<task>``         the external side effect (before or after the wait);
- ``go-<task>``             written BY THE TEST: the handler's "navigation" completes;
- ``cancelled-<task>``      the instant the handler first observed cancellation;
- ``returned-<task>``       written just before the handler returns its result.

The payload says what a run does (all keys optional):

- ``fail`` (bool): raise ``Retry`` at once, every attempt (a retryable failure);
- ``effect``: ``"before"`` or ``"after"`` the wait (or absent: no effect);
- ``wait`` (seconds, default 30): how long to wait for ``go-<task>``; 0 does not wait;
  no ``go`` in time fails the attempt for good (``NO_GO``);
- ``on_cancel``: ``"stop"`` (default: stop at once) or ``"finish"`` (note the
  cancellation, keep waiting for ``go`` and return the real result anyway: a result
  that arrives after the cancel committed);
- ``artifact`` (bool): upload ``shot.png`` once ``go`` is there;
- ``result``: what to return (default ``{"task": <id>, "attempt": <n>}``).

``drill.async`` is an async handler; ``drill.sync`` a plain function (it runs in a
thread of its own and observes cancellation through ``ctx.cancelled``). Marker files are
written atomically (a dot-file then ``os.replace``), so a kill never leaves a torn one.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

from orbit.worker.runner import Context, Fail, Retry, Worker

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name=os.environ.get("ORBIT_DRILL_NAME", "drill-worker"),
    concurrency=int(os.environ.get("ORBIT_DRILL_CONCURRENCY", "4")),
    grace=float(os.environ.get("ORBIT_DRILL_GRACE", "5")),
    cancel_grace=float(os.environ.get("ORBIT_DRILL_CANCEL_GRACE", "5")),
)
DIR = Path(os.environ.get("ORBIT_DRILL_DIR", "."))
POLL = 0.005  # how often a waiting handler looks for its go file / the cancel flag
PNG = b"\x89PNG\r\n\x1a\n" + b"drill screenshot"


def mark(name: str, *, exclusive: bool = False) -> bool:
    """Write ``DIR/name`` atomically with the current time. ``exclusive``: only if it
    does not exist yet (returns whether it was written)."""
    target = DIR / name
    if exclusive and target.exists():
        return False
    tmp = DIR / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(repr(time.time()))
    os.replace(tmp, target)
    return True


def _begin(ctx: Context, payload: dict[str, Any]) -> None:
    mark(f"run-{ctx.task_id}-{ctx.attempt}")
    mark(f"started-{ctx.task_id}")
    if payload.get("fail"):
        raise Retry(f"attempt {ctx.attempt} failed on purpose", code="DRILL_TRANSIENT")
    if payload.get("effect") == "before":
        mark(f"effect-{ctx.task_id}")


def _saw_cancel(ctx: Context) -> None:
    mark(f"cancelled-{ctx.task_id}", exclusive=True)


def _result(ctx: Context, payload: dict[str, Any]) -> Any:
    if payload.get("effect") == "after":
        mark(f"effect-{ctx.task_id}")
    return payload.get("result", {"task": ctx.task_id, "attempt": ctx.attempt})


@worker.handler("drill.async")
async def drill_async(ctx: Context, payload: dict[str, Any]) -> Any:
    _begin(ctx, payload)
    wait = float(payload.get("wait", 30))
    keep_going = payload.get("on_cancel") == "finish"
    go = DIR / f"go-{ctx.task_id}"
    end = time.monotonic() + wait
    while wait > 0 and not go.exists():
        if time.monotonic() > end:
            raise Fail("go never came", code="NO_GO")
        try:
            await asyncio.sleep(POLL)
        except asyncio.CancelledError:
            _saw_cancel(ctx)
            if not keep_going:
                raise
            # Deliberately swallowed: the real result is still on its way.
    result = _result(ctx, payload)
    if payload.get("artifact"):
        await ctx.upload("shot.png", PNG, "image/png")
    mark(f"returned-{ctx.task_id}")
    return result


@worker.handler("drill.sync")
def drill_sync(ctx: Context, payload: dict[str, Any]) -> Any:
    _begin(ctx, payload)
    wait = float(payload.get("wait", 30))
    keep_going = payload.get("on_cancel") == "finish"
    go = DIR / f"go-{ctx.task_id}"
    end = time.monotonic() + wait
    while wait > 0 and not go.exists():
        if time.monotonic() > end:
            raise Fail("go never came", code="NO_GO")
        if ctx.cancelled:
            _saw_cancel(ctx)
            if not keep_going:
                ctx.check()  # raises Cancelled
        time.sleep(POLL)
    result = _result(ctx, payload)
    if payload.get("artifact"):
        ctx.upload_from_thread("shot.png", PNG, "image/png")
    mark(f"returned-{ctx.task_id}")
    return result
