"""From raw run files to ``summary.json``: median [min-max] per metric, and the ratios.

Every ratio is computed from the medians of one invocation, so the two sides of a ratio
were measured on the same machine, in the same hour, alternating run by run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORBIT = "orbit-pg"
#: the ratios use Orbit's tuned profile when the run has it (docs/worker.md's advice)
ORBIT_TUNED = "orbit-pg-tuned"
DASH = "\u2013"  # an en dash: "12 [10\u201314]"
PEER_FAMILIES = ("pgqueuer", "procrastinate", "celery")

#: how each workload's metrics are shown: (metric, label, unit, higher is better)
#: the unit of a 0/1 metric (recovered or not), whose cell counts its ones: ``3 of 5``
#: runs recovered, where a median would say 1
RUNS_OF = "k of n runs"

COLUMNS: dict[str, list[tuple[str, str, str, bool]]] = {
    "throughput": [
        ("w1_tasks_per_s", "1 worker", "tasks/s", True),
        ("w1_tasks_per_s_incl_startup", "1 worker incl. start-up", "tasks/s", True),
        ("w2_tasks_per_s", "2 workers", "tasks/s", True),
        ("w2_tasks_per_s_incl_startup", "2 workers incl. start-up", "tasks/s", True),
    ],
    "enqueue": [
        ("one_jobs_per_s", "one per call", "jobs/s", True),
        ("batch_jobs_per_s", "batches", "jobs/s", True),
    ],
    "latency": [
        ("p50_ms", "p50", "ms", False),
        ("p99_ms", "p99", "ms", False),
        ("max_ms", "max", "ms", False),
    ],
    "io": [
        ("tasks_per_s", "sleep jobs", "tasks/s", True),
        ("tasks_per_s_incl_startup", "incl. start-up", "tasks/s", True),
    ],
    "recovery": [
        ("recovery_s", "recovered after kill", "s", False),
        ("recovered", "runs recovered", RUNS_OF, True),
    ],
    "backlog": [
        ("small_tasks_per_s", "small backlog", "tasks/s", True),
        ("large_tasks_per_s", "large backlog", "tasks/s", True),
        ("large_over_small", "large / small", "ratio", True),
        ("small_claim_ms", "claim stmt, small", "ms", False),
        ("large_claim_ms", "claim stmt, large", "ms", False),
        ("large_taken_per_counted", "large: jobs taken per job counted", "ratio", False),
    ],
}
CPU_COLUMNS = [
    ("host_cpu_percent", "host CPU", "% of all cores"),
    ("children_core_percent", "servers + workers", "% of one core"),
    ("postgres_core_percent", "PostgreSQL", "% of one core"),
    ("redis_core_percent", "Redis", "% of one core"),
    ("w1_children_ms_per_task", "servers + workers, 1 worker", "CPU ms per task"),
    ("w1_postgres_ms_per_task", "PostgreSQL, 1 worker", "CPU ms per task"),
    ("w1_wal_bytes_per_task", "PostgreSQL WAL, 1 worker", "bytes per task"),
]


def aggregate(values: list[float | None]) -> dict[str, Any]:
    """median [min-max] over the runs that produced a number (``n`` of ``runs``)."""
    got = [float(v) for v in values if isinstance(v, int | float)]
    out: dict[str, Any] = {"runs": len(values), "n": len(got), "values": got}
    if got:
        out.update(median=statistics.median(got), min=min(got), max=max(got))
    return out


def _cpu_metrics(cpu: dict[str, Any]) -> dict[str, float]:
    """Means over a run's sampled phases of host CPU % and per-group core %."""
    phases = [p for p in cpu.values() if isinstance(p, dict) and "system_percent" in p]
    if not phases:
        return {}
    out = {"host_cpu_percent": statistics.fmean(p["system_percent"]["mean"] for p in phases)}
    for group in ("children", "postgres", "redis"):
        out[f"{group}_core_percent"] = statistics.fmean(p["core_percent"][group] for p in phases)
    return out


