"""Artifacts: chunked, fenced like every report, listed once ready, expired by the reaper."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import SECOND, Artifact, Grant, Outcome, Session
from orbit.store import Store, StoreConfig, open_store
from orbit.store import store as store_module
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import (
    RACE_WAIT,
    query_plan,
    queue,
    run_one,
    submit,
    until_done_or_waiting_on_a_lock,
    worker,
)


@dataclass
class Running:
    """A task whose attempt runs: every upload is made under its session and attempt
    (on ``node``, another store on the same database, where one is given)."""

    store: Store
    task_id: str
    session: Session
    grant: Grant

    def begin(
        self, name: str, content_type: str = "a/b", node: Store | None = None, **options: Any
    ) -> str:
        s, a = self.session, self.grant.attempt
        return (node or self.store).artifact_begin(
            s.id, s.epoch, a.id, a.fence, name=name, content_type=content_type, **options
        )

    def commit(self, upload: str, data: bytes, node: Store | None = None) -> Artifact:
        """Commit ``upload`` as holding ``data``: its size and digest."""
        s, a = self.session, self.grant.attempt
        digest = hashlib.sha256(data).hexdigest()
        return (node or self.store).artifact_commit(
            s.id, s.epoch, a.id, a.fence, upload, size=len(data), sha256=digest
        )

    def upload(self, name: str, chunks: list[bytes]) -> Artifact:
        """A whole upload, begun, written a chunk at a time and committed."""
        upload = self.begin(name, "image/png")
        for seq, chunk in enumerate(chunks):
            self.store.artifact_write(upload, seq, chunk)
        return self.commit(upload, b"".join(chunks))

    def finish(self) -> None:
        s, a = self.session, self.grant.attempt
        self.store.attempt_finish(s.id, s.epoch, a.id, a.fence, Outcome.success())


def _running(store: Store) -> Running:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    return Running(store, tid, s, run_one(store, s))


def test_upload_list_and_read_back(store: Store) -> None:
    run = _running(store)
    tid = run.task_id
    chunks = [bytes([i]) * 1000 for i in range(3)]
    artifact = run.upload("shot.png", chunks)
    assert artifact.size == 3000 and artifact.state == "ready"
    [listed] = store.artifact_list(tid)
    assert listed.name == "shot.png" and listed.content_type == "image/png"
    assert b"".join(store.artifact_chunks(listed.id)) == b"".join(chunks)
    assert [e["kind"] for e in store.event_list(task_id=tid)][-1] == "artifact"
    with pytest.raises(OrbitError) as err:
        run.upload("shot.png", [b"x"])
    assert err.value.code == Code.ARTIFACT_EXISTS
    assert check_all(store) == []


def test_an_upload_is_invisible_until_committed_and_abort_drops_it(store: Store) -> None:
    run = _running(store)
    artifact_id = run.begin("half", "application/zip")
    store.artifact_write(artifact_id, 0, b"part")
    assert store.artifact_list(run.task_id) == []
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
    run = _running(store)
    tid, s, g = run.task_id, run.session, run.grant
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
    run = _running(store)
    artifact_id = run.begin("slow", "image/png")
    store.artifact_write(artifact_id, 0, b"x")
    clock.advance(31)
    with pytest.raises(Rejected) as err:
        run.commit(artifact_id, b"x")
    assert err.value.code == Code.LEASE_EXPIRED
    assert store.artifact_list(run.task_id) == []


def _expiring_in_ten_seconds(run: Running) -> str:
    """An artifact committed with a TTL of 10 s, its attempt ended since."""
    artifact_id = run.begin("tmp", "text/plain", ttl_us=10_000_000)
    run.store.artifact_write(artifact_id, 0, b"bye")
    run.commit(artifact_id, b"bye")
    run.finish()
    return artifact_id


def test_the_reaper_expires_artifacts(store: Store, clock: ManualClock) -> None:
    """Deleted once the grace after its expiry has passed (``artifact_grace_us``)."""
    run = _running(store)
    artifact_id = _expiring_in_ten_seconds(run)
    clock.advance(9)
    assert store.reap().artifacts_expired == 0
    clock.advance(2 + store.config.artifact_grace_us / SECOND)
    assert store.reap().artifacts_expired == 1
    assert store.artifact_list(run.task_id) == []
    assert list(store.artifact_chunks(artifact_id)) == []


def test_an_artifact_is_kept_for_its_ttl_from_its_commit(store: Store, clock: ManualClock) -> None:
    """An upload slower than its TTL (2 s; the upload 3 s, well inside its 30 s lease) is
    kept for its TTL from its commit. The TTL counted from the begin: such an upload was
    committed already expired (never readable), and a reaper pass in between deleted it
    in flight (its next chunk refused INVALID_STATE). Nor does an upload in flight wake
    the reaper: only a committed artifact's expiry is its next due instant."""
    run = _running(store)
    upload = run.begin("slow.bin", ttl_us=2 * SECOND)
    store.artifact_write(upload, 0, b"x")
    clock.advance(3)
    assert store.reap_due_in() == pytest.approx(27)  # the run lease's, not the upload's
    reaped = store.reap()
    assert (reaped.artifacts_expired, reaped.uploads_dropped) == (0, 0)
    store.artifact_write(upload, 1, b"y")  # still uploading
    made = run.commit(upload, b"xy")
    assert made.expires_at == clock.now + 2 * SECOND
    assert store.artifact_get(upload).expires_at == made.expires_at
    grace = store.config.artifact_grace_us / SECOND
    # the run lease's still: the artifact is due at its expiry's grace, 2 + 600 s on
    assert store.reap_due_in() == pytest.approx(27)
    clock.advance(1.5)
    assert [x.id for x in store.artifact_list(run.task_id)] == [upload]
    assert store.reap().artifacts_expired == 0
    clock.advance(0.5)
    assert store.artifact_list(run.task_id) == []  # gone for readers from its expiry
    clock.advance(grace)
    assert store.reap().artifacts_expired == 1
    assert list(store.artifact_chunks(upload)) == []
    assert check_all(store) == []


