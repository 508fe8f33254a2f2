"""The reaper's sleep after a pass (orbit.server.app.reap_delay): until the soonest due
instant, never longer than the interval, never a spin on work another node holds."""

from __future__ import annotations

import pytest

from orbit.server.app import REAP_MARGIN_S, REAP_MIN_GAP_S, reap_delay


@pytest.mark.parametrize(
    ("due_in", "did_work", "expected"),
    [
        (None, False, 5.0),  # nothing pending: the interval
        (None, True, 5.0),
        (1.25, False, 1.25 + REAP_MARGIN_S),  # a lease runs out first: just after it
        (9.0, True, 5.0),  # due after the interval: the interval
        (0.001, False, REAP_MIN_GAP_S),  # never sooner than the minimum gap
        (-0.5, True, REAP_MIN_GAP_S),  # the pass left due work (a full batch): go on
        (-0.001, False, REAP_MIN_GAP_S),  # woke a hair early (two clocks): try again
        (-0.5, False, 5.0),  # long due but untouched by the pass: held elsewhere, no spin
    ],
)
def test_the_reaper_sleeps_until_the_next_due_instant(
    due_in: float | None, did_work: bool, expected: float
) -> None:
    assert reap_delay(5.0, due_in, did_work=did_work) == pytest.approx(expected)
