"""Cron expressions in a time zone: when a schedule fires (docs/concepts.md, "Schedules").

An expression is the classic five fields of Vixie cron (minute, hour, day of month,
month, day of week), read by this module's own parser (``_parse_field``), which
takes that syntax and nothing else (``check_cron``): ``croniter``, which walks the
matching times, reads extensions (``L``, ``W``, ``#``, ``?``, ``H``, ``R``) and a few
classic forms its own way (``7-7``, ``7/1`` in the day of week are every day to it,
Sunday to cron). So croniter is given the parsed fields rewritten as plain lists of
numbers, its day fields combined as Vixie cron combines them (``_reading``). Text that
an older Orbit stored unchecked and this parser refuses is still read, as croniter
reads it.

Times are *wall-clock* (naive local) times; this module maps each to UTC instants with
``zoneinfo``, so the rules at a DST change are ours and written down here rather than a
library's:

- a local time that does not exist (the hour skipped when clocks go forward) fires at
  the first instant after the gap: ``30 2 * * *`` in Europe/Berlin on the last Sunday of
  March fires at 03:00 CEST. Two local times that land on one instant fire once.
- a local time that happens twice (the hour repeated when clocks go back) fires as
  Vixie cron runs it (cron(8)): an expression whose minute or hour field starts with
  ``*`` (``*``, ``*/15``: ``_Reading.wildcard_time``) fires at both occurrences, so
  ``*/15 * * * *`` fires every 15 real minutes through the night; any other (a job at
  a particular time: ``30 1 * * *``, ``0 1-3 * * *``) fires once, at the first
  occurrence (``fold=0``, still on summer time).

Instants are microseconds since the epoch (UTC), as everywhere in ``orbit.core``.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter  # type: ignore[import-untyped]

from orbit.core.errors import Code, OrbitError

#: How far ``next_after``/``latest`` walk before they give an expression up: a valid
#: expression that never matches (``0 0 30 2 *``, 30 February) is refused at create.
MAX_STEPS = 10_000
#: the longest expression text taken
MAX_CRON_LEN = 200
#: the longest time zone name taken (the IANA database's longest is 32)
MAX_TIMEZONE_LEN = 64
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Further than any DST change moves a zone's clock (2 hours at most, Antarctica/Troll):
#: ``_offsets`` looks this far either side of an instant for the offsets around it.
_SHIFT = timedelta(hours=3)


@dataclass(frozen=True, slots=True)
class _Field:
    """One of the five fields: its name (for messages), its numbers, and its names
    (``names[i]`` is the number ``first + i``), as Vixie cron reads them."""

    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    first: int = 0


_FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day of month", 1, 31),
    _Field(
        "month",
        1,
        12,
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
        1,
    ),
    # 0 and 7 are both Sunday
    _Field("day of week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat"), 0),
)
_DIGITS = re.compile(r"[0-9]+")


class _NotClassic(ValueError):
    """A field that is not classic cron; its message says why."""


def _bad_cron(expr: object, why: str) -> OrbitError:
    return OrbitError(
        Code.INVALID_CRON, f"cron {expr!r:.80} is not a cron expression: {why}", field="cron"
    )


def _value(text: str, field: _Field) -> int:
    """A number in the field's range, or (month, day of week) a three-letter name in
    any case, as Vixie cron's ``get_number``."""
    if _DIGITS.fullmatch(text):
        number = int(text)
        if not field.low <= number <= field.high:
            raise _NotClassic(f"{text} is not in {field.low}-{field.high}")
        return number
    if text.lower() in field.names:
        return field.names.index(text.lower()) + field.first
    named = f" or a name {field.names[0]}-{field.names[-1]}" if field.names else ""
    raise _NotClassic(f"{text!r:.20} is not a number{named}")


