"""``canonical_json`` is the standard library's spelling (sorted keys, no spaces, no
ASCII escaping, no NaN), whichever encoder writes it: digests of payloads and results
stored by earlier versions must still match."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.core.model import canonical_json


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
