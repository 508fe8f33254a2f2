"""Cron expressions in a time zone (``orbit.core.cron``): the strict 5-field form of
classic (Vixie) cron, IANA zones, and the DST rules: a local time in a gap fires at the
gap's end; a repeated one fires once (its first occurrence) for a job at a particular
time, at each occurrence for one whose minute or hour field starts with ``*``."""

from __future__ import annotations

import sys
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from orbit.core.cron import (
    check_cron,
    check_timezone,
    from_us,
    latest,
    next_after,
    stored_zone,
    to_us,
)
from orbit.core.errors import Code, OrbitError

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def _utc(*args: int) -> int:
    return to_us(datetime(*args, tzinfo=UTC))


def _iso(at: int, zone: ZoneInfo) -> str:
    return from_us(at).astimezone(zone).isoformat()


def _walk(expr: str, zone: ZoneInfo, start: int, n: int) -> list[str]:
    out, at = [], start
    for _ in range(n):
        at = next_after(expr, zone, at)
        out.append(_iso(at, zone))
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


def test_a_repeated_local_time_fires_once_for_a_job_at_a_particular_time() -> None:
    """Vixie cron (cron(8)): a job at a particular time, no ``*`` starting its minute
    or hour field, is not run again in the hour repeated when clocks go back."""
    # New York, 2026-11-01: 02:00 EDT -> 01:00 EST. 01:30 happens twice.
    start = _utc(2026, 10, 31, 12, 0)
    assert _walk("30 1 * * *", NEW_YORK, start, 2) == [
        "2026-11-01T01:30:00-04:00",
        "2026-11-02T01:30:00-05:00",
    ]
    # a range or a list of hours and minutes is still a particular time
    assert _walk("0,30 1-2 * * *", NEW_YORK, _utc(2026, 11, 1, 4, 45), 5) == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-01T02:00:00-05:00",
        "2026-11-01T02:30:00-05:00",
        "2026-11-02T01:00:00-05:00",
    ]
    # Berlin, 2026-10-25: 03:00 CEST -> 02:00 CET. 02:30 happens twice.
    assert _walk("30 2 * * *", BERLIN, _utc(2026, 10, 24, 12, 0), 2) == [
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:30:00+01:00",
    ]
    # from inside the second pass, a particular time's next fire is after it
    inside = _utc(2026, 11, 1, 6, 10)  # 01:10 EST
    assert _iso(next_after("30 1 * * *", NEW_YORK, inside), NEW_YORK) == (
        "2026-11-02T01:30:00-05:00"
    )


def test_a_wildcard_minute_or_hour_runs_normally_through_the_repeated_hour() -> None:
    """Vixie cron: jobs with ``*`` starting the minute or hour field run normally: at
    each occurrence of a repeated local time, every real quarter hour for ``*/15``."""
    got = _walk("*/15 * * * *", NEW_YORK, _utc(2026, 11, 1, 4, 50), 9)
    assert got == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:15:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-01T01:45:00-04:00",
        "2026-11-01T01:00:00-05:00",
        "2026-11-01T01:15:00-05:00",
        "2026-11-01T01:30:00-05:00",
        "2026-11-01T01:45:00-05:00",
        "2026-11-01T02:00:00-05:00",
    ]
    assert _walk("0 * * * *", NEW_YORK, _utc(2026, 11, 1, 4, 50), 3) == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:00:00-05:00",
        "2026-11-01T02:00:00-05:00",
    ]
    # the hour field starred, the minute a particular one: still a wildcard job
    assert _walk("30 */2 * * *", BERLIN, _utc(2026, 10, 24, 23, 0), 3) == [
        "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:30:00+01:00",
        "2026-10-25T04:30:00+01:00",
    ]
    # from inside the second pass, the next fire is the second pass's next one
    inside = _utc(2026, 11, 1, 6, 10)  # 01:10 EST
    assert _iso(next_after("*/30 * * * *", NEW_YORK, inside), NEW_YORK) == (
        "2026-11-01T01:30:00-05:00"
    )
    # and from the last instant of the first pass, the first of the second
    last_first = _utc(2026, 11, 1, 5, 45)  # 01:45 EDT
    assert next_after("*/15 * * * *", NEW_YORK, last_first) == _utc(2026, 11, 1, 6, 0)


