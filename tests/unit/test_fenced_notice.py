"""What a node reads from another node's ``fenced`` notice (orbit.server.listen)."""

from __future__ import annotations

import pytest

from orbit.server.listen import fenced_notice


def test_a_fenced_notice_names_the_session_and_its_new_epoch() -> None:
    assert fenced_notice(["s-1:7"]) == ("s-1", 7)
    assert fenced_notice(["a:b:12"]) == ("a:b", 12)  # the epoch is after the last colon


@pytest.mark.parametrize(
    "rest",
    [
        [],
        ["s-1:7", "x"],
        ["s-1:²"],
        ["s-1:\u0661"],
        ["s-1:"],
        [":7"],
        ["s-1:-7"],
        ["s-1:1e3"],
        ["s:" + "9" * 19],
    ],
)
def test_anything_else_is_no_fenced_notice_and_raises_nothing(rest: list[str]) -> None:
    """'²' passes ``str.isdigit`` and then made ``int()`` raise ValueError inside the
    notification callback: the node dropped its LISTEN connection. Other non-ASCII
    digits, which ``int()`` takes, are no epoch Orbit writes either."""
    assert fenced_notice(rest) is None
