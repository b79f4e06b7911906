"""WebRTC for the media plane (aiortc), written once for the Live facade's ``POST /v1/live/sessions`` and the browser.

:func:`answer_offer` takes a client's SDP offer and an open :class:`~engine_bridge.client.EngineSession` and returns
a :class:`WebRTCPeer` whose ``answer_sdp`` goes back to the client. The peer

* sends the session's model audio: an outgoing track paced by :class:`~media.pacer.Pacer` and fed by an
  :class:`~media.egress.EgressPlayer` at 48 kHz as Opus, or at 8 kHz when the peer offers only G.711 (PCMU/PCMA);
  by default the track encodes itself and aiortc only packetizes (``encoder="aiortc"`` lets aiortc encode, see
  :class:`EgressTrack`); pts grow by one frame per frame;
* writes the caller's audio into the session's ingress ring through an :class:`~media.ingress.IngressWriter`,
  holding at most ``max_input_backlog`` decoded frames (drop-oldest, counted) if the event loop falls behind;
  aiortc's receive jitter buffer is replaced by :class:`AudioJitterBuffer` (see ``DEFAULT_JITTER_PREFETCH``);
* accepts the data channel the client opens (OpenAI Live WebRTC: ``"oai-events"``, JSON text) and exposes
  ``on_datachannel_message`` / :meth:`WebRTCPeer.send_event` so the facade can speak the Live protocol over it;
* reports connection-state changes to ``on_connection_state`` and closes itself when the connection fails;
* never contacts a STUN/TURN server unless one is configured (aiortc's default is Google's public STUN server).

It does not own the engine session: :meth:`WebRTCPeer.close` frees the peer, its tasks and buffers, and the caller
closes the session. Given a :class:`~media.bridge.SessionBridge` instead of a bare session, the peer uses the
bridge's ingress writer and egress player, and the bridge's event pump routes the model's
:class:`~engine_bridge.protocol.OutputTranscript` events to that player (with a bare session, route them to
``peer.player.add_transcript`` yourself); ``on_output_frame`` then sees them in the frame whose audio they belong
to.

Loopback use (tests, benchmarks, a browser on the same machine): aioice never gathers 127.0.0.1, so
:func:`enable_loopback_ice` patches its host-address lookup process-wide, and ``loopback_only`` strips every offered
candidate that is not UDP on 127.0.0.1 (mDNS ``.local`` candidates are always stripped: aioice would resolve them
by multicast). See docs/development.md, Loopback WebRTC.

The client side of the same call, for tests and benchmarks, is :class:`testkit.webrtc_caller.WebRTCCaller`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fractions
import inspect
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Literal

import aioice.ice
import numpy as np
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpReceiver,
    RTCRtpTransceiver,
    RTCSessionDescription,
)
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.sdp import SessionDescription
from aiortc.utils import uint16_add
from av import AudioFrame, Packet

from media.bridge import SessionBridge
from media.codecs import (
    G711_RATE,
    OPUS_RATE,
    OpusEncoder,
    alaw_encode,
    ulaw_encode,
)
from media.egress import EgressPlayer, OutputFrame
from media.ingress import IngressWriter, SessionLike, frame_to_mono_pcm16
from media.pacer import Pacer

log = logging.getLogger(__name__)

#: Receive jitter-buffer prefetch for caller audio (see :class:`AudioJitterBuffer`). aiortc holds each audio frame
#: until 4 later frames have arrived. Nothing downstream needs a playout cushion — the ingress ring absorbs arrival
#: jitter and the engine reads it every 10 ms — so the wait only delays every caller turn and every barge-in.
#: Measured (``benchmarks/media_plane.py --jitter-only``: aiortc caller → answer_offer() on 127.0.0.1, 2-core VM,
#: from the first frame of a tone burst handed to the caller's aiortc sender to the server's IngressWriter,
#: 30 bursts each): prefetch 4 (aiortc's rule) → median 81 ms (p90 84); 2 → 41 ms; 1 → 21 ms; 0 → 1.3 ms (p90 2.3).
#: Default 0: in-order audio is never held. The price is that a packet arriving after a later one is dropped
#: (a 20 ms gap in what the engine hears) instead of being put back in order; raise it to 1 (+20 ms) for paths
#: that reorder. Losses never stall the buffer at any setting.
DEFAULT_JITTER_PREFETCH: Final = 0
#: Decoded input frames allowed to wait for the consumer before the oldest are dropped (100 ms).
DEFAULT_MAX_INPUT_BACKLOG: Final = 5
#: Offers larger than this are refused before parsing (a browser's is ~3–6 KB).
MAX_OFFER_BYTES: Final = 64 * 1024
#: Outgoing data-channel bytes queued in SCTP before :meth:`WebRTCPeer.send_event` refuses more.
MAX_DATACHANNEL_BUFFERED: Final = 1 << 20
#: Events queued while no data channel is open yet, and client messages waiting for the handler.
MAX_PENDING_EVENTS: Final = 256
MAX_INBOUND_MESSAGES: Final = 256
#: Client data-channel messages above this size are refused (reported through ``on_datachannel_error``).
MAX_DATACHANNEL_MESSAGE: Final = 1 << 20

_LOOPBACK: Final = "127.0.0.1"
_loopback_patched = False
_original_get_host_addresses = aioice.ice.get_host_addresses

MessageHandler = Callable[[str | bytes], Awaitable[None] | None]
StateHandler = Callable[[str], Awaitable[None] | None]
ErrorHandler = Callable[[str, str], None]
FrameHandler = Callable[[OutputFrame], None]
InputHandler = Callable[[AudioFrame], None]


class SdpError(ValueError):
    """The offer is oversized, malformed, or has nothing this peer can answer (no audio)."""


# --- loopback ICE -----------------------------------------------------------------------------------------------


def _loopback_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    return [_LOOPBACK] if use_ipv4 else []


def enable_loopback_ice() -> None:
    """Make aioice gather only 127.0.0.1 (it skips loopback by design). Process-wide; idempotent."""
    global _loopback_patched
    aioice.ice.get_host_addresses = _loopback_host_addresses
    _loopback_patched = True


def disable_loopback_ice() -> None:
    """Undo :func:`enable_loopback_ice`."""
    global _loopback_patched
    aioice.ice.get_host_addresses = _original_get_host_addresses
    _loopback_patched = False


def loopback_ice_enabled() -> bool:
    return _loopback_patched


_CANDIDATE_RE: Final = re.compile(
    r"^a=candidate:\S+\s+\d+\s+(\S+)\s+\d+\s+(\S+)\s+\d+\s+typ\s+(\S+)", re.IGNORECASE
)


def sanitize_offer_sdp(sdp: str, *, loopback_only: bool) -> str:
    """Drop candidates aioice must not act on: mDNS ``*.local`` names always; with ``loopback_only`` everything but
    UDP 127.0.0.1 (LAN addresses, IPv6, TCP). Line endings are kept."""
    eol = "\r\n" if "\r\n" in sdp else "\n"
    kept: list[str] = []
    for line in sdp.splitlines():
        m = _CANDIDATE_RE.match(line)
        if m is not None:
            transport, address = m.group(1).lower(), m.group(2).lower()
            if address.endswith(".local"):
                continue
            if loopback_only and (transport != "udp" or address != _LOOPBACK):
                continue
        kept.append(line)
    return eol.join(kept) + eol


def ice_server_list(servers: Sequence[RTCIceServer | str]) -> list[RTCIceServer]:
    return [s if isinstance(s, RTCIceServer) else RTCIceServer(urls=s) for s in servers]


# --- receive jitter buffer --------------------------------------------------------------------------------------


class AudioJitterBuffer(JitterBuffer):
    """A receive jitter buffer for audio: one RTP packet is one frame.

    aiortc's buffer is written for video: it declares a frame complete only when a packet of the *next* frame
    arrives, then waits for ``prefetch`` (default 4) more — 80 ms before a caller's audio reaches us — and on a lost
    packet it stalls until its 16 slots overflow; since it releases at most one frame per arriving packet, one lost
    packet leaves it 14 frames (280 ms) behind for the rest of the call. Here:

    * the head frame is released once the newest packet is ``prefetch`` or more ahead of it (``prefetch=0``:
      at once, so in-order audio is never held);
    * a missing head packet is given up once the newest packet is more than ``prefetch`` ahead of it, so a loss
      costs that frame and no lasting delay, and up to ``prefetch`` packets of reordering are still repaired.

    * an empty payload is dropped as a lost packet, never given to the decoder (an empty packet flushes libopus).

    Overflow, duplicates and very late packets are handled by aiortc's ``add`` as before.
    """

    def __init__(self, prefetch: int, capacity: int = 16) -> None:
        super().__init__(capacity=capacity, prefetch=prefetch)
        self._newest: int | None = None
        self.holes_skipped = 0
        self.empty_dropped = 0

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        cap = self._capacity
        origin = self._origin
        assert origin is not None  # add() sets it before calling us
        newest = self._newest
        if (
            newest is None
            or uint16_add(newest, -origin) >= cap  # released already, or before a reset: forget it
            or uint16_add(sequence_number, -origin) > uint16_add(newest, -origin)
        ):
            newest = self._newest = sequence_number
        ahead = uint16_add(newest, -origin)
        if self._packets[origin % cap] is None:
            if ahead <= self._prefetch:
                return None
            while self._packets[origin % cap] is None:  # ends at the newest packet at the latest
                self.remove(1)
                self.holes_skipped += 1
                origin = self._origin
                assert origin is not None  # remove() advances it, never clears it
            ahead = uint16_add(newest, -origin)
        if ahead < self._prefetch:
            return None
        packet = self._packets[origin % cap]
        assert packet is not None
        self.remove(1)
        data: bytes = packet._data  # type: ignore[attr-defined]
        if not data:
            # An RTP packet with an empty payload (RFC 7587: treat as lost). Handed to the decoder it would be a
            # flush, after which libopus refuses every later packet: the caller's audio would be gone for the rest
            # of the call (found by benchmarks/fuzz_edges.py).
            self.empty_dropped += 1
            return None
        return JitterFrame(data=data, timestamp=packet.timestamp)


def install_jitter_buffer(receiver: RTCRtpReceiver, prefetch: int) -> bool:
    """Replace an audio receiver's jitter buffer (before any RTP arrives). False if this aiortc has no such slot."""
    attr = "_RTCRtpReceiver__jitter_buffer"
    if not isinstance(getattr(receiver, attr, None), JitterBuffer):
        log.warning("aiortc receiver has no %s; keeping its own jitter buffer", attr)
        return False
    setattr(receiver, attr, AudioJitterBuffer(prefetch))
    return True


