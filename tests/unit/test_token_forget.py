"""A node that hears of a revoke forgets its cached answer for the token
(``TokenCheck.forget``), so that its next check reads the database again, also when a
read of the token was in flight as it heard of it (that read may predate the revoke)."""

from __future__ import annotations

import asyncio
import threading
from typing import cast

from starlette.datastructures import Headers

from orbit.server.auth import TokenCheck
from orbit.store import Store

TOKEN = "orbit_0abc_secret"


class CountingStore:
    """Answers every token check with the worker scope, counting the reads; ``hold``
    keeps the next read waiting until it is set."""

    def __init__(self) -> None:
        self.reads = 0
        self.reading = threading.Event()
        self.hold: threading.Event | None = None

    def token_scopes(self, token: str) -> frozenset[str]:
        self.reads += 1
        self.reading.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        return frozenset({"worker"})


HEADERS = Headers({"authorization": f"Bearer {TOKEN}"})


def test_forget_drops_the_cached_answer_of_that_token_only() -> None:
    async def main() -> None:
        store = CountingStore()
        check = TokenCheck(cast(Store, store), ttl=600)
        other = Headers({"authorization": "Bearer orbit_0def_secret"})
        await check.require(HEADERS, "worker")
        await check.require(other, "worker")
        await check.require(HEADERS, "worker")
        assert store.reads == 2  # cached
        check.forget({"0abc"})
        await check.require(HEADERS, "worker")
        await check.require(other, "worker")
        assert store.reads == 3  # read again; the other token's answer kept

    asyncio.run(main())


def test_an_answer_read_across_a_forget_is_not_cached() -> None:
    async def main() -> None:
        store = CountingStore()
        store.hold = threading.Event()
        check = TokenCheck(cast(Store, store), ttl=600)
        reading = asyncio.create_task(check.require(HEADERS, "worker"))
        await asyncio.to_thread(store.reading.wait, 10)
        check.forget({"0abc"})  # the revoke is heard while the read is in flight
        store.hold.set()
        await reading
        store.hold = None
        await check.require(HEADERS, "worker")
        assert store.reads == 2

    asyncio.run(main())
