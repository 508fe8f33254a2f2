"""benchmarks.probe: a tiny real drain gives a rate, CPU per process and the server's
worker transactions (from its /metrics), a tiny drain of sleeping tasks what the
handlers' overlap shows, a tiny paced run gives latency percentiles, and bad arguments
are refused before any database is created."""

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
    # the server's worker transactions over the drain, from its /metrics: with 5 slots
    # for 40 tasks, claims, starts and finishes go on after the first success
    calls = result["transactions"]
    assert {"claim", "start", "finish"} <= set(calls) <= {"claim", "start", "finish", "renew"}
    for op in ("claim", "start", "finish"):
        assert calls[op]["calls"] >= 1
        assert 0 < calls[op]["items_mean"] <= 5  # the worker's 5 slots
        assert calls[op]["ms_mean"] > 0 and calls[op]["in_flight"] > 0


def test_transactions_are_the_difference_of_two_readings() -> None:
    before = {"claim": probe.Tally(2, 0.5, 300), "start": probe.Tally(4, 1.0, 400)}
    after = {
        "claim": probe.Tally(6, 2.5, 1100),
        "start": probe.Tally(4, 1.0, 400),  # no call between the readings: left out
        "finish": probe.Tally(5, 2.0, 500),  # not in the first reading: counted from 0
    }
    assert probe._transactions(before, after, 4.0) == {
        "claim": {"calls": 4, "items_mean": 200.0, "ms_mean": 500.0, "in_flight": 0.5},
        "finish": {"calls": 5, "items_mean": 100.0, "ms_mean": 400.0, "in_flight": 0.5},
    }


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


def test_a_tiny_drain_of_sleeping_tasks_reports_the_handlers_overlap() -> None:
    result = probe.drain(
        ADMIN_DSN, tasks=30, concurrency=5, spy=None, spy_worker=False, sleep_ms=5, prefetch=2
    )
    assert (result["tasks"], result["sleep_ms"], result["prefetch"]) == (30, 5, 2)
    assert result["worker_slots"] == 5 + 2  # the prefetch reached the worker's hello
    assert result["tasks_per_s"] > 0
    # handlers ran at once, never more than the worker's concurrency (its slots, not
    # its slots and the prefetch: the waiting attempts run no handler)
    assert 0 < result["in_flight_mean"] <= 5
    # a start's write, durable commit and reply: more than 50 µs, well under 5 s (a
    # slip between the database's µs and the records' seconds is off by 1,000 or more)
    waits = result["start_to_handler_ms"]
    assert 0.05 < waits["p50"] <= waits["p90"] < 5000


def test_a_no_op_drain_reports_no_overlap_and_its_prefetch() -> None:
    result = probe.drain(ADMIN_DSN, tasks=10, concurrency=2, spy=None, spy_worker=False)
    assert not {"sleep_ms", "prefetch", "worker_slots", "in_flight_mean"} & set(result)
    prefetched = probe.drain(
        ADMIN_DSN, tasks=10, concurrency=2, spy=None, spy_worker=False, prefetch=1
    )
    assert (prefetched["prefetch"], prefetched["worker_slots"]) == (1, 3)
    assert "in_flight_mean" not in prefetched


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


@pytest.mark.parametrize(
    "bad",
    [{"tasks": 0}, {"concurrency": 0}, {"payload_bytes": -1}, {"sleep_ms": -1}, {"prefetch": -1}],
)
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


@pytest.mark.parametrize(
    "option", [["--sleep-ms", "20"], ["--prefetch", "3"], ["--payload-bytes", "64"]]
)
def test_a_drains_options_are_refused_with_paced(
    option: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_database(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        probe.main(["--paced", "100", "--tasks", "5", *option])
    assert exited.value.code == 2
    assert "not --paced" in capsys.readouterr().err
