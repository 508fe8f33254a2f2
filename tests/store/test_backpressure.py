"""Backpressure: a queue's and a tenant's ``max_queued`` (docs/concepts.md,
"Backpressure"), on SQLite and PostgreSQL.

A submit that would leave a capped scope with more waiting tasks (queued or scheduled)
than its cap is refused whole, QUEUE_FULL or TENANT_FULL, and writes nothing: no task, no
event. A batch making more new tasks in a scope than its cap is BATCH_EXCEEDS_CAP: it can
never fit, so it is not answered as a wait. An idempotent resubmit adds nothing and is
never refused. Two nodes submitting at once on PostgreSQL never pass a cap together."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from orbit.core.errors import Backpressure, Code, OrbitError
from orbit.core.model import TaskSpec
from orbit.protocol.submissions import UsualBatch
from orbit.store import Store
from orbit.store import store as store_module
from orbit.store.store import KEEP, retry_after
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import (
    RACE_WAIT,
    claim_one,
    queue,
    submit,
    until_done_or_waiting_on_a_lock,
    worker,
)


def _spec(queue: str = "q", **kw: Any) -> TaskSpec:
    return TaskSpec(queue=queue, handler="h", **kw)


def _counts(store: Store) -> tuple[int, int]:
    """Tasks and events in the store: what a refused submit must leave as they were."""
    return sum(store.task_counts().values()), len(store.event_list(limit=100_000))


def _capped(store: Store, max_queued: int, **kw: Any) -> None:
    store.queue_create("q", max_concurrency=10, rate=0, max_queued=max_queued, **kw)


def test_a_submit_past_a_queue_cap_is_refused_and_writes_nothing(store: Store) -> None:
    _capped(store, 2)
    submit(store)
    submit(store)
    before = _counts(store)
    with pytest.raises(Backpressure) as refused:
        submit(store)
    assert refused.value.code == Code.QUEUE_FULL and refused.value.status == 429
    assert refused.value.scope == "q" and refused.value.retry_after == 1
    assert "max_queued 2" in refused.value.message
    assert _counts(store) == before
    assert check_all(store) == []


def test_a_batch_crossing_the_cap_is_refused_whole(store: Store) -> None:
    _capped(store, 5)
    store.task_submit_many([_spec() for _ in range(3)])
    before = _counts(store)
    with pytest.raises(Backpressure):
        store.task_submit_many([_spec() for _ in range(3)])  # 2 would fit, 3 do not
    assert _counts(store) == before
    store.task_submit_many([_spec() for _ in range(2)])  # exactly to the cap
    assert store.task_counts() == {"queued": 5}


def _never_fits(store: Store, specs: Any) -> OrbitError:
    """The refusal of a batch that can never fit; it must have written nothing."""
    before = _counts(store)
    with pytest.raises(OrbitError) as refused:
        if isinstance(specs, UsualBatch):
            store.task_submit_rendered(specs, lambda done: done)
        else:
            store.task_submit_many(specs)
    assert _counts(store) == before
    return refused.value


def test_a_batch_larger_than_the_cap_is_refused_for_good(store: Store) -> None:
    """More new tasks than the cap can never fit, however long the submitter waits: it is
    BATCH_EXCEEDS_CAP (413), which no client retries, not QUEUE_FULL (429) with a
    Retry-After, which a well-behaved client retries for ever. Empty queue or not."""
    _capped(store, 2)
    refused = _never_fits(store, [_spec() for _ in range(3)])
    assert not isinstance(refused, Backpressure)
    assert refused.code == Code.BATCH_EXCEEDS_CAP and refused.status == 413
    assert "queue 'q' has max_queued 2" in refused.message
    assert "3 new tasks" in refused.message and "batch of 3" in refused.message
    store.task_submit_many([_spec(), _spec()])  # a batch of the cap fits
    assert _counts(store) == (2, 3)  # the queue.created and two submitted events
    # full now, and still the answer that no wait helps
    assert _never_fits(store, [_spec() for _ in range(3)]).code == Code.BATCH_EXCEEDS_CAP


def test_a_batch_past_a_tenant_cap_across_queues_is_refused_for_good(store: Store) -> None:
    """A tenant's count is its new tasks in every queue of the batch; a queue's, its own
    (of every tenant): a batch spread over two queues can fit each of them."""
    queue(store, "a")
    queue(store, "b")
    store.tenant_limit_set("acme", max_queued=3)
    specs = [_spec("a", tenant="acme"), _spec("b", tenant="acme")] * 2
    refused = _never_fits(store, specs)
    assert refused.code == Code.BATCH_EXCEEDS_CAP and "tenant 'acme'" in refused.message
    assert "4 new tasks" in refused.message
    store.tenant_limit_set("acme", max_queued=None)
    store.queue_update("a", max_queued=2)
    store.queue_update("b", max_queued=2)
    assert len(store.task_submit_many(specs)) == 4  # two in each queue: each cap holds


def test_tasks_already_made_do_not_count_toward_a_batch_past_the_cap(store: Store) -> None:
    """Only the tasks a batch makes are weighed: a batch of more than the cap whose keys
    name tasks already made (or repeat in it) is an idempotent retry, answered with them or
    refused as full (a wait can help), never told it cannot fit."""
    _capped(store, 3)
    for k in ("k1", "k2"):
        store.task_submit(_spec(idempotency_key=k))
    keyed = [_spec(idempotency_key=k) for k in ("k1", "k2", "k3", "k3")]
    assert [m.created for m in store.task_submit_many(keyed)] == [False, False, True, False]
    before = _counts(store)
    with pytest.raises(Backpressure) as full:  # one new task, at a full queue
        store.task_submit_many([_spec(idempotency_key=k) for k in ("k1", "k2", "k3", "k4")])
    assert full.value.code == Code.QUEUE_FULL and _counts(store) == before
    again = [_spec(idempotency_key=k) for k in ("k1", "k5", "k6", "k7", "k8")]
    refused = _never_fits(store, again)  # four new tasks: more than the cap
    assert refused.code == Code.BATCH_EXCEEDS_CAP and "4 new tasks" in refused.message


def test_a_batch_that_can_never_fit_is_told_so_at_a_full_queue(store: Store) -> None:
    """The queue is full (a wait can help) and the batch passes the tenant's cap (no wait
    can): the answer is the one no wait helps, whichever scope is counted first, or the
    client would wait for room, be told the batch never fits, and have waited for
    nothing."""
    _capped(store, 3)
    for _ in range(3):
        submit(store)
    store.tenant_limit_set("acme", max_queued=2)
    refused = _never_fits(store, [_spec(tenant="acme") for _ in range(3)])
    assert refused.code == Code.BATCH_EXCEEDS_CAP and "tenant 'acme'" in refused.message


def test_a_streamed_batch_is_counted_whole(store: Store) -> None:
    """A batch past SUBMIT_CHUNK goes in chunks: the cap is weighed before the first."""
    cap = store_module.SUBMIT_CHUNK + 10
    _capped(store, cap)
    refused = _never_fits(store, [_spec() for _ in range(cap + 1)])
    assert refused.code == Code.BATCH_EXCEEDS_CAP
    submit(store)
    before = _counts(store)
    with pytest.raises(Backpressure):  # one waits: the cap's worth passes it by one
        store.task_submit_many([_spec() for _ in range(cap)])
    assert _counts(store) == before
    store.task_submit_many([_spec() for _ in range(cap - 1)])


def test_a_batch_read_a_chunk_at_a_time_is_weighed_whole(store: Store) -> None:
    """The HTTP reader's batch (``UsualBatch``) over SUBMIT_CHUNK: its tenants are known
    before the transaction, and its tasks are read whole for the count."""
    store.queue_create("q", max_concurrency=10, rate=0)
    n = store_module.SUBMIT_CHUNK + 51
    store.tenant_limit_set("acme", max_queued=n - 1)
    raw = {"tasks": [{"queue": "q", "handler": "h", "tenant": "acme"} for _ in range(n)]}
    batch = UsualBatch.of(raw)
    assert batch is not None and batch.tenants == {"acme"}
    assert _never_fits(store, batch).code == Code.BATCH_EXCEEDS_CAP
    store.tenant_limit_set("acme", max_queued=n)
    submit(store, tenant="acme")
    before = _counts(store)
    with pytest.raises(Backpressure) as refused:
        store.task_submit_rendered(batch, lambda done: done)
    assert refused.value.code == Code.TENANT_FULL
    assert _counts(store) == before
    store.tenant_limit_set("acme", max_queued=n + 1)
    assert len(store.task_submit_rendered(batch, lambda done: done)) == n


def test_an_idempotent_resubmit_at_a_full_queue_returns_the_existing_task(store: Store) -> None:
    _capped(store, 2)
    first = store.task_submit(_spec(idempotency_key="k1", payload={"a": 1}))
    submit(store)
    again = store.task_submit(_spec(idempotency_key="k1", payload={"a": 1}))
    assert (again.created, again.task.id) == (False, first.task.id)
    # A batch of retries and one new task: refused for the new one alone.
    with pytest.raises(Backpressure):
        store.task_submit_many([_spec(idempotency_key="k1", payload={"a": 1}), _spec()])
    # A key repeated in one batch makes one task: it counts once.
    store.queue_update("q", max_queued=3)
    made = store.task_submit_many([_spec(idempotency_key="k2"), _spec(idempotency_key="k2")])
    assert [m.created for m in made] == [True, False]
    assert store.task_counts() == {"queued": 3}


def test_scheduled_tasks_count_and_claimed_ones_do_not(store: Store, clock: ManualClock) -> None:
    _capped(store, 2)
    session, _ = worker(store)
    submit(store, run_after=clock.now + 60_000_000)  # scheduled: waiting all the same
    submit(store)
    with pytest.raises(Backpressure):
        submit(store)
    claim_one(store, session)  # the queued one leaves the count once claimed
    submit(store)
    with pytest.raises(Backpressure):
        submit(store)


def test_a_tenant_cap_counts_across_queues(store: Store) -> None:
    queue(store, "a")
    queue(store, "b")
    store.tenant_limit_set("acme", max_queued=2)
    assert store.tenant_queued_get("acme") == 2 and store.tenant_limit_get("acme") is None
    submit(store, "a", tenant="acme")
    submit(store, "b", tenant="acme")
    submit(store, "a")  # another tenant: not counted
    before = _counts(store)
    with pytest.raises(Backpressure) as refused:
        submit(store, "b", tenant="acme")
    assert refused.value.code == Code.TENANT_FULL and refused.value.scope == "acme"
    assert _counts(store) == before


def test_the_queue_cap_and_the_tenant_cap_both_hold(store: Store) -> None:
    _capped(store, 3)
    store.tenant_limit_set("acme", max_queued=1)
    submit(store, tenant="acme")
    with pytest.raises(Backpressure) as refused:
        submit(store, tenant="acme")
    assert refused.value.code == Code.TENANT_FULL
    submit(store)
    submit(store)
    with pytest.raises(Backpressure) as refused:
        submit(store)
    assert refused.value.code == Code.QUEUE_FULL


def test_a_lowered_cap_refuses_submits_and_touches_nothing_queued(store: Store) -> None:
    _capped(store, 5)
    ids = [submit(store) for _ in range(4)]
    store.queue_update("q", max_queued=2)
    assert store.queue_get("q").max_queued == 2
    assert [store.task_get(i).state for i in ids] == ["queued"] * 4
    with pytest.raises(Backpressure):
        submit(store)
    store.queue_update("q", max_queued=None)  # removed: no cap at all
    assert store.queue_get("q").max_queued is None
    submit(store)
    updates = [json.loads(e["data"]) for e in store.event_list() if e["kind"] == "queue.updated"]
    assert updates == [
        {"max_queued": 2, "max_queued_before": 5},
        {"max_queued": None, "max_queued_before": 2},
    ]


def test_a_cap_set_later_counts_the_tasks_already_waiting(store: Store) -> None:
    queue(store)
    submit(store)
    submit(store)
    store.queue_update("q", max_queued=2)
    with pytest.raises(Backpressure):
        submit(store)


def test_tenant_caps_change_one_at_a_time(store: Store) -> None:
    store.tenant_limit_set("acme", 4, max_queued=7)
    assert store.tenant_limits() == {"acme": (4, 7)}
    with pytest.raises(OrbitError, match="at least one"):
        store.tenant_limit_set("acme", KEEP, max_queued=KEEP)
    store.tenant_limit_set("acme", None)  # max_queued kept
    assert store.tenant_limits() == {"acme": (None, 7)}
    assert store.tenant_limit_list() == {}
    store.tenant_limit_set("acme", max_queued=7)  # the cap it has: no event
    store.tenant_limit_set("acme", max_queued=None)
    assert store.tenant_limits() == {}
    events = [json.loads(e["data"]) for e in store.event_list() if e["kind"] == "tenant.updated"]
    assert events == [
        {
            "max_concurrency": 4,
            "max_concurrency_before": None,
            "max_queued": 7,
            "max_queued_before": None,
        },
        {"max_concurrency": None, "max_concurrency_before": 4},
        {"max_queued": None, "max_queued_before": 7},
    ]


@pytest.mark.parametrize("bad", [0, -1, 1_000_000_001, True, 2.5, "3"])
def test_every_bad_cap_is_refused_and_changes_nothing(store: Store, bad: Any) -> None:
    with pytest.raises(OrbitError) as refused:
        store.queue_create("q", max_concurrency=1, rate=0, max_queued=bad)
    assert refused.value.code == Code.INVALID_ARGUMENT
    queue(store)
    for call in (
        lambda: store.queue_update("q", max_queued=bad),
        lambda: store.tenant_limit_set("acme", max_queued=bad),
    ):
        with pytest.raises(OrbitError) as refused:
            call()
        assert refused.value.code == Code.INVALID_ARGUMENT
    assert store.queue_get("q").max_queued is None
    assert store.tenant_limits() == {}


def test_retry_after_follows_the_queue_rate() -> None:
    assert retry_after(10, None) == 1  # a tenant, or an unlimited queue
    assert retry_after(10, 0) == 1
    assert retry_after(10, 4) == 3  # 10 tasks at 4/s
    assert retry_after(10_000, 1) == store_module.MAX_RETRY_AFTER


def test_a_rate_limited_queue_answers_its_drain_time(store: Store) -> None:
    _capped(store, 1, burst=1)
    store.queue_update("q", rate=0.5)
    submit(store)
    with pytest.raises(Backpressure) as refused:
        submit(store)
    assert refused.value.retry_after == 2


def _submits_from_two_nodes(a: Store, b: Store, submit_on: Callable[[Store], Any]) -> Any:
    """``submit_on`` node ``a`` holds its transaction once it has counted its scope's
    depth (the depth lock held); ``submit_on`` node ``b`` then runs, until it waits for
    that lock; then ``a`` goes on. What each returned or raised, by node name."""
    counted, go_on = threading.Event(), threading.Event()
    check = store_module._check_depth

    def held(tx: Any, *args: Any) -> None:
        check(tx, *args)
        if tx._store is a:
            counted.set()
            assert go_on.wait(RACE_WAIT)

    outcomes: dict[str, Any] = {}

    def run(name: str, node: Store) -> None:
        try:
            outcomes[name] = submit_on(node)
        except Exception as exc:
            outcomes[name] = exc

    mp = pytest.MonkeyPatch()
    mp.setattr(store_module, "_check_depth", held)
    try:
        first = threading.Thread(target=run, args=("a", a))
        first.start()
        assert counted.wait(RACE_WAIT)
        second = threading.Thread(target=run, args=("b", b))
        second.start()
        until_done_or_waiting_on_a_lock(second, store_url(a))
        go_on.set()
        first.join(RACE_WAIT)
        second.join(RACE_WAIT)
    finally:
        go_on.set()
        mp.undo()
    return outcomes


def test_two_nodes_never_pass_the_cap_together(make_store: Any, backend: str) -> None:
    """One node's submit holds the last room, counted but not yet written; the other
    node's submit waits for it, then counts it, and is refused."""
    if backend != "postgres":
        pytest.skip("SQLite has one writer: BEGIN IMMEDIATE serialises the submits")
    a, b = make_store(), make_store()
    _capped(a, 3)
    submit(a)
    submit(a)
    outcomes = _submits_from_two_nodes(a, b, submit)
    assert isinstance(outcomes["a"], str)
    assert isinstance(outcomes["b"], Backpressure), outcomes["b"]
    assert a.task_counts() == {"queued": 3}


