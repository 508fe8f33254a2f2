"""The one rule for an artifact's content type (``orbit.core.validate.content_type_problem``),
which the store and the worker's ``Context.upload`` both apply: an RFC 9110 media type
that an HTTP header carries as it is. A type with a space or tab at either end passed,
and h11 refused the header in the worker (a retryable ``Unreachable`` in the handler);
``ab/``, ``/ab``, ``a b/c d`` and ``text/plain/extra`` were stored and served back."""

from __future__ import annotations

import pytest

from orbit.core.validate import content_type_problem

ACCEPTED = [
    "a/b",
    "text/plain",
    "image/svg+xml",
    "application/vnd.api+json",
    "application/json; charset=utf-8",
    "application/json;charset=utf-8",
    "text/plain ;charset=utf-8",
    "text/plain;\tq=1",
    "text/plain; charset=shift_jis",
    "a/b; x=1; y=2",
    'a/b; x="two words; and a \\" quote"',
    'text/plain; name="\xe9"',
    "text/plain; name=\xe9",  # a Latin-1 value unquoted: what the store kept before
    "a/b;",  # RFC 9110 lets a parameter be empty
    "a/b; ;x=1",
    "a/" + "b" * 198,
]

#: each refused, with what the refusal says
REFUSED = [
    ("text/plain ", "no space or tab at either end"),
    (" text/plain", "no space or tab at either end"),
    ("\ttext/x", "no space or tab at either end"),
    ("text/plain;\t", "no space or tab at either end"),
    ("ab/", "must be a media type"),
    ("/ab", "must be a media type"),
    ("a b/c d", "must be a media type"),
    ("text/plain/extra", "must be a media type"),
    ("text/(x)", "must be a media type"),
    ("a/b,c/d", "must be a media type"),
    ("a/b;x", "must be a media type"),
    ("a/b;x=", "must be a media type"),
    ("a/b; x = 1", "must be a media type"),
    ("a/b;x=a b", "must be a media type"),
    ('a/b;x="open', "must be a media type"),
    ('a/b;x="a"b', "must be a media type"),
    ("png", "content_type must look like type/subtype"),
    ("a/", "3 to 200 characters long; got 2"),
    ("a/" + "b" * 250, "3 to 200 characters long; got 252"),
    ("text/plain; name=日本", "got '日'"),
    ("text/plain\r\nX: y", r"got '\r'"),
]


@pytest.mark.parametrize("content_type", ACCEPTED)
def test_a_media_type_is_a_content_type(content_type: str) -> None:
    assert content_type_problem(content_type) is None


@pytest.mark.parametrize(("content_type", "says"), REFUSED)
def test_anything_else_is_refused_naming_the_rule(content_type: str, says: str) -> None:
    problem = content_type_problem(content_type)
    assert problem is not None and says in problem, problem


def test_a_long_run_of_separators_is_judged_at_once() -> None:
    """The whitespace around each ``;`` splits only one way, so a near miss of the
    longest length is refused without the regex trying every split (a test that hung
    would say so; no time is asserted)."""
    assert content_type_problem("a/b" + ";  " * 65 + "!") is not None
    assert content_type_problem("a/b" + " ; x=y" * 32 + " ") is not None
