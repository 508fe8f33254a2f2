"""The automatic worker: leases, renewals, cancellation, reconnects and shutdown done
right, so a handler is just a function.

    worker = Worker("http://127.0.0.1:8000", name="renderer", concurrency=8)

    @worker.handler("render.screenshot", capacity=4)
    async def screenshot(ctx: Context, payload: dict) -> dict:
        ...

    if __name__ == "__main__":  # not at import: ``orbit worker`` runs it itself
        worker.run()  # SIGTERM or SIGINT: drain, then exit (a second SIGINT: at once)

Guarantees the runner keeps:
- a handler's result is sent only while its attempt is still ours: when the server says
  the lease is lost (or we cannot renew before it runs out), the handler is cancelled and
  its result is dropped;
- a finish whose reply was lost is re-sent with the very same outcome after a reconnect
  and resume; the server answers it with the original receipt, so it commits once; one
  not yet sent when the connection dropped is sent after the reconnect only if its lease
  is still ours, and the pauses between reconnect tries never pass half of what is left
  of the soonest lease, so a node back in time still gets the results;
- a start the server could not try (its database failed: the start may have committed,
  its reply lost) is sent again while the claim lasts, and answered with the same lease
  if it did commit, so the handler runs once; past the claim it is released;
- an operator's drain (the server pushes ``drain``) stops the worker as SIGTERM does;
- cancellation reaches the handler at once: an async handler's task is cancelled; a plain
  function sees ``ctx.cancelled`` become true and is waited for a bounded time;
- shutdown never hangs: after the grace period running handlers are cancelled, and a
  handler that still ignores it is reported and abandoned (its thread is a daemon; an
  async handler's task is left behind when the event loop closes); its attempt reports
  nothing, and its lease decides;
- a revoked token ends the run: the server closes the connection with 4401, the worker
  given its token in ``token=`` or ``ORBIT_TOKEN`` (which cannot change) reconnects once,
  and refused it cancels its handlers and ``run()`` raises the refusal, as at the first
  connection (``orbit worker`` exits 3); what its attempts become is up to their leases
  and the session's expiry. A connection lost another way (the network, a server
  restart) whose reconnects are refused ends the same way, once the same token has been
  refused twice with a pause after each (tries between them that fail another way, the
  server unreachable, neither count nor start the count again). After a 4401 for a token
  read from ``ORBIT_TOKEN_FILE`` the worker waits up to ``ROTATION_WAIT_S`` for a new
  token there (tried at once: the session resumes, its handlers going on under their
  leases), and ends the run only when none has come by then (with the file's fault,
  ``orbit worker`` exits 2, if the file still cannot be read).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import math
import numbers
import os
import random
import signal
import ssl
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from types import CoroutineType
from typing import Any, Literal
from urllib.parse import quote

from websockets.exceptions import InvalidStatus

from orbit import aio
from orbit.aio import stop_tasks
from orbit.core.errors import DATABASE_CODES, Code, OrbitError
from orbit.core.model import parse_json
from orbit.core.validate import (
    MAX_ARTIFACT_TTL_S,
    MAX_HANDLER_CAPACITY,
    MAX_RENEW_IDS,
    MAX_WORKER_CONCURRENCY,
    MAX_WORKER_HANDLERS,
    check_name,
    content_type_problem,
)
from orbit.gctune import tune_for_throughput
from orbit.tokens import TokenError, load_token
from orbit.urls import check_cafile, check_server_url
from orbit.worker import outcomes
from orbit.worker.batching import MAX_BATCH, Coalescer
from orbit.worker.connection import ServerError, WorkerConnection, outcome_wire

log = logging.getLogger("orbit.worker")
#: seconds before a failed renewal is tried again, doubled at each failure up to the
#: most, and never past half of what is left of a lease (``Worker._defer_renewals``)
RENEW_RETRY_FIRST = 0.25
RENEW_RETRY_MAX = 10.0
#: the close code of a connection whose token was revoked (docs/protocol.md)
REVOKED_CLOSE = 4401
#: After a drop that was no 4401, how many refusals (401/403) of one token, with no
#: refusal of another between them, end the run, provided the token read after the pause
#: that follows the last is still that one. A try between them that fails another way (the server
#: unreachable, a 5xx) judged no token: it neither counts nor starts the count again
#: (were it to, a balancer alternating a node that is down and one that refuses would
#: have a revoked token retried for ever), and it only makes the wait for a rotated token
#: longer. Two, not one: a token revoked just before its replacement is written into
#: ORBIT_TOKEN_FILE is refused once or twice before the new one can be read. After a
#: 4401 for a file's token the count is not what ends the run: ROTATION_WAIT_S is.
REFUSALS_TO_STOP = 2
#: After a 4401 for a token read from ORBIT_TOKEN_FILE, how long (seconds) the worker
#: waits for a usable token there before it ends the run: a token revoked before its
#: replacement is written, or a replacement written with the wrong mode and mended by
#: hand. REFUSALS_TO_STOP alone gave such a rotation the back-off's first two pauses,
#: 0.15 to 0.3 s, and the run (and a running task that is not retry_safe) was lost to
#: a write half a second late. The handlers go on meanwhile, under leases nobody can
#: renew until the connection is back.
ROTATION_WAIT_S = 10.0
#: the reconnect back-off's first base, in seconds (``reconnect_max`` if that is less):
#: the pause after the first failed try is between half of it and all of it
#: (``ReconnectBackoff``)
RECONNECT_FIRST_S = 0.1
#: The longest ``Retry-After`` a refused reconnect waits for, in seconds: a longer one (a
#: proxy's maintenance page asking for an hour) is taken as this, so a refused worker
#: looks again within a minute (twice this, at most) and a node back sooner is not left
#: without its workers for the hour.
RETRY_AFTER_MAX_S = 30.0
#: the refusals of an upgrade whose ``Retry-After`` is waited out: a proxy or balancer in
#: front whose nodes are away (503), or that limits the rate of connections (429)
RETRY_AFTER_STATUSES = frozenset({429, 503})
#: While running attempts hold leases, a reconnect pause (``Retry-After`` included) is
#: never longer than half of what is left of the soonest of them, as a failed renewal's
#: retry is not (``Worker._lease_bound``), nor shorter than this, in seconds. Paced by
#: the back-off alone (up to ``reconnect_max``, or twice a ``Retry-After``), a worker
#: slept past its leases although its node was back: the finished handlers' results
#: were dropped, and their tasks that are not retry_safe went to needs_review.
RECONNECT_LEASE_FLOOR_S = 0.05
#: how long a prefetched attempt waits before the runner may take it for a claim that ran
#: out (``Worker._drop_stale``): the server's default claim lease (docs/concepts.md)
CLAIM_STALE_S = 30.0
#: The answer to a ``resume`` that says the server could not try it (its store failed:
#: a database failover, a node starting), not that the session is gone: while some
#: running attempt still holds its lease, the resume is tried again, as after a failed
#: connect. Any other refusal (``BAD_SECRET``, ``SESSION_NOT_FOUND``, a malformed
#: request), or this one with no lease left to keep, starts a new session, and the old
#: one's attempts are lost to this worker. Starting anew at once lost every running
#: handler, and, past its lease, sent every task that is not ``retry_safe`` to
#: ``needs_review``, whenever a node restarted while its database hiccuped.
#: The answers of a server that could not try a request, as opposed to one that refused
#: it: ``INTERNAL`` (it failed unexpectedly: how a node whose database refuses writes, a
#: full disk or a read-only database, answers a ``hello``) and the database conditions a
#: server answers 503 for (its lock held too long, full, read-only, out of reach). A
#: ``hello`` answered so, on the first connection too, is retried with the reconnect
#: back-off (a warning each time), not final as the server's refusal of this worker's
#: credentials or configuration is (any other code): a worker started while its server's
#: database refused writes exited for good. ``resume`` and ``finish`` read them the same.
SERVER_NOT_TRIED = frozenset({"INTERNAL", *DATABASE_CODES})
RESUME_NOT_TRIED = SERVER_NOT_TRIED
#: The answer to a ``finish`` (or a whole ``finish_many``) that says the server could not
#: commit it (its database failed or was out of reach), not that the report was refused:
#: it is sent again while the lease lasts (``Worker._finish``), after FINISH_RETRY_FIRST
#: seconds, doubled at each try up to FINISH_RETRY_MAX, never past half of what is left
#: of the lease.
FINISH_NOT_TRIED = SERVER_NOT_TRIED
FINISH_RETRY_FIRST = 0.1
FINISH_RETRY_MAX = 5.0
#: The answer to a ``start`` (or a whole ``start_many``) that says the server could not
#: try it. It was logged and dropped: its commit may have landed with the reply lost (a
#: connection killed after the COMMIT), and 30 s on the reaper found the attempt started
#: and unreported, its handler never run, and sent a task that is not ``retry_safe`` to
#: ``needs_review``; or it had not, and the claimed task waited out its claim lease. It
#: is sent again, with the finish's back-off (``_Resends``), while the claim lasts by this
#: host's clock (``CLAIM_STALE_S`` from the claim): a repeated start of an attempt already
#: running for this session and fence is answered with its lease, and the handler runs
#: once. Past that, or once the worker stops, the claim is released (``Worker._start``).
START_NOT_TRIED = SERVER_NOT_TRIED
#: The longest gap between two checks of the leases while a renewal's answer is awaited
#: (the renew loop's shortest sleep, ``Worker._interval``'s): an attempt started meanwhile
#: may hold a lease shorter than the wait.
LEASE_CHECK_S = 0.05
#: The least a renewal's answer is waited for, however little is left of the soonest
#: lease. A renewal not answered by the soonest lease's end closes the connection, so that
#: the runner resumes on a new one in time to renew the others (a link gone half-open);
#: but a lease the server will not extend (capped by its attempt timeout or its task's
#: deadline) shrinks towards nothing, and near its end the wait fell to 50 ms: a server
#: slower than that closed the connection, and every other attempt's renewal with it,
#: again and again. Leases that end meanwhile are given up on time all the same
#: (``Worker._renewal_answer``).
RENEW_WAIT_FLOOR_S = 1.0
#: How late (seconds) the renew loop may wake, past when it meant to, before it says the
#: event loop was blocked (``Worker._note_stall``). An async handler that blocks the loop,
#: or many CPU-bound plain functions whose threads hold the GIL, delay every renewal: past
#: the lease's length each attempt is lost, and the log said only ``lost: lease expired``.
#: 1 s is far beyond the loop's own latency and well under the 15 s a default 30 s lease
#: has left when it is renewed (half spent): a stall is named before it costs leases.
LOOP_STALL_WARN_S = 1.0
#: At most one stall warning this often (seconds): a worker whose loop is starved for good
#: (CPU-bound thread handlers) would otherwise log one at every turn of the renew loop.
LOOP_STALL_LOG_EVERY_S = 60.0
#: The most the renewal of an attempt whose finish is on its way (sent, not answered) is
#: put off, once, when it falls due (``Worker._carried``): a finish is answered in far
#: less, and a renew sent meanwhile reached the server after the finish had committed,
#: which refused it (ATTEMPT_ENDED, a ``rejected`` event after ``succeeded``). Never put
#: off below RENEW_WAIT_FLOOR_S of lease left, nor more than a quarter of what is left: a
#: finish slow to commit still has its lease renewed.
FINISH_RENEW_DEFER_S = 0.5
#: the reason a drain gives the attempts it cancels (and the waiting ones it gives back)
STOPPING = "worker stopping"
#: The most times one ``ctx.upload`` is sent. It is sent again only when it was refused
#: ``FENCED_EPOCH`` because this worker resumed its session while it was on its way (a
#: dropped socket, a node restarted in a rolling deploy), and the attempt is still the
#: worker's (``Worker._resumed_since``): once for each new epoch. The epoch is read when
#: the PUT starts and checked again at its commit, so such an upload was refused while the
#: same attempt then finished normally under the new epoch, with no artifact.
UPLOAD_SENDS = 4
#: the most of a handler's traceback one log line holds (characters)
TRACE_MAX = 20_000
Handler = Callable[..., Any]
#: a finish the runner batches: attempt id, fence, outcome in wire form, and whether
#: that outcome is plain (``_sendable``)
FinishItem = tuple[str, str, dict[str, Any], bool]


class Retry(Exception):
    """Raise from a handler to fail this attempt as retryable (the default for errors).

    ``code`` and ``message`` are class attributes too: a subclass may give its code as
    one (``code = "THROTTLED"``), and one whose ``__init__`` does not call this one is
    still reported (it reported nothing, its outcome failing in the runner)."""

    code: str = "RETRY"
    message: str = ""

    def __init__(self, message: str | None = None, code: str | None = None) -> None:
        super().__init__(message or "")
        if code is not None:  # else the class's: it was overwritten with the default
            self.code = code
        if message is not None:  # else the class's, as the code
            self.message = message


class Fail(Exception):
    """Raise from a handler to fail the task for good (no retry). ``code`` and
    ``message`` are class attributes too, as ``Retry``'s are."""

    code: str = "FAILED"
    message: str = ""

    def __init__(self, message: str | None = None, code: str | None = None) -> None:
        super().__init__(message or "")
        if code is not None:
            self.code = code
        if message is not None:
            self.message = message


class Cancelled(Exception):
    """Raised by ``ctx.check()`` once the attempt must stop."""


class _LeaseLapsed(Exception):
    """A finish not sent: its attempt's lease ran out while it waited for a connection
    (``Worker._send_finishes``)."""


