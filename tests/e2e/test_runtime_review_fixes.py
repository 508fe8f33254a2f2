"""The runner's handling of odd handler outcomes, against a real server on SQLite and
PostgreSQL: a handler's own ``KeyboardInterrupt`` under ``orbit worker`` fails its attempt
(it ended the whole worker, exit 130), a ``BaseExceptionGroup`` holding a ``Fail`` is that
``Fail`` (it was a retryable ``BaseExceptionGroup``), and a plain function that finishes
after its lease was lost says its outcome is dropped (it was dropped without a word)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.worker.runner import Context, Fail, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import FAST, _wait_for, api, fast, run_until, submit, wait_state  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
DROPPED = "the handler finished, but its outcome is dropped"


def _until(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    end = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < end, f"{what}: never"
        time.sleep(0.02)
    return found


def test_a_handlers_own_keyboard_interrupt_fails_its_attempt_not_the_worker(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``orbit worker`` handles SIGINT on its loop, so a KeyboardInterrupt inside an async
    handler is the handler's own raise: its attempt fails retryably (code
    KeyboardInterrupt), as SystemExit's does; the plain function beside it finishes, the
    worker takes more work and exits 0 on SIGTERM. It ended the worker at once, exit
    130, nothing logged, and both tasks went to needs_review."""
    env = {
        **os.environ,
        "ORBIT_URL": fast.http,
        "ORBIT_TOKEN": tokens.worker,
        "ORBIT_TEST_MARKS": str(tmp_path),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "tests.e2e.runtime_review_app:worker"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        held = submit(api, "hold", max_attempts=1)
        _wait_for(tmp_path / f"start-{held}")
        raised = submit(api, "interrupt", max_attempts=1)

        def ended() -> dict[str, Any] | None:
            assert proc.poll() is None, f"the worker exited {proc.returncode}"
            task = api.get(f"/v1/tasks/{raised}").json()
            return None if task["state"] in {"queued", "claimed", "running"} else task

        task = _until("the interrupted task's end", ended)
        assert task["state"] == "failed", task
        assert task["error"]["code"] == "KeyboardInterrupt" and task["error"]["retryable"], task
        (tmp_path / f"release-{held}").write_text("go")
        assert wait_state(api, held, {"succeeded", "failed", "needs_review"})["result"] == "held"
        after = submit(api, "ok")
        assert wait_state(api, after, {"succeeded", "failed", "needs_review"})["result"] == "ok"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "the handler raised KeyboardInterrupt" in out  # with its traceback, as any


def test_a_base_exception_group_holding_a_fail_is_that_fail(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
) -> None:
    """A group that also holds a BaseException (GeneratorExit: an asyncio.TaskGroup's
    child) came to the runner wrapped, and was reported as a retryable
    BaseExceptionGroup, not as the Fail it held: the task was run again. Async handler
    and plain function alike."""
    worker = Worker(fast.http, tokens.worker)

    def group() -> BaseExceptionGroup[BaseException]:
        return BaseExceptionGroup("g", [Fail("nope", code="F1"), GeneratorExit()])

    @worker.handler("async-group")
    async def async_group(ctx: Context, payload: Any) -> Any:
        raise group()

    @worker.handler("plain-group")
    def plain_group(ctx: Context, payload: Any) -> Any:
        raise group()

    ids = [submit(api, h, max_attempts=3) for h in ("async-group", "plain-group")]
    asyncio.run(run_until(worker, lambda: worker.finished == 2))
    for tid in ids:
        task = wait_state(api, tid, {"failed", "scheduled", "queued", "needs_review"})
        assert task["state"] == "failed" and task["attempts_used"] == 1, task
        assert task["error"] == {"code": "F1", "message": "nope", "retryable": False}, task


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_plain_handler_finishing_after_its_lease_was_lost_says_its_outcome_is_dropped(
    nodes: Callable[..., Node],
    tokens: Tokens,
    caplog: pytest.LogCaptureFixture,
    abandoned: bool,
) -> None:
    """The node is killed under a running plain function: its lease (1 s) runs out by the
    worker's clock, the attempt is lost and the function told to stop. It then returns
    a result, within its cancel_grace or, abandoned, later: either way the worker logs
    that the outcome is dropped, as it does for an async handler (it said nothing)."""
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    node = nodes(args=FAST)
    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as admin:
        admin.post("/v1/queues", json={"name": "q", "max_concurrency": 50, "rate": 0})
        tid = submit(admin, "late")
    worker = Worker(node.http, tokens.worker, cancel_grace=0.2 if abandoned else 30)
    started, release = threading.Event(), threading.Event()

    @worker.handler("late")
    def late(ctx: Context, payload: Any) -> Any:
        started.set()
        while not ctx.cancelled:  # told by the worker's clock that the lease is gone
            time.sleep(0.01)
        if abandoned:
            release.wait(30)  # past its cancel_grace: abandoned, and still finishing
        return "too late"

    def warnings() -> str:
        return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)

    runner = threading.Thread(target=asyncio.run, args=(worker.arun(),))
    runner.start()
    try:
        assert started.wait(30), "the handler never started"
        node.kill()
        _until("the attempt lost", lambda: f"(task {tid}) lost: lease expired" in warnings())
        if abandoned:
            _until("the handler abandoned", lambda: "abandoning it" in warnings())
            release.set()
        line = _until(
            "the dropped outcome logged",
            lambda: next((m for m in warnings().splitlines() if DROPPED in m), None),
        )
        assert line.startswith("attempt ") and f"(task {tid})" in line, line
        assert "lease expired" in line, line  # why, as the lost line said
    finally:
        release.set()
        worker.stop(now=True)
        runner.join(60)
    assert not runner.is_alive()
    assert warnings().count(DROPPED) == 1, warnings()  # once, not again on the way out


def test_under_arun_without_signals_a_keyboard_interrupt_still_ends_the_run(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
) -> None:
    """``await worker.arun()`` installs no SIGINT handler: there a KeyboardInterrupt may be
    the process's own Ctrl-C, which must reach the caller, so it still ends the run."""
    worker = Worker(fast.http, tokens.worker)

    @worker.handler("interrupt")
    async def interrupt(ctx: Context, payload: Any) -> Any:
        raise KeyboardInterrupt

    submit(api, "interrupt", max_attempts=1)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(worker.arun())
