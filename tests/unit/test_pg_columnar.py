"""The columnar form of PostgreSQL's batched writes (orbit/store/postgres/driver.py):
which rows may travel column by column, and how. The round trips themselves are store
tests (tests/store/test_columnar_writes.py)."""

from __future__ import annotations

from orbit.store.driver import RowColumns, load_queries
from orbit.store.postgres.driver import _HERE, columnar_sql, rows_columns, to_psycopg

COLUMNS = (("id", "text"), ("n", "bigint"), ("ok", "boolean"), ("f", "double precision"))


def test_every_batched_write_has_a_columnar_form() -> None:
    queries = {k: to_psycopg(v) for k, v in load_queries(_HERE / "queries.sql").items()}
    batched = {name for name, sql in queries.items() if "json_to_recordset" in sql}
    assert {"task_submit_many", "attempt_write_many", "event_insert_many"} <= batched
    for name in batched:
        form = columnar_sql(queries[name])
        assert form is not None, name
        sql, columns = form
        assert "json_to_recordset" not in sql
        assert all(f"%(rows__{column})s" in sql for column, _ in columns)


def test_rows_travel_as_one_string_per_column() -> None:
    rows = [
        {"id": "a", "n": 1, "ok": True, "f": 0.5},
        {"id": None, "n": None, "ok": None, "f": None},
        {"id": "None", "n": -(2**63), "ok": False, "f": 2},
    ]
    assert rows_columns(rows, COLUMNS) == {
        "rows__id": "a\x1f\x1e\x1fNone",
        "rows__n": "1,null,-9223372036854775808",
        "rows__ok": "true,null,false",
        "rows__f": "0.5,null,2",
    }
    held = RowColumns({name: [r[name] for r in rows] for name, _ in COLUMNS})
    assert rows_columns(held, COLUMNS) == rows_columns(rows, COLUMNS)


def test_rows_that_could_be_misread_go_as_json() -> None:
    def row(**kw: object) -> dict[str, object]:
        return {"id": "x", "n": 1, "ok": True, "f": 1.0, **kw}

    for bad in (
        [row(id="a\x1fb")],  # the separator
        [row(id="\x1e")],  # the NULL spelling
        [row(id="\x1e\x1e"), row(id=None)],
        [row(id="ok"), row(id="a\x1eb"), row(id=None)],  # inside a value, beside a NULL
        [row(id=None), row(id="ok"), row(id="b\x1f")],
        [row(id="")],  # a lone empty string: string_to_array('') has no element
        [row(id=3)],  # not a string
        [row(n=2**64)],  # past 64 bits: orjson refuses it
        [{"id": "x", "n": 1, "ok": True}],  # a column missing
        [],  # no rows
    ):
        assert rows_columns(bad, COLUMNS) is None, bad
        if bad and all(r.keys() == bad[0].keys() for r in bad):  # and held by column
            held = RowColumns({k: [r[k] for r in bad] for k in bad[0]})
            assert rows_columns(held, COLUMNS) is None, bad
    assert rows_columns([row(id=""), row(id="")], COLUMNS) is not None  # two are fine
