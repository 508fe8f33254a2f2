"""History queries: tasks page by page (keyset cursors), a task's attempts and events."""

from __future__ import annotations

from typing import Any

from examples._env import server
from orbit import Client


def main(url: str, token: str) -> dict[str, Any]:
    with Client(url, token) as client:
        if "examples" not in {q["name"] for q in client.queues()}:
            client.queue_create("examples", max_concurrency=4, rate=0)
        batch = [{"queue": "examples", "handler": "example.noop", "payload": i} for i in range(5)]
        made = client.submit_many(batch)
        first_page = client.list_tasks(queue="examples", limit=2)
        everything = list(client.iter_tasks(queue="examples", limit=2))  # follows cursors
        for task in made:  # no worker handles example.noop: none is left queued for good
            client.cancel(task["id"])
        some = everything[0]["id"]
        story = [(e["kind"], e["task_to"]) for e in client.events(some)["items"]]
        return {
            "first_page": len(first_page["items"]),
            "total": len(everything),
            "history": story,
            "attempts": client.attempts(some),
        }


if __name__ == "__main__":
    print(main(*server()))
