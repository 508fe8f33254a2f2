"""The fast paths say exactly what the slower, plainer paths they replace say."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import (
    Backoff,
    Capability,
    Grant,
    Lease,
    Outcome,
    Receipt,
    Task,
    TaskSpec,
    canonical_json,
    compact_json,
    evolve,
    parse_json,
    sorted_json_texts,
)
from orbit.core.states import AttemptState, TaskState
from orbit.core.transitions import new_task
from orbit.core.validate import check_payload
from orbit.protocol.convert import EPOCH, instant_to_wire
from orbit.protocol.decode import (
    MAX_DEPTH,
    MAX_INT,
    MIN_INT,
    DecodeError,
    _find_bad_value,
    decode_json,
    values_ok,
)
from orbit.protocol.messages import (
    Assignment,
    FinishedManyMessage,
    FinishedMessage,
    RenewedMessage,
    StartedManyMessage,
    StartedMessage,
    TasksMessage,
    TaskView,
)
from orbit.server.gateway import any_fenced, finished_many_wire, started_many_wire, tasks_frame
from orbit.server.metrics import Metrics
from orbit.server.views import assignments_wire, lease_wire, receipt_wire, task_wire
from orbit.store import open_store

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
    assert values_ok(value) == slow_ok


@given(
    st.recursive(
        _LEAVES | st.floats(),
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.dictionaries(st.text(alphabet="k\x00", max_size=2), kids, max_size=3)
        ),
        max_leaves=12,
    ),
    st.integers(min_value=0, max_value=70),
    st.integers(min_value=0, max_value=66),
)
def test_the_quick_value_check_agrees_under_dicts_and_from_any_depth(
    value: Any, wrap: int, start: int
) -> None:
    """The same agreement with the value wrapped in dicts (whose keys count as a level)
    and checked from a starting depth, as the readers check a payload inside a body:
    dicts and lists at and past the nesting limit, floats among the scalars."""
    for _ in range(wrap):
        value = {"k": value}
    try:
        _find_bad_value(value, "", start)
        slow_ok = True
    except DecodeError:
        slow_ok = False
    assert values_ok(value, start) == slow_ok


def test_the_quick_value_check_at_the_nesting_limit() -> None:
    """Every container shape at each depth around the limit, as the path-naming walk
    judges it: the quick walk's loops run only below the limit."""
    shapes: list[Any] = [{}, [], {"k": 1}, {"k": "a"}, {"k": None}, ["a"], [1.5], [[]], [{}]]
    shapes += [{"k": [1]}, {"k\x00": 1}, ["a\x00"], {"k": {"j": 2}}]
    for start in range(MAX_DEPTH - 3, MAX_DEPTH + 3):
        for value in shapes:
            try:
                _find_bad_value(value, "", start)
                slow_ok = True
            except DecodeError:
                slow_ok = False
            assert values_ok(value, start) == slow_ok, (start, value)


def test_worker_replies_are_their_models_dumped(tmp_path: Path) -> None:
    """The hot worker replies, built as dicts, say what their pydantic models say."""
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        store.queue_create("q", max_concurrency=10, rate=0)
        plain = store.task_submit(TaskSpec(queue="q", handler="h", payload={"n": [1, 2.5]}))
        timed = store.task_submit(
            TaskSpec(
                queue="q",
                handler="h",
                payload=None,
                retry_safe=True,
                attempt_timeout_us=1_500_000,
                deadline=time.time_ns() // 1000 + 3_600_000_000,
            )
        )
        assert plain.task.id and timed.task.id
        session, _ = store.session_open(
            name="w", node_id="n", capabilities=[Capability("h", 10)], max_concurrency=10
        )
        grants = store.attempt_claim_many(session.id, session.epoch, 10)
        assert len(grants) == 2
        starts = [(g.attempt.id, g.attempt.fence) for g in grants]
        leases = store.attempt_start_many(session.id, session.epoch, starts)
        outcomes = [Outcome.success({"ok": True}), Outcome.failure("BOOM", "it broke", False)]
        finishes = [(a, f, o) for (a, f), o in zip(starts, outcomes, strict=True)]
        receipts = store.attempt_finish_many(session.id, session.epoch, finishes)
    finally:
        store.close()
    refused = {"code": "STALE_FENCE", "message": "the fence is stale"}

    def same(model: type[BaseModel], wire: dict[str, Any]) -> None:
        assert model.model_validate(wire).model_dump(mode="json") == wire
        assert json.loads(compact_json(wire)) == wire

    def same_text(model: type[BaseModel], text: str | bytes) -> None:
        assert model.model_validate_json(text).model_dump(mode="json") == json.loads(text)

    for wire in assignments_wire(grants):  # its payload a fragment, which only orjson writes
        same_text(Assignment, orjson.dumps(wire))
    same_text(TasksMessage, tasks_frame(None, grants))
    same_text(TasksMessage, tasks_frame("r1", []))
    lease_dicts = [lease_wire(x) for x in leases if not isinstance(x, Exception)]
    assert len(lease_dicts) == 2
    same(StartedMessage, {"type": "started", "req_id": "r2", "lease": lease_dicts[0]})
    same(RenewedMessage, {"type": "renewed", "req_id": "r3", "leases": lease_dicts})
    started = [{"attempt_id": d["attempt_id"], "lease": d, "error": None} for d in lease_dicts]
    started.append({"attempt_id": "a-refused", "lease": None, "error": refused})
    same(StartedManyMessage, {"type": "started_many", "req_id": "r4", "results": started})
    receipt_dicts = [receipt_wire(r) for r in receipts if not isinstance(r, Exception)]
    assert len(receipt_dicts) == 2
    same(FinishedMessage, {"type": "finished", "req_id": "r5", "receipt": receipt_dicts[0]})
    finished = [{"attempt_id": d["attempt_id"], "receipt": d, "error": None} for d in receipt_dicts]
    finished.append({"attempt_id": "a-refused", "receipt": None, "error": refused})
    same(FinishedManyMessage, {"type": "finished_many", "req_id": "r6", "results": finished})


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


