"""Strict decoding of everything a client or worker sends.

JSON that Python's parser would quietly accept is refused here, each class with its own
machine-readable code, before any state is touched: duplicate keys, invalid UTF-8, lone
surrogates, NaN/Infinity, integers beyond 64 bits, unknown fields, case variants of
field names, nulls where a value is required, and fields that only responses carry.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

MAX_INT = 2**63 - 1
MIN_INT = -(2**63)


class DecodeError(Exception):
    """A request refused before it was understood; ``code`` says which rule it broke."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = None if field is None else _writable(field)

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        return {"error": body}


def _writable(text: str) -> str:
    """``text`` with each lone surrogate as its ``\\udxxx`` escape: a field named from the
    request (a key seen twice) can hold one, and a reply holding it cannot be written."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the first key seen twice, to name it
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DecodeError("DUPLICATE_KEY", f"key {key!r:.60} appears twice", key[:60])
            seen.add(key)
    return out


def _constant(name: str) -> Any:
    raise DecodeError("NON_FINITE_NUMBER", f"{name} is not a JSON number")


MAX_DEPTH = 64


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # beyond 64 bits, and int() refuses > 4300 digits
        raise DecodeError("NUMBER_OUT_OF_RANGE", "integers must fit in 64 bits")
    value = int(text)
    if not MIN_INT <= value <= MAX_INT:
        raise DecodeError("NUMBER_OUT_OF_RANGE", "integers must fit in 64 bits")
    return value


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise DecodeError("NUMBER_OUT_OF_RANGE", f"{text[:40]} overflows a double")
    return value


def _check_strings(value: Any) -> None:
    """Every string valid UTF-8."""
    for item, _, keys in _walk(value):
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise DecodeError(
                    "LONE_SURROGATE", "a string holds a lone surrogate", _path(keys)
                ) from None


#: The most of a path a refusal names (its ``field``): a hostile document's keys can be
#: megabytes long, and so could the path to a value nested under them.
MAX_FIELD = 120


def _walk(value: Any, depth: int = 0, path: str = "") -> Iterator[tuple[Any, int, list[str | int]]]:
    """Every value in ``value``, each dict's keys too, in document order: with its depth
    (a key or an item one level below its container, as ``values_ok`` counts) and its
    path, the keys to it (a dict's key: the dict's). The path is one list the walk
    changes as it goes: read it at once (``_path``). Paths are never spelled along the
    way, and the walk is a loop, not a recursion: a document nested some 900 levels
    under keys of thousands of characters (within the frame limits) made a path string
    at every level, each kept until the walk came back up, and took gigabytes and
    seconds of the event loop."""
    keys: list[str | int] = [path] if path else []
    # (value, its depth, the length of its container's path, its key in it or None)
    stack: list[tuple[Any, int, int, str | int | None]] = [(value, depth, len(keys), None)]
    while stack:
        item, depth, at, key = stack.pop()
        del keys[at:]
        if key is not None:
            keys.append(key)
        yield item, depth, keys
        here, inner = len(keys), depth + 1
        if isinstance(item, dict):
            for k, v in reversed(item.items()):
                stack.append((v, inner, here, k))
                stack.append((k, inner, here, None))
        elif isinstance(item, list):
            for i in range(len(item) - 1, -1, -1):
                stack.append((item[i], inner, here, i))


def _path(keys: list[str | int]) -> str | None:
    """A path as a refusal names it (``a.b[2].c``), at most ``MAX_FIELD`` characters: a
    list's index in brackets, the one spelling clients may parse, whichever check
    refused (the walks here, ``_check_fields``, pydantic's errors, the store's)."""
    parts: list[str] = []
    size = 0
    for key in keys:
        if isinstance(key, int):
            part = f"[{key}]"
        else:
            part = f".{key[:MAX_FIELD]}" if parts else key[:MAX_FIELD]
        parts.append(part)
        size += len(part)
        if size >= MAX_FIELD:
            break
    return "".join(parts)[:MAX_FIELD] or None


def short_text(value: Any, most: int) -> TypeGuard[str]:
    """A string of 1 to ``most`` characters without NUL: an id, a code, a key, as the
    models' length limits and ``values_ok`` take it (the one-pass readers' check)."""
    return type(value) is str and 0 < len(value) <= most and "\x00" not in value


#: Values that pass ``values_ok`` at any depth within the limit, as a container's item.
_SCALARS = frozenset({int, float, bool, type(None)})


def values_ok(value: Any, depth: int = 0) -> bool:
    """``_check_values`` without naming the culprit: the same rules, no path strings built
    along the way. Every message passes through here (a 200-item finish batch holds
    thousands of values, a batch submit a thousand payloads), so the path is worked out
    only for a message that fails.

    A dict or list within the limit checks its strings and scalars in its own loop, not
    by a call each (a payload of three fields: 0.59 -> 0.34 µs); anything else, and a
    key or item of an unusual type, takes ``_values_walk``, which states the rules."""
    kind = type(value)
    if kind is dict and depth < MAX_DEPTH:  # so each key and item is within it
        inner = depth + 1
        for k, v in value.items():
            if type(k) is str:  # as a JSON object's keys are
                if "\x00" in k:
                    return False
            elif not _values_walk(k, inner):
                return False
            kind = type(v)
            if kind is str:
                if "\x00" in v:
                    return False
            elif kind not in _SCALARS and not values_ok(v, inner):
                return False
        return True
    if kind is list and depth < MAX_DEPTH:
        inner = depth + 1
        for v in value:
            kind = type(v)
            if kind is str:
                if "\x00" in v:
                    return False
            elif kind not in _SCALARS and not values_ok(v, inner):
                return False
        return True
    return _values_walk(value, depth)


def _values_walk(value: Any, depth: int) -> bool:
    """``values_ok``'s rules, one value at a time: nesting within ``MAX_DEPTH`` (a key
    counts as one level below its dict) and no NUL in any string."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        inner = depth + 1
        for k, v in value.items():
            if not (values_ok(k, inner) and values_ok(v, inner)):
                return False
    elif isinstance(value, list):
        inner = depth + 1
        for v in value:
            if not values_ok(v, inner):
                return False
    return True


