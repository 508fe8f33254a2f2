"""What ``Worker.handler`` refuses at registration, and what ``Worker(...)`` refuses as
timings. A handler that can never run a task was accepted, and then failed every attempt
(a wrong arity retried max_attempts times; a generator ``__call__`` RESULT_NOT_JSON). A
refusal names the handler or the option and registers or changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import pytest

from orbit import Context, Worker


class GeneratorCall:
    def __call__(self, ctx: Context, payload: Any) -> Iterator[int]:
        yield 1


class AsyncGeneratorCall:
    async def __call__(self, ctx: Context, payload: Any) -> AsyncIterator[int]:
        yield 1


class TooFewCall:
    def __call__(self, ctx: Context) -> int:
        return 1


def _three(a: Any, b: Any, c: Any) -> int:
    return 1


REFUSED: dict[str, tuple[Any, str]] = {
    "no_arguments": (lambda: 1, "its signature is ()"),
    "one_argument": (lambda ctx: 1, "its signature is (ctx)"),
    "three_required": (_three, "missing a required argument: 'c'"),
    "call_too_few": (TooFewCall(), "its signature is (ctx: 'Context')"),
    "partial_too_many": (partial(_three, 1, 2), "its signature is (c: 'Any')"),
    "generator_call": (GeneratorCall(), "generator function cannot be a handler"),
    "async_generator_call": (AsyncGeneratorCall(), "generator function cannot be a handler"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_handler_that_can_never_run_is_refused_and_registers_nothing(case: str) -> None:
    fn, says = REFUSED[case]
    worker = Worker("http://127.0.0.1:8000", name="w")
    worker.handler("kept")(lambda ctx, payload: 1)
    before = dict(worker.handlers)
    with pytest.raises(TypeError, match="handler bad") as raised:
        worker.handler("bad")(fn)
    assert says in str(raised.value)
    assert worker.handlers == before


async def _async_ok(ctx: Context, payload: Any) -> int:
    return 1


class AsyncCall:
    async def __call__(self, ctx: Context, payload: Any) -> int:
        return 1


ACCEPTED: dict[str, Any] = {
    "two": lambda ctx, payload: 1,
    "star_args": lambda *args: 1,
    "defaulted_third": lambda ctx, payload, extra=1: 1,
    "keyword_only_default": lambda ctx, payload, *, extra=1: 1,
    "partial": partial(_three, 1),
    "async": _async_ok,
    "async_call": AsyncCall(),
    "builtin": print,
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_a_handler_callable_as_ctx_payload_is_accepted(case: str) -> None:
    worker = Worker("http://127.0.0.1:8000", name="w")
    worker.handler("ok")(ACCEPTED[case])
    assert list(worker.handlers) == ["ok"]


TIMINGS = ("grace", "cancel_grace", "request_timeout", "reconnect_max", "renew_interval")
ZERO_OK = {"grace", "cancel_grace"}


NOT_NUMBERS = [
    (option, value)
    for option in TIMINGS
    for value in ["5", True, False, None, [1], 1j]
    if not (option == "renew_interval" and value is None)  # its default: the lease's pace
]


@pytest.mark.parametrize(("option", "value"), NOT_NUMBERS)
def test_a_timing_that_is_no_real_number_is_a_type_error_naming_it(
    option: str, value: object
) -> None:
    with pytest.raises(TypeError, match=f"^{option} must be a number of seconds"):
        Worker("http://127.0.0.1:8000", **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("option", TIMINGS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -1, -0.5])
def test_a_timing_out_of_range_is_a_value_error_naming_it(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{option} must be"):
        Worker("http://127.0.0.1:8000", **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("option", TIMINGS)
def test_zero_is_taken_only_where_the_docs_allow_it(option: str) -> None:
    if option in ZERO_OK:
        worker = Worker("http://127.0.0.1:8000", **{option: 0})  # type: ignore[arg-type]
        assert getattr(worker, option) == 0
    else:
        with pytest.raises(ValueError, match=f"^{option} must be more than 0 seconds"):
            Worker("http://127.0.0.1:8000", **{option: 0})  # type: ignore[arg-type]


@pytest.mark.parametrize("option", TIMINGS)
@pytest.mark.parametrize("value", [1, 2.5, 3600])
def test_a_finite_number_of_seconds_is_taken(option: str, value: float) -> None:
    worker = Worker("http://127.0.0.1:8000", **{option: value})  # type: ignore[arg-type]
    assert getattr(worker, option) == value
