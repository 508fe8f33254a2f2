"""benchmarks.physical: a short real pgbench run on Orbit's tables gives positive jobs/s
in the documented shape, and leaves no database behind (it runs beside other tests on
the same server, so a leak would pile up)."""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg
import pytest

from benchmarks import physical
from tests.pg import ADMIN_DSN

pytestmark = pytest.mark.skipif(
    not (shutil.which("pgbench") or Path("/usr/bin/pgbench").exists()),
    reason="pgbench is not installed",
)


def _exists(name: str) -> bool:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
        row = cx.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name]).fetchone()
        assert row is not None
        return bool(row[0])


def test_measure_shape_rates_and_cleanup() -> None:
    result = physical.measure(
        ADMIN_DSN, batch=4, clients=[1], seconds=1, backlog=100, submit_batch=10, commits=5
    )

    assert result["batch"] == 4
    assert result["clients"] == [1]
    assert set(result["pipelines"]) == {"one_per_tx", "batched"}
    assert result["pipelines"]["one_per_tx"]["batch"] == 1
    assert result["pipelines"]["batched"]["batch"] == 4
    for key, pipeline in result["pipelines"].items():
        (run,) = pipeline["runs"]
        assert run["clients"] == 1
        assert run["failed"] == 0
        assert run["tps"] > 0 and run["iterations"] > 0
        assert run["jobs_per_s"] > 0
        # The backlog keeps the queue from running dry: every claim got a full batch.
        assert run["tasks_per_iteration"] == pipeline["batch"]
        assert run["tasks_succeeded"] >= run["iterations"] * pipeline["batch"]
        assert set(run["step_latency_ms"]) == set(physical.STEPS)
        assert all(v > 0 for v in run["step_latency_ms"].values())
        assert result["jobs_per_s"][key] == {"1": run["jobs_per_s"]}
        # without the submit step the same client drains faster (the drain-only bound)
        assert run["drain_jobs_per_s"] > run["jobs_per_s"]
        assert result["drain_jobs_per_s"][key] == {"1": run["drain_jobs_per_s"]}
    # The submit ceiling: whole batches of tasks, each with its event, counted in the table.
    assert result["submit"]["batch"] == 10
    (run,) = result["submit"]["runs"]
    assert run["failed"] == 0 and run["iterations"] > 0
    assert run["tasks_per_iteration"] == 10
    assert run["tasks_succeeded"] == run["iterations"] * 10  # here: tasks inserted
    assert result["submit_jobs_per_s"] == {"1": run["jobs_per_s"]}
    assert run["jobs_per_s"] > 0
    assert run["drain_jobs_per_s"] is None  # one step, the submit: nothing to take out
    assert result["commits"] == 5
    assert set(result["commit_latency_ms"]) == {"durable", "relaxed"}
    for latency in result["commit_latency_ms"].values():
        assert 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert result["round_trip"]["wall_us"] > 0 and result["round_trip"]["client_cpu_us"] >= 0
    assert result["server"]["version"]
    assert not _exists(result["database"])


@pytest.mark.parametrize(
    "bad",
    [{"batch": 0}, {"submit_batch": 0}, {"commits": 0}, {"clients": []}, {"seconds": 0}],
)
def test_measure_refuses_bad_arguments_before_creating_anything(
    bad: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_database(*args: object, **kwargs: object) -> str:
        raise AssertionError("a database was about to be created")

    monkeypatch.setattr(physical, "_libpq_dsn", no_database)
    args: dict[str, object] = {"batch": 2, "clients": [1], "seconds": 1, "backlog": 10}
    with pytest.raises(ValueError):
        physical.measure(ADMIN_DSN, **{**args, **bad})  # type: ignore[arg-type]


def test_measure_drops_the_database_when_a_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []
    real = physical._libpq_dsn

    def spy(admin_dsn: str, dbname: str) -> str:
        created.append(dbname)
        return real(admin_dsn, dbname)

    def boom(*args: object, **kwargs: object) -> dict[str, object]:
        raise RuntimeError("pgbench failed")

    monkeypatch.setattr(physical, "_libpq_dsn", spy)
    monkeypatch.setattr(physical, "run_pipeline", boom)
    with pytest.raises(RuntimeError):
        physical.measure(ADMIN_DSN, batch=2, clients=[1], seconds=1, backlog=10)
    assert created and not _exists(created[0])


def test_parse_pgbench_reads_tps_latency_and_steps() -> None:
    out = """\
number of transactions actually processed: 563
number of failed transactions: 0 (0.000%)
latency average = 10.656 ms
initial connection time = 9.565 ms
tps = 187.686374 (without initial connection time)
statement latencies in milliseconds and failures:
         0.002           0  \\set batch 4
         2.468           0  INSERT INTO orbit_tasks (
         3.227           0  WITH c AS (
         2.527           0  WITH c AS (
         2.430           0  WITH c AS (
"""
    parsed = physical.parse_pgbench(out)
    assert parsed["tps"] == pytest.approx(187.686374)
    assert parsed["latency_ms"] == pytest.approx(10.656)
    assert parsed["iterations"] == 563
    assert parsed["failed"] == 0
    assert parsed["step_latency_ms"] == {
        "submit": 2.468,
        "claim": 3.227,
        "start": 2.527,
        "finish": 2.430,
    }
