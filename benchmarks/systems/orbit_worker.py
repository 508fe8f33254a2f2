"""The Orbit worker the benchmark starts: ``orbit worker benchmarks.systems.orbit_worker:worker``.

One async handler, ``bench``, runs the shared handler body, so Orbit does exactly the
work every peer does. The settings come from the environment the harness (through
:class:`benchmarks.systems.orbit_system.OrbitSystem`) exports:

- ``ORBIT_URL`` / ``ORBIT_TOKEN_FILE``: the server and the token (read by ``orbit.Worker``)
- ``BENCH_CONCURRENCY``: attempts in flight in this process (``WorkerSpec.concurrency``)
- ``BENCH_PREFETCH``: attempts claimed ahead of a free slot (``orbit.Worker(prefetch=…)``;
  the tuned profile's I/O-bound workload only, else 0)
- ``BENCH_REC_DIR`` / ``BENCH_HOLD``: read by :mod:`benchmarks.recorder`
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks import recorder
from orbit import Context, Worker

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"),
    name=os.environ.get("BENCH_WORKER_NAME", "bench"),
    concurrency=int(os.environ.get("BENCH_CONCURRENCY", "10")),
    prefetch=int(os.environ.get("BENCH_PREFETCH", "0")),
)


# retry_safe=True: the benchmark's jobs are submitted retry-safe so that the recovery
# workload sees them replayed on another worker after their lease runs out.
@worker.handler("bench", retry_safe=True)
async def bench(ctx: Context, payload: dict[str, Any]) -> None:
    """Run the shared body; the result is null (nothing to store but the success)."""
    await recorder.run_async(payload)
