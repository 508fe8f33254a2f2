"""The PgQueuer worker process of the benchmark.

Started by :class:`benchmarks.systems.pgqueuer_system.PgQueuerSystem` as
``python -m benchmarks.systems.pgqueuer_worker --batch-size N ...``. It runs PgQueuer's
documented programmatic entry ``pgqueuer.run(factory, ...)``, which its docs call
equivalent to ``pgq run module:factory``. The CLI itself cannot be used here: in
pgqueuer 1.6.0 with the installed typer 0.29, ``pgq run`` crashes while parsing its own
``--log-level`` default (``AttributeError: 'str' object has no attribute 'name'``).
Like the CLI, it runs the loop on uvloop when uvloop is installed.

The factory opens one direct database connection and registers one entrypoint whose
handler is the shared body :func:`benchmarks.recorder.run_async`. The connection is
asyncpg's when asyncpg is installed: PgQueuer's docs use it throughout and tell to run the
QueueManager on a direct asyncpg connection. Without asyncpg it is a psycopg async
connection in autocommit mode, which PgQueuer also supports, but its psycopg driver
waits for notifications holding the connection for up to a second at a time, so a worker
whose jobs are not all done at once (I/O-bound jobs, a concurrency cap) stalls for up to a
second between claims. ``BENCH_PGQUEUER_DRIVER`` names the driver to use.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from typing import Any

import pgqueuer
import psycopg
from pgqueuer import PgQueuer
from pgqueuer.models import Job

from benchmarks import recorder

#: the database the harness created for this run (a postgresql:// URL: asyncpg reads
#: only URLs)
DSN_ENV = "BENCH_PGQUEUER_DSN"
#: "asyncpg" or "psycopg"
DRIVER_ENV = "BENCH_PGQUEUER_DRIVER"
#: the one entrypoint every benchmark job is enqueued to
ENTRYPOINT = "bench"


def default_driver() -> str:
    """The driver PgQueuer's docs prefer if it is installed, else psycopg."""
    return "asyncpg" if importlib.util.find_spec("asyncpg") is not None else "psycopg"


@asynccontextmanager
async def create_pgqueuer() -> AsyncIterator[PgQueuer]:
    """The factory PgQueuer enters: 1.6 requires an async context manager.

    The connection is closed on the way out, after PgQueuer has stopped the manager.
    """
    dsn = os.environ[DSN_ENV]
    async with AsyncExitStack() as stack:
        if os.environ.get(DRIVER_ENV, default_driver()) == "asyncpg":
            import asyncpg

            connection = await asyncpg.connect(dsn)
            stack.push_async_callback(connection.close)
            pgq = PgQueuer.from_asyncpg_connection(connection)
        else:
            aconnection = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            stack.push_async_callback(aconnection.close)
            pgq = PgQueuer.from_psycopg_connection(aconnection)

        @pgq.entrypoint(ENTRYPOINT)
        async def bench(job: Job) -> None:
            # The payload is the JSON the system enqueued; decode it back to the dict the
            # shared handler body expects.
            assert job.payload is not None
            await recorder.run_async(json.loads(job.payload))

        yield pgq


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The ``pgq run`` options the benchmark sets, with the same names and defaults."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--dequeue-timeout", type=float, default=30.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0)
    parser.add_argument("--max-concurrent-tasks", type=int, default=None)
    return parser.parse_args(argv)


def _run_loop(coro: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when it is installed, as ``pgq run`` does."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    _run_loop(
        pgqueuer.run(
            create_pgqueuer,
            batch_size=args.batch_size,
            dequeue_timeout=timedelta(seconds=args.dequeue_timeout),
            heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
            max_concurrent_tasks=args.max_concurrent_tasks,
        )
    )


if __name__ == "__main__":
    main()
