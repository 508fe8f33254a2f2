"""Random interleavings of every lifecycle operation against the real store, both backends.

The unit tests of ``orbit.core.transitions`` judge one transition at a time; the bugs that
matter in a job queue live in the orders nobody wrote down: a finish after a resume after
a reap, a cancel while a claim is in flight, a renew from a fenced epoch. This hypothesis
``RuleBasedStateMachine`` drives the real ``Store`` (SQLite and PostgreSQL, through the
``make_store`` fixture) with a manual clock and short leases, so claims and leases expire
within a few steps, and checks three things:

* after EVERY step, ``tests.invariants.check_all`` (I1, I2, I4, I5, I6, I7, I9) finds
  nothing, plus monotonicity that ``check_all`` cannot see from one snapshot (fences,
  ``attempts_used`` and row versions never go back; ended attempts and succeeded tasks
  never change);
* every operation's answer matches an oracle written from DESIGN.md §2 and the documented
  contract (``Rejected``, ``REPORT_GRACE_US``) rather than from the code paths: where
  several guards fail at once, any of their codes is accepted;
* every refused worker report (``Rejected``) changes no row at all and appends exactly one
  event of kind ``rejected`` with the code it raised (I3, checked directly); a refused
  claim or heartbeat changes nothing and, as ``Rejected`` documents, logs nothing.

Each hypothesis example opens a fresh store: a new SQLite file, or the shared PostgreSQL
test database emptied with ``tests.conftest._truncate``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import (
    SECOND,
    Attempt,
    Backoff,
    Capability,
    Lease,
    Outcome,
    Queue,
    Receipt,
    Session,
    Task,
    TaskSpec,
    canonical_json,
)
from orbit.core.states import AttemptState, SessionState, TaskState
from orbit.core.transitions import REPORT_GRACE_US
from orbit.store import Store, StoreConfig
from tests.conftest import ManualClock, _truncate
from tests.invariants import ResultLedger, check_all

T = TypeVar("T")
Row = dict[str, Any]

# Short leases so a few clock advances expire them; the session outlives several leases so
# both "lease lost, session alive" and "session expired" interleavings are reachable.
CLAIM_TTL = 3 * SECOND
LEASE_TTL = 5 * SECOND
SESSION_TTL = 30 * SECOND
CONFIG = StoreConfig(claim_ttl_us=CLAIM_TTL, lease_ttl_us=LEASE_TTL, session_ttl_us=SESSION_TTL)
BACKOFF = Backoff(base_us=1 * SECOND, factor=2.0, max_us=4 * SECOND)

# Two queues (one rate limited), two tenants (one capped), two handlers, and a global cap
# small enough that the caps of I4 are actually reached.
QUEUES: dict[str, tuple[int, float, int | None]] = {"q": (3, 0.0, None), "r": (2, 1.0, 2)}
TENANTS = ("default", "acme")
TENANT_CAPS = {"acme": 2}
GLOBAL_CAP = 5
HANDLERS = ("h", "g")
I4_CAPS: dict[str, Any] = {"global": GLOBAL_CAP} | {
    f"tenant:{name}": cap for name, cap in TENANT_CAPS.items()
}
MAX_WORKERS = 4

S = TaskState
A = AttemptState
LIVE = frozenset({A.CLAIMED, A.RUNNING})
WAITING = frozenset({S.QUEUED, S.SCHEDULED})
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})

# How a worker report is addressed. The honest owner dominates so the happy path is
# exercised as often as the stale ones; hypothesis shrinks towards the first entry.
VARIANTS = st.sampled_from(["owner", "owner", "owner", "old_epoch", "wrong_fence", "other_session"])
INDEX = st.integers(min_value=0, max_value=63)
# A submission: some retry_safe, some children of an existing task (``parent`` indexes the
# tasks submitted so far), some with a deadline, an attempt timeout or a run_after, and
# idempotency keys from a tiny set so repeats and conflicts both happen.
SUBMIT_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "queue": st.sampled_from(sorted(QUEUES)),
    "handler": st.sampled_from(HANDLERS),
    "tenant": st.sampled_from(TENANTS),
    "priority": st.integers(0, 1),
    "retry_safe": st.booleans(),
    "parent": st.sampled_from([None, None, 0, 1, 2, 3, 4, 5]),
    "key": st.sampled_from([None, None, None, "k1", "k2"]),
    "payload": st.integers(0, 1),
    "max_attempts": st.integers(1, 3),
    "timeout_s": st.sampled_from([None, None, 2, 4, 8]),
    "delay_s": st.sampled_from([None, None, None, 1, 3]),
    "deadline_s": st.sampled_from([None, None, 3, 8, 20, 40]),
}
SUBMISSIONS = st.fixed_dictionaries(SUBMIT_ARGS)


@dataclass
class Worker:
    """What a worker process knows about its own session: the secret and its epochs."""

    id: str
    secret: str
    epoch: int
    old_epochs: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class World:
    """Every row the machine judges, read between two operations.

    Oracles read the state *before* an operation from here and compare it with a fresh
    read afterwards, so "nothing changed" (I3) is checked on every row, not just the target.
    """

    tasks: dict[str, Task]
    attempts: dict[str, Attempt]
    sessions: dict[str, Session]
    queues: dict[str, Queue]
    cursor: tuple[int, int]  # position (xid, id) of the newest event at read time

    def live_attempt(self, task_id: str) -> Attempt | None:
        live = [a for a in self.attempts.values() if a.task_id == task_id and a.state in LIVE]
        return live[0] if live else None

    def occupancy(self) -> Counter[str]:
        """Live attempts per cap scope, keyed like ``tests.invariants`` keys them."""
        occ: Counter[str] = Counter()
        for a in self.attempts.values():
            if a.state in LIVE:
                for scope in (
                    "global",
                    f"queue:{a.queue}",
                    f"tenant:{a.tenant}",
                    f"session:{a.session_id}",
                    f"handler:{a.session_id}:{a.handler}",
                ):
                    occ[scope] += 1
        return occ


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    keys = sorted(set(before) | set(after))
    return [k for k in keys if before.get(k) != after.get(k)]


def _outcome(kind: str, value: int) -> Outcome:
    if kind == "ok":
        return Outcome.success({"value": value})
    return Outcome.failure("BOOM", f"failure {value}", retryable=kind == "retry")


def _same_outcome(a: Outcome, b: Outcome) -> bool:
    return canonical_json(a.as_json()) == canonical_json(b.as_json())


def _retry_window(task: Task, now: int) -> tuple[int, int]:
    """Earliest and latest next run after ``task.attempts_used`` started attempts.

    DESIGN.md §1: exponential backoff with jitter; the store draws equal jitter, so the
    delay lies in ``[d/2, d]`` with ``d = min(base * factor**(used-1), max)``.
    """
    b = task.backoff
    d = min(int(b.base_us * b.factor ** max(task.attempts_used - 1, 0)), b.max_us)
    return now + d // 2, now + d


def _check_failed_attempt(before: Task, after: Task, now: int, retryable: bool, code: str) -> None:
    """A failed attempt: retry at ``now + backoff`` if allowed and before the deadline,
    else ``failed`` (``DEADLINE_EXCEEDED`` when only the deadline forbade the retry)."""
    assert after.attempts_used == before.attempts_used
    if not retryable or before.attempts_used >= before.max_attempts:
        assert after.state == S.FAILED, (after.state, before)
        assert after.error_code == code, after.error_code
        return
    lo, hi = _retry_window(before, now)
    if after.state == S.SCHEDULED:
        assert lo <= after.run_after <= hi, (lo, after.run_after, hi)
        assert before.deadline is None or after.run_after < before.deadline
        return
    assert after.state == S.FAILED, after.state
    assert after.error_code == Code.DEADLINE_EXCEEDED, after.error_code
    assert before.deadline is not None and hi >= before.deadline, (hi, before.deadline)


def _session_reasons(session: Session, epoch: int, now: int, *, draining: bool) -> set[str]:
    """Every session-level guard a report or claim fails (DESIGN.md §2: claim, resume)."""
    reasons: set[str] = set()
    if epoch != session.epoch:
        reasons.add(Code.FENCED_EPOCH)
    if session.state != SessionState.LIVE or session.expires_at <= now:
        reasons.add(Code.SESSION_EXPIRED)
    if draining and session.draining:
        reasons.add(Code.SESSION_DRAINING)
    return reasons


class OrbitMachine(RuleBasedStateMachine):
    """Workers, an operator and the reaper, interleaved at random over one store."""

    def __init__(self, open_store: Callable[[ManualClock], Store]) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.store = open_store(self.clock)
        self.ledger = ResultLedger()
        self.cursor = (0, 0)
        # The machine's own memory, in creation order: selection by index must not depend
        # on row order in the database, or hypothesis could not replay an example.
        self.task_ids: list[str] = []
        self.children: dict[str, list[str]] = {}
        self.keys: dict[tuple[str, str, str], tuple[str, int, str, str | None]] = {}
        self.workers: list[Worker] = []
        self.attempt_ids: list[str] = []
        self.reported: dict[str, tuple[Outcome, Receipt]] = {}
        for name, (cap, rate, burst) in QUEUES.items():
            self.store.queue_create(name, max_concurrency=cap, rate=rate, burst=burst)
        for tenant, cap in TENANT_CAPS.items():
            self.store.tenant_limit_set(tenant, cap)
        self.store.global_limit_set(GLOBAL_CAP)
        self._open_worker({"h": 2, "g": 1}, 3)
        self._open_worker({"h": 1}, 2)
        self.world = self._read_world()
        self.previous = self.world

    def teardown(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ reading

    def _events_since(self, cursor: tuple[int, int]) -> list[Row]:
        out: list[Row] = []
        while True:
            page = self.store.event_list(after_xid=cursor[0], after_id=cursor[1], limit=1000)
            if not page:
                return out
            out.extend(page)
            cursor = (page[-1]["xid"], page[-1]["id"])

    def _read_world(self) -> World:
        tasks: dict[str, Task] = {}
        after: str | None = None
        while True:
            page = self.store.task_list(after_id=after, limit=1000)
            if not page:
                break
            tasks.update((t.id, t) for t in page)
            after = page[-1].id
        attempts: dict[str, Attempt] = {}
        for t in tasks.values():
            if t.fence > 0:  # a task without a fence was never claimed: no attempt rows
                attempts.update((a.id, a) for a in self.store.attempt_list(t.id))
        events = self._events_since(self.cursor)
        if events:
            self.cursor = (events[-1]["xid"], events[-1]["id"])
        return World(
            tasks=tasks,
            attempts=attempts,
            sessions={s.id: s for s in self.store.session_list()},
            queues={q.name: q for q in self.store.queue_list()},
            cursor=self.cursor,
        )

    def _after(self) -> World:
        """Re-read the world after a mutation; it becomes the next step's "before"."""
        self.world = self._read_world()
        return self.world

    def _kinds(self, before: World) -> list[str]:
        return [e["kind"] for e in self._events_since(before.cursor)]

    # ------------------------------------------------------------------ common oracles

    def _assert_same_rows(self, before: World, after: World, what: str) -> None:
        for name in ("tasks", "attempts", "sessions", "queues"):
            changed = _diff(getattr(before, name), getattr(after, name))
            assert not changed, f"{what}: {name} changed: {changed}"

    def _expect_rejected(
        self, before: World, exc: Rejected, codes: set[str], what: str, *, logged: bool = True
    ) -> None:
        """I3 directly: a refused report changes no row and leaves exactly one event.

        ``logged=False`` is for a refused claim or heartbeat: per ``orbit.core.errors.Rejected``
        those "could not have changed anything" and are only answered, so no event at all.
        """
        assert codes, f"{what}: expected acceptance, got Rejected({exc.code}): {exc.message}"
        assert exc.code in codes, f"{what}: rejected with {exc.code}, expected {sorted(codes)}"
        after = self._after()
        self._assert_same_rows(before, after, what)
        events = [(e["kind"], e["code"]) for e in self._events_since(before.cursor)]
        expected = [("rejected", str(exc.code))] if logged else []
        assert events == expected, f"{what}: events {events}, expected {expected}"

    def _expect_refused(self, before: World, exc: OrbitError, code: str, what: str) -> None:
        """A request refused before any write (bad state, conflict): no row, no event."""
        assert not isinstance(exc, Rejected), f"{what}: {exc} is not a worker report"
        assert exc.code == code, f"{what}: refused with {exc.code}, expected {code}"
        self._expect_nothing(before, what)

    def _expect_nothing(self, before: World, what: str) -> None:
        after = self._after()
        self._assert_same_rows(before, after, what)
        assert self._kinds(before) == [], f"{what}: wrote events"

    def _only_changed(
        self, before: World, after: World, tasks: set[str], attempts: set[str], what: str
    ) -> None:
        """Rows other than the ones an operation is about stay exactly as they were."""
        for tid in set(before.tasks) - tasks:
            assert after.tasks[tid] == before.tasks[tid], f"{what}: task {tid} changed"
        for aid in set(before.attempts) - attempts:
            assert after.attempts[aid] == before.attempts[aid], f"{what}: attempt {aid} changed"

    # ------------------------------------------------------------------ selection

    def _pick(self, items: Sequence[T], i: int) -> T:
        return items[i % len(items)]

    def _under_cancel(self, world: World, task_id: str | None) -> bool:
        """The task ``task_id`` or one of its ancestors was cancelled: a cancel cascades
        down the whole tree, so nothing under it may be retried or take a new child."""
        while task_id is not None:
            task = world.tasks[task_id]
            if task.cancel_requested or task.state == S.CANCELLED:
                return True
            task_id = task.parent_id
        return False

    def _worker(self, session_id: str) -> Worker:
        return next(w for w in self.workers if w.id == session_id)

    def _stale_epoch(self, worker: Worker) -> int:
        """An epoch the session no longer has: the last fenced one, or one never issued."""
        return worker.old_epochs[-1] if worker.old_epochs else worker.epoch + 1

    def _attempt(self, i: int, states: frozenset[A] | None) -> Attempt:
        """An attempt, preferring those in ``states`` so happy paths are not starved."""
        pool = [
            a for a in self.attempt_ids if states is None or self.world.attempts[a].state in states
        ]
        return self.world.attempts[self._pick(pool or self.attempt_ids, i)]

    def _identity(self, attempt: Attempt, variant: str) -> tuple[str, int, int, set[str]]:
        """The (session, epoch, fence) a report carries, and the codes a stale one gets."""
        owner = self._worker(attempt.session_id)
        if variant == "other_session":
            other = next(w for w in self.workers if w.id != owner.id)
            return other.id, other.epoch, attempt.fence, {Code.NOT_OWNER}
        if variant == "old_epoch":
            return owner.id, self._stale_epoch(owner), attempt.fence, {Code.FENCED_EPOCH}
        if variant == "wrong_fence":
            fence = attempt.fence - 1 if attempt.fence > 1 else attempt.fence + 1
            return owner.id, owner.epoch, fence, {Code.STALE_FENCE}
        return owner.id, owner.epoch, attempt.fence, set()

    def _open_worker(self, caps: dict[str, int], max_concurrency: int) -> Worker:
        self.clock.now += 1  # distinct instants give distinct, ordered UUIDv7 ids
        session, secret = self.store.session_open(
            name=f"w{len(self.workers)}",
            node_id="n1",
            capabilities=[Capability(h, c) for h, c in caps.items()],
            max_concurrency=max_concurrency,
        )
        worker = Worker(session.id, secret, session.epoch)
        self.workers.append(worker)
        return worker

    # ------------------------------------------------------------------ sessions

    @precondition(lambda self: len(self.workers) < MAX_WORKERS)
    @rule(h=st.integers(1, 2), g=st.integers(0, 2), max_concurrency=st.integers(1, 3))
    def open_session(self, h: int, g: int, max_concurrency: int) -> None:
        """More workers with small, different caps, so the session and handler caps bind."""
        caps = {"h": h} | ({"g": g} if g else {})
        before = self.world
        worker = self._open_worker(caps, max_concurrency)
        after = self._after()
        session = after.sessions[worker.id]
        assert session.state == SessionState.LIVE and session.epoch == 1
        assert session.expires_at == self.clock.now + SESSION_TTL
        assert self._kinds(before) == ["session.opened"]

    @rule(w=INDEX, bad_secret=st.sampled_from([False, False, True]))
    def resume(self, w: int, bad_secret: bool) -> None:
        """A reconnect: the epoch is bumped, so every report with the old one is fenced."""
        worker = self._pick(self.workers, w)
        before = self.world
        secret = worker.secret + "x" if bad_secret else worker.secret
        try:
            session = self.store.session_resume(worker.id, secret, node_id="n2")
        except OrbitError as exc:
            assert bad_secret, f"resume refused with the right secret: {exc}"
            self._expect_refused(before, exc, Code.BAD_SECRET, "resume")
            return
        assert not bad_secret, "resume accepted a wrong secret"
        old = before.sessions[worker.id]
        assert session.epoch == old.epoch + 1 == worker.epoch + 1
        worker.old_epochs.append(worker.epoch)
        worker.epoch = session.epoch
        after = self._after()
        assert after.sessions[worker.id] == session
        assert session.state == SessionState.LIVE
        assert session.expires_at == self.clock.now + SESSION_TTL
        self._only_changed(before, after, set(), set(), "resume")
        assert self._kinds(before) == ["session.resumed"]

    @rule(w=INDEX, stale=st.sampled_from([False, False, True]))
    def heartbeat(self, w: int, stale: bool) -> None:
        """Keeps a session alive; from a fenced epoch or after expiry it is refused."""
        worker = self._pick(self.workers, w)
        before = self.world
        epoch = self._stale_epoch(worker) if stale else worker.epoch
        session = before.sessions[worker.id]
        reasons = _session_reasons(session, epoch, self.clock.now, draining=False)
        try:
            renewed = self.store.session_heartbeat(worker.id, epoch)
        except Rejected as exc:
            self._expect_rejected(before, exc, reasons, "heartbeat", logged=False)
            return
        assert not reasons, f"heartbeat accepted despite {reasons}"
        after = self._after()
        assert after.sessions[worker.id] == renewed
        assert renewed.expires_at == self.clock.now + SESSION_TTL
        self._only_changed(before, after, set(), set(), "heartbeat")
        assert self._kinds(before) == []

    @precondition(lambda self: sum(not s.draining for s in self.world.sessions.values()) > 1)
    @rule(w=INDEX, by=st.sampled_from(["operator", "worker", "stale_worker"]))
    def drain(self, w: int, by: str) -> None:
        """Durable drain, by an operator (any epoch) or by the worker (fenced like a report).

        The precondition leaves at least one session undrained, so work can still be claimed.
        """
        worker = self._pick(self.workers, w)
        before = self.world
        was = before.sessions[worker.id].draining
        epoch = {"operator": None, "worker": worker.epoch}.get(by, self._stale_epoch(worker))
        try:
            self.store.session_drain(worker.id, epoch)
        except Rejected as exc:
            codes: set[str] = {Code.FENCED_EPOCH} if by == "stale_worker" else set()
            self._expect_rejected(before, exc, codes, f"drain/{by}")
            return
        assert by != "stale_worker", "a drain from a fenced epoch was accepted"
        after = self._after()
        assert after.sessions[worker.id].draining
        self._only_changed(before, after, set(), set(), "drain")
        assert self._kinds(before) == ([] if was else ["session.draining"])

    # ------------------------------------------------------------------ operator

    @initialize(
        specs=st.lists(SUBMISSIONS, min_size=1, max_size=4),
        claim=st.integers(0, 3),
        start=st.sampled_from([True, True, False]),
    )
    def seed(self, specs: list[dict[str, Any]], claim: int, start: bool) -> None:
        """Start with work queued and maybe claimed. Hypothesis disables a random subset of
        rules per example (swarm testing); without a seed, every example that drew
        ``claim`` as disabled would never reach a start, renew, finish or reap of a lease."""
        for spec in specs:
            self._submit(**spec)
        if claim:
            self.claim(0, claim, False, start)

    @rule(spec=SUBMISSIONS)
    def submit(self, spec: dict[str, Any]) -> None:
        """One client submission, its knobs drawn from ``SUBMIT_ARGS``."""
        self._submit(**spec)

    def _submit(
        self,
        queue: str,
        handler: str,
        tenant: str,
        priority: int,
        retry_safe: bool,
        parent: int | None,
        key: str | None,
        payload: int,
        max_attempts: int,
        timeout_s: int | None,
        delay_s: int | None,
        deadline_s: int | None,
    ) -> None:
        """A task with any mix of the knobs; a new child under a cancelled parent or a
        reused key with another payload is refused before anything is written."""
        self.clock.now += 1  # distinct instants give distinct, ordered UUIDv7 ids
        now = self.clock.now
        before = self.world
        run_after = now + delay_s * SECOND if delay_s else None
        deadline = (run_after or now) + deadline_s * SECOND if deadline_s else None
        parent_id = (
            self._pick(self.task_ids, parent) if parent is not None and self.task_ids else None
        )
        spec = TaskSpec(
            queue=queue,
            handler=handler,
            payload={"n": payload},
            tenant=tenant,
            priority=priority,
            idempotency_key=key,
            parent_id=parent_id,
            retry_safe=retry_safe,
            max_attempts=max_attempts,
            backoff=BACKOFF,
            attempt_timeout_us=timeout_s * SECOND if timeout_s else None,
            deadline=deadline,
            run_after=run_after,
        )
        parent_cancelled = self._under_cancel(before, parent_id)
        prior = self.keys.get((tenant, queue, key)) if key else None
        try:
            submitted = self.store.task_submit(spec)
        except OrbitError as exc:
            if parent_cancelled and prior is None:
                expected = Code.PARENT_CANCELLED
            elif prior is not None and prior[1:] != (payload, handler, parent_id):
                # another payload, handler or parent under the key: another job
                expected = Code.IDEMPOTENCY_CONFLICT
            else:
                raise
            self._expect_refused(before, exc, expected, "submit")
            return
        # A resubmit whose key names a task is idempotent even under a cancelled parent.
        assert not parent_cancelled or prior is not None, "a new child under a cancelled parent"
        if prior is not None:
            assert prior[1:] == (payload, handler, parent_id), "a key was reused for another job"
            assert not submitted.created and submitted.task.id == prior[0]
            self._expect_nothing(before, "submit (idempotent)")
            return
        assert submitted.created
        task = submitted.task
        after = self._after()
        assert after.tasks[task.id] == task
        assert task.state == (S.SCHEDULED if run_after and run_after > now else S.QUEUED)
        assert task.attempts_used == 0 and task.fence == 0 and task.result_version == 0
        self._only_changed(before, after, {task.id}, set(), "submit")
        assert self._kinds(before) == ["submitted"]
        self.task_ids.append(task.id)
        if parent_id:
            self.children.setdefault(parent_id, []).append(task.id)
        if key:
            self.keys[(tenant, queue, key)] = (task.id, payload, handler, parent_id)

    @precondition(lambda self: self.task_ids)
    @rule(i=INDEX)
    def cancel(self, i: int) -> None:
        """I7: the task and every descendant, in one transaction; idempotent."""
        root = self._pick(self.task_ids, i)
        before = self.world
        subtree, todo = [], [root]
        while todo:
            tid = todo.pop()
            subtree.append(tid)
            todo.extend(self.children.get(tid, []))
        returned = self.store.task_cancel(root)
        after = self._after()
        now = self.clock.now
        assert returned == after.tasks[root]
        changed: set[str] = set()
        released: set[str] = set()
        for tid in subtree:
            b, a = before.tasks[tid], after.tasks[tid]
            live = before.live_attempt(tid)
            if b.state in TERMINAL or b.state == S.CANCELLING:
                assert a == b, f"cancel touched {b.state} task {tid}"
                continue
            changed.add(tid)
            assert a.cancel_requested
            if b.state == S.RUNNING:
                assert a.state == S.CANCELLING, a.state
                assert live is not None and after.attempts[live.id] == live
                continue
            assert a.state == S.CANCELLED and a.finished_at == now, (b.state, a.state)
            if b.state == S.CLAIMED:
                assert live is not None
                assert after.attempts[live.id].state == A.RELEASED
                released.add(live.id)
            else:
                assert live is None
        self._only_changed(before, after, changed, released, "cancel")
        events = self._events_since(before.cursor)
        assert sorted(e["task_id"] for e in events) == sorted(changed)
        assert {e["kind"] for e in events} <= {"cancelled", "cancel_requested"}

    @precondition(lambda self: self.task_ids)
    @rule(i=INDEX)
    def retry(self, i: int) -> None:
        """An operator retry of a failed or cancelled task (an I6 operator decision)."""
        tid = self._pick(self.task_ids, i)
        before = self.world
        task = before.tasks[tid]
        parent_cancelled = self._under_cancel(before, task.parent_id)
        try:
            returned = self.store.task_retry(tid)
        except OrbitError as exc:
            if task.state not in (S.FAILED, S.CANCELLED):
                expected = Code.INVALID_STATE
            elif parent_cancelled:
                expected = Code.PARENT_CANCELLED
            elif task.deadline is not None and task.deadline <= self.clock.now:
                expected = Code.DEADLINE_EXCEEDED  # it could only be failed again
            else:
                raise
            self._expect_refused(before, exc, expected, "retry")
            return
        assert task.state in (S.FAILED, S.CANCELLED), f"retried a {task.state} task"
        assert not parent_cancelled, "retried under a cancelled parent or ancestor"
        assert task.deadline is None or task.deadline > self.clock.now, "retried past deadline"
        after = self._after()
        t = after.tasks[tid]
        assert returned == t
        assert t.state == S.QUEUED and not t.cancel_requested
        assert t.attempts_used == task.attempts_used and t.max_attempts > t.attempts_used
        self._only_changed(before, after, {tid}, set(), "retry")
        assert self._kinds(before) == ["retried"]

    @precondition(lambda self: self.task_ids)
    @rule(
        i=INDEX,
        any_task=st.sampled_from([False, False, False, True]),
        decision=st.sampled_from(["succeeded", "failed", "retry"]),
        value=st.integers(0, 2),
    )
    def resolve(self, i: int, any_task: bool, decision: str, value: int) -> None:
        """An operator's decision on a ``needs_review`` task; any other task is refused."""
        before = self.world
        review = [t for t in self.task_ids if before.tasks[t].state == S.NEEDS_REVIEW]
        tid = self._pick(self.task_ids if any_task or not review else review, i)
        task = before.tasks[tid]
        outcome = Outcome.success({"resolved": value}) if decision == "succeeded" else None
        try:
            returned = self.store.task_resolve(tid, decision, outcome)
        except OrbitError as exc:
            past_deadline = task.deadline is not None and task.deadline <= self.clock.now
            if task.state == S.NEEDS_REVIEW and decision == "retry":
                if self._under_cancel(before, task.parent_id):
                    self._expect_refused(before, exc, Code.PARENT_CANCELLED, "resolve")
                    return
                if past_deadline:
                    self._expect_refused(before, exc, Code.DEADLINE_EXCEEDED, "resolve")
                    return
            assert task.state != S.NEEDS_REVIEW, f"resolve refused on needs_review: {exc}"
            self._expect_refused(before, exc, Code.INVALID_STATE, "resolve")
            return
        assert task.state == S.NEEDS_REVIEW, f"resolved a {task.state} task"
        if decision == "retry":
            assert task.deadline is None or task.deadline > self.clock.now, "retried past it"
            assert not self._under_cancel(before, task.parent_id), "retried under a cancel"
        after = self._after()
        t = after.tasks[tid]
        assert returned == t
        assert t.attempts_used == task.attempts_used
        if decision == "succeeded":
            assert t.state == S.SUCCEEDED and t.result_version == 1
            assert t.result == canonical_json({"resolved": value})
        elif decision == "failed":
            assert t.state == S.FAILED and t.result_version == 0
        else:
            assert t.state == S.QUEUED and t.max_attempts > t.attempts_used
        self._only_changed(before, after, {tid}, set(), "resolve")
        assert self._kinds(before) == ["resolved"]

    @rule(name=st.sampled_from(sorted(QUEUES)), paused=st.sampled_from([False, False, True]))
    def pause(self, name: str, paused: bool) -> None:
        before = self.world
        was = before.queues[name].paused
        if paused:
            self.store.queue_pause(name)
        else:
            self.store.queue_resume(name)
        after = self._after()
        assert after.queues[name].paused == paused
        self._only_changed(before, after, set(), set(), "pause")
        kind = "queue.paused" if paused else "queue.resumed"
        assert self._kinds(before) == ([] if was == paused else [kind])

    # ------------------------------------------------------------------ clock and reaper

    @rule(seconds=st.sampled_from([0.5, 1, 2, 3, 4, 6, 12]))
    def advance(self, seconds: float) -> None:
        """Move time only: claims (3 s), leases (5 s) and sessions (30 s) run out."""
        self.clock.advance(seconds)

    @rule(after_s=st.sampled_from([0, 0, 1, 3, 6]))
    def reap(self, after_s: int) -> None:
        """Time passes, then one reaper pass does everything the clock made due, and a
        second pass does nothing. Pairing the two makes expired leases reach the reaper
        (lease loss, needs_review) far more often than two independent rules would."""
        self.clock.advance(after_s)
        before = self.world
        now = self.clock.now
        self.store.reap()
        after = self._after()
        expired = {
            sid
            for sid, s in before.sessions.items()
            if s.state == SessionState.LIVE and s.expires_at <= now
        }
        for sid, s in after.sessions.items():
            was = before.sessions[sid]
            if sid in expired:
                assert s == replace(was, state=SessionState.EXPIRED), s
            else:
                assert s == was, f"reap changed live session {sid}"
        events = self._events_since(before.cursor)
        per_task = Counter(e["task_id"] for e in events if e["task_id"] is not None)
        assert sorted(e["session_id"] for e in events if e["kind"] == "session.expired") == sorted(
            expired
        )
        for tid, b in before.tasks.items():
            a = after.tasks[tid]
            live = before.live_attempt(tid)
            moved = self._check_reaped(b, a, live, after, expired, now)
            assert per_task[tid] == (1 if moved else 0), f"reap: {per_task[tid]} events {tid}"
        for aid, b_att in before.attempts.items():
            if b_att.state not in LIVE:
                assert after.attempts[aid] == b_att
        # Post-condition of a pass: nothing due is left behind.
        for a_att in after.attempts.values():
            assert not (a_att.state == A.CLAIMED and a_att.claim_expires_at <= now), a_att
            assert not (
                a_att.state == A.RUNNING
                and a_att.lease_expires_at is not None
                and a_att.lease_expires_at <= now
            ), a_att
        for t in after.tasks.values():
            assert not (t.state in WAITING and t.deadline is not None and t.deadline <= now), t
            assert not (t.state == S.SCHEDULED and t.run_after <= now), t
        cursor = after.cursor
        self.store.reap()
        again = self._after()
        self._assert_same_rows(after, again, "second reap")
        assert self._events_since(cursor) == [], "a second reap pass changed something"

    def _check_reaped(
        self, b: Task, a: Task, live: Attempt | None, after: World, expired: set[str], now: int
    ) -> bool:
        """Judge one task of a reap pass against DESIGN.md §2; return whether it moved."""
        deadline_passed = b.deadline is not None and now >= b.deadline
        assert a.attempts_used == b.attempts_used and a.fence == b.fence, "reap reset counters"
        if (
            live is not None
            and live.state == A.CLAIMED
            and (live.claim_expires_at <= now or deadline_passed or live.session_id in expired)
        ):
            assert after.attempts[live.id].state == A.RELEASED
            if deadline_passed:
                assert a.state == S.FAILED and a.error_code == Code.DEADLINE_EXCEEDED, a
            else:
                assert a.state == S.QUEUED, a.state
            return True
        if live is not None and live.state == A.RUNNING:
            assert live.lease_expires_at is not None
            if live.lease_expires_at > now:
                assert not deadline_passed, "a run lease outlived the task's deadline"
                assert a == b and after.attempts[live.id] == live
                return False
            ended = after.attempts[live.id]
            timed_out = (
                b.attempt_timeout_us is not None
                and live.started_at is not None
                and now >= live.started_at + b.attempt_timeout_us
            )
            if b.state == S.CANCELLING:
                assert ended.state == A.CANCELLED and a.state == S.CANCELLED, (ended, a)
            elif b.retry_safe:
                assert ended.state == (A.TIMED_OUT if timed_out else A.LOST), ended.state
                if deadline_passed:  # the reaper row: whatever attempts remain
                    assert a.state == S.FAILED and a.error_code == Code.DEADLINE_EXCEEDED, a
                else:
                    code = Code.ATTEMPT_TIMEOUT if timed_out else Code.ATTEMPT_LOST
                    _check_failed_attempt(b, a, now, True, code)
            else:
                assert ended.state == A.UNKNOWN, ended.state
                if deadline_passed:
                    assert a.state == S.FAILED and a.error_code == Code.DEADLINE_EXCEEDED, a
                else:
                    assert a.state == S.NEEDS_REVIEW, a.state
            assert a.result_version == b.result_version == 0
            return True
        if live is not None:  # claimed, nothing due
            assert a == b and after.attempts[live.id] == live
            return False
        if b.state in WAITING and deadline_passed:
            assert a.state == S.FAILED and a.error_code == Code.DEADLINE_EXCEEDED, a
            return True
        if b.state == S.SCHEDULED and b.run_after <= now:
            assert a.state == S.QUEUED, a.state
            return True
        assert a == b, f"reap changed task {b.id} ({b.state} -> {a.state})"
        return False

    # ------------------------------------------------------------------ worker reports

    @rule(
        w=INDEX,
        n=st.integers(1, 3),
        stale=st.sampled_from([False, False, False, True]),
        start=st.sampled_from([True, True, False]),
    )
    def claim(self, w: int, n: int, stale: bool, start: bool) -> None:
        """Claim up to n; like a real worker, optionally start what it got right away."""
        worker = self._pick(self.workers, w)
        before = self.world
        now = self.clock.now
        epoch = self._stale_epoch(worker) if stale else worker.epoch
        session = before.sessions[worker.id]
        reasons = _session_reasons(session, epoch, now, draining=True)
        try:
            grants = self.store.attempt_claim_many(worker.id, epoch, n)
        except Rejected as exc:
            self._expect_rejected(before, exc, reasons, "claim", logged=False)
            return
        assert not reasons, f"claim accepted despite {reasons}"
        after = self._after()
        assert len(grants) <= n
        granted = {g.task.id for g in grants}
        assert len(granted) == len(grants), "one task granted twice in one claim"
        for g in grants:
            b = before.tasks[g.task.id]
            assert b.state in WAITING and b.run_after <= now, b
            assert b.deadline is None or b.deadline > now, "claimed past its deadline"
            assert session.capacity_for(b.handler) > 0, "claimed a handler it cannot run"
            assert not before.queues[b.queue].paused, "claimed from a paused queue"
            assert g.task == after.tasks[b.id] and g.attempt == after.attempts[g.attempt.id]
            assert g.task.state == S.CLAIMED and g.task.fence == b.fence + 1
            att = g.attempt
            assert att.state == A.CLAIMED and att.fence == g.task.fence
            assert att.session_id == worker.id and att.session_epoch == worker.epoch
            assert att.claim_expires_at == now + CLAIM_TTL and att.started_at is None
        self._only_changed(before, after, granted, {g.attempt.id for g in grants}, "claim")
        assert self._kinds(before) == ["claimed"] * len(grants)
        if len(grants) < n:
            self._assert_nothing_admissible(after, after.sessions[worker.id], now)
        self.attempt_ids.extend(g.attempt.id for g in grants)
        if start:
            for g in grants:
                self._start(g.attempt, "owner")

    def _assert_nothing_admissible(self, world: World, session: Session, now: int) -> None:
        """A claim that returned fewer than asked left no task every cap would admit.

        Rate-limited queues are skipped: their token bucket is not modelled here.
        """
        occ = world.occupancy()
        if occ["global"] >= GLOBAL_CAP or occ[f"session:{session.id}"] >= session.max_concurrency:
            return
        for t in world.tasks.values():
            queue = world.queues[t.queue]
            if t.state not in WAITING or t.run_after > now or queue.rate > 0 or queue.paused:
                continue
            if t.deadline is not None and t.deadline <= now:
                continue
            if occ[f"queue:{t.queue}"] >= queue.max_concurrency:
                continue
            if t.tenant in TENANT_CAPS and occ[f"tenant:{t.tenant}"] >= TENANT_CAPS[t.tenant]:
                continue
            if occ[f"handler:{session.id}:{t.handler}"] >= session.capacity_for(t.handler):
                continue
            raise AssertionError(f"claim returned short but task {t.id} was admissible")

    @precondition(lambda self: self.attempt_ids)
    @rule(i=INDEX, fresh=st.sampled_from([True, True, False]), variant=VARIANTS)
    def start(self, i: int, fresh: bool, variant: str) -> None:
        self._start(self._attempt(i, frozenset({A.CLAIMED}) if fresh else None), variant)

    def _start(self, att: Attempt, variant: str) -> None:
        """claimed -> running, the point of no return (I5), or a refusal that changes nothing."""
        before = self.world
        task = before.tasks[att.task_id]
        sid, epoch, fence, stale = self._identity(att, variant)
        session = before.sessions[sid]
        now = self.clock.now
        repeat: Lease | None = None
        if stale:
            reasons = stale
        elif att.state == A.RUNNING and att.lease_expires_at is not None:
            reasons = set() if att.lease_expires_at > now else {Code.LEASE_EXPIRED}
            status = "cancel" if task.state == S.CANCELLING else "ok"
            until = att.lease_expires_at
            repeat = Lease(att.id, status, until, until - now) if not reasons else None
        elif att.state != A.CLAIMED:
            reasons = {Code.ATTEMPT_ENDED, Code.TASK_CANCELLED}
        else:
            reasons = set()
            if now >= att.claim_expires_at:
                reasons.add(Code.CLAIM_EXPIRED)
            if task.cancel_requested or task.state != S.CLAIMED:
                reasons.add(Code.TASK_CANCELLED)
            if task.deadline is not None and now >= task.deadline:
                reasons.add(Code.DEADLINE_EXCEEDED)
            if before.queues[task.queue].paused:
                reasons.add(Code.QUEUE_PAUSED)
            if session.state != SessionState.LIVE or session.expires_at <= now:
                reasons.add(Code.SESSION_EXPIRED)
        try:
            lease = self.store.attempt_start(sid, epoch, att.id, fence)
        except Rejected as exc:
            self._expect_rejected(before, exc, reasons, f"start/{variant}")
            return
        assert not reasons, f"start/{variant} accepted despite {reasons}"
        if repeat is not None:  # a lost ACK retried: the same attempt simply continues
            assert lease == repeat, (lease, repeat)
            self._expect_nothing(before, "repeated start")
            return
        after = self._after()
        running = after.attempts[att.id]
        t = after.tasks[task.id]
        caps = [now + LEASE_TTL, session.expires_at]
        if task.attempt_timeout_us is not None:
            caps.append(now + task.attempt_timeout_us + REPORT_GRACE_US)
        if task.deadline is not None:
            caps.append(task.deadline)
        assert lease == Lease(att.id, "ok", min(caps), min(caps) - now), (lease, caps)
        assert running.state == A.RUNNING and running.started_at == now
        assert running.lease_expires_at == min(caps)
        assert t.state == S.RUNNING and t.attempts_used == task.attempts_used + 1
        self._only_changed(before, after, {task.id}, {att.id}, "start")
        assert self._kinds(before) == ["started"]

    @precondition(lambda self: self.attempt_ids)
    @rule(
        w=INDEX,
        stale=st.sampled_from([False, False, False, True]),
        extra=st.sampled_from(["none", "none", "ended", "foreign"]),
        i=INDEX,
    )
    def renew(self, w: int, stale: bool, extra: str, i: int) -> None:
        """Renew a worker's running leases in one call; a refused one is an event each."""
        worker = self._pick(self.workers, w)
        before = self.world
        now = self.clock.now
        epoch = self._stale_epoch(worker) if stale else worker.epoch
        mine = [a for a in self.attempt_ids if before.attempts[a].session_id == worker.id]
        ids = [a for a in mine if before.attempts[a].state == A.RUNNING]
        others = {
            "ended": [a for a in mine if before.attempts[a].state != A.RUNNING],
            "foreign": [a for a in self.attempt_ids if before.attempts[a].session_id != worker.id],
            "none": [],
        }[extra]
        if others:
            ids.append(self._pick(others, i))
        session = before.sessions[worker.id]
        reasons = _session_reasons(session, epoch, now, draining=False)
        leases = self.store.lease_renew_many(worker.id, epoch, ids)
        after = self._after()
        assert [x.attempt_id for x in leases] == ids
        expect_codes: dict[str, set[str]] = {}
        for lease in leases:
            b = before.attempts[lease.attempt_id]
            task = before.tasks[b.task_id]
            codes = set(reasons)
            if not codes:
                if b.session_id != worker.id:
                    codes.add(Code.NOT_OWNER)
                elif b.state != A.RUNNING or b.lease_expires_at is None:
                    codes.add(Code.ATTEMPT_ENDED)
                elif now >= b.lease_expires_at:
                    codes.add(Code.LEASE_EXPIRED)
            if codes:
                assert lease == Lease(b.id, "lost", None), (lease, codes)
                assert after.attempts[b.id] == b, "a refused renew changed the attempt"
                expect_codes[b.id] = codes
                continue
            assert b.lease_expires_at is not None and b.started_at is not None
            caps = [now + LEASE_TTL, now + SESSION_TTL]
            if task.attempt_timeout_us is not None:
                caps.append(b.started_at + task.attempt_timeout_us + REPORT_GRACE_US)
            if task.deadline is not None:
                caps.append(task.deadline)
            until = max(min(caps), b.lease_expires_at)
            status = "ok"
            if task.state == S.CANCELLING:  # told to stop: the lease is not extended
                until, status = b.lease_expires_at, "cancel"
            assert lease == Lease(b.id, status, until, until - now), (lease, until)
            assert after.attempts[b.id] == replace(b, lease_expires_at=until)
        self._only_changed(before, after, set(), set(ids), "renew")
        s = after.sessions[worker.id]
        if reasons:
            assert s == session, "a refused renew touched the session"
        else:
            assert s.expires_at == now + SESSION_TTL, "renew did not keep the session alive"
        events = self._events_since(before.cursor)
        assert all(e["kind"] == "rejected" for e in events), events
        assert sorted(e["attempt_id"] for e in events) == sorted(expect_codes), events
        for e in events:
            assert e["code"] in expect_codes[e["attempt_id"]], (e, expect_codes)

    @precondition(lambda self: self.attempt_ids)
    @rule(
        i=INDEX,
        prefer=st.sampled_from(["running", "running", "reported", "any"]),
        kind=st.sampled_from(["ok", "retry", "final"]),
        value=st.integers(0, 1),
        repeat=st.booleans(),
        variant=VARIANTS,
    )
    def finish(
        self, i: int, prefer: str, kind: str, value: int, repeat: bool, variant: str
    ) -> None:
        """Fresh finishes, lost-ACK repeats, conflicting repeats and stale reports (I2, I3)."""
        before = self.world
        now = self.clock.now
        if prefer == "reported" and self.reported:
            att = before.attempts[self._pick(sorted(self.reported, key=self.attempt_ids.index), i)]
        else:
            att = self._attempt(i, frozenset({A.RUNNING}) if prefer == "running" else None)
        task = before.tasks[att.task_id]
        sid, epoch, fence, stale = self._identity(att, variant)
        prior = self.reported.get(att.id)
        assert (att.finish_digest is not None) == (prior is not None), "finish digest lost"
        outcome = prior[0] if repeat and prior else _outcome(kind, value)
        same = prior is not None and _same_outcome(prior[0], outcome)
        what = f"finish/{variant}/{'repeat' if prior else 'fresh'}"
        # DESIGN §2: ownership first; then a repeat of the very report gets its receipt
        # back; a stale repeat may be fenced instead (both leave the truth untouched).
        receipt_ok = False
        if variant == "other_session":
            reasons: set[str] = {Code.NOT_OWNER}
        elif prior is not None:
            receipt_ok = same
            reasons = set(stale) if same else {Code.ALREADY_FINISHED} | stale
        elif stale:
            reasons = stale
        elif att.state == A.CLAIMED:
            reasons = {Code.FINISH_WITHOUT_START}
        elif att.state != A.RUNNING:
            reasons = {Code.ATTEMPT_ENDED}
        elif task.state == S.CANCELLING:
            reasons = set()
        else:
            assert att.lease_expires_at is not None
            reasons = set()
            if task.deadline is not None and now >= task.deadline:
                reasons.add(Code.DEADLINE_EXCEEDED)
            if now >= att.lease_expires_at:
                reasons.add(Code.LEASE_EXPIRED)
        try:
            receipt = self.store.attempt_finish(sid, epoch, att.id, fence, outcome)
        except Rejected as exc:
            if prior is not None and same and not stale:
                raise AssertionError(f"{what}: a repeated finish was refused: {exc}") from exc
            self._expect_rejected(before, exc, reasons, what)
            return
        if prior is not None:
            assert receipt_ok, f"{what}: accepted, expected one of {sorted(reasons)}"
            assert receipt == prior[1], f"{what}: another receipt {receipt} != {prior[1]}"
            self._expect_nothing(before, what)
            return
        assert not reasons, f"{what}: accepted despite {sorted(reasons)}"
        after = self._after()
        a, t = after.attempts[att.id], after.tasks[task.id]
        assert a.finish_digest == receipt.result_digest and a.ended_at == now
        assert receipt.task_id == task.id and receipt.attempt_id == att.id
        assert receipt.fence == att.fence
        assert (receipt.task_state, receipt.attempt_state) == (t.state, a.state)
        assert receipt.result_version == t.result_version
        assert t.attempts_used == task.attempts_used
        kinds = self._kinds(before)
        if task.state == S.CANCELLING:  # cancel wins the race: the outcome is evidence only
            assert (t.state, a.state) == (S.CANCELLED, A.CANCELLED), (t.state, a.state)
            assert t.result is None and t.result_version == 0
            assert kinds == ["cancelled"]
        elif outcome.ok:
            assert (t.state, a.state) == (S.SUCCEEDED, A.SUCCEEDED), (t.state, a.state)
            assert t.result == canonical_json(outcome.result) and t.result_version == 1
            assert kinds == ["succeeded"]
        else:
            assert a.state == A.FAILED and t.result_version == 0
            _check_failed_attempt(task, t, now, outcome.retryable, "BOOM")
            assert kinds == ["retry_scheduled" if t.state == S.SCHEDULED else "failed"]
        self._only_changed(before, after, {task.id}, {att.id}, what)
        self.reported[att.id] = (outcome, receipt)

    @precondition(lambda self: self.attempt_ids)
    @rule(i=INDEX, fresh=st.sampled_from([True, True, False]), variant=VARIANTS)
    def release(self, i: int, fresh: bool, variant: str) -> None:
        """claimed -> released: never started, so it costs no attempt (I5)."""
        before = self.world
        att = self._attempt(i, frozenset({A.CLAIMED}) if fresh else None)
        task = before.tasks[att.task_id]
        sid, epoch, fence, stale = self._identity(att, variant)
        now = self.clock.now
        reasons = stale or (set() if att.state == A.CLAIMED else {Code.NOT_CLAIMED})
        try:
            self.store.attempt_release(sid, epoch, att.id, fence)
        except Rejected as exc:
            self._expect_rejected(before, exc, reasons, f"release/{variant}")
            return
        assert not reasons, f"release/{variant} accepted despite {reasons}"
        after = self._after()
        t = after.tasks[task.id]
        assert after.attempts[att.id].state == A.RELEASED
        assert t.attempts_used == task.attempts_used, "a release counted as an attempt"
        if task.deadline is not None and now >= task.deadline:
            assert t.state == S.FAILED and t.error_code == Code.DEADLINE_EXCEEDED
            assert self._kinds(before) == ["failed"]
        else:
            assert t.state == S.QUEUED and t.run_after <= now
            assert self._kinds(before) == ["released"]
        self._only_changed(before, after, {task.id}, {att.id}, "release")

    @precondition(lambda self: self.attempt_ids)
    @rule(
        i=INDEX,
        fresh=st.sampled_from([True, True, False]),
        variant=VARIANTS,
        fraction=st.sampled_from([None, 0.0, 0.5, 1.0]),
    )
    def progress(self, i: int, fresh: bool, variant: str, fraction: float | None) -> None:
        """Progress is an event of a running attempt, never a state change; a stale or late
        one is refused with evidence like any other report."""
        before = self.world
        att = self._attempt(i, frozenset({A.RUNNING}) if fresh else None)
        sid, epoch, fence, stale = self._identity(att, variant)
        now = self.clock.now
        if stale:
            reasons = stale
        elif att.state == A.CLAIMED:
            reasons = {Code.NOT_STARTED}  # live, not yet started: not ATTEMPT_ENDED
        elif att.state != A.RUNNING or att.lease_expires_at is None:
            reasons = {Code.ATTEMPT_ENDED}
        elif now >= att.lease_expires_at:
            reasons = {Code.LEASE_EXPIRED}
        else:
            reasons = set()
        try:
            self.store.attempt_progress(
                sid, epoch, att.id, fence, fraction=fraction, message=f"step {i}"
            )
        except Rejected as exc:
            self._expect_rejected(before, exc, reasons, f"progress/{variant}")
            return
        assert not reasons, f"progress/{variant} accepted despite {reasons}"
        after = self._after()
        self._assert_same_rows(before, after, "progress")
        events = self._events_since(before.cursor)
        assert [(e["kind"], e["attempt_id"]) for e in events] == [("progress", att.id)], events

    # Hypothesis chooses among the enabled rules without weights; a rule listed under a
    # second name is chosen twice as often. Worker reports are where fencing and lease
    # bugs live, and without this they got a small share of each 40-step budget.
    finish_again = finish
    finish_once_more = finish
    start_again = start
    renew_again = renew

    # ------------------------------------------------------------------ invariants

    @invariant()
    def invariants_hold(self) -> None:
        """I1, I2, I4, I5, I6, I7, I9 from the rows and the log; monotonicity between steps."""
        violations = check_all(self.store, self.ledger, I4_CAPS)
        assert violations == [], violations
        world, prev = self.world, self.previous
        assert set(world.tasks) == set(self.task_ids), "tasks appeared or vanished"
        assert set(world.attempts) == set(self.attempt_ids), "attempts appeared or vanished"
        for tid, p in prev.tasks.items():
            t = world.tasks[tid]
            assert t.attempts_used >= p.attempts_used, f"I5 {tid}: attempts_used went back"
            assert t.fence >= p.fence and t.version >= p.version, f"{tid}: fence/version back"
            if p.state == S.SUCCEEDED:
                assert t == p, f"I2 {tid}: a succeeded task changed"
        for aid, p_att in prev.attempts.items():
            if p_att.state not in LIVE:
                assert world.attempts[aid] == p_att, f"ended attempt {aid} changed"
        self.previous = world


SETTINGS = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    database=None,  # keep the working tree clean; failures print a reproduction blob
    print_blob=True,
    # One failure, shrunk fast: shrinking replays whole examples against a real database,
    # and chasing several distinct failures at once can outlast the pytest timeout.
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_random_interleavings_keep_every_invariant(
    make_store: Callable[..., Store], backend: str
) -> None:
    """Every hypothesis example gets an empty store of its own on the fixture's backend."""

    def open_fresh(clock: ManualClock) -> Store:
        store = make_store(clock=clock, config=CONFIG)
        if backend == "postgres":
            _truncate(store)  # the fixture empties the shared database only once per test
        return store

    class Machine(OrbitMachine):
        def __init__(self) -> None:
            super().__init__(open_fresh)

    run_state_machine_as_test(Machine, settings=SETTINGS)
