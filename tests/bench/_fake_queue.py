"""A queue for the harness's own tests: no server, no database, no worker process.

Its "workers" run every queued job the moment they start (each job's record is written
into the run's record directory at once) and it logs every call, with the instance that
got it, in ``CALLS``, so a test can see in which order the harness drove which instance.
The harness loads it by module path, like a registered system (``harness.Entry``).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.systems.base import Env, Job, System, WorkerSpec

#: every call so far: (instance number, what, detail)
CALLS: list[tuple[int, str, Any]] = []
_numbers = itertools.count(1)


class FakeQueue(System):
    uses_postgres = False

    def __init__(self, label: str = "a", bound: float | None = None, stop_s: float = 0.0) -> None:
        self.name = f"fake-{label}"
        self.number = next(_numbers)
        self.bound = bound
        self.stop_s = stop_s  # how long stop_workers takes (a worker's shutdown)
        self.queued: list[Job] = []

    def _log(self, what: str, detail: Any = None) -> None:
        CALLS.append((self.number, what, detail))

    def versions(self) -> dict[str, str]:
        return {"fake": "1"}

    def settings(self) -> dict[str, Any]:
        return {}

    def prepare(self, env: Env) -> None:
        self._log("prepare", str(env.work_dir))

    def reset(self) -> None:
        self.queued.clear()
        self._log("reset")

    def enqueue(self, jobs: list[Job], batch: int) -> None:
        self.queued.extend(jobs)
        self._log("enqueue", len(jobs))

    def maintain(self) -> dict[str, Any]:
        self._log("maintain", len(self.queued))
        return {"fake": True}

    def claim_statement_ms(self, spec: WorkerSpec | None = None) -> float | None:
        self._log("claim", None if spec is None else spec.concurrency)
        return 0.1

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        """Run every queued job at once: its record says it started 10 ms ago."""
        self._log("start", len(self.queued))
        now = time.time()
        lines = [
            f"F {job['id']} {job['t']:.6f} {now - 0.01:.6f} {now:.6f} {os.getpid()}\n"
            for job in self.queued
        ]
        with (Path(spec.rec_dir) / f"fake-{self.number}.rec").open("a") as out:
            out.write("".join(lines))
        self.queued.clear()
        return [] if into is None else into

    def stop_workers(self, procs: list[subprocess.Popen[bytes]]) -> None:
        time.sleep(self.stop_s)
        self._log("stop")

    def done_count(self) -> int:
        return -1  # the records say when a job is done

    def recovery_bound_s(self) -> float | None:
        return self.bound

    def close(self) -> None:
        self._log("close")