def _parse_field(text: str, field: _Field) -> frozenset[int]:
    """The numbers one field matches: a comma list of ``*``, ``n`` and ``a-b`` (a ≤ b:
    cron's ranges do not wrap), each with an optional ``/step`` (1 to the field's
    highest number); ``n/step`` is ``n-<highest>/step`` (cron 4.1, cronie). The day of
    week's 7 is read as 0, Sunday."""
    values: set[int] = set()
    for item in text.split(","):
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not _DIGITS.fullmatch(step_text) or not 1 <= int(step_text) <= field.high:
                raise _NotClassic(f"the step {step_text!r:.20} is not in 1-{field.high}")
            step = int(step_text)
        if base == "*":
            start, end = field.low, field.high
        elif "-" in base:
            first, _, last = base.partition("-")
            start, end = _value(first, field), _value(last, field)
            if start > end:
                raise _NotClassic(f"the range {base!r:.20} runs backwards")
        else:
            start = _value(base, field)
            end = field.high if slash else start
        values.update(range(start, end + 1, step))
    if field.high == 7 and 7 in values:
        values = (values - {7}) | {0}
    return frozenset(values)


def _parse(fields: list[str]) -> list[frozenset[int]]:
    """Each field's numbers, or INVALID_CRON naming the first field that is not
    classic cron."""
    parsed = []
    for text, field in zip(fields, _FIELDS, strict=True):
        try:
            parsed.append(_parse_field(text, field))
        except _NotClassic as exc:
            raise _bad_cron(
                " ".join(fields), f"its {field.name} field {text!r:.40}: {exc}"
            ) from None
    return parsed


def check_cron(expr: object) -> str:
    """A classic 5-field cron expression (Vixie cron's syntax: ``_parse_field``; no
    ``@daily`` macros, no seconds or years field, none of croniter's extensions), its
    fields one space apart (the text stored), or INVALID_CRON naming the bad field. The
    length is checked first, here rather than by the HTTP model, so that an empty or
    over-long text is INVALID_CRON as any other bad text is, and no longer one is parsed."""
    if not isinstance(expr, str) or not expr.strip():
        raise _bad_cron(expr, f"it must be 1-{MAX_CRON_LEN} characters, not all spaces")
    if len(expr) > MAX_CRON_LEN:
        raise _bad_cron(expr, f"it is {len(expr)} characters, over {MAX_CRON_LEN}")
    if not expr.isascii():
        raise _bad_cron(expr, _not_ascii(expr))
    fields = expr.split()
    if len(fields) != 5:
        raise _bad_cron(expr, "it must have exactly 5 fields: minute hour day month weekday")
    _parse(fields)
    return " ".join(fields)


def _not_ascii(expr: str) -> str:
    """Why ``expr``, not all ASCII, is refused: its first other character, by code point
    and name, and the field it is in when the text has five fields around it. Such a
    character is most often pasted with the text (an en dash for the hyphen of
    ``mon-fri``, a no-break or zero-width space), invisible or alike to the eye, so
    "exactly 5 fields" would send its author counting fields the text has."""
    char = next(c for c in expr if not c.isascii())
    why = f"{char!r} (U+{ord(char):04X} {unicodedata.name(char, 'unnamed')}) is not ASCII"
    # Fields apart on ASCII white space only: a non-ASCII space stays in a field (and
    # joins two into one, so that no field can be named).
    fields = re.findall(r"\S+", expr, re.ASCII)
    if len(fields) == 5:
        for field, text in zip(_FIELDS, fields, strict=True):
            if not text.isascii():
                return f"its {field.name} field {text!r:.40}: {why}"
    return why


@dataclass(frozen=True, slots=True)
class _Reading:
    """How ``croniter`` is to read an expression (``_reading``)."""

    #: the text given to croniter: each classic field as the list of its numbers
    text: str
    #: the day fields ORed (both restricted) rather than ANDed
    day_or: bool
    #: the minute or hour field starts with ``*``: fires at both passes of a repeated
    #: local time (the module's doc)
    wildcard_time: bool