@pytest.mark.parametrize(
    ("expr", "zone", "night"),
    [
        ("*/15 * * * *", NEW_YORK, _utc(2026, 11, 1, 3)),
        ("* * * * *", NEW_YORK, _utc(2026, 11, 1, 3)),
        ("0 * * * *", BERLIN, _utc(2026, 10, 24, 22)),
        ("30 2 * * *", BERLIN, _utc(2026, 10, 24, 22)),
        ("0,30 1-2 * * *", NEW_YORK, _utc(2026, 11, 1, 3)),
        ("*/20 * * * *", BERLIN, _utc(2026, 3, 28, 22)),  # the spring gap
    ],
)
def test_latest_walks_back_through_a_dst_change_as_next_after_walks_forward(
    expr: str, zone: ZoneInfo, night: int
) -> None:
    """``latest`` (misfires) and ``next_after`` (each fire) agree on every instant of a
    night with a DST change, and ``latest`` keeps the latest ``n`` even where local
    times do not map to instants in order (the repeated hour's second pass)."""
    end = night + 5 * 3600 * 1_000_000
    forward, at = [], night - 1
    while (at := next_after(expr, zone, at)) <= end:
        forward.append(at)
    assert len(set(forward)) == len(forward) and forward == sorted(forward)
    assert latest(expr, zone, end, night, 10_000) == forward
    half = len(forward) // 2
    assert latest(expr, zone, end, forward[half], 10_000) == forward[half:]
    for n in (1, 3):
        for cut in forward:
            want = [f for f in forward if f <= cut][-n:]
            assert latest(expr, zone, cut, night, n) == want, (n, cut)


def test_latest_in_the_repeated_hour_counts_both_passes_of_a_wildcard() -> None:
    # New York: 06:00 UTC is 01:00 EST, the second pass
    got = latest("*/15 * * * *", NEW_YORK, _utc(2026, 11, 1, 6, 50), 0, 3)
    assert got == [_utc(2026, 11, 1, 6, m) for m in (15, 30, 45)]
    window = latest("*/15 * * * *", NEW_YORK, _utc(2026, 11, 1, 7), _utc(2026, 11, 1, 5), 100)
    assert len(window) == 9  # 01:00 EDT to 02:00 EST: eight in the repeated hour, and 02:00
    assert latest("30 1 * * *", NEW_YORK, _utc(2026, 11, 1, 12), _utc(2026, 11, 1), 5) == [
        _utc(2026, 11, 1, 5, 30)  # the first 01:30 only
    ]


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


#: Text croniter takes but classic (Vixie) cron does not, each with the field it names.
NOT_CLASSIC: list[tuple[str, str]] = [
    ("0 0 L * *", "day of month"),  # croniter: the last day of the month
    ("0 0 15W * *", "day of month"),  # the weekday nearest the 15th
    ("0 0 ? * *", "day of month"),  # Quartz's "no value"
    ("0 0 * * 5#2", "day of week"),  # the second Friday
    ("0 0 * * 5L", "day of week"),  # the last Friday
    ("0 0 * * L", "day of week"),
    ("H * * * *", "minute"),  # Jenkins' hashed
    ("H(0-29) * * * *", "minute"),
    ("R * * * *", "minute"),  # croniter's random
    ("0 22-2 * * *", "hour"),  # a range that wraps: croniter's 22-23 and 0-2
    ("0 0 * * fri-mon", "day of week"),
    ("*/0 * * * *", "minute"),
    ("1-5/0 * * * *", "minute"),
    ("*/60 * * * *", "minute"),  # a step longer than the field
    ("0 0 * * */8", "day of week"),
    ("0 0 0 * *", "day of month"),
    ("0 0 32 * *", "day of month"),
    ("0 0 * 13 *", "month"),
    ("0 0 * 0 *", "month"),
    ("0 0 * * 8", "day of week"),
    ("-1 * * * *", "minute"),
    ("+1 * * * *", "minute"),
    ("1.5 * * * *", "minute"),
    ("0x1 * * * *", "minute"),
    ("1,,2 * * * *", "minute"),
    (",1 * * * *", "minute"),
    ("1- * * * *", "minute"),
    ("1-2-3 * * * *", "minute"),
    ("*/ * * * *", "minute"),
    ("*/2/3 * * * *", "minute"),
    ("/5 * * * *", "minute"),
    ("** * * * *", "minute"),
    ("mon * * * *", "minute"),  # names only in the month and weekday fields
    ("0 0 1 mon *", "month"),
    ("0 0 1 * jan", "day of week"),
    ("0 0 * * monday", "day of week"),  # three letters, as cron
    ("0 0 * * mon/x", "day of week"),
    ("0 0 * * 1/mon", "day of week"),
]


