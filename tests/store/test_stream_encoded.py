"""An event's wire forms (its SSE message, its WebSocket frame) are encoded once for all
of a node's streams, not once per stream (``Encoded``, orbit/server/streams.py): 250
streams encoded each event 250 times on the event loop, and a submit waited 0.8 s for
it. On real event rows of each backend: what is shared is what each stream sent before
(the bytes on the wire are those of the e2e stream tests), and only a bounded number of
events is kept."""

from __future__ import annotations

from typing import Any

from orbit.core.model import TaskSpec, compact_json
from orbit.server.routes import event_position_cursor
from orbit.server.streams import ENCODED_ENTRY_MAX, Encoded, _Kept, message
from orbit.server.views import event_view
from orbit.store import Store
from tests.store.helpers import queue


def _rows(store: Store, task_id: str | None = None) -> list[dict[str, Any]]:
    rows, _ = store.event_read(task_id=task_id, after_xid=0, after_id=0, limit=500, checked=False)
    return rows


def _own_sse(row: dict[str, Any]) -> bytes:
    """An event's SSE message as a stream encoded it for itself."""
    view = event_view(row).model_dump(mode="json")
    return message(event_position_cursor(row), view["kind"], view)


def _own_frame(row: dict[str, Any]) -> str:
    """An event's WebSocket frame as a stream encoded it for itself."""
    view = event_view(row).model_dump(mode="json")
    frame = {"type": "event", "cursor": event_position_cursor(row), "event": view}
    return compact_json(frame).decode()


def test_an_event_is_encoded_once_for_every_stream_that_sends_it(store: Store) -> None:
    queue(store)
    tasks = store.task_submit_many([TaskSpec(queue="q", handler="h") for _ in range(3)])
    assert tasks
    encoded = Encoded()
    first_sse = encoded.sse(_rows(store), event_position_cursor)
    first_ws = encoded.frames(_rows(store), event_position_cursor)
    assert first_sse == [_own_sse(r) for r in _rows(store)]
    assert first_ws == [_own_frame(r) for r in _rows(store)]
    # another stream, its own read of the same events: the same bytes, not encoded again
    again_sse = encoded.sse(_rows(store), event_position_cursor)
    again_ws = encoded.frames(_rows(store), event_position_cursor)
    assert all(a is b for a, b in zip(again_sse, first_sse, strict=True))
    assert all(a is b for a, b in zip(again_ws, first_ws, strict=True))


def test_a_task_stream_shares_the_whole_logs_encoding_byte_for_byte(store: Store) -> None:
    """A task's stream reads its events through another query than the whole log's;
    the rows, and so the wire forms, are the same: what one encoded the other may send."""
    queue(store)
    store.task_submit_many([TaskSpec(queue="q", handler="h") for _ in range(3)])
    whole = _rows(store)
    task_id = str(whole[-1]["task_id"])
    encoded = Encoded()
    encoded.sse(whole, event_position_cursor)
    encoded.frames(whole, event_position_cursor)
    own = _rows(store, task_id)
    assert own
    assert encoded.sse(own, event_position_cursor) == [_own_sse(r) for r in own]
    assert encoded.frames(own, event_position_cursor) == [_own_frame(r) for r in own]


def test_only_the_most_recently_sent_events_are_kept(store: Store) -> None:
    queue(store)
    store.task_submit_many([TaskSpec(queue="q", handler="h") for _ in range(3)])
    rows = _rows(store)[-3:]
    encoded = Encoded(size=2)
    first = encoded.frames(rows, event_position_cursor)
    again = encoded.frames(rows[1:], event_position_cursor)  # the two kept
    assert all(a is b for a, b in zip(again, first[1:], strict=True))
    older = encoded.frames(rows[:1], event_position_cursor)  # dropped: encoded anew
    assert older == first[:1] and older[0] is not first[0]


def test_the_kept_forms_are_bounded_in_bytes_and_a_large_one_is_not_kept() -> None:
    """Counted in events alone, a stream reading a backlog of events that carry large
    results (a cancel that won over a finish keeps the finish's outcome, result and all,
    in its event) kept up to 4,096 of them: gigabytes. The bytes kept are bounded too, and
    a form larger than ``ENCODED_ENTRY_MAX`` is sent and not kept. (The forms here stand
    for any: what is counted is their length.)"""
    sizes = {1: 100, 2: ENCODED_ENTRY_MAX + 1, 3: 100, 4: 100}
    made: list[int] = []

    def encode(row: dict[str, Any]) -> str:
        made.append(row["id"])
        return "x" * sizes[row["id"]]

    kept = _Kept[str](size=10, max_bytes=250)
    rows = [{"xid": 7, "id": i} for i in sizes]
    first = [kept.get(r, encode) for r in rows]
    assert [len(f) for f in first] == list(sizes.values())
    assert made == [1, 2, 3, 4] and len(kept) == 2 and kept.bytes == 200  # 1 dropped, 2 not kept
    again = [kept.get(r, encode) for r in rows[2:]]
    assert again[0] is first[2] and again[1] is first[3] and made == [1, 2, 3, 4]
    assert kept.get(rows[1], encode) == first[1] and made[-1] == 2  # too large: encoded anew
    assert kept.get(rows[0], encode) == first[0] and made[-1] == 1  # dropped: encoded anew
    assert len(kept) == 2 and kept.bytes == 200
