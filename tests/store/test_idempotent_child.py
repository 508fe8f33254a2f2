"""An idempotent resubmit of a child after its parent was cancelled gets the child its key
made (cancelled with its parent), as any other idempotent retry gets its task: a client
that lost the reply to its submit may retry it. A submit that would make a new child
under a cancelled parent is still refused with PARENT_CANCELLED, as a whole and with
nothing written, in a single submit, a batch, a streamed batch and a batch read a chunk
at a time (``LazyBatch``), on both backends."""

from __future__ import annotations

from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import TaskSpec
from orbit.protocol.submissions import UsualBatch
from orbit.store import Store, Submitted
from orbit.store.store import SUBMIT_CHUNK, submit_chunks
from tests.invariants import check_all
from tests.store.helpers import blind_first_look, queue, submit

#: several chunks (submit_chunks), the last one short
N = 2 * SUBMIT_CHUNK + 7


def _written(store: Store) -> tuple[Any, ...]:
    """Everything a submit could write: the tasks and the event log."""
    events = store.event_list(limit=10 * N)
    return store.task_counts(), len(events), events[-1]["id"] if events else 0


def _child(parent: str, i: int, payload: Any = None, key: str | None = None) -> dict[str, Any]:
    return {
        "queue": "q",
        "handler": "h",
        "payload": {"i": i} if payload is None else payload,
        "idempotency_key": key or f"k{i}",
        "parent_id": parent,
    }


def _submit(store: Store, tasks: list[dict[str, Any]], form: str) -> list[Submitted]:
    """The batch as a list of specs (``eager``) or read a chunk at a time (``lazy``, the
    HTTP reader's ``UsualBatch``)."""
    if form == "eager":
        return store.task_submit_many([TaskSpec(**t) for t in tasks])
    batch = UsualBatch.of({"tasks": tasks})
    assert batch is not None
    return store.task_submit_rendered(batch, lambda d: d)


def _cancelled_family(store: Store, n: int = 1) -> tuple[str, list[Submitted]]:
    """A parent with ``n`` keyed children, all cancelled (the parent's cancel cascades)."""
    queue(store)
    parent = submit(store)
    made = store.task_submit_many([TaskSpec(**_child(parent, i)) for i in range(n)])
    assert all(d.created for d in made)
    store.task_cancel(parent)
    return parent, made


def test_a_childs_resubmit_after_its_parent_was_cancelled_gets_the_child(store: Store) -> None:
    parent, [child] = _cancelled_family(store)
    before = _written(store)
    again = store.task_submit(TaskSpec(**_child(parent, 0)))
    assert not again.created
    assert again.task.id == child.task.id and again.task.state == "cancelled"
    assert again.task == store.task_get(child.task.id)
    assert _written(store) == before  # no task, no event
    assert check_all(store) == []


def test_a_childs_resubmit_with_another_payload_is_still_a_conflict(store: Store) -> None:
    parent, _ = _cancelled_family(store)
    before = _written(store)
    with pytest.raises(OrbitError) as err:
        store.task_submit(TaskSpec(**_child(parent, 0, payload="other")))
    assert err.value.code == Code.IDEMPOTENCY_CONFLICT
    assert _written(store) == before


@pytest.mark.parametrize("key", [None, "new"])
def test_a_new_child_under_a_cancelled_parent_is_refused(store: Store, key: str | None) -> None:
    parent, _ = _cancelled_family(store)
    before = _written(store)
    spec = TaskSpec(queue="q", handler="h", parent_id=parent, idempotency_key=key)
    with pytest.raises(OrbitError) as err:
        store.task_submit(spec)
    assert err.value.code == Code.PARENT_CANCELLED
    assert _written(store) == before


def test_a_missing_parent_is_refused_whatever_the_key_names(store: Store) -> None:
    """PARENT_NOT_FOUND is checked for every spec before any key is honoured, as before:
    a resubmit naming a parent that does not exist is refused. In a batch it now comes
    before a cancelled parent's refusal, whichever parent's id sorts first."""
    parent, _ = _cancelled_family(store)
    before = _written(store)
    with pytest.raises(OrbitError) as err:
        store.task_submit(TaskSpec(**_child("no-such-task", 0)))
    assert err.value.code == Code.PARENT_NOT_FOUND
    batch = [_child(parent, 0), _child(parent, 1, key="new"), _child("no-such-task", 2)]
    with pytest.raises(OrbitError) as err:
        store.task_submit_many([TaskSpec(**t) for t in batch])
    assert err.value.code == Code.PARENT_NOT_FOUND
    assert _written(store) == before


@pytest.mark.parametrize(("form", "n"), [("eager", 3), ("eager", N), ("lazy", N)])
def test_a_batchs_resubmit_after_the_parent_was_cancelled_gets_its_children(
    store: Store, form: str, n: int
) -> None:
    parent, made = _cancelled_family(store, n)
    before = _written(store)
    again = _submit(store, [_child(parent, i) for i in range(n)], form)
    assert [(d.created, d.task.id) for d in again] == [(False, d.task.id) for d in made]
    assert {d.task.state for d in again} == {"cancelled"}
    assert _written(store) == before
    assert check_all(store) == []


@pytest.mark.parametrize(("form", "n"), [("eager", 3), ("eager", N), ("lazy", N)])
def test_a_batch_with_a_new_child_under_a_cancelled_parent_is_refused_whole(
    store: Store, form: str, n: int
) -> None:
    """Existing children's keys and one new child (in the last chunk, read after the
    earlier ones were written in a streamed batch): PARENT_CANCELLED, nothing written;
    the existing children's resubmits do not carry the new one through."""
    parent, _ = _cancelled_family(store, n)
    before = _written(store)
    tasks = [_child(parent, i) for i in range(n)]
    tasks[submit_chunks(n)[-1][0]] = _child(parent, n, key="new")
    with pytest.raises(OrbitError) as err:
        _submit(store, tasks, form)
    assert err.value.code == Code.PARENT_CANCELLED
    assert _written(store) == before
    tasks[submit_chunks(n)[-1][0]]["idempotency_key"] = None  # a keyless child: the same
    with pytest.raises(OrbitError) as err:
        _submit(store, tasks, form)
    assert err.value.code == Code.PARENT_CANCELLED
    assert _written(store) == before
    assert check_all(store) == []


@pytest.mark.parametrize(("form", "n"), [("eager", 1), ("eager", N), ("lazy", N)])
def test_a_key_taken_after_the_look_is_found_under_a_cancelled_parent(
    store: Store, monkeypatch: pytest.MonkeyPatch, form: str, n: int
) -> None:
    """The transaction's look for keys finds none (as if the first submit of this child
    committed just after it, and the cancel after that): the key's task is found when
    the cancelled parent is seen, and the retried transaction returns it."""
    parent, made = _cancelled_family(store, n)
    before = _written(store)
    looks = blind_first_look(store, monkeypatch)
    again = _submit(store, [_child(parent, i) for i in range(n)], form)
    assert looks() == 3  # the blind look, the second one that found the key, the retry's
    assert [(d.created, d.task.id) for d in again] == [(False, d.task.id) for d in made]
    assert _written(store) == before
