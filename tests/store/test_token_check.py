"""A node's token check (``orbit.server.auth.TokenCheck``) on a real store of each backend:
what it keeps of the tokens it is sent."""

from __future__ import annotations

import asyncio

import pytest
from starlette.datastructures import Headers

from orbit.server.auth import TokenCheck
from orbit.server.errors import ApiError
from orbit.store import Store


@pytest.mark.parametrize(
    "bogus",
    [
        "orbit_" + "a" * 1_000_000 + "_x",  # an "id" far longer than any a server makes
        "orbit_" + "\u00e9" * 100_000 + "_x",  # letters, not ASCII
    ],
    ids=["long", "non-ascii"],
)
def test_a_bogus_token_leaves_no_copy_of_itself_in_the_cache(store: Store, bogus: str) -> None:
    """The cache of token checks kept, beside each answer, the id of the token it was
    for: for a token of no id a server makes (an "id" a megabyte long), a megabyte per
    bogus token, and it holds 10,000 answers before it is cleared, so a client with no
    token could make a node hold gigabytes. Such a token is refused as any unknown one
    (401) and what is cached for it is a hash and no id."""
    _, good = store.token_create("ops", ["submit"])

    async def main() -> None:
        check = TokenCheck(store, ttl=600)
        for _ in range(3):
            with pytest.raises(ApiError) as refused:
                await check.require(Headers({"authorization": f"Bearer {bogus}"}), "submit")
            assert (refused.value.status, refused.value.code) == (401, "UNAUTHENTICATED")
        await check.require(Headers({"authorization": f"Bearer {good}"}), "submit")
        kept = sum(len(key) + len(tid or "") for key, (_, _, tid) in check._cache.items())
        assert kept < 1_000, f"the cache holds {kept} characters for two tokens"

    asyncio.run(main())
