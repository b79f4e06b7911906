"""Test audio: spoken sentences from Piper, noise, bursts, and WAV helpers.

``synthesize_speech("What is the capital of France?")`` gives PCM16 mono at 16 kHz (by default) with silence
or noise around it. Piper's output differs slightly from run to run (VITS samples noise), so the raw voice
output is cached on disk per text: every test run, and every test in a run, hears the same audio, and only
the first run pays for synthesis. The cache lives in ``$LIVEKIT_OMNI_CACHE/test-audio`` or
``~/.cache/livekit-omni/test-audio``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import wave
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import soxr

if TYPE_CHECKING:
    from engine_bridge.speech.tts import PiperSynthesizer

__all__ = [
    "AUDIBLE_DBFS",
    "add_noise",
    "audio_cache_dir",
    "level_dbfs",
    "loud_windows",
    "noise",
    "noise_burst",
    "read_wav",
    "silence",
    "speech_bounds_ms",
    "synthesize_speech",
    "write_wav",
]

# Bump when the way raw speech is produced changes, so old cache entries are not reused.
_CACHE_VERSION = "piper-joe-v5-noiseless"
_lock = threading.Lock()
_piper: PiperSynthesizer | None = None


def audio_cache_dir() -> Path:
    root = os.environ.get("LIVEKIT_OMNI_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "livekit-omni"
    path = base / "test-audio"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_wav(path: str | Path, pcm: npt.NDArray[np.int16], rate: int) -> None:
    """Write PCM16 mono ``pcm`` at ``rate`` as a WAV file (atomically, so parallel test runs never read a
    half-written cache entry)."""
    if pcm.dtype != np.int16:
        raise TypeError("write_wav takes int16 PCM")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f, wave.open(f, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
        # mkstemp creates 0600 files; the cache is shared by every test run on the machine.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_wav(path: str | Path) -> tuple[npt.NDArray[np.int16], int]:
    """Read a PCM16 WAV file; returns (mono int16 samples, rate). Stereo is averaged to mono."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM is supported")
        channels = w.getnchannels()
        rate = w.getframerate()
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    if channels > 1:
        data = data.reshape(-1, channels).mean(axis=1).round().astype(np.int16)
    return data.astype(np.int16), rate


