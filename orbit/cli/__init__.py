"""The ``orbit`` command."""

from orbit.cli.main import app, main

__all__ = ["app", "main"]
