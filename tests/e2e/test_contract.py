"""The contract surface (DESIGN §3): everything a client or worker sends is decoded strictly.

Each rejection class is thrown at ``POST /v1/tasks``, ``POST /v1/queues`` and the worker
WebSocket of a real ``orbit server`` (one per backend for the whole module). Every refusal
must carry its machine-readable code (HTTP 400 ``{"error": {...}}``, or a WebSocket
``error`` echoing the ``req_id`` when one can be read), leave the connection usable, and
change nothing: the task list and the event log (and the workers, or the queues, where a
message could touch them) are compared before and after. Two Hypothesis tests then mutate
valid messages at random and check the same promises on both surfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from orbit.protocol.decode import DecodeError, decode_json, decode_model
from orbit.protocol.messages import WORKER_REQUESTS, QueueCreate, TaskBatch, TaskSubmit
from orbit.worker import ServerError, WorkerConnection
from tests.e2e.servers import Node, Tokens, database, make_tokens, start_server

T = TypeVar("T")
REPLY_TIMEOUT = 15.0
# Nothing may move by the clock while a test compares state: leases and sessions outlive
# the module, so the reaper has nothing to do and "no change" means no change.
SERVER_ARGS = ["--claim-ttl", "3600", "--lease-ttl", "3600", "--session-ttl", "3600"]
FUZZ_EXAMPLES = 60
EVENT_PAGE = 100
_ids = itertools.count(1)


def uid() -> str:
    return f"{next(_ids)}x{uuid.uuid4().hex[:6]}"


# ----------------------------------------------------------------------------- state


@dataclass
class State:
    tasks: dict[str, dict[str, Any]]
    events: list[dict[str, Any]]
    workers: dict[str, dict[str, Any]] | None
    queues: dict[str, dict[str, Any]] | None

    def new_events(self, before: State) -> list[dict[str, Any]]:
        assert self.events[: len(before.events)] == before.events, "the event log was rewritten"
        return self.events[len(before.events) :]


class Watch:
    """Reads what a message could change. The task list is read whole; the event log is
    append-only, so its full pages are kept and only the tail is read again (with the
    cursors the server issued)."""

    def __init__(self, admin: httpx.Client) -> None:
        self.admin = admin
        self.full: list[dict[str, Any]] = []
        self.cursor: str | None = None

    def _get(self, path: str, **params: Any) -> Any:
        r = self.admin.get(path, params=params)
        assert r.status_code == 200, f"GET {path}: {r.status_code} {r.text[:300]}"
        return r.json()

    def _every(self, path: str, key: str, **params: Any) -> dict[str, dict[str, Any]]:
        """Every item of a paged list, page by page (a page holds at most 1,000), by key."""
        found: dict[str, dict[str, Any]] = {}
        cursor = None
        while True:
            page = self._get(path, limit=1000, **params, **({"cursor": cursor} if cursor else {}))
            found.update((item[key], item) for item in page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                return found

    def workers(self) -> dict[str, dict[str, Any]]:
        return self._every("/v1/workers", "session_id")

    def events(self) -> list[dict[str, Any]]:
        while True:
            params: dict[str, Any] = {"limit": EVENT_PAGE}
            if self.cursor is not None:
                params["cursor"] = self.cursor
            page = self._get("/v1/events", **params)
            if not page["next_cursor"]:
                return self.full + page["items"]
            self.full += page["items"]
            self.cursor = page["next_cursor"]

    def tasks(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor is not None:
                params["cursor"] = cursor
            page = self._get("/v1/tasks", **params)
            out |= {t["id"]: t for t in page["items"]}
            cursor = page["next_cursor"]
            if not cursor:
                return out

    def snapshot(self, *, workers: bool = False, queues: bool = False) -> State:
        return State(
            tasks=self.tasks(),
            events=self.events(),
            workers=self.workers() if workers else None,
            queues=self._every("/v1/queues", "name") if queues else None,
        )


def changed(before: dict[str, Any] | None, after: dict[str, Any] | None) -> set[str]:
    before, after = before or {}, after or {}
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def assert_unchanged(before: State, after: State) -> None:
    problems = []
    if ids := changed(before.tasks, after.tasks):
        problems.append(f"tasks changed: {sorted(ids)[:5]}")
    if after.events != before.events:
        new = after.events[len(before.events) :]
        problems.append(f"events written: {[(e['kind'], e['code']) for e in new][:5]}")
    if ids := changed(before.workers, after.workers):
        problems.append(f"workers changed: {sorted(ids)[:5]}")
    if names := changed(before.queues, after.queues):
        problems.append(f"queues changed: {sorted(names)[:5]}")
    assert not problems, "a refused message changed state: " + "; ".join(problems)


def assert_error_body(r: httpx.Response) -> dict[str, Any]:
    """The one refusal shape: ``{"error": {"code", "message", "field"?}}``."""
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"{r.status_code} body is not JSON: {r.text[:200]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict), err
    assert {"code", "message"} <= set(err) <= {"code", "message", "field"}, err
    assert isinstance(err["code"], str) and err["code"], err
    assert isinstance(err["message"], str), err
    assert err.get("field") is None or isinstance(err["field"], str), err
    return err


def assert_ws_error(reply: dict[str, Any]) -> None:
    assert reply.get("type") != "closed", "the server dropped the connection without an error"
    assert reply.get("type") == "error", reply
    assert isinstance(reply.get("code"), str) and reply["code"], reply
    assert isinstance(reply.get("message"), str), reply


# ----------------------------------------------------------------------------- harness


class LoopThread:
    """One event loop on a thread, so that a WebSocket outlives one ``asyncio.run``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Env:
    backend: str
    node: Node
    tokens: Tokens
    admin: httpx.Client
    watch: Watch
    loop: LoopThread
    queue_http: str  # paused: nothing submitted over HTTP here is ever claimed
    queue_ws: str  # the targeted WebSocket cases claim from here (one handler per case)


@contextlib.contextmanager
def launch(backend: str, work: Path) -> Iterator[Env]:
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(database(backend, work, "orbit_contract"))
        tokens = make_tokens(url)
        node = start_server(url, work, args=SERVER_ARGS)
        stack.callback(node.stop)
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        admin = stack.enter_context(httpx.Client(base_url=node.http, timeout=30, headers=headers))
        loop = LoopThread()
        stack.callback(loop.close)
        for name in ("c-http", "c-ws"):
            body = {"name": name, "max_concurrency": 100_000, "rate": 0}
            assert admin.post("/v1/queues", json=body).status_code == 201
        assert admin.post("/v1/queues/c-http/pause").status_code == 200
        yield Env(backend, node, tokens, admin, Watch(admin), loop, "c-http", "c-ws")


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One server per backend for the whole module (starting one costs seconds)."""
    backend = str(request.param)
    with launch(backend, tmp_path_factory.mktemp(f"contract-{backend}")) as e:
        yield e


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A server for bugs that leave the task list unreadable: each test there reads only
    its own queue."""
    with launch("sqlite", tmp_path_factory.mktemp("contract-scratch")) as e:
        yield e


