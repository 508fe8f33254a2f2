"""Signals and ``orbit worker``: a second Ctrl-C stops at once, and ``arun`` puts back the
signal handlers its caller had on the loop. Real processes, as a user would run them."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import FAST, _wait_for, _worker_process, submit, wait_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fast(nodes: Callable[..., Node]) -> Node:
    return nodes(args=FAST)


@pytest.fixture
def api(fast: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=fast.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as client:
        client.post("/v1/queues", json={"name": "q", "max_concurrency": 50, "rate": 0})
        yield client


def _read_until(proc: subprocess.Popen[str], text: str) -> list[str]:
    """The worker's output lines up to the first that holds ``text``."""
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never logged:\n{''.join(lines)}")


@pytest.mark.parametrize("retry_safe", [True, False])
def test_a_second_ctrl_c_cancels_running_handlers_at_once(
    fast: Node, tokens: Tokens, api: httpx.Client, tmp_path: Path, retry_safe: bool
) -> None:
    """The first SIGINT drains with a grace of ten minutes; the second cuts it short,
    as it stops ``orbit server`` at once: the handler is cancelled, and its task then
    follows the grace's rules (a retry_safe one reported CANCELLED and run again, any
    other left to its lease, needs_review). The second Ctrl-C once did nothing: the
    worker waited out the whole grace."""
    proc = _worker_process(
        fast, tokens, tmp_path, ORBIT_TEST_GRACE="600", ORBIT_TEST_CANCEL_GRACE="5"
    )
    try:
        tid = submit(api, "sleep", {"seconds": 600}, retry_safe=retry_safe, max_attempts=3)
        _wait_for(tmp_path / f"start-{tid}")
        proc.send_signal(signal.SIGINT)
        lines = _read_until(proc, "stopping: draining")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)  # a guard: the grace left is ten minutes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(lines) + out
    assert proc.returncode == 0, out
    assert "stopping now" in out
    assert not (tmp_path / f"done-{tid}").exists()
    if retry_safe:
        task = wait_state(api, tid, {"queued", "scheduled"})
        events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
        assert "CANCELLED" in [e["code"] for e in events], events
    else:
        task = wait_state(api, tid, {"needs_review", "queued", "scheduled", "failed"})
        assert task["state"] == "needs_review", task
    assert task["attempts_used"] == 1


CALLER = """
import asyncio, signal, sys

from orbit.aio import loop_factory
from orbit.worker.runner import Worker

worker = Worker("http://127.0.0.1:9", "orbit_unused_token", reconnect_max=0.2)


@worker.handler("h")
async def h(ctx, payload):
    return None


def installed(loop):
    handlers = getattr(loop, "_signal_handlers", None)
    if isinstance(handlers, dict):
        return signal.SIGTERM in handlers
    return signal.getsignal(signal.SIGTERM) == loop._Loop__sighandler


async def run_and_stop(loop):
    run = asyncio.create_task(worker.arun(install_signals=True))
    while not installed(loop):  # the worker's SIGTERM handler
        await asyncio.sleep(0.01)
    signal.raise_signal(signal.SIGTERM)
    print("worker returned", await run, flush=True)


async def main():
    loop = asyncio.get_running_loop()
    runners = signal.getsignal(signal.SIGINT)  # the Runner's: it cancels main()
    await run_and_stop(loop)
    print("the runner's handler is back:", signal.getsignal(signal.SIGINT) == runners)
    mine = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, mine.set)
    await run_and_stop(loop)
    signal.raise_signal(signal.SIGINT)
    await asyncio.wait_for(mine.wait(), 30)
    print("the caller's handler ran", flush=True)


factory = loop_factory() if sys.argv[1] == "uvloop" else None
with asyncio.Runner(loop_factory=factory) as runner:
    runner.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_arun_puts_back_the_signal_handler_its_caller_had(loop: str) -> None:
    """A SIGINT handler the caller had put on its loop before ``arun(install_signals=
    True)`` is still there when the run ends, and without one the process's is put back
    (``asyncio.run``'s, which cancels its main task): both were removed, and the caller's
    next Ctrl-C raised KeyboardInterrupt wherever it landed instead."""
    proc = subprocess.run(
        [sys.executable, "-c", CALLER, loop],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("worker returned 0") == 2
    assert "the runner's handler is back: True" in proc.stdout
    assert "the caller's handler ran" in proc.stdout
