"""Orbit: durable job execution for Python.

The public surface grows issue by issue; today it is the store layer
(``orbit.store.open_store``) over the pure lifecycle rules in ``orbit.core``.
"""

__all__: list[str] = []
