"""PostgreSQL driver over a psycopg 3 connection pool.

Named queries are written with ``:name`` parameters and translated once to psycopg's
``%(name)s``. A ``*_many`` write sends all its rows as one JSON document that the
statement unpacks with ``json_to_recordset``: one statement, one round trip (``json``, not
``jsonb``: the rows are read once, so building the binary form would be wasted; it cost
PostgreSQL a fifth to a quarter more per batch). Every such write is also given its row
count as ``:rows_n``: an update reads its rows through ``LIMIT :rows_n``, because the
planner otherwise guesses 100 rows from the function and, on a table of a few thousand
rows, scans all of it to update ten (docs/operations.md, "Query plans"). The clock is
``clock_timestamp()`` read inside the transaction after the rows it judges are locked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from orbit.core.model import compact_json, parse_json
from orbit.store.driver import Params, Row, load_queries
from orbit.store.postgres.plans import PlanWatch

_HERE = Path(__file__).parent
_PARAM_RE = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def to_psycopg(sql: str) -> str:
    """``:name`` -> ``%(name)s``, leaving ``::casts`` and literal ``%`` intact."""
    return _PARAM_RE.sub(r"%(\1)s", sql.replace("%", "%%"))


def _rows_json(rows: Sequence[Row]) -> str:
    """The rows as one JSON array (orjson: hundreds of rows per batched write)."""
    return compact_json(list(rows)).decode("utf-8")


_PSYCOPG_PARAM_RE = re.compile(r"%\((\w+)\)s")


def text_array(items: Sequence[str]) -> str:
    """A list of strings as a PostgreSQL array literal, every element quoted and escaped:
    each ``CAST(:x AS text[])`` reads it back exactly. psycopg's list dumper, which does
    the same one element at a time in Python, was a visible share of a batch's time (a
    start or finish batch sends hundreds of ids)."""
    quoted = ",".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items)
    return "{" + quoted + "}"


def _arrays(params: Params) -> Params:
    """Lists of strings as array literals (see ``text_array``); other values as they are."""
    return {
        key: text_array(value)
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        else value
        for key, value in params.items()
    }


def _scoped(sql: str, i: int) -> str:
    """Rename a query's parameters ``%(x)s`` -> ``%(p<i>_x)s`` so that several queries
    can share one statement without their parameters colliding."""
    return _PSYCOPG_PARAM_RE.sub(lambda m: f"%(p{i}_{m.group(1)})s", sql)


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
#: statement saves a round trip per read, which is most of a small report's cost, but
#: returns the rows as JSON, which costs PostgreSQL and this process more per row than
#: plain rows do: for a batch of hundreds (a busy worker's starts and finishes) the
#: separate reads were cheaper (``python -m benchmarks.probe``).
LOCK_MANY_INLINE_MAX = 16


def _largest_list(calls: Sequence[tuple[str, Params]]) -> int:
    return max(
        (len(v) for _, params in calls for v in params.values() if isinstance(v, list | tuple)),
        default=0,
    )


def write_batch_sql(queries: Sequence[str]) -> str:
    """One statement that runs each ``*_many`` write as a data-modifying CTE and returns
    how many rows each wrote. PostgreSQL runs every such CTE exactly once, and checks
    foreign keys at the end of the statement, when all of them have run."""
    for q in queries:
        if "RETURNING" not in q.upper():
            raise ValueError("a batched write must end with RETURNING, to count its rows")
    ctes = ",\n".join(f"w{i} AS ({_scoped(q, i)})" for i, q in enumerate(queries))
    counts = ", ".join(f"(SELECT count(*) FROM w{i}) AS c{i}" for i in range(len(queries)))
    return f"WITH {ctes}\nSELECT {counts}"


def _has_rows(cur: psycopg.Cursor[Any]) -> bool:
    """Whether the statement returned rows. ``cur.description`` would say so too, but it
    builds an object per column on every call: a row of orbit_tasks has 31."""
    result = cur.pgresult
    return result is not None and result.nfields > 0


class _PostgresConnection:
    def __init__(
        self, cx: psycopg.Connection[Any], queries: dict[str, str], composed: dict[Any, str]
    ) -> None:
        self._cx = cx
        self._queries = queries
        self._composed = composed  # the driver's cache of lock_many/write_batch statements

    def _compose(self, kind: str, names: tuple[str, ...]) -> str:
        key = (kind, names)
        sql = self._composed.get(key)
        if sql is None:
            queries = [self._queries[n] for n in names]
            if kind == "lock":
                sql = lock_many_sql(queries, self._queries["clock_now"])
            else:
                sql = write_batch_sql(queries)
            self._composed[key] = sql
        return sql

    def lock_many(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[list[Row]], int]:
        if _largest_list(calls) > LOCK_MANY_INLINE_MAX:  # see LOCK_MANY_INLINE_MAX
            found = [self.fetch(name, params) for name, params in calls]
            return found, self.now()
        # One statement (lock_many_sql), each query's parameters scoped by its position.
        sql = self._compose("lock", tuple(name for name, _ in calls))
        params = _arrays({f"p{i}_{k}": v for i, (_, ps) in enumerate(calls) for k, v in ps.items()})
        with self._cx.cursor() as cur:
            cur.execute(sql, params)
            row = cur.fetchone()
        assert row is not None
        *found, now = row
        return [parse_json(rows) for rows in found], int(now)

    def write_batch(self, writes: Sequence[tuple[str, Sequence[Row]]]) -> list[int]:
        if len(writes) == 1:
            return [self.write_many(*writes[0])]
        sql = self._compose("write", tuple(name for name, _ in writes))
        params: Params = {}
        for i, (_, rows) in enumerate(writes):
            params[f"p{i}_rows"] = _rows_json(rows)
            params[f"p{i}_rows_n"] = len(rows)
        with self._cx.cursor() as cur:
            cur.execute(sql, params)
            row = cur.fetchone()
        assert row is not None
        return [int(n) for n in row]

    def fetch(self, name: str, params: Params) -> list[Row]:
        with self._cx.cursor(row_factory=dict_row) as cur:
            cur.execute(self._queries[name], _arrays(params))
            return cur.fetchall() if _has_rows(cur) else []

    def write_many(self, name: str, rows: Sequence[Row]) -> int:
        if not rows:
            return 0
        with self._cx.cursor() as cur:
            cur.execute(self._queries[name], {"rows": _rows_json(rows), "rows_n": len(rows)})
            return len(cur.fetchall()) if _has_rows(cur) else cur.rowcount

    def execute(self, name: str, params: Params) -> int:
        with self._cx.cursor() as cur:
            cur.execute(self._queries[name], _arrays(params))
            return cur.rowcount

    def now(self) -> int:
        with self._cx.cursor() as cur:
            cur.execute(self._queries["clock_now"])
            row = cur.fetchone()
            assert row is not None
            return int(row[0])

    def run_script(self, sql: str) -> None:
        self._cx.execute(sql.encode("utf-8"))


class PostgresDriver:
    name = "postgres"

    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 8) -> None:
        self.dsn = dsn
        self.queries = {k: to_psycopg(v) for k, v in load_queries(_HERE / "queries.sql").items()}
        self._composed: dict[Any, str] = {}
        self.migrations = _HERE / "migrations"
        self._pool = ConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            open=True,
            kwargs={"autocommit": False},
            name="orbit",
        )
        self.plans = PlanWatch()

    @contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[_PostgresConnection]:
        with self._pool.connection() as cx, cx.transaction():
            self.plans.before_transaction(cx)
            if not durable:  # SET LOCAL: ends with this transaction, whatever its outcome
                cx.execute(self.queries["commit_relaxed"])
            yield _PostgresConnection(cx, self.queries, self._composed)

    def is_retryable(self, exc: BaseException) -> bool:
        return isinstance(
            exc,
            psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure,
        )

    def close(self) -> None:
        self._pool.close()
