"""schema/ is generated from the code (scripts/gen_schema.py) and must match it; the server
serves the same documents. Pure: no database is opened (the app's lifespan never runs)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.routing import Route

import orbit.protocol.schema
import scripts.gen_schema
from orbit.protocol.messages import WORKER_REPLIES, WORKER_REQUESTS
from orbit.server.app import ServerSettings, create_app
from orbit.server.errors import ApiError
from scripts.gen_schema import OPENAPI_NAME, SCHEMA_DIR, generate, main, openapi, problems

FIX = "Run `python scripts/gen_schema.py` and commit the result."


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return create_app(ServerSettings(db_url="sqlite:///unused.db"))


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return generate()


@pytest.fixture(scope="module")
def docs() -> dict[str, Any]:
    return orbit.protocol.schema.schemas()


@pytest.fixture
def cached(
    monkeypatch: pytest.MonkeyPatch, generated: dict[str, str], docs: dict[str, Any]
) -> None:
    """Building every schema takes a noticeable fraction of a second; build it once."""
    monkeypatch.setattr(scripts.gen_schema, "generate", lambda: dict(generated))
    monkeypatch.setattr(orbit.protocol.schema, "schemas", lambda: dict(docs))


def test_committed_schema_matches_the_code() -> None:
    found = problems(SCHEMA_DIR)
    assert not found, "schema/ differs from the code:\n" + "\n".join(found) + "\n" + FIX


def test_every_message_has_a_schema(generated: dict[str, str]) -> None:
    names = set(generated)
    assert OPENAPI_NAME in names
    for kind in WORKER_REQUESTS:
        assert f"worker.request.{kind}.json" in names
    for kind in WORKER_REPLIES:
        assert f"worker.reply.{kind}.json" in names


def test_generation_is_deterministic(generated: dict[str, str]) -> None:
    assert generate() == generated
    for name, text in generated.items():
        assert text.endswith("}\n") and not text.endswith("\n\n"), name
        doc = json.loads(text)
        assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n", name


@pytest.mark.usefixtures("cached")
def test_check_flags_missing_drifted_and_stale_files(tmp_path: Path) -> None:
    out = tmp_path / "schema"
    assert main(["--check", "--output", str(out)]) == 1  # everything missing
    assert main(["--output", str(out)]) == 0
    assert main(["--check", "--output", str(out)]) == 0
    assert problems(out) == []

    (out / "worker.request.hello.json").write_text("{}\n", encoding="utf-8")
    (out / OPENAPI_NAME).unlink()
    (out / "worker.request.gone.json").write_text("{}\n", encoding="utf-8")
    found = problems(out)
    assert any(p.startswith("drifted:") and "worker.request.hello.json" in p for p in found)
    assert any(p.startswith("missing:") and OPENAPI_NAME in p for p in found)
    assert any(p.startswith("stale:") and "worker.request.gone.json" in p for p in found)
    assert len(found) == 3
    assert main(["--check", "--output", str(out)]) == 1

    assert main(["--output", str(out)]) == 0  # rewrites the drifted, removes the stale
    assert problems(out) == []
    assert not (out / "worker.request.gone.json").exists()


def _schema_endpoint(app: FastAPI) -> Callable[[str], Coroutine[Any, Any, Response]]:
    for route in app.routes:
        if isinstance(route, Route) and route.path == "/schema/{name}":
            assert "GET" in (route.methods or set())
            return cast(Callable[[str], Coroutine[Any, Any, Response]], route.endpoint)
    raise AssertionError("the app serves no GET /schema/{name}")


@pytest.mark.usefixtures("cached")
def test_server_serves_every_message_schema(app: FastAPI, docs: dict[str, Any]) -> None:
    endpoint = _schema_endpoint(app)

    async def fetch_all() -> dict[str, Any]:
        served: dict[str, Any] = {}
        for name in docs:
            response = await endpoint(name)
            assert response.status_code == 200, name
            served[name] = json.loads(bytes(response.body))
        return served

    served = asyncio.run(fetch_all())
    for name, doc in served.items():
        assert doc == docs[name], name
        committed = json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))
        assert doc == committed, f"GET /schema/{name} differs from schema/{name}. {FIX}"

    with pytest.raises(ApiError) as refused:
        asyncio.run(endpoint("no-such-schema.json"))
    assert refused.value.status == 404


def test_server_serves_the_openapi_document(app: FastAPI) -> None:
    assert app.openapi_url == "/openapi.json"
    paths = {r.path for r in app.routes if isinstance(r, Route)}
    assert "/openapi.json" in paths
    assert app.openapi() == openapi()
    committed = json.loads((SCHEMA_DIR / OPENAPI_NAME).read_text(encoding="utf-8"))
    assert app.openapi() == committed, f"/openapi.json differs from schema/openapi.json. {FIX}"
    # the token every /v1 route takes: /docs offers to authorize, or each call was a 401
    document = app.openapi()
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    assert document["security"] == [{"bearer": []}]


def test_openapi_covers_every_v1_route(app: FastAPI) -> None:
    documented = app.openapi()["paths"]
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path.startswith("/v1/"):
            assert route.path in documented, route.path
            for method in route.methods or ():
                assert method.lower() in documented[route.path], f"{method} {route.path}"


def test_every_json_route_documents_its_reply() -> None:
    """Each success reply in the OpenAPI document has a schema (a route without a
    ``response_model`` showed an empty one), and the one route that answers with bytes
    says so instead of claiming JSON."""
    document = openapi()
    empty = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, reply in operation["responses"].items():
                if not status.startswith("2"):
                    continue
                content = reply.get("content", {})
                if "application/json" in content and not content["application/json"].get("schema"):
                    empty.append(f"{method.upper()} {path} {status}")
                if not content and status != "204":
                    empty.append(f"{method.upper()} {path} {status}: no content")
    assert empty == []
    content = document["paths"]["/v1/artifacts/{artifact_id}/content"]["get"]["responses"]
    assert "application/json" not in content["200"]["content"]
