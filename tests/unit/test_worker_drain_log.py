"""The line an operator's drain logs counts the attempts that will finish: with a
prefetch, those waiting for a slot (claimed, not started) are given back, not finished,
and the line says how many. They were once counted as running. Against ``FakeGateway``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.unit.fake_gateway import FakeGateway
from tests.unit.test_worker_prefetch import Gate, _push, _released, _started, _worker
from tests.unit.test_worker_recovery import _is

DRAINED = "drained by the server (an operator's drain)"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_drain_line_counts_the_started_and_the_given_back(
    prefetch: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orbit.worker")
    gate = Gate()
    pushed = ["h1", "h2", "h3"][: 1 + prefetch]

    async def main() -> int:
        async with FakeGateway() as gw:
            worker = _worker(gw, concurrency=1, prefetch=prefetch, grace=10.0)
            worker.handler("h")(gate)
            runner = asyncio.create_task(worker.arun())
            await gw.wait_for(_is("hello"))
            await _push(gw, *pushed)
            await gate.until(lambda: gate.inside == {"h1"} and len(worker.running) == len(pushed))
            await gw.push({"type": "drain"})
            await gw.wait_for(_is("drain"))
            await gw.count(_is("release"), prefetch)
            gate.go("h1")
            code = await asyncio.wait_for(runner, 10)
            assert _started(gw) == ["h1"]
            assert sorted(_released(gw)) == pushed[1:]
            return code

    assert asyncio.run(main()) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(DRAINED)]
    assert "stopping once the 1 running attempt(s) finish" in line, line
    if prefetch:
        assert line.endswith("; giving back the 2 waiting (claimed, not started)"), line
    else:
        assert "giving back" not in line, line
