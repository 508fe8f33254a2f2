"""Orbit: durable job execution for Python.

``Client``/``AsyncClient`` submit and follow tasks over the HTTP API; ``Worker`` runs
handlers under leases; ``Retry`` and ``Fail`` let a handler choose its outcome.

The client names are loaded on first use: they bring httpx, whose import (with the
command-line tools it pulls in when they are installed) took a third of a worker
process's start, and a worker never calls the HTTP API.
"""

from __future__ import annotations

import typing

from orbit.worker.runner import Cancelled, Context, Fail, Retry, Worker

if typing.TYPE_CHECKING:
    from orbit.client import AsyncClient, Client, TaskFailed

_CLIENT_NAMES = frozenset({"AsyncClient", "Client", "TaskFailed"})

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "Context",
    "Fail",
    "Retry",
    "TaskFailed",
    "Worker",
]


def __getattr__(name: str) -> typing.Any:
    if name in _CLIENT_NAMES:
        from orbit import client

        value = getattr(client, name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module 'orbit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
