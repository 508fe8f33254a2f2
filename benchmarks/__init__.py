"""Orbit's side-by-side benchmark harness: Orbit and its peers, same machine, same run.

Run it with ``python -m benchmarks`` (or ``make bench``); see ``docs/benchmarks.md``.
"""
