"""``orbit server`` in this process, where what a failed start leaves open can be seen."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest
import typer

from orbit.cli.main import server


@pytest.fixture
def root_logger() -> Iterator[None]:
    """The command points the root logger at stderr: put it back for the next test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _sockets() -> set[str]:
    """The sockets this process holds open (their ``socket:[inode]`` names)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # a descriptor closed since the listing
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


def test_a_database_that_cannot_be_opened_leaves_no_listening_socket(
    tmp_path: Path, root_logger: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command binds its port before it opens the database (so that its first line
    can name a port 0 picked); a database it could not open ended it with one line and
    exit 1, and the bound socket was left open (a ResourceWarning when collected, a port
    held for as long as the error lived in a process that called the command)."""
    junk = tmp_path / "orbit.db"
    junk.write_bytes(b"not a database, not at all" * 100)
    before = _sockets()
    with pytest.raises(typer.Exit) as ended:
        server(db=f"sqlite:///{junk}", port=0)
    assert ended.value.exit_code == 1
    assert "cannot open the database" in capsys.readouterr().err
    assert _sockets() == before
