"""Shared fixtures. Every store test runs on SQLite and on PostgreSQL (ids name the
backend); the PostgreSQL database is created for the run and dropped after it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.logging import LogCaptureHandler

from orbit.logs import RedactSecrets
from orbit.store import Store, StoreConfig, open_store
from tests.pg import as_url, temporary_database

#: no secret in a test's report: every hook of the plugin (a failed report's text, a
#: warning's message), loaded whole rather than imported hook by hook
pytest_plugins = ["tests.redacted_reports"]

BACKENDS = ["sqlite", "postgres"]
TABLES = [
    "orbit_schedules",
    "orbit_artifact_chunks",
    "orbit_artifacts",
    "orbit_tokens",
    "orbit_events",
    "orbit_attempts",
    "orbit_tasks",
    "orbit_sessions",
    "orbit_queues",
    "orbit_tenants",
    "orbit_settings",
]
T0 = 1_800_000_000_000_000  # a fixed instant (2027-01-15) in microseconds


class ManualClock:
    """A clock the test moves by hand; the store reads it instead of the database's."""

    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> int:
        self.now += int(seconds * 1_000_000)
        return self.now


@pytest.fixture(autouse=True)
def _root_logger_put_back() -> Iterator[None]:
    """A command run in this process (typer's ``CliRunner``) configures logging as a real
    one does: ``orbit.logs.configure`` replaces the root logger's handlers with one on
    the test's stderr, closed once the test ends, whose redaction filter moves each
    record's traceback into its text. Every later test in the process then saw its
    records without ``exc_info``, and pytest's own session handlers were gone. Put the
    root logger back: no handler of Orbit's, pytest's session handlers (its per-phase
    capture handlers are its own to add and remove), the level it had."""
    root = logging.getLogger()
    level = root.level
    session = [h for h in root.handlers if not isinstance(h, LogCaptureHandler)]
    yield
    for handler in root.handlers[:]:
        if any(isinstance(f, RedactSecrets) for f in handler.filters):
            root.removeHandler(handler)
    for handler in session:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with temporary_database() as dsn:
        url = as_url(dsn)
        open_store(url).close()  # migrate once
        yield url


def _truncate(store: Store) -> None:
    if store.backend == "postgres":
        import psycopg

        with psycopg.connect(store_url(store), autocommit=True) as cx:
            cx.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")


_URLS: dict[int, str] = {}


def store_url(store: Store) -> str:
    return _URLS[id(store)]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    """Factory: ``make_store(clock=..., config=...)`` opens a fresh, empty store."""
    opened: list[Store] = []

    def factory(clock: ManualClock | None = None, config: StoreConfig | None = None) -> Store:
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path}/orbit-{len(opened)}.db"
        else:
            url = request.getfixturevalue("pg_url")
        store = open_store(url, config, clock=clock)
        _URLS[id(store)] = url
        if backend == "postgres" and not opened:
            _truncate(store)
        opened.append(store)
        return store

    yield factory
    for s in opened:
        s.close()


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database of the test's own, not the run's shared PostgreSQL one: for a test
    that changes its schema (a migration from an older one, a table altered, a version
    from the future) and would break every later store."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path}/orbit.db"
    else:
        with temporary_database() as dsn:
            yield as_url(dsn)


@pytest.fixture
def store(make_store: object, clock: ManualClock) -> Store:
    return make_store(clock=clock)  # type: ignore[operator]
