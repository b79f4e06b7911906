"""media.ingress: every input format lands in the ingress ring as PCM16 mono 16 kHz; overruns are counted."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import av
import numpy as np
import pytest

from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE
from engine_bridge.ring import RingPair
from media.codecs import alaw_encode, ulaw_encode
from media.ingress import IngressWriter, frame_to_mono_pcm16


@dataclass
class FakeSession:
    rings: RingPair
    closed: bool = False


@pytest.fixture
def session() -> Iterator[FakeSession]:
    rings = RingPair.create(input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE, ingress_seconds=2.0)
    yield FakeSession(rings)
    rings.close()


def _drain(s: FakeSession) -> np.ndarray:
    out = np.zeros(s.rings.ingress.capacity_samples, dtype=np.int16)
    n = s.rings.ingress.read_into(out)
    return out[:n].copy()


def test_pcm16_16k_is_bit_exact_in_the_ring(session: FakeSession) -> None:
    w = IngressWriter(session)
    x = (np.random.default_rng(0).standard_normal(16000) * 8000).astype(np.int16)
    # bytes in uneven pieces (even byte counts), as a WebSocket client would send them
    data = x.astype("<i2").tobytes()
    pos = 0
    for n in (2, 640, 1000, 6, 31000 - 1648):
        w.write(data[pos : pos + n])
        pos += n
    w.write(data[pos:])
    assert np.array_equal(_drain(session), x)
    assert w.samples_written == 16000 and w.overruns == 0


def test_odd_byte_count_is_an_error_and_writes_nothing(session: FakeSession) -> None:
    w = IngressWriter(session)
    with pytest.raises(ValueError, match="even"):
        w.write(b"\x00\x01\x02")
    assert session.rings.ingress.available() == 0


@pytest.mark.parametrize("rate", [8000, 24000, 48000])
def test_pcm16_other_rates_are_resampled(session: FakeSession, rate: int) -> None:
    w = IngressWriter(session, rate=rate)
    t = np.arange(rate // 2) / rate
    x = (8000 * np.sin(2 * np.pi * 500 * t)).astype(np.int16)
    for i in range(0, len(x), rate // 50):
        w.write(x[i : i + rate // 50].tobytes())
    got = _drain(session)
    assert len(got) == 8000  # 0.5 s at 16 kHz, exactly
    spec = np.abs(np.fft.rfft(got[800:].astype(float)))
    assert abs(np.fft.rfftfreq(len(got) - 800, 1 / 16000)[spec.argmax()] - 500) < 5


@pytest.mark.parametrize(("encoding", "encode"), [("g711_ulaw", ulaw_encode), ("audio/pcma", alaw_encode)])
def test_g711_input(session: FakeSession, encoding: str, encode) -> None:
    w = IngressWriter(session, encoding=encoding, rate=8000)
    t = np.arange(8000) / 8000
    x = (8000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16)
    w.write(encode(x).tobytes())
    got = _drain(session)
    assert len(got) == 16000
    assert 7000 < np.abs(got[400:]).max() < 9000
    with pytest.raises(ValueError):
        w.set_format("pcmu", 16000)


def test_aiortc_style_frames_are_downmixed_and_resampled(session: FakeSession) -> None:
    w = IngressWriter(session)
    t = np.arange(960 * 25) / 48000
    left = (6000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    right = np.zeros_like(left)
    inter = np.stack([left, right], axis=1).reshape(-1)
    for i in range(25):
        f = av.AudioFrame.from_ndarray(inter[None, i * 1920 : (i + 1) * 1920], format="s16", layout="stereo")
        f.sample_rate = 48000
        w.write_frame(f)
    got = _drain(session)
    assert len(got) == 320 * 25
    assert 2700 < np.abs(got[200:]).max() < 3300  # the mean of a tone and silence: half amplitude
    assert w.frames_in == 25
    assert -25 < w.last_level_dbfs < -10


def test_interleaved_pcm_is_averaged(session: FakeSession) -> None:
    w = IngressWriter(session)
    stereo = np.array([100, 300] * 320, np.int16)
    assert w.write_pcm16(stereo, 16000, channels=2) == 320
    assert (_drain(session) == 200).all()
    with pytest.raises(ValueError):
        w.write_pcm16(stereo[:5], 16000, channels=2)


def test_planar_float_frames() -> None:
    x = np.stack([np.full(480, 0.5, np.float32), np.full(480, -0.5, np.float32) + 1.0])
    f = av.AudioFrame.from_ndarray(x, format="fltp", layout="stereo")
    f.sample_rate = 24000
    assert frame_to_mono_pcm16(f).tolist() == [16384] * 480


def test_overrun_drops_and_counts(session: FakeSession) -> None:
    w = IngressWriter(session)
    cap = session.rings.ingress.capacity_samples
    x = np.ones(cap + 640, dtype=np.int16)
    assert w.write(x) == cap
    assert w.overruns == 2 and w.samples_dropped == 640
    assert session.rings.ingress.overruns == 2


def test_closed_session_is_never_written(session: FakeSession) -> None:
    w = IngressWriter(session)
    session.closed = True
    assert w.write(np.ones(320, np.int16)) == 0
    session.closed = False
    w.close()
    assert w.write(np.ones(320, np.int16)) == 0
    assert session.rings.ingress.available() == 0
