"""The worker WebSocket ``/v1/worker`` and the dispatcher that pushes claims.

A connection starts with ``hello`` (a new session) or ``resume`` (an existing one, from
any node, with its secret; the epoch is bumped so the old connection is fenced). After
``welcome`` every request carries a ``req_id`` that its reply echoes. Malformed messages
are answered with an ``error`` and the connection stays open; nothing is touched. A
connection left without a ``welcome`` for a session TTL is closed (4408), and so is one
whose session lapsed (4409), pushed to or not.

The dispatcher claims on behalf of connected sessions whenever it is woken — by a commit
on this node, by NOTIFY from another node on PostgreSQL, or by the slow poll fallback —
and pushes ``tasks``; the store's caps decide how many each session gets.

The dispatcher serves every connection on the node from one loop, so it never waits for
a socket: a push (``tasks``, ``cancel``, ``drain``) goes out at once when the socket
takes it, and otherwise waits by itself (``WorkerConnection.send_nowait``) while the
dispatcher goes on to the next worker. A connection with such a push waiting is offered
nothing more until it has gone out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Sequence
from functools import partial
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from orbit.aio import start_eagerly
from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import (
    Capability,
    Grant,
    Lease,
    Outcome,
    Receipt,
    Session,
    compact_json,
    instant_text,
)
from orbit.core.states import SessionState
from orbit.protocol.decode import DecodeError, decode_json, decode_model
from orbit.protocol.messages import (
    WORKER_REQUESTS,
    AckMessage,
    CancelMessage,
    CapacityUpdate,
    Claim,
    Drain,
    DrainMessage,
    ErrorMessage,
    Finish,
    FinishMany,
    Heartbeat,
    Hello,
    Progress,
    Release,
    Renew,
    Resume,
    Start,
    StartMany,
    Welcome,
)
from orbit.protocol.reports import (
    READERS,
    FinishBatch,
    StartBatch,
    finish_batch,
    outcome_of,
    start_batch,
)
from orbit.server.auth import bearer_token_id
from orbit.server.errors import DATABASE_RETRY_AFTER_S, ApiError, refuse_upgrade
from orbit.server.metrics import Metrics
from orbit.server.threads import in_thread
from orbit.server.views import assignments_wire, lease_wire, receipt_wire
from orbit.store import Grants, Store
from orbit.store.driver import DatabaseUnavailable

log = logging.getLogger("orbit.gateway")
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Reports that one connection may have in the store at once. Each is its own
#: transaction; overlapping them keeps the database busy while this process encodes and
#: decodes. A worker sends a start or finish only after the reply it depends on, so their
#: order is free (replies are matched by req_id). Every other message — progress above
#: all, which must land before the finish sent right after it — waits for the reports
#: before it and holds back the ones after it.
MAX_REPORTS_IN_FLIGHT = 4
#: how long after a rate-limited queue's next token is due the dispatcher wakes for it,
#: so that its claim reads a clock past the due instant
TOKEN_MARGIN_S = 0.002
#: Seconds before a round that failed (a bug: a claim's own errors are caught) is tried
#: again: soon, but not in a loop that would fill the log.
ROUND_RETRY_S = 1.0
#: a decoded worker message: a model, or a batch of reports read at once (reports.py)
Request = BaseModel | StartBatch | FinishBatch

#: What a worker sends to begin work: not acted on once its connection is closed.
OPENING_WORK = (Start, StartMany, StartBatch, Claim)
CONCURRENT_REPORTS = (
    Start,
    StartMany,
    StartBatch,
    Finish,
    FinishMany,
    FinishBatch,
    Renew,
    Heartbeat,
)


#: How many revoked token ids a node remembers for connections still attaching
#: (``Dispatcher.revoked``); past it they are forgotten, and the periodic re-check of the
#: open connections' tokens (orbit/server/revocation.py) closes such a connection instead.
MAX_REVOKED_KEPT = 10_000

#: The close of a connection that had no ``hello`` or ``resume`` welcomed within a
#: session TTL of its upgrade (HTTP's 408, in the 4000s as 4401 and 4409 are): it held
#: a socket, and a task of the node's, for as long as its peer kept it open.
HELLO_TIMEOUT_CLOSE = 4408
HELLO_TIMEOUT = "HELLO_TIMEOUT"
#: How long after its session was read still live past the expiry this connection
#: expected (the reaper not there yet, or a renew that kept it alive unnoticed: one that
#: answered only ``lost``) a connection's session is read again, as a fraction of the
#: session TTL.
EXPIRY_RECHECK_FRACTION = 0.1


class WorkerConnection:
    """One attached worker: its session, epoch, and a lock so replies never interleave."""

    def __init__(
        self, ws: WebSocket, session: Session, push: bool, token_id: str | None = None
    ) -> None:
        self.ws = ws
        self.session_id = session.id
        #: the id of the token the WebSocket was opened with: revoked, it closes the
        #: connection (orbit/server/revocation.py)
        self.token_id = token_id
        self.epoch = session.epoch
        self.max_concurrency = session.max_concurrency
        #: the handlers the session runs: a claim can only find tasks of these (kept
        #: current by ``capacity`` updates)
        self.handlers = handlers_of(session)
        self.push = push
        #: the session is draining and its worker knows: it asked (``drain``) or was
        #: pushed ``drain`` on this connection (``Dispatcher.push_drain``)
        self.draining = False
        self.closed = False
        #: whether the last claim for this worker stopped at a capacity or cap (see
        #: ``Grants.blocked``): only then is a claim worth making when a permit frees
        self.blocked = True
        #: the last claim for this worker found its session with no free slot
        #: (``Grants.full``): the dispatcher's rounds skip it until something may have
        #: freed one (``Dispatcher.slots_freed``) or a poll round comes
        self.full = False
        #: how many times something may have freed one of its slots: a claim in flight
        #: across one may have counted the slot as taken, so it does not mark it full
        self.freed = 0
        #: pushes still waiting for the socket to take them (``send_nowait``): the worker
        #: is not reading, or reads slower than pushes come
        self.backlog: set[asyncio.Task[Any]] = set()
        #: the pushes of claimed attempts among them (``push_nowait``), and whether
        #: ``close`` cancelled them (for a fence), so that they release their attempts
        self.pushes: set[asyncio.Task[Any]] = set()
        self.pushes_dropped = False
        self._send_lock = asyncio.Lock()

    async def send(self, message: BaseModel | dict[str, Any] | str) -> bool:
        """Send a message: a model, a wire dict (the hot replies, see views.py) or a
        frame's text already written (``tasks_frame``).
        Whether it was handed to the socket: not if the connection is closed or the send
        failed (which marks it closed)."""
        if self.closed:
            return False
        if isinstance(message, str):
            text = message
        elif isinstance(message, BaseModel):
            text = message.model_dump_json()
        else:
            text = wire_text(message)
        async with self._send_lock:
            if self.closed:  # closed while this send waited for the one before it
                return False
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True
                return False
        return True

    def send_nowait(
        self, sending: Coroutine[Any, Any, Any], then: Callable[[], None] | None = None
    ) -> asyncio.Task[Any] | None:
        """Run ``sending`` (a ``send``, ``send_tasks`` or ``close`` of this connection)
        without waiting for the socket. A socket that takes the bytes takes them at once,
        so the send usually completes right here, before this returns. One that does not
        (the worker stopped reading: its process is stopped, or a handler blocks its event
        loop, and the kernel's and the server's buffers are full) leaves the send waiting
        in a task of its own, in ``backlog``, and returned; ``then`` is called when it is
        done. Sends keep their order: each waits for the one before it (the send lock)."""
        task = start_eagerly(sending)
        if task is None:
            return None
        self.backlog.add(task)
        task.add_done_callback(partial(self._sent, then=then))
        return task

    def push_nowait(self, store: Store, grants: Sequence[Grant], then: Callable[[], None]) -> None:
        """``send_tasks`` of attempts claimed for this worker, not waited for; kept in
        ``pushes`` while it waits for the socket, for ``close(drop_pushes=True)``."""
        task = self.send_nowait(self.send_tasks(store, None, grants), then=then)
        if task is not None:
            self.pushes.add(task)
            task.add_done_callback(self.pushes.discard)

    def _sent(self, task: asyncio.Task[Any], then: Callable[[], None] | None) -> None:
        self.backlog.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a push to a worker failed", exc_info=task.exception())
        if then is not None:
            then()

    async def close(self, code: int, reason: str, *, drop_pushes: bool = False) -> None:
        """Mark the connection closed and close its socket (quietly: it may be gone).

        ``drop_pushes``, for a connection fenced by a resume: its pushes still waiting for
        the socket (the worker stopped reading it, having gone on over another) are
        cancelled, and so released (``send_tasks``). Left waiting, they held their
        attempts, and the resumed session's slots, until their claim lease ran out: the
        socket took no bytes, so the send never failed. Other closes leave them: a
        revoke's release (``release_revoked``) and the reaper give such attempts back
        with their own codes, and a release of ours beside them would race them. A close
        waiting for the socket is never cancelled: Starlette marks the socket closed
        before it writes the frame, so a second close could not send one."""
        self.closed = True
        if drop_pushes:
            self.pushes_dropped = True
            for push in list(self.pushes):
                push.cancel()
        with contextlib.suppress(Exception):
            await self.ws.close(code=code, reason=reason)

    async def send_tasks(self, store: Store, req_id: str | None, grants: Sequence[Grant]) -> None:
        """Send claimed attempts; if they cannot reach the worker, release them at once
        (back to queued) rather than leave them to their claim lease. A push cancelled
        by ``close(drop_pushes=True)`` while it waited for the socket is released too: a
        socket write is made whole once the socket can take it, so a cancelled one sent
        nothing, and the connection is fenced anyway (a start from it is refused)."""
        try:
            if await self.send(tasks_frame(req_id, grants)):
                return
        except asyncio.CancelledError:
            if self.pushes_dropped:  # not the server stopping: that releases nothing
                await in_thread(release_undelivered, store, self.session_id, self.epoch, grants)
            raise
        await in_thread(release_undelivered, store, self.session_id, self.epoch, grants)


def wire_text(message: dict[str, Any]) -> str:
    """A wire dict (the hot replies, see views.py) as its text frame."""
    return compact_json(message).decode("utf-8")


def handlers_of(session: Session) -> frozenset[str]:
    """The handlers a session runs, as the dispatcher compares them."""
    return frozenset(c.handler for c in session.capabilities)


def release_undelivered(store: Store, session_id: str, epoch: int, grants: Sequence[Grant]) -> None:
    """Give back attempts claimed for a connection that closed before they reached it,
    through the store's release path (claimed -> released, the task queued again).

    A failed send wrote nothing, so no connection of the session has these attempts.
    If the session was resumed meanwhile (the resume is what closed the connection, when
    it lands on this node), the release in the claim's epoch is fenced: it is made again
    in the session's current epoch, rather than leave the attempts holding the resumed
    session's slots until their claim lease runs out. One that still cannot be released
    (started, or resumed once more meanwhile) is left to its claim lease."""
    current: int | None = None
    for grant in grants:
        attempt = grant.attempt
        try:
            try:
                store.attempt_release(session_id, epoch, attempt.id, attempt.fence)
            except OrbitError as exc:
                if exc.code != Code.FENCED_EPOCH:
                    raise
                if current is None:
                    current = store.session_get(session_id).epoch
                store.attempt_release(session_id, current, attempt.id, attempt.fence)
        except OrbitError as exc:
            log.info("undelivered attempt %s not released: %s", attempt.id, exc.code)
        except Exception:
            log.exception("releasing undelivered attempt %s failed", attempt.id)


async def release_revoked(store: Store, session_id: str, epoch: int) -> None:
    """Give back the attempts a session had claimed and not started, its connection
    closed for a revoked token (``Store.session_release_claims``): the tasks go back to
    the queue at once rather than wait for their claim lease. Done by the node that
    closed the connection, whichever node the revoke was made on. A failure is logged:
    the claim lease still releases them."""
    try:
        released = await in_thread(store.session_release_claims, session_id, epoch)
    except Exception:
        log.exception("releasing the claims of session %s failed", session_id)
        return
    if released:
        log.info("released %d claimed attempt(s) of session %s", released, session_id)


class PassSkips:
    """What a background duty (the reaper, the scheduler, the dispatcher's claims) logs
    while the database keeps its passes from running. A pass the store gave up on for the
    database's sake (its lock held elsewhere, full, read-only, out of reach:
    ``DatabaseUnavailable``) is no bug: the store logged why already (``a transaction gave
    up after N tries``) and the next pass tries again. It was an ERROR with a traceback at
    every pass, for as long as the lock was held, which sent operators looking for a bug.
    It is now one WARNING when passes start being skipped, again only if the reason
    changes, and one INFO once a pass runs again; anything else a pass raises is a bug
    and keeps its traceback. (Here, not in app.py with the reaper and the scheduler, so
    that the dispatcher can use it: app.py imports this module.)"""

    def __init__(self, duty: str, interval: float, logger: logging.Logger | None = None) -> None:
        self.duty = duty
        self.interval = interval  # the pause after a skipped pass
        self.code: str | None = None  # why passes are being skipped; None while they run
        self.count = 0  # passes skipped since the last that ran
        self.log = logger or logging.getLogger("orbit.server")

    def skipped(self, exc: DatabaseUnavailable) -> None:
        self.count += 1
        if exc.code != self.code:
            self.code = exc.code
            self._say_skipped(exc)

    def ran(self) -> None:
        if self.code is not None:
            self._say_ran()
        self.code, self.count = None, 0

    def _say_skipped(self, exc: DatabaseUnavailable) -> None:
        self.log.warning(
            "%s pass skipped: %s (%s); trying again every %g s",
            self.duty,
            exc.message,
            exc.code,
            self.interval,
        )

    def _say_ran(self) -> None:
        self.log.info("%s passes run again, after %d skipped", self.duty, self.count)


class RefusedConnects(PassSkips):
    """``PassSkips`` for worker upgrades refused (503, ``worker_endpoint``) while the
    database cannot check their tokens: one WARNING when they start, again only if the
    reason changes, and one INFO once a worker is let in (``ran``). A line for each
    refused try: each worker of a fleet retries at every ``Retry-After``, so a fleet of
    N wrote about N/5 lines a second for as long as the database was away."""

    def __init__(self) -> None:
        super().__init__("worker connect", DATABASE_RETRY_AFTER_S, log)

    def _say_skipped(self, exc: DatabaseUnavailable) -> None:
        self.log.warning(
            "worker connect refused 503: %s (%s); each try is answered so, Retry-After "
            "%d s, until the database takes the token check",
            exc.message,
            exc.code,
            DATABASE_RETRY_AFTER_S,
        )

    def _say_ran(self) -> None:
        self.log.info("worker connects let in again, after %d refused", self.count)


class Dispatcher:
    """Claims for attached sessions when woken, and pushes cancels to their owners."""

    def __init__(self, store: Store, poll_interval: float, metrics: Metrics) -> None:
        self.store = store
        self.poll_interval = poll_interval
        self.metrics = metrics
        self.connections: dict[str, WorkerConnection] = {}
        #: the tokens this node has heard were revoked (``close_revoked``): a connection
        #: upgraded with one before the revoke is closed as it attaches (``refuse_revoked``)
        self.revoked: set[str] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: permits freed so far (by any commit this node hears of). A claim compares it
        #: before and after: a permit freed while the claim was in flight was judged
        #: against the worker's previous ``blocked``, so the wake may have been skipped.
        self.frees = 0
        #: when (event loop time) a rate-limited queue that held tasks back has a token
        #: again: the dispatcher wakes by itself then, as no commit announces it
        self._token_due: float | None = None
        #: releases of what connections closed for a revoked token had claimed, under way
        self.releasing: set[asyncio.Task[None]] = set()
        #: rounds run so far: each starts one connection further on (``offer_all``)
        self.rounds = 0
        #: worker upgrades refused while the database could not check their tokens
        self.refused_connects = RefusedConnects()
        #: this round's claims that went through and that the database kept from running
        self.round_claims = self.round_skips = 0
        #: claims the database kept from running (``_offer``): a warning, not a traceback
        self.skips = PassSkips("dispatch", poll_interval, log)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def wake_threadsafe(self, *_: Any) -> None:
        """A task became ready: claim for every attached worker."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def freed_threadsafe(self, *_: Any) -> None:
        """A permit was freed: claim again if some worker's last claim was held back."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_if_blocked)

    def _wake_if_blocked(self) -> None:
        self.frees += 1
        # A freed permit may be a full session's own slot, freed with no report of its
        # worker's (the reaper ending a timed-out or lost attempt, a cancel releasing a
        # claimed one its worker held waiting, another node's commit), and the notice
        # does not say whose: every full mark is cleared, as a poll round clears them.
        # A submit frees nothing, so submits still skip full workers.
        self._clear_full_marks()
        # Only connections the dispatcher claims for: one that takes no pushes has no
        # claim made for it, so its ``blocked`` never leaves its first value (True), and
        # counting it made every freed permit on the node cost a round of claims.
        if any(c.blocked and c.push and not c.closed for c in self.connections.values()):
            self._wake.set()

    def _clear_full_marks(self) -> None:
        """Offer to every connection again, those skipped as full too: something whose
        owner this node cannot tell may have freed one of their slots."""
        for conn in self.connections.values():
            conn.full = False

    def slots_freed(self, conn: WorkerConnection) -> None:
        """Something may have freed slots of ``conn``'s session: its worker reported an
        attempt ended or released (or one refused as already ended), or changed its
        capacities, and the store call has returned; or the node gave back attempts
        claimed for it. Its rounds offer to it again. Called after the commit: the commit's
        own wake (``freed_threadsafe``) may run a round before this, which skipped the
        connection while it was still marked full, so this wakes another."""
        conn.freed += 1
        if conn.full:
            conn.full = False
            self._wake.set()

    def session_slots_freed(self, session_id: str) -> None:
        """``slots_freed`` for the session's connection on this node, if it has one (a
        release made for a connection since closed: the session may have resumed here)."""
        conn = self.connections.get(session_id)
        if conn is not None:
            self.slots_freed(conn)

    def cancel_threadsafe(self, pairs: list[tuple[str, str]]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.push_cancel, pairs)

    def push_cancel(self, pairs: list[tuple[str, str]]) -> None:
        """Push ``cancel`` to the attached owners of these attempts, waiting for none of
        them: a worker that does not read holds up only its own."""
        by_session: dict[str, list[str]] = {}
        for session_id, attempt_id in pairs:
            by_session.setdefault(session_id, []).append(attempt_id)
        for session_id, attempt_ids in by_session.items():
            conn = self.connections.get(session_id)
            if conn is not None:
                message = CancelMessage(attempt_ids=attempt_ids)
                conn.send_nowait(conn.send(message), then=self._wake.set)

    def push_drain(self, session_id: str) -> None:
        """Push ``drain`` to the session's connection here, if it has one: the session
        was drained other than by its worker's own ``drain`` (an operator's drain, on
        this node or another), so the worker stops as on SIGTERM once its running
        attempts finish. Without it, the worker was offered nothing more and never
        told: it heartbeated an idle session for ever. Not waited for, as a cancel."""
        conn = self.connections.get(session_id)
        if conn is not None and not conn.closed:
            conn.push = False  # offered nothing more (its claims would be refused)
            conn.draining = True
            conn.send_nowait(conn.send(DrainMessage()))

    def close_fenced(self, session_id: str, epoch: int) -> None:
        """The session resumed elsewhere with ``epoch``: close its connection here if that
        holds an older one (the store fences it), rather than wait for the worker's next
        request or a dispatch round to find out. Not waited for, as in ``_offer``."""
        conn = self.connections.get(session_id)
        if conn is not None and conn.epoch < epoch and not conn.closed:
            conn.send_nowait(conn.close(4409, str(Code.FENCED_EPOCH), drop_pushes=True))

    def close_revoked(self, token_ids: Collection[str]) -> int:
        """Close each connection opened with one of these (revoked) tokens: 4401, reason
        ``UNAUTHENTICATED``, as a refused upgrade would be closed. Not waited for, as in
        ``close_fenced``. How many it closed. The ids are remembered, for a connection
        whose upgrade checked the token before the revoke and that attaches after it."""
        if len(self.revoked) > MAX_REVOKED_KEPT:  # the re-check catches the rest
            self.revoked.clear()
        self.revoked.update(token_ids)
        closing = [c for c in self.connections.values() if c.token_id in token_ids and not c.closed]
        for conn in closing:
            self._close_revoked(conn)
        return len(closing)

    def refuse_revoked(self, conn: WorkerConnection) -> None:
        """Close ``conn``, just attached, if its token was revoked since its upgrade
        checked it: the revoke's sweep (``close_revoked``) ran before it was attached.
        Called with no await since ``attach``, so a revoke heard later sweeps it."""
        if conn.token_id is not None and conn.token_id in self.revoked and not conn.closed:
            self._close_revoked(conn)

    def _close_revoked(self, conn: WorkerConnection) -> None:
        """Close ``conn`` with 4401 (not waited for), then release what its session had
        claimed and not started (``release_revoked``), in a task of its own: a close
        that waits for a worker that does not read must not hold the tasks back. The
        close marks the connection closed at once, so nothing more is offered to it."""
        conn.send_nowait(conn.close(4401, "UNAUTHENTICATED"))
        task = asyncio.create_task(release_revoked(self.store, conn.session_id, conn.epoch))
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)
        # Its session may have resumed here meanwhile, and been found full by what this
        # releases.
        task.add_done_callback(lambda _: self.session_slots_freed(conn.session_id))

    def token_ids(self) -> set[str]:
        """The tokens the open connections on this node were opened with."""
        return {
            c.token_id for c in self.connections.values() if c.token_id is not None and not c.closed
        }

    def attach(self, conn: WorkerConnection) -> WorkerConnection | None:
        """Make ``conn`` its session's connection on this node; return the connection it
        supersedes, which the caller closes: the previous one, or ``conn`` itself when the
        previous one holds a newer epoch. Two resumes of one session can cross: the one
        that committed first (the older epoch) may reach here last, and must not push out
        the session's current connection for one the store already fences."""
        previous = self.connections.get(conn.session_id)
        if previous is not None and previous.epoch > conn.epoch:
            return conn
        self.connections[conn.session_id] = conn
        self._wake.set()
        return previous

    def detach(self, conn: WorkerConnection) -> None:
        if self.connections.get(conn.session_id) is conn:
            del self.connections[conn.session_id]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        poll_due = loop.time() + self.poll_interval
        while True:
            timeout = max(poll_due - loop.time(), 0.0)
            if self._token_due is not None:
                timeout = min(timeout, max(self._token_due - loop.time(), 0.0))
            # asyncio.timeout, not wait_for: wait_for runs the wait as a task of its own,
            # one more turn of the event loop between a submit's commit and its claim.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            self._token_due = None  # this round's claims say again if one is still short
            if loop.time() >= poll_due:
                # The poll round, however busy the node (wakes never let the wait time
                # out): offered again are full sessions too, whose slots something this
                # node cannot see freed (another node's reaper expiring a lease, a claimed
                # task cancelled): a missed free costs at most the poll interval.
                poll_due = loop.time() + self.poll_interval
                self._clear_full_marks()
            try:
                await self.offer_all()
            except Exception:
                # A bug in a round must not end dispatch for the node's life (this task
                # would die unseen, and every later task wait for another node or a
                # restart): say so, and run another round after a pause.
                log.exception("dispatch round failed")
                await asyncio.sleep(ROUND_RETRY_S)
                self._wake.set()

    async def offer_all(self) -> None:
        """One round: a claim for each attached connection that takes pushed tasks,
        except those a claim earlier in the round showed to have nothing to find. A claim
        that was not held back (``Grants.blocked``: by a cap, a rate, its slots, or the
        size of one claim) took every ready task of its session's handlers, so a session
        whose handlers are among them would claim nothing: with ten idle workers, a
        submit used to cost ten claims, nine of them empty and each holding the claim
        lock in turn. A claim held back only by what every session shares (a queue's, a
        tenant's or the global cap, a rate) that granted nothing skips them as well: the
        same limits hold back a claim for them. A task that becomes ready during the
        round wakes another round.

        A connection whose session had no free slot at its last claim (``full``) is
        skipped until something frees one (``slots_freed``) or a poll round: with every
        worker busy, each submit used to cost a claim per connected worker.

        Each round starts one connection further on than the last: started at the first
        attached every time, its claim took every ready task, so under a light load the
        oldest worker ran nearly everything (10,343 attempts against 299 in a 35-minute
        soak with two idle workers) and the others sat idle."""
        exhausted: list[frozenset[str]] = []  # handler sets with nothing left ready
        conns = list(self.connections.values())
        if conns:
            first = self.rounds % len(conns)
            conns = conns[first:] + conns[:first]
        self.rounds += 1
        self.round_claims = self.round_skips = 0
        for conn in conns:
            # A connection with a push still waiting for its socket is offered nothing
            # more: its worker is not reading. When the push goes out (or fails), the
            # dispatcher is woken to offer again.
            if not conn.push or conn.closed or conn.backlog or conn.full:
                continue
            if any(conn.handlers <= h for h in exhausted):
                continue
            if await self._offer(conn):
                exhausted.append(conn.handlers)
        # "Run again" once a whole round's claims went through, not after any one of
        # them: with some claims of a round skipped, the warning and the "run again"
        # alternated at every claim, the churn the warning once a reason is there to end.
        if self.round_claims and not self.round_skips:
            self.skips.ran()

    async def claim(self, session_id: str, epoch: int, n: int) -> Grants:
        """``Store.attempt_claim_many`` on a store thread, timed and counted as the
        worker protocol's claim (``orbit_worker_transaction_*``, ``orbit_claims_total``):
        the one way this node claims for a worker, pushed or asked."""
        with self.metrics.worker_call("claim") as call:
            grants = await in_thread(self.store.attempt_claim_many, session_id, epoch, n)
            call.items = len(grants)
        self.metrics.claims.inc(len(grants))
        return grants

    async def _offer(self, conn: WorkerConnection) -> bool:
        """Claim for ``conn`` and push what it got; whether the claim took every ready
        task of its handlers (see ``offer_all``)."""
        # A session may declare more slots than one claim may grant: offer at most a
        # claim's worth (the claim itself grants no more than the session's free slots),
        # and offer again at once when that filled (below).
        n = min(conn.max_concurrency, self.store.config.max_batch)
        frees, freed = self.frees, conn.freed
        try:
            grants = await self.claim(conn.session_id, conn.epoch, n)
        except Rejected as exc:
            if exc.code == Code.SESSION_DRAINING:
                conn.push = False  # drained from elsewhere (the HTTP API): stop offering
                if not conn.draining:
                    # Drained by an operator, and the push that says so never came here
                    # (a NOTIFY sent while this node's LISTEN connection was away)
                    self.push_drain(conn.session_id)
            elif exc.code in (Code.FENCED_EPOCH, Code.SESSION_EXPIRED):
                # Superseded by a resume, or lapsed: the worker must resume on a new
                # connection, so close this one and stop offering to it. Not waited for:
                # the close frame waits behind anything the socket has not taken yet.
                fenced = exc.code == Code.FENCED_EPOCH
                conn.send_nowait(conn.close(4409, str(exc.code), drop_pushes=fenced))
            return False
        except DatabaseUnavailable as exc:  # the database's state, which the store logged
            self.skips.skipped(exc)  # a warning once, not a traceback each time
            self.round_skips += 1
            return False
        except Exception:  # a bug must not stop dispatch either
            log.exception("dispatch failed")
            return False
        self.round_claims += 1
        conn.blocked = grants.blocked
        # Not full if its worker reported an attempt ended while the claim was in flight:
        # the claim may have counted that slot as taken, and the report's wake has gone.
        conn.full = grants.full and conn.freed == freed and self.frees == frees
        if grants.token_wait_us is not None:
            due = asyncio.get_running_loop().time() + grants.token_wait_us / 1e6 + TOKEN_MARGIN_S
            if self._token_due is None or due < self._token_due:
                self._token_due = due
        if grants.blocked and (self.frees != frees or conn.freed != freed):
            # A permit was freed while this claim was in flight, and its wake was judged
            # by the worker's last claim, which may not have been blocked: the claim may
            # have counted the permit as taken, so claim again rather than lose the wake.
            self._wake.set()
        if grants:
            conn.push_nowait(self.store, grants, then=partial(self._pushed, conn))
        if grants.more or len(grants) == n < conn.max_concurrency:
            # a claim's worth of tasks or of payload bytes, and maybe slots to spare:
            # offer again now (a session with none left gets an empty claim)
            self._wake.set()
        # Held back only by shared limits, and nothing granted: a claim for a session of
        # the same handlers would be held back by the same (see offer_all).
        return not grants.blocked or not (grants or grants.own)

    def _pushed(self, conn: WorkerConnection) -> None:
        """A push that waited for ``conn``'s socket is done: offer again. If the
        connection closed, what it held was released (``send_tasks``): its session's
        slots, should it have resumed here since."""
        if conn.closed:
            self.session_slots_freed(conn.session_id)
        self._wake.set()