def test_many_submits_from_two_nodes_fill_the_cap_exactly(make_store: Any, backend: str) -> None:
    """Four threads on two nodes (one store on SQLite, whose file has one server)."""
    a = make_store()
    b = make_store() if backend == "postgres" else a
    store_of = [a, b]
    _capped(a, 12)
    a.tenant_limit_set("acme", max_queued=9)
    made: list[str] = []
    refused: list[Code] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        node = store_of[i % 2]
        for j in range(6):
            try:
                task = submit(node, tenant="acme" if j % 2 else "default")
            except Backpressure as exc:
                with lock:
                    refused.append(exc.code)
            else:
                with lock:
                    made.append(task)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RACE_WAIT)
    assert len(made) == 12 and len(refused) == 12
    tasks = [a.task_get(i) for i in made]
    assert sum(t.tenant == "acme" for t in tasks) <= 9
    assert a.task_counts() == {"queued": 12}
    assert check_all(a) == []


def test_a_concurrent_resubmit_of_the_last_task_is_answered_not_refused(
    make_store: Any, backend: str
) -> None:
    """Two nodes submit the same idempotency key to a queue with room for one. The second
    read its keys before the first committed, then waited for the first's depth lock: the
    key names a task by the time it counts, so it must get that task back (as it does at a
    queue without a cap), not QUEUE_FULL."""
    if backend != "postgres":
        pytest.skip("SQLite has one writer: BEGIN IMMEDIATE serialises the submits")
    a, b = make_store(), make_store()
    _capped(a, 1)
    outcomes = _submits_from_two_nodes(
        a, b, lambda node: node.task_submit(_spec(idempotency_key="k", payload={"n": 1}))
    )
    assert outcomes["a"].created, outcomes["a"]
    assert not isinstance(outcomes["b"], Exception), outcomes["b"]
    assert not outcomes["b"].created and outcomes["b"].task.id == outcomes["a"].task.id
    assert a.task_counts() == {"queued": 1}


