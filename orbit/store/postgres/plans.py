"""Prepared statements re-planned when Orbit's tables change size.

The driver prepares its statements at their first use on a connection (``_Raw``;
psycopg, which sends the few others, after their fifth run), and PostgreSQL may then
build one generic plan for each and keep it until something invalidates it (DDL, an
``ANALYZE``). A generic
plan fits the table sizes of the moment it was made: one made while ``orbit_attempts``
was nearly empty (after a ``TRUNCATE``, or early in a drain) scanned the whole table for
every report of the 20,000-task drain that followed, which ran at a third of its speed.
Planning every run instead (``plan_cache_mode = force_custom_plan``) cured that but cost
PostgreSQL about half as much CPU again on the one-task-at-a-time path, where a submit,
claim, start and finish are each a transaction of their own (7.6-9.7 against 4.9-6.4 ms
per task, and 13.7 against 10.4-11.1 ms of wall time), since every run of the composed
statements was planned anew.

So plans are cached, and remade when they may have gone stale: at most once per
``interval`` a transaction also reads the size on disk of the job tables (what the
planner itself scales its estimates by); when one has doubled or halved since the plans
were last remade (and by at least ``MIN_PAGES``), every pooled connection runs ``DISCARD
PLANS`` before its next transaction, and each statement is planned again for the tables
as they are. A table growing from empty to a million rows is re-planned about a dozen
times in all.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psycopg

#: the tables whose size a hot statement's plan depends on
TABLES = ("orbit_tasks", "orbit_attempts", "orbit_events", "orbit_sessions")
PAGE = 8192
#: a change smaller than this many pages never re-plans (tiny tables are planned alike)
MIN_PAGES = 8

SIZES_SQL = "SELECT " + ", ".join(
    f"coalesce(pg_relation_size(to_regclass('{t}')), 0)" for t in TABLES
)


def drifted(planned: tuple[int, ...], now: tuple[int, ...]) -> bool:
    """Whether any table (sizes in bytes) doubled or halved, by ``MIN_PAGES`` at least."""
    for before, after in zip(planned, now, strict=True):
        small, large = sorted((before, after))
        if large - small >= MIN_PAGES * PAGE and large > 2 * small:
            return True
    return False


class PlanWatch:
    """Decides, per transaction, whether its connection must discard its cached plans."""

    def __init__(
        self,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        forget: Callable[[psycopg.Connection[Any]], None] = lambda cx: None,
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._forget = forget
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._planned_for: tuple[int, ...] | None = None
        self.epoch = 0  # bumped each time every connection's plans must be remade
        #: the epoch from which a connection that saw an earlier one must drop its
        #: prepared statements, not only their plans (``statements_stale``)
        self._deallocate_from = 0
        self._seen: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def before_transaction(self, cx: psycopg.Connection[Any]) -> None:
        """Run first in every transaction on ``cx``: now and then read the sizes, and
        discard this connection's plans if they were made before the last drift."""
        if self._clock() >= self._next_check and self._claim_check():
            row = cx.execute(SIZES_SQL).fetchone()
            assert row is not None
            self._observe(tuple(int(n) for n in row))
        seen = self._seen.get(cx)
        if seen is None:  # a new connection has no plans yet
            self._seen[cx] = self.epoch
        elif seen != self.epoch:
            if seen < self._deallocate_from:
                # psycopg reads this command's status and forgets its own statements
                cx.execute("DEALLOCATE ALL")
                self._forget(cx)
            else:
                cx.execute("DISCARD PLANS")
            self._seen[cx] = self.epoch

    def statements_stale(self) -> None:
        """The tables changed under the prepared statements (another node's migration
        added a column): every connection drops them before its next transaction and
        prepares each again at its next use. PostgreSQL refuses to run a prepared
        statement whose result's columns changed (a ``SELECT *``), and ``DISCARD PLANS``
        does not lift that: each connection failed every such statement until the pool
        replaced it, an hour later."""
        with self._lock:
            self.epoch += 1
            self._deallocate_from = self.epoch

    def _claim_check(self) -> bool:
        """One transaction per interval reads the sizes; the others go on."""
        with self._lock:
            now = self._clock()
            if now < self._next_check:
                return False
            self._next_check = now + self.interval
            return True

    def _observe(self, sizes: tuple[int, ...]) -> None:
        with self._lock:
            if self._planned_for is None:
                self._planned_for = sizes
            elif drifted(self._planned_for, sizes):
                self._planned_for = sizes
                self.epoch += 1
