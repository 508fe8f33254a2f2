"""``canonical_json`` is the standard library's spelling (sorted keys, no spaces, no
ASCII escaping, no NaN), whichever encoder writes it: digests of payloads and results
stored by earlier versions must still match."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Outcome, canonical_json
from orbit.core.transitions import spell
from orbit.core.validate import check_payload


def _reference(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


_plain = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past 64 bits too
    | st.text(st.characters(codec="utf-8"))  # every code point but the surrogates
)
_values = st.recursive(
    _plain | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=500)
@given(_values)
def test_any_value_is_spelled_as_the_standard_library_spells_it(value: Any) -> None:
    assert canonical_json(value) == _reference(value)


@given(st.dictionaries(st.text(), _plain, max_size=8) | st.lists(_plain, max_size=8))
def test_flat_values_too(value: Any) -> None:
    assert canonical_json(value) == _reference(value)


def test_the_spellings_that_differ_between_encoders() -> None:
    for value in (
        {"t": 1e-05, "u": 1e16, "v": 0.1},  # floats: orjson 3.13 writes 1e-05 as 1e-5
        {1: "a", 2: "b"},  # keys that are not strings
        [2**64, -(2**63) - 1],  # past 64 bits
        {"a": "\x00\x1f\x7f\u2028\ud7ff\U0001f600"},  # escapes and the edges of UTF-8
        {"é": 1, "Z": 2, "\U0001f600": 3, "ﬀ": 4},  # key order by code point
    ):
        assert canonical_json(value) == _reference(value), value


#: Floats orjson writes exactly as the standard library does (``_plain``): zero, and
#: magnitudes Python writes without an exponent. The edges first, then random ones.
_EDGE_FLOATS = (0.0, -0.0, 1e-4, -1e-4, 0.1, 1.0, 2.5, 0.30000000000000004)
_EDGE_FLOATS += (9999999999999998.0, 1e15, 123456789.123456789, 1.7976931348623157e16 / 2)


@given(
    st.dictionaries(
        st.text(),
        st.floats(min_value=1e-4, max_value=9999999999999998.0) | st.just(-0.0),
        max_size=8,
    )
)
def test_flat_values_with_floats_too(value: dict[str, float]) -> None:
    assert canonical_json(value) == _reference(value)
    assert canonical_json([-v for v in value.values()]) == _reference([-v for v in value.values()])


def test_floats_across_the_range_orjson_writes_for_them() -> None:
    """A quarter of a million doubles from every part of the fast path's range (random
    exponent and mantissa bits), and its edges: orjson's spelling, taken for them, must
    be the standard library's to the byte, or stored digests would stop matching."""
    rng = random.Random(20261202)
    values: list[float] = list(_EDGE_FLOATS)
    while len(values) < 250_000:
        x = rng.uniform(-4, 16)  # log-uniform magnitudes, 1e-4 to 1e16
        value = 10**x * rng.choice((1, -1))
        values.append(value)
        values.append(round(value, rng.randint(0, 8)))  # the short decimals people write
    values = [v for v in values if v == 0.0 or 1e-4 <= abs(v) < 1e16]
    for start in range(0, len(values), 1000):
        chunk = values[start : start + 1000]
        assert canonical_json(chunk) == _reference(chunk)
    for edge in _EDGE_FLOATS:
        assert canonical_json({"t": edge}) == _reference({"t": edge})


def test_floats_outside_that_range_take_the_standard_library() -> None:
    for value in (1e16, -1e16, 9.999e-05, 5e-324, 1.7976931348623157e308, 1e-7, 1e22):
        assert canonical_json([value]) == _reference([value]), value
        assert canonical_json(value) == _reference(value), value


@settings(max_examples=80)
@given(_values)
def test_check_payload_spells_and_measures_as_the_standard_library(value: Any) -> None:
    """``check_payload`` spells a shallow payload once, by the fast path, and measures
    the bytes: the same text and size as the standard spelling, and a payload is refused
    as too large exactly when its UTF-8 spelling is over the limit."""
    text = _reference(value)
    size = len(text.encode("utf-8"))
    assert check_payload(value, size) == (text, size)
    with pytest.raises(OrbitError) as err:
        check_payload(value, size - 1)
    assert err.value.code == Code.PAYLOAD_TOO_LARGE


def test_check_payload_still_refuses_what_the_fast_path_leaves() -> None:
    """A lone surrogate, NaN, a float the fast path leaves and an integer past 64 bits
    take the standard way, with its verdicts."""
    for bad in ({"s": "\ud800"}, {"f": float("nan")}, [float("inf")]):
        with pytest.raises(OrbitError) as err:
            check_payload(bad, 1000)
        assert err.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(OrbitError) as err:
        check_payload({"s": "\ud800" * 10}, 5)
    assert err.value.code == Code.PAYLOAD_TOO_LARGE
    wide = '{"f":1e-07,"n":' + str(2**70) + "}"
    assert check_payload({"n": 2**70, "f": 1e-7}, 1000) == (wide, len(wide))


@settings(max_examples=300)
@given(_values)
def test_a_success_is_spelled_around_its_results_spelling(value: Any) -> None:
    """``spell`` builds a success's report from its result's spelling: exactly the
    whole outcome's, as the finish spelled (and digested) it before."""
    outcome = Outcome.success(value)
    spelled = spell(outcome)
    assert spelled.result == _reference(value)
    assert spelled.report == _reference(outcome.as_json())


@given(st.text(), st.text(), st.booleans())
def test_a_failure_is_spelled_whole_and_has_no_result(
    code: str, message: str, retryable: bool
) -> None:
    outcome = Outcome.failure(code, message, retryable)
    assert spell(outcome) == (_reference(outcome.as_json()), None)


def test_spelling_an_outcome_refuses_what_canonical_json_refuses() -> None:
    for result in (float("nan"), {"a": {1, 2}}, {("k",): 1}):
        for value in (result, {"ok": True, "result": result}):
            with pytest.raises((TypeError, ValueError)):
                canonical_json(value)
        with pytest.raises((TypeError, ValueError)):
            spell(Outcome.success(result))
