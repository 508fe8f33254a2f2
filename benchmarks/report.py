"""``python -m benchmarks report DIR``: plots and the results section of docs/benchmarks.md.

Everything is drawn from ``DIR/summary.json`` alone (it carries the latency quantiles
too), so the committed ``benchmarks/results/latest/summary.json`` is enough to rebuild the
section exactly. The section is written between ``<!-- results:begin -->`` and
``<!-- results:end -->``; the rest of the page (the method) is left as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from benchmarks.masking import mask
from benchmarks.summary import COLUMNS, CPU_COLUMNS, DASH, cell, fmt, present, ratios

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
IMAGES = REPO / "docs" / "benchmarks"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

TITLES = {
    "throughput": "Throughput: pre-enqueued no-op jobs",
    "enqueue": "Enqueue",
    "latency": "Latency: enqueue → start, one job at a time at a fixed rate, idle workers",
    "io": "I/O-bound: jobs that sleep, many at once in one process",
    "recovery": "Recovery: a worker SIGKILLed while holding jobs",
    "backlog": "Backlog: 1 worker draining with a small and with a large queue",
}


def write(
    run_dir: Path, *, docs: Path = DOC, images: Path = IMAGES, latest: Path | None = None
) -> list[Path]:
    """Write the plots and the docs section; copy the summary to ``latest`` if given."""
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    head, tail = _around_results(text, docs)
    summary = json.loads((run_dir / "summary.json").read_text())
    if not _has_results(summary):
        raise ValueError(
            f"{run_dir / 'summary.json'} holds no measured value (every run failed or was "
            "skipped). Nothing was written."
        )
    summary["ratios"] = ratios(summary)  # derived from the medians: always today's rules
    images.mkdir(parents=True, exist_ok=True)
    written = plots(summary, images)
    rel = Path(os.path.relpath(images, docs.parent))
    section = render(summary, {p.stem: rel / p.name for p in written})
    text = f"{head}{BEGIN}\n{section}\n{END}{tail}"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    written.append(docs)
    if latest is not None and latest.resolve() != run_dir.resolve():
        latest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / "summary.json", latest / "summary.json")
        written.append(latest / "summary.json")
    return written


def _sampling(interval_s: float | None) -> str:
    """How the CPU was read: an interval of 0 (the smoke scale) means at each phase's
    start and end only."""
    if interval_s is None:
        return "Sampled"
    if interval_s == 0:
        return "Read at the start and end of each phase (no periodic samples)"
    return f"Sampled every {interval_s:g} s"


def _has_results(summary: dict[str, Any]) -> bool:
    """Whether any system measured anything: a section of failed rows would replace the
    published results with dashes."""
    return any(
        "median" in res.get("metrics", {}).get(metric, {})
        for workload, systems in summary.get("results", {}).items()
        for res in systems.values()
        for metric, *_ in COLUMNS.get(workload, [])
    )


# ---------------------------------------------------------------------- plots


def _around_results(text: str, docs: Path) -> tuple[str, str]:
    """The page before and after its generated section, which is replaced whole.

    A page with no markers gets the section at its end. Markers out of order, doubled or
    alone are refused before anything is written: the section is replaced from the begin
    marker to the end marker, so a begin marker left above hand-written text (as one once
    sat above two rounds' sections) would have the report erase that text."""
    begins, ends = text.count(BEGIN), text.count(END)
    if begins == ends == 0:
        return f"{text.rstrip()}\n\n", "\n"
    if begins != 1 or ends != 1 or text.index(BEGIN) > text.index(END):
        found = "in the wrong order" if begins == ends == 1 else f"{begins} and {ends}"
        raise ValueError(
            f"{docs}: expected one {BEGIN} line before one {END} line around the results "
            f"section; found {found}. Nothing was written; put the markers back around "
            "the generated section only."
        )
    head, rest = text.split(BEGIN, 1)
    return head, rest.split(END, 1)[1]


def plots(summary: dict[str, Any], images: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out: list[Path] = []
    results = summary["results"]
    bars = [
        ("throughput", ["w1_tasks_per_s", "w2_tasks_per_s"], "tasks/s", "Throughput"),
        ("enqueue", ["one_jobs_per_s", "batch_jobs_per_s"], "jobs/s", "Enqueue"),
        ("io", ["tasks_per_s"], "tasks/s", "I/O-bound"),
        ("backlog", ["small_tasks_per_s", "large_tasks_per_s"], "tasks/s", "Backlog"),
        ("recovery", ["recovery_s"], "seconds after the kill", "Recovery"),
    ]
    for workload, metrics, unit, title in bars:
        if workload in results:
            missing = "not recovered within the cap" if workload == "recovery" else "no result"
            path = _bar_chart(results[workload], workload, metrics, unit, title, images, missing)
            if path is not None:
                out.append(path)
    if summary.get("latency_quantiles_ms"):
        out.append(_latency_cdf(summary["latency_quantiles_ms"], images))
    return out


def _labels(workload: str) -> dict[str, str]:
    return {m: label for m, label, _, _ in COLUMNS.get(workload, [])}


def _bar_chart(
    per_system: dict[str, Any],
    workload: str,
    metrics: list[str],
    unit: str,
    title: str,
    images: Path,
    missing: str = "no result",
) -> Path | None:
    """Grouped bars: the median per system and metric, error bars from min to max."""
    import matplotlib.pyplot as plt

    systems = [s for s, r in per_system.items() if "metrics" in r]
    if not systems:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(systems) + 2), 4))
    width = 0.8 / len(metrics)
    labels = _labels(workload)
    for i, metric in enumerate(metrics):
        meds, lo, hi = [], [], []
        for s in systems:
            agg = per_system[s]["metrics"].get(metric) or {}
            m = agg.get("median", 0.0)
            meds.append(m)
            lo.append(m - agg.get("min", m))
            hi.append(agg.get("max", m) - m)
        xs = [x + (i - (len(metrics) - 1) / 2) * width for x in range(len(systems))]
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=labels.get(metric, metric))
        for x, s in zip(xs, systems, strict=True):
            if "median" not in (per_system[s]["metrics"].get(metric) or {}):
                # no number is not zero: say so where the bar would be
                ax.annotate(missing, (x, 0), ha="center", va="bottom", rotation=90, fontsize=8)
    ax.set_xticks(range(len(systems)), systems, rotation=20, ha="right")
    ax.set_ylabel(unit)
    ax.set_title(f"{title}: median, error bars min{DASH}max")
    if len(metrics) > 1:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = images / f"{workload}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_cdf(quantiles: dict[str, list[float]], images: Path) -> Path:
    """The distribution of enqueue→start per system (every run pooled), log time axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    share = [q / 100 for q in range(101)]
    for system, values in quantiles.items():
        ax.plot([max(v, 0.01) for v in values], share, label=system, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("enqueue → start (ms, log scale)")
    ax.set_ylabel("share of jobs")
    ax.set_title("Latency distribution (all runs pooled)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = images / "latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- markdown


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(summary: dict[str, Any], images: dict[str, Path]) -> str:
    meta = summary["meta"]
    parts = [_header(summary), _systems(summary)]
    for workload, per_system in summary["results"].items():
        parts.append(_workload(workload, per_system, summary, images))
    parts.append(_physical(summary))
    parts.append(_ratios(summary))
    parts.append(_cpu(summary))
    argv = mask(" ".join(["python -m benchmarks", *meta.get("argv", [])[1:]]))
    parts.append(
        "### Reproduce\n\n"
        f"This run: `{argv}` then `python -m benchmarks report <its output directory>`.\n"
        "Everything (5 runs of every workload, every system, then this section): "
        "`make bench`. The summary these tables were built from is "
        "`benchmarks/results/latest/summary.json`."
    )
    return "\n\n".join(p for p in parts if p)


def _header(summary: dict[str, Any]) -> str:
    meta = summary["meta"]
    h, pg, git = meta.get("host", {}), meta.get("postgres", {}), meta.get("git", {})
    pg_settings = ", ".join(f"{k}={v}" for k, v in sorted((pg.get("settings") or {}).items()))
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    started = str(meta.get("started_at", "?"))[:16].replace("T", " ")
    order = "all systems side by side" if meta.get("parallel") else "alternating run by run"
    if not meta.get("parallel") and meta.get("run_orders"):
        order += ", the systems' order changed each run (balanced: forward and reversed)"
    scale = meta.get("scale", {}).get("name")
    if meta.get("parallel") or scale == "smoke":
        banner = [
            "> **A smoke run (or systems run side by side): these numbers mean nothing.** "
            "Publish only a sequential run.",
            "",
        ]
    elif scale != "full":
        banner = [
            f"> **Reduced scale (`{scale}`):** the workloads of the method with fewer jobs "
            "(sizes under *The workloads*). Compare systems within this run; the `full` "
            "scale (`make bench`) has not been published yet.",
            "",
        ]
    else:
        banner = []
    return "\n".join(
        [
            "## Results",
            "",
            *banner,
            f"Generated by `python -m benchmarks report` from the run started {started} UTC: "
            f"{meta.get('runs')} run(s) per system and workload at "
            f"`{meta.get('scale', {}).get('name')}` scale, "
            f"{order}. "
            f"Each cell is **median [min{DASH}max]** over the runs.",
            "",
            f"- Host: {h.get('cpu_model') or '?'}, {h.get('cpu_count')} CPUs, "
            f"{h.get('memory_gb')} GB; {h.get('platform')}; Python {h.get('python')}; "
            f"load average {h.get('load_avg_at_start')} at the start, "
            f"{meta.get('load_avg_at_end')} at the end (the machine was shared)",
            f"- PostgreSQL {pg.get('version', '?')} on loopback ({pg_settings})",
            f"- Redis {meta.get('redis', {}).get('version', '?')} on loopback",
            f"- Orbit at commit `{(git.get('commit') or '?')[:12]}`{dirty}",
        ]
    )


def _systems(summary: dict[str, Any]) -> str:
    rows = []
    for key, d in summary.get("systems", {}).items():
        versions = ", ".join(f"{k} {v}" for k, v in (d.get("versions") or {}).items())
        rows.append([f"`{key}`", str(d.get("profile", "?")), versions or d.get("error", "")[:80]])
    details = json.dumps(
        {k: d.get("settings") for k, d in summary.get("systems", {}).items()},
        indent=1,
        ensure_ascii=False,
    )
    return (
        "### Systems\n\n"
        "`defaults`: the system's own defaults; `tuned`: the settings its documentation "
        "recommends for throughput (the exact values are in each system's settings below).\n\n"
        + _md_table(["system", "profile", "versions"], rows)
        + "\n\n<details><summary>Every setting, per system</summary>\n\n```json\n"
        + details
        + "\n```\n\n</details>"
    )


def _workload(
    workload: str, per_system: dict[str, Any], summary: dict[str, Any], images: dict[str, Path]
) -> str:
    cols = present(COLUMNS.get(workload, []), per_system)
    rows, notes = [], []
    for system, res in per_system.items():
        if "skipped" in res:
            rows.append([f"`{system}`", "skipped (below)", *[""] * max(0, len(cols) - 1)])
            notes.append(f"- `{system}` skipped: {res['skipped']}.")
            continue
        row = [f"`{system}`", *[cell(res["metrics"].get(m), unit) for m, _, unit, _ in cols]]
        if res.get("errors"):
            row[-1] += f" (failed runs: {', '.join(str(e['run']) for e in res['errors'])})"
        rows.append(row)
    labels = [f"{label} ({unit})" for _, label, unit, _ in cols] or ["result"]
    header = ["system", *labels]
    text = f"### {TITLES.get(workload, workload)}\n\n{_scale_note(workload, summary)}\n\n"
    text += _md_table(header, rows)
    if notes:
        text += "\n\n" + "\n".join(notes)
    if workload == "recovery":
        text += "\n\n" + _recovery_notes(summary)
    if workload in images:
        text += f"\n\n![{workload}]({images[workload].as_posix()})"
    return text


def _measured(summary: dict[str, Any], workload: str) -> list[str]:
    """The systems ``workload`` measured: those it skipped (Celery in the backlog) left
    out of its caption."""
    results = summary["results"].get(workload, {})
    return [k for k, r in results.items() if not (isinstance(r, dict) and r.get("skipped"))]


def _in_flight(summary: dict[str, Any], workload: str) -> str:
    """Each system's own in-flight setting for ``workload``, as its settings make it
    (``System.in_flight``, recorded by the harness); "" for a summary without them."""
    systems = summary.get("systems", {})
    found = [
        f"`{key}` {d['in_flight'][workload]}"
        for key in _measured(summary, workload)
        if isinstance((d := systems.get(key) or {}).get("in_flight"), dict)
        and workload in d["in_flight"]
    ]
    return f" In flight per worker process: {'; '.join(found)}." if found else ""


def _requested(summary: dict[str, Any], workload: str, requested: int | None) -> str:
    """The in-flight line of ``workload``'s caption: each system's own figure, or (a
    summary from before the harness recorded them) what the workload asked for."""
    return _in_flight(summary, workload) or (
        f" The workload asks each worker process for {requested} in flight; each system's "
        "settings (above) say what it made of that."
    )


def _claim_probes(summary: dict[str, Any]) -> str:
    """What each system's claim-statement figure times (``System.claim_probe``)."""
    systems = summary.get("systems", {})
    found = [
        f"`{key}`: {systems[key]['claim_probe']}"
        for key in _measured(summary, "backlog")
        if isinstance((systems.get(key) or {}).get("claim_probe"), str)
        and systems[key]["claim_probe"]
    ]
    return " Claim statement, per system: " + "; ".join(found) + "." if found else ""


