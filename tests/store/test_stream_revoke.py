"""An event stream's token is checked again while the stream is busy, not only while it
waits: ``Tail.steps`` (orbit/server/streams.py), the reading side that the SSE and the
WebSocket streams share, on a real store of each backend."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from starlette.requests import HTTPConnection

from orbit.core.model import TaskSpec
from orbit.server.auth import TokenCheck
from orbit.server.routes import event_position_cursor
from orbit.server.streams import PAGE, Events, Stopped, Streams, Tail
from orbit.store import Store
from tests.store.helpers import queue


def test_a_stream_reading_full_pages_stops_once_its_token_is_revoked(store: Store) -> None:
    """A stream that has a backlog to read (a reader from the start of a long log, or a
    log written faster than a page a poll) reads page after page without waiting. Its
    token was checked only when it waited, so a revoked token read on at full speed for
    as long as the backlog lasted, though the docs promise its streams end within the
    token cache time. Now it is checked before each read (a look in the cache)."""
    queue(store)
    for _ in range(3):
        store.task_submit_many([TaskSpec(queue="q", handler="h") for _ in range(PAGE)])
    token_id, token = store.token_create("reader", ["admin"])
    # a poll and a keep-alive far longer than the test: only a busy stream's checks count
    streams = Streams(limit=1, poll_s=3600, keepalive_s=3600)
    tokens = TokenCheck(store, ttl=0)  # every check reads the database
    state = SimpleNamespace(streams=streams, store=store, tokens=tokens)
    conn = SimpleNamespace(
        app=SimpleNamespace(state=state), headers={"authorization": f"Bearer {token}"}
    )
    first = store.event_read(task_id=None, after_xid=0, after_id=0, limit=PAGE, checked=False)[0]
    assert len(first) == PAGE  # a full page: more follow at once
    tail = Tail(
        cast(HTTPConnection, conn),
        scope="admin",
        task_id=None,
        position=(0, 0),
        rows=first,
        cursor_of=event_position_cursor,
        woken=streams.woken(),
    )

    async def main() -> list[Any]:
        seen: list[Any] = []
        steps = tail.steps()
        try:
            seen.append(await anext(steps))
            store.token_revoke(token_id)
            seen.append(await anext(steps))
        finally:
            await steps.aclose()
        return seen

    got = asyncio.run(main())
    assert isinstance(got[0], Events) and len(got[0].items) == PAGE
    assert got[1] == Stopped("UNAUTHENTICATED")
