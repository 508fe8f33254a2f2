"""What a SQLite ``--db`` path names, as the driver and the one-server lock meet it: a
directory or another file that is no database file, a symlink to a file not made yet,
every other path to the same file (links, bind mounts)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
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


#: Run in a mount namespace of its own (``unshare``): hold the one-server lock on the
#: database by its path, then try it again by every other path to the same file, and
#: print what each try met.
EVERY_PATH = r"""
import json, os, subprocess, sys
from pathlib import Path
from orbit.store import open_store
from orbit.store.sqlite import hold_for_server

root = Path(sys.argv[1])
data, real = root / "data", root / "data" / "orbit.db"
data.mkdir()
open_store(f"sqlite:///{real}").close()
for d in ("bind dir", "other place", "other"):
    (root / d).mkdir()
(root / "other place" / "orbit.db").touch()
subprocess.run(["mount", "--bind", str(data), str(root / "bind dir")], check=True)
subprocess.run(["mount", "--bind", str(real), str(root / "other place" / "orbit.db")], check=True)
(root / "link.db").symlink_to(real)
(root / "linked-dir").symlink_to(data)

def met(call):
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "taken", ""

def lock(name):
    return lambda: os.close(hold_for_server(str(root / name)))

held = hold_for_server(str(real))
seen = {}
for name in ("link.db", "linked-dir/orbit.db", "bind dir/orbit.db", "other place/orbit.db"):
    seen[name] = met(lock(name))
mounted = root / "other place" / "orbit.db"
seen["open other place"] = met(lambda: open_store(f"sqlite:///{mounted}").close())
os.link(real, root / "other" / "orbit.db")
seen["other/orbit.db"] = met(lock("other/orbit.db"))
os.unlink(root / "other" / "orbit.db")
os.close(held)
seen["beside"] = sorted(p.name for d in ("other place", "other") for p in (root / d).iterdir())
print(json.dumps(seen))
"""


def test_every_path_to_the_database_meets_the_one_server_lock_or_is_refused(
    tmp_path: Path,
) -> None:
    """The lock file is named from the path: a symlink is resolved, a bind mount of the
    directory shares the lock file, a hard link is refused; but a bind mount of the file
    itself (``docker run -v /srv/orbit.db:/data/orbit.db``) named another lock file, in
    another directory, so a second server through it served the same file, deaf to the
    first's wakes (and SQLite made a second -wal there). It is refused, as a hard link
    is, by the server's lock and by the store. Real mounts, in a mount namespace of the
    test's own; the bind-mounted file's path holds a space, which the kernel's list of
    mounts (``/proc/self/mountinfo``) writes as ``\\040``."""
    probe = ["unshare", "--user", "--map-root-user", "--mount"]
    try:
        usable = subprocess.run([*probe, "true"], capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        usable = False
    if not usable:
        pytest.skip("needs unshare with user and mount namespaces")
    run = subprocess.run(
        [*probe, sys.executable, "-c", EVERY_PATH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    for name in ("link.db", "linked-dir/orbit.db", "bind dir/orbit.db"):
        other = tmp_path / name
        assert seen[name] == [
            "DatabaseInUse",
            f"another orbit server is serving {other}: "
            "SQLite takes one server (use PostgreSQL for more)",
        ], seen
    mounted = tmp_path / "other place" / "orbit.db"
    for name in ("other place/orbit.db", "open other place"):
        assert seen[name][0] == "DatabaseMounted", seen
        assert seen[name][1].startswith(f"{mounted} is a mount point of its own"), seen
    assert seen["other/orbit.db"][0] == "DatabaseLinked", seen
    assert seen["beside"] == ["orbit.db"], seen  # no lock file, no -wal there
