"""The columnar form of PostgreSQL's batched writes (orbit/store/postgres/driver.py):
which rows may travel column by column, and how. The round trips themselves are store
tests (tests/store/test_columnar_writes.py)."""

from __future__ import annotations

import pytest

from orbit.store.driver import RowColumns, load_queries
from orbit.store.postgres.driver import (
    _HERE,
    COLUMNAR_MIN_ROWS,
    columnar_sql,
    rows_columns,
    to_psycopg,
    uniform_forms,
    uniform_params,
)

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


def test_the_batch_submit_has_a_uniform_form() -> None:
    """``task_submit_many_uniform`` reads every column of ``task_submit_many`` but the ids,
    payloads and digests once each, and leaves out only the idempotency key."""
    queries = {k: to_psycopg(v) for k, v in load_queries(_HERE / "queries.sql").items()}
    columnar = {n: f for n, f in ((n, columnar_sql(q)) for n, q in queries.items()) if f}
    forms = uniform_forms(queries, columnar)
    assert set(forms) == {"task_submit_many"}
    name, ones, nulls = forms["task_submit_many"]
    assert name == "task_submit_many_uniform"
    assert nulls == ("idempotency_key",)
    arrays = {column for column, _ in columnar[name][1]}
    assert arrays == {"id", "payload", "payload_digest"}
    every = {column for column, _ in columnar["task_submit_many"][1]}
    assert set(ones) | arrays | set(nulls) == every


def test_a_uniform_form_fits_only_rows_alike_in_its_columns() -> None:
    uniform = ("w_uniform", ("q", "n"), ("key",))
    n = COLUMNAR_MIN_ROWS

    def held(**changed: object) -> RowColumns:
        columns: dict[str, list[object]] = {
            "id": [str(i) for i in range(n)],
            "q": ["a"] * n,
            "n": [1] * n,
            "key": [None] * n,
        }
        for name, value in changed.items():
            columns[name][-1] = value
        return RowColumns(columns)

    assert uniform_params(held(), uniform) == {"one__q": "a", "one__n": 1}
    assert uniform_params(held(n=1.0), uniform) == {"one__q": "a", "one__n": 1}  # one value
    for unlike in (held(q="b"), held(n=2), held(n=None), held(key="k"), held(key="")):
        assert uniform_params(unlike, uniform) is None
    few = RowColumns({k: v[1:] for k, v in held().columns.items()})
    assert uniform_params(few, uniform) is None  # fewer than COLUMNAR_MIN_ROWS
    assert uniform_params(list(held()), uniform) is None  # not held by column
    lacking = RowColumns({k: v for k, v in held().columns.items() if k != "key"})
    assert uniform_params(lacking, uniform) is None


def test_a_uniform_form_must_read_only_its_writes_columns() -> None:
    base = "SELECT 1 FROM json_to_recordset(CAST(%(rows)s AS json)) AS x(id text, q text)"
    odd = "SELECT %(one__z)s FROM json_to_recordset(CAST(%(rows)s AS json)) AS x(id text, w text)"
    queries = {"w": base, "w_uniform": odd}
    columnar = {n: f for n, f in ((n, columnar_sql(q)) for n, q in queries.items()) if f}
    with pytest.raises(ValueError, match="w_uniform"):
        uniform_forms(queries, columnar)
