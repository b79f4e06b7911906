"""Streaming int16 resamplers for the media plane.

``Resampler.for_rates(a, b)`` picks one:

* equal rates: :class:`IdentityResampler` (returns its input; no copy);
* rates in a small integer ratio (every pair of 8/16/24/32/48 kHz): :class:`PolyphaseResampler`, a Kaiser-windowed
  sinc FIR in numpy, about 1 ms of delay and *exactly* ``n * L / M`` samples out for ``n`` in;
* anything else (22.05/44.1 kHz…): :class:`SoxrResampler`, a thin wrapper over ``soxr.ResampleStream`` (HQ).

Why not soxr for everything (docs/speech-stack.md, Codecs and resampling): fed 20 ms chunks, ``soxr.ResampleStream``
returns its output in bursts, not per chunk. Measured here (soxr 1.1.0, HQ, int16): 24→48 kHz returns
0 or 1660 samples per 480-sample chunk and reports ``delay()`` 1100 samples (23 ms); 48→16 kHz 0/489/490 per
960-sample chunk, delay 24 ms; 8→16 kHz returns 1660 samples every fifth chunk (100 ms bursts, 57 ms delay). A 20 ms
output clock then needs another burst of buffering on top, so soxr would put ~25–60 ms into *each* direction of
every turn and of every barge-in (docs/architecture.md, Budgets, leaves ~50 ms of the barge-in budget once the 200 ms minimum
barge-in speech is counted). ``LQ`` is smoother but its passband ends at 0.8 of Nyquist; ``QQ`` does not filter
aliases at all. The polyphase FIR below costs 10–40 µs per 20 ms frame (soxr: 6–14 µs), well inside the 0.2 ms
budget, passes 0–0.45·min(rate) flat and rejects aliases by ≥ 70 dB.

The polyphase path's per-call work runs in C (``media._polyphase``, built at install; ``NATIVE`` says whether it
was) and in numpy otherwise, with the same filter and plan. The numpy path computes each phase's convolution over
the whole input and keeps every ``M``-th output; the C one computes only the outputs it returns, in one call:
for the co-located LiveKit plugin's 48→16 kHz caller frame that was the largest cost per frame
(benchmarks/plugin_paths.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Final

import numpy as np
import soxr

try:  # the per-call FIR work in C; optional (see media/_polyphase.c and pyproject.toml)
    import media._polyphase as _polyphase
except ImportError:  # pragma: no cover - a build without a C compiler
    _polyphase = None  # type: ignore[assignment]  # a module or None; NATIVE says which

#: True when PolyphaseResampler.process runs in C (media._polyphase); False on the numpy path.
NATIVE: Final = _polyphase is not None
#: Largest numerator/denominator of a rate ratio handled by the polyphase path (48k↔8k is 6).
MAX_POLYPHASE_FACTOR: Final = 12


class Resampler(ABC):
    """A stateful mono int16 resampler; feed consecutive chunks of one stream of any length."""

    in_rate: int
    out_rate: int

    @staticmethod
    def for_rates(in_rate: int, out_rate: int, *, low_latency: bool = True) -> Resampler:
        """The resampler for ``in_rate → out_rate``: identity when equal, polyphase for small integer ratios
        (unless ``low_latency`` is False), soxr HQ otherwise."""
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} → {out_rate}")
        if in_rate == out_rate:
            return IdentityResampler(in_rate)
        g = math.gcd(in_rate, out_rate)
        if low_latency and max(in_rate // g, out_rate // g) <= MAX_POLYPHASE_FACTOR:
            return PolyphaseResampler(in_rate, out_rate)
        return SoxrResampler(in_rate, out_rate)

    @abstractmethod
    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Resample the next chunk (1-D int16). May return fewer or more samples than the exact ratio; the sum
        over a stream follows the ratio up to the resampler's delay."""

    @abstractmethod
    def flush(self) -> np.ndarray:
        """End of stream: return what the filter still holds and start a fresh stream."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all history (e.g. after an epoch flush, so no stale sample leaks into new audio)."""

    @property
    @abstractmethod
    def delay_ms(self) -> float:
        """Algorithmic delay from input to output."""

    def out_samples(self, in_samples: int) -> int:
        """Nominal output length for ``in_samples`` of input."""
        return in_samples * self.out_rate // self.in_rate


def _check_pcm(pcm: np.ndarray) -> None:
    if pcm.dtype != np.int16 or pcm.ndim != 1:
        raise TypeError("resampler input must be a 1-D int16 array")


class IdentityResampler(Resampler):
    def __init__(self, rate: int) -> None:
        self.in_rate = self.out_rate = rate

    def process(self, pcm: np.ndarray) -> np.ndarray:
        _check_pcm(pcm)
        return pcm

    def flush(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int16)

    def reset(self) -> None:
        return None

    @property
    def delay_ms(self) -> float:
        return 0.0


