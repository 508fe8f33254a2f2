"""How the harness orders a run, with a fake queue (tests/bench/_fake_queue.py) so that
only the harness itself runs: each run's system order changes (a balanced design, rows
and their reverses) and is recorded; the backlog's large queue lives in a second
instance, filled, vacuumed and checkpointed before any timed run and after each top-up,
and each run drains small and large back to back (the small half even when the large one
failed); the recovery cap sits above every system's documented recovery; a run's CPU
leaves other systems' servers out."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.scale import SESSION, SMOKE
from tests.bench import _fake_queue
from tests.bench._fake_queue import CALLS, FakeQueue
from tests.pg import ADMIN_DSN

FAKE = "tests.bench._fake_queue"
KEYS = ["fake-a", "fake-b", "fake-c"]


def test_each_run_changes_the_order_and_balances_the_predecessors() -> None:
    assert harness.run_order(KEYS, 1) == ["fake-a", "fake-b", "fake-c"]
    assert harness.run_order(KEYS, 2) == ["fake-c", "fake-b", "fake-a"]
    assert harness.run_order(KEYS, 3) == ["fake-b", "fake-c", "fake-a"]
    assert harness.run_order(KEYS, 4) == ["fake-a", "fake-c", "fake-b"]
    assert harness.run_order(KEYS, 7) == harness.run_order(KEYS, 1)
    steps = harness.plan(["throughput"], KEYS, 4)
    assert [s.key for s in steps] == [
        *harness.run_order(KEYS, 1),
        *harness.run_order(KEYS, 2),
        *harness.run_order(KEYS, 3),
        *harness.run_order(KEYS, 4),
    ]
    assert all(s.order == tuple(harness.run_order(KEYS, s.run)) for s in steps)
    assert all(sorted(s.order) == KEYS for s in steps)  # every system once per run

    def pairs(runs: int) -> list[tuple[str, str]]:
        found = []
        for run in range(1, runs + 1):
            order = harness.run_order(KEYS, run)
            found += list(itertools.pairwise(order))
        return found

    # Over 4 runs each system already follows more than one other system (a rotation,
    # A B C / B C A / C A B, keeps the cycle: A is always followed by B but once) ...
    for runs in (4, 5, 6):
        for key in KEYS:
            assert len({a for a, b in pairs(runs) if b == key}) > 1, (runs, key)
    # ... and over 6 runs (2n) each system follows each other one exactly twice.
    counts = {(a, b): pairs(6).count((a, b)) for a in KEYS for b in KEYS if a != b}
    assert set(counts.values()) == {2}
    firsts = [harness.run_order(KEYS, run)[0] for run in range(1, 7)]
    assert sorted(firsts) == sorted(KEYS * 2)  # and each stands first equally often


def test_the_order_is_balanced_for_any_number_of_systems() -> None:
    for n in range(2, 9):
        keys = [f"s{i}" for i in range(n)]
        period = n if n % 2 == 0 else 2 * n
        counts: dict[tuple[str, str], int] = {}
        for run in range(1, period + 1):
            order = harness.run_order(keys, run)
            assert sorted(order) == keys
            for pair in itertools.pairwise(order):
                counts[pair] = counts.get(pair, 0) + 1
        assert len(counts) == n * (n - 1), n  # every ordered pair occurs
        assert len(set(counts.values())) == 1, n  # and equally often


def _fake_harness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> harness.Harness:
    monkeypatch.setattr(
        harness,
        "REGISTRY",
        [harness.Entry(k, FAKE, (("label", k[-1]),)) for k in KEYS[:2]],
    )
    monkeypatch.setattr(harness, "_git", lambda: {})  # no git call from a test
    scale = dataclasses.replace(
        SMOKE, throughput_jobs=6, backlog_small=5, backlog_large=20, poll_s=0.005
    )
    opts = harness.Options(
        runs=2,
        scale=scale,
        out=tmp_path / "bench",
        pg_dsn=ADMIN_DSN,
        physical=False,
        log=lambda _: None,
        **kwargs,
    )
    return harness.Harness(opts)


def test_a_run_records_its_order_and_the_backlog_alternates_small_and_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    CALLS.clear()
    h = _fake_harness(tmp_path, monkeypatch, workloads=["throughput", "backlog"])
    result = h.run()
    runs = tmp_path / "bench" / "runs"

    for run, order in ((1, ["fake-a", "fake-b"]), (2, ["fake-b", "fake-a"])):
        assert result["meta"]["run_orders"][str(run)] == order
        for workload in ("throughput", "backlog"):
            for key in order:
                record = json.loads((runs / f"{workload}-{key}-{run}.json").read_text())
                assert record["order"] == order and record["position"] == order.index(key)
                assert not record.get("error"), record.get("error")

    # Two instances per system: the first prepared is the small one, the second holds
    # the large backlog (a database of its own for a real system).
    prepared = [n for n, what, _ in CALLS if what == "prepare"]
    assert len(prepared) == 4
    small = {h.slots[i].system.number for i in range(2)}  # type: ignore[union-attr]
    large = {h.slots[i].large.number for i in range(2)}  # type: ignore[union-attr]
    assert small.isdisjoint(large) and small | large == set(prepared)

    # Every large queue is filled and maintained (VACUUM ANALYZE + CHECKPOINT on a real
    # system) before any backlog drain, small or large, is timed.
    first_claim = next(i for i, (_, what, _) in enumerate(CALLS) if what == "claim")
    for n in large:
        mine = [(i, what, detail) for i, (m, what, detail) in enumerate(CALLS) if m == n]
        assert [w for _, w, _ in mine][:4] == ["prepare", "reset", "enqueue", "maintain"]
        assert mine[2][2] == 20 and mine[3][2] == 20  # filled, then maintained full
        assert mine[3][0] < first_claim
        assert [w for _, w, _ in mine].count("reset") == 1  # never reset after the fill
        # every top-up (an enqueue after the fill) is followed by the same maintenance
        whats = [w for _, w, _ in mine]
        top_ups = [j for j, w in enumerate(whats) if w == "enqueue" and j > 2]
        assert len(top_ups) == 2  # one per run
        assert all(whats[j + 1] == "maintain" for j in top_ups)
    for slot in h.slots:
        assert slot.state["backlog_fill"]["maintenance"] == {"fake": True}
        assert result["systems"][slot.entry.key]["backlog_fill"]["jobs"] == 20

    # The timed drains, in order: each system's small and large back to back, small
    # first in run 1 and large first in run 2, the systems' order reversed.
    number = {h.slots[i].system.number: (KEYS[i], "small") for i in range(2)}  # type: ignore[union-attr]
    number |= {h.slots[i].large.number: (KEYS[i], "large") for i in range(2)}  # type: ignore[union-attr]
    drains = [number[n] for n, what, _ in CALLS[first_claim:] if what == "claim"]
    assert drains == [
        ("fake-a", "small"),
        ("fake-a", "large"),
        ("fake-b", "small"),
        ("fake-b", "large"),
        ("fake-b", "large"),
        ("fake-b", "small"),
        ("fake-a", "large"),
        ("fake-a", "small"),
    ]
    record = json.loads((runs / "backlog-fake-a-2.json").read_text())
    assert record["phases"] == ["large", "small"]
    assert {"small_tasks_per_s", "large_tasks_per_s"} <= set(record["metrics"])
    backlog = result["results"]["backlog"]["fake-a"]["metrics"]
    assert backlog["large_over_small"]["n"] == 2


def test_the_small_half_runs_when_the_large_half_failed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 2 drains the large backlog first: when that fails, the small half (another
    instance) is still measured; later large halves are skipped (the queue is broken)."""
    CALLS.clear()
    h = _fake_harness(tmp_path, monkeypatch, workloads=["backlog"])
    starts: dict[int, int] = {}
    real = FakeQueue.start_workers

    def failing(self: FakeQueue, spec: Any, into: Any = None) -> Any:
        if any(slot.large is self for slot in h.slots):
            starts[self.number] = starts.get(self.number, 0) + 1
            if starts[self.number] == 2:
                raise RuntimeError("the large drain failed")
        return real(self, spec, into)

    monkeypatch.setattr(FakeQueue, "start_workers", failing)
    result = h.run()
    runs = tmp_path / "bench" / "runs"
    for key in KEYS[:2]:
        record = json.loads((runs / f"backlog-{key}-2.json").read_text())
        assert record["phases"] == ["large", "small"]
        assert "the large drain failed" in record["error"]
        assert record["detail"]["large"]["error"] == "RuntimeError: the large drain failed"
        assert record["metrics"]["small_tasks_per_s"] is not None  # measured anyway
        assert "large_tasks_per_s" not in record["metrics"]
        first = json.loads((runs / f"backlog-{key}-1.json").read_text())
        assert not first.get("error") and first["metrics"]["large_tasks_per_s"] is not None
        metrics = result["results"]["backlog"][key]["metrics"]
        assert metrics["small_tasks_per_s"]["n"] == 2


