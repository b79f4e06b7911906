"""The primary Live WebSocket (``/v1/live/sessions`` and ``/live/sessions``): auth, the start deadline, resume relay.

Auth is checked *after* the upgrade: a bad key gets an ``error`` event (``invalid_api_key``, which LiveKit treats as
final) and close 1008, because a refused handshake is something LiveKit retries (docs/protocol.md). The socket
itself (one bounded outbound queue, one writer task) is the session core's
:class:`~livekit_omni.sessions.websocket.WebSocketTransport`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from starlette.websockets import WebSocket

from livekit_omni import routing
from livekit_omni.auth import bearer_token, key_is_valid
from livekit_omni.drain import DRAINING_CODE, DRAINING_MESSAGE, Drain
from livekit_omni.live import wire
from livekit_omni.live.session import LiveSession
from livekit_omni.sessions.errors import WireError, invalid_api_key
from livekit_omni.sessions.hub import hub_of
from livekit_omni.sessions.state import SessionState
from livekit_omni.sessions.transport import CLOSE_POLICY, CLOSE_TRY_AGAIN
from livekit_omni.sessions.websocket import WebSocketTransport, oversize, payload

log = logging.getLogger(__name__)

#: A socket that never sends ``session.start`` is closed after this.
START_TIMEOUT_S: Final = 60.0
#: A client that closes with these (a close frame: it meant to leave) ends its session. A connection lost without
#: a close frame (1006: a network drop, a crashed client) or closed with another code detaches it for a resume.
DELIBERATE_CLOSE_CODES: Final = frozenset({1000, 1001})


async def _refuse_draining(session: LiveSession) -> None:
    """No new session on a draining server: an error, then 1013, which tells the client to try again (elsewhere)."""
    await session.refuse(
        WireError(DRAINING_CODE, DRAINING_MESSAGE, type=wire.SERVER_ERROR), close_code=CLOSE_TRY_AGAIN
    )


async def live_websocket(ws: WebSocket) -> None:
    await ws.accept()
    hub = hub_of(ws.app)
    transport = WebSocketTransport(ws, hub.settings.limits.outbound_queue_events)
    session = LiveSession(hub, transport)
    limit = hub.settings.limits.max_message_bytes
    client_close_code: int | None = None
    relayed = False
    try:
        # The transport cancels this task when the client stops reading; the cleanup below then runs as usual.
        with transport.reading():
            if not key_is_valid(hub.settings, bearer_token(ws.headers)):
                await session.refuse(invalid_api_key(), close_code=CLOSE_POLICY)
                return
            drain: Drain = ws.app.state.drain
            while not transport.closed:
                # Draining (SIGTERM), checked on arrival and again before a session.start is handled.
                if session.state is SessionState.NEW and not drain.admitting:
                    await _refuse_draining(session)
                    return
                if session.state is SessionState.NEW:
                    try:
                        msg = await asyncio.wait_for(ws.receive(), START_TIMEOUT_S)
                    except TimeoutError:
                        session.emit(
                            wire.error_event(
                                "session_start_timeout", f"no session.start within {START_TIMEOUT_S:g} s"
                            )
                        )
                        await transport.close(CLOSE_POLICY, "session_start_timeout")
                        return
                else:
                    msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    client_close_code = msg.get("code")
                    return
                data = payload(msg)
                if (refusal := oversize(data, limit)) is not None:
                    session.emit(wire.error_event("message_too_large", refusal))
                    continue
                if session.state is SessionState.NEW and not drain.admitting:
                    await _refuse_draining(session)
                    return
                owner = routing.resume_owner(data) if session.state is SessionState.NEW else None
                if owner is not None and await routing.relay_accepted_websocket(
                    ws.app, ws.scope, ws.receive, ws.send, owner, data
                ):
                    # Another worker holds the session (--workers): the connection was relayed there and is over.
                    session.advance(SessionState.CLOSED)
                    relayed = True
                    return
                await session.handle_text(data)
                if session.successor is not None:
                    # session.resume: this connection now belongs to the resumed session.
                    session = session.successor
    finally:
        if relayed:
            # The relay sent the owner's close; no session was opened here.
            await transport.close(1000)
        else:
            hub.losses["events_unread"] += transport.unread
            # Detached for a resume (resume_grace_s), or ended. A client that stopped reading is not kept: what its
            # full queue held is lost, so a resume could not give it the session's output exactly.
            deliberate = client_close_code in DELIBERATE_CLOSE_CODES
            await session.transport_lost(transport, may_detach=not transport.aborted and not deliberate)
            await transport.close(CLOSE_TRY_AGAIN if transport.aborted else 1000)
            await transport.wait_closed()
