"""The ASGI application: wiring of store, routes, gateway and background duties."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from orbit.aio import stop_tasks
from orbit.core.errors import OrbitError
from orbit.core.model import Queue
from orbit.protocol.decode import DecodeError
from orbit.server import artifacts, errors
from orbit.server.announce import Announcer
from orbit.server.auth import TokenCheck
from orbit.server.direct import DirectRoutes
from orbit.server.errors import ApiError
from orbit.server.gates import SubmitGates
from orbit.server.gateway import Dispatcher, PassSkips, worker_endpoint
from orbit.server.listen import ListenLink, listen
from orbit.server.metrics import Metrics
from orbit.server.revocation import Revocations
from orbit.server.routes import router, task_submit, task_submit_batch
from orbit.server.streams import Streams
from orbit.store import Store, StoreConfig, open_store
from orbit.store.driver import DatabaseUnavailable
from orbit.tokens import CACHE_SECONDS

log = logging.getLogger("orbit.server")

#: the endpoints served by DirectRoutes (orbit/server/direct.py): the submits
DIRECT = (task_submit, task_submit_batch)


@dataclass
class ServerSettings:
    db_url: str
    node_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    poll_interval: float = 5.0  # the dispatch fallback; notifications do the real work
    reap_interval: float = 1.0
    #: how often this node looks for due schedules (``_scheduler``); every node does
    schedule_interval: float = 1.0
    max_body_bytes: int = 16 * 1024 * 1024
    token_cache_s: float = CACHE_SECONDS  # how long a token check's answer is trusted
    max_streams: int = 100  # event streams open at once on this node (orbit.server.streams)
    stream_poll_s: float = 2.0  # the safety net under the wakes (orbit.server.streams)
    stream_keepalive_s: float = 15.0  # an idle stream's comment, so proxies keep it open
    #: a stream whose client has not taken a message within this is closed (its slot freed)
    stream_send_timeout_s: float = 30.0
    store_config: StoreConfig = field(default_factory=StoreConfig)


class RefuseOddUrlsMiddleware:
    """A NUL in the path or query can reach no database column: refuse it up front. An
    encoded ``/`` (``%2F``) in the path is refused too: routes match the decoded path, so
    ``GET /v1/tasks/x%2Fevents`` was answered as task ``x``'s events, and no id or name
    may hold a ``/``.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware
    runs every request through an extra task and memory streams, about 0.3 ms of CPU a
    request, which a single submit felt.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope.get("raw_path", b"")
            raw = path + b"?" + scope.get("query_string", b"")
            refusal = None
            if b"%00" in raw or b"\x00" in raw:
                refusal = ApiError(400, "NUL_CHARACTER", "the URL holds a NUL character")
            elif b"%2f" in path.lower():
                refusal = ApiError(
                    400, "INVALID_ARGUMENT", "the URL's path holds an encoded '/' (%2F)"
                )
            if refusal is None:
                pass
            elif scope["type"] == "websocket":  # an event stream's task id, say
                await errors.refuse_upgrade(WebSocket(scope, receive, send), refusal)
                return
            else:
                response = errors.error_response(refusal.status, refusal.code, refusal.message)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: how long /readyz and /metrics wait for the database before they answer 503: longer
#: than a healthy read takes, shorter than the connection pool's own wait (30 s) or a
#: probe's (or a scrape's) timeout
READY_TIMEOUT_S = 2.0
T = TypeVar("T")


class BoundedRead(Generic[T]):
    """A database read for a probe, bounded by ``READY_TIMEOUT_S``: with the database gone
    the pool waits 30 s for a connection, far past any probe's patience, and the probe
    hung (then /metrics answered 500). One read at a time: a probe that comes while one
    still waits shares it rather than tying up another thread of the pool that artifacts
    and metrics stream through. /readyz and /metrics each have one."""

    def __init__(self) -> None:
        self._read: asyncio.Task[T] | None = None

    async def __call__(self, read: Callable[[], T]) -> T:
        """``read()``'s value, or TimeoutError (or the read's own error)."""
        task = self._read
        if task is None or task.done():
            task = self._read = asyncio.create_task(run_in_threadpool(read))
            task.add_done_callback(_retrieve)
        return await asyncio.wait_for(asyncio.shield(task), READY_TIMEOUT_S)


