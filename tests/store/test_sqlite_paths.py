"""What a SQLite ``--db`` path names, as the driver and the one-server lock meet it: a
directory or another file that is no database file, a symlink to a file not made yet."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orbit.store import open_store
from orbit.store.sqlite import DatabaseNotAFile, hold_for_server


def test_a_directory_or_a_fifo_given_as_the_database_is_refused_as_what_it_is(
    tmp_path: Path,
) -> None:
    """A directory was refused as a file with "2 hard links" (a directory's own count of
    links), which sent its operator looking for links that are not there, and the
    one-server lock took it, making ``<directory>-server.lock`` beside it; a FIFO was
    SQLite's ``disk I/O error``. Each is refused with one line that says what it is, and
    nothing is made beside it."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "sub").mkdir()  # three links
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for call in (lambda p: open_store(f"sqlite:///{p}"), lambda p: hold_for_server(str(p))):
        with pytest.raises(DatabaseNotAFile) as refused:
            call(data)
        assert str(refused.value) == (
            f"{data} is a directory: give the path of the database file (e.g. {data / 'orbit.db'})"
        )
        with pytest.raises(DatabaseNotAFile) as refused:
            call(fifo)
        assert (
            str(refused.value) == f"{fifo} is not a regular file: give the path of a database file"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "fifo"]
    assert [p.name for p in data.iterdir()] == ["sub"]


def test_a_database_made_through_a_symlink_to_no_file_yet_is_its_owners_only(
    tmp_path: Path,
) -> None:
    """The file is made 0600 before SQLite opens it, but ``O_EXCL`` refuses a path that
    is a symlink, even to a file not there yet: through such a link (a path kept stable
    by a link to where the data lives) ``sqlite3.connect`` made the database, and its
    ``-wal`` and ``-shm``, with the umask's 0644, readable by every user of the machine."""
    old_umask = os.umask(0o022)
    try:
        target = tmp_path / "data" / "orbit.db"
        target.parent.mkdir()
        link = tmp_path / "orbit.db"
        link.symlink_to(target)
        store = open_store(f"sqlite:///{link}")
        try:
            store.token_create("ci", ["submit"])  # a write: the WAL file exists
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.parent.iterdir()}
        finally:
            store.close()
    finally:
        os.umask(old_umask)
    assert link.is_symlink() and "orbit.db-wal" in modes, modes
    assert modes == dict.fromkeys(modes, 0o600), {k: oct(v) for k, v in modes.items()}
