"""The Realtime WebSocket (``/v1/realtime`` and any path ending ``/realtime``): auth, subprotocols, framing.

Auth is checked after the upgrade, as on the Live socket: a bad key gets an ``error`` event (``invalid_api_key``,
which LiveKit and the SDK treat as final) and close 1008. The key comes from ``Authorization: Bearer`` or, for
browsers (which cannot set headers on a WebSocket), from the subprotocol ``openai-insecure-api-key.<key>``; when
the client offers the ``realtime`` subprotocol the server selects it, or a browser fails the handshake.
``?model=`` (every client sends it) names the session's model; ``?call_id=`` makes the socket a sideband to that
WebRTC call (:mod:`livekit_omni.realtime.calls`); other query parameters are ignored.

The outbound queue, writer task and close handling are the session core's :class:`WebSocketTransport`.
"""

from __future__ import annotations

from typing import Final

from starlette.websockets import WebSocket

from livekit_omni.auth import bearer_token, key_is_valid
from livekit_omni.realtime.calls import run_sideband
from livekit_omni.realtime.session import RealtimeSession
from livekit_omni.sessions.errors import invalid_api_key
from livekit_omni.sessions.hub import hub_of
from livekit_omni.sessions.transport import CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_AGAIN
from livekit_omni.sessions.websocket import WebSocketTransport, receive_messages

SUBPROTOCOL: Final = "realtime"
KEY_SUBPROTOCOL_PREFIX: Final = "openai-insecure-api-key."


def _offered_subprotocols(ws: WebSocket) -> list[str]:
    raw = ws.headers.get("sec-websocket-protocol", "")
    return [s.strip() for s in raw.split(",") if s.strip()]


def _api_key(ws: WebSocket, offered: list[str]) -> str:
    token = bearer_token(ws.headers)
    if token:
        return token
    for proto in offered:
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return proto[len(KEY_SUBPROTOCOL_PREFIX) :]
    return ""


async def realtime_websocket(ws: WebSocket) -> None:
    offered = _offered_subprotocols(ws)
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    hub = hub_of(ws.app)
    transport = WebSocketTransport(ws, hub.settings.limits.outbound_queue_events)
    session = RealtimeSession(hub, transport, model=ws.query_params.get("model") or None)
    limit = hub.settings.limits.max_message_bytes
    sideband = False
    try:
        if not key_is_valid(hub.settings, _api_key(ws, offered)):
            await session.refuse(invalid_api_key(), close_code=CLOSE_POLICY)
            return
        call_id = ws.query_params.get("call_id")
        if call_id is not None:
            # A sideband to a WebRTC call: it joins that call's session instead of opening one of its own.
            sideband = True
            await run_sideband(ws, transport, call_id)
            return
        session.start()
        await receive_messages(
            ws,
            transport,
            session.handle_text,
            limit=limit,
            on_too_large=lambda m: session.error("message_too_large", m),
        )
    finally:
        hub.losses["events_unread"] += transport.unread
        if not sideband:
            await session.end(code=CLOSE_TRY_AGAIN if transport.aborted else CLOSE_NORMAL)
            await transport.wait_closed()
