"""SQLite runs one statement per call: a named write of several is split on line-ending ';'."""

from __future__ import annotations

from pathlib import Path

from orbit.store.driver import load_queries
from orbit.store.sqlite.driver import statements

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
