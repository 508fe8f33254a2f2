"""The pauses between a worker's tries to reconnect (``ReconnectBackoff``): exponential,
spread by "equal jitter" so that a fleet a server restart dropped together does not
come back together, prompt at first, and stretched to what a refusal's ``Retry-After``
asks for. The random source is injected: every pause here is known exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from websockets.datastructures import Headers
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from orbit.worker.runner import (
    RECONNECT_FIRST_S,
    RETRY_AFTER_MAX_S,
    Context,
    ReconnectBackoff,
    Worker,
    _retry_after,
)
from tests.unit.fake_gateway import FakeGateway


def draws(values: Iterable[float]) -> Callable[[], float]:
    """A random source that returns ``values`` in turn (and fails the test past them)."""
    it = iter(values)
    return lambda: next(it)


def pauses(backoff: ReconnectBackoff, n: int) -> list[float]:
    return [round(backoff.pause(), 6) for _ in range(n)]


def test_the_pauses_double_up_to_reconnect_max_each_drawn_between_half_and_all_its_base() -> None:
    """The base runs 0.1, 0.2, 0.4, ... up to ``reconnect_max`` (5 by default), and each
    pause is half its base plus the draw's share of the other half: 0 gives the least
    pause, a draw near 1 the longest, 0.5 the middle."""
    assert pauses(ReconnectBackoff(5.0, lambda: 0.0), 9) == [
        0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.5, 2.5, 2.5
    ]  # fmt: skip
    assert pauses(ReconnectBackoff(5.0, lambda: 1.0), 9) == [
        0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0
    ]  # fmt: skip
    drawn = draws([0.5, 0.0, 1.0, 0.25, 0.5, 0.75, 0.5])
    assert pauses(ReconnectBackoff(5.0, drawn), 7) == [0.075, 0.1, 0.4, 0.5, 1.2, 2.8, 3.75]


def test_workers_with_different_draws_pause_apart() -> None:
    """What breaks the lockstep of a fleet: two workers dropped at the same instant, with
    their own draws, pause for different times at every try, at the cap too."""
    early = pauses(ReconnectBackoff(5.0, lambda: 0.1), 8)
    late = pauses(ReconnectBackoff(5.0, lambda: 0.9), 8)
    assert all(a < b for a, b in zip(early, late, strict=True)), (early, late)
    assert early[-1] == 2.75 and late[-1] == 4.75


def test_the_first_pause_stays_prompt_whatever_reconnect_max_is() -> None:
    """A lone worker that lost its connection is not kept waiting by a long
    ``reconnect_max``: the first pause is at most ``RECONNECT_FIRST_S`` for any draw; only
    later ones grow towards the cap."""
    assert RECONNECT_FIRST_S == 0.1
    for draw in (0.0, 0.5, 0.999999):
        first = ReconnectBackoff(3600.0, draws([draw])).pause()
        assert RECONNECT_FIRST_S / 2 <= first <= RECONNECT_FIRST_S


def test_a_reconnect_max_under_the_first_base_bounds_every_pause() -> None:
    """``reconnect_max`` is the longest pause, the first one included (it was 0.1 s
    whatever ``reconnect_max`` said)."""
    assert pauses(ReconnectBackoff(0.01, lambda: 1.0), 3) == [0.01, 0.01, 0.01]
    assert pauses(ReconnectBackoff(0.01, lambda: 0.0), 3) == [0.005, 0.005, 0.005]


def test_a_retry_after_is_waited_out_and_spread_up_to_twice_it() -> None:
    """A refusal's ``Retry-After`` of N seconds makes that pause between N and 2N (by the
    draw): never shorter than asked, and a fleet refused together is spread again. The
    back-off goes on doubling underneath, and the next pause without one is the
    back-off's again."""
    backoff = ReconnectBackoff(5.0, draws([0.0, 1.0, 0.5, 1.0]))
    assert backoff.pause(1.0) == 1.0
    assert backoff.pause(1.0) == 2.0
    assert backoff.pause(3.0) == 4.5
    assert backoff.pause() == 0.8  # the fourth base, 0.1 doubled three times