def _scale_note(workload: str, summary: dict[str, Any]) -> str:
    s = summary["meta"].get("scale", {})
    cap = summary["meta"].get("recovery_cap") or {}
    method = summary["meta"].get("method") or {}
    raised = (
        f" (the scale's {cap['scale_cap_s']:g} s raised above the slowest documented recovery "
        "of the systems here, with a margin)"
        if cap and cap.get("cap_s") != cap.get("scale_cap_s")
        else ""
    )
    notes = {
        "throughput": f"{s.get('throughput_jobs'):,} jobs; from the first job's start to the "
        "last finish, and from launching the workers (start-up included)."
        + _requested(summary, "throughput", s.get("worker_concurrency")),
        "enqueue": f"{s.get('enqueue_one_jobs'):,} jobs one call each; "
        f"{s.get('enqueue_batch_jobs'):,} jobs in batches of {s.get('batch'):,}.",
        "latency": f"{s.get('latency_jobs'):,} jobs at {s.get('latency_rate'):g}/s to one "
        "waiting worker process." + _requested(summary, "latency", s.get("worker_concurrency")),
        "io": f"{s.get('io_jobs'):,} jobs sleeping {s.get('io_sleep_ms')} ms, "
        f"{s.get('io_concurrency')} at once in 1 process (ideal: "
        f"{s.get('io_concurrency', 0) * 1000 // max(1, s.get('io_sleep_ms', 1)):,} tasks/s)."
        + _in_flight(summary, "io"),
        "recovery": f"{s.get('recovery_jobs')} jobs held; cap {s.get('recovery_cap_s'):g} s "
        f"after the kill{raised} (a run that does not finish within it counts as not "
        "recovered)"
        + (f"; {method['recovery_clock']}." if "recovery_clock" in method else ".")
        + " Runs recovered: how many runs recovered of those that measured it (k of n), "
        "not a median.",
        "backlog": f"1 worker drains {s.get('backlog_small'):,} jobs with "
        f"{s.get('backlog_small'):,} queued (small) and with {s.get('backlog_large'):,} "
        "queued (large); the claim statement is timed at both sizes. Jobs taken per job "
        "counted: how many the worker finished in the large phase, up to its exit, per "
        "counted job; the excess was claimed ahead (up to the worker's concurrency) and "
        "its claims and starts fall in the timed window uncounted, so well above 1 the "
        "ratio of rates reflects that depth against a short drain more than the queue's "
        "size."
        + (f" {method['backlog']}." if "backlog" in method else "")
        + _requested(summary, "backlog", s.get("worker_concurrency"))
        + _claim_probes(summary),
    }
    return notes.get(workload, "")


