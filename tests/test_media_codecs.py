"""media.codecs: G.711 against the ITU-T G.191 reference and FFmpeg, PCM16 helpers, and the Opus pair."""

from __future__ import annotations

import av
import numpy as np
import pytest

from media.codecs import (
    ALAW_DECODE,
    ALAW_ENCODE,
    ULAW_DECODE,
    ULAW_ENCODE,
    AudioEncoding,
    OpusDecoder,
    OpusEncoder,
    alaw_decode,
    alaw_encode,
    downmix_interleaved,
    float_to_pcm16,
    parse_encoding,
    pcm16_from_bytes,
    rms_dbfs,
    ulaw_decode,
    ulaw_encode,
)
from tests.speech_fixtures import voice_like

ALL_PCM = np.arange(-32768, 32768, dtype=np.int16)


# Scalar transcriptions of ITU-T G.191 STL g711.c (ulaw_compress / ulaw_expand / alaw_compress / alaw_expand), kept
# deliberately literal so the vectorised tables are checked against the reference's own control flow.
def ref_ulaw_compress(x: int) -> int:
    absno = ((~x) >> 2) + 33 if x < 0 else (x >> 2) + 33
    absno = min(absno, 0x1FFF)
    i = absno >> 6
    segno = 1
    while i != 0:
        segno += 1
        i >>= 1
    high = 0x8 - segno
    low = 0xF - ((absno >> segno) & 0xF)
    out = (high << 4) | low
    if x >= 0:
        out |= 0x80
    return out


