"""JSON Schemas of every message, generated from the models (committed under schema/)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from orbit.protocol import messages as m

HTTP_MODELS: tuple[type[BaseModel], ...] = (
    m.QueueCreate,
    m.QueueView,
    m.QueuePage,
    m.QueueUpdate,
    m.LimitSet,
    m.TenantLimitSet,
    m.TenantLimitView,
    m.TenantLimitPage,
    m.GlobalLimitView,
    m.ScheduleCreate,
    m.ScheduleUpdate,
    m.ScheduleView,
    m.SchedulePage,
    m.TaskSubmit,
    m.TaskBatch,
    m.TaskResolve,
    m.TaskView,
    m.Submitted,
    m.SubmittedId,
    m.TaskPage,
    m.AttemptView,
    m.AttemptPage,
    m.EventView,
    m.EventPage,
    m.WorkerView,
    m.WorkerPage,
    m.TokenCreate,
    m.TokenCreated,
    m.TokenView,
    m.TokenPage,
    m.ErrorReply,
    m.ArtifactView,
    m.ArtifactPage,
)


def schemas() -> dict[str, Any]:
    """``{file name: schema}`` for every HTTP body and worker message."""
    out: dict[str, Any] = {}
    for model in HTTP_MODELS:
        out[f"http.{model.__name__}.json"] = model.model_json_schema()
    for kind, model in sorted(m.WORKER_REQUESTS.items()):
        out[f"worker.request.{kind}.json"] = model.model_json_schema()
    for kind, reply in sorted(m.WORKER_REPLIES.items()):
        out[f"worker.reply.{kind}.json"] = reply.model_json_schema()
    return out


def render(schema: Any) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"
