"""Artifacts: chunked, fenced like every report, listed once ready, expired by the reaper."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import Outcome
from orbit.store import Store, open_store
from orbit.store import store as store_module
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import (
    RACE_WAIT,
    queue,
    run_one,
    submit,
    until_done_or_waiting_on_a_lock,
    worker,
)
from tests.store.test_list_pages import _plan


def _upload(store: Store, s: object, g: object, name: str, chunks: list[bytes]) -> object:
    sid, epoch = s.id, s.epoch  # type: ignore[attr-defined]
    a = g.attempt  # type: ignore[attr-defined]
    artifact_id = store.artifact_begin(
        sid, epoch, a.id, a.fence, name=name, content_type="image/png"
    )
    for seq, chunk in enumerate(chunks):
        store.artifact_write(artifact_id, seq, chunk)
    data = b"".join(chunks)
    return store.artifact_commit(
        sid,
        epoch,
        a.id,
        a.fence,
        artifact_id,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def test_upload_list_and_read_back(store: Store) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    chunks = [bytes([i]) * 1000 for i in range(3)]
    artifact = _upload(store, s, g, "shot.png", chunks)
    assert artifact.size == 3000 and artifact.state == "ready"  # type: ignore[attr-defined]
    [listed] = store.artifact_list(tid)
    assert listed.name == "shot.png" and listed.content_type == "image/png"
    assert b"".join(store.artifact_chunks(listed.id)) == b"".join(chunks)
    assert [e["kind"] for e in store.event_list(task_id=tid)][-1] == "artifact"
    with pytest.raises(OrbitError) as err:
        _upload(store, s, g, "shot.png", [b"x"])
    assert err.value.code == Code.ARTIFACT_EXISTS
    assert check_all(store) == []


def test_an_upload_is_invisible_until_committed_and_abort_drops_it(store: Store) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    artifact_id = store.artifact_begin(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, name="half", content_type="application/zip"
    )
    store.artifact_write(artifact_id, 0, b"part")
    assert store.artifact_list(tid) == []
    with pytest.raises(OrbitError):
        store.artifact_get(artifact_id)
    store.artifact_abort(artifact_id)
    with pytest.raises(OrbitError) as err:
        store.artifact_write(artifact_id, 1, b"more")
    assert err.value.code == Code.INVALID_STATE


@pytest.mark.parametrize("case", ["fence", "finished", "lease"])
def test_stale_uploads_are_refused_with_evidence(
    store: Store, clock: ManualClock, case: str
) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    fence = g.attempt.fence
    if case == "fence":
        fence += 1
    elif case == "finished":
        store.attempt_finish(s.id, s.epoch, g.attempt.id, fence, Outcome.success())
    else:
        clock.advance(31)
    with pytest.raises(Rejected) as err:
        store.artifact_begin(
            s.id, s.epoch, g.attempt.id, fence, name="late", content_type="image/png"
        )
    expected = {
        "fence": Code.STALE_FENCE,
        "finished": Code.ATTEMPT_ENDED,
        "lease": Code.LEASE_EXPIRED,
    }[case]
    assert err.value.code == expected
    last = store.event_list(task_id=tid)[-1]
    assert last["kind"] == "rejected" and last["code"] == expected
    assert store.artifact_list(tid) == []


def test_a_commit_after_the_lease_is_lost_is_refused(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    artifact_id = store.artifact_begin(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, name="slow", content_type="image/png"
    )
    store.artifact_write(artifact_id, 0, b"x")
    clock.advance(31)
    with pytest.raises(Rejected) as err:
        store.artifact_commit(
            s.id,
            s.epoch,
            g.attempt.id,
            g.attempt.fence,
            artifact_id,
            size=1,
            sha256=hashlib.sha256(b"x").hexdigest(),
        )
    assert err.value.code == Code.LEASE_EXPIRED
    assert store.artifact_list(tid) == []


def test_the_reaper_expires_artifacts(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    artifact_id = store.artifact_begin(
        s.id,
        s.epoch,
        g.attempt.id,
        g.attempt.fence,
        name="tmp",
        content_type="text/plain",
        ttl_us=10_000_000,
    )
    store.artifact_write(artifact_id, 0, b"bye")
    store.artifact_commit(
        s.id,
        s.epoch,
        g.attempt.id,
        g.attempt.fence,
        artifact_id,
        size=3,
        sha256=hashlib.sha256(b"bye").hexdigest(),
    )
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    clock.advance(9)
    assert store.reap().artifacts_expired == 0
    clock.advance(2)
    assert store.reap().artifacts_expired == 1
    assert store.artifact_list(tid) == []
    assert list(store.artifact_chunks(artifact_id)) == []


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"name": "bad name"}, Code.INVALID_ARGUMENT),
        ({"content_type": "png"}, Code.INVALID_ARGUMENT),
        ({"content_type": "text/plain\r\nX: y"}, Code.INVALID_ARGUMENT),
        ({"ttl_us": 5}, Code.INVALID_ARGUMENT),
    ],
)
def test_bad_upload_options(store: Store, kw: dict[str, object], code: Code) -> None:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    args: dict[str, object] = {"name": "ok", "content_type": "image/png", **kw}
    before = len(store.event_list())
    with pytest.raises(OrbitError) as err:
        store.artifact_begin(s.id, s.epoch, g.attempt.id, g.attempt.fence, **args)  # type: ignore[arg-type]
    assert err.value.code == code
    assert len(store.event_list()) == before


def test_a_cancel_refuses_new_artifacts_and_hides_the_attempts_own(store: Store) -> None:
    """Cancel wins over artifacts as over results (DESIGN §5.1): once cancel is asked,
    no artifact is begun or committed (evidence left), and one committed before is no
    longer listed or read once the attempt ends cancelled."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    a = g.attempt
    before = _upload(store, s, g, "early.png", [b"early"])
    pending = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="half", content_type="a/b")
    store.artifact_write(pending, 0, b"x")
    store.task_cancel(tid)
    assert store.task_get(tid).state == "cancelling"
    with pytest.raises(Rejected) as err:
        store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="late", content_type="a/b")
    assert err.value.code == Code.TASK_CANCELLED
    with pytest.raises(Rejected) as err:
        store.artifact_commit(s.id, s.epoch, a.id, a.fence, pending, size=1, sha256="0" * 64)
    assert err.value.code == Code.TASK_CANCELLED
    last = store.event_list(task_id=tid)[-1]
    assert last["kind"] == "rejected" and last["code"] == Code.TASK_CANCELLED
    store.attempt_finish(s.id, s.epoch, a.id, a.fence, Outcome.success({"done": True}))
    assert store.task_get(tid).state == "cancelled"
    assert store.artifact_list(tid) == []
    with pytest.raises(OrbitError) as err:
        store.artifact_get(before.id)  # type: ignore[attr-defined]
    assert err.value.code == Code.ARTIFACT_NOT_FOUND
    assert check_all(store) == []


