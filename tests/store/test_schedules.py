"""Schedules in the store (``Store.schedule_*``), on SQLite and PostgreSQL: each fire
instant makes one task, in the transaction that advances the schedule; the misfire
policies after a downtime (the test clock jumps, nothing sleeps); two nodes firing at
once on PostgreSQL make one task per instant; every rejection writes nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pytest

from orbit.core.cron import to_us
from orbit.core.errors import Code, OrbitError
from orbit.core.model import Backoff, Schedule, TaskSpec
from orbit.store import Store, open_store
from orbit.store import rows as R
from orbit.store.store import fire_key
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import RACE_WAIT, queue

MINUTE = 60 * 1_000_000
#: 2027-01-15 08:00:30 UTC: half a minute past a minute
START = to_us(datetime(2027, 1, 15, 8, 0, 30, tzinfo=UTC))


@pytest.fixture
def sched_clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def st(make_store: Any, sched_clock: ManualClock) -> Store:
    s: Store = make_store(clock=sched_clock)
    queue(s)
    return s


def _make(store: Store, name: str = "every-minute", **kw: Any) -> Any:
    args: dict[str, Any] = {
        "cron": "* * * * *",
        "timezone": "UTC",
        "template": TaskSpec(queue="q", handler="h", payload={"n": 1}),
    }
    args.update(kw)
    return store.schedule_create(name, **args)


def _tasks(store: Store) -> list[Any]:
    """The tasks schedules made (their idempotency keys say so)."""
    every = store.task_list(queue="q", limit=1000)
    return [t for t in every if (t.idempotency_key or "").startswith("schedule:")]


def _keys(store: Store) -> list[str]:
    return sorted(str(t.idempotency_key) for t in _tasks(store))


def _instants(store: Store) -> list[int]:
    return sorted(int(str(t.idempotency_key).rsplit(":", 1)[1]) for t in _tasks(store))


def _fire_all(store: Store) -> int:
    """Passes of the duty until one makes nothing and leaves nothing due."""
    made = 0
    for _ in range(5000):
        n = store.schedule_fire_due()
        made += n
        due = store.schedule_due_in()
        if n == 0 and (due is None or due > 0):
            return made
    raise AssertionError("the duty never settled")


def _together(*calls: Callable[[], object]) -> list[BaseException]:
    """Run each call on a thread of its own, all released at once; what they raised."""
    barrier = threading.Barrier(len(calls))
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            barrier.wait(RACE_WAIT)
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RACE_WAIT * 4)
    return errors


def _kinds(store: Store, prefix: str = "schedule.") -> list[str]:
    return [e["kind"] for e in store.event_list() if e["kind"].startswith(prefix)]


def test_create_get_list_and_the_first_fire_instant(st: Store) -> None:
    s = _make(st, timezone="Europe/Berlin", cron="0 9 * * *")
    # 08:00:30 UTC is 09:00:30 in Berlin: the first fire is tomorrow's 09:00 (08:00 UTC).
    assert s.next_fire_at == to_us(datetime(2027, 1, 16, 8, 0, tzinfo=UTC))
    assert (s.paused, s.misfire, s.max_catch_up, s.last_fire_at) == (False, "skip", 10, None)
    assert st.schedule_get(s.name) == s
    _make(st, "a", cron="*/5 * * * *")
    _make(st, "z")
    assert [x.name for x in st.schedule_list()] == ["a", "every-minute", "z"]
    assert [x.name for x in st.schedule_list(after_name="a", limit=1)] == ["every-minute"]
    assert _kinds(st) == ["schedule.created"] * 3
    assert check_all(st) == []


def test_each_instant_fires_once_with_the_template(st: Store, sched_clock: ManualClock) -> None:
    template = TaskSpec(
        queue="q",
        handler="h",
        payload={"n": 1},
        tenant="t1",
        priority=5,
        retry_safe=True,
        max_attempts=7,
        backoff=Backoff(2_000_000, 3.0, 60_000_000),
        attempt_timeout_us=30_000_000,
    )
    s = _make(st, template=template)
    assert st.schedule_fire_due() == 0  # not due yet
    sched_clock.advance(30)  # 08:01:00: due
    assert st.schedule_fire_due() == 1
    assert st.schedule_fire_due() == 0  # the same instant again: nothing
    [task] = _tasks(st)
    assert task.idempotency_key == fire_key(s, s.next_fire_at)
    assert json.loads(task.payload) == {"n": 1}
    assert (task.tenant, task.priority, task.retry_safe, task.max_attempts) == ("t1", 5, True, 7)
    assert task.backoff == Backoff(2_000_000, 3.0, 60_000_000)
    assert task.attempt_timeout_us == 30_000_000
    after = st.schedule_get(s.name)
    assert (after.last_fire_at, after.next_fire_at) == (s.next_fire_at, s.next_fire_at + MINUTE)
    sched_clock.advance(60)
    assert st.schedule_fire_due() == 1
    assert _instants(st) == [s.next_fire_at, s.next_fire_at + MINUTE]
    fired = [e for e in st.event_list() if e["kind"] == "schedule.fired"]
    assert [json.loads(e["data"])["instant"] for e in fired] == _instants(st)
    assert check_all(st) == []


def test_a_retried_fire_finds_its_task(st: Store, sched_clock: ManualClock) -> None:
    """The second guard: a fire whose row check passes (as if the first commit's reply
    was lost and the row were read before it) finds the task by its key."""
    s = _make(st)
    sched_clock.advance(30)
    assert st.schedule_fire(s, sched_clock.now) == 1
    assert st.schedule_fire(s, sched_clock.now) == 0  # the row moved on: nothing
    assert len(_tasks(st)) == 1


@pytest.mark.parametrize(
    ("policy", "expect"),
    [
        ("skip", []),
        ("run_once", [9]),  # the latest missed instant, once
        ("catch_up", [7, 8, 9]),  # the latest max_catch_up (3) missed, oldest first
    ],
)
def test_misfire_policies_after_a_downtime(
    st: Store, sched_clock: ManualClock, policy: str, expect: list[int]
) -> None:
    s = _make(st, misfire=policy, max_catch_up=3)
    first = s.next_fire_at  # 08:01
    # Down for ten minutes: 08:01 ... 08:10 passed unseen; now 08:10:30 + 61 s (08:11:31).
    sched_clock.now = first + 10 * MINUTE + 31_000_000
    _fire_all(st)
    # 08:11 is on time (31 s old): it fires whatever the policy.
    assert _instants(st) == [first + m * MINUTE for m in expect] + [first + 10 * MINUTE]
    after = st.schedule_get(s.name)
    assert after.next_fire_at == first + 11 * MINUTE
    if policy == "skip":
        assert _kinds(st)[-1] == "schedule.fired"
    assert check_all(st) == []


def test_skip_with_nothing_on_time_only_moves_on(st: Store, sched_clock: ManualClock) -> None:
    s = _make(st, cron="0 * * * *")  # hourly: 09:00
    sched_clock.now = s.next_fire_at + 5 * 3600 * 1_000_000 + 10 * MINUTE  # 14:10
    assert _fire_all(st) == 0
    assert st.schedule_get(s.name).next_fire_at == s.next_fire_at + 6 * 3600 * 1_000_000
    assert _kinds(st) == ["schedule.created", "schedule.skipped"]
    assert _tasks(st) == []


def test_catch_up_is_bounded(st: Store, sched_clock: ManualClock) -> None:
    s = _make(st, misfire="catch_up", max_catch_up=5)
    # 1,001 instants missed, and the 1,002nd is 30 s old (on time).
    sched_clock.now = s.next_fire_at + 1001 * MINUTE + 30_000_000
    assert _fire_all(st) == 5 + 1
    assert _instants(st) == [s.next_fire_at + m * MINUTE for m in range(996, 1002)]


def test_a_full_queue_leaves_the_fire_due_and_it_is_retried(
    st: Store, sched_clock: ManualClock
) -> None:
    st.queue_update("q", max_queued=1)
    st.task_submit(TaskSpec(queue="q", handler="h"))  # the queue is full
    s = _make(st, misfire="run_once")
    sched_clock.advance(30)
    before = (st.schedule_get(s.name), len(st.event_list()))
    assert st.schedule_fire_due() == 0
    assert (st.schedule_get(s.name), len(st.event_list())) == before  # nothing written
    st.queue_update("q", max_queued=2)  # room again, a pass later
    sched_clock.advance(1)
    assert st.schedule_fire_due() == 1
    assert _instants(st) == [s.next_fire_at]


def test_pause_resume_and_delete(st: Store, sched_clock: ManualClock) -> None:
    s = _make(st, misfire="catch_up")
    assert st.schedule_pause(s.name).paused
    assert st.schedule_pause(s.name).paused  # again: a no-op
    sched_clock.advance(600)  # ten instants pass while paused
    assert _fire_all(st) == 0
    resumed = st.schedule_resume(s.name)
    # The paused instants are not misfires: the next fire is the first after now.
    assert not resumed.paused and resumed.next_fire_at == s.next_fire_at + 10 * MINUTE
    sched_clock.advance(30)
    assert _fire_all(st) == 1
    gone = st.schedule_delete(s.name)
    assert gone.name == s.name
    with pytest.raises(OrbitError) as err:
        st.schedule_get(s.name)
    assert err.value.code == Code.SCHEDULE_NOT_FOUND
    sched_clock.advance(60)
    assert _fire_all(st) == 0
    assert len(_tasks(st)) == 1  # the task it made stays
    assert _kinds(st) == [
        "schedule.created",
        "schedule.paused",
        "schedule.resumed",
        "schedule.fired",
        "schedule.deleted",
    ]
    # Made again under the same name: a new schedule, whose keys are its own.
    again = _make(st, s.name)
    sched_clock.now = again.next_fire_at
    assert _fire_all(st) == 1
    assert len(set(_keys(st))) == 2


def test_a_missing_schedule_is_404_for_every_operation(st: Store) -> None:
    for op in (st.schedule_get, st.schedule_pause, st.schedule_resume, st.schedule_delete):
        with pytest.raises(OrbitError) as err:
            op("nope")
        assert err.value.code == Code.SCHEDULE_NOT_FOUND


BAD: list[tuple[dict[str, Any], Code, str]] = [
    ({"cron": "* * * *"}, Code.INVALID_CRON, "cron"),
    ({"cron": "* * * * * *"}, Code.INVALID_CRON, "cron"),
    ({"cron": "61 * * * *"}, Code.INVALID_CRON, "cron"),
    ({"cron": "@daily"}, Code.INVALID_CRON, "cron"),
    ({"cron": "0 0 30 2 *"}, Code.INVALID_CRON, "cron"),  # 30 February: never
    ({"cron": ""}, Code.INVALID_CRON, "cron"),
    # croniter's extensions, which classic cron does not have
    ({"cron": "0 0 L * *"}, Code.INVALID_CRON, "cron"),
    ({"cron": "0 0 * * 5#2"}, Code.INVALID_CRON, "cron"),
    ({"cron": "R * * * *"}, Code.INVALID_CRON, "cron"),
    ({"cron": "0 22-2 * * *"}, Code.INVALID_CRON, "cron"),  # a range that wraps
    ({"timezone": "Mars/Olympus"}, Code.INVALID_TIMEZONE, "timezone"),
    ({"timezone": "../etc/passwd"}, Code.INVALID_TIMEZONE, "timezone"),
    ({"timezone": ""}, Code.INVALID_TIMEZONE, "timezone"),
    ({"timezone": "America/Argentina"}, Code.INVALID_TIMEZONE, "timezone"),  # a directory
    ({"timezone": "localtime"}, Code.INVALID_TIMEZONE, "timezone"),  # each node's own
    ({"misfire": "later"}, Code.INVALID_ARGUMENT, "misfire"),
    ({"misfire": "catch_up", "max_catch_up": 0}, Code.INVALID_ARGUMENT, "max_catch_up"),
    ({"max_catch_up": 1001}, Code.INVALID_ARGUMENT, "max_catch_up"),
    ({"max_catch_up": True}, Code.INVALID_ARGUMENT, "max_catch_up"),
    ({"template": TaskSpec(queue="q", handler="bad name")}, Code.INVALID_ARGUMENT, "template"),
    (
        {"template": TaskSpec(queue="q", handler="h", max_attempts=0)},
        Code.INVALID_ARGUMENT,
        "template",
    ),
    (
        {"template": TaskSpec(queue="q", handler="h", idempotency_key="k")},
        Code.INVALID_ARGUMENT,
        "template.idempotency_key",
    ),
    (
        {"template": TaskSpec(queue="q", handler="h", run_after=1)},
        Code.INVALID_ARGUMENT,
        "template.run_after",
    ),
    (
        {"template": TaskSpec(queue="q", handler="h", deadline=1)},
        Code.INVALID_ARGUMENT,
        "template.deadline",
    ),
    (
        {"template": TaskSpec(queue="q", handler="h", parent_id="x")},
        Code.INVALID_ARGUMENT,
        "template.parent_id",
    ),
    (
        {"template": TaskSpec(queue="nope", handler="h")},
        Code.QUEUE_NOT_FOUND,
        "template.queue",
    ),
]


@pytest.mark.parametrize(("change", "code", "field"), BAD)
def test_every_rejection_writes_nothing(
    st: Store, change: dict[str, Any], code: Code, field: str
) -> None:
    before = len(st.event_list())
    with pytest.raises(OrbitError) as err:
        _make(st, **change)
    assert (err.value.code, err.value.field) == (code, field), err.value
    assert st.schedule_list() == [] and len(st.event_list()) == before


def test_a_bad_name_and_a_taken_name(st: Store) -> None:
    with pytest.raises(OrbitError) as err:
        _make(st, "bad name")
    assert err.value.code == Code.INVALID_ARGUMENT
    first = _make(st)
    before = len(st.event_list())
    with pytest.raises(OrbitError) as err:
        _make(st, cron="0 * * * *")
    assert (err.value.code, err.value.field) == (Code.SCHEDULE_EXISTS, "name")
    assert st.schedule_list() == [first] and len(st.event_list()) == before


def test_two_nodes_fire_each_instant_once(
    backend: str, st: Store, sched_clock: ManualClock
) -> None:
    """Two stores on one PostgreSQL database (two nodes) run their duty at once, over
    and over, through a downtime's catch_up: each instant makes exactly one task."""
    if backend != "postgres":
        pytest.skip("one SQLite database has one server")
    other = open_store(store_url(st), clock=sched_clock)
    try:
        for i in range(5):
            _make(st, f"s{i}", misfire="catch_up", max_catch_up=20)
        sched_clock.now = START + 20 * MINUTE  # 20 instants due for each
        assert _together(lambda: _fire_all(st), lambda: _fire_all(other)) == []
        keys = _keys(st)
        assert len(keys) == len(set(keys)) == 5 * 20
        fired = [e for e in st.event_list(limit=1000) if e["kind"] == "schedule.fired"]
        assert len(fired) == 100
        assert check_all(st) == []
    finally:
        other.close()