def _retrieve(future: asyncio.Task[Any]) -> None:
    """Mark the failure of a read no probe waits for any more as seen (asyncio would log
    it as never retrieved)."""
    if not future.cancelled():
        future.exception()


def unavailable(exc: Exception, store: Store) -> JSONResponse:
    """/readyz's and /metrics' answer when the database did not answer in time (a
    TimeoutError) or failed: the exception's type only, whose text could name a host.
    A wait that ran out because PostgreSQL refuses every new connection (a database
    closed to connections, a password changed) says so, in the server's words (the
    driver's ``connect_refusal``, which holds no host or URL): it was reported as a
    database that did not answer, which sent its operator looking at the network."""
    reason = type(exc).__name__
    timed_out = isinstance(exc, TimeoutError)
    refused = store.driver.connect_refusal() if timed_out else None
    if refused is not None:
        reason, said = refused
        message = f"the database refuses connections: {said}"
    elif timed_out:
        message = f"the database did not answer within {READY_TIMEOUT_S:g} s"
    elif isinstance(exc, DatabaseUnavailable):  # the store's reading of the driver's error
        reason, message = exc.code, exc.message
    else:
        message = f"the database could not be read ({reason})"
    return JSONResponse(
        {"status": "unavailable", "reason": reason, "message": message},
        status_code=503,
    )


#: the shortest pause between two reaper passes (a pass that left due work behind, such
#: as more expired leases than one batch holds, runs again after this)
REAP_MIN_GAP_S = 0.01
#: how long after a due instant the reaper wakes, so that its pass reads a clock past it
REAP_MARGIN_S = 0.005
#: work overdue by more than this that a pass left untouched is held by another node or
#: transaction: the reaper then waits its whole interval instead of spinning on it
REAP_STUCK_S = 0.1


def reap_delay(interval: float, due_in: float | None, *, did_work: bool) -> float:
    """How long the reaper sleeps after a pass: until just after the soonest due instant
    (``due_in`` seconds from now, by the store's clock), at most ``interval``."""
    if due_in is None:
        return interval
    if due_in < -REAP_STUCK_S and not did_work:
        return interval
    return min(interval, max(due_in + REAP_MARGIN_S, REAP_MIN_GAP_S))


async def _reaper(store: Store, interval: float, metrics: Metrics) -> None:
    # Never asleep for longer than the shortest claim, lease or session TTL: a full
    # claim, lease or session made while the reaper sleeps is read by its next pass before
    # it falls due. What falls due sooner (a retry's backoff, a deadline, a lease a
    # deadline or timeout cuts short) waits for that pass, at most ``interval``; claim,
    # start and finish read the clock themselves, so nothing runs past its instant.
    config = store.config
    shortest = min(config.claim_ttl_us, config.lease_ttl_us, config.session_ttl_us)
    interval = min(interval, shortest / 1_000_000)
    skips = PassSkips("reaper", interval)
    while True:
        delay = interval
        try:
            report = await run_in_threadpool(store.reap)
            if report.expired_leases:
                metrics.lease_expiries.inc(report.expired_leases)
            due_in = await run_in_threadpool(store.reap_due_in)
            delay = reap_delay(interval, due_in, did_work=report.total > 0)
            skips.ran()
        except DatabaseUnavailable as exc:
            skips.skipped(exc)
        except Exception:
            log.exception("reaper pass failed")
        await asyncio.sleep(delay)


async def _scheduler(store: Store, interval: float) -> None:
    """Fire the schedules due now, every ``interval`` seconds, on every node: each fire
    is its own transaction, which locks its schedule's row and skips one another node's
    fire holds (``Store.schedule_fire``), so nodes share the work and never fire one
    instant twice. A pass works about a second at most (``SCHEDULE_PASS_S``), and one
    that fired something runs again at once: a schedule catching up after a downtime
    fires one instant per transaction and per round, and the instants that come due
    meanwhile, on time, between its rounds."""
    skips = PassSkips("schedule", interval)
    while True:
        delay = interval
        try:
            made = await run_in_threadpool(store.schedule_fire_due)
            if made:
                delay = 0
            skips.ran()
        except DatabaseUnavailable as exc:
            skips.skipped(exc)
        except Exception:
            log.exception("schedule pass failed")
        await asyncio.sleep(delay)


