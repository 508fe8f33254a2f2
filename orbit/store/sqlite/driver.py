"""SQLite driver. Every write transaction takes the database write lock up front
(``BEGIN IMMEDIATE``), so a transition reads and writes with no interleaving; the clock
is read after that lock is held."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import chain
from pathlib import Path
from typing import Any
from urllib.parse import quote

from orbit.store.driver import (
    DATABASE_BUSY,
    DATABASE_FULL,
    DATABASE_READ_ONLY,
    DATABASE_UNAVAILABLE,
    DatabaseUnavailable,
    Notice,
    Params,
    Row,
    RowColumns,
    Table,
    load_queries,
)

_HERE = Path(__file__).parent
#: a named query may be several statements, each ending with ';' at the end of a line
_STATEMENT_END_RE = re.compile(r";[ \t]*\n")


def _encode(params: Params) -> Params:
    return {k: json.dumps(v) if isinstance(v, list | tuple) else v for k, v in params.items()}


_ARRAYS = frozenset({list, tuple})


def _encoded_rows(rows: Sequence[Row]) -> list[Params]:
    """Each row's parameters, ``_encode``d. Rows held by column (``RowColumns``: a
    plan's writes, a batch submit's tasks) are encoded a column at a time, each column
    looked through for a list by the types it holds, and zipped into one dict per row:
    read as dicts and encoded one by one, they made two dicts per row."""
    if not isinstance(rows, RowColumns):
        return [_encode(r) for r in rows]
    return _row_dicts(_encoded_columns(rows))


def _row_dicts(columns: dict[str, list[Any]]) -> list[Params]:
    """Encoded columns as one dict per row: for a statement ``positional`` cannot bind."""
    names = tuple(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)]


def _encoded_columns(rows: RowColumns) -> dict[str, list[Any]]:
    """Rows held by column, each column ``_encode``d a column at a time."""
    return {
        name: [json.dumps(v) if isinstance(v, list | tuple) else v for v in values]
        if _ARRAYS.intersection(map(type, values))
        else values
        for name, values in rows.columns.items()
    }


_PARAM_RE = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


@functools.cache  # one per statement and shape of rows
def positional(statement: str, names: tuple[str, ...]) -> tuple[str, tuple[str, ...]] | None:
    """A write's statement with each ``:name`` as ``?N`` (N the rank of the name's first
    appearance), and the names in that order: ``executemany`` then binds each row's
    tuple by position, where for a dict it made each parameter's name into a string
    and looked it up, per row, and each row was a dict made for it. None (the dicts'
    way, as before) for a statement with a quote (a ``:`` in a literal must stay), none
    of ``names`` or a name not among them (the dicts' way raises its error)."""
    if "'" in statement or '"' in statement:
        return None
    used: dict[str, int] = {}
    for found in _PARAM_RE.finditer(statement):
        if found.group(1) not in names:
            return None
        used.setdefault(found.group(1), len(used) + 1)
    if not used:
        return None
    sql = _PARAM_RE.sub(lambda m: f"?{used[m.group(1)]}", statement)
    return sql, tuple(used)


def joined(chunks: Sequence[Sequence[Row]]) -> Sequence[Row]:
    """The rows of several chunks as one sequence, in order. Chunks held by column alike
    (``RowColumns``, a batch submit's) stay so, each column the chunks' lists chained:
    ``write_many`` then encodes a column at a time and binds each row by position
    (``_write_columns``), where a dict per row (what a ``RowColumns`` gives a reader of
    rows) was encoded again into a second dict per row."""
    columned = [c for c in chunks if isinstance(c, RowColumns)]
    if columned and len(columned) == len(chunks):
        names = list(columned[0].columns)
        if all(list(c.columns) == names for c in columned):
            return RowColumns(
                {n: list(chain.from_iterable(c.columns[n] for c in columned)) for n in names}
            )
    return [row for rows in chunks for row in rows]


def statements(queries: dict[str, str]) -> dict[str, list[str]]:
    """Each named query as its statements, for ``write_many``: SQLite runs one statement
    per call, and a write such as ``task_submit_many`` (the tasks, then their events)
    needs two over the same rows."""
    return {
        name: [part.strip() for part in _STATEMENT_END_RE.split(sql) if part.strip()]
        for name, sql in queries.items()
    }


class _SqliteConnection:
    def __init__(
        self, cx: sqlite3.Connection, queries: dict[str, str], writes: dict[str, list[str]]
    ) -> None:
        self._cx = cx
        self._queries = queries
        self._writes = writes

    def fetch(self, name: str, params: Params) -> list[Row]:
        return self.fetch_table(name, params).dicts()

    def fetch_table(self, name: str, params: Params) -> Table:
        cur = self._cx.execute(self._queries[name], _encode(params))
        names = tuple(d[0] for d in cur.description) if cur.description else ()
        return Table(names, cur.fetchall())

    def write_many(self, name: str, rows: Sequence[Row]) -> int:
        """Each of the query's statements over every row; the count is the last one's
        (a multi-statement write makes its later rows from the ones the first wrote)."""
        if not rows:
            return 0
        if isinstance(rows, RowColumns):
            return self._write_columns(name, rows)
        encoded = _encoded_rows(rows)
        count = 0
        for statement in self._writes[name]:
            count = self._cx.executemany(statement, encoded).rowcount
        return count

    def _write_columns(self, name: str, rows: RowColumns) -> int:
        """``write_many`` of rows held by column: each statement bound by position
        (``positional``) to the tuples of the columns it names, or else to a dict per
        row as before."""
        columns = _encoded_columns(rows)
        names = tuple(columns)
        count = 0
        for statement in self._writes[name]:
            form = positional(statement, names)
            if form is None:
                count = self._cx.executemany(statement, _row_dicts(columns)).rowcount
            else:
                sql, order = form
                count = self._cx.executemany(
                    sql, zip(*(columns[n] for n in order), strict=True)
                ).rowcount
        return count

    def write_stream(
        self,
        name: str,
        chunks: Iterable[Sequence[Row]],
        notify: Callable[[], Sequence[Notice]] = tuple,
    ) -> int:
        # In-process: nothing to overlap, so the chunks are written as one. ``notify``:
        # as write_batch's notices, one server process woken in-process after the commit.
        count = self.write_many(name, joined(list(chunks)))
        notify()
        return count

    def lock_many(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[list[Row]], int]:
        # In-process: a statement costs no round trip, and BEGIN IMMEDIATE already holds
        # the write lock (one view for every read): the reads, then the clock.
        return [self.fetch(name, params) for name, params in calls], self.now()

    def lock_tables(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[Table], int]:
        return [self.fetch_table(name, params) for name, params in calls], self.now()

    def write_batch(
        self,
        writes: Sequence[tuple[str, Sequence[Row]]],
        notify: Sequence[Notice] = (),
        *,
        commit_with: Sequence[int | None] | None = None,
    ) -> list[int]:
        # ``notify``: one server process, woken in-process after the commit (on_ready).
        # ``commit_with``: a commit here is a function call, not a round trip to save;
        # the transaction commits when it ends, and the store checks the counts.
        return [self.write_many(name, rows) for name, rows in writes]

    def execute(self, name: str, params: Params) -> int:
        return self._cx.execute(self._queries[name], _encode(params)).rowcount

    def prelude(self, name: str, params: Params) -> None:
        self.execute(name, params)  # in-process: no round trip to save

    def now(self) -> int:
        return time.time_ns() // 1000

    def run_script(self, sql: str) -> None:
        body = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--"))
        for statement in body.split(";"):
            if statement.strip():
                self._cx.execute(statement)


#: SQLite's page cache, per connection (its default is 2 MiB): a queue of tens of thousands
#: of tasks and their indexes outgrows that, and every claim then reads pages back from the
#: operating system.
CACHE_KIB = 64 * 1024

#: The size SQLite truncates the ``-wal`` file back to after a checkpoint that emptied it.
#: Past a checkpoint SQLite writes the file again from its start but never shrinks it (its
#: default limit is none): one large batch (a submit of 100,000 tasks) left a ``-wal``
#: file of its size on disk for as long as the server ran. A limit well above what a
#: usual stretch of commits between checkpoints writes, so the file is not cut and grown
#: again at every checkpoint.
JOURNAL_LIMIT_BYTES = 64 * 1024 * 1024


def _create_private(path: str) -> None:
    """Create the database file readable and writable by its owner only, if it does not
    exist yet. It holds token and resume-secret hashes, and ``sqlite3.connect`` would
    create it with the umask's mode (0644 under the usual 022), readable by every user of
    the machine; SQLite gives its WAL and shared-memory files the database file's mode.
    An existing file keeps the mode its operator gave it.

    A symlink is followed, as SQLite follows it: ``O_EXCL`` refuses a path that is a
    symlink, even one to no file yet, so a database made through a dangling link was
    left to ``sqlite3.connect``, which made it with the umask's mode."""
    with suppress(FileExistsError):
        os.close(os.open(os.path.realpath(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


class DatabaseNotAFile(Exception):
    """The SQLite database path names a directory, or something else that is no file."""


def _check_regular(path: str) -> None:
    """Refuse, with one line that says what it is, a path that names a directory (or a
    FIFO, a device, a socket) rather than a database file. A directory was refused as a
    file with "2 hard links" (a directory's own count of links), which sent its operator
    looking for links that are not there. A path ending in ``/`` that is no directory
    is refused too: the file was made without the slash, then every later open failed
    with NotADirectoryError."""
    if path.endswith(os.sep) and not os.path.isdir(path):
        raise DatabaseNotAFile(
            f"{path} ends in {os.sep} and so names a directory: give the path of the "
            f"database file (e.g. {path}orbit.db)"
        )
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # made here: a file
    if stat.S_ISDIR(mode):
        raise DatabaseNotAFile(
            f"{path} is a directory: give the path of the database file "
            f"(e.g. {os.path.join(path, 'orbit.db')})"
        )
    if not stat.S_ISREG(mode):
        raise DatabaseNotAFile(f"{path} is not a regular file: give the path of a database file")


def open_to_others(path: str) -> int | None:
    """The database file's permission bits if users other than its owner and its group
    may read or write it (a file an Orbit before 0600 made, under the usual umask),
    else None: ``orbit server`` says so when it starts, and leaves the mode as it is."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    return mode if mode & 0o006 else None


class DatabaseReadOnly(Exception):
    """This process cannot write the SQLite database file, or the directory it is in."""


def _writable(path: str, mode: int = os.W_OK) -> bool:
    """Whether this process may write ``path``, by its effective user (what ``open``
    checks: root may write a file whatever its mode, not on a read-only file system)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _check_writable(path: str) -> None:
    """Refuse, with one line that names the path and why, a database this process could
    only read. SQLite says nothing at open: it opens a read-only file read-only, and
    the first write failed with ``attempt to write a readonly database``, which names
    neither; in a directory it cannot write in, it cannot make the ``-wal`` and
    ``-shm`` files, and failed at the first statement with the same words.

    A symlink is followed, as SQLite follows it: the ``-wal`` and ``-shm`` files are made
    beside the file it points at, so that is the directory that must be writable."""
    real = os.path.realpath(path)
    where = os.path.dirname(real)
    if not _writable(where, os.W_OK | os.X_OK):
        link = "" if real == os.path.abspath(path) else f" (a link to {real})"
        raise DatabaseReadOnly(
            f"cannot write in {where}, the directory of {path}{link}: SQLite makes the "
            "database's -wal and -shm files beside it"
        )
    for name in (path, f"{real}-wal", f"{real}-shm"):
        if os.path.exists(name) and not _writable(name):
            raise DatabaseReadOnly(f"{name} is read-only to this user: Orbit writes to it")


class DatabaseLinked(Exception):
    """The SQLite database file has more than one name (hard links)."""


def _check_one_name(path: str) -> None:
    """Refuse a database file with hard links: SQLite keeps its ``-wal`` and ``-shm``
    beside the name it was opened by, so two processes opening two names of one file
    write past each other's locks, and the file is corrupted ("Multiple links to the
    same file", SQLite's *How To Corrupt An SQLite Database File*). A second server
    through a link also passed the one-server lock, which is named from the path."""
    try:
        links = os.stat(path).st_nlink
    except FileNotFoundError:
        return  # made here: one name
    if links > 1:
        raise DatabaseLinked(
            f"{path} has {links} hard links: SQLite cannot keep a database consistent "
            "through more than one name (its -wal file goes by name); remove the other "
            "links, or copy the file"
        )


class DatabaseMounted(Exception):
    """The SQLite database file is a mount point of its own (a bind mount of the file)."""


#: where Linux lists this process's mounts; a system without it has no bind mount of a file
MOUNTINFO = Path("/proc/self/mountinfo")
_ESCAPE_RE = re.compile(r"\\([0-7]{3})")


def mount_points(mountinfo: str) -> set[str]:
    """The mount points ``/proc/self/mountinfo`` lists (its fifth field), with the octal
    escapes the kernel writes for a space, a tab, a newline and a backslash undone."""
    return {
        _ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
        for line in mountinfo.splitlines()
        if line.count(" ") >= 4
    }


def _check_not_mounted(path: str) -> None:
    """Refuse a database file that is itself a mount point (``mount --bind`` of the file,
    ``docker run -v /srv/orbit.db:/data/orbit.db``): the file then has a second name in
    another directory, as a hard link gives it, and is as unsafe. SQLite makes its
    ``-wal`` and ``-shm`` beside the name it was opened by, so a process on the other
    name wrote past this one's WAL index, and a container's ``-wal`` lived in the
    container, not beside the file, and went with it; a second server through it passed
    the one-server lock (``hold_for_server``). A bind mount of the directory is safe:
    the files beside the database are then the same files by either path."""
    real = os.path.realpath(path)
    try:
        mounts = MOUNTINFO.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return  # not Linux: no bind mount of a single file
    if real in mount_points(mounts) and os.path.isfile(real):
        raise DatabaseMounted(
            f"{path} is a mount point of its own (a bind mount of the file): SQLite "
            "cannot keep a database consistent through more than one name (its -wal "
            "file goes by name); mount the directory that holds it instead"
        )


class DatabaseNotOrbit(Exception):
    """The SQLite file holds another application's database, or is no database at all."""


class ForeignDatabase(DatabaseNotOrbit):
    """The SQLite file is a database, another application's: readable, and not Orbit's
    (where a file that is no database at all cannot be opened)."""


#: What an existing file holds, read before Orbit changes anything in it: whether it has
#: Orbit's migration table, up to three of its other schema objects, and the two numbers
#: an application marks its own database with (Orbit sets neither).
_OWNER_SQL = """
SELECT
    (SELECT count(*) FROM sqlite_master
     WHERE type = 'table' AND name = 'orbit_schema_version') AS orbit,
    (SELECT group_concat(name, ', ') FROM (
        SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite~_%' ESCAPE '~'
        ORDER BY name LIMIT 3)) AS objects,
    (SELECT user_version FROM pragma_user_version) AS user_version,
    (SELECT application_id FROM pragma_application_id) AS application_id
"""


def _check_orbit(path: str) -> None:
    """Refuse, changing nothing, an existing file that is not Orbit's database: opened
    as it was, Orbit put another application's database in WAL mode and added its own
    tables to it. Orbit's is a database with Orbit's migration table
    (``orbit_schema_version``, whatever else an operator added to it); a new one is no
    file, an empty file, or a SQLite database with no table, view, index or trigger and
    no ``user_version`` or ``application_id``. Anything else is another application's;
    a file that is no SQLite database is refused in SQLite's words.

    The file is read through SQLite alone, never opened by Orbit itself: closing any
    descriptor of a file drops every POSIX lock this process holds on it, and another
    connection of this process (a second store on one file) holds SQLite's. Without a
    ``-wal`` beside it no one has it open in WAL mode, and it is read ``immutable``
    (no lock, no file made: a read-only open of a WAL database makes a ``-wal`` and a
    ``-shm`` and leaves them); with one, it is read as any reader reads it, through
    that WAL. What looks new is read again read-only, under SQLite's shared lock, so
    that a rollback-mode database in the middle of another program's first write is
    not taken for an empty one (a file made there is Orbit's to use, as it is new)."""
    real = os.path.realpath(path)
    try:
        size = os.stat(real).st_size
    except FileNotFoundError:
        return  # made here: Orbit's
    live = os.path.exists(f"{real}-wal")  # a WAL database in use (or left by a crash)
    if size == 0 and not live:
        return
    owner = _read_owner(path, real, "mode=ro" if live else "immutable=1")
    if not live and owner == (0, None, 0, 0):
        owner = _read_owner(path, real, "mode=ro")
    orbit, objects, user_version, application_id = owner
    marks = [
        f"{n} {v}"
        for n, v in (("user_version", user_version), ("application_id", application_id))
        if v
    ]
    if not orbit and (objects or marks):
        raise ForeignDatabase(
            f"{path} is not an Orbit database: it holds another application's data "
            f"({objects or ', '.join(marks)}) and no orbit_schema_version table; Orbit "
            "changed nothing in it: give Orbit a file of its own"
        )


def holds_orbit(path: str) -> bool:
    """Whether the existing file at ``path`` holds Orbit's migration table, read as
    ``_check_orbit`` reads it: nothing made, nothing changed. An empty file holds none.
    The ``token`` commands open only Orbit's database: opened as a new one, an empty
    file was migrated (and put in WAL mode) just to list no tokens."""
    real = os.path.realpath(path)
    live = os.path.exists(f"{real}-wal")
    if os.stat(real).st_size == 0 and not live:
        return False
    return bool(_read_owner(path, real, "mode=ro" if live else "immutable=1")[0])


def _read_owner(path: str, real: str, mode: str) -> tuple[int, str | None, int, int]:
    """``_OWNER_SQL``'s answer from ``real`` opened with the URI parameter ``mode``."""
    cx = sqlite3.connect(f"file:{quote(real)}?{mode}", uri=True)
    try:
        orbit, objects, user_version, application_id = cx.execute(_OWNER_SQL).fetchone()
    except sqlite3.DatabaseError as exc:
        if "file is not a database" not in str(exc):
            raise
        raise DatabaseNotOrbit(f"{path} is not an Orbit database: {exc}") from None
    finally:
        cx.close()
    return int(orbit), objects, int(user_version), int(application_id)


class DatabaseNotWal(Exception):
    """SQLite cannot put this database in WAL mode (its file system, or its VFS)."""


def set_wal(cx: sqlite3.Connection, path: str) -> None:
    """Put the database in WAL mode, or refuse it with one line. The pragma answers with
    the mode in effect; where WAL cannot be had (a VFS without shared memory, as on some
    network file systems) it keeps the old mode and raises nothing, and Orbit ran in
    rollback mode, where a reader waits for every writer (``orbit token ls`` behind a
    server's writes). An in-memory database has no other connection to wait for: its
    mode stays ``memory``."""
    (mode,) = cx.execute("PRAGMA journal_mode = WAL").fetchone()
    if path != ":memory:" and str(mode).lower() != "wal":
        raise DatabaseNotWal(
            f"SQLite cannot use WAL for {path} (its journal mode stays {mode!r}): "
            "put the database on a local file system"
        )


def check_path(path: str) -> None:
    """Refuse a database path SQLite cannot serve Orbit through, with one line: a
    directory, a file with other names (hard links, a bind mount of the file), a file or
    directory this user cannot write, a file that is another application's database."""
    _check_regular(path)
    _check_one_name(path)
    _check_not_mounted(path)
    _check_writable(path)
    _check_orbit(path)


class DatabaseInUse(Exception):
    """Another server process serves this SQLite database."""


def hold_for_server(path: str) -> int:
    """Make this process the only server of the SQLite database at ``path``, and return
    the descriptor that holds it (close it to let go). A second server on one file would
    be consistent (every write transaction takes the file's write lock) but deaf: on
    SQLite dispatch and cancels wake only the process that committed, so its workers
    would wait for the slow poll. The lock is an exclusive ``flock`` of a file beside the
    database (``<path>-server.lock``), never of the database itself, whose locks are
    SQLite's; the kernel drops it when the process ends, however it ends, so a server
    that was killed leaves nothing to clean up.

    Every path that reaches the file meets the same lock. The lock file is named from
    the path with its symlinks resolved, as SQLite resolves them to find the file (and
    puts its ``-wal`` beside the target). ``check_path`` refuses a file with a second
    name (a hard link, a bind mount of the file itself), which SQLite cannot serve
    safely anyway; so the file has one directory entry, and every other path (through a
    symlink, a bind mount of its directory or of a directory above, a second mount of
    its file system) reaches it through that one directory, where ``<name>-server.lock``
    is one file, whichever mount it is reached by, and ``flock`` locks the file.
    Rejected: a ``flock`` of the database file itself, on a descriptor of Orbit's own.
    Closing any descriptor of a file drops every POSIX lock the process holds on it,
    SQLite's included (the shared lock that tells others a WAL database is in use), so
    that descriptor could never be closed while the store is open; and where ``flock``
    is emulated by byte-range locks (NFS on Linux) it would conflict with SQLite's own.
    A lock file named from the inode: a bind mount of the file puts it in another
    directory, and a file restored from a backup (a new inode) leaves the old ones.

    The path is checked as the driver checks it (no directory, one name, writable, no
    other application's database) before the lock file is made: the lock is taken
    before the store is opened, so that a second server is refused before it migrates
    or writes anything, and a path the store would refuse leaves no lock file behind."""
    check_path(path)
    real = os.path.realpath(path)
    fd = os.open(f"{real}-server.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DatabaseInUse(
            f"another orbit server is serving {path}: SQLite takes one server "
            "(use PostgreSQL for more)"
        ) from None
    return fd


class LockWaitOver(sqlite3.OperationalError):
    """This process's connection was not free within a transaction's wait: its other
    threads' transactions held it (one of them waiting for another process's write lock,
    or one long write). "locked", as SQLite's own busy error: retried, then busy."""

    def __init__(self) -> None:
        super().__init__("database is locked: this process's connection was not free in time")


#: SQLite's primary result codes (``sqlite_errorcode & 0xff``) that say the database
#: itself failed, and which of ``Driver.unavailable_code``'s conditions each is
_UNAVAILABLE_CODES = {
    5: DATABASE_BUSY,  # SQLITE_BUSY: another connection's write lock, past busy_timeout
    6: DATABASE_BUSY,  # SQLITE_LOCKED
    8: DATABASE_READ_ONLY,  # SQLITE_READONLY (a read-only file, PRAGMA query_only)
    10: DATABASE_UNAVAILABLE,  # SQLITE_IOERR
    13: DATABASE_FULL,  # SQLITE_FULL: the disk, or PRAGMA max_page_count
    14: DATABASE_UNAVAILABLE,  # SQLITE_CANTOPEN
}


class SqliteDriver:
    """One connection for the process's transactions, serialised by a lock, and one for
    its reads (``read``), with a lock of its own; WAL and full sync, so a committed
    finish survives a crash of the process or the machine."""

    name = "sqlite"

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 10_000) -> None:
        self.path = str(path)
        #: the longest one try of a transaction waits for another connection's write
        #: lock; a transaction's ``wait_s`` cuts it (``transaction``)
        self.busy_timeout_ms = int(busy_timeout_ms)
        self._busy_ms = self.busy_timeout_ms  # the connection's busy_timeout now
        self.queries = load_queries(_HERE / "queries.sql")
        self._writes = statements(self.queries)
        self.migrations = _HERE / "migrations"
        self._lock = threading.RLock()
        if self.path != ":memory:":
            check_path(self.path)
            _create_private(self.path)
        self._cx = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._cx.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            set_wal(self._cx, self.path)
            self._cx.execute(f"PRAGMA journal_size_limit = {JOURNAL_LIMIT_BYTES}")
            self._cx.execute(self.queries["commit_durable"])
            # On macOS fsync() returns with the commit in the drive's cache, which a power
            # loss loses: F_FULLFSYNC (SQLite's fullfsync, off by default) flushes it, for
            # the WAL's syncs and the checkpoints'. Elsewhere SQLite's sync is the same.
            self._cx.execute("PRAGMA fullfsync = ON")
            self._cx.execute("PRAGMA foreign_keys = ON")
            self._cx.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
        except BaseException:
            self._cx.close()  # the caller never gets the driver to close
            raise
        self._read_cx = self._cx if self.path == ":memory:" else self._reader()
        #: the read connection's lock: the transactions' own when it is their connection
        self._read_lock: threading.Lock | threading.RLock = (
            self._lock if self._read_cx is self._cx else threading.Lock()
        )

    def _reader(self) -> sqlite3.Connection:
        """The connection ``read`` runs on, opened after the first, which made the file
        and set WAL (the file's own mode from then on). Its own, so that a read waits for
        no transaction of this process: the one connection's lock was held by the
        reaper's or the scheduler's transaction, waiting in ``BEGIN IMMEDIATE`` for
        another process's write lock, and /readyz and every GET behind it answered 503
        busy though under WAL a read takes none of a writer's locks. ``query_only``: a
        read that wrote would commit outside every transaction. The pragmas that matter
        to a read: the wait for a lock (a WAL reader rarely meets one: while another
        connection recovers the WAL) and the page cache. An in-memory database keeps its
        one connection: a second connection to ``:memory:`` is another database."""
        cx = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            cx.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
            cx.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            cx.execute("PRAGMA query_only = ON")
        except BaseException:
            cx.close()
            self._cx.close()  # the caller never gets the driver to close
            raise
        return cx

    @contextmanager
    def transaction(
        self, *, durable: bool = True, wait_s: float | None = None
    ) -> Iterator[_SqliteConnection]:
        """``wait_s``: the longest this waits for the connection (another thread's
        transaction holds it) and then for the write lock (``BEGIN IMMEDIATE``, whose
        ``busy_timeout`` is cut to what is left of it): past it, ``database is locked``.
        A lock wait left unbounded held the connection, and every thread behind it,
        for as long as another process held the write lock."""
        if wait_s is None:
            self._lock.acquire()
        else:
            end = time.monotonic() + wait_s
            if not self._lock.acquire(timeout=max(wait_s, 0.0)):
                raise LockWaitOver()
        try:
            busy_ms = self.busy_timeout_ms
            if wait_s is not None:
                busy_ms = max(1, min(busy_ms, int((end - time.monotonic()) * 1000)))
            if busy_ms != self._busy_ms:  # only when cut short: no statement otherwise
                self._cx.execute(f"PRAGMA busy_timeout = {busy_ms}")
                self._busy_ms = busy_ms
            if not durable:  # the safety level can change only between transactions
                self._cx.execute(self.queries["commit_relaxed"])
            try:
                self._cx.execute("BEGIN IMMEDIATE")
                try:
                    yield _SqliteConnection(self._cx, self.queries, self._writes)
                    self._cx.execute("COMMIT")
                except BaseException:
                    # SQLite may have rolled back already (a full disk, an I/O error):
                    # a second ROLLBACK would raise instead of the error that happened.
                    # A COMMIT that failed leaves its transaction open, and this one
                    # connection serves every thread: it must not stay in it.
                    if self._cx.in_transaction:
                        self._cx.execute("ROLLBACK")
                    raise
            finally:
                if not durable:
                    self._cx.execute(self.queries["commit_durable"])
        finally:
            self._lock.release()

    def read(self, name: str, params: Params) -> list[Row]:
        """The statement alone, outside ``BEGIN``, on the read connection (``_reader``):
        under WAL it is its own read transaction and takes none of the locks a writer
        holds, so it reads the last commit (this process's, once ``transaction`` has
        returned, as another's) while a transaction of this process or another writes or
        waits for the write lock. It sees nothing a transaction has not committed: no
        caller reads in the middle of its own transaction. Through ``transaction`` it
        took the write lock and waited for every writer; on the transactions' connection
        it waited for whichever of them held it. It waits for the read connection as long
        as ``busy_timeout`` at most (other threads' reads hold it, one at a time); an
        in-memory database's reads share the one connection and its lock."""
        if not self._read_lock.acquire(timeout=self.busy_timeout_ms / 1000):
            raise LockWaitOver()
        try:
            return _SqliteConnection(self._read_cx, self.queries, self._writes).fetch(name, params)
        finally:
            self._read_lock.release()

    def is_retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)

    def is_unavailable(self, exc: BaseException) -> bool:
        """``OperationalError``: the file cannot be opened or read, the disk is full,
        the database stayed locked; a ``ProgrammingError`` on a closed connection; a
        transaction the store gave up on for one of those (``DatabaseUnavailable``)."""
        if isinstance(exc, sqlite3.ProgrammingError):
            return "closed" in str(exc)
        return isinstance(exc, sqlite3.OperationalError | DatabaseUnavailable)

    def unavailable_code(self, exc: BaseException) -> str | None:
        """By SQLite's result code (``_UNAVAILABLE_CODES``): busy or locked, full,
        read-only, an I/O error or a file it cannot open; a closed connection is
        unavailable. Any other error (no such table: a bug) is none of them."""
        if isinstance(exc, LockWaitOver):
            return DATABASE_BUSY
        if isinstance(exc, sqlite3.ProgrammingError):
            return DATABASE_UNAVAILABLE if "closed" in str(exc) else None
        if not isinstance(exc, sqlite3.Error):
            return None
        code = getattr(exc, "sqlite_errorcode", None)
        return _UNAVAILABLE_CODES.get(code & 0xFF) if isinstance(code, int) else None

    def connect_refusal(self) -> tuple[str, str] | None:
        """None: a file is opened, not connected to; no server refuses it."""
        return None

    def disk_space(self) -> tuple[int, int] | None:
        """``(free, size)`` in bytes of the file system that holds the database and its
        ``-wal`` (the directory of the file, its symlinks resolved, as SQLite resolves
        them), free as an unprivileged process sees it (``f_bavail``). None for an
        in-memory database. An upload checks it (``Store.artifact_disk_room``): a full
        disk refused every later write, the delete of the upload that filled it too."""
        if self.path == ":memory:":
            return None
        found = os.statvfs(os.path.dirname(os.path.realpath(self.path)))
        return found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize

    def close(self) -> None:
        """The read connection first: the last to close checkpoints the WAL into the
        file and removes it, and that is the transactions' connection, which writes."""
        if self._read_cx is not self._cx:
            with self._read_lock:
                self._read_cx.close()
        with self._lock:
            self._cx.close()

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"SqliteDriver({self.path!r})"

    def _raw(self) -> Any:
        return self._cx
