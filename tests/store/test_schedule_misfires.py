"""Misfires under load and their trace, on SQLite and PostgreSQL (``Store.schedule_*``).

A long catch-up keeps the duty busy for many minutes of its clock: the instants of
other schedules that come due meanwhile are on time (the duty could not have fired
them sooner) and fire, rather than wait behind the backlog and be judged missed. And
every missed instant a policy drops is written down (``schedule.skipped``) in the
transaction of the fire or advance that drops it. The clock is the test's: it moves on
by a fixed step each time the store reads it, as time passes while the duty works."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import pytest

from orbit.core import cron
from orbit.core.model import TaskSpec
from orbit.core.validate import MISFIRE_GRACE_US
from orbit.store import Store, open_store
from orbit.store import store as store_module
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import queue
from tests.store.test_schedules import MINUTE, START, _fire_all, _instants, _make, _together

HOUR = 60 * MINUTE


class TickingClock(ManualClock):
    """A test clock that moves on by ``step`` microseconds at every read (while
    ``ticking``): each transaction of the duty costs it time, as a real one does."""

    def __init__(self, now: int, step: int) -> None:
        super().__init__(now)
        self.step = step
        self.ticking = False

    def __call__(self) -> int:
        if self.ticking:
            self.now += self.step
        return self.now


@pytest.fixture
def sched_clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def st(make_store: Any, sched_clock: ManualClock) -> Store:
    s: Store = make_store(clock=sched_clock)
    queue(s)
    return s


def _fired(store: Store, name: str) -> list[int]:
    """The instants of ``name``'s tasks, oldest first."""
    every = store.task_list(queue="q", limit=1000)
    keys = [str(t.idempotency_key) for t in every if t.idempotency_key]
    return sorted(int(k.rsplit(":", 1)[1]) for k in keys if k.split(":")[1] == name)


def _skipped(store: Store, name: str) -> list[dict[str, Any]]:
    found = [e for e in store.event_list(limit=100_000) if e["kind"] == "schedule.skipped"]
    data = [json.loads(e["data"]) for e in found]
    return [d for d in data if d["schedule"] == name]


def _consecutive(instants: list[int]) -> bool:
    return all(b - a == MINUTE for a, b in pairwise(instants))


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_long_catch_up_does_not_drop_the_instants_that_come_due_meanwhile(
    backend: str, make_store: Any, nodes: int
) -> None:
    """Four catch_up schedules four hours behind (max_catch_up 50: 200 fires) and one
    plain minutely ``skip`` schedule. Each read of the clock costs a second, so the
    catch-up takes many minutes of it: every minutely instant of that time fires, none
    is dropped, and the catch-up fires its latest 50 missed instants, then every
    instant that came due while it ran. Two nodes (PostgreSQL) share the work alike."""
    if nodes == 2 and backend != "postgres":
        pytest.skip("one SQLite database has one server")
    clock = TickingClock(START - 4 * HOUR, 1_000_000)
    st: Store = make_store(clock=clock)
    queue(st)
    big = [f"big{i}" for i in range(4)]
    for name in big:
        _make(st, name, misfire="catch_up", max_catch_up=50)  # next fire 04:01
    clock.now = START
    minutely = _make(st, "minutely")  # next fire 08:01
    end = START + 30 * MINUTE
    others = [open_store(store_url(st), clock=clock) for _ in range(nodes - 1)]
    try:

        def duty(store: Store) -> None:
            while clock.now < end:
                store.schedule_fire_due(limit=2)  # pages of 2: a pass reads page after page

        clock.ticking = True
        assert _together(*[lambda s=s: duty(s) for s in [st, *others]]) == []
        clock.ticking = False
        _fire_all(st)
    finally:
        for other in others:
            other.close()
    # Every minutely instant from its first to the last due, each once, none skipped.
    fired = _fired(st, "minutely")
    assert fired[0] == minutely.next_fire_at and fired[-1] > end - 2 * MINUTE
    assert _consecutive(fired)
    assert _skipped(st, "minutely") == []
    for name in big:
        done = _fired(st, name)
        # The latest 50 missed at the start (before 07:59:3x), then every later one.
        assert len([i for i in done if i < START - MISFIRE_GRACE_US]) == 50
        assert _consecutive(done) and done[-1] > end - 2 * MINUTE
        [skipped] = _skipped(st, name)
        assert skipped["missed_from"] == START - 4 * HOUR + 30_000_000  # 04:01
        assert skipped["missed_to"] == done[0] - MINUTE
        assert skipped["missed"] == (done[0] - skipped["missed_from"]) // MINUTE
    assert check_all(st) == []


