"""Logging that cannot leak secrets: every record passes through ``RedactSecrets``.

Libraries under the server (uvicorn, websockets) log request headers and frames at debug
level; the filter rewrites bearer tokens, Orbit tokens, resume secrets and database
passwords wherever they appear, so no log level can print one.

Server and worker processes both configure logging here. It is not part of
``orbit.server``, whose import brings FastAPI and the whole HTTP stack (0.37 s): a
worker process importing it for this filter spent longer starting than draining a
thousand tasks.
"""

from __future__ import annotations

import logging
import re
import sys

_PATTERNS = [
    # websockets' debug line of a data frame (``< TEXT '{"type": …}' [88 bytes]``): the
    # payload goes whole. It is shortened in its middle, which can cut a secret's key off
    # and keep its value's tail, and a fragment (CONT) carries no key at all.
    (re.compile(r"^([<>] (?:TEXT|BINARY|CONT) ).*( \[[^\]]*\])$", re.DOTALL), r"\1[payload]\2"),
    (re.compile(r"(?i)(bearer\s+)[^\s'\",]+"), r"\1[redacted]"),
    (re.compile(r"orbit_([0-9a-f]{32})_[A-Za-z0-9_\-]+"), r"orbit_\1_[redacted]"),
    (
        re.compile(r"(?i)(\\?[\"']?(?:resume_)?secret\\?[\"']?\s*[:=]\s*\\?[\"']?)[^\"'\\\s,}]+"),
        r"\1[redacted]",
    ),
    # A database password, wherever libpq reads one: after the user name in a URL (which
    # may be empty), and as a ``password`` parameter of a URL's query or of a key=value
    # conninfo string, quoted or not. In a URL it runs to the LAST ``@`` before a space:
    # a password with an unencoded ``@`` (``user:p@ss@host``) kept its tail up to the
    # first one. Going too far (an ``@`` in the path) hides a host, never a password.
    (re.compile(r"(?i)(postgres(?:ql)?://[^:/@\s]*:)\S*@"), r"\1[redacted]@"),
    (
        re.compile(
            r"(?i)(\bpassword\s*=\s*)"
            r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&'\",]+)"
        ),
        r"\1[redacted]",
    ),
]


def redact(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_text is None:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def configure(level: str) -> None:
    """Send every logger to stderr through the redaction filter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handler.addFilter(RedactSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