def test_the_recovery_cap_sits_above_every_documented_recovery() -> None:
    assert harness.recovery_cap(15.0, {"a": 5.5, "b": None}) == 15.0
    assert harness.recovery_cap(15.0, {"a": 5.5, "b": 60.0, "c": None}) == 75.0
    assert harness.recovery_cap(15.0, {"a": 12.0}) == 17.0  # at least 5 s of margin
    assert harness.recovery_cap(15.0, {}) == 15.0


def test_the_session_scale_measures_pgqueuers_and_celerys_documented_recovery(
    tmp_path: Path,
) -> None:
    h = harness.Harness(
        harness.Options(runs=1, scale=SESSION, out=tmp_path, workloads=["recovery"], physical=False)
    )
    cap = h.recovery_cap()
    bounds = cap["bounds_s"]
    assert bounds["pgqueuer"] == 60.0  # heartbeat 30 s, then the idle rescuer's 30 s poll
    # visibility timeout 30 s, the sweep mutex's 10 s (the victim killed holding it),
    # then one sweep
    assert bounds["celery-tuned"] == 41.0
    assert bounds["celery"] is None and bounds["procrastinate"] is None  # never recovered
    assert bounds["orbit-pg"] == 5.5
    assert cap["cap_s"] > max(b for b in bounds.values() if b is not None)
    assert cap["cap_s"] > SESSION.recovery_cap_s == cap["scale_cap_s"]


