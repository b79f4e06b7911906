"""Plain RTP for the media plane: the audio of a SIP call (G.711 at 8 kHz, RFC 4733 telephone events).

:class:`RtpPeer` is to a SIP call what :class:`~media.webrtc.WebRTCPeer` is to a WebRTC one, without ICE, DTLS or
SRTP (a SIP trunk or PBX sends plain RTP on the address its SDP named):

* **in:** every datagram on the call's UDP port is parsed by aiortc's :class:`~aiortc.rtp.RtpPacket`; audio packets
  of the negotiated payload type go through the receive jitter buffer of the WebRTC path
  (:class:`~media.webrtc.AudioJitterBuffer`: up to ``jitter_prefetch`` packets of reordering put back in order, a
  lost packet given up once the buffer is that far past it), are decoded (G.711 tables of :mod:`media.codecs`) and
  written to the ingress ring through the session's :class:`~media.ingress.IngressWriter` (8 kHz, resampled to the
  engine rate there). A frame that never came is concealed: the previous frame again at half its level, for at
  most ``MAX_CONCEALED_FRAMES`` frames of one gap; a longer gap (a caller's silence suppression, a hold) is left
  out, as the WebRTC path leaves out what never arrived;
* **symmetric RTP** (RFC 4961): the peer sends to where the caller's RTP comes from, latched on the first valid
  packet (the SDP's address is used only until then), so a caller behind NAT is heard and hears us. Once latched,
  packets from elsewhere are dropped (counted), unless the latched source has been silent for ``RELATCH_AFTER_S``
  (the caller moved: a re-INVITE to a new address, a NAT rebinding);
* **telephone events** (RFC 4733) of the negotiated payload type are reported once per key press, at its first
  packet, to ``on_dtmf``;
* **out:** one 20 ms frame per tick of a :class:`~media.pacer.Pacer`, from the session's
  :class:`~media.egress.EgressPlayer` playing PCM16 at 8 kHz, encoded here in the call's G.711 law (as
  :class:`~media.webrtc.EgressTrack` does for a WebRTC G.711 call; a re-INVITE may switch the law), so the epoch
  flush on barge-in, the duck and the playout report are the WebRTC path's own; while the model is quiet the frames are silence and still
  sent (a phone keeps its jitter buffer primed and a trunk sees a live stream). The marker bit starts each talkspurt.
  While the call is on hold (``sending = False``) the frames are still pulled, so the player's clock runs on, but
  not sent.

It owns neither the engine session nor its writer and player (the session's
:class:`~media.bridge.SessionBridge` does); :meth:`RtpPeer.close` stops the tasks and closes the socket. All of it
runs on the event loop and never blocks: a datagram costs one parse, one jitter-buffer step, one table decode and
one ring write (tens of microseconds), an output frame one table encode and one ``sendto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np
from aiortc.rtp import RtpPacket

from media.codecs import G711_RATE, AudioEncoding, alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from media.egress import EgressPlayer, OutputFrame
from media.ingress import IngressWriter
from media.pacer import Pacer
from media.webrtc import AudioJitterBuffer

log = logging.getLogger(__name__)

#: Samples of one 20 ms G.711 frame.
FRAME_SAMPLES: Final = G711_RATE // 50
#: Static payload types of the two G.711 laws (RFC 3551).
PCMU_PT: Final = 0
PCMA_PT: Final = 8
#: A latched source silent this long may be replaced by a new one.
RELATCH_AFTER_S: Final = 2.0
#: Frames of one gap that are concealed by repeating the previous frame (at half level); the rest are left out.
MAX_CONCEALED_FRAMES: Final = 3
#: Largest datagram read (a G.711 packet of 20 ms is 172 bytes; anything much larger is not ours).
MAX_DATAGRAM: Final = 2048
#: RFC 4733 events 0-15 as the keys they stand for.
DTMF_KEYS: Final = "0123456789*#ABCD"

DtmfHandler = Callable[[str, int], None]
FrameHandler = Callable[[OutputFrame], None]
InputSink = Callable[[np.ndarray, int], None]


def dtmf_event(payload: bytes) -> tuple[int, bool, int] | None:
    """An RFC 4733 telephone-event payload: (event, end bit, duration in samples), or None when it is not one."""
    if len(payload) < 4:
        return None
    return payload[0], bool(payload[1] & 0x80), int.from_bytes(payload[2:4], "big")


class RtpStats:
    """What one peer received, dropped and sent."""

    __slots__ = (
        "concealed",
        "dtmf_events",
        "foreign",
        "frames_in",
        "gaps",
        "malformed",
        "other_payload",
        "packets_in",
        "packets_out",
    )

    def __init__(self) -> None:
        self.packets_in = 0
        self.malformed = 0
        self.foreign = 0
        self.other_payload = 0
        self.frames_in = 0
        self.concealed = 0
        self.gaps = 0
        self.dtmf_events = 0
        self.packets_out = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, peer: RtpPeer) -> None:
        self.peer = peer

    def datagram_received(self, data: bytes, addr: tuple[str, int] | Any) -> None:
        self.peer._on_datagram(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:
        # An ICMP port unreachable for what we sent (the caller's port closed): nothing to do, the call's
        # signalling or its RTP timeout ends it.
        log.debug("rtp socket error: %s", exc)


class RtpPeer:
    """The RTP side of one call: see the module docstring. Create with :func:`open_rtp_peer`."""

    def __init__(
        self,
        writer: IngressWriter,
        player: EgressPlayer,
        *,
        encoding: AudioEncoding,
        payload_type: int,
        dtmf_payload_type: int | None = None,
        remote: tuple[str, int] | None = None,
        jitter_prefetch: int = 1,
        on_output_frame: FrameHandler | None = None,
        on_dtmf: DtmfHandler | None = None,
    ) -> None:
        if player.rate != G711_RATE or player.encoding is not AudioEncoding.PCM16:
            raise ValueError("the egress player must play PCM16 at 8 kHz (the peer encodes G.711)")
        self.writer = writer
        self.player = player
        self.encoding = AudioEncoding.PCMU
        self.payload_type = payload_type
        self._decode: Callable[[bytes], np.ndarray] = ulaw_decode
        self._encode: Callable[[np.ndarray], np.ndarray] = ulaw_encode
        self.switch_codec(encoding, payload_type)
        self.dtmf_payload_type = dtmf_payload_type
        #: Where the SDP says to send (until the caller's first packet latches its real source).
        self.sdp_remote = remote
        self.latched: tuple[str, int] | None = None
        self._last_rx = 0.0
        self.on_output_frame = on_output_frame
        self.on_dtmf = on_dtmf
        #: When set, decoded caller audio goes here instead of the ingress ring (a client committing its own turns).
        self.input_sink: InputSink | None = None
        #: False while the call is on hold (or the caller asked to only send): frames are pulled, not sent.
        self.sending = True
        self.stats = RtpStats()
        self._jitter = AudioJitterBuffer(jitter_prefetch)
        self._expected_ts: int | None = None
        self._last_pcm: np.ndarray | None = None
        self._dtmf_seen: tuple[int, int] | None = None  # (ssrc, timestamp) of the last reported event
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task[None] | None = None
        self.pacer = Pacer()
        self._ssrc = random.getrandbits(32)
        self._seq = random.getrandbits(16)
        self._ts = random.getrandbits(32)
        self._was_speaking = False
        self.local_port = 0
        self.closed = False

    # --- life ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start sending (the output clock). The socket already receives."""
        if self._task is None and not self.closed:
            self._task = asyncio.create_task(self._send_loop(), name=f"rtp-out-{self.local_port}")

    async def close(self) -> None:
        """Stop sending and receiving. Idempotent. The writer and player stay with their owner."""
        if self.closed:
            return
        self.closed = True
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def switch_codec(self, encoding: AudioEncoding, payload_type: int) -> None:
        """Send and receive ``encoding`` (G.711 µ-law or A-law) on ``payload_type`` from now on."""
        if encoding is AudioEncoding.PCMU:
            self._decode, self._encode = ulaw_decode, ulaw_encode
        elif encoding is AudioEncoding.PCMA:
            self._decode, self._encode = alaw_decode, alaw_encode
        else:
            raise ValueError(f"RTP audio is G.711 (pcmu or pcma), not {encoding}")
        self.encoding = encoding
        self.payload_type = payload_type

    @property
    def remote(self) -> tuple[str, int] | None:
        """Where our RTP goes: the latched source, else the SDP's address."""
        return self.latched or self.sdp_remote

    def set_remote(self, remote: tuple[str, int] | None) -> None:
        """A new SDP address (a re-INVITE): used until packets come from it, and the latch may move to it."""
        if remote != self.sdp_remote:
            self.sdp_remote = remote
            self.latched = None

    @property
    def idle_s(self) -> float:
        """Seconds since the last valid packet of the caller (since the peer started when none came yet)."""
        return time.monotonic() - self._last_rx

    # --- in ----------------------------------------------------------------------------------------------------
    def _on_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.closed:
            return
        st = self.stats
        st.packets_in += 1
        if len(data) > MAX_DATAGRAM:
            st.malformed += 1
            return
        try:
            packet = RtpPacket.parse(data)
        except (
            Exception
        ):  # aiortc raises ValueError for what it checks, struct.error or IndexError for the rest
            st.malformed += 1
            return
        pt = packet.payload_type
        if pt != self.payload_type and pt != self.dtmf_payload_type:
            st.other_payload += 1  # RTCP on a muxed port, comfort noise, a codec we did not answer
            return
        now = time.monotonic()
        if self.latched is None:
            self.latched = addr
        elif addr != self.latched:
            if now - self._last_rx < RELATCH_AFTER_S:
                st.foreign += 1
                return
            log.info("rtp %d: caller's media moved from %s to %s", self.local_port, self.latched, addr)
            self.latched = addr
        self._last_rx = now
        if pt == self.payload_type:
            self._on_audio(packet)
        else:
            self._on_dtmf(packet)

    def _on_audio(self, packet: RtpPacket) -> None:
        packet._data = packet.payload  # type: ignore[attr-defined]  # what aiortc's depayloader would have set
        _, frame = self._jitter.add(packet)
        if frame is None:
            return
        pcm = self._decode(frame.data)
        expected = self._expected_ts
        if expected is not None:
            gap = (frame.timestamp - expected) & 0xFFFFFFFF
            if (
                0 < gap < 0x80000000
            ):  # frames missing before this one (a wrap-around jump backwards is no gap)
                self.stats.gaps += 1
                self._conceal(gap)
        self._expected_ts = (frame.timestamp + pcm.shape[0]) & 0xFFFFFFFF
        self._last_pcm = pcm
        self.stats.frames_in += 1
        self._deliver(pcm)

    def _conceal(self, gap: int) -> None:
        last = self._last_pcm
        frames = gap // FRAME_SAMPLES
        if last is None or frames == 0 or frames > MAX_CONCEALED_FRAMES:
            return  # a long gap is silence suppression or a hold, not loss: nothing to conceal
        fill = (last.astype(np.int32) >> 1).astype(np.int16)
        for _ in range(frames):
            self.stats.concealed += 1
            self._deliver(fill)
            fill = (fill.astype(np.int32) >> 1).astype(np.int16)

    def _deliver(self, pcm: np.ndarray) -> None:
        sink = self.input_sink
        if sink is not None:
            sink(pcm, G711_RATE)
        else:
            self.writer.write_pcm16(pcm, G711_RATE)

    def _on_dtmf(self, packet: RtpPacket) -> None:
        ev = dtmf_event(packet.payload)
        if ev is None:
            self.stats.malformed += 1
            return
        event, _end, _duration = ev
        key = (packet.ssrc, packet.timestamp)
        if key == self._dtmf_seen:
            return  # the same key press: its updates and its three end packets
        self._dtmf_seen = key
        if event >= len(DTMF_KEYS):
            return  # a tone event (RFC 4734), not a key
        self.stats.dtmf_events += 1
        if self.on_dtmf is not None:
            try:
                self.on_dtmf(DTMF_KEYS[event], packet.timestamp)
            except Exception:
                log.exception("on_dtmf handler failed")

    # --- out ---------------------------------------------------------------------------------------------------
    async def _send_loop(self) -> None:
        pacer, player = self.pacer, self.player
        while not self.closed:
            await pacer.tick()
            frame = player.next_frame()
            if self.on_output_frame is not None:
                try:
                    self.on_output_frame(frame)
                except Exception:
                    log.exception("on_output_frame handler failed")
            self._send(frame)

    def _send(self, frame: OutputFrame) -> None:
        n = frame.pcm.shape[0]
        marker = 1 if frame.speaking and not self._was_speaking else 0
        self._was_speaking = frame.speaking
        seq, ts = self._seq, self._ts
        self._seq = (seq + 1) & 0xFFFF
        self._ts = (ts + n) & 0xFFFFFFFF
        remote, transport = self.remote, self._transport
        if not self.sending or remote is None or transport is None:
            return
        packet = RtpPacket(
            payload_type=self.payload_type,
            marker=marker,
            sequence_number=seq,
            timestamp=ts,
            ssrc=self._ssrc,
            payload=self._encode(frame.pcm).tobytes(),
        )
        transport.sendto(packet.serialize(), remote)
        self.stats.packets_out += 1


async def open_rtp_peer(
    host: str,
    ports: tuple[int, int],
    writer: IngressWriter,
    player: EgressPlayer,
    *,
    attempts: int = 64,
    **kwargs: Any,
) -> RtpPeer:
    """An :class:`RtpPeer` receiving on ``host`` at an even port of ``ports`` (inclusive range; RTP's convention
    leaves the odd one above for RTCP). Raises OSError when ``attempts`` random ports were all taken."""
    lo, hi = ports
    if lo > hi or lo < 1 or hi > 65535:
        raise ValueError(f"bad RTP port range {lo}-{hi}")
    loop = asyncio.get_running_loop()
    peer = RtpPeer(writer, player, **kwargs)
    evens = (hi - lo) // 2 + 1
    last: OSError | None = None
    for _ in range(max(1, attempts)):
        port = lo + (lo & 1) + 2 * random.randrange(evens)
        if port > hi:
            port = hi - (hi & 1)
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Protocol(peer), local_addr=(host, port)
            )
        except OSError as e:
            last = e
            continue
        peer._transport = transport
        peer.local_port = port
        peer._last_rx = time.monotonic()
        return peer
    raise OSError(f"no free RTP port in {lo}-{hi} on {host} after {attempts} tries: {last}")
