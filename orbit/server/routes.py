"""The ``/v1`` HTTP API. Every route names the scope it needs; bodies are read raw and
decoded strictly (orbit.protocol) before the store is touched."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, BeforeValidator
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.websockets import WebSocket

from orbit.core.batches import UnusualTask
from orbit.core.errors import Code, OrbitError
from orbit.core.model import DEFAULT_BACKOFF, Attempt, Backoff, Outcome, TaskSpec, build
from orbit.core.states import SessionState, TaskState
from orbit.core.validate import MAX_ATTEMPT_NUMBER, check_name, is_name
from orbit.protocol.convert import instant_from_wire, seconds_to_us, token_wire
from orbit.protocol.decode import DecodeError, decode_json, decode_model
from orbit.protocol.messages import (
    AttemptPage,
    ErrorReply,
    EventPage,
    GlobalLimitView,
    LimitSet,
    QueueCreate,
    QueuePage,
    QueueUpdate,
    QueueView,
    ScheduleCreate,
    SchedulePage,
    ScheduleTemplate,
    ScheduleUpdate,
    ScheduleView,
    Strict,
    Submitted,
    SubmittedId,
    TaskBatch,
    TaskPage,
    TaskResolve,
    TaskSubmit,
    TaskView,
    TenantLimitPage,
    TenantLimitSet,
    TenantLimitView,
    TokenCreate,
    TokenCreated,
    TokenPage,
    TokenView,
    WorkerPage,
    WorkerView,
)
from orbit.protocol.submissions import UsualBatch, read_task
from orbit.server.auth import require
from orbit.server.errors import ApiError, refuse_upgrade
from orbit.server.gates import SubmitGates
from orbit.server.jsonwire import FastJSONResponse
from orbit.server.streams import PAGE, EventStream, Tail, open_tail, serve_socket
from orbit.server.threads import in_thread
from orbit.server.views import (
    attempt_view,
    event_view,
    queue_view,
    schedule_view,
    task_wire,
    worker_view,
)
from orbit.store import Store
from orbit.store import Submitted as Stored
from orbit.store.store import KEEP

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("orbit.server")
router = APIRouter(prefix="/v1")


def _plain_digits(value: Any) -> Any:
    """A limit as the query spells it must be ASCII digits: pydantic's lax int read
    ``" 1"``, ``"1.0"``, ``"+1"`` and ``"1_0"`` as numbers, while ``"x"`` was refused."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError("give a whole number in plain digits")
    return value


Limit = Annotated[int, Query(ge=1, le=1000), BeforeValidator(_plain_digits)]
#: the values of the task list's ``state`` filter
TASK_STATES = tuple(str(s) for s in TaskState)
#: the values of the worker list's ``state`` filter
SESSION_STATES = tuple(str(s) for s in SessionState)


#: a Content-Length: ASCII digits (``str.isdigit`` also admits '²' and other scripts'
#: digits, which ``int`` refuses)
_LENGTH = re.compile(r"[0-9]+")


def _length_digits(declared: str | None) -> str | None:
    """A Content-Length value's digits, leading zeros dropped; None for no value or one
    that is not ASCII digits (around them, spaces or tabs)."""
    if declared is None:
        return None
    value = declared.strip(" \t")
    return value.lstrip("0") if _LENGTH.fullmatch(value) else None


def declares_over(declared: str | None, limit: int) -> bool:
    """Whether a Content-Length value declares more than ``limit`` bytes. A value that is
    not ASCII digits (around them, spaces or tabs) refuses nothing here, and cannot
    raise: the body is counted as it arrives and refused at the limit, as a chunked one
    is. Uvicorn answers such a header with its own 400, but another ASGI server may
    pass it on; a value longer than the limit's digits is over it without ``int``, which
    refuses strings of more than 4,300 digits."""
    digits = _length_digits(declared)
    if digits is None:
        return False
    return len(digits) > len(str(limit)) or int(digits or "0") > limit


def declared_length(declared: str | None, limit: int) -> int | None:
    """The byte count a Content-Length value declares, if it is one within ``limit``
    (``declares_over`` refuses the rest); None for no value or one not digits."""
    digits = _length_digits(declared)
    if digits is None or len(digits) > len(str(limit)):
        return None
    length = int(digits or "0")
    return length if length <= limit else None


def _store(request: HTTPConnection) -> Store:
    store: Store = request.app.state.store
    return store


async def _document(request: Request) -> Any:
    """The body, within the size limit, parsed under the strict JSON rules."""
    return decode_json(await _raw_body(request))


async def _raw_body(request: Request) -> bytes:
    """The body's bytes, within the size limit."""
    limit: int = request.app.state.settings.max_body_bytes
    if declares_over(request.headers.get("content-length"), limit):
        raise ApiError(413, "BODY_TOO_LARGE", f"the body is over {limit} bytes")
    # Read as it arrives and stopped at the limit: a chunked body declares no length,
    # and reading it whole first would hold all of it in memory before refusing it.
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "BODY_TOO_LARGE", f"the body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _body(request: Request, model: type[M]) -> M:
    return decode_model(model, await _document(request), parsed=True)


class _NoFields(Strict):
    """The body of an action that takes no input: none, or ``{}``."""


async def _no_fields(request: Request) -> None:
    """Refuse a body the action would ignore, before anything is touched: a cancel sent
    with ``{"cascade": false}`` cancelled the whole tree all the same, and said nothing.
    No body, or ``{}``, is taken; a field is ``UNKNOWN_FIELD``, naming it."""
    length = request.headers.get("content-length")
    if "transfer-encoding" not in request.headers and length in (None, "0"):
        return
    raw = await _raw_body(request)
    if not raw:  # sent chunked with no bytes (a client that streams its body): no body
        return
    decode_model(_NoFields, decode_json(raw), parsed=True)


def _json(model: BaseModel | list[Any] | dict[str, Any], status: int = 200) -> Response:
    """A view (a model, a plain dict such as ``task_wire``'s, or a list of either) as a
    JSON response."""
    if isinstance(model, list):
        content: Any = [m.model_dump(mode="json") if isinstance(m, BaseModel) else m for m in model]
    elif isinstance(model, BaseModel):
        content = model.model_dump(mode="json")
    else:
        content = model
    return FastJSONResponse(content, status_code=status)


