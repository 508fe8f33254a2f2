"""A drain's CPU (and WAL) window closes at the last finish: the workers' shutdown after
it is not counted as the drain's (``workloads.launched``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from benchmarks.scale import SMOKE
from benchmarks.workloads import RunContext, backlog, throughput
from tests.bench._fake_queue import FakeQueue

STOP_S = 0.6  # the fake workers take this long to shut down


def _ctx(tmp_path: Path, phase: str = "") -> RunContext:
    scale = dataclasses.replace(
        SMOKE, throughput_jobs=6, backlog_small=5, backlog_large=20, poll_s=0.005
    )
    return RunContext(
        system=FakeQueue(stop_s=STOP_S),
        scale=scale,
        run=1,
        rec_root=tmp_path,
        state={},
        phase=phase,
    )


def test_the_throughput_window_ends_at_the_last_finish(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    outcome = throughput(ctx)
    for procs in SMOKE.throughput_processes:
        detail = outcome.detail[f"w{procs}"]
        assert detail["t_last_finish"] >= detail["t_launch"]
        assert ctx.cpu[f"w{procs}"]["wall_s"] < STOP_S  # the shutdown is outside


def test_the_backlog_windows_end_at_the_last_finish(tmp_path: Path) -> None:
    for phase in ("small", "large"):
        ctx = _ctx(tmp_path / phase, phase)
        backlog(ctx)
        assert ctx.cpu[phase]["wall_s"] < STOP_S, phase