class Wire:
    """A worker connection driven from the test thread. ``raw`` returns the next frame the
    server sends: replies to malformed frames are not routed by ``req_id``."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.conn = env.loop.run(WorkerConnection.connect(env.node.ws, env.tokens.worker))
        self.session_id: str | None = None

    def raw(self, frame: str | bytes) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            await self.conn.send_raw(frame)
            return await self.conn.next_push(REPLY_TIMEOUT)

        return self.env.loop.run(go())

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """A well-formed request; its reply, an ``error`` reply included."""

        async def go() -> dict[str, Any]:
            try:
                return await self.conn.request(message, REPLY_TIMEOUT)
            except ServerError as exc:
                return exc.reply

        return self.env.loop.run(go())

    def hello(self, handler: str, capacity: int = 4) -> None:
        reply = self.call(
            {"type": "hello", "name": "w", "max_concurrency": capacity, "push": False,
             "capabilities": [{"handler": handler, "capacity": capacity}]}
        )  # fmt: skip
        assert reply["type"] == "welcome", reply
        self.session_id = reply["session_id"]

    def claim(self) -> list[dict[str, Any]]:
        reply = self.call({"type": "claim", "n": 1})
        assert reply["type"] == "tasks", reply
        return list(reply["tasks"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.env.loop.run(self.conn.close(), timeout=10)


def submit(env: Env, queue: str, handler: str) -> str:
    body = {"queue": queue, "handler": handler, "max_attempts": 1, "payload": {"n": 1}}
    r = env.admin.post("/v1/tasks", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["task"]["id"])


def fill(template: str | bytes, values: dict[str, str]) -> bytes:
    data = template.encode() if isinstance(template, str) else template
    for key, value in values.items():
        data = data.replace(key.encode(), value.encode())
    return data


# ----------------------------------------------------------------------------- HTTP cases


def task(rest: str = "") -> str:
    return '{"queue":"@Q","handler":"h"' + rest + "}"


def queue(rest: str) -> str:
    return '{"name":"q@N"' + rest + "}"


def h(ident: str, route: str, body: str | bytes, code: str, where: str | None = None,
      marks: Any = ()) -> Any:  # fmt: skip
    return pytest.param(route, body, code, where, id=ident, marks=marks)


# fmt: off
HTTP_CASES = [
    h("dup-key", "tasks", task(',"handler":"h"'), "DUPLICATE_KEY", "handler"),
    h("dup-key-deep-in-payload", "tasks", task(',"payload":{"a":1,"b":{"c":1,"c":1}}'),
      "DUPLICATE_KEY", "c"),
    h("queue-dup-key", "queues", queue(',"max_concurrency":1,"rate":0,"rate":1'),
      "DUPLICATE_KEY", "rate"),
    h("utf8-latin1-byte", "tasks", b'{"queue":"@Q","handler":"h","payload":"caf\xe9"}',
      "INVALID_UTF8"),
    h("utf8-encoded-surrogate", "tasks", b'{"queue":"@Q","handler":"h","payload":"\xed\xa0\x80"}',
      "INVALID_UTF8"),
    h("utf8-overlong", "tasks", b'{"queue":"@Q","handler":"h","payload":"\xc0\xaf"}',
      "INVALID_UTF8"),
    h("queue-utf8-in-name", "queues", b'{"name":"q\xff@N","max_concurrency":1,"rate":0}',
      "INVALID_UTF8"),
    h("surrogate-high", "tasks", task(r',"payload":"\ud800"'), "LONE_SURROGATE", "payload"),
    h("surrogate-low-nested", "tasks", task(r',"payload":{"k":["ok","x\udfff"]}'),
      "LONE_SURROGATE", "payload.k[1]"),
    h("surrogate-pair-reversed", "tasks", task(r',"payload":"\udc00\ud800"'), "LONE_SURROGATE"),
    h("surrogate-in-key", "tasks", task(r',"payload":{"\ud800":1}'), "LONE_SURROGATE"),
    h("surrogate-in-field", "tasks", r'{"queue":"@Q","handler":"h\udbff"}', "LONE_SURROGATE",
      "handler"),
    h("int-2^64", "tasks", task(',"priority":18446744073709551616'), "NUMBER_OUT_OF_RANGE"),
    h("int-2^63-in-payload", "tasks", task(',"payload":{"n":9223372036854775808}'),
      "NUMBER_OUT_OF_RANGE"),
    h("int-below-min", "tasks", task(',"payload":[-9223372036854775809]'), "NUMBER_OUT_OF_RANGE"),
    h("float-overflow", "tasks", task(',"payload":1e400'), "NUMBER_OUT_OF_RANGE"),
    h("priority-over-max", "tasks", task(',"priority":1000001'), "NUMBER_OUT_OF_RANGE",
      "priority"),
    h("max-attempts-zero", "tasks", task(',"max_attempts":0'), "NUMBER_OUT_OF_RANGE",
      "max_attempts"),
    h("queue-concurrency-zero", "queues", queue(',"max_concurrency":0,"rate":0'),
      "NUMBER_OUT_OF_RANGE", "max_concurrency"),
    h("queue-negative-rate", "queues", queue(',"max_concurrency":1,"rate":-1'),
      "NUMBER_OUT_OF_RANGE", "rate"),
    h("int-5000-digits", "tasks", task(',"payload":' + "7" * 5000), "NUMBER_OUT_OF_RANGE"),
    h("nan", "tasks", task(',"payload":NaN'), "NON_FINITE_NUMBER"),
    h("infinity-nested", "tasks", task(',"payload":{"x":[Infinity]}'), "NON_FINITE_NUMBER"),
    h("minus-infinity", "tasks", task(',"backoff":{"factor":-Infinity}'), "NON_FINITE_NUMBER"),
    h("queue-rate-nan", "queues", queue(',"max_concurrency":1,"rate":NaN'), "NON_FINITE_NUMBER"),
    h("unknown", "tasks", task(',"colour":"red"'), "UNKNOWN_FIELD", "colour"),
    h("unknown-nested", "tasks", task(',"backoff":{"jitter":0.5}'), "UNKNOWN_FIELD",
      "backoff.jitter"),
    h("queue-unknown", "queues", queue(',"max_concurrency":1,"rate":0,"capacity":1'),
      "UNKNOWN_FIELD", "capacity"),
    h("case-Handler", "tasks", '{"queue":"@Q","Handler":"h"}', "FIELD_CASE_MISMATCH", "Handler"),
    h("case-nested-backoff-Base", "tasks", task(',"backoff":{"Base":1}'), "FIELD_CASE_MISMATCH",
      "backoff.Base"),
    h("case-upper", "tasks", task(',"PAYLOAD":{}'), "FIELD_CASE_MISMATCH", "PAYLOAD"),
    h("queue-case", "queues", queue(',"Max_Concurrency":1,"rate":0'), "FIELD_CASE_MISMATCH",
      "Max_Concurrency"),
    h("null-required", "tasks", '{"queue":"@Q","handler":null}', "NULL_NOT_ALLOWED", "handler"),
    h("null-defaulted", "tasks", task(',"priority":null'), "NULL_NOT_ALLOWED", "priority"),
    h("null-bool", "tasks", task(',"retry_safe":null'), "NULL_NOT_ALLOWED", "retry_safe"),
    h("null-nested", "tasks", task(',"backoff":{"base":null}'), "NULL_NOT_ALLOWED",
      "backoff.base"),
    h("queue-null-rate", "queues", queue(',"max_concurrency":1,"rate":null'), "NULL_NOT_ALLOWED",
      "rate"),
    h("response-only-id", "tasks", task(',"id":"01a229a1-b242-7b91-8a09-66c3d3d25594"'),
      "RESPONSE_ONLY_FIELD", "id"),
    h("response-only-state", "tasks", task(',"state":"succeeded"'), "RESPONSE_ONLY_FIELD",
      "state"),
    h("response-only-attempts-used", "tasks", task(',"attempts_used":0'), "RESPONSE_ONLY_FIELD",
      "attempts_used"),
    h("response-only-result-version", "tasks", task(',"result_version":"1"'),
      "RESPONSE_ONLY_FIELD", "result_version"),
    h("queue-response-only-paused", "queues", queue(',"max_concurrency":1,"rate":0,"paused":true'),
      "RESPONSE_ONLY_FIELD", "paused"),
    h("missing-handler", "tasks", '{"queue":"@Q"}', "MISSING_FIELD", "handler"),
    h("queue-missing-rate", "queues", queue(',"max_concurrency":1'), "MISSING_FIELD", "rate"),
    h("queue-missing-concurrency", "queues", queue(',"rate":0'), "MISSING_FIELD",
      "max_concurrency"),
    h("type-string-for-int", "tasks", task(',"priority":"5"'), "INVALID_TYPE", "priority"),
    h("type-string-for-bool", "tasks", task(',"retry_safe":"true"'), "INVALID_TYPE",
      "retry_safe"),
    h("type-float-for-int", "tasks", task(',"max_attempts":2.0'), "INVALID_TYPE", "max_attempts"),
    h("type-int-for-string", "tasks", '{"queue":"@Q","handler":7}', "INVALID_TYPE", "handler"),
    h("type-list-for-object", "tasks", task(',"backoff":[1,2,3]'), "INVALID_TYPE", "backoff"),
    h("type-array-body", "tasks", "[]", "INVALID_TYPE"),
    h("queue-type-bool-for-int", "queues", queue(',"max_concurrency":true,"rate":0'),
      "INVALID_TYPE", "max_concurrency"),
    h("value-bad-name", "tasks", '{"queue":"@Q","handler":"not a name"}', "INVALID_VALUE",
      "handler"),
    h("value-bad-instant", "tasks", task(',"deadline":"tomorrow"'), "INVALID_VALUE", "deadline"),
    h("value-instant-without-offset", "tasks", task(',"deadline":"2100-01-01T00:00:00"'),
      "INVALID_VALUE", "deadline"),
    # ISO 8601's other forms, which datetime.fromisoformat took: RFC 3339 only
    h("value-instant-week-date", "tasks", task(',"deadline":"2100-W01-1T00:00:00Z"'),
      "INVALID_VALUE", "deadline"),
    h("value-instant-compact", "tasks", task(',"run_after":"21000101T000000Z"'),
      "INVALID_VALUE", "run_after"),
    h("value-instant-space", "tasks", task(',"deadline":"2100-01-01 00:00:00Z"'),
      "INVALID_VALUE", "deadline"),
    h("value-instant-no-seconds", "tasks", task(',"run_after":"2100-01-01T00:00Z"'),
      "INVALID_VALUE", "run_after"),
    h("value-instant-offset-hours", "tasks", task(',"deadline":"2100-01-01T00:00:00+05"'),
      "INVALID_VALUE", "deadline"),
    h("value-instant-offset-seconds", "tasks",
      task(',"deadline":"2100-01-01T00:00:00+05:30:15"'), "INVALID_VALUE", "deadline"),
    h("value-instant-offset-minute-60", "tasks",
      task(',"deadline":"2100-01-01T00:00:00+05:60"'), "INVALID_VALUE", "deadline"),
    h("queue-value-bad-name", "queues", '{"name":"-q@N","max_concurrency":1,"rate":0}',
      "INVALID_VALUE", "name"),
    h("json-truncated", "tasks", task()[:-1], "INVALID_JSON"),
    h("json-trailing-garbage", "tasks", task() + " {}", "INVALID_JSON"),
    h("json-empty-body", "tasks", "", "INVALID_JSON"),
    h("json-single-quotes", "tasks", "{'queue':'@Q','handler':'h'}", "INVALID_JSON"),
    h("json-trailing-comma", "tasks", task(","), "INVALID_JSON"),
    h("json-bom", "tasks", b"\xef\xbb\xbf" + task().encode(), "INVALID_JSON"),
    h("queue-json-leading-zero", "queues", queue(',"max_concurrency":01,"rate":0'),
      "INVALID_JSON"),
]
# fmt: on


def http_follow_up(env: Env, route: str) -> None:
    """A valid request on the same client goes through. Tasks use one idempotency key, so
    the follow-ups do not grow the state every comparison reads."""
    if route == "tasks":
        body: dict[str, Any] = {"queue": env.queue_http, "handler": "h", "payload": {"ok": 1},
                                "idempotency_key": "contract-follow-up"}  # fmt: skip
        expected = (200, 201)
    else:
        body, expected = {"name": f"ok{uid()}", "max_concurrency": 1, "rate": 0}, (201,)
    r = env.admin.post(f"/v1/{route}", json=body)
    assert r.status_code in expected, r.text


@pytest.mark.parametrize(("route", "template", "code", "where"), HTTP_CASES)
def test_http_rejects_with_code_and_changes_nothing(
    env: Env, route: str, template: str | bytes, code: str, where: str | None
) -> None:
    body = fill(template, {"@Q": env.queue_http, "@N": uid()})
    queues = route == "queues"
    before = env.watch.snapshot(queues=queues)
    r = env.admin.post(f"/v1/{route}", content=body)
    assert r.status_code == 400, f"{r.status_code} {r.text[:300]}"
    err = assert_error_body(r)
    assert_unchanged(before, env.watch.snapshot(queues=queues))
    http_follow_up(env, route)
    assert err["code"] == code, err
    if where is not None:
        assert err.get("field") == where, err


# ----------------------------------------------------------------------------- WS cases


@dataclass(frozen=True)
class Frame:
    """A malformed frame sent at ``stage``: connected (before hello), welcomed, claimed (an
    attempt to start) or running (an attempt to finish). ``@H``, ``@A`` and ``@F`` stand
    for the case's handler, attempt id and fence; ``where`` is the ``field``, if checked."""

    stage: str
    data: str | bytes
    code: str
    req_id: str | None
    where: str | None = None


