"""``orbit``: run a server node, show and migrate the schema, create, list and revoke tokens.

The database comes from ``--db`` or ``ORBIT_DB``: ``sqlite:///path/orbit.db`` or
``postgresql://user@host:5432/db``. Its password, if any, is never printed (and belongs in
``ORBIT_DB`` or ``~/.pgpass``, not on a command line that ``ps`` shows to everyone).
"""

from __future__ import annotations

import inspect
import os
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar
from urllib.parse import unquote

import typer

from orbit.cli.api import DEFAULT_URL, CaFile, Url, option_source
from orbit.cli.listening import KEEP_ALIVE, announcement, bind, quiet_abandoned, url_of
from orbit.core.errors import OrbitError
from orbit.core.model import SECOND
from orbit.core.validate import is_name
from orbit.tokens import CACHE_SECONDS

if TYPE_CHECKING:
    from rich.table import Table

    from orbit.store import Store

T = TypeVar("T")
#: The most any of `orbit server`'s durations may be, seconds (a day): infinity, taken
#: as a number, was an OverflowError traceback (a TTL is whole microseconds), and a TTL
#: past the database's 64-bit microseconds failed at the first claim, after a start that
#: looked well. A day also keeps --session-ttl within TCP_USER_TIMEOUT's milliseconds.
DAY = 86400.0

#: `orbit server --header-timeout`'s default and `orbit dev`'s deadline, seconds: a
#: connection that has not delivered a complete request head by then is closed (see
#: orbit.server.request_heads: a peer that sent none held a descriptor for ever). A head
#: is a few hundred bytes, one round trip's worth: a client on a lossy link, its segments
#: resent several times, still sends one in a few seconds, and Apache's default
#: (``RequestReadTimeout header=20``) leaves it as long. Shorter frees a held descriptor
#: sooner; it bounds what each silent peer costs, not how many there are (a limit per
#: address belongs in a proxy or firewall in front).
HEADER_TIMEOUT = 20.0

app = typer.Typer(
    help="Orbit: durable job execution. Examples:\n\n"
    "  orbit db migrate --db sqlite:///.orbit/orbit.db\n\n"
    "  orbit token create --db sqlite:///.orbit/orbit.db --name ops --scope admin\n\n"
    "  orbit server --db postgresql://orbit@127.0.0.1/orbit --port 8000",
    no_args_is_help=True,
    add_completion=False,
    # -h as well as --help, for every command (each inherits it)
    context_settings={"help_option_names": ["-h", "--help"]},
)
db_app = typer.Typer(
    help="Database schema: status shows its version and what is due, migrate applies it.",
    no_args_is_help=True,
)
token_app = typer.Typer(
    help="API tokens: create, list, revoke. They open the database (--db or ORBIT_DB) "
    "directly, not a server, and migrate nothing: its schema must be at this Orbit's "
    "version (orbit db status shows it, orbit db migrate upgrades it).",
    no_args_is_help=True,
)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


def _add_api_groups() -> None:
    from orbit.cli.api import event_app, limit_app, queue_app, schedule_app, task_app
    from orbit.cli.dev import dev

    app.command("dev")(dev)
    app.add_typer(queue_app, name="queue")
    app.add_typer(task_app, name="task")
    app.add_typer(limit_app, name="limit")
    app.add_typer(event_app, name="event")
    app.add_typer(schedule_app, name="schedule")


_add_api_groups()

DbUrl = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="ORBIT_DB",
        help="sqlite:///file.db or postgresql://…; sqlite:/// with three slashes is "
        "relative to the working directory, sqlite://// with four is absolute "
        "(sqlite:////var/lib/orbit/orbit.db), and missing directories are made; a "
        "password belongs in ORBIT_DB or ~/.pgpass, not here, where ps shows it",
        show_default=False,
    ),
]