def test_the_fired_event_names_the_task_it_made(st: Store, sched_clock: ManualClock) -> None:
    """A reader of the event log follows a fire to its task: ``schedule.fired`` carries
    the task's id (``task_id`` and ``data.task_id``), not only its idempotency key."""
    s = _make(st)
    sched_clock.advance(30)
    assert st.schedule_fire_due() == 1
    [task] = _tasks(st)
    [fired] = [e for e in st.event_list() if e["kind"] == "schedule.fired"]
    data = json.loads(fired["data"])
    assert data["task_id"] == task.id
    assert fired["task_id"] == task.id
    assert data["idempotency_key"] == fire_key(s, s.next_fire_at)
    assert check_all(st) == []


# ----------------------------------------------------------------------------- update


def test_update_changes_only_what_is_given(st: Store, sched_clock: ManualClock) -> None:
    s = _make(st, misfire="catch_up", max_catch_up=3)
    new_template = TaskSpec(queue="q", handler="h2", payload={"n": 2}, priority=9)
    u = st.schedule_update(s.name, template=new_template, max_catch_up=7)
    assert (u.template.handler, u.template.payload, u.template.priority) == ("h2", {"n": 2}, 9)
    assert (u.max_catch_up, u.misfire, u.cron, u.timezone) == (7, "catch_up", s.cron, s.timezone)
    # Neither cron nor zone changed: the next instant stays, and fires the new template.
    assert u.next_fire_at == s.next_fire_at and u.version == s.version + 1
    sched_clock.advance(30)
    assert st.schedule_fire_due() == 1
    [task] = _tasks(st)
    assert (task.handler, json.loads(task.payload), task.priority) == ("h2", {"n": 2}, 9)
    [ev] = [e for e in st.event_list() if e["kind"] == "schedule.updated"]
    data = json.loads(ev["data"])
    assert data["changed"] == ["template", "max_catch_up"]
    assert data["next_fire_at"] == s.next_fire_at
    assert check_all(st) == []


