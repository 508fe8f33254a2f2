"""End-to-end fixtures: a fresh database per test (a SQLite file, or a PostgreSQL
database created and dropped), tokens for each scope, and real server processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.servers import Node, Tokens, database, make_tokens, start_server


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database(str(request.param), tmp_path) as url:
        yield url


@pytest.fixture
def tokens(db_url: str) -> Tokens:
    return make_tokens(db_url)


@pytest.fixture
def nodes(db_url: str, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Factory: ``nodes(node_id="b", args=[...])`` starts another node on the same db."""
    started: list[Node] = []

    def factory(**kw: object) -> Node:
        node = start_server(db_url, tmp_path, **kw)  # type: ignore[arg-type]
        started.append(node)
        return node

    yield factory
    for node in started:
        node.stop()


@pytest.fixture
def node(nodes: Callable[..., Node]) -> Node:
    return nodes()


@pytest.fixture
def admin(node: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=node.http, timeout=30, headers={"Authorization": f"Bearer {tokens.admin}"}
    ) as client:
        yield client
