"""``orbit dev``: everything on one machine, from nothing to tasks flowing.

It opens SQLite under ``.orbit/``, starts a server and a demo worker in this process,
runs four demo tasks that show the rules at work (one succeeds, one fails and is retried,
one is cancelled while running, one times out), prints what happened and what to try
next, and keeps serving until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from orbit.cli.listening import KEEP_ALIVE, bind, url_of
from orbit.core.errors import OrbitError
from orbit.core.model import SECOND
from orbit.gctune import tune_for_throughput
from orbit.tokens import TokenError, load_token, token_id
from orbit.worker.runner import Context, Retry, Worker

if TYPE_CHECKING:
    from collections.abc import Iterator

    from orbit.client import AsyncClient
    from orbit.store import Store

console = Console(markup=False, emoji=False)  # paths and results are data, not markup
DEMO: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "succeeds": ("demo.echo", {"message": "hello"}, {}),
    "retries": (
        "demo.flaky",
        {"fail_times": 1},
        {"backoff": {"base": 0.5, "factor": 1, "max": 0.5}, "retry_safe": True},
    ),
    "cancelled": ("demo.slow", {"seconds": 60}, {}),
    # retry_safe: the runner reports the timeout of a retry_safe task only (any other is
    # left to its lease, and needs review); one attempt allowed, so the task fails
    "times out": (
        "demo.slow",
        {"seconds": 60},
        {"attempt_timeout": 1.0, "max_attempts": 1, "retry_safe": True},
    ),
}


def demo_worker(url: str, token: str) -> Worker:
    worker = Worker(url, token, name="orbit-dev-demo", concurrency=8, grace=2.0)

    @worker.handler("demo.echo")
    async def echo(ctx: Context, payload: Any) -> Any:
        return {"echo": payload}

    @worker.handler("demo.flaky")
    async def flaky(ctx: Context, payload: Any) -> Any:
        if ctx.attempt <= int(payload.get("fail_times", 1)):
            # Retry, not an exception of its own: the runner logs those with their
            # traceback, which the demo's first screen showed as if something had broken
            raise Retry(f"attempt {ctx.attempt} fails on purpose")
        return {"succeeded_on_attempt": ctx.attempt}

    @worker.handler("demo.slow")
    async def slow(ctx: Context, payload: Any) -> Any:
        await asyncio.sleep(float(payload.get("seconds", 5)))
        return {"slept": payload.get("seconds")}

    return worker


def _saved_admin_token(token_file: Path, store: Store) -> str | None:
    """The admin token an earlier run saved, if the file is private and the database
    still takes it: minting one every run left each earlier admin token valid, its only
    copy overwritten, until someone listed and revoked it (``orbit token revoke``)."""
    try:
        token = load_token({"ORBIT_TOKEN_FILE": str(token_file)})
    except TokenError:
        _revoke_exposed(token_file, store)
        return None
    return token if "admin" in (store.token_scopes(token) or ()) else None


def _revoke_exposed(token_file: Path, store: Store) -> None:
    """Revoke the admin token an earlier run saved in ``token_file`` if the file is open
    to group or others: a new token replaced it, and the old one, which other users could
    read, stayed valid for ever, its only copy overwritten. Only a token of this database
    that an earlier ``orbit dev`` made (its name ``orbit-dev``) is revoked."""
    try:
        mode = token_file.stat().st_mode
        if not stat.S_ISREG(mode) or not mode & (stat.S_IRWXG | stat.S_IRWXO):
            return
        token = token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return
    found = token_id(token)
    if found is None or store.token_scopes(token) is None:
        return
    if any(t.id == found and t.name == "orbit-dev" for t in store.token_list()):
        store.token_revoke(found)
        console.print(
            f"{token_file} was open to group or others: its token {found} is revoked, "
            "and a new one is saved"
        )


def _make_data_dir(data_dir: Path) -> None:
    """Make ``--data-dir`` if it is not there; one that is a file, or that cannot be
    made, is a usage error, not a traceback."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise typer.BadParameter(f"--data-dir {data_dir} is not a directory") from None
    except OSError as exc:
        raise typer.BadParameter(
            f"--data-dir {data_dir} cannot be made: {exc.strerror or exc}"
        ) from None


