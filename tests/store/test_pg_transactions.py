"""How the PostgreSQL driver begins and ends a transaction.

Its connections are in autocommit mode and a transaction is begun by its first
statement, which carries ``BEGIN`` with it in one round trip (libpq's pipeline mode). The
driver then commits, or rolls back when the work raised or when one of its statements
failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import pq

from orbit.core.model import TaskSpec
from orbit.core.transitions import new_task
from orbit.store import InjectedFault, Store
from orbit.store.postgres.driver import LOCK_MANY_INLINE_MAX, PostgresDriver, _Raw
from orbit.store.rows import task_to_row
from tests.store.helpers import queue, run_one, submit, worker

pytestmark = pytest.mark.parametrize("backend", ["postgres"])

#: what a first read must carry exactly
AWKWARD = [
    "it's",
    'a "quote"',
    "back\\slash",
    "'; DROP TABLE orbit_tasks; --",
    "snow ☃",
    "$1 %s %(x)s",
]


@pytest.fixture
def driver(store: Store) -> Iterator[PostgresDriver]:
    drv = store.driver
    assert isinstance(drv, PostgresDriver)
    drv.queries["test_echo"] = "SELECT CAST(%(v)s AS text) AS v, CAST(%(n)s AS bigint) AS n"
    drv.queries["test_note"] = "INSERT INTO orbit_settings (name, int_value) VALUES (%(name)s, 1)"
    drv.queries["test_notes"] = "SELECT name FROM orbit_settings WHERE name LIKE 'test-%%'"
    yield drv


def _notes(driver: PostgresDriver) -> list[str]:
    with driver.transaction() as cx:
        return sorted(r["name"] for r in cx.fetch("test_notes", {}))


def test_a_first_read_carries_its_parameters_exactly(driver: PostgresDriver) -> None:
    for value in AWKWARD:
        for n in (0, -(2**63), 2**63 - 1):
            with driver.transaction() as cx:
                first = cx.fetch("test_echo", {"v": value, "n": n})
                again = cx.fetch("test_echo", {"v": value, "n": n})  # bound server-side
            assert first == again == [{"v": value, "n": n}]


def test_a_first_read_with_a_nul_is_refused_and_nothing_stays_open(
    driver: PostgresDriver,
) -> None:
    with pytest.raises(psycopg.DataError), driver.transaction() as cx:
        cx.fetch("test_echo", {"v": "a\x00b", "n": 1})
    with driver.transaction() as cx:  # the connection is usable, outside any transaction
        assert cx.fetch("test_echo", {"v": "ok", "n": 1}) == [{"v": "ok", "n": 1}]


def test_a_first_read_that_fails_on_the_server_leaves_no_transaction_open(
    driver: PostgresDriver, caplog: pytest.LogCaptureFixture
) -> None:
    """``BEGIN`` ran, then the read failed: the connection goes back to the pool rolled
    back (the pool warns when it is handed one still in a transaction)."""
    statuses: list[psycopg.pq.TransactionStatus] = []
    with pytest.raises(psycopg.errors.InvalidTextRepresentation), driver.transaction() as cx:
        raw: Any = cx._cx  # type: ignore[attr-defined]
        try:
            cx.fetch("test_echo", {"v": "x", "n": "not a number"})
        finally:
            statuses.append(raw.info.transaction_status)
    assert statuses == [psycopg.pq.TransactionStatus.INERROR]  # BEGIN had run
    assert not [r for r in caplog.records if r.name.startswith("psycopg")], caplog.records


def test_work_that_raises_after_the_first_read_is_rolled_back(driver: PostgresDriver) -> None:
    with pytest.raises(RuntimeError), driver.transaction() as cx:
        cx.fetch("test_echo", {"v": "x", "n": 1})
        cx.execute("test_note", {"name": "test-undone"})
        raise RuntimeError("the work failed")
    with driver.transaction() as cx:
        cx.execute("test_note", {"name": "test-kept"})  # a write first: BEGIN alone
    assert _notes(driver) == ["test-kept"]


def test_a_failed_statement_whose_error_was_swallowed_is_not_committed(
    driver: PostgresDriver,
) -> None:
    """PostgreSQL answers the ``COMMIT`` of a failed transaction with a rollback and no
    error; the driver must not report such a transaction as committed."""
    with pytest.raises(psycopg.errors.InFailedSqlTransaction), driver.transaction() as cx:
        cx.execute("test_note", {"name": "test-lost"})
        with pytest.raises(psycopg.errors.UniqueViolation):
            cx.execute("test_note", {"name": "test-lost"})
    assert _notes(driver) == []


def test_a_transaction_that_ran_nothing_leaves_its_connection_idle(
    driver: PostgresDriver,
) -> None:
    raw: Any
    with driver.transaction() as cx:
        raw = cx._cx  # type: ignore[attr-defined]
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with driver.transaction() as cx:
        cx.fetch("test_echo", {"v": "x", "n": 1})
        raw = cx._cx  # type: ignore[attr-defined]
        assert raw.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_the_first_statement_and_its_begin_form_one_transaction(driver: PostgresDriver) -> None:
    """The first statement already runs inside the transaction: its clock is the
    transaction's, and a later statement reads the same ``now()``."""
    driver.queries["test_clocks"] = "SELECT CAST(now() AS text) AS t, txid_current() AS x"
    with driver.transaction() as cx:
        first = cx.fetch("test_clocks", {})
        time.sleep(0.01)
        second = cx.fetch("test_clocks", {})
    assert first == second  # one transaction: the same start and the same id