@lru_cache(maxsize=1024)
def _reading(expr: str) -> _Reading:
    """``expr`` for croniter. A classic expression is handed over as its fields' lists
    of numbers (``*`` as is), so croniter's reading of ranges, steps, names and 7 never
    matters; text an older Orbit stored unchecked goes as it was, read as croniter
    reads it. The day fields are combined as Vixie cron combines them: both restricted,
    a day matching either matches (``0 0 1 * mon``: the 1st and every Monday); either
    starting with ``*`` (``*/2`` too), a day must match both (``0 0 */2 * mon``: the
    odd-numbered Mondays). croniter's own default ORs them whenever neither is exactly
    ``*``, which fired ``*/2`` every other day; its OR needs croniter 7 (pyproject's
    floor), as 6.x finds no date for one side that never comes (``0 0 31 2 mon``), where
    Vixie cron fires the other. Vixie cron's ``*`` flags, which ``wildcard_time``
    follows too, are set by a field's first character."""
    fields = expr.split()
    try:
        parsed = _parse(fields)
    except OrbitError:
        text = expr
    else:
        text = " ".join(
            "*" if f == "*" else ",".join(map(str, sorted(v)))
            for f, v in zip(fields, parsed, strict=True)
        )
    return _Reading(
        text=text,
        day_or=not (fields[2].startswith("*") or fields[4].startswith("*")),
        wildcard_time=fields[0].startswith("*") or fields[1].startswith("*"),
    )


#: Files of a zone database that ``ZoneInfo`` reads but that are no zone of their own:
#: ``localtime`` (and ``posixrules``) is the node's own configured zone, which each node
#: of a cluster may have set otherwise; ``right/`` zones count leap seconds, so their
#: instants are some 27 s off the database's clock; ``posix/`` copies the plain names.
_NOT_ZONES = frozenset({"localtime", "posixrules"})
_NOT_ZONE_PREFIXES = ("right/", "posix/")


def check_timezone(name: object) -> ZoneInfo:
    """An IANA time zone (``Europe/Berlin``, ``UTC``) given now, or INVALID_TIMEZONE.
    The length is checked first, here rather than by the HTTP model (as ``check_cron``'s)."""
    if isinstance(name, str) and len(name) > MAX_TIMEZONE_LEN:
        raise OrbitError(
            Code.INVALID_TIMEZONE,
            f"timezone {name!r:.80} is {len(name)} characters, over {MAX_TIMEZONE_LEN}: "
            "not an IANA time zone (e.g. UTC, Europe/Berlin)",
            field="timezone",
        )
    if not isinstance(name, str) or not name or not name.isascii():
        raise _bad_zone(name)
    if name in _NOT_ZONES or name.startswith(_NOT_ZONE_PREFIXES):
        raise _bad_zone(name)
    return stored_zone(name)