def w(ident: str, stage: str, data: str | bytes, code: str, req_id: str | None,
      where: str | None = None, marks: Any = ()) -> Any:  # fmt: skip
    return pytest.param(Frame(stage, data, code, req_id, where), id=ident, marks=marks)


def hello(rest: str = "", caps: str = '[{"handler":"@H","capacity":1}]', mc: str = "1") -> str:
    return ('{"type":"hello","req_id":"c1","name":"w","capabilities":' + caps
            + ',"max_concurrency":' + mc + ',"push":false' + rest + "}")  # fmt: skip


def start(rest: str) -> str:
    return '{"type":"start","req_id":"s1","attempt_id":"@A"' + rest + "}"


def finish(outcome: str, rest: str = "", fence: str = '"@F"') -> str:
    return ('{"type":"finish","req_id":"f1","attempt_id":"@A","fence":' + fence
            + ',"outcome":' + outcome + rest + "}")  # fmt: skip


def claim(rest: str) -> str:
    return '{"type":"claim","req_id":"w1"' + rest + "}"


CAPS = '"capabilities":[{"handler":"@H","capacity":1}],"max_concurrency":1'
RESUME = '{"type":"resume","req_id":"c2","session_id":"s"'

# fmt: off
WS_CASES = [
    # before hello: the handshake answers and goes on waiting for a good hello
    w("hello-capabilities[0].Handler", "connected",
      hello(caps='[{"Handler":"@H","capacity":1}]'), "FIELD_CASE_MISMATCH", "c1",
      "capabilities[0].Handler"),
    w("hello-response-only-session_id", "connected", hello(',"session_id":"s"'),
      "RESPONSE_ONLY_FIELD", "c1", "session_id"),
    w("hello-response-only-secret", "connected", hello(',"resume_secret":"s"'),
      "RESPONSE_ONLY_FIELD", "c1", "resume_secret"),
    w("hello-null-name", "connected", hello().replace('"w"', "null"), "NULL_NOT_ALLOWED", "c1",
      "name"),
    w("hello-missing-field", "connected", hello().replace(',"max_concurrency":1', ""),
      "MISSING_FIELD", "c1", "max_concurrency"),
    w("hello-string-for-int", "connected", hello(mc='"1"'), "INVALID_TYPE", "c1",
      "max_concurrency"),
    w("hello-unknown-field", "connected", hello(',"colour":"red"'), "UNKNOWN_FIELD", "c1",
      "colour"),
    w("hello-unknown-nested", "connected",
      hello(caps='[{"handler":"@H","capacity":1,"weight":2}]'), "UNKNOWN_FIELD", "c1",
      "capabilities[0].weight"),
    w("hello-capacity-zero", "connected", hello(caps='[{"handler":"@H","capacity":0}]'),
      "NUMBER_OUT_OF_RANGE", "c1", "capabilities[0].capacity"),
    w("hello-dup-key", "connected", hello(',"name":"v"'), "DUPLICATE_KEY", None, "name"),
    w("hello-int-2^64", "connected", hello(mc="18446744073709551616"), "NUMBER_OUT_OF_RANGE",
      None),
    w("hello-infinity", "connected", hello(mc="Infinity"), "NON_FINITE_NUMBER", None),
    w("hello-lone-surrogate", "connected", hello().replace('"w"', r'"w\ud800"'),
      "LONE_SURROGATE", None),
    w("hello-invalid-utf8-binary", "connected", hello().encode().replace(b'"w"', b'"w\xff"'),
      "INVALID_UTF8", None),
    w("hello-truncated", "connected", hello()[:-9], "INVALID_JSON", None),
    w("resume-response-only-epoch", "connected", RESUME + ',"secret":"x","epoch":"2"}',
      "RESPONSE_ONLY_FIELD", "c2", "epoch"),
    w("resume-case-Secret", "connected", RESUME + ',"Secret":"x"}', "FIELD_CASE_MISMATCH", "c2",
      "Secret"),
    # after welcome: an error echoes the req_id whenever it can be read
    w("claim-case-N", "welcomed", claim(',"N":1'), "FIELD_CASE_MISMATCH", "w1", "N"),
    w("claim-null", "welcomed", claim(',"n":null'), "NULL_NOT_ALLOWED", "w1", "n"),
    w("claim-zero", "welcomed", claim(',"n":0'), "NUMBER_OUT_OF_RANGE", "w1", "n"),
    w("claim-float", "welcomed", claim(',"n":1.5'), "INVALID_TYPE", "w1", "n"),
    w("claim-float-overflow", "welcomed", claim(',"n":1e400'), "NUMBER_OUT_OF_RANGE", None),
    w("claim-int-below-min", "welcomed", claim(',"n":-9223372036854775809'),
      "NUMBER_OUT_OF_RANGE", None),
    w("claim-nan", "welcomed", claim(',"n":NaN'), "NON_FINITE_NUMBER", None),
    w("claim-lone-surrogate", "welcomed", claim(r',"n":1,"note":"\udc00"'), "LONE_SURROGATE",
      None),
    w("claim-invalid-utf8-binary", "welcomed", claim(',"n":1,"x":"@X"').encode()
      .replace(b"@X", b"\xc3\x28"), "INVALID_UTF8", None),
    w("claim-unknown-field", "welcomed", claim(',"n":1,"limit":5'), "UNKNOWN_FIELD", "w1",
      "limit"),
    w("claim-dup-req_id", "welcomed", claim(',"n":1,"req_id":"w2"'), "DUPLICATE_KEY", None,
      "req_id"),
    w("server-only-type", "welcomed", '{"type":"tasks","req_id":"w3","tasks":[]}',
      "UNKNOWN_TYPE", "w3", "type"),
    w("claim-truncated", "welcomed", claim(',"n":1')[:-1], "INVALID_JSON", None),
    w("renew-null-item", "welcomed", '{"type":"renew","req_id":"w4","attempt_ids":[null]}',
      "NULL_NOT_ALLOWED", "w4"),
    w("renew-case", "welcomed", '{"type":"renew","req_id":"w5","Attempt_ids":["a"]}',
      "FIELD_CASE_MISMATCH", "w5", "Attempt_ids"),
    w("capacity-number-for-counter", "welcomed",
      '{"type":"capacity","req_id":"w6","seq":5,' + CAPS + "}", "INVALID_TYPE", "w6", "seq"),
    w("capacity-case-nested", "welcomed",
      '{"type":"capacity","req_id":"w7","seq":"5",' + CAPS.replace('"capacity"', '"Capacity"')
      + "}", "FIELD_CASE_MISMATCH", "w7", "capabilities[0].Capacity"),
    w("case-Type", "welcomed", '{"Type":"claim","req_id":"w8","n":1}', "FIELD_CASE_MISMATCH",
      "w8"),
    w("non-object-frame", "welcomed", '[{"type":"claim","req_id":"w9","n":1}]', "INVALID_TYPE",
      None),
    # start: a fence is a canonical decimal string below 2^63
    w("start-fence-leading-zero", "claimed", start(',"fence":"01"'), "INVALID_VALUE", "s1",
      "fence"),
    w("start-fence-negative", "claimed", start(',"fence":"-1"'), "INVALID_VALUE", "s1", "fence"),
    w("start-fence-plus", "claimed", start(',"fence":"+1"'), "INVALID_VALUE", "s1", "fence"),
    w("start-fence-trailing-newline", "claimed", start(',"fence":"1\\n"'), "INVALID_VALUE", "s1",
      "fence"),
    w("start-fence-2^63-string", "claimed", start(',"fence":"9223372036854775808"'),
      "NUMBER_OUT_OF_RANGE", "s1", "fence"),
    # twenty digits: out of range as 2^63 is, not a bad spelling (it was INVALID_VALUE)
    w("start-fence-20-digits", "claimed", start(',"fence":"99999999999999999999"'),
      "NUMBER_OUT_OF_RANGE", "s1", "fence"),
    w("start-fence-json-number", "claimed", start(',"fence":@F'), "INVALID_TYPE", "s1", "fence"),
    w("start-fence-null", "claimed", start(',"fence":null'), "NULL_NOT_ALLOWED", "s1", "fence"),
    w("start-case-Fence", "claimed", start(',"Fence":"@F"'), "FIELD_CASE_MISMATCH", "s1",
      "Fence"),
    w("start-response-only-status", "claimed", start(',"fence":"@F","status":"ok"'),
      "RESPONSE_ONLY_FIELD", "s1", "status"),
    w("start-response-only-lease", "claimed",
      start(',"fence":"@F","lease_expires_at":"2100-01-01T00:00:00Z"'), "RESPONSE_ONLY_FIELD",
      "s1", "lease_expires_at"),
    w("start-missing-fence", "claimed", start(""), "MISSING_FIELD", "s1", "fence"),
    w("start-dup-fence", "claimed", start(',"fence":"@F","fence":"@F"'), "DUPLICATE_KEY", None,
      "fence"),
    w("release-fence-space", "claimed",
      '{"type":"release","req_id":"s2","attempt_id":"@A","fence":"@F "}', "INVALID_VALUE", "s2",
      "fence"),
    # finish: the outcome is decoded as strictly as the envelope
    w("finish-nan", "running", finish('{"ok":true,"result":NaN}'), "NON_FINITE_NUMBER", None),
    w("finish-dup-key-in-result", "running", finish('{"ok":true,"result":{"a":1,"a":1}}'),
      "DUPLICATE_KEY", None, "a"),
    w("finish-case-nested", "running", finish('{"OK":true}'), "FIELD_CASE_MISMATCH", "f1",
      "outcome.OK"),
    w("finish-null-nested", "running", finish('{"ok":false,"error":{"code":null}}'),
      "NULL_NOT_ALLOWED", "f1", "outcome.error.code"),
    w("finish-response-only-receipt", "running", finish('{"ok":true}', ',"receipt":{}'),
      "RESPONSE_ONLY_FIELD", "f1", "receipt"),
    w("finish-response-only-version", "running", finish('{"ok":true}', ',"result_version":"1"'),
      "RESPONSE_ONLY_FIELD", "f1", "result_version"),
    w("finish-string-for-bool", "running", finish('{"ok":"true"}'), "INVALID_TYPE", "f1",
      "outcome.ok"),
    w("finish-int-2^64", "running", finish('{"ok":true,"result":[18446744073709551616]}'),
      "NUMBER_OUT_OF_RANGE", None),
    w("finish-lone-surrogate", "running", finish(r'{"ok":true,"result":"\ud800"}'),
      "LONE_SURROGATE", None),
    w("finish-encoded-surrogate-binary", "running", finish('{"ok":true,"result":"@X"}').encode()
      .replace(b"@X", b"\xed\xa0\x80"), "INVALID_UTF8", None),
    w("finish-missing-nested", "running", finish('{"result":1}'), "MISSING_FIELD", "f1",
      "outcome.ok"),
    w("finish-unknown-nested", "running", finish('{"ok":false,"error":{"code":"E","retry":1}}'),
      "UNKNOWN_FIELD", "f1", "outcome.error.retry"),
    w("finish-fence-json-number", "running", finish('{"ok":true}', fence="@F"), "INVALID_TYPE",
      "f1", "fence"),
    # batches: the whole batch is refused before anything is touched
    w("start_many-empty", "claimed", '{"type":"start_many","req_id":"b1","items":[]}',
      "INVALID_VALUE", "b1", "items"),
    w("start_many-too-many", "claimed", '{"type":"start_many","req_id":"b2","items":['
      + ",".join(['{"attempt_id":"@A","fence":"@F"}'] * 1001) + "]}", "VALUE_TOO_LONG", "b2",
      "items"),
    w("start_many-duplicate", "claimed", '{"type":"start_many","req_id":"b3","items":['
      '{"attempt_id":"@A","fence":"@F"},{"attempt_id":"@A","fence":"@F"}]}',
      "INVALID_ARGUMENT", "b3"),
    w("start_many-missing-fence", "claimed",
      '{"type":"start_many","req_id":"b4","items":[{"attempt_id":"@A"}]}', "MISSING_FIELD",
      "b4", "items[0].fence"),
    w("finish_many-nan", "running", '{"type":"finish_many","req_id":"b5","items":[{'
      '"attempt_id":"@A","fence":"@F","outcome":{"ok":true,"result":NaN}}]}',
      "NON_FINITE_NUMBER", None),
    w("finish_many-duplicate", "running", '{"type":"finish_many","req_id":"b6","items":['
      + ",".join(['{"attempt_id":"@A","fence":"@F","outcome":{"ok":true}}'] * 2) + "]}",
      "INVALID_ARGUMENT", "b6"),
    w("finish_many-ok-with-error", "running", '{"type":"finish_many","req_id":"b7","items":[{'
      '"attempt_id":"@A","fence":"@F","outcome":{"ok":true,"error":{"code":"E","message":"m",'
      '"retryable":false}}}]}', "INVALID_ARGUMENT", "b7"),
    # a failure with a result: the result was dropped, and left out of the digest, so a
    # repeat with another result got the first receipt (now refused as a success with an
    # error is, with the field at fault)
    w("finish-failure-with-result", "running",
      finish('{"ok":false,"result":{"rows":500},"error":{"code":"E","retryable":false}}'),
      "INVALID_ARGUMENT", "f1", "outcome.result"),
    w("finish-success-with-error", "running",
      finish('{"ok":true,"result":1,"error":{"code":"E"}}'), "INVALID_ARGUMENT", "f1",
      "outcome.error"),
    w("finish_many-failure-with-result", "running",
      '{"type":"finish_many","req_id":"b8","items":[{"attempt_id":"@A","fence":"@F",'
      '"outcome":{"ok":false,"result":[1],"error":{"code":"E"}}}]}', "INVALID_ARGUMENT", "b8",
      "items[0].outcome.result"),
]
# fmt: on


