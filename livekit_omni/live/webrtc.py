"""WebRTC signalling of the Live facade: ``POST /v1/live/sessions`` (and ``/live/sessions``).

Body ``{session: MediaSessionConfig, transport: {type: "webrtc", sdp: <offer>}}`` → ``{session: {id}, transport:
{type: "webrtc", sdp: <answer>}}``. Audio travels on the media track (Opus or G.711, handled by
:mod:`media.webrtc`); events travel on the client's data channel with the same semantics as the WebSocket, through
the same :class:`~livekit_omni.live.session.LiveSession`. There is no ``session.start`` there: the POST starts the
session, and ``session.started`` is the first event once the channel opens (the peer queues events until then).

Errors are JSON ``{error: {type, code, message}}``: 400 for a bad request, 401 for a bad key (the app's auth
middleware), 503 when the engine is full or unavailable.

The data-channel transport, the bounded body reader, the ICE-server list and the connect deadline are shared with
the Realtime dialect's calls (:mod:`livekit_omni.realtime.webrtc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from aiortc import RTCIceServer
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from livekit_omni.drain import DRAINING_CODE, DRAINING_MESSAGE, Drain
from livekit_omni.live import wire
from livekit_omni.live.resume import TOKEN_INVALID, TRANSPORT_MISMATCH
from livekit_omni.live.session import CLOSE_TRY_AGAIN, LiveHub, LiveSession, hub_of
from livekit_omni.settings import Settings
from media.bridge import SessionBridge
from media.webrtc import MAX_DATACHANNEL_BUFFERED, SdpError, WebRTCPeer, answer_offer

log = logging.getLogger(__name__)

#: Room for the session config around the SDP in the request body.
BODY_SLACK_BYTES: Final = 256 * 1024
#: How long closing waits for queued data-channel events to be sent.
DRAIN_TIMEOUT_S: Final = 1.0


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


class DataChannelTransport:
    """Events over the peer's data channel; audio on its track (so ``carries_audio`` is False)."""

    kind = "webrtc"
    carries_audio = False

    def __init__(self) -> None:
        self.peer: WebRTCPeer | None = None
        #: Called once when the client stops reading its channel (the session should end).
        self.on_stalled: Callable[[], None] | None = None
        self.closed = False
        self.refused = 0

    def send(self, data: bytes) -> None:
        peer = self.peer
        if self.closed or peer is None:
            return
        if peer.send_text(data.decode()):
            return
        self.refused += 1
        channel = peer.channel
        if channel is not None and channel.readyState == "open" and self.on_stalled is not None:
            # An open channel that cannot take more: the client stopped reading. End the session.
            self.closed = True
            self.on_stalled()

    async def put(self, data: bytes) -> None:
        # A backlog waits while the open channel holds over half of what it may buffer, so it never stalls it.
        while not self.closed and (peer := self.peer) is not None:
            ch = peer.channel
            if ch is None or ch.readyState != "open" or ch.bufferedAmount <= MAX_DATACHANNEL_BUFFERED // 2:
                break
            await asyncio.sleep(0.02)
        self.send(data)

    async def close(self, code: int, reason: str = "") -> None:
        self.closed = True
        peer = self.peer
        if peer is None:
            return
        # Let the last events (session.closed) leave the SCTP buffer before the association goes away.
        ch = peer.channel
        if ch is not None and ch.readyState == "open" and ch.bufferedAmount > 0:
            drained = asyncio.Event()
            ch.bufferedAmountLowThreshold = 0
            ch.on("bufferedamountlow", drained.set)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT_S)
        await peer.close()


async def connect_deadline(
    peer: WebRTCPeer, timeout: float, session_id: str, end: Callable[[], Awaitable[None]]
) -> None:
    """A client that never completes ICE/DTLS must not hold an engine slot until the session's lifetime ends."""
    await asyncio.sleep(timeout)
    if peer.connection_state != "connected":
        log.info("webrtc session %s: not connected after %g s; closing it", session_id, timeout)
        await end()


def _error(status: int, code: str, message: str, *, type: str = wire.INVALID_REQUEST) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "code": code, "message": message}}, status_code=status)


async def read_body(request: Request, limit: int) -> bytes | None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def answer_with_settings(
    settings: Settings, sdp: str, bridge: SessionBridge, **handlers: Any
) -> WebRTCPeer:
    """:func:`media.webrtc.answer_offer` with the server's WebRTC settings (ICE servers, loopback-only), for both
    dialects' calls; ``handlers`` are its ``on_*`` callbacks."""
    return await answer_offer(
        sdp,
        bridge,
        ice_servers=ice_servers(settings.webrtc.ice_servers),
        loopback_only=True if settings.webrtc.loopback_only else None,
        **handlers,
    )


def ice_servers(servers: list[dict[str, Any]]) -> list[RTCIceServer]:
    out = []
    for s in servers:
        out.append(
            RTCIceServer(urls=s.get("urls", []), username=s.get("username"), credential=s.get("credential"))
        )
    return out


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
    except wire.WireError as e:
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
    except wire.WireError as e:
        status = 503 if e.code in ("session_limit_reached", "engine_unavailable") else 500
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
        live.spawn(live.end(None, code=CLOSE_TRY_AGAIN, notify=False))

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


async def _resume_webrtc_session(hub: LiveHub, token: str, sdp: str) -> Response:
    """A new offer with a resume token: a new peer for the token's detached session (docs/protocol.md, Resume).
    The token is spent only once the offer is answered, so a bad offer leaves it usable."""
    live = hub.resume_tokens.peek(token)
    if live is not None and live.transport.kind != DataChannelTransport.kind:
        return _error(400, TRANSPORT_MISMATCH, "this token resumes a WebSocket session; resume it there")
    if live is None or live.bridge is None:
        try:
            hub.resume_tokens.take(token)  # raises the typed refusal (used, or invalid)
        except wire.WireError as e:
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
        if hub.resume_tokens.take(token) is not live or live.state != "active":
            raise wire.WireError(TOKEN_INVALID, "the session has ended", param="resume_token")
    except wire.WireError as e:  # another offer took it, or the session ended, while this one was answered
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
