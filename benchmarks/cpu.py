"""Host CPU use during a measurement, sampled with psutil in a background thread.

A throughput figure means little without knowing what else the machine was doing, and
who spent the CPU: the worker processes, the Orbit server, PostgreSQL, Redis or the
harness itself. Every ``interval`` seconds the sampler reads system-wide CPU % and the
cumulative CPU time of every process of interest; at the end it reports, per process and
per group, the CPU seconds spent inside the window.

A process that exits inside the window takes its last moments with it, and one that is
born and exits between two scans (a peer's worker and its database connections, in a
drain shorter than a second) is never seen at all. Their time is not lost, though: the
kernel adds a reaped child's CPU time to its parent's ``children`` times. So the sampler
also reads the children times of each group's reaper (this process for ``children``, the
postmaster for ``postgres``) and adds what grew there, less the last reading of every
process it saw die (already counted up to that reading).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from benchmarks.masking import mask

INTERVAL_S = 0.25
DISCOVER_S = 1.0
GROUPS = ("harness", "children", "postgres", "redis")


@dataclass
class _Seen:
    label: str
    group: str
    first: float  # CPU seconds at the first sample (0 if born inside the window)
    last: float
    ppid: int
    alive: bool = True


def _children_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of the reaped children of ``proc`` (and of theirs that they reaped)."""
    t = proc.cpu_times()
    return float(t.children_user + t.children_system)


