"""Lists of strings reach SQL exactly, whatever they hold.

PostgreSQL receives them as array literals built by the driver (``text_array``), SQLite
as JSON arrays; either way a query must read back the very strings it was given, in
order, including the characters an array literal has to escape.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orbit.store import Store
from orbit.store.postgres.driver import text_array

ECHO = {
    "postgres": "SELECT x FROM unnest(CAST(%(items)s AS text[])) WITH ORDINALITY AS u(x, n) "
    "ORDER BY n",
    "sqlite": "SELECT value AS x FROM json_each(:items) ORDER BY key",
}
AWKWARD = [
    "plain",
    'a "quoted" word',
    "back\\slash",
    "trailing\\",
    "comma,separated",
    "{braces}",
    "  spaces  ",
    "NULL",
    "null",
    "",
    "é ünïcödé ✓",
    "tab\tand\nnewline",
]


@pytest.mark.parametrize("items", [[], ["one"], AWKWARD], ids=["empty", "one", "awkward"])
def test_a_list_of_strings_reads_back_exactly(store: Store, items: list[str]) -> None:
    store.driver.queries["test_echo"] = ECHO[store.backend]
    with store.driver.transaction() as cx:
        rows = cx.fetch("test_echo", {"items": items})
    assert [r["x"] for r in rows] == items


def test_text_array_quotes_every_element() -> None:
    assert text_array([]) == "{}"
    assert text_array(["a", 'b"c', "d\\e"]) == '{"a","b\\"c","d\\\\e"}'


def _escaped_each(items: list[str]) -> str:
    """The array literal with every element escaped on its own (``text_array``'s general
    form, which it skips when nothing needs escaping)."""
    quoted = ",".join('"' + i.replace("\\", "\\\\").replace('"', '\\"') + '"' for i in items)
    return "{" + quoted + "}"


PLAIN = [s for s in AWKWARD if '"' not in s and "\\" not in s]


@pytest.mark.parametrize(
    "items", [PLAIN, [""], ["", ""], ["a", ""], ['"'], ["\\"], ['a","b'], ["", '"', ""]]
)
def test_text_array_joins_what_needs_no_escape_as_each_escaped(items: list[str]) -> None:
    """Joined in one call when no element holds a quote or a backslash, the literal is
    the one each element escaped on its own makes; any such element takes that form."""
    assert text_array(items) == _escaped_each(items)


@given(st.lists(st.text(alphabet=st.sampled_from('ab",\\{} \x1f'), max_size=4), max_size=5))
def test_text_array_is_each_element_escaped(items: list[str]) -> None:
    assert text_array(items) == _escaped_each(items)


@pytest.mark.parametrize("items", [PLAIN, [""], ["", ""]], ids=["plain", "empty", "empties"])
def test_a_list_needing_no_escape_reads_back_exactly(store: Store, items: list[str]) -> None:
    store.driver.queries["test_echo"] = ECHO[store.backend]
    with store.driver.transaction() as cx:
        rows = cx.fetch("test_echo", {"items": items})
    assert [r["x"] for r in rows] == items