def _check_values(value: Any, path: str) -> None:
    """No NUL in any string (PostgreSQL text cannot hold one) and nesting bounded (so
    every view can serialise what was stored). Run on a parsed message, so the error can
    still echo its ``req_id``."""
    if not values_ok(value):
        _find_bad_value(value, path)


def _find_bad_value(value: Any, path: str, depth: int = 0) -> None:
    """Raise the error for the first value that breaks ``_check_values``'s rules (from
    ``depth``), naming where it is (under ``path``)."""
    for item, level, keys in _walk(value, depth, path):
        if level > MAX_DEPTH:
            raise DecodeError("TOO_DEEP", f"values nest at most {MAX_DEPTH} levels", _path(keys))
        if isinstance(item, str) and "\x00" in item:
            raise DecodeError("NUL_CHARACTER", "a string holds a NUL character", _path(keys))


def _canonical(raw: bytes | str) -> tuple[bool, Any]:
    """``(True, value)`` if ``raw`` is exactly what orjson writes for the value it parses
    to, with no integer beyond 53 bits; else ``(False, None)``. Such a document breaks no
    rule above: a key seen twice would be missing from the value's spelling, and orjson
    refuses NaN, invalid UTF-8 and lone surrogates; the one thing it reads that the
    strict parser refuses, an integer from 2**63 to 2**64 - 1, is past 53 bits, which
    ``OPT_STRICT_INTEGER`` refuses to write. Compact JSON, as Orbit's worker and client
    send it, is then read at orjson's speed (the standard library's parser, with a hook
    per object and per number, took 1.3 ms of a 1,000-task batch's body); anything else,
    and every document that breaks a rule, takes the strict parser, whose errors say
    which rule."""
    try:
        value = orjson.loads(raw)
        spelled = orjson.dumps(value, option=orjson.OPT_STRICT_INTEGER)
        exact = spelled == (raw if isinstance(raw, bytes) else raw.encode("utf-8"))
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, UnicodeEncodeError):
        return False, None
    return (True, value) if exact else (False, None)


def decode_json(raw: bytes | str) -> Any:
    """Parse one JSON document under the strict rules above: orjson for a document in
    its canonical spelling (``_canonical``), the strict parser for any other."""
    fast, value = _canonical(raw)
    return value if fast else _strict_json(raw)


