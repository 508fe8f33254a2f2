"""A repeat of a committed upload (its reply lost, the worker sends it again under the same
name): answered with the stored artifact when it declares the same sha256, refused
ARTIFACT_EXISTS otherwise, and fenced like any upload."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import Artifact
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import queue, run_one, submit, worker
from tests.store.test_artifacts import Running

DATA = b"png" * 1000
DIGEST = hashlib.sha256(DATA).hexdigest()


def _running(store: Store) -> Running:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    return Running(store, tid, s, run_one(store, s))


def _committed(run: Running, **options: Any) -> Artifact:
    upload = run.begin("shot.png", "image/png", **options)
    assert isinstance(upload, str)
    run.store.artifact_write(upload, 0, DATA)
    return run.commit(upload, DATA)


def _stored(store: Store) -> tuple[int, int]:
    """How many artifact rows (uploads included) and chunks the database holds."""
    store.driver.queries["test_artifact_rows"] = (
        "SELECT (SELECT count(*) FROM orbit_artifacts) AS artifacts,"
        " (SELECT count(*) FROM orbit_artifact_chunks) AS chunks"
    )
    [row] = store.driver.read("test_artifact_rows", {})
    return int(row["artifacts"]), int(row["chunks"])


@pytest.mark.parametrize("digest", [DIGEST, DIGEST.upper()], ids=["lower", "upper"])
def test_a_repeat_declaring_the_same_sha256_is_answered_with_the_stored_artifact(
    store: Store, digest: str
) -> None:
    """The upload a worker sends again after its reply was lost: the artifact its first
    send committed, nothing written (no upload opened, no chunk, no event)."""
    run = _running(store)
    first = _committed(run)
    before = (_stored(store), store.event_list(task_id=run.task_id))
    again = run.begin("shot.png", "image/png", sha256=digest)
    assert again == first
    assert (_stored(store), store.event_list(task_id=run.task_id)) == before
    assert store.artifact_list(run.task_id) == [first]


@pytest.mark.parametrize(
    "digest", [None, hashlib.sha256(b"other").hexdigest()], ids=["none", "other"]
)
def test_a_repeat_without_the_sha256_or_with_another_is_artifact_exists(
    store: Store, digest: str | None
) -> None:
    run = _running(store)
    first = _committed(run)
    before = (_stored(store), store.event_list(task_id=run.task_id))
    with pytest.raises(OrbitError) as err:
        run.begin("shot.png", "image/png", sha256=digest)
    assert err.value.code == Code.ARTIFACT_EXISTS
    if digest is None:  # it says how a repeat is answered instead
        assert "X-Orbit-Sha256" in err.value.message
    else:
        assert "other bytes" in err.value.message
    assert (_stored(store), store.event_list(task_id=run.task_id)) == before
    assert store.artifact_list(run.task_id) == [first]


@pytest.mark.parametrize("case", ["fence", "finished"])
def test_a_repeat_from_a_report_no_longer_ours_is_refused_as_any_upload(
    store: Store, case: str
) -> None:
    """The fence is checked before the name: a stale repeat is refused with its evidence
    (a ``rejected`` event), not answered with the artifact."""
    run = _running(store)
    _committed(run)
    s, attempt = run.session, run.grant.attempt
    fence = attempt.fence + 1 if case == "fence" else attempt.fence
    if case == "finished":
        run.finish()
    rows = _stored(store)
    with pytest.raises(Rejected) as err:
        store.artifact_begin(
            s.id, s.epoch, attempt.id, fence, name="shot.png", content_type="a/b", sha256=DIGEST
        )
    code = Code.STALE_FENCE if case == "fence" else Code.ATTEMPT_ENDED
    assert err.value.code == code
    last = store.event_list(task_id=run.task_id)[-1]
    assert last["kind"] == "rejected" and last["code"] == code
    assert _stored(store) == rows


def test_an_upload_of_the_name_in_progress_is_still_replaced(store: Store) -> None:
    """Only a committed artifact is repeated: an unfinished upload of the name is replaced
    by the new begin, digest or not, as before."""
    run = _running(store)
    stuck = run.begin("shot.png", "image/png")
    assert isinstance(stuck, str)
    store.artifact_write(stuck, 0, DATA)
    fresh = run.begin("shot.png", "image/png", sha256=DIGEST)
    assert isinstance(fresh, str) and fresh != stuck
    with pytest.raises(OrbitError) as err:
        store.artifact_write(stuck, 1, b"more")
    assert err.value.code == Code.INVALID_STATE
    store.artifact_write(fresh, 0, DATA)
    assert run.commit(fresh, DATA).sha256 == DIGEST


def test_an_expired_artifact_is_not_answered(store: Store, clock: ManualClock) -> None:
    """Gone to every reader from its expiry (the reaper not yet past): not answered, and
    its name stays taken, as before."""
    run = _running(store)
    _committed(run, ttl_us=10_000_000)
    clock.advance(11)
    with pytest.raises(OrbitError) as err:
        run.begin("shot.png", "image/png", sha256=DIGEST)
    assert err.value.code == Code.ARTIFACT_EXISTS and "expired" in err.value.message


@pytest.mark.parametrize(
    "digest", ["0" * 63, "g" * 64, "0" * 65, ""], ids=["short", "not-hex", "long", "empty"]
)
def test_a_sha256_that_is_no_digest_is_refused_and_changes_nothing(
    store: Store, digest: str
) -> None:
    run = _running(store)
    first = _committed(run)
    before = (_stored(store), store.event_list(task_id=run.task_id))
    for name in ("shot.png", "new.png"):
        with pytest.raises(OrbitError) as err:
            run.begin(name, "image/png", sha256=digest)
        assert err.value.code == Code.INVALID_ARGUMENT and "sha256" in err.value.message
    assert (_stored(store), store.event_list(task_id=run.task_id)) == before
    assert store.artifact_list(run.task_id) == [first]


def test_a_new_name_declaring_its_sha256_is_uploaded_as_any_other(store: Store) -> None:
    run = _running(store)
    upload = run.begin("new.png", "image/png", sha256=DIGEST)
    assert isinstance(upload, str)
    store.artifact_write(upload, 0, DATA)
    made = run.commit(upload, DATA)
    assert made.sha256 == DIGEST and store.artifact_list(run.task_id) == [made]
