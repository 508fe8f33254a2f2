"""Where SDKs and workers find their token: ``ORBIT_TOKEN`` or ``ORBIT_TOKEN_FILE``.

A token file must not be open to group or others (like an SSH key); an empty or
missing token, or one holding a character no HTTP header can carry, is refused with a
message that says exactly which source was wrong. The token itself never appears in a
message.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

#: How long a node remembers a token check, in seconds, unless ``orbit server
#: --token-cache`` says otherwise: a token revoked in the database is still accepted by
#: a node for at most this long (docs/operations.md, Tokens). Here, not beside the check
#: in orbit.server.auth, so that the CLI can name it without importing the server.
CACHE_SECONDS = 10.0


class TokenError(ValueError):
    """No usable token; the message names the variable or file at fault. A ValueError,
    as the clients' other setup mistakes (the URL, the timeout, the CA file) are, so one
    ``except ValueError`` catches each of them."""


def token_fault(token: str) -> str | None:
    """Why ``token`` cannot be sent as a bearer token, or None. Only visible ASCII can:
    a line break, space, control or non-ASCII character inside one (a token file of two
    lines, a pasted sentence) made http.client raise ``ValueError("Invalid header value
    b'Bearer <the token>'")``, the token in the message. The answer never quotes it."""
    if not token:
        return "is empty"
    if not all("!" <= c <= "~" for c in token):
        return (
            "holds a space, a line break, a control or a non-ASCII character, which no "
            "token has (is it one line, the token alone?)"
        )
    return None


def token_id(token: str) -> str | None:
    """The id part of a token ``orbit_<id>_<secret>`` (not secret: ``orbit token ls``
    shows it), or None for a string of another shape, which no server accepts. An id is
    1 to 64 ASCII letters and digits, as ``orbit token revoke`` takes one (a server makes
    32 hex digits): a node's token cache kept the "id" of every bogus token it was sent,
    so a client with no token could fill it with 10,000 of a megabyte each."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != "orbit":
        return None
    found = parts[1]
    if not (0 < len(found) <= 64 and found.isascii() and found.isalnum()):
        return None
    return found


def load_token(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    direct = env.get("ORBIT_TOKEN")
    path = env.get("ORBIT_TOKEN_FILE")
    if direct is not None:
        if not direct.strip():
            raise TokenError("ORBIT_TOKEN is set but empty")
        fault = token_fault(direct.strip())
        if fault is not None:
            raise TokenError(f"ORBIT_TOKEN {fault}")
        return direct.strip()
    if path is None:
        raise TokenError("no token: set ORBIT_TOKEN or ORBIT_TOKEN_FILE")
    if not path.strip():
        raise TokenError("ORBIT_TOKEN_FILE is set but empty")
    file = Path(path)
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise TokenError(f"ORBIT_TOKEN_FILE {file} does not exist") from None
    except PermissionError:
        raise TokenError(f"ORBIT_TOKEN_FILE {file} cannot be read") from None
    except OSError as exc:
        # A path through a file (ENOTDIR), a symlink loop, a name too long: the raw error
        # was a traceback from the CLI, and a worker retried it for ever as a network
        # failure.
        reason = exc.strerror or type(exc).__name__
        raise TokenError(f"ORBIT_TOKEN_FILE {file} cannot be read: {reason}") from None
    if not stat.S_ISREG(mode):
        raise TokenError(f"ORBIT_TOKEN_FILE {file} is not a regular file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"ORBIT_TOKEN_FILE {file} is open to group or others "
            f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {file}"
        )
    try:
        token = file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"ORBIT_TOKEN_FILE {file} cannot be read: {type(exc).__name__}") from None
    if not token:
        raise TokenError(f"ORBIT_TOKEN_FILE {file} is empty")
    fault = token_fault(token)
    if fault is not None:
        raise TokenError(f"ORBIT_TOKEN_FILE {file} {fault}")
    return token