def silence(ms: int, rate: int = 16_000) -> npt.NDArray[np.int16]:
    return np.zeros(ms * rate // 1000, dtype=np.int16)


def noise(ms: int, level_db: float, rate: int = 16_000, seed: int = 0) -> npt.NDArray[np.int16]:
    """White Gaussian noise whose RMS is ``level_db`` dBFS (0 dB = an RMS of 32767, as in :func:`level_dbfs`)."""
    rng = np.random.default_rng(seed)
    rms = 32767.0 * 10 ** (level_db / 20)
    x = rng.standard_normal(ms * rate // 1000) * rms
    return np.clip(x, -32768, 32767).astype(np.int16)


def add_noise(pcm: npt.NDArray[np.int16], level_db: float, seed: int = 0) -> npt.NDArray[np.int16]:
    """``pcm`` with white noise at ``level_db`` dBFS RMS added over its whole length."""
    rng = np.random.default_rng(seed)
    n = rng.standard_normal(len(pcm)) * (32767.0 * 10 ** (level_db / 20))
    return np.clip(pcm.astype(np.float64) + n, -32768, 32767).astype(np.int16)


def noise_burst(ms: int, level_db: float = -12.0, rate: int = 16_000, seed: int = 1) -> npt.NDArray[np.int16]:
    """A cough- or knock-like burst: broadband noise, band-limited to 200-4000 Hz where speech VADs look,
    with a fast attack and exponential decay. Its RMS over the burst is about ``level_db`` dBFS."""
    n = ms * rate // 1000
    rng = np.random.default_rng(seed)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / rate)
    spectrum[(freqs < 200) | (freqs > 4000)] = 0
    x = np.fft.irfft(spectrum, n)
    t = np.arange(n) / rate
    attack = np.minimum(1.0, t / 0.005)
    x *= attack * np.exp(-t / (ms / 1000 / 3))
    x *= 32767.0 * 10 ** (level_db / 20) / max(float(np.sqrt(np.mean(x**2))), 1e-9)
    return np.clip(x, -32768, 32767).astype(np.int16)


def voice_like(seconds: float, rate: int = 48_000) -> npt.NDArray[np.int16]:
    """A harmonic voice-like signal with a moving pitch and syllable envelope (deterministic, no model needed):
    what the codec and resampler tests and the media-plane benchmark feed through."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 12))
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    return (x * env * 6000).astype(np.int16)


def level_dbfs(pcm: npt.NDArray[np.int16]) -> float:
    """RMS level in dBFS (RMS 32767 = 0 dB); -inf for digital silence."""
    if len(pcm) == 0:
        return float("-inf")
    rms = float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))
    return 20 * np.log10(rms / 32767.0) if rms > 0 else float("-inf")


def _piper_raw(text: str) -> tuple[npt.NDArray[np.int16], int]:
    """Piper's output for ``text`` at its native rate, from the disk cache or freshly synthesized."""
    global _piper
    key = hashlib.sha256(f"{_CACHE_VERSION}\0{text}".encode()).hexdigest()[:24]
    path = audio_cache_dir() / f"{key}.wav"
    if path.is_file():
        return read_wav(path)
    with _lock:
        if _piper is None:
            from engine_bridge.speech.tts import PiperSynthesizer

            # Without the noise scales Piper renders a text the same way on every machine and run (its VITS
            # graph draws unseeded noise otherwise, and onnxruntime.set_seed does not reach it), so a test hears
            # the same audio in CI as it did here: with them, whisper tiny.en misheard ~1 rendering in 20 of some
            # texts ("a spider" as "the spider"). The voice keeps its own pace: the recogniser must hear it
            # wherever the utterance starts (engine_bridge/speech/asr.py snaps the start to the speech).
            _piper = PiperSynthesizer(threads=1, noise_scale=0.0, noise_w_scale=0.0)
        synth = _piper
    audio = synth.synthesize_all(text)
    write_wav(path, audio, synth.sample_rate)
    return audio, synth.sample_rate


def synthesize_speech(
    text: str,
    rate: int = 16_000,
    lead_silence_ms: int = 300,
    tail_silence_ms: int = 300,
    noise_db: float | None = None,
    seed: int = 0,
) -> npt.NDArray[np.int16]:
    """``text`` spoken by Piper (en_US joe), PCM16 mono at ``rate``, with ``lead_silence_ms`` before and
    ``tail_silence_ms`` after. With ``noise_db``, white noise at that RMS level (dBFS) is added over the whole
    clip, the speech included. The same samples for given arguments on every machine and run."""
    raw, raw_rate = _piper_raw(text)
    speech = raw if raw_rate == rate else soxr.resample(raw, raw_rate, rate, quality="HQ")
    clip = np.concatenate(
        [silence(lead_silence_ms, rate), speech.astype(np.int16), silence(tail_silence_ms, rate)]
    )
    return clip if noise_db is None else add_noise(clip, noise_db, seed)


#: The level above which a 10 ms window counts as audible, everywhere the project measures speech bounds or the
#: first audible sample of an answer (the benchmarks' voice-to-voice stops there).
AUDIBLE_DBFS = -45.0


def loud_windows(
    pcm: npt.NDArray[np.int16], rate: int = 16_000, floor_db: float = AUDIBLE_DBFS
) -> npt.NDArray[np.intp]:
    """Indices of the whole 10 ms windows of ``pcm`` whose RMS exceeds ``floor_db`` dBFS (RMS 32767 = 0 dB)."""
    win = rate // 100
    n = len(pcm) // win
    frames = pcm[: n * win].astype(np.float64).reshape(n, win)
    rms = np.sqrt(np.mean(frames**2, axis=1))
    return np.nonzero(rms > 32767.0 * 10 ** (floor_db / 20))[0]


def speech_bounds_ms(
    pcm: npt.NDArray[np.int16], rate: int = 16_000, floor_db: float = AUDIBLE_DBFS
) -> tuple[int, int]:
    """First and last millisecond where the 10 ms RMS of a clean clip exceeds ``floor_db``: the ground
    truth that VAD tests compare against, and the caller's last audible sample in the benchmarks."""
    loud = loud_windows(pcm, rate, floor_db)
    if len(loud) == 0:
        raise ValueError("no speech above the floor")
    return int(loud[0] * 10), int((loud[-1] + 1) * 10)
