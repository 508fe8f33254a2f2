"""The Python SDK: ``Client`` (sync) and ``AsyncClient`` over the HTTP API."""

from orbit.client._client import AsyncClient, Client
from orbit.client._errors import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    TaskFailed,
    TooLarge,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    WaitTimeout,
)
from orbit.client._http import Unreachable
from orbit.tokens import TokenError

__all__ = [
    "ApiError",
    "AsyncClient",
    "BadRequest",
    "Client",
    "Conflict",
    "Forbidden",
    "NotFound",
    "TaskFailed",
    "TokenError",
    "TooLarge",
    "TooManyRequests",
    "Unauthorized",
    "Unavailable",
    "Unreachable",
    "WaitTimeout",
]
