"""What a server does with a Realtime WebRTC call after it is answered: ``POST /v1/realtime/calls/{call_id}/hangup``
ends it, and a WebSocket on ``/v1/realtime?call_id=<call_id>`` is a *sideband* to it (the openai SDK's
``client.realtime.connect(call_id=...)``: an app's backend watches the call's events and steers it with the same
client events, tools and instructions included, while the browser holds the media).

A call's events go out on its ``oai-events`` data channel and, as the same JSON, on every sideband attached to it
(:class:`CallTransport`); events from a sideband are handled exactly like those from the data channel. A SIP call
(:mod:`livekit_omni.sip`) is a call here too: its transport has sidebands and no data channel (:class:`CallLike`). A sideband
that closes leaves the call running; a call that ends closes its sidebands with the call's close code. The call id
is the session id in the answer's ``Location`` header, and the sideband needs an API key like any other socket.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from livekit_omni.realtime import wire
from livekit_omni.realtime.session import RealtimeSession
from livekit_omni.sessions.errors import error_response
from livekit_omni.sessions.hub import SessionHub, hub_of
from livekit_omni.sessions.transport import CLOSE_NORMAL, CLOSE_TRY_AGAIN
from livekit_omni.sessions.webrtc import DataChannelTransport
from livekit_omni.sessions.websocket import WebSocketTransport, receive_messages

log = logging.getLogger(__name__)


@runtime_checkable
class CallLike(Protocol):
    """The transport of a call that sidebands may attach to: a WebRTC call's :class:`CallTransport`, a SIP call's
    ``SipCallTransport``."""

    sidebands: set[WebSocketTransport]


class CallTransport:
    """A call's events: its data channel first, then each attached sideband (one encoded event to all)."""

    kind = "webrtc"
    carries_audio = False

    def __init__(self, channel: DataChannelTransport) -> None:
        self.channel = channel
        self.sidebands: set[WebSocketTransport] = set()

    @property
    def closed(self) -> bool:
        return self.channel.closed

    def send(self, data: bytes) -> None:
        self.channel.send(data)
        for sb in list(self.sidebands):
            if sb.closed:
                self.sidebands.discard(sb)
            else:
                sb.send(data)

    async def put(self, data: bytes) -> None:
        await self.channel.put(data)
        for sb in list(self.sidebands):
            if not sb.closed:
                sb.send(data)

    async def close(self, code: int, reason: str = "") -> None:
        for sb in list(self.sidebands):
            await sb.close(code, reason)
        self.sidebands.clear()
        await self.channel.close(code, reason)


def find_call(hub: SessionHub, call_id: str) -> RealtimeSession | None:
    """The open Realtime call ``call_id`` (WebRTC or SIP), if this server holds it."""
    for s in hub.sessions:
        if s.id == call_id and isinstance(s, RealtimeSession) and isinstance(s.transport, CallLike):
            return s
    return None


async def hangup_call(request: Request) -> Response:
    """``POST /v1/realtime/calls/{call_id}/hangup`` (behind the app's API-key check): end the call now, as the
    browser closing its peer connection would. 404 for a call this server does not hold (or no longer)."""
    call = find_call(hub_of(request.app), request.path_params["call_id"])
    if call is None:
        return error_response(404, "call_not_found", "no open call with that id on this server")
    log.info("realtime call %s: hung up by the API", call.id)
    call.spawn(call.end(code=CLOSE_NORMAL, reason="hangup"))
    return Response(status_code=200)


async def run_sideband(ws: WebSocket, transport: WebSocketTransport, call_id: str) -> None:
    """Serve a sideband socket (already accepted and authenticated) until it or the call closes."""
    hub = hub_of(ws.app)
    call = find_call(hub, call_id)
    if call is None:
        transport.send(
            wire.encode(wire.error_event("call_not_found", f"no open call {call_id!r} on this server"))
        )
        await transport.close(CLOSE_TRY_AGAIN, "call_not_found")
        return
    assert isinstance(call.transport, CallLike)
    call.transport.sidebands.add(transport)
    log.info("realtime call %s: sideband attached (%d)", call.id, len(call.transport.sidebands))

    def too_large(message: str) -> None:
        transport.send(wire.encode(wire.error_event("message_too_large", message)))

    try:
        await receive_messages(
            ws,
            transport,
            call.handle_text,
            limit=hub.settings.limits.max_message_bytes,
            on_too_large=too_large,
        )
    finally:
        if isinstance(call.transport, CallLike):
            call.transport.sidebands.discard(transport)
        await transport.close(CLOSE_TRY_AGAIN if transport.aborted else CLOSE_NORMAL)
        await transport.wait_closed()
