"""Every PostgreSQL connection a node opens probes its peer: TCP keepalives and a user
timeout are set on the store's pooled connections and on the LISTEN connection, so a
PostgreSQL gone without a reset fails a call or a read in seconds (and the node
reconnects) instead of after TCP's own timers (2 hours idle, ~15 minutes sending)."""

from __future__ import annotations

import asyncio
import os
import socket

from orbit.server.listen import connect
from orbit.store.postgres.driver import TCP_CHECKS, PostgresDriver

EXPECTED = (
    1,
    TCP_CHECKS["keepalives_idle"],
    TCP_CHECKS["keepalives_interval"],
    TCP_CHECKS["keepalives_count"],
    TCP_CHECKS["tcp_user_timeout"],
)


def _options(fd: int) -> tuple[int, ...]:
    with socket.socket(fileno=os.dup(fd)) as sock:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )


def test_the_listen_connection_probes_its_peer(pg_url: str) -> None:
    async def options() -> tuple[int, ...]:
        async with await connect(pg_url) as cx:
            return _options(cx.pgconn.socket)

    assert asyncio.run(options()) == EXPECTED


def test_the_stores_connections_probe_their_peer(pg_url: str) -> None:
    driver = PostgresDriver(pg_url)
    try:
        for pool in (driver._pool, driver._relaxed):
            with pool.connection() as cx:
                assert _options(cx.pgconn.socket) == EXPECTED
    finally:
        driver.close()