#: what Orbit's own JSON holds: every integer in it passed the strict decoder's 64-bit check
_ORBIT_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(MIN_INT, MAX_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_ORBIT_JSON_VALUES)
def test_parse_json_reads_what_the_standard_library_reads(value: Any) -> None:
    text = canonical_json(value)
    assert parse_json(text) == json.loads(text)


def test_an_integer_past_64_bits_never_reaches_parse_json() -> None:
    """orjson would read it as a float; the strict decoder refuses it on the way in."""
    for text in ("18446744073709551616", "-9223372036854775809", '{"n": 9223372036854775808}'):
        with pytest.raises(DecodeError) as refused:
            decode_json(text)
        assert refused.value.code == "NUMBER_OUT_OF_RANGE"


@given(_JSON_VALUES)
def test_compact_json_writes_what_the_standard_library_writes(value: Any) -> None:
    sorted_text = compact_json(value, sort_keys=True)
    assert json.loads(sorted_text) == value
    if not _has_float(value):  # orjson spells some floats its own way (1e16, not 1e+16)
        assert sorted_text.decode() == json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )


@given(st.lists(_JSON_VALUES, max_size=6))
def test_sorted_json_texts_spells_each_value_as_compact_json(values: list[Any]) -> None:
    """A batch's event data in one loop is each value's ``compact_json(sort_keys=True)``
    text (None for None), a batch holding what orjson refuses (an integer past 64
    bits) included."""
    each = [None if v is None else compact_json(v, sort_keys=True).decode() for v in values]
    assert sorted_json_texts(values) == each
    mixed = [{"digest": "ab"}, None, *values, {"n": 2**70, "a": [1.5]}]
    big = f'{{"a":[1.5],"n":{2**70}}}'
    assert sorted_json_texts(mixed) == ['{"digest":"ab"}', None, *each, big]


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return False


def test_parse_json_falls_back_where_orjson_refuses() -> None:
    assert parse_json('{"n": 1180591620717411303424}') == {"n": 2**70}
    assert parse_json('"\\ud800"') == "\ud800"  # a lone surrogate, as json.loads reads it
    big = compact_json({"b": 1, "a": 2**70}, sort_keys=True)
    assert big == b'{"a":1180591620717411303424,"b":1}'


def _reparsed_frame(req_id: str | None, grants: list[Grant]) -> str:
    """The ``tasks`` frame as it was written before the payload went in as a fragment:
    each payload parsed from its stored text, then the whole frame encoded again."""
    wires = assignments_wire(grants)
    tasks = [
        {**w, "payload": parse_json(g.task.payload)} for g, w in zip(grants, wires, strict=True)
    ]
    return compact_json({"type": "tasks", "req_id": req_id, "tasks": tasks}).decode("utf-8")


def _frames_alike(frame: str, reparsed: str, payload: Any) -> None:
    """``frame`` says what ``reparsed`` said, as the worker reads either (``parse_json``),
    types and all; and a reader of exact JSON finds the very payload submitted in it,
    where the parsed payload had an integer past 64 bits as a float (orjson's reading)."""
    assert _typed(parse_json(frame)) == _typed(parse_json(reparsed))
    for task in json.loads(frame)["tasks"]:
        assert _typed(task.pop("payload")) == _typed(payload)
        assert task == {k: v for k, v in json.loads(reparsed)["tasks"][0].items() if k != "payload"}


