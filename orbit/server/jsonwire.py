"""JSON responses encoded with orjson: several times faster than the standard library
on the submit, batch and list routes, where encoding the reply costs as much as storing
the tasks. Values orjson refuses (integers past 64 bits, which a payload may hold) fall
back to the standard library, so every value that was encodable still is."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response


def dumps(content: Any) -> bytes:
    try:
        return orjson.dumps(content)
    except TypeError:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")


class FastJSONResponse(Response):
    media_type = "application/json"

    def __init__(
        self, content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)

    def render(self, content: Any) -> bytes:
        return dumps(content)
