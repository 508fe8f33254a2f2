"""The physical limit's drain-only bound: Orbit's throughput drains tasks queued before its
clock starts, so its share of PostgreSQL's ceiling is taken against the batched
pipeline's rate without the submit step (from the same run's per-step latencies), with
the whole pipeline's rate kept beside it and named as including the submit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report, summary

ROUND45 = Path(__file__).resolve().parents[2] / "benchmarks/results/round45/full-1cc53e5.json"


def _round45() -> dict[str, object]:
    made = json.loads(ROUND45.read_text())
    made["physical"] = summary._physical(made["physical"])  # today's rules, not the file's
    return dict(made)


def test_the_drain_only_rate_takes_the_submit_step_out() -> None:
    run = {
        "jobs_per_s": 1000.0,
        "step_latency_ms": {"submit": 1.0, "claim": 1.0, "start": 1.0, "finish": 1.0},
    }
    # 4 ms an iteration, 3 of them without the submit: 4/3 as many iterations
    assert summary.drain_only_jobs_per_s(run) == pytest.approx(1000 * 4 / 3)
    # the submit script has one step only: no drain-only figure
    assert (
        summary.drain_only_jobs_per_s({"jobs_per_s": 9.0, "step_latency_ms": {"submit": 1}}) is None
    )
    assert summary.drain_only_jobs_per_s({"jobs_per_s": 9.0}) is None


def test_round_45_gives_orbit_46_5_percent_of_the_drain_only_bound() -> None:
    made = _round45()
    physical = made["physical"]
    assert isinstance(physical, dict)
    drain = physical["drain_limit"]
    # batched pipeline, 2 clients: 12,700.5 x 31.47 / (31.47 - 2.257)
    assert drain["which"] == "batched, 2"
    assert drain["jobs_per_s"] == pytest.approx(13_680, rel=1e-3)
    assert physical["limit"]["jobs_per_s"] == 12_700.5  # the whole pipeline's, kept
    found = {r["name"]: r["value"] for r in summary.ratios(made)}
    w1 = found["orbit-pg-tuned / physical limit, drain only: 1 worker(s)"]
    assert w1 == pytest.approx(6_361.8 / 13_681.7, rel=1e-3)
    assert round(100 * w1, 1) == 46.5
    # the old share stays visible, named as including the submit
    assert found["orbit-pg-tuned / physical limit incl. submit: 1 worker(s)"] == pytest.approx(
        6_361.8 / 12_700.5, rel=1e-3
    )
    # the most any Orbit could drain, against a peer's drain: the drain-only bound too
    pgqueuer = summary.median(made, "throughput", "pgqueuer", "w1_tasks_per_s")
    assert pgqueuer is not None
    assert found["physical limit, drain only / pgqueuer: throughput, 1 worker"] == pytest.approx(
        13_681.7 / pgqueuer, rel=1e-3
    )


def test_the_report_and_the_table_show_both_bounds() -> None:
    made = _round45()
    made["ratios"] = summary.ratios(made)
    text = report._physical(made)
    assert "Drain only (claim, start, finish): **13,682 jobs/s**" in text
    assert "Including the submit step (submit, claim, start, finish): **12,700 jobs/s**" in text
    table = summary.table(made)
    assert "physical limit, drain only (claim, start, finish): 13,682 jobs/s" in table
    assert "physical limit incl. submit: 12,700 jobs/s" in table
    ratios = report._ratios(made)
    assert "| orbit-pg-tuned / physical limit, drain only: 1 worker(s) | **0.465** |" in ratios
