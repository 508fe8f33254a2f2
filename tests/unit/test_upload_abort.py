"""An artifact upload that fails, and whose clean-up fails too (the database went down
between the two), answers with its own error."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
from starlette.exceptions import StarletteDeprecationWarning

from orbit.server import ServerSettings, create_app
from orbit.store import open_store
from tests.store.helpers import queue, run_one, submit, worker

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient


def test_an_upload_whose_abort_fails_answers_with_the_uploads_own_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The upload aborted itself on any failure and re-raised; when the abort failed as
    well, its error replaced the upload's: a body whose digest did not match (400,
    DIGEST_MISMATCH) came back a 500 (INTERNAL). The upload's error is kept, and the
    abort's failure is a warning that names the upload and the error's type (never its
    text, which on PostgreSQL may quote the server's address)."""
    url = f"sqlite:///{tmp_path}/orbit.db"
    store = open_store(url)
    try:
        queue(store)
        submit(store)
        session, _ = worker(store)
        attempt = run_one(store, session).attempt
        _, token = store.token_create("w", ["worker"])
        headers = {
            "authorization": f"Bearer {token}",
            "x-orbit-session": session.id,
            "x-orbit-epoch": str(session.epoch),
            "x-orbit-fence": str(attempt.fence),
            "x-orbit-sha256": "0" * 64,
        }
        app = create_app(ServerSettings(db_url=url), store=store)
        with (
            TestClient(app, raise_server_exceptions=False) as client,
            caplog.at_level(logging.WARNING, logger="orbit.server"),
            store.inject_fault("artifact_delete"),
        ):
            answer = client.put(
                f"/v1/attempts/{attempt.id}/artifacts/shot.png", content=b"data", headers=headers
            )
    finally:
        store.close()
    assert answer.json()["error"]["code"] == "DIGEST_MISMATCH", answer.text
    assert answer.status_code == 400
    [warned] = [r for r in caplog.records if "upload" in r.getMessage()]
    assert warned.levelno == logging.WARNING
    message = warned.getMessage()
    assert "InjectedFault" in message and "injected failure" not in message, message
    assert token not in caplog.text
