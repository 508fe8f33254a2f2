"""What a finish may carry: outcomes the server takes, and their size on the wire.

The server refuses some values before it reads the request they travel in: NaN or
Infinity, an integer beyond 64 bits, a lone surrogate, a key seen twice, a frame over
4 MiB (``docs/protocol.md``). Its error then carries no ``req_id``, so the finish timed
out, was sent again after the resume, and timed out again, for ever: the attempt stayed
running, its lease renewed, and its sender held back the finishes after it. Other values
(a NUL, nesting past 64 levels, a code or message past its limit) are refused with the
``req_id``, which fails the whole ``finish_many`` they travel in; and a value JSON cannot
hold at all (a set, a datetime) failed the batch in the runner. The runner therefore
checks a result here, under the server's rules, before it sends it: a result the server
would refuse becomes the attempt's non-retryable failure (``RESULT_NOT_JSON``,
``RESULT_TOO_LARGE``), and an error's code and message are cleaned to fit.

No pydantic here (``orbit.protocol.decode`` imports it): a worker process does not load
it. ``tests/unit/test_worker_outcomes.py`` holds these rules to the server's decoder.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

#: the largest frame the server reads, in characters (``gateway.MAX_MESSAGE_BYTES``)
MAX_FRAME_CHARS = 4 * 1024 * 1024
#: what a frame holds besides its outcomes: the message's own fields
MESSAGE_ROOM = 1024
#: what a ``finish_many`` item holds besides its outcome's value: id, fence, keys
ITEM_ROOM = 512


def frame_room(items: int) -> int:
    """What ``items`` outcomes' values may take together, as JSON, in one frame."""
    return MAX_FRAME_CHARS - MESSAGE_ROOM - items * ITEM_ROOM


#: the most an outcome's value (a result, or an error) may take as JSON on the wire
MAX_OUTCOME_CHARS = frame_room(1)

_MAX_DEPTH = 64  # the server's nesting limit, counted from the message itself
_RESULT_DEPTH = 4  # where a result sits in a finish_many (message, items, item, outcome)
_MIN_INT, _MAX_INT = -(2**63), 2**63 - 1
_CODE_MAX = 100
_MESSAGE_MAX = 10_000


class Unsendable(Exception):
    """A result the server would refuse; ``code`` is the failure reported instead."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error(code: str, message: str, *, retryable: bool) -> dict[str, Any]:
    """An error outcome the server takes: code and message within their limits, with no
    NUL and no lone surrogate (each written as its escape instead)."""
    code = clean_text(code, _CODE_MAX) or ("RETRY" if retryable else "FAILED")
    message = clean_text(message, _MESSAGE_MAX)
    return {"error": {"code": code, "message": message, "retryable": retryable}}


def clean_text(text: str, most: int) -> str:
    """``text`` as the server takes a string: NULs and lone surrogates escaped, at most
    ``most`` characters."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if _not_utf8(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:most]


def _not_utf8(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate, which UTF-8 (and the server) cannot."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def wire_size(value: Any) -> int:
    """Characters ``value`` takes on the wire, as ``WorkerConnection.request`` writes it."""
    if value is None:
        return 4
    return len(json.dumps(value, separators=(",", ":")))


#: the types of a plain value's scalars (exactly: no subclass, no Enum; no float, which
#: orjson may write otherwise than json.dumps, 1e+16 as 1e16)
_PLAIN_SCALARS = frozenset({str, int, bool, type(None)})


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a scalar of ``_PLAIN_SCALARS``, or a flat list or dict (text
    keys) of them: a handler's usual result, which orjson writes as ``json.dumps`` does
    whenever its text is ASCII with no DEL (``connection.frame_text``, ``_plain_size``).
    Anything nested or of another type is not looked into: not plain."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is dict:
        return all(type(k) is str and type(v) in _PLAIN_SCALARS for k, v in value.items())
    if kind is list:
        return all(type(v) in _PLAIN_SCALARS for v in value)
    return False


def _plain_size(value: Any) -> int:
    """``wire_size`` of a plain value, by orjson (0.2 µs for a small dict, against the
    standard library's 2.5): its text is ``json.dumps``'s, character for character, when
    it is ASCII and holds no DEL (which json.dumps escapes and orjson does not)."""
    try:
        data = orjson.dumps(value)
    except TypeError:  # an int beyond 64 bits (refused before this, by _check)
        return wire_size(value)
    if data.isascii() and b"\x7f" not in data:
        return len(data)
    return wire_size(value)


def _plain_and_fine(value: Any) -> bool:
    """Whether ``value`` is plain (``is_plain``) and passes ``_check``: its texts hold no
    NUL and no lone surrogate, its ints fit in 64 bits (a flat value nests no deeper than
    a result may, and a dict's text keys cannot repeat). One pass, with no path built for
    each key as ``_check`` builds them for its messages (2.2 µs a small dict); False for
    anything else, which ``_check`` then reads."""
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and _text_fine(k) and _scalar_fine(v) for k, v in value.items())
    if kind is list:
        return all(_scalar_fine(v) for v in value)
    return _scalar_fine(value)


