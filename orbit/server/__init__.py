"""The control plane: HTTP API, worker WebSocket gateway, auth and background duties."""

from orbit.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