@pytest.mark.parametrize(("expr", "field"), NOT_CLASSIC)
def test_text_beyond_classic_cron_is_refused_naming_its_field(expr: str, field: str) -> None:
    with pytest.raises(OrbitError) as err:
        check_cron(expr)
    assert (err.value.code, err.value.field) == (Code.INVALID_CRON, "cron")
    assert f"{field} field" in err.value.message, err.value.message


@pytest.mark.parametrize(
    "expr",
    [
        "*/15 0-23/2 1,15 jan-mar,DEC mon-fri",
        "5/15 * * * *",  # from 5 to the end, every 15
        "0 0 * * 7",
        "0 0 * * 0-7/3",
        "0 0 * * SUN,Sat",
        "0 0 * Jan/5 *",
        "05 00 01 01 *",
        "* *,1 * * *",
        "59 23 31 12 6",
    ],
)
def test_classic_cron_is_taken(expr: str) -> None:
    assert check_cron(expr) == expr


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("0 9 * * mon\u2013fri", "day of week field 'mon\u2013fri': '\u2013' (U+2013 EN DASH)"),
        ("0 9 * * 1-5\u200b", "day of week field '1-5\\u200b': '\\u200b' (U+200B ZERO WIDTH"),
        ("0 9 * \u0031\u20e3 *", "month field '1\u20e3': '\u20e3' (U+20E3 COMBINING"),
        ("* * * * \uff17", "day of week field '\uff17': '\uff17' (U+FF17 FULLWIDTH DIGIT"),
        # between two fields, it makes them one: no field to name
        ("0\u00a09 * * 1-5", ": '\\xa0' (U+00A0 NO-BREAK SPACE) is not ASCII"),
    ],
)
def test_a_character_that_is_not_ascii_is_named_not_miscounted_as_fields(
    expr: str, why: str
) -> None:
    """Pasted text brings look-alikes (an en dash for a hyphen) and invisible spaces:
    the refusal names the character and its field, rather than "exactly 5 fields"."""
    with pytest.raises(OrbitError) as err:
        check_cron(expr)
    assert (err.value.code, err.value.field) == (Code.INVALID_CRON, "cron")
    assert why in err.value.message and "5 fields" not in err.value.message, err.value.message


def test_the_text_is_kept_with_its_fields_one_space_apart() -> None:
    assert check_cron("  0  3\t* *   MON ") == "0 3 * * MON"


def _days(expr: str, n: int) -> list[str]:
    return [d[:10] for d in _walk(expr, ZoneInfo("UTC"), _utc(2026, 1, 1, 12), n)]