def test_a_back_off_longer_than_the_retry_after_wins() -> None:
    backoff = ReconnectBackoff(5.0, lambda: 0.0)
    pauses(backoff, 7)  # at the cap: 5 s
    assert backoff.pause(1.0) == 2.5  # 1 s asked for, and half the back-off's base is more


def test_a_retry_after_of_zero_leaves_the_back_off_as_it_is() -> None:
    """``Retry-After: 0`` asks for no wait; the back-off still paces the tries (honoured
    alone, it would have the worker try again at once, for ever)."""
    assert ReconnectBackoff(5.0, lambda: 0.0).pause(0.0) == 0.05


def test_a_long_retry_after_is_capped() -> None:
    """A proxy's maintenance page asking for an hour does not keep a worker away for an
    hour: the delay is taken as ``RETRY_AFTER_MAX_S``."""
    assert ReconnectBackoff(5.0, lambda: 0.0).pause(3600.0) == RETRY_AFTER_MAX_S
    assert ReconnectBackoff(5.0, lambda: 1.0).pause(3600.0) == 2 * RETRY_AFTER_MAX_S
    assert ReconnectBackoff(5.0, lambda: 0.0).pause(float("inf")) == RETRY_AFTER_MAX_S


def refusal(status: int, *retry_after: str) -> InvalidStatus:
    """The exception websockets raises for an upgrade answered ``status``."""
    headers = Headers([("Retry-After", value) for value in retry_after])
    return InvalidStatus(Response(status, "refused", headers, b""))


@pytest.mark.parametrize(("status", "header", "seconds"), [(503, "1", 1.0), (429, " 7 ", 7.0)])
def test_the_retry_after_of_a_503_or_a_429_is_read(
    status: int, header: str, seconds: float
) -> None:
    assert _retry_after(refusal(status, header)) == seconds


@pytest.mark.parametrize(
    ("status", "given"),
    [
        (503, ()),  # none given
        (500, ("5",)),  # a status it means nothing on
        (401, ("5",)),
        (502, ("5",)),
        (503, ("soon",)),
        (503, ("-1",)),
        (503, ("1.5",)),
        (503, ("",)),
        (503, ("\u00b9",)),  # "¹" (the byte 0xB9, read as Latin-1): a str.isdigit digit
        (503, ("Wed, 21 Oct 2026 07:28:00 GMT",)),  # a date: the clocks would differ
        (503, ("1", "60")),  # given twice: which one?
    ],
    ids=lambda v: str(v),
)
def test_a_retry_after_that_cannot_be_trusted_is_ignored(
    status: int, given: tuple[str, ...]
) -> None:
    """None, and the back-off decides the pause, as for a refusal that gave none."""
    assert _retry_after(refusal(status, *given)) is None


def test_a_failure_with_no_answer_has_no_retry_after() -> None:
    assert _retry_after(ConnectionRefusedError()) is None


def test_the_worker_draws_each_pause_from_its_random_source() -> None:
    """The reconnect loop takes its pauses from ``ReconnectBackoff`` with the worker's
    random source: one draw for each failed try, none for the try that works."""
    drawn: list[float] = []

    def source() -> float:
        drawn.append(0.0)
        return 0.0

    async def main() -> None:
        async with FakeGateway(reject=[503, 500, 502]) as gw:
            worker = Worker(gw.url, "token", reconnect_max=0.1)
            worker._reconnect_random = source

            @worker.handler("h")
            async def handler(ctx: Context, payload: Any) -> Any:
                return None

            runner = asyncio.create_task(worker.arun())
            try:
                await gw.wait_for(lambda m: m["type"] == "hello")
            finally:
                worker.stop()
                assert await asyncio.wait_for(runner, 10) == 0
            assert gw.attempts == 4

    asyncio.run(main())
    assert len(drawn) == 3