def test_update_of_cron_or_zone_recomputes_the_next_instant_from_now(
    st: Store, sched_clock: ManualClock
) -> None:
    s = _make(st)  # every minute; next 08:01
    u = st.schedule_update(s.name, cron="0 9 * * *")
    assert u.next_fire_at == to_us(datetime(2027, 1, 15, 9, 0, tzinfo=UTC))
    u = st.schedule_update(s.name, timezone="Europe/Berlin")  # 09:00 Berlin is 08:00 UTC
    assert u.next_fire_at == to_us(datetime(2027, 1, 16, 8, 0, tzinfo=UTC))
    # The same cron again is no change: the instant stays.
    assert st.schedule_update(s.name, cron="0 9 * * *").next_fire_at == u.next_fire_at
    assert _kinds(st) == ["schedule.created"] + ["schedule.updated"] * 3


def test_update_of_cron_while_an_instant_is_due_drops_it_and_fires_nothing_twice(
    st: Store, sched_clock: ManualClock
) -> None:
    s = _make(st)
    sched_clock.advance(30)  # 08:01 due
    assert st.schedule_fire_due() == 1
    sched_clock.advance(60)  # 08:02 due, not yet fired
    u = st.schedule_update(s.name, cron="*/2 * * * *")
    # From now (08:02:00): the first */2 instant after it is 08:04; 08:02 is dropped.
    assert u.next_fire_at == s.next_fire_at + 3 * MINUTE
    assert _fire_all(st) == 0
    sched_clock.now = u.next_fire_at
    assert _fire_all(st) == 1
    assert _instants(st) == [s.next_fire_at, s.next_fire_at + 3 * MINUTE]


