"""The event feed is a gap-free tail: a reader paging from the last event it was given
never steps past an event, even one whose transaction commits after the read with a
lower id than events already returned (docs/concepts.md, "The event log").

On PostgreSQL an event's id comes from a sequence when it is inserted, so a transaction
that commits late can hold a lower id than an event already visible; the feed is
ordered by (transaction id, event id) and holds back the events of transactions newer
than the oldest one still running. SQLite runs one writer at a time, so its ids are
already in commit order; the tests that need no second writer run on both backends.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import psycopg
import pytest
from starlette.exceptions import StarletteDeprecationWarning

from orbit.core.errors import Code, OrbitError
from orbit.core.limits import SECOND
from orbit.core.model import TaskSpec
from orbit.server import ServerSettings, create_app
from orbit.server.routes import event_position_cursor
from orbit.server.threads import THREADS
from orbit.store import Store, StoreConfig
from orbit.store import store as store_module
from tests.conftest import store_url
from tests.pg import ADMIN_DSN
from tests.store.helpers import RACE_WAIT, queue, submit

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

MS = 1000


def _insert(cx: psycopg.Connection[Any], kind: str, task_id: str | None) -> int:
    """An event written straight into the log, in ``cx``'s transaction."""
    row = cx.execute(
        "INSERT INTO orbit_events (at, kind, task_id) VALUES (0, %s, %s) RETURNING id",
        (kind, task_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _ids(rows: list[dict[str, Any]]) -> list[int]:
    return [int(r["id"]) for r in rows]


def _after(row: dict[str, Any]) -> dict[str, int]:
    """``event_list``'s arguments to page on from ``row``: its position."""
    return {"after_xid": row["xid"], "after_id": row["id"]}


@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("task_id", [None, "t1"], ids=["log", "task"])
def test_an_event_that_commits_late_with_a_lower_id_is_not_stepped_past(
    make_store: Any, task_id: str | None
) -> None:
    """Transaction A inserts an event and stays open; B inserts one (a higher id) and
    commits. Paging by id returned B's event, and a reader resuming after it never saw
    A's once A committed. Now B's event waits behind A's, and a reader from the cursor
    it held gets both, A's first, once A commits."""
    store: Store = make_store()
    hasty: Store = make_store(config=StoreConfig(event_wait_us=0))
    patient: Store = make_store(config=StoreConfig(event_wait_us=50 * MS))
    url = store_url(store)
    with psycopg.connect(url, autocommit=True) as cx:
        first = _insert(cx, "first", task_id)
    [seen] = store.event_list(task_id=task_id)
    assert seen["id"] == first
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        a_id = _insert(a, "a", task_id)  # A's transaction stays open
        b_id = _insert(b, "b", task_id)  # B's commits
        assert a_id < b_id
        assert _ids(hasty.event_list(task_id=task_id, **_after(seen))) == []
        # a read that waits for A gives up after its bound and returns what is settled
        assert _ids(patient.event_list(task_id=task_id, **_after(seen))) == []
        a.commit()
    both = store.event_list(task_id=task_id, **_after(seen))
    assert _ids(both) == [a_id, b_id]
    assert _ids(store.event_list(task_id=task_id, **_after(both[-1]))) == []


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_read_waits_for_the_older_transaction_to_end(
    make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that has seen B's committed event behind A's open transaction reads again
    until A ends, so it returns A's and B's events rather than a short page."""
    store: Store = make_store(config=StoreConfig(event_wait_us=int(RACE_WAIT * SECOND)))
    url = store_url(store)
    waiting = threading.Event()
    sleep = time.sleep

    def note_the_wait(seconds: float) -> None:
        waiting.set()
        sleep(seconds)

    monkeypatch.setattr(store_module.time, "sleep", note_the_wait)
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        a_id = _insert(a, "a", None)
        b_id = _insert(b, "b", None)
        read: list[list[int]] = []
        reader = threading.Thread(target=lambda: read.append(_ids(store.event_list())))
        reader.start()
        assert waiting.wait(RACE_WAIT)
        a.commit()
        reader.join(RACE_WAIT)
    assert read == [[a_id, b_id]]


@pytest.mark.parametrize("backend", ["postgres"])
def test_event_reads_waiting_for_an_older_transaction_hold_no_store_thread(
    make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's store calls run on ``THREADS`` threads (orbit/server/threads.py),
    which worker reports and submits share. A GET of events that waited for an older
    transaction slept on one of them, up to ``event_wait_us`` (2 s) each: as many
    readers as threads, while any transaction ran, held every report back. Here as many
    readers as threads wait for transaction A, and a task read is answered meanwhile."""
    store: Store = make_store(config=StoreConfig(event_wait_us=int(10 * RACE_WAIT * SECOND)))
    queue(store)
    tid = submit(store)
    token = store.token_create("admin", ["admin"])[1]
    url = store_url(store)
    settled = store.event_list()[-1]  # the last event, before A and B
    limits: set[int] = set()  # the readers (told by their limit) that found B's event
    all_waiting = threading.Event()
    read = store.driver.read

    def noted(name: str, params: Any) -> Any:
        rows = read(name, params)
        if name == "event_list" and rows and int(rows[0]["txid"]) >= int(rows[0]["horizon"]):
            limits.add(int(params["limit"]))
            if len(limits) == THREADS:
                all_waiting.set()
        return rows

    monkeypatch.setattr(store.driver, "read", noted)
    app = create_app(ServerSettings(db_url=url), store)
    auth = {"authorization": f"Bearer {token}"}
    cursor = event_position_cursor(settled)
    pages: list[list[int]] = []
    with (
        TestClient(app) as client,
        psycopg.connect(url) as a,
        psycopg.connect(url, autocommit=True) as b,
    ):
        a_id = _insert(a, "a", None)  # A's transaction stays open
        b_id = _insert(b, "b", None)

        def page(limit: int) -> None:
            got = client.get("/v1/events", params={"cursor": cursor, "limit": limit}, headers=auth)
            pages.append([int(e["id"]) for e in got.json()["items"]])

        readers = [
            threading.Thread(target=page, args=(n,), daemon=True) for n in range(1, THREADS + 1)
        ]
        for reader in readers:
            reader.start()
        assert all_waiting.wait(RACE_WAIT)
        answers: list[int] = []
        probe = threading.Thread(
            target=lambda: answers.append(client.get(f"/v1/tasks/{tid}", headers=auth).status_code),
            daemon=True,
        )
        probe.start()
        probe.join(RACE_WAIT)
        assert answers == [200]
        assert pages == []  # the readers still wait for A
        a.commit()
        for reader in readers:
            reader.join(RACE_WAIT)
    assert sorted(pages) == [[a_id]] + [[a_id, b_id]] * (THREADS - 1)


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_rolled_back_event_holds_the_feed_back_only_while_it_runs(make_store: Any) -> None:
    """A transaction that rolls back leaves no event, and the events behind it are
    returned once it has ended."""
    store: Store = make_store()
    hasty: Store = make_store(config=StoreConfig(event_wait_us=0))
    url = store_url(store)
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        _insert(a, "a", None)
        b_id = _insert(b, "b", None)
        assert hasty.event_list() == []
        a.rollback()
    assert _ids(store.event_list()) == [b_id]


@pytest.mark.parametrize("backend", ["postgres"])
def test_only_a_transaction_of_this_database_holds_the_feed_back(make_store: Any) -> None:
    """The horizon is the oldest running transaction of this database: one in another
    database on the same cluster (a CREATE DATABASE, another application) can write no
    event here. Any transaction of this one holds it back, whether or not it writes an
    event: nothing tells which will."""
    store: Store = make_store()
    hasty: Store = make_store(config=StoreConfig(event_wait_us=0))
    url = store_url(store)
    with psycopg.connect(ADMIN_DSN) as elsewhere, psycopg.connect(url) as here:
        elsewhere.execute("SELECT pg_current_xact_id()")  # takes a transaction id
        with psycopg.connect(url, autocommit=True) as b:
            first = _insert(b, "first", None)
        read = store.event_list()
        assert _ids(read) == [first]  # waits out only a finished one
        here.execute("SELECT pg_current_xact_id()")
        with psycopg.connect(url, autocommit=True) as b:
            second = _insert(b, "second", None)
        assert _ids(hasty.event_list(**_after(read[0]))) == []
        here.rollback()
        elsewhere.rollback()
    assert _ids(store.event_list(**_after(read[0]))) == [second]


#: events written and read one at a time while another database commits (on the code
#: before ``activity_snapshot``, 111 of 1,000 were held back)
RACED_READS = 1000


@pytest.mark.parametrize("backend", ["postgres"])
def test_another_databases_commits_never_hold_an_event_back(make_store: Any) -> None:
    """A transaction of another database that is running when a read's snapshot is taken
    and ends before the read looks at ``pg_stat_activity`` would count as possibly this
    database's and hold back every event after it. The read looks first
    (``activity_snapshot``, in the same implicit transaction), so such a transaction is
    either shown as another database's or ended before the snapshot. Three threads keep
    short transactions going in another database while each event, once committed, must
    be read at once and not held back."""
    store: Store = make_store()
    queue(store)
    stop = threading.Event()
    commits = [0, 0, 0]  # each writer's, so that the test cannot pass with none racing
    failures: list[BaseException] = []

    def commit_elsewhere(n: int) -> None:
        try:
            with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
                while not stop.is_set():
                    with cx.transaction():
                        cx.execute("SELECT pg_current_xact_id()")  # takes a transaction id
                        time.sleep(0.003)  # held open, as a short write would be
                    commits[n] += 1
        except BaseException as exc:  # re-raised by the test, not lost in the thread
            failures.append(exc)

    writers = [threading.Thread(target=commit_elsewhere, args=(n,)) for n in range(3)]
    for w in writers:
        w.start()
    try:
        held = []
        for _ in range(RACED_READS):
            tid = submit(store)
            rows, held_back = store.event_read(task_id=tid)
            if held_back or len(rows) != 1:
                held.append((len(rows), held_back))
    finally:
        stop.set()
        for w in writers:
            w.join()
    if failures:
        raise failures[0]
    assert held == []
    assert min(commits) >= 100, commits  # each writer raced the reads all along


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_log_is_read_in_transaction_id_order(make_store: Any) -> None:
    """The order is (xid, id), numerically: ids given here with small transaction ids,
    all long ended, in an order that neither id order nor the text of the xids ('100' <
    '99') gives. The xid went out as text named xid, and ORDER BY xid sorted that text."""
    store: Store = make_store()
    with psycopg.connect(store_url(store), autocommit=True) as cx:
        ids = [
            int(row[0])
            for row in cx.execute(
                "INSERT INTO orbit_events (at, kind, xid) VALUES"
                " (0, 'k', '100'), (0, 'k', '99'), (0, 'k', '100'), (0, 'k', '5')"
                " RETURNING id"
            ).fetchall()
        ]
    expected = [ids[3], ids[1], ids[0], ids[2]]
    assert _ids(store.event_list()) == expected
    assert _ids(store.event_list(after_xid=99, after_id=ids[1])) == expected[2:]
    assert _ids(store.event_list(after_xid=100, after_id=ids[0], limit=1)) == [ids[2]]


def test_a_caller_sees_the_events_it_has_just_committed(store: Store) -> None:
    queue(store)
    tid = submit(store)
    assert [e["kind"] for e in store.event_list(task_id=tid)] == ["submitted"]
    assert store.event_list()[-1]["task_id"] == tid


def test_paging_while_tasks_are_submitted_returns_every_event_once(store: Store) -> None:
    """Two threads submit tasks while a reader pages the log a few events at a time; the
    reader ends with every event, each once, and so does a reader of one task's feed."""
    queue(store)
    tid = submit(store)
    done = threading.Event()

    def write() -> None:
        for _ in range(40):
            store.task_submit_many([TaskSpec(queue="q", handler="h") for _ in range(3)])

    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    waiter = threading.Thread(target=lambda: ([w.join() for w in writers], done.set()))
    waiter.start()
    seen: list[int] = []
    after = {"after_xid": 0, "after_id": 0}
    while True:
        finished = done.is_set()  # read before the page: the page then holds every write
        page = store.event_list(**after, limit=7)
        seen += _ids(page)
        after = _after(page[-1]) if page else after
        if finished and not page:
            break
    waiter.join()
    assert len(seen) == len(set(seen)) == 2 + 2 * 40 * 3  # queue.created, 241 submitted
    assert sorted(seen) == sorted(_ids(store.event_list(limit=1000)))
    store.task_cancel(tid)
    first = store.event_list(task_id=tid, limit=1)
    task_ids = _ids(first) + _ids(store.event_list(task_id=tid, **_after(first[-1]), limit=1))
    assert task_ids == _ids(store.event_list(task_id=tid)) and len(task_ids) == 2


def test_a_cursor_that_names_no_event_is_refused(store: Store) -> None:
    """A position (``after_xid``, ``after_id``) is an event's place in the log: one no
    event has is refused, rather than read as a place it does not have: an id no event
    has, an event's id with another xid, an xid with id 0 (one below every event's xid
    read as the start of the log's tail)."""
    queue(store)
    submit(store)
    last = store.event_list()[-1]
    xid, event_id = last["xid"], last["id"]
    for task_id in (None, "nope"):
        for bad_xid, bad_id in ((xid, event_id + 1), (xid + 1, event_id), (xid + 1, 0), (1, 0)):
            with pytest.raises(OrbitError) as err:
                store.event_list(task_id=task_id, after_xid=bad_xid, after_id=bad_id)
            assert err.value.code == Code.INVALID_ARGUMENT
            assert f"after ({bad_xid}, {bad_id}) names no event" in err.value.message
    assert store.event_list(**_after(last)) == []
    assert store.event_list(task_id="nope", **_after(last)) == []


def test_an_id_alone_is_the_position_of_an_event_from_before_migration_8(
    store: Store, backend: str
) -> None:
    """The events written before migration 0008 have xid 0, so the id a cursor issued
    then names is their position with xid 0: paging on from it still works. On SQLite
    every event's xid is 0."""
    if backend == "postgres":
        with psycopg.connect(store_url(store), autocommit=True) as cx:  # as 0008 left them
            cx.execute(
                "INSERT INTO orbit_events (at, kind, xid) VALUES (0, 'old', '0'), (0, 'old', '0')"
            )
    else:
        queue(store, "old1")
        queue(store, "old2")
    old = store.event_list()
    assert [e["xid"] for e in old] == [0, 0]
    queue(store)
    after = store.event_list(after_id=old[0]["id"])
    assert _ids(after[:1]) == [old[1]["id"]] and len(after) == 2


def test_one_event_read_says_whether_events_are_held_back(store: Store) -> None:
    """``event_read`` is one read of ``event_list`` without its wait (the server waits
    between reads on its event loop): nothing is held back with no other transaction of
    this database running, on either backend, and a cursor naming no event is refused as
    there."""
    queue(store)
    tid = submit(store)
    rows, held_back = store.event_read()
    assert (_ids(rows), held_back) == (_ids(store.event_list()), False)
    assert [r["kind"] for r in store.event_read(task_id=tid)[0]] == ["submitted"]
    assert store.event_read(**_after(rows[-1])) == ([], False)
    with pytest.raises(OrbitError) as err:
        store.event_read(after_xid=rows[-1]["xid"], after_id=rows[-1]["id"] + 1)
    assert err.value.code == Code.INVALID_ARGUMENT


@pytest.mark.parametrize("backend", ["postgres"])
def test_one_event_read_holds_back_the_events_behind_an_open_transaction(
    make_store: Any,
) -> None:
    store: Store = make_store()
    url = store_url(store)
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        with psycopg.connect(url, autocommit=True) as first:
            before = _insert(first, "before", None)
        a_id = _insert(a, "a", None)
        _insert(b, "b", None)
        assert (_ids(store.event_read()[0]), store.event_read()[1]) == ([before], True)
        a.commit()
    rows, held_back = store.event_read(**_after(store.event_list()[0]))
    assert (_ids(rows)[0], held_back) == (a_id, False)


@pytest.mark.parametrize("backend", ["postgres"])
def test_an_event_written_in_a_savepoint_is_held_back_by_its_transaction(
    make_store: Any,
) -> None:
    """A subtransaction has an xid of its own, but an event takes its top-level
    transaction's (``pg_current_xact_id``), which the reader's snapshot lists among the
    running even when the subtransactions overflow the snapshot's cache (64 and more):
    the events behind it are held back until it commits, then come after its own."""
    store: Store = make_store()
    hasty: Store = make_store(config=StoreConfig(event_wait_us=0))
    url = store_url(store)
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        for n in range(70):
            a.execute(f"SAVEPOINT s{n}")
        a_id = _insert(a, "a", None)
        [[top, mine]] = a.execute(
            "SELECT pg_current_xact_id(), xid FROM orbit_events WHERE id = %s", (a_id,)
        ).fetchall()
        assert top == mine
        b_id = _insert(b, "b", None)
        assert _ids(hasty.event_list()) == []
        a.commit()
    assert _ids(store.event_list()) == [a_id, b_id]


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_subscriptions_read_says_when_it_held_events_back(make_store: Any) -> None:
    """``event_read(checked=False)``, a subscription's read: one query, no wait. While
    A's transaction is open, B's committed event is held back and the read says so, so a
    task stream does not take an empty read for the end of the task's events."""
    store: Store = make_store()
    url = store_url(store)
    with psycopg.connect(url, autocommit=True) as cx:
        first = _insert(cx, "first", None)
    [seen], held_back = store.event_read(checked=False)
    assert seen["id"] == first and not held_back
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        _insert(a, "a", None)
        _insert(b, "b", None)
        assert store.event_read(**_after(seen), checked=False) == ([], True)
        a.rollback()
    rows, held_back = store.event_read(**_after(seen), checked=False)
    assert [r["kind"] for r in rows] == ["b"] and not held_back


def test_a_subscriptions_read_of_nothing_new_holds_nothing_back(store: Store) -> None:
    queue(store)
    task_id = submit(store)
    rows, held_back = store.event_read(task_id=task_id, checked=False)
    assert [r["kind"] for r in rows] == ["submitted"] and not held_back
    assert store.event_read(task_id=task_id, **_after(rows[0]), checked=False) == ([], False)
    assert store.event_read(**_after(rows[0]), checked=False) == ([], False)
