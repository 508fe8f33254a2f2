"""Fixes from a review of retries, timeouts and deadlines, on both backends: a resolve's
result is held to a finish's size bound; a task failed DEADLINE_EXCEEDED before its
deadline says why; a duration under 1 µs is refused saying what the floor is."""

from __future__ import annotations

import re

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import SECOND, Backoff, Outcome, TaskSpec
from orbit.core.retry import MAX_ERROR_MESSAGE
from orbit.core.validate import MAX_RESULT_CHARS
from orbit.protocol.convert import instant_to_wire
from orbit.store import Store
from orbit.worker.outcomes import MAX_OUTCOME_CHARS
from tests.conftest import ManualClock
from tests.invariants import check_all
from tests.store.helpers import queue, run_one, submit, worker


def _needs_review(store: Store, clock: ManualClock) -> str:
    queue(store)
    tid = submit(store, max_attempts=1)
    s, _ = worker(store)
    run_one(store, s)
    clock.advance(30)
    store.reap()
    assert store.task_get(tid).state == "needs_review"
    return tid


def _text_of_chars(chars: int) -> str:
    """A string whose JSON spelling is ``chars`` characters (its two quotes included)."""
    return "x" * (chars - 2)


def test_the_result_bound_is_what_a_workers_finish_can_carry() -> None:
    assert MAX_RESULT_CHARS == MAX_OUTCOME_CHARS


def test_a_resolve_result_larger_than_a_finish_can_carry_is_refused(
    store: Store, clock: ManualClock
) -> None:
    """The reviewer's case: a 12 MB result was resolved ``succeeded`` and stored, though
    a worker's finish carries at most a 4 MiB frame. It is refused, and nothing changes;
    a result of exactly the bound is taken."""
    tid = _needs_review(store, clock)
    before = store.task_get(tid)
    events = len(store.event_list(task_id=tid))
    too_large = Outcome.success(_text_of_chars(MAX_RESULT_CHARS + 1))
    with pytest.raises(OrbitError) as err:
        store.task_resolve(tid, "succeeded", too_large)
    assert (err.value.code, err.value.field) == (Code.PAYLOAD_TOO_LARGE, "result")
    assert f"{MAX_RESULT_CHARS + 1} characters" in err.value.message
    assert store.task_get(tid) == before
    assert len(store.event_list(task_id=tid)) == events
    fits = _text_of_chars(MAX_RESULT_CHARS)
    done = store.task_resolve(tid, "succeeded", Outcome.success(fits))
    assert done.state == "succeeded" and done.result is not None
    assert len(done.result) == MAX_RESULT_CHARS
    assert check_all(store) == []


_PAST = re.compile(
    r"the next attempt \(at (?P<at>\S+)\) would fall past the deadline "
    r"\((?P<deadline>\S+)\); last attempt: (?P<last>.*)\Z",
    re.DOTALL,
)


def _past_deadline(message: str | None) -> dict[str, str]:
    assert message is not None
    found = _PAST.match(message)
    assert found is not None, message
    return found.groupdict()


def test_a_reported_failure_whose_retry_falls_past_the_deadline_says_so(
    store: Store, clock: ManualClock
) -> None:
    """The task failed DEADLINE_EXCEEDED well before its deadline, its message only the
    worker's "BOOM: boom": it now names the next attempt's instant and the deadline,
    then what the attempt reported."""
    queue(store)
    backoff = Backoff(base_us=20 * SECOND, factor=1.0, max_us=20 * SECOND)
    deadline = clock.now + 6 * SECOND
    tid = submit(store, deadline=deadline, backoff=backoff)
    s, _ = worker(store)
    g = run_one(store, s)
    failed_at = clock.now
    store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("BOOM", "boom")
    )
    task = store.task_get(tid)
    assert (task.state, task.error_code) == ("failed", "DEADLINE_EXCEEDED")
    said = _past_deadline(task.error_message)
    assert said["deadline"] == instant_to_wire(deadline)
    # equal jitter: the next attempt was 10 to 20 s after the failure
    earliest, latest = (
        instant_to_wire(failed_at + 10 * SECOND),
        instant_to_wire(failed_at + 20 * SECOND),
    )
    assert earliest <= said["at"] <= latest
    assert said["last"] == "BOOM: boom"
    assert check_all(store) == []


def test_a_lost_lease_whose_retry_falls_past_the_deadline_says_so(
    store: Store, clock: ManualClock
) -> None:
    """A retry_safe task whose lease ran out: the message was only "the run lease
    expired without a report", on a task failed DEADLINE_EXCEEDED before its deadline."""
    queue(store)
    backoff = Backoff(base_us=60 * SECOND, factor=1.0, max_us=60 * SECOND)
    deadline = clock.now + 40 * SECOND
    tid = submit(store, deadline=deadline, backoff=backoff, retry_safe=True)
    s, _ = worker(store)
    run_one(store, s)
    clock.advance(31)  # the 30 s lease runs out, 9 s before the deadline
    store.reap()
    task = store.task_get(tid)
    assert (task.state, task.error_code) == ("failed", "DEADLINE_EXCEEDED")
    said = _past_deadline(task.error_message)
    assert said["deadline"] == instant_to_wire(deadline)
    assert said["at"] > said["deadline"]
    assert said["last"] == "ATTEMPT_LOST: the run lease expired without a report"
    assert check_all(store) == []


def test_the_past_deadline_message_keeps_within_a_messages_bound(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    backoff = Backoff(base_us=20 * SECOND, factor=1.0, max_us=20 * SECOND)
    tid = submit(store, deadline=clock.now + 5 * SECOND, backoff=backoff)
    s, _ = worker(store)
    g = run_one(store, s)
    long = "m" * MAX_ERROR_MESSAGE
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("E", long))
    message = store.task_get(tid).error_message
    assert message is not None and len(message) == MAX_ERROR_MESSAGE
    assert _past_deadline(message)["last"].startswith("E: mmm")


@pytest.mark.parametrize(
    ("spec", "code", "field"),
    [
        ({"attempt_timeout_us": 0}, Code.INVALID_TIMEOUT, "attempt_timeout"),
        (
            {"backoff": Backoff(base_us=0, factor=2.0, max_us=SECOND)},
            Code.INVALID_BACKOFF,
            "backoff.base",
        ),
    ],
)
def test_a_duration_under_a_microsecond_is_refused_naming_the_floor(
    store: Store, spec: dict[str, object], code: Code, field: str
) -> None:
    """0.0000001 s reaches the store as 0 µs; the message said "positive" (or "> 0"),
    which the input was."""
    queue(store)
    with pytest.raises(OrbitError) as err:
        store.task_submit(TaskSpec(queue="q", handler="h", **spec))  # type: ignore[arg-type]
    assert (err.value.code, err.value.field) == (code, field)
    assert "at least 0.000001 s (1 µs) and at most a year" in err.value.message
    assert store.task_list() == []
