"""The dispatcher against a real store (both backends), served in-process so that the
test can hold a claim in flight while a worker's connection closes or breaks.

A claim the dispatcher makes for a connection that can no longer take it must be given
back at once — the attempt released, the task queued again — not left to its claim
lease (set to ten minutes here, so only a prompt release can pass).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.exceptions import StarletteDeprecationWarning
from starlette.websockets import WebSocketDisconnect

from orbit.core.model import SECOND, Capability, Outcome, TaskSpec
from orbit.protocol.messages import Finish, Start
from orbit.server import ServerSettings, create_app, gateway
from orbit.server.gateway import Dispatcher
from orbit.store import Grants, Store, StoreConfig, open_store
from orbit.tokens import token_id
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

WAIT = 30.0  # an upper bound for events that come at once; never reached when they do


@dataclass
class Rig:
    store: Store
    client: TestClient
    dispatcher: Dispatcher
    token: str
    claiming: threading.Event  # a dispatcher claim has begun (and waits for `gate`)
    gate: threading.Event
    released: threading.Event  # an attempt_release returned
    detached: threading.Event  # a connection left the dispatcher

    def hello(self, ws: Any) -> str:
        return str(_hello(ws)["session_id"])

    def connect(self) -> Any:
        return self.client.websocket_connect(
            "/v1/worker", headers={"Authorization": f"Bearer {self.token}"}
        )


def _hello(ws: Any, *, name: str = "w", slots: int = 1, push: bool = True) -> dict[str, Any]:
    """Say hello on ``ws`` as a worker of ``slots`` for handler ``h``; the welcome."""
    ws.send_json(
        {
            "type": "hello",
            "req_id": "r1",
            "name": name,
            "max_concurrency": slots,
            "push": push,
            "capabilities": [{"handler": "h", "capacity": slots}],
        }
    )
    welcome = _receive(ws)
    assert welcome["type"] == "welcome", welcome
    return dict(welcome)


def _observe(fn: Callable[..., Any], after: threading.Event) -> Callable[..., Any]:
    def observed(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            after.set()

    return observed


def _worker_store(db_url: str, config: StoreConfig | None = None) -> tuple[Store, str]:
    """A store with a queue ``q`` (10 permits, no rate) and a worker token for it."""
    store = open_store(db_url, config)
    store.queue_create("q", max_concurrency=10, rate=0)
    return store, store.token_create("w", ["worker"])[1]


@pytest.fixture
def rig(db_url: str) -> Iterator[Rig]:
    store, token = _worker_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    claiming, gate, released, detached = (threading.Event() for _ in range(4))
    claim = store.attempt_claim_many

    def gated(*args: Any) -> Any:
        claiming.set()
        assert gate.wait(WAIT), "the test never opened the gate"
        return claim(*args)

    store.attempt_claim_many = gated  # type: ignore[method-assign]
    store.attempt_release = _observe(store.attempt_release, released)  # type: ignore[method-assign]
    app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
    try:
        with TestClient(app) as client:
            dispatcher: Dispatcher = app.state.dispatcher
            dispatcher.detach = _observe(dispatcher.detach, detached)  # type: ignore[method-assign]
            yield Rig(store, client, dispatcher, token, claiming, gate, released, detached)
            gate.set()
    finally:
        store.close()


def _assert_released(store: Store, task_id: str) -> None:
    assert store.task_get(task_id).state == "queued"
    [attempt] = store.attempt_list(task_id)
    assert attempt.state == "released"


def test_a_claim_for_a_connection_that_closed_meanwhile_is_released(rig: Rig) -> None:
    task_id = rig.store.task_submit(TaskSpec(queue="q", handler="h")).task.id
    with rig.connect() as ws:
        rig.hello(ws)
        assert rig.claiming.wait(WAIT)  # the dispatcher is claiming for this connection
    assert rig.detached.wait(WAIT)  # the connection is gone from the server
    rig.gate.set()  # now the claim completes, for a connection that has closed
    assert rig.released.wait(WAIT), "the undelivered claim was left to its lease"
    _assert_released(rig.store, task_id)


def test_a_dispatch_round_that_fails_does_not_end_dispatch(rig: Rig) -> None:
    """A round that raised (here ``offer_all``, once; a claim's own errors are caught
    inside it) ended the dispatcher's task for the node's life, unseen: every later task
    waited for another node or a restart, since the poll runs in the same loop. The
    round is logged and the next one runs."""
    rig.gate.set()  # claims run freely
    offer_all = rig.dispatcher.offer_all
    failed = threading.Event()

    async def failing_once() -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a bug in a round")
        await offer_all()

    rig.dispatcher.offer_all = failing_once  # type: ignore[method-assign]
    with rig.connect() as ws:
        rig.hello(ws)  # the attach wakes a round, which fails
        assert failed.wait(WAIT)
        task_id = rig.store.task_submit(TaskSpec(queue="q", handler="h")).task.id
        pushed = _receive(ws)
        assert pushed["type"] == "tasks", pushed
        assert [t["task_id"] for t in pushed["tasks"]] == [task_id]


def test_a_claim_whose_send_fails_is_released(rig: Rig) -> None:
    task_id = rig.store.task_submit(TaskSpec(queue="q", handler="h")).task.id
    with rig.connect() as ws:
        session_id = rig.hello(ws)
        assert rig.claiming.wait(WAIT)
        conn = rig.dispatcher.connections[session_id]

        async def broken(_: str) -> None:
            raise OSError("connection reset by peer")

        conn.ws.send_text = broken  # type: ignore[method-assign]
        rig.gate.set()
        assert rig.released.wait(WAIT), "the undelivered claim was left to its lease"
        _assert_released(rig.store, task_id)
        assert conn.closed


def test_a_cancel_for_a_worker_that_does_not_read_holds_up_no_other(db_url: str) -> None:
    """One batch of cancels for two workers on a node. The first worker's socket takes
    no bytes (its send waits, as for a worker that stopped reading): the second must
    get its cancel all the same, and the first gets its own once its socket takes
    bytes again."""
    store = open_store(db_url)
    try:
        token = store.token_create("w", ["worker"])[1]
        app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
        with TestClient(app) as client:
            events = (threading.Event() for _ in range(4))
            rig = Rig(store, client, app.state.dispatcher, token, *events)
            with rig.connect() as stuck_ws, rig.connect() as other_ws:
                stuck, other = rig.hello(stuck_ws), rig.hello(other_ws)
                conn = rig.dispatcher.connections[stuck]
                reading = threading.Event()
                send_text = conn.ws.send_text

                async def not_reading(text: str) -> None:
                    while not reading.is_set():
                        await asyncio.sleep(0.01)
                    await send_text(text)

                conn.ws.send_text = not_reading  # type: ignore[method-assign]
                rig.dispatcher.cancel_threadsafe([(stuck, "a1"), (other, "a2")])
                assert _receive(other_ws) == {"type": "cancel", "attempt_ids": ["a2"]}
                reading.set()
                assert _receive(stuck_ws) == {"type": "cancel", "attempt_ids": ["a1"]}
    finally:
        store.close()


def _receive(ws: Any) -> Any:
    """The next message on a test client's socket, waiting at most WAIT seconds."""
    got: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=lambda: got.put(ws.receive_json()), daemon=True).start()
    try:
        return got.get(timeout=WAIT)
    except queue.Empty:
        raise AssertionError("nothing arrived") from None


