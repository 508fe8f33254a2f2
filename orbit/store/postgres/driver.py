"""PostgreSQL driver over a psycopg 3 connection pool.

Named queries are written with ``:name`` parameters and translated once to psycopg's
``%(name)s``. A ``*_many`` write reads its rows with ``json_to_recordset(CAST(:rows AS
json)) AS x(column type, ...)``: one statement, one round trip. The driver sends them
column by column instead whenever it safely can (``columnar_sql``): one parameter per
column, the values joined by a separator that ``string_to_array`` splits, a fraction of
what parsing the rows' JSON costs PostgreSQL (which builds a hash table for every row's
object: 40 % of a start or finish batch's write). Every such write is also given its row
count as ``:rows_n``: an update reads its rows through ``LIMIT :rows_n``, because the
planner otherwise guesses 100 rows from the function and, on a table of a few thousand
rows, scans all of it to update ten (docs/operations.md, "Query plans"). The clock is
``clock_timestamp()`` read inside the transaction after the rows it judges are locked.
"""

from __future__ import annotations

import re
import select
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any, Self, TypeVar, cast

import orjson
import psycopg
from psycopg import conninfo, pq
from psycopg.adapt import Transformer
from psycopg.pq import ConnStatus, ExecStatus, TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from orbit.core.model import compact_json, parse_json
from orbit.store.driver import (
    DATABASE_BUSY,
    DATABASE_FULL,
    DATABASE_READ_ONLY,
    DATABASE_UNAVAILABLE,
    DatabaseUnavailable,
    Notice,
    Params,
    Row,
    RowColumns,
    StaleWrite,
    Table,
    load_queries,
)
from orbit.store.postgres.plans import PlanWatch

_HERE = Path(__file__).parent
_PARAM_RE = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def to_psycopg(sql: str) -> str:
    """``:name`` -> ``%(name)s``, leaving ``::casts`` and literal ``%`` intact."""
    return _PARAM_RE.sub(r"%(\1)s", sql.replace("%", "%%"))


#: The separator between a column's values and the spelling of NULL in ``string_to_array``
#: (ASCII unit and record separators: JSON text, ids and names never hold them).
COLUMN_SEP = "\x1f"
COLUMN_NULL = "\x1e"
_RECORDSET_RE = re.compile(r"json_to_recordset\(CAST\(%\(rows\)s AS json\)\) AS x\(([^()]*)\)")
_NUMBERS = frozenset({"bigint", "integer", "double precision"})

Columns = tuple[tuple[str, str], ...]

#: The SQLSTATE ``orbit_stale_write`` (migration 6) raises: a guarded write that is a
#: transaction's last statement matched fewer rows than planned (``commit_with``).
STALE_WRITE_SQLSTATE = "OR409"

#: Fewer rows than this travel as JSON: for a row or two, PostgreSQL parses the JSON in a
#: few microseconds, and splitting them into columns costs this process more (25 µs for
#: a task's 31 columns, against 2 µs for orjson).
COLUMNAR_MIN_ROWS = 8


def columnar_sql(sql: str) -> tuple[str, Columns] | None:
    """The column-by-column form of a query that reads ``json_to_recordset(CAST(:rows AS
    json)) AS x(...)``, and its columns; None for any other query. Each column becomes a
    parameter ``rows__<column>``, split by ``string_to_array`` and cast to its type, and
    ``unnest`` zips the arrays back into rows, in order."""
    found = _RECORDSET_RE.search(sql)
    if found is None:
        return None
    columns = tuple(
        (name, kind.strip())
        for name, _, kind in (d.strip().partition(" ") for d in found.group(1).split(","))
    )
    if len(columns) < 2:  # rows_columns reads each row's columns as a tuple
        return None
    for name, kind in columns:
        if kind not in _NUMBERS | {"text", "boolean"}:
            raise ValueError(f"no columnar form for a {kind} column ({name})")
    arrays = ", ".join(
        f"CAST(string_to_array(%(rows__{name})s, chr(31), chr(30)) AS text[])"
        if kind == "text"
        else f"CAST(string_to_array(%(rows__{name})s, ',', 'null') AS {kind}[])"
        for name, kind in columns
    )
    names = ", ".join(name for name, _ in columns)
    return sql[: found.start()] + f"unnest({arrays}) AS x({names})" + sql[found.end() :], columns


def _column(values: Sequence[Any], kind: str) -> str | None:
    """One column's values as ``string_to_array`` reads them, joined in C where it can
    be (a batch has hundreds of rows); None if a text value could be misread: it holds
    the separator or the NULL spelling, or it is a lone empty string, which
    ``string_to_array`` reads as no element at all.

    The two characters are looked for in the values' plain concatenation, which ``in``
    scans with ``memchr``: counting them in the joined text, as this did, walked every
    character twice, one at a time (31 → 7 µs for a column of 200 receipts; a batch of
    200 finishes writes about 1 KB of text columns per task)."""
    if kind != "text":  # numbers and booleans: orjson spells them as PostgreSQL reads them
        try:
            return orjson.dumps(values)[1:-1].decode("ascii")  # "1,null,3"
        except TypeError:  # an integer past 64 bits
            return None
    try:
        if None in values:
            text = COLUMN_SEP.join([COLUMN_NULL if v is None else v for v in values])
        else:
            text = COLUMN_SEP.join(values)
        plain = "".join(filter(None, values))  # every value, nothing between them
    except TypeError:  # a value that is not a string
        return None
    if COLUMN_SEP in plain or COLUMN_NULL in plain or not text:
        return None
    return text


def rows_columns(rows: Sequence[Row], columns: Columns) -> dict[str, str] | None:
    """The rows as ``columnar_sql``'s parameters, or None if any value must go as JSON
    (``_column``) or a row lacks a column, or there are no rows."""
    if not rows:
        return None
    table: Sequence[Sequence[Any]]
    try:
        if isinstance(rows, RowColumns):  # already a list per column
            table = [rows.columns[name] for name, _ in columns]
        else:
            table = list(zip(*map(itemgetter(*(name for name, _ in columns)), rows), strict=True))
    except KeyError:
        return None
    params: dict[str, str] = {}
    for (name, kind), values in zip(columns, table, strict=True):
        text = _column(values, kind)
        if text is None:
            return None
        params[f"rows__{name}"] = text
    return params


#: The suffix of a batched write's uniform form (``uniform_forms``), and the prefix of
#: the parameters in which it reads a column's one value.
UNIFORM_SUFFIX = "_uniform"
_ONE_RE = re.compile(r"%\(one__(\w+)\)s")

#: A uniform form: its query's name, the columns it reads as one value each, and the
#: columns of the write's rows it does not read at all, which must be NULL in every row.
Uniform = tuple[str, tuple[str, ...], tuple[str, ...]]


def uniform_forms(
    queries: dict[str, str], columnar: dict[str, tuple[str, Columns]]
) -> dict[str, Uniform]:
    """Each batched write that has a uniform form, by the write's name: a query named
    after it with ``UNIFORM_SUFFIX`` that reads some of its columns once, as
    ``:one__<column>``, for rows in which each of them holds one value (``uniform_params``).
    Such a column is then one parameter where the write's own form sends an array of a
    value per row, which PostgreSQL splits and casts row by row."""
    forms: dict[str, Uniform] = {}
    for name, sql in queries.items():
        base = name.removesuffix(UNIFORM_SUFFIX)
        if base == name or base not in columnar or name not in columnar:
            continue
        ones = tuple(dict.fromkeys(_ONE_RE.findall(sql)))
        read = {column for column, _ in columnar[name][1]} | set(ones)
        every = tuple(column for column, _ in columnar[base][1])
        if not ones or not read <= set(every):
            raise ValueError(f"{name} reads columns {base} has not")
        forms[base] = (name, ones, tuple(c for c in every if c not in read))
    return forms