def _cpu_per_task(record: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per task of each drain (``w1``: one worker process), by group:
    what each system pays for a task, whatever the drain's length. The window runs from
    the workers' launch, so a peer's figure includes its workers' start-up (Orbit's
    server is already up), to the last finish (``workloads.launched``: the workers'
    shutdown is not counted), and the children counted are the system under test's
    (``RunContext.foreign_pids``: not another system's idle server)."""
    out = {}
    for key, cpu in (record.get("cpu") or {}).items():
        jobs = ((record.get("detail") or {}).get(key) or {}).get("jobs")
        if isinstance(cpu, dict) and "cpu_s" in cpu and jobs:
            for group in ("children", "postgres"):
                out[f"{key}_{group}_ms_per_task"] = 1000 * cpu["cpu_s"][group] / jobs
            wal = cpu.get("wal") or {}
            if "bytes" in wal:
                out[f"{key}_wal_bytes_per_task"] = wal["bytes"] / jobs
    return out


def _taken_per_counted(record: dict[str, Any]) -> float | None:
    """Jobs the worker finished in the large-backlog phase, up to its exit, per job the
    clock counted. The clock stops at the counted jobs' last finish. With only those jobs
    queued nothing else is there to take; with a large queue the worker has by then
    claimed and started as many more as its concurrency holds, and their claims and
    starts fall inside the window without being counted. A value well above 1 says the
    large/small ratio of rates reflects that claim-ahead depth against a short drain, not
    the queue's size."""
    large = (record.get("detail") or {}).get("large") or {}
    drained, jobs = large.get("drained_before_stop"), large.get("jobs")
    return drained / jobs if isinstance(drained, int) and jobs else None


def build(
    runs_dir: Path,
    meta: dict[str, Any],
    physical: dict[str, Any] | None,
    systems: dict[str, Any],
) -> dict[str, Any]:
    per: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(runs_dir.glob("*.json")):
        record = json.loads(path.read_text())
        per.setdefault(record["workload"], {}).setdefault(record["system"], []).append(record)
    results: dict[str, Any] = {}
    for workload in [w for w in meta.get("workloads", []) if w in per] + sorted(
        set(per) - set(meta.get("workloads", []))
    ):
        results[workload] = {}
        for system in [s for s in meta.get("systems", []) if s in per[workload]]:
            records = sorted(per[workload][system], key=lambda r: int(r["run"]))
            results[workload][system] = _system_result(workload, records)
    out: dict[str, Any] = {
        "meta": meta,
        "systems": systems,
        "physical": _physical(physical),
        "results": results,
        "latency_quantiles_ms": _latency_quantiles(
            {
                s: per.get("latency", {})[s]
                for s in meta.get("systems", [])
                if s in per.get("latency", {})
            }
        ),
    }
    out["ratios"] = ratios(out)
    return out


def _system_result(workload: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    skipped = next((r["skipped"] for r in records if r.get("skipped")), None)
    if skipped:
        return {"skipped": skipped}
    rows: list[dict[str, float | None]] = []
    for r in records:
        metrics = dict(r.get("metrics") or {})
        if workload == "backlog":
            small, large = metrics.get("small_tasks_per_s"), metrics.get("large_tasks_per_s")
            metrics["large_over_small"] = large / small if small and large else None
            metrics["large_taken_per_counted"] = _taken_per_counted(r)
        metrics.update(_cpu_metrics(r.get("cpu") or {}))
        if workload == "throughput":
            metrics.update(_cpu_per_task(r))
        rows.append(metrics)
    names = sorted({k for row in rows for k in row})
    errors = [
        {"run": r["run"], "error": r["error"].strip().splitlines()[-1]}
        for r in records
        if r.get("error")
    ]
    return {
        "runs": len(records),
        "errors": errors,
        "metrics": {m: aggregate([row.get(m) for row in rows]) for m in names},
    }


def _latency_quantiles(per_system: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Every run's latencies pooled, as 101 nearest-rank quantiles (0, 1, …, 100 %): enough
    to draw the distribution from summary.json alone."""
    out: dict[str, list[float]] = {}
    for system, records in per_system.items():
        pooled = sorted(
            float(v) for r in records for v in (r.get("detail") or {}).get("latencies_ms", [])
        )
        if pooled:
            n = len(pooled)
            out[system] = [pooled[max(0, math.ceil(q / 100 * n) - 1)] for q in range(101)]
    return out


#: the batched pipeline's steps, in the order of benchmarks/pgbench/pipeline.sql
PIPELINE_STEPS = ("submit", "claim", "start", "finish")


def drain_only_jobs_per_s(run: dict[str, Any]) -> float | None:
    """A pipeline run's jobs/s without its submit step, from its own per-step latencies.

    Orbit's throughput is a drain: its tasks were queued before the clock started, so it
    claims, starts and finishes them and submits none. An iteration of the pipeline spends
    ``total`` ms (the sum of its four steps) of which ``submit`` ms on the submit, so the
    same client would go through the other three steps ``total / (total - submit)`` times
    as often: ``rate_drain = rate x total / (total - submit)``. None without the steps."""
    rate = run.get("jobs_per_s")
    steps = run.get("step_latency_ms") or {}
    values = [steps.get(step) for step in PIPELINE_STEPS]
    if not isinstance(rate, int | float) or not all(isinstance(v, int | float) for v in values):
        return None
    total = float(sum(v for v in values if v is not None))
    drain = total - float(steps["submit"])
    return float(rate) * total / drain if drain > 0 else None


def _drain_limit(result: dict[str, Any]) -> dict[str, Any] | None:
    """The best drain-only rate over every pipeline run (``drain_only_jobs_per_s``)."""
    best: dict[str, Any] | None = None
    for key, pipeline in (result.get("pipelines") or {}).items():
        for run in pipeline.get("runs") or []:
            rate = drain_only_jobs_per_s(run)
            if rate is not None and (best is None or rate > best["jobs_per_s"]):
                steps = run["step_latency_ms"]
                total = sum(float(steps[s]) for s in PIPELINE_STEPS)
                best = {
                    "jobs_per_s": round(rate, 1),
                    "which": f"{key}, {run.get('clients')}",
                    "with_submit_jobs_per_s": float(run["jobs_per_s"]),
                    "submit_share": round(float(steps["submit"]) / total, 4),
                    "steps": "claim, start, finish",
                }
    return best


def _physical(physical: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep the measurement and name its best figures: the ceiling of the whole pipeline
    (``limit``: submit, claim, start, finish) and the drain-only one Orbit's throughput,
    a drain of tasks queued beforehand, is compared with (``drain_limit``)."""
    if physical is None or "result" not in physical:
        return physical
    best: tuple[float, str] | None = None

    def walk(node: Any, path: list[str]) -> None:
        nonlocal best
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, [*path, str(k)])
        elif (
            isinstance(node, int | float)
            and not isinstance(node, bool)
            and (best is None or node > best[0])
        ):
            best = (float(node), ", ".join(path))

    result = physical["result"]
    walk(result.get("jobs_per_s", {}), [])
    if best is not None:
        physical = {
            **physical,
            "limit": {"jobs_per_s": best[0], "which": best[1], "steps": ", ".join(PIPELINE_STEPS)},
        }
    drain = _drain_limit(result)
    if drain is not None:
        physical = {**physical, "drain_limit": drain}
    submit = {k: float(v) for k, v in result.get("submit_jobs_per_s", {}).items()}
    if submit:
        clients = max(submit, key=lambda k: submit[k])
        physical["submit_limit"] = {
            "jobs_per_s": submit[clients],
            "clients": clients,
            "batch": result.get("submit", {}).get("batch"),
        }
    for key in ("commit_latency_ms", "round_trip"):
        if result.get(key):
            physical[key] = result[key]
    return physical


def median(summary: dict[str, Any], workload: str, system: str, metric: str) -> float | None:
    try:
        value = summary["results"][workload][system]["metrics"][metric]["median"]
    except KeyError:
        return None
    return float(value)


def _ratio(
    name: str,
    a: tuple[str, str, str] | tuple[str, float | None],
    b: tuple[str, str, str] | float | None,
    summary: dict[str, Any],
    note: str = "",
) -> dict[str, Any] | None:
    """``a / b``; each a median ``(workload, system, metric)``, or ``a`` a measured
    figure ``(what, value)`` and ``b`` a plain value."""
    if len(a) == 2:
        top = a[1]
        of: dict[str, Any] = {"what": a[0], "median": top}
    else:
        top = median(summary, *a)
        of = {"workload": a[0], "system": a[1], "metric": a[2], "median": top}
    if isinstance(b, tuple):
        bottom = median(summary, *b)
        against: Any = {"workload": b[0], "system": b[1], "metric": b[2], "median": bottom}
    else:
        bottom, against = b, {"value": b}
    if top is None or bottom is None:
        return None
    return {
        "name": name,
        "value": top / bottom if bottom else None,
        "of": of,
        "against": against,
        "note": note,
    }


def _best_latency_peer(summary: dict[str, Any]) -> str | None:
    """The peer with the lowest median enqueue→start p99 in this invocation, if any."""
    found = {s: median(summary, "latency", s, "p99_ms") for s in _peers(summary, "latency")}
    p99 = {s: v for s, v in found.items() if v is not None}
    return min(p99, key=lambda s: p99[s]) if p99 else None


def _peers(summary: dict[str, Any], workload: str, family: str | None = None) -> list[str]:
    found = summary["results"].get(workload, {})
    return [
        s
        for s in found
        if not s.startswith("orbit") and (family is None or s.split("-")[0] == family)
    ]


def ratios(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The comparisons docs/benchmarks.md states, each from this invocation's medians."""
    out: list[dict[str, Any] | None] = []

    def pick(workload: str) -> str:
        found = summary["results"].get(workload, {})
        tuned = found.get(ORBIT_TUNED)
        return ORBIT_TUNED if tuned and not tuned.get("skipped") else ORBIT

    for family in ("pgqueuer", "procrastinate"):
        for peer in _peers(summary, "throughput", family):
            out.append(
                _ratio(
                    f"{pick('throughput')} / {peer}: throughput, 1 worker",
                    ("throughput", pick("throughput"), "w1_tasks_per_s"),
                    ("throughput", peer, "w1_tasks_per_s"),
                    summary,
                    "> 1: Orbit drains faster",
                )
            )
    best = _best_latency_peer(summary)
    if best is not None:
        out.append(
            _ratio(
                f"{pick('latency')} p99 / best peer p99 ({best})",
                ("latency", pick("latency"), "p99_ms"),
                ("latency", best, "p99_ms"),
                summary,
                "< 1: Orbit starts jobs sooner at the 99th percentile",
            )
        )
    for peer in _peers(summary, "enqueue", "pgqueuer"):
        out.append(
            _ratio(
                f"{pick('enqueue')} / {peer}: batch enqueue",
                ("enqueue", pick("enqueue"), "batch_jobs_per_s"),
                ("enqueue", peer, "batch_jobs_per_s"),
                summary,
                "> 1: Orbit enqueues faster",
            )
        )
    target = _recovery_target(summary, pick("recovery"))
    if target is not None:
        out.append(
            _ratio(
                f"{pick('recovery')} recovery / (lease TTL + 1 s)",
                ("recovery", pick("recovery"), "recovery_s"),
                target,
                summary,
                "≤ 1: within the target",
            )
        )
    for system in summary["results"].get("backlog", {}):
        if system.startswith("orbit"):
            out.append(
                _ratio(
                    f"{system}: throughput with the large backlog / with the small one",
                    ("backlog", system, "large_tasks_per_s"),
                    ("backlog", system, "small_tasks_per_s"),
                    summary,
                    "1 = the backlog size does not matter",
                )
            )
    physical = summary.get("physical") or {}
    drain = physical.get("drain_limit", {}).get("jobs_per_s")
    limit = physical.get("limit", {}).get("jobs_per_s")
    for key in ("w1_tasks_per_s", "w2_tasks_per_s"):
        workers = key.split("_")[0][1:]
        if drain is not None:
            out.append(
                _ratio(
                    f"{pick('throughput')} / physical limit, drain only: {workers} worker(s)",
                    ("throughput", pick("throughput"), key),
                    drain,
                    summary,
                    "the share of PostgreSQL's own ceiling Orbit reaches: Orbit drains tasks "
                    "queued beforehand, so the bound is the pipeline without its submit step",
                )
            )
        out.append(
            _ratio(
                f"{pick('throughput')} / physical limit incl. submit: {workers} worker(s)",
                ("throughput", pick("throughput"), key),
                limit,
                summary,
                "against the whole pipeline (submit, claim, start, finish), whose rate pays "
                "for a submit Orbit's drain does not make: an understatement, kept for "
                "comparison with earlier runs",
            )
        )
    out.extend(_bounds(summary, physical, pick))
    return [r for r in out if r is not None]


def _bounds(
    summary: dict[str, Any], physical: dict[str, Any], pick: Callable[[str], str]
) -> list[dict[str, Any] | None]:
    """Where a target lies against what PostgreSQL itself allows Orbit's SQL on this
    server: the physical limit and the submit ceiling as multiples of each peer, and one
    durable commit's p99 against the best peer's whole enqueue-to-start p99."""
    out: list[dict[str, Any] | None] = []
    # The peers' throughput is a drain of tasks queued beforehand too: the drain-only bound
    # is the most any Orbit could drain (the whole pipeline's, in a summary without it).
    limit = physical.get("drain_limit", {}).get("jobs_per_s")
    what = "physical limit, drain only"
    if limit is None:
        limit, what = physical.get("limit", {}).get("jobs_per_s"), "physical limit incl. submit"
    for family, factor in (("pgqueuer", "1.5"), ("procrastinate", "15")):
        for peer in _peers(summary, "throughput", family):
            out.append(
                _ratio(
                    f"{what} / {peer}: throughput, 1 worker",
                    (what, limit),
                    ("throughput", peer, "w1_tasks_per_s"),
                    summary,
                    f"the most any Orbit could drain, as a multiple of {peer}; "
                    f"the target asks for {factor} times",
                )
            )
    submit = physical.get("submit_limit", {}).get("jobs_per_s")
    out.append(
        _ratio(
            f"{pick('enqueue')} / submit ceiling: batch enqueue",
            ("enqueue", pick("enqueue"), "batch_jobs_per_s"),
            submit,
            summary,
            "the share of PostgreSQL's own insert ceiling Orbit's batch enqueue reaches",
        )
    )
    for peer in _peers(summary, "enqueue", "pgqueuer"):
        out.append(
            _ratio(
                f"submit ceiling / {peer}: batch enqueue",
                ("submit ceiling", submit),
                ("enqueue", peer, "batch_jobs_per_s"),
                summary,
                f"the most any Orbit could enqueue, as a multiple of {peer}; "
                "the target asks for 1 time",
            )
        )
    durable = (physical.get("commit_latency_ms") or {}).get("durable", {}).get("p99_ms")
    best = _best_latency_peer(summary)
    if best is not None and durable is not None:
        out.append(
            _ratio(
                f"durable commit p99 / best peer's enqueue→start p99 ({best})",
                ("durable commit p99", float(durable)),
                ("latency", best, "p99_ms"),
                summary,
                "> 1: one durable commit alone is slower at p99 than the best peer's whole "
                "path; Orbit's path waits for two (the submit's and the start's)",
            )
        )
    return out


def _recovery_target(summary: dict[str, Any], orbit: str) -> float | None:
    settings = summary.get("systems", {}).get(orbit, {}).get("recovery_settings") or {}
    target = settings.get("target_s")
    return float(target) if isinstance(target, int | float) else None


# ---------------------------------------------------------------------- text


def fmt(value: float | None) -> str:
    if value is None:
        return DASH
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def cell(agg: dict[str, Any] | None, unit: str = "") -> str:
    """``median [min-max]``, or for a 0/1 metric (unit ``RUNS_OF``) ``k of n``; and
    ``n/runs`` when some runs gave no number."""
    if not agg or "median" not in agg:
        return DASH if not agg else f"{DASH} (0/{agg['runs']})"
    if unit == RUNS_OF:
        text = f"{fmt(sum(agg['values']))} of {agg['n']}"
    else:
        text = f"{fmt(agg['median'])} [{fmt(agg['min'])}{DASH}{fmt(agg['max'])}]"
    if agg["n"] < agg["runs"]:
        text += f" ({agg['n']}/{agg['runs']})"
    return text


def present(cols: list[Any], systems: dict[str, Any]) -> list[Any]:
    """The columns some system has a number for (a smoke run skips some phases)."""
    return [c for c in cols if any(c[0] in r.get("metrics", {}) for r in systems.values())]


def table(summary: dict[str, Any]) -> str:
    """Plain-text tables for the terminal: one per workload."""
    lines: list[str] = []
    for workload, systems in summary["results"].items():
        cols = present(COLUMNS.get(workload, []), systems)
        header = ["system", *[f"{label} ({unit})" for _, label, unit, _ in cols]]
        rows, notes = [], []
        for system, res in systems.items():
            if "skipped" in res:
                rows.append([system, "skipped"])
                notes.append(f"  {system} skipped: {res['skipped']}")
                continue
            row = [system, *[cell(res["metrics"].get(m), unit) for m, _, unit, _ in cols]]
            if res["errors"]:
                row.append(f"errors in runs {[e['run'] for e in res['errors']]}")
            rows.append(row)
        widths = [max(len(r[i]) for r in [header, *rows] if i < len(r)) for i in range(len(header))]
        lines.append(f"\n== {workload}")
        for r in [header, *rows]:
            padded = [c.ljust(widths[i]) if i < len(widths) else c for i, c in enumerate(r)]
            lines.append("  ".join(padded).rstrip())
        lines.extend(notes)
    if summary.get("ratios"):
        lines.append("\n== ratios (medians of this invocation)")
        for r in summary["ratios"]:
            lines.append(f"  {r['name']}: {fmt(r['value'])}   ({r['note']})")
    physical = summary.get("physical") or {}
    if "drain_limit" in physical:
        lim = physical["drain_limit"]
        lines.append(
            f"\nphysical limit, drain only (claim, start, finish): {fmt(lim['jobs_per_s'])} "
            f"jobs/s ({lim['which']})"
        )
    if "limit" in physical:
        lim = physical["limit"]
        lines.append(
            ("" if "drain_limit" in physical else "\n")
            + f"physical limit incl. submit: {fmt(lim['jobs_per_s'])} jobs/s ({lim['which']})"
        )
    elif physical.get("error"):
        lines.append(f"\nphysical limit: not measured ({physical['error']})")
    return "\n".join(lines)
