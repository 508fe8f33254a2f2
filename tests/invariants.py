"""Checks of invariants I1-I9 against a real store: its rows and its event log.

Used after every step of the stateful test, after the concurrency test and by the
per-invariant tests. Each check returns a list of violations (empty = holds), so a
failure message names every broken task at once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from orbit.store import Store

LIVE = {"claimed", "running"}


def all_events(store: Store) -> list[dict[str, Any]]:
    """The whole event log, in id order: the order the events were inserted in, which
    the replays below need. The feed's own order is by transaction, and a transaction
    that took its id early can come before one whose effect it read (docs/concepts.md,
    "The event log"); an event is inserted only after what it read had committed."""
    out: list[dict[str, Any]] = []
    after_xid, after_id = 0, 0
    while page := store.event_list(after_xid=after_xid, after_id=after_id, limit=5000):
        out.extend(page)
        after_xid, after_id = page[-1]["xid"], page[-1]["id"]
    return sorted(out, key=lambda e: int(e["id"]))


def _all_tasks(store: Store) -> list[Any]:
    tasks, after = [], None
    while True:
        page = store.task_list(after_id=after, limit=1000)
        if not page:
            return tasks
        tasks.extend(page)
        after = page[-1].id


class ResultLedger:
    """Remembers every committed result seen so far, to prove none ever changes (I2)."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str | None, str | None, int]] = {}

    def check(self, tasks: list[Any]) -> list[str]:
        bad = []
        for t in tasks:
            if t.result_version == 0:
                if t.id in self.seen:
                    bad.append(f"I2 {t.id}: committed result disappeared")
                continue
            now = (t.result, t.result_digest, t.result_version)
            if t.result_version != 1:
                bad.append(f"I2 {t.id}: result_version {t.result_version} != 1")
            if t.id in self.seen and self.seen[t.id] != now:
                bad.append(f"I2 {t.id}: committed result changed")
            self.seen.setdefault(t.id, now)
        return bad


def check_all(
    store: Store, ledger: ResultLedger | None = None, caps: dict[str, Any] | None = None
) -> list[str]:
    """Every invariant that can be read off the store at rest."""
    tasks = _all_tasks(store)
    events = all_events(store)
    attempts = {t.id: store.attempt_list(t.id) for t in tasks}
    bad: list[str] = []
    bad += check_i1(attempts)
    bad += check_i2(tasks, events, ledger)
    bad += check_i4(store, events, caps)
    bad += check_i5(tasks, attempts, events)
    bad += check_i6(tasks, events)
    bad += check_i7(tasks)
    bad += check_i9(tasks, attempts, events)
    return bad


def check_i1(attempts: dict[str, list[Any]]) -> list[str]:
    return [
        f"I1 {task_id}: {n} live attempts"
        for task_id, items in attempts.items()
        if (n := sum(1 for a in items if a.state in LIVE)) > 1
    ]


def check_i2(
    tasks: list[Any], events: list[dict[str, Any]], ledger: ResultLedger | None
) -> list[str]:
    commits: dict[str, int] = defaultdict(int)
    for e in events:
        if e["task_to"] == "succeeded":
            commits[e["task_id"]] += 1
    bad = [f"I2 {tid}: result committed {n} times" for tid, n in commits.items() if n > 1]
    for t in tasks:
        if t.state == "succeeded" and (t.result_version != 1 or t.result_digest is None):
            bad.append(f"I2 {t.id}: succeeded without exactly one result version")
        if t.state != "succeeded" and t.result_version != 0:
            bad.append(f"I2 {t.id}: a result is stored but the task is {t.state}")
    if ledger is not None:
        bad += ledger.check(tasks)
    return bad


