"""Bad input gets a clear error and writes nothing: one test per rejection class."""

from __future__ import annotations

from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import SECOND, Backoff, Capability, Outcome, TaskSpec
from orbit.core.validate import MAX_INSTANT_US, MIN_RATE
from orbit.store import Store, StoreConfig
from tests.conftest import ManualClock
from tests.store.helpers import queue, run_one, submit, worker


def _snapshot(store: Store) -> tuple[Any, ...]:
    return (store.task_counts(), len(store.event_list()), store.queue_list())


def _rejects(store: Store, code: Code, call: Any) -> OrbitError:
    before = _snapshot(store)
    with pytest.raises(OrbitError) as err:
        call()
    assert err.value.code == code, err.value
    assert _snapshot(store) == before, "a rejected call changed state"
    return err.value


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"max_concurrency": None, "rate": 1}, Code.MISSING_CAP),
        ({"max_concurrency": 5, "rate": None}, Code.MISSING_CAP),
        ({"max_concurrency": 0, "rate": 1}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": 5, "rate": -1}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": 5, "rate": float("nan")}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": 5, "rate": 1, "burst": 0}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": True, "rate": 1}, Code.INVALID_ARGUMENT),
    ],
)
def test_queue_needs_valid_caps(store: Store, kwargs: dict[str, Any], code: Code) -> None:
    err = _rejects(store, code, lambda: store.queue_create("q", **kwargs))
    assert err.status == 400


@pytest.mark.parametrize("name", ["bad name!", "q\n", "", "x" * 129])
def test_queue_name_must_be_a_name(store: Store, name: str) -> None:
    """``q\n`` too: a ``$`` anchor would let the newline through, and names are spelled
    into event JSON unescaped (``task_submit_many``)."""
    _rejects(
        store, Code.INVALID_ARGUMENT, lambda: store.queue_create(name, max_concurrency=1, rate=0)
    )
    queue(store)
    _rejects(store, Code.INVALID_ARGUMENT, lambda: submit(store, handler=name))


def test_queue_duplicate(store: Store) -> None:
    queue(store)
    err = _rejects(
        store, Code.QUEUE_EXISTS, lambda: store.queue_create("q", max_concurrency=1, rate=0)
    )
    assert err.status == 409


def test_unknown_queue(store: Store) -> None:
    err = _rejects(store, Code.QUEUE_NOT_FOUND, lambda: submit(store, queue="nope"))
    assert err.status == 404


def test_oversize_payload(make_store: Any, clock: ManualClock) -> None:
    store: Store = make_store(clock=clock, config=StoreConfig(max_payload_bytes=1024))
    queue(store)
    err = _rejects(store, Code.PAYLOAD_TOO_LARGE, lambda: submit(store, payload="x" * 2000))
    assert err.status == 413 and "1024" in err.message
    submit(store, payload="x" * 1000)  # within the bound


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"backoff": Backoff(base_us=0)}, Code.INVALID_BACKOFF),
        ({"backoff": Backoff(factor=0.5)}, Code.INVALID_BACKOFF),
        ({"backoff": Backoff(factor=float("inf"))}, Code.INVALID_BACKOFF),
        ({"backoff": Backoff(base_us=10 * SECOND, max_us=SECOND)}, Code.INVALID_BACKOFF),
        ({"attempt_timeout_us": 0}, Code.INVALID_TIMEOUT),
        ({"attempt_timeout_us": -5}, Code.INVALID_TIMEOUT),
        ({"attempt_timeout_us": 10**18}, Code.INVALID_TIMEOUT),
        ({"max_attempts": 0}, Code.INVALID_ARGUMENT),
        ({"priority": 10**9}, Code.INVALID_ARGUMENT),
        ({"handler": ""}, Code.INVALID_ARGUMENT),
        ({"tenant": "a b"}, Code.INVALID_ARGUMENT),
        ({"idempotency_key": ""}, Code.INVALID_ARGUMENT),
        # the schedules' own keys (orbit.core.validate.is_fire_key)
        (
            {"idempotency_key": "schedule:nightly:1800000000000000:1800000060000000"},
            Code.INVALID_ARGUMENT,
        ),
        ({"payload": float("nan")}, Code.INVALID_ARGUMENT),
        ({"payload": {"x": object()}}, Code.INVALID_ARGUMENT),
        ({"payload": "\ud800"}, Code.INVALID_ARGUMENT),
        ({"retry_safe": "yes"}, Code.INVALID_ARGUMENT),
        ({"parent_id": "no-such-task"}, Code.PARENT_NOT_FOUND),
        # instants the wire cannot spell (it takes 1970 to 9998): a store caller's
        # 2**63 raised a raw OverflowError on SQLite
        ({"deadline": 2**63}, Code.INVALID_DEADLINE),
        ({"deadline": MAX_INSTANT_US}, Code.INVALID_DEADLINE),
        ({"run_after": 2**63}, Code.INVALID_ARGUMENT),
        ({"run_after": -1}, Code.INVALID_ARGUMENT),
    ],
)
def test_bad_task_options(store: Store, kwargs: dict[str, Any], code: Code) -> None:
    queue(store)
    _rejects(store, code, lambda: submit(store, **kwargs))