def _req_id(raw: Any) -> str | None:
    if isinstance(raw, dict):
        rid = raw.get("req_id")
        if isinstance(rid, str) and 0 < len(rid) <= 64:
            return rid
    return None


class _Protocol:
    """Decoding and answering one connection's messages."""

    def __init__(
        self,
        ws: WebSocket,
        store: Store,
        dispatcher: Dispatcher,
        node_id: str,
        token_id: str | None,
    ) -> None:
        self.ws = ws
        self.token_id = token_id
        self.store = store
        self.dispatcher = dispatcher
        self.node_id = node_id
        self.session_ttl = store.config.session_ttl_us / 1_000_000
        self.heartbeat_interval = store.config.session_ttl_us / 3_000_000
        self.conn: WorkerConnection | None = None
        #: when (event loop time) a request on this connection last pushed its session's
        #: expiry forward (``hello``, ``resume``, ``heartbeat``, ``renew``), read before
        #: the store call: the session lapses no sooner than a session TTL after it
        #: (``_close_when_lapsed``)
        self.refreshed = 0.0
        #: the session was resumed (not opened) by this connection's handshake
        self.resumed = False
        #: the session it resumed was already draining
        self.draining = False

    async def error(
        self, req_id: str | None, code: str, message: str, field: str | None = None
    ) -> None:
        msg = ErrorMessage(req_id=req_id, code=code, message=message, field=field)
        if self.conn is not None:
            await self.conn.send(msg)
        else:
            await self.ws.send_text(msg.model_dump_json())

    async def receive(self) -> Request:
        """The next well-formed request, answering malformed ones with an error."""
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            text = message.get("text")
            try:
                return read_request(message.get("bytes") or b"" if text is None else text)
            except Refused as exc:
                await self.error(exc.req_id, exc.code, exc.message, exc.field)

    def _open(self, msg: Hello) -> tuple[Session, str]:
        return self.store.session_open(
            name=msg.name,
            node_id=self.node_id,
            capabilities=[Capability(c.handler, c.capacity) for c in msg.capabilities],
            max_concurrency=msg.max_concurrency,
        )

    async def handshake(self) -> WorkerConnection | None:
        """The connection's session, once a ``hello`` or ``resume`` is welcomed; None if
        none was within a session TTL of the upgrade. Such a connection (silent, or
        sending only frames that are refused) is closed with ``HELLO_TIMEOUT_CLOSE``:
        it held a socket and this task for as long as its peer kept it open. Only the
        waits for frames count against the deadline, with the errors that answer them;
        a ``hello`` or ``resume`` read in time is answered, however long the store
        takes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.session_ttl
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    msg = await self.receive()
            except TimeoutError:
                with contextlib.suppress(Exception):  # it may be gone
                    await self.ws.close(code=HELLO_TIMEOUT_CLOSE, reason=HELLO_TIMEOUT)
                return None
            self.refreshed = loop.time()
            try:
                if isinstance(msg, Hello):
                    session, secret = await in_thread(self._open, msg)
                    welcome = Welcome(
                        req_id=msg.req_id,
                        session_id=session.id,
                        epoch=str(session.epoch),
                        resume_secret=secret,
                        heartbeat_interval=self.heartbeat_interval,
                    )
                    push = msg.push
                elif isinstance(msg, Resume):
                    session = await in_thread(
                        partial(self.store.session_resume, node_id=self.node_id),
                        msg.session_id,
                        msg.secret,
                    )
                    welcome = Welcome(
                        req_id=msg.req_id,
                        session_id=session.id,
                        epoch=str(session.epoch),
                        resume_secret=None,
                        heartbeat_interval=self.heartbeat_interval,
                    )
                    push = msg.push
                    self.resumed = True
                    self.draining = session.draining
                else:
                    await self.error(
                        getattr(msg, "req_id", None), "HELLO_FIRST", "send hello or resume first"
                    )
                    continue
            except OrbitError as exc:
                await self.error(getattr(msg, "req_id", None), str(exc.code), exc.message)
                continue
            except DatabaseUnavailable as exc:  # the store said so: its code, no traceback
                await self.error(getattr(msg, "req_id", None), exc.code, exc.message)
                continue
            except Exception:
                log.exception("handshake failed")
                await self.error(
                    getattr(msg, "req_id", None),
                    "INTERNAL",
                    "the server could not process this request",
                )
                continue
            await self.ws.send_text(welcome.model_dump_json())
            conn = WorkerConnection(self.ws, session, push, self.token_id)
            superseded = self.dispatcher.attach(conn)
            if superseded is not None:
                # Not waited for: the old connection's worker may no longer read it.
                # Its pushes are dropped as a fence's, unless a revoke closed it first:
                # then the revoke's release has them (``close``).
                superseded.send_nowait(
                    superseded.close(
                        4409, "session resumed elsewhere", drop_pushes=not superseded.closed
                    )
                )
            self.dispatcher.refuse_revoked(conn)
            return conn

    async def serve(self) -> None:
        self.conn = await self.handshake()
        if self.conn is None:
            return
        slots = asyncio.Semaphore(MAX_REPORTS_IN_FLIGHT)
        in_flight: set[asyncio.Task[None]] = set()
        lapse_watch = asyncio.create_task(self._close_when_lapsed(self.conn))

        async def report(msg: Request) -> None:
            try:
                await self.handle(msg)
            finally:
                slots.release()

        try:
            if self.resumed:
                await self._push_missed_cancels(self.conn)
                if self.draining:
                    # Drained while no connection held it (an operator's drain while the
                    # worker reconnected): said after the welcome, as missed cancels are.
                    self.dispatcher.push_drain(self.conn.session_id)
            while not self.conn.closed:
                msg = await self.receive()
                if self.conn.closed and isinstance(msg, OPENING_WORK):
                    # Closed while the frame waited to be read (its token revoked, its
                    # session resumed elsewhere): a start or claim is not acted on. A
                    # start read after a revoke's close ran beside the release of the
                    # session's claims and could start an attempt nobody would run (its
                    # reply unread), leaving a task that never ran to its lease and then
                    # to needs_review. Other reports are still taken: a finish carries a
                    # result, and the store fences what a resume superseded.
                    continue
                if isinstance(msg, CONCURRENT_REPORTS):
                    await slots.acquire()
                    task = asyncio.create_task(report(msg))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    continue
                if in_flight:  # anything else is handled after the reports before it
                    await asyncio.gather(*in_flight, return_exceptions=True)
                await self.handle(msg)
        finally:
            # Closed first, so that a claim the dispatcher has in flight for this
            # connection, or makes before the detach, is released rather than sent.
            self.conn.closed = True
            lapse_watch.cancel()
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            self.dispatcher.detach(self.conn)

    async def _close_when_lapsed(self, conn: WorkerConnection) -> None:
        """Close ``conn`` with 4409 once its session has lapsed (the reaper marked it
        ``expired``) or was resumed elsewhere: its worker must resume on a new
        connection. The dispatcher finds this out for a connection it pushes to, when
        its claim is refused; one it does not push to (``push: false``, or drained) kept
        its socket open for as long as its peer did. The session is read only when no
        request on this connection has pushed its expiry forward for a session TTL
        (``refreshed``), so a worker that heartbeats or renews costs no read."""
        loop = asyncio.get_running_loop()
        while not conn.closed:
            due = self.refreshed + self.session_ttl
            if loop.time() < due:
                await asyncio.sleep(due - loop.time())
                continue
            try:
                session = await in_thread(self.store.session_get, conn.session_id)
            except DatabaseUnavailable:  # said by the reaper and requests too: read again
                pass
            except Exception as exc:  # read again below
                log.warning("reading session %s failed (%s)", conn.session_id, type(exc).__name__)
            else:
                if conn.closed:
                    return
                if session.epoch != conn.epoch:  # the node missed the resume's notice
                    conn.send_nowait(conn.close(4409, str(Code.FENCED_EPOCH), drop_pushes=True))
                    return
                if session.state != SessionState.LIVE:
                    conn.send_nowait(conn.close(4409, str(Code.SESSION_EXPIRED)))
                    return
            await asyncio.sleep(self.session_ttl * EXPIRY_RECHECK_FRACTION)

    async def _push_missed_cancels(self, conn: WorkerConnection) -> None:
        """Push ``cancel`` for the session's running attempts whose task is `cancelling`,
        once a resume has attached it here: a cancel committed while no connection held
        the session (the worker reconnecting, a node restarting) was pushed to no one, and
        the worker heard of it only at its next renew, up to half a lease later. Read
        after the attach, so a cancel committed since is pushed by its own notice (a
        cancel may come twice: a repeat is a no-op)."""
        if conn.closed:
            return
        try:
            pairs = await in_thread(self.store.attempt_cancelling_for_sessions, [conn.session_id])
        except Exception as exc:  # the next renew still says `cancel`
            log.warning("re-checking cancels after a resume failed (%s)", type(exc).__name__)
            return
        if pairs and not conn.closed:
            self.dispatcher.push_cancel(pairs)

    async def _close_if_fenced(self, answers: Sequence[object]) -> None:
        """A batch answered FENCED_EPOCH came from a superseded connection: close it, as a
        single report's FENCED_EPOCH does (the worker must resume elsewhere)."""
        if any_fenced(answers):
            assert self.conn is not None
            await self.conn.close(4409, "session resumed elsewhere")

    async def handle(self, msg: Request) -> None:
        conn = self.conn
        assert conn is not None
        sid, epoch = conn.session_id, conn.epoch
        rid: str = getattr(msg, "req_id", "")
        store = self.store
        metrics = self.dispatcher.metrics
        try:
            if isinstance(msg, Claim):
                grants = await self.dispatcher.claim(sid, epoch, msg.n)
                await conn.send_tasks(store, rid, grants)
            elif isinstance(msg, Start):
                with metrics.worker_call("start", 1):
                    lease = await in_thread(
                        store.attempt_start, sid, epoch, msg.attempt_id, int(msg.fence)
                    )
                metrics.starts.inc()
                await conn.send({"type": "started", "req_id": rid, "lease": lease_wire(lease)})
            elif isinstance(msg, StartBatch | StartMany):
                starts = (msg if isinstance(msg, StartBatch) else start_batch(msg)).items
                with metrics.worker_call("start", len(starts)):
                    answers = await in_thread(store.attempt_start_many, sid, epoch, starts)
                if any_refused(answers):  # ended meanwhile (cancelled while claimed, reaped)
                    self.dispatcher.slots_freed(conn)
                await conn.send(started_many_wire(rid, starts, answers, metrics))
                await self._close_if_fenced(answers)
            elif isinstance(msg, FinishBatch | FinishMany):
                finishes = (msg if isinstance(msg, FinishBatch) else finish_batch(msg)).items
                with metrics.worker_call("finish", len(finishes)):
                    receipts = await in_thread(store.attempt_finish_many, sid, epoch, finishes)
                self.dispatcher.slots_freed(conn)
                await conn.send(finished_many_wire(rid, finishes, receipts, metrics))
                await self._close_if_fenced(receipts)
            elif isinstance(msg, Renew):
                asked = asyncio.get_running_loop().time()
                with metrics.worker_call("renew", len(msg.attempt_ids)):
                    leases = await in_thread(
                        store.lease_renew_many, sid, epoch, list(msg.attempt_ids)
                    )
                if any(x.status != "lost" for x in leases):  # the session was live: kept so
                    self.refreshed = max(self.refreshed, asked)
                if any(x.status == "lost" for x in leases):  # ended meanwhile (reaped)
                    self.dispatcher.slots_freed(conn)
                renewed = [lease_wire(x) for x in leases]
                await conn.send({"type": "renewed", "req_id": rid, "leases": renewed})
            elif isinstance(msg, Finish):
                outcome = outcome_of(msg)
                with metrics.worker_call("finish", 1):
                    done = await in_thread(
                        store.attempt_finish, sid, epoch, msg.attempt_id, int(msg.fence), outcome
                    )
                self.dispatcher.slots_freed(conn)
                metrics.finishes.labels(str(done.task_state)).inc()
                await conn.send({"type": "finished", "req_id": rid, "receipt": receipt_wire(done)})
            elif isinstance(msg, Release):
                with metrics.worker_call("release", 1):
                    await in_thread(
                        store.attempt_release, sid, epoch, msg.attempt_id, int(msg.fence)
                    )
                self.dispatcher.slots_freed(conn)
                await conn.send(AckMessage(req_id=rid, op="release"))
            elif isinstance(msg, CapacityUpdate):
                caps = [Capability(c.handler, c.capacity) for c in msg.capabilities]
                session = await in_thread(
                    lambda: store.session_capacity_set(
                        sid,
                        epoch,
                        seq=int(msg.seq),
                        capabilities=caps,
                        max_concurrency=msg.max_concurrency,
                    )
                )
                # The dispatcher's rounds skip a worker by its handlers (offer_all): judged
                # by those it said at hello, one given a new handler here was skipped after
                # any empty claim for its old ones, and the new handler's tasks waited.
                conn.max_concurrency = session.max_concurrency
                conn.handlers = handlers_of(session)
                self.dispatcher.slots_freed(conn)
                await conn.send(AckMessage(req_id=rid, op="capacity"))
                self.dispatcher.wake_threadsafe()
            elif isinstance(msg, Drain):
                conn.draining = True  # its own: no drain is pushed back to it
                await in_thread(store.session_drain, sid, epoch)
                conn.push = False
                await conn.send(AckMessage(req_id=rid, op="drain"))
            elif isinstance(msg, Progress):
                await in_thread(
                    partial(store.attempt_progress, fraction=msg.fraction, message=msg.message),
                    sid,
                    epoch,
                    msg.attempt_id,
                    int(msg.fence),
                )
                await conn.send(AckMessage(req_id=rid, op="progress"))
            elif isinstance(msg, Heartbeat):
                asked = asyncio.get_running_loop().time()
                await in_thread(store.session_heartbeat, sid, epoch)
                self.refreshed = max(self.refreshed, asked)
                await conn.send(AckMessage(req_id=rid, op="heartbeat"))
            else:
                await self.error(rid, "ALREADY_WELCOMED", "the session is already established")
        except Exception as exc:
            # A refused report may say its attempt ended meanwhile (cancelled while
            # claimed, reaped), and a failed one may yet have committed: either may have
            # freed a slot. Rare, and a claim too many is all it can cost.
            self.dispatcher.slots_freed(conn)
            if isinstance(exc, DatabaseUnavailable):
                # The database's state, which the store logged: its code (the worker
                # sends a finish so answered again), not INTERNAL and a traceback
                await self.error(rid, exc.code, exc.message)
                return
            if not isinstance(exc, OrbitError):
                log.exception("worker request failed")
                await self.error(rid, "INTERNAL", "the server could not process this request")
                return
            metrics.report_refused(exc)
            if exc.code == Code.FENCED_EPOCH:
                await self.error(rid, str(exc.code), exc.message)
                await conn.close(4409, "session resumed elsewhere")
                return
            await self.error(rid, str(exc.code), exc.message, exc.field)


