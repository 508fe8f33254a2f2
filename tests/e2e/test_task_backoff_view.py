"""A task's backoff reads back as it was submitted: DESIGN lists it among a task's fields,
and a submitted ``{"base": 7, "factor": 3, "max": 99}`` could be seen nowhere (only a
schedule's template showed its own)."""

from __future__ import annotations

import httpx

from tests.e2e.servers import Node, Tokens


def test_a_tasks_backoff_is_in_its_view(node: Node, tokens: Tokens) -> None:
    headers = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=10, headers=headers) as http:
        made = http.post("/v1/queues", json={"name": "q", "max_concurrency": 1, "rate": 0})
        assert made.status_code == 201, made.text
        backoff = {"base": 7.0, "factor": 3.0, "max": 99.5}
        sent = http.post("/v1/tasks", json={"queue": "q", "handler": "h", "backoff": backoff})
        assert sent.status_code == 201, sent.text
        task = sent.json()["task"]
        assert task["backoff"] == backoff
        assert http.get(f"/v1/tasks/{task['id']}").json()["backoff"] == backoff
        plain = http.post("/v1/tasks", json={"queue": "q", "handler": "h"}).json()["task"]
        assert plain["backoff"] == {"base": 1.0, "factor": 2.0, "max": 300.0}
        listed = http.get("/v1/tasks", params={"queue": "q"}).json()["items"]
        assert sorted(t["backoff"]["base"] for t in listed) == [1.0, 7.0]
        batch = http.post(
            "/v1/tasks/batch",
            json={"tasks": [{"queue": "q", "handler": "h", "backoff": {"base": 0.5}}]},
        )
        assert batch.status_code == 201, batch.text
        assert batch.json()[0]["task"]["backoff"] == {"base": 0.5, "factor": 2.0, "max": 300.0}
