"""The ``orbit`` command."""

try:
    from orbit.cli.main import app, main
except KeyboardInterrupt:  # Ctrl-C while the command loads: exit 130 as later, no traceback
    raise SystemExit(130) from None

__all__ = ["app", "main"]