def test_a_download_begun_before_the_expiry_reads_on_to_its_end(
    make_store: Callable[..., Store], clock: ManualClock
) -> None:
    """A 40 MB download, its artifact expiring 3.5 s into it: the reaper's pass deleted
    the chunks under it, and the body stopped at 4.4 MB. The reaper now leaves an expired
    artifact's bytes for ``artifact_grace_us`` (10 minutes by default), while every read
    treats it as gone from its expiry (no download starts, it is not listed, its
    metadata is 404), and only then deletes it. The reaper sleeps through the grace too:
    its next due instant is the grace's end, not the expiry it has passed."""
    assert StoreConfig().artifact_grace_us == 10 * 60 * SECOND
    day = 24 * 3600 * SECOND  # a session that outlives the grace: the artifact is due first
    store = make_store(clock=clock, config=StoreConfig(session_ttl_us=day))
    grace = store.config.artifact_grace_us / SECOND
    run = _running(store)
    chunks = [bytes([i]) * 1000 for i in range(4)]
    upload = run.begin("big.bin", ttl_us=2 * SECOND)
    for seq, chunk in enumerate(chunks):
        store.artifact_write(upload, seq, chunk)
    run.commit(upload, b"".join(chunks))
    run.finish()
    reading = store.artifact_chunks(upload)
    assert next(reading) == chunks[0]  # a download has started
    clock.advance(2)  # the artifact expires
    assert store.artifact_list(run.task_id) == []
    with pytest.raises(OrbitError) as err:
        store.artifact_get(upload)  # no download starts now
    assert err.value.code == Code.ARTIFACT_NOT_FOUND
    assert store.reap().artifacts_expired == 0
    assert store.reap_due_in() == pytest.approx(grace)
    assert next(reading) == chunks[1]
    clock.advance(grace - 0.001)
    assert store.reap().artifacts_expired == 0
    assert list(reading) == chunks[2:]  # whole, however the reaper ran meanwhile
    clock.advance(0.001)
    assert store.reap().artifacts_expired == 1
    assert list(store.artifact_chunks(upload)) == []
    assert check_all(store) == []