def any_refused(answers: Sequence[object]) -> bool:
    """Whether a batch's answers hold a refusal, found as ``any_fenced`` finds one."""
    return any(issubclass(kind, OrbitError) for kind in set(map(type, answers)))


def any_fenced(answers: Sequence[object]) -> bool:
    """Whether a batch's answers hold a FENCED_EPOCH refusal. The answers' types are
    gathered in C first, so a batch with no refusal at all (nearly every one) is not
    walked item by item in Python."""
    if not any_refused(answers):
        return False
    return any(isinstance(a, OrbitError) and a.code == Code.FENCED_EPOCH for a in answers)


def _item_error(exc: OrbitError, metrics: Metrics) -> dict[str, str]:
    """One refused item of a batch as the wire's ``ItemError``."""
    metrics.report_refused(exc)
    return {"code": str(exc.code), "message": exc.message}


def tasks_frame(req_id: str | None, grants: Sequence[Grant]) -> str:
    """``TasksMessage``'s text frame: claimed attempts, pushed (no req_id) or answered.
    Written by orjson alone, never ``compact_json``'s fallback: each payload is a
    fragment of stored JSON (``assignments_wire``), and every other value is a string, a
    bool, None, a float or an integer within 64 bits."""
    tasks = assignments_wire(grants)
    return orjson.dumps({"type": "tasks", "req_id": req_id, "tasks": tasks}).decode("utf-8")


