"""Passwords out of everything the benchmarks record or print.

A DSN or URL may carry a password (``postgresql://user:pw@host/db``, ``password=pw``):
the log lines, the run files, ``summary.json``, the CPU sampler's process labels (an
Orbit server's ``--db`` URL) and the report's "This run" line all pass through here, so
the password reads ``***`` wherever it would have been written.
"""

from __future__ import annotations

import re
from typing import Any

_SECRETS = (
    (re.compile(r"(://[^:/@\s]*:)[^@\s]+@"), r"\1***@"),
    (re.compile(r"(password\s*=\s*)\S+", re.IGNORECASE), r"\1***"),
)


def mask(text: str) -> str:
    """``text`` with the password of every DSN or URL in it replaced by ``***``."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def masked(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings) with every string ``mask``-ed."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {k: masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked(v) for v in value]
    return value
