"""Input checks that run before any state is touched. Each failure is a clear OrbitError."""

from __future__ import annotations

import math
import re

from orbit.core.cron import check_cron, check_timezone, stored_zone
from orbit.core.errors import Code, OrbitError
from orbit.core.model import (
    JSON,
    MISFIRE_POLICIES,
    Backoff,
    TaskSpec,
    canonical_json,
    canonical_shallow_utf8,
    is_shallow,
)

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
NAME_RE = re.compile(rf"^{_NAME}\Z")  # \Z: $ would pass a final newline
MAX_PRIORITY = 1_000_000
MAX_ATTEMPTS_LIMIT = 1_000
MAX_KEY_LEN = 255
#: The idempotency keys only schedules make (``orbit.store.store.fire_key``:
#: ``schedule:<name>:<created_at>:<instant>``, a schedule's name and two whole numbers): a
#: submit may not use one. Their shape is documented and their parts are readable with
#: the submit scope, and a fire takes a task it finds under its key as its own: a client
#: could have a schedule's fire take its task, or, with another payload, refuse the fire
#: (``IDEMPOTENCY_CONFLICT``) at every pass. Other keys starting ``schedule:`` are free.
FIRE_KEY_RE = re.compile(rf"^schedule:{_NAME}:[0-9]+:[0-9]+\Z")


def is_fire_key(key: object) -> bool:
    """Whether ``key`` has the shape of a schedule's fire key (``FIRE_KEY_RE``). Every
    submitted key comes here: the prefix test spares nearly all of them the regex."""
    return isinstance(key, str) and key.startswith("schedule:") and bool(FIRE_KEY_RE.match(key))


#: The largest attempt number: ``orbit_attempts.number`` is a 32-bit integer in PostgreSQL.
MAX_ATTEMPT_NUMBER = 2**31 - 1
#: The largest duration Orbit accepts anywhere: a year, in microseconds.
MAX_DURATION_US = 366 * 24 * 3600 * 1_000_000
#: The first instant Orbit does not accept: 9999-01-01T00:00:00Z, in microseconds. The
#: wire spells instants from 1970 to 9998 (``orbit.protocol.messages``); the store holds
#: every caller to the same range, which both databases' 64-bit integers hold.
MAX_INSTANT_US = 253_402_300_800 * 1_000_000
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
#: The most characters an error's message holds: a worker's (``ErrorSpec``), an
#: operator's (``ResolveError``), and the message a task's failure is given.
MAX_ERROR_MESSAGE = 10_000
#: The most characters of JSON a result may take: what fits in a worker's finish, whose
#: frame the gateway reads up to 4 MiB (``orbit.worker.outcomes.MAX_OUTCOME_CHARS``, the
#: frame less a message's and an item's own fields; a test holds the two equal). The
#: runner fails a larger result ``RESULT_TOO_LARGE``; an operator's resolve is refused it.
MAX_RESULT_CHARS = 4 * 1024 * 1024 - 1024 - 512
#: A worker's hello (``orbit.protocol.messages.Hello``): the most attempts a session may
#: hold at once, the most handlers it may declare, and the most attempts of one handler.
#: ``orbit.worker.runner.Worker`` checks them as it is built, before any connection.
MAX_WORKER_CONCURRENCY = 100_000
MAX_WORKER_HANDLERS = 256
MAX_HANDLER_CAPACITY = 100_000
#: A queue's rate, in tasks per second: 0 (unlimited), or from MIN_RATE to MAX_RATE. At
#: the bounds a token comes every microsecond (the clock's unit) or every 1,000,000 s
#: (11.6 days); a slower rate's refill is no schedule anyone means, and near the
#: smallest doubles (5e-324) the interval ``SECOND / rate`` overflows to infinity.
#: ``QueueCreate``, ``QueueUpdate``, the store and ``orbit queue`` check the same range.
MIN_RATE = 0.000_001
MAX_RATE = 1_000_000
RATE_RANGE = f"0 (unlimited) or from {MIN_RATE:f} to {MAX_RATE} tasks per second"
#: The largest tenant cap and global cap (``Store.tenant_limit_set``,
#: ``Store.global_limit_set``); the smallest of each is 1, and None is no cap.
MAX_TENANT_CAP = 1_000_000
MAX_GLOBAL_CAP = 100_000_000
#: The largest ``max_queued`` (a queue's or a tenant's cap on waiting tasks): the
#: database's integer column holds up to 2^31 - 1.
MAX_QUEUED_CAP = 1_000_000_000
#: The most attempt ids one ``renew`` carries (``orbit.protocol.messages.Renew``): the
#: runner sends a larger set in messages of this many.
MAX_RENEW_IDS = 1000


