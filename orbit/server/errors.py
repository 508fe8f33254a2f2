"""One error shape for every refusal: ``{"error": {"code", "message", "field"?}}``."""

from __future__ import annotations

import contextlib
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.websockets import WebSocket

from orbit.core.errors import Backpressure, OrbitError
from orbit.protocol.decode import DecodeError, error_message
from orbit.server.metrics import REFUSAL_REASONS
from orbit.store.driver import DatabaseUnavailable

#: The ``Retry-After`` of a 503 for the database's sake (``on_unexpected``), in seconds:
#: the store already waited ``StoreConfig.tx_wait_us`` for a lock before it gave up.
DATABASE_RETRY_AFTER_S = 5


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field  # the query or path parameter at fault, if one is
        self.headers = headers  # sent with the refusal (Retry-After)


def error_response(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, str] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def close_code(status: int) -> int:
    """The WebSocket close code that stands for a refusal's HTTP status where the server
    cannot answer an upgrade with the status itself: 4000 + a 4xx (4401, 4403, 4404…),
    1013 (try again later) for a 503, 1011 (internal error) for anything else."""
    if 400 <= status < 500:
        return 4000 + status
    return 1013 if status == 503 else 1011


async def refuse_upgrade(ws: WebSocket, exc: ApiError) -> None:
    """Refuse a WebSocket upgrade with the status, headers (``Retry-After``) and error body
    an HTTP route would give (uvicorn supports the denial response extension; a 401
    carries ``WWW-Authenticate``, as on the routes); failing that, close with
    ``close_code`` and the code as the reason. Closed before being accepted, the socket
    was answered a bare 403 whatever the refusal: an unknown token looked like a wrong
    scope, and a failed check like a refused token."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
        refusal = error_response(exc.status, exc.code, exc.message, exc.field, headers=headers)
        with contextlib.suppress(Exception):  # the client may be gone already
            await ws.send_denial_response(refusal)
        return
    with contextlib.suppress(Exception):  # a server without the denial response extension
        await ws.close(code=close_code(exc.status), reason=exc.code)


async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
    return error_response(exc.status, exc.code, exc.message, exc.field, headers=headers)


async def on_orbit_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OrbitError)
    headers = None
    if isinstance(exc, Backpressure):
        # A full queue or tenant (429) says when to try again, in whole seconds, and is
        # counted (orbit_refused_submits_total): only submits raise it.
        headers = {"Retry-After": str(exc.retry_after)}
        request.app.state.metrics.refused_submits.labels(REFUSAL_REASONS[exc.code]).inc()
    return error_response(exc.status, str(exc.code), exc.message, exc.field, headers=headers)


async def on_decode_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DecodeError)
    return error_response(400, exc.code, exc.message, exc.field)


async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = tuple(first.get("loc", ()))
    # Bodies are decoded by orbit.protocol, so what fails here is a query or path
    # parameter: name it as the other refusals of a parameter do ("limit", never
    # FastAPI's "query.limit"), so that `field` is one spelling for one parameter.
    if len(loc) > 1 and loc[0] in ("query", "path", "header", "cookie"):
        loc = loc[1:]
    where = ".".join(str(p) for p in loc)
    message = error_message(str(first.get("msg")))
    return error_response(400, "INVALID_ARGUMENT", f"{where}: {message}", where)


async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
    return error_response(exc.status_code, code, str(exc.detail))


async def on_client_gone(request: Request, exc: Exception) -> Response:
    """A client that closed its connection before its body was read whole: routine (a
    timeout, a killed process), so logged at debug, not as an error with a traceback
    (twice: by ``on_unexpected``, then by the server's last resort). The answer reaches
    no one; an empty 400 is what the access log shows."""
    assert isinstance(exc, ClientDisconnect)
    logging.getLogger("orbit.server").debug(
        "%s %s: the client left before its body arrived", request.method, request.url.path
    )
    return Response(status_code=400)


#: Marks an exception ``on_unexpected`` has logged and answered (``LoggedOnce``).
_ANSWERED = "_orbit_answered"


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything unforeseen: logged with its traceback and the request it failed,
    answered in the usual shape.

    A transaction the store gave up on for the database's sake (``DatabaseUnavailable``:
    its lock held by another process past the store's wait, full, read-only, out of
    reach) is no failure of the server's: 503 with its code (``DATABASE_BUSY``,
    ``DATABASE_FULL``, ``DATABASE_READ_ONLY``, ``DATABASE_UNAVAILABLE``), the store's
    words, which name no path or host, and ``Retry-After``; the store logged it. It was
    500 ``INTERNAL``, "the server could not process this request", and only the server's
    log said the disk was full."""
    if isinstance(exc, DatabaseUnavailable):
        logging.getLogger("orbit.server").debug(
            "%s %s: %s", request.method, request.url.path, exc.code
        )
        setattr(exc, _ANSWERED, True)  # Starlette re-raises it past this answer
        return error_response(
            503, exc.code, exc.message, headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)}
        )
    logging.getLogger("orbit.server").error(
        "request failed: %s %s", request.method, request.url.path, exc_info=exc
    )
    with contextlib.suppress(AttributeError, TypeError):  # one that takes no attribute
        setattr(exc, _ANSWERED, True)
    return error_response(500, "INTERNAL", "the server could not process this request")


class LoggedOnce(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for an exception
    ``on_unexpected`` has logged and answered. Starlette's outermost middleware re-raises
    after the handler's answer (for the server's last resort), so every 500 was logged
    twice, two tracebacks, and an alert counting errors counted each failure twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        failed = record.exc_info[1] if record.exc_info else None
        return not getattr(failed, _ANSWERED, False)


def log_each_failure_once() -> None:
    """Put ``LoggedOnce`` on uvicorn's error logger, once however many apps are made."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, LoggedOnce) for f in logger.filters):
        logger.addFilter(LoggedOnce())
