"""The schedule duty's stretch of work, on SQLite and PostgreSQL (``Store.schedule_fire_due``).

While the duty's rounds follow one another, each firing something, an instant that
comes due is on time however late its round. That holds only while the duty is busy:
a stall between two of its looks at the clock (the node stopped, a paused VM, a long
wait on the database) is time it could not see, as if it were down, and what came due
then is judged by the misfire policy. And a round in which no fire wrote anything (every
due row held by another node's fire) ends the pass, rather than spinning round after
round for its whole budget. The clocks are the test's: nothing sleeps."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from orbit.store import Store
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import queue
from tests.store.test_schedule_misfires import TickingClock, _consecutive, _fired, _skipped
from tests.store.test_schedules import MINUTE, START, _fire_all, _make

HOUR = 60 * MINUTE


class StallClock(ManualClock):
    """A test clock that counts its reads and, once armed, jumps ahead by ``stall`` at
    the ``at``-th read from then on: the node stood still between two reads."""

    def __init__(self, now: int) -> None:
        super().__init__(now)
        self.reads = 0
        self.at = 0
        self.stall = 0

    def arm(self, at: int, stall: int) -> None:
        self.reads, self.at, self.stall = 0, at, stall

    def __call__(self) -> int:
        self.reads += 1
        if self.reads == self.at:
            self.now += self.stall
        return self.now


@pytest.mark.parametrize("where", ["in a fire", "between rounds"])
@pytest.mark.parametrize(
    ("policy", "missed_to", "kept"),
    [
        ("skip", 59, []),  # 08:03 … 09:00 dropped; 09:01 is a minute old: on time
        ("catch_up", 56, [57, 58, 59]),  # the latest max_catch_up (3) missed, then on
    ],
    ids=["skip", "catch_up"],
)
def test_a_stall_within_a_pass_ends_the_stretch(
    make_store: Any, policy: str, missed_to: int, kept: list[int], where: str
) -> None:
    """The duty fires 08:02 and then stands still for an hour, inside the same pass:
    within the round's fire (after its transaction read the clock), or between that
    round and the next. The hour's instants are missed, not on time: the policy and
    ``max_catch_up`` decide, and the instants dropped are written down. They used to
    fire all 61 as on time, the pass's stretch having begun before the stall."""
    clock = StallClock(START)
    st: Store = make_store(clock=clock)
    queue(st)
    first = _make(st, misfire=policy, max_catch_up=3).next_fire_at  # 08:01
    clock.now = first
    clock.arm(0, 0)
    assert st.schedule_fire_due() == 1  # 08:01: a round that fires, one that finds none
    reads = clock.reads  # the round's start, its fire's, the next round's start
    clock.now = first + MINUTE  # 08:02 due
    clock.arm(2 if where == "in a fire" else reads, HOUR)
    st.schedule_fire_due()
    assert clock.reads >= clock.at  # the stall came within that pass
    _fire_all(st)
    minutes = [0, 1, *kept, 60, 61]  # 08:01, 08:02, those kept, 09:01 and 09:02
    assert _fired(st, "every-minute") == [first + m * MINUTE for m in minutes]
    [skipped] = _skipped(st, "every-minute")
    assert (skipped["missed_from"], skipped["missed_to"]) == (
        first + 2 * MINUTE,
        first + missed_to * MINUTE,
    )
    assert skipped["missed"] == missed_to - 1
    assert check_all(st) == []


def test_a_long_round_without_a_stall_keeps_every_instant_on_time(make_store: Any) -> None:
    """A round of many fires may take minutes of the clock (here each read of it costs
    25 s: four fires, over three minutes a round) without the duty ever standing still
    for a minute: it is busy, so every instant that comes due meanwhile is on time and
    fires, none dropped. A stall is a gap between two of the duty's looks at the clock,
    not a round's length."""
    clock = TickingClock(START, 25_000_000)
    st: Store = make_store(clock=clock)
    queue(st)
    names = [f"s{i}" for i in range(4)]
    first = min(_make(st, name).next_fire_at for name in names)  # 08:01, for each
    clock.now = first
    end = first + 20 * MINUTE
    clock.ticking = True
    while clock.now < end:
        st.schedule_fire_due(budget_s=0)  # a round a pass; the stretch goes on
    clock.ticking = False
    _fire_all(st)
    for name in names:
        fired = _fired(st, name)
        assert fired[0] == first and fired[-1] >= end - MINUTE
        assert _consecutive(fired)
        assert _skipped(st, name) == []
    assert check_all(st) == []


@pytest.mark.parametrize("path", ["a fire", "a skip's advance"])
def test_a_pass_whose_due_rows_are_held_elsewhere_ends_at_once(
    backend: str, make_store: Any, path: str
) -> None:
    """Another node's fire holds the one due schedule's row (``FOR UPDATE``): this
    node's fire passes it by (``SKIP LOCKED``) and writes nothing, whether it would
    have fired an instant or, under ``skip`` with none on time, only moved the schedule
    on. That round did nothing, and the pass ends: one round, a clock read or two. It
    used to count the fire as done and go round after round for its whole second (some
    700 rounds). The clock's reads count the rounds (one at each round's start, one in
    each fire). Once the row is free the next pass fires it."""
    if backend != "postgres":
        pytest.skip("SQLite has no row locks: a fire waits for the write lock, none is passed by")
    clock = StallClock(START)
    st: Store = make_store(clock=clock)
    queue(st)
    if path == "a fire":
        s = _make(st)  # 08:01, on time at 08:01:30
        clock.now = s.next_fire_at + 30_000_000
    else:
        s = _make(st, cron="0 * * * *")  # 09:00, missed by 14:10; none on time
        clock.now = s.next_fire_at + 5 * HOUR + 10 * MINUTE
    with psycopg.connect(store_url(st)) as other:
        other.execute("SELECT * FROM orbit_schedules WHERE name = %s FOR UPDATE", (s.name,))
        clock.arm(0, 0)
        assert st.schedule_fire_due() == 0
        assert clock.reads <= 3, clock.reads
        other.rollback()
    assert st.schedule_get(s.name) == s  # nothing written
    if path == "a fire":
        assert st.schedule_fire_due() == 1
        assert _fired(st, s.name) == [s.next_fire_at]
    else:
        assert st.schedule_fire_due() == 0
        assert st.schedule_get(s.name).next_fire_at == s.next_fire_at + 6 * HOUR
        [skipped] = _skipped(st, s.name)
        assert skipped["missed_to"] == s.next_fire_at + 5 * HOUR
    assert check_all(st) == []
