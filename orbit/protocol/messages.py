"""Every message of the HTTP API and the worker WebSocket, as pydantic models.

Requests forbid unknown fields and are validated strictly (no coercion: ``"5"`` is not
5). 64-bit counters (fences, epochs, sequences, versions) travel as canonical decimal
strings. Instants are RFC 3339 strings with an offset; durations are seconds. The JSON
Schemas under ``schema/`` are generated from these classes (``orbit.protocol.schema``).
"""

from __future__ import annotations

import re
from datetime import UTC
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from orbit.core.cron import MAX_CRON_LEN, MAX_TIMEZONE_LEN
from orbit.core.validate import (
    MAX_ERROR_MESSAGE,
    MAX_GLOBAL_CAP,
    MAX_HANDLER_CAPACITY,
    MAX_QUEUED_CAP,
    MAX_RATE,
    MAX_RENEW_IDS,
    MAX_WORKER_CONCURRENCY,
    MAX_WORKER_HANDLERS,
    MIN_RATE,
    RATE_RANGE,
    is_rate,
)
from orbit.protocol.convert import rfc3339

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
COUNTER_RE = re.compile(r"^(0|[1-9][0-9]{0,18})\Z")
#: a counter's spelling in the schema (the values from 2^63 to 19 nines it lets by are
#: refused NUMBER_OUT_OF_RANGE, as are longer ones)
COUNTER_PATTERN = "^(0|[1-9][0-9]{0,18})$"
_DIGITS_RE = re.compile(r"^[1-9][0-9]*\Z")
MAX_SECONDS = 366 * 24 * 3600.0


def _counter(value: str) -> str:
    """A canonical decimal below 2^63. One of twenty digits or more is out of range as one
    of nineteen above 2^63 - 1 is (protocol.md), not a bad spelling."""
    if not COUNTER_RE.match(value):
        if _DIGITS_RE.match(value):
            raise PydanticCustomError("number_out_of_range", "a counter must be below 2^63")
        raise ValueError("a counter is a decimal string without sign or leading zeros")
    if int(value) > 2**63 - 1:
        raise PydanticCustomError("number_out_of_range", "a counter must be below 2^63")
    return value


def _instant(value: str) -> str:
    """An RFC 3339 date-time with its offset (``orbit.protocol.convert.rfc3339``, which the
    routes read it with), from 1970 to 9998 in UTC."""
    try:
        parsed = rfc3339(value)
    except ValueError:
        raise ValueError(
            "an instant is an RFC 3339 date-time with an offset, e.g. 2026-11-29T12:00:00Z"
        ) from None
    try:
        year = parsed.astimezone(UTC).year
    except OverflowError:
        year = 10_000
    if not 1970 <= year <= 9998:
        raise PydanticCustomError(
            "number_out_of_range", "an instant must fall between 1970 and 9998 (UTC)"
        )
    return value


def _rate(value: float) -> float:
    """A rate in the range the store takes (``orbit.core.validate.is_rate``): the gap
    between 0 and MIN_RATE cannot be said with ``ge``/``le``."""
    if not is_rate(value):
        raise PydanticCustomError("number_out_of_range", f"Input should be {RATE_RANGE}")
    return value


