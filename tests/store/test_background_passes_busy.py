"""The server's background duties (``_reaper``, ``_scheduler`` in orbit.server.app)
while another connection holds the database's write lock: each pass the store gives up
on (``DatabaseUnavailable``) is skipped with one WARNING for the whole stretch, no
traceback, and once the lock is released the next pass does the work (an expired lease
reaped, a due schedule fired) and says that passes run again.

Every skipped pass was logged at ERROR with a full traceback (``reaper pass failed``),
under the store's own warning that it gave up: noise that read as a bug. The lock is
held by a real second connection; each store here waits a tenth of a second for it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from orbit.aio import stop_tasks
from orbit.core.model import SECOND, TaskSpec
from orbit.server.app import _reaper, _scheduler
from orbit.server.metrics import Metrics
from orbit.store import Store, StoreConfig, open_store, sqlite_path
from tests.conftest import ManualClock
from tests.db_locks import write_lock
from tests.store.helpers import RACE_WAIT, queue, run_one, submit, worker

#: each store's wait for the lock before it gives up (``tx_wait_us``)
WAIT = StoreConfig(tx_wait_us=SECOND // 10)
#: PostgreSQL's lock wait per try, through the URL (the store keeps a URL's own)
IMPATIENT = "options=-c%20lock_timeout%3D30"
#: the duties' pause between passes here
INTERVAL = 0.05


def _open(url: str, clock: ManualClock) -> Store:
    if sqlite_path(url) is None:
        url = f"{url}{'&' if '?' in url else '?'}{IMPATIENT}"
    return open_store(url, WAIT, clock=clock)


async def _until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until it holds; ``RACE_WAIT`` is only a safety net."""
    ends = time.monotonic() + RACE_WAIT
    while not check():
        assert time.monotonic() < ends, f"never: {what}"
        await asyncio.sleep(0.01)


def _said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.message]


def _skipped_while_locked(
    url: str,
    caplog: pytest.LogCaptureFixture,
    duty: Coroutine[Any, Any, None],
    done: Callable[[], bool],
) -> None:
    """Run ``duty`` under another connection's write lock until the store has given up
    on two of its passes, release the lock, and wait until ``done()``."""

    async def scenario() -> None:
        with write_lock(url):
            running = asyncio.create_task(duty)
            try:
                await _until(
                    lambda: len(_said(caplog, logging.WARNING, "gave up")) >= 2,
                    "two passes given up",
                )
            except BaseException:
                await stop_tasks([running])
                raise
        try:
            await _until(done, "the pass after the lock did its work")
            await _until(lambda: bool(_said(caplog, logging.INFO, "run again")), "passes run again")
        finally:
            await stop_tasks([running])

    caplog.set_level(logging.INFO)
    asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not [r for r in caplog.records if r.exc_info or r.exc_text], caplog.text


def test_the_reaper_skips_its_passes_under_a_lock_with_one_warning(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    store = _open(fresh_url, clock)
    try:
        queue(store)
        tid = submit(store, retry_safe=True)
        session, _ = worker(store)
        grant = run_one(store, session)
        clock.advance(WAIT.lease_ttl_us / SECOND + 1)  # its lease has run out

        _skipped_while_locked(
            fresh_url,
            caplog,
            _reaper(store, INTERVAL, Metrics(store)),
            lambda: store.attempt_get(grant.attempt.id).state == "lost",
        )
        assert store.task_get(tid).state == "scheduled"  # to run again, after its backoff
        busy = (
            "reaper pass skipped: the database is busy: another process or a long transaction "
            "holds its lock; nothing was written (DATABASE_BUSY); "
            f"trying again every {INTERVAL:g} s"
        )
        assert _said(caplog, logging.WARNING, "reaper pass") == [busy]  # once, not a pass
        [again] = _said(caplog, logging.INFO, "run again")
        assert again.startswith("reaper passes run again, after ")
        assert int(again.split()[-2]) >= 2  # the passes skipped, counted
    finally:
        store.close()


def test_the_scheduler_skips_its_passes_under_a_lock_with_one_warning(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    store = _open(fresh_url, clock)
    try:
        queue(store)
        template = TaskSpec(queue="q", handler="h")
        store.schedule_create("every-minute", cron="* * * * *", timezone="UTC", template=template)
        clock.advance(61)  # its first instant is due

        _skipped_while_locked(
            fresh_url,
            caplog,
            _scheduler(store, INTERVAL),
            lambda: bool(store.task_list(queue="q")),
        )
        [task] = store.task_list(queue="q")
        assert str(task.idempotency_key).startswith("schedule:")
        [skipped] = _said(caplog, logging.WARNING, "schedule pass")  # once, not a pass
        assert skipped.startswith("schedule pass skipped: the database is busy: ")
        assert "(DATABASE_BUSY)" in skipped
        [again] = _said(caplog, logging.INFO, "run again")
        assert again.startswith("schedule passes run again, after ")
    finally:
        store.close()
