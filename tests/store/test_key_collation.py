"""Every indexed text column compares byte by byte: "C" on PostgreSQL (migration 0004),
SQLite's default BINARY. A locale-aware collation (a cluster's "C.UTF-8" or "en_US")
would send each B-tree comparison of an id through strcoll(), for keys that are ASCII,
and order them differently from Python's ``sorted``, which the store uses to lock rows in
a fixed order."""

from __future__ import annotations

from orbit.store import Store
from tests.store.helpers import queue, submit

_PG_TEXT_KEYS = """
SELECT c.relname AS table_name, i.relname AS index_name, a.attname AS column_name,
       coll.collname AS collation
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class c ON c.oid = x.indrelid
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(x.indkey)
JOIN pg_collation coll ON coll.oid = a.attcollation
WHERE c.relname LIKE 'orbit\\_%' AND a.atttypid = 'text'::regtype
ORDER BY 1, 2, 3
"""


def _indexed_text_columns(store: Store) -> list[tuple[str, str, str, str]]:
    """(table, index, column, collation) of every text column in an index of Orbit's."""
    if store.backend == "postgres":
        import psycopg

        with psycopg.connect(store.driver.dsn) as cx:  # type: ignore[attr-defined]
            return [tuple(r) for r in cx.execute(_PG_TEXT_KEYS).fetchall()]  # type: ignore[misc]
    import sqlite3

    found: list[tuple[str, str, str, str]] = []
    with sqlite3.connect(store.driver.path) as cx:  # type: ignore[attr-defined]
        tables = [
            r[0]
            for r in cx.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'orbit_%'"
            )
        ]
        for table in tables:
            types = {r[1]: r[2].lower() for r in cx.execute(f"PRAGMA table_info({table})")}
            for _, index, *_ in cx.execute(f"PRAGMA index_list({table})"):
                for row in cx.execute(f"PRAGMA index_xinfo({index})"):
                    column, collation, is_key = row[2], row[4], row[5]
                    if is_key and column is not None and types.get(column) == "text":
                        found.append((table, index, column, collation))
    return found


def test_every_indexed_text_column_compares_bytes(store: Store) -> None:
    columns = _indexed_text_columns(store)
    # the keys a drain walks are among them (the check is not vacuous)
    names = {(table, column) for table, _, column, _ in columns}
    assert {("orbit_tasks", "id"), ("orbit_attempts", "id"), ("orbit_attempts", "task_id")} <= (
        names
    )
    expected = "C" if store.backend == "postgres" else "BINARY"
    assert [c for c in columns if c[3] != expected] == []


def test_ids_come_back_in_pythons_order(store: Store) -> None:
    """The database orders keys as ``sorted`` does, so locks taken in either order agree;
    names that a locale orders differently (case, punctuation) show it."""
    for name in ["b", "B", "a-z", "a.z", "a_z", "A", "a", "0", "Z:1"]:
        queue(store, name)
    assert [q.name for q in store.queue_list()] == sorted(
        ["b", "B", "a-z", "a.z", "a_z", "A", "a", "0", "Z:1"]
    )
    ids = [submit(store, queue="a", payload=i) for i in range(3)]
    assert sorted(ids) == [t.id for t in store.task_list(limit=10)]