#: Names that passed ``NAME_RE`` lately: a batch repeats one queue, handler and tenant a
#: thousand times, and a lookup costs less than half a match. Emptied when full.
_GOOD_NAMES: set[str] = set()
_GOOD_NAMES_MAX = 4096


def is_name(value: object) -> bool:
    """Whether ``value`` is a name (``NAME_RE``), remembering the names it accepts."""
    if type(value) is str and value in _GOOD_NAMES:
        return True
    if not isinstance(value, str) or not NAME_RE.match(value):
        return False
    if type(value) is str:  # not a subclass, whose __eq__ and __hash__ could differ
        if len(_GOOD_NAMES) >= _GOOD_NAMES_MAX:
            _GOOD_NAMES.clear()
        _GOOD_NAMES.add(value)
    return True


def check_name(kind: str, value: object, *, field: str | None = None) -> str:
    """``value`` if it is a name (``is_name``); ``field``: the request field it came from."""
    if not is_name(value):
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            f"{kind} must be 1-128 characters of letters, digits, '_', '.', ':' or '-', "
            f"starting with a letter or digit; got {value!r:.80}",
            field=field,
        )
    assert isinstance(value, str)
    return value


def check_int(name: str, value: object, low: int, high: int, *, field: str | None = None) -> int:
    """``value`` if it is an integer in ``[low, high]``; ``field``: the request field."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            f"{name} must be an integer in [{low}, {high}]; got {value!r}",
            field=field,
        )
    return value


#: The longest artifact TTL, in whole seconds (X-Orbit-TTL, ``Context.upload``'s
#: ``ttl``): an artifact is kept at most the longest duration Orbit accepts anywhere.
MAX_ARTIFACT_TTL_S = MAX_DURATION_US // 1_000_000
#: The longest content type an artifact may carry, in characters.
MAX_CONTENT_TYPE_LEN = 200
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = r'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
#: An RFC 9110 media type (section 8.3.1): ``type/subtype``, then ``;`` parameters with
#: optional whitespace around the ``;``, each ``name=token`` or ``name="quoted"``. An
#: unquoted value may hold Latin-1 too (``name=é``), as the store kept before this rule.
#: The whitespace after a ``;`` belongs to the parameter, so no two ways to split it.
CONTENT_TYPE_RE = re.compile(
    rf"{_TOKEN}/{_TOKEN}"
    rf"(?:[ \t]*;(?:[ \t]*{_TOKEN}=(?:{_QUOTED}|[!#$%&'*+\-.^_`|~0-9A-Za-z\x80-\xff]+))?)*"
)


def content_type_problem(value: object) -> str | None:
    """Why ``value`` is no artifact content type, or None if it is one: a media type
    (``CONTENT_TYPE_RE``: ``type/subtype``, parameters if any, no space or tab at either
    end), 3 to ``MAX_CONTENT_TYPE_LEN`` characters, each what an HTTP header carries as
    text (a tab, printable ASCII, or Latin-1 from U+0080 to U+00FF). The store and the
    worker's ``Context.upload`` judge by this one rule: the worker refused ``name=日本``
    only inside httpx, with a raw UnicodeEncodeError; ``"text/plain "`` passed here and
    h11 refused the header, which the handler saw as a retryable ``Unreachable``; and
    ``ab/`` or ``a b/c d`` were stored and served back as content types."""
    if not isinstance(value, str):
        return f"content_type must be a string, not {type(value).__name__}"
    if not 3 <= len(value) <= MAX_CONTENT_TYPE_LEN:
        return f"content_type must be 3 to {MAX_CONTENT_TYPE_LEN} characters long; got {len(value)}"
    if "/" not in value:
        return "content_type must look like type/subtype"
    for char in value:
        if char != "\t" and not (" " <= char <= "~" or "\x80" <= char <= "\xff"):
            return (
                "content_type must hold only a tab, printable ASCII or Latin-1 characters "
                f"(what an HTTP header carries); got {char!r}"
            )
    if not CONTENT_TYPE_RE.fullmatch(value):
        return (
            "content_type must be a media type: type/subtype, then any '; name=value' "
            f"parameters, no space or tab at either end (RFC 9110); got {value!r:.80}"
        )
    return None


def is_rate(rate: float) -> bool:
    """Whether a finite ``rate`` is in the one range every entry point takes."""
    return rate == 0 or MIN_RATE <= rate <= MAX_RATE


def check_queue_caps(max_concurrency: int | None, rate: float | None, burst: int | None) -> None:
    """A queue needs an explicit concurrency cap and an explicit rate (0 = unlimited)."""
    if max_concurrency is None:
        raise OrbitError(Code.MISSING_CAP, "a queue needs max_concurrency (an integer >= 1)")
    if rate is None:
        raise OrbitError(
            Code.MISSING_CAP, "a queue needs rate (tasks per second; write 0 for unlimited)"
        )
    check_queue_cap_values(max_concurrency, rate, burst)


def check_queue_cap_values(
    max_concurrency: int | None, rate: float | None, burst: int | None
) -> None:
    """Each cap given (not None) is in its range: what ``queue_create`` and
    ``queue_update`` both check."""
    if max_concurrency is not None:
        check_int("max_concurrency", max_concurrency, 1, 1_000_000)
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
            raise OrbitError(Code.INVALID_ARGUMENT, f"rate must be a finite number; got {rate!r}")
        if not is_rate(rate):
            raise OrbitError(Code.INVALID_ARGUMENT, f"rate must be {RATE_RANGE}; got {rate!r}")
    if burst is not None:
        check_int("burst", burst, 1, 1_000_000)


def check_max_queued(max_queued: int | None) -> None:
    """A cap on waiting tasks (``max_queued``) is None (no cap) or 1 to MAX_QUEUED_CAP:
    0 would refuse every submit, which pausing submitters is not (pause the queue)."""
    if max_queued is not None:
        check_int("max_queued", max_queued, 1, MAX_QUEUED_CAP)


def check_backoff(backoff: Backoff) -> None:
    """A backoff's three values, each refusal naming its field (``backoff.base``, …)."""
    if isinstance(backoff.base_us, bool) or not isinstance(backoff.base_us, int):
        raise OrbitError(
            Code.INVALID_BACKOFF,
            "backoff base must be an integer of microseconds",
            field="backoff.base",
        )
    if not 0 < backoff.base_us <= MAX_DURATION_US:
        raise OrbitError(
            Code.INVALID_BACKOFF,
            "backoff base must be at least 0.000001 s (1 µs) and at most a year",
            field="backoff.base",
        )
    factor = backoff.factor
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise OrbitError(
            Code.INVALID_BACKOFF, "backoff factor must be a number", field="backoff.factor"
        )
    if not math.isfinite(factor) or not 1.0 <= factor <= 100.0:
        raise OrbitError(
            Code.INVALID_BACKOFF,
            f"backoff factor must be in [1, 100]; got {factor}",
            field="backoff.factor",
        )
    if isinstance(backoff.max_us, bool) or not isinstance(backoff.max_us, int):
        raise OrbitError(
            Code.INVALID_BACKOFF,
            "backoff max must be an integer of microseconds",
            field="backoff.max",
        )
    if not backoff.base_us <= backoff.max_us <= MAX_DURATION_US:
        raise OrbitError(
            Code.INVALID_BACKOFF,
            "backoff max must be at least the base and at most a year",
            field="backoff.max",
        )