def _typed(value: Any) -> Any:
    """A JSON value with the type of every scalar beside it (``==`` takes 1 for 1.0 and
    for True), floats by their ``repr`` (so -0.0 is not 0.0)."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, repr(value) if isinstance(value, float) else value)


@pytest.fixture(scope="module")
def claimed(tmp_path_factory: pytest.TempPathFactory) -> Grant:
    """One real claimed attempt, whose task's payload the tests below replace."""
    store = open_store(f"sqlite:///{tmp_path_factory.mktemp('claim')}/orbit.db")
    try:
        store.queue_create("q", max_concurrency=10, rate=0)
        store.task_submit(TaskSpec(queue="q", handler="h", payload={"n": 1}))
        session, _ = store.session_open(
            name="w", node_id="n", capabilities=[Capability("h", 10)], max_concurrency=10
        )
        (grant,) = store.attempt_claim_many(session.id, session.epoch, 10)
        return grant
    finally:
        store.close()


def _holding(grant: Grant, payload: Any) -> Grant:
    """``grant`` with its task's payload stored as Orbit stores one (``check_payload``)."""
    text, _ = check_payload(payload, 1 << 30)
    return Grant(evolve(grant.task, payload=text), grant.attempt)


_ODD_PAYLOADS: list[Any] = [
    None,
    {},
    [],
    "",
    {"id": "p1", "t": 0.0, "kind": "noop"},
    {"é": "ünïcødé ☃ \U0001f600", "quote": '"\\/', "ctl": "\t\n\x01\x1f\x7f", "ls": "\u2028"},
    {"big": 2**70, "neg": -(2**70), "edge": [2**63 - 1, -(2**63), 2**64 - 1, 2**64]},
    {"f": [1e16, 1e17, 1.5e300, 1e-5, 6.103515625e-05, 0.1, -0.0, 5e-324, 123456789.123456]},
    {"nested": [[{"a": [{"b": [1, 2.5, None, True, "x"]}]}]] * 2},
    {"z": 1, "a": {"y": 2, "b": [3, {"x": 4}]}},
]


@pytest.mark.parametrize("payload", _ODD_PAYLOADS, ids=range(len(_ODD_PAYLOADS)))
def test_a_payload_fragment_frames_what_parsing_it_framed(claimed: Grant, payload: Any) -> None:
    """The ``tasks`` frame with each payload a fragment of its stored text is the same
    JSON, types and all, as the frame that parsed the payload and wrote it again, and
    gives the worker the payload it was submitted with."""
    grant = _holding(claimed, payload)
    frame = tasks_frame(None, [grant])
    _frames_alike(frame, _reparsed_frame(None, [grant]), payload)
    TasksMessage.model_validate_json(frame)


@given(_JSON_VALUES)
def test_any_payload_fragment_frames_what_parsing_it_framed(claimed: Grant, payload: Any) -> None:
    """As above, over any JSON value a payload may be (integers of any size: the
    Python API stores what the wire's decoder would refuse)."""
    grant = _holding(claimed, payload)
    _frames_alike(tasks_frame("r", [grant, grant]), _reparsed_frame("r", [grant, grant]), payload)


def test_a_batch_of_assignments_spells_each_attempts_own_instants(claimed: Grant) -> None:
    """``assignments_wire`` spells a claim's shared expiry once, but a batch whose
    attempts expire at different instants (a claim that read twice, at two clocks) or
    have deadlines and time limits gets each attempt's own, as the model spells them."""
    task, attempt = claimed.task, claimed.attempt
    at = attempt.claim_expires_at
    grants = [
        claimed,
        Grant(task, evolve(attempt, claim_expires_at=at + 1)),
        Grant(task, evolve(attempt, claim_expires_at=at + 1)),
        Grant(evolve(task, deadline=at + 7_000_000, attempt_timeout_us=2_500_000), attempt),
        Grant(task, evolve(attempt, claim_expires_at=at + 1_000_000)),
        claimed,
    ]
    for grant, wire in zip(grants, assignments_wire(grants), strict=True):
        deadline = grant.task.deadline
        assert wire["claim_expires_at"] == instant_to_wire(grant.attempt.claim_expires_at)
        assert wire["deadline"] == instant_to_wire(deadline)
        left = None if deadline is None else (deadline - grant.attempt.claimed_at) / 1e6
        assert wire["deadline_left"] == left
        assert wire["fence"] == str(grant.attempt.fence)
        Assignment.model_validate_json(orjson.dumps(wire))


