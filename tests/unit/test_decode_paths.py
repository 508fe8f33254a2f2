"""One spelling of a refusal's path: a list's index in brackets (``tasks[1].priority``),
whichever rule was broken. A bad value (pydantic's error) was named ``tasks.1.priority``
while an unknown field of the same task was ``tasks[1].Priority``, and a client parsing
``field`` had to know both."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel

from orbit.protocol.decode import DecodeError, decode_model
from orbit.protocol.messages import Hello, Renew, StartMany, TaskBatch

#: a path as refusals spell it: names joined by dots, each followed by any indexes
ONE_SPELLING = re.compile(r"[^.\[\]]+(\[\d+\])*(\.[^.\[\]]+(\[\d+\])*)*")

GOOD_TASK = {"queue": "q", "handler": "h"}
GOOD_CAP = {"handler": "h", "capacity": 1}


def _hello(*caps: dict[str, Any]) -> dict[str, Any]:
    return {"type": "hello", "req_id": "r", "name": "w", "max_concurrency": 1,
            "capabilities": list(caps)}  # fmt: skip


def _refusal(model: type[BaseModel], data: dict[str, Any]) -> DecodeError:
    with pytest.raises(DecodeError) as err:
        decode_model(model, data, parsed=True)
    return err.value


#: (model, message, code, field, whether the message leads with the field)
CASES: list[Any] = [
    pytest.param(TaskBatch, {"tasks": [GOOD_TASK, {**GOOD_TASK, "priority": 1_000_001}]},
                 "NUMBER_OUT_OF_RANGE", "tasks[1].priority", True, id="value"),
    pytest.param(TaskBatch, {"tasks": [GOOD_TASK, {**GOOD_TASK, "retry_safe": 1}]},
                 "INVALID_TYPE", "tasks[1].retry_safe", True, id="type"),
    pytest.param(TaskBatch, {"tasks": [GOOD_TASK, {"queue": "q"}]},
                 "MISSING_FIELD", "tasks[1].handler", True, id="missing"),
    pytest.param(TaskBatch, {"tasks": [GOOD_TASK, {**GOOD_TASK, "backoff": {"base": None}}]},
                 "NULL_NOT_ALLOWED", "tasks[1].backoff.base", True, id="null-nested"),
    pytest.param(TaskBatch, {"tasks": [GOOD_TASK, {**GOOD_TASK, "Priority": 1}]},
                 "FIELD_CASE_MISMATCH", "tasks[1].Priority", False, id="case"),
    pytest.param(TaskBatch, {"tasks": [GOOD_TASK, {**GOOD_TASK, "payload": {"a": [0, "\x00"]}}]},
                 "NUL_CHARACTER", "tasks[1].payload.a[1]", False, id="nul"),
    pytest.param(Hello, _hello(GOOD_CAP, {"handler": "h2", "capacity": 0}),
                 "NUMBER_OUT_OF_RANGE", "capabilities[1].capacity", True, id="hello-capacity"),
    pytest.param(StartMany, {"type": "start_many", "req_id": "r",
                             "items": [{"attempt_id": "a", "fence": "1"}, {"attempt_id": "b"}]},
                 "MISSING_FIELD", "items[1].fence", True, id="start_many-fence"),
    pytest.param(Renew, {"type": "renew", "req_id": "r", "attempt_ids": ["a", 7]},
                 "INVALID_TYPE", "attempt_ids[1]", True, id="renew-index-last"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "data", "code", "field", "leads"), CASES)
def test_a_list_item_is_named_by_its_index_in_brackets(
    model: type[BaseModel], data: dict[str, Any], code: str, field: str, leads: bool
) -> None:
    err = _refusal(model, data)
    assert (err.code, err.field) == (code, field), err
    assert ONE_SPELLING.fullmatch(field)
    if leads:  # a value's refusal says where in its message too, spelt the same
        assert err.message.startswith(f"{field}: "), err.message
    assert not re.search(r"\.\d", err.message), err.message
    assert err.as_json()["error"]["field"] == field
