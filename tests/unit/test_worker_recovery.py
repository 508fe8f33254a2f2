"""The worker SDK recovers from what goes wrong on its connection: requests that get no
reply, sockets that close under a send, and messages that arrive at awkward moments.
Driven against ``FakeGateway``, a real WebSocket server on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import InvalidStatus

from orbit.tokens import TokenError
from orbit.worker.connection import WorkerConnection
from orbit.worker.runner import Context, Worker
from tests.unit.fake_gateway import FakeGateway, assignment


async def _swallow_heartbeats(gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
    return bool(msg["type"] == "heartbeat")


def test_a_request_given_up_leaves_nothing_waiting_and_its_late_reply_is_dropped() -> None:
    async def main() -> None:
        async with FakeGateway(on_request=_swallow_heartbeats) as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            try:
                asking = asyncio.create_task(conn.request({"type": "heartbeat"}))
                late = await gw.wait_for(lambda m: m["type"] == "heartbeat")
                asking.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asking
                assert conn._waiting == {}
                # The reply comes after all, then a real push: only the push is handed on.
                await gw.push({"type": "ack", "req_id": late["req_id"], "op": "heartbeat"})
                await gw.push({"type": "tasks", "req_id": None, "tasks": []})
                assert (await conn.next_push(10))["type"] == "tasks"
            finally:
                await conn.close()

    asyncio.run(main())


def test_a_request_that_cannot_be_encoded_leaves_nothing_waiting() -> None:
    """A message json cannot encode raises at once, and leaves no reply waited for (an
    entry left in ``_waiting`` was never removed), and the connection stays usable."""

    async def main() -> None:
        async with FakeGateway() as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            try:
                with pytest.raises(TypeError):
                    await conn.request({"type": "progress", "message": {1, 2}})
                assert conn._waiting == {}
                assert (await conn.request({"type": "heartbeat"}))["type"] == "ack"
            finally:
                await conn.close()

    asyncio.run(main())


def test_a_request_that_times_out_leaves_nothing_waiting() -> None:
    async def main() -> None:
        async with FakeGateway(on_request=_swallow_heartbeats) as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            try:
                with pytest.raises(TimeoutError):
                    await conn.request({"type": "heartbeat"}, 0.2)
                assert conn._waiting == {}
            finally:
                await conn.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- the runner


def _is(kind: str) -> Callable[[dict[str, Any]], bool]:
    return lambda m: bool(m["type"] == kind)


def _finished(attempt_id: str) -> Callable[[dict[str, Any]], bool]:
    def match(m: dict[str, Any]) -> bool:
        if m["type"] == "finish":
            return bool(m["attempt_id"] == attempt_id)
        return m["type"] == "finish_many" and any(i["attempt_id"] == attempt_id for i in m["items"])

    return match


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[int]]:
    """``worker.arun()`` as a task; stopped (drained) and awaited on the way out."""
    runner = asyncio.create_task(worker.arun())
    try:
        yield runner
    finally:
        worker.stop()
        await asyncio.wait_for(runner, 30)


async def _run_one(
    gw: FakeGateway,
    worker: Worker,
    task: dict[str, Any] | None = None,
    *,
    first: tuple[dict[str, Any], ...] = (),
    timeout: float = 20.0,
) -> None:
    """Run ``worker``: once it has said hello, push ``first``, then ``task`` (``a1`` for
    handler ``h`` by default); return, the worker stopped, once the task's finish came."""
    task = task or assignment("a1", "h")
    async with running(worker):
        await gw.wait_for(_is("hello"))
        for message in first:
            await gw.push(message)
        await gw.push({"type": "tasks", "req_id": None, "tasks": [task]})
        await gw.wait_for(_finished(task["attempt_id"]), timeout=timeout)