def uniform_params(rows: Sequence[Row], uniform: Uniform) -> dict[str, Any] | None:
    """The ``:one__<column>`` parameters of a uniform form for these rows, or None if it
    does not fit them: rows not held by column (``RowColumns``), fewer than
    ``COLUMNAR_MIN_ROWS`` of them, a column it reads once holding more than one value,
    or a column it does not read holding anything but NULL. Values are the same when
    equal (``list.count``, in C: a type check per value would cost a batch of 1,000
    tasks about 0.3 ms); equal values of a column's kind are one stored value (1 and
    1.0 are one ``double precision``, as orjson's ``1`` and ``1.0`` were)."""
    if not isinstance(rows, RowColumns) or len(rows) < COLUMNAR_MIN_ROWS:
        return None
    _, ones, nulls = uniform
    columns = rows.columns
    params: dict[str, Any] = {}
    try:
        for column in nulls:
            if columns[column].count(None) != len(rows):
                return None
        for column in ones:
            values = columns[column]
            first = values[0]
            if values.count(first) != len(values):
                return None
            params[f"one__{column}"] = first
    except KeyError:  # a column the rows lack
        return None
    return params


def _same_rows(rows: list[Row]) -> list[Row]:
    """A one-statement ``lock_many``'s rows, as its JSON holds them."""
    return rows


def _table_of(rows: list[Row]) -> Table:
    """A one-statement ``lock_tables``' rows (``json_agg``: one object per row, its keys
    the columns in order) as a ``Table``."""
    return Table(tuple(rows[0]) if rows else (), [tuple(row.values()) for row in rows])


def _notice_rows(notices: Sequence[Notice]) -> list[Row]:
    """Notices as the rows ``notify_many`` reads."""
    return [{"channel": channel, "payload": payload} for channel, payload in notices]


def _rows_json(rows: Sequence[Row]) -> str:
    """The rows as one JSON array (orjson: hundreds of rows per batched write)."""
    return compact_json(list(rows)).decode("utf-8")


_PSYCOPG_PARAM_RE = re.compile(r"%\((\w+)\)s")


def text_array(items: Sequence[str]) -> str:
    """A list of strings as a PostgreSQL array literal, every element quoted and escaped:
    each ``CAST(:x AS text[])`` reads it back exactly. psycopg's list dumper, which does
    the same one element at a time in Python, was a visible share of a batch's time (a
    start or finish batch sends hundreds of ids). Items without a quote or a backslash
    (ids, names: nearly every list) are joined in one call; escaping each item in a
    generator cost about a thousand instructions an id, three ids a start or finish."""
    if not items:
        return "{}"
    joined = '","'.join(items)
    if "\\" not in joined and joined.count('"') == 2 * (len(items) - 1):
        return '{"' + joined + '"}'  # nothing to escape: every quote is a separator's
    quoted = ",".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items)
    return "{" + quoted + "}"


#: ``isinstance``'s second argument for every item of a list (``map`` calls it in C, where a
#: generator of the same test ran a Python frame per item).
_STR = repeat(str)


def _arrays(params: Params) -> Params:
    """Lists of strings as array literals (see ``text_array``); other values as they are."""
    return {
        key: text_array(value)
        if isinstance(value, list | tuple) and all(map(isinstance, value, _STR))
        else value
        for key, value in params.items()
    }


def _scoped(sql: str, i: int) -> str:
    """Rename a query's parameters ``%(x)s`` -> ``%(p<i>_x)s`` so that several queries
    can share one statement without their parameters colliding."""
    return _PSYCOPG_PARAM_RE.sub(lambda m: f"%(p{i}_{m.group(1)})s", sql)


#: A statement with ``$n`` parameters and their names in order (``to_positional``).
Positional = tuple[str, tuple[str, ...]]


def to_positional(sql: str) -> Positional:
    """``%(name)s`` -> ``$n`` (each name numbered once, in order of first use) and the
    names in that order: libpq's prepared statements (``_Raw``) and psycopg's
    ``RawCursor`` take positional parameters (psycopg parses a named-parameter query on
    every execution when it is longer than 4 KiB or has more than 50 parameters, as the
    columnar writes are)."""
    numbers: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        return f"${numbers.setdefault(match.group(1), len(numbers) + 1)}"

    return _PSYCOPG_PARAM_RE.sub(number, sql).replace("%%", "%"), tuple(numbers)


_ANY_RE = re.compile(r"= ANY\(CAST\((%\(\w+\)s) AS ([a-z ]+)\[\]\)\)")
_ROWS_LIMIT_RE = re.compile(r"LIMIT %\(\w*rows_n\)s")
_OTHER_LIMIT_RE = re.compile(r"LIMIT %\((?!\w*rows_n\))\w+\)s")


def one_each_sql(sql: str) -> str:
    """The form of ``sql`` for parameters that each hold one item: ``= ANY(CAST(:ids AS
    text[]))`` becomes ``= (CAST(:ids AS text[]))[1]`` and ``LIMIT :rows_n`` becomes
    ``LIMIT 1``, the same statement for one id and one row.

    Why: PostgreSQL's generic plan of a prepared statement guesses ten items for an array
    parameter and for a ``LIMIT`` parameter, so it costs more than the plan made for one
    id, and the planner then plans every run afresh. A report one task at a time (a
    start, a finish) spent more on planning its read than on running it (1.3 against
    0.36 ms a read, side by side). In this form the generic plan is the plan for one
    row, which PostgreSQL keeps (``one_each``).

    A statement with a ``LIMIT`` of its own (the claim's ready select: ``LIMIT :limit``,
    ``run_after <= :now``) stays as it is: its generic plan, blind to those values,
    read the whole table and sorted it (docs/benchmarks/history.md, "tried and not kept")."""
    if _OTHER_LIMIT_RE.search(sql):
        return sql
    return _ROWS_LIMIT_RE.sub("LIMIT 1", _ANY_RE.sub(r"= (CAST(\1 AS \2[]))[1]", sql))


def one_each(params: Params) -> bool:
    """Whether ``one_each_sql``'s form fits these parameters: every list holds exactly one
    item and every row count (``rows_n``) is one, and there is at least one of them."""
    found = False
    for key, value in params.items():
        if isinstance(value, list | tuple):
            if len(value) != 1:
                return False
            found = True
        elif key.endswith("rows_n"):
            if value != 1:
                return False
            found = True
    return found


def lock_many_sql(queries: Sequence[str], clock: str) -> str:
    """One statement for several reads, each a subquery whose rows come back as a JSON
    array (one column per query, one snapshot for all), and the clock as a last column:
    the reads run in a subquery that must produce its row (every lock taken, in order,
    each one waited for) before the outer query's projection reads the clock. The arrays
    come back as text, for ``parse_json`` (orjson) to read: psycopg's own JSON loader is
    the standard library's, 55 µs for ten task rows where orjson takes 23."""
    columns = ",\n".join(
        f"(SELECT coalesce(json_agg(x), '[]'::json)::text FROM ({_scoped(q, i)}) AS x) AS r{i}"
        for i, q in enumerate(queries)
    )
    return f"SELECT s.*, ({clock}) AS now FROM (SELECT\n{columns} OFFSET 0) AS s"


#: ``lock_many`` sends its reads as one statement only for this many ids at most. The
#: statement returns the rows as JSON, which costs PostgreSQL and this process more per
#: row than plain rows do: for a batch of hundreds (a busy worker's starts and finishes)
#: separate reads were cheaper (``python -m benchmarks.probe``). Those go as statements of
#: their own, the clock last, in one pipeline: one round trip as well (they had taken one
#: each). For a few ids the one statement still costs this process less (in process,
#: batches of 1 and 10 side by side).
LOCK_MANY_INLINE_MAX = 16


