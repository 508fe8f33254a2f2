"""The SQLite driver: one file, one writer at a time (BEGIN IMMEDIATE), WAL journal."""

from orbit.store.sqlite.driver import SqliteDriver

__all__ = ["SqliteDriver"]