@dataclass
class Prepared:
    wire: Wire
    handler: str
    attempt: dict[str, Any] = field(default_factory=dict)

    def values(self) -> dict[str, str]:
        if not self.attempt:
            return {"@H": self.handler}
        return {"@H": self.handler, "@A": self.attempt["attempt_id"], "@F": self.attempt["fence"]}


def prepare(env: Env, stage: str) -> Prepared:
    """A fresh connection brought to ``stage``, with a handler of its own."""
    p = Prepared(Wire(env), f"h{uid()}")
    if stage == "connected":
        return p
    p.wire.hello(p.handler)
    if stage == "welcomed":
        return p
    task_id = submit(env, env.queue_ws, p.handler)
    [p.attempt] = p.wire.claim()
    assert p.attempt["task_id"] == task_id
    if stage == "running":
        reply = p.wire.call(
            {"type": "start", "attempt_id": p.attempt["attempt_id"], "fence": p.attempt["fence"]}
        )
        assert reply["type"] == "started", reply
    return p


def ws_follow_up(p: Prepared, stage: str) -> None:
    """The right next request at ``stage`` is answered as if nothing had come before."""
    if stage == "connected":
        p.wire.hello(p.handler)
    elif stage == "welcomed":
        assert p.wire.claim() == []
    elif stage == "claimed":
        reply = p.wire.call(
            {"type": "start", "attempt_id": p.attempt["attempt_id"], "fence": p.attempt["fence"]}
        )
        assert reply["type"] == "started" and reply["lease"]["status"] == "ok", reply
    else:
        reply = p.wire.call(
            {"type": "finish", "attempt_id": p.attempt["attempt_id"],
             "fence": p.attempt["fence"], "outcome": {"ok": True, "result": "fine"}}
        )  # fmt: skip
        assert reply["type"] == "finished", reply
        assert reply["receipt"]["task_state"] == "succeeded", reply


