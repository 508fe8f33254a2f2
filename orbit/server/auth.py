"""Bearer tokens with scopes. Tokens are stored hashed, checked in constant time, cached
briefly in memory by their hash, and never written to a log or an error message."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Collection

from fastapi import Request
from starlette.datastructures import Headers

from orbit.server.errors import ApiError
from orbit.server.threads import in_thread
from orbit.store import Store
from orbit.tokens import CACHE_SECONDS, token_id

SCOPES = ("admin", "submit", "worker")


class TokenCheck:
    """Verifies tokens against the store, remembering answers for ``ttl`` seconds.

    An answer is remembered from when it was read, not renewed by use: a revoked token
    is refused by the first check ``ttl`` seconds after the answer that still took it,
    or at once once this node has heard of the revoke (``forget``), or once its LISTEN
    connection is back (``forget_all``: it may have missed the notice). A call of an
    admin route (``require``) and a worker's WebSocket upgrade are checked against the
    database, not the cache (``fresh``). Let in by a cached answer, a worker connection
    opened just before that answer ran out lived until the re-check after it, nearly
    twice the cache period after an unheard revoke, claiming and starting tasks. Its open
    connection is closed when its token is revoked (orbit/server/revocation.py)."""

    def __init__(self, store: Store, ttl: float = CACHE_SECONDS) -> None:
        self._store = store
        self.ttl = ttl
        #: sha256 of a token -> (until when the answer holds, the scopes or None, its id)
        self._cache: dict[str, tuple[float, frozenset[str] | None, str | None]] = {}
        #: how many times ``forget`` ran: a read in flight across one may have read the
        #: token before its revoke, so its answer is used but not cached
        self._forgets = 0

    async def scopes(self, headers: Headers, *, fresh: bool = False) -> frozenset[str]:
        """The token's scopes, or 401. ``fresh``: read the database whatever the cache
        holds (and cache that answer)."""
        token = bearer_token(headers)
        if token is None:
            raise ApiError(401, "UNAUTHENTICATED", "send Authorization: Bearer <token>")
        key = hashlib.sha256(token.encode()).hexdigest()
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now and not fresh:
            granted = hit[1]
        else:
            forgets = self._forgets
            granted = await in_thread(self._store.token_scopes, token)
            if len(self._cache) > 10_000:
                self._cache.clear()
            if forgets == self._forgets:
                self._cache[key] = (now + self.ttl, granted, token_id(token))
        if granted is None:
            raise ApiError(401, "UNAUTHENTICATED", "the token is unknown or revoked")
        return granted

    def forget_all(self) -> None:
        """Drop every cached answer: this node may have missed a revoke's notice (its
        LISTEN connection was away), and does not know which token it named."""
        self._forgets += 1
        self._cache.clear()

    def forget(self, token_ids: Collection[str]) -> None:
        """Drop the answers cached for these tokens (just revoked): the next check of one
        reads the database, so this node refuses it at once rather than at the end of its
        cache period."""
        self._forgets += 1
        stale = [k for k, (_, _, tid) in self._cache.items() if tid in token_ids]
        for key in stale:
            del self._cache[key]

    async def require(self, headers: Headers, scope: str, *, fresh: bool = False) -> frozenset[str]:
        granted = await self.scopes(headers, fresh=fresh)
        if scope not in granted and "admin" not in granted:
            raise ApiError(403, "FORBIDDEN", f"this call needs the {scope!r} scope")
        return granted


def bearer_token(headers: Headers) -> str | None:
    """The token of the ``Authorization: Bearer <token>`` header, or None if there is none."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def bearer_token_id(headers: Headers) -> str | None:
    """The id of the bearer token in ``headers`` (see ``token_id``)."""
    token = bearer_token(headers)
    return None if token is None else token_id(token)


def require(scope: str) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: the request must carry a token with ``scope`` (or admin).

    A route that needs ``admin`` reads the token from the database at every call, never
    from the cache (``fresh``): an admin can create tokens, and a leaked admin token let
    in by an answer cached before its revoke (one this node has not heard of) minted a
    new admin token that outlived the revoke. Every admin route, not only the token
    ones: they are an operator's rare calls, a read each costs nothing that matters, and
    a revoked admin token then stops revoking other tokens, pausing queues or draining
    workers at once as well; nor can a new admin route forget it. Calls that a submit or
    worker token may make keep the cache, an admin token's too: none of them grants
    anything that outlives the token."""
    assert scope in SCOPES
    fresh = scope == "admin"

    async def dependency(request: Request) -> None:
        await request.app.state.tokens.require(request.headers, scope, fresh=fresh)

    dependency.orbit_scope = scope  # type: ignore[attr-defined]
    return dependency