def _largest_list(calls: Sequence[tuple[str, Params]]) -> int:
    return max(
        (len(v) for _, params in calls for v in params.values() if isinstance(v, list | tuple)),
        default=0,
    )


def _counts_rows(sql: str) -> bool:
    """Whether ``sql`` can be a CTE of ``write_batch_sql``, which counts its rows: a
    write with ``RETURNING``, or a ``SELECT``."""
    return "RETURNING" in sql.upper() or sql.lstrip().upper().startswith("SELECT")


_CTE_HEAD_RE = re.compile(r"\s*(\w+)\s+AS\s+\(", re.IGNORECASE)
_COMMA_RE = re.compile(r"\s*,")
_LITERAL_RE = re.compile(r"'(?:[^']|'')*'")  # a plain string literal, quotes doubled
_UNREAD_RE = re.compile(r"\$\$|\bE'|--|/\*", re.IGNORECASE)


def _closing(sql: str, start: int) -> int:
    """The index of the parenthesis that closes the one just before ``start``, passing
    over string literals (whose parentheses do not count)."""
    depth, i = 1, start
    while i < len(sql):
        char = sql[i]
        if char == "'":
            literal = _LITERAL_RE.match(sql, i)
            if literal is None:
                break
            i = literal.end() - 1
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if not depth:
                return i
        i += 1
    raise ValueError("a WITH query whose parentheses or quotes do not close")


def split_with(sql: str) -> tuple[list[tuple[str, str]], str]:
    """A query's own leading ``WITH`` list, as ``(name, body)`` pairs, and the statement
    after it; no pairs for a query without one. ``WITH RECURSIVE`` is not split, and a
    list this cannot read safely (column lists, ``MATERIALIZED``, comments, ``E''`` or
    dollar-quoted strings) is refused: the driver reads every query's list when it
    loads them (``_Statements``), so such a query fails at start-up."""
    head = re.match(r"\s*WITH\s", sql, re.IGNORECASE)
    if head is None or re.match(r"\s*WITH\s+RECURSIVE\s", sql, re.IGNORECASE):
        return [], sql
    if _UNREAD_RE.search(sql):
        raise ValueError(f"comments, E'' or dollar quotes in the WITH query {sql[:60]!r}")
    ctes: list[tuple[str, str]] = []
    at = head.end()
    while True:
        found = _CTE_HEAD_RE.match(sql, at)
        if found is None:
            raise ValueError(f"cannot read the WITH list of {sql[:60]!r}")
        end = _closing(sql, found.end())
        ctes.append((found.group(1), sql[found.end() : end]))
        comma = _COMMA_RE.match(sql, end + 1)
        if comma is None:
            return ctes, sql[end + 1 :].strip()
        at = comma.end()


def _renamed(text: str, renames: dict[str, str]) -> str:
    """``text`` with each name in ``renames`` replaced as a whole word, all at once (a
    new name is never renamed again), outside string literals. The names must not also
    name a column or a table of the query: a CTE's name is its own."""
    if not renames:
        return text
    word = re.compile(r"\b(" + "|".join(map(re.escape, renames)) + r")\b")
    pieces: list[str] = []
    at = 0
    for literal in _LITERAL_RE.finditer(text):
        pieces.append(word.sub(lambda m: renames[m.group(1)], text[at : literal.start()]))
        pieces.append(literal.group(0))
        at = literal.end()
    pieces.append(word.sub(lambda m: renames[m.group(1)], text[at:]))
    return "".join(pieces)


def _as_ctes(sql: str, i: int) -> str:
    """Write ``i`` of ``write_batch_sql`` as its CTE ``w<i>``. A write with a data-modifying
    ``WITH`` of its own (a submit's tasks, then their events from the rows it returns)
    cannot be a CTE's body, since PostgreSQL takes such a ``WITH`` only at a statement's
    top level: its own CTEs join the statement's list instead, each renamed
    ``w<i>_<name>`` wherever the write names it, and the rest becomes ``w<i>``."""
    own, main = split_with(_scoped(sql, i))
    renames = {name: f"w{i}_{name}" for name, _ in own}
    parts = [f"{renames[name]} AS ({_renamed(body, renames)})" for name, body in own]
    return ",\n".join([*parts, f"w{i} AS ({_renamed(main, renames)})"])


def write_batch_sql(queries: Sequence[str], guards: Sequence[bool] = ()) -> str:
    """One statement that runs each ``*_many`` write as a data-modifying CTE and returns
    how many rows each wrote. PostgreSQL runs every such CTE exactly once, and checks
    foreign keys at the end of the statement, when all of them have run. A ``SELECT``
    (``notify_many``) may join them: it calls a volatile function, so PostgreSQL does not
    fold it into the count and reads every row of it once.

    ``guards`` (one per write): the statement also checks each guarded write's count
    against its parameter ``expect_<i>`` and fails (``orbit_stale_write``, migration 6)
    if one differs, so that a ``COMMIT`` sent behind it is skipped (``commit_with``)."""
    for q in queries:
        if not _counts_rows(q):
            raise ValueError(
                "a batched write must end with RETURNING (or be a SELECT), to count its rows"
            )
    ctes = ",\n".join(_as_ctes(q, i) for i, q in enumerate(queries))
    counts = ", ".join(f"(SELECT count(*) FROM w{i}) AS c{i}" for i in range(len(queries)))
    if not guards:
        return f"WITH {ctes}\nSELECT {counts}"
    if len(guards) != len(queries):
        raise ValueError("one guard flag for each write")
    checks = " AND ".join(
        f"c{i} = CAST(%(expect_{i})s AS bigint)" for i, guarded in enumerate(guards) if guarded
    )
    names = ", ".join(f"c{i}" for i in range(len(queries)))
    return (
        f"WITH {ctes}\nSELECT {names}, CASE WHEN {checks or 'true'} THEN 0 ELSE "
        f"orbit_stale_write('a batched write matched fewer rows than planned') END AS guard\n"
        f"FROM (SELECT {counts} OFFSET 0) AS counts"  # not flattened: each count runs once
    )


def _value(result: pq.abc.PGresult, column: int) -> bytes:
    """The first row's value in ``column`` of a statement that returns one (never NULL)."""
    value = result.get_value(0, column)
    assert value is not None
    return value


def _written(cur: psycopg.RawCursor[Any]) -> int:
    """The rows a ``*_many`` write wrote: those it returned, or else its row count, read
    from its result (``_written_count``): a streamed chunk returns a row per task, which
    ``fetchall`` made into tuples only to be counted, after the stream, while the
    transaction waited."""
    result = cur.pgresult
    assert result is not None, "a streamed write without its result"
    return _written_count(result)


#: A batched write as it travels: the query's name and whether in its columnar form.
WriteForm = tuple[str, bool]
K = TypeVar("K")
T = TypeVar("T")


