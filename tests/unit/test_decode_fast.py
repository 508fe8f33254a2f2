"""``decode_json`` reads a compact document with orjson when orjson would write exactly
that document back; every other document, and every one that breaks a rule, goes
through the strict parser. Whichever path a document takes, the answer (a value, or an
error with its code) must be the strict parser's."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit.protocol.decode import DecodeError, _canonical, _strict_json, decode_json

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)  # both sides of 53 and 64 bits
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8")),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=16,
)


def _outcome(parse: Any, raw: bytes | str) -> tuple[str, Any]:
    try:
        return "value", parse(raw)
    except DecodeError as exc:
        return "error", exc.code


def _spellings(value: Any) -> list[bytes | str]:
    """The document as the worker and the client (httpx) write it (compact, no ASCII
    escaping), as a plain ``json.dumps`` writes it, and as orjson writes it."""
    docs: list[bytes | str] = [
        json.dumps(value, separators=(",", ":"), ensure_ascii=False),
        json.dumps(value),
    ]
    with contextlib.suppress(TypeError):  # an integer past 64 bits
        docs.append(orjson.dumps(value))
    return docs


@settings(max_examples=400)
@given(_values)
def test_every_spelling_decodes_as_the_strict_parser_decodes_it(value: Any) -> None:
    for doc in _spellings(value):
        assert _outcome(decode_json, doc) == _outcome(_strict_json, doc)
        if isinstance(doc, str):
            raw = doc.encode("utf-8")
            assert _outcome(decode_json, raw) == _outcome(_strict_json, raw)


@pytest.mark.parametrize(
    ("doc", "code"),
    [
        (b'{"a":1,"a":1}', "DUPLICATE_KEY"),  # the same value twice: still two keys
        (b'{"a":{"b":1,"b":2}}', "DUPLICATE_KEY"),
        (b"[9223372036854775808]", "NUMBER_OUT_OF_RANGE"),  # orjson reads these ...
        (b"[18446744073709551615]", "NUMBER_OUT_OF_RANGE"),  # ... and writes them back
        (b"[-9223372036854775809]", "NUMBER_OUT_OF_RANGE"),
        (b"[1e400]", "NUMBER_OUT_OF_RANGE"),
        (b"[NaN]", "NON_FINITE_NUMBER"),
        (b'["\\ud800"]', "LONE_SURROGATE"),
        (b'["caf\xe9"]', "INVALID_UTF8"),
        (b"[1,]", "INVALID_JSON"),
    ],
)
def test_a_compact_document_that_breaks_a_rule_is_refused(doc: bytes, code: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_json(doc)
    assert caught.value.code == code


def test_the_fast_path_takes_compact_documents_and_only_those() -> None:
    compact = b'{"queue":"q","handler":"h","payload":{"n":9007199254740991,"x":1.5}}'
    assert _canonical(compact) == (True, orjson.loads(compact))
    assert _canonical(compact.decode()) == (True, orjson.loads(compact))
    assert _canonical(b'{"queue": "q"}') == (False, None)  # spaces: the strict way
    assert _canonical(b'{"a":1,"a":1}') == (False, None)
    assert _canonical(b"[9007199254740992]") == (False, None)  # past 53 bits
    assert decode_json(b"[9223372036854775807]") == [2**63 - 1]  # read by the strict way


def test_a_key_seen_twice_is_named_in_a_reply_that_can_be_written() -> None:
    """A lone surrogate in a duplicated key reaches DUPLICATE_KEY before the string check,
    and the key named in ``field`` must still be writable as JSON (it was a 500: orjson
    refuses to write a surrogate)."""
    with pytest.raises(DecodeError) as caught:
        decode_json(b'{"\\ud800":3,"\\ud800":0}')
    assert caught.value.code == "DUPLICATE_KEY"
    assert orjson.loads(orjson.dumps(caught.value.as_json()))["error"]["field"] == "\\ud800"