def encode_cursor(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")


def _bad_cursor() -> ApiError:
    return ApiError(400, "INVALID_CURSOR", "the cursor is not one this server issued", "cursor")


def decode_cursor(cursor: str | None, longest: int = 64) -> str | None:
    """The text a cursor stands for, at most ``longest`` characters (a queue name's
    cursor may be 128). Only the spelling ``encode_cursor`` writes is one: the decoder
    drops characters outside its alphabet and reads extra padding, so ``M.C.4.z``,
    ``MC4z!!`` and ``MC4z==`` were read as ``MC4z``."""
    if cursor is None:
        return None
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise _bad_cursor() from None
    if not text or len(text) > longest or encode_cursor(text) != cursor:
        raise _bad_cursor()
    return text


#: a task's or an artifact's id as the server spells it (orbit.core.ids.uuid7): lowercase
#: 8-4-4-4-12 hex
_TASK_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def id_cursor(cursor: str | None) -> str | None:
    """The id a task list's or a worker list's cursor resumes after (both are uuid7
    ids). Any other text is refused: 'hello' would read as an empty page (the end of the
    list) and '0' as its start."""
    after = decode_cursor(cursor)
    if after is not None and not _TASK_ID.match(after):
        raise _bad_cursor()
    return after


def name_cursor(cursor: str | None) -> str | None:
    """The name a queue list's or a tenant limit list's cursor resumes after: only a name
    a queue or a tenant can have (``orbit.core.validate.NAME_RE``, up to 128 characters).
    Any other text would be read as a place in the list ('' its start, '~' its end), a
    page that looks like an answer."""
    after = decode_cursor(cursor, longest=128)
    if after is not None and not is_name(after):
        raise _bad_cursor()
    return after


#: a token's id as the server spells it: a uuid7's 32 lowercase hex digits, no dashes
_TOKEN_ID = re.compile(r"^[0-9a-f]{32}\Z")


def token_cursor(cursor: str | None) -> str | None:
    """The token id a token list's cursor resumes after; any other text is refused, as a
    task list's cursor that is not a task id is."""
    after = decode_cursor(cursor)
    if after is not None and not _TOKEN_ID.match(after):
        raise _bad_cursor()
    return after


#: an attempt number (or an artifact's place in its list) as the server spells it: ASCII
#: digits, no sign, no leading zero
_ATTEMPT_NUMBER = re.compile(r"^[1-9][0-9]*\Z")


def attempt_cursor(cursor: str | None) -> int:
    """The attempt number an attempt list's cursor resumes after (0: from the first).
    Only a number the server could have issued is one: 1 to 2^31 - 1 (PostgreSQL's
    integer column), spelled in plain ASCII digits; '0' would read as the start."""
    after = decode_cursor(cursor)
    if after is None:
        return 0
    if not _ATTEMPT_NUMBER.match(after) or int(after) > MAX_ATTEMPT_NUMBER:
        raise _bad_cursor()
    return int(after)


def artifact_cursor(cursor: str | None) -> tuple[int, str | None]:
    """Where an artifact list's cursor resumes, ``(after_seq, after_id)`` as
    ``Store.artifact_list`` takes them: after the artifact whose place in the list
    (``ready_seq``) it spells, 1 to 2^63 - 1 in plain ASCII digits; or, for a cursor
    issued before the list was in commit order (an artifact id), after that artifact.
    Any other text is refused, as a task list's cursor that is not a task id is."""
    after = decode_cursor(cursor)
    if after is None:
        return 0, None
    if _TASK_ID.match(after):
        return 0, after
    if not _ATTEMPT_NUMBER.match(after) or int(after) > 2**63 - 1:
        raise _bad_cursor()
    return int(after), None


#: the largest number in an events cursor: event ids are 64-bit signed integers in both
#: databases, and a PostgreSQL transaction id (xid8) stays far below it
MAX_EVENT_ID = 2**63 - 1

#: an events cursor as the server spells it (``event_position_cursor``): ``<xid>.<id>``,
#: each in plain ASCII digits without sign or leading zero, the id from 1 (an xid is 0 on
#: SQLite, and for PostgreSQL's events from before migration 0008); or a bare id, a cursor
#: issued before that migration
_EVENT_POSITION = re.compile(r"(?:(0|[1-9][0-9]*)\.)?([1-9][0-9]*)")


def event_cursor(after: str | None) -> tuple[int, int]:
    """The position (xid, event id) an events cursor resumes after ((0, 0): the start,
    for no cursor at all). Only a spelling the server issues is one: ``0``, ``0.0`` and
    ``00.00`` were read as the start, and ``05`` or ``0.005`` as event 5, where every
    other list refuses a cursor it did not issue ('0' for an attempt list's start
    among them). Other scripts' digits ('١٢'), which ``str.isdigit`` admits, and a
    number past 2^63 - 1, which overflows the database's integer, are not one either. A
    bare id of an event written after migration 0008 names no event, and the store
    refuses it."""
    if after is None:
        return 0, 0
    found = _EVENT_POSITION.fullmatch(after)
    if found is None:
        raise _bad_cursor()
    xid_text, id_text = found.groups()
    xid, event_id = int(xid_text or "0"), int(id_text)
    if xid > MAX_EVENT_ID or event_id > MAX_EVENT_ID:
        raise _bad_cursor()
    return xid, event_id


def event_position_cursor(row: dict[str, Any]) -> str:
    """The cursor of an event row: its position, ``<xid>.<id>``."""
    return encode_cursor(f"{row['xid']}.{row['id']}")


def spec_from(msg: TaskSubmit) -> TaskSpec:
    """A decoded submission as the store's spec. Built without the frozen ``__init__``
    (which sets each of 13 fields through ``object.__setattr__``): a batch makes a
    thousand of these, and that ``__init__`` was a tenth of a batch submit's server time."""
    backoff = DEFAULT_BACKOFF
    if msg.backoff is not None:
        backoff = Backoff(
            seconds_to_us(msg.backoff.base), msg.backoff.factor, seconds_to_us(msg.backoff.max)
        )
    return build(
        TaskSpec,
        queue=msg.queue,
        handler=msg.handler,
        payload=msg.payload,
        tenant=msg.tenant,
        priority=msg.priority,
        idempotency_key=msg.idempotency_key,
        parent_id=msg.parent_id,
        retry_safe=msg.retry_safe,
        max_attempts=msg.max_attempts,
        backoff=backoff,
        attempt_timeout_us=seconds_to_us(msg.attempt_timeout) if msg.attempt_timeout else None,
        deadline=instant_from_wire(msg.deadline) if msg.deadline else None,
        run_after=instant_from_wire(msg.run_after) if msg.run_after else None,
    )


def _submitted_view(done: Stored) -> dict[str, Any]:
    """A batch reply's item: made by the store while it writes the next chunk of rows."""
    return {"task": task_wire(done.task), "created": done.created}


def _submitted_id(done: Stored) -> dict[str, Any]:
    """A batch reply's item with ``?reply=ids``."""
    return {"id": done.task.id, "created": done.created}


#: ``POST /v1/tasks/batch?reply=…``: each task's whole view (the default), or its id.
#: The views are nine tenths of the reply's bytes and of the server's and the client's
#: work on it; a producer that only needs the ids asks for them.
BATCH_REPLIES: dict[str, Callable[[Stored], dict[str, Any]]] = {
    "full": _submitted_view,
    "ids": _submitted_id,
}
BATCH_REPLY_QUERY = {
    "name": "reply",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "enum": list(BATCH_REPLIES), "default": "full"},
    "description": "`full`: a `Submitted` per task, in order (the default); "
    "`ids`: a `SubmittedId` per task, in order.",
}


