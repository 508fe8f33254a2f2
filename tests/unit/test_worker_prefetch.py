"""A worker's prefetch (``Worker(..., prefetch=P)``): the server is told of ``concurrency
+ P`` slots and pushes that many claimed attempts, the worker runs at most
``concurrency`` handlers (and each handler's own capacity) at once, and an attempt beyond
that waits claimed, unstarted, until a handler ends. Driven against ``FakeGateway``;
tests/e2e/test_runner.py holds the same against a real server on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from orbit.core.validate import MAX_WORKER_CONCURRENCY
from orbit.worker import runner
from orbit.worker.runner import Context, Worker
from tests.unit.fake_gateway import FakeGateway, assignment
from tests.unit.test_worker_recovery import _finished, _is, running

Hook = Callable[[FakeGateway, Any, dict[str, Any]], Awaitable[bool]]


def _started(gw: FakeGateway) -> list[str]:
    """The attempt ids the worker sent a start for, in order."""
    ids: list[str] = []
    for m in gw.received:
        if m["type"] == "start":
            ids.append(m["attempt_id"])
        elif m["type"] == "start_many":
            ids.extend(i["attempt_id"] for i in m["items"])
    return ids


def _released(gw: FakeGateway) -> list[str]:
    return [m["attempt_id"] for m in gw.received if m["type"] == "release"]


class Gate:
    """Handlers that hold until the test lets each one go, and say who is in."""

    def __init__(self) -> None:
        self.inside: set[str] = set()
        self.ran: list[str] = []
        self.peak = 0
        self.peak_by: dict[str, int] = {}
        self._go: dict[str, asyncio.Event] = {}

    def go(self, attempt_id: str) -> None:
        self._go.setdefault(attempt_id, asyncio.Event()).set()

    async def __call__(self, ctx: Context, payload: Any) -> Any:
        self.inside.add(ctx.attempt_id)
        self.ran.append(ctx.attempt_id)
        self.peak = max(self.peak, len(self.inside))
        same = sum(1 for a in self.inside if a.startswith(ctx.handler))
        self.peak_by[ctx.handler] = max(self.peak_by.get(ctx.handler, 0), same)
        try:
            await self._go.setdefault(ctx.attempt_id, asyncio.Event()).wait()
        finally:
            self.inside.discard(ctx.attempt_id)
        return "ok"

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                await asyncio.sleep(0.005)


def _worker(gw: FakeGateway, **options: Any) -> Worker:
    worker = Worker(gw.url, "token", **{"grace": 0.5, "cancel_grace": 0.3, **options})
    worker._report_grace = 0.2
    return worker


@contextlib.asynccontextmanager
async def _serving(
    gw: FakeGateway, gate: Gate, *, capacity: int | None = None, **options: Any
) -> AsyncIterator[Worker]:
    """A worker with the one handler ``h`` run by ``gate``, running and past its hello."""
    worker = _worker(gw, **options)
    worker.handler("h", capacity=capacity)(gate)
    async with running(worker):
        await gw.wait_for(_is("hello"))
        yield worker


async def _push(gw: FakeGateway, *ids: str) -> None:
    tasks = [assignment(a, a.rstrip("0123456789")) for a in ids]
    await gw.push({"type": "tasks", "req_id": None, "tasks": tasks})


def _refuse_starts(refused: dict[str, str]) -> Hook:
    """A gateway hook that refuses the start of each attempt in ``refused`` with its code."""

    async def hook(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] == "start" and msg["attempt_id"] in refused:
            code = refused[msg["attempt_id"]]
            await ws.send(json.dumps({"type": "error", "req_id": msg["req_id"], "code": code}))
            return True
        if msg["type"] == "start_many" and any(i["attempt_id"] in refused for i in msg["items"]):
            answer = gw.answer(msg)
            for result in answer["results"]:
                if result["attempt_id"] in refused:
                    del result["lease"]
                    result["error"] = {"code": refused[result["attempt_id"]], "message": ""}
            await ws.send(json.dumps(answer))
            return True
        return False

    return hook


@pytest.mark.parametrize(
    ("prefetch", "error"),
    [
        (-1, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("2", TypeError),
        (None, TypeError),
        (MAX_WORKER_CONCURRENCY, ValueError),  # with concurrency 10: past the hello's bound
    ],
)
def test_an_invalid_prefetch_is_refused_at_construction(prefetch: Any, error: type) -> None:
    with pytest.raises(error, match="prefetch"):
        Worker("http://127.0.0.1:1", "token", concurrency=10, prefetch=prefetch)


@pytest.mark.parametrize("prefetch", [0, 5])
def test_the_server_is_told_of_concurrency_plus_prefetch_slots(prefetch: int) -> None:
    async def main() -> dict[str, Any]:
        async with FakeGateway() as gw:
            worker = _worker(gw, concurrency=4, prefetch=prefetch)
            worker.handler("a", capacity=2)(Gate())
            worker.handler("b")(Gate())
            async with running(worker):
                return await gw.wait_for(_is("hello"))

    hello = asyncio.run(main())
    assert hello["max_concurrency"] == 4 + prefetch
    assert hello["capabilities"] == [
        {"handler": "a", "capacity": 2 + prefetch},
        {"handler": "b", "capacity": 4 + prefetch},
    ]


def test_at_most_concurrency_handlers_run_and_the_rest_wait_unstarted() -> None:
    """Six pushed to 2 slots and a prefetch of 4: two start and run; the other four send
    no start until a handler ends, and each end starts exactly one more, in order."""
    gate = Gate()

    async def main() -> tuple[list[str], list[str]]:
        async with FakeGateway() as gw, _serving(gw, gate, concurrency=2, prefetch=4) as worker:
            await _push(gw, "h1", "h2", "h3", "h4", "h5", "h6")
            await gate.until(lambda: len(gate.inside) == 2)
            await asyncio.sleep(0.1)  # time enough for a start that should not go out
            assert sorted(_started(gw)) == ["h1", "h2"]
            assert set(worker.running) == {"h1", "h2", "h3", "h4", "h5", "h6"}
            waiting = [worker.running[a] for a in ("h3", "h4", "h5", "h6")]
            assert all(r.lease_expires == 0.0 for r in waiting)  # no lease: unstarted
            gate.go("h1")
            await gate.until(lambda: "h3" in gate.inside)
            assert _started(gw)[2:] == ["h3"] and len(gate.inside) == 2
            for a in ("h2", "h3", "h4", "h5", "h6"):
                gate.go(a)
            for a in ("h1", "h2", "h3", "h4", "h5", "h6"):
                await gw.wait_for(_finished(a))
            return gate.ran, _started(gw)

    ran, started = asyncio.run(main())
    assert gate.peak == 2
    assert ran == ["h1", "h2", "h3", "h4", "h5", "h6"]
    assert sorted(started) == ran


def test_each_handler_capacity_holds_with_a_prefetch() -> None:
    """Handler ``a`` (capacity 1) waits for its own slot while ``b`` takes the free ones:
    a waiting ``a`` does not hold back a ``b`` behind it."""
    gate = Gate()

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _worker(gw, concurrency=3, prefetch=3)
            worker.handler("a", capacity=1)(gate)
            worker.handler("b")(gate)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push(gw, "a1", "a2", "b1", "b2", "a3", "b3")
                await gate.until(lambda: gate.inside == {"a1", "b1", "b2"})
                await asyncio.sleep(0.1)
                assert sorted(_started(gw)) == ["a1", "b1", "b2"]
                gate.go("b1")  # frees a slot only b may use: b3 passes a2 and a3
                await gate.until(lambda: "b3" in gate.inside)
                assert "a2" not in _started(gw)
                gate.go("a1")
                await gate.until(lambda: "a2" in gate.inside)
                for a in ("a2", "a3", "b2", "b3"):
                    gate.go(a)
                for a in ("a1", "a2", "a3", "b1", "b2", "b3"):
                    await gw.wait_for(_finished(a))

    asyncio.run(main())
    assert gate.peak == 3 and gate.peak_by["a"] == 1


def test_a_waiting_attempt_whose_claim_expired_is_dropped_and_the_worker_goes_on() -> None:
    gate = Gate()

    async def main() -> None:
        hook = _refuse_starts({"h2": "CLAIM_EXPIRED"})
        async with (
            FakeGateway(on_request=hook) as gw,
            _serving(gw, gate, concurrency=1, prefetch=2) as worker,
        ):
            await _push(gw, "h1", "h2", "h3")
            await gate.until(lambda: gate.inside == {"h1"})
            gate.go("h1")
            # h2's start is refused: its handler never runs, and h3 takes the slot
            await gate.until(lambda: gate.inside == {"h3"})
            gate.go("h3")
            await gw.wait_for(_finished("h3"))
            assert "h2" not in worker.running
            assert _started(gw) == ["h1", "h2", "h3"]
            assert "h2" not in gw.finished and _released(gw) == []

    asyncio.run(main())
    assert gate.ran == ["h1", "h3"]


def test_a_cancel_for_a_waiting_attempt_drops_it_without_its_handler() -> None:
    gate = Gate()

    async def main() -> None:
        async with FakeGateway() as gw, _serving(gw, gate, concurrency=1, prefetch=2) as worker:
            await _push(gw, "h1", "h2", "h3")
            await gate.until(lambda: gate.inside == {"h1"})
            await gw.push({"type": "cancel", "attempt_ids": ["h2"]})
            await gate.until(lambda: "h2" not in worker.running)
            gate.go("h1")
            await gate.until(lambda: gate.inside == {"h3"})
            gate.go("h3")
            await gw.wait_for(_finished("h3"))
            # never started, never reported, not released: the server's cancel of a
            # claimed task has already released its attempt
            assert "h2" not in _started(gw) and "h2" not in gw.finished
            assert _released(gw) == []

    asyncio.run(main())
    assert gate.ran == ["h1", "h3"]


def test_a_drain_releases_the_waiting_attempts_and_lets_the_running_finish() -> None:
    gate = Gate()

    async def main() -> int:
        async with FakeGateway() as gw:
            worker = _worker(gw, concurrency=1, prefetch=2, grace=10.0)
            worker.handler("h")(gate)
            runner = asyncio.create_task(worker.arun())
            await gw.wait_for(_is("hello"))
            await _push(gw, "h1", "h2", "h3")
            await gate.until(lambda: gate.inside == {"h1"})
            worker.stop()
            await gw.wait_for(_is("drain"))
            await gw.count(_is("release"), 2)
            assert sorted(_released(gw)) == ["h2", "h3"]
            await gate.until(lambda: set(worker.running) == {"h1"})  # released, acked
            assert gate.inside == {"h1"}  # still running: its grace is not over
            gate.go("h1")
            code = await asyncio.wait_for(runner, 10)
            assert _started(gw) == ["h1"]  # the released ones were never started
            assert gw.finished["h1"] == {"ok": True, "result": "ok"}
            return code

    assert asyncio.run(main()) == 0
    assert gate.ran == ["h1"]


def test_a_refused_session_drops_the_waiting_attempts_unreported() -> None:
    """The resume refused (a new session): the old session's waiting claims are not ours
    any more, so they are neither started nor released, and nothing is reported."""
    gate = Gate()

    async def refuse_resume(gw: FakeGateway, ws: Any, msg: dict[str, Any]) -> bool:
        if msg["type"] == "resume":
            reply = {"type": "error", "req_id": msg["req_id"], "code": "SESSION_NOT_FOUND"}
            await ws.send(json.dumps(reply))
            return True
        return False

    async def main() -> None:
        async with (
            FakeGateway(on_request=refuse_resume) as gw,
            _serving(gw, gate, concurrency=1, prefetch=2) as worker,
        ):
            await _push(gw, "h1", "h2", "h3")
            await gate.until(lambda: gate.inside == {"h1"})
            await gw.connections[-1].close()
            await gw.count(_is("hello"), 2)
            await gate.until(lambda: not worker.running)
            assert _started(gw) == ["h1"] and _released(gw) == []
            assert worker._busy == 0 and not worker._waiting

    asyncio.run(main())
    assert gate.ran == ["h1"]


def test_more_waiting_than_the_prefetch_drops_the_oldest_claim_unstarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every slot busy the server pushes at most ``prefetch`` attempts more, unless
    the oldest waiting claim ran out (the reaper gave its task back, and the server pushed
    another in its place): that one is dropped, neither started nor released, so handlers
    longer than the claim lease pile up no stale claims. (The claim lease is the server's;
    ``CLAIM_STALE_S`` stands for it here, made short.)"""
    monkeypatch.setattr(runner, "CLAIM_STALE_S", 0.05)
    gate = Gate()

    async def main() -> None:
        async with FakeGateway() as gw, _serving(gw, gate, concurrency=1, prefetch=1) as worker:
            await _push(gw, "h1", "h2")
            await gate.until(lambda: gate.inside == {"h1"})
            await asyncio.sleep(0.1)  # h2's claim ages past the (shortened) lease
            await _push(gw, "h3")
            await gate.until(lambda: "h2" not in worker.running)
            assert list(worker._waiting) == ["h3"]
            gate.go("h1")
            await gate.until(lambda: gate.inside == {"h3"})
            gate.go("h3")
            await gw.wait_for(_finished("h3"))
            assert _started(gw) == ["h1", "h3"] and _released(gw) == []

    asyncio.run(main())
    assert gate.ran == ["h1", "h3"]