Name = Annotated[str, Field(pattern=NAME_PATTERN)]
#: a queue's rate: 0, or MIN_RATE to MAX_RATE (the schema says so with ``not``)
Rate = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_RATE,
        json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_RATE}},
    ),
    AfterValidator(_rate),
]
Counter = Annotated[
    str,
    Field(examples=["1"], json_schema_extra={"pattern": COUNTER_PATTERN}),
    AfterValidator(_counter),
]
Instant = Annotated[str, Field(examples=["2026-11-29T12:00:00Z"]), AfterValidator(_instant)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
ReqId = Annotated[str, Field(min_length=1, max_length=64)]
Id = Annotated[str, Field(min_length=1, max_length=64)]


class Strict(BaseModel):
    """Base of every request: strict, closed, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    response_only_fields: ClassVar[frozenset[str]] = frozenset()


class Response(BaseModel):
    """Base of every response."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------- HTTP


#: A cap on waiting tasks (a queue's or a tenant's ``max_queued``); null: no cap.
MaxQueued = Annotated[int, Field(ge=1, le=MAX_QUEUED_CAP)]
MAX_QUEUED_DOC = (
    "the most waiting (queued or scheduled) tasks a submit may leave; a submit past it "
    "is refused whole with 429 (QUEUE_FULL, TENANT_FULL), or with 413 (BATCH_EXCEEDS_CAP) "
    "if it makes more new tasks in the queue or tenant than the cap itself; null: no cap"
)


class QueueCreate(Strict):
    name: Name
    max_concurrency: Annotated[int, Field(ge=1, le=1_000_000)]
    rate: Rate = Field(description=f"{RATE_RANGE}; 0 must be written explicitly")
    burst: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_queued: MaxQueued | None = Field(default=None, description=MAX_QUEUED_DOC)
    response_only_fields = frozenset({"paused", "created_at"})
    #: why ``paused`` cannot be sent (``decode_model``'s message): the client sets it,
    #: but by its own call, not at create
    response_only_reasons: ClassVar[dict[str, str]] = {
        "paused": "a queue is created running: pause it with POST /v1/queues/{name}/pause",
    }


#: The fields of a body where null means "remove the cap" (``_never_null`` keeps them).
NULL_REMOVES = frozenset({"max_queued"})


def _never_null(schema: dict[str, Any]) -> None:
    """The schema of a body whose fields may be left out but are never null (but those
    of ``NULL_REMOVES``, where null removes a cap), with at least one given: each
    ``anyOf [X, null]`` property becomes X."""
    for name, prop in schema.get("properties", {}).items():
        if name in NULL_REMOVES:
            prop.pop("default", None)
            continue
        kinds = prop.pop("anyOf", None)
        if kinds is not None:
            prop.update(next(k for k in kinds if k.get("type") != "null"))
        prop.pop("default", None)
    schema["minProperties"] = 1


_Body = TypeVar("_Body", bound=BaseModel)


def _at_least_one(body: _Body) -> _Body:
    """A change body that leaves every field out changes nothing: refused, naming the
    fields it could give (its own, in order)."""
    if not body.model_fields_set:
        names = ", ".join(type(body).model_fields)
        raise PydanticCustomError("at_least_one", f"give at least one of {names}")
    return body


def _kept_if_left_out(value: Any) -> Any:
    """A change body's field that can only be changed, not removed: null is refused (a
    field left out keeps its value)."""
    if value is None:
        raise ValueError("null is not allowed: leave the field out to keep its value")
    return value


class QueueUpdate(Strict):
    """The caps to change (``PATCH /v1/queues/{name}``): at least one; a field left out
    keeps its value. Null is refused, but for ``max_queued``, where it removes the cap."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, json_schema_extra=_never_null
    )
    max_concurrency: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    rate: Rate | None = Field(default=None, description=RATE_RANGE)
    burst: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_queued: MaxQueued | None = Field(default=None, description=MAX_QUEUED_DOC)
    response_only_fields = frozenset({"name", "paused", "created_at"})
    #: why those the server does not set cannot be sent (``decode_model``'s message)
    response_only_reasons: ClassVar[dict[str, str]] = {
        "name": "an update cannot change name: it is the URL's (/v1/queues/{name})",
        "paused": "an update cannot change paused: use POST /v1/queues/{name}/pause or /resume",
    }

    _not_null = field_validator("max_concurrency", "rate", "burst", mode="before")(
        _kept_if_left_out
    )

    _something = model_validator(mode="after")(_at_least_one)


class QueueView(Response):
    name: str
    max_concurrency: int
    rate: float
    burst: int
    paused: bool
    created_at: str
    max_queued: int | None


class QueuePage(Response):
    items: list[QueueView]
    next_cursor: str | None


class LimitSet(Strict):
    """The global concurrency cap (``PUT /v1/limits/global``); null removes it. A
    tenant's caps are a ``TenantLimitSet``."""

    max_concurrency: Annotated[int, Field(ge=1, le=MAX_GLOBAL_CAP)] | None = Field(
        description="live attempts at most, across the cluster; null: no cap"
    )


class TenantLimitSet(Strict):
    """A tenant's caps (``PUT /v1/limits/tenants/{tenant}``): at least one; a field left
    out keeps its value, null removes the cap."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, json_schema_extra={"minProperties": 1}
    )
    # Bounded as LimitSet was, which tenants took before: the store refuses a tenant cap
    # over 1,000,000 with INVALID_ARGUMENT, as it always has.
    max_concurrency: Annotated[int, Field(ge=1, le=MAX_GLOBAL_CAP)] | None = Field(
        default=None,
        description="live attempts at most, in all queues (up to 1,000,000); null: no cap",
    )
    max_queued: MaxQueued | None = Field(
        default=None, description=f"in all queues: {MAX_QUEUED_DOC}"
    )

    _something = model_validator(mode="after")(_at_least_one)


class TenantLimitView(Response):
    tenant: str
    max_concurrency: int | None
    max_queued: int | None


class TenantLimitPage(Response):
    items: list[TenantLimitView]
    next_cursor: str | None


class GlobalLimitView(Response):
    max_concurrency: int | None


class BackoffSpec(Strict):
    base: Seconds = 1.0
    factor: Annotated[float, Field(ge=1, le=100)] = 2.0
    max: Seconds = 300.0


class TaskSubmit(Strict):
    queue: Name
    handler: Name
    payload: Any = None
    tenant: Name = "default"
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = 0
    idempotency_key: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    parent_id: Id | None = None
    retry_safe: bool = False
    max_attempts: Annotated[int, Field(ge=1, le=1000)] = 3
    backoff: BackoffSpec | None = None
    attempt_timeout: Seconds | None = None
    deadline: Instant | None = None
    run_after: Instant | None = None
    response_only_fields = frozenset(
        {
            "id",
            "state",
            "attempts_used",
            "result",
            "error",
            "result_digest",
            "result_version",
            "created_at",
            "updated_at",
            "finished_at",
            "created",
        }
    )


class ScheduleTemplate(Strict):
    """The task a schedule submits at each fire: a submit's fields (``TaskSubmit``),
    checked as a submit's are, but for those each fire sets itself: the idempotency key
    (the schedule's and the instant's), and no parent, deadline or run_after."""

    queue: Name
    handler: Name
    payload: Any = None
    tenant: Name = "default"
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = 0
    retry_safe: bool = False
    max_attempts: Annotated[int, Field(ge=1, le=1000)] = 3
    backoff: BackoffSpec | None = None
    attempt_timeout: Seconds | None = None
    #: each fire's key is the schedule's and the instant's: refused as set by the server
    response_only_fields = frozenset({"idempotency_key"})


#: The bounds of ``cron`` and ``timezone``, stated in the schema but checked by
#: ``check_cron`` and ``check_timezone`` (not by pydantic), so that text out of them is
#: INVALID_CRON or INVALID_TIMEZONE as any other bad text is, not VALUE_TOO_LONG.
_CRON_BOUND: dict[str, Any] = {"minLength": 1, "maxLength": MAX_CRON_LEN}
_TIMEZONE_BOUND: dict[str, Any] = {"minLength": 1, "maxLength": MAX_TIMEZONE_LEN}


class ScheduleCreate(Strict):
    """``POST /v1/schedules``: submit ``template`` at each instant of ``cron`` in
    ``timezone`` (docs/concepts.md, "Schedules")."""

    name: Name
    cron: str = Field(
        description="classic cron's 5 fields: minute hour day-of-month month day-of-week "
        "(e.g. '0 3 * * *')",
        json_schema_extra=_CRON_BOUND,
    )
    timezone: str = Field(
        default="UTC",
        description="an IANA time zone (e.g. Europe/Berlin)",
        json_schema_extra=_TIMEZONE_BOUND,
    )
    template: ScheduleTemplate
    misfire: Literal["skip", "run_once", "catch_up"] = Field(
        default="skip",
        description="what fires for instants missed by more than a minute: none (skip), "
        "one for all (run_once), or each of the latest max_catch_up (catch_up)",
    )
    max_catch_up: Annotated[int, Field(ge=1, le=1000)] = 10
    paused: bool = False
    response_only_fields = frozenset({"next_fire_at", "last_fire_at", "created_at", "updated_at"})


class ScheduleUpdate(Strict):
    """``PATCH /v1/schedules/{name}``: the fields to change, at least one; a field left
    out keeps its value, null is refused. ``template`` replaces the whole template (its
    fields left out take their defaults, as at create). A new ``cron`` or ``timezone``
    moves ``next_fire_at`` to the first instant after now."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, json_schema_extra=_never_null
    )
    cron: str | None = Field(
        default=None,
        description="classic cron's 5 fields: minute hour day-of-month month day-of-week "
        "(e.g. '0 3 * * *')",
        json_schema_extra=_CRON_BOUND,
    )
    timezone: str | None = Field(
        default=None,
        description="an IANA time zone (e.g. Europe/Berlin)",
        json_schema_extra=_TIMEZONE_BOUND,
    )
    template: ScheduleTemplate | None = None
    misfire: Literal["skip", "run_once", "catch_up"] | None = None
    max_catch_up: Annotated[int, Field(ge=1, le=1000)] | None = None
    response_only_fields = frozenset(
        {"name", "paused", "next_fire_at", "last_fire_at", "created_at", "updated_at"}
    )
    #: why those the server does not set cannot be sent (``decode_model``'s message)
    response_only_reasons: ClassVar[dict[str, str]] = {
        "name": "an update cannot change name: it is the URL's (/v1/schedules/{name})",
        "paused": "an update cannot change paused: use POST /v1/schedules/{name}/pause or /resume",
    }

    _not_null = field_validator(
        "cron", "timezone", "template", "misfire", "max_catch_up", mode="before"
    )(_kept_if_left_out)

    _something = model_validator(mode="after")(_at_least_one)