@pytest.mark.parametrize("case", WS_CASES)
def test_ws_rejects_with_code_and_stays_open(env: Env, case: Frame) -> None:
    p = prepare(env, case.stage)
    try:
        data = fill(case.data, p.values())
        frame: str | bytes = data if isinstance(case.data, bytes) else data.decode()
        before = env.watch.snapshot(workers=True)
        reply = p.wire.raw(frame)
        assert_ws_error(reply)
        assert reply["req_id"] == case.req_id, reply
        assert_unchanged(before, env.watch.snapshot(workers=True))
        ws_follow_up(p, case.stage)
        assert reply["code"] == case.code, reply
        if case.where is not None:
            assert reply.get("field") == case.where, reply
    finally:
        p.wire.close()


def test_ws_batches_answer_each_report_on_its_own(env: Env) -> None:
    """start_many and finish_many: one reply per item, in order; a refused item carries its
    code and leaves the others committed."""
    p = prepare(env, "welcomed")
    try:
        for _ in range(2):
            submit(env, env.queue_ws, p.handler)
        claimed: list[dict[str, Any]] = []
        while len(claimed) < 2:
            claimed += p.wire.claim()
        a, b = claimed
        items = [
            {"attempt_id": a["attempt_id"], "fence": a["fence"]},
            {"attempt_id": b["attempt_id"], "fence": str(int(b["fence"]) + 1)},
        ]
        reply = p.wire.call({"type": "start_many", "items": items})
        assert reply["type"] == "started_many", reply
        first, second = reply["results"]
        assert first["attempt_id"] == a["attempt_id"] and first["error"] is None
        assert first["lease"]["status"] == "ok"
        assert second["lease"] is None and second["error"]["code"] == "STALE_FENCE", second
        done = {"ok": True, "result": {"n": 1}}
        reply = p.wire.call(
            {
                "type": "finish_many",
                "items": [
                    {"attempt_id": a["attempt_id"], "fence": a["fence"], "outcome": done},
                    {"attempt_id": b["attempt_id"], "fence": b["fence"], "outcome": done},
                ],
            }
        )
        assert reply["type"] == "finished_many", reply
        ok, refused = reply["results"]
        assert ok["receipt"]["task_state"] == "succeeded" and ok["error"] is None, ok
        assert refused["error"]["code"] == "FINISH_WITHOUT_START", refused
        assert env.admin.get(f"/v1/tasks/{a['task_id']}").json()["state"] == "succeeded"
        assert env.admin.get(f"/v1/tasks/{b['task_id']}").json()["state"] == "claimed"
    finally:
        p.wire.close()


def test_ws_a_failure_repeated_with_a_result_gets_no_receipt(env: Env) -> None:
    """A failure's digest leaves out a result it has none of: a repeat that added one
    (``finish`` or ``finish_many``) was answered with the first receipt, as the same
    report. It is refused INVALID_ARGUMENT; the task stays failed without a result."""
    p = prepare(env, "running")
    try:
        error = {"code": "E", "retryable": False}
        item = {"attempt_id": p.attempt["attempt_id"], "fence": p.attempt["fence"]}
        first = p.wire.call({"type": "finish", **item, "outcome": {"ok": False, "error": error}})
        assert first["type"] == "finished" and first["receipt"]["task_state"] == "failed", first
        before = env.watch.snapshot(workers=True)
        other = {"ok": False, "result": {"rows_written": 7}, "error": error}
        again = p.wire.call({"type": "finish", **item, "outcome": other})
        many = p.wire.call({"type": "finish_many", "items": [{**item, "outcome": other}]})
        assert (again["type"], again["code"], again["field"]) == (
            "error", "INVALID_ARGUMENT", "outcome.result"), again  # fmt: skip
        assert (many["type"], many["code"], many["field"]) == (
            "error", "INVALID_ARGUMENT", "items[0].outcome.result"), many  # fmt: skip
        assert_unchanged(before, env.watch.snapshot(workers=True))
        task = env.admin.get(f"/v1/tasks/{p.attempt['task_id']}").json()
        assert task["state"] == "failed" and task["result"] is None, task
    finally:
        p.wire.close()


# ----------------------------------------------- one spelling of a list item's path

#: (a batch's second task's fields, the status, the code, the field): refusals of the
#: decoder and of the store alike name the task by its index in brackets
BATCH_PATHS = [
    pytest.param({"priority": 1_000_001}, 400, "NUMBER_OUT_OF_RANGE", "tasks[1].priority",
                 id="decoder-value"),
    pytest.param({"backoff": {"base": None}}, 400, "NULL_NOT_ALLOWED", "tasks[1].backoff.base",
                 id="decoder-null-nested"),
    pytest.param({"deadline": "2020-01-01T00:00:00Z"}, 400, "INVALID_DEADLINE",
                 "tasks[1].deadline", id="store-deadline"),
    pytest.param({"queue": "no-such-queue"}, 404, "QUEUE_NOT_FOUND", "tasks[1].queue",
                 id="store-queue"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "status", "code", "where"), BATCH_PATHS)
def test_http_names_a_batch_task_by_its_index_in_brackets(
    env: Env, bad: dict[str, Any], status: int, code: str, where: str
) -> None:
    """``field`` and the message's lead are ``tasks[1].<field>``: a bad value was named
    ``tasks.1.priority`` where an unknown field of the same task was ``tasks[1].Priority``."""
    tasks = [{"queue": env.queue_http, "handler": "h"}, {"queue": env.queue_http, "handler": "h"}]
    tasks[1].update(bad)
    before = env.watch.snapshot()
    r = env.admin.post("/v1/tasks/batch", json={"tasks": tasks})
    assert r.status_code == status, r.text
    err = assert_error_body(r)
    assert_unchanged(before, env.watch.snapshot())
    assert (err["code"], err.get("field")) == (code, where), err
    assert err["message"].startswith(f"{where}: "), err


# fmt: off
WS_PATHS = [
    w("hello-second-capacity", "connected",
      hello(caps='[{"handler":"@H","capacity":1},{"handler":"z@H","capacity":0}]'),
      "NUMBER_OUT_OF_RANGE", "c1", "capabilities[1].capacity"),
    w("renew-second-id", "welcomed", '{"type":"renew","req_id":"p1","attempt_ids":["a",7]}',
      "INVALID_TYPE", "p1", "attempt_ids[1]"),
    w("start_many-second-fence", "claimed", '{"type":"start_many","req_id":"p2","items":['
      '{"attempt_id":"@A","fence":"@F"},{"attempt_id":"@A"}]}', "MISSING_FIELD", "p2",
      "items[1].fence"),
    w("finish_many-nested", "running", '{"type":"finish_many","req_id":"p3","items":[{'
      '"attempt_id":"@A","fence":"@F","outcome":{"ok":"yes"}}]}', "INVALID_TYPE", "p3",
      "items[0].outcome.ok"),
]
# fmt: on


