"""How a LISTEN or ``orbit_events`` connection's failure is told (``failure_said``): in
the log and in /readyz's body, which needs no token, so no name the message quotes, nor
the URL or its password. psycopg's own messages quote a host singly (``failed to
resolve host '…'``), the server's doubly; the single quotes were left in."""

from __future__ import annotations

import psycopg

from orbit.server.listen import failure_said

DSN = "postgresql://orbit:s3cret-pw@no-such-host.invalid:5432/jobs"


def test_a_host_psycopg_cannot_resolve_is_not_named() -> None:
    try:
        psycopg.connect(DSN, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        failed = exc
    else:  # pragma: no cover - a resolver that answers for .invalid
        raise AssertionError("no-such-host.invalid resolved")
    said = failure_said(failed, DSN)
    assert said.startswith("OperationalError: ") and "'…'" in said, said
    for secret in ("no-such-host", "s3cret-pw", "orbit:", "jobs"):
        assert secret not in said, said


def test_a_servers_refusal_keeps_its_words_without_the_names() -> None:
    refused = psycopg.OperationalError(
        'connection to server at "10.0.0.5", port 5432 failed: FATAL:  too many '
        'connections for database "jobs"'
    )
    said = failure_said(refused, DSN)
    assert "too many connections for database" in said, said
    assert "jobs" not in said and "10.0.0.5" not in said, said