def _batch_reply(request: Request) -> Callable[[Stored], dict[str, Any]]:
    """The render of each item the ``reply`` query asks for; refused before the body is
    read, so a bad value changes nothing."""
    asked = request.query_params.getlist("reply") or ["full"]
    if len(asked) > 1 or asked[0] not in BATCH_REPLIES:
        raise ApiError(400, "INVALID_ARGUMENT", "reply: give it once, as full or ids", "reply")
    return BATCH_REPLIES[asked[0]]


def each_query_once(request: HTTPConnection) -> None:
    """A list route's filters take one value each: ``?state=queued&state=running`` was
    read as its last value alone, a list of running tasks that looked like an answer.
    And a list takes only the parameters it names: ``GET /v1/events?task_id=…`` or
    ``GET /v1/tasks?status=failed`` was answered with the whole list, a page that looked
    filtered. An event stream (``…/stream``) still ignores the others: a browser's
    EventSource polyfill may add its own."""
    _each_once(request)
    route = request.scope.get("route")
    if isinstance(route, APIRoute) and not route.path.endswith("/stream"):
        _known_queries_only(request, _route_queries(route), "list")


def _each_once(request: HTTPConnection) -> None:
    """Refuse a query parameter given more than once: each takes one value."""
    for name in request.query_params:
        if len(request.query_params.getlist(name)) > 1:
            raise ApiError(400, "INVALID_ARGUMENT", f"{name}: give it once", name)


def _route_queries(route: APIRoute) -> set[str]:
    """The query parameters a route takes: its endpoint's own, and those its OpenAPI
    entry names (the batch submit reads ``reply`` itself)."""
    known = {p.alias for p in route.dependant.query_params}
    extra = (route.openapi_extra or {}).get("parameters", [])
    known.update(p["name"] for p in extra if p.get("in") == "query")
    return known


def _known_queries_only(request: HTTPConnection, known: Iterable[str], what: str) -> None:
    """Refuse a query parameter that is not one of ``known``."""
    known = set(known)
    for name in request.query_params:
        if name not in known:
            takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
            raise ApiError(
                400, "INVALID_ARGUMENT", f"{name}: not a parameter of this {what} ({takes})", name
            )


def only_queries(request: Request, known: Iterable[str]) -> None:
    """An action (a POST, PUT, PATCH or DELETE) takes only the query parameters it names,
    once each, refused before its body is read or anything is touched:
    ``DELETE /v1/schedules/nightly?dry_run=true`` deleted the schedule and
    ``POST /v1/tasks?dry_run=1`` submitted the task, each answering as if the flag had
    been heard. A request with no query string costs one lookup (the submits call this
    on their direct path, ``orbit.server.direct``)."""
    if not request.scope.get("query_string"):
        return
    _each_once(request)
    _known_queries_only(request, known, "action")


def action_query(request: Request) -> None:
    """``only_queries`` for a route FastAPI resolves, with the parameters it declares."""
    route = request.scope.get("route")
    if isinstance(route, APIRoute):
        only_queries(request, _route_queries(route))


#: the dependencies of a route whose query holds filters, a limit and a cursor
LISTING = [Depends(each_query_once)]
#: the dependencies of an action that takes a body: no query parameter it does not name
ACTION = [Depends(action_query)]
#: the dependencies of an action that takes no input (pause, resume, cancel, retry, drain,
#: revoke, a schedule's delete): a query parameter or a body it would ignore is refused
#: before anything is touched
BODILESS = [*ACTION, Depends(_no_fields)]


# ----------------------------------------------------------------------------- queues


@router.post(
    "/queues",
    dependencies=[Depends(require("admin")), *ACTION],
    status_code=201,
    response_model=QueueView,
)
async def queue_create(request: Request) -> Response:
    msg = await _body(request, QueueCreate)
    queue = await in_thread(
        _store(request).queue_create,
        msg.name,
        max_concurrency=msg.max_concurrency,
        rate=msg.rate,
        burst=msg.burst,
        max_queued=msg.max_queued,
    )
    return _json(queue_view(queue), 201)


