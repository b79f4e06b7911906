"""media.resample: exact lengths, chunking invariance, response, the soxr fallback and identity; the polyphase
resampler's C core (media._polyphase) and its numpy path against the same cases, and against each other."""

from __future__ import annotations

import numpy as np
import pytest

from media.resample import (
    NATIVE,
    IdentityResampler,
    PolyphaseResampler,
    Resampler,
    SoxrResampler,
    design_lowpass,
)

RATES = [8000, 16000, 24000, 48000]
PAIRS = [(a, b) for a in RATES for b in RATES if a != b]
#: The polyphase resampler's two paths: numpy always, C where the module was built (Linux with a compiler:
#: test_the_c_core_is_built_where_a_compiler_is checks that it was).
PATHS = [pytest.param(False, id="numpy")] + ([pytest.param(True, id="native")] if NATIVE else [])


def _poly(a: int, b: int, native: bool) -> PolyphaseResampler:
    r = PolyphaseResampler(a, b, native=native)
    assert r.native is native
    return r


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


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_any_chunking_gives_identical_output(a: int, b: int, native: bool) -> None:
    x = _noise(a // 5, seed=3)
    whole = _poly(a, b, native).process(x)
    r = _poly(a, b, native)
    rng = np.random.default_rng(7)
    parts, pos = [], 0
    while pos < len(x):
        n = int(rng.integers(0, 500))
        parts.append(r.process(x[pos : pos + n]))
        pos += n
    assert np.array_equal(np.concatenate(parts), whole)
    assert len(whole) == len(x) * b // a


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize(("a", "b"), [(24000, 48000), (48000, 16000), (24000, 16000), (8000, 16000)])
def test_matches_the_direct_fir_formula(a: int, b: int, native: bool) -> None:
    up, down, h = design_lowpass(a, b)
    x = _noise(a // 20, seed=5)
    y = _poly(a, b, native).process(x).astype(np.float64)
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


@pytest.mark.parametrize("native", PATHS)
def test_reset_forgets_history_and_flush_drains(native: bool) -> None:
    r = _poly(24000, 48000, native)
    r.process(_noise(480))
    r.reset()
    assert not r.process(np.zeros(480, np.int16)).any()  # no tail of the earlier audio
    tail = _poly(24000, 48000, native)
    tail.process(np.full(480, 10000, np.int16))
    assert tail.flush().any()
    # A period left pending (48 -> 16 kHz consumes 3 samples at a time) is forgotten by reset, drained by flush.
    down = _poly(48000, 16000, native)
    assert down.process(np.full(2, 20000, np.int16)).shape == (0,)
    drained = down.flush()
    assert drained.shape[0] > 0 and drained.any()
    assert not down.process(np.zeros(960, np.int16)).any()  # flush started a fresh stream


@pytest.mark.skipif(not NATIVE, reason="media._polyphase is not built (no C compiler)")
@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_the_c_core_and_numpy_agree_to_the_last_bit(a: int, b: int) -> None:
    """Same filter and plan: only the order of the float32 additions differs, so at most 1 LSB apart; clipped
    full-scale input clips alike."""
    c, py = _poly(a, b, True), _poly(a, b, False)
    rng = np.random.default_rng(11)
    for i in range(40):
        n = int(rng.integers(0, 2 * a // 50))
        x = _noise(n, seed=100 + i) if i % 5 else np.full(n, 32767 if i % 2 else -32768, np.int16)
        yc, yp = c.process(x), py.process(x)
        assert yc.dtype == np.int16 and yc.shape == yp.shape
        assert np.abs(yc.astype(np.int32) - yp.astype(np.int32)).max(initial=0) <= 1
    assert np.abs(c.flush().astype(np.int32) - py.flush().astype(np.int32)).max(initial=0) <= 1


@pytest.mark.parametrize("native", PATHS)
def test_a_strided_view_resamples_like_its_copy(native: bool) -> None:
    """One channel of interleaved stereo is a strided view; the C core reads contiguous buffers only."""
    stereo = _noise(2 * 960, seed=9)
    left = stereo[::2]
    assert not left.flags.c_contiguous
    assert np.array_equal(
        _poly(48000, 16000, native).process(left), _poly(48000, 16000, native).process(left.copy())
    )


def test_the_c_core_is_built_where_a_compiler_is() -> None:
    """The install compiles media._polyphase (optional, like the ring core): with gcc on Linux it must be there,
    or the plugin's co-located frame silently pays the numpy path."""
    import shutil
    import sys

    if sys.platform == "linux" and shutil.which("gcc"):
        assert NATIVE
    assert Resampler.for_rates(48000, 16000).native is NATIVE  # type: ignore[attr-defined]


@pytest.mark.parametrize("native", PATHS)
def test_rejects_bad_input(native: bool) -> None:
    with pytest.raises(TypeError):
        _poly(16000, 48000, native).process(np.zeros(10, np.float32))
    with pytest.raises(TypeError):
        _poly(16000, 48000, native).process(np.zeros((2, 10), np.int16))
    with pytest.raises(ValueError):
        Resampler.for_rates(0, 16000)