def test_an_update_racing_a_fire_neither_doubles_nor_loses_the_instant(
    st: Store, sched_clock: ManualClock
) -> None:
    """The duty read the row, then an update committed before the fire's transaction:
    the fire finds the row moved on and makes nothing; the next pass reads the new row
    and fires the instant once, with the new template. And a fire that committed first
    leaves the update to a row already moved on: no second task for that instant."""
    s = _make(st)
    sched_clock.advance(30)
    read = st.schedule_get(s.name)  # as the duty read it
    st.schedule_update(s.name, template=TaskSpec(queue="q", handler="h", payload={"n": 2}))
    assert st.schedule_fire(read, sched_clock.now) == 0  # stale: nothing
    assert st.schedule_fire_due() == 1
    assert st.schedule_fire_due() == 0
    [task] = _tasks(st)
    assert json.loads(task.payload) == {"n": 2}
    # Fire first, then an update of the template: the fired instant does not come back.
    sched_clock.advance(60)
    assert st.schedule_fire_due() == 1
    st.schedule_update(s.name, template=TaskSpec(queue="q", handler="h", payload={"n": 3}))
    assert st.schedule_fire(read, sched_clock.now) == 0
    assert _fire_all(st) == 0
    assert _instants(st) == [s.next_fire_at, s.next_fire_at + MINUTE]
    assert check_all(st) == []


