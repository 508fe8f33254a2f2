"""The submission readers (``orbit.protocol.submissions``) take only what the strict path
accepts, and give the store exactly the specs the strict path gives it: for any body,
either the reader declines (None) or the strict path decodes the same specs."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.core.batches import UnusualTask
from orbit.core.errors import OrbitError
from orbit.core.model import Backoff, TaskSpec
from orbit.core.validate import check_payload, check_spec
from orbit.protocol.decode import MAX_DEPTH, DecodeError, decode_json, decode_model
from orbit.protocol.messages import TaskBatch, TaskSubmit
from orbit.protocol.submissions import UsualBatch, read_task
from orbit.server.routes import spec_from

#: mostly values the model accepts, and now and then one it refuses
_names = st.sampled_from(["q", "bench", "a.b:c-d_e", "x" * 128] * 8 + ["", "x" * 129, "-q", "q\n"])
_texts = st.sampled_from(["k", "x" * 64, "é"] * 8 + ["", "x" * 65, "x" * 256, "a\x00b"])
_ints = st.sampled_from([0, 1, 3, -5, 1000, 1_000_000] * 6 + [-1_000_001, 1_000_001, 1001, True])


def read_task_batch(raw: Any) -> list[TaskSpec] | None:
    """The reader's whole answer for a batch, as the route gets it over a batch's
    chunks: its specs, or None where the route takes the strict path (the first pass
    declines the batch, or a task's other fields raise ``UnusualTask``)."""
    batch = UsualBatch.of(raw)
    if batch is None:
        return None
    try:
        return batch.read(0, len(batch))
    except UnusualTask:
        return None


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"k": value}
    return value


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
) | st.sampled_from([_deep(MAX_DEPTH - 4), _deep(MAX_DEPTH - 3), _deep(MAX_DEPTH), "a\x00"])

_FIELDS = {
    "payload": _json,
    "tenant": _names,
    "priority": _ints,
    "idempotency_key": st.none() | _texts,
    "parent_id": st.none() | _texts,
    "retry_safe": st.sampled_from([True, False, True, 0, None]),
    "max_attempts": _ints,
}
_OTHERS = {
    "backoff": st.just({"base": 0.5}),
    "attempt_timeout": st.sampled_from([1.5, 0, None]),
    "deadline": st.sampled_from(["2030-01-01T00:00:00Z", None]),
    "run_after": st.sampled_from(["2030-01-01T00:00:00Z", None]),
    "id": st.just("t1"),
    "Queue": st.just("q"),
    "other": st.just(1),
}


@st.composite
def _task(draw: st.DrawFn) -> Any:
    task: dict[str, Any] = {}
    for name in ("queue", "handler"):
        if draw(st.integers(0, 19)):
            task[name] = draw(_names)
    for name, values in _FIELDS.items():
        if draw(st.booleans()):
            task[name] = draw(values)
    if not draw(st.integers(0, 9)):
        name = draw(st.sampled_from(sorted(_OTHERS)))
        task[name] = draw(_OTHERS[name])
    return task if draw(st.integers(0, 29)) else draw(st.sampled_from([[], "task", None]))


@st.composite
def _batch(draw: st.DrawFn) -> Any:
    tasks = [draw(_task()) for _ in range(draw(st.sampled_from([1, 1, 2, 3, 0])))]
    body: dict[str, Any] = {"tasks": tasks}
    if not draw(st.integers(0, 19)):
        body["extra"] = 1
    return body


def _spelled(specs: list[TaskSpec]) -> bytes:
    """Specs spelt out, types and all (``==`` would take ``True`` for ``1``)."""
    return orjson.dumps(specs)


def _strict(raw: Any, model: type[TaskBatch] | type[TaskSubmit]) -> tuple[str, Any]:
    try:
        msg = decode_model(model, raw, parsed=True)
    except DecodeError as exc:
        return "refused", exc.code
    if isinstance(msg, TaskBatch):
        return "specs", [spec_from(t) for t in msg.tasks]
    assert isinstance(msg, TaskSubmit)
    return "specs", [spec_from(msg)]


