"""Parameters in PostgreSQL's text format, as the driver's libpq path sends them."""

from __future__ import annotations

import psycopg
import pytest

from orbit.store.postgres.driver import _dump, one_each, one_each_sql


def test_parameters_in_text_format() -> None:
    assert _dump(None) is None
    assert _dump(True) == b"t" and _dump(False) == b"f"
    assert _dump(-(2**63)) == b"-9223372036854775808"
    assert _dump(0.1) == b"0.1" and _dump(1e300) == b"1e+300"
    assert _dump("snow ☃") == "snow ☃".encode()
    with pytest.raises(psycopg.DataError):
        _dump("a\x00b")
    with pytest.raises(TypeError):
        _dump(b"bytes")


def test_the_one_each_form_reads_one_item_where_the_general_form_reads_a_list() -> None:
    sql = (
        "SELECT * FROM t WHERE id = ANY(CAST(%(ids)s AS text[]))"
        " AND NOT (q = ANY(CAST(%(p1_skip)s AS double precision[])))"
        " AND x IN (SELECT y FROM u LIMIT %(p0_rows_n)s)"
    )
    assert one_each_sql(sql) == (
        "SELECT * FROM t WHERE id = (CAST(%(ids)s AS text[]))[1]"
        " AND NOT (q = (CAST(%(p1_skip)s AS double precision[]))[1])"
        " AND x IN (SELECT y FROM u LIMIT 1)"
    )
    assert one_each_sql("SELECT 1 WHERE a = %(a)s") == "SELECT 1 WHERE a = %(a)s"


def test_a_statement_with_a_limit_of_its_own_keeps_its_general_form() -> None:
    sql = "SELECT * FROM t WHERE id = ANY(CAST(%(ids)s AS text[])) LIMIT %(limit)s"
    assert one_each_sql(sql) == sql  # its generic plan would be blind to the limit
    sql = "SELECT * FROM t WHERE id = ANY(CAST(%(ids)s AS text[])) LIMIT %(p2_rows_n)s"
    assert one_each_sql(sql).endswith("[1] LIMIT 1")


def test_the_one_each_form_is_chosen_only_when_every_list_and_row_count_is_one() -> None:
    assert one_each({"ids": ["a"]})
    assert one_each({"p0_ids": ("a",), "p1_names": ["q"], "p0_rows_n": 1, "id": "s"})
    assert one_each({"rows": "[{}]", "rows_n": 1})
    assert not one_each({"ids": ["a", "b"]})
    assert not one_each({"ids": []})  # none: the general form reads nothing
    assert not one_each({"p0_ids": ["a"], "p1_ids": ["a", "b"]})
    assert not one_each({"ids": ["a"], "rows_n": 2})
    assert not one_each({"id": "s", "limit": 1})  # no list at all: nothing to rewrite
    assert not one_each({})