@pytest.mark.parametrize("case", WS_PATHS)
def test_ws_names_a_list_item_by_its_index_in_brackets(env: Env, case: Frame) -> None:
    """The worker's refusals spell a path as the HTTP ones do, in ``field`` and message."""
    p = prepare(env, case.stage)
    try:
        before = env.watch.snapshot(workers=True)
        reply = p.wire.raw(fill(case.data, p.values()).decode())
        assert_ws_error(reply)
        assert reply["req_id"] == case.req_id, reply
        assert_unchanged(before, env.watch.snapshot(workers=True))
        ws_follow_up(p, case.stage)
        assert (reply["code"], reply["field"]) == (case.code, case.where), reply
        assert reply["message"].startswith(f"{case.where}: "), reply
    finally:
        p.wire.close()


# ------------------------------------------ once bugs: NUL, far-future instants, deep values


@pytest.mark.parametrize("name", ["idempotency_key", "parent_id"])
def test_http_nul_in_free_form_string_is_never_a_500(
    env: Env, request: pytest.FixtureRequest, name: str
) -> None:
    before = env.watch.snapshot()
    r = env.admin.post(
        "/v1/tasks", json={"queue": env.queue_http, "handler": "h", name: f"k{uid()}\u0000"}
    )
    assert r.status_code < 500, f"{r.status_code} {r.text[:200]}"
    if r.is_success:  # an idempotency key may hold any character: then it is one new task
        assert changed(before.tasks, env.watch.snapshot().tasks) == {r.json()["task"]["id"]}
    else:
        assert_error_body(r)
        assert_unchanged(before, env.watch.snapshot())
    http_follow_up(env, "tasks")


# fmt: off
NUL_FRAMES = [
    pytest.param("connected", '{"type":"resume","req_id":"n1","session_id":"s\\u0000",'
                 '"secret":"x"}', "n1", id="resume-session_id"),
    pytest.param("claimed", '{"type":"start","req_id":"n2","attempt_id":"@A\\u0000",'
                 '"fence":"@F"}', "n2", id="start-attempt_id"),
    pytest.param("claimed", '{"type":"renew","req_id":"n3","attempt_ids":["a\\u0000"]}', "n3",
                 id="renew-attempt_ids"),
]
# fmt: on


@pytest.mark.parametrize(("stage", "template", "rid"), NUL_FRAMES)
def test_ws_nul_in_an_id_is_answered_not_dropped(
    env: Env, request: pytest.FixtureRequest, stage: str, template: str, rid: str
) -> None:
    p = prepare(env, stage)
    try:
        before = env.watch.snapshot(workers=True)
        reply = p.wire.raw(fill(template, p.values()).decode())
        assert reply.get("type") != "closed", "the server dropped the connection"
        assert reply["req_id"] == rid, reply
        if reply["type"] == "error":
            assert_unchanged(before, env.watch.snapshot(workers=True))
        ws_follow_up(p, stage)
    finally:
        p.wire.close()


def own_queue(env: Env) -> str:
    name = f"s{uid()}"
    body = {"name": name, "max_concurrency": 10, "rate": 0}
    assert env.admin.post("/v1/queues", json=body).status_code == 201
    return name


def assert_readable(env: Env, queue: str, task_id: str | None) -> None:
    """What was accepted can be read back: the task and its queue's listing."""
    r = env.admin.get("/v1/tasks", params={"queue": queue})
    assert r.status_code == 200, f"GET /v1/tasks?queue=: {r.status_code} {r.text[:200]}"
    if task_id is None:
        assert r.json()["items"] == []
    else:
        r = env.admin.get(f"/v1/tasks/{task_id}")
        assert r.status_code == 200, f"GET /v1/tasks/{{id}}: {r.status_code} {r.text[:200]}"


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_http_instant_beyond_year_9999_is_refused(scratch: Env) -> None:
    q = own_queue(scratch)
    body = {"queue": q, "handler": "h", "run_after": "9999-12-31T23:59:59-14:00"}
    r = scratch.admin.post("/v1/tasks", json=body)
    assert r.status_code == 400, f"{r.status_code} {r.text[:200]}"
    assert_error_body(r)
    assert_readable(scratch, q, None)


def test_http_deep_payload_is_refused_or_served(scratch: Env) -> None:
    q = own_queue(scratch)
    r = scratch.admin.post("/v1/tasks", json={"queue": q, "handler": "h", "payload": nested(300)})
    assert r.status_code < 500, f"{r.status_code} {r.text[:200]}"
    if r.is_success:
        assert_readable(scratch, q, r.json()["task"]["id"])
    else:
        assert_error_body(r)
        assert_readable(scratch, q, None)


def test_ws_deep_result_is_refused_or_served(scratch: Env) -> None:
    q, handler = own_queue(scratch), f"h{uid()}"
    wire = Wire(scratch)
    try:
        wire.hello(handler)
        task_id = submit(scratch, q, handler)
        [a] = wire.claim()
        reply = wire.call({"type": "start", "attempt_id": a["attempt_id"], "fence": a["fence"]})
        assert reply["type"] == "started", reply
        reply = wire.call(
            {"type": "finish", "attempt_id": a["attempt_id"], "fence": a["fence"],
             "outcome": {"ok": True, "result": nested(300)}}
        )  # fmt: skip
        assert reply["type"] in ("finished", "error"), reply
        assert_readable(scratch, q, task_id)
    finally:
        wire.close()


# ----------------------------------------------------------------------------- fuzzing


@dataclass
class Raw:
    """Literal JSON text (NaN, 1e400, ...) that no encoder would write."""

    text: str


@dataclass
class Obj:
    """A JSON object as pairs, so that keys can repeat."""

    pairs: list[tuple[str, Any]]


def to_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return Obj([(k, to_tree(v)) for k, v in value.items()])
    if isinstance(value, list):
        return [to_tree(v) for v in value]
    return value


class Esc(str):
    """A string written with every character as a ``\\uXXXX`` escape: the same string."""

    __slots__ = ()


def string(text: str, ascii_only: bool) -> str:
    if isinstance(text, Esc):
        return '"' + "".join(json.dumps(c)[1:-1] if ord(c) > 0xFFFF else f"\\u{ord(c):04x}"
                             for c in text) + '"'  # fmt: skip
    return json.dumps(text, ensure_ascii=ascii_only)


