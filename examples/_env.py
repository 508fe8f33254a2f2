"""Where the examples find the server: ORBIT_URL and ORBIT_TOKEN / ORBIT_TOKEN_FILE."""

from __future__ import annotations

import os

from orbit.tokens import load_token


def server() -> tuple[str, str]:
    return os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"), load_token()