def design_lowpass(
    in_rate: int, out_rate: int, *, attenuation_db: float = 70.0
) -> tuple[int, int, np.ndarray]:
    """Kaiser-windowed sinc prototype for an ``L/M`` polyphase resampler: returns ``(L, M, h)`` with ``h`` at the
    rate ``in_rate * L``, length a multiple of ``L``, DC gain ``L``. Passband edge 0.45·min(rate), stopband edge
    0.55·min(rate): aliases that land in the passband are attenuated by ``attenuation_db``."""
    g = math.gcd(in_rate, out_rate)
    up, down = out_rate // g, in_rate // g
    high = in_rate * up
    low = min(in_rate, out_rate)
    width = 0.1 * low / high  # transition width in cycles per high-rate sample
    n = math.ceil((attenuation_db - 7.95) / (14.36 * width)) + 1
    n = -(-n // up) * up
    beta = 0.1102 * (attenuation_db - 8.7)
    t = np.arange(n) - (n - 1) / 2
    fc = 0.5 * low / high
    h = 2 * fc * np.sinc(2 * fc * t) * np.kaiser(n, beta)
    h *= up / h.sum()
    return up, down, h


class PolyphaseResampler(Resampler):
    """Rational ``L/M`` FIR resampler, streaming, float32 inside.

    Output sample ``j`` is ``y[j] = Σ_n h[jM − nL] · x[n]``. Input is consumed in whole periods of ``M`` samples
    (``L`` outputs each); a remainder below ``M`` waits for the next call, so any chunking of the same stream gives
    bit-identical output. Per call the work is one C call computing ``n_out × taps`` multiply-adds (``native``,
    the default when built), or ``L`` numpy convolutions (``n_in × taps`` multiply-adds in all).
    """

    def __init__(
        self, in_rate: int, out_rate: int, *, attenuation_db: float = 70.0, native: bool = NATIVE
    ) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        up, down, h = design_lowpass(in_rate, out_rate, attenuation_db=attenuation_db)
        self.up, self.down = up, down
        self.taps = h.shape[0] // up  # taps per phase
        phases = h.reshape(-1, up).T  # phases[p, k] = h[p + k * up]
        # For output residue r (j ≡ r mod L): filter phase (r·M) mod L, input offset ⌊r·M / L⌋.
        self._plan = [
            (np.ascontiguousarray(phases[(r * down) % up], dtype=np.float32), (r * down) // up)
            for r in range(up)
        ]
        self._delay_ms = (h.shape[0] - 1) / 2 / (in_rate * up) * 1000
        self._hist = np.zeros(self.taps - 1, dtype=np.float32)
        self._pending = np.zeros(down, dtype=np.int16)
        self._npending = 0
        self._xe = np.zeros(self.taps - 1 + 4096, dtype=np.float32)
        self._y = np.zeros(4096, dtype=np.float32)
        self._core: _polyphase.PolyphaseCore | None = None
        if native:
            if _polyphase is None:
                raise RuntimeError("the native resampler core (media._polyphase) is not built")
            # Residue r's phase filter reversed (the convolution becomes a dot product over consecutive input).
            bank = np.concatenate([g[::-1] for g, _ in self._plan]).astype(np.float32)
            self._core = _polyphase.PolyphaseCore(bank, [q for _, q in self._plan], up, down)

    @property
    def native(self) -> bool:
        """Whether this resampler's work runs in C."""
        return self._core is not None

    @property
    def delay_ms(self) -> float:
        return self._delay_ms

    def process(self, pcm: np.ndarray) -> np.ndarray:
        _check_pcm(pcm)
        core = self._core
        if core is not None:
            if not pcm.flags.c_contiguous:
                # The C core reads one contiguous buffer; a channel of interleaved stereo is a strided view.
                pcm = np.ascontiguousarray(pcm)
            out = np.empty(core.out_samples(pcm.shape[0]), dtype=np.int16)
            core.process(pcm, out)
            return out
        up, down, k1 = self.up, self.down, self.taps - 1
        total = self._npending + pcm.shape[0]
        periods = total // down
        used = periods * down
        if periods == 0:
            self._pending[self._npending : total] = pcm
            self._npending = total
            return np.zeros(0, dtype=np.int16)
        if self._xe.shape[0] < k1 + used:
            self._xe = np.zeros(k1 + used, dtype=np.float32)
        xe = self._xe[: k1 + used]
        xe[:k1] = self._hist
        np_ = self._npending
        xe[k1 : k1 + np_] = self._pending[:np_]
        take = used - np_
        xe[k1 + np_ : k1 + used] = pcm[:take]
        rest = pcm.shape[0] - take
        self._pending[:rest] = pcm[take:]
        self._npending = rest
        self._hist[:] = xe[used : used + k1]

        n_out = periods * up
        if self._y.shape[0] < n_out:
            self._y = np.zeros(n_out, dtype=np.float32)
        y = self._y[:n_out]
        for r, (g, q) in enumerate(self._plan):
            c = np.convolve(xe, g, "valid")
            y[r::up] = c[q::down] if down > 1 else c
        np.rint(y, out=y)
        np.clip(y, -32768, 32767, out=y)
        return y.astype(np.int16)

    def flush(self) -> np.ndarray:
        pending = self._core.pending if self._core is not None else self._npending
        pad = -(-(self.taps + pending) // self.down) * self.down - pending
        out = self.process(np.zeros(pad, dtype=np.int16))
        self.reset()
        return out

    def reset(self) -> None:
        self._hist[:] = 0
        self._npending = 0
        if self._core is not None:
            self._core.reset()


class SoxrResampler(Resampler):
    """``soxr.ResampleStream`` (HQ), for rate pairs without a small integer ratio. Bursty at 20 ms chunks (see the
    module docstring): callers that need exact frames must buffer its output."""

    def __init__(self, in_rate: int, out_rate: int, *, quality: str = "HQ") -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._quality = quality
        self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16", quality=quality)

    @property
    def delay_ms(self) -> float:
        return float(self._stream.delay()) / self.out_rate * 1000

    def process(self, pcm: np.ndarray) -> np.ndarray:
        _check_pcm(pcm)
        return self._stream.resample_chunk(pcm)

    def flush(self) -> np.ndarray:
        out = self._stream.resample_chunk(np.zeros(0, dtype=np.int16), last=True)
        self._stream = soxr.ResampleStream(
            self.in_rate, self.out_rate, 1, dtype="int16", quality=self._quality
        )
        return out

    def reset(self) -> None:
        self._stream.clear()