def test_a_catch_up_looks_back_over_its_bound_once(
    st: Store, sched_clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which instants a catch-up keeps is decided once, at its first fire: the fires
    after it walk on from the instant before, where each looked back over
    ``max_catch_up`` instants again, a cost that grew with the bound's square."""
    looks: list[int] = []
    real = cron.latest

    def counting(expr: str, zone: Any, at_us: int, since_us: int, n: int) -> list[int]:
        looks.append(n)
        return real(expr, zone, at_us, since_us, n)

    monkeypatch.setattr(store_module, "latest", counting)
    s = _make(st, misfire="catch_up", max_catch_up=200)
    sched_clock.now = s.next_fire_at + 300 * MINUTE + 30_000_000  # 300 missed, 1 on time
    assert _fire_all(st) == 200 + 1
    assert _instants(st) == [s.next_fire_at + m * MINUTE for m in range(100, 301)]
    assert len([n for n in looks if n > 200]) == 2  # the kept ones, and the dropped count


@pytest.mark.parametrize(
    ("policy", "fired", "dropped"),
    [
        ("skip", [10], (0, 9)),
        ("run_once", [9, 10], (0, 8)),
        ("catch_up", [7, 8, 9, 10], (0, 6)),  # max_catch_up 3
    ],
)
def test_every_dropped_instant_is_written_down_with_the_fire(
    st: Store, sched_clock: ManualClock, policy: str, fired: list[int], dropped: tuple[int, int]
) -> None:
    """Down ten minutes (08:01 ... 08:10 missed), up again at 08:11:31: 08:11 fires on
    time under every policy; the missed instants the policy does not keep are named in a
    ``schedule.skipped`` event (first, last, how many) of the transaction that fired the
    first instant after the outage (its ``xid``), where ``skip`` left no trace at all."""
    s = _make(st, misfire=policy, max_catch_up=3)
    first = s.next_fire_at
    sched_clock.now = first + 10 * MINUTE + 31_000_000
    _fire_all(st)
    assert _instants(st) == [first + m * MINUTE for m in fired]
    events = st.event_list()
    [skipped] = [e for e in events if e["kind"] == "schedule.skipped"]
    assert json.loads(skipped["data"]) == {
        "schedule": s.name,
        "missed_from": first + dropped[0] * MINUTE,
        "missed_to": first + dropped[1] * MINUTE,
        "missed": dropped[1] - dropped[0] + 1,
        "next_fire_at": first + fired[1] * MINUTE if len(fired) > 1 else first + 11 * MINUTE,
    }
    fire = next(e for e in events if e["kind"] == "schedule.fired")
    assert json.loads(fire["data"])["instant"] == first + fired[0] * MINUTE
    assert (skipped["xid"], skipped["id"] + 1) == (fire["xid"], fire["id"])
    assert check_all(st) == []


def test_a_refused_fire_drops_nothing_and_writes_nothing(
    st: Store, sched_clock: ManualClock
) -> None:
    """The drop goes with its fire: a full queue refuses the fire after an outage, and
    the missed instants are neither dropped nor written down; with room again, they
    are, with the fire."""
    st.queue_update("q", max_queued=1)
    st.task_submit(TaskSpec(queue="q", handler="h"))  # the queue is full
    s = _make(st)
    sched_clock.now = s.next_fire_at + 10 * MINUTE + 31_000_000
    before = (st.schedule_get(s.name), len(st.event_list()))
    assert st.schedule_fire_due() == 0
    assert (st.schedule_get(s.name), len(st.event_list())) == before
    st.queue_update("q", max_queued=2)
    assert _fire_all(st) == 1
    assert [d["missed"] for d in _skipped(st, s.name)] == [10]


def test_a_long_outage_names_its_range_and_counts_up_to_a_bound(
    st: Store, sched_clock: ManualClock
) -> None:
    """Two thousand minutes missed under ``skip``, then one on time: the event names
    the first and the last missed, and says there were more than it counts (``missed``
    null)."""
    s = _make(st)
    sched_clock.now = s.next_fire_at + 2000 * MINUTE + 30_000_000
    assert _fire_all(st) == 1
    assert _instants(st) == [s.next_fire_at + 2000 * MINUTE]
    [skipped] = _skipped(st, s.name)
    assert skipped["missed_from"] == s.next_fire_at
    assert skipped["missed_to"] == s.next_fire_at + 1999 * MINUTE
    assert skipped["missed"] is None
