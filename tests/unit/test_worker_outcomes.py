"""The runner's check of what a finish carries (``orbit.worker.outcomes``) agrees with the
server's decoder: a result the runner passes is taken by the server, alone or in a batch,
and a result the runner refuses would have been refused there (where some refusals carry
no ``req_id`` and wedged the worker). Errors, once cleaned, are always taken."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.core.errors import OrbitError
from orbit.protocol.decode import DecodeError, decode_json, decode_model
from orbit.protocol.messages import Finish, FinishMany
from orbit.protocol.reports import finish_batch, read_finish_many
from orbit.server.gateway import MAX_MESSAGE_BYTES
from orbit.worker import outcomes
from orbit.worker.connection import outcome


def _frame(message: dict[str, Any]) -> str:
    """A request as ``WorkerConnection.request`` writes it."""
    return json.dumps({**message, "req_id": "r1"}, separators=(",", ":"))


def _server_takes(message: dict[str, Any]) -> bool:
    """Whether the gateway reads ``message`` and hands its outcomes to the store."""
    try:
        text = _frame(message)
    except (TypeError, ValueError):
        return False
    if len(text) > MAX_MESSAGE_BYTES:
        return False
    try:
        raw = decode_json(text)
        if message["type"] == "finish":
            decode_model(Finish, raw, parsed=True)
        elif read_finish_many(raw) is None:
            finish_batch(decode_model(FinishMany, raw, parsed=True))
    except (DecodeError, OrbitError):
        return False
    return True


def _single(report: dict[str, Any]) -> dict[str, Any]:
    return {"type": "finish", "attempt_id": "a" * 36, "fence": "7", "outcome": report}


def _batch(*reports: dict[str, Any]) -> dict[str, Any]:
    items = [
        {"attempt_id": f"{i:036d}", "fence": "9223372036854775807", "outcome": r}
        for i, r in enumerate(reports)
    ]
    return {"type": "finish_many", "items": items}


def _runner_takes(value: Any) -> bool:
    try:
        outcomes.check_result(value)
    except outcomes.Unsendable:
        return False
    return True


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


REFUSED = {
    "nan": float("nan"),
    "infinity": [float("inf")],
    "int past 64 bits": {"n": 2**63},
    "negative int past 64 bits": -(2**63) - 1,
    "lone surrogate": "\udcff.txt",
    "lone surrogate in a key": {"\ud800": 1},
    "nul": "a\x00b",
    "nul in a key": {"a\x00": 1},
    "a key twice once written": {1: "a", "1": "b"},
    "a set": {1, 2},
    "a datetime": datetime(2026, 1, 1, tzinfo=UTC),
    "a decimal": Decimal("1.5"),
    "bytes": b"png",
    "a tuple key": {(1, 2): 3},
    # json.dumps writes them as text: stored changed ({"1": "a"}), without a word
    "an int key": {2: "a"},
    "a bool key": {False: "b"},
    "a None key": {None: "c"},
    "a float key": {1.5: "d"},
    "a NaN key": {float("nan"): "e"},
    "too deep": _nested(61),
    "too large": "x" * outcomes.MAX_FRAME_CHARS,
}
TAKEN = {
    "none": None,
    "false": False,
    "int at 64 bits": [2**63 - 1, -(2**63)],
    "float": 1e-7,
    "unicode": {"é": "日本語 🙂"},
    "escapes": "\\u0000 \\ud800 \t\n",
    "a tuple": (1, "two"),
    "as deep as may be": _nested(60),
    "as large as may be": "x" * (outcomes.MAX_OUTCOME_CHARS - 2),
}


def _has_a_key_not_text(value: Any) -> bool:
    """Whether a dict anywhere in ``value`` has a key that is not a string: one the
    runner refuses, which the server never sees as such (json.dumps writes it as text)."""
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _has_a_key_not_text(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_a_key_not_text(v) for v in value)
    return False


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_result_the_runner_refuses_the_server_would_refuse(name: str) -> None:
    value = REFUSED[name]
    assert not _runner_takes(value)
    if not _has_a_key_not_text(value):
        assert not _server_takes(_batch(outcome(result=value)))


@pytest.mark.parametrize("key", [1, True, None, 1.5])
def test_a_result_with_a_key_that_is_not_text_is_refused_not_changed(key: Any) -> None:
    """``{1: "a"}`` went out as ``{"1": "a"}`` (json.dumps writes the key as text): the
    task's result was not what the handler returned. RESULT_NOT_JSON now, naming the key,
    as the clients refuse such a payload (TypeError)."""
    with pytest.raises(outcomes.Unsendable) as refused:
        outcomes.check_result({"ok": {key: "a"}})
    assert refused.value.code == "RESULT_NOT_JSON"
    assert f"result.ok has the key {key!r}" in refused.value.message


@pytest.mark.parametrize("name", list(TAKEN))
def test_a_result_the_runner_passes_the_server_takes_alone_and_in_a_batch(name: str) -> None:
    value = TAKEN[name]
    assert _runner_takes(value)
    assert _server_takes(_single(outcome(result=value)))
    assert _server_takes(_batch(outcome(result=value)))


def test_the_frame_limit_is_the_servers() -> None:
    assert outcomes.MAX_FRAME_CHARS == MAX_MESSAGE_BYTES
    # the runner refuses a result a little before the frame is full: room for the rest
    assert not _runner_takes("x" * (outcomes.MAX_OUTCOME_CHARS - 1))
    assert _server_takes(_single(outcome(result="x" * (outcomes.MAX_OUTCOME_CHARS - 1))))


def test_a_full_batch_at_the_runners_bound_fits_in_a_frame() -> None:
    """200 finishes whose outcomes add up to the runner's batch bound, with the longest
    ids and fences, still make one frame the server reads."""
    from orbit.worker.runner import Worker

    bound = Worker("http://x")._finishes._max_bytes
    pad = outcomes.wire_size(outcomes.error("E" * 100, "", retryable=False)["error"])
    each = (bound // 200) - pad
    reports = [outcomes.error("E" * 100, "m" * each, retryable=False) for _ in range(200)]
    assert sum(outcomes.wire_size(r["error"]) for r in reports) <= bound
    items = [
        {"attempt_id": f"{i:064d}", "fence": "9223372036854775807", "outcome": outcome(**r)}
        for i, r in enumerate(reports)
    ]
    assert len(_frame({"type": "finish_many", "items": items})) <= MAX_MESSAGE_BYTES


_chars = st.characters(codec=None, exclude_categories=[])  # surrogates and NUL included
_texts = st.text(_chars, max_size=4) | st.sampled_from(["a", "1", "true", "null", "é"])
_keys = _texts | st.integers(-3, 3) | st.booleans() | st.none() | st.floats(width=16)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats()
    | _texts
    | st.sampled_from([b"b", {1}, Decimal(1)])
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.tuples(inner) | st.dictionaries(_keys, inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_the_runner_and_the_server_agree_on_any_result(value: Any) -> None:
    server_takes = _server_takes(_batch(outcome(result=value)))
    assert _runner_takes(value) == (server_takes and not _has_a_key_not_text(value))
    if _runner_takes(value):
        assert _server_takes(_single(outcome(result=value)))


@settings(max_examples=300, deadline=None)
@given(st.text(_chars, max_size=120), st.text(_chars, max_size=12_000), st.booleans())
def test_an_error_once_cleaned_is_always_taken(code: str, message: str, retryable: bool) -> None:
    report = outcomes.error(code, message, retryable=retryable)
    assert _server_takes(_single(outcome(**report)))
    assert _server_takes(_batch(outcome(**report), outcome(result=1)))
    assert report["error"]["retryable"] is retryable


#: text with what escapes differently or not at all: controls, DEL, quotes, backslashes,
#: non-ASCII and lone surrogates (which check_result refuses)
_odd_text = st.text(
    st.sampled_from(
        ["a", "\x01", "\x1f", "\n", "\t", "\x7f", '"', "\\", "/", "é", "\ud800", "\x00"]
    )
    | st.characters(codec=None, exclude_categories=[]),
    max_size=8,
)
_plain_leaves = st.none() | st.booleans() | st.integers() | _odd_text
_flat_values = (
    _plain_leaves
    | st.lists(_plain_leaves, max_size=4)
    | st.dictionaries(_odd_text, _plain_leaves, max_size=4)
    | st.floats()
    | st.lists(st.floats() | _plain_leaves, max_size=3)
    | st.dictionaries(st.integers(0, 3) | _odd_text, _plain_leaves, max_size=3)
    | st.lists(st.lists(_plain_leaves, max_size=2), max_size=2)
)


@settings(max_examples=1000, deadline=None)
@given(_flat_values)
def test_the_size_of_a_result_is_its_json_dumps_length_exactly(value: Any) -> None:
    """A plain result is measured by orjson (``_plain_size``), any other by json.dumps:
    either way the size is the length of json.dumps's text, character for character."""
    try:
        size, _ = outcomes.check_result(value)
    except outcomes.Unsendable:
        return
    assert size == len(json.dumps(value, separators=(",", ":")))


