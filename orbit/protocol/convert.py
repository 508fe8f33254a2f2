"""Conversions between wire values and the store's integers (no I/O)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from orbit.core.model import Token, instant_text, parse_json

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
    return instant_text(us)


#: RFC 3339's ``date-time`` (section 5.6): a full date, ``T``, hours, minutes and seconds,
#: an optional fraction, and an offset, ``Z`` or ``±hh:mm`` (``T`` and ``Z`` may be
#: lowercase, as the RFC allows); ASCII digits only
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?"
    r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)


def rfc3339(text: str) -> datetime:
    """An RFC 3339 date-time as an aware datetime, to the microsecond (finer digits are
    dropped); ValueError for any other text, and for a date or a time that does not exist
    (a leap second too: no datetime holds it). ``datetime.fromisoformat`` alone takes
    ISO 8601's other forms as well: a date or a time without an offset (an instant in no
    one's time zone), week dates (``2026-W01-1T00:00:00Z``), compact ones
    (``20260101T000000Z``), a space or any other character for ``T``, minutes or seconds
    left out, a comma for the point, offsets such as ``+05``, ``+0530`` or ``+05:30:15``,
    and ``+05:60`` read as ``+06:00``."""
    if not isinstance(text, str) or not _RFC3339.fullmatch(text):
        raise ValueError("not an RFC 3339 date-time with an offset")
    return datetime.fromisoformat(text.upper())


def instant_from_wire(text: str) -> int:
    """An RFC 3339 date-time (``rfc3339``) as microseconds since the epoch."""
    return (rfc3339(text) - EPOCH) // _US


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
