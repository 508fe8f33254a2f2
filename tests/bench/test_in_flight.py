"""The result captions say each system's own in-flight setting, from its settings in the
code (``System.in_flight``, recorded by the harness), not one figure for every system."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchmarks import harness, report
from benchmarks.scale import FULL
from benchmarks.systems.base import WorkerSpec
from benchmarks.systems.celery_app import DEFAULT_PREFETCH_MULTIPLIER, TUNED_PREFETCH_MULTIPLIER

HERE = Path(".")


def _in_flight(tmp_path: Path) -> dict[str, dict[str, str]]:
    h = harness.Harness(harness.Options(runs=1, scale=FULL, out=tmp_path, physical=False))
    return {e.key: h._in_flight(e.load()) for e in harness.REGISTRY}


def test_each_system_says_what_one_worker_process_holds(tmp_path: Path) -> None:
    found = _in_flight(tmp_path)
    cpus = os.cpu_count() or 1
    assert found["orbit-pg"]["throughput"] == "10 slots"
    assert found["orbit-pg-tuned"]["throughput"] == "1,500 slots"
    assert found["orbit-pg-tuned"]["io"] == "200 slots + 200 prefetched"
    assert found["pgqueuer"]["throughput"] == "dequeue batch 10, no cap on concurrent jobs"
    assert found["pgqueuer-tuned"]["throughput"] == "dequeue batch 25, no cap on concurrent jobs"
    assert found["procrastinate"]["latency"].startswith("1 at once")
    assert found["procrastinate-tuned"]["latency"].startswith("10 at once")
    pool = f"prefork pool of {cpus} x prefetch {DEFAULT_PREFETCH_MULTIPLIER}"
    assert found["celery"]["throughput"].startswith(pool)
    tuned = min(10, cpus)
    assert found["celery-tuned"]["throughput"] == (
        f"prefork pool of {tuned} x prefetch {TUNED_PREFETCH_MULTIPLIER} = "
        f"{tuned * TUNED_PREFETCH_MULTIPLIER:,} reserved"
    )
    assert found["celery"]["io"].startswith("threads pool of 200")


def test_the_captions_name_every_systems_own_setting(tmp_path: Path) -> None:
    found = _in_flight(tmp_path)
    systems = {k: {"in_flight": v, "claim_probe": f"probe of {k}"} for k, v in found.items()}
    results = {w: {k: {"metrics": {}} for k in found} for w in report.TITLES}
    summary: dict[str, Any] = {
        "meta": {"scale": FULL.as_dict()},
        "systems": systems,
        "results": results,
    }
    throughput = report._scale_note("throughput", summary)
    assert "10 in flight" not in throughput
    assert "`orbit-pg-tuned` 1,500 slots" in throughput
    assert "`pgqueuer` dequeue batch 10" in throughput
    assert f"`celery-tuned` {found['celery-tuned']['throughput']}" in throughput
    latency = report._scale_note("latency", summary)
    assert "(10 slots)" not in latency and "`orbit-pg-tuned` 1,500 slots" in latency
    assert "`procrastinate` 1 at once" in report._scale_note("backlog", summary)
    assert "`orbit-pg`: probe of orbit-pg" in report._scale_note("backlog", summary)
    assert "`celery" in report._scale_note("backlog", summary)  # not skipped here


def test_the_backlog_caption_leaves_out_the_systems_it_skipped(tmp_path: Path) -> None:
    found = _in_flight(tmp_path)
    systems = {k: {"in_flight": v, "claim_probe": f"probe of {k}"} for k, v in found.items()}
    skip = {e.key for e in harness.REGISTRY if e.backlog_skip}
    assert {"celery", "celery-tuned"} <= skip
    backlog = {k: {"skipped": "no backlog"} if k in skip else {"metrics": {}} for k in found}
    summary: dict[str, Any] = {
        "meta": {"scale": FULL.as_dict()},
        "systems": systems,
        "results": {"backlog": backlog},
    }
    text = report._scale_note("backlog", summary)
    assert "`orbit-pg` 10 slots" in text and "`orbit-pg`: probe of orbit-pg" in text
    assert "celery" not in text


def test_a_summary_without_the_settings_does_not_claim_one_figure_for_all() -> None:
    summary: dict[str, Any] = {
        "meta": {"scale": FULL.as_dict()},
        "systems": {},
        "results": {"throughput": {"orbit-pg": {"metrics": {}}}},
    }
    text = report._scale_note("throughput", summary)
    assert "asks each worker process for 10 in flight" in text
    assert "10 in flight per worker process" not in text


def test_a_worker_spec_is_all_in_flight_needs() -> None:
    from benchmarks.systems.orbit_system import OrbitSystem

    assert (
        OrbitSystem("sqlite", "tuned").in_flight(WorkerSpec(1, 10, HERE, hold=True)) == "10 slots"
    )