def _resume(ws: Any, welcome: dict[str, Any]) -> Any:
    """Resume the session ``welcome`` opened, on ``ws`` (pushes on); the reply."""
    ws.send_json(
        {
            "type": "resume",
            "req_id": "r1",
            "session_id": welcome["session_id"],
            "secret": welcome["resume_secret"],
            "push": True,
        }
    )
    return _receive(ws)


def _close_code(ws: Any) -> int:
    """The code the server closes a test client's socket with (within WAIT seconds);
    a message arriving first fails the test."""
    got: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        try:
            got.put(ws.receive_json())
        except WebSocketDisconnect as exc:
            got.put(exc)

    threading.Thread(target=read, daemon=True).start()
    try:
        outcome = got.get(timeout=WAIT)
    except queue.Empty:
        raise AssertionError("the socket was not closed") from None
    assert isinstance(outcome, WebSocketDisconnect), f"not closed: {outcome}"
    return int(outcome.code)


class Steps:
    """Stands in for ``attempt_claim_many``: each dispatcher claim waits at the gate until
    the test lets it into the store, and again before it returns to the dispatcher."""

    def __init__(self, claim: Callable[..., Grants]) -> None:
        self.claim = claim
        self.entered: queue.Queue[None] = queue.Queue()
        self.go: queue.Queue[None] = queue.Queue()
        self.done: queue.Queue[Grants] = queue.Queue()
        self.back: queue.Queue[None] = queue.Queue()

    def __call__(self, *args: Any) -> Grants:
        self.entered.put(None)
        self.go.get(timeout=WAIT)
        grants = self.claim(*args)
        self.done.put(grants)
        self.back.get(timeout=WAIT)
        return grants

    def enter(self) -> None:
        """Wait for the dispatcher's next claim to reach the gate."""
        try:
            self.entered.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError("the dispatcher made no claim: a wake was lost") from None

    def run(self) -> Grants:
        """Let the claim at the gate into the store; what it found (it then waits)."""
        self.go.put(None)
        return self.done.get(timeout=WAIT)

    def step(self) -> Grants:
        """A whole claim: wait for it, run it, and hand its answer to the dispatcher."""
        self.enter()
        grants = self.run()
        self.back.put(None)
        return grants