def _recovery_notes(summary: dict[str, Any]) -> str:
    lines = []
    for key, d in summary.get("systems", {}).items():
        settings = d.get("recovery_settings") or {}
        extra = f" Settings: `{json.dumps(settings, ensure_ascii=False)}`." if settings else ""
        if d.get("recovery_note"):
            lines.append(f"- `{key}`: {d['recovery_note']}{extra}")
    return "\n".join(lines)


def _physical(summary: dict[str, Any]) -> str:
    physical = summary.get("physical")
    if not physical:
        return "### Physical limit\n\nNot measured in this run."
    if "limit" not in physical:
        why = physical.get("error", "no jobs/s figure in the result")
        return f"### Physical limit\n\nNot available: {why}."
    lim = physical["limit"]
    args = physical.get("args", {})
    text = (
        "### Physical limit\n\n"
        f"`benchmarks.physical.measure` ({', '.join(f'{k}={v}' for k, v in args.items())}): "
        "Orbit's own SQL for a task's life, driven by pgbench with nothing else in between, "
        "on the same server in the same invocation."
    )
    drain = physical.get("drain_limit")
    if drain:
        text += (
            f"\n\n- Drain only (claim, start, finish): **{fmt(drain['jobs_per_s'])} jobs/s** "
            f"({_which(drain['which'])}; the pipeline's rate x total / (total {DASH} submit) "
            "from its per-step latencies, the submit step being "
            f"{100 * drain['submit_share']:.1f} % of an iteration). Orbit's throughput drains "
            "tasks queued before its clock starts, so this is the bound the ratios compare it "
            "with."
        )
    text += (
        f"\n{'- ' if drain else ''}Including the submit step (submit, claim, start, finish): "
        f"**{fmt(lim['jobs_per_s'])} jobs/s** ({_which(lim['which'])})"
        + (": it pays for a submit Orbit's drain does not make." if drain else ".")
    )
    submit = physical.get("submit_limit")
    if submit:
        text += (
            f"\n\nSubmit ceiling: **{fmt(submit['jobs_per_s'])} jobs/s** "
            f"({submit['clients']} pgbench client(s), {submit['batch']} tasks and their "
            "`submitted` events per statement, `benchmarks/pgbench/submit.sql`): the most "
            "any batch enqueue into Orbit's tables could reach here."
        )
    commit = physical.get("commit_latency_ms")
    if commit:
        rows = [
            [label, fmt(v.get("p50_ms")), fmt(v.get("p99_ms")), fmt(v.get("max_ms"))]
            for label, v in commit.items()
        ]
        text += (
            "\n\nCommit latency, a one-row INSERT and its COMMIT as the client sees it "
            "(durable: `synchronous_commit = on`, what a submit and a start wait for; "
            "relaxed: `off`, what a claim waits for):\n\n"
            + _md_table(["commit", "p50 (ms)", "p99 (ms)", "max (ms)"], rows)
        )
    trip = physical.get("round_trip")
    if trip:
        text += (
            f"\n\nOne statement round trip (`SELECT 1` through psycopg): "
            f"{fmt(trip.get('wall_us'))} µs of wall time, {fmt(trip.get('client_cpu_us'))} µs "
            "of the client's CPU. Each of Orbit's small transactions is a handful of these."
        )
    return text


