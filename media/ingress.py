"""Caller audio into a session's ingress ring.

:class:`IngressWriter` takes whatever a client sends — PCM16 at 8/16/24/48 kHz (or any other rate), G.711 µ-law or
A-law at 8 kHz, or PyAV ``AudioFrame``\\ s as aiortc delivers them (s16 stereo 48 kHz, 960 samples) — converts it to
PCM16 mono at the engine input rate and writes it to the ingress ring. It never mutes (the engine does) and never
blocks: when the engine has not made room, the frame is dropped and counted as an overrun.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final, Protocol

import av
import numpy as np

from engine_bridge.formats import ENGINE_INPUT_RATE, FRAME_MS
from engine_bridge.ring import IngressRing, RingPair
from media.codecs import (
    G711_RATE,
    AudioEncoding,
    alaw_decode,
    downmix_interleaved,
    float_to_pcm16,
    parse_encoding,
    pcm16_from_bytes,
    rms_dbfs,
    ulaw_decode,
)
from media.resample import Resampler

log = logging.getLogger(__name__)

#: Writes to the ring are cut into pieces of at most one frame, so an overrun drops the excess, not a whole chunk.
WRITE_PIECE: Final = ENGINE_INPUT_RATE * FRAME_MS // 1000
#: Distinct input rates a writer keeps resamplers for (a client flipping rates cannot grow this without bound).
MAX_RESAMPLERS: Final = 4


class SessionLike(Protocol):
    """What the media plane needs of an ``EngineSession``: its rings and whether it is closed."""

    @property
    def rings(self) -> RingPair: ...

    @property
    def closed(self) -> bool: ...


class IngressWriter:
    """Converts one caller's audio to the engine format and writes it to ``session.rings.ingress``."""

    def __init__(
        self,
        session: SessionLike,
        *,
        encoding: AudioEncoding | str = AudioEncoding.PCM16,
        rate: int = ENGINE_INPUT_RATE,
    ) -> None:
        self._session = session
        # EngineSession.ring_doorbell wakes the engine's audio thread (coalesced per loop iteration). Stand-ins
        # without one (tests of this module, which read the ring themselves) have no engine to wake.
        self._ring_doorbell: Callable[[], None] | None = getattr(session, "ring_doorbell", None)
        self.encoding = AudioEncoding.PCM16
        self.rate = ENGINE_INPUT_RATE
        self.set_format(encoding, rate)
        self._resamplers: dict[int, Resampler] = {}
        self._closed = False
        #: Samples (at the engine rate) written to the ring, dropped because the ring was full, and the number of
        #: dropped pieces; input calls.
        self.samples_written = 0
        self.samples_dropped = 0
        self.overruns = 0
        self.chunks_in = 0
        self.frames_in = 0
        self._latest: np.ndarray | None = None

    # --- configuration ---------------------------------------------------------------------------------------
    def set_format(self, encoding: AudioEncoding | str, rate: int | None = None) -> None:
        """Set the format of raw bytes given to :meth:`write` (PCM16 at ``rate``; G.711 is always 8 kHz)."""
        enc = parse_encoding(encoding)
        if enc is AudioEncoding.PCM16:
            r = ENGINE_INPUT_RATE if rate is None else rate
            if not 1000 <= r <= 192_000:
                raise ValueError(f"unsupported input sample rate {r}")
        else:
            if rate not in (None, G711_RATE):
                raise ValueError(f"{enc.value} audio is 8 kHz, not {rate}")
            r = G711_RATE
        self.encoding = enc
        self.rate = r

    @property
    def last_level_dbfs(self) -> float:
        """The level of the latest input in dBFS (-120 before any). Measured when asked, not per write: only the
        stats read it, and per frame it would cost more than the ring write (it holds a reference to that input,
        so a caller that overwrites its buffer afterwards sees the level of what it wrote there since)."""
        return -120.0 if self._latest is None else rms_dbfs(self._latest)

    # --- input paths ------------------------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview | np.ndarray) -> int:
        """Raw audio in the configured format (bytes, or an int16/uint8 array). Returns samples written to the ring.

        Raises ValueError for an odd PCM16 byte count (a protocol error the caller reports; nothing is written).
        """
        if self.encoding is AudioEncoding.PCM16:
            pcm = data if isinstance(data, np.ndarray) else pcm16_from_bytes(data)
            if pcm.dtype != np.int16:
                raise TypeError("PCM16 input must be int16")
        elif self.encoding is AudioEncoding.PCMU:
            pcm = ulaw_decode(data)
        else:
            pcm = alaw_decode(data)
        return self.write_pcm16(pcm, self.rate)

    def write_pcm16(self, pcm: np.ndarray, rate: int, channels: int = 1) -> int:
        """int16 at ``rate``, mono or interleaved ``channels`` (averaged to mono; e.g. a LiveKit ``AudioFrame``).
        Returns samples written to the ring (at the engine rate)."""
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise TypeError("PCM must be a 1-D int16 array")
        if channels != 1:
            if channels < 1 or pcm.shape[0] % channels:
                raise ValueError(f"{pcm.shape[0]} samples do not divide into {channels} channels")
            pcm = downmix_interleaved(pcm, channels)
        self.chunks_in += 1
        if self._closed or self._session.closed:
            return 0
        if pcm.shape[0] == 0:
            return 0
        self._latest = pcm
        out = self._resampler(rate).process(pcm)
        return self._write_ring(out)

    def write_frame(self, frame: av.AudioFrame) -> int:
        """A decoded PyAV frame (aiortc gives s16 stereo 48 kHz; any layout, s16/flt, packed/planar works)."""
        self.frames_in += 1
        return self.write_pcm16(frame_to_mono_pcm16(frame), frame.sample_rate)

    # --- internals --------------------------------------------------------------------------------------------
    def _resampler(self, rate: int) -> Resampler:
        r = self._resamplers.get(rate)
        if r is None:
            if len(self._resamplers) >= MAX_RESAMPLERS:
                self._resamplers.pop(next(iter(self._resamplers)))
            r = Resampler.for_rates(rate, ENGINE_INPUT_RATE)
            self._resamplers[rate] = r
        return r

    def _write_ring(self, pcm: np.ndarray) -> int:
        ring: IngressRing = self._session.rings.ingress
        written = 0
        n = pcm.shape[0]
        for pos in range(0, n, WRITE_PIECE):
            piece = pcm[pos : pos + WRITE_PIECE]
            if ring.write(piece):
                written += piece.shape[0]
            else:
                self.overruns += 1
                self.samples_dropped += piece.shape[0]
        self.samples_written += written
        if written and self._ring_doorbell is not None:
            self._ring_doorbell()
        return written

    def stats(self) -> dict[str, float | int]:
        return {
            "samples_written": self.samples_written,
            "samples_dropped": self.samples_dropped,
            "overruns": self.overruns,
            "chunks_in": self.chunks_in,
            "frames_in": self.frames_in,
            "last_level_dbfs": round(self.last_level_dbfs, 1),
        }

    def close(self) -> None:
        """Stop writing (the ring may be unmapped after this). Idempotent."""
        self._closed = True
        self._resamplers.clear()