def test_an_upload_cut_off_half_way_neither_blocks_its_name_nor_stays_stored(
    store: Store,
) -> None:
    """A server killed in the middle of an upload never aborts it: its ``uploading`` row
    and chunks stay behind. The worker's retry of the same name is a new begin, which
    replaces the dead upload (it used to be refused ``ARTIFACT_EXISTS`` for the rest of
    the attempt), and once the attempt has ended the reaper drops any upload it left
    unfinished (it used to keep the chunks until the TTL, 7 days by default)."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    a = g.attempt
    cut = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="shot.png", content_type="a/b")
    store.artifact_write(cut, 0, b"half of it")
    done = _upload(store, s, g, "shot.png", [b"all of it"])  # the retry, no abort before
    assert list(store.artifact_chunks(cut)) == []
    assert [x.id for x in store.artifact_list(tid)] == [done.id]  # type: ignore[attr-defined]
    left = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="left", content_type="a/b")
    store.artifact_write(left, 0, b"never finished")
    assert store.reap().uploads_dropped == 0  # its attempt still runs: it may go on
    store.attempt_finish(s.id, s.epoch, a.id, a.fence, Outcome.success())
    assert store.reap().uploads_dropped == 1
    assert list(store.artifact_chunks(left)) == []
    assert b"".join(store.artifact_chunks(done.id)) == b"all of it"  # type: ignore[attr-defined]
    assert check_all(store) == []


def test_an_expired_artifact_is_not_served_before_the_reaper_deletes_it(
    store: Store, clock: ManualClock
) -> None:
    """Past its ``expires_at`` an artifact is gone, whether or not a reaper pass has
    run yet: a listing or a download between the two used to still serve it."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    a = g.attempt
    artifact_id = store.artifact_begin(
        s.id, s.epoch, a.id, a.fence, name="tmp", content_type="text/plain", ttl_us=10_000_000
    )
    store.artifact_write(artifact_id, 0, b"bye")
    store.artifact_commit(
        s.id, s.epoch, a.id, a.fence, artifact_id, size=3, sha256=hashlib.sha256(b"bye").hexdigest()
    )
    store.attempt_finish(s.id, s.epoch, a.id, a.fence, Outcome.success())
    clock.advance(9)
    assert [x.id for x in store.artifact_list(tid)] == [artifact_id]
    clock.advance(1)
    assert store.artifact_list(tid) == []
    with pytest.raises(OrbitError) as err:
        store.artifact_get(artifact_id)
    assert err.value.code == Code.ARTIFACT_NOT_FOUND