def _agrees(document: Any, model: type[TaskBatch] | type[TaskSubmit]) -> None:
    """The reader for ``model`` declines ``document``, or reads the specs the strict path
    decodes from it."""
    raw = decode_json(orjson.dumps(document))
    if model is TaskBatch:
        read = read_task_batch(raw)
    else:
        one = read_task(raw)
        read = None if one is None else [one]
    if read is None:
        return  # the strict path decides: its refusal, or its specs, are the answer
    strict = _strict(raw, model)
    assert strict[0] == "specs", f"the reader took what the strict path refuses: {strict}"
    assert _spelled(read) == _spelled(strict[1])


@settings(max_examples=1500, deadline=None)
@given(_batch())
def test_the_batch_reader_reads_what_the_strict_path_decodes_and_declines_the_rest(
    body: Any,
) -> None:
    _agrees(body, TaskBatch)


@settings(max_examples=1000, deadline=None)
@given(_task())
def test_the_task_reader_reads_what_the_strict_path_decodes_and_declines_the_rest(
    task: Any,
) -> None:
    _agrees(task, TaskSubmit)


def test_the_usual_submissions_are_read_without_the_strict_path() -> None:
    task = {
        "queue": "q",
        "handler": "h",
        "payload": {"n": [1, 2.5, None, "x"]},
        "tenant": "acme",
        "priority": -3,
        "idempotency_key": "k1",
        "parent_id": "p1",
        "retry_safe": True,
        "max_attempts": 5,
    }
    batch = read_task_batch({"tasks": [task, {"queue": "q", "handler": "h"}]})
    assert batch is not None and len(batch) == 2
    assert _spelled(batch) == _spelled(
        _strict({"tasks": [task, {"queue": "q", "handler": "h"}]}, TaskBatch)[1]
    )
    assert batch[1] == TaskSpec(queue="q", handler="h", backoff=Backoff())
    single = read_task(task)
    assert single is not None and single == batch[0]


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"queue": "q\n"}, "INVALID_VALUE"),
        ({"Queue": "q"}, "FIELD_CASE_MISMATCH"),
        ({"state": "queued"}, "RESPONSE_ONLY_FIELD"),
        ({"priority": True}, "INVALID_TYPE"),
        ({"idempotency_key": ""}, "INVALID_VALUE"),
        ({"payload": {"a": "b\x00"}}, "NUL_CHARACTER"),
        ({"payload": _deep(MAX_DEPTH)}, "TOO_DEEP"),
        ({"max_attempts": 0}, "NUMBER_OUT_OF_RANGE"),
    ],
)
def test_a_submission_out_of_its_usual_shape_is_left_to_the_strict_path(
    change: dict[str, Any], code: str
) -> None:
    task = {"queue": "q", "handler": "h", **change}
    raw = decode_json(orjson.dumps({"tasks": [task]}))
    assert read_task_batch(raw) is None
    assert _strict(raw, TaskBatch) == ("refused", code)
    single = decode_json(orjson.dumps(task))
    assert read_task(single) is None
    assert _strict(single, TaskSubmit) == ("refused", code)


@pytest.mark.parametrize("field", ["queue", "tenant", "idempotency_key", "parent_id"])
@pytest.mark.parametrize("value", [["q"], {"q": 1}, 1, True, None])
def test_a_batch_whose_first_pass_fields_are_no_text_is_left_to_the_strict_path(
    field: str, value: Any
) -> None:
    """The first pass collects the queues, tenants, keys and parents of a batch in sets
    before it checks each distinct one: a list or a dict there (which no set can hold), a
    number or a boolean is declined, not raised, and the strict path names it. A null
    key or parent is no key or parent."""
    task = {"queue": "q", "handler": "h", field: value}
    raw = decode_json(orjson.dumps({"tasks": [{"queue": "q", "handler": "h"}] * 300 + [task]}))
    if value is None and field in ("idempotency_key", "parent_id"):
        assert read_task_batch(raw) is not None
        return
    assert UsualBatch.of(raw) is None
    assert _strict(raw, TaskBatch)[0] == "refused"


