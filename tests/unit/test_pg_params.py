"""Parameters in PostgreSQL's text format, as the driver's libpq path sends them."""

from __future__ import annotations

import psycopg
import pytest

from orbit.store.postgres.driver import _dump


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
