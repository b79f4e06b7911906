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
from typing import Final

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from livekit_omni.live import wire
from livekit_omni.live.session import LiveSession
from livekit_omni.sessions import webrtc as signalling
from livekit_omni.sessions.errors import INVALID_REQUEST, WireError
from livekit_omni.sessions.hub import TRY_AGAIN_CODES, SessionHub
from livekit_omni.sessions.resume import TOKEN_INVALID, TRANSPORT_MISMATCH
from livekit_omni.sessions.state import SessionState
from livekit_omni.sessions.transport import CLOSE_TRY_AGAIN
from media.webrtc import WebRTCPeer

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


async def create_webrtc_session(request: Request) -> Response:
    return await signalling.answer_offer_request(request, _create)


async def _create(request: Request, hub: SessionHub) -> Response:
    body = await signalling.read_offer(request, hub)
    try:
        req = _body_decoder.decode(body)
    except msgspec.ValidationError as e:
        raise signalling.OfferRefused(400, "invalid_value", f"invalid request: {e}") from e
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        # msgspec raises the last two for non-UTF-8 text and for nesting past the limit
        raise signalling.OfferRefused(400, "invalid_json", "the body is not valid JSON") from e
    if req.transport.type != "webrtc":
        raise signalling.OfferRefused(400, "invalid_value", "transport.type must be webrtc")
    signalling.check_sdp_size(req.transport.sdp, hub)
    if req.resume_token is not None:
        return await _resume_webrtc_session(hub, req.resume_token, req.transport.sdp)
    if req.session is None:
        raise signalling.OfferRefused(
            400, "missing_required_parameter", "session is required (or resume_token)"
        )
    if req.session.audio is not None and req.session.audio.format is not None:
        raise signalling.OfferRefused(
            400, "unsupported_parameter", "session.audio.format is negotiated by WebRTC; omit it"
        )
    try:
        cfg = wire.resolve_config(req.session, with_format=False)
    except WireError as e:
        hub.metrics.rejected_sessions.labels(reason=e.code).inc()
        raise signalling.OfferRefused(400, e.code, e.message) from e

    transport = signalling.DataChannelTransport()
    live = LiveSession(hub, transport, accepts_start=False)
    if cfg.client is not None:
        dc = cfg.client.data_channel
        if isinstance(dc.allowed_client_events, list):
            live.allowed_client_events = frozenset(dc.allowed_client_events)
        if isinstance(dc.allowed_server_events, list):
            live.allowed_server_events = frozenset(x.type for x in dc.allowed_server_events)
            nested = [x.response_event for x in dc.allowed_server_events if x.type == "response.event"]
            if nested and None not in nested:
                # Selectors of response.event name the nested Responses events the channel carries.
                live.allowed_response_events = frozenset(e for e in nested if e is not None)
    signalling.refuse_if_draining(hub)  # the drain began while the body was read
    try:
        await live.open_or_raise(cfg)
    except WireError as e:
        await live.end(code=CLOSE_TRY_AGAIN, reason=e.code, notify=False)
        hub.metrics.errors.labels(code=e.code).inc()
        status = 503 if e.code in TRY_AGAIN_CODES else 400 if e.type == INVALID_REQUEST else 500
        raise signalling.OfferRefused(status, e.code, e.message, type=e.type) from e
    peer = await _answer(live, transport, req.transport.sdp, new_session=True)
    _use_peer(live, transport, peer)
    # Queued by the peer until the client's data channel opens, then sent first.
    live.announce()
    # Only while this peer is still the session's: one that connected, failed and was replaced by a resume (or is
    # detached) must not end the session when its deadline comes.
    signalling.watch_connect(live, peer, lambda: live.transport_lost(transport, may_detach=False))
    log.info("webrtc session %s: codec %s", live.id, peer.codec)
    return JSONResponse({"session": {"id": live.id}, "transport": {"type": "webrtc", "sdp": peer.answer_sdp}})


async def _answer(
    live: LiveSession, transport: signalling.DataChannelTransport, sdp: str, *, new_session: bool
) -> WebRTCPeer:
    """Answer ``sdp`` for ``live``'s engine session, with ``transport`` as the peer's way to the session. A refused
    offer ends a new session; a resumed one stays detached (its token still good)."""

    async def on_state(state: str) -> None:
        # An ICE failure or consent loss ("failed") detaches the session for a resume (resume_grace_s); a peer
        # connection the client closed ("closed") ends it.
        if state == "failed":
            await live.transport_lost(transport)
        elif state == "closed":
            await live.transport_lost(transport, may_detach=False)

    def on_stalled() -> None:
        live.spawn(live.end(code=CLOSE_TRY_AGAIN, notify=False))

    transport.on_stalled = on_stalled
    return await signalling.answer_call(
        live,
        sdp,
        on_connection_state=on_state,
        on_output_frame=live.on_output_frame,
        on_input_frame=live.count_ingress_drops,
        end_on_failure=new_session,
    )


def _use_peer(live: LiveSession, transport: signalling.DataChannelTransport, peer: WebRTCPeer) -> None:
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
    if live is not None and live.transport.kind != signalling.DataChannelTransport.kind:
        raise signalling.OfferRefused(
            400, TRANSPORT_MISMATCH, "this token resumes a WebSocket session; resume it there"
        )
    if live is None or live.bridge is None:
        try:
            hub.resume_tokens.take(token)  # raises the typed refusal (used, or invalid)
        except WireError as e:
            hub.metrics.resume_refused.labels(code=e.code).inc()
            raise signalling.OfferRefused(400, e.code, e.message) from e
        raise signalling.OfferRefused(400, TOKEN_INVALID, "no session to resume with this token")
    transport = signalling.DataChannelTransport()
    peer = await _answer(live, transport, sdp, new_session=False)
    try:
        if hub.resume_tokens.take(token) is not live or live.state is not SessionState.ACTIVE:
            raise WireError(TOKEN_INVALID, "the session has ended", param="resume_token")
    except WireError as e:  # another offer took it, or the session ended, while this one was answered
        await peer.close()
        hub.metrics.resume_refused.labels(code=e.code).inc()
        raise signalling.OfferRefused(400, e.code, e.message) from e
    _use_peer(live, transport, peer)
    # session.started (same id, a fresh token) and the kept events: queued until the new data channel opens.
    await live.attach(transport)
    # Never connected: detached again, for the rest of a grace.
    signalling.watch_connect(live, peer, lambda: live.transport_lost(transport))
    log.info("webrtc session %s: resumed, codec %s", live.id, peer.codec)
    return JSONResponse({"session": {"id": live.id}, "transport": {"type": "webrtc", "sdp": peer.answer_sdp}})
