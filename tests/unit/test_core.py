"""The pure rules, without a database: backoff, retry plans, the token bucket, ids."""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orbit.core.errors import Code, OrbitError, status_of
from orbit.core.ids import BATCH_INDEX_BITS, ENTROPY_POOL_BYTES, random8, uuid7, uuid7_many
from orbit.core.limits import (
    MAX_TOKEN_WAIT_US,
    Occupancy,
    bucket_refill,
    caps_raised,
    queue_with_caps,
    room_for_all,
    token_wait_us,
)
from orbit.core.model import SECOND, Backoff, Queue, Task, TaskSpec
from orbit.core.retry import backoff_delay, plan_retry
from orbit.core.states import TaskState
from orbit.core.transitions import digest, new_task
from orbit.core.validate import check_name

BACKOFF = Backoff(base_us=SECOND, factor=2.0, max_us=60 * SECOND)


@given(n=st.integers(1, 50), rand=st.floats(0, 1, exclude_max=True))
def test_backoff_is_exponential_capped_with_equal_jitter(n: int, rand: float) -> None:
    delay = backoff_delay(BACKOFF, n, rand)
    full = min(SECOND * 2 ** (n - 1), 60 * SECOND)
    assert full // 2 <= delay <= full


def test_backoff_rejects_bad_draws() -> None:
    with pytest.raises(ValueError):
        backoff_delay(BACKOFF, 1, 1.0)


def test_plan_retry_decisions() -> None:
    common = {"backoff": BACKOFF, "now": 0, "rand": 0.0, "error_code": "E"}
    assert (
        plan_retry(
            retryable=True, attempts_used=1, max_attempts=3, deadline=None, **common
        ).retry_at
        == SECOND // 2
    )
    assert (
        plan_retry(
            retryable=False, attempts_used=1, max_attempts=3, deadline=None, **common
        ).final_code
        == "E"
    )
    assert (
        plan_retry(
            retryable=True, attempts_used=3, max_attempts=3, deadline=None, **common
        ).final_code
        == "E"
    )
    assert (
        plan_retry(
            retryable=True, attempts_used=1, max_attempts=3, deadline=SECOND // 4, **common
        ).final_code
        == "DEADLINE_EXCEEDED"
    )


def test_token_bucket_refills_at_rate_up_to_burst() -> None:
    q = Queue("q", 10, rate=2.0, burst=4, tokens=0.0, tokens_at=0)
    assert bucket_refill(q, SECOND) == 2.0
    assert bucket_refill(q, 10 * SECOND) == 4.0
    assert bucket_refill(q, -5) == 0.0  # a clock that went backwards grants nothing
    assert bucket_refill(Queue("u", 1, rate=0, burst=1), 0) == float("inf")


def test_new_caps_settle_the_bucket_at_the_old_rate_then_clamp_it() -> None:
    q = Queue("q", 10, rate=2.0, burst=4, tokens=0.0, tokens_at=0)
    # 1 s at the old rate gave 2 tokens; from now on the new rate applies
    faster = queue_with_caps(q, max_concurrency=None, rate=100, burst=None, now=SECOND)
    assert (faster.rate, faster.burst, faster.tokens, faster.tokens_at) == (100.0, 4, 2.0, SECOND)
    smaller = queue_with_caps(q, max_concurrency=None, rate=None, burst=1, now=SECOND)
    assert (smaller.burst, smaller.tokens) == (1, 1.0)  # clamped to the new burst
    larger = queue_with_caps(q, max_concurrency=None, rate=None, burst=50, now=10 * SECOND)
    assert larger.tokens == 4.0  # full at the old burst; fills to 50 at the rate
    unlimited = Queue("u", 1, rate=0, burst=1, tokens=0.0, tokens_at=0)
    limited = queue_with_caps(unlimited, max_concurrency=None, rate=1, burst=3, now=5)
    assert (limited.tokens, limited.tokens_at) == (3.0, 5)  # starts full, as at create
    # only the concurrency, or the same values: the bucket is untouched
    assert queue_with_caps(q, max_concurrency=3, rate=None, burst=None, now=SECOND).tokens_at == 0
    assert queue_with_caps(q, max_concurrency=10, rate=2, burst=4, now=SECOND) == q


def test_caps_raised_knows_unlimited_is_the_fastest_rate() -> None:
    q = Queue("q", 10, rate=2.0, burst=4)
    assert caps_raised(q, Queue("q", 11, rate=2.0, burst=4))
    assert caps_raised(q, Queue("q", 10, rate=3.0, burst=4))
    assert caps_raised(q, Queue("q", 10, rate=0.0, burst=4))
    assert caps_raised(q, Queue("q", 10, rate=2.0, burst=5))
    assert not caps_raised(q, Queue("q", 9, rate=1.0, burst=3))
    unlimited = Queue("u", 10, rate=0.0, burst=1)
    assert not caps_raised(unlimited, Queue("u", 10, rate=5.0, burst=1))
    assert not caps_raised(unlimited, Queue("u", 10, rate=0.0, burst=9))  # burst unused


