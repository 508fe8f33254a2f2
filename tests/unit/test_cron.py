"""Cron expressions in a time zone (``orbit.core.cron``): the strict 5-field form, IANA
zones, and the DST rules: a local time in a gap fires at the gap's end, a repeated one
fires once (its first occurrence)."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from orbit.core.cron import check_cron, check_timezone, from_us, latest, next_after, to_us
from orbit.core.errors import Code, OrbitError

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def _utc(*args: int) -> int:
    return to_us(datetime(*args, tzinfo=UTC))


def _walk(expr: str, zone: ZoneInfo, start: int, n: int) -> list[str]:
    out, at = [], start
    for _ in range(n):
        at = next_after(expr, zone, at)
        out.append(from_us(at).astimezone(zone).isoformat())
    return out


def test_next_is_strictly_after_and_in_the_zone() -> None:
    at = _utc(2027, 1, 15, 8, 0)  # 09:00 in Berlin
    assert next_after("0 9 * * *", BERLIN, at) == _utc(2027, 1, 16, 8, 0)
    assert next_after("0 9 * * *", BERLIN, at - 1) == at
    assert next_after("*/15 * * * *", ZoneInfo("UTC"), at) == at + 15 * 60 * 1_000_000


def test_a_local_time_in_the_spring_gap_fires_at_the_gaps_end_once() -> None:
    # Berlin, 2026-03-29: 02:00 CET -> 03:00 CEST. 02:30 does not exist.
    start = _utc(2026, 3, 28, 12, 0)
    assert _walk("30 2 * * *", BERLIN, start, 2) == [
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]
    # 02:00, 02:30 (both in the gap) and 03:00 are one instant: it fires once.
    assert _walk("0,30 2,3 * * *", BERLIN, start, 3) == [
        "2026-03-29T03:00:00+02:00",
        "2026-03-29T03:30:00+02:00",
        "2026-03-30T02:00:00+02:00",
    ]


def test_a_repeated_local_time_in_autumn_fires_once() -> None:
    # New York, 2026-11-01: 02:00 EDT -> 01:00 EST. 01:30 happens twice.
    start = _utc(2026, 10, 31, 12, 0)
    assert _walk("30 1 * * *", NEW_YORK, start, 2) == [
        "2026-11-01T01:30:00-04:00",
        "2026-11-02T01:30:00-05:00",
    ]
    # Every half hour through the change: the second pass of 01:xx is not fired again.
    assert _walk("*/30 * * * *", NEW_YORK, _utc(2026, 11, 1, 4, 45), 4) == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-01T02:00:00-05:00",
        "2026-11-01T02:30:00-05:00",
    ]
    # From inside the second pass, the next fire is after it.
    inside = _utc(2026, 11, 1, 6, 10)  # 01:10 EST
    assert (
        from_us(next_after("*/30 * * * *", NEW_YORK, inside)).astimezone(NEW_YORK).isoformat()
        == "2026-11-01T02:00:00-05:00"
    )


def test_latest_is_the_last_n_oldest_first_within_the_window() -> None:
    utc = ZoneInfo("UTC")
    now = _utc(2027, 1, 15, 8, 10, 30)
    got = latest("* * * * *", utc, now, _utc(2027, 1, 15, 8, 0), 3)
    assert got == [_utc(2027, 1, 15, 8, m) for m in (8, 9, 10)]
    assert latest("* * * * *", utc, now, _utc(2027, 1, 15, 8, 9), 100) == [
        _utc(2027, 1, 15, 8, m) for m in (9, 10)
    ]
    assert latest("0 0 1 1 *", utc, now, _utc(2027, 1, 2), 5) == []


@pytest.mark.parametrize(
    "expr",
    [
        "",
        "   ",
        "* * * *",
        "* * * * * *",
        "60 * * * *",
        "* 24 * * *",
        "@hourly",
        "a b c d e",
        "* * * * \uff17",  # a full-width 7
        "x" * 300,
        None,
        5,
    ],
)
def test_bad_expressions_are_refused(expr: object) -> None:
    with pytest.raises(OrbitError) as err:
        check_cron(expr)
    assert (err.value.code, err.value.field) == (Code.INVALID_CRON, "cron")


def test_an_expression_that_never_matches_is_refused() -> None:
    assert check_cron("0 0 30 2 *") == "0 0 30 2 *"  # well-formed...
    with pytest.raises(OrbitError) as err:  # ...but 30 February never comes
        next_after("0 0 30 2 *", ZoneInfo("UTC"), 0)
    assert err.value.code == Code.INVALID_CRON


@pytest.mark.parametrize(
    "zone",
    [
        "",
        "Mars/Olympus",
        "../etc/passwd",
        "/etc/localtime",
        3,
        "é",
        # files of the node's zone database that are not zones of their own: the node's
        # own local zone (each node may have another), and the leap-second clock
        "localtime",
        "posixrules",
        "right/UTC",
        "right/Europe/Berlin",
        "posix/Europe/Berlin",
    ],
)
def test_bad_timezones_are_refused(zone: object) -> None:
    with pytest.raises(OrbitError) as err:
        check_timezone(zone)
    assert (err.value.code, err.value.field) == (Code.INVALID_TIMEZONE, "timezone")


def test_day_of_month_and_day_of_week_as_classic_cron_reads_them() -> None:
    """Vixie cron: when both day fields are restricted, a day matching either fires;
    when either starts with ``*`` (``*/2`` too), a day must match both. croniter's
    default (``day_or``) ORs whenever a field is not exactly ``*``."""
    utc = ZoneInfo("UTC")
    start = _utc(2026, 1, 1, 12, 0)  # a Thursday
    both = [d[:10] for d in _walk("0 0 1 * mon", utc, start, 3)]
    assert both == ["2026-01-05", "2026-01-12", "2026-01-19"]  # Mondays, or the 1st
    assert [d[:10] for d in _walk("0 0 1 * mon", utc, _utc(2026, 1, 27), 2)] == [
        "2026-02-01",  # a Sunday: the 1st
        "2026-02-02",
    ]
    # every odd day AND Monday: Jan 5, Jan 19, Feb 9 (Jan 12 and 26 are even)
    starred = [d[:10] for d in _walk("0 0 */2 * mon", utc, start, 3)]
    assert starred == ["2026-01-05", "2026-01-19", "2026-02-09"]
    # the weekday field starred (*/7: Sunday), a day must be in 1-7 AND a Sunday
    assert [d[:10] for d in _walk("0 0 1-7 * */7", utc, start, 2)] == [
        "2026-01-04",
        "2026-02-01",
    ]
    assert latest("0 0 */2 * mon", utc, _utc(2026, 1, 20), _utc(2026, 1, 1), 5) == [
        _utc(2026, 1, 5),
        _utc(2026, 1, 19),
    ]
