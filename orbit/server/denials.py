"""uvicorn's WebSocket protocol, quiet about an upgrade refused with an HTTP status, and
the WebSocket options every Orbit server gives uvicorn (``UVICORN_WS``).

``errors.refuse_upgrade`` answers a refused upgrade (a wrong token 401, a wrong scope
403, a node at its cap 503) through the denial response extension
(``websocket.http.response.start`` and ``.body``). uvicorn's websockets-sansio protocol
(its default, websockets being installed) sends that response in full, but never marks
the handshake as done, so when the app returns it logs ``ASGI callable returned without
completing handshake`` at ERROR: an operator saw an ERROR line for every routine 401 (its
wsproto protocol marks it; its "send a 500" that follows does nothing once a response
went). Here the last part of a denial response marks it done, so that ERROR is left for
an app that really returned without answering (a route that forgot to accept).
"""

from __future__ import annotations

from typing import Any, Final

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class QuietDenials(WebSocketsSansIOProtocol):
    """``WebSocketsSansIOProtocol`` that takes a denial response sent in full for the
    end of the handshake (``uvicorn.Config(ws=QuietDenials)``)."""

    async def send(self, message: Any) -> None:
        await super().send(message)
        if (
            message["type"] == "websocket.http.response.body"
            and not message.get("more_body", False)
            and self.close_sent
        ):
            self.handshake_complete = True


#: ``uvicorn.Config``'s WebSocket options for an Orbit server (``orbit server`` and ``orbit
#: dev``). permessage-deflate is never negotiated: uvicorn's default accepts it from any
#: client that offers it (the websockets library's and browsers' default; Orbit's worker
#: and client never do), and deflating a drain's frames then cost the server about eleven
#: times the instructions of its whole WebSocket layer without it (``benchmarks/wslayer.py``):
#: the frames are JSON on a LAN or loopback, where the bytes saved are worth less than that.
UVICORN_WS: Final[dict[str, Any]] = {"ws": QuietDenials, "ws_per_message_deflate": False}
