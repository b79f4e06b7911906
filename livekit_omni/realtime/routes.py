"""Routes of the Realtime dialect: the WebSocket at ``/v1/realtime``, ``/realtime`` and any path ending ``/realtime``;
WebRTC calls at ``POST /v1/realtime/calls`` (and ``.../calls/{call_id}/hangup``); ephemeral keys at ``POST /v1/realtime/client_secrets``.

LiveKit's ``RealtimeModel`` appends ``/realtime`` only to a few base paths and otherwise connects to the base path
itself, so any path whose last segment is ``realtime`` is served (``?model=`` and other query parameters allowed).
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route, WebSocketRoute

from livekit_omni.realtime.calls import hangup_call
from livekit_omni.realtime.client_secrets import create_client_secret
from livekit_omni.realtime.webrtc import create_call
from livekit_omni.realtime.websocket import realtime_websocket


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/realtime/calls", create_call, methods=["POST"]),
        Route("/realtime/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", hangup_call, methods=["POST"]),
        Route("/realtime/calls/{call_id}/hangup", hangup_call, methods=["POST"]),
        Route("/v1/realtime/client_secrets", create_client_secret, methods=["POST"]),
        Route("/realtime/client_secrets", create_client_secret, methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime_websocket),
        WebSocketRoute("/realtime", realtime_websocket),
        WebSocketRoute("/{prefix:path}/realtime", realtime_websocket),
    ]