BAD_UPDATES = [(c, code, f) for c, code, f in BAD if set(c) != {"misfire", "max_catch_up"}]


@pytest.mark.parametrize(("change", "code", "field"), BAD_UPDATES)
def test_every_update_rejection_writes_nothing(
    st: Store, change: dict[str, Any], code: Code, field: str
) -> None:
    s = _make(st)
    before = len(st.event_list())
    with pytest.raises(OrbitError) as err:
        st.schedule_update(s.name, **change)
    assert (err.value.code, err.value.field) == (code, field), err.value
    assert st.schedule_list() == [s] and len(st.event_list()) == before


def test_update_refuses_nothing_to_change_and_a_missing_schedule(st: Store) -> None:
    s = _make(st)
    with pytest.raises(OrbitError) as err:
        st.schedule_update(s.name)
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "at least one" in err.value.message
    with pytest.raises(OrbitError) as err:
        st.schedule_update("nope", cron="0 * * * *")
    assert err.value.code == Code.SCHEDULE_NOT_FOUND
    assert st.schedule_list() == [s] and _kinds(st) == ["schedule.created"]


def test_two_nodes_updating_while_firing_fire_each_instant_once(
    backend: str, st: Store, sched_clock: ManualClock
) -> None:
    """Two PostgreSQL nodes fire a catch_up backlog while a third thread updates the
    template over and over (the cron stays): each instant makes exactly one task."""
    if backend != "postgres":
        pytest.skip("one SQLite database has one server")
    other = open_store(store_url(st), clock=sched_clock)
    try:
        s = _make(st, misfire="catch_up", max_catch_up=30)
        sched_clock.now = START + 30 * MINUTE  # 30 instants due

        def edits() -> None:
            for n in range(20):
                spec = TaskSpec(queue="q", handler="h", payload={"n": n})
                other.schedule_update(s.name, template=spec)

        assert _together(lambda: _fire_all(st), lambda: _fire_all(other), edits) == []
        _fire_all(st)  # what a pass left to the next, once the edits stopped
        keys = _keys(st)
        assert len(keys) == len(set(keys)) == 30
        assert check_all(st) == []
    finally:
        other.close()


