"""The benchmark harness end to end at smoke scale (a few dozen jobs): every registered
system runs every workload once, writes its raw JSON, and the summary and the report come
out of them. It asserts shapes and completeness, never a time: the numbers of a smoke run
on a shared machine mean nothing.

It runs everything in ``harness.REGISTRY``, which names the peers by module path: a peer
whose module is missing or broken fails this test (its runs carry the import error), it
is never skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import harness, report, summary
from benchmarks.__main__ import main
from benchmarks.scale import SMOKE
from benchmarks.workloads import WORKLOADS, percentile
from tests.pg import ADMIN_DSN


def _problems(out: Path) -> list[str]:
    """Every way the run fell short, as readable lines (so one failure shows them all)."""
    found: list[str] = []
    for entry in harness.REGISTRY:
        for workload in WORKLOADS:
            path = out / "runs" / f"{workload}-{entry.key}-1.json"
            if not path.exists():
                found.append(f"{path.name}: missing")
                continue
            record = json.loads(path.read_text())
            if record.get("order") != [e.key for e in harness.REGISTRY]:  # run 1: as registered
                found.append(f"{path.name}: order {record.get('order')}")
            if record.get("error"):
                found.append(f"{path.name}: {record['error'].strip().splitlines()[-1]}")
            elif record.get("skipped"):
                if workload != "backlog" or not entry.backlog_skip:
                    found.append(f"{path.name}: skipped without a registered reason")
            else:
                derived = {"large_over_small", "large_taken_per_counted"}  # by the summary
                expected = {m for m, *_ in summary.COLUMNS[workload]} - derived
                if workload == "throughput":  # the smoke scale runs only some process counts
                    expected = {m for m in expected if int(m[1]) in SMOKE.throughput_processes}
                missing = expected - set(record.get("metrics", {}))
                if missing:
                    found.append(f"{path.name}: no {sorted(missing)}")
                if not record.get("cpu") or not record.get("versions"):
                    found.append(f"{path.name}: no cpu samples or versions")
    return found


def test_every_registered_system_runs_every_workload(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    lines: list[str] = []
    opts = harness.Options(
        runs=1,
        scale=SMOKE,
        out=out,
        pg_dsn=ADMIN_DSN,
        # Redis dbs 7 and 8 (one per Celery system): clear of a real run's (1 and 2), of
        # tests/bench/test_peers.py's (15) and test_harness_guards.py's (11), should they
        # run at the same time
        redis_db_base=7,
        parallel=True,
        log=lines.append,
    )

    result = harness.Harness(opts).run()

    problems = _problems(out)
    assert not problems, "\n".join([*problems, "", "harness log:", *lines])
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["meta"]["systems"] == [e.key for e in harness.REGISTRY]
    assert set(on_disk["results"]) == set(WORKLOADS)
    assert on_disk["physical"] is not None  # measured, or the reason it could not be
    if "error" not in on_disk["physical"]:
        assert on_disk["physical"]["submit_limit"]["jobs_per_s"] > 0
        assert set(on_disk["physical"]["commit_latency_ms"]) == {"durable", "relaxed"}
    for key in [e.key for e in harness.REGISTRY]:
        assert on_disk["systems"][key]["versions"], key
        assert key in on_disk["latency_quantiles_ms"]
        # CPU per task of each drain: the workers' start-up alone is above zero
        cpu = on_disk["results"]["throughput"][key]["metrics"]
        for procs in SMOKE.throughput_processes:
            assert cpu[f"w{procs}_children_ms_per_task"]["median"] > 0, key
            assert cpu[f"w{procs}_postgres_ms_per_task"]["n"] == 1, key
            # the WAL a drain wrote, for the systems that keep their queue in PostgreSQL
            wal = cpu.get(f"w{procs}_wal_bytes_per_task")
            if key in ("orbit-sqlite", "orbit-sqlite-tuned", "celery", "celery-tuned"):
                assert wal is None, key
            else:
                assert wal is not None and wal["median"] > 0, key
        # the large backlog's drain counts its jobs and takes at least as many
        backlog = on_disk["results"]["backlog"][key]
        if "skipped" not in backlog:
            assert backlog["metrics"]["large_taken_per_counted"]["median"] >= 1, key
    assert summary.table(result)

    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text(
        f"# Benchmarks\n\nmethod\n\n{report.BEGIN}\nSTALE-RESULTS\n{report.END}\n\nafter\n"
    )
    written = report.write(out, docs=docs, images=tmp_path / "img", latest=tmp_path / "latest")

    text = docs.read_text()
    assert (
        "STALE-RESULTS" not in text
        and text.startswith("# Benchmarks\n\nmethod")
        and "after" in text
    )
    assert "## Results" in text and "![throughput](" in text
    assert "In flight per worker process: `orbit-pg` 10 slots" in text
    assert "`orbit-pg-tuned` 1,500 slots" in text
    if "error" not in on_disk["physical"]:
        assert "Submit ceiling" in text and "Commit latency" in text and "round trip" in text
    assert (tmp_path / "img" / "throughput.png").exists()
    assert (tmp_path / "img" / "latency.png").exists()
    assert (tmp_path / "latest" / "summary.json").exists()
    assert docs in written


def test_aggregate_and_percentile() -> None:
    agg = summary.aggregate([3.0, None, 1.0, 2.0])
    assert (agg["median"], agg["min"], agg["max"], agg["n"], agg["runs"]) == (2.0, 1.0, 3.0, 3, 4)
    assert summary.cell(agg) == "2 [1\u20133] (3/4)"
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )


def test_plan_alternates_systems_run_by_run() -> None:
    steps = harness.plan(["throughput", "backlog"], ["a", "b"], 2)
    assert [(s.workload, s.run, s.key, s.phase) for s in steps] == [
        ("throughput", 1, "a", ""),
        ("throughput", 1, "b", ""),
        ("throughput", 2, "b", ""),  # each run's order changed (here reversed)
        ("throughput", 2, "a", ""),
        ("backlog", 0, "a", "fill"),  # every large backlog filled before any timed run
        ("backlog", 0, "b", "fill"),
        ("backlog", 1, "a", "small"),  # small and large back to back, small first
        ("backlog", 1, "a", "large"),
        ("backlog", 1, "b", "small"),
        ("backlog", 1, "b", "large"),
        ("backlog", 2, "b", "large"),  # large first in even runs
        ("backlog", 2, "b", "small"),
        ("backlog", 2, "a", "large"),
        ("backlog", 2, "a", "small"),
    ]


def test_cli_help_names_every_system_and_workload(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for name in [*(e.key for e in harness.REGISTRY), *WORKLOADS]:
        assert name in text


def _result(metrics: dict[str, float]) -> dict[str, object]:
    return {"metrics": {m: {"median": v} for m, v in metrics.items()}}


def test_bounds_place_each_target_against_what_postgresql_allows() -> None:
    """The ratios that say whether a target lies above the database's own ceiling."""
    made = {
        "results": {
            "throughput": {
                "orbit-pg-tuned": _result({"w1_tasks_per_s": 2000.0}),
                "pgqueuer": _result({"w1_tasks_per_s": 5000.0}),
                "procrastinate": _result({"w1_tasks_per_s": 400.0}),
            },
            "enqueue": {
                "orbit-pg-tuned": _result({"batch_jobs_per_s": 10000.0}),
                "pgqueuer": _result({"batch_jobs_per_s": 40000.0}),
            },
            "latency": {
                "orbit-pg-tuned": _result({"p99_ms": 50.0}),
                "pgqueuer": _result({"p99_ms": 7.0}),
                "celery": _result({"p99_ms": 4.0}),
            },
        },
        "physical": summary._physical(
            {
                "result": {
                    "jobs_per_s": {"batched": {"1": 4000.0, "2": 6000.0}},
                    "submit": {"batch": 1000},
                    "submit_jobs_per_s": {"1": 30000.0, "2": 48000.0},
                    "commit_latency_ms": {
                        "durable": {"p50_ms": 1.0, "p99_ms": 6.0, "max_ms": 9.0},
                        "relaxed": {"p50_ms": 0.5, "p99_ms": 2.0, "max_ms": 3.0},
                    },
                }
            }
        ),
    }
    assert made["physical"]["limit"]["jobs_per_s"] == 6000.0  # not the submit ceiling
    assert made["physical"]["submit_limit"] == {
        "jobs_per_s": 48000.0,
        "clients": "2",
        "batch": 1000,
    }
    found = {r["name"]: r["value"] for r in summary.ratios(made)}
    # without the pipelines' step latencies there is no drain-only bound: the whole
    # pipeline's, named as such
    assert found["physical limit incl. submit / pgqueuer: throughput, 1 worker"] == (
        pytest.approx(1.2)
    )
    assert found[
        "physical limit incl. submit / procrastinate: throughput, 1 worker"
    ] == pytest.approx(15.0)
    assert found["submit ceiling / pgqueuer: batch enqueue"] == pytest.approx(1.2)
    assert found["orbit-pg-tuned / submit ceiling: batch enqueue"] == pytest.approx(10 / 48)
    assert found["durable commit p99 / best peer's enqueue→start p99 (celery)"] == pytest.approx(
        1.5
    )
    table = report._ratios(made | {"ratios": summary.ratios(made)})
    assert (
        "| physical limit incl. submit / pgqueuer: throughput, 1 worker | **1.2** "
        "| 6,000 / pgqueuer" in table
    )


@pytest.mark.parametrize(
    "page",
    [
        f"# B\n\nrounds\n\n{report.END}\n",  # an end with no begin
        f"# B\n\n{report.BEGIN}\nold\n",  # a begin with no end
        f"# B\n\n{report.END}\nrounds\n{report.BEGIN}\nold\n",  # the wrong order
        f"# B\n\n{report.BEGIN}\nround 47\n{report.BEGIN}\nold\n{report.END}\n",  # two begins
    ],
)
def test_report_refuses_misplaced_markers_and_writes_nothing(tmp_path: Path, page: str) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(page)
    images = tmp_path / "img"
    with pytest.raises(ValueError, match="Nothing was written"):
        report.write(tmp_path / "no-run", docs=docs, images=images, latest=tmp_path / "latest")
    assert docs.read_text() == page
    assert not images.exists() and not (tmp_path / "latest").exists()


def test_report_places_the_section_between_its_markers_or_at_the_end() -> None:
    page = f"# B\n\nmethod\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n"
    assert report._around_results(page, Path("b.md")) == ("# B\n\nmethod\n\n", "\n\nafter\n")
    assert report._around_results("# B\n\nmethod\n", Path("b.md")) == ("# B\n\nmethod\n\n", "\n")
