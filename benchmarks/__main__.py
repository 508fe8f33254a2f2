"""``python -m benchmarks``: run the side-by-side benchmark and write its report.

With no arguments it runs everything at full scale (5 runs), then writes the report
into docs/benchmarks.md. See ``python -m benchmarks --help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import harness, report, summary
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
    return [part.strip() for part in text.split(",") if part.strip()]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


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
        help="job counts: full (20,000 jobs…; default) or smoke (a few dozen)",
    )
    run.add_argument(
        "--out", type=Path, help="a new output directory (default benchmarks/results/<UTC time>)"
    )
    run.add_argument(
        "--pg-dsn",
        default=harness.DEFAULT_PG_DSN,
        help="PostgreSQL that may CREATE DATABASE ($BENCH_PG_DSN, or %(default)s)",
    )
    run.add_argument(
        "--redis-url",
        default=harness.DEFAULT_REDIS,
        help="Redis, without a db number ($BENCH_REDIS_URL, or %(default)s)",
    )
    run.add_argument(
        "--redis-db-base", type=int, default=1, help="first Redis db number handed out (1)"
    )
    run.add_argument(
        "--no-physical", action="store_true", help="skip the pgbench physical-limit measurement"
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
    return top


def _run(args: argparse.Namespace) -> Path:
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
        physical=not args.no_physical,
        parallel=args.parallel,
        keep_records=args.keep_records,
    )
    result = harness.Harness(opts).run()
    print(summary.table(result))
    print(f"\nwrote {out / 'summary.json'}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    if not argv:  # everything, at full scale, then the report
        out = _run(top.parse_args(["run"]))
        args = top.parse_args(["report", str(out)])
        report.write(args.dir, docs=args.docs, images=args.images, latest=args.latest)
        return 0
    args = top.parse_args(argv)
    if args.command == "run":
        _run(args)
    elif args.command == "report":
        latest = None if args.no_latest else args.latest
        written = report.write(args.dir, docs=args.docs, images=args.images, latest=latest)
        for path in written:
            print(f"wrote {path}")
    else:
        top.print_help()
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
