"""An aiortc caller for tests and benchmarks: the client side of a WebRTC call to the Live facade's
``POST /v1/live/sessions`` or to :func:`media.webrtc.answer_offer`. It sends audio (48 kHz mono int16), opens the
Live data channel, and records the audio that comes back with arrival times. Not used by the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fractions
import time
from collections.abc import Callable, Sequence

import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, Packet

from media.codecs import OPUS_FRAME_SAMPLES, OPUS_RATE, OpusEncoder, rms_dbfs
from media.ingress import frame_to_mono_pcm16
from media.pacer import Pacer
from media.webrtc import DEFAULT_JITTER_PREFETCH, ice_server_list, install_jitter_buffer, negotiated_mime


class _SourceTrack(MediaStreamTrack):
    """Sends a mono 48 kHz int16 clip (looped, or once then silence) in 20 ms frames on a pacer; as pre-encoded
    Opus packets when the link is Opus (cheap for many callers in one process), else as PCM frames."""

    kind = "audio"

    def __init__(self, audio: np.ndarray, *, loop: bool, codec: Callable[[], str]) -> None:
        super().__init__()
        self._looping = loop  # (MediaStreamTrack's event emitter owns ``_loop``)
        self._codec = codec
        self._silence_packet = b""
        self._set_clip(audio, start=0)
        self._pacer = Pacer()
        self._time_base = fractions.Fraction(1, OPUS_RATE)
        self.sent = 0
        #: Monotonic time at which each frame index was handed to aiortc (bounded).
        self.sent_at: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)

    def _set_clip(self, audio: np.ndarray, *, start: int) -> None:
        n = -(-audio.shape[0] // OPUS_FRAME_SAMPLES) * OPUS_FRAME_SAMPLES
        self._audio = np.zeros(n, dtype=np.int16)
        self._audio[: audio.shape[0]] = audio
        self._frames = n // OPUS_FRAME_SAMPLES
        self._start = start  # the frame count at which the clip's first frame goes out
        self._packets: list[bytes] | None = None

    def play(self, audio: np.ndarray) -> None:
        """Send ``audio`` from the next frame on, instead of the rest of the current clip (timestamps go on)."""
        self._set_clip(audio, start=self.sent)

    def _frame_index(self) -> int | None:
        k = self.sent - self._start
        if k < self._frames:
            return k
        return k % self._frames if self._looping else None

    async def recv(self) -> AudioFrame | Packet:
        if self.readyState != "live":
            raise MediaStreamError
        await self._pacer.tick()
        i = self._frame_index()
        pts = self.sent * OPUS_FRAME_SAMPLES
        self.sent_at.append((self.sent, time.monotonic()))
        self.sent += 1
        if self._codec() == "audio/opus":
            if self._packets is None:
                enc = OpusEncoder()
                self._packets = enc.encode(self._audio)
                self._silence_packet = enc.encode(np.zeros(OPUS_FRAME_SAMPLES, np.int16))[0]
            data = self._packets[i] if i is not None else self._silence_packet
            pkt = Packet(data)
            pkt.pts = pts
            pkt.time_base = self._time_base
            return pkt
        pcm = (
            self._audio[i * OPUS_FRAME_SAMPLES : (i + 1) * OPUS_FRAME_SAMPLES]
            if i is not None
            else np.zeros(OPUS_FRAME_SAMPLES, np.int16)
        )
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = OPUS_RATE
        frame.pts = pts
        frame.time_base = self._time_base
        return frame


class WebRTCCaller:
    """An aiortc client: offers audio (sendrecv) and a data channel, sends ``audio`` (48 kHz mono int16), and
    records the audio that comes back (mono, at the frame rate, bounded to ``record_seconds``) with arrival times.

    ``codecs`` restricts the offer (e.g. ``["audio/PCMU"]``) to exercise a G.711 answer.
    """

    def __init__(
        self,
        audio: np.ndarray | None = None,
        *,
        loop: bool = True,
        datachannel: str | None = "oai-events",
        ice_servers: Sequence[RTCIceServer | str] = (),
        codecs: Sequence[str] | None = None,
        jitter_prefetch: int = DEFAULT_JITTER_PREFETCH,
        record_seconds: float = 30.0,
        record_audio: bool = True,
    ) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_server_list(ice_servers)))
        src = audio if audio is not None else np.zeros(OPUS_FRAME_SAMPLES, np.int16)
        self.transceiver = self.pc.addTransceiver("audio", direction="sendrecv")
        if codecs is not None:
            wanted = {c.lower() for c in codecs}
            caps = RTCRtpSender.getCapabilities("audio").codecs
            self.transceiver.setCodecPreferences([c for c in caps if c.mimeType.lower() in wanted])
        install_jitter_buffer(self.transceiver.receiver, jitter_prefetch)
        self.source = _SourceTrack(src, loop=loop, codec=lambda: negotiated_mime(self.transceiver))
        self.transceiver.sender.replaceTrack(self.source)
        self.channel = self.pc.createDataChannel(datachannel) if datachannel else None
        self.messages: collections.deque[str | bytes] = collections.deque(maxlen=1024)
        self.opened = asyncio.Event()
        self.connected = asyncio.Event()
        self._record_max = int(record_seconds * 50)
        self.record_audio = record_audio
        self.chunks: collections.deque[np.ndarray] = collections.deque(maxlen=self._record_max)
        self.arrivals: collections.deque[float] = collections.deque(maxlen=self._record_max)
        self.levels: collections.deque[float] = collections.deque(maxlen=self._record_max)
        self.rate = 0
        self._task: asyncio.Task[None] | None = None

        if self.channel is not None:
            ch = self.channel

            @ch.on("open")
            def _open() -> None:
                self.opened.set()

            @ch.on("message")
            def _message(m: str | bytes) -> None:
                self.messages.append(m)

        @self.pc.on("connectionstatechange")
        def _state() -> None:
            if self.pc.connectionState == "connected":
                self.connected.set()

        @self.pc.on("track")
        def _track(track: MediaStreamTrack) -> None:
            if track.kind == "audio" and self._task is None:
                self._task = asyncio.ensure_future(self._receive(track))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def accept(self, answer_sdp: str) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer_sdp, type="answer"))

    def play(self, audio: np.ndarray) -> None:
        """Speak ``audio`` (48 kHz mono int16) from the next 20 ms frame on, then silence (or loop, as created)."""
        self.source.play(audio)

    def send(self, text: str) -> None:
        if self.channel is None:
            raise RuntimeError("this caller has no data channel")
        self.channel.send(text)

    async def _receive(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                if not isinstance(frame, AudioFrame):
                    continue  # an audio track's receiver yields decoded frames
                now = time.monotonic()
                pcm = frame_to_mono_pcm16(frame)
                self.rate = frame.sample_rate
                self.arrivals.append(now)
                self.levels.append(rms_dbfs(pcm))
                if self.record_audio:
                    self.chunks.append(pcm.copy())
        except MediaStreamError:
            return

    def received_audio(self) -> np.ndarray:
        return np.concatenate(list(self.chunks)) if self.chunks else np.zeros(0, np.int16)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.pc.close()