def test_a_chunk_written_while_its_upload_is_replaced_is_refused_invalid_state(
    store: Store, backend: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker retries an upload (a new begin of the same name) while a chunk of the old
    one is still being written, on another node. The begin deletes the old upload; the
    chunk must then be refused like any chunk of an upload that is gone,
    ``INVALID_STATE`` (409). On PostgreSQL the chunk's insert saw the old row (the delete
    was not committed yet), then waited on its foreign key for the delete, which failed
    it with ForeignKeyViolation: a 500 from the upload route."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    a = g.attempt
    old = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="shot.png", content_type="a/b")
    store.artifact_write(old, 0, b"first chunk")
    other = open_store(store_url(store), migrate=False, clock=clock)  # another node
    deleted, go_on = threading.Event(), threading.Event()
    execute = store_module._Tx.execute

    def pausing(self: Any, query: str, /, **params: Any) -> int:
        count = execute(self, query, **params)
        if self._store is other and query == "artifact_uploading_delete":
            deleted.set()  # the old upload is deleted, not yet committed
            assert go_on.wait(RACE_WAIT)
        return count

    monkeypatch.setattr(store_module._Tx, "execute", pausing)
    out: dict[str, Any] = {}

    def replace() -> None:
        out["new"] = other.artifact_begin(
            s.id, s.epoch, a.id, a.fence, name="shot.png", content_type="a/b"
        )

    def write() -> None:
        try:
            store.artifact_write(old, 1, b"second chunk")
        except Exception as exc:  # the test looks at what it was
            out["error"] = exc

    try:
        replacing = threading.Thread(target=replace)
        replacing.start()
        assert deleted.wait(RACE_WAIT)
        writing = threading.Thread(target=write)
        writing.start()
        if backend == "postgres":  # the chunk waits for the replacing transaction
            until_done_or_waiting_on_a_lock(writing, store_url(store))
            assert writing.is_alive(), "the chunk did not meet the replacing transaction"
        go_on.set()
        replacing.join(RACE_WAIT)
        writing.join(RACE_WAIT)
        assert not replacing.is_alive() and not writing.is_alive()
    finally:
        go_on.set()
        monkeypatch.undo()
        other.close()
    error = out.get("error")
    assert isinstance(error, OrbitError), repr(error)
    assert error.code == Code.INVALID_STATE and error.status == 409
    assert list(store.artifact_chunks(old)) == []
    new = out["new"]
    store.artifact_write(new, 0, b"all of it")
    store.artifact_commit(
        s.id, s.epoch, a.id, a.fence, new, size=9, sha256=hashlib.sha256(b"all of it").hexdigest()
    )
    assert [x.id for x in store.artifact_list(tid)] == [new]
    assert check_all(store) == []


