"""The domain records: queues, tasks, attempts, sessions and events.

All instants are integers: microseconds since the Unix epoch, read from the database
clock (or a test clock) by the store. All durations are integer microseconds too, so
lease and deadline arithmetic is exact on both backends.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, TypeVar

import orjson

from orbit.core.states import AttemptState, SessionState, TaskState

SECOND = 1_000_000
JSON = Any


R = TypeVar("R")
_FIELDS: dict[type, frozenset[str]] = {}


def evolve(record: R, **changes: Any) -> R:
    """``dataclasses.replace`` for these records, about ten times cheaper.

    ``replace`` calls ``__init__`` with every field, and the hot path makes several
    copies per task per transition. The records here are frozen and have no
    ``__post_init__``, so copying the instance dictionary is equivalent; the names of
    the changes are still checked.
    """
    cls = type(record)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field {sorted(changes.keys() - names)}")
    return copied(record, changes)


def build(cls: type[R], **values: Any) -> R:
    """Construct a record from every one of its fields, without the frozen ``__init__``
    (which sets each field through ``object.__setattr__``). Every field must be given,
    and no other."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]
    if values.keys() != names:
        raise TypeError(f"{cls.__name__} fields differ: {sorted(values.keys() ^ names)}")
    return assemble(cls, values)


def assemble(cls: type[R], values: dict[str, Any]) -> R:
    """``build`` without its check, for the store's hot path (hundreds of rows turned
    into records per batch): ``values`` must hold every field and no other, which the
    caller's fixed field list and a test of it guarantee. ``values`` becomes the record's
    own dict (the caller's fresh display, never touched again): copied into the dict
    the new instance makes, its 31 fields cost a task about 900 instructions more."""
    record = _new(cls)
    _set(record, "__dict__", values)
    return record


def copied(record: R, changes: dict[str, Any]) -> R:
    """``evolve`` for the transitions a drain makes per task (a claim, a start, a finish):
    the same copy, without the keywords' packing and the check of their names, which
    cost about as much as the copy (9.8 → 7.1 thousand instructions for a task's copy
    with four changes). ``changes`` is a dict display of field names; a test holds each
    such transition's records to the dataclass's fields."""
    copy = _new(type(record))
    state = copy.__dict__
    state.update(record.__dict__)
    state.update(changes)
    return copy


_new = object.__new__
_set = object.__setattr__


#: One encoder for every canonical spelling: ``json.dumps`` with non-default options
#: builds a new encoder per call, a visible cost at three digests per finish.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


#: Values orjson spells exactly as ``_CANONICAL`` does (every string, checked code point
#: by code point; integers up to 64 bits, beyond which orjson refuses).
_PLAIN = frozenset({str, int, bool, type(None)})


def _plain(value: JSON) -> bool:
    """``value`` is one orjson spells as ``_CANONICAL`` does: a ``_PLAIN`` value, or a
    float Python writes without an exponent (zero, or a magnitude in [1e-4, 1e16)).
    Both write the shortest digits that read back the same double; they differ only in
    the exponent's form (``1e-05`` against ``1e-5``), which such floats do not have. A
    test compares the two over a quarter of a million floats of that range and its
    edges (and 4 million random doubles did, once, when this was written)."""
    kind = type(value)
    return kind in _PLAIN or (kind is float and (value == 0.0 or 1e-4 <= abs(value) < 1e16))


#: How deep ``is_shallow`` looks: an outcome holding a result of dicts is three levels.
SHALLOW_LEVELS = 4


def is_shallow(value: JSON, levels: int = SHALLOW_LEVELS) -> bool:
    """A plain value (``_plain``), or dicts and lists of them nested at most ``levels``
    deep: payloads, results, outcomes and receipts of the usual shapes, which orjson
    spells canonically and which are far from the nesting limit (``check_json_depth``)."""
    kind = type(value)
    if kind is dict:
        items: Any = value.values()
    elif kind is list:
        items = value
    else:
        return _plain(value)
    if all(map(_plain, items)):  # the usual: one level
        return True
    if levels <= 1:
        return False
    inner = levels - 1
    return all(_plain(v) or is_shallow(v, inner) for v in items)


