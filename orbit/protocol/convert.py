"""Conversions between wire values and the store's integers (no I/O)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def instant_to_wire(us: int | None) -> str | None:
    """Microseconds since the epoch as RFC 3339 in UTC, to the microsecond."""
    if us is None:
        return None
    return (
        (EPOCH + timedelta(microseconds=us))
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z")
    )


def instant_from_wire(text: str) -> int:
    return (datetime.fromisoformat(text) - EPOCH) // _US


def seconds_to_us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def us_to_seconds(us: int | None) -> float | None:
    return None if us is None else us / 1_000_000


def json_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)
