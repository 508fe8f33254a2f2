"""benchmarks.cpu: CPU spent inside the window is counted once, also for processes that
exit inside it, seen or not (a short drain's worker and its database connections)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import psycopg
import pytest

from benchmarks import cpu
from benchmarks.cpu import CpuSampler
from tests.pg import ADMIN_DSN

# CPU burnt in a window of wall time: other tests on the two cores would slow the burner.
pytestmark = pytest.mark.alone

# Burns CPU for the given seconds, then prints its own CPU time and exits.
BURN = """
import os, sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
burn(float(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
burn(float(sys.argv[2]))
t = os.times()
print(t.user + t.system, flush=True)
"""


def _burner(before: float, inside: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BURN, str(before), str(inside)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_child_born_and_reaped_between_two_scans_is_counted() -> None:
    # interval 0: the only scans are at the start and at the end, so the child is never
    # seen alive; its time reaches this process's children times when it is reaped.
    with CpuSampler(interval=0) as sampler:
        child = _burner(0.0, 0.3)
        out, _ = child.communicate("go\n", timeout=60)
        total = float(out.split()[-1])
    assert child.returncode == 0
    assert sampler.result["cpu_s"]["children"] >= 0.9 * total
    assert sampler.result["cpu_s"]["children"] <= total + 0.2


def test_a_child_seen_before_it_exits_is_not_counted_twice() -> None:
    child = _burner(0.4, 0.3)  # 0.4 s before the window, 0.3 s inside it
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    with CpuSampler(interval=0) as sampler:
        out, _ = child.communicate("go\n", timeout=60)
        total = float(out.split()[-1])
    assert total >= 0.65
    spent = sampler.result["cpu_s"]["children"]
    assert 0.25 <= spent <= total - 0.3  # the window's share, not the whole life


def test_a_child_born_just_after_the_window_opens_is_counted_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker launched right after the window opens and still running when it closes
    (a drain's window ends at the last finish, before the workers are stopped): all its
    CPU time, start-up included, was spent inside the window. psutil's ``create_time``
    on Linux is built on a boot time in whole seconds and reads up to 1 s early; it is
    made to read 0.9 s early here so that a rule built on it fails on any boot."""
    real = psutil.Process.create_time

    def early(self: psutil.Process) -> float:
        return float(real(self)) - 0.9

    monkeypatch.setattr(psutil.Process, "create_time", early)
    with CpuSampler(interval=0) as sampler:
        child = _burner(0.3, 0.0)  # burns 0.3 s as soon as it starts, then waits
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        used = psutil.Process(child.pid).cpu_times()
        burned = used.user + used.system
    out, _ = child.communicate("go\n", timeout=60)  # alive at the close, reaped after
    assert child.returncode == 0
    total = float(out.split()[-1])
    assert burned >= 0.3
    assert child.pid in {p["pid"] for p in sampler.result["processes"]}
    spent = sampler.result["cpu_s"]["children"]
    assert 0.9 * burned <= spent <= total + 0.1


def test_a_database_connection_closed_inside_the_window_is_counted() -> None:
    with CpuSampler(interval=0) as sampler:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
            row = cx.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            backend = psutil.Process(row[0])
            cx.execute("SELECT sum(i) FROM generate_series(1, 3000000) AS i").fetchone()
            cpu = backend.cpu_times()
            burned = cpu.user + cpu.system
        # the postmaster reaps the backend soon after the connection closes
        deadline = time.monotonic() + 10
        while psutil.pid_exists(backend.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not psutil.pid_exists(backend.pid)
    assert burned > 0.05
    assert sampler.result["cpu_s"]["postgres"] >= 0.9 * burned


def test_postmasters_are_found_while_another_scan_replaces_psutil_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil hands every caller the same ``Process`` objects; a scan with other
    attributes in another thread (a parallel run's sampler) replaces their ``info``.
    Here every process is rescanned that way just before it is handed over: finding
    the postmasters must not depend on ``info``."""
    scan = psutil.process_iter
    for _ in scan():  # psutil keeps the Process objects of one scan for the next ones
        pass

    def interleaved(*args: Any, **kwargs: Any) -> Iterator[psutil.Process]:
        for proc in scan(*args, **kwargs):
            for _ in scan(["name"]):  # another caller's scan, between two of ours
                pass
            yield proc

    monkeypatch.setattr(psutil, "process_iter", interleaved)
    names = {p.name() for p in cpu._postmasters()}
    assert names == {"postgres"}  # the local PostgreSQL the tests run on, found


# Another system's server: busy for the given seconds once told, then idle until told
# again (it outlives the window, as a server does).
SERVER = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
print("done", flush=True)
sys.stdin.readline()
"""


def test_an_excluded_child_is_not_counted() -> None:
    """Another system's server is a child of the harness too: a run leaves it out."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, "0.4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    mine = _burner(0.0, 0.2)  # the system under test's worker
    assert server.stdin is not None and server.stdout is not None and mine.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    assert mine.stdout.readline().strip() == "ready"
    try:
        with CpuSampler(interval=0, exclude=[server.pid]) as sampler:
            server.stdin.write("go\n")
            server.stdin.flush()
            assert server.stdout.readline().strip() == "done"  # 0.4 s burnt in the window
            out, _ = mine.communicate("go\n", timeout=60)
    finally:
        server.kill()
        server.wait()
    spent = sampler.result["cpu_s"]["children"]
    mine_total = float(out.split()[-1])  # its whole life, start-up before the window too
    assert 0.15 <= spent <= mine_total + 0.1  # the worker's 0.2 s, not the server's 0.4 s
    assert server.pid not in {p["pid"] for p in sampler.result["processes"]}
