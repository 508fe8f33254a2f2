"""The Store: every lifecycle operation as one transaction over any driver.

Each operation follows the same pipeline: lock the rows it judges (in a fixed order:
claim lock, tasks by id, attempts, queues, sessions), read the clock, let
``orbit.core.transitions`` decide, then apply the resulting plan with compare-and-set
writes and append its events, all before commit. A write whose guard matches no row
aborts the transaction (``StaleWrite``) instead of succeeding silently.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import random
import secrets
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial
from typing import Any, Final, NamedTuple, TypeVar
from zoneinfo import ZoneInfo

from orbit.core import transitions
from orbit.core.batches import LazyBatch
from orbit.core.cron import check_timezone, latest, next_after, stored_zone
from orbit.core.errors import Backpressure, Code, OrbitError, Rejected
from orbit.core.ids import random8, uuid7, uuid7_many
from orbit.core.limits import (
    Occupancy,
    bucket_refill,
    bucket_stamped_ahead,
    caps_raised,
    queue_with_caps,
    room_for_all,
    token_wait_us,
)
from orbit.core.model import (
    SECOND,
    Artifact,
    Attempt,
    Capability,
    Event,
    Grant,
    Lease,
    Outcome,
    Queue,
    Receipt,
    Schedule,
    Session,
    Task,
    TaskSpec,
    Token,
    assemble,
    evolve,
)
from orbit.core.states import LIVE_ATTEMPT_STATES, SessionState, TaskState
from orbit.core.transitions import Plan
from orbit.core.validate import (
    DEFAULT_MAX_CATCH_UP,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_ATTEMPT_NUMBER,
    MAX_DURATION_US,
    MAX_GLOBAL_CAP,
    MAX_TENANT_CAP,
    MISFIRE_GRACE_US,
    check_deadline,
    check_int,
    check_json_depth,
    check_max_queued,
    check_name,
    check_payload,
    check_queue_cap_values,
    check_queue_caps,
    check_result_size,
    check_schedule,
    check_spec,
    content_type_problem,
)
from orbit.store import rows as R
from orbit.store.driver import (
    DATABASE_BUSY,
    DATABASE_UNAVAILABLE,
    UNAVAILABLE_MESSAGES,
    Connection,
    DatabaseUnavailable,
    Driver,
    Notice,
    Row,
    RowColumns,
    StaleWrite,
    Table,
    error_line,
    migration_files,
)
from orbit.tokens import token_id as parse_token_id

_log = logging.getLogger("orbit.store")
T = TypeVar("T")

#: What the server answers (503 ``DATABASE_UNAVAILABLE``) for a transaction whose
#: connection failed while its ``COMMIT`` was on its way (``CommitOutcomeUnknown``).
COMMIT_UNKNOWN_MESSAGE = (
    "the database's connection was lost while this change was being committed: it may "
    "have been committed; a resend must carry the same idempotency key (a submit sent "
    "again without one may make a second task)"
)


class CommitOutcomeUnknown(DatabaseUnavailable):
    """A transaction whose connection failed (``DATABASE_UNAVAILABLE``) while its
    ``COMMIT`` was sent: PostgreSQL may have committed it and its answer been lost with
    the connection (of three submits answered so while the node's backends were being
    terminated, two were in the database). The code stays ``DATABASE_UNAVAILABLE``, so
    that the worker sends a finish again as it does (a finish is idempotent by its
    fence); only the words differ: the plain code's did not say that anything may have
    been written, and a client took the 503 and its ``Retry-After`` as "nothing
    written" and submitted again, a second task."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.message = COMMIT_UNKNOWN_MESSAGE
        self.args = (self.message,)


Clock = Callable[[], int]


#: How long one pass of the schedule duty (``Store.schedule_fire_due``) works before it
#: hands back to the duty, which runs the next at once: a long catch-up does not hold
#: the duty's thread, which a stop of the server waits for, for minutes on end.
SCHEDULE_PASS_S = 1.0
#: The most dropped instants a ``schedule.skipped`` event counts (``Dropped.count``).
MAX_DROPPED_COUNT = 1000
#: How many lapsed sessions one transaction of the reaper expires. It holds the claim lock,
#: which every claim on every node waits for, so a mass lapse (a deploy, a lost pool of
#: hosts) is expired in short transactions, claims going on between them.
SESSION_EXPIRY_BATCH = 50
#: How far (µs) a transaction's clock may read behind the latest this store has read
#: before the clock is taken to have gone back (``_Tx._stamp``): beyond the few
#: microseconds two threads' readings race by, short of any step worth acting on.
CLOCK_STEP_US = SECOND


#: A batch submit larger than this goes to the database a chunk at a time, each chunk's
#: statement sent without waiting for the last (``Connection.write_stream``): PostgreSQL
#: inserts one chunk while this process makes the next. A batch this size or smaller is
#: one plain statement.
SUBMIT_CHUNK = 250
#: The first chunk of a streamed batch, and how much each next one may grow: the
#: database waits while the first is made, and a task takes this process about half
#: the time it takes PostgreSQL to insert it (with its event), so a chunk half again as
#: large as the one before is made while that one is written (``submit_chunks``).
SUBMIT_FIRST_CHUNK = 50
#: How long /readyz says not ready after a transaction gave up for the database's sake
#: (``Store.write_failure``: full, read-only or unavailable, not busy), unless a write
#: commits sooner: a node whose writes fail is taken out of a balancer's rotation, and
#: tried again after this with no probe writing.
WRITE_FAILURE_S = 10.0


class CallQueued(threading.local):
    """When the call running on this thread was queued for it (``time.monotonic()``):
    set by ``orbit.server.threads`` before each call it runs on its store threads; None
    on any other thread. ``Store._tx`` counts its wait (``StoreConfig.tx_wait_us``) from
    it, not from its own start: a request that waited for one of the node's threads
    behind others waiting for a lock held past its client's timeout waited its full
    wait after that, and committed after its client had given up."""

    at: float | None = None


#: The one ``CallQueued``: ``orbit.server.threads`` sets its ``at``, ``Store._tx`` reads it.
CALL_QUEUED = CallQueued()

#: How long a migration waits for the database (``Store._tx``'s ``wait_us``): for another
#: node's migration (the migration lock), and for the locks live traffic holds on the
#: tables a migration alters. No client waits for it, and a node starting beside another
#: that migrates a large table must wait for that node, not fail its start after the
#: 20 s a request waits (``StoreConfig.tx_wait_us``).
MIGRATE_WAIT_US = 3600 * SECOND
SUBMIT_CHUNK_GROWTH = 1.5

#: Read once: a member read through its enum class costs a lookup each time (60 ns), and
#: a batch submit asks once per task.
_QUEUED = TaskState.QUEUED


