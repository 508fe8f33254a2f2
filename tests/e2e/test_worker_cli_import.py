"""``orbit worker MODULE:OBJ`` refuses a module that runs its worker as it is imported.

A module ending in a bare ``worker.run()`` (as docs/worker.md's example once did) ran a
hidden worker during the import: it used the module's URL whatever ``--url`` said, and
only a second SIGTERM reached the worker the CLI then started. Real ``orbit worker``
processes against a real server, whose URL is the module's own, so a hidden run would
connect and never end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.servers import Node, Tokens

ROOT = Path(__file__).resolve().parents[2]

HEAD = """\
import asyncio

from orbit import Worker

worker = Worker({url!r}, name="hidden")


@worker.handler("echo")
def echo(ctx, payload):
    return payload


"""

RUNS = {
    "run": "worker.run()\n",
    "arun": "asyncio.run(worker.arun())\n",
    "main_guard": 'if __name__ == "__main__":\n    worker.run()\n',
}


def _orbit_worker(node: Node, tokens: Tokens, where: Path, tail: str) -> subprocess.Popen[str]:
    (where / "hiddenjobs.py").write_text(HEAD.format(url=node.http) + tail)
    return subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "hiddenjobs:worker", "--url", node.http],
        env={**os.environ, "ORBIT_TOKEN": tokens.worker, "PYTHONPATH": str(ROOT)},
        cwd=where,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("call", ["run", "arun"])
def test_a_run_during_the_import_is_refused(
    node: Node, tokens: Tokens, tmp_path: Path, call: str
) -> None:
    """Exit 2 with one line that names the fix; no worker connects, hidden or not."""
    proc = _orbit_worker(node, tokens, tmp_path, RUNS[call])
    try:
        out, _ = proc.communicate(timeout=60)  # a guard: the hidden run never ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, out
    assert "called while orbit worker imported hiddenjobs" in out, out
    assert 'if __name__ == "__main__":' in out, out
    assert "Traceback" not in out, out
    assert "connected as session" not in out, out


def test_the_guarded_example_runs_once_under_orbit_worker(
    node: Node, tokens: Tokens, tmp_path: Path
) -> None:
    """The documented form: ``orbit worker`` connects once, and one SIGTERM stops it."""
    proc = _orbit_worker(node, tokens, tmp_path, RUNS["main_guard"])
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        for line in proc.stdout:
            seen.append(line)
            if "connected as session" in line:
                break
        else:
            raise AssertionError("never connected:\n" + "".join(seen))
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(seen) + out
    assert proc.returncode == 0, out
    assert out.count("connected as session") == 1, out
