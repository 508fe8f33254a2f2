"""The automatic runner against a real server process, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from orbit.store import sqlite_path
from orbit.worker import connection as connection_module
from orbit.worker.runner import Context, Fail, Worker
from tests.e2e.servers import Node, Tokens

FAST = ["--lease-ttl", "1", "--claim-ttl", "2", "--reap-interval", "0.1", "--poll-interval", "0.5"]


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


def submit(api: httpx.Client, handler: str, payload: Any = None, **kw: Any) -> str:
    reply = api.post("/v1/tasks", json={"queue": "q", "handler": handler, "payload": payload, **kw})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["task"]["id"])


def wait_state(
    api: httpx.Client, task_id: str, states: set[str], timeout: float = 30
) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        task = api.get(f"/v1/tasks/{task_id}").json()
        if task["state"] in states:
            return dict(task)
        assert time.monotonic() < end, f"task stayed {task['state']}"
        time.sleep(0.05)


async def run_until(worker: Worker, done: Callable[[], bool], timeout: float = 30) -> None:
    """Run the worker in this loop until ``done()``, then drain it."""
    runner = asyncio.create_task(worker.arun())
    end = time.monotonic() + timeout
    try:
        while not done():
            assert not runner.done(), runner.exception()
            assert time.monotonic() < end, "timed out"
            await asyncio.sleep(0.02)
    finally:
        worker.stop()
        await asyncio.wait_for(runner, 30)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_concurrency_limits_are_honoured(
    fast: Node, tokens: Tokens, api: httpx.Client, prefetch: int
) -> None:
    """Also with a prefetch: the server pushes up to 6 (3 + 3) attempts, and the worker
    still runs at most 3 handlers, at most 2 of ``narrow``."""
    worker = Worker(fast.http, tokens.worker, concurrency=3, prefetch=prefetch)
    live = {"now": 0, "peak": 0, "h": 0, "h_peak": 0}

    @worker.handler("narrow", capacity=2)
    async def narrow(ctx: Context, payload: Any) -> Any:
        live["h"] += 1
        live["h_peak"] = max(live["h_peak"], live["h"])
        return await wide(
            ctx, payload, count=False, after=lambda: live.__setitem__("h", live["h"] - 1)
        )

    @worker.handler("wide")
    async def wide(
        ctx: Context, payload: Any, count: bool = True, after: Callable[[], None] | None = None
    ) -> Any:
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        await asyncio.sleep(0.1)
        live["now"] -= 1
        if after:
            after()
        return "ok"

    ids = [submit(api, "narrow") for _ in range(6)] + [submit(api, "wide") for _ in range(6)]
    asyncio.run(run_until(worker, lambda: worker.finished == len(ids)))
    assert live["peak"] <= 3 and live["h_peak"] <= 2
    assert live["peak"] == 3  # the cap was reached, so the limit really held something back
    assert all(api.get(f"/v1/tasks/{i}").json()["state"] == "succeeded" for i in ids)


def test_a_prefetched_attempt_waits_claimed_not_started_until_a_slot_frees(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """Concurrency 2, prefetch 2, six tasks: the server sees 4 slots, so 2 tasks run and
    2 more wait on the worker, `claimed` in the store (no start, no lease); each
    handler's end starts one of them."""
    worker = Worker(fast.http, tokens.worker, concurrency=2, prefetch=2)
    inside: set[str] = set()
    ran: list[str] = []
    go = asyncio.Event()

    @worker.handler("gated")
    async def gated(ctx: Context, payload: Any) -> Any:
        inside.add(ctx.task_id)
        ran.append(ctx.task_id)
        try:
            await go.wait()
        finally:
            inside.discard(ctx.task_id)
        return "ok"

    ids = [submit(api, "gated") for _ in range(6)]

    def states() -> list[str]:
        return [api.get(f"/v1/tasks/{i}").json()["state"] for i in ids]

    async def main() -> list[str]:
        runner = asyncio.create_task(worker.arun())
        try:
            end = time.monotonic() + 30
            while sorted(seen := await asyncio.to_thread(states)) != sorted(
                ["running"] * 2 + ["claimed"] * 2 + ["queued"] * 2
            ):
                assert time.monotonic() < end, seen
                assert not runner.done(), runner.exception()
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # nothing more starts while the two run
            assert len(inside) == 2 and len(ran) == 2
            now = await asyncio.to_thread(states)
            waiting = [i for i, s in zip(ids, now, strict=True) if s == "claimed"]
            assert len(waiting) == 2 and not set(waiting) & set(ran)
            for i in waiting:
                assert api.get(f"/v1/tasks/{i}").json()["attempts_used"] == 0
            go.set()
            while worker.finished < len(ids):
                assert time.monotonic() < end, "timed out"
                await asyncio.sleep(0.02)
            return waiting
        finally:
            worker.stop()
            await asyncio.wait_for(runner, 30)

    waiting = asyncio.run(main())
    assert sorted(ran) == sorted(ids) and set(waiting) <= set(ran)
    assert all(api.get(f"/v1/tasks/{i}").json()["state"] == "succeeded" for i in ids)


