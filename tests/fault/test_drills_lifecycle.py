"""Lifecycle drills of DESIGN §5 (scenarios 1, 2, 5 and 7) with real processes: ``orbit
server`` nodes and ``orbit worker tests.fault.drill_worker:worker`` processes, on SQLite
and PostgreSQL, SIGKILL where the scenario says kill.

The handlers are steered through marker files (see ``tests/fault/drill_worker.py``); the
test never sleeps to synchronise: it waits for a file or a state in a bounded polling
loop. Every drill ends with ``Drill.finish()``, the checks DESIGN §5 asks after every
scenario: the workers idle and then ended (SIGTERM, exit 0), no temporary file left, no
child process or zombie left, occupancy never above its cap (replayed from the event
log), and the invariants of §2 on the store at rest.

Leases are short (``--lease-ttl 2``): the runner renews at half the lease, so one renew
interval is 1 s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.core.model import Outcome, canonical_json
from orbit.core.transitions import digest
from orbit.store import open_store
from tests.e2e.conftest import db_url, nodes, tokens  # noqa: F401  (fixtures reused here)
from tests.e2e.servers import Node, Tokens
from tests.invariants import all_events, check_all, occupancy_replay

LEASE_TTL = 2.0
RENEW_INTERVAL = LEASE_TTL / 2  # the runner renews when the lease is half spent
FAST = [
    "--lease-ttl",
    str(LEASE_TTL),
    "--claim-ttl",
    "2",
    "--reap-interval",
    "0.2",
    "--poll-interval",
    "0.5",
]
REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(
    r"^(?:(?:started|go|effect|cancelled|returned)-(?P<task>[0-9A-Za-z-]+)"
    r"|run-(?P<run>[0-9A-Za-z-]+)-\d+)$"
)
TERMINAL = {"succeeded", "failed", "cancelled", "needs_review"}


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _at(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _until(what: str, check: Callable[[], Any], timeout: float, step: float = 0.02) -> Any:
    """Poll ``check`` until it returns something truthy, for at most ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < end, f"timed out after {timeout}s waiting for {what}"
        time.sleep(step)


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, command) of every process, read from /proc."""
    table: dict[int, tuple[int, str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # it ended while we looked
        rest = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(rest[1]), rest[0], cmd.strip())
    return table


def _descendants(root: int) -> list[tuple[int, str, str]]:
    table = _proc_table()
    out: list[tuple[int, str, str]] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, cmd) in table.items():
            if ppid == parent:
                out.append((pid, state, cmd))
                frontier.append(pid)
    return out


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer exists at all (not even as a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@dataclass
class Drill:
    """One scenario's processes, handler directory and checks."""

    db_url: str
    tokens: Tokens
    tmp: Path
    start_node: Callable[..., Node]
    dir: Path = field(init=False)
    worker_tmp: Path = field(init=False)
    servers: list[Node] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    clients: list[httpx.Client] = field(default_factory=list)
    tasks: set[str] = field(default_factory=set)
    caps: dict[str, int] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dir = self.tmp / "handler"
        self.worker_tmp = self.tmp / "worker-tmp"
        self.dir.mkdir()
        self.worker_tmp.mkdir()

    # ------------------------------------------------------------------ processes

    def server(self, node_id: str = "node-a") -> Node:
        node = self.start_node(node_id=node_id, args=FAST)
        self.servers.append(node)
        return node

    def client(self, node: Node) -> httpx.Client:
        api = httpx.Client(
            base_url=node.http,
            timeout=30,
            headers={"Authorization": f"Bearer {self.tokens.admin}"},
        )
        self.clients.append(api)
        return api

    def worker(self, node: Node, api: httpx.Client) -> subprocess.Popen[bytes]:
        """Start a worker process on ``node`` and wait until its session is live."""
        name = f"drill-{len(self.workers) + 1}"
        env = {
            **os.environ,
            "ORBIT_URL": node.http,
            "ORBIT_TOKEN": self.tokens.worker,
            "ORBIT_DRILL_DIR": str(self.dir),
            "ORBIT_DRILL_NAME": name,
            "TMPDIR": str(self.worker_tmp),
        }
        env.pop("ORBIT_TOKEN_FILE", None)
        with (self.tmp / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orbit.cli", "worker", "tests.fault.drill_worker:worker"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        self.workers.append(proc)

        def live() -> bool:
            assert proc.poll() is None, self.worker_log(proc)
            sessions = api.get("/v1/workers", params={"state": "live", "limit": 1000}).json()
            return any(s["name"] == name for s in sessions["items"])

        _until(f"worker {name} to connect", live, 30)
        return proc

    def worker_log(self, proc: subprocess.Popen[bytes]) -> str:
        name = f"drill-{self.workers.index(proc) + 1}"
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def kill_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL, then confirm the process is gone (reaped, not even a zombie)."""
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        assert _gone(proc.pid), f"worker {proc.pid} survived SIGKILL"

    # ------------------------------------------------------------------ API

    def queue(self, api: httpx.Client, name: str, max_concurrency: int) -> None:
        reply = api.post(
            "/v1/queues", json={"name": name, "max_concurrency": max_concurrency, "rate": 0}
        )
        assert reply.status_code in (200, 201), reply.text
        self.caps[f"queue:{name}"] = max_concurrency

    def submit(
        self, api: httpx.Client, queue: str, handler: str, payload: dict[str, Any], **kw: Any
    ) -> str:
        body = {"queue": queue, "handler": handler, "payload": payload, **kw}
        reply = api.post("/v1/tasks", json=body)
        assert reply.status_code == 201, reply.text
        task_id = str(reply.json()["task"]["id"])
        self.tasks.add(task_id)
        return task_id

    @staticmethod
    def task(api: httpx.Client, task_id: str) -> dict[str, Any]:
        reply = api.get(f"/v1/tasks/{task_id}")
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    def wait_state(
        self, api: httpx.Client, task_id: str, states: set[str], timeout: float = 20
    ) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            task = self.task(api, task_id)
            return task if task["state"] in states else None

        return dict(_until(f"{task_id} to be one of {sorted(states)}", reached, timeout))

    @staticmethod
    def events(api: httpx.Client, task_id: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 500}
            if cursor:
                params["cursor"] = cursor
            page = api.get(f"/v1/tasks/{task_id}/events", params=params).json()
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                return items

    @staticmethod
    def attempts(api: httpx.Client, task_id: str) -> list[dict[str, Any]]:
        page = api.get(f"/v1/tasks/{task_id}/attempts", params={"limit": 1000}).json()
        assert page["next_cursor"] is None  # a drill's task has a few attempts
        return list(page["items"])

    @staticmethod
    def artifacts(api: httpx.Client, task_id: str) -> list[dict[str, Any]]:
        reply = api.get(f"/v1/tasks/{task_id}/artifacts")
        assert reply.status_code == 200, reply.text
        assert reply.json()["next_cursor"] is None  # one page holds a drill's few
        return list(reply.json()["items"])

    # ------------------------------------------------------------------ markers

    def path(self, name: str) -> Path:
        return self.dir / name

    def wait_file(self, name: str, timeout: float = 20) -> float:
        """Wait for a marker; return the time the handler wrote into it."""
        path = self.dir / name
        _until(f"marker {name}", path.exists, timeout, step=0.005)
        return float(path.read_text())

    def go(self, task_id: str) -> None:
        (self.dir / f"go-{task_id}").write_text(repr(time.time()))

    def runs(self, task_id: str) -> list[str]:
        return sorted(p.name for p in self.dir.glob(f"run-{task_id}-*"))

    # ------------------------------------------------------------------ after every scenario

    def finish(self) -> None:
        """DESIGN §5, after every scenario: workers idle then ended, no temporary file,
        no child process or zombie, occupancy never above its cap; §2's invariants."""
        store = open_store(self.db_url)
        try:
            # Idle: no claimed or running attempt left anywhere, nor in the handlers.
            _until(
                "no live attempt",
                lambda: sum(int(r["n"]) for r in store.live_attempt_counts()) == 0,
                10,
            )
            for proc in self.workers:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # idle: drains and exits at once
            for proc in self.workers:
                if proc.returncode == -signal.SIGKILL:
                    continue  # killed on purpose by the scenario
                proc.wait(timeout=15)
                log = self.worker_log(proc)
                assert proc.returncode == 0, log
                assert "ignored cancellation" not in log and "Traceback" not in log, log
            for node in self.servers:
                node.stop()
            for proc in [*self.workers, *(n.proc for n in self.servers)]:
                assert _gone(proc.pid), f"process {proc.pid} still exists"
            left = _descendants(os.getpid())
            assert not left, f"child processes or zombies left: {left}"

            # No temporary file: only the drill's own markers, each for a task we made.
            for path in self.dir.iterdir():
                m = MARKER.match(path.name)
                assert m, f"unexpected file left in the handler directory: {path.name}"
                assert (m["task"] or m["run"]) in self.tasks, path.name
            assert not list(self.worker_tmp.iterdir()), list(self.worker_tmp.iterdir())

            # Occupancy never above its cap (replayed from the event log), and I1-I9.
            events = all_events(store)
            negative, peaks = occupancy_replay(events)
            assert not negative, negative
            caps = dict(self.caps)
            for s in store.session_list():
                caps[f"session:{s.id}"] = s.max_concurrency
            over = {k: (n, caps[k]) for k, n in peaks.items() if k in caps and n > caps[k]}
            assert not over, f"occupancy above cap (peak, cap): {over}"
            assert any(k.startswith("queue:") for k in peaks), "the replay saw no attempt"
            self.report["peaks"] = {k: v for k, v in peaks.items() if k.startswith("queue:")}
            violations = check_all(store, caps=self.caps)
            assert not violations, violations
        finally:
            store.close()

    def cleanup(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for node in self.servers:
            node.stop()
        for api in self.clients:
            api.close()


@pytest.fixture
def drill(
    db_url: str,  # noqa: F811
    tokens: Tokens,  # noqa: F811
    nodes: Callable[..., Node],  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Drill]:
    d = Drill(db_url, tokens, tmp_path, nodes)
    try:
        yield d
    finally:
        d.cleanup()
        if d.report:
            backend = "postgres" if db_url.startswith("postgres") else "sqlite"
            print(f"\nDRILL {request.node.name} [{backend}]: {d.report}")


def _no_success(drill: Drill, api: httpx.Client, task_id: str) -> dict[str, Any]:
    task = drill.task(api, task_id)
    assert task["result"] is None and task["result_digest"] is None, task
    assert task["result_version"] == "0", task
    events = drill.events(api, task_id)
    assert not [e for e in events if e["task_to"] == "succeeded" or e["kind"] == "succeeded"]
    assert drill.artifacts(api, task_id) == []
    return task


# ---------------------------------------------------------------------- scenario 1


def test_cancel_during_navigation(drill: Drill) -> None:
    """§5.1: a job (async handler) and its request (plain function, a child submitted with
    parent_id) both running; the job is cancelled over HTTP while the request's handler
    runs. Both end cancelled, both handlers saw it within one renew interval + 1 s, no
    result and no artifact (each handler would upload a screenshot on completion)."""
    node = drill.server()
    api = drill.client(node)
    drill.queue(api, "nav", 4)
    drill.worker(node, api)
    job = drill.submit(api, "nav", "drill.async", {"artifact": True, "effect": "after"})
    drill.wait_file(f"started-{job}")
    request = drill.submit(
        api, "nav", "drill.sync", {"artifact": True, "effect": "after"}, parent_id=job
    )
    drill.wait_file(f"started-{request}")
    assert drill.task(api, request)["state"] == "running"
    assert drill.task(api, job)["state"] == "running"

    asked = time.time()
    reply = api.post(f"/v1/tasks/{job}/cancel")
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "cancelling"
    # I7: the request was cancelled in the same transaction as its job.
    assert drill.task(api, request)["state"] in {"cancelling", "cancelled"}

    observed = {t: drill.wait_file(f"cancelled-{t}", timeout=10) - asked for t in (job, request)}
    ended = {}
    for t in (job, request):
        drill.wait_state(api, t, TERMINAL)
        ended[t] = time.time() - asked
    drill.report["cancel_seen_s"] = {"job": observed[job], "request": observed[request]}
    drill.report["cancel_to_cancelled_s"] = {"job": ended[job], "request": ended[request]}
    for t in (job, request):
        assert observed[t] <= RENEW_INTERVAL + 1.0, (t, observed)
        task = _no_success(drill, api, t)
        assert task["state"] == "cancelled", task
        attempts = drill.attempts(api, t)
        assert [a["state"] for a in attempts] == ["cancelled"], attempts
        assert not drill.path(f"effect-{t}").exists()
        assert not drill.path(f"returned-{t}").exists()
        assert drill.runs(t) == [f"run-{t}-1"]
    drill.finish()


def test_cancel_during_navigation_screenshot_arrives_after_cancel(drill: Drill) -> None:
    """§5.1, the race inside it: the request's navigation cannot be interrupted; it
    completes after the cancel committed and uploads its screenshot before it returns.
    Cancel wins the race: the task ends cancelled and no artifact may be listed."""
    node = drill.server()
    api = drill.client(node)
    drill.queue(api, "nav", 4)
    drill.worker(node, api)
    job = drill.submit(api, "nav", "drill.async", {})
    drill.wait_file(f"started-{job}")
    request = drill.submit(
        api, "nav", "drill.sync", {"artifact": True, "on_cancel": "finish"}, parent_id=job
    )
    drill.wait_file(f"started-{request}")
    reply = api.post(f"/v1/tasks/{job}/cancel")
    assert reply.status_code == 200 and reply.json()["state"] == "cancelling", reply.text
    drill.wait_file(f"cancelled-{request}")  # seen, but the navigation goes on
    assert drill.task(api, request)["state"] == "cancelling"  # the cancel has committed
    drill.go(request)
    for t in (job, request):
        assert drill.wait_state(api, t, TERMINAL)["state"] == "cancelled"
    listed = {t: drill.artifacts(api, t) for t in (job, request)}
    drill.finish()
    assert listed == {job: [], request: []}, listed


# ---------------------------------------------------------------------- scenario 2


def test_result_returns_while_cancel_commits(drill: Drill) -> None:
    """§5.2: the request's real result is delayed and reaches the server after the cancel
    committed. It is not stored: job and request stay cancelled, result null, and the
    finish-while-cancelling event keeps the result's digest as evidence."""
    node = drill.server()
    api = drill.client(node)
    drill.queue(api, "nav", 4)
    drill.worker(node, api)
    late = {"shot": "late.png", "pages": 3}
    job = drill.submit(api, "nav", "drill.async", {})
    drill.wait_file(f"started-{job}")
    request = drill.submit(
        api, "nav", "drill.async", {"on_cancel": "finish", "result": late}, parent_id=job
    )
    drill.wait_file(f"started-{request}")

    reply = api.post(f"/v1/tasks/{job}/cancel")
    assert reply.status_code == 200 and reply.json()["state"] == "cancelling", reply.text
    drill.wait_file(f"cancelled-{request}")
    assert drill.task(api, request)["state"] == "cancelling"  # committed; result not sent
    released = time.time()
    drill.go(request)  # now the real result comes back
    drill.wait_file(f"returned-{request}")
    for t in (job, request):
        assert drill.wait_state(api, t, TERMINAL)["state"] == "cancelled"
    drill.report["result_to_cancelled_s"] = time.time() - released

    _no_success(drill, api, job)
    _no_success(drill, api, request)
    attempts = drill.attempts(api, request)
    assert [a["state"] for a in attempts] == ["cancelled"], attempts
    events = drill.events(api, request)
    finish = [e for e in events if e["task_from"] == "cancelling" and e["task_to"] == "cancelled"]
    assert len(finish) == 1, events
    evidence = finish[0]["data"]
    expected = Outcome.success(late).as_json()
    assert evidence["outcome"] == expected, evidence
    assert evidence["digest"] == digest(canonical_json(expected)), evidence
    assert finish[0]["attempt_id"] == attempts[0]["id"]
    # The finish was answered (cancel wins), not refused: no rejected report.
    assert not [e for e in events if e["kind"] == "rejected"], events
    drill.finish()


# ---------------------------------------------------------------------- scenario 5


def test_hard_deadline_exhausts_retries(drill: Drill) -> None:
    """§5.5: a retry_safe task fails retryably every time; with its backoff the retries
    run into the deadline long before max_attempts: DEADLINE_EXCEEDED, no result."""
    node = drill.server()
    api = drill.client(node)
    drill.queue(api, "dl", 4)
    drill.worker(node, api)
    deadline = datetime.now(UTC) + timedelta(seconds=3)
    task_id = drill.submit(
        api,
        "dl",
        "drill.async",
        {"fail": True},
        retry_safe=True,
        max_attempts=50,
        backoff={"base": 0.4, "factor": 1, "max": 0.4},
        deadline=_iso(deadline),
    )
    task = drill.wait_state(api, task_id, TERMINAL, timeout=15)
    ended = time.time()
    assert task["state"] == "failed", task
    assert task["error"]["code"] == "DEADLINE_EXCEEDED", task
    _no_success(drill, api, task_id)
    used = task["attempts_used"]
    assert 4 <= used < task["max_attempts"], task  # three retries at least; the deadline ended it
    attempts = drill.attempts(api, task_id)
    # A claim made just before the deadline may never start: its start is refused once
    # the deadline has passed and the attempt is released there, counting no attempt
    # (the state table's claimed → released). Only the last attempt can be such a one.
    started = [a for a in attempts if a["started_at"] is not None]
    unstarted = attempts[len(started) :]
    assert attempts[: len(started)] == started, attempts
    assert [a["state"] for a in unstarted] in ([], ["released"]), attempts
    assert all(_at(a["ended_at"]) >= deadline.timestamp() for a in unstarted), attempts
    states = [a["state"] for a in started]
    # Every started attempt failed; the last one may instead have started just before the
    # deadline and had its lease end there (leases are capped at the deadline): then the
    # runner reports nothing and the reaper marks it lost. Either way, never a success.
    assert len(states) == used and states[:-1] == ["failed"] * (used - 1), attempts
    assert states[-1] in ("failed", "lost"), attempts
    assert all(_at(a["started_at"]) < deadline.timestamp() for a in started), attempts
    # Each started attempt ran its handler once, and nothing else ran; but a lost last
    # attempt may have had its lease end before its handler's first line (a start
    # granted a moment before the deadline, seen on a loaded machine): its run is optional.
    ran = [f"run-{task_id}-{n}" for n in range(1, used + 1)]
    allowed = [sorted(ran)] + ([sorted(ran[:-1])] if states[-1] == "lost" else [])
    assert drill.runs(task_id) in allowed, (drill.runs(task_id), attempts)
    failed_at = _at(task["finished_at"])
    assert failed_at <= deadline.timestamp() + 1.0, (task, deadline)  # refused at once
    drill.report["attempts"] = used
    drill.report["failed_vs_deadline_s"] = failed_at - deadline.timestamp()
    drill.report["seen_failed_vs_deadline_s"] = ended - deadline.timestamp()
    drill.finish()


# ---------------------------------------------------------------------- scenario 7


def test_crash_with_unknown_effects(drill: Drill) -> None:
    """§5.7: a task that is not retry_safe writes its external marker, then the worker
    and the server are both SIGKILLed. A new server on the same database and a new worker:
    the reaper marks the attempt `unknown` and the task `needs_review` (1 of 3 attempts
    used), the queue's only slot goes to another task, and the task is not re-run."""
    node = drill.server()
    api = drill.client(node)
    drill.queue(api, "fx", 1)  # one slot: the other task can run only once it is freed
    first = drill.worker(node, api)
    task_id = drill.submit(
        api, "fx", "drill.sync", {"effect": "before", "wait": 120}, max_attempts=3
    )
    drill.wait_file(f"effect-{task_id}")
    assert drill.task(api, task_id)["state"] == "running"

    node.kill()  # SIGKILL; confirmed gone
    drill.kill_worker(first)  # SIGKILL; confirmed gone
    killed = time.time()
    drill.servers.remove(node)

    node_b = drill.server("node-b")
    api = drill.client(node_b)
    drill.worker(node_b, api)
    other = drill.submit(api, "fx", "drill.async", {"wait": 0, "result": "other"})
    task = drill.wait_state(api, task_id, TERMINAL, timeout=20)
    reviewed = time.time() - killed
    assert task["state"] == "needs_review", task
    # The observation window: the reaper has judged the task after its lease expired
    # (the only path back to `queued` would have been that judgement), and since then the
    # new worker has claimed and completed another task of the same queue. A rerun would
    # have had to start before that: the queue has one slot, and the older task would
    # have come first had it been queued again.
    done = drill.wait_state(api, other, TERMINAL, timeout=20)
    assert done["state"] == "succeeded" and done["result"] == "other", done
    drill.report["kill_to_needs_review_s"] = reviewed
    drill.report["kill_to_other_done_s"] = time.time() - killed

    task = drill.task(api, task_id)
    assert task["state"] == "needs_review", task
    assert task["attempts_used"] == 1 and task["max_attempts"] == 3, task
    assert task["result"] is None, task
    attempts = drill.attempts(api, task_id)
    assert [a["state"] for a in attempts] == ["unknown"], attempts
    assert drill.runs(task_id) == [f"run-{task_id}-1"]  # not re-run
    assert drill.path(f"effect-{task_id}").exists()
    reaped = [e for e in drill.events(api, task_id) if e["task_to"] == "needs_review"]
    assert len(reaped) == 1 and reaped[0]["attempt_to"] == "unknown", reaped
    lease_end = _at(attempts[0]["lease_expires_at"])
    assert _at(reaped[0]["at"]) >= lease_end, (reaped, attempts)  # after the lease, not before
    drill.report["lease_end_to_needs_review_s"] = _at(reaped[0]["at"]) - lease_end  # db clock
    other_started = [e for e in drill.events(api, other) if e["kind"] == "started"]
    assert len(other_started) == 1
    assert int(other_started[0]["id"]) > int(reaped[0]["id"])  # the slot was freed by it
    drill.finish()