def test_artifacts_are_listed_a_page_at_a_time(store: Store, clock: ManualClock) -> None:
    """A task's artifacts come in keyset pages, as its events and the task list do: up to
    ``limit`` (1-1000, 100 by default) after ``after_id``, in id (= creation) order. The
    list had no limit at all: a task with thousands of artifacts came back whole."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    made = []
    for i in range(5):
        made.append(_upload(store, s, g, f"part-{i}", [b"x"]).id)  # type: ignore[attr-defined]
        clock.advance(0.001)  # ids are time-ordered to the millisecond
    assert made == sorted(made)
    assert [x.id for x in store.artifact_list(tid)] == made
    pages, after = [], 0
    while True:
        page = store.artifact_list(tid, after_seq=after, limit=2)
        pages.append([x.id for x in page])
        if len(page) < 2:
            break
        after = page[-1].ready_seq  # type: ignore[assignment]
    assert pages == [made[:2], made[2:4], made[4:]]
    last = store.artifact_list(tid)[-1].ready_seq
    assert last is not None and store.artifact_list(tid, after_seq=last, limit=1) == []
    # an artifact id (a cursor from before the list was in commit order) stands for its
    # place; one that names no ready artifact of the task is refused
    assert [x.id for x in store.artifact_list(tid, after_id=made[1])] == made[2:]
    other_task = submit(store)
    for nowhere, wrong in ((made[0], other_task), (other_task, tid)):
        with pytest.raises(OrbitError) as err:
            store.artifact_list(wrong, after_id=nowhere)
        assert err.value.code == Code.INVALID_ARGUMENT
    for bad in (-1, 2**63, True, 1.0, "1"):
        with pytest.raises(OrbitError) as err:
            store.artifact_list(tid, after_seq=bad)  # type: ignore[arg-type]
        assert err.value.code == Code.INVALID_ARGUMENT, bad
    for limit in (0, 1001, -1, True, 2.0, "2"):
        with pytest.raises(OrbitError) as err:
            store.artifact_list(tid, limit=limit)  # type: ignore[arg-type]
        assert err.value.code == Code.INVALID_ARGUMENT, limit
    assert check_all(store) == []


def test_an_upload_committed_late_comes_after_the_cursor_of_a_page_read_before(
    store: Store, clock: ManualClock
) -> None:
    """A task's artifacts come in the order their uploads were committed, so a reader
    that pages on, or asks again later from its last cursor, gets every artifact
    committed since. The list was in id order, and an id is made when an upload begins:
    an upload begun before an artifact the reader had already read, and committed after
    its page, sorted before its cursor and was never seen by that reader."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    a = g.attempt
    slow = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="slow", content_type="a/b")
    store.artifact_write(slow, 0, b"a long upload")
    clock.advance(0.001)
    quick = _upload(store, s, g, "quick", [b"done at once"]).id  # type: ignore[attr-defined]
    assert slow < quick  # begun first: the id order put it first
    [read] = store.artifact_list(tid)
    assert read.id == quick and read.ready_seq is not None
    digest = hashlib.sha256(b"a long upload").hexdigest()
    store.artifact_commit(s.id, s.epoch, a.id, a.fence, slow, size=13, sha256=digest)
    again = store.artifact_list(tid, after_seq=read.ready_seq)
    assert [x.id for x in again] == [slow]
    assert [x.id for x in store.artifact_list(tid)] == [quick, slow]
    assert check_all(store) == []