def _strict_json(raw: bytes | str) -> Any:
    """The standard library's parser, with a hook for every rule above."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("INVALID_UTF8", "the body is not valid UTF-8") from None
    else:
        text = raw
    try:
        value = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_constant=_constant,
            parse_int=_int,
            parse_float=_float,
        )
    except DecodeError:
        raise
    except (ValueError, RecursionError) as exc:
        raise DecodeError("INVALID_JSON", f"not a JSON document: {exc}"[:200]) from None
    # A lone surrogate can only come from a \uD8xx-\uDFxx escape (strict UTF-8 has
    # none), or from a str that was never UTF-8: only then is the walk needed.
    if not text.isascii() or "\\ud" in text or "\\uD" in text:
        _check_strings(value)
    return value


class _Shape:
    """What ``_check_fields`` needs to know of a model, worked out once per model (the
    hot path decodes batches of hundreds of items)."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.known = frozenset(model.model_fields)
        self.response_only: frozenset[str] = getattr(model, "response_only_fields", frozenset())
        # A change body's field that is not the server's but changed elsewhere (the
        # URL's name, paused): "set by the server" would send its author astray.
        self.reasons: Mapping[str, str] = getattr(model, "response_only_reasons", {})
        self.lowered = {name.lower(): name for name in model.model_fields}
        self.nested = {
            name: sub
            for name, info in model.model_fields.items()
            if (sub := _submodel(info.annotation)) is not None
        }


_SHAPES: dict[type[BaseModel], _Shape] = {}


def _shape(model: type[BaseModel]) -> _Shape:
    shape = _SHAPES.get(model)
    if shape is None:
        shape = _SHAPES[model] = _Shape(model)
    return shape


def _check_fields(model: type[BaseModel], data: Any, path: str) -> None:
    """Name the precise rule an object breaks: unknown, case variant or response-only."""
    if not isinstance(data, dict):
        return
    shape = _shape(model)
    for key, value in data.items():
        if key in shape.known:
            sub = shape.nested.get(key)
            if sub is not None:
                where = f"{path}.{key}" if path else key
                if isinstance(value, list):
                    for i, item in enumerate(value):
                        _check_fields(sub, item, f"{where}[{i}]")
                else:
                    _check_fields(sub, value, where)
            continue
        where = f"{path}.{key}" if path else key
        if key in shape.response_only:
            why = shape.reasons.get(key, f"{key} is set by the server, never sent")
            raise DecodeError("RESPONSE_ONLY_FIELD", why, where)
        if key.lower() in shape.lowered:
            raise DecodeError(
                "FIELD_CASE_MISMATCH", f"{key} must be spelled {shape.lowered[key.lower()]}", where
            )
        raise DecodeError("UNKNOWN_FIELD", f"unknown field {key!r:.60}", where[:120])


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model inside ``M``, ``M | None`` or ``list[M]``, if any."""
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    for c in candidates:
        for inner in (c, *getattr(c, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


_CODES = {
    "missing": "MISSING_FIELD",
    "at_least_one": "MISSING_FIELD",
    "extra_forbidden": "UNKNOWN_FIELD",
    "less_than_equal": "NUMBER_OUT_OF_RANGE",
    "greater_than_equal": "NUMBER_OUT_OF_RANGE",
    "less_than": "NUMBER_OUT_OF_RANGE",
    "greater_than": "NUMBER_OUT_OF_RANGE",
    "finite_number": "NON_FINITE_NUMBER",
    "string_too_long": "VALUE_TOO_LONG",
    "too_long": "VALUE_TOO_LONG",
    "number_out_of_range": "NUMBER_OUT_OF_RANGE",
}


def decode_model(model: type[M], raw: bytes | str | Any, *, parsed: bool = False) -> M:
    """Strictly decode bytes (or an already strictly parsed value) into ``model``."""
    data = raw if parsed else decode_json(raw)
    if not isinstance(data, dict):
        raise DecodeError("INVALID_TYPE", "the message must be a JSON object")
    _check_values(data, "")
    _check_fields(model, data, "")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        # ``_path``'s spelling, as every other refusal's (``tasks[1].priority``): joined
        # with dots, pydantic's location said ``tasks.1.priority`` for a bad value where
        # an unknown field of the same task was ``tasks[1].Priority``
        where = _path(list(err["loc"]))
        kind = err["type"]
        if err.get("input", 0) is None and kind != "missing":
            code = "NULL_NOT_ALLOWED"
        elif kind.endswith("_type") or kind.endswith("_parsing"):
            code = "INVALID_TYPE"
        else:
            code = _CODES.get(kind, "INVALID_VALUE")
        message = error_message(err["msg"])
        raise DecodeError(code, f"{where}: {message}" if where else message, where) from None


def error_message(msg: str) -> str:
    """pydantic's message for one error, without the "Value error, " it puts before the
    text of a ValueError a validator raised: "deadline: Value error, an instant is …"
    spoke of Python, not of the value."""
    return msg.removeprefix("Value error, ")