def test_the_grace_is_the_stores_to_set(
    make_store: Callable[..., Store], clock: ManualClock
) -> None:
    """``artifact_grace_us`` is a setting: 0 deletes an artifact at its expiry."""
    store = make_store(clock=clock, config=StoreConfig(artifact_grace_us=0))
    run = _running(store)
    artifact_id = _expiring_in_ten_seconds(run)
    assert store.reap_due_in() == pytest.approx(10)
    clock.advance(10)
    assert store.reap().artifacts_expired == 1
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
    run = _running(store)
    args: dict[str, object] = {"name": "ok", "content_type": "image/png", **kw}
    before = len(store.event_list())
    with pytest.raises(OrbitError) as err:
        run.begin(**args)  # type: ignore[arg-type]
    assert err.value.code == code
    assert len(store.event_list()) == before


@pytest.mark.parametrize(
    ("content_type", "says"),
    [
        ("a/" + "b" * 250, "content_type must be 3 to 200 characters long; got 252"),
        ("a/", "content_type must be 3 to 200 characters long; got 2"),
        ("png", "content_type must look like type/subtype"),
        ("text/plain; name=日本", "Latin-1 characters (what an HTTP header carries); got '日'"),
        ("text/plain\x01", r"got '\x01'"),
        ("text/pl\x7fain", r"got '\x7f'"),
    ],
)
def test_a_content_type_is_refused_naming_the_rule_it_breaks(
    store: Store, content_type: str, says: str
) -> None:
    """A 252-character type was refused as not looking like type/subtype, which it did:
    the message names the limit now, and every other rule by what broke it. Refused
    before anything is written."""
    run = _running(store)
    before = len(store.event_list())
    with pytest.raises(OrbitError) as err:
        run.begin("x.bin", content_type)
    assert err.value.code == Code.INVALID_ARGUMENT
    assert says in err.value.message
    assert len(store.event_list()) == before
    upload = run.begin("x.bin", "a/b")  # the name was not taken by the refusal
    run.commit(upload, b"")
    assert [a.name for a in store.artifact_list(run.task_id)] == ["x.bin"]


@pytest.mark.parametrize(
    "content_type", ["a/" + "b" * 198, "text/plain; name=\xe9", "text/plain;\tq=1", "a/b"]
)
def test_a_content_type_an_http_header_carries_is_kept_as_given(
    store: Store, content_type: str
) -> None:
    """The bounds themselves, a Latin-1 parameter and a tab: what the server takes."""
    run = _running(store)
    upload = run.begin("x.bin", content_type)
    assert run.commit(upload, b"").content_type == content_type


def test_a_cancel_refuses_new_artifacts_and_hides_the_attempts_own(store: Store) -> None:
    """Cancel wins over artifacts as over results (DESIGN §5.1): once cancel is asked,
    no artifact is begun or committed (evidence left), and one committed before is no
    longer listed or read, from the moment cancel is asked (the task ``cancelling``,
    its attempt still running, as a success result is not shown) and once the attempt
    ends cancelled."""
    run = _running(store)
    tid, s, a = run.task_id, run.session, run.grant.attempt
    before = run.upload("early.png", [b"early"])
    pending = run.begin("half")
    store.artifact_write(pending, 0, b"x")
    store.task_cancel(tid)
    assert store.task_get(tid).state == "cancelling"
    assert store.artifact_list(tid) == []
    with pytest.raises(OrbitError) as err:
        store.artifact_get(before.id)
    assert err.value.code == Code.ARTIFACT_NOT_FOUND
    with pytest.raises(Rejected) as err:
        run.begin("late")
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
        store.artifact_get(before.id)
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
    run = _running(store)
    cut = run.begin("shot.png")
    store.artifact_write(cut, 0, b"half of it")
    done = run.upload("shot.png", [b"all of it"])  # the retry, no abort before
    assert list(store.artifact_chunks(cut)) == []
    assert [x.id for x in store.artifact_list(run.task_id)] == [done.id]
    left = run.begin("left")
    store.artifact_write(left, 0, b"never finished")
    assert store.reap().uploads_dropped == 0  # its attempt still runs: it may go on
    run.finish()
    assert store.reap().uploads_dropped == 1
    assert list(store.artifact_chunks(left)) == []
    assert b"".join(store.artifact_chunks(done.id)) == b"all of it"
    assert check_all(store) == []


