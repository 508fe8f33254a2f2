"""``orbit dev``: everything on one machine, from nothing to tasks flowing.

It opens SQLite under ``.orbit/``, starts a server and a demo worker in this process,
runs four demo tasks that show the rules at work (one succeeds, one fails and is retried,
one is cancelled while running, one times out), prints what happened and what to try
next, and keeps serving until Ctrl-C (``_Stopping``: a second one stops at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shlex
import signal
import stat
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from orbit.aio import stop_tasks
from orbit.cli.listening import KEEP_ALIVE, bind, quiet_abandoned, url_of
from orbit.core.errors import OrbitError
from orbit.core.model import SECOND
from orbit.gctune import tune_for_throughput
from orbit.tokens import TokenError, load_token, token_id

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator
    from socket import socket

    from orbit.client import AsyncClient
    from orbit.store import Store
    from orbit.worker.runner import Context, Worker

T = TypeVar("T")

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
    # imported here: the worker runtime is no part of the other commands' start
    from orbit.worker.runner import Retry, Worker

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


class _Stopping:
    """What SIGINT and SIGTERM ask of ``orbit dev``, from its first moment (Ctrl-C while
    the database was prepared or the server started cancelled the start-up half way,
    which uvicorn logged as an ERROR with its traceback, exit 130). The first asks for a
    clean stop: a demo not yet over is cut short (one asked for during start-up still
    ran the whole demo, some 3 s, first), the worker drains, the server ends its
    requests. A second SIGINT (Ctrl-C again, after a SIGTERM too) stops at once, as it
    stops ``orbit server`` and ``orbit worker``: the worker's running handlers are
    cancelled without their grace, and the server waits for no request under way; the
    store is closed all the same. A second Ctrl-C did nothing: the stop waited for all
    of that, a request that never ended for ever."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.now = False
        self._hurry: list[Callable[[], object]] = []

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGINT, self.interrupted)
        loop.add_signal_handler(signal.SIGTERM, self.ask)

    def ask(self) -> None:
        """SIGTERM, or a first SIGINT: a clean stop (a second SIGTERM changes nothing)."""
        if not self.asked.is_set():
            console.print("stopping (Ctrl-C again stops at once)")
            self.asked.set()

    def interrupted(self) -> None:
        """SIGINT: the first asks for a clean stop, the next for a stop at once."""
        if not self.asked.is_set():
            self.ask()
        elif not self.now:
            self.now = True
            console.print("stopping at once")
            for hurry in self._hurry:
                hurry()

    def at_once(self, hurry: Callable[[], object]) -> None:
        """Have ``hurry`` called on a stop at once; now, if it was asked for already."""
        self._hurry.append(hurry)
        if self.now:
            hurry()


