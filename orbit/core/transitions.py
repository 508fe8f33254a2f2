"""Every transition of the lifecycle table, decided as a value.

Each function receives the rows a store has locked, the instant the store read after
taking those locks, and any random draw it needs; it appends to a ``Plan`` the rows to
write (each with the version or state it expects to overwrite), the attempts to insert
and the events to append. The store applies a plan in one transaction with
compare-and-set guards, so a plan built from stale rows changes nothing.

A refused worker report becomes ``plan.rejection``: the plan then holds only the event
that records the evidence (I3, I9), and the store raises the rejection after commit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from orbit.core.errors import Code, Rejected
from orbit.core.model import (
    JSON,
    Attempt,
    Event,
    Lease,
    Outcome,
    Receipt,
    Session,
    Task,
    TaskSpec,
    assemble,
    canonical_json,
    copied,
    evolve,
)
from orbit.core.retry import RetryPlan, past_deadline_message, plan_retry
from orbit.core.states import AttemptState, SessionState, TaskState

A = AttemptState
T = TaskState


def digest(text: str) -> str:
    """sha256 of a canonical JSON text, as ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


#: The longest text ``Digests`` keeps: a short one is cheaper to find than to hash again,
#: and a batch's long results are rarely the same and would be hashed twice.
DIGESTS_KEPT_CHARS = 256


class Digests(dict[str, str]):
    """``digest`` of each text, kept for the texts of at most ``DIGESTS_KEPT_CHARS``: a
    batch of finishes spells the same report and result again and again (every handler
    that returns None reports ``{"ok":true,"result":null}`` and stores ``null``), and
    two sha256 digests a finish were 1 % of a drain's server samples. One per batch, so
    what it keeps lasts no longer than the batch."""

    def __missing__(self, text: str) -> str:
        value = digest(text)
        if len(text) <= DIGESTS_KEPT_CHARS:
            self[text] = value
        return value