def started_many_wire(
    rid: str,
    starts: Sequence[tuple[str, int]],
    answers: Sequence[Lease | OrbitError],
    metrics: Metrics,
) -> dict[str, Any]:
    """The answer to a ``start_many`` as the wire's ``StartedManyMessage``; counts the
    starts and refusals.

    Each lease is spelled as ``lease_wire`` spells it, in this loop rather than a call
    each, and the leases of one batch share their expiry (the start's clock plus the
    lease), so it is formatted (looked up in the formatter's cache) once, not per item."""
    started: list[dict[str, Any]] = []
    append = started.append
    refused = 0
    expires_us: int | None = None
    expires: str | None = None
    for (a, _), r in zip(starts, answers, strict=True):
        if isinstance(r, OrbitError):
            refused += 1
            append({"attempt_id": a, "lease": None, "error": _item_error(r, metrics)})
            continue
        at, left = r.lease_expires_at, r.lease_left_us
        if at != expires_us:
            expires_us, expires = at, None if at is None else instant_text(at)
        lease = {
            "attempt_id": r.attempt_id,
            "status": r.status,
            "lease_expires_at": expires,
            "lease_left": None if left is None else left / 1e6,
        }
        append({"attempt_id": a, "lease": lease, "error": None})
    metrics.starts.inc(len(started) - refused)
    return {"type": "started_many", "req_id": rid, "results": started}