class ScheduleTemplateView(Response):
    queue: str
    handler: str
    payload: Any
    tenant: str
    priority: int
    retry_safe: bool
    max_attempts: int
    backoff: dict[str, float]
    attempt_timeout: float | None


class ScheduleView(Response):
    name: str
    cron: str
    timezone: str
    template: ScheduleTemplateView
    misfire: str
    max_catch_up: int
    paused: bool
    next_fire_at: str
    last_fire_at: str | None
    created_at: str
    updated_at: str


class SchedulePage(Response):
    items: list[ScheduleView]
    next_cursor: str | None


class TaskBatch(Strict):
    tasks: Annotated[list[TaskSubmit], Field(min_length=1, max_length=1000)]


class ErrorSpec(Strict):
    code: Annotated[str, Field(min_length=1, max_length=100)]
    message: Annotated[str, Field(max_length=MAX_ERROR_MESSAGE)] = ""
    retryable: bool = True


class ResolveError(Strict):
    """An operator's error for a task resolved ``failed``: a finish's ``ErrorSpec`` but
    for ``retryable``, false by default as it is stored (nothing retries a task an
    operator failed; the route refuses ``true``)."""

    code: Annotated[str, Field(min_length=1, max_length=100)]
    message: Annotated[str, Field(max_length=MAX_ERROR_MESSAGE)] = ""
    retryable: bool = False


