"""The readers of batched reports (``orbit.protocol.reports``) take only what the strict
path accepts, and give the store exactly what the strict path gives it: for any message,
either the reader declines (None) or the strict path decodes the same batch."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.core.errors import OrbitError
from orbit.core.model import Outcome
from orbit.protocol.decode import MAX_DEPTH, DecodeError, decode_json, decode_model
from orbit.protocol.messages import COUNTER_RE, WORKER_REQUESTS
from orbit.protocol.reports import (
    _NO_RESULT,
    READERS,
    FinishBatch,
    StartBatch,
    _fence,
    finish_batch,
    read_finish_many,
    read_start_many,
    start_batch,
)
from orbit.protocol.reports import (
    _outcome as read_outcome,
)

#: mostly values the models accept, and now and then one they refuse
_texts = st.sampled_from(["a", "x" * 64, "é", "019ad2f0-attempt"] * 4 + ["", "x" * 65, "a\x00b"])
_counters = st.sampled_from(
    ["0", "1", "42", "9223372036854775807"] * 4
    + ["01", "-1", "+1", " 1", "1\n", "1.0", "9223372036854775808", "99999999999999999999", ""]
)
_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _texts
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3),
    max_leaves=8,
)


def _deep(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def _maybe(draw: st.DrawFn, value: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``value``, or a variant of it: a field dropped, changed or added."""
    choice = draw(st.integers(0, 19))
    if choice == 0 and value:
        value = {k: v for k, v in value.items() if k != draw(st.sampled_from(sorted(value)))}
    elif choice == 1 and value:
        key = draw(st.sampled_from(sorted(value)))
        value = {**value, key: draw(_json)}
    elif choice == 2:
        key = draw(st.sampled_from([*extra, "Fence", "receipt", "status", "other"]))
        value = {**value, key: extra.get(key, draw(_json))}
    return value


@st.composite
def _error(draw: st.DrawFn) -> Any:
    spec: dict[str, Any] = {"code": draw(st.sampled_from(["E", "x" * 100, "x" * 101, ""]))}
    if draw(st.booleans()):
        spec["message"] = draw(st.sampled_from(["", "m", "m" * 10_000, "m" * 10_001, "\x00"]))
    if draw(st.booleans()):
        spec["retryable"] = draw(st.sampled_from([True, False, True, False, 0, None]))
    return _maybe(draw, spec, {})


@st.composite
def _outcome(draw: st.DrawFn) -> Any:
    ok = draw(st.sampled_from([True, False] * 4 + [0, 1, None, "true"]))
    spec: dict[str, Any] = {"ok": ok}
    if draw(st.booleans()):
        spec["result"] = draw(_json | st.sampled_from([_deep(MAX_DEPTH - 4), _deep(MAX_DEPTH)]))
    if draw(st.booleans()) or ok is False:
        spec["error"] = draw(st.none() | _error())
    return _maybe(draw, spec, {"error": None})


@st.composite
def _item(draw: st.DrawFn, finish: bool) -> Any:
    item: dict[str, Any] = {"attempt_id": draw(_texts), "fence": draw(_counters)}
    if finish:
        item["outcome"] = draw(_outcome())
    return _maybe(draw, item, {})


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["start_many", "finish_many"]))
    n = draw(st.sampled_from([1, 1, 2, 3, 0]))
    items = [draw(_item(kind == "finish_many")) for _ in range(n)]
    msg: dict[str, Any] = {"type": kind, "req_id": draw(_texts), "items": items}
    return _maybe(draw, msg, {"type": kind})


def _strict(raw: dict[str, Any]) -> tuple[str, Any]:
    """What the strict path makes of a message: the batch, or the refusal's code."""
    model = WORKER_REQUESTS[raw["type"]]
    try:
        msg = decode_model(model, raw, parsed=True)
        return "batch", start_batch(msg) if raw["type"] == "start_many" else finish_batch(msg)  # type: ignore[arg-type]
    except DecodeError as exc:
        return "refused", exc.code
    except OrbitError as exc:
        return "refused", str(exc.code)