def _which(path: str) -> str:
    """``"batched, 2"`` (the keys of physical's ``jobs_per_s``) as words."""
    parts = [p.strip() for p in path.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        return f"the {parts[0]} pipeline, {parts[1]} pgbench client(s)"
    return path


def _ratios(summary: dict[str, Any]) -> str:
    if not summary.get("ratios"):
        return ""
    rows = []
    for r in summary["ratios"]:
        of, against = r["of"], r["against"]
        right = (
            f"{against['system']} {fmt(against['median'])}"
            if "system" in against
            else fmt(against.get("value"))
        )
        left = f"{of['system']} {fmt(of['median'])}" if "system" in of else fmt(of["median"])
        medians = f"{left} / {right}"
        rows.append([r["name"], f"**{fmt(r['value'])}**", medians, r["note"]])
    return "### Ratios (medians of this invocation)\n\n" + _md_table(
        ["ratio", "value", "medians", "reading"], rows
    )


def _cpu(summary: dict[str, Any]) -> str:
    per = summary["results"].get("throughput", {})
    cols = present(CPU_COLUMNS, per)  # a summary from before the WAL meter has no WAL
    rows = []
    for system, res in per.items():
        metrics = res.get("metrics", {})
        rows.append([f"`{system}`", *[cell(metrics.get(m)) for m, _, _ in cols]])
    if not rows:
        return ""
    header = ["system", *[f"{label} ({unit})" for _, label, unit in cols]]
    wal = any(m.endswith("_wal_bytes_per_task") for m, _, _ in cols)
    return (
        "### Host CPU during the throughput runs\n\n"
        f"{_sampling(summary['meta'].get('scale', {}).get('cpu_interval_s'))} with "
        "psutil and averaged over the drains (a process that exits inside a drain is "
        "counted through its parent's children times); CPU per task is the one-worker "
        "drain's CPU seconds over its tasks, "
        + (
            f"{summary['meta']['method']['cpu_window']}. "
            if "cpu_window" in (summary["meta"].get("method") or {})
            else "from the worker's launch. "
        )
        + (
            "WAL per task is how far PostgreSQL's WAL insert position moved over the same "
            "drain (cluster-wide; the systems run one at a time), over its tasks: every row "
            "version, index entry and row lock a task's life leaves. "
            if wal
            else ""
        )
        + "Every run file holds the per-process figures for every workload.\n\n"
        + _md_table(header, rows)
    )
