"""``hold_for_server``: one server per SQLite database, however its path is spelled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orbit.store.sqlite import DatabaseInUse, hold_for_server


def test_a_second_server_through_a_symlink_to_the_database_is_refused(tmp_path: Path) -> None:
    """The lock was taken on ``<path as given>-server.lock``: a second server given a
    symlink to the file (or a symlinked directory) locked another lock file and served
    the same database, which SQLite opens through the link, deaf to the first's
    wakes. Spellings of one file that are no link (``./``, ``..``) already met."""
    (tmp_path / "data").mkdir()
    real = tmp_path / "data" / "orbit.db"
    real.touch()
    (tmp_path / "link.db").symlink_to(real)
    (tmp_path / "linked-dir").symlink_to(tmp_path / "data")
    held = hold_for_server(str(real))
    try:
        for other in (tmp_path / "link.db", tmp_path / "linked-dir" / "orbit.db"):
            with pytest.raises(DatabaseInUse, match=f"another orbit server is serving {other}"):
                os.close(hold_for_server(str(other)))
    finally:
        os.close(held)
    os.close(hold_for_server(str(tmp_path / "link.db")))  # let go: the next one takes it
