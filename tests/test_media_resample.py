"""media.resample: exact lengths, chunking invariance, response, the soxr fallback and identity."""

from __future__ import annotations

import numpy as np
import pytest

from media.resample import (
    IdentityResampler,
    PolyphaseResampler,
    Resampler,
    SoxrResampler,
    design_lowpass,
)

RATES = [8000, 16000, 24000, 48000]
PAIRS = [(a, b) for a in RATES for b in RATES if a != b]


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 4000).astype(np.int16)


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_twenty_ms_frames_give_exact_twenty_ms_out(a: int, b: int) -> None:
    r = Resampler.for_rates(a, b)
    assert isinstance(r, PolyphaseResampler)
    x = _noise(a // 50 * 25)
    for i in range(25):
        y = r.process(x[i * a // 50 : (i + 1) * a // 50])
        assert y.dtype == np.int16 and y.shape == (b // 50,)
    assert r.delay_ms < 3.0


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_any_chunking_gives_identical_output(a: int, b: int) -> None:
    x = _noise(a // 5, seed=3)
    whole = Resampler.for_rates(a, b).process(x)
    r = Resampler.for_rates(a, b)
    rng = np.random.default_rng(7)
    parts, pos = [], 0
    while pos < len(x):
        n = int(rng.integers(0, 500))
        parts.append(r.process(x[pos : pos + n]))
        pos += n
    assert np.array_equal(np.concatenate(parts), whole)
    assert len(whole) == len(x) * b // a


@pytest.mark.parametrize(("a", "b"), [(24000, 48000), (48000, 16000), (24000, 16000), (8000, 16000)])
def test_matches_the_direct_fir_formula(a: int, b: int) -> None:
    up, down, h = design_lowpass(a, b)
    x = _noise(a // 20, seed=5)
    y = Resampler.for_rates(a, b).process(x).astype(np.float64)
    # y[j] = sum_n h[j*M - n*L] x[n]
    xf = x.astype(np.float64)
    for j in range(0, len(y), 37):
        n = np.arange(len(x))
        k = j * down - n * up
        ok = (k >= 0) & (k < len(h))
        assert abs(np.sum(h[k[ok]] * xf[n[ok]]) - y[j]) <= 1.0


def _tone_gain_db(a: int, b: int, freq: float) -> float:
    t = np.arange(a) / a
    x = (12000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)
    y = Resampler.for_rates(a, b).process(x).astype(np.float64)[b // 10 :]
    return 20 * np.log10(np.sqrt(2) * y.std() / 12000 + 1e-12)


@pytest.mark.parametrize(("a", "b"), [(48000, 16000), (24000, 16000), (24000, 8000), (48000, 8000)])
def test_downsampling_passes_speech_band_and_rejects_aliases(a: int, b: int) -> None:
    assert abs(_tone_gain_db(a, b, 0.40 * b)) < 0.1  # 6.4 kHz at 16 kHz out
    assert _tone_gain_db(a, b, 0.56 * b) < -60  # would alias into the passband


def test_upsampling_rejects_images() -> None:
    a, b, f = 24000, 48000, 10_000.0
    t = np.arange(a) / a
    x = (12000 * np.sin(2 * np.pi * f * t)).astype(np.int16)
    y = Resampler.for_rates(a, b).process(x).astype(np.float64)[4800:]
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    freqs = np.fft.rfftfreq(len(y), 1 / b)
    wanted = spec[np.argmin(np.abs(freqs - f))]
    image = spec[np.argmin(np.abs(freqs - (a - f)))]  # 14 kHz mirror
    assert 20 * np.log10(image / wanted) < -60


def test_identity_and_soxr_fallback() -> None:
    ident = Resampler.for_rates(16000, 16000)
    assert isinstance(ident, IdentityResampler)
    x = _noise(320)
    assert ident.process(x) is x
    odd = Resampler.for_rates(44100, 16000)
    assert isinstance(odd, SoxrResampler)
    total = sum(odd.process(_noise(882, seed=i)).shape[0] for i in range(100)) + odd.flush().shape[0]
    assert abs(total - 100 * 320) <= 2
    assert isinstance(Resampler.for_rates(24000, 48000, low_latency=False), SoxrResampler)


def test_reset_forgets_history_and_flush_drains() -> None:
    r = Resampler.for_rates(24000, 48000)
    r.process(_noise(480))
    r.reset()
    assert not r.process(np.zeros(480, np.int16)).any()  # no tail of the earlier audio
    tail = Resampler.for_rates(24000, 48000)
    tail.process(np.full(480, 10000, np.int16))
    assert tail.flush().any()


def test_rejects_bad_input() -> None:
    with pytest.raises(TypeError):
        Resampler.for_rates(16000, 48000).process(np.zeros(10, np.float32))
    with pytest.raises(ValueError):
        Resampler.for_rates(0, 16000)