def test_deadline_in_the_past_or_before_run_after(store: Store, clock: ManualClock) -> None:
    queue(store)
    _rejects(store, Code.INVALID_DEADLINE, lambda: submit(store, deadline=clock.now))
    _rejects(
        store,
        Code.INVALID_DEADLINE,
        lambda: submit(store, deadline=clock.now + 10 * SECOND, run_after=clock.now + 20 * SECOND),
    )


def test_only_a_fire_shaped_key_is_the_schedules_own(store: Store) -> None:
    """A key of a fire's shape (``schedule:<name>:<number>:<number>``) is refused above;
    any other key starting ``schedule:`` is a key like any other."""
    queue(store)
    for key in ("schedule:daily-report", "schedule:a:b", "schedule:x:1:2:3b"):
        assert store.task_get(submit(store, idempotency_key=key)).idempotency_key == key


def test_idempotency_conflict(store: Store) -> None:
    """The refusal names the task the key already names (task ids are no secret), so the
    submitter can look it up; a key given twice in one batch names no task, as the
    refused batch makes none."""
    queue(store)
    tid = submit(store, payload={"a": 1}, idempotency_key="k")
    err = _rejects(
        store,
        Code.IDEMPOTENCY_CONFLICT,
        lambda: submit(store, payload={"a": 2}, idempotency_key="k"),
    )
    assert err.status == 409
    assert f"already names task {tid}" in err.message, err.message
    twice = [TaskSpec(queue="q", handler="h", payload=n, idempotency_key="k2") for n in (1, 2)]
    err = _rejects(store, Code.IDEMPOTENCY_CONFLICT, lambda: store.task_submit_many(twice))
    # the message leads with the second task's field (tasks[1]...), and names no task id
    said = err.message.removeprefix("tasks[1].idempotency_key: ")
    assert "given twice in this batch" in said and "task" not in said, err.message
    assert err.field == "tasks[1].idempotency_key"


def test_one_bad_task_rejects_the_whole_batch(store: Store) -> None:
    queue(store)
    good = TaskSpec(queue="q", handler="h")
    bad = TaskSpec(queue="missing", handler="h")
    _rejects(store, Code.QUEUE_NOT_FOUND, lambda: store.task_submit_many([good, good, bad]))
    submit(store, payload=1, idempotency_key="k")
    clash = TaskSpec(queue="q", handler="h", payload=2, idempotency_key="k")
    _rejects(store, Code.IDEMPOTENCY_CONFLICT, lambda: store.task_submit_many([good, clash]))
    too_many = [good] * (store.config.max_batch + 1)
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.task_submit_many(too_many))


@pytest.mark.parametrize(
    ("caps", "max_concurrency"),
    [
        ([], 5),
        ([Capability("h", 0)], 5),
        ([Capability("h", 1), Capability("h", 2)], 5),
        ([Capability("bad name", 1)], 5),
        ([Capability("h", 1)], 0),
    ],
)
def test_bad_session_options(store: Store, caps: list[Capability], max_concurrency: int) -> None:
    _rejects(
        store,
        Code.INVALID_ARGUMENT,
        lambda: store.session_open(
            name="w", node_id="n", capabilities=caps, max_concurrency=max_concurrency
        ),
    )
    assert store.session_list() == []