def test_the_commit_of_a_replaced_upload_is_refused_invalid_state(store: Store) -> None:
    """The worker's retry of a name (a new begin) replaces the upload still under way; that
    upload's own commit, its body all sent, is then refused ``INVALID_STATE`` (409) as its
    chunks are, and as docs/protocol.md says. It was ``ARTIFACT_NOT_FOUND`` (404): the
    worker was told that its own upload did not exist."""
    run = _running(store)
    old = run.begin("shot.png")
    store.artifact_write(old, 0, b"all of the old body")
    new = run.begin("shot.png")
    with pytest.raises(OrbitError) as err:
        run.commit(old, b"all of the old body")
    assert (err.value.code, err.value.status) == (Code.INVALID_STATE, 409)
    assert "replaced" in err.value.message
    store.artifact_write(new, 0, b"the retry")
    run.commit(new, b"the retry")
    assert [x.id for x in store.artifact_list(run.task_id)] == [new]
    assert check_all(store) == []


def test_the_commit_of_an_upload_whose_attempt_ended_is_refused_for_the_attempt(
    store: Store, clock: ManualClock
) -> None:
    """The lease runs out mid-upload, a reaper pass ends the attempt and the next drops
    its unfinished upload: the commit that comes after is refused for the attempt
    (``ATTEMPT_ENDED``, with a ``rejected`` event), as every late report is. The missing
    upload was checked first, and the commit told it had been replaced or aborted."""
    run = _running(store)
    upload = run.begin("late.bin")
    store.artifact_write(upload, 0, b"all of it")
    clock.advance(31)  # the 30 s run lease runs out mid-upload
    store.reap()  # the attempt ends
    assert store.reap().uploads_dropped == 1  # its upload, never committed, goes
    with pytest.raises(Rejected) as err:
        run.commit(upload, b"all of it")
    assert err.value.code == Code.ATTEMPT_ENDED
    last = store.event_list(task_id=run.task_id)[-1]
    assert last["kind"] == "rejected" and last["code"] == Code.ATTEMPT_ENDED
    assert check_all(store) == []


def test_an_upload_left_unfinished_goes_after_a_day_though_its_attempt_runs(
    make_store: Callable[..., Store],
) -> None:
    """An upload whose server was killed mid-body is never aborted, and its TTL counts
    only from a commit: while its attempt ran (a handler renewing its lease for weeks) it
    was kept, bytes and all, for as long. The reaper drops it once it is a day old
    (``StoreConfig.upload_max_us``), its attempt still running, and not before."""
    clock = ManualClock()
    days = 3 * 24 * 3600 * SECOND  # the lease and the session stand for renewals
    store = make_store(clock=clock, config=StoreConfig(lease_ttl_us=days, session_ttl_us=days))
    run = _running(store)
    left = run.begin("left.bin")
    store.artifact_write(left, 0, b"half of it")
    clock.advance(24 * 3600 - 1)
    assert store.reap().uploads_dropped == 0
    clock.advance(1)
    assert store.reap().uploads_dropped == 1
    assert store.attempt_get(run.grant.attempt.id).state == "running"
    assert list(store.artifact_chunks(left)) == []
    done = run.upload("done.bin", [b"the retry"])  # the name is free again
    assert [a.id for a in store.artifact_list(run.task_id)] == [done.id]
    assert check_all(store) == []


def test_an_expired_artifact_is_not_served_before_the_reaper_deletes_it(
    store: Store, clock: ManualClock
) -> None:
    """Past its ``expires_at`` an artifact is gone, whether or not a reaper pass has
    run yet: a listing or a download between the two used to still serve it."""
    run = _running(store)
    artifact_id = _expiring_in_ten_seconds(run)
    clock.advance(9)
    assert [x.id for x in store.artifact_list(run.task_id)] == [artifact_id]
    clock.advance(1)
    assert store.artifact_list(run.task_id) == []
    with pytest.raises(OrbitError) as err:
        store.artifact_get(artifact_id)
    assert err.value.code == Code.ARTIFACT_NOT_FOUND