def test_a_run_uses_the_raised_cap_and_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = _fake_harness(tmp_path, monkeypatch, workloads=["enqueue"])
    h.workloads = ["enqueue", "recovery"]  # the cap is computed; only enqueue runs
    real = harness.plan
    monkeypatch.setattr(harness, "plan", lambda _, *rest: real(["enqueue"], *rest))
    monkeypatch.setattr(_fake_queue.FakeQueue, "recovery_bound_s", lambda self: 40.0)
    fits = dataclasses.replace(h.opts.scale, recovery_cap_fits_systems=True)
    h.opts.scale = fits
    result = h.run()
    assert result["meta"]["recovery_cap"]["cap_s"] == 50.0
    assert result["meta"]["scale"]["recovery_cap_s"] == 50.0
    assert h.scale.recovery_cap_s == 50.0


def test_a_run_counts_no_other_systems_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = _fake_harness(tmp_path, monkeypatch, workloads=["enqueue"])
    a, b = (FakeQueue(k) for k in "ab")
    h.slots[0].system, h.slots[1].system = a, b
    h.slots[1].large = FakeQueue("b")
    monkeypatch.setattr(a, "own_pids", lambda: [101])
    monkeypatch.setattr(b, "own_pids", lambda: [202])
    monkeypatch.setattr(h.slots[1].large, "own_pids", lambda: [303])
    assert sorted(h._foreign_pids(a)) == [202, 303]
    assert sorted(h._foreign_pids(b)) == [101, 303]
    step = harness.Step("enqueue", 1, "fake-a")
    assert sorted(h._context(step, h.slots[0], a).foreign_pids()) == [202, 303]
