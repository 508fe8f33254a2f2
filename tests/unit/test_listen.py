"""The LISTEN connection probes its peer: TCP keepalives are set on its socket, so a
PostgreSQL gone without a reset fails the read (and the node reconnects) instead of
leaving the node deaf to other nodes' wakes and cancels."""

from __future__ import annotations

import asyncio
import os
import socket

from orbit.server.listen import KEEPALIVES, connect


def test_the_listen_connection_sets_tcp_keepalives(pg_url: str) -> None:
    async def options() -> tuple[int, int, int, int]:
        async with await connect(pg_url) as cx:
            with socket.socket(fileno=os.dup(cx.pgconn.socket)) as sock:
                return (
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                )

    on, idle, interval, count = asyncio.run(options())
    assert on == 1
    assert (idle, interval, count) == (
        KEEPALIVES["keepalives_idle"],
        KEEPALIVES["keepalives_interval"],
        KEEPALIVES["keepalives_count"],
    )
