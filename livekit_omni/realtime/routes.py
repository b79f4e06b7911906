"""Routes of the Realtime dialect: the WebSocket at ``/v1/realtime``, ``/realtime`` and any path ending ``/realtime``.

LiveKit's ``RealtimeModel`` appends ``/realtime`` only to a few base paths and otherwise connects to the base path
itself, so any path whose last segment is ``realtime`` is served (``?model=`` and other query parameters allowed).
"""

from __future__ import annotations

from starlette.routing import BaseRoute, WebSocketRoute

from livekit_omni.realtime.websocket import realtime_websocket


def routes() -> list[BaseRoute]:
    return [
        WebSocketRoute("/v1/realtime", realtime_websocket),
        WebSocketRoute("/realtime", realtime_websocket),
        WebSocketRoute("/{prefix:path}/realtime", realtime_websocket),
    ]
