"""Conversions between wire values and the store's integers (no I/O)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from orbit.core.model import Token, parse_json

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def instant_to_wire(us: int | None) -> str | None:
    """Microseconds since the epoch as RFC 3339 in UTC, to the microsecond.

    Cached, instants and their seconds both: a transaction stamps every row it writes
    with one instant, so a batch of a thousand tasks repeats one value three thousand
    times (a hit costs a fifth of formatting it).
    """
    if us is None:
        return None
    return _instant_to_wire(us)


@lru_cache(maxsize=4096)
def _instant_to_wire(us: int) -> str:
    seconds, micros = divmod(us, 1_000_000)
    return f"{_second_to_wire(seconds)}.{micros:06d}Z"


@lru_cache(maxsize=4096)
def _second_to_wire(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


#: ``instant_to_wire`` of an instant that is never None: the cached formatter itself, for
#: the hot frames (a claimed task's claim expiry), without the call that checks for None
instant_text = _instant_to_wire


def instant_from_wire(text: str) -> int:
    return (datetime.fromisoformat(text) - EPOCH) // _US


def seconds_to_us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def us_to_seconds(us: int | None) -> float | None:
    return None if us is None else us / 1_000_000


def json_or_none(text: str | None) -> Any:
    return None if text is None else parse_json(text)


def token_wire(token: Token) -> dict[str, Any]:
    """A token as the API's ``TokenView`` spells it and ``orbit token ls --json`` prints
    it: RFC 3339 instants, never the secret nor its hash."""
    return {
        "id": token.id,
        "name": token.name,
        "scopes": list(token.scopes),
        "created_at": instant_to_wire(token.created_at),
        "revoked_at": instant_to_wire(token.revoked_at),
    }
