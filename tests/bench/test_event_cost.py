"""benchmarks.event_cost: a tiny run over two schemas reports CPU and WAL per event for
each, drops its scratch databases whether it succeeds or fails, and refuses bad
arguments before creating any."""

from __future__ import annotations

import math

import psycopg
import pytest

from benchmarks import event_cost
from tests.pg import ADMIN_DSN


def _exists(name: str) -> bool:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
        row = cx.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name]).fetchone()
        assert row is not None
        return bool(row[0])


def test_a_tiny_run_reports_each_schema_and_drops_its_databases() -> None:
    result = event_cost.measure(
        ADMIN_DSN, schemas=["0007", "0008"], tasks=4, batch=2, rounds=2, fill=10
    )
    assert (result["rounds"], result["tasks"], result["batch"]) == (2, 4, 2)
    assert result["events_per_round"] == 16
    assert list(result["schemas"]) == ["0007", "0008"]
    for schema in result["schemas"].values():
        cpu = schema["cpu_us_per_event"]
        assert 0 <= cpu["min"] <= cpu["median"] <= cpu["max"]
        assert len(schema["per_round"]) == 2
        assert set(schema["vs_first"]) == {"median", "min", "max"}
        # NaN only if every try wrote a full-page image (a checkpoint each time)
        assert all(
            math.isnan(schema[k]) or schema[k] > 0
            for k in ("wal_records_per_event", "wal_bytes_per_event")
        )
    assert result["schemas"]["0007"]["vs_first"]["median"] == 1
    assert len(result["databases"]) == 2
    assert not any(_exists(name) for name in result["databases"])


def test_a_failed_run_drops_its_databases(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []
    real = event_cost.create

    def spy(admin_dsn: str, name: str, sql: str) -> str:
        created.append(name)
        return real(admin_dsn, name, sql)

    def boom(*args: object) -> list[int]:
        raise RuntimeError("insert failed")

    monkeypatch.setattr(event_cost, "create", spy)
    monkeypatch.setattr(event_cost, "run_round", boom)
    with pytest.raises(RuntimeError):
        event_cost.measure(ADMIN_DSN, schemas=["0007", "0008"], tasks=2, batch=1, rounds=1, fill=0)
    assert created and not any(_exists(name) for name in created)


@pytest.mark.parametrize(
    "bad",
    [
        {"schemas": []},
        {"schemas": ["0007", "nope"]},
        {"schemas": ["0008", "0008"]},
        {"tasks": 0},
        {"batch": 0},
        {"rounds": 0},
        {"fill": -1},
    ],
)
def test_bad_arguments_are_refused_first(
    bad: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_database(*args: object) -> str:
        raise AssertionError("a database was about to be created")

    monkeypatch.setattr(event_cost, "create", no_database)
    args: dict[str, object] = {"schemas": ["0007"], "tasks": 2, "batch": 1, "rounds": 1, "fill": 0}
    with pytest.raises(ValueError):
        event_cost.measure(ADMIN_DSN, **{**args, **bad})  # type: ignore[arg-type]
