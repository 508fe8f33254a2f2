"""``scripts/venv``, the set-up ``./scripts/dev`` and ``./scripts/test`` share: the
Python it makes ``.venv`` with, checked before anything is made."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _older_python() -> str:
    """A Python older than 3.11 on this machine (pyenv's, or one on PATH)."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    found += [p for v in ("3.10", "3.9", "3.8") if (p := shutil.which(f"python{v}"))]
    for python in found:
        run = subprocess.run(
            [python, "-c", "import sys; sys.exit(sys.version_info >= (3, 11))"],
            capture_output=True,
            check=False,
        )
        if run.returncode == 0:
            return python
    pytest.skip("no Python older than 3.11 on this machine")


def _venv(project: Path, python: str) -> subprocess.CompletedProcess[str]:
    """``scripts/venv`` of a copy of the project's scripts in ``project``."""
    (project / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "scripts" / "venv", project / "scripts" / "venv")
    return subprocess.run(
        [str(project / "scripts" / "venv")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "PYTHON": python},
    )


def test_an_older_python_is_refused_by_name_before_a_venv_is_made(tmp_path: Path) -> None:
    """With Python 3.10 (python3.11 not found, python3 taken unchecked) pip failed with
    ``ResolutionImpossible``, nothing said "needs 3.11", and the .venv it left was used
    again by every later run. The Python found is named, with PYTHON= to choose."""
    older = _older_python()
    run = _venv(tmp_path, older)
    assert run.returncode == 1, run.stdout + run.stderr
    [line] = run.stderr.splitlines()
    assert "needs Python >= 3.11" in line and f"'{older}' is Python 3." in line, line
    assert "PYTHON=" in line, line
    assert not (tmp_path / ".venv").exists()


def test_a_python_that_is_not_there_is_refused_by_name(tmp_path: Path) -> None:
    run = _venv(tmp_path, str(tmp_path / "no-python"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"no Python at '{tmp_path / 'no-python'}'" in run.stderr, run.stderr
    assert "PYTHON=" in run.stderr, run.stderr
    assert not (tmp_path / ".venv").exists()


def test_a_venv_an_older_python_made_is_made_again(tmp_path: Path) -> None:
    """A .venv the older Python made (an earlier run's) was used as it was."""
    older = _older_python()
    subprocess.run([older, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    run = _venv(tmp_path, sys.executable)  # this one, 3.11 or newer
    assert run.returncode == 0, run.stdout + run.stderr
    assert "making .venv again" in run.stdout and " made it" in run.stdout, run.stdout
    made = subprocess.run(
        [
            str(tmp_path / ".venv" / "bin" / "python"),
            "-c",
            "import sys; print(sys.version_info >= (3, 11))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert made.stdout.strip() == "True"