def test_a_permit_freed_while_a_claim_is_in_flight_wakes_the_dispatcher(tmp_path: Path) -> None:
    """The lost wakeup: a permit freed while a claim was in flight used to be judged by
    the worker's previous claim. If that one was not held back by a cap, the wake was
    skipped, and the in-flight claim — which had counted the permit as taken — left the
    worker blocked with a ready task and nothing to wake it until the poll (an hour here).

    SQLite only: on PostgreSQL the LISTEN connection's catch-up wake comes at a moment
    the test cannot order; the dispatcher's logic under test is the same on both."""
    url = f"sqlite:///{tmp_path}/orbit.db"
    store = open_store(url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        store.queue_create("q", max_concurrency=1, rate=0)
        token = store.token_create("w", ["worker"])[1]
        steps = Steps(store.attempt_claim_many)
        store.attempt_claim_many = steps  # type: ignore[method-assign]
        app = create_app(ServerSettings(db_url=url, poll_interval=3600), store=store)
        with (
            TestClient(app) as client,
            client.websocket_connect(
                "/v1/worker", headers={"Authorization": f"Bearer {token}"}
            ) as ws,
        ):
            _hello(ws, name="a", slots=2)
            first = steps.step()  # on attach: nothing ready, nothing held back
            assert not first and not first.blocked

            spec = TaskSpec(queue="q", handler="h")
            b, _ = store.session_open(
                name="b", node_id="test", capabilities=[Capability("h", 1)], max_concurrency=1
            )
            submitted = [s.task.id for s in store.task_submit_many([spec, spec])]
            steps.enter()  # the submit's wake: a claim for A waits at the gate
            [taken] = steps.claim(b.id, b.epoch, 1)  # B takes the queue's only permit
            store.attempt_start(b.id, b.epoch, taken.attempt.id, taken.attempt.fence)
            second = steps.run()
            assert not second and second.blocked  # held back by the queue's cap
            # B finishes while A's claim is still in flight: the permit is free again
            done = store.attempt_finish(
                b.id, b.epoch, taken.attempt.id, taken.attempt.fence, Outcome.success(1)
            )
            assert done.task_state == "succeeded"
            steps.back.put(None)  # now A's blocked claim returns to the dispatcher

            third = steps.step()  # the freed permit's wake was kept: A claims again
            [left] = [t for t in submitted if t != taken.task.id]
            assert [g.task.id for g in third] == [left]
            pushed = ws.receive_json()
            assert [t["task_id"] for t in pushed["tasks"]] == [left]
    finally:
        store.close()


def test_a_rate_limited_queue_drains_with_no_other_traffic(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """A real server whose poll fallback is an hour away (and claim leases ten minutes):
    a queue allowing 20 tasks a second, burst 1, gets five tasks for one pushed worker
    that never starts any, so no commit frees a permit or readies a task after the
    submit. Each claim after the first finds the bucket empty; only the dispatcher
    waking by itself when the next token is due hands out the rest."""
    node = nodes(args=["--poll-interval", "3600", "--claim-ttl", "600"])
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=auth) as admin:
        slow = {"name": "q", "max_concurrency": 10, "rate": 20, "burst": 1}
        assert admin.post("/v1/queues", json=slow).status_code == 201

    async def work() -> list[str]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("w", {"h": 10}, 10)
            batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(5)]
            async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=auth) as admin:
                reply = await admin.post("/v1/tasks/batch", json={"tasks": batch})
                assert reply.status_code == 201, reply.text
                submitted = [item["task"]["id"] for item in reply.json()]
            got: list[str] = []
            while len(got) < 5:
                pushed = await conn.next_push(WAIT)  # a bound, never a measurement
                assert len(pushed["tasks"]) == 1  # one token at a time
                got += [t["task_id"] for t in pushed["tasks"]]
            assert sorted(got) == sorted(submitted)
            return got
        finally:
            await conn.close()

    asyncio.run(work())


#: a payload near the 256 KiB limit (``DEFAULT_MAX_PAYLOAD_BYTES``), so that a stopped
#: worker's share of pushes fills its socket's kernel buffers and then the server's own
PAD = "x" * 200_000
#: The stopped worker's slots: 13 MB of payloads, far more than the loopback buffers and
#: the server's write buffer take (about 4 MB here), so however the tasks are shared out
#: while they are submitted, a push to it blocks with tasks still queued.
STOPPED_SLOTS = 64
OTHERS = 8  # tasks that only the running worker can take


def _start_worker(
    node: Node, tokens: Tokens, name: str, concurrency: int, marks: Path
) -> subprocess.Popen[bytes]:
    """``orbit worker tests.e2e.worker_app:worker``: its ``touch`` handler writes
    ``done-<task id>`` into ``marks``. Its output goes to a file, not a pipe nobody
    reads."""
    marks.mkdir()
    env = {
        **os.environ,
        "ORBIT_URL": node.http,
        "ORBIT_TOKEN": tokens.worker,
        "ORBIT_TEST_MARKS": str(marks),
        "ORBIT_TEST_NAME": name,
        "ORBIT_TEST_CONCURRENCY": str(concurrency),
    }
    with (marks.parent / f"{name}.log").open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "orbit.cli", "worker", "tests.e2e.worker_app:worker"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )


def _stop_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each worker still running (after SIGCONT: a stopped process cannot act on
    TERM), then reap them all, SIGKILL for one that does not end in 30 s."""
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    for proc in workers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _proc_state(pid: int) -> str:
    """The state letter in /proc/<pid>/stat (``T``: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]  # the command name may hold spaces


def _until(what: str, done: Callable[[], bool], timeout: float = WAIT) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.05)


def test_a_worker_that_stops_reading_does_not_hold_up_dispatch_to_the_others(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens, tmp_path: Path
) -> None:
    """Two real workers on one node and one queue; the first is SIGSTOPped, so it no
    longer reads its socket. Tasks with large payloads are then submitted one by one
    (on PostgreSQL through a second node, so the first hears of them by NOTIFY). The
    dispatcher offers each to the stopped worker first (it attached first) until that
    worker's socket and the server's write buffer are full. The running worker must
    still get and finish the tasks the stopped one has no slots for: a push that waits
    for a worker to read may not hold up the others'. Claim leases and sessions are
    long (ten minutes) so that only dispatch can hand out a task here. Once the stopped
    worker continues, it reads what was pushed to it and every task succeeds."""
    long = ["--claim-ttl", "600", "--session-ttl", "600"]
    node = nodes(args=long)
    entry = nodes(node_id="node-b", args=long) if db_url.startswith("postgres") else node
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    workers: list[subprocess.Popen[bytes]] = []
    with httpx.Client(base_url=entry.http, timeout=30, headers=auth) as api:
        queue_spec = {"name": "q", "max_concurrency": 1000, "rate": 0}
        assert api.post("/v1/queues", json=queue_spec).status_code == 201

        def submit(payload: Any) -> str:
            spec = {"queue": "q", "handler": "touch", "payload": payload}
            reply = api.post("/v1/tasks", json=spec)
            assert reply.status_code == 201, reply.text
            return str(reply.json()["task"]["id"])

        def in_state(state: str) -> list[Any]:  # one of them, if any
            reply = api.get("/v1/tasks", params={"queue": "q", "state": state, "limit": 1})
            return list(reply.json()["items"])

        def done(marks: Path) -> int:
            return len(list(marks.glob("done-*")))

        try:
            stalled_marks, running_marks = tmp_path / "stalled", tmp_path / "running"
            stalled = _start_worker(node, tokens, "stalled", STOPPED_SLOTS, stalled_marks)
            workers.append(stalled)
            first = submit(None)  # ran by the stalled worker: it is attached, and first
            _until("the first worker ran a task", (stalled_marks / f"done-{first}").exists)
            running = _start_worker(node, tokens, "running", 4, running_marks)
            workers.append(running)
            _until(
                "the second worker attached",
                lambda: "running" in {w["name"] for w in api.get("/v1/workers").json()["items"]},
            )
            stalled.send_signal(signal.SIGSTOP)
            _until("the first worker is stopped", lambda: _proc_state(stalled.pid) == "T")

            ids = [submit({"i": i, "pad": PAD}) for i in range(STOPPED_SLOTS + OTHERS)]
            # The stopped worker holds at most its slots; every other task is the running
            # worker's to claim and finish.
            _until("no task is left queued", lambda: not in_state("queued"))

            stalled.send_signal(signal.SIGCONT)
            for task_id in ids:  # nothing was lost: what the stopped worker held, it runs
                _until(
                    f"task {task_id} succeeded",
                    lambda t=task_id: api.get(f"/v1/tasks/{t}").json()["state"] == "succeeded",
                )
            assert done(stalled_marks) + done(running_marks) == len(ids) + 1
        finally:
            _stop_workers(workers)