def _close_then_send(monkeypatch: pytest.MonkeyPatch, kind: str) -> list[str]:
    """The first ``kind`` request the worker sends finds its socket closed under it (the
    socket is closed, then the frame sent): websockets raises ConnectionClosed."""
    original = ClientConnection.send
    cut: list[str] = []

    async def send(self: ClientConnection, message: Any, *, text: bool | None = None) -> None:
        if not cut and isinstance(message, str) and f'"type":"{kind}"' in message:
            cut.append(message)
            await self.close()
        await original(self, message, text=text)

    monkeypatch.setattr(ClientConnection, "send", send)
    return cut


def test_a_renewal_cut_by_a_closed_socket_does_not_end_the_renew_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cut = _close_then_send(monkeypatch, "renew")

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", renew_interval=0.05)

            @worker.handler("h")
            async def handler(ctx: Context, payload: Any) -> Any:
                await gw.count(_is("renew"), 2)  # renewals go on after the cut one
                return "renewed"

            await _run_one(gw, worker)
            assert cut
            assert gw.finished["a1"] == {"ok": True, "result": "renewed"}

    asyncio.run(main())


def test_a_heartbeat_cut_by_a_closed_socket_does_not_end_the_heartbeat_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cut = _close_then_send(monkeypatch, "heartbeat")

    async def main() -> None:
        async with FakeGateway(heartbeat_interval=0.05) as gw:
            worker = _idle_worker(gw.url, "token")
            async with running(worker):
                await gw.count(_is("heartbeat"), 2)
            assert cut

    asyncio.run(main())


def test_a_start_cut_by_a_closed_socket_is_sent_again_after_the_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cut = _close_then_send(monkeypatch, "start")

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token")

            worker.handler("h")(_ran)

            await _run_one(gw, worker)
            assert cut
            assert [m["type"] for m in gw.received][:4] == ["hello", "resume", "start", "finish"]
            assert gw.finished["a1"] == {"ok": True, "result": "ran"}

    asyncio.run(main())


def test_a_push_the_runner_cannot_use_does_not_end_the_read_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token")

            worker.handler("h")(_ran)

            await _run_one(
                gw,
                worker,
                first=(
                    {"type": "cancel"},
                    {"type": "tasks", "req_id": None, "tasks": [{"attempt_id": "x"}]},
                ),
            )
            assert gw.finished["a1"] == {"ok": True, "result": "ran"}

    with caplog.at_level(logging.ERROR, logger="orbit.worker"):
        asyncio.run(main())
    assert "could not handle a pushed 'cancel' message" in caplog.text
    assert "could not accept a pushed task" in caplog.text


