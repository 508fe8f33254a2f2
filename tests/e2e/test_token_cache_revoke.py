"""A node caches the answer of a token check (``orbit server --token-cache``), and a
revoke it has not heard of left a token it had cached good for that long. Two ways
that window is closed: the admin routes (creating and revoking tokens among them) read
the token from the database at every call, so a leaked admin token cannot mint another
that outlives its revoke; and on PostgreSQL a node whose LISTEN connection comes back
forgets every cached answer, since it may have missed the revoke's notice."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest

from orbit.store import open_store
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_revoke import LONG_TOKEN_CACHE, _revoke_unannounced

_WAIT = 30.0  # a safety net: every wait below ends on an event long before


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _revoke_behind_the_nodes_back(db_url: str, token_id: str) -> None:
    """A revoke no node hears of: on SQLite ``orbit token revoke --db`` (another process,
    which tells no server), on PostgreSQL the store's statement without its NOTIFY."""
    if db_url.startswith("sqlite"):
        cli = [sys.executable, "-m", "orbit.cli", "token", "revoke", "--db", db_url, token_id]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        _revoke_unannounced(db_url, token_id)


def test_a_leaked_admin_token_revoked_unheard_cannot_mint_or_revoke_tokens(
    nodes: Callable[..., Node], db_url: str, tokens: Tokens
) -> None:
    """Both backends. The node has the leaked admin token's answer cached (for far
    longer than the test) when the token is revoked behind its back. Creating a token
    with it, revoking another, creating a queue: each is refused 401 at once, and none
    of them changed anything. Before, the cached answer let it mint a new admin token,
    which the revoke did not cut off."""
    node = nodes(args=LONG_TOKEN_CACHE)
    store = open_store(db_url)
    try:
        leaked_id, leaked = store.token_create("leaked", ["admin"])
        ops_id, _ = store.token_create("ops", ["admin"])
        with httpx.Client(base_url=node.http, timeout=30, headers=_bearer(leaked)) as attacker:
            cached = attacker.get("/v1/queues")  # a submit-scope call: the node caches it
            assert cached.status_code == 200, cached.text
            _revoke_behind_the_nodes_back(db_url, leaked_id)

            minted = attacker.post("/v1/tokens", json={"name": "backdoor", "scopes": ["admin"]})
            assert minted.status_code == 401, minted.text
            assert minted.json()["error"]["code"] == "UNAUTHENTICATED"
            revoked = attacker.post(f"/v1/tokens/{ops_id}/revoke")
            assert revoked.status_code == 401, revoked.text
            queue = {"name": "q", "max_concurrency": 1, "rate": 0}
            assert attacker.post("/v1/queues", json=queue).status_code == 401

        names = {t.name: t for t in store.token_list()}
        assert sorted(names) == ["admin", "leaked", "ops", "submit", "worker"]
        assert names["ops"].revoked_at is None
        assert store.queue_list() == []
    finally:
        store.close()


def _listen_backends(cx: psycopg.Connection[Any]) -> set[int]:
    """The pids of the backends whose last statement was the node's last LISTEN: its
    LISTEN connection, once all of its channels are listened to."""
    rows = cx.execute(
        "SELECT pid FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = 'LISTEN orbit_events'"
    ).fetchall()
    return {int(pid) for (pid,) in rows}


def test_a_token_revoked_while_listen_was_away_is_refused_once_it_is_back(
    nodes: Callable[..., Node], db_url: str
) -> None:
    """PostgreSQL. A node that has a submit token's answer cached (for far longer than
    the test) loses its LISTEN connection (its backend terminated); the token is
    revoked meanwhile, and the revoke's notice never reaches the node. Once the node
    says its LISTEN connection is back, an HTTP call with the token is refused 401.
    Before, a reconnect re-checked only the tokens of open worker connections, and the
    node took the token from its cache until the cache ran out."""
    if db_url.startswith("sqlite"):
        pytest.skip("LISTEN is PostgreSQL's; SQLite has one node, told in-process")
    node = nodes(args=LONG_TOKEN_CACHE)
    store = open_store(db_url)
    try:
        leaked_id, leaked = store.token_create("leaked", ["submit"])
    finally:
        store.close()
    back = "LISTEN connection back"
    with (
        psycopg.connect(db_url, autocommit=True) as pg,
        httpx.Client(base_url=node.http, timeout=30, headers=_bearer(leaked)) as client,
    ):
        deadline = time.monotonic() + _WAIT
        while not (listening := _listen_backends(pg)):
            assert time.monotonic() < deadline, node.log_text()
            time.sleep(0.05)
        cached = client.get("/v1/queues")
        assert cached.status_code == 200, cached.text

        [pid] = listening
        assert pg.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        _revoke_unannounced(db_url, leaked_id)
        while back not in node.log_text():
            assert time.monotonic() < deadline, node.log_text()
            time.sleep(0.05)
        assert _listen_backends(pg) - {pid}, "a new LISTEN connection"

        refused = client.get("/v1/queues")
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "UNAUTHENTICATED"
