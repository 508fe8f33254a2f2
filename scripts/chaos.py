"""The long chaos run: many tasks, many faults, one PostgreSQL restart; prints the report
as JSON and exits 1 if any check failed (see ``tests/fault/chaos.py``).

    python scripts/chaos.py --tasks 10000 --kills 50 --seed 1
    python scripts/chaos.py --tasks 2000 --kills 20 --seed 7 --no-pg-restart

Needs a local PostgreSQL (``ORBIT_TEST_PG_DSN``, default postgres@127.0.0.1:5432) and,
for the restart, ``pg_ctlcluster`` run as a user allowed to restart the cluster.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(ROOT))

from tests.fault.chaos import run_chaos  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--kills", type=int, default=50, help="worker/server kills and cuts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, help="logs go here (default: a temp dir)")
    parser.add_argument("--timeout", type=float, help="bound on the run, seconds")
    parser.add_argument("--no-pg-restart", dest="pg_restart", action="store_false")
    parser.add_argument(
        "--keep-review",
        dest="resolve_review",
        action="store_false",
        help="leave needs_review tasks unresolved",
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="orbit-chaos-"))
    report = run_chaos(
        args.tasks,
        args.kills,
        args.seed,
        workdir,
        pg_restart=args.pg_restart,
        resolve_review=args.resolve_review,
        timeout=args.timeout,
    )
    print(report.to_json())
    print(report.summary(), file=sys.stderr)
    print(f"logs: {workdir}", file=sys.stderr)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