#: ``--db`` of the token commands, which open an existing Orbit database and make nothing
TokenDbUrl = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="ORBIT_DB",
        help="the Orbit database: sqlite:///file.db (three slashes: relative to the working "
        "directory; four: absolute) or postgresql://…; it must exist and hold Orbit's "
        "schema (orbit db migrate makes one), nothing is made here; a password belongs in "
        "ORBIT_DB or ~/.pgpass, not here, where ps shows it",
        show_default=False,
    ),
]


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _check_url(url: str) -> None:
    if not url.startswith(("sqlite://", "postgresql://", "postgres://")):
        _fail("--db must start with sqlite:// or postgresql://")
    if _unencoded_in_password(url):
        # libpq ends the user part at the first ``@`` (or ``/``): ``user:p@ss@host`` is
        # password ``p`` on host ``ss@host``, which it looks up in DNS and names in its
        # error, with the rest of the password. Refused before the driver sees it, and
        # without echoing it.
        _fail("the password in --db holds an unencoded @ or /: percent-encode it (%40, %2F)")
    from orbit.store import sqlite_path

    try:
        path = sqlite_path(url)
    except ValueError as exc:  # a query, a host, a directory's trailing /: nothing made
        _fail(f"--db: {exc}")
    if path is not None and path.lstrip("/") in ("", ":memory:"):
        # The store opens these in memory: a schema, a token or a server's state that is
        # gone when the command ends (`token create` printed a token nothing accepts).
        _fail("--db names no file: give sqlite:///path/orbit.db (or sqlite:////abs/path)")


def _unencoded_in_password(url: str) -> bool:
    """Whether a PostgreSQL URL's password (from the first ``:`` of its user part to the
    last ``@`` before its query) holds an ``@`` or a ``/`` that is not percent-encoded."""
    if url.startswith("sqlite://"):
        return False
    rest = url.partition("://")[2].partition("?")[0]
    userinfo = rest.rpartition("@")[0]
    password = userinfo.partition(":")[2]
    return "@" in password or "/" in password


def _passwords(url: str) -> list[str]:
    """Every spelling of the password a database URL holds, longest first: in its user
    part and in a ``password=`` query parameter, as written and percent-decoded.

    Taken apart by hand, as libpq reads it (the user part ends at the first ``@`` before
    any ``/``), because ``urlsplit`` raises on exactly the malformed URLs that psycopg
    quotes whole in its error ("... in URI: \"postgresql://orbit:pw@[::1\""), and it
    never looks in the query, where libpq takes a password too."""
    rest = url.partition("://")[2]
    authority = rest.split("/", 1)[0]
    found: set[str] = set()
    if "@" in authority:
        for userinfo in (authority.split("@", 1)[0], authority.rsplit("@", 1)[0]):
            if ":" in userinfo:
                found.add(userinfo.partition(":")[2])
    for param in rest.partition("?")[2].split("&"):
        key, _, value = param.partition("=")
        if unquote(key).strip().lower() == "password":
            found.add(value)
    found |= {unquote(p) for p in found}
    return sorted((p for p in found if p), key=len, reverse=True)


@contextmanager
def database(db: str) -> Iterator[None]:
    """A database that cannot be opened or migrated (unreachable, refused, not a
    database, a URL it cannot parse) is one line and exit 1, not a traceback; the URL's
    password, in whatever spelling the driver's message holds it, is blotted out."""
    from orbit.store import MigrationFailed

    _check_url(db)
    try:
        yield
    except MigrationFailed as exc:  # opened: a migration failed, and the message says which
        _fail(_blotted(str(exc), db), 1)
    except Exception as exc:  # the drivers' errors: sqlite3, psycopg, psycopg_pool, OS
        reason = f"{type(exc).__name__}: {exc}".strip()
        _fail(f"cannot open the database: {_blotted(reason, db)}", 1)


def _blotted(text: str, db: str) -> str:
    """``text`` with the password of ``db``, in any spelling, and any token blotted out."""
    from orbit.logs import redact

    for password in _passwords(db):
        text = text.replace(password, "***")
    return redact(text)


@db_app.command("migrate")
def db_migrate(db: DbUrl) -> None:
    """Create or upgrade the schema (safe to run on every node at once).

    Prints the version reached and the migration files applied, or "up to date". The
    migrations due are applied in one transaction: one that fails is named, with the
    version the schema stays at, and none of them is applied (exit 1). Stop the nodes of
    an older Orbit first when a migration due says so (docs/operations.md, "Schema";
    orbit db status lists the migrations due).

    Example: orbit db migrate --db sqlite:///.orbit/orbit.db
    """
    from orbit.store import open_store

    with database(db):
        store = open_store(db, migrate=False)
        try:
            done = store.schema_migrate()
        finally:
            store.close()
    typer.echo(done.describe())