def _events_committed(streams: Streams, announcer: Announcer | None, notified: bool) -> None:
    """``Store.on_events``, in the committing thread: wake this node's streams, and (on
    PostgreSQL) the other nodes' by an ``orbit_events`` notice if the commit sent them
    none of its own (which wakes them too)."""
    streams.wake_threadsafe()
    if announcer is not None and not notified:
        announcer.announce_threadsafe()


def create_app(settings: ServerSettings, store: Store | None = None) -> FastAPI:
    """Build the app. The store is opened (and migrated) at startup unless given."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal store
        own = store is None
        if store is None:
            store = await run_in_threadpool(open_store, settings.db_url, settings.store_config)
        metrics = Metrics(store)
        dispatcher = Dispatcher(store, settings.poll_interval, metrics)
        dispatcher.bind(asyncio.get_running_loop())
        app.state.store = store
        app.state.tokens = tokens = TokenCheck(store, settings.token_cache_s)
        revocations = Revocations(dispatcher, tokens)
        revocations.bind(asyncio.get_running_loop())
        app.state.dispatcher = dispatcher
        app.state.metrics = metrics
        app.state.submit_gates = SubmitGates()
        # Wake this node's dispatcher in-process after each of its own commits. On
        # PostgreSQL the same commit also sends NOTIFY, which wakes the other nodes (this
        # one skips its own): the local wake saves the round trip through the LISTEN
        # connection on the submit-to-start path.
        store.on_ready = dispatcher.wake_threadsafe
        store.on_freed = dispatcher.freed_threadsafe
        if store.backend == "sqlite":  # one process: cancels are pushed in-process too
            store.on_cancel = dispatcher.cancel_threadsafe
        # A revoke through this node closes its connections at once (any backend: a node
        # skips its own NOTIFY); the re-check catches those it never heard of.
        store.on_revoked = revocations.revoked_threadsafe
        # A commit of events wakes this node's streams in-process (the only wake on
        # SQLite, one server per file); on PostgreSQL the other nodes hear of it by the
        # commit's own notice, or else by this node's coalesced orbit_events.
        streams: Streams = app.state.streams
        streams.bind(asyncio.get_running_loop())
        announcer = None
        if store.backend == "postgres":
            announcer = Announcer(store.driver.dsn, store.origin)  # type: ignore[attr-defined]
            announcer.bind(asyncio.get_running_loop())
        store.on_events = partial(_events_committed, streams, announcer)
        tasks = [
            asyncio.create_task(dispatcher.run(), name="dispatch"),
            asyncio.create_task(_reaper(store, settings.reap_interval, metrics), name="reap"),
            asyncio.create_task(revocations.run(), name="revocations"),
            asyncio.create_task(_scheduler(store, settings.schedule_interval), name="schedule"),
        ]
        if store.backend == "postgres":  # every node hears the others' NOTIFY
            dsn: str = store.driver.dsn  # type: ignore[attr-defined]
            app.state.listen_link = link = ListenLink(metrics.listen_connected)
            listening = listen(dsn, store.origin, dispatcher, revocations, streams.wake, link)
            tasks.append(asyncio.create_task(listening, name="listen"))
        if announcer is not None:
            tasks.append(asyncio.create_task(announcer.run(), name="announce"))
        # SQLite's file, absolute: sqlite:///x.db is relative to the working directory
        path = getattr(store.driver, "path", ":memory:")
        serving = f"sqlite {os.path.abspath(path)}" if path != ":memory:" else store.backend
        log.info("orbit node %s serving on %s", settings.node_id, serving)
        try:
            yield
        finally:
            await stop_tasks(tasks)  # the dispatcher, the reaper, schedules and LISTEN, for certain
            if own:
                await run_in_threadpool(store.close)

    app = FastAPI(
        title="Orbit",
        version="0.1.0",
        lifespan=lifespan,
        description="Durable job execution: the control plane API.",
        # FastAPI's built-in OpenTelemetry checks the global providers on every request
        # (about a tenth of a single submit's server time) and would export exception
        # messages and traces from this process; Orbit exposes /metrics instead.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    served_openapi = app.openapi

    def openapi_with_bearer() -> dict[str, Any]:
        """FastAPI's document, with the bearer token every /v1 route takes: /docs then
        offers to authorize, and its calls carry the token (each was a 401); and
        without the 422 FastAPI adds to each route with a parameter, which this server
        never sends (a bad parameter is 400 INVALID_ARGUMENT: ``on_validation_error``)."""
        document = served_openapi()
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                if isinstance(operation, dict):
                    operation.get("responses", {}).pop("422", None)
        schemas = document.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        document.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}
        }
        document["security"] = [{"bearer": []}]
        return document

    app.openapi = openapi_with_bearer  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.streams = Streams(
        settings.max_streams,
        settings.stream_poll_s,
        settings.stream_keepalive_s,
        settings.stream_send_timeout_s,
    )
    app.add_exception_handler(ApiError, errors.on_api_error)
    app.add_exception_handler(OrbitError, errors.on_orbit_error)
    app.add_exception_handler(DecodeError, errors.on_decode_error)
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.on_http_error)
    app.add_exception_handler(ClientDisconnect, errors.on_client_gone)
    app.add_exception_handler(Exception, errors.on_unexpected)
    errors.log_each_failure_once()

    app.include_router(router)
    app.include_router(artifacts.router)
    app.add_api_websocket_route("/v1/worker", worker_endpoint)

    # The last added is the outermost: NUL refusal, then the direct submit routes.
    direct = [r for r in router.routes if isinstance(r, APIRoute) and r.endpoint in DIRECT]
    assert len(direct) == len(DIRECT), "every direct endpoint is a route of the /v1 router"
    app.add_middleware(DirectRoutes, routes=direct)
    app.add_middleware(RefuseOddUrlsMiddleware)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        """The address ``orbit dev`` and ``orbit server`` print, opened in a browser: the
        API's pages, where it answered 404."""
        return RedirectResponse("/docs", status_code=307)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok", "node_id": settings.node_id})

    ready: BoundedRead[list[Queue]] = BoundedRead()
    scrape: BoundedRead[bytes] = BoundedRead()

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        store: Store = request.app.state.store
        try:
            await ready(store.queue_list)
        except Exception as exc:  # TimeoutError: the database did not answer in time
            return unavailable(exc, store)
        # A database that answers reads may still refuse writes (full, read-only): not
        # ready while the store's writes give up (``Store.write_failure``, noted as they
        # fail: no write here). Ready, it took traffic every write of which failed. A
        # lock another session holds is not noted: every node meets the same lock.
        failing = store.write_failure()
        if failing is not None:
            reason, message = failing
            return JSONResponse(
                {"status": "unavailable", "reason": reason, "message": message},
                status_code=503,
            )
        # PostgreSQL's LISTEN connection away (refused, lost): said in the body, and the
        # node stays ready. It serves every request as well without it; only the other
        # nodes' wakes and cancels come by its polls meanwhile (seconds late), and a
        # database that refuses connections would take every node's LISTEN away at once:
        # not ready for it, a balancer would be left no node (docs/operations.md).
        link: ListenLink | None = getattr(request.app.state, "listen_link", None)
        down = None if link is None else link.down()
        if down is not None:
            return JSONResponse({"status": "ready", "listen": down})
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics_route(request: Request) -> Response:
        # The gauges read the database (orbit.server.metrics): bounded as /readyz is
        try:
            body = await scrape(partial(generate_latest, request.app.state.metrics.registry))
        except Exception as exc:
            return unavailable(exc, request.app.state.store)
        return PlainTextResponse(body.decode(), media_type="text/plain; version=0.0.4")

    @app.get("/schema/{name}", include_in_schema=False)
    async def schema(name: str) -> Response:
        from orbit.protocol.schema import schemas

        docs = schemas()
        if name not in docs:
            raise ApiError(404, "NOT_FOUND", f"no schema named {name!r:.60}")
        return JSONResponse(docs[name])

    return app