def occupancy_replay(events: list[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    """Replay permits from the event log in order; return the peaks seen per scope."""
    live: dict[str, int] = defaultdict(int)
    peak: dict[str, int] = defaultdict(int)
    for e in events:
        frm, to = e["attempt_from"], e["attempt_to"]
        delta = (1 if to in LIVE else 0) - (1 if frm in LIVE else 0)
        if delta == 0:
            continue
        for scope in (
            "global",
            f"queue:{e['queue']}",
            f"tenant:{e['tenant']}",
            f"session:{e['session_id']}",
        ):
            live[scope] += delta
            peak[scope] = max(peak[scope], live[scope])
    negatives = [f"I4 {k}: live count went negative" for k, v in live.items() if v < 0]
    return negatives, dict(peak)


def check_i4(store: Store, events: list[dict[str, Any]], caps: dict[str, Any] | None) -> list[str]:
    bad, peak = occupancy_replay(events)
    limits: dict[str, int] = {f"queue:{q.name}": q.max_concurrency for q in store.queue_list()}
    for s in store.session_list():
        limits[f"session:{s.id}"] = s.max_concurrency
    for e in events:  # a cap may have been lowered: judge by the largest it had
        if e["kind"] == "session.capacity":
            key = f"session:{e['session_id']}"
            limits[key] = max(limits.get(key, 0), json.loads(e["data"])["max_concurrency"])
        elif e["kind"] in ("queue.created", "queue.updated"):
            cap = json.loads(e["data"]).get("max_concurrency")
            if cap is not None:
                key = f"queue:{e['queue']}"
                limits[key] = max(limits.get(key, 0), cap)
    for k, v in (caps or {}).items():
        limits[k] = v
    for scope, n in peak.items():
        cap = limits.get(scope)
        if cap is not None and n > cap:
            bad.append(f"I4 {scope}: {n} live attempts, cap {cap}")
    current = sum(int(r["n"]) for r in store.live_attempt_counts())
    replayed = _final_live(events)
    if current != replayed:
        bad.append(f"I4: {current} live attempts stored, {replayed} by the event log")
    return bad


def _final_live(events: list[dict[str, Any]]) -> int:
    n = 0
    for e in events:
        n += (1 if e["attempt_to"] in LIVE else 0) - (1 if e["attempt_from"] in LIVE else 0)
    return n


def check_i5(
    tasks: list[Any], attempts: dict[str, list[Any]], events: list[dict[str, Any]]
) -> list[str]:
    started: dict[str, int] = defaultdict(int)
    for e in events:
        if e["kind"] == "started":
            started[e["task_id"]] += 1
    bad = []
    for t in tasks:
        by_rows = sum(1 for a in attempts[t.id] if a.started_at is not None)
        if not t.attempts_used == by_rows == started[t.id]:
            bad.append(
                f"I5 {t.id}: attempts_used {t.attempts_used}, started rows {by_rows}, "
                f"started events {started[t.id]}"
            )
    return bad


def check_i6(tasks: list[Any], events: list[dict[str, Any]]) -> list[str]:
    unsafe = {t.id for t in tasks if not t.retry_safe}
    may_start: dict[str, bool] = {}
    bad = []
    for e in events:
        tid = e["task_id"]
        if tid not in unsafe:
            continue
        if e["kind"] == "started":
            if not may_start.get(tid, True):
                bad.append(f"I6 {tid}: not retry_safe, started again without a decision")
            may_start[tid] = False
        elif e["kind"] in ("resolved", "retried") or e["attempt_to"] == "failed":
            may_start[tid] = True  # an operator decision, or a reported (known) failure
    return bad


def check_i7(tasks: list[Any]) -> list[str]:
    """No task waits or runs under a cancelled ancestor: the cancel cascaded down the
    whole tree, past any task that had ended (which it leaves as it was)."""
    by_id = {t.id: t for t in tasks}
    bad = []
    for t in tasks:
        if t.state in ("succeeded", "failed", "cancelled", "cancelling"):
            continue
        ancestor = by_id.get(t.parent_id) if t.parent_id else None
        while ancestor is not None and not ancestor.cancel_requested:
            ancestor = by_id.get(ancestor.parent_id) if ancestor.parent_id else None
        if ancestor is not None:
            bad.append(f"I7 {t.id}: ancestor {ancestor.id} cancelled but task is {t.state}")
    return bad


def check_i9(
    tasks: list[Any], attempts: dict[str, list[Any]], events: list[dict[str, Any]]
) -> list[str]:
    task_chain: dict[str, str | None] = {}
    attempt_chain: dict[str, str | None] = {}
    bad = []
    for e in events:
        tid = e["task_id"]
        if e["task_to"] is not None and tid is not None:
            if task_chain.get(tid) != e["task_from"]:
                bad.append(
                    f"I9 {tid}: event {e['id']} moves from {e['task_from']} but the "
                    f"log says {task_chain.get(tid)}"
                )
            task_chain[tid] = e["task_to"]
        aid = e["attempt_id"]
        if e["attempt_to"] is not None and aid is not None:
            if attempt_chain.get(aid) != e["attempt_from"]:
                bad.append(
                    f"I9 attempt {aid}: event {e['id']} moves from "
                    f"{e['attempt_from']} but the log says {attempt_chain.get(aid)}"
                )
            attempt_chain[aid] = e["attempt_to"]
    for t in tasks:
        if task_chain.get(t.id) != t.state:
            bad.append(f"I9 {t.id}: stored {t.state}, event log says {task_chain.get(t.id)}")
        for a in attempts[t.id]:
            if attempt_chain.get(a.id) != a.state:
                bad.append(
                    f"I9 attempt {a.id}: stored {a.state}, log says {attempt_chain.get(a.id)}"
                )
    return bad
