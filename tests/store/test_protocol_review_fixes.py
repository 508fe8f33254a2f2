"""Fixes from a review of the worker protocol, in the store on both backends: a stale
epoch's drain and heartbeat say which epoch fenced it, as every other report does;
progress or an artifact on an attempt still claimed is NOT_STARTED (it is live), not
ATTEMPT_ENDED; a start refused because the task was cancelled names the cancel."""

from __future__ import annotations

import json

import pytest

from orbit.core.errors import Code, Rejected
from orbit.core.model import Capability
from orbit.store import Store
from tests.store.helpers import claim_one, queue, submit, worker


def _rejected(store: Store, task_id: str) -> list[tuple[str, str | None]]:
    """The task's rejected reports: (report, code)."""
    events = store.event_list(task_id=task_id)
    return [(json.loads(e["data"])["report"], e["code"]) for e in events if e["kind"] == "rejected"]


def test_a_fenced_epochs_drain_and_heartbeat_say_a_resume_fenced_it(store: Store) -> None:
    """Drain said "the epoch was fenced by a resume", capacity "the epoch was fenced" and
    heartbeat "epoch 1 is not the session's current epoch" (the same words for an epoch
    never had); each now says what every report says (docs/protocol.md, fencing)."""
    s, secret = worker(store)
    resumed = store.session_resume(s.id, secret, node_id="n2")
    assert (s.epoch, resumed.epoch) == (1, 2)
    fenced = "epoch 1 was fenced by a resume (current epoch 2)"
    never = "epoch 3 is not the session's epoch (current epoch 2)"
    for epoch, message in [(1, fenced), (3, never)]:
        with pytest.raises(Rejected) as beat:
            store.session_heartbeat(s.id, epoch)
        assert (beat.value.code, beat.value.message) == (Code.FENCED_EPOCH, message)
        with pytest.raises(Rejected) as drain:
            store.session_drain(s.id, epoch)
        assert (drain.value.code, drain.value.message) == (Code.FENCED_EPOCH, message)
        with pytest.raises(Rejected) as claim:
            store.attempt_claim_many(s.id, epoch, 1)
        assert (claim.value.code, claim.value.message) == (Code.FENCED_EPOCH, message)
        with pytest.raises(Rejected) as capacity:  # it said "the epoch was fenced"
            store.session_capacity_set(
                s.id, epoch, seq=1, capabilities=[Capability("h", 5)], max_concurrency=5
            )
        assert (capacity.value.code, capacity.value.message) == (Code.FENCED_EPOCH, message)
    # Refused: the session is neither draining nor extended.
    assert store.session_get(s.id) == resumed


def test_progress_and_an_artifact_on_a_claimed_attempt_are_not_started(store: Store) -> None:
    """They were ATTEMPT_ENDED "the attempt is claimed", which elsewhere means the attempt
    is over: a worker following the docs would give up a claim it still holds."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    before = (store.task_get(tid), store.attempt_get(g.attempt.id))
    with pytest.raises(Rejected) as progress:
        store.attempt_progress(s.id, s.epoch, g.attempt.id, g.attempt.fence, fraction=0.5)
    with pytest.raises(Rejected) as artifact:
        store.artifact_begin(
            s.id, s.epoch, g.attempt.id, g.attempt.fence, name="a", content_type="text/plain"
        )
    for err, report in [(progress, "progress"), (artifact, "artifact")]:
        assert err.value.code == Code.NOT_STARTED
        assert err.value.message == (
            f"the attempt is claimed and not started: start it before its {report}"
        )
    # Nothing written but the evidence; the claim is still held and can be started.
    assert (store.task_get(tid), store.attempt_get(g.attempt.id)) == before
    assert store.artifact_list(tid) == []
    assert _rejected(store, tid) == [
        ("progress", Code.NOT_STARTED),
        ("artifact", Code.NOT_STARTED),
    ]
    store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    store.attempt_progress(s.id, s.epoch, g.attempt.id, g.attempt.fence, fraction=0.5)


def test_a_start_after_the_cancel_names_the_cancel(store: Store) -> None:
    """The cancel of a claimed task releases its attempt; the start refused for it said
    "the attempt is released, not claimed", not why."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    store.task_cancel(tid)
    before = (store.task_get(tid), store.attempt_get(g.attempt.id))
    with pytest.raises(Rejected) as err:
        store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert err.value.code == Code.TASK_CANCELLED
    assert err.value.message == "the task was cancelled: its attempt is released"
    assert (store.task_get(tid), store.attempt_get(g.attempt.id)) == before
    assert _rejected(store, tid) == [("start", Code.TASK_CANCELLED)]