def _prepare(data_dir: Path) -> tuple[str, str]:
    """Create the database, the demo queue and an admin token (saved with mode 600), or
    use the token an earlier run saved. A ``--data-dir`` that is a file, or that cannot
    be made, is a usage error, not a traceback."""
    from orbit.cli.main import database
    from orbit.store import open_store

    _make_data_dir(data_dir)
    db_url = f"sqlite:///{data_dir / 'orbit.db'}"
    with database(db_url):  # a file that is no database: one line, exit 1
        store = open_store(db_url)
    try:
        with contextlib.suppress(OrbitError):
            store.queue_create("demo", max_concurrency=8, rate=0)
        token = _saved_admin_token(data_dir / "token", store)
        if token is None:
            _, token = store.token_create("orbit-dev", ["admin"])
    finally:
        store.close()
    # A new file, private from its first byte (mkstemp makes it 600), renamed over the
    # old one: opened by name, a `token` symlink took the token to wherever it pointed,
    # and an old token file others could read held it until its mode was changed.
    fd, temp = tempfile.mkstemp(dir=data_dir, prefix=".token-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(temp, data_dir / "token")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return db_url, token


async def _demo(client: AsyncClient) -> dict[str, dict[str, Any]]:
    ids: dict[str, str] = {}
    for name, (handler, payload, options) in DEMO.items():
        task = await client.submit("demo", handler, payload, **options)
        ids[name] = task["id"]
    # Cancel the slow task once it is really running: cancel wins over its result.
    for _ in range(300):
        if (await client.get(ids["cancelled"]))["state"] == "running":
            break
        await asyncio.sleep(0.05)
    await client.cancel(ids["cancelled"])
    return {name: await client.wait(tid, timeout=60) for name, tid in ids.items()}


async def _history(client: AsyncClient, task_id: str) -> str:
    page = await client._call(("GET", f"/v1/tasks/{task_id}/events", {"limit": 100}, None))
    return " → ".join(e["task_to"] for e in page["items"] if e["task_to"])


async def serve(host: str, port: int, data_dir: Path, once: bool) -> int:
    import uvicorn

    from orbit.client import AsyncClient
    from orbit.logs import configure
    from orbit.server import ServerSettings, create_app
    from orbit.server.denials import UVICORN_WS
    from orbit.store import StoreConfig

    configure("warning")
    # SIGINT and SIGTERM ask for the stop below from the start: Ctrl-C while the database
    # was prepared or the server started cancelled the start-up half way, which uvicorn
    # logged as an ERROR with its traceback (exit 130). The server leaves them to us.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    # Bound before anything is written: a port in use or a host that cannot be listened
    # on is refused with no database made and no admin token minted for nothing.
    sock = bind(host, port, unread_timeout=StoreConfig().session_ttl_us / SECOND)
    held: int | None = None
    try:
        from orbit.cli.main import database
        from orbit.store.sqlite import hold_for_server

        # The lock first: a second `orbit dev` on this directory is refused before it
        # migrates the database, or mints an admin token and rewrites the token file.
        _make_data_dir(data_dir)
        with database(f"sqlite:///{data_dir / 'orbit.db'}"):  # one line, exit 1
            held = hold_for_server(str(data_dir / "orbit.db"))
        db_url, token = _prepare(data_dir)
    except BaseException:
        if held is not None:
            os.close(held)
        sock.close()
        raise
    settings = ServerSettings(db_url=db_url, node_id="orbit-dev")
    url = url_of(sock, host)
    api = create_app(settings)
    server = Server(
        uvicorn.Config(
            api,
            log_level="warning",
            access_log=False,
            log_config=None,
            timeout_keep_alive=KEEP_ALIVE,  # as ``orbit server``'s
            **UVICORN_WS,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            return 1
        await asyncio.sleep(0.02)
    # Absolute: the commands below are to be pasted into another shell, maybe elsewhere.
    here = data_dir.resolve()
    console.print(f"Orbit dev server on SQLite ({here / 'orbit.db'}) at {url}")
    worker = demo_worker(url, token)
    working = asyncio.create_task(worker.arun())
    async with AsyncClient(url, token) as client:
        results = await _demo(client)
        table = Table("demo task", "state", "attempts", "history", "result / error")
        for name, task in results.items():
            outcome = (
                str(task["result"])
                if task["result"] is not None
                else f"{task['error']['code']}"
                if task["error"]
                else ""
            )
            table.add_row(
                name,
                task["state"],
                f"{task['attempts_used']}/{task['max_attempts']}",
                await _history(client, task["id"]),
                outcome,
            )
        console.print(table)
    # Under --once it stops now: it says so, and what a run without it would serve.
    running = (
        f"The demo ran on {url}; stopping (--once). Without --once it keeps serving"
        if once
        else f"Orbit is running at {url}  (API docs: {url}/docs)"
    )
    console.print(
        f"\n{running}\n"
        "Try, in another shell:\n"
        f"  export ORBIT_URL={url} ORBIT_TOKEN_FILE={here / 'token'}\n"
        "  orbit task submit demo demo.echo --payload '{\"hi\": 1}' --wait\n"
        "  orbit task ls\n"
        "  orbit worker ls\n" + ("" if once else "Press Ctrl-C to stop."),
        highlight=False,
        soft_wrap=True,  # the commands to paste stay one line each, however narrow
    )
    if not once:
        await stop.wait()
    worker.stop()
    # 10 s, though grace + cancel_grace + the report grace add up to 12: the demo's
    # handlers all end at once when cancelled (none ignores it, so cancel_grace is never
    # waited out) and the server here answers until the worker is done, so the drain
    # takes grace (2 s) and a round trip. Past 10 s only a server that stopped answering
    # is waited on; the run is cancelled then, and its leases decide.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(working, 10)
    api.state.streams.close()  # open event streams end: uvicorn waits for every response
    server.should_exit = True
    await serving
    os.close(held)
    console.print("stopped")
    return 0


def dev(
    port: Annotated[int, typer.Option(min=0, max=65535, help="port (0 picks a free one)")] = 8000,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    data_dir: Annotated[Path, typer.Option(help="where the SQLite file and token go")] = Path(
        ".orbit"
    ),
    once: Annotated[bool, typer.Option(help="exit after the demo instead of serving")] = False,
) -> None:
    """Run a server, a demo worker and demo tasks on SQLite; keep serving until Ctrl-C.

    Example: orbit dev --port 8000
    """
    tune_for_throughput()
    raise typer.Exit(asyncio.run(serve(host, port, data_dir, once)))
