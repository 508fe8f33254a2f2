"""PostgreSQL driver over a psycopg 3 connection pool.

Named queries are written with ``:name`` parameters and translated once to psycopg's
``%(name)s``. A ``*_many`` write sends all its rows as one JSON document that the
statement unpacks with ``jsonb_to_recordset``: one statement, one round trip. The clock is
``clock_timestamp()`` read inside the transaction after the rows it judges are locked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from orbit.store.driver import Params, Row, load_queries

_HERE = Path(__file__).parent
_PARAM_RE = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def to_psycopg(sql: str) -> str:
    """``:name`` -> ``%(name)s``, leaving ``::casts`` and literal ``%`` intact."""
    return _PARAM_RE.sub(r"%(\1)s", sql.replace("%", "%%"))


def _rows_json(rows: Sequence[Row]) -> str:
    """The rows as one JSON array; orjson is several times faster than the standard
    library, which matters at hundreds of rows per batched write. Row values are column
    values (64-bit integers, text, booleans), which orjson always encodes; the fallback
    only keeps the same behaviour if one ever is not."""
    try:
        return orjson.dumps(list(rows)).decode("utf-8")
    except TypeError:
        return json.dumps(list(rows))


class _PostgresConnection:
    def __init__(self, cx: psycopg.Connection[Any], queries: dict[str, str]) -> None:
        self._cx = cx
        self._queries = queries

    def fetch(self, name: str, params: Params) -> list[Row]:
        with self._cx.cursor(row_factory=dict_row) as cur:
            cur.execute(self._queries[name], params)
            return cur.fetchall() if cur.description else []

    def write_many(self, name: str, rows: Sequence[Row]) -> int:
        if not rows:
            return 0
        with self._cx.cursor() as cur:
            cur.execute(self._queries[name], {"rows": _rows_json(rows)})
            return len(cur.fetchall()) if cur.description else cur.rowcount

    def execute(self, name: str, params: Params) -> int:
        with self._cx.cursor() as cur:
            cur.execute(self._queries[name], params)
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
        self.migrations = _HERE / "migrations"
        self._pool = ConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            open=True,
            kwargs={"autocommit": False},
            name="orbit",
        )

    @contextmanager
    def transaction(self) -> Iterator[_PostgresConnection]:
        with self._pool.connection() as cx, cx.transaction():
            yield _PostgresConnection(cx, self.queries)

    def is_retryable(self, exc: BaseException) -> bool:
        return isinstance(
            exc,
            psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure,
        )

    def close(self) -> None:
        self._pool.close()
