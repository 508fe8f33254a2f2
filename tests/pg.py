"""Throwaway PostgreSQL databases for tests: created on the local server (or the one
``ORBIT_TEST_PG_DSN`` names) and dropped afterwards, so runs never collide."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ADMIN_DSN = os.environ.get("ORBIT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def temporary_database(prefix: str = "orbit_test") -> Iterator[str]:
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    params = conninfo_to_dict(ADMIN_DSN)
    params["dbname"] = name
    try:
        yield make_conninfo(**params)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def as_url(dsn: str) -> str:
    """A libpq key=value string as a postgresql:// URL the store accepts."""
    p = conninfo_to_dict(dsn)
    user = p.get("user", "postgres")
    host = p.get("host", "127.0.0.1")
    port = p.get("port", "5432")
    auth = user if not p.get("password") else f"{user}:{p['password']}"
    return f"postgresql://{auth}@{host}:{port}/{p['dbname']}"


def postgres_migrations_up_to(version: int, into: Path) -> Path:
    """A directory holding PostgreSQL's migrations 1..``version`` only: a store opened
    on it builds an older schema, for a test of the migration after it."""
    from orbit.store.postgres import driver

    into.mkdir()
    for path in sorted((Path(driver.__file__).parent / "migrations").glob("*.sql")):
        if int(path.name.split("_")[0]) <= version:
            shutil.copy(path, into / path.name)
    return into
