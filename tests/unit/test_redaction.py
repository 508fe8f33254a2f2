"""The log filter removes tokens, bearer headers, resume secrets and DSN passwords."""

from __future__ import annotations

import asyncio
import logging

import pytest

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


def test_a_database_password_is_redacted_in_every_place_libpq_reads_one() -> None:
    """A password after an empty user name, in a URL's ``?password=`` parameter or in a
    key=value conninfo string (quoted or not) is a database password as much as one
    after ``user:``."""
    for text in (
        "postgresql://:hunter2@db:5432/orbit",
        "postgresql://orbit@db/orbit?password=hunter2",
        "postgresql://orbit@db/orbit?sslmode=require&PASSWORD=hunter2&x=1",
        "host=db user=orbit password=hunter2 dbname=orbit",
        "host=db password = 'hunter2 and more' dbname=orbit",
    ):
        cleaned = redact(text)
        assert "hunter2" not in cleaned, cleaned
        assert "[redacted]" in cleaned and "db" in cleaned, cleaned


def test_a_database_password_with_reserved_characters_leaves_no_part_behind() -> None:
    """A password with an unencoded ``@`` (``user:hun@ter2@host``) kept its tail: the URL
    pattern stopped at the first ``@``. So did a scheme in capitals, and a double-quoted
    ``password="…"`` (a repr or a JSON string of a conninfo)."""
    for text in (
        "postgresql://orbit:hun@ter2@db:5432/orbit",
        "postgresql://orbit:h@un@ter2@db/orbit",
        "postgresql://orbit:hun/ter2@db/orbit",
        "postgresql://orbit:hun:ter2@db/orbit",
        "failed: 'postgres://orbit:hun@ter2@db/orbit' at boot",
        "POSTGRESQL://orbit:hunter2@db/orbit",
        'host=db password="hun ter2" dbname=orbit',
    ):
        cleaned = redact(text)
        kept = "hun" in cleaned or "ter2" in cleaned  # a bool: a failure shows no part
        assert not kept
        assert "[redacted]" in cleaned and "db" in cleaned, cleaned


def test_a_worker_connection_logs_no_token_even_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """websockets logs every header of the upgrade at debug level, the Authorization
    header included: an application that turned debug logging on to see why its worker
    would not connect wrote its token into its log. The SDK's connection logs through
    the redaction filter, whatever logging the application configured."""
    from orbit.worker import WorkerConnection
    from tests.unit.fake_gateway import FakeGateway

    async def run() -> None:
        async with FakeGateway() as gw:
            conn = await WorkerConnection.connect(gw.ws_url, TOKEN)
            await conn.hello("w", {"h": 1}, 1)
            await conn.close()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    # the worker's side only: the fake gateway's own server logs are no part of the SDK
    ours = [r.getMessage() for r in caplog.records if not r.name.startswith("websockets.server")]
    assert any("authorization" in m.lower() for m in ours)  # the headers were logged
    assert not [m for m in ours if "S9M0" in m]


@pytest.mark.parametrize("opcode", ["TEXT", "CONT"])
def test_a_websockets_frame_line_keeps_no_part_of_a_secret(opcode: str) -> None:
    """websockets logs each frame at debug, shortened in its middle: a resume written in
    the protocol's own key order lost its ``"secret":`` key to the cut and kept its
    value's tail, and a fragment (CONT) has no key at all. The payload goes whole."""
    from websockets.frames import Frame, Opcode

    secret = "c_v9MODlf9UzT9wUHzieg" + "x" * 22
    resume = '{"type":"resume","req_id":"r","session_id":"' + "s" * 60 + f'","secret":"{secret}"}}'
    frame = Frame(Opcode[opcode], resume.encode(), fin=opcode == "TEXT")
    record = logging.LogRecord(
        "websockets.server", logging.DEBUG, __file__, 1, "< %s", (frame,), None
    )
    assert RedactSecrets().filter(record)
    shown = record.getMessage()
    assert secret[-12:] not in shown and "payload" in shown, shown
    assert f"{len(resume)} bytes" in shown  # what the frame was is still said