@dataclass
class Plan:
    """The writes one transaction must make, in order, plus what to answer."""

    task_writes: list[tuple[Task, Task]] = field(default_factory=list)
    attempt_inserts: list[Attempt] = field(default_factory=list)
    attempt_writes: list[tuple[Attempt, Attempt]] = field(default_factory=list)
    session_writes: list[tuple[Session, Session]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    receipt: Receipt | None = None
    rejection: Rejected | None = None

    def move(
        self,
        before: Task,
        after: Task,
        kind: str,
        *,
        attempt_before: Attempt | None = None,
        attempt_after: Attempt | None = None,
        code: str | None = None,
        data: dict[str, JSON] | None = None,
    ) -> Task:
        """Write a task (and optionally its attempt) and record the transition."""
        return self.moved(
            before,
            evolve(after, version=before.version + 1),
            kind,
            attempt_before=attempt_before,
            attempt_after=attempt_after,
            code=code,
            data=data,
        )

    def moved(
        self,
        before: Task,
        after: Task,
        kind: str,
        *,
        attempt_before: Attempt | None = None,
        attempt_after: Attempt | None = None,
        code: str | None = None,
        data: dict[str, JSON] | None = None,
    ) -> Task:
        """``move`` for an ``after`` whose version is already ``before.version + 1``: a
        claim, a start and a finish make their task's new record with its version in one
        copy (``evolve``), where ``move`` copied it a second time to set the version (a
        copy of 31 fields, per task per transition)."""
        assert after.version == before.version + 1, (before.version, after.version)
        self.task_writes.append((before, after))
        if attempt_after is not None:
            if attempt_before is None:
                self.attempt_inserts.append(attempt_after)
            else:
                self.attempt_writes.append((attempt_before, attempt_after))
        # assemble(): every field named once in this display (a test holds it to the
        # dataclass), without the frozen __init__ (3.6 % of a drain's server samples) nor
        # build()'s check of a dozen keyword arguments (about 2.5 µs a move)
        self.events.append(
            assemble(
                Event,
                {
                    "kind": kind,
                    "task_id": after.id,
                    "attempt_id": attempt_after.id if attempt_after else None,
                    "session_id": attempt_after.session_id if attempt_after else None,
                    "queue": after.queue,
                    "tenant": after.tenant,
                    "task_from": before.state,
                    "task_to": after.state,
                    "attempt_from": attempt_before.state if attempt_before else None,
                    "attempt_to": attempt_after.state if attempt_after else None,
                    "code": code,
                    "data": data,
                },
            )
        )
        return after

    def note(
        self, kind: str, task: Task, attempt: Attempt, session: Session, data: dict[str, JSON]
    ) -> None:
        """Record what a running attempt reported (progress, an artifact): history only."""
        self.events.append(
            Event(
                kind=kind,
                task_id=task.id,
                attempt_id=attempt.id,
                session_id=session.id,
                queue=task.queue,
                tenant=task.tenant,
                data=data,
            )
        )

    def refuse(
        self,
        code: Code,
        message: str,
        report: str,
        task: Task,
        attempt: Attempt,
        session: Session,
        data: dict[str, JSON] | None = None,
    ) -> Rejected:
        """``reject`` for a report about one attempt by one session (the common case)."""
        return self.reject(
            code,
            message,
            report=report,
            task=task,
            attempt=attempt,
            session_id=session.id,
            data=data,
        )

    def reject(
        self,
        code: Code,
        message: str,
        *,
        report: str,
        task: Task | None = None,
        attempt: Attempt | None = None,
        session_id: str | None = None,
        data: dict[str, JSON] | None = None,
    ) -> Rejected:
        """Refuse a report: nothing changes but the evidence event."""
        self.events.append(
            Event(
                kind="rejected",
                task_id=task.id if task else (attempt.task_id if attempt else None),
                attempt_id=attempt.id if attempt else None,
                session_id=session_id,
                queue=task.queue if task else None,
                tenant=task.tenant if task else None,
                code=str(code),
                data={"report": report, **(data or {})},
            )
        )
        self.rejection = Rejected(code, message)
        return self.rejection


# --------------------------------------------------------------------------- submit


#: The fields every submitted task starts with, whatever was submitted (and
#: ``updated_at`` = ``created_at``). The store's insert spells them as literals instead of
#: reading them from each row (``orbit.store.rows.tasks_columns``), so they are named once
#: here for both.
NEW_TASK_FIXED: dict[str, Any] = {
    "attempts_used": 0,
    "fence": 0,
    "cancel_requested": False,
    "result": None,
    "error_code": None,
    "error_message": None,
    "error_retryable": None,
    "result_digest": None,
    "result_version": 0,
    "finished_at": None,
    "version": 1,
}


#: A member read through its enum class costs a lookup in the class each time (60 ns,
#: 190 ns on a loaded machine): the members a claim, start or finish reads per task are
#: module constants.
_SCHEDULED, _QUEUED, _CLAIMED, _RUNNING = T.SCHEDULED, T.QUEUED, T.CLAIMED, T.RUNNING
_CANCELLING, _SUCCEEDED = T.CANCELLING, T.SUCCEEDED
_A_CLAIMED, _A_RUNNING, _A_SUCCEEDED = A.CLAIMED, A.RUNNING, A.SUCCEEDED
_LIVE = SessionState.LIVE


def new_task(
    spec: TaskSpec, *, task_id: str, payload: str, now: int, payload_digest: str | None = None
) -> Task:
    """A submitted task. ``payload_digest`` is ``digest(payload)``, passed by a caller that
    already computed it (the submit compares it against an idempotency key's task).
    Unchecked (``assemble``): a batch submit makes a thousand, and ``build``'s check of
    thirty keyword arguments took more time than the rest; the literal below, with
    ``NEW_TASK_FIXED``, names every field of ``Task`` once, which a test holds."""
    run_after = spec.run_after if spec.run_after is not None else now
    return assemble(
        Task,
        {
            "id": task_id,
            "queue": spec.queue,
            "handler": spec.handler,
            "tenant": spec.tenant,
            "priority": spec.priority,
            "payload": payload,
            "payload_digest": payload_digest or digest(payload),
            "idempotency_key": spec.idempotency_key,
            "parent_id": spec.parent_id,
            "retry_safe": spec.retry_safe,
            "max_attempts": spec.max_attempts,
            "backoff": spec.backoff,
            "attempt_timeout_us": spec.attempt_timeout_us,
            "deadline": spec.deadline,
            "run_after": run_after,
            "state": _SCHEDULED if run_after > now else _QUEUED,
            "created_at": now,
            "updated_at": now,
            **NEW_TASK_FIXED,
        },
    )


# --------------------------------------------------------------------------- claim


def claim(
    plan: Plan, task: Task, session: Session, *, attempt_id: str, now: int, claim_ttl: int
) -> Attempt:
    """Hand a waiting task to a session with a short claim lease."""
    assert task.state in (_QUEUED, _SCHEDULED), task.state
    fence = task.fence + 1
    # assemble(): every field named once (a test holds the display to the dataclass),
    # without the frozen __init__ (as Plan.moved's events; a claim of 200 makes 200, and
    # the __init__ was about 5 % of a claim's CPU) nor build()'s check of the keywords
    attempt = assemble(
        Attempt,
        {
            "id": attempt_id,
            "task_id": task.id,
            "number": fence,
            "session_id": session.id,
            "session_epoch": session.epoch,
            "fence": fence,
            "state": _A_CLAIMED,
            "claimed_at": now,
            "claim_expires_at": now + claim_ttl,
            "started_at": None,
            "lease_expires_at": None,
            "ended_at": None,
            "finish_digest": None,
            "receipt": None,
            "queue": task.queue,
            "tenant": task.tenant,
            "handler": task.handler,
        },
    )
    plan.moved(
        task,
        copied(
            task,
            {"state": _CLAIMED, "fence": fence, "updated_at": now, "version": task.version + 1},
        ),
        "claimed",
        attempt_after=attempt,
    )
    return attempt


def fenced_epoch_message(epoch: int, current: int) -> str:
    """FENCED_EPOCH's message, the same on every path. Older: a resume fenced it. Newer:
    no resume made it (the session never had it), and "fenced by a resume" sent a reader
    looking for one that never happened."""
    why = "was fenced by a resume" if epoch < current else "is not the session's epoch"
    return f"epoch {epoch} {why} (current epoch {current})"


def session_usable(session: Session, epoch: int, now: int) -> tuple[Code, str] | None:
    """Why a session may not claim, or None."""
    if epoch != session.epoch:
        return Code.FENCED_EPOCH, fenced_epoch_message(epoch, session.epoch)
    if session.state != SessionState.LIVE or session.expires_at <= now:
        return Code.SESSION_EXPIRED, "the session has expired; resume it with its secret"
    if session.draining:
        return Code.SESSION_DRAINING, "the session is draining and takes no new work"
    return None


# --------------------------------------------------------------------------- reports


def _check_owner(
    plan: Plan,
    report: str,
    task: Task,
    attempt: Attempt,
    session: Session,
    epoch: int,
    fence: int,
) -> Rejected | None:
    if attempt.session_id != session.id:
        return plan.refuse(
            Code.NOT_OWNER, "the attempt belongs to another session", report, task, attempt, session
        )
    if epoch != session.epoch:
        return plan.refuse(
            Code.FENCED_EPOCH,
            fenced_epoch_message(epoch, session.epoch),
            report,
            task,
            attempt,
            session,
            data={"epoch": epoch, "current_epoch": session.epoch},
        )
    if fence != attempt.fence:
        return plan.refuse(
            Code.STALE_FENCE,
            f"fence {fence} is not the attempt's fence {attempt.fence}",
            report,
            task,
            attempt,
            session,
            data={"fence": fence},
        )
    return None


#: After an attempt's timeout its lease lasts this much longer, so that the runner's own
#: ATTEMPT_TIMEOUT report (sent when it stops the handler) can still be accepted.
REPORT_GRACE_US = 5_000_000


def lease_until(task: Task, started_at: int, session: Session, now: int, lease_ttl: int) -> int:
    """A run lease: ``now + ttl`` capped by the attempt timeout (plus the report grace),
    the task deadline and the session's expiry."""
    until = now + lease_ttl
    if task.attempt_timeout_us is not None:
        until = min(until, started_at + task.attempt_timeout_us + REPORT_GRACE_US)
    if task.deadline is not None:
        until = min(until, task.deadline)
    return min(until, session.expires_at)


def start(
    plan: Plan,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    fence: int,
    queue_paused: bool,
    now: int,
    lease_ttl: int,
) -> Lease | None:
    """claimed -> running: the point of no return (``attempts_used += 1``)."""
    if _check_owner(plan, "start", task, attempt, session, epoch, fence):
        return None
    if attempt.state == _A_RUNNING and attempt.lease_expires_at is not None:
        if attempt.lease_expires_at > now:
            # A repeated start (its ACK was lost): the same attempt simply continues.
            status = "cancel" if task.state == _CANCELLING else "ok"
            until = attempt.lease_expires_at
            return Lease(attempt.id, status, until, until - now)
        plan.refuse(
            Code.LEASE_EXPIRED, "the run lease has expired", "start", task, attempt, session
        )
        return None
    if attempt.state != _A_CLAIMED:
        if task.state == T.CANCELLED:
            # The cancel released the attempt: name the cancel, not the release.
            code = Code.TASK_CANCELLED
            message = f"the task was cancelled: its attempt is {attempt.state}"
        else:
            code, message = Code.ATTEMPT_ENDED, f"the attempt is {attempt.state}, not claimed"
        plan.refuse(code, message, "start", task, attempt, session)
        return None
    reason: tuple[Code, str] | None = None
    if now >= attempt.claim_expires_at:
        reason = Code.CLAIM_EXPIRED, "the claim lease expired before start"
    elif task.cancel_requested or task.state != _CLAIMED:
        reason = Code.TASK_CANCELLED, "the task was cancelled"
    elif task.deadline is not None and now >= task.deadline:
        reason = Code.DEADLINE_EXCEEDED, "the task's deadline has passed"
    elif queue_paused:
        reason = Code.QUEUE_PAUSED, f"queue {task.queue} is paused; release the attempt"
    elif session.state != _LIVE or session.expires_at <= now:
        reason = Code.SESSION_EXPIRED, "the session has expired; resume it first"
    if reason is not None:
        plan.refuse(reason[0], reason[1], "start", task, attempt, session)
        return None
    lease = lease_until(task, now, session, now, lease_ttl)
    answer = assemble(  # the frozen __init__ set its four fields one call each
        Lease,
        {
            "attempt_id": attempt.id,
            "status": "ok",
            "lease_expires_at": lease,
            "lease_left_us": lease - now,
        },
    )
    # copied(): evolve without its keywords' cost, two records per task per start
    running = copied(attempt, {"state": _A_RUNNING, "started_at": now, "lease_expires_at": lease})
    after = copied(
        task,
        {
            "state": _RUNNING,
            "attempts_used": task.attempts_used + 1,
            "updated_at": now,
            "version": task.version + 1,
        },
    )
    plan.moved(
        task,
        after,
        "started",
        attempt_before=attempt,
        attempt_after=running,
    )
    return answer


def renew(
    plan: Plan,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    now: int,
    lease_ttl: int,
) -> Lease:
    """Extend one run lease; the answer is ``ok``, ``cancel`` (stop now: the lease is not
    extended) or ``lost``."""
    lost = Lease(attempt.id, "lost", None)
    if attempt.session_id != session.id or epoch != session.epoch:
        code = Code.NOT_OWNER if attempt.session_id != session.id else Code.FENCED_EPOCH
        plan.reject(
            code, "not the owner", report="renew", task=task, attempt=attempt, session_id=session.id
        )
        return lost
    if not _check_live(plan, "renew", task, attempt, session, now):
        return lost
    assert attempt.lease_expires_at is not None
    assert attempt.started_at is not None
    if task.state == T.CANCELLING:
        # Cancel means stop now (DESIGN §2): the worker has what is left of the lease it
        # held to stop and report. Extending it would let a worker that ignores the cancel
        # keep the task `cancelling`, and its permit, for as long as it renews; unextended,
        # the reaper cancels the task once the lease ends.
        until = attempt.lease_expires_at
        return Lease(attempt.id, "cancel", until, until - now)
    until = lease_until(task, attempt.started_at, session, now, lease_ttl)
    if attempt.lease_expires_at <= now + lease_ttl:
        # A renew never shortens a lease (docs/concepts.md, "Leases"), even where a cap
        # (a session TTL shorter than the lease TTL, set on this node in a rolling change)
        # ends a fresh one sooner. But a lease that ends later than now + lease_ttl was
        # granted before the store's clock went back (or by a node with a longer TTL):
        # kept, it would outlive the session and hold its permit for the length of the
        # step after its worker died. The new lease alone counts then, and the answer
        # tells the worker (the reaper pulls back the leases nobody renews).
        until = max(until, attempt.lease_expires_at)
    if until != attempt.lease_expires_at:
        plan.attempt_writes.append((attempt, evolve(attempt, lease_expires_at=until)))
    # Past the attempt timeout the lease is no longer extended (it ends at timeout + the
    # report grace); the runner stops the handler on its own clock and reports the timeout.
    return Lease(attempt.id, "ok", until, until - now)  # a live lease: until > now


#: How every success's canonical spelling begins: ``{"ok": true, "result": …}`` with its
#: keys sorted ("ok" before "result") and no spaces.
_SUCCESS_OPEN = '{"ok":true,"result":'


def receipt_json(receipt: Receipt) -> str:
    """``canonical_json(receipt.as_json())``, which every accepted finish stores: a
    receipt holds strings and integers only, which orjson spells as the standard
    library does (``model._plain``), so it is spelled at once, without
    ``canonical_json``'s look at each of its seven values (``is_shallow``). A value
    orjson refuses (a lone surrogate, an integer past 64 bits) goes the standard way."""
    values = receipt.as_json()
    try:
        return orjson.dumps(values, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except TypeError:
        return canonical_json(values)


class Spelled(NamedTuple):
    """An outcome's canonical spellings, made once per report: ``report`` is the whole
    outcome's (``canonical_json(outcome.as_json())``, whose digest identifies the report)
    and ``result`` a success's result's (None for a failure), which the task stores."""

    report: str
    result: str | None


def spell(outcome: Outcome) -> Spelled:
    """``Spelled`` for an outcome; raises as ``canonical_json`` does for a value that is
    not JSON. A success's report is its result's spelling inside ``_SUCCESS_OPEN`` and
    ``}``: exactly ``canonical_json`` of the whole (each level's keys are sorted on
    their own), so a finish spells its result once where it spelled it twice (a test
    holds the two spellings equal)."""
    if outcome.ok:
        result = canonical_json(outcome.result)
        return Spelled(_SUCCESS_OPEN + result + "}", result)
    return Spelled(canonical_json(outcome.as_json()), None)


def finish(
    plan: Plan,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    fence: int,
    outcome: Outcome,
    spelled: Spelled,
    now: int,
    rand: float,
    digests: Digests | None = None,
) -> Receipt | None:
    """End a running attempt with the worker's outcome, or refuse the report.
    ``spelled`` is ``spell(outcome)``, which the store made when it checked the outcome;
    ``digests``, the batch's digests of the texts it has spelled (``Digests``)."""
    if digests is None:
        digests = Digests()
    report_digest = digests[spelled.report]
    if attempt.session_id != session.id:
        plan.refuse(
            Code.NOT_OWNER,
            "the attempt belongs to another session",
            "finish",
            task,
            attempt,
            session,
        )
        return None
    if attempt.finish_digest is not None and attempt.receipt is not None:
        if attempt.finish_digest == report_digest:
            # A lost ACK retried: the very same receipt, nothing written.
            plan.receipt = Receipt.from_json(json.loads(attempt.receipt))
            return plan.receipt
        plan.refuse(
            Code.ALREADY_FINISHED,
            "the attempt already reported another outcome",
            "finish",
            task,
            attempt,
            session,
            data={"digest": report_digest},
        )
        return None
    if _check_owner(plan, "finish", task, attempt, session, epoch, fence):
        return None
    if attempt.state == _A_CLAIMED:
        plan.refuse(
            Code.FINISH_WITHOUT_START,
            "the attempt was never started",
            "finish",
            task,
            attempt,
            session,
            data={"digest": report_digest, "ok": outcome.ok},
        )
        return None
    if attempt.state != _A_RUNNING:
        plan.refuse(
            Code.ATTEMPT_ENDED,
            f"the attempt already ended as {attempt.state}",
            "finish",
            task,
            attempt,
            session,
            data={"digest": report_digest, "ok": outcome.ok},
        )
        return None
    version = task.version + 1
    if task.state == _CANCELLING:
        # Cancel wins the race: the outcome is kept as evidence only.
        ended = evolve(attempt, state=A.CANCELLED, ended_at=now, finish_digest=report_digest)
        after = evolve(task, state=T.CANCELLED, updated_at=now, finished_at=now, version=version)
        receipt = Receipt(
            task.id,
            attempt.id,
            attempt.fence,
            T.CANCELLED,
            A.CANCELLED,
            report_digest,
            task.result_version,
        )
        ended = evolve(ended, receipt=receipt_json(receipt))
        plan.moved(
            task,
            after,
            "cancelled",
            attempt_before=attempt,
            attempt_after=ended,
            data={"outcome": outcome.as_json(), "digest": report_digest},
        )
        plan.receipt = receipt
        return receipt
    if task.deadline is not None and now >= task.deadline:
        plan.refuse(
            Code.DEADLINE_EXCEEDED,
            "the task's deadline has passed",
            "finish",
            task,
            attempt,
            session,
            data={"digest": report_digest, "ok": outcome.ok},
        )
        return None
    assert attempt.lease_expires_at is not None
    if now >= attempt.lease_expires_at:
        plan.refuse(
            Code.LEASE_EXPIRED,
            "the run lease expired before the report arrived",
            "finish",
            task,
            attempt,
            session,
            data={"digest": report_digest, "ok": outcome.ok},
        )
        return None
    if outcome.ok:
        result = spelled.result
        assert result is not None  # spell() gives a success its result's spelling
        after = copied(
            task,
            {
                "state": _SUCCEEDED,
                "result": result,
                "result_digest": digests[result],
                "result_version": task.result_version + 1,
                "error_code": None,
                "error_message": None,
                "error_retryable": None,
                "updated_at": now,
                "finished_at": now,
                "version": version,
            },
        )
        attempt_state = _A_SUCCEEDED
        kind = "succeeded"
    else:
        code = outcome.error_code or str(Code.HANDLER_ERROR)
        decision = _task_retry(task, outcome.retryable, now, rand, code)
        base = evolve(
            task,
            error_code=code,
            error_message=outcome.error_message,
            error_retryable=outcome.retryable,
            updated_at=now,
            version=version,
        )
        attempt_state = A.FAILED
        if decision.retry_at is not None:
            after = evolve(base, state=T.SCHEDULED, run_after=decision.retry_at)
            kind = "retry_scheduled"
        else:
            final = decision.final_code or code
            after = evolve(base, state=T.FAILED, error_code=final, finished_at=now)
            if decision.past_deadline is not None:  # says why it ended before the deadline
                message = past_deadline_message(decision.past_deadline, code, outcome.error_message)
                after = evolve(after, error_message=message)
            if final == Code.DEADLINE_EXCEEDED:  # no retry can come, whatever the error
                after = evolve(after, error_retryable=False)
            kind = "failed"
    # assemble(): the frozen __init__ set its seven fields one call each
    receipt = assemble(
        Receipt,
        {
            "task_id": task.id,
            "attempt_id": attempt.id,
            "fence": attempt.fence,
            "task_state": after.state,
            "attempt_state": attempt_state,
            "result_digest": report_digest,
            "result_version": after.result_version,
        },
    )
    ended = copied(
        attempt,
        {
            "state": attempt_state,
            "ended_at": now,
            "finish_digest": report_digest,
            "receipt": receipt_json(receipt),
        },
    )
    plan.moved(
        task,
        after,
        kind,
        attempt_before=attempt,
        attempt_after=ended,
        code=after.error_code if not outcome.ok else None,
        data={"digest": report_digest},
    )
    plan.receipt = receipt
    return receipt


def check_running(
    plan: Plan,
    report: str,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    fence: int,
    now: int,
) -> bool:
    """The guard of every report made while an attempt runs (progress, artifacts): the
    caller owns it at the current epoch and fence, it has started, and its lease has not
    expired. A claimed attempt is live, not over: NOT_STARTED, not ATTEMPT_ENDED, which
    would tell the worker to give up a claim it still holds."""
    if _check_owner(plan, report, task, attempt, session, epoch, fence):
        return False
    if attempt.state == _A_CLAIMED:
        plan.refuse(
            Code.NOT_STARTED,
            f"the attempt is claimed and not started: start it before its {report}",
            report,
            task,
            attempt,
            session,
        )
        return False
    return _check_live(plan, report, task, attempt, session, now)


def _check_live(
    plan: Plan, report: str, task: Task, attempt: Attempt, session: Session, now: int
) -> bool:
    """The attempt is running and its lease has not expired by the clock."""
    if attempt.state != A.RUNNING or attempt.lease_expires_at is None:
        plan.refuse(
            Code.ATTEMPT_ENDED, f"the attempt is {attempt.state}", report, task, attempt, session
        )
        return False
    if now >= attempt.lease_expires_at:
        plan.refuse(Code.LEASE_EXPIRED, "the run lease has expired", report, task, attempt, session)
        return False
    return True


def check_artifact(
    plan: Plan,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    fence: int,
    now: int,
) -> bool:
    """An artifact may be attached by the owner of a live lease, and not once the task
    is being cancelled: a cancelled task has no result and no artifact (DESIGN §5.1)."""
    if not check_running(
        plan, "artifact", task, attempt, session, epoch=epoch, fence=fence, now=now
    ):
        return False
    if task.cancel_requested:
        plan.refuse(
            Code.TASK_CANCELLED, "the task is being cancelled", "artifact", task, attempt, session
        )
        return False
    return True


def progress(
    plan: Plan,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    fence: int,
    now: int,
    data: dict[str, JSON],
) -> bool:
    """Record a running attempt's progress: an event, never a state change."""
    if not check_running(
        plan, "progress", task, attempt, session, epoch=epoch, fence=fence, now=now
    ):
        return False
    plan.note("progress", task, attempt, session, data)
    return True


def release(
    plan: Plan,
    task: Task,
    attempt: Attempt,
    session: Session,
    *,
    epoch: int,
    fence: int,
    now: int,
) -> bool:
    """claimed -> released: never started, so it does not count against max_attempts."""
    if _check_owner(plan, "release", task, attempt, session, epoch, fence):
        return False
    if attempt.state != A.CLAIMED:
        plan.refuse(
            Code.NOT_CLAIMED,
            f"the attempt is {attempt.state}, not claimed",
            "release",
            task,
            attempt,
            session,
        )
        return False
    _release(plan, task, attempt, now, "released")
    return True


def _release(
    plan: Plan, task: Task, attempt: Attempt, now: int, kind: str, code: str | None = None
) -> Task:
    released = evolve(attempt, state=A.RELEASED, ended_at=now)
    if task.deadline is not None and now >= task.deadline:
        after = evolve(
            task,
            state=T.FAILED,
            error_code=str(Code.DEADLINE_EXCEEDED),
            error_message=_unrun_deadline_message(task),
            error_retryable=False,
            updated_at=now,
            finished_at=now,
        )
        return plan.move(
            task,
            after,
            "failed",
            attempt_before=attempt,
            attempt_after=released,
            code=str(Code.DEADLINE_EXCEEDED),
        )
    after = evolve(task, state=T.QUEUED, run_after=min(task.run_after, now), updated_at=now)
    return plan.move(task, after, kind, attempt_before=attempt, attempt_after=released, code=code)


# --------------------------------------------------------------------------- operator


def cancel(plan: Plan, task: Task, live: Attempt | None, now: int) -> None:
    """Cancel one task of a cascade; the store calls this for the root and each descendant."""
    if task.terminal or task.state == T.CANCELLING:
        return
    if task.state == T.RUNNING:
        assert live is not None
        after = evolve(task, state=T.CANCELLING, cancel_requested=True, updated_at=now)
        plan.move(
            task,
            after,
            "cancel_requested",
            data={"attempt_id": live.id, "session_id": live.session_id},
        )
        return
    after = evolve(task, state=T.CANCELLED, cancel_requested=True, updated_at=now, finished_at=now)
    if task.state == T.CLAIMED:
        assert live is not None
        released = evolve(live, state=A.RELEASED, ended_at=now)
        plan.move(task, after, "cancelled", attempt_before=live, attempt_after=released)
    else:
        plan.move(task, after, "cancelled")


def resolve(plan: Plan, task: Task, decision: str, outcome: Outcome | None, now: int) -> Task:
    """An operator's decision on a ``needs_review`` task (checked by the caller)."""
    if decision == "succeeded":
        result = canonical_json(outcome.result if outcome else None)
        after = evolve(
            task,
            state=T.SUCCEEDED,
            result=result,
            result_digest=digest(result),
            result_version=task.result_version + 1,
            error_code=None,
            error_message=None,
            error_retryable=None,
            updated_at=now,
            finished_at=now,
        )
    elif decision == "failed":
        after = evolve(
            task,
            state=T.FAILED,
            error_code=(outcome.error_code if outcome else None) or str(Code.RESOLVED_FAILED),
            error_message=(outcome.error_message if outcome else None)
            or "marked failed by an operator",
            error_retryable=False,
            updated_at=now,
            finished_at=now,
        )
    else:
        after = evolve(
            task,
            state=T.QUEUED,
            run_after=now,
            max_attempts=max(task.max_attempts, task.attempts_used + 1),
            error_code=None,
            error_message=None,
            error_retryable=None,
            updated_at=now,
        )
    return plan.move(task, after, "resolved", data={"decision": decision})


def retry(plan: Plan, task: Task, now: int) -> Task:
    """Run a failed or cancelled task again (an operator decision), with one more attempt."""
    after = evolve(
        task,
        state=T.QUEUED,
        run_after=now,
        cancel_requested=False,
        max_attempts=max(task.max_attempts, task.attempts_used + 1),
        error_code=None,
        error_message=None,
        error_retryable=None,
        finished_at=None,
        updated_at=now,
    )
    return plan.move(task, after, "retried")


# --------------------------------------------------------------------------- reaper


def reap(plan: Plan, task: Task, live: Attempt | None, now: int, rand: float) -> None:
    """Whatever the clock has made due for one task: expired leases, deadlines, run_after."""
    if live is not None and live.state == A.CLAIMED and live.claim_expires_at <= now:
        _release(plan, task, live, now, "claim_expired", code="CLAIM_EXPIRED")
        return
    if (
        live is not None
        and live.state == A.RUNNING
        and live.lease_expires_at is not None
        and live.lease_expires_at <= now
    ):
        _lease_expired(plan, task, live, now, rand)
        return
    if (
        live is not None
        and live.state == A.CLAIMED
        and task.deadline is not None
        and now >= task.deadline
    ):
        _release(plan, task, live, now, "released")
        return
    if live is None and task.state in (T.QUEUED, T.SCHEDULED):
        if task.deadline is not None and now >= task.deadline:
            after = evolve(
                task,
                state=T.FAILED,
                error_code=str(Code.DEADLINE_EXCEEDED),
                error_message=_unrun_deadline_message(task),
                error_retryable=False,
                updated_at=now,
                finished_at=now,
            )
            plan.move(task, after, "failed", code=str(Code.DEADLINE_EXCEEDED))
        elif task.state == T.SCHEDULED and task.run_after <= now:
            plan.move(task, evolve(task, state=T.QUEUED, updated_at=now), "queued")


def _unrun_deadline_message(task: Task) -> str:
    """Why a task that no attempt is running fails at its deadline. A task that never
    started says so; one that ran and waits for a retry failed before its next attempt,
    and the message keeps its last attempt's error (``code: message``, as the message of
    a task whose next attempt would fall past the deadline does), which DEADLINE_EXCEEDED
    replaces as the task's error: the view has no other place for it."""
    if task.attempts_used == 0:
        return "the deadline passed before the task could run"
    used = f"{task.attempts_used} of {task.max_attempts} attempts used"
    passed = f"the deadline passed before its next attempt ({used})"
    if task.error_code is None:
        return passed
    return f"{passed}; the last attempt failed {task.error_code}: {task.error_message or ''}"


def _task_retry(task: Task, retryable: bool, now: int, rand: float, code: str) -> RetryPlan:
    """``plan_retry`` for a failed attempt of ``task``: its attempts, deadline, backoff."""
    return plan_retry(
        retryable=retryable,
        attempts_used=task.attempts_used,
        max_attempts=task.max_attempts,
        deadline=task.deadline,
        backoff=task.backoff,
        now=now,
        rand=rand,
        error_code=code,
    )


def _lease_expired(plan: Plan, task: Task, live: Attempt, now: int, rand: float) -> None:
    timed_out = (
        task.attempt_timeout_us is not None
        and live.started_at is not None
        and now >= live.started_at + task.attempt_timeout_us
    )
    deadline_passed = task.deadline is not None and now >= task.deadline
    if task.state == T.CANCELLING:
        ended = evolve(live, state=A.CANCELLED, ended_at=now)
        after = evolve(task, state=T.CANCELLED, updated_at=now, finished_at=now)
        plan.move(
            task, after, "cancelled", attempt_before=live, attempt_after=ended, code="LEASE_EXPIRED"
        )
        return
    if task.retry_safe:
        attempt_state = A.TIMED_OUT if timed_out else A.LOST
        code = str(Code.ATTEMPT_TIMEOUT if timed_out else Code.ATTEMPT_LOST)
        # A passed deadline ends the task whatever attempts remain (the reaper row of the
        # state table), so it is checked before plan_retry, which looks at attempts first.
        decision = (
            RetryPlan(None, str(Code.DEADLINE_EXCEEDED))
            if deadline_passed
            else _task_retry(task, True, now, rand, code)
        )
        ended = evolve(live, state=attempt_state, ended_at=now)
        base = evolve(
            task,
            error_code=code,
            error_retryable=not deadline_passed,
            updated_at=now,
            error_message="the deadline passed while the attempt ran without a report"
            if deadline_passed
            else "the run lease expired without a report",
        )
        if decision.retry_at is not None:
            plan.move(
                task,
                evolve(base, state=T.SCHEDULED, run_after=decision.retry_at),
                "retry_scheduled",
                attempt_before=live,
                attempt_after=ended,
                code=code,
            )
        else:
            final = decision.final_code or code
            # DEADLINE_EXCEEDED is never retryable, whichever way the deadline ended it (a
            # retry that would fall past it, too): the reaper's own end at it says so
            retryable = base.error_retryable and final != Code.DEADLINE_EXCEEDED
            message = base.error_message
            if decision.past_deadline is not None:  # says why it ended before the deadline
                message = past_deadline_message(decision.past_deadline, code, message)
            plan.move(
                task,
                evolve(
                    base,
                    state=T.FAILED,
                    error_code=final,
                    error_message=message,
                    error_retryable=retryable,
                    finished_at=now,
                ),
                "failed",
                attempt_before=live,
                attempt_after=ended,
                code=final,
            )
        return
    ended = evolve(live, state=A.UNKNOWN, ended_at=now)
    if deadline_passed:
        after = evolve(
            task,
            state=T.FAILED,
            error_code=str(Code.DEADLINE_EXCEEDED),
            error_message="the deadline passed; the last attempt's effects are unknown",
            error_retryable=False,
            updated_at=now,
            finished_at=now,
        )
        plan.move(
            task,
            after,
            "failed",
            attempt_before=live,
            attempt_after=ended,
            code=str(Code.DEADLINE_EXCEEDED),
        )
        return
    after = evolve(
        task,
        state=T.NEEDS_REVIEW,
        error_code=str(Code.OUTCOME_UNKNOWN),
        error_message="the run lease expired; the handler may have had effects",
        error_retryable=False,
        updated_at=now,
    )
    plan.move(
        task,
        after,
        "needs_review",
        attempt_before=live,
        attempt_after=ended,
        code="ATTEMPT_TIMEOUT" if timed_out else "LEASE_EXPIRED",
    )


def expire_session(
    plan: Plan, session: Session, claimed: list[tuple[Task, Attempt]], now: int
) -> None:
    """A session's heartbeat lapsed: it expires and its claimed attempts go back."""
    plan.session_writes.append((session, evolve(session, state=SessionState.EXPIRED)))
    plan.events.append(Event(kind="session.expired", session_id=session.id))
    release_claims(plan, claimed, now, Code.SESSION_EXPIRED)


def release_claims(plan: Plan, claimed: list[tuple[Task, Attempt]], now: int, code: Code) -> None:
    """claimed -> released for attempts their session can no longer start (it expired,
    or its connection was closed for a revoked token), each task queued again (or failed
    past its deadline); ``code`` says why on each event."""
    for task, attempt in claimed:
        _release(plan, task, attempt, now, "released", code=str(code))