def _spelled(batch: StartBatch | FinishBatch) -> bytes:
    """A batch spelt out, types and all (``==`` would take ``True`` for ``1``)."""
    if isinstance(batch, StartBatch):
        return orjson.dumps([batch.req_id, batch.items])
    return orjson.dumps(
        [batch.req_id, [(a, f, o.__dict__) for a, f, o in batch.items], type(batch).__name__]
    )


@settings(max_examples=1500, deadline=None)
@given(_message())
def test_a_reader_reads_what_the_strict_path_decodes_and_declines_the_rest(
    message: dict[str, Any],
) -> None:
    raw = decode_json(orjson.dumps(message))
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in READERS:
        return
    read = READERS[kind](raw)
    strict = _strict(raw)
    if read is None:
        return  # the strict path decides: its refusal, or its batch, is the answer
    assert strict[0] == "batch", f"the reader took what the strict path refuses: {strict}"
    assert _spelled(read) == _spelled(strict[1])


def test_the_usual_batches_are_read_without_the_strict_path() -> None:
    starts = {
        "type": "start_many",
        "req_id": "r1",
        "items": [{"attempt_id": "a1", "fence": "1"}, {"attempt_id": "a2", "fence": "7"}],
    }
    assert read_start_many(starts) == StartBatch("r1", [("a1", 1), ("a2", 7)])
    finishes = {
        "type": "finish_many",
        "req_id": "r2",
        "items": [
            {"attempt_id": "a1", "fence": "1", "outcome": {"ok": True, "result": {"n": [1]}}},
            {"attempt_id": "a2", "fence": "2", "outcome": {"ok": True}},
            {
                "attempt_id": "a3",
                "fence": "3",
                "outcome": {"ok": False, "error": {"code": "E", "retryable": False}},
            },
        ],
    }
    read = read_finish_many(finishes)
    assert read is not None
    assert _spelled(read) == _spelled(_strict(finishes)[1])
    assert [o.ok for _, _, o in read.items] == [True, True, False]


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (lambda m: m["items"][0].update(fence="01"), "INVALID_VALUE"),
        (lambda m: m["items"][0].update(Fence="1"), "FIELD_CASE_MISMATCH"),
        (lambda m: m["items"][0].update(status="ok"), "UNKNOWN_FIELD"),
        (lambda m: m["items"][0].update(attempt_id="a\x00"), "NUL_CHARACTER"),
        (lambda m: m["items"][0]["outcome"].update(error={"code": "E"}), "INVALID_ARGUMENT"),
        (
            lambda m: m["items"][0]["outcome"].update(ok=False, result=1, error={"code": "E"}),
            "INVALID_ARGUMENT",
        ),
        (lambda m: m["items"][0]["outcome"].update(result=_deep(MAX_DEPTH)), "TOO_DEEP"),
        (lambda m: m.update(items=[]), "INVALID_VALUE"),
    ],
)
def test_a_batch_out_of_its_usual_shape_is_left_to_the_strict_path(change: Any, code: str) -> None:
    message = {
        "type": "finish_many",
        "req_id": "r",
        "items": [{"attempt_id": "a", "fence": "1", "outcome": {"ok": True}}],
    }
    change(message)
    raw = decode_json(orjson.dumps(message))
    assert read_finish_many(raw) is None
    assert _strict(raw) == ("refused", code)


def _finish_with(item: dict[str, Any], **message: Any) -> dict[str, Any]:
    base = {"attempt_id": "a", "fence": "1", "outcome": {"ok": True}}
    return {"type": "finish_many", "req_id": "r", "items": [{**base, **item}], **message}


