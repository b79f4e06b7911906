"""Routes of the Live facade: the WebSocket and the WebRTC offer/answer, under /v1 and at the bare path.

Both share a path (``/live/sessions``): Starlette dispatches the WebSocket upgrade to the WebSocket route and the
POST to the HTTP route. Query parameters (e.g. LiveKit Inference's ``?model=``) are ignored.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route, WebSocketRoute

from livekit_omni.live.webrtc import create_webrtc_session
from livekit_omni.live.websocket import live_websocket


def routes() -> list[BaseRoute]:
    out: list[BaseRoute] = []
    for path in ("/v1/live/sessions", "/live/sessions"):
        out.append(WebSocketRoute(path, live_websocket))
        out.append(Route(path, create_webrtc_session, methods=["POST"]))
    return out
