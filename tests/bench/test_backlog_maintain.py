"""After the backlog's bulk fill, a system's own database is vacuumed, analysed and
checkpointed (``System.maintain`` via ``base.vacuum_checkpoint``) before any timed run."""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from benchmarks.systems import base
from benchmarks.systems.orbit_system import OrbitSystem
from benchmarks.systems.pgqueuer_system import PgQueuerSystem
from benchmarks.systems.procrastinate_system import ProcrastinateSystem
from tests.pg import ADMIN_DSN


@pytest.fixture
def database() -> Iterator[str]:
    name = f"bench_fix_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = base.create_database(ADMIN_DSN, name)
    try:
        yield url
    finally:
        base.drop_database(ADMIN_DSN, name)


def test_a_postgresql_database_is_vacuumed_analysed_and_checkpointed(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as cx:
        cx.execute("CREATE TABLE q (id bigint PRIMARY KEY, v text)")
        cx.execute("INSERT INTO q SELECT i, 'x' FROM generate_series(1, 5000) AS i")
        cx.execute("UPDATE q SET v = 'y' WHERE id % 2 = 0")  # dead row versions
        before = cx.execute("SELECT checkpoints_req FROM pg_stat_bgwriter").fetchone()

    done = base.vacuum_checkpoint(database)

    assert done["vacuum_analyze_s"] >= 0 and done["checkpoint_s"] >= 0
    with psycopg.connect(database, autocommit=True) as cx:
        row = cx.execute(
            "SELECT last_vacuum IS NOT NULL, last_analyze IS NOT NULL, n_dead_tup"
            " FROM pg_stat_user_tables WHERE relname = 'q'"
        ).fetchone()
        after = cx.execute("SELECT checkpoints_req FROM pg_stat_bgwriter").fetchone()
    assert row == (True, True, 0)
    assert before is not None and after is not None and after[0] > before[0]


def test_a_sqlite_database_is_analysed_and_its_wal_checkpointed(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    cx = sqlite3.connect(path, isolation_level=None)
    cx.execute("PRAGMA journal_mode = WAL")
    cx.execute("CREATE TABLE q (id INTEGER PRIMARY KEY, v TEXT)")
    cx.execute("CREATE INDEX q_v ON q (v)")
    cx.executemany("INSERT INTO q (v) VALUES (?)", [("x",)] * 500)
    assert Path(f"{path}-wal").stat().st_size > 0

    done = base.vacuum_checkpoint(f"sqlite:///{path}")

    assert done["wal_checkpoint"][0] == 0  # not busy: the whole log went into the file
    assert Path(f"{path}-wal").stat().st_size == 0  # TRUNCATE
    assert cx.execute("SELECT count(*) FROM sqlite_stat1").fetchone()[0] > 0  # analysed
    cx.close()


@pytest.mark.parametrize(
    ("system", "attribute"),
    [
        (OrbitSystem("postgres"), "_db_url"),
        (OrbitSystem("sqlite"), "_db_url"),
        (PgQueuerSystem(), "_dsn"),
        (ProcrastinateSystem(), "_dsn"),
    ],
)
def test_each_database_system_maintains_its_own_database(
    system: base.System, attribute: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    module = __import__(type(system).__module__, fromlist=["vacuum_checkpoint"])
    monkeypatch.setattr(module, "vacuum_checkpoint", lambda url: seen.append(url) or {})
    setattr(system, attribute, "postgresql://its-own/db")
    system.maintain()
    assert seen == ["postgresql://its-own/db"]
