"""``orbit queue|task|worker|limit|event|schedule …``: the HTTP API from the shell.

Connection: ``--url`` (or ORBIT_URL, default http://127.0.0.1:8000), the token from
ORBIT_TOKEN or ORBIT_TOKEN_FILE, ``--cafile`` for a private CA. Output: tables for
people, ``--json`` for scripts. Exit codes: 0 done; 1 the task ended other than
succeeded; 2 bad arguments; 3 refused by the server; 4 server unreachable; 5 timed out;
6 try again later (a full queue or tenant, 429; the server's database busy or away, 503).
"""

from __future__ import annotations

import json
import math
import os
import ssl
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from orbit.core.errors import (
    DATABASE_BUSY,
    DATABASE_FULL,
    DATABASE_READ_ONLY,
    DATABASE_UNAVAILABLE,
)
from orbit.core.states import TaskState
from orbit.core.validate import (
    MAX_GLOBAL_CAP,
    MAX_QUEUED_CAP,
    MAX_TENANT_CAP,
    RATE_RANGE,
    is_rate,
)
from orbit.tokens import TokenError, load_token
from orbit.urls import check_cafile

if TYPE_CHECKING:
    from rich.status import Status

    from orbit.client import ApiError, Client, Unreachable, WaitTimeout
    from orbit.client._client import Waiting

EXIT_TASK_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_TIMEOUT = 1, 2, 3, 4, 5
#: try again later, in the time the error line gives: backpressure, a queue or tenant is
#: full (429, nothing was written), or the server cannot take the call now (503,
#: ``Unavailable``: its database busy, full, read-only or away). The 503 was exit 3,
#: "refused", as if the same call would always be.
EXIT_FULL = 6
#: Ctrl-C, as a shell reports a command SIGINT ended (128 + 2)
EXIT_INTERRUPTED = 130
# What these print is data (results, progress and error messages, ids, paths), never
# rich markup: a "[/x]" in any of it was a MarkupError traceback, and ":x:" an emoji.
out = Console(markup=False, emoji=False)
err = Console(stderr=True, markup=False, emoji=False)

#: C0 but newline and tab, DEL and C1: what a terminal reads as a command, not text
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)}


def shown(text: str) -> str:
    """Text a worker or a user wrote, made safe to print: each control character spelled
    as ``\\x1b``. Rich drops BEL but passes ESC, so a handler's error or progress message
    could clear the operator's screen or set the terminal's title."""
    return text.translate(_CONTROL)


def option_source(ctx: typer.Context, name: str) -> str | None:
    """Where option ``name``'s value came from: ``COMMANDLINE``, ``ENVIRONMENT``,
    ``DEFAULT``... By name: typer carries a click of its own, whose ParameterSource is
    not the one ``import click`` gives."""
    source = ctx.get_parameter_source(name)
    return None if source is None else source.name


