"""The low-level worker connection: one WebSocket, request/reply by ``req_id``, and a
queue of what the server pushes (``tasks``, ``cancel``, ``drain``).

It does no leasing or retrying on its own; the automatic runner builds on it. The token
travels in the ``Authorization`` header of the upgrade, never in the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import ssl
from collections.abc import Sequence
from typing import Any

import orjson
import websockets
from websockets.asyncio.client import ClientConnection

from orbit.core.model import parse_json
from orbit.logs import RedactSecrets
from orbit.tokens import TokenError, token_fault

log = logging.getLogger("orbit.worker")
#: What websockets logs about our connections: every header of the upgrade at debug
#: level, the Authorization header included. A child of its own logger, so that an
#: application's settings for "websockets.client" still apply, with the redaction
#: filter on it, so that the token never reaches the application's handlers.
ws_log = logging.getLogger("websockets.client.orbit")
ws_log.addFilter(RedactSecrets())


class ServerError(Exception):
    """The server answered a request with ``error``; ``code`` is machine-readable."""

    def __init__(self, code: str, message: str, reply: dict[str, Any]) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reply = reply


#: orjson refuses (TypeError) what it would write otherwise than ``json.dumps``: a subclass
#: of str, int, dict or list (an IntEnum, a dict with its own ``items``), a dataclass, a
#: datetime; the frame then takes ``json.dumps``
_ORJSON_LIKE_JSON = (
    orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
)


def frame_text(message: dict[str, Any], *, plain: bool = False) -> str:
    """A request's frame: compact JSON, non-ASCII written as escapes (so a string that is
    not valid UTF-8, a lone surrogate in a result, still reaches the server, which refuses
    it with its code), as ``json.dumps`` writes it.

    ``plain``: every value is of JSON's own types exactly (``str``, ``int`` within 64
    bits, ``bool``, ``None``, ``list``, ``tuple``, ``dict`` with ``str`` keys; no float,
    no subclass, no Enum), as in the runner's ``start_many`` and most of its
    ``finish_many`` (see ``Worker._send_finishes``). Such a message is written by orjson,
    about ten times faster (the standard library's encoder was a tenth of a busy worker's
    instructions), whenever orjson's text is ASCII: then it is the same JSON value, never
    longer (orjson leaves DEL unescaped), so never past the size ``outcomes.wire_size``
    counted. A float is the same value but may be longer (orjson writes 6.103515625e-05
    as 0.00006103515625), hence not plain. Anything else takes ``json.dumps``: orjson
    writes NaN as null, an Enum as its value, and a UUID that ``json.dumps`` refuses."""
    if plain:
        try:
            data = orjson.dumps(message, option=_ORJSON_LIKE_JSON)
        except TypeError:  # not plain after all: json.dumps decides
            pass
        else:
            if data.isascii():
                return data.decode("ascii")
    return json.dumps(message, separators=(",", ":"))


def read_frame(frame: bytes) -> Any:
    """A frame from the server as a value, read from its bytes as they came: websockets
    no longer decodes the text first (a frame of 180 tasks, 70 KB, copied into a str for
    orjson to read back as UTF-8). What orjson refuses is read as before: decoded as
    strict UTF-8 (invalid UTF-8 raises UnicodeDecodeError, as websockets raised it),
    then ``parse_json`` (lone surrogates as escapes, numbers beyond a double)."""
    try:
        return orjson.loads(frame)
    except orjson.JSONDecodeError:
        return parse_json(frame.decode())


def outcome(*, result: Any = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The wire form of an attempt's outcome: a result, or an error. Both is refused: the
    error's outcome carried no result, and the result given with it was dropped unsaid
    (the server refuses a failed outcome with a result)."""
    if error is not None and result is not None:
        raise ValueError("an outcome is a result or an error, not both")
    return outcome_wire({"result": result} if error is None else {"error": error})


def outcome_wire(report: dict[str, Any]) -> dict[str, Any]:
    """The wire form of the runner's outcome ``report`` (``{"result": …}`` or
    ``{"error": …}``), without a call by keywords: one per finish."""
    if "error" in report:
        return {"ok": False, "error": report["error"]}
    return {"ok": True, "result": report["result"]}


