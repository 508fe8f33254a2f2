"""A small web app that submits jobs to Orbit and reports on them (stdlib http.server).

POST /thumbnails  {"url": "https://…"}   -> 202 {"id": …}   (idempotent per URL)
GET  /thumbnails/<id>                    -> {"state": …, "result": …}

An unknown (or empty) id is 404; Orbit out of reach is 503, so a caller can try again.
"""

from __future__ import annotations

import hashlib
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orbit import Client
from orbit.client import ApiError, Unreachable
from orbit.tokens import load_token


def make_server(port: int, orbit_url: str, token: str) -> ThreadingHTTPServer:
    client = Client(orbit_url, token)
    if "thumbnails" not in {q["name"] for q in client.queues()}:
        client.queue_create("thumbnails", max_concurrency=8, rate=50)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            if self.path != "/thumbnails":
                return self._reply(404, {"error": "not found"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                url = str(body["url"])
            except (ValueError, KeyError, TypeError):
                return self._reply(400, {"error": 'send {"url": "https://…"}'})
            key = hashlib.sha256(url.encode()).hexdigest()  # the same URL → the same job
            try:
                task = client.submit(
                    "thumbnails",
                    "thumbnail.make",
                    {"url": url},
                    idempotency_key=key,
                    retry_safe=True,
                    attempt_timeout=30,
                )
            except ApiError as exc:
                return self._reply(exc.status, {"error": exc.code})
            except Unreachable:  # safe to send again: the key makes it one job
                return self._reply(503, {"error": "orbit unreachable, try again"})
            return self._reply(202, {"id": task["id"], "state": task["state"]})

        def do_GET(self) -> None:
            prefix = "/thumbnails/"
            task_id = self.path[len(prefix) :]
            if not self.path.startswith(prefix) or not task_id:  # the client refuses ""
                return self._reply(404, {"error": "not found"})
            try:
                task = client.get(task_id)
            except ApiError as exc:
                return self._reply(exc.status, {"error": exc.code})
            except Unreachable:
                return self._reply(503, {"error": "orbit unreachable, try again"})
            return self._reply(
                200,
                {
                    "id": task["id"],
                    "state": task["state"],
                    "result": task["result"],
                    "error": task["error"],
                },
            )

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


if __name__ == "__main__":
    server = make_server(8080, os.environ.get("ORBIT_URL", "http://127.0.0.1:8000"), load_token())
    print("thumbnails app on http://127.0.0.1:8080")
    server.serve_forever()
