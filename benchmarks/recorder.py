"""What every system's task handler does, and the per-task record the harness reads.

Every system under test runs the same handler body, :func:`run_sync` or
:func:`run_async`, so the systems differ only in how they queue, claim and finish.
Each handler appends one line per event to a file of its own process under
``$BENCH_REC_DIR`` (``O_APPEND``, one ``write`` per line, no buffering, so a SIGKILL
loses nothing already written):

    S <job id> <enqueued at> <started at> <pid>          (only for jobs with "mark_start")
    F <job id> <enqueued at> <started at> <ended at> <pid>

Times are ``time.time()`` seconds; all processes share this machine's clock.

A job's payload is a small JSON object:
    {"id": "<unique id>", "t": <enqueued at>, "kind": "noop" | "sleep" | "hold",
     "ms": <sleep milliseconds>, "mark_start": true}
``hold`` jobs sleep for an hour in a process started with ``BENCH_HOLD=1`` (the victim
of the recovery workload) and return at once anywhere else.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REC_DIR_ENV = "BENCH_REC_DIR"
HOLD_ENV = "BENCH_HOLD"
HOLD_SECONDS = 3600.0

_fd: int | None = None


def _write(line: str) -> None:
    global _fd
    if _fd is None:
        directory = os.environ[REC_DIR_ENV]
        path = os.path.join(directory, f"{os.getpid()}.rec")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, line.encode())


def _begin(payload: dict[str, Any]) -> float:
    started = time.time()
    if payload.get("mark_start"):
        _write(f"S {payload['id']} {payload['t']:.6f} {started:.6f} {os.getpid()}\n")
    return started


def _end(payload: dict[str, Any], started: float) -> None:
    ended = time.time()
    _write(f"F {payload['id']} {payload['t']:.6f} {started:.6f} {ended:.6f} {os.getpid()}\n")


def _hold_here() -> bool:
    return os.environ.get(HOLD_ENV) == "1"


def run_sync(payload: dict[str, Any]) -> None:
    """The handler body for systems whose handlers are plain functions."""
    started = _begin(payload)
    kind = payload.get("kind", "noop")
    if kind == "sleep":
        time.sleep(payload["ms"] / 1000)
    elif kind == "hold" and _hold_here():
        time.sleep(HOLD_SECONDS)
    _end(payload, started)


async def run_async(payload: dict[str, Any]) -> None:
    """The handler body for systems whose handlers are coroutines."""
    started = _begin(payload)
    kind = payload.get("kind", "noop")
    if kind == "sleep":
        await asyncio.sleep(payload["ms"] / 1000)
    elif kind == "hold" and _hold_here():
        await asyncio.sleep(HOLD_SECONDS)
    _end(payload, started)


@dataclass(frozen=True)
class Record:
    kind: str  # "S" or "F"
    job_id: str
    enqueued: float
    started: float
    ended: float | None
    pid: int


class RecordReader:
    """Reads the records written so far, incrementally, from every file in a directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.records: list[Record] = []

    def poll(self) -> list[Record]:
        """New complete records since the last call (also appended to ``records``)."""
        fresh: list[Record] = []
        for path in sorted(self.directory.glob("*.rec")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            if not data:
                continue
            self._offsets[path] = offset + len(data)
            text = self._partial.pop(path, "") + data.decode()
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                if line:
                    fresh.append(_parse(line))
        self.records.extend(fresh)
        return fresh

    def finished(self) -> list[Record]:
        return [r for r in self.records if r.kind == "F"]

    def started(self) -> list[Record]:
        return [r for r in self.records if r.kind == "S"]


def _parse(line: str) -> Record:
    parts = line.split()
    if parts[0] == "S":
        return Record("S", parts[1], float(parts[2]), float(parts[3]), None, int(parts[4]))
    return Record("F", parts[1], float(parts[2]), float(parts[3]), float(parts[4]), int(parts[5]))
