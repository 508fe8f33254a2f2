"""The Celery app of the benchmark, for its workers and for its producer.

Workers are Celery's documented CLI, started by
:class:`benchmarks.systems.celery_system.CelerySystem` as ``python -m celery
--app=benchmarks.systems.celery_app worker ...``; the harness process imports the same
module to publish. The app is built at import from the environment the system exports:

* ``BENCH_CELERY_BROKER``: the Redis URL (a db reserved for Celery by the harness);
* ``BENCH_PROFILE``: ``tuned`` raises ``worker_prefetch_multiplier`` as Celery's
  "Optimizing" guide advises for many short tasks;
* ``BENCH_RECOVERY=1`` with the tuned profile: late acknowledgement and a short Redis
  visibility timeout, so a message whose worker was SIGKILLed is redelivered.

There is no result backend: every task ignores its result, so Celery keeps no durable
record of completion (the system's ``done_count`` is -1).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from benchmarks import recorder

#: the Redis URL of the broker
BROKER_ENV = "BENCH_CELERY_BROKER"
#: "defaults" or "tuned"
PROFILE_ENV = "BENCH_PROFILE"
#: "1" when the workers must recover jobs of a killed worker
RECOVERY_ENV = "BENCH_RECOVERY"
#: the task every benchmark job is sent to
TASK_NAME = "bench"

#: Celery's default prefetch multiplier, and the tuned one: the Optimizing guide says that
#: with many short tasks "this number should be large ... Say 64, or 128".
DEFAULT_PREFETCH_MULTIPLIER = 4
TUNED_PREFETCH_MULTIPLIER = 64
#: Tuned recovery: the Redis transport's visibility timeout (default 3600 s) and how often
#: a live worker sweeps for expired unacknowledged messages (kombu transport options
#: ``unacked_restore_interval`` x ``unacked_restore_throttle``, default 10 x 10 s).
#: The timeout is not a liveness check: a message still unacknowledged that long after
#: delivery is redelivered even if its worker is alive and running it. 5 s made the
#: rescuer re-run the victim's jobs before the victim was even killed; 30 s stays above
#: every job of the benchmark except the victim's hold jobs, and above the time the
#: recovery workload lets the victim hold them.
RECOVERY_VISIBILITY_TIMEOUT = 30
RECOVERY_RESTORE_INTERVAL = 1
RECOVERY_RESTORE_THROTTLE = 1
#: The sweep runs under a Redis mutex that expires after 300 s by default: a worker killed
#: while holding it would stall every other worker's sweep for that long.
RECOVERY_MUTEX_EXPIRE = 10


def config(profile: str, *, recovery: bool) -> dict[str, Any]:
    """The Celery settings of a profile; recovery only matters with ``tuned``."""
    conf: dict[str, Any] = {
        "task_ignore_result": True,
        "worker_prefetch_multiplier": DEFAULT_PREFETCH_MULTIPLIER,
    }
    if profile == "tuned":
        conf["worker_prefetch_multiplier"] = TUNED_PREFETCH_MULTIPLIER
        if recovery:
            conf.update(
                # The Optimizing guide's "reserve one task at a time": acks_late with a
                # prefetch multiplier of 1, so a message is acknowledged only once run.
                task_acks_late=True,
                worker_prefetch_multiplier=1,
                broker_transport_options={
                    "visibility_timeout": RECOVERY_VISIBILITY_TIMEOUT,
                    "unacked_restore_interval": RECOVERY_RESTORE_INTERVAL,
                    "unacked_restore_throttle": RECOVERY_RESTORE_THROTTLE,
                    "unacked_mutex_expire": RECOVERY_MUTEX_EXPIRE,
                },
            )
    return conf


def build_app(broker_url: str, profile: str, *, recovery: bool = False) -> Celery:
    app = Celery("bench", broker=broker_url)
    app.conf.update(config(profile, recovery=recovery))

    # shared=False: each app owns its task (the producer and a worker may coexist).
    @app.task(name=TASK_NAME, ignore_result=True, shared=False)
    def bench(payload: dict[str, Any]) -> None:
        recorder.run_sync(payload)

    return app


#: the app ``celery --app=benchmarks.systems.celery_app`` loads
app = build_app(
    os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/0"),
    os.environ.get(PROFILE_ENV, "defaults"),
    recovery=os.environ.get(RECOVERY_ENV) == "1",
)
