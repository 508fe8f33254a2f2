"""What a node's log says about its open-file limit and about a dropped event stream.

- At start ``orbit server`` raises its soft limit of open files to the hard limit (a
  node at its limit resets new connections and logged nothing), logs the limit in force
  at INFO, and warns when the hard limit keeps it under 4096; ``orbit dev`` warns alike.
- A stalled SSE stream dropped after ``--stream-send-timeout`` logs its INFO line and
  no ERROR (uvicorn's "ASGI callable returned without completing response." was left
  for a routine event, and tripped alerts on ERROR lines).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from orbit.cli.listening import announced_port
from orbit.cli.openfiles import ENOUGH
from tests.e2e.servers import Node, Tokens, database, make_tokens, start_server
from tests.e2e.streams_common import PATIENCE, auth, create_queue

resource = pytest.importorskip("resource")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/PID/limits"
)

DROPPED = "event stream dropped: its client took nothing for the send timeout"


def _limited(soft: int, hard: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child starts with these limits of open files."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


def _open_files_limits(pid: int) -> tuple[int, int]:
    """The soft and hard limits of open files of process ``pid``, as the kernel has them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    with database("sqlite", tmp_path) as url:
        yield url


@pytest.fixture
def limited_server(sqlite_url: str, tmp_path: Path) -> Iterator[Callable[[int, int], Node]]:
    """Factory: ``orbit server`` started with the given soft and hard limits of open
    files, once it has said where it listens (after its start-up's log lines)."""
    started: list[Node] = []

    def start(soft: int, hard: int) -> Node:
        log = tmp_path / f"server-{len(started)}.log"
        cmd = [sys.executable, "-m", "orbit.cli", "server", "--db", sqlite_url, "--port", "0"]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limited(soft, hard)
            )
        node = Node(proc, 0, log)
        started.append(node)
        node.port = announced_port(proc, log, timeout=PATIENCE * 2)
        return node

    yield start
    for node in started:
        node.stop()


def test_a_node_raises_its_open_files_limit_to_the_hard_limit(
    limited_server: Callable[[int, int], Node],
) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 8192:
        pytest.skip("this process may not give a child a hard limit of 8192 open files")
    node = limited_server(256, 8192)
    assert _open_files_limits(node.proc.pid) == (8192, 8192)
    said = node.log_text()
    assert "INFO orbit.server open files: the limit is 8192, raised from 256" in said, said
    assert "WARNING" not in said, said
    assert httpx.get(f"{node.http}/healthz", timeout=PATIENCE).is_success


def test_a_node_warns_when_the_hard_limit_keeps_open_files_low(
    limited_server: Callable[[int, int], Node],
) -> None:
    node = limited_server(256, 1024)
    assert _open_files_limits(node.proc.pid) == (1024, 1024)
    said = node.log_text()
    assert "open files: the limit is 1024, raised from 256" in said, said
    warning = re.search(r"WARNING orbit\.server open files: the limit of 1024 is low\. (.*)", said)
    assert warning is not None, said
    assert "Each worker connection and each event stream holds one open file" in warning[1]
    assert "database connections" in warning[1] and f"to {ENOUGH} or more" in warning[1]
    assert "LimitNOFILE=" in warning[1]


def test_orbit_dev_warns_when_the_hard_limit_keeps_open_files_low(tmp_path: Path) -> None:
    """``orbit dev`` logs only warnings: the low limit's, and not the INFO line."""
    data = tmp_path / "dot-orbit"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "orbit.cli",
            "dev",
            "--once",
            "--port",
            "0",
            "--data-dir",
            str(data),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "300"},
        preexec_fn=_limited(256, 1024),
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING orbit.server open files: the limit of 1024 is low." in done.stderr
    assert "INFO" not in done.stderr


def _stalled_sse_client(node: Node, token: str) -> socket.socket:
    """An SSE stream's client that asks and then never reads, with small buffers (as
    tests/e2e/test_event_stream.py's), so that the server's sends soon wait on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", node.port))
    head = [
        "GET /v1/events/stream HTTP/1.1",
        f"Host: 127.0.0.1:{node.port}",
        f"Authorization: Bearer {token}",
        "Accept: text/event-stream",
    ]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    return sock


def test_a_dropped_stalled_stream_logs_no_error(sqlite_url: str, tmp_path: Path) -> None:
    tokens: Tokens = make_tokens(sqlite_url)
    node = start_server(sqlite_url, tmp_path, args=["--stream-send-timeout", "0.5"])
    try:
        with httpx.Client(base_url=node.http, timeout=PATIENCE, headers=auth(tokens.admin)) as api:
            create_queue(api)
            stalled = _stalled_sse_client(node, tokens.admin)
            try:
                stalled.settimeout(PATIENCE)
                assert stalled.recv(12, socket.MSG_PEEK).split()[1:] == [b"200"]
                # events enough to fill the buffers, until the node says it dropped it
                tasks = [{"queue": "q", "handler": "h"} for _ in range(500)]
                deadline = time.monotonic() + 8 * PATIENCE
                while DROPPED not in node.log_text():
                    api.post("/v1/tasks/batch?reply=ids", json={"tasks": tasks})
                    assert time.monotonic() < deadline, node.log_text()
                # The node closes the connection after uvicorn's check of the response
                # (and its ERROR line, were there one): read up to that close.
                while stalled.recv(1 << 16):
                    pass
            finally:
                stalled.close()
            # the node serves on, and streams again
            with api.stream("GET", "/v1/events/stream") as again:
                assert again.status_code == 200
    finally:
        node.stop()
    said = node.log_text()
    assert f"INFO orbit.server {DROPPED}" in said, said
    assert " ERROR " not in said, said
    assert "without completing response" not in said, said
