"""The fast paths say exactly what the slower, plainer paths they replace say."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orbit.core.model import Backoff, Task, TaskSpec, compact_json, evolve
from orbit.core.states import TaskState
from orbit.core.transitions import new_task
from orbit.protocol.convert import EPOCH, instant_to_wire
from orbit.protocol.decode import DecodeError, _find_bad_value, _values_ok
from orbit.protocol.messages import TaskView
from orbit.server.views import task_wire

LAST_INSTANT = 253_370_764_800_000_000 - 1  # 9998-12-31T23:59:59.999999Z, the last valid


@given(st.integers(min_value=0, max_value=LAST_INSTANT))
def test_instants_format_as_datetime_does(us: int) -> None:
    reference = (EPOCH + timedelta(microseconds=us)).isoformat(timespec="microseconds")
    assert instant_to_wire(us) == reference.replace("+00:00", "Z")


def test_instant_edges() -> None:
    assert instant_to_wire(None) is None
    assert instant_to_wire(0) == "1970-01-01T00:00:00.000000Z"
    assert instant_to_wire(LAST_INSTANT) == "9998-12-31T23:59:59.999999Z"


def _task() -> Task:
    spec = TaskSpec(queue="q", handler="h", payload={"b": [1, 2.5, "x"], "a": None})
    return new_task(spec, task_id="t1", payload=json.dumps(spec.payload), now=1_800_000_000_123)


def task_view(task: Task) -> TaskView:
    return TaskView.model_validate(task_wire(task))


def test_task_wire_is_task_view_dumped() -> None:
    fresh = _task()
    finished = evolve(
        fresh,
        state=TaskState.FAILED,
        result='{"partial":true}',
        error_code="BOOM",
        error_message="it broke",
        error_retryable=False,
        finished_at=1_800_000_999_000,
        deadline=1_900_000_000_000,
        attempt_timeout_us=2_500_000,
        parent_id="p1",
        idempotency_key="k",
        backoff=Backoff(),
    )
    for task in (fresh, finished):
        assert task_wire(task) == task_view(task).model_dump(mode="json")
        assert json.loads(compact_json(task_wire(task))) == task_view(task).model_dump(mode="json")


def test_compact_json_falls_back_for_integers_orjson_refuses() -> None:
    big = {"n": 2**70, "s": "é"}
    assert json.loads(compact_json(big)) == big
    assert json.loads(compact_json({"n": 1, "s": "é"})) == {"n": 1, "s": "é"}


_LEAVES = st.none() | st.booleans() | st.integers() | st.text(alphabet="ab\x00", max_size=3)


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@given(
    st.recursive(
        _LEAVES,
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.dictionaries(st.text(alphabet="k\x00", max_size=2), kids, max_size=3)
        ),
        max_leaves=12,
    ),
    st.integers(min_value=0, max_value=70),
)
def test_the_quick_value_check_agrees_with_the_one_that_names_the_culprit(
    value: Any, wrap: int
) -> None:
    """The fast walk passes exactly the values the path-naming walk passes, and whenever
    it refuses one, the path-naming walk raises (so nothing bad slips through)."""
    value = _nested(wrap, value)
    try:
        _find_bad_value(value, "")
        slow_ok = True
    except DecodeError as exc:
        slow_ok = False
        assert exc.code in ("NUL_CHARACTER", "TOO_DEEP")
    assert _values_ok(value) == slow_ok
