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


def test_the_check_follows_a_symlink_to_the_database_as_sqlite_does(tmp_path: Path) -> None:
    """SQLite resolves a symlink to the database and makes the -wal and -shm files beside
    the file it points at, not beside the link. Old code checked the link's directory: a
    link in a read-only directory to a database in a writable one (which SQLite serves)
    was refused, "cannot write in .../links", and a link in a writable directory to a
    database in a read-only one passed the check and failed at the first statement with
    ``attempt to write a readonly database``, the error the check is there to replace."""
    with reachable_dir(tmp_path) as base:
        data, links = base / "data", base / "links"
        for where in (data, links):
            where.mkdir()
            where.chmod(0o777)
        open_store(f"sqlite:///{data / 'orbit.db'}").close()
        (data / "orbit.db").chmod(0o666)
        (links / "to-data.db").symlink_to(data / "orbit.db")
        locked = base / "locked"
        locked.mkdir()
        open_store(f"sqlite:///{locked / 'orbit.db'}").close()
        (locked / "orbit.db").chmod(0o666)
        (data / "to-locked.db").symlink_to(locked / "orbit.db")
        links.chmod(0o555)
        locked.chmod(0o555)
        with as_unprivileged():
            store = open_store(f"sqlite:///{links / 'to-data.db'}")
            try:
                store.queue_create("q", max_concurrency=1, rate=0)
                assert [q.name for q in store.queue_list()] == ["q"]
            finally:
                store.close()
            with pytest.raises(DatabaseReadOnly) as caught:
                open_store(f"sqlite:///{data / 'to-locked.db'}")
        assert str(caught.value) == (
            f"cannot write in {locked.resolve()}, the directory of {data / 'to-locked.db'}"
            f" (a link to {(locked / 'orbit.db').resolve()}): SQLite makes the database's "
            "-wal and -shm files beside it"
        )
        for where in (links, locked):
            where.chmod(0o755)  # for the clean-up