def test_a_tasks_commits_take_turns_so_their_places_follow_their_commits(
    store: Store, backend: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two uploads of one task committed at once, on two nodes: the one that commits
    first has the earlier place, whichever began first. A commit draws its place while it
    holds its task's row lock, so the other commit waits for it (on PostgreSQL for the
    lock, on SQLite for the one writer) and draws after: a reader never gets a cursor
    that an artifact committed later could sort before."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    a = g.attempt
    began = {}
    for name in ("first-begun", "last-begun"):
        began[name] = store.artifact_begin(
            s.id, s.epoch, a.id, a.fence, name=name, content_type="a/b"
        )
        store.artifact_write(began[name], 0, name.encode())
        clock.advance(0.001)
    other = open_store(store_url(store), migrate=False, clock=clock)  # another node
    drawn, go_on = threading.Event(), threading.Event()
    execute = store_module._Tx.execute

    def pausing(self: Any, query: str, /, **params: Any) -> int:
        count = execute(self, query, **params)
        if self._store is other and query == "artifact_ready":
            drawn.set()  # its place drawn and written, not yet committed
            assert go_on.wait(RACE_WAIT)
        return count

    monkeypatch.setattr(store_module._Tx, "execute", pausing)

    def commit(node: Store, name: str) -> None:
        data = name.encode()
        node.artifact_commit(
            s.id,
            s.epoch,
            a.id,
            a.fence,
            began[name],
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    try:
        late = threading.Thread(target=commit, args=(other, "last-begun"))
        late.start()
        assert drawn.wait(RACE_WAIT)
        early = threading.Thread(target=commit, args=(store, "first-begun"))
        early.start()
        if backend == "postgres":  # the second commit waits for the first's task lock
            until_done_or_waiting_on_a_lock(early, store_url(store))
            assert early.is_alive(), "the second commit did not wait for the first"
            assert store.artifact_list(tid) == []  # neither committed yet (on SQLite a
            # listing is a transaction of its own, which waits for the one writer)
        go_on.set()
        late.join(RACE_WAIT)
        early.join(RACE_WAIT)
        assert not late.is_alive() and not early.is_alive()
    finally:
        go_on.set()
        monkeypatch.undo()
        other.close()
    [first] = store.artifact_list(tid, limit=1)
    assert first.id == began["last-begun"]  # committed first, though begun last
    assert [x.id for x in store.artifact_list(tid, after_seq=first.ready_seq or 0)] == [
        began["first-begun"]
    ]
    assert check_all(store) == []


def test_a_commit_draws_its_place_without_reading_the_artifacts(store: Store, backend: str) -> None:
    """Drawing a commit's place reads a counter, not the artifacts table: on SQLite the
    draw was one upsert whose fallback, ``max(ready_seq)`` over every artifact, was
    evaluated by every commit, under the one writer's lock (about 33 ms a commit at
    300,000 artifacts, and growing). The fallback stays for a counter row deleted by
    hand: the next place is still after every place given."""
    if backend == "sqlite":  # (PostgreSQL draws from a sequence)
        assert "orbit_artifacts" not in _plan(store, "artifact_ready_seq", {})
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    a = run_one(store, s).attempt
    digest = hashlib.sha256(b"x").hexdigest()
    for name in ("before", "after"):
        upload = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name=name, content_type="a/b")
        store.artifact_write(upload, 0, b"x")
        store.artifact_commit(s.id, s.epoch, a.id, a.fence, upload, size=1, sha256=digest)
        if backend == "sqlite" and name == "before":
            store.driver.queries["test_forget"] = (
                "DELETE FROM orbit_settings WHERE name = 'artifact_ready_seq'"
            )
            store._tx(lambda tx: tx.execute("test_forget"))
    before, after = store.artifact_list(tid)
    assert (before.name, after.name) == ("before", "after")
    assert after.ready_seq == (before.ready_seq or 0) + 1
    assert check_all(store) == []


@pytest.mark.parametrize("query", ["artifact_ready_seq", "artifact_ready", "event_insert_many"])
def test_a_commit_that_fails_half_way_leaves_the_upload_unlisted(store: Store, query: str) -> None:
    """A commit's place, its ``ready`` and its event are one transaction: one that fails
    at any of them lists nothing, and the same commit then goes through."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    a = run_one(store, s).attempt
    upload = store.artifact_begin(s.id, s.epoch, a.id, a.fence, name="x", content_type="a/b")
    store.artifact_write(upload, 0, b"x")
    digest = hashlib.sha256(b"x").hexdigest()
    events = len(store.event_list(task_id=tid))
    with store.inject_fault(query), pytest.raises(store_module.InjectedFault):
        store.artifact_commit(s.id, s.epoch, a.id, a.fence, upload, size=1, sha256=digest)
    assert store.artifact_list(tid) == [] and len(store.event_list(task_id=tid)) == events
    store.artifact_commit(s.id, s.epoch, a.id, a.fence, upload, size=1, sha256=digest)
    assert [x.id for x in store.artifact_list(tid)] == [upload]
    assert check_all(store) == []