class _Exited(Exception):
    """A handler raised a BaseException that is no Exception (SystemExit, ...), or one
    that a thread cannot hand to the loop as it is (StopIteration, which a future
    refuses; CancelledError, taken for the attempt's own cancel): its attempt's failure,
    carried as an Exception so that it ends no more than that."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(type(exc).__name__)
        self.exc = exc


def _check_upload_options(content_type: object, ttl: object) -> int | None:
    """Refuse, before anything is sent, a content type the store would refuse (one rule:
    ``content_type_problem``) and a ``ttl`` that is no whole number of seconds in the
    server's range. ``int(ttl)`` sent 1.5 as 1 s and True as 1, "10" went as 10, and 0.5
    came back as the server's complaint about a header, X-Orbit-TTL, the handler never
    set; a content type httpx cannot encode (``name=日本``) raised its UnicodeEncodeError.
    Returns ``ttl`` as an int (a numpy integer is one too), or None."""
    problem = content_type_problem(content_type)
    if problem is not None:
        if not isinstance(content_type, str):
            raise TypeError(problem)
        raise ValueError(problem)
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, numbers.Integral):
        raise TypeError(f"ttl must be whole seconds (an int) or None, not {type(ttl).__name__}")
    seconds = int(ttl)
    if not 1 <= seconds <= MAX_ARTIFACT_TTL_S:
        raise ValueError(f"ttl must be from 1 to {MAX_ARTIFACT_TTL_S} seconds; got {seconds}")
    return seconds


@dataclass
class Context:
    """What a handler knows about its attempt."""

    task_id: str
    attempt_id: str
    #: which started attempt this is: 1, 2, ... up to max_attempts (released claims,
    #: never started, do not count)
    attempt: int
    handler: str
    queue: str
    tenant: str
    deadline: datetime | None
    attempt_timeout: float | None
    retry_safe: bool = False
    #: the task's max_attempts; None from a server too old to send it
    max_attempts: int | None = None
    #: set once (by the event loop) and read from handler threads: a plain flag is
    #: enough under the GIL, and a threading.Event per attempt was a visible cost
    _stopped: bool = field(default=False, repr=False)
    reason: str | None = None
    #: the worker's progress report (``Worker._report_progress``), given this context
    _report: Callable[[Context, float | None, str | None], None] | None = field(
        default=None, repr=False
    )
    #: the worker's upload (``Worker._upload``), given this attempt's id and ``_fence``
    _upload: Callable[..., Awaitable[dict[str, Any]]] | None = field(default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _fence: str = field(default="", repr=False)

    @property
    def cancelled(self) -> bool:
        """True once the task was cancelled, the lease lost, or the worker is stopping."""
        return self._stopped

    def check(self) -> None:
        """Raise ``Cancelled`` if the attempt must stop (for plain-function handlers)."""
        if self._stopped:
            raise Cancelled(self.reason or "cancelled")

    def progress(self, fraction: float | None = None, message: str | None = None) -> None:
        """Report how far the attempt has got (0..1 and/or a short message). Safe from any
        thread and cheap: reports are coalesced and sent in the background."""
        # Refused here, by name: a message that is no string raised TypeError from deep in
        # the text cleaning ("argument of type 'int' is not iterable"), a fraction that is
        # no number one about '<=', and True was taken for 1.
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
                kind = type(fraction).__name__
                raise TypeError(f"fraction must be a number in [0, 1] or None, not {kind}")
            fraction = float(fraction)  # a numpy float goes out as JSON too
            if not 0.0 <= fraction <= 1.0:
                raise ValueError("fraction must be in [0, 1]")
        if message is not None and not isinstance(message, str):
            raise TypeError(f"message must be a string or None, not {type(message).__name__}")
        if self._report is not None:
            # Cleaned as the server takes a string: a lone surrogate (a file name that is
            # not UTF-8) was refused unread, and its report closed the connection.
            cleaned = None if message is None else outcomes.clean_text(message, 500)
            self._report(self, fraction, cleaned)

    async def upload(
        self,
        name: str,
        data: bytes | Path,
        content_type: str = "application/octet-stream",
        *,
        ttl: int | None = None,
    ) -> dict[str, Any]:
        """Attach an artifact to this attempt (bytes, or a file streamed from disk).
        Returns its metadata: id, size, sha256. Fenced like every report: refused once
        the attempt is no longer ours (an upload cut short by the worker's resume of its
        session, the attempt still its own, is sent again). The bytes' sha256 goes with
        them, so the same bytes uploaded again under the same name (a retry after
        ``Unreachable``, the first upload committed all the same) return the artifact
        stored. ``ttl``: whole seconds, from 1 to ``MAX_ARTIFACT_TTL_S``, or None for the
        server's default."""
        if self._upload is None:
            raise RuntimeError("this context is not attached to a running worker")
        ttl = _check_upload_options(content_type, ttl)
        # Refused before the request: a str path or text failed mid-request with an
        # AttributeError; bytes-like data (bytearray, memoryview) is taken as bytes.
        if not isinstance(data, bytes | Path):
            try:
                data = bytes(memoryview(data))
            except TypeError:
                raise TypeError(
                    f"data must be bytes or a pathlib.Path, not {type(data).__name__}"
                ) from None
        return await self._upload(self.attempt_id, self._fence, name, data, content_type, ttl)

    def upload_from_thread(
        self,
        name: str,
        data: bytes | Path,
        content_type: str = "application/octet-stream",
        *,
        ttl: int | None = None,
        timeout: float = 300.0,
    ) -> dict[str, Any]:
        """``upload`` for a plain-function handler (it runs in a thread of its own)."""
        if self._loop is None:
            raise RuntimeError("this context is not attached to a running worker")
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no loop running here: a handler's thread, as meant
            here = None
        if here is self._loop:
            # Waited for here, the upload could never run: the loop it runs on is this
            # thread's, blocked (every attempt and renewal with it) until the timeout.
            raise RuntimeError("on the event loop, use await ctx.upload(...) instead")
        future = asyncio.run_coroutine_threadsafe(
            self.upload(name, data, content_type, ttl=ttl), self._loop
        )
        try:
            return future.result(timeout)
        except TimeoutError:
            # Given up: left to run, the upload held its connection and its file open on
            # the event loop for as long as the server took.
            future.cancel()
            raise

    def _stop(self, reason: str) -> None:
        if not self._stopped:
            self.reason = reason
            self._stopped = True


@dataclass
class _Registered:
    fn: Handler
    capacity: int
    is_async: bool
    retry_safe: bool | None  # None: the handler accepts tasks either way


@dataclass
class _Running:
    ctx: Context
    fence: str
    task: asyncio.Task[Any] | None = None  # the whole attempt: start, handler, finish
    handler_task: asyncio.Task[Any] | None = None  # just the handler
    #: done once the attempt is over or abandoned: made only for a drain to wait on
    over: asyncio.Future[None] | None = None
    lost: bool = False
    lost_reason: str = ""  # why (``_lose``): said again if a finished outcome is dropped
    #: monotonic instant the claim came (``_accept``): its start is sent again, if the
    #: server could not try it, until CLAIM_STALE_S past this (``Worker._start``)
    claimed: float = 0.0
    abandoned: bool = False  # its handler ignored cancellation: it reports nothing
    watched: bool = False  # an async handler, cancelled: abandoned unless it ends in time
    #: its handler was cancelled once: a later cancel (every renewal says ``cancel`` again)
    #: cut an async handler's cleanup short, and broke a plain function's grace off
    cancelled: bool = False
    #: the server said its task was cancelled (a push, a renewal, a repeated start): any
    #: report now ends the task cancelled, so one is always made (``_stopped``)
    task_cancelled: bool = False
    #: a plain handler that returned a coroutine: it runs on the loop, as an async one
    on_loop: bool = False
    #: the handler is over: progress reported now would reach the server after the finish,
    #: which refuses it (ATTEMPT_ENDED, a rejected report in the task's history)
    ended: bool = False
    lease_expires: float = 0.0  # monotonic deadline of the current lease
    deadline_at: float | None = None  # monotonic instant of the task's deadline
    renew_at: float = 0.0  # monotonic instant its lease is half spent
    pending_progress: tuple[float | None, str | None] | None = None
    sending_progress: bool = False
    #: its finish was answered, with a receipt or a refusal (not one the server could not
    #: try): from the answer on, left out of renewals, which the server refuses
    #: (ATTEMPT_ENDED) with a ``rejected`` event after ``succeeded`` in the task's history
    #: (``_send_finishes`` marks it as the answer arrives, before the attempt's own task
    #: resumes to forget it)
    answered: bool = False
    #: its finish is on its way (``_finish``: queued or sent, not answered yet), and
    #: whether its renewal was put off once for it (``Worker._carried``)
    finishing: bool = False
    finish_deferred: bool = False
    #: done once the renew on its way that carries this attempt is answered and taken
    #: (``_renew_once``): a finish waits for it (``_renewal_settled``), so that a renew
    #: sent before the finish never reaches the server after it
    renewing: asyncio.Future[None] | None = None


_cli_importing: str | None = None
"""The module ``orbit worker`` is importing, while it imports it (set by the CLI): a
``worker.run()`` at the module's top level then ran a hidden worker during the import,
which ignored ``--url``, and the CLI started a second one after it."""


class RunDuringImport(RuntimeError):
    """``run()``/``arun()`` called while ``orbit worker`` imports the worker's module."""


def _refuse_run_during_import() -> None:
    if _cli_importing is not None:
        raise RunDuringImport(
            f"Worker.run() was called while orbit worker imported {_cli_importing}: "
            'put the call under `if __name__ == "__main__":` (orbit worker runs the worker '
            "itself)"
        )


