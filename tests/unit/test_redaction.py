"""The log filter removes tokens, bearer headers, resume secrets and DSN passwords."""

from __future__ import annotations

import logging

from orbit.logs import RedactSecrets, redact

TOKEN = "orbit_0123456789abcdef0123456789abcdef_S9M0TNbDPerUA6MTaGrz-_x"


def test_redact_patterns() -> None:
    assert "S9M0" not in redact(f"Authorization: Bearer {TOKEN}")
    assert "S9M0" not in redact(f"token={TOKEN}")
    assert "hunter2" not in redact('{"type":"welcome","resume_secret":"hunter2"}')
    assert "hunter2" not in redact("{'secret': 'hunter2'}")
    assert "pw" not in redact("postgresql://orbit:pw@db:5432/orbit")
    assert redact("nothing secret here") == "nothing secret here"


def test_filter_rewrites_records_with_args() -> None:
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "header %s", (f"Bearer {TOKEN}",), None
    )
    assert RedactSecrets().filter(record)
    assert "S9M0" not in record.getMessage() and "[redacted]" in record.getMessage()