def stored_zone(name: str) -> ZoneInfo:
    """The zone a stored schedule names, or INVALID_TIMEZONE if this node cannot load it.
    ``check_timezone``'s refusals are for what is written now: a zone an older Orbit
    took (``localtime``, ``right/UTC``) still loads and fires, as stored cron text does,
    rather than leave its schedule never to fire, resume or update again."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        # OSError: a directory of the database (``Europe``, ``America/Argentina``), which
        # the ``tzdata`` package opens, IsADirectoryError, where a system database is
        # passed over as not found
        raise _bad_zone(name) from None


def _bad_zone(name: object) -> OrbitError:
    why = "is not an IANA time zone (e.g. UTC, Europe/Berlin)"
    if not _has_zone_database():
        why = "cannot be read: this node has no time zone database (install tzdata)"
    return OrbitError(Code.INVALID_TIMEZONE, f"timezone {name!r:.80} {why}", field="timezone")


def _has_zone_database() -> bool:
    """Whether ``zoneinfo`` finds a database (the host's, or the ``tzdata`` package's),
    so that a refusal does not call UTC no time zone where there is none to read."""
    try:
        ZoneInfo("UTC")
    except ZoneInfoNotFoundError:
        return False
    return True


def to_us(at: datetime) -> int:
    """An aware datetime as microseconds since the epoch."""
    return (at - _EPOCH) // timedelta(microseconds=1)


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def local_instant(local: datetime, zone: ZoneInfo) -> int:
    """The instant a naive local time fires at, its first occurrence if it has two (the
    DST rules in the module's doc; ``_instants`` adds the second where it fires too)."""
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


def _instants(local: datetime, zone: ZoneInfo, twice: bool) -> tuple[int, ...]:
    """The instants a naive local time fires at: ``local_instant``'s, and (``twice``,
    a wildcard expression) its second occurrence too if the clock passes it twice."""
    first = local_instant(local, zone)
    if twice:
        second = to_us(local.replace(tzinfo=zone, fold=1).astimezone(UTC))
        if second > first and from_us(second).astimezone(zone).replace(tzinfo=None) == local:
            return first, second
    return (first,)


def _offsets(at_us: int, zone: ZoneInfo) -> list[timedelta]:
    """The zone's UTC offsets in force around ``at_us`` (a DST change within
    ``_SHIFT`` either side of it included)."""
    at = from_us(at_us)
    found = [(at + d).astimezone(zone).utcoffset() for d in (-_SHIFT, timedelta(0), _SHIFT)]
    return [o for o in found if o is not None]


# Both walks below rest on one order. Read at its first occurrence (``local_instant``),
# a later local time is never an earlier instant (a gap's times share its end). A second
# occurrence breaks the order, as the repeated hour's second pass is later than its
# first pass's later times; but it comes before the first instant of any local time after
# the repeated hour. So once a walk meets a local time that fires once, every local time
# beyond it fires beyond that instant too (further on in time, in the walk's direction).


def next_after(expr: str, zone: ZoneInfo, after_us: int) -> int:
    """The first fire instant strictly after ``after_us``. INVALID_CRON if the expression
    never matches (within ``MAX_STEPS`` candidates)."""
    reading = _reading(expr)
    # The earliest local time that can fire after ``after_us``: read with the smallest
    # offset around it (on the repeated hour's first pass, the local time an instant
    # will read as in the second pass).
    start = (from_us(after_us) + min(_offsets(after_us, zone))).replace(tzinfo=None)
    it = croniter(reading.text, start - timedelta(minutes=1), day_or=reading.day_or)
    best: int | None = None
    try:
        for _ in range(MAX_STEPS):
            first, *second = _instants(it.get_next(datetime), zone, reading.wildcard_time)
            for at in second:
                if at > after_us and (best is None or at < best):
                    best = at
            if first > after_us:
                return first if best is None else min(best, first)
    except CroniterBadDateError:
        pass
    raise _bad_cron(expr, "it matches no date")


def latest(expr: str, zone: ZoneInfo, at_us: int, since_us: int, n: int) -> list[int]:
    """The last ``n`` fire instants in ``[since_us, at_us]``, oldest first, each once."""
    reading = _reading(expr)
    # The latest local time that can fire at or before ``at_us`` (as in next_after).
    start = (from_us(at_us) + max(_offsets(at_us, zone))).replace(tzinfo=None)
    it = croniter(reading.text, start + timedelta(minutes=1), day_or=reading.day_or)
    found: set[int] = set()
    try:
        for _ in range(MAX_STEPS):
            got = _instants(it.get_prev(datetime), zone, reading.wildcard_time)
            found.update(at for at in got if since_us <= at <= at_us)
            if len(got) == 1:
                # Every local time before this one fires before it (the order above):
                # once it is before the window, or the latest n found, none can count.
                floor = since_us if len(found) < n else sorted(found)[-n]
                if got[0] < floor:
                    break
    except CroniterBadDateError:
        pass
    return sorted(found)[-n:]
