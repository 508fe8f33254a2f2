"""A node that migrates the schema at start says so in its log, naming the versions and
the files applied; a node on a current schema says nothing of it."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.servers import start_server
from tests.store.test_migrate_report import older


def test_a_node_logs_the_migrations_it_applied_at_start(db_url: str, tmp_path: Path) -> None:
    """A node started on a database an older Orbit left migrated it and logged nothing:
    which migrations ran, and when, was found only in ``orbit_schema_version``."""
    version, due = older(db_url, tmp_path, before="_artifact_order.sql")
    latest = version + len(due)
    first = start_server(db_url, tmp_path, node_id="upgraded")
    first.stop()
    said = f"INFO orbit.store migrated the schema from version {version} to {latest}: "
    assert said + ", ".join(due) in first.log_text(), first.log_text()
    again = start_server(db_url, tmp_path, node_id="current")
    again.stop()
    assert "migrated the schema" not in again.log_text(), again.log_text()
