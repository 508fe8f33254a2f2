"""A revoked token cuts off the worker connections already open with it, on every node.

A worker's token is checked when its WebSocket is opened; a connection opened before the
token was revoked is then closed with **4401** and reason ``UNAUTHENTICATED`` (the code
a refused upgrade gets without the denial response extension), in two ways:

- at once, when the node hears of the revoke: the revoke's own commit tells its node
  (``Store.on_revoked``) and, on PostgreSQL, every other one (``NOTIFY orbit_ready``
  with ``<origin>:revoked:<token id>``, see orbit/server/listen.py);
- as the backstop for a notice never heard (``orbit token revoke`` run on a SQLite file
  beside the server, or a LISTEN connection away at the time), by a re-check of every
  token the node's open connections were opened with, one read each ``interval``
  seconds: the node's token cache period (``orbit server --token-cache``), at least
  ``MIN_RECHECK_S``. A LISTEN reconnect re-checks at once, and forgets every answer the
  node cached, so an HTTP call with a token revoked meanwhile is refused at once too.

A connection whose upgrade checked the token before the revoke but that attaches (its
``hello`` or ``resume``) after the node heard of it is missed by that sweep: the node
remembers the revoked ids and closes it as it attaches (``Dispatcher.refuse_revoked``).

Either way the node also forgets its cached answers for the token, so a worker that
reconnects with it is refused (HTTP 401) rather than let in until the cache runs out,
and releases what the connection's session had claimed and not started
(``gateway.release_revoked``): the tasks go to other workers at once. What it was
running follows the session-loss rules (docs/operations.md, Tokens).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from orbit.server.auth import TokenCheck
from orbit.server.gateway import Dispatcher
from orbit.server.threads import in_thread

log = logging.getLogger("orbit.server")

#: The shortest pause between two re-checks, whatever ``--token-cache`` says: with 0 (a
#: database read at every HTTP call) the re-check would otherwise spin. The notices close
#: a connection at once; this bounds only the backstop.
MIN_RECHECK_S = 1.0


class Revocations:
    """Closes this node's worker connections whose token was revoked."""

    def __init__(self, dispatcher: Dispatcher, tokens: TokenCheck) -> None:
        self.dispatcher = dispatcher
        self.tokens = tokens
        self.interval = max(tokens.ttl, MIN_RECHECK_S)
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def revoked(self, token_ids: Collection[str]) -> None:
        """These tokens were revoked: forget what the node cached for them, then close
        the connections opened with them. Runs on the event loop."""
        self.tokens.forget(token_ids)
        closed = self.dispatcher.close_revoked(token_ids)
        if closed:
            # Token ids are not secret (``orbit token ls`` shows them).
            log.info(
                "closed %d worker connection(s) of revoked token(s) %s",
                closed,
                ", ".join(sorted(token_ids)),
            )

    def revoked_threadsafe(self, token_ids: list[str]) -> None:
        """``revoked`` from another thread: ``Store.on_revoked`` runs in the store's."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.revoked, token_ids)

    async def recheck(self) -> None:
        """Read, in one query, which tokens of the open connections are still accepted,
        and treat the others as just revoked. A failed read is logged and left to the
        next re-check: it says nothing about the tokens."""
        held = self.dispatcher.token_ids()
        if not held:
            return
        try:
            live = await in_thread(self.dispatcher.store.token_live, sorted(held))
        except Exception as exc:
            log.warning("re-checking worker tokens failed (%s)", type(exc).__name__)
            return
        gone = held - live
        if gone:
            self.revoked(gone)

    async def catch_up(self) -> None:
        """LISTEN is (re)established, and a revoke's notice may have been missed while it
        was not: forget every cached answer, those of HTTP calls too (a token that made
        one here is not one of the open connections' that ``recheck`` reads), then
        re-check the open connections' tokens."""
        self.tokens.forget_all()
        await self.recheck()

    async def run(self) -> None:
        """Re-check every ``interval`` seconds, for the server's life."""
        while True:
            await asyncio.sleep(self.interval)
            await self.recheck()