class Worker:
    """Register handlers, then ``run()``. See the module docstring for the guarantees."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        name: str = "worker",
        concurrency: int = 10,
        prefetch: int = 0,
        cafile: str | None = None,
        grace: float = 30.0,
        cancel_grace: float = 5.0,
        renew_interval: float | None = None,
        reconnect_max: float = 5.0,
        request_timeout: float = 30.0,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            # 1.5 passed the bounds below, and the server refused the hello
            raise ValueError(f"concurrency must be a whole number; got {concurrency!r}")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        # Refused here, by the hello's own bounds: the server's refusal of the hello
        # ended the run (``orbit worker`` exited 3) once it had started.
        if concurrency > MAX_WORKER_CONCURRENCY:
            raise ValueError(
                f"concurrency must be at most {MAX_WORKER_CONCURRENCY} "
                "(the most attempts a worker session holds)"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int):
            raise TypeError(f"prefetch must be a whole number; got {prefetch!r}")
        if prefetch < 0:
            raise ValueError("prefetch must be 0 or more")
        if concurrency + prefetch > MAX_WORKER_CONCURRENCY:
            # the hello declares both as the session's slots
            raise ValueError(
                f"concurrency + prefetch must be at most {MAX_WORKER_CONCURRENCY} "
                "(the most attempts a worker session holds)"
            )
        _check_name("name", name)
        # Refused here: request_timeout=0 timed every request out, the hello first, which
        # was retried for ever; renew_interval=0 renewed without a pause.
        for option, value in (
            ("request_timeout", request_timeout),
            ("reconnect_max", reconnect_max),
            ("renew_interval", renew_interval),
        ):
            if value is not None or option != "renew_interval":  # None: the lease's pace
                _check_seconds(option, value, zero=False)
        for option, value in (("grace", grace), ("cancel_grace", cancel_grace)):
            _check_seconds(option, value, zero=True)
        # Refused here, as the clients refuse it: a URL the worker cannot use was tried
        # again and again as if the server were down (credentials in it went as Basic
        # auth in place of the token; one with no scheme could not be opened at all).
        check_server_url(url)
        self.url = url.rstrip("/")
        self.token = token
        self.name = name
        self.concurrency = concurrency
        #: attempts claimed ahead of a free slot: declared to the server on top of
        #: ``concurrency`` (and of each handler's capacity), they wait here claimed, not
        #: started, and start the moment a handler ends (docs/worker.md, "Prefetch")
        self.prefetch = prefetch
        #: with a prefetch: the handlers running (or starting) per handler, the attempts
        #: (by id) that hold a slot (``_busy`` counts them), and those waiting for one in
        #: the order they came, each with the future that says whether it was granted
        #: (True) or dropped unstarted (False). Kept here, not in ``_Running``: an attempt
        #: without a prefetch pays nothing for them.
        self._busy_by: dict[str, int] = {}
        self._holding: set[str] = set()
        #: attempt id -> (attempt, its slot's future, when it began to wait: monotonic)
        self._waiting: dict[str, tuple[_Running, asyncio.Future[bool], float]] = {}
        self._waiting_by: dict[str, int] = {}  # waiting attempts per handler
        check_cafile(cafile)
        self.cafile = cafile
        self.grace = grace
        self.cancel_grace = cancel_grace
        self.renew_interval = renew_interval
        self.reconnect_max = reconnect_max
        #: the reconnect pauses' random source, floats in [0, 1) (``ReconnectBackoff``); a
        #: test sets its own to know the pauses
        self._reconnect_random: Callable[[], float] = random.random
        #: seconds a request waits for its reply before the connection is given up and
        #: the session resumed on a new one (``WorkerConnection.request_timeout``)
        self.request_timeout = request_timeout
        self.handlers: dict[str, _Registered] = {}
        self.running: dict[str, _Running] = {}
        self.abandoned: list[str] = []  # attempts whose handler ignored cancellation
        #: each abandoned attempt's handler: done once its code has ended after all
        self._abandoned_handlers: dict[str, asyncio.Future[Any]] = {}
        #: the abandoned handlers still running when the drain ended: ``run()`` returns 1
        self._stuck: list[str] = []
        #: attempts whose outcome the server had not confirmed when the run ended (a
        #: finish unanswered, the server unreachable): their leases decide
        self.unreported: list[str] = []
        #: seconds the drain waits, after ``cancel_grace``, for the last reports to land
        self._report_grace = 5.0
        self.finished = 0
        self._conn: WorkerConnection | None = None
        self._connected = asyncio.Event()
        self._stop_requested = asyncio.Event()
        #: set once the drain has been asked for (answered, or given up on): an attempt
        #: pushed after the stop is released only then (``_attempt``)
        self._drain_asked = asyncio.Event()
        self._hurry = asyncio.Event()
        self._lease_changed = asyncio.Event()
        #: no live lease's renewal is due before this instant (monotonic): a bound under
        #: every ``renew_at``, lowered as each is set and raised only by a full look
        #: (``_renewal_due``), so a start batch's wake of the renew loop need not look at
        #: every running attempt (1,500 at each batch of a busy worker)
        self._renew_floor = math.inf
        self._stopping = False
        # Whether SIGINT is this run's loop handler (``_run``): a KeyboardInterrupt out
        # of a handler is then the handler's own, not Ctrl-C (``_call``).
        self._sigint_ours = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the running arun()'s
        self._background: set[asyncio.Task[None]] = set()
        #: Fault-test switch: stop sending renewals (leases then run out and are lost).
        self.pause_renewals = False
        self._session: tuple[str, str] | None = None  # (session id, resume secret)
        #: the token the connection was last opened with: after a close for its revoke,
        #: the one in hand while ORBIT_TOKEN_FILE cannot be read (``_connect``)
        self._token_used: str | None = None
        #: the HTTP client of this run's uploads (an ``httpx.AsyncClient``, made by the
        #: first: ``_upload_client``), closed as the run ends
        self._uploads: Any = None
        #: the refusal of our token that ended the run (the token was revoked), raised by
        #: ``arun`` once the handlers are stopped
        self._refused: Exception | None = None
        self._renew_retry = RENEW_RETRY_FIRST  # the wait after the next failed renewal
        self._stall_logged_at = -math.inf  # when a blocked loop was last logged (monotonic)
        # Starts and finishes of concurrent attempts travel in batches (one transaction
        # each on the server); see orbit.worker.batching.
        self._starts: Coalescer[tuple[str, str], dict[str, Any]] = Coalescer(self._send_starts)
        # A finish batch stops before its frame passes what the server reads (the
        # outcomes' sizes are their JSON on the wire; see orbit.worker.outcomes).
        self._finishes: Coalescer[FinishItem, dict[str, Any]] = Coalescer(
            self._send_finishes, max_bytes=outcomes.frame_room(MAX_BATCH)
        )
        self.session_id: str | None = None
        # Each context's hooks (``_accept``): bound once, not once an attempt.
        self._progress_hook = self._report_progress
        self._upload_hook = self._upload

    # ------------------------------------------------------------------ registration

    def handler(
        self, name: str, *, capacity: int | None = None, retry_safe: bool | None = None
    ) -> Callable[[Handler], Handler]:
        """Register ``fn(ctx, payload)`` for a handler name. Async functions run on the
        event loop; plain functions run in a thread of their own (a coroutine one
        returns is then awaited on the event loop, as an async handler).

        ``capacity`` caps this handler's concurrent attempts. ``retry_safe=False`` declares
        that the handler has effects that must not be replayed: a task submitted as
        ``retry_safe`` (which Orbit would replay after a lost lease) is then refused with a
        non-retryable ``RETRY_SAFETY_MISMATCH`` instead of being run.
        """

        # Refused here: 0 was taken for "no cap" (the worker's concurrency), and a
        # negative one went to the server, whose refusal of the hello ended the run.
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
            raise ValueError(f"handler {name}: capacity must be a whole number; got {capacity!r}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"handler {name}: capacity must be at least 1")
        # As the hello takes them: refused by the server, they ended the run.
        if capacity is not None and capacity > MAX_HANDLER_CAPACITY:
            raise ValueError(f"handler {name}: capacity must be at most {MAX_HANDLER_CAPACITY}")
        _check_name("handler name", name)
        # Anything else was taken: ``retry_safe=0`` (or "false" from a config file) then
        # passed the guard ``is False``, and a replayable task ran a handler meant never
        # to be replayed.
        if retry_safe is not None and not isinstance(retry_safe, bool):
            raise TypeError(
                f"handler {name}: retry_safe must be True, False or None; got {retry_safe!r}"
            )

        def register(fn: Handler) -> Handler:
            _check_handler(name, fn)
            if name in self.handlers:
                raise ValueError(f"handler {name} is registered twice")
            if len(self.handlers) >= MAX_WORKER_HANDLERS:
                raise ValueError(
                    f"handler {name}: a worker serves at most {MAX_WORKER_HANDLERS} handlers "
                    "(the most one hello declares); run another worker for the rest"
                )
            self.handlers[name] = _Registered(
                fn, capacity or self.concurrency, _is_async(fn), retry_safe
            )
            return fn

        return register

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        """Run until SIGTERM/SIGINT, then drain. Returns 0, or 1 if an attempt was left
        without a confirmed outcome (its handler abandoned and still running when the
        drain ended, or its finish unanswered).
        In the main thread it owns the process: it installs SIGTERM/SIGINT handlers and
        tunes the garbage collector (``orbit.gctune``). In another thread (a worker run
        beside an application) it does neither: only the main thread may install
        handlers, the application ends the run with ``stop()``, and its collector keeps
        its own settings (``gc.freeze`` would freeze every object it holds). Inside a
        running event loop (Jupyter, an async application) it is a RuntimeError that
        says to ``await arun()``: asyncio refused the second loop, and the coroutine made
        for it was reported never awaited."""
        _refuse_run_during_import()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop running in this thread: run() makes its own
        else:
            raise RuntimeError(
                "Worker.run() was called inside a running event loop: "
                "use `await worker.arun()` there"
            )
        main = threading.current_thread() is threading.main_thread()
        if main:
            tune_for_throughput()
        # An abandoned async handler's task never ends: the loop closes without it rather
        # than wait for it for ever (as asyncio.run would).
        return aio.run(self.arun(install_signals=main), leftovers=1.0)

    async def arun(self, *, install_signals: bool = False) -> int:
        _refuse_run_during_import()
        if not self.handlers:
            raise ValueError("register at least one handler before running")
        # Fresh events for this loop; a stop() asked for before this run is kept (it was
        # once dropped with the old event, and the worker then ran until signalled).
        self._connected = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._drain_asked = asyncio.Event()
        self._hurry = asyncio.Event()  # stop(now=True): the grace is over
        self._lease_changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # A session of its own: the last run's was drained, for good, and resumed it was
        # offered no work again. Its abandoned and unreported attempts are its own too.
        self._session = self.session_id = None
        self._refused = None
        self.abandoned, self.unreported = [], []
        self._abandoned_handlers, self._stuck = {}, []
        # The prefetch's books start empty too: an attempt a last run left hung (a handler
        # that ignored its cancel) must not hold one of this run's slots.
        self._busy_by, self._holding = {}, set()
        self._waiting, self._waiting_by = {}, {}
        try:
            if self._stopping:
                log.info("stopped before it started: not connecting")
                return 0
            return await self._run(install_signals)
        finally:
            # The loop first: an upload begun while the client closes makes one of its own.
            self._loop = None
            if self._uploads is not None:
                uploads, self._uploads = self._uploads, None
                with contextlib.suppress(Exception):  # its connections, closed or not
                    await uploads.aclose()
            self._stopping = False  # this run is over; the next one starts afresh

    async def _run(self, install_signals: bool) -> int:
        if not install_signals:
            return await self._serve()
        loop = asyncio.get_running_loop()
        handlers = {signal.SIGTERM: self.stop, signal.SIGINT: self._interrupted}
        # The loop is the caller's (``arun``): a handler the caller had put on it is put
        # back when the run ends (it was removed, and the caller's Ctrl-C then did
        # nothing); ours, left installed, sent a later Ctrl-C to this finished worker.
        # Without one, the process's own handler is put back: ``asyncio.run``'s for SIGINT
        # (which cancels its main task) became Python's, a KeyboardInterrupt anywhere.
        before: dict[signal.Signals, tuple[Callable[..., object], tuple[Any, ...]] | None] = {}
        python_level = {sig: signal.getsignal(sig) for sig in handlers}
        for sig, handler in handlers.items():
            found = _loop_signal_handler(loop, sig)
            if found is False:
                # uvloop keeps its handlers out of reach: one the caller put there could
                # not be put back, so it is left alone and the caller's stays in charge.
                log.info("%s already has a handler on this loop: left to it", sig.name)
                continue
            before[sig] = found
            loop.add_signal_handler(sig, handler)
        self._sigint_ours = signal.SIGINT in before
        try:
            return await self._serve()
        finally:
            self._sigint_ours = False
            for installed, previous in before.items():
                loop.remove_signal_handler(installed)
                if previous is not None:
                    loop.add_signal_handler(installed, previous[0], *previous[1])
                elif python_level[installed] is not None:  # None: not set from Python
                    signal.signal(installed, python_level[installed])

    def _interrupted(self) -> None:
        """SIGINT: the first drains, as SIGTERM does; a second one (Ctrl-C pressed again)
        cuts the grace short, as ``orbit server`` stops at once on a second Ctrl-C."""
        self.stop(now=self._stopping)

    async def _serve(self) -> int:
        """The run itself, apart from ``_run``, which installs the signals around it."""
        # A stop() while the first connection is still being made (a server that is down
        # is retried for ever) ends the run there.
        connecting = asyncio.create_task(self._connect(first=True), name="connect")
        stopped = asyncio.create_task(self._stop_requested.wait(), name="stopped")
        try:
            await asyncio.wait((connecting, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await stop_tasks([stopped])
            if not connecting.done():
                await stop_tasks([connecting])
        if connecting.cancelled():
            log.info("stopped before connecting")
            return 0
        connecting.result()  # the first connection's fatal errors (bad credentials)
        loops = [
            asyncio.create_task(self._renew_loop(), name="renew"),
            asyncio.create_task(self._read_loop(), name="read"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        try:
            await self._stop_requested.wait()
            if self._refused is None:
                await self._drain()
            # else: no report can reach the server, so none is waited for; the handlers
            # are cancelled at once (``_give_up_reports``)
        finally:
            await self._give_up_reports()
            await stop_tasks(loops)
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    await self._conn.close()
        if self._refused is not None:
            raise self._refused
        return 1 if self._stuck or self.unreported else 0

    async def _give_up_reports(self) -> None:
        """The attempts still here once the drain is over had their handler end (or
        abandoned) but no outcome confirmed: say so, and end their tasks. Left running,
        each waited for a connection for ever, in the caller's loop under ``arun()``;
        and the worker exited 0 as if every result had landed."""
        # Waiting for a slot, never started: nothing to report. Dropped as lost (no
        # release can reach the server now), their claims are the server's to give back.
        dropped = set(self._waiting)
        for r, _, _ in list(self._waiting.values()):
            self._lose(r, "worker stopped")
        left = [
            r for r in self.running.values() if not r.abandoned and r.ctx.attempt_id not in dropped
        ]
        for r in left:
            log.error(
                "attempt %s (task %s) ended without its outcome confirmed by the server; "
                "its lease decides what becomes of the task",
                r.ctx.attempt_id,
                r.ctx.task_id,
            )
            self.unreported.append(r.ctx.attempt_id)
        tasks = [r.task for r in left if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.cancel_grace + 1.0)
        # Their reports' senders too (one waits for a connection that will not come).
        await self._starts.stop()
        await self._finishes.stop()

    def stop(self, *, now: bool = False) -> None:
        """Ask the worker to drain and exit (what SIGTERM and SIGINT do). Safe from any
        thread: from one other than the worker's, an asyncio.Event set directly woke
        nothing, and the run went on until something else woke its loop.

        ``now=True`` (what a second SIGINT does) skips what is left of ``grace``: running
        handlers are cancelled at once, and the drain goes on as when ``grace`` runs out."""
        if now:
            log.warning("stopping now: running handlers are cancelled")
        else:
            log.info("stopping: draining")
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if here is not loop:
                with contextlib.suppress(RuntimeError):  # closed meanwhile: the run is over
                    loop.call_soon_threadsafe(self._stop_events, now)
                return
        self._stop_events(now)

    def _stop_events(self, now: bool) -> None:
        self._stop_requested.set()
        if now:
            self._hurry.set()

    # ------------------------------------------------------------------ connection

    def _ws_url(self) -> str:
        base = self.url.replace("https://", "wss://").replace("http://", "ws://")
        return f"{base}/v1/worker"

    async def _connect(self, *, first: bool = False, revoked: bool = False) -> None:
        """Connect and hello (first time) or resume; retry with backoff until it works.
        A refusal of our credentials (HTTP 401 or 403, or no token to read) is raised
        rather than retried on the first connection, and on the one after the server
        closed ours because its token was revoked (``revoked``) when that token cannot
        change (``token=`` or ORBIT_TOKEN: ``_token_in_file``). On any other reconnect
        a refused token is raised once it has been refused ``REFUSALS_TO_STOP`` times,
        with no refusal of another token between (failures of another kind between do
        not matter), and is still the token read after the pause that follows
        (``REFUSALS_TO_STOP``). After a 4401 for a token read from ORBIT_TOKEN_FILE, the
        end is ROTATION_WAIT_S after the close instead, and a try for which the file
        cannot be read is waited out too, of the token in hand (the revoked one, or the
        last one read), ending the run with its TokenError when the file still cannot
        be read then."""
        self._connected.clear()
        # The first try is made at once (a lone worker that lost its connection is back
        # without a pause); each failed one is followed by a pause (ReconnectBackoff).
        backoff = ReconnectBackoff(self.reconnect_max, self._reconnect_random)
        caps = {name: self._declared_capacity(name) for name in self.handlers}
        refused_token: str | None = None  # the token the last refusal was of
        refusals = 0  # how many times it was refused since another token last was
        # A revoked token read from ORBIT_TOKEN_FILE waits for its replacement there, as
        # after any other drop: a rotation done in the other order (revoked, then the
        # new token written) ended the run, and a running task that is not retry_safe
        # went to needs_review.
        rotating = revoked and self._token_in_file()
        rotation_ends = time.monotonic() + ROTATION_WAIT_S  # when ``rotating``
        held = self._token_used  # the token in hand: the last one read
        while True:
            conn: WorkerConnection | None = None
            token: str | None = None
            try:
                # Read at every try: a token rotated in ORBIT_TOKEN_FILE is taken up by
                # the next reconnect, without a restart.
                token = held = self._token()
                conn = await WorkerConnection.connect(self._ws_url(), token, cafile=self.cafile)
                conn.request_timeout = self.request_timeout
                if self._session is None:
                    await conn.hello(self.name, caps, self._declared_slots)
                    assert conn.session_id and conn.resume_secret
                    self._session = (conn.session_id, conn.resume_secret)
                    self.session_id = conn.session_id
                    # Said once it holds: a worker that printed nothing until it stopped
                    # could not be told from one stuck connecting.
                    log.info(
                        "connected as session %s, handlers: %s",
                        conn.session_id,
                        ", ".join(f"{n} ({c})" for n, c in caps.items()),
                    )
                else:
                    try:
                        await conn.resume(*self._session)
                    except ServerError as exc:
                        if exc.code in RESUME_NOT_TRIED and any(
                            self._lease_valid(r) for r in self.running.values()
                        ):
                            # Retried below like a failed connect; meanwhile each running
                            # attempt keeps its lease until it runs out by this host's
                            # clock (the renew loop's check), and then it is lost.
                            raise
                        log.warning("resume refused (%s); starting a new session", exc.code)
                        for running in self.running.values():
                            self._lose(running, "session lost")
                        self._session = None
                        await conn.close()
                        continue
                    log.info("resumed session %s", self._session[0])
                if self._stopping:
                    # After a resume, and after the hello of a session made anew (the
                    # resume refused): undrained, the server pushed it tasks to release.
                    await conn.drain()
                self._conn = conn
                self._token_used = token
                self._connected.set()
                return
            except asyncio.CancelledError:
                if conn is not None:
                    conn.abort()  # not the closing handshake: the cancel is to end now
                raise
            except Exception as exc:  # the network, the server's refusal, the handshake
                await _close_quietly(conn)
                # Only a refusal of our credentials is final, and only on the first
                # connection: a hello the server refused, or HTTP 401/403 by its status
                # code (once read as "40" in the message: a 404 ended the worker, and any
                # message with "40" in it would have). A 500 or 503 is a server or proxy
                # that is not ready yet: retried. No token to read is final on the first
                # connection too. After a close for a revoked token (4401), a refusal is
                # final as well when the token cannot change (``token=``, ORBIT_TOKEN):
                # retrying it for ever would leave the worker holding a session it can
                # never use again. After any other drop, and after a 4401 for a token
                # read from ORBIT_TOKEN_FILE (``rotating``: its replacement may be
                # written just after the revoke), a refusal is final once the same token
                # is refused twice (below).
                status = exc.response.status_code if isinstance(exc, InvalidStatus) else None
                bad_token = isinstance(exc, TokenError)
                refused = bad_token or status in (401, 403)
                not_tried = isinstance(exc, ServerError) and exc.code in SERVER_NOT_TRIED
                if (
                    first
                    and isinstance(exc, ServerError | ssl.SSLCertVerificationError)
                    and not not_tried
                ):
                    # The server's refusal of the hello, or a certificate the CAs do not
                    # vouch for (a wrong cafile, an expired certificate, another host's):
                    # a worker set up wrong, which no retry mends, as the clients judge it.
                    # A hello the server could not try (SERVER_NOT_TRIED: its database
                    # refusing writes) is retried below like a failed connect.
                    raise
                if (first or (revoked and not rotating)) and refused:
                    raise
                unreadable = bad_token and rotating
                if status in (401, 403) or unreadable:
                    # Refused after a drop that was no 4401 (a network failure, a server
                    # restart: the token may have been revoked meanwhile, and this worker
                    # never heard the close that says so), or after a 4401 for a token
                    # read from ORBIT_TOKEN_FILE. A new token read now is tried at once;
                    # the same one again after a pause, and the run ends once it has been
                    # refused REFUSALS_TO_STOP times (failures of another kind between are
                    # no refusal, and reset nothing), or after a 4401 once ROTATION_WAIT_S
                    # has passed, and the pause after the last brought no other. After a
                    # 4401 the file that cannot be read (being rewritten, or left open to
                    # group or others) brought no token to try in place of the one in
                    # hand: a refusal of that one, so a file never made usable ends the
                    # run as a token never replaced does.
                    if unreadable:
                        token = held
                    refusals = refusals + 1 if token == refused_token else 1
                    refused_token = token
                    why = (
                        f"no token to reconnect with ({exc})"
                        if unreadable
                        else f"connect refused: HTTP {status}"
                    )
                    now = self._token_now()
                    if now is not None and now != token:
                        log.error("%s; trying the token read again", why)
                        continue
                    delay = backoff.pause()
                    if rotating:  # the file's rotation has ROTATION_WAIT_S in all
                        delay = min(delay, max(rotation_ends - time.monotonic(), 0.0))
                        last = time.monotonic() + delay >= rotation_ends
                    else:
                        last = refusals >= REFUSALS_TO_STOP
                    log.error(
                        "%s; %s",
                        why if unreadable else f"{why} (bad credentials?)",
                        f"stopping in {delay:.1f}s unless the token is replaced"
                        if last
                        else f"retrying in {delay:.1f}s",
                    )
                    await asyncio.sleep(delay)
                    now = self._token_now()
                    if last and (now == token or (unreadable and now is None)):
                        raise
                    continue
                # A proxy or balancer in front whose nodes are away (503), or that limits
                # the rate of connections (429), may say when to come back: retried at
                # the back-off's pace instead, it spent on refusals the load it was
                # shedding. Orbit's worker endpoint answers 503 too, with the database's
                # code (DATABASE_BUSY, …), while its token check cannot read the database.
                retry_after = _retry_after(exc)
                delay = self._lease_bound(backoff.pause(retry_after))
                if bad_token:
                    log.error("no token to reconnect with (%s); retrying", exc)
                else:
                    log.warning(
                        "connect failed (%s%s); retrying in %.1fs",
                        _failure_name(exc),
                        "" if retry_after is None else f", Retry-After {retry_after:g}",
                        delay,
                    )
                await asyncio.sleep(delay)

    def _lease_bound(self, pause: float) -> float:
        """``pause`` cut to half of what is left of the soonest lease still held (never
        under ``RECONNECT_LEASE_FLOOR_S``): a node back before the lease runs out is
        reached in time to renew it and to send the results waiting for it. A lease
        beats a server's ``Retry-After``: a try refused again costs one request, an
        attempt lost costs its work."""
        now = time.monotonic()
        left = [
            r.lease_expires - now
            for r in self.running.values()
            if not r.lost and r.lease_expires > now
        ]
        if not left:
            return pause
        return min(pause, max(min(left) / 2, RECONNECT_LEASE_FLOOR_S))

    def _token_in_file(self) -> bool:
        """Whether the token is read from ORBIT_TOKEN_FILE: no ``token=`` and no
        ORBIT_TOKEN, which ``load_token`` takes first. Only such a token can be replaced
        under a running worker (the others stay what they were at the start), so only
        then is a close for a revoked token (4401) waited out (``_connect``)."""
        return (
            self.token is None
            and "ORBIT_TOKEN" not in os.environ
            and "ORBIT_TOKEN_FILE" in os.environ
        )

    def _token_now(self) -> str | None:
        """The token as read now, or None if it cannot be read (a file being rewritten,
        say): that is no new token to try at once, nor, after a drop that was no 4401,
        the refused one to give up on, and the next try reads it again (after a 4401 for
        a file's token, no token to read is a refusal in turn: ``_connect``)."""
        try:
            return self._token()
        except TokenError:
            return None

    async def _read_loop(self) -> None:
        while True:
            assert self._conn is not None
            # No timeout: an idle worker may hear nothing for hours (a timeout here once
            # ended this loop after an idle hour, and the worker never heard a push again).
            msg = await self._conn.next_push(timeout=None)
            kind = msg.get("type")
            if kind == "closed":
                if self._stopping and not self.running:
                    return
                revoked = msg.get("code") == REVOKED_CLOSE
                if revoked:
                    log.error(
                        "the server closed the connection: its token was revoked (%s %s); %s",
                        REVOKED_CLOSE,
                        msg.get("reason"),
                        "reconnecting with the token read again from ORBIT_TOKEN_FILE"
                        if self._token_in_file()
                        else "reconnecting once with the token read again",
                    )
                try:
                    await self._connect(revoked=revoked)
                except (InvalidStatus, TokenError) as exc:
                    log.error(
                        "the token is refused (%s): stopping; the %d running attempt(s) are "
                        "left to their leases",
                        f"HTTP {exc.response.status_code}"
                        if isinstance(exc, InvalidStatus)
                        else exc,
                        len(self.running),
                    )
                    self._refused = exc
                    self._stop_requested.set()
                    return
                continue
            try:
                self._on_push(msg)
            except Exception:
                # One message this runner cannot use must not end the loop: with it ended,
                # the worker heard no task, no cancel and no close again.
                log.exception("could not handle a pushed %r message; ignoring it", kind)

    def _on_push(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "tasks":
            for assignment in msg["tasks"]:
                try:
                    self._accept(assignment)
                except Exception:
                    log.exception("could not accept a pushed task; ignoring it")
        elif kind == "cancel":
            for attempt_id in msg["attempt_ids"]:
                running = self.running.get(attempt_id)
                if running is not None:
                    self._cancel_task(running)
        elif kind == "drain":
            self._drained_by_server()
        elif kind == "error":
            # A request the server refused unread (not JSON, too large, a req_id it could
            # not take): it cannot say which, and that request times out. Said here, or
            # all one saw was the timeout and a new connection.
            log.warning(
                "the server refused a request it could not read: %s: %s",
                msg.get("code"),
                msg.get("message"),
            )

    def _drained_by_server(self) -> None:
        """The server pushed ``drain``: the session was drained by an operator
        (``POST /v1/workers/{id}/drain``, ``orbit worker drain``), and is offered no more
        work. Taken as the worker's own graceful stop (SIGTERM): the running attempts
        finish, then the run ends. Ignored, the worker heartbeated an idle session for
        ever, and nothing said why it got no more tasks."""
        if self._stopping:
            return  # already draining: a repeat, or the push after a resume
        # With a prefetch, the attempts waiting for a slot (claimed, not started) are given
        # back by the drain, not finished: they were once counted with the running ones.
        waiting = len(self._waiting)
        log.info(
            "drained by the server (an operator's drain): no new tasks; stopping once the "
            "%d running attempt(s) finish%s",
            len(self.running) - waiting,
            f"; giving back the {waiting} waiting (claimed, not started)" if waiting else "",
        )
        self._stopping = True
        self._stop_events(False)

    async def _request(self, call: Callable[[WorkerConnection], Awaitable[Any]]) -> Any:
        """Run a request, riding over reconnects: wait for a live connection, retry once it
        is back. A ServerError is an answer, not a transport failure: it propagates."""
        while True:
            await self._connected.wait()
            conn = self._conn
            assert conn is not None
            try:
                return await call(conn)
            except (TimeoutError, ConnectionError, OSError):
                if self._conn is conn:
                    self._connected.clear()
                await asyncio.sleep(0.05)

    async def _send_starts(
        self, items: list[tuple[str, str]]
    ) -> list[dict[str, Any] | BaseException]:
        if len(items) == 1:  # a lone report travels as the plain message
            ((attempt_id, fence),) = items
            try:
                return [await self._request(lambda c: c.start(attempt_id, fence))]
            except ServerError as exc:
                return [exc]
        results = await self._request(lambda c: c.start_many(items))
        return _items(results, "lease")

    async def _send_finishes(self, items: list[FinishItem]) -> list[dict[str, Any] | BaseException]:
        """Send a batch of finishes, each for the first time: only those whose lease is
        still ours once the connection is up. A finish queued while the connection was
        down was sent after the reconnect however long that took, and the server
        refused it (``ATTEMPT_ENDED``, a ``rejected`` event) after the runner had logged
        the attempt lost and its outcome unreported. (A finish whose reply was lost is
        sent again inside ``_request``, whatever its lease: that copy may have landed.)"""
        await self._connected.wait()
        # An attempt no longer known here is left to the server to judge
        running = self.running
        lapsed = {
            a
            for a, _, _, _ in items
            if (r := running.get(a)) is not None and not self._lease_valid(r)
        }
        if not lapsed:
            return self._answered(items, await self._send_finish_items(items))
        sendable = [item for item in items if item[0] not in lapsed]
        answers = iter(await self._send_finish_items(sendable) if sendable else [])
        return self._answered(
            items, [_LeaseLapsed() if item[0] in lapsed else next(answers) for item in items]
        )

    def _answered(
        self, items: list[FinishItem], answers: list[dict[str, Any] | BaseException]
    ) -> list[dict[str, Any] | BaseException]:
        """Mark each attempt whose finish the server answered (a receipt, or a refusal it
        did try) as ``answered``, as the answer arrives: the renew loop may run before the
        attempts' own tasks resume to forget them, and renewed them after their finish."""
        for (attempt_id, _, _, _), answer in zip(items, answers, strict=True):
            if isinstance(answer, ServerError) and answer.code in FINISH_NOT_TRIED:
                continue  # sent again: its lease is still renewed
            if isinstance(answer, dict | ServerError) and (r := self.running.get(attempt_id)):
                r.answered = True
        return answers

    async def _send_finish_items(
        self, items: list[FinishItem]
    ) -> list[dict[str, Any] | BaseException]:
        if len(items) == 1:
            ((attempt_id, fence, report, _),) = items
            try:
                return [await self._request(lambda c: c.finish_report(attempt_id, fence, report))]
            except ServerError as exc:
                return [exc]
        results = await self._request(lambda c: c.finish_flagged(items))
        return _items(results, "receipt")

    def _lease_valid(self, running: _Running) -> bool:
        return not running.lost and time.monotonic() < running.lease_expires

    # ------------------------------------------------------------------ attempts

    def _accept(self, a: dict[str, Any]) -> None:
        # Positional, in the fields' order (tests/unit/test_worker_handler_task.py holds it to
        # the keywords): a call of a dataclass's __init__ by keywords took twice as long,
        # 1.6 µs of these two, a task.
        used = a.get("attempts_used")
        ctx = Context(
            a["task_id"],
            a["attempt_id"],
            # Which started attempt this is (1, 2, ...): the wire's ``attempt`` counts
            # claims, released ones too, so a task with max_attempts=1 saw attempt=3. A
            # server too old to send attempts_used leaves the claim's number.
            int(a["attempt"]) if used is None else int(used) + 1,
            a["handler"],
            a["queue"],
            a["tenant"],
            datetime.fromisoformat(a["deadline"]) if a["deadline"] else None,
            a["attempt_timeout"],
            bool(a["retry_safe"]),
            a.get("max_attempts"),
        )
        running = _Running(ctx, a["fence"])
        running.claimed = time.monotonic()
        if a.get("deadline_left") is not None:  # the server's clock, not this host's
            running.deadline_at = time.monotonic() + a["deadline_left"]
        # The context reaches its attempt's state through the worker's methods, by its
        # attempt's id (and fence, for uploads): a strong reference back to ``running``
        # made every attempt a reference cycle (with its tasks and coroutines), which only
        # the garbage collector frees (a quarter of a busy worker's CPU); and a weak
        # reference, a closure and a partial made for each attempt were a few more.
        loop = ctx._loop = asyncio.get_running_loop()
        ctx._report = self._progress_hook
        ctx._upload = self._upload_hook
        ctx._fence = running.fence
        self.running[ctx.attempt_id] = running
        # Each call spelled out: a bound method picked first was one more object a task.
        if self.prefetch:
            running.task = loop.create_task(self._prefetched(running, a["payload"]))
        else:
            running.task = loop.create_task(self._attempt(running, a["payload"]))

    async def _attempt(self, running: _Running, payload: Any) -> None:
        ctx = running.ctx
        try:
            if self._stopping or ctx.handler not in self.handlers:
                if self._stopping:
                    # Pushed after the stop: given back once the session is draining.
                    # Released before, its task was claimed again for this session (not
                    # draining yet) and pushed back here, to be released a second time.
                    await self._drain_asked.wait()
                await self._request(lambda c: c.release(ctx.attempt_id, running.fence))
                return
            started = await self._start(running)
            if started is None:
                return
            lease, sent = started
            self._set_lease(running, lease, sent)
            if not self._lease_valid(running):
                # Its start was answered, but taken only after the lease had run out by
                # this host's clock (the event loop blocked meanwhile): the handler is not
                # begun, as its outcome could never be reported. (It ran all the same,
                # and its result was dropped: work, and effects perhaps, for nothing.)
                self._lose(running, "lease expired before the handler began")
                return
            self._lease_changed.set()
            if lease.get("status") == "cancel":  # a repeated start, after a cancel
                self._cancel_task(running)
            report = await self._invoke(running, payload)
            running.ended = True  # progress still pending is dropped, not sent after it
            if self.prefetch:
                # The next waiting attempt starts now, while this one's finish travels.
                self._free_slot(running)
            if report is None:
                return  # nothing to report: lost, abandoned or stopped (see _invoke)
            # A renew already on its way with it is answered first (it may say the lease
            # is lost): sent before the finish, it could reach the server after it.
            await self._renewal_settled(running)
            if not self._lease_valid(running):
                # The attempt is no longer ours (by the server's word or our own clock):
                # its result is never sent, but never silently either.
                _log_dropped(running)
                return
            report, size, plain = _sendable(report, ctx)
            # Sent while the lease is ours. If the reply is lost, the same outcome is
            # re-sent after a reconnect: the server answers with the original receipt,
            # or refuses a copy that arrived too late (and keeps it as evidence).
            item = (ctx.attempt_id, running.fence, outcome_wire(report), plain)
            if await self._finish(running, item, size):
                self.finished += 1
        except ServerError as exc:
            log.warning("release of %s refused: %s", ctx.attempt_id, exc.code)
        except Exception:
            # Never silent: an attempt task's error was otherwise seen by no one (its lease
            # then runs out, and the server decides what becomes of the task).
            log.exception("attempt %s failed in the runner", ctx.attempt_id)
        finally:
            self._forget(running)

    async def _start(self, running: _Running) -> tuple[dict[str, Any], float] | None:
        """Send ``running``'s start; its lease and when the start answered was sent, or
        None if it was refused (the attempt is then over here).

        A start the server could not try (``START_NOT_TRIED``, for this attempt or for
        the whole ``start_many`` it went in: either reaches ``submit`` as ServerError) is
        sent again after the finish's back-off while the claim lasts and the worker is
        not stopping; a copy whose first did commit is answered with the same lease. Past
        that the claim is released, as a paused queue's is, so that the task is claimed
        again at once rather than after its claim lease (a release refused, the start
        having committed after all, is left to the lease). Other refusals end it."""
        ctx = running.ctx
        claim_ends = running.claimed + CLAIM_STALE_S
        resends = _Resends()
        while True:
            sent = time.monotonic()
            try:
                return await self._starts.submit((ctx.attempt_id, running.fence)), sent
            except ServerError as exc:
                code = exc.code
                if code in START_NOT_TRIED and self._may_resend_start(running, claim_ends):
                    wait = resends.next(claim_ends)
                    log.warning(
                        "start of %s answered %s (%s); sending it again in %.2fs",
                        ctx.attempt_id,
                        code,
                        exc.message,
                        wait,
                    )
                    await asyncio.sleep(wait)
                    if self._may_resend_start(running, claim_ends):
                        continue
                log.info("start of %s refused: %s", ctx.attempt_id, code)
                if code == "QUEUE_PAUSED" or code in START_NOT_TRIED:
                    with contextlib.suppress(ServerError):
                        await self._request(lambda c: c.release(ctx.attempt_id, running.fence))
                return None

    def _may_resend_start(self, running: _Running, claim_ends: float) -> bool:
        """Whether a start the server could not try is sent again: its claim still ours
        by this host's clock, and the worker not stopping (a stopping one releases it)."""
        return not self._stopping and not running.lost and time.monotonic() < claim_ends

    async def _finish(self, running: _Running, item: FinishItem, size: int) -> bool:
        """Send ``running``'s finish; whether the server took it (a receipt).

        A finish the server could not try (``FINISH_NOT_TRIED``: its database failed the
        transaction, or was out of reach past the pool's wait) was logged and dropped: the
        attempt was forgotten, its lease ran out, and a task that is not ``retry_safe``
        went to ``needs_review`` although its handler had finished. It is sent again, the
        very same outcome (a copy that did commit is answered with its receipt: same
        digest), after a back-off, for as long as the lease is ours by this host's clock.
        The attempt stays in ``running`` meanwhile, so the renew loop keeps its lease."""
        attempt_id = running.ctx.attempt_id
        resends = _Resends()
        while True:
            running.finishing, running.finish_deferred = True, False
            try:
                await self._finishes.submit(item, size=size)
                return True
            except _LeaseLapsed:
                _log_dropped(running)  # its lease ran out while it waited to be sent
                return False
            except ServerError as exc:
                if exc.code not in FINISH_NOT_TRIED or not self._lease_valid(running):
                    log.warning("finish of %s refused: %s", attempt_id, exc.code)
                    return False
                wait = resends.next(running.lease_expires)
                log.warning(
                    "finish of %s answered %s (%s); sending it again in %.2fs",
                    attempt_id,
                    exc.code,
                    exc.message,
                    wait,
                )
            finally:
                running.finishing = False
            await asyncio.sleep(wait)  # its lease is renewed meanwhile
            await self._renewal_settled(running)
            if not self._lease_valid(running):
                log.warning("finish of %s given up: its lease is no longer ours", attempt_id)
                return False

    async def _renewal_settled(self, running: _Running) -> None:
        """Wait until no renew carrying ``running`` is on its way (answered and taken):
        its finish is sent after that."""
        # Again after each: the renew loop may send another carrying it before this
        # task resumes from the last one's answer.
        while (renewing := running.renewing) is not None and not renewing.done():
            await asyncio.wait((renewing,))

    def _forget(self, running: _Running) -> None:
        """The attempt is over, or abandoned: no renewal, drain or progress report is
        for it any more."""
        running.ended = True  # a thread that outlived it reports nothing more
        self.running.pop(running.ctx.attempt_id, None)
        if running.over is not None and not running.over.done():
            running.over.set_result(None)

    async def _invoke(self, running: _Running, payload: Any) -> dict[str, Any] | None:
        """Run the handler; return the outcome to report, or None to report nothing."""
        ctx = running.ctx
        reg = self.handlers[ctx.handler]
        if reg.retry_safe is False and ctx.retry_safe:
            return outcomes.error(
                "RETRY_SAFETY_MISMATCH",
                f"handler {ctx.handler} has effects that must not be replayed, but "
                "the task was submitted as retry_safe",
                retryable=False,
            )
        limit, by_deadline = self._time_limit(running)
        # The loop's create_task, as asyncio.create_task calls it, without that wrapper's
        # Python frame (a task an attempt).
        loop = asyncio.get_running_loop()
        task = running.handler_task = loop.create_task(self._call(running, reg, payload))
        if ctx.cancelled:
            # Cancelled (a cancel pushed, a drain past its grace) while the start was in
            # flight, when there was no handler task to cancel: the handler sees it now,
            # as it would a cancel just after it began (``call_soon``: after its first
            # step, so that the function is entered and gets CancelledError inside).
            loop.call_soon(self._cancel, running, ctx.reason or "cancelled")
        # Not wait_for: it raises the same TimeoutError for its limit and for a handler
        # that raised one itself, and a handler's own TimeoutError (a call of its that
        # timed out) is its failure, not the attempt's timeout. Not asyncio.wait either,
        # though it waits the same way: for one task it built three sets, two coroutines
        # and a closure, a tenth of a busy worker's CPU (``_ended_or_timed_out``).
        try:
            await _ended_or_timed_out(task, limit)
        except asyncio.CancelledError:
            # This attempt's own task: cancelled because its handler was abandoned (see
            # _abandon_if_running), or by the event loop's close.
            task.cancel()
            if not running.abandoned:
                await asyncio.wait((task,))
            raise
        if not task.done():
            ctx._stop("attempt timeout")
            running.cancelled = True  # a cancel heard meanwhile must not cut its grace
            task.cancel()
            if reg.is_async or running.on_loop:
                ended, _ = await asyncio.wait((task,), timeout=self.cancel_grace)
                if not ended:
                    self._abandon(running, task)
            else:
                await asyncio.wait((task,))  # a plain function: cancel_grace at most
            if by_deadline:
                return None  # past the deadline the server refuses any report
            if ctx.reason == STOPPING:
                # The drain had stopped it part way before the limit came: the drain's
                # rule decides (a task that is not retry_safe is left to its lease).
                return _failure(running, asyncio.CancelledError())
            return _timed_out(running)
        # What the handler ended with is reported, a cancel of its task or not: the server
        # ends a cancelled task cancelled whatever it is told, and keeps the outcome as
        # evidence (DESIGN: finish while cancelling). An async handler that caught the
        # cancel and finished an irreversible step says so in what it returns.
        try:
            return {"result": task.result()}
        except (asyncio.CancelledError, Exception) as exc:
            try:
                return _failure(running, exc)
            except Exception:
                # An exception whose outcome cannot be made (a code property that
                # raises, ...) still fails the attempt: it reported nothing, for ever.
                log.exception("attempt %s: its failure's outcome cannot be made", ctx.attempt_id)
                kind = _text(type(exc).__name__)
                message = f"the handler raised {kind}, whose outcome cannot be made"
                return outcomes.error("", message, retryable=not isinstance(exc, Fail))

    def _time_limit(self, running: _Running) -> tuple[float | None, bool]:
        """Seconds the handler may run: its attempt timeout or the task deadline, timed
        from the server's ``deadline_left`` on this host's monotonic clock."""
        limit = running.ctx.attempt_timeout
        if running.deadline_at is not None:
            left = running.deadline_at - time.monotonic()
            if limit is None or left < limit:
                return max(left, 0.0), True
        return limit, False

    async def _call(self, running: _Running, reg: _Registered, payload: Any) -> Any:
        try:
            if not reg.is_async:
                value = await self._in_thread(running, reg.fn, payload)
                if not isinstance(value, CoroutineType):
                    return value
                # A plain function that returned a coroutine (a sync decorator around an
                # async handler): awaited here, on the loop, as an async handler is; its
                # un-awaited coroutine was reported as the result (RESULT_NOT_JSON).
                running.on_loop = True
                return await value
            return await reg.fn(running.ctx, payload)
        except (Exception, asyncio.CancelledError):
            raise
        except KeyboardInterrupt as exc:
            if not self._sigint_ours:
                raise  # Ctrl-C under arun() without our SIGINT handler: the process's
            # Ctrl-C drains through the loop's handler, so this one is the handler's own
            # raise: out of this task it ended the whole worker at once (exit 130).
            raise _Exited(exc) from exc
        except BaseException as exc:
            # SystemExit (``sys.exit()`` in code lifted from a script) or the like: out of
            # this task, the event loop re-raised it, and the whole worker exited with it.
            raise _Exited(exc) from exc

    async def _in_thread(self, running: _Running, fn: Handler, payload: Any) -> Any:
        """A plain function in a daemon thread. Cancellation sets ``ctx.cancelled`` and
        waits ``cancel_grace``; a thread that ignores it is abandoned, never joined."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def target() -> None:
            try:
                value = fn(running.ctx, payload)
            except BaseException as exc:  # handed to the loop as the outcome
                # SystemExit re-raised on the loop ended the worker; StopIteration left
                # the future unsettled (set_exception refuses it) and the attempt running
                # for ever; and asyncio cannot cancel a thread, so a CancelledError here
                # is the function's own (its asyncio.run's), not the attempt's timeout.
                if not isinstance(exc, Exception) or isinstance(exc, StopIteration):
                    exc = _Exited(exc)
                outcome: tuple[Any, BaseException | None] = (None, exc)
            else:
                outcome = (value, None)
            # An abandoned function may end after the run's event loop has closed: its
            # outcome has no one to go to, where it printed "Exception in thread".
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, done, *outcome)

        def dropped(ended: asyncio.Future[Any]) -> None:
            # It finished after its attempt was lost: its outcome is thrown away, said so
            # as an async handler's is (a ``Cancelled`` it raised is no outcome).
            if not (running.lost and ended.done()) or ended.cancelled():
                return
            if not isinstance(ended.exception(), Cancelled):
                _log_dropped(running)

        name = f"orbit-{running.ctx.attempt_id}"
        threading.Thread(target=target, name=name, daemon=True).start()
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            running.ctx._stop(running.ctx.reason or "attempt timeout")
            try:
                value = await asyncio.wait_for(asyncio.shield(done), self.cancel_grace)
            except TimeoutError:
                # Its outcome may be on the loop's queue already, handed over (by
                # call_soon_threadsafe) as the wait ran out: one turn of the loop takes it.
                # Abandoned without that look, a function that had returned was logged as
                # one that "ignored cancellation". (A TimeoutError it raised itself is
                # its outcome too, taken here as any other.)
                await asyncio.sleep(0)
                if not done.done():
                    self._abandon(running, done)
                    done.add_done_callback(dropped)  # if it ends while the loop still runs
                elif running.ctx.reason != STOPPING:
                    dropped(done)
                elif not done.cancelled() and done.exception() is None:
                    return done.result()  # a drain's cancel, its work finished: as below
            except BaseException:
                if not done.done():  # the wait itself cancelled (the loop closing)
                    done.add_done_callback(dropped)
                elif running.ctx.reason != STOPPING:  # a drain's: re-raised below, reported
                    dropped(done)
            else:
                if running.ctx.reason == STOPPING:
                    # A drain's cancel, and the function finished its work meanwhile:
                    # its result is the attempt's outcome (a cancel of the task wins
                    # whatever it returned; a timeout is reported as one).
                    return value
                dropped(done)
            if running.ctx.reason == STOPPING and done.done() and not done.cancelled():
                failed = done.exception()
                if failed is not None and not isinstance(failed, asyncio.CancelledError):
                    raise failed from None  # a Fail or Retry it raised on the cancel: its own
            raise

    async def _upload(
        self,
        attempt_id: str,
        fence: str,
        name: str,
        data: bytes | Path,
        content_type: str,
        ttl: int | None,
    ) -> dict[str, Any]:
        """Upload an artifact for the attempt; send it again (the bytes again, a file read
        again from its start) when it was refused ``FENCED_EPOCH`` for an epoch this
        worker's resume replaced meanwhile, the attempt still its own (``UPLOAD_SENDS``)."""
        try:
            check_name("artifact name", name)
        except OrbitError as exc:
            # Refused here as the server refuses it: sent, a '/' in the name was refused
            # for its encoding in the URL's path (%2F), and '.' or '..', dot segments
            # that httpx removes from a path, sent the PUT to another route (404).
            error = {"code": str(exc.code), "message": exc.message}
            raise ServerError(error["code"], exc.message, error) from None
        # Sent with its digest (X-Orbit-Sha256): a handler's retry of an upload whose reply
        # was lost (Unreachable, though the server committed it) is answered with the
        # stored artifact, where it was refused ARTIFACT_EXISTS. The header goes before
        # the body, so a file is read for it first (off the loop), then again as it is
        # sent: one changed in between is refused DIGEST_MISMATCH, not stored.
        sha256 = await asyncio.to_thread(_sha256_of, data)
        sends = 0
        while True:
            conn = self._conn
            if conn is None or conn.session_id is None or conn.epoch is None:
                raise ConnectionError("not connected")
            session_id, epoch = conn.session_id, conn.epoch
            sends += 1
            try:
                return await self._send_upload(
                    attempt_id, fence, name, data, content_type, ttl, session_id, epoch, sha256
                )
            except ServerError as exc:
                if (
                    exc.code != Code.FENCED_EPOCH
                    or sends >= UPLOAD_SENDS
                    or not await self._resumed_since(attempt_id, fence, session_id, epoch)
                ):
                    raise

    async def _resumed_since(
        self, attempt_id: str, fence: str, session_id: str, epoch: str
    ) -> bool:
        """Whether this worker has resumed ``session_id`` past ``epoch`` while the attempt
        is still its own (not lost, not over, its lease not run out by this host's clock).
        Only this worker holds the session's resume secret, so a refusal for a newer epoch
        is its own resume, done or under way: one under way is waited for, at most until
        the lease runs out (the renew loop then loses the attempt)."""
        while True:
            running = self.running.get(attempt_id)
            if (
                running is None
                or running.fence != fence
                or running.ended
                or not self._lease_valid(running)
            ):
                return False
            conn = self._conn
            if self._connected.is_set() and conn is not None:
                return conn.session_id == session_id and conn.epoch != epoch
            with contextlib.suppress(TimeoutError):
                left = running.lease_expires - time.monotonic()
                await asyncio.wait_for(self._connected.wait(), left)

    async def _send_upload(
        self,
        attempt_id: str,
        fence: str,
        name: str,
        data: bytes | Path,
        content_type: str,
        ttl: int | None,
        session_id: str,
        epoch: str,
        sha256: str,
    ) -> dict[str, Any]:
        """One PUT of the upload, under ``session_id`` and ``epoch``."""
        headers = {
            "Authorization": f"Bearer {self._token()}",
            "Accept-Encoding": "identity",  # the reply's bytes as sent: see _upload_reply
            "Content-Type": content_type,
            "X-Orbit-Session": session_id,
            "X-Orbit-Epoch": epoch,
            "X-Orbit-Fence": fence,
            "X-Orbit-Sha256": sha256,
        }
        if ttl is not None:
            headers["X-Orbit-TTL"] = str(ttl)  # an int in range: Context.upload checked it
        # As bytes: httpx encodes a str header as ASCII, and a Latin-1 content type
        # (name=é), which the server takes, raised its UnicodeEncodeError.
        raw_headers = {k.encode("ascii"): v.encode("latin-1") for k, v in headers.items()}
        body: bytes | AsyncIterator[bytes] = data if isinstance(data, bytes) else _file(data)
        name_part = quote(name, safe="")
        import httpx  # here, not at the top: only an upload uses it (see orbit/__init__)

        from orbit.client._http import Unreachable

        path = f"/v1/attempts/{attempt_id}/artifacts/{name_part}"
        # The run's client, on the run's loop; a plain handler's own loop (its
        # asyncio.run(ctx.upload(...))) gets one for this upload alone: a client's
        # connections belong to the loop that opened them.
        shared = self._loop is not None and asyncio.get_running_loop() is self._loop
        http = self._upload_client() if shared else self._new_upload_client()
        try:
            async with http.stream("PUT", path, content=body, headers=raw_headers) as reply:
                raw = b"".join([chunk async for chunk in reply.aiter_raw()])
        except httpx.TransportError as exc:
            # Raised as the clients raise it (a ConnectionError): httpx's own is none, and
            # a handler that caught transport failures so did not catch this one.
            where = self.url.split("://", 1)[-1]
            raise Unreachable(f"upload to {where}: {type(exc).__name__}: {exc}"[:300]) from exc
        finally:
            if not shared:
                await http.aclose()
        return _upload_reply(reply.status_code, raw)

    def _upload_client(self) -> Any:
        """The run's one HTTP client for uploads on its loop (``_new_upload_client``),
        made by the first. Each upload made its own, with a TLS context that loads the CA
        bundle, even for ``http://``: a worker uploading 300 KB a task at a task a second
        grew to 289 MB of native memory (a worker making the same bytes without
        uploading: 49 MB), and each upload opened a new connection."""
        if self._uploads is None:
            self._uploads = self._new_upload_client()
        return self._uploads

    def _new_upload_client(self) -> Any:
        """An ``httpx.AsyncClient`` for uploads to this worker's server."""
        import httpx

        from orbit.client._http import KEEPALIVE_EXPIRY

        return httpx.AsyncClient(
            base_url=self.url,
            # The CAs the connection trusts (the system's, or cafile's): httpx's
            # verify=True trusts certifi's bundle instead.
            verify=ssl.create_default_context(cafile=self.cafile),
            timeout=300,
            # No cap on connections (every handler may upload at once), and idle ones
            # closed before the server's keep-alive timeout can meet a request on them,
            # as Orbit's clients do.
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=20,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
        )

    def _token(self) -> str:
        return self.token if self.token is not None else load_token()

    def _report_progress(self, ctx: Context, fraction: float | None, message: str | None) -> None:
        """``ctx.progress``'s report, from the event loop or a handler's thread: kept for
        the attempt's next progress message, unless the attempt is over (no longer
        running, or this context not its own)."""
        running = self.running.get(ctx.attempt_id)
        if running is None or running.ctx is not ctx or running.ended or ctx._loop is None:
            return  # the attempt is over: there is nothing left to report on
        running.pending_progress = (fraction, message)
        ctx._loop.call_soon_threadsafe(self._flush_progress, running)

    def _flush_progress(self, running: _Running) -> None:
        if not running.sending_progress:
            running.sending_progress = True
            task = asyncio.create_task(self._send_progress(running))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_progress(self, running: _Running) -> None:
        """Send the latest progress, then any that arrived meanwhile (older ones drop)."""
        try:
            while running.pending_progress is not None and not (running.lost or running.ended):
                fraction, message = running.pending_progress
                running.pending_progress = None
                conn = self._conn
                if conn is None:
                    return
                try:
                    # The request's own timeout, not wait_for: wait_for runs the request as
                    # a task whose refusal's traceback holds wait_for's frame, which holds
                    # the task: a cycle through this attempt's state, left to the collector.
                    await conn.progress(
                        running.ctx.attempt_id,
                        running.fence,
                        fraction=fraction,
                        message=message,
                        timeout=min(10.0, self.request_timeout),
                    )
                except (TimeoutError, ServerError, ConnectionError, OSError) as exc:
                    log.debug("progress not recorded: %s", exc)
        finally:
            running.sending_progress = False

    # ------------------------------------------------------------------ prefetch

    async def _prefetched(self, running: _Running, payload: Any) -> None:
        """An attempt's task with a prefetch: it waits, claimed and not started, for a
        slot (``_slot``), then runs as any other (``_attempt``, which gives the slot back
        as soon as its handler is over). One dropped while it waited runs no handler: a
        drain gives it back (``release``) for another worker to take at once; a cancel, a
        claim that ran out or a lost session has already taken it from us on the server."""
        ctx = running.ctx
        try:
            if self._stopping or ctx.handler not in self.handlers or await self._slot(running):
                await self._attempt(running, payload)  # a drain's or a stranger's: released
            elif ctx.reason == STOPPING and not running.lost:
                await self._request(lambda c: c.release(ctx.attempt_id, running.fence))
        except ServerError as exc:
            log.warning("release of %s refused: %s", ctx.attempt_id, exc.code)
        except Exception:
            log.exception("attempt %s failed in the runner", ctx.attempt_id)
        finally:
            # Also when its task was cancelled while it waited; ``_forget`` twice is once.
            self._forget(running)
            slot = self._unwait(ctx.attempt_id)
            if slot is not None:
                slot.cancel()
            self._free_slot(running)

    async def _slot(self, running: _Running) -> bool:
        """Wait until ``running`` may start: fewer than ``concurrency`` handlers run, and
        fewer than its handler's capacity. True once it holds a slot; False if it was
        dropped meanwhile (``_drop``). Waiting ones are granted in the order they came,
        as slots free (``_free_slot``), so one that arrives to a free slot never passes
        one that could have used it."""
        if self._take_slot(running):
            return True
        if running.ctx.cancelled:  # cancelled before it could wait: dropped as it would be
            return False
        slot: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        name = running.ctx.handler
        self._waiting[running.ctx.attempt_id] = (running, slot, time.monotonic())
        self._waiting_by[name] = self._waiting_by.get(name, 0) + 1
        self._drop_stale(name)
        return await slot

    def _drop_stale(self, handler: str) -> None:
        """Drop the claims that ran out while they waited, so that handlers longer than
        the claim lease do not pile stale ones up here, each to cost a refused start (and
        an evidence row) before a live one gets its slot. The server holds no more for
        this session than the slots it was told (``concurrency + prefetch`` in all, and
        each handler's capacity + ``prefetch``): more here, busy and waiting, means one of
        ours ran out, its task was given back and pushed again. The oldest waiting of the
        scope that is over goes, unstarted and unreleased (a start or release of it would
        be refused), but only once it has waited ``CLAIM_STALE_S`` (the server's default
        claim lease): until then the excess may be ours to wait out instead, handlers
        still ending after a lost session or a lost lease, whose slots the server freed
        first, and a live claim is kept."""
        now = time.monotonic()
        capacity = self._declared_capacity(handler)
        while self._waiting:
            if self._busy + len(self._waiting) > self._declared_slots:
                scope = None  # the session's slots are over: the oldest of any handler
            elif self._busy_by.get(handler, 0) + self._waiting_by.get(handler, 0) > capacity:
                scope = handler
            else:
                return
            oldest, since = next(
                (r, since)
                for r, _, since in self._waiting.values()
                if scope is None or r.ctx.handler == scope
            )
            if now - since < CLAIM_STALE_S:
                return
            oldest.ctx._stop("claim expired")
            self._drop(oldest)

    @property
    def _declared_slots(self) -> int:
        """The session's slots the hello declares: its concurrency, and the prefetch the
        server holds for it on top (attempts claimed that wait for a handler)."""
        return self.concurrency + self.prefetch

    def _declared_capacity(self, handler: str) -> int:
        """The slots the hello declares for ``handler``: its capacity, and the prefetch
        the server may push on top of it."""
        return min(self.handlers[handler].capacity + self.prefetch, MAX_HANDLER_CAPACITY)

    @property
    def _busy(self) -> int:
        """Handlers running (or starting) with a prefetch: the attempts holding a slot."""
        return len(self._holding)

    def _take_slot(self, running: _Running) -> bool:
        name = running.ctx.handler
        held = self._busy_by.get(name, 0)
        if self._busy >= self.concurrency or held >= self.handlers[name].capacity:
            return False
        self._busy_by[name] = held + 1
        self._holding.add(running.ctx.attempt_id)
        return True

    def _free_slot(self, running: _Running) -> None:
        """Give ``running``'s slot back, if it holds one, and start the waiting attempts
        that now fit. Not while stopping: the drain gives those back to the server."""
        if running.ctx.attempt_id not in self._holding:
            return
        self._holding.discard(running.ctx.attempt_id)
        self._busy_by[running.ctx.handler] -= 1
        if self._stopping or not self._waiting:
            return
        # Granted while walking the line, taken out of it after: no copy of the whole
        # line for each slot freed (a freed slot usually grants the first in it).
        granted: list[str] = []
        for attempt_id, (waiting, _, _) in self._waiting.items():
            if self._busy >= self.concurrency:
                break
            if self._take_slot(waiting):
                granted.append(attempt_id)
        for attempt_id in granted:
            slot = self._unwait(attempt_id)
            if slot is not None and not slot.done():
                slot.set_result(True)

    def _drop(self, running: _Running) -> None:
        """A waiting attempt will not be started: its task ends unstarted."""
        slot = self._unwait(running.ctx.attempt_id)
        if slot is not None and not slot.done():
            slot.set_result(False)

    def _unwait(self, attempt_id: str) -> asyncio.Future[bool] | None:
        """Take an attempt out of the waiting line; its slot's future, if it waited."""
        entry = self._waiting.pop(attempt_id, None)
        if entry is None:
            return None
        name = entry[0].ctx.handler
        self._waiting_by[name] -= 1
        return entry[1]

    def _cancel_task(self, running: _Running) -> None:
        """The server said ``running``'s task was cancelled (a push, a renewal, a repeated
        start): remembered, since any report now ends the task cancelled (``_stopped``),
        and the handler cancelled."""
        running.task_cancelled = True
        self._cancel(running, "task cancelled")

    def _cancel(self, running: _Running, reason: str) -> None:
        running.ctx._stop(reason)
        task = running.handler_task
        if task is None or task.done():
            if running.ctx.attempt_id in self._waiting:
                self._drop(running)  # waiting, unstarted: its handler never runs
            return
        if running.cancelled:
            return  # once: the handler is stopping, or is abandoned after cancel_grace
        running.cancelled = True
        task.cancel()
        if not running.watched and (running.on_loop or self.handlers[running.ctx.handler].is_async):
            # A plain function's thread is waited for in _in_thread; an async handler
            # that swallows CancelledError would be waited for for ever.
            running.watched = True
            loop = asyncio.get_running_loop()
            loop.call_later(self.cancel_grace, self._abandon_if_running, running)

    def _abandon_if_running(self, running: _Running) -> None:
        """An async handler still running ``cancel_grace`` after it was cancelled is
        abandoned: its attempt stops waiting for it and reports nothing."""
        task, attempt = running.handler_task, running.task
        if task is None or task.done() or attempt is None or attempt.done():
            return
        self._abandon(running, task)
        attempt.cancel()

    def _abandon(self, running: _Running, handler: asyncio.Future[Any]) -> None:
        """Give up on ``running``'s handler, which ignored its cancel; ``handler`` is done
        once its code ends after all (``_drain`` counts those that have not)."""
        if not running.abandoned:
            self._abandoned_handlers[running.ctx.attempt_id] = handler
            running.abandoned = True
            log.error(
                "handler %s ignored cancellation for %.1fs; abandoning it",
                running.ctx.handler,
                self.cancel_grace,
            )
            self.abandoned.append(running.ctx.attempt_id)

    def _lose(self, running: _Running, reason: str) -> None:
        """The attempt is no longer ours: its handler is cancelled and its outcome never
        sent. Logged once, as a warning: a lease lost this way (a blocked event loop
        that renewed nothing) once threw a finished handler's result away without a
        word, and the task went to needs_review for no reason the log showed."""
        if not running.lost:
            log.warning(
                "attempt %s (task %s) lost: %s; its outcome will not be reported",
                running.ctx.attempt_id,
                running.ctx.task_id,
                reason,
            )
            running.lost_reason = reason
        running.lost = True
        self._cancel(running, reason)

    # ------------------------------------------------------------------ leases

    def _set_lease(self, running: _Running, lease: dict[str, Any], sent: float) -> None:
        """Time the lease from ``lease_left``, the server's own count, starting from
        ``sent`` (when the request left, so never later than the server's answer): this
        host's wall clock, which may disagree with the database's, never enters."""
        running.lease_expires = sent + max(lease.get("lease_left") or 0.0, 0.0)
        now = time.monotonic()
        self._renew_at(running, now + (running.lease_expires - now) / 2)

    def _renew_at(self, running: _Running, at: float) -> None:
        """Set when ``running``'s lease is next renewed, and lower the floor to it: the
        floor stays under every ``renew_at`` only if each is set here."""
        running.renew_at = at
        self._renew_floor = min(self._renew_floor, at)

    def _interval(self) -> float:
        """Seconds until the next renewal is due: when the soonest lease is half spent
        (or every ``renew_interval``)."""
        if self.renew_interval is not None:
            return self.renew_interval
        return min(max(self._renew_floor - time.monotonic(), 0.05), 10.0)

    def _renewal_due(self) -> bool:
        """Whether some live lease is half spent (or past its deferred retry). The floor
        answers no without a look while it is still ahead; a look makes it exact again."""
        if self.renew_interval is not None:
            return True
        now = time.monotonic()
        if self._renew_floor > now:
            return False
        due = [r.renew_at for r in self.running.values() if _renewable(r)]
        self._renew_floor = min(due, default=math.inf)
        return self._renew_floor <= now

    async def _renew_loop(self) -> None:
        """Renew every running lease in one message (per MAX_RENEW_IDS ids); a lease we could
        not renew before it ran out is treated as lost (its handler is cancelled, its
        result dropped). No error ends this loop: with it gone, leases ran out under a
        live worker."""
        while True:
            try:
                await self._renew_once()
            except Exception:
                log.exception("renewal failed; renewing again at the next turn")

    async def _renew_once(self) -> None:
        """One turn of the renew loop: wait until a renewal is due, then send it."""
        wait = self._interval()
        meant = time.monotonic() + wait  # when this turn wakes at the latest, on time
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._lease_changed.wait()
        self._note_stall(meant)
        # New leases only move the next renewal earlier; renewing everything at each
        # start would cost a transaction per start batch. A wait timed by the floor while
        # the soonest lease has since ended wakes early: nothing is due, and the next turn
        # waits for the one after it.
        self._lease_changed.clear()
        if not self._renewal_due():
            return
        live = [r for r in self.running.values() if _renewable(r)]
        self._lose_expired(live)
        now = time.monotonic()
        pending = [r for r in live if not r.lost and self._carried(r, now)]
        conn = self._conn
        if not pending or self.pause_renewals or conn is None or not self._connected.is_set():
            return
        # At most MAX_RENEW_IDS ids a message, as the server reads them: one renew of all of
        # them, past that, was refused as a whole, and every lease ran out.
        for start in range(0, len(pending), MAX_RENEW_IDS):
            alive = [r.lease_expires for r in live if _renewable(r)]
            if not alive:  # every one lost by the answers so far
                return
            # Those whose finish was answered while the renews before were are left out;
            # the rest are marked as carried, at once, so that a finish setting out from
            # now on waits for this renew's answer (``_renewal_settled``).
            now = time.monotonic()
            chunk = [
                r
                for r in pending[start : start + MAX_RENEW_IDS]
                if _renewable(r) and (not r.finishing or r.renew_at <= now)
            ]
            if not chunk:
                continue
            settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for r in chunk:
                r.renewing = settled
            try:
                # A renewal not answered in time closes the connection (as any request
                # that times out): the runner resumes on a new one rather than wait on it.
                soonest = min(alive) - time.monotonic()
                timeout = min(10.0, self.request_timeout, max(soonest, RENEW_WAIT_FLOOR_S))
                sent = time.monotonic()
                renewal = asyncio.ensure_future(
                    conn.renew([r.ctx.attempt_id for r in chunk], timeout)
                )
                leases = await self._renewal_answer(renewal)
            except (TimeoutError, ServerError, ConnectionError, OSError) as exc:
                log.warning("renew failed: %s", str(exc) or type(exc).__name__)
                self._defer_renewals(pending[start:])
                return
            else:
                self._renew_retry = RENEW_RETRY_FIRST
                self._renewed(leases, sent)
            finally:
                settled.set_result(None)

    def _note_stall(self, meant: float) -> None:
        """Say, as a warning, that the event loop was blocked when the renew loop woke more
        than LOOP_STALL_WARN_S later than ``meant`` (at most once per
        LOOP_STALL_LOG_EVERY_S): nothing but a loop that did not run delays it so. Its
        renewals were late by as much, and the leases that ran out meanwhile are then
        logged lost with only ``lease expired``, which never said why."""
        now = time.monotonic()
        late = now - meant
        if late <= LOOP_STALL_WARN_S or now - self._stall_logged_at < LOOP_STALL_LOG_EVERY_S:
            return
        self._stall_logged_at = now
        log.warning(
            "the event loop was blocked for %.1fs: lease renewals were late (an async "
            "handler that blocks the loop, or CPU-bound plain handlers whose threads hold "
            "the GIL; see docs/worker.md)",
            late,
        )

    def _carried(self, running: _Running, now: float) -> bool:
        """Whether this renew carries ``running``. One whose finish is on its way is left
        out until its own renewal falls due (not carried along with the others'), and
        then put off once more, by up to FINISH_RENEW_DEFER_S, while enough of its lease
        is left: the finish's answer usually comes first, and the attempt is over. A
        finish still unanswered after that is slow, and its lease is renewed."""
        if not running.finishing:
            return True
        if running.renew_at > now:
            return False
        if running.finish_deferred:
            return True
        left = running.lease_expires - now
        wait = min(left / 4, FINISH_RENEW_DEFER_S)
        if left - wait < RENEW_WAIT_FLOOR_S:
            return True
        running.finish_deferred = True
        self._renew_at(running, now + wait)
        return False

    async def _renewal_answer(
        self, renewal: asyncio.Future[list[dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        """The answer to ``renewal``; while it is awaited (up to its timeout, at least
        ``RENEW_WAIT_FLOOR_S``), each running lease that runs out by this host's clock
        (those of attempts started meanwhile too) is lost at once, as the check at the
        top of the loop would."""
        try:
            while True:
                live = [r for r in self.running.values() if _renewable(r)]
                soonest = min((r.lease_expires for r in live), default=math.inf)
                wait = min(max(soonest - time.monotonic(), 0.0), LEASE_CHECK_S)
                meant = time.monotonic() + wait
                done, _ = await asyncio.wait((renewal,), timeout=wait)
                self._note_stall(meant)  # blocked while the answer waited, as at the top
                if done:
                    return renewal.result()
                self._lose_expired(live)
        finally:
            if not renewal.done():
                renewal.cancel()  # this turn was cancelled: the runner is stopping

    def _lose_expired(self, leases: list[_Running]) -> None:
        """Lose each of ``leases`` that has run out by this host's clock: not renewed in
        time, it is not ours now."""
        now = time.monotonic()
        for r in leases:
            if not r.lost and r.lease_expires <= now:
                self._lose(r, "lease expired")

    def _defer_renewals(self, failed: list[_Running]) -> None:
        """Try the renewal of leases whose renew failed again later, not at the next turn:
        after a server's refusal of a whole renew (a database failure), renewals went out
        every 50 ms for as long as it lasted. The wait doubles at each failure, from
        RENEW_RETRY_FIRST to RENEW_RETRY_MAX, but never passes half of what is left of a
        lease: a server that recovers in time still renews it."""
        now = time.monotonic()
        delay = self._renew_retry
        self._renew_retry = min(delay * 2, RENEW_RETRY_MAX)
        for r in failed:
            self._renew_at(r, now + min(delay, max(r.lease_expires - now, 0.0) / 2))

    def _renewed(self, leases: list[dict[str, Any]], sent: float) -> None:
        """Take a renew's answers: new leases, cancels, lost attempts."""
        for lease in leases:
            running = self.running.get(lease["attempt_id"])
            if running is None:
                continue
            if lease["status"] == "lost":
                self._lose(running, "lease lost")
            else:
                self._set_lease(running, lease, sent)
                if lease["status"] == "cancel":
                    self._cancel_task(running)

    async def _heartbeat_loop(self) -> None:
        """Keep the session alive while idle; a lapsed session is resumed on reconnect."""
        while True:
            conn = self._conn
            await asyncio.sleep(conn.heartbeat_interval if conn is not None else 5.0)
            if conn is None or not self._connected.is_set() or conn is not self._conn:
                continue
            try:
                await conn.heartbeat(min(10.0, self.request_timeout))
            except ServerError as exc:
                log.warning("heartbeat refused (%s); reconnecting", exc.code)
                with contextlib.suppress(Exception):
                    await conn.ws.close()
            except (TimeoutError, ConnectionError, OSError) as exc:
                log.warning("heartbeat failed: %r", exc)
            except Exception:
                # Any other error must not end the loop: an idle session would lapse.
                log.exception("heartbeat failed")

    # ------------------------------------------------------------------ shutdown

    async def _drain(self) -> None:
        """No new claims; running handlers get ``grace`` seconds, then are cancelled."""
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._request(lambda c: c.drain()), timeout=5)
        finally:
            self._drain_asked.set()  # the attempts pushed since the stop go back now
        # Claimed ahead and not started: given back (``release``) for another worker to
        # take at once, not started during the drain (``_free_slot`` starts none now).
        for r, _, _ in list(self._waiting.values()):
            self._cancel(r, STOPPING)
        await self._attempts_over(self.grace, hurry=True)
        for r in list(self.running.values()):
            self._cancel(r, STOPPING)
        await self._attempts_over(self.cancel_grace + self._report_grace)
        # Only a handler still running now keeps the exit code at 1: one that ignored a
        # cancel earlier in the run and has ended since left nothing behind (it once made
        # every later clean drain of the process exit 1).
        self._stuck = [a for a, h in self._abandoned_handlers.items() if not h.done()]
        if self._stuck:
            log.error(
                "%d handler(s) ignored cancellation, were abandoned and are still running",
                len(self._stuck),
            )

    async def _attempts_over(self, timeout: float, *, hurry: bool = False) -> None:
        """Wait at most ``timeout`` seconds for the running attempts to be over or
        abandoned: not for their tasks, of which an abandoned async handler's lives on.
        With ``hurry``, no longer once ``stop(now=True)`` has been asked for."""
        loop = asyncio.get_running_loop()
        overs: list[asyncio.Future[Any]] = []
        for r in self.running.values():
            if r.over is None:
                r.over = loop.create_future()
            overs.append(r.over)
        if not overs or (hurry and self._hurry.is_set()):
            return
        if not hurry:
            await asyncio.wait(overs, timeout=timeout)
            return
        # All of them over, or the hurry: whichever comes first (cancelling the wait
        # for them cancels none of them)
        waits = [
            asyncio.ensure_future(asyncio.wait(overs)),
            asyncio.ensure_future(self._hurry.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


def _loop_signal_handler(
    loop: asyncio.AbstractEventLoop, sig: int
) -> tuple[Callable[..., object], tuple[Any, ...]] | Literal[False] | None:
    """The handler ``loop.add_signal_handler`` put on ``sig`` (its callback and
    arguments), None if there is none, or False if there is one that cannot be read
    (uvloop keeps its handlers to itself: it is seen by the Python handler it installs)."""
    handlers = getattr(loop, "_signal_handlers", None)  # asyncio's Unix loops
    if isinstance(handlers, dict):
        handle = handlers.get(sig)
        if handle is None:
            return None
        return handle._callback, tuple(handle._args)
    own = getattr(loop, "_Loop__sighandler", None)  # uvloop's
    if own is not None and signal.getsignal(sig) == own:
        return False
    return None


class ReconnectBackoff:
    """The pauses between a worker's tries to connect: exponential back-off with "equal
    jitter". The base starts at ``RECONNECT_FIRST_S`` (``most`` if that is less) and
    doubles after each pause up to ``most`` (``reconnect_max``); each pause is drawn
    between half the base and the whole of it.

    Jitter, because without it every worker a server restart dropped retried at the
    same instants (0.1, 0.3, 0.7 s, ... then every 5 s) and all of them reached the node
    coming back at once. Equal rather than "full" jitter (anywhere from 0 to the base):
    a pause is never under half its base, so no worker tries a node that is down faster
    than the back-off means it to (full jitter draws pauses near 0 now and then), and a
    fleet once spread reaches the node at a lower rate (the mean pause is 3/4 of the
    base, not 1/2); half the base is spread enough to break the lockstep. The first
    pause is at most ``RECONNECT_FIRST_S``: a lone worker that lost its connection is
    not kept waiting for nothing (and its first try, before any pause, is made at once).

    A refusal that says when to come back (``Retry-After``) is waited out: that pause's
    base is raised to twice the delay asked for (capped at ``RETRY_AFTER_MAX_S``), so
    the pause is at least that delay and at most twice it (or the back-off's, if
    longer). Waiting exactly the delay would bring back together a fleet that a front
    refused together. ``rand`` gives floats in [0, 1): ``random.random``,
    or a test's own."""

    def __init__(self, most: float, rand: Callable[[], float]) -> None:
        self.most = most
        self.rand = rand
        self.base = min(RECONNECT_FIRST_S, most)

    def pause(self, retry_after: float | None = None) -> float:
        """The pause after a failed try (``retry_after``: what its refusal asked for, in
        seconds), in seconds; the next one's base doubles."""
        base = self.base
        if retry_after is not None:
            base = max(base, 2 * min(retry_after, RETRY_AFTER_MAX_S))
        self.base = min(self.base * 2, self.most)
        return base / 2 + self.rand() * base / 2


def _retry_after(exc: Exception) -> float | None:
    """The seconds a refused upgrade asks the worker to wait: its ``Retry-After`` on a
    status of ``RETRY_AFTER_STATUSES``, in whole seconds as Orbit sends it. None for
    another status, no header, or one that cannot be trusted (not whole seconds, or
    given twice): the back-off decides then. An HTTP date is not read either: it would
    set this host's clock against the server's."""
    if not isinstance(exc, InvalidStatus):
        return None
    if exc.response.status_code not in RETRY_AFTER_STATUSES:
        return None
    # Read here, not with the client's retry_after_seconds: a worker process imports
    # neither the HTTP client nor httpx (tests/unit/test_public_api.py).
    values = exc.response.headers.get_all("Retry-After")
    if len(values) != 1:
        return None
    value = values[0].strip()
    return float(value) if value.isascii() and value.isdigit() else None


def _renewable(running: _Running) -> bool:
    """Whether ``running``'s lease is for the renew loop to keep: started, not lost, and
    its finish not answered (``_Running.answered``)."""
    return bool(running.lease_expires) and not running.lost and not running.answered


async def _close_quietly(conn: WorkerConnection | None) -> None:
    """Close a connection that failed before it was put to use."""
    if conn is not None:
        with contextlib.suppress(Exception):
            await conn.close()


def _failure_name(exc: Exception) -> str:
    """How a failed connect is logged: the server's code and words for an answer (a hello
    or resume it could not try), an upgrade's refusal by its status (and Orbit's code
    and words, if its body holds them: ``HTTP 503, DATABASE_BUSY from the server: the
    database is busy: …``), else the exception's kind (the network, the handshake)."""
    if isinstance(exc, ServerError):
        return f"{exc.code} from the server: {exc.message}"
    if isinstance(exc, InvalidStatus):
        status = f"HTTP {exc.response.status_code}"
        try:
            found = parse_json(bytes(exc.response.body or b"{}")).get("error")
            code, message = found["code"], found["message"]
        except Exception:  # no body, or a proxy's page: the status alone
            return status
        if not isinstance(code, str) or not isinstance(message, str):
            return status
        said = " ".join(message.split())[:300]  # one line in the log, whatever it holds
        return f"{status}, {' '.join(code.split())[:64]} from the server: {said}"
    return type(exc).__name__


def _upload_reply(status: int, raw: bytes) -> dict[str, Any]:
    """An upload's answer: the artifact Orbit's JSON describes, or ServerError. A proxy
    in front (nginx refuses bodies over 1 MB by default) answers with a page of its own:
    HTTP_ERROR for an error status, and, with the codes the clients give them, REDIRECT
    for a redirect (not followed: the token would go along) and NOT_JSON for a success
    that is no JSON object. The body is read raw (asked for with no content coding): one
    labelled gzip that is not raised httpx's DecodingError, and a redirect's or a page's
    json's JSONDecodeError, where a refusal raised ServerError."""
    try:
        answer = parse_json(raw) if raw else None
    except ValueError:
        answer = None
    if 200 <= status < 300 and isinstance(answer, dict):
        return answer
    found = answer.get("error") if isinstance(answer, dict) and status >= 400 else None
    error: dict[str, Any] = found if isinstance(found, dict) else {}
    code = "HTTP_ERROR" if status >= 400 else "REDIRECT" if status >= 300 else "NOT_JSON"
    message = str(error.get("message", f"HTTP {status}"))
    raise ServerError(str(error.get("code", code)), message, error)


def _sha256_of(data: bytes | Path) -> str:
    """The sha256 of an upload's bytes, or of a file's, read in chunks."""
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    with data.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def _file(path: Path) -> AsyncIterator[bytes]:
    """A file's bytes in chunks, read off the event loop."""
    with path.open("rb") as f:
        while chunk := await asyncio.to_thread(f.read, 256 * 1024):
            yield chunk


def _sendable(
    report: dict[str, Any], ctx: Context | None = None
) -> tuple[dict[str, Any], int, bool]:
    """The outcome to send for ``report``, its size on the wire, and whether it is plain
    JSON (``connection.frame_text``): a result the server would refuse (NaN, a set, a
    NUL, over the frame limit, ...) becomes the attempt's non-retryable failure instead,
    so that it can neither wedge the worker (refused unread, it got no reply, and was
    re-sent for ever) nor sink the finishes batched with it (see orbit.worker.outcomes).

    Plain: an error, which ``outcomes.error`` made of text and a bool, or a result that
    ``outcomes.is_plain`` calls so (a scalar other than a float, or a flat list or dict
    of them, a handler's usual answer; an int beyond 64 bits is refused), as
    ``outcomes.check_result`` found while it checked it; a float anywhere, a subclass,
    or anything nested, and the frame takes ``json.dumps``."""
    if "error" in report:
        return report, outcomes.wire_size(report["error"]), True
    try:
        return report, *outcomes.check_result(report["result"])
    except outcomes.Unsendable as exc:
        log.error(
            "attempt %s (task %s): the handler's result cannot be sent: %s",
            ctx.attempt_id if ctx is not None else "?",
            ctx.task_id if ctx is not None else "?",
            exc.message,
        )
        failure = outcomes.error(exc.code, exc.message, retryable=False)
        return failure, outcomes.wire_size(failure["error"]), True


def _timed_out(running: _Running) -> dict[str, Any] | None:
    """The outcome of a handler its attempt timeout stopped; None to report nothing.

    Reported ``ATTEMPT_TIMEOUT``, retryably, only when nothing can come of a second run:
    the handler has ended and the task is ``retry_safe``. An abandoned handler (it
    outlived ``cancel_grace``) may still be at work, and a retry started beside it; a
    handler that is not retry_safe was stopped at whichever point it had reached, an
    effect maybe made, and a retryable report ran it again with no operator's decision
    (I6), where the drain's stop and a silent worker's lease both send it to
    needs_review. Either is left to its lease, which the server ends at the timeout (and
    its report grace): ``timed_out`` and a retry for a retry_safe task, ``needs_review``
    for any other."""
    if running.abandoned:
        return None  # _abandon said so in the log
    return _stopped(running, "its attempt timeout", "ATTEMPT_TIMEOUT", "the attempt timed out")


def _stopped(running: _Running, by: str, code: str, message: str) -> dict[str, Any] | None:
    """The outcome of a handler the runner stopped part way (``by``: the drain, its
    attempt timeout) that has ended: ``code``, retryably, if its task is retry_safe, to
    run again. Any other reports nothing: an effect may have happened (an async handler
    is cancelled at whichever await it is on), and a retryable report replayed a task
    that is not retry_safe (I6); the lease runs out and the server decides
    (needs_review)."""
    if running.task_cancelled:
        # Its task was cancelled while it stopped: the server ends the task cancelled
        # whatever is reported, so a report replays nothing, where reporting nothing (for
        # a task that is not retry_safe) left it `cancelling` until its lease ran out.
        return outcomes.error("CANCELLED", "task cancelled", retryable=False)
    ctx = running.ctx
    if ctx.retry_safe:
        return outcomes.error(code, message, retryable=True)
    log.warning(
        "attempt %s (task %s) was stopped by %s part way and is not retry_safe: "
        "it is left to its lease (needs_review)",
        ctx.attempt_id,
        ctx.task_id,
        by,
    )
    return None


def _log_dropped(running: _Running) -> None:
    """Say that a finished handler's outcome is thrown away, and why."""
    log.warning(
        "attempt %s (task %s): the handler finished, but its outcome is dropped: %s",
        running.ctx.attempt_id,
        running.ctx.task_id,
        running.lost_reason or "its lease ran out by this worker's clock",
    )


def _failure(running: _Running, exc: BaseException) -> dict[str, Any] | None:
    """The outcome of a handler that raised ``exc``; None to report nothing.

    A cancel is the runner's (``CANCELLED``, or the drain's and timeout's rules) only when
    the runner stopped the handler. One the handler made itself, never stopped
    (``asyncio.current_task().cancel()``, ``raise Cancelled``), is its own failure, as
    any other exception is: it failed the task for good with CANCELLED, never retried."""
    stopped = running.cancelled or running.ctx.cancelled
    if isinstance(exc, asyncio.CancelledError | Cancelled) and stopped:
        if running.lost or running.abandoned:
            # Lost: not ours to report. Abandoned: it may still be at work, so its
            # outcome is unknown: the lease runs out, and the server decides (a task
            # that is not retry_safe goes to needs_review, never silently replayed).
            return None
        if running.ctx.reason != STOPPING:
            return outcomes.error("CANCELLED", running.ctx.reason or "cancelled", retryable=False)
        return _stopped(running, "the drain", "CANCELLED", STOPPING)
    if isinstance(exc, _Exited) and isinstance(exc.exc, BaseExceptionGroup):
        exc = exc.exc  # a group holding a BaseException (GeneratorExit, ...) came wrapped
    if isinstance(exc, BaseExceptionGroup):
        # A Fail raised in an asyncio.TaskGroup arrives in a group: still a Fail (it was
        # reported as a retryable ExceptionGroup, and the task retried for ever).
        fails = exc.subgroup(Fail)
        if fails is not None:
            exc = _first_leaf(fails)
    # Codes and messages as text, whatever the handler gave: ``Fail(exc)`` or
    # ``Retry(code=503)`` (not strings), or an exception whose own ``str()`` fails,
    # made the runner's outcome fail instead, and the attempt reported nothing. By
    # getattr: a subclass may have set neither (its __init__ not calling ours).
    if isinstance(exc, Fail | Retry):
        code = _text(getattr(exc, "code", None))
        message = _text(getattr(exc, "message", None))
        if not message and "message" not in vars(exc):  # its __init__ skipped ours
            message = _text(exc)
        return outcomes.error(code, message, retryable=not isinstance(exc, Fail))
    failed = exc.exc if isinstance(exc, _Exited) else exc  # any other: retryably
    # The server is told its class and str() only: its traceback is logged here, or it
    # was nowhere, and a failing handler could not be traced to its line. Written out
    # and cleaned as the report's text is (exc_info would carry the exception's own text
    # as it is): a lone surrogate in it failed a UTF-8 log file's write, and pytest-xdist
    # could not send a captured log holding one.
    trace = "".join(traceback.format_exception(failed))
    log.warning(
        "attempt %s (task %s): the handler raised %s\n%s",
        running.ctx.attempt_id,
        running.ctx.task_id,
        type(failed).__name__,
        outcomes.clean_text(trace, TRACE_MAX).rstrip("\n"),
    )
    return outcomes.error(type(failed).__name__[:100], _text(failed)[:2000], retryable=True)


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first exception of ``group`` that is no group itself (groups nest)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _check_seconds(option: str, value: object, *, zero: bool) -> None:
    """A timing option as ``Worker(...)`` takes it: a real number of seconds, not a bool
    (TypeError; ``grace="5"`` raised a bare comparison's TypeError that named nothing),
    finite and more than 0 (or 0 or more with ``zero``) (ValueError): an infinite
    ``cancel_grace`` let a handler that ignores its cancel hang the drain for ever."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{option} must be a number of seconds; got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{option} must be a finite number of seconds; got {value!r}")
    if not (seconds >= 0 if zero else seconds > 0):
        more = "0 seconds or more" if zero else "more than 0 seconds"
        raise ValueError(f"{option} must be {more}; got {value!r}")


def _check_name(kind: str, value: object) -> None:
    """``value`` as the hello takes a name, or ValueError (the server's own words)."""
    try:
        check_name(kind, value)
    except OrbitError as exc:
        raise ValueError(exc.message) from None


def _check_handler(name: str, fn: object) -> None:
    """TypeError for what can never handle a task, refused at registration rather than
    failing each attempt: no callable, a generator function (sync or async), whose call
    returns a generator and runs none of its body, an object whose ``__call__`` is one,
    and a callable that cannot be called as ``fn(ctx, payload)`` (``lambda: 1``: each
    attempt failed with TypeError, retried up to max_attempts times)."""
    if not callable(fn):
        raise TypeError(f"handler {name}: {type(fn).__name__} is not callable")
    _check_arity(name, fn)
    while isinstance(fn, partial):
        fn = fn.func
    call = getattr(fn, "__call__", None)  # noqa: B004 - the method itself is asked about
    for inner in (fn, call):
        if inspect.isgeneratorfunction(inner) or inspect.isasyncgenfunction(inner):
            raise TypeError(
                f"handler {name}: a generator function cannot be a handler (use return, not yield)"
            )


def _check_arity(name: str, fn: object) -> None:
    """TypeError unless ``fn(ctx, payload)`` binds to ``fn``'s signature, when it has one
    (a builtin or a C extension's callable may have none: it is taken on trust)."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise TypeError(
            f"handler {name}: cannot be called as handler(ctx, payload): its signature is "
            f"{signature} ({exc})"
        ) from None


def _is_async(fn: Handler) -> bool:
    """Whether ``fn`` is called as a coroutine function: an object whose ``__call__`` is
    one too (it ran in a thread, and its un-awaited coroutine was its "result"), also
    behind ``functools.partial``."""
    while isinstance(fn, partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method itself is asked about
    )


def _text(value: Any) -> str:
    """``value`` as an error's code or message: a handler may give anything, and an
    exception's ``str()`` may itself fail. None is no text (the default code then)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return str(value)
    except Exception as exc:
        return f"<{type(value).__name__}: str() raised {type(exc).__name__}>"


class _Resends:
    """The pauses between the copies of a report the server could not try (a finish, a
    start): FINISH_RETRY_FIRST seconds, doubled at each copy up to FINISH_RETRY_MAX, and
    never past half of what is left until ``until`` (monotonic; the lease or the claim),
    so that one more copy still fits before it ends."""

    __slots__ = ("delay",)

    def __init__(self) -> None:
        self.delay = FINISH_RETRY_FIRST

    def next(self, until: float) -> float:
        """The pause before the next copy."""
        wait = min(self.delay, max(until - time.monotonic(), 0.0) / 2)
        self.delay = min(self.delay * 2, FINISH_RETRY_MAX)
        return wait


def _items(results: list[dict[str, Any]], key: str) -> list[dict[str, Any] | BaseException]:
    """A batch reply's answers (``_item``'s), an item with no error and a dict answered
    in the one expression, without a call of ``_item`` for each."""
    return [
        value if r.get("error") is None and type(value := r.get(key)) is dict else _item(r, key)
        for r in results
    ]


def _item(result: dict[str, Any], key: str) -> dict[str, Any] | BaseException:
    """One answer of a batch reply: its value, or the ServerError that refused it."""
    error = result.get("error")
    if error is not None:
        return ServerError(error["code"], error.get("message", ""), result)
    value = result[key]
    # A dict as parsed is the reply's own: no copy (one a lease and a receipt a task).
    return value if type(value) is dict else dict(value)


def _ended_or_timed_out(task: asyncio.Task[Any], timeout: float | None) -> asyncio.Future[None]:
    """A future done once ``task`` is done or ``timeout`` seconds have passed, whichever
    comes first: ``asyncio.wait((task,), timeout=timeout)`` without its sets, coroutines
    and closure. Cancelling the future (its awaiter was cancelled) leaves ``task``
    running, as ``asyncio.wait`` does."""
    loop = task.get_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    timer = None if timeout is None else loop.call_later(timeout, _wake, waiter, None)
    task.add_done_callback(partial(_wake, waiter, timer))
    return waiter


def _wake(waiter: asyncio.Future[None], timer: asyncio.TimerHandle | None, *_: object) -> None:
    """Settle ``waiter`` (if nothing has yet) and cancel the ``timer`` it no longer needs."""
    if timer is not None:
        timer.cancel()
    if not waiter.done():
        waiter.set_result(None)


def _settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    """Settle a thread's ``future`` with its function's outcome. Never left unsettled: an
    exception asyncio refuses to carry (``set_exception`` raises TypeError for
    StopIteration) left its attempt waiting, and its lease renewed, for ever."""
    if future.done():
        return
    if exc is None:
        future.set_result(value)
        return
    try:
        future.set_exception(exc)
    except TypeError:
        future.set_exception(
            RuntimeError(f"the handler raised {type(exc).__name__}, which asyncio cannot carry")
        )