def finished_many_wire(
    rid: str,
    finishes: Sequence[tuple[str, int, Outcome]],
    receipts: Sequence[Receipt | OrbitError],
    metrics: Metrics,
) -> dict[str, Any]:
    """The answer to a ``finish_many`` as the wire's ``FinishedManyMessage``; counts the
    finishes by task state, and the refusals."""
    finished: list[dict[str, Any]] = []
    append = finished.append
    states: list[str] = []
    for (a, _, _), r in zip(finishes, receipts, strict=True):
        if isinstance(r, OrbitError):
            append({"attempt_id": a, "receipt": None, "error": _item_error(r, metrics)})
        else:
            states.append(r.task_state)
            append({"attempt_id": a, "receipt": receipt_wire(r), "error": None})
    # counted in C once the loop is done, each state by its str's hash (an Enum's hash is
    # Python's); one labelled inc per state, not per item
    for state, count in Counter(map(str, states)).items():
        metrics.finishes.labels(state).inc(count)
    return {"type": "finished_many", "req_id": rid, "results": finished}


class Refused(Exception):
    """A worker's frame that is not a well-formed request: the ``error`` it is answered
    with (its ``req_id``, when one could be read)."""

    def __init__(self, req_id: str | None, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}")
        self.req_id = req_id
        self.code = code
        self.message = message
        self.field = field


