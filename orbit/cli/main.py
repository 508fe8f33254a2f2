"""``orbit``: run a server node, migrate the database, create tokens.

The database comes from ``--db`` or ``ORBIT_DB``: ``sqlite:///path/orbit.db`` or
``postgresql://user@host:5432/db``. Its password, if any, is never printed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from orbit.core.errors import OrbitError
from orbit.core.model import SECOND

app = typer.Typer(
    help="Orbit: durable job execution. Examples:\n\n"
    "  orbit db migrate --db sqlite:///.orbit/orbit.db\n\n"
    "  orbit token create --db sqlite:///.orbit/orbit.db --name ops --scope admin\n\n"
    "  orbit server --db postgresql://orbit@127.0.0.1/orbit --port 8000",
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")

DbUrl = Annotated[
    str,
    typer.Option(
        "--db", envvar="ORBIT_DB", help="sqlite:///file.db or postgresql://…", show_default=False
    ),
]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _check_url(url: str) -> None:
    if not url.startswith(("sqlite://", "postgresql://", "postgres://")):
        _fail("--db must start with sqlite:// or postgresql://")


@db_app.command("migrate")
def db_migrate(db: DbUrl) -> None:
    """Create or upgrade the schema (safe to run on every node at once)."""
    from orbit.store import open_store

    _check_url(db)
    store = open_store(db, migrate=False)
    version = store.migrate()
    store.close()
    typer.echo(f"schema at version {version}")


@token_app.command("create")
def token_create(
    db: DbUrl,
    name: Annotated[str, typer.Option(help="a label for the token, e.g. the service using it")],
    scope: Annotated[list[str], typer.Option(help="admin, submit or worker (repeatable)")],
) -> None:
    """Create a token and print it once; only its hash is stored."""
    from orbit.store import open_store

    _check_url(db)
    store = open_store(db)
    try:
        token_id, token = store.token_create(name, scope)
    except OrbitError as exc:
        _fail(exc.message)
    finally:
        store.close()
    typer.echo(token)
    typer.secho(
        f"token {token_id} ({', '.join(sorted(set(scope)))}): store it now, it is not shown again",
        err=True,
    )


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
        float, typer.Option(min=0.05, help="dispatch fallback, seconds")
    ] = 5.0,
    reap_interval: Annotated[float, typer.Option(min=0.05, help="reaper period, seconds")] = 1.0,
    claim_ttl: Annotated[float, typer.Option(min=0.1, help="claim lease, seconds")] = 30.0,
    lease_ttl: Annotated[float, typer.Option(min=0.1, help="run lease, seconds")] = 30.0,
    session_ttl: Annotated[
        float, typer.Option(min=0.1, help="session heartbeat TTL, seconds")
    ] = 60.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Run one control-plane node (any number may share one PostgreSQL)."""
    import uvicorn

    from orbit.server import ServerSettings, create_app
    from orbit.store import StoreConfig

    _check_url(db)
    if (tls_cert is None) != (tls_key is None):
        _fail("--tls-cert and --tls-key go together")
    if log_level not in ("debug", "info", "warning", "error"):
        _fail("--log-level must be debug, info, warning or error")
    from orbit.server.logs import configure

    configure(log_level)
    settings = ServerSettings(
        db_url=db,
        poll_interval=poll_interval,
        reap_interval=reap_interval,
        store_config=StoreConfig(
            claim_ttl_us=int(claim_ttl * SECOND),
            lease_ttl_us=int(lease_ttl * SECOND),
            session_ttl_us=int(session_ttl * SECOND),
        ),
    )
    if node_id:
        settings.node_id = node_id
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        access_log=False,  # request lines are not needed and must never carry tokens
        log_config=None,  # keep our handler: it redacts secrets from every record
    )


def main() -> None:
    app()


@app.command("worker")
def worker_command(
    target: Annotated[str, typer.Argument(help="MODULE:OBJ, an orbit.Worker to run")],
    url: Annotated[
        str | None, typer.Option(envvar="ORBIT_URL", help="server URL (overrides the Worker's)")
    ] = None,
) -> None:
    """Run a worker defined in your code, e.g. ``orbit worker myapp.jobs:worker``.

    The token comes from ORBIT_TOKEN or ORBIT_TOKEN_FILE. SIGTERM or SIGINT drains: no new
    claims, running handlers finish within the grace period, then are cancelled.
    """
    import importlib

    from orbit.server.logs import configure
    from orbit.worker.runner import Worker

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        _fail("give the worker as MODULE:OBJ, e.g. myapp.jobs:worker")
    sys.path.insert(0, ".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        _fail(f"cannot load {target}: {exc}")
    if not isinstance(obj, Worker):
        _fail(f"{target} is a {type(obj).__name__}, not an orbit Worker")
    if url:
        obj.url = url.rstrip("/")
    configure("info")
    raise typer.Exit(obj.run())
