"""Orbit: durable job execution for Python.

``Client``/``AsyncClient`` submit and follow tasks over the HTTP API; ``Worker`` runs
handlers under leases; ``Retry`` and ``Fail`` let a handler choose its outcome.

Every name is loaded on first use. The client names bring httpx, whose import (with the
command-line tools it pulls in when they are installed) took a third of a worker
process's start, and a worker never calls the HTTP API. The worker names bring the
worker runtime (asyncio, websockets), which no server and no ``orbit task|queue|…``
command uses: imported with the package, it was about a third of each such command's
start (0.12 of 0.35 s).
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from orbit.client import AsyncClient, Client, TaskFailed
    from orbit.worker.runner import Cancelled, Context, Fail, Retry, Worker

#: each public name, and the module it is loaded from on first use
_HOMES = {
    "AsyncClient": "orbit.client",
    "Client": "orbit.client",
    "TaskFailed": "orbit.client",
    "Cancelled": "orbit.worker.runner",
    "Context": "orbit.worker.runner",
    "Fail": "orbit.worker.runner",
    "Retry": "orbit.worker.runner",
    "Worker": "orbit.worker.runner",
}

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
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module 'orbit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
