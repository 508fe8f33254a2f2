"""FENCED_EPOCH says what happened: an epoch older than the session's was fenced by a
resume; a newer one is no epoch the session ever had (no resume happened, and saying
"fenced by a resume" sent a reader looking for one)."""

from __future__ import annotations

import pytest

from orbit.core.errors import Code, Rejected
from orbit.core.model import Outcome
from orbit.store import Store
from tests.store.helpers import queue, run_one, submit, worker


def test_a_newer_epoch_is_not_the_sessions_and_an_older_one_was_fenced(store: Store) -> None:
    queue(store)
    tid = submit(store)
    s, secret = worker(store)
    g = run_one(store, s)
    before = (store.task_get(tid), store.attempt_get(g.attempt.id))
    with pytest.raises(Rejected) as newer:
        store.attempt_finish(s.id, s.epoch + 1, g.attempt.id, g.attempt.fence, Outcome.success())
    assert newer.value.code == Code.FENCED_EPOCH
    assert newer.value.message == (
        f"epoch {s.epoch + 1} is not the session's epoch (current epoch {s.epoch})"
    )
    resumed = store.session_resume(s.id, secret, node_id="n2")
    with pytest.raises(Rejected) as older:
        store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    assert older.value.code == Code.FENCED_EPOCH
    assert older.value.message == (
        f"epoch {s.epoch} was fenced by a resume (current epoch {resumed.epoch})"
    )
    # Refusals change nothing and leave their evidence, as every fenced report does.
    assert (store.task_get(tid), store.attempt_get(g.attempt.id)) == before
    rejected = [e for e in store.event_list(task_id=tid) if e["kind"] == "rejected"]
    assert [e["code"] for e in rejected] == [Code.FENCED_EPOCH] * 2
