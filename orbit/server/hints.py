"""A signal raised from the store's threads and acted on on the event loop, coalesced.

The store calls back after every commit (``Store.on_events``), thousands of times a
second in a drain; a hop to the loop (``call_soon_threadsafe``: a lock and a write to
the loop's self-pipe, then a wake of the loop) for each would cost the drain itself.
A ``Hint`` costs a raiser an attribute write and a test, and the loop at most one hop
per ``gap`` seconds: the first raise is acted on at once, and whatever is raised during
the gap once after it. None is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class Hint:
    """Calls ``act`` on the loop soon after ``raise_threadsafe``, at most once per
    ``gap`` seconds however often it is raised."""

    def __init__(self, act: Callable[[], None], gap: float) -> None:
        self._act = act
        self.gap = gap
        self._owed = False  # raised since ``act`` last ran
        self._armed = False  # a hop to the loop is on its way, or a gap is running
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def raise_threadsafe(self) -> None:
        """From any thread (the loop's too). ``_owed`` is written before ``_armed`` is
        read, and the loop clears ``_armed`` before it reads ``_owed``: one of the two
        sides always sees the other's write, so a raise is never dropped (at worst
        ``act`` runs once more)."""
        self._owed = True
        if not self._armed and self._loop is not None:
            self._armed = True
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self._owed = False
        self._act()
        assert self._loop is not None
        self._loop.call_later(self.gap, self._rearm)

    def _rearm(self) -> None:
        self._armed = False
        if self._owed:
            self._armed = True
            self._fire()
