"""Imported by ``orbit worker tests.unit.worker_imports:worker`` in test_public_api: prints
which of the modules a worker process must not load were loaded by then (the CLI has
imported what it runs a worker with before it imports the worker's module)."""

import sys

UNWANTED = ("httpx", "orbit.client", "orbit.server", "fastapi", "uvicorn")
print("loaded:", ",".join(m for m in UNWANTED if m in sys.modules), flush=True)
worker = None  # not a Worker: the command stops here, having imported everything else
