"""Streaming turn detection: a frame VAD (WebRTC or Silero ONNX) plus the turn state machine around it.

The session runner pushes caller audio (PCM16 mono at :data:`~engine_bridge.formats.ENGINE_INPUT_RATE`) in
chunks of any length and gets back :class:`SpeechStarted` / :class:`SpeechStopped` events positioned on the
stream's own timeline (milliseconds of audio pushed so far). Between events it reads :attr:`TurnDetector.speech_ms`
(for its barge-in minimum) and :attr:`TurnDetector.silence_ms_so_far` (to start ASR speculatively before the
endpoint), and :meth:`TurnDetector.utterance` for the audio of the turn.

All buffers are preallocated when the detector is built; pushing never allocates per frame, and the memory
of a detector is fixed by ``max_utterance_ms``.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import webrtcvad

from engine_bridge.formats import ENGINE_INPUT_RATE, samples_to_ms

if TYPE_CHECKING:
    import onnxruntime

__all__ = [
    "SpeechStarted",
    "SpeechStopped",
    "TurnDetector",
    "TurnEvent",
    "VADEngine",
    "VADSettings",
    "silero_model_path",
]

_RATE = ENGINE_INPUT_RATE
_SAMPLES_PER_MS = _RATE // 1000
# Silero v5/v6 at 16 kHz takes exactly 512 new samples (32 ms) per call, plus 64 samples of context.
_SILERO_FRAME = 512
_SILERO_CONTEXT = 64
# Silero's own streaming iterator leaves speech only when the probability falls this far below the
# threshold; the hysteresis keeps a word's quiet tail from splitting the turn.
_SILERO_HYSTERESIS = 0.15
_WEBRTC_FRAME_MS = (10, 20, 30)


class VADEngine(StrEnum):
    WEBRTC = "webrtc"
    SILERO = "silero"


@dataclass(frozen=True, slots=True)
class VADSettings:
    """Turn-taking knobs. Times are milliseconds of caller audio."""

    engine: VADEngine = VADEngine.WEBRTC
    #: WebRTC aggressiveness 0-3; 3 rejects the most non-speech (measured best on Piper speech in noise).
    aggressiveness: int = 3
    #: WebRTC frame length (10, 20 or 30 ms). 20 ms matches the media plane's frames, so every pushed frame
    #: is judged at once instead of waiting for the next one. Silero always uses 32 ms frames.
    frame_ms: int = 20
    #: Silero speech probability at which a frame counts as speech (WebRTC decides by itself).
    threshold: float = 0.5
    #: Audio kept before the first speech frame, so ASR hears the onset of the first word.
    prefix_padding_ms: int = 300
    #: Silence after the last speech frame that ends the turn.
    silence_ms: int = 500
    #: Consecutive speech needed before a turn starts; shorter blips (clicks, taps) never start one. 100 ms
    #: because WebRTC flags the first 80 ms of a fresh stream as speech whenever it begins with noise
    #: (measured: one frame plus three hangover frames, at -60 to -30 dBFS), which 60 ms would turn into a
    #: phantom turn.
    min_speech_ms: int = 100
    #: Silence kept after the last speech frame in :meth:`TurnDetector.utterance`. It must not exceed
    #: ``silence_ms``. Set it to the point where the engine starts speculative ASR: the audio it gets then
    #: is exactly the final utterance if no more speech comes, so the speculative transcript can be reused.
    tail_padding_ms: int = 200
    #: Longest turn (prefix padding included). A turn that reaches it is ended with ``forced=True``; this
    #: also bounds the detector's memory.
    max_utterance_ms: int = 30_000
    #: onnxruntime intra-op threads for Silero (the session is shared by every detector in the process).
    onnx_threads: int = 1

    def __post_init__(self) -> None:
        # Accept the plain strings that come from configuration files and session.update payloads.
        object.__setattr__(self, "engine", VADEngine(self.engine))
        if not 0 <= self.aggressiveness <= 3:
            raise ValueError(f"aggressiveness must be 0-3, got {self.aggressiveness}")
        if self.engine is VADEngine.WEBRTC and self.frame_ms not in _WEBRTC_FRAME_MS:
            raise ValueError(f"WebRTC frame_ms must be one of {_WEBRTC_FRAME_MS}, got {self.frame_ms}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        for name in ("prefix_padding_ms", "silence_ms", "min_speech_ms", "tail_padding_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.silence_ms < 1:
            raise ValueError("silence_ms must be >= 1")
        if self.tail_padding_ms > self.silence_ms:
            raise ValueError("tail_padding_ms must not exceed silence_ms")
        floor = self.prefix_padding_ms + self.min_speech_ms + self.silence_ms + 1000
        if self.max_utterance_ms < floor:
            raise ValueError(f"max_utterance_ms must be >= {floor} (padding + min speech + silence + 1 s)")
        if self.onnx_threads < 1:
            raise ValueError("onnx_threads must be >= 1")

    @property
    def effective_frame_ms(self) -> int:
        return self.frame_ms if self.engine is VADEngine.WEBRTC else _SILERO_FRAME // _SAMPLES_PER_MS


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    #: Start of the first speech frame of the turn (prefix padding not included).
    start_ms: int
    #: Stream position at which the start was decided (``start_ms`` + about ``min_speech_ms``).
    at_ms: int


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    #: End of the last speech frame of the turn.
    end_ms: int
    #: Stream position at which the end was decided (``end_ms`` + ``silence_ms``, the cap when forced, or the
    #: moment :meth:`TurnDetector.end_turn` was called).
    at_ms: int
    #: Same as the matching :attr:`SpeechStarted.start_ms`.
    start_ms: int
    #: The turn's audio, as :meth:`TurnDetector.utterance` returns it at this moment (a private copy).
    audio: npt.NDArray[np.int16] = field(repr=False, compare=False)
    #: True when the turn hit ``max_utterance_ms`` rather than ending in silence.
    forced: bool = False


TurnEvent = SpeechStarted | SpeechStopped


class _FrameClassifier(Protocol):
    frame_samples: int

    def score(self, frame: npt.NDArray[np.int16]) -> float: ...

    def reset(self) -> None: ...


class _WebRtcClassifier:
    def __init__(self, aggressiveness: int, frame_ms: int) -> None:
        self.frame_samples = frame_ms * _SAMPLES_PER_MS
        self._aggressiveness = aggressiveness
        self._vad = webrtcvad.Vad(aggressiveness)

    def score(self, frame: npt.NDArray[np.int16]) -> float:
        return 1.0 if self._vad.is_speech(frame.tobytes(), _RATE) else 0.0

    def reset(self) -> None:
        # The WebRTC core adapts its noise model and keeps a hangover counter; a fresh instance forgets both.
        self._vad = webrtcvad.Vad(self._aggressiveness)


def silero_model_path() -> Path:
    """The ``silero_vad.onnx`` shipped in the silero-vad wheel, found without importing the package.

    ``import silero_vad`` imports torch and calls ``torch.set_num_threads(1)`` process-wide, which would
    change the thinker's threading; ``find_spec`` on a top-level package only locates it.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero-vad package is not installed; it ships the Silero ONNX model")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise RuntimeError(f"silero_vad.onnx not found at {path}")
    return path


