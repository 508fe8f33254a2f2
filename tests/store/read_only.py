"""A directory and a file this process cannot write, as root too.

``chmod`` stops no write of root's, so as root the part that must find them read-only
runs with the effective user ``nobody`` (``as_unprivileged``; the real user stays root,
which takes it back), in a directory ``nobody`` can reach: pytest's own ``tmp_path``
is under a directory only its owner may enter."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NOBODY = 65534


@contextmanager
def reachable_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory that ``as_unprivileged`` may enter and read."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    made = Path(tempfile.mkdtemp(prefix="orbit-ro-"))
    try:
        made.chmod(0o755)
        yield made
    finally:
        shutil.rmtree(made)


@contextmanager
def as_unprivileged() -> Iterator[None]:
    """Run the block as a user whom a missing write permission stops."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