class _Statements:
    """The driver's composed statements, built once and shared by every connection."""

    def __init__(self, queries: dict[str, str]) -> None:
        for sql in queries.values():  # a WITH list write_batch_sql cannot read fails here
            split_with(sql)
        # positional SQL and its parameters' names, in order; each keyed also by
        # whether it is the form for one item per parameter (``one_each_sql``)
        self.locks: dict[tuple[tuple[str, ...], bool], Positional] = {}
        self.writes: dict[tuple[tuple[WriteForm, ...], bool], Positional] = {}
        #: the last writes of a transaction, guarded (``commit_with``): by their forms
        #: and which of them is guarded
        self.final_writes: dict[
            tuple[tuple[tuple[WriteForm, ...], tuple[bool, ...]], bool], Positional
        ] = {}
        self.positional: dict[tuple[str, bool], Positional] = {}
        self._names: dict[str, bytes] = {}  # positional SQL -> its prepared statement's name
        self._prepared: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[bytes]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def statement(self, cx: psycopg.Connection[Any], sql: str) -> tuple[bytes, bool]:
        """The name ``sql`` is prepared under, and whether ``cx`` has yet to prepare it."""
        with self._lock:
            name = self._names.get(sql)
            if name is None:
                name = self._names[sql] = f"orbit_{len(self._names)}".encode("ascii")
            return name, name not in self._prepared.setdefault(cx, set())

    def prepared(self, cx: psycopg.Connection[Any], name: bytes) -> None:
        with self._lock:
            self._prepared.setdefault(cx, set()).add(name)

    def forget(self, cx: psycopg.Connection[Any]) -> None:
        """``cx`` dropped its prepared statements (``DEALLOCATE ALL``)."""
        with self._lock:
            self._prepared.pop(cx, None)

    @staticmethod
    def form(
        cache: dict[tuple[K, bool], Positional], key: K, one: bool, build: Callable[[], str]
    ) -> Positional:
        """The positional statement ``cache`` holds for ``key`` (in ``one_each_sql``'s
        form when ``one``), built from ``build()``'s SQL at its first use."""
        found = cache.get((key, one))
        if found is None:
            sql = build()
            found = cache[key, one] = to_positional(one_each_sql(sql) if one else sql)
        return found


def _dump(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format. The statements sent this way (``_Raw``)
    cast or compare every parameter, so PostgreSQL infers each one's type."""
    if value is None:
        return None
    if isinstance(value, str):
        if "\x00" in value:  # libpq would cut the value short at the NUL
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        return value.encode("utf-8")
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int | float):
        return repr(value).encode("ascii")
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


def _checked(result: pq.abc.PGresult) -> pq.abc.PGresult:
    """``result``, or the psycopg error it reports: the class its SQLSTATE names, or,
    for libpq's own error (a connection lost or closed, which has no SQLSTATE),
    ``OperationalError``, as psycopg's cursors raise it. psycopg names that one the base
    ``DatabaseError``, which ``PostgresDriver.is_unavailable`` did not take for a lost
    database: a schedule's fire blamed its schedule for it, and went on to the next."""
    if result.status not in (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK):
        if result.error_field(pq.DiagnosticField.SQLSTATE) is None:
            message = result.error_message.decode("utf-8", "replace").strip()
            raise psycopg.OperationalError(message or "the connection to PostgreSQL failed")
        raise psycopg.errors.error_from_result(result)
    return result


class _Raw:
    """The statements every small transaction runs, sent through libpq directly.

    A submit, claim, start and finish done one at a time are each a transaction of a
    few statements (``BEGIN``, a composed locking read, a batched write, ``COMMIT``).
    psycopg's cursor machinery spends 35-80 µs of this process's CPU on each of them
    beyond libpq's own (a read and its ``BEGIN`` and ``COMMIT``: 240-320 µs against
    60-80 µs, measured side by side), more than the loopback round trip it wraps. These
    statements need none of it: their parameters are strings and numbers. So they go as
    libpq's blocking calls (which release the GIL while they wait), each prepared once per
    connection, and the rows of a ``fetch`` are loaded by psycopg's own C loaders. Only an
    ``execute`` with a ``bytea`` parameter (sent in binary) and the streamed batch submit
    (psycopg's pipeline mode) still go through psycopg's cursors."""

    def __init__(self, cx: psycopg.Connection[Any], statements: _Statements) -> None:
        self._cx = cx
        self._pg = cx.pgconn
        self._statements = statements

    def command(self, sql: bytes) -> None:
        """A statement without parameters or rows: ``BEGIN``, ``COMMIT``, ``ROLLBACK``."""
        _checked(self._pg.exec_(sql))

    def run(self, sql: str, params: Sequence[Any]) -> pq.abc.PGresult:
        """A positional statement (``$n``), prepared on this connection at its first use."""
        name, values = self.prepare(sql, params)
        return _checked(self._pg.exec_prepared(name, values))

    def pipeline(
        self, statements: Sequence[tuple[bytes, list[bytes]]], *, begin: bool, commit: bool = False
    ) -> list[pq.abc.PGresult]:
        """Prepared statements (from ``prepare``), after ``BEGIN`` if ``begin``, in one
        round trip through libpq's pipeline mode; their results, each checked in order.
        A transaction done one at a time (a submit, a claim, a start, a finish) had spent
        a round trip of its own, about 50-130 µs here, on ``BEGIN``, and a single submit
        another on the NOTIFY after its insert. libpq's pipeline costs this process no
        more CPU than one statement (psycopg's own pipeline mode did, see above). The
        results are read once the socket is readable, so the wait releases the GIL (a
        blocking ``get_result`` would hold it). Anything but the expected answers closes
        the connection, which the pool then replaces. After a failed statement the
        others are skipped and the transaction is left failed, for the caller's
        rollback. ``commit``: ``COMMIT`` goes last, in the same round trip; after a failed
        statement PostgreSQL skips it too, and the transaction is left failed."""
        pg = self._pg
        try:
            pg.enter_pipeline_mode()
            if begin:
                pg.send_query_params(b"BEGIN", None)
            for name, values in statements:
                pg.send_query_prepared(name, values)
            if commit:
                pg.send_query_params(b"COMMIT", None)
            pg.pipeline_sync()
            _send_all(pg)
            results = _pipeline_results(pg, len(statements) + begin + commit)
            pg.exit_pipeline_mode()
        except BaseException:
            self._cx.close()
            raise
        return [_checked(r) for r in results][begin : begin + len(statements)]

    def prepare(self, sql: str, params: Sequence[Any]) -> tuple[bytes, list[bytes]]:
        """The name ``sql`` is prepared under on this connection (preparing it at its
        first use), and ``params`` in libpq's text format."""
        name, unprepared = self._statements.statement(self._cx, sql)
        if unprepared:
            _checked(self._pg.prepare(name, sql.encode("utf-8"), None))
            self._statements.prepared(self._cx, name)
        # libpq reads None as NULL; psycopg's stub leaves None out of the values' type
        return name, cast("list[bytes]", [_dump(v) for v in params])


def _bound(statement: Positional, params: Params) -> tuple[str, list[Any]]:
    """A positional statement's SQL and ``params`` in its order."""
    sql, order = statement
    return sql, [params[name] for name in order]


def _written_count(result: pq.abc.PGresult) -> int:
    """The rows a write returned, or else the rows it changed."""
    return result.ntuples if result.nfields else result.command_tuples or 0


def _send_all(pg: pq.abc.PGconn) -> None:
    """Send whatever libpq still holds of the statements sent in pipeline mode.

    psycopg's connections are nonblocking, so libpq sends what the socket takes and
    keeps the rest: a pipeline larger than the socket's buffer (a batch of 45 tasks of
    200 KB) stopped part way, PostgreSQL waited for the rest of its statement, and a
    wait for its answer waited for ever. ``flush`` until everything is sent, waiting for
    the socket to take more (and reading what arrives meanwhile, should PostgreSQL be
    writing to us while we write to it)."""
    if pg.flush() == 0:
        return
    waiter = select.poll()
    waiter.register(pg.socket, select.POLLIN | select.POLLOUT)
    while pg.flush() != 0:
        for _, events in waiter.poll():
            if events & select.POLLIN:
                pg.consume_input()


def _pipeline_results(pg: pq.abc.PGconn, count: int) -> list[pq.abc.PGresult]:
    """The results of ``count`` statements sent in pipeline mode and of the sync after
    them, waiting for the socket between reads (``poll`` releases the GIL)."""
    results: list[pq.abc.PGresult] = []
    waiter = select.poll()
    waiter.register(pg.socket, select.POLLIN)
    while True:
        while pg.is_busy():
            waiter.poll()
            pg.consume_input()
        result = pg.get_result()
        if result is None:  # the end of one statement's results
            continue
        if result.status == ExecStatus.PIPELINE_SYNC:
            break
        results.append(result)
    if len(results) != count:
        raise psycopg.OperationalError(f"expected {count} results in the pipeline")
    return results


