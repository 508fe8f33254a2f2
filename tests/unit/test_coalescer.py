"""``orbit.worker.batching.Coalescer``: reports grouped into batches, bounded by count
and by size, each caller answered with its own item's answer."""

from __future__ import annotations

import asyncio

import pytest

from orbit.worker.batching import Coalescer


def _batches(sizes: list[int], *, max_batch: int, max_bytes: int) -> list[list[int]]:
    """The batches ``Coalescer`` sends for items submitted together, one sender in
    flight; each item is its own size, and each caller gets its item back."""
    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int | BaseException]:
        sent.append(items)
        await asyncio.sleep(0)
        return list(items)

    async def main() -> list[int]:
        coalescer: Coalescer[int, int] = Coalescer(
            send, max_batch=max_batch, max_in_flight=1, max_bytes=max_bytes, size=lambda i: i
        )
        return await asyncio.gather(*(coalescer.submit(s) for s in sizes))

    assert asyncio.run(main()) == sizes
    return sent


def test_a_batch_stops_before_its_items_pass_max_bytes() -> None:
    assert _batches([40, 40, 40, 40, 40], max_batch=10, max_bytes=100) == [
        [40, 40],
        [40, 40],
        [40],
    ]


def test_an_item_larger_than_max_bytes_goes_alone() -> None:
    assert _batches([10, 500, 10, 10], max_batch=10, max_bytes=100) == [[10], [500], [10, 10]]


def test_the_count_still_bounds_a_batch() -> None:
    assert _batches([1] * 7, max_batch=3, max_bytes=100) == [[1, 1, 1], [1, 1, 1], [1]]


def test_bad_bounds_are_refused() -> None:
    async def send(items: list[int]) -> list[int | BaseException]:
        return list(items)

    for kwargs in ({"max_batch": 0}, {"max_in_flight": 0}, {"max_bytes": 0}):
        with pytest.raises(ValueError, match="at least 1"):
            Coalescer(send, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_an_item_submitted_as_every_sender_ends_is_still_sent(max_in_flight: int) -> None:
    """Every sender's last request answered in one turn of the loop, and an item
    submitted in that same turn, after the senders have found nothing left to send but
    before their tasks' done callbacks have run. The item must still be sent: it once
    waited for the next ``submit`` to start a sender, and at the end of a drain there is
    none (a start stranded so held its task until the claim lease expired, 30 s)."""
    sent: list[list[int]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        replies = [loop.create_future() for _ in range(max_in_flight)]

        async def send(items: list[int]) -> list[int | BaseException]:
            sent.append(items)
            if len(sent) <= max_in_flight:  # the first requests wait for their replies
                await replies[len(sent) - 1]
            return list(items)

        coalescer: Coalescer[int, int] = Coalescer(send, max_batch=1, max_in_flight=max_in_flight)
        first = [asyncio.create_task(coalescer.submit(i)) for i in range(max_in_flight)]
        while len(sent) < max_in_flight:  # every sender is waiting for its reply
            await asyncio.sleep(0)
        for reply in replies:  # the replies arrive together: each sender wakes ...
            reply.set_result(None)
        late = asyncio.create_task(coalescer.submit(99))  # ... and this runs after them
        assert await asyncio.wait_for(asyncio.gather(*first), 5) == list(range(max_in_flight))
        assert await asyncio.wait_for(late, 5) == 99

    asyncio.run(main())
    assert sent[-1] == [99]
