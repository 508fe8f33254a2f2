"""The PostgreSQL driver's statements sent through libpq directly (``_Raw``).

``BEGIN``, ``COMMIT``, ``ROLLBACK``, the composed locking reads, the batched writes and
the clock go as libpq's blocking calls, each statement prepared once per connection,
their parameters in PostgreSQL's text format. These tests hold that path to what psycopg
gave before: values exact, a NUL refused before anything is sent, server errors raised
as psycopg's class for their SQLSTATE, and prepared statements that survive a rollback
and are made again on a new connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from orbit.store import Store
from orbit.store.postgres.driver import PostgresDriver
from tests.store.helpers import postgres_driver

pytestmark = pytest.mark.parametrize("backend", ["postgres"])

AWKWARD = ["it's", 'a "quote"', "back\\slash", "$1 %s %(x)s", "snow ☃", "", "{a,b}"]


@pytest.fixture
def driver(store: Store) -> Iterator[PostgresDriver]:
    yield postgres_driver(
        store,
        {
            "test_pick": "SELECT CAST(%(v)s AS text) AS v, CAST(%(n)s AS bigint) AS n,"
            " CAST(%(f)s AS double precision) AS f, CAST(%(b)s AS boolean) AS b,"
            " CAST(%(z)s AS text) AS z",
            "test_names": "SELECT name FROM orbit_settings WHERE name = ANY(%(names)s)",
            "test_note": "INSERT INTO orbit_settings (name, int_value) VALUES (%(name)s, 1)",
        },
    )


def _prepared(raw: psycopg.Connection[Any]) -> list[str]:
    """The statements prepared on this connection for ``test_pick``."""
    rows = raw.execute(
        "SELECT name FROM pg_prepared_statements"
        " WHERE name LIKE 'orbit%' AND statement LIKE '%AS boolean) AS b%'"
    ).fetchall()
    return [r[0] for r in rows]


def test_a_composed_read_carries_every_parameter_exactly(driver: PostgresDriver) -> None:
    for value in AWKWARD:
        for n, f, b in ((0, 0.5, True), (-(2**63), -1e300, False), (2**63 - 1, 1e-7, True)):
            params = {"v": value, "n": n, "f": f, "b": b, "z": None}
            with driver.transaction() as cx:
                (rows,), now = cx.lock_many([("test_pick", params)])
                (again,), later = cx.lock_many([("test_pick", params)])
            assert rows == again == [{"v": value, "n": n, "f": f, "b": b, "z": None}]
            assert isinstance(now, int) and now <= later


def test_a_list_parameter_reads_back_as_its_items(driver: PostgresDriver) -> None:
    names = ["a,b", 'q"uote', "back\\slash", "{brace}", "NULL"]
    with driver.transaction() as cx:
        for name in names:
            cx.execute("test_note", {"name": name})
        (rows,), _ = cx.lock_many([("test_names", {"names": names})])
    assert sorted(r["name"] for r in rows) == sorted(names)


def test_a_nul_is_refused_before_it_is_sent_and_nothing_stays_open(
    driver: PostgresDriver,
) -> None:
    raw: Any = None
    with pytest.raises(psycopg.DataError), driver.transaction() as cx:
        raw = cx._cx  # type: ignore[attr-defined]
        cx.lock_many([("test_pick", {"v": "a\x00b", "n": 1, "f": 1.0, "b": True, "z": None})])
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with driver.transaction() as cx:
        (rows,), _ = cx.lock_many([("test_pick", {"v": "ok", "n": 1, "f": 1, "b": 0, "z": "z"})])
    assert rows == [{"v": "ok", "n": 1, "f": 1.0, "b": False, "z": "z"}]


def test_a_server_error_is_psycopgs_class_for_its_sqlstate_and_rolls_back(
    driver: PostgresDriver,
) -> None:
    with driver.transaction() as cx:
        cx.write_many("queue_tokens_write_many", [])  # no rows: nothing sent
    with pytest.raises(psycopg.errors.InvalidTextRepresentation), driver.transaction() as cx:
        cx.execute("test_note", {"name": "undone"})
        cx.lock_many([("test_pick", {"v": "x", "n": "many", "f": 1, "b": True, "z": None})])
    with driver.transaction() as cx:
        (rows,), _ = cx.lock_many([("test_names", {"names": ["undone"]})])
    assert rows == []  # the note before the error was rolled back


def test_statements_are_prepared_once_per_connection_and_survive_a_rollback(
    driver: PostgresDriver,
) -> None:
    params = {"v": "x", "n": 1, "f": 1.0, "b": True, "z": None}
    raw: Any = None
    with pytest.raises(RuntimeError), driver.transaction() as cx:
        raw = cx._cx  # type: ignore[attr-defined]
        cx.lock_many([("test_pick", params)])  # prepared here, then rolled back
        raise RuntimeError("the work failed")
    (name,) = _prepared(raw)  # PostgreSQL keeps a prepared statement through a rollback
    sql, _ = driver._statements.locks[("test_pick",), False]
    assert driver._statements.statement(raw, sql) == (name.encode(), False)  # and knows it
    for _ in range(5):
        with driver.transaction() as cx:
            (rows,), _ = cx.lock_many([("test_pick", params)])
            assert rows == [params]
            assert len(_prepared(cx._cx)) == 1  # type: ignore[attr-defined]  # never twice


def test_a_new_connection_prepares_its_statements_again(driver: PostgresDriver) -> None:
    params = {"v": "x", "n": 1, "f": 1.0, "b": True, "z": None}
    for _ in range(3):
        with pytest.raises(psycopg.OperationalError), driver.transaction() as cx:
            (rows,), _ = cx.lock_many([("test_pick", params)])
            assert rows == [params]
            cx._cx.close()  # type: ignore[attr-defined]  # broken: the pool discards it
    with driver.transaction() as cx:  # a connection that has never seen the statement
        (rows,), _ = cx.lock_many([("test_pick", params)])
        assert rows == [params]
        assert len(_prepared(cx._cx)) == 1  # type: ignore[attr-defined]