class _PostgresConnection:
    """One transaction on an autocommit connection, begun by its first statement.

    The driver begins, commits and rolls back itself. ``BEGIN`` travels with the
    transaction's first statement in libpq's pipeline mode (``_Raw.pipeline``), or
    alone before a statement sent another way (``_begin``): psycopg's own pipeline mode
    costs this process more CPU than the round trip it saves (``_Raw``)."""

    def __init__(
        self,
        cx: psycopg.Connection[Any],
        queries: dict[str, str],
        columnar: dict[str, tuple[str, Columns]],
        statements: _Statements,
        *,
        uniform: dict[str, Uniform] | None = None,
        autocommit: bool = False,
    ) -> None:
        self._cx = cx
        self._queries = queries
        self._columnar = columnar  # the columnar form of each *_many write
        self._uniform = uniform or {}  # the uniform form of some (``uniform_forms``)
        self._statements = statements
        self.raw = _Raw(cx, statements)
        #: whether no BEGIN is owed: one was sent, or each statement is its own
        #: transaction (``autocommit``, a lone read: nothing to commit either)
        self.begun = autocommit
        #: preludes (positional SQL and values) waiting to go with the next statement
        self._preludes: list[tuple[str, list[Any]]] = []
        #: whether the transaction's last write took its COMMIT with it (``commit_with``)
        self.committed = False

    def _open(self) -> None:
        """Refuse a statement after the transaction has committed with its last write."""
        if self.committed:
            raise RuntimeError("this transaction committed with its last write")

    def _begin(self) -> None:
        """``BEGIN`` (unless a statement has already begun the transaction) and any
        preludes, in one round trip: before a statement sent through psycopg."""
        self._open()
        if self._preludes or not self.begun:
            self._pipelined_run([])

    def _run(self, statement: Positional, params: Params) -> pq.abc.PGresult:
        """A positional statement and its parameters' names (``to_positional``), run in
        this transaction through libpq with ``params`` in that order."""
        self._open()
        sql, values = _bound(statement, params)
        if self.begun and not self._preludes:
            return self.raw.run(sql, values)
        return self._pipelined_run([(sql, values)])[0]

    def _pipelined_run(
        self, statements: Sequence[tuple[str, list[Any]]], *, commit: bool = False
    ) -> list[pq.abc.PGresult]:
        """Positional statements and their values in one round trip (``_Raw.pipeline``),
        after ``BEGIN`` if the transaction has not begun and after any preludes, and with
        ``COMMIT`` after them if ``commit``; the statements' results."""
        self._open()
        # a bad value raises here, before anything is sent or any prelude is dropped
        prepared = [self.raw.prepare(*statement) for statement in [*self._preludes, *statements]]
        sent_before = len(self._preludes)
        self._preludes = []
        begin = not self.begun
        self.begun = True  # before the round trip: if a statement fails, a rollback follows
        return self.raw.pipeline(prepared, begin=begin, commit=commit)[sent_before:]

    def prelude(self, name: str, params: Params) -> None:
        self._open()
        self._preludes.append(_bound(self._positional(name, one_each(params)), _arrays(params)))

    def flush(self) -> None:
        """Send the preludes still waiting (a transaction that ends after one)."""
        if self._preludes:
            self._pipelined_run([])

    def _lock_sql(self, names: tuple[str, ...], one: bool) -> Positional:
        """The one positional statement of ``lock_many`` for these reads
        (``lock_many_sql``; ``one``: in ``one_each_sql``'s form), and its parameters'
        names in order."""
        return self._statements.form(
            self._statements.locks,
            names,
            one,
            lambda: lock_many_sql([self._queries[n] for n in names], self._queries["clock_now"]),
        )

    def _write_sql(self, forms: tuple[WriteForm, ...], one: bool) -> Positional:
        """The positional statement of one write, or of several as one
        (``write_batch_sql``; ``one``: in ``one_each_sql``'s form), and its parameters'
        names in order."""

        def build() -> str:
            queries = self._form_queries(forms)
            return queries[0] if len(queries) == 1 else write_batch_sql(queries)

        return self._statements.form(self._statements.writes, forms, one, build)

    def _form_queries(self, forms: Sequence[WriteForm]) -> list[str]:
        """Each write's SQL in the form it travels in (columnar or JSON rows)."""
        return [
            self._columnar[name][0] if columnar else self._queries[name] for name, columnar in forms
        ]

    def _write(self, forms: tuple[WriteForm, ...], params: Params) -> pq.abc.PGresult:
        return self._run(self._write_sql(forms, one_each(params)), params)

    def _write_sent(self, forms: tuple[WriteForm, ...], params: Params) -> psycopg.RawCursor[Any]:
        """``_write`` through psycopg, for a write sent in its pipeline mode (a batch
        submit's chunks: never one row each, so always the general form)."""
        sql, values = _bound(self._write_sql(forms, False), params)
        cur = psycopg.RawCursor(self._cx)
        cur.execute(sql, values)
        return cur

    def _write_params(self, name: str, rows: Sequence[Row]) -> tuple[WriteForm, Params]:
        """The form a write's rows travel in and their parameters."""
        uniform = self._uniform.get(name)
        if uniform is not None and (ones := uniform_params(rows, uniform)) is not None:
            form, own = self._write_params(uniform[0], rows)
            own.update(ones)
            return form, own
        columnar = self._columnar.get(name)
        params: Params | None = None
        if columnar is not None and len(rows) >= COLUMNAR_MIN_ROWS:
            params = rows_columns(rows, columnar[1])
        if params is None:
            return (name, False), {"rows": _rows_json(rows), "rows_n": len(rows)}
        params["rows_n"] = len(rows)
        return (name, True), params

    def lock_many(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[list[Row]], int]:
        return self._locked(calls, self._rows, _same_rows)

    def lock_tables(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[Table], int]:
        return self._locked(calls, self._table, _table_of)

    def _locked(
        self,
        calls: Sequence[tuple[str, Params]],
        loaded: Callable[[pq.abc.PGresult], T],
        parsed: Callable[[list[Row]], T],
    ) -> tuple[list[T], int]:
        """``lock_many``'s reads, each one's rows made by ``loaded`` from its result, or
        by ``parsed`` from the rows its JSON holds (the one-statement form); and the
        clock."""
        if _largest_list(calls) > LOCK_MANY_INLINE_MAX:  # see LOCK_MANY_INLINE_MAX
            # Each read its own statement, then the clock, all in one round trip
            # (``_Raw.pipeline``): PostgreSQL runs them in order, so the clock is read
            # after every lock was taken, as a separate ``now()`` would be. Each read
            # has its own snapshot (READ COMMITTED), as when they went one by one; the
            # one-statement form below shares one.
            statements = [
                _bound(self._positional(name, one_each(params)), _arrays(params))
                for name, params in calls
            ]
            statements.append(_bound(self._positional("clock_now"), {}))
            *results, clock = self._pipelined_run(statements)
            return [loaded(result) for result in results], int(_value(clock, 0))
        # One statement (lock_many_sql), each query's parameters scoped by its position.
        scoped = {f"p{i}_{k}": v for i, (_, ps) in enumerate(calls) for k, v in ps.items()}
        statement = self._lock_sql(tuple(name for name, _ in calls), one_each(scoped))
        result = self._run(statement, _arrays(scoped))
        *arrays, now = (_value(result, i) for i in range(result.nfields))
        return [parsed(parse_json(rows)) for rows in arrays], int(now)

    def write_batch(
        self,
        writes: Sequence[tuple[str, Sequence[Row]]],
        notify: Sequence[Notice] = (),
        *,
        commit_with: Sequence[int | None] | None = None,
    ) -> list[int]:
        # The notices travel as one more write (notify_many) of the same statement: a
        # NOTIFY of its own would cost a round trip, in every transaction that wakes a
        # dispatcher (a submit, a finish).
        todo = [*writes, ("notify_many", _notice_rows(notify))] if notify else list(writes)
        if not todo:
            return []
        if commit_with is not None:
            unchecked = [None] * (len(todo) - len(writes))  # the notices: any count
            return self._write_and_commit(todo, [*commit_with, *unchecked])[: len(writes)]
        if len(todo) == 1:
            return [self.write_many(*todo[0])][: len(writes)]
        forms, params = self._batch_params(todo)
        result = self._write(forms, params)
        return [int(_value(result, i)) for i in range(len(writes))]

    def _batch_params(
        self, todo: Sequence[tuple[str, Sequence[Row]]]
    ) -> tuple[tuple[WriteForm, ...], Params]:
        """The forms of writes sent as one statement, and their parameters, each scoped by
        its write's position (``write_batch_sql``)."""
        forms: list[WriteForm] = []
        params: Params = {}
        for i, (name, rows) in enumerate(todo):
            form, own = self._write_params(name, rows)
            forms.append(form)
            params.update((f"p{i}_{k}", v) for k, v in own.items())
        return tuple(forms), params

    def _write_and_commit(
        self, todo: Sequence[tuple[str, Sequence[Row]]], expect: Sequence[int | None]
    ) -> list[int]:
        """The transaction's last writes as one statement that checks each guarded count
        itself (``write_batch_sql``'s guards; ``expect``: one count or None per write),
        sent with ``COMMIT`` in one round trip. A transaction done one task at
        a time (a claim, a start, a finish) spent a round trip of its own on its
        ``COMMIT``; the count was checked here, between the two, so it had to be."""
        forms, params = self._batch_params(todo)
        guards = tuple(count is not None for count in expect)
        params.update((f"expect_{i}", count) for i, count in enumerate(expect) if count is not None)

        statement = self._statements.form(
            self._statements.final_writes,
            (forms, guards),
            one_each(params),
            lambda: write_batch_sql(self._form_queries(forms), guards),
        )
        try:
            (result,) = self._pipelined_run([_bound(statement, params)], commit=True)
        except psycopg.Error as exc:
            if exc.sqlstate == STALE_WRITE_SQLSTATE:
                raise StaleWrite(f"{', '.join(n for n, _ in todo)}: {exc}") from None
            raise
        self.committed = True
        return [int(_value(result, i)) for i in range(len(todo))]

    def fetch(self, name: str, params: Params) -> list[Row]:
        return self._rows(self._read(name, params))

    def fetch_table(self, name: str, params: Params) -> Table:
        return self._table(self._read(name, params))

    def _read(self, name: str, params: Params) -> pq.abc.PGresult:
        return self._run(self._positional(name, one_each(params)), _arrays(params))

    def _rows(self, result: pq.abc.PGresult) -> list[Row]:
        """A statement's rows as dicts, by column name."""
        return self._table(result).dicts()

    def _table(self, result: pq.abc.PGresult) -> Table:
        """A statement's rows as tuples, and its columns' names."""
        if not result.nfields:
            return Table((), [])
        # psycopg's own loaders (C) turn the values into Python ones, as its cursor would;
        # ``tuple`` rows are the ones it makes, which it then hands back as they are
        names = tuple((result.fname(i) or b"").decode("utf-8") for i in range(result.nfields))
        loader = Transformer(self._cx)
        loader.set_pgresult(result)
        return Table(names, loader.load_rows(0, result.ntuples, tuple))

    def write_many(self, name: str, rows: Sequence[Row]) -> int:
        if not rows:
            return 0
        form, params = self._write_params(name, rows)
        return _written_count(self._write((form,), params))

    def write_stream(
        self,
        name: str,
        chunks: Iterable[Sequence[Row]],
        notify: Callable[[], Sequence[Notice]] = tuple,
    ) -> int:
        notified: list[bool] = []

        def writes() -> Iterator[tuple[str, Sequence[Row]]]:
            yield from ((name, rows) for rows in chunks if rows)
            notices = notify()  # the last statement of the pipeline (write_batch's notify)
            if notices:
                notified.append(True)
                yield "notify_many", _notice_rows(notices)

        counts = self._pipelined(writes())
        return sum(counts[:-1] if notified else counts)

    def _pipelined(self, writes: Iterable[tuple[str, Sequence[Row]]]) -> list[int]:
        """Each write its own statement, sent in pipeline mode: each execute sends its
        statement and returns, so the server runs it while ``writes`` makes the next;
        leaving the block syncs and reads every result, raising the first error (the
        caller's transaction then rolls back). One round trip for all of them."""
        cursors: list[psycopg.RawCursor[Any]] = []
        self._begin()
        try:
            with self._cx.pipeline():
                for name, rows in writes:
                    form, params = self._write_params(name, rows)
                    cursors.append(self._write_sent((form,), params))
            return [_written(c) for c in cursors]
        finally:
            for cur in cursors:
                cur.close()

    def execute(self, name: str, params: Params) -> int:
        values = _arrays(params)
        if any(isinstance(v, bytes) for v in values.values()):  # bytea: psycopg, in binary
            self._begin()
            with self._cx.cursor() as cur:
                cur.execute(self._queries[name], values)
                return cur.rowcount
        return self._run(self._positional(name, one_each(params)), values).command_tuples or 0

    def _positional(self, name: str, one: bool = False) -> Positional:
        """A named query as a positional statement (``one``: in ``one_each_sql``'s
        form), and its parameters' names in order."""
        return self._statements.form(
            self._statements.positional, name, one, lambda: self._queries[name]
        )

    def now(self) -> int:
        return int(_value(self._run(self._positional("clock_now"), {}), 0))

    def run_script(self, sql: str) -> None:
        self._begin()
        self._cx.execute(sql.encode("utf-8"))


