"""Uploads against the free space of a SQLite database's disk, and the content route's
HEAD and ranges: the app ``create_app`` builds over a real store, driven in process by
starlette's TestClient (``tests/e2e/test_artifact_http.py`` says why that is enough).

An upload larger than the free space filled the disk of a SQLite node: its chunks stayed
behind, the delete that should have dropped them failed for want of space too, and every
later write of the node failed (submits, finishes, the reaper's passes). A node now
keeps a reserve free (``StoreConfig.artifact_disk_reserve_bytes``); a reserve larger
than the disk's free space makes the refusal certain without filling any disk."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from orbit.server.artifacts import CHUNK, ROOM_EVERY
from orbit.store import StoreConfig, sqlite_path
from tests.e2e.test_artifact_http import Served, serving

#: more than any disk has free: every look at the disk refuses
ALL = 2**62


@pytest.fixture
def served(db_url: str) -> Iterator[Served]:
    """An app over a store with one running attempt (``serving``), its uploads sent as
    ``application/octet-stream``."""
    with serving(db_url, StoreConfig(max_artifact_bytes=16 * 1024 * 1024)) as it:
        it.worker["Content-Type"] = "application/octet-stream"
        yield it


def _reserve(served: Served, reserve: int | None) -> None:
    served.store.config = replace(served.store.config, artifact_disk_reserve_bytes=reserve)


def _stored(served: Served) -> tuple[int, int]:
    """The artifact rows and the chunk rows in the SQLite file, read beside the store."""
    path = sqlite_path(served.url)
    assert path
    with sqlite3.connect(path) as cx:
        artifacts = cx.execute("SELECT count(*) FROM orbit_artifacts").fetchone()[0]
        chunks = cx.execute("SELECT count(*) FROM orbit_artifact_chunks").fetchone()[0]
    return int(artifacts), int(chunks)


def _still_writes(served: Served) -> None:
    """A submit and a small upload go through once the disk has room again."""
    _reserve(served, None)
    made = served.client.post(
        "/v1/tasks", json={"queue": "q", "handler": "h"}, headers=served.submit
    )
    assert made.status_code == 201, made.text
    small = served.client.put(
        f"{served.upload}/big.bin", content=b"hi" * 1000, headers=served.worker
    )
    assert small.status_code == 201, small.text
    assert _stored(served) == (1, 1)


def _refused(reply: Any) -> str:
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] == "5"
    error = reply.json()["error"]
    assert error["code"] == "DATABASE_FULL"
    return str(error["message"])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_upload_too_large_for_the_disk_is_refused_before_it_writes(served: Served) -> None:
    """Its Content-Length is more than the disk can spare: refused before the upload
    begins, so nothing at all is written, not even its row."""
    _reserve(served, ALL)
    reply = served.client.put(
        f"{served.upload}/big.bin", content=b"x" * (3 * CHUNK), headers=served.worker
    )
    assert _refused(reply).endswith("nothing was written")
    assert _stored(served) == (0, 0)
    _still_writes(served)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_upload_that_runs_the_disk_low_is_stopped_and_dropped(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body of no declared length that passed the first look and finds the disk short
    at a later one (here the reserve grows once it has written one stretch, as the free
    space would fall under another writer): stopped there, its chunks deleted before the
    answer, which says so."""
    write = served.store.artifact_write

    def then_short(artifact_id: str, seq: int, data: bytes) -> None:
        write(artifact_id, seq, data)
        if seq == ROOM_EVERY - 1:
            assert _stored(served) == (1, ROOM_EVERY)  # written, before the next look
            _reserve(served, ALL)

    monkeypatch.setattr(served.store, "artifact_write", then_short)
    body = iter([b"x" * CHUNK] * (ROOM_EVERY * 2))  # no Content-Length: sent chunked
    reply = served.client.put(f"{served.upload}/big.bin", content=body, headers=served.worker)
    message = _refused(reply)
    assert f"stopped and the {ROOM_EVERY * CHUNK} bytes it had written dropped" in message
    assert _stored(served) == (0, 0)
    monkeypatch.undo()
    _still_writes(served)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_stopped_upload_whose_delete_fails_says_so_and_is_reaped_later(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete of the stopped upload fails too (here a fault injected in it):
    the answer does not claim it was dropped, and the reaper drops its chunks once its
    attempt has ended."""
    write = served.store.artifact_write

    def then_short(artifact_id: str, seq: int, data: bytes) -> None:
        write(artifact_id, seq, data)
        if seq == ROOM_EVERY - 1:
            _reserve(served, ALL)

    monkeypatch.setattr(served.store, "artifact_write", then_short)
    body = iter([b"x" * CHUNK] * (ROOM_EVERY * 2))
    with served.store.inject_fault("artifact_chunks_shed"):
        reply = served.client.put(f"{served.upload}/big.bin", content=body, headers=served.worker)
    message = _refused(reply)
    assert (
        "could not be dropped now, and the reaper drops them once its attempt has ended" in message
    )
    assert "nothing was written" not in message
    assert _stored(served) == (1, ROOM_EVERY)
    monkeypatch.undo()
    served.finish()
    assert served.store.reap().uploads_dropped == 1
    assert _stored(served) == (0, 0)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_upload_that_fits_beside_the_reserve_is_taken(served: Served) -> None:
    """The default reserve (64 MiB or 5 % of the disk, the smaller) refuses nothing on a
    disk with room: a multi-stretch upload, declared and not, is committed whole."""
    body = b"y" * (ROOM_EVERY * CHUNK * 2 + 5)
    declared = served.client.put(f"{served.upload}/a.bin", content=body, headers=served.worker)
    assert declared.status_code == 201, declared.text
    chunked = served.client.put(
        f"{served.upload}/b.bin", content=iter([body[:CHUNK], body[CHUNK:]]), headers=served.worker
    )
    assert chunked.status_code == 201, chunked.text
    assert chunked.json()["size"] == declared.json()["size"] == len(body)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_postgres_uploads_do_not_look_at_the_nodes_disk(served: Served) -> None:
    """PostgreSQL's disk is its server's: the reserve is not checked there."""
    _reserve(served, ALL)
    reply = served.client.put(
        f"{served.upload}/big.bin", content=b"x" * (3 * CHUNK), headers=served.worker
    )
    assert reply.status_code == 201, reply.text


def test_head_answers_the_gets_headers_and_no_range_is_honoured(served: Served) -> None:
    """HEAD was 405; a Range was answered with the whole body as a 200, and nothing said
    that ranges are not served. Now HEAD answers the GET's headers, no body, and both say
    ``Accept-Ranges: none``, so that a client does not take the 200 for its range."""
    body = bytes(range(256)) * 2000  # two chunks
    made = served.client.put(f"{served.upload}/r.bin", content=body, headers=served.worker)
    assert made.status_code == 201, made.text
    url = f"/v1/artifacts/{made.json()['id']}/content"
    got = served.client.get(url, headers={**served.submit, "Range": "bytes=0-9"})
    assert got.status_code == 200 and got.content == body
    assert got.headers["accept-ranges"] == "none"
    assert "content-range" not in got.headers
    head = served.client.head(url, headers=served.submit)
    assert head.status_code == 200 and head.content == b""
    same = ("content-length", "content-type", "content-disposition", "x-orbit-sha256")
    for name in (*same, "accept-ranges", "x-content-type-options"):
        assert head.headers[name] == got.headers[name], name
    assert head.headers["content-length"] == str(len(body))
    missing = served.client.head("/v1/artifacts/nope/content", headers=served.submit)
    assert missing.status_code == 404
    assert served.client.head(url).status_code == 401
