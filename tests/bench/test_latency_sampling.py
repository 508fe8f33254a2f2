"""The latency workload's CPU readings: at the ends of the paced phase only.

The sampler's thread runs in the harness process, the paced client's, and its periodic
process scan made the job in flight wait (benchmarks.workloads.latency). A fake system
here writes each job's record as it is enqueued, so the workload runs in a moment and
without a server.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.scale import SMOKE
from benchmarks.systems.base import Env, Job, System, WorkerSpec
from benchmarks.workloads import RunContext, latency


class _Instant(System):
    """Runs every job the moment it is enqueued: writes its record and nothing else."""

    name = "instant"

    def __init__(self) -> None:
        self.rec_dir: Path | None = None

    def versions(self) -> dict[str, str]:
        return {}

    def settings(self) -> dict[str, Any]:
        return {}

    def prepare(self, env: Env) -> None:
        pass

    def reset(self) -> None:
        pass

    def enqueue(self, jobs: list[Job], batch: int) -> None:
        for job in jobs:
            self.enqueue_one(job)

    def enqueue_one(self, job: Job) -> None:
        assert self.rec_dir is not None
        now = time.time()
        started = self.started(job, now)
        line = f"F {job['id']} {job['t']:.6f} {started:.6f} {now:.6f} {os.getpid()}\n"
        with (self.rec_dir / f"{self.name}.rec").open("a") as out:
            out.write(line)

    def started(self, job: Job, now: float) -> float:
        """When the job's record says it started: as it was enqueued."""
        return now

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        self.rec_dir = spec.rec_dir
        return [] if into is None else into

    def stop_workers(self, procs: list[subprocess.Popen[bytes]]) -> None:
        pass

    def done_count(self) -> int:
        return -1  # not supported: the records alone say a job is done

    def close(self) -> None:
        pass


def test_the_paced_phase_is_read_at_its_ends_not_sampled(tmp_path: Path) -> None:
    # A scale that samples every 0.25 s, as the session and full scales do
    scale = dataclasses.replace(SMOKE, cpu_interval_s=0.25, latency_jobs=40, latency_rate=100.0)
    ctx = RunContext(system=_Instant(), scale=scale, run=1, rec_root=tmp_path, state={})
    outcome = latency(ctx)
    assert outcome.detail["jobs"] == 40
    cpu = ctx.cpu["lat"]
    assert cpu["interval_s"] == 0.0  # no sampling thread in the client's process
    assert cpu["samples"] == 1  # the host's busy share over the whole phase, read at its end
    assert cpu["wall_s"] >= 0.35  # the phase itself: 40 jobs at 100/s
    assert "harness" in cpu["cpu_s"]  # every group's CPU is still counted


def test_other_phases_keep_the_scales_sampling(tmp_path: Path) -> None:
    scale = dataclasses.replace(SMOKE, cpu_interval_s=0.05)
    ctx = RunContext(system=_Instant(), scale=scale, run=1, rec_root=tmp_path, state={})
    with ctx.sampled("drain"):
        time.sleep(0.3)
    assert ctx.cpu["drain"]["interval_s"] == 0.05
    assert ctx.cpu["drain"]["samples"] > 1