#: Connections kept for relaxed transactions (claims): claims are serialised cluster-wide
#: by the claim lock, so a second one would only wait for it.
RELAXED_MAX = 2

#: libpq's TCP settings for every connection Orbit opens. A PostgreSQL gone without a
#: reset (a partition, a dropped NAT entry) is otherwise noticed only by TCP's own
#: timers: an idle connection after libpq's default keepalive idle of 2 hours, a request
#: whose bytes go unacknowledged after about 15 minutes of retransmits, a store call or
#: a LISTEN read hanging all that while. The keepalive probes find a silent peer in
#: 10 + 3 * 5 s; ``tcp_user_timeout`` drops a connection whose sent bytes wait 30 s for
#: an acknowledgement (a long query sends nothing meanwhile, so it is unaffected).
TCP_CHECKS = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def with_tcp_checks(dsn: str) -> str:
    """``dsn`` (a URL or key=value conninfo) with ``TCP_CHECKS`` added."""
    return conninfo.make_conninfo(dsn, **TCP_CHECKS)


def close_if_stale(cx: psycopg.Connection[Any]) -> bool:
    """Whether this idle pooled connection is unfit for a transaction, closing it if so:
    the server closed it (a restart, or ``pg_terminate_backend``) or spoke on it unasked.
    A pooled connection LISTENs to nothing and has read every answer to its statements,
    so an idle one has nothing to read; a readable socket is the server's goodbye (its
    error, then the end of the stream, which can come a moment later), or one of its rare
    unprompted messages (a setting's new value), and a new connection costs less than
    telling them apart. One ``poll`` with no wait: about a microsecond a transaction. A
    peer that vanished without a word is not seen here; the TCP checks find it."""
    pg = cx.pgconn
    if pg.status == ConnStatus.OK:
        waiter = select.poll()
        waiter.register(pg.socket, select.POLLIN)
        if not waiter.poll(0):
            return False
    cx.close()
    return True


