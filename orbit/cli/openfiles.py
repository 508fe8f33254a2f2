"""The open-file limit of a node's process (``orbit server``, ``orbit dev``).

Each worker connection and each event stream holds one open file (its socket), and so
does each of the store's database connections. A process at its limit (``RLIMIT_NOFILE``)
cannot accept: uvloop's accept loop takes ``EMFILE`` in silence, the kernel resets the
connection, and neither the node's log (at any level) nor the worker (``connect
failed``) says why. Linux distributions start a process with a soft limit of 1024 (256
on macOS) under a hard limit many times that, which a process may raise its own soft
limit to: a node does so at start, logs the limit in force, and warns if that is still
low (the hard limit is the operator's to raise).
"""

from __future__ import annotations

import logging

log = logging.getLogger("orbit.server")

#: below this many open files a node warns at start: a few thousand workers and streams
ENOUGH = 4096
#: macOS refuses a soft limit above ``kern.maxfilesperproc`` (and ``RLIM_INFINITY``),
#: whatever the hard limit says; its ``OPEN_MAX`` is always allowed
OPEN_MAX = 10240


def raise_open_files_limit() -> int | None:
    """Raise this process's soft limit of open files to its hard limit (POSIX; elsewhere
    nothing is done), log the limit in force at INFO, and warn if it is under
    ``ENOUGH``. Returns the limit in force (None: no limit, or none to read)."""
    try:
        import resource
    except ImportError:  # Windows: no RLIMIT_NOFILE to read or raise
        return None
    infinity = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    if soft != infinity and soft != hard:
        targets = [hard] if hard != infinity else [infinity]
        if hard == infinity or hard > OPEN_MAX:
            targets.append(OPEN_MAX)
        for target in targets:
            if target != infinity and target <= soft:
                continue
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                continue
            soft = target
            break
    if soft == infinity:
        log.info("open files: no limit")
        return None
    ceiling = "no hard limit" if hard == infinity else f"hard limit {hard}"
    if soft != before:
        log.info("open files: the limit is %d, raised from %d (%s)", soft, before, ceiling)
    else:
        log.info("open files: the limit is %d (%s)", soft, ceiling)
    if soft < ENOUGH:
        log.warning(
            "open files: the limit of %d is low. Each worker connection and each event "
            "stream holds one open file, and so does each of the store's database "
            "connections; at the limit new connections are reset and nothing is logged. "
            "Raise the hard limit to %d or more (ulimit -Hn as root, LimitNOFILE= in a "
            "systemd unit, docker run --ulimit nofile=N:N): the node raises its own limit "
            "to the hard one at start",
            soft,
            ENOUGH,
        )
    return soft