def test_a_stale_fire_does_not_fire_into_a_schedule_made_again_under_its_name(
    st: Store, sched_clock: ManualClock
) -> None:
    """The duty read a schedule due for its first fire (version 1); before its fire's
    transaction, the schedule is deleted and made again under its name (version 1 too)
    with another template, and comes due. The stale fire must not pass the row check:
    it would submit the deleted schedule's template under its key and move the new
    schedule's next instant by the old expression."""
    s = _make(st)
    sched_clock.advance(30)  # 08:01 due
    read = st.schedule_get(s.name)  # as the duty read it
    st.schedule_delete(s.name)
    again = _make(st, template=TaskSpec(queue="q", handler="h", payload={"n": 2}))
    assert again.version == read.version
    sched_clock.now = again.next_fire_at  # the new one's first instant (08:02)
    assert st.schedule_fire(read, sched_clock.now) == 0
    assert st.schedule_get(s.name) == again
    assert _tasks(st) == []
    assert _fire_all(st) == 1
    [task] = _tasks(st)
    assert task.idempotency_key == fire_key(again, again.next_fire_at)
    assert json.loads(task.payload) == {"n": 2}


def test_schedules_a_full_queue_refuses_do_not_starve_the_others(
    st: Store, sched_clock: ManualClock
) -> None:
    """A pass reads the due schedules a page at a time, oldest first. Schedules whose
    fires a full queue refuses stay due (run_once keeps them) and oldest: were the pass
    to read one page only, a page of them would hide every other due schedule for as
    long as the queue stays full, and those instants would then be missed."""
    queue(st, "full")
    st.queue_update("full", max_queued=1)
    st.task_submit(TaskSpec(queue="full", handler="h"))
    full = TaskSpec(queue="full", handler="h")
    for name in ("a", "b", "c"):
        _make(st, name, misfire="run_once", template=full)
    other = _make(st, "z")
    sched_clock.advance(30)  # all four due at 08:01
    assert st.schedule_fire_due(limit=2) == 1
    assert _instants(st) == [other.next_fire_at]
    assert all(st.schedule_get(n).last_fire_at is None for n in ("a", "b", "c"))


