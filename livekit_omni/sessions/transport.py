"""How a session reaches its client, whatever the dialect: the :class:`Transport` interface and the close codes.

A transport carries encoded events (one JSON object per frame) and, where it is a WebSocket, audio inside them; on
WebRTC the audio travels on the media track and the data channel carries events only. Implementations:
:class:`~livekit_omni.sessions.websocket.WebSocketTransport`,
:class:`~livekit_omni.sessions.webrtc.DataChannelTransport`, the detached buffer of a session waiting for a resume
(:class:`~livekit_omni.sessions.resume.DetachedTransport`) and the Realtime call's fan-out to its sidebands
(:class:`~livekit_omni.realtime.calls.CallTransport`). A SIP call plugs in here as one more: its signalling owns
the dialog, its RTP goes through the media plane like a WebRTC track (``carries_audio = False``), and its events
(call control, DTMF) go to whoever steers the call.
"""

from __future__ import annotations

from typing import Final, Protocol

# WebSocket close codes (RFC 6455): what a client's reconnect policy keys on (docs/protocol.md).
CLOSE_NORMAL: Final = 1000
CLOSE_POLICY: Final = 1008
CLOSE_INTERNAL: Final = 1011
CLOSE_RESTART: Final = 1012
CLOSE_TRY_AGAIN: Final = 1013


class Transport(Protocol):
    """How a session reaches its client. Events are encoded JSON objects; audio differs per transport."""

    #: Metrics label and resume key: ``websocket`` or ``webrtc``.
    kind: str
    #: True: output audio goes out in events and input arrives in events (WebSocket). False: both travel on a
    #: media track (WebRTC).
    carries_audio: bool

    def send(self, data: bytes) -> None:
        """Queue one encoded event; never blocks. A client that stops reading is disconnected by the transport."""

    async def put(self, data: bytes) -> None:
        """Queue one encoded event, waiting for room (a resumed session's backlog goes out through this)."""

    async def close(self, code: int, reason: str = "") -> None:
        """Flush queued events, then close with ``code``. Idempotent."""