MAX_JSON_DEPTH = 64


def check_json_depth(value: object, what: str) -> None:
    """Payloads and results nest at most 64 levels, so every view can serialise them.
    A shallow value (``is_shallow``, the usual shape) is far from the limit: no walk."""
    if is_shallow(value):
        return
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise OrbitError(
                Code.INVALID_ARGUMENT, f"{what} nests more than {MAX_JSON_DEPTH} levels"
            )
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)


def check_result_size(spelled: str) -> None:
    """A result, spelled as it is stored, must fit in a worker's finish
    (``MAX_RESULT_CHARS``): one an operator gives is held to the bound a worker's is."""
    if len(spelled) > MAX_RESULT_CHARS:
        raise OrbitError(
            Code.PAYLOAD_TOO_LARGE,
            f"the result is {len(spelled)} characters of JSON; at most {MAX_RESULT_CHARS} "
            "fit in a finish (attach a large output as an artifact)",
            field="result",
        )


AN_INSTANT = "an instant between 1970 and 9998 (UTC)"


def _is_instant(value: object) -> bool:
    """Microseconds since the epoch, within the range the wire can spell."""
    return type(value) is int and 0 <= value < MAX_INSTANT_US


def check_spec(spec: TaskSpec, max_payload_bytes: int) -> tuple[str, int]:
    """Validate a submission, all but what needs the clock (:func:`check_deadline`);
    return its canonical payload JSON and its encoded size. The store runs it before
    its transaction begins, so bad input costs the database nothing."""
    check_name("queue", spec.queue, field="queue")
    check_name("handler", spec.handler, field="handler")
    check_name("tenant", spec.tenant, field="tenant")
    check_int("priority", spec.priority, -MAX_PRIORITY, MAX_PRIORITY, field="priority")
    check_int("max_attempts", spec.max_attempts, 1, MAX_ATTEMPTS_LIMIT, field="max_attempts")
    if not isinstance(spec.retry_safe, bool):
        raise OrbitError(
            Code.INVALID_ARGUMENT, "retry_safe must be true or false", field="retry_safe"
        )
    if spec.idempotency_key is not None and (
        not isinstance(spec.idempotency_key, str)
        or not 0 < len(spec.idempotency_key) <= MAX_KEY_LEN
    ):
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            f"idempotency_key must be 1-{MAX_KEY_LEN} characters",
            field="idempotency_key",
        )
    if is_fire_key(spec.idempotency_key):
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            "idempotency_key may not have the shape schedule:<name>:<number>:<number>: "
            "schedules' fires use those keys",
            field="idempotency_key",
        )
    if spec.parent_id is not None and not isinstance(spec.parent_id, str):
        raise OrbitError(Code.INVALID_ARGUMENT, "parent_id must be a task id", field="parent_id")
    check_backoff(spec.backoff)
    if spec.attempt_timeout_us is not None and (
        isinstance(spec.attempt_timeout_us, bool)
        or not isinstance(spec.attempt_timeout_us, int)
        or not 0 < spec.attempt_timeout_us <= MAX_DURATION_US
    ):
        raise OrbitError(
            Code.INVALID_TIMEOUT,
            "attempt_timeout must be at least 0.000001 s (1 µs) and at most a year",
            field="attempt_timeout",
        )
    if spec.deadline is not None and not _is_instant(spec.deadline):
        raise OrbitError(Code.INVALID_DEADLINE, f"deadline must be {AN_INSTANT}", field="deadline")
    if spec.run_after is not None:
        if not _is_instant(spec.run_after):
            raise OrbitError(
                Code.INVALID_ARGUMENT, f"run_after must be {AN_INSTANT}", field="run_after"
            )
        if spec.deadline is not None and spec.run_after >= spec.deadline:
            raise OrbitError(
                Code.INVALID_DEADLINE, "run_after must be before the deadline", field="run_after"
            )
    for name, text in (("idempotency_key", spec.idempotency_key), ("parent_id", spec.parent_id)):
        if isinstance(text, str) and "\x00" in text:
            raise OrbitError(Code.INVALID_ARGUMENT, f"{name} holds a NUL character", field=name)
    return check_payload(spec.payload, max_payload_bytes)