def ref_ulaw_expand(code: int) -> int:
    sign = -1 if code < 0x80 else 1
    mant = ~code
    exponent = (mant >> 4) & 0x7
    segment = exponent + 1
    mant &= 0xF
    step = 4 << segment
    return sign * ((0x80 << exponent) + step * mant + step // 2 - 4 * 33)


def ref_alaw_compress(x: int) -> int:
    ix = (~x) >> 4 if x < 0 else x >> 4
    if ix > 15:
        iexp = 1
        while ix > 16 + 15:
            ix >>= 1
            iexp += 1
        ix -= 16
        ix += iexp << 4
    if x >= 0:
        ix |= 0x80
    return ix ^ 0x55


def ref_alaw_expand(code: int) -> int:
    ix = (code ^ 0x55) & 0x7F
    iexp = ix >> 4
    mant = ix & 0xF
    if iexp > 0:
        mant += 16
    mant = (mant << 4) + 0x8
    if iexp > 1:
        mant <<= iexp - 1
    return mant if code > 127 else -mant


def test_ulaw_tables_match_the_itu_reference_for_every_input() -> None:
    enc = ulaw_encode(ALL_PCM)
    assert [ref_ulaw_compress(int(x)) for x in ALL_PCM] == enc.tolist()
    assert [ref_ulaw_expand(c) for c in range(256)] == ULAW_DECODE.tolist()


def test_alaw_tables_match_the_itu_reference_for_every_input() -> None:
    enc = alaw_encode(ALL_PCM)
    assert [ref_alaw_compress(int(x)) for x in ALL_PCM] == enc.tolist()
    assert [ref_alaw_expand(c) for c in range(256)] == ALAW_DECODE.tolist()


def test_g711_known_values() -> None:
    # Silence, the positive/negative zero codes and the full-scale codes every G.711 implementation agrees on.
    assert ULAW_ENCODE[0] == 0xFF and ulaw_encode(np.array([-1], np.int16))[0] == 0x7F
    assert ULAW_DECODE[0xFF] == 0 and ULAW_DECODE[0x7F] == 0
    assert ULAW_DECODE[0x80] == 32124 and ULAW_DECODE[0x00] == -32124
    assert ulaw_encode(np.array([32767, -32768], np.int16)).tolist() == [0x80, 0x00]
    assert ALAW_ENCODE[0] == 0xD5 and alaw_encode(np.array([-1], np.int16))[0] == 0x55
    assert ALAW_DECODE[0xD5] == 8 and ALAW_DECODE[0x55] == -8
    assert ALAW_DECODE[0xAA] == 32256 and ALAW_DECODE[0x2A] == -32256
    assert alaw_encode(np.array([32767, -32768], np.int16)).tolist() == [0xAA, 0x2A]


def _ffmpeg(codec: str, pcm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    enc = av.CodecContext.create(codec, "w")
    enc.sample_rate, enc.layout, enc.format = 8000, "mono", "s16"
    enc.open()
    frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
    frame.sample_rate = 8000
    frame.pts = 0
    codes = np.frombuffer(b"".join(bytes(p) for p in enc.encode(frame)), dtype=np.uint8)
    dec = av.CodecContext.create(codec, "r")
    dec.sample_rate, dec.layout, dec.format = 8000, "mono", "s16"
    decoded = np.concatenate(
        [f.to_ndarray().reshape(-1) for f in dec.decode(av.Packet(np.arange(256, dtype=np.uint8).tobytes()))]
    )
    return codes, decoded


@pytest.mark.parametrize(
    ("codec", "encode", "table"),
    [("pcm_mulaw", ulaw_encode, ULAW_DECODE), ("pcm_alaw", alaw_encode, ALAW_DECODE)],
)
def test_g711_agrees_with_ffmpeg(codec: str, encode, table: np.ndarray) -> None:
    codes, decoded = _ffmpeg(codec, ALL_PCM)
    assert np.array_equal(decoded, table)  # an independent decoder: identical for all 256 codes
    ours = encode(ALL_PCM)
    d = codes != ours
    # FFmpeg encodes to the nearest reconstruction level; G.711 (and its reference) use the standard's decision
    # levels, which are not midpoints at segment edges, and the one's complement for negative samples. So the
    # encoders may differ only near a decision level, by one level, with the input between the two levels.
    assert d.sum() < 0.02 * len(ALL_PCM)
    levels = np.unique(table)
    step = np.abs(np.searchsorted(levels, table[codes[d]]) - np.searchsorted(levels, table[ours[d]]))
    assert (step == 1).all()  # neighbouring reconstruction levels
    x = ALL_PCM[d].astype(int)
    lo = np.minimum(table[codes[d]], table[ours[d]]).astype(int)
    hi = np.maximum(table[codes[d]], table[ours[d]]).astype(int)
    assert ((lo <= x) & (x <= hi)).all()


@pytest.mark.parametrize(("encode", "decode"), [(ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)])
def test_g711_round_trip_error_is_within_half_a_step(encode, decode) -> None:
    back = decode(encode(ALL_PCM)).astype(np.int32)
    err = np.abs(back - ALL_PCM.astype(np.int32))
    # The largest quantisation step is 1024 (µ-law) / 1024 (A-law) near full scale; half of it plus clipping.
    assert err.max() <= 1024
    small = np.abs(ALL_PCM.astype(np.int32)) < 64
    assert err[small].max() <= 16


def test_g711_out_buffers_and_bytes_input() -> None:
    pcm = (np.sin(np.arange(160) / 5) * 12000).astype(np.int16)
    out = np.zeros(400, dtype=np.uint8)
    codes = ulaw_encode(pcm, out=out)
    assert codes.base is out or codes is out or np.shares_memory(codes, out)
    assert np.array_equal(ulaw_decode(codes.tobytes()), ulaw_decode(codes))
    dec_out = np.zeros(160, dtype=np.int16)
    assert np.shares_memory(alaw_decode(alaw_encode(pcm), out=dec_out), dec_out)
    with pytest.raises(TypeError):
        ulaw_encode(pcm.astype(np.int32))


def test_pcm16_helpers() -> None:
    assert pcm16_from_bytes(b"\x01\x00\xff\xff").tolist() == [1, -1]
    with pytest.raises(ValueError, match="even"):
        pcm16_from_bytes(b"\x00\x01\x02")
    assert float_to_pcm16(np.array([0.0, 1.0, -1.0, 2.0, 0.5], np.float32)).tolist() == [
        0,
        32767,
        -32768,
        32767,
        16384,
    ]
    st = np.array([100, 300, -5, -6, 32767, 32767], np.int16)
    assert downmix_interleaved(st, 2).tolist() == [200, -6, 32767]
    assert rms_dbfs(np.zeros(10, np.int16)) == -120.0
    assert abs(rms_dbfs(np.full(100, 16384, np.int16)) - (-6.02)) < 0.01


def test_parse_encoding_aliases() -> None:
    assert parse_encoding("g711_ulaw") is AudioEncoding.PCMU
    assert parse_encoding("audio/pcma") is AudioEncoding.PCMA
    assert parse_encoding("audio/pcm") is AudioEncoding.PCM16
    assert parse_encoding(AudioEncoding.PCM16) is AudioEncoding.PCM16
    with pytest.raises(ValueError, match="unsupported"):
        parse_encoding("mp3")


def _align_ncc(ref: np.ndarray, out: np.ndarray, max_lag: int = 2000) -> tuple[float, int]:
    a = ref.astype(np.float64)
    b = out.astype(np.float64)
    best, best_lag = -1.0, 0
    seg = a[max_lag : len(a) - max_lag]
    for lag in range(0, max_lag):
        c = b[max_lag + lag : max_lag + lag + len(seg)]
        if len(c) < len(seg):
            break
        ncc = float(np.dot(seg, c) / (np.linalg.norm(seg) * np.linalg.norm(c) + 1e-9))
        if ncc > best:
            best, best_lag = ncc, lag
    return best, best_lag


def test_opus_round_trip_mono() -> None:
    src = voice_like(2.0)
    enc, dec = OpusEncoder(), OpusDecoder()
    packets = []
    for i in range(0, len(src), 777):  # odd chunking: the encoder frames it into 20 ms itself
        packets += enc.encode(src[i : i + 777])
    assert len(packets) == len(src) // 960
    kbps = sum(len(p) for p in packets) * 8 / 2.0 / 1000
    assert 24 < kbps < 36, kbps
    out = np.concatenate([dec.decode(p) for p in packets])
    assert out.dtype == np.int16 and out.shape == (len(packets) * 960,)
    ncc, lag = _align_ncc(src[: len(out)], out, max_lag=1200)
    # Opus is perceptual, not waveform-exact: measured here NCC 0.88, SNR 6.3 dB, envelope correlation 0.98 on
    # this signal at 32 kbps. The lag is libopus's lookahead (6.5 ms = 312 samples).
    assert ncc > 0.8, (ncc, lag)
    assert 250 <= lag <= 360, lag
    a = src[: len(out) - lag].astype(np.float64)
    b = out[lag:].astype(np.float64)
    snr = 10 * np.log10(np.sum(a**2) / np.sum((a - b) ** 2))
    assert snr > 4, snr
    env_a = np.sqrt(np.convolve(a**2, np.ones(480) / 480, "valid")[::480])
    env_b = np.sqrt(np.convolve(b**2, np.ones(480) / 480, "valid")[::480])
    assert np.corrcoef(env_a, env_b)[0, 1] > 0.95


def test_opus_decoder_takes_an_empty_packet_as_lost_and_keeps_decoding() -> None:
    # PyAV treats an empty packet as end of stream; passed on, libopus would refuse every later packet.
    enc, dec = OpusEncoder(), OpusDecoder()
    packets = enc.encode(voice_like(0.1))
    assert dec.decode(packets[0]).shape == (960,)
    assert dec.decode(b"").shape == (0,)
    assert dec.decode(packets[1]).shape == (960,)


def test_opus_stereo_input_to_mono_encoder_and_stereo_decoder() -> None:
    mono = voice_like(1.0)
    stereo = np.stack([mono, mono], axis=1)
    enc = OpusEncoder(channels=1)
    packets = enc.encode(stereo)
    assert len(packets) == 50
    dec2 = OpusDecoder(channels=2)
    out = np.concatenate([dec2.decode(p) for p in packets])
    assert out.shape == (50 * 960, 2)
    ncc, _ = _align_ncc(mono[: len(out)], out[:, 0], max_lag=1200)
    assert ncc > 0.8
    enc2 = OpusEncoder(channels=2, bitrate=64_000)
    assert len(enc2.encode(mono)) == 50  # mono into a stereo encoder is duplicated


def test_opus_packets_carry_pts() -> None:
    enc = OpusEncoder()
    pkts = enc.encode_packets(np.zeros(960 * 3, np.int16))
    assert len(pkts) == 3
    assert all(p.time_base is not None for p in pkts)