def test_a_batch_task_without_a_handler_is_declined_when_its_chunk_is_read() -> None:
    """The first pass looks at each task's field names, but not for the handler, which
    a task's chunk is read with: a task without one is declined there (``UnusualTask``,
    inside the transaction), and the strict path names it."""
    usual = [{"queue": "q", "handler": "h"}] * 600
    raw = decode_json(orjson.dumps({"tasks": [*usual[:550], {"queue": "q"}, *usual[551:]]}))
    batch = UsualBatch.of(raw)
    assert batch is not None
    assert len(batch.read(0, 550)) == 550
    with pytest.raises(UnusualTask) as raised:
        batch.read(500, 600)
    assert raised.value.index == 550
    assert _strict(raw, TaskBatch) == ("refused", "MISSING_FIELD")
    other = {"tasks": [*usual[:550], {"queue": "q", "handler": "h", "backoff": {}}]}
    assert UsualBatch.of(decode_json(orjson.dumps(other))) is None  # not the usual fields


@pytest.mark.parametrize(
    ("fits", "beyond"),
    [
        ({"queue": "q" * 128}, {"queue": "q" * 129}),
        ({"tenant": "t" * 128}, {"tenant": "t" * 129}),
        ({"priority": 1_000_000}, {"priority": 1_000_001}),
        ({"priority": -1_000_000}, {"priority": -1_000_001}),
        ({"max_attempts": 1000}, {"max_attempts": 1001}),
        ({"max_attempts": 1}, {"max_attempts": 0}),
        ({"idempotency_key": "☃" * 255}, {"idempotency_key": "☃" * 256}),
        ({"parent_id": "p" * 64}, {"parent_id": "p" * 65}),
        # a payload nests as deep as the body's own limit allows, counted from the body
        ({"payload": _deep(MAX_DEPTH - 1)}, {"payload": _deep(MAX_DEPTH)}),
    ],
)
def test_the_readers_stop_where_the_model_does(
    fits: dict[str, Any], beyond: dict[str, Any]
) -> None:
    """Every limit the readers copy from the model, at the limit and one past it, alone
    (the payload one level less deep in a batch, where it sits two levels lower)."""
    for change, accepted in ((fits, True), (beyond, False)):
        task = {"queue": "q", "handler": "h", **change}
        assert (read_task(decode_json(orjson.dumps(task))) is not None) is accepted, change
        assert (_strict(task, TaskSubmit)[0] == "specs") is accepted, change
        _agrees(task, TaskSubmit)
        if "payload" in change:
            change = {"payload": change["payload"]["k"]["k"]}  # two levels deeper in a batch
        body = {"tasks": [{"queue": "q", "handler": "h", **change}]}
        assert (read_task_batch(decode_json(orjson.dumps(body))) is not None) is accepted, change
        assert (_strict(body, TaskBatch)[0] == "specs") is accepted, change
        _agrees(body, TaskBatch)
    assert len(read_task_batch({"tasks": [{"queue": "q", "handler": "h"}] * 1000}) or []) == 1000
    assert read_task_batch({"tasks": [{"queue": "q", "handler": "h"}] * 1001}) is None


@settings(max_examples=1500, deadline=None)
@given(_batch())
def test_every_field_the_batch_reader_takes_passes_check_spec(body: Any) -> None:
    """The store checks only the payloads of the reader's specs (``fields_checked``), so
    the reader must take no field that ``check_spec`` refuses: when it reads a batch,
    every spec passes ``check_spec``, with the payload check alone giving the same
    answer."""
    read = read_task_batch(decode_json(orjson.dumps(body)))
    if read is None:
        return
    for spec in read:
        try:
            whole: Any = check_spec(spec, 1 << 20)
        except OrbitError as exc:  # only the payload may refuse, as check_payload does
            with pytest.raises(OrbitError) as alone:
                check_payload(spec.payload, 1 << 20)
            assert (alone.value.code, alone.value.message) == (exc.code, exc.message)
        else:
            assert check_payload(spec.payload, 1 << 20) == whole