@router.get(
    "/queues", dependencies=[Depends(require("submit")), *LISTING], response_model=QueuePage
)
async def queue_list(request: Request, limit: Limit = 100, cursor: str | None = None) -> Response:
    """Queues a page at a time in name order, the cursor standing for the last one's
    name: keyset, as the task list pages tasks."""
    after = name_cursor(cursor)
    queues = await in_thread(lambda: _store(request).queue_list(after_name=after, limit=limit))
    nxt = encode_cursor(queues[-1].name) if len(queues) == limit else None
    return _json(QueuePage(items=[queue_view(q) for q in queues], next_cursor=nxt))


@router.post(
    "/queues/{name}/pause",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=QueueView,
)
async def queue_pause(request: Request, name: str) -> Response:
    return _json(queue_view(await in_thread(_store(request).queue_pause, name)))


@router.post(
    "/queues/{name}/resume",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=QueueView,
)
async def queue_resume(request: Request, name: str) -> Response:
    return _json(queue_view(await in_thread(_store(request).queue_resume, name)))


# ----------------------------------------------------------------------------- tasks


#: A submit's 429 in the OpenAPI document: backpressure (docs/concepts.md).
FULL_RESPONSE: dict[int | str, dict[str, Any]] = {
    429: {
        "model": ErrorReply,
        "description": "QUEUE_FULL or TENANT_FULL: the submit would take a queue's or a "
        "tenant's waiting tasks past its max_queued; nothing was written",
        "headers": {
            "Retry-After": {
                "description": "whole seconds to wait before trying again",
                "schema": {"type": "integer", "minimum": 1},
            }
        },
    }
}


@router.post(
    "/tasks",
    dependencies=[Depends(require("submit"))],
    status_code=201,
    response_model=Submitted,
    responses=FULL_RESPONSE,
)
async def task_submit(request: Request) -> Response:
    only_queries(request, ())  # served directly: no dependency runs (orbit.server.direct)
    raw = await _document(request)
    spec = read_task(raw)  # the usual shape, read at once (orbit.protocol.submissions)
    if spec is None:
        spec = spec_from(decode_model(TaskSubmit, raw, parsed=True))
    store = _store(request)
    async with _gates(request).held(store, [("queue", spec.queue), ("tenant", spec.tenant)]):
        done = await in_thread(store.task_submit, spec)
    return _json(
        {"task": task_wire(done.task), "created": done.created}, 201 if done.created else 200
    )


#: A batch submit's refusals in the OpenAPI document: a 429 as a single submit's, and a
#: 413 for a batch that can never fit (no Retry-After: waiting does not help).
BATCH_RESPONSES: dict[int | str, dict[str, Any]] = {
    **FULL_RESPONSE,
    413: {
        "model": ErrorReply,
        "description": "BATCH_EXCEEDS_CAP: the batch makes more new tasks in a queue or a "
        "tenant than its max_queued, so it can never fit (split it); PAYLOAD_TOO_LARGE or "
        "BODY_TOO_LARGE: a payload or the body is over its bound. Nothing was written",
    },
}


@router.post(
    "/tasks/batch",
    dependencies=[Depends(require("submit"))],
    status_code=201,
    response_model=list[Submitted] | list[SubmittedId],
    responses=BATCH_RESPONSES,
    openapi_extra={"parameters": [BATCH_REPLY_QUERY]},
)
async def task_submit_batch(request: Request) -> Response:
    only_queries(request, ("reply",))  # served directly, as task_submit
    render = _batch_reply(request)
    raw = await _document(request)
    store = _store(request)
    submit = store.task_submit_rendered
    usual = UsualBatch.of(raw)  # the usual shape, read a chunk at a time in the store
    if usual is not None:
        try:
            async with _gates(request).held(store, _scopes(usual.queues, usual.tenants)):
                return _json(await in_thread(submit, usual, render), 201)
        except UnusualTask:  # rolled back, nothing written: the strict path says why
            pass
    specs = [spec_from(t) for t in decode_model(TaskBatch, raw, parsed=True).tasks]
    scopes = _scopes({s.queue for s in specs}, {s.tenant for s in specs})
    async with _gates(request).held(store, scopes):
        return _json(await in_thread(submit, specs, render), 201)


def _gates(request: Request) -> SubmitGates:
    gates: SubmitGates = request.app.state.submit_gates
    return gates


def _scopes(queues: Iterable[str], tenants: Iterable[str]) -> list[tuple[str, str]]:
    """A batch's queues and tenants as the scopes a cap may be on (``SubmitGates``)."""
    return [("queue", q) for q in queues] + [("tenant", t) for t in tenants]


@router.get("/tasks", dependencies=[Depends(require("submit")), *LISTING], response_model=TaskPage)
async def task_list(
    request: Request,
    state: str | None = None,
    queue: str | None = None,
    tenant: str | None = None,
    handler: str | None = None,
    created_after: str | None = None,
    created_before: str | None = None,
    parent_id: str | None = None,
    limit: Limit = 100,
    cursor: str | None = None,
) -> Response:
    bounds: dict[str, int | None] = {}
    for name, value in (("created_after", created_after), ("created_before", created_before)):
        try:
            # ``is not None``: an empty value (``?created_after=``) is refused, not read
            # as no filter at all. RFC 3339 only, as a body's deadline and run_after: a
            # date alone or a time without an offset names no one instant
            bounds[name] = instant_from_wire(value) if value is not None else None
        except (ValueError, TypeError):
            raise DecodeError(
                "INVALID_VALUE",
                f"{name} must be an RFC 3339 date-time with an offset, e.g. 2026-01-01T00:00:00Z",
                name,
            ) from None
    if state is not None and state not in TASK_STATES:
        raise ApiError(
            400, "INVALID_ARGUMENT", f"state must be one of {', '.join(TASK_STATES)}", "state"
        )
    for name, value in (("queue", queue), ("tenant", tenant), ("handler", handler)):
        if value == "":  # it matched no task: a page that read as "there are none"
            raise ApiError(
                400,
                "INVALID_ARGUMENT",
                f"{name} is empty: leave it out to list the tasks of every {name}",
                name,
            )
        if value is not None:  # a value no task can have matched none: the same
            check_name(name, value, field=name)
    after, before = bounds.get("created_after"), bounds.get("created_before")
    if after is not None and before is not None and after >= before:
        raise ApiError(
            400,
            "INVALID_ARGUMENT",
            "created_after must be before created_before: no task was created in between",
            "created_after",
        )
    if parent_id is not None and not _TASK_ID.match(parent_id):
        # an empty or mistyped id would list nothing, which reads as "no children"
        raise ApiError(400, "INVALID_ARGUMENT", "parent_id must be a task id", "parent_id")
    tasks = await in_thread(
        lambda: _store(request).task_list(
            state=state,
            queue=queue,
            tenant=tenant,
            handler=handler,
            parent_id=parent_id,
            after_id=id_cursor(cursor),
            limit=limit,
            **bounds,
        )
    )
    nxt = encode_cursor(tasks[-1].id) if len(tasks) == limit else None
    return _json({"items": [task_wire(t) for t in tasks], "next_cursor": nxt})


