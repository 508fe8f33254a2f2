"""Real ``orbit server`` processes on loopback ports, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from orbit.cli.listening import announced_port
from orbit.store import open_store
from tests.pg import as_url, temporary_database


@contextlib.contextmanager
def database(backend: str, work: Path, prefix: str = "orbit_e2e") -> Iterator[str]:
    """An empty database's URL for servers to share: a SQLite file in ``work``, or a
    PostgreSQL database (its name starts with ``prefix``) created, and dropped after."""
    if backend == "sqlite":
        yield f"sqlite:///{work}/orbit.db"
    else:
        with temporary_database(prefix) as dsn:
            yield as_url(dsn)


@dataclass
class Tokens:
    admin: str
    submit: str
    worker: str


def make_tokens(db_url: str) -> Tokens:
    store = open_store(db_url)
    try:
        return Tokens(*(store.token_create(s, [s])[1] for s in ("admin", "submit", "worker")))
    finally:
        store.close()


@dataclass
class Node:
    """One server process. ``http`` and ``ws`` are its base URLs."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    scheme: str = "http"

    @property
    def http(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"{'wss' if self.scheme == 'https' else 'ws'}://127.0.0.1:{self.port}/v1/worker"

    def kill(self) -> None:
        """SIGKILL, then confirm the process is gone before anyone asserts anything."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        try:
            os.kill(self.proc.pid, 0)
        except ProcessLookupError:
            return
        raise AssertionError(f"server {self.proc.pid} survived SIGKILL")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def app_server(module: str, args: list[str], log: Path, timeout: float = 30.0) -> Iterator[Node]:
    """A test's own server app (``python -m <module> <args>``: ``tests.e2e.busy_app``,
    ``tests.e2e.start_fault_app``, which serve ``create_app`` through
    ``tests.e2e.app_serving``), once it has said where it listens; stopped after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT
        )
    node = Node(proc, 0, log)
    try:
        node.port = announced_port(proc, log, timeout=timeout)
        yield node
    finally:
        node.stop()


def start_server(
    db_url: str,
    log_dir: Path,
    *,
    node_id: str = "node-a",
    args: list[str] | None = None,
    tls: tuple[Path, Path, Path] | None = None,
    timeout: float = 30.0,
) -> Node:
    """Start a node on a port it picks itself (``--port 0``: a port chosen here first
    could be taken by another process before the server binds it) and wait until it
    says which and answers /healthz there (tls = cert, key, CA file)."""
    log = log_dir / f"{node_id}-{uuid.uuid4().hex[:8]}.log"
    cmd = [
        sys.executable,
        "-m",
        "orbit.cli",
        "server",
        "--db",
        db_url,
        "--port",
        "0",
        "--node-id",
        node_id,
        *(args or []),
    ]
    if tls is not None:
        cmd += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        port = announced_port(proc, log, timeout=timeout)
    except RuntimeError:
        Node(proc, 0, log).stop()
        raise
    node = Node(proc, port, log, "https" if tls else "http")
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(tls[2])) if tls else True
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{node.log_text()}")
        try:
            if httpx.get(f"{node.http}/healthz", timeout=1, verify=verify).is_success:
                return node
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            node.stop()
            raise RuntimeError(f"server did not come up:\n{node.log_text()}")
        time.sleep(0.05)