def test_a_paused_queue_answers_the_longest_wait(store: Store) -> None:
    """A paused queue hands out nothing until resumed: its rate (or none) says nothing of
    when room comes, and 1 s would invite a producer to ask again every second."""
    _capped(store, 1)
    submit(store)
    store.queue_pause("q")
    with pytest.raises(Backpressure) as refused:
        submit(store)
    assert refused.value.retry_after == store_module.MAX_RETRY_AFTER
    store.queue_resume("q")
    with pytest.raises(Backpressure) as refused:
        submit(store)
    assert refused.value.retry_after == 1
    assert retry_after(1, 4, paused=True) == store_module.MAX_RETRY_AFTER


def test_retry_after_is_not_a_second_long_from_rounding() -> None:
    """21 tasks at 0.7 a second take 30 s: the division's float error (30.000000000000004)
    rounded up to 31."""
    assert retry_after(21, 0.7) == 30
    assert retry_after(21, 1.4) == 15
    assert retry_after(57, 1.14) == 50
    assert retry_after(22, 0.7) == 32  # 31.4...: a part of a second is still a second


def test_submits_waiting_for_a_full_scope_leave_the_node_connections(
    make_store: Any, backend: str
) -> None:
    """Submits to one capped queue go one at a time, cluster-wide (the depth lock). More
    of them at once on one node than its pool holds took every pooled connection, each
    waiting for that lock, and every other call of the node (an uncapped submit here; a
    worker's renewal alike) waited for a connection behind them. A node lets one of its
    submits per capped scope wait for the lock; the others wait in the node, holding no
    connection."""
    if backend != "postgres":
        pytest.skip("SQLite has one writer and no pool of connections")
    import psycopg

    node = make_store()
    _capped(node, 1000)
    node.queue_create("free", max_concurrency=1, rate=0)
    submit(node)  # the node has seen that q has a cap
    outcomes: list[Any] = []

    def run(queue: str) -> None:
        try:
            outcomes.append(submit(node, queue))
        except Exception as exc:
            outcomes.append(exc)

    with psycopg.connect(store_url(node)) as other_node:  # holds q's depth lock
        other_node.execute(
            "SELECT pg_advisory_xact_lock(%s)", (store_module.depth_key("queue", "q"),)
        )
        waiting = [threading.Thread(target=run, args=("q",)) for _ in range(12)]
        for t in waiting:
            t.start()
        until_done_or_waiting_on_a_lock(waiting[0], store_url(node))
        probe = threading.Thread(target=run, args=("free",))
        probe.start()
        probe.join(RACE_WAIT)
        assert not probe.is_alive() and len(outcomes) == 1, outcomes
        assert isinstance(outcomes[0], str), outcomes[0]  # while q's lock is still held
        other_node.rollback()
    for t in waiting:
        t.join(RACE_WAIT)
    assert len(outcomes) == 13 and all(isinstance(o, str) for o in outcomes), outcomes
    assert node.task_counts() == {"queued": 14}