class TaskResolve(Strict):
    decision: Literal["succeeded", "failed", "retry"]
    result: Any = None
    error: ResolveError | None = None


class TaskError(Response):
    code: str
    message: str | None
    retryable: bool | None


class BackoffView(Response):
    """A task's backoff as stored, in seconds (``BackoffSpec`` as submitted)."""

    base: float
    factor: float
    max: float


class TaskView(Response):
    id: str
    queue: str
    handler: str
    tenant: str
    priority: int
    payload: Any
    state: str
    parent_id: str | None
    idempotency_key: str | None
    retry_safe: bool
    attempts_used: int
    max_attempts: int
    backoff: BackoffView
    attempt_timeout: float | None
    deadline: str | None
    run_after: str
    result: Any
    error: TaskError | None
    result_digest: str | None
    result_version: str
    created_at: str
    updated_at: str
    finished_at: str | None


class Submitted(Response):
    task: TaskView
    created: bool


class SubmittedId(Response):
    """A batch reply's item with ``?reply=ids``: the task's id and whether this request
    created it (``false``: its idempotency key named an existing task)."""

    id: str
    created: bool


class TaskPage(Response):
    items: list[TaskView]
    next_cursor: str | None


class AttemptOutcome(Response):
    """How an attempt ended, as the event log recorded it: the ``kind`` and ``code`` of the
    event written in the transaction that ended it (docs/protocol.md, the attempt list)."""

    kind: str
    code: str | None