def _fit_connection(
    pool: ConnectionPool[Any], timeout: float | None = None
) -> psycopg.Connection[Any]:
    """A connection from ``pool``, passing over those ``close_if_stale`` closes: after
    PostgreSQL restarts, every idle connection in the pool is closed, and each used to
    fail one store call (a 500) before the pool replaced it. A failed call is not retried
    instead, since a lost reply to its ``COMMIT`` may hide a commit. ``timeout``: how
    long to wait for one (``PoolTimeout`` past it), None for the pool's own 30 s."""
    cx: psycopg.Connection[Any]
    for _ in range(pool.max_size):
        cx = pool.getconn(timeout)
        if not close_if_stale(cx):
            return cx
        pool.putconn(cx)  # closed: the pool discards it and opens another
    cx = pool.getconn(timeout)  # every one was stale: a new one, as it comes
    return cx


#: How long PostgreSQL lets a transaction of Orbit's wait for its next statement before
#: it ends the connection (``idle_in_transaction_session_timeout``, milliseconds).
IDLE_IN_TRANSACTION_MS = 60_000
#: How long a statement of Orbit's waits for a lock (``lock_timeout``, milliseconds) on a
#: connection whose database, role or URL sets none: past it the statement fails
#: (``55P03``, nothing of its transaction committed) and ``Store._tx`` runs the
#: transaction again while its wait (``StoreConfig.tx_wait_us``) lasts, then answers
#: ``DATABASE_BUSY``. With none, a submit waited for as long as another session held a
#: lock (``LOCK TABLE orbit_tasks``, a migration's), long past its client's timeout, and
#: committed after the client had given up. Set once per connection, with its other
#: settings: a ``SET`` per transaction would cost a round trip each.
LOCK_TIMEOUT_MS = 5_000


def _configure(cx: psycopg.Connection[Any]) -> None:
    """Every pooled connection's setting, made once when the pool opens it: PostgreSQL
    ends a transaction of ours that waits ``IDLE_IN_TRANSACTION_MS`` for its next
    statement. A node cut off from the database in the middle of a transaction (its host
    gone, a partition) held that transaction's row locks until the database's own
    keepalives gave the connection up, two hours by default, and every claim of the
    cluster could wait behind them meanwhile (a resume locks the session's row under the
    claim lock). Orbit's transactions wait for nothing but the database between their
    statements: a request's body is read before, an artifact's download reads a chunk a
    transaction."""
    cx.execute(_settings())


def _settings() -> str:
    """``_configure``'s settings, one round trip: with the timer, the bounds for a node
    cut off while its backend is busy (mid-pipeline, or writing a result), which that
    timer does not cover: the server's own TCP checks of the connection, as libpq's are
    set at our end (``TCP_CHECKS``)."""
    return (
        f"SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS};"
        " SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5;"
        " SET tcp_keepalives_count = 3; SET tcp_user_timeout = 30000;"
        # ``LOCK_TIMEOUT_MS`` unless the URL (``options=-c lock_timeout=…``), the role or
        # the database sets one of its own
        f" SELECT set_config('lock_timeout', '{LOCK_TIMEOUT_MS}', false)"
        " WHERE current_setting('lock_timeout') = '0'"
    )


def _relax(cx: psycopg.Connection[Any]) -> None:
    """A relaxed connection's settings, made once when the pool opens it, in the same
    round trip as every pooled connection's: its commits return before their WAL is
    flushed (``Driver.transaction(durable=False)``)."""
    cx.execute(_settings() + "; SET synchronous_commit = off")


def _end(cx: psycopg.Connection[Any], tx: _PostgresConnection, *, failed: bool) -> None:
    """Commit the transaction ``tx`` began, or roll it back if its work ``failed`` or a
    statement of it failed (PostgreSQL would answer that ``COMMIT`` with a rollback)."""
    status = cx.pgconn.transaction_status
    if failed:  # the server's status, not ``begun``: a first read may fail after BEGIN
        if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
            with suppress(psycopg.Error):  # a broken connection: the pool discards it
                tx.raw.command(b"ROLLBACK")
        return
    if not tx.begun or tx.committed:
        return
    if status == TransactionStatus.INERROR:
        tx.raw.command(b"ROLLBACK")
        raise psycopg.errors.InFailedSqlTransaction(
            "a statement of this transaction failed; it was rolled back"
        )
    tx.raw.command(b"COMMIT")


def stale_statement(exc: BaseException) -> bool:
    """Whether PostgreSQL refused a statement prepared before the tables changed: the
    columns of its result changed (``0A000``, "cached plan must not change result type":
    a ``SELECT *`` after another node's migration added a column), or it is gone
    (``26000``). Told by SQLSTATE, not by the message, which the server's locale words;
    another ``0A000`` (a feature a statement cannot use) fails again on statements
    prepared afresh, and is raised then (``PostgresDriver._stale_once``)."""
    return isinstance(
        exc, psycopg.errors.FeatureNotSupported | psycopg.errors.InvalidSqlStatementName
    )


#: How long opening the store waits for PostgreSQL to answer before it says why not.
CONNECT_TIMEOUT_S = 10


#: the server's refusal in libpq's message for a failed connect ("connection to server
#: at "h", port 5432 failed: FATAL:  database "x" is not currently accepting
#: connections"): its first line, after the severity
_SERVER_REFUSAL = re.compile(r"failed: (?:FATAL|ERROR|PANIC):\s+([^\n]+)")
#: a name a message quotes: the server's doubly ("orbit", "127.0.0.1", "postgres"),
#: psycopg's own singly (failed to resolve host 'db.internal')
_QUOTED = re.compile(r""""[^"]*"|'[^']*'""")


def unnamed(text: str) -> str:
    """``text`` with every name it quotes left out (``"…"``, ``'…'``): a host, a user, a
    database are not for an endpoint with no token, nor for a log line about the
    database's state; the reason is what a reader needs."""
    return _QUOTED.sub(lambda m: f"{m[0][0]}…{m[0][0]}", text)


def server_refusal(error: BaseException) -> str | None:
    """PostgreSQL's own words refusing a connection (``database "…" is not currently
    accepting connections``), without the host, port or URL libpq's message starts
    with, and ``unnamed``; None if ``error`` holds no answer of the server's (unreachable,
    refused by the network)."""
    found = _SERVER_REFUSAL.search(str(error))
    return None if found is None else unnamed(found.group(1))


class _ConnectErrors:
    """The last error the pools met opening a connection, None once one has opened
    since: the pools retry in the background and their callers see only a 30 s
    ``PoolTimeout``, so /readyz said a database that refused every connection ("not
    currently accepting connections", a password changed) had merely not answered."""

    last: Exception | None = None

    def connection_class(self) -> type[psycopg.Connection[Any]]:
        """A connection class for a pool (its public ``connection_class``) that records
        here how each of its connects ended."""
        errors = self

        class Recorded(psycopg.Connection[Any]):
            @classmethod
            def connect(cls, *args: Any, **kwargs: Any) -> Self:
                try:
                    cx = super().connect(*args, **kwargs)
                except Exception as exc:
                    errors.last = exc
                    raise
                errors.last = None
                return cx

        return Recorded


#: the reads whose horizon looks at other databases' transactions in pg_stat_activity
HORIZON_READS = frozenset({"event_list", "event_list_task"})