@router.get("/tasks/{task_id}", dependencies=[Depends(require("submit"))], response_model=TaskView)
async def task_get(request: Request, task_id: str) -> Response:
    return _json(task_wire(await in_thread(_store(request).task_get, task_id)))


@router.post(
    "/tasks/{task_id}/cancel",
    dependencies=[Depends(require("submit")), *BODILESS],
    response_model=TaskView,
)
async def task_cancel(request: Request, task_id: str) -> Response:
    return _json(task_wire(await in_thread(_store(request).task_cancel, task_id)))


@router.post(
    "/tasks/{task_id}/retry",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=TaskView,
)
async def task_retry(request: Request, task_id: str) -> Response:
    return _json(task_wire(await in_thread(_store(request).task_retry, task_id)))


@router.post(
    "/tasks/{task_id}/resolve",
    dependencies=[Depends(require("admin")), *ACTION],
    response_model=TaskView,
)
async def task_resolve(request: Request, task_id: str) -> Response:
    msg = await _body(request, TaskResolve)
    if msg.result is not None and msg.decision != "succeeded":
        raise ApiError(
            400, "INVALID_ARGUMENT", "result goes only with decision 'succeeded'", "result"
        )
    if msg.error is not None and msg.decision != "failed":
        raise ApiError(400, "INVALID_ARGUMENT", "error goes only with decision 'failed'", "error")
    if msg.error is not None and msg.error.retryable and "retryable" in msg.error.model_fields_set:
        # Stored as false whatever was asked, without a word: nothing retries a task an
        # operator failed (its decision 'retry' runs it again)
        raise ApiError(
            400,
            "INVALID_ARGUMENT",
            "a failure an operator resolves is never retried by itself; resolve with "
            "decision 'retry' to run the task again",
            "error.retryable",
        )
    outcome = None
    if msg.decision == "succeeded":
        outcome = Outcome.success(msg.result)
    elif msg.error is not None:
        outcome = Outcome.failure(msg.error.code, msg.error.message, retryable=False)
    task = await in_thread(_store(request).task_resolve, task_id, msg.decision, outcome)
    return _json(task_wire(task))


@router.get(
    "/tasks/{task_id}/attempts",
    dependencies=[Depends(require("submit")), *LISTING],
    response_model=AttemptPage,
)
async def task_attempts(
    request: Request, task_id: str, limit: Limit = 100, cursor: str | None = None
) -> Response:
    """A task's attempts a page at a time in number order, the cursor standing for the
    last one's number. Released claims do not count against ``max_attempts``, so a task
    can gather any number of attempts. Each ended one comes with its outcome, read from
    the events that ended it after the attempts themselves: an attempt read as ended
    has its event committed with it."""
    after = attempt_cursor(cursor)
    store = _store(request)
    task = await in_thread(store.task_get, task_id)  # 404 for an unknown task
    # A cursor past the task's fence (its last claim's number, released claims included,
    # which attempts_used does not count) names no attempt this server could have
    # listed: its empty page would read as "no new attempt yet" for ever after. The task
    # is read before the attempts and its fence only grows, so a cursor issued before
    # this request is never past it.
    if after > task.fence:
        raise _bad_cursor()

    def read() -> tuple[list[Attempt], dict[str, tuple[str, str | None]]]:
        attempts = store.attempt_list(task_id, after_number=after, limit=limit)
        ended = [a.id for a in attempts if not a.live]
        return attempts, store.attempt_outcomes(task_id, ended)

    attempts, outcomes = await in_thread(read)
    nxt = encode_cursor(str(attempts[-1].number)) if len(attempts) == limit else None
    items = [attempt_view(a, outcomes.get(a.id)) for a in attempts]
    return _json(AttemptPage(items=items, next_cursor=nxt))


async def _event_rows(
    request: HTTPConnection,
    run: Callable[[Callable[[], tuple[list[dict[str, Any]], bool]]], Awaitable[Any]],
    task_id: str | None,
    position: tuple[int, int],
    limit: int,
) -> tuple[list[dict[str, Any]], bool]:
    """``Store.event_list``, its wait on the event loop: each read goes through ``run``
    (the store's threads, or a stream's own), and a read waiting for an older
    transaction holds no thread. A position that names no event is a bad cursor. Also
    whether events were still held back when the wait gave up (a stream's first page:
    it then re-reads shortly, as after any of its reads that says so)."""
    store = _store(request)
    read = partial(
        store.event_read,
        task_id=task_id,
        after_id=position[1],
        after_xid=position[0],
        limit=limit,
    )
    rows: list[dict[str, Any]]
    try:
        rows, held_back = await run(read)
        for pause in store.event_pauses():
            if not held_back:
                break
            await asyncio.sleep(pause)
            rows, held_back = await run(read)
    except OrbitError as exc:  # the only argument left to refuse: no event is there
        if exc.code is not Code.INVALID_ARGUMENT:
            raise
        raise _bad_cursor() from None
    return rows, held_back


