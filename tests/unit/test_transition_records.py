"""The records a claim, a start and a finish make without their dataclass's ``__init__``
(``assemble``, ``copied``, ``Plan.moved``, a batch's ``Digests``) are exactly the ones the
constructors and ``dataclasses.replace`` make: every field, no other, the same values."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orbit.core import transitions
from orbit.core.model import (
    Attempt,
    Event,
    Grant,
    Lease,
    Outcome,
    Receipt,
    Task,
    assemble,
    canonical_json,
    copied,
)
from orbit.core.states import AttemptState, TaskState
from orbit.core.transitions import Digests, Plan, digest, receipt_json, spell
from tests.unit.test_rows import _attempt, _session, _task

NOW = 50


def _whole(record: Any) -> None:
    """The record holds every field of its dataclass and no other, and is the record
    its own ``__init__`` makes of those values."""
    assert set(vars(record)) == {f.name for f in fields(record)}
    assert type(record)(**vars(record)) == record


def _plan_records(plan: Plan) -> list[Any]:
    pairs = [*plan.task_writes, *plan.attempt_writes]
    return [r for pair in pairs for r in pair] + [*plan.attempt_inserts, *plan.events]


def test_copied_is_evolve() -> None:
    task = _task()
    changes = {"state": TaskState.CLAIMED, "fence": 3, "updated_at": 9, "version": 5}
    made = copied(task, changes)
    assert made == replace(task, **changes) and made is not task
    _whole(made)
    assert task.state == TaskState.RUNNING  # the original is untouched


def test_assemble_takes_the_values_as_the_records_dict() -> None:
    values = {"task": _task(), "attempt": _attempt()}
    grant = assemble(Grant, values)
    assert grant == Grant(values["task"], values["attempt"])
    _whole(grant)


def test_a_claim_makes_what_the_constructors_make() -> None:
    task = replace(_task(), state=TaskState.QUEUED, fence=2)
    plan = Plan()
    attempt = transitions.claim(plan, task, _session(), attempt_id="a9", now=NOW, claim_ttl=7)
    assert attempt == Attempt(
        id="a9",
        task_id=task.id,
        number=3,
        session_id="s",
        session_epoch=1,
        fence=3,
        state=AttemptState.CLAIMED,
        claimed_at=NOW,
        claim_expires_at=NOW + 7,
        started_at=None,
        lease_expires_at=None,
        ended_at=None,
        finish_digest=None,
        receipt=None,
        queue=task.queue,
        tenant=task.tenant,
        handler=task.handler,
    )
    after = replace(task, state=TaskState.CLAIMED, fence=3, updated_at=NOW, version=5)
    assert plan.task_writes == [(task, after)]
    assert plan.attempt_inserts == [attempt]
    assert plan.events == [
        Event(
            kind="claimed",
            task_id=task.id,
            attempt_id="a9",
            session_id="s",
            queue=task.queue,
            tenant=task.tenant,
            task_from=TaskState.QUEUED,
            task_to=TaskState.CLAIMED,
            attempt_to=AttemptState.CLAIMED,
        )
    ]
    for record in _plan_records(plan):
        _whole(record)


def test_a_start_makes_what_the_constructors_make() -> None:
    task = replace(_task(), state=TaskState.CLAIMED, deadline=None)
    attempt = _attempt(state=AttemptState.CLAIMED, claim_expires_at=100, started_at=None)
    plan = Plan()
    lease = transitions.start(
        plan,
        task,
        attempt,
        _session(),
        epoch=1,
        fence=2,
        queue_paused=False,
        now=NOW,
        lease_ttl=1_000,
    )
    assert lease == Lease("a1", "ok", NOW + 1_000, 1_000)
    _whole(lease)
    after = replace(task, state=TaskState.RUNNING, attempts_used=2, updated_at=NOW, version=5)
    running = replace(
        attempt, state=AttemptState.RUNNING, started_at=NOW, lease_expires_at=NOW + 1_000
    )
    assert plan.task_writes == [(task, after)]
    assert plan.attempt_writes == [(attempt, running)]
    assert plan.events == [
        Event(
            kind="started",
            task_id=task.id,
            attempt_id="a1",
            session_id="s",
            queue=task.queue,
            tenant=task.tenant,
            task_from=TaskState.CLAIMED,
            task_to=TaskState.RUNNING,
            attempt_from=AttemptState.CLAIMED,
            attempt_to=AttemptState.RUNNING,
        )
    ]
    for record in _plan_records(plan):
        _whole(record)


def _finish(
    task: Task, outcome: Outcome, digests: Digests | None = None
) -> tuple[Receipt | None, Plan]:
    plan = Plan()
    receipt = transitions.finish(
        plan,
        task,
        _attempt(lease_expires_at=NOW + 10),
        _session(),
        epoch=1,
        fence=2,
        outcome=outcome,
        spelled=spell(outcome),
        now=NOW,
        rand=0.5,
        digests=digests,
    )
    return receipt, plan


def test_a_successful_finish_makes_what_the_constructors_make() -> None:
    task = replace(_task(), deadline=None)
    outcome = Outcome.success({"n": 1})
    receipt, plan = _finish(task, outcome)
    report = digest(canonical_json(outcome.as_json()))
    expected = Receipt(task.id, "a1", 2, TaskState.SUCCEEDED, AttemptState.SUCCEEDED, report, 1)
    assert receipt == expected and plan.receipt == expected
    _whole(receipt)
    after = replace(
        task,
        state=TaskState.SUCCEEDED,
        result='{"n":1}',
        result_digest=digest('{"n":1}'),
        result_version=1,
        updated_at=NOW,
        finished_at=NOW,
        version=5,
    )
    attempt = _attempt(lease_expires_at=NOW + 10)
    ended = replace(
        attempt,
        state=AttemptState.SUCCEEDED,
        ended_at=NOW,
        finish_digest=report,
        receipt=canonical_json(expected.as_json()),
    )
    assert plan.task_writes == [(task, after)]
    assert plan.attempt_writes == [(attempt, ended)]
    for record in _plan_records(plan):
        _whole(record)


@pytest.mark.parametrize(
    ("task_changes", "outcome"),
    [
        ({}, Outcome.success(None)),
        ({}, Outcome.success("x" * (transitions.DIGESTS_KEPT_CHARS + 1))),
        ({}, Outcome.failure("E", "boom", retryable=True)),  # retried
        ({"attempts_used": 3}, Outcome.failure("E", "boom", retryable=True)),  # failed
        ({"state": TaskState.CANCELLING}, Outcome.success(None)),
        ({"deadline": NOW}, Outcome.success(None)),  # refused: its deadline passed
    ],
)
def test_a_finish_plans_the_same_with_a_batchs_digests_as_alone(
    task_changes: dict[str, Any], outcome: Outcome
) -> None:
    """A batch's ``Digests``, already holding its texts' digests, gives every finish the
    plan and receipt it makes alone; every record is whole."""
    task = replace(_task(), **{"deadline": None, **task_changes})
    digests = Digests()
    made = [
        _finish(task, outcome),
        _finish(task, outcome, digests),
        _finish(task, outcome, digests),
    ]
    # a rejection is an exception, equal only to itself: compared by its repr
    alone, first, again = [
        (receipt, replace(plan, rejection=None), repr(plan.rejection)) for receipt, plan in made
    ]
    assert alone == first == again
    for record in _plan_records(made[0][1]):
        _whole(record)


def test_digests_are_digest_and_keep_only_short_texts() -> None:
    digests = Digests()
    short, long = "null", "y" * (transitions.DIGESTS_KEPT_CHARS + 1)
    edge = "z" * transitions.DIGESTS_KEPT_CHARS
    for text in (short, long, edge, short, long):
        assert digests[text] == digest(text)
    assert set(digests) == {short, edge}


_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=6)


@given(_TEXT, _TEXT, st.integers(0, 2**70), st.integers(-(2**70), 2**70), _TEXT)
def test_a_receipt_is_spelled_as_canonical_json_spells_it(
    task_id: str, attempt_id: str, fence: int, version: int, digest_text: str
) -> None:
    receipt = Receipt(
        task_id,
        attempt_id,
        fence,
        TaskState.SUCCEEDED,
        AttemptState.SUCCEEDED,
        digest_text,
        version,
    )
    assert receipt_json(receipt) == canonical_json(receipt.as_json())