def _named() -> list[tuple[psutil.Process, str]]:
    """Every process on this host and its name (processes that exit meanwhile left out).

    ``psutil.process_iter(attrs)`` would store the names in each process's ``info``, but
    it hands the same ``Process`` objects to every caller in this process, so a sampler
    in another thread (``--parallel``) replaces ``info`` with its own attributes between
    the scan and the read (a ``KeyError: 'ppid'`` in CI). Each name is read here instead."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            found.append((p, p.name()))
    return found


def _postmasters() -> list[psutil.Process]:
    """Every PostgreSQL postmaster on this host: a ``postgres`` whose parent is not one."""
    found = []
    for p, name in _named():
        if name != "postgres":
            continue
        try:
            if psutil.Process(p.ppid()).name() != "postgres":
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _label(proc: psutil.Process) -> str:
    """A short, readable command line: ``python -m orbit.cli worker …``, with any
    password in it masked (an Orbit server's ``--db`` URL) before it is shortened."""
    try:
        args = proc.cmdline()
    except (psutil.Error, OSError):
        return str(proc.name()) if proc.is_running() else "?"
    if not args:
        return str(proc.name())
    args = [os.path.basename(args[0]), *args[1:]]
    return mask(" ".join(" ".join(args).split()))[:120]


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


class CpuSampler:
    """Use as a context manager around one measurement; read ``result`` afterwards."""

    def __init__(self, interval: float = INTERVAL_S, exclude: Iterable[int] = ()) -> None:
        """``interval`` <= 0: no sampling thread, only readings at the start and the end
        (what a parallel smoke run uses: cheap, and its numbers mean nothing anyway).

        ``exclude``: pids of this process's children that are not part of the
        measurement (another system's idle server): they and every process under them
        are left out of ``children`` and of the per-process list."""
        self.interval = interval
        self.exclude = frozenset(exclude)
        self.result: dict[str, Any] = {}
        self._me = psutil.Process()
        self._procs: dict[int, psutil.Process] = {}
        self._seen: dict[int, _Seen] = {}
        self._system: list[float] = []
        self._last_times = psutil.cpu_times()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._t0 = 0.0
        self._before: frozenset[int] = frozenset()
        self._reapers: dict[str, list[tuple[psutil.Process, float]]] = {}

    def _reaped_s(self) -> dict[str, float]:
        """Per group, the CPU seconds its reapers' children times grew by since the start."""
        grown = dict.fromkeys(GROUPS, 0.0)
        for group, reapers in self._reapers.items():
            for proc, before in reapers:
                with contextlib.suppress(psutil.Error, OSError):
                    grown[group] += max(0.0, _children_cpu_s(proc) - before)
        return grown

    def _in_reaped(self, seen: _Seen) -> bool:
        """Whether a process's whole CPU time reached its group's reaper: it died, and so
        did every ancestor between it and the reaper (each reaped by its parent)."""
        reapers = {proc.pid for proc, _ in self._reapers.get(seen.group, [])}
        while not seen.alive:
            if seen.ppid in reapers:
                return True
            parent = self._seen.get(seen.ppid)
            if parent is None:
                return False
            seen = parent
        return False

    def __enter__(self) -> CpuSampler:
        # Every pid alive as the window opens: a process found later whose pid is not
        # here was born inside the window, and all its CPU time counts. Not decided by
        # ``create_time``: psutil builds it on a boot time in whole seconds, so on Linux
        # it reads up to 1 s early, and a worker started just after the window opened
        # would pass for one already running (its CPU before its first scan dropped).
        self._before = frozenset(psutil.pids())
        self._t0 = time.time()
        self._last_times = psutil.cpu_times()
        for group, procs in (("children", [self._me]), ("postgres", _postmasters())):
            readings = []
            for proc in procs:
                with contextlib.suppress(psutil.Error, OSError):
                    readings.append((proc, _children_cpu_s(proc)))
            self._reapers[group] = readings
        self._discover(first=True)
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._system.append(self._system_percent())
        self._discover(first=False)
        self.result = self._summarise(time.time() - self._t0)

    def _system_percent(self) -> float:
        """System-wide busy % since the previous reading (this sampler's own, unlike
        ``psutil.cpu_percent``, whose state every caller in the process shares)."""
        now = psutil.cpu_times()
        before, self._last_times = self._last_times, now
        total = sum(now) - sum(before)
        idle = (now.idle - before.idle) + (
            getattr(now, "iowait", 0.0) - getattr(before, "iowait", 0.0)
        )
        return round(100 * (1 - idle / total), 1) if total > 0 else 0.0

    def _loop(self) -> None:
        next_discovery = time.monotonic() + DISCOVER_S
        while not self._stop.wait(self.interval):
            self._system.append(self._system_percent())
            if time.monotonic() >= next_discovery:
                next_discovery = time.monotonic() + DISCOVER_S
                self._discover(first=False)
            else:
                self._update()

    def _discover(self, *, first: bool) -> None:
        """Find the processes of interest (a full process scan: 3-6 ms of CPU on a quiet
        machine, hence not every tick) and sample them. A process born since the window
        opened (its pid not among those alive then) is seen whole: all its CPU time was
        spent inside the window."""
        found: list[tuple[psutil.Process, str]] = [(self._me, "harness")]
        with contextlib.suppress(psutil.Error):
            found += [(p, "children") for p in self._children()]
        for p, name in _named():
            if name == "postgres":
                found.append((p, "postgres"))
            elif name.startswith("redis-server"):
                found.append((p, "redis"))
        for proc, group in found:
            if proc.pid in self._seen:
                continue
            try:
                used = _cpu_s(proc)
                born_inside = not first and proc.pid not in self._before
                self._seen[proc.pid] = _Seen(
                    _label(proc), group, 0.0 if born_inside else used, used, proc.ppid()
                )
                self._procs[proc.pid] = proc
            except (psutil.Error, OSError):
                continue
        self._update()

    def _children(self) -> list[psutil.Process]:
        """This process's descendants, less the excluded ones and everything under them."""
        kids = self._me.children(recursive=True)
        if not self.exclude:
            return kids
        parent = {}
        for p in kids:
            with contextlib.suppress(psutil.Error, OSError):
                parent[p.pid] = p.ppid()

        def excluded(pid: int) -> bool:
            while pid in parent:
                if pid in self.exclude:
                    return True
                pid = parent[pid]
            return pid in self.exclude

        return [p for p in kids if not excluded(p.pid)]

    def _update(self) -> None:
        """Read the cumulative CPU time of every known process (cheap: no scan)."""
        for pid, proc in list(self._procs.items()):
            try:
                self._seen[pid].last = _cpu_s(proc)
            except (psutil.Error, OSError):
                del self._procs[pid]  # gone: its last reading stands
                self._seen[pid].alive = False

    def _summarise(self, wall: float) -> dict[str, Any]:
        groups = dict.fromkeys(GROUPS, 0.0)
        processes = []
        # What the reapers collected, less what was already counted of the processes
        # seen to die (their whole life is in the reaper's figure). Never below zero: a
        # process reaped elsewhere (an orphan adopted by init) is simply not corrected.
        reaped = self._reaped_s()
        for seen in self._seen.values():
            if self._in_reaped(seen):
                reaped[seen.group] -= seen.last
        for group, extra in reaped.items():
            groups[group] += max(0.0, extra)
        for pid, seen in self._seen.items():
            spent = max(0.0, seen.last - seen.first)
            groups[seen.group] += spent
            if seen.group in ("harness", "children"):
                processes.append(
                    {"pid": pid, "group": seen.group, "label": seen.label, "cpu_s": round(spent, 3)}
                )
        system = self._system or [0.0]
        return {
            "interval_s": self.interval,
            "wall_s": round(wall, 3),
            "cpu_count": psutil.cpu_count(),
            "samples": len(self._system),
            "system_percent": {
                "mean": round(statistics.fmean(system), 1),
                "median": round(statistics.median(system), 1),
                "max": round(max(system), 1),
            },
            "cpu_s": {k: round(v, 3) for k, v in groups.items()},
            "core_percent": {
                k: round(100 * v / wall, 1) if wall > 0 else 0.0 for k, v in groups.items()
            },
            "processes": sorted(processes, key=lambda p: -float(p["cpu_s"])),
        }