#: two tenant names with one CRC-32, so one depth key (``depth_key``)
SHARED_KEY = ("t928096", "t11200040")


def test_two_capped_scopes_sharing_a_depth_key_are_gated_once_and_counted_apart(
    store: Store,
) -> None:
    """A batch to two capped tenants whose names share a depth key took that key's gate
    twice; the gate is a plain lock, so the submit waited on itself for ever, and so did
    every later submit to either tenant on that node. Each key is held once now, and the
    two tenants still count their own tasks."""
    a, b = SHARED_KEY
    assert store_module.depth_key("tenant", a) == store_module.depth_key("tenant", b)
    queue(store)
    store.tenant_limit_set(a, max_queued=2)
    store.tenant_limit_set(b, max_queued=2)
    submit(store, tenant=a)  # the store has seen that the tenants have caps
    assert store.depth_gated([("tenant", a), ("tenant", b)]) == [
        store_module.depth_key("tenant", a)
    ]
    outcome: list[Any] = []

    def batch() -> None:
        try:
            outcome.append(store.task_submit_many([_spec(tenant=a), _spec(tenant=b)]))
        except Exception as exc:
            outcome.append(exc)

    t = threading.Thread(target=batch, daemon=True)  # a regression hangs it, not the run
    t.start()
    t.join(RACE_WAIT)
    assert not t.is_alive(), "the batch waited on its own gate"
    assert [s.created for s in outcome[0]] == [True, True]
    submit(store, tenant=b)  # b's own count: 2 of 2
    with pytest.raises(Backpressure) as refused:
        submit(store, tenant=a)
    assert refused.value.code == Code.TENANT_FULL and refused.value.scope == a
    with pytest.raises(Backpressure) as refused:
        submit(store, tenant=b)
    assert refused.value.scope == b