def _scalar_fine(value: Any) -> bool:
    kind = type(value)
    if kind is str:
        return _text_fine(value)
    if kind is int:
        return bool(_MIN_INT <= value <= _MAX_INT)
    return value is None or kind is bool


def _text_fine(text: str) -> bool:
    return "\x00" not in text and not _not_utf8(text)


def check_result(value: Any) -> tuple[int, bool]:
    """Raise ``Unsendable`` if the server would refuse ``value`` as a result; else return
    its size on the wire, and whether it is plain (``is_plain``, which the one pass of a
    plain value has found out already: the runner's batch then takes orjson)."""
    if value is None or value is True or value is False:
        return wire_size(value), True
    plain = _plain_and_fine(value)
    if not plain:
        _check(value, _RESULT_DEPTH, "result")  # which also names what is wrong
    try:
        size = _plain_size(value) if plain else wire_size(value)
    except (TypeError, ValueError) as exc:  # a subclass that encodes unlike its base
        raise Unsendable("RESULT_NOT_JSON", f"the result is not JSON: {exc}"[:2000]) from None
    if size > MAX_OUTCOME_CHARS:
        raise Unsendable(
            "RESULT_TOO_LARGE",
            f"the result is {size} characters of JSON; at most {MAX_OUTCOME_CHARS} fit in "
            "a message (attach large outputs with ctx.upload)",
        )
    return size, plain


def _not_json(path: str, why: str) -> Unsendable:
    return Unsendable("RESULT_NOT_JSON", f"{path} {why}"[:2000])


def _check(value: Any, depth: int, path: str) -> None:
    """The rules of ``orbit.protocol.decode`` (strict JSON, then ``values_ok``), applied
    to the value before it is encoded, as ``json.dumps`` would encode it."""
    if depth > _MAX_DEPTH:
        raise _not_json(path, f"nests deeper than a result may ({_MAX_DEPTH - _RESULT_DEPTH})")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not _MIN_INT <= value <= _MAX_INT:
            raise _not_json(path, "is an integer beyond 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _not_json(path, f"is {value!r}, which JSON cannot hold")
    elif isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check(item, depth + 1, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            name = _key(key, path)  # text keys: none can repeat
            _check_text(name, path)
            if depth + 1 > _MAX_DEPTH:
                raise _not_json(path, "nests deeper than a result may")
            _check(item, depth + 1, f"{path}.{name}")
    else:
        raise _not_json(path, f"is a {type(value).__name__}, which JSON cannot hold")


def _check_text(text: str, path: str) -> None:
    if "\x00" in text:
        raise _not_json(path, "holds a NUL character")
    if _not_utf8(text):
        raise _not_json(path, "holds a lone surrogate (not valid UTF-8)")


def _key(key: Any, path: str) -> str:
    """A dict key, which must be a string: ``json.dumps`` writes a number, a bool or None
    as text, and a handler's ``{1: "a"}`` was stored as ``{"1": "a"}``, ``{None: 1}`` as
    ``{"null": 1}``, without a word (the clients refuse such a payload too)."""
    if isinstance(key, str):
        return key
    raise _not_json(
        path, f"has the key {key!r:.60} of type {type(key).__name__}: JSON keys are strings"
    )