class AttemptView(Response):
    id: str
    task_id: str
    number: int
    session_id: str
    #: the session's epoch that claimed it (a counter, as ``fence``)
    session_epoch: str
    fence: str
    state: str
    claimed_at: str
    #: when the claim lapses unless the attempt starts
    claim_expires_at: str
    started_at: str | None
    lease_expires_at: str | None
    ended_at: str | None
    #: null while the attempt is claimed or running
    outcome: AttemptOutcome | None


class AttemptPage(Response):
    items: list[AttemptView]
    next_cursor: str | None


class EventView(Response):
    id: str
    at: str
    kind: str
    task_id: str | None
    attempt_id: str | None
    session_id: str | None
    queue: str | None
    tenant: str | None
    task_from: str | None
    task_to: str | None
    attempt_from: str | None
    attempt_to: str | None
    code: str | None
    data: Any


class EventPage(Response):
    items: list[EventView]
    next_cursor: str | None


class WorkerView(Response):
    session_id: str
    name: str
    node_id: str
    epoch: str
    state: str
    draining: bool
    max_concurrency: int
    capabilities: list[dict[str, Any]]
    expires_at: str


class WorkerPage(Response):
    items: list[WorkerView]
    next_cursor: str | None


class ArtifactView(Response):
    id: str
    task_id: str
    attempt_id: str
    name: str
    content_type: str
    size: int
    sha256: str | None
    created_at: str
    expires_at: str


class ArtifactPage(Response):
    items: list[ArtifactView]
    next_cursor: str | None


class TokenCreate(Strict):
    name: Name
    scopes: Annotated[list[Literal["admin", "submit", "worker"]], Field(min_length=1, max_length=3)]
    response_only_fields = frozenset({"token", "id", "created_at"})


class TokenCreated(Response):
    id: str
    name: str
    scopes: list[str]
    token: str = Field(description="shown once; only its hash is stored")


class TokenView(Response):
    """A token as ``GET /v1/tokens`` lists it: never its secret nor the secret's hash."""

    id: str
    name: str
    scopes: list[str]
    created_at: str
    revoked_at: str | None = Field(description="null while the token is accepted")


class TokenPage(Response):
    items: list[TokenView]
    next_cursor: str | None


class ErrorBody(Response):
    code: str
    message: str
    field: str | None = None


class ErrorReply(Response):
    error: ErrorBody


# ----------------------------------------------------------------------------- worker


class CapabilitySpec(Strict):
    handler: Name
    capacity: Annotated[int, Field(ge=1, le=MAX_HANDLER_CAPACITY)]


class Hello(Strict):
    type: Literal["hello"]
    req_id: ReqId
    name: Name
    capabilities: Annotated[
        list[CapabilitySpec], Field(min_length=1, max_length=MAX_WORKER_HANDLERS)
    ]
    max_concurrency: Annotated[int, Field(ge=1, le=MAX_WORKER_CONCURRENCY)]
    push: bool = Field(True, description="let the server push claimed tasks unasked")
    response_only_fields = frozenset({"session_id", "epoch", "resume_secret"})


