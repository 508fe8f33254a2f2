"""The recovery clock starts when the victim is SIGKILLed, not once it has been reaped
and confirmed gone (``workloads.kill_tree``)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from benchmarks import workloads

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
"""


def test_t_kill_is_taken_at_the_kill_and_the_tree_is_confirmed_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    victim = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    assert victim.stdout is not None and victim.stdout.readline().strip() == b"ready"
    (child,) = psutil.Process(victim.pid).children()
    real = psutil.wait_procs

    def slow_confirmation(procs: Any, timeout: float) -> Any:
        time.sleep(0.5)  # a slow reap and confirmation: it is no part of the recovery
        return real(procs, timeout=timeout)

    monkeypatch.setattr(workloads.psutil, "wait_procs", slow_confirmation)
    before = time.time()
    pids, t_kill = workloads.kill_tree(victim)
    after = time.time()

    assert pids == [victim.pid, child.pid]
    assert before <= t_kill < before + 0.3  # at os.kill
    assert after - t_kill >= 0.5  # the confirmation came after, and is not in it
    assert victim.poll() is not None and not child.is_running()
