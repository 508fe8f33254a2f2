"""benchmarks.depth_cost: a tiny run on each backend reports the submit medians and the
count's plan, a PostgreSQL run drops its scratch database whether it succeeds or fails,
and bad arguments are refused before anything is created."""

from __future__ import annotations

import psycopg
import pytest

from benchmarks import depth_cost
from benchmarks.systems import base
from tests.pg import ADMIN_DSN


def _exists(name: str) -> bool:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
        row = cx.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name]).fetchone()
        assert row is not None
        return bool(row[0])


def test_a_tiny_sqlite_run_reports_submits_plan_and_count() -> None:
    result = depth_cost.measure(backlog=30, rounds=2)
    assert (result["backend"], result["backlog"], result["rounds"]) == ("sqlite", 30, 2)
    assert set(result["submit_ms"]) == {"free", "capped"}
    assert all(ms > 0 for ms in result["submit_ms"].values())
    assert any("orbit_tasks" in line for line in result["plan"])
    assert result["count_ms"] > 0


def test_a_tiny_postgres_run_reports_submits_and_plan_and_drops_its_database() -> None:
    result = depth_cost.measure(backlog=30, rounds=2, postgres=True, admin_dsn=ADMIN_DSN)
    assert (result["backend"], result["backlog"], result["rounds"]) == ("postgres", 30, 2)
    assert set(result["submit_ms"]) == {"free", "capped"}
    assert all(ms > 0 for ms in result["submit_ms"].values())
    assert any("Execution Time" in line for line in result["plan"])
    assert not _exists(result["database"])


def test_a_failed_postgres_run_drops_its_database(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []
    real = base.create_database

    def spy(admin_dsn: str, name: str) -> str:
        created.append(name)
        return real(admin_dsn, name)

    def boom(*args: object) -> None:
        raise RuntimeError("fill failed")

    monkeypatch.setattr(depth_cost, "create_database", spy)
    monkeypatch.setattr(depth_cost, "_fill", boom)
    with pytest.raises(RuntimeError):
        depth_cost.measure(backlog=1, rounds=1, postgres=True, admin_dsn=ADMIN_DSN)
    assert created and not _exists(created[0])


@pytest.mark.parametrize("bad", [{"backlog": -1}, {"rounds": 0}, {"rounds": depth_cost.ROOM + 1}])
def test_bad_arguments_are_refused_first(
    bad: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_database(*args: object) -> str:
        raise AssertionError("a database was about to be created")

    monkeypatch.setattr(depth_cost, "create_database", no_database)
    monkeypatch.setattr(depth_cost, "open_store", no_database)
    with pytest.raises(ValueError):
        depth_cost.measure(**{"backlog": 1, "rounds": 1, "postgres": True, **bad})  # type: ignore[arg-type]
