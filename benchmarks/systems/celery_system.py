"""Celery 5.7 with the Redis broker as a system under test.

Everything goes through Celery's documented surface: ``Task.apply_async`` per job and
``group(...).apply_async()`` per batch for publishing, and the ``celery worker`` CLI with
the app in :mod:`benchmarks.systems.celery_app` for the workers. Celery has no batch
publish: a group still sends one message per task (over one producer connection), so the
batch path saves little. There is no result backend, so ``done_count`` is -1 and the
harness counts the handlers' own records.

The harness reserves a Redis database for Celery (``Env.redis_url``); this system only
ever runs ``FLUSHDB`` on that database: when it prepares (and refuses to, flushing
nothing, when the database holds keys, unless ``Env.flush_redis`` says it may), before
each run and when it closes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis
from celery import Celery, group

from benchmarks.recorder import HOLD_ENV, REC_DIR_ENV
from benchmarks.systems.base import Env, Job, PeerSystem, WorkerSpec
from benchmarks.systems.celery_app import (
    BROKER_ENV,
    DEFAULT_PREFETCH_MULTIPLIER,
    PROFILE_ENV,
    RECOVERY_ENV,
    RECOVERY_MUTEX_EXPIRE,
    RECOVERY_RESTORE_INTERVAL,
    RECOVERY_RESTORE_THROTTLE,
    RECOVERY_VISIBILITY_TIMEOUT,
    TASK_NAME,
    TUNED_PREFETCH_MULTIPLIER,
    build_app,
    config,
)

ROOT = Path(__file__).resolve().parents[2]
APP_PATH = "benchmarks.systems.celery_app"


class CelerySystem(PeerSystem):
    """Celery over a reserved Redis database.

    Worker pools: a no-op workload runs Celery's default prefork pool (with ``defaults``
    its default concurrency, the CPU count; with ``tuned`` ``WorkerSpec.concurrency``
    child processes, capped at the CPU count). An ``io_bound`` or ``hold`` workload runs
    the threads pool with ``WorkerSpec.concurrency`` threads in both profiles: Celery's
    docs send I/O-bound work to eventlet or gevent, which need extra packages, and threads
    is the pool that does the same job without them. One worker process in the harness's
    sense is one ``celery worker`` command, whose prefork pool forks its children under it.

    Recovery mode: when ``recovery`` is true, or once any worker of the current run was
    started with ``WorkerSpec.hold`` (until the next ``reset``), workers are started with
    ``BENCH_RECOVERY=1``. With the tuned profile the worker app then acknowledges late and
    uses a short Redis visibility timeout (see ``recovery_settings``); with the defaults
    profile nothing changes and messages acknowledged at start are lost with the worker.
    """

    name = "celery"
    uses_postgres = False

    def __init__(self, profile: str = "defaults", recovery: bool = False) -> None:
        super().__init__(profile, recovery)
        self._redis: redis.Redis | None = None
        self._app: Celery | None = None
        self._last_worker_args: list[str] | None = None
        self._log_seq = 0

    # -- description -------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        out = {
            "celery": importlib.metadata.version("celery"),
            "kombu": importlib.metadata.version("kombu"),
            "redis-py": importlib.metadata.version("redis"),
        }
        if self._redis is not None:
            out["redis-server"] = str(self._redis.info("server").get("redis_version", "?"))
        return out

    def settings(self) -> dict[str, Any]:
        tuned = self.profile == "tuned"
        out: dict[str, Any] = {
            "profile": self.profile,
            "broker": _setting("redis", "celery docs (Using Redis)"),
            "result_backend": _setting(
                "none (task_ignore_result)", "no durable completion record is kept"
            ),
            "pool": _setting(
                "prefork; threads when the workload is io_bound or hold",
                "celery default (prefork); celery docs (concurrency) send I/O-bound work to "
                "eventlet/gevent, which need extra packages, so threads stands in",
            ),
            "concurrency": _setting(
                "WorkerSpec.concurrency threads for io_bound/hold; prefork: "
                + ("WorkerSpec.concurrency capped at the CPU count" if tuned else "CPU count"),
                "celery worker --concurrency; CPU count is celery's default, and its docs put "
                "prefork's cut-off at a few processes per CPU",
            ),
            "worker_prefetch_multiplier": _setting(
                f"{TUNED_PREFETCH_MULTIPLIER} (1 in recovery mode)"
                if tuned
                else DEFAULT_PREFETCH_MULTIPLIER,
                "celery docs (Optimizing, prefetch limits: 'Say 64, or 128' for short tasks)"
                if tuned
                else "celery default",
            ),
            "task_acks_late": _setting(
                "True in recovery mode, else False" if tuned else False,
                "celery docs (Optimizing, reserve one task at a time)"
                if tuned
                else "celery default (acknowledge just before running)",
            ),
            "visibility_timeout_s": _setting(
                f"{RECOVERY_VISIBILITY_TIMEOUT} in recovery mode, else 3600" if tuned else 3600,
                "celery docs (Using Redis: visibility timeout); 3600 is the default",
            ),
            "serializer": _setting("json", "celery default"),
            "enqueue_batch": _setting(
                "group(...).apply_async(): still one message per task",
                "celery has no bulk publish",
            ),
        }
        if self._redis is not None:
            persistence = self._redis.config_get("appendonly") | self._redis.config_get("save")
            out["redis_persistence"] = _setting(
                persistence, "the Redis server's own config, not changed by the benchmark"
            )
        if self._last_worker_args is not None:
            out["last_worker_args"] = self._last_worker_args
        return out

    # -- lifecycle ------------------------------------------------------------------------

    def prepare(self, env: Env) -> None:
        """Refuses a database that holds keys (someone else's data) unless
        ``env.flush_redis``; the database is flushed only after that check, and ``close``
        flushes only a database this instance took (``_redis`` is set once it has)."""
        self._env = env
        env.work_dir.mkdir(parents=True, exist_ok=True)
        client = redis.Redis.from_url(env.redis_url)
        try:
            keys = int(client.dbsize())
            if keys and not env.flush_redis:
                db = client.connection_pool.connection_kwargs.get("db", 0)
                raise RuntimeError(
                    f"Redis database {db} holds {keys:,} key(s), which the run would flush: "
                    "empty it, choose others with --redis-db-base, or pass --flush-redis"
                )
            client.flushdb()
        except BaseException:
            client.close()
            raise
        self._redis = client
        self._app = build_app(env.redis_url, self.profile)

    def reset(self) -> None:
        """Flush the reserved db and start over with a fresh producer: the flush also
        drops kombu's queue bindings, which a producer declares only once."""
        self._forget_hold()
        self._require_redis().flushdb()
        if self._app is not None:
            self._app.close()
        self._app = build_app(self._require_env().redis_url, self.profile)

    def close(self) -> None:
        if self._app is not None:
            self._app.close()
            self._app = None
        if self._redis is not None:
            self._redis.flushdb()
            self._redis.close()
            self._redis = None

    # -- jobs -----------------------------------------------------------------------------

    def enqueue(self, jobs: list[Job], batch: int) -> None:
        """``apply_async`` per job, or one ``group`` per ``batch`` jobs. Either returns
        once Redis has the messages; how durable they are is the Redis server's
        persistence config (see ``settings``)."""
        task = self._require_app().tasks[TASK_NAME]
        if batch <= 1:
            for job in jobs:
                task.apply_async((job,))
            return
        for start in range(0, len(jobs), batch):
            group(task.s(job) for job in jobs[start : start + batch]).apply_async()

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        self._note_workers(spec)
        args = self.worker_args(spec)
        self._last_worker_args = args
        env = dict(os.environ)
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
        env.pop(HOLD_ENV, None)
        env.pop(RECOVERY_ENV, None)
        env[REC_DIR_ENV] = str(spec.rec_dir)
        env[BROKER_ENV] = self._require_env().redis_url
        env[PROFILE_ENV] = self.profile
        if spec.hold:
            env[HOLD_ENV] = "1"
        if self._recovery_mode():
            env[RECOVERY_ENV] = "1"

        def start_one() -> subprocess.Popen[bytes]:
            self._log_seq += 1
            cmd = [
                sys.executable,
                "-m",
                "celery",
                f"--app={APP_PATH}",
                "worker",
                f"--hostname=bench-{self.profile}-{self._log_seq}@%h",
                *args,
            ]
            return self._spawn(cmd, env, self._log_seq)

        return self._start_each(spec.processes, into, start_one)

    def worker_args(self, spec: WorkerSpec) -> list[str]:
        """The ``celery worker`` pool options for ``spec`` under this profile."""
        if spec.io_bound or spec.hold:
            return ["--pool=threads", f"--concurrency={spec.concurrency}"]
        if self.profile == "tuned":
            return ["--pool=prefork", f"--concurrency={tuned_prefork_concurrency(spec)}"]
        return []

    def stop_workers(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """The base stop, then SIGKILL to each worker's process group: a prefork parent
        killed after the grace period would leave its pool children behind."""
        super().stop_workers(procs)
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def done_count(self) -> int:
        return -1

    def in_flight(self, spec: WorkerSpec) -> str:
        """The pool's size times the prefetch multiplier: the messages one worker
        reserves at once (Celery's prefetch limit), of which the pool runs ``size``."""
        recovery = self.profile == "tuned" and spec.hold  # the recovery workload's victim
        prefetch = config(self.profile, recovery=recovery)["worker_prefetch_multiplier"]
        if spec.io_bound or spec.hold:
            pool, size = "threads", spec.concurrency
        elif self.profile == "tuned":
            pool, size = "prefork", tuned_prefork_concurrency(spec)
        else:
            pool, size = "prefork", os.cpu_count() or 1  # celery worker's default
        return f"{pool} pool of {size:,} x prefetch {prefetch} = {size * prefetch:,} reserved"

    # -- recovery -------------------------------------------------------------------------

    def recovery_note(self) -> str:
        return (
            "By default Celery acknowledges a message just before running it, so the jobs a "
            "SIGKILLed worker was running are lost; messages it had prefetched but not "
            "started stay unacknowledged and the Redis transport redelivers them after the "
            "visibility timeout (default 1 h), swept by a live worker every "
            "unacked_restore_interval x unacked_restore_throttle (default 100 s). With "
            "task_acks_late a running job is also redelivered after the visibility timeout. "
            "That timeout counts from delivery, not from the worker's death: a job is "
            "recovered visibility_timeout after its worker received it (minus the time it had "
            "already held it when killed), and a job that runs longer than the timeout is "
            "run twice even when its worker is alive."
        )

    def recovery_settings(self) -> dict[str, Any]:
        if self.profile == "tuned":
            return {
                "task_acks_late": True,
                "worker_prefetch_multiplier": 1,
                "visibility_timeout_s": RECOVERY_VISIBILITY_TIMEOUT,
                "unacked_restore_interval_s": RECOVERY_RESTORE_INTERVAL,
                "unacked_restore_throttle": RECOVERY_RESTORE_THROTTLE,
                "unacked_mutex_expire_s": RECOVERY_MUTEX_EXPIRE,
                "source": "celery docs (Optimizing; Using Redis) and kombu's Redis transport "
                "options, shortest sane values",
            }
        return {
            "task_acks_late": False,
            "visibility_timeout_s": 3600,
            "source": "celery defaults (running jobs are lost)",
        }

    def recovery_bound_s(self) -> float | None:
        """Tuned: the visibility timeout (it counts from delivery, before the kill), the
        sweep mutex's expiry (the worst case celery_app.py names: the victim killed while
        holding the restore mutex stalls every other worker's sweep until it expires) and
        one unacked-restore sweep. Defaults: never (acknowledged at start, so lost)."""
        if self.profile != "tuned":
            return None
        return float(
            RECOVERY_VISIBILITY_TIMEOUT
            + RECOVERY_MUTEX_EXPIRE
            + RECOVERY_RESTORE_INTERVAL * RECOVERY_RESTORE_THROTTLE
        )

    # -- helpers --------------------------------------------------------------------------

    def _require_redis(self) -> redis.Redis:
        if self._redis is None:
            raise RuntimeError("prepare() has not been called")
        return self._redis

    def _require_app(self) -> Celery:
        if self._app is None:
            raise RuntimeError("prepare() has not been called")
        return self._app

    def _spawn(self, cmd: list[str], env: dict[str, str], seq: int) -> subprocess.Popen[bytes]:
        log = self._require_env().work_dir / f"celery-worker-{seq}.log"
        with log.open("ab") as out:
            # A session of its own, so stop_workers can reach the prefork children.
            return subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


def tuned_prefork_concurrency(spec: WorkerSpec) -> int:
    """``WorkerSpec.concurrency`` pool processes, but no more than the CPUs: Celery's docs
    default prefork to the CPU count and put its cut-off at a few processes per CPU (a
    recovery rescuer asks for 200, which would fork 200 children)."""
    return max(1, min(spec.concurrency, os.cpu_count() or 1))


def _setting(value: Any, source: str) -> dict[str, Any]:
    return {"value": value, "source": source}
