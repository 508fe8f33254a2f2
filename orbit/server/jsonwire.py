"""JSON responses encoded with orjson (``compact_json``): several times faster than the
standard library on the submit, batch and list routes, where encoding the reply costs as
much as storing the tasks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from orbit.core.model import compact_json


class FastJSONResponse(Response):
    media_type = "application/json"

    def __init__(
        self, content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)

    def render(self, content: Any) -> bytes:
        return compact_json(content)