def test_waiting_for_the_first_statement_releases_the_gil(driver: PostgresDriver) -> None:
    """The pipelined first statement waits on its socket, not inside libpq holding the
    GIL (which would freeze the server's event loop for a round trip)."""
    driver.queries["test_sleep"] = "SELECT CAST(pg_sleep(%(s)s) AS text) AS slept"
    steps = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            steps[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        before = steps[0]
        time.sleep(0.3)  # the spinner's pace while this thread waits without the GIL
        idle = steps[0] - before
        with driver.transaction() as cx:
            before = steps[0]
            cx.fetch("test_sleep", {"s": 0.3})
            during = steps[0] - before
    finally:
        stop.set()
        spinner.join()
    assert during > idle / 4, (during, idle)  # held, it barely moves (about 2 %)


def test_a_connection_lost_during_the_first_statement_is_replaced(
    driver: PostgresDriver,
) -> None:
    """A connection whose server process is gone fails the one transaction that draws
    it (a psycopg error, not a hang or a wrong answer) and is then discarded."""
    driver.queries["test_pid"] = "SELECT pg_backend_pid() AS pid, CAST(%(v)s AS text) AS v"
    with driver.transaction() as cx:
        (row,) = cx.fetch("test_pid", {"v": "x"})
    with psycopg.connect(driver.dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [row["pid"]])
    outcomes: list[str] = []
    for i in range(6):  # the pool hands its connections out in turn
        try:
            with driver.transaction() as cx:
                (again,) = cx.fetch("test_pid", {"v": f"y{i}"})
            assert again["v"] == f"y{i}" and again["pid"] != row["pid"]
            outcomes.append("ok")
        except psycopg.DatabaseError:  # "server closed the connection unexpectedly"
            outcomes.append("lost")
    assert outcomes.count("lost") <= 1 and outcomes[-3:] == ["ok"] * 3, outcomes
    with driver.transaction() as cx:
        cx.execute("test_note", {"name": "test-after"})
    assert _notes(driver) == ["test-after"]


def test_a_write_and_its_notice_share_a_round_trip_and_its_fate(
    store: Store, driver: PostgresDriver
) -> None:
    """A single submit's insert (a statement with its own data-modifying WITH, hoisted
    into the batched one) and its NOTIFY go as one statement: when the insert fails on
    the server, no one is told and nothing is written; when it succeeds, the commit
    delivers the notice once."""
    queue(store)
    good = new_task(TaskSpec(queue="q", handler="h"), task_id="t-good", payload="1", now=1)
    bad = {**task_to_row(good), "id": "t-bad", "priority": "not a number"}
    with psycopg.connect(driver.dsn, autocommit=True) as listener:
        listener.execute("LISTEN orbit_ready")
        with pytest.raises(psycopg.errors.InvalidTextRepresentation), driver.transaction() as cx:
            cx.write_batch([("task_submit_many", [bad])], [("orbit_ready", "x:ready:q")])
        with driver.transaction() as cx:
            counts = cx.write_batch(
                [("task_submit_many", [task_to_row(good)])], [("orbit_ready", "y:ready:q")]
            )
        with psycopg.connect(driver.dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify('orbit_ready', 'sentinel')")
        heard = []
        for n in listener.notifies(timeout=5):
            if n.payload == "sentinel":
                break
            heard.append(n.payload)
    assert counts == [1] and heard == ["y:ready:q"]
    assert [t.id for t in store.task_list()] == ["t-good"]


def test_a_streams_notices_go_in_its_pipeline_after_its_chunks_and_share_its_fate(
    store: Store, driver: PostgresDriver
) -> None:
    """A streamed write's notices are read once every chunk is made and sent in the same
    pipeline, after the chunks (a statement after it cost a round trip): a stream whose
    chunk fails on the server tells no one, and one that commits tells each listener once."""
    queue(store)
    rows = [
        task_to_row(
            new_task(TaskSpec(queue="q", handler="h"), task_id=f"t-{i}", payload="1", now=1)
        )
        for i in range(3)
    ]
    bad = {**rows[2], "id": "t-bad", "priority": "not a number"}
    made: list[str] = []

    def chunks(last: dict[str, object]) -> Iterator[list[dict[str, object]]]:
        for row in (rows[0], rows[1], last):
            made.append(str(row["id"]))
            yield [row]

    def notices(payload: str) -> Callable[[], list[tuple[str, str]]]:
        def read() -> list[tuple[str, str]]:
            made.append(f"notify:{pq.PipelineStatus(cx._cx.pgconn.pipeline_status).name}")
            return [("orbit_ready", payload)]

        return read

    with psycopg.connect(driver.dsn, autocommit=True) as listener:
        listener.execute("LISTEN orbit_ready")
        with pytest.raises(psycopg.errors.InvalidTextRepresentation), driver.transaction() as cx:
            cx.write_stream("task_submit_many", chunks(bad), notices("x:ready:q"))
        assert made == ["t-0", "t-1", "t-bad", "notify:ON"]
        made.clear()
        with driver.transaction() as cx:
            count = cx.write_stream("task_submit_many", chunks(rows[2]), notices("y:ready:q"))
        assert made == ["t-0", "t-1", "t-2", "notify:ON"]
        with psycopg.connect(driver.dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify('orbit_ready', 'sentinel')")
        heard = []
        for n in listener.notifies(timeout=5):
            if n.payload == "sentinel":
                break
            heard.append(n.payload)
    assert count == 3 and heard == ["y:ready:q"]
    assert sorted(t.id for t in store.task_list()) == ["t-0", "t-1", "t-2"]


def test_a_prelude_is_held_before_the_statement_it_travels_with(driver: PostgresDriver) -> None:
    driver.queries["test_lock"] = "SELECT pg_advisory_xact_lock(%(k)s) AS locked"
    driver.queries["test_held"] = (
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND objid = CAST(%(k)s AS bigint) AND pid = pg_backend_pid()"
    )
    with driver.transaction() as cx:
        cx.prelude("test_lock", {"k": 4242})
        assert cx.fetch("test_held", {"k": 4242}) == [{"n": 1}]


def test_a_prelude_with_nothing_after_it_still_runs_and_a_failing_one_rolls_back(
    driver: PostgresDriver,
) -> None:
    with driver.transaction() as cx:
        cx.prelude("test_note", {"name": "test-prelude"})
    assert _notes(driver) == ["test-prelude"]
    with pytest.raises(psycopg.errors.UniqueViolation), driver.transaction() as cx:
        cx.prelude("test_note", {"name": "test-prelude"})  # a duplicate key
        cx.execute("test_note", {"name": "test-never"})
    with pytest.raises(psycopg.errors.UniqueViolation), driver.transaction() as cx:
        cx.execute("test_note", {"name": "test-undone"})
        cx.prelude("test_note", {"name": "test-prelude"})  # fails at the commit
    assert _notes(driver) == ["test-prelude"]


def test_the_statement_after_a_lock_prelude_sees_what_the_lock_holder_committed(
    driver: PostgresDriver,
) -> None:
    """Why a claim's lock is a statement of its own: the read after it takes its
    snapshot once the lock is held, so it sees the previous holder's writes."""
    driver.queries["test_lock"] = "SELECT pg_advisory_xact_lock(%(k)s) AS locked"
    seen: list[list[str]] = []
    with psycopg.connect(driver.dsn) as holder:  # a transaction, not autocommit
        holder.execute("SELECT pg_advisory_xact_lock(4243)")
        holder.execute("INSERT INTO orbit_settings (name, int_value) VALUES ('test-held', 1)")

        def claim() -> None:
            with driver.transaction() as cx:
                cx.prelude("test_lock", {"k": 4243})
                seen.append(sorted(r["name"] for r in cx.fetch("test_notes", {})))

        waiter = threading.Thread(target=claim)
        waiter.start()
        with psycopg.connect(driver.dsn, autocommit=True) as watch:
            deadline = time.monotonic() + 10
            while not watch.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND objid = 4243"
            ).fetchall():
                assert time.monotonic() < deadline, "the claim never waited for the lock"
                time.sleep(0.01)
        holder.commit()
        waiter.join(10)
    assert seen == [["test-held"]]


def test_a_prelude_waits_out_a_statement_refused_before_it_was_sent(
    driver: PostgresDriver,
) -> None:
    """A NUL is refused before anything is sent; the prelude waiting with that statement
    is neither sent nor dropped, but goes with the next one."""
    with driver.transaction() as cx:
        cx.prelude("test_note", {"name": "test-kept-prelude"})
        with pytest.raises(psycopg.DataError):
            cx.fetch("test_echo", {"v": "a\x00b", "n": 1})
        assert cx.fetch("test_echo", {"v": "ok", "n": 1}) == [{"v": "ok", "n": 1}]
    assert _notes(driver) == ["test-kept-prelude"]


def _record_round_trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The driver's libpq calls from now on, recorded on their way to the real server:
    ``run`` (one statement), ``pipeline`` (several, one round trip; ``pipeline+COMMIT``
    with the COMMIT in it) or the command sent."""
    sent: list[str] = []
    raw: Any = _Raw
    for name in ("command", "run", "pipeline"):
        real = getattr(raw, name)

        def spy(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            if _name == "command":
                sent.append(args[0].decode())
            else:
                sent.append(f"{_name}+COMMIT" if kw.get("commit") else _name)
            return _real(self, *args, **kw)

        monkeypatch.setattr(raw, name, spy)
    return sent


def test_a_read_of_its_own_runs_without_begin_or_commit(
    store: Store, driver: PostgresDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Store``'s lone reads (a task, a queue list, a token) are one statement in
    autocommit: one round trip, no ``BEGIN`` or ``COMMIT`` (the driver's libpq calls,
    recorded on their way to the real server); an injected fault still fires."""
    sent = _record_round_trips(monkeypatch)
    queue(store, "q2")
    sent.clear()
    assert [q.name for q in store.queue_list()] == ["q2"]
    assert sent == ["run"]
    sent.clear()
    with driver.transaction() as cx:  # against a read inside a transaction
        cx.fetch("test_notes", {})
    assert sent == ["pipeline", "COMMIT"]
    with store.inject_fault("queue_list"), pytest.raises(InjectedFault):
        store.queue_list()


def test_a_large_batch_reads_its_rows_and_the_clock_in_one_round_trip(
    store: Store, driver: PostgresDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``LOCK_MANY_INLINE_MAX`` ids each read of a report batch is a statement of
    its own, and so is the clock: all of them go in one pipeline, after the BEGIN, and
    come back as the reads one by one would return them."""
    queue(store)
    submit(store)
    s, _ = worker(store)
    ids = [run_one(store, s).attempt.id] + [f"no-such-{i}" for i in range(LOCK_MANY_INLINE_MAX)]
    calls: list[tuple[str, dict[str, Any]]] = [
        ("task_lock_for_attempts", {"ids": ids}),
        ("attempt_lock_many", {"ids": ids}),
        ("session_share", {"id": s.id}),
    ]
    with driver.transaction() as cx:
        one_by_one = [cx.fetch(name, params) for name, params in calls]
    sent = _record_round_trips(monkeypatch)
    with driver.transaction() as cx:
        found, now = cx.lock_many(calls)
    assert sent == ["pipeline", "COMMIT"]
    assert found == one_by_one and [len(rows) for rows in found] == [1, 1, 1]
    assert isinstance(now, int) and now > 0


def test_a_renewal_reads_its_rows_and_the_clock_in_one_round_trip(
    store: Store, driver: PostgresDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal locks its tasks, its attempts and its session and reads the clock as a
    start or finish batch does, in one round trip with its BEGIN; then its writes go
    with the COMMIT, in a second."""
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    sent = _record_round_trips(monkeypatch)
    (lease,) = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
    assert lease.status == "ok"
    assert sent == ["pipeline", "pipeline+COMMIT"]