def no_empty_env(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """An option's environment variable that is set but empty (``ORBIT_URL=$UNSET``) is
    refused, one line and exit 2, as an empty ORBIT_TOKEN is: click takes it for unset,
    so ``orbit task submit`` went to the default URL, and ``orbit worker`` replaced its
    module's URL with the default. The option given on the command line wins over it."""
    envvar = param.envvar
    given = option_source(ctx, str(param.name)) == "COMMANDLINE"
    if isinstance(envvar, str) and not given and os.environ.get(envvar, "x").strip() == "":
        option = param.opts[0] if param.opts else envvar
        fail(f"{envvar} is set but empty: give {option}, or unset {envvar}", EXIT_USAGE)
    return value


Url = Annotated[
    str, typer.Option("--url", envvar="ORBIT_URL", help="server URL", callback=no_empty_env)
]
CaFile = Annotated[
    str | None,
    typer.Option(
        "--cafile",
        envvar="ORBIT_CAFILE",
        help="CA file for a server with a private CA",
        callback=no_empty_env,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
#: a queue's caps, as ``queue create`` and ``queue update`` take them
MaxConcurrency = Annotated[int | None, typer.Option(help="live attempts at most (>= 1)")]
Rate = Annotated[float | None, typer.Option(help=RATE_RANGE)]
#: ``queue create``'s, which refuses a queue without both: said in the help, not made
#: typer's required options, whose refusal named one of the two and not ``--rate 0``
CreateMaxConcurrency = Annotated[
    int | None, typer.Option(help="live attempts at most (>= 1); required")
]
CreateRate = Annotated[float | None, typer.Option(help=f"{RATE_RANGE}; required")]
Burst = Annotated[int | None, typer.Option(help="token bucket size")]
#: what ``--max-queued`` says, where it may also remove the cap
MAX_QUEUED_HELP = "waiting (queued or scheduled) tasks at most; a submit past it is refused"
DEFAULT_URL = "http://127.0.0.1:8000"

#: What every command of these groups shares, said in their --help.
CONNECTION_HELP = (
    "\n\nThe server is --url (or ORBIT_URL; set but empty, it is refused); the token "
    "comes from ORBIT_TOKEN or ORBIT_TOKEN_FILE, never from the command line. Exit codes: "
    "0 done; 2 bad arguments (those the command checks itself); 3 refused by the server "
    "(a value only it checks too); 4 server unreachable"
)
#: Exit 6 for every group: the server's 503 for its database's sake (DATABASE_BUSY, ...).
DATABASE_BUSY_HELP = (
    "the server's database cannot take the call now (503: busy, full, read-only or away); "
    "try again later, in the time the error line gives"
)
#: What the groups but the task commands' add to CONNECTION_HELP.
TRY_LATER_EXIT = "; 6 " + DATABASE_BUSY_HELP
#: The task commands' own exit codes, after those of every group.
TASK_EXITS = (
    "; 6 the queue or tenant is full (backpressure: nothing was submitted) or "
    + DATABASE_BUSY_HELP
    + ". Of wait and submit --wait only (show exits 0 for any task it shows): 1 the "
    "task ended other than succeeded; 5 timed out; 130 interrupted (Ctrl-C: the task "
    "goes on, and the command says how to wait for it again)."
)
queue_app = typer.Typer(
    help="Queues: create, list, update caps, pause, resume."
    + CONNECTION_HELP
    + TRY_LATER_EXIT
    + ".",
    no_args_is_help=True,
)
limit_app = typer.Typer(
    help="Caps of tenants (live attempts, waiting tasks) and of the whole cluster (live "
    "attempts): ls lists them; tenant and global show, set or remove one."
    + CONNECTION_HELP
    + TRY_LATER_EXIT
    + ".",
    no_args_is_help=True,
)
event_app = typer.Typer(
    help="The event log, in its order: every task's events and the operators' changes "
    "(queue, tenant and global caps, pauses, sessions)."
    + CONNECTION_HELP
    + TRY_LATER_EXIT
    # the follow rides over a node's 503 for its streams' sake for a minute (the
    # client's outage), then ends with it: exit 6, as for the database's
    + "; for ls --follow, also a node still at its cap of streams or shutting down after "
    "a minute (503 TOO_MANY_STREAMS, SHUTTING_DOWN).",
    no_args_is_help=True,
)
schedule_app = typer.Typer(
    help="Schedules: a cron expression in a time zone that submits a task at each of its "
    "instants, once across the cluster. Create, update, list, show, pause, resume, "
    "delete." + CONNECTION_HELP + TRY_LATER_EXIT + ".",
    no_args_is_help=True,
)
task_app = typer.Typer(
    help="Tasks: submit, list, show, cancel, retry, resolve, wait." + CONNECTION_HELP + TASK_EXITS,
    no_args_is_help=True,
)


def fail(message: str, code: int) -> NoReturn:
    # soft_wrap: one line, however long; rich broke a message at the console's width
    # (80 columns when stderr is no terminal), so a script read half of it
    err.print(Text.assemble(("error:", "red"), " ", shown(message)), soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def client(url: str, cafile: str | None) -> Iterator[Client]:
    # The client (httpx) is imported by the commands that use it, not by every `orbit`.
    from orbit.client import ApiError, Client, TooManyRequests, Unavailable, Unreachable

    try:
        token = load_token()
    except TokenError as exc:
        fail(str(exc), EXIT_USAGE)
    try:
        check_cafile(cafile)  # named, where a missing file said only "[Errno 2] ..."
        api = Client(url, token, cafile=cafile)
    except (ValueError, OSError) as exc:  # a URL it cannot use, a CA file it cannot read
        fail(str(exc), EXIT_USAGE)
    try:
        with api as c:
            yield c
    except (TooManyRequests, Unavailable) as exc:  # a 429 or a 503: try again later
        wait = "" if exc.retry_after is None else f" (retry after {exc.retry_after:g} s)"
        fail(f"{exc.code}: {exc.message}{wait}", EXIT_FULL)
    except ApiError as exc:
        fail(f"{exc.code}: {exc.message}", EXIT_REFUSED)
    except Unreachable as exc:
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLCertVerificationError):
            # reached, but not trusted: a set-up to mend (--cafile), not an outage
            why = cause.verify_message or str(cause)
            fail(f"the server's certificate is not trusted: {why} (see --cafile)", EXIT_USAGE)
        fail(f"cannot reach {url}: {_why_unreachable(url, exc)}", EXIT_UNREACHABLE)
    except ValueError as exc:
        # The client's refusal of an argument before anything is sent: an empty id or
        # name (`orbit task show "$ID"` with ID unset) was a traceback and exit 1, which
        # `task wait` means as a task that ended other than succeeded. Only the client's
        # own: any other ValueError is a fault, and keeps its traceback.
        if not _raised_by_client(exc):
            raise
        fail(str(exc), EXIT_USAGE)


def _why_unreachable(url: str, exc: BaseException) -> str:
    """What failed, on one line: the client's message (the transport's error, or how long
    a wait met it), where the class name alone (``Unreachable``, ``SSLError``) said
    nothing; and, for a scheme the server does not speak there, which one to use. The URL
    holds no password (the client refuses one); ``redact`` blots out any other secret."""
    from http.client import RemoteDisconnected
    from urllib.parse import urlsplit

    from orbit.client._http import where
    from orbit.logs import redact

    parts = urlsplit(url)
    why = " ".join(str(exc).split()).removeprefix(f"{where(parts)}: ")
    chain = list(_chain(exc))
    if parts.scheme == "https" and any(_plain_http(e) for e in chain):
        why += " (the server speaks plain HTTP there? use http://)"
    elif parts.scheme == "http" and any(isinstance(e, RemoteDisconnected) for e in chain):
        why += " (if the server serves TLS there, use https://)"
    return redact(why)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes, innermost last (ten at most: a chain may loop)."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def _plain_http(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS handshake that met no TLS: the answer of a plain HTTP
    server (OpenSSL 3.2 and later name it RECORD_LAYER_FAILURE)."""
    reasons = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE")
    return isinstance(exc, ssl.SSLError) and exc.reason in reasons


def raised_in(exc: BaseException, package: str) -> bool:
    """Whether ``exc`` was raised in ``package`` (its innermost frame's module is the
    package or in it): a refusal of Orbit's, rather than a fault elsewhere."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = "" if tb is None else str(tb.tb_frame.f_globals.get("__name__", ""))
    return module == package or module.startswith(f"{package}.")


def _raised_by_client(exc: BaseException) -> bool:
    """A refusal of an argument by ``orbit.client``, rather than a fault in printing or
    in the command's own code."""
    return raised_in(exc, "orbit.client")


def emit(
    data: Any, as_json: bool, table: Callable[[Any], Table] | None = None, none: str = ""
) -> None:
    """``data`` as JSON or as ``table``; an empty list as ``none`` (a table's bare frame
    read as a fault), never so with ``--json``."""
    if as_json or table is None:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    elif none and data == []:
        out.print(none, highlight=False)
    else:
        out.print(table(data))


def parse_json(value: str | None, what: str) -> Any:
    """An option's JSON, read under the server's strict rules (orbit.protocol.decode).
    Python's ``json`` also reads NaN, Infinity and 1e999, which the client's encoder then
    sent as ``null``: ``--payload NaN`` submitted a null payload and exited 0."""
    from orbit.protocol.decode import DecodeError, decode_json

    if value is None:
        return None
    try:
        return decode_json(value)
    except DecodeError as exc:
        fail(f"{what} is not JSON Orbit takes: {exc.message}", EXIT_USAGE)


def finite(value: float | None, option: str) -> float | None:
    """A number option that JSON can carry: ``--timeout nan`` was sent as ``null``, a
    task with no timeout at all."""
    if value is not None and not math.isfinite(value):
        fail(f"{option} must be a finite number", EXIT_USAGE)
    return value


def rate_option(value: float | None) -> None:
    """``--rate`` in the one range the server takes (``orbit.core.validate.is_rate``):
    refused here, exit 2, as a non-finite one is, rather than sent for a 400."""
    finite(value, "--rate")
    if value is not None and not is_rate(value):
        fail(f"--rate must be {RATE_RANGE}; got {value:g}", EXIT_USAGE)


def instant_option(value: str | None, option: str) -> datetime | None:
    """An ISO 8601 instant with a timezone (``2026-01-01T00:00:00Z``, ``…+02:00``). A
    date alone or a time without a zone names no one instant: refused, exit 2."""
    if value is None:
        return None
    try:
        instant = datetime.fromisoformat(value)
    except ValueError:
        instant = None
    if instant is None or instant.tzinfo is None:
        fail(
            f"{option} must be an ISO 8601 instant with a timezone, e.g. 2026-01-01T00:00:00Z",
            EXIT_USAGE,
        )
    return instant


def _queues_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(*_folding("queue", "max concurrency", "rate/s", "burst", "max queued", "paused"))
    for q in rows:
        rate = "unlimited" if q["rate"] == 0 else f"{q['rate']:g}"
        table.add_row(
            q["name"],
            str(q["max_concurrency"]),
            rate,
            str(q["burst"]),
            "no cap" if q.get("max_queued") is None else str(q["max_queued"]),
            "yes" if q["paused"] else "",
        )
    return table


def _id_column(name: str, ids: list[str]) -> Column:
    """A column of ids, never cut short: an id shortened to fit an 80-column terminal
    (``01a24af6-5679-7d…``) was printed, and the commands it is copied into refused it
    (TASK_NOT_FOUND). The other columns fold instead (``_folding``)."""
    return Column(name, no_wrap=True, min_width=max((len(i) for i in ids), default=0))


def _folding(*names: str) -> list[Column]:
    """Columns that wrap a long value onto more lines rather than end it with ``…``."""
    return [Column(name, overflow="fold") for name in names]


def _tasks_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        _id_column("id", [t["id"] for t in rows]),
        *_folding("queue", "handler", "state", "attempts", "created"),
    )
    for t in rows:
        table.add_row(
            t["id"],
            t["queue"],
            t["handler"],
            t["state"],
            f"{t['attempts_used']}/{t['max_attempts']}",
            t["created_at"][:19],
        )
    return table


# ----------------------------------------------------------------------------- queue


@queue_app.command("create")
def queue_create(
    name: str,
    max_concurrency: CreateMaxConcurrency = None,
    rate: CreateRate = None,
    burst: Burst = None,
    max_queued: Annotated[
        str | None, typer.Option(help=f"{MAX_QUEUED_HELP} (default: no cap)")
    ] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Create a queue. Both --max-concurrency and --rate are required.

    Example: orbit queue create render --max-concurrency 8 --rate 20 --max-queued 10000
    """
    if max_concurrency is None or rate is None:
        fail(
            "a queue needs --max-concurrency and --rate (write --rate 0 for unlimited)", EXIT_USAGE
        )
    rate_option(rate)
    queued = _max_queued(max_queued)[1]
    with client(url, cafile) as c:
        made = c.queue_create(
            name, max_concurrency=max_concurrency, rate=rate, burst=burst, max_queued=queued
        )
        emit(made, as_json, lambda q: _queues_table([q]))


@queue_app.command("update")
def queue_update(
    name: str,
    max_concurrency: MaxConcurrency = None,
    rate: Rate = None,
    burst: Burst = None,
    max_queued: Annotated[
        str | None, typer.Option(help=f"{MAX_QUEUED_HELP}; `none` removes the cap")
    ] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Change a queue's caps: only the ones given.

    Lowering --max-concurrency stops nothing that runs; new claims wait until fewer are
    live. Lowering --max-queued below the tasks waiting touches none of them; submits are
    refused until fewer wait. A new --rate keeps the burst: give --burst too to change both.

    Example: orbit queue update render --max-concurrency 16 --rate 50 --burst 50
    """
    if max_concurrency is None and rate is None and burst is None and max_queued is None:
        fail("give at least one of --max-concurrency, --rate, --burst, --max-queued", EXIT_USAGE)
    rate_option(rate)
    put_queued, queued = _max_queued(max_queued)
    with client(url, cafile) as c:
        changed = c.queue_update(
            name,
            max_concurrency=max_concurrency,
            rate=rate,
            burst=burst,
            max_queued=queued if put_queued else "keep",
        )
        emit(changed, as_json, lambda q: _queues_table([q]))


@queue_app.command("ls")
def queue_ls(url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False) -> None:
    """List every queue, in name order (the command reads every page of the list)."""
    with client(url, cafile) as c:
        emit(c.queues(), as_json, _queues_table, "no queues")


@queue_app.command("pause")
def queue_pause(
    name: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Pause a queue: nothing new starts; running attempts still finish."""
    with client(url, cafile) as c:
        emit(c.queue_pause(name), as_json, lambda q: _queues_table([q]))


@queue_app.command("resume")
def queue_resume(
    name: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Resume a paused queue."""
    with client(url, cafile) as c:
        emit(c.queue_resume(name), as_json, lambda q: _queues_table([q]))


# ----------------------------------------------------------------------------- schedule


def _schedules_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        *_folding("schedule", "cron", "timezone", "queue", "handler", "misfire", "next fire")
    )
    for s in rows:
        misfire = s["misfire"]
        if misfire == "catch_up":
            misfire = f"catch_up (at most {s['max_catch_up']})"
        table.add_row(
            s["name"],
            s["cron"],
            s["timezone"],
            s["template"]["queue"],
            s["template"]["handler"],
            misfire,
            "paused" if s["paused"] else s["next_fire_at"],
        )
    return table


#: A schedule's tasks' attempt limit, spelled as ``task submit`` spells it; ``--timeout``
#: was its only spelling here, the one ``task submit`` gave up as read for a wait's.
TemplateAttemptTimeout = Annotated[
    float | None,
    typer.Option(
        "--attempt-timeout",
        "--timeout",
        help="each task's attempt limit: how long one attempt may run, seconds (--timeout "
        "is its older spelling)",
    ),
]


@schedule_app.command("create")
def schedule_create(
    name: str,
    cron: Annotated[
        str,
        typer.Option(
            help="classic cron's 5 fields: minute hour day-of-month month day-of-week, "
            "e.g. '0 3 * * *' (03:00 daily) or '*/15 * * * mon-fri' (every 15 minutes on "
            "weekdays)"
        ),
    ],
    queue: Annotated[str, typer.Option(help="the queue each fire submits to")],
    handler: Annotated[str, typer.Option(help="the handler each fire's task runs")],
    payload: Annotated[str | None, typer.Option(help="JSON payload of each task")] = None,
    timezone: Annotated[
        str, typer.Option(help="IANA time zone the expression is read in (e.g. Europe/Berlin)")
    ] = "UTC",
    misfire: Annotated[
        str,
        typer.Option(
            help="instants missed by more than a minute (the cluster was down, or the queue "
            "full): skip them, run_once for all, or catch_up each (the latest "
            "--max-catch-up), oldest first"
        ),
    ] = "skip",
    max_catch_up: Annotated[
        int | None, typer.Option(help="catch_up's bound, 1..1000 (default 10)")
    ] = None,
    paused: Annotated[bool, typer.Option(help="create it paused")] = False,
    tenant: Annotated[str | None, typer.Option(help="each task's tenant")] = None,
    priority: Annotated[int | None, typer.Option(help="each task's priority")] = None,
    max_attempts: Annotated[
        int | None, typer.Option(help="each task's started attempts at most, 1..1000")
    ] = None,
    attempt_timeout: TemplateAttemptTimeout = None,
    retry_safe: Annotated[
        bool, typer.Option(help="each task may be replayed if its outcome is lost")
    ] = False,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Create a schedule that submits a task at each instant of its cron expression.

    The first fire is the first instant of --cron in --timezone after now; each instant
    fires once across the cluster. A local time that a DST change skips fires at the
    gap's end; one it repeats fires once, at its first occurrence, unless the minute or
    hour field starts with * (as in Vixie cron: then at both).

    Example (on `orbit dev`'s server, whose queue is demo; elsewhere, make the queue
    first with orbit queue create): orbit schedule create nightly --cron '0 3 * * *'
    --timezone Europe/Berlin --queue demo --handler demo.echo --payload '{"kind": "daily"}'
    """
    body = parse_json(payload, "--payload")
    finite(attempt_timeout, "--attempt-timeout (--timeout)")
    if misfire not in ("skip", "run_once", "catch_up"):
        fail("--misfire must be skip, run_once or catch_up", EXIT_USAGE)
    template: dict[str, Any] = {
        "tenant": tenant,
        "priority": priority,
        "max_attempts": max_attempts,
        "attempt_timeout": attempt_timeout,
        "retry_safe": retry_safe or None,
    }
    with client(url, cafile) as c:
        made = c.schedule_create(
            name,
            cron=cron,
            queue=queue,
            handler=handler,
            payload=body,
            timezone=timezone,
            misfire=misfire,  # type: ignore[arg-type]
            max_catch_up=max_catch_up,
            paused=paused or None,
            **template,
        )
        emit(made, as_json, lambda s: _schedules_table([s]))


@schedule_app.command("update")
def schedule_update(
    name: str,
    cron: Annotated[
        str | None, typer.Option(help="a new expression: classic cron's 5 fields, e.g. '0 3 * * *'")
    ] = None,
    timezone: Annotated[str | None, typer.Option(help="a new IANA time zone")] = None,
    misfire: Annotated[
        str | None, typer.Option(help="a new misfire policy: skip, run_once or catch_up")
    ] = None,
    max_catch_up: Annotated[
        int | None, typer.Option(help="a new bound for catch_up, 1..1000")
    ] = None,
    queue: Annotated[str | None, typer.Option(help="each task's new queue")] = None,
    handler: Annotated[str | None, typer.Option(help="each task's new handler")] = None,
    payload: Annotated[str | None, typer.Option(help="each task's new JSON payload")] = None,
    tenant: Annotated[str | None, typer.Option(help="each task's new tenant")] = None,
    priority: Annotated[int | None, typer.Option(help="each task's new priority")] = None,
    max_attempts: Annotated[
        int | None, typer.Option(help="each task's started attempts at most, 1..1000")
    ] = None,
    attempt_timeout: TemplateAttemptTimeout = None,
    retry_safe: Annotated[
        bool | None, typer.Option(help="each task may (not) be replayed if its outcome is lost")
    ] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Change a schedule: only what is given.

    A new --cron or --timezone moves the next fire to the first instant after now (the
    old expression's instants not yet fired are dropped). The task options (--queue,
    --handler, --payload, ...) change the schedule's template: the command reads it and
    sends it whole with the options given replacing its fields, so an edit of the
    template made by someone else in between is overwritten.

    Example: orbit schedule update nightly --cron '30 2 * * *' --payload '{"kind": "full"}'
    """
    changes: dict[str, Any] = {
        "queue": queue,
        "handler": handler,
        "tenant": tenant,
        "priority": priority,
        "max_attempts": max_attempts,
        "attempt_timeout": attempt_timeout,
        "retry_safe": retry_safe,
    }
    finite(attempt_timeout, "--attempt-timeout (--timeout)")
    changes = {k: v for k, v in changes.items() if v is not None}
    if payload is not None:
        changes["payload"] = parse_json(payload, "--payload")  # JSON null is a payload too
    if misfire is not None and misfire not in ("skip", "run_once", "catch_up"):
        fail("--misfire must be skip, run_once or catch_up", EXIT_USAGE)
    if not changes and all(v is None for v in (cron, timezone, misfire, max_catch_up)):
        fail(
            "give at least one of --cron, --timezone, --misfire, --max-catch-up, or a "
            "task option (--queue, --handler, --payload, ...)",
            EXIT_USAGE,
        )
    with client(url, cafile) as c:
        template = None
        if changes:
            template = dict(c.schedule(name)["template"]) | changes
        changed = c.schedule_update(
            name,
            cron=cron,
            timezone=timezone,
            template=template,
            misfire=misfire,  # type: ignore[arg-type]
            max_catch_up=max_catch_up,
        )
        emit(changed, as_json, lambda s: _schedules_table([s]))


@schedule_app.command("ls")
def schedule_ls(url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False) -> None:
    """List every schedule, in name order (the command reads every page of the list)."""
    with client(url, cafile) as c:
        emit(c.schedules(), as_json, _schedules_table, "no schedules")


@schedule_app.command("show")
def schedule_show(
    name: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Show one schedule: its template whole with --json."""
    with client(url, cafile) as c:
        emit(c.schedule(name), as_json, lambda s: _schedules_table([s]))


@schedule_app.command("pause")
def schedule_pause(
    name: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Pause a schedule: it fires nothing until resumed."""
    with client(url, cafile) as c:
        emit(c.schedule_pause(name), as_json, lambda s: _schedules_table([s]))


@schedule_app.command("resume")
def schedule_resume(
    name: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Resume a paused schedule from the first instant after now.

    The instants that passed while it was paused are not fired, whatever its misfire
    policy."""
    with client(url, cafile) as c:
        emit(c.schedule_resume(name), as_json, lambda s: _schedules_table([s]))


@schedule_app.command("delete")
def schedule_delete(
    name: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Delete a schedule. The tasks it made stay as they are."""
    with client(url, cafile) as c:
        emit(c.schedule_delete(name), as_json, lambda s: _schedules_table([s]))


# ----------------------------------------------------------------------------- task


@task_app.command("submit")
def task_submit(
    queue: str,
    handler: str,
    payload: Annotated[str | None, typer.Option(help="JSON payload")] = None,
    tenant: Annotated[str | None, typer.Option(help="workspace (default: default)")] = None,
    priority: Annotated[
        int | None, typer.Option(help="higher runs first, -1000000..1000000 (default 0)")
    ] = None,
    key: Annotated[
        str | None, typer.Option(help="idempotency key, unique per tenant and queue")
    ] = None,
    parent: Annotated[str | None, typer.Option(help="parent task id")] = None,
    retry_safe: Annotated[
        bool, typer.Option(help="may be replayed if its outcome is lost")
    ] = False,
    max_attempts: Annotated[
        int | None, typer.Option(help="started attempts at most, 1..1000 (default 3)")
    ] = None,
    attempt_timeout: Annotated[
        float | None,
        typer.Option(
            "--attempt-timeout",
            "--timeout",  # its older spelling, which read as how long --wait waits
            help="the attempt's limit: how long one attempt may run, seconds (--timeout is "
            "its older spelling; how long --wait waits is --wait-timeout)",
        ),
    ] = None,
    deadline: Annotated[str | None, typer.Option(help="RFC 3339 instant")] = None,
    run_after: Annotated[str | None, typer.Option(help="RFC 3339 instant")] = None,
    wait: Annotated[
        bool, typer.Option(help="wait for the task to end (exit codes as task wait's)")
    ] = False,
    wait_timeout: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            # not "[default: 3600]": rich, which renders the help, took it for markup
            help="with --wait: give up waiting after this many seconds (default 3600)",
        ),
    ] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Submit a task and print it (its id first).

    Example: orbit task submit render render.screenshot --payload '{"url": "https://x.test"}'
    """
    body = parse_json(payload, "--payload")
    finite(attempt_timeout, "--attempt-timeout (--timeout)")
    finite(wait_timeout, "--wait-timeout")
    if wait_timeout is not None and not wait:
        fail("--wait-timeout goes with --wait", EXIT_USAGE)
    with client(url, cafile) as c:
        task = c.submit(
            queue,
            handler,
            body,
            tenant=tenant,
            priority=priority,
            idempotency_key=key,
            parent_id=parent,
            retry_safe=retry_safe or None,
            max_attempts=max_attempts,
            attempt_timeout=attempt_timeout,
            deadline=deadline,
            run_after=run_after,
        )
        if wait:
            waited = 3600.0 if wait_timeout is None else wait_timeout
            _wait(c, task["id"], waited, as_json, seen=task)
            return
        # Whether this submit made the task or its --key named one made before: the
        # same view either way, and a resubmit said nothing of it.
        created = bool(getattr(task, "created", True))
        view = {**task, "created": created} if as_json else task
        emit(view, as_json, lambda t: _tasks_table([t]))
        if not created and not as_json:
            err.print(
                f"--key {shown(str(key))} names this existing task: nothing new was submitted"
            )


@task_app.command("ls")
def task_ls(
    state: Annotated[
        str | None, typer.Option(help=f"only tasks in this state: {', '.join(TaskState)}")
    ] = None,
    queue: Annotated[str | None, typer.Option()] = None,
    tenant: Annotated[str | None, typer.Option()] = None,
    handler: Annotated[str | None, typer.Option()] = None,
    parent: Annotated[str | None, typer.Option(help="only the children of this task")] = None,
    created_after: Annotated[
        str | None,
        typer.Option(help="only tasks created at or after this ISO 8601 instant (with a zone)"),
    ] = None,
    created_before: Annotated[
        str | None,
        typer.Option(help="only tasks created before this ISO 8601 instant (with a zone)"),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    cursor: Annotated[str | None, typer.Option(help="continue from a previous page")] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """List tasks, oldest first; prints the cursor of the next page if there is one.

    Example: orbit task ls --state failed --created-after 2026-01-01T00:00:00Z
    """
    for value, option in (
        (state, "--state"),
        (queue, "--queue"),
        (tenant, "--tenant"),
        (handler, "--handler"),
        (parent, "--parent"),
    ):
        if value == "":  # an unset shell variable, say: the server refuses it too
            fail(f"{option} is empty: give a value, or leave the option out", EXIT_USAGE)
    after = instant_option(created_after, "--created-after")
    before = instant_option(created_before, "--created-before")
    with client(url, cafile) as c:
        page = c.list_tasks(
            state=state,
            queue=queue,
            tenant=tenant,
            handler=handler,
            parent_id=parent,
            created_after=after,
            created_before=before,
            limit=limit,
            cursor=cursor,
        )
    if as_json:
        emit(page, True)
        return
    emit(page["items"], False, _tasks_table, "no tasks match")
    if page["next_cursor"]:
        out.print(f"next page: --cursor {page['next_cursor']}", highlight=False)


@task_app.command("show")
def task_show(
    task_id: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """A task with all its attempts and its whole history (every page of each)."""
    with client(url, cafile) as c:
        task = c.get(task_id)
        attempts = c.attempts(task_id)
        events = _EventFollower(c, task_id).new()
    if as_json:
        emit({"task": task, "attempts": attempts, "events": events}, True)
        return
    out.print(_tasks_table([task]))
    _print_outcome(task)
    if attempts:
        tried = Table(
            _id_column("attempt", [a["id"] for a in attempts]),
            *_folding("#", "state"),
            _id_column("session", [a["session_id"] or "" for a in attempts]),
            *_folding("started", "ended"),
        )
        for a in attempts:
            tried.add_row(
                a["id"],
                str(a["number"]),
                a["state"],
                a["session_id"],
                (a["started_at"] or "")[:23],
                (a["ended_at"] or "")[:23],
            )
        out.print(tried)
    history = Table(*_folding("at", "event", "task", "attempt", "code"))
    for e in events:
        history.add_row(
            e["at"][11:23],
            e["kind"],
            f"{e['task_from'] or ''} → {e['task_to'] or ''}" if e["task_to"] else "",
            e["attempt_to"] or "",
            shown(e["code"] or ""),  # a worker's error code: any short text
        )
    out.print(history)


@task_app.command("cancel")
def task_cancel(
    task_id: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Cancel a task and its descendants: a running one's worker is told at once (or as
    it reconnects, if it was not connected), and it ends cancelled when its handler
    stops or its lease runs out."""
    with client(url, cafile) as c:
        emit(c.cancel(task_id), as_json, lambda t: _tasks_table([t]))


@task_app.command("retry")
def task_retry(
    task_id: str, url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False
) -> None:
    """Run a failed or cancelled task again."""
    with client(url, cafile) as c:
        emit(c.retry(task_id), as_json, lambda t: _tasks_table([t]))


@task_app.command("resolve")
def task_resolve(
    task_id: str,
    decision: Annotated[str, typer.Option(help="succeeded, failed or retry")],
    result: Annotated[str | None, typer.Option(help="JSON result, with succeeded")] = None,
    error_code: Annotated[str | None, typer.Option(help="with failed")] = None,
    error_message: Annotated[str, typer.Option(help="with failed")] = "",
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Decide a needs_review task: its last attempt may or may not have had effects.

    Example: orbit task resolve 01a2… --decision retry
    """
    if decision not in ("succeeded", "failed", "retry"):
        fail("--decision must be succeeded, failed or retry", EXIT_USAGE)
    # Refused here rather than dropped: the client sends a result only with succeeded.
    if result is not None and decision != "succeeded":
        fail("--result goes only with --decision succeeded", EXIT_USAGE)
    if (error_code is not None or error_message) and decision != "failed":
        fail("--error-code and --error-message go only with --decision failed", EXIT_USAGE)
    if error_message and error_code is None:
        fail("--error-message needs --error-code", EXIT_USAGE)
    if error_code == "":  # was sent as no error at all, its --error-message dropped
        fail("--error-code must not be empty", EXIT_USAGE)
    value = parse_json(result, "--result")
    error = {"code": error_code, "message": error_message} if error_code is not None else None
    with client(url, cafile) as c:
        emit(
            c.resolve(task_id, decision, result=value, error=error),
            as_json,
            lambda t: _tasks_table([t]),
        )


def _show_event(e: dict[str, Any]) -> None:
    """One line of live progress for ``task wait``."""
    at = e["at"][11:23]
    if e["kind"] == "progress":
        data = e["data"] or {}
        fraction = data.get("fraction")
        pct = f"{fraction:.0%}" if fraction is not None else ""
        message = shown(data.get("message") or "")
        err.print(f"  {at}  progress {pct} {message}", highlight=False)
    elif e["task_to"]:
        err.print(f"  {at}  {e['kind']:<16} → {e['task_to']}", highlight=False)


class _EventFollower:
    """A task's events, page after page: ``new()`` returns those not returned before.
    One page holds at most 1,000, and a task that reports progress in a loop has more:
    reading only the first page left ``task show`` short and ``task wait`` silent."""

    PAGE = 1000

    def __init__(self, c: Client, task_id: str) -> None:
        self._c = c
        self._task_id = task_id
        self._cursor: str | None = None  # the start of the page not yet read to its end
        self._read: set[str] = set()  # the ids read on that page
        self._pending: list[dict[str, Any]] = []  # read, not yet returned

    def new(self, timeout: Callable[[], float | None] = lambda: None) -> list[dict[str, Any]]:
        """The events not returned before, in id order. A read that fails part way (the
        server gone between two pages) loses none: those read are returned by the next
        call. The feed's order is by transaction, not by id (an event with a lower id
        can follow), so what was read is told by its id, not by the highest id read;
        each batch is shown in id order, the order its events were written in.
        ``timeout``: asked before each page, its request's timeout (None: the client's)."""
        while True:
            page = self._c.events(
                self._task_id, limit=self.PAGE, cursor=self._cursor, timeout=timeout()
            )
            for e in page["items"]:
                if e["id"] not in self._read:
                    self._pending.append(e)
                    self._read.add(e["id"])
            if not page["next_cursor"]:
                found, self._pending = self._pending, []
                return sorted(found, key=lambda e: int(e["id"]))
            self._cursor = page["next_cursor"]
            self._read = set()


def _last_events(follower: _EventFollower, within: Callable[[], float]) -> list[dict[str, Any]]:
    """The events written between a wait's last two reads, once the task is seen ended.
    They are for show: a read the end of the wait cut short (a server slow to answer) or
    the server gone since says so on stderr, and the task's outcome stands. Raised, it
    made a task that succeeded exit 4, as if the server had been out of reach."""
    from orbit.client import ApiError, Unreachable

    try:
        return follower.new(within)
    except (Unreachable, ApiError) as exc:
        err.print(Text(f"warning: the task's last events could not be read: {shown(str(exc))}"))
        return []


def _print_outcome(task: dict[str, Any]) -> None:
    """A task's result or error, one line each, under its table."""
    if task["result"] is not None:
        # ensure_ascii=False: 日本語 as written, not \u65e5\u672c\u8a9e
        result = json.dumps(task["result"], ensure_ascii=False)
        out.print(f"result: {shown(result)}", highlight=False)
    if task["error"]:
        # A task cancelled while it waited for a retry (or from needs_review) keeps its last
        # attempt's error as history: it did not end because of it.
        label = "last attempt's error" if task["state"] == "cancelled" else "error"
        error = f"{task['error']['code']} {task['error']['message'] or ''}"
        out.print(f"{label}: {shown(error)}", highlight=False)


def _wait(
    c: Client, task_id: str, timeout: float, as_json: bool, seen: dict[str, Any] | None = None
) -> None:
    """Follow the task until it ends: exit 0 if it succeeded, 1 if not, 5 when the wait
    is over first. With ``--json`` a wait that is over prints the task as last seen
    (``seen``: as already known, which ``submit`` has), as an ended one is printed: a
    script reading stdout got nothing, not even the id of the task it had submitted."""
    from orbit.client._client import Waiting

    waiting = Waiting(task_id, timeout)
    try:
        with err.status(Text(f"waiting for {task_id}")) as status:  # Text: no markup
            task, over = _follow(c, waiting, status, as_json, seen)
    except KeyboardInterrupt:
        # The id was only in the status line, which is erased on exit (and never shown
        # when stderr is no terminal): the user could not find the task that goes on.
        err.print(Text(f"task {task_id} goes on: orbit task wait {task_id}"), soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    # Printed once the status line is gone: on a terminal it sends stdout's writes to stderr.
    if task is not None and (as_json or over is None):
        emit(task, as_json, lambda t: _tasks_table([t]))
    if over is not None:
        fail(str(over), EXIT_TIMEOUT)
    assert task is not None  # an ended task was seen
    if not as_json:
        _print_outcome(task)  # why it failed, not only that it did
    if task["state"] != "succeeded":
        raise typer.Exit(EXIT_TASK_FAILED)


#: What a 503's ``DATABASE_*`` code says of the server's database, in the wait's status
DATABASE_STATES = {
    DATABASE_BUSY: "is busy",
    DATABASE_FULL: "is full",
    DATABASE_READ_ONLY: "is read-only",
    DATABASE_UNAVAILABLE: "is away",
}


def why_asking_again(exc: Unreachable | ApiError) -> str:
    """Why a wait's poll failed and it asks again (``Waiting.failed`` let it through), as
    its status line says it: the server out of reach (or a proxy's page), its database
    unable to take the call (a 503 ``DATABASE_*``, code named), or the server failing
    (500 ``INTERNAL``). Every failure said "the server cannot be reached", so an
    operator watching a wait looked for a network fault while the server was answering
    that its database was busy."""
    from orbit.client import ApiError, Unavailable

    if isinstance(exc, Unavailable):
        state = DATABASE_STATES.get(exc.code)
        said = (
            "the server cannot take the call now"
            if state is None
            else f"the server's database {state}"
        )
        return f"{said} ({exc.code})"
    if isinstance(exc, ApiError) and exc.code == "INTERNAL":
        return "the server failed (INTERNAL)"
    return "the server cannot be reached"


def _follow(
    c: Client, waiting: Waiting, status: Status, as_json: bool, seen: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, WaitTimeout | None]:
    """Poll the task until it ends: it, and None; or, once the wait is over, the task as
    last seen and the WaitTimeout. Asks again while the server cannot be reached (a
    restart, a rolling deploy), as ``Client.wait`` does: the first such poll ended the
    command (exit 4) though the task went on. Unreachable to the end is still exit 4.
    No request waits for its answer past the end of the wait (``Waiting``)."""
    from orbit.client import ApiError, Unreachable, WaitTimeout

    task_id = waiting.task_id
    follower = _EventFollower(c, task_id)

    def within() -> float:
        return waiting.request_timeout(c.timeout)

    while True:
        try:
            fresh = follower.new(within)
            task = seen = c.get(task_id, timeout=within())
        except (Unreachable, ApiError) as exc:
            try:
                # a refusal is raised: exit 3; an outage to the end: 4; the database
                # busy or away to the end (503): 6
                waiting.failed(exc)
            except WaitTimeout as over:  # the end of the wait cut the last poll short
                return seen, over
            status.update(Text(f"{task_id}: {why_asking_again(exc)}; asking again"))
            time.sleep(0.2)
            continue
        for e in fresh:
            if not as_json:
                _show_event(e)
        status.update(
            Text(
                f"{task_id}: {task['state']} "
                f"(attempt {task['attempts_used']}/{task['max_attempts']})"
            )
        )
        try:
            if waiting.ended(task):
                for e in _last_events(follower, within):
                    if not as_json:
                        _show_event(e)
                return task, None
        except WaitTimeout as over:
            return task, over
        time.sleep(0.2)


@task_app.command("wait")
def task_wait(
    task_id: str,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="how long to wait, seconds (then exit 5)")
    ] = 300.0,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Follow a task live until it ends; exit 0 if it succeeded, 1 if not, 5 on timeout
    (with --json, the task as last seen is printed then too, as task submit --wait does)."""
    with client(url, cafile) as c:
        _wait(c, task_id, timeout, as_json)


# ----------------------------------------------------------------------------- worker


def _workers_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        _id_column("session", [w["session_id"] for w in rows]),
        *_folding("name", "node", "epoch", "state", "draining", "capabilities"),
    )
    for w in rows:
        caps = ", ".join(f"{c['handler']}:{c['capacity']}" for c in w["capabilities"])
        table.add_row(
            w["session_id"],
            w["name"],
            w["node_id"],
            w["epoch"],
            w["state"],
            "yes" if w["draining"] else "",
            caps,
        )
    return table


def worker_ls(url: str, cafile: str | None, as_json: bool, state: str | None = None) -> None:
    """The live sessions unless ``state`` says otherwise (``all``: expired ones too).
    Expired sessions are never deleted, so listing them all by default printed every
    session a cluster ever had (6,055 lines in 17 s at 2,000 of them) to find the few
    running; a state the server does not know is still the server's to refuse."""
    state = "live" if state is None else state
    listed = None if state == "all" else state
    with client(url, cafile) as c:
        none = "no workers" if listed is None else f"no {listed} workers"
        emit(c.workers(listed), as_json, _workers_table, none)


def worker_drain(session_id: str, url: str, cafile: str | None, as_json: bool) -> None:
    with client(url, cafile) as c:
        emit(c.worker_drain(session_id), as_json, lambda w: _workers_table([w]))


# ----------------------------------------------------------------------------- event


def _event_text(e: dict[str, Any]) -> tuple[str, str]:
    """An event's subject and data as printed: what it is about is its task, else its
    queue, tenant or session (an operator's change belongs to no task)."""
    subject = e["task_id"] or e["queue"] or e["tenant"] or e["session_id"] or ""
    data = "" if e["data"] is None else json.dumps(e["data"], sort_keys=True, ensure_ascii=False)
    return subject, shown(data)


def _events_table(rows: list[dict[str, Any]]) -> Table:
    """One line an event (``_event_text``)."""
    table = Table(*_folding("id", "at"))
    table.add_column("kind", no_wrap=True)  # what a reader scans for, never cut short
    table.add_column("subject", overflow="fold")  # a task id: wrapped, never cut short
    table.add_column("data", overflow="fold")
    for e in rows:
        subject, data = _event_text(e)
        table.add_row(e["id"], e["at"], e["kind"], subject, data)
    return table


@event_app.command("ls")
def event_ls(
    limit: Annotated[
        int | None,
        typer.Option(min=1, max=1000, help="events on the page, 1-1000 (default 50)"),
    ] = None,
    cursor: Annotated[str | None, typer.Option(help="continue from a previous page")] = None,
    task: Annotated[
        str | None, typer.Option(help="only this task's events (a submit token will do)")
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="keep printing events as they are written (a task's: until it has ended)",
        ),
    ] = False,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """List the event log in its order; prints the cursor of the next page if there is
    one, else, for a page read from --cursor, that cursor: the one to ask again with for
    the events written since. Needs an admin token, but for one task's events (--task).
    With --follow, one line an event as it is written (with --json, one object a line:
    its cursor and the event), riding out a server restart; Ctrl-C stops and prints the
    cursor to go on from.

    Example: orbit event ls --limit 100 --cursor …; orbit event ls --follow --task ID
    """
    if follow and limit is not None:  # it was taken, and followed every event regardless
        fail("--limit is a page's size; --follow prints every event as it comes", EXIT_USAGE)
    with client(url, cafile) as c:
        if follow:
            _follow_events(c, task, cursor, as_json)
            return
        size = 50 if limit is None else limit
        if task is None:
            page = c.event_log(limit=size, cursor=cursor)
        else:
            page = c.events(task, limit=size, cursor=cursor)
    if as_json:
        emit(page, True)
        return
    emit(page["items"], False, _events_table, "no events")
    if page["next_cursor"]:
        out.print(f"next page: --cursor {page['next_cursor']}", highlight=False)
    elif cursor is not None:
        # A short page is the end for now, and a follower goes on from the cursor that
        # read it (its events come again first, then the newer ones: docs/protocol.md,
        # "Event feeds"); it was printed nowhere, as if there were no place to go on from.
        err.print(f"caught up; go on with --cursor {cursor}", highlight=False)


def _follow_events(c: Client, task_id: str | None, cursor: str | None, as_json: bool) -> None:
    """``event ls --follow``: each event as it comes, until the task's stream ends (or,
    for the whole log, Ctrl-C, which says where to go on from)."""
    last = cursor
    try:
        for last, e in c.stream_events(task_id, cursor=cursor):
            if as_json:
                sys.stdout.write(json.dumps({"cursor": last, "event": e}, sort_keys=True) + "\n")
                sys.stdout.flush()
                continue
            subject, data = _event_text(e)
            line = f"{e['at']}  {e['id']:>8}  {e['kind']:<16} {subject}  {data}"
            out.print(line.rstrip(), highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        if last is not None:
            err.print(f"stopped; go on with --cursor {last}", highlight=False)


# ----------------------------------------------------------------------------- limit

#: what `orbit limit tenant|global` takes as the new cap
CAP_HELP = "the new cap (an integer >= 1), or `none` to remove it; left out: show the cap"
#: `orbit limit tenant|global`: a CAP that starts with '-' (``-1``) is the argument, not
#: an option click does not know ("No such option: -1"), so ``_cap`` refuses it as a cap
CAP_COMMAND = {"ignore_unknown_options": True}


def _cap(value: str | None, most: int, what: str = "the cap") -> tuple[bool, int | None]:
    """``(set?, cap)`` from the optional CAP argument (or ``what``, an option that takes a
    cap the same way): absent shows, ``none`` removes; a cap is 1 to ``most`` (the store's
    bound for the scope). There is no negative or zero spelling of "no cap": that is
    ``none``."""
    if value is None:
        return False, None
    if value.strip().lower() == "none":
        return True, None
    if value.startswith("--"):  # a mistyped option, which CAP_COMMAND lets through
        fail(f"no such option: {value:.40}", EXIT_USAGE)
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= most:
        fail(
            f"{what} must be an integer from 1 to {most} or `none` (no cap); got {value!r:.40}",
            EXIT_USAGE,
        )
    return True, int(value)


def _max_queued(value: str | None) -> tuple[bool, int | None]:
    """``_cap`` of a --max-queued option: ``(set?, cap on waiting tasks)``."""
    return _cap(value, MAX_QUEUED_CAP, "--max-queued")


def _limits_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(*_folding("scope", "max concurrency", "max queued"))
    for row in rows:
        scope = "global" if "tenant" not in row else f"tenant {row['tenant']}"
        cap = row["max_concurrency"]
        queued = "" if "tenant" not in row else row.get("max_queued")  # global: none of its own
        table.add_row(
            scope,
            "no cap" if cap is None else str(cap),
            "no cap" if queued is None else str(queued),
        )
    return table


@limit_app.command("ls")
def limit_ls(url: Url = DEFAULT_URL, cafile: CaFile = None, as_json: AsJson = False) -> None:
    """Show the global cap and every tenant that has one (every page of the list)."""
    with client(url, cafile) as c:
        data = {"global": c.global_limit(), "tenants": c.tenant_limits()}
    emit(data, as_json, lambda d: _limits_table([d["global"], *d["tenants"]]))


@limit_app.command("tenant", context_settings=CAP_COMMAND)
def limit_tenant(
    tenant: str,
    cap: Annotated[str | None, typer.Argument(help=CAP_HELP, show_default=False)] = None,
    max_queued: Annotated[
        str | None,
        typer.Option(help=f"{MAX_QUEUED_HELP}, in all queues; `none` removes the cap"),
    ] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Show or set a tenant's caps, across all queues: CAP on live attempts, --max-queued
    on waiting tasks. A cap left out stays as it is.

    Lowering CAP stops nothing that runs; new claims wait until fewer are live. Lowering
    --max-queued touches no waiting task; submits are refused until fewer wait.

    Example: orbit limit tenant acme 20 --max-queued 5000   (none: no cap)
    """
    put, value = _cap(cap, MAX_TENANT_CAP)
    put_queued, queued = _max_queued(max_queued)
    with client(url, cafile) as c:
        if put or put_queued:
            row = c.tenant_limit_set(
                tenant, value if put else "keep", max_queued=queued if put_queued else "keep"
            )
        else:
            row = c.tenant_limit(tenant)
    emit(row, as_json, lambda r: _limits_table([r]))


@limit_app.command("global", context_settings=CAP_COMMAND)
def limit_global(
    cap: Annotated[str | None, typer.Argument(help=CAP_HELP, show_default=False)] = None,
    url: Url = DEFAULT_URL,
    cafile: CaFile = None,
    as_json: AsJson = False,
) -> None:
    """Show or set the cap on live attempts across the whole cluster.

    Example: orbit limit global 500   (orbit limit global none: no cap)
    """
    put, value = _cap(cap, MAX_GLOBAL_CAP)
    with client(url, cafile) as c:
        row = c.global_limit_set(value) if put else c.global_limit()
    emit(row, as_json, lambda r: _limits_table([r]))
