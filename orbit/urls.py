"""The one check of a server URL, for the SDK clients and for ``orbit worker``.

Not in ``orbit.client``, whose import brings httpx: a worker process imports neither the
HTTP client nor the server (``tests/unit/test_public_api.py``).
"""

from __future__ import annotations

import ssl
from urllib.parse import SplitResult, urlsplit


def check_server_url(url: str) -> SplitResult:
    """``url`` taken apart, if it can name an Orbit server; else ValueError, whose message
    never repeats the URL (it may hold a password). Credentials in it are refused rather
    than sent: httpx and websockets turn them into a Basic ``Authorization`` header that
    replaces the bearer token, so the password travelled and the token did not."""
    usage = "the server URL must be http://host[:port] or https://host[:port]"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - read for its ValueError: a port that is no number, or too big
    except ValueError:
        raise ValueError(usage) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(usage)
    if parts.query or parts.fragment:
        raise ValueError("the server URL must not hold a query or a fragment")
    if parts.username is not None or parts.password is not None:
        raise ValueError("the server URL must not hold credentials: pass token= instead")
    return parts


def check_cafile(cafile: str | None) -> None:
    """ValueError, naming the file, if ``cafile`` cannot be loaded as the CAs to trust:
    a worker given a missing or non-PEM file connected and failed, and retried for ever
    saying only ``FileNotFoundError`` or ``SSLError``."""
    if cafile is None:
        return
    try:
        ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(
            f"cafile {cafile}: cannot load CA certificates from it ({reason})"
        ) from None