async def _events(
    request: Request, task_id: str | None, limit: int, cursor: str | None
) -> Response:
    position = event_cursor(decode_cursor(cursor))
    rows, _ = await _event_rows(request, in_thread, task_id, position, limit)
    nxt = event_position_cursor(rows[-1]) if len(rows) == limit else None
    return _json(EventPage(items=[event_view(r) for r in rows], next_cursor=nxt))


@router.get(
    "/tasks/{task_id}/events",
    dependencies=[Depends(require("submit")), *LISTING],
    response_model=EventPage,
)
async def task_events(
    request: Request, task_id: str, limit: Limit = 100, cursor: str | None = None
) -> Response:
    await in_thread(_store(request).task_get, task_id)
    return await _events(request, task_id, limit, cursor)


@router.get("/events", dependencies=[Depends(require("admin")), *LISTING], response_model=EventPage)
async def events(request: Request, limit: Limit = 100, cursor: str | None = None) -> Response:
    return await _events(request, None, limit, cursor)


#: the 200 of a stream route in the OpenAPI document
STREAM_REPLY: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-Sent Events: each event with its cursor as `id`, its kind "
        "as `event` and its EventView as `data` (docs/protocol.md, Event streams)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}
#: the ``Last-Event-ID`` header a stream resumes from (it wins over ``cursor``)
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID")]


def stream_start(last_event_id: str | None, cursor: str | None) -> tuple[int, int]:
    """The position a stream starts after: ``Last-Event-ID`` if the request has one (a
    browser's EventSource reconnects to the URL it was opened with, ``cursor`` and all,
    adding the header), else ``cursor``, else the start of the log. An empty header is
    none (EventSource sends none after an empty id). Both are checked when both are
    given: a bad ``cursor`` was let through silently behind a good header."""
    from_query = event_cursor(decode_cursor(cursor))
    if not last_event_id:
        return from_query
    try:
        return event_cursor(decode_cursor(last_event_id))
    except ApiError as refused:  # named as the header, not the query it was taken for
        refused.field = "Last-Event-ID"
        raise


async def _open_tail(
    conn: HTTPConnection,
    scope: str,
    task_id: str | None,
    cursor: str | None,
    last_event_id: str | None = None,
) -> Tail:
    """A stream's start, whichever carries it (SSE or WebSocket), refused before it is
    accepted: a bad cursor 400, an unknown task 404, the node at its cap of streams 503.
    Its first page is read on the streams' own threads, as its later reads."""
    position = stream_start(last_event_id, cursor)
    if task_id is not None:
        await in_thread(_store(conn).task_get, task_id)  # 404 for an unknown task

    async def first_page() -> tuple[list[dict[str, Any]], bool]:
        return await _event_rows(conn, conn.app.state.streams.read, task_id, position, PAGE)

    try:
        return await open_tail(
            conn,
            scope=scope,
            task_id=task_id,
            position=position,
            first_page=first_page,
            cursor_of=event_position_cursor,
        )
    except ApiError as refused:  # a position naming no event: the header's, if sent
        if refused.code == "INVALID_CURSOR" and last_event_id:
            refused.field = "Last-Event-ID"
        raise


@router.get(
    "/tasks/{task_id}/events/stream",
    dependencies=[Depends(require("submit")), *LISTING],
    response_class=Response,
    responses=STREAM_REPLY,
)
async def task_event_stream(
    request: Request,
    task_id: str,
    cursor: str | None = None,
    last_event_id: LastEventId = None,
) -> Response:
    """The task's events as they are written, from ``Last-Event-ID`` or ``cursor`` (or
    its first); the stream ends after the task has ended and its events are all sent."""
    return EventStream(await _open_tail(request, "submit", task_id, cursor, last_event_id))


@router.get(
    "/events/stream",
    dependencies=[Depends(require("admin")), *LISTING],
    response_class=Response,
    responses=STREAM_REPLY,
)
async def event_stream(
    request: Request, cursor: str | None = None, last_event_id: LastEventId = None
) -> Response:
    """The whole event log as it is written, from ``Last-Event-ID`` or ``cursor`` (or its
    start), until the client goes or the server stops."""
    return EventStream(await _open_tail(request, "admin", None, cursor, last_event_id))


async def _subscribe(ws: WebSocket, scope: str, task_id: str | None) -> None:
    """A WebSocket stream: the checks of its SSE twin, in the same order (the token's
    scope, the query, the cursor, the task, the cap), each refusing the upgrade with the
    status and error body the SSE route answers; then the frames (streams.serve_socket).
    The token comes in the upgrade's ``Authorization`` header only, never in the URL."""
    try:
        await ws.app.state.tokens.require(ws.headers, scope)
        each_query_once(ws)
        tail = await _open_tail(ws, scope, task_id, ws.query_params.get("cursor"))
    except ApiError as exc:
        await refuse_upgrade(ws, exc)
        return
    except OrbitError as exc:  # an unknown task
        await refuse_upgrade(ws, ApiError(exc.status, str(exc.code), exc.message))
        return
    except Exception:
        # As the worker gateway: a check that failed (the database down) judged nothing;
        # 500 INTERNAL, which a client retries, rather than a refusal it would not.
        log.exception("event stream upgrade failed")
        await refuse_upgrade(
            ws, ApiError(500, "INTERNAL", "the server could not process this request")
        )
        return
    await serve_socket(ws, tail)


@router.websocket("/tasks/{task_id}/events/ws")
async def task_event_socket(ws: WebSocket, task_id: str) -> None:
    """``/v1/tasks/{id}/events/stream`` over WebSocket (submit scope)."""
    await _subscribe(ws, "submit", task_id)


@router.websocket("/events/ws")
async def event_socket(ws: WebSocket) -> None:
    """``/v1/events/stream`` over WebSocket (admin scope)."""
    await _subscribe(ws, "admin", None)


# ----------------------------------------------------------------------------- schedules


