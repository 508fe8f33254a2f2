"""Garbage-collector settings for Orbit's own long-running processes.

CPython starts a collection of its youngest generation every 700 net allocations. A
server answering batches of hundreds of tasks allocates tens of thousands of short-lived
objects per request (rows, records, wire dicts) and so collected dozens of times per
batch, about a tenth of its CPU in a drain (``python -m benchmarks.probe``; see
docs/benchmarks/history.md). Hardly any of those objects are in reference cycles: reference
counting frees them the moment they are dropped, and the collector exists only to find
cycles. So Orbit's processes collect the young generation every 50,000 allocations
instead, and first freeze what start-up loaded (modules, the app), which no full
collection then needs to walk again. Garbage in cycles is still found, just in larger
and rarer passes: a few megabytes at most.

Only the processes Orbit starts call this (``orbit server``, ``orbit dev``, ``orbit
worker``, ``Worker.run``); an application that embeds Orbit keeps its own settings.
"""

from __future__ import annotations

import gc

YOUNG_GENERATION_THRESHOLD = 50_000


def tune_for_throughput() -> None:
    """Freeze the objects loaded so far and collect the young generation less often."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, old)
