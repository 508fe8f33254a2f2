"""A failing test's report carries no secret (``tests/redacted_reports.py``): pytest run
in a subprocess on a test that fails with a token among a frame's arguments and in its
captured output, with the plugin and, to show the check can fail, without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = "SeCrEtPaRtOfTheToken"
TOKEN = "orbit_" + "a" * 32 + "_" + SECRET

FAILING = f'''
import threading

def connect(url, token):
    raise TimeoutError("timed out while waiting for handshake response")

def test_upgrade():
    headers = {{"Authorization": "Bearer {TOKEN}"}}
    print("connecting with", headers)
    connect("wss://127.0.0.1:1/v1/events/ws", "{TOKEN}")

def test_long_arguments():
    # saferepr cuts an argument past 240 characters in its middle, here in the token's id
    connect("wss://127.0.0.1:1/v1/events/ws", ["q" * 150, "{TOKEN}", "p" * 70])

def test_a_thread_raises():
    def follow():
        raise ConnectionError("refused: Authorization: Bearer {TOKEN}")
    thread = threading.Thread(target=follow)
    thread.start()
    thread.join()
'''


def _pytest_output(tmp_path: Path, *options: str) -> str:
    (tmp_path / "test_failing.py").write_text(FAILING)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", *options, "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["in-process", "xdist"])
def test_a_failed_report_has_no_token(tmp_path: Path, workers: list[str]) -> None:
    out = _pytest_output(tmp_path, "-p", "tests.redacted_reports", *workers)
    assert SECRET not in out
    assert f"orbit_{'a' * 32}_[redacted]" in out  # the frame's argument, redacted
    assert "Bearer [redacted]" in out  # the captured output, redacted
    assert "timed out while waiting for handshake response" in out
    assert "2 failed, 1 passed" in out
    assert "PytestUnhandledThreadExceptionWarning" in out  # the thread's, redacted


def test_without_the_plugin_the_report_shows_the_token(tmp_path: Path) -> None:
    assert SECRET in _pytest_output(tmp_path)


def test_the_suite_loads_every_hook_of_the_plugin(pytestconfig: pytest.Config) -> None:
    """The suite's own runs use the plugin whole (``pytest_plugins`` in
    tests/conftest.py), its warnings' hook too, not only a hook imported by name."""
    manager = pytestconfig.pluginmanager
    plugin = manager.get_plugin("tests.redacted_reports")
    assert plugin is not None
    hooks = {impl.plugin for impl in manager.hook.pytest_warning_recorded.get_hookimpls()}
    assert plugin in hooks