def template_from(msg: ScheduleTemplate) -> TaskSpec:
    """A schedule's template as the store's spec, as ``spec_from`` makes a submit's."""
    backoff = DEFAULT_BACKOFF
    if msg.backoff is not None:
        backoff = Backoff(
            seconds_to_us(msg.backoff.base), msg.backoff.factor, seconds_to_us(msg.backoff.max)
        )
    return TaskSpec(
        queue=msg.queue,
        handler=msg.handler,
        payload=msg.payload,
        tenant=msg.tenant,
        priority=msg.priority,
        retry_safe=msg.retry_safe,
        max_attempts=msg.max_attempts,
        backoff=backoff,
        attempt_timeout_us=seconds_to_us(msg.attempt_timeout) if msg.attempt_timeout else None,
    )


SCHEDULE_REFUSALS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorReply,
        "description": "INVALID_CRON, INVALID_TIMEZONE or INVALID_ARGUMENT (a bad template, "
        "misfire or max_catch_up), with the field at fault; nothing was written",
    },
    404: {"model": ErrorReply, "description": "QUEUE_NOT_FOUND: the template's queue"},
    409: {"model": ErrorReply, "description": "SCHEDULE_EXISTS: the name is taken"},
    413: {
        "model": ErrorReply,
        "description": "PAYLOAD_TOO_LARGE: the template's payload is over the store's bound "
        "(field template); BODY_TOO_LARGE: the body is over the server's. Nothing was written",
    },
}


@router.post(
    "/schedules",
    dependencies=[Depends(require("admin")), *ACTION],
    status_code=201,
    response_model=ScheduleView,
    responses=SCHEDULE_REFUSALS,
)
async def schedule_create(request: Request) -> Response:
    """Create a schedule: it submits its template at each instant of its cron expression
    in its time zone, from the first instant after now."""
    msg = await _body(request, ScheduleCreate)
    schedule = await in_thread(
        partial(
            _store(request).schedule_create,
            msg.name,
            cron=msg.cron,
            timezone=msg.timezone,
            template=template_from(msg.template),
            misfire=msg.misfire,
            max_catch_up=msg.max_catch_up,
            paused=msg.paused,
        )
    )
    return _json(schedule_view(schedule), 201)


@router.get(
    "/schedules",
    dependencies=[Depends(require("submit")), *LISTING],
    response_model=SchedulePage,
)
async def schedule_list(
    request: Request, limit: Limit = 100, cursor: str | None = None
) -> Response:
    """Schedules a page at a time in name order: keyset, as the queue list."""
    after = name_cursor(cursor)
    found = await in_thread(lambda: _store(request).schedule_list(after_name=after, limit=limit))
    nxt = encode_cursor(found[-1].name) if len(found) == limit else None
    return _json(SchedulePage(items=[schedule_view(s) for s in found], next_cursor=nxt))


@router.get(
    "/schedules/{name}", dependencies=[Depends(require("submit"))], response_model=ScheduleView
)
async def schedule_get(request: Request, name: str) -> Response:
    return _json(schedule_view(await in_thread(_store(request).schedule_get, name)))


@router.post(
    "/schedules/{name}/pause",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=ScheduleView,
)
async def schedule_pause(request: Request, name: str) -> Response:
    """Stop firing; idempotent."""
    return _json(schedule_view(await in_thread(_store(request).schedule_pause, name)))


@router.post(
    "/schedules/{name}/resume",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=ScheduleView,
)
async def schedule_resume(request: Request, name: str) -> Response:
    """Fire again from the first instant after now (the instants passed while paused are
    not fired, whatever the misfire policy); idempotent."""
    return _json(schedule_view(await in_thread(_store(request).schedule_resume, name)))


@router.patch(
    "/schedules/{name}",
    dependencies=[Depends(require("admin")), *ACTION],
    response_model=ScheduleView,
    responses={
        400: SCHEDULE_REFUSALS[400],
        404: {
            "model": ErrorReply,
            "description": "SCHEDULE_NOT_FOUND, or QUEUE_NOT_FOUND: the template's queue",
        },
        413: SCHEDULE_REFUSALS[413],
    },
)
async def schedule_update(request: Request, name: str) -> Response:
    """Change a schedule: only the fields given (see ScheduleUpdate). A new cron or time
    zone moves its next fire to the first instant after now; otherwise an instant due
    and not yet fired fires once, with what the update left."""
    msg = await _body(request, ScheduleUpdate)
    schedule = await in_thread(
        partial(
            _store(request).schedule_update,
            name,
            cron=msg.cron,
            timezone=msg.timezone,
            template=None if msg.template is None else template_from(msg.template),
            misfire=msg.misfire,
            max_catch_up=msg.max_catch_up,
        )
    )
    return _json(schedule_view(schedule))


@router.delete(
    "/schedules/{name}",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=ScheduleView,
)
async def schedule_delete(request: Request, name: str) -> Response:
    """Delete a schedule, answering it as it was; the tasks it made stay."""
    return _json(schedule_view(await in_thread(_store(request).schedule_delete, name)))


@router.patch(
    "/queues/{name}", dependencies=[Depends(require("admin")), *ACTION], response_model=QueueView
)
async def queue_update(request: Request, name: str) -> Response:
    """Change a queue's caps: only the fields given (see QueueUpdate)."""
    msg = await _body(request, QueueUpdate)
    queue = await in_thread(
        _store(request).queue_update,
        name,
        max_concurrency=msg.max_concurrency,
        rate=msg.rate,
        burst=msg.burst,
        max_queued=_given(msg, "max_queued"),
    )
    return _json(queue_view(queue))


# ----------------------------------------------------------------------------- limits


@router.get(
    "/limits/global", dependencies=[Depends(require("admin"))], response_model=GlobalLimitView
)
async def limit_global_get(request: Request) -> Response:
    cap = await in_thread(_store(request).global_limit_get)
    return _json(GlobalLimitView(max_concurrency=cap))


@router.put(
    "/limits/global",
    dependencies=[Depends(require("admin")), *ACTION],
    response_model=GlobalLimitView,
)
async def limit_global_set(request: Request) -> Response:
    """Cap live attempts across the cluster; ``max_concurrency: null`` removes the cap."""
    msg = await _body(request, LimitSet)
    await in_thread(_store(request).global_limit_set, msg.max_concurrency)
    return _json(GlobalLimitView(max_concurrency=msg.max_concurrency))


