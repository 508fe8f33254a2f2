"""A worker's batched reports (``start_many``, ``finish_many``) as the store takes them.

A busy worker sends its starts and finishes in batches of hundreds, and each item went
through the rule walks and the pydantic model before the store saw it: 3.4 µs a start
and 6.9 µs a finish of the server's event loop (``timeit``, batches of 100), a loop that
also carries every other connection. A batch whose every item has exactly the usual
fields, each of the usual type and within its limits, is read here in one pass instead.
Anything else (a field unknown, misspelt or missing, a wrong type, a value out of range,
a NUL, an outcome that is both a success and an error) makes the reader return None, and
the strict path (``decode_model``) decodes the message and names the rule it broke. So
the readers only ever accept what the strict path accepts, and both give the store the
same arguments: ``tests/unit/test_report_batches.py`` holds them to each other.

The document has already been parsed by ``decode_json``, under the strict JSON rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Outcome
from orbit.protocol.decode import MAX_INT, short_text, values_ok
from orbit.protocol.messages import (
    Finish,
    FinishItem,
    FinishMany,
    StartMany,
)

#: the limits the models set (messages.py): ReqId and Id, the batch, ErrorSpec
_ID_MAX = 64
_BATCH_MAX = 1000
_CODE_MAX = 100
_MESSAGE_MAX = 10_000

_MESSAGE_KEYS = frozenset({"type", "req_id", "items"})
_OUTCOME_KEYS = frozenset({"ok", "result", "error"})
_ERROR_KEYS = frozenset({"code", "message", "retryable"})

#: the usual outcome of a handler that returns nothing (records are immutable: one will do)
_NO_RESULT = Outcome.success(None)

#: how deep an outcome's result sits in the message (message, items, item, outcome),
#: for ``values_ok``: the nesting limit counts from the message itself
_RESULT_DEPTH = 4


@dataclass(frozen=True, slots=True)
class StartBatch:
    """A ``start_many``: its ``req_id`` and, per item, the attempt and its fence."""

    req_id: str
    items: list[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class FinishBatch:
    """A ``finish_many``: its ``req_id`` and, per item, the attempt, its fence and the
    outcome reported."""

    req_id: str
    items: list[tuple[str, int, Outcome]]


def _fence(value: Any) -> int | None:
    """A counter (a canonical decimal string below 2**63) as its integer.

    Without the model's regular expression (``COUNTER_RE``, a match per item on top of
    the ``int``): ``int`` reads the digits, and a string that is not the integer's own
    spelling (a sign, a space, an underscore, a leading zero, a non-ASCII digit) is
    refused by comparing it with that spelling. ``tests/unit/test_report_batches.py``
    holds it to the regular expression."""
    if type(value) is not str or not 0 < len(value) <= 19:
        return None
    try:
        fence = int(value)
    except ValueError:
        return None
    return fence if 0 <= fence <= MAX_INT and str(fence) == value else None


def _items(raw: dict[str, Any]) -> list[Any] | None:
    """The message's items, if the message has exactly its three fields and a usual
    ``req_id`` and holds 1 to 1,000 items."""
    if raw.keys() != _MESSAGE_KEYS or not short_text(raw["req_id"], _ID_MAX):
        return None
    items = raw["items"]
    if type(items) is not list or not 0 < len(items) <= _BATCH_MAX:
        return None
    return items


def read_start_many(raw: dict[str, Any]) -> StartBatch | None:
    """A ``start_many`` in its usual shape, or None (see the module's docstring).

    An item of two entries whose ``attempt_id`` and ``fence`` are both there and valid
    has exactly those two fields: the lookups with ``get`` check the keys' set without
    building it (``item.keys() != …``), as ``read_finish_many`` does."""
    items = _items(raw)
    if items is None:
        return None
    starts: list[tuple[str, int]] = []
    for item in items:
        if type(item) is not dict or len(item) != 2:
            return None
        attempt_id = item.get("attempt_id")
        fence = _fence(item.get("fence"))
        if fence is None or not short_text(attempt_id, _ID_MAX):
            return None
        starts.append((attempt_id, fence))
    return StartBatch(raw["req_id"], starts)


def _outcome(spec: Any) -> Outcome | None:
    """An outcome in its usual shape (a success with its result, or a failure with its
    error and no result), or None."""
    if type(spec) is not dict:
        return None
    ok = spec.get("ok")
    if ok is True and len(spec) == 2 and "result" in spec and spec["result"] is None:
        return _NO_RESULT  # the usual outcome of all, ``{"ok": true, "result": null}``
    if not spec.keys() <= _OUTCOME_KEYS:
        return None
    if type(ok) is not bool:
        return None
    error = spec.get("error")
    result = spec.get("result")
    if not values_ok(result, _RESULT_DEPTH):
        return None
    if ok:
        if error is not None:
            return None
        return _NO_RESULT if result is None else Outcome.success(result)
    if result is not None:  # a failure with a result: refused by the strict path
        return None
    if type(error) is not dict or not error.keys() <= _ERROR_KEYS:
        return None
    code = error.get("code")
    message = error.get("message", "")
    retryable = error.get("retryable", True)
    if not short_text(code, _CODE_MAX) or type(retryable) is not bool:
        return None
    if type(message) is not str or len(message) > _MESSAGE_MAX or "\x00" in message:
        return None
    return Outcome.failure(code, message, retryable)


def read_finish_many(raw: dict[str, Any]) -> FinishBatch | None:
    """A ``finish_many`` in its usual shape, or None (see the module's docstring)."""
    items = _items(raw)
    if items is None:
        return None
    finishes: list[tuple[str, int, Outcome]] = []
    for item in items:
        if type(item) is not dict or len(item) != 3:
            return None
        attempt_id = item.get("attempt_id")
        fence = _fence(item.get("fence"))
        outcome = _outcome(item.get("outcome"))
        if fence is None or outcome is None or not short_text(attempt_id, _ID_MAX):
            return None
        finishes.append((attempt_id, fence, outcome))
    return FinishBatch(raw["req_id"], finishes)


#: the readers by message type
READERS: dict[str, Callable[[dict[str, Any]], StartBatch | FinishBatch | None]] = {
    "start_many": read_start_many,
    "finish_many": read_finish_many,
}


def start_batch(msg: StartMany) -> StartBatch:
    """A ``start_many`` the strict path decoded, as the reader would have read it."""
    return StartBatch(msg.req_id, [(item.attempt_id, int(item.fence)) for item in msg.items])


def finish_batch(msg: FinishMany) -> FinishBatch:
    """A ``finish_many`` the strict path decoded, as the reader would have read it;
    OrbitError (INVALID_ARGUMENT) if an outcome breaks ``outcome_of``'s rules, its
    ``field`` under ``items[<i>].outcome``."""
    return FinishBatch(
        msg.req_id,
        [
            (item.attempt_id, int(item.fence), outcome_of(item, f"items[{i}].outcome"))
            for i, item in enumerate(msg.items)
        ],
    )


def outcome_of(msg: Finish | FinishItem, where: str = "outcome") -> Outcome:
    """The outcome a decoded finish reports; OrbitError (INVALID_ARGUMENT, ``field`` the
    part at fault under ``where``) for a success with an error, a failure without one,
    or a failure with a result. A failure's result was dropped without a word (the task
    failed with no result), and the report's digest, which has no result for a failure,
    answered a repeat with another result with the first receipt, not ALREADY_FINISHED."""
    spec = msg.outcome
    if spec.ok:
        if spec.error is not None:
            raise _refused(f"{where}.error", "a successful outcome carries no error")
        return Outcome.success(spec.result)
    if spec.error is None:
        raise _refused(f"{where}.error", "a failed outcome needs an error")
    if spec.result is not None:
        raise _refused(f"{where}.result", "a failed outcome carries no result")
    return Outcome.failure(spec.error.code, spec.error.message, spec.error.retryable)


def _refused(field: str, rule: str) -> OrbitError:
    """An outcome's refusal, led by its field as the decoder's messages are."""
    return OrbitError(Code.INVALID_ARGUMENT, f"{field}: {rule}", field=field)