@db_app.command("status")
def db_status(db: TokenDbUrl) -> None:
    """Show the schema's version in the database, this Orbit's, and the migration files
    orbit db migrate would apply (or "up to date"). Reads only: changes nothing, takes no
    lock. Exit 0; 2 for a database that is not Orbit's (a SQLite --db that names no file
    included); 1 for one that cannot be opened or that a newer Orbit migrated.

    Example: orbit db status --db sqlite:///.orbit/orbit.db
    """
    status = _on_existing_store(
        db, lambda store: store.schema_status(), "read the schema version", current=False
    )
    typer.echo(f"schema in the database: version {status.version}")
    typer.echo(f"this Orbit's schema: version {status.known}")
    if not status.pending:
        typer.echo("up to date")
        return
    typer.echo(f"pending migrations ({len(status.pending)}; orbit db migrate applies them):")
    for name in status.pending:
        typer.echo(f"  {name}")


@token_app.command("create")
def token_create(
    db: TokenDbUrl,
    name: Annotated[str, typer.Option(help="a label for the token, e.g. the service using it")],
    scope: Annotated[list[str], typer.Option(help="admin, submit or worker (repeatable)")],
) -> None:
    """Create a token and print it once; only its hash is stored. A SQLite --db that
    names no file is refused, not created (orbit db migrate creates one)."""
    token_id, token = _on_existing_store(
        db, lambda store: store.token_create(name, scope), "create the token"
    )
    typer.echo(token)
    typer.secho(
        f"token {token_id} ({', '.join(sorted(set(scope)))}): store it now, it is not shown again",
        err=True,
    )


def _on_existing_store(
    db: str, call: Callable[[Store], T], doing: str, *, current: bool = True
) -> T:
    """Open the database, run ``call`` on its store and close it. A SQLite file that does
    not exist is refused, not created: on a mistyped path ``token ls`` would list the
    tokens of an empty database it had just made, and ``token revoke`` refuse every id
    while leaving that file behind. A database without Orbit's schema (an empty file,
    another application's PostgreSQL database) is refused too, exit 2, changing nothing:
    it was migrated, given Orbit's tables, just to list no tokens. Orbit's own database
    at an older version is refused as well (``current``; ``db status`` takes any), exit
    2, naming both versions: it was migrated, under the older nodes that may still
    serve it, which a migration can break (docs/operations.md, "Schema"); ``orbit db
    migrate`` is the command that migrates. A database that cannot be opened (or that a
    newer Orbit migrated) is ``database``'s one line, exit 1. Once it is open, a failure
    of ``call`` says what failed (``could not <doing>: database is locked``), exit 1: it
    was "cannot open the database" too; a refusal from the store is its message, exit 2."""
    from orbit.store import open_store, sqlite_path

    _check_url(db)
    path = sqlite_path(db)
    if path is not None and not Path(path).is_file():
        _fail(f"no database at {path}: check --db (orbit db migrate creates one)")
    not_orbit = (
        f"{path or 'the database --db names'} is not an Orbit database (it has no "
        "orbit_schema_version table) and was left as it was: check --db (orbit db "
        "migrate makes a new one)"
    )
    refused: str | None = None
    store: Store | None = None
    with database(db):
        if path is not None:
            from orbit.store.sqlite.driver import ForeignDatabase, check_path, holds_orbit

            try:
                check_path(path)  # the driver's refusals first, in its words (read-only, …)
            except ForeignDatabase as exc:  # another application's: a refusal, as below
                refused = str(exc)
            else:
                if not holds_orbit(path):  # read before the driver opens it in WAL mode
                    refused = not_orbit
        if refused is None:
            store = open_store(db, migrate=False)
            try:
                status = store.schema_status()  # SchemaTooNew: database's line, exit 1
            except BaseException:
                store.close()
                raise
            if not status.version:
                refused = not_orbit
            elif current and status.pending:
                refused = (
                    f"the database's schema is at version {status.version}, this Orbit "
                    f"needs {status.known}: run `orbit db migrate` (after stopping the "
                    "nodes of an older Orbit, if a migration due says so: "
                    "docs/operations.md, Schema); nothing was changed"
                )
    if refused is not None:
        if store is not None:
            store.close()
        _fail(refused)
    assert store is not None  # database() ends every other way out with an exit
    try:
        return call(store)
    except OrbitError as exc:
        if exc.status < 500:  # a refusal: a token id that is unknown, a bad scope
            _fail(exc.message)
        _fail(f"could not {doing}: {_blotted(exc.message, db)}", 1)
    except Exception as exc:  # the driver's: a write lock held too long, a read-only database
        from orbit.store.driver import error_line

        _fail(f"could not {doing}: {_blotted(error_line(exc), db)}", 1)
    finally:
        store.close()