def canonical_json(value: JSON) -> str:
    """One spelling per value, so a digest identifies a payload or a result.

    The standard library's spelling, which a digest must keep, is the definition; orjson
    writes it about five times faster for a shallow value (``is_shallow``: a finish
    spells three such, its outcome, its result and its receipt). Anything else, or
    anything orjson refuses, goes the standard way."""
    encoded = canonical_shallow_utf8(value)
    if encoded is not None:
        return encoded.decode("utf-8")
    return _CANONICAL.encode(value)


def canonical_shallow_utf8(value: JSON) -> bytes | None:
    """``canonical_json``'s fast path: its spelling, UTF-8 encoded, of a shallow value
    (``is_shallow``) that orjson takes; None for any other, which the standard way
    spells (or refuses)."""
    if is_shallow(value):
        try:
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # a key that is not a string, an integer past 64 bits, a lone
            pass  # surrogate
    return None


def compact_json(value: JSON, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON, fast: orjson, several times quicker than the standard library
    where it matters (replies of a thousand tasks, batched writes of hundreds of rows).
    Not canonical (floats are spelled orjson's way), so never for a digest. Values orjson
    refuses (integers past 64 bits, which a payload may hold) fall back to the standard
    library, so every value that was encodable still is."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except TypeError:
        text = json.dumps(
            value, ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=sort_keys
        )
        return text.encode("utf-8")


def sorted_json_texts(values: list[JSON]) -> list[str | None]:
    """``compact_json(value, sort_keys=True)`` of each value as text, None for None: a
    batch's event data (a finish's ``{"digest": …}``, one per task). orjson is called for
    each straight from the loop, not through ``compact_json`` and its ``try`` per value;
    a batch holding a value orjson refuses is spelled through ``compact_json``."""
    dumps, sort = orjson.dumps, orjson.OPT_SORT_KEYS
    try:
        return [None if v is None else dumps(v, option=sort).decode() for v in values]
    except TypeError:
        return [None if v is None else compact_json(v, sort_keys=True).decode() for v in values]


@lru_cache(maxsize=4096)
def instant_text(us: int) -> str:
    """Microseconds since the epoch as RFC 3339 in UTC, to the microsecond, as the API
    spells instants (``orbit.protocol.convert.instant_to_wire``, which takes None too;
    this, the cached formatter itself, serves the hot frames and the core's messages)."""
    seconds, micros = divmod(us, 1_000_000)
    return f"{_second_text(seconds)}.{micros:06d}Z"


@lru_cache(maxsize=256)
def _second_text(seconds: int) -> str:
    """Keyed by whole seconds, so a busy node adds one entry a second and a past second
    is seldom asked for again: at 4,096 entries the cache took 68 minutes to fill, a
    steady 7-8 KB a minute of RSS that a soak took for a leak. 256 covers the seconds
    a batch, a page or a frame spans."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def parse_json(text: str | bytes) -> JSON:
    """JSON text Orbit wrote itself (a stored payload, result or event, a server's reply
    or frame) back to a value, fast: orjson, falling back to the standard library for
    what orjson refuses (lone surrogates, numbers beyond a double). Only for such text:
    orjson reads an integer outside 64 bits as a float, silently, and every integer in
    Orbit's JSON fits in 64 bits, since each request and frame is read strictly on the
    way in (``orbit.protocol.decode``: NUMBER_OUT_OF_RANGE). Anything else takes
    ``json.loads`` or the strict decoder."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with equal jitter: half fixed, half random."""

    base_us: int = 1 * SECOND
    factor: float = 2.0
    max_us: int = 300 * SECOND


#: the backoff of a submission that names none (records are immutable: one will do)
DEFAULT_BACKOFF = Backoff()


@dataclass(frozen=True)
class Queue:
    name: str
    max_concurrency: int
    rate: float  # tasks per second; 0 means unlimited
    burst: int
    paused: bool = False
    tokens: float = 0.0
    tokens_at: int = 0
    created_at: int = 0
    #: the most waiting (queued or scheduled) tasks a submit may leave it with; None: no cap
    max_queued: int | None = None


@dataclass(frozen=True)
class TaskSpec:
    """What a client submits. Validated by ``orbit.core.validate.check_spec``."""

    queue: str
    handler: str
    payload: JSON = None
    tenant: str = "default"
    priority: int = 0
    idempotency_key: str | None = None
    parent_id: str | None = None
    retry_safe: bool = False
    max_attempts: int = 3
    backoff: Backoff = field(default_factory=Backoff)
    attempt_timeout_us: int | None = None
    deadline: int | None = None
    run_after: int | None = None


#: What a schedule does with the fire instants a downtime (or a full queue) made it miss
#: (docs/concepts.md, "Schedules"): ``skip`` them, ``run_once`` for all of them, or
#: ``catch_up`` each (the latest ``max_catch_up`` of them), oldest first.
MISFIRE_POLICIES = ("skip", "run_once", "catch_up")


@dataclass(frozen=True)
class Schedule:
    """A cron expression in a time zone that submits ``template`` at each fire instant.
    Validated by ``orbit.core.validate.check_schedule``; fired by ``Store.schedule_fire``."""

    name: str
    cron: str
    timezone: str
    template: TaskSpec  # a submit's fields, but no idempotency key, parent or instants
    misfire: str  # one of MISFIRE_POLICIES
    max_catch_up: int  # catch_up's bound: the most missed instants fired after a downtime
    paused: bool
    next_fire_at: int  # the next instant to fire (microseconds, UTC)
    last_fire_at: int | None  # the last instant fired, if any
    created_at: int
    updated_at: int
    version: int  # row version: the compare-and-set token of every write


@dataclass(frozen=True)
class Task:
    id: str
    queue: str
    handler: str
    tenant: str
    priority: int
    payload: str  # canonical JSON
    payload_digest: str
    idempotency_key: str | None
    parent_id: str | None
    retry_safe: bool
    max_attempts: int
    backoff: Backoff
    attempt_timeout_us: int | None
    deadline: int | None
    run_after: int
    state: TaskState
    attempts_used: int
    fence: int  # the last fence issued for this task; monotonic
    cancel_requested: bool
    result: str | None  # canonical JSON
    error_code: str | None
    error_message: str | None
    error_retryable: bool | None
    result_digest: str | None
    result_version: int
    created_at: int
    updated_at: int
    finished_at: int | None
    version: int  # row version: the compare-and-set token of every write

    @property
    def terminal(self) -> bool:
        return self.state in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED)


@dataclass(frozen=True)
class Attempt:
    id: str
    task_id: str
    number: int
    session_id: str
    session_epoch: int
    fence: int
    state: AttemptState
    claimed_at: int
    claim_expires_at: int
    started_at: int | None
    lease_expires_at: int | None
    ended_at: int | None
    finish_digest: str | None  # digest of the outcome a worker reported
    receipt: str | None  # canonical JSON of the receipt returned for that report
    queue: str  # copied from the task so caps are counted without a join
    tenant: str
    handler: str

    @property
    def live(self) -> bool:
        return self.state in (AttemptState.CLAIMED, AttemptState.RUNNING)


@dataclass(frozen=True)
class Capability:
    handler: str
    capacity: int


@dataclass(frozen=True)
class Session:
    id: str
    name: str
    node_id: str
    epoch: int
    secret_hash: str
    capabilities: tuple[Capability, ...]
    max_concurrency: int
    capacity_seq: int
    draining: bool
    state: SessionState
    expires_at: int
    created_at: int

    def capacity_for(self, handler: str) -> int:
        for cap in self.capabilities:
            if cap.handler == handler:
                return cap.capacity
        return 0


@dataclass(frozen=True)
class Event:
    """One line of history. ``task_from``/``task_to`` chain into each task's full story."""

    kind: str
    task_id: str | None = None
    attempt_id: str | None = None
    session_id: str | None = None
    queue: str | None = None
    tenant: str | None = None
    task_from: TaskState | None = None
    task_to: TaskState | None = None
    attempt_from: AttemptState | None = None
    attempt_to: AttemptState | None = None
    code: str | None = None
    data: dict[str, JSON] | None = None


@dataclass(frozen=True)
class Outcome:
    """What a worker reports at the end of an attempt."""

    ok: bool
    result: JSON = None
    error_code: str | None = None
    error_message: str | None = None
    retryable: bool = True

    @staticmethod
    def success(result: JSON = None) -> Outcome:
        return Outcome(ok=True, result=result)

    @staticmethod
    def failure(code: str, message: str = "", retryable: bool = True) -> Outcome:
        return Outcome(ok=False, error_code=code, error_message=message, retryable=retryable)

    def as_json(self) -> JSON:
        if self.ok:
            return {"ok": True, "result": self.result}
        return {
            "ok": False,
            "error": {
                "code": self.error_code,
                "message": self.error_message,
                "retryable": self.retryable,
            },
        }


@dataclass(frozen=True)
class Receipt:
    """The answer to an accepted finish; a repeated finish gets the very same one."""

    task_id: str
    attempt_id: str
    fence: int
    task_state: TaskState
    attempt_state: AttemptState
    result_digest: str
    result_version: int

    def as_json(self) -> JSON:
        return {
            "task_id": self.task_id,
            "attempt_id": self.attempt_id,
            "fence": self.fence,
            "task_state": str(self.task_state),
            "attempt_state": str(self.attempt_state),
            "result_digest": self.result_digest,
            "result_version": self.result_version,
        }

    @staticmethod
    def from_json(data: JSON) -> Receipt:
        return Receipt(
            task_id=data["task_id"],
            attempt_id=data["attempt_id"],
            fence=int(data["fence"]),
            task_state=TaskState(data["task_state"]),
            attempt_state=AttemptState(data["attempt_state"]),
            result_digest=data["result_digest"],
            result_version=int(data["result_version"]),
        )


@dataclass(frozen=True)
class Artifact:
    """A blob attached to an attempt's result, kept until ``expires_at``."""

    id: str
    task_id: str
    attempt_id: str
    name: str
    content_type: str
    size: int
    sha256: str | None
    state: str  # uploading | ready
    created_at: int
    expires_at: int
    #: its place in its task's artifact list, given when its upload is committed (None
    #: while uploading): a task's commits take turns, so later ones have larger numbers
    ready_seq: int | None = None


@dataclass(frozen=True)
class Token:
    """An API token as an operator sees it: never its secret nor the secret's hash, so a
    listing can be printed or logged without handing out anything that authenticates."""

    id: str  # the part of ``orbit_<id>_<secret>`` between the underscores
    name: str
    scopes: tuple[str, ...]  # sorted
    created_at: int
    revoked_at: int | None  # None while the token is accepted


@dataclass(frozen=True)
class Grant:
    """One claimed attempt handed to a worker."""

    task: Task
    attempt: Attempt


@dataclass(frozen=True)
class Lease:
    """The answer to a start or a renew for one attempt: ``ok``, ``cancel`` or ``lost``.
    ``lease_left_us`` is the lease's time left by the database's clock when it answered:
    a worker times its lease from that on its own monotonic clock, so a wall clock that
    disagrees with the database's cannot make it renew late (or at once)."""

    attempt_id: str
    status: str
    lease_expires_at: int | None
    lease_left_us: int | None = None