def check_payload(value: JSON, max_payload_bytes: int) -> tuple[str, int]:
    """The part of :func:`check_spec` that reads the payload: its canonical JSON and its
    encoded size, or the error that refuses it. A batch whose other fields a reader has
    already checked (``orbit.protocol.submissions``) needs only this.

    A shallow payload (the usual) is spelled once, by ``canonical_json``'s fast path, and
    measured in the bytes that spell it: a batch submit checks a thousand, and asking
    ``is_shallow`` twice (for the depth, then for the spelling) and encoding the text
    again for its size was half of this check's time."""
    encoded = canonical_shallow_utf8(value)
    if encoded is not None:  # shallow, so far from the nesting limit, and valid UTF-8
        if len(encoded) > max_payload_bytes:
            raise OrbitError(
                Code.PAYLOAD_TOO_LARGE,
                f"payload is {len(encoded)} bytes; the limit is {max_payload_bytes} bytes",
                field="payload",
            )
        return encoded.decode("utf-8"), len(encoded)
    check_json_depth(value, "payload")
    try:
        payload = canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            f"payload must be JSON (no NaN or Infinity): {exc}",
            field="payload",
        ) from None
    try:
        size = len(payload.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: too large first, if it is
        size = len(payload.encode("utf-8", "surrogatepass"))
        if size <= max_payload_bytes:
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                "payload contains a lone surrogate (not valid UTF-8)",
                field="payload",
            ) from None
    if size > max_payload_bytes:
        raise OrbitError(
            Code.PAYLOAD_TOO_LARGE,
            f"payload is {size} bytes; the limit is {max_payload_bytes} bytes",
            field="payload",
        )
    return payload, size


