"""Workers: the low-level connection (``orbit.worker.connection``)."""

from orbit.worker.connection import ServerError, WorkerConnection

__all__ = ["ServerError", "WorkerConnection"]