@router.get(
    "/limits/tenants",
    dependencies=[Depends(require("admin")), *LISTING],
    response_model=TenantLimitPage,
)
async def limit_tenant_list(
    request: Request, limit: Limit = 100, cursor: str | None = None
) -> Response:
    """The tenants that have a cap of either kind (a tenant left out has none) a page at a
    time in name order, the cursor standing for the last one's name: keyset, as the queue
    list pages queues. Every tenant ever capped keeps its row, so the list has no bound
    of its own."""
    after = name_cursor(cursor)
    caps = await in_thread(lambda: _store(request).tenant_limits(after_name=after, limit=limit))
    items = [
        TenantLimitView(tenant=t, max_concurrency=c, max_queued=q) for t, (c, q) in caps.items()
    ]
    nxt = encode_cursor(items[-1].tenant) if len(items) == limit else None
    return _json(TenantLimitPage(items=items, next_cursor=nxt))


@router.get(
    "/limits/tenants/{tenant}",
    dependencies=[Depends(require("admin"))],
    response_model=TenantLimitView,
)
async def limit_tenant_get(request: Request, tenant: str) -> Response:
    return _json(await in_thread(_tenant_view, _store(request), tenant))


def _tenant_view(store: Store, tenant: str) -> TenantLimitView:
    """A tenant's caps as the store holds them (None: no cap of that kind)."""
    return TenantLimitView(
        tenant=tenant,
        max_concurrency=store.tenant_limit_get(tenant),
        max_queued=store.tenant_queued_get(tenant),
    )


@router.put(
    "/limits/tenants/{tenant}",
    dependencies=[Depends(require("admin")), *ACTION],
    response_model=TenantLimitView,
)
async def limit_tenant_set(request: Request, tenant: str) -> Response:
    """Cap a tenant's live attempts and its waiting tasks in all queues: the caps given
    (see TenantLimitSet); null removes one. Answers the caps in force after."""
    msg = await _body(request, TenantLimitSet)
    store = _store(request)

    def put() -> TenantLimitView:
        store.tenant_limit_set(
            tenant,
            _given(msg, "max_concurrency"),
            max_queued=_given(msg, "max_queued"),
        )
        return _tenant_view(store, tenant)

    return _json(await in_thread(put))


def _given(msg: BaseModel, field: str) -> Any:
    """A body's field as the store takes a cap: its value (None removes the cap) if the
    body gave it, else KEEP."""
    return getattr(msg, field) if field in msg.model_fields_set else KEEP


# ----------------------------------------------------------------------------- workers


@router.get(
    "/workers",
    dependencies=[Depends(require("admin")), *LISTING],
    response_model=WorkerPage,
)
async def worker_list(
    request: Request, state: str | None = None, limit: Limit = 100, cursor: str | None = None
) -> Response:
    """Worker sessions a page at a time, as the task list pages tasks: by id (a uuid7, so
    in the order they were opened), the cursor standing for the last one's id. Sessions
    are never deleted, so the whole list grows with every worker process ever started."""
    if state is not None and state not in SESSION_STATES:
        raise ApiError(
            400, "INVALID_ARGUMENT", f"state must be one of {', '.join(SESSION_STATES)}", "state"
        )
    after_id = id_cursor(cursor)
    sessions = await in_thread(
        lambda: _store(request).session_list(state=state, after_id=after_id, limit=limit)
    )
    nxt = encode_cursor(sessions[-1].id) if len(sessions) == limit else None
    return _json(WorkerPage(items=[worker_view(s) for s in sessions], next_cursor=nxt))


@router.post(
    "/workers/{session_id}/drain",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=WorkerView,
)
async def worker_drain(request: Request, session_id: str) -> Response:
    """Stop new claims for the session, durably. Its worker is pushed `drain` and
    exits once its running attempts finish."""
    session = await in_thread(_store(request).session_drain, session_id)
    # Told by this node if it holds the session's connection; on PostgreSQL another
    # node that holds it hears the drain's NOTIFY (``Store.session_drain``).
    request.app.state.dispatcher.push_drain(session_id)
    return _json(worker_view(session))


# ----------------------------------------------------------------------------- tokens


@router.post(
    "/tokens",
    dependencies=[Depends(require("admin")), *ACTION],
    status_code=201,
    response_model=TokenCreated,
)
async def token_create(request: Request) -> Response:
    msg = await _body(request, TokenCreate)
    token_id, token = await in_thread(_store(request).token_create, msg.name, list(msg.scopes))
    reply = _json(
        TokenCreated(id=token_id, name=msg.name, scopes=sorted(set(msg.scopes)), token=token), 201
    )
    reply.headers["Cache-Control"] = "no-store"  # the reply holds the token's only copy
    return reply


@router.get("/tokens", dependencies=[Depends(require("admin")), *LISTING], response_model=TokenPage)
async def token_list(request: Request, limit: Limit = 100, cursor: str | None = None) -> Response:
    """Tokens, revoked ones too, oldest first, a page at a time: in id order (a token's
    id is the uuid7 of its creation), the cursor standing for the last one's id. Never a
    secret: the cursor is the id ``orbit token ls`` shows anyway."""
    after = token_cursor(cursor)
    tokens = await in_thread(lambda: _store(request).token_list(after_id=after, limit=limit))
    nxt = encode_cursor(tokens[-1].id) if len(tokens) == limit else None
    return _json({"items": [token_wire(t) for t in tokens], "next_cursor": nxt})


@router.post(
    "/tokens/{token_id}/revoke",
    dependencies=[Depends(require("admin")), *BODILESS],
    response_model=TokenView,
)
async def token_revoke(request: Request, token_id: str) -> Response:
    """Refuse a token from now on; each node refuses it for admin calls at once
    (``auth.require`` reads those afresh), may accept it for others for as long as it
    caches token checks (``orbit server --token-cache``, default
    ``orbit.tokens.CACHE_SECONDS``), and closes the worker connections open with it
    within that time (orbit/server/revocation.py). Idempotent."""
    return _json(token_wire(await in_thread(_store(request).token_revoke, token_id)))
