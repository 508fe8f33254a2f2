"""A chaos run on PostgreSQL: real ``orbit server`` nodes and ``orbit worker`` processes,
many tasks, and faults injected at random (seeded) moments; then the invariants of
DESIGN §2 are checked on the store at rest.

    report = run_chaos(tasks=150, kills=6, seed=1, workdir=tmp_path)
    assert report.violations == []

The world:

- a fresh PostgreSQL database (``tests/pg.py``), two server nodes with short leases
  (``--lease-ttl 2 --claim-ttl 2 --reap-interval 0.2 --poll-interval 0.5 --session-ttl 5``);
- small caps: queue ``qa`` 3, queue ``qb`` 2, tenant ``t1`` 2, global 4 (each worker
  offers 3), so the caps bind and an over-grant would show;
- three worker processes (``tests/fault/chaos_worker.py``), each connected through its
  own fault relay (``tests/fault/proxy.py``) to one of the nodes, so a connection can be
  cut and a reconnect steered to the surviving node;
- tasks mixing ``retry_safe`` (handler ``chaos.safe``) and unsafe ones (``chaos.unsafe``),
  each sleeping a short random time, some failing retryably on chosen attempts. They are
  submitted in batches during the run (with idempotency keys: a batch whose reply is lost
  to a fault is re-sent and returns the same tasks), keeping a bounded backlog.

The faults, at moments drawn from the seed (as fractions of the tasks finished, so the
schedule does not depend on the machine's speed): SIGKILL a worker (confirmed gone, a
replacement started on the same relay), SIGKILL a server node (confirmed gone; the relays
aimed at it are steered to the other node first; the node is restarted after a short
random delay), cut every connection of one worker's relay; and, once, restart PostgreSQL
itself (``pg_restart=False`` skips it). Nothing sleeps to synchronise: the driver polls
the database and the API in bounded loops.

At the end: wait (bounded) until every task is terminal or ``needs_review``; count the
``needs_review`` tasks, then (``resolve_review``) resolve each as ``failed``; stop the
workers (each must exit 0 on SIGTERM) and nodes; then check, on the store:
``check_all(store, caps=...)`` (I1, I2, I4-I7, I9), no task lost (I8: every submitted id
present and terminal), no result committed twice, no unsafe task started twice without a
decision (I6), occupancy replayed from the event log never above a cap, every stored
result produced by the attempt recorded as the successful one, and only unsafe tasks in
``needs_review``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from orbit.store import open_store
from tests.e2e.servers import Node, Tokens, make_tokens, start_server
from tests.fault.proxy import FaultProxy
from tests.invariants import all_events, check_all, occupancy_replay
from tests.pg import as_url, temporary_database

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = [
    "--lease-ttl",
    "2",
    "--claim-ttl",
    "2",
    "--reap-interval",
    "0.2",
    "--poll-interval",
    "0.5",
    "--session-ttl",
    "5",
    "--log-level",
    "warning",
]
QUEUE_CAPS = {"qa": 3, "qb": 2}
TENANT_CAPS = {"t1": 2}
GLOBAL_CAP = 4
WORKERS = 3
WORKER_CONCURRENCY = 3
QUICK_RETRY = {"base": 0.05, "factor": 1, "max": 0.05}
DONE = {"succeeded", "failed", "cancelled", "needs_review"}
BATCH = 100
BACKLOG = 200  # submitted but not yet finished, at most (roughly)
PG_RESTART = ["pg_ctlcluster", "--skip-systemctl-redirect", "", "main", "restart"]
FAULTS = ("worker_kill", "server_kill", "disconnect")


@dataclass
class ChaosReport:
    """What a chaos run did and found. ``violations`` empty = every check held."""

    tasks: int
    seed: int
    submitted: int = 0
    kills: dict[str, int] = field(default_factory=lambda: {"worker": 0, "server": 0})
    disconnects: int = 0
    pg_restarts: int = 0
    needs_review: int = 0
    resolved: int = 0
    states: dict[str, int] = field(default_factory=dict)
    unsafe_tasks: int = 0
    lost_tasks: int = 0
    double_commits: int = 0
    unsafe_double_starts: int = 0
    rejected_reports: int = 0
    attempts: int = 0
    peaks: dict[str, int] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    wall_time: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def summary(self) -> str:
        peaks = {k: v for k, v in self.peaks.items() if not k.startswith("session:")}
        return (
            f"chaos seed={self.seed}: {self.submitted}/{self.tasks} tasks "
            f"({self.unsafe_tasks} unsafe) in {self.wall_time:.1f}s; kills {self.kills}, "
            f"disconnects {self.disconnects}, PG restarts {self.pg_restarts}; "
            f"states {self.states}; needs_review {self.needs_review}; "
            f"lost {self.lost_tasks}, double commits {self.double_commits}, unsafe double "
            f"starts {self.unsafe_double_starts}; rejected reports {self.rejected_reports}; "
            f"peaks {peaks}; violations {len(self.violations)}"
        )


@dataclass
class _Slot:
    """One worker position: its relay (kept across replacements) and current process."""

    index: int
    proxy: FaultProxy
    home: int  # the node this slot's relay aims at when both are up
    proc: subprocess.Popen[bytes] | None = None
    name: str = ""
    generation: int = 0


class _Chaos:
    def __init__(
        self, url: str, tokens: Tokens, workdir: Path, rng: random.Random, report: ChaosReport
    ) -> None:
        self.url = url
        self.tokens = tokens
        self.workdir = workdir
        self.rng = rng
        self.report = report
        self.nodes: list[Node | None] = [None, None]
        self.all_nodes: list[Node] = []
        self.slots: list[_Slot] = []
        self.killed: list[subprocess.Popen[bytes]] = []
        self.pending: list[tuple[float, Callable[[], None]]] = []
        self.ids: list[str] = []  # every task id the API returned, in submission order
        self.started = time.monotonic()

    # ------------------------------------------------------------------ bookkeeping

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self.started:7.2f}s {what}"
        self.report.timeline.append(line)

    def counts(self) -> dict[str, int] | None:
        """Tasks by state, read straight from the database (None while it is down)."""
        try:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                rows = conn.execute("SELECT state, count(*) FROM orbit_tasks GROUP BY state")
                return {str(s): int(n) for s, n in rows.fetchall()}
        except psycopg.Error:
            return None

    # ------------------------------------------------------------------ nodes

    def node_id(self, k: int) -> str:
        return f"node-{'ab'[k]}"

    def start_node(self, k: int) -> Node:
        node = start_server(
            self.url, self.workdir, node_id=self.node_id(k), args=SERVER_ARGS, timeout=60
        )
        self.nodes[k] = node
        self.all_nodes.append(node)
        return node

    def live_node(self) -> Node:
        for node in self.nodes:
            if node is not None:
                return node
        raise AssertionError("no server node is up")

    def api(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> Any:
        """One admin API call, re-sent (to whichever node is up) until it is answered with
        a non-5xx status, for at most ``timeout`` s. Only idempotent calls go through it."""
        end = time.monotonic() + timeout
        while True:
            node = self.live_node()
            try:
                reply = httpx.request(
                    method,
                    f"{node.http}{path}",
                    json=body,
                    timeout=10,
                    headers={"Authorization": f"Bearer {self.tokens.admin}"},
                )
                if reply.status_code < 500:
                    if reply.status_code >= 400:
                        raise AssertionError(f"{method} {path}: {reply.status_code} {reply.text}")
                    return reply.json()
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                raise AssertionError(f"{method} {path}: no answer within {timeout}s")
            time.sleep(0.1)

    def kill_node(self) -> None:
        if None in self.nodes:  # one is down, waiting for its restart: restart it now
            self.run_due(everything=True)
        k = self.rng.randrange(2)
        node, other = self.nodes[k], self.nodes[1 - k]
        assert node is not None and other is not None
        for slot in self.slots:
            slot.proxy.retarget(other.port)  # reconnects land on the survivor
        node.kill()  # SIGKILL, confirmed gone
        self.nodes[k] = None
        self.report.kills["server"] += 1
        self.note(f"SIGKILL {self.node_id(k)} (pid {node.proc.pid})")
        self.later(self.rng.uniform(0.2, 2.0), lambda: self.restart_node(k))

    def restart_node(self, k: int) -> None:
        node = self.start_node(k)
        self.note(f"restarted {self.node_id(k)} on port {node.port}")
        for slot in self.slots:
            if slot.home == k:
                slot.proxy.retarget(node.port)

    # ------------------------------------------------------------------ workers

    def start_worker(self, slot: _Slot) -> None:
        slot.generation += 1
        slot.name = f"w{slot.index}-{slot.generation}"
        env = {
            **os.environ,
            "ORBIT_URL": slot.proxy.http,
            "ORBIT_TOKEN": self.tokens.worker,
            "ORBIT_CHAOS_NAME": slot.name,
            "ORBIT_CHAOS_CONCURRENCY": str(WORKER_CONCURRENCY),
        }
        env.pop("ORBIT_TOKEN_FILE", None)
        with (self.workdir / f"worker-{slot.name}.log").open("wb") as out:
            slot.proc = subprocess.Popen(
                [sys.executable, "-m", "orbit.cli", "worker", "tests.fault.chaos_worker:worker"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def wait_sessions(self, names: set[str], timeout: float = 60.0) -> None:
        """Poll until each named worker holds a live session (or a worker died)."""
        end = time.monotonic() + timeout
        while True:
            for slot in self.slots:
                if slot.proc is not None and slot.proc.poll() is not None:
                    raise AssertionError(f"worker {slot.name} exited: {self.worker_log(slot)}")
            page = self.api("GET", "/v1/workers?state=live&limit=1000")
            live = {s["name"] for s in page["items"]}
            if names <= live:
                return
            if time.monotonic() > end:
                raise AssertionError(f"no live session for {names - live} within {timeout}s")
            time.sleep(0.05)

    def worker_log(self, slot: _Slot) -> str:
        return (self.workdir / f"worker-{slot.name}.log").read_text(errors="replace")[-3000:]

    def kill_worker(self) -> None:
        slot = self.rng.choice(self.slots)
        proc = slot.proc
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=10)
        assert code == -signal.SIGKILL, f"worker {slot.name} ended with {code} instead"
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            pass
        else:
            raise AssertionError(f"worker {slot.name} (pid {proc.pid}) survived SIGKILL")
        assert not Path(f"/proc/{proc.pid}").exists()
        self.killed.append(proc)
        self.report.kills["worker"] += 1
        self.note(f"SIGKILL worker {slot.name} (pid {proc.pid})")
        self.start_worker(slot)
        self.wait_sessions({slot.name})
        self.note(f"started worker {slot.name}, connected")

    def cut(self) -> None:
        slot = self.rng.choice(self.slots)
        slot.proxy.cut_all()
        self.report.disconnects += 1
        self.note(f"cut the connections of worker {slot.name}")

    # ------------------------------------------------------------------ PostgreSQL

    def restart_postgres(self) -> None:
        versions = sorted(os.listdir("/etc/postgresql"))
        cmd = list(PG_RESTART)
        cmd[2] = versions[-1]
        self.note("restarting PostgreSQL")
        subprocess.run(cmd, check=True, timeout=120, capture_output=True)
        end = time.monotonic() + 60
        while (
            subprocess.run(
                ["pg_isready", "-h", "127.0.0.1", "-p", "5432"], capture_output=True
            ).returncode
            != 0
        ):
            if time.monotonic() > end:
                raise AssertionError("PostgreSQL did not come back within 60s")
            time.sleep(0.1)
        self.report.pg_restarts += 1
        self.note("PostgreSQL is ready again")

    # ------------------------------------------------------------------ scheduling

    def later(self, delay: float, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, action))

    def run_due(self, *, everything: bool = False) -> None:
        now = float("inf") if everything else time.monotonic()
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, action in due:
            action()

    def fault(self, kind: str) -> None:
        if kind == "worker_kill":
            self.kill_worker()
        elif kind == "server_kill":
            self.kill_node()
        elif kind == "disconnect":
            self.cut()
        elif kind == "pg_restart":
            self.restart_postgres()
        else:
            raise ValueError(kind)


def _specs(n: int, seed: int, rng: random.Random) -> list[dict[str, Any]]:
    """The tasks to submit, drawn from the seed."""
    specs = []
    for i in range(n):
        unsafe = rng.random() < 0.3
        roll = rng.random()
        fail = [1] if roll < 0.15 else [1, 2] if roll < 0.2 else []
        specs.append(
            {
                "queue": rng.choice(sorted(QUEUE_CAPS)),
                "tenant": rng.choice(["t1", "t2"]),
                "handler": "chaos.unsafe" if unsafe else "chaos.safe",
                "retry_safe": not unsafe,
                "max_attempts": 3 if unsafe else 4,
                "backoff": QUICK_RETRY,
                "idempotency_key": f"chaos-{seed}-{i}",
                "payload": {"i": i, "sleep": round(rng.uniform(0.01, 0.25), 3), "fail": fail},
            }
        )
    return specs


def run_chaos(
    tasks: int,
    kills: int,
    seed: int,
    workdir: Path,
    *,
    pg_restart: bool = True,
    resolve_review: bool = True,
    timeout: float | None = None,
) -> ChaosReport:
    """Run the chaos described in the module docstring; see ``ChaosReport``.

    ``kills`` faults are drawn among worker SIGKILL, server SIGKILL and connection cut;
    the PostgreSQL restart (``pg_restart``) comes on top. ``timeout`` bounds the wait for
    every task to finish (default: generous for ``tasks``); running out of it is reported
    as a violation, not raised."""
    rng = random.Random(seed)
    report = ChaosReport(tasks=tasks, seed=seed)
    workdir.mkdir(parents=True, exist_ok=True)
    budget = timeout if timeout is not None else 120.0 + tasks * 0.2 + kills * 5
    caps = {f"queue:{q}": c for q, c in QUEUE_CAPS.items()}
    caps |= {f"tenant:{t}": c for t, c in TENANT_CAPS.items()}
    caps["global"] = GLOBAL_CAP
    report.caps = caps
    began = time.monotonic()
    with temporary_database("orbit_chaos") as dsn:
        url = as_url(dsn)
        store = open_store(url)
        try:
            for q, c in QUEUE_CAPS.items():
                store.queue_create(q, max_concurrency=c, rate=0)
            for t, c in TENANT_CAPS.items():
                store.tenant_limit_set(t, c)
            store.global_limit_set(GLOBAL_CAP)
        finally:
            store.close()
        tokens = make_tokens(url)
        world = _Chaos(url, tokens, workdir, rng, report)
        try:
            _drive(world, tasks, kills, seed, pg_restart, resolve_review, budget)
        finally:
            _teardown(world)
        _check(url, world, report, caps)
    report.wall_time = round(time.monotonic() - began, 2)
    return report


def _drive(
    world: _Chaos,
    tasks: int,
    kills: int,
    seed: int,
    pg_restart: bool,
    resolve_review: bool,
    budget: float,
) -> None:
    rng, report = world.rng, world.report
    specs = _specs(tasks, seed, rng)
    report.unsafe_tasks = sum(1 for s in specs if not s["retry_safe"])
    # The fault schedule: (fraction of tasks finished, kind), in order.
    schedule = sorted((rng.uniform(0.05, 0.9), rng.choice(FAULTS)) for _ in range(kills))
    if pg_restart:
        schedule = sorted([*schedule, (rng.uniform(0.25, 0.65), "pg_restart")])
    world.start_node(0)
    world.start_node(1)
    for i in range(WORKERS):
        proxy = FaultProxy(world.nodes[i % 2].port).start()  # type: ignore[union-attr]
        world.slots.append(_Slot(i, proxy, home=i % 2))
    for slot in world.slots:
        world.start_worker(slot)
    world.wait_sessions({s.name for s in world.slots})
    world.note(f"{WORKERS} workers connected; {len(schedule)} faults scheduled")

    ids = world.ids
    done = 0
    end = time.monotonic() + budget
    while True:
        world.run_due()
        counts = world.counts()
        if counts is not None:
            done = sum(n for s, n in counts.items() if s in DONE)
        while schedule and done >= schedule[0][0] * tasks:
            _, kind = schedule.pop(0)
            world.fault(kind)
        if len(ids) < tasks and counts is not None and len(ids) - done < BACKLOG:
            batch = specs[len(ids) : len(ids) + BATCH]
            reply = world.api("POST", "/v1/tasks/batch", {"tasks": batch})
            ids += [str(r["task"]["id"]) for r in reply]
            report.submitted = len(ids)
        if len(ids) == tasks and done >= tasks and not schedule and not world.pending:
            break
        if time.monotonic() > end:
            report.violations.append(
                f"timed out after {budget:.0f}s: {done}/{tasks} tasks finished, "
                f"{len(ids)} submitted, states {counts}, {len(schedule)} faults left"
            )
            return
        time.sleep(0.05)
    world.note(f"all {tasks} tasks finished")
    reviews = [
        t["id"]
        for t in _list_tasks(world, "needs_review")
        if t["state"] == "needs_review"  # the filter, double-checked
    ]
    report.needs_review = len(reviews)
    if resolve_review:
        for tid in reviews:
            world.api("POST", f"/v1/tasks/{tid}/resolve", {"decision": "failed"})
            report.resolved += 1
        world.note(f"resolved {len(reviews)} needs_review tasks as failed")


def _list_tasks(world: _Chaos, state: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = ""
    while True:
        page = world.api("GET", f"/v1/tasks?state={state}&limit=1000{cursor}")
        out += page["items"]
        if not page["next_cursor"]:
            return out
        cursor = f"&cursor={page['next_cursor']}"


def _teardown(world: _Chaos) -> None:
    """Stop the workers (each must exit 0 on SIGTERM), the relays and the nodes."""
    report = world.report
    for slot in world.slots:
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.send_signal(signal.SIGTERM)
    for slot in world.slots:
        if slot.proc is None:
            continue
        try:
            code = slot.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            slot.proc.kill()
            slot.proc.wait(10)
            code = None
        if code != 0:
            report.violations.append(
                f"worker {slot.name} ended with {code} on SIGTERM:\n{world.worker_log(slot)}"
            )
    for slot in world.slots:
        slot.proxy.close()
        report.violations += [f"proxy {slot.index}: {e}" for e in slot.proxy.errors]
    for node in world.all_nodes:
        node.stop()


def _check(url: str, world: _Chaos, report: ChaosReport, caps: dict[str, int]) -> None:
    store = open_store(url)
    try:
        events = all_events(store)
        tasks = []
        after = None
        while page_t := store.task_list(after_id=after, limit=1000):
            tasks.extend(page_t)
            after = page_t[-1].id
        attempts = {t.id: store.attempt_list(t.id) for t in tasks}
        live = store.live_attempt_counts()
        report.violations += check_all(store, caps=caps)
    finally:
        store.close()
    by_id = {t.id: t for t in tasks}
    report.states = dict(Counter(str(t.state) for t in tasks))
    report.attempts = sum(len(a) for a in attempts.values())
    report.rejected_reports = sum(1 for e in events if e["kind"] == "rejected")
    bad = report.violations
    if live:
        bad.append(f"live attempts left at rest: {live}")

    # I8: every submitted task is there and finished.
    ids = world.ids
    lost = [tid for tid in ids if tid not in by_id or by_id[tid].state not in DONE]
    report.lost_tasks = len(lost) + (report.tasks - len(ids))
    bad += [f"I8 {tid}: lost ({by_id[tid].state if tid in by_id else 'missing'})" for tid in lost]
    if len(by_id) != len(ids) or len(set(ids)) != len(ids):
        bad.append(f"{len(by_id)} tasks stored, {len(set(ids))} distinct ids submitted")

    # I2: no result committed twice (the event log), results from the right attempt.
    commits: dict[str, int] = defaultdict(int)
    for e in events:
        if e["task_to"] == "succeeded":
            commits[e["task_id"]] += 1
    report.double_commits = sum(1 for n in commits.values() if n > 1)
    for t in tasks:
        if t.state != "succeeded":
            continue
        won = [a for a in attempts[t.id] if a.state == "succeeded"]
        result = json.loads(t.result) if isinstance(t.result, str | bytes) else t.result
        got = result.get("attempt_id") if isinstance(result, dict) else None
        if len(won) != 1 or got != won[0].id:
            bad.append(f"{t.id}: result from {got}, succeeded {[a.id for a in won]}")

    # I6: an unsafe task never starts twice without a decision (or a reported failure).
    unsafe = {t.id for t in tasks if not t.retry_safe}
    may_start: dict[str, bool] = {}
    for e in events:
        tid = e["task_id"]
        if tid not in unsafe:
            continue
        if e["kind"] == "started":
            if not may_start.get(tid, True):
                report.unsafe_double_starts += 1
            may_start[tid] = False
        elif e["kind"] in ("resolved", "retried") or e["attempt_to"] == "failed":
            may_start[tid] = True

    # needs_review is for unsafe tasks only: a retry_safe one is replayed instead.
    for e in events:
        if e["task_to"] == "needs_review" and e["task_id"] not in unsafe:
            bad.append(f"{e['task_id']}: retry_safe but went to needs_review")

    # I4: occupancy replayed from the event log never above a cap.
    negatives, peaks = occupancy_replay(events)
    bad += negatives
    report.peaks = peaks
    sessions = {f"session:{s}" for s in {e["session_id"] for e in events} if s}
    for scope, n in peaks.items():
        cap = caps.get(scope, WORKER_CONCURRENCY if scope in sessions else None)
        if cap is not None and n > cap:
            bad.append(f"I4 {scope}: peak {n} live attempts, cap {cap}")
