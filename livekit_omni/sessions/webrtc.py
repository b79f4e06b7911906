"""WebRTC pieces both dialects' calls share: the data-channel transport, the bounded body reader, the answer with the
server's ICE settings, and the connect deadline (the media itself is :mod:`media.webrtc`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiortc import RTCIceServer
from starlette.requests import Request

from livekit_omni.settings import Settings
from media.bridge import SessionBridge
from media.webrtc import MAX_DATACHANNEL_BUFFERED, WebRTCPeer, answer_offer

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