def test_token_wait_is_the_time_to_the_next_whole_token() -> None:
    assert token_wait_us(1.0, 2.0) == 0  # a token is there now
    assert token_wait_us(3.5, 2.0) == 0
    assert token_wait_us(0.0, 2.0) == SECOND // 2
    assert token_wait_us(0.5, 2.0) == SECOND // 4
    assert token_wait_us(0.0, 1 / 3) == 3 * SECOND
    assert token_wait_us(0.25, 1_000_000) == 1  # never less than a microsecond
    assert token_wait_us(0.0, 0) is None  # unlimited: never short of a token
    assert token_wait_us(0.0, 1e-9) == MAX_TOKEN_WAIT_US
    assert token_wait_us(0.0, 5e-324) == MAX_TOKEN_WAIT_US  # no overflow


@given(
    tokens=st.floats(min_value=-5.0, max_value=0.999999, allow_nan=False),
    rate=st.floats(min_value=0.001, max_value=1_000_000, allow_nan=False),
    start=st.integers(min_value=0, max_value=2**52),
)
def test_a_claim_after_the_token_wait_finds_the_token(
    tokens: float, rate: float, start: int
) -> None:
    """``token_wait_us`` agrees with ``bucket_refill``: waiting that long is enough, and
    (but for a wait of one microsecond, the least it reports) a microsecond less is not."""
    wait = token_wait_us(tokens, rate)
    assert wait is not None and 1 <= wait <= MAX_TOKEN_WAIT_US
    q = Queue("q", 1, rate=rate, burst=1, tokens=tokens, tokens_at=start)
    if wait < MAX_TOKEN_WAIT_US:
        assert bucket_refill(q, start + wait) >= 1.0
    if 1 < wait < MAX_TOKEN_WAIT_US:
        assert bucket_refill(q, start + wait - 2) < 1.0


def test_occupancy_admits_within_every_cap() -> None:
    occ = Occupancy(0, {}, {}, {}, 0)
    caps = {
        "queue_cap": 2,
        "tenant_cap": None,
        "handler_cap": 5,
        "session_cap": 5,
        "global_cap": None,
    }
    assert occ.admit(queue="q", tenant="t", handler="h", **caps)
    assert occ.admit(queue="q", tenant="t", handler="h", **caps)
    assert not occ.admit(queue="q", tenant="t", handler="h", **caps)
    assert occ.total == 2 and occ.by_queue == {"q": 2}


def test_room_for_all_holds_only_when_no_cap_is_within_reach() -> None:
    occ = Occupancy(3, {"q": 3}, {"t": 3}, {"h": 3}, 3)  # caps of 10: 7 left in each

    def room(
        want: int,
        *,
        tokens: float = float("inf"),
        tenant_caps: dict[str, int] | None = None,
        handler_cap: int = 10,
    ) -> bool:
        return room_for_all(
            want,
            occ,
            queues={"q": Queue("q", 10, rate=0, burst=1)},
            tokens={"q": tokens},
            tenant_caps={"t": 10} if tenant_caps is None else tenant_caps,
            handler_caps={"h": handler_cap},
        )

    assert room(6) and room(7)
    assert not room(8)  # the queue (and the others)
    assert not room(6, tokens=5.5)  # the queue's tokens
    assert not room(6, tenant_caps={"t": 8})  # a capped tenant: 5 left
    assert not room(6, handler_cap=8)  # the handler's capacity in this session
    assert room(6, tenant_caps={})  # a tenant without a cap never refuses


def test_uuid7_is_valid_and_time_ordered() -> None:
    ids = [uuid7(1_700_000_000_000_000 + i, bytes(8)) for i in range(0, 5000, 7)]
    assert ids == sorted(ids)
    parsed = uuid.UUID(ids[0])
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122


@given(st.integers(0, 2**62), st.binary(min_size=8, max_size=8))
def test_uuid7_is_spelled_as_the_uuid_module_spells_it(now_us: int, random: bytes) -> None:
    made = uuid7(now_us, random)
    assert made == str(uuid.UUID(made)) and len(made) == 36
    assert uuid.UUID(made).version == 7


_INSTANTS = st.sampled_from([0, 1, 999, 1000, 1_700_000_000_000_000, 2**62])


