"""SQLite runs one statement per call: a named write of several is split on line-ending ';'; a
write of rows held by column is bound by position where its statement allows."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from orbit.store.driver import RowColumns, load_queries
from orbit.store.sqlite.driver import _SqliteConnection, positional, statements

QUERIES = Path(__file__).resolve().parents[2] / "orbit" / "store" / "sqlite" / "queries.sql"


def test_a_query_is_split_only_where_a_statement_ends_a_line() -> None:
    split = statements(
        {
            "one": "SELECT ';' AS semicolon FROM t WHERE a = :a",
            "two": "INSERT INTO t (a) VALUES (:a);\nINSERT INTO u (a) VALUES (:a)",
            "spaced": "UPDATE t SET a = 1;  \n\nUPDATE u SET a = 2",
        }
    )
    assert split == {
        "one": ["SELECT ';' AS semicolon FROM t WHERE a = :a"],
        "two": ["INSERT INTO t (a) VALUES (:a)", "INSERT INTO u (a) VALUES (:a)"],
        "spaced": ["UPDATE t SET a = 1", "UPDATE u SET a = 2"],
    }


def test_only_the_submit_write_has_several_statements() -> None:
    """The tasks, then their events; every other query stays one statement."""
    several = {k: v for k, v in statements(load_queries(QUERIES)).items() if len(v) != 1}
    assert list(several) == ["task_submit_many"]
    first, second = several["task_submit_many"]
    assert first.startswith("INSERT INTO orbit_tasks")
    assert second.startswith("INSERT INTO orbit_events")


def test_a_write_of_columns_is_bound_by_position_to_the_names_it_uses() -> None:
    """Each ``:name`` becomes ``?N`` by its first appearance, a name used twice the same
    N, and only the names used are bound; a literal, an unknown name or no name at all
    keeps the dicts' way."""
    names = ("id", "n", "unused", "s")
    assert positional("UPDATE t SET n = :n, m = :n + 1 WHERE id = :id AND s = :s", names) == (
        "UPDATE t SET n = ?1, m = ?1 + 1 WHERE id = ?2 AND s = ?3",
        ("n", "id", "s"),
    )
    assert positional("UPDATE t SET n = :n WHERE s = 'a:id'", names) is None
    assert positional("UPDATE t SET n = :other", names) is None
    assert positional("DELETE FROM t", names) is None


def _table_after(write: Callable[[_SqliteConnection], int]) -> tuple[int, list[tuple[object, ...]]]:
    cx = sqlite3.connect(":memory:", isolation_level=None)
    cx.execute("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER, m INTEGER, s TEXT, j TEXT)")
    cx.executemany("INSERT INTO t (id, n) VALUES (?, 0)", [("a",), ("b",), ("c",)])
    count = write(_SqliteConnection(cx, {}, WRITES))
    return count, cx.execute("SELECT * FROM t ORDER BY id").fetchall()


WRITES = {
    "w": ["UPDATE t SET n = :n, m = :n * 2, s = :s, j = :j WHERE id = :id AND n = :expect"],
    "quoted": ["UPDATE t SET n = :n, s = ':' || :s, j = :j WHERE id = :id AND n = :expect"],
}


@pytest.mark.parametrize("name", ["w", "quoted"])
def test_a_write_of_columns_changes_what_its_rows_as_dicts_change(name: str) -> None:
    """By position or by dicts, the same rows written and counted: NULLs, lists (as JSON
    text), a row whose guard misses."""
    held = RowColumns(
        {
            "id": ["a", "b", "c"],
            "expect": [0, 0, 7],
            "n": [1, None, 3],
            "s": ["x", None, "z"],
            "j": [["p", 1], None, ("q",)],
            "unused": [1, 2, 3],
        }
    )
    by_columns = _table_after(lambda c: c.write_many(name, held))
    by_dicts = _table_after(lambda c: c.write_many(name, list(held)))
    assert by_columns == by_dicts
    assert by_columns[1][0][4] == '["p", 1]' and by_columns[1][2] == ("c", 0, None, None, None)