def _second_meets_the_first(
    store: Store,
    backend: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    *,
    pause_after: str,
    first: Callable[[Store], object],
    second: Callable[[], object],
    waits: str,
    while_waiting: Callable[[], None] = lambda: None,
) -> None:
    """Two nodes at once: ``first`` runs on another node (a store of its own on the same
    database) and holds its transaction open once its ``pause_after`` query has run;
    ``second`` then runs on ``store``. On PostgreSQL the second must wait for the first's
    transaction (``waits`` names what failed to wait), and ``while_waiting`` checks what
    holds meanwhile; then the first goes on, and both end."""
    other = open_store(store_url(store), migrate=False, clock=clock)  # another node
    paused, go_on = threading.Event(), threading.Event()
    execute = store_module._Tx.execute

    def pausing(self: Any, query: str, /, **params: Any) -> int:
        count = execute(self, query, **params)
        if self._store is other and query == pause_after:
            paused.set()  # written, not yet committed
            assert go_on.wait(RACE_WAIT)
        return count

    monkeypatch.setattr(store_module._Tx, "execute", pausing)
    try:
        ahead = threading.Thread(target=first, args=(other,))
        ahead.start()
        assert paused.wait(RACE_WAIT)
        behind = threading.Thread(target=second)
        behind.start()
        if backend == "postgres":
            until_done_or_waiting_on_a_lock(behind, store_url(store))
            assert behind.is_alive(), waits
            while_waiting()
        go_on.set()
        ahead.join(RACE_WAIT)
        behind.join(RACE_WAIT)
        assert not ahead.is_alive() and not behind.is_alive()
    finally:
        go_on.set()
        monkeypatch.undo()
        other.close()