@pytest.mark.parametrize(
    "value",
    [
        "x" * outcomes.MAX_OUTCOME_CHARS,
        ["x" * (outcomes.MAX_OUTCOME_CHARS // 2)] * 2,
        {"k": "\x7f" * (outcomes.MAX_OUTCOME_CHARS // 6 + 1)},  # DEL: escaped, six times longer
    ],
)
def test_a_plain_result_past_the_limit_is_refused_as_any_is(value: Any) -> None:
    assert outcomes.is_plain(value)
    with pytest.raises(outcomes.Unsendable) as refused:
        outcomes.check_result(value)
    assert refused.value.code == "RESULT_TOO_LARGE"


@settings(max_examples=1000, deadline=None)
@given(_flat_values)
def test_a_result_the_one_pass_finds_fine_is_one_the_full_check_passes(value: Any) -> None:
    """``_plain_and_fine`` only ever spares ``_check`` a value ``_check`` would pass (what
    it declines, ``_check`` reads and names, as before)."""
    if outcomes._plain_and_fine(value):
        assert outcomes.is_plain(value)
        outcomes._check(value, 4, "result")  # raises nothing
    else:
        try:
            outcomes._check(value, 4, "result")
        except outcomes.Unsendable:
            return
        assert not outcomes.is_plain(value)  # passed, but not plain: json.dumps's side


def test_an_outcome_of_a_result_and_an_error_is_refused() -> None:
    """``WorkerConnection.finish(result=..., error=...)`` sent the error and dropped the
    result without a word: it is refused before anything is sent."""
    with pytest.raises(ValueError, match="a result or an error, not both"):
        outcome(result={"partial": 1}, error={"code": "E", "message": "m"})
    assert outcome(result=None, error={"code": "E"}) == {"ok": False, "error": {"code": "E"}}
    assert outcome(result=0) == {"ok": True, "result": 0}
