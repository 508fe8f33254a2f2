"""The public surface is small and explicit: ``orbit.__all__`` is sorted and complete."""

from __future__ import annotations

import orbit


def test_all_is_sorted_and_importable() -> None:
    assert orbit.__all__ == sorted(orbit.__all__)
    for name in orbit.__all__:
        assert getattr(orbit, name) is not None
    public = {n for n in dir(orbit) if not n.startswith("_") and n[0].isupper()}
    assert public == set(orbit.__all__)
