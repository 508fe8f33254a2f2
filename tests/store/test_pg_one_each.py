"""Statements for one item per parameter (``one_each_sql``), on PostgreSQL.

A report of one task (a start, a finish) reads and writes through statements whose list
parameters hold one id and whose row counts are one. The driver sends those in a form
whose generic plan is the plan for one row, so PostgreSQL keeps it rather than planning
every run. These tests hold that form to the same answers as the general one, and check
that PostgreSQL does keep its generic plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from orbit.store import Store
from orbit.store.postgres.driver import PostgresDriver, one_each_sql
from tests.store.helpers import postgres_driver

pytestmark = pytest.mark.parametrize("backend", ["postgres"])


@pytest.fixture
def driver(store: Store) -> Iterator[PostgresDriver]:
    drv = postgres_driver(
        store,
        {
            "test_settings": "SELECT name, int_value FROM orbit_settings"
            " WHERE name = ANY(CAST(%(names)s AS text[])) ORDER BY name FOR UPDATE",
            "test_bump_many": "UPDATE orbit_settings AS s SET int_value = x.int_value"
            " FROM (SELECT * FROM json_to_recordset(CAST(%(rows)s AS json))"
            " AS x(name text, int_value bigint) LIMIT %(rows_n)s) AS x"
            " WHERE s.name = x.name RETURNING s.name",
            "test_note": "INSERT INTO orbit_settings (name, int_value)"
            " VALUES (%(name)s, %(value)s)",
        },
    )
    with drv.transaction() as cx:
        for i, name in enumerate(("one-a", "one-b", "one-c")):
            cx.execute("test_note", {"name": name, "value": i})
    yield drv


def _plans(cx: Any, fragment: str) -> list[tuple[str, int, int]]:
    """(statement, generic plans, custom plans) prepared on this connection."""
    rows = cx._cx.execute(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE name LIKE 'orbit%%' AND statement LIKE %s",
        (f"%{fragment}%",),
    ).fetchall()
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


def test_one_id_reads_the_same_rows_through_the_one_each_form(driver: PostgresDriver) -> None:
    with driver.transaction() as cx:
        (one,), _ = cx.lock_many([("test_settings", {"names": ["one-b"]})])
        (two,), _ = cx.lock_many([("test_settings", {"names": ["one-b", "one-c"]})])
        (none,), _ = cx.lock_many([("test_settings", {"names": ["missing"]})])
        fetched = cx.fetch("test_settings", {"names": ["one-c"]})
        statements = {s for s, _, _ in _plans(cx, "FROM orbit_settings")}
    assert one == [{"name": "one-b", "int_value": 1}]
    assert two == [{"name": "one-b", "int_value": 1}, {"name": "one-c", "int_value": 2}]
    assert none == []
    assert fetched == [{"name": "one-c", "int_value": 2}]
    assert any("[1]" in s and "ANY" not in s for s in statements)  # one id each
    assert any("ANY" in s for s in statements)  # the general form, for two ids


def test_one_row_writes_through_the_one_each_form(driver: PostgresDriver) -> None:
    with driver.transaction() as cx:
        written = cx.write_many("test_bump_many", [{"name": "one-a", "int_value": 7}])
        both = cx.write_many(
            "test_bump_many",
            [{"name": "one-b", "int_value": 8}, {"name": "one-c", "int_value": 9}],
        )
        rows = cx.fetch("test_settings", {"names": ["one-a", "one-b", "one-c"]})
        statements = {s for s, _, _ in _plans(cx, "UPDATE orbit_settings")}
    assert (written, both) == (1, 2)
    assert [r["int_value"] for r in rows] == [7, 8, 9]
    assert any("LIMIT 1)" in s for s in statements)
    assert any("LIMIT $2)" in s for s in statements)


def test_postgresql_keeps_the_generic_plan_of_a_one_id_read(driver: PostgresDriver) -> None:
    # PostgreSQL plans a prepared statement's first five runs for their parameters, then
    # keeps its generic plan if that costs no more than they did on average.
    with driver.transaction() as cx:  # one connection, so one prepared statement
        for _ in range(12):
            (rows,), _ = cx.lock_many([("test_settings", {"names": ["one-a"]})])
            assert rows == [{"name": "one-a", "int_value": 0}]
        ((_, generic, custom),) = [p for p in _plans(cx, "FROM orbit_settings") if "[1]" in p[0]]
    assert (generic, custom) == (7, 5)


def test_a_nul_in_a_one_item_list_is_still_refused(driver: PostgresDriver) -> None:
    with pytest.raises(psycopg.DataError), driver.transaction() as cx:
        cx.lock_many([("test_settings", {"names": ["a\x00b"]})])


def test_the_claims_ready_select_keeps_its_general_form(driver: PostgresDriver) -> None:
    # Its generic plan, blind to LIMIT :limit and run_after <= :now, read the whole table
    # and sorted it: one handler and one skipped queue, tenant and id must not change it.
    sql = driver.queries["task_ready_select"]
    assert "ANY(" in sql and one_each_sql(sql) == sql