def emit(value: Any, ascii_only: bool, gap: str = "") -> str:
    """JSON text; ``gap`` is the whitespace written after every ``,`` and ``:``."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Obj):
        return "{" + f",{gap}".join(
            f"{string(k, ascii_only)}:{gap}{emit(v, ascii_only, gap)}" for k, v in value.pairs
        ) + "}"  # fmt: skip
    if isinstance(value, list):
        return "[" + f",{gap}".join(emit(v, ascii_only, gap) for v in value) + "]"
    if isinstance(value, str):
        return string(value, ascii_only)
    return json.dumps(value)


def children(value: Any) -> list[Any]:
    if isinstance(value, Obj):
        return [v for _, v in value.pairs]
    return value if isinstance(value, list) else []


def slots(value: Any) -> list[tuple[Any, int]]:
    """Every place a value sits below the root, as (container, index)."""
    out: list[tuple[Any, int]] = []
    for i, child in enumerate(children(value)):
        out += [(value, i), *slots(child)]
    return out


def objects(value: Any) -> list[Obj]:
    out = [value] if isinstance(value, Obj) and value.pairs else []
    for child in children(value):
        out += objects(child)
    return out


def put(container: Any, index: int, new: Any) -> None:
    if isinstance(container, Obj):
        container.pairs[index] = (container.pairs[index][0], new)
    else:
        container[index] = new


# NUL characters and nesting between 64 and the parser's limit have tests of their own
# above (they were bugs: a 500 on PostgreSQL, an unreadable task list).
KEYS = [
    "colour", "", "id", "state", "session_id", "epoch", "receipt", "result_version", "paused",
    "lease_expires_at", "type", "req_id", "n", "Payload", "\ud800", "k" * 80,
]  # fmt: skip
VALUES: list[Any] = [
    0, -1, 1, 2, 1.5, -0.0, 1e-300, True, False, "", "x", "1", "01", "-1", " 1", "true",
    "\u00e9", "a b", "2100-01-01T00:00:00", [], [1, "a"], {}, {"a": None},
]  # fmt: skip
HUGE: list[Any] = [
    2**63, 2**64, -(2**63) - 1, 10**40, 2**63 - 1, -(2**63), 1e308, Raw("1e400"),
    Raw("-1E999"), Raw("123456789012345678901234567890.5"),
]  # fmt: skip
NONFINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("nan"), Raw("Inf")]
SURROGATES = ["\ud800", "a\udbff", "\udc00", "\udc00\ud800", "ok\ud83d"]
KEY_OPS = ["delete", "rename", "recase", "duplicate", "add"]
VALUE_OPS = {"swap": VALUES, "null": [None], "huge": HUGE, "nonfinite": NONFINITE,
             "surrogate": SURROGATES, "deep": [30, 3000]}  # fmt: skip
TEXT_OPS = ["truncate", "insert", "replace", "append", "wrap"]
OPS = KEY_OPS + sorted(VALUE_OPS) + TEXT_OPS
# Rewritings that keep a message valid (strictness must not refuse them); about one example
# in four uses only these, so the "valid after all, and carried out" paths run too.
BENIGN_OPS = ["reorder", "escape"]


def mutate(data: st.DataObject, base: dict[str, Any]) -> bytes:
    """A valid message, mutated one to three times (its structure first, then its bytes)."""
    doc = to_tree(copy.deepcopy(base))
    text_ops: list[tuple[str, int, bytes]] = []
    benign = data.draw(st.integers(0, 3), label="benign") == 0
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        op = data.draw(st.sampled_from(BENIGN_OPS if benign else OPS), label="op")
        if op in BENIGN_OPS and objects(doc):
            obj = data.draw(st.sampled_from(objects(doc)), label="object")
            i = data.draw(st.integers(0, len(obj.pairs) - 1), label="pair")
            if op == "reorder":
                obj.pairs = obj.pairs[i:] + obj.pairs[:i]
            else:
                key, value = obj.pairs[i]
                obj.pairs[i] = (Esc(key), Esc(value) if isinstance(value, str) else value)
        elif op in TEXT_OPS:
            at = data.draw(st.integers(0, 10**6), label="at")
            text_ops.append((op, at, data.draw(st.binary(min_size=1, max_size=4), label="bytes")))
        elif op in KEY_OPS and objects(doc):
            obj = data.draw(st.sampled_from(objects(doc)), label="object")
            i = data.draw(st.integers(0, len(obj.pairs) - 1), label="pair")
            key, value = obj.pairs[i]
            if op == "delete":
                del obj.pairs[i]
            elif op == "rename":
                obj.pairs[i] = (data.draw(st.sampled_from(KEYS), label="key"), value)
            elif op == "recase":
                how = data.draw(st.sampled_from(["upper", "capitalize", "swapcase", "title"]))
                obj.pairs[i] = (getattr(key, how)(), value)
            elif op == "duplicate":
                j = data.draw(st.integers(0, len(obj.pairs)), label="where")
                obj.pairs.insert(j, (key, copy.deepcopy(value)))
            else:
                new = to_tree(copy.deepcopy(data.draw(st.sampled_from(VALUES), label="value")))
                obj.pairs.append((data.draw(st.sampled_from(KEYS), label="key"), new))
        elif op in VALUE_OPS and slots(doc):
            container, i = data.draw(st.sampled_from(slots(doc)), label="slot")
            new = copy.deepcopy(data.draw(st.sampled_from(VALUE_OPS[op]), label="value"))
            put(container, i, Raw("[" * new + "1" + "]" * new) if op == "deep" else to_tree(new))
    ascii_only = data.draw(st.booleans(), label="ascii")
    gap = data.draw(st.sampled_from(["", " ", "\n  ", "\t", "\r\n"]), label="gap")
    frame = (gap + emit(doc, ascii_only, gap) + gap).encode("utf-8", "surrogatepass")
    for op, at, extra in text_ops:
        pos = at % (len(frame) + 1)
        if op == "truncate":
            frame = frame[: at % max(len(frame), 1)]
        elif op == "insert":
            frame = frame[:pos] + extra + frame[pos:]
        elif op == "replace" and frame:
            pos = at % len(frame)
            frame = frame[:pos] + extra[:1] + frame[pos + 1 :]
        elif op == "append":
            frame += [b" ", b"\n", b"x", b"{}", b",", b"\x00"][at % 6]
        elif op == "wrap":
            frame = b"[" + frame + b"]"
    return frame


def expect(model: type[BaseModel], frame: bytes) -> str | None:
    """What strict decoding says about ``frame``: a code, or None if it is well formed."""
    try:
        decode_model(model, frame)
    except DecodeError as exc:
        return exc.code
    return None


def expect_ws(frame: bytes) -> tuple[set[str] | None, str | None]:
    """(the acceptable codes, or None if well formed; the req_id an error must echo)."""
    try:
        raw = decode_json(frame)
    except DecodeError as exc:
        return {exc.code}, None
    if not isinstance(raw, dict):
        return {"UNKNOWN_TYPE", "INVALID_TYPE"}, None
    rid = raw.get("req_id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= 64 else None
    kind = raw.get("type")
    model = WORKER_REQUESTS.get(kind) if isinstance(kind, str) else None
    if model is None:  # no usable discriminator (or a case variant of it)
        variant = any(k.lower() == "type" and k != "type" for k in raw)
        return {"UNKNOWN_TYPE"} | ({"FIELD_CASE_MISMATCH"} if variant else set()), rid
    try:
        decode_model(model, raw, parsed=True)
    except DecodeError as exc:
        return {exc.code}, rid
    return None, rid


# The codes of a refusal "before it was understood"; a well-formed message never gets one.
DECODE_CODES = {
    "DUPLICATE_KEY", "INVALID_UTF8", "LONE_SURROGATE", "NUMBER_OUT_OF_RANGE",
    "NON_FINITE_NUMBER", "UNKNOWN_FIELD", "FIELD_CASE_MISMATCH", "NULL_NOT_ALLOWED",
    "RESPONSE_ONLY_FIELD", "MISSING_FIELD", "INVALID_TYPE", "INVALID_VALUE", "INVALID_JSON",
    "VALUE_TOO_LONG", "UNKNOWN_TYPE",
}  # fmt: skip

FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_fuzz_http_never_5xx_and_refusals_change_nothing(env: Env) -> None:
    admin, watch = env.admin, env.watch
    fuzz_queue = f"fz{uid()}"
    body = {"name": fuzz_queue, "max_concurrency": 5, "rate": 0}
    assert admin.post("/v1/queues", json=body).status_code == 201
    assert admin.post(f"/v1/queues/{fuzz_queue}/pause").status_code == 200

    def task_body(n: str) -> dict[str, Any]:
        return {"queue": fuzz_queue, "handler": "h-http", "tenant": "t1", "priority": 5,
                "payload": {"url": "https://example.test/\u00e9", "n": [1, 2.5, True, None]},
                "idempotency_key": f"k{n}", "retry_safe": True, "max_attempts": 2,
                "backoff": {"base": 1, "factor": 2, "max": 60}, "attempt_timeout": 30,
                "deadline": "2100-01-01T00:00:00Z",
                "run_after": "2099-01-01T00:00:00+00:00"}  # fmt: skip

    def batch_body(n: str) -> dict[str, Any]:
        return {"tasks": [task_body(n), {"queue": fuzz_queue, "handler": "h-http"}]}

    def queue_body(n: str) -> dict[str, Any]:
        return {"name": f"qf{n}", "max_concurrency": 3, "rate": 1.5, "burst": 2}

    routes: dict[str, tuple[str, type[BaseModel], Callable[[str], dict[str, Any]]]] = {
        "task": ("/v1/tasks", TaskSubmit, task_body),
        "batch": ("/v1/tasks/batch", TaskBatch, batch_body),
        "queue": ("/v1/queues", QueueCreate, queue_body),
    }

    @FUZZ_SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(sorted(routes)), label="route")
        path, model, make = routes[kind]
        body = mutate(data, make(uid()))
        code = expect(model, body)
        note(f"POST {path} {body[:400]!r} -> expected {code}")
        before = watch.snapshot(queues=True)
        r = admin.post(path, content=body)
        note(f"{r.status_code} {r.text[:300]}")
        assert r.status_code < 500, f"{r.status_code} {r.text[:300]}"
        after = watch.snapshot(queues=True)
        if not r.is_success:
            err = assert_error_body(r)
            assert_unchanged(before, after)
            if code is not None:
                assert (r.status_code, err["code"]) == (400, code), err
            else:
                assert err["code"] not in DECODE_CODES, f"well formed, yet refused as {err}"
            return
        # Accepted: it must have been well formed, and the change must be its own alone.
        assert code is None, f"accepted a message strict decoding refuses ({code})"
        new = after.new_events(before)
        if kind == "queue":
            name = r.json()["name"]
            assert changed(before.queues, after.queues) == {name}
            assert after.tasks == before.tasks
            assert all(e["queue"] == name and e["task_id"] is None for e in new), new
            # Paused, so that no fuzzed task could ever be claimed from it behind our back.
            assert admin.post(f"/v1/queues/{name}/pause").status_code == 200
        else:
            results = r.json() if kind == "batch" else [r.json()]
            created = {s["task"]["id"] for s in results if s["created"]}
            assert changed(before.tasks, after.tasks) == created
            assert not created & before.tasks.keys()
            assert after.queues == before.queues
            assert all(e["task_id"] in created for e in new), new

    run()


@dataclass
class WsFuzz:
    """The WebSocket fuzzer's world: a welcomed session (push off) holding a few claimed
    and running attempts, and a connection that has not said hello yet."""

    env: Env
    queue: str
    handler: str
    main: Wire | None = None
    pre: Wire | None = None
    claimed: list[dict[str, Any]] = field(default_factory=list)
    running: list[dict[str, Any]] = field(default_factory=list)
    seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def session(self) -> Wire:
        if self.main is None:
            self.main = Wire(self.env)
            self.main.hello(self.handler, capacity=8)
            self.claimed, self.running = [], []
        return self.main

    def waiting(self) -> Wire:
        if self.pre is None:
            self.pre = Wire(self.env)
        return self.pre

    def claim_one(self) -> None:
        main = self.session()
        submit(self.env, self.queue, self.handler)
        grants = main.claim()
        if not grants:  # a fuzzed capacity update may have shrunk the session: restore it
            reply = main.call(self.capacity({}))
            assert reply["type"] == "ack", reply
            grants = main.claim()
        assert grants, "could not claim a task for the fuzzer"
        self.claimed += grants

    def capacity(self, msg: dict[str, Any]) -> dict[str, Any]:
        return msg | {"type": "capacity", "seq": str(next(self.seq)), "max_concurrency": 8,
                      "capabilities": [{"handler": self.handler, "capacity": 8}]}  # fmt: skip

    def start(self, a: dict[str, Any]) -> None:
        reply = self.session().call(
            {"type": "start", "attempt_id": a["attempt_id"], "fence": a["fence"]}
        )
        assert reply["type"] == "started", reply
        self.running.append(a)

    def finish(self, a: dict[str, Any]) -> None:
        reply = self.session().call(
            {"type": "finish", "attempt_id": a["attempt_id"], "fence": a["fence"],
             "outcome": {"ok": True}}
        )  # fmt: skip
        assert reply["type"] == "finished", reply

    def provision(self, kind: str) -> None:
        """Keep the pools small, and hold what a ``kind`` message needs."""
        self.session()
        while len(self.running) > 1:
            self.finish(self.running.pop())
        while len(self.claimed) > 1:
            self.start(self.claimed.pop())
            self.finish(self.running.pop())
        if kind in ("start", "release", "finish", "renew") and not self.claimed:
            self.claim_one()
        if kind in ("finish", "renew") and not self.running:
            self.start(self.claimed.pop())

    def base(self, kind: str, rid: str, ok: bool) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": kind, "req_id": rid}
        if kind == "hello":
            caps = [{"handler": "h-fz-pre", "capacity": 2}]
            return msg | {"name": "fz", "capabilities": caps, "max_concurrency": 2, "push": False}
        if kind == "resume":
            sid = self.session().session_id
            return msg | {"session_id": sid, "secret": "not-the-secret", "push": False}
        if kind == "claim":
            return msg | {"n": 1}
        if kind in ("start", "release"):
            a = self.claimed[-1]
            return msg | {"attempt_id": a["attempt_id"], "fence": a["fence"]}
        if kind == "renew":
            return msg | {"attempt_ids": [self.running[-1]["attempt_id"]]}
        if kind == "finish":
            a = self.running[-1]
            outcome = (
                {"ok": True, "result": {"png": "x", "n": 1.5}} if ok
                else {"ok": False, "error": {"code": "E", "message": "m", "retryable": True}}
            )  # fmt: skip
            return msg | {"attempt_id": a["attempt_id"], "fence": a["fence"], "outcome": outcome}
        if kind == "capacity":
            return self.capacity(msg)
        return msg  # drain, heartbeat: nothing but the envelope

    def accepted(self, kind: str, reply: dict[str, Any]) -> None:
        """Account for a fuzzed message that happened to be valid and was carried out."""
        pools = {"start": self.claimed, "release": self.claimed, "finish": self.running}
        if kind in pools:
            pool = pools[kind]
            attempt_id = reply.get("lease", reply.get("receipt", {})).get("attempt_id")
            moved = [a for a in pool if a["attempt_id"] == attempt_id] or pool[-1:]
            pool.remove(moved[0])
            if kind == "start":
                self.running.append(moved[0])
        elif kind == "claim":
            self.claimed += reply["tasks"]

    def close(self) -> None:
        for wire in (self.main, self.pre):
            if wire is not None:
                wire.close()


def test_fuzz_ws_never_drops_and_refusals_change_nothing(env: Env) -> None:
    n = uid()
    fz = WsFuzz(env, f"fzq{n}", f"h-fz{n}")
    body = {"name": fz.queue, "max_concurrency": 10_000, "rate": 0}
    assert env.admin.post("/v1/queues", json=body).status_code == 201
    kinds = ["claim", "start", "renew", "finish", "release", "capacity", "hello", "resume"]
    kinds += [k for k in WORKER_REQUESTS if k not in kinds and k != "drain"]  # e.g. heartbeat

    @FUZZ_SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        pre = data.draw(st.integers(0, 4), label="phase") == 0
        pool = ["hello", "resume", "claim"] if pre else [*kinds, "drain"]
        kind = data.draw(st.sampled_from(pool), label="kind")
        fz.provision(kind)
        wire = fz.waiting() if pre else fz.session()
        frame = mutate(data, fz.base(kind, f"fz{uid()}", data.draw(st.booleans(), label="ok")))
        codes, rid = expect_ws(frame)
        try:
            frame.decode("utf-8")
            as_text = data.draw(st.booleans(), label="text frame")
        except UnicodeDecodeError:
            as_text = False
        note(f"{'before hello' if pre else 'welcomed'}, {'text' if as_text else 'binary'}: "
             f"{frame[:400]!r} -> expected {codes} {rid}")  # fmt: skip
        before = env.watch.snapshot(workers=True)
        reply = wire.raw(frame.decode() if as_text else frame)
        note(f"reply {json.dumps(reply)[:300]}")
        assert reply.get("type") != "closed", "the server dropped the connection"
        after = env.watch.snapshot(workers=True)
        if codes is not None:
            assert_ws_error(reply)
            assert reply["code"] in codes and reply["req_id"] == rid, reply
            assert_unchanged(before, after)
        elif reply["type"] == "error":
            # Well formed, refused by a guard: only the evidence of a report may appear (I3).
            assert reply["req_id"] == rid and reply["code"] not in DECODE_CODES, reply
            assert changed(before.tasks, after.tasks) == set()
            assert changed(before.workers, after.workers) == set()
            assert all(e["kind"] == "rejected" for e in after.new_events(before))
        else:
            # Valid and carried out: only this connection's session and the fuzz queue move.
            assert reply["req_id"] == rid, reply
            allowed = {wire.session_id, reply.get("session_id")} - {None}
            assert changed(before.workers, after.workers) <= allowed
            ours = {t["id"] for t in [*before.tasks.values(), *after.tasks.values()]
                    if t["queue"] == fz.queue}  # fmt: skip
            assert changed(before.tasks, after.tasks) <= ours
            for e in after.new_events(before):
                assert e["session_id"] in allowed or e["task_id"] in ours, e
            if not pre:
                fz.accepted(kind, reply)
        # The connection is still there, and answers the next request in turn.
        if pre and reply["type"] != "welcome":
            follow = wire.call({"type": "claim", "n": 1})
            assert follow["type"] == "error" and follow["code"] == "HELLO_FIRST", follow
        elif pre:
            assert wire.claim() == []
            wire.close()
            fz.pre = None
        elif kind == "drain" and reply["type"] == "ack":
            follow = wire.call({"type": "claim", "n": 1})
            assert follow["type"] in ("tasks", "error") and not follow.get("tasks"), follow
            wire.close()  # a draining session claims nothing more: the next example opens one
            fz.main = None
        else:
            fz.claimed += wire.claim()

    try:
        run()
    finally:
        fz.close()