def test_unknown_ids(store: Store) -> None:
    queue(store)
    s, _ = worker(store)
    _rejects(store, Code.TASK_NOT_FOUND, lambda: store.task_get("nope"))
    _rejects(store, Code.TASK_NOT_FOUND, lambda: store.task_cancel("nope"))
    _rejects(store, Code.ATTEMPT_NOT_FOUND, lambda: store.attempt_start(s.id, 1, "nope", 1))
    _rejects(store, Code.SESSION_NOT_FOUND, lambda: store.attempt_claim_many("nope", 1, 1))
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.attempt_claim_many(s.id, 1, 0))
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.task_resolve("x", "maybe"))


def test_limits_validated(store: Store) -> None:
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.tenant_limit_set("t", 0))
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.global_limit_set(-1))


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({}, Code.INVALID_ARGUMENT),  # nothing to change
        ({"max_concurrency": 0}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": 1_000_001}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": True}, Code.INVALID_ARGUMENT),
        ({"max_concurrency": 2.5}, Code.INVALID_ARGUMENT),
        ({"rate": -1}, Code.INVALID_ARGUMENT),
        ({"rate": 1_000_001}, Code.INVALID_ARGUMENT),
        ({"rate": float("nan")}, Code.INVALID_ARGUMENT),
        ({"rate": float("inf")}, Code.INVALID_ARGUMENT),
        ({"rate": "5"}, Code.INVALID_ARGUMENT),
        ({"burst": 0}, Code.INVALID_ARGUMENT),
        ({"burst": 1_000_001}, Code.INVALID_ARGUMENT),
        # one bad cap among good ones changes none of them
        ({"max_concurrency": 5, "rate": 2, "burst": 0}, Code.INVALID_ARGUMENT),
    ],
)
def test_queue_update_needs_valid_caps(store: Store, kwargs: dict[str, Any], code: Code) -> None:
    queue(store, max_concurrency=3, rate=1, burst=2)
    err = _rejects(store, code, lambda: store.queue_update("q", **kwargs))
    assert err.status == 400


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 9.99e-7])
def test_a_rate_below_the_bound_is_refused_at_create_and_update(store: Store, rate: float) -> None:
    """A positive rate below MIN_RATE (one task per 1,000,000 s) was taken, down to a
    subnormal 5e-324 whose refill interval overflows (``SECOND / rate`` is inf): create
    and update now refuse it alike, naming the field and the bound."""
    queue(store, rate=5)
    for call in (
        lambda: store.queue_create("slow", max_concurrency=1, rate=rate),
        lambda: store.queue_update("q", rate=rate),
    ):
        err = _rejects(store, Code.INVALID_ARGUMENT, call)
        assert err.status == 400
        assert "rate must be 0 (unlimited) or from 0.000001 to 1000000" in err.message, err


def test_the_slowest_rate_is_taken_at_create_and_update(store: Store) -> None:
    store.queue_create("slow", max_concurrency=1, rate=MIN_RATE)
    assert store.queue_get("slow").rate == MIN_RATE
    queue(store, rate=5)
    assert store.queue_update("q", rate=MIN_RATE).rate == MIN_RATE


def test_queue_update_of_an_unknown_queue(store: Store) -> None:
    queue(store)
    err = _rejects(
        store, Code.QUEUE_NOT_FOUND, lambda: store.queue_update("nope", max_concurrency=2)
    )
    assert err.status == 404
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.queue_update("bad name!", rate=1))


def test_limit_reads_validated(store: Store) -> None:
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.tenant_limit_get("bad name!"))


def test_a_bad_submission_is_refused_before_any_sql(store: Store) -> None:
    """What can be judged without the database is judged before the transaction: with
    the queue read armed to fail, the bad spec's own error still comes back."""
    queue(store)
    bad = TaskSpec(queue="q", handler="bad handler!")
    with store.inject_fault("queue_get_many"):
        _rejects(store, Code.INVALID_ARGUMENT, lambda: store.task_submit_many([bad]))


def test_every_queue_of_a_batch_must_exist(store: Store) -> None:
    queue(store, "a")
    queue(store, "b")
    specs = [TaskSpec(queue=q, handler="h") for q in ("b", "a", "b", "c")]
    err = _rejects(store, Code.QUEUE_NOT_FOUND, lambda: store.task_submit_many(specs))
    assert "'c'" in err.message
    created = store.task_submit_many(specs[:3])
    assert [s.task.queue for s in created] == ["b", "a", "b"]


