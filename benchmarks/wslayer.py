"""uvicorn's WebSocket layer per frame, as a drain uses it: a real uvicorn server (the
measured process) with one FastAPI WebSocket route, and a client in a process of its own
that sends and reads frames of a drain's sizes. It answers "does a change make the
server's part of a frame cheaper?" (uvicorn's protocol, Starlette's wrappers, text or
binary) with instruction counts, which a shared machine does not move::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.0 \\
        python -m benchmarks.wslayer --ws sansio --endpoint starlette --rounds 0
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.300 \\
        python -m benchmarks.wslayer --ws sansio --endpoint starlette --rounds 300
    python -m benchmarks.wslayer sizes      # the sizes below, from a drain's real frames

A round is one batch of a drain (``BATCH`` tasks): the worker's ``start_many`` in, the
``started_many`` answer and a push of the next batch's ``tasks`` out, the worker's
``finish_many`` in, the ``finished_many`` answer out; two frames in, three out, one at a
time (the client waits for each answer). The server's instructions a round are the
difference of the runs with ``--rounds R`` and ``--rounds 0`` (start-up, handshake and
close are in both), divided by R. Only the server runs under callgrind: valgrind does
not follow the client, a child process, unless told to. Natively, the server prints its
own user and system CPU.

The server is configured as ``orbit server`` configures uvicorn (``QuietDenials``, the
``sansio`` choice) unless ``--ws`` names uvicorn's ``legacy`` websockets protocol or its
``wsproto`` one (wsproto is no dependency of Orbit: install it to measure it). The route
reads and writes as the gateway does, through Starlette's ``WebSocket.receive`` and
``send_text`` (``--endpoint starlette``), or through the ASGI ``receive`` and ``send``
under them (``--endpoint asgi``). ``--binary`` sends binary frames both ways (the
protocol's server frames are text; a finding, not an option of the server).
``--offer-deflate`` has the client offer permessage-deflate, as the websockets library
and browsers do by default (Orbit's own clients never do).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from starlette.websockets import WebSocket

#: bytes of each frame of a round (``python -m benchmarks.wslayer sizes``: a drain's
#: frames for BATCH tasks, as the worker and the gateway write them)
SIZES = {"start": 11925, "started": 39109, "push": 62930, "finish": 18406, "finished": 64130}
BATCH = 180
WS = ("sansio", "legacy", "wsproto")
ENDPOINTS = ("starlette", "asgi")


def frame(size: int, tag: str) -> str:
    """An ASCII frame of ``size`` characters (frames of a drain are ASCII JSON)."""
    head = f'{{"type":"{tag}","pad":"'
    return head + "x" * (size - len(head) - 2) + '"}'


def sizes() -> dict[str, int]:
    """The lengths of a drain's real frames for one batch (``benchmarks.frames``)."""
    from benchmarks.frames import make_records
    from orbit.server import gateway

    with tempfile.TemporaryDirectory(prefix="orbit-wslayer-") as where:
        records = make_records(BATCH, Path(where))
    start = gateway.read_request(records.start_frames[0])
    finish = gateway.read_request(records.finish_frames[0])
    started = gateway.started_many_wire(
        "s0",
        start.items,  # type: ignore[union-attr]
        records.leases[0],
        records.metrics,
    )
    finished = gateway.finished_many_wire(
        "f0",
        finish.items,  # type: ignore[union-attr]
        records.receipts[0],
        records.metrics,
    )
    return {
        "start": len(records.start_frames[0]),
        "started": len(gateway.wire_text(started)),
        "push": len(gateway.tasks_frame(None, records.grants[0])),
        "finish": len(records.finish_frames[0]),
        "finished": len(gateway.wire_text(finished)),
    }


