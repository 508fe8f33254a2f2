"""No renew of an attempt crosses its finish. A renew that did reached the server after
the finish had committed, which refused it (ATTEMPT_ENDED) and kept a ``rejected`` event
after ``succeeded`` in the task's history (seen on PostgreSQL with 3 s handlers and 3 s
leases). Now a finish waits for the renew already on its way with its attempt (whose
answer may say the lease is lost); an attempt whose finish is on its way is renewed only
once its own renewal falls due and has been put off once (a slow finish still has its
lease kept); an attempt whose finish was answered is in no later renew. While a finish
the server could not try waits to be sent again, its lease is still renewed. Against
``FakeGateway``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection

from orbit.worker.runner import Worker
from tests.unit.fake_gateway import FakeGateway
from tests.unit.test_worker_prefetch import Gate, _push, _worker
from tests.unit.test_worker_recovery import _finished, _is, running


def _renews_of(gw: FakeGateway, attempt_id: str, since: int = 0) -> list[dict[str, Any]]:
    return [
        m for m in gw.received[since:] if m["type"] == "renew" and attempt_id in m["attempt_ids"]
    ]


class Held:
    """A gateway hook that holds the answer to the first request ``match`` picks until
    ``release`` (the gateway reads on meanwhile), then sends ``answer(gw, msg)``."""

    def __init__(self, match: Any, answer: Any = None) -> None:
        self.match = match
        self.answer = answer or (lambda gw, msg: gw.answer(msg))
        self.held: dict[str, Any] | None = None
        self.go = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
        if self.held is not None or not self.match(msg):
            return False
        self.held = msg

        async def later() -> None:
            await self.go.wait()
            await ws.send(json.dumps(self.answer(gw, msg)))

        task = asyncio.create_task(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True


def test_no_renew_carries_an_attempt_whose_finish_was_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """a1's finish is answered while b1 runs on; the renew loop gets its turn before a1's
    own task resumes (here: held until the gateway has a renew sent after the answer).
    That renew carries b1 alone. It carried a1 too, which the server, the finish
    committed, refused with a rejected event."""
    gate = Gate()
    answered_at: list[int] = []
    send_finishes = Worker._send_finishes

    async def answered_then_a_renew(
        self: Worker, items: list[Any]
    ) -> list[dict[str, Any] | BaseException]:
        answers = await send_finishes(self, items)
        gw = self._test_gw  # type: ignore[attr-defined]
        for attempt_id, _, _, _ in items:
            # Its renewal due, and put off once already: only the answer leaves it out.
            r = self.running[attempt_id]
            r.finish_deferred = True
            self._renew_at(r, 0.0)
        answered_at.append(len(gw.received))
        self._lease_changed.set()
        await gw.wait_for(lambda m: m["type"] == "renew" and m in gw.received[answered_at[0] :])
        return answers

    monkeypatch.setattr(Worker, "_send_finishes", answered_then_a_renew)

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = _worker(gw, concurrency=2, renew_interval=0.05)
            worker._test_gw = gw  # type: ignore[attr-defined]
            worker.handler("a")(gate)
            worker.handler("b")(gate)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push(gw, "a1", "b1")
                await gate.until(lambda: gate.inside == {"a1", "b1"})
                await gw.wait_for(lambda m: bool(_renews_of(gw, "a1")))
                gate.go("a1")
                await gate.until(lambda: "a1" not in worker.running)
                after = [m for m in gw.received[answered_at[0] :] if m["type"] == "renew"]
                assert after and all(m["attempt_ids"] == ["b1"] for m in after), after
                gate.go("b1")
            assert gw.finished.keys() == {"a1", "b1"}

    asyncio.run(main())


def test_a_finish_on_its_way_is_not_renewed_along_with_others() -> None:
    """a1's finish is held unanswered while b1 runs on: the renewals sent meanwhile (every
    50 ms, b1's) carry b1 alone, a1's own renewal not being due (60 s leases). They
    carried a1 too: reaching the server after the finish had committed, refused."""
    gate = Gate()
    hold = Held(_finished("a1"))

    async def main() -> None:
        async with FakeGateway(on_request=hold) as gw:
            worker = _worker(gw, concurrency=2, renew_interval=0.05)
            worker.handler("a")(gate)
            worker.handler("b")(gate)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push(gw, "a1", "b1")
                await gate.until(lambda: gate.inside == {"a1", "b1"})
                await gw.wait_for(lambda m: bool(_renews_of(gw, "a1")))
                gate.go("a1")
                await gw.wait_for(_finished("a1"))
                since = len(gw.received)
                await gw.count(lambda m: m in _renews_of(gw, "b1", since), 3)
                assert _renews_of(gw, "a1", since) == []
                hold.go.set()
                await gate.until(lambda: "a1" not in worker.running)
                gate.go("b1")
            assert gw.finished.keys() == {"a1", "b1"}

    asyncio.run(main())


def test_a_finish_slow_to_answer_still_has_its_lease_renewed() -> None:
    """Leases of 3 s: a1's finish is held unanswered past the time its renewal falls due
    (1.5 s) and the once it is put off: a1 is renewed all the same, its lease kept for a
    finish that is slow to commit."""
    gate = Gate()
    hold = Held(_finished("a1"))

    async def main() -> None:
        async with FakeGateway(on_request=hold, lease_left=3.0) as gw:
            worker = _worker(gw, concurrency=1)
            worker.handler("a")(gate)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push(gw, "a1")
                await gate.until(lambda: gate.inside == {"a1"})
                gate.go("a1")
                await gw.wait_for(_finished("a1"))
                since = len(gw.received)
                await gw.wait_for(lambda m: m in _renews_of(gw, "a1", since))
                hold.go.set()
                await gate.until(lambda: "a1" not in worker.running)
            assert "a1" in gw.finished

    asyncio.run(main())


def test_a_finish_waits_for_the_renew_on_its_way_with_its_attempt() -> None:
    """A renew carrying a1 is on its way when a1's handler returns: the finish is not
    sent before that renew is answered. Here the answer says the lease is lost, so the
    outcome is dropped, never sent; sent at once, it crossed the renew."""
    gate = Gate()

    def lost(gw: FakeGateway, msg: dict[str, Any]) -> dict[str, Any]:
        answer = gw.answer(msg)
        for lease in answer["leases"]:
            lease.update(status="lost", lease_expires_at=None, lease_left=None)
        return answer

    hold = Held(lambda m: m["type"] == "renew" and "a1" in m["attempt_ids"], lost)

    async def main() -> None:
        async with FakeGateway(on_request=hold) as gw:
            worker = _worker(gw, concurrency=1, renew_interval=0.05)
            worker.handler("a")(gate)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push(gw, "a1")
                await gate.until(lambda: gate.inside == {"a1"} and hold.held is not None)
                gate.go("a1")
                # The handler has returned: the finish is sent, or waits for the renew.
                await gate.until(lambda: "a1" not in worker.running or worker.running["a1"].ended)
                hold.go.set()
                await gate.until(lambda: "a1" not in worker.running)
            assert not any(_finished("a1")(m) for m in gw.received)
            assert "a1" not in gw.finished

    asyncio.run(main())


def test_a_finish_answered_internal_is_renewed_while_it_waits_to_be_sent_again() -> None:
    """The first finish is answered INTERNAL: while its copy waits (0.1 s), a1 is renewed
    again, as docs/worker.md promises; the copy is then taken."""
    gate = Gate()
    answered: list[str] = []

    async def internal_once(gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
        if not _finished("a1")(msg) or answered:
            return False
        answered.append(msg["type"])
        error = {"type": "error", "req_id": msg["req_id"], "code": "INTERNAL", "message": "x"}
        await ws.send(json.dumps(error))
        return True

    async def main() -> None:
        async with FakeGateway(on_request=internal_once) as gw:
            worker = _worker(gw, concurrency=1, renew_interval=0.05)
            worker.handler("a")(gate)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                await _push(gw, "a1")
                await gate.until(lambda: gate.inside == {"a1"})
                gate.go("a1")
                await gw.count(_finished("a1"), 2)
                first, again = [i for i, m in enumerate(gw.received) if _finished("a1")(m)]
                assert [m for m in gw.received[first:again] if m["type"] == "renew"], (
                    "not renewed while the finish waited to be sent again"
                )
                await gate.until(lambda: "a1" not in worker.running)
            assert "a1" in gw.finished

    asyncio.run(main())


def test_a_finish_waits_for_a_renew_sent_while_it_waited_for_the_last() -> None:
    """The renew loop may send another renew carrying the attempt between the answer of
    the one a finish waited for and the finish's task resuming: the finish waits for that
    one too (it waited for the first alone, and could cross the second)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        attempt = SimpleNamespace(renewing=first)
        settled = asyncio.ensure_future(Worker._renewal_settled(None, attempt))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the finish waits for the first renew's answer
        # the renew loop's next renew, carrying the attempt, set out as the first is answered
        first.add_done_callback(lambda _: setattr(attempt, "renewing", second))
        first.set_result(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not settled.done()
        second.set_result(None)
        await settled

    asyncio.run(scenario())