def test_a_prefetched_attempt_whose_claim_runs_out_is_never_run_under_it(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """The claim lease is 2 s here and the running handler takes 2.8 s: the attempt
    waiting behind it loses its claim (the reaper puts the task back), and it is not run
    under that claim: the task runs once, under a later claim, and the worker goes on."""
    worker = Worker(fast.http, tokens.worker, concurrency=1, prefetch=1)
    seen: dict[str, list[int]] = {}

    @worker.handler("h")
    async def h(ctx: Context, payload: Any) -> Any:
        seen.setdefault(ctx.task_id, []).append(ctx.attempt)
        await asyncio.sleep(payload["seconds"])
        return "ok"

    async def main() -> tuple[str, str]:
        runner = asyncio.create_task(worker.arun())
        try:
            slow = await asyncio.to_thread(submit, api, "h", {"seconds": 2.8})
            end = time.monotonic() + 30
            while slow not in seen:
                assert time.monotonic() < end and not runner.done()
                await asyncio.sleep(0.02)
            late = await asyncio.to_thread(submit, api, "h", {"seconds": 0})
            while worker.finished < 2:
                assert time.monotonic() < end, "timed out"
                assert not runner.done(), runner.exception()
                await asyncio.sleep(0.02)
            return slow, late
        finally:
            worker.stop()
            await asyncio.wait_for(runner, 30)

    slow, late = asyncio.run(main())
    assert seen[slow] == [1]
    # Its first claim ran out unstarted, and the second one ran (the attempts below):
    # its first started attempt, which ctx.attempt counts (released claims do not).
    assert seen[late] == [1]
    task = api.get(f"/v1/tasks/{late}").json()
    assert task["state"] == "succeeded" and task["attempts_used"] == 1
    attempts = api.get(f"/v1/tasks/{late}/attempts").json()["items"]
    assert [a["state"] for a in attempts] == ["released", "succeeded"]


def test_renewal_keeps_a_three_lease_handler_alive(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    worker = Worker(fast.http, tokens.worker)

    @worker.handler("slow")
    async def slow(ctx: Context, payload: Any) -> Any:
        await asyncio.sleep(3.2)  # the lease is 1 s
        return "done"

    tid = submit(api, "slow")
    asyncio.run(run_until(worker, lambda: worker.finished == 1))
    task = api.get(f"/v1/tasks/{tid}").json()
    assert task["state"] == "succeeded" and task["attempts_used"] == 1


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_cancel_reaches_the_handler(
    fast: Node, tokens: Tokens, api: httpx.Client, kind: str
) -> None:
    worker = Worker(fast.http, tokens.worker)
    seen: dict[str, Any] = {}
    started = threading.Event()

    if kind == "async":

        @worker.handler("wait")
        async def wait_async(ctx: Context, payload: Any) -> Any:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen["cancelled"] = ctx.reason
                raise
            return "finished anyway"
    else:

        @worker.handler("wait")
        def wait_sync(ctx: Context, payload: Any) -> Any:
            started.set()
            end = time.monotonic() + 60
            while not ctx.cancelled and time.monotonic() < end:
                time.sleep(0.01)
            seen["cancelled"] = ctx.reason
            ctx.check()
            return "finished anyway"

    tid = submit(api, "wait")

    def cancel_when_started() -> None:
        started.wait(30)
        api.post(f"/v1/tasks/{tid}/cancel")

    canceller = threading.Thread(target=cancel_when_started)
    canceller.start()
    asyncio.run(run_until(worker, lambda: "cancelled" in seen and not worker.running))
    canceller.join()
    task = wait_state(api, tid, {"cancelled"})
    assert seen["cancelled"] == "task cancelled"
    assert task["result"] is None


def renewal_free_worker(node: Node, token: str, sleep_s: float) -> tuple[Worker, dict[str, Any]]:
    """A worker that never renews its leases, with a ``slow`` handler that sleeps
    ``sleep_s`` and records the reason it was cancelled for (in the returned dict)."""
    worker = Worker(node.http, token)
    worker.pause_renewals = True
    seen: dict[str, Any] = {}

    @worker.handler("slow")
    async def slow(ctx: Context, payload: Any) -> Any:
        try:
            await asyncio.sleep(sleep_s)
        except asyncio.CancelledError:
            seen["reason"] = ctx.reason
            raise
        return "must not be committed"

    return worker, seen


def test_lease_loss_cancels_the_handler_and_drops_its_result(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    worker, seen = renewal_free_worker(fast, tokens.worker, 3)
    tid = submit(api, "slow", retry_safe=False)
    asyncio.run(run_until(worker, lambda: "reason" in seen and not worker.running))
    assert seen["reason"] == "lease expired"
    task = wait_state(api, tid, {"needs_review"})
    assert task["result"] is None and task["attempts_used"] == 1
    kinds = [e["kind"] for e in api.get(f"/v1/tasks/{tid}/events").json()["items"]]
    assert "succeeded" not in kinds and "rejected" not in kinds  # nothing was even sent


def test_ack_loss_on_finish_commits_exactly_once(
    fast: Node, tokens: Tokens, api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first finish reaches the server, then the connection is cut before its reply:
    the runner reconnects, resumes, re-sends the same outcome, and gets the same receipt."""
    worker = Worker(fast.http, tokens.worker)
    runs: list[str] = []
    cut: list[str] = []
    original = connection_module.WorkerConnection.request

    async def request(
        self: Any, message: dict[str, Any], timeout: float = 30.0, **options: Any
    ) -> Any:
        if message.get("type") == "finish" and not cut:
            cut.append(message["attempt_id"])
            await self.ws.send(connection_module.json.dumps({**message, "req_id": "lost"}))
            await asyncio.sleep(0.3)  # let the server commit it
            await self.ws.close()
            raise ConnectionError("cut after sending finish")
        return await original(self, message, timeout, **options)

    monkeypatch.setattr(connection_module.WorkerConnection, "request", request)

    @worker.handler("once")
    async def once(ctx: Context, payload: Any) -> Any:
        runs.append(ctx.attempt_id)
        return {"value": 42}

    tid = submit(api, "once")
    asyncio.run(run_until(worker, lambda: worker.finished == 1))
    task = api.get(f"/v1/tasks/{tid}").json()
    assert cut and runs == cut  # the handler ran once, its finish was cut once
    assert task["state"] == "succeeded" and task["result"] == {"value": 42}
    assert task["result_version"] == "1" and task["attempts_used"] == 1
    events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
    assert [e["kind"] for e in events].count("succeeded") == 1
    # The re-sent finish was answered with the receipt, not refused. (A renewal that raced
    # the first finish may be refused as ATTEMPT_ENDED: the runner keeps renewing until a
    # finish is confirmed, so the lease cannot lapse while it retries.)
    refused = [e["data"]["report"] for e in events if e["kind"] == "rejected"]
    assert "finish" not in refused


def test_concurrent_reports_travel_in_batches_and_survive_ack_loss(
    fast: Node, tokens: Tokens, api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty attempts end together: their finishes coalesce into finish_many batches. The
    first batch reaches the server and its reply is lost: the runner resumes and re-sends
    the very same outcomes, each committed once, every handler run once."""
    n = 20
    worker = Worker(fast.http, tokens.worker, concurrency=n)
    sent: list[dict[str, Any]] = []
    runs: list[str] = []
    original = connection_module.WorkerConnection.request

    async def request(
        self: Any, message: dict[str, Any], timeout: float = 30.0, **options: Any
    ) -> Any:
        if message.get("type") == "finish_many" and not any(
            m.get("req_id") == "lost" for m in sent
        ):
            sent.append({**message, "req_id": "lost"})
            await self.ws.send(connection_module.json.dumps({**message, "req_id": "lost"}))
            await asyncio.sleep(0.3)  # let the server commit the batch
            await self.ws.close()
            raise ConnectionError("cut after sending finish_many")
        if message.get("type") in ("start_many", "finish_many"):
            sent.append(message)  # sent normally (a re-sent batch among them)
        return await original(self, message, timeout, **options)

    monkeypatch.setattr(connection_module.WorkerConnection, "request", request)
    everyone = asyncio.Event()

    @worker.handler("together")
    async def together(ctx: Context, payload: Any) -> Any:
        runs.append(ctx.attempt_id)
        if len(runs) == n:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 20)
        return {"task": ctx.task_id}

    tids = [submit(api, "together", retry_safe=False) for _ in range(n)]
    asyncio.run(run_until(worker, lambda: worker.finished == n))
    assert sorted(runs) == sorted(set(runs)) and len(runs) == n  # each handler ran once
    lost = [m for m in sent if m.get("req_id") == "lost"]
    assert len(lost) == 1 and len(lost[0]["items"]) > 1, "no batched finish was cut"
    cut_ids = {item["attempt_id"] for item in lost[0]["items"]}
    resent = [m for m in sent if m["type"] == "finish_many" and m.get("req_id") != "lost"]
    assert any({i["attempt_id"] for i in m["items"]} == cut_ids for m in resent)
    for tid in tids:
        task = api.get(f"/v1/tasks/{tid}").json()
        assert task["state"] == "succeeded" and task["result"] == {"task": tid}
        assert task["result_version"] == "1" and task["attempts_used"] == 1
        events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
        assert [e["kind"] for e in events].count("succeeded") == 1
        assert "finish" not in [e["data"]["report"] for e in events if e["kind"] == "rejected"]


def test_fail_and_exceptions_choose_the_outcome(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    worker = Worker(fast.http, tokens.worker)

    @worker.handler("fatal")
    async def fatal(ctx: Context, payload: Any) -> Any:
        raise Fail("bad input", code="BAD_INPUT")

    @worker.handler("flaky")
    def flaky(ctx: Context, payload: Any) -> Any:
        ctx.progress(0.5, f"attempt {ctx.attempt} halfway")  # from a thread: safe
        if ctx.attempt == 1:
            raise RuntimeError("transient")
        return "second time lucky"

    @worker.handler("charge", retry_safe=False)
    async def charge(ctx: Context, payload: Any) -> Any:
        raise AssertionError("a replayable task must not reach an unsafe handler")

    mismatch_id = submit(api, "charge", retry_safe=True)
    fatal_id = submit(api, "fatal")
    flaky_id = submit(api, "flaky", backoff={"base": 0.05, "factor": 1, "max": 0.05})
    asyncio.run(run_until(worker, lambda: worker.finished == 4))
    mismatch = api.get(f"/v1/tasks/{mismatch_id}").json()
    assert mismatch["state"] == "failed"
    assert mismatch["error"]["code"] == "RETRY_SAFETY_MISMATCH"
    fatal_task = api.get(f"/v1/tasks/{fatal_id}").json()
    assert fatal_task["state"] == "failed" and fatal_task["error"]["code"] == "BAD_INPUT"
    flaky_task = wait_state(api, flaky_id, {"succeeded"})
    assert flaky_task["attempts_used"] == 2
    events = api.get(f"/v1/tasks/{flaky_id}/events").json()["items"]
    messages = [e["data"]["message"] for e in events if e["kind"] == "progress"]
    assert "attempt 2 halfway" in messages  # progress reaches the history


class _NotFound(Fail):
    def __init__(self, key: str) -> None:  # no Fail.__init__: no code, no message set
        Exception.__init__(self, f"no such key {key}")


class _Declined(Fail):
    code = "CARD_DECLINED"


def test_odd_exceptions_still_finish_their_tasks(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """Each of these reported nothing, and its task stayed running (StopIteration, which
    a thread's future refused: its lease renewed for ever) or went to needs_review on its
    lease (a Fail subclass that skipped Fail.__init__); a class-level code was lost."""
    worker = Worker(fast.http, tokens.worker)

    @worker.handler("first")
    def first(ctx: Context, payload: Any) -> Any:
        return next(iter(payload["items"]))

    @worker.handler("lookup")
    async def lookup(ctx: Context, payload: Any) -> Any:
        raise _NotFound("k1")

    @worker.handler("charge")
    def charge(ctx: Context, payload: Any) -> Any:
        raise _Declined("card declined")

    first_id = submit(api, "first", {"items": []}, max_attempts=1)
    lookup_id = submit(api, "lookup")
    charge_id = submit(api, "charge")
    asyncio.run(run_until(worker, lambda: worker.finished == 3))
    first_task = wait_state(api, first_id, {"failed"})
    assert first_task["error"]["code"] == "StopIteration"
    assert first_task["error"]["retryable"] is True
    lookup_task = wait_state(api, lookup_id, {"failed"})
    assert lookup_task["error"] == {
        "code": "FAILED",
        "message": "no such key k1",
        "retryable": False,
    }
    charge_task = wait_state(api, charge_id, {"failed"})
    assert charge_task["error"]["code"] == "CARD_DECLINED"


def test_a_progress_message_with_a_lone_surrogate_or_a_nul_is_recorded(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """A progress message naming a file whose name is not UTF-8 (``os.listdir`` gives
    it a lone surrogate) was sent as it was: the server refused it unread, without a
    req_id, so the report waited out its timeout and closed the worker's connection, and
    it was never recorded; a NUL was refused too. The message is now sent escaped."""
    worker = Worker(fast.http, tokens.worker)
    recorded = threading.Event()
    messages: list[str] = []

    @worker.handler("scan")
    def scan(ctx: Context, payload: Any) -> Any:
        ctx.progress(0.5, "reading \udcff.txt\x00")
        recorded.wait(30)  # the test sees the event in the history, or gives up
        return "done"

    tid = submit(api, "scan")

    def watch() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end and not messages:
            events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
            messages.extend(e["data"]["message"] for e in events if e["kind"] == "progress")
            time.sleep(0.05)
        recorded.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    asyncio.run(run_until(worker, lambda: worker.finished == 1, timeout=60))
    watcher.join()
    assert messages == ["reading \\udcff.txt\\x00"]
    assert wait_state(api, tid, {"succeeded"})["result"] == "done"


def test_progress_pending_when_the_handler_returns_is_not_sent_after_the_finish(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """A progress report made while an earlier one was still in flight waited for that
    one's reply; a handler that returned meanwhile had its finish sent first, and the
    report then went out after it: the server refused it (ATTEMPT_ENDED) and the task's
    history held a rejected report for every such handler. It is dropped now."""
    n = 10
    worker = Worker(fast.http, tokens.worker, concurrency=n)

    @worker.handler("quick")
    async def quick(ctx: Context, payload: Any) -> Any:
        ctx.progress(0.1, "begun")
        for _ in range(5):  # a few turns of the loop: the first report is on the wire
            await asyncio.sleep(0)
        ctx.progress(0.9, "nearly")  # waits for the first one's reply
        return "done"

    tids = [submit(api, "quick") for _ in range(n)]
    asyncio.run(run_until(worker, lambda: worker.finished == n))
    for tid in tids:
        assert wait_state(api, tid, {"succeeded"})["result"] == "done"
        events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
        rejected = [(e["code"], e["data"].get("report")) for e in events if e["kind"] == "rejected"]
        assert rejected == []
        assert "begun" in [e["data"]["message"] for e in events if e["kind"] == "progress"]


def test_a_timeout_error_raised_by_the_handler_is_its_own_failure(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """A handler whose own call timed out failed like any handler that raised: it is not
    the attempt's timeout (ATTEMPT_TIMEOUT), nor, under a deadline, a report dropped."""
    worker = Worker(fast.http, tokens.worker)

    @worker.handler("upstream.async")
    async def upstream_async(ctx: Context, payload: Any) -> Any:
        async with asyncio.timeout(0):
            await asyncio.sleep(1)

    @worker.handler("upstream.sync")
    def upstream_sync(ctx: Context, payload: Any) -> Any:
        raise TimeoutError("the upstream did not answer")

    deadline = (datetime.now(UTC) + timedelta(minutes=10)).isoformat()
    under_deadline = submit(api, "upstream.async", max_attempts=1, deadline=deadline)
    timed = submit(api, "upstream.sync", max_attempts=1, attempt_timeout=60)
    plain = submit(api, "upstream.sync", max_attempts=1)
    asyncio.run(run_until(worker, lambda: worker.finished == 3))
    for tid in (under_deadline, timed, plain):
        task = wait_state(api, tid, {"failed"})
        assert task["error"]["code"] == "TimeoutError", task["error"]
        assert task["attempts_used"] == 1
    assert api.get(f"/v1/tasks/{plain}").json()["error"]["message"] == (
        "the upstream did not answer"
    )


def test_an_async_handler_that_swallows_its_timeout_is_abandoned_and_never_run_twice(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """An async handler that catches the CancelledError of its attempt timeout once held
    its attempt for ever: the runner waited for the handler without a bound. It is now
    waited for ``cancel_grace``, as a thread is, then abandoned, and reports nothing: it
    may still be at work. It reported a retryable ATTEMPT_TIMEOUT, and a task that is not
    retry_safe, with attempts left, ran again beside it (I6). Its lease sends it to
    needs_review, its one attempt ``unknown``."""
    worker = Worker(fast.http, tokens.worker, cancel_grace=0.2)
    release = asyncio.Event()

    @worker.handler("stubborn")
    async def stubborn(ctx: Context, payload: Any) -> Any:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()
        return "too late"

    def abandoned() -> bool:
        if worker.abandoned:
            release.set()  # the test is over: let the handler end with the loop
        return bool(worker.abandoned)

    tid = submit(api, "stubborn", attempt_timeout=1, max_attempts=3)
    asyncio.run(run_until(worker, abandoned))
    task = wait_state(api, tid, {"needs_review"})
    assert task["attempts_used"] == 1 and worker.finished == 0
    attempts = api.get(f"/v1/tasks/{tid}/attempts").json()["items"]
    assert [a["state"] for a in attempts] == ["unknown"]


def _worker_process(node: Node, tokens: Tokens, marks: Path, **env: str) -> subprocess.Popen[str]:
    environment = {
        **os.environ,
        "ORBIT_URL": node.http,
        "ORBIT_TOKEN": tokens.worker,
        "ORBIT_TEST_MARKS": str(marks),
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "tests.e2e.worker_app:worker"],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


def _wait_for(path: Path, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.02)


def test_sigterm_drains(fast: Node, tokens: Tokens, api: httpx.Client, tmp_path: Path) -> None:
    proc = _worker_process(fast, tokens, tmp_path)
    try:
        tid = submit(api, "sleep", {"seconds": 1.5})
        _wait_for(tmp_path / f"start-{tid}")
        proc.send_signal(signal.SIGTERM)
        later = submit(api, "sleep", {"seconds": 0})
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert (tmp_path / f"done-{tid}").exists()  # the running handler was allowed to finish
    assert api.get(f"/v1/tasks/{tid}").json()["state"] == "succeeded"
    assert not (tmp_path / f"start-{later}").exists()  # no new claims while draining
    assert api.get(f"/v1/tasks/{later}").json()["state"] == "queued"
    assert "Bearer" not in out and tokens.worker not in out


def test_sigterm_gives_prefetched_attempts_back_unstarted(
    fast: Node, tokens: Tokens, api: httpx.Client, tmp_path: Path
) -> None:
    """A real worker process, concurrency 1 and prefetch 2: on SIGTERM the two attempts
    waiting on it are released (their tasks `queued` again, for another worker to take at
    once), never started, while the running one finishes."""
    proc = _worker_process(
        fast, tokens, tmp_path, ORBIT_TEST_CONCURRENCY="1", ORBIT_TEST_PREFETCH="2"
    )
    try:
        tid = submit(api, "sleep", {"seconds": 2.0})
        _wait_for(tmp_path / f"start-{tid}")
        waiting = [submit(api, "sleep", {"seconds": 0}) for _ in range(2)]
        for w in waiting:
            wait_state(api, w, {"claimed"})
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert api.get(f"/v1/tasks/{tid}").json()["state"] == "succeeded"
    for w in waiting:
        assert not (tmp_path / f"start-{w}").exists()
        task = api.get(f"/v1/tasks/{w}").json()
        assert task["state"] == "queued" and task["attempts_used"] == 0
        attempts = api.get(f"/v1/tasks/{w}/attempts").json()["items"]
        assert [a["state"] for a in attempts] == ["released"]


def test_an_uncooperative_handler_cannot_hang_shutdown(
    fast: Node, tokens: Tokens, api: httpx.Client, tmp_path: Path
) -> None:
    proc = _worker_process(
        fast, tokens, tmp_path, ORBIT_TEST_GRACE="0.5", ORBIT_TEST_CANCEL_GRACE="0.5"
    )
    try:
        tid = submit(api, "stubborn", {"seconds": 120})
        _wait_for(tmp_path / f"start-{tid}")
        proc.send_signal(signal.SIGTERM)
        # A shutdown that waited for the handler (120 s) raises TimeoutExpired here; one
        # bounded by grace + cancel grace (1 s) ends well within the 30 s.
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out  # exit code 1 reports the abandoned handler
    assert "ignored cancellation" in out


@pytest.mark.parametrize("handler", ["stubborn", "stubborn.async"])
def test_a_handler_abandoned_at_shutdown_is_left_to_its_lease(
    fast: Node, tokens: Tokens, api: httpx.Client, tmp_path: Path, handler: str
) -> None:
    """A handler that ignores the drain's cancellation is abandoned, and its attempt is
    left to its lease: it may have had effects, so the server decides (a task that is not
    retry_safe goes to needs_review). The runner once reported it CANCELLED, retryable,
    for a thread, so the task was queued to run again; and an async handler that swallows
    every CancelledError kept ``orbit worker`` from ever exiting, because the event loop's
    close waits for every task it cancels."""
    proc = _worker_process(
        fast, tokens, tmp_path, ORBIT_TEST_GRACE="0.5", ORBIT_TEST_CANCEL_GRACE="0.5"
    )
    try:
        tid = submit(api, handler, {"seconds": 120})
        _wait_for(tmp_path / f"start-{tid}")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out  # exit code 1 reports the abandoned handler
    assert "ignored cancellation" in out
    task = wait_state(api, tid, {"needs_review", "queued", "scheduled", "failed"})
    assert task["state"] == "needs_review", task
    assert task["attempts_used"] == 1
    events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
    assert [e["code"] for e in events if e["kind"] == "needs_review"] == ["LEASE_EXPIRED"]


@pytest.mark.parametrize("held_by", ["queue cap", "worker capacity"])
def test_a_freed_permit_wakes_a_worker_that_a_cap_held_back(
    nodes: Callable[..., Node], tokens: Tokens, held_by: str
) -> None:
    """With polling out of the picture (60 s), only the wake a finish sends when it frees
    a permit can get the next task claimed: a claim held back by a cap says so
    (``Grants.blocked``), and the dispatcher claims again when a permit frees."""
    node = nodes(args=[*FAST[:-2], "--poll-interval", "60"])
    cap, concurrency = (1, 4) if held_by == "queue cap" else (50, 1)
    worker = Worker(node.http, tokens.worker, concurrency=concurrency)
    ran: list[float] = []

    @worker.handler("h")
    async def h(ctx: Context, payload: Any) -> Any:
        ran.append(time.monotonic())
        await asyncio.sleep(0.05)
        return None

    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as api:
        api.post("/v1/queues", json={"name": "q", "max_concurrency": cap, "rate": 0})
        ids = [submit(api, "h") for _ in range(3)]
        asyncio.run(run_until(worker, lambda: worker.finished == 3, timeout=20))
        assert all(api.get(f"/v1/tasks/{i}").json()["state"] == "succeeded" for i in ids)
    assert len(ran) == 3


def test_a_finished_attempt_is_freed_without_the_garbage_collector(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """An attempt's objects (its context, state, tasks) must not form a reference cycle:
    a busy worker would otherwise leave thousands for the collector, which then took a
    quarter of its CPU. With the collector off, each finished context is freed at once."""
    worker = Worker(fast.http, tokens.worker, concurrency=5)
    contexts: list[weakref.ref[Context]] = []

    @worker.handler("keep")
    async def keep(ctx: Context, payload: Any) -> Any:
        contexts.append(weakref.ref(ctx))
        # Sent in the background, so it often lands after the finish and is refused:
        # neither way may leave a cycle (asyncio.wait_for's refusal did: its traceback
        # held wait_for's frame, which held the request's task).
        ctx.progress(0.5, "half")
        return payload

    ids = [submit(api, "keep", i) for i in range(5)]
    gc.collect()
    gc.disable()
    try:
        asyncio.run(run_until(worker, lambda: worker.finished >= len(ids)))
        alive = [ref for ref in contexts if ref() is not None]
    finally:
        gc.enable()
    assert len(contexts) == len(ids)
    assert not alive, f"{len(alive)} finished attempts are only freed by the collector"
    for task_id in ids:
        assert wait_state(api, task_id, {"succeeded"})["state"] == "succeeded"


def test_a_lost_lease_is_reaped_when_it_runs_out_not_an_interval_later(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """The reaper sleeps until the soonest lease runs out (at most its interval): with a
    60 s interval, a lease of 1 s that is never renewed is still acted on within seconds."""
    node = nodes(args=["--lease-ttl", "1", "--reap-interval", "60", "--poll-interval", "0.5"])
    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as api:
        api.post("/v1/queues", json={"name": "q", "max_concurrency": 50, "rate": 0})
        worker, seen = renewal_free_worker(node, tokens.worker, 30)
        tid = submit(api, "slow", retry_safe=False)
        asyncio.run(run_until(worker, lambda: "reason" in seen and not worker.running))
        # Only the reaper moves a lost attempt's task; its passes are 60 s apart.
        task = wait_state(api, tid, {"needs_review"}, timeout=15)
        assert task["attempts_used"] == 1
        events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
        assert [e["code"] for e in events if e["kind"] == "needs_review"] == ["LEASE_EXPIRED"]


def test_finishes_with_large_results_travel_in_frames_the_server_takes(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """A hundred handlers that each return 200 KB finish together: their finishes once
    went as one frame of about 20 MB, past the server's 16 MiB, which closed the
    connection, and again after each resume. The worker's batches stop at 4 MiB."""
    api.post("/v1/queues", json={"name": "big", "max_concurrency": 200, "rate": 0})
    specs = [{"queue": "big", "handler": "large", "payload": i} for i in range(100)]
    reply = api.post("/v1/tasks/batch?reply=ids", json={"tasks": specs})
    assert reply.status_code == 201, reply.text
    ids = [item["id"] for item in reply.json()]
    worker = Worker(fast.http, tokens.worker, concurrency=100)
    gate = asyncio.Event()
    started = {"n": 0}

    @worker.handler("large")
    async def large(ctx: Context, payload: Any) -> Any:
        started["n"] += 1
        if started["n"] == len(ids):
            gate.set()
        await gate.wait()  # all hundred finish at once
        return {"i": payload, "pad": "r" * 200_000}

    asyncio.run(run_until(worker, lambda: worker.finished >= len(ids), timeout=60))
    for i, task_id in enumerate(ids):
        task = wait_state(api, task_id, {"succeeded"})
        assert task["result"] == {"i": i, "pad": "r" * 200_000}


#: results the server cannot take, each returned by a handler (see the test below)
UNSENDABLE_RESULTS: dict[str, Callable[[], Any]] = {
    "nan": lambda: {"score": float("nan")},  # refused unread: no req_id in the error
    "big-int": lambda: [2**64],  # the same
    "lone-surrogate": lambda: "\udcff.txt",  # the same (a surrogate-escaped file name)
    "too-large": lambda: "x" * (5 * 1024 * 1024),  # a frame over the server's 4 MiB
    "nul": lambda: "a\x00b",  # refused with the req_id: the whole batch with it
    "a-set": lambda: {1, 2},  # not JSON at all: the whole batch failed in the runner
}


def test_a_result_the_server_cannot_take_fails_its_own_task_alone(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """A handler's result that JSON or the server's rules refuse (NaN, an integer past 64
    bits, a lone surrogate, a NUL, over the frame limit, a set) once wedged the worker: the
    server answered some of them without a req_id, so the finish timed out, was re-sent
    after the resume and timed out again, for ever, the task renewed and running, and two
    such finishes held back every later one. Others failed the whole finish batch, and the
    good results in it were never sent: those tasks waited out their lease and went to
    needs_review. Each now fails its own task, not retryably, and nothing else."""
    api.post("/v1/queues", json={"name": "odd", "max_concurrency": 100, "rate": 0})
    kinds = list(UNSENDABLE_RESULTS)
    specs = [{"queue": "odd", "handler": "odd", "payload": k, "max_attempts": 1} for k in kinds]
    specs += [{"queue": "odd", "handler": "odd", "payload": "good", "max_attempts": 1}] * 12
    reply = api.post("/v1/tasks/batch?reply=ids", json={"tasks": specs})
    assert reply.status_code == 201, reply.text
    ids = [item["id"] for item in reply.json()]
    worker = Worker(fast.http, tokens.worker, concurrency=len(ids))
    gate = asyncio.Event()
    started = {"n": 0}

    @worker.handler("odd")
    async def odd(ctx: Context, payload: Any) -> Any:
        started["n"] += 1
        if started["n"] == len(ids):
            gate.set()
        await gate.wait()  # all finish at once, in batches
        return "fine" if payload == "good" else UNSENDABLE_RESULTS[payload]()

    asyncio.run(run_until(worker, lambda: worker.finished >= len(ids), timeout=60))
    for spec, task_id in zip(specs, ids, strict=True):
        task = wait_state(api, task_id, {"succeeded", "failed", "needs_review"})
        if spec["payload"] == "good":
            assert task["state"] == "succeeded" and task["result"] == "fine", task
            continue
        assert task["state"] == "failed", (spec["payload"], task)
        code = "RESULT_TOO_LARGE" if spec["payload"] == "too-large" else "RESULT_NOT_JSON"
        assert task["error"]["code"] == code and task["error"]["retryable"] is False, task
        assert task["attempts_used"] == 1


def test_an_error_the_server_cannot_take_is_cleaned_not_lost(
    fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """A failure whose code or message breaks the server's limits (an empty or long code,
    a message past 10,000 characters, a NUL, a lone surrogate from a file name) was sent
    as it was: refused, or never answered, it wedged or sank its finish like a bad result.
    The runner now sends it cleaned: codes and messages within their limits."""
    worker = Worker(fast.http, tokens.worker)

    @worker.handler("fail.empty-code")
    async def empty_code(ctx: Context, payload: Any) -> Any:
        raise Fail("no code", code="")

    @worker.handler("fail.long")
    async def long_fail(ctx: Context, payload: Any) -> Any:
        raise Fail("m" * 20_000, code="C" * 300)

    @worker.handler("error.nul")
    def nul(ctx: Context, payload: Any) -> Any:
        raise ValueError("bad byte \x00 here")

    @worker.handler("error.surrogate")
    def surrogate(ctx: Context, payload: Any) -> Any:
        raise FileNotFoundError("no such file: '\udcff.txt'")

    ids = {h: submit(api, h, max_attempts=1) for h in worker.handlers}
    asyncio.run(run_until(worker, lambda: worker.finished >= len(ids), timeout=60))
    tasks = {h: wait_state(api, tid, {"failed", "needs_review"}) for h, tid in ids.items()}
    assert all(t["state"] == "failed" for t in tasks.values()), tasks
    errors = {h: t["error"] for h, t in tasks.items()}
    assert errors["fail.empty-code"] == {
        "code": "FAILED",
        "message": "no code",
        "retryable": False,
    }
    assert errors["fail.long"]["code"] == "C" * 100
    assert errors["fail.long"]["message"] == "m" * 10_000
    assert errors["error.nul"]["code"] == "ValueError"
    assert errors["error.nul"]["message"] == "bad byte \\x00 here"
    assert errors["error.surrogate"]["code"] == "FileNotFoundError"
    assert errors["error.surrogate"]["message"] == "no such file: '\\udcff.txt'"


#: The fault the next test injects: the database itself refuses every finish (an attempt
#: leaving ``running`` for an outcome) while ``test_fault`` holds a row. The server answers
#: such a finish INTERNAL, as it does one whose database is out of reach; renewals, the
#: reaper and every other write go on.
_FAULT_SQLITE = [
    "CREATE TABLE test_fault (on_finish integer)",
    "INSERT INTO test_fault VALUES (1)",
    "CREATE TRIGGER test_fault_finish BEFORE UPDATE OF state ON orbit_attempts"
    " WHEN OLD.state = 'running' AND NEW.state IN ('succeeded', 'failed')"
    " AND EXISTS (SELECT 1 FROM test_fault)"
    " BEGIN SELECT RAISE(ABORT, 'test fault: finishes fail'); END",
]
_FAULT_POSTGRES = [
    "CREATE TABLE test_fault (on_finish integer)",
    "INSERT INTO test_fault VALUES (1)",
    "CREATE FUNCTION test_fault_finish() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " IF EXISTS (SELECT 1 FROM test_fault) THEN RAISE EXCEPTION 'test fault: finishes fail';"
    " END IF; RETURN NEW; END $$",
    "CREATE TRIGGER test_fault_finish BEFORE UPDATE OF state ON orbit_attempts FOR EACH ROW"
    " WHEN (OLD.state = 'running' AND NEW.state IN ('succeeded', 'failed'))"
    " EXECUTE FUNCTION test_fault_finish()",
]


def _sql(db_url: str, statements: list[str]) -> None:
    """Run ``statements`` on a connection of the test's own, beside the server's."""
    path = sqlite_path(db_url)
    if path is None:
        with psycopg.connect(db_url, autocommit=True) as cx:
            for sql in statements:
                cx.execute(sql)
        return
    with contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=10)) as cx:
        for sql in statements:
            cx.execute(sql)


class _OnInternal(logging.Handler):
    """Calls ``then`` once the worker has logged a finish answered INTERNAL for each of
    ``attempts`` (filled in as the handlers run)."""

    def __init__(self, attempts: set[str], n: int, then: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.attempts, self.n, self.then = attempts, n, then
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "INTERNAL" not in text or len(self.seen) == self.n:
            return
        self.seen |= {a for a in self.attempts if a in text}
        if len(self.seen) == self.n:
            self.then()


def test_a_finish_answered_internal_is_sent_again_while_the_lease_lasts(
    fast: Node,
    tokens: Tokens,
    api: httpx.Client,
    db_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server could not commit the finishes (its database failed them: INTERNAL).
    They were logged and dropped, their attempts forgotten, their leases left to run out,
    and tasks that are not retry_safe went to needs_review although their handlers had
    finished. The runner now keeps renewing and sends the same outcomes again: once the
    database takes them, each is committed once, every handler having run once."""
    n = 3
    _sql(db_url, _FAULT_POSTGRES if sqlite_path(db_url) is None else _FAULT_SQLITE)
    attempts: set[str] = set()
    watcher = _OnInternal(attempts, n, lambda: _sql(db_url, ["DELETE FROM test_fault"]))
    caplog.set_level(logging.INFO, logger="orbit.worker")
    logging.getLogger("orbit.worker").addHandler(watcher)
    worker = Worker(fast.http, tokens.worker, concurrency=n)
    everyone = asyncio.Event()

    @worker.handler("once")
    async def once(ctx: Context, payload: Any) -> Any:
        attempts.add(ctx.attempt_id)
        if len(attempts) == n:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 20)
        return {"task": ctx.task_id}

    tids = [submit(api, "once", retry_safe=False) for _ in range(n)]
    ended = {"succeeded", "failed", "needs_review", "cancelled"}

    def over() -> bool:
        return all(api.get(f"/v1/tasks/{t}").json()["state"] in ended for t in tids)

    try:
        asyncio.run(run_until(worker, over))
    finally:
        logging.getLogger("orbit.worker").removeHandler(watcher)
    assert watcher.seen == attempts and len(attempts) == n  # each finish failed at least once
    assert "test fault: finishes fail" in fast.log_text()
    for tid in tids:
        task = api.get(f"/v1/tasks/{tid}").json()
        assert task["state"] == "succeeded" and task["result"] == {"task": tid}, task
        assert task["result_version"] == "1" and task["attempts_used"] == 1
        events = api.get(f"/v1/tasks/{tid}/events").json()["items"]
        assert [e["kind"] for e in events].count("succeeded") == 1
    resent = [m for m in caplog.messages if "sending it again" in m]
    assert {a for a in attempts if any(a in m for m in resent)} == attempts