def test_the_expression_is_stored_with_its_fields_one_space_apart(st: Store) -> None:
    s = _make(st, cron="  */5   *\t* * MON-fri ")
    assert s.cron == st.schedule_get(s.name).cron == "*/5 * * * MON-fri"
    assert st.schedule_update(s.name, cron=" 0  3 * * * ").cron == "0 3 * * *"


def _store_as_an_older_orbit(
    st: Store, s: Schedule, cron: str, next_fire_at: int, timezone: str | None = None
) -> None:
    """Write ``cron`` (and its ``next_fire_at``, and a ``timezone`` if given) into
    ``s``'s row unchecked, as an Orbit that took croniter's extensions, or zones refused
    since, did (the store's own update query, past its checks)."""
    payload = json.dumps(s.template.payload)
    with st.driver.transaction() as cx:
        cx.execute(
            "schedule_update",
            {
                "name": s.name,
                "version": s.version,
                "cron": cron,
                "timezone": timezone or s.timezone,
                "template": R.template_json(s.template, payload),
                "misfire": s.misfire,
                "max_catch_up": s.max_catch_up,
                "next_fire_at": next_fire_at,
                "now": s.updated_at,
            },
        )


def test_a_schedule_stored_with_an_extension_still_fires_and_updates(
    st: Store, sched_clock: ManualClock
) -> None:
    """The strict check is on what is written now: a row an older Orbit stored with
    croniter's ``L`` (the last day of the month) loads, fires, and takes an update that
    leaves its expression alone; an update that gives the text again is refused."""
    s = _make(st, "monthly", cron="0 0 1 * *")
    last_of_january = to_us(datetime(2027, 1, 31, tzinfo=UTC))
    _store_as_an_older_orbit(st, s, "0 0 L * *", last_of_january)
    s = st.schedule_get("monthly")
    assert s.cron == "0 0 L * *"
    s = st.schedule_update("monthly", template=TaskSpec(queue="q", handler="h2"))
    assert s.cron == "0 0 L * *" and s.template.handler == "h2"
    s = st.schedule_update("monthly", misfire="run_once")
    with pytest.raises(OrbitError) as err:
        st.schedule_update("monthly", cron="0 0 L * *")
    assert (err.value.code, err.value.field) == (Code.INVALID_CRON, "cron")
    assert st.schedule_get("monthly") == s
    sched_clock.now = last_of_january + 30 * 1_000_000
    assert _fire_all(st) == 1
    assert _instants(st) == [last_of_january]
    assert st.schedule_get("monthly").next_fire_at == to_us(datetime(2027, 2, 28, tzinfo=UTC))


@pytest.mark.parametrize("zone", ["localtime", "posixrules", "posix/UTC", "right/UTC"])
def test_a_schedule_stored_with_a_zone_taken_before_still_fires_resumes_and_updates(
    st: Store, sched_clock: ManualClock, zone: str
) -> None:
    """As with cron text: a zone an older Orbit took and ``check_timezone`` now refuses
    (each node's own ``localtime``, leap-second ``right/``) loads, fires, resumes, and
    takes an update that leaves it alone; an update that gives it again is refused.
    Only a zone this node's database has (the ``tzdata`` package has none of these)."""
    try:
        ZoneInfo(zone)
    except ZoneInfoNotFoundError:
        pytest.skip(f"this host's zone database has no {zone}")
    s = _make(st, "legacy")
    _store_as_an_older_orbit(st, s, s.cron, s.next_fire_at, timezone=zone)
    sched_clock.now = s.next_fire_at + 30 * 1_000_000  # due, on time
    assert st.schedule_fire_due() == 1
    assert st.schedule_get("legacy").last_fire_at == s.next_fire_at
    st.schedule_pause("legacy")
    resumed = st.schedule_resume("legacy")
    assert (resumed.timezone, resumed.paused) == (zone, False)
    s = st.schedule_update("legacy", misfire="run_once")
    s = st.schedule_update("legacy", cron="0 3 * * *")  # a new cron, the zone kept
    assert s.timezone == zone
    with pytest.raises(OrbitError) as err:
        st.schedule_update("legacy", timezone=zone)
    assert (err.value.code, err.value.field) == (Code.INVALID_TIMEZONE, "timezone")
    assert st.schedule_get("legacy") == s
    assert st.schedule_update("legacy", timezone="UTC").timezone == "UTC"


