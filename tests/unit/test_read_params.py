"""The read API's two strict inputs, where they are parsed: an instant is RFC 3339 and
nothing else of ISO 8601 (``orbit.protocol.convert.rfc3339``: the task list's
``created_after``/``created_before``, a submit's ``deadline``/``run_after``), and an
events cursor is only a spelling the server issues (``orbit.server.routes.event_cursor``)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from orbit.protocol.convert import instant_from_wire, rfc3339
from orbit.protocol.decode import DecodeError, decode_model
from orbit.protocol.messages import TaskSubmit
from orbit.server.errors import ApiError
from orbit.server.routes import encode_cursor, event_cursor

#: 2026-01-01T00:00:00Z in microseconds since the epoch
NEW_YEAR = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp()) * 1_000_000

RFC3339 = [
    ("2026-01-01T00:00:00Z", NEW_YEAR),
    ("2026-01-01t00:00:00z", NEW_YEAR),  # the RFC lets T and Z be lowercase
    ("2026-01-01T00:00:00+00:00", NEW_YEAR),
    ("2026-01-01T00:00:00-00:00", NEW_YEAR),  # "offset unknown": still UTC
    ("2026-01-01T02:30:00+02:30", NEW_YEAR),
    ("2025-12-31T23:00:00-01:00", NEW_YEAR),
    ("2026-01-01T00:00:00.5Z", NEW_YEAR + 500_000),
    ("2026-01-01T00:00:00.000001Z", NEW_YEAR + 1),
    ("2026-01-01T00:00:00.1234569Z", NEW_YEAR + 123_456),  # to the microsecond
    ("2026-01-01T00:00:00.000000000000000000000Z", NEW_YEAR),
]

#: ISO 8601 (and other) spellings ``datetime.fromisoformat`` took that RFC 3339 does not
#: have, then texts it refused anyway
NOT_RFC3339 = [
    "2026-01-01",  # a date alone
    "2026-01-01T00:00:00",  # no offset: in no one's time zone
    "2026-01-01T00:00:00.5",
    "2026-W01-4T00:00:00Z",  # a week date
    "2026W014T000000Z",
    "20260101T000000Z",  # compact forms
    "2026-01-01T000000Z",
    "20260101T00:00:00Z",
    "2026-01-01T00:00Z",  # no seconds
    "2026-01-01T00Z",
    "2026-01-01 00:00:00Z",  # a space, or any other character, for T
    "2026-01-01X00:00:00Z",
    "2026-01-01T00:00:00,5Z",  # a comma for the point
    "2026-01-01T00:00:00.Z",  # a point without digits
    "2026-01-01T00:00:00+00",  # offsets without minutes, without the colon, with seconds
    "2026-01-01T00:00:00+0000",
    "2026-01-01T00:00:00+00:00:00",
    "2026-01-01T00:00:00+05:30:15.5",
    "2026-01-01T00:00:00+05:60",  # read as +06:00
    "2026-01-01T00:00:00+24:00",
    "2026-01-01T00:00:00ZZ",
    "2026-01-01T00:00:00Z\n",
    " 2026-01-01T00:00:00Z",
    "+2026-01-01T00:00:00Z",
    "2026-1-01T00:00:00Z",
    "\u0662\u0660\u0662\u0666-01-01T00:00:00Z",  # another script's digits
    "2026-02-30T00:00:00Z",  # no such day
    "2026-01-01T24:00:00Z",
    "2026-12-31T23:59:60Z",  # a leap second: no datetime holds one
    "",
    "yesterday",
]


@pytest.mark.parametrize(("text", "us"), RFC3339)
def test_an_rfc3339_date_time_is_read_to_the_microsecond(text: str, us: int) -> None:
    assert instant_from_wire(text) == us
    assert rfc3339(text).tzinfo is not None


@pytest.mark.parametrize("text", NOT_RFC3339)
def test_anything_else_is_no_instant(text: str) -> None:
    """Each was read by ``datetime.fromisoformat`` (or refused by it) as an instant:
    ``2026-01-01T00:00:00`` as one in no time zone, ``+05:60`` as ``+06:00``."""
    with pytest.raises(ValueError):
        instant_from_wire(text)


@pytest.mark.parametrize("field", ["deadline", "run_after"])
@pytest.mark.parametrize("text", NOT_RFC3339)
def test_a_submit_refuses_an_instant_that_is_not_rfc3339(field: str, text: str) -> None:
    """A submit's instants are read by the same rule as the task list's filters."""
    with pytest.raises(DecodeError) as refused:
        decode_model(TaskSubmit, {"queue": "q", "handler": "h", field: text}, parsed=True)
    assert (refused.value.code, refused.value.field) == ("INVALID_VALUE", field)


def test_a_submit_takes_every_rfc3339_spelling() -> None:
    for text, _ in RFC3339:
        task = decode_model(
            TaskSubmit, {"queue": "q", "handler": "h", "deadline": text}, parsed=True
        )
        assert task.deadline == text


@pytest.mark.parametrize(
    ("text", "position"),
    [
        ("0.1", (0, 1)),  # SQLite's events, and PostgreSQL's from before migration 0008
        ("0.9223372036854775807", (0, 2**63 - 1)),
        ("812.1", (812, 1)),
        ("9223372036854775807.40", (2**63 - 1, 40)),
        ("7", (0, 7)),  # a bare id: a cursor issued before migration 0008
    ],
)
def test_an_events_cursor_as_the_server_spells_it_is_a_position(
    text: str, position: tuple[int, int]
) -> None:
    assert event_cursor(text) == position


def test_no_cursor_is_the_start() -> None:
    assert event_cursor(None) == (0, 0)


@pytest.mark.parametrize(
    "text",
    [
        "0",  # read as the start: the server issues no such cursor (leave it out)
        "0.0",
        "00.00",
        "00",
        "0.00",
        "5.0",  # no event has id 0
        "05",  # leading zeros: event 5, spelt as the server never does
        "0.05",
        "00.5",
        "012.5",
        "12.005",
        "+5",
        "1.+5",
        "-1.5",
        " 5",
        "5 ",
        "1_0",
        "1e3",
        "0x10",
        "1.",
        ".1",
        "1..2",
        "1.2.3",
        "\u0661\u0662",
        "1.\u0662",
        "\u00b2",
        str(2**63),
        f"{2**63}.1",
        f"1.{2**63}",
        "",
    ],
)
def test_any_other_spelling_is_an_invalid_cursor(text: str) -> None:
    with pytest.raises(ApiError) as refused:
        event_cursor(text)
    error = refused.value
    assert (error.status, error.code, error.field) == (400, "INVALID_CURSOR", "cursor")


def test_the_cursors_the_server_issues_are_read_back() -> None:
    """What ``event_position_cursor`` writes for an event row, read back to its row's
    position: the canonical form above is the only one issued."""
    from orbit.server.routes import decode_cursor, event_position_cursor

    for xid, event_id in ((0, 1), (0, 12345), (7, 1), (2**63 - 1, 2**63 - 1)):
        cursor = event_position_cursor({"xid": xid, "id": event_id})
        assert cursor == encode_cursor(f"{xid}.{event_id}")
        assert event_cursor(decode_cursor(cursor)) == (xid, event_id)
