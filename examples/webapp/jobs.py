"""The worker of the web app: makes "thumbnails" (a stand-in for real image work).

Run it with ``orbit worker examples.webapp.jobs:worker``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from orbit import Context, Fail, Worker

worker = Worker(
    os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"), name="thumbnails", concurrency=4
)


@worker.handler("thumbnail.make", capacity=4)
async def make_thumbnail(ctx: Context, payload: Any) -> Any:
    url = payload.get("url", "")
    if not url.startswith(("http://", "https://")):
        raise Fail(f"not an http(s) URL: {url!r}", code="BAD_URL")
    await asyncio.sleep(0.05)  # the "rendering"
    digest = hashlib.sha256(url.encode()).hexdigest()
    return {"url": url, "width": 320, "height": 200, "sha256": digest}