def test_an_attempt_that_fails_in_the_runner_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def no_lease(gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
        if msg["type"] != "start":
            return False
        await ws.send(json.dumps({"type": "started", "req_id": msg["req_id"]}))  # no lease
        return True

    async def main() -> None:
        async with FakeGateway(on_request=no_lease) as gw:
            worker = _idle_worker(gw.url, "token")
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push_a1(gw)
                await gw.wait_for(_is("start"))
                attempt = worker.running["a1"].task
                assert attempt is not None
                await asyncio.wait_for(attempt, 10)  # it ends, with its error logged

    with caplog.at_level(logging.ERROR, logger="orbit.worker"):
        asyncio.run(main())
    assert "attempt a1 failed in the runner" in caplog.text


async def _ran(ctx: Context, payload: Any) -> Any:
    return "ran"


async def _never_called(ctx: Context, payload: Any) -> Any:
    raise AssertionError("this handler must not run")


def _idle_worker(url: str, token: str | None = None, **options: Any) -> Worker:
    """A ``Worker`` whose handler ``h`` must not run: for tests of its connection alone."""
    worker = Worker(url, token, **options)
    worker.handler("h")(_never_called)
    return worker


async def _push_a1(gw: FakeGateway, **kw: Any) -> None:
    """Push attempt ``a1``, for handler ``h`` (``kw``: the assignment's other fields)."""
    await gw.push({"type": "tasks", "req_id": None, "tasks": [assignment("a1", "h", **kw)]})


def test_a_request_that_times_out_closes_the_connection() -> None:
    async def main() -> None:
        async with FakeGateway(on_request=_swallow_heartbeats) as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            conn.request_timeout = 0.2
            try:
                with pytest.raises(TimeoutError):
                    await conn.heartbeat()
                assert (await conn.next_push(10))["type"] == "closed"
            finally:
                await conn.close()

    asyncio.run(main())


def test_a_start_without_a_reply_makes_the_runner_resume_on_a_new_connection() -> None:
    async def swallow_first_start(gw: FakeGateway, ws: ServerConnection, msg: Any) -> bool:
        return msg["type"] == "start" and sum(m["type"] == "start" for m in gw.received) == 1

    async def main() -> None:
        async with FakeGateway(on_request=swallow_first_start) as gw:
            worker = Worker(gw.url, "token", request_timeout=0.3)

            worker.handler("h")(_ran)

            await _run_one(gw, worker)
            kinds = [m["type"] for m in gw.received]
            assert kinds[:5] == ["hello", "start", "resume", "start", "finish"]
            assert gw.finished["a1"] == {"ok": True, "result": "ran"}
            assert len(gw.connections) == 2

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _a1_running_then_dropped(
    gw: FakeGateway, worker: Worker, entered: asyncio.Event
) -> AsyncIterator[None]:
    """``worker`` running attempt ``a1`` (its handler has begun: ``entered``), then its
    connection closed by the gateway; the worker is stopped on the way out."""
    async with running(worker):
        await gw.wait_for(_is("hello"))
        await _push_a1(gw)
        await entered.wait()
        await gw.connections[-1].close()
        yield


def _answer_resumes(*codes: str) -> Callable[..., Any]:
    """A gateway hook that answers the first resumes with these error codes, one each,
    and the ones after as a well-behaved server does."""

    async def hook(gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
        nth = sum(m["type"] == "resume" for m in gw.received)
        if msg["type"] != "resume" or nth > len(codes):
            return False
        error = {"type": "error", "req_id": msg["req_id"], "code": codes[nth - 1], "message": ""}
        await ws.send(json.dumps(error))
        return True

    return hook


@pytest.mark.parametrize("failures", [1, 3])
def test_a_resume_the_server_could_not_try_is_tried_again_and_the_handler_goes_on(
    failures: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A resume answered ``INTERNAL`` (the node's store failed: a failover, a restart)
    says nothing of the session, whose leases may be intact: the runner tries the resume
    again after a pause, as after a failed connect, instead of starting a new session. So
    the running handler is not cancelled, no second hello is sent, and its finish is
    taken. (Before, any refusal of a resume started a new session: the handler was
    cancelled as "session lost" and its task waited for its lease to run out.)"""
    caplog.set_level(logging.WARNING, "orbit.worker")

    async def main() -> None:
        entered, go = asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def held(ctx: Context, payload: Any) -> Any:
            entered.set()
            await go.wait()
            seen["cancelled"] = ctx.cancelled
            return "done"

        async with FakeGateway(on_request=_answer_resumes(*["INTERNAL"] * failures)) as gw:
            worker = Worker(gw.url, "token", reconnect_max=0.2)
            worker.handler("h")(held)
            async with _a1_running_then_dropped(gw, worker, entered):
                await gw.count(_is("resume"), failures + 1)
                go.set()
                await gw.wait_for(_finished("a1"))
            kinds = [m["type"] for m in gw.received]
            assert kinds.count("hello") == 1 and kinds.count("resume") == failures + 1
            assert gw.finished["a1"] == {"ok": True, "result": "done"}
            assert seen == {"cancelled": False}

    asyncio.run(main())
    retried = [r.getMessage() for r in caplog.records if "INTERNAL from the server" in r.message]
    assert len(retried) == failures, retried
    assert not any("starting a new session" in r.getMessage() for r in caplog.records)


def test_a_resume_the_server_could_not_try_with_no_lease_to_keep_starts_a_new_session() -> None:
    """Retrying a resume answered ``INTERNAL`` is worth it only while some running
    attempt holds a lease the resume would keep. An idle worker (or one whose leases have
    all run out) starts a new session at once instead: a node that fails every resume of
    one session (any error it cannot name is ``INTERNAL``) would otherwise keep the
    worker connected to no session for ever."""

    async def main() -> None:
        async with FakeGateway(on_request=_answer_resumes(*["INTERNAL"] * 50)) as gw:
            worker = _idle_worker(gw.url, "token")
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await gw.connections[-1].close()
                await gw.count(_is("hello"), 2)
            kinds = [m["type"] for m in gw.received]
            assert kinds.count("resume") == 1

    asyncio.run(main())


@pytest.mark.parametrize("code", ["BAD_SECRET", "SESSION_NOT_FOUND"])
def test_a_resume_refused_for_its_session_starts_a_new_one_and_loses_the_handler(
    code: str,
) -> None:
    """A resume refused because the session is not this worker's to resume (a wrong
    secret, a session the server no longer has) starts a new session at once: the old
    one's running attempt is lost to this worker, its handler cancelled, and nothing of
    it reported (the server's lease decides)."""

    async def main() -> None:
        entered, lost = asyncio.Event(), asyncio.Event()
        seen: dict[str, Any] = {}

        async def held(ctx: Context, payload: Any) -> Any:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen["cancelled"] = ctx.cancelled
                lost.set()
                raise

        async with FakeGateway(on_request=_answer_resumes(code)) as gw:
            worker = Worker(gw.url, "token", cancel_grace=0.3)
            worker.handler("h")(held)
            async with _a1_running_then_dropped(gw, worker, entered):
                await gw.count(_is("hello"), 2)
                await asyncio.wait_for(lost.wait(), 10)
            kinds = [m["type"] for m in gw.received]
            assert kinds.count("resume") == 1
            assert "a1" not in gw.finished
            assert seen == {"cancelled": True}

    asyncio.run(main())


def _watch_cancels(worker: Worker) -> asyncio.Queue[str]:
    """The reasons the runner cancels attempts for, as it does."""
    reasons: asyncio.Queue[str] = asyncio.Queue()
    cancel = worker._cancel

    def watched(running: Any, reason: str) -> None:
        cancel(running, reason)
        reasons.put_nowait(reason)

    worker._cancel = watched  # type: ignore[method-assign]
    return reasons


def _waiting_handler(worker: Worker, kind: str, seen: dict[str, Any]) -> None:
    """Register handler ``h``: it waits until cancelled and records the reason."""
    if kind == "async":

        @worker.handler("h")
        async def wait_async(ctx: Context, payload: Any) -> Any:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen["reason"] = ctx.reason
                raise

    else:
        stopped = threading.Event()

        @worker.handler("h")
        def wait_sync(ctx: Context, payload: Any) -> Any:
            while not ctx.cancelled:
                stopped.wait(0.01)
            seen["reason"] = ctx.reason
            ctx.check()


@dataclass
class HeldStart:
    """Attempt ``a1``'s ``start``, held unanswered by the gateway, its handler waiting
    until cancelled (``_waiting_handler``): the test cancels the attempt meanwhile."""

    gw: FakeGateway
    worker: Worker
    runner: asyncio.Task[int]
    ws: ServerConnection
    start: dict[str, Any]
    reasons: asyncio.Queue[str]
    seen: dict[str, Any] = field(default_factory=dict)

    async def answer_once_cancelled(self, reason: str, *, finish: bool = True) -> None:
        """Once the runner has cancelled the attempt for ``reason``, answer its start
        and (if ``finish``) wait for its finish."""
        assert await asyncio.wait_for(self.reasons.get(), 10) == reason
        await self.ws.send(json.dumps(self.gw.answer(self.start)))
        if finish:
            await self.gw.wait_for(_finished("a1"))


@contextlib.asynccontextmanager
async def _a_held_start(
    kind: str, *, retry_safe: bool = False, **options: Any
) -> AsyncIterator[HeldStart]:
    """A ``Worker(..., **options)`` running, its handler ``h`` (``kind``) given attempt
    ``a1`` (of a task ``retry_safe`` or not), whose ``start`` the gateway holds; stopped
    (drained) on the way out."""
    held: asyncio.Queue[tuple[ServerConnection, dict[str, Any]]] = asyncio.Queue()

    async def hold(gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
        if msg["type"] != "start":
            return False
        await held.put((ws, msg))
        return True

    async with FakeGateway(on_request=hold) as gw:
        worker = Worker(gw.url, "token", **options)
        seen: dict[str, Any] = {}
        _waiting_handler(worker, kind, seen)
        reasons = _watch_cancels(worker)
        async with running(worker) as runner:
            await gw.wait_for(_is("hello"))
            await _push_a1(gw, retry_safe=retry_safe)
            ws, start = await asyncio.wait_for(held.get(), 10)
            yield HeldStart(gw, worker, runner, ws, start, reasons, seen)


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_cancel_while_the_start_is_in_flight_reaches_the_handler(kind: str) -> None:
    async def main() -> None:
        async with _a_held_start(kind) as held:
            # The task is cancelled once started: the push overtakes the reply.
            await held.gw.push({"type": "cancel", "attempt_ids": ["a1"]})
            await held.answer_once_cancelled("task cancelled")
        assert held.seen["reason"] == "task cancelled"
        error = held.gw.finished["a1"]["error"]
        assert error["code"] == "CANCELLED" and error["retryable"] is False

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize("retry_safe", [True, False])
def test_a_drain_while_the_start_is_in_flight_reaches_the_handler(
    kind: str, retry_safe: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler sees the drain's cancel. A retry_safe task's attempt reports
    CANCELLED, retryably, to run again elsewhere; any other's reports nothing, and its
    lease decides (needs_review): stopped part way, its effects are unknown, and a
    retryable report replayed it (I6)."""

    async def main() -> None:
        options = {"grace": 0, "cancel_grace": 5}  # no grace: cancelled at once
        async with _a_held_start(kind, retry_safe=retry_safe, **options) as held:
            held.worker.stop()
            await held.answer_once_cancelled("worker stopping", finish=retry_safe)
            assert await asyncio.wait_for(held.runner, 10) == 0
        assert held.seen["reason"] == "worker stopping"
        if retry_safe:
            error = held.gw.finished["a1"]["error"]
            assert error["code"] == "CANCELLED" and error["retryable"] is True
        else:
            assert "a1" not in held.gw.finished
            assert "left to its lease (needs_review)" in caplog.text

    asyncio.run(main())


def test_an_attempt_pushed_after_the_stop_is_released_once_the_drain_is_answered() -> None:
    """A push read in the turn the stop was, released at once, could reach the server
    before the drain: the release made its task ready, the server claimed it again for
    this session (not draining yet) and pushed it back, to be released a second time (a
    task with two released attempts, seen once in CI under load). It is released only
    once the drain has been answered. The gateway holds the drain's answer until a
    release comes, or 2 s: a release that came first is the defect."""
    release_seen = asyncio.Event()
    answers: list[asyncio.Task[None]] = []

    async def answer_later(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release_seen.wait(), 2)
        gw.received.append({"type": "drain answered"})
        await ws.send(json.dumps(gw.answer(msg)))

    async def hold_the_drain(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] == "release":
            release_seen.set()
        if msg["type"] != "drain":
            return False
        # answered from a task of its own: the gateway goes on reading meanwhile
        answers.append(asyncio.create_task(answer_later(gw, ws, msg)))
        return True

    async def main() -> list[str]:
        async with FakeGateway(on_request=hold_the_drain) as gw:
            worker = _idle_worker(gw.url, "token", prefetch=1)
            runner = asyncio.create_task(worker.arun())
            async with asyncio.timeout(10):  # connected: the run is under way
                while not worker._connected.is_set():
                    await asyncio.sleep(0.005)
            worker.stop()
            await gw.wait_for(_is("drain"))
            await _push_a1(gw)
            await gw.wait_for(_is("release"))
            assert await asyncio.wait_for(runner, 10) == 0
            return [m["type"] for m in gw.received]

    kinds = asyncio.run(main())
    assert kinds.index("drain answered") < kinds.index("release"), kinds
    assert kinds.count("release") == 1


def test_a_stop_before_the_run_is_honoured() -> None:
    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _idle_worker(gw.url, "token")
            worker.stop()
            assert await asyncio.wait_for(worker.arun(), 10) == 0
            assert gw.attempts == 0  # it did not even connect

    asyncio.run(main())


def test_a_stop_while_the_first_connection_is_retried_ends_the_run() -> None:
    async def main() -> None:
        async with FakeGateway(reject=[503] * 1000) as gw:
            worker = _idle_worker(gw.url, "token", reconnect_max=0.1)
            runner = asyncio.create_task(worker.arun())
            await gw.upgrades(2)  # refused, and retried
            worker.stop()
            assert await asyncio.wait_for(runner, 10) == 0

    asyncio.run(main())


def test_a_refused_upgrade_other_than_bad_credentials_is_retried() -> None:
    async def main() -> None:
        async with FakeGateway(reject=[404, 500, 503]) as gw:
            worker = _idle_worker(gw.url, "token", reconnect_max=0.1)
            async with running(worker):
                await gw.wait_for(_is("hello"))
            assert gw.attempts == 4

    asyncio.run(main())


@pytest.mark.parametrize("status", [401, 403])
def test_bad_credentials_end_the_first_connection(status: int) -> None:
    async def main() -> None:
        async with FakeGateway(reject=[status]) as gw:
            worker = _idle_worker(gw.url, "token")
            with pytest.raises(InvalidStatus) as refused:
                await asyncio.wait_for(worker.arun(), 10)
            assert refused.value.response.status_code == status
            assert gw.attempts == 1

    asyncio.run(main())


@pytest.fixture
def token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ORBIT_TOKEN_FILE, holding ``old-token``, and no ORBIT_TOKEN: a worker given no
    token reads this file, and reads it again at each reconnect."""
    path = tmp_path / "token"
    path.write_text("old-token\n")
    path.chmod(0o600)
    monkeypatch.delenv("ORBIT_TOKEN", raising=False)
    monkeypatch.setenv("ORBIT_TOKEN_FILE", str(path))
    return path


def test_a_reconnect_reads_a_rotated_token_file(token_file: Path) -> None:
    """The server stops taking the worker's token and drops its connection; the operator
    writes a new token into ORBIT_TOKEN_FILE. The worker's reconnects, refused with 401
    meanwhile, pick the new token up and resume the session: no restart."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _idle_worker(gw.url, reconnect_max=0.1)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                gw.accepted_token = "new-token"
                await gw.connections[-1].close()
                await gw.upgrades(3)  # the old token refused, twice
                token_file.write_text("new-token\n")
                await gw.wait_for(_is("resume"))
            assert len(gw.connections) == 2

    asyncio.run(main())


async def _run_a_waiting_attempt(
    gw: FakeGateway, worker: Worker
) -> tuple[asyncio.Task[int], asyncio.Event]:
    """Start ``worker.arun()`` (not stopped on the way out: the test ends the run) and
    give it attempt ``a1``, in a handler that waits until cancelled; return once the
    handler runs: the run, and an event set once the handler is cancelled."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    @worker.handler("h")
    async def handler(ctx: Context, payload: Any) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner = asyncio.create_task(worker.arun())
    await gw.wait_for(_is("hello"))
    await _push_a1(gw)
    await asyncio.wait_for(started.wait(), 10)
    return runner, cancelled


async def _ended_by_a_refusal(
    runner: asyncio.Task[int], worker: Worker, cancelled: asyncio.Event
) -> int:
    """The status of the refused upgrade the run ended with, its running handler
    cancelled and attempt ``a1`` reported as unconfirmed (its lease decides)."""
    with pytest.raises(InvalidStatus) as refused:
        await asyncio.wait_for(runner, 10)
    assert cancelled.is_set()
    assert worker.unreported == ["a1"]
    return refused.value.response.status_code


def test_a_close_for_a_revoked_token_ends_the_run_once_the_token_is_refused_again() -> None:
    """The server closes the connection with 4401 UNAUTHENTICATED (its token was
    revoked) and refuses the token at the reconnect: the run ends with that refusal, as
    at the first connection (``orbit worker`` exits 3), at once rather than after the
    drain's grace, its running handler cancelled and its attempt reported as unconfirmed
    (its lease decides). Before, the worker retried the refused token for ever."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", reconnect_max=0.1, grace=60.0)
            runner, cancelled = await _run_a_waiting_attempt(gw, worker)
            gw.accepted_token = "another-token"  # "token" is refused from now on
            await gw.connections[-1].close(4401, "UNAUTHENTICATED")
            assert await _ended_by_a_refusal(runner, worker, cancelled) == 401
            assert gw.attempts == 2  # the first connection, and one reconnect

    asyncio.run(main())


def test_a_close_for_a_revoked_token_resumes_with_a_rotated_token_file(
    token_file: Path,
) -> None:
    """A token rotated the documented way: the new one written into ORBIT_TOKEN_FILE,
    then the old one revoked. The server closes the connection with 4401; the worker's
    reconnect reads the new token and resumes its session, without a restart."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _idle_worker(gw.url, reconnect_max=0.1)
            async with running(worker) as runner:
                await gw.wait_for(_is("hello"))
                token_file.write_text("new-token\n")
                gw.accepted_token = "new-token"
                await gw.connections[-1].close(4401, "UNAUTHENTICATED")
                await gw.wait_for(_is("resume"))
                assert not runner.done()
            assert len(gw.connections) == 2

    asyncio.run(main())


@pytest.mark.parametrize("status", [401, 403])
def test_a_token_refused_after_another_drop_ends_the_run_once_it_is_refused_twice(
    status: int,
) -> None:
    """The connection drops for another reason than a revoke (a server restart: close
    1012, not 4401) and the token is revoked meanwhile, so the worker never hears a
    4401: its reconnects are refused. Once the same token, read again after a pause, has
    been refused twice, the run ends as after a 4401 (handlers cancelled, no drain,
    ``run()`` raises the refusal). Before, it retried for ever, logging each refusal."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", reconnect_max=0.1, grace=60.0)
            runner, cancelled = await _run_a_waiting_attempt(gw, worker)
            gw.reject = [status] * 100  # the token is refused from now on
            await gw.connections[-1].close(1012, "service restart")
            assert await _ended_by_a_refusal(runner, worker, cancelled) == status
            assert gw.attempts == 3  # the first connection, and two refused reconnects

    asyncio.run(main())


@pytest.mark.parametrize("between", [502, 503])
def test_a_failure_between_two_refusals_neither_counts_nor_resets_them(between: int) -> None:
    """Refused, the server unreachable for a while (a proxy's 502 while it is down, a
    503 while it starts), refused again: the same token has been refused twice, and the
    run ends once the pause after the second brings no other token, as with no failure
    between. A try that fails another way judged no token: it is not a refusal, and it
    does not start the count again (a load balancer alternating a node that is down and
    one that refuses would otherwise have the worker retry a revoked token for ever).
    The second refusal comes later for the failures, which gives a rotation in
    ORBIT_TOKEN_FILE more time, not less (docs/worker.md, *Connection*)."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _idle_worker(gw.url, "token", reconnect_max=0.1)
            runner = asyncio.create_task(worker.arun())
            await gw.wait_for(_is("hello"))
            gw.reject = [401, between, between]  # then "token" is refused (401)
            gw.accepted_token = "another-token"
            await gw.connections[-1].close(1012, "service restart")
            with pytest.raises(InvalidStatus) as refused:
                await asyncio.wait_for(runner, 10)
            assert refused.value.response.status_code == 401
            # the first connection; refused; two failures; refused: the run ends
            assert gw.attempts == 5

    asyncio.run(main())


def test_a_token_file_missing_after_two_refusals_does_not_end_the_run(
    token_file: Path,
) -> None:
    """The old token is refused twice after a drop, and the token file is being
    replaced (gone for a moment) when the runner reads it to decide: no token is not the
    refused token, so the run goes on, and the new token, once written, resumes the
    session."""
    missing = asyncio.Event()

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "no token to reconnect with" in record.getMessage():
                missing.set()

    heard = Heard()
    logging.getLogger("orbit.worker").addHandler(heard)

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _idle_worker(gw.url, reconnect_max=0.1)
            async with running(worker) as runner:
                await gw.wait_for(_is("hello"))
                gw.accepted_token = "new-token"
                await gw.connections[-1].close(1012, "service restart")
                await gw.upgrades(3)  # the old token refused, twice
                token_file.unlink()
                await asyncio.wait_for(missing.wait(), 10)
                assert not runner.done()
                token_file.write_text("new-token\n")
                token_file.chmod(0o600)
                await gw.wait_for(_is("resume"))
            assert len(gw.connections) == 2

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("orbit.worker").removeHandler(heard)


def test_no_token_to_read_ends_the_first_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORBIT_TOKEN", raising=False)
    monkeypatch.setenv("ORBIT_TOKEN_FILE", str(tmp_path / "missing"))

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _idle_worker(gw.url)
            with pytest.raises(TokenError, match="does not exist"):
                await asyncio.wait_for(worker.arun(), 10)
            assert gw.attempts == 0

    asyncio.run(main())


# --------------------------------------------------------------------------- clocks


@pytest.mark.parametrize("offset", [-100.0, 100.0])
def test_leases_are_timed_by_the_servers_count_not_this_hosts_clock(offset: float) -> None:
    """The server's clock is 100 s behind (or ahead of) this host's, and its leases last
    a second: the worker renews each at half its ``lease_left`` and keeps the attempt.
    By the instants alone it would have found every lease over at once (or renewed a
    minute and a half too late)."""

    async def main() -> None:
        async with FakeGateway(lease_left=1.0, clock_offset=offset) as gw:
            worker = Worker(gw.url, "token")

            @worker.handler("h")
            async def handler(ctx: Context, payload: Any) -> Any:
                await gw.count(_is("renew"), 3, timeout=20)  # three leases, each renewed
                return "kept"

            await _run_one(gw, worker, timeout=30)
            assert gw.finished["a1"] == {"ok": True, "result": "kept"}

    asyncio.run(main())


def test_a_deadline_is_timed_by_the_servers_count_not_this_hosts_clock() -> None:
    """The deadline's instant is already past by this host's clock, but the server
    says 30 s are left: the handler runs and its result is sent."""

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token")

            @worker.handler("h")
            async def handler(ctx: Context, payload: Any) -> Any:
                await asyncio.sleep(0.05)  # work that a zero time limit would cut short
                return "in time"

            past = "2020-01-01T00:00:00Z"
            task = assignment("a1", "h", deadline=past, deadline_left=30.0)
            await _run_one(gw, worker, task)
            assert gw.finished["a1"] == {"ok": True, "result": "in time"}

    asyncio.run(main())
