"""Where a node's submits to a full scope wait for their turn: on the event loop.

The submits to one queue or tenant with a ``max_queued`` go one at a time, cluster-wide
(``depth_lock``, docs/concepts.md "Backpressure"). A submit waiting for its turn in a
store thread holds that thread, and the node has few (``orbit.server.threads.THREADS``),
which every worker report needs too: a burst of submits at a full queue left the
node's workers waiting for a thread. So a submit to a scope the store last saw capped
(``Store.depth_gated``) first takes this node's asyncio lock of that scope, in key
order, and only then a thread: one thread per capped scope waits for the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext

from orbit.store import Store


class SubmitGates:
    """One asyncio lock per capped scope (its depth key), made when first needed: as
    many as the scopes ever submitted to while capped, which operators set one by one."""

    def __init__(self) -> None:
        self._locks: dict[int, asyncio.Lock] = {}

    def held(
        self, store: Store, scopes: Iterable[tuple[str, str]]
    ) -> AbstractAsyncContextManager[None]:
        """Hold the locks of ``scopes`` (``(kind, name)``) that ``store`` last saw
        capped, for the block. No cap seen: nothing is taken, and no generator made (the
        path of every submit to a scope without a cap)."""
        keys = store.depth_gated(scopes)
        return self._hold(keys) if keys else _NOTHING

    @asynccontextmanager
    async def _hold(self, keys: list[int]) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for key in keys:
                await stack.enter_async_context(self._locks.setdefault(key, asyncio.Lock()))
            yield


_NOTHING: AbstractAsyncContextManager[None] = nullcontext()