def read_request(frame: str | bytes) -> Request:
    """A worker's frame (a text frame's ``str``, a binary one's ``bytes``) as its request:
    a batch of reports in its usual shape read at once (reports.py), anything else
    decoded strictly; ``Refused`` with the rule it broke if it is not well formed."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise Refused(None, "MESSAGE_TOO_LARGE", "the message is too large")
    try:
        raw = decode_json(frame)
    except DecodeError as exc:
        raise Refused(None, exc.code, exc.message, exc.field) from None
    rid = _req_id(raw)
    if not isinstance(raw, dict):
        raise Refused(None, "INVALID_TYPE", "the message must be a JSON object")
    kind = raw.get("type")
    model = WORKER_REQUESTS.get(kind) if isinstance(kind, str) else None
    if "type" not in raw and any(k.lower() == "type" for k in raw):
        raise Refused(rid, "FIELD_CASE_MISMATCH", "type must be spelled type", "type")
    if model is None:
        raise Refused(rid, "UNKNOWN_TYPE", f"unknown message type {kind!r:.40}", "type")
    reader = READERS.get(kind) if isinstance(kind, str) else None
    if reader is not None:  # a batch of reports in its usual shape: read at once
        batch = reader(raw)
        if batch is not None:
            return batch
    try:
        return decode_model(model, raw, parsed=True)
    except DecodeError as exc:
        raise Refused(rid, exc.code, exc.message, exc.field) from None


async def worker_endpoint(ws: WebSocket) -> None:
    app = ws.app
    try:
        # One read a connect: a revoke no notice told this node of takes effect for new
        # connections at once, and for open ones at the next re-check (revocation.py).
        await app.state.tokens.require(ws.headers, "worker", fresh=True)
    except ApiError as exc:  # refuse the upgrade: 401/403 before any frame
        await refuse_upgrade(ws, exc)  # (4401 or 4403 without the denial extension)
        return
    except DatabaseUnavailable as exc:
        # The database's state (its lock held past the store's wait, out of reach), which
        # the store logged: 503 with its code and Retry-After, as an HTTP route answers
        # it (errors.on_unexpected), and a line when that starts (RefusedConnects). It
        # was a 500 INTERNAL and an ERROR with a traceback at every try of every worker.
        app.state.dispatcher.refused_connects.skipped(exc)
        retry = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}
        await refuse_upgrade(ws, ApiError(503, exc.code, exc.message, headers=retry))
        return
    except Exception:
        # The check itself failed otherwise (a bug, a database error the store does not
        # read as one of its conditions): that says nothing about the token. Refusing it
        # as bad credentials would make a worker give up as if its token were wrong;
        # answer 500 INTERNAL, which it retries.
        log.exception("worker token check failed")
        internal = ApiError(500, "INTERNAL", "the server could not process this request")
        await refuse_upgrade(ws, internal)
        return
    app.state.dispatcher.refused_connects.ran()
    await ws.accept()
    protocol = _Protocol(
        ws,
        app.state.store,
        app.state.dispatcher,
        app.state.settings.node_id,
        bearer_token_id(ws.headers),
    )
    with contextlib.suppress(WebSocketDisconnect):
        await protocol.serve()
    if ws.client_state == WebSocketState.CONNECTED:
        with contextlib.suppress(Exception):
            await ws.close()