def submit_chunks(n: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each chunk of a streamed batch of ``n`` specs, in order:
    SUBMIT_FIRST_CHUNK, then each chunk SUBMIT_CHUNK_GROWTH times the one before."""
    bounds: list[tuple[int, int]] = []
    start, size = 0, SUBMIT_FIRST_CHUNK
    while start < n:
        end = min(start + size, n)
        bounds.append((start, end))
        start, size = end, int(size * SUBMIT_CHUNK_GROWTH)
    return bounds


def _same(value: T) -> T:
    return value


LIVE_TASK_STATES = frozenset({TaskState.CLAIMED, TaskState.RUNNING, TaskState.CANCELLING})
#: A member read through its enum class is a lookup in the class (60-190 ns), once per
#: task written in ``_Tx.apply``.
_QUEUED = TaskState.QUEUED


class InjectedFault(Exception):
    """Raised by a query armed with ``Store.inject_fault`` (atomicity tests)."""


class SchemaTooNew(Exception):
    """The database's schema is at a version above this Orbit's last migration: a newer
    Orbit migrated it. This one does not know what the newer columns and constraints
    mean, so it refuses to open the database rather than write rows that break them."""


def _check_schema(current: int, known: int) -> None:
    """Raise ``SchemaTooNew`` for a database at ``current``, past this Orbit's ``known``."""
    if current > known:
        raise SchemaTooNew(
            f"the database's schema is at version {current}, and this Orbit knows "
            f"versions up to {known}: run the Orbit that migrated it, or a newer one"
        )


class MigrationFailed(Exception):
    """A migration's statement failed (``DuplicateTable``: an object made by hand where
    the migration makes its own). The migrations of one run commit together, so none of
    them was applied: the message names the file that failed, the driver's error and
    the version the schema stays at. The driver's error is ``__cause__``."""

    def __init__(self, message: str, *, failed: str | None, version: int) -> None:
        super().__init__(message)
        #: the file whose statement failed; None when the commit of the run failed
        self.failed = failed
        #: the version the schema stays at
        self.version = version


@dataclass(frozen=True)
class SchemaStatus:
    """Where a database's schema stands against this Orbit's migrations."""

    #: the version in the database, 0 for none (not an Orbit database, or a new one)
    version: int
    #: this Orbit's last migration
    known: int
    #: the names of the migration files above ``version``, in the order they apply
    pending: tuple[str, ...]


@dataclass(frozen=True)
class Migrated:
    """What ``Store.schema_migrate`` did: the version before and after, and the names of
    the migration files it applied, in order (none when the schema was current)."""

    before: int
    after: int
    applied: tuple[str, ...]

    def describe(self) -> str:
        """One line for a person: ``schema at version 8, migrated from version 5:
        0006_x.sql, 0007_y.sql, 0008_z.sql``, or ``schema at version 8, up to date``."""
        if not self.applied:
            return f"schema at version {self.after}, up to date"
        files = ", ".join(self.applied)
        return f"schema at version {self.after}, migrated from version {self.before}: {files}"


def _migration_failed(exc: Exception, at: dict[str, Any]) -> MigrationFailed:
    """``MigrationFailed`` for ``exc``, raised while ``Store.schema_migrate`` applied ``at``'s
    file (None: at the commit) on a schema at ``at["before"]``. The driver's message is
    its first line (psycopg's next ones quote rows' values)."""
    reason = error_line(exc)
    before, failed = int(at["before"]), at.get("file")
    if failed is None:  # a commit that failed may yet have gone through: not said here
        return MigrationFailed(
            f"the commit of migrations {', '.join(at.get('applied', ()))} failed: {reason}; "
            f"the schema stays at version {before} unless the commit went through (orbit "
            "db status says)",
            failed=None,
            version=before,
        )
    return MigrationFailed(
        f"migration {failed} failed: {reason}; no migration was applied (a run's "
        f"migrations commit together), the schema stays at version {before}",
        failed=failed,
        version=before,
    )


class Grants(list[Grant]):
    """What a claim handed out, and whether anything held it back.

    ``blocked`` is true when the claim stopped at a capacity, a cap or a rate rather
    than at the end of the ready tasks: only then can a permit freed later let a new
    claim find more, so a dispatcher needs to claim again after a finish only if its
    last claim was blocked (an idle worker's finish would otherwise cost an empty claim).
    """

    blocked: bool = False
    #: What held it back was, at least once, the session's own: its ``max_concurrency``,
    #: a handler's capacity, or the size of one claim (``n``, CLAIM_PAYLOAD_BYTES, its
    #: rounds). Blocked and not ``own``, only what every session shares held it back (a
    #: queue's, a tenant's or the global cap, a rate): a claim for a session whose
    #: handlers are among this one's would be held back by the same, and find nothing.
    own: bool = False
    #: After this claim the session has no free slot: its ``max_concurrency`` is reached,
    #: or every handler of it is at its capacity. Until one of its own attempts ends (or
    #: its capacities change) a claim for it can find nothing, whatever becomes ready.
    full: bool = False
    #: The claim stopped with ready tasks left that a claim now may take (at
    #: CLAIM_PAYLOAD_BYTES, or at its last round): claim again now.
    more: bool = False
    #: A rate-limited queue held tasks back for want of a token (it was skipped, or ran
    #: out during the claim): microseconds until the soonest such queue has one again
    #: (``limits.token_wait_us``), else None. No commit announces a token's arrival, so a
    #: dispatcher must wake by itself then, or those tasks wait for some other event.
    token_wait_us: int | None = None


#: The most payload one claim hands out, in UTF-8 bytes (a claim always grants at least
#: one task, whatever its size). Its tasks travel to the worker in one WebSocket frame,
#: and the SDK's connection takes frames of up to 8 MiB: a thousand tasks of 16 KiB were
#: a 16 MB frame, which the worker refused by closing the connection, so the claim's
#: tasks waited out their claim lease and were pushed, and refused, again.
CLAIM_PAYLOAD_BYTES = 4 * 1024 * 1024


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


#: The most an upload leaves free on a SQLite database's file system by default
#: (``StoreConfig.artifact_disk_reserve_bytes``): room for the node's ordinary writes for
#: a while, and for the delete of an upload that was stopped.
DISK_RESERVE_BYTES = 64 * 1024 * 1024
#: How many chunks (256 KiB each) one transaction deletes of an artifact that goes on
#: SQLite (``Store._shed_chunks``): 2 MiB of the ``-wal`` at a time.
SHED_CHUNKS = 8


@dataclass(frozen=True)
class StoreConfig:
    """Lease lengths and bounds. Defaults suit a worker that renews every ~10 s."""

    claim_ttl_us: int = 30 * SECOND
    lease_ttl_us: int = 30 * SECOND
    session_ttl_us: int = 60 * SECOND
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_batch: int = 1000  # at most 2**20 (``orbit.core.ids.BATCH_INDEX_BITS``)
    reap_batch: int = 500
    max_tx_retries: int = 5
    #: About the longest a transaction and its retries wait for the database, counted
    #: from when the call was queued for a store thread (``CALL_QUEUED``): for a thread,
    #: for this process's connection (SQLite) or a pooled one (PostgreSQL), and for a
    #: lock another process holds (SQLite's write lock; on PostgreSQL each wait ends at
    #: the connection's ``lock_timeout``, 5 s unless set, and is tried again, so the last
    #: try may end up to one ``lock_timeout`` past it). Past it the transaction gives up
    #: (``DatabaseUnavailable``, 503 ``DATABASE_BUSY``), nothing written: under a
    #: client's default timeout (30 s), so the client hears why.
    tx_wait_us: int = 20 * SECOND
    artifact_ttl_us: int = 7 * 24 * 3600 * SECOND
    #: The longest an upload may stay unfinished: the reaper drops one older than this
    #: even while its attempt runs. An upload whose server was killed mid-body is never
    #: aborted, and its TTL counts only from its commit, so a long handler that renews
    #: its lease for weeks would otherwise keep its bytes (up to ``max_artifact_bytes``
    #: a name) that long.
    upload_max_us: int = 24 * 3600 * SECOND
    max_artifact_bytes: int = 256 * 1024 * 1024
    #: How long the reaper leaves an expired artifact's bytes in place. Every read
    #: treats it as gone from its ``expires_at`` (404, not listed), so no download
    #: starts after it; one that started before goes on reading chunk after chunk, each
    #: in its own transaction, and a delete under it cut the body short. Ten minutes
    #: read the largest artifact (``max_artifact_bytes``, 256 MiB) at about 440 KiB/s.
    artifact_grace_us: int = 10 * 60 * SECOND
    #: What an upload must leave free on the file system of a SQLite database (its file
    #: and its ``-wal``; the file's own free pages count as free), in bytes
    #: (``artifact_disk_room``): an upload that would leave less is refused before it
    #: writes, or stopped and dropped. A full disk refused
    #: every later write, the upload's own delete and the reaper's passes too. None:
    #: 64 MiB, or 5 % of the file system where that is less (a small disk). Not checked
    #: on PostgreSQL, whose disk is not the node's to see.
    artifact_disk_reserve_bytes: int | None = None
    #: how long ``event_list`` waits for older transactions to end (PostgreSQL)
    event_wait_us: int = 2 * SECOND


class Keep(Enum):
    """A cap argument's "leave it as it is", where None means "remove the cap"."""

    KEEP = "keep"


KEEP: Final = Keep.KEEP


@dataclass(frozen=True)
class Submitted:
    task: Task
    created: bool  # False when an idempotency key returned an existing task


@dataclass(frozen=True)
class ReapReport:
    released: int = 0
    expired_leases: int = 0
    deadlines: int = 0
    promoted: int = 0
    sessions_expired: int = 0
    artifacts_expired: int = 0
    #: unfinished uploads dropped because their attempt has ended
    uploads_dropped: int = 0

    @property
    def total(self) -> int:
        return (
            self.artifacts_expired
            + self.uploads_dropped
            + (
                self.released
                + self.expired_leases
                + self.deadlines
                + self.promoted
                + self.sessions_expired
            )
        )


TOKEN_SCOPES = frozenset({"admin", "submit", "worker"})


def _hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class Store:
    """Orbit's durable state. Thread-safe; every public method is one transaction."""

    def __init__(
        self,
        driver: Driver,
        config: StoreConfig | None = None,
        *,
        clock: Clock | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.driver = driver
        self.config = config or StoreConfig()
        self._clock = clock
        self._rand = rand
        #: the latest clock any of this store's transactions read (``_Tx._stamp``), and,
        #: once one read it more than CLOCK_STEP_US behind that (the clock went back),
        #: that latest reading: the reaper pulls back the ends granted before the step
        #: (``reap``'s ``pull_back_pass``) until the clock is back there, then sets it to 0
        self._clock_high = 0
        self._stepped_from = 0
        self._fault: str | None = None
        #: Called after a commit that made tasks ready, with their queues: the server wakes
        #: its dispatcher with it. On PostgreSQL the same transaction also sends NOTIFY
        #: orbit_ready, which wakes every other node.
        self.on_ready: Callable[[set[str]], None] | None = None
        #: Called after a commit that freed permits (an attempt ended), with the queues
        #: concerned. A freed permit matters only to a dispatcher whose last claim was held
        #: back by a cap (see :class:`Grants`); NOTIFY orbit_ready says ``freed`` for it.
        self.on_freed: Callable[[set[str]], None] | None = None
        #: Called after a commit that asked running attempts to stop, with
        #: ``(session_id, attempt_id)`` pairs (NOTIFY orbit_cancel on PostgreSQL).
        self.on_cancel: Callable[[list[tuple[str, str]]], None] | None = None
        #: Called after a commit that revoked tokens, with their ids: the server closes
        #: the worker connections opened with them (NOTIFY orbit_ready ``revoked`` tells
        #: the other nodes on PostgreSQL).
        self.on_revoked: Callable[[list[str]], None] | None = None
        #: Called after a commit that wrote events, with whether it also sent the other
        #: nodes a notice (NOTIFY on PostgreSQL; never on SQLite): the server wakes its
        #: event streams with it, and tells the other nodes' streams if no notice did.
        self.on_events: Callable[[bool], None] | None = None
        #: Prefixes this store's ``orbit_ready`` payloads (``<origin>:<kind>:<queue>``), so that
        #: the node owning it can ignore its own NOTIFY: ``on_ready`` already woke it, and
        #: a second wake would cost an empty claim transaction per commit.
        self.origin = uuid.uuid4().hex[:16]
        self._depth_gates = _DepthGates()
        #: The schedule duty's stretch of back-to-back work (``schedule_fire_due``).
        self._fire_stretch: _FireStretch | None = None

    # ------------------------------------------------------------------ plumbing

    @property
    def backend(self) -> str:
        return self.driver.name

    def close(self) -> None:
        self.driver.close()

    @contextmanager
    def inject_fault(self, query: str) -> Iterator[None]:
        """Make the named query raise ``InjectedFault`` while the block runs (tests)."""
        if query not in self.driver.queries:
            raise KeyError(query)
        self._fault = query
        try:
            yield
        finally:
            self._fault = None

    def _new_id(self, now: int) -> str:
        return uuid7(now, random8())

    def _new_ids(self, now: int, count: int, first: int) -> list[str]:
        """A batch submit's ids ``first`` to ``first + count - 1`` (one chunk's):
        ``uuid7_many``, so they sort in the batch's order."""
        return uuid7_many(now, count, first)

    #: When a transaction last gave up for the database's sake (``time.monotonic()``), and
    #: why (a ``DATABASE_*`` code); None again once a transaction that wrote commits.
    _write_failed: tuple[float, str] | None = None

    def write_failure(self, within_s: float = WRITE_FAILURE_S) -> tuple[str, str] | None:
        """Why writes fail, if a transaction gave up for the database's sake
        (``DatabaseUnavailable``: full, read-only, unavailable) in the last ``within_s``
        seconds and none that wrote has committed since: the code and its message
        (/readyz's answer). No read of the database: a failed write is noted as it
        happens, at no cost to the writes that succeed.

        Not ``DATABASE_BUSY``: a lock another session holds (a frozen node's on one
        queue's idempotency stripe, an operator's on a table) keeps the writes that need
        it waiting while others commit, and the database is shared, so every node meets
        the same lock: a node not ready for it took a healthy node out of a balancer's
        rotation, and with all of them out no node was left."""
        failed = self._write_failed
        if failed is None or time.monotonic() - failed[0] > within_s:
            return None
        return failed[1], UNAVAILABLE_MESSAGES[failed[1]]

    def _tx(
        self,
        work: Callable[[_Tx], T],
        *,
        durable: bool = True,
        wait_us: int | None = None,
        waiting: str | None = None,
    ) -> T:
        """Run ``work`` in one transaction, retrying on deadlocks, stale writes and lock
        waits that ran out. ``durable=False``: see ``Driver.transaction`` (only claims
        use it).

        The transaction and its retries wait for the database (this process's
        connection, a pooled one, its write lock) for about ``StoreConfig.tx_wait_us``
        in all, less than a client's default timeout (30 s): past it, or on a database
        that is full, read-only or out of reach (``Driver.unavailable_code``), it gives
        up with ``DatabaseUnavailable`` (the server's 503), logged once as a warning.
        A wait with no bound outlived its client, which was told the server was
        unreachable, and the transaction committed after all, a minute later.
        ``waiting``: what to log at INFO, once, when a lock wait first runs out and the
        transaction is tried again (a long wait that would otherwise say nothing).
        ``wait_us``: this transaction's wait in place of the config's (one no client
        waits for, such as a migration behind another node's).

        On one of the server's store threads (``orbit.server.threads``) the wait counts
        from when the call was queued for the thread (``CALL_QUEUED``), not from here: a
        call whose wait was over before a thread took it is refused at once
        (``DATABASE_BUSY``), nothing tried. Counted from here, a request queued behind
        the threads' own waits waited twice over, outlived its client, and committed."""
        attempt = 0
        wait_s = (self.config.tx_wait_us if wait_us is None else wait_us) / SECOND
        now = time.monotonic()
        queued = CALL_QUEUED.at
        if queued is None:
            deadline = now + wait_s
        else:
            deadline = queued + wait_s
            if deadline <= now:
                _log.warning(
                    "a transaction was not tried: its call waited %.1f s for a store "
                    "thread, past its wait (%g s): %s",
                    now - queued,
                    wait_s,
                    UNAVAILABLE_MESSAGES[DATABASE_BUSY],
                )
                raise DatabaseUnavailable(DATABASE_BUSY)
            wait_s = deadline - now
        while True:
            tried: _Tx | None = None  # this try's, once the driver began it
            try:
                with self.driver.transaction(durable=durable, wait_s=wait_s) as cx:
                    tried = tx = _Tx(cx, self)
                    result = work(tx)
                    tx.notify()  # whatever the plans' own writes did not already send
                    tx.committing = True  # the driver commits as the block ends
                if tx.ready and self.on_ready is not None:
                    self.on_ready(tx.ready)
                if tx.freed and self.on_freed is not None:
                    self.on_freed(tx.freed)
                if tx.cancels and self.on_cancel is not None:
                    self.on_cancel(tx.cancels)
                if tx.revoked and self.on_revoked is not None:
                    self.on_revoked(tx.revoked)
                if tx.wrote_events and self.on_events is not None:
                    self.on_events(bool(tx._sent))
                if self._write_failed is not None and tx.wrote_events:
                    self._write_failed = None  # writes go through again
                return result
            except StaleWrite:
                attempt += 1
                if attempt > self.config.max_tx_retries:
                    raise
            except Exception as exc:
                attempt += 1
                code = self.driver.unavailable_code(exc)
                wait_s = deadline - time.monotonic()
                # A lock wait that ran out is tried again for as long as the wait lasts,
                # however many tries that takes; any other retryable error (a deadlock)
                # at most max_tx_retries times.
                tries_left = code == DATABASE_BUSY or attempt <= self.config.max_tx_retries
                if self.driver.is_retryable(exc) and wait_s > 0 and tries_left:
                    if waiting is not None and code == DATABASE_BUSY:
                        _log.info("%s; trying again for up to %.0f s", waiting, wait_s)
                        waiting = None
                    continue
                if code is None:
                    raise
                committing = tried is not None and tried.committing
                raise self._gave_up(code, exc, attempt, committing=committing) from exc

    def _gave_up(
        self, code: str, exc: Exception, tries: int, *, committing: bool = False
    ) -> DatabaseUnavailable:
        """The error a transaction that gave up for the database's sake raises, noted
        for /readyz (``write_failure``) unless it is a lock's (``DATABASE_BUSY``: see
        there), and logged, once, with the driver's own words (which the client's answer
        leaves out).

        ``committing``: the failure came once the transaction's ``COMMIT`` was sent (with
        its final write, ``commit_with``, or as the driver's block ended). A connection
        that failed then (``DATABASE_UNAVAILABLE``) leaves the outcome unknown: the
        database may have committed and its answer been lost
        (``CommitOutcomeUnknown``). A full or read-only database, or a lock, answered the
        statement itself with its refusal, and nothing was committed. SQLite has no
        connection to lose (the database is this process's library); its own failure at
        ``COMMIT`` (an I/O error) is taken as unknown too: the commit's pages may have
        reached the file before the error."""
        if code != DATABASE_BUSY:
            self._write_failed = (time.monotonic(), code)
        if committing and code == DATABASE_UNAVAILABLE:
            failed: DatabaseUnavailable = CommitOutcomeUnknown(code)
        else:
            failed = DatabaseUnavailable(code)
        _log.warning(
            "a transaction gave up after %d %s: %s (%s)",
            tries,
            "try" if tries == 1 else "tries",
            failed.message,
            error_line(exc),
        )
        return failed

    def _read(self, query: str, /, **params: Any) -> list[Row]:
        """One read, its own transaction (``Driver.read``). One the database turns away
        (SQLite's connection held past ``busy_timeout`` by a transaction waiting for
        another process's write lock; a PostgreSQL pool with no connection free, the
        database out of reach) is ``DatabaseUnavailable``, the server's 503: it was a
        500 ``INTERNAL`` with a traceback. Not noted for /readyz: no write failed."""
        self._armed(query)
        try:
            return self.driver.read(query, params)
        except Exception as exc:
            code = self.driver.unavailable_code(exc)
            if code is None:
                raise
            raise DatabaseUnavailable(code) from exc

    def _armed(self, query: str) -> None:
        """Raise the failure ``inject_fault`` armed for this query, if any."""
        _fire(self._fault, query)

    def _run_plan(self, build: Callable[[_Tx], tuple[Plan, T]], *, durable: bool = True) -> T:
        """Build a plan inside a transaction, apply it, commit, then raise a rejection."""

        def work(tx: _Tx) -> tuple[Plan, T]:
            plan, value = build(tx)
            tx.apply(plan, final=True)  # the transaction's last statement
            return plan, value

        plan, value = self._tx(work, durable=durable)
        if plan.rejection is not None:
            raise plan.rejection
        return value

    # ------------------------------------------------------------------ schema

    def schema_version(self) -> int:
        """The version of Orbit's schema in the database, 0 for none (a database not yet
        migrated, or another application's): read alone, changing nothing."""
        if not self._read("schema_version_present")[0]["present"]:
            return 0
        return int(self._read("schema_version_get")[0]["version"])

    def schema_status(self) -> SchemaStatus:
        """The database's schema version, this Orbit's, and the migrations not yet
        applied: read alone, changing nothing, taking no lock. Raise ``SchemaTooNew`` on
        a database a newer Orbit migrated."""
        files = migration_files(self.driver.migrations)
        known = files[-1][0] if files else 0
        current = self.schema_version()
        _check_schema(current, known)
        return SchemaStatus(current, known, tuple(p.name for n, p in files if n > current))

    def migrate(self) -> int:
        """Apply the numbered migrations not yet applied; return the schema version
        (``schema_migrate``, which says what it applied)."""
        return self.schema_migrate().after

    def schema_migrate(self) -> Migrated:
        """Apply the numbered migrations not yet applied, in one transaction; return the
        version before and after and the files applied, and log them at INFO when there
        were any. Raise ``SchemaTooNew`` (changing nothing) on a database a newer Orbit
        migrated, and ``MigrationFailed`` (nothing of the run applied) when a statement
        of a migration, or the run's commit, fails.

        The version is read first, with no lock: a schema that is current (every open
        but the first after an upgrade) takes neither the migration's lock nor, on
        SQLite, the database's write lock, so ``orbit token ls`` does not wait behind a
        server's write. Only a database with migrations due takes the lock, and reads
        the version again under it (another node may have migrated it meanwhile)."""
        files = migration_files(self.driver.migrations)
        known = files[-1][0] if files else 0
        current = self.schema_version()
        if current:
            _check_schema(current, known)
            if current == known:
                return Migrated(current, current, ())
        #: the version under the lock and the file being applied, of the latest try
        at: dict[str, Any] = {}

        def work(tx: _Tx) -> Migrated:
            at.clear()
            tx.fetch("migrate_lock")
            tx.execute("schema_version_create")
            before = current = int(tx.fetch("schema_version_get")[0]["version"])
            _check_schema(current, known)
            at["before"], applied = before, []
            for number, path in files:
                if number > current:
                    at["file"] = path.name
                    tx.cx.run_script(path.read_text(encoding="utf-8"))
                    tx.execute("schema_version_insert", version=number, now=tx.now())
                    applied.append(path.name)
                    current = number
            at["file"] = None  # all ran: what fails now is the commit
            at["applied"] = applied
            return Migrated(before, current, tuple(applied))

        try:
            done = self._tx(
                work,
                wait_us=MIGRATE_WAIT_US,
                waiting="the migration waits for a lock another process holds (another "
                "node's migration, or a transaction on a table it alters)",
            )
        except SchemaTooNew:
            raise
        except Exception as exc:
            if "before" not in at:  # before the lock was taken and the version read
                raise
            raise _migration_failed(exc, at) from exc
        if done.applied:
            _log.info(
                "migrated the schema from version %d to %d: %s",
                done.before,
                done.after,
                ", ".join(done.applied),
            )
        return done

    # ------------------------------------------------------------------ queues and limits

    def queue_create(
        self,
        name: str,
        *,
        max_concurrency: int | None,
        rate: float | None,
        burst: int | None = None,
        max_queued: int | None = None,
    ) -> Queue:
        """Create a queue. ``max_concurrency`` and ``rate`` are required (rate 0 = unlimited);
        ``max_queued`` (None: no cap) bounds its waiting tasks (``_check_depth``)."""
        check_name("queue", name)
        check_queue_caps(max_concurrency, rate, burst)
        check_max_queued(max_queued)
        assert max_concurrency is not None and rate is not None
        if burst is None:
            burst = max(1, int(rate)) if rate > 0 else 1

        def work(tx: _Tx) -> Queue:
            _wait_for_claims(tx)  # a claim in flight read the queues before this one
            now = tx.now()
            made = tx.fetch(
                "queue_insert",
                name=name,
                max_concurrency=max_concurrency,
                rate=float(rate) + 0.0,  # -0.0 is 0 (unlimited), spelled 0.0 everywhere
                burst=burst,
                tokens=float(burst),
                now=now,
                max_queued=max_queued,
            )
            if not made:
                raise OrbitError(Code.QUEUE_EXISTS, f"queue {name} already exists")
            tx.events(
                [
                    Event(
                        kind="queue.created",
                        queue=name,
                        data={
                            "max_concurrency": max_concurrency,
                            "rate": rate,
                            "burst": burst,
                            **({} if max_queued is None else {"max_queued": max_queued}),
                        },
                    )
                ]
            )
            return R.queue_from_row(tx.fetch("queue_get", name=name)[0])

        return self._tx(work)

    def queue_get(self, name: str) -> Queue:
        found = self._read("queue_get", name=name)
        if not found:
            raise OrbitError(Code.QUEUE_NOT_FOUND, f"no queue named {name!r:.80}")
        return R.queue_from_row(found[0])

    def queue_list(self, *, after_name: str | None = None, limit: int | None = None) -> list[Queue]:
        """Queues in name order after ``after_name``, at most ``limit`` (1 to 1,000; None:
        all): keyset pagination on the primary key, as ``task_list`` pages by id."""
        if limit is not None:
            check_int("limit", limit, 1, 1000)
        rows = self._read("queue_list", after_name=after_name or "", limit=limit)
        return [R.queue_from_row(r) for r in rows]

    def queue_pause(self, name: str) -> Queue:
        return self._queue_set_paused(name, True)

    def queue_resume(self, name: str) -> Queue:
        return self._queue_set_paused(name, False)

    def _queue_set_paused(self, name: str, paused: bool) -> Queue:
        def work(tx: _Tx) -> Queue:
            found = tx.fetch("queue_lock", name=name)
            if not found:
                raise OrbitError(Code.QUEUE_NOT_FOUND, f"no queue named {name!r:.80}")
            queue = R.queue_from_row(found[0])
            if queue.paused != paused:
                tx.execute("queue_set_paused", name=name, paused=paused)
                kind = "queue.paused" if paused else "queue.resumed"
                tx.events([Event(kind=kind, queue=name)])
                if not paused:
                    tx.ready.add(name)  # its tasks are claimable again: wake the dispatchers
            return evolve(queue, paused=paused)

        return self._tx(work)

    def queue_update(
        self,
        name: str,
        *,
        max_concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        max_queued: int | Keep | None = KEEP,
    ) -> Queue:
        """Change a queue's caps: only the ones given (None keeps a cap as it is; for
        ``max_queued``, KEEP keeps it and None removes it).

        Checked as ``queue_create`` checks them, before anything is touched. Nothing
        running is pre-empted: a ``max_concurrency`` below the live attempts only holds
        back new claims until enough of them end. A new rate or burst settles the token
        bucket first: it holds what it held at the old rate until now (a full bucket if
        the queue was unlimited), at most the new burst, and refills at the new rate from
        now on. A raised cap wakes the dispatchers that a cap held back. A
        ``max_queued`` below the waiting tasks touches none of them: it refuses submits
        until enough of them have been claimed."""
        check_name("queue", name)
        if max_concurrency is None and rate is None and burst is None and max_queued is KEEP:
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                "give at least one of max_concurrency, rate, burst, max_queued",
            )
        check_queue_cap_values(max_concurrency, rate, burst)
        if not isinstance(max_queued, Keep):
            check_max_queued(max_queued)

        def work(tx: _Tx) -> Queue:
            _wait_for_claims(tx)  # a claim in flight read the caps (and writes the bucket)
            found = tx.fetch("queue_lock", name=name)
            if not found:
                raise OrbitError(Code.QUEUE_NOT_FOUND, f"no queue named {name!r:.80}")
            before = R.queue_from_row(found[0])
            now = tx.now()
            after = queue_with_caps(
                before,
                max_concurrency=max_concurrency,
                rate=rate,
                burst=burst,
                now=now,
            )
            if not isinstance(max_queued, Keep):
                after = replace(after, max_queued=max_queued)
            if after == before:
                return before
            tx.execute(
                "queue_update_caps",
                name=name,
                max_concurrency=after.max_concurrency,
                rate=after.rate,
                burst=after.burst,
                tokens=after.tokens,
                tokens_at=after.tokens_at,
                max_queued=after.max_queued,
            )
            caps = ("max_concurrency", "rate", "burst", "max_queued")
            changed = _changes(
                caps, [getattr(before, f) for f in caps], [getattr(after, f) for f in caps]
            )
            tx.events([Event(kind="queue.updated", queue=name, data=changed)])
            if caps_raised(before, after):
                tx.freed.add(name)  # a claim a cap held back may find more now
            return after

        return self._tx(work)

    def tenant_limit_set(
        self,
        tenant: str,
        max_concurrency: int | Keep | None = KEEP,
        *,
        max_queued: int | Keep | None = KEEP,
    ) -> None:
        """Cap a tenant's live attempts across all queues (``max_concurrency``) and its
        waiting tasks across all queues (``max_queued``, see ``_check_depth``): None
        removes a cap, KEEP leaves it as it is; at least one must be given. A change
        writes a ``tenant.updated`` event, as ``queue_update`` writes ``queue.updated``;
        setting the caps it has writes none. A ``max_queued`` below the tenant's waiting
        tasks touches none of them: it refuses its submits until enough are claimed."""
        check_name("tenant", tenant)
        if isinstance(max_concurrency, Keep) and isinstance(max_queued, Keep):
            raise OrbitError(
                Code.INVALID_ARGUMENT, "give at least one of max_concurrency, max_queued"
            )
        if not isinstance(max_concurrency, Keep) and max_concurrency is not None:
            check_int("max_concurrency", max_concurrency, 1, MAX_TENANT_CAP)
        if not isinstance(max_queued, Keep):
            check_max_queued(max_queued)

        def work(tx: _Tx) -> None:
            _wait_for_claims(tx)  # and so no other change between this read and the write
            found = tx.fetch("tenant_get", name=tenant)
            before = (
                (_int_or_none(found[0]["max_concurrency"]), _int_or_none(found[0]["max_queued"]))
                if found
                else (None, None)
            )
            after = (
                before[0] if isinstance(max_concurrency, Keep) else max_concurrency,
                before[1] if isinstance(max_queued, Keep) else max_queued,
            )
            tx.execute("tenant_upsert", name=tenant, max_concurrency=after[0], max_queued=after[1])
            if before != after:
                changed = _changes(("max_concurrency", "max_queued"), before, after)
                tx.events([Event(kind="tenant.updated", tenant=tenant, data=changed)])
            if before[0] != after[0]:
                _limits_changed(tx)

        self._tx(work)

    def global_limit_set(self, max_concurrency: int | None) -> None:
        """Cap live attempts across the whole cluster (None removes the cap). A change
        writes a ``global.updated`` event and wakes the dispatchers a cap held back, as
        ``tenant_limit_set`` does; setting the cap in force does neither: a claim would
        find what it found (the claim lock orders this after any claim in flight)."""
        if max_concurrency is not None:
            check_int("max_concurrency", max_concurrency, 1, MAX_GLOBAL_CAP)

        def work(tx: _Tx) -> None:
            _wait_for_claims(tx)
            found = tx.fetch("setting_get", name="global_max_concurrency")
            before = _int_or_none(found[0]["int_value"]) if found else None
            tx.execute("setting_upsert", name="global_max_concurrency", int_value=max_concurrency)
            if before != max_concurrency:
                changed = _changes(("max_concurrency",), (before,), (max_concurrency,))
                tx.events([Event(kind="global.updated", data=changed)])
                _limits_changed(tx)

        self._tx(work)

    def tenant_limit_get(self, tenant: str) -> int | None:
        """A tenant's cap (None: no cap, which every tenant has until one is set)."""
        check_name("tenant", tenant)
        found = self._read("tenant_get", name=tenant)
        return _int_or_none(found[0]["max_concurrency"]) if found else None

    def tenant_queued_get(self, tenant: str) -> int | None:
        """A tenant's cap on waiting tasks (None: no cap, as every tenant has until set)."""
        check_name("tenant", tenant)
        found = self._read("tenant_get", name=tenant)
        return _int_or_none(found[0]["max_queued"]) if found else None

    def tenant_limits(
        self, *, after_name: str | None = None, limit: int | None = None
    ) -> dict[str, tuple[int | None, int | None]]:
        """The tenants with a cap of either kind: ``(max_concurrency, max_queued)`` (None:
        no cap of that kind), by name, in name order after ``after_name``, at most
        ``limit`` (1 to 1,000; None: all): keyset pagination on the primary key, as
        ``queue_list`` pages queues. A tenant whose caps were all removed is left out."""
        if limit is not None:
            check_int("limit", limit, 1, 1000)
        rows = self._read("tenant_limits", after_name=after_name or "", limit=limit)
        return {
            str(r["name"]): (_int_or_none(r["max_concurrency"]), _int_or_none(r["max_queued"]))
            for r in rows
        }

    def tenant_limit_list(self) -> dict[str, int]:
        """Every tenant that has a cap, with it, by name."""
        rows = self._read("tenant_caps")
        return {str(r["name"]): int(r["max_concurrency"]) for r in sorted(rows, key=_by_name)}

    def global_limit_get(self) -> int | None:
        """The cluster-wide cap (None: no cap)."""
        found = self._read("setting_get", name="global_max_concurrency")
        return _int_or_none(found[0]["int_value"]) if found else None

    # ------------------------------------------------------------------ tokens

    def token_create(self, name: str, scopes: Sequence[str]) -> tuple[str, str]:
        """Create an API token; return its id and the token itself (shown only once)."""
        check_name("token name", name)
        bad = set(scopes) - TOKEN_SCOPES
        if not scopes or bad:
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                f"scopes must be among {sorted(TOKEN_SCOPES)}; got {sorted(bad)}",
            )
        secret = secrets.token_urlsafe(32)

        def work(tx: _Tx) -> str:
            now = tx.now()
            token_id = self._new_id(now).replace("-", "")
            tx.execute(
                "token_insert",
                id=token_id,
                name=name,
                secret_hash=_hash_secret(secret),
                scopes=",".join(sorted(set(scopes))),
                now=now,
            )
            return token_id

        token_id = self._tx(work)
        return token_id, f"orbit_{token_id}_{secret}"

    def token_scopes(self, token: str) -> frozenset[str] | None:
        """The scopes a token grants, or None if it is unknown, revoked or malformed."""
        found_id = parse_token_id(token)
        if found_id is None:
            return None
        found = self._read("token_get", id=found_id)
        secret = token.split("_", 2)[2]
        if not found or not hmac.compare_digest(found[0]["secret_hash"], _hash_secret(secret)):
            return None
        return frozenset(str(found[0]["scopes"]).split(","))

    def token_live(self, token_ids: Sequence[str]) -> set[str]:
        """Which of these token ids are still accepted (known and not revoked): one read
        for every token a node's open worker connections were opened with."""
        if not token_ids:
            return set()
        return {str(r["id"]) for r in self._read("token_live", ids=sorted(set(token_ids)))}

    def token_list(self, *, after_id: str | None = None, limit: int | None = None) -> list[Token]:
        """Tokens, revoked ones included, oldest first (in id order, which is creation
        order: a token's id is the uuid7 of its ``created_at``) after ``after_id``, at
        most ``limit`` (1 to 1,000; None: all): keyset pagination on the primary key.
        Never a secret or its hash."""
        if limit is not None:
            check_int("limit", limit, 1, 1000)
        rows = self._read("token_list", after_id=after_id or "", limit=limit)
        return [R.token_from_row(r) for r in rows]

    def token_revoke(self, token_id: str) -> Token:
        """Refuse a token from now on (``token_scopes`` answers None) and return it.

        Revoking a revoked token changes nothing and returns it with its first
        ``revoked_at``, so a revoke retried after a lost answer is harmless and the
        record of when the token stopped working stays true. A server node still
        accepts the token for as long as it caches checks (``orbit.server.auth``).

        The commit tells every node (``on_revoked``; NOTIFY orbit_ready ``revoked`` on
        PostgreSQL) to close the worker connections opened with the token. A second
        revoke tells them again: harmless, and a node that missed the first hears it."""
        if not (0 < len(token_id) <= 64 and token_id.isascii() and token_id.isalnum()):
            # Not echoed: what was given may be a whole token, secret included.
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                "a token id is the part of the token between 'orbit_' and the next '_'",
            )

        def work(tx: _Tx) -> Token:
            found = tx.fetch("token_lock", id=token_id)
            if not found:
                raise OrbitError(Code.TOKEN_NOT_FOUND, f"no token with id {token_id!r:.80}")
            token = R.token_from_row(found[0])
            tx.revoked.append(token_id)
            if token.revoked_at is not None:
                return token
            now = tx.now()  # after the lock: two revokes in a race keep the first instant
            _guarded("token_revoke", tx.execute("token_revoke", id=token_id, now=now), 1)
            return evolve(token, revoked_at=now)

        return self._tx(work)

    # ------------------------------------------------------------------ schedules

    def schedule_create(
        self,
        name: str,
        *,
        cron: str,
        timezone: str,
        template: TaskSpec,
        misfire: str = "skip",
        max_catch_up: int = DEFAULT_MAX_CATCH_UP,
        paused: bool = False,
    ) -> Schedule:
        """Create a schedule, its first fire the first instant after now. Everything is
        checked before the transaction (``check_schedule``); the template's queue must
        exist (QUEUE_NOT_FOUND), the name be new (SCHEDULE_EXISTS)."""
        cron, payload = check_schedule(
            name, cron, timezone, template, misfire, max_catch_up, self.config.max_payload_bytes
        )
        zone = check_timezone(timezone)
        next_after(cron, zone, self._now())  # INVALID_CRON if it never matches

        def work(tx: _Tx) -> Schedule:
            now = tx.now()
            if not tx.fetch("queue_get", name=template.queue):
                raise OrbitError(
                    Code.QUEUE_NOT_FOUND,
                    f"no queue named {template.queue!r:.80}",
                    field="template.queue",
                )
            first = next_after(cron, zone, now)
            made = tx.fetch(
                "schedule_insert",
                name=name,
                cron=cron,
                timezone=timezone,
                template=R.template_json(template, payload),
                misfire=misfire,
                max_catch_up=max_catch_up,
                paused=paused,
                next_fire_at=first,
                now=now,
            )
            if not made:
                raise OrbitError(
                    Code.SCHEDULE_EXISTS, f"schedule {name} already exists", field="name"
                )
            data: dict[str, Any] = {"schedule": name, "cron": cron, "timezone": timezone}
            data.update(misfire=misfire, max_catch_up=max_catch_up, next_fire_at=first)
            tx.events([Event(kind="schedule.created", queue=template.queue, data=data)])
            return R.schedule_from_row(tx.fetch("schedule_get", name=name)[0])

        return self._tx(work)

    def schedule_get(self, name: str) -> Schedule:
        found = self._read("schedule_get", name=name)
        if not found:
            raise _no_schedule(name)
        return R.schedule_from_row(found[0])

    def schedule_list(
        self, *, after_name: str | None = None, limit: int | None = None
    ) -> list[Schedule]:
        """Schedules in name order after ``after_name``, at most ``limit`` (1 to 1,000;
        None: all): keyset pagination, as ``queue_list``."""
        if limit is not None:
            check_int("limit", limit, 1, 1000)
        rows = self._read("schedule_list", after_name=after_name or "", limit=limit)
        return [R.schedule_from_row(r) for r in rows]

    def schedule_pause(self, name: str) -> Schedule:
        """Stop firing. A no-op on a paused schedule."""
        return self._schedule_set_paused(name, True)

    def schedule_resume(self, name: str) -> Schedule:
        """Fire again from the first instant after now: the instants that passed while it
        was paused are not misfires (an operator chose them), whatever its policy."""
        return self._schedule_set_paused(name, False)

    def _schedule_set_paused(self, name: str, paused: bool) -> Schedule:
        def work(tx: _Tx) -> Schedule:
            found = tx.fetch("schedule_lock", name=name)
            if not found:
                raise _no_schedule(name)
            s = R.schedule_from_row(found[0])
            if s.paused == paused:
                return s
            now = tx.now()
            next_fire = s.next_fire_at
            if not paused:
                next_fire = next_after(s.cron, stored_zone(s.timezone), now)
            _guarded(
                "schedule_write",
                tx.execute(
                    "schedule_write",
                    name=name,
                    version=s.version,
                    paused=paused,
                    next_fire_at=next_fire,
                    last_fire_at=s.last_fire_at,
                    now=now,
                ),
                1,
            )
            kind = "schedule.paused" if paused else "schedule.resumed"
            data: dict[str, Any] = {"schedule": name, "next_fire_at": next_fire}
            tx.events([Event(kind=kind, queue=s.template.queue, data=data)])
            return R.schedule_from_row(tx.fetch("schedule_get", name=name)[0])

        return self._tx(work)

    def schedule_update(
        self,
        name: str,
        *,
        cron: str | None = None,
        timezone: str | None = None,
        template: TaskSpec | None = None,
        misfire: str | None = None,
        max_catch_up: int | None = None,
    ) -> Schedule:
        """Change what is given (at least one; None keeps a field), checked as a create
        is; ``template`` replaces the whole template. A change of ``cron`` or
        ``timezone`` sets ``next_fire_at`` to the new expression's first instant after
        now: the old expression's instants not yet fired are dropped, none fires twice
        (every fired instant is at or before now). Otherwise ``next_fire_at`` stays, and
        an instant due but not yet fired fires with the new template and policy.

        Against a fire: the row is locked (waiting for a fire that holds it) and written
        under its version, so a fire that read it before this commits finds it moved on
        and leaves it to the duty's next pass, which reads the new row."""
        given = {
            "cron": cron,
            "timezone": timezone,
            "template": template,
            "misfire": misfire,
            "max_catch_up": max_catch_up,
        }
        changed: dict[str, Any] = {f: v for f, v in given.items() if v is not None}
        if not changed:
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                "give at least one of cron, timezone, template, misfire, max_catch_up",
            )

        def work(tx: _Tx) -> Schedule:
            found = tx.fetch("schedule_lock", name=name)
            if not found:
                raise _no_schedule(name)
            s = R.schedule_from_row(found[0])
            new = replace(s, **changed)
            checked_cron, payload = check_schedule(
                name,
                new.cron,
                new.timezone,
                new.template,
                new.misfire,
                new.max_catch_up,
                self.config.max_payload_bytes,
                cron_stored=cron is None,
                timezone_stored=timezone is None,
            )
            new = replace(new, cron=checked_cron)
            if template is not None and not tx.fetch("queue_get", name=template.queue):
                raise OrbitError(
                    Code.QUEUE_NOT_FOUND,
                    f"no queue named {template.queue!r:.80}",
                    field="template.queue",
                )
            now = tx.now()
            next_fire = s.next_fire_at
            if (new.cron, new.timezone) != (s.cron, s.timezone):
                # a zone given was checked (check_schedule); one kept is read as stored
                next_fire = next_after(new.cron, stored_zone(new.timezone), now)
            _guarded(
                "schedule_update",
                tx.execute(
                    "schedule_update",
                    name=name,
                    version=s.version,
                    cron=new.cron,
                    timezone=new.timezone,
                    template=R.template_json(new.template, payload),
                    misfire=new.misfire,
                    max_catch_up=new.max_catch_up,
                    next_fire_at=next_fire,
                    now=now,
                ),
                1,
            )
            data: dict[str, Any] = {
                "schedule": name,
                "changed": list(changed),
                "cron": new.cron,
                "timezone": new.timezone,
                "misfire": new.misfire,
                "max_catch_up": new.max_catch_up,
                "next_fire_at": next_fire,
            }
            tx.events([Event(kind="schedule.updated", queue=new.template.queue, data=data)])
            return R.schedule_from_row(tx.fetch("schedule_get", name=name)[0])

        return self._tx(work)

    def schedule_delete(self, name: str) -> Schedule:
        """Delete a schedule; the tasks it made are left as they are."""

        def work(tx: _Tx) -> Schedule:
            found = tx.fetch("schedule_lock", name=name)
            if not found:
                raise _no_schedule(name)
            s = R.schedule_from_row(found[0])
            tx.execute("schedule_delete", name=name)
            tx.events(
                [Event(kind="schedule.deleted", queue=s.template.queue, data={"schedule": name})]
            )
            return s

        return self._tx(work)

    def schedule_due_in(self) -> float | None:
        """Seconds until the soonest unpaused schedule is due (negative: overdue), or
        None if there is none."""
        found = self._read("schedule_due_in")
        soonest = found[0]["next_fire_at"] if found else None
        if soonest is None:
            return None
        return (int(soonest) - self._now()) / 1_000_000

    def schedule_fire_due(self, limit: int = 100, budget_s: float = SCHEDULE_PASS_S) -> int:
        """Fire what is due, each fire its own transaction (``schedule_fire``), in
        rounds; return how many tasks were made. A round reads the clock, then every
        schedule due then, ``limit`` at a time, oldest first, and fires each at most
        once: a schedule catching up fires its next instant in the next round, after
        the instants that came due meanwhile have had theirs, so a long catch-up never
        holds a fresh instant back behind its backlog. Rounds go on until one does
        nothing (nothing due, or no fire wrote anything: each refused, or its row held
        by another node's fire or moved on since it was read) or ``budget_s`` has
        passed; the duty then runs the next pass at once if this one made anything. A
        round counts only fires that wrote something: one whose due rows are all held
        elsewhere would otherwise find them again at once, round after round, for the
        whole budget.

        While rounds follow one another, the duty is busy: an instant that came due
        since the first of them (``_FireStretch``) is on time however late the round
        that fires it (the documented meaning of a missed instant: the cluster was down,
        or its fire refused all that time). A round that does nothing ends the stretch,
        and so does a stall (the node stopped, a long wait on the database): more than
        ``MISFIRE_GRACE_US`` between two of the duty's readings of the clock, during
        which it saw nothing come due. The next round starts a stretch of its own.

        A fire refused (a full queue, say) writes nothing: the schedule stays due, and
        is tried again by the next pass, not by this one's later rounds; a page of those
        does not hide the schedules after them. A fire that fails in any other way (a
        bug, a row that cannot be read) is logged with its traceback and passed by too.
        A failure of the database itself (``Driver.is_unavailable``) ends the pass
        instead: the next schedule's fire would fail the same way, and the duty logs it
        once."""
        ends = time.monotonic() + budget_s
        made = 0
        failed: set[str] = set()
        try:
            while True:
                now = self._now()
                stretch = self._fire_stretch
                if stretch is not None:
                    stretch.saw(now)
                if stretch is None or stretch.stalled:
                    stretch = self._fire_stretch = _FireStretch(began=now)
                wrote = stretch.wrote
                made += self._schedule_round(now, limit, failed)
                if stretch.wrote == wrote:
                    self._fire_stretch = None
                    return made
                if time.monotonic() >= ends:
                    return made
        except BaseException:
            self._fire_stretch = None
            raise

    def _schedule_round(self, now: int, limit: int, failed: set[str]) -> int:
        """One round of ``schedule_fire_due`` at ``now``: each due schedule not in
        ``failed`` fired once (one that fails is added to it). Return the tasks made;
        the fires that wrote something the stretch counts (``_FireStretch.wrote``)."""
        made = 0
        done: set[str] = set()
        after_at, after_name = -(2**62), ""
        while True:
            rows = self._read(
                "schedule_due", now=now, after_at=after_at, after_name=after_name, limit=limit
            )
            for row in rows:
                name = str(row["name"])
                if name in done or name in failed:
                    continue  # fired in this round (its next instant is the next round's)
                done.add(name)
                try:
                    made += self.schedule_fire(R.schedule_from_row(row), now)
                except OrbitError as exc:
                    # Nothing was written: the instant stays due and the next pass tries it.
                    failed.add(name)
                    _log.warning("schedule %s did not fire: %s", name, exc)
                except Exception as exc:
                    if self.driver.is_unavailable(exc):
                        raise  # the database's failure, no schedule's: the pass ends
                    # A bug, or a row this Orbit cannot read: its fire's transaction
                    # rolled back, it stays due, and the schedules after it go on. The
                    # record names the schedule, never its template (payloads may hold
                    # secrets); the traceback has the error's own message only.
                    failed.add(name)
                    _log.exception("schedule %s did not fire", name)
            if len(rows) < limit:
                return made
            after_at, after_name = int(rows[-1]["next_fire_at"]), str(rows[-1]["name"])

    def schedule_fire(self, s: Schedule, now: int) -> int:
        """Fire ``s`` (as read at ``now``, when it was due) once: submit its template for
        the oldest instant its misfire policy keeps (``fire_plan``) in the transaction
        that advances its ``next_fire_at`` and writes a ``schedule.fired`` event, or,
        if the policy keeps none, only advance it past now. Missed instants the policy
        drops are written down in the same transaction, whether or not an instant
        fires: a ``schedule.skipped`` event (``_skipped``). On time is judged from the
        duty's stretch, when one is under way (``_FireStretch``), and the fire tells it
        the clock it read and whether it wrote anything. Return the tasks made (0 or 1).

        Two guards keep an instant from firing twice. The row is locked as read (its
        version, and its ``created_at``: a schedule deleted and made again under its
        name starts again at version 1), skipping a row another node's fire holds
        (``FOR UPDATE SKIP LOCKED``): that fire moves it on, so this one would be
        stale; a row changed since it was read is left to the next pass. And the task's
        idempotency key is the schedule's and the instant's (``fire_key``): a fire that
        committed but whose reply was lost, then retried, finds its task rather than
        making another."""
        stretch = self._fire_stretch
        if stretch is None:
            plan = fire_plan(s, now)
        else:
            plan = fire_plan(s, now, stretch.began - MISFIRE_GRACE_US, stretch.kept_from(s))
        if plan.instant is None:

            def advance(tx: _Tx) -> bool:
                at = tx.now()
                if stretch is not None:
                    stretch.saw(at)
                if not tx.fetch(
                    "schedule_lock_due",
                    name=s.name,
                    created_at=s.created_at,
                    version=s.version,
                    now=at,
                ):
                    return False  # held by another node's fire, or moved on
                _guarded(
                    "schedule_write",
                    tx.execute(
                        "schedule_write",
                        name=s.name,
                        version=s.version,
                        paused=False,
                        next_fire_at=plan.next_fire_at,
                        last_fire_at=s.last_fire_at,
                        now=at,
                    ),
                    1,
                )
                tx.events(_skipped(s, plan))
                return True

            if self._tx(advance) and stretch is not None:
                stretch.wrote += 1
            return 0
        instant = plan.instant
        key = fire_key(s, instant)

        def first(tx: _Tx) -> None:
            at = tx.now()
            if stretch is not None:
                stretch.saw(at)
            if not tx.fetch(
                "schedule_lock_due",
                name=s.name,
                created_at=s.created_at,
                version=s.version,
                now=at,
            ):
                raise _Moved
            _guarded(
                "schedule_write",
                tx.execute(
                    "schedule_write",
                    name=s.name,
                    version=s.version,
                    paused=False,
                    next_fire_at=plan.next_fire_at,
                    last_fire_at=instant,
                    now=at,
                ),
                1,
            )

        def fired(tx: _Tx, done: Sequence[Submitted]) -> None:
            # Written once the task's id is known (a new one, or the one the key already
            # names), in the same transaction as the task and the schedule's advance.
            task_id = done[0].task.id
            data: dict[str, Any] = {
                "schedule": s.name,
                "instant": instant,
                "task_id": task_id,
                "idempotency_key": key,
                "next_fire_at": plan.next_fire_at,
            }
            event = Event(
                kind="schedule.fired",
                task_id=task_id,
                queue=s.template.queue,
                tenant=s.template.tenant,
                data=data,
            )
            tx.events([*_skipped(s, plan), event])

        # The template checked as a submit is, and then given the fire's key, which a
        # submit's check refuses (``is_fire_key``): so ``fields_checked``.
        check_spec(s.template, self.config.max_payload_bytes)
        spec = replace(s.template, idempotency_key=key)
        try:
            done = self.task_submit_rendered(
                [spec], _same, fields_checked=True, first=first, made=fired, batch=False
            )
        except _Moved:
            return 0
        if stretch is not None:
            stretch.kept[(s.name, s.created_at)] = (s.version + 1, instant)
            stretch.wrote += 1
        return int(done[0].created)

    def _now(self) -> int:
        """The clock outside a transaction: the test clock, else the database's."""
        if self._clock is not None:
            return self._clock()
        if self.backend == "postgres":
            return int(self._read("clock_now")[0]["now"])
        return time.time_ns() // 1000

    # ------------------------------------------------------------------ submit

    def task_submit(self, spec: TaskSpec) -> Submitted:
        """One task: its refusals name its fields as they are (``deadline``), where a
        batch's name the task too (``tasks[0].deadline``)."""
        return self.task_submit_rendered([spec], _same, batch=False)[0]

    def task_submit_many(self, specs: Sequence[TaskSpec]) -> list[Submitted]:
        """Submit tasks in one transaction: all of them or none."""
        return self.task_submit_rendered(specs, _same)

    def depth_gated(self, scopes: Iterable[tuple[str, str]]) -> list[int]:
        """The depth keys (``depth_key``) of those scopes (``(kind, name)``: ``"queue"``
        or ``"tenant"``) that this store's last submit to them found capped, in order: a
        caller that makes many submits wait (the server, ``orbit.server.gates``) lets one
        per key at a time through to the store. A hint: a cap set or removed since is
        seen by the next submit."""
        return self._depth_gates.keys(scopes)

    def task_submit_rendered(
        self,
        specs: Sequence[TaskSpec] | LazyBatch,
        render: Callable[[Submitted], T],
        *,
        fields_checked: bool = False,
        first: Callable[[_Tx], None] | None = None,
        made: Callable[[_Tx, Sequence[Submitted]], None] | None = None,
        batch: bool = True,
    ) -> list[T]:
        """``task_submit_many``, each result passed through ``render`` while the database
        writes the chunk after it (or its own, for the last): an HTTP reply's views are
        made in the shadow of the insert. A batch of one chunk is rendered before its
        write, which carries the ``COMMIT``: a render that raises commits nothing.
        ``render`` must not use the store; it runs again for every result if the
        transaction is retried, and its values are returned only once the transaction
        has committed.

        ``fields_checked``: every spec comes from ``orbit.protocol.submissions``' reader,
        which accepts only what ``check_spec`` accepts (a test holds the two to each
        other), or is a schedule's fire, checked by ``check_spec`` before its key was set,
        so only the payloads are checked here: half of ``check_spec``'s time,
        which runs before the transaction begins, while the database waits.

        A ``LazyBatch`` (the reader's, over HTTP) is read and its payloads checked before
        the transaction if it is one chunk, else a chunk at a time inside it, each while
        the database inserts the chunk before (``orbit.core.batches``). Its bad task is
        then found inside the transaction, which rolls back with nothing written:
        ``UnusualTask`` for what its reader cannot take, the payload's own error for
        the rest.

        ``batch``: the specs are a batch's tasks, and a refusal of one of them names it,
        as the decoder's do: its ``field`` is ``tasks[<index>].<field>`` and its message
        starts with that (``_of_task``). A single submit's and a schedule's fire's say
        their field alone."""
        if len(specs) > self.config.max_batch:
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                f"a batch holds at most {self.config.max_batch} tasks; got {len(specs)}",
            )
        lazy: LazyBatch | None = None
        eager: Sequence[TaskSpec] = ()  # the specs read and checked before the transaction
        if not isinstance(specs, LazyBatch):
            eager = specs
        elif len(specs) <= SUBMIT_CHUNK:  # nothing to overlap
            eager, fields_checked = specs.read(0, len(specs)), True
        else:
            lazy = specs
        count = len(specs)
        if not count:
            return []
        most = self.config.max_payload_bytes
        named = _of_task if batch else _as_is
        for index, spec in enumerate(eager):
            if not isinstance(spec, TaskSpec):
                refusal = OrbitError(Code.INVALID_ARGUMENT, "each task must be a TaskSpec")
                raise named(refusal, index)

        def checked(spec: TaskSpec) -> tuple[str, int]:
            """A spec's payload as ``fields_checked`` asks (asked again for a refusal)."""
            return check_payload(spec.payload, most) if fields_checked else check_spec(spec, most)

        try:  # a comprehension each, the hot path: no call per spec beyond the check
            if fields_checked:
                payloads = [check_payload(s.payload, most)[0] for s in eager]
            else:
                payloads = [check_spec(s, most)[0] for s in eager]
        except OrbitError as exc:
            raise _refusal(eager, 0, checked, named) or exc from None
        if lazy is None:
            queues = sorted({s.queue for s in eager})
            parents = sorted({s.parent_id for s in eager if s.parent_id})
            keys = {key for s in eager if (key := _key_of(s)) is not None}
        else:
            queues, parents, keys = sorted(lazy.queues), sorted(lazy.parents), set(lazy.keys)
        tenants = sorted({s.tenant for s in eager} if lazy is None else lazy.tenants)
        scopes = [("queue", q) for q in queues] + [("tenant", t) for t in tenants]

        def read(
            start: int, end: int, now: int, by_key: dict[tuple[str, str, str], Task]
        ) -> tuple[Sequence[TaskSpec], Sequence[str]]:
            """Chunk ``start``-``end``'s specs and payloads: as read before the
            transaction, or read now (a ``LazyBatch``: its payloads checked as
            ``fields_checked`` would, its deadlines as the eager ones were)."""
            if lazy is None:
                return eager[start:end], payloads[start:end]
            chunk = lazy.read(start, end)
            check_deadlines(chunk, start, now, by_key)
            try:
                return chunk, [check_payload(s.payload, most)[0] for s in chunk]
            except OrbitError as exc:
                raise _refusal(chunk, start, payload_of, named) or exc from None

        def payload_of(spec: TaskSpec) -> tuple[str, int]:
            return check_payload(spec.payload, most)

        def check_deadlines(
            specs: Sequence[TaskSpec], start: int, now: int, by_key: Mapping[Any, Task]
        ) -> None:
            """``check_deadline`` for the specs (the batch's from ``start``) whose keys
            name no task yet, a refusal naming its task (``_refusal``)."""
            try:
                for spec in specs:
                    if _key_of(spec) not in by_key:
                        check_deadline(spec, now)
            except OrbitError as exc:

                def deadline(spec: TaskSpec) -> None:
                    if _key_of(spec) not in by_key:
                        check_deadline(spec, now)

                raise _refusal(specs, start, deadline, named) or exc from None

        def naming(field: str, value: str, exc: OrbitError) -> OrbitError:
            """``exc``, the refusal of a value that tasks share (a queue, a parent), as
            the first task's that names it (``named``). A ``LazyBatch`` finds it without
            reading a chunk (``first_naming``)."""
            if lazy is not None:
                index = lazy.first_naming(field, value)
            else:
                index = next((i for i, s in enumerate(eager) if getattr(s, field) == value), None)
            return exc if index is None else named(exc, index)

        def work(tx: _Tx) -> list[T]:
            if first is not None:
                first(tx)
            # The queues, the tenants' caps on waiting tasks and the clock in one round
            # trip (one statement on PostgreSQL).
            queue_rows, tenant_caps = tx.lock_many(
                ("queue_get_many", {"names": queues}),
                ("tenant_queued_caps", {"names": tenants}),
            )
            now = tx.clock()
            known = {row["name"] for row in queue_rows}
            for q in queues:
                if q not in known:
                    missing = OrbitError(
                        Code.QUEUE_NOT_FOUND, f"no queue named {q!r:.80}", field="queue"
                    )
                    raise naming("queue", q, missing)
            if len(keys) > 1:
                # Two batches sharing keys in different orders each held a key the other
                # was inserting next, and PostgreSQL aborted one as a deadlock, 1 s later,
                # five times over (500 INTERNAL): the keys' stripes first, in one order.
                stripes = sorted({key_lock(tenant, queue) for tenant, queue, _ in keys})
                tx.fetch("idempotency_lock", keys=[str(k) for k in stripes])
            # The tasks each idempotency key already names: the database's, then this
            # batch's own as they are made. A spec whose key names a task makes nothing,
            # so its deadline is not checked: a client retrying a submit after its
            # deadline gets the task it made, not INVALID_DEADLINE.
            by_key = self._existing_by_key(tx, keys)
            stored = frozenset(by_key)  # the keys of tasks made before this batch
            check_deadlines(eager, 0, now, by_key)
            # Every parent must exist, whatever its children's keys name. A cancelled
            # one takes no new child, but a spec whose key names a task made before
            # this batch makes nothing: it is an idempotent retry, and gets its task
            # back (cancelled with its parent) rather than PARENT_CANCELLED.
            cancelled: dict[str, _CancelledBy] = {}  # parent -> its lineage's cancelled task
            nested: list[str] = []  # parents with a parent of their own
            for parent_id in parents:
                found = tx.fetch("task_share", id=parent_id)
                if not found:
                    missing = OrbitError(
                        Code.PARENT_NOT_FOUND,
                        f"no parent task {parent_id!r:.80}",
                        field="parent_id",
                    )
                    raise naming("parent_id", parent_id, missing)
                parent = R.task_from_row(found[0])
                if parent.cancel_requested or parent.state == TaskState.CANCELLED:
                    cancelled[parent_id] = _CancelledBy(parent_id, parent.state)
                elif parent.parent_id is not None:
                    nested.append(parent_id)
            if nested:
                # A cancel cascades down the whole tree but leaves a task that had ended
                # as it was: a finished parent under a cancelled ancestor takes no new
                # child either. Read after the parents' locks, which that cancel takes.
                cancelled.update(_cancelled_lineage(tx, nested))
            if cancelled:
                # Which spec names which parent: a LazyBatch is read whole for it, once
                # more (as a retried transaction reads it again), before anything is
                # written. Only a batch naming a cancelled parent pays for it.
                _refuse_new_children(
                    eager if lazy is None else lazy.read(0, count),
                    cancelled,
                    frozenset(by_key),
                    lambda k: self._existing_by_key(tx, k),
                    named,
                )
            capped = {
                ("queue", str(r["name"])): int(r["max_queued"])
                for r in queue_rows
                if r["max_queued"] is not None
            }
            capped.update((("tenant", str(r["name"])), int(r["max_queued"])) for r in tenant_caps)
            self._depth_gates.saw(scopes, capped)
            if capped:  # only a submit to a capped queue or tenant pays for backpressure
                _check_depth(
                    tx,
                    capped,
                    eager if lazy is None else lazy.read(0, count),
                    frozenset(by_key),
                    {r["name"]: float(r["rate"]) for r in queue_rows},
                    frozenset(r["name"] for r in queue_rows if r["paused"]),
                    lambda k: self._existing_by_key(tx, k),
                )
            results: list[Submitted] = []
            rendered: list[T] = []

            def render_made() -> None:
                rendered.extend(render(r) for r in results[len(rendered) :])

            streamed = count > SUBMIT_CHUNK

            def rows_by_chunk() -> Iterator[RowColumns]:
                """The new tasks' rows, a chunk at a time (``submit_chunks``; the whole
                batch at once if it is not ``streamed``): the driver writes each chunk
                while this renders it and makes the next (``Connection.write_stream``)."""
                for start, end in submit_chunks(count) if streamed else [(0, count)]:
                    made: list[Task] = []
                    ids = self._new_ids(now, end - start, start)
                    chunk, chunk_payloads = read(start, end, now, by_key)
                    for index, (spec, payload, task_id) in enumerate(
                        zip(chunk, chunk_payloads, ids, strict=True), start
                    ):
                        try:
                            done = self._submitted(spec, payload, now, by_key, stored, task_id)
                        except OrbitError as exc:
                            raise named(exc, index) from None
                        results.append(done)
                        if done.created:
                            if done.task.state == _QUEUED:
                                tx.ready.add(done.task.queue)
                            made.append(done.task)
                    yield R.tasks_columns(made)
                    render_made()

            # One statement per chunk for the tasks and their `submitted` events, which
            # the database makes from the rows it inserts (two on SQLite). A short count
            # means an idempotency key was taken concurrently: StaleWrite rolls it all
            # back and the retry finds the winner's task.
            if streamed:
                tx.write_stream(
                    "task_submit_many",
                    rows_by_chunk(),
                    expect=lambda: sum(r.created for r in results),
                )
                if made is not None:
                    made(tx, results)
            else:  # the wake of the other nodes and the COMMIT travel with the insert
                rows = next(rows_by_chunk())
                # Rendered first: the write commits (on PostgreSQL), and a render that
                # failed after it would answer an error for tasks that were made.
                render_made()
                if made is not None:  # the tasks' ids are known: a caller's own writes
                    made(tx, results)
                tx.write_batch(
                    ("task_submit_many", rows, len(rows)), notify=tx.unsent_notices(), final=True
                )
            return rendered

        with self._depth_gates.held(scopes):
            return self._tx(work)

    def _submitted(
        self,
        spec: TaskSpec,
        payload: str,
        now: int,
        by_key: dict[tuple[str, str, str], Task],
        stored: frozenset[tuple[str, str, str]],
        task_id: str,
    ) -> Submitted:
        """One spec of a batch: the task its idempotency key already names in ``by_key``
        (the same payload, handler and parent, or IDEMPOTENCY_CONFLICT: ``_differs``),
        or a new task with ``task_id``, which joins it. ``stored``: the keys of ``by_key``
        that name tasks made before the batch, which a conflict names (task ids are no
        secret) so that the submitter can find it; a key given twice in the batch names a
        task the refusal leaves unmade."""
        key = _key_of(spec)
        digest = transitions.digest(payload)
        prior = by_key.get(key) if key else None
        if prior is not None:
            differs = _differs(prior, spec, digest)
            if differs is not None:
                named = f"idempotency key {spec.idempotency_key!r:.80}"
                raise OrbitError(
                    Code.IDEMPOTENCY_CONFLICT,
                    f"{named} already names task {prior.id}, submitted with {differs[0]}"
                    if key in stored
                    else f"{named} is given twice in this batch, with {differs[1]}",
                    field="idempotency_key",
                )
            return assemble(Submitted, {"task": prior, "created": False})
        task = transitions.new_task(
            spec, task_id=task_id, payload=payload, now=now, payload_digest=digest
        )
        if key:
            by_key[key] = task
        return assemble(Submitted, {"task": task, "created": True})

    def _existing_by_key(
        self, tx: _Tx, keys: Iterable[tuple[str, str, str]]
    ) -> dict[tuple[str, str, str], Task]:
        """The tasks that already hold any of these ``(tenant, queue, key)``s."""
        groups: dict[tuple[str, str], set[str]] = {}
        for tenant, queue, key in keys:
            groups.setdefault((tenant, queue), set()).add(key)
        found: dict[tuple[str, str, str], Task] = {}
        for (tenant, queue), named in sorted(groups.items()):
            for row in tx.fetch(
                "task_by_idempotency_keys", tenant=tenant, queue=queue, keys=sorted(named)
            ):
                t = R.task_from_row(row)
                assert t.idempotency_key is not None
                found[(t.tenant, t.queue, t.idempotency_key)] = t
        return found

    # ------------------------------------------------------------------ reads

    def task_get(self, task_id: str) -> Task:
        found = self._read("task_get", id=task_id)
        if not found:
            raise OrbitError(Code.TASK_NOT_FOUND, f"no task {task_id!r:.80}")
        return R.task_from_row(found[0])

    def task_list(
        self,
        *,
        queue: str | None = None,
        state: str | None = None,
        tenant: str | None = None,
        handler: str | None = None,
        created_after: int | None = None,
        created_before: int | None = None,
        parent_id: str | None = None,
        after_id: str | None = None,
        limit: int = 100,
    ) -> list[Task]:
        """Tasks in id (= creation) order after ``after_id``: keyset pagination. With
        ``parent_id``, that task's children only (not their descendants).

        Given ``after_id`` or a created window, the query is ``task_list_range``, whose
        plain id bounds (``_list_id_bounds``) let the primary key's scan start at the
        window or page and stop at its end: the one query with every filter optional
        walked the key from the first task, filtering each (1-3 s at a million tasks
        for ``created_after`` = yesterday, as every later page of any listing did)."""
        check_int("limit", limit, 1, 1000)
        params: dict[str, Any] = {
            "queue": queue,
            "state": state,
            "tenant": tenant,
            "handler": handler,
            "created_after": created_after,
            "created_before": created_before,
            "limit": limit,
        }
        bounds = _list_id_bounds(after_id, created_after, created_before)
        if parent_id is not None:
            query = "task_list_by_parent"
            params.update(parent_id=parent_id, after_id=after_id)
        elif bounds is not None:
            query = "task_list_range"
            params.update(id_from=bounds[0], id_to=bounds[1])
        else:
            query = "task_list"
            params.update(after_id=after_id)
        return [R.task_from_row(r) for r in self._read(query, **params)]

    def task_stats(self) -> tuple[list[Row], int]:
        """Counts by queue and state of the tasks a state can still leave (queued,
        scheduled, claimed, running, cancelling, needs_review), with the oldest queued
        instant (metrics), and the store's clock read with them: an age is measured by the
        database's clock, as leases and deadlines are, never by the clock of the process
        that asks. Ended tasks are left out: every node reads this at every scrape, and a
        count of them was a scan of every task ever stored, which outgrew the scrape's
        time limit (each is read through an index of the tasks not ended instead).
        SQLite reads them on its read connection, outside every transaction: in one they
        waited for another process's write lock, and a scrape answered 503 while /readyz
        and every GET went on (PostgreSQL's take no lock, but need the transaction for
        the planner setting of ``task_stats_by_index``)."""
        if self.backend == "postgres":
            return self._tx(self._task_stats)
        return self._read("task_stats"), self._now()

    def _task_stats(self, tx: _Tx) -> tuple[list[Row], int]:
        if self.backend == "postgres":
            # sequential scans off for this transaction: see the query's comment
            tx.fetch("task_stats_by_index")
        return tx.fetch("task_stats"), tx.now()

    def task_counts(self) -> dict[str, int]:
        return {r["state"]: int(r["n"]) for r in self._read("task_count_by_state")}

    def attempt_list(
        self, task_id: str, *, after_number: int = 0, limit: int | None = None
    ) -> list[Attempt]:
        """The task's attempts in number order after ``after_number`` (0: from the first),
        at most ``limit`` (1 to 1,000; None: all): keyset pagination on the (task_id,
        number) index. A task's attempts are bounded by claims, not by ``max_attempts``
        (a released claim counts for nothing), so the API reads them a page at a time."""
        check_int("after_number", after_number, 0, MAX_ATTEMPT_NUMBER)
        if limit is not None:
            check_int("limit", limit, 1, 1000)
        rows = self._read("attempt_list", task_id=task_id, after_number=after_number, limit=limit)
        return [R.attempt_from_row(r) for r in rows]

    def attempt_outcomes(
        self, task_id: str, attempt_ids: Sequence[str]
    ) -> dict[str, tuple[str, str | None]]:
        """How each of these attempts of the task ended, as the event log recorded it: the
        ``(kind, code)`` of the event written in the transaction that ended it, by attempt
        id (an attempt still live, or not of this task, is left out). The log holds the
        end of every attempt already (I9), so the attempt list reads it from there: a
        column of its own would be one more write on the finish path, and a migration."""
        if not attempt_ids:
            return {}
        rows = self._read("attempt_outcome_list", task_id=task_id, ids=list(attempt_ids))
        # in the log's order: were an attempt ever ended twice, its last end would stand
        return {str(r["attempt_id"]): (str(r["kind"]), r["code"]) for r in rows}

    def attempt_get(self, attempt_id: str) -> Attempt:
        found = self._read("attempt_get", id=attempt_id)
        if not found:
            raise OrbitError(Code.ATTEMPT_NOT_FOUND, f"no attempt {attempt_id!r:.80}")
        return R.attempt_from_row(found[0])

    def attempt_cancelling_for_sessions(self, session_ids: Sequence[str]) -> list[tuple[str, str]]:
        """``(session_id, attempt_id)`` of these sessions' running attempts whose task is
        `cancelling`: what ``on_cancel`` told, for a node that may have missed it."""
        if not session_ids:
            return []
        rows = self._read("attempt_cancelling_for_sessions", session_ids=sorted(set(session_ids)))
        return [(str(r["session_id"]), str(r["id"])) for r in rows]

    def event_list(
        self,
        *,
        task_id: str | None = None,
        after_id: int = 0,
        after_xid: int = 0,
        limit: int = 1000,
    ) -> list[Row]:
        """Events after the event at the position (``after_xid``, ``after_id``) ((0, 0):
        from the start) in the log's order, at most ``limit`` (1 to 100,000: a limit of -1
        read every event on SQLite and was a database error on PostgreSQL). A gap-free
        tail: paging on from the last event returned never steps past an event, and
        returns each one once. Each row's ``xid`` and ``id`` are its position.

        The order is by (transaction id, event id) on PostgreSQL, and only the events of
        transactions older than every transaction still running are returned: a later
        commit can hold a lower event id, but never such a position (see
        ``0008_event_xid.sql``). So that a caller sees the events it has just committed,
        a read that finds committed events it cannot return yet (an older transaction of
        this database is still running) reads again until they can be, for at most
        ``StoreConfig.event_wait_us``; then it returns the events before them. A position
        is both numbers, as the log has no index on the id alone: an event's xid is 0 on
        SQLite and for the events written before migration 0008, so an id from before
        it is a position with xid 0. A position that names no event is INVALID_ARGUMENT.

        This call sleeps between its reads; the server waits on its event loop instead,
        with ``event_read`` and ``event_pauses``, so a wait holds none of its threads."""
        read = partial(
            self.event_read, task_id=task_id, after_id=after_id, after_xid=after_xid, limit=limit
        )
        rows, held_back = read()
        for pause in self.event_pauses():
            if not held_back:
                break
            time.sleep(pause)  # an older writer is still running: it ends in a moment
            rows, held_back = read()
        return rows

    def event_read(
        self,
        *,
        task_id: str | None = None,
        after_id: int = 0,
        after_xid: int = 0,
        limit: int = 1000,
        checked: bool = True,
    ) -> tuple[list[Row], bool]:
        """One read of ``event_list``, without its wait: the events it may return, and
        whether committed events follow them that an older running transaction holds
        back (read again shortly, as ``event_list`` does, to return them too).

        ``checked=False`` is a subscription's read, again and again from positions this
        store returned: a read that finds nothing does not look whether the position
        names an event, so it is one query."""
        check_int("after_id", after_id, 0, 2**63 - 1)
        check_int("after_xid", after_xid, 0, 2**63 - 1)
        check_int("limit", limit, 1, 100_000)
        query = "event_list" if task_id is None else "event_list_task"
        rows = self._read(
            query, task_id=task_id, after_id=after_id, after_xid=after_xid, limit=limit
        )
        if (
            checked
            and not rows
            and (after_id or after_xid)
            and not self._names_event(after_xid, after_id)
        ):
            raise OrbitError(
                Code.INVALID_ARGUMENT, f"after ({after_xid}, {after_id}) names no event"
            )
        settled = _settled(rows)
        return settled, len(settled) < len(rows)

    def event_pauses(self) -> Iterator[float]:
        """The pauses before each read again of an event read that waits for older
        transactions (``event_list``): doubling from 1 ms to 50 ms, for as long as
        ``StoreConfig.event_wait_us`` has not passed since the first was asked for."""
        deadline = time.monotonic() + self.config.event_wait_us / SECOND
        pause = 0.001
        while time.monotonic() < deadline:
            yield pause
            pause = min(pause * 2, 0.05)

    def _names_event(self, xid: int, event_id: int) -> bool:
        """Whether an event is at this position (never one whose id is 0)."""
        return event_id != 0 and bool(self._read("event_exists", xid=xid, id=event_id))

    def session_get(self, session_id: str) -> Session:
        found = self._read("session_get", id=session_id)
        if not found:
            raise _no_session(session_id)
        return R.session_from_row(found[0])

    def session_list(
        self,
        *,
        state: str | None = None,
        after_id: str | None = None,
        limit: int | None = None,
    ) -> list[Session]:
        """Sessions in id (= opening) order after ``after_id``, at most ``limit`` (1 to
        1,000; None: all), or only those in ``state`` (``live``, ``expired``): keyset
        pagination, as ``task_list``. Sessions are never deleted: an expired one stays,
        as the evidence its events point at, so the API reads them a page at a time."""
        if limit is not None:
            check_int("limit", limit, 1, 1000)
        if state == "live":  # few, among every session ever opened: by their own index
            rows = self._read("session_list_live", after_id=after_id, limit=limit)
        else:
            rows = self._read("session_list", state=state, after_id=after_id, limit=limit)
        return [R.session_from_row(r) for r in rows]

    def live_attempt_counts(self) -> list[Row]:
        """Live attempts grouped by queue, tenant, handler and session (for caps and tests)."""
        return self._read("attempt_live_counts")

    # ------------------------------------------------------------------ sessions

    def session_open(
        self,
        *,
        name: str,
        node_id: str,
        capabilities: Sequence[Capability],
        max_concurrency: int,
    ) -> tuple[Session, str]:
        """Open a worker session; return it and its resume secret (shown once)."""
        check_name("worker name", name)
        check_name("node id", node_id)
        caps = _check_capabilities(capabilities)
        check_int("max_concurrency", max_concurrency, 1, 100_000)
        secret = secrets.token_urlsafe(32)

        def work(tx: _Tx) -> Session:
            now = tx.now()
            session = Session(
                id=self._new_id(now),
                name=name,
                node_id=node_id,
                epoch=1,
                secret_hash=_hash_secret(secret),
                capabilities=caps,
                max_concurrency=max_concurrency,
                capacity_seq=0,
                draining=False,
                state=SessionState.LIVE,
                expires_at=now + self.config.session_ttl_us,
                created_at=now,
            )
            tx.execute("session_insert", **R.session_to_row(session))
            tx.events(
                [
                    Event(
                        kind="session.opened",
                        session_id=session.id,
                        data={"name": name, "node_id": node_id},
                    )
                ]
            )
            return session

        return self._tx(work), secret

    def session_resume(self, session_id: str, secret: str, *, node_id: str) -> Session:
        """Resume with the secret: the epoch is bumped, so the old connection is fenced."""
        check_name("node id", node_id)

        def work(tx: _Tx) -> Session:
            _wait_for_claims(tx)
            session = tx.session(session_id, lock=True)
            if not hmac.compare_digest(session.secret_hash, _hash_secret(secret)):
                raise OrbitError(Code.BAD_SECRET, "the resume secret does not match")
            now = tx.now()
            after = evolve(
                session,
                epoch=session.epoch + 1,
                node_id=node_id,
                state=SessionState.LIVE,
                expires_at=now + self.config.session_ttl_us,
            )
            tx.write_sessions([(session, after)])
            # Tells the node holding the superseded connection to close it now (NOTIFY
            # orbit_ready `fenced` on PostgreSQL; a node hears none of its own).
            tx.fenced.append((session_id, after.epoch))
            tx.events(
                [
                    Event(
                        kind="session.resumed",
                        session_id=session_id,
                        data={"epoch": after.epoch, "node_id": node_id},
                    )
                ]
            )
            return after

        return self._tx(work)

    def session_heartbeat(self, session_id: str, epoch: int) -> Session:
        def build(tx: _Tx) -> tuple[Plan, Session]:
            plan = Plan()
            session = tx.session(session_id, lock=True)
            now = tx.now()
            reason = transitions.session_usable(evolve(session, draining=False), epoch, now)
            if reason is not None:
                raise Rejected(reason[0], reason[1])  # answered, not logged: see claim
            after = evolve(session, expires_at=now + self.config.session_ttl_us)
            plan.session_writes.append((session, after))
            return plan, after

        return self._run_plan(build)

    def session_capacity_set(
        self,
        session_id: str,
        epoch: int,
        *,
        seq: int,
        capabilities: Sequence[Capability],
        max_concurrency: int,
    ) -> Session:
        """Replace (never add to) the session's capacity; ``seq`` must increase.

        ``seq`` 0 is a counter the wire takes, and no newer than a new session's: it is
        judged as any stale seq (STALE_CAPACITY, and its event), not refused before the
        transaction as INVALID_ARGUMENT without one."""
        caps = _check_capabilities(capabilities)
        check_int("max_concurrency", max_concurrency, 1, 100_000)
        check_int("seq", seq, 0, 2**63 - 1)

        def build(tx: _Tx) -> tuple[Plan, Session]:
            plan = Plan()
            _wait_for_claims(tx)
            session = tx.session(session_id, lock=True)
            if epoch != session.epoch:
                plan.reject(
                    Code.FENCED_EPOCH,
                    transitions.fenced_epoch_message(epoch, session.epoch),
                    report="capacity",
                    session_id=session_id,
                )
                return plan, session
            if seq <= session.capacity_seq:
                plan.reject(
                    Code.STALE_CAPACITY,
                    f"capacity seq {seq} is not newer than {session.capacity_seq}",
                    report="capacity",
                    session_id=session_id,
                )
                return plan, session
            after = evolve(
                session, capabilities=caps, max_concurrency=max_concurrency, capacity_seq=seq
            )
            plan.session_writes.append((session, after))
            plan.events.append(
                Event(
                    kind="session.capacity",
                    session_id=session_id,
                    data={"seq": seq, "max_concurrency": max_concurrency},
                )
            )
            return plan, after

        return self._run_plan(build)

    def session_drain(self, session_id: str, epoch: int | None = None) -> Session:
        """Durably stop new claims for the session; running attempts carry on.

        A worker's own drain carries its epoch and is fenced like any report; an
        operator's drain (``epoch=None``) applies to whichever epoch is current, and on
        PostgreSQL tells the other nodes (``NOTIFY orbit_ready``, payload
        ``<origin>:drained:<session id>``), so that the one holding the session's
        connection pushes it ``drain`` (the node that drained it pushes it itself). It
        is sent again by a repeated drain: the worker may have missed the first.
        """

        def build(tx: _Tx) -> tuple[Plan, Session]:
            plan = Plan()
            _wait_for_claims(tx)
            session = tx.session(session_id, lock=True)
            if epoch is None:
                tx.write_batch(notify=[("orbit_ready", f"{self.origin}:drained:{session_id}")])
            if epoch is not None and epoch != session.epoch:
                plan.reject(
                    Code.FENCED_EPOCH,
                    transitions.fenced_epoch_message(epoch, session.epoch),
                    report="drain",
                    session_id=session_id,
                    data={"epoch": epoch, "current_epoch": session.epoch},
                )
                return plan, session
            if session.draining:
                return plan, session
            after = evolve(session, draining=True)
            plan.session_writes.append((session, after))
            plan.events.append(Event(kind="session.draining", session_id=session_id))
            return plan, after

        return self._run_plan(build)

    def session_release_claims(self, session_id: str, epoch: int) -> int:
        """Release every attempt the session has claimed but not started (attempt
        ``released``, task back to ``queued``; event code ``TOKEN_REVOKED``) if ``epoch``
        is still its current one; how many. The server calls it when it closes the
        session's connection because the token that opened it was revoked: the worker
        can no longer start them, and a claimed attempt has done nothing (start is the
        point of no return), so another worker need not wait for its claim lease. A
        start that comes later is refused (``ATTEMPT_ENDED``); running attempts keep
        their run leases. Nothing is released once the session has been resumed since
        (``epoch`` fenced): its new connection, whose token is good, holds them. The
        session itself stays live: the worker may resume it with a new token."""

        def build(tx: _Tx) -> tuple[Plan, int]:
            plan = Plan()
            # As the session expiry: a claim in flight commits first (its attempts are
            # released with the others), and a resume cannot bump the epoch meanwhile.
            _wait_for_claims(tx)
            claimed = _claimed_by(tx, session_id)
            session = tx.session(session_id, lock=True)
            if session.epoch != epoch or not claimed:
                return plan, 0
            transitions.release_claims(plan, claimed, tx.now(), Code.TOKEN_REVOKED)
            return plan, len(claimed)

        return self._run_plan(build)

    # ------------------------------------------------------------------ claim

    def attempt_claim_many(self, session_id: str, epoch: int, n: int) -> Grants:
        """Claim up to ``n`` ready tasks for a session, within every cap and rate."""
        check_int("n", n, 1, self.config.max_batch)

        def build(tx: _Tx) -> tuple[Plan, Grants]:
            plan = Plan()
            tx.prelude("claim_lock")  # sent with the reads below, and held before them
            # Everything a claim weighs, then the clock, read after the claim lock in one
            # round trip (one statement on PostgreSQL). Claims are serialised by that lock,
            # so queue rows need no lock here: only claims write the token buckets, and a
            # pause racing a claim is caught by start.
            found, queue_rows, live, tenant_rows, setting = tx.lock_many(
                ("session_get", {"id": session_id}),
                ("queue_all", {}),
                ("attempt_live_counts", {}),
                ("tenant_caps", {}),
                ("setting_get", {"name": "global_max_concurrency"}),
            )
            if not found:
                raise _no_session(session_id)
            session = R.session_from_row(found[0])
            queues = {q.name: q for q in (R.queue_from_row(r) for r in queue_rows)}
            now = tx.clock()
            reason = transitions.session_usable(session, epoch, now)
            if reason is not None:
                # A refused claim changes nothing and holds nothing: it is answered, not
                # logged (an idle worker's dispatcher would otherwise flood the log).
                raise Rejected(reason[0], reason[1])
            occ = Occupancy(0, {}, {}, {}, 0)
            for row in live:
                k = int(row["n"])
                occ.total += k
                occ.by_queue[row["queue"]] = occ.by_queue.get(row["queue"], 0) + k
                occ.by_tenant[row["tenant"]] = occ.by_tenant.get(row["tenant"], 0) + k
                if row["session_id"] == session.id:
                    occ.by_handler[row["handler"]] = occ.by_handler.get(row["handler"], 0) + k
                    occ.session_total += k
            tenant_caps = {r["name"]: int(r["max_concurrency"]) for r in tenant_rows}
            global_cap = _int_or_none(setting[0]["int_value"]) if setting else None
            grants = self._claim(
                tx, plan, session, queues, occ, tenant_caps, global_cap, n=n, now=now
            )
            return plan, grants

        # A claim commits without waiting for the disk. It only reserves: nothing has run,
        # no attempt is used, and every report about it (start, finish, release) is a
        # durable commit that makes the claim durable first. If a database crash undoes
        # a claim, its task is queued again and the worker's start of the vanished
        # attempt is refused (NOT_FOUND), so nothing runs on a claim that was lost. What
        # it buys: no disk flush on the way from submit to start, and the claim lock
        # (held until commit) no longer waits for one.
        return self._run_plan(build, durable=False)

    def _claim(
        self,
        tx: _Tx,
        plan: Plan,
        session: Session,
        queues: dict[str, Queue],
        occ: Occupancy,
        tenant_caps: dict[str, int],
        global_cap: int | None,
        *,
        n: int,
        now: int,
    ) -> Grants:
        tokens = {name: bucket_refill(q, now) for name, q in queues.items()}
        # The instant the buckets hold their tokens at: ``now`` moves on below (the clock
        # read again after each window's locks), and a bucket written back stamped with
        # that later instant lost the refill between the two reads, a claim's round trip
        # and select at every claim (a queue drained at about 85 % of its rate).
        refilled_at = now
        # each handler's capacity, looked up per row read (``capacity_for`` walks the list)
        capacity = {c.handler: c.capacity for c in session.capabilities}
        used: dict[str, int] = {}
        grants = Grants()
        skip_ids: list[str] = []
        payload_bytes = 0
        short: set[str] = set()  # rate-limited queues that held back for want of a token
        for _ in range(8):
            mine = min(n - len(grants), session.max_concurrency - occ.session_total)
            want = mine if global_cap is None else min(mine, global_cap - occ.total)
            handlers = [
                c.handler
                for c in session.capabilities
                if occ.by_handler.get(c.handler, 0) < c.capacity
            ]
            # a capacity or cap is full: a freed permit matters
            if mine <= 0 or len(handlers) < len(session.capabilities):
                grants.blocked = grants.own = True  # its slots, a handler's, the claim's size
            elif want <= 0:
                grants.blocked = True  # the global cap
            if want <= 0 or not handlers:
                break
            capped = [
                name
                for name, q in queues.items()
                if occ.by_queue.get(name, 0) >= q.max_concurrency or tokens[name] < 1.0
            ]
            short.update(name for name in capped if tokens[name] < 1.0)
            skip_queues = sorted({*capped, *(name for name, q in queues.items() if q.paused)})
            skip_tenants = [t for t, cap in tenant_caps.items() if occ.by_tenant.get(t, 0) >= cap]
            if capped or skip_tenants:
                grants.blocked = True
            room = room_for_all(
                want,
                occ,
                queues={name: q for name, q in queues.items() if name not in skip_queues},
                tokens=tokens,
                tenant_caps={t: c for t, c in tenant_caps.items() if t not in skip_tenants},
                handler_caps={h: capacity[h] for h in handlers},
            )
            # With room everywhere every row is granted, so read exactly what is wanted;
            # otherwise a margin, for the rows a cap will turn away.
            window = want if room else want * 2 + 8
            ready = tx.fetch_table(
                "task_ready_select",
                now=now,
                handlers=handlers,
                skip_queues=skip_queues,
                skip_tenants=skip_tenants,
                skip_ids=skip_ids,
                limit=window,
            )
            # The clock again, now that these rows are locked: a release that committed
            # while we waited must not end after our claim begins. PostgreSQL read it
            # with the last row, after every lock (`locked_at`); nothing locked, nothing
            # to time.
            if ready.rows:
                now = tx.now_from(ready.rows[-1][ready.names.index("locked_at")])
            for task in R.tasks_from_table(ready):
                if len(grants) >= n:
                    break  # the rest stay ready: the round ends below
                size = _utf8_len(task.payload)
                if grants and payload_bytes + size > CLAIM_PAYLOAD_BYTES:
                    grants.more = True  # this one and the rest stay ready for the next
                    break
                queue = queues[task.queue]
                if task.deadline is not None and now >= task.deadline:
                    skip_ids.append(task.id)  # the reaper ends it; no permit involved
                    continue
                if tokens[task.queue] < 1.0:
                    skip_ids.append(task.id)
                    grants.blocked = True
                    short.add(task.queue)
                    continue
                if not occ.admit(  # by position: it runs for every row read
                    task.queue,
                    task.tenant,
                    task.handler,
                    queue.max_concurrency,
                    tenant_caps.get(task.tenant),
                    capacity.get(task.handler, 0),
                    session.max_concurrency,
                    global_cap,
                ):
                    skip_ids.append(task.id)
                    grants.blocked = True
                    if (
                        occ.by_handler.get(task.handler, 0) >= capacity.get(task.handler, 0)
                        or occ.session_total >= session.max_concurrency
                    ):
                        grants.own = True  # not (only) a queue's, a tenant's or the global cap
                    continue
                skip_ids.append(task.id)
                tokens[task.queue] -= 1.0
                used[task.queue] = used.get(task.queue, 0) + 1
                attempt = transitions.claim(
                    plan,
                    task,
                    session,
                    attempt_id=self._new_id(now),
                    now=now,
                    claim_ttl=self.config.claim_ttl_us,
                )
                # assemble(): the frozen __init__ set its two fields one call each
                grants.append(
                    assemble(Grant, {"task": plan.task_writes[-1][1], "attempt": attempt})
                )
                payload_bytes += size
            if len(grants) >= n or grants.more:
                grants.blocked = grants.own = True  # more may be ready than were asked for
                break
            if len(ready.rows) < window:
                break
        else:
            # Ran out of rounds, not out of ready tasks: with more capped queues or
            # tenants ahead in claim order than rounds, each round granted one of them and
            # capped it for the next, and tasks behind them that no cap holds stayed
            # hidden. Claim again now (the next claim skips those scopes from its first
            # round), rather than wait for a freed permit or the poll; a claim that
            # granted nothing found only rows that no claim can take now (past their
            # deadline, the reaper's), and claiming again would read them again.
            grants.blocked = grants.own = True
            grants.more = bool(grants)
        grants.full = occ.session_total >= session.max_concurrency or all(
            occ.by_handler.get(c.handler, 0) >= c.capacity for c in session.capabilities
        )
        waits = [
            token_wait_us(tokens[name], queues[name].rate)
            for name in short
            if not queues[name].paused  # a resume wakes the dispatcher itself
        ]
        grants.token_wait_us = min((w for w in waits if w), default=None)
        # The buckets a grant took from, and any stamped later than now (the clock went
        # back), which refill from now on once written back stamped now.
        ahead = (name for name, q in queues.items() if bucket_stamped_ahead(q, refilled_at))
        limited = [
            {"name": name, "tokens": tokens[name], "tokens_at": refilled_at}
            for name in sorted(used.keys() | ahead)
            if queues[name].rate > 0
        ]
        tx.write_many("queue_tokens_write_many", limited, expect=len(limited))
        return grants

    # ------------------------------------------------------------------ worker reports

    def _report_rows(
        self, tx: _Tx, attempt_id: str, session_id: str
    ) -> tuple[Task, Attempt, Session]:
        found = tx.fetch("attempt_get", id=attempt_id)
        if not found:
            raise OrbitError(Code.ATTEMPT_NOT_FOUND, f"no attempt {attempt_id!r:.80}")
        task_id = found[0]["task_id"]
        task = R.task_from_row(tx.fetch("task_lock_many", ids=[task_id])[0])
        attempt = R.attempt_from_row(tx.fetch("attempt_lock_many", ids=[attempt_id])[0])
        session = tx.session(session_id, lock=False, share=True)
        return task, attempt, session

    def _report_batch(
        self,
        tx: _Tx,
        attempt_ids: Sequence[str],
        session_id: str,
        *,
        queues: bool = False,
        write_session: bool = False,
        starts: bool = False,
    ) -> tuple[dict[str, Task], dict[str, Attempt], Session, dict[str, bool]]:
        """Lock the tasks, then the attempts, of a batch of reports (always in that order
        and by id, as every transaction does, so batches never deadlock), share their
        session (lock it instead with ``write_session``: a renewal extends it) and, with
        ``queues``, their queues (name -> paused), then read the clock: one round trip on
        PostgreSQL (``Connection.lock_tables``). The tasks come without their payload (an
        empty string): no report reads it, and it can be large. With ``starts`` they come
        with only the fields a start reads or writes back (``task_lock_for_starts``,
        ``rows.start_tasks_from_table``): for a start, the other columns' conversion (in
        psycopg and into the record) was most of the tasks' share of its CPU. The tasks
        and attempts come as tuples (``lock_tables``), made into records by position:
        a batch has hundreds."""
        ids = sorted(set(attempt_ids))
        calls: list[tuple[str, dict[str, Any]]] = [
            ("task_lock_for_starts" if starts else "task_lock_for_attempts", {"ids": ids}),
            ("attempt_lock_many", {"ids": ids}),
            ("session_lock" if write_session else "session_share", {"id": session_id}),
        ]
        if queues:
            calls.append(("queue_share_for_attempts", {"ids": ids}))
        found = tx.lock_tables(*calls)
        if not found[2].rows:
            raise _no_session(session_id)
        to_tasks = R.start_tasks_from_table if starts else R.tasks_from_table
        tasks = {t.id: t for t in to_tasks(found[0])}
        attempts = {a.id: a for a in R.attempts_from_table(found[1])}
        paused = {r["name"]: bool(r["paused"]) for r in found[3].dicts()} if queues else {}
        return tasks, attempts, R.session_from_row(found[2].dicts()[0]), paused

    def attempt_start(self, session_id: str, epoch: int, attempt_id: str, fence: int) -> Lease:
        """claimed -> running. A repeat of an accepted start returns the same lease."""
        (result,) = self.attempt_start_many(session_id, epoch, [(attempt_id, fence)])
        if isinstance(result, OrbitError):
            raise result
        return result

    def attempt_start_many(
        self, session_id: str, epoch: int, items: Sequence[tuple[str, int]]
    ) -> list[Lease | OrbitError]:
        """Start many claimed attempts in one transaction (one commit for the batch).

        Each attempt is judged on its own, exactly as a single start would be: the answer
        for each is its lease or the error that refused it (a refusal is recorded as
        evidence and changes nothing else), in the order given.
        """
        _check_batch([attempt_id for attempt_id, _ in items], self.config.max_batch)

        def build(tx: _Tx) -> tuple[Plan, list[Lease | OrbitError]]:
            plan = Plan()
            tasks, attempts, session, paused = self._report_batch(
                tx, [i for i, _ in items], session_id, queues=True, starts=True
            )
            now = tx.clock()
            answers: list[Lease | OrbitError] = []
            for attempt_id, fence in items:
                attempt = attempts.get(attempt_id)
                if attempt is None:
                    answers.append(_no_attempt(attempt_id))
                    continue
                task = tasks[attempt.task_id]
                lease = transitions.start(
                    plan,
                    task,
                    attempt,
                    session,
                    epoch=epoch,
                    fence=fence,
                    queue_paused=paused.get(task.queue, False),
                    now=now,
                    lease_ttl=self.config.lease_ttl_us,
                )
                answers.append(_answer(plan, lease))
            return plan, answers

        return self._run_plan(build)

    def lease_renew_many(
        self, session_id: str, epoch: int, attempt_ids: Sequence[str]
    ) -> list[Lease]:
        """Renew many run leases in one statement; also keeps the session alive."""
        ids = sorted(set(attempt_ids))
        if len(ids) > self.config.max_batch:
            raise OrbitError(Code.INVALID_ARGUMENT, "too many attempts in one renew")

        def build(tx: _Tx) -> tuple[Plan, list[Lease]]:
            plan = Plan()
            tasks, attempts, stored, _ = self._report_batch(tx, ids, session_id, write_session=True)
            now = tx.clock()
            reason = transitions.session_usable(evolve(stored, draining=False), epoch, now)
            leases: list[Lease] = []
            session = stored
            if reason is None:
                session = evolve(stored, expires_at=now + self.config.session_ttl_us)
            for attempt_id in ids:
                attempt = attempts.get(attempt_id)
                if attempt is None:
                    leases.append(Lease(attempt_id, "lost", None))
                    continue
                task = tasks[attempt.task_id]
                if reason is not None:
                    plan.reject(
                        reason[0],
                        reason[1],
                        report="renew",
                        task=task,
                        attempt=attempt,
                        session_id=session_id,
                    )
                    plan.rejection = None  # per-attempt answers, not one error
                    leases.append(Lease(attempt_id, "lost", None))
                    continue
                leases.append(
                    transitions.renew(
                        plan,
                        task,
                        attempt,
                        session,
                        epoch=epoch,
                        now=now,
                        lease_ttl=self.config.lease_ttl_us,
                    )
                )
                plan.rejection = None
            if reason is None:
                plan.session_writes.append((stored, session))
            order = {a: i for i, a in enumerate(attempt_ids)}
            leases.sort(key=lambda lease: order.get(lease.attempt_id, 0))
            return plan, leases

        return self._run_plan(build)

    def attempt_finish(
        self, session_id: str, epoch: int, attempt_id: str, fence: int, outcome: Outcome
    ) -> Receipt:
        """Commit an attempt's outcome, or refuse it with a precise code (I2, I3)."""
        (result,) = self.attempt_finish_many(session_id, epoch, [(attempt_id, fence, outcome)])
        if isinstance(result, OrbitError):
            raise result
        return result

    def attempt_finish_many(
        self, session_id: str, epoch: int, items: Sequence[tuple[str, int, Outcome]]
    ) -> list[Receipt | OrbitError]:
        """Commit many attempts' outcomes in one transaction: nothing is acknowledged
        before the commit that makes it durable, and a batch costs one commit.

        Each report is judged on its own, exactly as a single finish would be; the answer
        for each is its receipt or the error that refused it, in the order given.
        """
        _check_batch([attempt_id for attempt_id, _, _ in items], self.config.max_batch)
        # Each outcome checked, and spelled, once: before any row is touched, and not
        # again for each try of the transaction (see ``_spelled_outcome``).
        spelled = {attempt_id: _spelled_outcome(outcome) for attempt_id, _, outcome in items}

        def build(tx: _Tx) -> tuple[Plan, list[Receipt | OrbitError]]:
            plan = Plan()
            digests = transitions.Digests()
            valid = [i for i, _, _ in items if not isinstance(spelled[i], OrbitError)]
            tasks, attempts, session, _ = self._report_batch(tx, valid, session_id)
            now = tx.clock()
            answers: list[Receipt | OrbitError] = []
            for attempt_id, fence, outcome in items:
                spelling = spelled[attempt_id]
                attempt = attempts.get(attempt_id)
                if isinstance(spelling, OrbitError):
                    answers.append(spelling)
                    continue
                if attempt is None:
                    answers.append(_no_attempt(attempt_id))
                    continue
                receipt = transitions.finish(
                    plan,
                    tasks[attempt.task_id],
                    attempt,
                    session,
                    epoch=epoch,
                    fence=fence,
                    outcome=outcome,
                    spelled=spelling,
                    now=now,
                    rand=self._rand(),
                    digests=digests,
                )
                answers.append(_answer(plan, receipt))
            plan.receipt = None
            return plan, answers

        return self._run_plan(build)

    def attempt_release(self, session_id: str, epoch: int, attempt_id: str, fence: int) -> None:
        """Give back a claimed, never-started attempt."""

        def build(tx: _Tx) -> tuple[Plan, None]:
            plan = Plan()
            task, attempt, session = self._report_rows(tx, attempt_id, session_id)
            transitions.release(
                plan, task, attempt, session, epoch=epoch, fence=fence, now=tx.now()
            )
            return plan, None

        self._run_plan(build)

    def attempt_progress(
        self,
        session_id: str,
        epoch: int,
        attempt_id: str,
        fence: int,
        *,
        fraction: float | None = None,
        message: str | None = None,
    ) -> None:
        """Record how far a running attempt has got (an event; no state changes)."""
        if fraction is not None and not (
            isinstance(fraction, int | float) and 0.0 <= fraction <= 1.0
        ):
            raise OrbitError(Code.INVALID_ARGUMENT, "progress fraction must be in [0, 1]")
        if message is not None and (
            not isinstance(message, str) or len(message) > 500 or "\x00" in message
        ):
            raise OrbitError(Code.INVALID_ARGUMENT, "progress message is at most 500 characters")
        data: dict[str, Any] = {"fraction": fraction, "message": message}

        def build(tx: _Tx) -> tuple[Plan, None]:
            plan = Plan()
            task, attempt, session = self._report_rows(tx, attempt_id, session_id)
            transitions.progress(
                plan, task, attempt, session, epoch=epoch, fence=fence, now=tx.now(), data=data
            )
            return plan, None

        self._run_plan(build)

    # ------------------------------------------------------------------ artifacts

    def artifact_begin(
        self,
        session_id: str,
        epoch: int,
        attempt_id: str,
        fence: int,
        *,
        name: str,
        content_type: str,
        ttl_us: int | None = None,
        sha256: str | None = None,
    ) -> str | Artifact:
        """Open an upload for a running attempt (fenced like any report); return its id.

        ``sha256``, the digest the upload declares it holds, makes a repeat safe: when the
        attempt has committed an artifact of this name with that digest (the upload sent
        again, its reply lost), that artifact is returned instead, nothing written.
        Without it, or with another digest, the name is ARTIFACT_EXISTS."""
        check_name("artifact name", name)
        problem = content_type_problem(content_type)
        if problem is not None:
            raise OrbitError(Code.INVALID_ARGUMENT, problem)
        ttl = self.config.artifact_ttl_us if ttl_us is None else ttl_us
        check_int("ttl", ttl, SECOND, MAX_DURATION_US)
        if sha256 is not None:
            sha256 = str(sha256).lower()  # as hexdigest() wrote the stored one
            if len(sha256) != 64 or not set(sha256) <= set("0123456789abcdef"):
                raise OrbitError(Code.INVALID_ARGUMENT, "sha256 must be 64 hex digits")

        def build(tx: _Tx) -> tuple[Plan, str | Artifact | None]:
            plan = Plan()
            task, attempt, session = self._report_rows(tx, attempt_id, session_id)
            now = tx.now()
            if not transitions.check_artifact(
                plan, task, attempt, session, epoch=epoch, fence=fence, now=now
            ):
                return plan, None
            artifact_id = self._new_id(now)
            # An upload of this name left unfinished would hold the name for the rest of
            # the attempt: one whose server was killed mid-body is never aborted.
            tx.execute("artifact_uploading_delete", attempt_id=attempt.id, name=name)
            # expires_at - created_at holds the TTL until the commit counts it from there;
            # the reaper expires only committed artifacts (an unfinished upload goes once
            # its attempt has ended: artifact_abandoned_delete).
            made = tx.fetch(
                "artifact_insert",
                id=artifact_id,
                task_id=task.id,
                attempt_id=attempt.id,
                name=name,
                content_type=content_type,
                now=now,
                expires_at=now + ttl,
            )
            if made:
                return plan, artifact_id
            # The name is committed already (its unfinished upload was deleted above).
            stored = (
                tx.fetch("artifact_ready_named", attempt_id=attempt.id, name=name)
                if sha256 is not None
                else []
            )
            if stored and stored[0]["sha256"] == sha256 and int(stored[0]["expires_at"]) > now:
                return plan, R.artifact_from_row(stored[0])
            if sha256 is None:
                why = (
                    ": send the bytes' sha256 (X-Orbit-Sha256), and a repeat of the upload "
                    "that stored them is answered with that artifact"
                )
            elif stored and stored[0]["sha256"] == sha256:
                why = ", expired"
            else:
                why = ", of other bytes (another sha256)"
            raise OrbitError(
                Code.ARTIFACT_EXISTS, f"the attempt already has an artifact named {name}{why}"
            )

        begun = self._run_plan(build)
        assert begun is not None
        return begun

    def artifact_write(self, artifact_id: str, seq: int, data: bytes) -> None:
        """Store one chunk of an upload (each chunk its own short transaction)."""
        written = self._tx(
            lambda tx: tx.execute(
                "artifact_chunk_insert", artifact_id=artifact_id, seq=seq, data=data
            )
        )
        if written != 1:
            raise OrbitError(Code.INVALID_STATE, "the artifact is not being uploaded")

    def artifact_commit(
        self,
        session_id: str,
        epoch: int,
        attempt_id: str,
        fence: int,
        artifact_id: str,
        *,
        size: int,
        sha256: str,
    ) -> Artifact:
        """Make an upload visible, if the attempt is still ours; evidence otherwise.

        The artifact takes its place in its task's list (``ready_seq``) here, while the
        transaction holds the task's row lock (``_report_rows``): two commits of one
        task's artifacts take turns, so the later one always draws the larger number, and
        a reader paging on from its last cursor never has one added behind it. The id,
        made when the upload began, was the list's key: an upload committed after a
        reader's page, but begun before its last artifact, sorted before its cursor."""

        def build(tx: _Tx) -> tuple[Plan, Artifact | None]:
            plan = Plan()
            task, attempt, session = self._report_rows(tx, attempt_id, session_id)
            found = tx.fetch("artifact_lock", id=artifact_id)
            now = tx.now()
            # The fence first: an attempt that ended (its lease run out, the reaper's pass
            # then dropping its unfinished upload) is refused for that, with its evidence,
            # as every late report is, not for the upload it no longer has.
            if not transitions.check_artifact(
                plan, task, attempt, session, epoch=epoch, fence=fence, now=now
            ):
                return plan, None
            if not found:
                # The id was this upload's own (its begin made it): a later begin of its
                # name replaced it (the worker's retry of an upload it took for stuck), or
                # it was aborted. A conflict, as for its chunks (artifact_write), not 404.
                raise OrbitError(
                    Code.INVALID_STATE,
                    f"upload {artifact_id!r:.80} is no longer open: a later upload of its "
                    "name replaced it, or it was aborted",
                )
            if found[0]["attempt_id"] != attempt_id:
                raise OrbitError(Code.ARTIFACT_NOT_FOUND, f"no upload {artifact_id!r:.80}")
            found_seq = tx.fetch("artifact_ready_seq")
            if not found_seq:  # SQLite's counter row deleted by hand (PostgreSQL: a sequence)
                found_seq = tx.fetch("artifact_ready_seq_first")
            drawn = int(found_seq[0]["ready_seq"])
            # Kept for its TTL from now: the begin wrote begin + TTL, and counted from
            # there an upload slower than its TTL was committed already expired.
            expires_at = now + int(found[0]["expires_at"]) - int(found[0]["created_at"])
            made = tx.execute(
                "artifact_ready",
                id=artifact_id,
                size=size,
                sha256=sha256,
                ready_seq=drawn,
                expires_at=expires_at,
            )
            if made:
                ready_seq = drawn
            else:  # ready already: its own place and expiry
                ready_seq, expires_at = found[0]["ready_seq"], int(found[0]["expires_at"])
            artifact = R.artifact_from_row(
                {**found[0], "state": "ready", "size": size, "sha256": sha256}
                | {"ready_seq": ready_seq, "expires_at": expires_at}
            )
            plan.note(
                "artifact",
                task,
                attempt,
                session,
                {
                    "artifact_id": artifact_id,
                    "name": artifact.name,
                    "size": size,
                    "sha256": sha256,
                    "content_type": artifact.content_type,
                },
            )
            return plan, artifact

        artifact = self._run_plan(build)
        assert artifact is not None
        return artifact

    def artifact_disk_room(self) -> tuple[int, int] | None:
        """``(free, reserve)`` in bytes: what the file system of a SQLite database has
        free now (with the free pages inside the file), and what an upload must leave of
        it (``StoreConfig.artifact_disk_reserve_bytes``) for the node's other writes,
        the upload's own delete and the reaper's. None on PostgreSQL (its server's disk
        is not the node's to see) and for an in-memory database."""
        space = self.driver.disk_space()
        if space is None:
            return None
        free, size = space
        # The file's own free pages: after a large upload was dropped they hold its
        # space, and the disk's free space alone refused every upload after it.
        free += int(self._read("database_free_bytes")[0]["free"])
        reserve = self.config.artifact_disk_reserve_bytes
        if reserve is None:
            reserve = min(DISK_RESERVE_BYTES, size // 20)
        return free, reserve

    def artifact_abort(self, artifact_id: str) -> None:
        """Drop an upload that failed half-way (its chunks go with it; on SQLite first,
        a few at a time: ``_shed_chunks``)."""
        if self.backend == "sqlite":
            self._shed_chunks(artifact_id)
        self._tx(lambda tx: tx.execute("artifact_delete", id=artifact_id))

    def _shed_chunks(self, artifact_id: str) -> None:
        """Delete an artifact's chunks ``SHED_CHUNKS`` at a time, each batch a
        transaction of its own (SQLite), before its row goes. SQLite is commonly built
        with SECURE_DELETE (Debian's is), which overwrites every page a delete frees: one
        transaction that deleted a large upload whole wrote as much to the ``-wal`` as
        the upload had, and on a disk the upload had nearly filled it failed, and the
        chunks stayed. Between small transactions the ``-wal`` is checkpointed and
        written again from its start, so the drop needs little more free space than
        one batch. Only for an artifact nothing can commit or read any more: a failed
        upload, one whose attempt has ended, one expired past its grace."""
        while self._tx(
            lambda tx: tx.execute(
                "artifact_chunks_shed", artifact_id=artifact_id, limit=SHED_CHUNKS
            )
        ):
            pass

    def _shed_doomed(self) -> None:
        """Shed the chunks (``_shed_chunks``) of the artifacts the reaper's next two
        passes delete (SQLite): the uploads of ended attempts, the artifacts expired
        past their grace. A pass that deleted them whole needed free space for all of
        their bytes, and failed every time on a disk without it, and the whole reap
        with it: leases were no longer expired. Read outside a transaction: a pass
        with nothing to shed takes no write lock for it."""
        limit = self.config.reap_batch
        expired_before = self._now() - self.config.artifact_grace_us
        expired = self._read("artifact_expired_select", expired_before=expired_before, limit=limit)
        abandoned = self._read("artifact_abandoned_select", limit=limit)
        for row in (*expired, *abandoned):
            self._shed_chunks(str(row["id"]))

    def artifact_get(self, artifact_id: str) -> Artifact:
        """A ready artifact, not of a cancelled attempt (nor of the live attempt of a task
        being cancelled, which can only end cancelled: cancel wins from the moment it is
        asked), and not expired by the store's clock: an expired one is gone even before
        the reaper's pass deletes it."""

        def read(tx: _Tx) -> tuple[list[Row], int]:
            return tx.fetch("artifact_get", id=artifact_id), tx.now()

        found, now = self._tx(read)
        if (
            not found
            or found[0]["state"] != "ready"
            or found[0]["attempt_state"] == "cancelled"
            or (
                found[0]["task_state"] == "cancelling"
                and found[0]["attempt_state"] in ("claimed", "running")
            )
            or int(found[0]["expires_at"]) <= now
        ):
            raise OrbitError(Code.ARTIFACT_NOT_FOUND, f"no artifact {artifact_id!r:.80}")
        return R.artifact_from_row(found[0])

    def artifact_list(
        self,
        task_id: str,
        *,
        after_seq: int = 0,
        after_id: str | None = None,
        limit: int = 100,
    ) -> list[Artifact]:
        """The task's artifacts that ``artifact_get`` would serve, in the order their
        uploads were committed, after the one whose ``ready_seq`` is ``after_seq`` (0:
        from the first): keyset pagination that a reader can follow, as the event feed
        (``artifact_commit`` says why nothing is ever added behind a position read).
        ``after_id`` (in place of ``after_seq``): after that artifact of the task, what a
        cursor issued before this order stands for; one that names no ready artifact of
        the task is INVALID_ARGUMENT, never a page from wherever its id would sort.

        An ``after_seq`` past every place ever drawn is INVALID_ARGUMENT too: its empty
        page would read as "nothing new yet" for ever after, and the reader holding it
        would never see the artifacts to come, those of places below it. The bound is the
        counter that draws places for every task (``artifact_ready_seq_last``): expired
        artifacts are deleted, so the rows cannot tell an old cursor from a forged one,
        and nothing keeps a task's own largest place. It is read only for an empty page:
        a place that has artifacts after it was drawn."""
        check_int("limit", limit, 1, 1000)
        check_int("after_seq", after_seq, 0, 2**63 - 1)

        def read(tx: _Tx) -> list[Row]:
            after = after_seq
            if after_id is not None:
                found = tx.fetch("artifact_seq", id=after_id, task_id=task_id)
                if not found:
                    raise OrbitError(
                        Code.INVALID_ARGUMENT, f"no artifact {after_id!r:.80} of this task"
                    )
                after = int(found[0]["ready_seq"])
            rows = tx.fetch(
                "artifact_list", task_id=task_id, after_seq=after, limit=limit, now=tx.now()
            )
            if not rows and after > int(tx.fetch("artifact_ready_seq_last")[0]["ready_seq"]):
                raise OrbitError(Code.INVALID_ARGUMENT, f"no artifact was ever given place {after}")
            return rows

        return [R.artifact_from_row(r) for r in self._tx(read)]

    def artifact_chunks(self, artifact_id: str) -> Iterator[bytes]:
        """The artifact's bytes, one stored chunk at a time (never all in memory), each
        read in a transaction of its own. A download that began before the artifact
        expired reads on to its end: the reaper deletes the chunks only
        ``StoreConfig.artifact_grace_us`` after the expiry, while ``artifact_get`` refuses
        to start one from the expiry on."""
        seq = 0
        while True:
            found = self._read("artifact_chunk_get", artifact_id=artifact_id, seq=seq)
            if not found:
                return
            yield bytes(found[0]["data"])
            seq += 1

    # ------------------------------------------------------------------ operator actions

    def task_cancel(self, task_id: str) -> Task:
        """Cancel a task and all its descendants in one transaction (I7). Idempotent.

        A tree that has all ended is answered from reads alone (``_tree_ended``): its
        task as it is, nothing written. Locking it changed nothing either, yet locked
        every row, on SQLite under the write lock that every other request of the node
        waits for: re-issuing the cancel of a 100,000-task tree (after the first
        outlived its client's 30 s) stalled the node 11 s for nothing."""
        ended = self._tree_ended(task_id)
        if ended is not None:
            return ended

        def build(tx: _Tx) -> tuple[Plan, Task]:
            tasks = _lock_tree(tx, task_id)
            ids = [t.id for t in tasks]
            live = {
                a.task_id: a
                for a in (
                    R.attempt_from_row(r) for r in tx.fetch("attempt_live_for_tasks", task_ids=ids)
                )
            }
            now = tx.now()
            plan = Plan()
            for task in tasks:
                transitions.cancel(plan, task, live.get(task.id), now)
            root = next(t for t in tasks if t.id == task_id)
            written = {after.id: after for _, after in plan.task_writes}
            return plan, written.get(task_id, root)

        return self._run_plan(build)

    def _tree_ended(self, task_id: str) -> Task | None:
        """The task, if it and all its descendants have ended (succeeded, failed or
        cancelled), read with no lock and no write transaction; None otherwise (or if
        there is no such task), for ``task_cancel``'s locking path to decide.

        The tree is walked a level per read (``_subtrees``, each read its own
        transaction), then checked in one statement, ``task_tree_ended``, which sees one
        instant: the task's row version, and the children of every task walked, how many
        and how many live. A task is never deleted and never changes parent, so those
        children include every task walked but the task itself; no more of them means
        the walk missed none (a child submitted meanwhile). Then, at that instant, the
        task was as first read (same ``version``) and every task of its tree (the task,
        or a child of one of the tree's tasks, so one of those counted) had ended: a
        cancel then would have changed nothing and answered the task as it was, which
        is this answer. Anything else sends the cancel down the locking path, unchanged.

        The race this leaves is benign: a retry of a task of the tree (or a new child's
        submit) that commits after that statement is answered as if the cancel had run
        just before it, which it might have. The locking path still locks the ended
        rows: a cancel that finds a live task must serialise with such a retry."""
        found = self._read("task_get", id=task_id)
        if not found:
            return None
        root = R.task_from_row(found[0])
        if not root.terminal:
            return None
        walked = _subtrees(self._read, [task_id])
        check = self._read("task_tree_ended", id=task_id, ids=sorted(walked))[0]
        ended = (
            check["version"] is not None
            and int(check["version"]) == root.version
            and int(check["children"]) == len(walked) - 1
            and int(check["live"]) == 0
        )
        return root if ended else None

    def task_resolve(self, task_id: str, decision: str, outcome: Outcome | None = None) -> Task:
        """An operator's decision on a ``needs_review`` task: succeeded, failed or retry."""
        if decision not in ("succeeded", "failed", "retry"):
            raise OrbitError(
                Code.INVALID_ARGUMENT, "decision must be 'succeeded', 'failed' or 'retry'"
            )
        # An outcome that the decision would drop is refused, not ignored: a result goes
        # with succeeded, an error with failed, nothing with retry.
        if outcome is not None and (decision == "retry" or outcome.ok != (decision == "succeeded")):
            kind = "a result" if outcome.ok else "an error"
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                f"{kind} does not go with decision {decision!r}: "
                "a result goes with 'succeeded', an error with 'failed'",
            )
        # The operator's result or error is stored as a worker's would be, so it passes the
        # same checks first: nested at most 64 levels, JSON, no NUL (which PostgreSQL's
        # text refuses and SQLite would have kept), and a result no larger than a finish
        # can carry (PAYLOAD_TOO_LARGE; a worker's runner fails it RESULT_TOO_LARGE).
        if outcome is not None:
            spelled = _spelled_outcome(outcome)
            if isinstance(spelled, OrbitError):
                raise spelled
            if spelled.result is not None:
                check_result_size(spelled.result)

        def build(tx: _Tx) -> tuple[Plan, Task]:
            found = tx.fetch("task_lock_many", ids=[task_id])
            if not found:
                raise OrbitError(Code.TASK_NOT_FOUND, f"no task {task_id!r:.80}")
            task = R.task_from_row(found[0])
            if task.state != TaskState.NEEDS_REVIEW:
                raise OrbitError(
                    Code.INVALID_STATE,
                    f"only a needs_review task can be resolved; it is {task.state}",
                )
            if decision == "retry":
                _refuse_under_cancelled(tx, task)
            now = tx.now()
            if decision == "retry":
                _refuse_past_deadline(task, now)
            plan = Plan()
            return plan, transitions.resolve(plan, task, decision, outcome, now)

        return self._run_plan(build)

    def task_retry(self, task_id: str) -> Task:
        """Run a failed or cancelled task again (an operator decision)."""

        def build(tx: _Tx) -> tuple[Plan, Task]:
            found = tx.fetch("task_lock_many", ids=[task_id])
            if not found:
                raise OrbitError(Code.TASK_NOT_FOUND, f"no task {task_id!r:.80}")
            task = R.task_from_row(found[0])
            if task.state not in (TaskState.FAILED, TaskState.CANCELLED):
                raise OrbitError(
                    Code.INVALID_STATE,
                    f"only a failed or cancelled task can be retried; it is {task.state}",
                )
            _refuse_under_cancelled(tx, task)
            now = tx.now()
            _refuse_past_deadline(task, now)
            plan = Plan()
            return plan, transitions.retry(plan, task, now)

        return self._run_plan(build)

    # ------------------------------------------------------------------ reaper

    def reap_due_in(self) -> float | None:
        """Seconds until the soonest instant a :meth:`reap` pass would find work, by the
        store's clock (zero or less if something is already due), or None if nothing is
        pending. The server's reaper sleeps until then (at most its interval), so a lease
        is acted on when it runs out rather than up to an interval later."""

        def read(tx: _Tx) -> float | None:
            grace = self.config.artifact_grace_us
            due = tx.fetch("reap_next_due", artifact_grace=grace)[0]["due"]
            return None if due is None else (int(due) - tx.now()) / 1_000_000

        return self._tx(read)

    def reap(self) -> ReapReport:
        """One pass of every clock-driven duty. Safe on every node at once: rows another
        node holds are skipped (SKIP LOCKED) and every write is a compare-and-set."""
        counts = {
            "artifacts_expired": 0,
            "uploads_dropped": 0,
            "released": 0,
            "expired_leases": 0,
            "deadlines": 0,
            "promoted": 0,
            "sessions_expired": 0,
        }

        def tasks_pass(tx: _Tx) -> Plan:
            now = tx.now()
            ids = [
                r["id"] for r in tx.fetch("reap_candidates", now=now, limit=self.config.reap_batch)
            ]
            plan = Plan()
            if not ids:
                return plan
            tasks = [
                R.task_from_row(r) for r in tx.fetch("task_lock_many_skip_locked", ids=sorted(ids))
            ]
            live = {
                a.task_id: a
                for a in (
                    R.attempt_from_row(r)
                    for r in tx.fetch("attempt_live_for_tasks", task_ids=[t.id for t in tasks])
                )
            }
            now = tx.now()
            for task in tasks:
                transitions.reap(plan, task, live.get(task.id), now, self._rand())
            tx.apply(plan, final=True)
            return plan

        def sessions_pass(tx: _Tx, limit: int) -> tuple[Plan, int]:
            """Up to ``limit`` lapsed sessions expired, their claimed attempts released;
            and how many were found lapsed (whether or not each could be expired)."""
            plan = Plan()
            found = tx.fetch("session_expired_select", now=tx.now(), limit=limit)
            if not found:
                return plan, 0
            ids = sorted(r["id"] for r in found)
            # A claim in flight may have read one of these sessions live, just before its
            # expiry. The claim lock waits for it to commit, so the attempts read below
            # include its and are released with the session's others. Every claim on every
            # node waits while it is held: what follows is a fixed few statements for the
            # whole batch, never a statement for each session.
            tx.prelude("claim_lock")
            claimed_task_ids: dict[str, list[str]] = {i: [] for i in ids}
            for r in tx.fetch("attempt_claimed_for_sessions", session_ids=ids):
                claimed_task_ids[r["session_id"]].append(r["task_id"])
            task_ids = sorted(t for held in claimed_task_ids.values() for t in held)
            # Under the claim lock a row lock is never waited for: a row another
            # transaction holds (a node cut off mid-report holds its locks until
            # PostgreSQL gives its connection up, hours later) stopped every reaper and
            # every claim of the cluster. A session whose row, or one of whose claimed
            # tasks, is held is left for a later pass; until then it can claim and start
            # nothing (its expiry is read by both).
            session_rows, task_rows = tx.lock_many(
                ("session_lock_many_skip_locked", {"ids": ids}),
                ("task_lock_many_skip_locked", {"ids": task_ids}),
            )
            now = tx.clock()
            tasks = {r["id"]: R.task_from_row(r) for r in task_rows}
            claimed: dict[str, list[tuple[Task, Attempt]]] = {i: [] for i in ids}
            if tasks:
                for row in tx.fetch("attempt_live_for_tasks", task_ids=sorted(tasks)):
                    attempt = R.attempt_from_row(row)
                    if attempt.state == "claimed" and attempt.session_id in claimed:
                        claimed[attempt.session_id].append((tasks[attempt.task_id], attempt))
            for session in (R.session_from_row(r) for r in session_rows):
                if session.state != SessionState.LIVE or session.expires_at > now:
                    continue
                if all(t in tasks for t in claimed_task_ids[session.id]):
                    transitions.expire_session(plan, session, claimed[session.id], now)
            tx.apply(plan, final=True)
            return plan, len(found)

        def artifacts_pass(tx: _Tx) -> int:
            # Expired before now - grace: a download begun just before its expiry ends
            # whole (StoreConfig.artifact_grace_us).
            expired_before = tx.now() - self.config.artifact_grace_us
            return len(
                tx.fetch(
                    "artifact_expired_delete",
                    expired_before=expired_before,
                    limit=self.config.reap_batch,
                )
            )

        def uploads_pass(tx: _Tx) -> int:
            stale_before = tx.now() - self.config.upload_max_us
            return len(
                tx.fetch(
                    "artifact_abandoned_delete",
                    stale_before=stale_before,
                    limit=self.config.reap_batch,
                )
            )

        def pull_back_pass(tx: _Tx) -> tuple[int, int, int]:
            """After the store's clock went back (``_stepped_from``, until it is back
            there): run leases, claim leases and sessions that end later than twice their
            TTL from now, each pulled back to now + its TTL; how many of each. Left, the
            ends granted before the step kept a dead worker's attempts, and their permits,
            for the length of the step (docs/reliability.md, "Clock steps"). Only then:
            a node whose TTL is longer, or this one before a restart with a shorter TTL,
            grants such ends too, and a worker, not told of a lease cut short, renews at
            half the lease it was given, too late. Not once the TTL from now, for the
            first. A new end writes no event, as a renew's writes none."""
            now = tx.now()
            if now >= self._stepped_from:
                self._stepped_from = 0  # the clock is back where it was: nothing is ahead
            cfg = self.config
            attempts = tx.fetch(
                "attempt_expiry_pull_back",
                claim_after=now + 2 * cfg.claim_ttl_us,
                claim_until=now + cfg.claim_ttl_us,
                lease_after=now + 2 * cfg.lease_ttl_us,
                lease_until=now + cfg.lease_ttl_us,
            )
            sessions = tx.fetch(
                "session_expiry_pull_back",
                after=now + 2 * cfg.session_ttl_us,
                until=now + cfg.session_ttl_us,
            )
            claims = sum(1 for r in attempts if r["state"] == "claimed")
            return len(attempts) - claims, claims, len(sessions)

        if self.backend == "sqlite":
            self._shed_doomed()
        counts["artifacts_expired"] = self._tx(artifacts_pass)
        counts["uploads_dropped"] = self._tx(uploads_pass)
        leases = claims = sessions = 0
        if self._stepped_from:
            leases, claims, sessions = self._tx(pull_back_pass)
        if leases or claims or sessions:
            _log.warning(
                "the database clock went back: %d run leases, %d claim leases and %d "
                "sessions ended later than twice their TTL from now; pulled back to now + TTL",
                leases,
                claims,
                sessions,
            )
        plans = [self._tx(tasks_pass)]
        # Lapsed sessions a batch at a time, each batch a transaction of its own, up to
        # reap_batch in all: the claim lock each batch holds is let go between them.
        left = self.config.reap_batch
        while left > 0:
            limit = min(left, SESSION_EXPIRY_BATCH)
            plan, lapsed = self._tx(partial(sessions_pass, limit=limit))
            plans.append(plan)
            left -= limit
            if lapsed < limit or not plan.events:
                break  # none left, or only sessions left for a later pass (rows held)
        for plan in plans:
            for event in plan.events:
                if event.kind == "session.expired":
                    counts["sessions_expired"] += 1
                elif event.kind == "queued" and event.task_from == TaskState.SCHEDULED:
                    counts["promoted"] += 1
                elif event.attempt_from == "running":
                    # A run lease that ran out, at the task's deadline too (renew caps a
                    # lease there): it was counted as a deadline alone, and missed by
                    # orbit_lease_expiries_total, which has no other source.
                    counts["expired_leases"] += 1
                    if event.code == Code.DEADLINE_EXCEEDED:
                        counts["deadlines"] += 1
                elif event.code == Code.DEADLINE_EXCEEDED:
                    counts["deadlines"] += 1
                elif event.attempt_from == "claimed":
                    counts["released"] += 1
        return ReapReport(**counts)