class Resume(Strict):
    type: Literal["resume"]
    req_id: ReqId
    session_id: Id
    secret: Annotated[str, Field(min_length=1, max_length=200)]
    push: bool = True
    response_only_fields = frozenset({"epoch", "resume_secret"})


class Claim(Strict):
    type: Literal["claim"]
    req_id: ReqId
    n: Annotated[int, Field(ge=1, le=1000)]


class Start(Strict):
    type: Literal["start"]
    req_id: ReqId
    attempt_id: Id
    fence: Counter
    response_only_fields = frozenset({"lease_expires_at", "status"})


class Renew(Strict):
    type: Literal["renew"]
    req_id: ReqId
    attempt_ids: Annotated[list[Id], Field(min_length=1, max_length=MAX_RENEW_IDS)]


class OutcomeSpec(Strict):
    """A success with its result (``{"ok": true, "result": ...}``), or a failure with its
    error and no result (``{"ok": false, "error": {...}}``). A success with an error, or a
    failure without one or with a non-null result, is INVALID_ARGUMENT: a failure's
    result was dropped, and left out of the report's digest (``outcome_of``)."""

    ok: bool
    result: Any = None
    error: ErrorSpec | None = None


class Finish(Strict):
    type: Literal["finish"]
    req_id: ReqId
    attempt_id: Id
    fence: Counter
    outcome: OutcomeSpec
    response_only_fields = frozenset({"receipt", "result_version", "result_digest"})


class StartItem(Strict):
    attempt_id: Id
    fence: Counter


class StartMany(Strict):
    """Start many claimed attempts in one transaction; each is answered on its own."""

    type: Literal["start_many"]
    req_id: ReqId
    items: Annotated[list[StartItem], Field(min_length=1, max_length=1000)]


class FinishItem(Strict):
    attempt_id: Id
    fence: Counter
    outcome: OutcomeSpec


class FinishMany(Strict):
    """Report many outcomes in one transaction: one commit makes them all durable before
    any is acknowledged; each is judged (and answered) on its own."""

    type: Literal["finish_many"]
    req_id: ReqId
    items: Annotated[list[FinishItem], Field(min_length=1, max_length=1000)]


class Release(Strict):
    type: Literal["release"]
    req_id: ReqId
    attempt_id: Id
    fence: Counter


class CapacityUpdate(Strict):
    type: Literal["capacity"]
    req_id: ReqId
    seq: Counter
    capabilities: Annotated[
        list[CapabilitySpec], Field(min_length=1, max_length=MAX_WORKER_HANDLERS)
    ]
    max_concurrency: Annotated[int, Field(ge=1, le=MAX_WORKER_CONCURRENCY)]


class Progress(Strict):
    """How far a running attempt has got; recorded as a ``progress`` event."""

    type: Literal["progress"]
    req_id: ReqId
    attempt_id: Id
    fence: Counter
    fraction: Annotated[float, Field(ge=0, le=1)] | None = None
    message: Annotated[str, Field(max_length=500)] | None = None


class Drain(Strict):
    type: Literal["drain"]
    req_id: ReqId


class Heartbeat(Strict):
    """Keeps an idle session alive (a renew does the same while attempts run)."""

    type: Literal["heartbeat"]
    req_id: ReqId


WORKER_REQUESTS: dict[str, type[Strict]] = {
    "hello": Hello,
    "resume": Resume,
    "claim": Claim,
    "start": Start,
    "renew": Renew,
    "finish": Finish,
    "start_many": StartMany,
    "finish_many": FinishMany,
    "release": Release,
    "capacity": CapacityUpdate,
    "drain": Drain,
    "heartbeat": Heartbeat,
    "progress": Progress,
}


