"""The SQLite driver: one file, one writer at a time (BEGIN IMMEDIATE), WAL journal."""

from orbit.store.sqlite.driver import (
    DatabaseInUse,
    DatabaseLinked,
    DatabaseMounted,
    DatabaseNotAFile,
    DatabaseNotOrbit,
    DatabaseNotWal,
    DatabaseReadOnly,
    SqliteDriver,
    hold_for_server,
)

__all__ = [
    "DatabaseInUse",
    "DatabaseLinked",
    "DatabaseMounted",
    "DatabaseNotAFile",
    "DatabaseNotOrbit",
    "DatabaseNotWal",
    "DatabaseReadOnly",
    "SqliteDriver",
    "hold_for_server",
]