class PostgresDriver:
    """Two pools over one database: durable connections for every transaction a reply
    waits on, and a few relaxed ones (``synchronous_commit = off`` for the whole
    session) for claims, so that a claim need not spend a round trip on ``SET LOCAL``."""

    name = "postgres"

    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 8) -> None:
        self.dsn = dsn
        # One connection first, so that a database that cannot be reached, or refuses
        # us, says why at once: the pools retry in the background, and their first
        # caller waited 30 s for a PoolTimeout that named no cause.
        psycopg.connect(with_tcp_checks(dsn), connect_timeout=CONNECT_TIMEOUT_S).close()
        self.queries = {k: to_psycopg(v) for k, v in load_queries(_HERE / "queries.sql").items()}
        self.columnar = {
            name: form
            for name, form in ((n, columnar_sql(q)) for n, q in self.queries.items())
            if form is not None
        }
        self.uniform = uniform_forms(self.queries, self.columnar)
        self._statements = _Statements(self.queries)
        self.migrations = _HERE / "migrations"
        self._connect_errors = _ConnectErrors()
        self._pool = ConnectionPool(
            with_tcp_checks(dsn),
            connection_class=self._connect_errors.connection_class(),
            min_size=min_size,
            max_size=max_size,
            open=True,
            kwargs={"autocommit": True},  # transactions begun by their first read
            configure=_configure,
            name="orbit",
        )
        self._relaxed = ConnectionPool(
            with_tcp_checks(dsn),
            connection_class=self._connect_errors.connection_class(),
            min_size=1,
            max_size=RELAXED_MAX,
            open=True,
            kwargs={"autocommit": True},
            configure=_relax,
            name="orbit-relaxed",
        )
        self.plans = PlanWatch(forget=self._statements.forget)
        #: per thread: whether its last transaction was refused for stale statements and
        #: is being run again (``_stale_once``); the store's retry runs on the same thread
        self._local = threading.local()

    @contextmanager
    def transaction(
        self, *, durable: bool = True, wait_s: float | None = None
    ) -> Iterator[_PostgresConnection]:
        """``wait_s``: the longest this waits for a pooled connection (``PoolTimeout``
        past it): while another session holds a lock, every connection of the pool can
        be waiting for it (``LOCK_TIMEOUT_MS`` each), and a transaction waited the pool's
        30 s behind them, past its client's timeout."""
        pool = self._pool if durable else self._relaxed
        with self._connection(pool, timeout=None if wait_s is None else max(wait_s, 0.001)) as (
            cx,
            tx,
        ):
            try:
                yield tx
                tx.flush()  # a prelude the work sent no statement after
            except BaseException as exc:
                _end(cx, tx, failed=True)
                if stale_statement(exc):
                    self._stale_once(exc)
                else:
                    self._local.run_again = False
                raise
            _end(cx, tx, failed=False)
            self._local.run_again = False

    def _stale_once(self, exc: BaseException) -> None:
        """A statement refused as prepared before the tables changed: drop every
        connection's statements and have the transaction run again (``is_retryable``),
        once. Refused again on that run, on statements prepared afresh, it is the
        statement's own refusal (a feature it cannot use): raised, where each of the
        store's retries dropped every connection's statements once more."""
        if getattr(self._local, "run_again", False):
            self._local.run_again = False
            return
        self.plans.statements_stale()
        self._local.run_again = True
        exc.orbit_run_again = True  # type: ignore[attr-defined]

    @contextmanager
    def _connection(
        self, pool: ConnectionPool[Any], *, autocommit: bool = False, timeout: float | None = None
    ) -> Iterator[tuple[psycopg.Connection[Any], _PostgresConnection]]:
        """A pooled connection fit for a transaction (``_fit_connection``), its plans
        checked (before any transaction: those reads need none), and the driver's view
        of it."""
        cx = _fit_connection(pool, timeout)
        try:
            self.plans.before_transaction(cx)
            yield (
                cx,
                _PostgresConnection(
                    cx,
                    self.queries,
                    self.columnar,
                    self._statements,
                    uniform=self.uniform,
                    autocommit=autocommit,
                ),
            )
        finally:
            pool.putconn(cx)

    def read(self, name: str, params: Params) -> list[Row]:
        """The statement alone in autocommit: its own transaction, one round trip. An
        event read (``HORIZON_READS``) goes after ``activity_snapshot`` in the same round
        trip, which libpq's pipeline runs as one implicit transaction (until its sync),
        so that its horizon sees other databases' transactions as they were before its
        snapshot (queries.sql, ``event_list``)."""
        for tries in (1, 2):
            try:
                with self._connection(self._pool, autocommit=True) as (_, tx):
                    if name in HORIZON_READS:
                        tx.prelude("activity_snapshot", {})
                    return tx.fetch(name, params)
            except psycopg.Error as exc:
                if tries == 2 or not stale_statement(exc):
                    raise
                self.plans.statements_stale()  # and read again, prepared afresh
        raise AssertionError("unreachable")

    def is_retryable(self, exc: BaseException) -> bool:
        """A deadlock, a serialisation failure, a lock wait past ``lock_timeout``, or a
        statement prepared before the tables changed (``stale_statement``, once:
        ``_stale_once``): each fails a statement before the ``COMMIT`` behind it, so the
        transaction committed nothing and may run again."""
        return isinstance(
            exc,
            psycopg.errors.DeadlockDetected
            | psycopg.errors.SerializationFailure
            | psycopg.errors.LockNotAvailable,
        ) or bool(getattr(exc, "orbit_run_again", False))

    def is_unavailable(self, exc: BaseException) -> bool:
        """``OperationalError``: a connection refused, lost or closed, the server
        shutting down, the pool closed or out of connections in time (psycopg_pool's
        errors are its subclasses), deadlocks and cancelled statements past the retries;
        a read-only database (``25006``); a transaction the store gave up on for one of
        those (``DatabaseUnavailable``)."""
        return isinstance(
            exc,
            psycopg.OperationalError | psycopg.errors.ReadOnlySqlTransaction | DatabaseUnavailable,
        )

    def unavailable_code(self, exc: BaseException) -> str | None:
        """By SQLSTATE: a lock wait past ``lock_timeout`` (``55P03``) is busy, as is no
        pooled connection free in time while the database accepts connections (each
        waiting for a lock, or the node's load); ``53100`` full; ``25006`` read-only
        (``default_transaction_read_only``, a standby); a connection that failed, was
        refused or closed (no SQLSTATE, class ``08``, ``57P01``-``57P03``) unavailable.
        A deadlock or a cancelled statement is none of them."""
        if isinstance(exc, PoolTimeout):
            return DATABASE_UNAVAILABLE if self._connect_errors.last else DATABASE_BUSY
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return DATABASE_BUSY
        if isinstance(exc, psycopg.errors.DiskFull):
            return DATABASE_FULL
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            return DATABASE_READ_ONLY
        if not isinstance(exc, psycopg.OperationalError):
            return None
        state = exc.sqlstate
        if state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03"):
            return DATABASE_UNAVAILABLE
        return None

    def disk_space(self) -> None:
        """None: the database's disk is its server's, not the node's to see."""
        return None

    def connect_refusal(self) -> tuple[str, str] | None:
        """Why a call waiting for a connection waits, when PostgreSQL itself refused the
        pools' last connect (``_ConnectErrors``): the error's type and the server's own
        words (``database "orbit" is not currently accepting connections``), without
        the host, port or URL libpq's message starts with, and with every name it quotes
        (a database, a user, a client's address) left out. None if a connect has
        succeeded since, or the last failed short of a server's answer (unreachable,
        refused by the network: a wait that ran out says as much)."""
        error = self._connect_errors.last
        refusal = None if error is None else server_refusal(error)
        return None if refusal is None else (type(error).__name__, refusal)

    def close(self) -> None:
        self._pool.close()
        self._relaxed.close()