#: New York, 2026-11-01: clocks go back from 02:00 EDT (06:00 UTC) to 01:00 EST.
FALL_BACK_UTC = to_us(datetime(2026, 11, 1, 6, tzinfo=UTC))


def test_a_fall_back_night_fires_wildcards_at_both_passes_and_fixed_times_once(
    make_store: Any,
) -> None:
    """Vixie cron's rule: ``*/15 * * * *`` fires every real quarter hour through the
    repeated hour (its local times twice, each instant its own key: one task each);
    ``30 1 * * *``, a job at a particular time, once. The duty runs every 5 minutes of
    the test clock from 00:30 EDT to 02:30 EST."""
    clock = ManualClock(FALL_BACK_UTC - 90 * MINUTE)
    st: Store = make_store(clock=clock)
    queue(st)
    _make(st, "quarterly", cron="*/15 * * * *", timezone="America/New_York")
    _make(st, "fixed", cron="30 1 * * *", timezone="America/New_York")
    while clock.now < FALL_BACK_UTC + 90 * MINUTE:
        clock.advance(5 * 60)
        _fire_all(st)
    # 00:45 EDT, four in each pass of 01:xx, then 02:00, 02:15 and 02:30 EST
    quarters = [FALL_BACK_UTC + m * 15 * MINUTE for m in range(-5, 7)]
    assert _instants(st) == sorted([*quarters, FALL_BACK_UTC - 30 * MINUTE])
    keys = _keys(st)
    assert len(keys) == len(set(keys)) == len(quarters) + 1
    by_name = [k.split(":")[1] for k in keys]
    assert by_name.count("quarterly") == 12 and by_name.count("fixed") == 1
    assert check_all(st) == []


def _failing_fire(st: Store, name: str, fail: Callable[[], None]) -> None:
    """Make ``st``'s fire of the schedule ``name`` call ``fail`` first (the unit under
    test is the duty's pass; its collaborator, one schedule's fire, is made to fail)."""
    fire = st.schedule_fire

    def patched(s: Schedule, now: int) -> int:
        if s.name == name:
            fail()
        return fire(s, now)

    st.schedule_fire = patched  # type: ignore[method-assign]


def test_a_fire_that_fails_unexpectedly_does_not_stop_the_pass(
    st: Store, sched_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A fire that raises what is no OrbitError (a bug; a row this Orbit cannot read)
    is logged with its traceback and passed by: the schedules after it still fire in
    the same pass. It stays due (oldest, so first in every page) and is tried again."""
    secret = TaskSpec(queue="q", handler="h", payload={"token": "s3cr3t-payload"})
    _make(st, "a-broken", template=secret)
    other = _make(st, "z-fine")

    def bug() -> None:
        raise ZeroDivisionError("a bug in one schedule's fire")

    _failing_fire(st, "a-broken", bug)
    sched_clock.advance(30)  # both due at 08:01
    with caplog.at_level("ERROR", logger="orbit.store"):
        assert st.schedule_fire_due(limit=1) == 1
    assert _instants(st) == [other.next_fire_at]
    assert st.schedule_get("a-broken").last_fire_at is None
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "a-broken" in record.getMessage() and record.exc_info is not None
    assert "s3cr3t" not in caplog.text
    assert check_all(st) == []


def test_a_database_failure_ends_the_pass(
    st: Store, sched_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The database going away is no one schedule's fault: the pass ends with it (the
    duty logs it once) rather than logging it for each schedule left."""
    _make(st, "a-first")
    _make(st, "z-second")
    _failing_fire(st, "a-first", st.driver.close)  # every later query fails for real
    sched_clock.advance(30)
    with caplog.at_level("WARNING", logger="orbit.store"), pytest.raises(Exception) as err:
        st.schedule_fire_due()
    assert st.driver.is_unavailable(err.value), repr(err.value)
    assert [r for r in caplog.records if "did not fire" in r.getMessage()] == []