def _tokens_table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Column, Table

    def when(instant: str | None) -> str:  # a space, where a narrow column may wrap
        return "" if instant is None else instant[:19].replace("T", " ")

    # The id is what `token revoke` takes: a narrow terminal wraps the other columns
    # first, rather than cut the id short with an ellipsis.
    table = Table(Column("id", no_wrap=True), "name", "scopes", "created", "revoked")
    for t in rows:
        table.add_row(
            t["id"], t["name"], ", ".join(t["scopes"]), when(t["created_at"]), when(t["revoked_at"])
        )
    return table


@token_app.command("ls")
def token_ls(
    db: TokenDbUrl,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """List every token, revoked ones too: id, name, scopes, created, revoked.

    Oldest first. A token's secret is never shown: only its hash is stored.

    Example: orbit token ls --db sqlite:///.orbit/orbit.db
    """
    from orbit.cli.api import emit
    from orbit.protocol.convert import token_wire

    tokens = _on_existing_store(db, lambda store: store.token_list(), "list the tokens")
    emit([token_wire(t) for t in tokens], as_json, _tokens_table)


@token_app.command("revoke")
def token_revoke(
    db: TokenDbUrl,
    token_id: Annotated[
        str,
        typer.Argument(
            metavar="TOKEN_ID",
            help="the id `orbit token ls` shows: in a token orbit_<id>_<secret>, the <id>",
            show_default=False,
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Revoke a token: from now on it is refused. Revoking it again changes nothing.

    A running server refuses it at once for admin calls, and still takes it for up to 10
    seconds for others (each node caches token checks; orbit server --token-cache sets
    how long), and each worker connection already
    open with it is closed within that time (close code 4401; at once on PostgreSQL): the
    worker exits 3, unless its ORBIT_TOKEN_FILE holds a new token within 10 seconds,
    which it reconnects with. The tasks it had claimed and not started go to other workers at
    once, those it was running as their run leases run out.

    Example: orbit token revoke --db sqlite:///.orbit/orbit.db 019ae4c3d2b97f0e8a1c4b5d6e7f8091
    """
    from orbit.cli.api import emit
    from orbit.protocol.convert import token_wire

    token = _on_existing_store(db, lambda store: store.token_revoke(token_id), "revoke the token")
    emit(token_wire(token), as_json, lambda t: _tokens_table([t]))
    if not as_json:
        typer.secho(
            f"token {token.id} is revoked: servers refuse it, and close the worker "
            f"connections open with it, within their --token-cache ({CACHE_SECONDS:g} s by "
            "default)",
            err=True,
        )


def _check_tls(cert: Path, key: Path) -> None:
    """Load the certificate and key now, as uvicorn will: one that is no PEM, or a key
    that does not match, was an SSLError traceback from uvicorn's start-up, after the
    database had been opened and migrated. An encrypted key is refused too (uvicorn is
    given no passphrase), rather than prompted for on the terminal."""
    import ssl

    def no_passphrase() -> str:
        raise ValueError("the key is encrypted; give an unencrypted one")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, no_passphrase)
    except (ssl.SSLError, OSError, ValueError) as exc:
        _fail(f"cannot load --tls-cert and --tls-key: {exc}")


@app.command()
def server(
    db: DbUrl,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port (0 picks a free one)")] = 8000,
    node_id: Annotated[str | None, typer.Option(help="this node's name in the cluster")] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="PEM certificate: serve https/wss"),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="PEM private key for --tls-cert"),
    ] = None,
    poll_interval: Annotated[
        float, typer.Option(min=0.05, max=DAY, help="dispatch fallback, seconds")
    ] = 5.0,
    reap_interval: Annotated[
        float,
        typer.Option(
            min=0.05,
            max=DAY,
            help="longest pause between reaper passes, seconds (it also wakes when a "
            "claim, lease, deadline or session falls due)",
        ),
    ] = 1.0,
    schedule_interval: Annotated[
        float,
        typer.Option(
            min=0.05,
            max=30.0,
            help="how often this node fires the schedules due, seconds, 0.05-30 (every "
            "node does; each instant fires once across the cluster; an instant seen more "
            "than a minute late is a misfire)",
        ),
    ] = 1.0,
    claim_ttl: Annotated[float, typer.Option(min=0.1, max=DAY, help="claim lease, seconds")] = 30.0,
    lease_ttl: Annotated[float, typer.Option(min=0.1, max=DAY, help="run lease, seconds")] = 30.0,
    session_ttl: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=DAY,
            help="session heartbeat TTL, seconds; a worker connection with no hello "
            "welcomed, or whose session lapsed, is closed after it, and a connection whose "
            "peer takes none of the server's bytes for this long is dropped",
        ),
    ] = 60.0,
    max_artifact_bytes: Annotated[
        int, typer.Option(min=1, help="largest artifact a worker may upload")
    ] = 256 * 1024 * 1024,
    artifact_disk_reserve: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="bytes an artifact upload must leave free on a SQLite database's disk "
            "for the node's other writes (default 64 MiB, or 5% of a small disk; 0 keeps "
            "none); not checked on PostgreSQL",
        ),
    ] = None,
    token_cache: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=3600.0,
            help="how long this node trusts a token check, seconds: a revoked token is "
            "still taken for up to this long; 0 reads the database on every call",
        ),
    ] = CACHE_SECONDS,
    max_streams: Annotated[
        int,
        typer.Option(
            min=1,
            help="event streams (SSE and WebSocket together) this node serves at once; more "
            "are refused with 503",
        ),
    ] = 100,
    stream_poll: Annotated[
        float,
        typer.Option(
            min=0.05,
            max=DAY,
            help="the longest an open event stream goes without reading the log, s: "
            "commits wake streams at once, and this poll finds what a lost wake missed",
        ),
    ] = 2.0,
    stream_keepalive: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=DAY,
            help="an idle event stream's keep-alive comment every this many seconds",
        ),
    ] = 15.0,
    stream_send_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=DAY,
            help="an event stream whose client has not taken a message within this many "
            "seconds is closed and its slot freed (a client that stopped reading)",
        ),
    ] = 30.0,
    header_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=DAY,
            help="a connection that has not sent a complete request head (request line and "
            "headers) within this many seconds is closed",
        ),
    ] = HEADER_TIMEOUT,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Run one control-plane node (any number may share one PostgreSQL)."""
    import uvicorn

    from orbit.gctune import tune_for_throughput
    from orbit.server import ServerSettings, create_app
    from orbit.server.denials import UVICORN_WS
    from orbit.server.request_heads import head_deadline
    from orbit.store import StoreConfig, open_store, sqlite_path

    _check_url(db)
    if (tls_cert is None) != (tls_key is None):
        _fail("--tls-cert and --tls-key go together")
    if node_id is not None and not is_name(node_id):
        # The store records it on every session: a node it cannot take refused every
        # worker's hello with INVALID_ARGUMENT, after starting as if all were well.
        _fail(
            "--node-id must be 1-128 characters of letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    if tls_cert is not None and tls_key is not None:
        _check_tls(tls_cert, tls_key)
    if log_level not in ("debug", "info", "warning", "error"):
        _fail("--log-level must be debug, info, warning or error")
    from orbit.logs import configure

    configure(log_level)
    settings = ServerSettings(
        db_url=db,
        poll_interval=poll_interval,
        reap_interval=reap_interval,
        schedule_interval=schedule_interval,
        token_cache_s=token_cache,
        max_streams=max_streams,
        stream_poll_s=stream_poll,
        stream_keepalive_s=stream_keepalive,
        stream_send_timeout_s=stream_send_timeout,
        store_config=StoreConfig(
            claim_ttl_us=int(claim_ttl * SECOND),
            lease_ttl_us=int(lease_ttl * SECOND),
            session_ttl_us=int(session_ttl * SECOND),
            max_artifact_bytes=max_artifact_bytes,
            artifact_disk_reserve_bytes=artifact_disk_reserve,
        ),
    )
    if node_id:
        settings.node_id = node_id
    # Bound here, so the line below can name a port 0 picked. A worker that has read
    # nothing for a session TTL has lost its session anyway: its connection goes too.
    sock = bind(host, port, unread_timeout=session_ttl)
    url = url_of(sock, host, "https" if tls_cert else "http")
    held: int | None = None  # SQLite: the lock that keeps a second server off the file
    try:
        with database(db):  # opened here, so a database that cannot be is one clear line
            path = sqlite_path(db)
            if path is not None:
                from orbit.store.sqlite import hold_for_server

                # Before open_store: a second server is refused before it migrates the
                # file under the first (an upgraded one started beside an older one).
                # open_store would make the file's directory; the lock file goes in it.
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                held = hold_for_server(path)
            store = open_store(db, settings.store_config)
            if path is not None:
                _warn_if_open_to_others(path)
    except BaseException:
        # The command ends here (one line, exit 1): the bound socket stayed open while
        # the error lived, and was collected with a ResourceWarning.
        if held is not None:
            os.close(held)
        sock.close()
        raise
    api = create_app(settings, store=store)
    from orbit.cli.openfiles import raise_open_files_limit

    raise_open_files_limit()  # at its limit a node resets new connections, silently
    config = uvicorn.Config(
        api,
        log_level=log_level,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        access_log=False,  # request lines are not needed and must never carry tokens
        log_config=None,  # keep our handler: it redacts secrets from every record
        timeout_keep_alive=KEEP_ALIVE,  # an idle connection's close never meets a request
        **UVICORN_WS,  # a refused upgrade is no ERROR line, no deflate (orbit.server.denials)
        http=head_deadline(header_timeout),  # a peer that sends no request is closed
    )

    class Announced(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # whatever the log level: where to reach this node
                print(announcement(url), file=sys.stderr, flush=True)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # Open event streams end first: uvicorn waits for every response to finish
            # before it stops, and a stream would never finish of itself.
            api.state.streams.close()
            await super().shutdown(sockets)
            if self.force_exit:  # a second Ctrl-C: the store is closed below all the same
                quiet_abandoned()

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn raises the signal that stopped it once more after its shutdown, for
            # a program that embeds it. Here that made a clean stop on SIGTERM a death by
            # the signal (143), before the store below was closed: SQLite's -wal left
            # behind, every PostgreSQL connection cut off. The node has stopped as asked:
            # the command closes the store and exits 0, as on Ctrl-C.
            with super().capture_signals():
                try:
                    yield
                finally:
                    # uvicorn's own list (0.29 and later): were it renamed, the signal would
                    # be raised again as before, which the SIGTERM test catches
                    captured = getattr(self, "_captured_signals", None)
                    if isinstance(captured, list):
                        captured.clear()

    server = Announced(config)
    tune_for_throughput()  # after the imports and the app: see orbit.gctune
    try:
        server.run(sockets=[sock])
    finally:
        store.close()
        if held is not None:
            os.close(held)
    if not server.started:
        raise typer.Exit(3)  # uvicorn's code for a failed start-up; it said why


def _warn_if_open_to_others(path: str) -> None:
    """A SQLite file other users may read holds what they should not: task payloads and
    results, and the hashes of tokens and resume secrets. Orbit makes a new file 0600,
    but one an older Orbit made (0644 under the usual umask) kept its mode, and nothing
    said so. It is said once at start; the mode is the operator's to change."""
    import logging

    from orbit.store.sqlite.driver import open_to_others

    mode = open_to_others(path)
    if mode is not None:
        logging.getLogger("orbit.server").warning(
            "the database file %s is open to other users of this machine (mode %03o): it "
            "holds task payloads and results; chmod o-rwx it (its -wal and -shm take the "
            "file's mode when they are made again)",
            path,
            mode,
        )


@app.command("worker")
def worker_command(
    args: Annotated[
        list[str], typer.Argument(help="ls | drain SESSION_ID | MODULE:OBJ", show_default=False)
    ],
    ctx: typer.Context,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON (ls, drain)")] = False,
    state: Annotated[
        str | None,
        typer.Option(
            help="(ls) the sessions to list: live (the default), expired or all",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a worker, or list and drain workers.

    \b
      orbit worker myapp.jobs:worker   run the orbit.Worker in myapp/jobs.py
      orbit worker ls [--state all]    list the live worker sessions (or all)
      orbit worker drain SESSION_ID    stop new claims for a session (durable)

    The token comes from ORBIT_TOKEN or ORBIT_TOKEN_FILE. --url (or ORBIT_URL) and
    --cafile (or ORBIT_CAFILE), when given, replace those the module's Worker names,
    whatever their value; a variable set but empty is refused. A running worker drains on
    SIGTERM or SIGINT: no new claims, running handlers finish within the grace period,
    then are cancelled; a second Ctrl-C (SIGINT) cancels them at once. Exit codes of a
    running worker: 0 drained, a handler the drain stopped part way included (one not
    retry_safe reports nothing, and its lease decides); 1 a handler ignored its
    cancellation, or an outcome the server never confirmed (a report the worker sent,
    unanswered when it stopped: its lease decides); 2 bad arguments, no token, an
    unusable URL or CA file, a server certificate not trusted, or no handler registered;
    3 the server refused the token or the worker's hello. Of ls and drain: 0 done; 2 bad
    arguments; 3 refused by the server; 4 server unreachable; 6 the server's database
    cannot take the call now (503: busy, full, read-only or away); try again later, in
    the time the error line gives.
    """
    from orbit.cli import api

    if args == ["ls"]:
        api.worker_ls(url, cafile, as_json, state)
        return
    if state is not None:
        _fail("--state applies to `ls` only")
    if len(args) == 2 and args[0] == "drain":
        api.worker_drain(args[1], url, cafile, as_json)
        return
    if len(args) != 1 or ":" not in args[0]:
        _fail("give `ls`, `drain SESSION_ID` or MODULE:OBJ (e.g. myapp.jobs:worker)")
    module_name, _, attr = args[0].partition(":")
    if not module_name or module_name.startswith(".") or not attr:
        # importlib's ValueError or TypeError for these was a traceback and exit 1
        _fail(
            f"{args[0]!r} is no MODULE:OBJ: give a module's full dotted name and the "
            "object in it (e.g. myapp.jobs:worker)"
        )
    if as_json:
        _fail("--json applies to `ls` and `drain`; a running worker logs lines")
    _run_worker(args[0], url if _given(ctx, "url") else None, cafile)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given, on the command line or in its environment
    variable, whatever its value: ``--url`` was taken as given only when it differed from
    the default, so ``--url http://127.0.0.1:8000`` left the module's own URL in place."""
    return option_source(ctx, name) in ("COMMANDLINE", "ENVIRONMENT")


def _run_worker(target: str, url: str | None, cafile: str | None) -> None:
    """Load and run the worker; ``url`` and ``cafile``, when given (not None), replace
    the module's. What makes it useless from the start (no token, a token the server
    refuses, a URL it cannot use) is one line and exit 2 or 3, as for the other commands:
    the runner raised it as a traceback, or retried a URL it could never use for ever."""
    import importlib
    import logging

    from websockets.exceptions import InvalidStatus

    from orbit.cli.api import raised_in
    from orbit.logs import configure
    from orbit.tokens import TokenError
    from orbit.urls import check_cafile, check_server_url
    from orbit.worker import runner
    from orbit.worker.connection import ServerError
    from orbit.worker.runner import RunDuringImport, Worker

    if url is not None:  # before the module's import, whose Worker(...) may read ORBIT_URL
        try:
            check_server_url(url)
        except ValueError as exc:
            _fail(str(exc))
    module_name, _, attr = target.partition(":")
    sys.path.insert(0, ".")
    runner._cli_importing = module_name  # a run() during the import is refused
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except RunDuringImport as exc:
        _fail(str(exc))
    except (ImportError, AttributeError) as exc:
        _fail(f"cannot load {target}: {exc}")
    except (ValueError, TypeError) as exc:
        # What Worker(...) refuses as it is built (a bad name, concurrency, timing;
        # prefetch=1.5) was a traceback: one line now. The module's own bug (len(5) in a
        # helper) keeps its traceback, which names its file and line.
        if not raised_in(exc, "orbit"):  # a refusal of ours, not the module's bug
            raise
        _fail(f"cannot load {target}: {exc}")
    finally:
        runner._cli_importing = None
    if not isinstance(obj, Worker):
        _fail(f"{target} is a {type(obj).__name__}, not an orbit Worker")
    if not obj.handlers:  # run() refuses it with ValueError, which was a traceback
        _fail(f"{target} has no handler: register one with @worker.handler(NAME)")
    if url is not None:
        obj.url = url.rstrip("/")
    if cafile is not None:  # --cafile or ORBIT_CAFILE: it was accepted, then ignored
        obj.cafile = cafile
    try:
        check_server_url(obj.url)
        check_cafile(obj.cafile)
    except ValueError as exc:
        _fail(str(exc))
    configure("info")
    # Which server, and from where: an option that did not take effect was found only
    # by a worker that never showed up (the URL holds no credentials: checked above).
    logging.getLogger("orbit.worker").info(
        "worker %s: server %s (%s)",
        obj.name,
        obj.url,
        "the module's" if url is None else "--url or ORBIT_URL",
    )
    try:
        code = obj.run()
    except TokenError as exc:
        _fail(str(exc))
    except InvalidStatus as exc:  # the runner ends only on 401 or 403, and only at first
        _fail(
            f"the server refused the token (HTTP {exc.response.status_code}): it is unknown "
            "or revoked, or lacks the worker scope",
            3,
        )
    except ServerError as exc:  # the server refused the hello itself
        _fail(f"the server refused this worker: {exc.code}: {exc.message}", 3)
    except ssl.SSLCertVerificationError as exc:  # at the first connection: set up wrong
        _fail(f"the server's certificate is not trusted: {exc.verify_message or exc}", 2)
    raise typer.Exit(code)


def reflowed(help_text: str) -> str:
    """``help_text`` as the help should print it: each paragraph's lines joined into one
    for the terminal to wrap, a paragraph that opens with a ``\\b`` line kept line by line
    (examples in columns). Typer's rich help (0.16 on) keeps a docstring's hard line
    breaks and then wraps each line again, so at 80 columns a paragraph came out ragged,
    a line of one or two words after each break. The ``\\b`` line is click's marker,
    kept where click renders the help (rich off). Rich printed it as a blank line, so
    there it moves to the start of the next line: rich drops the character, and it keeps
    that line's indentation, which typer's ``cleandoc`` strips from the text's first."""
    paragraphs = []
    for paragraph in inspect.cleandoc(help_text).split("\n\n"):
        lines = paragraph.split("\n")
        if lines[0].strip() == "\b":
            if typer.core.HAS_RICH and len(lines) > 1:
                lines = ["\b" + lines[1], *lines[2:]]
            paragraphs.append("\n".join(lines))
        else:
            paragraphs.append(" ".join([lines[0].rstrip(), *(ln.strip() for ln in lines[1:])]))
    return "\n\n".join(paragraphs)


def _reflow_helps(group: typer.Typer) -> None:
    """Reflow (``reflowed``) the help of every command and group under ``group``, once,
    when this module is imported: the help a command gives is its docstring unless it
    was given one, and ``orbit --help`` alike reads it from what is set here."""
    for command in group.registered_commands:
        text = command.help if command.help is not None else inspect.getdoc(command.callback)
        if text:
            command.help = reflowed(text)
    for sub in group.registered_groups:
        instance = sub.typer_instance
        if instance is not None:
            if isinstance(instance.info.help, str):
                instance.info.help = reflowed(instance.info.help)
            _reflow_helps(instance)


_reflow_helps(app)


def main() -> None:
    app()