def test_stale_claims_are_dropped_where_a_handlers_capacity_is_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler's capacity, not the worker's concurrency, holds the line: the server
    holds no more than capacity + prefetch of that handler's attempts for the session, so
    more waiting than that, once they are old, are claims that ran out (found by review:
    with concurrency 4, prefetch 1 and a handler of capacity 1, five waited and none was
    dropped)."""
    monkeypatch.setattr(runner, "CLAIM_STALE_S", 0.05)
    gate = Gate()

    async def main() -> None:
        async with (
            FakeGateway() as gw,
            _serving(gw, gate, concurrency=4, prefetch=1, capacity=1) as worker,
        ):
            await _push(gw, "h1", "h2")
            await gate.until(lambda: gate.inside == {"h1"})
            for late in ("h3", "h4", "h5"):
                await asyncio.sleep(0.1)  # the waiting one ages past the lease
                await _push(gw, late)
                await gate.until(lambda late=late: list(worker._waiting) == [late])
            gate.go("h1")
            await gate.until(lambda: gate.inside == {"h5"})
            gate.go("h5")
            await gw.wait_for(_finished("h5"))
            assert _started(gw) == ["h1", "h5"] and _released(gw) == []

    asyncio.run(main())
    assert gate.ran == ["h1", "h5"]


def test_fresh_claims_past_the_slots_wait_rather_than_drop() -> None:
    """More waiting than the slots allow is not always a claim that ran out: handlers
    still ending after a lost lease or session hold slots the server already freed, and
    the claims it pushed in their place are live. Those are kept (until they are as old
    as a claim lease) and start as the handlers end (found by review: they were dropped
    at once, unreleased, and held the session's slots for a claim lease)."""
    gate = Gate()

    async def main() -> None:
        async with FakeGateway() as gw, _serving(gw, gate, concurrency=1, prefetch=1) as worker:
            await _push(gw, "h1", "h2")
            await gate.until(lambda: gate.inside == {"h1"})
            await _push(gw, "h3")  # the server freed h1's slot early: h3 is live
            await gate.until(lambda: "h3" in worker._waiting)
            assert list(worker._waiting) == ["h2", "h3"]
            gate.go("h1")
            await gate.until(lambda: gate.inside == {"h2"})
            gate.go("h2")
            await gate.until(lambda: gate.inside == {"h3"})
            gate.go("h3")
            await gw.wait_for(_finished("h3"))
            assert _started(gw) == ["h1", "h2", "h3"] and _released(gw) == []

    asyncio.run(main())
    assert gate.ran == ["h1", "h2", "h3"]


def test_a_run_ended_by_a_refused_token_drops_the_waiting_attempts_unreported() -> None:
    """A close for a revoked token, and the token refused at the reconnect: the run ends
    with the refusal; the running attempt is reported unconfirmed as without a prefetch,
    and the waiting ones, never started, are neither released nor counted unreported
    (the server gives their claims back)."""
    gate = Gate()

    async def main() -> tuple[Worker, FakeGateway]:
        async with FakeGateway() as gw:
            worker = _worker(gw, concurrency=1, prefetch=2, reconnect_max=0.1, grace=60.0)
            worker.handler("h")(gate)
            runner = asyncio.create_task(worker.arun())
            await gw.wait_for(_is("hello"))
            await _push(gw, "h1", "h2", "h3")
            await gate.until(lambda: gate.inside == {"h1"} and len(worker._waiting) == 2)
            gw.accepted_token = "another-token"  # "token" is refused from now on
            await gw.connections[-1].close(4401, "UNAUTHENTICATED")
            with pytest.raises(Exception, match="401"):
                await asyncio.wait_for(runner, 10)
            await asyncio.sleep(0.05)  # the dropped attempts' tasks end
            return worker, gw

    worker, gw = asyncio.run(main())
    assert worker.unreported == ["h1"]
    assert worker.running == {} and not worker._waiting
    assert _started(gw) == ["h1"] and _released(gw) == []
    assert gate.ran == ["h1"]