def test_a_started_many_answer_spells_each_lease_as_lease_wire(tmp_path: Path) -> None:
    """``started_many_wire`` spells a batch's shared expiry once, but each lease is
    still ``lease_wire``'s spelling, leases expiring at other instants, lost ones
    without an expiry and refusals between them included; the answer is its model's."""
    at = 1_764_944_000_123_456
    answers: list[Lease | OrbitError] = [
        Lease("a0", "ok", at, 30_000_000),
        Lease("a1", "ok", at, 30_000_000),
        Rejected(Code.STALE_FENCE, "the fence is stale"),
        Lease("a3", "ok", at + 1, 29_999_999),
        Lease("a4", "lost", None),
        Lease("a5", "ok", at + 1, 29_999_999),
        OrbitError(Code.ATTEMPT_NOT_FOUND, "no attempt"),
        Lease("a7", "cancel", at, 30_000_000),
    ]
    starts = [(f"a{i}", 1) for i in range(len(answers))]
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        wire = started_many_wire("r", starts, answers, Metrics(store))
    finally:
        store.close()
    for result, answer in zip(wire["results"], answers, strict=True):
        if isinstance(answer, OrbitError):
            assert result["lease"] is None and result["error"]["code"] == str(answer.code)
        else:
            assert result == {
                "attempt_id": answer.attempt_id,
                "lease": lease_wire(answer),
                "error": None,
            }
    assert StartedManyMessage.model_validate(wire).model_dump(mode="json") == wire


def test_a_batch_is_fenced_only_by_a_fenced_epoch_refusal() -> None:
    """``any_fenced`` (which closes a superseded connection) finds a FENCED_EPOCH among
    leases, receipts and other refusals, and nothing in a batch without one."""
    lease = Lease("a0", "ok", 1, 1)
    fenced = Rejected(Code.FENCED_EPOCH, "fenced")
    stale = Rejected(Code.STALE_FENCE, "stale")
    missing = OrbitError(Code.ATTEMPT_NOT_FOUND, "no attempt")
    assert not any_fenced([])
    assert not any_fenced([lease, lease])
    assert not any_fenced([lease, stale, missing])
    assert any_fenced([lease, stale, fenced, lease])
    assert any_fenced([fenced])
    assert any_fenced([OrbitError(Code.FENCED_EPOCH, "fenced")])


def test_a_finished_many_answer_counts_each_task_state(tmp_path: Path) -> None:
    """``finished_many_wire`` answers each item with its receipt or its refusal, and
    counts the accepted finishes by task state (one series per state), the refused by
    code."""

    def receipt(i: int, state: TaskState, ended: AttemptState) -> Receipt:
        return Receipt(f"t{i}", f"a{i}", i + 1, state, ended, "d" * 64, 1)

    receipts: list[Receipt | OrbitError] = [
        receipt(0, TaskState.SUCCEEDED, AttemptState.SUCCEEDED),
        Rejected(Code.STALE_FENCE, "the fence is stale"),
        receipt(2, TaskState.FAILED, AttemptState.FAILED),
        receipt(3, TaskState.SUCCEEDED, AttemptState.SUCCEEDED),
        receipt(4, TaskState.SCHEDULED, AttemptState.FAILED),
        receipt(5, TaskState.SUCCEEDED, AttemptState.SUCCEEDED),
        # a report for an attempt the store does not know: no event, but refused all
        # the same (it was left out of the count)
        OrbitError(Code.ATTEMPT_NOT_FOUND, "no attempt"),
    ]
    finishes = [(f"a{i}", i + 1, Outcome.success(None)) for i in range(len(receipts))]
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        metrics = Metrics(store)
        wire = finished_many_wire("r", finishes, receipts, metrics)

        def count(state: str) -> float | None:
            labels = {"task_state": state}
            return metrics.registry.get_sample_value("orbit_finishes_total", labels)

        assert (count("succeeded"), count("failed"), count("scheduled")) == (3.0, 1.0, 1.0)
        assert count("cancelled") is None
        for code in ("STALE_FENCE", "ATTEMPT_NOT_FOUND"):
            refused = {"code": code}
            assert metrics.registry.get_sample_value("orbit_rejected_reports_total", refused) == 1.0
    finally:  # the metrics read the store's queues when collected
        store.close()
    for result, answer in zip(wire["results"], receipts, strict=True):
        if isinstance(answer, OrbitError):
            assert result["receipt"] is None and result["error"]["code"] == str(answer.code)
        else:
            assert result == {
                "attempt_id": answer.attempt_id,
                "receipt": receipt_wire(answer),
                "error": None,
            }
    assert FinishedManyMessage.model_validate(wire).model_dump(mode="json") == json.loads(
        compact_json(wire)
    )
