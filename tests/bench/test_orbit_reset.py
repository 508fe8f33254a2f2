"""The Orbit system's reset between runs gives its TRUNCATE another try when PostgreSQL
picks it as a deadlock's victim, and only then."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

from benchmarks.systems.orbit_system import RESET_TRIES, retry_deadlocks


def _failing(errors: list[Exception]) -> tuple[list[int], Callable[[], None]]:
    calls: list[int] = []

    def call() -> None:
        calls.append(1)
        if errors:
            raise errors.pop(0)

    return calls, call


def test_a_deadlock_victim_is_tried_again() -> None:
    calls, call = _failing([psycopg.errors.DeadlockDetected(), psycopg.errors.DeadlockDetected()])
    retry_deadlocks(call)
    assert len(calls) == 3


def test_a_deadlock_on_every_try_is_raised() -> None:
    calls, call = _failing([psycopg.errors.DeadlockDetected() for _ in range(RESET_TRIES)])
    with pytest.raises(psycopg.errors.DeadlockDetected):
        retry_deadlocks(call)
    assert len(calls) == RESET_TRIES


def test_any_other_error_is_raised_at_once() -> None:
    calls, call = _failing([psycopg.errors.UndefinedTable()])
    with pytest.raises(psycopg.errors.UndefinedTable):
        retry_deadlocks(call)
    assert len(calls) == 1
