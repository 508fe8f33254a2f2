"""The public surface is small and explicit: ``orbit.__all__`` is sorted and complete."""

from __future__ import annotations

import subprocess
import sys

import orbit


def test_all_is_sorted_and_importable() -> None:
    assert orbit.__all__ == sorted(orbit.__all__)
    for name in orbit.__all__:
        assert getattr(orbit, name) is not None
    public = {n for n in dir(orbit) if not n.startswith("_") and n[0].isupper()}
    assert public == set(orbit.__all__)


def test_a_worker_process_does_not_import_the_http_client() -> None:
    """httpx (and the command-line tools it imports when they are installed) was a third
    of a worker process's start; a worker never calls the HTTP API, so neither
    ``import orbit`` nor the CLI's worker command may load it. ``orbit.Client`` still does."""
    code = (
        "import sys, orbit, orbit.cli.main, orbit.worker.runner\n"
        "loaded = sorted(m for m in ('httpx', 'orbit.client') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "from orbit import AsyncClient, Client, TaskFailed\n"
        "assert 'httpx' in sys.modules and Client.__module__ == 'orbit.client._client'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
