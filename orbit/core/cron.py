"""Cron expressions in a time zone: when a schedule fires (docs/concepts.md, "Schedules").

An expression is the classic five fields (minute, hour, day of month, month, day of
week), read by ``croniter`` over *wall-clock* (naive local) times, its day fields
combined as Vixie cron combines them (``_iter``); this module maps each
local time to one UTC instant with ``zoneinfo``, so the rules at a DST change are ours
and written down here rather than a library's:

- a local time that does not exist (the hour skipped when clocks go forward) fires at
  the first instant after the gap: ``30 2 * * *`` in Europe/Berlin on the last Sunday of
  March fires at 03:00 CEST. Two local times that land on one instant fire once.
- a local time that happens twice (the hour repeated when clocks go back) fires once,
  at its first occurrence (``fold=0``, still on summer time).

Instants are microseconds since the epoch (UTC), as everywhere in ``orbit.core``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, croniter  # type: ignore[import-untyped]

from orbit.core.errors import Code, OrbitError

#: How far ``next_after``/``latest`` walk before they give an expression up: a valid
#: expression that never matches (``0 0 30 2 *``, 30 February) is refused at create.
MAX_STEPS = 10_000
#: the longest expression text taken
MAX_CRON_LEN = 200
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _bad_cron(expr: object, why: str) -> OrbitError:
    return OrbitError(
        Code.INVALID_CRON, f"cron {expr!r:.80} is not a cron expression: {why}", field="cron"
    )


def _iter(expr: str, start: datetime) -> croniter:
    """croniter over ``expr`` from ``start``, its two day fields read as Vixie cron
    reads them: both restricted, a day matching either matches (``0 0 1 * mon``: the
    1st and every Monday); either starting with ``*`` (``*/2`` too), a day must match
    both (``0 0 */2 * mon``: the odd-numbered Mondays). croniter's default ORs them
    whenever neither is exactly ``*``, which fired ``*/2`` every other day."""
    fields = expr.split()
    day_or = not (fields[2].startswith("*") or fields[4].startswith("*"))
    return croniter(expr, start, day_or=day_or)


def check_cron(expr: object) -> str:
    """A 5-field cron expression (no ``@daily`` macros, no seconds or years field), or
    INVALID_CRON."""
    if not isinstance(expr, str) or not expr.strip() or len(expr) > MAX_CRON_LEN:
        raise _bad_cron(expr, f"it must be 1-{MAX_CRON_LEN} characters")
    if not expr.isascii() or len(expr.split()) != 5:
        raise _bad_cron(expr, "it must have exactly 5 fields: minute hour day month weekday")
    try:
        _iter(expr, datetime(2000, 1, 1))
    except (CroniterBadCronError, ValueError, KeyError, TypeError) as exc:
        raise _bad_cron(expr, str(exc) or type(exc).__name__) from None
    return expr


#: Files of a zone database that ``ZoneInfo`` reads but that are no zone of their own:
#: ``localtime`` (and ``posixrules``) is the node's own configured zone, which each node
#: of a cluster may have set otherwise; ``right/`` zones count leap seconds, so their
#: instants are some 27 s off the database's clock; ``posix/`` copies the plain names.
_NOT_ZONES = frozenset({"localtime", "posixrules"})
_NOT_ZONE_PREFIXES = ("right/", "posix/")


def check_timezone(name: object) -> ZoneInfo:
    """An IANA time zone (``Europe/Berlin``, ``UTC``), or INVALID_TIMEZONE."""
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isascii():
        raise _bad_zone(name)
    if name in _NOT_ZONES or name.startswith(_NOT_ZONE_PREFIXES):
        raise _bad_zone(name)
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise _bad_zone(name) from None


def _bad_zone(name: object) -> OrbitError:
    return OrbitError(
        Code.INVALID_TIMEZONE,
        f"timezone {name!r:.80} is not an IANA time zone (e.g. UTC, Europe/Berlin)",
        field="timezone",
    )


def to_us(at: datetime) -> int:
    """An aware datetime as microseconds since the epoch."""
    return (at - _EPOCH) // timedelta(microseconds=1)


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def local_instant(local: datetime, zone: ZoneInfo) -> int:
    """The instant a naive local time fires at (the DST rules in the module's doc)."""
    late = local.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if late.astimezone(zone).replace(tzinfo=None) == local:
        return to_us(late)
    # In a gap: fold=0 read it with the offset from before the change, which lands past
    # the gap's end by the time into it; fold=1 with the offset after, which lands before
    # the change. Fire at the change itself: the first instant on the new offset,
    # found to the second between the two.
    early = local.replace(tzinfo=zone, fold=1).astimezone(UTC)
    after = late.astimezone(zone).utcoffset()
    lo, hi = to_us(early) // 1_000_000, to_us(late) // 1_000_000
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if from_us(mid * 1_000_000).astimezone(zone).utcoffset() == after:
            hi = mid
        else:
            lo = mid
    instant = from_us(hi * 1_000_000)
    return to_us(instant)


def next_after(expr: str, zone: ZoneInfo, after_us: int) -> int:
    """The first fire instant strictly after ``after_us``. INVALID_CRON if the expression
    never matches (within ``MAX_STEPS`` candidates)."""
    # Start an hour back in local time: an instant in a repeated hour (second pass) reads
    # as a local time whose fold=0 instant is an hour earlier.
    start = from_us(after_us).astimezone(zone).replace(tzinfo=None) - timedelta(hours=1)
    it = _iter(expr, start)
    try:
        for _ in range(MAX_STEPS):
            at = local_instant(it.get_next(datetime), zone)
            if at > after_us:
                return at
    except CroniterBadDateError:
        pass
    raise _bad_cron(expr, "it matches no date")


def latest(expr: str, zone: ZoneInfo, at_us: int, since_us: int, n: int) -> list[int]:
    """The last ``n`` fire instants in ``[since_us, at_us]``, oldest first, each once."""
    start = from_us(at_us).astimezone(zone).replace(tzinfo=None) + timedelta(hours=1)
    it = _iter(expr, start)
    found: list[int] = []
    try:
        for _ in range(MAX_STEPS):
            local = it.get_prev(datetime)
            instant = local_instant(local, zone)
            if instant > at_us:
                continue
            # Local times walk back one by one; the instants they map to do too, but for
            # a gap's times, which all share the gap's end: stop once well before since.
            if instant < since_us and (since_us - instant) > 3 * 3600 * 1_000_000:
                break
            if instant >= since_us and instant not in found:
                found.append(instant)
                if len(found) >= n:
                    break
    except CroniterBadDateError:
        pass
    return sorted(found)
