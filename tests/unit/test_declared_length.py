"""The early refusal of a body by its Content-Length (``POST /v1/tasks``, the artifact
upload): only a value of ASCII digits counts, and no value can make the check raise."""

from __future__ import annotations

import pytest

from orbit.server.routes import declares_over


@pytest.mark.parametrize(
    ("declared", "over"),
    [
        (None, False),
        ("0", False),
        ("100", False),
        ("101", True),
        ("000101", True),
        ("00100", False),
        ("101 ", True),  # httptools hands the app the value with its trailing space
        ("\t101", True),
        ("9" * 5000, True),  # int() refuses strings of more than 4,300 digits
        ("1" + "0" * 30, True),
    ],
)
def test_a_declared_length_of_ascii_digits_is_compared_with_the_limit(
    declared: str | None, over: bool
) -> None:
    assert declares_over(declared, 100) is over


@pytest.mark.parametrize(
    "declared",
    ["²", "¹²³", "\u0661\u0662\u0663", "\uff11\uff12\uff13", "+101", "-1", "1_01", "", " "],
)
def test_a_declared_length_that_is_not_ascii_digits_is_left_to_the_body_count(
    declared: str,
) -> None:
    """The check used ``str.isdigit`` and then ``int``: ``isdigit`` also admits '²' (and
    other scripts' digits), which ``int`` refuses, so such a header was a 500. Uvicorn
    (h11 and httptools alike) answers a Content-Length that is not digits with its own
    400 and never passes it on, but another ASGI server, or a direct ASGI call, reached
    the app with it. Such a value refuses nothing early: the body is counted as it
    arrives and refused at the limit, as a chunked one is."""
    assert declares_over(declared, 100) is False
