"""benchmarks.probe: a tiny real drain gives a rate and CPU per process, a tiny paced
run gives latency percentiles, and bad arguments are refused before any database is
created."""

from __future__ import annotations

import pytest

from benchmarks import probe
from tests.pg import ADMIN_DSN


def test_a_tiny_fill_and_drain_report_rate_and_cpu() -> None:
    result = probe.drain(ADMIN_DSN, tasks=40, concurrency=5, spy=None, spy_worker=False)
    assert result["tasks"] == 40
    assert result["tasks_per_s"] > 0
    assert set(result["cpu_ms_per_task"]) == {"server", "worker", "postgres"}
    assert all(v >= 0 for v in result["cpu_ms_per_task"].values())
    enqueue = result["enqueue"]
    assert enqueue["tasks_per_s"] > 0
    assert set(enqueue["cpu_ms_per_task"]) == {"server", "client", "postgres"}
    assert all(v >= 0 for v in enqueue["cpu_ms_per_task"].values())


def test_a_tiny_paced_run_reports_latency_and_cpu() -> None:
    result = probe.paced(ADMIN_DSN, tasks=5, rate=50, concurrency=3, spy=None, spy_worker=False)
    assert (result["tasks"], result["rate"], result["concurrency"]) == (5, 50, 3)
    latency = result["latency_ms"]
    assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    stages = result["stages_ms"]
    assert list(stages) == list(probe.STAGES)
    # each stage ends later than it begins and is a part of its task's latency
    assert all(0 < stage["p50"] <= stage["p99"] <= latency["max"] for stage in stages.values())
    assert set(result["cpu_ms_per_task"]) == {"server", "worker", "postgres"}
    assert all(v >= 0 for v in result["cpu_ms_per_task"].values())


def _no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_database(*args: object, **kwargs: object) -> str:
        raise AssertionError("a database was about to be created")

    monkeypatch.setattr(probe, "create_database", no_database)


def test_a_padded_drain_carries_payloads_of_the_size_asked() -> None:
    assert probe._pad(0) == {}
    (pad,) = probe._pad(4097).values()
    assert len(pad) == 4097 and int(pad, 16) >= 0  # hex digits, as many as asked
    assert probe._pad(64) != probe._pad(64)  # random: compression cannot shrink it away
    result = probe.drain(
        ADMIN_DSN, tasks=20, concurrency=5, spy=None, spy_worker=False, payload_bytes=3000
    )
    assert result["tasks"] == 20 and result["tasks_per_s"] > 0


@pytest.mark.parametrize("bad", [{"tasks": 0}, {"concurrency": 0}, {"payload_bytes": -1}])
def test_bad_arguments_are_refused_first(
    bad: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_database(monkeypatch)
    args = {"tasks": 10, "concurrency": 2, **bad}
    with pytest.raises(ValueError):
        probe.drain(ADMIN_DSN, spy=None, spy_worker=False, **args)


@pytest.mark.parametrize(
    "bad",
    [{"tasks": 0}, {"rate": 0.0}, {"rate": -5.0}, {"rate": float("nan")}, {"concurrency": 0}],
)
def test_bad_paced_arguments_are_refused_first(
    bad: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_database(monkeypatch)
    args: dict[str, float] = {"tasks": 10, "rate": 100.0, "concurrency": 4, **bad}
    with pytest.raises(ValueError):
        probe.paced(
            ADMIN_DSN,
            tasks=int(args["tasks"]),
            rate=args["rate"],
            concurrency=int(args["concurrency"]),
            spy=None,
            spy_worker=False,
        )