@pytest.mark.parametrize(
    ("fits", "beyond"),
    [
        (_finish_with({}, req_id="x" * 64), _finish_with({}, req_id="x" * 65)),
        (_finish_with({"attempt_id": "☃" * 64}), _finish_with({"attempt_id": "☃" * 65})),
        (_finish_with({"fence": str(2**63 - 1)}), _finish_with({"fence": str(2**63)})),
        (
            _finish_with({"outcome": {"ok": False, "error": {"code": "c" * 100}}}),
            _finish_with({"outcome": {"ok": False, "error": {"code": "c" * 101}}}),
        ),
        (
            _finish_with(
                {"outcome": {"ok": False, "error": {"code": "E", "message": "m" * 10_000}}}
            ),
            _finish_with(
                {"outcome": {"ok": False, "error": {"code": "E", "message": "m" * 10_001}}}
            ),
        ),
        # a result nests as deep as the message's own limit allows, counted from the message
        (
            _finish_with({"outcome": {"ok": True, "result": _deep(MAX_DEPTH - 4)}}),
            _finish_with({"outcome": {"ok": True, "result": _deep(MAX_DEPTH - 3)}}),
        ),
        (
            {
                "type": "start_many",
                "req_id": "r",
                "items": [{"attempt_id": "a", "fence": "1"}] * 1000,
            },
            {
                "type": "start_many",
                "req_id": "r",
                "items": [{"attempt_id": "a", "fence": "1"}] * 1001,
            },
        ),
    ],
)
def test_the_readers_stop_where_the_models_do(fits: dict[str, Any], beyond: dict[str, Any]) -> None:
    """Every limit the readers copy from the models, at the limit and one past it."""
    for message, accepted in ((fits, True), (beyond, False)):
        raw = decode_json(orjson.dumps(message))
        read = READERS[raw["type"]](raw)
        assert (read is not None) is accepted, message
        assert (_strict(raw)[0] == "batch") is accepted, _strict(raw)
        if read is not None:
            assert _spelled(read) == _spelled(_strict(raw)[1])


_FENCE_EDGES = [
    *("0", "7", "10", "9223372036854775807", "9223372036854775808", "9999999999999999999"),
    *("", "00", "01", "-0", "-1", "+1", " 1", "1 ", "1\n", "1_0", "1.0", "1e3", "0x1"),
    *("\u0661", "\u00b2", "\uff11", "12345678901234567890", "\x00", "1\x00"),
]


def _fence_by_model(value: Any) -> int | None:
    """A fence as the model reads one: ``COUNTER_RE``, then the bound below 2**63."""
    if not isinstance(value, str) or not COUNTER_RE.match(value) or int(value) >= 2**63:
        return None
    return int(value)


@given(st.sampled_from(_FENCE_EDGES) | st.text(max_size=21) | st.integers().map(str))
def test_the_fence_reader_takes_what_the_model_takes(value: str) -> None:
    """``_fence`` reads a counter with ``int`` and a comparison, not the model's regular
    expression: the same strings, to the same integers."""
    assert _fence(value) == _fence_by_model(value)


def test_the_fence_reader_takes_strings_only() -> None:
    for value in (1, 1.0, True, None, ["1"], {"1": 1}):
        assert _fence(value) is None


def test_the_usual_outcome_is_read_at_once_and_nothing_like_it() -> None:
    """``{"ok": true, "result": null}`` is the one outcome read without the walk; a
    near miss goes the full way (and is refused there, or read as what it is)."""
    assert read_outcome({"ok": True, "result": None}) is _NO_RESULT
    assert read_outcome({"ok": True}) is _NO_RESULT
    assert read_outcome({"ok": True, "result": None, "error": None}) is _NO_RESULT
    for near in ({"ok": 1, "result": None}, {"ok": True, "result": None, "x": 1}, {"ok": None}):
        assert read_outcome(near) is None
    assert read_outcome({"ok": True, "result": 0}) == Outcome.success(0)
    assert read_outcome({"ok": False, "result": None, "error": {"code": "E"}}) == Outcome.failure(
        "E", "", True
    )
