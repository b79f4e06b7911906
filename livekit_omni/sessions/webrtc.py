"""WebRTC calls, whatever the dialect: the data-channel transport, reading and checking the offer, answering it for a
session with the server's ICE settings, and the connect deadline (the media itself is :mod:`media.webrtc`).

A dialect's offer route reads the body (:func:`read_offer`), builds its session and opens its engine session, then
:func:`answer_call` answers the offer with the session's callbacks and :func:`watch_connect` ends a session whose
peer never connects. Refusals are :class:`OfferRefused`, answered as OpenAI's error body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiortc import RTCIceServer
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from livekit_omni.drain import DRAINING_CODE, DRAINING_MESSAGE
from livekit_omni.sessions.base import DialectSession
from livekit_omni.sessions.errors import INVALID_REQUEST, SERVER_ERROR, error_response
from livekit_omni.sessions.hub import SessionHub, hub_of
from livekit_omni.settings import Settings
from media.bridge import SessionBridge
from media.egress import OutputFrame
from media.webrtc import MAX_DATACHANNEL_BUFFERED, SdpError, WebRTCPeer, answer_offer

log = logging.getLogger(__name__)

#: Room for the session config around the SDP in the request body.
BODY_SLACK_BYTES: Final = 256 * 1024
#: How long closing waits for queued data-channel events to be sent.
DRAIN_TIMEOUT_S: Final = 1.0


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


class OfferRefused(Exception):
    """A WebRTC offer the server will not answer: the HTTP status and the error body's fields."""

    def __init__(self, status: int, code: str, message: str, *, type: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.type = status, code, message, type

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message, type=self.type)


def refuse_if_draining(hub: SessionHub) -> None:
    """A draining server answers no new call (503: the client tries again, elsewhere)."""
    if not hub.admitting:
        hub.metrics.rejected_sessions.labels(reason=DRAINING_CODE).inc()
        raise OfferRefused(503, DRAINING_CODE, DRAINING_MESSAGE, type=SERVER_ERROR)


async def read_offer(request: Request, hub: SessionHub) -> bytes:
    """The body of an offer request, within the SDP limit and its slack (a draining server reads none)."""
    refuse_if_draining(hub)
    limit = hub.settings.limits.max_sdp_bytes + BODY_SLACK_BYTES
    body = await read_body(request, limit)
    if body is None:
        raise OfferRefused(400, "request_too_large", f"the request body is limited to {limit} bytes")
    return body


def check_sdp_size(sdp: str, hub: SessionHub) -> None:
    max_sdp = hub.settings.limits.max_sdp_bytes
    if len(sdp.encode()) > max_sdp:
        raise OfferRefused(400, "sdp_too_large", f"the SDP offer is limited to {max_sdp} bytes")


async def answer_call(
    session: DialectSession[Any, Any],
    sdp: str,
    *,
    on_connection_state: Callable[[str], Awaitable[None]],
    on_output_frame: Callable[[OutputFrame], None],
    on_input_frame: Callable[[], None] | None = None,
    end_on_failure: bool = True,
) -> WebRTCPeer:
    """Answer ``sdp`` for ``session``'s engine session (open): its data channel carries the session's events, the
    track its audio. A bad offer is refused (400), as is a failure to answer (500); the session then ends unless
    ``end_on_failure`` is False (a resume's offer: the session stays detached)."""
    assert session.bridge is not None
    metrics = session.metrics

    def input_frame(frame: Any) -> None:
        metrics.audio_in_seconds.inc(frame.samples / frame.sample_rate)
        if on_input_frame is not None:
            on_input_frame()

    def datachannel_error(code: str, message: str) -> None:
        session.emit(session.codec.error_event(code, message))

    try:
        return await answer_with_settings(
            session.settings,
            sdp,
            session.bridge,
            on_datachannel_message=session.handle_text,
            on_connection_state=on_connection_state,
            on_output_frame=on_output_frame,
            on_input_frame=input_frame,
            on_datachannel_error=datachannel_error,
        )
    except SdpError as e:
        if end_on_failure:
            await session.transport_closed()
        raise OfferRefused(400, "invalid_sdp", str(e)) from e
    except Exception as e:
        log.exception("%s session %s: answering the offer failed", session.dialect, session.id)
        if end_on_failure:
            await session.transport_closed()
        raise OfferRefused(
            500, "internal_error", f"could not answer the offer: {e}", type=SERVER_ERROR
        ) from e


def watch_connect(
    session: DialectSession[Any, Any], peer: WebRTCPeer, end: Callable[[], Awaitable[None]]
) -> None:
    """``end`` the session if its peer has not connected within ``webrtc_connect_timeout_s``."""
    session.spawn(connect_deadline(peer, session.settings.limits.webrtc_connect_timeout_s, session.id, end))


async def answer_offer_request(
    request: Request, create: Callable[[Request, SessionHub], Awaitable[Response]]
) -> Response:
    """Run a dialect's offer route ``create`` with the app's hub; an :class:`OfferRefused` becomes its response."""
    try:
        return await create(request, hub_of(request.app))
    except OfferRefused as e:
        return e.response()