def jitter_buffer_of(receiver: RTCRtpReceiver) -> JitterBuffer | None:
    buf = getattr(receiver, "_RTCRtpReceiver__jitter_buffer", None)
    return buf if isinstance(buf, JitterBuffer) else None


# --- outgoing track ---------------------------------------------------------------------------------------------


EncoderMode = Literal["aiortc", "media"]


class EgressTrack(MediaStreamTrack):
    """The session's model audio as an aiortc audio track: one 20 ms frame per pacer tick.

    ``encoder="media"`` (default) encodes here — Opus with :class:`~media.codecs.OpusEncoder` (mono, 32 kbps, voip),
    G.711 with the µ-law/A-law tables — and hands aiortc finished packets, which it only packetizes.
    ``encoder="aiortc"`` hands aiortc PCM frames instead: it then runs libswresample and libopus (stereo 96 kbps) in
    its executor and, on the event loop, a pure-Python RMS over every sample for the RTP audio-level header
    (``aiortc.rtp.compute_audio_level_dbov``: 0.4–0.8 ms per 20 ms stereo frame on this VM, more than the whole media
    plane's own work). Measured per session: see benchmarks/media_plane.py ``--opus``. G.722 always goes as frames.
    """

    kind = "audio"

    def __init__(
        self,
        player: EgressPlayer,
        *,
        codec: str = "audio/opus",
        pacer: Pacer | None = None,
        on_frame: FrameHandler | None = None,
        encoder: EncoderMode = "media",
    ) -> None:
        super().__init__()
        self.player = player
        self.pacer = pacer or Pacer()
        self.on_frame = on_frame
        self._pts = 0
        self._time_base = fractions.Fraction(1, player.rate)
        self._opus: OpusEncoder | None = None
        self._g711: Callable[[np.ndarray], np.ndarray] | None = None
        if encoder == "media":
            if codec == "audio/opus" and player.rate == OPUS_RATE:
                self._opus = OpusEncoder()
            elif codec == "audio/pcmu" and player.rate == G711_RATE:
                self._g711 = ulaw_encode
            elif codec == "audio/pcma" and player.rate == G711_RATE:
                self._g711 = alaw_encode
        self._stereo = codec == "audio/opus"
        self._stereo_buf = np.zeros(2 * player.frame_samples, dtype=np.int16)
        self.frames_sent = 0

    async def recv(self) -> AudioFrame | Packet:
        if self.readyState != "live":
            raise MediaStreamError
        await self.pacer.tick()
        out = self.player.next_frame()
        if self.on_frame is not None:
            try:
                self.on_frame(out)
            except Exception:
                log.exception("on_output_frame handler failed")
        self.frames_sent += 1
        pts = self._pts
        self._pts += out.pcm.shape[0]
        if self._opus is not None:
            packets = self._opus.encode_packets(out.pcm)
            if packets:
                return self._stamp(packets[0], pts)
        elif self._g711 is not None:
            return self._stamp(Packet(self._g711(out.pcm).tobytes()), pts)
        if self._stereo:
            # aiortc's Opus encoder upmixes mono through libswresample at -3 dB; duplicated channels pass unchanged.
            self._stereo_buf[0::2] = out.pcm
            self._stereo_buf[1::2] = out.pcm
            frame = AudioFrame.from_ndarray(self._stereo_buf.reshape(1, -1), format="s16", layout="stereo")
        else:
            frame = AudioFrame.from_ndarray(out.pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.player.rate
        frame.pts = pts
        frame.time_base = self._time_base
        return frame

    def _stamp(self, packet: Packet, pts: int) -> Packet:
        packet.pts = pts
        packet.time_base = self._time_base
        return packet


# --- the peer ---------------------------------------------------------------------------------------------------


def negotiated_mime(transceiver: RTCRtpTransceiver) -> str:
    codecs = [c for c in getattr(transceiver, "_codecs", []) if c.mimeType.lower() != "audio/rtx"]
    return codecs[0].mimeType.lower() if codecs else ""


def _output_rate_for(mime: str) -> int:
    if mime in ("audio/pcmu", "audio/pcma"):
        return 8000
    if mime == "audio/g722":
        return 16000
    return OPUS_RATE


async def _call(handler: Callable[..., Any] | None, *args: Any) -> None:
    if handler is None:
        return
    result = handler(*args)
    if inspect.isawaitable(result):
        await result


class WebRTCPeer:
    """One client's WebRTC connection to one engine session. Created by :func:`answer_offer`."""

    def __init__(
        self,
        pc: RTCPeerConnection,
        session: SessionLike,
        *,
        max_input_backlog: int,
        on_datachannel_message: MessageHandler | None,
        on_connection_state: StateHandler | None,
        on_output_frame: FrameHandler | None,
        on_input_frame: InputHandler | None,
        on_datachannel_error: ErrorHandler | None,
    ) -> None:
        self.pc = pc
        self.session = session
        self.answer_sdp = ""
        self.codec = ""
        # A bridge owns the session's writer and player (and closes them); a bare session gets the peer's own. So
        # a bridge's session outlives its peer: a new peer can take it over (a resumed WebRTC session).
        self._owns_media = not isinstance(session, SessionBridge)
        self.writer = session.writer if isinstance(session, SessionBridge) else IngressWriter(session)
        self.player: EgressPlayer | None = None
        self.track: EgressTrack | None = None
        self.channel: RTCDataChannel | None = None
        self.on_datachannel_message = on_datachannel_message
        self.on_connection_state = on_connection_state
        self.on_input_frame = on_input_frame
        self.on_datachannel_error = on_datachannel_error
        self._on_output_frame = on_output_frame
        #: When set, the caller's decoded audio (mono int16 at its rate, a fresh array per frame the sink may keep)
        #: goes here instead of the engine's ingress ring: a client that commits its own turns (the Realtime
        #: dialect's manual mode) buffers it until then.
        self.input_sink: Callable[[np.ndarray, int], None] | None = None
        self._max_input_backlog = max_input_backlog
        self._tasks: set[asyncio.Task[None]] = set()
        #: connectionstatechange handlers in flight (apart from _tasks: a handler may itself close the peer).
        self._state_tasks: set[asyncio.Future[None]] = set()
        self._outbox: collections.deque[str] = collections.deque()
        self._inbox: asyncio.Queue[str | bytes] = asyncio.Queue(MAX_INBOUND_MESSAGES)
        self._closing: asyncio.Future[None] | None = None
        self.connection_state = "new"
        #: The connection ended because the network went away (ICE consent expired), not by a close.
        self.ice_lost = False
        self.created_at = time.monotonic()
        #: Input frames dropped because the consumer lagged; events refused (no room); client messages dropped
        #: (handler backlog full or oversized); events sent; client messages delivered.
        self.input_frames = 0
        self.input_frames_dropped = 0
        self.events_refused = 0
        self.messages_dropped = 0
        self.events_sent = 0
        self.messages_in = 0

    # --- facade surface ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closing is not None

    @property
    def on_output_frame(self) -> FrameHandler | None:
        return self._on_output_frame

    @on_output_frame.setter
    def on_output_frame(self, handler: FrameHandler | None) -> None:
        self._on_output_frame = handler
        if self.track is not None:
            self.track.on_frame = handler

    def send_event(self, event: dict[str, Any]) -> bool:
        """Send one JSON event on the data channel (queued until the client's channel opens). False when it cannot
        be queued (no room, or the peer is closed); the facade decides whether that is fatal."""
        return self.send_text(json.dumps(event, separators=(",", ":"), ensure_ascii=False))

    def send_text(self, text: str) -> bool:
        if self.closed:
            self.events_refused += 1
            return False
        ch = self.channel
        if ch is None or ch.readyState == "connecting":
            if len(self._outbox) >= MAX_PENDING_EVENTS:
                self.events_refused += 1
                return False
            self._outbox.append(text)
            return True
        if ch.readyState != "open" or ch.bufferedAmount > MAX_DATACHANNEL_BUFFERED:
            self.events_refused += 1
            return False
        ch.send(text)
        self.events_sent += 1
        return True

    def stats(self) -> dict[str, Any]:
        jb = None
        for t in self.pc.getTransceivers():
            if t.kind == "audio":
                jb = jitter_buffer_of(t.receiver)
        return {
            "connection_state": self.connection_state,
            "codec": self.codec,
            "input_frames": self.input_frames,
            "input_frames_dropped": self.input_frames_dropped,
            "events_sent": self.events_sent,
            "events_refused": self.events_refused,
            "messages_in": self.messages_in,
            "messages_dropped": self.messages_dropped,
            "jitter_holes_skipped": getattr(jb, "holes_skipped", 0),
            "ingress": self.writer.stats(),
            "egress": self.player.stats() if self.player is not None else {},
            "pacer": (
                {
                    "ticks": self.track.pacer.ticks,
                    "late": self.track.pacer.late,
                    "skipped": self.track.pacer.skipped,
                }
                if self.track is not None
                else {}
            ),
        }

    async def close(self) -> None:
        """Close the connection and free the peer's tasks, tracks and buffers. Idempotent; safe from any handler.
        The engine session stays open (its owner closes it)."""
        if self._closing is not None:
            if not self._closing.done():
                await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        try:
            current = asyncio.current_task()
            for t in list(self._tasks):
                if t is not current:
                    t.cancel()
            for t in list(self._tasks):
                if t is not current:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
            self._tasks.clear()
            if self.channel is not None:
                with contextlib.suppress(Exception):
                    self.channel.close()
            if self.track is not None:
                self.track.stop()
            with contextlib.suppress(Exception):
                await self.pc.close()
        finally:
            if self._owns_media:
                self.writer.close()
                if self.player is not None:
                    self.player.close()
            self._outbox.clear()
            self.connection_state = "closed"
            self._closing.set_result(None)

    # --- wiring ----------------------------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("webrtc peer task %s failed", task.get_name(), exc_info=task.exception())

    def _start_input(self, track: MediaStreamTrack) -> None:
        self._spawn(self._consume(track), "webrtc-input")

    async def _consume(self, track: MediaStreamTrack) -> None:
        # aiortc's RemoteStreamTrack queue is unbounded (its decoder thread pushes into it); bound it from this
        # side: when more than max_input_backlog frames wait, the oldest are dropped.
        queue: asyncio.Queue[Any] | None = getattr(track, "_queue", None)
        try:
            while True:
                frame = await track.recv()
                if queue is not None:
                    while queue.qsize() > self._max_input_backlog:
                        newer = queue.get_nowait()
                        self.input_frames_dropped += 1
                        if newer is None:  # end of stream marker: the track is done
                            return
                        frame = newer
                assert isinstance(frame, AudioFrame)  # an audio track's receiver yields decoded frames
                self.input_frames += 1
                sink = self.input_sink
                if sink is None:
                    self.writer.write_frame(frame)
                else:
                    sink(frame_to_mono_pcm16(frame), frame.sample_rate)
                if self.on_input_frame is not None:
                    try:
                        self.on_input_frame(frame)
                    except Exception:
                        log.exception("on_input_frame handler failed")
        except MediaStreamError:
            return

    def _attach_channel(self, channel: RTCDataChannel) -> None:
        if self.channel is None or self.channel.readyState in ("closing", "closed"):
            self.channel = channel

        @channel.on("message")
        def _on_message(message: str | bytes) -> None:
            size = len(message.encode() if isinstance(message, str) else message)
            if size > MAX_DATACHANNEL_MESSAGE:
                self.messages_dropped += 1
                self._report_error(
                    "message_too_large",
                    f"data channel message of {size} bytes exceeds {MAX_DATACHANNEL_MESSAGE}",
                )
                return
            try:
                self._inbox.put_nowait(message)
            except asyncio.QueueFull:
                self.messages_dropped += 1
                self._report_error(
                    "backlog_full", "too many unprocessed data channel messages; message dropped"
                )

        @channel.on("open")
        def _on_open() -> None:
            self._flush_outbox()

        if channel.readyState == "open":
            self._flush_outbox()
        if not any(t.get_name() == "webrtc-dc-dispatch" for t in self._tasks):
            self._spawn(self._dispatch(), "webrtc-dc-dispatch")

    def _flush_outbox(self) -> None:
        while self._outbox and self.channel is not None and self.channel.readyState == "open":
            self.channel.send(self._outbox.popleft())
            self.events_sent += 1

    def _report_error(self, code: str, message: str) -> None:
        log.warning("webrtc data channel: %s", message)
        if self.on_datachannel_error is not None:
            try:
                self.on_datachannel_error(code, message)
            except Exception:
                log.exception("on_datachannel_error handler failed")

    async def _dispatch(self) -> None:
        # One consumer, so the facade sees client events in order even when its handler awaits.
        while True:
            message = await self._inbox.get()
            self.messages_in += 1
            handler = self.on_datachannel_message
            if handler is None:
                self.messages_dropped += 1
                continue
            try:
                await _call(handler, message)
            except Exception:
                log.exception("on_datachannel_message handler failed")

    def _watch_ice_loss(self) -> None:
        """Tell a lost network from a hang-up. aiortc reports both as "closed": when ICE consent expires (RFC 7675:
        the far end stopped answering) its ICE connection closes, the DTLS transport over it closes, and the peer
        connection shuts down before its ICE transport says "failed". A client's own close (a DTLS shutdown)
        closes the DTLS transport while ICE is still up. So the ICE connection is looked at when DTLS closes."""
        transports = {t.receiver.transport for t in self.pc.getTransceivers()}
        if self.pc.sctp is not None:
            transports.add(self.pc.sctp.transport)
        for dtls in transports - {None}:  # a mutated offer can leave a section without a transport

            def on_dtls_state(dtls: Any = dtls) -> None:
                if dtls.state == "closed" and not self.closed:
                    ice = getattr(dtls.transport, "_connection", None)  # aioice's Connection
                    if getattr(ice, "_closing", False):
                        self.ice_lost = True

            dtls.on("statechange", on_dtls_state)

    async def _on_state(self, state: str) -> None:
        if state == "closed" and self.ice_lost:
            state = "failed"  # what the standard calls a connection whose ICE consent expired
        self.connection_state = state
        try:
            await _call(self.on_connection_state, state)
        except Exception:
            log.exception("on_connection_state handler failed")
        if state in ("failed", "closed") and not self.closed:
            await self.close()


def _check_dtls(sdp: str) -> None:
    """Every media section needs a DTLS fingerprint: without one aiortc answers, then fails the connection in a
    background task (an AssertionError nobody sees) and the session waits out its connect deadline."""
    for media in SessionDescription.parse(sdp).media:
        if media.dtls is None or not media.dtls.fingerprints:
            raise SdpError(f"the SDP offer's {media.kind} section has no DTLS fingerprint (a=fingerprint)")


def check_offer(offer_sdp: str) -> None:
    """The checks of an offer that need no peer connection (size, an audio section, parseable, DTLS), so a route
    can refuse a bad offer with :class:`SdpError` before it takes an engine slot."""
    if len(offer_sdp.encode()) > MAX_OFFER_BYTES:
        raise SdpError(f"SDP offer is larger than {MAX_OFFER_BYTES} bytes")
    if "m=audio" not in offer_sdp:
        raise SdpError("the SDP offer has no audio section")
    try:
        _check_dtls(offer_sdp)
    except SdpError:
        raise
    except Exception as e:  # aiortc's parser raises what it meets (ValueError, IndexError, ...)
        raise SdpError(f"cannot apply the SDP offer: {type(e).__name__}: {e}") from e


async def answer_offer(
    offer_sdp: str,
    session: SessionLike,
    *,
    ice_servers: Sequence[RTCIceServer | str] = (),
    loopback_only: bool | None = None,
    jitter_prefetch: int = DEFAULT_JITTER_PREFETCH,
    max_input_backlog: int = DEFAULT_MAX_INPUT_BACKLOG,
    encoder: EncoderMode = "media",
    on_datachannel_message: MessageHandler | None = None,
    on_connection_state: StateHandler | None = None,
    on_output_frame: FrameHandler | None = None,
    on_input_frame: InputHandler | None = None,
    on_datachannel_error: ErrorHandler | None = None,
) -> WebRTCPeer:
    """Answer a client's offer for ``session``; returns the peer (``peer.answer_sdp`` is the answer).

    ``ice_servers`` defaults to none at all (host candidates only). ``loopback_only`` (default: whether
    :func:`enable_loopback_ice` was called) keeps only UDP 127.0.0.1 candidates of the offer and, when True,
    enables loopback ICE. ``encoder`` picks who encodes outgoing audio (see :class:`EgressTrack`). Raises
    :class:`SdpError` for an oversized or unusable offer.
    """
    check_offer(offer_sdp)
    if loopback_only is None:
        loopback_only = loopback_ice_enabled()
    elif loopback_only:
        enable_loopback_ice()
    sdp = sanitize_offer_sdp(offer_sdp, loopback_only=loopback_only)

    pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_server_list(ice_servers)))
    peer = WebRTCPeer(
        pc,
        session,
        max_input_backlog=max_input_backlog,
        on_datachannel_message=on_datachannel_message,
        on_connection_state=on_connection_state,
        on_output_frame=on_output_frame,
        on_input_frame=on_input_frame,
        on_datachannel_error=on_datachannel_error,
    )

    @pc.on("datachannel")
    def _on_datachannel(channel: RTCDataChannel) -> None:
        peer._attach_channel(channel)

    @pc.on("connectionstatechange")
    def _on_state() -> None:
        # The state is read now, not when a handler task runs: a failed connection closes right after, and a
        # handler that read it late would see "closed" twice and never "failed".
        task = asyncio.ensure_future(peer._on_state(pc.connectionState))
        peer._state_tasks.add(task)
        task.add_done_callback(peer._state_tasks.discard)

    try:
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except Exception as e:  # aiortc raises ValueError/OperationError/InternalError for bad offers
            raise SdpError(f"cannot apply the SDP offer: {e}") from e
        _check_dtls(sdp)
        peer._watch_ice_loss()
        audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise SdpError("the SDP offer has no audio section")
        transceiver = audio[0]
        install_jitter_buffer(transceiver.receiver, jitter_prefetch)
        peer.codec = negotiated_mime(transceiver)
        rate = _output_rate_for(peer.codec)
        peer.player = (
            session.output_at(rate)
            if isinstance(session, SessionBridge)
            else EgressPlayer(session, rate=rate)
        )
        # The client's direction as seen from here: "sendrecv"/"sendonly" means it wants to hear us.
        if getattr(transceiver, "_offerDirection", "sendrecv") in ("sendrecv", "sendonly"):
            peer.track = EgressTrack(peer.player, codec=peer.codec, on_frame=on_output_frame, encoder=encoder)
            pc.addTrack(peer.track)
        if transceiver.receiver.track is not None and getattr(transceiver, "_offerDirection", "") in (
            "sendrecv",
            "recvonly",
        ):
            peer._start_input(transceiver.receiver.track)
        try:
            answer = await pc.createAnswer()
            await pc.setLocalDescription(answer)
        except Exception as e:
            # aiortc accepts some offers it cannot answer (found by fuzzing: duplicated m= sections, a dropped
            # a=mid end in AttributeError/ValueError here); the offer is the only input, so it is the offer's fault.
            raise SdpError(f"cannot answer the SDP offer: {type(e).__name__}: {e}") from e
        peer.answer_sdp = pc.localDescription.sdp
    except BaseException:
        await peer.close()
        raise
    return peer