def check_deadline(spec: TaskSpec, now: int) -> None:
    """The part of :func:`check_spec` that needs the clock (the transaction's)."""
    if spec.deadline is not None and spec.deadline <= now:
        raise OrbitError(Code.INVALID_DEADLINE, "deadline is already in the past", field="deadline")


#: catch_up's bound: the most missed instants one schedule fires after a downtime
MAX_CATCH_UP = 1000
#: catch_up's bound when a schedule names none
DEFAULT_MAX_CATCH_UP = 10
#: How late a fire instant may be seen and still be on time rather than missed (its
#: misfire policy then decides): a node's duty looks once a second, so an instant seen
#: later than this was passed over by a cluster that was down, or by a fire that a full
#: queue refused all that while.
MISFIRE_GRACE_US = 60 * 1_000_000


def check_schedule(
    name: object,
    cron: object,
    timezone: object,
    template: TaskSpec,
    misfire: object,
    max_catch_up: object,
    max_payload_bytes: int,
    *,
    cron_stored: bool = False,
    timezone_stored: bool = False,
) -> tuple[str, str]:
    """Validate a schedule (``orbit.core.model.Schedule``) before anything is written;
    return its cron expression as stored (``check_cron``: fields one space apart) and
    its template's canonical payload JSON. ``cron_stored``: ``cron`` is the one already
    stored, which an update that does not change it keeps unchecked (an older Orbit took
    croniter's extensions, which still fire); ``timezone_stored`` likewise for the zone,
    which need only load (an older Orbit took ``localtime``, ``right/`` zones:
    ``stored_zone``). The template is checked exactly as a submit is (``check_spec``),
    and may not name what each fire sets itself: the idempotency key (derived from the
    schedule and the instant, so that no instant fires twice), a parent, a deadline or a
    ``run_after`` (instants, which would be past after the first fire)."""
    check_name("schedule", name)
    stored = cron if cron_stored and isinstance(cron, str) else check_cron(cron)
    if timezone_stored and isinstance(timezone, str):
        stored_zone(timezone)
    else:
        check_timezone(timezone)
    if misfire not in MISFIRE_POLICIES:
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            f"misfire must be one of {', '.join(MISFIRE_POLICIES)}; got {misfire!r:.40}",
            field="misfire",
        )
    if isinstance(max_catch_up, bool) or not isinstance(max_catch_up, int):
        raise OrbitError(
            Code.INVALID_ARGUMENT, "max_catch_up must be an integer", field="max_catch_up"
        )
    if not 1 <= max_catch_up <= MAX_CATCH_UP:
        raise OrbitError(
            Code.INVALID_ARGUMENT,
            f"max_catch_up must be an integer in [1, {MAX_CATCH_UP}]; got {max_catch_up}",
            field="max_catch_up",
        )
    if not isinstance(template, TaskSpec):
        raise OrbitError(Code.INVALID_ARGUMENT, "template must be a TaskSpec", field="template")
    for what in ("idempotency_key", "parent_id", "deadline", "run_after"):
        if getattr(template, what) is not None:
            raise OrbitError(
                Code.INVALID_ARGUMENT,
                f"a schedule's template may not set {what}: each fire sets its own",
                field=f"template.{what}",
            )
    try:
        return stored, check_spec(template, max_payload_bytes)[0]
    except OrbitError as exc:  # the template as a whole, whichever field of it
        exc.field = "template"
        raise