@given(st.lists(st.tuples(_INSTANTS, st.binary(min_size=8, max_size=8)), max_size=12))
def test_uuid7_spells_each_instants_head_whatever_was_drawn_before(
    draws: list[tuple[int, bytes]],
) -> None:
    """Ids drawn at one instant in a row share a head spelled once; each is still the
    UUID of its own instant and bits, after an id of the same or another instant."""
    for now_us, random in draws:
        ms, sub_us = divmod(now_us, 1000)
        bits = (ms & (2**48 - 1)) << 80 | 0x7 << 76 | (sub_us * 4096 // 1000) << 64
        bits |= 0b10 << 62 | int.from_bytes(random, "big") & (2**62 - 1)
        assert uuid7(now_us, random) == str(uuid.UUID(int=bits))


@given(st.integers(0, 2**62), st.integers(0, 200), st.integers(0, 2**20 - 203))
def test_uuid7_many_sorts_in_the_order_made(now_us: int, count: int, first: int) -> None:
    """Each id is a uuid7 of that instant (the one ``uuid7`` makes from its last 62 bits)
    whose tail starts with its number in the batch, so a batch's ids, and a later chunk's
    after an earlier one's, sort in the order they were made."""
    made = uuid7_many(now_us, count, first)
    later = uuid7_many(now_us, 3, first + count)
    assert len(made) == count and sorted(made + later) == made + later
    for index, one in enumerate(made, first):
        bits = uuid.UUID(one).int & ((1 << 62) - 1)
        assert one == uuid7(now_us, bits.to_bytes(8, "big"))
        assert bits >> (62 - BATCH_INDEX_BITS) == index


def test_uuid7_many_draws_all_42_random_bits_for_every_id() -> None:
    """Each of the 42 bits after an id's number is random: over a batch, every one of
    them is set in some id and clear in another (each fails by chance with
    probability 2**-999), and the ids, valid UUIDv7s of one instant, are distinct."""
    now_us = 1_700_000_000_123_456
    made = uuid7_many(now_us, 1000, 40)  # runs that start and end mid-way through 64
    tails = [uuid.UUID(one).int & ((1 << (62 - BATCH_INDEX_BITS)) - 1) for one in made]
    ones = (1 << (62 - BATCH_INDEX_BITS)) - 1
    set_somewhere = clear_somewhere = 0
    for tail in tails:
        set_somewhere |= tail
        clear_somewhere |= ~tail & ones
    assert set_somewhere == ones and clear_somewhere == ones
    assert len(set(made)) == len(made) == 1000
    for one in made:
        parsed = uuid.UUID(one)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert parsed.int >> 80 == now_us // 1000 and str(parsed) == one


def test_uuid7_many_refuses_more_than_a_batch_holds() -> None:
    uuid7_many(1_700_000_000_000_000, 2, 2**BATCH_INDEX_BITS - 2)
    with pytest.raises(ValueError, match="at most"):
        uuid7_many(1_700_000_000_000_000, 2, 2**BATCH_INDEX_BITS - 1)


def test_uuid7_many_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match="count"):
        uuid7_many(1_700_000_000_000_000, -1)


def test_random8_never_repeats_across_refills_and_threads() -> None:
    """Each thread reads its own pool, so no two callers are handed the same slice."""
    drawn: list[list[bytes]] = [[] for _ in range(4)]

    def draw(into: list[bytes]) -> None:
        into.extend(random8() for _ in range(3 * ENTROPY_POOL_BYTES // 8))

    threads = [threading.Thread(target=draw, args=(d,)) for d in drawn]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [b for d in drawn for b in d]
    assert all(len(b) == 8 for b in every)
    assert len(set(every)) == len(every)


def test_a_forked_child_does_not_hand_out_its_parents_next_random_bytes() -> None:
    """The pool is copied by fork; the child must draw afresh, or the parent's next id
    and the child's first would share their random bits."""
    random8()  # the pool now holds unread bytes
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its first draw, then leave without cleanup
        try:
            os.write(write_end, random8())
        finally:
            os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 8)
    os.close(read_end)
    os.waitpid(pid, 0)
    parent = random8()
    assert len(child) == 8 and child != parent


def test_check_name_remembers_only_names_it_accepted() -> None:
    """Accepted names are remembered (``_GOOD_NAMES``); a bad one is refused every
    time, before and after the memory fills and is emptied, and a str subclass, whose
    equality could lie, is matched afresh."""

    class Liar(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    for round_ in range(3):
        for i in range(3000):  # 9,000 names: more than the memory holds
            assert check_name("queue", f"q{round_}.{i}") == f"q{round_}.{i}"
        for bad in (
            "",
            "-leading",
            "has space",
            "x" * 129,
            "nul\x00",
            "trailing\n",
            7,
            None,
            Liar("a b"),
        ):
            with pytest.raises(OrbitError) as caught:
                check_name("queue", bad)
            assert caught.value.code == Code.INVALID_ARGUMENT


def test_status_codes() -> None:
    assert status_of(Code.MISSING_CAP) == 400
    assert status_of(Code.QUEUE_NOT_FOUND) == 404
    assert status_of(Code.PAYLOAD_TOO_LARGE) == 413
    assert status_of(Code.STALE_FENCE) == 409


def test_new_task_fills_every_task_field_and_no_other() -> None:
    """``new_task`` skips ``build``'s check (a batch submit makes a thousand), so this
    holds its literal to the dataclass: a field added to ``Task`` must be added there."""
    spec = TaskSpec(queue="q", handler="h", payload={"a": 1}, run_after=2 * SECOND)
    task = new_task(spec, task_id="t1", payload='{"a":1}', now=SECOND)
    assert set(vars(task)) == {f.name for f in fields(Task)}
    assert (task.state, task.run_after, task.version) == (TaskState.SCHEDULED, 2 * SECOND, 1)
    assert task.payload_digest == digest('{"a":1}')
    assert new_task(spec, task_id="t2", payload="{}", now=3 * SECOND).state == TaskState.QUEUED
