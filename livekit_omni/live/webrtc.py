"""WebRTC signalling of the Live facade: ``POST /v1/live/sessions`` (and ``/live/sessions``).

Body ``{session: MediaSessionConfig, transport: {type: "webrtc", sdp: <offer>}}`` → ``{session: {id}, transport:
{type: "webrtc", sdp: <answer>}}``. Audio travels on the media track (Opus or G.711, handled by
:mod:`media.webrtc`); events travel on the client's data channel with the same semantics as the WebSocket, through
the same :class:`~livekit_omni.live.session.LiveSession`. There is no ``session.start`` there: the POST starts the
session, and ``session.started`` is the first event once the channel opens (the peer queues events until then).

Errors are JSON ``{error: {type, code, message}}``: 400 for a bad request, 401 for a bad key (the app's auth
middleware), 503 when the engine is full or unavailable.

The data-channel transport, the bounded body reader, the ICE-server list and the connect deadline are the session
core's (:mod:`livekit_omni.sessions.webrtc`), shared with the Realtime dialect's calls.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from livekit_omni.drain import DRAINING_CODE, DRAINING_MESSAGE, Drain
from livekit_omni.live import wire
from livekit_omni.live.session import LiveSession
from livekit_omni.sessions.errors import WireError
from livekit_omni.sessions.hub import TRY_AGAIN_CODES, SessionHub, hub_of
from livekit_omni.sessions.resume import TOKEN_INVALID, TRANSPORT_MISMATCH
from livekit_omni.sessions.state import SessionState
from livekit_omni.sessions.transport import CLOSE_TRY_AGAIN
from livekit_omni.sessions.webrtc import (
    BODY_SLACK_BYTES,
    DataChannelTransport,
    answer_with_settings,
    connect_deadline,
    read_body,
)
from media.webrtc import SdpError, WebRTCPeer

log = logging.getLogger(__name__)


class _Transport(msgspec.Struct, kw_only=True):
    type: str
    sdp: str


class _CreateBody(msgspec.Struct, kw_only=True):
    #: Required for a new session; with ``resume_token`` (an extension) the offer re-attaches to a session whose
    #: peer connection failed, and ``session`` is ignored.
    session: wire.StartConfig | None = None
    transport: _Transport
    resume_token: str | None = None


_body_decoder: Final = msgspec.json.Decoder(_CreateBody)


def _error(status: int, code: str, message: str, *, type: str = wire.INVALID_REQUEST) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "code": code, "message": message}}, status_code=status)


async def create_webrtc_session(request: Request) -> Response:
    hub = hub_of(request.app)
    settings = hub.settings
    drain: Drain = request.app.state.drain
    if not drain.admitting:
        hub.metrics.rejected_sessions.labels(reason=DRAINING_CODE).inc()
        return _error(503, DRAINING_CODE, DRAINING_MESSAGE, type=wire.SERVER_ERROR)
    max_sdp = settings.limits.max_sdp_bytes
    body = await read_body(request, max_sdp + BODY_SLACK_BYTES)
    if body is None:
        return _error(
            400, "request_too_large", f"the request body is limited to {max_sdp + BODY_SLACK_BYTES} bytes"
        )
    try:
        req = _body_decoder.decode(body)
    except msgspec.ValidationError as e:
        return _error(400, "invalid_value", f"invalid request: {e}")
    except (
        msgspec.DecodeError,
        UnicodeDecodeError,
        RecursionError,
    ):  # msgspec raises the last two for non-UTF-8
        return _error(
            400, "invalid_json", "the body is not valid JSON"
        )  # text and for nesting past the limit
    if req.transport.type != "webrtc":
        return _error(400, "invalid_value", "transport.type must be webrtc")
    if len(req.transport.sdp.encode()) > max_sdp:
        return _error(400, "sdp_too_large", f"the SDP offer is limited to {max_sdp} bytes")
    if req.resume_token is not None:
        return await _resume_webrtc_session(hub, req.resume_token, req.transport.sdp)
    if req.session is None:
        return _error(400, "missing_required_parameter", "session is required (or resume_token)")
    if req.session.audio is not None and req.session.audio.format is not None:
        return _error(400, "unsupported_parameter", "session.audio.format is negotiated by WebRTC; omit it")
    try:
        cfg = wire.resolve_config(req.session, with_format=False)
    except WireError as e:
        hub.metrics.rejected_sessions.labels(reason=e.code).inc()
        return _error(400, e.code, e.message)

    transport = DataChannelTransport()
    live = LiveSession(hub, transport, accepts_start=False)
    if cfg.client is not None:
        dc = cfg.client.data_channel
        if isinstance(dc.allowed_client_events, list):
            live.allowed_client_events = frozenset(dc.allowed_client_events)
        if isinstance(dc.allowed_server_events, list):
            live.allowed_server_events = frozenset(x.type for x in dc.allowed_server_events)
    if not drain.admitting:  # the drain began while the body was read
        hub.metrics.rejected_sessions.labels(reason=DRAINING_CODE).inc()
        return _error(503, DRAINING_CODE, DRAINING_MESSAGE, type=wire.SERVER_ERROR)
    try:
        await live.open_or_raise(cfg)
    except WireError as e:
        await live.end(code=CLOSE_TRY_AGAIN, reason=e.code, notify=False)
        status = 503 if e.code in TRY_AGAIN_CODES else 500
        hub.metrics.errors.labels(code=e.code).inc()
        return _error(status, e.code, e.message, type=e.type)
    assert live.bridge is not None

    try:
        peer = await _answer(live, transport, req.transport.sdp)
    except SdpError as e:
        await live.transport_closed()
        return _error(400, "invalid_sdp", str(e))
    except Exception as e:
        log.exception("webrtc: answering the offer failed")
        await live.transport_closed()
        return _error(500, "internal_error", f"could not answer the offer: {e}", type=wire.SERVER_ERROR)
    _use_peer(live, transport, peer)
    # Queued by the peer until the client's data channel opens, then sent first.
    live.announce()
    live.spawn(
        connect_deadline(
            peer,
            settings.limits.webrtc_connect_timeout_s,
            live.id,
            # Only while this peer is still the session's: one that connected, failed and was replaced by a
            # resume (or is detached) must not end the session when its deadline comes.
            lambda: live.transport_lost(transport, may_detach=False),
        )
    )
    log.info("webrtc session %s: codec %s", live.id, peer.codec)
    return JSONResponse({"session": {"id": live.id}, "transport": {"type": "webrtc", "sdp": peer.answer_sdp}})


async def _answer(live: LiveSession, transport: DataChannelTransport, sdp: str) -> WebRTCPeer:
    """Answer ``sdp`` for ``live``'s engine session, with ``transport`` as the peer's way to the session."""
    hub, settings = live.hub, live.settings
    assert live.bridge is not None

    async def on_state(state: str) -> None:
        # An ICE failure or consent loss ("failed") detaches the session for a resume (resume_grace_s); a peer
        # connection the client closed ("closed") ends it.
        if state == "failed":
            await live.transport_lost(transport)
        elif state == "closed":
            await live.transport_lost(transport, may_detach=False)

    def on_input_frame(frame: Any) -> None:
        hub.metrics.audio_in_seconds.inc(frame.samples / frame.sample_rate)
        live.count_ingress_drops()

    def on_datachannel_error(code: str, message: str) -> None:
        live.emit(wire.error_event(code, message))

    def on_stalled() -> None:
        live.spawn(live.end(code=CLOSE_TRY_AGAIN, notify=False))

    transport.on_stalled = on_stalled
    return await answer_with_settings(
        settings,
        sdp,
        live.bridge,
        on_datachannel_message=live.handle_text,
        on_connection_state=on_state,
        on_output_frame=live.on_output_frame,
        on_input_frame=on_input_frame,
        on_datachannel_error=on_datachannel_error,
    )


def _use_peer(live: LiveSession, transport: DataChannelTransport, peer: WebRTCPeer) -> None:
    transport.peer = peer
    if peer.player is not None:
        overlay = live.attach_player(peer.player)
        if peer.track is not None:
            # The track pulls frames from the overlay, so fixtures play over WebRTC too.
            peer.track.player = overlay  # type: ignore[assignment]


async def _resume_webrtc_session(hub: SessionHub, token: str, sdp: str) -> Response:
    """A new offer with a resume token: a new peer for the token's detached session (docs/protocol.md, Resume).
    The token is spent only once the offer is answered, so a bad offer leaves it usable."""
    peeked = hub.resume_tokens.peek(token)
    live = peeked if isinstance(peeked, LiveSession) else None
    if live is not None and live.transport.kind != DataChannelTransport.kind:
        return _error(400, TRANSPORT_MISMATCH, "this token resumes a WebSocket session; resume it there")
    if live is None or live.bridge is None:
        try:
            hub.resume_tokens.take(token)  # raises the typed refusal (used, or invalid)
        except WireError as e:
            hub.metrics.resume_refused.labels(code=e.code).inc()
            return _error(400, e.code, e.message)
        return _error(400, TOKEN_INVALID, "no session to resume with this token")
    transport = DataChannelTransport()
    try:
        peer = await _answer(live, transport, sdp)
    except SdpError as e:
        return _error(400, "invalid_sdp", str(e))
    except Exception as e:
        log.exception("webrtc: answering the resume offer failed")
        return _error(500, "internal_error", f"could not answer the offer: {e}", type=wire.SERVER_ERROR)
    try:
        if hub.resume_tokens.take(token) is not live or live.state is not SessionState.ACTIVE:
            raise WireError(TOKEN_INVALID, "the session has ended", param="resume_token")
    except WireError as e:  # another offer took it, or the session ended, while this one was answered
        await peer.close()
        hub.metrics.resume_refused.labels(code=e.code).inc()
        return _error(400, e.code, e.message)
    _use_peer(live, transport, peer)
    # session.started (same id, a fresh token) and the kept events: queued until the new data channel opens.
    await live.attach(transport)
    settings = hub.settings
    live.spawn(
        connect_deadline(
            peer,
            settings.limits.webrtc_connect_timeout_s,
            live.id,
            lambda: live.transport_lost(
                transport
            ),  # never connected: detached again, for the rest of a grace
        )
    )
    log.info("webrtc session %s: resumed, codec %s", live.id, peer.codec)
    return JSONResponse({"session": {"id": live.id}, "transport": {"type": "webrtc", "sdp": peer.answer_sdp}})
