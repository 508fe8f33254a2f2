"""The submit routes served straight to their endpoints.

For each request FastAPI matches the path against every route, solves the route's
dependencies, opens an exit stack and runs the endpoint inside its exception middleware:
for one submit that machinery was about a third of the server's CPU (py-spy, a submit at
a time at 100/s), as much as the store's transaction. The submit endpoints take nothing
but the request and depend only on the token check, so for their exact method and path
this middleware makes the same check, calls the same endpoint, and answers an error with
the app's own handler for it. Every other request goes through FastAPI, which also still
describes these routes in the OpenAPI document.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


def _served(route: APIRoute) -> tuple[Endpoint, str]:
    """The route's endpoint and the token scope it requires, or why it cannot be served
    directly (anything FastAPI would resolve that this middleware does not)."""
    params = list(inspect.signature(route.endpoint).parameters)
    if params != ["request"]:
        raise ValueError(f"{route.path}: a direct route takes only the request")
    scopes = [getattr(d.dependency, "orbit_scope", None) for d in route.dependencies]
    if len(scopes) != 1 or scopes[0] is None or route.dependant.dependencies[1:]:
        raise ValueError(f"{route.path}: a direct route depends on one token check only")
    return route.endpoint, scopes[0]


class DirectRoutes:
    """Serves the given routes without FastAPI's routing and dependency machinery."""

    def __init__(self, app: ASGIApp, routes: Sequence[APIRoute]) -> None:
        self.app = app
        self._routes: dict[tuple[str, str], tuple[Endpoint, str]] = {}
        for route in routes:
            served = _served(route)
            for method in route.methods or ():
                self._routes[(method, route.path)] = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hit = self._routes.get((scope.get("method", ""), scope.get("path", "")))
        if scope["type"] != "http" or hit is None:
            await self.app(scope, receive, send)
            return
        endpoint, token_scope = hit
        request = Request(scope, receive, send)
        try:
            await request.app.state.tokens.require(request.headers, token_scope)
            response = await endpoint(request)
        except Exception as exc:
            handler = _handler(request.app.exception_handlers, exc)
            if handler is None:
                raise  # the app's last resort (ServerErrorMiddleware) answers and logs it
            response = await handler(request, exc)
        await response(scope, receive, send)


def _handler(handlers: dict[Any, Any], exc: Exception) -> Any:
    """The app's handler for this error, as its exception middleware would pick it; not
    the catch-all for ``Exception``, which belongs to the outermost middleware."""
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None