#: Above every task id in the store's text order (code points, the "C" collation on
#: PostgreSQL, BINARY on SQLite): an id is a UUIDv7 spelled in lowercase hex
#: (``orbit.core.ids``), so its first character is a digit or a-f, all below "g".
_ID_END = "g"

#: Milliseconds a UUIDv7's 48-bit prefix can spell.
_ID_MS_END = 1 << 48


def _id_ms_prefix(ms: int) -> str:
    """The first 13 characters of every id made in millisecond ``ms`` (0 <= ms < 2**48):
    the millisecond's 12 hex digits, with the dash ``uuid7`` spells after the eighth."""
    h = f"{ms:012x}"
    return f"{h[:8]}-{h[8:]}"


def _list_id_bounds(
    after_id: str | None, created_after: int | None, created_before: int | None
) -> tuple[str, str] | None:
    """Exclusive id bounds (``id > lo AND id < hi``) for a task list after ``after_id``
    with ``created_after <= created_at < created_before``; None if none is asked for.

    Only ever narrower than the created_at window, never wider: a task's id is
    ``uuid7(now)`` (``uuid7_many(now, …)`` in a batch) of the same ``now`` its
    ``created_at`` holds (``transitions.new_task``; nothing else makes a task), and the
    id's first 13 characters spell ``now // 1000`` in 12 fixed-width lowercase hex
    digits, so for ``0 <= created_at < 2**48`` ms they order as the millisecond does.
    Hence ``created_at >= A`` gives a prefix at least ``_id_ms_prefix(A // 1000)`` and an
    id above it (no id is as short as the prefix, so ">=" and ">" agree), and
    ``created_at < B``, that is ``<= B - 1``, a prefix at most that of ``(B - 1) // 1000``
    and an id below the next millisecond's prefix. The bounds are to the millisecond, not
    the microsecond the ids' next 12 bits order, so they lean on the 48-bit prefix alone
    (RFC 9562); the created_at conditions, which the query keeps, make the window exact.
    A bound outside the prefix's range (before 1970, after the year 10889) is left out."""
    if after_id is None and created_after is None and created_before is None:
        return None
    lo, hi = after_id or "", _ID_END
    if created_after is not None and 0 < created_after < _ID_MS_END * 1000:
        lo = max(lo, _id_ms_prefix(created_after // 1000))
    if created_before is not None and created_before > 0:
        end_ms = (created_before - 1) // 1000 + 1
        if end_ms < _ID_MS_END:
            hi = _id_ms_prefix(end_ms)
    return lo, hi


def _refuse_past_deadline(task: Task, now: int) -> None:
    """An operator's retry of a task whose deadline has passed would only queue it for
    the reaper's next pass to fail ``DEADLINE_EXCEEDED``: it is refused instead, and the
    task is left as it was (a deadline is fixed at submit; submit the work anew)."""
    if task.deadline is not None and task.deadline <= now:
        raise OrbitError(
            Code.DEADLINE_EXCEEDED,
            "the task's deadline has passed, so it cannot run again; submit it anew",
        )


def _claimed_by(tx: _Tx, session_id: str) -> list[tuple[Task, Attempt]]:
    """The attempts the session has claimed and not started, each with its task: the
    tasks locked (by id), then the attempts read under those locks. Taken after the claim
    lock, so that a claim in flight for the session has committed and its attempts are
    among them."""
    task_ids = sorted(
        r["task_id"] for r in tx.fetch("attempt_claimed_for_session", session_id=session_id)
    )
    tasks = {r["id"]: R.task_from_row(r) for r in tx.fetch("task_lock_many", ids=task_ids)}
    attempts = (
        R.attempt_from_row(r) for r in tx.fetch("attempt_live_for_tasks", task_ids=task_ids)
    )
    return [
        (tasks[a.task_id], a)
        for a in attempts
        if a.session_id == session_id and a.state == "claimed"
    ]


def _wait_for_claims(tx: _Tx) -> None:
    """Take the claim lock before changing what a claim weighs without locking it: a
    session's drain, capacity or epoch (a resume), a tenant's or the global cap, the set
    of queues (as the session expiry does). A claim reads them under that lock, so a
    claim in flight commits first (its grants were allowed when it read) and any later
    claim reads the change. Without it, on PostgreSQL, a claim that read them just before
    such a change committed after it, and granted what the change, already acknowledged,
    forbade (a drained session, a lowered cap, a fenced epoch), or met a ready task of a
    queue it had not read (a KeyError). These changes are rare: the claim lock costs the
    hot path nothing. (A queue's pause needs none: start refuses it.)"""
    tx.fetch("claim_lock")


def _by_name(row: Row) -> str:
    return str(row["name"])


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


#: The advisory lock key's high bits for each kind of capped scope (``depth_key``): above
#: 2^32, apart from the small constants the claim and migration locks use.
_DEPTH_LOCK_KIND = {"queue": 7270602, "tenant": 7270603}
#: The high bits of a keyed batch's advisory locks (``key_lock``), and how many there
#: are: a batch takes at most this many, however many keys and queues it names.
_KEY_LOCK_KIND = 7270604
KEY_LOCK_STRIPES = 64

#: The longest ``Retry-After`` a full queue or tenant is answered with, in seconds.
MAX_RETRY_AFTER = 60


class _DepthGates:
    """One node's in-process gates in front of the depth locks (``depth_lock``): a submit
    to a scope this node last saw capped passes its gate before it takes a pooled
    connection, so that one submit per capped scope at most waits for the scope's depth
    lock on this node, connection in hand. Without them a burst of submits to one full
    scope, which go one at a time cluster-wide anyway, held every pooled connection
    while they waited, and every other call of the node (a worker's renewal, an
    uncapped submit) waited for a connection behind them, up to the pool's timeout.

    Only a hint: the depth lock alone keeps the cap. A scope first capped since this node
    last saw it is submitted to ungated (as before) until a submit has read its cap; one
    whose cap was removed stays gated until then. A gate is waited for before any
    transaction begins, so its holder waits for database locks but no database lock
    holder ever waits for a gate: they cannot wait for each other in a cycle, and gates
    are taken in key order."""

    def __init__(self) -> None:
        self._capped: set[int] = set()  # the depth keys of the scopes last seen capped
        self._gates: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()

    def saw(self, scopes: Iterable[tuple[str, str]], capped: Iterable[tuple[str, str]]) -> None:
        """A submit read these scopes' caps: ``capped`` has one, the rest have none."""
        if not capped and not self._capped:  # no cap seen anywhere: nothing to do
            return
        now = {depth_key(*s) for s in capped}
        with self._lock:
            self._capped -= {depth_key(*s) for s in scopes} - now
            self._capped |= now

    def keys(self, scopes: Iterable[tuple[str, str]]) -> list[int]:
        """The depth keys of the scopes last seen capped, in order, each once: two
        scopes of one batch may share a key (a CRC-32 of their names), and a gate taken
        twice by one submit waited on itself for ever, and every later submit to either
        scope behind it."""
        if not self._capped:  # no cap seen anywhere
            return []
        with self._lock:
            return sorted({k for s in scopes if (k := depth_key(*s)) in self._capped})

    def held(self, scopes: Iterable[tuple[str, str]]) -> AbstractContextManager[None]:
        """Hold the gates of the scopes last seen capped, in key order, for the block
        (none seen: nothing, and no generator made)."""
        keys = self.keys(scopes)
        return self._hold(keys) if keys else nullcontext()

    @contextmanager
    def _hold(self, keys: list[int]) -> Iterator[None]:
        with self._lock:
            gates = [self._gates.setdefault(k, threading.Lock()) for k in keys]
        with ExitStack() as stack:
            for gate in gates:
                stack.enter_context(gate)
            yield


def depth_key(kind: str, name: str) -> int:
    """The advisory lock key (``depth_lock``) of a capped queue or tenant: its kind in the
    high 32 bits, a CRC-32 of its name in the low ones."""
    return (_DEPTH_LOCK_KIND[kind] << 32) | zlib.crc32(name.encode("utf-8"))


def key_lock(tenant: str, queue: str) -> int:
    """The advisory lock (``idempotency_lock``) a keyed batch takes for the keys of one
    ``(tenant, queue)``, where they are unique: its kind in the high 32 bits, one of
    ``KEY_LOCK_STRIPES`` in the low ones (a CRC-32 of the two, folded). Two batches that
    share a key share its stripe, so they take turns; batches to queues sharing a stripe
    only wait for each other more. A lock per key ran PostgreSQL out of its shared lock
    table (``max_locks_per_transaction`` times connections, 6,400 by default): twenty
    concurrent batches of 1,000 keys failed "out of shared memory"."""
    joined = f"{tenant}\0{queue}".encode()
    return (_KEY_LOCK_KIND << 32) | (zlib.crc32(joined) % KEY_LOCK_STRIPES)


def retry_after(adding: int, rate: float | None, *, paused: bool = False) -> int:
    """Seconds a refused submit of ``adding`` tasks should wait: for a queue whose rate
    is capped, the time that rate takes to claim as many tasks (at best the room a
    retry needs), else one second; at least 1, at most ``MAX_RETRY_AFTER``. A heuristic:
    nothing else bounds how soon a backlog drains. A paused queue claims nothing until
    it is resumed, whatever its rate: the most."""
    if paused:
        return MAX_RETRY_AFTER
    if rate is None or rate <= 0:
        return 1
    # Rounded to microseconds first: 21 / 0.7 is 30.000000000000004 in floats, not 31 s.
    return max(1, min(MAX_RETRY_AFTER, math.ceil(round(adding / rate, 6))))


def _check_depth(
    tx: _Tx,
    capped: Mapping[tuple[str, str], int],
    specs: Sequence[TaskSpec],
    known: frozenset[tuple[str, str, str]],
    rates: Mapping[str, float],
    paused: frozenset[str],
    existing: Callable[[set[tuple[str, str, str]]], Mapping[tuple[str, str, str], Task]],
) -> None:
    """Refuse a submit (the transaction writes nothing) that would leave a capped queue or
    tenant (``capped``: ``(kind, name)`` and its ``max_queued`` as the submit read it) with
    more waiting tasks, in state queued or scheduled, than its ``max_queued``:
    ``Backpressure`` (429, QUEUE_FULL or TENANT_FULL) when it would fit once enough of them
    are claimed, BATCH_EXCEEDS_CAP (413) when it makes more new tasks in the scope than the
    cap itself and so can never fit: a client waits out and retries a 429 (the SDK's and
    the CLI's users do), and such a batch would be retried for ever.

    Only the tasks the submit makes count: a spec whose idempotency key names a task of
    the database (``known``) or of the batch before it makes none, so a retried submit
    gets its tasks back from a full queue. The submits to one capped scope are serialised
    cluster-wide by ``depth_lock``, and each counts after it holds the lock, in a
    statement of its own (which sees every submit committed before it), with the cap as
    it is then: two nodes cannot both fill the last room. A submit to a scope without a
    cap takes no lock and counts nothing. The scopes the batch passes by itself under the
    caps as read are counted first: a full scope counted before one of them would answer
    429, and the retry after the wait would learn that it never fits.

    ``known`` was read before the lock: a submit that waited for it may find that a key it
    counted as new was taken meanwhile by the submit it waited for. Before refusing, the
    keys counted as new are read again (``existing``, a statement after the lock); if one
    names a task now, the transaction is retried (``StaleWrite``) with the keys as they
    are, as a submit without a cap is when its insert finds the key taken. So a
    concurrent resubmit gets the task back rather than a refusal; only a refusal pays."""
    adding: dict[tuple[str, str], int] = {}
    seen = set(known)
    fresh: set[tuple[str, str, str]] = set()  # the keys counted as new
    for spec in specs:
        key = _key_of(spec)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
            fresh.add(key)
        for scope in (("queue", spec.queue), ("tenant", spec.tenant)):
            adding[scope] = adding.get(scope, 0) + 1
    todo = sorted(
        ((scope, n) for scope, cap in capped.items() if (n := adding.get(scope, 0))),
        key=lambda item: (item[1] <= capped[item[0]], item[0]),
    )
    if not todo:
        return
    tx.fetch("depth_lock", keys=[str(k) for k in sorted({depth_key(*s) for s, _ in todo})])
    for (kind, name), n in todo:
        found = tx.fetch(f"{kind}_depth", name=name, adding=n)
        cap = _int_or_none(found[0]["max_queued"]) if found else None
        if cap is None:  # removed since the submit read it
            continue
        depth = int(found[0]["depth"])
        if depth + n <= cap:
            continue
        if fresh and existing(fresh):
            raise StaleWrite  # a key counted as new was taken while this waited
        what = f"{kind} {name!r:.80}"
        if n > cap:
            raise OrbitError(
                Code.BATCH_EXCEEDS_CAP,
                f"{what} has max_queued {cap}: this batch of {len(specs)} makes {n} new "
                f"tasks in it, which can never fit; submit at most {cap} at a time",
            )
        raise Backpressure(
            Code.QUEUE_FULL if kind == "queue" else Code.TENANT_FULL,
            f"{what} is full: it holds {depth}+ waiting tasks of its max_queued {cap}, "
            f"and this submit adds {n}",
            scope=name,
            retry_after=(
                retry_after(n, rates.get(name), paused=name in paused)
                if kind == "queue"
                else retry_after(n, None)
            ),
        )


def _changes(fields: Sequence[str], before: Sequence[Any], after: Sequence[Any]) -> dict[str, Any]:
    """The data of a ``queue.updated``, ``tenant.updated`` or ``global.updated`` event:
    each of ``fields`` whose value changed, the new one and the old (``<field>_before``;
    None: no cap), so the three events spell a change alike."""
    data: dict[str, Any] = {}
    for field, old, new in zip(fields, before, after, strict=True):
        if old != new:
            data[field] = new
            data[f"{field}_before"] = old
    return data


def _limits_changed(tx: _Tx) -> None:
    """A tenant's or the global cap changed: like a freed permit, a raised or removed one
    can let a claim that a cap held back find more, in any queue (dispatchers whose last
    claim was not held back ignore it). Called only on a change: the cap in force set
    again lets no claim find more."""
    tx.freed.update(str(r["name"]) for r in tx.fetch("queue_all"))


def _fire(fault: str | None, query: str) -> None:
    """Raise the failure armed as ``fault`` (``Store.inject_fault``) if it is ``query``'s."""
    if fault == query:
        raise InjectedFault(f"injected failure in query {query}")


def _guarded(name: str, count: int, expect: int | None) -> int:
    """``count``, the rows a batched write wrote, if it is what every row's guard should
    have matched (``expect``; None: no guard); StaleWrite otherwise."""
    if expect is not None and count != expect:
        raise StaleWrite(f"{name}: {count} of {expect} rows matched their guard")
    return count


def _check_batch(attempt_ids: Sequence[str], max_batch: int) -> None:
    """A batch of reports names each attempt once, and holds at most ``max_batch``."""
    if not attempt_ids:
        raise OrbitError(Code.INVALID_ARGUMENT, "a batch needs at least one attempt")
    if len(attempt_ids) > max_batch:
        raise OrbitError(Code.INVALID_ARGUMENT, f"a batch holds at most {max_batch} attempts")
    if len(set(attempt_ids)) != len(attempt_ids):
        raise OrbitError(Code.INVALID_ARGUMENT, "a batch names an attempt more than once")


class _Moved(Exception):
    """A schedule's row was fired or changed by another transaction since it was read."""


def _no_schedule(name: str) -> OrbitError:
    return OrbitError(Code.SCHEDULE_NOT_FOUND, f"no schedule named {name!r:.80}", field="name")


@dataclass(frozen=True)
class Dropped:
    """The missed instants one fire of a schedule passes over for good: the first and
    the last, and how many (None: more than ``MAX_DROPPED_COUNT``)."""

    first: int
    last: int
    count: int | None


@dataclass(frozen=True)
class FirePlan:
    """What one fire of a schedule does: submit for ``instant`` (None: nothing), then
    wait for ``next_fire_at``; ``dropped``, the missed instants it drops, if any."""

    instant: int | None
    next_fire_at: int
    dropped: Dropped | None = None


class _FireStretch:
    """The schedule duty's current stretch of work on this node: passes back to back
    since ``began`` (the clock at its first round), each round firing something. An
    instant that came due during it could not be fired sooner, the duty being busy, so
    it is on time however long the stretch takes (``fire_plan``'s ``on_time_from``).

    Busy, not stalled: the duty reads the clock at each round and each fire (``saw``),
    and a gap of more than ``MISFIRE_GRACE_US`` between two readings (the node stopped,
    a paused VM, a long wait on the database) is time in which the duty saw nothing, as
    if it were down: it ends the stretch (``stalled``), so that what came due meanwhile
    is judged by the misfire policy, not fired as on time. The gap, not a round's
    length: a round of many fires may take minutes and still see every instant in time.
    ``wrote`` counts the fires that wrote something (a task made or found, or the
    schedule moved on): a round that adds none ends the stretch.

    ``kept`` remembers, for each schedule this stretch fired past missed instants, the
    row version its fire wrote and the instant it fired: every due instant from there
    on is kept (the policy's choice is a run of consecutive instants), so its next fires
    need no second look back over ``max_catch_up`` instants, which made a catch-up's
    cost grow with the square of its bound. A row another node or an operator wrote
    since has another version and is looked at afresh."""

    def __init__(self, began: int) -> None:
        self.began = began
        self.seen = began
        self.stalled = False
        self.wrote = 0
        self.kept: dict[tuple[str, int], tuple[int, int]] = {}

    def saw(self, at: int) -> None:
        """The duty read the clock: ``at``. More than the grace since its last reading
        is a stall."""
        if at - self.seen > MISFIRE_GRACE_US:
            self.stalled = True
        self.seen = max(self.seen, at)

    def kept_from(self, s: Schedule) -> int | None:
        found = self.kept.get((s.name, s.created_at))
        return found[1] if found is not None and found[0] == s.version else None


def fire_plan(
    s: Schedule, now: int, on_time_from: int | None = None, kept_from: int | None = None
) -> FirePlan:
    """The misfire policy applied to the instants due at ``now`` (docs/concepts.md,
    "Schedules"). An instant at or after ``on_time_from`` (by default ``now -
    MISFIRE_GRACE_US``; the duty's stretch can make it earlier: ``_FireStretch``) is on
    time and always fires; older ones were missed (the cluster was down, or a full queue
    refused the fire): ``skip`` drops them, ``run_once`` fires the latest of them once
    for all, ``catch_up`` fires each of the latest ``max_catch_up`` of them, oldest
    first, and drops the older. One instant per fire; the next fire (the next round)
    takes the next kept one. ``kept_from``: an instant from which every due one is known
    kept (``_FireStretch.kept``)."""
    zone = stored_zone(s.timezone)
    cut = now - MISFIRE_GRACE_US if on_time_from is None else min(on_time_from, now)
    first = next_after(s.cron, zone, s.next_fire_at - 1)
    if first > now:  # next_fire_at no instant of the expression: none is due yet
        return FirePlan(None, first)
    if first >= cut or (kept_from is not None and first >= kept_from):
        return FirePlan(first, next_after(s.cron, zone, first))
    keep = {"skip": 0, "run_once": 1}.get(s.misfire, s.max_catch_up)
    # The latest missed instants: those kept, and the last one dropped before them.
    tail = latest(s.cron, zone, cut - 1, first, keep + 1)
    kept = tail[-keep:] if keep else []
    dropped = None
    if len(tail) > keep:
        last = tail[-keep - 1]
        dropped = Dropped(first, last, _count(s, zone, first, last))
    if kept:
        following = kept[1] if len(kept) > 1 else next_after(s.cron, zone, kept[0])
        return FirePlan(kept[0], following, dropped)
    on_time = next_after(s.cron, zone, tail[-1])
    if on_time <= now:
        return FirePlan(on_time, next_after(s.cron, zone, on_time), dropped)
    return FirePlan(None, on_time, dropped)


def _count(s: Schedule, zone: ZoneInfo, first: int, last: int) -> int | None:
    """How many instants of ``s`` lie in ``[first, last]``, if no more than
    ``MAX_DROPPED_COUNT`` (a year of a minutely schedule would take seconds to count)."""
    found = latest(s.cron, zone, last, first, MAX_DROPPED_COUNT + 1)
    return len(found) if len(found) <= MAX_DROPPED_COUNT else None


def _skipped(s: Schedule, plan: FirePlan) -> list[Event]:
    """The ``schedule.skipped`` event of the missed instants ``plan`` drops (none if it
    drops none): the first and last of them and how many, and the next instant."""
    if plan.dropped is None:
        return []
    data: dict[str, Any] = {
        "schedule": s.name,
        "missed_from": plan.dropped.first,
        "missed_to": plan.dropped.last,
        "missed": plan.dropped.count,
        "next_fire_at": plan.next_fire_at,
    }
    return [Event(kind="schedule.skipped", queue=s.template.queue, data=data)]


def fire_key(s: Schedule, instant: int) -> str:
    """The idempotency key of ``s``'s task for ``instant``: the schedule's name, when it
    was created (so that a schedule deleted and made again under its name is a new
    one) and the instant, all in microseconds."""
    return f"schedule:{s.name}:{s.created_at}:{instant}"


def _no_session(session_id: str) -> OrbitError:
    return OrbitError(Code.SESSION_NOT_FOUND, f"no session {session_id!r:.80}")


def _no_attempt(attempt_id: str) -> OrbitError:
    return OrbitError(Code.ATTEMPT_NOT_FOUND, f"no attempt {attempt_id!r:.80}")


def _answer(plan: Plan, value: T | None) -> T | OrbitError:
    """One report's answer out of a shared plan: its value, or the rejection it recorded
    (taken off the plan, so the batch commits and answers each report on its own)."""
    rejection, plan.rejection = plan.rejection, None
    if value is None:
        assert rejection is not None
        return rejection
    return value


def _spelled_outcome(outcome: Outcome) -> transitions.Spelled | OrbitError:
    """The outcome's canonical spellings (``transitions.spell``), or why it cannot be
    stored. A finish needs the spellings anyway (the report's digest, the result it
    stores), and making them is the last check: they are made here once, where the
    check made them and the finish made them again."""
    if not isinstance(outcome, Outcome):
        return OrbitError(Code.INVALID_ARGUMENT, "outcome must be an Outcome")
    try:
        check_json_depth(outcome.result, "result")
    except OrbitError as exc:
        return exc
    for text in (outcome.error_code, outcome.error_message):
        if text is not None and (not isinstance(text, str) or "\x00" in text):
            return OrbitError(
                Code.INVALID_ARGUMENT, "error code and message must be text without NUL characters"
            )
    try:
        return transitions.spell(outcome)
    except (TypeError, ValueError) as exc:
        return OrbitError(Code.INVALID_ARGUMENT, f"result must be JSON: {exc}")


def _check_capabilities(capabilities: Sequence[Capability]) -> tuple[Capability, ...]:
    caps = tuple(capabilities)
    if not caps:
        raise OrbitError(Code.INVALID_ARGUMENT, "a worker needs at least one capability")
    seen: set[str] = set()
    for cap in caps:
        if not isinstance(cap, Capability):
            raise OrbitError(Code.INVALID_ARGUMENT, "capabilities must be Capability values")
        check_name("handler", cap.handler)
        check_int("capacity", cap.capacity, 1, 100_000)
        if cap.handler in seen:
            raise OrbitError(Code.INVALID_ARGUMENT, f"handler {cap.handler} is listed twice")
        seen.add(cap.handler)
    return caps


#: the writes that insert events (``task_submit_many`` inserts each new task's
#: ``submitted``): a transaction that sent one calls ``Store.on_events`` once committed
EVENT_WRITES = frozenset({"event_insert_many", "task_submit_many"})


class _Tx:
    """One transaction's view: named queries, the clock, and plan application."""

    def __init__(self, cx: Connection, store: Store) -> None:
        self.cx = cx
        self._store = store
        self._now: int | None = None
        self.ready: set[str] = set()  # queues where a task became ready
        self.freed: set[str] = set()  # queues where an attempt ended (a permit freed)
        self.cancels: list[tuple[str, str]] = []
        #: sessions resumed, with their new epoch: their older connections are fenced
        self.fenced: list[tuple[str, int]] = []
        #: tokens revoked: the worker connections opened with them are closed, on every node
        self.revoked: list[str] = []
        self._sent: set[Notice] = set()  # the notices already queued in this transaction
        #: a write that inserts events has been sent (``EVENT_WRITES``)
        self.wrote_events = False
        #: a write marked final has been sent: the transaction may have committed with it
        self._final = False
        #: the transaction's ``COMMIT`` has been sent (with a final write, or as the
        #: driver's block ends): a connection lost from here leaves its outcome unknown
        self.committing = False

    def _armed(self, name: str) -> None:
        self._usable()
        self._store._armed(name)

    def _usable(self) -> None:
        """Refuse a statement after the final write, on every backend alike (on
        PostgreSQL the transaction has committed by then; SQLite would take it)."""
        if self._final:
            raise RuntimeError("a statement after this transaction's final write")

    def fetch(self, query: str, /, **params: Any) -> list[Row]:
        self._armed(query)
        return self.cx.fetch(query, params)

    def fetch_table(self, query: str, /, **params: Any) -> Table:
        """``fetch``'s rows as tuples and their columns' names (``Connection.fetch_table``):
        for a read of hundreds of rows made into records by position."""
        self._armed(query)
        return self.cx.fetch_table(query, params)

    def execute(self, query: str, /, **params: Any) -> int:
        self._armed(query)
        return self.cx.execute(query, params)

    def prelude(self, query: str, /, **params: Any) -> None:
        self._armed(query)
        self.cx.prelude(query, params)

    def write_many(self, name: str, rows: Sequence[Row], *, expect: int | None = None) -> int:
        if not rows:
            return 0
        self._armed(name)
        self.wrote_events = self.wrote_events or name in EVENT_WRITES
        return _guarded(name, self.cx.write_many(name, rows), expect)

    def write_stream(
        self, name: str, chunks: Iterable[Sequence[Row]], *, expect: Callable[[], int]
    ) -> int:
        """``write_many`` over rows made a chunk at a time (``Connection.write_stream``);
        ``expect`` is read once every chunk is made: the count every row's guard must
        match. The notices owed once every chunk is made go with the chunks."""
        self._usable()
        self.wrote_events = self.wrote_events or name in EVENT_WRITES
        count = self.cx.write_stream(name, chunks, self.unsent_notices)
        # As in write_batch: a fault fires after every chunk has been written.
        self._armed(name)
        return _guarded(name, count, expect())

    def write_batch(
        self,
        *writes: tuple[str, Sequence[Row], int | None],
        notify: Sequence[Notice] = (),
        final: bool = False,
    ) -> list[int]:
        """Several ``*_many`` writes in one round trip; ``(name, rows, expect)`` each, where
        ``expect`` (if not None) is the count every row's guard must match. ``notify``:
        notices sent with them (``Connection.write_batch``). ``final``: nothing follows
        them in this transaction, so the driver may commit with them (``commit_with``);
        not while a fault is armed for one of them, which must fire before the commit."""
        todo = [(name, rows, expect) for name, rows, expect in writes if rows]
        if not todo and not notify:
            return []
        self._usable()
        fault = self._store._fault  # read once: another thread may arm one meanwhile
        commit = final and not any(fault == name for name, _, _ in todo)
        if commit:
            self.committing = True  # its COMMIT goes with these writes (PostgreSQL)
        counts = self.cx.write_batch(
            [(name, rows) for name, rows, _ in todo],
            notify,
            commit_with=[expect for _, _, expect in todo] if commit else None,
        )
        self._final = final
        for name, _, _ in todo:
            self.wrote_events = self.wrote_events or name in EVENT_WRITES
            # A fault injected in a batched write fires after the whole batch has run:
            # the harshest case for atomicity, since every write must then be undone.
            _fire(fault, name)
        for (name, _, expect), count in zip(todo, counts, strict=True):
            _guarded(name, count, expect)
        return counts

    def unsent_notices(self) -> list[Notice]:
        """The notices this transaction owes the other nodes and has not queued yet: a
        queue whose task became ready, one where a permit was freed (a slot of a session
        another node may skip as full), each running attempt asked to stop, and each session
        resumed (its older connection, on whichever node, is fenced), and each token revoked
        (the connections opened with it are closed). Marked as queued: the caller must send
        them in this transaction."""
        origin = self._store.origin
        owed = [("orbit_ready", f"{origin}:ready:{q}") for q in sorted(self.ready)]
        owed += [("orbit_ready", f"{origin}:freed:{q}") for q in sorted(self.freed)]
        owed += [("orbit_cancel", f"{s}:{a}") for s, a in self.cancels]
        owed += [("orbit_ready", f"{origin}:fenced:{s}:{e}") for s, e in self.fenced]
        owed += [("orbit_ready", f"{origin}:revoked:{t}") for t in self.revoked]
        unsent = [n for n in owed if n not in self._sent]
        self._sent.update(unsent)
        return unsent

    def notify(self) -> None:
        """Queue the notices not yet queued (``unsent_notices``)."""
        self.write_batch(notify=self.unsent_notices())

    def now(self) -> int:
        """The clock, read now: call it only after the rows being judged are locked."""
        self._usable()
        return self._stamp(self.cx.now)

    def now_from(self, read: int | None) -> int:
        """The clock as a statement read it after its locks (``read``), or, where the
        database did not read it (``None``: SQLite's in-process clock), read now."""
        if read is None:
            return self.now()
        return self._stamp(lambda: int(read))

    def _stamp(self, database_clock: Callable[[], int]) -> int:
        """This transaction's clock: the store's test clock if it has one, else the
        database's (read by ``database_clock``)."""
        store = self._store
        now = store._clock() if store._clock is not None else database_clock()
        self._now = now
        if now > store._clock_high:
            store._clock_high = now
        elif store._clock_high - now > CLOCK_STEP_US:
            store._stepped_from = store._clock_high  # the clock went back (reap)
        return now

    def clock(self) -> int:
        """The clock as last read (by ``now`` or ``lock_many``)."""
        assert self._now is not None, "the clock has not been read in this transaction"
        return self._now

    def lock_many(self, *calls: tuple[str, dict[str, Any]]) -> list[list[Row]]:
        """Reads (locking ones take their locks in the order given), then the clock
        (``clock()`` returns it): one round trip on PostgreSQL (``Connection.lock_many``)."""
        for name, _ in calls:
            self._armed(name)
        found, now = self.cx.lock_many(calls)
        self._stamp(lambda: now)
        return found

    def lock_tables(self, *calls: tuple[str, dict[str, Any]]) -> list[Table]:
        """``lock_many``, each read's rows as a ``Table`` (``Connection.lock_tables``)."""
        for name, _ in calls:
            self._armed(name)
        found, now = self.cx.lock_tables(calls)
        self._stamp(lambda: now)
        return found

    def session(self, session_id: str, *, lock: bool, share: bool = False) -> Session:
        name = "session_lock" if lock else ("session_share" if share else "session_get")
        found = self.fetch(name, id=session_id)
        if not found:
            raise _no_session(session_id)
        return R.session_from_row(found[0])

    def write_sessions(self, pairs: Sequence[tuple[Session, Session]]) -> None:
        self.write_many(
            "session_write_many", [R.session_write_row(b, a) for b, a in pairs], expect=len(pairs)
        )

    def event_rows(self, events: Sequence[Event]) -> RowColumns:
        """Event rows stamped with this transaction's clock (read now if not yet read)."""
        at = self._now if self._now is not None else self.now()
        return R.event_columns(events, at)

    def events(self, events: Sequence[Event]) -> None:
        self.write_many("event_insert_many", self.event_rows(events), expect=len(events))

    def apply(self, plan: Plan, *, final: bool = False) -> None:
        """Carry a plan out: inserts, guarded writes, then its events. ``final``: this is
        the transaction's last statement (``write_batch``)."""
        for before, after in plan.task_writes:
            # A task became ready, or a permit was freed: wake the dispatchers. A start
            # (claimed -> running) or a cancel request changes neither.
            if after.state == _QUEUED:
                self.ready.add(after.queue)
            # A live task that leaves the live states frees its session's slot and its
            # permits, back to queued too (a release, a reaped claim, a retry): a
            # dispatcher skipping its worker as full hears of it (``on_freed``).
            if before.state in LIVE_TASK_STATES and after.state not in LIVE_TASK_STATES:
                self.freed.add(after.queue)
        for event in plan.events:
            if event.kind == "cancel_requested" and event.data:
                self.cancels.append((event.data["session_id"], event.data["attempt_id"]))
        # One round trip for all of them (one statement on PostgreSQL); each write's
        # guard must match every one of its rows, or the transaction is retried.
        self.write_batch(
            (
                "attempt_write_many",
                R.attempt_write_columns(plan.attempt_writes),
                len(plan.attempt_writes),
            ),
            (
                "task_write_many",
                R.task_write_columns(plan.task_writes),
                len(plan.task_writes),
            ),
            (
                "attempt_insert_many",
                R.attempts_columns(plan.attempt_inserts),
                len(plan.attempt_inserts),
            ),
            (
                "session_write_many",
                [R.session_write_row(b, a) for b, a in plan.session_writes],
                len(plan.session_writes),
            ),
            ("event_insert_many", self.event_rows(plan.events), len(plan.events)),
            notify=self.unsent_notices(),
            final=final,
        )


__all__ = [
    "LIVE_ATTEMPT_STATES",
    "Grants",
    "InjectedFault",
    "ReapReport",
    "StaleWrite",
    "Store",
    "StoreConfig",
    "Submitted",
]


def _lock_tree(tx: _Tx, root_id: str) -> list[Task]:
    """A task and all its descendants, locked, in id order.

    The tree is read, locked, and read again until no new task appears. A child's
    submit holds its parent's row FOR SHARE until it commits, so a read of the tree
    taken before the locks can miss a child committed while this waited for them (on
    PostgreSQL each statement sees what had committed when it began). Once a parent is
    locked here, its children's submits have either committed, and the next read sees
    them, or they wait for this transaction and then find the parent cancel-requested.
    Locking a late child after its parent breaks the id order the store locks in, so
    a deadlock is possible; PostgreSQL detects it and the transaction is retried
    (``Store._tx``). On SQLite a transaction runs alone and the first read is the
    last.

    The read after the locks is one statement: the children of every task locked. A
    task of the tree that is not locked yet has a topmost such ancestor, whose parent is
    locked, so it is among them; the subtrees under those new children are then walked
    (``_subtrees``) and locked in turn."""
    locked: dict[str, Task] = {}
    found = _subtrees(tx.fetch, [root_id])
    while True:
        new = sorted(found - locked.keys())
        if not new:
            return [locked[i] for i in sorted(locked)]
        for row in tx.fetch("task_lock_many", ids=new):
            task = R.task_from_row(row)
            locked[task.id] = task
        if root_id not in locked:
            raise OrbitError(Code.TASK_NOT_FOUND, f"no task {root_id!r:.80}")
        children = {r["id"] for r in tx.fetch("task_children", ids=sorted(locked))}
        found = _subtrees(tx.fetch, sorted(children - locked.keys()))


def _subtrees(fetch: Callable[..., list[Row]], ids: list[str]) -> set[str]:
    """These tasks and all their descendants, read a level per statement (``fetch``: a
    transaction's, or ``Store._read``, each level then a read of its own).

    Why not one recursive query: PostgreSQL plans a recursive CTE's step once, for no
    parent in particular. Where the statistics showed a parent with thousands of
    children, that plan was a hash join over a scan of every task, run once per level:
    a chain 1,500 deep took 8 s to cancel, its locks held throughout. A level's
    statement is planned for its own parents, and reads a chain's through the parent
    index."""
    found = set(ids)
    level = ids
    while level:
        rows = fetch("task_children", ids=level)
        level = sorted({str(r["id"]) for r in rows} - found)
        found.update(level)
    return found


def _refuse_new_children(
    specs: Iterable[TaskSpec],
    cancelled: Mapping[str, _CancelledBy],
    stored: frozenset[tuple[str, str, str]],
    look: Callable[[list[tuple[str, str, str]]], dict[tuple[str, str, str], Task]],
    named: Callable[[OrbitError, int], OrbitError],
) -> None:
    """PARENT_CANCELLED for the first spec that would make a task under a ``cancelled``
    parent (one mapped to itself, or to its cancelled ancestor): one whose key named no
    task when the batch looked (``stored``). If its key names one now (``look``: a
    concurrent submit of the same task committed after the look, and then the cancel that
    cancelled both), StaleWrite: the transaction runs again, finds the task and returns
    it. ``named``: the refusal as the task's at an index (``_of_task``, or as it is)."""
    for index, spec in enumerate(specs):
        parent = spec.parent_id
        if parent is not None and parent in cancelled and (key := _key_of(spec)) not in stored:
            if key is not None and look([key]):
                raise StaleWrite(f"idempotency key {spec.idempotency_key!r:.80} was taken")
            refusal = _parent_cancelled(parent, cancelled[parent])
            refusal.field = "parent_id"
            raise named(refusal, index)


class _CancelledBy(NamedTuple):
    """A task whose cancel stands in the way of a child or a retry under it, and its
    state: ``cancelling`` while the cancel waits for its running handler to end."""

    id: str
    state: str


def _cancelled_lineage(tx: _Tx, ids: Sequence[str]) -> dict[str, _CancelledBy]:
    """Each of ``ids`` that is cancelled or has a cancelled ancestor, mapped to such a
    task (itself first). A cancel cascades to every descendant, so a task anywhere under
    a cancelled one may not be retried or given a child: checking the parent alone missed
    a grandparent's cancel when the parent had already ended (a cancel leaves an ended
    task as it was)."""
    found: dict[str, _CancelledBy] = {}
    for row in tx.fetch("task_cancelled_lineage", ids=sorted(ids)):
        start = str(row["id"])
        by = _CancelledBy(str(row["cancelled_id"]), str(row["cancelled_state"]))
        if start not in found or found[start].id != start:
            found[start] = by
    return found


def _parent_cancelled(parent_id: str, by: _CancelledBy) -> OrbitError:
    """PARENT_CANCELLED, naming the task whose cancel stands in the way, and saying
    whether that cancel is done or only requested (the task ``cancelling``, its handler
    still running): "is cancelled" of a task still running misled an operator who then
    looked it up."""
    how = (
        "is being cancelled (cancel requested)"
        if by.state == TaskState.CANCELLING
        else "is cancelled"
    )
    if by.id == parent_id:
        return OrbitError(Code.PARENT_CANCELLED, f"parent task {parent_id} {how}")
    return OrbitError(
        Code.PARENT_CANCELLED,
        f"task {by.id}, an ancestor of parent task {parent_id}, {how}",
    )


def _refuse_under_cancelled(tx: _Tx, task: Task) -> None:
    """An operator's retry of a task under a cancelled parent or ancestor is refused:
    the cancel cascaded to it, and running it again would undo that cancel (I7). The
    task's own lock serialises this with any such cancel, which locks its whole subtree."""
    if task.parent_id is None:
        return
    cancelled = _cancelled_lineage(tx, [task.parent_id]).get(task.parent_id)
    if cancelled is not None:
        error = _parent_cancelled(task.parent_id, cancelled)
        then = "once it is cancelled" if cancelled.state == TaskState.CANCELLING else "first"
        raise OrbitError(error.code, f"{error.message}; retry it {then}")


def _of_task(exc: OrbitError, index: int) -> OrbitError:
    """A batch's refusal of its task ``index``, named as the decoder names a batch's
    fields: ``field`` ``tasks[<index>].<field>`` (``tasks[<index>]`` for a refusal of no
    one field), and the message led by it. A batch of a thousand tasks said only
    "deadline is already in the past", and the client had to find which; and spelt
    ``tasks.<index>`` it was a second spelling of one path for a client to parse."""
    field = f"tasks[{index}].{exc.field}" if exc.field else f"tasks[{index}]"
    return OrbitError(exc.code, f"{field}: {exc.message}", field=field)


def _as_is(exc: OrbitError, index: int) -> OrbitError:
    """A single submit's refusal: its own field already says where."""
    return exc


def _refusal(
    specs: Sequence[TaskSpec],
    start: int,
    check: Callable[[TaskSpec], object],
    named: Callable[[OrbitError, int], OrbitError],
) -> OrbitError | None:
    """The first refusal ``check`` raises for ``specs`` (the batch's tasks from ``start``),
    as its task's (``named``). Asked again once a check over every spec at once has
    refused one, so the checks that pass keep their loops free of the bookkeeping."""
    for offset, spec in enumerate(specs):
        try:
            check(spec)
        except OrbitError as exc:
            return named(exc, start + offset)
    return None


def _differs(prior: Task, spec: TaskSpec, digest: str) -> tuple[str, str] | None:
    """What sets ``spec`` apart from ``prior``, the task its idempotency key names, if
    anything a retry keeps: its payload, handler or parent (said two ways: against the
    stored task, and against an earlier task of the same batch). Other options are not
    compared: a client retrying may compute a deadline (now + 1 h) or a priority afresh
    each time, and still means the same task; a different handler or parent is another
    job, which a 200 ``created: false`` would have lost. Only a key that names a task
    pays for the comparison."""
    if prior.payload_digest != digest:
        return "a different payload", "different payloads"
    if prior.handler != spec.handler:
        return (
            f"handler {prior.handler!r:.80}, not {spec.handler!r:.80}",
            f"handlers {prior.handler!r:.80} and {spec.handler!r:.80}",
        )
    if prior.parent_id != spec.parent_id:
        return (
            f"parent {prior.parent_id or 'none'}, not {spec.parent_id or 'none'}",
            f"parents {prior.parent_id or 'none'} and {spec.parent_id or 'none'}",
        )
    return None


def _key_of(spec: TaskSpec) -> tuple[str, str, str] | None:
    """The ``(tenant, queue, idempotency_key)`` a spec's task is known by, if it has one."""
    return (spec.tenant, spec.queue, spec.idempotency_key) if spec.idempotency_key else None


def _settled(rows: list[Row]) -> list[Row]:
    """The leading rows of an ``event_list`` read whose transaction is below the read's
    horizon, each with its ``xid`` as a number and without the horizon: the events no
    running transaction can ever precede. The rows are in xid order, so the rest are all
    at or past the horizon."""
    out: list[Row] = []
    for row in rows:
        xid, horizon = int(row.pop("txid")), int(row.pop("horizon"))
        if xid >= horizon:
            break
        row["xid"] = xid
        out.append(row)
    return out