_silero_sessions: dict[int, onnxruntime.InferenceSession] = {}
_silero_lock = threading.Lock()
#: onnxruntime providers for Silero, set once by the engine from ``engine.device`` (see devices.py).
_silero_providers: list[str] = ["CPUExecutionProvider"]


def use_silero_providers(providers: list[str]) -> None:
    """Choose where Silero runs (before the first Silero detector is built)."""
    global _silero_providers
    with _silero_lock:
        _silero_providers = list(providers)
        _silero_sessions.clear()


def _silero_session(threads: int) -> onnxruntime.InferenceSession:
    # One session per process (per thread count): InferenceSession.run is thread-safe and the recurrent
    # state lives in each classifier, so fifty sessions' detectors share one 2 MB model.
    with _silero_lock:
        session = _silero_sessions.get(threads)
        if session is None:
            import onnxruntime  # only the Silero path pays for importing onnxruntime

            opts = onnxruntime.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
            session = onnxruntime.InferenceSession(
                str(silero_model_path()), sess_options=opts, providers=_silero_providers
            )
            _silero_sessions[threads] = session
        return session


class _SileroClassifier:
    frame_samples = _SILERO_FRAME

    def __init__(self, threads: int) -> None:
        self._session = _silero_session(threads)
        # The model input is [context(64) | frame(512)]; the context is the tail of the previous input.
        self._input = np.zeros((1, _SILERO_CONTEXT + _SILERO_FRAME), dtype=np.float32)
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._sr = np.array(_RATE, dtype=np.int64)

    def score(self, frame: npt.NDArray[np.int16]) -> float:
        inp = self._input
        inp[0, :_SILERO_CONTEXT] = inp[0, -_SILERO_CONTEXT:]
        np.multiply(frame, np.float32(1.0 / 32768.0), out=inp[0, _SILERO_CONTEXT:])
        prob, state = self._session.run(None, {"input": inp, "state": self._state, "sr": self._sr})
        self._state = state
        return float(prob[0, 0])

    def reset(self) -> None:
        self._input.fill(0.0)
        self._state = np.zeros((2, 1, 128), dtype=np.float32)


