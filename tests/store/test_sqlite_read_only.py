"""A SQLite database this process may only read is refused when it is opened, with one
line that names the path and why, and nothing is changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbit.store import open_store
from orbit.store.sqlite import DatabaseReadOnly
from tests.store.read_only import as_unprivileged, reachable_dir


def _contents(where: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(where.iterdir())}


def test_a_database_in_a_read_only_directory_or_file_is_refused_at_open(
    tmp_path: Path,
) -> None:
    """A read-only file opened read-only without a word, and so did a file in a
    directory SQLite cannot make its -wal and -shm files in: the first write (or, in
    the directory, the first statement) failed with ``attempt to write a readonly
    database``, which names neither the file nor the cause."""
    with reachable_dir(tmp_path) as base:
        locked_dir, locked_file = base / "locked-dir", base / "locked-file"
        for where in (locked_dir, locked_file):
            where.mkdir()
            open_store(f"sqlite:///{where / 'orbit.db'}").close()
        (locked_file / "orbit.db").chmod(0o444)
        locked_file.chmod(0o777)  # the directory is writable: only the file is not
        empty = base / "empty"
        empty.mkdir()
        for where in (locked_dir, empty):
            where.chmod(0o555)
        before = {where: _contents(where) for where in (locked_dir, locked_file, empty)}
        with as_unprivileged():
            refused = {}
            for where in (locked_dir, locked_file, empty):
                with pytest.raises(DatabaseReadOnly) as caught:
                    open_store(f"sqlite:///{where / 'orbit.db'}")
                refused[where] = str(caught.value)
        assert refused[locked_dir] == (
            f"cannot write in {locked_dir}, the directory of {locked_dir / 'orbit.db'}: "
            "SQLite makes the database's -wal and -shm files beside it"
        )
        assert refused[empty].startswith(f"cannot write in {empty}, ")
        assert refused[locked_file] == (
            f"{locked_file / 'orbit.db'} is read-only to this user: Orbit writes to it"
        )
        assert {where: _contents(where) for where in before} == before
        for where in (locked_dir, empty):
            where.chmod(0o755)  # for the clean-up
