"""A hostile document's cost: linear in its size, however deep and long its keys.

A document nested some 900 levels under long non-ASCII keys (within the frame and body
limits, and before ``hello``: any worker or submit token would do) took the strict
parser's walks a path string at every level, each kept until the walk came back up: a
14 MB frame took 6.5 GB and held every worker of the node for seconds. The walks keep a
list of keys now, and a refusal names at most ``MAX_FIELD`` characters of the path."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from orbit.protocol.decode import MAX_FIELD, DecodeError, _check_values, decode_json

DEPTH, KEY = 900, "😀" * 300


def _hostile(bottom: str) -> str:
    return '{"type":"heartbeat","p":' + ('{"' + KEY + '":') * DEPTH + bottom + "}" * DEPTH + "}"


def _peak(call: Any) -> tuple[int, Any]:
    """The most memory ``call`` held at once (tracemalloc), and what it returned."""
    tracemalloc.start()
    try:
        out = call()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("bottom", "code"), [('"\\u00e9"', "TOO_DEEP"), ('"\\udc80"', "LONE_SURROGATE")]
)
def test_a_deep_document_under_long_keys_costs_its_size_and_names_a_short_field(
    bottom: str, code: str
) -> None:
    doc = _hostile(bottom)

    def refuse() -> DecodeError:
        try:
            _check_values(decode_json(doc), "")
        except DecodeError as exc:
            return exc
        raise AssertionError("not refused")

    peak, refused = _peak(refuse)
    assert refused.code == code
    # The parsed value holds the keys (4 bytes a character); the old walks held a path
    # of every level at once: hundreds of times more (about 0.5 GB here).
    assert peak < 20 * len(doc) * 4, peak
    assert refused.field is not None and 0 < len(refused.field) <= MAX_FIELD
