"""Client and AsyncClient. Requests are built once (``_Calls``) and sent by a sync or an
async transport; certificates are always verified (a custom CA file is accepted)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import inspect
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, overload
from urllib.parse import SplitResult

import httpx
import orjson
from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as ws_open_async
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import connect as ws_open

from orbit.client._errors import ApiError, TaskFailed, WaitTimeout, error_from
from orbit.client._http import (
    KEEPALIVE_EXPIRY,
    Reply,
    Transport,
    Unreachable,
    checked_timeout,
    sent_again,
    server_down,
    server_failing,
    timed_out,
    unreachable,
    where,
)
from orbit.client._http import (
    path_segment as _seg,
)
from orbit.client._sse import Following
from orbit.client._tls import ThreadSafeTLS
from orbit.client._ws import (
    MAX_FRAME,
    Subscription,
    aheld,
    closed,
    held,
    socket_base,
    ws_log,
)
from orbit.core.model import compact_json, parse_json
from orbit.tokens import load_token, token_fault
from orbit.tokens import token_id as token_id_of
from orbit.urls import check_cafile, check_server_url

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "needs_review"})
Request = tuple[str, str, dict[str, Any] | None, dict[str, Any] | list[Any] | None]
#: The page size the calls that return a whole list (``workers()``, ``queues()``,
#: ``attempts()``, ``token_list()``, ``tenant_limits()``) walk its pages with: the most a
#: page may hold.
FULL_PAGE = 1000
#: What a batch submit answers with: each task's view, or its id (``submit_many``).
BatchReply = Literal["full", "ids"]


def _instant(value: datetime | str | None, what: str = "deadline and run_after") -> str | None:
    """An aware datetime as RFC 3339, the only spelling the server takes; text is sent as
    it is. An offset that is not whole minutes (``+05:30:15``, which ``isoformat``
    writes so and RFC 3339 cannot) is written as the same instant in UTC."""
    if value is None or isinstance(value, str):
        return value
    offset = value.utcoffset()
    if offset is None:
        raise ValueError(f"{what} need a timezone (e.g. datetime.now(UTC))")
    if offset % timedelta(minutes=1):
        value = value.astimezone(UTC)
    return value.isoformat()


def _window(
    created_after: datetime | str | None, created_before: datetime | str | None
) -> dict[str, str | None]:
    """The task list's time window as query values (an aware datetime or RFC 3339 text;
    a naive datetime is a ValueError, nothing sent)."""
    what = "created_after and created_before"
    return {
        "created_after": _instant(created_after, what),
        "created_before": _instant(created_before, what),
    }


def request_json(body: dict[str, Any] | list[Any]) -> bytes:
    """A request's body as JSON, refusing NaN and the infinities with ValueError. orjson
    (``compact_json``) writes them as ``null``: ``submit(payload={"x": float("nan")})``
    stored ``{"x": null}``, and ``attempt_timeout=float("inf")`` gave a task no timeout
    at all, without a word. Each of them comes out as ``null``, so the value is walked
    only when its JSON holds one.

    A dict key that is not a string (``{1: "a"}``, ``{None: 1}``) is a TypeError naming
    the key and where it is: orjson refuses one, and the standard library it falls back
    to wrote it as text, so ``{1: "a"}`` was stored as ``{"1": "a"}`` and ``{None: 1}``
    as ``{"null": 1}`` without a word (and ``{1: "a", "1": "b"}`` was the server's
    DUPLICATE_KEY). Only a body orjson refuses is walked for one. A value JSON cannot
    hold (a set, bytes) is a TypeError naming where it is too: the encoder's said only
    "Object of type set is not JSON serializable", which left a large payload to be
    searched by hand."""
    try:
        data = orjson.dumps(body)  # compact_json's first try, and all it does when it works
    except TypeError:
        _refuse_non_text_keys(body, "")
        data = compact_json(body)
    if b"null" in data and _holds_non_finite(body):
        raise ValueError("JSON cannot carry NaN or an infinity: send a number, or null")
    return data


#: What JSON writes as it is: a value of these is never looked into by the walk below.
_JSON_SCALARS = (str, int, float, bool, type(None))


def _refuse_non_text_keys(value: Any, path: str) -> None:
    """TypeError if a dict anywhere in ``value`` (at ``path``: ``payload.items[0]``) has
    a key that is not a string, or if a value there is one ``compact_json`` cannot write
    (a set, bytes, an object), which JSON cannot hold; the message names its path."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                where = f"in {path}" if path else "at the top of the request body"
                raise TypeError(
                    f"JSON object keys must be strings: the key {key!r:.60} "
                    f"({type(key).__name__}) {where} (nothing was sent)"
                )
            _refuse_non_text_keys(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _refuse_non_text_keys(item, f"{path}[{i}]")
    elif not isinstance(value, _JSON_SCALARS):
        # Anything else orjson may still write (a dataclass, an enum, a UUID, a datetime).
        try:
            compact_json(value)
        except TypeError:
            hint = " (send a list)" if isinstance(value, set | frozenset) else ""
            if isinstance(value, bytes | bytearray | memoryview):
                hint = " (send text: base64, say)"
            raise TypeError(
                f"JSON cannot hold the {type(value).__name__} at "
                f"{path or 'the top of the request body'}{hint} (nothing was sent)"
            ) from None


def _holds_non_finite(value: Any) -> bool:
    """Whether a NaN or an infinity is anywhere in what orjson writes of ``value``: in
    a dataclass instance's fields and an enum member's value too, which it writes as it
    writes a dict and the value (they were not looked into, and their NaN went as null)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_holds_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_non_finite(v) for v in value)
    if isinstance(value, enum.Enum):
        return _holds_non_finite(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_non_finite(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _walk(read: Callable[[str | None], dict[str, Any]], cursor: str | None) -> Iterator[Any]:
    """Every item of a keyset-paged list, page after page from ``cursor`` (None: the
    start) until a page names no next one."""
    while True:
        page = read(cursor)
        yield from page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return


async def _awalk(
    read: Callable[[str | None], Awaitable[dict[str, Any]]], cursor: str | None
) -> AsyncIterator[Any]:
    """``_walk`` for AsyncClient."""
    while True:
        page = await read(cursor)
        for item in page["items"]:
            yield item
        cursor = page["next_cursor"]
        if cursor is None:
            return


def _page(limit: int, cursor: str | None) -> dict[str, Any]:
    """A paged list's query. An empty cursor is sent, and refused, as the task list's
    is: dropped, it read from the start."""
    return {"limit": limit, **({} if cursor is None else {"cursor": cursor})}


def _duration(value: Any) -> Any:
    """A duration as the seconds the server takes: a ``timedelta`` as its
    ``total_seconds()`` (json cannot write one, and the TypeError named no argument);
    anything else as it is, for the server to check."""
    return value.total_seconds() if isinstance(value, timedelta) else value


def _backoff(backoff: Any) -> Any:
    """A backoff with its durations (``base``, ``max``) in seconds (``_duration``);
    anything but a mapping as it is, for the server to refuse naming the field."""
    if not isinstance(backoff, Mapping):
        return backoff
    return {key: _duration(value) for key, value in backoff.items()}


#: The fields of a task's body that ``_batch_item`` may have to write otherwise.
_CONVERTED = frozenset({"attempt_timeout", "backoff", "deadline", "run_after"})


def _batch_item(task: Any) -> Any:
    """A ``submit_many`` item with its durations and instants written as ``task_body``
    writes them: a ``timedelta`` was a bare TypeError from the JSON encoder, naming no
    task or field, where ``submit`` took one. Anything but a dict is left as it is, for
    the server to refuse naming the item."""
    if not isinstance(task, dict) or _CONVERTED.isdisjoint(task):
        return task  # the usual item, sent as it is (a copy cost 1 % of a batch's time)
    item = dict(task)
    if "attempt_timeout" in item:
        item["attempt_timeout"] = _duration(item["attempt_timeout"])
    if "backoff" in item:
        item["backoff"] = _backoff(item["backoff"])
    for field in ("deadline", "run_after"):
        if isinstance(item.get(field), datetime):
            item[field] = _instant(item[field])
    return item


def task_body(
    queue: str,
    handler: str,
    payload: Any = None,
    *,
    tenant: str | None = None,
    priority: int | None = None,
    idempotency_key: str | None = None,
    parent_id: str | None = None,
    retry_safe: bool | None = None,
    max_attempts: int | None = None,
    backoff: Mapping[str, float | timedelta] | None = None,
    attempt_timeout: float | timedelta | None = None,
    deadline: datetime | str | None = None,
    run_after: datetime | str | None = None,
) -> dict[str, Any]:
    """The submit body; options left as None take the server's defaults. Durations
    (``attempt_timeout``, ``backoff``'s ``base`` and ``max``) are seconds or a
    ``timedelta``; instants (``deadline``, ``run_after``) an aware ``datetime`` or
    RFC 3339 text."""
    body: dict[str, Any] = {"queue": queue, "handler": handler, "payload": payload}
    optional = {
        "tenant": tenant,
        "priority": priority,
        "idempotency_key": idempotency_key,
        "parent_id": parent_id,
        "retry_safe": retry_safe,
        "max_attempts": max_attempts,
        "backoff": _backoff(backoff),
        "attempt_timeout": _duration(attempt_timeout),
        "deadline": _instant(deadline),
        "run_after": _instant(run_after),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


#: The options ``submit`` takes beside the queue, the handler and the payload.
SUBMIT_OPTIONS = tuple(
    name
    for name, param in inspect.signature(task_body).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
)


def _submit_body(
    call: str, queue: str, handler: str, payload: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """``task_body`` for ``call`` (``Client.submit``), an option it does not know a
    TypeError that names ``call``, the option and those it takes: Python's own named
    ``task_body()``, which no caller had called, and not what ``timeout`` is instead."""
    unknown = [name for name in options if name not in SUBMIT_OPTIONS]
    if unknown:
        hint = (
            " (a task's time limit is attempt_timeout, in seconds or a timedelta)"
            if "timeout" in unknown
            else ""
        )
        raise TypeError(
            f"{call}() got an unexpected keyword argument {', '.join(map(repr, unknown))}"
            f"{hint}; it takes {', '.join(SUBMIT_OPTIONS)} (nothing was sent)"
        )
    return task_body(queue, handler, payload, **options)


class SubmittedTask(dict[str, Any]):
    """What ``submit`` returns (and ``submit_many`` with ``reply="full"``, for each task):
    the task's view, a dict as before, and ``created``, whether this submit made the task
    (True) or its idempotency key named one that was there already (False: nothing new
    was made, and this is that task). The server says so in every answer, and the view
    alone could not tell a resubmit from a new task."""

    __slots__ = ("created",)

    def __init__(self, view: dict[str, Any], created: bool) -> None:
        super().__init__(view)
        self.created = created

    def __reduce__(self) -> tuple[Any, ...]:
        # With ``__slots__`` and no state of its own, pickle protocols 0 and 1 refused
        # it, where the plain dict it replaces was taken by every protocol.
        return (SubmittedTask, (dict(self), self.created))


#: A cap argument's "leave it as it is", where None removes the cap.
Keep = Literal["keep"]
KEEP: Keep = "keep"


class _Calls:
    """Every API call as (method, path, query, body): shared by both clients."""

    @staticmethod
    def queue_create(
        name: str,
        max_concurrency: int,
        rate: float,
        burst: int | None = None,
        max_queued: int | None = None,
    ) -> Request:
        body: dict[str, Any] = {"name": name, "max_concurrency": max_concurrency, "rate": rate}
        if burst is not None:
            body["burst"] = burst
        if max_queued is not None:
            body["max_queued"] = max_queued
        return ("POST", "/v1/queues", None, body)

    @staticmethod
    def queue_update(
        name: str,
        max_concurrency: int | None,
        rate: float | None,
        burst: int | None,
        max_queued: int | Keep | None = KEEP,
    ) -> Request:
        """Only the caps given go in the body; the server refuses an empty one.
        ``max_queued``: None removes the cap, ``"keep"`` leaves it out."""
        caps = {"max_concurrency": max_concurrency, "rate": rate, "burst": burst}
        body: dict[str, Any] = {k: v for k, v in caps.items() if v is not None}
        if max_queued != KEEP:
            body["max_queued"] = max_queued
        return ("PATCH", f"/v1/queues/{_seg(name, 'name')}", None, body)

    @staticmethod
    def tenant_limit(
        tenant: str,
        max_concurrency: int | Keep | None = KEEP,
        max_queued: int | Keep | None = KEEP,
        *,
        put: bool,
    ) -> Request:
        """The caps given (None removes one; ``"keep"`` leaves it out of the body)."""
        path = f"/v1/limits/tenants/{_seg(tenant, 'tenant')}"
        if put:
            caps = {"max_concurrency": max_concurrency, "max_queued": max_queued}
            return ("PUT", path, None, {k: v for k, v in caps.items() if v != KEEP})
        return ("GET", path, None, None)

    @staticmethod
    def global_limit(max_concurrency: int | None = None, *, put: bool) -> Request:
        if put:
            return ("PUT", "/v1/limits/global", None, {"max_concurrency": max_concurrency})
        return ("GET", "/v1/limits/global", None, None)

    @staticmethod
    def tasks_list(limit: int, cursor: str | None, **filters: str | None) -> Request:
        """``filters``: state, queue, tenant, handler, parent_id, created_after,
        created_before (None: not filtered). An empty one is sent as it is, for the
        server to refuse (BadRequest): dropped, ``queue=""`` would list every queue's."""
        query: dict[str, Any] = {k: v for k, v in filters.items() if v is not None}
        query["limit"] = limit
        if cursor is not None:
            query["cursor"] = cursor
        return ("GET", "/v1/tasks", query, None)

    @staticmethod
    def artifacts_list(task_id: str, limit: int, cursor: str | None) -> Request:
        return (
            "GET",
            f"/v1/tasks/{_seg(task_id, 'task_id')}/artifacts",
            _page(limit, cursor),
            None,
        )

    @staticmethod
    def attempts_list(task_id: str, limit: int, cursor: str | None) -> Request:
        return ("GET", f"/v1/tasks/{_seg(task_id, 'task_id')}/attempts", _page(limit, cursor), None)

    @staticmethod
    def queues_list(limit: int, cursor: str | None) -> Request:
        return ("GET", "/v1/queues", _page(limit, cursor), None)

    @staticmethod
    def tokens_list(limit: int, cursor: str | None) -> Request:
        return ("GET", "/v1/tokens", _page(limit, cursor), None)

    @staticmethod
    def events(task_id: str, limit: int, cursor: str | None) -> Request:
        return ("GET", f"/v1/tasks/{_seg(task_id, 'task_id')}/events", _page(limit, cursor), None)

    @staticmethod
    def event_log(limit: int, cursor: str | None) -> Request:
        """Every task's events and the operators' changes (caps, pauses, sessions): an
        empty cursor is sent, and refused, as ``events`` sends it."""
        return ("GET", "/v1/events", _page(limit, cursor), None)

    @staticmethod
    def submit_many(tasks: list[dict[str, Any]], reply: BatchReply) -> Request:
        query = None if reply == "full" else {"reply": reply}
        # Anything but a list goes as it is, for the server to refuse as "tasks" (None
        # was a bare TypeError here, and a dict's keys went as the tasks).
        items = [_batch_item(t) for t in tasks] if isinstance(tasks, list | tuple) else tasks
        return ("POST", "/v1/tasks/batch", query, {"tasks": items})

    @staticmethod
    def submitted(reply: BatchReply, items: Any) -> list[dict[str, Any]]:
        """A batch reply's items, in the order submitted: each task's view with whether
        it was made (``SubmittedTask``, ``reply="full"``), or each ``{"id", "created"}``
        (``reply="ids"``)."""
        if reply == "full":
            return [SubmittedTask(r["task"], r["created"]) for r in items]
        return [dict(r) for r in items]

    @staticmethod
    def workers_list(state: str | None, limit: int, cursor: str | None) -> Request:
        query = {"state": state, "limit": limit, "cursor": cursor}
        return ("GET", "/v1/workers", {k: v for k, v in query.items() if v is not None}, None)

    @staticmethod
    def queue_action(name: str, action: Literal["pause", "resume"]) -> Request:
        return ("POST", f"/v1/queues/{_seg(name, 'name')}/{action}", None, None)

    @staticmethod
    def schedule_create(
        name: str,
        cron: str,
        template: dict[str, Any],
        timezone: str | None,
        misfire: str | None,
        max_catch_up: int | None,
        paused: bool | None,
    ) -> Request:
        """``template``: a submit's body as ``task_body`` makes it (without a key,
        parent, deadline or run_after); options left as None take the server's
        defaults."""
        body: dict[str, Any] = {"name": name, "cron": cron, "template": template}
        optional = {
            "timezone": timezone,
            "misfire": misfire,
            "max_catch_up": max_catch_up,
            "paused": paused,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        return ("POST", "/v1/schedules", None, body)

    @staticmethod
    def schedules_list(limit: int, cursor: str | None) -> Request:
        return ("GET", "/v1/schedules", _page(limit, cursor), None)

    @staticmethod
    def schedule(name: str) -> Request:
        return ("GET", f"/v1/schedules/{_seg(name, 'name')}", None, None)

    @staticmethod
    def schedule_action(name: str, action: Literal["pause", "resume"]) -> Request:
        return ("POST", f"/v1/schedules/{_seg(name, 'name')}/{action}", None, None)

    @staticmethod
    def schedule_update(
        name: str,
        cron: str | None,
        timezone: str | None,
        template: dict[str, Any] | None,
        misfire: str | None,
        max_catch_up: int | None,
    ) -> Request:
        """Only the fields given go in the body; the server refuses an empty one.
        ``template``: ``task_body``'s keyword arguments (``queue`` and ``handler`` at
        least), the whole template."""
        body: dict[str, Any] = {}
        if template is not None:
            body["template"] = task_body(**template)
        given: dict[str, Any] = {"cron": cron, "timezone": timezone, "misfire": misfire}
        given["max_catch_up"] = max_catch_up
        body.update({k: v for k, v in given.items() if v is not None})
        return ("PATCH", f"/v1/schedules/{_seg(name, 'name')}", None, body)

    @staticmethod
    def schedule_delete(name: str) -> Request:
        return ("DELETE", f"/v1/schedules/{_seg(name, 'name')}", None, None)

    @staticmethod
    def tenant_limits_list(limit: int, cursor: str | None) -> Request:
        return ("GET", "/v1/limits/tenants", _page(limit, cursor), None)

    @staticmethod
    def submit(body: dict[str, Any]) -> Request:
        """``body``: as ``task_body`` makes it."""
        return ("POST", "/v1/tasks", None, body)

    @staticmethod
    def task(task_id: str) -> Request:
        return ("GET", f"/v1/tasks/{_seg(task_id, 'task_id')}", None, None)

    @staticmethod
    def task_action(task_id: str, action: Literal["cancel", "retry"]) -> Request:
        return ("POST", f"/v1/tasks/{_seg(task_id, 'task_id')}/{action}", None, None)

    @staticmethod
    def worker_drain(session_id: str) -> Request:
        return ("POST", f"/v1/workers/{_seg(session_id, 'session_id')}/drain", None, None)

    @staticmethod
    def token_create(name: str, scopes: list[str]) -> Request:
        return ("POST", "/v1/tokens", None, {"name": name, "scopes": scopes})

    @staticmethod
    def token_revoke(token_id: str) -> Request:
        segment = _seg(token_id, "token_id")  # a TypeError for an id that is no text
        if token_id_of(token_id) is not None:
            # A whole token, secret included: sent, it went in the URL (the server refuses
            # it, but a proxy's access log had it by then). Refused here, not repeated.
            raise ValueError(
                "token_id is a whole token, secret included: give its id, the part between "
                "'orbit_' and the next '_' (nothing was sent)"
            )
        return ("POST", f"/v1/tokens/{segment}/revoke", None, None)

    @staticmethod
    def resolve(task_id: str, decision: str, result: Any, error: dict[str, Any] | None) -> Request:
        # The result goes with any decision it is given with: the server refuses one a
        # decision would drop, where leaving it out lost the operator's result in silence.
        body: dict[str, Any] = {"decision": decision}
        if decision == "succeeded" or result is not None:
            body["result"] = result
        if error is not None:
            body["error"] = error
        return ("POST", f"/v1/tasks/{_seg(task_id, 'task_id')}/resolve", None, body)


def _checked_setup(
    url: str, token: str | None, cafile: str | None, timeout: float
) -> tuple[SplitResult, float, dict[str, str]]:
    """What both clients are made with, checked in one order, so that a mistake is the
    same error from either (a ValueError at once, nothing connected): the URL, the
    timeout, the CA file (one that cannot be loaded is named, even for an ``http://`` URL,
    which Client took and AsyncClient refused with a bare FileNotFoundError), then the
    token. ``Client(None)`` raised AttributeError from ``None.rstrip``."""
    if not isinstance(url, str):  # None, bytes, a number: urlsplit took some, not all
        raise ValueError(
            "the server URL must be http://host[:port] or https://host[:port], "
            f"not {type(url).__name__}"
        )
    server = check_server_url(url)
    checked = checked_timeout(timeout)
    check_cafile(cafile)
    return server, checked, _headers(token)


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else load_token()
    fault = token_fault(token)
    if fault is not None:  # refused here: sent, the transport's error quoted the token
        raise ValueError(f"the token {fault}")
    return {"Authorization": f"Bearer {token}", "User-Agent": "orbit-python"}


#: The least a wait's poll is given to be answered in, however little of the wait is
#: left: a poll cut to the few milliseconds left would fail on a server that is well.
POLL_TIMEOUT_FLOOR = 0.5


def _seconds(value: object) -> bool:
    """Whether ``value`` is a number (of seconds): an int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


class Waiting:
    """A wait for one task, from poll to poll: when it is over, how long to pause, and
    since when the server has been unreachable. ``Client.wait``, ``AsyncClient.wait``
    and ``orbit task wait`` poll their own way and share these rules."""

    def __init__(self, task_id: str, timeout: float, poll: float = 0.2) -> None:
        """ValueError for a ``timeout`` of NaN, which no clock passes (the wait went on
        for ever), and a ``poll`` that is not a positive, finite number of seconds (0
        asked the server in a tight loop; less raised from ``time.sleep``). True or False
        is no number of seconds either (``checked_timeout`` refuses them too): True was
        taken as a wait of 1 s."""
        if not _seconds(timeout) or math.isnan(timeout):
            raise ValueError(f"a wait's timeout must be a number of seconds, not {timeout!r}")
        if not _seconds(poll) or not 0 < poll < math.inf:
            raise ValueError(f"a wait's poll must be a positive number of seconds, not {poll!r}")
        self.task_id = task_id
        self._end = time.monotonic() + timeout
        self._poll = poll
        self._delay = min(poll, 0.05)
        self._down_since: float | None = None
        self._state: str | None = None  # the task's, as the last poll that answered saw
        self._cut = False  # the last poll's timeout was cut short by the end of the wait

    def request_timeout(self, default: float) -> float:
        """The next poll's request timeout: the client's (``default``), but never past
        the end of the wait, save for ``POLL_TIMEOUT_FLOOR``. Each poll took the client's
        whole timeout, and a wait for a server slow to answer overshot its own timeout
        by up to that (30 s by default)."""
        left = max(self._end - time.monotonic(), POLL_TIMEOUT_FLOOR)
        self._cut = left < default
        return min(left, default)

    def ended(self, task: dict[str, Any]) -> bool:
        """A poll that answered: whether the task has ended (or needs review);
        WaitTimeout if not and the wait is over."""
        self._down_since = None
        self._state = task["state"]
        if task["state"] in TERMINAL:
            return True
        if time.monotonic() >= self._end:
            raise WaitTimeout(f"task {self.task_id} is still {task['state']}")
        return False

    def failed(self, exc: Unreachable | ApiError) -> None:
        """A poll that raised. A refusal (NotFound, Forbidden, an untrusted certificate,
        an https:// URL for a plain HTTP server) is raised again. The server out of reach,
        directly or behind a proxy's own 502, 503 or 504 page, or failing (500
        ``INTERNAL``, or 503 ``DATABASE_*``: its database busy or away; ``server_failing``),
        is asked again, until the wait is over: Unreachable then, saying for how long, or
        the server's last ``INTERNAL`` or ``Unavailable``. Once,
        the first such poll ended the wait, and a server restarting (a rolling deploy)
        failed every waiting caller, as a database hiccup of a second did until the
        follows and this wait took ``INTERNAL`` for an outage too.

        A poll that timed out after ``request_timeout`` cut it short met the end of the
        wait, not a server that is down: WaitTimeout then, unless the server was out of
        reach before it."""
        failing = server_failing(exc)
        if not (server_down(exc) or failing):
            raise exc
        now = time.monotonic()
        cut_short = self._cut and timed_out(exc)
        if self._down_since is None and not cut_short:
            self._down_since = now
        if now < self._end:
            return
        if failing:
            raise exc
        if self._down_since is None:
            seen = f"is still {self._state}" if self._state else "was not seen"
            raise WaitTimeout(
                f"task {self.task_id} {seen}: the server did not answer the last poll "
                "before the end of the wait"
            ) from exc
        raise Unreachable(
            f"task {self.task_id}: the server was unreachable for the last "
            f"{now - self._down_since:.1f} s of the wait ({exc})"
        ) from exc

    def pause(self) -> float:
        """Seconds until the next poll: short at first, doubling up to ``poll``, never
        past the end of the wait."""
        pause = min(self._delay, max(self._end - time.monotonic(), 0))
        self._delay = min(self._delay * 2, self._poll)
        return pause


def _unwrap(reply: httpx.Response | Reply) -> Any:
    """A call's answer: its JSON. A refusal is raised as its ApiError; a redirect, and a
    success with no JSON (an empty body too, on which the calls raised TypeError), as an
    ApiError that says so."""
    if 300 <= reply.status_code < 400:
        raise _redirected(reply)
    # orjson (falling back to the standard library for what it refuses): a batch reply
    # holds a thousand task views, which json.loads took most of the client's time to read
    try:
        body = parse_json(reply.content) if reply.content else None
    except (ValueError, RecursionError):
        # a proxy's error page, a URL that names no Orbit server, or JSON nested past what
        # the parsers take (the standard library's, orjson's fallback, raises RecursionError)
        body = None
    if reply.status_code >= 400:
        retry_after = (
            reply.retry_after if isinstance(reply, Reply) else reply.headers.get("Retry-After")
        )
        raise error_from(reply.status_code, body, retry_after)
    if body is None:  # no Orbit call answers with nothing
        raise ApiError(
            reply.status_code, "NOT_JSON", "the reply is not JSON: is the URL an Orbit server's?"
        )
    return body


def _redirected(reply: httpx.Response | Reply) -> ApiError:
    """A redirect, from a proxy in front (plain HTTP sent on to https, a host that
    moved): neither client follows one, since the token would go along to wherever it
    points. The error names where, the URL to give the client."""
    to = reply.headers.get("location") if isinstance(reply, httpx.Response) else reply.location
    return ApiError(
        reply.status_code,
        "REDIRECT",
        f"the server redirects to {str(to)[:200]}: the client follows no redirect; give it "
        "the URL the server redirects to",
    )


def _upgrade_failed(exc: Exception, where: str, timeout: float) -> Unreachable | ApiError:
    """What a failed WebSocket upgrade is to a follow (``subscribe``): the server's
    refusal, raised as an HTTP call's (a bad cursor 400, a token refused 401 or 403, an
    unknown task 404, a node at its cap 503, a redirect websockets would not follow); a
    2xx that is no upgrade (NOT_EVENT_STREAM: no Orbit server's answer); anything else
    (refused, reset, timed out, a handshake cut off by a restart) Unreachable. A redirect
    websockets refused to follow (to an ``https://`` page, InvalidURI; from ``wss`` to
    ``ws``, SecurityError) is the redirect it met: REDIRECT, as an HTTP call's."""
    met = exc.__cause__ or exc.__context__
    if not isinstance(exc, InvalidStatus) and isinstance(met, InvalidStatus):
        exc = met
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        if status < 300:
            return ApiError(
                status,
                "NOT_EVENT_STREAM",
                f"the server answered the upgrade with {status}, not 101: is the URL an "
                "Orbit server's?",
            )
        headers = exc.response.headers
        reply = Reply(
            status,
            bytes(exc.response.body),
            headers.get("Location"),
            headers.get("Retry-After"),
        )
        try:
            _unwrap(reply)
        except ApiError as refusal:
            return refusal
    return unreachable(where, timeout, exc, timed_out=isinstance(exc, TimeoutError))


def _socket_options(
    server: SplitResult,
    headers: dict[str, str],
    cafile: str | None,
    timeout: float,
    *,
    threaded: bool,
) -> tuple[str, dict[str, Any]]:
    """Where and how both clients open an event stream's WebSocket (``subscribe``): the
    ``ws(s)://`` base of the server's URL, and the options: the token in the upgrade's
    header, certificates verified as the HTTP calls verify them, no compression (small
    JSON frames), the upgrade given the client's timeout, and websockets' debug log of
    the headers redacted. ``threaded`` for websockets' synchronous connection, which
    reads in a thread while others write: its TLS is ``ThreadSafeTLS``."""
    tls: ssl.SSLContext | ThreadSafeTLS | None = None
    if server.scheme == "https":
        tls = ssl.create_default_context(cafile=cafile)
        if threaded:
            tls = ThreadSafeTLS(tls)
    options = {
        "additional_headers": headers,
        "ssl": tls,
        "open_timeout": timeout,
        "max_size": MAX_FRAME,
        "compression": None,
        "logger": ws_log,
    }
    return socket_base(server), options


class Client:
    """Synchronous client. The token comes from ``token=`` or ORBIT_TOKEN(_FILE)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        cafile: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        server, self._timeout, headers = _checked_setup(url, token, cafile, timeout)
        self._http = Transport(url.rstrip("/"), headers, cafile=cafile, timeout=self._timeout)
        self._where = where(server)
        self._socket_base, self._socket = _socket_options(
            server, headers, cafile, self._timeout, threaded=True
        )

    @property
    def timeout(self) -> float:
        """Seconds a call waits for its answer (the ``timeout`` it was made with)."""
        return self._timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections, the streams being read in other threads too:
        each of their follows (``stream_events``, ``subscribe``, ``artifact_stream``)
        ends with RuntimeError, "the client is closed", and so does a call waiting for
        its answer (a ``get``, a ``wait``), which went on for its whole timeout. One still
        connecting, or a ``subscribe`` still opening its WebSocket, ends so once that
        returns, at most the client's ``timeout`` later."""
        self._http.close()

    def _check_open(self, exc: BaseException | None = None) -> None:
        """RuntimeError if the client was closed: a follow's stream broke because
        ``close`` shut it down, and is not reopened."""
        if self._http.closed:
            raise RuntimeError("the client is closed") from exc

    def _call(self, request: Request, timeout: float | None = None) -> Any:
        method, path, query, body = request
        content = None if body is None else request_json(body)
        return _unwrap(self._http.request(method, path, query, content, timeout))

    # queues
    def queue_create(
        self,
        name: str,
        *,
        max_concurrency: int,
        rate: float,
        burst: int | None = None,
        max_queued: int | None = None,
    ) -> dict[str, Any]:
        """Create a queue; ``max_queued`` caps its waiting tasks (None: no cap)."""
        call = _Calls.queue_create(name, max_concurrency, rate, burst, max_queued)
        return dict(self._call(call))

    def queues(self) -> list[dict[str, Any]]:
        """Every queue (all its pages), in name order."""
        return list(self.iter_queues(limit=FULL_PAGE))

    def list_queues(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """One page of queues, in name order: ``{"items": [...], "next_cursor": ...}``."""
        return dict(self._call(_Calls.queues_list(limit, cursor)))

    def iter_queues(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every queue, page by page, from the start or from ``cursor``."""
        yield from _walk(lambda c: self.list_queues(limit=limit, cursor=c), cursor)

    def queue_pause(self, name: str) -> dict[str, Any]:
        return dict(self._call(_Calls.queue_action(name, "pause")))

    def queue_resume(self, name: str) -> dict[str, Any]:
        return dict(self._call(_Calls.queue_action(name, "resume")))

    def queue_update(
        self,
        name: str,
        *,
        max_concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        max_queued: int | Keep | None = KEEP,
    ) -> dict[str, Any]:
        """Change a queue's caps: only those given (at least one). ``max_queued=None``
        removes the cap on waiting tasks; left out (``"keep"``), it stays as it is."""
        call = _Calls.queue_update(name, max_concurrency, rate, burst, max_queued)
        return dict(self._call(call))

    # schedules
    def schedule_create(
        self,
        name: str,
        *,
        cron: str,
        queue: str,
        handler: str,
        payload: Any = None,
        timezone: str | None = None,
        misfire: Literal["skip", "run_once", "catch_up"] | None = None,
        max_catch_up: int | None = None,
        paused: bool | None = None,
        **template: Any,
    ) -> dict[str, Any]:
        """Submit ``handler`` on ``queue`` with ``payload`` at each instant of ``cron`` (5
        fields) in ``timezone`` (IANA; the server's default UTC). ``misfire`` says what
        fires for instants missed by more than a minute (default ``skip``). ``template``:
        a submit's other options (tenant, priority, retry_safe, max_attempts, backoff,
        attempt_timeout), as ``submit`` takes them."""
        body = task_body(queue, handler, payload, **template)
        call = _Calls.schedule_create(name, cron, body, timezone, misfire, max_catch_up, paused)
        return dict(self._call(call))

    def schedule(self, name: str) -> dict[str, Any]:
        return dict(self._call(_Calls.schedule(name)))

    def schedules(self) -> list[dict[str, Any]]:
        """Every schedule (all its pages), in name order."""
        return list(self.iter_schedules(limit=FULL_PAGE))

    def list_schedules(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """One page of schedules, in name order: ``{"items": [...], "next_cursor": ...}``."""
        return dict(self._call(_Calls.schedules_list(limit, cursor)))

    def iter_schedules(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        yield from _walk(lambda c: self.list_schedules(limit=limit, cursor=c), cursor)

    def schedule_pause(self, name: str) -> dict[str, Any]:
        return dict(self._call(_Calls.schedule_action(name, "pause")))

    def schedule_resume(self, name: str) -> dict[str, Any]:
        """Fire again from the first instant after now."""
        return dict(self._call(_Calls.schedule_action(name, "resume")))

    def schedule_update(
        self,
        name: str,
        *,
        cron: str | None = None,
        timezone: str | None = None,
        template: dict[str, Any] | None = None,
        misfire: Literal["skip", "run_once", "catch_up"] | None = None,
        max_catch_up: int | None = None,
    ) -> dict[str, Any]:
        """Change a schedule: only what is given (at least one). ``template`` replaces
        the whole template: a dict of ``submit``'s arguments (``queue``, ``handler``,
        ``payload``, ``tenant``, ``priority``, ...). A new ``cron`` or ``timezone`` moves
        the next fire to the first instant after now."""
        call = _Calls.schedule_update(name, cron, timezone, template, misfire, max_catch_up)
        return dict(self._call(call))

    def schedule_delete(self, name: str) -> dict[str, Any]:
        """Delete a schedule (its tasks stay); returns it as it was."""
        return dict(self._call(_Calls.schedule_delete(name)))

    # limits
    def tenant_limits(self) -> list[dict[str, Any]]:
        """Every tenant that has a cap of either kind (all the pages), by name:
        ``[{"tenant", "max_concurrency", "max_queued"}]`` (None: no cap of that kind)."""
        return list(self.iter_tenant_limits(limit=FULL_PAGE))

    def list_tenant_limits(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """One page of the tenants that have a cap, by name: ``{"items": [...],
        "next_cursor": ...}``."""
        return dict(self._call(_Calls.tenant_limits_list(limit, cursor)))

    def iter_tenant_limits(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every tenant that has a cap, page by page, from the start or from ``cursor``."""
        yield from _walk(lambda c: self.list_tenant_limits(limit=limit, cursor=c), cursor)

    def tenant_limit(self, tenant: str) -> dict[str, Any]:
        return dict(self._call(_Calls.tenant_limit(tenant, put=False)))

    def tenant_limit_set(
        self,
        tenant: str,
        max_concurrency: int | Keep | None = KEEP,
        *,
        max_queued: int | Keep | None = KEEP,
    ) -> dict[str, Any]:
        """Cap a tenant's live attempts and its waiting tasks in all queues: the caps
        given (at least one); None removes one, ``"keep"`` (left out) keeps it."""
        call = _Calls.tenant_limit(tenant, max_concurrency, max_queued, put=True)
        return dict(self._call(call))

    def global_limit(self) -> dict[str, Any]:
        return dict(self._call(_Calls.global_limit(put=False)))

    def global_limit_set(self, max_concurrency: int | None) -> dict[str, Any]:
        """Cap live attempts across the cluster; None removes the cap."""
        return dict(self._call(_Calls.global_limit(max_concurrency, put=True)))

    # tasks
    def submit(
        self, queue: str, handler: str, payload: Any = None, **options: Any
    ) -> SubmittedTask:
        """Submit a task; returns it (an existing one when the idempotency key matched),
        a dict whose ``created`` attribute says which: False for the existing one.
        ``options``: ``task_body``'s; a duration (``attempt_timeout``, ``backoff``'s
        ``base`` and ``max``) is seconds or a ``timedelta``, an instant (``deadline``,
        ``run_after``) an aware ``datetime`` or RFC 3339 text."""
        body = _submit_body("Client.submit", queue, handler, payload, options)
        reply = self._call(_Calls.submit(body))
        return SubmittedTask(reply["task"], reply["created"])

    @overload
    def submit_many(
        self, tasks: list[dict[str, Any]], *, reply: Literal["full"] = "full"
    ) -> list[SubmittedTask]: ...

    @overload
    def submit_many(
        self, tasks: list[dict[str, Any]], *, reply: Literal["ids"]
    ) -> list[dict[str, Any]]: ...

    def submit_many(
        self, tasks: list[dict[str, Any]], *, reply: BatchReply = "full"
    ) -> list[SubmittedTask] | list[dict[str, Any]]:
        """Submit up to 1000 tasks atomically (each a ``task_body``-shaped dict, its
        durations and instants taken as ``submit`` takes them); returns each task's view in
        order (with ``created``, as ``submit``'s), or with ``reply="ids"`` each ``{"id",
        "created"}``: a tenth of the bytes, and the quickest way to enqueue many."""
        return _Calls.submitted(reply, self._call(_Calls.submit_many(tasks, reply)))

    def get(self, task_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """The task; ``timeout``: this call's, in place of the client's."""
        return dict(self._call(_Calls.task(task_id), timeout))

    def wait(self, task_id: str, timeout: float = 60.0, poll: float = 0.2) -> dict[str, Any]:
        """Block until the task ends (or needs review); raise WaitTimeout after ``timeout``.
        A server that cannot be reached (a restart, a rolling deploy; behind a proxy, its
        own 502, 503 or 504 page) or that fails (500 INTERNAL; 503 DATABASE_BUSY and the
        other DATABASE_* codes, its database busy or away) is asked again until then:
        Unreachable only if it still cannot be reached at the end, the 500 (or the 503,
        ``Unavailable``) if it still fails. A refusal (ApiError, such as NotFound) is
        raised at once.
        No poll waits for its answer past the end (save for ``POLL_TIMEOUT_FLOOR``)."""
        waiting = Waiting(task_id, timeout, poll)
        while True:
            try:
                task = self.get(task_id, timeout=waiting.request_timeout(self._timeout))
            except (Unreachable, ApiError) as exc:
                waiting.failed(exc)
            else:
                if waiting.ended(task):
                    return task
            time.sleep(waiting.pause())

    def result(self, task_id: str, timeout: float = 60.0) -> Any:
        """The task's result; TaskFailed if it ended any other way than succeeded."""
        task = self.wait(task_id, timeout)
        if task["state"] != "succeeded":
            raise TaskFailed(task)
        return task["result"]

    def cancel(self, task_id: str) -> dict[str, Any]:
        return dict(self._call(_Calls.task_action(task_id, "cancel")))

    def retry(self, task_id: str) -> dict[str, Any]:
        return dict(self._call(_Calls.task_action(task_id, "retry")))

    def resolve(
        self,
        task_id: str,
        decision: str,
        *,
        result: Any = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return dict(self._call(_Calls.resolve(task_id, decision, result, error)))

    def list_tasks(
        self,
        *,
        state: str | None = None,
        queue: str | None = None,
        tenant: str | None = None,
        handler: str | None = None,
        parent_id: str | None = None,
        created_after: datetime | str | None = None,
        created_before: datetime | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """One page: ``{"items": [...], "next_cursor": ...}``. ``parent_id``: that task's
        children only; ``created_after`` (inclusive) and ``created_before`` (exclusive):
        aware datetimes or RFC 3339 strings. An empty filter (``queue=""``) is
        BadRequest, not a page of no tasks."""
        call = _Calls.tasks_list(
            limit,
            cursor,
            state=state,
            queue=queue,
            tenant=tenant,
            handler=handler,
            parent_id=parent_id,
            **_window(created_after, created_before),
        )
        return dict(self._call(call))

    def iter_tasks(self, *, cursor: str | None = None, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every matching task, page by page (keyset pagination: no task twice, and
        every one there before the walk began that still matches), from the start or from
        ``cursor`` (a page's ``next_cursor``). A snapshot, not a follow: a task submitted
        during the walk may sort before its cursor and be missed (follow the event log's
        ``submitted`` events for new tasks; docs/protocol.md, "What a reader of a list may
        rely on")."""
        yield from _walk(lambda c: self.list_tasks(cursor=c, **filters), cursor)

    def attempts(self, task_id: str) -> list[dict[str, Any]]:
        """Every attempt of the task (all its pages), in number order."""
        return list(self.iter_attempts(task_id, limit=FULL_PAGE))

    def list_attempts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        """One page of the task's attempts: ``{"items": [...], "next_cursor": ...}``."""
        return dict(self._call(_Calls.attempts_list(task_id, limit, cursor)))

    def iter_attempts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every attempt of the task, page by page, from the start or from ``cursor``.
        Attempts are numbered in the order they commit: asking again later with the cursor
        the last page was asked with (``list_attempts``) gets the attempts made since."""
        yield from _walk(lambda c: self.list_attempts(task_id, limit=limit, cursor=c), cursor)

    def events(
        self,
        task_id: str,
        limit: int = 100,
        cursor: str | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One page of the task's events; ``timeout``: this call's, in place of the
        client's."""
        return dict(self._call(_Calls.events(task_id, limit, cursor), timeout))

    def iter_events(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every event of the task, page by page, from the start or from ``cursor``."""
        yield from _walk(lambda c: self.events(task_id, limit=limit, cursor=c), cursor)

    def event_log(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """One page of the whole event log, in its order (admin): the events of every
        task and of the operators' changes, ``queue.updated`` or ``tenant.updated``."""
        return dict(self._call(_Calls.event_log(limit, cursor)))

    def iter_event_log(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """The whole event log, page by page, from the start or from ``cursor``."""
        yield from _walk(lambda c: self.event_log(limit=limit, cursor=c), cursor)

    def stream_events(
        self, task_id: str | None = None, *, cursor: str | None = None, outage: float = 60.0
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Follow events as they are written: ``(cursor, event)`` for each, in the log's
        order, from ``cursor`` (or the start). With ``task_id``, the task's events (the
        submit scope), and the iteration ends once the task has ended and its events are
        all out; without, the whole log (admin), for as long as the caller iterates.

        A stream that breaks (a restart, another node behind a load balancer, a node at
        its cap of streams, its database busy or away: 500 INTERNAL, 503 DATABASE_*) is
        reopened from the last event's cursor, so no event is missed or given twice; it
        gives up (Unreachable, or the node's 500 or 503, ``Unavailable``) once the server
        has been out of reach for ``outage`` seconds. A refusal (a bad cursor, a
        token refused, an unknown task) is raised at once, and so is a 200 that is no
        event stream (its Content-Type not ``text/event-stream``, or its body's first line
        no SSE field nor comment: a proxy's page, some other server; or an event whose data
        is no JSON object), as an ApiError with code NOT_EVENT_STREAM. A client ``timeout``
        under the server's keep-alive interval (15 s by default) makes a read of an idle
        stream time out: the stream is reopened, and since the server answered it, that
        is no outage. ``close()`` (from any thread) ends the follow: RuntimeError, "the
        client is closed"."""
        following = Following(task_id, cursor, outage)
        while True:
            try:
                with self._http.stream(
                    "GET", following.path, following.headers, live=True
                ) as opened:
                    status, location, content_type, chunks = opened
                    if status >= 300:
                        _unwrap(Reply(status, b"".join(chunks), location, opened.retry_after))
                    following.opened(content_type)
                    for chunk in chunks:
                        yield from following.feed(chunk)
                        if following.ended:
                            return
                self._check_open()
                following.broke(None)
            except (Unreachable, ApiError) as exc:
                self._check_open(exc)
                following.broke(exc)
            time.sleep(following.pause())

    def subscribe(
        self, task_id: str | None = None, *, cursor: str | None = None, outage: float = 60.0
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``stream_events`` over WebSocket (``/v1/events/ws``, ``/v1/tasks/{id}/events/
        ws``): the same ``(cursor, event)`` in the same order, the same end of a task's
        stream, the same reconnect from the last cursor within ``outage``, and the same
        refusals, raised at once. A 2xx answer to the upgrade (no Orbit server's) is an
        ApiError with code NOT_EVENT_STREAM. As there, a client ``timeout`` under the
        server's keep-alive interval reopens an idle stream, which is no outage, and
        ``close()`` ends the follow."""
        following = Subscription(task_id, cursor, outage)
        while True:
            try:
                try:
                    conn = ws_open(following.url(self._socket_base), **self._socket)
                except (OSError, InvalidHandshake, InvalidURI) as exc:  # TimeoutError is an OSError
                    raise _upgrade_failed(exc, self._where, self._timeout) from exc
                following.reached()
                # aborted, not closed, when given up on; shut down by close()
                with held(conn), self._http.held(conn.socket):
                    while True:
                        try:
                            data = conn.recv(timeout=self._timeout)
                        except ConnectionClosed as exc:
                            raise closed(exc, self._where) from exc
                        except TimeoutError as exc:
                            raise unreachable(
                                self._where, self._timeout, exc, timed_out=True
                            ) from exc
                        item = following.frame(data)
                        if item is not None:
                            yield item
                        if following.ended:
                            return
            except (Unreachable, ApiError) as exc:
                self._check_open(exc)
                following.broke(exc)
            time.sleep(following.pause())

    # workers and tokens
    def workers(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every worker session (all its pages), oldest first; ``state="live"`` leaves out
        the expired ones, which are never deleted."""
        return list(self.iter_workers(state=state, limit=FULL_PAGE))

    def list_workers(
        self, *, state: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        """One page of worker sessions: ``{"items": [...], "next_cursor": ...}``."""
        return dict(self._call(_Calls.workers_list(state, limit, cursor)))

    def iter_workers(
        self, *, cursor: str | None = None, **filters: Any
    ) -> Iterator[dict[str, Any]]:
        """Every matching worker session, page by page (keyset, as ``iter_tasks``), from
        the start or from ``cursor`` (a page's ``next_cursor``)."""
        yield from _walk(lambda c: self.list_workers(cursor=c, **filters), cursor)

    def worker_drain(self, session_id: str) -> dict[str, Any]:
        return dict(self._call(_Calls.worker_drain(session_id)))

    def list_artifacts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        """One page of the task's artifacts: ``{"items": [...], "next_cursor": ...}``."""
        return dict(self._call(_Calls.artifacts_list(task_id, limit, cursor)))

    def iter_artifacts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every artifact of the task, page by page, from the start or from ``cursor``,
        in the order the uploads were committed: asking again later with the cursor the
        last page was asked with (``list_artifacts``) gets the artifacts committed since,
        none passed over."""
        yield from _walk(lambda c: self.list_artifacts(task_id, limit=limit, cursor=c), cursor)

    def artifacts(self, task_id: str) -> list[dict[str, Any]]:
        """Every artifact of the task (all its pages; ``list_artifacts`` reads one)."""
        return list(self.iter_artifacts(task_id))

    def artifact_content(self, artifact_id: str) -> bytes:
        """An artifact's bytes, all in memory (``artifact_stream`` holds one chunk at a
        time). Read as ``artifact_stream`` reads them, as AsyncClient's is: the client's
        timeout bounds the answer's head and then each read of the body, not the whole
        download, which a large artifact on a slow link could never finish within it."""
        return b"".join(self.artifact_stream(artifact_id))

    def artifact_stream(self, artifact_id: str) -> Iterator[bytes]:
        """An artifact's bytes as they arrive, without holding them all."""
        path = f"/v1/artifacts/{_seg(artifact_id, 'artifact_id')}/content"
        with self._http.stream("GET", path) as opened:
            status, location, _, chunks = opened
            if status >= 300:
                _unwrap(Reply(status, b"".join(chunks), location, opened.retry_after))
            yield from chunks

    def token_create(self, name: str, scopes: list[str]) -> dict[str, Any]:
        return dict(self._call(_Calls.token_create(name, scopes)))

    def token_list(self) -> list[dict[str, Any]]:
        """Every token (all its pages), oldest first, revoked ones too (never a secret):
        id, name, scopes, instants."""
        return list(self.iter_tokens(limit=FULL_PAGE))

    def list_tokens(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """One page of tokens, oldest first: ``{"items": [...], "next_cursor": ...}``."""
        return dict(self._call(_Calls.tokens_list(limit, cursor)))

    def iter_tokens(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every token, page by page, from the start or from ``cursor``."""
        yield from _walk(lambda c: self.list_tokens(limit=limit, cursor=c), cursor)

    def token_revoke(self, token_id: str) -> dict[str, Any]:
        """Refuse the token from now on (each node within its token cache's 10 s)."""
        return dict(self._call(_Calls.token_revoke(token_id)))


class _Trace:
    """What httpcore tells of one request (httpx's ``trace`` extension): whether it
    opened a connection (if not, it went out on a kept-alive one) and whether the
    answer's head came. ``sent_again`` is asked only of a request that opened none and
    had no answer. It cannot tell a close before any byte of the answer from one part way
    through its head: httpcore raises the same "Server disconnected without sending a
    response" for both, and tells no trace of the bytes read. Such a GET is sent once
    more too (Client's http.client sees the bytes, and does not): a GET changes nothing."""

    __slots__ = ("answered", "connected")

    def __init__(self) -> None:
        self.connected = False
        self.answered = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.startswith("connection.connect_"):
            self.connected = True
        elif event == "http11.receive_response_headers.complete":
            self.answered = True


async def _refused(reply: httpx.Response) -> None:
    """A streamed reply that is not a 2xx raised as ``_unwrap`` raises it, its body read
    raw (as the stream would have been); a 2xx is left to read."""
    if reply.status_code >= 300:
        body = b"".join([chunk async for chunk in reply.aiter_raw()])
        headers = reply.headers
        _unwrap(Reply(reply.status_code, body, headers.get("location"), headers.get("retry-after")))


class AsyncClient:
    """The same calls for asyncio code."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        cafile: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        server, self._timeout, headers = _checked_setup(url, token, cafile, timeout)
        self._where = where(server)
        self._socket_base, self._socket = _socket_options(
            server, headers, cafile, self._timeout, threaded=False
        )
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers=headers,
            # The system's CAs (or cafile's), as Client and the worker's connection trust:
            # httpx's verify=True trusts certifi's bundle instead.
            verify=ssl.create_default_context(cafile=cafile),
            timeout=self._timeout,
            # No cap on connections, as Client has none: each follow (``stream_events``)
            # and ``artifact_stream`` holds one for as long as it is read, and with
            # httpx's default cap (100) a hundred follows left every other call waiting
            # for a connection until it timed out (Unreachable, "no answer"). httpx's
            # other defaults, and idle connections closed before a server's idle timeout
            # can meet a request on them: httpx's own expiry (5 s) is uvicorn's.
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=20,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
        )
        self._closed = False
        #: the WebSockets of the follows being read (``subscribe``), aborted by ``aclose``
        self._sockets: set[AsyncConnection] = set()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    @property
    def timeout(self) -> float:
        """Seconds a call waits for its answer (the ``timeout`` it was made with)."""
        return self._timeout

    async def aclose(self) -> None:
        """Close the client's connections, and end the follows being read in other tasks
        (``stream_events``, ``subscribe``, ``artifact_stream``): each raises RuntimeError,
        "the client is closed", as does one started (or reconnecting) after. As
        ``Client.close``: ``subscribe``'s WebSocket, which httpx does not hold, is
        aborted here, where it went on yielding, and one opened after was served."""
        self._closed = True
        sockets, self._sockets = self._sockets, set()
        for conn in sockets:
            conn.transport.abort()
        await self._http.aclose()

    def _check_open(self, exc: BaseException | None = None) -> None:
        """RuntimeError if the client was closed (``aclose``): a follow's stream broke
        because it was shut down, and is not reopened."""
        if self._closed:
            raise RuntimeError("the client is closed") from exc

    @contextlib.contextmanager
    def _holding(self, conn: AsyncConnection) -> Iterator[None]:
        """``conn`` (a follow's WebSocket) aborted by ``aclose`` while the block runs;
        RuntimeError if the client is closed already (the caller's ``aheld`` aborts it)."""
        self._check_open()
        self._sockets.add(conn)
        try:
            yield
        finally:
            self._sockets.discard(conn)

    async def _stream(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """A streamed GET (a follow's, an artifact's), its body read raw, or RuntimeError
        ("the client is closed") after ``aclose``, where httpx said "Cannot send a
        request, as the client has been closed"."""
        self._check_open()
        try:
            return await self._send("GET", path, None, None, raw=True, headers=headers)
        except RuntimeError as exc:
            self._check_open(exc)
            raise

    async def _call(self, request: Request, timeout: float | None = None) -> Any:
        """One call, its request sent and its whole answer read within ``timeout`` (the
        client's if None), as Client's: httpx gives each read of the socket the timeout,
        and a server that sent a byte every 0.3 s kept a call with a 2 s timeout waiting
        for ever. Unreachable, "no answer … within …", when it runs out."""
        method, path, query, body = request
        content = None if body is None else request_json(body)
        timeout = self._timeout if timeout is None else checked_timeout(timeout)
        # After aclose, and for a call it cut short, "the client is closed", as Client
        # says: httpx's "Cannot send a request, as the client has been closed", or an
        # Unreachable (ReadError) for a call in flight, said nothing of the sort.
        self._check_open()
        try:
            return await self._answer(method, path, query, content, timeout)
        except (Unreachable, RuntimeError) as exc:
            self._check_open(exc)
            raise

    async def _answer(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None,
        content: bytes | None,
        timeout: float,
    ) -> Any:
        """``_call``'s request sent and its whole answer read within ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                reply = await self._send(method, path, query, content, timeout=timeout)
                try:
                    await reply.aread()
                except httpx.DecodingError:
                    # A body labelled with a coding it is not in (gzip, from a proxy): no
                    # JSON, as Client, which asks for no coding and reads the bytes as they
                    # came, finds it. httpx's DecodingError came out as it was, neither
                    # ApiError nor Unreachable.
                    return _unwrap(Reply(reply.status_code, b"", reply.headers.get("location")))
                except httpx.TransportError as exc:  # the body cut off
                    raise self._unreachable(exc, timeout) from exc
                finally:
                    await reply.aclose()
        except TimeoutError as exc:
            raise unreachable(self._where, timeout, exc, timed_out=True) from exc
        return _unwrap(reply)

    async def _send(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None,
        content: bytes | None,
        *,
        timeout: float | None = None,
        raw: bool = False,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One request, as Client sends it: a transport error raised as Unreachable, and
        a GET that met a kept-alive connection's close sent once more (``sent_again``).
        ``timeout``: this request's, in place of the client's (None). The body is left to
        read, and the reply to close, to the caller. ``raw``: the body is asked for with
        no content coding (``identity``), as Client asks for every one. ``headers``: sent
        besides the client's. The request is sent and the answer's head read within
        ``timeout`` as a whole (both sends, if sent again), not per read: a stream's
        body, read by its caller, waits per read."""
        timeout = self._timeout if timeout is None else checked_timeout(timeout)
        sent = {**(headers or {})}
        if content is not None:
            sent["Content-Type"] = "application/json"
        if raw:
            sent["Accept-Encoding"] = "identity"
        trace = _Trace()
        request = self._http.build_request(
            method,
            path,
            params=query,
            content=content,
            headers=sent,
            timeout=timeout,
            extensions={"trace": trace},
        )
        try:
            async with asyncio.timeout(timeout):
                try:
                    return await self._http.send(request, stream=True)
                except httpx.TransportError as exc:
                    if trace.answered or not sent_again(method, not trace.connected, exc):
                        raise self._unreachable(exc, timeout) from exc
                try:
                    return await self._http.send(request, stream=True)
                except httpx.TransportError as exc:
                    raise self._unreachable(exc, timeout) from exc
        except TimeoutError as exc:
            raise unreachable(self._where, timeout, exc, timed_out=True) from exc

    def _unreachable(self, exc: httpx.TransportError, timeout: float) -> Unreachable:
        """As Client raises it: the server's host and port, and the time waited (httpx's
        own message named neither; a timeout's was empty)."""
        timed_out = isinstance(exc, httpx.TimeoutException)
        return unreachable(self._where, timeout, exc, timed_out=timed_out)

    async def queue_create(
        self,
        name: str,
        *,
        max_concurrency: int,
        rate: float,
        burst: int | None = None,
        max_queued: int | None = None,
    ) -> dict[str, Any]:
        """Create a queue; ``max_queued`` caps its waiting tasks (None: no cap)."""
        call = _Calls.queue_create(name, max_concurrency, rate, burst, max_queued)
        return dict(await self._call(call))

    async def queues(self) -> list[dict[str, Any]]:
        return [q async for q in self.iter_queues(limit=FULL_PAGE)]

    async def list_queues(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        return dict(await self._call(_Calls.queues_list(limit, cursor)))

    async def iter_queues(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.list_queues(limit=limit, cursor=c), cursor):
            yield item

    async def queue_pause(self, name: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.queue_action(name, "pause")))

    async def queue_resume(self, name: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.queue_action(name, "resume")))

    async def queue_update(
        self,
        name: str,
        *,
        max_concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        max_queued: int | Keep | None = KEEP,
    ) -> dict[str, Any]:
        """Change a queue's caps: only those given (at least one). ``max_queued=None``
        removes the cap on waiting tasks; left out (``"keep"``), it stays as it is."""
        call = _Calls.queue_update(name, max_concurrency, rate, burst, max_queued)
        return dict(await self._call(call))

    async def schedule_create(
        self,
        name: str,
        *,
        cron: str,
        queue: str,
        handler: str,
        payload: Any = None,
        timezone: str | None = None,
        misfire: Literal["skip", "run_once", "catch_up"] | None = None,
        max_catch_up: int | None = None,
        paused: bool | None = None,
        **template: Any,
    ) -> dict[str, Any]:
        """As ``Client.schedule_create``."""
        body = task_body(queue, handler, payload, **template)
        call = _Calls.schedule_create(name, cron, body, timezone, misfire, max_catch_up, paused)
        return dict(await self._call(call))

    async def schedule(self, name: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.schedule(name)))

    async def schedules(self) -> list[dict[str, Any]]:
        return [s async for s in self.iter_schedules(limit=FULL_PAGE)]

    async def list_schedules(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.schedules_list(limit, cursor)))

    async def iter_schedules(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.list_schedules(limit=limit, cursor=c), cursor):
            yield item

    async def schedule_pause(self, name: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.schedule_action(name, "pause")))

    async def schedule_resume(self, name: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.schedule_action(name, "resume")))

    async def schedule_update(
        self,
        name: str,
        *,
        cron: str | None = None,
        timezone: str | None = None,
        template: dict[str, Any] | None = None,
        misfire: Literal["skip", "run_once", "catch_up"] | None = None,
        max_catch_up: int | None = None,
    ) -> dict[str, Any]:
        """Change a schedule: only what is given (at least one). ``template`` replaces
        the whole template: a dict of ``submit``'s arguments (``queue``, ``handler``,
        ``payload``, ``tenant``, ``priority``, ...). A new ``cron`` or ``timezone`` moves
        the next fire to the first instant after now."""
        call = _Calls.schedule_update(name, cron, timezone, template, misfire, max_catch_up)
        return dict(await self._call(call))

    async def schedule_delete(self, name: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.schedule_delete(name)))

    async def tenant_limits(self) -> list[dict[str, Any]]:
        """Every tenant that has a cap of either kind (all the pages), by name:
        ``[{"tenant", "max_concurrency", "max_queued"}]`` (None: no cap of that kind)."""
        return [t async for t in self.iter_tenant_limits(limit=FULL_PAGE)]

    async def list_tenant_limits(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.tenant_limits_list(limit, cursor)))

    async def iter_tenant_limits(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.list_tenant_limits(limit=limit, cursor=c), cursor):
            yield item

    async def tenant_limit(self, tenant: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.tenant_limit(tenant, put=False)))

    async def tenant_limit_set(
        self,
        tenant: str,
        max_concurrency: int | Keep | None = KEEP,
        *,
        max_queued: int | Keep | None = KEEP,
    ) -> dict[str, Any]:
        """Cap a tenant's live attempts and its waiting tasks in all queues: the caps
        given (at least one); None removes one, ``"keep"`` (left out) keeps it."""
        call = _Calls.tenant_limit(tenant, max_concurrency, max_queued, put=True)
        return dict(await self._call(call))

    async def global_limit(self) -> dict[str, Any]:
        return dict(await self._call(_Calls.global_limit(put=False)))

    async def global_limit_set(self, max_concurrency: int | None) -> dict[str, Any]:
        """Cap live attempts across the cluster; None removes the cap."""
        return dict(await self._call(_Calls.global_limit(max_concurrency, put=True)))

    async def attempts(self, task_id: str) -> list[dict[str, Any]]:
        return [a async for a in self.iter_attempts(task_id, limit=FULL_PAGE)]

    async def list_attempts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.attempts_list(task_id, limit, cursor)))

    async def iter_attempts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(
            lambda c: self.list_attempts(task_id, limit=limit, cursor=c), cursor
        ):
            yield item

    async def events(
        self,
        task_id: str,
        limit: int = 100,
        cursor: str | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.events(task_id, limit, cursor), timeout))

    async def iter_events(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.events(task_id, limit=limit, cursor=c), cursor):
            yield item

    async def event_log(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        return dict(await self._call(_Calls.event_log(limit, cursor)))

    async def iter_event_log(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.event_log(limit=limit, cursor=c), cursor):
            yield item

    async def stream_events(
        self, task_id: str | None = None, *, cursor: str | None = None, outage: float = 60.0
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """As ``Client.stream_events``. Close the iterator when done with it before its
        end (``contextlib.aclosing``), so that its connection closes at once. Each open
        follow holds a connection of its own; the client opens as many as its calls and
        follows need at once (no cap, as Client), so follows never hold up other calls.
        ``aclose()`` ends it: RuntimeError, "the client is closed"."""
        following = Following(task_id, cursor, outage)
        while True:
            try:
                reply = await self._stream(following.path, following.headers)
                try:
                    await _refused(reply)
                    following.opened(reply.headers.get("content-type"))
                    async for chunk in reply.aiter_raw():
                        for item in following.feed(chunk):
                            yield item
                        if following.ended:
                            return
                except httpx.TransportError as exc:  # as Client raises it
                    self._check_open(exc)
                    raise self._unreachable(exc, self._timeout) from exc
                finally:
                    await reply.aclose()
                self._check_open()
                following.broke(None)
            except (Unreachable, ApiError) as exc:
                self._check_open(exc)
                following.broke(exc)
            await asyncio.sleep(following.pause())

    async def subscribe(
        self, task_id: str | None = None, *, cursor: str | None = None, outage: float = 60.0
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """As ``Client.subscribe``. Close the iterator when done with it before its end
        (``contextlib.aclosing``), so that its connection closes at once. ``aclose()``
        ends it: RuntimeError, "the client is closed"."""
        following = Subscription(task_id, cursor, outage)
        while True:
            try:
                self._check_open()
                try:
                    conn = await ws_open_async(following.url(self._socket_base), **self._socket)
                except (OSError, InvalidHandshake, InvalidURI) as exc:
                    raise _upgrade_failed(exc, self._where, self._timeout) from exc
                following.reached()
                # aborted, not closed, when given up on; aborted by aclose()
                async with aheld(conn):
                    with self._holding(conn):
                        while True:
                            try:
                                async with asyncio.timeout(self._timeout):
                                    data = await conn.recv()
                            except ConnectionClosed as exc:
                                raise closed(exc, self._where) from exc
                            except TimeoutError as exc:
                                raise unreachable(
                                    self._where, self._timeout, exc, timed_out=True
                                ) from exc
                            item = following.frame(data)
                            if item is not None:
                                yield item
                            if following.ended:
                                return
            except (Unreachable, ApiError) as exc:
                self._check_open(exc)
                following.broke(exc)
            await asyncio.sleep(following.pause())

    async def list_artifacts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.artifacts_list(task_id, limit, cursor)))

    async def iter_artifacts(
        self, task_id: str, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(
            lambda c: self.list_artifacts(task_id, limit=limit, cursor=c), cursor
        ):
            yield item

    async def artifacts(self, task_id: str) -> list[dict[str, Any]]:
        return [item async for item in self.iter_artifacts(task_id)]

    async def artifact_content(self, artifact_id: str) -> bytes:
        """An artifact's bytes (use ``artifact_stream`` for large ones)."""
        chunks = [chunk async for chunk in self.artifact_stream(artifact_id)]
        return b"".join(chunks)

    async def artifact_stream(self, artifact_id: str) -> AsyncIterator[bytes]:
        """An artifact's bytes as they arrive, without holding them all: the bytes the
        server sent, as Client reads them. Asked for with no content coding and read raw:
        a body a proxy labelled gzip that was not raised httpx's DecodingError, unwrapped,
        where Client returned the bytes."""
        path = f"/v1/artifacts/{_seg(artifact_id, 'artifact_id')}/content"
        reply = await self._stream(path)
        try:
            await _refused(reply)
            async for chunk in reply.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:  # as Client raises it
            self._check_open(exc)
            raise self._unreachable(exc, self._timeout) from exc
        finally:
            await reply.aclose()

    async def token_create(self, name: str, scopes: list[str]) -> dict[str, Any]:
        return dict(await self._call(_Calls.token_create(name, scopes)))

    async def token_list(self) -> list[dict[str, Any]]:
        return [t async for t in self.iter_tokens(limit=FULL_PAGE)]

    async def list_tokens(self, *, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        return dict(await self._call(_Calls.tokens_list(limit, cursor)))

    async def iter_tokens(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.list_tokens(limit=limit, cursor=c), cursor):
            yield item

    async def token_revoke(self, token_id: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.token_revoke(token_id)))

    async def submit(
        self, queue: str, handler: str, payload: Any = None, **options: Any
    ) -> SubmittedTask:
        """As ``Client.submit``: a duration is seconds or a ``timedelta``."""
        body = _submit_body("AsyncClient.submit", queue, handler, payload, options)
        reply = await self._call(_Calls.submit(body))
        return SubmittedTask(reply["task"], reply["created"])

    @overload
    async def submit_many(
        self, tasks: list[dict[str, Any]], *, reply: Literal["full"] = "full"
    ) -> list[SubmittedTask]: ...

    @overload
    async def submit_many(
        self, tasks: list[dict[str, Any]], *, reply: Literal["ids"]
    ) -> list[dict[str, Any]]: ...

    async def submit_many(
        self, tasks: list[dict[str, Any]], *, reply: BatchReply = "full"
    ) -> list[SubmittedTask] | list[dict[str, Any]]:
        """As ``Client.submit_many``: ``reply="full"`` gives each ``SubmittedTask``."""
        return _Calls.submitted(reply, await self._call(_Calls.submit_many(tasks, reply)))

    async def get(self, task_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        return dict(await self._call(_Calls.task(task_id), timeout))

    async def wait(self, task_id: str, timeout: float = 60.0, poll: float = 0.2) -> dict[str, Any]:
        """As ``Client.wait``."""
        waiting = Waiting(task_id, timeout, poll)
        while True:
            try:
                task = await self.get(task_id, timeout=waiting.request_timeout(self._timeout))
            except (Unreachable, ApiError) as exc:
                waiting.failed(exc)
            else:
                if waiting.ended(task):
                    return task
            await asyncio.sleep(waiting.pause())

    async def result(self, task_id: str, timeout: float = 60.0) -> Any:
        task = await self.wait(task_id, timeout)
        if task["state"] != "succeeded":
            raise TaskFailed(task)
        return task["result"]

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.task_action(task_id, "cancel")))

    async def retry(self, task_id: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.task_action(task_id, "retry")))

    async def resolve(
        self,
        task_id: str,
        decision: str,
        *,
        result: Any = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.resolve(task_id, decision, result, error)))

    async def list_tasks(
        self,
        *,
        state: str | None = None,
        queue: str | None = None,
        tenant: str | None = None,
        handler: str | None = None,
        parent_id: str | None = None,
        created_after: datetime | str | None = None,
        created_before: datetime | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        call = _Calls.tasks_list(
            limit,
            cursor,
            state=state,
            queue=queue,
            tenant=tenant,
            handler=handler,
            parent_id=parent_id,
            **_window(created_after, created_before),
        )
        return dict(await self._call(call))

    async def iter_tasks(
        self, *, cursor: str | None = None, **filters: Any
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.list_tasks(cursor=c, **filters), cursor):
            yield item

    async def workers(self, state: str | None = None) -> list[dict[str, Any]]:
        return [w async for w in self.iter_workers(state=state, limit=FULL_PAGE)]

    async def list_workers(
        self, *, state: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        return dict(await self._call(_Calls.workers_list(state, limit, cursor)))

    async def iter_workers(
        self, *, cursor: str | None = None, **filters: Any
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in _awalk(lambda c: self.list_workers(cursor=c, **filters), cursor):
            yield item

    async def worker_drain(self, session_id: str) -> dict[str, Any]:
        return dict(await self._call(_Calls.worker_drain(session_id)))
