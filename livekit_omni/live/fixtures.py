"""Audio fixtures of the Live dialect (``session.output_audio.fixture.play``): a clip that plays in place of the model.

:class:`FixturePlayback` resamples and encodes the clip for the session's output; :class:`FixtureOverlay` wraps the
session's :class:`~media.egress.EgressPlayer` wherever frames are pulled (the hub's clock, or the WebRTC track) and
hands out the clip's frames instead of the model's while it plays.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import numpy as np

from engine_bridge import protocol as p
from engine_bridge.formats import ENGINE_OUTPUT_RATE, FRAME_MS
from media.codecs import AudioEncoding, alaw_encode, ulaw_encode
from media.egress import EgressPlayer, OutputFrame
from media.resample import Resampler


class FixturePlayback:
    """A fixture clip (PCM16 24 kHz) resampled to an output rate, handed out in 20 ms frames."""

    def __init__(self, pcm: np.ndarray, *, rate: int, encoding: AudioEncoding) -> None:
        frame_in = ENGINE_OUTPUT_RATE * FRAME_MS // 1000
        # Whole frames plus one frame of zeros, which also flushes the resampler's delay line.
        padded = np.zeros(-(-pcm.shape[0] // frame_in) * frame_in + frame_in, dtype=np.int16)
        padded[: pcm.shape[0]] = pcm
        self.pcm = Resampler.for_rates(ENGINE_OUTPUT_RATE, rate).process(padded)
        self.encoding = encoding
        self.frame_samples = rate * FRAME_MS // 1000
        self.pos = 0
        self._frame = np.zeros(self.frame_samples, dtype=np.int16)

    @property
    def done(self) -> bool:
        return self.pos >= self.pcm.shape[0]

    def next_frame(self) -> tuple[np.ndarray, np.ndarray]:
        """The next 20 ms as (int16 pcm, payload bytes in the output encoding)."""
        chunk = self.pcm[self.pos : self.pos + self.frame_samples]
        self.pos += self.frame_samples
        pcm = self._frame
        pcm[: chunk.shape[0]] = chunk
        pcm[chunk.shape[0] :] = 0
        if self.encoding is AudioEncoding.PCMU:
            payload = ulaw_encode(pcm)
        elif self.encoding is AudioEncoding.PCMA:
            payload = alaw_encode(pcm)
        else:
            payload = pcm.astype("<i2", copy=False).view(np.uint8)
        return pcm, payload


class FixtureOverlay:
    """Wraps a session's :class:`EgressPlayer`: while a fixture plays, its frames replace the model's.

    The player keeps running underneath (it keeps the output timeline and drains the ring, whose audio is stale
    after the fixture's interrupt anyway). It stands in for the player wherever frames are pulled: the hub's clock
    (WebSocket) or the WebRTC track.
    """

    def __init__(self, player: EgressPlayer, on_fixture_done: Callable[[], None]) -> None:
        self.inner = player
        self.rate = player.rate
        self.frame_samples = player.frame_samples
        self.fixture: FixturePlayback | None = None
        self._on_done = on_fixture_done

    async def prepare(self, pcm24k: np.ndarray) -> FixturePlayback:
        """Resample the clip for this output, off the event loop (30 s at 48 kHz takes tens of ms)."""
        return await asyncio.to_thread(
            FixturePlayback, pcm24k, rate=self.inner.rate, encoding=self.inner.encoding
        )

    def play(self, fixture: FixturePlayback) -> None:
        self.fixture = fixture

    def add_transcript(self, ev: p.OutputTranscript) -> None:
        self.inner.add_transcript(ev)

    def next_frame(self) -> OutputFrame:
        frame = self.inner.next_frame()
        fixture = self.fixture
        if fixture is None:
            return frame
        pcm, payload = fixture.next_frame()
        if fixture.done:
            self.fixture = None
            self._on_done()
        # Model text released under a fixture belongs to interrupted (stale) speech: it is not shown.
        return msgspec.structs.replace(
            frame, pcm=pcm, payload=payload, speaking=True, model_samples=0, transcripts=()
        )
