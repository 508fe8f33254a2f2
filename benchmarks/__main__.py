"""``python -m benchmarks``: run the side-by-side benchmark and write its report.

With no arguments it runs everything at full scale (5 runs), then writes the report
into docs/benchmarks.md. See ``python -m benchmarks --help``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import harness, report, summary
from benchmarks.masking import mask
from benchmarks.scale import SCALES
from benchmarks.workloads import WORKLOADS

RESULTS = Path(__file__).resolve().parent / "results"

EPILOG = f"""\
systems:   {", ".join(e.key for e in harness.REGISTRY)}
workloads: {", ".join(WORKLOADS)}

examples:
  make bench                      # = run (everything, full scale, 5 runs) + report
  python -m benchmarks            # the same
  python -m benchmarks run --systems orbit-pg,pgqueuer --workloads throughput,latency
  python -m benchmarks run --scale smoke --runs 1 --parallel --out /tmp/bench  # quick check
  python -m benchmarks report benchmarks/results/20260101T000000Z

run writes OUT/runs/<workload>-<system>-<run>.json (every measured value, versions,
settings, host CPU) and OUT/summary.json (median [min-max] per metric per system, the
physical limit and the ratios); report turns a summary into plots and the results
section of docs/benchmarks.md. A full run takes hours on a small machine: narrow it
with --systems/--workloads/--runs while iterating. Method: docs/benchmarks.md.
"""


def _csv(text: str) -> list[str]:
    """The names in a comma-separated list (empty and repeated ones are refused later,
    by ``harness.entries`` and ``harness.workload_names``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _check_run(run: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything starts, what would fail or mislead later: an unknown,
    repeated or empty system or workload list, a Redis URL that names a database, Redis
    databases holding keys that the run would flush (without --flush-redis), and an --out
    the run cannot use. The output directory is created last, once all else passed."""
    for check, names in ((harness.entries, args.systems), (harness.workload_names, args.workloads)):
        try:
            check(names)
        except ValueError as exc:
            run.error(str(exc))
    chosen = harness.entries(args.systems)
    if any(e.redis for e in chosen):
        _check_redis(run, args, chosen)
    if args.out is None:
        args.out = _default_out()
    problem = _out_problem(args.out)
    if problem:
        run.error(f"--out {args.out}: {problem}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        run.error(f"--out {args.out}: cannot be created: {exc.strerror or exc}")


def _check_redis(
    run: argparse.ArgumentParser, args: argparse.Namespace, chosen: list[harness.Entry]
) -> None:
    """The Redis URL names no database, and the databases the Redis systems would flush
    hold no keys (unless --flush-redis) and exist; an unreachable Redis is left to the
    run, which reports the systems unavailable."""
    problem = harness.redis_url_problem(args.redis_url)
    if problem:
        run.error(f"--redis-url {mask(args.redis_url)}: {problem}")
    dbs = [db for db in harness.redis_dbs(chosen, args.redis_db_base) if db >= 0]
    found = harness.occupied_redis_dbs(args.redis_url, dbs)
    broken = {db: why for db, why in found.items() if isinstance(why, str)}
    if broken:
        db, why = next(iter(broken.items()))
        run.error(f"Redis database {db}: {why} (lower --redis-db-base)")
    if found and not args.flush_redis:
        held = ", ".join(f"{db} ({keys:,} keys)" for db, keys in found.items())
        run.error(
            f"Redis database(s) {held} would be flushed by the run: empty them, choose "
            "others with --redis-db-base, or pass --flush-redis"
        )


def _out_problem(out: Path) -> str | None:
    """Why ``out`` cannot take a new run, or None (nothing is created here)."""
    if out.exists() and not out.is_dir():
        return "not a directory"
    if any((out / "runs").glob("*.json")):
        # the summary aggregates every file there: never mix two invocations
        return "already holds runs; choose a new directory"
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _session_minutes() -> int:
    """The session scale's length for every registered system, 5 runs: about 45 minutes
    were measured for eight, rounded to 5 minutes."""
    return max(5, round(len(harness.REGISTRY) * 45 / 8 / 5) * 5)


def _default_out() -> Path:
    return RESULTS / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Orbit and its peers on the same PostgreSQL (and Redis), same workloads, "
        "alternating run by run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = top.add_subparsers(dest="command")
    run = sub.add_parser(
        "run",
        help="run the workloads and write raw JSON plus summary.json",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--runs", type=_positive, default=5, help="runs per system and workload (5)")
    run.add_argument("--systems", type=_csv, help="comma-separated (default: all registered)")
    run.add_argument("--workloads", type=_csv, help="comma-separated (default: all six)")
    run.add_argument(
        "--scale",
        choices=sorted(SCALES),
        default="full",
        help="job counts: full (20,000 jobs…; default), session (the same workloads with "
        f"fewer jobs: about {_session_minutes()} minutes for the {len(harness.REGISTRY)} "
        "registered systems and 5 runs) or smoke (a few dozen)",
    )
    run.add_argument(
        "--out", type=Path, help="a new output directory (default benchmarks/results/<UTC time>)"
    )
    run.add_argument(
        "--pg-dsn",
        default=harness.DEFAULT_PG_DSN,
        help="PostgreSQL that may CREATE DATABASE (default: $BENCH_PG_DSN, else "
        f"{harness.FALLBACK_PG_DSN}, which needs a database named test)",
    )
    run.add_argument(
        "--redis-url",
        default=harness.DEFAULT_REDIS,
        help="Redis, naming no database (default: $BENCH_REDIS_URL, else "
        f"{harness.FALLBACK_REDIS})",
    )
    run.add_argument(
        "--redis-db-base",
        type=_non_negative,
        default=1,
        help="first Redis db number handed out (1): each Celery system takes one, from this "
        "number up, and WIPES it (FLUSHDB) when it starts, before each run and at the end",
    )
    run.add_argument(
        "--flush-redis",
        action="store_true",
        help="let the run wipe those Redis databases although they hold keys (without it, "
        "it refuses to start)",
    )
    run.add_argument(
        "--no-physical",
        action="store_true",
        help="skip the pgbench physical-limit measurement (when asked for and not measured, "
        "the run fails)",
    )
    run.add_argument(
        "--parallel",
        action="store_true",
        help="run the systems side by side (fast checks only: the numbers mean nothing)",
    )
    run.add_argument("--keep-records", action="store_true", help="keep the handlers' record files")
    rep = sub.add_parser("report", help="write plots and the results section from a summary")
    rep.add_argument("dir", type=Path, help="a run's output directory (holds summary.json)")
    rep.add_argument("--docs", type=Path, default=report.DOC, help="markdown file to update")
    rep.add_argument("--images", type=Path, default=report.IMAGES, help="where the PNGs go")
    rep.add_argument(
        "--latest",
        type=Path,
        default=RESULTS / "latest",
        help="where to copy the summary the docs were built from (benchmarks/results/latest)",
    )
    rep.add_argument("--no-latest", action="store_true", help="do not copy the summary")
    for sub_parser in (run, rep):  # for its usage line in the errors found after parsing
        sub_parser.set_defaults(parser=sub_parser)
    return top


def _run(args: argparse.Namespace) -> tuple[Path, bool]:
    """Run, print the tables; the output directory and whether every run succeeded."""
    out = args.out or _default_out()
    opts = harness.Options(
        runs=args.runs,
        scale=SCALES[args.scale],
        out=out,
        systems=args.systems,
        workloads=args.workloads,
        pg_dsn=args.pg_dsn,
        redis_url=args.redis_url,
        redis_db_base=args.redis_db_base,
        flush_redis=args.flush_redis,
        physical=not args.no_physical,
        parallel=args.parallel,
        keep_records=args.keep_records,
    )
    bench = harness.Harness(opts)
    with harness.interrupts_end_the_run():
        result = bench.run()
    print(summary.table(result))
    print(f"\nwrote {out / 'summary.json'}")
    if bench.failed:
        print(f"\n{len(bench.failed)} failure(s):", *bench.failed, sep="\n  ", file=sys.stderr)
    return out, not bench.failed


def _report(rep: argparse.ArgumentParser, args: argparse.Namespace) -> list[Path]:
    if not (args.dir / "summary.json").is_file():
        rep.error(f"{args.dir}: no summary.json there (the output directory of a run)")
    latest = None if args.no_latest else args.latest
    try:
        return report.write(args.dir, docs=args.docs, images=args.images, latest=latest)
    except ValueError as exc:  # markers out of place, or a summary with no results
        rep.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when everything ran; 1 when a run failed or a system was unavailable (the
    summary is written, the report is not: ``make bench`` stops before it); 2 on bad
    input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    if not argv:  # everything, at full scale, then the report
        args = top.parse_args(["run"])
        _check_run(args.parser, args)
        out, ok = _run(args)
        if not ok:
            return 1
        args = top.parse_args(["report", str(out)])
        _report(args.parser, args)
        return 0
    args = top.parse_args(argv)
    if args.command == "run":
        _check_run(args.parser, args)
        return 0 if _run(args)[1] else 1
    if args.command == "report":
        for path in _report(args.parser, args):
            print(f"wrote {path}")
        return 0
    top.print_help()
    return 2


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # the systems are closed by now: no traceback
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