class WorkerConnection:
    #: Seconds a request waits for its reply unless told otherwise. A request that times
    #: out, or fails to send, closes the connection: a server that stopped answering on
    #: it is not waited on again, and the runner reconnects and resumes its session.
    request_timeout: float = 30.0

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.pushed: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.session_id: str | None = None
        self.epoch: str | None = None
        self.resume_secret: str | None = None
        self.heartbeat_interval: float = 20.0
        self._ids = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        #: requests given up on (timed out, or their caller cancelled): a reply that comes
        #: for one later is dropped, never taken for a message the server pushed
        self._abandoned: set[str] = set()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str, token: str, *, cafile: str | None = None) -> WorkerConnection:
        """Open ``ws(s)://host:port/v1/worker``; certificates are always verified. A
        token no header can carry is a TokenError, which quotes it not: websockets'
        InvalidHeaderValue did, and the runner took it for a network failure and
        retried it for ever."""
        fault = token_fault(token)
        if fault is not None:
            raise TokenError(f"the token {fault}")
        ssl_ctx = None
        if url.startswith("wss://"):
            ssl_ctx = ssl.create_default_context(cafile=cafile)
        ws = await websockets.connect(
            url,
            additional_headers={"Authorization": f"Bearer {token}"},
            ssl=ssl_ctx,
            max_size=8 * 1024 * 1024,
            open_timeout=10,
            logger=ws_log,
            # Frames are small JSON on a LAN or loopback: deflating them costs both ends
            # more CPU than it saves (it was a visible share of a busy worker's profile).
            compression=None,
        )
        return cls(ws)

    async def _read(self) -> None:
        try:
            while True:
                msg = read_frame(await self.ws.recv(decode=False))
                rid = msg.get("req_id")
                future = self._waiting.pop(rid, None) if isinstance(rid, str) else None
                if future is not None and not future.done():
                    future.set_result(msg)
                elif isinstance(rid, str) and rid in self._abandoned:
                    self._abandoned.discard(rid)  # a late reply: its request is over
                else:
                    await self.pushed.put(msg)
        except websockets.ConnectionClosed:
            pass
        except Exception:
            # A frame we cannot read (not JSON): nothing after it can be trusted either.
            log.exception("unreadable frame from the server; closing the connection")
            self.abort()
        finally:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(ConnectionError("the connection closed"))
            self._waiting.clear()
            self._abandoned.clear()
            # What the server said as it closed (None if the socket just dropped): 4401
            # UNAUTHENTICATED, the token was revoked; 4409, the session resumed elsewhere.
            closing = self.ws.protocol.close_rcvd
            await self.pushed.put(
                {
                    "type": "closed",
                    "code": None if closing is None else closing.code,
                    "reason": None if closing is None else closing.reason,
                }
            )

    async def send_raw(self, data: str | bytes) -> None:
        """Send a frame. A closed socket is a ``ConnectionError``, as for a reply that a
        close cut off: websockets' ``ConnectionClosed`` is not one, and it escaped every
        handler that expects transport failures as ``ConnectionError`` or ``OSError``."""
        try:
            await self.ws.send(data)
        except websockets.ConnectionClosed as exc:
            raise ConnectionError(f"the connection closed: {exc}") from exc

    def abort(self) -> None:
        """Drop the connection at once, without the closing handshake: on a connection
        that stopped answering, that handshake would wait too. The reader then ends, and
        pushes ``closed``."""
        transport = self.ws.transport
        if transport is not None and not transport.is_closing():
            transport.abort()

    async def request(
        self, message: dict[str, Any], timeout: float | None = None, *, plain: bool = False
    ) -> dict[str, Any]:
        """Send a request (a ``req_id`` is added) and wait for its reply, at most
        ``timeout`` seconds (default: ``request_timeout``). A timeout or a failure to send
        closes the connection; a ``ServerError`` (the server's answer) does not.
        ``plain``: see :func:`frame_text`."""
        if timeout is None:
            timeout = self.request_timeout
        rid = f"r{next(self._ids)}"
        # Compact, as orjson writes JSON: the server then reads an ASCII frame with orjson
        # rather than its strict parser (``decode_json``). Encoded before the reply is
        # awaited: a message that cannot be encoded raises here and leaves nothing waiting.
        frame = frame_text({**message, "req_id": rid}, plain=plain)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            await self.send_raw(frame)
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that meets
            # the reply in one loop iteration, and the worker's loops must stop when told.
            async with asyncio.timeout(timeout):
                reply = await future
        except BaseException as exc:
            # Timed out, failed or cancelled: nobody waits for this reply any more. Left in
            # ``_waiting``, it leaked, and a reply arriving late was handed on as a push.
            if self._waiting.pop(rid, None) is not None:
                self._abandoned.add(rid)
            if isinstance(exc, OSError):  # TimeoutError and ConnectionError among them
                self.abort()
            raise
        if reply.get("type") == "error":
            raise ServerError(reply["code"], reply.get("message", ""), reply)
        return reply

    async def hello(
        self, name: str, capabilities: dict[str, int], max_concurrency: int, push: bool = True
    ) -> dict[str, Any]:
        reply = await self.request(
            {
                "type": "hello",
                "name": name,
                "max_concurrency": max_concurrency,
                "push": push,
                "capabilities": [{"handler": h, "capacity": c} for h, c in capabilities.items()],
            }
        )
        self.session_id, self.epoch = reply["session_id"], reply["epoch"]
        self.resume_secret = reply["resume_secret"]
        self.heartbeat_interval = float(reply["heartbeat_interval"])
        return reply

    async def resume(self, session_id: str, secret: str, push: bool = True) -> dict[str, Any]:
        reply = await self.request(
            {"type": "resume", "session_id": session_id, "secret": secret, "push": push}
        )
        self.session_id, self.epoch, self.resume_secret = session_id, reply["epoch"], secret
        self.heartbeat_interval = float(reply["heartbeat_interval"])
        return reply

    async def claim(self, n: int) -> list[dict[str, Any]]:
        return list((await self.request({"type": "claim", "n": n}))["tasks"])

    async def start(self, attempt_id: str, fence: str) -> dict[str, Any]:
        reply = await self.request({"type": "start", "attempt_id": attempt_id, "fence": fence})
        return dict(reply["lease"])

    async def start_many(self, items: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Start many attempts in one request. Each result is ``{"attempt_id", "lease"}``
        or ``{"attempt_id", "error": {"code", "message"}}``, in the order given."""
        reply = await self.request(
            {"type": "start_many", "items": [{"attempt_id": a, "fence": f} for a, f in items]},
            # ids and fences are text, as the server gave them (anything else: json.dumps);
            # a list looked at, not a generator resumed an item
            plain=all([type(a) is str and type(f) is str for a, f in items]),
        )
        return list(reply["results"])

    async def finish_many(
        self, items: Sequence[tuple[str, str, dict[str, Any]]], *, plain: bool = False
    ) -> list[dict[str, Any]]:
        """Report many outcomes in one request (``outcome`` as :func:`outcome` builds it).
        Each result is ``{"attempt_id", "receipt"}`` or ``{"attempt_id", "error"}``.
        ``plain``: the ids, fences and outcomes are plain values (:func:`frame_text`)."""
        wire = [{"attempt_id": a, "fence": f, "outcome": outcome} for a, f, outcome in items]
        return await self._finish(wire, plain)

    async def finish_flagged(
        self, items: Sequence[tuple[str, str, dict[str, Any], bool]]
    ) -> list[dict[str, Any]]:
        """``finish_many`` for items that say each whether its outcome is plain (the
        runner's, which found it when it checked the result): the batch is plain when
        every one of them is (the ids and fences are text, as the server gave them)."""
        wire = [{"attempt_id": a, "fence": f, "outcome": outcome} for a, f, outcome, _ in items]
        return await self._finish(wire, all([plain for _, _, _, plain in items]))

    async def _finish(self, items: list[dict[str, Any]], plain: bool) -> list[dict[str, Any]]:
        reply = await self.request({"type": "finish_many", "items": items}, plain=plain)
        return list(reply["results"])

    async def renew(
        self, attempt_ids: list[str], timeout: float | None = None
    ) -> list[dict[str, Any]]:
        reply = await self.request({"type": "renew", "attempt_ids": attempt_ids}, timeout)
        return list(reply["leases"])

    async def finish(
        self,
        attempt_id: str,
        fence: str,
        *,
        result: Any = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return await self.finish_report(attempt_id, fence, outcome(result=result, error=error))

    async def finish_report(
        self, attempt_id: str, fence: str, report: dict[str, Any]
    ) -> dict[str, Any]:
        """Report an outcome already in wire form (see :func:`outcome`)."""
        reply = await self.request(
            {"type": "finish", "attempt_id": attempt_id, "fence": fence, "outcome": report}
        )
        return dict(reply["receipt"])

    async def release(self, attempt_id: str, fence: str) -> None:
        await self.request({"type": "release", "attempt_id": attempt_id, "fence": fence})

    async def drain(self) -> None:
        await self.request({"type": "drain"})

    async def progress(
        self,
        attempt_id: str,
        fence: str,
        *,
        fraction: float | None = None,
        message: str | None = None,
        timeout: float | None = None,
    ) -> None:
        await self.request(
            {
                "type": "progress",
                "attempt_id": attempt_id,
                "fence": fence,
                "fraction": fraction,
                "message": message,
            },
            timeout,
        )

    async def heartbeat(self, timeout: float | None = None) -> None:
        """Keep an idle session alive (renewals do it while attempts run)."""
        await self.request({"type": "heartbeat"}, timeout)

    async def next_push(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """The next message the server pushed (``None``: wait as long as it takes). The
        last one is ``{"type": "closed", "code": …, "reason": …}``: the close frame the
        server sent, or None for both if the connection dropped without one."""
        async with asyncio.timeout(timeout):
            return await self.pushed.get()

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