def frame_to_mono_pcm16(frame: av.AudioFrame) -> np.ndarray:
    """Any PyAV audio frame → mono int16 at the frame's rate (channels averaged)."""
    fmt = frame.format
    channels = len(frame.layout.channels)
    a = frame.to_ndarray()
    if fmt.is_planar:
        # (channels, samples)
        if a.dtype == np.int16:
            if channels == 1:
                return a[0]
            return (a.sum(axis=0, dtype=np.int32) // channels).astype(np.int16)
        mono = a.mean(axis=0, dtype=np.float32) if channels > 1 else a[0]
        return float_to_pcm16(mono)
    # packed: (1, samples * channels), interleaved
    flat = a.reshape(-1)
    if flat.dtype == np.int16:
        return downmix_interleaved(flat, channels)
    if flat.dtype in (np.float32, np.float64):
        mono = flat.reshape(-1, channels).mean(axis=1, dtype=np.float32) if channels > 1 else flat
        return float_to_pcm16(mono)
    if flat.dtype == np.int32:
        mono32 = flat.reshape(-1, channels).mean(axis=1) if channels > 1 else flat.astype(np.float64)
        return float_to_pcm16((mono32 / 2147483648.0).astype(np.float32))
    raise ValueError(f"unsupported audio frame format {fmt.name}")