def test_classic_forms_croniter_reads_otherwise_fire_as_cron_reads_them() -> None:
    """croniter reads ``7-7`` and ``7/1`` in the day of week as every day; cron as
    Sunday (7 is Sunday, ``a/n`` is ``a-<last>/n``)."""
    sundays = ["2026-01-04", "2026-01-11", "2026-01-18"]
    assert _days("0 0 * * 7-7", 3) == sundays
    assert _days("0 0 * * 7/1", 3) == sundays
    assert _days("0 0 * * 6-7", 3) == ["2026-01-03", "2026-01-04", "2026-01-10"]
    assert _days("0 0 * * sun/3", 3) == ["2026-01-03", "2026-01-04", "2026-01-07"]  # 0, 3, 6
    # both day fields restricted, every day of the month OR Monday: every day
    assert _days("0 0 1-31 * mon", 3) == ["2026-01-02", "2026-01-03", "2026-01-04"]
    assert [d[11:16] for d in _walk("5/20 * * * *", ZoneInfo("UTC"), _utc(2026, 1, 1), 4)] == [
        "00:05",
        "00:25",
        "00:45",
        "01:05",
    ]


def test_text_an_older_orbit_stored_still_fires_as_croniter_reads_it() -> None:
    """The strict check is for what is written now: a schedule stored before it, with
    croniter's extensions, keeps firing (``L``: the last day of the month)."""
    utc = ZoneInfo("UTC")
    assert _days("0 0 L * *", 2) == ["2026-01-31", "2026-02-28"]
    assert latest("0 0 L * *", utc, _utc(2026, 3, 1), _utc(2026, 1, 1), 5) == [
        _utc(2026, 1, 31),
        _utc(2026, 2, 28),
    ]


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


@pytest.fixture
def no_system_zone_database() -> Iterator[None]:
    """As on a host without /usr/share/zoneinfo (python:*-alpine, distroless, Windows):
    ``zoneinfo`` has only the ``tzdata`` package to read."""
    zoneinfo.reset_tzpath(to=[])
    zoneinfo.ZoneInfo.clear_cache()
    try:
        yield
    finally:
        zoneinfo.reset_tzpath()
        zoneinfo.ZoneInfo.clear_cache()


@pytest.mark.parametrize("name", ["UTC", "Europe/Berlin", "America/Argentina/Salta"])
def test_zones_are_read_without_a_system_zone_database(
    no_system_zone_database: None, name: str
) -> None:
    """Orbit depends on ``tzdata`` (pyproject.toml), zoneinfo's own fallback."""
    assert str(check_timezone(name)) == name


