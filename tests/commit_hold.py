"""A PostgreSQL transaction stopped in its ``COMMIT`` (or in a statement before it) and
its connection terminated there, as ``pg_terminate_backend`` or a database restart does
to a call in flight: the node's answer can no longer say whether the change committed.

A trigger of the test's own database waits, at the statement or (``deferred``) at
``COMMIT``, for an advisory lock the test holds; ``Held.terminate`` waits for a backend
to wait for it and terminates that backend."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

#: the advisory lock the trigger waits for
HOLD_KEY = 72_001
#: a safety net: the backend waits for the lock within milliseconds of the call
WAIT_S = 30.0


@dataclass
class Held:
    admin: psycopg.Connection[tuple[object, ...]]

    def terminate(self) -> int:
        """Wait for a backend to wait for ``HOLD_KEY`` (the held transaction), terminate
        it, and return its pid. Well within ``lock_timeout`` (5 s), past which the wait
        would fail as a lock's and be tried again."""
        deadline = time.monotonic() + WAIT_S
        while True:
            row = self.admin.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND objid = %s AND database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())",
                (HOLD_KEY,),
            ).fetchone()
            if row is not None:
                self.admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
                return int(str(row[0]))
            assert time.monotonic() < deadline, "no transaction reached the trigger"
            time.sleep(0.005)  # a poll of pg_locks: PostgreSQL says nothing of a waiter


@contextmanager
def commit_held(url: str, table: str, *, deferred: bool = True) -> Iterator[Held]:
    """A trigger on ``table`` that waits for ``HOLD_KEY`` after each insert (at the
    transaction's ``COMMIT`` if ``deferred``), and the lock held meanwhile."""
    with psycopg.connect(url, autocommit=True) as admin:
        timing = "DEFERRABLE INITIALLY DEFERRED" if deferred else "NOT DEFERRABLE"
        admin.execute(
            "CREATE OR REPLACE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS"
            f" $$ BEGIN PERFORM pg_advisory_xact_lock({HOLD_KEY}); RETURN NULL; END $$"
        )
        admin.execute(
            f"CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON {table} {timing}"
            " FOR EACH ROW EXECUTE FUNCTION hold_commit()"
        )
        admin.execute("SELECT pg_advisory_lock(%s)", (HOLD_KEY,))
        try:
            yield Held(admin)
        finally:
            admin.execute("SELECT pg_advisory_unlock(%s)", (HOLD_KEY,))
            admin.execute(f"DROP TRIGGER hold_commit ON {table}")
