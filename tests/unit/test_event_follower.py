"""``orbit task show`` / ``task wait`` follow a task's events with ``_EventFollower``.
The feed is in transaction order, not id order: an event that commits late can carry a
lower id than one already shown. The follower told what it had read by the highest id,
so such an event was never shown."""

from __future__ import annotations

from typing import Any

from orbit.cli.api import _EventFollower


class _Feed:
    """A task's events pages as the server gives them: ``pages[cursor]``."""

    def __init__(self) -> None:
        self.pages: dict[str | None, dict[str, Any]] = {}

    def events(
        self, task_id: str, limit: int, cursor: str | None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        return self.pages[cursor]


def _page(*ids: int, next_cursor: str | None = None) -> dict[str, Any]:
    return {"items": [{"id": str(i)} for i in ids], "next_cursor": next_cursor}


def test_an_event_with_a_lower_id_that_comes_later_is_shown() -> None:
    feed = _Feed()
    follower = _EventFollower(feed, "t")  # type: ignore[arg-type]
    feed.pages[None] = _page(5)
    assert [e["id"] for e in follower.new()] == ["5"]
    feed.pages[None] = _page(5, 3, 7)  # 3 committed after 5 was read
    assert [e["id"] for e in follower.new()] == ["3", "7"]
    assert follower.new() == []


def test_a_full_page_is_passed_and_its_events_are_not_shown_again() -> None:
    feed = _Feed()
    follower = _EventFollower(feed, "t")  # type: ignore[arg-type]
    feed.pages[None] = _page(4, 2, next_cursor="c1")
    feed.pages["c1"] = _page(9)
    assert [e["id"] for e in follower.new()] == ["2", "4", "9"]
    feed.pages["c1"] = _page(9, 8)
    assert [e["id"] for e in follower.new()] == ["8"]
