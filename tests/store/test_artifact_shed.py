"""An artifact that goes on SQLite loses its chunks a few at a time, each batch a
transaction of its own, before its row (``Store._shed_chunks``): SQLite built with
SECURE_DELETE overwrites every page a delete frees, so one transaction that deleted a
large upload whole wrote as much to the ``-wal`` as the upload had, and on a disk the
upload had nearly filled it failed, leaving the chunks, and every reaper pass after it
failed alike. PostgreSQL keeps its one delete. Each test arms a fault on the row's
delete: what is gone by then was deleted in transactions of its own."""

from __future__ import annotations

import os

import pytest

from orbit.core.model import SECOND, Outcome
from orbit.store import Store, sqlite_path
from orbit.store.store import DISK_RESERVE_BYTES, SHED_CHUNKS, InjectedFault
from tests.conftest import ManualClock, store_url
from tests.store.helpers import queue, run_one, submit, worker

#: more than two batches, and not a whole number of them
CHUNKS = 2 * SHED_CHUNKS + 3


def _upload(store: Store, *, commit: bool) -> tuple[str, str, int, str, int]:
    """An upload of CHUNKS chunks by a running attempt (committed if ``commit``, with a
    TTL of ten seconds): its id, and the session id, epoch, attempt id and fence."""
    queue(store)
    submit(store)
    session, _ = worker(store)
    attempt = run_one(store, session).attempt
    ids = (session.id, session.epoch, attempt.id, attempt.fence)
    upload = store.artifact_begin(*ids, name="big.bin", content_type="a/b", ttl_us=10 * SECOND)
    assert isinstance(upload, str)
    for seq in range(CHUNKS):
        store.artifact_write(upload, seq, b"x" * 100)
    if commit:
        store.artifact_commit(*ids, upload, size=100 * CHUNKS, sha256="0" * 64)
    return (upload, *ids)


def _chunks(store: Store, artifact_id: str) -> int:
    return len(list(store.artifact_chunks(artifact_id)))


def _left(store: Store) -> int:
    """The chunks the armed delete of the row finds: none on SQLite, all on PostgreSQL."""
    return 0 if store.backend == "sqlite" else CHUNKS


def test_an_aborted_upload_loses_its_chunks_before_its_row(store: Store) -> None:
    upload, *_ = _upload(store, commit=False)
    with store.inject_fault("artifact_delete"), pytest.raises(InjectedFault):
        store.artifact_abort(upload)
    assert _chunks(store, upload) == _left(store)
    store.artifact_abort(upload)
    assert _chunks(store, upload) == 0


def test_the_reaper_sheds_an_ended_attempts_upload_before_its_row(store: Store) -> None:
    upload, session_id, epoch, attempt_id, fence = _upload(store, commit=False)
    store.attempt_finish(session_id, epoch, attempt_id, fence, Outcome.success())
    with store.inject_fault("artifact_abandoned_delete"), pytest.raises(InjectedFault):
        store.reap()
    assert _chunks(store, upload) == _left(store)
    assert store.reap().uploads_dropped == 1
    assert _chunks(store, upload) == 0


def test_the_reaper_sheds_an_expired_artifact_before_its_row(
    store: Store, clock: ManualClock
) -> None:
    upload, *_ = _upload(store, commit=True)
    clock.advance(9)
    store.reap()
    assert _chunks(store, upload) == CHUNKS  # not expired: nothing shed
    clock.advance(2 + store.config.artifact_grace_us / SECOND)
    with store.inject_fault("artifact_expired_delete"), pytest.raises(InjectedFault):
        store.reap()
    assert _chunks(store, upload) == _left(store)
    assert store.reap().artifacts_expired == 1
    assert _chunks(store, upload) == 0


def test_the_room_for_uploads_counts_the_files_free_pages(store: Store) -> None:
    """SQLite's file never shrinks: the pages of a dropped upload are free inside it,
    and the next writes fill them before the file grows. The room an upload is checked
    against counts them, so that a disk left nearly full by a large upload that was
    stopped does not refuse every upload after it. On PostgreSQL nothing is seen."""
    upload, *_ = _upload(store, commit=False)
    for seq in range(CHUNKS, CHUNKS + 40):
        store.artifact_write(upload, seq, b"y" * (256 * 1024))  # 10 MiB more
    store.artifact_abort(upload)
    before = _disk_free(store)
    room = store.artifact_disk_room()
    after = _disk_free(store)
    if store.backend != "sqlite":
        assert room is None
        return
    assert room is not None
    free, reserve = room
    # the free list (10 MiB, less a few pages of the tables) beyond the disk's own space
    assert free - max(before, after) >= 9 * 1024 * 1024
    disk = os.statvfs(_directory(store))
    assert reserve == min(DISK_RESERVE_BYTES, disk.f_blocks * disk.f_frsize // 20)


def _directory(store: Store) -> str:
    """The SQLite file's directory (PostgreSQL: this one, whose disk nothing reads)."""
    path = sqlite_path(store_url(store))
    return os.path.dirname(os.path.realpath(path)) if path else "."


def _disk_free(store: Store) -> int:
    found = os.statvfs(_directory(store))
    return found.f_bavail * found.f_frsize
