"""A batch submit's tasks read a chunk at a time, inside the store's transaction.

A batch of 1,000 tasks was read whole (4-6 ms of the server's time for the protocol's
reader, then 2-3.5 ms for the payloads' canonical spelling) before its transaction
began, and PostgreSQL waited for all of it. The transaction itself needs only the
batch's queues, parents and idempotency keys before its first chunk of rows; the rest of
each task can be read while the database inserts the chunk before it. A ``LazyBatch``
knows those up front, having checked them, and reads the rest on demand: a task that the
reader cannot take raises ``UnusualTask``, the transaction rolls back with nothing
written, and the caller reads the batch the strict way, which names the rule it broke.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from orbit.core.model import TaskSpec


class UnusualTask(Exception):
    """A task of a ``LazyBatch`` that its reader cannot take: the strict path decides."""

    def __init__(self, index: int) -> None:
        super().__init__(f"task {index} is not in the usual shape")
        self.index = index


class LazyBatch(ABC):
    """The tasks of one batch submit, read a chunk at a time by ``read``. ``queues``,
    ``tenants``, ``parents`` and ``keys`` (each ``(tenant, queue, idempotency_key)``) are
    every task's, already checked by the rules each task's fields are read under."""

    queues: frozenset[str]
    tenants: frozenset[str]
    parents: frozenset[str]
    keys: frozenset[tuple[str, str, str]]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, start: int, end: int) -> list[TaskSpec]:
        """The specs of tasks ``start`` to ``end`` (every field checked but the payload,
        which the store spells and checks itself); ``UnusualTask`` for one that cannot
        be read so. The same tasks may be read more than once (a retried transaction; a
        batch naming a cancelled parent is read whole before its chunks), and must read
        the same each time."""

    def first_naming(self, field: str, value: str) -> int | None:
        """The index of the first task whose ``field`` (``queue``, ``parent_id``) is
        ``value``, or None: a refusal of that value (no such queue, no such parent) names
        that task. Read whole here; a reader that holds the tasks as sent looks there,
        reading no chunk."""
        for index, spec in enumerate(self.read(0, len(self))):
            if getattr(spec, field) == value:
                return index
        return None