async def _unless(stop: asyncio.Event, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None once ``stop`` is set first (``work`` is cancelled)."""
    doing = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((doing, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        await stop_tasks([stopped])
        finished = doing.done()
        if not finished:
            await stop_tasks([doing])
    return doing.result() if finished else None


async def _submit_demo(client: AsyncClient) -> dict[str, str]:
    """Submit the demo tasks: their ids by name."""
    ids: dict[str, str] = {}
    for name, (handler, payload, options) in DEMO.items():
        task = await client.submit("demo", handler, payload, **options)
        ids[name] = task["id"]
    return ids


async def _demo(client: AsyncClient, ids: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Cancel the slow task once it runs, then wait for all four to end."""
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


async def _demo_table(client: AsyncClient, ids: dict[str, str]) -> Table:
    """What became of each demo task, once all have ended, as a table."""
    results = await _demo(client, ids)
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
    return table


async def _run_demo(url: str, token: str, stop: asyncio.Event) -> Table | None:
    """The demo's table, or None if a stop was asked for before it was over: its tasks
    not ended yet are cancelled then, rather than left to the next run's worker (a slow
    one, not retry_safe, would have needed review)."""
    from orbit.client import ApiError, AsyncClient, Unreachable

    async with AsyncClient(url, token) as client:
        if stop.is_set():
            return None
        # Not cut short: a submit cut off in flight may have made its task, whose id was
        # then never known, nor the task cancelled. The four take some milliseconds.
        ids = await _submit_demo(client)
        table = await _unless(stop, _demo_table(client, ids))
        if table is None:
            for task_id in ids.values():
                with contextlib.suppress(ApiError, Unreachable):
                    await client.cancel(task_id)
    return table


def _on_path() -> str:
    """The line that puts this ``orbit`` on a fresh shell's PATH, if it runs from a
    virtual environment: the commands printed are for another shell, where ``orbit`` was
    not found (``./scripts/dev`` runs it from ``.venv`` without activating it)."""
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix == sys.base_prefix or not activate.is_file():
        return ""
    return f"  source {shlex.quote(str(activate.absolute()))}\n"


def _next_steps(url: str, here: Path, once: bool) -> None:
    """What to try next. Under --once it stops now: it says so, and what a run without
    it would serve."""
    running = (
        f"The demo ran on {url}; stopping (--once). Without --once it keeps serving"
        if once
        else f"Orbit is running at {url}  (API docs: {url}/docs)"
    )
    console.print(
        f"\n{running}\n"
        "Try, in another shell:\n"
        f"{_on_path()}"
        f"  export ORBIT_URL={url} ORBIT_TOKEN_FILE={here / 'token'}\n"
        "  orbit task submit demo demo.echo --payload '{\"hi\": 1}' --wait\n"
        "  orbit task ls\n"
        "  orbit worker ls\n" + ("" if once else "Press Ctrl-C to stop."),
        highlight=False,
        soft_wrap=True,  # the commands to paste stay one line each, however narrow
    )


async def _work(url: str, token: str, here: Path, once: bool, stopping: _Stopping) -> None:
    """The demo worker, the demo and, but under --once, serving until a stop is asked."""
    worker = demo_worker(url, token)
    working = asyncio.create_task(worker.arun())
    stopping.at_once(lambda: None if working.done() else worker.stop(now=True))
    try:
        table = await _run_demo(url, token, stopping.asked)
        if table is not None:
            console.print(table)
            _next_steps(url, here, once)
            if not once:
                await stopping.asked.wait()
    finally:
        worker.stop()
        # 10 s, though grace + cancel_grace + the report grace add up to 12: the demo's
        # handlers all end at once when cancelled (none ignores it, so cancel_grace is
        # never waited out) and the server here answers until the worker is done, so the
        # drain takes grace (2 s) and a round trip. Past 10 s only a server that stopped
        # answering is waited on; the run is cancelled then, and its leases decide.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(working, 10)


def _client_url(sock: socket, host: str) -> str:
    """The URL a client on this machine reaches the server by: a wildcard host
    (``0.0.0.0``, ``::``) is every address to listen on, not one to connect to, and
    ``http://0.0.0.0:8000`` was printed as the URL and as ``ORBIT_URL`` to export."""
    with contextlib.suppress(ValueError):  # a name, not an address
        if ipaddress.ip_address(host).is_unspecified:
            return url_of(sock, "::1" if ":" in host else "127.0.0.1")
    return url_of(sock, host)


def _hold(data_dir: Path) -> int | None:
    """The one-server lock on ``data_dir``'s database, or None if another process holds
    it (another ``orbit dev``, or an ``orbit server`` on that file)."""
    from orbit.store.sqlite import DatabaseInUse, hold_for_server

    try:
        return hold_for_server(str(data_dir / "orbit.db"))
    except DatabaseInUse:
        return None


def _open(host: str, port: int, data_dir: Path, after: ExitStack) -> tuple[socket, str, Store]:
    """Bind, take the one-server lock, prepare the database and open its store; ``after``
    closes each once the event loop is closed (as ``orbit server`` closes its store once
    uvicorn has returned: a stop at once leaves the application's shutdown out). Returns
    the socket, the admin token and the store."""
    from orbit.cli.main import _fail, database
    from orbit.store import StoreConfig, open_store

    # Bound before anything is written: a port in use or a host that cannot be listened
    # on is refused with no database made and no admin token minted for nothing.
    sock = bind(host, port, unread_timeout=StoreConfig().session_ttl_us / SECOND)
    after.callback(sock.close)
    # The lock first: a second `orbit dev` on this directory is refused before it
    # migrates the database, or mints an admin token and rewrites the token file.
    _make_data_dir(data_dir)
    with database(f"sqlite:///{data_dir / 'orbit.db'}"):  # one line, exit 1
        held = _hold(data_dir)
    if held is None:  # the store's words ("use PostgreSQL for more") are for servers
        _fail(
            f"another orbit dev (or orbit server) is using --data-dir {data_dir}: "
            "stop it, or pass another --data-dir",
            1,
        )
    after.callback(os.close, held)
    db_url, token = _prepare(data_dir)
    with database(db_url):
        store = open_store(db_url)
    after.callback(store.close)
    return sock, token, store


async def serve(host: str, port: int, data_dir: Path, once: bool, after: ExitStack) -> int:
    """Serve until stopped; ``after`` holds what is closed once the event loop is."""
    # Signals ask for the stop below from the start; the server leaves them to us.
    stopping = _Stopping()
    stopping.install(asyncio.get_running_loop())
    import uvicorn  # imported already (_import_server): these take no time

    from orbit.cli.main import HEADER_TIMEOUT
    from orbit.logs import configure
    from orbit.server import ServerSettings, create_app
    from orbit.server.denials import UVICORN_WS
    from orbit.server.request_heads import head_deadline

    configure("warning")

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    sock, token, store = _open(host, port, data_dir, after)
    db_url = f"sqlite:///{data_dir / 'orbit.db'}"
    api = create_app(ServerSettings(db_url=db_url, node_id="orbit-dev"), store=store)
    url = _client_url(sock, host)
    from orbit.cli.openfiles import raise_open_files_limit

    raise_open_files_limit()  # as ``orbit server``: a warning only if it stays low
    server = Server(
        uvicorn.Config(
            api,
            log_level="warning",
            access_log=False,
            log_config=None,
            timeout_keep_alive=KEEP_ALIVE,  # as ``orbit server``'s
            **UVICORN_WS,
            http=head_deadline(HEADER_TIMEOUT),  # as ``orbit server``'s default
        )
    )
    stopping.at_once(lambda: setattr(server, "force_exit", True))  # waits for no request
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            return 1
        await asyncio.sleep(0.02)
    if not stopping.asked.is_set():  # asked during start-up: no demo, no worker
        # Absolute: the commands printed are to be pasted into another shell, maybe elsewhere.
        here = data_dir.resolve()
        everywhere = "" if url == url_of(sock, host) else f" (listening on all addresses, {host})"
        console.print(f"Orbit dev server on SQLite ({here / 'orbit.db'}) at {url}{everywhere}")
        await _work(url, token, here, once, stopping)
    api.state.streams.close()  # open event streams end: uvicorn waits for every response
    server.should_exit = True
    await serving
    if server.force_exit:
        quiet_abandoned()  # cancelled as the loop closes, before the store is closed
    console.print("stopped")
    return 0


def _import_server() -> None:
    """Import the server (some 0.7 s) before the event loop runs. Imported in ``serve``,
    a Ctrl-C met asyncio.run's own SIGINT handler, ``_Stopping``'s not yet installed:
    it cancelled the start-up half way, which uvicorn logged as an ERROR with its
    traceback (exit 130). Here a Ctrl-C is a KeyboardInterrupt, before anything is
    written: a clean exit 130."""
    import uvicorn  # noqa: F401

    import orbit.logs
    import orbit.server
    import orbit.server.denials
    import orbit.server.request_heads  # noqa: F401


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
    try:
        tune_for_throughput()
        _import_server()
    except KeyboardInterrupt:  # Ctrl-C before the loop runs: nothing is written yet
        raise typer.Exit(130) from None
    # Closed once the loop is, the tasks it still held (a stop at once leaves some) ended.
    with ExitStack() as after:
        code = asyncio.run(serve(host, port, data_dir, once, after))
    raise typer.Exit(code)