def test_without_any_zone_database_the_refusal_says_so(
    no_system_zone_database: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should ``tzdata`` be missing after all, a refusal of UTC says the node lacks a
    database, not that UTC is no zone."""
    for module in [m for m in sys.modules if m.split(".")[0] == "tzdata"] + ["tzdata"]:
        monkeypatch.setitem(sys.modules, module, None)  # its import fails
    with pytest.raises(OrbitError) as err:
        check_timezone("UTC")
    assert (err.value.code, err.value.field) == (Code.INVALID_TIMEZONE, "timezone")
    assert "no time zone database" in err.value.message, err.value.message


@pytest.mark.parametrize("name", ["Europe", "Etc", "America/Argentina"])
def test_a_directory_of_the_zone_database_is_no_zone(
    no_system_zone_database: None, name: str
) -> None:
    """``tzdata`` opens a directory of its database where a system database is passed
    over: IsADirectoryError, an OSError, not ZoneInfoNotFoundError."""
    for check in (check_timezone, stored_zone):
        with pytest.raises(OrbitError) as err:
            check(name)
        assert (err.value.code, err.value.field) == (Code.INVALID_TIMEZONE, "timezone")


@pytest.mark.parametrize("name", ["localtime", "posixrules", "posix/UTC", "right/UTC"])
def test_a_zone_an_older_orbit_stored_still_loads(name: str) -> None:
    """``check_timezone`` refuses these for what is written now; a schedule an older
    Orbit stored with one keeps its zone (``stored_zone``), as far as the node's
    database has it (the ``tzdata`` package has none of them)."""
    try:
        ZoneInfo(name)
    except zoneinfo.ZoneInfoNotFoundError:
        pytest.skip(f"this host's zone database has no {name}")
    assert str(stored_zone(name)) == name
    with pytest.raises(OrbitError):
        check_timezone(name)
    with pytest.raises(OrbitError) as err:
        stored_zone("Mars/Olympus")
    assert err.value.code == Code.INVALID_TIMEZONE


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


@pytest.mark.parametrize(
    ("expr", "first"),
    [
        ("0 0 31 2 mon", _utc(2027, 2, 1)),  # 31 February (never) or a Monday in February
        ("0 0 30 2 mon", _utc(2027, 2, 1)),
        ("0 0 31 4 fri", _utc(2027, 4, 2)),  # 31 April (never) or a Friday in April
    ],
)
def test_a_day_of_month_that_never_comes_ored_with_a_weekday_fires_on_the_weekday(
    expr: str, first: int
) -> None:
    """Vixie cron: that day-of-month side adds no days; the weekday side still fires.
    croniter 6 refuses these as matching no date (hence pyproject's croniter>=7)."""
    assert next_after(expr, ZoneInfo("UTC"), _utc(2027, 1, 15)) == first


def test_latest_finds_a_leap_day_walking_back() -> None:
    """The 29th or Sundays: Tuesday 29 February 2028, seen an hour late, is among the
    last instants (croniter 6.0 passes it by, and a catch-up fire of it was lost)."""
    utc = ZoneInfo("UTC")
    got = latest("0 23 29 * sun", utc, _utc(2028, 3, 1), _utc(2028, 2, 20), 10)
    assert got == [_utc(2028, 2, 20, 23), _utc(2028, 2, 27, 23), _utc(2028, 2, 29, 23)]


def _offset(at: datetime, zone: ZoneInfo) -> timedelta:
    offset = at.astimezone(zone).utcoffset()
    assert offset is not None
    return offset


def _fall_back(zone: ZoneInfo, year: int) -> datetime:
    """The first instant of ``year`` at which the zone's clock is turned back."""
    day = datetime(year, 1, 1, tzinfo=UTC)
    while _offset(day + timedelta(days=1), zone) >= _offset(day, zone):
        day += timedelta(days=1)
    while _offset(day, zone) >= _offset(day - timedelta(days=1), zone):
        day += timedelta(minutes=1)
    return day


@pytest.mark.parametrize(
    "zone",
    [
        NEW_YORK,
        BERLIN,
        ZoneInfo("Australia/Lord_Howe"),  # back by half an hour
        ZoneInfo("Antarctica/Troll"),  # back by two hours
    ],
)
@pytest.mark.parametrize("expr", ["*/7 * * * *", "15,45 */2 * * *", "30 1 * * *", "0,30 1-3 * * *"])
def test_every_minute_of_a_fall_back_night_fires_by_the_rule(zone: ZoneInfo, expr: str) -> None:
    """Minute by minute over the eight hours around a change that turns the clock back,
    read independently of the module: a minute fires if its local time matches, and,
    for a local time that comes round again, the second time only if the minute or hour
    field starts with ``*``."""
    change = _fall_back(zone, 2026)
    minute, hour = expr.split()[:2]
    wildcard = minute.startswith("*") or hour.startswith("*")

    def matches(value: int, field: str, last: int) -> bool:
        for item in field.split(","):
            base, _, step = item.partition("/")
            first, _, end = base.partition("-")
            low = 0 if base == "*" else int(first)
            high = last if base == "*" or (step and not end) else int(end or first)
            if low <= value <= high and (value - low) % int(step or 1) == 0:
                return True
        return False

    want, at = [], change - timedelta(hours=4)
    while at <= change + timedelta(hours=4):
        local = at.astimezone(zone)
        matched = matches(local.minute, minute, 59) and matches(local.hour, hour, 23)
        # fold 1: the second time round for this local time
        if matched and (wildcard or local.fold == 0):
            want.append(to_us(at))
        at += timedelta(minutes=1)
    got, cursor = [], to_us(change - timedelta(hours=4)) - 1
    while (cursor := next_after(expr, zone, cursor)) <= want[-1]:
        got.append(cursor)
    assert got == want
    assert latest(expr, zone, want[-1], want[0], 10_000) == want