class Welcome(Response):
    type: Literal["welcome"] = "welcome"
    req_id: str
    session_id: str
    epoch: str
    resume_secret: str | None = Field(
        description="sent on hello only; keep it to resume the session on any node"
    )
    heartbeat_interval: float = Field(
        description="seconds between heartbeats that keep the session alive"
    )


class Assignment(Response):
    task_id: str
    attempt_id: str
    fence: str
    handler: str
    queue: str
    tenant: str
    payload: Any
    attempt: int = Field(description="the claim's number (its fence): released claims count")
    retry_safe: bool
    deadline: str | None
    deadline_left: float | None = Field(
        description="seconds to the deadline by the server's clock at the claim"
    )
    attempt_timeout: float | None
    claim_expires_at: str
    # Optional, after the fields older workers read: a worker that does not know them
    # ignores them, and one that does falls back to ``attempt`` without them.
    attempts_used: int | None = Field(
        default=None,
        description="the task's started attempts at the claim: this attempt, once started, "
        "is number attempts_used + 1 of max_attempts (the SDK's ctx.attempt)",
    )
    max_attempts: int | None = Field(default=None, description="the task's max_attempts")


class TasksMessage(Response):
    type: Literal["tasks"] = "tasks"
    req_id: str | None = Field(description="the claim it answers; null when pushed")
    tasks: list[Assignment]


class LeaseView(Response):
    attempt_id: str
    status: Literal["ok", "cancel", "lost"]
    lease_expires_at: str | None
    lease_left: float | None = Field(
        description="seconds of lease left by the server's clock when it answered; "
        "time the lease from this, not from lease_expires_at and the local clock"
    )


class StartedMessage(Response):
    type: Literal["started"] = "started"
    req_id: str
    lease: LeaseView


class RenewedMessage(Response):
    type: Literal["renewed"] = "renewed"
    req_id: str
    leases: list[LeaseView]


class ReceiptView(Response):
    task_id: str
    attempt_id: str
    fence: str
    task_state: str
    attempt_state: str
    result_digest: str
    result_version: str


class FinishedMessage(Response):
    type: Literal["finished"] = "finished"
    req_id: str
    receipt: ReceiptView


class ItemError(Response):
    """Why one report of a batch was refused (the others are unaffected)."""

    code: str
    message: str


class StartedItem(Response):
    attempt_id: str
    lease: LeaseView | None = Field(description="set when the start was accepted")
    error: ItemError | None = Field(description="set when the start was refused")


class StartedManyMessage(Response):
    type: Literal["started_many"] = "started_many"
    req_id: str
    results: list[StartedItem] = Field(description="one per item, in the order sent")


class FinishedItem(Response):
    attempt_id: str
    receipt: ReceiptView | None = Field(description="set when the outcome was committed")
    error: ItemError | None = Field(description="set when the report was refused")


class FinishedManyMessage(Response):
    type: Literal["finished_many"] = "finished_many"
    req_id: str
    results: list[FinishedItem] = Field(description="one per item, in the order sent")


class AckMessage(Response):
    type: Literal["ack"] = "ack"
    req_id: str
    op: str


class CancelMessage(Response):
    type: Literal["cancel"] = "cancel"
    attempt_ids: list[str]


class DrainMessage(Response):
    """Pushed (no req_id) when the session was drained other than by its worker's own
    ``drain``: an operator's ``POST /v1/workers/{id}/drain``, or a resume of a session
    already draining. The worker stops as on SIGTERM: running attempts finish, then it
    exits."""

    type: Literal["drain"] = "drain"


class ErrorMessage(Response):
    type: Literal["error"] = "error"
    req_id: str | None
    code: str
    message: str
    field: str | None = None


WORKER_REPLIES: dict[str, type[Response]] = {
    "welcome": Welcome,
    "tasks": TasksMessage,
    "started": StartedMessage,
    "renewed": RenewedMessage,
    "finished": FinishedMessage,
    "started_many": StartedManyMessage,
    "finished_many": FinishedManyMessage,
    "ack": AckMessage,
    "cancel": CancelMessage,
    "drain": DrainMessage,
    "error": ErrorMessage,
}