def _make_classifier(settings: VADSettings) -> _FrameClassifier:
    if settings.engine is VADEngine.SILERO:
        return _SileroClassifier(settings.onnx_threads)
    return _WebRtcClassifier(settings.aggressiveness, settings.frame_ms)


class TurnDetector:
    """Streaming VAD + turn state machine for one caller stream.

    A turn starts after ``min_speech_ms`` of consecutive speech frames and ends after ``silence_ms`` of
    non-speech frames. Calls on one instance are serialised by a lock, so the runner may push from one
    thread and read the utterance from another; different instances share nothing mutable.
    """

    def __init__(self, settings: VADSettings | None = None) -> None:
        self._lock = threading.Lock()
        self._settings = settings or VADSettings()
        self._pushed = 0  # samples pushed since creation: the timeline
        self._build()

    # --- configuration ---------------------------------------------------------------------------------

    @property
    def settings(self) -> VADSettings:
        return self._settings

    def update_settings(self, settings: VADSettings) -> None:
        """Apply new settings. Thresholds and durations take effect at the next frame; a change of engine,
        frame length, aggressiveness, thread count or buffer size rebuilds the VAD and resets the turn."""
        with self._lock:
            old = self._settings
            self._settings = settings
            rebuild = (
                old.engine,
                old.aggressiveness,
                old.effective_frame_ms,
                old.onnx_threads,
                old.max_utterance_ms,
            ) != (
                settings.engine,
                settings.aggressiveness,
                settings.effective_frame_ms,
                settings.onnx_threads,
                settings.max_utterance_ms,
            )
            if rebuild:
                self._build()
            else:
                self._recompute_thresholds()

    def _build(self) -> None:
        s = self._settings
        self._classifier = _make_classifier(s)
        self._frame = self._classifier.frame_samples
        # The ring holds a whole number of frames so that a frame is always contiguous in it.
        frames = math.ceil((s.max_utterance_ms * _SAMPLES_PER_MS) / self._frame) + 2
        self._ring = np.zeros(frames * self._frame, dtype=np.int16)
        self._recompute_thresholds()
        self._reset_state()

    def _recompute_thresholds(self) -> None:
        s = self._settings
        self._on_threshold = s.threshold if s.engine is VADEngine.SILERO else 0.5
        self._off_threshold = (
            max(0.01, s.threshold - _SILERO_HYSTERESIS) if s.engine is VADEngine.SILERO else 0.5
        )
        self._pad = s.prefix_padding_ms * _SAMPLES_PER_MS
        self._tail = s.tail_padding_ms * _SAMPLES_PER_MS
        self._silence_end = s.silence_ms * _SAMPLES_PER_MS
        # At least one frame: a turn never starts without a speech frame.
        self._min_speech = max(s.min_speech_ms * _SAMPLES_PER_MS, 1)
        self._max_span = min(s.max_utterance_ms * _SAMPLES_PER_MS, len(self._ring) - self._frame)

    def reset(self) -> None:
        """Forget the current turn, any partial frame and the audio history. The timeline keeps running
        (positions stay comparable with the samples pushed so far); the frame grid restarts here."""
        with self._lock:
            self._reset_state()

    def _reset_state(self) -> None:
        self._classifier.reset()
        self._base = self._pushed  # absolute sample index of ring position 0
        self._fill = 0  # samples of the current, incomplete frame
        self._frame_pos = 0  # ring index where the current frame starts
        self._active = False  # last frame counted as speech (drives Silero's hysteresis)
        self._run_start = -1  # absolute start of the current run of speech frames (candidate turn)
        self._in_speech = False
        self._turn_start = 0  # absolute sample of the turn's first speech frame
        self._last_speech_end = 0  # absolute sample just past the last speech frame
        self._voiced = 0  # speech samples in the current turn
        self._last_utterance: npt.NDArray[np.int16] = np.zeros(0, dtype=np.int16)

    # --- streaming -------------------------------------------------------------------------------------

    def push(self, pcm: npt.NDArray[np.int16]) -> list[TurnEvent]:
        """Feed caller audio (int16 mono at 16 kHz, any length); return the turn events it produced."""
        if not isinstance(pcm, np.ndarray) or pcm.dtype != np.int16:
            raise TypeError("push() takes a numpy int16 array of PCM16 mono samples")
        if pcm.ndim != 1:
            pcm = pcm.reshape(-1)
        events: list[TurnEvent] = []
        with self._lock:
            ring = self._ring
            size = len(ring)
            frame = self._frame
            n = len(pcm)
            off = 0
            while off < n:
                # Copy as much as the ring can take without overwriting the frame being filled, then judge
                # every frame that became complete. The ring is a whole number of frames and the frame grid
                # starts at ring index 0, so a frame never straddles the wrap.
                take = min(n - off, size - frame)
                w = self._frame_pos + self._fill
                first = min(take, size - w)
                ring[w : w + first] = pcm[off : off + first]
                if take > first:
                    ring[: take - first] = pcm[off + first : off + take]
                off += take
                avail = self._fill + take
                cursor = self._pushed - self._fill  # absolute start of the frame being filled
                pos = self._frame_pos
                while avail >= frame:
                    avail -= frame
                    cursor += frame
                    # The state says "frame complete" before _on_frame runs: timeline at the frame's end,
                    # nothing pending, write position past it.
                    self._pushed = cursor
                    self._fill = 0
                    self._frame_pos = (pos + frame) % size
                    self._on_frame(pos, events)
                    pos = self._frame_pos
                self._fill = avail
                self._pushed = cursor + avail
        return events

    def _on_frame(self, pos: int, events: list[TurnEvent]) -> None:
        frame_end = self._pushed  # absolute; the frame is [frame_end - frame, frame_end), at ring[pos:]
        frame_start = frame_end - self._frame
        score = self._classifier.score(self._ring[pos : pos + self._frame])
        speech = score >= (self._off_threshold if self._active else self._on_threshold)
        self._active = speech

        if not self._in_speech:
            if not speech:
                self._run_start = -1
                return
            if self._run_start < 0:
                self._run_start = frame_start
            if frame_end - self._run_start >= self._min_speech:
                self._in_speech = True
                self._turn_start = self._run_start
                self._last_speech_end = frame_end
                self._voiced = frame_end - self._run_start
                self._last_utterance = np.zeros(0, dtype=np.int16)
                events.append(SpeechStarted(start_ms=self._ms(self._turn_start), at_ms=self._ms(frame_end)))
            return

        if speech:
            self._last_speech_end = frame_end
            self._voiced += self._frame
        if frame_end - self._last_speech_end >= self._silence_end:
            self._end_turn(events, frame_end, forced=False)
        elif frame_end + self._frame - max(self._turn_start - self._pad, self._base) > self._max_span:
            # One more frame would make the turn longer than the cap, so it ends here.
            self._last_speech_end = frame_end
            self._end_turn(events, frame_end, forced=True)

    def end_turn(self) -> SpeechStopped | None:
        """End the current turn now, in its silence, as ``silence_ms`` would later (the end-of-turn model found
        the caller finished). None outside a turn or while the last frame was speech."""
        with self._lock:
            now = self._frame_end_pushed()
            if not self._in_speech or now <= self._last_speech_end:
                return None
            events: list[TurnEvent] = []
            self._end_turn(events, now, forced=False)
            stopped = events[0]
            assert isinstance(stopped, SpeechStopped)
            return stopped

    def _end_turn(self, events: list[TurnEvent], now: int, *, forced: bool) -> None:
        audio = self._utterance_locked()
        self._in_speech = False
        self._run_start = -1
        self._voiced = 0
        self._last_utterance = audio
        events.append(
            SpeechStopped(
                end_ms=self._ms(self._last_speech_end),
                at_ms=self._ms(now),
                start_ms=self._ms(self._turn_start),
                audio=audio,
                forced=forced,
            )
        )

    # --- reading ---------------------------------------------------------------------------------------

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def speech_ms(self) -> int:
        """Milliseconds of speech frames in the current turn (0 outside a turn). Silence inside the turn does
        not count, so a click plus the WebRTC hangover stays short even while the endpoint is pending."""
        return self._ms(self._voiced) if self._in_speech else 0

    @property
    def run_ms(self) -> int:
        """Milliseconds of the current run of consecutive speech frames that has not (yet) started a turn: the
        first frames of caller sound, before ``min_speech_ms`` decides it is a turn (0 when the last frame was not
        speech, or inside a turn)."""
        if self._in_speech or self._run_start < 0:
            return 0
        return self._ms(self._frame_end_pushed() - self._run_start)

    @property
    def silence_ms_so_far(self) -> int:
        """Milliseconds since the last speech frame while in a turn (0 outside a turn)."""
        if not self._in_speech:
            return 0
        return self._ms(self._frame_end_pushed() - self._last_speech_end)

    @property
    def speech_end_ms(self) -> int | None:
        """End of the current turn's last speech frame, or None outside a turn."""
        return self._ms(self._last_speech_end) if self._in_speech else None

    @property
    def position_ms(self) -> int:
        """Length of the stream pushed so far."""
        return self._ms(self._pushed)

    @property
    def turn_start_ms(self) -> int | None:
        """Start of the current turn's first speech frame, or None outside a turn."""
        return self._ms(self._turn_start) if self._in_speech else None

    def utterance(self) -> npt.NDArray[np.int16]:
        """Audio of the current turn (a copy): from ``prefix_padding_ms`` before its first speech frame to
        ``tail_padding_ms`` after its last speech frame, or to now if that is earlier. Outside a turn, the
        audio of the last finished turn (what its :class:`SpeechStopped` carried), or an empty array."""
        with self._lock:
            if not self._in_speech:
                return self._last_utterance.copy()
            return self._utterance_locked()

    def _utterance_start(self) -> int:
        # The slot of the frame being filled is being overwritten, so the ring holds one frame less than
        # its size of complete history.
        oldest = self._pushed - self._fill - len(self._ring) + self._frame
        return max(self._turn_start - self._pad, self._base, oldest)

    def _frame_end_pushed(self) -> int:
        # Silence is judged per frame, so a partial frame does not count yet.
        return self._pushed - self._fill

    def _utterance_locked(self) -> npt.NDArray[np.int16]:
        start = self._utterance_start()
        end = min(self._last_speech_end + self._tail, self._frame_end_pushed())
        return self._copy_range(start, end)

    def _copy_range(self, start: int, end: int) -> npt.NDArray[np.int16]:
        """Copy absolute samples [start, end) out of the ring (both must still be held by it)."""
        size = len(self._ring)
        if end <= start:
            return np.zeros(0, dtype=np.int16)
        a = (start - self._base) % size
        b = a + (end - start)
        if b <= size:
            return self._ring[a:b].copy()
        return np.concatenate((self._ring[a:], self._ring[: b - size]))

    @staticmethod
    def _ms(samples: int) -> int:
        return samples_to_ms(samples, _RATE)