def _server_sides(port: int, pid: int) -> dict[int, int]:
    """The server's established connections to process ``pid``'s sockets (a worker's):
    for each, the worker's port and the bytes the server has queued for it and not yet
    had acknowledged (``tx_queue`` in /proc/net/tcp)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    owned = {
        target.removeprefix("socket:[").removesuffix("]")
        for fd in Path(f"/proc/{pid}/fd").iterdir()
        if (target := os.readlink(fd)).startswith("socket:[")
    }
    worker_ports = {
        int(row[1].split(":")[1], 16)
        for row in rows
        if row[9] in owned and int(row[2].split(":")[1], 16) == port
    }
    return {
        int(row[2].split(":")[1], 16): int(row[4].split(":")[0], 16)
        for row in rows
        if row[3] == "01"  # ESTABLISHED
        and int(row[1].split(":")[1], 16) == port
        and int(row[2].split(":")[1], 16) in worker_ports
    }


def test_a_worker_that_reads_nothing_for_a_session_ttl_is_disconnected(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens, tmp_path: Path
) -> None:
    """A SIGSTOPped worker's kernel keeps acknowledging TCP's window probes, so TCP never
    gives up on its connection: the server kept it, with the pushes waiting in it, for
    as long as the process lived (uvicorn's keepalive close waits to flush them first).
    The node's socket now has a user timeout of one session TTL (5 s here): once the
    pushes fill the stopped worker's window, the kernel drops the connection after that
    long. Checked on the server's side of the connection in /proc/net/tcp: first its
    unacknowledged bytes (the stall), then its absence. After SIGCONT the worker finds
    its connection reset, starts a new session (its old one expired) and runs every
    task: nothing pushed into the dropped connection is lost."""
    ttl = ["--claim-ttl", "600", "--session-ttl", "5"]
    node = nodes(args=ttl)
    entry = nodes(node_id="node-b", args=ttl) if db_url.startswith("postgres") else node
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=entry.http, timeout=30, headers=auth) as api:
        queue_spec = {"name": "q", "max_concurrency": 1000, "rate": 0}
        assert api.post("/v1/queues", json=queue_spec).status_code == 201
        marks = tmp_path / "stalled"
        worker = _start_worker(node, tokens, "stalled", STOPPED_SLOTS, marks)
        try:
            first = api.post("/v1/tasks", json={"queue": "q", "handler": "touch"})
            _until("the worker ran a task", (marks / f"done-{first.json()['task']['id']}").exists)
            [worker_port] = _server_sides(node.port, worker.pid)
            worker.send_signal(signal.SIGSTOP)
            _until("the worker is stopped", lambda: _proc_state(worker.pid) == "T")

            batch = [
                {"queue": "q", "handler": "touch", "payload": {"i": i, "pad": PAD}}
                for i in range(STOPPED_SLOTS)
            ]
            reply = api.post("/v1/tasks/batch", params={"reply": "ids"}, json={"tasks": batch})
            assert reply.status_code == 201, reply.text
            ids = [item["id"] for item in reply.json()]
            _until(
                "the pushes wait in the stopped worker's connection",
                lambda: _server_sides(node.port, worker.pid).get(worker_port, 0) > 0,
            )
            _until(
                "the server dropped the connection",
                lambda: worker_port not in _server_sides(node.port, worker.pid),
            )

            worker.send_signal(signal.SIGCONT)
            for task_id in ids:
                _until(
                    f"task {task_id} succeeded",
                    lambda t=task_id: api.get(f"/v1/tasks/{t}").json()["state"] == "succeeded",
                )
        finally:
            _stop_workers([worker])


def test_a_handler_added_by_a_capacity_update_is_pushed(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """Two pushed workers of handler ``h``; the second then adds handler ``g`` with a
    ``capacity`` update. A ``g`` task must be pushed to it. The dispatcher skips, within
    a round, every worker whose handlers are among those a claim that nothing held back
    has emptied; it judged the second worker by the handlers it said at ``hello``, so the
    first worker's empty claim for ``h`` skipped it in every round, and the task stayed
    queued (the poll fallback is an hour away here, and runs the same rounds)."""
    node = nodes(args=["--poll-interval", "3600"])
    auth = {"Authorization": f"Bearer {tokens.admin}"}

    async def work() -> None:
        narrow = await WorkerConnection.connect(node.ws, tokens.worker)
        wide = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await narrow.hello("narrow", {"h": 1}, 1)
            await wide.hello("wide", {"h": 1}, 1)
            capacity = {
                "type": "capacity",
                "seq": "1",
                "max_concurrency": 2,
                "capabilities": [{"handler": "h", "capacity": 1}, {"handler": "g", "capacity": 1}],
            }
            assert (await wide.request(capacity))["op"] == "capacity"
            async with httpx.AsyncClient(base_url=node.http, timeout=30, headers=auth) as api:
                spec = {"name": "q", "max_concurrency": 10, "rate": 0}
                assert (await api.post("/v1/queues", json=spec)).status_code == 201
                reply = await api.post("/v1/tasks", json={"queue": "q", "handler": "g"})
                assert reply.status_code == 201, reply.text
                task_id = reply.json()["task"]["id"]
            pushed = await wide.next_push(WAIT)  # a bound, never a measurement
            assert [t["task_id"] for t in pushed["tasks"]] == [task_id]
        finally:
            await narrow.close()
            await wide.close()

    asyncio.run(work())


def test_reports_overlap_and_other_requests_wait_for_them(db_url: str) -> None:
    """What the req_id echo rule's last point promises (docs/protocol.md): up to four
    reports of one connection (here a ``start``) are in the store at once and answered
    as each completes, so a ``heartbeat`` sent after a start still in the store is
    answered first; any other request (here a ``release``) waits for the reports before
    it. The docs used to say that every request was handled one at a time, in order."""
    store, token = _worker_store(db_url)
    try:
        task_id = store.task_submit(TaskSpec(queue="q", handler="h")).task.id
        starting, finish_start = threading.Event(), threading.Event()
        start = store.attempt_start

        def held(*args: Any) -> Any:
            starting.set()
            assert finish_start.wait(WAIT), "the test never let the start finish"
            return start(*args)

        store.attempt_start = held  # type: ignore[method-assign]
        app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
        with (
            TestClient(app) as client,
            client.websocket_connect(
                "/v1/worker", headers={"Authorization": f"Bearer {token}"}
            ) as ws,
        ):
            _hello(ws, push=False)
            ws.send_json({"type": "claim", "req_id": "r2", "n": 1})
            [task] = _receive(ws)["tasks"]
            assert task["task_id"] == task_id
            attempt = {"attempt_id": task["attempt_id"], "fence": task["fence"]}
            ws.send_json({"type": "start", "req_id": "r3", **attempt})
            assert starting.wait(WAIT)
            ws.send_json({"type": "heartbeat", "req_id": "r4"})
            assert _receive(ws) == {"type": "ack", "req_id": "r4", "op": "heartbeat"}
            ws.send_json({"type": "release", "req_id": "r5", **attempt})
            finish_start.set()
            started = _receive(ws)
            assert started["type"] == "started" and started["req_id"] == "r3", started
            refused = _receive(ws)  # the release came after the start: judged after it
            assert refused["req_id"] == "r5" and refused["code"] == "NOT_CLAIMED", refused
    finally:
        store.close()


def test_two_resumes_that_cross_leave_the_newer_epoch_attached(db_url: str) -> None:
    """Two connections resume one session on one node at once. The first resume
    commits (epoch 2) but is slow to attach; the second commits (epoch 3) and attaches
    first. When the first then attaches, it is the one superseded, and is closed with
    4409. The node used to close the epoch-3 connection, the session's current one,
    instead, and keep the fenced epoch-2 connection as the session's: the worker holding
    the current epoch lost its connection, and nothing attached could work."""
    store = open_store(db_url)
    try:
        token = store.token_create("w", ["worker"])[1]
        session, secret = store.session_open(
            name="w", node_id="test", capabilities=[Capability("h", 1)], max_concurrency=1
        )
        resumed_slowly, go_on = threading.Event(), threading.Event()
        resume = store.session_resume
        calls = 0

        def slow_first(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            first = calls == 1
            resumed = resume(*args, **kwargs)
            if first:
                resumed_slowly.set()
                assert go_on.wait(WAIT), "the test never let the first resume go on"
            return resumed

        store.session_resume = slow_first  # type: ignore[method-assign]
        app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
        auth = {"Authorization": f"Bearer {token}"}
        resume_msg = {"type": "resume", "session_id": session.id, "secret": secret, "push": False}
        with (
            TestClient(app) as client,
            client.websocket_connect("/v1/worker", headers=auth) as older,
            client.websocket_connect("/v1/worker", headers=auth) as newer,
        ):
            older.send_json({**resume_msg, "req_id": "r1"})
            assert resumed_slowly.wait(WAIT)
            newer.send_json({**resume_msg, "req_id": "r1"})
            assert _receive(newer)["epoch"] == "3"
            go_on.set()
            assert _receive(older)["epoch"] == "2"
            # The epoch-2 connection is the superseded one: it is closed, not the other.
            assert _close_code(older) == 4409
            newer.send_json({"type": "heartbeat", "req_id": "r2"})
            assert _receive(newer) == {"type": "ack", "req_id": "r2", "op": "heartbeat"}
    finally:
        store.close()


def test_a_claim_undelivered_because_of_a_resume_here_is_released(db_url: str) -> None:
    """A push worker's claim commits for its connection (epoch 1); before the claim is
    back in the dispatcher, the worker resumes its session on the same node (epoch 2),
    which closes the first connection. The claimed tasks cannot be sent, and nobody has
    them: their release, made in the name of epoch 1, was refused (FENCED_EPOCH), so the
    attempts stayed claimed for the session, filling its one slot, and the resumed
    connection got nothing until the claim lease (ten minutes here) ran out. They are
    released under the session's current epoch instead, and pushed to the resumed
    connection."""
    store, token = _worker_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        task_id = store.task_submit(TaskSpec(queue="q", handler="h")).task.id
        claimed, back = threading.Event(), threading.Event()
        claim = store.attempt_claim_many

        def first_held(*args: Any) -> Grants:
            grants = claim(*args)
            if not claimed.is_set():  # the first claim: committed, then held
                claimed.set()
                assert back.wait(WAIT), "the test never let the claim return"
            return grants

        store.attempt_claim_many = first_held  # type: ignore[method-assign]
        app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
        auth = {"Authorization": f"Bearer {token}"}
        with (
            TestClient(app) as client,
            client.websocket_connect("/v1/worker", headers=auth) as first,
        ):
            welcome = _hello(first)
            assert claimed.wait(WAIT)  # the task is claimed for epoch 1
            assert store.task_get(task_id).state == "claimed"
            with client.websocket_connect("/v1/worker", headers=auth) as second:
                assert _resume(second, welcome)["epoch"] == "2"
                assert _close_code(first) == 4409
                back.set()  # the claim reaches the dispatcher: its connection is closed
                pushed = _receive(second)
                assert [t["task_id"] for t in pushed["tasks"]] == [task_id], pushed
                assert pushed["tasks"][0]["fence"] == "2"  # a new attempt, the first released
    finally:
        store.close()


def _told_after(store: Store, method: str) -> threading.Event:
    """Replace the store's ``method`` by one that sets the returned event once a call of
    it has returned (or raised): the test waits on that, not on a guess of time."""
    done = threading.Event()
    call = getattr(store, method)

    def then_tell(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        finally:
            done.set()

    setattr(store, method, then_tell)
    return done


def _revoke_on_reading(
    monkeypatch: pytest.MonkeyPatch, app: Any, token: str, kind: type[Any]
) -> None:
    """Have the node hear that ``token`` was revoked while a worker's request of ``kind``
    waits to be read: as the gateway reads it, the revoke's close comes first."""
    read = gateway.read_request

    def read_then_revoke(frame: str | bytes) -> Any:
        msg = read(frame)
        if isinstance(msg, kind):
            app.state.dispatcher.close_revoked([token_id(token)])
        return msg

    monkeypatch.setattr(gateway, "read_request", read_then_revoke)


@dataclass
class StalledPush:
    """A worker attached to an in-process node, whose socket takes no bytes (a worker
    that stopped reading it), and the push of a task's claim waiting in the send."""

    store: Store
    app: Any
    client: TestClient
    ws: Any
    welcome: dict[str, Any]
    conn: Any
    task_id: str
    token: str


@contextmanager
def _a_stalled_push(store: Store, token: str, db_url: str) -> Iterator[StalledPush]:
    """A node on ``store``, a worker attached with ``token`` whose socket takes no bytes
    (each send waits for ever), and a task submitted and claimed for it: yielded once
    the push of its claim has begun waiting."""
    app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
    auth = {"Authorization": f"Bearer {token}"}
    with (
        TestClient(app) as client,
        client.websocket_connect("/v1/worker", headers=auth) as ws,
    ):
        welcome = _hello(ws)
        conn = app.state.dispatcher.connections[welcome["session_id"]]
        waiting = threading.Event()
        never = asyncio.Event()

        async def takes_no_bytes(text: str) -> None:
            waiting.set()
            await never.wait()

        conn.ws.send_text = takes_no_bytes
        task_id = store.task_submit(TaskSpec(queue="q", handler="h")).task.id
        assert waiting.wait(WAIT)  # claimed, its push waiting
        yield StalledPush(store, app, client, ws, welcome, conn, task_id, token)


def test_a_push_waiting_for_a_socket_fenced_by_a_resume_is_released(db_url: str) -> None:
    """A push worker's socket takes no bytes (a half-open link: its worker has gone on
    over another), so the push of its claim waits in the send. The worker resumes on a
    new connection, which closes the old one (4409): the waiting push is cancelled and its
    attempt released at once, and the task goes to the resumed connection. Before, the
    push went on waiting on the old socket, and the attempt held the session's one slot
    until its claim lease (ten minutes here) ran out."""
    store, token = _worker_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        with _a_stalled_push(store, token, db_url) as stalled:
            task_id = stalled.task_id
            assert store.task_get(task_id).state == "claimed"  # for epoch 1
            auth = {"Authorization": f"Bearer {token}"}
            with stalled.client.websocket_connect("/v1/worker", headers=auth) as second:
                assert _resume(second, stalled.welcome)["epoch"] == "2"
                pushed = _receive(second)
                assert [t["task_id"] for t in pushed["tasks"]] == [task_id], pushed
                assert pushed["tasks"][0]["fence"] == "2"  # a new attempt, the first released
            # the push is over (cancelled); its done callback, which takes it out of the
            # backlog, may still be on its way on the node's loop
            assert all(push.done() for push in stalled.conn.backlog)
        [old, new] = store.attempt_list(task_id)
        assert (old.state, new.state) == ("released", "claimed")
    finally:
        store.close()


@contextmanager
def _a_pushed_task(
    store: Store, token: str, db_url: str
) -> Iterator[tuple[Any, Any, str, dict[str, str]]]:
    """A node on ``store``, a worker attached with ``token`` (pushes on), and a task
    claimed and pushed to it: the app, the worker's socket, the task's id and its
    attempt (``attempt_id`` and ``fence``, as a report names them)."""
    app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
    auth = {"Authorization": f"Bearer {token}"}
    with (
        TestClient(app) as client,
        client.websocket_connect("/v1/worker", headers=auth) as ws,
    ):
        _hello(ws)
        task_id = store.task_submit(TaskSpec(queue="q", handler="h")).task.id
        [pushed] = _receive(ws)["tasks"]
        yield app, ws, task_id, {"attempt_id": pushed["attempt_id"], "fence": pushed["fence"]}


def test_a_request_read_after_a_close_for_a_revoked_token_is_not_acted_on(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's ``start`` waits to be read while its node hears that the worker's token
    was revoked: the connection is closed (4401) and its claims are released. The serve
    loop then read the start and ran it beside the release: when it won, the attempt was
    started for a worker that would never hear of it (its connection closed, its token
    unusable), and the task, which never ran, waited for its lease to end and then went
    to needs_review. A request read after the close is not acted on now: the start is
    never made, and the task is queued again at once."""
    store, token = _worker_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        starts: list[Any] = []
        start = store.attempt_start

        def counted(*args: Any) -> Any:
            starts.append(args)
            return start(*args)

        store.attempt_start = counted  # type: ignore[method-assign]
        released = _told_after(store, "session_release_claims")
        with _a_pushed_task(store, token, db_url) as (app, ws, task_id, attempt):
            _revoke_on_reading(monkeypatch, app, token, Start)
            ws.send_json({"type": "start", "req_id": "r2", **attempt})
            assert _close_code(ws) == 4401
            assert released.wait(WAIT)
        assert starts == []
        task = store.task_get(task_id)
        assert (task.state, task.attempts_used) == ("queued", 0)
    finally:
        store.close()


def test_a_finish_read_after_a_close_for_a_revoked_token_is_taken(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a request that would begin work (a start, a claim) is dropped once its
    connection is closed: a ``finish`` waiting to be read when the revoke is heard still
    commits its result (a revoke ends no session and changes no epoch), where dropping it
    would have had the finished task run again after its lease."""
    store, token = _worker_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        finished = _told_after(store, "attempt_finish_many")
        with _a_pushed_task(store, token, db_url) as (app, ws, task_id, attempt):
            _revoke_on_reading(monkeypatch, app, token, Finish)
            ws.send_json({"type": "start", "req_id": "r2", **attempt})
            assert _receive(ws)["type"] == "started"
            outcome = {"ok": True, "result": 1}
            ws.send_json({"type": "finish", "req_id": "r3", **attempt, "outcome": outcome})
            assert _close_code(ws) == 4401
            assert finished.wait(WAIT)
        assert store.task_get(task_id).state == "succeeded"
    finally:
        store.close()


def test_a_revoke_leaves_a_waiting_push_to_its_own_release(db_url: str) -> None:
    """A push waits for a socket that takes no bytes when the worker's token is revoked:
    the close (4401) leaves the push waiting, and the revoke's release gives its attempt
    back with the code ``TOKEN_REVOKED``, alone. Cancelling the push there released the
    attempt beside it, and the two raced: the release event lost its code, or a refused
    release no worker sent left a ``rejected`` event."""
    store, token = _worker_store(db_url, StoreConfig(claim_ttl_us=600 * SECOND))
    try:
        released = _told_after(store, "session_release_claims")
        with _a_stalled_push(store, token, db_url) as stalled:
            task_id = stalled.task_id
            dispatcher = stalled.app.state.dispatcher
            stalled.client.portal.call(dispatcher.close_revoked, [token_id(token)])
            assert _close_code(stalled.ws) == 4401
            assert released.wait(WAIT)
            # still waiting: not cancelled, so not released a second time
            assert stalled.conn.pushes
        events = [(e["kind"], e["code"]) for e in store.event_list(task_id=task_id)]
        assert events[-1] == ("released", "TOKEN_REVOKED"), events
        assert not any(kind == "rejected" for kind, _ in events), events
    finally:
        store.close()


def test_a_drain_from_a_connection_still_open_after_a_resume_elsewhere_is_refused(
    db_url: str,
) -> None:
    """A drain a fenced connection sends before its node closes it (the resume's NOTIFY
    closes it at once; this is the window before) carries the connection's epoch and is
    refused, leaving the session undrained: a drain once ignored the epoch and drained
    the session its new connection was using. The resume is made on the node's own store
    here, whose notices the node skips, so the connection stays open for the drain
    (tests/e2e/test_cluster.py shows a resume on another node closing it)."""
    store = open_store(db_url)
    try:
        token = store.token_create("w", ["worker"])[1]
        app = create_app(ServerSettings(db_url=db_url, poll_interval=3600), store=store)
        auth = {"Authorization": f"Bearer {token}"}
        with TestClient(app) as client, client.websocket_connect("/v1/worker", headers=auth) as ws:
            welcome = _hello(ws, push=False)
            session_id = str(welcome["session_id"])
            resumed = store.session_resume(session_id, welcome["resume_secret"], node_id="b")
            assert resumed.epoch == 2
            ws.send_json({"type": "drain", "req_id": "r2"})
            refused = _receive(ws)
            assert (refused["type"], refused["code"]) == ("error", "FENCED_EPOCH"), refused
            assert _close_code(ws) == 4409
        session = store.session_get(session_id)
        assert session.epoch == 2 and not session.draining
    finally:
        store.close()
