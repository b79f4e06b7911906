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
from dataclasses import dataclass

import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, Packet

from media.codecs import OPUS_FRAME_SAMPLES, OPUS_RATE, OpusEncoder, rms_dbfs
from media.ingress import frame_to_mono_pcm16
from media.pacer import Pacer
from media.webrtc import DEFAULT_JITTER_PREFETCH, ice_server_list, install_jitter_buffer, negotiated_mime


@dataclass
class _Utterance:
    """A clip queued with :meth:`WebRTCCaller.say`: its 20 ms frames (PCM, and Opus packets once encoded), the
    frame that holds the marked sample, and the future that gets the time that frame was handed to aiortc."""

    pcm: np.ndarray
    mark_frame: int
    sent_mark: asyncio.Future[float]
    packets: list[bytes] | None = None
    pos: int = 0

    @property
    def frames(self) -> int:
        return self.pcm.shape[0] // OPUS_FRAME_SAMPLES


class _SourceTrack(MediaStreamTrack):
    """Sends a mono 48 kHz int16 clip (looped, or once then silence) in 20 ms frames on a pacer; as pre-encoded
    Opus packets when the link is Opus (cheap for many callers in one process), else as PCM frames. After a clip
    that is not looped, clips queued with :meth:`say` play one after another, silence in between."""

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
        self._queued: collections.deque[_Utterance] = collections.deque()

    def say(self, audio: np.ndarray, mark_sample: int) -> asyncio.Future[float]:
        """Queue ``audio`` (48 kHz mono int16); the future gets the time the frame holding ``mark_sample`` was sent."""
        if self._looping:
            raise RuntimeError("a looping source plays its clip forever; queue clips on a loop=False caller")
        if not 0 <= mark_sample < audio.shape[0]:
            raise ValueError("mark_sample lies outside the clip")
        n = -(-audio.shape[0] // OPUS_FRAME_SAMPLES) * OPUS_FRAME_SAMPLES
        pcm = np.zeros(n, dtype=np.int16)
        pcm[: audio.shape[0]] = audio
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        utt = _Utterance(pcm, mark_sample // OPUS_FRAME_SAMPLES, fut)
        if self._codec() == "audio/opus":
            utt.packets = OpusEncoder().encode(pcm)  # now, not in recv(), so the pacing tick stays on time
        self._queued.append(utt)
        return fut

    def _next_queued(self, now: float) -> np.ndarray | bytes | None:
        """The next 20 ms of the queued clips (PCM or an Opus packet), or None when none is queued."""
        if not self._queued:
            return None
        utt = self._queued[0]
        i = utt.pos
        utt.pos += 1
        if i == utt.mark_frame and not utt.sent_mark.done():
            utt.sent_mark.set_result(now)
        if utt.pos >= utt.frames:
            self._queued.popleft()
        if self._codec() == "audio/opus":
            if utt.packets is None:
                utt.packets = OpusEncoder().encode(utt.pcm)
            return utt.packets[i]
        return utt.pcm[i * OPUS_FRAME_SAMPLES : (i + 1) * OPUS_FRAME_SAMPLES]

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
        now = time.monotonic()
        i = self._frame_index()
        pts = self.sent * OPUS_FRAME_SAMPLES
        self.sent_at.append((self.sent, now))
        self.sent += 1
        queued = self._next_queued(now) if i is None else None
        if self._codec() == "audio/opus":
            if self._packets is None:
                self._packets = OpusEncoder().encode(self._audio)
                # Silence from a fresh encoder: encoded right after the clip, the same packet carries the clip's
                # state, and repeated it decodes to a steady loud signal (-17 to -24 dBFS after a tone clip) that the
                # server hears as the caller never going quiet.
                self._silence_packet = OpusEncoder().encode(np.zeros(OPUS_FRAME_SAMPLES, np.int16))[0]
            if isinstance(queued, bytes):
                data = queued
            else:
                data = self._packets[i] if i is not None else self._silence_packet
            pkt = Packet(data)
            pkt.pts = pts
            pkt.time_base = self._time_base
            return pkt
        if isinstance(queued, np.ndarray):
            pcm = queued
        elif i is not None:
            pcm = self._audio[i * OPUS_FRAME_SAMPLES : (i + 1) * OPUS_FRAME_SAMPLES]
        else:
            pcm = np.zeros(OPUS_FRAME_SAMPLES, np.int16)
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = OPUS_RATE
        frame.pts = pts
        frame.time_base = self._time_base
        return frame


class WebRTCCaller:
    """An aiortc client: offers audio (sendrecv) and a data channel, sends ``audio`` (48 kHz mono int16), and
    records the audio that comes back (mono, at the frame rate, bounded to ``record_seconds``) with arrival times.

    ``codecs`` restricts the offer (e.g. ``["audio/PCMU"]``) to exercise a G.711 answer. ``on_audio`` is called
    with (arrival time, mono pcm) for every frame received, for a listener that must see all of a long call.
    With ``loop=False``, :meth:`say` queues further clips to speak (a conversation).
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
        on_audio: Callable[[float, np.ndarray], None] | None = None,
    ) -> None:
        self.on_audio = on_audio
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

    def say(self, audio: np.ndarray, mark_sample: int) -> asyncio.Future[float]:
        """Speak ``audio`` (48 kHz mono int16) after what is queued; the future resolves to the time the frame
        holding ``mark_sample`` (e.g. the last audible one) was handed to aiortc."""
        return self.source.say(audio, mark_sample)

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
                if self.on_audio is not None:
                    self.on_audio(now, pcm)
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
