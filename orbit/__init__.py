"""Orbit: durable job execution for Python.

``Client``/``AsyncClient`` submit and follow tasks over the HTTP API; ``Worker`` runs
handlers under leases; ``Retry`` and ``Fail`` let a handler choose its outcome.
"""

from orbit.client import AsyncClient, Client, TaskFailed
from orbit.worker.runner import Cancelled, Context, Fail, Retry, Worker

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