def _nested(levels: int) -> Any:
    value: Any = 1
    for i in range(levels):
        value = [value] if i % 2 else {"k": value, "flat": 2.5}
    return value


@pytest.mark.parametrize("payload", [_nested(65), {"a": 1, "b": [_nested(64)]}, [0.5, _nested(70)]])
def test_a_payload_nested_past_64_levels_is_refused(store: Store, payload: Any) -> None:
    """Beside plain values (which skip the walk), a deep one is still found."""
    queue(store)
    err = _rejects(store, Code.INVALID_ARGUMENT, lambda: submit(store, payload=payload))
    assert "nests more than 64 levels" in err.message


def test_a_payload_nested_64_levels_is_taken(store: Store) -> None:
    queue(store)
    task = store.task_get(submit(store, payload=_nested(64)))
    assert task.payload.count("[") + task.payload.count("{") == 64


@pytest.mark.parametrize(
    ("payload", "code"),
    [("x" * 2000, Code.PAYLOAD_TOO_LARGE), ("\ud800", Code.INVALID_ARGUMENT)],
)
def test_a_batch_read_by_the_reader_still_has_its_payloads_checked(
    make_store: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, payload: Any, code: Code
) -> None:
    """``fields_checked`` (a batch the protocol's reader built) skips check_spec's field
    checks, not the payload's: a payload too large, or not UTF-8, is refused all the
    same, before any SQL, and nothing is written."""
    import orbit.store.store as store_module

    store: Store = make_store(clock=clock, config=StoreConfig(max_payload_bytes=1024))
    queue(store)

    def unexpected(*_: Any) -> None:
        raise AssertionError("check_spec ran on a batch whose fields were checked")

    monkeypatch.setattr(store_module, "check_spec", unexpected)
    good = TaskSpec(queue="q", handler="h", payload={"a": 1})
    bad = TaskSpec(queue="q", handler="h", payload=payload)
    submit_checked = store.task_submit_rendered
    with store.inject_fault("queue_get_many"):
        _rejects(store, code, lambda: submit_checked([good, bad], lambda d: d, fields_checked=True))
    done = submit_checked([good], lambda d: d.task.payload, fields_checked=True)
    assert done == ['{"a":1}']


@pytest.mark.parametrize(
    ("decision", "outcome"),
    [
        ("succeeded", Outcome.success(_nested(65))),
        ("succeeded", Outcome.success({"x": float("nan")})),
        ("failed", Outcome.failure("E\x00", "a NUL in the code")),
        ("failed", Outcome.failure("E", "a NUL \x00 in the message")),
        # an outcome the decision would drop, refused rather than ignored
        ("failed", Outcome.success({"r": 1})),
        ("succeeded", Outcome.failure("E", "an error with succeeded")),
        ("retry", Outcome.success(1)),
        ("retry", Outcome.failure("E")),
    ],
)
def test_a_resolves_outcome_is_checked_as_a_finishs_is(
    store: Store, clock: ManualClock, decision: str, outcome: Outcome
) -> None:
    """An operator's result or error passes the checks a worker's does (depth, JSON, no
    NUL), before any state is touched: refused alike on both backends, the task left in
    needs_review, no event written."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    run_one(store, s)
    clock.advance(30)
    store.reap()
    assert store.task_get(tid).state == "needs_review"
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.task_resolve(tid, decision, outcome))
    assert store.task_get(tid).state == "needs_review"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit": 0},
        {"limit": -1},
        {"limit": 100_001},
        {"limit": 1.5},
        {"after_id": -1},
        {"after_xid": -1},
        {"after_xid": 2**63},
    ],
)
def test_an_event_page_out_of_range_is_refused(store: Store, kwargs: dict[str, Any]) -> None:
    """``limit=-1`` read every event on SQLite (``LIMIT -1`` is no limit there) and was a
    database error on PostgreSQL: both refuse it now, as the HTTP route does."""
    queue(store)
    submit(store)
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.event_list(**kwargs))
    _rejects(store, Code.INVALID_ARGUMENT, lambda: store.event_read(**kwargs))