def make_app(endpoint: str, binary: bool) -> Any:
    """A FastAPI app whose ``/ws`` answers a round's frames, and stops the server (its
    ``state.server``) when the connection ends."""
    from fastapi import FastAPI

    started = frame(SIZES["started"], "started_many")
    push = frame(SIZES["push"], "tasks")
    finished = frame(SIZES["finished"], "finished_many")
    out: dict[str, Any] = {
        "s": [started, push],
        "f": [finished],
    }
    if binary:
        out = {k: [t.encode() for t in v] for k, v in out.items()}
    key = "bytes" if binary else "text"

    async def through_starlette(ws: WebSocket) -> None:
        await ws.accept()
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            data = message.get(key)
            assert data is not None
            for reply in out["s" if data[9:10] in ("s", b"s") else "f"]:
                if binary:
                    await ws.send_bytes(reply)
                else:
                    await ws.send_text(reply)

    async def through_asgi(ws: WebSocket) -> None:
        await ws.accept()
        receive, send = ws._receive, ws._send
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                break
            data = message.get(key)
            assert data is not None
            for reply in out["s" if data[9:10] in ("s", b"s") else "f"]:
                await send({"type": "websocket.send", key: reply})

    chosen = through_starlette if endpoint == "starlette" else through_asgi

    async def route(ws: WebSocket) -> None:
        try:
            await chosen(ws)
        finally:
            ws.app.state.server.should_exit = True

    app = FastAPI()
    app.add_api_websocket_route("/ws", route)
    return app


def serve(ws_kind: str, endpoint: str, rounds: int, binary: bool, offer_deflate: bool) -> None:
    """Run the server, and the client (a child process) against it, for ``rounds``."""
    import uvicorn

    from orbit.gctune import tune_for_throughput
    from orbit.server.denials import UVICORN_WS

    protocol: Any = {"sansio": UVICORN_WS["ws"], "legacy": "websockets", "wsproto": "wsproto"}
    app = make_app(endpoint, binary)
    config = uvicorn.Config(
        app,
        **{**UVICORN_WS, "ws": protocol[ws_kind]},
        log_level="warning",
        log_config=None,
        access_log=False,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    app.state.server = server
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "benchmarks.wslayer", "client", "--port", str(port)]
    argv += ["--rounds", str(rounds)] + (["--binary"] if binary else [])
    argv += ["--offer-deflate"] if offer_deflate else []
    client = subprocess.Popen(argv)
    tune_for_throughput()
    try:
        server.run(sockets=[sock])
    finally:
        code = client.wait(timeout=60)
    if code != 0:
        raise SystemExit(f"the client failed ({code})")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rounds": rounds, "user_s": usage.ru_utime, "sys_s": usage.ru_stime}))


async def drive(port: int, rounds: int, binary: bool, offer_deflate: bool) -> None:
    """The client: ``rounds`` rounds, each frame sent after the answer before it."""
    import websockets

    start = frame(SIZES["start"], "start_many")
    finish = frame(SIZES["finish"], "finish_many")
    data: tuple[str | bytes, str | bytes] = (
        (start.encode(), finish.encode()) if binary else (start, finish)
    )
    for _ in range(600):
        try:
            ws = await websockets.connect(
                f"ws://127.0.0.1:{port}/ws",
                compression="deflate" if offer_deflate else None,
                max_size=8 * 1024 * 1024,
            )
            break
        except OSError:
            await asyncio.sleep(0.1)
    else:
        raise SystemExit("the server never listened")
    async with ws:
        for _ in range(rounds):
            await ws.send(data[0])
            await ws.recv()
            await ws.recv()
            await ws.send(data[1])
            await ws.recv()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=("serve", "client", "sizes"), default="serve")
    parser.add_argument("--ws", choices=WS, default="sansio")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="starlette")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--binary", action="store_true", help="binary frames, not text")
    parser.add_argument(
        "--offer-deflate",
        action="store_true",
        help="the client offers permessage-deflate, as the websockets library's default does",
    )
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.what == "sizes":
        print(json.dumps(sizes()))
    elif args.what == "client":
        asyncio.run(drive(args.port, args.rounds, args.binary, args.offer_deflate))
    else:
        serve(args.ws, args.endpoint, args.rounds, args.binary, args.offer_deflate)


if __name__ == "__main__":
    main()
