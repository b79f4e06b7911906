"""The Realtime input audio buffer of manual turn-taking (``turn_detection: null``): caller audio held until the
client commits it, then fed to the engine as one turn.

Over the WebSocket the buffer is the appended bytes, in the session's input format; over WebRTC it is the track's
decoded audio since the last commit. A commit turns what is held into 100 ms writes into the engine's ingress ring,
followed by :data:`COMMIT_TAIL_MS` of silence so the engine's turn detector endpoints the last word; the session
feeds them at :data:`COMMIT_FEED_SPEED` times real time (the ingress ring holds a few seconds).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Final

import numpy as np

from livekit_omni.sessions.audio import WireFormat
from media.ingress import IngressWriter

#: ``input_audio_buffer.commit`` needs at least this much audio (OpenAI's rule; clients know its error).
MIN_COMMIT_MS: Final = 100
#: The committed buffer goes to the engine followed by this much silence, so its turn detector endpoints the last
#: word.
COMMIT_TAIL_MS: Final = 1200
#: The buffer is fed at this multiple of real time (the ingress ring holds a few seconds).
COMMIT_FEED_SPEED: Final = 4.0
#: The most caller audio an uncommitted buffer holds (older audio is dropped).
MAX_BUFFER_S: Final = 60.0
#: Silence in each input encoding (what the commit's tail is made of).
_SILENCE_BYTE: Final = {"pcmu": b"\xff", "pcma": b"\xd5"}

#: One write of committed audio into the engine's ingress (100 ms of it).
Write = Callable[[], object]


class InputBuffer:
    """The caller's uncommitted audio: appended bytes (WebSocket) or the track's frames (WebRTC)."""

    def __init__(self) -> None:
        self._bytes = bytearray()
        #: The track's audio since the last commit (mono int16 pieces at ``_track_rate``).
        self._track: collections.deque[np.ndarray] = collections.deque()
        self._track_samples = 0
        self._track_rate = 48_000

    def clear(self) -> None:
        self._bytes.clear()
        self._track.clear()
        self._track_samples = 0

    def append(self, raw: bytes, fmt: WireFormat) -> None:
        """Appended audio (WebSocket), at most :data:`MAX_BUFFER_S`: the oldest goes first."""
        self._bytes += raw
        cap = int(MAX_BUFFER_S * fmt.rate) * fmt.bytes_per_sample
        if len(self._bytes) > cap:
            del self._bytes[: len(self._bytes) - cap]

    def capture_track(self, pcm: np.ndarray, rate: int) -> None:
        """The track's audio while no commit has come (WebRTC), at most :data:`MAX_BUFFER_S`."""
        if rate != self._track_rate:  # the codec's rate does not change within a call; if it did, start over
            self.clear()
            self._track_rate = rate
        self._track.append(pcm)  # the peer's own array for this frame (decoded afresh), not a shared buffer
        self._track_samples += pcm.shape[0]
        cap = int(MAX_BUFFER_S * rate)
        while self._track_samples - self._track[0].shape[0] >= cap:
            self._track_samples -= self._track.popleft().shape[0]

    def buffered_ms(self, *, on_track: bool, fmt: WireFormat) -> float:
        if on_track:
            return self._track_samples / self._track_rate * 1000
        return len(self._bytes) / fmt.bytes_per_sample / fmt.rate * 1000

    def commit(self, writer: IngressWriter, *, on_track: bool, fmt: WireFormat) -> tuple[list[Write], float]:
        """Empty the buffer into 100 ms writes of it and its silent tail; returns them and their span (ms)."""
        if on_track:
            rate = self._track_rate
            pcm = np.concatenate([*self._track, np.zeros(rate * COMMIT_TAIL_MS // 1000, np.int16)])
            span_ms = pcm.shape[0] / rate * 1000
            step = rate // 10
            pieces: list[Write] = [
                functools.partial(writer.write_pcm16, pcm[i : i + step], rate)
                for i in range(0, pcm.shape[0], step)
            ]
        else:
            n_tail = int(fmt.rate * COMMIT_TAIL_MS / 1000) * fmt.bytes_per_sample
            data = bytes(self._bytes) + _SILENCE_BYTE.get(fmt.encoding, b"\x00") * n_tail
            span_ms = len(data) / fmt.bytes_per_sample / fmt.rate * 1000
            step = int(fmt.rate * 0.1) * fmt.bytes_per_sample
            pieces = [functools.partial(writer.write, data[i : i + step]) for i in range(0, len(data), step)]
        self.clear()
        return pieces, span_ms