def test_a_chunk_written_while_its_upload_is_replaced_is_refused_invalid_state(
    store: Store, backend: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker retries an upload (a new begin of the same name) while a chunk of the old
    one is still being written, on another node. The begin deletes the old upload; the
    chunk must then be refused like any chunk of an upload that is gone,
    ``INVALID_STATE`` (409). On PostgreSQL the chunk's insert saw the old row (the delete
    was not committed yet), then waited on its foreign key for the delete, which failed
    it with ForeignKeyViolation: a 500 from the upload route."""
    run = _running(store)
    old = run.begin("shot.png")
    store.artifact_write(old, 0, b"first chunk")
    out: dict[str, Any] = {}

    def replace(node: Store) -> None:
        out["new"] = run.begin("shot.png", node=node)

    def write() -> None:
        try:
            store.artifact_write(old, 1, b"second chunk")
        except Exception as exc:  # the test looks at what it was
            out["error"] = exc

    _second_meets_the_first(  # the chunk waits for the replacing transaction
        store,
        backend,
        clock,
        monkeypatch,
        pause_after="artifact_uploading_delete",  # the old upload deleted, not committed
        first=replace,
        second=write,
        waits="the chunk did not meet the replacing transaction",
    )
    error = out.get("error")
    assert isinstance(error, OrbitError), repr(error)
    assert error.code == Code.INVALID_STATE and error.status == 409
    assert list(store.artifact_chunks(old)) == []
    new = out["new"]
    store.artifact_write(new, 0, b"all of it")
    run.commit(new, b"all of it")
    assert [x.id for x in store.artifact_list(run.task_id)] == [new]
    assert check_all(store) == []


def test_artifacts_are_listed_a_page_at_a_time(store: Store, clock: ManualClock) -> None:
    """A task's artifacts come in keyset pages, as its events and the task list do: up to
    ``limit`` (1-1000, 100 by default) after ``after_id``, in id (= creation) order. The
    list had no limit at all: a task with thousands of artifacts came back whole."""
    run = _running(store)
    tid = run.task_id
    made = []
    for i in range(5):
        made.append(run.upload(f"part-{i}", [b"x"]).id)
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


def test_a_place_never_drawn_is_refused_and_an_expired_artifacts_place_is_not(
    store: Store, clock: ManualClock
) -> None:
    """A place past every place drawn (by any task's commit) names no artifact the list
    could have shown: INVALID_ARGUMENT (the API's INVALID_CURSOR). Its empty page read
    as "nothing new yet" for ever after, so a follower holding it never saw the task's
    artifacts to come. The place of an artifact expired and deleted since is still a
    cursor: the counter, not the rows, bounds the places."""
    run = _running(store)
    tid = run.task_id
    kept = run.upload("kept", [b"x"])
    gone = _expiring_in_ten_seconds(run)
    [_, listed] = store.artifact_list(tid)
    assert listed.id == gone and listed.ready_seq is not None
    last = listed.ready_seq
    clock.advance(11 + store.config.artifact_grace_us / SECOND)
    assert store.reap().artifacts_expired == 1
    assert [x.id for x in store.artifact_list(tid)] == [kept.id]
    assert store.artifact_list(tid, after_seq=last) == []  # deleted: its place stands
    assert store.artifact_list(tid, after_seq=kept.ready_seq or 0) == []
    for never in (last + 1, 2**63 - 1):
        with pytest.raises(OrbitError) as err:
            store.artifact_list(tid, after_seq=never)
        assert err.value.code == Code.INVALID_ARGUMENT, never
    assert check_all(store) == []


def test_an_upload_committed_late_comes_after_the_cursor_of_a_page_read_before(
    store: Store, clock: ManualClock
) -> None:
    """A task's artifacts come in the order their uploads were committed, so a reader
    that pages on, or asks again later from its last cursor, gets every artifact
    committed since. The list was in id order, and an id is made when an upload begins:
    an upload begun before an artifact the reader had already read, and committed after
    its page, sorted before its cursor and was never seen by that reader."""
    run = _running(store)
    tid = run.task_id
    slow = run.begin("slow")
    store.artifact_write(slow, 0, b"a long upload")
    clock.advance(0.001)
    quick = run.upload("quick", [b"done at once"]).id
    assert slow < quick  # begun first: the id order put it first
    [read] = store.artifact_list(tid)
    assert read.id == quick and read.ready_seq is not None
    run.commit(slow, b"a long upload")
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
    run = _running(store)
    tid = run.task_id
    began = {}
    for name in ("first-begun", "last-begun"):
        began[name] = run.begin(name)
        store.artifact_write(began[name], 0, name.encode())
        clock.advance(0.001)

    def neither_committed_yet() -> None:
        assert store.artifact_list(tid) == []  # (on SQLite a listing is a transaction
        # of its own, which waits for the one writer)

    _second_meets_the_first(  # the second commit waits for the first's task lock
        store,
        backend,
        clock,
        monkeypatch,
        pause_after="artifact_ready",  # its place drawn and written, not yet committed
        first=lambda node: run.commit(began["last-begun"], b"last-begun", node),
        second=lambda: run.commit(began["first-begun"], b"first-begun"),
        waits="the second commit did not wait for the first",
        while_waiting=neither_committed_yet,
    )
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
        assert "orbit_artifacts" not in query_plan(store, "artifact_ready_seq", {})
    run = _running(store)
    tid = run.task_id
    for name in ("before", "after"):
        upload = run.begin(name)
        store.artifact_write(upload, 0, b"x")
        run.commit(upload, b"x")
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
    run = _running(store)
    tid = run.task_id
    upload = run.begin("x")
    store.artifact_write(upload, 0, b"x")
    events = len(store.event_list(task_id=tid))
    with store.inject_fault(query), pytest.raises(store_module.InjectedFault):
        run.commit(upload, b"x")
    assert store.artifact_list(tid) == [] and len(store.event_list(task_id=tid)) == events
    run.commit(upload, b"x")
    assert [x.id for x in store.artifact_list(tid)] == [upload]
    assert check_all(store) == []
