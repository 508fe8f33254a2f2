"""The public surface is small and explicit: ``orbit.__all__`` is sorted and complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orbit


def test_all_is_sorted_and_importable() -> None:
    assert orbit.__all__ == sorted(orbit.__all__)
    for name in orbit.__all__:
        assert getattr(orbit, name) is not None
    public = {n for n in dir(orbit) if not n.startswith("_") and n[0].isupper()}
    assert public == set(orbit.__all__)


def test_a_worker_process_imports_neither_the_http_client_nor_the_server() -> None:
    """httpx (with the command-line tools it imports when they are installed) and the
    server's HTTP stack were most of a worker process's start; a worker serves no HTTP and
    never calls the HTTP API, so ``orbit worker`` may load neither before it runs the
    worker. ``orbit.Client`` still loads httpx."""
    done = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "worker", "tests.unit.worker_imports:worker"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "not an orbit Worker" in done.stderr, done.stderr
    assert "loaded: \n" in done.stdout, done.stdout
    code = (
        "import sys, orbit\n"
        "assert 'httpx' not in sys.modules\n"
        "from orbit import AsyncClient, Client, TaskFailed\n"
        "assert 'httpx' in sys.modules and Client.__module__ == 'orbit.client._client'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_command_line_loads_no_worker_runtime_until_it_runs_a_worker() -> None:
    """``import orbit`` loaded the worker runtime (asyncio, websockets): about a tenth of
    the start of every ``orbit task|queue|…`` command, none of which runs a worker."""
    code = (
        "import sys, orbit.cli.main\n"
        "assert not [m for m in sys.modules if m.startswith('orbit.worker')], sys.modules\n"
        "from orbit import Worker\n"
        "assert Worker.__module__ == 'orbit.worker.runner'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
